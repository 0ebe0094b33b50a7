"""Run: the one object the user's `main(run)` talks to, a thin front over parts that own their state.

Lightning Fabric's user object is wide and holds little: a few collaborators do the work. So here:
the progress record (progress.py), the checkpointer (what a checkpoint holds, its cadence, the save
and the restore), the session clock (the one deadline and the publish plan), the metrics trace,
the loop driver (run.steps, run.epochs, the stop) and the out-of-memory ladder's rung. No part
imports this module or receives the Run.

A Run is built from the job's config (a RuntimeConfig, or its dict) and an environment mapping
(os.environ in the kernel), so a test or a benchmark can build one in-process without the
launcher. Restoring is lazy: `run.steps` loads the newest checkpoint after the training code has
registered everything with `run.track` and `run.loader`, then yields the remaining step numbers,
saving on the job's cadence, at the deadline, on SIGTERM/SIGINT and at the end.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from kchain.common import resumecheck, summary, trackers
from kchain.common.config import RuntimeConfig
from kchain.common.layout import Paths
from kchain.common.say import say, warn
from kchain.common.settings import Settings
from kchain.common.trace import Trace
from kchain.runtime import distributed, ladder, precision, preflight, staging, watchdog
from kchain.runtime.checkpoint.checkpointer import Checkpointer, Policy, Where
from kchain.runtime.clock import SessionClock
from kchain.runtime.frameworks import mlflow_store, tensorboard
from kchain.runtime.loader import NOT_SHARDED, Loader, dataloader_options, refuse_sharded
from kchain.runtime.loader import subset as smoke_subset
from kchain.runtime.loop import Loop, SessionStopped
from kchain.runtime.progress import Progress

__all__ = ["Params", "Run", "SessionStopped"]

NO_LOOP_NOTE = "no checkpoint was written: the loop did not use run.steps"


class Params(dict):
    """The job's params: `run.params.lr` and `run.params["lr"]` both work."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"params has no {name!r}; the job defines {sorted(self)}") from None


def _plain(v):
    """A JSON-able number from a tensor / numpy scalar (loss.item() is easy to forget)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


class Run:
    """The one object `main(run)` talks to: data, registration, the loop, metrics and checkpoints.

    The launcher builds it from the rendered job's config (`python -m kchain.runtime.launch`); a test
    or a benchmark can build one in-process from a config dict and an environment mapping.

    Example::

        def main(run):
            model = run.wrap(Net())
            stepper = run.optimize(torch.optim.AdamW(model.parameters(), lr=run.params.lr))
            run.track(model=model)
            loader = run.loader(run.subset(train_set), batch_size=64)
            for step in run.steps(run.params.steps):   # resumes after the last checkpoint
                x, y = next(loader)
                with run.autocast():
                    loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
                stepper.backward(loss)
                stepper.step()
                run.log(loss=loss)
    """

    def __init__(self, config: RuntimeConfig | Mapping, env: Mapping[str, str] | None = None,
                 started: float | None = None, halvings: int = 0):
        env = os.environ if env is None else env
        self._config = config if isinstance(config, RuntimeConfig) else RuntimeConfig.from_dict(config)
        self._settings = st = Settings.parse(self._config, env, started)  # config + environment, parsed once
        self._params = Params(st.params)
        if st.smoke_params:
            say("smoke params: " + ", ".join(f"{k}={v!r}" for k, v in st.smoke_params.items()))
        self._paths = paths = Paths.of(env)
        paths.kchain.mkdir(parents=True, exist_ok=True)
        self._clock = SessionClock(st.started, st.limit_s, st.margin_s, st.publish)
        # kchain ddp: the group this process is one rank of (a no-op group of 1 without torchrun).
        self._ranks = distributed.Ranks(env)
        if self._ranks.backend == "gloo":
            # Ranks on the CPU standing in for GPUs (a smoke, a rehearsal): accelerate (the HF Trainer's
            # DDP) then runs over these ranks too, instead of one separate training per process.
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        device, why = self._ranks.device(*precision.choose_device())
        say(f"device: {device} ({why}); {self._ranks.describe()}")
        dtype, why = precision.choose_dtype(device, st.precision)
        say(f"precision: {str(dtype).removeprefix('torch.')} ({why})")
        self._amp = precision.Amp(device, dtype)
        self._progress = Progress()
        self._rung = ladder.Rung(st.micro_auto, halvings)
        self._ckpt = Checkpointer(
            Where(paths.checkpoints, paths.input_root, paths.scratch, paths.working, st.state_slug,
                  sink=Path(st.sink) if st.sink else None, sink_only=st.multi_node, requeued=st.requeued),
            Policy(st.job, st.every, st.keep, st.stream, self._manifest_fields(), st.checkpoint_frozen,
                   plan=st.plan, keep_best=st.keep_best),
            self._ranks, st.faults, self._rung)
        if st.micro_auto and self._ranks.is_main:  # the ladder starts from the size that fitted last session
            self._rung.halvings = max(halvings, self._ckpt.halvings_found())
        self._trace = Trace(paths.metrics, writes=self._ranks.is_main)
        # The chain's run id: rank 0 reads it from the newest checkpoint (or chooses it), every rank gets it.
        self._ids: trackers.RunIds = self._ranks.all_gather(
            trackers.RunIds.of(self._ckpt.chain_manifest()) if self._ranks.is_main else None)[0]
        self._tb = tensorboard.Log(paths.tensorboard, paths.scratch, self._ranks.is_main,
                                   functools.partial(_resumed_from, self._ckpt))
        self._ckpt.additions.append(functools.partial(_additions, self._ids, self._tb, self._ckpt))
        if "tensorboard" in st.trackers:
            self._trace.mirror = self._tb.mirror
        if "mlflow" in st.trackers:  # MLflow's file store travels in every checkpoint
            self._ckpt.additions.append(_mlflow_store(paths, self._ranks.is_main, self._ckpt).addition)
        # The trackers' own resume variables, before the user's code imports them (train.trackers).
        os.environ.update(trackers.environ(st.trackers, self._ids, paths.tensorboard, paths.mlflow, os.environ))
        # The watchdog's verdict writes the summary from the parts (a part never holds the Run).
        summarize = functools.partial(_build_summary, self._progress, self._trace, self._ckpt, st, self._ranks.world_size)
        self._loop = Loop(self._progress, self._clock, self._ckpt, self._trace, self._ranks, st.faults,
                          dict(self._params), heartbeat_s=st.heartbeat_s, hang_s=None if st.smoke else st.hang_s,
                          on_hang=functools.partial(_hung, self._progress, summarize, paths.summary),
                          cap=st.total_cap if st.total_cap is not None else (st.smoke_steps if st.smoke else None),
                          plan=st.plan, watch_untracked=st.audit, watch_changes=st.smoke)
        if not st.smoke and self._ranks.is_main and resumecheck.expected(st.resume):
            # The chain said which step this session resumes: check it now, in the session's first
            # minute, not after the data is staged (resumecheck.WrongState ends the run).
            found, damaged = self._ckpt.find()
            resumecheck.check(st.resume, int(found[0][1]["step"]) if found else None,
                              str(found[0][0]) if found else None, damaged)

    def _manifest_fields(self) -> dict:
        """What every checkpoint's manifest says about the run besides its step (checkpointer.py)."""
        st = self._settings
        return {"fingerprint": st.fingerprint, "kchain_version": st.kchain_version, "params": dict(self._params),
                "world_size": self._ranks.world_size}

    # --- what the code reads ----------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """The job's params (and in a smoke, smoke.params and `--set` over them)."""
        return self._params

    @property
    def config(self) -> RuntimeConfig:
        """The rendered job's config (job, entry, params, train, smoke, kaggle, fingerprint)."""
        return self._config

    @property
    def settings(self) -> Settings:
        """The frozen Settings parsed once from the config and the environment."""
        return self._settings

    @property
    def smoke(self) -> bool:
        """True in a smoke run (KCHAIN_SMOKE=1)."""
        return self._settings.smoke

    @property
    def fraction(self) -> float:
        """The share of the data run.subset keeps: smoke.fraction in a smoke, else 1.0."""
        return self._settings.fraction

    @property
    def device(self) -> torch.device:
        """This rank's device: cuda if present, else cpu (printed with the reason at start-up)."""
        return self._amp.device

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (train.precision: auto, fp32, bf16, fp16)."""
        return self._amp.dtype

    @property
    def working(self) -> Path:
        """The working dir ($KCHAIN_ROOT/working, /kaggle/working on Kaggle)."""
        return self._paths.working

    @property
    def export_dir(self) -> Path:
        """A folder for your own export of the result (save_pretrained, ONNX, a tokenizer, anything),
        made on first use under kchain's corner of the working dir. Its files travel in the state
        version the session publishes (flat, as export.* files) and `kchain pull` writes them back as
        they were, under export/. Write it on rank 0 once training is done.

        Example::

            if run.finished and run.is_main:
                model.save_pretrained(run.export_dir)
        """
        self._paths.export.mkdir(parents=True, exist_ok=True)
        return self._paths.export

    @property
    def id(self) -> str:
        """The chain's run id: chosen when the chain starts, the same in every session and on every rank.

        Kept in every checkpoint. Give it to a tracker as the run's id, e.g.
        `wandb.init(id=run.id, resume="allow")` (`train.trackers: {wandb: true}` exports it as WANDB_RUN_ID).
        """
        return self._ids.run_id

    @property
    def tensorboard_dir(self) -> Path:
        """The chain's one TensorBoard log dir (<working>/kchain/tensorboard), carried in every checkpoint.

        At a resume it holds exactly what the resumed checkpoint held, so every session's writers
        append to one run. Build writers on it after the first use of this property (it is
        restored then); prefer run.summary_writer(), which kchain flushes before each save.

        Example::

            logger = TensorBoardLogger(run.tensorboard_dir, name="", version="", default_hp_metric=False)
        """
        return self._tb.made()

    def summary_writer(self, **kwargs):
        """A `torch.utils.tensorboard.SummaryWriter` on run.tensorboard_dir that continues the chain's run.

        It starts with `purge_step` at the resumed step + 1 (TensorBoard drops any later event an
        earlier session wrote), is flushed before each checkpoint (its events up to the checkpoint's
        step travel with it) and closed at the end. On ranks other than 0 it writes nothing.
        Keyword arguments go to SummaryWriter.

        Example::

            tb = run.summary_writer()
            for step in run.steps(total):
                ...
                tb.add_scalar("loss", loss.item(), step)
        """
        return self._tb.writer(**kwargs)

    @property
    def rank(self) -> int:
        """This process's rank: 0 .. world_size-1 (0 without torchrun)."""
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks run `main(run)` (train.gpus; 1 without torchrun)."""
        return self._ranks.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0: the rank that writes checkpoints, the trace and the summary."""
        return self._ranks.is_main

    @property
    def step(self) -> int:
        """Steps completed, restored ones included."""
        return self._progress.step

    @property
    def total(self) -> int | None:
        """The loop's total after the caps (a smoke, KCHAIN_TOTAL_STEPS)."""
        return self._progress.total

    @property
    def session(self) -> int:
        """The session number in the chain: 1 + the resumed checkpoint's session (known once the loop starts)."""
        return self._progress.session

    @property
    def resumed_from(self) -> int | None:
        """The restored checkpoint's step, or None."""
        return self._progress.resumed_from

    @property
    def status(self) -> str:
        """running, then finished, stopped, deadline or interrupted when the loop ends."""
        return self._progress.status

    @property
    def finished(self) -> bool:
        """The loop reached its total (False after a deadline or interrupt stop)."""
        return self._progress.finished

    @property
    def metrics(self) -> dict:
        """The last value logged under each name."""
        return self._trace.metrics

    @property
    def best(self) -> dict | None:
        """{'name', 'value', 'step'}: the best value of the first val* metric (lower is better for losses)."""
        return self._trace.best

    # --- registration ---------------------------------------------------------------------------

    def wrap(self, model, **ddp_options):
        """The model on this rank's device, in DistributedDataParallel when there are several ranks.

        `ddp_options` are DistributedDataParallel's own (find_unused_parameters, broadcast_buffers,
        gradient_as_bucket_view, static_graph, bucket_cap_mb, ...), used under several ranks and
        harmless with one (no DDP then); the device is kchain's choice (device_ids is refused).

        Example:
            model = run.wrap(Net())          # DDP on 2 GPUs, the plain module on 1
            model = run.wrap(Net(), find_unused_parameters=True)
            run.track(model=model)           # checkpoints hold the inner module's keys either way
        """
        return distributed.wrap(model, self._ranks, self.device, ddp_options)

    def track(self, **objects) -> None:
        """Register what a checkpoint must hold, by name (names must stay the same across sessions).

        Example: `run.track(model=model, sched=sched, ema=ema_model)`. A name already used for
        another object is an error: two objects under one name would overwrite each other.
        """
        for name, obj in objects.items():
            self._ckpt.track(name, obj)

    def untrack(self, *objects, reason: str) -> None:
        """Leave state out of every checkpoint on purpose: an object a resume rebuilds exactly (a frozen
        teacher loaded from the hub, a metric reset each epoch). The smoke and the rehearsal then neither
        refuse it as forgotten state nor compare it; their verdict lists it with `reason`.

        Example: `run.untrack(teacher, reason="frozen, loaded from the hub")`.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise TypeError("run.untrack(obj, reason=...): say why in reason=, e.g. reason=\"frozen, loaded from the hub\"")
        for obj in objects:
            self._ckpt.exclude(obj, " ".join(reason.split()))

    def loader(self, dataset, batch_size: int | None = None, shuffle: bool = True, num_workers: int = 0,
               drop_last: bool = False, collate_fn: Callable | None = None, sampler=None,
               batch_sampler=None, name: str | None = None, *, pin_memory: bool | None = None,
               persistent_workers: bool | None = None, prefetch_factor: int | None = None,
               pin_memory_device: str = "", timeout: float = 0, worker_init_fn: Callable | None = None,
               multiprocessing_context=None, generator=None, in_order: bool = True):
        """A DataLoader whose position is checkpointed, tracked as `name` (else loader, loader2, ...).

        Every other DataLoader argument is taken by keyword, honoured where it applies and harmless where
        it does not, so code written for the GPU runs as it is on the laptop (loader.dataloader_options):
        pin_memory only on CUDA (the default there), workers always persistent, prefetch_factor with
        workers, the order always from params.seed and the epoch (a generator= is set aside).

        `next(loader)` gives the next batch and moves into the next epoch by itself (for run.steps);
        `for batch in loader` reads the rest of this epoch (for run.epochs). Each epoch's order is
        drawn from (params.seed, epoch), so a resume goes on at the next batch of the same shuffle.
        `dataset` may also be a DataLoader you built (rebuilt here with its dataset, batch size,
        sampler and collate_fn), or any loader with state_dict/load_state_dict (e.g. torchdata's
        StatefulDataLoader), which is tracked as it is. kchain shards each batch across the ranks itself:
        a sampler already sharded (a DistributedSampler, anything with `num_replicas`) is refused.

        Example::

            loader = run.loader(train, batch_size=64, num_workers=2, drop_last=True)
            weighted = run.loader(train, batch_size=64, sampler=WeightedRandomSampler(w, len(w)))
            x, y = next(loader)
        """
        name = name or self._ckpt.free_name("loader")
        if not isinstance(dataset, (Dataset, DataLoader)) and hasattr(dataset, "state_dict") \
                and hasattr(dataset, "load_state_dict") and hasattr(dataset, "__iter__"):
            self.track(**{name: dataset})  # a stateful loader: its own state_dict is the position
            return dataset
        given = "sampler" if sampler is not None else "batch_sampler"
        refuse_sharded(f"run.loader({type(dataset).__name__}, {given}=...)", sampler, batch_sampler,
                       "give a sampler over the whole dataset, or none (run.loader shuffles each epoch itself)")
        if isinstance(dataset, DataLoader):
            refuse_sharded(f"run.loader({type(dataset).__name__})", dataset.sampler, dataset.batch_sampler,
                           f"{NOT_SHARDED}, or pass its dataset: run.loader(dataset, batch_size=...)")
            dataset, batch_size, shuffle, num_workers, drop_last, collate_fn, sampler, batch_sampler = \
                _rebuilt(dataset, shuffle, sampler, batch_sampler)
        if batch_sampler is None and batch_size is None:
            raise TypeError(f"run.loader({type(dataset).__name__}): give batch_size= (or a batch_sampler=)")
        pin, options, notes = dataloader_options(
            self.device.type == "cuda", num_workers, pin_memory, persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor, pin_memory_device=pin_memory_device, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context, generator=generator,
            in_order=in_order)
        for line in notes:
            say(f"run.loader({name}): {line}")
        lo = self._new_loader(dataset, batch_size, shuffle, num_workers, drop_last, collate_fn, sampler, batch_sampler,
                              pin, options)
        if lo.iterable:
            self._progress.not_exact.append(
                f"data order: {name} reads an IterableDataset; a resume replays its epoch and skips the "
                "batches already trained, exact only if the stream yields the same items each time"
            )
        self.track(**{name: lo})
        return lo

    def optimize(self, optimizer, accumulate: int = 1, clip: float | None = None, track: bool = True,
                 name: str | None = None):
        """The optimizer step as a `Stepper`: .backward(loss) `accumulate` times, then .step().

        backward() divides the loss by `accumulate` (and scales it for fp16); step() unscales, clips
        the gradient norm to `clip`, steps, updates the scaler and zeroes the gradients. The optimizer
        (and the GradScaler fp16 needs) is tracked as `name`, by default `optimizer`, then
        `optimizer2`, ... for a second one; `track=False` leaves it out of the checkpoint.

        Example::

            stepper = run.optimize(torch.optim.AdamW(model.parameters(), lr=3e-4), accumulate=4, clip=1.0)
            for _ in range(stepper.accumulate):
                stepper.backward(F.cross_entropy(model(x), y))
            stepper.step()
            g, d = run.optimize(opt_g, name="gen"), run.optimize(opt_d, name="disc")   # a GAN
        """
        self._loop.optimizers.append(optimizer)
        scaler = self._amp.scaler()
        if track:
            self.track(**{name or self._ckpt.free_name("optimizer"): optimizer})
            if scaler is not None:
                self.track(**{f"{name}_scaler" if name else self._ckpt.free_name("scaler"): scaler})
        else:  # left out on purpose: the resume is not exact, and the verdict's trace shows it
            self._ckpt.exclude(optimizer, "run.optimize(track=False)")
            if scaler is not None:
                self._ckpt.exclude(scaler, "run.optimize(track=False)")
        # The ladder halved the micro-batch this many times: the same effective batch.
        return precision.Stepper(optimizer, accumulate=self._rung.accumulate(accumulate), clip=clip, scaler=scaler)

    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None):
        """Mixed precision for the forward pass: `run.dtype` on CUDA, a no-op on CPU and with fp32.

        Wrap the forward pass and the loss, not the backward pass. `enabled` and `cache_enabled` are
        torch.autocast's (e.g. `enabled=False` for a part that must run in fp32).

        Example::

            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            stepper.backward(loss)
        """
        return self._amp.autocast(enabled, cache_enabled)

    # --- data -----------------------------------------------------------------------------------

    def input(self, name: str) -> Path:
        """The folder where an attached input (a dataset or the competition) is mounted.

        `name` is 'slug' or 'owner/slug'; /kaggle/input/<slug> and /kaggle/input/datasets/<owner>/<slug>
        both work. An input that is not attached is a FileNotFoundError that lists what is.

        Example::

            text = (run.input("me/shakespeare") / "input.txt").read_text()
        """
        return staging.find_input(name, self._paths.input_root)

    def stage(self, name: str, params, build: Callable):
        """`build(params)` once per distinct (name, params); every later call loads the saved result.

        The result is saved in kchain's cache (`<working>/kchain/cache`, published as the job's
        `<job>-cache` dataset and attached to later sessions) under a name that holds a hash of
        `params`: change a parameter and it is built again. It comes back memory-mapped, on a miss as
        on a hit: a dict of numpy arrays as read-only `np.memmap`s, one array as one memmap, anything
        else through `torch.load(mmap=True)` (tensors, and numpy arrays of 64 KiB or more wherever they
        sit in it, map the file; other values are unpickled). Only this session's cache and the folders where
        the job's cache dataset is mounted are looked at, never anything else attached.

        Example::

            def tokenize(p):
                ids = encode(open(run.input("shakespeare") / "input.txt").read(), p["vocab"])
                return {"train": ids[:-p["val"]], "val": ids[-p["val"]:]}

            arrays = run.stage("tokens", {"vocab": 256, "val": 10_000}, tokenize)
            train = torch.from_numpy(np.array(arrays["train"]))   # np.array copies out of the map
        """
        stage = functools.partial(staging.stage, name, params, build, self._paths.cache, self._paths.input_root,
                                  self._settings.cache_dataset)
        if not self._ranks.active:
            return stage()
        # kchain ddp: rank 0 builds (or finds) the entry first; the others then load it from the cache.
        if not self.is_main:
            self._ranks.barrier()
        obj = stage()
        if self.is_main:
            self._ranks.barrier()
        return obj

    def subset(self, items):
        """In a smoke run, an evenly spread `smoke.fraction` of `items`; `items` itself otherwise.

        A Dataset, list, tuple, numpy array or tensor; spread over all of it, not its first rows,
        so sorted data keeps every class.

        Example::

            train = run.subset(TensorDataset(x, y))   # 2% of the rows under `kchain smoke`
        """
        if not self.smoke:
            return items
        out = smoke_subset(items, self.fraction)
        if isinstance(out, Dataset):
            out.kchain_subset = True  # run.hf_resume leaves it as it is (hf.smoke_cut)
        return out

    def check(self, batch=None, x_shape=None, x_dtype=None, num_classes=None, label_dtype=None, splits=None):
        """Check a sample batch and the splits before the loop; a failure is a PreflightError saying what to fix.

        Args:
            batch: `(x, y)`; x is checked against x_shape (None for any size) and x_dtype, y against
                label_dtype (an integer class index) and num_classes (labels in [0, num_classes)).
            splits: {"train": ..., "val": ...}: none empty, and no sampled row in two of them.

        Example::

            run.check(batch=next(iter(DataLoader(train, batch_size=8))), x_shape=(None, 20),
                      x_dtype=torch.float32, num_classes=10, splits={"train": train, "val": val})
        """
        before, self._progress.phase = self._progress.phase, "preflight"
        if splits:
            preflight.check_splits(splits, quiet=not self.is_main)
        if batch is not None:
            preflight.check_batch(batch, x_shape, x_dtype, num_classes, label_dtype, quiet=not self.is_main)
        self._progress.phase = before

    # --- the loop -------------------------------------------------------------------------------

    def steps(self, total: int):
        """Yield step numbers restored_step+1 .. total; save on cadence, at the deadline and at the end.

        `break` (or `return`) out of the loop is an early stop: the step reached is counted and
        saved, and the session ends with status `stopped`. Build and track everything first: the
        checkpoint is restored when the loop starts.

        Example::

            for step in run.steps(run.params.steps):
                x, y = next(loader)
                ...
                run.log(loss=loss)
        """
        return self._loop.steps(total)

    def epochs(self, total: int, loader: Loader | None = None):
        """Yield epoch numbers from the restored one to total-1; `for batch in loader` inside.

        Each batch is one step: saved on the job's cadence between batches, so a resume starts
        mid-epoch at the next batch, with the same shuffle. `loader` is the first run.loader by
        default. Example::

            for epoch in run.epochs(10):
                for x, y in loader:
                    ...
                    run.log(loss=loss)
                sched.step()
        """
        lo = loader or (self._loop.loaders[0] if self._loop.loaders else None)
        if lo is None:
            raise RuntimeError("run.epochs needs a loader made by run.loader (make it before the loop)")
        return self._loop.epochs(total, lo)

    def every(self, n: int) -> bool:
        """True every n steps and on the last step: where an evaluation goes inside the loop.

        That step's crash stage is `validation`, and the deadline guard plans with how long it took.

        Example::

            if run.every(500):
                run.log(val_loss=evaluate(model, val))
        """
        return self._loop.every(n)

    def log(self, mean_over_ranks: bool = False, **metrics) -> None:
        """Append one row to the metrics trace (rank 0 writes it; the other ranks' calls only count).

        Args:
            mean_over_ranks: average each number over the ranks first (a collective: then every
                rank must call run.log at the same point with the same names).
        Example:
            run.log(loss=loss.item(), lr=sched.get_last_lr()[0])
            run.log(val_loss=local_val, mean_over_ranks=True)
        """
        values = {k: _plain(v) for k, v in metrics.items()}
        # step=... names the step in a loop kchain does not drive (run.restore / run.save).
        step = values.pop("step", None) or self._progress.current or self._progress.step
        if mean_over_ranks:
            values = {**values, **self._ranks.mean({k: v for k, v in values.items() if isinstance(v, (int, float))})}
        self._trace.log(step, values)

    def should_stop(self, step: int | None = None) -> bool:
        """For a loop kchain cannot drive: True when this session must end after this step.

        The deadline guard of run.steps (the slowest recent step, timed between calls, plus a save
        must still fit before the session's stop time) and SIGTERM/SIGINT. Call it on every rank
        once per step, after the step's work (with several ranks it is a collective: they agree).
        On True, save: `run.save(step)` then ends main(run) as run.steps does at a stop
        (SessionStopped), so the next session resumes right there.

        Example::

            start = run.restore()
            for step in range(start + 1, total + 1):
                train_one_step()
                stop = run.should_stop(step)
                if stop or step % 500 == 0 or step == total:
                    run.save(step)          # after a stop, main(run) ends here
        """
        return self._loop.should_stop(step)

    def hf_callback(self):
        """The `transformers.TrainerCallback` through which kchain owns a Hugging Face Trainer's checkpoints.

        Give it to the Trainer and resume with run.hf_resume: kchain then decides when the Trainer saves
        (train.checkpoint_every, the deadline guard, SIGTERM, the end; the Trainer's own save_strategy is
        turned off), moves each checkpoint-N folder it writes into kchain's verified checkpoint, ends a
        session at a stop (SessionStopped out of trainer.train()), sets run.status and run.total from the
        Trainer's state, and logs the Trainer's logs with run.log. See docs/runtime.md, "Hugging Face Trainer".

        Example::

            trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[run.hf_callback()])
            trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        """
        return self._hf().callback()

    def hf_resume(self, trainer) -> str | None:
        """Restore the newest checkpoint for `trainer`: the folder for train(resume_from_checkpoint=...), or None.

        Args:
            trainer: the `transformers.Trainer` about to train; kchain turns its own saves off, cuts its
                datasets to smoke.fraction in a smoke, collates each batch under an RNG seeded from
                (seed, the batch, the epoch) so a masking collator resumes exactly, adds
                run.hf_callback() if it is not in its callbacks,
                and returns a checkpoint-N folder of links to the verified files of kchain's newest
                checkpoint (None when the run starts fresh).

        Example::

            trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
            if run.finished:                     # not after a deadline or SIGTERM stop
                trainer.save_model()
        """
        return self._hf().resume(trainer)

    def _hf(self):
        from kchain.runtime.frameworks import hf  # transformers is imported only inside it, only when used

        self._tb.open()  # its TensorBoardCallback (TENSORBOARD_LOGGING_DIR) writes after the restore
        return hf.bridge(self._loop, self._paths.scratch, self.smoke, self.fraction)

    def restore(self) -> int:
        """Load the newest checkpoint into everything tracked; returns the step it resumes at (0 fresh).

        For a loop kchain cannot drive; `run.steps` calls this itself. Example::

            start = run.restore()
            for step in range(start + 1, total + 1):
                train_one_step()
                if step % 500 == 0 or step == total:
                    run.save(step)
        """
        self._loop.restore()
        self._progress.looped = True
        self._loop.check_one_model()
        return self._progress.step

    def save(self, step: int | None = None) -> None:
        """Checkpoint everything tracked as `step` (default: the step reached), as run.steps does.

        The snapshot blocks; the write runs in the background. See run.restore for an example.
        """
        self._loop.save(step)

    def lightning_callback(self):
        """The Lightning `Callback` through which kchain owns a `trainer.fit`'s checkpoints, stops and data order.

        Give it to the Trainer and keep `trainer.fit(model, datamodule)`: kchain then restores its newest
        checkpoint into the Trainer at the fit's setup (model, optimizers, schedulers, loops, callbacks),
        rebuilds the training DataLoader as a run.loader Loader (its position in the checkpoint), saves on
        train.checkpoint_every between two steps, stops at the deadline guard or on SIGTERM
        (SessionStopped out of trainer.fit()), sets run.status and run.total from the Trainer's state and
        logs its losses and validation metrics with run.log. No plugin is needed. See docs/runtime.md,
        "Lightning Trainer".

        Example::

            trainer = pl.Trainer(max_epochs=10, accelerator="auto", devices="auto",
                                 callbacks=[run.lightning_callback()])
            trainer.fit(model, datamodule)
            if run.finished:                     # not after a deadline or SIGTERM stop
                trainer.save_checkpoint(run.working / "final.ckpt")
        """
        from kchain.runtime.frameworks import (
            lightning,  # Lightning is imported only inside it, only when used
        )

        return lightning.callback(self._loop, self._untracked_loader, self.fraction if self.smoke else None,
                                  self._tb.flushes)

    def accelerator(self, **kwargs):
        """A Hugging Face `accelerate.Accelerator` (built with `kwargs`, its own) whose loop kchain checkpoints.

        Replace `Accelerator(...)` with it and `for epoch in range(n)` with `for epoch in run.epochs(n)`; the
        rest of the script stays (prepare, accumulate, backward, clip_grad_norm_, gather_for_metrics, log).
        prepare() hands back the training DataLoader as a run.loader Loader (its position in the checkpoint),
        the prepared models, optimizers, schedulers, the scaler and register_for_checkpointing's objects are
        tracked, a step is one optimizer step (gradient_accumulation_steps batches under accumulate), and
        kchain saves, stops (SessionStopped out of the loop) and resumes mid-epoch there. save_state and
        load_state are refused with what to delete. See docs/runtime.md, "Hugging Face Accelerate".

        Example::

            accelerator = run.accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)
            model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
                model, optimizer, train_dl, eval_dl, scheduler)
            for epoch in run.epochs(num_epochs):
                for batch in train_dl:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(**batch).loss)
                        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        """
        from kchain.runtime.frameworks import hf_accelerate  # accelerate imported inside it, when used

        return hf_accelerate.accelerator(self._loop, self._untracked_loader, self.fraction if self.smoke else None,
                                         self.device, kwargs)

    def fabric(self, **kwargs):
        """A Lightning `Fabric` (built with `kwargs`, its own) whose loop kchain checkpoints.

        Replace `Fabric(...)` with it and `for epoch in range(n)` with `for epoch in run.epochs(n)`; the rest
        stays (launch, setup, setup_dataloaders, backward, clip_gradients, no_backward_sync, log). Fabric's
        processes are kchain's ranks; setup_dataloaders hands back the training DataLoader as a run.loader
        Loader (its position in the checkpoint); the set-up modules, optimizers and the scheduler given to
        setup(..., scheduler=) are tracked; a step ends with an optimizer step, and kchain saves, stops
        (SessionStopped out of the loop) and resumes mid-epoch there. fabric.save and fabric.load are
        refused with what to delete. See docs/runtime.md, "Lightning Fabric".

        Example::

            fabric = run.fabric(accelerator="cuda", devices="auto", precision="16-mixed")
            fabric.launch()
            model, optimizer = fabric.setup(model, optimizer, scheduler=scheduler)
            train_loader = fabric.setup_dataloaders(train_loader)
            for epoch in run.epochs(num_epochs):
                for batch in train_loader:
                    fabric.backward(model.training_step(batch))
                    optimizer.step(); optimizer.zero_grad()
        """
        from kchain.runtime.frameworks import lit_fabric  # Fabric imported inside it, when used

        return lit_fabric.fabric(self._loop, self._untracked_loader, self.fraction if self.smoke else None,
                                 self.device, kwargs)

    def _untracked_loader(self, dataloader: DataLoader, fraction: float | None = None) -> Loader:
        """A framework's DataLoader rebuilt as run.loader rebuilds one, not tracked: the framework's own
        checkpoint holds its position (lightning.py). With `fraction` (a smoke) its dataset is cut as
        run.subset cuts one, to at least one batch per rank (one that came from run.subset stays as it is)."""
        refuse_sharded("the training DataLoader", dataloader.sampler, dataloader.batch_sampler)
        dataset, batch_size, shuffle, num_workers, drop_last, collate_fn, sampler, batch_sampler = \
            _rebuilt(dataloader, True, None, None)
        if fraction is not None and sampler is None and batch_sampler is None and batch_size \
                and not getattr(dataset, "kchain_subset", False) \
                and not isinstance(dataset, torch.utils.data.IterableDataset) and len(dataset):
            dataset = smoke_subset(dataset, min(1.0, max(fraction, batch_size * self.world_size / len(dataset))))
        return self._new_loader(dataset, batch_size, shuffle, num_workers, drop_last, collate_fn, sampler,
                                batch_sampler)

    def _new_loader(self, dataset, batch_size, shuffle, num_workers, drop_last, collate_fn, sampler,
                    batch_sampler, pin_memory: bool | None = None, options: dict | None = None) -> Loader:
        """A Loader over this run's ranks and seed, counted by the loop (run.loader's and a framework's)."""
        preflight.check_worker_tmpdir(num_workers)
        lo = Loader(
            dataset, self._rung.batch(batch_size), shuffle=shuffle, num_workers=num_workers, drop_last=drop_last,
            collate_fn=collate_fn, seed=int(self._params.get("seed", 0)),
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            on_wait=self._loop.add_wait, sampler=sampler, batch_sampler=batch_sampler, rank=self.rank,
            world_size=self.world_size, options=options,
        )
        self._loop.loaders.append(lo)
        return lo

    def close(self) -> None:
        """Join the writer (no write is ever left in flight) and close the trace."""
        try:
            self._ckpt.close()  # the writer joined, and the state sink flushed
        finally:
            for lo in self._loop.loaders:
                lo.close()  # their workers end now, not seconds later
            self._loop.restore_signals()  # run.should_stop's, if a loop of the user's own set them
            self._ranks.close()
            self._trace.close()
            self._tb.close()

    # --- the launcher's (not the user's) --------------------------------------------------------

    @functools.cached_property
    def launcher(self) -> Launched:
        """What the launcher (launch.py), never the user, does with this Run."""
        return Launched(self._progress, self._ckpt, self._rung, self._paths.summary, self.world_size,
                        functools.partial(_build_summary, self._progress, self._trace, self._ckpt, self._settings,
                                          self.world_size))


class Launched:
    """The launcher's side of a Run: the stage a crash is named by and the status, the ladder's next rung
    after an out-of-memory error, the end of a main(run) that ran no loop, and the summary and its path."""

    def __init__(self, progress: Progress, ckpt: Checkpointer, rung: ladder.Rung, summary_path: Path,
                 world_size: int, summarize: Callable[..., summary.Summary]) -> None:
        self._progress, self._ckpt, self._rung, self._world_size = progress, ckpt, rung, world_size
        self.summary_path, self._summarize = summary_path, summarize

    @property
    def phase(self) -> str:
        """The stage the run is in (build, preflight, step, ...): what a crash is reported as."""
        return self._progress.phase

    def enter(self, phase: str) -> None:
        self._progress.phase = phase

    def mark(self, status: summary.StatusName) -> None:
        """The run's status, as the launcher knows it (interrupted, crashed)."""
        self._progress.status = status

    @property
    def halvings(self) -> int:
        """How many times the ladder halved the micro-batch so far."""
        return self._rung.halvings

    def next_rung(self) -> str | None:
        """After an out-of-memory error: the ladder's next rung, or None (see ladder.next_rung).

        With a rung, this run is retired: a loop generator closed later (by the garbage collector)
        must not count or save the failed attempt's step."""
        rung = self._rung.next(self._progress.loop_steps > 0, self._world_size)
        self._progress.retired = rung is not None
        return rung

    def end_without_loop(self) -> None:
        """main(run) returned while the status is still `running`: say whether anything was saved."""
        p = self._progress
        if p.saved_step is not None or self._ckpt.writer.last_path is not None:
            self._ckpt.writer.wait()
            p.status = summary.Status.FINISHED  # a hand-written loop that called run.save()
            return
        p.status, p.note = summary.Status.NO_CHECKPOINT, NO_LOOP_NOTE
        warn(NO_LOOP_NOTE)

    def close_checkpoints(self) -> None:
        """The writer joined and the sink flushed: never a checkpoint write left half done."""
        self._ckpt.close()

    def summary(self, error: dict | None = None) -> summary.Summary:
        return self._summarize(error)


def _build_summary(progress: Progress, trace: Trace, ckpt: Checkpointer, st: Settings, world_size: int,
               error: dict | None = None) -> summary.Summary:
    """The session's summary.json, from the parts that hold it."""
    p = progress
    return summary.Summary(
        status=p.status, session=p.session, step=p.step, total=p.total, metrics=trace.metrics, best=trace.best,
        total_asked=p.asked if p.asked is not None and p.asked != p.total else None,
        checkpoint=ckpt.newest_rel(), error=error, started=st.started, ended=time.time(),
        steps_per_s=p.steps_per_s(), fingerprint=st.fingerprint, resumed_from=p.resumed_from, note=p.note,
        not_exact=p.not_exact, world_size=world_size,
        torch=torch.__version__, cuda=torch.version.cuda,  # the image it ran on (kchain status compares)
    )


def _resumed_from(ckpt: Checkpointer) -> tuple[Path, dict] | None:
    """The checkpoint this run resumes from (rank 0: found and verified once), or None."""
    found, _ = ckpt.find()
    return found[0] if found else None


def _mlflow_store(paths: Paths, writes: bool, ckpt: Checkpointer) -> mlflow_store.Store:
    """train.trackers.mlflow's file store, made what the resumed checkpoint holds now, before the code imports mlflow."""
    store = mlflow_store.Store(paths.mlflow, paths.scratch, writes, functools.partial(_resumed_from, ckpt))
    store.restore()
    return store


def _additions(ids: trackers.RunIds, tb: tensorboard.Log, ckpt: Checkpointer) -> tuple[dict, dict[str, Path]]:
    """What every checkpoint adds: the chain's ids in the manifest, and the TensorBoard log's files."""
    old = ids.follow(ckpt.resumed[1] if ckpt.resumed else None)
    if old is not None:
        warn(f"run id: the checkpoint resumed says {ids.run_id}, not {old} as read at the start; keeping {ids.run_id}")
    staged = tb.stage()
    return ids.manifest(), ({tensorboard.GROUP: staged} if staged is not None else {})


def _hung(progress: Progress, summarize: Callable, path: Path, waited: float, limit: float) -> None:
    """The watchdog's verdict: a step hangs. The summary says `hung`; no checkpoint is written."""
    def write() -> None:
        progress.status = summary.Status.HUNG
        summary.write(path, summarize({"type": "Hung", "message": f"no step completed for {waited:.0f}s",
                                       "stage": progress.phase}))

    watchdog.end_hung(say, write, waited, limit)


def _rebuilt(dl: DataLoader, shuffle: bool, sampler, batch_sampler):
    """What run.loader rebuilds a user's DataLoader from: its dataset, sizes, order and collate_fn."""
    if isinstance(dl.sampler, RandomSampler) and dl.sampler.generator is None:
        shuffle = True
    elif isinstance(dl.sampler, SequentialSampler):
        shuffle = False
    elif dl.batch_size is None or not isinstance(dl.batch_sampler, BatchSampler):
        batch_sampler = dl.batch_sampler
    else:
        sampler = dl.sampler
    return dl.dataset, dl.batch_size, shuffle, dl.num_workers, dl.drop_last, dl.collate_fn, sampler, batch_sampler

