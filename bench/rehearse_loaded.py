"""The default `kchain rehearse` of every example job and template, with every core kept busy by another process.

    python bench/rehearse_loaded.py                       # all of jobs/ and every `kchain init` template
    python bench/rehearse_loaded.py --only tinygpt loop   # these only
    python bench/rehearse_loaded.py --busy 0              # on a quiet machine, for comparison

One busy loop per core (`--busy N` to choose) runs for the whole run, as another program would on a
user's laptop. Each job is rehearsed as a user runs it: `kchain rehearse job.yaml` from the CLI in a
copy of the job's folder (templates as `kchain init --template T` writes them), no `--set`, no flags.
Rehearsals plan their sessions in steps, so the load changes how long one takes, not its chain or its
verdict. Prints, per job: the exit code, the wall time, the 1-minute load average when it started, and
rehearse's verdict line; each rehearsal's whole output is kept in the scratch folder it names.

The inference template predicts with a model `kchain pull` brought home (its first step, `kaggle.local`);
with no chain to pull from here, it gets what pull writes: the notebook template's network with seeded
weights as pulled/model.safetensors, as tests/scenarios/test_inference_template.py does.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.common import layout  # noqa: E402
from kchain.job.init import init_job, templates  # noqa: E402


def _jobs(scratch: Path) -> dict[str, Path]:
    found = {p.name: p for p in sorted((REPO / "jobs").iterdir()) if (p / "job.yaml").exists()}
    for template in templates():
        init_job(scratch / "templates" / template, template=template)
        found[f"template {template}"] = scratch / "templates" / template
    return found


def _pulled(folder: Path) -> None:
    """The folder `kchain pull --best -o pulled` writes, for the inference template's kaggle.local."""
    import json

    import torch
    from safetensors.torch import save_file
    from torch import nn

    (folder / "pulled").mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    save_file(model.state_dict(), str(folder / "pulled" / "model.safetensors"))
    (folder / "pulled" / "metrics.json").write_text(json.dumps({"step": 4}))


def _verdict(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    said = [line for line in lines if line.startswith("verdict:")] or [line for line in lines if line.startswith("Error")]
    return (said or lines[-1:] or ["(no output)"])[-1][:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy loops beside the rehearsals")
    parser.add_argument("--only", nargs="+", metavar="JOB", help="job folders of jobs/ or template names")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kchain-rehearse-loaded-"))
    env = {**os.environ, layout.HOME_ENV: str(scratch / "home")}
    chosen = {name: path for name, path in _jobs(scratch).items()
              if not args.only or name.split()[-1] in args.only}
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    print(f"{len(chosen)} rehearsals, {args.busy} busy loops on {os.cpu_count()} cores; outputs under {scratch}",
          flush=True)
    results = []
    try:
        for name, folder in chosen.items():
            target = scratch / "runs" / name.replace(" ", "-")
            shutil.copytree(folder, target, ignore=shutil.ignore_patterns(".kchain", "__pycache__"))
            if name == "template inference":
                _pulled(target)
            load = os.getloadavg()[0]
            start = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "kchain.cli", "rehearse", "job.yaml"], cwd=target, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
            wall = time.monotonic() - start
            (target / "rehearse.log").write_text(out.stdout)
            results.append((name, out.returncode, wall, load, _verdict(out.stdout)))
            print(f"{name:<22} exit {out.returncode}  {wall:7.1f} s  load {load:5.2f}  {results[-1][4]}", flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    passed = sum(1 for r in results if r[1] == 0)
    print(f"passed {passed} of {len(results)}; {sum(r[2] for r in results):.0f} s in all")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
