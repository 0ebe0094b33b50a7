"""How fast this machine copies memory that has sat idle: the floor under run.save's blocked time.

run.save blocks the training thread for one copy of the state into host buffers kept from the last
save (snapshot.Snapshotter). Those buffers sit idle between saves. On a virtual machine whose host
reclaims or demotes idle guest memory, the copy into them slows down with the time they sat idle,
with no page fault the guest can see, and the blocked time with it. A Kaggle GPU VM passes its GPU
through to the guest, which pins guest memory on the host, so this should not happen there; this
script shows whether it happens where the benchmarks run.

    python bench/idle_memory.py [--mib 40] [--rounds 3]

Prints, for each idle time, the best of --rounds copies of --mib MiB (numpy, one thread) into a
buffer left untouched for that long, and the ratio to the copy into a buffer just touched.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

IDLE_S = (0.0, 0.05, 0.2, 1.0, 2.0)


def copy_after_idle(src: np.ndarray, dst: np.ndarray, idle_s: float) -> tuple[float, int]:
    """Seconds to copy src into dst after both sat untouched for idle_s, and the page faults seen."""
    if idle_s:
        time.sleep(idle_s)
    else:
        np.copyto(dst, src)  # touched just now
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    np.copyto(dst, src)
    took = time.perf_counter() - t0
    return took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    src = np.ones(args.mib * 2**20 // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # every page of both faulted in before anything is timed
    best = dict.fromkeys(IDLE_S, float("inf"))
    faults = dict.fromkeys(IDLE_S, 0)
    for _ in range(args.rounds):
        for idle in IDLE_S:  # interleaved: the machine drifts between rounds
            took, n = copy_after_idle(src, dst, idle)
            best[idle] = min(best[idle], took)
            faults[idle] += n
    hot = best[0.0]
    print(f"copy of {args.mib} MiB into a buffer idle for ..., best of {args.rounds}:")
    for idle in IDLE_S:
        print(f"  {idle:4.2f} s idle  {best[idle] * 1e3:7.1f} ms  {best[idle] / hot:5.1f}x the copy into a buffer "
              f"just touched  ({faults[idle]} page faults in all)")


if __name__ == "__main__":
    main()
