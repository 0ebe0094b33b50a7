"""CPU of one notebook run that does nothing: what every smoke, rehearsal and local Kaggle session pays per
notebook before its code runs.

    python bench/notebook_start.py                 # 10 runs; the median and the spread
    python bench/before_after.py REV notebook_start.py --runs 10 --turns 3

Each run is `python -m kchain.local.executor run` (the executor) on a one-cell notebook (`pass`); its CPU is the
rusage of that process and all it waited for: the executor itself and the ipykernel it starts. Nothing
of torch or the runtime is in it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c0", "metadata": {}, "outputs": [],
               "source": "pass"}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def one_run(notebook: Path, root: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "kchain.local.executor", "run", str(notebook), "--root", str(root)],
                   check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/notebook_start.py")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kc-nb-") as tmp:
        notebook = Path(tmp) / "pass.ipynb"
        notebook.write_text(json.dumps(NOTEBOOK))
        cpu = [one_run(notebook, Path(tmp) / f"run{i}") for i in range(args.runs)]
    print(f"notebook run (executor + kernel): median {statistics.median(cpu):.3f} CPU-s, "
          f"{min(cpu):.3f}-{max(cpu):.3f} over {len(cpu)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
