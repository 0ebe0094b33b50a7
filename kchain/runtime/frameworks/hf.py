"""The Hugging Face Trainer under kchain: the Trainer keeps its loop, kchain owns its checkpoints.

A run_clm-style script keeps `trainer.train()`; two lines change:

    trainer = Trainer(model=model, args=args, ..., callbacks=[run.hf_callback()])
    trainer.train(resume_from_checkpoint=run.hf_resume(trainer))

What kchain takes over (transformers 5.24, accelerate 1.15):
- When the Trainer saves. `run.hf_resume` turns the Trainer's own saves off (save_strategy "no":
  save_steps and DefaultFlowCallback's epoch and end saves never fire; save_total_limit has nothing
  left to rotate, train.keep does it), and the callback's on_step_end asks for a save
  (control.should_save) on kchain's cadence (train.checkpoint_every), at the Trainer's end (max_steps,
  or any callback's should_training_stop, EarlyStoppingCallback's included) and at a deadline or
  SIGTERM stop: the deadline guard of run.should_stop, which also ends the training
  (control.should_training_stop).
- Where its checkpoints go. The Trainer writes checkpoint-N into its output_dir as usual (model or
  adapter, optimizer, scheduler, scaler, RNG states, trainer_state.json); on_save renames that folder
  into kchain's checkpoint of step N (checkpointer.attach: moved, never copied; hashed once, in the
  writer's thread), where the manifest holds each file's sha256 like state.pt's, so the restore
  verifies them and falls back to the previous checkpoint when one was damaged. A resume gives the
  Trainer a folder of links to the verified files (nothing copied either).
- The status. A deadline or signal stop saves and raises SessionStopped out of on_save, and with it
  out of trainer.train(): nothing after it runs in this session (status deadline or interrupted, the
  next session resumes there). The Trainer reaching max_steps is `finished`; a stop before it
  (EarlyStoppingCallback) is `stopped`, and the chain ends. run.total is the Trainer's max_steps after
  kchain's caps; run.step its global_step.
- The trace. on_log rows go to run.log at the Trainer's global_step, its eval_* metrics as val_*,
  without the timing values (*_runtime, *_per_second) and without train()'s closing summary (this
  call's pace and mean loss), so the smoke and a rehearsal compare traces. The loss the Trainer summed
  since its last log (it logs the mean of a logging_steps window) is in every checkpoint and put back,
  so a window cut by a session's end logs the same value as the uninterrupted run.
- The smoke. The Trainer's max_steps is capped to the smoke's steps and its datasets are cut to
  smoke.fraction (run.subset's rows; a dataset that already came from run.subset is left as it is); a
  smoke logs every step.

How the Trainer resumes, read in its sources: on_train_begin follows the checkpoint's load (model,
optimizer, scheduler, scaler, trainer_state.json); _run_epoch skips the epoch's first batches with
accelerate's skip_first_batches, which for a map-style dataset is a SkipBatchSampler over the same
epoch's index order (a SeedableRandomSampler seeded from (seed, epoch)): indices are skipped, no batch is
read again (huggingface/transformers#11284 is gone for those). The RNG states are restored after the
first batch of the resumed epoch is fetched, and loader workers get seeds the DataLoader iterator draws
when it is created, at another moment in a resumed session: a collator that draws random numbers
(DataCollatorForLanguageModeling with mlm=True, a random augmentation) would draw the first resumed
batch, or with workers every one, from other RNG states. So run.hf_resume wraps trainer.data_collator in
a SeededCollator: each batch is collated under RNGs seeded from (TrainingArguments.seed, the batch's
content, the epoch), then the RNGs are put back. The batch's content at a place of the run is the same
in every session (the sampler is seeded from (seed, epoch)), so its draws are too, in the main process
or a worker; the training's own draws (dropout) no longer see the collator's. An IterableDataset has no
order to skip in: the Trainer reads the skipped batches again; said as not exact.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import pickle
import random
import shutil
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kchain.common.say import say, warn
from kchain.runtime import replicas
from kchain.runtime.loader import subset as cut
from kchain.runtime.loop import Loop

GROUP = "hf"  # the checkpoint's files from the Trainer are attached under this name (hf.<file>)
WINDOW = "hf_trainer_log"  # the tracked name of the Trainer's unlogged loss sum
SKIPPED_LOGS = ("_runtime", "_per_second")  # timing values: never the same twice
SUMMARY_LOG = "train_runtime"  # the key of the closing summary train() logs
NOT_RESUMED = ("trainer.train() was called without resume_from_checkpoint=run.hf_resume(trainer): every "
               "session would start the Trainer from step 0; write "
               "trainer.train(resume_from_checkpoint=run.hf_resume(trainer))")


class HFSetupError(Exception):
    """The Trainer is not set up the way kchain can checkpoint it; the message says what to write."""


_bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bridge(loop: Loop, scratch: Path, smoke: bool, fraction: float) -> TrainerBridge:
    """The run's one TrainerBridge (run.hf_callback and run.hf_resume share it)."""
    found = _bridges.get(loop)
    if found is None:
        found = _bridges[loop] = TrainerBridge(loop, scratch, smoke, fraction)
    return found


class LogWindow:
    """The loss the Trainer summed since its last log, and that log's step: carried across sessions.

    The Trainer logs the mean loss of each logging_steps window; a resume would start a new window at
    the resumed step and log another mean. Each rank sums its own losses (the log averages them)."""

    kchain_per_rank = True  # checkpointer.per_rank: every rank's own is saved and given back

    def __init__(self):
        self.trainer = None
        self.pending: dict | None = None

    def state_dict(self) -> dict:
        t = self.trainer
        if t is None or not hasattr(t, "_tr_loss"):
            return {}
        return {"tr_loss": t._tr_loss.detach().to("cpu", copy=True), "last_logged": t._globalstep_last_logged,
                "total_loss": t._total_loss_scalar}

    def load_state_dict(self, state: dict) -> None:
        self.pending = state or None

    def apply(self) -> None:
        """At on_train_begin, after the Trainer reset its sums: the resumed window goes on."""
        t, state, self.pending = self.trainer, self.pending, None
        if t is not None and state:
            t._tr_loss = state["tr_loss"].to(t._tr_loss.device)
            t._globalstep_last_logged = int(state["last_logged"])
            t._total_loss_scalar = float(state["total_loss"])


class SeededCollator:
    """The Trainer's data collator, every batch collated under RNGs of its own (run.hf_resume puts it in).

    A collator that draws random numbers (DataCollatorForLanguageModeling's masks, a random augmentation)
    draws from the global RNGs of the process that collates, at the moment it does: a resumed session
    fetches its first batch before the Trainer restores its RNG states, and loader workers are seeded from
    a number the DataLoader iterator draws when it is created. Here torch's CPU generator, numpy's and
    python's `random` are seeded for the call from (seed, the batch's content, the epoch) and put back
    after it: the draws are a fixed function of the batch's place in the run, each batch still gets draws
    of its own (another content or epoch, another seed), and the training's RNG streams do not move. A
    collator that draws nothing gives what it gave. Not covered: CUDA generators, and a generator the
    collator keeps itself (DataCollatorForLanguageModeling(seed=N): said as not exact). A module-level
    class, so loader workers started by spawn or forkserver unpickle it; its other attributes (tokenizer,
    mlm) are the collator's."""

    def __init__(self, collator, seed: int):
        self.collator = collator
        self.seed = int(seed)  # TrainingArguments.seed
        self.epoch: int | None = None  # the Trainer's epoch, set at on_epoch_begin (None: not known)

    def __call__(self, features):
        digest = _batch_digest(features, f"kchain-collate:{self.seed}:{self.epoch}")
        py, npy = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):  # the CPU generator; torch.manual_seed would reseed CUDA too
            torch.random.default_generator.manual_seed(int.from_bytes(digest[:8], "little"))
            np.random.seed(int.from_bytes(digest[8:12], "little"))
            random.seed(digest)
            try:
                return self.collator(features)
            finally:
                random.setstate(py)
                np.random.set_state(npy)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("collator", "seed", "epoch"):  # asked by pickle before __dict__ is set
            raise AttributeError(name)
        return getattr(self.collator, name)


def _batch_digest(features, salt: str) -> bytes:
    """16 bytes from the salt and a batch's content, the same in every process and session: tensors' and
    arrays' dtype, shape and bytes, lists of token ids, mappings' keys and values, strings, numbers."""
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    _feed(h, features)
    return h.digest()


def _feed(h, x) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, np.ndarray) and not x.dtype.hasobject:
        h.update(f"A{x.dtype.str}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, Mapping):
        h.update(b"M%d" % len(x))
        for key, value in x.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(x, (list, tuple, np.ndarray)):
        ids = _int_array(x)
        if ids is not None:  # a row of token ids: one update, not one per id
            h.update(b"I%d" % len(ids) + ids.tobytes())
            return
        h.update(b"L%d" % len(x))
        for item in x:
            _feed(h, item)
    elif isinstance(x, (str, bytes)):
        data = x.encode() if isinstance(x, str) else x
        h.update(b"S%d:" % len(data) + data)
    elif x is None or isinstance(x, (bool, int, float, complex, np.generic)):
        h.update(f"{type(x).__name__}:{x!r}".encode())
    else:  # anything else by its pickle (deterministic for plain objects), else its repr
        try:
            h.update(pickle.dumps(x, protocol=4))
        except Exception:  # an object pickle refuses: its repr still names it
            h.update(f"{type(x).__qualname__}:{x!r}".encode())


def _int_array(x) -> np.ndarray | None:
    if not isinstance(x, np.ndarray) and x and all(type(v) is int for v in x):
        try:
            return np.asarray(x, dtype=np.int64)
        except OverflowError:
            return None
    return None


@functools.cache
def _callback_class():
    from transformers import TrainerCallback

    class KchainCallback(TrainerCallback):
        """kchain owns the Trainer's checkpoints: when (its cadence, the deadline, SIGTERM, the end),
        where (inside kchain's verified checkpoint) and the session's status (kchain/runtime/frameworks/hf.py)."""

        def __init__(self, owner: TrainerBridge):
            self.owner = owner

        def on_train_begin(self, args, state, control, **kwargs):
            self.owner.train_begin(state)

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.owner.epoch_begin(state)

        def on_step_end(self, args, state, control, **kwargs):
            self.owner.step_end(state, control)

        def on_epoch_end(self, args, state, control, **kwargs):
            self.owner.epoch_end(state, control)

        def on_save(self, args, state, control, **kwargs):
            self.owner.saved(args, state)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.owner.logged(state, logs or {})

        def on_train_end(self, args, state, control, **kwargs):
            self.owner.train_end(state)

    return KchainCallback


class TrainerBridge:
    """One Trainer's training driven through kchain's loop parts (it never sees the Run)."""

    def __init__(self, loop: Loop, scratch: Path, smoke: bool, fraction: float):
        self.loop = loop
        self.scratch = scratch  # where the folder the Trainer resumes from is laid out
        self.smoke, self.fraction = smoke, fraction
        self.trainer: Any = None  # the transformers Trainer (read as Any), from hf_resume on
        self.window = LogWindow()
        self.resumed: str | None = None  # the folder hf_resume returned ("" when fresh); None before
        self._callback = None
        self._asked: float | None = None  # when on_step_end asked for the save on_save completes
        self._disk_checked = False
        self.collator: SeededCollator | None = None  # told the epoch at each on_epoch_begin

    # --- the two calls of the user's script ---------------------------------------------------------

    def callback(self):
        """The TrainerCallback (one per run)."""
        if self._callback is None:
            self._callback = _callback_class()(self)
        return self._callback

    def resume(self, trainer) -> str | None:
        """Take the Trainer over and restore the newest checkpoint; the folder to resume from, or None."""
        from transformers import Trainer

        if self.resumed is not None:
            return self.resumed or None
        if not isinstance(trainer, Trainer):
            raise HFSetupError(f"run.hf_resume(trainer) needs the transformers Trainer it resumes, got a "
                               f"{type(trainer).__name__}; write trainer.train(resume_from_checkpoint=run.hf_resume(trainer))")
        lp = self.loop
        if lp.ranks.active and trainer.args.world_size != lp.ranks.world_size:
            raise HFSetupError(f"the Trainer sees {trainer.args.world_size} process(es) but kchain runs "
                               f"{lp.ranks.world_size} ranks: each would train a model of its own; build "
                               "TrainingArguments inside main(run), after the ranks are up")
        if lp.ranks.active:
            say(f"hf: the Trainer's DDP runs over kchain's {lp.ranks.world_size} ranks "
                f"(TrainingArguments.world_size {trainer.args.world_size})")
        self.trainer = self.window.trainer = trainer
        if not any(cb is self._callback for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self.callback())  # Trainer(..., callbacks=[run.hf_callback()]) left out
        _own_saves(trainer.args)
        best_model(trainer.args, lp.ckpt.best)
        if self.smoke:
            self._smoke_data(trainer)
        self._note_not_exact(trainer)
        self._seed_collation(trainer)
        lp.ckpt.track(WINDOW, self.window)
        lp.ckpt.cover("hf_model", trainer.model)  # the Trainer's checkpoint-N (attached to kchain's) holds it
        lp.ckpt.cover("hf_trainer", trainer)  # and its optimizer, scheduler and scaler, however they were made
        lp.restore()
        lp.progress.looped = True
        lp.check_one_model()
        if lp.progress.resumed_from is None:
            self.resumed = ""
            return None
        files = lp.ckpt.attached(GROUP)
        path = lp.ckpt.resumed[0] if lp.ckpt.resumed else None
        if not files:
            raise HFSetupError(f"cannot resume from {path}: it holds no Hugging Face Trainer checkpoint (a loop "
                               "without the Trainer wrote it); start fresh by detaching the state dataset")
        self.resumed = str(self._resume_folder(files, lp.progress.step))
        say(f"hf: the Trainer resumes from {path}'s checkpoint-{lp.progress.step} (linked, verified)")
        return self.resumed

    def _resume_folder(self, files: dict[str, Path], step: int) -> Path:
        """checkpoint-N as the Trainer reads it: links to the verified files (each rank its own folder)."""
        top = self.scratch / f"hf-resume-rank{self.loop.ranks.rank}"
        shutil.rmtree(top, ignore_errors=True)
        folder = top / f"checkpoint-{step}"
        for rel, src in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).symlink_to(src.resolve())
        return folder

    def _smoke_data(self, trainer) -> None:
        """A smoke trains on smoke.fraction of the Trainer's datasets (run.subset's rows)."""
        for attr in ("train_dataset", "eval_dataset"):
            data = getattr(trainer, attr, None)
            if isinstance(data, dict):
                setattr(trainer, attr, {k: smoke_cut(v, self.fraction) for k, v in data.items()})
            elif data is not None:
                setattr(trainer, attr, smoke_cut(data, self.fraction))
        data = trainer.train_dataset
        if data is not None and hasattr(data, "__len__"):
            say(f"smoke: the Trainer trains on {len(data)} rows (smoke.fraction {self.fraction:g} of its train_dataset)")

    def _note_not_exact(self, trainer) -> None:
        """What the Trainer's own resume cannot restore exactly, one line each (summary's not_exact)."""
        from transformers import DataCollatorForLanguageModeling

        args, lines = trainer.args, []
        if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
            lines.append("data order: the Trainer reads an IterableDataset: a resume replays its epoch and reads the "
                         "batches already trained again, exact only if the stream yields the same items each time")
        if args.ignore_data_skip:
            lines.append("data order: TrainingArguments(ignore_data_skip=True) restarts the epoch's data on resume")
        if args.save_only_model:
            lines.append("TrainingArguments(save_only_model=True) leaves the optimizer, scheduler and RNG states "
                         "out of the Trainer's checkpoints")
        collator = trainer.data_collator
        if isinstance(collator, DataCollatorForLanguageModeling) and collator.mlm \
                and getattr(collator, "seed", None) is not None:
            lines.append("data: DataCollatorForLanguageModeling(seed=...) masks from a generator of its own, which "
                         "starts again from the seed in every session; leave seed out (kchain seeds each batch's "
                         "masks from TrainingArguments.seed)")
        for line in lines:
            self.loop.progress.not_exact.append(line)
            warn(f"not exact on resume: {line}")

    def _seed_collation(self, trainer) -> None:
        """Every batch collated under RNGs of its own (SeededCollator), told the epoch while the workers that
        collate see it: not with persistent workers, made once and keeping the epoch they were made in."""
        if not isinstance(trainer.data_collator, SeededCollator):
            trainer.data_collator = SeededCollator(trainer.data_collator, trainer.args.seed)
        args = trainer.args
        persistent = args.dataloader_persistent_workers and args.dataloader_num_workers > 0
        self.collator = None if persistent else trainer.data_collator

    # --- the callback's hooks -------------------------------------------------------------------------

    def train_begin(self, state) -> None:
        """Before the first step: the Trainer resumed where kchain did; its total after kchain's caps."""
        p = self.loop.progress
        if self.resumed is None:
            raise HFSetupError(NOT_RESUMED)
        if state.global_step != p.step:
            raise HFSetupError(f"the Trainer starts at step {state.global_step} but kchain resumed step {p.step}: "
                               "give trainer.train() resume_from_checkpoint=run.hf_resume(trainer) and nothing else")
        state.max_steps = self.loop.capped(state.max_steps)
        p.total = state.max_steps
        self.window.apply()
        p.phase = "step"

    def epoch_begin(self, state) -> None:
        """Before the epoch's DataLoader iterator (and its workers) is made: the collator's epoch. The
        Trainer's float epoch is the last one's end (N.0) or, resumed, a point inside the epoch."""
        if self.collator is not None:
            self.collator.epoch = math.floor(state.epoch or 0)

    def step_end(self, state, control) -> None:
        """After each optimizer step: the step's faults, the stop (agreed over the ranks) and the save."""
        lp, step = self.loop, state.global_step
        lp.faults.at_step_end(step, lp.ranks.kill_all)
        stop = lp.should_stop(step)  # deadline guard, SIGTERM/SIGINT, a test's deadline
        due = lp.ckpt.due(step, lp.progress.total)
        if lp.ranks.active and "seconds" in lp.ckpt.policy.every and lp.ckpt.policy.plan is None:
            _, due = lp.ranks.agree(None, due)  # a clock-based cadence: every rank saves at the same step
        if self.smoke:
            control.should_log = True  # a smoke's few steps each compared
        if stop:
            control.should_training_stop = True
        if stop or due or control.should_training_stop:
            control.should_save = True
            self._asked = time.perf_counter()

    def epoch_end(self, state, control) -> None:
        """A stop decided after on_step_end (EarlyStoppingCallback's, in on_evaluate): save that step too."""
        if control.should_training_stop and self.loop.progress.saved_step != state.global_step:
            control.should_save = True
            self._asked = time.perf_counter()

    def saved(self, args, state) -> None:
        """The Trainer wrote checkpoint-N: it becomes kchain's checkpoint of step N (then a stop ends here)."""
        lp, step = self.loop, state.global_step
        t0, self._asked = self._asked or time.perf_counter(), None
        lp.ranks.barrier()  # every rank's part of the folder (its rng_state_R.pth) is written
        if lp.ranks.active:
            self._check_one_model(step)
        if lp.ranks.is_main:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
            self._check_disk(folder)
            lp.ckpt.attach(GROUP, folder)
        lp.save(step)  # after a deadline or signal stop: SessionStopped, out of trainer.train()
        lp.ckpt.stalls.append(time.perf_counter() - t0)  # the Trainer's own save is part of one (the guard plans with it)

    def _check_one_model(self, step: int) -> None:
        """kchain ddp: every rank holds the same trained weights at a save, or every rank stops here."""
        params = [(n, t) for n, t in self.trainer.model.named_parameters() if t.requires_grad]
        line = replicas.differing(self.loop.ranks.all_gather(replicas.fingerprint(params)), params)
        if line:
            raise replicas.UnsyncedReplicas(
                f"at the checkpoint of step {step} the ranks hold different weights, first {line}: the Trainer did "
                "not average the gradients over the ranks (is TrainingArguments built inside main(run)?)")

    def _check_disk(self, folder: Path) -> None:
        """Said once: an output_dir on another disk than the working dir costs a copy of every checkpoint."""
        if self._disk_checked:
            return
        self._disk_checked = True
        here = self.loop.ckpt.where.checkpoints
        here.mkdir(parents=True, exist_ok=True)
        if os.stat(folder).st_dev != os.stat(here).st_dev:
            warn(f"hf: the Trainer's output_dir {folder.parent} is on another disk than {here}: every checkpoint "
                 f"is copied once instead of moved (errno {errno.EXDEV}); put output_dir under the working dir")

    def logged(self, state, logs: dict) -> None:
        """The Trainer's log rows into run.log's trace: eval_* as val_*, no timings, no closing summary."""
        if SUMMARY_LOG in logs:
            return
        values = {}
        for key, value in logs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or key.endswith(SKIPPED_LOGS):
                continue
            values["val_" + key.removeprefix("eval_") if key.startswith("eval_") else key] = value
        if values:
            self.loop.trace.log(state.global_step, values)

    def train_end(self, state) -> None:
        """The Trainer ended by itself: finished at max_steps, stopped before it (an early stop)."""
        lp = self.loop
        if lp.progress.saved_step != state.global_step and self.trainer is not None:
            # A callback after kchain's turned the last save off: the step reached is saved all the same.
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
            self.saved(self.trainer.args, state)
        lp.finish(stopped=state.global_step < state.max_steps)
        lp.end_loop()


def _own_saves(args) -> None:
    """kchain decides when the Trainer saves: its own save_strategy is turned off, said in one line."""
    from transformers.trainer_utils import SaveStrategy

    unused = []
    if args.save_strategy != SaveStrategy.NO:
        unused.append(f"save_strategy={args.save_strategy.value!r}"
                      + (f", save_steps={args.save_steps:g}" if args.save_strategy == SaveStrategy.STEPS else ""))
    if args.save_total_limit:
        unused.append(f"save_total_limit={args.save_total_limit} (train.keep applies)")
    args.save_strategy = SaveStrategy.NO
    say("hf: kchain decides when the Trainer saves (train.checkpoint_every, the deadline, SIGTERM, the end) and "
        "keeps each checkpoint-N inside its own checkpoint" + (f"; not used: {', '.join(unused)}" if unused else ""))


def best_model(args, keeper) -> None:
    """load_best_model_at_end + metric_for_best_model (+ greater_is_better) onto train.keep_best.

    The Trainer's own load at the end is turned off (its checkpoint folders live inside kchain's): the
    best checkpoint is kept, and `kchain pull --best` brings it; the model in memory at the end stays the
    last step's. The Trainer logs eval_<m> and kchain's trace names it val_<m> (logged)."""
    from kchain.common import keepbest

    if not args.load_best_model_at_end:
        return
    args.load_best_model_at_end = False
    metric = "val_" + (args.metric_for_best_model or "loss").removeprefix("eval_")
    line = keepbest.adopt(keeper, metric, "max" if args.greater_is_better else "min",
                          f"load_best_model_at_end (metric_for_best_model={args.metric_for_best_model or 'loss'})")
    say(f"hf: {line}; the model in memory after trainer.train() is the last step's")


def smoke_cut(data, fraction: float):
    """run.subset's rows of a Trainer dataset (a `datasets.Dataset` through its own select), unless it
    already came from run.subset or has no length (an IterableDataset)."""
    if getattr(data, "kchain_subset", False) or isinstance(data, torch.utils.data.IterableDataset) \
            or not hasattr(data, "__len__"):
        return data
    if hasattr(data, "select") and hasattr(data, "column_names"):  # a datasets.Dataset keeps its columns
        return data.select(cut(list(range(len(data))), fraction))
    return cut(data, fraction)
