# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""The GPU quota as Kaggle reports it, read on a laptop that is not on UTC.

kagglesdk hands back quota_refresh_time as a naive UTC datetime; `.timestamp()` on it reads it as
local time, which in India (UTC+5:30) moves the week by five and a half hours. The week's start and
the account's allowance come from Kaggle's answer; the job's budget is the smaller of the two.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from emulator_helpers import emulator  # noqa: F401
from helpers import copy_job, invoke

from kchain.chain.budget import check_budget, plan_for
from kchain.common.sessionstate import SessionState
from kchain.emulator.rpcs import week_start as emulator_week_start
from kchain.errors import BudgetExceeded
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger, iso

WEEK_S = 7 * 86400


@pytest.fixture
def laptop_in_india() -> Iterator[None]:
    """The process's local time zone is Asia/Kolkata (UTC+5:30) for the test, then what it was."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


def test_the_week_and_the_allowance_come_from_kaggle_in_any_laptop_time_zone(emulator, laptop_in_india, tmp_path):
    assert time.localtime().tm_gmtoff == 5.5 * 3600
    now = time.time()
    # This account's quota week began an hour ago (not on a Saturday 00:00 UTC), and it is allowed
    # 20 GPU-h a week, fewer than the job's budget of 30.
    emulator.quota_week_offset_s = round(now - 3600 - emulator_week_start(now)) % WEEK_S
    emulator.gpu_quota_s = 20 * 3600
    emulator.switches.quota_has_gpu = True
    refresh = emulator_week_start(now, emulator.quota_week_offset_s) + WEEK_S
    assert abs(refresh - WEEK_S - (now - 3600)) < 1

    answer = KaggleClient(timeout_s=10).quota_view()
    assert answer.refresh == refresh  # not 5.5 h early
    assert (answer.used_s, answer.total_s) == (0.0, 20 * 3600)

    # Two GPU sessions in the ledger: one ended before the Kaggle week began, one started in it.
    ledger = Ledger(tmp_path / "ledger")
    at = datetime.fromtimestamp(now, timezone.utc)
    for n, (start_h, end_h) in enumerate([(3, 2), (0.5, 0)], start=1):
        ledger.save_session("other-job", {"session": n, "status": SessionState.COMPLETE, "gpu": True,
                                          "started": iso(at - timedelta(hours=start_h)),
                                          "ended": iso(at - timedelta(hours=end_h))})
    job = load_job(copy_job("classifier", tmp_path, budget={"weekly_gpu_hours": 30}, train={"session_limit": "12h"}))
    plan = plan_for(job, ledger, KaggleClient(timeout_s=10))
    assert plan.week_start == datetime.fromtimestamp(refresh - WEEK_S, timezone.utc)
    assert abs(plan.used_h - 0.5) < 0.01  # only the session inside Kaggle's week
    assert (plan.weekly_h, plan.kaggle_h, plan.budget_h) == (20, 20, 30)
    refreshes = datetime.fromtimestamp(refresh, timezone.utc).strftime("%A %H:%M UTC")
    assert f"  quota week     from {iso(plan.week_start)}, refreshes {refreshes} (Kaggle's refresh time)" in plan.lines()
    assert ("  weekly quota   Kaggle allows this account 20 h, budget.weekly_gpu_hours is 30 h: the smaller counts"
            in plan.lines())

    emulator.gpu_quota_s = 12 * 3600  # 12 h allowed, 0.5 used: a 12 h session does not fit
    with pytest.raises(BudgetExceeded) as refused:
        check_budget(job, plan_for(job, ledger, KaggleClient(timeout_s=10)), False, job.path)
    assert str(refused.value) == (
        f"{job.path}: this session may use 12.00 GPU-h but only 11.50 are left this week (Kaggle's weekly GPU "
        f"quota for this account, 12 h); wait for {refreshes}, lower train.session_limit, or pass --force")

    # `kchain budget` counts the same week: Kaggle's 12 h, not the job's 30, from Kaggle's week start.
    shown = invoke("budget", job.path)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[:2] == [f"GPU quota week from {iso(plan.week_start)} (resets {refreshes})",
                         "Kaggle allows this account 12 GPU-hours a week, fewer than budget.weekly_gpu_hours 30: "
                         "the smaller counts"]
    assert "12.00 GPU-hours left this week." in lines
