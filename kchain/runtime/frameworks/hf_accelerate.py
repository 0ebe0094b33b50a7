"""Hugging Face Accelerate under kchain: the script keeps its Accelerator and its own loop.

Two lines of an `accelerate` script change (nothing else; the names are accelerate's):

    accelerator = run.accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)  # was Accelerator(...)
    for epoch in run.epochs(num_epochs):                                                   # was range(num_epochs)

`run.accelerator(**kwargs)` is a real `accelerate.Accelerator` (accelerate 1.15: a subclass, KchainAccelerator,
built with the same arguments). What it does differently, all of it in this module:
- The process group. kchain's ranks are its processes: under two ranks (Kaggle's T4s, or gloo ranks on the
  CPU, where ACCELERATE_USE_CPU is set by the Run) accelerate finds the group kchain made and wraps the
  model in its DDP over it. No `accelerate launch`, no second launcher; an Accelerator that counts another
  number of processes is refused.
- The training data. `prepare(...)` hands back, for the training DataLoader (the first one it is given
  whose sampler is not sequential; the first one when all are), a kchain Loader instead of accelerate's
  DataLoaderShard: each epoch's order drawn from (params.seed, epoch), each rank's share of a global
  batch of batch_size per rank (as accelerate's sharding gives), batches moved to the device, the position
  in the checkpoint, so a resume goes on at the next batch without reading the ones before it. In a smoke
  it reads smoke.fraction of the rows, and a sequential (evaluation) DataLoader the same share of its
  rows. The other DataLoaders are accelerate's as usual (an evaluation restarts by design).
- The steps. `for epoch in run.epochs(N)` drives the loop: a step is one optimizer step, so with
  `gradient_accumulation_steps=A` and `accelerator.accumulate(model)` it is A batches (the epoch's last
  step may be shorter: accelerate syncs at the end of the DataLoader, and the Loader tells its GradientState
  where that end is). Between two steps (never inside an accumulation) kchain counts, saves on
  train.checkpoint_every and stops at the deadline guard or on SIGTERM: the state is saved and
  SessionStopped leaves the loop, nothing of the unfinished epoch runs. A step ends when a prepared
  optimizer's step() ran with the gradients synced (an fp16 step the scaler skipped counts, as in
  accelerate), so a hand-written accumulation (`if step % A == 0: optimizer.step()`) steps where it does.
- The state. Everything `save_state` would write is tracked in kchain's verified checkpoint, not in
  files of accelerate's: each prepared model (`model`, `model2`, ...), optimizer, scheduler, the fp16
  GradScaler (`scaler`), each `register_for_checkpointing` object (`custom_checkpoint`, ...) and
  `accelerator.step` (`accelerator`); the RNG states are every checkpoint's own. `save_state`,
  `load_state` and `skip_first_batches` on the training Loader are refused with one line saying what to
  delete: kchain saves and resumes by itself.
- Mixed precision. On the CPU (the smoke) `mixed_precision` is off, said in one line, as train.precision
  runs the CPU in fp32; on the GPU it is accelerate's.
- The trace. `accelerator.log(values)` also logs the numbers to kchain's trace at kchain's step (what
  the smoke and a rehearsal compare), besides the trackers of `init_trackers`.

accelerate's private parts used, all in this module: GradientState's list of the DataLoaders being
read (`_add_dataloader`), which `accumulate` and `gather_for_metrics` read the end of the epoch from.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from kchain.common.say import say
from kchain.runtime.loader import Loader
from kchain.runtime.loader import subset as cut
from kchain.runtime.loop import Loop

OUTSIDE_EPOCHS = ("the prepared training DataLoader is read outside run.epochs: write `for epoch in "
                  "run.epochs(num_epochs):` in place of `for epoch in range(num_epochs):` (kchain counts its "
                  "steps, saves and resumes mid-epoch there)")
SAVE_STATE = ("accelerator.save_state(...): kchain saves the Accelerator's state itself (models, optimizers, "
              "schedulers, scaler, RNG states, registered objects) on train.checkpoint_every, at the deadline "
              "and on SIGTERM; delete this call")
LOAD_STATE = ("accelerator.load_state(...): kchain restores its newest checkpoint itself when run.epochs "
              "starts; delete this call and the resume code around it (starting_epoch, skip_first_batches)")
SKIP = ("accelerator.skip_first_batches(train_dataloader, ...): kchain's loader resumes at its own position; "
        "delete the call and read train_dataloader")
ITERABLE = ("data order: the training DataLoader reads an IterableDataset; a resume replays its epoch and skips "
            "the batches already trained, exact only if the stream yields the same items each time")


class AccelerateSetupError(RuntimeError):
    """The Accelerator is used in a way kchain cannot checkpoint; the message says what to write."""


def framework():
    """The accelerate package, or one line that says how to get it."""
    try:
        import accelerate
    except ImportError:
        raise AccelerateSetupError("run.accelerator(): accelerate is not installed; on the laptop: pip install "
                                   "'kchain[accelerate]' (Kaggle's image has it)") from None
    return accelerate


def accelerator(loop: Loop, make_loader, fraction: float | None, device: torch.device, kwargs: dict):
    """run.accelerator(**kwargs): a KchainAccelerator over this run's loop driver.

    `make_loader(dataloader, fraction)` rebuilds a DataLoader as a kchain Loader (counted by the loop, not
    tracked: this module tracks it); `fraction` is smoke.fraction in a smoke, None outside one."""
    if Bridge.NAME in loop.ckpt.tracked:
        raise AccelerateSetupError("run.accelerator() was called twice: one Accelerator serves the session's "
                                   "loop; keep the one you made")
    accelerate = framework()
    asked = kwargs.get("mixed_precision")
    if device.type == "cpu" and asked is not None and str(asked) != "no":
        say(f"accelerate: mixed_precision={str(asked)!r} is off on the CPU (fp32, as train.precision runs it)")
        kwargs = {**kwargs, "mixed_precision": "no"}
    kind = type("KchainAccelerator", (Bridge, accelerate.Accelerator), {})
    return kind(loop, make_loader, fraction, **kwargs)


if TYPE_CHECKING:
    _Accelerator = Any  # the class Bridge is mixed into (accelerate's, read as Any): its attributes and super()
else:
    _Accelerator = object


class Bridge(_Accelerator):
    """What KchainAccelerator changes of accelerate's Accelerator (this class mixed in before it)."""

    NAME = "accelerator"  # the tracked name of accelerator.step

    def __init__(self, loop: Loop, make_loader, fraction: float | None, **kwargs):
        self._kc_loop, self._kc_make_loader, self._kc_fraction = loop, make_loader, fraction
        self._kc_train: DataLoader | None = None  # the DataLoader prepare() rebuilds as the training Loader
        self._kc_loader: Loader | None = None
        self._kc_stepped = False  # a prepared optimizer stepped (gradients synced) since the last step's end
        super().__init__(**kwargs)
        ranks = loop.ranks
        if self.num_processes != ranks.world_size:
            raise AccelerateSetupError(
                f"kchain runs {ranks.world_size} rank(s) but the Accelerator counts {self.num_processes} "
                f"process(es) ({self.distributed_type}): leave cpu= and the launcher to kchain (its ranks are the "
                "Accelerator's processes)")
        if ranks.active:
            say(f"accelerate: the Accelerator's {self.distributed_type} runs over kchain's {ranks.world_size} ranks")
        loop.ckpt.track(self.NAME, Step(self))
        if self.scaler is not None:
            loop.ckpt.track(loop.ckpt.free_name("scaler"), self.scaler)

    # --- prepare ---------------------------------------------------------------------------------------

    def prepare(self, *args, device_placement=None):
        if self._kc_loader is None:
            loaders = [a for a in args if isinstance(a, DataLoader)]
            shuffled = [dl for dl in loaders if not isinstance(dl.sampler, SequentialSampler)]
            self._kc_train = (shuffled or loaders or [None])[0]
        return super().prepare(*args, device_placement=device_placement)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if data_loader is self._kc_train:
            self._kc_train = None  # not held: kchain's loop would name it a DataLoader that restarts its order
            return self._kc_training_loader(data_loader, device_placement)
        return super().prepare_data_loader(smoke_cut(data_loader, self._kc_fraction, self.num_processes),
                                           device_placement=device_placement,
                                           slice_fn_for_dispatch=slice_fn_for_dispatch)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        ckpt = self._kc_loop.ckpt
        if evaluation_mode:
            ckpt.cover(f"accelerate_eval_{len(ckpt.covered)}", prepared)  # not trained: not in the checkpoint
        else:
            ckpt.track(ckpt.free_name("model"), prepared)
        return prepared

    def prepare_optimizer(self, optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if not getattr(prepared, "_kc_counted", False):
            prepared.step = functools.partial(_counted_step, self, prepared.step)
            prepared._kc_counted = True
            self._kc_loop.ckpt.track(self._kc_loop.ckpt.free_name("optimizer"), prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        self._kc_loop.ckpt.track(self._kc_loop.ckpt.free_name("scheduler"), prepared)
        return prepared

    def register_for_checkpointing(self, *objects):
        super().register_for_checkpointing(*objects)
        for obj in objects:
            self._kc_loop.ckpt.track(self._kc_loop.ckpt.free_name("custom_checkpoint"), obj)

    def _kc_training_loader(self, dl: DataLoader, device_placement) -> Loader:
        """The training DataLoader as a kchain Loader whose steps are the optimizer's (see the module)."""
        if not self.gradient_state.sync_with_dataloader:
            raise AccelerateSetupError("GradientAccumulationPlugin(sync_with_dataloader=False) carries an "
                                       "accumulation over an epoch's end; kchain's steps end with the epoch: "
                                       "leave sync_with_dataloader at True")
        if self.split_batches:
            raise AccelerateSetupError("Accelerator(split_batches=True) splits each batch over the processes; "
                                       "kchain's loader gives each rank batch_size rows: leave split_batches "
                                       "False and give the DataLoader the batch size of one process")
        lo = self._kc_make_loader(dl, self._kc_fraction)
        if lo.iterable:
            self._kc_loop.progress.not_exact.append(ITERABLE)
        ckpt = self._kc_loop.ckpt
        ckpt.track(ckpt.free_name("loader"), lo)
        lo.batches_per_step = max(1, int(self.gradient_accumulation_steps))
        lo.step_done = self._kc_step_done
        place = self.device_placement if device_placement is None else device_placement
        lo.place = functools.partial(_placed, lo, self.device if place else None, self.non_blocking)
        self._kc_loader = lo
        self._kc_end = EpochEnd(lo)  # held here: GradientState keeps a weak reference
        self.gradient_state._add_dataloader(self._kc_end)
        return lo

    def _kc_step_done(self) -> bool:
        """After a batch's body: did it end an optimizer step (every batch does without a prepared optimizer)."""
        done, self._kc_stepped = self._kc_stepped or not self._optimizers, False
        return done

    # --- what kchain does instead -----------------------------------------------------------------------

    def save_state(self, *args, **kwargs):
        raise AccelerateSetupError(SAVE_STATE)

    def load_state(self, *args, **kwargs):
        raise AccelerateSetupError(LOAD_STATE)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        if dataloader is self._kc_loader:
            raise AccelerateSetupError(SKIP)
        return super().skip_first_batches(dataloader, num_batches)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        """accelerate's log (its trackers, on the main process), and the numbers in kchain's trace at
        kchain's step (the step= given is the script's own count)."""
        super().log(values, step=step, log_kwargs=log_kwargs or {})
        plain = {k: v.item() for k, v in values.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        plain.update({k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if plain:
            p = self._kc_loop.progress
            self._kc_loop.trace.log(p.current or p.step, plain)


def _counted_step(acc: Bridge, step, *args, **kwargs):
    """A prepared optimizer's step(): accelerate's, noting that an optimizer step ended (gradients synced)."""
    if acc.gradient_state.sync_gradients:
        acc._kc_stepped = True
    return step(*args, **kwargs)


def _placed(lo: Loader, device: torch.device | None, non_blocking: bool, batch):
    """A training batch as the Loader hands it out: on the device (accelerate's device_placement)."""
    if lo.hooks is None:
        raise AccelerateSetupError(OUTSIDE_EPOCHS)
    if device is None:
        return batch
    from accelerate.utils import send_to_device

    return send_to_device(batch, device, non_blocking=non_blocking)


class Step:
    """accelerator.step (the batches of the open accumulation, 0 after an epoch's end) as tracked state."""

    def __init__(self, acc):
        self.acc = acc

    def state_dict(self) -> dict:
        return {"step": int(self.acc.step)}

    def load_state_dict(self, state: dict) -> None:
        self.acc.step = int(state["step"])


class EpochEnd:
    """The training Loader as accelerate's GradientState reads a DataLoader being iterated: whether the
    batch handed out is its epoch's last (then `accumulate` syncs, and its step counter starts over), and
    how many rows of the last global batch are real (`gather_for_metrics` drops the padding)."""

    def __init__(self, lo: Loader):
        self.lo = lo

    @property
    def end_of_dataloader(self) -> bool:
        return self.lo.hooks is not None and self.lo.position >= len(self.lo)

    @property
    def remainder(self) -> int:
        lo = self.lo
        if lo.batch_sampler is not None or lo.iterable or not lo.batch_size:
            return -1
        rows = len(lo.sampler) if lo.sampler is not None else len(lo.dataset)
        return 0 if lo.drop_last else rows % (lo.batch_size * lo.world_size)


def smoke_cut(dl: DataLoader, fraction: float | None, ranks: int) -> DataLoader:
    """In a smoke, a sequential (evaluation) DataLoader over smoke.fraction of its rows, at least a batch
    per rank; any other DataLoader, or one outside a smoke, as it is."""
    dataset = dl.dataset
    if fraction is None or not isinstance(dl.sampler, SequentialSampler) or not dl.batch_size \
            or isinstance(dataset, IterableDataset) or getattr(dataset, "kchain_subset", False) or not len(dataset):
        return dl
    rows = cut(dataset, min(1.0, max(fraction, dl.batch_size * ranks / len(dataset))))
    return DataLoader(rows, batch_size=dl.batch_size, shuffle=False, num_workers=dl.num_workers,
                      collate_fn=dl.collate_fn, pin_memory=dl.pin_memory, drop_last=dl.drop_last)
