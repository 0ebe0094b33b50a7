"""The smoke run: the notebook that push would send, run on this CPU on a tiny subset.

What it proves, in order: the notebook renders; the code starts, stages its data and passes its
preflight checks; it trains `smoke.steps` steps, validates and writes a checkpoint; a real SIGKILL
after that checkpoint and a resume in a fresh process give the same losses, bit for bit, as an
uninterrupted reference run of `2 x smoke.steps` steps. Each run is a process of its own with a hash seed of
its own, as each Kaggle session is (local.py drops the laptop's PYTHONHASHSEED).

`smoke()` is a straight run of stages: prepare (refuse a leftover framework checkpoint call, codecheck.py;
render, lay out the sandboxes) -> train (the reference
and the run to be killed, side by side, and the resume's notebook beside them, held at its gate) ->
resume (released once the killed run is dead: a fresh process that reads the checkpoint only then,
while the reference may still be running) -> judge (traces.judge, the states, train.keep_best's metric
logged) -> record (the run log, and the
smoke pass for push).

The resume starts early because its kernel, its Python and torch imports take seconds that would
otherwise follow the kill. Its training process waits
at the gate (runtime/launch.py `released`) before it builds the Run, so nothing of the killed run's
working dir is read before the kill; what it has done by then is start up, as on Kaggle.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kchain.common import atomic, layout
from kchain.common.statefolder import build_state_folder
from kchain.common.summary import Summary, read_working
from kchain.errors import SmokeFailed
from kchain.job import codecheck, diagnose
from kchain.job.inputs import local_inputs, mount_inputs
from kchain.job.render import Rendered, code_files, render_job, write_rendered
from kchain.job.spec import Job, load_job
from kchain.kaggle.credentials import configured_username
from kchain.local import statecheck
from kchain.result import traces
from kchain.store.ledger import Ledger, new_run_id, state_dir

if TYPE_CHECKING:
    from kchain.local.executor import NotebookThread

Echo = Callable[[str], None]
# What the notebook prints once it has reaped a training process that died of SIGKILL
# (kernel_templates/notebook.ipynb.j2): from then on nothing of that run writes to the working dir.
KILLED_LINE = f"TrainingFailed: training exited with code {-signal.SIGKILL};"


@dataclass
class Child:
    """One execution of the notebook with a fresh kernel of its own, driven from a thread of this process
    (local.NotebookThread): the kernel, its training processes and their deaths are real processes;
    the executor that sends the cells is not a Python to start and import again for each of the three."""

    name: str
    root: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    wall_s: float = 0.0  # from the start, or from the release for a child started at a gate
    gate: Path | None = None  # started early, held at this gate until release()
    _held: list[str] | None = None  # output kept back while held at the gate
    _echo: Echo | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _killed: threading.Event = field(default_factory=threading.Event)  # KILLED_LINE was printed
    _notebook: NotebookThread | None = None
    _t0: float = 0.0
    _released: float | None = None

    @property
    def summary(self) -> Summary | None:
        return read_working(self.root / layout.WORKING_DIR)

    def first_time(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)

    def start(self, notebook: Path, env: dict[str, str], echo: Echo | None) -> Child:
        from kchain.local.executor import NotebookThread

        self._echo = echo
        if self.gate is not None:
            self._held = []
            env = {**env, layout.GATE_ENV: f"{os.getpid()}:{self.gate}"}
        self._t0 = t0 = time.time()
        log = self.root.parent / f"{self.name}.log"

        pending = ""  # the output's last line, until its newline comes
        f = open(log, "w", encoding="utf-8")  # noqa: SIM115  (closed at the notebook's end, on its thread)

        def line_out(line: str) -> None:
            self.lines.append((time.time() - t0, line))
            f.write(line + "\n")
            f.flush()
            if line.startswith(KILLED_LINE):
                self._killed.set()
            # The notebook's own failure line repeats what the runtime already said.
            if echo is not None and not line.startswith("TrainingFailed:"):
                with self._lock:
                    if self._held is not None:
                        self._held.append(line)
                    else:
                        echo(f"    {line.rstrip()}")

        def on_output(_stream: str, text: str) -> None:
            nonlocal pending
            *whole, pending = (pending + text).split("\n")
            for line in whole:
                line_out(line)

        def on_end(error: str | None) -> None:
            if pending:
                line_out(pending)
            if error is not None:
                line_out(error)
            f.close()

        self._notebook = NotebookThread(notebook, self.root, env, on_output=on_output, on_end=on_end,
                                        name=f"smoke-{self.name}").start()
        return self

    @property
    def returncode(self) -> int | None:
        """0: every cell ran; 1: a cell failed (its error is the last line); None: still running."""
        return None if self._notebook is None else self._notebook.poll()

    def release(self, go: bool = True) -> Child:
        """Open the gate (`go`: the kill has happened) or tell the held child to leave (`stop`)."""
        assert self.gate is not None
        atomic.write_text(self.gate, "go" if go else "stop")  # the child reads the whole word or nothing
        self._released = time.time()
        with self._lock:
            held, self._held = self._held or [], None
            if go and self._echo is not None:
                for line in held:
                    self._echo(f"    {line.rstrip()}")
        return self

    def stop(self) -> None:
        """Kill the notebook's process tree if it still runs (the smoke is ending early: a signal, an error)."""
        if self._notebook is None or self._notebook.poll() is not None:
            return
        self._notebook.kill()
        self._notebook.wait()

    def cancel(self) -> None:
        """A child still held at its gate leaves without reading anything; wait for it to end."""
        if self._notebook is not None and self.gate is not None and not self.gate.exists():
            self.release(go=False).wait()

    def until_killed(self) -> Child:
        """Until the notebook reports its training process SIGKILLed, or the notebook ends: the
        resume need not wait for the killed run's kernel to shut down."""
        assert self._notebook is not None
        while not self._killed.wait(0.02):
            if self._notebook.poll() is not None:
                return self.wait()
        self.wall_s = time.time() - self._t0
        return self

    def wait(self) -> Child:
        assert self._notebook is not None
        self._notebook.wait()
        if not self._killed.is_set():  # a killed run's time ends at its kill (until_killed)
            self.wall_s = time.time() - (self._released or self._t0)
        return self


@dataclass
class SmokeReport:
    passed: bool
    run_id: str
    fingerprint: str
    timings: dict[str, float]
    reference: list[dict[str, Any]]
    resumed: list[dict[str, Any]]
    failure: diagnose.Failure | None = None
    verdict: str = ""
    checkpoint: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)  # the reference run's pace and asked total (record)


@dataclass
class Prepared:
    """What every stage after `prepare` works from."""

    job: Job
    ledger: Ledger
    run_id: str
    work: Path
    rendered: Rendered
    notebook: Path
    env: dict[str, str]
    render_s: float
    t_start: float
    ranks: int = 1
    tmp_dirs: list[Path] = field(default_factory=list)  # each session's own temp dir, removed at the end
    children: list[Child] = field(default_factory=list)  # every notebook started, stopped at the end

    def session_tmp(self) -> dict[str, str]:
        """A temp dir of its own, as every Kaggle session starts with an empty /tmp (short: DataLoader
        workers make Unix sockets there)."""
        self.tmp_dirs.append(Path(tempfile.mkdtemp(prefix="kc-s-")))
        return {"TMPDIR": str(self.tmp_dirs[-1])}

    @property
    def steps(self) -> int:
        return self.job.smoke.steps


def smoke(job_path: Path, echo: Echo = print, quiet_training: bool = False, download: bool = False,
          sets: dict[str, Any] | None = None, ranks_asked: int | None = None, job: Job | None = None) -> SmokeReport:
    """Run the smoke; raise SmokeFailed (after logging the run) unless it passes.

    `sets` are params over the job's and its smoke.params (--set), `ranks_asked` the rank count
    instead of the one the job gets on Kaggle (--ranks); `job`: the job as it will be pushed, when it is not
    job_path's as written (a run of `kchain queue`: its chain's name, its --set in its params)."""
    prep = prepare(job_path, echo, download, sets or {}, ranks_asked, job)
    show = None if quiet_training else echo
    try:
        reference, killed, held = train(prep, echo, show)
        try:
            failure = _stopped_right(prep, killed.until_killed())
            resumed = resume(prep, killed, held, echo) if failure is None else None
        finally:
            held.cancel()  # nothing to resume (or an error here): the held notebook leaves untouched
        report = judge(prep, reference.wait(), killed.wait(), resumed, failure, echo)
    finally:
        for child in prep.children:  # nothing outlives the smoke (ended by a signal or an error), then the tmp dirs go
            child.stop()
        for tmp in prep.tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
    return record(prep, report, killed, resumed, echo)


def prepare(job_path: Path, echo: Echo, download: bool, sets: dict[str, Any] | None = None,
            ranks_asked: int | None = None, job: Job | None = None) -> Prepared:
    """Load and render the job, lay out three /kaggle-like sandboxes with the inputs mounted: the
    reference, the run to stop and kill, and the resume (an empty working dir, as a new session's).
    Code that saves a framework's own checkpoint is refused first, before anything is laid out (codecheck.py)."""
    t_start = time.time()
    job = job or load_job(job_path)
    codecheck.refuse_leftover_saves(code_files(job)[0])
    ledger = Ledger(state_dir(job.path))
    run_id = new_run_id("smoke")
    work = ledger.root / "smoke" / run_id
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rendered = render_job(job, owner=job.kaggle.owner or configured_username())
    write_rendered(rendered, work / "kernel")
    notebook = work / "kernel" / rendered.notebook_file
    render_s = time.time() - t_start
    echo(f"  render     {render_s:5.2f}s  fingerprint {rendered.fingerprint[:12]}  ({notebook.stat().st_size // 1024} KB)")

    sources = local_inputs(job, ledger.root / "inputs", download=download, echo=echo)
    for name in ("reference", "run", "resume"):
        (work / name).mkdir()
        mount_inputs(work / name, sources)
    n = ranks(job, ranks_asked)
    env = dict(os.environ)
    env.update({
        layout.SMOKE_ENV: "1",
        layout.TOTAL_STEPS_ENV: str(2 * job.smoke.steps),
        layout.CHECKPOINT_EVERY_ENV: f"{job.smoke.steps} steps",
        "PYTHONUNBUFFERED": "1",
        **ranks_env(n),
    })
    if sets:
        env[layout.SMOKE_PARAMS_ENV] = json.dumps(sets)
    env.setdefault("OMP_NUM_THREADS", str(threads_each(n)))
    for var in (layout.SESSION_LIMIT_ENV, layout.FAULT_ENV, layout.SESSION_START_ENV):
        env.pop(var, None)
    return Prepared(job, ledger, run_id, work, rendered, notebook, env, render_s, t_start, n)


# The run to kill reaches its checkpoint through a deadline stop, not the cadence: the stop's save
# (whatever the code does between the stop and the save, an unfinished epoch's code included) is what
# the resume must match. No cadence save comes first.
NO_CADENCE = f"{10**9} steps"


def train(prep: Prepared, echo: Echo, show: Echo | None) -> tuple[Child, Child, Child]:
    """Start the uninterrupted reference, the run that stops at a deadline after `smoke.steps` steps
    and is SIGKILLed right after the stop's checkpoint, and the resume's notebook, held at its gate
    until the kill."""
    steps = prep.steps
    echo(f"  train      {steps} steps, a deadline stop, its checkpoint, SIGKILL; reference run of {2 * steps} "
         f"steps beside it; {ranks_label(prep.ranks)}, {prep.env['OMP_NUM_THREADS']} CPU thread(s) each")
    reference = Child("reference", prep.work / "reference")
    killed = Child("run", prep.work / "run")
    held = Child("resume", prep.work / "resume", gate=prep.work / "resume.gate")
    prep.children += [reference, killed, held]
    reference.start(prep.notebook, prep.env, None)
    kill_env = {**prep.env, layout.FAULT_ENV: f"deadline_at_step={steps},kill_after_checkpoint=1",
                layout.CHECKPOINT_EVERY_ENV: NO_CADENCE}
    killed.start(prep.notebook, {**kill_env, **prep.session_tmp()}, show)
    held.start(prep.notebook, {**prep.env, **prep.session_tmp()}, show)
    return reference, killed, held


def kaggle_ranks(job: Job) -> int:
    """The ranks the job gets in a Kaggle session: train.gpus, and for `auto` one per GPU of the
    accelerator (GPU T4 x2: 2; none: 1)."""
    if job.train.gpus == "auto":
        return 2 if job.kaggle.accelerator == "gpu" else 1
    return int(job.train.gpus)


def ranks(job: Job, asked: int | None = None) -> int:
    """Ranks per local run (smoke, rehearse): as many as on Kaggle, as gloo ranks on this CPU, unless
    `asked` (--ranks) says otherwise."""
    return asked if asked is not None else kaggle_ranks(job)


def ranks_env(n: int) -> dict[str, str]:
    """The environment that makes a local run start `n` ranks whatever this machine's GPUs."""
    return {layout.RANKS_ENV: str(n)}


def ranks_label(n: int) -> str:
    return f"{n} ranks (gloo, CPU), the whole group SIGKILLed" if n > 1 else "1 rank (CPU)"


def threads_each(n_ranks: int) -> int:
    """CPU threads per training process: the cores shared by the two runs that train at once.

    torch's default (a thread per core in every process) oversubscribes the cores, and its OpenMP
    threads spin while they wait: each smoke step took ~3 s instead of ~0.15 s on 2 cores. The three
    runs get the same count, so their float results stay comparable bit for bit. OMP_NUM_THREADS set
    by the user wins (torchrun makes the same choice for its ranks).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (2 * n_ranks))


def _stopped_right(prep: Prepared, killed: Child) -> diagnose.Failure | None:
    """The killed run's own failure, or why it cannot be resumed (no checkpoint, or it was never killed)."""
    failure = _child_failure(killed)
    if failure is not None:
        return failure
    ckpts = sorted((killed.root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).glob(
        f"{layout.CHECKPOINT_PREFIX}*"
    ))
    if not ckpts:
        note = (killed.summary or Summary()).note or "the run ended without writing a checkpoint"
        return diagnose.Failure(
            "NoCheckpoint", f"{note}; train with `for step in run.steps(total)` or `for epoch in run.epochs(n)`",
            "checkpoint", "the runtime can only checkpoint and resume a loop it drives (or one that calls run.save)",
        )
    if killed.returncode == 0:
        return diagnose.Failure(
            "NotKilled", f"the run finished before the kill; make run.steps(total) at least {2 * prep.steps} steps",
            "checkpoint", "the smoke needs steps after the checkpoint to prove the resume",
        )
    return None


def resume(prep: Prepared, killed: Child, held: Child, echo: Echo) -> Child:
    """Release the resume now that the killed run is dead: a fresh process, started beside the others
    and held before it read anything, resumes from the checkpoint (the reference may still be running).

    It starts as a Kaggle session does: an empty working dir, the killed run's checkpoint attached as
    the state dataset and its staged data as the cache dataset. Nothing else the killed run wrote
    reaches it, so state a job keeps only in its own files fails here, not on Kaggle."""
    echo(f"  kill       {time.time() - prep.t_start:5.2f}s  SIGKILL after the stop's checkpoint at step {prep.steps}; "
         f"the training took {killed.wall_s:.1f}s")
    _attach_state(killed.root, held.root, prep.rendered.config)
    echo("  resume     fresh process, empty working dir, the checkpoint attached as the state dataset "
         "(started beside the runs, released at the kill)")
    resumed = held.release().wait()
    echo(f"  resumed    {time.time() - prep.t_start:5.2f}s  in {resumed.wall_s:.1f}s")
    return resumed


def _attach_state(killed_root: Path, resume_root: Path, config: dict[str, Any]) -> None:
    """Mount what a chain carries to the next session in the resume's sandbox: the newest complete
    checkpoint as the state dataset version (statefolder's flat layout) and the staged-data cache
    as the cache dataset. Not verified here: the resuming runtime verifies what it loads."""
    kchain_dir = killed_root / layout.WORKING_DIR / layout.KCHAIN_DIR
    kaggle = config.get("kaggle") or {}
    job = config.get("job", "job")
    owner, _, state_slug = (kaggle.get("state_dataset") or f"smoke/{job}-state").rpartition("/")
    ckpts = sorted(p for p in (kchain_dir / layout.CHECKPOINTS_DIR).glob(f"{layout.CHECKPOINT_PREFIX}*")
                   if (p / layout.MANIFEST).is_file())
    inputs = resume_root / layout.INPUT_DIR / "datasets" / owner
    inputs.mkdir(parents=True, exist_ok=True)
    if ckpts:
        manifest = json.loads((ckpts[-1] / layout.MANIFEST).read_text())
        build_state_folder(kchain_dir, inputs / state_slug, "smoke", found=(ckpts[-1], manifest))
    cache = kchain_dir / layout.CACHE_DIR
    if cache.is_dir():
        cache_slug = (kaggle.get("cache_dataset") or f"{owner}/{job}-cache").rpartition("/")[2]
        (inputs / cache_slug).symlink_to(cache, target_is_directory=True)


def judge(prep: Prepared, reference: Child, killed: Child, resumed: Child | None,
          failure: diagnose.Failure | None, echo: Echo) -> SmokeReport:
    """The verdict: a failure of any child first, then the traces compared step by step."""
    if failure is None or failure.type in ("NoCheckpoint", "NotKilled"):
        failure = _child_failure(reference) or failure
    if failure is None and resumed is not None:
        failure = _child_failure(resumed, stage="resume")
    report = SmokeReport(
        passed=False, run_id=prep.run_id, fingerprint=prep.rendered.fingerprint,
        timings=_timings(prep.render_s, killed, resumed) if resumed else {"render": prep.render_s},
        reference=traces.read_trace(traces.sandbox_trace(reference.root)),
        resumed=traces.read_trace(traces.sandbox_trace(resumed.root)) if resumed else [],
        failure=failure,
    )
    not_exact = list((reference.summary or Summary()).not_exact or [])
    for line in not_exact:
        echo(f"  not exact  {line}")
    if failure is None:
        rows, report.failure, report.verdict = traces.judge(
            report.reference, report.resumed, prep.steps, 2 * prep.steps, not_exact,
        )
        traces.print_traces(echo, rows, prep.steps)
        report.failure, report.verdict = _judge_state(prep, reference, killed, resumed, report, echo)
    if report.failure is None:
        report.failure = _judge_keep_best(prep, report)
    report.passed = report.failure is None
    report.measured = _measured(reference.summary, prep.env)
    summary = (resumed.summary if resumed else None) or killed.summary or Summary()
    report.checkpoint = summary.checkpoint
    if report.passed and not any("[kchain] check" in line for _, line in killed.lines):
        echo("  note       no preflight checks ran: hand a batch and the splits to run.check(...) so shape, "
             "dtype, label and split bugs stop before the loop")
    return report


def _judge_state(prep: Prepared, reference: Child, killed: Child, resumed: Child | None, report: SmokeReport,
                echo: Echo) -> tuple[diagnose.Failure | None, str]:
    """The checkpoints compared value by value (statecheck.py) at every step the reference and the
    killed or resumed run both saved: a trace that agrees with a state that does not is a failure."""
    runs = [killed.root, *([resumed.root] if resumed else [])]
    comparison = statecheck.compare(
        statecheck.saved([statecheck.checkpoints_of(reference.root / layout.WORKING_DIR)]),
        statecheck.saved(statecheck.checkpoints_of(root / layout.WORKING_DIR) for root in runs))
    failure, verdict = report.failure, report.verdict
    diff = comparison.first
    if diff is None:
        if failure is None and comparison.steps:
            what = ("every tracked tensor, the untracked state, the RNGs, the loader positions" if comparison.whole
                    else comparison.not_compared())
            echo(f"  state      {comparison.values} values equal at step{'s' if len(comparison.steps) > 1 else ''} "
                 f"{', '.join(map(str, comparison.steps))} ({what})")
            if comparison.whole:
                verdict = verdict.replace("bit for bit (", "bit for bit, state and trace (", 1)
            if comparison.excluded:  # left out on purpose (run.untrack): never claimed as compared
                verdict += f"; {comparison.excluded_note()}"
        return failure, verdict
    line = statecheck.describe(diff, statecheck.largest(diff), traces_agree=failure is None)
    echo(f"  state      {line}")
    if failure is None:
        return diagnose.Failure("StateMismatch", line, "resume", statecheck.cause(comparison, prep.steps)), ""
    if failure.type == "ResumeMismatch":  # the state names what the trace could only guess
        return diagnose.Failure(failure.type, f"{failure.message}; {line}", failure.stage, failure.hint), verdict
    return failure, verdict


def _judge_keep_best(prep: Prepared, report: SmokeReport) -> diagnose.Failure | None:
    """A metric train.keep_best names that the smoke's runs never logged: a chain would keep no best and
    `pull --best` would fail at the end. Only a metric job.yaml names is checked: the default follows
    run.best's (whatever is logged), and off keeps none. run.every(n) evaluates on the smoke's last step too,
    so a cadence longer than the smoke still logs."""
    from kchain.common import keepbest

    choice = keepbest.parse((prep.rendered.config.get("train") or {}).get("keep_best"))
    metric = choice.metric if choice is not None else None
    seen = list(dict.fromkeys(key for row in [*report.reference, *report.resumed] for key, value in row.items()
                              if key not in ("step", "time") and isinstance(value, (int, float))
                              and not isinstance(value, bool)))
    if metric is None or metric in seen:
        return None
    return diagnose.Failure(
        "KeepBestNotLogged", f"{prep.job.path}: train.keep_best: {metric} was never logged in the smoke (it logged "
        f"{', '.join(seen)}): log it with run.log({metric}=...) or name one of those", "checkpoint",
        f"an evaluation on a cadence of its own (`if step % 500 == 0`) may never come in a smoke's {2 * prep.steps} "
        "steps: put it under `if run.every(500):`, which also evaluates on the last step; or train.keep_best: off")


def record(prep: Prepared, report: SmokeReport, killed: Child, resumed: Child | None, echo: Echo) -> SmokeReport:
    """Write the run-log line (and the smoke pass push looks for); raise SmokeFailed on a failure."""
    job, failure = prep.job, report.failure
    val = traces.last_val(report.resumed or report.reference)
    if failure is None:
        prep.ledger.record_smoke_pass(report.fingerprint, report.run_id, job.name, report.measured)
        echo(f"  verdict    {report.verdict}")
        total_s = time.time() - prep.t_start
        echo(f"  total      {total_s:.1f}s  ({', '.join(f'{k} {v:.1f}s' for k, v in report.timings.items())})")
        prep.ledger.append_run(
            run_id=report.run_id, channel="smoke", job=job.name, config=report.fingerprint[:12],
            steps=2 * prep.steps, val=val, checkpoint=report.checkpoint, note="smoke pass",
        )
        return report
    summary = (resumed.summary if resumed else None) or killed.summary or Summary()
    prep.ledger.append_run(
        run_id=report.run_id, channel="smoke", job=job.name, config=report.fingerprint[:12],
        steps=summary.step or "", val=val, checkpoint=report.checkpoint,
        note=f"{failure.type}: {failure.message}",
    )
    where = f" (during {failure.stage})" if failure.stage else ""
    echo(f"  FAILED{where}: {failure.type}: {failure.message}")
    echo(f"  hint: {failure.hint}")
    echo(f"  logs: {prep.work}")
    raise SmokeFailed(f"smoke failed{where}: {failure.type}: {failure.message}")


def _measured(summary: Summary | None, env: dict[str, str]) -> dict[str, Any]:
    """What `kchain plan` sizes a run from: the uninterrupted reference's pace on this laptop (its steps
    alone, beside the other runs of the smoke) and the total the code asked for before the smoke's cap."""
    if summary is None or not summary.steps_per_s:
        return {}
    return {"steps_per_s": summary.steps_per_s, "total": summary.total_asked or summary.total,
            "sets": json.loads(env.get(layout.SMOKE_PARAMS_ENV) or "{}")}


def _timings(render_s: float, killed: Child, resumed: Child) -> dict[str, float]:
    started = killed.first_time("[kchain]") or 0.0
    first_step = killed.first_time("[kchain] step") or killed.first_time("step ") or started
    return {
        "render": render_s,
        "executor start": started,
        "preflight": max(0.0, first_step - started),
        "steps": max(0.0, killed.wall_s - first_step),
        "kill and resume": resumed.wall_s,
    }


def _child_failure(child: Child, stage: str | None = None) -> diagnose.Failure | None:
    summary = child.summary
    failure = diagnose.from_summary(summary)
    if failure is not None:
        return failure
    if summary is None and child.returncode not in (0, None):
        # Killed on purpose (the run to resume) leaves no summary; anything else is a crash before the
        # runtime could write one (an import error, a syntax error).
        text = "\n".join(line for _, line in child.lines)
        crashed = diagnose.from_log(text)
        if crashed is not None and "exited with code -9" not in crashed.message:
            return diagnose.Failure(crashed.type, crashed.message, stage or "build", crashed.hint)
        if "code -9" not in text:
            return diagnose.Failure(
                "NotebookFailed", f"the notebook exited with {child.returncode}", stage or "build",
                diagnose.hint_for("", text[-500:]),
            )
    return None
