"""Data: a resumable DataLoader, cached staging, smoke subsets, and finding attached inputs.

The loader's order is part of the checkpoint. Each epoch's order is a permutation seeded from
(seed, epoch), and the DataLoader is fed batch descriptors (epoch, batch_index, indices) rather than
row indices, so a resume restarts from the exact next batch. Whatever randomness a batch uses
(augmentation) is seeded from (seed, epoch, batch_index) just before it is fetched, so it does not
depend on which worker gets the batch or on what the process did before.
"""

from __future__ import annotations

import contextlib
import dis
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

from . import distributed, layout
from .checkpoint import fsync_path

ARRAYS_EXT = "npy"  # one array, or a folder of <key>.npy files (a dict of arrays): loaded memory-mapped
PICKLE_EXT = "pt"  # anything else torch.save can pickle: loaded with torch.load(mmap=True)
PICKLE_PROTOCOL = 4  # see _save
_SAFE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # a dict key that is also a file name
MAPPED_MIN_BYTES = 64 * 1024  # a staged numpy array this large comes back memory-mapped (_MappingPickler)
CACHE_SUFFIX = "-cache"  # the job's cache dataset is <owner>/<job>-cache (kchain/names.py)


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
        batches = lo.batches(lo.epoch)
        for b in range(lo.position, len(batches)):
            # kchain ddp: with several ranks each rank's share of global batch b has its own seed
            yield (lo.epoch, b * lo.world_size + lo.rank if lo.world_size > 1 else b, batches[b])

    def __len__(self):
        return len(self.loader) - self.loader.position


def _identity(batch):
    return batch


@contextlib.contextmanager
def _seeded_global_rngs(seed: int):
    """The global python/numpy/torch RNGs seeded for the block, then put back as they were."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def _draw(source, seed: int, epoch: int) -> list:
    """One epoch of a sampler or batch sampler, the same for the same (seed, epoch) in every process.

    The sampler's own generator (RandomSampler, WeightedRandomSampler) is swapped for a seeded one
    for the draw, and the global RNGs are seeded around it for samplers that use those instead.
    """
    if hasattr(source, "set_epoch"):  # DistributedSampler and friends
        source.set_epoch(epoch)
    holder = getattr(source, "sampler", source)  # a BatchSampler draws from its sampler
    s = mix_seed(seed, epoch)
    own = getattr(holder, "generator", None)
    with _seeded_global_rngs(s):
        if own is not None:
            holder.generator = torch.Generator().manual_seed(s)
        try:
            return [list(b) if isinstance(b, (list, tuple)) else b for b in source]
        finally:
            if own is not None:
                holder.generator = own


class Loader:
    """A DataLoader whose position is checkpointed; counts batches delivered, not prefetched.

    One rule for the two ways to read it: `next(loader)` returns the next batch and moves into the
    next epoch by itself (the `run.steps` loop); `for batch in loader` iterates the rest of the
    current epoch and then ends (the `run.epochs` loop). Under `run.epochs`, each batch handed out
    by `for` is one step: the step ends when the loop asks for the next batch.

    The order of an epoch comes from (seed, epoch): a shuffle, or one draw of the given `sampler`
    or `batch_sampler` (see _draw). An IterableDataset has no order to draw: its epoch is replayed
    from the start and the batches already trained are skipped on resume.
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        seed: int = 0,
        pin_memory: bool = False,
        on_wait: Callable[[float], None] | None = None,
        sampler=None,
        batch_sampler=None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size  # kchain ddp: batch_size is per rank
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.iterable = isinstance(dataset, IterableDataset)
        if world_size > 1 and (self.iterable or batch_sampler is not None):
            print(
                f"[kchain] WARNING: run.loader shards a dataset or a sampler across the {world_size} ranks, not "
                f"{'an IterableDataset' if self.iterable else 'a batch_sampler'}: every rank reads the same "
                "batches unless it shards them itself by run.rank",
                flush=True,
            )
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed to the user
        self.run = None  # the Run whose epoch loop this loader drives (set by run.epochs)
        self._on_wait = on_wait
        self._it = None
        self._skip = 0  # batches of an iterable epoch to drop after a resume
        self._drawn: tuple[int, list] | None = None
        # Its own generator: DataLoader draws a base seed per iterator, which must not come from
        # (and shift) the global torch RNG that dropout uses. Reseeded per epoch (see _fetch).
        self._gen = torch.Generator().manual_seed(seed)
        self._dl = self._dataloader(collate_fn or default_collate, num_workers, pin_memory)

    def _dataloader(self, collate_fn: Callable, num_workers: int, pin_memory: bool) -> DataLoader:
        """The torch DataLoader underneath: fed batch descriptors by _Descriptors, or the stream itself."""
        if self.iterable:
            return DataLoader(
                self.dataset, batch_size=self.batch_size, num_workers=num_workers, drop_last=self.drop_last,
                collate_fn=collate_fn, pin_memory=pin_memory, persistent_workers=False, generator=self._gen,
            )
        return DataLoader(
            _Batches(self.dataset, collate_fn, self.seed, in_main_process=num_workers == 0),
            batch_size=None,
            sampler=_Descriptors(self),
            num_workers=num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            # Workers live across epochs (no fork per epoch); the sampler is re-read at each reset.
            persistent_workers=num_workers > 0,
            generator=self._gen,
        )

    def __len__(self):
        if self.iterable:
            return len(self._dl)  # TypeError when the stream has no length, as DataLoader does
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        if self.world_size > 1:  # kchain ddp: global batches; each rank takes one micro-batch of each
            return distributed.batches_per_rank(n, self.batch_size, self.world_size, self.drop_last)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch)))

    def batches(self, epoch: int) -> list[list[int]]:
        """The index lists of every batch of `epoch` (drawn once per epoch)."""
        if self._drawn is not None and self._drawn[0] == epoch:
            return self._drawn[1]
        if self.batch_sampler is not None:
            out = _draw(self.batch_sampler, self.seed, epoch)
        else:
            idx = _draw(self.sampler, self.seed, epoch) if self.sampler is not None else self.order(epoch).tolist()
            bs = self.batch_size
            out = [idx[i : i + bs] for i in range(0, len(idx), bs)]
            if self.drop_last and out and len(out[-1]) < bs:
                out.pop()
            if self.world_size > 1:  # kchain ddp: this rank's share of each global batch
                out = [distributed.shard(idx, bs, b, self.rank, self.world_size) for b in range(len(self))]
        self._drawn = (epoch, out)
        return out

    def _fetch(self):
        """The next batch of this epoch; StopIteration at its end."""
        if self._it is None:
            self._gen.manual_seed(mix_seed(self.seed, self.epoch))  # worker seeds depend on the epoch only
            self._it = iter(self._dl)
            if self.iterable:
                for _ in range(self._skip):  # replay the stream up to where the checkpoint was
                    next(self._it)
                self._skip = 0
        t0 = time.perf_counter()
        batch = next(self._it)
        if self._on_wait:
            self._on_wait(time.perf_counter() - t0)
        self.position += 1
        return batch

    def _epoch_done(self) -> bool:
        """Every batch of this epoch was handed out (unknown for a stream without a length: False)."""
        n = self._length()
        return n is not None and self.position >= n

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
        run = self.run
        if run is None and self._epoch_done():
            # A consumer that reads exactly len(loader) batches and stops (Lightning's fit loop, a
            # `for i, b in zip(range(len(loader)), loader)`) never asks for the end: a new pass is
            # the next epoch, not the empty rest of the last one. (Under run.epochs the end is asked
            # for, and a resume at an epoch's last batch must give that epoch's code its turn.)
            self._next_epoch()
        while True:
            if run is not None and not run._may_start_step():
                if not run._stop_reason:
                    return  # the step cap: the epoch loop ends here and saves
                if not self._epoch_done():
                    run._stop_here()  # a stop mid-epoch: saved here; the rest of the epoch's code never runs
                # A stop after the epoch's last batch: the epoch is complete, so its own code (a
                # scheduler step, an evaluation) runs; run.epochs then saves and stops.
                self._next_epoch()
                return
            try:
                batch = self._fetch()
            except StopIteration:
                self._next_epoch()
                return
            if run is None:
                yield batch
                continue
            step = run.step + 1
            t0 = run._start_step(step)
            try:
                yield batch
            except GeneratorExit:
                if left_on_purpose():  # `break` out of the batches: the batch counts as done
                    run._end_step(step, t0)
                raise
            run._end_step(step, t0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batches": self._length()}

    def _length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("batches", self._length()) != self._length():
            print(
                f"[kchain] WARNING: loader seed/batches changed ({state.get('seed')}/{state.get('batches')} -> "
                f"{self.seed}/{self._length()}); the data order after the resume is not the original one",
                flush=True,
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._skip = self.position if self.iterable else 0
        self._it = None  # prefetched batches belong to the old position


def left_on_purpose() -> bool:
    """Called while a loop generator handles GeneratorExit: True when the user's loop was left by
    `break` or `return` (the frame closing the generator is popping it off its stack), False when
    an exception is unwinding through the loop (its last instruction is a raise or a call).
    Checked on CPython 3.10, 3.11 and 3.12.
    """
    frame = sys._getframe(2)
    return dis.opname[frame.f_code.co_code[frame.f_lasti]] == "POP_TOP"


# --- staging -----------------------------------------------------------------------------------


def fingerprint(name: str, params) -> str:
    """12 hex chars from name+params: change a parameter and the cache file name changes."""
    blob = json.dumps({"name": name, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _is_array(obj) -> bool:
    """One plain numpy array that a .npy file holds exactly (a masked array would lose its mask)."""
    return type(obj) in (np.ndarray, np.memmap) and not obj.dtype.hasobject


def _is_arrays(obj) -> bool:
    """A dict of arrays that a folder of <key>.npy gives back exactly: a plain dict whose keys are file
    names, in the sorted order the folder is read back in. Any other mapping goes to the pickle."""
    keys = list(obj) if type(obj) is dict else []
    return (bool(keys) and keys == sorted(keys, key=str) and all(type(k) is str and _SAFE_KEY.fullmatch(k) for k in keys)
            and all(_is_array(v) for v in obj.values()))


def _mapped_array(tensor: torch.Tensor, fortran: bool) -> np.ndarray:
    """How _MappingPickler's arrays are rebuilt: a view of the tensor's storage, which torch.load(mmap=True)
    maps from the entry's file, so the array is read only where it is touched."""
    arr = tensor.numpy()
    return arr.T if fortran else arr


class _MappingPickler(pickle.Pickler):
    """The pickler torch.save uses for a staged entry: every numpy array of MAPPED_MIN_BYTES or more,
    wherever it sits (a dict, a list, a dataclass, a user's class), is written as a tensor, so
    its bytes become a storage of their own in the file and come back memory-mapped (_mapped_array).

    Smaller arrays, object and string arrays, subclasses that carry more than their data (masked
    arrays, matrices) and dtypes torch has no tensor for are pickled as numpy pickles them.
    """

    def reducer_override(self, obj):
        if not _is_array(obj) or obj.nbytes < MAPPED_MIN_BYTES or not obj.dtype.isnative:  # (torch: native order)
            return NotImplemented
        fortran = obj.ndim > 1 and obj.flags.f_contiguous and not obj.flags.c_contiguous
        try:
            with warnings.catch_warnings():  # a read-only array (a staged memmap): torch.save only reads it
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(np.ascontiguousarray(obj.T if fortran else obj))
        except (TypeError, ValueError):  # no tensor dtype for it (strings, structured)
            return NotImplemented
        return _mapped_array, (tensor, fortran)


_MAPPING_PICKLE = types.ModuleType("kchain_mapping_pickle")  # what torch.save takes as its pickle_module
_MAPPING_PICKLE.Pickler = _MappingPickler


def _load(path: Path):
    """An entry memory-mapped: a hit costs opening the files, not reading them."""
    if path.is_dir():  # a dict of arrays
        return {p.stem: np.load(p, mmap_mode="r") for p in sorted(path.glob("*.npy"), key=lambda p: p.stem)}
    if path.suffix == f".{ARRAYS_EXT}":  # one array
        return np.load(path, mmap_mode="r")
    # weights_only=False: an entry may be any picklable object, and it is this job's own cache
    # (kchain's working dir, or the job's own <job>-cache dataset), never a foreign file.
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def _save(obj, final: Path) -> None:
    """Write an entry under a temporary name, fsync it, then rename it into place."""
    tmp = final.with_name(f"{layout.TMP_PREFIX}{final.name}-{os.getpid()}")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    if _is_arrays(obj):
        tmp.mkdir(parents=True)
        for key, arr in obj.items():
            np.save(tmp / f"{key}.npy", arr)
            fsync_path(tmp / f"{key}.npy")
        fsync_path(tmp)
    elif _is_array(obj):
        with open(tmp, "wb") as f:
            np.save(f, obj)
    else:
        # Protocol 4 (frames, short strings) unpickles a list of strings about twice as fast as torch's 2.
        torch.save(obj, tmp, pickle_module=_MAPPING_PICKLE, pickle_protocol=PICKLE_PROTOCOL)
    if not tmp.is_dir():
        fsync_path(tmp)
    os.replace(tmp, final)  # atomic: a killed build never leaves a half entry that looks complete
    fsync_path(final.parent)


def cache_mounts(input_root: Path, dataset: str) -> list[Path]:
    """Where the job's own cache dataset (`[owner/]<job>-cache`) is mounted (layout.mounts: only
    the input root and its dataset and owner folders are listed, never what an input holds)."""
    owner, _, slug = dataset.rpartition("/")
    return [m for m in layout.mounts(input_root, ("datasets",))
            if m.name == slug and (not owner or m.parent == input_root or m.parent.name == owner)]


def _find_entry(names: list[str], cache_dir: Path, input_root: Path, dataset: str | None) -> Path | None:
    """This session's cache first, then the cache dataset: its top level, or its cache/ folder."""
    for path in (cache_dir / n for n in names):
        if path.exists():
            return path
    for mount in cache_mounts(input_root, dataset) if dataset else []:
        for path in (folder / n for folder in (mount, mount / layout.CACHE_DIR) for n in names):
            if path.exists():
                return path
    return None


def stage(name: str, params, build: Callable, cache_dir: Path, input_root: Path, dataset: str | None = None):
    """build(params) once per distinct (name, params); later calls load the saved result, memory-mapped.

    `dataset` names the job's cache dataset (`owner/<job>-cache`, or `<job>-cache` with any owner):
    only where it is mounted is looked at, never anything else attached.
    """
    stem = f"{name}-{fingerprint(name, params)}"
    names = [f"{stem}.{ARRAYS_EXT}", f"{stem}.{PICKLE_EXT}"]
    t0 = time.perf_counter()
    path = _find_entry(names, cache_dir, input_root, dataset)
    if path is not None:
        obj = _load(path)
        print(f"[kchain] stage {name}: cache hit {path} ({time.perf_counter() - t0:.3f}s)", flush=True)
        return obj
    obj = build(params)
    final = cache_dir / (names[0] if _is_arrays(obj) or _is_array(obj) else names[1])
    cache_dir.mkdir(parents=True, exist_ok=True)
    _save(obj, final)
    del obj  # the caller gets the mapped entry, as on a hit: the built copy can be freed
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
        if p.name in layout.INPUT_KINDS and p.is_dir():
            for q in sorted(p.iterdir()):
                subs = sorted(q.iterdir()) if p.name != "competitions" and q.is_dir() else []
                out += [f"{q.name}/{s.name}" for s in subs if s.is_dir()] or [q.name]
        else:
            out.append(p.name)
    return out


def find_input(slug: str, input_root: Path) -> Path:
    """The mounted folder of an attached input; `slug` may be 'name' or 'owner/name'.

    Only mount points are looked at: <input>/<name>, <input>/competitions/<name>, then
    <input>/<kind>/<owner>/<name> (datasets, notebooks, models; that owner's first when one is
    given). Nothing inside an attached input is listed, so the call costs the same whatever else
    is attached.
    """
    parts = slug.rstrip("/").split("/")
    name, owner = parts[-1], parts[0] if len(parts) > 1 else None
    mounted = [m for m in layout.mounts(input_root, layout.OWNED_KINDS) if m.name == name]
    competition = input_root / "competitions" / name
    for tier in ([m for m in mounted if m.parent == input_root], [competition] if competition.is_dir() else [],
                 [m for m in mounted if m.parent != input_root]):
        if owner:  # owner given: prefer the mount under that owner
            tier = [p for p in tier if p.parent.name == owner] or tier
        if tier:
            return tier[0]
    tried = [input_root / name, competition, *(input_root / k / "*" / name for k in layout.OWNED_KINDS)]
    raise FileNotFoundError(
        f"input {slug!r} is not attached: looked in {', '.join(map(str, tried))}; attached: "
        f"{', '.join(attached(input_root)) or 'nothing'}. Add it to the job's inputs"
    )
