"""`kchain push`: start a session on Kaggle, only for smoked code and within the week's quota.

A push is recorded before it is sent ("pushing") and completed after, so a retry after a timeout
looks at Kaggle's current kernel version first and never starts the same session twice.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kchain.chain.budget import check_budget, plan_for
from kchain.chain.doctor import refuse_unattended, suggest_doctor, unattended_note
from kchain.chain.sessions import rebuild
from kchain.common import publishplan, sessionstate
from kchain.common.config import KaggleConfig
from kchain.common.sendonce import NotLanded, send_and_settle
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import LIVE, SessionState
from kchain.errors import ChainStop, KaggleError, NotSmoked, SpecError
from kchain.job import kagglepip
from kchain.job.render import Rendered, render_job, write_rendered
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import (
    InvalidSources,
    KaggleClient,
    OutcomeUnknown,
    SessionCapReached,
    lost_answer,
    missing,
    new_kernel_version,
)
from kchain.kaggle.datasets import ensure_state_dataset
from kchain.kaggle.models import model_problem
from kchain.store.ledger import Ledger, iso, new_run_id, now_utc, state_dir
from kchain.store.names import doctor_kernel, name_problem, pip_dataset

Echo = Callable[[str], None]


def refuse_unpushable(job: Job) -> None:
    """What Kaggle (or kchain's runtime) cannot run, refused before anything is created."""
    problem = name_problem(job.name)
    if problem:
        raise SpecError(f"{job.path}: name: {problem}")
    if job.kaggle.accelerator == "tpu":
        raise SpecError(f"{job.path}: kaggle.accelerator: tpu is not supported yet (the runtime would train on the "
                        "TPU machine's CPU); use gpu")


def kernel_ref(client: KaggleClient, job: Job) -> str:
    return f"{job.kaggle.owner or client.username}/{job.name}"


def _push_once(client: KaggleClient, ref: str, before: int | None, folder: Path, timeout_s: int,
               attempts: int = 4, settle_s: float = 6.0) -> tuple[int, str]:
    """Send the kernel exactly once (sendonce.send_and_settle): a lost answer is settled by the kernel's
    version, a new one means the push landed (its session runs). If the version cannot be read at all,
    OutcomeUnknown: the record stays PUSHING ("outcome unknown" in `kchain status`) and nothing is pushed
    until Kaggle's versions settle it."""
    try:
        answer, landed = send_and_settle(lambda: client.push(folder, timeout_s=timeout_s),
                                         lambda: new_kernel_version(client, ref, before), lost=lost_answer,
                                         attempts=attempts, settle_s=settle_s)
    except NotLanded as exc:
        raise exc.last from None
    return answer if answer is not None else (landed, client.kernel_url(ref))


def _refuse_a_second_session(client: KaggleClient, ref: str, before: int | None, again: str) -> None:
    """A push to a kernel whose session still runs starts a second session beside it (Kaggle runs
    and bills both): refused while the kernel's newest session is queued or running, whoever
    started it."""
    if before is None:
        return
    status = client.status(ref)[0]
    if status in LIVE:
        raise ChainStop(f"{ref} version {before} is {status.lower()} on Kaggle: a push now would start a second "
                        f"session beside it (Kaggle runs and bills both); let it end, or stop it on its page "
                        f"({client.kernel_url(ref)}), then run `{again}` again")


def _explain_cap(client: KaggleClient, exc: SessionCapReached, again: str) -> SessionCapReached:
    """Kaggle's "Maximum batch GPU session count of N reached" with the sessions that hold the slots
    (this chain's or not: the account's running GPU kernels) and what to do, in one line."""
    try:
        running = client.running_gpu_kernels()
    except KaggleError:
        running = None
    unseen = "an older session of a kernel pushed again while it ran, which Kaggle's status does not show"
    if running is None:
        held = "the account's running kernels could not be listed"
    elif not running:
        held = f"none of your recently run kernels shows a running GPU session (it may be {unseen})"
    else:
        held = "running now: " + ", ".join(f"{r['ref']} v{r['version']} ({r['status'].lower()})" for r in running)
        hidden = (exc.cap or 0) - len(running)
        if hidden > 0:
            held += f" and {hidden} more: {unseen}"
    where = f" on its page ({client.kernel_url(running[0]['ref'])})" if running else " on its page"
    return SessionCapReached(f"{str(exc).rstrip('.')}; {held}; wait until one ends, or stop one{where}, then run "
                             f"`{again}` again", exc.cap)


def _verify_sources(client: KaggleClient, sources: list[str], job: Job) -> None:
    """Before SaveKernel: every dataset source exists, is visible, is ready, and a pinned version
    exists; Kaggle would otherwise drop it and still start the session without it."""
    for source in sources:
        parts = source.split("/")
        ref, pin = "/".join(parts[:2]), int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None
        where = ("kaggle.datasets" if source in job.kaggle.datasets else "kaggle.pip's wheels"
                 if ref == pip_dataset(parts[0], job.name) else "the chain's state")
        try:
            status = client.dataset_status(ref)
        except KaggleError as exc:
            if missing(exc):
                raise ChainStop(f"{job.path}: {where}: dataset {ref} does not exist on Kaggle or is not visible "
                                "to you; fix the name, or make it visible to your account") from exc
            raise
        if status != "ready":
            raise KaggleError(f"dataset source {ref} is {status}, not ready yet; run the command again shortly")
        if pin is not None:
            newest = client.dataset_version_number(ref)
            if pin > newest:
                raise ChainStop(f"{job.path}: {where}: dataset {ref} has no version {pin} (the newest is "
                                f"{newest}); pin an existing version")


def _verify_models(client: KaggleClient, sources: list[str], job: Job) -> None:
    """Before SaveKernel: every pinned model version exists and is visible (else Kaggle drops it and
    starts the session without it)."""
    for source in sources:
        problem = model_problem(client, source)
        if problem is not None:
            raise ChainStop(f"{job.path}: kaggle.models: {problem[0]}; {problem[1]}")


def push_session(
    client: KaggleClient,
    job: Job,
    rendered: Rendered,
    ledger: Ledger,
    session: int,
    echo: Echo,
    extra: SessionRecord | None = None,
) -> SessionRecord:
    """Push the rendered kernel as session `session` of the chain, exactly once."""
    ref = kernel_ref(client, job)
    again = f"kchain push {job.path}" if session == 1 else f"kchain continue {job.path}"
    before = client.kernel_version(ref)
    _refuse_a_second_session(client, ref, before, again)
    record: SessionRecord = {
        "session": session,
        "kernel": ref,
        "version": None,
        "version_before": before,
        "fingerprint": rendered.fingerprint,
        "gpu": job.gpu,
        "requested": iso(now_utc()),
        **(extra or {}),
    }
    sessionstate.pushing(record)
    metadata = json.loads(rendered.metadata)
    if job.kaggle.pip:  # the newest version of <owner>/<name>-pip holds these pins' wheels before the push
        kagglepip.ensure(client, job, ref.split("/")[0], echo)
    _verify_sources(client, metadata.get("dataset_sources") or [], job)
    _verify_models(client, metadata.get("model_sources") or [], job)
    ledger.save_session(job.name, record)
    folder = Path(tempfile.mkdtemp(prefix="kchain-push-"))
    try:
        write_rendered(rendered, folder)
        # Kaggle ends the session at the job's limit, not at its own default.
        version, url = _push_once(client, ref, before, folder, int(job.train.session_limit_s))
    except OutcomeUnknown:
        raise  # the record stays PUSHING: the next push or continue settles it from Kaggle's versions
    except InvalidSources as exc:
        # Kaggle started the session anyway, without the source. It cannot be cancelled through the
        # API; its runtime stops it in its first minute (the attached state is not the expected one).
        record.update({"version": exc.version, "url": exc.url, "started": iso(now_utc()),
                       "invalid_sources": exc.dropped})
        ledger.save_session(job.name, sessionstate.pushed(record))
        raise ChainStop(
            f"{exc}: Kaggle started that session without them (a session pushed to resume a state stops "
            f"itself in its first minute without it); stop it at {exc.url} (Kaggle's API cannot), fix the "
            "source, then run `kchain continue`"
        ) from exc
    except SessionCapReached as exc:
        ledger.save_session(job.name, sessionstate.failed_to_push(record))  # Kaggle created no version
        raise _explain_cap(client, exc, again) from exc
    except KaggleError:
        ledger.save_session(job.name, sessionstate.failed_to_push(record))
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record.update({"version": version, "url": url, "started": iso(now_utc())})
    ledger.save_session(job.name, sessionstate.pushed(record))
    return record


def push(job_file: Path, skip_smoke: bool = False, force: bool = False, echo: Echo = print,
         unattended: bool = False) -> SessionRecord:
    job = load_job(job_file)
    if unattended:
        _refuse_short_sessions(job, Ledger(state_dir(job.path)))  # a kernel that cannot publish in time
        refuse_unattended(job)  # the doctor must have seen a kernel push a kernel on this account
        note = unattended_note(job)  # a kernel-pushed kernel without its Secrets: the laptop takes over
        if note:
            echo(note)
    suggest_doctor(job, echo)  # one line when doctor.json is missing or stale; never blocks
    return push_job(job, Ledger(state_dir(job.path)), KaggleClient(), skip_smoke=skip_smoke, force=force, echo=echo,
                    unattended=unattended)


def _refuse_short_sessions(job: Job, ledger: Ledger) -> None:
    """push --unattended: a session must keep what its kernel needs after the last save (the hand-over to the
    publisher, the publish, the wait for the version, the push of the next session) by the rule its deadline
    guard plans with (publishplan.fits), or no kernel would ever publish and the chain would wait for the
    laptop after every session. Planned with the figures the last session measured, else the assumed ones."""
    measured = ledger.publish_figures(job.name)
    plan = publishplan.figures(KaggleConfig(internet=True, state_dataset="-", unattended=True, publish=measured))
    assert plan is not None
    nbytes = int((measured or {}).get("bytes") or 0)  # unknown before a session published: the least it can be
    need = publishplan.seconds(plan, nbytes) + publishplan.handoff_s(nbytes)
    limit, margin = job.train.session_limit_s, job.train.margin_s
    if publishplan.fits(need, limit, margin):
        return
    size = publishplan.size_text(nbytes) if nbytes else "the state"
    raise SpecError(
        f"{job.path}: train.session_limit: {job.train.session_limit} is too short for an unattended chain: after its "
        f"last save each kernel needs about {need:.0f}s to publish {size} and push the next session "
        f"({'measured' if plan['measured'] else 'assumed'} figures), and a session keeps at most half of the "
        f"{limit - margin:.0f}s left after train.margin for that; raise train.session_limit to at least "
        f"{2 * need + margin:.0f}s, or push without --unattended (the laptop relays each session)")


def _status_now(client: KaggleClient, record: SessionRecord) -> SessionState:
    """A live session's status as Kaggle says it now (the ledger's may be older: queued when it runs)."""
    if record.get("version") is None:
        return record["status"]
    try:
        return client.status(record["kernel"], record["version"])[0]
    except KaggleError:
        return record["status"]


def push_job(job: Job, ledger: Ledger, client: KaggleClient, skip_smoke: bool = False, force: bool = False,
             echo: Echo = print, unattended: bool = False) -> SessionRecord:
    """Start session 1 of the job's chain (or the next one, if the last push never landed). unattended:
    from then on each session pushes the next itself (kchain/common/nextkernel.py)."""
    job_file = job.path
    refuse_unpushable(job)
    owner = job.kaggle.owner or client.username
    chain = reconcile(client, ledger, job)
    if not chain:
        chain = _unrecorded_chain(client, ledger, job)
    live = [s for s in chain if s["status"] in LIVE]
    if live:
        raise ChainStop(
            f"session {live[-1]['session']} of {job.name} is still {_status_now(client, live[-1]).lower()}; "
            "watch it with `kchain status` or `kchain logs --follow`"
        )
    if [s for s in chain if s.get("version")]:
        raise ChainStop(
            f"{job.name} already has a chain of {len(chain)} session(s); chain the next one with "
            f"`kchain continue {job_file}`"
        )
    figures = ledger.publish_figures(job.name)
    if unattended and not job.kaggle.internet:
        raise SpecError(f"{job.path}: kaggle.internet: an unattended chain needs it true (each session pushes the "
                        "next over the internet, with your key attached as Secrets); set kaggle.internet: true")
    facts = {**({"publish": figures} if figures else {}), **({"week": ledger.week_tally(user=owner)} if unattended else {})}
    rendered = render_job(job, owner=owner, session_facts=facts or None, unattended=unattended)
    smoked = ledger.smoke_passed(rendered.fingerprint)
    if smoked is None and not skip_smoke:
        raise NotSmoked.for_job(job_file)
    plan = plan_for(job, ledger, client)
    echo(f"kchain push {job_file}: session 1 of {owner}/{job.name}")
    for line in plan.lines() + ([_slots_line(job, owner)] if unattended else []):
        echo(line)
    check_budget(job, plan, force, job_file)
    ensure_state_dataset(client, owner, job.name, echo)
    record = push_session(client, job, rendered, ledger, 1, echo,
                          extra={"smoke": smoked["run_id"] if smoked else "skipped",
                                 "params": rendered.config.get("params") or {},
                                 **({"unattended": True} if unattended else {})})
    note = "session 1 pushed" + ("" if smoked else " (--skip-smoke: never smoke-tested)")
    ledger.append_run(
        run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=rendered.fingerprint[:12],
        steps="", val="", checkpoint="", note=f"{note}; kernel {record['kernel']} v{record['version']}",
    )
    echo(f"  pushed {record['kernel']} version {record['version']}: {record['url']}")
    return record


def _slots_line(job: Job, owner: str) -> str:
    """How many of the account's GPU slots an unattended chain holds (Kaggle runs two GPU sessions per account)."""
    if not job.gpu:
        return "  GPU slots      none (the job runs on the CPU): each session pushes the next itself"
    return (f"  GPU slots      1 of the account's 2 at any time: each session hands the push of the next to a CPU relay "
            f"({doctor_kernel(owner, job.name)}, no accelerator), which pushes it once the session has ended")


def _unrecorded_chain(client: KaggleClient, ledger: Ledger, job: Job) -> list[SessionRecord]:
    """This laptop has no record of the job (another laptop pushed it, or its state folder is new): an
    unattended chain is rebuilt from Kaggle's records (sessions.rebuild), so that the refusal below names
    it; a session live on the kernel is refused at the push itself (_refuse_a_second_session)."""
    rebuild(client, ledger, job.name)
    return [s for s in ledger.sessions(job.name) if s["status"] != SessionState.FAILED_TO_PUSH]


def reconcile(client: KaggleClient, ledger: Ledger, job: Job) -> list[SessionRecord]:
    """Settle a push that an earlier kchain run sent but never heard back from."""
    for record in ledger.sessions(job.name):
        if record["status"] != SessionState.PUSHING or record.get("relay"):
            continue  # a relay's push is settled from what the relay did, once it ended (sessions.settle_relay)
        version = client.kernel_version(record["kernel"])
        if version and version != record.get("version_before"):
            url = client.kernel_url(record["kernel"])
            record.update({"version": version, "url": url})
            if "requested" in record:  # always: push_session and adopt_pushed write it first
                record["started"] = record["requested"]
            sessionstate.pushed(record)
        else:
            sessionstate.failed_to_push(record)
        ledger.save_session(job.name, record)
    return [s for s in ledger.sessions(job.name) if s["status"] != SessionState.FAILED_TO_PUSH]
