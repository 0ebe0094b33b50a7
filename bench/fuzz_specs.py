"""Fuzz `kchain render` with thousands of job files: how many end cleanly, how many do not.

    .venv/bin/python bench/fuzz_specs.py [N] [--seed S]

Generates N job files with the hypothesis strategies of tests/spec_strategies.py (plus the stored
corpus in tests/corpus/), renders each in-process and prints N, the exit-code histogram, the
tracebacks (exit 1 with an exception), the cases that broke the one-line rule, the hangs (over
HANG_S, stopped by an alarm) and the slowest case. Counts and times measured in this one run.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

HANG_S = 30


class Hang(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise Hang()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kchain-fuzz-"))
    # No real credentials or state: the bench renders with a home of its own.
    os.environ.update(HOME=str(work / "home"), KCHAIN_HOME=str(work / "kchain-home"),
                      KAGGLE_CONFIG_DIR=str(work / "home" / ".kaggle"))
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        os.environ.pop(var, None)

    from hypothesis import HealthCheck, given, seed, settings
    from spec_strategies import CORPUS, corpus, job_files, problem, render_bytes

    exits: collections.Counter[int | str] = collections.Counter()  # exit codes, and "hang"
    broken: list[tuple[str, bytes]] = []
    hangs: list[bytes] = []
    slowest = (0.0, b"")
    count = 0

    def run_one(data: bytes) -> None:
        nonlocal count, slowest
        count += 1
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(HANG_S)
        started = time.perf_counter()
        try:
            outcome = render_bytes(work / "case", data)
        except Hang:
            hangs.append(data)
            exits["hang"] += 1
            return
        finally:
            signal.alarm(0)
        elapsed = time.perf_counter() - started
        if elapsed >= HANG_S:  # the alarm's Hang was raised inside the command and caught there
            hangs.append(data)
            exits["hang"] += 1
            return
        if elapsed > slowest[0]:
            slowest = (elapsed, data)
        exits[outcome.exit_code] += 1
        why = problem(outcome)
        if why:
            broken.append((why, data))

    for name in sorted(corpus()):
        run_one((CORPUS / name).read_bytes())

    @seed(args.seed)
    @settings(max_examples=args.n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=job_files())
    def fuzz(data: bytes) -> None:
        run_one(data)

    started = time.perf_counter()
    fuzz()
    total = time.perf_counter() - started

    tracebacks = [b for b in broken if b[0].startswith("traceback")]
    print(f"job files rendered   {count} ({len(corpus())} from the corpus, seed {args.seed}) in {total:.0f} s")
    print("exit codes           " + ", ".join(f"{k}: {v}" for k, v in sorted(exits.items(), key=str)))
    print(f"tracebacks           {len(tracebacks)}")
    print(f"broken one-line rule {len(broken) - len(tracebacks)}")
    print(f"hangs (> {HANG_S} s)      {len(hangs)}")
    print(f"slowest case         {slowest[0]:.2f} s: {slowest[1][:80]!r}")
    for why, data in broken[:5]:
        print(f"--- {data[:200]!r}\n{why[-1500:]}")
    return 1 if broken or hangs else 0


if __name__ == "__main__":
    sys.exit(main())
