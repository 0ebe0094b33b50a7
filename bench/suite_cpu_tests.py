"""CPU seconds of each test, its child processes included, in one run of the suite as CI runs it.

    python bench/suite_cpu_tests.py                 # the whole suite, `-n 6` as .ci/run; the 40 dearest tests
    python bench/suite_cpu_tests.py -n 2 --top 10 tests/house   # pytest's own arguments after the options

Where bench/suite_cpu.py gives each file in a pytest process of its own (serial, exact), this runs the
suite once, as CI does, with a plugin in each worker that reads the worker's rusage before and after
every test: its own CPU and that of every child process waited for during it (notebooks, kernels,
training processes, emulator sessions). A process killed and never waited for is not counted.
Then the timeline: per minute, the machine's busy share of its cores (/proc/stat) and the tests in
flight, and the last tests to end: where cores sit idle while a few long tests finish.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LOG_ENV = "KCHAIN_BENCH_CPU_LOG"
SAMPLE_S = 2.0  # how often the machine's busy share is read


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201  (the plugin's hook, in each worker)
    own0, children0 = _cpu()
    t0 = time.time()
    yield
    own1, children1 = _cpu()
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
        f.write(json.dumps({"test": item.nodeid, "own": own1 - own0, "children": children1 - children0,
                            "wall": time.time() - t0, "start": t0,
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def ci_pytest(workers: str, rest: list[str], *plugins: str) -> list[str]:
    """The suite's command line as .ci/run gives it (`-n 6 --dist loadgroup`, no cache), with these plugins."""
    return [sys.executable, "-m", "pytest", "-q", "-n", workers, "--dist", "loadgroup", *(f"-p{name}" for name in plugins),
            "-p", "no:cacheprovider", *rest]


def _busy_while(proc: subprocess.Popen) -> list[tuple[float, float]]:
    """(time, the machine's busy share of all cores over the last SAMPLE_S) until the process ends."""
    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    samples, last = [], ticks()
    while proc.poll() is None:
        time.sleep(SAMPLE_S)
        now = ticks()
        samples.append((time.time(), 1 - (now[1] - last[1]) / max(1, now[0] - last[0])))
        last = now
    return samples


def _timeline(rows: list[dict], busy: list[tuple[float, float]], t0: float) -> None:
    """Per minute: the machine's busy share and the tests in flight; then the tests still running in the
    last minutes (the tail that leaves cores idle)."""
    print("\nminute  busy  tests in flight (mean)")
    for minute in range(int((busy[-1][0] - t0) // 60) + 1 if busy else 0):
        lo, hi = t0 + 60 * minute, t0 + 60 * (minute + 1)
        shares = [b for t, b in busy if lo <= t < hi]
        flight = sum(max(0.0, min(hi, r["start"] + r["wall"]) - max(lo, r["start"])) for r in rows) / 60
        print(f"{minute:6d} {sum(shares) / max(1, len(shares)):5.0%} {flight:6.1f}")
    if rows:
        end = max(r["start"] + r["wall"] for r in rows)
        print("\nthe last tests to end (started, ended: seconds from the start)")
        for r in sorted(rows, key=lambda r: -(r["start"] + r["wall"]))[:12]:
            print(f"{r['start'] - t0:7.0f} {r['start'] + r['wall'] - t0:7.0f}  {r['worker']:5s} {r['test']}")
        print(f"suite end {end - t0:.0f} s")
    cores = os.cpu_count() or 1
    idle = [(t, 1 - b) for t, b in busy if t >= t0 + 60]
    print(f"idle after the first minute: {sum(i for _, i in idle) * SAMPLE_S * cores:.0f} core-seconds "
          f"(of {len(idle) * SAMPLE_S * cores:.0f})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/suite_cpu_tests.py")
    parser.add_argument("-n", default="6", help="pytest-xdist workers (default 6, as .ci/run)")
    parser.add_argument("--top", type=int, default=40)
    args, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "cpu.jsonl"
        env = {**os.environ, LOG_ENV: str(log),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        t0 = time.time()
        proc = subprocess.Popen(ci_pytest(args.n, rest, "suite_cpu_tests"), cwd=REPO, env=env)
        busy = _busy_while(proc)
        code = proc.returncode
        wall = time.time() - t0
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for row in rows:
        row["cpu"] = row["own"] + row["children"]
    print(f"\n{len(rows)} tests, pytest exit {code}, {wall:.0f} s wall")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:args.top]:
        print(f"{row['cpu']:7.1f} CPU-s ({row['own']:5.1f} in the worker)  {row['wall']:6.1f} s  {row['test']}")
    print(f"total: {sum(r['cpu'] for r in rows):.0f} CPU-s, {sum(r['own'] for r in rows):.0f} of them in the workers")
    _timeline(rows, busy, t0)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
