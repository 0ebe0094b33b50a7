"""`kchain plan`: the week's runs sized from measured speed, placed on Kaggle's two GPU slots, against the
quota week's allowance with a slack held back for the mistake not yet made.

Two halves. The arithmetic is pure (`Run`, `Week`, `place`, `advice`, `document`, `table`): hours from
steps and a pace, each run's sessions and GPU-hours as budget.py's `Plan` counts them for one job
(`sessions_for`, `gpu_hours_for`), the earliest free slot for each run in order, and which run to drop or
shorten when the week cannot hold them. The I/O (`make_plan`, `plan_jobs`) reads the measurements: a run's
seconds per step are its chain's own Kaggle pace where a session measured one, else the smoke's pace on
this laptop (ledger.smoke_measured) times a device factor (`--factor`, or another chain's Kaggle pace over
its smoke's, from the ledger; 1 where nothing measured one, said as assumed). Its steps are `--steps`, or
the loop's total as the smoke or a session asked for it, followed through the param that held it (a
`--set steps=4000` variant plans 4000). The plan is written atomically as JSON (`PLAN_FILE`, FORMAT) only
when it fits: a list of runs, each with its job file, --set overrides, chain name, sessions, slot and hours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from kchain.chain.budget import Plan, plan_for
from kchain.common import atomic
from kchain.common.summary import Summary
from kchain.errors import BudgetExceeded, SpecError
from kchain.job.render import render_job
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import PLAN_FILE, Ledger, iso, now_utc, state_dir
from kchain.store.names import MAX_NAME

FORMAT = "kchain-plan/1"
GPU_SLOTS = 2  # Kaggle runs at most two GPU sessions per account at once (shared/reference/kaggle-api.md 9)
Echo = Callable[[str], None]


# -- the arithmetic (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pace:
    seconds_per_step: float  # on Kaggle's GPU, as planned
    source: str  # where it comes from, as the table says it


@dataclass(frozen=True)
class Run:
    """One run of the week: a chain of one job with its overrides."""

    label: str  # r1, r2, ... in the order given
    job_file: str  # the job file, absolute
    chain: str  # the chain's (kernel's) name: the job's own for its only run, else <name>-<n>
    sets: dict[str, Any]  # --set (and --seeds) over the job's params
    steps: int
    steps_source: str
    pace: Pace
    cost: Plan  # the job's session arithmetic (budget.plan_for)

    def train_h(self, steps: int | None = None) -> float:
        return (self.steps if steps is None else steps) * self.pace.seconds_per_step / 3600

    @property
    def session_count(self) -> int:
        return self.cost.sessions_for(self.train_h())

    @property
    def gpu_h(self) -> float:
        return self.cost.gpu_hours_for(self.train_h())

    @property
    def gpu(self) -> bool:
        return self.cost.expected_gpu_h > 0

    def steps_within(self, hours: float) -> int:
        """The most steps whose chain spends at most `hours` GPU-hours (0 when none fit)."""
        low, high = 0, self.steps
        while low < high:
            mid = (low + high + 1) // 2
            if self.cost.gpu_hours_for(self.train_h(mid)) <= hours:
                low = mid
            else:
                high = mid - 1
        return low

    def words(self) -> str:
        sets = " ".join(f"{k}={v}" for k, v in self.sets.items())
        return f"{self.label} ({self.chain}{', ' + sets if sets else ''}; {self.gpu_h:.2f} GPU-h)"


@dataclass(frozen=True)
class Week:
    """The quota week the plan spends, as budget.plan_for reads it."""

    weekly_h: float
    weekly_source: str
    used_h: float
    slack_h: float
    slack_source: str
    start: datetime
    refresh: str  # when the quota comes back, in words
    now: datetime

    @property
    def left_h(self) -> float:
        return max(0.0, self.weekly_h - self.used_h)

    @property
    def plannable_h(self) -> float:
        return max(0.0, self.left_h - self.slack_h)


@dataclass(frozen=True)
class Placed:
    run: Run
    slot: int | None  # 1 or 2; None for a CPU run (it holds no GPU slot)
    start_h: float  # hours from now
    end_h: float


def place(runs: list[Run], slots: int = GPU_SLOTS) -> list[Placed]:
    """Each run in order on the slot that is free earliest; a chain's sessions follow each other in it."""
    free = [0.0] * slots
    out = []
    for run in runs:
        if not run.gpu:
            out.append(Placed(run, None, 0.0, run.train_h()))
            continue
        slot = min(range(slots), key=lambda k: (free[k], k))
        start, free[slot] = free[slot], free[slot] + run.gpu_h
        out.append(Placed(run, slot + 1, start, free[slot]))
    return out


def advice(runs: list[Run], week: Week) -> str | None:
    """None when the runs fit the plannable hours; else which to drop (the last ones given) or shorten."""
    total = sum(r.gpu_h for r in runs)
    if total <= week.plannable_h + 1e-9:
        return None
    if week.plannable_h <= 0:
        return f"nothing can be planned before the quota refreshes {week.refresh}; wait, or lower budget.slack"
    kept, dropped = list(runs), list[Run]()
    while kept and sum(r.gpu_h for r in kept) > week.plannable_h + 1e-9:
        dropped.insert(0, kept.pop())
    first, rest = dropped[0], dropped[1:]
    text = "drop " + ", ".join(r.words() for r in dropped)
    shorter = first.steps_within(week.plannable_h - sum(r.gpu_h for r in kept))
    if shorter > 0:
        text += f", or shorten {first.label} to {shorter} steps (--steps or its params)"
        text += f" and drop {', '.join(r.label for r in rest)}" if rest else ""
    return text


def refusal(runs: list[Run], week: Week, said: str, where: str) -> str:
    total = sum(r.gpu_h for r in runs)
    return (f"{where}: the plan needs {total:.2f} GPU-h but {week.plannable_h:.2f} can be planned this week "
            f"({week.weekly_source}, {week.used_h:.2f} used, {week.slack_h:.2f} held back as slack): {said}")


def document(placed: list[Placed], week: Week) -> dict[str, Any]:
    """The plan as plan.json holds it and `--json` prints it (README, Machine-readable output)."""
    total = sum(p.run.gpu_h for p in placed)
    return {
        "format": FORMAT, "made": iso(week.now), "slots": GPU_SLOTS,
        "week": {"start": iso(week.start), "refresh": week.refresh, "weekly_gpu_hours": week.weekly_h,
                 "weekly_source": week.weekly_source, "used": week.used_h, "left": week.left_h,
                 "slack": week.slack_h, "slack_source": week.slack_source, "plannable": week.plannable_h},
        "planned_gpu_hours": total, "spare": week.plannable_h - total,
        "runs": [{"run": p.run.label, "job": p.run.job_file, "chain": p.run.chain, "sets": p.run.sets,
                  "steps": p.run.steps, "steps_from": p.run.steps_source,
                  "seconds_per_step": p.run.pace.seconds_per_step, "pace_from": p.run.pace.source,
                  "session_limit_h": p.run.cost.session_limit_h, "sessions": p.run.session_count,
                  "gpu_hours": p.run.gpu_h, "slot": p.slot, "start_h": p.start_h, "end_h": p.end_h,
                  "ends": iso(week.now + timedelta(hours=p.end_h))} for p in placed],
    }


def _when(now: datetime, hours: float) -> str:
    return (now + timedelta(hours=hours)).strftime("%a %d %b %H:%M UTC")


def table(placed: list[Placed], week: Week) -> list[str]:
    """The plan a person reads at a glance: one row per run, the measurements as notes, the week."""
    notes: dict[str, int] = {}
    lines = [f"plan: {len(placed)} run(s) on Kaggle's {GPU_SLOTS} GPU slots, quota week from {iso(week.start)} "
             f"(refreshes {week.refresh})",
             f"{'run':<4} {'chain':<24} {'--set':<24} {'steps':>7} {'s/step':>8} {'note':<4} {'sessions':>8} "
             f"{'GPU-h':>6} {'slot':>4}  ends"]
    for p in placed:
        note = f"pace {p.run.pace.source}; steps {p.run.steps_source}"
        mark = notes.setdefault(note, len(notes) + 1)
        sets = " ".join(f"{k}={v}" for k, v in p.run.sets.items()) or "-"
        lines.append(f"{p.run.label:<4} {p.run.chain:<24} {sets[:24]:<24} {p.run.steps:>7} "
                     f"{p.run.pace.seconds_per_step:>8.3g} {f'[{mark}]':<4} {p.run.session_count:>8} {p.run.gpu_h:>6.2f} "
                     f"{p.slot or 'cpu':>4}  {_when(week.now, p.end_h)} (+{p.end_h:.1f} h)")
    lines += [f"[{mark}] {note}" for note, mark in notes.items()]
    total = sum(p.run.gpu_h for p in placed)
    last = max((p.end_h for p in placed), default=0.0)
    lines.append(f"week: {week.weekly_h:g} GPU-h ({week.weekly_source}), {week.used_h:.2f} used, {week.left_h:.2f} "
                 f"left; {week.slack_h:.2f} held back as slack ({week.slack_source}); {week.plannable_h:.2f} plannable")
    lines.append(f"planned {total:.2f} GPU-h, {week.plannable_h - total:.2f} spare beside the slack; the last run "
                 f"ends {_when(week.now, last)}"
                 + (f", after the quota refreshes {week.refresh}" if week.now + timedelta(hours=last)
                    > week.start + timedelta(days=7) else ""))
    return lines


# -- the measurements and the runs (I/O) -----------------------------------------------------------


def variants(sets: list[tuple[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """--set lr=3e-4 --set lr=1e-3 --set batch=16 -> every combination of each key's values (two runs, batch
    16 in both), then each with every seed of --seeds (params.seed; the command refuses --set seed beside it)."""
    values: dict[str, list[Any]] = {}
    for key, value in sets:
        values.setdefault(key, []).append(value)
    if seeds:
        values["seed"] = list(seeds)
    return [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]


def _chain_pace(chain: list[Any]) -> tuple[float, Summary, int] | None:
    """A chain's newest Kaggle GPU pace: (steps/s, its summary, the session's number)."""
    for record in reversed(chain):
        summary = Summary.from_dict(record.get("summary"))
        if record.get("gpu") and summary.steps_per_s:
            return summary.steps_per_s, summary, record["session"]
    return None


def _factor(ledger: Ledger, given: float | None) -> tuple[float, str]:
    """The laptop-to-Kaggle factor on seconds per step: given, measured by a chain with both paces, or 1."""
    if given is not None:
        return given, f"x{given:g} (--factor)"
    both = []
    for name, chain in ledger.all_sessions().items():
        kaggle, smoked = _chain_pace(chain), ledger.smoke_measured(name)
        if kaggle and smoked:
            started = max((r.get("started") or "" for r in chain), default="")
            both.append((started, smoked["steps_per_s"] / kaggle[0], name))
    if both:
        _, factor, name = max(both)
        return factor, f"x{factor:.3g} ({name}'s Kaggle pace over its smoke's, in the ledger)"
    return 1.0, "x1 assumed (no chain has measured a Kaggle pace yet; pass --factor)"


def _total(total: int | None, measured_with: dict[str, Any], run_params: dict[str, Any],
           where: str) -> tuple[int | None, str]:
    """The run's steps from a measured loop total: through the one param that held it, else as measured
    where the run's params are the measurement's."""
    if not total:
        return None, where
    held = [k for k, v in measured_with.items() if type(v) is int and v == total]
    if len(held) == 1 and type(run_params.get(held[0])) is int:
        return run_params[held[0]], f"params.{held[0]} ({where}'s loop total was its value)"
    return (total, f"{where}'s loop total") if measured_with == run_params else (None, where)


def measure(job: Job, ledger: Ledger, chain: str, sets: dict[str, Any], factor: float | None,
            steps: int | None) -> tuple[Pace, int, str]:
    """A run's pace and steps from what was measured (its own chain's sessions first, then the job's chain's);
    SpecError naming the command that measures them."""
    params = {**job.params, **sets}
    name = next((n for n in (chain, job.name) if _chain_pace(ledger.sessions(n))), job.name)
    kaggle = _chain_pace(ledger.sessions(name))
    smoked = ledger.smoke_measured(job.name, render_job(job).fingerprint)
    if kaggle is not None:
        pace = Pace(1 / kaggle[0], f"Kaggle session {kaggle[2]} of {name}")
        first = ledger.sessions(name)[0].get("params")
        total, source = _total(kaggle[1].total_asked or kaggle[1].total, first if isinstance(first, dict)
                               else job.params, params, f"session {kaggle[2]}")
    elif smoked is not None:
        scale, said = _factor(ledger, factor)
        pace = Pace(scale / smoked["steps_per_s"], f"smoke {smoked['run_id']} on this laptop "
                    f"({1 / smoked['steps_per_s']:.3g} s/step) {said}")
        total, source = _total(smoked.get("total"), {**job.params, **job.smoke.params, **(smoked.get("sets") or {})},
                               params, "the smoke")
    else:
        raise SpecError(f"{job.path}: no pace measured for {job.name}: run `kchain smoke {job.path}` first")
    if steps is not None:
        return pace, steps, "--steps"
    if total is None:
        raise SpecError(f"{job.path}: the steps of {job.name} with {sets or 'its params'} are not known from "
                        f"{source}: pass --steps N")
    return pace, total, source


def _chains(job: Job, count: int) -> list[str]:
    """The chain name of each of a job's runs: its own for one run; <name>-<n> (Kaggle's length) for several."""
    if count == 1:
        return [job.name]
    return [f"{job.name[:MAX_NAME - len(str(n)) - 1].rstrip('-')}-{n}" for n in range(1, count + 1)]


def _slack(jobs: list[tuple[Job, Plan]]) -> tuple[float, str]:
    """The most any job holds back: its budget.slack, else one session of it."""
    options = [(job.budget.slack, f"budget.slack of {job.name}") if job.budget.slack is not None
               else (plan.expected_gpu_h, f"one session: train.session_limit of {job.name}") for job, plan in jobs]
    return max(options, key=lambda o: o[0])


def asked(jobs: list[Job], sets: list[tuple[str, Any]], seeds: list[int]) -> list[tuple[Job, str, dict[str, Any]]]:
    """The runs asked for, in order, before anything is measured: each job's variants with their chain names."""
    wanted = variants(sets, seeds)
    return [(job, chain, run_sets) for job in jobs
            for chain, run_sets in zip(_chains(job, len(wanted)), wanted, strict=True)]


def make_plan(job_files: list[Path], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None = None,
              factor: float | None = None, client: KaggleClient | None = None) -> tuple[list[Placed], Week]:
    """Every run of every job, measured and placed, and the week it spends (the tightest job's)."""
    loaded = [load_job(f) for f in job_files]
    costs = [(job, plan_for(job, Ledger(state_dir(job.path)), client)) for job in loaded]
    cost_of = {id(job): cost for job, cost in costs}
    runs: list[Run] = []
    for job, chain, run_sets in asked(loaded, sets, seeds):
        pace, total, source = measure(job, Ledger(state_dir(job.path)), chain, run_sets, factor, steps)
        runs.append(Run(f"r{len(runs) + 1}", str(job.path.resolve()), chain, run_sets, total, source, pace,
                        cost_of[id(job)]))
    tight = min(costs, key=lambda c: c[1].left_h)[1]
    slack_h, slack_source = _slack(costs)
    week = Week(tight.weekly_h, tight.weekly_source, tight.used_h, slack_h, slack_source,
                tight.week_start or now_utc(), tight.refresh, now_utc())
    return place(runs), week


def plan_path(job_file: Path, out: Path | None = None) -> Path:
    """Where the plan is written: the folder the user names, else the first job's state folder."""
    return (out if out is not None else state_dir(load_job(job_file).path)) / PLAN_FILE


def read_plan(path: Path) -> dict[str, Any] | None:
    """A plan.json `kchain plan` wrote; None when there is none (a damaged one is refused with its path)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: not a plan `kchain plan` wrote ({str(exc)[:80]}); run `kchain plan` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("runs"), list):
        raise SpecError(f"{path}: not a {FORMAT} plan; run `kchain plan` again")
    return data


def checked_plan(job_files: list[Path], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
                 factor: float | None, client: KaggleClient | None) -> tuple[list[Placed], Week]:
    """make_plan's runs and week; BudgetExceeded, naming what to drop, when the week cannot hold them."""
    placed, week = make_plan(job_files, sets, seeds, steps, factor, client)
    runs = [p.run for p in placed]
    said = advice(runs, week)
    if said is not None:
        raise BudgetExceeded(refusal(runs, week, said, str(job_files[0])))
    return placed, week


def plan_jobs(job_files: list[Path], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
              factor: float | None, out: Path | None) -> tuple[dict[str, Any], list[str], Path]:
    """`kchain plan`: the plan written (atomically) and its table; BudgetExceeded, before anything is written or
    pushed, when the week cannot hold it."""
    placed, week = checked_plan(job_files, sets, seeds, steps, factor, KaggleClient(timeout_s=15, attempts=2))
    doc = document(placed, week)
    path = plan_path(job_files[0], out)
    atomic.write_json(path, doc)
    return doc, table(placed, week), path


def hours(value: Any) -> float | None:
    """A planned figure read back from plan.json: a finite number, else None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
