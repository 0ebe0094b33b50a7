"""The session clock on its own: the one deadline, the step times it plans with, the publish plan."""

from __future__ import annotations

import time

from kchain.common import publishplan
from kchain.common.config import KaggleConfig
from kchain.runtime.clock import STEP_TIME_WINDOW, SessionClock


def test_the_deadline_is_the_limit_less_the_margin_and_the_guard_stops_when_a_step_and_a_save_no_longer_fit():
    now = time.time()
    clock = SessionClock(started=now - 100, limit_s=200, margin_s=40, publish=None)
    assert abs(clock.deadline() - (now + 60)) < 1e-6 and clock.reserve_s() == 40
    clock.step_took(10.0)
    assert clock.too_late(step=5, total=100, save_s=5.0) is None  # 60 s left > 10 + 5
    line = clock.too_late(step=5, total=100, save_s=55.0)
    assert line is not None and "stopping at step 5" in line


def test_an_evaluation_step_is_planned_with_even_after_it_left_the_window_of_recent_steps():
    clock = SessionClock(started=time.time(), limit_s=3600, margin_s=60, publish=None)
    clock.every_n = 5
    clock.step_took(3.0, evaluated=True)  # the evaluation at step 5
    for _ in range(STEP_TIME_WINDOW):
        clock.step_took(0.1)
    assert max(clock.step_times) == 0.1 and clock.eval_s == 3.0
    # Put the deadline between a plain step and an evaluating one.
    clock.end = time.time() + clock.reserve_s() + 1.5
    assert clock.too_late(step=7, total=30, save_s=0.0) is None  # step 8 does not evaluate
    assert clock.too_late(step=9, total=30, save_s=0.0) is not None  # step 10 does
    assert clock.too_late(step=28, total=30, save_s=0.0) is None
    assert clock.too_late(step=29, total=30, save_s=0.0) is not None  # the last step evaluates too


def test_a_publish_that_needs_more_than_the_margin_moves_the_deadline_earlier_and_one_too_long_is_dropped(tmp_path):
    plan = publishplan.figures(KaggleConfig(internet=True, state_dataset="me/job-state"))
    clock = SessionClock(started=0.0, limit_s=12 * 3600, margin_s=60, publish=plan)
    ckpt = tmp_path / "step-00000010"
    ckpt.mkdir()
    (ckpt / "state.pt").write_bytes(b"x" * 2_000_000)
    clock.sized(ckpt)
    # The publish, and the hand-over before the publisher's own check (teardown, its start, the sha256 check).
    assert plan is not None
    need = publishplan.seconds(plan, 2_000_000) + publishplan.handoff_s(2_000_000)
    assert need > 60 and clock.reserve_s() == need and clock.deadline() == 12 * 3600 - need
    said = clock.plan(lambda: 0)
    assert said is not None and "for save + publish of" in said
    short = SessionClock(started=0.0, limit_s=2 * need, margin_s=60, publish=plan)  # the publish needs half of it
    short.sized(ckpt)
    assert short.reserve_s() == 60
    short_said = short.plan(lambda: 0)
    assert short_said is not None and "relays the state from the laptop" in short_said
    assert SessionClock(0.0, 100, 10, publish=None).plan(lambda: 0) is None


def test_should_stop_times_the_steps_between_its_calls():
    clock = SessionClock(started=time.time(), limit_s=3600, margin_s=60, publish=None)
    clock.poll()
    time.sleep(0.05)
    clock.poll()
    assert len(clock.step_times) == 1 and clock.step_times[0] >= 0.05


def test_the_plan_of_a_measured_publish_is_what_the_session_took():
    # The kernel's figures: its client's start, the upload's rate over the state's bytes, then the wait for the
    # version to be ready and its push of the next session. Planned with, they give the publish it took, not
    # the assumed processing (30 s) and push (20 s) on top of a measured upload.
    timing = publishplan.measured({"start_s": 2.0, "create_s": 0.0, "rate_bps": 1e6, "bytes": 2_000_000},
                                  processing_s=1.5, push_s=0.75)
    plan = publishplan.figures(KaggleConfig(internet=True, state_dataset="me/job-state", unattended=True,
                                            publish=timing))
    assert plan is not None and plan["measured"] and publishplan.seconds(plan, 2_000_000) == 2.0 + 2.0 + 1.5 + 0.75
    assumed = publishplan.figures(KaggleConfig(internet=True, state_dataset="me/job-state", unattended=True))
    assert assumed is not None and publishplan.seconds(assumed, 0) == 30 + 15 + 30 + 20
