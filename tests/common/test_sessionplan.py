"""A rehearsal's sessions planned in steps (KCHAIN_SESSION_PLAN, common/sessionplan.py): where a session
stops and saves depends on the steps alone, never on the machine's speed."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from test_checkpointer import parts

from kchain.common import layout, sessionplan
from kchain.common.faults import Faults
from kchain.common.sessionplan import SessionPlan
from kchain.runtime.clock import SessionClock
from kchain.runtime.loop import Loop, SessionStopped


@pytest.mark.parametrize(("total", "ends", "saves"), [
    (30, [10, 20], [5, 15, 25]),
    (16, [6, 11], [3, 8, 13]),
    (5, [2, 4], [1, 3]),  # a span of one step has no middle: its end (a stop) is its save
    (1, [], []),  # fewer steps than sessions: one session, no stop
])
def test_the_total_is_cut_into_spans_stopped_at_their_ends_and_saved_in_their_middles(total, ends, saves):
    plan = SessionPlan(3)
    assert plan.ends(total) == ends
    assert [step for step in range(total + 1) if plan.saves_at(step, total)] == saves


def test_a_session_stops_at_the_first_span_end_past_where_it_resumed():
    plan = SessionPlan(3)
    assert [plan.stop_at(resumed, 30) for resumed in (0, 10, 15, 20, 25)] == [10, 20, 20, None, None]
    assert plan.deadline_line(9, 0, 30) is None and (line := plan.deadline_line(10, 0, 30)) is not None
    assert "at step 10" in line
    assert plan.deadline_line(10, 0, None) is None  # a loop with no total has no plan: its clock decides


def test_the_variable_is_a_number_of_sessions():
    assert sessionplan.parse("") is None and sessionplan.parse("4") == SessionPlan(4)
    with pytest.raises(ValueError, match=f"^{layout.SESSION_PLAN_ENV}='0' is not a number of sessions; write e.g. 3"):
        sessionplan.parse("0")


def test_a_session_stops_and_saves_where_the_plan_says_with_a_clock_that_never_falls(tmp_path):
    # The job's cadence in seconds is replaced by the plan's mid-span saves, and the year-long clock
    # never stops the loop: the stop at step 10 is the plan's, through the deadline path.
    ckpt, progress, trace = parts(tmp_path, every={"seconds": 1e-9})
    ckpt.policy = dataclasses.replace(ckpt.policy, plan=SessionPlan(3))
    ckpt.track("model", torch.nn.Linear(2, 2))
    clock = SessionClock(time.time(), 365 * 24 * 3600.0, margin_s=0.0, publish=None)
    loop = Loop(progress, clock, ckpt, trace, ckpt.ranks, Faults(), {}, heartbeat_s=0, hang_s=None,
                on_hang=lambda waited, limit: None, cap=None, plan=SessionPlan(3))
    ran = []
    with pytest.raises(SessionStopped):
        for step in loop.steps(30):
            ran.append(step)
    ckpt.writer.wait()
    saved = sorted(int(p.name.split("-")[1]) for p in ckpt.where.checkpoints.glob("step-*"))
    assert ran == list(range(1, 11)) and progress.status == "deadline" and saved == [5, 10]
    trace.close()


def test_the_plan_adds_its_saves_to_a_cadence_in_steps_and_the_reference_saves_where_sessions_stop(tmp_path):
    ckpt, _, trace = parts(tmp_path, every={"steps": 8})
    ckpt.policy = dataclasses.replace(ckpt.policy, plan=SessionPlan(3))
    # 3 spans of 40: stops at 14 and 27 (saved by the stop), the plan's saves at 7, 20 and 33.
    assert [s for s in range(1, 41) if ckpt.due(s, 40)] == [7, 8, 16, 20, 24, 32, 33, 40]
    ckpt.policy = dataclasses.replace(ckpt.policy, plan=sessionplan.parse(sessionplan.reference(3)))
    assert [s for s in range(1, 41) if ckpt.due(s, 40)] == [7, 8, 14, 16, 20, 24, 27, 32, 33, 40]
    assert ckpt.policy.plan.deadline_line(27, 0, 40) is None  # the reference never stops
    trace.close()
