"""CPU seconds of each test file, its child processes included: where the suite's time goes.

    python bench/suite_cpu.py                           # every test file under tests/, one pytest process each
    python bench/suite_cpu.py tests/scenarios/test_smoke.py ...   # only these files

Each file runs in its own `python -m pytest -q -n 0` process; its user+sys CPU is read from the
rusage `wait4` returns, which counts every descendant the process waited for (notebook executors,
kernels, training children, emulator sessions). CPU seconds hold on a busy machine where wall time
does not: the suite's wall time on CI is about this total over the cores the workers keep busy.
The table is sorted by CPU, the largest first, with the file's wall time and pytest's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def file_cpu(path: Path) -> tuple[float, float, float, int]:
    """(user, sys, wall, exit code) of one file's pytest process and all it waited for."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait for it again
    return usage.ru_utime, usage.ru_stime, time.time() - t0, proc.returncode


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or sorted((REPO / "tests").rglob("test_*.py"))
    rows = []
    for path in files:
        user, system, wall, code = file_cpu(path)
        rows.append((user + system, user, system, wall, code, str(path.resolve().relative_to(REPO))))
        print(f"{rows[-1][-1]:52s} cpu {user + system:7.1f} s (user {user:6.1f}, sys {system:5.1f})  "
              f"wall {wall:6.1f} s  exit {code}", flush=True)
    print("\nby CPU:")
    for cpu, _, _, wall, code, name in sorted(rows, reverse=True):
        print(f"{name:52s} {cpu:7.1f} CPU-s  {wall:6.1f} s wall  exit {code}")
    print(f"{'total':52s} {sum(r[0] for r in rows):7.1f} CPU-s  {sum(r[3] for r in rows):6.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
