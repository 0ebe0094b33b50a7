"""The metrics trace on its own: rows, the best val* value, a resume's history put back in front."""

from __future__ import annotations

import json

from kchain.common.trace import Trace


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_the_last_values_and_the_best_of_the_first_val_metric(tmp_path):
    trace = Trace(tmp_path / "metrics.jsonl", writes=True)
    trace.log(1, {"loss": 2.0, "val_loss": 1.5, "val_acc": 0.1})
    trace.log(2, {"val_loss": 1.7, "val_acc": 0.9})  # worse loss: best stays; val_acc is not followed
    trace.log(3, {"val_loss": 1.2})
    trace.close()
    assert [r["step"] for r in rows(trace.path)] == [1, 2, 3]
    assert trace.metrics == {"loss": 2.0, "val_loss": 1.2, "val_acc": 0.9}
    assert trace.best == {"name": "val_loss", "value": 1.2, "step": 3}
    assert trace.bytes == trace.path.stat().st_size
    higher = Trace(tmp_path / "acc.jsonl", writes=True)
    higher.log(1, {"val_acc": 0.5})
    higher.log(2, {"val_acc": 0.4})
    higher.close()
    assert higher.best is not None and higher.best["value"] == 0.5  # an accuracy: higher is better


def test_another_rank_keeps_values_but_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("rank 0's\n")
    other = Trace(path, writes=False)
    other.log(4, {"loss": 1.0})
    assert other.metrics == {"loss": 1.0} and path.read_text() == "rank 0's\n" and other.logged() == b""


def test_a_resume_puts_the_checkpoints_history_before_what_this_process_logged(tmp_path):
    trace = Trace(tmp_path / "metrics.jsonl", writes=True)
    trace.log(0, {"setup": 1})
    history = b'{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'
    trace.adopt(history, trace.logged())
    trace.log(3, {"loss": 2.0})
    trace.close()
    assert [r["step"] for r in rows(trace.path)] == [1, 2, 0, 3] and trace.bytes == trace.path.stat().st_size
