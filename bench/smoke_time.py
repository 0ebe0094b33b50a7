"""Wall time of `kchain smoke` for each example job, split by stage, next to its floor, in one run.

    python bench/smoke_time.py            # target: tinygpt smoke <= 1.3 x the floor, at 1 and 2 ranks

The floor is what the smoke's design cannot go below on this machine, measured here, in this run:
the killed run and the reference start side by side, and the resume starts when the killed run is
dead, each a notebook run by `python -m kchain.local` whose one cell starts a Python child that
imports torch (the training child's start) and does nothing else; the child exits the way the
runtime's training child does (one collection, then the rest frozen: runtime/launch.py), so no exit
cost the smoke avoids is left in the floor. So the floor holds 3 notebook executors, 3 kernel starts
and 3 torch imports, 2 of each on the critical path. The smoke itself starts the resume's notebook
beside the other two and holds it at a gate until the kill, so that notebook's start overlaps the
training: the training and the checks are what the smoke adds to the floor (torch._dynamo's import too, at 2 ranks: DDP imports it).

Stages of a smoke: render; executor start (process + kernel up, until the runtime's first line);
preflight (start-up, staging and checks, until the first training step); steps (until the SIGKILL
after the checkpoint; the reference run executes beside it); kill and resume (from the release of
the held resume, right after the kill, to its end). Each job is copied to a scratch folder so the repo's run log is untouched.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.runtime import layout  # noqa: E402
from kchain.smoke import smoke  # noqa: E402

STAGES = ["render", "executor start", "preflight", "steps", "kill and resume"]
CELL = ("import subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'import gc, torch; gc.collect(); gc.freeze()'], check=True)\n")
# The floor of a 2-rank smoke: each session's training child imports torch and starts torchrun, whose
# two ranks import torch and join a gloo group, then leave (what the launcher of a 2-rank job does).
RANK = "import torch.distributed as dist; dist.init_process_group('gloo'); dist.destroy_process_group()\n"
CELL_2 = ("import subprocess, sys, pathlib\n"
          f"pathlib.Path('rank.py').write_text({RANK!r})\n"
          "subprocess.run([sys.executable, '-c', 'import subprocess, sys, torch; subprocess.run([sys.executable, "
          "\"-m\", \"torch.distributed.run\", \"--standalone\", \"--nproc_per_node=2\", \"rank.py\"], check=True)'], "
          "check=True)\n")


def _notebook(path: Path, ranks: int = 1) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL if ranks == 1 else CELL_2)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def _executor(notebook: Path, root: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kchain.local", "run", str(notebook), "--root", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def floor_s(scratch: Path, ranks: int = 1) -> float:
    """(reference || killed run), then the resume after the killed run, all doing nothing but start."""
    nb = _notebook(scratch / f"floor-{ranks}.ipynb", ranks)
    t0 = time.perf_counter()
    reference, killed = _executor(nb, scratch / "f-ref"), _executor(nb, scratch / "f-run")
    killed.wait()
    _executor(nb, scratch / "f-run").wait()
    reference.wait()
    return time.perf_counter() - t0


def main(rounds: int = 3) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="kchain-bench-"))
    os.environ[layout.HOME_ENV] = str(scratch / "home")
    print(f"{'job':<12} {'ranks':>5} {'total':>7} " + " ".join(f"{s:>15}" for s in STAGES))
    ratios: dict[int, list[float]] = {1: [], 2: []}
    try:
        for i in range(rounds):
            for ranks in (1, 2):  # --ranks 1, and the 2 ranks a GPU job gets on Kaggle (the default)
                floor = floor_s(scratch, ranks)
                for job_dir in sorted(p for p in (REPO / "jobs").iterdir() if (p / "job.yaml").exists()):
                    target = scratch / f"{job_dir.name}-{i}-{ranks}"
                    shutil.copytree(job_dir, target, ignore=shutil.ignore_patterns(".kchain", "__pycache__"))
                    t0 = time.perf_counter()
                    report = smoke(target / "job.yaml", echo=lambda _: None, quiet_training=True, ranks_asked=ranks)
                    total = time.perf_counter() - t0
                    cells = " ".join(f"{report.timings.get(s, 0.0):>14.2f}s" for s in STAGES)
                    print(f"{job_dir.name:<12} {ranks:>5} {total:>6.1f}s {cells}   {'PASS' if report.passed else 'FAIL'}")
                    if job_dir.name == "tinygpt":
                        ratios[ranks].append(total / floor)
                        print(f"{'':<12} floor ({ranks} rank(s)) {floor:.1f}s; tinygpt smoke / floor = {total / floor:.2f}")
        for ranks, got in ratios.items():
            print(f"tinygpt smoke / floor, {ranks} rank(s), median of {rounds}: {statistics.median(got):.2f} "
                  "(target <= 1.3)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
