"""The Lightning Trainer under kchain: `trainer.fit` keeps its loop, kchain owns its checkpoints.

A script keeps `trainer.fit(model, datamodule)`; one line changes:

    trainer = Trainer(..., callbacks=[run.lightning_callback()])

No CheckpointIO plugin is needed: the Trainer never writes or reads a checkpoint file of its own
under kchain. What the callback takes over (pytorch_lightning 2.6; `lightning.pytorch` alike):
- The data order. The Trainer's training DataLoader is rebuilt as a kchain Loader (run.loader's:
  each epoch's order drawn from (params.seed, epoch), the randomness inside a batch seeded per batch,
  the position counted), and the Trainer iterates it through `Batches`, whose every batch first
  passes the step boundary. Lightning's own resume restarts an unfinished epoch's data (measured:
  0.176 loss difference) unless the loader is stateful; this one is, and its position is taken
  where it is clean (below). Each Trainer epoch starts the loader at that epoch (a limit_train_batches
  that ends an epoch early does not leave the next one empty).
- When and where to save, and the stops. The boundary is the moment the Trainer asks for the next
  training batch: the step before it is complete (its validation, its epoch's end, the logging) and
  nothing of the next has run, so the state there is the one an uninterrupted fit has there. At a
  boundary after an optimizer step (never inside a gradient accumulation) the loop driver counts the
  step, saves on train.checkpoint_every, and stops at the deadline guard or on SIGTERM/SIGINT (kchain's
  handlers replace Lightning's for the fit, so no SIGTERMException pre-empts the save): the state is
  saved and SessionStopped leaves trainer.fit() (status deadline or interrupted). The checkpoint holds
  the Trainer's own checkpoint dict (`dump_checkpoint`: model, optimizers, schedulers, precision
  plugin, loops' progress, callbacks' states such as EarlyStopping's, the datamodule's state) with the
  loaders' positions, beside kchain's RNG states, per rank.
- The resume. At the fit's setup the newest kchain checkpoint is restored and handed to the Trainer
  as the checkpoint it loads (its model, callbacks and training state, as `fit(ckpt_path=...)` would,
  without a file); the loaders get their positions back, and at the first boundary the RNG states are
  put back once more (whatever model.setup or configure_model drew after the restore is undone) and
  the loggers' step counter too (Lightning adds one when it restarts after a validation).
- The status. The Trainer reaching its max_steps or max_epochs is `finished`; a stop before it
  (EarlyStopping, `trainer.should_stop = True`, max_time) is `stopped`, and the chain ends. run.total
  is the Trainer's `estimated_stepping_batches` after kchain's caps; run.step its global_step.
- The trace. Every optimizer step logs, at its end, what training_step returned (its loss) and what
  was logged on step during it (never a value left from an earlier step); every validation logs its
  metrics. Validation DataLoaders without a generator get one of their own, so starting their
  iterators (the sanity check's in one run, the first validation's in a resumed one) never draws
  from the global RNG the training uses.
- The smoke. The Trainer's max_steps is capped (smoke.steps, KCHAIN_TOTAL_STEPS), the training set is
  cut to smoke.fraction as run.subset cuts it (at least one batch per rank), validation to the same
  share of its batches (limit_val_batches), and the loggers log every step.
- Two ranks. kchain's torchrun ranks are the Trainer's DDP processes: Lightning finds the process
  group kchain made and uses it; on the CPU stand-in for Kaggle's two GPUs (gloo ranks), devices="auto"
  counts kchain's ranks. A Trainer that runs another number of processes is refused at its setup.
- Lightning's default ModelCheckpoint (the one the Trainer adds by itself) is taken out: kchain's
  checkpoint replaces it. A ModelCheckpoint you configured (monitor=, dirpath=, save_top_k=...) keeps
  writing its files; they are your outputs, never what a session resumes from.

Lightning's private parts used, all in this module: the checkpoint connector (dump, and the dict it
loads), the fit and validation loops' data sources, the epoch loop's logger step counter and the
logged values of the running loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from kchain.common.say import say
from kchain.runtime.checkpoint.snapshot import restore_rng, rng_state
from kchain.runtime.loader import Loader
from kchain.runtime.loop import Loop

NAME = "lightning"  # the tracked name of the Trainer's state in kchain's checkpoint
NOT_POSITIONED = ("data order: the Trainer's training data is a {kind}, not a DataLoader kchain can rebuild: a "
                  "resume restarts its epoch; return a DataLoader from train_dataloader()")
NO_LENGTH = ("data order: the training DataLoader has no length, so Lightning fetches a batch ahead and a "
             "checkpoint counts one batch too many; give the dataset a __len__")
ITERABLE = ("data order: the training DataLoader reads an IterableDataset; a resume replays its epoch and skips "
            "the batches already trained, exact only if the stream yields the same items each time")


class LightningSetupError(RuntimeError):
    """The Trainer is set up in a way kchain cannot checkpoint; the message says what to write."""


def loaded_or_imported(names: tuple[str, ...]) -> Any:
    """The first of the packages the code already imported (it chose which spelling), else the first that
    imports, in that order; None when none is installed."""
    import importlib

    for name in names:
        if name in sys.modules:
            return sys.modules[name]
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def framework():
    """The Lightning package the code uses: pytorch_lightning, or lightning.pytorch."""
    pl = loaded_or_imported(("pytorch_lightning", "lightning.pytorch"))
    if pl is None:
        raise LightningSetupError("run.lightning_callback(): Lightning is not installed; on the laptop: "
                                  "pip install 'kchain[lightning]' (Kaggle's image has it)")
    return pl


def callback(loop: Loop, make_loader: Callable, fraction: float | None, flushes: list | None = None):
    """run.lightning_callback(): a Lightning Callback (KchainCallback) over this run's loop driver.

    `make_loader(dataloader, fraction)` rebuilds a DataLoader as an untracked kchain Loader; `fraction`
    is smoke.fraction in a smoke, None outside one; `flushes` gets the call that flushes the Trainer's
    loggers (their `save()`), made before each checkpoint copies run.tensorboard_dir (tensorboard.py)."""
    if NAME in loop.ckpt.tracked:
        raise LightningSetupError("run.lightning_callback() was called twice: one callback serves the session's "
                                  "trainer.fit(); give the Trainer the one you made")
    pl = framework()
    ranks = loop.ranks
    if ranks.active and ranks.backend == "gloo":
        # The CPU stands in for Kaggle's GPUs (one gloo rank each): devices="auto" means kchain's ranks,
        # as it means both T4s on Kaggle. Set before the Trainer is built (this call is in its arguments).
        pl.accelerators.CPUAccelerator.auto_device_count = staticmethod(lambda: ranks.world_size)
    kind = type("KchainCallback", (Bridge, pl.Callback), {})
    bridge = kind(loop, make_loader, fraction, pl)
    bridge.flushes = flushes
    return bridge


class TrainerState:
    """What kchain's checkpoint holds of a Lightning Trainer (tracked as `lightning`)."""

    def __init__(self):
        self.trainer = None  # the Trainer whose fit this is, from its setup on
        self.batches: list[Batches] = []  # the training data as the Trainer reads it
        self.live = False  # the fit loop runs: a save holds the Trainer's whole checkpoint
        self.loaded: dict | None = None  # the restored state, until the Trainer and the loaders have it

    def state_dict(self) -> dict:
        t = self.trainer
        if t is None:
            return {}
        if not self.live:  # the restore's shape check comes before the fit loop: the model's tensors
            return {"trainer": {"state_dict": t.lightning_module.state_dict()}}
        return {"trainer": t._checkpoint_connector.dump_checkpoint(weights_only=False),
                "data": [b.state_dict() for b in self.batches],
                "batches_that_stepped": t.fit_loop.epoch_loop._batches_that_stepped}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


class Batches:
    """What the Trainer iterates for one training DataLoader: its batches from a kchain Loader, each one
    fetched only after the step boundary (`boundary`) has run. A source kchain cannot position (not a
    DataLoader) is iterated as it is, still through the boundary."""

    def __init__(self, source, boundary: Callable[[], None]):
        self.source = source
        self.boundary = boundary
        self.dataset = getattr(source, "dataset", None)  # what Lightning looks at (an iterable dataset?)

    def __len__(self) -> int:
        return len(self.source)  # TypeError without a length, as Lightning expects

    def __iter__(self):
        batches = iter(self.source)
        while True:
            self.boundary()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def start_epoch(self, epoch: int) -> None:
        """The Trainer starts `epoch`: a loader behind it (its last epoch cut short by a limit, or read
        to its end) starts that epoch; one ahead of it (cycled by a longer loader beside it) goes on."""
        lo = self.source
        if isinstance(lo, Loader) and lo.epoch < epoch:
            lo.load_state_dict({**lo.state_dict(), "epoch": epoch, "position": 0})

    # Stateful for Lightning too (it then never warns that the loader cannot resume); kchain's own copy
    # of the positions (TrainerState) is the one put back, also when Lightning's is not.
    def state_dict(self) -> dict:
        return self.source.state_dict() if isinstance(self.source, Loader) else {}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(self.source, Loader) and state:
            self.source.load_state_dict(state)


class Bridge:
    """The callback's hooks: KchainCallback is this class mixed into Lightning's Callback."""

    def __init__(self, loop: Loop, make_loader: Callable, fraction: float | None, pl):
        self.loop, self.make_loader, self.fraction, self.pl = loop, make_loader, fraction, pl
        self.state = TrainerState()
        loop.ckpt.track(NAME, self.state)
        self._begun: int | None = None  # the global_step the open kchain step started from
        self._resumed: tuple | None = None  # (RNG states, loggers' step): put back at the first boundary
        self._returned: dict = {}  # what training_step returned last, for the step's row
        self._seen: dict = {}  # each logged value already in the trace, held (so compared by identity)
        self._every = 1  # steps between validations, for the deadline guard's plan
        self.flushes: list | None = None  # where the loggers' flush goes (run.tensorboard_dir's copies)

    # --- setup and restore --------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage) -> None:
        if stage != "fit":
            return
        if self.state.trainer is not None:
            raise LightningSetupError("run.lightning_callback() serves one trainer.fit() per session: the "
                                      "checkpoint holds one Trainer's state; fit once in main(run)")
        self.state.trainer = trainer
        self.loop.ckpt.cover("lightning_module", pl_module)  # the Trainer's checkpoint (tracked as `lightning`) holds it
        if self.flushes is not None:  # a TensorBoardLogger on run.tensorboard_dir: its events reach each checkpoint
            self.flushes.append(lambda: [logger.save() for logger in trainer.loggers])
        _check_ranks(trainer, self.loop.ranks.world_size)
        _drop_default_checkpoint(trainer, self.pl.callbacks.ModelCheckpoint)
        _monitored_best(trainer, self.pl.callbacks.ModelCheckpoint, self.loop.ckpt.best)
        _serve(trainer.fit_loop._data_source, self._train_data)
        _serve(trainer.fit_loop.epoch_loop.val_loop._data_source, self._validation)
        if self.fraction is not None:
            trainer.log_every_n_steps = 1  # a smoke logs every step
        epoch_loop, cap = trainer.fit_loop.epoch_loop, self.loop.cap
        if cap is not None and (epoch_loop.max_steps == -1 or epoch_loop.max_steps > cap):
            epoch_loop.max_steps = cap  # the smoke's steps, KCHAIN_TOTAL_STEPS
        self.loop.restore()
        loaded = self.state.loaded
        if loaded is None and self.loop.progress.resumed_from is not None:
            raise LightningSetupError(f"the checkpoint of step {self.loop.progress.resumed_from} holds no Lightning "
                                      "Trainer state (it was written by a loop of run.steps or run.epochs); "
                                      "start fresh by detaching the state dataset")
        if loaded is not None:
            # The Trainer loads this as the checkpoint of fit(ckpt_path=...): model, datamodule and callbacks
            # next, then the precision plugin, the loops' progress, optimizers and schedulers.
            trainer._checkpoint_connector._loaded_checkpoint = loaded["trainer"]
            self._resumed = (rng_state(), loaded.get("batches_that_stepped"))

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.ckpt_path:
            raise LightningSetupError(f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) resumes from a checkpoint of "
                                      "Lightning's own, which restarts an unfinished epoch's data; kchain resumes "
                                      "from its own checkpoint: call trainer.fit(model, datamodule) without ckpt_path")

    def on_train_start(self, trainer, pl_module) -> None:
        loop = self.loop
        total = trainer.estimated_stepping_batches
        if not 0 <= total < float("inf"):  # inf, or -1: training data without a length and no max_steps
            raise LightningSetupError("the Trainer has no end (max_epochs=-1 and no max_steps, or training data "
                                      "without a length): give Trainer(max_steps=N) so kchain can plan the chain")
        loop.progress.total = loop.capped(int(total))
        loop.optimizers.extend(o for o in trainer.optimizers if all(o is not x for x in loop.optimizers))
        loaded, self.state.loaded = self.state.loaded, None
        for batches, position in zip(self.state.batches, (loaded or {}).get("data", []), strict=False):
            batches.load_state_dict(position)
        self.state.live = True
        self._every = _steps_between_validations(trainer)
        loop.start_loop(scan_loaders=False)  # the one-model check, kchain's signal handlers, the watchdog

    # --- the data ------------------------------------------------------------------------------------

    def _train_data(self, data):
        """The training dataloaders the Trainer asked for, each as Batches (a kchain Loader when it is a
        DataLoader); a list, a dict or a CombinedLoader of them keeps its shape."""
        for old in self.state.batches:  # reload_dataloaders_every_n_epochs: the loaders made before
            if isinstance(old.source, Loader):
                old.source.close()
        self.state.batches = []
        return _map(data, self._batches)

    def _batches(self, dl) -> Batches:
        not_exact = self.loop.progress.not_exact
        if isinstance(dl, DataLoader):
            lo = self.make_loader(dl, self.fraction)
            if _length(lo) is None:
                not_exact.append(NO_LENGTH)
            elif lo.iterable:
                not_exact.append(ITERABLE)
            source = lo
        else:
            source = dl
            not_exact.append(NOT_POSITIONED.format(kind=type(dl).__name__))
        self.state.batches.append(Batches(source, self.boundary))
        return self.state.batches[-1]

    def _validation(self, data):
        """The validation dataloaders as they are, but each DataLoader without a generator of its own gets
        one: starting its iterator (its workers' seeds) then never draws from the global RNG that dropout
        uses, as it would at other points in a resumed session than in the uninterrupted fit (the sanity
        check started the persistent workers of the one, the first validation those of the other). In a
        smoke, validation reads smoke.fraction of its batches (at least one), unless the code set
        limit_val_batches itself."""
        loaders = [dl for dl in _flat(data) if isinstance(dl, DataLoader)]
        for dl in loaders:
            if dl.generator is None:
                dl.generator = torch.Generator().manual_seed(int(self.loop.params.get("seed", 0)))
        trainer, lengths = self.state.trainer, [n for dl in _flat(data) if (n := _length(dl))]
        assert trainer is not None  # set by setup, which serves this validation data
        if self.fraction is not None and lengths and trainer.limit_val_batches == 1.0 \
                and isinstance(trainer.limit_val_batches, float):
            trainer.limit_val_batches = max(1, round(max(lengths) * self.fraction))
        return data

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for batches in self.state.batches:
            batches.start_epoch(trainer.current_epoch)

    # --- the step boundary ---------------------------------------------------------------------------

    def boundary(self) -> None:
        """The Trainer is about to fetch a training batch: everything of the batches before it has run
        (their validation, an epoch's end) and nothing of this one. After an optimizer step this is a
        step's end (count, cadence save) and the place to stop; inside an accumulation it is neither."""
        loop, trainer = self.loop, self.state.trainer
        assert trainer is not None  # set by setup, before the first batch
        gs = trainer.global_step
        if self._begun is not None and gs > self._begun:
            self._step_row(gs)
            loop.end(gs)
            self._begun = None
        if self._begun is not None:
            return  # gradients are being accumulated: no step ended, no save or stop can be exact here
        if self._resumed is not None:
            rng, stepped = self._resumed
            self._resumed = None
            restore_rng(rng)  # what model.setup / configure_model drew after the restore is undone
            if stepped is not None:
                trainer.fit_loop.epoch_loop._batches_that_stepped = stepped
        p = loop.progress
        assert p.total is not None  # set before the first batch (on_train_start)
        p.total = max(p.total, p.step + 1)  # the Trainer asks for another step: there is one
        if not loop.may_start():  # a deadline or a signal (agreed by every rank)
            loop.stop_here()  # saves this state and raises SessionStopped out of trainer.fit()
        self._begun = gs
        loop.begin()

    # --- the trace -----------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._returned = _returned(outputs)  # with accumulate_grad_batches, the step's last batch's

    def _step_row(self, step: int) -> None:
        """A step's row, at its end (the next boundary, or the fit's end): what training_step returned and
        what was logged on step since the last row (hooks after training_step included)."""
        values, self._returned = self._returned, {}
        values.update(self._fresh(self.state.trainer))
        self._log(step, values)

    def _fresh(self, trainer) -> dict:
        """The values logged on step (self.log) since the last row, by the name they were given. A value
        logged in an earlier step stays in Lightning's results: it is left out, so a resumed run, whose
        results start empty, logs what the uninterrupted one logs."""
        out = {}
        results = getattr(trainer, "_results", None) or {}
        for key, metric in results.items():
            value = getattr(metric, "_forward_cache", None)
            meta = getattr(metric, "meta", None)
            if value is None or meta is None or not meta.on_step or self._seen.get(key) is value:
                continue
            self._seen[key] = value
            out[meta.name] = value
        return out

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.loop.every(self._every)  # a crash here is in stage validation; the guard plans with it

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        results = getattr(trainer, "_results", None)
        values = results.metrics(on_step=False)["callback"] if results is not None else trainer.callback_metrics
        self._log(trainer.global_step, dict(values))

    def _log(self, step: int, values: dict) -> None:
        plain = {k: v.item() for k, v in values.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        plain.update({k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if plain:
            self.loop.trace.log(step, plain)

    # --- the end -------------------------------------------------------------------------------------

    def on_train_end(self, trainer, pl_module) -> None:
        loop, gs = self.loop, trainer.global_step
        if self._begun is not None and gs > self._begun:
            self._step_row(gs)
            loop.end(gs)
        self._begun = None
        loop.finish(stopped=gs < loop.progress.total)  # EarlyStopping, should_stop, max_time: stopped
        loop.end_loop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.loop.end_loop()  # the watchdog and kchain's signal handlers go with the fit


def _check_ranks(trainer, world_size: int) -> None:
    if trainer.world_size != world_size:
        raise LightningSetupError(
            f"kchain runs {world_size} rank(s) but the Trainer runs {trainer.world_size} process(es) "
            f"({type(trainer.strategy).__name__}): give the Trainer devices='auto' and strategy 'auto' or "
            "'ddp' (kchain's ranks are its processes), or set train.gpus to the devices it uses")


def _drop_default_checkpoint(trainer, model_checkpoint: type[Any]) -> None:
    """Take out the ModelCheckpoint the Trainer added by itself (enable_checkpointing=True): kchain's
    checkpoint replaces it. One with settings of the code's own stays."""
    default = model_checkpoint()
    for cb in list(trainer.callbacks):
        if type(cb) is model_checkpoint and cb.state_key == default.state_key and cb.dirpath is None \
                and cb.filename is None and not cb.save_last and cb.save_top_k == 1:
            trainer.callbacks.remove(cb)
            say("Lightning's default ModelCheckpoint is off: kchain's checkpoints replace it")


def _monitored_best(trainer, model_checkpoint: type[Any], keeper) -> None:
    """A ModelCheckpoint(monitor=..., mode=...) of the code's own onto train.keep_best (the first one with
    a monitor); it keeps writing its own files too. save_top_k, every_n_* and filename have no kchain
    counterpart: one best is kept, among the steps kchain checkpoints."""
    from kchain.common import keepbest

    watching = [cb for cb in trainer.callbacks if isinstance(cb, model_checkpoint) and cb.monitor]
    if watching:
        cb = watching[0]
        say("lightning: " + keepbest.adopt(keeper, cb.monitor, cb.mode, f"ModelCheckpoint(monitor={cb.monitor!r}, "
                                           f"mode={cb.mode!r})"))


def _serve(source, convert: Callable) -> None:
    """Make one of the Trainer's data sources hand what it returns through `convert` first."""
    request = source.dataloader
    source.dataloader = lambda: convert(request())


def _map(data, fn: Callable):
    """`fn` over each loader in what a train_dataloader() returns: one, a list, a tuple, a dict, or a
    CombinedLoader (its loaders replaced in place)."""
    if isinstance(data, Mapping):
        mapping: Callable[..., Any] = type(data)  # a concrete one (dict, OrderedDict): built from its items
        return mapping((k, _map(v, fn)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        return type(data)(_map(v, fn) for v in data)
    if hasattr(data, "flattened") and hasattr(data, "iterables"):  # a CombinedLoader
        data.flattened = [fn(v) for v in data.flattened]
        return data
    return fn(data)


def _flat(data) -> list:
    if isinstance(data, Mapping):
        return [x for v in data.values() for x in _flat(v)]
    if isinstance(data, (list, tuple)):
        return [x for v in data for x in _flat(v)]
    return list(data.flattened) if hasattr(data, "flattened") else [data]


def _length(dl) -> int | None:
    try:
        return len(dl)
    except TypeError:
        return None


def _returned(outputs) -> dict:
    """What training_step returned: a loss, or a dict of values (its loss among them)."""
    if isinstance(outputs, torch.Tensor):
        return {"loss": outputs.detach()}
    if isinstance(outputs, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()}
    return {}


def _steps_between_validations(trainer) -> int:
    """How many steps apart validations run, for the deadline guard (it plans the step that validates
    with the longest validating step): once an epoch, the default, or 1 (every step may) when unsure."""
    batches = trainer.num_training_batches
    if not trainer.enable_validation or not isinstance(batches, int) or trainer.check_val_every_n_epoch is None:
        return 1
    if trainer.val_check_batch is None or trainer.val_check_batch < batches:
        return 1
    per_epoch = -(-batches // trainer.accumulate_grad_batches)
    return per_epoch * trainer.check_val_every_n_epoch
