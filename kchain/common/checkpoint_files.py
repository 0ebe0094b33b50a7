"""Checkpoints on disk: their manifest and checksums, pruning, and the search for the newest one.

A checkpoint is a directory `checkpoints/step-00000120/` holding state.pt, a copy of the metrics
trace, and manifest.json (written last) with the sha256 and size of every file. Everything here
reads, verifies, removes or finds such directories without opening state.pt as a torch file, so it
is standard library only: the in-kernel publisher, the doctor's probe and the laptop find and verify
a checkpoint without importing torch or numpy. Writing and loading are in checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import threading
import time
import zipfile
from concurrent.futures import Future
from pathlib import Path

from kchain.common import layout
from kchain.common.atomic import fsync_path
from kchain.common.faults import NO_FAULTS, Faults
from kchain.common.say import gb, say, warn

HASH_CHUNK = 1 << 20  # 1 MiB reads: checkpoints can be gigabytes
# How deep to look inside one of kchain's own state datasets: <mount>/kchain/checkpoints/step-N/
# is 3 levels. Other people's datasets are never walked (see _in_mount).
SEARCH_DEPTH = 5
WRITE_SLACK = 1.05  # a checkpoint file is state_bytes plus a little zip overhead (64-byte record alignment)
# The manifest key of the files a framework wrote (the Hugging Face Trainer's checkpoint folder) that a
# checkpoint holds beside state.pt: {group: {name in the checkpoint: path inside the framework's folder}}.
# Each is in "files" too (sha256 and size), so it is verified with the rest.
ATTACHED_KEY = "attached"
# The manifest key of the best checkpoint so far (train.keep_best, keepbest.py): {metric, mode, value,
# step}. Pruning spares that step's folder; the end state carries it beside the newest.
BEST_KEY = "keep_best"
# The manifest key naming the tracked objects that are torch modules (`kchain pull` writes their weights).
MODULES_KEY = "modules"
FROZEN_KEY = "frozen"  # a fine-tune's frozen base left out: {tracked name: {state_dict key: {shape, dtype, sha256}}}


class ResumeError(Exception):
    """The checkpoint cannot be loaded into this run (e.g. the model's shape changed)."""


class CheckpointInvalid(Exception):
    """A checkpoint failed verification; the message says which file and why."""


class CheckpointTooLarge(Exception):
    """The checkpoint cannot fit the disk even after pruning; the message says what to change."""


class CheckpointsDamaged(Exception):
    """Checkpoints were found but none can be loaded: starting fresh would silently redo the run."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)  # one buffer, refilled: no allocation per chunk
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# --- verifying --------------------------------------------------------------------------------


def read_manifest(ckpt: Path, prefix: str = "") -> dict:
    """ckpt's manifest, if it is kchain's and every file it lists is there with its recorded size.

    The cheap half of a verification: the checksums are compared by verify(), or, for state.pt,
    while it is loaded (checkpoint.load_verified). `prefix`: the checkpoint's files carry it in a
    flat folder (the kept best in a state version: layout.BEST_PREFIX).
    """
    mpath = ckpt / (prefix + layout.MANIFEST)
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
        path = ckpt / (prefix + name)
        if not path.is_file():
            raise CheckpointInvalid(f"{path}: missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointInvalid(f"{path}: {size} bytes, manifest says {want['size']} (truncated?)")
    return manifest


def check_sha256(path: Path, want: dict, got: str | None = None) -> None:
    if (got or sha256_of(path)) != want["sha256"]:
        raise CheckpointInvalid(f"{path}: sha256 does not match the manifest (corrupted)")


def verify(ckpt: Path, prefix: str = "") -> dict:
    """The manifest of ckpt if every file it lists has the recorded size and sha256."""
    manifest = read_manifest(ckpt, prefix)
    for name, want in manifest["files"].items():
        check_sha256(ckpt / (prefix + name), want)
    return manifest


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
    newest = next(iter(newest_first(checkpoints, input_root, None, state_slug)), None)
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


def early_digest(path: Path) -> Future | None:
    """The early digest of path if it was started and the file has not changed since."""
    hit = _early.pop(str(path), None)
    try:
        return hit[1] if hit and hit[0] == _stamp(path) else None
    except OSError:
        return None


# --- files a framework wrote -------------------------------------------------------------------


def attached_names(group: str, folder: Path) -> dict[str, str]:
    """{name in the checkpoint: path under folder} for every file under `folder`, for the manifest.

    A state version is flat (Kaggle keeps only top-level files), so a file in a subfolder
    (an adapter's, a sharded model's) gets one flat name: `<group>.<path with / as -->`.
    """
    names: dict[str, str] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(folder).as_posix()
        flat = f"{group}.{rel.replace('/', '--')}"
        while flat in names:  # two paths flattened alike (a--b and a/b): the second gets a mark
            flat = f"{group}.~{flat.removeprefix(group + '.')}"
        names[flat] = rel
    return names


def attached_files(ckpt: Path, manifest: dict, group: str) -> dict[str, Path]:
    """The files of `group` a checkpoint holds: {path inside the framework's folder: file in ckpt}."""
    names = (manifest.get(ATTACHED_KEY) or {}).get(group) or {}
    return {rel: ckpt / flat for flat, rel in names.items()}


# --- pruning ----------------------------------------------------------------------------------


def complete(checkpoints: Path) -> list[Path]:
    """The step-* folders in checkpoints, oldest first."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith(layout.CHECKPOINT_PREFIX))


def remove(ckpt: Path, faults: Faults = NO_FAULTS) -> None:
    """Atomic for a reader: renamed aside (a .tmp- name nobody loads) first, then deleted."""
    aside = ckpt.with_name(f"{layout.TMP_PREFIX}prune-{ckpt.name}-{os.getpid()}")
    os.replace(ckpt, aside)
    fsync_path(ckpt.parent)
    faults.in_save("in_prune")
    shutil.rmtree(aside, ignore_errors=True)


def best_step(manifest: dict) -> int | None:
    """The step of the best checkpoint a manifest records (train.keep_best), or None."""
    try:
        return int(manifest[BEST_KEY]["step"])
    except (KeyError, TypeError, ValueError):
        return None


def kept_best(done: list[Path]) -> Path | None:
    """Among `done` (oldest first), the folder of the best step the newest one records, or None."""
    if not done:
        return None
    try:
        manifest = json.loads((done[-1] / layout.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    step = best_step(manifest) if isinstance(manifest, dict) else None
    return next((d for d in done if _step_of(d) == step), None) if step is not None else None


def prune(checkpoints: Path, keep: int, faults: Faults = NO_FAULTS) -> None:
    """Keep the `keep` newest complete checkpoints, and the kept best beside them (train.keep_best)."""
    done = complete(checkpoints)
    best = kept_best(done)
    for old in done[: max(0, len(done) - keep)]:
        if old != best:
            remove(old, faults)


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
    best = kept_best(done)
    if best is not None and best != done[-1]:  # the kept best goes only when nothing older is left
        done.remove(best)
        done.insert(len(done) - 1, best)
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


def clean_tmp(checkpoints: Path) -> None:
    """Remove half-written checkpoints, half-pruned ones and those set aside as corrupt last time."""
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith((layout.TMP_PREFIX, layout.CORRUPT_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)


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


def newest_first(checkpoints: Path, input_root: Path, scratch: Path | None, state_slug: str | None) -> list[Path]:
    found = candidates(checkpoints, input_root, scratch, state_slug)
    # At equal steps prefer the working dir (it is the one we are writing to).
    return sorted(found, key=lambda p: (_step_of(p), p.parent == checkpoints), reverse=True)


def set_aside(path: Path, checkpoints: Path, e: CheckpointInvalid, damaged: list[str]) -> None:
    """Say a checkpoint is damaged; in our own working dir, rename it `.corrupt-...` so it is neither
    loaded nor counted when old checkpoints are pruned (the next start removes it)."""
    warn(f"skipping checkpoint {path}: {e}; trying the previous one")
    damaged.append(str(e))
    if path.parent == checkpoints:
        os.replace(path, checkpoints / f"{layout.CORRUPT_PREFIX}{path.name}-{int(time.time())}")


def other_job(path: Path, manifest: dict, job: str | None) -> bool:
    """Whether the checkpoint belongs to another job (said in one line, then skipped)."""
    if job and manifest.get("job") and manifest["job"] != job:
        say(f"ignoring checkpoint {path}: it belongs to job {manifest['job']!r}, not {job!r}")
        return True
    return False


def _find_checkpoints(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                     state_slug: str | None = None) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(every checkpoint that verifies, newest first; one line per damaged one)."""
    good: list[tuple[Path, dict]] = []
    damaged: list[str] = []
    for path in newest_first(checkpoints, input_root, scratch, state_slug):
        try:
            manifest = verify(path)
        except CheckpointInvalid as e:
            set_aside(path, checkpoints, e, damaged)
            continue
        if not other_job(path, manifest, job):
            good.append((path, manifest))
    return good, damaged


def bring_best(resumed: Path, manifest: dict, checkpoints: Path) -> str | None:
    """The kept best the resumed checkpoint records, copied into `checkpoints` (verified) if it is not
    there yet, so this session's pruning spares it and its end state carries it; what was done, in words.

    Where it is: the resumed folder itself (the best is the newest), its `best.*` files (a flat state
    version), or a sibling step folder (a notebook's output, the working dir).
    """
    step = best_step(manifest)
    if step is None:
        return None
    name = layout.checkpoint_name(step)
    if (checkpoints / name / layout.MANIFEST).is_file():
        return None
    if int(manifest.get("step", -1)) == step:
        places = [(resumed, "")]
    else:
        places = [(resumed.parent / name, ""), (resumed, layout.BEST_PREFIX)]
    for src, prefix in places:
        if not (src / (prefix + layout.MANIFEST)).is_file():
            continue
        try:
            kept = verify(src, prefix)
        except CheckpointInvalid as e:
            warn(f"the kept best checkpoint {name} is damaged ({e}): keep_best starts over from here")
            return None
        tmp = checkpoints / f"{layout.TMP_PREFIX}best-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file in [*kept["files"], layout.MANIFEST]:  # the manifest last, as every writer does
            try:
                os.link(src / (prefix + file), tmp / file)  # same disk (a local resume): no copy
            except OSError:
                shutil.copyfile(src / (prefix + file), tmp / file)
        os.replace(tmp, checkpoints / name)
        fsync_path(checkpoints)
        return f"kept best checkpoint {name} ({kept[BEST_KEY]['metric']} {kept[BEST_KEY]['value']}) brought along " \
               f"from {src}, {gb(dir_bytes(checkpoints / name))}"
    warn(f"the kept best checkpoint {name} is not beside {resumed}: keep_best starts over from here")
    return None


def find_latest(checkpoints: Path, input_root: Path, scratch: Path, job: str | None,
                state_slug: str | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies; each one skipped is named in a warning."""
    good, _ = _find_checkpoints(checkpoints, input_root, scratch, job, state_slug)
    return good[0] if good else None
