"""Run: the one object the user's `main(run)` talks to.

It is built from the job's config dict and an environment mapping (os.environ in the kernel), so a
test or a benchmark can build one in-process without the launcher. Restoring is lazy: `run.steps`
loads the newest checkpoint after the training code has registered everything with `run.track`
and `run.loader`, then yields the remaining step numbers, saving on the job's cadence, at the
deadline, on SIGTERM/SIGINT and at the end.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from . import (
    data,
    distributed,
    heartbeat,
    ladder,
    layout,
    precision,
    preflight,
    publishplan,
    replicas,
    resumecheck,
    watchdog,
)
from .checkpoint import (
    WRITE_SLACK,
    CheckpointsDamaged,
    CheckpointTooLarge,
    Snapshotter,
    Writer,
    available_ram,
    check_compatible,
    clean_tmp,
    complete,
    dir_bytes,
    find_and_load,
    gb,
    hash_early,
    load_state,
    make_room,
    restore_rng,
    rng_state,
    say,
    state_bytes,
    warn,
)
from .settings import Settings

STEP_TIME_WINDOW = 5
SNAPSHOT_RAM_FRACTION = 0.25  # a state above this share of free RAM is streamed, not copied
REUSE_MAX_BYTES = 256 * 2**20  # host copies up to this size are kept for the next save (no page faults)
PLAIN_LOADER_NOTE = "data order: a DataLoader not made by run.loader restarts its order on resume"
NO_LOOP_NOTE = "no checkpoint was written: the loop did not use run.steps"  # the deadline guard plans with the slowest of the last few steps


class SessionStopped(BaseException):  # noqa: N818  (a stop, not an error: a BaseException as SystemExit is)
    """A deadline or signal stop: the state at the stop is saved, and `main(run)` ends here.

    Raised out of the training loop (run.steps, run.epochs and the batches of a run.loader), so no
    code after the stop runs in this session: not the rest of an unfinished epoch (a per-epoch
    scheduler step, an evaluation), not the code after the loop. The next session resumes from the
    stop exactly. The launcher catches it; the status is `deadline` or `interrupted`.
    """


class Params(dict):
    """The job's params: `run.params.lr` and `run.params["lr"]` both work."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"params has no {name!r}; the job defines {sorted(self)}") from None


def _state_of(obj):
    obj = distributed.unwrap(obj)
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    return obj.state_dict()


def _load_into(obj, state) -> None:
    obj = distributed.unwrap(obj)
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    else:
        obj.load_state_dict(state)


def match_module_prefix(saved: dict, live: dict) -> dict:
    """Add or strip the `module.` prefix nn.DataParallel / DDP put on every key, to match `live`."""
    p = "module."
    saved_wrapped = bool(saved) and all(k.startswith(p) for k in saved)
    live_wrapped = bool(live) and all(k.startswith(p) for k in live)
    if saved_wrapped and not live_wrapped:
        return {k[len(p):]: v for k, v in saved.items()}
    if live_wrapped and not saved_wrapped:
        return {p + k: v for k, v in saved.items()}
    return saved


def _loader_name(loader) -> str:
    """A DataLoader as the user knows it: the variable that holds it in the code's frames, and what it reads."""
    what = f"a DataLoader over {type(loader.dataset).__name__}, batch_size {loader.batch_size}"
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(os.path.dirname(__file__)):
            name = next((k for k, v in frame.f_locals.items() if v is loader), None)
            if name is not None:
                return f"`{name}` ({what})"
        frame = frame.f_back
    return what


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
            model = Net().to(run.device)
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

    def __init__(self, config: dict, env: Mapping[str, str] | None = None, started: float | None = None,
                 halvings: int = 0):
        env = os.environ if env is None else env
        self.config = config
        self.job = config.get("job", "job")
        self.settings = st = Settings.parse(config, env, started)  # config + environment, parsed once
        self.params = Params({**(config.get("params") or {}), **st.smoke_params})
        if st.smoke_params:
            say("smoke params: " + ", ".join(f"{k}={v!r}" for k, v in st.smoke_params.items()))
        self.smoke, self.fraction, self.started, self.deadline = st.smoke, st.fraction, st.started, st.deadline
        self.every_cfg, self.keep, self.heartbeat_s, self.faults = st.every, st.keep, st.heartbeat_s, st.faults
        self.seed = int(self.params.get("seed", 0))
        self._init_paths(env)
        self._init_session_clock()
        self._init_device(env)
        self._init_progress()
        self._init_loop_clocks()
        self._init_checkpoints(halvings)

    def _init_paths(self, env: Mapping[str, str]) -> None:
        """Where everything lives: the inputs, the working dir and kchain's corner of it."""
        self.input_root = layout.input_root(env)
        self.working = layout.working_root(env)
        self.dir = layout.kchain_dir(env)
        self.checkpoints = self.dir / layout.CHECKPOINTS_DIR
        self.cache_dir = self.dir / layout.CACHE_DIR
        # The job's own cache dataset (render.py names it); without an owner, mounted under any owner.
        self.cache_dataset = (self.config.get("kaggle") or {}).get("cache_dataset") or f"{self.job}{data.CACHE_SUFFIX}"
        self.metrics_path = self.dir / layout.METRICS
        self.summary_path = self.dir / layout.SUMMARY
        self.dir.mkdir(parents=True, exist_ok=True)

    def _init_session_clock(self) -> None:
        """The session's limit and margin, and the in-kernel publish after the final save.

        The publish plan is None when the laptop relays the state. When the publish needs more than
        train.margin, the deadline moves earlier (_reserve_s); the first heartbeat says so.
        """
        st = self.settings
        self.limit_s, self.margin_s = st.limit_s, st.margin_s
        self.end = self.started + st.limit_s  # the session's hard limit
        self.publish_plan = None if self.smoke else publishplan.figures(self.config)
        self._state_bytes = 0  # the checkpoint's size: estimated at the first heartbeat, then measured
        self._sized_path: Path | None = None
        self._planned = False

    def _init_device(self, env: Mapping[str, str]) -> None:
        """The ranks, the device and the autocast dtype, each said with its reason."""
        # kchain ddp: the group this process is one rank of (a no-op group of 1 without torchrun).
        self.ranks = distributed.Ranks(env)
        self.device, why = precision.choose_device()
        self.device = self.ranks.device(self.device)
        say(f"device: {self.device} ({why}); {self.ranks.describe()}")
        self.dtype, why = precision.choose_dtype(self.device, self.settings.precision)
        say(f"precision: {str(self.dtype).removeprefix('torch.')} ({why})")

    def _init_progress(self) -> None:
        """Where the run stands (what the summary reports) and what is registered for checkpoints."""
        self.step = 0  # steps completed (restored ones included)
        self.total: int | None = None
        self.session = 1
        self.resumed_from: int | None = None
        self.status = "running"
        self.note: str | None = None  # one line for the summary when the status needs a why
        self.phase = "build"  # what the code is doing, for a crash report
        self.metrics: dict = {}
        self.best: dict | None = None
        self._tracked: dict[str, object] = {}
        self.not_exact: list[str] = []  # what a resume cannot restore exactly, one line each
        self._loaders: list[data.Loader] = []
        self._optimizers: list = []  # every optimizer run.optimize was given (tracked or not)
        self._sharded: bool | None = None  # kchain ddp: FSDP or DTensor parameters (found once)
        self._scaled = False  # run.optimize made a GradScaler
        self._warned_fp16 = False
        self._metrics_file = None  # opened by the first run.log
        self._metrics_bytes = 0
        self._asked_batches: list[int] = []  # run.loader's batch sizes as the code asks for them
        self._retired = False

    def _init_loop_clocks(self) -> None:
        """What the loop measures: step times for the deadline guard, data waits, save stalls."""
        self._dog: watchdog.Watchdog | None = None  # the hung-step watchdog, while a loop runs
        self._current = 0  # the step whose body is running
        self._restored = False
        self._stop_reason: str | None = None
        self._stopped = False  # a deadline or signal stop was saved and SessionStopped raised
        self._last_poll: float | None = None  # run.should_stop's previous call (its step timer)
        self._saved_step: int | None = None
        self._step_times: list[float] = []
        self._every_n: int | None = None  # the n of run.every(n), for the deadline plan
        self._eval_step: int | None = None
        self._eval_s = 0.0  # the longest step that ran run.every's evaluation
        self._loop_used = False  # run.steps / run.epochs / run.save / run.restore was used
        self._old_handlers = None
        self._data_wait = 0.0
        self._loop_start: float | None = None
        self._loop_steps = 0
        self._last_save = time.time()
        self._last_heartbeat = 0.0
        self.stalls: list[float] = []  # seconds the training thread spent blocked in each save

    def _init_checkpoints(self, halvings: int) -> None:
        """The writer, this session's trace, the out-of-memory ladder's rung and the resume check."""
        self._snapshots = Snapshotter()
        self.writer = Writer(self.faults.get("kill_in_save"), self.faults.get("kill_after_checkpoint") == "1")
        self.writer.die = self.ranks.kill_all  # kchain ddp: a kill fault ends every rank at once
        if self.is_main:  # kchain ddp: rank 0 alone owns the files
            clean_tmp(self.checkpoints)
        hash_early(self.checkpoints, self.input_root, self._state_slug())  # overlaps the user's set-up
        self._resume: tuple[Path, dict] | None = None  # found when the loop starts (run.restore)
        self._found: tuple[list[tuple[Path, dict]], list[str]] | None = None  # _find, once
        self._loaded: dict | None = None  # rank 0: the state _find loaded with it, until _restore
        self._plan: dict | None = None  # the checkpoint's size and write mode, set at the first save
        self.micro_auto = (self.config.get("train") or {}).get("micro_batch") == "auto"
        if self.micro_auto and self.is_main:  # the ladder starts from the size that fitted last session
            found, _ = self._find()
            halvings = max([halvings] + [int(m.get(ladder.MANIFEST_KEY, 0)) for _, m in found[:1]])
        self.micro_halvings = halvings if self.micro_auto else 0
        if self.is_main:
            self.metrics_path.write_bytes(b"")  # this session's lines; a resume puts the history before them
        if not self.smoke and self.is_main and resumecheck.expected(self.config):
            # The chain said which step this session resumes: check it now, in the session's first
            # minute, not after the data is staged (resumecheck.WrongState ends the run).
            found, _ = self._find()
            resumecheck.check(self.config, int(found[0][1]["step"]) if found else None,
                              str(found[0][0]) if found else None)

    def next_rung(self) -> str | None:
        """After an out-of-memory error: the ladder's next rung, or None (see ladder.next_rung).

        With a rung, this run is retired: a loop generator closed later (by the garbage collector)
        must not count or save the failed attempt's step."""
        rung = ladder.next_rung(self._asked_batches, self.micro_halvings, self.micro_auto, self._loop_steps > 0,
                                self.world_size)
        self._retired = rung is not None
        return rung

    # --- ranks (kchain ddp) -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank: 0 .. world_size-1 (0 without torchrun)."""
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks run `main(run)` (train.gpus; 1 without torchrun)."""
        return self.ranks.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0: the rank that writes checkpoints, the trace and the summary."""
        return self.ranks.is_main

    def wrap(self, model):
        """The model on this rank's device, in DistributedDataParallel when there are several ranks.

        Example:
            model = run.wrap(Net())          # DDP on 2 GPUs, the plain module on 1
            run.track(model=model)           # checkpoints hold the inner module's keys either way
        """
        return distributed.wrap(model, self.ranks, self.device)

    def _adopt(self, path: Path, manifest: dict, logged: bytes) -> None:
        """Resume from this checkpoint: its session number and its trace."""
        self._resume = (path, manifest)
        self.session = int(manifest.get("session", 0)) + 1
        # One continuous history: the trace as it was at the checkpoint (later lines are replayed),
        # then whatever this process logged before its loop started.
        if self.is_main:  # kchain ddp: rank 0 alone writes the trace
            self.metrics_path.write_bytes((path / layout.METRICS).read_bytes() + logged)
            self._metrics_bytes = self.metrics_path.stat().st_size
        say(f"session {self.session} of {self.job}: resuming from {path}")

    # --- registration ---------------------------------------------------------------------------

    def track(self, **objects) -> None:
        """Register what a checkpoint must hold, by name (names must stay the same across sessions).

        Example: `run.track(model=model, sched=sched, ema=ema_model)`. A name already used for
        another object is an error: two objects under one name would overwrite each other.
        """
        for name, obj in objects.items():
            ok = hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            if not (ok or isinstance(obj, (torch.Generator, np.random.Generator))):
                raise TypeError(
                    f"run.track({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict; "
                    "track modules, optimizers, schedulers, GradScalers or generators"
                )
            if self._restored:
                # A resumed run would silently differ from the uninterrupted one: stop here instead.
                raise RuntimeError(
                    f"run.track({name}=...) after run.steps started: the checkpoint is restored when "
                    "run.steps starts, so build and track everything (run.loader, run.optimize too) before the loop"
                )
            if any(o is obj for o in self._tracked.values()):
                continue
            if name in self._tracked:
                raise ValueError(
                    f"run.track({name}=...): the name {name!r} already tracks a {type(self._tracked[name]).__name__}; "
                    "give each object its own name (e.g. run.optimize(opt, name='disc_opt'))"
                )
            self._tracked[name] = obj

    def _free_name(self, base: str) -> str:
        """base, base2, base3, ...: the first not tracked yet (stable while the code is the same)."""
        n = 1
        while (name := base if n == 1 else f"{base}{n}") in self._tracked:
            n += 1
        return name

    def loader(self, dataset, batch_size: int | None = None, shuffle: bool = True, num_workers: int = 0,
               drop_last: bool = False, collate_fn: Callable | None = None, sampler=None,
               batch_sampler=None, name: str | None = None):
        """A DataLoader whose position is checkpointed, tracked as `name` (else loader, loader2, ...).

        `next(loader)` gives the next batch and moves into the next epoch by itself (for run.steps);
        `for batch in loader` reads the rest of this epoch (for run.epochs). Each epoch's order is
        drawn from (params.seed, epoch), so a resume goes on at the next batch of the same shuffle.
        `dataset` may also be a DataLoader you built (rebuilt here with its dataset, batch size,
        sampler and collate_fn), or any loader with state_dict/load_state_dict (e.g. torchdata's
        StatefulDataLoader), which is tracked as it is.

        Example::

            loader = run.loader(train, batch_size=64, num_workers=2, drop_last=True)
            weighted = run.loader(train, batch_size=64, sampler=WeightedRandomSampler(w, len(w)))
            x, y = next(loader)
        """
        name = name or self._free_name("loader")
        if not isinstance(dataset, (Dataset, DataLoader)) and hasattr(dataset, "state_dict") \
                and hasattr(dataset, "load_state_dict") and hasattr(dataset, "__iter__"):
            self.track(**{name: dataset})  # a stateful loader: its own state_dict is the position
            return dataset
        if isinstance(dataset, DataLoader):
            dl = dataset
            dataset, num_workers, collate_fn = dl.dataset, dl.num_workers, dl.collate_fn
            batch_size, drop_last = dl.batch_size, dl.drop_last
            if isinstance(dl.sampler, RandomSampler) and dl.sampler.generator is None:
                shuffle = True
            elif isinstance(dl.sampler, SequentialSampler):
                shuffle = False
            elif dl.batch_size is None or not isinstance(dl.batch_sampler, BatchSampler):
                batch_sampler = dl.batch_sampler
            else:
                sampler = dl.sampler
        preflight.check_worker_tmpdir(num_workers)
        if batch_sampler is None and batch_size is None:
            raise TypeError(f"run.loader({type(dataset).__name__}): give batch_size= (or a batch_sampler=)")
        if self.micro_auto and batch_size:  # the out-of-memory ladder's current rung
            self._asked_batches.append(batch_size)
            batch_size //= ladder.factor(self.micro_halvings)
        lo = data.Loader(
            dataset, batch_size, shuffle=shuffle, num_workers=num_workers, drop_last=drop_last,
            collate_fn=collate_fn, seed=self.seed, pin_memory=self.device.type == "cuda", on_wait=self._add_wait,
            sampler=sampler, batch_sampler=batch_sampler, rank=self.rank, world_size=self.world_size,
        )
        self._loaders.append(lo)
        if lo.iterable:
            self.not_exact.append(
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
        self._optimizers.append(optimizer)
        scaler = None
        if self.dtype == torch.float16:
            scaler = torch.amp.GradScaler(self.device.type)
        if track:
            opt_name = name or self._free_name("optimizer")
            self.track(**{opt_name: optimizer})
            if scaler is not None:
                self.track(**{f"{name}_scaler" if name else self._free_name("scaler"): scaler})
        self._scaled = self._scaled or scaler is not None
        if self.micro_auto:  # the ladder halved the micro-batch this many times: the same effective batch
            accumulate *= ladder.factor(self.micro_halvings)
        return precision.Stepper(optimizer, accumulate=accumulate, clip=clip, scaler=scaler)

    def autocast(self):
        """Mixed precision for the forward pass: `run.dtype` on CUDA, a no-op on CPU and with fp32.

        Wrap the forward pass and the loss, not the backward pass.

        Example::

            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            stepper.backward(loss)
        """
        if self.dtype == torch.float16 and not self._scaled and not self._warned_fp16:
            self._warned_fp16 = True
            warn(precision.FP16_WITHOUT_SCALER)
        return precision.autocast(self.device, self.dtype)

    # --- data -----------------------------------------------------------------------------------

    def input(self, name: str) -> Path:
        """The folder where an attached input (a dataset or the competition) is mounted.

        `name` is 'slug' or 'owner/slug'; /kaggle/input/<slug> and /kaggle/input/datasets/<owner>/<slug>
        both work. An input that is not attached is a FileNotFoundError that lists what is.

        Example::

            text = (run.input("me/shakespeare") / "input.txt").read_text()
        """
        return data.find_input(name, self.input_root)

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
        stage = functools.partial(data.stage, name, params, build, self.cache_dir, self.input_root,
                                  self.cache_dataset)
        if not self.ranks.active:
            return stage()
        # kchain ddp: rank 0 builds (or finds) the entry first; the others then load it from the cache.
        if not self.is_main:
            self.ranks.barrier()
        obj = stage()
        if self.is_main:
            self.ranks.barrier()
        return obj

    def subset(self, items):
        """In a smoke run, an evenly spread `smoke.fraction` of `items`; `items` itself otherwise.

        A Dataset, list, tuple, numpy array or tensor; spread over all of it, not its first rows,
        so sorted data keeps every class.

        Example::

            train = run.subset(TensorDataset(x, y))   # 2% of the rows under `kchain smoke`
        """
        return data.subset(items, self.fraction) if self.smoke else items

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
        before, self.phase = self.phase, "preflight"
        if splits:
            preflight.check_splits(splits)
        if batch is not None:
            preflight.check_batch(batch, x_shape, x_dtype, num_classes, label_dtype)
        self.phase = before

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
        self.total = self._capped(total)
        self._restore()
        self._begin_loop()
        step = self.step
        try:
            while step < self.total:
                if self._should_stop():
                    self._stop_here()
                step += 1
                t0 = self._start_step(step)
                try:
                    yield step
                except GeneratorExit:
                    if data.left_on_purpose():
                        self._end_step(step, t0, save=False)
                        if self.ranks.active and step < self.total:  # kchain ddp: the others stop with it
                            self._stop_reason = self._stop_reason or "stopped"
                            self._should_stop()
                        self._finish_loop(stopped=step < self.total)
                    raise
                self._end_step(step, t0)
            self._finish_loop()
        finally:
            self._end_loop()

    def epochs(self, total: int, loader: data.Loader | None = None):
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
        lo = loader or (self._loaders[0] if self._loaders else None)
        if lo is None:
            raise RuntimeError("run.epochs needs a loader made by run.loader (make it before the loop)")
        self.total = self._capped(total * len(lo))
        self._restore()
        self._begin_loop()
        lo.run = self
        try:
            while lo.epoch < total:
                if not self._may_start_step():
                    if self._stop_reason:
                        self._stop_here()
                    break
                epoch = lo.epoch
                try:
                    yield epoch
                except GeneratorExit:
                    if not self._stopped and data.left_on_purpose():
                        nxt = epoch + 1 if lo.epoch == epoch else lo.epoch
                        if self.ranks.active and nxt < total and self.step < self.total:
                            self._stop_reason = self._stop_reason or "stopped"  # kchain ddp: agreed
                            self._should_stop()
                        self._finish_loop(stopped=True)
                    raise
                if lo.epoch == epoch and not self._stop_reason:
                    lo._next_epoch()  # the batches were left early: the rest of this epoch is skipped
            self._finish_loop()
        finally:
            lo.run = None
            self._end_loop()

    def _may_start_step(self) -> bool:
        """False once the loop must end: the step cap reached, or a deadline or signal stop."""
        return self.step < self.total and not self._should_stop()

    def _stop_here(self) -> None:
        """A deadline or signal stop before the next step: save the state as it is now, end main(run).

        Nothing of the user's code runs after this in the session (see SessionStopped), so the
        checkpoint is the state at the stop, and code written for a finished epoch or a finished
        run never sees an unfinished one."""
        self._finish_loop()
        self._end_loop()
        self._stopped = True
        say(f"the session ends here: the code after the loop runs when the run is finished "
            f"(step {self.total}), in a later session")
        raise SessionStopped(self._stop_reason)

    def _capped(self, total: int) -> int:
        if self.settings.total_cap is not None:
            return min(total, self.settings.total_cap)
        if self.smoke:  # the smoke driver sets the cap itself (steps, then as many after the kill)
            return min(total, self.settings.smoke_steps)
        return total

    def _begin_loop(self) -> None:
        self._loop_used = True
        self._note_plain_loaders()
        self._check_one_model()
        self._old_handlers = self._install_signals()
        self._loop_start = time.perf_counter()
        self._last_save = time.time()
        if not self.smoke:  # a hung step ends the run instead of the session's remaining hours
            self._dog = watchdog.Watchdog(watchdog.floor_s(self.config, os.environ), self._hung).start()

    def _start_step(self, step: int) -> float:
        self._current = step
        self.phase = "step"
        if self._loop_steps == 0:
            ladder.injected([lo.batch_size for lo in self._loaders if lo.batch_size], self.faults)
        return time.perf_counter()

    def _known_optimizers(self) -> list:
        tracked = [o for o in self._tracked.values() if isinstance(o, torch.optim.Optimizer)]
        return list({id(o): o for o in [*self._optimizers, *tracked]}.values())

    def _tracked_modules(self) -> dict:
        return {n: o for n, o in self._tracked.items() if isinstance(o, torch.nn.Module)}

    def _check_one_model(self) -> None:
        """kchain ddp: before the first step, every parameter an optimizer steps is under DDP (else stop)."""
        if self.ranks.active:
            line = replicas.unsynced(self._known_optimizers(), self._tracked_modules())
            if line:
                raise replicas.UnsyncedReplicas(line)

    def _check_replicas(self, when: str) -> None:
        """kchain ddp: every rank holds the same trained parameters, or every rank stops here (one
        gather of a number per parameter tensor; see replicas.py)."""
        params = replicas.trained(self._known_optimizers(), self._tracked_modules())
        if self._sharded is None:
            self._sharded = replicas.sharded(params)
        if self._sharded:
            return  # FSDP / DTensor: each rank holds its own shard, equal sums are not expected
        line = replicas.differing(self.ranks.all_gather(replicas.fingerprint(params)), params)
        if line:
            raise replicas.UnsyncedReplicas(
                f"{when} the ranks hold different weights, first {line}: the gradients were not averaged "
                f"over the ranks; {replicas.FIX}")

    def _end_step(self, step: int, t0: float, save: bool = True) -> None:
        """The body of `step` ran to its end: count it, and save when the cadence says so."""
        stall = float(self.faults.get("stall_step", 0))
        if stall:
            time.sleep(stall)
        if step == int(self.faults.get("kill_at_step", -1)):
            self.ranks.kill_all()  # a real death (of every rank): nothing below runs
        if step == int(self.faults.get("hang_at_step", -1)):
            time.sleep(10**9)  # a step that never returns: the watchdog ends the run
        self.step = step
        self._loop_steps += 1
        took = time.perf_counter() - t0
        self._step_times = (self._step_times + [took])[-STEP_TIME_WINDOW:]
        if self._eval_step == step:  # a step that ran run.every's evaluation: remembered apart
            self._eval_s = max(self._eval_s, took)
        if self.ranks.active and self._loop_steps == 1:
            self._check_replicas(f"after step {step}")
        self._heartbeat()
        if self._dog is not None:
            self._dog.beat(took)
        # kchain ddp: with several ranks the save is agreed at the start of the next step (_should_stop)
        if save and not self.ranks.active and self._save_due():
            self.save()

    def _finish_loop(self, stopped: bool = False) -> None:
        if self._retired:  # an attempt the out-of-memory ladder replaced: nothing of it is kept
            return
        if self._dog is not None:
            self._dog.stop()  # the final save and what follows the loop are not steps
        if stopped:
            self._stop_reason = self._stop_reason or "stopped"
        if self._saved_step != self.step:
            self.save()
        self.phase = "checkpoint"
        self.writer.wait()
        self.ranks.barrier()  # kchain ddp: no rank leaves before rank 0's checkpoint is complete
        self.status = self._stop_reason or "finished"
        say(f"{self.status} at step {self.step}/{self.total}; checkpoint {self.checkpoint_rel()}")
        if self.status == "finished" and self.total is not None and self.step < self.total:
            # run.epochs ran out of epochs before its steps: some passes gave no batches (a loop that
            # skipped them, a loader read by another consumer). Finished, but not what was asked for.
            self.note = (f"trained {self.step} of the {self.total} steps asked for: some epochs gave no "
                         "batches (read the loader once per epoch, inside run.epochs)")
            warn(self.note)
        self.phase = "validation"  # whatever runs after the loop is usually a final evaluation

    def _note_plain_loaders(self) -> None:
        """Name any torch DataLoader the user built (not via run.loader): it restarts on resume."""
        ours = {id(lo._dl) for lo in self._loaders}
        tracked = {id(o) for o in self._tracked.values()}

        def plain_loaders() -> list:
            # type(o), not isinstance: isinstance reads __class__, which some torch objects warn on.
            # A sequential one (a validation loader) restarting from its start is what it should do.
            return [o for o in gc.get_objects()
                    if issubclass(type(o), DataLoader) and id(o) not in ours and id(o) not in tracked
                    and not isinstance(o.sampler, SequentialSampler)]

        # A DataLoader made for one batch (a preflight check) is garbage, not a loader in use: when
        # there is a candidate, collect (a full pass over torch's objects, ~0.2 s) and look again.
        plain = plain_loaders()
        if plain:
            del plain
            gc.collect()
            plain = plain_loaders()
        if plain and not any(line.startswith(PLAIN_LOADER_NOTE) for line in self.not_exact):
            named = ", ".join(_loader_name(o) for o in plain[:3])
            self.not_exact.append(f"{PLAIN_LOADER_NOTE}: {named} (pass it to run.loader(...) to keep its place; "
                                  "one used only for evaluation does not change the resume)")
        del plain
        for line in self.not_exact:
            warn(f"not exact on resume: {line}")

    def _end_loop(self) -> None:
        if self._dog is not None:
            self._dog.stop()
            self._dog = None
        self._restore_signals(self._old_handlers)
        self._old_handlers = None

    def every(self, n: int) -> bool:
        """True every n steps and on the last step: where an evaluation goes inside the loop.

        That step's crash stage is `validation`, and the deadline guard plans with how long it took.

        Example::

            if run.every(500):
                run.log(val_loss=evaluate(model, val))
        """
        self._every_n = n
        hit = self._current % n == 0 or self._current == self.total
        if hit:
            self.phase = "validation"
            self._eval_step = self._current
        return hit

    @property
    def finished(self) -> bool:
        """The loop reached its total (False after a deadline or interrupt stop)."""
        return self.status == "finished"

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
        step = values.pop("step", None) or self._current or self.step
        if mean_over_ranks:
            values = {**values, **self.ranks.mean({k: v for k, v in values.items() if isinstance(v, (int, float))})}
        if not self.is_main:
            self.metrics.update(values)
            return
        row = {"step": step, "time": round(time.time(), 3), **values}
        line = (json.dumps(row) + "\n").encode()
        if self._metrics_file is None:
            self._metrics_file = open(self.metrics_path, "ab")
        self._metrics_file.write(line)
        self._metrics_file.flush()
        self._metrics_bytes += len(line)
        self.metrics.update(values)
        for k, v in values.items():
            # The first val* metric logged is the one "best" follows; lower is better for losses.
            if not k.startswith("val") or not isinstance(v, (int, float)):
                continue
            if self.best is not None and self.best["name"] != k:
                continue
            lower = any(w in k for w in ("loss", "err", "perplexity", "ppl"))
            if self.best is None or (v < self.best["value"] if lower else v > self.best["value"]):
                self.best = {"name": k, "value": v, "step": row["step"]}
            break

    # --- internals ------------------------------------------------------------------------------

    def _add_wait(self, seconds: float) -> None:
        self._data_wait += seconds

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def stop(signum, frame):
            self._stop_reason = "interrupted"
            say(f"received {signal.Signals(signum).name}: stopping after this step and saving")

        return {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(old) -> None:
        for s, handler in (old or {}).items():
            signal.signal(s, handler)

    def _agreed_stop(self, save: bool) -> bool:
        """One all-reduce (kchain ddp): every rank stops, and saves, when any rank says so.

        The save comes before the stop, so a stop right after a due save writes no second checkpoint."""
        local = self._stop_reason if self._local_stop() else None
        stop, save = self.ranks.agree(local, save)
        if stop and not self._stop_reason:
            say(f"another rank stopped ({stop}): stopping at step {self.step} with it")
        if stop:
            self._stop_reason = stop
        if save:
            self.save()
        return bool(stop)

    def _hung(self, waited: float, limit: float) -> None:
        """The watchdog's verdict: a step hangs. The summary says `hung`; no checkpoint is written."""
        def write() -> None:
            self.status = "hung"
            summary = self.summary(error={"type": "Hung", "message": f"no step completed for {waited:.0f}s",
                                          "stage": self.phase})
            tmp = self.summary_path.with_name(f"{layout.TMP_PREFIX}{self.summary_path.name}")
            tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
            os.replace(tmp, self.summary_path)

        watchdog.end_hung(say, write, waited, limit)

    def _should_stop(self) -> bool:
        """Whether the loop must end before the next step (checked at the start of every step)."""
        if not self.ranks.active:
            return self._local_stop()
        # kchain ddp: one all-reduce at the start of each step decides for every rank, and saves
        # the step just finished when any rank's cadence says so.
        due = self._loop_steps > 0 and self._saved_step != self.step and self._save_due()
        return self._agreed_stop(save=due)

    def _local_stop(self) -> bool:
        """This process's own view: a signal, the deadline guard, or a test's deadline fault."""
        if self._stop_reason:
            return True
        at = self.faults.get("deadline_at_step")  # a test's clock: this rank's deadline is now
        if at and self.step >= int(at) and str(self.rank) == self.faults.get("deadline_rank", str(self.rank)):
            self._stop_reason = "deadline"
            say(f"deadline (fault: this rank's clock) at step {self.step}: stopping and saving")
            return True
        after = int(self.faults.get("deadline_after_steps", 0) or 0)
        if after and self._loop_steps >= after:
            # A test's clock: the deadline falls after N steps of this session, whatever the machine.
            self._stop_reason = "deadline"
            say(f"deadline (fault deadline_after_steps={after}): stopping at step {self.step} and saving")
            return True
        step_s = max(self._step_times, default=0.0)
        nxt = self.step + 1
        if self._every_n and (nxt % self._every_n == 0 or nxt == self.total):
            # The next step runs run.every's evaluation: plan with the longest such step seen,
            # which may have left the window of recent steps long ago.
            step_s = max(step_s, self._eval_s)
        save_s = max(self.stalls, default=0.0) + self.writer.last_write_s
        self.deadline = self.end - self._reserve_s()
        left = self.deadline - time.time()
        if left < step_s + save_s:
            self._stop_reason = "deadline"
            say(
                f"deadline: {left:.1f}s left before the session limit and a step takes {step_s:.2f}s "
                f"(+{save_s:.2f}s to save): stopping at step {self.step} and saving"
            )
            return True
        return False

    def _publish_s(self) -> float:
        """Seconds the in-kernel publish needs, 0 when there is none or it cannot fit the session."""
        if self.publish_plan is None:
            return 0.0
        path = self.writer.last_path
        if path is not None and path != self._sized_path:
            self._sized_path, self._state_bytes = path, publishplan.tree_bytes(path)
        need = publishplan.seconds(self.publish_plan, self._state_bytes)
        return need if need <= (self.limit_s - self.margin_s) / 2 else 0.0

    def _reserve_s(self) -> float:
        """Kept back after the last step besides the final save: train.margin, or the publish if longer."""
        return max(self.margin_s, self._publish_s())

    def _plan_publish(self) -> None:
        """Once, with the first heartbeat: when the session stops and what the time after it is for."""
        self._planned = True
        if self.publish_plan is None:
            return
        if not self._state_bytes:
            self._state_bytes = publishplan.state_bytes(
                {name: _state_of(obj) for name, obj in self._tracked.items()})
        size = publishplan.size_text(self._state_bytes)
        need = publishplan.seconds(self.publish_plan, self._state_bytes)
        source = "measured" if self.publish_plan.get("measured") else "assumed"
        if not self._publish_s():
            say(f"plan: the publish of {size} needs about {heartbeat.duration(need)} ({source}), more than half "
                f"this session: stopping at {heartbeat.duration(self.end - self.margin_s - self.started)}; "
                "`kchain continue` relays the state from the laptop")
            return
        self.deadline = self.end - self._reserve_s()
        say(f"plan: stopping at {heartbeat.duration(self.deadline - self.started)}: "
            f"{heartbeat.duration(self._reserve_s())} for save + publish of {size} ({source} figures)")

    def _save_due(self) -> bool:
        if "steps" in self.every_cfg:
            return self.step % int(self.every_cfg["steps"]) == 0
        return time.time() - self._last_save >= float(self.every_cfg["seconds"])

    def _next_checkpoint(self) -> str:
        if "steps" in self.every_cfg:
            n = int(self.every_cfg["steps"])
            return f"{n - self.step % n} steps"
        return heartbeat.duration(float(self.every_cfg["seconds"]) - (time.time() - self._last_save))

    def _heartbeat(self) -> None:
        if not self._planned:
            self._plan_publish()
        now = time.perf_counter()
        if not self.is_main or (self.heartbeat_s and now - self._last_heartbeat < self.heartbeat_s):
            return
        self._last_heartbeat = now
        elapsed = now - self._loop_start
        rate = self._loop_steps / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.step) / rate if rate else None
        shown = {k: v for k, v in self.metrics.items() if isinstance(v, (int, float))}
        print(heartbeat.line(
            self.step, self.total, shown, rate, self._data_wait / elapsed if elapsed > 0 else 0.0,
            eta, self.deadline - time.time(), self._next_checkpoint(), ranks=self.world_size,
        ), flush=True)

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
        now = time.perf_counter()
        if self._last_poll is not None:
            self._step_times = (self._step_times + [now - self._last_poll])[-STEP_TIME_WINDOW:]
        self._last_poll = now
        if step is not None:
            self.step = self._current = step
        self._loop_steps += 1
        if self._old_handlers is None:
            self._old_handlers = self._install_signals()
        if self._loop_start is None:
            self._loop_start = now
        local = self._stop_reason if self._local_stop() else None
        if self.ranks.active:  # kchain ddp: every rank stops at the same step
            agreed, _ = self.ranks.agree(local, False)
            self._stop_reason = agreed or self._stop_reason
        return bool(self._stop_reason)

    def restore(self) -> int:
        """Load the newest checkpoint into everything tracked; returns the step it resumes at (0 fresh).

        For a loop kchain cannot drive; `run.steps` calls this itself. Example::

            start = run.restore()
            for step in range(start + 1, total + 1):
                train_one_step()
                if step % 500 == 0 or step == total:
                    run.save(step)
        """
        self._restore()
        self._loop_used = True
        self._check_one_model()
        return self.step

    def _find(self) -> tuple[list[tuple[Path, dict]], list[str]]:
        """The checkpoint to resume from (a list of one, or none) and the damaged ones: looked for once.

        The one found is verified and loaded in the same pass over its state.pt (find_and_load); its
        state waits in self._loaded for _restore.
        """
        if self._found is None:
            hit, damaged = find_and_load(self.checkpoints, self.input_root, self.dir / ".scratch", self.job,
                                         state_slug=self._state_slug())
            self._loaded = hit[2] if hit else None
            self._found = ([(hit[0], hit[1])] if hit else [], damaged)
        return self._found

    def _state_slug(self) -> str | None:
        """The slug of the job's state dataset, as the rendered config names it (None in a local run)."""
        ref = (self.config.get("kaggle") or {}).get("state_dataset") or ""
        return ref.rsplit("/", 1)[-1] or None

    def _restore(self) -> None:
        if self._restored:
            return
        self._restored = True
        self.phase = "resume"
        saved = self._load_found()
        if saved is None:
            say(f"session 1 of {self.job}: no checkpoint found, starting fresh")
            self.phase = "build"
            return
        path, manifest = self._resume
        distributed.check_world_size(path, manifest, self.world_size)
        self._state_bytes = publishplan.tree_bytes(path)
        if self.ranks.active:  # kchain ddp: this rank's own RNGs and loader positions
            mine = saved["ranks"][self.rank]
            saved["rng"] = mine["rng"]
            saved["tracked"] = {**saved["tracked"], **mine["tracked"]}
        self._apply(path, manifest, saved["tracked"])
        restore_rng(saved["rng"])
        self.step = self._saved_step = self.resumed_from = int(saved["step"])
        self.metrics = dict(saved.get("metrics") or {})
        self.best = saved.get("best")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(manifest.get("time", 0))))
        say(f"resumed from step {self.step} ({path}, saved at {when})")

    def _load_found(self) -> dict | None:
        """The state to resume from, adopted (_adopt); None to start fresh.

        kchain ddp: rank 0 finds, verifies and loads (and sets damaged ones aside); the other ranks
        learn what it found and load that file.
        """
        mine = self._find() if self.is_main else None
        found, damaged = self.ranks.all_gather(mine)[0]
        if not found:
            if damaged:
                # Starting over would silently redo (and overwrite) the chain's work: stop and say why.
                raise CheckpointsDamaged(
                    f"every checkpoint found is damaged: {'; '.join(damaged)}. Attach an earlier "
                    "state version, or detach the state dataset to start fresh on purpose"
                )
            return None
        path, manifest = found[0]
        saved = self._loaded if self.is_main else load_state(path)
        self._loaded = None  # the live objects hold it from here on
        if self._metrics_file is not None:
            self._metrics_file.flush()
        self._adopt(path, manifest, self.metrics_path.read_bytes() if self.is_main else b"")
        return saved

    def _apply(self, path: Path, manifest: dict, saved: dict) -> None:
        """Load the saved tracked states into the live objects, after checking that they fit."""
        for name, obj in self._tracked.items():
            live = distributed.unwrap(obj)  # DDP: checkpoints hold the inner module's keys
            if isinstance(live, torch.nn.Module) and isinstance(saved.get(name), dict):
                saved[name] = match_module_prefix(saved[name], live.state_dict())
        current = {name: _state_of(obj) for name, obj in self._tracked.items()}
        check_compatible(path, manifest, saved, current, dict(self.params))
        for name, obj in self._tracked.items():
            if name in saved:
                _load_into(obj, saved[name])
            else:
                warn(f"{name!r} is tracked now but not in the checkpoint: it starts fresh, the run is not exact")
        for name in saved:
            if name not in self._tracked:
                warn(f"the checkpoint holds {name!r} but nothing is tracked under that name now: ignored")

    def save(self, step: int | None = None) -> None:
        """Checkpoint everything tracked as `step` (default: the step reached), as run.steps does.

        The snapshot blocks; the write runs in the background. See run.restore for an example.
        """
        if self._retired:  # kchain ladder: an attempt the out-of-memory ladder replaced is never saved
            return
        if step is not None:
            self._restore()  # a save before any restore would hide the checkpoint to resume from
            self.step = self._current = step
            self._loop_used = True
        before, self.phase = self.phase, "checkpoint"
        t0 = time.perf_counter()
        self.writer.wait()  # one write in flight at most: bounds memory to one extra copy
        if self.ranks.active:  # kchain ddp: never a checkpoint of one rank's model among several
            self._check_replicas(f"at the checkpoint of step {self.step}")
        # kchain ddp: every rank's own RNGs and loader positions go to rank 0, which writes alone.
        per_rank = self.ranks.gather(self._rank_state()) if self.ranks.active else None
        if self.is_main:
            self._write(per_rank)
            self.stalls.append(time.perf_counter() - t0)
            if self._dog is not None:
                self._dog.pause()  # a save is not a step: the hang clock restarts after it
        self._saved_step = self.step
        self._last_save = time.time()
        self.phase = before
        if step is not None and self._stop_reason and not self._stopped:
            # A loop of the user's own, saving after run.should_stop said stop: end main(run) as run.steps does.
            self.writer.wait()
            self.ranks.barrier()
            self.status = self._stop_reason
            self._stopped = True
            say(f"{self.status} at step {self.step}; checkpoint {self.checkpoint_rel()}: the session ends here")
            raise SessionStopped(self._stop_reason)

    def _write(self, per_rank: list | None) -> None:
        """Rank 0's part of a save: room on the disk, then the state to the writer (see save)."""
        live = {
            "step": self.step,
            "tracked": {name: _state_of(obj) for name, obj in self._tracked.items()},
            "rng": rng_state(),
            "metrics": self.metrics,
            "best": self.best,
            **({"ranks": per_rank} if per_rank else {}),
        }
        if self._plan is None:
            self._plan = self._plan_checkpoints(live)
        pruned = make_room(self.checkpoints, self._plan["bytes"])
        if pruned:
            say(pruned)
        if self._metrics_file is not None:
            self._metrics_file.flush()
        job = dict(checkpoints=self.checkpoints, step=self.step, metrics_src=self.metrics_path,
                   metrics_bytes=self._metrics_bytes, manifest=self._manifest(), keep=self.keep)
        if self._plan["stream"]:
            self.writer.write_now(state=live, **job)  # blocks; no host copy of the state
            return
        state = self._snapshots.take(live)
        del live
        if not self._plan["reuse"]:
            self._snapshots.release()  # the writer holds the only reference: freed when written
        self.writer.submit(state=state, **job)

    def _manifest(self) -> dict:
        """What a checkpoint says about itself, next to its file list (see checkpoint.write_checkpoint)."""
        return {
            "job": self.job,
            "step": self.step,
            "time": time.time(),
            "session": self.session,
            "fingerprint": self.config.get("fingerprint"),
            "kchain_version": self.config.get("kchain_version"),
            "params": dict(self.params),
            "world_size": self.world_size,
            ladder.MANIFEST_KEY: self.micro_halvings,
        }

    def _rank_state(self) -> dict:
        """What differs between ranks (kchain ddp): the global RNGs and the per-rank tracked objects."""
        per_rank = (data.Loader, torch.Generator, np.random.Generator)  # a rank's shard and its own RNGs
        private = {n: _state_of(o) for n, o in self._tracked.items() if isinstance(o, per_rank)}
        return {"rank": self.rank, "rng": rng_state(), "tracked": private}

    def _plan_checkpoints(self, live: dict) -> dict:
        """At the first save: the checkpoint's size against the disk and RAM, said in one line.

        A state that fits a quarter of the free RAM is copied to host memory and written in the
        background (training goes on); a larger one is streamed to the file from the live tensors,
        blocking, so no second full copy ever exists. KCHAIN_CHECKPOINT_STREAM=1/0 forces either.
        """
        size = state_bytes(live)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.checkpoints).free
        ours = sum(dir_bytes(p) for p in complete(self.checkpoints))
        ram = available_ram()
        forced = self.settings.stream
        if forced in ("0", "1"):
            stream, why = forced == "1", f"{layout.CHECKPOINT_STREAM_ENV}={forced}"
        elif ram is not None and size > SNAPSHOT_RAM_FRACTION * ram:
            stream, why = True, f"more than {SNAPSHOT_RAM_FRACTION:.0%} of the {gb(ram)} of RAM available"
        else:
            stream, why = False, f"fits in RAM ({gb(ram) if ram is not None else 'unknown'} available)"
        mode = "streamed from the live tensors (blocks training)" if stream else "copied to RAM, written in the background"
        peak = (self.keep + 1) * size
        if 2 * size * WRITE_SLACK > free + ours:
            # The newest checkpoint stays until the next one is complete: two must fit at once.
            raise CheckpointTooLarge(
                f"checkpoint needs {gb(size)}, and two must fit while one is written ({gb(2 * size)}), but "
                f"{self.checkpoints} has {gb(free + ours)} for checkpoints: free disk space (delete files in "
                "/kaggle/working) or checkpoint less state (8-bit or bf16 optimizer moments)"
            )
        room = ("fits" if peak <= free + ours else
                "does not fit: older checkpoints are pruned before each write, the newest kept until the new one is complete")
        say(f"checkpoint plan: {gb(size)} per checkpoint, keep {self.keep} + 1 being written = {gb(peak)} "
            f"({gb(free + ours)} available) {room}; {mode}: {why}")
        return {"bytes": size, "stream": stream, "reuse": size <= REUSE_MAX_BYTES}

    def checkpoint_rel(self) -> str | None:
        """The newest complete checkpoint, relative to the working dir."""
        path = self.writer.last_path
        if path is None and self._resume:
            path = self._resume[0]
        if path is None:
            return None
        try:
            return str(path.relative_to(self.working))
        except ValueError:
            return str(path)

    def end_without_loop(self) -> None:
        """main(run) returned while the status is still `running`: say whether anything was saved."""
        if self._saved_step is not None or self.writer.last_path is not None:
            self.writer.wait()
            self.status = "finished"  # a hand-written loop that called run.save()
            return
        self.status = "no_checkpoint"
        self.note = NO_LOOP_NOTE
        warn(NO_LOOP_NOTE)

    def close(self) -> None:
        """Join the writer (no write is ever left in flight) and close the trace."""
        try:
            self.writer.wait()
        finally:
            self._restore_signals(self._old_handlers)  # run.should_stop's, if a loop of the user's own set them
            self._old_handlers = None
            self.ranks.close()
            if self._metrics_file is not None:
                self._metrics_file.close()
                self._metrics_file = None

    def summary(self, error: dict | None = None, ended: float | None = None) -> dict:
        elapsed = (time.perf_counter() - self._loop_start) if self._loop_start else 0.0
        return {
            "status": self.status,
            "session": self.session,
            "step": self.step,
            "total": self.total,
            "metrics": self.metrics,
            "best": self.best,
            "checkpoint": self.checkpoint_rel(),
            "error": error,
            "started": self.started,
            "ended": ended or time.time(),
            "steps_per_s": round(self._loop_steps / elapsed, 3) if elapsed > 0 else None,
            "fingerprint": self.config.get("fingerprint"),
            "resumed_from": self.resumed_from,
            "published": None,
            "note": self.note,
            "not_exact": self.not_exact,
            "world_size": self.world_size,
        }
