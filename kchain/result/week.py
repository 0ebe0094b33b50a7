"""`kchain week`: the run log of the quota week, one row per run: what changed from the run before, its best
metric and step, GPU-hours planned and spent, and for a failure the traceback's first line; then the week's
planned against spent, and the hours spare.

A run is a chain (the ledger keeps one per name, sessions.json): each run `kchain plan` planned (plan.json,
its chain name and --set), and each job given that the plan does not hold, under its own name; those with a
session this quota week or a plan. What changed is the params' difference (as session 1 recorded them at
its push; the job file's with the plan's --set for a run that has not started, or a chain older than the
record) and the code's fingerprint. The kept best is outcome.py's; the failure diagnose.py's, from the
session record. The records are the ledger's as they are: `kchain status` refreshes a chain from Kaggle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain.chain import outcome
from kchain.chain.budget import Plan, plan_for
from kchain.chain.plan import hours, plan_path, read_plan
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import LIVE
from kchain.common.summary import Status, Summary
from kchain.job import diagnose
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger, iso, now_utc, parse_iso, session_hours, state_dir

DONE = (Status.FINISHED, Status.STOPPED, "failed")  # a run that spends no more of its planned hours
_MISSING = object()


@dataclass(frozen=True)
class Wanted:
    """A run the week holds, before its records are read."""

    label: str  # the plan's r1, r2, ...; "-" for a job the plan does not hold
    chain: str
    job: Job
    sets: dict[str, Any]
    planned_h: float | None


@dataclass(frozen=True)
class Row:
    label: str
    chain: str
    status: str
    params: dict[str, Any] | None
    fingerprint: str | None
    best: str | None
    planned_h: float | None
    spent_h: float
    failure: str | None
    started: str | None  # the run's first session this week (ISO UTC), None before it starts
    change: str = ""


# -- pure: one row from a chain's records, the change between rows, the table ------------------------


def _status(chain: list[SessionRecord], said: outcome.Result) -> str:
    if not chain:
        return "planned"
    last = chain[-1]
    if said.ended:
        return said.ended
    if last.get("error"):
        return "failed"
    if last["status"] in LIVE:
        return f"session {last['session']} {last['status'].lower()}"
    return f"session {last['session']} {last.get('end_status') or last['status'].lower()}"


def _failure(chain: list[SessionRecord]) -> str | None:
    """The last session's failure as diagnose names it: the traceback's first line."""
    error = chain[-1].get("error") if chain else None
    found = diagnose.from_summary(Summary(error=error)) if error else None
    return found.one_line().splitlines()[0] if found else None


def _best(chain: list[SessionRecord], said: outcome.Result) -> str | None:
    """The kept best (train.keep_best), else the best validation value the last summary names."""
    if said.best:
        return outcome.best_words(said.best)
    for record in reversed(chain):
        best = Summary.from_dict(record.get("summary")).best
        if best:
            return outcome.best_words({"metric": best.get("name"), "value": best.get("value"), "step": best.get("step")})
    return None


def row_of(wanted: Wanted, chain: list[SessionRecord], week_start: str) -> Row:
    """The run's row: its sessions that started this quota week count as spent."""
    this_week = [r for r in chain if r.get("started") and parse_iso(r["started"]) >= parse_iso(week_start)]
    recorded = chain[0].get("params") if chain else None
    params = recorded if isinstance(recorded, dict) else {**wanted.job.params, **wanted.sets}
    said = outcome.of_chain(chain)
    return Row(wanted.label, wanted.chain, _status(chain, said), params,
               chain[0].get("fingerprint") if chain else None, _best(chain, said), wanted.planned_h,
               sum(session_hours(r) for r in this_week if r.get("gpu")), _failure(chain),
               min((r["started"] for r in this_week), default=None))


def change(before: Row | None, row: Row) -> str:
    """What this run changed from the one before: each param that differs, or the code's fingerprint."""
    if before is None:
        return "first run of the week"
    if before.params is None or row.params is None:
        return "params not recorded"
    diffs = []
    for key in dict.fromkeys([*before.params, *row.params]):
        was, now = before.params.get(key, _MISSING), row.params.get(key, _MISSING)
        if was != now:
            diffs.append(f"+{key}={now}" if was is _MISSING else f"-{key}" if now is _MISSING else f"{key} {was} -> {now}")
    if not diffs and before.fingerprint and row.fingerprint and before.fingerprint != row.fingerprint:
        diffs.append(f"code {before.fingerprint[:8]} -> {row.fingerprint[:8]}")
    if not diffs:
        return "no change" if row.fingerprint is None or before.fingerprint == row.fingerprint else "code"
    return ", ".join(diffs) + (f" ({len(diffs)} changes in one run)" if len(diffs) > 1 else "")


def ordered(rows: list[Row]) -> list[Row]:
    """By when each run started (runs not started yet last, in the plan's order), each with its change."""
    rows = sorted(rows, key=lambda r: (r.started is None, r.started or ""))
    out: list[Row] = []
    for row in rows:
        out.append(dataclasses.replace(row, change=change(out[-1] if out else None, row)))
    return out


def _h(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[Row], totals: dict[str, Any]) -> list[str]:
    lines = [f"quota week from {totals['week_start']} (refreshes {totals['refresh']})",
             f"{'run':<4} {'chain':<24} {'status':<18} {'best':<32} {'planned':>7} {'spent':>6}  change"]
    for r in rows:
        lines.append(f"{r.label:<4} {r.chain:<24} {r.status:<18} {r.best or '-':<32} {_h(r.planned_h):>7} "
                     f"{r.spent_h:>6.2f}  {r.change}")
        if r.failure:
            lines.append(f"{'':<4} failed: {r.failure}")
    lines.append(f"planned {_h(totals['planned'])} GPU-h, spent {totals['spent']:.2f} on these runs; this week "
                 f"{totals['used']:.2f} of {totals['weekly_gpu_hours']:g} used, {totals['spare']:.2f} spare, "
                 f"{totals['spare_after_plan']:.2f} once the runs still going spend what was planned"
                 + (f" ({totals['slack']:.2f} of it the plan's slack)" if totals["slack"] else ""))
    if not rows:
        lines.append("no run this week: `kchain plan` plans the week, `kchain push` starts a run")
    return lines


def document(rows: list[Row], totals: dict[str, Any]) -> dict[str, Any]:
    """`kchain week --json` (README, Machine-readable output)."""
    return {**totals, "runs": [{"run": r.label, "chain": r.chain, "status": r.status, "change": r.change,
                                "params": r.params, "fingerprint": r.fingerprint, "best": r.best,
                                "planned_gpu_hours": r.planned_h, "spent_gpu_hours": r.spent_h,
                                "failure": r.failure, "started": r.started} for r in rows]}


# -- I/O: the plan, the jobs, the ledger ----------------------------------------------------------


def wanted_runs(jobs: list[Job], plan: dict[str, Any] | None) -> list[Wanted]:
    """The plan's runs of these jobs, then each job the plan does not hold as its own run."""
    by_file = {str(job.path.resolve()): job for job in jobs}
    out = [Wanted(str(r.get("run")), str(r.get("chain")), by_file[r["job"]], dict(r.get("sets") or {}),
                  hours(r.get("gpu_hours")))
           for r in (plan or {}).get("runs", []) if isinstance(r, dict) and r.get("job") in by_file]
    planned = {w.job.path.resolve() for w in out}
    return out + [Wanted("-", job.name, job, {}, None) for job in jobs if job.path.resolve() not in planned]


def week_of(job_files: list[Path], plan_file: Path | None = None) -> tuple[list[Row], dict[str, Any]]:
    """The week's rows and totals for these jobs (the plan beside the first job, or plan_file)."""
    jobs = [load_job(f) for f in job_files]
    path = plan_file if plan_file is not None else plan_path(job_files[0])
    plan = read_plan(path)
    week: Plan = plan_for(jobs[0], Ledger(state_dir(jobs[0].path)), KaggleClient(timeout_s=15, attempts=2))
    start = iso(week.week_start or now_utc())
    rows = []
    for wanted in wanted_runs(jobs, plan):
        row = row_of(wanted, Ledger(state_dir(wanted.job.path)).sessions(wanted.chain), start)
        if row.started is not None or row.planned_h is not None:
            rows.append(row)
    planned = [r.planned_h for r in rows if r.planned_h is not None]
    to_spend = sum(max(0.0, (r.planned_h or 0.0) - r.spent_h) for r in rows if r.status not in DONE)
    totals = {"week_start": start, "refresh": week.refresh, "weekly_gpu_hours": week.weekly_h, "used": week.used_h,
              "spare": week.left_h, "slack": hours((plan or {}).get("week", {}).get("slack")) or 0.0,
              "spare_after_plan": max(0.0, week.left_h - to_spend),
              "planned": sum(planned) if planned else None, "spent": sum((r.spent_h for r in rows), 0.0),
              "plan": str(path) if plan else None}
    return ordered(rows), totals
