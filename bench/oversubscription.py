"""Does a process's CPU grow when more processes run at once than the machine has cores?

    python bench/oversubscription.py                     # `import torch`, 1..8 at once
    python bench/oversubscription.py --levels 1 2 6 --rounds 3 --code "import torch, transformers"
    python bench/oversubscription.py --levels 1 8 --batch   # also each level under SCHED_BATCH

The suite is CPU-bound: its wall time is its CPU-seconds over the cores. Its CPU-seconds are mostly
start-ups (an interpreter importing torch, a Jupyter kernel). This starts K copies of the same
start-up at once, R rounds each, and prints the CPU-seconds (user + system, from the children's
rusage) each copy took, as a ratio to K=1 in the same run. A ratio well above 1 at K > cores means
the suite pays for running more processes at once than the machine has cores (caches refilled at
each switch), not only for the work itself. With --batch each level runs a second time with the
copies under Linux's SCHED_BATCH policy (`chrt --batch 0`: treated as CPU-bound, not preempted by a
waking task, so a copy keeps its core and its caches for a whole slice). Levels are taken turn about,
round by round, so a drift of the shared machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def _batch() -> None:
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def one_round(k: int, code: str, batch: bool = False) -> tuple[float, float]:
    """CPU-seconds per copy and the round's wall time, for k copies started at once."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], preexec_fn=_batch if batch else None)
             for _ in range(k)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"the start-up failed (exit {p.returncode}): {code}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu / k, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--code", default="import torch")
    parser.add_argument("--batch", action="store_true", help="also run each level under SCHED_BATCH")
    args = parser.parse_args()
    runs = [(k, batch) for k in args.levels for batch in ([False, True] if args.batch else [False])]
    cpu: dict[tuple[int, bool], list[float]] = {run: [] for run in runs}
    wall: dict[tuple[int, bool], list[float]] = {run: [] for run in runs}
    one_round(1, args.code)  # the files into the page cache, for every level alike
    for r in range(args.rounds):
        for k, batch in runs:
            c, w = one_round(k, args.code, batch)
            cpu[k, batch].append(c)
            wall[k, batch].append(w)
            print(f"round {r + 1}: {k} at once{' (batch)' if batch else ''}: {c:.2f} CPU-s each, {w:.1f} s wall",
                  flush=True)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    base = median(cpu[runs[0]])
    print(f"\n{os.cpu_count()} cores; `{args.code}`; medians over {args.rounds} rounds")
    print(" at once  policy  CPU-s each  ratio  wall per round")
    for k, batch in runs:
        c = median(cpu[k, batch])
        print(f"{k:8d}  {'batch' if batch else 'other':6s}  {c:10.2f}  {c / base:5.2f}  {median(wall[k, batch]):8.1f} s")


if __name__ == "__main__":
    main()
