"""The run log, the GPU-hour week and the loss plot."""

import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from helpers import JOBS, error_line, invoke

from kchain.chain.outcome import of_chain
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.errors import KchainError
from kchain.result.plot import plot_chain
from kchain.store.ledger import Ledger, budget_lines, iso, runs_lines, week_start


def test_the_quota_week_starts_saturday_midnight_utc():
    sunday = datetime(2026, 11, 29, 15, 0, tzinfo=timezone.utc)
    assert week_start(sunday) == datetime(2026, 11, 28, tzinfo=timezone.utc)
    saturday_early = datetime(2026, 11, 28, 0, 30, tzinfo=timezone.utc)
    assert week_start(saturday_early) == datetime(2026, 11, 28, tzinfo=timezone.utc)
    friday = datetime(2026, 11, 27, 23, 59, tzinfo=timezone.utc)
    assert week_start(friday) == datetime(2026, 11, 21, tzinfo=timezone.utc)


def test_budget_counts_this_weeks_gpu_sessions_and_estimates_what_is_left(tmp_path):
    ledger = Ledger(tmp_path)
    now = datetime.now(timezone.utc)
    start = week_start(now)
    ledger.save_session("job-a", {"session": 1, "status": SessionState.COMPLETE, "gpu": True,
                                  "started": iso(start.replace(hour=1)), "ended": iso(start.replace(hour=4)),
                                  "summary": {"status": "deadline", "step": 3000, "total": 9000, "steps_per_s": 0.5}})
    ledger.save_session("job-a", {"session": 2, "status": SessionState.COMPLETE, "gpu": False,
                                  "started": iso(start.replace(hour=5)), "ended": iso(start.replace(hour=9))})
    ledger.save_session("job-b", {"session": 1, "status": SessionState.COMPLETE, "gpu": True,
                                  "started": iso(start),
                                  "ended": iso(start.replace(hour=2))})
    assert abs(ledger.gpu_hours_this_week(now) - 5.0) < 1e-6
    assert ledger.week_tally(now) == {"start": start.timestamp(), "used_s": 5 * 3600.0}  # an unattended kernel's
    lines = budget_lines(ledger, 30, "job-a")
    assert "25.00 GPU-hours left this week." in lines
    assert any(line.startswith("job-a session 1") and "3.00" in line and "deadline at step 3000" in line for line in lines)
    assert lines[-1] == "job-a: 6000 steps to go at 0.50 steps/s = 3.33 GPU-h, 1 more session(s)"


def test_runs_shows_the_best_row_or_the_chains_kept_best(tmp_path):
    ledger = Ledger(tmp_path)
    assert runs_lines(ledger, job_file="a/job.yaml")[-1] == \
        "the run log is empty: `kchain smoke a/job.yaml` writes its first line"
    ledger.append_run(run_id="r1", channel="smoke", job="j", config="abc", steps=4, val="0.9", checkpoint="c1", note="")
    ledger.append_run(run_id="r2", channel="kaggle", job="j", config="abc", steps=400, val="0.35", checkpoint="c2",
                      note="died, resumed")
    ledger.append_run(run_id="r3", channel="kaggle", job="j", config="def", steps=400, val="0.5", checkpoint="c3",
                      note="higher lr, worse")
    lines = runs_lines(ledger)
    # Without a chain's kept best, the row with the best value at its own step; no pull names a row's step.
    assert lines[-1] == "best row by val: r2 at val 0.35 (job j)"
    assert len(lines) == 5
    # A chain's result (kchain/chain/outcome.py) replaces it: the kept best the state carries, as pull --best brings it.
    chain: list[SessionRecord] = [{"session": 1, "status": SessionState.COMPLETE, "saved_step": 60, "publish": {"published": "relay", "step": 60,
              "version": 3}, "kept_best": {"metric": "val_loss", "mode": "min", "value": 0.35, "step": 40},
              "summary": {"status": "finished", "step": 60, "total": 60}}]
    said = of_chain(chain)
    assert runs_lines(ledger, said.lines("a/job.yaml", "alice/j-state"))[-2:] == [
        "best: val_loss 0.35 at step 40 (train.keep_best), in alice/j-state version 3: `kchain pull a/job.yaml --best`",
        "final: step 60 (finished), in alice/j-state version 3: `kchain pull a/job.yaml --final`"]
    # Its last state in no state version yet (internet off, before `continue` saw the end): continue publishes it.
    del chain[0]["publish"]
    assert of_chain(chain).finished_message("a/job.yaml", "alice/j-state") == (
        "training is complete: 60/60 steps, best val_loss 0.35 at step 40; final weights (step 60) in session 1's "
        "output on Kaggle: `kchain continue a/job.yaml` publishes them as a state version, then "
        "`kchain pull a/job.yaml --final`")


def test_plot_marks_the_sessions(tmp_path):
    trace = [{"step": s, "time": 0.0, "loss": 4.0 / s} for s in range(1, 101)]
    trace += [{"step": s, "time": 0.0, "val_loss": 4.5 / s} for s in (50, 100)]
    out = plot_chain(trace, [(1, 0), (2, 40), (3, 75)], tmp_path / "loss.png", "demo: 3 sessions")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(KchainError) as refused:
        plot_chain([{"step": 1, "time": 0.0, "loss": 1.0}], [(1, 0)], tmp_path / "loss.png", "demo")
    assert str(refused.value) == "kchain plot needs matplotlib: pip install 'kchain[plot]'"
    result = invoke("plot", JOBS / "tinygpt" / "job.yaml")  # said first, before the chain is looked at
    assert result.exit_code == 1 and error_line(result) == f"Error: {refused.value}"


def test_commands_on_a_job_without_sessions(tmp_path):
    job = Path(__file__).resolve().parents[2] / "jobs" / "tinygpt" / "job.yaml"
    assert "the run log is empty" in invoke("runs", job).output
    result = invoke("plot", job, "-o", tmp_path / "x.png")
    assert result.exit_code == 1
    assert "has no finished session with a metrics trace yet" in result.output
    assert "GPU-hours left this week" in invoke("budget", job).output
