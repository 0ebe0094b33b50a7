"""run.stage where the user waits: a cache hit to the first batch, and the hit's start-up cost.

One run, interleaved rounds (the machine drifts, so every figure of a round is taken side by side),
best of the rounds printed with the median beside it:
  1. a staged cache hit of a 100 MiB object, to its first batch, for each kind run.stage saves:
     a dict of numpy arrays (a folder of .npy), one tensor (.pt), a dict of tensors with a
     vocabulary list (.pt) and a user's own object holding a numpy array (.pt), against the floors: np.load(mmap_mode="r") and torch.load(mmap=True).
  2. the start-up of a stage hit from the job's attached cache dataset (a fresh working dir, as in
     a new session) with 50,000 files of other data attached under the input root, and with
     nothing else attached.

    python bench/staging.py [--mib 100] [--files 50000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from kchain.common import layout
from kchain.runtime.run import Run

ROW = 1024  # float32 values per row: 4 KiB
BATCH = 64  # rows in the first batch
JOB = "bench"


def make_run(root: Path) -> Run:
    config = {"job": JOB, "params": {}, "train": {"heartbeat_s": 0},
              "kaggle": {"cache_dataset": f"me/{JOB}-cache"}}  # as render.py names it on Kaggle
    with contextlib.redirect_stdout(io.StringIO()):
        return Run(config, {layout.ROOT_ENV: str(root)})


@dataclasses.dataclass
class Tokens:
    """A user's own object holding the array (pickled by reference, as a job's class would be)."""

    x: np.ndarray
    vocab: list


KINDS = ("npy folder (dict of arrays)", "pt (one tensor)", "pt (dict of tensors + list)",
         "pt (an object holding an array)")


def array_of(obj):
    return obj.x if isinstance(obj, Tokens) else obj["x"] if isinstance(obj, dict) else obj


def timed(fn) -> float:
    with contextlib.redirect_stdout(io.StringIO()):  # the hit's one-line message, for every figure alike
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000


def first_batch(obj) -> torch.Tensor:
    """The first rows copied out, the same single-threaded numpy copy for every kind (a torch copy of
    this size wakes torch's intra-op threads, which on a busy machine adds noise unrelated to staging)."""
    view = obj[:BATCH].numpy() if isinstance(obj, torch.Tensor) else obj[:BATCH]
    return torch.from_numpy(np.array(view))


def hit_measures(root: Path, mib: int) -> dict:
    """Each kind staged once (the miss), then its hit and the floors as callables."""
    rows = mib * 2**20 // (ROW * 4)
    x = np.random.default_rng(0).standard_normal((rows, ROW), dtype=np.float32)
    objects = {
        "npy folder (dict of arrays)": {"x": x},
        "pt (one tensor)": torch.from_numpy(x),
        "pt (dict of tensors + list)": {"x": torch.from_numpy(x), "vocab": [str(i) for i in range(1000)]},
        "pt (an object holding an array)": Tokens(x, [str(i) for i in range(1000)]),
    }
    run = make_run(root)
    for name, obj in objects.items():
        with contextlib.redirect_stdout(io.StringIO()):
            run.stage(name.split()[0], {"kind": name}, lambda p, obj=obj: obj)
    np.save(root / "floor.npy", x)
    torch.save(torch.from_numpy(x), root / "floor.pt")
    del objects, x

    def hit(name):
        def go():
            obj = run.stage(name.split()[0], {"kind": name}, cast(Any, None))  # None: a miss would raise
            first_batch(array_of(obj))
        return go

    out = {f"stage hit -> first batch, {name}": hit(name) for name in KINDS}
    out["floor: np.load(mmap_mode='r') -> first batch"] = lambda: first_batch(np.load(root / "floor.npy", mmap_mode="r"))
    out["anchor: torch.load(mmap=True) -> first batch"] = lambda: first_batch(
        torch.load(root / "floor.pt", mmap=True, weights_only=True))
    return out


def startup_measures(base: Path, files: int) -> dict:
    """A fresh session whose cache dataset is attached, with and without other data beside it."""
    out = {}
    for label, n in (("nothing else attached", 0), (f"{files:,} files of other data attached", files)):
        root = base / f"root-{n}"
        own = root / layout.INPUT_DIR / "datasets" / "me" / f"{JOB}-cache"
        own.mkdir(parents=True)
        seed = make_run(base / "seed")  # builds the entry once, then it is "attached" as a dataset
        with contextlib.redirect_stdout(io.StringIO()):
            seed.stage("vocab", {"v": 1}, lambda p: {"ids": torch.arange(1000), "words": ["a", "b"]})
        for entry in seed._paths.cache.iterdir():
            shutil.copy(entry, own / entry.name)
        shutil.rmtree(base / "seed")
        corpus = root / layout.INPUT_DIR / "datasets" / "someone" / "corpus"  # a flat image dataset
        corpus.mkdir(parents=True)
        for i in range(n):
            (corpus / f"img-{i:06d}.png").touch()
        run = make_run(root)
        out[f"stage hit start-up, {label}"] = lambda run=run: run.stage("vocab", {"v": 1}, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        measures = {**hit_measures(base / "hit", a.mib), **startup_measures(base / "startup", a.files)}
        times: dict[str, list[float]] = {name: [] for name in measures}
        names = list(measures)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:  # a rotating order
                times[name].append(timed(measures[name]))
    best = {name: min(ts) for name, ts in times.items()}
    floor = best["floor: np.load(mmap_mode='r') -> first batch"]
    print(f"torch {torch.__version__}, {a.rounds} interleaved rounds, best (median) in ms")
    for name, ts in times.items():
        ratio = f"  {best[name] / floor:5.2f}x np mmap" if "first batch" in name else ""
        print(f"{name:<58} {best[name]:8.2f} ({statistics.median(ts):8.2f}){ratio}")
    quiet = best["stage hit start-up, nothing else attached"]
    loud = best[f"stage hit start-up, {a.files:,} files of other data attached"]
    print(f"start-up with {a.files:,} files attached / nothing attached: {loud / quiet:.2f}x")


if __name__ == "__main__":
    main()
