# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain week`: one row per run of the quota week, with what it changed from the run before, its best, the
GPU-hours planned and spent, and a failure's first line. The chains are real: planned with `kchain plan`,
pushed to the local Kaggle, one finishing and one crashing in its session."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from emulator_helpers import emulator  # noqa: F401
from helpers import copy_job, invoke

from kchain.job.render import render_job
from kchain.job.spec import load_job
from kchain.result.week import Row, ordered
from kchain.store.ledger import Ledger

SMALL = {"steps": 40, "rows": 4000, "num_workers": 0, "eval_every": 20, "lr": 1e-3}


def job(tmp_path: Path, name: str, crash: bool = False, **params) -> Path:
    path = copy_job("classifier", tmp_path / name, params={**SMALL, **params}, train={"heartbeat": "0s"})
    path.write_text(path.read_text().replace("name: blobs-classifier\n", f"name: {name}\n"))
    if crash:
        code = path.parent / "train.py"
        code.write_text(code.read_text().replace(
            "        trainer.step()\n", "        trainer.step()\n        if step == 25:\n"
                                       "            raise ValueError('boom at step 25')\n"))
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    ledger.record_smoke_pass(render_job(load_job(path)).fingerprint, f"smoke-{name}", name,
                             {"steps_per_s": 100.0, "total": 40, "sets": {}})
    return path


def test_the_week_has_a_row_per_run_with_its_change_best_hours_and_failure(emulator, tmp_path):
    base, crashing = job(tmp_path, "week-base"), job(tmp_path, "week-lr", crash=True, lr=3e-3)
    planned = invoke("plan", base, crashing, "--json")
    assert planned.exit_code == 0, planned.output
    hours = [run["gpu_hours"] for run in json.loads(planned.output)["runs"]]

    for path, name in ((base, "week-base"), (crashing, "week-lr")):
        assert invoke("push", path, "--skip-smoke").exit_code == 0
        emulator.wait_session(f"alice/{name}", 1)
        assert invoke("status", path).exit_code == 0  # the ended session's output and summary fetched

    result = invoke("week", base, crashing)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("quota week from ")
    assert lines[1].split() == ["run", "chain", "status", "best", "planned", "spent", "change"]
    first, second = lines[2].split(), lines[3].split()
    assert first[:3] == ["r1", "week-base", "finished"] and lines[2].endswith("  first run of the week")
    assert re.search(r" val_\w+ \S+ at step 40 ", lines[2])  # the kept best
    assert second[:3] == ["r2", "week-lr", "failed"] and lines[3].endswith("lr 0.001 -> 0.003")
    assert lines[4] == "     failed: ValueError: boom at step 25 during step"

    doc = json.loads(invoke("week", base, crashing, "--json").output)
    runs = doc["runs"]
    assert [r["run"] for r in runs] == ["r1", "r2"] and [r["planned_gpu_hours"] for r in runs] == hours
    assert all(r["spent_gpu_hours"] > 0 for r in runs)
    assert runs[1]["params"]["lr"] == 3e-3 and runs[0]["fingerprint"] != runs[1]["fingerprint"]
    assert doc["spent"] == sum(r["spent_gpu_hours"] for r in runs) and doc["planned"] == sum(hours)
    assert doc["spare"] == doc["weekly_gpu_hours"] - doc["used"] and doc["used"] >= doc["spent"]
    assert lines[5].startswith(f"planned {sum(hours):.2f} GPU-h, spent {doc['spent']:.2f} on these runs; ")


def row(label: str, params: dict | None, fingerprint: str | None, started: str | None = None) -> Row:
    return Row(label, f"c-{label}", "finished", params, fingerprint, None, None, 0.0, None, started)


def test_each_run_says_what_it_changed_from_the_one_before():
    rows = ordered([
        row("r4", {"lr": 1, "seed": 2}, None),  # not started yet: after the ones that did
        row("r2", {"lr": 1, "seed": 1}, "bbbb1111", "2026-01-01T02:00:00Z"),
        row("r1", {"lr": 1, "seed": 1}, "aaaa1111", "2026-01-01T01:00:00Z"),
        row("r3", {"lr": 2, "drop": 0.1}, "cccc1111", "2026-01-01T03:00:00Z"),
    ])
    assert [(r.label, r.change) for r in rows] == [
        ("r1", "first run of the week"),
        ("r2", "code aaaa1111 -> bbbb1111"),
        ("r3", "lr 1 -> 2, -seed, +drop=0.1 (3 changes in one run)"),
        ("r4", "lr 2 -> 1, -drop, +seed=2 (3 changes in one run)"),
    ]
