"""`kchain sync`: the whole chain as one run in TensorBoard, MLflow or W&B, from kchain's own trace.

The newest session's metrics trace (its output, downloaded by `kchain continue`/`status`) holds every
`run.log` row of the chain at its step, each step once: a resume puts the history as its checkpoint
held it before the session's own rows, so the steps a killed session logged past its last checkpoint
are not there twice. The run is the chain's `run.id` (in every checkpoint's manifest): a W&B run of
that id, an MLflow run tagged with it, a TensorBoard folder.

Sending never repeats a step: each target is asked what it already holds of the run (TensorBoard's
and MLflow's last step of each metric; the last step of the W&B run's offline files, read back), and
only later rows go. Run it after every session, or once at the end: the run is the same.

The trackers are extras (`pip install 'kchain[trackers]'`), imported only by the target asked for.
W&B runs offline here (nothing is uploaded; `wandb sync DIR/wandb/offline-run-*` uploads them all
to the one run id, resumed); MLflow writes to MLFLOW_TRACKING_URI, else to a file store in DIR/mlruns.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kchain.common import layout, trackers
from kchain.common.atomic import fsync_path
from kchain.errors import KchainError
from kchain.result.traces import read_trace

TARGETS = ("tensorboard", "mlflow", "wandb")
TB_EVENTS = ".tfevents."  # what TensorBoard looks for in an event file's name
RUN_TAG = "kchain.run_id"  # the MLflow tag that names the chain's run
# The .wandb file W&B writes (an offline run's record log): LevelDB's log format, 32 KiB blocks of
# chunks with a 7-byte header (crc32, length, type), after a 7-byte file header (":W&B", 0xBEE1, 0).
WANDB_BLOCK = 32768
WANDB_HEADER = struct.Struct("<4sHB")
WANDB_CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class SyncError(KchainError):
    """Nothing to sync, or a tracker that is not installed."""


@dataclass(frozen=True)
class Synced:
    """What one sync did."""

    target: str
    run_id: str
    where: str  # the folder, store or offline dir the run is in
    sent: int  # (step, metric) values sent now
    held: int  # values the target held already (not sent again)


def _steps_of(rows: Iterable[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """{step: {metric: value}}: every number of a trace, one value per metric and step, steps in order."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        numbers = {k: float(v) for k, v in row.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            out.setdefault(int(row["step"]), {}).update(numbers)
    return dict(sorted(out.items()))


def _times_of(rows: Iterable[dict[str, Any]]) -> dict[int, float]:
    """{step: when it was logged (epoch seconds)}, the first row of each step."""
    out: dict[int, float] = {}
    for row in rows:
        if "time" in row:
            out.setdefault(int(row["step"]), float(row["time"]))
    return out


def _chain_run_id(output: Path, job: str) -> str:
    """The chain's run id, from the newest checkpoint in a session's output; for a chain older than
    run ids, one made from the job's name (the same every time)."""
    checkpoints = output / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    for path in sorted(checkpoints.glob(f"{layout.CHECKPOINT_PREFIX}*"), reverse=True):
        try:
            run_id = json.loads((path / layout.MANIFEST).read_text()).get(trackers.RUN_ID_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if run_id:
            return str(run_id)
    return hashlib.sha256(job.encode()).hexdigest()[:16]


def sync_for(job_file: Path, to: str, folder: Path | None) -> Synced:
    """`kchain sync`: the chain's newest trace to `to`, as the run of its run id."""
    from kchain.job.spec import load_job
    from kchain.result.plot import newest_trace
    from kchain.store.ledger import Ledger, state_dir

    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    trace = newest_trace(ledger.sessions(job.name))
    if trace is None:
        raise SyncError(f"{job.name} has no session with a metrics trace yet; `kchain status` shows the chain")
    output = trace.parent.parent  # <output>/kchain/metrics.jsonl
    return _sync_trace(read_trace(trace), _chain_run_id(output, job.name), job.name, to,
                      folder or ledger.root / "trackers" / job.name)


def _sync_trace(rows: list[dict[str, Any]], run_id: str, name: str, to: str, folder: Path) -> Synced:
    """The rows of a trace to one target's run `run_id` (named `name`), each (step, metric) once."""
    steps, times = _steps_of(rows), _times_of(rows)
    if to == "tensorboard":
        return _tensorboard(steps, run_id, folder)
    if to == "mlflow":
        return _mlflow(steps, times, run_id, name, folder)
    if to == "wandb":
        return _wandb(steps, run_id, name, folder)
    raise SyncError(f"--to {to}: not a target; use one of {', '.join(TARGETS)}")


def _need(module: str, target: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SyncError(f"--to {target} needs the {target} package: pip install 'kchain[trackers]'") from None


def _new(steps: dict[int, dict[str, float]], last: dict[str, int]) -> tuple[list[tuple[int, str, float]], int]:
    """(step, metric, value) the target does not hold yet (after its last step of that metric), and
    how many it holds."""
    fresh = [(s, k, v) for s, values in steps.items() for k, v in values.items() if s > last.get(k, -1)]
    return fresh, sum(len(values) for values in steps.values()) - len(fresh)


def _tensorboard(steps: dict[int, dict[str, float]], run_id: str, folder: Path) -> Synced:
    """The run is a folder (`tensorboard --logdir` it); what it holds is read with TensorBoard's reader."""
    _need("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    last: dict[str, int] = {}
    if folder.is_dir():
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        last = {tag: max(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
    fresh, held = _new(steps, last)
    if fresh:
        before = set(folder.glob(f"*{TB_EVENTS}*"))
        w = SummaryWriter(str(folder))
        for step, key, value in fresh:
            w.add_scalar(key, value, step)
        w.close()
        for written in sorted(set(folder.glob(f"*{TB_EVENTS}*")) - before):
            target = folder / _next_events_name(before)
            _replace_durably(written, target)
            before.add(target)
    return Synced("tensorboard", run_id, str(folder), len(fresh), held)


def _next_events_name(present: set[Path]) -> str:
    """An event file's name that sorts after every one present. TensorBoard reads a folder's event files
    in name order, and the writer's own names (`...tfevents.<second>.<host>.<pid>.<count>`) do not
    sort in writing order when two syncs fall in one second (count 9 before 10, or two pids)."""
    def serial(path: Path) -> int:
        field = path.name.partition(TB_EVENTS)[2].split(".")[0]
        return int(field) if field.isdigit() else 0
    return f"events.out{TB_EVENTS}{max([int(time.time()), *(serial(p) + 1 for p in present)]):010d}.kchain-sync"


def _replace_durably(source: Path, target: Path) -> None:
    fsync_path(source)
    os.replace(source, target)
    fsync_path(target.parent)


def _mlflow(steps: dict[int, dict[str, float]], times: dict[int, float], run_id: str, name: str,
            folder: Path) -> Synced:
    """The run tagged kchain.run_id=<run.id> in the experiment named for the job (made at the first sync)."""
    _need("mlflow", "mlflow")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = None
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        # A local file store: what mlflow-skinny can write (SQLite needs the full mlflow). MLflow 3 keeps it
        # in maintenance mode and asks for this opt-in; `mlflow ui --backend-store-uri DIR/mlruns` reads it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (folder / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    exp_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
    run = found[0] if found else client.create_run(exp_id, tags={RUN_TAG: run_id}, run_name=f"{name}-{run_id}")
    mlflow_id = run.info.run_id
    last = {key: max(m.step for m in client.get_metric_history(mlflow_id, key)) for key in run.data.metrics}
    fresh, held = _new(steps, last)
    batch = [Metric(key, value, int(times.get(step, 0) * 1000), step) for step, key, value in fresh]
    for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
        client.log_batch(mlflow_id, metrics=batch[i:i + 1000])
    return Synced("mlflow", run_id, client.tracking_uri, len(fresh), held)


def _wandb(steps: dict[int, dict[str, float]], run_id: str, name: str, folder: Path) -> Synced:
    """The W&B run of id run.id, offline: a new offline run folder resumes it (resume="allow") with
    the steps after the last one any earlier offline folder of it holds."""
    wandb = _need("wandb", "wandb")
    last = max((_wandb_steps(f) for f in sorted((folder / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))),
               default=-1)
    fresh = {s: values for s, values in steps.items() if s > last}
    held = sum(len(v) for s, v in steps.items() if s <= last)
    if fresh:
        folder.mkdir(parents=True, exist_ok=True)
        _wait_for_a_fresh_second(folder / "wandb", run_id)
        run = wandb.init(project=name, id=run_id, resume="allow", mode="offline", dir=str(folder),
                         settings=wandb.Settings(silent=True, console="off"))
        try:
            for step, values in fresh.items():
                run.log(values, step=step)
        finally:
            run.finish()
            wandb.teardown()  # the W&B service ends: the run's record file is whole once this returns
    return Synced("wandb", run_id, str(folder / "wandb"), sum(len(v) for v in fresh.values()), held)


def _wait_for_a_fresh_second(runs: Path, run_id: str) -> None:
    """W&B names an offline run's folder by its start, to the second, in local time
    (`offline-run-%Y%m%d_%H%M%S-<id>`): a second sync in the same second as the last would write into
    that folder and replace its record file, and `wandb sync` would upload the later steps alone.
    So a sync waits (under a second) until its second names no folder of the run yet."""
    def taken() -> bool:
        stamp = datetime.fromtimestamp(time.time()).strftime("%Y%m%d_%H%M%S")
        return (runs / f"offline-run-{stamp}-{run_id}").exists()
    while taken():
        time.sleep(0.05)


def _wandb_steps(path: Path) -> int:
    """The last step an offline W&B run's record file holds (-1 for none), read with W&B's own
    record type (wandb.proto): W&B 0.31 ships no reader of these files in Python."""
    from wandb.proto import wandb_internal_pb2

    last = -1
    for raw in wandb_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            last = max(last, record.history.step.num)
    return last


def wandb_records(data: bytes):
    """The records of a .wandb file, whole (its chunks joined); a torn last one is left out."""
    ident, _, _ = WANDB_HEADER.unpack_from(data, 0) if len(data) >= WANDB_HEADER.size else (b"", 0, 0)
    if ident != b":W&B":
        return
    pos, held = WANDB_HEADER.size, b""
    while pos + WANDB_CHUNK.size <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < WANDB_CHUNK.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = WANDB_CHUNK.unpack_from(data, pos)
        if kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + WANDB_CHUNK.size:pos + WANDB_CHUNK.size + length]
        if len(chunk) < length:
            return
        pos += WANDB_CHUNK.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            held = chunk
        elif kind == MIDDLE:
            held += chunk
        elif kind == LAST:
            yield held + chunk
            held = b""
