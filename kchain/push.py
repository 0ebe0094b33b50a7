"""`kchain push`: start a session on Kaggle, only for smoked code and within the week's quota.

A push is recorded before it is sent ("pushing") and completed after, so a retry after a timeout
looks at Kaggle's current kernel version first and never starts the same session twice.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain.doctor import suggest_doctor
from kchain.errors import BudgetExceeded, ChainStop, KaggleError, NotSmoked
from kchain.kaggle_api import KaggleClient, OutcomeUnknown
from kchain.ledger import Ledger, iso, new_run_id, now_utc, state_dir
from kchain.render import Rendered, render_job, write_rendered
from kchain.runtime.layout import STATE_MARKER
from kchain.sessions import LIVE
from kchain.spec import Job, load_job, parse_duration

Echo = Callable[[str], None]


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
            used_h = max(used_h, client.quota()["used_s"] / 3600)
        except KaggleError:
            pass  # the quota view is a second opinion; the ledger still counts
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


def write_dataset_metadata(folder: Path, ref: str, title: str) -> None:
    """dataset-metadata.json as the client reads it (slug and title 6-50 characters, one license)."""
    meta = {"id": ref, "title": title[:50].ljust(6, "-"), "licenses": [{"name": "CC0-1.0"}]}
    (folder / "dataset-metadata.json").write_text(json.dumps(meta, indent=1) + "\n")


def ensure_dataset(client: KaggleClient, ref: str, title: str, echo: Echo) -> bool:
    """Create a private dataset holding only a marker if it does not exist; True if it was made."""
    if client.dataset_exists(ref):
        return False
    folder = Path(tempfile.mkdtemp(prefix="kchain-dataset-"))
    try:
        (folder / STATE_MARKER).write_text(json.dumps({"dataset": ref, "session": 0, "step": None}) + "\n")
        write_dataset_metadata(folder, ref, title)
        try:
            client.create_dataset(folder, public=False, dir_mode="skip")
        except OutcomeUnknown:
            if not client.dataset_exists(ref):
                client.create_dataset(folder, public=False, dir_mode="skip")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    echo(f"  created dataset {ref}")
    return True


def ensure_state_dataset(client: KaggleClient, ref: str, job: Job, echo: Echo) -> None:
    """<owner>/<name>-state, which the chain versions with each session's end state."""
    ensure_dataset(client, ref, f"{job.name} state", echo)


def kernel_ref(client: KaggleClient, job: Job) -> str:
    return f"{job.kaggle.owner or client.username}/{job.name}"


def _push_once(client: KaggleClient, ref: str, before: int | None, folder: Path,
               attempts: int = 4) -> tuple[int, str]:
    """Send the kernel; after each lost answer, a new kernel version means the push landed."""
    for attempt in range(attempts):
        try:
            return client.push(folder)
        except OutcomeUnknown:
            try:
                version = client.kernel_version(ref)
            except KaggleError as exc:
                raise OutcomeUnknown(f"Kaggle push of {ref}: the answer was lost and the kernel's version could "
                                     f"not be read ({exc}); the next `kchain push` or `kchain continue` settles it"
                                     ) from exc
            if version and version != before:
                return version, client.kernel_url(ref)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def push_session(
    client: KaggleClient,
    job: Job,
    rendered: Rendered,
    ledger: Ledger,
    session: int,
    echo: Echo,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Push the rendered kernel as session `session` of the chain, exactly once."""
    ref = kernel_ref(client, job)
    before = client.kernel_version(ref)
    record = {
        "session": session,
        "status": "PUSHING",
        "kernel": ref,
        "version": None,
        "version_before": before,
        "fingerprint": rendered.fingerprint,
        "gpu": job.gpu,
        "requested": iso(now_utc()),
        **(extra or {}),
    }
    ledger.save_session(job.name, record)
    folder = Path(tempfile.mkdtemp(prefix="kchain-push-"))
    try:
        write_rendered(rendered, folder)
        version, url = _push_once(client, ref, before, folder)
    except OutcomeUnknown:
        raise  # the record stays PUSHING: the next push or continue settles it from Kaggle's versions
    except KaggleError:
        ledger.save_session(job.name, {**record, "status": "FAILED_TO_PUSH"})
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record.update(status="QUEUED", version=version, url=url, started=iso(now_utc()))
    ledger.save_session(job.name, record)
    return record


def push(job_file: Path, skip_smoke: bool = False, force: bool = False, echo: Echo = print) -> dict[str, Any]:
    job = load_job(job_file)
    suggest_doctor(job, echo)  # one line when doctor.json is missing or stale; never blocks
    return push_job(job, Ledger(state_dir(job.path)), KaggleClient(), skip_smoke=skip_smoke, force=force, echo=echo)


def push_job(job: Job, ledger: Ledger, client: KaggleClient, skip_smoke: bool = False, force: bool = False,
             echo: Echo = print) -> dict[str, Any]:
    """Start session 1 of the job's chain (or the next one, if the last push never landed)."""
    job_file = job.path
    owner = job.kaggle.owner or client.username
    chain = reconcile(client, ledger, job)
    live = [s for s in chain if s["status"] in LIVE]
    if live:
        raise ChainStop(
            f"session {live[-1]['session']} of {job.name} is still {live[-1]['status'].lower()}; "
            "watch it with `kchain status` or `kchain logs --follow`"
        )
    if [s for s in chain if s.get("version")]:
        raise ChainStop(
            f"{job.name} already has a chain of {len(chain)} session(s); chain the next one with "
            f"`kchain continue {job_file}`"
        )
    rendered = render_job(job, owner=owner)
    smoked = ledger.smoke_passed(rendered.fingerprint)
    if smoked is None and not skip_smoke:
        raise NotSmoked(
            f"this code has never passed a smoke run: run `kchain smoke {job_file}` first "
            "(or --skip-smoke, recorded in the run log)"
        )
    plan = plan_for(job, ledger, client)
    echo(f"kchain push {job_file}: session 1 of {owner}/{job.name}")
    for line in plan.lines():
        echo(line)
    check_budget(job, plan, force, job_file)
    ensure_state_dataset(client, f"{owner}/{job.name}-state", job, echo)
    record = push_session(client, job, rendered, ledger, 1, echo,
                          extra={"smoke": smoked["run_id"] if smoked else "skipped"})
    note = "session 1 pushed" + ("" if smoked else " (--skip-smoke: never smoke-tested)")
    ledger.append_run(
        run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=rendered.fingerprint[:12],
        steps="", val="", checkpoint="", note=f"{note}; kernel {record['kernel']} v{record['version']}",
    )
    echo(f"  pushed {record['kernel']} version {record['version']}: {record['url']}")
    return record


def reconcile(client: KaggleClient, ledger: Ledger, job: Job) -> list[dict[str, Any]]:
    """Settle a push that an earlier kchain run sent but never heard back from."""
    for record in ledger.sessions(job.name):
        if record["status"] != "PUSHING":
            continue
        version = client.kernel_version(record["kernel"])
        if version and version != record.get("version_before"):
            record.update(status="QUEUED", version=version, url=client.kernel_url(record["kernel"]),
                          started=record.get("requested"))
        else:
            record.update(status="FAILED_TO_PUSH")
        ledger.save_session(job.name, record)
    return [s for s in ledger.sessions(job.name) if s["status"] != "FAILED_TO_PUSH"]
