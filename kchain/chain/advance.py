"""`kchain continue`: look at the chain, decide what the next session is, and act on it.

`look` gathers the records (Kaggle's status, each ended session's summary and log), `decide`
(kchain/decide.py, pure; its docstring is the decision table) picks the step, and `act` performs it:
for a push, the newest checkpoint becomes a READY version of the state dataset (published from the
laptop if the kernel could not), then the next session is pushed attached to that version.
One chain never has two sessions at once: a lock on the laptop and a status check on Kaggle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kchain.chain import outcome
from kchain.chain import sessions as sess
from kchain.chain.budget import Held, check_budget, plan_for
from kchain.chain.notify import FAILED, FINISHED, NEEDS_PERSON, SESSION_ENDED, Notify, nobody, notifier
from kchain.chain.push import push_session, reconcile, refuse_unpushable
from kchain.chain.sessions import StaleRule, summary_of
from kchain.common import layout, nextsession, sessionstate
from kchain.common.checkpoint_files import CheckpointInvalid, verify
from kchain.common.nextkernel import resume_for
from kchain.common.nextsession import Chain, Copy, Verdict, final_weights, saved_step
from kchain.common.sessionrecord import PendingRelay, PublishFacts, SessionRecord
from kchain.common.sessionstate import LIVE, SessionState
from kchain.common.statefolder import (
    build_cache_folder,
    build_state_folder,
    cache_entries,
    write_dataset_metadata,
)
from kchain.errors import (
    BudgetExceeded,
    ChainStop,
    CredentialsError,
    KaggleError,
    KchainError,
    NotSmoked,
    StateError,
)
from kchain.job.render import Rendered, render_job
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient, missing
from kchain.kaggle.datasets import (
    current_version,
    ensure_dataset,
    ensure_state_dataset,
    new_version,
    wait_ready,
)
from kchain.store.ledger import Ledger, iso, new_run_id, now_utc, state_dir
from kchain.store.names import cache_dataset, state_dataset

Echo = Callable[[str], None]


@contextlib.contextmanager
def _chain_lock(ledger: Ledger, job: str) -> Iterator[None]:
    ledger.root.mkdir(parents=True, exist_ok=True)
    with open(ledger.root / f"{job}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ChainStop(f"another kchain command is chaining {job} right now; let it finish") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def relay_state(client: KaggleClient, job: Job, owner: str, record: SessionRecord, echo: Echo,
                save: Callable[[PublishFacts], None], copy: Copy | None = None) -> dict[str, Any] | None:
    """Version the state dataset from the session's downloaded output; None if it holds no checkpoint.
    copy: a repair, the verified copy of the step the session refused (an earlier session's checkpoint, or
    a downloaded state version) is published instead, as a new version.

    What is about to be uploaded is saved (save) before the upload and before any wait, so a rerun
    after an abort looks at the dataset's versions instead of uploading the same state again."""
    work = Path(tempfile.mkdtemp(prefix="kchain-relay-"))
    try:
        built = _relay_folder(record, work, job, echo) if copy is None else _repair_folder(copy, work, job)
        if built is None:
            return None
        folder, marker, kchain_dir = built
        state_ref = state_dataset(owner, job.name)
        uploaded = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        notes = f"kchain session {record['session']} step {marker['step']}" if copy is None else \
            f"kchain step {marker['step']} again: session {record['session']} refused version {record.get('state_version')}"
        pending: PendingRelay = {**((record.get("publish") or {}).get("pending") or {})}
        sent = (record.get("summary") or {}).get(layout.PUBLISH_SENT_KEY) or {}
        by_kernel = not pending and sent.get("step") == marker["step"] and sent.get("before") is not None
        if by_kernel:  # the kernel sent this state and ended before it could tell whether it landed
            pending = {"step": sent["step"], "before": sent["before"]}
        version = pending.get("version") if pending.get("step") == marker["step"] else None
        if version is None and pending.get("step") == marker["step"]:
            now = current_version(client, state_ref, echo)
            if now != pending["before"]:
                version = now
                where = "from the kernel, which could not settle its send" if by_kernel else "in an earlier run"
                echo(f"  step {marker['step']} reached {state_ref} {where} (version {now}): not uploading it again")
                uploaded = 0 if by_kernel else uploaded
        if version is None:
            before = current_version(client, state_ref, echo)  # also: never upload while one processes
            pending = {"step": marker["step"], "before": before}
            save({"pending": pending})
            echo(f"  publishing step {marker['step']} to {state_ref} from the laptop ({uploaded / 1e6:.2f} MB)")
            write_dataset_metadata(folder, state_ref, f"{job.name} state")
            version = new_version(client, folder, state_ref, notes, "skip", echo, before=before)
        pending["version"] = version
        save({"pending": pending})
        entries, cache_bytes = _relay_cache(client, job, owner, record, kchain_dir, work, notes, pending, echo, save)
        return {**marker, "uploaded_bytes": uploaded + cache_bytes, "cache_bytes": cache_bytes, "cache": entries,
                "version": version}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _relay_folder(record: SessionRecord, work: Path, job: Job, echo: Echo) -> tuple[Path, dict, Path | None] | None:
    """The state folder built from a session's downloaded output (its folder, marker and kchain dir), None
    when the output holds no checkpoint past the step the session resumed at."""
    output = Path(out) if (out := record.get("output")) else None
    kchain_dir = output / layout.KCHAIN_DIR if output else None
    if kchain_dir is None or not kchain_dir.is_dir():
        return None
    marker = build_state_folder(kchain_dir, work / "state", published="relay", job=job.name)
    if marker is None:
        return None
    if marker["step"] <= (resumed := record.get("resumes_at") or 0):  # e.g. only the kept best it brought along
        echo(f"  session {record['session']}'s output holds no checkpoint past step {resumed}, where it resumed: "
             "nothing to publish")
        return None
    return work / "state", marker, kchain_dir


def _repair_folder(copy: Copy, work: Path, job: Job) -> tuple[Path, dict, Path | None] | None:
    """The state folder of a repair: a downloaded state version as it is (its marker), or one built around a
    verified checkpoint of an earlier session's output (the kept best, export and summary beside it, as the
    relay of that session built it); the checkpoint is verified again, since it is what will be sent."""
    path = Path(copy.path)
    try:
        if copy.state_folder:
            verify(path)
            return path, json.loads((path / layout.STATE_MARKER).read_text()), None
        kchain_dir = path.parent.parent
        marker = build_state_folder(kchain_dir, work / "state", published="relay", job=job.name,
                                    found=(path, verify(path)))
    except (CheckpointInvalid, OSError, ValueError):
        return None
    return (work / "state", marker, None) if marker is not None else None


def _relay_cache(client: KaggleClient, job: Job, owner: str, record: SessionRecord, kchain_dir: Path | None,
                 work: Path, notes: str, pending: PendingRelay, echo: Echo,
                 save: Callable[[PublishFacts], None]) -> tuple[list[str], int]:
    """A changed staged-data cache in the session's output, published beside its state: (entries, bytes)."""
    if kchain_dir is None:
        return [], 0
    entries = cache_entries(kchain_dir)
    cache_bytes = 0
    if entries and entries != record.get("cache_attached") and not pending.get("cache_version"):
        cache_ref = cache_dataset(owner, job.name)
        cache_bytes = build_cache_folder(kchain_dir, work / "cache")
        echo(f"  staged-data cache changed: publishing {cache_ref} ({cache_bytes / 1e6:.2f} MB)")
        ensure_dataset(client, cache_ref, f"{job.name} cache", echo)
        write_dataset_metadata(work / "cache", cache_ref, f"{job.name} cache")
        pending["cache_version"] = new_version(client, work / "cache", cache_ref, notes, "zip", echo)
        save({"pending": pending})
    return entries, cache_bytes


def ready_state(client: KaggleClient, job: Job, owner: str, chain: list[SessionRecord], echo: Echo,
                save: Callable[[PublishFacts], None] | None = None, final: bool = False) -> PublishFacts:
    """Make sure the newest checkpoint is a ready version of the state dataset; return its facts. final: the
    chain has ended, and this is its last state (a session that trained nothing past its resume leaves the
    version it resumed from as the newest: nothing was lost)."""
    last = chain[-1]
    state_ref = state_dataset(owner, job.name)
    if (last.get("publish") or {}).get("version"):
        # An earlier `continue` already published this session's state (then stopped, e.g. on the
        # budget): publishing again would only upload the same checkpoint twice.
        wait_ready(client, state_ref, echo)
        return last["publish"]
    summary = summary_of(last)
    facts: PublishFacts = {"published": None, "uploaded_bytes": 0}
    if summary.published == "kernel":
        facts.update({"published": "kernel", "step": summary.published_step,
                      "uploaded_bytes": summary.published_bytes or 0})
        echo(f"  the kernel published step {facts['step']} to {state_ref} itself "
             f"({facts['uploaded_bytes'] / 1e6:.2f} MB)")
    else:
        marker = relay_state(client, job, owner, last, echo, save or (lambda _facts: None))
        if marker is not None:
            facts.update({"published": "relay", "step": marker["step"], "uploaded_bytes": marker["uploaded_bytes"],
                          "checkpoint_bytes": marker["checkpoint_bytes"], "cache_bytes": marker["cache_bytes"],
                          "cache": marker["cache"]})
    facts["version"] = current_version(client, state_ref, echo)
    if facts["published"] is None:
        # Nothing new survived: the newest ready version is the last one a session published (or, in records
        # rebuilt from Kaggle, which have no publish facts, the one the last session resumed from).
        earlier = [step for s in chain[:-1] if (step := (s.get("publish") or {}).get("step")) is not None]
        facts["step"] = step = max([*earlier, last.get("resumes_at") or 0])
        facts["steps_lost"], lost = steps_lost(last, step)
        if final:
            echo(f"  session {last['session']} trained nothing past step {step}: state version {facts['version']} "
                 "holds the final state")
        else:
            echo(f"  session {last['session']} left no checkpoint: resuming from step {facts['step']} "
                 f"(state version {facts['version']}); {lost}")
    elif (step := facts.get("step")) is not None:
        facts["steps_lost"], lost = steps_lost(last, step)
        if facts["steps_lost"]:  # e.g. killed between two saves
            echo(f"  session {last['session']} trained past its newest checkpoint (step {facts['step']}): {lost}")
    facts["resumes_at"] = facts["step"] or 0
    return facts


def steps_lost(record: SessionRecord, saved: int) -> tuple[int | None, str]:
    """How many steps a session trained past `saved` (the step the chain goes on from), and how to
    say it: exact from its summary, at least as many as its last heartbeat shows, or unknown."""
    reached = summary_of(record).step
    if isinstance(reached, int):
        return max(0, reached - saved), f"{max(0, reached - saved)} steps lost"
    beat = sess.heartbeat_step(record.get("heartbeat"))
    if beat is not None:
        return max(0, beat - saved), f"at least {max(0, beat - saved)} steps lost (its last heartbeat: step {beat})"
    return None, "an unknown number of steps lost (no summary or heartbeat says how far it got)"


def fetch_or_stop(client: KaggleClient, ledger: Ledger, job: Job, owner: str, chain: list[SessionRecord],
                  from_state: int | None, echo: Echo, attempts: int = 3) -> None:
    """The last session ended but its output could not be fetched: fetch it again; if that still
    fails, pushing from an older state loses its steps, so only --from-state N (the newest state
    version, which is what Kaggle mounts) lets the chain go on without it."""
    last = chain[-1]
    error = last.get("output_error")
    for attempt in range(attempts):
        try:
            sess.fetch_output(client, ledger, job.name, last)
            last.pop("output_error", None)
            ledger.save_session(job.name, last)
            echo(f"  fetched the output of session {last['session']} (after an earlier failure)")
            return
        except Exception as exc:  # noqa: BLE001 - any failure to fetch is reported below
            error = f"{type(exc).__name__}: {exc}"
            time.sleep(min(30.0, 2.0 * 2 ** attempt) if attempt < attempts - 1 else 0)
    state_ref = state_dataset(owner, job.name)
    version = current_version(client, state_ref, echo)
    earlier = [step for s in chain[:-1] if (step := (s.get("publish") or {}).get("step")) is not None]
    step = max(earlier, default=0)
    reached = last.get("step") or sess.heartbeat_step(last.get("heartbeat"))
    lost = (f"{reached - step} steps (it reached step {reached})" if reached is not None
            else "every step it trained (how many is unknown: no heartbeat was seen)")
    if from_state is None:
        raise ChainStop(
            f"the output of session {last['session']} could not be fetched ({' '.join(str(error).split())}); run `kchain continue` "
            f"again later, or pass --from-state {version} to resume from state version {version} (step {step}), "
            f"which loses {lost}"
        )
    if from_state != version:
        raise ChainStop(f"--from-state {from_state}: only the newest state version ({version}, step {step}) can be "
                        f"attached (Kaggle mounts the newest version); pass --from-state {version}")
    echo(f"  --from-state {version}: resuming from step {step}; session {last['session']}'s output is given up, "
         f"which loses {lost}")


def decide_and_continue(job: Job, ledger: Ledger, client: KaggleClient, retry: bool = False,
                        force: bool = False, skip_smoke: bool = False, echo: Echo = print,
                        from_state: int | None = None, held: Held | None = None, named: str | None = None) -> Verdict:
    """One step of the chain: look at it, decide (kchain/common/nextsession.py), act. held: the hours a next
    session must leave (`kchain queue`'s slack and other runs), refused past them even with force; named: how
    the finished line's commands name the chain (`JOB --run r2` for a queued run; default the job file)."""
    refuse_unpushable(job)
    owner = job.kaggle.owner or client.username
    with _chain_lock(ledger, job.name):
        reconcile(client, ledger, job)
        now = look(client, ledger, job, owner)
        decision = decide(now, job.path, retry=retry, skip_smoke=skip_smoke)
        if decision.action == "refetch":
            fetch_or_stop(client, ledger, job, owner, now.records, from_state, echo)
            # A fetch that worked filled in the last record: decide again on its summary.
            decision = decide(now, job.path, retry=retry, skip_smoke=skip_smoke, output_settled=True)
        return act(decision, job, ledger, client, owner, now.records, force, echo, held, named)


def look(client: KaggleClient, ledger: Ledger, job: Job, owner: str) -> Chain:
    """What `decide` reads: the chain's records as Kaggle has them now, and Kaggle's own word on the
    kernel (a session started outside kchain also counts). The code is rendered only when asked."""
    chain = [s for s in sess.refresh(client, ledger, job.name) if s["status"] != SessionState.FAILED_TO_PUSH]
    kernel = f"{owner}/{job.name}"
    on_kaggle = _kernel_status(client, kernel) if chain else None
    fingerprint = functools.cache(lambda: render_job(job, owner=owner).fingerprint)
    copy_of = functools.partial(verified_copy, client, ledger, job, owner, list(chain))
    return Chain(list(chain), kernel, on_kaggle, fingerprint=fingerprint,
                 smoked=lambda fingerprint: ledger.smoke_passed(fingerprint) is not None, copy_of=copy_of)


def verified_copy(client: KaggleClient, ledger: Ledger, job: Job, owner: str, chain: list[SessionRecord], step: int,
                  refused: int | None) -> Copy | None:
    """A copy of `step` that verifies, other than state version `refused`: the checkpoint in a session's
    output downloaded here (newest session first; nothing asked of Kaggle), else an earlier state version
    that holds the step (downloaded into the ledger, verified)."""
    name = layout.checkpoint_name(step)
    for record in reversed(chain):
        output = Path(out) if (out := record.get("output")) else None
        for ckpt in sorted(output.rglob(name)) if output is not None and output.is_dir() else []:
            try:
                manifest = verify(ckpt) if ckpt.parent.name == layout.CHECKPOINTS_DIR else None
            except CheckpointInvalid:
                continue
            if manifest is not None and manifest.get("step") == step and manifest.get("job") in (None, job.name):
                return Copy(str(ckpt), f"session {record['session']}'s output on this laptop")
    state_ref = state_dataset(owner, job.name)
    for record in reversed(chain):
        version = (record.get("publish") or {}).get("version")
        if (record.get("publish") or {}).get("step") != step or version in (None, refused):
            continue
        dest = ledger.root / "repair" / job.name / str(version)
        shutil.rmtree(dest, ignore_errors=True)
        try:
            client.download_dataset(state_ref, version, dest)
            manifest = verify(dest)
        except (KaggleError, CheckpointInvalid):
            shutil.rmtree(dest, ignore_errors=True)
            continue
        if manifest.get("step") == step and (dest / layout.STATE_MARKER).is_file():
            return Copy(str(dest), f"state version {version}", state_folder=True)
    return None


def _kernel_status(client: KaggleClient, kernel: str) -> SessionState | None:
    """Kaggle's status of the kernel's newest session; None once the kernel is gone (`kchain stop --delete`)."""
    try:
        return client.status(kernel, None)[0]
    except KaggleError as exc:
        if missing(exc):
            return None
        raise


def decide(now: Chain, job_file: Path, retry: bool = False, skip_smoke: bool = False,
           output_settled: bool = False) -> Verdict:
    """The next step of the chain: the one decision table (kchain/common/nextsession.py's docstring)."""
    return nextsession.decide(now, str(job_file), retry=retry, skip_smoke=skip_smoke, output_settled=output_settled)


def stop_error(verdict: Verdict, job_file: Path) -> KchainError:
    """The error a stop raises on the laptop: NotSmoked (its own exit code) or ChainStop."""
    return NotSmoked.for_job(job_file) if verdict.stop == nextsession.NOT_SMOKED else ChainStop(verdict.message)


def act(decision: Verdict, job: Job, ledger: Ledger, client: KaggleClient, owner: str,
        chain: list[SessionRecord], force: bool, echo: Echo, held: Held | None = None,
        named: str | None = None) -> Verdict:
    """Perform a decision: raise its stop, publish and record a finished chain's end, or push the next session."""
    if decision.stop is not None:
        raise stop_error(decision, job.path)
    if decision.action == "finished":
        return finish(job, ledger, client, owner, chain, decision, echo, named)
    if decision.action == "push":
        return push_next(job, ledger, client, owner, chain, force, echo, decision.attempt if decision.again else 1,
                         held)
    if decision.action == "repair":
        return repair_and_push(decision, job, ledger, client, owner, chain, force, echo, held)
    return decision


def repair_and_push(decision: Verdict, job: Job, ledger: Ledger, client: KaggleClient, owner: str,
                    chain: list[SessionRecord], force: bool, echo: Echo, held: Held | None = None) -> Verdict:
    """The last session refused its state (damaged): the verified copy of that step (decision.copy) becomes a
    new state version, through the laptop's relay (sent once: a rerun settles it by the dataset's versions),
    and the next session is pushed from it, resuming at the same step: nothing is lost."""
    last, copy = chain[-1], decision.copy
    assert copy is not None  # nextsession decides a repair with its copy

    def save_publish(progress: PublishFacts) -> None:
        last["publish"] = progress
        ledger.save_session(job.name, last)

    echo(f"  {decision.message}")
    if not (last.get("publish") or {}).get("version"):
        marker = relay_state(client, job, owner, last, echo, save_publish, copy=copy)
        if marker is None:
            raise ChainStop(f"the copy of step {last.get('resumes_at') or 0} in {copy.path} no longer verifies; "
                            f"run `kchain continue {job.path}` again to look for another")
        save_publish({"published": "relay", "step": marker["step"], "version": marker["version"],
                      "uploaded_bytes": marker["uploaded_bytes"], "checkpoint_bytes": marker["checkpoint_bytes"],
                      "cache_bytes": 0, "steps_lost": 0, "resumes_at": marker["step"],
                      "repair": {"refused_version": last.get("state_version"), "from": copy.where}})
    if copy.state_folder:
        shutil.rmtree(copy.path, ignore_errors=True)  # the download it was sent from
    pushed = push_next(job, ledger, client, owner, chain, force, echo, held=held)
    return dataclasses.replace(pushed, message=f"{pushed.message}: step {last['publish']['step']} republished from "
                               f"{copy.where} after session {last['session']} refused state version "
                               f"{last.get('state_version')}; 0 steps lost")


def finish(job: Job, ledger: Ledger, client: KaggleClient, owner: str, chain: list[SessionRecord],
           decision: Verdict, echo: Echo, named: str | None = None) -> Verdict:
    """An ended chain: its last state a ready state version (relayed from the laptop unless the kernel published
    it; sent once: a rerun finds it recorded, a lost answer is settled by the dataset's versions), one line in
    the run log, and the line that says where the final weights are (kchain/chain/outcome.py)."""
    last = chain[-1]

    def save_publish(progress: PublishFacts) -> None:
        last["publish"] = progress
        ledger.save_session(job.name, last)

    save_publish(ready_state(client, job, owner, chain, echo, save_publish, final=True))
    said = outcome.of_chain(chain)
    state_ref = state_dataset(owner, job.name)
    record_finished(ledger, job, chain, said, state_ref)
    return dataclasses.replace(decision, message=said.finished_message(named or job.path, state_ref), record=last)


def record_finished(ledger: Ledger, job: Job, chain: list[SessionRecord], said: outcome.Result, state_ref: str) -> None:
    """One line for the whole chain's result: its final step and value, where its final state is."""
    last = chain[-1]
    summary = summary_of(last)
    if said.ended is None or last.get("logged"):
        return
    where = f"{state_ref}/{said.version}" if said.published and said.version else str(final_weights(last))
    ledger.append_run(
        run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=str(last.get("fingerprint"))[:12],
        steps=summary.step or "", val=_val(last), checkpoint=where,
        note=f"{said.ended} after {len(chain)} session(s)",
    )
    ledger.save_session(job.name, {**last, "logged": True})


def push_next(job: Job, ledger: Ledger, client: KaggleClient, owner: str, chain: list[SessionRecord],
              force: bool, echo: Echo, attempt: int = 1, held: Held | None = None) -> Verdict:
    """The newest checkpoint as a ready state version, the budget, then the next session pinned to it
    (attempt: which try of the same state this is, after sessions that did not see it mounted)."""
    last = chain[-1]

    def save_publish(progress: PublishFacts) -> None:
        last["publish"] = progress
        ledger.save_session(job.name, last)

    facts = ready_state(client, job, owner, chain, echo, save_publish)
    save_publish(facts)
    check_budget(job, plan_for(job, ledger, client), force, job.path, held)
    ensure_state_dataset(client, owner, job.name, echo)
    state = f"{state_dataset(owner, job.name)}/{facts['version']}"
    sources = [state]
    cache_ref = cache_dataset(owner, job.name)
    if client.dataset_exists(cache_ref):
        wait_ready(client, cache_ref, echo)
        sources.append(cache_ref)
    unattended = bool(chain[0].get("unattended"))  # the kernels push from here on again, as from session 1
    rendered = render_job(job, owner=owner, extra_sources=sources, session=last["session"] + 1,
                          session_facts=session_facts(ledger, job, facts, last["session"] + 1, attempt, unattended,
                                                      owner),
                          unattended=unattended)
    image = chain[0].get("image") if job.kaggle.image == "pin" else None
    record = push_session(
        client, job, _pin_image(rendered, image) if image else rendered, ledger, last["session"] + 1, echo,
        extra={"state_version": facts["version"], "resumes_at": facts["resumes_at"],
               **({"unattended": True} if unattended else {}),
               "cache_attached": facts.get("cache") or last.get("cache_attached"),
               **({"image_asked": image} if image else {})},
    )
    ledger.append_run(
        run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=rendered.fingerprint[:12],
        steps=last.get("step") or "", val=_val(last), checkpoint=state,
        note=f"session {record['session']} pushed, resuming at step {facts['resumes_at']}",
    )
    return Verdict("pushed", f"session {record['session']} pushed (kernel version {record['version']}), "
                    f"resuming at step {facts['resumes_at']} from state version {facts['version']}", record)


def _pin_image(rendered: Rendered, image: str) -> Rendered:
    """The kernel pinned to the image its chain started on: `docker_image` (session 1's, as `kernels pull
    -m` named it) beside the `docker_image_pinning_type: original` every push sends, so a kernel deleted
    and made again (`kchain stop --delete`), whose "original" would be the newest image, keeps it too."""
    metadata = {**json.loads(rendered.metadata), "docker_image": image}
    return dataclasses.replace(rendered, metadata=json.dumps(metadata, indent=1, sort_keys=True,
                                                             ensure_ascii=False) + "\n")


def session_facts(ledger: Ledger, job: Job, facts: PublishFacts | None = None, session: int = 2,
                  attempt: int = 1, unattended: bool = False, owner: str | None = None) -> dict[str, Any]:
    """What the rendered config tells the next session besides the job: the state it must resume
    (step and state version, its number in the chain, which try of that state it is), the measured
    publish figures its deadline guard plans with, and (unattended) the week's GPU time so far (owner's
    account's, every job folder's), which its kernel counts on. A kernel of an unattended chain writes the same (nextkernel.resume_for,
    nextsession.week_used) for the session it pushes."""
    out: dict[str, Any] = {}
    figures = ledger.publish_figures(job.name)
    if figures:
        out["publish"] = figures
    if unattended:
        out["week"] = ledger.week_tally(user=owner)
    if facts is not None:
        out["resume"] = resume_for(session, facts.get("resumes_at") or 0, facts.get("version"), attempt)
    return out


def _iso_now() -> str:
    return iso(now_utc())


def _val(record: SessionRecord) -> str:
    """A run-log row's val: the last validation value the session logged (at its end), never the best so far,
    which `kchain runs` names apart (the kept best, kchain/chain/outcome.py)."""
    summary = summary_of(record)
    for key, value in (summary.metrics or {}).items():
        if key.startswith("val") and isinstance(value, (int, float)):
            return f"{value:.6g}"
    return ""


def continue_chain(job_file: Path, retry: bool = False, force: bool = False, skip_smoke: bool = False,
                   watch_chain: bool = False, echo: Echo = print, from_state: int | None = None,
                   delete_stale: bool = False, notify_command: str | None = None) -> Verdict:
    job = load_job(job_file)
    ledger, client = Ledger(state_dir(job.path)), KaggleClient(progress=True)
    if watch_chain:
        notify = notifier(notify_command, job.name, echo) if notify_command else nobody
        try:
            return watch(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke, echo=echo,
                         from_state=from_state, delete_stale=delete_stale, notify=notify)
        except (ChainStop, BudgetExceeded, NotSmoked) as exc:
            notify(NEEDS_PERSON, str(exc), _last_session(ledger, job))
            raise
        except Exception as exc:
            notify(FAILED, str(exc) if isinstance(exc, KchainError) else f"{type(exc).__name__}: {exc}",
                   _last_session(ledger, job))
            raise
    return decide_and_continue(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke, echo=echo,
                               from_state=from_state)


# A wait that has not changed is echoed again only after this long: a rehearsal polls every 2 s, and a
# session that runs for minutes was a page of the same line; a watch still says it is alive each minute.
SAY_AGAIN_S = 60.0


def watch(job: Job, ledger: Ledger, client: KaggleClient, retry: bool = False, force: bool = False,
          skip_smoke: bool = False, echo: Echo = print, poll_s: float = 30.0, max_poll_s: float = 300.0,
          before_each: Callable[[int], None] | None = None, max_failures: int = 8,
          from_state: int | None = None, stale: StaleRule | None = None, delete_stale: bool = False,
          notify: Notify = nobody) -> Verdict:
    """Keep chaining until training is finished, the budget is spent, or a crash needs a human.

    A Kaggle failure that outlived the client's own retries (429s, 5xx, a lost answer) is not a
    decision: the watch tries the same step again with backoff, up to max_failures in a row. Every
    step is safe to repeat (pushes and uploads check Kaggle's versions first). A running session that
    goes stale (sessions.StaleRule; `stale` overrides the job's) ends the watch, naming `kchain stop
    --delete`; with delete_stale its kernel is deleted (when the chain's state is safe) and the watch goes on.
    Every decision is echoed as it comes, the last one too (a wait once, then again only when it changed or
    SAY_AGAIN_S later); notify hears of each session that ended and
    of the end (kchain/chain/notify.py)."""
    delay = poll_s
    failures = 0
    said, said_at = "", 0.0  # the last wait echoed, and when
    while True:
        if before_each is not None:
            before_each(len(ledger.sessions(job.name)) + 1)
        try:
            decision = decide_and_continue(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke,
                                           echo=echo, from_state=from_state)
        except KaggleError as exc:
            if isinstance(exc, CredentialsError) or failures + 1 >= max_failures:
                raise
            failures += 1
            wait = min(max_poll_s, poll_s * 2 ** failures) * (0.75 + 0.5 * random.random())
            echo(f"[{time.strftime('%H:%M:%S')}] {exc} (failure {failures} of at most {max_failures} in a row; "
                 f"trying again in {wait:.0f}s)")
            time.sleep(wait)
            continue
        failures = 0
        retry = False  # --retry covers one crash, not every crash of the watch
        from_state = None if decision.action == "pushed" else from_state  # it covers one push too
        if decision.action == "finished":
            echo(decision.message)
            notify(FINISHED, decision.message, _last_session(ledger, job))
            return decision
        if decision.action == "pushed":
            echo(decision.message)
            ended = _last_session(ledger, job, back=2)
            notify(SESSION_ENDED, f"session {ended} ended; {decision.message}", ended)
            delay = poll_s
        else:
            if decision.message != said or time.monotonic() - said_at >= SAY_AGAIN_S:
                echo(f"[{time.strftime('%H:%M:%S')}] {decision.message}")
                said, said_at = decision.message, time.monotonic()
            delay = min(delay * 1.5, max_poll_s)
            if decision.action == "running" and decision.record is not None and _stale_session(
                    job, ledger, client, decision.record, stale or StaleRule.for_job(job), delete_stale, echo):
                continue  # its kernel was deleted: the next look pushes the next session
        time.sleep(delay)


def _last_session(ledger: Ledger, job: Job, back: int = 1) -> int | None:
    """The number of the chain's last session (back=2: the one before it), None when there is none."""
    try:
        chain = ledger.sessions(job.name)
    except StateError:  # a damaged ledger is the failure being told of: the event names no session
        return None
    return chain[-back]["session"] if len(chain) >= back else None


def _delete_to_stop(ledger: Ledger, client: KaggleClient, job: Job, chain: list[SessionRecord],
                   record: SessionRecord, confirm: Callable[[str], bool], echo: Echo) -> SessionRecord | None:
    """`kchain stop --delete`: what deleting the kernel keeps and loses, refused if the chain needs what
    it loses, then asked; the deleted session's record, or None when the answer was no."""
    plan = _delete_plan(client, job, chain, record)
    judged = sess.stale(record, StaleRule.for_job(job), time.time())
    echo(f"session {record['session']} is {record['status'].lower()}"
         + (f" ({judged.note().lower()})" if judged else "")
         + f": deleting {plan.kernel} stops it and its GPU time (Kaggle's API cannot cancel a session)")
    plan.refuse_if_unsafe()
    echo(f"  kept: {'; '.join(plan.kept)}")
    echo(f"  lost with the kernel: {'; '.join(plan.lost)}")
    if not confirm(f"Delete {plan.kernel} and every version's output on Kaggle?"):
        echo(f"{plan.kernel} not deleted; session {record['session']} is still {record['status'].lower()}")
        return None
    return _delete_kernel_of(ledger, client, job, record, plan, echo)


def _stale_session(job: Job, ledger: Ledger, client: KaggleClient, record: SessionRecord, rule: StaleRule,
                  delete: bool, echo: Echo) -> bool:
    """watch's look at a running session: a stale one ends the watch (ChainStop naming `kchain stop
    --delete`), or, with delete, has its kernel deleted once the chain's state is safe; True then (False
    also when Kaggle gave no answer about that state this time: asked again at the next look)."""
    judged = sess.check_stale(client, ledger, job.name, record, rule, time.time())
    if judged is None:
        return False
    if not delete:
        raise ChainStop(judged.message(job.path))
    echo(f"[{time.strftime('%H:%M:%S')}] {judged.message(job.path)}: deleting it")
    with _chain_lock(ledger, job.name):
        chain = [s for s in ledger.sessions(job.name) if s["status"] != SessionState.FAILED_TO_PUSH]
        plan = _delete_plan(client, job, chain, record)
        if plan.unchecked and not plan.blockers:  # no answer is not a no: the watch asks at its next look
            echo(f"  not deleted yet: {'; '.join(plan.unchecked)}; asking Kaggle again at the next look")
            return False
        plan.refuse_if_unsafe()
        _delete_kernel_of(ledger, client, job, record, plan, echo)
    return True


@dataclasses.dataclass
class DeletePlan:
    """What deleting the chain's kernel keeps, loses, and would lose that the chain needs (blockers)."""

    kernel: str
    job_file: Path
    kept: list[str]
    lost: list[str]
    blockers: list[str]
    resumes: str  # the state the next session resumes from, in words
    unchecked: list[str] = dataclasses.field(default_factory=list)  # what Kaggle gave no answer about this time

    def refuse_if_unsafe(self) -> None:
        needs = self.blockers + self.unchecked
        if needs:
            raise ChainStop(f"not deleting {self.kernel}: that would lose what the chain needs: "
                            f"{'; '.join(needs)}; deleting it on its page loses the same")


def _delete_plan(client: KaggleClient, job: Job, chain: list[SessionRecord], record: SessionRecord) -> DeletePlan:
    """Check that everything the chain needs outlives the kernel (the state the session resumed from is
    a version of the state dataset, every ended session's output is on this laptop, the newest checkpoint
    is in a state version) and say what goes with it."""
    owner, ref, n = record["kernel"].split("/", 1)[0], record["kernel"], record["session"]
    ended = [s for s in chain if s.get("version") and s["status"] not in LIVE and not s.get("kernel_deleted")]
    blockers = [f"session {s['session']}'s output, never downloaded ({s.get('output_error') or 'not fetched'}): "
                "run `kchain status` to fetch it" for s in ended if not s.get("output")]
    published = max((step for s in chain if (s.get("publish") or {}).get("version")
                     and (step := s["publish"].get("step")) is not None), default=0)
    newest = max((saved_step(s) or 0 for s in ended), default=0)
    if newest > published:
        blockers.append(f"the checkpoint at step {newest}, which is in no state version yet (only in a download here)")
    unchecked: list[str] = []
    version, step = record.get("state_version"), record.get("resumes_at") or 0
    resumes = f"state version {version} of {state_dataset(owner, job.name)} (step {step})" if version else "a fresh start"
    if version:
        try:
            if client.dataset_version_number(state_dataset(owner, job.name)) < version:
                blockers.append(f"{resumes}, which Kaggle does not have")
        except KaggleError as exc:  # "not there" is Kaggle's answer; anything else is no answer
            if missing(exc):
                blockers.append(f"{resumes}, which Kaggle does not have ({exc})")
            else:
                unchecked.append(f"{resumes}, which could not be checked ({exc})")
    beat = sess.heartbeat_step(record.get("heartbeat"))
    lost = [f"session {n}'s work since step {step}" + (f" (it reached step {beat})" if beat else "") + " and its log"]
    if ended:
        lost.append(f"Kaggle's copies of the output of session(s) {', '.join(str(s['session']) for s in ended)} "
                    "and the kernel's version history")
    if job.kaggle.internet:
        lost.append(f"the Secrets attached to {ref}: attach them again after the next push, or the laptop relays")
    kept = [resumes if version else f"nothing to resume yet: session {n} started fresh"]
    downloads = [Path(out).parent for s in ended if (out := s.get("output"))]
    if downloads:
        kept.append(f"every ended session's output and log, downloaded to {downloads[-1]}")
    return DeletePlan(ref, job.path, kept, lost, blockers, resumes, unchecked)


def _delete_kernel_of(ledger: Ledger, client: KaggleClient, job: Job, record: SessionRecord, plan: DeletePlan,
                     echo: Echo) -> SessionRecord:
    """Delete the kernel (Kaggle's only stop for a session that stays RUNNING, and its bill) and record it:
    the live session ended, stopped by the user; every session of that kernel lost its copy on Kaggle."""
    client.delete_kernel(plan.kernel)  # False: it was gone already (a lost answer retried), as good
    when = _iso_now()
    for s in ledger.sessions(job.name):
        if s.get("kernel") == plan.kernel and s.get("version") is not None and not s.get("kernel_deleted"):
            s["kernel_deleted"] = when
            if s["status"] in LIVE:
                s.update({"ended": when, "stopped_by_user": True,
                          "failure_message": "stopped by `kchain stop --delete`: its kernel was deleted, with its output"})
                sessionstate.stopped(s)
            ledger.save_session(job.name, s)
    echo(f"deleted {plan.kernel}: session {record['session']} ended with it, and its GPU time with it; "
         f"`kchain continue {plan.job_file}` pushes the next session (a new kernel of the same name) from "
         f"{plan.resumes}")
    return next(s for s in ledger.sessions(job.name) if s["session"] == record["session"])


def stop_chain(job_file: Path, wait_s: float = 3600.0, poll_s: float = 10.0, echo: Echo = print,
               delete: bool = False, confirm: Callable[[str], bool] | None = None) -> SessionRecord | None:
    """`kchain stop`: end the running session and record it, so `continue` resumes from the last state.

    Kaggle's API cannot stop a session: CancelKernelSession takes a session id that no client call
    returns (Kaggle's maintainers: "not currently exposed outside the server"). So kchain names the
    session and its page to stop it on, waits until Kaggle reports it ended, and records it. With
    delete, it deletes the kernel instead (the stop Kaggle honours even for a session it keeps RUNNING
    after its runner died), once the chain's state is safe and `confirm` agrees; None if it did not."""
    job = load_job(job_file)
    ledger, client = Ledger(state_dir(job.path)), KaggleClient()
    with _chain_lock(ledger, job.name):
        reconcile(client, ledger, job)
        chain = [s for s in sess.refresh(client, ledger, job.name, live_log=delete)
                 if s["status"] != SessionState.FAILED_TO_PUSH]
        live = [s for s in chain if s["status"] in LIVE and s.get("version")]
        if not live:
            raise ChainStop(f"no session of {job.name} is queued or running; nothing to stop")
        record = live[-1]
        if delete:
            return _delete_to_stop(ledger, client, job, chain, record, confirm or (lambda _question: False), echo)
        record["stop_requested"] = _iso_now()
        ledger.save_session(job.name, record)
        url = record.get("url") or client.kernel_url(record["kernel"])
        echo(f"session {record['session']} is {record['status'].lower()}: Kaggle's API cannot stop a session (it does "
             f"not expose the session id), so stop it on its page: {url} (Stop session); waiting for Kaggle to "
             "report it ended")
        started = time.time()
        while True:
            record = next(s for s in sess.refresh(client, ledger, job.name) if s["session"] == record["session"])
            if record["status"] not in LIVE:
                break
            if time.time() - started > wait_s:
                raise ChainStop(f"session {record['session']} is still {record['status'].lower()} after "
                                f"{wait_s:.0f}s; stop it at {url}, then run `kchain stop {job_file}` again")
            time.sleep(poll_s)
        record["stopped_by_user"] = True
        ledger.save_session(job.name, record)
    echo(f"session {record['session']} ended ({record['status']}); `kchain continue {job_file}` resumes from the "
         "last saved state")
    return record
