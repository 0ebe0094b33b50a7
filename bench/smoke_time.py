"""Wall time of `kchain smoke` for each example job and framework template, split by stage, next to
its own floor, in one run.

    python bench/smoke_time.py                    # every job, 1 and 2 ranks, 3 rounds; target <= 1.3 x floor
    python bench/smoke_time.py 1 --ranks 2 --only tinygpt hf-trainer lightning finetune

The jobs: those in jobs/ and the HF Trainer and Lightning templates (`kchain init --template
hf-trainer|lightning`); jobs/finetune is the LoRA one (transformers + peft).

The floor is what the smoke's design cannot go below on this machine, measured here, in this run,
for each job: the killed run and the reference start side by side, and the resume starts when the
killed run is dead, each a notebook run as the smoke runs its three (local.execute_notebook on a thread
of this process) whose one cell starts a Python
child that imports torch and the job's own top-level imports (its frameworks: transformers, peft,
Lightning; the training child's start, each rank's with 2 ranks) and does nothing else; the child exits the way the
runtime's training child does (one collection, then the rest frozen: runtime/launch.py), so no exit
cost the smoke avoids is left in the floor. So the floor holds 3 kernel starts and 3 torch
imports, 2 of each on the critical path. The smoke itself starts the resume's notebook
beside the other two and holds it at a gate until the kill, so that notebook's start overlaps the
training: the training and the checks are what the smoke adds to the floor.

Stages of a smoke: render; executor start (process + kernel up, until the runtime's first line);
preflight (start-up, staging and checks, until the first training step); steps (until the SIGKILL
after the checkpoint; the reference run executes beside it); kill and resume (from the release of
the held resume, right after the kill, to its end). Each job is copied to a scratch folder so the repo's run log is untouched.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.common import layout  # noqa: E402
from kchain.job.init import init_job  # noqa: E402
from kchain.local.executor import execute_notebook  # noqa: E402
from kchain.local.smoke import smoke  # noqa: E402

STAGES = ["render", "executor start", "preflight", "steps", "kill and resume"]
TEMPLATES = ("hf-trainer", "lightning")  # the framework templates, made with `kchain init --template`


def _cell(imports: str) -> str:
    """The floor's one cell at 1 rank: a child that imports torch and the job's imports, then exits."""
    child = f"import gc, torch\n{imports}gc.collect(); gc.freeze()\n"
    return f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}], check=True)\n"


def _cell_2(imports: str) -> str:
    """The floor of a 2-rank smoke: each session's training child imports torch and starts torchrun, whose
    two ranks import torch and the job's imports and join a gloo group, then leave (what the launcher of a
    2-rank job does)."""
    rank = f"import torch.distributed as dist\n{imports}dist.init_process_group('gloo'); dist.destroy_process_group()\n"
    return ("import subprocess, sys, pathlib\n"
            f"pathlib.Path('rank.py').write_text({rank!r})\n"
            "subprocess.run([sys.executable, '-c', 'import subprocess, sys, torch; subprocess.run([sys.executable, "
            "\"-m\", \"torch.distributed.run\", \"--standalone\", \"--nproc_per_node=2\", \"rank.py\"], check=True)'], "
            "check=True)\n")


def job_imports(code: Path) -> str:
    """The top-level imports of a job's training file that name installed packages (its frameworks), as
    source lines: what its training child imports before it trains (the job's own modules left out)."""
    lines = []
    for node in ast.parse(code.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if all(importlib.util.find_spec(n.split(".")[0]) is not None for n in names) and \
                    not any((code.parent / f"{n.split('.')[0]}.py").exists() for n in names):
                lines.append(ast.unparse(node) + "\n")
    return "".join(lines)


def _notebook(path: Path, ranks: int = 1, imports: str = "") -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(_cell(imports) if ranks == 1 else _cell_2(imports))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def _executor(notebook: Path, root: Path) -> threading.Thread:
    thread = threading.Thread(target=execute_notebook, args=(notebook, root))
    thread.start()
    return thread


def floor_s(scratch: Path, ranks: int = 1, imports: str = "", name: str = "") -> float:
    """(reference || killed run), then the resume after the killed run, all doing nothing but start."""
    nb = _notebook(scratch / f"floor-{name}-{ranks}.ipynb", ranks, imports)
    t0 = time.perf_counter()
    reference, killed = _executor(nb, scratch / "f-ref"), _executor(nb, scratch / "f-run")
    killed.join()
    _executor(nb, scratch / "f-run").join()
    reference.join()
    return time.perf_counter() - t0


def jobs(scratch: Path) -> dict[str, Path]:
    """name -> a job folder: each of jobs/, and each framework template as `kchain init` writes it."""
    found = {p.name: p for p in sorted((REPO / "jobs").iterdir()) if (p / "job.yaml").exists()}
    for template in TEMPLATES:
        init_job(scratch / "templates" / template, template=template)
        found[template] = scratch / "templates" / template
    return found


def main(rounds: int = 3, ranks_list: tuple[int, ...] = (1, 2), only: list[str] | None = None) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="kchain-bench-"))
    os.environ[layout.HOME_ENV] = str(scratch / "home")
    chosen = {name: path for name, path in jobs(scratch).items() if not only or name in only}
    print(f"{'job':<12} {'ranks':>5} {'total':>7} " + " ".join(f"{s:>15}" for s in STAGES) + f" {'floor':>7} {'ratio':>6}")
    ratios: dict[tuple[str, int], list[float]] = {}
    try:
        for i in range(rounds):
            for ranks in ranks_list:  # --ranks 1, and the 2 ranks a GPU job gets on Kaggle (the default)
                for name, job_dir in chosen.items():
                    imports = job_imports(job_dir / "train.py") if (job_dir / "train.py").exists() else ""
                    floor = floor_s(scratch, ranks, imports, name)
                    target = scratch / f"{name}-{i}-{ranks}"
                    shutil.copytree(job_dir, target, ignore=shutil.ignore_patterns(".kchain", "__pycache__"))
                    t0 = time.perf_counter()
                    report = smoke(target / "job.yaml", echo=lambda _: None, quiet_training=True, ranks_asked=ranks)
                    total = time.perf_counter() - t0
                    ratios.setdefault((name, ranks), []).append(total / floor)
                    cells = " ".join(f"{report.timings.get(s, 0.0):>14.2f}s" for s in STAGES)
                    print(f"{name:<12} {ranks:>5} {total:>6.1f}s {cells} {floor:>6.1f}s {total / floor:>6.2f}"
                          f"   {'PASS' if report.passed else 'FAIL'}", flush=True)
        for (name, ranks), got in ratios.items():
            print(f"{name} smoke / its floor, {ranks} rank(s), median of {len(got)}: {statistics.median(got):.2f} "
                  "(target <= 1.3)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", nargs="?", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--only", nargs="+", metavar="JOB", help="these jobs only (a folder of jobs/ or a template)")
    args = parser.parse_args()
    main(args.rounds, tuple(args.ranks), args.only)
