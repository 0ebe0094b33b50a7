"""`kchain queue`: the week's plan run without a person, each run its own chain, on Kaggle's two GPU slots.

The plan is `kchain plan`'s (chain/plan.py: refused before anything is pushed when the week cannot hold it).
The queue keeps it in `queue.json` beside the first job (QUEUE_FILE, written atomically after every change),
each run with its state (RunState) and the slot it holds, so a queue stopped (the laptop shut, Ctrl-C) goes on
where it was when `kchain queue` runs again. Each poll, in order:

- every running run's chain takes one step, as `continue --watch` takes it (advance.decide_and_continue):
  a session that ended is followed by the next in the same slot; a finished chain frees its slot. A run
  holds its slot between its sessions too, so the next session of a run never meets a third live session.
  A next session is refused (the run stops, its state saved) when it would reach into the hours the queue
  holds back (`held`): the slack, unless --use-slack, and what the other running runs still have planned.
- a run whose chain stopped for a person (a crash: the same-crash guard of common/nextsession.py never
  pushes the same code again; no progress; the quota) is STOPPED: its planned hours not yet spent go back to
  the queue, not to a retry of the same bug, and --notify hears of it (needs_person).
- the waiting runs start in the plan's order in the free slots: GPU_SLOTS, fewer when the account's other
  chains on this laptop hold a GPU session or Kaggle refuses a push at the account's cap (SessionCapReached:
  the run waits). A run starts only when its planned hours fit what is left of the week beside the slack and
  the running runs' planned hours; while a run is going the next waits for it, and once none is, a run that
  still cannot fit is SKIPPED, so the slack is never planned into.

The arithmetic (`free_slots`, `held_h`, `fits`) is pure; the loop (`run`) does the I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from kchain.chain import advance
from kchain.chain.budget import Held, plan_for
from kchain.chain.notify import FINISHED, NEEDS_PERSON, QUEUE_ENDED, SESSION_ENDED, Notify, nobody
from kchain.chain.plan import GPU_SLOTS, asked, hours, plan_jobs
from kchain.chain.push import push_job, reconcile
from kchain.common import atomic
from kchain.common.sessionstate import LIVE
from kchain.errors import BudgetExceeded, ChainStop, CredentialsError, KaggleError, NotSmoked, SpecError
from kchain.job.render import render_job
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient, SessionCapReached
from kchain.kaggle.credentials import configured_username
from kchain.store.ledger import (
    LONGEST_SESSION_H,
    QUEUE_FILE,
    Ledger,
    iso,
    now_utc,
    parse_iso,
    session_hours,
    state_dir,
)

FORMAT = "kchain-queue/1"
Echo = Callable[[str], None]


class RunState(StrEnum):
    WAITING = "waiting"  # not started: waits for a slot and for its hours
    RUNNING = "running"  # its chain holds a slot, between its sessions too
    FINISHED = "finished"  # its chain finished (or the loop stopped on purpose)
    STOPPED = "stopped"  # its chain stopped for a person: a crash, no progress, the quota
    SKIPPED = "skipped"  # never started: its hours would reach into the slack


DONE = (RunState.FINISHED, RunState.STOPPED, RunState.SKIPPED)


@dataclass
class QueuedRun:
    label: str  # the plan's r1, r2, ...
    job_file: str
    chain: str
    sets: dict[str, Any]
    planned_h: float
    sessions: int
    state: RunState = RunState.WAITING
    slot: int | None = None
    said: str = ""  # its last word: why it waits, stopped or was skipped; how it finished
    spent_h: float = 0.0  # the GPU-hours its chain's sessions spent since the queue began
    started: str | None = None
    ended: str | None = None

    def left_h(self) -> float:
        """Its planned hours not spent yet: what it holds while it runs, and gives back when it stops."""
        return max(0.0, self.planned_h - self.spent_h)


@dataclass
class Queue:
    runs: list[QueuedRun]
    slack_h: float
    slack_source: str
    use_slack: bool
    made: str
    events: list[str] = field(default_factory=list)  # one line per start, stop and end, oldest first

    def document(self) -> dict[str, Any]:
        return {"format": FORMAT, "made": self.made, "slack": self.slack_h, "slack_source": self.slack_source,
                "use_slack": self.use_slack, "slots": GPU_SLOTS, "events": self.events,
                "runs": [{**asdict(r), "state": str(r.state)} for r in self.runs]}

    @classmethod
    def from_document(cls, data: dict[str, Any], where: Path) -> Queue:
        try:
            runs = [QueuedRun(**{**r, "state": RunState(r["state"])}) for r in data["runs"]]
            return cls(runs, float(data["slack"]), str(data["slack_source"]), bool(data["use_slack"]),
                       str(data["made"]), list(data.get("events") or []))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"{where}: not a queue `kchain queue` wrote ({str(exc)[:80]}); move it away and "
                            "run `kchain queue` again (the chains stay in the ledger)") from None

    @property
    def done(self) -> bool:
        return all(r.state in DONE for r in self.runs)


# -- the arithmetic (pure) ------------------------------------------------------------------------


def free_slots(runs: list[QueuedRun], busy_elsewhere: int, slots: int = GPU_SLOTS) -> list[int]:
    """The slot numbers (1..slots) a waiting run may take: not held by a running run, less as many as the
    account's sessions outside the queue hold (the highest numbers go first)."""
    held = {r.slot for r in runs if r.state == RunState.RUNNING}
    free = [n for n in range(1, slots + 1) if n not in held]
    return free[:max(0, len(free) - busy_elsewhere)]


def held_h(runs: list[QueuedRun], besides: QueuedRun | None, slack_h: float, use_slack: bool) -> float:
    """The hours a push for `besides` must leave: the other running runs' planned hours not spent yet, and
    the slack unless --use-slack."""
    others = sum(r.left_h() for r in runs if r.state == RunState.RUNNING and r is not besides)
    return others + (0.0 if use_slack else slack_h)


def fits(run: QueuedRun, left_h: float, held: float) -> bool:
    """A waiting run may start: its planned hours fit what the week has left beside what is held."""
    return run.planned_h <= left_h - held + 1e-9


# -- the queue on disk ----------------------------------------------------------------------------


def queue_path(job_file: Path) -> Path:
    return state_dir(load_job(job_file).path) / QUEUE_FILE


def has_chain(job_file: Path) -> bool:
    """The job under its own name has a chain in its ledger (a queue of several runs gives each its own name)."""
    job = load_job(job_file)
    return bool(Ledger(state_dir(job.path)).sessions(job.name))


def read(path: Path) -> Queue | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: not a queue `kchain queue` wrote ({str(exc)[:80]}); move it away and run "
                        "`kchain queue` again (the chains stay in the ledger)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecError(f"{path}: not a {FORMAT} queue; move it away and run `kchain queue` again")
    return Queue.from_document(data, path)


def save(queue: Queue, path: Path) -> None:
    atomic.write_json(path, queue.document())


def from_plan(doc: dict[str, Any], use_slack: bool) -> Queue:
    """A new queue of a plan `kchain plan` made (plan.document): every run waiting, in its order."""
    runs = [QueuedRun(r["run"], r["job"], r["chain"], dict(r["sets"]), hours(r["gpu_hours"]) or 0.0,
                      int(r["sessions"])) for r in doc["runs"]]
    week = doc["week"]
    return Queue(runs, float(week["slack"]), str(week["slack_source"]), use_slack, iso(now_utc()))


def same_runs(queue: Queue, wanted: list[tuple[str, dict[str, Any]]]) -> bool:
    """The command asks for the runs the queue holds (the same chains with the same --set, in order)."""
    return [(r.chain, r.sets) for r in queue.runs] == wanted


def open_queue(job_files: list[Path], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
               factor: float | None, use_slack: bool) -> tuple[Queue, Path, list[str]]:
    """The queue to run and the lines that introduce it: the one beside the first job going on, when it is not
    done and the plan asks for its runs; else a new one of a plan that fits the week (plan.plan_jobs: refused,
    before anything is pushed, naming what to drop)."""
    path = queue_path(job_files[0])
    going = read(path)
    if going is not None and not going.done:
        wanted = [(chain, run_sets) for _job, chain, run_sets in asked([load_job(f) for f in job_files], sets, seeds)]
        if not same_runs(going, wanted):
            raise SpecError(f"{path}: a queue of {len(going.runs)} other run(s) is not done "
                            f"({summary_line(going)}); run `kchain queue` with its jobs and --set again to go on, "
                            "or move the file away to start this one (the chains stay in the ledger)")
        going.use_slack = use_slack
        return going, path, [f"queue: going on with {path}: {summary_line(going)}"]
    doc, table, _plan_file = plan_jobs(job_files, sets, seeds, steps, factor, None)
    queue = from_plan(doc, use_slack)
    save(queue, path)
    return queue, path, [*table, f"queue: {len(queue.runs)} run(s) kept in {path}"]


def run_job(run: QueuedRun) -> Job:
    """The job a run pushes: the job file's, under the run's chain name, its --set over the params."""
    job = load_job(run.job_file)
    return job.model_copy(update={"name": run.chain, "params": {**job.params, **run.sets}})


def job_of_run(job_file: Path, label: str) -> Job:
    """The job of run `label` of the job's queue (`kchain pull --run r2`); SpecError naming the runs there are."""
    path = queue_path(job_file)
    queue = read(path)
    if queue is None:
        raise SpecError(f"{job_file}: --run {label}: this job has no queue ({path}); `kchain queue {job_file}` runs one")
    found = [r for r in queue.runs if r.label == label]
    if not found:
        raise SpecError(f"{path}: --run {label}: the queue's runs are {', '.join(r.label for r in queue.runs)}")
    return run_job(found[0])


def unsmoked(queue: Queue) -> list[tuple[QueuedRun, Job]]:
    """The waiting runs whose code with their params never passed a smoke run (each is its own kernel)."""
    out = []
    for run in queue.runs:
        if run.state != RunState.WAITING:
            continue
        job = run_job(run)
        rendered = render_job(job, owner=job.kaggle.owner or configured_username())
        if Ledger(state_dir(job.path)).smoke_passed(rendered.fingerprint) is None:
            out.append((run, job))
    return out


# -- the loop (I/O) -------------------------------------------------------------------------------


@dataclass
class Loop:
    """What `run` needs beside the queue: where it is kept, the client, and how it speaks."""

    path: Path
    client: KaggleClient
    echo: Echo = print
    notify_for: Callable[[str], Notify] = lambda _chain: nobody  # the run's chain -> its notifier
    skip_smoke: bool = False
    poll_s: float = 30.0
    max_failures: int = 8
    job_of: Callable[[QueuedRun], Job] = run_job  # the job a run pushes (a rehearsal's: its short sessions)


def _spent(ledger: Ledger, run: QueuedRun, since: str) -> float:
    """The GPU-hours the run's chain spent in sessions that started since the queue began."""
    return sum(session_hours(s) for s in ledger.sessions(run.chain)
               if s.get("gpu") and s.get("started") and parse_iso(s["started"]) >= parse_iso(since))


def most_at_once(sessions: list[dict[str, Any]]) -> int:
    """The most GPU sessions that ran at one moment, from the local Kaggle's records (`started` and `ended`,
    epoch seconds; one not ended yet counts as running still)."""
    edges = sorted([(float(s["started"]), 1) for s in sessions if s.get("gpu") and s.get("started")]
                   + [(float(s.get("ended") or "inf"), -1) for s in sessions if s.get("gpu") and s.get("started")],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same moment
    most = now = 0
    for _, change in edges:
        now += change
        most = max(most, now)
    return most


def _busy_elsewhere(ledger: Ledger, queue: Queue, user: str | None, moment: datetime | None = None) -> int:
    """Live GPU sessions of the account outside the queue: this ledger's other chains, and those the
    account's other job folders noted (store/account.py). A record still live that started longer ago than a
    session can last (LONGEST_SESSION_H: nobody looked since it ended) holds no slot."""
    since = (moment or now_utc()) - timedelta(hours=LONGEST_SESSION_H)
    ours = {r.chain for r in queue.runs}
    here = [s for name, chain in ledger.all_sessions().items() if name not in ours for s in chain if s.get("gpu")]
    return sum(1 for s in [*here, *ledger.elsewhere(user)] if s.get("status") in LIVE
               and ((began := s.get("started") or s.get("requested")) is None or parse_iso(str(began)) >= since))


def _say(queue: Queue, loop: Loop, text: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] queue: {text}"
    queue.events.append(f"{iso(now_utc())} {text}")
    loop.echo(line)


def _end(queue: Queue, loop: Loop, run: QueuedRun, state: RunState, said: str) -> None:
    run.state, run.said, run.ended, slot = state, said, iso(now_utc()), run.slot
    run.slot = None
    back = f"; its {run.left_h():.2f} planned GPU-h not spent go back to the queue" if state == RunState.STOPPED else ""
    _say(queue, loop, f"{run.label} ({run.chain}) {state}" + (f", slot {slot} free" if slot else "") + f": {said}{back}")
    session = (Ledger(state_dir(Path(run.job_file))).sessions(run.chain) or [{}])[-1].get("session")
    loop.notify_for(run.chain)(FINISHED if state == RunState.FINISHED else NEEDS_PERSON,
                               f"{run.label} {state}: {said}{back}", session)


def _advance(queue: Queue, loop: Loop, run: QueuedRun, ledger: Ledger) -> None:
    """One step of a running run's chain (advance.decide_and_continue), its end recorded."""
    job = loop.job_of(run)
    held = Held(held_h(queue.runs, run, queue.slack_h, queue.use_slack),
                "the queue's slack and its other runs' planned hours",
                "the run stops here with its state saved: `kchain queue --use-slack` lets it spend the slack")
    try:
        verdict = advance.decide_and_continue(job, ledger, loop.client, skip_smoke=loop.skip_smoke,
                                              echo=lambda s: loop.echo(f"  {run.label}: {s}"), held=held,
                                              named=f"{run.job_file} --run {run.label}")
    except (ChainStop, NotSmoked, BudgetExceeded) as exc:
        return _end(queue, loop, run, RunState.STOPPED, str(exc))
    except SessionCapReached as exc:
        run.said = f"its next session waits for a slot: {exc}"
        return
    if verdict.action == "finished":
        _end(queue, loop, run, RunState.FINISHED, verdict.message)
    elif verdict.action == "pushed":
        _say(queue, loop, f"{run.label} ({run.chain}) in slot {run.slot}: {verdict.message}")
        session = verdict.record["session"] if verdict.record else None
        loop.notify_for(run.chain)(SESSION_ENDED, f"{run.label}: {verdict.message}", session)
    else:
        run.said = verdict.message


def _start(queue: Queue, loop: Loop, run: QueuedRun, slot: int, ledger: Ledger) -> bool:
    """Push session 1 of the run's chain in `slot` (or take up a chain it already has: a queue run again, or
    killed after its push);
    False when Kaggle refused it at the account's cap (the run waits)."""
    job = loop.job_of(run)
    # A push an earlier queue sent and died before it heard back is settled from Kaggle's versions first: a
    # chain with a session (even one still live) is taken up, never pushed again.
    if not reconcile(loop.client, ledger, job):
        try:
            push_job(job, ledger, loop.client, skip_smoke=loop.skip_smoke, echo=lambda s: loop.echo(f"  {run.label}: {s}"))
        except SessionCapReached as exc:
            run.said = f"waits for a slot: {exc}"
            return False
        except (ChainStop, NotSmoked, BudgetExceeded, SpecError) as exc:
            run.started = iso(now_utc())
            _end(queue, loop, run, RunState.STOPPED, str(exc))
            return True
    run.state, run.slot, run.started = RunState.RUNNING, slot, run.started or iso(now_utc())
    run.said = ""
    _say(queue, loop, f"{run.label} ({run.chain}) started in slot {slot}, {run.planned_h:.2f} GPU-h planned")
    return True


def _fill(queue: Queue, loop: Loop, ledger: Ledger, left_h: float, busy: int) -> None:
    """Start the waiting runs, in the plan's order, in the free slots while their hours fit."""
    for run in [r for r in queue.runs if r.state == RunState.WAITING]:
        held = held_h(queue.runs, None, queue.slack_h, queue.use_slack)
        if not fits(run, left_h, held):
            said = (f"needs {run.planned_h:.2f} GPU-h, {max(0.0, left_h - held):.2f} are left this week beside "
                    f"{'the running runs and ' if held > queue.slack_h else ''}the slack of {queue.slack_h:.2f}"
                    f"{'' if queue.use_slack else ' (`kchain queue --use-slack` may spend it)'}")
            if any(r.state == RunState.RUNNING for r in queue.runs):
                run.said = f"waits: it {said}"
                return  # a running run may give hours back when it ends
            run.started = None
            _end(queue, loop, run, RunState.SKIPPED, f"it {said}")
            continue
        slots = free_slots(queue.runs, busy)
        if not slots:
            run.said = "waits for a free slot"
            return
        if not _start(queue, loop, run, slots[0], ledger):
            return


def run(queue: Queue, loop: Loop) -> Queue:
    """Poll until every run is finished, stopped or skipped; the queue saved after every poll."""
    first = load_job(queue.runs[0].job_file)
    failures = 0
    while not queue.done:
        try:
            for run_ in [r for r in queue.runs if r.state == RunState.RUNNING]:
                ledger = Ledger(state_dir(Path(run_.job_file)))
                _advance(queue, loop, run_, ledger)
                run_.spent_h = _spent(ledger, run_, queue.made)
            if any(r.state == RunState.WAITING for r in queue.runs):  # the week is read only for a run to start
                ledger = Ledger(state_dir(first.path))
                plan = plan_for(first, ledger, loop.client)
                _fill(queue, loop, ledger, plan.left_h, _busy_elsewhere(ledger, queue, plan.account))
        except KaggleError as exc:
            if isinstance(exc, CredentialsError) or failures + 1 >= loop.max_failures:
                save(queue, loop.path)
                raise
            failures += 1
            loop.echo(f"[{time.strftime('%H:%M:%S')}] {exc} (failure {failures} of at most {loop.max_failures} in a "
                      "row; the queue tries again)")
        else:
            failures = 0
        save(queue, loop.path)
        if not queue.done:
            time.sleep(loop.poll_s)
    said = summary_line(queue)
    _say(queue, loop, said)
    save(queue, loop.path)
    loop.notify_for(first.name)(QUEUE_ENDED, said, None)
    return queue


# -- what status says -----------------------------------------------------------------------------


def summary_line(queue: Queue) -> str:
    counts = {state: sum(1 for r in queue.runs if r.state == state) for state in RunState}
    spent = sum(r.spent_h for r in queue.runs)
    planned = sum(r.planned_h for r in queue.runs)
    back = sum(r.left_h() for r in queue.runs if r.state in (RunState.STOPPED, RunState.SKIPPED))
    return (f"{len(queue.runs)} run(s): " + ", ".join(f"{n} {state}" for state, n in counts.items() if n)
            + f"; {spent:.2f} of {planned:.2f} planned GPU-h spent, {back:.2f} given back by runs that stopped or were "
            f"skipped; the slack of {queue.slack_h:.2f} " + ("may be spent (--use-slack)" if queue.use_slack else "held back"))


def lines(queue: Queue) -> list[str]:
    """The queue as `kchain status` shows it: one row per run, then the totals."""
    out = [f"queue of {len(queue.runs)} run(s) on Kaggle's {GPU_SLOTS} GPU slots, made {queue.made}",
           f"{'run':<4} {'chain':<24} {'state':<9} {'slot':>4} {'planned':>7} {'spent':>6}  last word"]
    for r in queue.runs:
        out.append(f"{r.label:<4} {r.chain:<24} {r.state:<9} {r.slot or '-':>4} {r.planned_h:>7.2f} {r.spent_h:>6.2f}  "
                   f"{(r.said or '-').splitlines()[0][:160]}")
    out.append(summary_line(queue))
    return out
