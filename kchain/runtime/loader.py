"""The resumable loader: a DataLoader whose position is part of the checkpoint, and smoke subsets.

The loader's order is part of the checkpoint. Each epoch's order is a permutation seeded from
(seed, epoch), and the DataLoader is fed batch descriptors (epoch, batch_index, indices) rather than
row indices, so a resume restarts from the exact next batch. Whatever randomness a batch uses
(augmentation) is seeded from (seed, epoch, batch_index) just before it is fetched, so it does not
depend on which worker gets the batch or on what the process did before.

Under `run.epochs` each batch is one step; the loop says when a step may start and counts it
through `StepHooks`, so the loader never reaches into the Run.
"""

from __future__ import annotations

import contextlib
import dis
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import NoReturn, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

from kchain.runtime import distributed


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; unlike hash() it is the same in every process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class StepHooks(Protocol):
    """What an epoch loop gives the loader whose batches are its steps (run.epochs sets it)."""

    def may_start(self) -> bool: ...  # False once the loop must end before another step

    def stopping(self) -> bool: ...  # that end is a deadline or signal stop, not the step cap

    def stop_here(self) -> NoReturn: ...  # save the state as it is now and raise SessionStopped

    def begin(self) -> int: ...  # a batch is handed out: the step it is (its timer starts)

    def end(self, step: int) -> None: ...  # that step's body ran to its end: count it, maybe save

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
        s = _mix_seed(self.seed, epoch, batch_index)
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


def dataloader_options(cuda: bool, num_workers: int, pin_memory: bool | None, *, persistent_workers: bool | None,
                       prefetch_factor: int | None, pin_memory_device: str, timeout: float, worker_init_fn,
                       multiprocessing_context, generator, in_order: bool) -> tuple[bool, dict, list[str]]:
    """Every DataLoader argument run.loader takes, honoured where it applies and harmless where it does
    not (the code written for Kaggle's GPUs runs as it is on the laptop's CPU): (pin_memory, the
    DataLoader options, lines that say what was set aside and why).

    Pinned memory only helps a copy to CUDA (the default: pinned on CUDA); workers are persistent
    whenever there are any (the loader keeps them across epochs itself); prefetch_factor needs workers;
    the order comes from params.seed and the epoch, never a generator (so a resume is exact)."""
    pin = cuda if pin_memory is None else bool(pin_memory) and cuda
    options: dict = {"timeout": timeout, "worker_init_fn": worker_init_fn, "in_order": in_order}
    if num_workers > 0:
        options["multiprocessing_context"] = multiprocessing_context
        options["prefetch_factor"] = prefetch_factor
    if pin and pin_memory_device:
        options["pin_memory_device"] = pin_memory_device
    notes = []
    if generator is not None:
        notes.append("generator= is not used: the order is drawn from params.seed and the epoch, so a resume "
                     "goes on with the same shuffle")
    del persistent_workers  # workers are kept across epochs whenever there are any
    return pin, options, notes


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
    s = _mix_seed(seed, epoch)
    own = getattr(holder, "generator", None)
    with _seeded_global_rngs(s):
        if own is not None:
            holder.generator = torch.Generator().manual_seed(s)
        try:
            return [list(b) if isinstance(b, (list, tuple)) else b for b in source]
        finally:
            if own is not None:
                holder.generator = own


NOT_SHARDED = ("build the DataLoader without a DistributedSampler (e.g. timm's create_loader(..., "
               "distributed=False))")


def refuse_sharded(what: str, sampler, batch_sampler, fix: str = NOT_SHARDED) -> None:
    """Refuse a sampler already sharded across ranks (torch's DistributedSampler; timm's, Hugging Face's
    and any other with `num_replicas`), given as itself or as a batch_sampler's sampler: the Loader
    shards each batch across the ranks itself, so each rank would read 1/N² of the data, and nothing
    else would say so (timm's 2-rank loader: 10 updates an epoch in place of 20, smoke and rehearse passing).

    `what` names what was passed, e.g. "run.loader(DataLoader)"; `fix` says what to pass instead."""
    for where, source in (("sampler", sampler), ("batch_sampler's sampler", getattr(batch_sampler, "sampler", None)),
                          ("batch_sampler", batch_sampler)):
        n = getattr(source, "num_replicas", None) if source is not None else None
        if n is not None:
            # refused at 1 replica too: a smoke's one rank would pass the code that Kaggle's two shard twice
            share = f"1/{n * n} of the data in place of 1/{n}" if isinstance(n, int) and n > 1 else \
                "1/N² of the data in place of 1/N (N ranks)"
            raise TypeError(f"{what}: its {where} is a {type(source).__name__} (num_replicas={n}), already sharded "
                            f"across the ranks; kchain shards each batch across the ranks itself, so each rank "
                            f"would read {share}: {fix}")


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
        options: dict | None = None,
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
        self.hooks: StepHooks | None = None  # the epoch loop whose steps these batches are (run.epochs)
        # A framework's loop (hf_accelerate.py): a step may span several batches (gradient accumulation);
        # `step_done()` says, after a batch's body, whether it ended one (None: every batch is a step).
        self.step_done: Callable[[], bool] | None = None
        self.batches_per_step = 1  # for the loop's total: batches of an epoch per step (its last one may be short)
        self.place: Callable | None = None  # a batch moved where the step uses it, as it is handed out
        self._on_wait = on_wait
        self._it: Iterator | None = None
        self._skip = 0  # batches of an iterable epoch to drop after a resume
        self._drawn: tuple[int, list] | None = None
        # Its own generator: DataLoader draws a base seed per iterator, which must not come from
        # (and shift) the global torch RNG that dropout uses. Reseeded per epoch (see _fetch).
        self._gen = torch.Generator().manual_seed(seed)
        self.dataloader = self._build_dataloader(collate_fn or default_collate, num_workers, pin_memory, options or {})

    def _build_dataloader(self, collate_fn: Callable, num_workers: int, pin_memory: bool,
                          options: dict) -> DataLoader:
        """The torch DataLoader underneath: fed batch descriptors by _Descriptors, or the stream itself.
        `options`: the DataLoader arguments that apply here (dataloader_options)."""
        if self.iterable:
            return DataLoader(
                self.dataset, batch_size=self.batch_size, num_workers=num_workers, drop_last=self.drop_last,
                collate_fn=collate_fn, pin_memory=pin_memory, persistent_workers=False, generator=self._gen,
                **options,
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
            **options,
        )

    def steps_per_epoch(self) -> int:
        """The steps an epoch of this loader gives under run.epochs."""
        return -(-len(self) // self.batches_per_step)

    def __len__(self):
        if self.iterable:
            return len(self.dataloader)  # TypeError when the stream has no length, as DataLoader does
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        bs = self.batch_size
        assert bs is not None  # run.loader refuses a loader with neither batch_size nor batch_sampler
        if self.world_size > 1:  # kchain ddp: global batches; each rank takes one micro-batch of each
            return distributed.batches_per_rank(n, bs, self.world_size, self.drop_last)
        return n // bs if self.drop_last else -(-n // bs)

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(self.seed, epoch)))

    def batches(self, epoch: int) -> list[list[int]]:
        """The index lists of every batch of `epoch` (drawn once per epoch)."""
        if self._drawn is not None and self._drawn[0] == epoch:
            return self._drawn[1]
        if self.batch_sampler is not None:
            out = _draw(self.batch_sampler, self.seed, epoch)
        else:
            idx = _draw(self.sampler, self.seed, epoch) if self.sampler is not None else self.order(epoch).tolist()
            bs = self.batch_size
            assert bs is not None  # run.loader refuses a loader with neither batch_size nor batch_sampler
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
            self._gen.manual_seed(_mix_seed(self.seed, self.epoch))  # worker seeds depend on the epoch only
            self._it = iter(self.dataloader)
            if self.iterable:
                for _ in range(self._skip):  # replay the stream up to where the checkpoint was
                    next(self._it)
                self._skip = 0
        t0 = time.perf_counter()
        batch = next(self._it)
        if self._on_wait:
            self._on_wait(time.perf_counter() - t0)
        self.position += 1
        return batch if self.place is None else self.place(batch)

    def _epoch_done(self) -> bool:
        """Every batch of this epoch was handed out (unknown for a stream without a length: False)."""
        n = self._length()
        return n is not None and self.position >= n

    def next_epoch(self):
        self.epoch += 1
        self.position = 0
        self._it = None

    def __next__(self):
        try:
            return self._fetch()
        except StopIteration:
            self.next_epoch()
            return self._fetch()  # an empty dataset raises StopIteration here, as it should

    def __iter__(self):
        hooks = self.hooks
        if hooks is None and self._epoch_done():
            # A consumer that reads exactly len(loader) batches and stops (Lightning's fit loop, a
            # `for i, b in zip(range(len(loader)), loader)`) never asks for the end: a new pass is
            # the next epoch, not the empty rest of the last one. (Under run.epochs the end is asked
            # for, and a resume at an epoch's last batch must give that epoch's code its turn.)
            self.next_epoch()
        step = None  # the step the batches handed out belong to, until one ends it (step_done)
        while True:
            if hooks is not None and step is None and not hooks.may_start():
                if not hooks.stopping():
                    return  # the step cap: the epoch loop ends here and saves
                if not self._epoch_done():
                    hooks.stop_here()  # a stop mid-epoch: saved here; the rest of the epoch's code never runs
                # A stop after the epoch's last batch: the epoch is complete, so its own code (a
                # scheduler step, an evaluation) runs; run.epochs then saves and stops.
                self.next_epoch()
                return
            try:
                batch = self._fetch()
            except StopIteration:
                self.next_epoch()
                return
            if hooks is None:
                yield batch
                continue
            if step is None:
                step = hooks.begin()
            try:
                yield batch
            except GeneratorExit:
                if left_on_purpose():  # `break` out of the batches: the batch counts as done
                    hooks.end(step)
                raise
            if self.step_done is None or self.step_done() or self._epoch_done():
                hooks.end(step)
                step = None

    def close(self) -> None:
        """End the worker processes now. Left to the garbage collector (the loader and its sampler
        hold each other), torch's shutdown of persistent workers waits up to 5 s for each worker."""
        it, self._it = self._it, None
        self.dataloader._iterator = None  # persistent workers: the DataLoader keeps its iterator too
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

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
