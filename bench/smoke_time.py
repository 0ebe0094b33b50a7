"""Wall time of `kchain smoke` for each example job, split by stage, measured in one run.

    python bench/smoke_time.py            # target: jobs/tinygpt under 30 s on 2 cores

Stages: render; executor start (process + kernel up, until the runtime's first line); preflight
(start-up, staging and checks, until the first training step); steps (until the SIGKILL after the
checkpoint; the reference run executes beside it); kill and resume (a fresh process from the
checkpoint to the end). Each job is copied to a scratch folder so the repo's run log is untouched.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.smoke import smoke  # noqa: E402

STAGES = ["render", "executor start", "preflight", "steps", "kill and resume"]


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="kchain-bench-"))
    os.environ["KCHAIN_HOME"] = str(scratch / "home")
    print(f"{'job':<12} {'total':>7} " + " ".join(f"{s:>15}" for s in STAGES))
    try:
        for job_dir in sorted(p for p in (REPO / "jobs").iterdir() if (p / "job.yaml").exists()):
            target = scratch / job_dir.name
            shutil.copytree(job_dir, target, ignore=shutil.ignore_patterns(".kchain", "__pycache__"))
            t0 = time.perf_counter()
            report = smoke(target / "job.yaml", echo=lambda _: None, quiet_training=True)
            total = time.perf_counter() - t0
            cells = " ".join(f"{report.timings.get(s, 0.0):>14.2f}s" for s in STAGES)
            print(f"{job_dir.name:<12} {total:>6.1f}s {cells}   {'PASS' if report.passed else 'FAIL'}")
            if job_dir.name == "tinygpt":
                print(f"{'':<12} tinygpt smoke / 30 s target = {total / 30:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
