"""CPU seconds of each test, its child processes included, in one run of the suite as CI runs it.

    python bench/suite_cpu_tests.py                 # the whole suite, `-n 6` as .ci/run; the 40 dearest tests
    python bench/suite_cpu_tests.py -n 2 --top 10 tests/house   # pytest's own arguments after the options

Where bench/suite_cpu.py gives each file in a pytest process of its own (serial, exact), this runs the
suite once, as CI does, with a plugin in each worker that reads the worker's rusage before and after
every test: its own CPU and that of every child process waited for during it (notebooks, kernels,
training processes, emulator sessions). A process killed and never waited for is not counted.
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
                            "wall": time.time() - t0}) + "\n")


def ci_pytest(workers: str, rest: list[str], *plugins: str) -> list[str]:
    """The suite's command line as .ci/run gives it (`-n 6`, a cache of its own), with these plugins."""
    return [sys.executable, "-m", "pytest", "-q", "-n", workers, *(f"-p{name}" for name in plugins),
            "-p", "no:cacheprovider", *rest]


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
        code = subprocess.call(ci_pytest(args.n, rest, "suite_cpu_tests"), cwd=REPO, env=env)
        wall = time.time() - t0
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for row in rows:
        row["cpu"] = row["own"] + row["children"]
    print(f"\n{len(rows)} tests, pytest exit {code}, {wall:.0f} s wall")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:args.top]:
        print(f"{row['cpu']:7.1f} CPU-s ({row['own']:5.1f} in the worker)  {row['wall']:6.1f} s  {row['test']}")
    print(f"total: {sum(r['cpu'] for r in rows):.0f} CPU-s, {sum(r['own'] for r in rows):.0f} of them in the workers")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
