"""The chain's run id, and the experiment trackers' own resume variables.

A chain of sessions is one training run. `run.id` is chosen once, by rank 0 of the first session
(the one that finds no checkpoint), written into every checkpoint's manifest, and read back from
the newest one by every later session, so it is the same in every session, on every rank, and in
`kchain sync` on the laptop. The job's `train.trackers` switches export it as the trackers' own
variables before the user's code runs:

- wandb: `WANDB_RUN_ID=<run.id>` and `WANDB_RESUME=allow`: `wandb.init()` resumes the same run.
- mlflow: `MLFLOW_RUN_ID` once a run exists: the id of the MLflow run the code had active at a
  checkpoint (MLflow makes its ids itself), kept in the manifest, so `mlflow.start_run()` resumes it;
  and, unless the process has a tracking URI of its own, `MLFLOW_TRACKING_URI` on the file store that
  travels in every checkpoint (<working>/kchain/mlflow, mlflow_store.py) with `MLFLOW_ALLOW_FILE_STORE=true`:
  MLflow 3 refuses a file store without that opt-in, and mlflow-skinny (kchain[trackers]) has no other
  local store (its default, sqlite, needs SQLAlchemy).
- tensorboard: `TENSORBOARD_LOGGING_DIR=<run.tensorboard_dir>` (the Hugging Face Trainer's
  TensorBoardCallback logs there) and every `run.log` value mirrored into it (tensorboard.py).

Standard library only: no tracker is imported here; MLflow's active run is read only when the
user's code imported mlflow itself.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

KINDS = ("tensorboard", "wandb", "mlflow")  # train.trackers' switches
RUN_ID_KEY = "run_id"  # in every checkpoint's manifest
MLFLOW_KEY = "mlflow_run_id"  # in the manifest once the code had an MLflow run active at a save
WANDB_RUN_ID_ENV = "WANDB_RUN_ID"
WANDB_RESUME_ENV = "WANDB_RESUME"
MLFLOW_RUN_ID_ENV = "MLFLOW_RUN_ID"
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  # the user's own (a tracking server) wins over kchain's file store
MLFLOW_ALLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3's opt-in to its file store
TENSORBOARD_ENV = "TENSORBOARD_LOGGING_DIR"  # read by transformers' TensorBoardCallback when it is built


def new_run_id() -> str:
    """16 lowercase hex digits: a valid W&B run id, and unique enough for one person's runs."""
    return uuid.uuid4().hex[:16]


@dataclass
class RunIds:
    """The chain's ids: kchain's run id, and the MLflow run's once the code started one."""

    run_id: str
    mlflow: str | None = None

    @classmethod
    def of(cls, manifest: dict | None) -> RunIds:
        """The ids a checkpoint's manifest carries, or a new run id (the chain starts here)."""
        m = manifest or {}
        return cls(str(m.get(RUN_ID_KEY) or new_run_id()), m.get(MLFLOW_KEY) or None)

    def follow(self, manifest: dict | None) -> str | None:
        """The restored checkpoint's run id wins over the one read before it (an archived state the
        first look could not open): the old id to warn about, or None when they agree."""
        m = manifest or {}
        theirs = m.get(RUN_ID_KEY)
        if not theirs or theirs == self.run_id:
            return None
        old, self.run_id = self.run_id, str(theirs)
        self.mlflow = m.get(MLFLOW_KEY) or self.mlflow
        return old

    def manifest(self) -> dict:
        """What every checkpoint records: the run id, and the MLflow run active now (or known before)."""
        self.mlflow = _active_mlflow_run() or self.mlflow
        return {RUN_ID_KEY: self.run_id, **({MLFLOW_KEY: self.mlflow} if self.mlflow else {})}


def _active_mlflow_run() -> str | None:
    """The id of the MLflow run the user's code has active, if it imported mlflow (never imported here)."""
    mlflow = sys.modules.get("mlflow")
    active = getattr(mlflow, "active_run", None) if mlflow is not None else None
    run = active() if callable(active) else None
    return getattr(getattr(run, "info", None), "run_id", None)


def environ(kinds: Iterable[str], ids: RunIds, tensorboard_dir: Path, mlflow_dir: Path,
            env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The trackers' own variables for the switches in `kinds` (train.trackers); `env`, the process's
    environment, keeps a tracking URI it has."""
    kinds = set(kinds)
    out: dict[str, str] = {}
    if "wandb" in kinds:
        out[WANDB_RUN_ID_ENV], out[WANDB_RESUME_ENV] = ids.run_id, "allow"
    if "mlflow" in kinds and ids.mlflow:
        out[MLFLOW_RUN_ID_ENV] = ids.mlflow
    if "mlflow" in kinds and not env.get(MLFLOW_TRACKING_URI_ENV):
        out[MLFLOW_TRACKING_URI_ENV] = mlflow_dir.absolute().as_uri()
        out[MLFLOW_ALLOW_FILE_STORE_ENV] = "true"
    if "tensorboard" in kinds:
        out[TENSORBOARD_ENV] = str(tensorboard_dir)
    return out
