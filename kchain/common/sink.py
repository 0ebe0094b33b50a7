"""The state sink: each verified checkpoint published to a mounted bucket folder (`KCHAIN_STATE_SINK`).

Off Kaggle (a SkyPilot managed job, a Slurm job) the machine's disk goes with the machine; a bucket
stays. A working folder put on the bucket itself lost the chain's state (issue 26): uploads fell
behind the saves, the prunes reached the bucket and the new checkpoints did not, and the next run
started fresh. So checkpoints stay on the local disk exactly as on Kaggle, and each complete one is
then published here, in a background thread:

    <sink>/step-00000120/   state.pt, metrics.jsonl (plain writes, each read once, hashed against the
                            local manifest on the way), then manifest.json (last: the copy is complete)
    <sink>/latest           {"checkpoint": "step-00000120", "step": 120, ...}, written atomically
                            once the copy is complete; older copies are pruned only after it moved

Plain writes, not a temporary name and a rename: on a bucket mount a rename is a copy and a delete.
A copy without its manifest is never a candidate; one with it is verified like any checkpoint when
it is loaded. When publishing falls behind (a slow bucket), a newer checkpoint replaces the one
still queued: only the newest matters. `flush()` (at close, after a SIGTERM stop's save) waits
for the publish in flight and the queued one.

The pointer is also the resume guard: when it names a step and no checkpoint at or after it
verifies (here or locally), the run stops with `StateLost` instead of starting fresh.

Standard library only: the restore looks here before torch loads anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kchain.common import atomic, layout
from kchain.common.checkpoint_files import HASH_CHUNK, CheckpointInvalid, complete, kept_best, read_manifest
from kchain.common.faults import NO_FAULTS, Faults
from kchain.common.say import say, warn

POINTER = "latest"  # <sink>/latest: the newest checkpoint published whole
# <sink>/published-00000120: a small mark written with each pointer and kept while its copy may matter: a
# `latest` deleted with the newest copy still leaves the mark, and the guard still sees that step was published.
MARK_PREFIX = "published-"


class StateLost(Exception):
    """The sink's pointer names a checkpoint, and none at or after it verifies: never start fresh."""


def step_of(ckpt: Path) -> int:
    """The step a step-* folder is named for."""
    return int(ckpt.name.removeprefix(layout.CHECKPOINT_PREFIX))


def read_pointer(folder: Path) -> dict | None:
    """What the sink says was published last: its `latest` pointer or its newest mark, the higher step (a
    pointer deleted with the newest copy leaves the mark); None when nothing was ever published."""
    pointer, mark = _read_latest(folder), _newest_mark(folder)
    if mark is not None and (pointer is None or int(mark["step"]) > int(pointer["step"])):
        return mark
    return pointer


def _newest_mark(folder: Path) -> dict | None:
    marks = sorted(folder.glob(f"{MARK_PREFIX}*")) if folder.is_dir() else []
    for mark in reversed(marks):
        number = mark.name.removeprefix(MARK_PREFIX)
        if number.isdigit():
            return {"checkpoint": layout.checkpoint_name(int(number)), "step": int(number), "mark": mark.name}
    return None


def _read_latest(folder: Path) -> dict | None:
    """The sink's `latest` pointer, or None when there is none; an unreadable one says step 0."""
    path = folder / POINTER
    try:
        pointer = json.loads(path.read_text())
        int(pointer["step"])
        return pointer
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        warn(f"state sink: {path} is unreadable ({e}); treating it as a published checkpoint")
        return {"checkpoint": None, "step": 0}


def candidates(folder: Path) -> list[Path]:
    """The copies in the sink that were published whole (their manifest is there), newest first."""
    return [d for d in reversed(complete(folder)) if (d / layout.MANIFEST).is_file()]


def unmounted(folder: str, parent: str) -> str:
    """Why a run whose sink's folder is missing stops: the runtime's guard and the engines' run scripts
    (targets/workfolder.py, with shell variables for the paths) say the same."""
    return (f"the state sink {folder} cannot be there: {parent} does not exist (a bucket that is not "
            f"mounted, or a wrong name or path); stopping instead of training from nothing: fix the mount or "
            f"{layout.STATE_SINK_ENV}'s folder")


def behind_pointer(folder: Path, found_step: int | None, damaged: list[str], requeued: bool = False) -> str | None:
    """The resume guard: why the run must stop, or None (no pointer, or a checkpoint at or after it). A sink
    whose mount is missing, and an empty sink under a requeued run, are lost state too: never start fresh."""
    if not folder.parent.is_dir():
        return unmounted(str(folder), str(folder.parent))
    pointer = read_pointer(folder)
    if pointer is None and requeued and found_step is None:
        return (f"this run was requeued ({layout.RESTART_COUNT_ENV} > 0) and the state sink {folder} holds no "
                "published checkpoint: its state was lost (an emptied or different bucket). Stopping instead of "
                f"starting fresh; to start over on purpose, set {layout.START_OVER_ENV}=1")
    if pointer is None or (found_step is not None and found_step >= int(pointer["step"])):
        return None
    what = f"{pointer.get('checkpoint') or 'a checkpoint'} (step {pointer['step']})"
    found = f"the newest that verifies is step {found_step}" if found_step is not None else "none verifies"
    why = f" ({'; '.join(damaged)})" if damaged else ""
    return (f"the state sink {folder} says {what} was published, but no checkpoint at or after it verifies "
            f"here or in the sink: {found}{why}. Stopping instead of training from older state: put the "
            f"bucket's copy back, or empty {folder} (or unset {layout.STATE_SINK_ENV}) to start over on purpose")


def _copy_verified(src: Path, dst: Path, want: dict) -> None:
    """src to dst with plain writes, every byte hashed once on the way; CheckpointInvalid if it differs
    from the local manifest (the local copy went bad after it was written: it is not published)."""
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(HASH_CHUNK):
            h.update(block)
            fout.write(block)
            size += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    if h.hexdigest() != want["sha256"] or size != want["size"]:
        raise CheckpointInvalid(f"{src}: does not match its manifest; not published")


def _fsync_folder(folder: Path) -> None:
    """Best effort: a FUSE bucket mount may refuse to fsync a folder (its entries are objects anyway)."""
    try:
        atomic.fsync_path(folder)
    except OSError:
        pass


def _write_pointer(folder: Path, pointer: dict) -> None:
    """`latest`, atomically: a temporary name in the same folder, fsynced, renamed over the old one
    (atomic.write_bytes, less its folder fsync, which a bucket mount may refuse)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{layout.TMP_PREFIX}{POINTER}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), atomic.usual_mode())
            json.dump(pointer, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / POINTER)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(folder)


class Sink:
    """Publishes complete local checkpoints to a bucket folder, one at a time, newest only."""

    def __init__(self, folder: Path, keep: int, job: str, faults: Faults = NO_FAULTS,
                 kill_all: Callable[[], None] | None = None):
        self.folder, self.keep, self.job = folder, max(1, keep), job
        self.faults, self.kill_all = faults, kill_all  # sink_kill ends every rank (kchain ddp)
        self._cond = threading.Condition()
        self._pending: Path | None = None  # the one checkpoint waiting; a newer one replaces it
        self._busy = False
        self._thread: threading.Thread | None = None
        self.published: list[str] = []  # names of the checkpoints this process published
        self.replaced: list[str] = []  # names replaced while queued (publishing fell behind)

    def publish(self, ckpt: Path) -> None:
        """Queue a complete local checkpoint (the writer's hook); returns at once."""
        with self._cond:
            if self._pending is not None:
                self.replaced.append(self._pending.name)
                say(f"state sink behind: {ckpt.name} replaces {self._pending.name}, which was not published yet")
            self._pending = ckpt
            self._cond.notify_all()
            if self._thread is None:
                # daemon: an idle sink must not keep the process alive; flush() covers a busy one.
                self._thread = threading.Thread(target=self._loop, name="kchain-sink", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Wait until the publish in flight and the queued one are done."""
        with self._cond:
            while self._pending is not None or self._busy:
                self._cond.wait()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                ckpt, self._pending, self._busy = self._pending, None, True
            try:
                self._publish(ckpt)
            except FileNotFoundError:
                warn(f"state sink: {ckpt.name} was pruned locally before it was published; the next one will be")
            except Exception as e:  # a bucket's error: said, and the next checkpoint is tried (a dead thread would hang flush)
                warn(f"state sink: {ckpt.name} not published to {self.folder}: {type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _publish(self, ckpt: Path) -> None:
        """The files (plain writes), the manifest last, the pointer (atomic), then the prune."""
        if self.faults.sink_stall:
            time.sleep(self.faults.sink_stall)
        self.faults.in_sink("after_local", self.kill_all)
        manifest = read_manifest(ckpt)  # ours, every file there at its size; the bytes are hashed below
        dest = self.folder / ckpt.name
        if dest.exists():
            shutil.rmtree(dest)  # a half copy of this step, or one of an older timeline
        dest.mkdir(parents=True)
        try:
            for i, (name, want) in enumerate(manifest["files"].items()):
                _copy_verified(ckpt / name, dest / name, want)
                if i == 0:
                    self.faults.in_sink("mid_files", self.kill_all)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        self.faults.in_sink("before_manifest", self.kill_all)
        _fsync_folder(dest)
        data = (ckpt / layout.MANIFEST).read_bytes()
        with open(dest / layout.MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.faults.in_sink("before_pointer", self.kill_all)
        _write_pointer(self.folder, {"checkpoint": ckpt.name, "step": int(manifest["step"]), "job": self.job,
                                     "manifest_sha256": hashlib.sha256(data).hexdigest(), "time": time.time()})
        (self.folder / f"{MARK_PREFIX}{int(manifest['step']):08d}").write_bytes(b"")  # the pointer's trace
        self.faults.in_sink("before_prune", self.kill_all)
        self._prune(step_of(ckpt))
        self.published.append(ckpt.name)
        say(f"state sink: published {ckpt.name} to {self.folder}")

    def _prune(self, newest: int) -> None:
        """After the pointer moved to `newest`: keep the newest `keep` whole copies up to it, and the kept
        best the newest records (train.keep_best) if the bucket has its copy; remove half copies and
        copies past it (an older timeline's: the run resumed from before them)."""
        whole = [d for d in complete(self.folder) if (d / layout.MANIFEST).is_file() and step_of(d) <= newest]
        kept = {d.name for d in [*whole[-self.keep:], *filter(None, [kept_best(whole)])]}
        for d in complete(self.folder):
            if d.name not in kept:
                shutil.rmtree(d, ignore_errors=True)
        for tmp in self.folder.glob(f"{layout.TMP_PREFIX}{POINTER}.*"):  # a pointer write a kill cut short
            tmp.unlink(missing_ok=True)
        oldest = min((step_of(self.folder / name) for name in kept), default=newest)
        for mark in self.folder.glob(f"{MARK_PREFIX}*"):  # marks of copies gone, or of an older timeline's
            number = mark.name.removeprefix(MARK_PREFIX)
            if number.isdigit() and not oldest <= int(number) <= newest:
                mark.unlink(missing_ok=True)
