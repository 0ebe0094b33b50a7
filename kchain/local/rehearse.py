"""`kchain rehearse`: the whole chain on this machine, against the local Kaggle, before any quota.

The job is pushed to a private emulator and its sessions are planned in steps: the run's total is cut
into `sessions` spans, each session stops through the runtime's deadline path at the end of its span
(`KCHAIN_SESSION_PLAN`, common/sessionplan.py) and the sessions chosen to die are killed right after
their first checkpoint past where they resumed, so the same job gives the same chain and verdict on any
machine, loaded or not; a wall-clock session limit stays only as a safety net. `by_time` plans them in
seconds instead (a short session limit that the runtime's deadline guard is set from, as on Kaggle).
`continue` chains session after session until training is done. Sessions and the
uninterrupted run beside them get the ranks the job gets on Kaggle. The two metrics traces are
compared step by step; the verdict is a pass only when they match, a session really resumed, the
kills asked for happened and the chain trained every step it asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kchain.chain import sessions as sess
from kchain.chain.advance import decide_and_continue, watch
from kchain.chain.notify import FAILED, FINISHED, NEEDS_PERSON, nobody, notifier
from kchain.chain.push import push_job
from kchain.chain.sessions import StaleRule
from kchain.common import layout, sessionplan
from kchain.common.checkpoint_files import BEST_KEY, CheckpointInvalid, complete, read_manifest
from kchain.common.sessionstate import TERMINAL
from kchain.common.statefolder import write_dataset_metadata
from kchain.common.summary import Status, Summary, read_working
from kchain.emulator import Emulator, Faults
from kchain.emulator.sessions import CHECKPOINT_KILL
from kchain.emulator.switches import Switches
from kchain.errors import ChainStop, KaggleError, KchainError
from kchain.job.inputs import local_inputs, mount_inputs
from kchain.job.render import render_job, write_rendered
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient
from kchain.kaggle.datasets import wait_ready
from kchain.local import statecheck
from kchain.local.executor import NotebookThread, SessionLog, start_session
from kchain.local.smoke import kaggle_ranks, ranks_env, threads_each
from kchain.local.smoke import ranks as local_ranks
from kchain.result.plot import newest_trace
from kchain.result.traces import compare_traces, read_trace, sandbox_trace
from kchain.store import account
from kchain.store.ledger import Ledger, new_run_id, state_dir
from kchain.store.names import doctor_kernel, state_dataset

Echo = Callable[[str], None]
USER = "rehearsal"
BUSY = "rehearsal-busy-gpu"  # busy_gpu: the other GPU kernel of the account
SESSIONS = 3  # the default plan: the total in 3 spans, so 4 sessions with the one kill
SAFETY_LIMIT_S = 3600.0  # sessions planned in steps: a wall-clock limit only a stuck session meets
BY_TIME_LIMIT_S = 20.0  # sessions planned in seconds (--by-time): their limit unless --session-limit


@dataclass
class Rehearsal:
    identical: bool  # the chained trace equals the uninterrupted one, value for value
    verdict: str
    sessions: list[sess.SessionRecord]
    reference: list[dict[str, Any]]
    chained: list[dict[str, Any]]
    emulator_sessions: list[dict[str, Any]] = field(default_factory=list)
    dataset_versions: list[dict[str, Any]] = field(default_factory=list)
    work: Path | None = None
    killed: list[int] = field(default_factory=list)  # kernel versions (sessions) the rehearsal killed
    passed: bool = False  # identical, and it proved a resume: see shortcomings()
    ranks: int = 1  # per session and in the uninterrupted run
    # unattended: the chain's records rebuilt from Kaggle alone into an empty ledger, or the line that refused
    rebuilt: list[dict[str, Any]] | str | None = None
    # unattended: what the local Kaggle's records count (Unattended.counted); None for an attended chain
    unattended: Unattended | None = None
    stopped: bool = False  # the chain stopped for a decision a person makes (a crash, no progress)

    def line(self) -> str:
        """The rehearsal's end in one line (a failure's `Error:` line, and what --notify is told)."""
        return f"rehearsal: the chained run {self.verdict}"

    def event(self) -> str:
        """Its end as a --notify event (chain/notify.py): finished (passed), needs_person (the chain stopped
        for a decision), failed (any other verdict)."""
        return FINISHED if self.passed else NEEDS_PERSON if self.stopped else FAILED


@dataclass(frozen=True)
class Unattended:
    """An unattended chain as the local Kaggle recorded it: what must be zero for it to pass."""

    laptop_pushes: int  # sessions after the first pushed by the laptop (a SaveKernel from outside a session)
    overlapping: int  # pairs of sessions that trained at once (a second session of the chain pushed too early)
    duplicate_versions: int  # state dataset versions of a step another version already holds

    @classmethod
    def counted(cls, sessions: list[dict[str, Any]], versions: list[dict[str, Any]]) -> Unattended:
        """From the emulator's session records (one kernel's) and the state dataset's versions. A kernel
        pushes the next session before its own ends, by design: only training at once counts (_training_span)."""
        ours = sorted(sessions, key=lambda s: s["version"])
        spans = sorted(_training_span(s) for s in ours if s.get("first_cell"))
        notes = [v["notes"] for v in versions if "step" in (v.get("notes") or "")]
        return cls(laptop_pushes=sum(1 for s in ours[1:] if s.get("pushed_from") != "kernel"),
                   overlapping=sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]),
                   duplicate_versions=len(notes) - len(set(notes)))

    def line(self) -> str:
        return (f"unattended, from the local Kaggle's records: {self.laptop_pushes} laptop pushes after session 1, "
                f"{self.overlapping} overlapping sessions, {self.duplicate_versions} duplicate state versions")

    def problems(self, handovers: int = 0) -> list[str]:
        """Why the unattended chain is not a pass ([] when every count is zero); handovers: laptop pushes the
        rehearsal caused on purpose (a kernel left without its Secret: no_secret_in)."""
        said = [(self.laptop_pushes - handovers, "the laptop pushed {n} of the sessions after the first (a kernel "
                 "could not push the next: its session's summary says why)"),
                (self.overlapping, "{n} pairs of sessions ran at once (a session pushed before the previous ended)"),
                (self.duplicate_versions, "{n} state versions hold a step another version already held")]
        return [text.format(n=n) for n, text in said if n > 0]


def _training_span(session: dict[str, Any]) -> tuple[float, float]:
    """When an emulator session trained: from its first cell to its summary's end (the training's), else to
    the kill of its training process (kill_training_only), else to the session's end (or now)."""
    ended = (session.get("summary") or {}).get("ended")
    if not isinstance(ended, (int, float)):
        ended = session.get("training_killed_at") or session.get("ended") or float("inf")
    return session["first_cell"], float(ended)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _short_session_job(job: Job, session_limit_s: float, params: dict[str, Any], by_time: bool = True) -> Job:
    """The job with the rehearsal's session limit (by time: the margin and cadence scaled to it; planned in
    steps: the limit is a safety net, and the plan's saves join the job's cadence in steps in the kernel)."""
    margin = max(3.0, round(session_limit_s * 0.25, 1))  # start-up and shutdown under load need room
    update = {"session_limit": f"{session_limit_s}s", "margin": f"{margin}s", "heartbeat": "2s"}
    if by_time:
        update["checkpoint_every"] = f"{max(1.0, round(session_limit_s / 6, 1))}s"
    train = job.train.model_copy(update=update)
    kaggle = job.kaggle.model_copy(update={"owner": USER})
    return job.model_copy(update={"train": train, "kaggle": kaggle, "params": {**job.params, **params}})


def _wait_first(client: KaggleClient, ledger: Ledger, job: Job, poll_s: float) -> sess.SessionRecord:
    """Session 1's record once it ended (a flaky local Kaggle is asked again)."""
    while True:
        try:
            first = sess.refresh(client, ledger, job.name)[0]
        except KaggleError:
            first = ledger.sessions(job.name)[0]
        if first["status"] in TERMINAL:
            return first
        time.sleep(poll_s)


SESSIONS_AFTER_THE_FIRST = 3  # a rehearsal is a handful of sessions, not dozens


def _sized_limit(first: sess.SessionRecord, limit_s: float, echo: Echo) -> float | None:
    """A longer session limit when session 1's measured speed says the given one would need many
    sessions: the remaining steps in about SESSIONS_AFTER_THE_FIRST sessions. None: keep the limit."""
    summary = sess.summary_of(first)
    step, total, rate = summary.step or 0, summary.total or 0, summary.steps_per_s
    started, ended = summary.started, summary.ended
    if not rate or not total or step >= total or not isinstance(started, (int, float)) or not ended:
        return None
    remaining = total - step
    if remaining / max(step, 1) <= SESSIONS_AFTER_THE_FIRST:
        return None
    overhead = max(0.0, (ended - started) - step / rate)  # start-up and the final save
    per_session = -(-remaining // SESSIONS_AFTER_THE_FIRST)
    # The margin is a quarter of the limit (_short_session_job); 20% more for a slower moment.
    longer = round(1.2 * (overhead + per_session / rate) / 0.75, 1)
    if longer <= limit_s:
        return None
    echo(f"  session 1 trained {step} steps at {rate:.2f} steps/s with {overhead:.0f}s of start-up: sessions of "
         f"{longer:g}s from now on, so the remaining {remaining} steps take about {SESSIONS_AFTER_THE_FIRST} more")
    return longer


def _resized(job: Job, limit_s: float) -> Job:
    margin = max(3.0, round(limit_s * 0.25, 1))
    train = job.train.model_copy(update={
        "session_limit": f"{limit_s}s", "margin": f"{margin}s",
        "checkpoint_every": f"{max(1.0, round(limit_s / 6, 1))}s",
    })
    return job.model_copy(update={"train": train})


def _run_reference(job: Job, root: Path, sources: dict[tuple[str, str, str], Path], extra_env: dict[str, str],
                  started: Callable[[NotebookThread], None] = lambda _notebook: None,
                  ) -> tuple[list[dict[str, Any]], Summary | None]:
    """The same notebook, one uninterrupted session with no time limit, its kernel in a process group of
    its own (started: told the notebook, so it can be killed); returns its trace and its summary."""
    rendered = render_job(job, owner=USER)
    write_rendered(rendered, root.parent / "reference-kernel")
    root.mkdir(parents=True, exist_ok=True)
    mount_inputs(root, sources)
    env = {**os.environ, layout.SESSION_LIMIT_ENV: str(30 * 24 * 3600)}
    env.pop(layout.FAULT_ENV, None)  # a test's session clock and kills are the sessions', not this run's
    env.pop(layout.SESSION_PLAN_ENV, None)  # so are the rehearsal's stops (extra_env: its saves, sessionplan.py)
    env.update(extra_env)
    notebook = root.parent / "reference-kernel" / rendered.notebook_file
    with open(root.parent / "reference.log", "w") as log:
        output = SessionLog(log, log)
        run = NotebookThread(notebook, root, env, on_output=output, on_end=output.ended, name="rehearse-reference")
        started(run)
        code = run.start().wait()
    if code != 0:
        raise KchainError(f"the reference run failed (exit {code}); see {root.parent / 'reference.log'}")
    return read_trace(sandbox_trace(root)), read_working(root / layout.WORKING_DIR)


def upload_inputs(emu: Emulator, job: Job, sources: dict[tuple[str, str, str], Path], keys: dict[str, str],
                  scratch: Path, echo: Echo) -> None:
    """Publish the local copy of each attached dataset to the local Kaggle, as its owner, so the
    sessions get it mounted like Kaggle would (a pinned version N exists as version N); a model's
    stand-in is put there as that model version."""
    pinned = {tuple(ref.split("/")[:2]): int(ref.split("/")[2]) for ref in job.kaggle.datasets if ref.count("/") == 2}
    for (kind, owner, slug), source in sources.items():
        if kind == "models":
            emu.add_model(f"{owner}/{slug}", source)
            echo(f"  input {owner}/{slug}: the stand-in {source} is on the local Kaggle")
            continue
        folder = scratch / owner / slug
        shutil.copytree(source, folder, symlinks=False)
        write_dataset_metadata(folder, f"{owner}/{slug}", slug)
        with _env({**emu.env(owner)}):
            client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
            client.create_dataset(folder, public=True, dir_mode="zip")
            for _ in range(pinned.get((owner, slug), 1) - 1):
                wait_ready(client, f"{owner}/{slug}", echo)
                client.version_dataset(folder, "rehearsal copy", dir_mode="zip")
            wait_ready(client, f"{owner}/{slug}", echo)  # a new version is invisible for a while
        echo(f"  input {owner}/{slug}: the local copy {source} is on the local Kaggle")


def rehearse(job_file: Path, sessions: int | None = SESSIONS, session_limit_s: float | None = None,
             kills: int = 1, seed: int = 0, params: dict[str, Any] | None = None, faults: Faults | None = None, internet: bool | None = None,
             echo: Echo = print, poll_s: float = 0.5, key: str | None = None,
             switches: Switches | None = None, ranks: int | None = None, unattended: bool = False,
             no_secret_in: int | None = None, stale: StaleRule | None = None, busy_gpu: bool = False) -> Rehearsal:
    """Named stages: the rehearsal's job -> a local Kaggle with the inputs on it -> the reference
    run beside the chain -> the chain with its kills -> the traces compared. sessions: the run's total
    in that many spans, each session stopped at a planned step (None: sessions by time, of session_limit_s
    seconds, BY_TIME_LIMIT_S unless given); session_limit_s: the wall-clock limit (planned in steps, a
    safety net of SAFETY_LIMIT_S unless given). ranks: per session and in the reference (default: as many as
    the job gets on Kaggle). unattended: `push --unattended`, then the laptop only watches (each kernel pushes
    the next; the emulator's kernel_may_push is on), taking over only when a kernel could not push (its counts,
    Unattended, must all be zero to pass); no_secret_in: that session's kernel finds no Secret (a hand-over);
    busy_gpu: another GPU session of the account runs throughout, so the chain has one GPU slot to hold.
    stale: the rule by which the watch judges a RUNNING session stale and deletes its kernel (once the
    chain's state is safe) to chain on, as `continue --watch --delete-stale` does; None: the job's rule, no delete."""
    base = load_job(job_file)
    by_time = sessions is None
    session_limit_s = session_limit_s or (BY_TIME_LIMIT_S if by_time else SAFETY_LIMIT_S)
    job = _rehearsal_job(base, job_file, session_limit_s, params or {}, True if unattended else internet, by_time)
    n = local_ranks(job, ranks)
    work = state_dir(base.path) / "rehearse" / new_run_id("rehearse")
    ledger = Ledger(work / "ledger")
    faults = faults or Faults(seed=seed)
    sources = local_inputs(job, state_dir(base.path) / "inputs", echo=echo)
    emu = _start_local_kaggle(job, work, sources, session_limit_s, faults, switches, key, echo)
    reference = ReferenceRun(job, work / "reference", sources, _session_env(emu, n, sessions))
    kill = Killer(emu, f"{USER}/{job.name}", kills)
    planned = (f"sessions of {session_limit_s:g}s" if by_time else
               f"sessions planned in steps (the total in {sessions} spans, kills after a planned checkpoint; "
               f"a {session_limit_s:g}s limit only as a safety net)")
    echo(f"kchain rehearse {job_file}: {planned} against a local Kaggle at {emu.url}; {_ranks_said(job, n, ranks)}")
    try:
        reference.start()
        rebuilt = None
        if unattended:
            # On Kaggle: what the doctor's probe saw (push --unattended): a kernel may push a kernel, and the
            # version it pushes keeps its Secrets.
            emu.switches.kernel_may_push, emu.switches.secrets_reset_on_push = True, False
            # A kill takes the training process alone (the OOM killer): the kernel lives on to publish and push,
            # so the chain stays unattended; a session's own death is the hand-over (no_secret_in's test).
            emu.faults.kill_training_only = True
            stop, rebuilt = _run_unattended(emu, job, ledger, kill, poll_s, echo, no_secret_in, busy_gpu)
        else:
            job, stop = _run_chain(emu, job, ledger, kill, session_limit_s if by_time else None, poll_s, echo, stale)
        stop = _in_rehearsal_terms(stop, by_time, session_limit_s)
        trace, summary = ([], None) if stop is not None else reference.result()
    finally:
        reference.stop()
        emu.stop()
    chain = ledger.sessions(job.name)
    state, best = _compare_state(work / "reference", chain) if stop is None else (None, None)
    identical, passed, verdict, chained = judge(trace, summary, chain, sorted(kill.killed), kills, stop, echo, state, best)
    ours = [s for s in emu.sessions() if s["kernel"] == f"{USER}/{job.name}"]
    versions = emu.dataset_versions(state_dataset(USER, job.name))
    counts = None
    if unattended:  # the verdict's rules, then the unattended chain's own
        counts, passed, verdict = _judge_unattended(ours, versions, no_secret_in, passed, verdict, echo)
    return Rehearsal(identical, verdict, chain, trace, chained, emu.sessions(), versions, work, sorted(kill.killed),
                     passed, n, rebuilt, counts, stopped=stop is not None)


def rehearse_told(job_file: Path, notify_command: str | None, echo: Echo = print, **options: Any) -> Rehearsal:
    """`kchain rehearse --notify CMD`: rehearse(job_file, echo=echo, **options), its end told to the command
    once (chain/notify.py): finished, needs_person or failed with Rehearsal.line(), or failed with the error
    that ended it. A job file that does not load fails before anything runs, untold."""
    notify = notifier(notify_command, load_job(job_file).name, echo) if notify_command else nobody
    try:
        result = rehearse(job_file, echo=echo, **options)
    except Exception as exc:
        notify(FAILED, str(exc) if isinstance(exc, KchainError) else f"{type(exc).__name__}: {exc}", None)
        raise
    notify(result.event(), result.line(), len(result.sessions) or None)
    return result


def _session_env(emu: Emulator, n: int, sessions: int | None) -> dict[str, str]:
    """Each session runs the ranks Kaggle gives it, as gloo ranks here; a session and the reference train
    at once, so each gets its share of the cores (as the smoke's runs do). The sessions, not the reference,
    also get the plan in steps. Returns the reference's environment."""
    ranked = {**ranks_env(n), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(threads_each(n)),
              layout.AUDIT_ENV: "1"}  # the state no checkpoint holds: refused at the first step, compared at saves
    emu.runner.image_env.update(ranked)
    if sessions is None:
        return ranked
    emu.runner.image_env[layout.SESSION_PLAN_ENV] = str(sessions)
    # The reference saves where the sessions save and stop, so both runs keep the same best (keep_best).
    return {**ranked, layout.SESSION_PLAN_ENV: sessionplan.reference(sessions)}


def _judge_unattended(ours: list[dict[str, Any]], versions: list[dict[str, Any]], no_secret_in: int | None,
                     passed: bool, verdict: str, echo: Echo) -> tuple[Unattended, bool, str]:
    """An unattended chain's own counts (laptop pushes, overlaps, duplicate versions) after the usual rules."""
    counts = Unattended.counted(ours, versions)
    echo(counts.line())
    problems = counts.problems(handovers=1 if no_secret_in is not None else 0)
    if problems and passed:
        verdict, passed = problems.pop(0), False
        echo(f"verdict: {verdict}")
    for problem in problems:
        echo(f"  and: {problem}")
    return counts, passed, verdict


NO_PROGRESS = ", and the next would lose its work the same way"


def _in_rehearsal_terms(stop: ChainStop | None, by_time: bool, limit_s: float) -> ChainStop | None:
    """A chain that stopped without progress, its fix said with rehearse's own flags (`continue` names the
    job's train.session_limit and itself, which a rehearsal does not use)."""
    if stop is None or NO_PROGRESS not in str(stop):
        return stop
    head = str(stop).split(NO_PROGRESS)[0]
    if by_time:
        fix = (f"raise --session-limit (now {limit_s:g}s) so a session trains and saves before its limit, or leave "
               "out --by-time to plan the sessions in steps")
    else:
        fix = (f"the sessions ended before their planned stop: if they met the safety limit, raise --session-limit "
               f"(now {limit_s:g}s); if the job's loop has no total (run.should_stop), plan them by time (--by-time)")
    return ChainStop(f"{head}{NO_PROGRESS}: {fix}")


def _ranks_said(job: Job, n: int, asked: int | None) -> str:
    """Which ranks the rehearsal runs, beside what Kaggle gives the job."""
    kaggle = kaggle_ranks(job)
    each = f"{n} rank{'s' if n > 1 else ''} per session and in the uninterrupted run"
    if n == kaggle:
        return f"{each}, as on Kaggle"
    return f"{each} (--ranks {asked}; on Kaggle the job gets {kaggle})"


def _rehearsal_job(base: Job, job_file: Path, session_limit_s: float, params: dict[str, Any],
                  internet: bool | None, by_time: bool = True) -> Job:
    """The job with the rehearsal's sessions, params and internet setting; a competition is refused."""
    if base.kaggle.competition:
        raise KchainError(f"{job_file}: kaggle.competition: competitions are not emulated; to rehearse, "
                          "attach a small copy of the data as a dataset")
    job = _short_session_job(base, session_limit_s, params, by_time)
    if internet is not None:
        job = job.model_copy(update={"kaggle": job.kaggle.model_copy(update={"internet": internet})})
    return job


def _start_local_kaggle(job: Job, work: Path, sources: dict[tuple[str, str, str], Path], session_limit_s: float,
                       faults: Faults, switches: Switches | None, key: str | None, echo: Echo) -> Emulator:
    """A private emulator holding the rehearsal's user (key: a throwaway key of the throwaway Kaggle),
    the owner of each attached dataset, and the datasets themselves."""
    key = key or secrets.token_hex(16)
    owners = {owner: secrets.token_hex(16) for (_, owner, _) in sources if owner != USER}
    emu = Emulator(work / "kaggle", users={USER: key, **owners}, session_limit_s=session_limit_s * 1.05,
                   secrets={USER: {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": key}}, faults=faults,
                   switches=switches, start_notebook=start_session)
    emu.start()
    try:
        upload_inputs(emu, job, sources, {USER: key, **owners}, work / "upload", echo)
    except BaseException:
        emu.stop()
        raise
    return emu


class ReferenceRun:
    """The uninterrupted run, in a thread beside the chain; its error is raised by result(), and
    stop() ends it (a chain that stopped is compared with nothing)."""

    def __init__(self, job: Job, root: Path, sources: dict[tuple[str, str, str], Path],
                 env: dict[str, str]) -> None:
        self.trace: list[dict[str, Any]] = []
        self.summary: Summary | None = None
        self.error: BaseException | None = None
        self.notebook: NotebookThread | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(job, root, sources, env), daemon=True)

    def _run(self, job: Job, root: Path, sources: dict[tuple[str, str, str], Path], env: dict[str, str]) -> None:
        try:
            self.trace, self.summary = _run_reference(job, root, sources, env, self._started)
        except BaseException as exc:  # noqa: BLE001 - reported after the chain
            self.error = exc

    def _started(self, notebook: NotebookThread) -> None:
        self.notebook = notebook
        if self.stopping.is_set():
            notebook.kill()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the run if it is still going (its process group, SIGKILL), and wait for its thread."""
        self.stopping.set()
        if self.notebook is not None:
            self.notebook.kill()
        if self.thread.ident is not None:
            self.thread.join()

    def result(self) -> tuple[list[dict[str, Any]], Summary | None]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.trace, self.summary


class Killer:
    """Called before each `continue`: session 1 runs clean; then `kills` sessions die, one at a time.
    Each is killed (a real SIGKILL of its process tree) as soon as it saved a checkpoint past the step
    it resumed at: the kill follows real progress whatever the loop prints (run.steps, run.epochs or
    an explicit run.save loop that prints no heartbeat) and however fast the machine is. A session
    that ends before such a save is not killed and the next one is armed; a chain that finishes
    first is named by the verdict (shortcomings)."""

    def __init__(self, emu: Emulator, kernel: str, kills: int) -> None:
        self.emu, self.kernel, self.kills = emu, kernel, kills
        self.killed: set[int] = set()  # kernel versions (sessions) killed so far

    def __call__(self, _session: int) -> None:
        ours = [s for s in self.emu.sessions() if s["kernel"] == self.kernel]
        armed = [s for s in ours if s.get("kill_after_checkpoint")]
        self.killed.update(s["version"] for s in armed if s.get("training_killed")
                           or (s.get("failure_message") or "").startswith(CHECKPOINT_KILL))
        pending = [s for s in armed if s["status"] not in TERMINAL]
        self.emu.faults.kill_after_checkpoint = bool(ours) and not pending and len(self.killed) < self.kills


def _run_chain(emu: Emulator, job: Job, ledger: Ledger, kill: Killer, session_limit_s: float | None, poll_s: float,
              echo: Echo, stale: StaleRule | None = None) -> tuple[Job, ChainStop | None]:
    """Push session 1, then `continue --watch` until done; returns the job as the chain ran it and the
    stop that ended the chain before it finished, if any (a crash, sessions without progress).
    session_limit_s: sessions by time, sized from session 1's speed (their limit may grow); None: the
    sessions are planned in steps, and nothing is sized."""
    with _env({**emu.env(USER), "KCHAIN_HOME": str(ledger.root), **_account_home(ledger)}):
        client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
        if job.kaggle.internet:
            # The user attached their Kaggle key to the kernel in the web UI once (no API can).
            emu.attach_secrets(f"{USER}/{job.name}")
            ledger.save_publish_figures(job.name, _measure_publish(emu, emu.faults, echo))
        kill(1)
        push_job(job, ledger, client, skip_smoke=True, force=True, echo=echo)
        longer = None
        if session_limit_s is not None:
            first = _wait_first(client, ledger, job, poll_s)
            longer = _sized_limit(first, session_limit_s, echo)
        if longer is not None:
            job = _resized(job, longer)
            emu.session_limit_s = longer * 1.05
        stop = None
        try:
            watch(job, ledger, client, force=True, skip_smoke=True, echo=echo, poll_s=poll_s,
                  max_poll_s=max(poll_s, 2.0), before_each=kill, stale=stale, delete_stale=stale is not None)
        except ChainStop as exc:
            stop = exc
        kill(0)  # settle the last kill
    return job, stop


def _run_unattended(emu: Emulator, job: Job, ledger: Ledger, kill: Killer, poll_s: float, echo: Echo,
                   no_secret_in: int | None = None,
                   busy_gpu: bool = False) -> tuple[ChainStop | None, list[dict[str, Any]] | str | None]:
    """`push --unattended`, then the laptop waits: only once the chain's newest session has ended without
    a successor (its kernel could not push, or it was the last) does `continue` look (the records rebuilt
    from Kaggle) and act; its pushes after session 1 are counted in `ledger`'s records (pushed_by).
    Returns the stop, if any, and, once finished, the chain rebuilt from Kaggle alone (_rebuilt_from_kaggle)."""
    ref = f"{USER}/{job.name}"
    with _env({**emu.env(USER), "KCHAIN_HOME": str(ledger.root), **_account_home(ledger)}):
        client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
        emu.attach_secrets(ref)
        emu.attach_secrets(doctor_kernel(USER, job.name))  # the relay's kernel, as `kchain doctor` asked
        if busy_gpu:
            occupy_gpu(client, ledger.root.parent / "busy", echo)
        ledger.save_publish_figures(job.name, _measure_publish(emu, emu.faults, echo))
        kill(1)
        push_job(job, ledger, client, skip_smoke=True, force=True, echo=echo, unattended=True)
        while True:
            ours = [s for s in emu.sessions() if s["kernel"] == ref]
            if no_secret_in is not None and len(ours) >= no_secret_in:
                with emu.store.lock:  # the user detached the Secrets (or a push reset them) before its end
                    if ref in emu.store.secrets_attached and len(ours) == no_secret_in:
                        emu.store.secrets_attached.remove(ref)
            if not ours or ours[-1]["status"] not in TERMINAL:
                kill(len(ours))
                time.sleep(poll_s)
                continue
            try:
                decision = decide_and_continue(job, ledger, client, force=True, skip_smoke=True, echo=echo)
            except ChainStop as exc:
                return exc, None
            except KaggleError:
                time.sleep(poll_s)
                continue
            if decision.action == "finished":
                return None, _rebuilt_from_kaggle(client, job.name, ledger.root.parent / "rebuilt")
            if decision.action == "pushed":
                echo(f"  the laptop took over: {decision.message}")
                emu.attach_secrets(ref)  # the user attached them again
            time.sleep(poll_s)


def _account_home(ledger: Ledger) -> dict[str, str]:
    """The local Kaggle's account week kept beside the rehearsal's ledger, never in the user's config home."""
    return {account.CONFIG_HOME_ENV: str(ledger.root.parent / "config")}


def occupy_gpu(client: KaggleClient, folder: Path, echo: Echo) -> None:
    """Another GPU session of the account, running until the local Kaggle stops (a notebook in the browser)."""
    folder.mkdir(parents=True, exist_ok=True)
    cell: dict[str, Any] = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                            "source": "import time\ntime.sleep(24 * 3600)"}
    (folder / "busy.ipynb").write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4,
                                                   "nbformat_minor": 5}))
    (folder / "kernel-metadata.json").write_text(json.dumps({
        "id": f"{USER}/{BUSY}", "title": BUSY, "code_file": "busy.ipynb", "language": "python",
        "kernel_type": "notebook", "is_private": True, "enable_gpu": True, "enable_internet": False}))
    version, _url = client.push(folder)
    echo(f"  another GPU session holds one of the account's slots: {USER}/{BUSY} version {version}")


def _rebuilt_from_kaggle(client: KaggleClient, job: str, root: Path) -> list[dict[str, Any]] | str:
    """What `kchain status` on a laptop with an empty ledger sees (sessions.rebuild): the chain's records
    from Kaggle's versions and outputs alone, or the one line that refused to rebuild it."""
    try:
        chain = sess.refresh(client, Ledger(root), job)
    except ChainStop as exc:
        return str(exc)
    return [{key: record.get(key) for key in ("session", "version", "resumes_at", "state_version", "status")}
            for record in chain]


def _compare_state(reference_root: Path, chain: list[sess.SessionRecord],
                   ) -> tuple[statecheck.Comparison, tuple[dict | None, dict | None]]:
    """The uninterrupted run's checkpoints against those the chain's sessions left, at every step both
    saved (statecheck.py), and the best each kept."""
    return statecheck.compare(
        statecheck.saved([statecheck.checkpoints_of(reference_root / layout.WORKING_DIR)]),
        statecheck.saved(statecheck.checkpoints_of(Path(out)) for s in chain if (out := s.get("output"))),
    ), _kept_bests(reference_root, chain)


def _kept_bests(reference_root: Path, chain: list[sess.SessionRecord]) -> tuple[dict | None, dict | None]:
    """The best checkpoint train.keep_best kept (its manifest's record: metric, mode, value, step) by the
    uninterrupted run and by the chain's last session that saved one."""
    def newest(folders: list[Path]) -> dict | None:
        for folder in reversed(folders):
            for ckpt in reversed(complete(folder)):
                try:
                    return read_manifest(ckpt).get(BEST_KEY) or {}
                except CheckpointInvalid:
                    continue
        return None

    ran = [statecheck.checkpoints_of(Path(out)) for s in chain if (out := s.get("output"))]
    return newest([statecheck.checkpoints_of(reference_root / layout.WORKING_DIR)]), newest(ran)


def best_problem(best: tuple[dict | None, dict | None] | None) -> str | None:
    """The kept best of the chain against the uninterrupted run's: a chain that keeps another best hands
    `pull --best` other weights, though every step agrees."""
    if best is None or best[0] is None or best[1] is None:
        return None
    ours, theirs = best[1] or None, best[0] or None
    if ours == theirs:
        return None

    def said(record: dict | None) -> str:
        return f"step {record['step']} ({record['metric']} {record['value']:.6g})" if record else "none"
    return (f"the kept best differs: the chain kept {said(ours)}, the uninterrupted run {said(theirs)} "
            "(train.keep_best keeps the best of the steps a checkpoint is saved at: validate at the steps you "
            "checkpoint, with a cadence in steps)")


def judge(reference: list[dict[str, Any]], summary: Summary | None, chain: list[sess.SessionRecord],
          killed: list[int], kills: int, stop: ChainStop | None,
          echo: Echo, state: statecheck.Comparison | None = None,
          best: tuple[dict | None, dict | None] | None = None) -> tuple[bool, bool, str, list[dict[str, Any]]]:
    """The chained trace, the chain's checkpoints and its kept best against the reference's, step by step,
    and what the chain proved: (identical, passed, the verdict, the chained trace)."""
    trace_path = newest_trace(chain)
    chained = read_trace(trace_path) if trace_path else []
    rows, first = compare_traces(reference, chained)
    identical = first is None and bool(rows) and all(r[3] is not None for r in rows)
    problems = shortcomings(identical, first, summary, chain, killed, kills, stop)
    if state is not None and state.first is not None:
        diff = state.first
        first_resume = min((s.get("resumes_at") or 0 for s in chain if (s.get("resumes_at") or 0) > 0), default=0)
        line = statecheck.describe(diff, statecheck.largest(diff), traces_agree=identical)
        problems.insert(0, f"the state differs: {line}: {statecheck.cause(state, first_resume, identical)}")
        identical = False
    kept = best_problem(best)
    if kept is not None:
        problems.insert(0, kept)
        identical = False
    if problems:
        verdict = problems[0]
    else:
        steps = max((r["step"] for r in reference), default=0)
        resumed = sum(1 for s in chain if (s.get("resumes_at") or 0) > 0)
        compared = (f"; the state equal at step{'s' if len(state.steps) > 1 else ''} "
                    f"{', '.join(map(str, state.steps))} ({state.counted()})") if state and state.steps else ""
        compared += f"; {state.excluded_note()}" if state and state.excluded else ""
        if best is not None and best[1]:
            compared += f"; the same best kept (step {best[1]['step']})"
        verdict = (f"identical: {len(rows)} values over {steps} steps, {len(chain)} sessions ({resumed} resumed, "
                   f"{len(killed)} killed), largest difference 0.0{compared}")
    _print(echo, chain, rows, set(killed))
    for problem in problems[1:]:
        echo(f"  and: {problem}")
    echo(f"verdict: {verdict}")
    return identical, not problems, verdict, chained


def shortcomings(identical: bool, first: tuple[int, str] | None, summary: Summary | None,
                 chain: list[sess.SessionRecord], killed: list[int], kills: int, stop: ChainStop | None) -> list[str]:
    """Why the rehearsal is not a pass, most telling first ([] for a pass). Identical traces prove
    nothing when no session resumed, when the kills asked for did not happen, or when the loop
    trained fewer steps than it asked for (the same short run twice is still identical).
    summary: the uninterrupted run's; chain: the sessions' records, oldest first."""
    problems = []
    if stop is not None:
        problems.append(f"stopped: {stop}")
    if first is not None:
        problems.append(f"differs first at step {first[0]} ({first[1]})")
    final = sess.summary_of(chain[-1]) if chain else Summary()
    step, total, status = final.step, final.total, final.status
    if stop is None and isinstance(step, int) and isinstance(total, int) and step < total and status != Status.STOPPED:
        problems.append(f"trained {step} of the {total} steps asked (its last session ended {status} at step "
                        f"{step}/{total}), and on Kaggle it would train as few: a loop that skips batches (an "
                        "epoch left empty, a loader that ends early) trains less than its run.steps or run.epochs "
                        "total; make it train every step it asks for")
    alone = summary.step if summary is not None else None
    if stop is None and isinstance(step, int) and isinstance(alone, int) and step != alone:
        problems.append(f"trained {step} steps, the uninterrupted run {alone}: resuming changed how many steps the "
                        "loop trains; check what the loop counts from (run.restore's step, the loader's epoch)")
    if stop is None and first is None and not identical:
        problems.append("incomplete: the chained trace is missing steps the reference has")
    if stop is None and not any((s.get("resumes_at") or 0) > 0 for s in chain):
        problems.append(f"proves nothing about resuming: the chain finished in {len(chain)} session"
                        f"{'s' if len(chain) != 1 else ''} and no session resumed from a saved state; {MORE_SESSIONS} "
                        "so the chain needs several sessions")
    elif stop is None and len(killed) < kills:
        problems.append(f"had {len(killed)} of the {kills} kills asked (--kills {kills}): the chain finished in "
                        f"session {len(chain)} before {'another' if killed else 'a'} session saved a checkpoint past "
                        f"its resume to be killed after; {MORE_SESSIONS} so the chain needs more sessions, or ask "
                        "fewer --kills")
    return problems


# What makes a chain of more sessions, in rehearse's own flags (planned in steps, or by time).
MORE_SESSIONS = "plan more sessions (--sessions N; with --by-time, a lower --session-limit) or raise the steps (--set steps=N)"


def _measure_publish(emu: Emulator, faults: Faults, echo: Echo) -> dict[str, float]:
    """The in-kernel publish's figures on this machine, for the sessions' deadline guard: a fresh
    process that imports torch and the kaggle client and authenticates (what kchain.common.publish does
    before its upload), timed once; the local Kaggle's upload is taken as fast, and its processing
    time as configured."""
    code = ("import torch, kchain.common.statefolder\n"
            "from kaggle.api.kaggle_api_extended import KaggleApi\nKaggleApi().authenticate()\n")
    env = {**os.environ, **emu.env(USER)}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True)
    start_s = time.monotonic() - started
    figures = {"start_s": round(2 * start_s, 2), "create_s": 2.0, "rate_bps": 50e6,
               "processing_s": float(faults.processing_s)}
    echo(f"  publish from the kernel measured: client start {start_s:.1f}s (planned with twice that)")
    return figures


def _print(echo: Echo, chain: list[sess.SessionRecord], rows: list[tuple[int, str, float, float | None]],
           killed: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    echo(f"{'session':>7}  {'status':<9} {'ended as':<12} {'resumed at':>10} {'reached':>8}  {'published':<9} uploaded")
    for s in chain:
        summary = sess.summary_of(s)
        publish = s.get("publish") or {}
        published = publish.get("published") or summary.published or "-"
        uploaded = f"{publish['uploaded_bytes'] / 1e6:.2f} MB" if publish.get("uploaded_bytes") else "-"
        ended = "KILLED" if s.get("version") in killed else summary.status or "no summary"
        echo(f"{s['session']:>7}  {s['status']:<9} {ended:<12} "
             f"{s.get('resumes_at', 0):>10} {summary.step or '-':>8}  {published:<9} {uploaded}")
    starts = {s.get("resumes_at", 0) for s in chain}
    shown = [r for r in rows if r[1] == "loss" and (r[0] - 1 in starts or r[0] % 25 == 0)]
    echo(f"{'step':>6}  {'uninterrupted':>16} {'chained':>16}")
    for step, _key, a, b in shown:
        mark = "  <- session boundary" if step - 1 in starts and step > 1 else ""
        echo(f"{step:>6}  {a:>16.8g} {'missing' if b is None else f'{b:.8g}':>16}{mark}")


FAULT_NAMES = {"429": "rate_429", "500": "rate_500", "lost_answer": "rate_lost_answer",
               "reset_after_acting": "rate_reset_after_acting", "drop_upload": None}


def emulator_switches(strict: bool) -> Switches:
    return Switches() if strict else Switches.lenient()


def parse_fault_spec(text: str, seed: int = 0) -> Faults:
    """--faults 429=0.15,500=0.10,lost_answer=0.1,drop_upload=0.1 (rates per call) -> Faults."""
    faults = Faults(seed=seed)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        try:
            rate = float(raw)
        except ValueError:
            rate = -1.0
        if not sep or name not in FAULT_NAMES or not 0 <= rate < 1:
            raise KchainError(f"--faults {item!r}: write name=rate with name one of {', '.join(FAULT_NAMES)} and a "
                              "rate in [0, 1), e.g. --faults 429=0.15,500=0.10,lost_answer=0.1,drop_upload=0.1")
        if name == "drop_upload":
            faults.drop_upload_every = round(1 / rate) if rate else 0
        elif (attr := FAULT_NAMES[name]) is None or not hasattr(faults, attr):
            raise KchainError(f"--faults {item!r}: this local Kaggle cannot inject {name} yet")
        else:
            setattr(faults, attr, rate)
    return faults


# -- a queue rehearsed: `kchain queue --rehearse` ---------------------------------------------------


@dataclass
class QueueRehearsal:
    """A week's queue (chain/queue.py) run against a private local Kaggle: its runs' ends and what must hold."""

    queue: Any  # chain.queue.Queue, each run's end
    most_at_once: int  # the most GPU sessions the local Kaggle ran at once
    refused_at_cap: int  # pushes Kaggle refused at the account's cap (the queue should never send one)
    sessions: dict[str, int]  # each run's chain: its sessions
    passed: bool
    verdict: str
    work: Path

    def line(self) -> str:
        return f"rehearsal of the queue: {self.verdict}"


def rehearse_queue(job_files: list[Path], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
                   factor: float | None, use_slack: bool, crash: str | None = None, sessions: int = 2,
                   echo: Echo = print, poll_s: float = 0.5, faults: Faults | None = None) -> QueueRehearsal:
    """The plan `kchain queue` would run (refused as it would be), run against a private local Kaggle with
    Kaggle's two GPU slots and its cap: each run's total in `sessions` spans (planned in steps, as `kchain
    rehearse` plans them), against what the quota week has left on this laptop's ledger; `crash`: that run's
    code raises at its first step (a bug one variant meets), so the queue's stop of that run is seen; faults: the
    local Kaggle's (`--faults`, parse_fault_spec), none by default. It passes
    when no third session was ever live, no push met the cap, the crashed run stopped after one session and
    every other run finished."""
    from kchain.chain import queue as queued
    from kchain.chain.plan import GPU_SLOTS, checked_plan, document

    placed, week = checked_plan(job_files, sets, seeds, steps, factor, None)  # the ledger's week: no Kaggle here
    queue = queued.from_plan(document(placed, week), use_slack)
    labels = [r.label for r in queue.runs]
    if crash is not None and crash not in labels:
        raise KchainError(f"--crash {crash}: the plan's runs are {', '.join(labels)}; name one of them")
    base = load_job(job_files[0])
    work = state_dir(base.path) / "rehearse" / new_run_id("queue")
    ledger = Ledger(work / "ledger")

    def job_of(run: Any) -> Job:
        job = _rehearsal_job(queued.run_job(run), Path(run.job_file), SAFETY_LIMIT_S, {}, None, by_time=False)
        return job.model_copy(update={"budget": job.budget.model_copy(update={"weekly_gpu_hours": week.left_h})})

    first = job_of(queue.runs[0])
    sources = local_inputs(first, state_dir(base.path) / "inputs", echo=echo)
    emu = _start_local_kaggle(first, work, sources, SAFETY_LIMIT_S, faults or Faults(), None, None, echo)
    _session_env(emu, local_ranks(first), sessions)
    for run in queue.runs:
        if run.label == crash:
            emu.runner.kernel_env[f"{USER}/{run.chain}"] = {layout.FAULT_ENV: "raise_at_step=1"}
    echo(f"kchain queue --rehearse: {len(queue.runs)} run(s), each in {sessions} session(s) planned in steps, on a "
         f"local Kaggle at {emu.url} with {GPU_SLOTS} GPU slots" + (f"; {crash} crashes at its first step" if crash else ""))
    try:
        with _env({**emu.env(USER), "KCHAIN_HOME": str(ledger.root), **_account_home(ledger)}):
            loop = queued.Loop(work / "queue.json", KaggleClient(backoff_s=0.2, max_backoff_s=2.0), echo,
                               skip_smoke=True, poll_s=poll_s, job_of=job_of)
            queued.run(queue, loop)
    finally:
        emu.stop()
    return judge_queue(queue, emu.sessions(), ledger, crash, work, echo)


def judge_queue(queue: Any, emulated: list[dict[str, Any]], ledger: Ledger, crash: str | None, work: Path,
                echo: Echo) -> QueueRehearsal:
    """What the rehearsed queue must show, the first problem its verdict."""
    from kchain.chain import queue as queued
    from kchain.common.sessionstate import SessionState

    ours = [s for s in emulated if s["kernel"] in {f"{USER}/{r.chain}" for r in queue.runs}]
    most = queued.most_at_once(ours)
    refused = sum(1 for chain in ledger.all_sessions().values() for s in chain
                  if s["status"] == SessionState.FAILED_TO_PUSH)
    counts = {r.chain: len(ledger.sessions(r.chain)) for r in queue.runs}
    problems = [f"{most} GPU sessions ran at once, more than Kaggle's 2"] if most > 2 else []
    problems += [f"{refused} push(es) met the account's cap"] if refused else []
    for run in queue.runs:
        if run.label == crash and (run.state != queued.RunState.STOPPED or counts[run.chain] != 1):
            problems.append(f"{run.label}, which crashed, is {run.state} after {counts[run.chain]} session(s)")
        elif run.label != crash and run.state != queued.RunState.FINISHED:
            problems.append(f"{run.label} is {run.state}: {run.said.splitlines()[0] if run.said else ''}")
    for line in queued.lines(queue):
        echo(line)
    verdict = problems[0] if problems else (
        f"the queue ran as planned: {', '.join(f'{r.label} {r.state} in {counts[r.chain]} session(s)' for r in queue.runs)}"
        f"; at most {most} GPU session(s) at once, none refused at the cap")
    echo(f"verdict: {verdict}")
    return QueueRehearsal(queue, most, refused, counts, not problems, verdict, work)
