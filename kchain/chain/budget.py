"""The week's GPU budget against a session: what it may cost (`plan_for`) and the refusal when the
quota left cannot cover it (`check_budget`). The ledger counts the hours, the account's across its job
folders (store/account.py, keyed by the kernels' owner: `account_of`); this plans with them.

Kaggle's own quota answer wins where it speaks: its refresh time fixes the week (else Saturday
00:00 UTC is assumed), its used time counts when it is higher than the ledger's (GPU time spent
outside kchain), and its allowance caps `budget.weekly_gpu_hours` (accounts differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kchain.chain.sessions import records
from kchain.errors import BudgetExceeded, CredentialsError, KaggleError
from kchain.job.spec import Job, load_job
from kchain.kaggle import credentials
from kchain.kaggle.client import KaggleClient, Quota
from kchain.store.ledger import (
    WEEK,
    Ledger,
    budget_document,
    budget_lines,
    iso,
    now_utc,
    sessions_needed,
    state_dir,
    week_start,
)


@dataclass
class Plan:
    accelerator: str
    session_limit_h: float
    expected_gpu_h: float
    used_h: float
    weekly_h: float  # the smaller of budget.weekly_gpu_hours and Kaggle's allowance
    budget_h: float | None = None  # budget.weekly_gpu_hours
    kaggle_h: float | None = None  # the allowance Kaggle reports for this account, if it does
    week_start: datetime | None = None
    refresh_reported: bool = False  # the week comes from Kaggle's refresh time, not the assumption
    margin_h: float = 0.25  # train.margin: the end of each session kept for its save and upload
    account: str | None = None  # the Kaggle account whose week used_h counts, every job folder's (account_of)

    @property
    def left_h(self) -> float:
        return max(0.0, self.weekly_h - self.used_h)

    @property
    def usable_h(self) -> float:
        """The training a session holds: its limit less the margin."""
        return self.session_limit_h - self.margin_h

    def sessions_for(self, train_h: float) -> int:
        """The sessions of a chain that trains `train_h` hours."""
        return sessions_needed(train_h, self.usable_h)

    def gpu_hours_for(self, train_h: float) -> float:
        """What such a chain spends of the week: its training, and each session's margin (a session that stops
        at its deadline runs to the limit; the last one ends with its final save and upload)."""
        if self.expected_gpu_h == 0:
            return 0.0
        return train_h + self.sessions_for(train_h) * self.margin_h

    @property
    def refresh(self) -> str:
        """When the week's quota comes back, in UTC (e.g. "Saturday 00:00 UTC")."""
        if self.week_start is None:
            return "Saturday 00:00 UTC"
        return (self.week_start + WEEK).strftime("%A %H:%M UTC")

    @property
    def weekly_source(self) -> str:
        """Which figure caps the week, as the refusal names it."""
        if self.kaggle_h is not None and self.kaggle_h < (self.budget_h or self.weekly_h):
            return f"Kaggle's weekly GPU quota for this account, {self.kaggle_h:g} h"
        return f"budget.weekly_gpu_hours {self.weekly_h:g}"

    def lines(self) -> list[str]:
        lines = [
            f"  accelerator    {self.accelerator}",
            f"  session limit  {self.session_limit_h:.2f} h",
            f"  expected       {self.expected_gpu_h:.2f} GPU-h this session",
            f"  this week      {self.used_h:.2f} GPU-h used, {self.left_h:.2f} of {self.weekly_h:g} left"
            + (f" (account {self.account}, every job folder on this laptop)" if self.account else ""),
        ]
        if self.kaggle_h is not None and self.budget_h is not None and self.kaggle_h != self.budget_h:
            lines.append(f"  weekly quota   Kaggle allows this account {self.kaggle_h:g} h, budget.weekly_gpu_hours "
                         f"is {self.budget_h:g} h: the smaller counts")
        if self.week_start is not None:
            said = "Kaggle's refresh time" if self.refresh_reported else "assumed: Kaggle reported no refresh time"
            lines.append(f"  quota week     from {iso(self.week_start)}, refreshes {self.refresh} ({said})")
        return lines


def _kaggle_quota(client: KaggleClient | None) -> Quota | None:
    if client is None:
        return None
    try:
        return client.quota_view()
    except (KaggleError, CredentialsError):
        return None  # the quota view is a second opinion; the ledger still counts


def account_of(job: Job, client: KaggleClient | None) -> str | None:
    """The Kaggle account whose week the job's sessions spend: its kernels' owner (kaggle.owner, else the
    credential's user, as the client knows it; offline, the configured API key's); None without one."""
    if job.kaggle.owner:
        return job.kaggle.owner
    if client is None:
        return credentials.configured_username()
    try:
        return client.username
    except CredentialsError:
        return None


def plan_for(job: Job, ledger: Ledger, client: KaggleClient | None = None) -> Plan:
    """The session's cost against the week: the account's hours (the ledger's, and those the account's other
    job folders noted, store/account.py) over the week Kaggle reports, or Kaggle's own count when it is
    higher; the week's total is the smaller of the job's budget and Kaggle's."""
    limit_h = job.train.session_limit_s / 3600
    answer = _kaggle_quota(client)
    refresh = datetime.fromtimestamp(answer.refresh, timezone.utc) if answer and answer.refresh else None
    start = week_start(now_utc(), refresh)
    user = account_of(job, client)
    used_h = ledger.gpu_hours_this_week(start=start, user=user)
    if answer is not None and answer.used_s is not None:
        used_h = max(used_h, answer.used_s / 3600)
    budget_h = job.budget.weekly_gpu_hours
    kaggle_h = answer.total_s / 3600 if answer is not None and answer.total_s else None
    return Plan(
        accelerator={"gpu": f"GPU T4 x2, {_ranks(job)} (NvidiaTeslaT4)", "tpu": "TPU v5e-8",
                     "none": "CPU"}[job.kaggle.accelerator],
        session_limit_h=limit_h,
        expected_gpu_h=limit_h if job.gpu else 0.0,
        used_h=used_h,
        weekly_h=min(budget_h, kaggle_h) if kaggle_h is not None else budget_h,
        budget_h=budget_h,
        kaggle_h=kaggle_h,
        week_start=start,
        refresh_reported=refresh is not None,
        margin_h=job.train.margin_s / 3600,
        account=user,
    )


def _ranks(job: Job) -> str:
    """train.gpus on a T4 x2 session: auto uses both GPUs (one rank each)."""
    return "1 rank" if job.train.gpus == 1 else "2 ranks"


@dataclass(frozen=True)
class Held:
    """GPU-hours of the week a push must leave alone (`kchain queue`: the slack, and what the queue's other
    running runs still have planned), and what they are, in words."""

    hours: float
    what: str
    fix: str  # how to let the session have them


def check_budget(job: Job, plan: Plan, force: bool, job_file: Path, held: Held | None = None) -> None:
    if job.gpu and held is not None and held.hours > 0 and plan.expected_gpu_h > plan.left_h - held.hours:
        raise BudgetExceeded(
            f"{job_file}: this session may use {plan.expected_gpu_h:.2f} GPU-h but {plan.left_h:.2f} are left this "
            f"week ({plan.weekly_source}) and {held.hours:.2f} of them are held back ({held.what}); {held.fix}"
        )
    if job.gpu and plan.expected_gpu_h > plan.left_h and not force:
        raise BudgetExceeded(
            f"{job_file}: this session may use {plan.expected_gpu_h:.2f} GPU-h but only {plan.left_h:.2f} "
            f"are left this week ({plan.weekly_source}); wait for {plan.refresh}, "
            "lower train.session_limit, or pass --force"
        )


def _week(job_file: Path) -> tuple[Plan, dict[str, Any], Ledger, Job]:
    """`kchain budget`: the week as push and doctor plan it (Kaggle's allowance, week and count where it
    answers; the ledger alone without credentials or an answer), session by session; an empty ledger is
    rebuilt from Kaggle first, as status does."""
    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    records(job, ledger)  # a chain another laptop ran: its sessions rebuilt from Kaggle, so their hours count
    client = KaggleClient(timeout_s=15, attempts=2)
    plan = plan_for(job, ledger, client)
    user = plan.account
    counted_h = ledger.gpu_hours_this_week(start=plan.week_start, user=user)
    kaggle_used_h = plan.used_h if plan.used_h > counted_h else None
    return plan, budget_document(ledger, plan.weekly_h, job.name, usable_session_h=plan.usable_h, start=plan.week_start,
                                 kaggle_used_h=kaggle_used_h,
                                 elsewhere=ledger.elsewhere(user, start=plan.week_start)), ledger, job


def budget_for(job_file: Path) -> list[str]:
    plan, week, ledger, job = _week(job_file)
    lines = budget_lines(ledger, plan.weekly_h, job.name, week=week, refresh=plan.refresh)
    if plan.kaggle_h is not None and plan.budget_h is not None and plan.kaggle_h < plan.budget_h:
        lines.insert(1, f"Kaggle allows this account {plan.kaggle_h:g} GPU-hours a week, fewer than "
                        f"budget.weekly_gpu_hours {plan.budget_h:g}: the smaller counts")
    return lines


def budget_document_for(job_file: Path) -> dict[str, Any]:
    return _week(job_file)[1]
