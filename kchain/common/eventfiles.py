"""A TensorBoard log on disk, standard library only: the chain's event files as a checkpoint holds them
(the manifest's attached group), copied by whole TFRecords, and laid out from a state folder
(`kchain pull`). The writers and the per-session log are kchain.runtime.frameworks.tensorboard.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kchain.common import layout
from kchain.common.checkpoint_files import attached_files
from kchain.common.say import warn
from kchain.common.statefolder import link_or_copy

GROUP = layout.TENSORBOARD_DIR  # the checkpoint's group of files ("attached" in the manifest)
EVENTS_MARK = "tfevents"  # in every event file's name: a TFRecord file, copied by whole records
RECORD_OVERHEAD = 16  # a TFRecord: length (8 bytes), its crc (4), the data, the data's crc (4)


def complete_records(path: Path, size: int, start: int = 0) -> int:
    """Where the last complete TFRecord that ends by `size` ends, walking the records from `start`
    (the end of one seen before): a writer in another thread may be halfway through the next."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(size - start)  # only what was written since the last save: read once, walked in memory
    pos, end = 0, len(data)
    while pos + RECORD_OVERHEAD <= end:
        (length,) = struct.unpack_from("<Q", data, pos)
        if pos + RECORD_OVERHEAD + length > end:
            break
        pos += RECORD_OVERHEAD + length
    return start + pos


def copy_prefix(src: Path, dst: Path, size: int) -> None:
    with open(src, "rb") as f, open(dst, "wb") as out:
        left = size
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                raise OSError(f"{src}: shorter than {size} bytes while copied")
            out.write(block)
            left -= len(block)


def files_in(folder: Path) -> dict[str, Path]:
    """The TensorBoard files a checkpoint or a flat state folder holds: {path in the log dir: file}."""
    try:
        manifest = json.loads((folder / layout.MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return attached_files(folder, manifest, GROUP) if isinstance(manifest, dict) else {}


def state_dir(folder: Path, dest: Path) -> Path | None:
    """The chain's TensorBoard log held by a state folder (a state version, a checkpoint), laid out
    in `dest` as the log dir it was (links where the disk allows): `tensorboard --logdir dest` shows
    the chain as one run. None when the state holds no log."""
    files = files_in(folder)
    if not files:
        return None
    for rel, src in files.items():
        if not src.is_file():
            warn(f"{src}: missing from {folder}; the TensorBoard log is incomplete")
            continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        link_or_copy(src, out)
    return dest
