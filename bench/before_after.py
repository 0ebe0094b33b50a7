"""One bench script run on an older revision and on this tree, in one run, turn about.

    python bench/before_after.py REV BENCH [ARGS...] [--turns 2]
    python bench/before_after.py 10ae4eb checkpoint_overhead.py --rounds 2

REV is checked out into a temporary git worktree with an interpreter of its own (a venv whose path holds
that tree, then this interpreter's packages; removed at the end), so it, its child processes, notebook
kernels and training ranks load REV's code and nothing of this checkout's editable install. BENCH is a
file name under bench/; each tree runs its own copy of it. The two runs alternate,
`--turns` times each (before, after, before, after...), because a shared machine drifts more than a
reshape should move a figure. Each run's output is printed whole, under a line naming the tree, the
turn and its wall time; the bench's own lines hold its ratios.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _interpreter(tree: Path, venv: Path) -> Path:
    """A venv whose path is the tree, then this interpreter's site-packages (the same torch and libraries)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          text=True, capture_output=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "kchain-before.pth").write_text(f"{tree}\n{ours}\n")
    return python


def _run(python: Path, tree: Path, bench: str, args: list[str]) -> tuple[float, str]:
    start = time.monotonic()
    out = subprocess.run([str(python), str(tree / "bench" / bench), *args], cwd=tree,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.monotonic() - start
    return wall, out.stdout + ("" if out.returncode == 0 else f"(exit {out.returncode})\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("bench")
    parser.add_argument("--turns", type=int, default=2)
    known, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="kc-before-") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "-q", "--detach", str(before), known.rev], check=True)
        try:
            label = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], text=True,
                                   capture_output=True, check=True).stdout.strip()
            python = _interpreter(before, Path(tmp) / "venv")
            for turn in range(1, known.turns + 1):
                for name, exe, tree in ((f"before ({known.rev})", python, before),
                                        (f"after ({label} + worktree)", Path(sys.executable), HERE)):
                    wall, text = _run(exe, tree, known.bench, rest)
                    print(f"===== {name}, turn {turn}: {known.bench} {' '.join(rest)} ({wall:.1f}s)", flush=True)
                    print(text, flush=True)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(before)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
