"""Checkpoints with torch: write the state in the background, load it back verified, check it fits.

A checkpoint is a directory `checkpoints/step-00000120/` holding state.pt, a copy of the metrics
trace, the files a framework wrote for that step if any (moved in, never copied: the Hugging Face
Trainer's checkpoint folder), and manifest.json (written last) with the sha256 and size of every file. It is written under
a `.tmp-` name, every file fsynced, then renamed into place and the parent directory fsynced, so a
process killed at any point leaves either the complete checkpoint or a `.tmp-` directory that the
next start ignores. Older checkpoints are pruned only after the newer one is in place.

What needs no torch (the manifest, checksums, pruning, the search) is in checkpoint_files.py; the
host copy a background write starts from is in snapshot.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kchain.common import layout
from kchain.common.atomic import fsync_path
from kchain.common.checkpoint_files import (
    CheckpointInvalid,
    ResumeError,
    check_sha256,
    early_digest,
    newest_first,
    other_job,
    prune,
    read_manifest,
    set_aside,
    sha256_of,
)
from kchain.common.faults import NO_FAULTS, Faults, die
from kchain.common.publishplan import (
    state_bytes,  # the checkpoint size estimate, one for the runtime and the publish
)
from kchain.common.say import gb, warn
from kchain.runtime.checkpoint.statedigest import digest_state

# Blocks torch.save writes from this size up are hashed in a second thread while they go to the
# file; smaller ones (zip headers, the pickle) cost less to hash than to hand over.
OVERLAP_BYTES = 64 << 10
SYNC_EVERY = 8 << 20  # bytes of state.pt between background syncs while it is written
COMPARED_FILES = (".safetensors", ".pt", ".pth")  # a framework's files whose bytes two exact runs share


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (disk full, file too large); the previous one stays in use."""


@dataclass(frozen=True)
class CheckpointJob:
    """Where and what one save writes, besides the state itself: built by the Run, read by the writer."""

    checkpoints: Path  # the folder of step-* checkpoints (the working dir's, on Kaggle)
    step: int  # the step the state is at: the directory's name and the manifest's "step"
    metrics_src: Path  # the live metrics trace, copied into the checkpoint up to metrics_bytes
    metrics_bytes: int  # the trace's length at this step (later lines belong to the next steps)
    manifest: dict  # what the checkpoint says about itself; the file list and format are added
    keep: int  # how many complete checkpoints stay after this one is in place
    # (name in the checkpoint, a file on the same disk): moved in and hashed, e.g. the HF Trainer's files
    attached: tuple[tuple[str, Path], ...] = ()
    attached_dirs: tuple[Path, ...] = ()  # the folders they came from, removed once they are moved
    # Digests of what the checkpoint does not hold, for the verdict (a smoke's or a rehearsal's untracked state)
    digests: dict[str, str] = field(default_factory=dict)


# --- writing ----------------------------------------------------------------------------------


class HashingFile:
    """The file torch.save writes state.pt to: every byte hashed once, as it is written.

    A large block is hashed in a second thread while the same block goes to the file (both release
    the GIL), so the checkpoint costs one pass over its bytes, not a write and then a read-back.
    Each block is hashed before write() returns, because torch may free or reuse it afterwards.
    torch.save never seeks a stream it writes (it has no seek() here to call), so the bytes hashed
    are the file's bytes, in order. Every SYNC_EVERY bytes the disk write starts in the background
    (fdatasync), so the final fsync waits for the last few blocks instead of the whole file.
    """

    def __init__(self, f, pool: ThreadPoolExecutor):
        self._f = f
        self._pool = pool  # at most two tasks at a time: one hashes, one syncs
        self._sync: Future[None] | None = None  # the background fdatasync in flight, if any
        self._synced_at = 0
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, block) -> int:
        view = memoryview(block)
        if view.nbytes < OVERLAP_BYTES:
            self.sha256.update(view)
            self._f.write(view)
        else:
            hashed = self._pool.submit(self.sha256.update, view)
            try:
                self._f.write(view)
            finally:
                hashed.result()
        self.size += view.nbytes
        if self.size - self._synced_at >= SYNC_EVERY and (self._sync is None or self._sync.done()):
            self._synced_at = self.size
            self._sync = self._pool.submit(os.fdatasync, self._f.fileno())
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> None:
        """Wait for the background sync (re-raising its OSError) and hand the last bytes to the OS."""
        if self._sync is not None:
            self._sync.result()
        self._f.flush()


def write_checkpoint(state: dict, job: CheckpointJob, faults: Faults = NO_FAULTS) -> Path:
    """Write one checkpoint atomically and prune old ones; returns the final directory."""
    job.checkpoints.mkdir(parents=True, exist_ok=True)
    final = job.checkpoints / layout.checkpoint_name(job.step)
    tmp = job.checkpoints / f"{layout.TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    try:
        return _write_into(tmp, final, state, job, faults)
    except (OSError, RuntimeError) as e:
        # torch's zip writer turns a failed write() of the file into a RuntimeError about stream
        # positions; the OSError that says why is its context.
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took is needed more than ever
        raise CheckpointWriteFailed(_write_failure(cause, job.checkpoints, state_bytes(state))) from e


def _write_failure(e: OSError, where: Path, need: int) -> str:
    """'checkpoint write failed: no space left on /kaggle/working (needs 12.1 GB, 3.2 GB free)'."""
    why = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "file too large (a file-size limit)"}.get(e.errno or 0, e.strerror or str(e))
    try:
        free = gb(shutil.disk_usage(where).free)
    except OSError:
        free = "unknown"
    return f"checkpoint write failed: {why} on {where} (needs {gb(need)}, {free} free); the previous checkpoint stays in use"


def _write_into(tmp: Path, final: Path, state: dict, job: CheckpointJob, faults: Faults) -> Path:
    with ThreadPoolExecutor(4, thread_name_prefix="kchain-write") as pool:  # helper threads for one write
        _write_files(tmp, state, job, faults, pool)
    faults.in_save("before_rename")

    if final.exists():
        # A stale directory of the same step (from before a resume further back): set it aside
        # first, since rename() will not replace a non-empty directory.
        stale = job.checkpoints / f"{layout.TMP_PREFIX}stale-{final.name}-{os.getpid()}"
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(job.checkpoints)
    faults.in_save("after_rename")

    prune(job.checkpoints, job.keep, faults)
    return final


def _write_files(tmp: Path, state: dict, job: CheckpointJob, faults: Faults, pool: ThreadPoolExecutor) -> None:
    """state.pt, the trace and manifest.json (last) into tmp, then every file and tmp itself fsynced."""
    # Every value's digest (statedigest.py), hashed from the same host copy while torch.save writes it.
    digests = pool.submit(digest_state, state)
    files = {layout.STATE_FILE: _write_state(tmp / layout.STATE_FILE, state, pool)}
    moved = _move_in(tmp, job.attached, pool)
    files.update(moved)
    # A framework's own files (the HF Trainer's model, optimizer, scheduler, RNGs) by their checksums; its
    # JSON and arguments files hold paths and times that differ between two runs of the same training.
    values = {**digests.result(), **{f"files.{name}": entry["sha256"][:32] for name, entry in moved.items()
                                     if name.endswith(COMPARED_FILES)}, **job.digests}
    text = json.dumps(values, indent=0, sort_keys=True).encode()
    (tmp / layout.DIGESTS).write_bytes(text)
    files[layout.DIGESTS] = {"sha256": hashlib.sha256(text).hexdigest(), "size": len(text)}
    for folder in job.attached_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    faults.in_save("after_state")

    # The trace up to this step only: the live file may already hold lines of the next step.
    with open(job.metrics_src, "rb") if job.metrics_src.exists() else open(os.devnull, "rb") as src:
        data = src.read(job.metrics_bytes)
    (tmp / layout.METRICS).write_bytes(data)
    files[layout.METRICS] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    faults.in_save("after_metrics")

    faults.in_save("before_manifest")
    body = {layout.MARKER: layout.FORMAT_VERSION, **job.manifest, "step": job.step, "files": files}
    (tmp / layout.MANIFEST).write_text(json.dumps(body, indent=2, default=str) + "\n")
    # Every fsync at once: the file system commits them together, one wait for the disk, not four.
    synced = [pool.submit(fsync_path, path) for path in (*(tmp / name for name in files), tmp / layout.MANIFEST, tmp)]
    for done in synced:
        done.result()


def _move_in(tmp: Path, attached: tuple[tuple[str, Path], ...], pool: ThreadPoolExecutor) -> dict:
    """The files a framework wrote, moved into tmp (a rename: their bytes are not copied) and hashed
    (read once, in parallel); their manifest entries. A file on another disk is copied, then removed."""
    for name, src in attached:
        try:
            os.replace(src, tmp / name)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.copyfile(src, tmp / name)
            os.unlink(src)
    digests = {name: pool.submit(sha256_of, tmp / name) for name, _ in attached}
    return {name: {"sha256": d.result(), "size": (tmp / name).stat().st_size} for name, d in digests.items()}


def _write_state(path: Path, state, pool: ThreadPoolExecutor) -> dict:
    """torch.save into path, hashed on the way; returns its manifest entry (sha256, size).

    A state of live tensors (streaming) goes out one tensor at a time: torch.save copies each CUDA
    storage to the host on its own, and writes CPU storages straight from their memory. The file's
    last blocks are made durable by the caller's fsync.
    """
    with open(path, "wb") as f:  # a Python file: a failed write is an OSError
        out = HashingFile(f, pool)
        torch.save(state, out)
        out.finish()
        size = os.fstat(f.fileno()).st_size
    if size != out.size:  # the file is not the bytes hashed: never record a wrong checksum
        raise RuntimeError(f"{path}: {size} bytes on disk but {out.size} written through the hash")
    return {"sha256": out.sha256.hexdigest(), "size": size}


class Writer:
    """Writes checkpoints in one long-lived background thread, one at a time.

    submit() waits for the previous write first, so at most one is in flight; wait() blocks until
    the writer is idle and re-raises whatever the write raised. The owner calls wait() before the
    process exits. The thread lives for the whole run: starting a thread per save would hand it the
    GIL at once and stall training for a switch interval.
    """

    def __init__(self, faults: Faults = NO_FAULTS):
        self.faults = faults  # kill_in_save ends the writer at a point; kill_after_checkpoint after the first
        self._jobs: queue.SimpleQueue[tuple[dict, CheckpointJob]] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.last_write_s = 0.0  # how long the last background write took (for the deadline)
        self.die: Callable[[], None] | None = None  # kchain ddp: how kill_after_checkpoint ends every rank
        self.on_written: Callable[[Path], None] | None = None  # each complete checkpoint (the state sink's queue)

    def submit(self, state: dict, job: CheckpointJob) -> None:
        self.wait()
        self._idle.clear()
        self._jobs.put((state, job))
        if self._thread is None:
            # daemon: an idle writer must not keep the process alive; wait() covers a busy one.
            self._thread = threading.Thread(target=self._loop, name="kchain-checkpoint", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()  # (state, job): the one reference to the snapshot
            t0 = time.perf_counter()
            try:
                self.last_path = write_checkpoint(*item, faults=self.faults)
                self.last_write_s = time.perf_counter() - t0
                self._written(self.last_path)
                if self.faults.kill_after_checkpoint:
                    (self.die or die)()
            except BaseException as e:  # re-raised in the training thread by wait()
                if isinstance(e, CheckpointWriteFailed):
                    warn(str(e))  # at once, not at the next save
                self._error = e
            finally:
                del item  # release the snapshot as soon as its write ends, not at the next one
                self._idle.set()

    def write_now(self, state: dict, job: CheckpointJob) -> None:
        """The same write in the calling thread (a streamed state: live tensors, no host copy)."""
        self.wait()
        t0 = time.perf_counter()
        try:
            self.last_path = write_checkpoint(state, job, faults=self.faults)
        except CheckpointWriteFailed as e:
            warn(str(e))
            raise
        self.last_write_s = time.perf_counter() - t0
        self._written(self.last_path)
        if self.faults.kill_after_checkpoint:
            (self.die or die)()

    def _written(self, path: Path) -> None:
        if self.on_written is not None:
            self.on_written(path)

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()


# --- loading ----------------------------------------------------------------------------------


def load_state(ckpt: Path) -> dict:
    # weights_only=False: the file is our own (RNG states hold numpy arrays and Python tuples).
    # mmap: the tensors stay in the page cache and are copied once, into the live objects.
    return torch.load(ckpt / layout.STATE_FILE, map_location="cpu", weights_only=False, mmap=True)


def load_verified(ckpt: Path, manifest: dict) -> dict:
    """ckpt's state, its bytes hashed as they are read; CheckpointInvalid if any sha256 differs.

    state.pt is read from the disk once: a second thread hashes it while torch.load maps the same
    file (its tensors are pages of the page cache, copied once, into the live objects later).
    Nothing is returned before every file matched the manifest; a state.pt that matches but does not
    load raises what torch.load raised.
    """
    files = manifest["files"]
    for name, want in files.items():
        if name != layout.STATE_FILE:
            check_sha256(ckpt / name, want)
    path = ckpt / layout.STATE_FILE
    with ThreadPoolExecutor(1, thread_name_prefix="kchain-verify") as pool:
        digest = early_digest(path) or pool.submit(sha256_of, path)
        try:
            state = load_state(ckpt)
        except Exception:
            check_sha256(path, files[layout.STATE_FILE], digest.result())  # damaged, rather than unloadable
            raise
        check_sha256(path, files[layout.STATE_FILE], digest.result())
    return state


def find_and_load(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                  state_slug: str | None = None, sink: list[Path] | None = None,
                  sink_only: bool = False) -> tuple[tuple[Path, dict, dict] | None, list[str]]:
    """((path, manifest, state) of the newest checkpoint that verifies and loads, or None; one line
    per damaged one). Each state.pt is read once (load_verified); older checkpoints are not read
    at all once one loads. One that verifies but does not load (e.g. written by another torch) is
    skipped like a damaged one. `sink`: the state sink's whole copies (sink.candidates), searched
    with the rest (at equal steps the local one first); `sink_only`: those alone (several nodes: the
    one path every node reads).
    """
    damaged: list[str] = []
    paths = [] if sink_only else newest_first(checkpoints, input_root, scratch, state_slug)
    if sink:
        paths = sorted([*paths, *sink], key=lambda p: (_claimed_step(p), p.parent == checkpoints), reverse=True)
    for path in paths:
        try:
            manifest = read_manifest(path)
            if other_job(path, manifest, job):
                continue
            return (path, manifest, load_verified(path, manifest)), damaged
        except CheckpointInvalid as e:
            set_aside(path, checkpoints, e, damaged)
        except Exception as e:  # verified but unloadable: the previous one
            warn(f"checkpoint {path} verifies but does not load ({type(e).__name__}: {e}); trying the previous one")
            damaged.append(f"{path / layout.STATE_FILE}: does not load ({type(e).__name__})")
    return None, damaged


def _claimed_step(path: Path) -> int:
    """The step a checkpoint's manifest claims (-1 if unreadable: it sorts last, and fails verification)."""
    try:
        return int(json.loads((path / layout.MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


# --- resuming into live objects ---------------------------------------------------------------


def _tensor_shapes(obj, prefix: str = "") -> dict[str, tuple]:
    """{dotted.key: shape} of every tensor in a nested state dict."""
    out: dict[str, tuple] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = tuple(obj.shape)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensor_shapes(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensor_shapes(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _param_changes(old: dict, new: dict) -> list[str]:
    """['d_model: 64 -> 128', ...] for every param that differs."""
    keys = sorted(set(old) | set(new), key=str)
    missing = "(unset)"
    return [
        f"{k}: {old.get(k, missing)!r} -> {new.get(k, missing)!r}".replace("'", "")
        for k in keys
        if old.get(k, missing) != new.get(k, missing)
    ]


def check_compatible(ckpt: Path, manifest: dict, saved: dict, current: dict, params: dict) -> None:
    """Refuse a checkpoint whose tensors no longer fit; warn if only params changed."""
    changes = _param_changes(manifest.get("params") or {}, params)
    shape_diffs = []
    for name, state in saved.items():
        if name not in current:
            continue
        old, new = _tensor_shapes(state), _tensor_shapes(current[name])
        for key in sorted(set(old) & set(new)):
            if old[key] != new[key]:
                shape_diffs.append(f"{name}.{key}: {list(old[key])} -> {list(new[key])}")
    if shape_diffs:
        why = "; ".join(changes) if changes else "no param changed, so the code did"
        raise ResumeError(
            f"cannot resume from {ckpt}: the model-shaping params changed ({why}); tensor shapes "
            f"differ: {', '.join(shape_diffs[:5])}{' ...' if len(shape_diffs) > 5 else ''}. "
            "Restore the params, or start fresh by detaching the state dataset."
        )
    if changes:
        warn(f"params changed since checkpoint step {manifest.get('step')}: {'; '.join(changes)}; shapes match, resuming")
