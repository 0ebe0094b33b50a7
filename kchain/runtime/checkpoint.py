"""Checkpoints: snapshot the state, write it in the background, verify it, find the newest one.

A checkpoint is a directory `checkpoints/step-00000120/` holding state.pt, a copy of the metrics
trace, and manifest.json (written last) with the sha256 and size of every file. It is written under
a `.tmp-` name, every file fsynced, then renamed into place and the parent directory fsynced, so a
process killed at any point leaves either the complete checkpoint or a `.tmp-` directory that the
next start ignores. Older checkpoints are pruned only after the newer one is in place.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import queue
import random
import shutil
import tarfile
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from . import death, layout
from .publishplan import state_bytes  # the checkpoint size estimate, one for the runtime and the publish

HASH_CHUNK = 1 << 20  # 1 MiB reads: checkpoints can be gigabytes
# Blocks torch.save writes from this size up are hashed in a second thread while they go to the
# file; smaller ones (zip headers, the pickle) cost less to hash than to hand over.
OVERLAP_BYTES = 64 << 10
SYNC_EVERY = 8 << 20  # bytes of state.pt between background syncs while it is written
# How deep to look inside one of kchain's own state datasets: <mount>/kchain/checkpoints/step-N/
# is 3 levels. Other people's datasets are never walked (see _in_mount).
SEARCH_DEPTH = 5
WRITE_SLACK = 1.05  # a checkpoint file is state_bytes plus a little zip overhead (64-byte record alignment)


class ResumeError(Exception):
    """The checkpoint cannot be loaded into this run (e.g. the model's shape changed)."""


class CheckpointInvalid(Exception):
    """A checkpoint failed verification; the message says which file and why."""


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (disk full, file too large); the previous one stays in use."""


class CheckpointTooLarge(Exception):
    """The checkpoint cannot fit the disk even after pruning; the message says what to change."""


class CheckpointsDamaged(Exception):
    """Checkpoints were found but none can be loaded: starting fresh would silently redo the run."""


GB = 1e9


def gb(n: float) -> str:
    if n >= 0.1 * GB:
        return f"{n / GB:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} KB"


# kchain ddp: under torchrun only rank 0 narrates; the other ranks' warnings carry their rank.
_RANK = os.environ.get("RANK", "0") if os.environ.get("WORLD_SIZE", "1") != "1" else "0"


def say(msg: str) -> None:
    if _RANK == "0":
        print(f"[kchain] {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"[kchain{'' if _RANK == '0' else f' rank {_RANK}'}] WARNING: {msg}", flush=True)


# --- snapshot ---------------------------------------------------------------------------------


_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


class Snapshotter:
    """Private copies of the state: tensors detached and copied to host memory, the rest deep-copied.

    This is the only part of a save that blocks training; the write happens in a thread. The host
    buffers are kept and reused by the next snapshot (same key path, shape and dtype): copying into
    memory already touched avoids a page fault per 4 KiB, which dominates a fresh copy. Reuse is safe
    because a snapshot is taken only after the previous write finished. release() drops them (large
    states: a second full host copy must not outlive its write). A tensor seen twice in one state
    (tied weights) is copied once, so torch.save writes it once.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._seen: dict[tuple, torch.Tensor] = {}

    def release(self) -> None:
        self._buffers = {}

    def take(self, obj, path: tuple = ()):
        if not path:
            self._seen = {}
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.numel() and view in self._seen:
                return self._seen[view]  # tied weights: one copy, one storage in the file
            buf = self._buffers.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                # clone even on CPU: the optimizer updates its tensors in place while the writer runs.
                buf = self._buffers[path] = t.to("cpu", copy=True)
            else:
                buf.copy_(t)  # from any device: a CUDA tensor comes back to the same host buffer
            self._seen[view] = buf
            return buf
        if type(obj) in _ATOMS:
            return obj  # immutable: sharing it is a copy
        if isinstance(obj, dict):
            return {k: self.take(v, (*path, k)) for k, v in obj.items()}
        if type(obj) is tuple and all(type(v) in _ATOMS for v in obj):
            return obj  # e.g. python's RNG state, 625 ints: no need to visit each one
        if type(obj) in (list, tuple):
            return type(obj)(self.take(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def snapshot(obj):
    """A one-off private copy (see Snapshotter)."""
    return Snapshotter().take(obj)


def rng_state() -> dict:
    """The global RNGs: always saved, so dropout and augmentation replay exactly."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda") or []
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved) != here:
        # Never silently: a resume that is no longer bit-exact must say so.
        warn(
            f"the checkpoint holds CUDA RNG states for {len(saved)} device(s) but this machine has "
            f"{here}; restored {min(len(saved), here)}, so the run is NO LONGER BIT-EXACT from here"
        )
    for i in range(min(len(saved), here)):
        torch.cuda.set_rng_state(saved[i], device=i)


# --- writing ----------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (its entries), by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)  # one buffer, refilled: no allocation per chunk
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


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
        self._sync = None  # the background fdatasync in flight, if any
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


def _die_if(point: str, fault_point: str | None) -> None:
    """KCHAIN_FAULT=kill_in_save=<point>: a real process death inside the writer, for tests."""
    if fault_point == point:
        death.die()


def write_checkpoint(
    checkpoints: Path,
    step: int,
    state: dict,
    metrics_src: Path,
    metrics_bytes: int,
    manifest: dict,
    keep: int,
    fault_point: str | None = None,
) -> Path:
    """Write one checkpoint atomically and prune old ones; returns the final directory."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    final = checkpoints / layout.checkpoint_name(step)
    tmp = checkpoints / f"{layout.TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    try:
        return _write_into(tmp, final, checkpoints, step, state, metrics_src, metrics_bytes, manifest, keep, fault_point)
    except (OSError, RuntimeError) as e:
        # torch's zip writer turns a failed write() of the file into a RuntimeError about stream
        # positions; the OSError that says why is its context.
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took is needed more than ever
        raise CheckpointWriteFailed(write_failure(cause, checkpoints, state_bytes(state))) from e


def write_failure(e: OSError, where: Path, need: int) -> str:
    """'checkpoint write failed: no space left on /kaggle/working (needs 12.1 GB, 3.2 GB free)'."""
    why = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "file too large (a file-size limit)"}.get(e.errno, e.strerror or str(e))
    try:
        free = gb(shutil.disk_usage(where).free)
    except OSError:
        free = "unknown"
    return f"checkpoint write failed: {why} on {where} (needs {gb(need)}, {free} free); the previous checkpoint stays in use"


def _write_into(tmp, final, checkpoints, step, state, metrics_src, metrics_bytes, manifest, keep, fault_point) -> Path:
    with ThreadPoolExecutor(4, thread_name_prefix="kchain-write") as pool:  # helper threads for one write
        _write_files(tmp, step, state, metrics_src, metrics_bytes, manifest, fault_point, pool)
    _die_if("before_rename", fault_point)

    if final.exists():
        # A stale directory of the same step (from before a resume further back): set it aside
        # first, since rename() will not replace a non-empty directory.
        stale = checkpoints / f"{layout.TMP_PREFIX}stale-{final.name}-{os.getpid()}"
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(checkpoints)
    _die_if("after_rename", fault_point)

    prune(checkpoints, keep, fault_point)
    return final


def _write_files(tmp, step, state, metrics_src, metrics_bytes, manifest, fault_point, pool) -> None:
    """state.pt, the trace and manifest.json (last) into tmp, then every file and tmp itself fsynced."""
    files = {layout.STATE_FILE: _write_state(tmp / layout.STATE_FILE, state, pool)}
    _die_if("after_state", fault_point)

    # The trace up to this step only: the live file may already hold lines of the next step.
    with open(metrics_src, "rb") if metrics_src.exists() else open(os.devnull, "rb") as src:
        data = src.read(metrics_bytes)
    (tmp / layout.METRICS).write_bytes(data)
    files[layout.METRICS] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    _die_if("after_metrics", fault_point)

    _die_if("before_manifest", fault_point)
    body = {layout.MARKER: layout.FORMAT_VERSION, **manifest, "step": step, "files": files}
    (tmp / layout.MANIFEST).write_text(json.dumps(body, indent=2, default=str) + "\n")
    # Every fsync at once: the file system commits them together, one wait for the disk, not four.
    synced = [pool.submit(fsync_path, path) for path in (*(tmp / name for name in files), tmp / layout.MANIFEST, tmp)]
    for done in synced:
        done.result()


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


def complete(checkpoints: Path) -> list[Path]:
    """The step-* folders in checkpoints, oldest first."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith(layout.CHECKPOINT_PREFIX))


def remove(ckpt: Path, fault_point: str | None = None) -> None:
    """Atomic for a reader: renamed aside (a .tmp- name nobody loads) first, then deleted."""
    aside = ckpt.with_name(f"{layout.TMP_PREFIX}prune-{ckpt.name}-{os.getpid()}")
    os.replace(ckpt, aside)
    fsync_path(ckpt.parent)
    _die_if("in_prune", fault_point)
    shutil.rmtree(aside, ignore_errors=True)


def prune(checkpoints: Path, keep: int, fault_point: str | None = None) -> None:
    done = complete(checkpoints)
    for old in done[: max(0, len(done) - keep)]:
        remove(old, fault_point)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_room(checkpoints: Path, need: int) -> str | None:
    """Before a write of `need` bytes: prune old checkpoints (never the newest) until it fits.

    Returns what was pruned, in words, or None; raises CheckpointTooLarge with one line when even
    the newest alone leaves too little room.
    """
    checkpoints.mkdir(parents=True, exist_ok=True)

    def free() -> int:
        return shutil.disk_usage(checkpoints).free

    want = int(need * WRITE_SLACK)
    pruned = []
    done = complete(checkpoints)
    while len(done) > 1 and free() < want:  # the newest stays until the new one is complete
        old = done.pop(0)
        remove(old)
        pruned.append(old.name)
    if free() < want:
        newest = (f" (the newest checkpoint, {done[-1].name} of {gb(dir_bytes(done[-1]))}, stays until a new one "
                  "is complete)") if done else ""
        raise CheckpointTooLarge(
            f"checkpoint needs {gb(need)} but {checkpoints} has {gb(free())} free{newest}: free disk space "
            "(delete files in /kaggle/working), set train.keep: 1, or checkpoint less state"
        )
    return f"pruned {', '.join(pruned)} before writing to make room" if pruned else None


class Writer:
    """Writes checkpoints in one long-lived background thread, one at a time.

    submit() waits for the previous write first, so at most one is in flight; wait() blocks until
    the writer is idle and re-raises whatever the write raised. The owner calls wait() before the
    process exits. The thread lives for the whole run: starting a thread per save would hand it the
    GIL at once and stall training for a switch interval.
    """

    def __init__(self, fault_point: str | None = None, kill_after_first: bool = False):
        self.fault_point = fault_point
        self.kill_after_first = kill_after_first
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.last_write_s = 0.0  # how long the last background write took (for the deadline)
        self.die: Callable[[], None] | None = None  # kchain ddp: how kill_after_first ends every rank

    def submit(self, **kwargs) -> None:
        self.wait()
        self._idle.clear()
        self._jobs.put(kwargs)
        if self._thread is None:
            # daemon: an idle writer must not keep the process alive; wait() covers a busy one.
            self._thread = threading.Thread(target=self._loop, name="kchain-checkpoint", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            kwargs = self._jobs.get()
            t0 = time.perf_counter()
            try:
                self.last_path = write_checkpoint(fault_point=self.fault_point, **kwargs)
                self.last_write_s = time.perf_counter() - t0
                if self.kill_after_first:
                    (self.die or death.die)()
            except BaseException as e:  # re-raised in the training thread by wait()
                if isinstance(e, CheckpointWriteFailed):
                    warn(str(e))  # at once, not at the next save
                self._error = e
            finally:
                del kwargs  # release the snapshot as soon as its write ends, not at the next one
                self._idle.set()

    def write_now(self, **kwargs) -> None:
        """The same write in the calling thread (a streamed state: live tensors, no host copy)."""
        self.wait()
        t0 = time.perf_counter()
        try:
            self.last_path = write_checkpoint(fault_point=self.fault_point, **kwargs)
        except CheckpointWriteFailed as e:
            warn(str(e))
            raise
        self.last_write_s = time.perf_counter() - t0
        if self.kill_after_first:
            (self.die or death.die)()

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()


# --- verifying and loading --------------------------------------------------------------------


def read_manifest(ckpt: Path) -> dict:
    """ckpt's manifest, if it is kchain's and every file it lists is there with its recorded size.

    The cheap half of a verification: the checksums are compared by verify(), or, for state.pt,
    while it is loaded (load_verified).
    """
    mpath = ckpt / layout.MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointInvalid(f"{ckpt}: no {layout.MANIFEST} (the write never finished)") from None
    except (OSError, ValueError) as e:
        raise CheckpointInvalid(f"{mpath}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or layout.MARKER not in manifest:
        raise CheckpointInvalid(f"{mpath}: not a kchain manifest (no {layout.MARKER!r} key)")
    files = manifest.get("files")
    if not isinstance(files, dict) or layout.STATE_FILE not in files:
        raise CheckpointInvalid(f"{mpath}: no file list with {layout.STATE_FILE} (an incomplete manifest)")
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointInvalid(f"{path}: missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointInvalid(f"{path}: {size} bytes, manifest says {want['size']} (truncated?)")
    return manifest


def _check_sha256(path: Path, want: dict, got: str | None = None) -> None:
    if (got or sha256_of(path)) != want["sha256"]:
        raise CheckpointInvalid(f"{path}: sha256 does not match the manifest (corrupted)")


def verify(ckpt: Path) -> dict:
    """The manifest of ckpt if every file it lists has the recorded size and sha256."""
    manifest = read_manifest(ckpt)
    for name, want in manifest["files"].items():
        _check_sha256(ckpt / name, want)
    return manifest


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
            _check_sha256(ckpt / name, want)
    path = ckpt / layout.STATE_FILE
    with ThreadPoolExecutor(1, thread_name_prefix="kchain-verify") as pool:
        digest = _early_digest(path) or pool.submit(sha256_of, path)
        try:
            state = load_state(ckpt)
        except Exception:
            _check_sha256(path, files[layout.STATE_FILE], digest.result())  # damaged, rather than unloadable
            raise
        _check_sha256(path, files[layout.STATE_FILE], digest.result())
    return state


# The digest of the newest checkpoint's state.pt, started when the Run is built (hash_early), so
# the hashing overlaps the user's own set-up (model, data) and run.restore mostly just loads.
_early: dict[str, tuple[tuple[int, int], Future]] = {}


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def hash_early(checkpoints: Path, input_root: Path, state_slug: str | None) -> Path | None:
    """Start hashing the newest checkpoint's state.pt in a daemon thread; returns the file, or None.

    Only a look: nothing is unpacked or renamed here; find_and_load still decides what is loaded,
    and load_verified takes this digest only for that same file, unchanged since (size, mtime).
    """
    newest = next(iter(_newest_first(checkpoints, input_root, None, state_slug)), None)
    path = newest / layout.STATE_FILE if newest else None
    if path is None or not path.is_file():
        return None
    digest: Future = Future()

    def work() -> None:
        try:
            digest.set_result(sha256_of(path))
        except BaseException as e:  # read by load_verified, which then hashes again itself
            digest.set_exception(e)

    _early[str(path)] = (_stamp(path), digest)
    threading.Thread(target=work, name="kchain-verify-early", daemon=True).start()
    return path


def _early_digest(path: Path) -> Future | None:
    """The early digest of path if it was started and the file has not changed since."""
    hit = _early.pop(str(path), None)
    try:
        return hit[1] if hit and hit[0] == _stamp(path) else None
    except OSError:
        return None


# --- finding ----------------------------------------------------------------------------------


def _walk(top: Path, depth: int = SEARCH_DEPTH):
    """(dirpath, filenames) under top, at most `depth` levels down, following dataset symlinks."""
    top_depth = len(top.parts)
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        if len(Path(dirpath).parts) - top_depth >= depth:
            dirnames[:] = []
        dirnames[:] = [d for d in dirnames if not d.startswith(layout.TMP_PREFIX)]
        yield Path(dirpath), filenames


def _unpack(archive: Path, scratch: Path) -> list[Path]:
    """Extract an archive of a kchain state dataset; returns the checkpoint dirs inside.

    Only called for archives next to the state marker: other people's archives are never opened.
    A .tar.gz is extracted in one pass, never decompressed once more just to list it.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix="ckpt-", dir=scratch))
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(dest)
        else:
            with tarfile.open(archive) as t:
                t.extractall(dest, filter="data")
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as e:
        warn(f"skipping archive {archive}: cannot read it ({e})")
        shutil.rmtree(dest, ignore_errors=True)
        return []
    return [d for d, files in _walk(dest) if layout.MANIFEST in files]


def _ours(d: Path, files: list[str]) -> bool:
    """A folder of kchain state: a state dataset version (marker file) or a step-* checkpoint."""
    return layout.STATE_MARKER in files or (d.name.startswith(layout.CHECKPOINT_PREFIX) and layout.MANIFEST in files)


def _in_state_dataset(top: Path, scratch: Path | None) -> list[Path]:
    """The checkpoints in one of kchain's state datasets, searched whole (it is small and ours);
    archives are unpacked into scratch, or left out when scratch is None (a look that writes nothing)."""
    found: list[Path] = []
    for d, files in _walk(top):
        if d != top and not _ours(d, files):
            continue
        if layout.MANIFEST in files:
            found.append(d)  # verification names whatever is wrong with it
        if scratch is not None:
            found += [p for f in files if f.endswith(layout.ARCHIVE_SUFFIXES) for p in _unpack(d / f, scratch)]
    return found


def _in_mount(mount: Path, state_slug: str | None, scratch: Path | None) -> list[Path]:
    """The checkpoints in one attached input, if it is kchain's; any other costs two stat calls.

    Ours: a state dataset version (its marker file, or the slug the job's config names), or a
    notebook's output holding a kchain working dir. Someone's data is never listed, so a manifest or
    archive in it is never opened, however many files it has.
    """
    if mount.name == state_slug or (mount / layout.STATE_MARKER).is_file():
        return _in_state_dataset(mount, scratch)
    kept = mount / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    if kept.is_dir():
        return [d for d in complete(kept) if (d / layout.MANIFEST).is_file()]
    return []


def candidates(checkpoints: Path, input_root: Path, scratch: Path | None, state_slug: str | None = None) -> list[Path]:
    """Every directory that might be a checkpoint: ours in the working dir, then attached state.

    The working dir first, then each attached input at its mount point (mounts), opened only if
    it is kchain's (_in_mount): the search costs the same whatever else is attached.
    """
    found: list[Path] = list(complete(checkpoints))
    for mount in layout.mounts(input_root, layout.STATE_KINDS):
        found += _in_mount(mount, state_slug, scratch)
    return found


def _step_of(path: Path) -> int:
    """The step a checkpoint claims, from its manifest or its name; -1 if neither says."""
    try:
        return int(json.loads((path / layout.MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return int(path.name.removeprefix(layout.CHECKPOINT_PREFIX))
    except ValueError:
        return -1


def _newest_first(checkpoints: Path, input_root: Path, scratch: Path | None, state_slug: str | None) -> list[Path]:
    found = candidates(checkpoints, input_root, scratch, state_slug)
    # At equal steps prefer the working dir (it is the one we are writing to).
    return sorted(found, key=lambda p: (_step_of(p), p.parent == checkpoints), reverse=True)


def _set_aside(path: Path, checkpoints: Path, e: CheckpointInvalid, damaged: list[str]) -> None:
    """Say a checkpoint is damaged; in our own working dir, rename it `.corrupt-...` so it is neither
    loaded nor counted when old checkpoints are pruned (the next start removes it)."""
    warn(f"skipping checkpoint {path}: {e}; trying the previous one")
    damaged.append(str(e))
    if path.parent == checkpoints:
        os.replace(path, checkpoints / f"{layout.CORRUPT_PREFIX}{path.name}-{int(time.time())}")


def _other_job(path: Path, manifest: dict, job: str | None) -> bool:
    if job and manifest.get("job") and manifest["job"] != job:
        say(f"ignoring checkpoint {path}: it belongs to job {manifest['job']!r}, not {job!r}")
        return True
    return False


def find_checkpoints(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                     state_slug: str | None = None) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(every checkpoint that verifies, newest first; one line per damaged one)."""
    good, damaged = [], []
    for path in _newest_first(checkpoints, input_root, scratch, state_slug):
        try:
            manifest = verify(path)
        except CheckpointInvalid as e:
            _set_aside(path, checkpoints, e, damaged)
            continue
        if not _other_job(path, manifest, job):
            good.append((path, manifest))
    return good, damaged


def find_latest(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                state_slug: str | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies; each one skipped is named in a warning."""
    good, _ = find_checkpoints(checkpoints, input_root, scratch, job, state_slug)
    return good[0] if good else None


def find_and_load(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                  state_slug: str | None = None) -> tuple[tuple[Path, dict, dict] | None, list[str]]:
    """((path, manifest, state) of the newest checkpoint that verifies and loads, or None; one line
    per damaged one). Each state.pt is read once (load_verified); older checkpoints are not read
    at all once one loads. One that verifies but does not load (e.g. written by another torch) is
    skipped like a damaged one.
    """
    damaged: list[str] = []
    for path in _newest_first(checkpoints, input_root, scratch, state_slug):
        try:
            manifest = read_manifest(path)
            if _other_job(path, manifest, job):
                continue
            return (path, manifest, load_verified(path, manifest)), damaged
        except CheckpointInvalid as e:
            _set_aside(path, checkpoints, e, damaged)
        except Exception as e:  # verified but unloadable: the previous one
            warn(f"checkpoint {path} verifies but does not load ({type(e).__name__}: {e}); trying the previous one")
            damaged.append(f"{path / layout.STATE_FILE}: does not load ({type(e).__name__})")
    return None, damaged


def clean_tmp(checkpoints: Path) -> None:
    """Remove half-written checkpoints, half-pruned ones and those set aside as corrupt last time."""
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith((layout.TMP_PREFIX, layout.CORRUPT_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)


# --- resuming into live objects ---------------------------------------------------------------


def tensor_shapes(obj, prefix: str = "") -> dict[str, tuple]:
    """{dotted.key: shape} of every tensor in a nested state dict."""
    out: dict[str, tuple] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = tuple(obj.shape)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensor_shapes(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensor_shapes(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def param_changes(old: dict, new: dict) -> list[str]:
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
    changes = param_changes(manifest.get("params") or {}, params)
    shape_diffs = []
    for name, state in saved.items():
        if name not in current:
            continue
        old, new = tensor_shapes(state), tensor_shapes(current[name])
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
