"""The checkpointer: what a checkpoint holds, when a save is due, and the save and the restore.

The policy sits beside the mechanism, in the shape of torchtitan's CheckpointManager: the objects
tracked by name, the cadence (`train.checkpoint_every`), the size plan made at the first save
(copy to RAM and write in the background, or stream from the live tensors), the writer and the
host snapshots, the search for the checkpoint to resume from and its loading into the live
objects. It never sees the Run: it receives the ranks, the progress record and the trace.

kchain ddp: rank 0 alone finds, verifies and writes; every rank's own RNG states and loader
positions are gathered into rank 0's checkpoint, and each rank gets its own back on resume.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kchain.common import heartbeat, keepbest, layout, sink
from kchain.common.checkpoint_files import (
    ATTACHED_KEY,
    BEST_KEY,
    FROZEN_KEY,
    MODULES_KEY,
    WRITE_SLACK,
    CheckpointInvalid,
    CheckpointsDamaged,
    CheckpointTooLarge,
    attached_files,
    attached_names,
    bring_best,
    clean_tmp,
    complete,
    dir_bytes,
    hash_early,
    make_room,
    newest_first,
    read_manifest,
)
from kchain.common.faults import Faults
from kchain.common.say import gb, say, warn
from kchain.common.sessionplan import SessionPlan
from kchain.common.trace import Trace
from kchain.runtime import distributed, ladder
from kchain.runtime.checkpoint import frozen
from kchain.runtime.checkpoint.frozen import FrozenBase
from kchain.runtime.checkpoint.snapshot import Snapshotter, available_ram, restore_rng, rng_state
from kchain.runtime.checkpoint.state import CheckpointJob, Writer, check_compatible, find_and_load, load_state
from kchain.runtime.checkpoint.statedigest import digest_state
from kchain.runtime.checkpoint.untracked import digests_of as untracked_digest
from kchain.runtime.checkpoint.untracked import tensors_only
from kchain.runtime.loader import Loader
from kchain.runtime.progress import Progress

SNAPSHOT_RAM_FRACTION = 0.25  # a state above this share of free RAM is streamed, not copied
REUSE_MAX_BYTES = 256 * 2**20  # host copies up to this size are kept for the next save (no page faults)
PER_RANK = (Loader, torch.Generator, np.random.Generator)  # a rank's data shard and its own RNGs
# What DDP and the optimizer step keep equal on every rank (replicas.py checks the weights).
REPLICATED = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def per_rank(obj) -> bool:
    """A tracked object each rank holds its own of (gathered into rank 0's checkpoint, given back to
    each rank on resume): PER_RANK, or one that says so (`kchain_per_rank = True`, e.g. hf.py's)."""
    return isinstance(obj, PER_RANK) or bool(getattr(obj, "kchain_per_rank", False))


BUFFERS_KEY = "buffers"  # a rank's own module buffers, in its part of the checkpoint (kchain ddp)


def _buffers(obj) -> dict:
    """A tracked module's buffers as its state_dict holds them (the inner module's, under DDP)."""
    module = distributed.unwrap(obj)
    names = {n for n, _ in module.named_buffers()}
    return {k: v for k, v in module.state_dict().items() if k in names}


def _copy_into(live, saved) -> None:
    """Tracked tensors loaded back in place (every holder of them sees the restored values)."""
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(saved)
        return
    same = set(live) == set(saved) if isinstance(live, dict) else len(live) == len(saved)
    if not same:
        raise ValueError(f"the checkpoint holds {len(saved)} tensors here, the job now {len(live)}")
    for k in (live if isinstance(live, dict) else range(len(live))):
        _copy_into(live[k], saved[k])


def state_of(obj):
    """The state a tracked object checkpoints (the inner module's, under DDP)."""
    obj = distributed.unwrap(obj)
    if tensors_only(obj):
        return obj  # the snapshot copies the tensors
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    return obj.state_dict()


def _load_into(obj, state, frozen_keys: Set[str] = frozenset()) -> None:
    """Load a tracked object's saved state; a module's `frozen_keys` were left out of it (frozen.py)."""
    obj = distributed.unwrap(obj)
    if tensors_only(obj):
        _copy_into(obj, state)
    elif isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    elif isinstance(obj, torch.nn.Module):
        frozen.load_module(obj, state, frozen_keys)
    else:
        obj.load_state_dict(state)


def _match_module_prefix(saved: dict, live: dict) -> dict:
    """Add or strip the `module.` prefix nn.DataParallel / DDP put on every key, to match `live`."""
    p = "module."
    saved_wrapped = bool(saved) and all(k.startswith(p) for k in saved)
    live_wrapped = bool(live) and all(k.startswith(p) for k in live)
    if saved_wrapped and not live_wrapped:
        return {k[len(p):]: v for k, v in saved.items()}
    if live_wrapped and not saved_wrapped:
        return {p + k: v for k, v in saved.items()}
    return saved


@dataclass(frozen=True)
class Where:
    """Where checkpoints are written and looked for."""

    checkpoints: Path  # <working>/kchain/checkpoints: this session's
    input_root: Path  # /kaggle/input: an attached state dataset holds the last session's
    scratch: Path  # where an attached archive is unpacked
    working: Path  # checkpoints are named relative to it in the summary
    state_slug: str | None  # the job's state dataset, as mounted (None in a local run)
    sink: Path | None = None  # KCHAIN_STATE_SINK: a bucket folder each complete checkpoint is published to
    sink_only: bool = False  # several nodes: resume from the sink alone, the one path every node reads
    requeued: bool = False  # a requeued run: an empty sink means the state was lost, not a first run


@dataclass(frozen=True)
class Policy:
    """How this job checkpoints (Settings, in the checkpointer's terms)."""

    job: str
    every: dict  # {'steps': n} or {'seconds': s}
    keep: int  # complete checkpoints kept
    stream: str | None  # KCHAIN_CHECKPOINT_STREAM: '1' stream, '0' copy, None by size
    manifest: dict  # what every manifest says besides step, time and session (fingerprint, params, ...)
    checkpoint_frozen: bool = False  # the frozen base is saved too (else left out: frozen.py)
    plan: SessionPlan | None = None  # a rehearsal's plan: its mid-span saves replace the cadence
    keep_best: keepbest.Choice | None = keepbest.Choice()  # train.keep_best; None: off


class Checkpointer:
    """The tracked objects and their checkpoints: track, due, save, restore."""

    def __init__(self, where: Where, policy: Policy, ranks: distributed.Ranks, faults: Faults, rung: ladder.Rung):
        self.where, self.policy, self.ranks = where, policy, ranks
        self.rung = rung  # the out-of-memory ladder's: every manifest says how many halvings it trained with
        self.frozen = FrozenBase(enabled=not policy.checkpoint_frozen)  # what a fine-tune's checkpoint leaves out
        self.best = keepbest.KeepBest(policy.keep_best)  # the best checkpoint so far, spared by pruning
        self.tracked: dict[str, object] = {}  # name -> object with state_dict/load_state_dict (or a generator)
        self._differ: set[str] = set()  # tracked objects found to differ between ranks: saved per rank from then on
        self._own_buffers: set[str] = set()  # tracked modules whose buffers differ between ranks (BatchNorm under
        # DDP without SyncBatchNorm): their buffers saved per rank from then on, the parameters once
        self.covered: dict[str, object] = {}  # what a framework's own checkpoint holds (the Trainer's model): cover()
        self.excluded: list[tuple[object, str]] = []  # (object, reason): left out on purpose (run.untrack)
        # A smoke or a rehearsal: the untracked state's digests, added to each checkpoint's (untracked.py)
        self.audit: Callable[[], dict[str, str]] | None = None
        self.writer = Writer(faults)
        self.writer.die = ranks.kill_all  # kchain ddp: a kill fault ends every rank at once
        # rank 0 publishes each complete checkpoint to the state sink (a bucket), in the background
        self.sink = sink.Sink(where.sink, policy.keep, policy.job, faults, ranks.kill_all) \
            if where.sink is not None and ranks.is_main else None
        self.writer.on_written = self.sink.publish if self.sink is not None else None
        if where.sink_only and where.sink is None and ranks.is_main:
            warn(f"the ranks span several machines and {layout.STATE_SINK_ENV} is not set: a resume needs the "
                 "checkpoints at one path every node reads (a mounted bucket folder)")
        self._lost: str | None = None  # the resume guard's reason to stop (sink.behind_pointer), set by find()
        self.stalls: list[float] = []  # seconds the training thread spent blocked in each save
        self.last_save = time.time()
        self.restored = False
        self._snapshots = Snapshotter()
        self._attached: dict[str, Path] = {}  # group -> a framework's folder the next checkpoint holds (attach)
        self._plan: dict | None = None  # the checkpoint's size and write mode, set at the first save
        self._found: tuple[list[tuple[Path, dict]], list[str]] | None = None  # find(), once
        self._loaded: dict | None = None  # rank 0: the state find() loaded with it, until restore()
        self.resumed: tuple[Path, dict] | None = None  # the checkpoint restored from
        # Parts that add to every checkpoint, asked by rank 0 at each save: each returns its manifest
        # entries and the folders to attach, by group (the run id, the TensorBoard log: run.py).
        self.additions: list[Callable[[], tuple[dict, dict[str, Path]]]] = []
        if ranks.is_main:  # kchain ddp: rank 0 alone owns the files
            clean_tmp(where.checkpoints)
        hash_early(where.checkpoints, where.input_root, where.state_slug)  # overlaps the user's set-up

    # --- what a checkpoint holds ---------------------------------------------------------------

    def track(self, name: str, obj) -> None:
        """Register `obj` under `name` (see Run.track for the rules)."""
        ok = hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
        if not (ok or isinstance(obj, (torch.Generator, np.random.Generator)) or tensors_only(obj)):
            raise TypeError(
                f"run.track({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict; "
                "track modules, optimizers, schedulers, GradScalers, generators, or tensors (alone or in a "
                "list or dict)"
            )
        if self.restored:
            # A resumed run would silently differ from the uninterrupted one: stop here instead.
            raise RuntimeError(
                f"run.track({name}=...) after run.steps started: the checkpoint is restored when "
                "run.steps starts, so build and track everything (run.loader, run.optimize too) before the loop"
            )
        if any(o is obj for o in self.tracked.values()):
            return
        if any(o is obj for o, _ in self.excluded):
            raise ValueError(f"run.track({name}=...): this {type(obj).__name__} was excluded with run.untrack; "
                             "an object is tracked or excluded, not both")
        if name in self.tracked:
            raise ValueError(
                f"run.track({name}=...): the name {name!r} already tracks a {type(self.tracked[name]).__name__}; "
                "give each object its own name (e.g. run.optimize(opt, name='disc_opt'))"
            )
        self.tracked[name] = obj

    def cover(self, name: str, obj) -> None:
        """`obj`'s state is saved by a framework's own checkpoint, which this one holds (hf.py, lightning.py):
        not untracked state (untracked.py); its frozen base is fingerprinted under `name` like a tracked
        model's (frozen.py), so a resume onto another base stops there too."""
        if obj is not None:
            self.covered[name] = obj

    def exclude(self, obj, reason: str) -> None:
        """`obj` is left out of every checkpoint on purpose (run.untrack): not refused as forgotten state, not
        compared by the verdict, which lists it with `reason`."""
        if any(o is obj for o in self.tracked.values()):
            name = next(n for n, o in self.tracked.items() if o is obj)
            raise ValueError(f"run.untrack(...): this {type(obj).__name__} is tracked as {name!r}; "
                             "an object is tracked or excluded, not both")
        if not any(o is obj for o, _ in self.excluded):
            self.excluded.append((obj, reason))

    def fingerprinted(self) -> dict:
        """The modules whose frozen parameters the manifest records: the tracked ones and the covered ones."""
        return {**self.covered, **self.tracked}

    def free_name(self, base: str) -> str:
        """base, base2, base3, ...: the first not tracked yet (stable while the code is the same)."""
        n = 1
        while (name := base if n == 1 else f"{base}{n}") in self.tracked:
            n += 1
        return name

    def states(self) -> dict:
        """What a checkpoint holds of each tracked object: its state, without its frozen parameters."""
        return {name: self.frozen.without(name, state_of(obj)) for name, obj in self.tracked.items()}

    # --- when -------------------------------------------------------------------------------------

    def due(self, step: int, total: int | None = None) -> bool:
        """The cadence says save after `step` (a rehearsal's plan, when the loop has a total)."""
        if self.policy.plan is not None and total:  # the plan's saves, beside a cadence in steps (sessionplan.py)
            return self.policy.plan.saves_at(step, total) or (
                "steps" in self.policy.every and step % int(self.policy.every["steps"]) == 0)
        if "steps" in self.policy.every:
            return step % int(self.policy.every["steps"]) == 0
        return time.time() - self.last_save >= float(self.policy.every["seconds"])

    def next_in(self, step: int, total: int | None = None) -> str:
        """How far the next save is, for the heartbeat."""
        if self.policy.plan is not None and total:
            ends = self.policy.plan.ends(total)  # a planned stop saves too
            after = next((s for s in range(step + 1, total) if self.due(s, total) or s in ends), total)
            return f"{after - step} steps"
        if "steps" in self.policy.every:
            n = int(self.policy.every["steps"])
            return f"{n - step % n} steps"
        return heartbeat.duration(float(self.policy.every["seconds"]) - (time.time() - self.last_save))

    def save_s(self) -> float:
        """What the deadline guard plans a save with: the longest stall plus the last write."""
        return max(self.stalls, default=0.0) + self.writer.last_write_s

    # --- find and restore ---------------------------------------------------------------------------

    def find(self) -> tuple[list[tuple[Path, dict]], list[str]]:
        """The checkpoint to resume from (a list of one, or none) and the damaged ones: looked for once.

        The one found is verified and loaded in the same pass over its state.pt (find_and_load); its
        state waits in self._loaded for restore().
        """
        if self._found is None:
            w = self.where
            hit, damaged = find_and_load(w.checkpoints, w.input_root, w.scratch, self.policy.job,
                                         state_slug=w.state_slug, sink=sink.candidates(w.sink) if w.sink else None,
                                         sink_only=w.sink_only and w.sink is not None)
            self._loaded = hit[2] if hit else None
            self._found = ([(hit[0], hit[1])] if hit else [], damaged)
            if w.sink is not None:
                self._lost = sink.behind_pointer(w.sink, int(hit[1]["step"]) if hit else None, damaged, w.requeued)
        return self._found

    def chain_manifest(self) -> dict | None:
        """The newest checkpoint's manifest of this job, read without verifying anything or unpacking
        an archive: for what every checkpoint of a chain says alike (its run id), before the restore."""
        w = self.where
        paths = [] if w.sink_only else newest_first(w.checkpoints, w.input_root, None, w.state_slug)
        for path in [*paths, *(sink.candidates(w.sink) if w.sink else [])]:
            try:
                manifest = read_manifest(path)
            except CheckpointInvalid:
                continue
            if not self.policy.job or manifest.get("job") in (None, self.policy.job):
                return manifest
        return None

    def restore(self, progress: Progress, trace: Trace, params: dict) -> Path | None:
        """Load the newest checkpoint into everything tracked (once); the checkpoint, or None fresh."""
        if self.restored:
            return None
        self.restored = True
        found = self._load_found(progress, trace)
        if found is None:
            say(f"session 1 of {self.policy.job}: no checkpoint found, starting fresh")
            self.frozen.mark(self.fingerprinted())
            return None
        path, manifest, saved = found
        distributed.check_world_size(path, manifest, self.ranks.world_size)
        left_out = manifest.get(FROZEN_KEY) or {}
        self.frozen.check_shapes(path, left_out, self.fingerprinted())  # never a resume onto another base (bytes: later)
        if self.ranks.active:  # kchain ddp: this rank's own RNGs, loader positions and module buffers
            mine = saved["ranks"][self.ranks.rank]
            saved["rng"] = mine["rng"]
            saved["tracked"] = {**saved["tracked"], **mine["tracked"]}
            for name, buffers in (mine.get(BUFFERS_KEY) or {}).items():
                if isinstance(saved["tracked"].get(name), dict):
                    saved["tracked"][name] = {**saved["tracked"][name], **buffers}
        self._apply(path, manifest, saved["tracked"], params, left_out)
        self.frozen.mark(self.fingerprinted(), path, left_out)
        restore_rng(saved["rng"])
        progress.step = progress.saved_step = progress.resumed_from = int(saved["step"])
        trace.restore(saved.get("metrics"), saved.get("best"))
        self._keep_best(path, manifest)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(manifest.get("time", 0))))
        say(f"resumed from step {progress.step} ({path}, saved at {when})")
        return path

    def _keep_best(self, path: Path, manifest: dict) -> None:
        """A resume: the kept best as the checkpoint records it, brought into this session's checkpoints."""
        self.best.restore(manifest.get(BEST_KEY))
        if self.best.record is None or not self.ranks.is_main:
            return
        brought = bring_best(path, manifest, self.where.checkpoints)
        if brought:
            say(brought)
        if not (self.where.checkpoints / layout.checkpoint_name(int(self.best.record["step"]))).is_dir():
            self.best.record = None  # not found (bring_best said why): the best starts over

    def _load_found(self, progress: Progress, trace: Trace) -> tuple[Path, dict, dict] | None:
        """The checkpoint to resume from with its state, adopted: its session number and its trace.

        kchain ddp: rank 0 finds, verifies and loads (and sets damaged ones aside); the other ranks
        learn what it found and load that file.
        """
        mine = (*self.find(), self._lost) if self.ranks.is_main else None
        found, damaged, lost = self.ranks.all_gather(mine)[0]
        if lost:
            self._loaded = None
            raise sink.StateLost(lost)  # the sink says newer state existed: never train from older state
        if not found:
            if damaged:
                # Starting over would silently redo (and overwrite) the chain's work: stop and say why.
                raise CheckpointsDamaged(
                    f"every checkpoint found is damaged: {'; '.join(damaged)}. Attach an earlier "
                    "state version, or detach the state dataset to start fresh on purpose"
                )
            return None
        path, manifest = found[0]
        saved = self._loaded if self.ranks.is_main else load_state(path)
        assert saved is not None  # rank 0's find() loaded the state of the checkpoint it found
        self._loaded = None  # the live objects hold it from here on
        self.resumed = (path, manifest)
        if self.sink is not None and path.parent == self.where.checkpoints:
            pointer = sink.read_pointer(self.sink.folder)
            if pointer is None or int(pointer["step"]) < int(manifest["step"]):
                self.sink.publish(path)  # a local checkpoint the bucket never got (killed before its publish)
        progress.session = int(manifest.get("session", 0)) + 1
        # One continuous history: the trace as it was at the checkpoint (later lines are replayed),
        # then whatever this process logged before its loop started.
        logged = trace.logged()
        trace.adopt((path / layout.METRICS).read_bytes() if trace.writes else b"", logged)
        say(f"session {progress.session} of {self.policy.job}: resuming from {path}")
        return path, manifest, saved

    def _apply(self, path: Path, manifest: dict, saved: dict, params: dict, left_out: dict) -> None:
        """Load the saved tracked states into the live objects, after checking that they fit."""
        for name, obj in self.tracked.items():
            live = distributed.unwrap(obj)  # DDP: checkpoints hold the inner module's keys
            if isinstance(live, torch.nn.Module) and isinstance(saved.get(name), dict):
                saved[name] = _match_module_prefix(saved[name], live.state_dict())
        check_compatible(path, manifest, saved, self.states(), params)
        for name, obj in self.tracked.items():
            if name in saved:
                _load_into(obj, saved[name], set(left_out.get(name, ())))
            else:
                warn(f"{name!r} is tracked now but not in the checkpoint: it starts fresh, the run is not exact")
        for name in saved:
            if name not in self.tracked:
                warn(f"the checkpoint holds {name!r} but nothing is tracked under that name now: ignored")

    # --- save -----------------------------------------------------------------------------------------

    def save(self, progress: Progress, trace: Trace, check_replicas: Callable[[str], None] | None = None) -> float:
        """Checkpoint everything tracked at progress.step; the seconds the training thread was blocked.

        The snapshot blocks; the write runs in the background (one in flight at most, which bounds
        memory to one extra copy). kchain ddp: `check_replicas` first, so a checkpoint never holds one
        rank's model among several that differ."""
        t0 = time.perf_counter()
        self.writer.wait()
        if self.ranks.active and check_replicas is not None:
            check_replicas(f"at the checkpoint of step {progress.step}")
        # kchain ddp: every rank's own RNGs and loader positions go to rank 0, which writes alone.
        per_rank = self.ranks.gather(self._rank_state()) if self.ranks.active else None
        stall = 0.0
        if self.ranks.is_main:
            self._write(progress, trace, per_rank)
            stall = time.perf_counter() - t0
            self.stalls.append(stall)
        progress.saved_step = progress.step
        self.last_save = time.time()
        return stall

    def _write(self, progress: Progress, trace: Trace, per_rank: list | None) -> None:
        """Rank 0's part of a save: room on the disk, then the state to the writer."""
        live = {
            "step": progress.step,
            "tracked": self.states(),
            "rng": rng_state(),
            "metrics": trace.metrics,
            "best": trace.best,
            **({"ranks": per_rank} if per_rank else {}),
        }
        added: dict = {}
        for add in self.additions:
            fields, folders = add()
            added.update(fields)
            for group, folder in folders.items():
                self.attach(group, folder)
        if self._plan is None:
            # A framework's files (attach) are on the disk already; its next checkpoint needs as much room.
            self._plan = self._plan_checkpoints(live, sum(dir_bytes(f) for f in self._attached.values()))
        pruned = make_room(self.where.checkpoints, self._plan["bytes"])
        if pruned:
            say(pruned)
        trace.flush()
        manifest = {"job": self.policy.job, "step": progress.step, "time": time.time(), "session": progress.session,
                    "total": progress.total,  # the loop's: a state folder's newest at its total is the final one
                    **self.policy.manifest, **added, ladder.MANIFEST_KEY: self.rung.halvings,
                    MODULES_KEY: [n for n, o in self.tracked.items() if isinstance(distributed.unwrap(o), torch.nn.Module)]}
        left_out = self.frozen.record()
        if left_out:
            manifest[FROZEN_KEY] = left_out
        best = self.best.at_save(progress.step, trace)
        if best is not None:
            manifest[BEST_KEY] = best
        held, self._attached = self._attached, {}
        names = {group: attached_names(group, folder) for group, folder in held.items()}
        if names:
            manifest[ATTACHED_KEY] = names
        job = CheckpointJob(checkpoints=self.where.checkpoints, step=progress.step, metrics_src=trace.path,
                            metrics_bytes=trace.bytes, manifest=manifest, keep=self.policy.keep,
                            attached=tuple((flat, held[group] / rel) for group, files in names.items()
                                           for flat, rel in files.items()),
                            attached_dirs=tuple(held.values()),
                            digests=self.audit() if self.audit is not None else {})
        if self._plan["stream"]:
            self.writer.write_now(live, job)  # blocks; no host copy of the state
            return
        # A state too large to keep a host copy of: the writer holds the only reference, freed when written.
        state = self._snapshots.take(live, keep=self._plan["reuse"])
        del live
        self.writer.submit(state, job)

    def _rank_state(self) -> dict:
        """What differs between ranks (kchain ddp): the global RNGs and the per-rank tracked objects:
        PER_RANK ones, and any other whose state differs between the ranks (found at each save), and the
        buffers of each tracked module whose buffers differ (BatchNorm without SyncBatchNorm)."""
        objects, buffers = self._differing()
        self._differ.update(objects)
        self._own_buffers.update(buffers)
        private = {n: state_of(o) for n, o in self.tracked.items() if per_rank(o) or n in self._differ}
        own = {n: _buffers(self.tracked[n]) for n in sorted(self._own_buffers)}
        return {"rank": self.ranks.rank, "rng": rng_state(), "tracked": private, **({BUFFERS_KEY: own} if own else {})}

    def _differing(self) -> tuple[set[str], set[str]]:
        """What differs between the ranks, in one gather of one digest each (kchain ddp): the tracked objects
        of the user's own (not a model, an optimizer, a scheduler or a scaler, which DDP keeps equal), and the
        tracked modules' buffers (DDP keeps the parameters equal, not always the buffers: BatchNorm's running
        statistics without SyncBatchNorm, or with broadcast_buffers=False). Each found is saved per rank from
        then on, and a resume gives each rank its own back."""
        mine: dict[str, str] = {}
        for n, o in self.tracked.items():
            if per_rank(o) or n in self._differ:
                continue
            if not isinstance(distributed.unwrap(o), REPLICATED):
                mine[f"state:{n}"] = "".join(digest_state({"s": state_of(o)}).values())
            elif isinstance(distributed.unwrap(o), torch.nn.Module) and n not in self._own_buffers and (b := _buffers(o)):
                mine[f"buffers:{n}"] = "".join(untracked_digest(b).values())
        if not mine:  # the same on every rank: the tracked objects and what was found are the same
            return set(), set()
        every = self.ranks.all_gather(mine)
        differ = [k.split(":", 1) for k in mine if len({d.get(k) for d in every}) > 1]
        return {n for kind, n in differ if kind == "state"}, {n for kind, n in differ if kind == "buffers"}

    def _plan_checkpoints(self, live: dict, attached: int = 0) -> dict:
        """At the first save: the checkpoint's size against the disk and RAM, said in one line.

        A state that fits a quarter of the free RAM is copied to host memory and written in the
        background (training goes on); a larger one is streamed to the file from the live tensors,
        blocking, so no second full copy ever exists. KCHAIN_CHECKPOINT_STREAM=1/0 forces either.
        """
        from kchain.common.publishplan import state_bytes

        state = state_bytes(live)  # what is copied to RAM or streamed; the attached files are on disk
        size = state + attached
        checkpoints = self.where.checkpoints
        checkpoints.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(checkpoints).free
        ours = sum(dir_bytes(p) for p in complete(checkpoints)) + attached
        ram = available_ram()
        forced = self.policy.stream
        if forced in ("0", "1"):
            stream, why = forced == "1", f"{layout.CHECKPOINT_STREAM_ENV}={forced}"
        elif ram is not None and state > SNAPSHOT_RAM_FRACTION * ram:
            stream, why = True, f"more than {SNAPSHOT_RAM_FRACTION:.0%} of the {gb(ram)} of RAM available"
        else:
            stream, why = False, f"fits in RAM ({gb(ram) if ram is not None else 'unknown'} available)"
        mode = "streamed from the live tensors (blocks training)" if stream else "copied to RAM, written in the background"
        peak = (self.policy.keep + 1 + (self.best.choice is not None)) * size
        if 2 * size * WRITE_SLACK > free + ours:
            # The newest checkpoint stays until the next one is complete: two must fit at once.
            raise CheckpointTooLarge(
                f"checkpoint needs {gb(size)}, and two must fit while one is written ({gb(2 * size)}), but "
                f"{checkpoints} has {gb(free + ours)} for checkpoints: free disk space (delete files in "
                "/kaggle/working) or checkpoint less state (8-bit or bf16 optimizer moments)"
            )
        room = ("fits" if peak <= free + ours else
                "does not fit: older checkpoints are pruned before each write, the newest kept until the new one is complete")
        best = ""
        if self.best.choice is not None:
            # The whole checkpoint, optimizer included: one kind of checkpoint, verified like the others.
            best = (f" + the best by {self.best.choice.describe(live.get('best'))} kept whole (train.keep_best: "
                    f"up to {gb(size)} more per state version)")
        say(f"checkpoint plan: {gb(size)} per checkpoint, keep {self.policy.keep}{best} + 1 being written = "
            f"{gb(peak)} ({gb(free + ours)} available) {room}; {mode}: {why}")
        return {"bytes": size, "stream": stream, "reuse": state <= REUSE_MAX_BYTES}

    # --- a framework's own checkpoint files ------------------------------------------------------------

    def attach(self, group: str, folder: Path) -> None:
        """The next checkpoint also holds every file under `folder` (a framework's own checkpoint, e.g.
        the Hugging Face Trainer's checkpoint-N), moved in, not copied; rank 0's call (it writes).

        The folder is renamed at once to a `.tmp-` name beside the checkpoints, so neither the
        framework's own retention (save_total_limit) nor its next save can touch it while the writer
        moves and hashes its files, and a process killed before that leaves only what the next start
        removes. Each file gets a flat name and an entry (sha256, size) in the manifest's "files", so it
        is verified at the restore like state.pt (checkpoint_files.attached_names)."""
        here = self.where.checkpoints
        here.mkdir(parents=True, exist_ok=True)
        held = here / f"{layout.TMP_PREFIX}{group}-{folder.name}-{os.getpid()}"
        if held.exists():
            shutil.rmtree(held)
        try:
            os.replace(folder, held)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.move(folder, held)  # on another disk: copied once, here
        self._attached[group] = held

    def attached(self, group: str) -> dict[str, Path]:
        """The resumed checkpoint's files of `group`: {path inside the framework's folder: verified file}."""
        if self.resumed is None:
            return {}
        return attached_files(*self.resumed, group)

    def close(self) -> None:
        """No write left in flight, and every complete checkpoint published to the sink (if any)."""
        try:
            self.writer.wait()
        finally:
            if self.sink is not None:
                self.sink.flush()

    # --- where ----------------------------------------------------------------------------------------

    def newest(self) -> Path | None:
        """The newest complete checkpoint this session wrote, else the one it resumed from."""
        path = self.writer.last_path
        if path is None and self.resumed:
            path = self.resumed[0]
        return path

    def newest_rel(self) -> str | None:
        """The newest checkpoint, relative to the working dir (as the summary names it)."""
        path = self.newest()
        if path is None:
            return None
        try:
            return str(path.relative_to(self.where.working))
        except ValueError:
            return str(path)

    def halvings_found(self) -> int:
        """The out-of-memory ladder's rung of the checkpoint to resume from (0 without one)."""
        found, _ = self.find()
        return max([0] + [int(m.get(ladder.MANIFEST_KEY, 0)) for _, m in found[:1]])
