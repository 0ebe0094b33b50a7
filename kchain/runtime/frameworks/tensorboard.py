"""run.tensorboard_dir: one TensorBoard run for a whole chain of sessions.

TensorBoard shows a folder of event files as one run, so the chain keeps one folder,
`<working>/kchain/tensorboard`, and carries it in the state:

- At each save, rank 0 copies the folder into the checkpoint (the manifest's "attached" group
  `tensorboard`: each file hashed and verified like state.pt, flat in a state version). An event
  file still being written is copied up to its last complete record, after the writers kchain
  knows of were flushed; a file restored from the checkpoint, closed since, is linked, not copied.
  So the copy holds the log exactly up to the checkpoint's step.
- At a resume, the folder is made exactly what the resumed checkpoint holds (whatever a killed
  session wrote after its last checkpoint is gone), before the user's code writes to it: at the
  first use of run.tensorboard_dir, run.summary_writer(), run.hf_resume or the first save.
- The first writer kchain makes in a session (run.summary_writer(), the run.log mirror of
  `train.trackers.tensorboard`) starts with TensorBoard's own `purge_step` at the resumed step + 1,
  the marker with which TensorBoard itself drops any later event an earlier file holds. Only the
  first: TensorBoard applies a marker to every event read before it, this session's included.

torch.utils.tensorboard (which needs the tensorboard package) is imported when a writer is made. The
event files on disk (whole records, the log a state folder holds, for `kchain pull`) are
kchain.common.eventfiles.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kchain.common import layout
from kchain.common.checkpoint_files import attached_files
from kchain.common.eventfiles import EVENTS_MARK, GROUP, complete_records, copy_prefix
from kchain.common.statefolder import link_or_copy


class Log:
    """The chain's TensorBoard folder on this rank: restored, flushed, copied into each checkpoint."""

    def __init__(self, folder: Path, scratch: Path, writes: bool, found: Callable[[], tuple[Path, dict] | None]):
        self.folder = folder
        self.scratch = scratch  # where a copy for the next checkpoint is put together (same disk)
        self.writes = writes  # rank 0 owns the folder; the other ranks' writers write nothing
        self._found = found  # the checkpoint this run resumes from (checkpointer.find), or None
        self.purge_step: int | None = None  # the resumed step + 1; None for a fresh run
        self._opened = False
        self._restored: dict[str, int] = {}  # rel path -> size, of the files the checkpoint gave back
        self._complete: dict[str, int] = {}  # rel path -> the end of its last complete record seen
        self._writers: list = []  # the writers kchain made: flushed before each copy, closed at the end
        self.flushes: list[Callable[[], object]] = []  # a framework's loggers' flush (lightning.py), likewise
        self._mirror: Any = None  # the mirror's SummaryWriter, made at the first row

    def open(self) -> Path:
        """The folder, made what the resumed checkpoint holds (once; rank 0)."""
        if self._opened or not self.writes:
            return self.folder
        self._opened = True
        found = self._found()
        shutil.rmtree(self.folder, ignore_errors=True)  # a killed session's later events go
        if found is None:
            return self.folder
        path, manifest = found
        self.purge_step = int(manifest["step"]) + 1
        for rel, src in attached_files(path, manifest, GROUP).items():
            dst = self.folder / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)  # a copy: the checkpoint's verified files are never written to
            self._restored[rel] = self._complete[rel] = dst.stat().st_size
        return self.folder

    def made(self) -> Path:
        """The folder, opened and made (run.tensorboard_dir)."""
        folder = self.open()
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def writer(self, **kwargs):
        """A SummaryWriter on the folder with purge_step set (see Run.summary_writer)."""
        if not self.writes:
            return NoWriter()
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        folder = self.made()
        # TensorBoard applies a purge marker to every event it read before it, in file-name order: a
        # second writer's would drop what this session's first writer wrote. Only the session's first
        # event file marks it (the folder is exact already; the marker is TensorBoard's own guard).
        first = not any(EVENTS_MARK in p.name and p.relative_to(folder).as_posix() not in self._restored
                        for p in folder.rglob("*"))
        kwargs.setdefault("purge_step", self.purge_step if first else None)
        w = SummaryWriter(str(folder), **kwargs)
        self._writers.append(w)
        return w

    def mirror(self, step: int, values: dict) -> None:
        """Every number of a run.log row as a scalar at `step` (train.trackers.tensorboard)."""
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numbers:
            return
        if self._mirror is None:
            self._mirror = self.writer()
        for name, value in numbers.items():
            self._mirror.add_scalar(name, value, step)

    def flush(self) -> None:
        for w in self._writers:
            w.flush()
        for flush in self.flushes:
            flush()

    def stage(self) -> Path | None:
        """The folder as it is now, copied for the next checkpoint (rank 0, at a save); None if empty."""
        if not self.writes:
            return None
        self.open()
        self.flush()
        files = sorted(p for p in self.folder.rglob("*") if p.is_file()) if self.folder.is_dir() else []
        if not files:
            return None
        staged = self.scratch / f"{layout.TMP_PREFIX}{GROUP}-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        for src in files:
            rel = src.relative_to(self.folder).as_posix()
            dst = staged / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            size = src.stat().st_size
            if self._restored.get(rel) == size:
                link_or_copy(src, dst)  # an earlier session's file: closed, never written again
                continue
            if EVENTS_MARK in src.name:
                size = self._complete[rel] = complete_records(src, size, self._complete.get(rel, 0))
            copy_prefix(src, dst, size)
        return staged

    def close(self) -> None:
        for w in self._writers:
            w.close()
        self._writers.clear()


class NoWriter:
    """What run.summary_writer() gives a rank other than 0: every call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None
