"""train.trackers.mlflow: one MLflow run for a whole chain of sessions, in a file store that travels
with the state.

MLflow keeps a run in its tracking store, and a Kaggle session's disk is gone when the session ends:
a run made in session 1 is "not found" in session 2 unless its store comes along. So the switch points
MLflow at a file store in the working folder, `<working>/kchain/mlflow` (MLFLOW_TRACKING_URI and MLflow
3's opt-in MLFLOW_ALLOW_FILE_STORE=true, unless the process has a tracking URI of its own:
common/trackers.py), and carries it as the TensorBoard log is carried (tensorboard.py):

- At each save, rank 0 copies the folder into the checkpoint (the manifest's "attached" group
  `mlflow`: each file hashed and verified like state.pt, flat in a state version). A metric file is
  copied up to its last complete line (MLflow appends `timestamp value step` lines; its asynchronous
  logging writes them from another thread). Every file is copied, never linked: MLflow appends to a
  resumed run's metric files and rewrites its meta.yaml, which would change the checkpoint's own bytes.
  A checkpoint holds files only, and MLflow finds a run only where its folders are, empty ones
  included (`params/`, `artifacts/`): the copy lists every folder in one more file, DIRS_FILE.
- At a resume, the folder is made exactly what the resumed checkpoint holds when the Run is built,
  before the user's code imports mlflow: whatever a killed session logged after its last checkpoint is
  gone, so each step is in the run once, and MLFLOW_RUN_ID (the run active at that checkpoint) makes
  `mlflow.start_run()` resume the run the store holds.

Nothing of mlflow is imported here: the store is MLflow's own files, read and written by MLflow.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from kchain.common import layout
from kchain.common.checkpoint_files import attached_files
from kchain.common.eventfiles import copy_prefix

GROUP = layout.MLFLOW_DIR  # the checkpoint's group of files ("attached" in the manifest)
METRICS_PART = "metrics"  # a run's metric files, <experiment>/<run>/metrics/<key>: appended by lines
DIRS_FILE = ".kchain-dirs"  # in the checkpoint's copy only: every folder of the store, one a line


class Store:
    """The chain's MLflow file store on this rank: restored from the resumed checkpoint, copied into each."""

    def __init__(self, folder: Path, scratch: Path, writes: bool, found: Callable[[], tuple[Path, dict] | None]):
        self.folder = folder
        self.scratch = scratch  # where a copy for the next checkpoint is put together (same disk)
        self.writes = writes  # rank 0 owns the folder (log to MLflow from rank 0, as to any tracker)
        self._found = found  # the checkpoint this run resumes from (checkpointer.find), or None

    def restore(self) -> None:
        """The folder made what the resumed checkpoint holds (nothing, for a chain's first session): rank 0,
        when the Run is built."""
        if not self.writes:
            return
        shutil.rmtree(self.folder, ignore_errors=True)  # a killed session's later values go
        found = self._found()
        if found is None:
            return
        files = attached_files(*found, GROUP)
        dirs = files.pop(DIRS_FILE, None)
        for rel in dirs.read_text().splitlines() if dirs is not None else []:
            (self.folder / rel).mkdir(parents=True, exist_ok=True)
        for rel, src in files.items():
            dst = self.folder / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)  # a copy: the checkpoint's verified files are never written to

    def stage(self) -> Path | None:
        """The folder as it is now, copied for the next checkpoint (rank 0, at a save); None if empty."""
        found = sorted(self.folder.rglob("*")) if self.writes and self.folder.is_dir() else []
        files = [p for p in found if p.is_file()]
        if not files:
            return None
        staged = self.scratch / f"{layout.TMP_PREFIX}{GROUP}-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        (staged / DIRS_FILE).write_text("".join(f"{p.relative_to(self.folder).as_posix()}\n" for p in found if p.is_dir()))
        for src in files:
            rel = src.relative_to(self.folder)
            dst = staged / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            data_end = src.stat().st_size
            if len(rel.parts) > 3 and rel.parts[2] == METRICS_PART:  # <experiment>/<run>/metrics/<key>
                data_end = _complete_lines(src, data_end)
            copy_prefix(src, dst, data_end)
        return staged

    def addition(self) -> tuple[dict, dict[str, Path]]:
        """What every checkpoint adds (checkpointer.additions): the store's files, as the group `mlflow`."""
        staged = self.stage()
        return {}, ({GROUP: staged} if staged is not None else {})


def _complete_lines(path: Path, size: int) -> int:
    """Where the last complete line that ends by `size` ends: a writer in another thread may be mid-line."""
    with open(path, "rb") as f:
        data = f.read(size)
    return data.rfind(b"\n") + 1
