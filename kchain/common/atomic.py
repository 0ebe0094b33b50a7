"""Atomic file writes: a reader sees the old file or the new one, never a torn one, and once the
call returns the new one survives a crash.

The one discipline for every file kchain writes whole (the laptop's ledger, doctor.json and rendered
notebooks, the emulator's state, the kernel's rank errors, probe output and published summary):
a temporary file in the same folder, fsynced, renamed over the target, then the folder fsynced (the
rename itself is durable only then).

The temporary name is `layout.TMP_PREFIX + name + "." + random` (mkstemp). Random, because two
writers of one file (two kchain commands on the ledger, the emulator's threads, several ranks)
must never write into each other's temporary file, as a fixed name lets them; with the runtime's
prefix, because the runtime's listings already skip and clean what starts with it.

Standard library only: the runtime imports it inside the Kaggle kernel.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kchain.common import layout


@functools.cache
def usual_mode() -> int:
    """The mode a plain open() gives a new file here: 0o666 less the process's umask (0644 under the usual
    022). mkstemp makes 0600 files, and so do libraries that write through a temporary file (safetensors);
    nothing kchain writes through here or pulls is secret (it never writes a credential file).

    Read once: Linux says the umask in /proc; elsewhere setting it is the only way to read it, so once per
    process a file another thread makes in that instant gets 0600, never more."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


def give_usual_mode(path: str | os.PathLike[str]) -> None:
    """A file another library wrote with a temporary file's 0600 gets usual_mode() (a pulled model.safetensors)."""
    os.chmod(path, usual_mode())


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: a rename into it, a new file), by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes, tmp: str | os.PathLike[str] | None = None) -> None:
    """Replace path's content by data, atomically and durably (its folder is made if missing).

    `tmp`: a fixed temporary name instead of a random one, for a file with one writer by
    construction whose failure path must be reachable by name (summary.json, rank 0's alone)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        fd, tmp = tempfile.mkstemp(prefix=f"{layout.TMP_PREFIX}{path.name}.", dir=path.parent)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, usual_mode())
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), usual_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """write_bytes of text in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """write_text of data as indented JSON with sorted keys and a final newline (diffable by eye)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
