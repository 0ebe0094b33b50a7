"""`kchain continue`: decide what the next session is, make its state ready, and start it.

The decision reads the last session's Kaggle status, its summary and its log:
  queued or running               -> say so, with the last heartbeat
  finished                        -> training is complete; push nothing
  deadline / killed / timed out   -> newest checkpoint into a READY state-dataset version
                                     (publish it from the laptop if the kernel could not),
                                     then push the next session attached to that version
  crashed with a traceback        -> a first crash needs --retry; the same crash twice is refused
One chain never has two sessions at once: a lock on the laptop and a status check on Kaggle.
"""

from __future__ import annotations

import contextlib
import fcntl
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain import sessions as sess
from kchain.errors import ChainStop, KaggleError, NotSmoked
from kchain.kaggle_api import KaggleClient, OutcomeUnknown
from kchain.ledger import Ledger, new_run_id, state_dir
from kchain.push import (
    check_budget,
    ensure_dataset,
    ensure_state_dataset,
    plan_for,
    push_session,
    reconcile,
    write_dataset_metadata,
)
from kchain.render import render_job
from kchain.runtime import layout
from kchain.runtime.statefolder import build_cache_folder, build_state_folder, cache_entries
from kchain.spec import Job, load_job

Echo = Callable[[str], None]


@dataclass
class Decision:
    action: str  # running | finished | pushed | stopped
    message: str
    record: dict[str, Any] | None = None


@contextlib.contextmanager
def chain_lock(ledger: Ledger, job: str) -> Iterator[None]:
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


def _crash(record: dict[str, Any]) -> dict[str, Any] | None:
    """The traceback error of a crashed session (not a kill, not a timeout), if any."""
    summary = record.get("summary") or {}
    if summary.get("status") == "crashed":
        return record.get("error") or summary.get("error")
    if record["status"] == "ERROR" and record.get("error") and record["error"].get("type") not in (
        "SessionError", "TrainingFailed",
    ):
        return record["error"]
    return None


def _same_error(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("type") == b.get("type") and a.get("message") == b.get("message")


def wait_ready(client: KaggleClient, ref: str, echo: Echo, timeout_s: float = 1800, poll_s: float = 2.0) -> None:
    """Poll the dataset until its newest version is ready (a 'processing' version 403s and 404s)."""
    started = time.time()
    delay = poll_s
    last = None
    while True:
        status = client.dataset_status(ref)
        if status == "ready":
            return
        if status in ("failed", "deleted"):
            raise KaggleError(f"dataset {ref} is {status}; look at it on Kaggle, then run `kchain continue` again")
        if status != last:
            echo(f"  waiting for {ref}: {status}")
            last = status
        if time.time() - started > timeout_s:
            raise KaggleError(f"dataset {ref} is still {status} after {timeout_s:.0f}s; run `kchain continue` later")
        time.sleep(delay * (0.8 + 0.4 * random.random()))
        delay = min(delay * 1.5, 30.0)


def new_version(client: KaggleClient, folder: Path, ref: str, notes: str, dir_mode: str) -> int:
    """Upload folder as a new version of ref exactly once (a lost answer is checked, not re-sent)."""
    before = client.dataset_version_number(ref)
    try:
        client.version_dataset(folder, notes, dir_mode=dir_mode)
    except OutcomeUnknown:
        if client.dataset_version_number(ref) == before:
            client.version_dataset(folder, notes, dir_mode=dir_mode)
    return client.dataset_version_number(ref)


def relay_state(client: KaggleClient, job: Job, owner: str, record: dict[str, Any], echo: Echo) -> dict[str, Any] | None:
    """Version the state dataset from the session's downloaded output; None if it holds no checkpoint."""
    output = Path(record["output"]) if record.get("output") else None
    kchain_dir = output / layout.KCHAIN_DIR if output else None
    if kchain_dir is None or not kchain_dir.is_dir():
        return None
    work = Path(tempfile.mkdtemp(prefix="kchain-relay-"))
    try:
        marker = build_state_folder(kchain_dir, work / "state", published="relay", job=job.name)
        if marker is None:
            return None
        state_ref = f"{owner}/{job.name}-state"
        uploaded = sum(p.stat().st_size for p in (work / "state").iterdir() if p.is_file())
        echo(f"  publishing step {marker['step']} to {state_ref} from the laptop ({uploaded / 1e6:.2f} MB)")
        notes = f"kchain session {record['session']} step {marker['step']}"
        write_dataset_metadata(work / "state", state_ref, f"{job.name} state")
        wait_ready(client, state_ref, echo)  # a version uploaded while the first one processes is refused
        new_version(client, work / "state", state_ref, notes, "skip")
        entries = cache_entries(kchain_dir)
        cache_bytes = 0
        if entries and entries != record.get("cache_attached"):
            cache_ref = f"{owner}/{job.name}-cache"
            cache_bytes = build_cache_folder(kchain_dir, work / "cache")
            echo(f"  staged-data cache changed: publishing {cache_ref} ({cache_bytes / 1e6:.2f} MB)")
            ensure_dataset(client, cache_ref, f"{job.name} cache", echo)
            wait_ready(client, cache_ref, echo)
            write_dataset_metadata(work / "cache", cache_ref, f"{job.name} cache")
            new_version(client, work / "cache", cache_ref, notes, "zip")
        return {**marker, "uploaded_bytes": uploaded + cache_bytes, "cache_bytes": cache_bytes, "cache": entries}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ready_state(client: KaggleClient, job: Job, owner: str, chain: list[dict[str, Any]], echo: Echo) -> dict[str, Any]:
    """Make sure the newest checkpoint is a ready version of the state dataset; return its facts."""
    last = chain[-1]
    state_ref = f"{owner}/{job.name}-state"
    if (last.get("publish") or {}).get("version"):
        # An earlier `continue` already published this session's state (then stopped, e.g. on the
        # budget): publishing again would only upload the same checkpoint twice.
        wait_ready(client, state_ref, echo)
        return last["publish"]
    summary = last.get("summary") or {}
    facts: dict[str, Any] = {"published": None, "uploaded_bytes": 0}
    if summary.get("published") == "kernel":
        facts.update(published="kernel", step=summary.get("published_step"),
                     uploaded_bytes=summary.get("published_bytes", 0))
        echo(f"  the kernel published step {facts['step']} to {state_ref} itself "
             f"({facts['uploaded_bytes'] / 1e6:.2f} MB)")
    else:
        marker = relay_state(client, job, owner, last, echo)
        if marker is not None:
            facts.update(published="relay", step=marker["step"], uploaded_bytes=marker["uploaded_bytes"],
                         checkpoint_bytes=marker["checkpoint_bytes"], cache_bytes=marker["cache_bytes"],
                         cache=marker["cache"])
    wait_ready(client, state_ref, echo)
    facts["version"] = client.dataset_version_number(state_ref)
    if facts["published"] is None:
        # Nothing new survived: the newest ready version is the last one a session published.
        earlier = [s["publish"]["step"] for s in chain[:-1] if (s.get("publish") or {}).get("step") is not None]
        facts["step"] = max(earlier, default=0)
        reached = last.get("step") or _heartbeat_step(last.get("heartbeat")) or facts["step"]
        facts["steps_lost"] = max(0, reached - facts["step"])
        echo(f"  session {last['session']} left no checkpoint: resuming from step {facts['step']} "
             f"(state version {facts['version']}); {facts['steps_lost']} steps lost")
    facts["resumes_at"] = facts["step"] or 0
    return facts


def _heartbeat_step(line: str | None) -> int | None:
    if not line:
        return None
    try:
        return int(line.split("step", 1)[1].split("/", 1)[0].strip())
    except (IndexError, ValueError):
        return None


def decide_and_continue(job: Job, ledger: Ledger, client: KaggleClient, retry: bool = False,
                        force: bool = False, skip_smoke: bool = False, echo: Echo = print) -> Decision:
    job_file = job.path
    owner = job.kaggle.owner or client.username
    with chain_lock(ledger, job.name):
        reconcile(client, ledger, job)
        chain = [s for s in sess.refresh(client, ledger, job.name) if s["status"] != "FAILED_TO_PUSH"]
        if not chain:
            raise ChainStop(f"{job.name} has no session yet: start it with `kchain push {job_file}`")
        last = chain[-1]
        # Kaggle's own word on the kernel too: a session started outside kchain also counts.
        latest, _ = client.status(f"{owner}/{job.name}", None)
        if latest in sess.LIVE and last["status"] not in sess.LIVE:
            raise ChainStop(f"{owner}/{job.name} has a session {latest.lower()} on Kaggle that kchain did not "
                            "start; wait for it to end, then run `kchain continue` again")
        if last["status"] in sess.LIVE:
            beat = last.get("heartbeat") or "no heartbeat yet"  # refresh() just read the log
            return Decision("running", f"session {last['session']} is {last['status'].lower()}: {beat}", last)
        summary = last.get("summary") or {}
        if summary.get("status") == "finished":
            best = summary.get("best") or {}
            best_text = f"{best['name']} {best['value']:.6g} at step {best['step']}" if best.get("name") else ""
            where = Path(last.get("output") or "") / layout.KCHAIN_DIR / (summary.get("checkpoint") or "")
            if not last.get("logged"):
                # One line for the whole chain's result, so `kchain runs` can name the best weights.
                ledger.append_run(
                    run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=str(last.get("fingerprint"))[:12],
                    steps=summary.get("step") or "", val=_val(last), checkpoint=str(where),
                    note=f"finished after {len(chain)} session(s)",
                )
                ledger.save_session(job.name, {**last, "logged": True})
            return Decision("finished", f"training is complete: {summary.get('step')}/{summary.get('total')} steps"
                            + (f", best {best_text}" if best_text else "") + f"; final weights in {where}", last)
        if summary.get("status") == "deadline" and summary.get("step") == last.get("resumes_at", 0):
            # Another session would burn its quota the same way: start-up filled the whole session.
            raise ChainStop(
                f"session {last['session']} reached its deadline without training a step (it resumed at "
                f"step {summary.get('step')}): loading and start-up take the whole session; stage the data "
                "with run.stage so later sessions load a cache, or raise train.session_limit"
            )
        crash = _crash(last)
        rendered = render_job(job, owner=owner)
        if crash is not None:
            earlier = [s for s in chain[:-1] if _crash(s) and _same_error(_crash(s), crash)]
            if earlier:
                raise ChainStop(
                    f"the same error as session {earlier[-1]['session']}: {crash.get('type')}: {crash.get('message')}; "
                    f"fix the code, run `kchain smoke {job_file}`"
                )
            if rendered.fingerprint == last.get("fingerprint") and not retry:
                raise ChainStop(
                    f"session {last['session']} crashed: {crash.get('type')}: {crash.get('message')}; "
                    f"fix the code and run `kchain smoke {job_file}`, or pass --retry to run it again as it is"
                )
        if ledger.smoke_passed(rendered.fingerprint) is None and not skip_smoke:
            raise NotSmoked(
                f"this code has never passed a smoke run: run `kchain smoke {job_file}` first "
                "(or --skip-smoke, recorded in the run log)"
            )
        facts = ready_state(client, job, owner, chain, echo)
        last.update(publish=facts)
        ledger.save_session(job.name, last)
        plan = plan_for(job, ledger, client)
        check_budget(job, plan, force, job_file)
        ensure_state_dataset(client, f"{owner}/{job.name}-state", job, echo)
        sources = [f"{owner}/{job.name}-state/{facts['version']}"]
        cache_ref = f"{owner}/{job.name}-cache"
        if client.dataset_exists(cache_ref):
            wait_ready(client, cache_ref, echo)
            sources.append(cache_ref)
        rendered = render_job(job, owner=owner, extra_sources=sources, session=last["session"] + 1)
        record = push_session(
            client, job, rendered, ledger, last["session"] + 1, echo,
            extra={"state_version": facts["version"], "resumes_at": facts["resumes_at"],
                   "cache_attached": facts.get("cache") or last.get("cache_attached")},
        )
        ledger.append_run(
            run_id=new_run_id("kaggle"), channel="kaggle", job=job.name, config=rendered.fingerprint[:12],
            steps=last.get("step") or "", val=_val(last), checkpoint=f"{owner}/{job.name}-state/{facts['version']}",
            note=f"session {record['session']} pushed, resuming at step {facts['resumes_at']}",
        )
        return Decision("pushed", f"session {record['session']} pushed (kernel version {record['version']}), "
                        f"resuming at step {facts['resumes_at']} from state version {facts['version']}", record)


def _val(record: dict[str, Any]) -> str:
    summary = record.get("summary") or {}
    best = summary.get("best") or {}
    if isinstance(best.get("value"), (int, float)):
        return f"{best['value']:.6g}"
    for key, value in (summary.get("metrics") or {}).items():
        if key.startswith("val") and isinstance(value, (int, float)):
            return f"{value:.6g}"
    return ""


def continue_chain(job_file: Path, retry: bool = False, force: bool = False, skip_smoke: bool = False,
                   watch_chain: bool = False, echo: Echo = print) -> Decision:
    job = load_job(job_file)
    ledger, client = Ledger(state_dir(job.path)), KaggleClient(progress=True)
    if watch_chain:
        return watch(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke, echo=echo)
    return decide_and_continue(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke, echo=echo)


def watch(job: Job, ledger: Ledger, client: KaggleClient, retry: bool = False, force: bool = False,
          skip_smoke: bool = False, echo: Echo = print, poll_s: float = 30.0, max_poll_s: float = 300.0,
          before_each: Callable[[int], None] | None = None) -> Decision:
    """Keep chaining until training is finished, the budget is spent, or a crash needs a human."""
    delay = poll_s
    while True:
        if before_each is not None:
            before_each(len(ledger.sessions(job.name)) + 1)
        decision = decide_and_continue(job, ledger, client, retry=retry, force=force, skip_smoke=skip_smoke,
                                       echo=echo)
        retry = False  # --retry covers one crash, not every crash of the watch
        if decision.action == "finished":
            echo(decision.message)
            return decision
        if decision.action == "pushed":
            echo(decision.message)
            delay = poll_s
        else:
            echo(f"[{time.strftime('%H:%M:%S')}] {decision.message}")
            delay = min(delay * 1.5, max_poll_s)
        time.sleep(delay)
