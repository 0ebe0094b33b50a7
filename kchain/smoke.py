"""The smoke run: the notebook that push would send, run on this CPU on a tiny subset.

What it proves, in order: the notebook renders; the code starts, stages its data and passes its
preflight checks; it trains `smoke.steps` steps, validates and writes a checkpoint; a real SIGKILL
after that checkpoint and a resume in a fresh process give the same losses, bit for bit, as an
uninterrupted reference run of `2 x smoke.steps` steps. The reference and the killed run execute at
the same time (this machine has two cores); then the resume runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kchain import diagnose
from kchain.errors import SmokeFailed, SpecError
from kchain.kaggle_api import configured_username
from kchain.ledger import Ledger, new_run_id, state_dir
from kchain.render import Rendered, render_job, write_rendered
from kchain.runtime import layout
from kchain.spec import Job, load_job

Echo = Callable[[str], None]


@dataclass
class Phase:
    """One execution of the notebook in its own process."""

    name: str
    root: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None
    wall_s: float = 0.0

    @property
    def summary(self) -> dict[str, Any] | None:
        path = self.root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def first_time(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)

    def last_time(self, needle: str) -> float | None:
        return next((t for t, line in reversed(self.lines) if needle in line), None)


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


def input_refs(job: Job) -> list[tuple[str, str, str, str | None]]:
    """(kind, owner, slug, version) of every attached input."""
    refs: list[tuple[str, str, str, str | None]] = []
    for ref in job.kaggle.datasets:
        parts = ref.split("/")
        refs.append(("datasets", parts[0], parts[1], parts[2] if len(parts) > 2 else None))
    if job.kaggle.competition:
        refs.append(("competitions", "", job.kaggle.competition, None))
    return refs


def local_inputs(job: Job, cache: Path, download: bool = False, echo: Echo = print) -> dict[tuple[str, str, str], Path]:
    """Where each input lives on this machine: kaggle.local, else a download cached under .kchain/inputs."""
    found: dict[tuple[str, str, str], Path] = {}
    for kind, owner, slug, version in input_refs(job):
        local = job.kaggle.local.get(slug)
        if local is not None:
            source = (job.root / local).resolve()
            if not source.is_dir():
                raise SpecError(f"{job.path}: kaggle.local.{slug}: {local!r} is not a folder; fix the path")
            found[(kind, owner, slug)] = source
            continue
        cached = cache / kind / (owner or "_") / slug / (version or "latest")
        if not (cached.is_dir() and any(cached.iterdir())):
            if not download or kind != "datasets":
                how = " or pass --download to fetch it once" if kind == "datasets" else ""
                raise SpecError(
                    f"{job.path}: kaggle.local.{slug}: no local copy of {kind[:-1]} {slug!r} for the smoke run; "
                    f"add kaggle.local: {{{slug}: path/to/a/small/copy}}{how}"
                )
            from kchain.kaggle_api import KaggleClient

            echo(f"  download   {owner}/{slug}{f'/{version}' if version else ''} into {cached}")
            KaggleClient(progress=True).download_dataset(f"{owner}/{slug}", int(version) if version else None,
                                                         cached, unzip=True)
        found[(kind, owner, slug)] = cached
    return found


def mount_inputs(root: Path, sources: dict[tuple[str, str, str], Path]) -> None:
    """Lay the inputs out under ROOT/input like Kaggle's current layout (links, nothing copied)."""
    for (kind, owner, slug), source in sources.items():
        target = root / layout.INPUT_DIR / kind / owner / slug if owner else root / layout.INPUT_DIR / kind / slug
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)


def _spawn(phase: Phase, notebook: Path, env: dict[str, str], echo: Echo | None) -> subprocess.Popen:
    log = phase.root.parent / f"{phase.name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kchain.local", "run", str(notebook), "--root", str(phase.root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    t0 = time.time()

    def pump() -> None:
        assert proc.stdout is not None
        with proc.stdout, open(log, "w", encoding="utf-8") as f:
            for line in proc.stdout:
                phase.lines.append((time.time() - t0, line.rstrip("\n")))
                f.write(line)
                # The notebook's own failure line repeats what the runtime already said.
                if echo is not None and not line.startswith("TrainingFailed:"):
                    echo(f"    {line.rstrip()}")

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    proc._kchain_pump = thread  # type: ignore[attr-defined]
    proc._kchain_t0 = t0  # type: ignore[attr-defined]
    return proc


def _wait(phase: Phase, proc: subprocess.Popen) -> None:
    phase.returncode = proc.wait()
    proc._kchain_pump.join()  # type: ignore[attr-defined]
    phase.wall_s = time.time() - proc._kchain_t0  # type: ignore[attr-defined]


def read_trace(path: Path) -> list[dict[str, Any]]:
    """A metrics trace (JSON lines); [] when the run never logged."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def sandbox_trace(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.METRICS


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))
    }


def compare_traces(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]]
) -> tuple[list[tuple[int, str, float, float | None]], tuple[int, str] | None]:
    """Rows (step, metric, reference, resumed) and the first (step, metric) that differs."""
    rows: list[tuple[int, str, float, float | None]] = []
    first: tuple[int, str] | None = None
    by_step: dict[tuple[int, str], float] = {}
    for rec in resumed:
        for key, value in _numbers(rec).items():
            by_step[(rec["step"], key)] = value
    for rec in reference:
        for key, value in _numbers(rec).items():
            other = by_step.get((rec["step"], key))
            rows.append((rec["step"], key, value, other))
            same = other is not None and (other == value or (math.isnan(value) and math.isnan(other)))
            if not same and first is None:
                first = (rec["step"], key)
    return rows, first


def likely_cause(first: tuple[int, str], resume_step: int, not_exact: list[str] | None = None) -> str:
    step, key = first
    if step <= resume_step:
        return "the trace before the kill differs: the training is not deterministic even without a resume"
    if not_exact:  # the runtime already named what it cannot restore (a hand-built DataLoader, a stream)
        return not_exact[0]
    if key.startswith("val"):
        return "only validation differs: validation uses randomness that is not seeded or tracked"
    if step == resume_step + 1:
        return (
            "the first step after the resume differs: the data order is not from run.loader, or a "
            "generator or RNG the model uses is not in run.track"
        )
    return (
        "the first resumed step matches but later ones drift: optimizer, LR scheduler or GradScaler "
        "state is not in run.track (run.optimize tracks the optimizer for you)"
    )


def _timings(render_s: float, run: Phase, resume: Phase) -> dict[str, float]:
    started = run.first_time("[kchain]") or 0.0
    first_step = run.first_time("[kchain] step") or run.first_time("step ") or started
    killed = run.wall_s
    return {
        "render": render_s,
        "executor start": started,
        "preflight": max(0.0, first_step - started),
        "steps": max(0.0, killed - first_step),
        "kill and resume": resume.wall_s,
    }


def smoke(job_path: Path, echo: Echo = print, quiet_training: bool = False, download: bool = False) -> SmokeReport:
    """Run the smoke; raise SmokeFailed (after logging the run) unless it passes."""
    t_start = time.time()
    job = load_job(job_path)
    ledger = Ledger(state_dir(job.path))
    run_id = new_run_id("smoke")
    work = ledger.root / "smoke" / run_id
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    rendered: Rendered = render_job(job, owner=job.kaggle.owner or configured_username())
    nb_dir = work / "kernel"
    write_rendered(rendered, nb_dir)
    notebook = nb_dir / rendered.notebook_file
    render_s = time.time() - t_start
    echo(f"  render     {render_s:5.2f}s  fingerprint {rendered.fingerprint[:12]}  ({notebook.stat().st_size // 1024} KB)")

    steps = job.smoke.steps
    ref, run, resume = Phase("reference", work / "reference"), Phase("run", work / "run"), None
    sources = local_inputs(job, ledger.root / "inputs", download=download, echo=echo)
    for phase in (ref, run):
        phase.root.mkdir()
        mount_inputs(phase.root, sources)
    base_env = dict(os.environ)
    base_env.update(
        {
            layout.SMOKE_ENV: "1",
            layout.TOTAL_STEPS_ENV: str(2 * steps),
            layout.CHECKPOINT_EVERY_ENV: f"{steps} steps",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for var in (layout.SESSION_LIMIT_ENV, layout.FAULT_ENV, layout.SESSION_START_ENV):
        base_env.pop(var, None)
    kill_env = {**base_env, layout.FAULT_ENV: "kill_after_checkpoint=1"}

    echo(f"  train      {steps} steps, checkpoint, SIGKILL; reference run of {2 * steps} steps beside it")
    show = None if quiet_training else echo
    procs = [(ref, _spawn(ref, notebook, base_env, None)), (run, _spawn(run, notebook, kill_env, show))]
    for phase, proc in procs:
        _wait(phase, proc)

    failure = _phase_failure(run) or _phase_failure(ref)
    not_exact = list((ref.summary or {}).get("not_exact") or [])
    for line in not_exact:
        echo(f"  not exact  {line}")
    reference = read_trace(sandbox_trace(ref.root))
    resumed: list[dict[str, Any]] = []
    resume_step = steps
    timings: dict[str, float] = {"render": render_s}
    if failure is None:
        ckpts = sorted((run.root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).glob(
            f"{layout.CHECKPOINT_PREFIX}*"
        ))
        if not ckpts:
            note = (ref.summary or {}).get("note") or "the run ended without writing a checkpoint"
            failure = diagnose.Failure(
                "NoCheckpoint",
                f"{note}; train with `for step in run.steps(total)` or `for epoch in run.epochs(n)`",
                "checkpoint",
                "the runtime can only checkpoint and resume a loop it drives (or one that calls run.save)",
            )
        elif run.returncode == 0:
            failure = diagnose.Failure(
                "NotKilled",
                f"the run finished before the kill; make run.steps(total) at least {2 * steps} steps",
                "checkpoint",
                "the smoke needs steps after the checkpoint to prove the resume",
            )
        else:
            echo(f"  kill       {time.time() - t_start:5.2f}s  SIGKILL after the checkpoint at step {resume_step} "
                 f"({ckpts[-1].name}); the training took {run.wall_s:.1f}s")
            resume = Phase("resume", run.root)
            echo("  resume     fresh process from the checkpoint")
            proc = _spawn(resume, notebook, base_env, show)
            _wait(resume, proc)
            failure = _phase_failure(resume, stage="resume")
            resumed = read_trace(sandbox_trace(run.root))
            timings = _timings(render_s, run, resume)
            echo(f"  resumed    {time.time() - t_start:5.2f}s  in {resume.wall_s:.1f}s")

    report = SmokeReport(
        passed=False,
        run_id=run_id,
        fingerprint=rendered.fingerprint,
        timings=timings,
        reference=reference,
        resumed=resumed,
        failure=failure,
    )
    if failure is None:
        rows, first = compare_traces(reference, resumed)
        _print_traces(echo, rows, resume_step)
        bad = next(((step, key, value) for step, key, value, _ in rows if not math.isfinite(value)), None)
        if not rows:
            failure = diagnose.Failure(
                "NoMetrics", "nothing was logged; call run.log(loss=...) every step", "step",
                "the smoke compares logged losses to prove the resume",
            )
        elif bad is not None:
            failure = diagnose.Failure(
                "NonFiniteMetric", f"{bad[1]} is {bad[2]} at step {bad[0]}", "step",
                "a loss that is already nan or inf in two steps will be on the GPU too: check the learning "
                "rate, the input scale, the labels and any log/division in the loss",
            )
        elif max((r[0] for r in rows), default=0) <= resume_step or not any(
            rec["step"] > resume_step for rec in resumed
        ):
            failure = diagnose.Failure(
                "ResumeNotExercised",
                f"no step after the checkpoint at step {resume_step} was compared",
                "resume",
                f"run.steps(total) must allow at least {2 * steps} steps in a smoke run",
            )
        elif first is not None:
            cause = likely_cause(first, resume_step, not_exact)
            failure = diagnose.Failure(
                "ResumeMismatch",
                f"{first[1]} at step {first[0]} differs from the uninterrupted run",
                "resume",
                cause,
            )
        else:
            biggest = max(abs(r[2] - (r[3] or 0.0)) for r in rows)
            report.verdict = (
                f"PASS: resumed run equals the uninterrupted run bit for bit "
                f"({len(rows)} values over {2 * steps} steps, largest difference {biggest:.1e})"
            )
        report.failure = failure
    summary = (resume.summary if resume else None) or run.summary or {}
    report.checkpoint = summary.get("checkpoint")
    val = _last_val(resumed or reference)
    total_s = time.time() - t_start
    if failure is None and not any("[kchain] check" in line for _, line in run.lines):
        echo("  note       no preflight checks ran: hand a batch and the splits to run.check(...) so shape, "
             "dtype, label and split bugs stop before the loop")
    if failure is None:
        report.passed = True
        ledger.record_smoke_pass(rendered.fingerprint, run_id, job.name)
        echo(f"  verdict    {report.verdict}")
        echo(f"  total      {total_s:.1f}s  ({', '.join(f'{k} {v:.1f}s' for k, v in timings.items())})")
        ledger.append_run(
            run_id=run_id, channel="smoke", job=job.name, config=rendered.fingerprint[:12],
            steps=2 * steps, val=val, checkpoint=report.checkpoint, note="smoke pass",
        )
        return report

    ledger.append_run(
        run_id=run_id, channel="smoke", job=job.name, config=rendered.fingerprint[:12],
        steps=(summary.get("step") if summary else "") or "", val=val, checkpoint=report.checkpoint,
        note=f"{failure.type}: {failure.message}",
    )
    where = f" (during {failure.stage})" if failure.stage else ""
    echo(f"  FAILED{where}: {failure.type}: {failure.message}")
    echo(f"  hint: {failure.hint}")
    echo(f"  logs: {work}")
    raise SmokeFailed(f"smoke failed{where}: {failure.type}: {failure.message}")


def _phase_failure(phase: Phase, stage: str | None = None) -> diagnose.Failure | None:
    summary = phase.summary
    failure = diagnose.from_summary(summary)
    if failure is not None:
        return failure
    if summary is None and phase.returncode not in (0, None):
        # Killed on purpose (the run phase) leaves no summary; anything else is a crash before the
        # runtime could write one (an import error, a syntax error).
        text = "\n".join(line for _, line in phase.lines)
        crashed = diagnose.from_log(text)
        if crashed is not None and "exited with code -9" not in crashed.message:
            return diagnose.Failure(crashed.type, crashed.message, stage or "build", crashed.hint)
        if "code -9" not in text:
            return diagnose.Failure(
                "NotebookFailed", f"the notebook exited with {phase.returncode}", stage or "build",
                diagnose.hint_for("", text[-500:]),
            )
    return None


def _last_val(trace: list[dict[str, Any]]) -> str:
    for rec in reversed(trace):
        for key, value in rec.items():
            if key.startswith("val") and isinstance(value, (int, float)):
                return f"{value:.6g}"
    return ""


def _print_traces(echo: Echo, rows: list[tuple[int, str, float, float | None]], resume_step: int) -> None:
    echo(f"  {'step':>6}  {'metric':<12} {'uninterrupted':>16} {'killed+resumed':>16}  diff")
    for step, key, ref, got in rows:
        marker = "  <- resumed here" if step == resume_step + 1 and key == rows[0][1] else ""
        if got is None:
            echo(f"  {step:>6}  {key:<12} {ref:>16.8g} {'missing':>16}  -{marker}")
        else:
            echo(f"  {step:>6}  {key:<12} {ref:>16.8g} {got:>16.8g}  {abs(ref - got):.1e}{marker}")
