"""Lightning Fabric under kchain: the script keeps its Fabric and its own loop.

Two lines of a Fabric script change (nothing else; the names are Fabric's):

    fabric = run.fabric(accelerator="cuda", devices="auto", precision="16-mixed")   # was Fabric(...)
    for epoch in run.epochs(num_epochs):                                            # was range(num_epochs)

`run.fabric(**kwargs)` is a real `lightning.fabric.Fabric` (lightning 2.6: a subclass, KchainFabric, built
with the same arguments). What it does differently, all of it in this module:
- The processes. kchain's ranks are Fabric's: under two ranks Fabric's DDP finds the process group kchain
  made (LOCAL_RANK is set: the processes are created outside it; run.fabric launches it, so a script's
  own `fabric.launch()` is a no-op and a script run by `fabric run` needs none); a strategy that spawns
  processes (ddp_spawn) is refused. On the CPU
  stand-in for Kaggle's GPUs (gloo ranks) devices="auto" counts kchain's ranks, accelerator="cuda" runs on
  the CPU and a 16-bit precision is fp32 (said in one line each). A Fabric that runs another number of
  processes is refused.
- The training data. `setup_dataloaders(...)` hands back, for the training DataLoader (the first one
  whose sampler is not sequential; the first one when all are), a kchain Loader: each epoch's order
  from (params.seed, epoch), each rank's share of a global batch, batches on Fabric's device, the position
  in the checkpoint (a resume goes on at the next batch without reading the ones before it). In a smoke
  it and a sequential (evaluation) DataLoader read smoke.fraction of their rows. The other DataLoaders
  are Fabric's.
- The steps. `for epoch in run.epochs(N)` drives the loop: a step ends at the batch after which a set-up
  optimizer stepped (`optimizer.step()`), so a hand-written accumulation (`no_backward_sync` and a step
  every A batches) is one step, and kchain saves and stops between two steps only. The epoch's last
  batch ends a step too. `run.fabric(..., accumulate=A)` (kchain's one argument, taken out before
  Fabric sees the rest) makes run.total N times the steps of an epoch, ceil(batches / A). A loop that
  counts its accumulation with `enumerate(train_loader)` counts from the loader's position after a
  resume mid-epoch: `enumerate(train_loader, train_loader.position)`.
- The state. The set-up module (`model`, ...), each optimizer (`optimizer`, ...), the scheduler given to
  `setup(..., scheduler=)` (`scheduler`), the fp16 GradScaler of "16-mixed" (`scaler`) and the loader
  (`loader`) are tracked in kchain's checkpoint, the
  RNG states with them. `fabric.save(...)` writes its file as usual (an export, your output: no session
  resumes from it); `fabric.load(...)` is refused with one line saying what to delete (`load_raw`, a
  plain weights file, stays). `model.training_step(batch)` called on the set-up
  module goes through DDP's forward (Fabric's own forward redirection), so the replicas check sees the
  ranks' weights agree.
- The trace. `fabric.log(...)` / `fabric.log_dict(...)` also log the numbers to kchain's trace at kchain's
  step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, SequentialSampler

from kchain.common.say import say
from kchain.runtime.frameworks.hf_accelerate import OUTSIDE_EPOCHS, smoke_cut
from kchain.runtime.frameworks.lightning import loaded_or_imported
from kchain.runtime.loader import Loader
from kchain.runtime.loop import Loop

LOAD = ("fabric.load(...): kchain restores its newest checkpoint itself when run.epochs starts; delete this call "
        "and the resume code around it (the start epoch or step read back from the state)")
SIXTEEN = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "16", "bf16", "transformer-engine")


class FabricSetupError(RuntimeError):
    """Fabric is used in a way kchain cannot checkpoint; the message says what to write."""


def framework():
    """The Fabric package the code uses: lightning.fabric, or lightning_fabric (the one it imported first)."""
    fabric = loaded_or_imported(("lightning.fabric", "lightning_fabric"))
    if fabric is None:
        raise FabricSetupError("run.fabric(): Lightning Fabric is not installed; on the laptop: pip install "
                               "'kchain[lightning]' (Kaggle's image has it)")
    return fabric


def fabric(loop: Loop, make_loader, fraction: float | None, device: torch.device, kwargs: dict):
    """run.fabric(**kwargs): a KchainFabric over this run's loop driver (see hf_accelerate.accelerator)."""
    lf = framework()
    kwargs = dict(kwargs)
    accumulate = int(kwargs.pop("accumulate", 1))  # kchain's: the batches of a step, for run.total
    if device.type == "cpu":
        if str(kwargs.get("accelerator", "auto")) in ("cuda", "gpu", "mps"):
            say(f"fabric: accelerator={kwargs['accelerator']!r} runs on the CPU here (no CUDA device)")
            kwargs["accelerator"] = "cpu"
        if str(kwargs.get("precision")) in SIXTEEN:
            say(f"fabric: precision={str(kwargs['precision'])!r} is fp32 on the CPU (as train.precision runs it)")
            kwargs["precision"] = "32-true"
    ranks = loop.ranks
    if ranks.active and ranks.backend == "gloo":
        # The CPU stands in for Kaggle's GPUs (one gloo rank each): devices="auto" means kchain's ranks.
        lf.accelerators.CPUAccelerator.auto_device_count = staticmethod(lambda: ranks.world_size)
    kind = type("KchainFabric", (Bridge, lf.Fabric), {})
    return kind(loop, make_loader, fraction, accumulate, **kwargs)


if TYPE_CHECKING:
    _Fabric = Any  # the class Bridge is mixed into (Lightning's Fabric, read as Any): its attributes and super()
else:
    _Fabric = object


class Bridge(_Fabric):
    """What KchainFabric changes of Fabric (this class mixed in before it)."""

    def __init__(self, loop: Loop, make_loader, fraction: float | None, accumulate: int, **kwargs):
        self._kc_loop, self._kc_make_loader, self._kc_fraction = loop, make_loader, fraction
        self._kc_accumulate = max(1, accumulate)
        self._kc_loader: Loader | None = None
        self._kc_stepped = False  # a set-up optimizer stepped since the last step's end
        self._kc_optimizers: list = []
        super().__init__(**kwargs)
        if self.world_size != loop.ranks.world_size:
            raise FabricSetupError(
                f"kchain runs {loop.ranks.world_size} rank(s) but Fabric runs {self.world_size} process(es) "
                f"({type(self.strategy).__name__}): give Fabric devices='auto' and strategy 'auto' or 'ddp' "
                "(kchain's ranks are its processes), or set train.gpus to the devices it uses")
        if type(self.strategy.launcher).__name__ == "_MultiProcessingLauncher":
            raise FabricSetupError(f"Fabric's strategy {type(self.strategy).__name__} starts processes of its own; "
                                   "kchain's ranks are the processes: give Fabric strategy 'auto' or 'ddp'")
        if loop.ranks.active:
            say(f"fabric: {type(self.strategy).__name__} runs over kchain's {loop.ranks.world_size} ranks")
        super().launch()  # the processes exist (kchain's ranks): this sets up the strategy; a launch() of the
        # script's own is then a no-op (or runs the function it is given), and a script without one runs too
        scaler = getattr(self._precision, "scaler", None)  # "16-mixed" on a GPU: Fabric's GradScaler
        if scaler is not None:
            loop.ckpt.track(loop.ckpt.free_name("scaler"), scaler)

    # --- setup ----------------------------------------------------------------------------------------

    def setup(self, module, *optimizers, scheduler=None, **kwargs):
        out = super().setup(module, *optimizers, scheduler=scheduler, **kwargs)
        parts = out if isinstance(out, tuple) else (out,)
        self._kc_track_module(parts[0])
        for opt in parts[1:1 + len(optimizers)]:
            self._kc_track_optimizer(opt)
        if scheduler is not None:
            self._kc_loop.ckpt.track(self._kc_loop.ckpt.free_name("scheduler"), scheduler)
        return out

    def setup_module(self, module, *args, **kwargs):
        out = super().setup_module(module, *args, **kwargs)
        self._kc_track_module(out)
        return out

    def setup_optimizers(self, *optimizers):
        out = super().setup_optimizers(*optimizers)
        for opt in out if isinstance(out, tuple) else (out,):
            self._kc_track_optimizer(opt)
        return out

    def _kc_track_module(self, module) -> None:
        ckpt = self._kc_loop.ckpt
        ckpt.track(ckpt.free_name("model"), module)

    def _kc_track_optimizer(self, opt) -> None:
        if any(o is opt for o in self._kc_optimizers):
            return
        self._kc_optimizers.append(opt)
        opt.step = functools.partial(_counted_step, self, opt.step)
        ckpt = self._kc_loop.ckpt
        ckpt.track(ckpt.free_name("optimizer"), opt.optimizer)  # the torch optimizer (the replicas check reads it)

    def setup_dataloaders(self, *dataloaders, use_distributed_sampler: bool = True, move_to_device: bool = True):
        self._validate_setup_dataloaders(dataloaders)
        if self._kc_loader is None:
            shuffled = [dl for dl in dataloaders if not isinstance(dl.sampler, SequentialSampler)]
            train = (shuffled or list(dataloaders) or [None])[0]
        else:
            train = None
        out = [self._kc_training_loader(dl, move_to_device) if dl is train else
               self._setup_dataloader(smoke_cut(dl, self._kc_fraction, self.world_size),
                                      use_distributed_sampler=use_distributed_sampler, move_to_device=move_to_device)
               for dl in dataloaders]
        return out[0] if len(out) == 1 else out

    def _kc_training_loader(self, dl: DataLoader, move_to_device: bool) -> Loader:
        lo = self._kc_make_loader(dl, self._kc_fraction)
        ckpt = self._kc_loop.ckpt
        ckpt.track(ckpt.free_name("loader"), lo)
        lo.step_done = self._kc_step_done
        lo.batches_per_step = self._kc_accumulate
        lo.place = functools.partial(_placed, self, lo, move_to_device)
        self._kc_loader = lo
        return lo

    def _kc_step_done(self) -> bool:
        done, self._kc_stepped = self._kc_stepped or not self._kc_optimizers, False
        return done

    # --- what kchain does instead -----------------------------------------------------------------------

    def load(self, *args, **kwargs):
        raise FabricSetupError(LOAD)

    def log_dict(self, metrics, step: int | None = None) -> None:
        """Fabric's log_dict (its loggers), and the numbers in kchain's trace at kchain's step."""
        super().log_dict(metrics, step=step)
        plain = {k: v.item() for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        plain.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if plain:
            p = self._kc_loop.progress
            self._kc_loop.trace.log(p.current or p.step, plain)


def _counted_step(fab: Bridge, step, *args, **kwargs):
    """A set-up optimizer's step(): Fabric's, noting that an optimizer step ended."""
    fab._kc_stepped = True
    return step(*args, **kwargs)


def _placed(fab, lo: Loader, move: bool, batch):
    """A training batch as the Loader hands it out: on Fabric's device."""
    if lo.hooks is None:
        raise FabricSetupError(OUTSIDE_EPOCHS)
    return fab.to_device(batch) if move else batch
