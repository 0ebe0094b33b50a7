# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain plan`: runs sized from the measured pace, placed on Kaggle's two GPU slots, against the allowance the
local Kaggle reports, the slack held back; a week that cannot hold the runs refused before anything is pushed.

The pace is the smoke's: one test runs a real smoke and plans from what it recorded; the others record a smoke
pass with a known pace through the ledger's own writer (record_smoke_pass), so the hours are exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from emulator_helpers import emulator  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.chain.plan import variants
from kchain.common.sessionstate import SessionState
from kchain.common.summary import Summary
from kchain.job.render import render_job
from kchain.job.spec import load_job
from kchain.store.ledger import Ledger, iso, now_utc

SMALL = {"steps": 40, "rows": 4000, "num_workers": 0, "eval_every": 20}
# Two-hour sessions with the default 15 minutes' margin: 1.75 hours of training each.
TRAIN = {"session_limit": "2h", "heartbeat": "0s"}
PACE = 100.0  # steps/s the recorded smoke measured: 0.01 s a step, 360,000 steps an hour


def ledger() -> Ledger:
    return Ledger(Path(os.environ["KCHAIN_HOME"]))


def job_with_smoke(tmp_path: Path, **overrides) -> Path:
    """The example classifier, made small, with a smoke pass of a known pace and loop total recorded."""
    job_file = copy_job("classifier", tmp_path, params=SMALL, train=TRAIN, **overrides)
    job = load_job(job_file)
    ledger().record_smoke_pass(render_job(job).fingerprint, "smoke-test-1", job.name,
                               {"steps_per_s": PACE, "total": 40, "sets": {}})
    return job_file


def quota(emu, hours: float) -> None:
    emu.switches.quota_has_gpu = True  # the quota answer carries the account's allowance
    emu.gpu_quota_s = hours * 3600


def test_variants_are_every_combination_then_each_seed():
    sets = [("lr", 3e-4), ("lr", 1e-3), ("batch", 16)]
    assert variants(sets, []) == [{"lr": 3e-4, "batch": 16}, {"lr": 1e-3, "batch": 16}]
    assert variants([("lr", 1e-3)], [1, 2]) == [{"lr": 1e-3, "seed": 1}, {"lr": 1e-3, "seed": 2}]
    assert variants([], []) == [{}]


def test_three_runs_fit_two_slots_with_the_slack_unspent(emulator, tmp_path):
    quota(emulator, 10)  # Kaggle allows 10 of budget.weekly_gpu_hours' 30: the smaller counts
    job = job_with_smoke(tmp_path)
    # 2 h of training (two sessions), 0.5 h, 1.5 h: each session adds its 15 minutes' margin.
    result = invoke("plan", job, "--set", "steps=720000", "--set", "steps=180000", "--set", "steps=540000")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("plan: 3 run(s) on Kaggle's 2 GPU slots, quota week from ")
    rows = [line.split() for line in lines[2:5]]
    assert [(r[0], r[1], r[2], r[3], r[6], r[7], r[8]) for r in rows] == [
        ("r1", "blobs-classifier-1", "steps=720000", "720000", "2", "2.50", "1"),
        ("r2", "blobs-classifier-2", "steps=180000", "180000", "1", "0.75", "2"),
        ("r3", "blobs-classifier-3", "steps=540000", "540000", "1", "1.75", "2"),  # slot 2 frees first
    ]
    assert lines[5] == ("[1] pace smoke smoke-test-1 on this laptop (0.01 s/step) x1 assumed (no chain has measured a "
                        "Kaggle pace yet; pass --factor); steps params.steps (the smoke's loop total was its value)")
    assert lines[6] == ("week: 10 GPU-h (Kaggle's weekly GPU quota for this account, 10 h), 0.00 used, 10.00 left; "
                        "2.00 held back as slack (one session: train.session_limit of blobs-classifier); 8.00 plannable")
    assert lines[7].startswith("planned 5.00 GPU-h, 3.00 spare beside the slack; the last run ends ")
    plan = json.loads((Path(os.environ["KCHAIN_HOME"]) / "plan.json").read_text())
    assert [(r["slot"], r["start_h"], r["end_h"]) for r in plan["runs"]] == [(1, 0.0, 2.5), (2, 0.0, 0.75),
                                                                              (2, 0.75, 2.5)]
    assert plan["planned_gpu_hours"] + plan["week"]["slack"] <= plan["week"]["left"]  # the slack is never planned
    assert lines[-1] == f"written {Path(os.environ['KCHAIN_HOME']) / 'plan.json'}"


def test_a_week_that_cannot_hold_the_runs_is_refused_before_any_push_naming_what_to_drop(emulator, tmp_path):
    quota(emulator, 10)
    job = job_with_smoke(tmp_path, budget={"slack": 1.5})
    # 2.50 + 4.75 (4 h: three sessions) = 7.25 GPU-h against 10 - 1.5 of slack = 8.5: fits; a third run does not.
    result = invoke("plan", job, "--set", "steps=720000", "--set", "steps=1440000", "--set", "steps=540000")
    assert result.exit_code == 5, result.output
    assert error_line(result) == (
        f"Error: {job}: the plan needs 9.00 GPU-h but 8.50 can be planned this week (Kaggle's weekly GPU quota for "
        "this account, 10 h, 0.00 used, 1.50 held back as slack): drop r3 (blobs-classifier-3, steps=540000; 1.75 "
        "GPU-h), or shorten r3 to 360000 steps (--steps or its params)")
    assert not (Path(os.environ["KCHAIN_HOME"]) / "plan.json").exists()
    with emulator.store.lock:
        assert emulator.store.kernels == {}  # nothing was pushed


def test_json_is_the_plan_file_and_the_pace_of_an_earlier_session_wins(emulator, tmp_path):
    job = job_with_smoke(tmp_path)
    # A session of the chain measured 50 steps/s on Kaggle: 0.02 s a step, whatever the smoke said.
    ended = now_utc()
    ledger().save_session("blobs-classifier", {
        "session": 1, "status": SessionState.COMPLETE, "gpu": True, "started": iso(ended), "ended": iso(ended),
        "summary": Summary(status="finished", step=40, total=40, steps_per_s=50.0).to_dict()})
    result = invoke("plan", job, "--seeds", "1,2", "--steps", "90000", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc == json.loads((Path(os.environ["KCHAIN_HOME"]) / "plan.json").read_text())
    assert set(doc) == {"format", "made", "slots", "week", "planned_gpu_hours", "spare", "runs"}
    assert set(doc["week"]) == {"start", "refresh", "weekly_gpu_hours", "weekly_source", "used", "left", "slack",
                                "slack_source", "plannable"}
    run = doc["runs"][1]
    assert set(run) == {"run", "job", "chain", "sets", "steps", "steps_from", "seconds_per_step", "pace_from",
                        "session_limit_h", "sessions", "gpu_hours", "slot", "start_h", "end_h", "ends"}
    assert (run["run"], run["job"], run["chain"], run["sets"], run["steps"], run["steps_from"]) == (
        "r2", str(job.resolve()), "blobs-classifier-2", {"seed": 2}, 90000, "--steps")
    assert (run["seconds_per_step"], run["pace_from"], run["sessions"], run["gpu_hours"], run["slot"]) == (
        0.02, "Kaggle session 1 of blobs-classifier", 1, 0.75, 2)


def test_the_smoke_records_its_pace_and_the_total_the_code_asked_for(tmp_path):
    job = copy_job("classifier", tmp_path, params=SMALL, train=TRAIN)
    smoked = invoke("smoke", job, "--quiet", "--ranks", "1")
    assert smoked.exit_code == 0, smoked.output
    measured = ledger().smoke_measured("blobs-classifier")
    assert measured is not None and measured["steps_per_s"] > 0
    assert (measured["total"], measured["sets"]) == (40, {})  # params.steps, not the smoke's 4-step cap
    result = invoke("plan", job, "--set", "steps=4000", "--set", "steps=8000", "--json")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["runs"]
    assert [(r["steps"], r["pace_from"].split()[:2]) for r in runs] == [
        (4000, ["smoke", measured["run_id"]]), (8000, ["smoke", measured["run_id"]])]
    assert runs[0]["seconds_per_step"] == pytest.approx(1 / measured["steps_per_s"])


def test_a_plan_without_a_measurement_or_a_total_says_what_to_run(tmp_path):
    job = copy_job("classifier", tmp_path, params=SMALL, train=TRAIN)
    result = invoke("plan", job)
    assert result.exit_code == 10
    assert error_line(result) == f"Error: {job}: no pace measured for blobs-classifier: run `kchain smoke {job}` first"
    job = job_with_smoke(tmp_path / "b")
    result = invoke("plan", job, "--set", "lr=0.1", "--set", "batch=64")  # batch may change the loop's total
    assert result.exit_code == 0, result.output  # params.steps still holds the total: 40 steps each
    assert invoke("plan", job, "--seeds", "1,x").exit_code == 2
    both = invoke("plan", job, "--seeds", "1", "--set", "seed=3")
    assert (both.exit_code, error_line(both)) == (2, "Error: --seeds and --set seed=... both give the seed; give one of them")


def test_budget_slack_is_a_number_of_gpu_hours(tmp_path):
    job = copy_job("classifier", tmp_path, budget={"slack": "6h"})
    result = invoke("render", job, "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert error_line(result).startswith(f"Error: {job}: budget.slack: '6h' is not a number")
