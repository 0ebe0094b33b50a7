"""The queue's arithmetic (kchain/chain/queue.py): which slots are free, what a push must leave of the week,
and a run that cannot fit beside the slack: it waits while another run may give hours back, and is skipped
once none can. The queue against the local Kaggle is tests/scenarios/test_queued_week.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kchain.chain import queue as queued
from kchain.chain.queue import Loop, Queue, QueuedRun, RunState
from kchain.kaggle.client import KaggleClient


def _run(label: str, planned_h: float, state: RunState = RunState.WAITING, slot: int | None = None,
         spent_h: float = 0.0) -> QueuedRun:
    return QueuedRun(label, "/nowhere/job.yaml", f"job-{label}", {}, planned_h, 1, state, slot, spent_h=spent_h)


def test_a_running_run_holds_its_slot_and_sessions_elsewhere_take_the_last_ones():
    runs = [_run("r1", 3, RunState.RUNNING, slot=2), _run("r2", 3), _run("r3", 3)]
    assert queued.free_slots(runs, busy_elsewhere=0) == [1]
    assert queued.free_slots(runs, busy_elsewhere=1) == []
    assert queued.free_slots([_run("r1", 3), _run("r2", 3)], busy_elsewhere=1) == [1]
    assert queued.free_slots([_run("r1", 3, RunState.STOPPED)], busy_elsewhere=0) == [1, 2]  # a stop frees its slot


def test_a_push_leaves_the_slack_and_what_the_other_running_runs_still_have_planned():
    r1 = _run("r1", 4, RunState.RUNNING, slot=1, spent_h=1.5)
    r2 = _run("r2", 3, RunState.RUNNING, slot=2, spent_h=3.5)  # past its plan: it holds nothing more
    runs = [r1, r2, _run("r3", 3), _run("r4", 2, RunState.STOPPED, spent_h=0.5)]
    assert queued.held_h(runs, r2, slack_h=2, use_slack=False) == pytest.approx(2.5 + 2)
    assert queued.held_h(runs, r1, slack_h=2, use_slack=False) == pytest.approx(0 + 2)
    assert queued.held_h(runs, None, slack_h=2, use_slack=True) == pytest.approx(2.5)
    assert queued.fits(runs[2], left_h=7.5, held=queued.held_h(runs, None, 2, False))
    assert not queued.fits(runs[2], left_h=7.4, held=queued.held_h(runs, None, 2, False))
    assert runs[3].left_h() == pytest.approx(1.5)  # what a stopped run gives back


def _queue(tmp_path: Path, runs: list[QueuedRun]) -> tuple[Queue, Loop, list[str]]:
    said: list[str] = []
    queue = Queue(runs, slack_h=2.0, slack_source="budget.slack", use_slack=False, made="2026-12-07T00:00:00Z")
    return queue, Loop(tmp_path / "queue.json", KaggleClient(timeout_s=1), said.append), said


def test_a_run_that_cannot_fit_beside_the_slack_waits_for_a_running_run_then_is_skipped(tmp_path):
    from kchain.store.ledger import Ledger

    running = _run("r1", 3, RunState.RUNNING, slot=1)
    queue, loop, said = _queue(tmp_path, [running, _run("r2", 4), _run("r3", 1)])
    ledger = Ledger(tmp_path / "ledger")
    queued._fill(queue, loop, ledger, left_h=8.0, busy=0)  # 8 left, 3 held by r1, 2 of slack: r2's 4 do not fit
    assert [r.state for r in queue.runs] == [RunState.RUNNING, RunState.WAITING, RunState.WAITING]
    assert queue.runs[1].said.startswith("waits: it needs 4.00 GPU-h, 3.00 are left this week beside the running")
    assert said == []  # r3 stays behind r2: the plan's order is kept

    running.state, running.slot = RunState.FINISHED, None
    queued._fill(queue, loop, ledger, left_h=5.5, busy=2)  # no run can give hours back now: r2 is skipped
    assert queue.runs[1].state == RunState.SKIPPED
    assert "needs 4.00 GPU-h, 3.50 are left this week beside the slack of 2.00 (`kchain queue --use-slack`" \
        in queue.runs[1].said
    assert queue.runs[2].state == RunState.WAITING and queue.runs[2].said == "waits for a free slot"
    assert any("r2 (job-r2) skipped" in line for line in said)
    assert "1 skipped" in queued.summary_line(queue) and "4.00 given back" in queued.summary_line(queue)


def test_a_damaged_queue_file_is_refused_with_its_path(tmp_path):
    from kchain.errors import SpecError

    path = tmp_path / "queue.json"
    path.write_text('{"format": "kchain-queue/1", "runs": [{"label": "r1"}]}')
    with pytest.raises(SpecError, match=f"{path}: not a queue `kchain queue` wrote"):
        queued.read(path)


def test_a_next_session_past_the_held_hours_is_refused_even_with_force(tmp_path):
    from helpers import copy_job

    from kchain.chain.budget import Held, Plan, check_budget
    from kchain.errors import BudgetExceeded
    from kchain.job.spec import load_job

    job = load_job(copy_job("classifier", tmp_path, kaggle={"accelerator": "gpu"}))
    plan = Plan("GPU T4 x2", session_limit_h=2.0, expected_gpu_h=2.0, used_h=1.0, weekly_h=6.0)  # 5 left
    held = Held(3.5, "the queue's slack and its other runs' planned hours", "stop here")
    with pytest.raises(BudgetExceeded) as refused:
        check_budget(job, plan, True, job.path, held)
    assert str(refused.value).endswith("5.00 are left this week (budget.weekly_gpu_hours 6) and 3.50 of them are "
                                       "held back (the queue's slack and its other runs' planned hours); stop here")
    check_budget(job, plan, False, job.path, Held(3.0, "-", "-"))  # 2 fit beside 3 of 5
    check_budget(job, plan, False, job.path, None)


def test_a_session_record_left_live_longer_ago_than_a_session_lasts_holds_no_slot(tmp_path):
    from datetime import timedelta

    from kchain.common.sessionstate import SessionState
    from kchain.store.ledger import Ledger, iso, now_utc

    ledger = Ledger(tmp_path / "ledger")
    queue, _loop, _said = _queue(tmp_path, [_run("r1", 1)])
    now = now_utc()
    ledger.save_session("other", {"session": 1, "status": SessionState.RUNNING, "gpu": True, "started": iso(now - timedelta(hours=1))})
    ledger.save_session("old", {"session": 1, "status": SessionState.RUNNING, "gpu": True, "started": iso(now - timedelta(days=2))})
    ledger.save_session("job-r1", {"session": 1, "status": SessionState.RUNNING, "gpu": True, "started": iso(now)})  # the queue's
    assert queued._busy_elsewhere(ledger, queue, None, now) == 1  # nobody looked at "old" since it ended
