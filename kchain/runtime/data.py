"""Data: a resumable DataLoader, cached staging, smoke subsets, and finding attached inputs.

The loader's order is part of the checkpoint. Each epoch's order is a permutation seeded from
(seed, epoch), and the DataLoader is fed batch descriptors (epoch, batch_index, indices) rather than
row indices, so a resume restarts from the exact next batch. Whatever randomness a batch uses
(augmentation) is seeded from (seed, epoch, batch_index) just before it is fetched, so it does not
depend on which worker gets the batch or on what the process did before.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from . import distributed, layout

# Attached data on Kaggle: /kaggle/input/<slug>, or one or two folders deeper
# (datasets/<owner>/<slug>, competitions/<slug>, notebooks/<owner>/<slug>, models/...).
INPUT_PATTERNS = ("{slug}", "*/{slug}", "*/*/{slug}")
KIND_DIRS = {"datasets", "competitions", "notebooks", "models"}
ARRAYS_EXT = "npy"  # a folder of <key>.npy files: a dict of numpy arrays, loaded memory-mapped
PICKLE_EXT = "pt"  # anything else torch.save can pickle


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; unlike hash() it is the same in every process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class _Batches(Dataset):
    """Maps a batch descriptor to a collated batch, seeding the RNGs from the descriptor first."""

    def __init__(self, dataset, collate_fn: Callable, seed: int, in_main_process: bool):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.seed = seed
        self.in_main_process = in_main_process

    def __len__(self):  # not used by the sampler, but DataLoader likes a length
        return len(self.dataset)

    def __getitem__(self, desc):
        epoch, batch_index, indices = desc
        if self.in_main_process:
            # Fetching in the training process: leave the user's RNG streams (dropout) untouched.
            saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        s = mix_seed(self.seed, epoch, batch_index)
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.default_generator.manual_seed(s)  # CPU only: torch.manual_seed would reseed CUDA too
        try:
            return self.collate_fn([self.dataset[i] for i in indices])
        finally:
            if self.in_main_process:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])


class _Descriptors:
    """The sampler: the remaining batches of the loader's current epoch, read when iterated."""

    def __init__(self, loader: Loader):
        self.loader = loader

    def __iter__(self):
        lo = self.loader
        order = lo.order(lo.epoch)
        for b in range(lo.position, len(lo)):
            if lo.world_size > 1:  # kchain ddp: this rank's share of global batch b (distributed.shard)
                rows = distributed.shard(order, lo.batch_size, b, lo.rank, lo.world_size)
                yield (lo.epoch, b * lo.world_size + lo.rank, rows)
                continue
            yield (lo.epoch, b, order[b * lo.batch_size : (b + 1) * lo.batch_size].tolist())

    def __len__(self):
        return len(self.loader) - self.loader.position


def _identity(batch):
    return batch


class Loader:
    """A DataLoader whose position is checkpointed; counts batches delivered, not prefetched.

    `next(loader)` returns the next batch and moves into the next epoch by itself (the step-based
    loop); `for batch in loader` iterates the rest of the current epoch.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        seed: int = 0,
        pin_memory: bool = False,
        on_wait: Callable[[float], None] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size  # kchain ddp: batch_size is per rank
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed to the user
        self._on_wait = on_wait
        self._it = None
        self._dl = DataLoader(
            _Batches(dataset, collate_fn or default_collate, seed, in_main_process=num_workers == 0),
            batch_size=None,
            sampler=_Descriptors(self),
            num_workers=num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            # Workers live across epochs (no fork per epoch); the sampler is re-read at each reset.
            persistent_workers=num_workers > 0,
            # Its own generator: DataLoader draws a base seed per iterator, which must not come
            # from (and shift) the global torch RNG that dropout uses.
            generator=torch.Generator().manual_seed(seed),
        )

    def __len__(self):
        n = len(self.dataset)
        if self.world_size > 1:  # kchain ddp: global batches; each rank takes one micro-batch of each
            return distributed.batches_per_rank(n, self.batch_size, self.world_size, self.drop_last)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch)))

    def _fetch(self):
        """The next batch of this epoch; StopIteration at its end."""
        if self._it is None:
            self._it = iter(self._dl)
        t0 = time.perf_counter()
        batch = next(self._it)
        if self._on_wait:
            self._on_wait(time.perf_counter() - t0)
        self.position += 1
        return batch

    def _next_epoch(self):
        self.epoch += 1
        self.position = 0
        self._it = None

    def __next__(self):
        try:
            return self._fetch()
        except StopIteration:
            self._next_epoch()
            return self._fetch()  # an empty dataset raises StopIteration here, as it should

    def __iter__(self):
        while True:
            try:
                batch = self._fetch()
            except StopIteration:
                self._next_epoch()
                return
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batches": len(self)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("batches", len(self)) != len(self):
            print(
                f"[kchain] WARNING: loader seed/batches changed ({state.get('seed')}/{state.get('batches')} -> "
                f"{self.seed}/{len(self)}); the data order after the resume is not the original one",
                flush=True,
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._it = None  # prefetched batches belong to the old position


# --- staging -----------------------------------------------------------------------------------


def fingerprint(name: str, params) -> str:
    """12 hex chars from name+params: change a parameter and the cache file name changes."""
    blob = json.dumps({"name": name, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _is_arrays(obj) -> bool:
    return isinstance(obj, Mapping) and obj and all(isinstance(v, np.ndarray) for v in obj.values())


def _load(path: Path):
    if path.is_dir():
        # mmap: a hit costs a directory listing, not a read of the whole array.
        return {p.stem: np.load(p, mmap_mode="r") for p in sorted(path.glob("*.npy"))}
    return torch.load(path, map_location="cpu", weights_only=False)


def _save(obj, final: Path) -> None:
    tmp = final.with_name(f"{layout.TMP_PREFIX}{final.name}-{os.getpid()}")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    if final.suffix == f".{ARRAYS_EXT}":
        tmp.mkdir(parents=True)
        for key, arr in obj.items():
            np.save(tmp / f"{key}.npy", arr)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, final)  # atomic: a killed build never leaves a half entry that looks complete


def stage(name: str, params, build: Callable, cache_dir: Path, input_root: Path):
    """build(params) once per distinct (name, params); later calls load the saved result."""
    stem = f"{name}-{fingerprint(name, params)}"
    names = [f"{stem}.{ARRAYS_EXT}", f"{stem}.{PICKLE_EXT}"]
    places = [cache_dir / n for n in names]
    if input_root.is_dir():  # an attached cache dataset, whatever its mount layout
        for pattern in ("", "*/", "*/*/", "*/*/*/", "*/*/*/*/"):
            for n in names:
                places += sorted(input_root.glob(f"{pattern}{n}"))
    for path in places:
        if path.exists():
            t0 = time.perf_counter()
            obj = _load(path)
            print(f"[kchain] stage {name}: cache hit {path} ({time.perf_counter() - t0:.2f}s)", flush=True)
            return obj
    t0 = time.perf_counter()
    obj = build(params)
    final = cache_dir / (names[0] if _is_arrays(obj) else names[1])
    cache_dir.mkdir(parents=True, exist_ok=True)
    _save(obj, final)
    print(f"[kchain] stage {name}: built in {time.perf_counter() - t0:.1f}s, saved {final}", flush=True)
    return _load(final)


# --- subsets and inputs ------------------------------------------------------------------------


def subset(data, fraction: float):
    """A deterministic subset spread evenly over data (not its first rows: sorted data keeps every class)."""
    n = len(data)
    k = min(n, max(1, round(n * fraction)))
    idx = np.unique(np.linspace(0, n - 1, k).round().astype(np.int64)) if n else np.zeros(0, np.int64)
    if isinstance(data, np.ndarray):
        return data[idx]
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(idx)]
    if isinstance(data, (list, tuple)):
        return type(data)(data[i] for i in idx)
    return Subset(data, idx.tolist())


def attached(input_root: Path) -> list[str]:
    """The slugs of everything attached, e.g. ['mnist', 'owner/state']."""
    out: list[str] = []
    if not input_root.is_dir():
        return out
    for p in sorted(input_root.iterdir()):
        if p.name in KIND_DIRS and p.is_dir():
            for q in sorted(p.iterdir()):
                subs = sorted(q.iterdir()) if p.name != "competitions" and q.is_dir() else []
                out += [f"{q.name}/{s.name}" for s in subs if s.is_dir()] or [q.name]
        else:
            out.append(p.name)
    return out


def find_input(slug: str, input_root: Path) -> Path:
    """The mounted folder of an attached dataset; `slug` may be 'name' or 'owner/name'."""
    name = slug.rstrip("/").split("/")[-1]
    tried = []
    for pattern in INPUT_PATTERNS:
        glob = pattern.format(slug=name)
        tried.append(str(input_root / glob))
        hits = sorted(p for p in input_root.glob(glob) if p.is_dir()) if input_root.is_dir() else []
        if "/" in slug:  # owner given: prefer the mount under that owner
            hits = [p for p in hits if p.parent.name == slug.split("/")[0]] or hits
        if hits:
            return hits[0]
    raise FileNotFoundError(
        f"input {slug!r} is not attached: looked in {', '.join(tried)}; attached: "
        f"{', '.join(attached(input_root)) or 'nothing'}. Add it to the job's inputs"
    )
