"""What a local Kaggle session costs in CPU, driven by an executor process or from a thread.

    python bench/session_driver.py [--sessions 4] [--rounds 2]

The emulator starts each session's notebook through `start_notebook`: by default `python -m kchain.local.executor
run`, a process of its own; rehearse and the tests pass `local.start_session`, a thread of the emulator's
process (the kernel, its training processes and their deaths stay real processes). Each round pushes
SESSIONS one-cell notebooks (`print`) to a fresh emulator with its modelled waits (queue, boot) at zero,
one after another, once each way, turn about (process, thread, process, thread, ...), since a shared
machine drifts; and counts the CPU-seconds of this process and of every child it waited for, the
kernels and executors included (getrusage SELF + CHILDREN). It prints each way's CPU-s per session and
the thread's as a ratio to the process's, taken in the same run.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path

os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from emulator_helpers import write_kernel  # noqa: E402

from kchain.emulator import Emulator, Switches  # noqa: E402
from kchain.emulator.sessions import StartNotebook, start_process  # noqa: E402
from kchain.local.executor import start_session  # noqa: E402

WAYS: dict[str, StartNotebook] = {"process": start_process, "thread": start_session}


def cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def sessions_cpu(tmp: Path, start_notebook: StartNotebook, sessions: int) -> tuple[float, float]:
    """CPU-s and wall seconds for SESSIONS sessions run one after another on a fresh emulator."""
    no_waits = Switches(queue_s=0.0, boot_s=0.0)
    with Emulator(tmp / "state", users={"alice": secrets.token_hex(16)}, switches=no_waits,
                  start_notebook=start_notebook) as emu:
        os.environ.update(emu.env("alice"))
        from kaggle.api.kaggle_api_extended import KaggleApi

        api = KaggleApi()
        api.authenticate()
        folder = write_kernel(tmp / "k", "alice/bench-session", ["print('one session')"])
        cpu0, wall0 = cpu_s(), time.perf_counter()
        for version in range(1, sessions + 1):
            api.kernels_push(str(folder))
            session = emu.wait_session("alice/bench-session", version)
            if session["status"] != "COMPLETE":
                raise SystemExit(f"session {version} ended {session['status']}: {session['failure_message']}")
        return cpu_s() - cpu0, time.perf_counter() - wall0


def main(sessions: int, rounds: int) -> None:
    totals = {way: [0.0, 0.0] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        (home / ".kaggle").mkdir(parents=True)
        os.environ.update({"HOME": str(home), "KAGGLE_CONFIG_DIR": str(home / ".kaggle")})
        for turn in range(rounds):
            for way, start_notebook in WAYS.items():
                cpu, wall = sessions_cpu(Path(tmp) / f"{way}-{turn}", start_notebook, sessions)
                totals[way][0] += cpu
                totals[way][1] += wall
                print(f"round {turn + 1} {way:<8} {cpu / sessions:5.2f} CPU-s and {wall / sessions:5.2f} s "
                      f"of wall per session", flush=True)
    n = sessions * rounds
    for way, (cpu, wall) in totals.items():
        print(f"{way:<8} {cpu / n:5.2f} CPU-s and {wall / n:5.2f} s of wall per session ({n} sessions)")
    ratio = totals["thread"][0] / totals["process"][0]
    print(f"thread/process: {ratio:.2f} of the CPU per session, {totals['thread'][1] / totals['process'][1]:.2f} "
          f"of the wall (os.cpu_count() = {os.cpu_count()}, load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python bench/session_driver.py")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    main(args.sessions, args.rounds)
