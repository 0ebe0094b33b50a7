"""Where the suite's CPU goes, by kind of process, in one run of the suite as CI runs it.

    python bench/suite_processes.py                       # the whole suite, `-n 6` as .ci/run
    python bench/suite_processes.py -n 2 tests/scenarios  # pytest's own arguments after the options

bench/suite_cpu_tests.py counts each test's CPU from the workers' rusage, so a process killed and never
waited for is not in it, and it cannot say which start-up a test pays for. This one reads /proc every
0.2 s while the suite runs and keeps, for each process started after it, the most CPU it was seen to
have used, its command line and the test it was started for (PYTEST_CURRENT_TEST, inherited). A process
that lives less than a sample, or the CPU a process spends after its last sample, is missed: the totals
are a little low. Then it prints the CPU of each kind of process (a training rank, the launcher of
several ranks, which imports torch when it forks them: runtime/forkranks.py; the notebook's kernel,
the executor that drives it, ...) and the tests with the most notebook runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

from suite_cpu_tests import ci_pytest  # bench/ is on sys.path when a bench runs

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
# (what the command line holds, the kind), first match wins
KINDS = [
    ("kchain.runtime.launch", "rank"), ("ipykernel_launcher", "notebook kernel"),
    ("kchain.local.executor", "notebook executor"), ("exec(eval(sys.stdin.readline()))", "pytest worker"),
    ("kchain.common.publish", "state publisher"), ("statedigest", "state digest"),
    ("torch.distributed.run", "torchrun"), ("/bin/kaggle", "kaggle CLI"), ("-m pip", "pip"),
]
LAUNCHER = "launcher of ranks"  # a `kchain.runtime.launch` whose children are ranks (spawned or forked)


def kind(cmd: str, launches_ranks: bool = False) -> str:
    for needle, name in KINDS:
        if needle in cmd:
            return LAUNCHER if name == "rank" and launches_ranks else name
    return "other"


def _stat(pid: str) -> tuple[float, str] | None:
    """The process's CPU seconds so far (user and system) and, when it leads its own session (a rank
    does; a DataLoader worker, which shares its rank's command line, does not), its parent's pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK, fields[1] if fields[3] == pid else ""


def _describe(pid: str) -> tuple[str, str]:
    """The process's command line and the test it was started for."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "", ""
    tests = [item.split(b"=", 1)[1].decode(errors="replace") for item in environ
             if item.startswith(b"PYTEST_CURRENT_TEST=")]
    return cmd, tests[0].rsplit(" (", 1)[0] if tests else ""


def sample(argv: list[str]) -> tuple[int, float, dict[str, list]]:
    """Run the command; each new process's [cpu, command, test]."""
    before = set(os.listdir("/proc"))
    seen: dict[str, list] = {}
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=REPO)
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before or (stat := _stat(pid)) is None:
                continue
            if pid in seen:
                seen[pid][0] = max(seen[pid][0], stat[0])
            else:
                seen[pid] = [stat[0], *_describe(pid), stat[1]]
        time.sleep(0.2)
    return proc.returncode, time.time() - t0, seen


def report(seen: dict[str, list], top: int) -> None:
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_test: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    launchers = {ppid for _, cmd, _, ppid in seen.values() if "kchain.runtime.launch" in cmd}
    names = {pid: kind(cmd, pid in launchers) for pid, (_, cmd, _, _) in seen.items()}
    for pid, (cpu, _, test, _) in seen.items():
        name = names[pid]
        by_kind[name][0] += cpu
        by_kind[name][1] += 1
        row = by_test[test or "(no test: the workers, collection)"]
        row[0] += cpu
        row[1] += name == "notebook kernel"
        row[2] += name == "rank"
    total = sum(cpu for cpu, _ in by_kind.values())
    print(f"\n{'CPU-s':>8} {'share':>6} {'procs':>6} {'each':>6}  kind")
    for name, (cpu, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {cpu / total:6.1%} {count:6d} {cpu / count:6.2f}  {name}")
    print(f"{total:8.1f}  in all")
    others: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for pid, (cpu, cmd, _, _) in seen.items():
        if names[pid] == "other":
            head = " ".join(Path(w).name if "/" in w else w for w in cmd.split()[:3])
            others[head][0] += cpu
            others[head][1] += 1
    print(f"\n{'CPU-s':>8} {'procs':>6}  'other': the command's first three words")
    for head, (cpu, count) in sorted(others.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"{cpu:8.1f} {count:6d}  {head}")
    print(f"\n{'CPU-s':>8} {'notebooks':>9} {'ranks':>6}  test")
    for test, (cpu, notebooks, ranks) in sorted(by_test.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:8.1f} {notebooks:9d} {ranks:6d}  {test}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/suite_processes.py")
    parser.add_argument("-n", default="6", help="pytest-xdist workers (default 6, as .ci/run)")
    parser.add_argument("--top", type=int, default=25)
    args, rest = parser.parse_known_args(argv)
    code, wall, seen = sample(ci_pytest(args.n, rest))
    print(f"\npytest exit {code}, {wall:.0f} s wall, {len(seen)} processes")
    report(seen, args.top)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
