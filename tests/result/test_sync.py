"""`kchain sync`: the chain's trace as one run in TensorBoard, MLflow and W&B (offline), each step once,
however often it runs. The chain here is two session outputs as `kchain continue` downloads them: the
second (resumed at step 6) holds the whole history in its trace, the first's killed steps 7-8 not twice."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import invoke

from kchain.common import layout, trackers
from kchain.common.sessionstate import SessionState
from kchain.result import sync
from kchain.store.ledger import Ledger, state_dir

RUN_ID = "0123456789abcdef"
JOB = "sync-demo"


def value(step: int) -> float:
    return round(1.0 / step, 6)


def session_output(root: Path, steps: range, saved: int) -> Path:
    """A session's output: its trace (a row of loss each step, val_loss every 5) and its last checkpoint."""
    kc = root / layout.KCHAIN_DIR
    (kc / layout.CHECKPOINTS_DIR / layout.checkpoint_name(saved)).mkdir(parents=True)
    (kc / layout.CHECKPOINTS_DIR / layout.checkpoint_name(saved) / layout.MANIFEST).write_text(
        json.dumps({"step": saved, trackers.RUN_ID_KEY: RUN_ID}))
    rows = [{"step": s, "time": 1.8e9 + s, "loss": value(s)} for s in steps]
    rows += [{"step": s, "time": 1.8e9 + s, "val_loss": 2 * value(s)} for s in steps if s % 5 == 0]
    (kc / layout.METRICS).write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))
    return root


@pytest.fixture
def chain(tmp_path) -> tuple[Path, Ledger]:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.py").write_text("def main(run):\n    pass\n")
    job_file = folder / "job.yaml"
    job_file.write_text(f"name: {JOB}\ncode: train.py\n")
    return job_file, Ledger(state_dir(job_file))


def add_session(ledger: Ledger, n: int, output: Path) -> None:
    ledger.save_session(JOB, {"session": n, "status": SessionState.COMPLETE, "version": n, "output": str(output)})


def expect(last: int) -> dict[str, list[int]]:
    return {"loss": list(range(1, last + 1)), "val_loss": list(range(5, last + 1, 5))}


@pytest.mark.parametrize("target", ["tensorboard", "mlflow", "wandb"])
def test_sync_makes_one_run_with_each_step_once_and_sends_nothing_twice(chain, tmp_path, target, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    job_file, ledger = chain
    out = tmp_path / "run"
    add_session(ledger, 1, session_output(tmp_path / "s1", range(1, 9), saved=6))  # killed at 8
    first = sync.sync_for(job_file, target, out)
    assert (first.run_id, first.sent, first.held) == (RUN_ID, 8 + 1, 0)
    assert read_back(target, out) == expect(8)

    # Session 2 resumed at 6: its trace is the history up to 6 and its own steps 7-12.
    add_session(ledger, 2, session_output(tmp_path / "s2", range(1, 13), saved=12))
    second = sync.sync_for(job_file, target, out)
    assert (second.sent, second.held) == (4 + 1, 8 + 1)
    assert read_back(target, out) == expect(12)
    again = sync.sync_for(job_file, target, out)
    assert (again.sent, again.held) == (0, 12 + 2)
    assert read_back(target, out) == expect(12)


def test_a_later_named_event_file_already_there_still_reads_back_in_step_order(chain, tmp_path):
    """TensorBoard reads a folder's event files in name order; the writer names them by second, host,
    pid and a per-process count, so a sync in the same second (count 9, then 10), from another pid, or
    after a clock step back would sort before what it follows. Here the first sync's file is named a
    minute ahead, as a second sync in that position would find it."""
    job_file, ledger = chain
    out = tmp_path / "run"
    add_session(ledger, 1, session_output(tmp_path / "s1", range(1, 9), saved=6))
    sync.sync_for(job_file, "tensorboard", out)
    [first] = out.glob("*tfevents*")
    first.rename(out / f"events.out.tfevents.{int(time.time()) + 60:010d}.elsewhere.99999.0")
    add_session(ledger, 2, session_output(tmp_path / "s2", range(1, 13), saved=12))
    assert sync.sync_for(job_file, "tensorboard", out).sent == 4 + 1
    assert read_back("tensorboard", out) == expect(12)
    assert sync.sync_for(job_file, "tensorboard", out).sent == 0


def read_back(target: str, out: Path) -> dict[str, list[int]]:
    """{metric: its steps, in the order the target returns them} as the target itself reads them."""
    if target == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out), size_guidance={"scalars": 0})
        acc.Reload()
        assert all(e.value == pytest.approx(value(e.step)) for e in acc.Scalars("loss"))
        return {tag: [e.step for e in acc.Scalars(tag)] for tag in sorted(acc.Tags()["scalars"])}
    if target == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
        runs = client.search_runs([client.get_experiment_by_name(JOB).experiment_id])
        assert [r.data.tags[sync.RUN_TAG] for r in runs] == [RUN_ID]  # one run
        history = {k: sorted(client.get_metric_history(runs[0].info.run_id, k), key=lambda m: m.step)
                   for k in sorted(runs[0].data.metrics)}
        assert all(m.value == pytest.approx(value(m.step)) for m in history["loss"])
        return {k: [m.step for m in ms] for k, ms in history.items()}
    from wandb.proto import wandb_internal_pb2

    seen: Counter = Counter()
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for raw in sync.wandb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == RUN_ID
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key in ("loss", "val_loss"):
                    if key in items:
                        assert items[key] == pytest.approx(value(record.history.step.num) * (key == "loss" or 2))
                        seen[key, record.history.step.num] += 1
    assert set(seen.values()) == {1}  # each step once, over every offline folder
    return {k: sorted(s for key, s in seen if key == k) for k in ("loss", "val_loss")}


def test_the_cli_says_what_it_sent_and_refuses_a_chain_with_no_trace(chain, tmp_path):
    job_file, ledger = chain
    assert invoke("sync", job_file, "--to", "tensorboard").output.endswith(
        f"Error: {JOB} has no session with a metrics trace yet; `kchain status` shows the chain\n")
    add_session(ledger, 1, session_output(tmp_path / "s1", range(1, 4), saved=3))
    result = invoke("sync", job_file, "--to", "tensorboard", "--dir", tmp_path / "tb")
    assert result.output == f"tensorboard: run {RUN_ID} in {tmp_path / 'tb'}: 3 values sent, 0 held already\n"
