"""What the emulator costs: status polls per second, and the wait from `kchain push` to training.

    python bench/emulator_overhead.py [N]

1. Polls per second for N GetKernelSessionStatus calls (default 500) made with the real `kaggle`
   client through the emulator's proxy, and the ratio to the 100 polls/s kchain needs for its
   tests to poll freely. A ratio above 1 means the emulator is not what slows a test down.
2. Seconds from `kchain push` (the CLI, through the real client) to the session's first training
   step, against the same notebook run directly with `kchain.local.executor.execute_notebook` to its first
   step, and the difference: what the push, the emulator's queue and its session sandbox add.
   The target is a difference within 2 s. The job is the example classifier made small, with a
   heartbeat every step; the first `[kchain] step` line in the live log marks the first step.
   The emulator runs with its modelled waits (queue, boot, version lag: strictness switches that
   stand for Kaggle's own delays) set to zero, so the figure is what its machinery costs; the
   modelled waits are printed apart.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from emulator_helpers import write_kernel  # noqa: E402
from helpers import copy_job, invoke  # noqa: E402

from kchain.common import layout  # noqa: E402
from kchain.emulator import Emulator, Switches  # noqa: E402

TARGET_PER_S = 100
TARGET_DIFF_S = 2.0
HEARTBEAT = "[kchain] step "
JOB = {"params": {"steps": 30, "rows": 4000, "num_workers": 0, "eval_every": 10}, "train": {"heartbeat": "0s"}}


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        (home / ".kaggle").mkdir(parents=True)
        os.environ.update({"HOME": str(home), "KAGGLE_CONFIG_DIR": str(home / ".kaggle")})
        with Emulator(Path(tmp) / "state", users={"alice": secrets.token_hex(16)}) as emu:
            os.environ.update(emu.env("alice"))
            from kaggle.api.kaggle_api_extended import KaggleApi

            api = KaggleApi()
            api.authenticate()
            api.kernels_push(str(write_kernel(Path(tmp) / "k", "alice/bench-kernel", ["print(1)"])), no_run=True)
            start = time.perf_counter()
            for _ in range(n):
                api.kernels_status("alice/bench-kernel")
            rate = n / (time.perf_counter() - start)
    print(f"status polls: {n} in {n / rate:.2f} s = {rate:.0f}/s; ratio to {TARGET_PER_S}/s: {rate / TARGET_PER_S:.1f}")


def first_line_in(path: Path, needle: str, timeout_s: float = 120) -> float:
    """perf_counter time at which needle first shows up in the file (polled every 10 ms)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            if needle in path.read_text(errors="replace"):
                return time.perf_counter()
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"no {needle!r} in {path} after {timeout_s} s")


def push_to_first_step(tmp: Path, emu: Emulator) -> float:
    job = copy_job("classifier", tmp / "push", **JOB)
    start = time.perf_counter()
    result = invoke("push", job, "--skip-smoke")  # the bench measures the push, not the smoke gate
    if result.exit_code != 0:
        raise SystemExit(result.output)
    session = emu.sessions()[-1]
    # The executor's live log: Kaggle's own log is only readable once the session ends.
    seen = first_line_in(emu.store.session_dir(session["id"]) / "log.jsonl", HEARTBEAT)
    emu.wait_session(session["kernel"], session["version"], timeout=120)
    return seen - start


def direct_to_first_step(tmp: Path) -> float:
    from kchain.job.render import render_job, write_rendered
    from kchain.job.spec import load_job
    from kchain.local.executor import execute_notebook

    job = load_job(copy_job("classifier", tmp / "direct", **JOB))
    notebook = write_rendered(render_job(job, owner="alice"), tmp / "direct-kernel")[0]
    first: list[float] = []

    def on_output(stream: str, text: str) -> None:
        if not first and HEARTBEAT in text:
            first.append(time.perf_counter())

    start = time.perf_counter()
    result = execute_notebook(notebook, tmp / "direct-root", on_output=on_output)
    if not result.ok or not first:
        raise SystemExit(f"the direct run failed: {result.error}")
    return first[0] - start


def first_step(tmp: Path) -> None:
    home = tmp / "home"
    (home / ".kaggle").mkdir(parents=True, exist_ok=True)
    os.environ.update({"HOME": str(home), "KAGGLE_CONFIG_DIR": str(home / ".kaggle"),
                       layout.HOME_ENV: str(tmp / "kchain-home")})
    # Both runs import torch from a warm page cache, so neither pays for the first read from disk.
    subprocess.run([sys.executable, "-c", "import torch, nbclient, ipykernel"], check=True)
    no_waits = Switches(queue_s=0.0, boot_s=0.0, version_lag_s=0.0)
    with Emulator(tmp / "state", users={"alice": secrets.token_hex(16)}, session_limit_s=600, switches=no_waits) as emu:
        os.environ.update(emu.env("alice"))
        pushed = push_to_first_step(tmp, emu)
    direct = direct_to_first_step(tmp)
    diff = pushed - direct
    verdict = "within" if diff <= TARGET_DIFF_S else "over"
    print(f"first training step: kchain push {pushed:.2f} s, local execute_notebook {direct:.2f} s; "
          f"difference {diff:+.2f} s ({verdict} the {TARGET_DIFF_S:g} s target)")
    strict = Switches()
    print(f"modelled on top by the strict defaults: queue {strict.queue_s:g} s + boot {strict.boot_s:g} s per session, "
          f"{strict.version_lag_s:g} s before a new dataset version is visible")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
    with tempfile.TemporaryDirectory() as scratch:
        first_step(Path(scratch))
