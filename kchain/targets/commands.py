"""push, status, logs and stop for the targets other than Kaggle: the engine's own commands.

`push` is a list of stages: render the work folder -> the smoke gate (the same fingerprint as the
Kaggle notebook's, so a `kchain smoke` pass counts) -> SkyPilot's own check of the task -> the
engine's submit -> the record (targets.json beside the run log, and a run-log line). status, logs
and stop run the engine's commands and print what they print. An engine command that is not
installed, or that fails, is one line naming it and what to do.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kchain.chain import outcome
from kchain.common.atomic import write_json
from kchain.common.checkpoint_files import CheckpointInvalid, read_manifest
from kchain.common.sink import read_pointer
from kchain.errors import KchainError, NotSmoked, RenderError, StateError
from kchain.job.render import Rendered
from kchain.job.spec import Job, load_job, target_problem
from kchain.store.ledger import Ledger, iso, new_run_id, now_utc, state_dir
from kchain.targets import skypilot, slurm
from kchain.targets.workfolder import TargetRendered, write_folder

Echo = Callable[[str], None]
TARGETS_FILE = "targets.json"  # in the state folder: each job's last push to a target
INSTALL = {"sky": skypilot.INSTALL, "sbatch": "run kchain on the cluster's login node, where Slurm's commands are",
           "squeue": "run it on the cluster's login node", "sacct": "run it on the cluster's login node",
           "scancel": "run it on the cluster's login node"}


class EngineError(KchainError):
    """An engine command (sky, sbatch, squeue, sacct, scancel) is missing or failed."""


def render_for(job: Job, target: str) -> TargetRendered:
    """The job's work folder for `target` (skypilot or slurm); pure."""
    return {"skypilot": skypilot.render, "slurm": slurm.render}[target](job)


def _work_folder(ledger: Ledger, job: Job, target: str) -> Path:
    """Where push writes the folder the engine reads (SkyPilot uploads it; sbatch runs in it)."""
    return ledger.root / "targets" / f"{job.name}-{target}"


def _run_engine(argv: list[str], cwd: Path | None = None, capture: bool = False,
               echo: Echo | None = None) -> str:
    """Run an engine command; its output is printed as it comes (or returned, with capture)."""
    if shutil.which(argv[0]) is None:
        raise EngineError(f"{argv[0]} is not installed here ({' '.join(argv[:3])} is what kchain runs); "
                          f"{INSTALL.get(argv[0], 'install it')}")
    done = subprocess.run(argv, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if echo is not None and not capture:
        for line in done.stdout.splitlines():
            echo(line)
    if done.returncode != 0:
        last = (done.stdout.strip().splitlines() or [""])[-1][:200]
        raise EngineError(f"`{' '.join(argv)}` exited with {done.returncode}: {last}")
    return done.stdout


def records(ledger: Ledger) -> dict[str, Any]:
    """targets.json: each job's last push to a target (a damaged file is refused, never rewritten)."""
    path = ledger.root / TARGETS_FILE
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: cannot be read ({str(exc)[:80]}); move it aside to start the record again") from None
    if not isinstance(data, dict):
        raise StateError(f"{path}: not a map of jobs; move it aside to start the record again")
    return data


def pushed(ledger: Ledger, job: Job) -> dict[str, Any]:
    record = records(ledger).get(job.name)
    if not record:
        raise EngineError(f"{job.name} was never pushed to {job.target}; run `kchain push {job.path}` first")
    return record


def push_target(job_file: Path, skip_smoke: bool = False, echo: Echo = print) -> dict[str, Any]:
    """`kchain push` for target skypilot or slurm: smoked code only, then the engine's submit."""
    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    rendered = render_for(job, job.target)
    smoked = ledger.smoke_passed(rendered.fingerprint)
    if smoked is None and not skip_smoke:
        raise NotSmoked.for_job(job.path)
    folder = _work_folder(ledger, job, job.target)
    write_folder(rendered, folder)
    echo(f"kchain push {job.path}: {job.target}, work folder {folder}")
    if job.target == "skypilot":
        assert job.skypilot.bucket is not None
        version = skypilot.check_task(folder, job.skypilot.bucket.store, job.skypilot.bucket.name)
        echo(f"  checked by SkyPilot {version}: the task and the bucket name")
        _run_engine(skypilot.launch_command(job.name), cwd=folder, echo=echo)
        engine_id = job.name
    else:
        engine_id = _run_engine(slurm.submit_command(), cwd=folder, capture=True).strip().split(";")[0]
        echo(f"  submitted Slurm job {engine_id}; its log: {folder / slurm.log_file(engine_id)}")
    record = {"target": job.target, "id": engine_id, "folder": str(folder), "fingerprint": rendered.fingerprint,
              "pushed": iso(now_utc()), "smoke": smoked["run_id"] if smoked else "skipped"}
    write_json(ledger.root / TARGETS_FILE, {**records(ledger), job.name: record})
    note = "" if smoked else " (--skip-smoke: never smoke-tested)"
    ledger.append_run(run_id=new_run_id(job.target), channel=job.target, job=job.name,
                      config=rendered.fingerprint[:12], note=f"pushed: {job.target} job {engine_id}{note}")
    return record


def status_target(job_file: Path, echo: Echo = print) -> None:
    """The engine's word on the job, then what its state folder says of the result."""
    job = load_job(job_file)
    record = pushed(Ledger(state_dir(job.path)), job)
    echo(f"{job.name}: {record['target']} job {record['id']}, pushed {record['pushed']} (fingerprint "
         f"{record['fingerprint'][:12]})")
    if record["target"] == "skypilot":
        _run_engine(skypilot.queue_command(), echo=echo)
    else:
        _run_engine(slurm.accounting_command(record["id"]), echo=echo)
    for line in result_lines(job_file, job):
        echo(line)


def result_lines(job_file: Path, job: Job) -> list[str]:
    """Where the result is, as `kchain status` says it of a Kaggle chain (outcome.Result.lines), from the
    newest checkpoint the runs published: a Slurm job's state_dir/<name> where this machine reaches it; a
    SkyPilot job's bucket is no folder here, so the line says how to read it."""
    if job.target == "skypilot":
        return [f"the result is in the bucket's {job.name}/ folder, which is no folder here: copy or mount it, then "
                f"`kchain pull {job_file} --best --from FOLDER` (or --final) reads it (docs/targets.md)"]
    folder = Path(job.slurm.sink(job.name))
    pointer = read_pointer(folder) if folder.is_dir() else None
    if pointer is None:
        return [f"no checkpoint published to {folder} yet (or that folder is not on this machine)"]
    try:
        said = outcome.of_state_folder(read_manifest(folder / str(pointer.get("checkpoint"))))
    except CheckpointInvalid as e:
        return [f"{folder}'s newest published checkpoint (step {pointer.get('step')}) is not whole here: {e}"]
    of = f" of {said.total}" if said.total else ""
    return [f"newest published: step {said.newest}{of}, in {folder}", *said.lines(job_file, str(folder))]


def logs_target(job_file: Path, follow: bool = False, echo: Echo = print) -> None:
    job = load_job(job_file)
    record = pushed(Ledger(state_dir(job.path)), job)
    if record["target"] == "skypilot":
        _run_engine(skypilot.logs_command(record["id"], follow), echo=echo)
        return
    log = Path(record["folder"]) / slurm.log_file(record["id"])
    if not log.is_file():
        raise EngineError(f"{log}: no log yet (Slurm writes it once job {record['id']} starts); see `kchain status`")
    for line in log.read_text(errors="replace").splitlines()[-200:]:
        echo(line)


def stop_target(job_file: Path, echo: Echo = print) -> None:
    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    record = pushed(ledger, job)
    if record["target"] == "skypilot":
        _run_engine(skypilot.cancel_command(record["id"]), echo=echo)
    else:
        _run_engine(slurm.cancel_command(record["id"]), echo=echo)
    ledger.append_run(run_id=new_run_id(record["target"]), channel=record["target"], job=job.name,
                      config=record["fingerprint"][:12], note=f"stopped: {record['target']} job {record['id']}")
    echo(f"stopped {record['target']} job {record['id']}; its saved state stays in the bucket or state folder")


def render_lines(job: Job, target: str, out: Path | None) -> list[str]:
    """`kchain render --target`: write the work folder; what is in it, and what checks it."""
    from kchain.job.render import payload_lines

    problem = target_problem(job, target)
    if problem:
        raise RenderError(f"{job.path}: {problem}")
    rendered = render_for(job, target)
    paths = write_folder(rendered, out or Path("build") / f"{job.name}-{target}")
    payload = rendered.payload
    lines = payload_lines(Rendered(name=job.name, notebook="", metadata="", fingerprint=payload.fingerprint,
                                   config=payload.config, embedded=payload.embedded, left_out=payload.left_out))
    lines += [f"wrote {path}" for path in paths] + [f"fingerprint {rendered.fingerprint}"]
    bucket = job.skypilot.bucket
    if target == "skypilot" and bucket is not None:
        lines.append(f"SkyPilot checks the task at `kchain push` (or now: python {skypilot.CHECKER} "
                     f"{paths[0].parent} {bucket.store} {bucket.name})")
    return lines
