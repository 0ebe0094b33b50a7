"""`kchain smoke --target` and `kchain rehearse --target`: the rendered engine script, run here.

The script SkyPilot's `run:` or the sbatch file holds is run on this machine with the engine's
environment variables (SKYPILOT_* or SLURM_*), a local folder as the bucket (or the shared state
folder), and each "machine" a fresh, empty root. The stages, each a real process:

    machine 1: a SIGTERM to the script (a preemption's warning) once step k is saved: the script
               passes it on, the runtime saves step s and publishes it -> exit 75 "saved, not done"
               (Slurm: the script asks for a requeue)
    machine 2: a fresh root, resumes from the bucket at s, saves a newer checkpoint locally and is
               SIGKILLed before it reaches the bucket (KCHAIN_FAULT sink_kill=after_local)
    machine 3: a fresh, empty root: resumes from the bucket's step s and trains to 3k -> exit 0

beside an uninterrupted reference of 3k steps on a bucket of its own (k = smoke.steps; machine 1's
steps are slowed by a stall, which changes no number, so the signal lands before the end). It passes
only when every exit code is the one the engine acts on, the bucket still said s after the kill,
machine 3 resumed at s, and its trace equals the reference bit for bit. What it cannot run here: the
engine itself (provisioning, the bucket mount, preemption, Slurm's requeue), and the task's setup.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kchain.common import layout
from kchain.common.sink import read_pointer
from kchain.common.summary import Summary, read_working
from kchain.errors import KchainError, SmokeFailed
from kchain.job.spec import Job, load_job
from kchain.local.executor import HASH_SEED_ENV
from kchain.local.smoke import threads_each
from kchain.result import traces
from kchain.store.ledger import Ledger, new_run_id, state_dir
from kchain.targets import skypilot, slurm
from kchain.targets.commands import render_for
from kchain.targets.workfolder import write_folder

Echo = Callable[[str], None]
TIMEOUT_S = 900  # one stage; a smoke-sized one takes seconds
POLL_S = 0.05  # how often machine 1's checkpoints are looked at for the SIGTERM
STALL_S = 1.0  # seconds machine 1 sleeps after each step, so the SIGTERM lands before its last step
KILLED = 128 + signal.SIGKILL  # what bash reports for a child SIGKILLed
# A stand-in for Slurm's scontrol on PATH: it records the requeue the script asks for.
SCONTROL = '#!/bin/sh\necho "$@" >> "$(dirname "$0")/scontrol.calls"\n'


@dataclass
class Stage:
    name: str
    root: Path  # the machine: HOME (SkyPilot) or TMPDIR (Slurm) of the run
    returncode: int | None = None
    lines: list[str] = field(default_factory=list)
    signalled: bool = False  # the rehearsal sent the script SIGTERM

    @property
    def kchain_root(self) -> Path:
        return next(self.root.glob("kchain-*"), self.root / "kchain-root")

    @property
    def summary(self) -> Summary | None:
        return read_working(self.kchain_root / layout.WORKING_DIR)


@dataclass
class TargetRehearsal:
    passed: bool
    verdict: str
    fingerprint: str
    stages: list[Stage]
    work: Path
    problems: list[str] = field(default_factory=list)


def _engine_env(target: str, job: Job, stage: Stage, number: int, sink: Path, bin_dir: Path) -> dict[str, str]:
    """The environment a one-node engine run gives the script, on a fresh machine."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KCHAIN_", "SKYPILOT_", "SLURM_")) and k != HASH_SEED_ENV}  # the machine's own seeds
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")])
    sink.mkdir(parents=True, exist_ok=True)  # the bucket's mount point, as the engine mounts it
    env[layout.STATE_SINK_ENV] = str(sink / job.name)  # the bucket's mount folder (or the shared state folder)
    env[layout.ACCELERATOR_CHECK_ENV] = "off"  # a GPU job's rehearsal trains on this CPU
    env.setdefault("OMP_NUM_THREADS", str(threads_each(1)))
    if target == "skypilot":
        env.update(HOME=str(stage.root), SKYPILOT_TASK_ID=f"sky-rehearsal-{number}", SKYPILOT_NODE_RANK="0",
                   SKYPILOT_NODE_IPS="127.0.0.1", SKYPILOT_NUM_NODES="1", SKYPILOT_NUM_GPUS_PER_NODE="0")
    else:
        env.update(TMPDIR=str(stage.root), SLURM_JOB_ID="4242", SLURM_JOB_NAME=job.name, SLURM_NNODES="1",
                   SLURM_NODEID="0", SLURM_RESTART_COUNT=str(max(0, number - 1)), SLURM_JOB_NODELIST="localhost")
    return env


def _script_command(target: str, folder: Path) -> list[str]:
    """The rendered script as the engine runs it: the task's run (bash, in the workdir) or the sbatch file."""
    if target == "skypilot":
        task = yaml.safe_load((folder / skypilot.TASK_FILE).read_text())
        return ["bash", "-c", task["run"]]
    return ["bash", slurm.SBATCH_FILE]


def _term_when_saved(stage: Stage, proc: subprocess.Popen, step: int) -> None:
    """SIGTERM to the script (bash, as the engine signals it) once the run saved `step` locally."""
    while proc.poll() is None:
        if step in _checkpoint_steps(stage):
            proc.send_signal(signal.SIGTERM)
            stage.signalled = True
            return
        time.sleep(POLL_S)


def _run_stage(stage: Stage, command: list[str], folder: Path, env: dict[str, str], show: Echo | None,
              term_after: int | None = None) -> Stage:
    """Run the script on a fresh machine; with term_after, SIGTERM it once that step is saved."""
    stage.root.mkdir(parents=True)
    with subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        timer = threading.Timer(TIMEOUT_S, proc.kill)  # a stage that hangs ends as a failure, not a wait
        timer.start()
        if term_after is not None:
            threading.Thread(target=_term_when_saved, args=(stage, proc, term_after), daemon=True).start()
        for line in proc.stdout:
            stage.lines.append(line.rstrip("\n"))
            if show is not None:
                show(f"    {stage.name}: {line.rstrip()}")
        stage.returncode = proc.wait()
        timer.cancel()
    return stage


def rehearse_target(job_file: Path, target: str, smoke: bool = True, params: dict[str, Any] | None = None,
                    echo: Echo = print, quiet: bool = False) -> TargetRehearsal:
    """Run the stages (module docstring), judge them, record the run (and, for a smoke, its pass)."""
    job = load_job(job_file)
    if params:
        job = job.model_copy(update={"params": {**job.params, **params}})
    if (job.skypilot.num_nodes if target == "skypilot" else job.slurm.nodes) > 1:
        raise SmokeFailed(f"{job.path}: the local rehearsal runs one node; rehearse with "
                          f"{'skypilot.num_nodes' if target == 'skypilot' else 'slurm.nodes'}: 1 (the multi-node "
                          "launch is the same script under an outer torchrun)")
    ledger = Ledger(state_dir(job.path))
    rendered = render_for(job, target)
    run_id = new_run_id(f"{'smoke' if smoke else 'rehearse'}-{target}")
    work = ledger.root / "targets-rehearsal" / run_id
    folder, bucket, bin_dir = work / "folder", work / "bucket", work / "bin"
    write_folder(rendered, folder)
    # The machines' roots (Slurm's TMPDIR, SkyPilot's HOME) on a short path: a DataLoader worker's Unix socket
    # under TMPDIR may not pass 107 bytes, whatever the job folder's path; linked from the work folder.
    machines = Path(tempfile.mkdtemp(prefix="kc-"))
    (work / "machines").symlink_to(machines, target_is_directory=True)
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    k = job.smoke.steps
    echo(f"  render     {target} work folder, fingerprint {rendered.fingerprint[:12]}; the engine's script run "
         f"here: a SIGTERM once step {k} is saved, a SIGKILL between a newer save and its publish, a fresh "
         f"machine to step {3 * k}")
    extra = {layout.TOTAL_STEPS_ENV: str(3 * k), layout.CHECKPOINT_EVERY_ENV: f"{k} steps",
             **({layout.SMOKE_ENV: "1"} if smoke else {})}
    command = _script_command(target, folder)
    show = None if quiet else echo

    def stage(name: str, number: int, sink: Path, fault: str | None, term_after: int | None = None) -> Stage:
        st = Stage(name, machines / name)
        env = {**_engine_env(target, job, st, number, sink, bin_dir), **extra}
        if fault:
            env[layout.FAULT_ENV] = fault
        return _run_stage(st, command, folder, env, show, term_after)

    reference: list[Stage] = []
    ref = threading.Thread(target=lambda: reference.append(stage("reference", 0, work / "bucket-ref", None)))
    ref.start()
    stages = [stage("machine-1", 1, bucket, f"stall_step={STALL_S}", term_after=k)]
    stages.append(stage("machine-2", 2, bucket, "sink_kill=after_local"))
    published = read_pointer(bucket / job.name)
    stages.append(stage("machine-3", 3, bucket, None))
    ref.join()
    saved = (stages[0].summary or Summary()).step or 0  # where machine 1 stopped and saved
    problems = shortcomings(target, saved, reference[0], stages, published, bin_dir)
    result = judge(job, rendered.fingerprint, saved, reference[0], stages, problems, work, echo)
    record(ledger, job, result, target, smoke, run_id, echo)
    return result


def _checkpoint_steps(stage: Stage) -> list[int]:
    folder = stage.kchain_root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    return sorted(int(p.name.removeprefix(layout.CHECKPOINT_PREFIX)) for p in folder.glob(f"{layout.CHECKPOINT_PREFIX}*")
                  if (p / layout.MANIFEST).is_file())


def shortcomings(target: str, saved: int, reference: Stage, stages: list[Stage], published: dict | None,
                 bin_dir: Path) -> list[str]:
    """Why the stages do not prove the contract (each a line), [] when they do. `saved`: the step
    machine 1 saved at its SIGTERM."""
    first, killed, last = stages
    problems = []
    if reference.returncode != 0:
        problems.append(f"the uninterrupted reference exited {reference.returncode}, not 0")
    status = (first.summary or Summary()).status
    if not first.signalled or first.returncode != layout.EXIT_SAVED_NOT_DONE or status != "interrupted":
        problems.append(f"machine 1 exited {first.returncode} ({status or 'no summary'}) after "
                        f"{'its SIGTERM' if first.signalled else 'no SIGTERM (it ended first)'}, not "
                        f"{layout.EXIT_SAVED_NOT_DONE} (interrupted: saved, not done): the engine would not recover "
                        "or requeue it")
    calls = bin_dir / "scontrol.calls"
    if target == "slurm" and "requeue 4242" not in (calls.read_text() if calls.is_file() else ""):
        problems.append("machine 1's script did not ask Slurm to requeue the job (scontrol requeue) on exit 75")
    if killed.returncode != KILLED:
        problems.append(f"machine 2 exited {killed.returncode}, not {KILLED} (SIGKILLed between saved and published)")
    if not any(step > saved for step in _checkpoint_steps(killed)):
        problems.append(f"machine 2 saved no checkpoint past step {saved} locally before its kill")
    if published is None or int(published.get("step", -1)) != saved:
        problems.append(f"after machine 2's kill the bucket's pointer says {published}, not step {saved}: the kill "
                        "was not between saved locally and published")
    summary = last.summary or Summary()
    if last.returncode != 0 or summary.status != "finished":
        problems.append(f"machine 3 exited {last.returncode} ({summary.status or 'no summary'}), not 0 (finished)")
    if summary.resumed_from != saved:
        problems.append(f"machine 3 resumed from {summary.resumed_from}, not from the bucket's step {saved}")
    return problems


def judge(job: Job, fingerprint: str, saved: int, reference: Stage, stages: list[Stage], problems: list[str],
          work: Path, echo: Echo) -> TargetRehearsal:
    """The verdict: the stages' contract first, then machine 3's trace against the reference."""
    k = job.smoke.steps
    for st in (reference, *stages):
        summary = st.summary or Summary()
        at = f" at step {summary.step}" if summary.status else ""
        echo(f"  {st.name:<10} exit {st.returncode}  {summary.status or 'killed, no summary'}{at}")
    verdict = ""
    if not problems:
        ref_trace = traces.read_trace(traces.sandbox_trace(reference.kchain_root))
        resumed = traces.read_trace(traces.sandbox_trace(stages[-1].kchain_root))
        rows, failure, verdict = traces.judge(ref_trace, resumed, saved, 3 * k)
        traces.print_traces(echo, rows, saved)
        if failure is not None:
            problems.append(f"{failure.type}: {failure.message} ({failure.hint})")
    for problem in problems:
        echo(f"  FAILED: {problem}")
    if problems:
        for st in (reference, *stages):
            tail = "\n".join(f"      {line}" for line in st.lines[-8:])
            echo(f"  {st.name}'s last lines:\n{tail}")
        echo(f"  logs: {work}")
    return TargetRehearsal(passed=not problems, verdict=verdict or "; ".join(problems), fingerprint=fingerprint,
                           stages=[reference, *stages], work=work, problems=problems)


def record(ledger: Ledger, job: Job, result: TargetRehearsal, target: str, smoke: bool, run_id: str,
           echo: Echo) -> None:
    """The run-log line, the smoke pass that push looks for, or SmokeFailed."""
    channel = f"{'smoke' if smoke else 'rehearse'}-{target}"
    note = f"{channel} pass" if result.passed else f"failed: {result.problems[0][:200]}"
    ledger.append_run(run_id=run_id, channel=channel, job=job.name, config=result.fingerprint[:12],
                      steps=3 * job.smoke.steps, note=note)
    if result.passed and smoke:
        ledger.record_smoke_pass(result.fingerprint, run_id, job.name)
    if result.passed:
        echo(f"  verdict    {result.verdict}")
        return
    error = SmokeFailed if smoke else KchainError  # exit 3 for a smoke, 1 for a rehearsal (README)
    raise error(f"{channel} failed: {result.problems[0]}")
