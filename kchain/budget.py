"""The week's GPU budget against a session: what it may cost (`plan_for`) and the refusal when the
quota left cannot cover it (`check_budget`). The ledger counts the hours; this plans with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kchain.errors import BudgetExceeded, KaggleError
from kchain.kaggle_api import KaggleClient
from kchain.ledger import Ledger
from kchain.spec import Job, parse_duration


@dataclass
class Plan:
    accelerator: str
    session_limit_h: float
    expected_gpu_h: float
    used_h: float
    weekly_h: float

    @property
    def left_h(self) -> float:
        return max(0.0, self.weekly_h - self.used_h)

    def lines(self) -> list[str]:
        return [
            f"  accelerator    {self.accelerator}",
            f"  session limit  {self.session_limit_h:.2f} h",
            f"  expected       {self.expected_gpu_h:.2f} GPU-h this session",
            f"  this week      {self.used_h:.2f} GPU-h used, {self.left_h:.2f} of {self.weekly_h:g} left",
        ]



def plan_for(job: Job, ledger: Ledger, client: KaggleClient | None = None) -> Plan:
    """The session's cost against the week: kchain's ledger, or Kaggle's own count when it is higher
    (GPU time spent outside kchain counts against the same quota)."""
    limit_h = parse_duration(job.train.session_limit) / 3600
    used_h = ledger.gpu_hours_this_week()
    if client is not None:
        try:
            quota = client.quota()
        except KaggleError:
            quota = None  # the quota view is a second opinion; the ledger still counts
        if quota is not None:
            used_h = max(used_h, quota["used_s"] / 3600)
    return Plan(
        accelerator={"gpu": f"GPU T4 x2, {_ranks(job)} (NvidiaTeslaT4)", "tpu": "TPU v5e-8",
                     "none": "CPU"}[job.kaggle.accelerator],
        session_limit_h=limit_h,
        expected_gpu_h=limit_h if job.gpu else 0.0,
        used_h=used_h,
        weekly_h=job.budget.weekly_gpu_hours,
    )



def _ranks(job: Job) -> str:
    """train.gpus on a T4 x2 session: auto uses both GPUs (one rank each)."""
    return "1 rank" if job.train.gpus == 1 else "2 ranks"



def check_budget(job: Job, plan: Plan, force: bool, job_file: Path) -> None:
    if job.gpu and plan.expected_gpu_h > plan.left_h and not force:
        raise BudgetExceeded(
            f"{job_file}: this session may use {plan.expected_gpu_h:.2f} GPU-h but only {plan.left_h:.2f} "
            f"are left this week (budget.weekly_gpu_hours {plan.weekly_h:g}); wait for Saturday 00:00 UTC, "
            "lower train.session_limit, or pass --force"
        )
