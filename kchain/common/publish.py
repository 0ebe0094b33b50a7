"""Publish this session's end state from inside the kernel (internet on, credential in Secrets).

Embedded into the notebook next to the runtime and run as its own process after training, so the
credential lives only in this process's environment: it is never printed, logged or written to
a file. Without internet or without a credential it says so and leaves the work to the laptop
(`kchain continue` relays the state from the session's output).

Each state (and cache) version is created exactly once: the client's own `with_retry` may not
re-send a creating call (`kchain.common.sendonce`), and a send whose answer was lost (a 500, a
reset connection) is settled by reading the dataset's current version, or by looking a new dataset
up, before it is sent again; a second send happens only while the session has time for it.

    python -m kchain.common.publish CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROCESS_START = time.monotonic()  # the client's start-up (the kaggle import) is measured from here

from kchain.common import (  # noqa: E402
    kernelauth,
    layout,
    nextkernel,
    nextsession,
    publishplan,
    relay,
    sendonce,
    sessionstate,
    summary,
)
from kchain.common.config import RuntimeConfig  # noqa: E402
from kchain.common.sessionrecord import SessionRecord  # noqa: E402

MISSING = (403, 404)  # Kaggle's answers for a dataset that does not exist, or is not visible yet
ATTEMPTS = 4  # sends of one version at most where the session's time is unknown (else: while it allows: Resends)
RESEND_BACKOFF_MAX = 4  # the backoff before a send again grows to sendonce.retry_delay_s(4): 8-16 s
SETTLE_S = 600.0  # the longest wait for a dataset to be ready again after a lost answer (hidden, processing)
APPEAR_S = 30.0  # how long a new dataset may stay hidden after its creation
RESERVE_S = 10.0  # kept back from the session's limit by a wait or a second send: the summary, the notebook's end
SENT_KEY = layout.PUBLISH_SENT_KEY


def say(msg: str) -> None:
    print(f"[kchain] publish: {msg}", flush=True)


def none(why: str, unattended: bool = False) -> int:
    """The summary keeps `published: null`: `kchain continue` relays the state from the session's output.
    In an unattended chain the summary also says the kernel did not push the next session, and why."""
    print(f"[kchain] published: none ({why}); `kchain continue` will relay the state from the laptop", flush=True)
    if unattended:
        nextkernel.record(layout.kchain_dir(os.environ), {"decision": "left to the laptop", "pushed": False,
                                                          "why": f"the kernel could not publish: {why}"}, say)
    return 0


def _time_left(config: RuntimeConfig) -> float | None:
    """Seconds until the session's hard limit, by the notebook's clock; None if unknown."""
    start = os.environ.get(layout.SESSION_START_ENV)
    limit = os.environ.get(layout.SESSION_LIMIT_ENV) or config.train.session_limit_s
    if not start or not limit:
        return None
    return float(start) + float(limit) - time.time()


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:120]}"


class Clock:
    """What the publish may still spend of the session: its time left, by the notebook's clock, against
    the plan's time for another upload (publishplan), and the deadline of a wait."""

    def __init__(self, config: RuntimeConfig, plan: dict) -> None:
        self.config, self.plan = config, plan

    def room_to_send(self, nbytes: int, after_s: float = 0.0) -> bool:
        """Whether another upload of nbytes, started after_s from now, ends before the session's reserve."""
        left = _time_left(self.config)
        again = publishplan.seconds(self.plan, nbytes) - self.plan["start_s"]  # the client is up already
        return left is None or left - RESERVE_S - after_s >= again

    def known(self) -> bool:
        """Whether the session's time left is known (by the notebook's clock)."""
        return _time_left(self.config) is not None

    def until(self, within_s: float) -> float:
        """The monotonic time a wait of at most within_s must end by."""
        left = _time_left(self.config)
        room = within_s if left is None else min(within_s, left - RESERVE_S)
        return time.monotonic() + max(0.0, room)


class Resends:
    """When a creating call whose send did not land (the dataset's state says so) goes again, for
    sendonce.send_and_settle: while the session's time allows another upload, each after a backoff (a 429's
    Retry-After when the last send ended in one), as read() asks again, since giving up hands the chain to
    the laptop; ATTEMPTS sends at most where the session's time is unknown. Each send is settled as before."""

    def __init__(self, clock: Clock, nbytes: int) -> None:
        self.clock, self.nbytes, self.again = clock, nbytes, 0
        self.last: BaseException = RuntimeError("no answer")
        self.attempts = sys.maxsize if clock.known() else ATTEMPTS

    def noting(self, lost: Callable[[BaseException], bool]) -> Callable[[BaseException], bool]:
        """lost, which also keeps the send's error for the backoff."""
        def note(exc: BaseException) -> bool:
            self.last = exc
            return lost(exc)
        return note

    def __call__(self) -> bool:
        wait = sendonce.retry_delay_s(min(self.again, RESEND_BACKOFF_MAX), self.last)
        if not self.clock.room_to_send(self.nbytes, wait):
            return False
        self.again += 1
        say(f"the send did not land ({_brief(self.last)}); sending it again in {wait:.0f}s (send {self.again + 1})")
        time.sleep(wait)
        return True


def transient(exc: BaseException) -> bool:
    """A 429, a 5xx or no answer at all (requests' errors are OSErrors): worth asking again."""
    code = sendonce.status_code(exc)
    return code == 429 or (code or 0) >= 500 or (code is None and isinstance(exc, OSError))


def read(what: str, call, attempts: int = 6, until: float | None = None):
    """A call that changes nothing, asked again after a transient failure: `attempts` times, and while the
    session's time allows when `until` (a monotonic deadline) is given, since giving up leaves the chain to the
    laptop. Any other answer is raised."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - sorted by transient()
            wait = sendonce.retry_delay_s(min(attempt, attempts - 1), exc)
            more = attempt < attempts - 1 or (until is not None and time.monotonic() + wait < until)
            if not transient(exc) or not more:
                raise
            say(f"{what} failed ({_brief(exc)}); retrying in {wait:.0f}s")
            time.sleep(wait)
            attempt += 1


def exists(api, ref: str, until: float | None = None) -> bool:
    try:
        read(f"looking up {ref}", lambda: api.dataset_status(ref), until=until)
    except Exception as exc:  # noqa: BLE001 - 403/404: not there (or not visible to this user)
        if sendonce.status_code(exc) in MISSING:
            return False
        raise
    return True


def appears(api, ref: str, until: float) -> bool:
    """Whether a dataset whose creation lost its answer turns up before `until` (a new one hides a while)."""
    wait = 0.5
    while True:
        try:
            api.dataset_status(ref)
            return True
        except Exception:  # noqa: BLE001 - hidden, missing or a transient failure: look again
            pass
        if time.monotonic() + wait > until:
            return False
        time.sleep(wait)
        wait = min(wait * 1.5, 5.0)


def version_number(api, ref: str, until: float) -> int | None:
    """ref's newest version number once it is ready (a new version is hidden, then processing, and the
    number lags until then: as datasets.current_version on the laptop); None if this client cannot say."""
    wait = 0.5
    while True:
        try:
            status = str(api.dataset_status(ref))
        except Exception as exc:  # noqa: BLE001 - hidden (403/404) or a transient failure: look again
            status = f"not visible ({_brief(exc)})"
        if status == "ready":
            try:
                answer = read(f"reading {ref}'s version", lambda: api.dataset_status(ref, format="json"), until=until)
            except TypeError:  # a client older than dataset_status(format=...)
                return None
            return int(json.loads(answer)["current_version_number"])
        if status in ("failed", "deleted"):
            raise RuntimeError(f"{ref} is {status}")
        if time.monotonic() + wait > until:
            raise RuntimeError(f"{ref} was still {status} when the session's time for the publish ran out")
        time.sleep(wait)
        wait = min(wait * 1.5, 10.0)


def refused(result, ref: str) -> bool:
    """Whether Kaggle's answer to a creating call says no (then it created nothing); a refusal other
    than a taken slug is raised."""
    status = getattr(result, "status", None) or (result.get("status") if isinstance(result, dict) else None)
    error = getattr(result, "error", None) or (result.get("error") if isinstance(result, dict) else None)
    if str(status).lower() == "ok":
        return False
    if sendonce.TAKEN in str(error):
        return True
    raise RuntimeError(f"{ref}: {error or status}")


def _version_once(api, folder: Path, ref: str, notes: str, dir_mode: str, clock: Clock,
                 on_send: Callable[[int | None], None] | None = None) -> None:
    """folder as one new version of ref. A send that fails is settled by ref's current version: a new
    one means it landed; else it is sent again, while the session has time for another upload.
    on_send(version before) is called before the first send: a send the session cannot settle in time
    is then settled by the laptop from that record, never sent a second time by its relay."""
    before = version_number(api, ref, clock.until(SETTLE_S))
    if on_send is not None:
        on_send(before)

    def landed() -> int | None:
        now = version_number(api, ref, clock.until(SETTLE_S))
        return now if now != before else None

    resends = Resends(clock, publishplan.tree_bytes(folder))
    try:  # whatever broke, the dataset's versions say what happened (a client that cannot read them: no resend)
        result, now = sendonce.send_and_settle(
            lambda: api.dataset_create_version(str(folder), notes, quiet=True, dir_mode=dir_mode), landed,
            lost=resends.noting(lambda exc: before is not None), attempts=resends.attempts, settle_s=0.0,
            may_resend=resends)
    except sendonce.NotLanded as exc:
        raise RuntimeError(f"the upload to {ref} failed ({_brief(exc.last)}), it has no new version after "
                           f"{exc.attempts} sends, and no attempts or no time are left") from exc
    except Exception as exc:
        if before is not None:
            raise  # the dataset's state said no (failed, deleted) or the time for the publish ran out
        raise RuntimeError(f"the upload to {ref} failed ({_brief(exc)}) and this kaggle client cannot "
                           "read the dataset's version to tell whether it landed") from exc
    if now:
        say(f"the answer was lost, but {ref} has version {now}: using it")
    elif refused(result, ref):  # a taken slug says nothing about a version: Kaggle said no all the same
        raise RuntimeError(f"{ref}: Kaggle refused the new version: {getattr(result, 'error', '')}")


def _create_once(api, folder: Path, ref: str, dir_mode: str, clock: Clock) -> bool:
    """folder as the first version of the new dataset ref; False if ref existed already. A send that
    fails is settled by looking ref up (a new dataset hides a while); else it is sent again, while the
    session has time for another upload."""
    sends = []

    def send() -> Any:
        sends.append(1)
        return api.dataset_create_new(str(folder), public=False, quiet=True, dir_mode=dir_mode)

    resends = Resends(clock, publishplan.tree_bytes(folder))
    try:  # whatever broke, looking the dataset up says what happened
        result, seen = sendonce.send_and_settle(
            send, lambda: appears(api, ref, clock.until(APPEAR_S)), lost=resends.noting(lambda exc: True),
            attempts=resends.attempts, settle_s=0.0, may_resend=resends)
    except sendonce.NotLanded as exc:
        raise RuntimeError(f"creating {ref} failed ({_brief(exc.last)}), it does not exist after {exc.attempts} "
                           "sends, and no attempts or no time are left") from exc
    if seen:
        say(f"the answer was lost, but {ref} exists: using it")
        return True
    # A taken slug: by an earlier send of ours whose answer was lost, or before this session.
    return len(sends) > 1 if refused(result, ref) else True


def _publish_folder(api, folder: Path, ref: str, title: str, notes: str, dir_mode: str, clock: Clock,
                   on_send: Callable[[int | None], None] | None = None) -> None:
    from kchain.common.statefolder import write_dataset_metadata

    write_dataset_metadata(folder, ref, title)
    if not exists(api, ref, clock.until(SETTLE_S)) and _create_once(api, folder, ref, dir_mode, clock):
        return
    _version_once(api, folder, ref, notes, dir_mode, clock, on_send)


def _attached_cache(input_root: Path, marker_name: str) -> list[str] | None:
    for marker in input_root.rglob(marker_name) if input_root.is_dir() else []:
        try:
            return json.loads(marker.read_text())["entries"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def main(config_path: str) -> int:
    raw = json.loads(Path(config_path).read_text())
    config = RuntimeConfig.from_dict(raw)
    kchain_dir = layout.kchain_dir(os.environ)
    if os.environ.get(layout.SMOKE_ENV) == "1":
        return 0  # a smoke run publishes nothing
    template = nextkernel.load_template(Path(config_path).parent)  # unattended: this kernel pushes the next
    alone = template is not None
    if not config.kaggle.internet:
        return none("internet is off for this kernel", alone)
    if not config.kaggle.state_dataset:
        return none("the job has no Kaggle owner, so there is no state dataset to publish to", alone)
    # Standard library only (statefolder finds and verifies without torch): a session near its limit
    # must not spend its last seconds importing torch.
    from kchain.common.statefolder import newest_checkpoint

    plan = publishplan.figures(config.kaggle)
    assert plan is not None  # figures are None only without internet or a state dataset, returned for above
    found = newest_checkpoint(kchain_dir, config.job)
    resumed = int((config.kaggle.resume or {}).get("step") or 0)
    if found is not None and int(found[1].get("step") or 0) <= resumed:
        found = None  # the kept best it brought along (or the step it resumed): never published as the newest
    if found is None and not alone:
        return none(f"no verified checkpoint past step {resumed} in this session's output")
    nbytes = publishplan.tree_bytes(found[0]) if found is not None else 0
    need, left = publishplan.seconds(plan, nbytes), _time_left(config)
    if left is not None and left < need:
        return none(f"{left:.0f}s left before the session limit, and publishing "
                    f"{publishplan.size_text(nbytes)} needs about {need:.0f}s", alone)
    try:
        cred = kernelauth.credential()
    except kernelauth.NoCredential as exc:
        say(f"{exc}; attach secrets {' and '.join(kernelauth.LABELS)} to publish from the kernel")
        return none("no credential in this kernel's Secrets", alone)
    api = kernelauth.client(cred)
    work = Path(tempfile.mkdtemp(prefix="kchain-publish-"))
    clock = Clock(config, plan)
    try:
        before = version_number(api, config.kaggle.state_dataset, clock.until(SETTLE_S)) if alone else None
        if found is not None:
            publish(api, config, kchain_dir, work, clock)
    except Exception as exc:  # noqa: BLE001 - the laptop relay is the fallback; say why
        return none(f"failed: {type(exc).__name__}: {str(exc)[:200]}", alone)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if template is not None:
        _chain_next(api, template, raw, config, kchain_dir, Path(config_path).parent, clock, before)
    return 0


def _chain_next(api, template: dict, raw: dict, config: RuntimeConfig, kchain_dir: Path, src: Path, clock: Clock,
               before: int | None) -> None:
    """An unattended chain's next session from this kernel: wait until the state version is ready, decide
    with the table `kchain continue` uses, and push it once; the decision goes into summary.json."""
    t0 = time.monotonic()
    ended = summary.read(kchain_dir / layout.SUMMARY) or summary.Summary()
    resume = config.kaggle.resume or {}
    try:
        assert config.kaggle.state_dataset, "main returns before this without a state dataset"
        version = _ready_version(api, config.kaggle.state_dataset, before, clock)
    except Exception as exc:  # noqa: BLE001 - the laptop takes over
        nextkernel.record(kchain_dir, {"decision": "left to the laptop", "pushed": False,
                                       "why": f"the state version did not become ready: {_brief(exc)}"}, say)
        return
    waited = round(time.monotonic() - t0, 3)
    verdict = nextsession.decide(nextsession.Chain(
        _chain_records(config, ended, resume, kchain_dir), template["chain"]["kernel"], None,
        lambda: str(config.fingerprint), lambda _fp: True), template["chain"]["job_file"])
    out: dict = {"decision": verdict.action, "pushed": False, "why": verdict.message, "waited_s": waited}
    if verdict.action == "push":
        out.update(push_next(api, (template, src), raw, config, ended, resume, version, verdict, clock, waited))
    out["idle_s"] = round(time.monotonic() - t0, 3)
    if ended.published == "kernel" and ended.publish_timing and out.get("push_s") is not None:
        _record_measured(kchain_dir, waited, out["push_s"])
    nextkernel.record(kchain_dir, out, say)


def _record_measured(kchain_dir: Path, waited_s: float, push_s: float) -> None:
    """The publish figures in summary.json with what came after the upload (the wait for the version to be
    ready, the push of the next session): the figures a later push plans with are what this session took."""
    path = kchain_dir / layout.SUMMARY
    ended = summary.read(path)
    if ended is not None and ended.publish_timing:
        ended.publish_timing = publishplan.measured(ended.publish_timing, waited_s, push_s)
        summary.write(path, ended)


def _ready_version(api, ref: str, before: int | None, clock: Clock) -> int | None:
    """The state dataset's version once a version newer than `before` is ready (the one just published),
    or the current one when this session published nothing; bounded by the session's time."""
    published = (summary.read(layout.kchain_dir(os.environ) / layout.SUMMARY) or summary.Summary()).published
    until = clock.until(SETTLE_S)
    while True:
        now = version_number(api, ref, until)
        if published != "kernel" or before is None or (now or 0) > before:
            return now
        if time.monotonic() + 1.0 > until:
            raise RuntimeError(f"{ref} still shows version {now} when the session's time ran out")
        time.sleep(1.0)


def _chain_records(config: RuntimeConfig, ended: summary.Summary, resume: dict,
                  kchain_dir: Path) -> list[SessionRecord]:
    """The chain's records as this kernel knows them: sessions before it that did not see their state
    mounted (resume.attempt), then this session, ending now."""
    from kchain.common.statefolder import newest_checkpoint

    n = int(resume.get("session") or 1)
    found = newest_checkpoint(kchain_dir, config.job)
    own: SessionRecord = {
        "session": n, "fingerprint": config.fingerprint or "", "summary": ended.to_dict(),
        "resumes_at": int(resume.get("step") or 0), "state_version": resume.get("state_version"),
        "saved_step": int(found[1].get("step") or 0) if found is not None else None}
    sessionstate.ending(own)
    attempt = int(resume.get("attempt") or 1)
    # Made before own's publish facts go in: those sessions published nothing.
    unmounted: list[SessionRecord] = [
        {**own, "session": n - k, "summary": {"status": summary.Status.STATE_NOT_MOUNTED}, "saved_step": None}
        for k in range(attempt - 1, 0, -1)]
    if ended.published == "kernel":
        own["publish"] = {"published": "kernel", "step": ended.published_step}
    return [*unmounted, own]


def push_next(api, unpacked: tuple[dict, Path], raw: dict, config: RuntimeConfig, ended: summary.Summary,
              resume: dict, version: int | None, verdict, clock: Clock, waited_s: float = 0.0) -> dict:
    """The budget, then the next session's kernel version (from the template and payload unpacked), once."""
    template, src = unpacked
    chain = template["chain"]
    session_s = float(chain["session_limit_s"])
    # This session as Kaggle bills it, from its start to now (its publish included), on top of the chain's week.
    now = time.time()
    chain_s, week = nextsession.week_used(config.kaggle.week, max(0.0, now - (ended.started or now)), now)
    if chain.get("gpu"):
        used, allowed, source = nextkernel.used_s(api, chain_s)
        budget = float(chain["weekly_gpu_hours"]) * 3600
        why = nextsession.afford(session_s, used, allowed if allowed is not None else budget, budget)
        if why is not None:
            return {"decision": "stop", "why": f"{why} (by {source}, budget.weekly_gpu_hours "
                    f"{chain['weekly_gpu_hours']:g})"}
    step = (resume.get("step") or 0) if verdict.again or ended.published != "kernel" else ended.published_step
    sources = [f"{config.kaggle.state_dataset}/{version}"]
    cache = chain.get("cache_dataset")
    if cache and exists(api, cache):
        version_number(api, cache, clock.until(SETTLE_S))  # ready before it is attached
        sources.append(cache)
    n = int(resume.get("session") or 1) + 1
    # What this session's publish took (its push: the last one measured), else the figures it was given.
    before = config.kaggle.publish or {}
    figures = publishplan.measured(ended.publish_timing, waited_s, before.get("push_s")) \
        if ended.published == "kernel" and ended.publish_timing else config.kaggle.publish
    plan: dict[str, Any] = {"session": n, "sources": sources, "publish": figures, "week": week,
            "resume": nextkernel.resume_for(n, int(step or 0), version, verdict.attempt if verdict.again else 1)}
    t0 = time.monotonic()
    if chain.get("relay"):  # a GPU chain: a CPU relay pushes it once this session has ended (common/relay.py)
        left = _time_left(config)
        sent = relay.send(api, template, src, raw, plan, session_s if left is None else max(left, 0.0),
                          clock.until(SETTLE_S * 3))
    else:
        sent = nextkernel.send_next(api, template, src, raw, plan, clock.until(SETTLE_S * 3))
    out = {"session": n, "state_version": version, "resumes_at": int(step or 0), "attempt": plan["resume"].get(
        "attempt", 1), "push_s": round(time.monotonic() - t0, 3), **sent}
    if sent.get("relay_version"):
        out.update(decision="relayed", why=f"handed session {n} to the relay {sent['relay']} version "
                   f"{sent['relay_version']} (a CPU session), which pushes it once this session has ended (resuming at "
                   f"step {step or 0} from state version {version}): the chain holds one GPU slot")
    elif sent.get("version"):
        out.update(decision="pushed", pushed=True,
                   why=f"pushed session {n} (kernel version {sent['version']}), resuming at step {step or 0} from "
                       f"state version {version}")
    elif sent.get("refused"):
        what = f"the relay's push ({sent['relay']})" if sent.get("relay") else "the push"
        out.update(decision="left to the laptop", why=f"Kaggle refused {what}: {sent['refused']}")
    else:
        out.update(decision="outcome unknown", why=f"the push's answer was lost ({sent.get('unknown')}); "
                   "`kchain continue` settles it from the kernel's versions")
    return out


def publish(api, config: RuntimeConfig, kchain_dir: Path, work: Path, clock: Clock) -> int:
    """The state (and a changed cache) as new dataset versions; the figures into summary.json."""
    from kchain.common.statefolder import build_state_folder

    kaggle = config.kaggle
    assert kaggle.state_dataset, "main returns before this without a state dataset"
    marker = build_state_folder(kchain_dir, work / "state", published="kernel", job=config.job)
    if marker is None:
        return none("no verified checkpoint in this session's output")
    notes = f"kchain session {marker['session']} step {marker['step']}"
    t1 = time.monotonic()
    _publish_folder(api, work / "state", kaggle.state_dataset, f"{config.job} state"[:50], notes, "skip", clock,
                   lambda before: _record_sent(kchain_dir, marker["step"], before))
    uploaded = sum(p.stat().st_size for p in (work / "state").iterdir() if p.is_file())
    # Measured here, planned with by the next session (continue passes them on in its config).
    took = max(time.monotonic() - t1, 1e-3)
    # The creation's round trips (and the settling of a lost answer) are folded into the rate: sessions of
    # a chain publish similar sizes.
    timing = {"start_s": round(t1 - PROCESS_START, 3), "create_s": 0.0,
              "rate_bps": round(uploaded / took, 1), "bytes": uploaded}
    # Recorded before the cache is tried: the state version exists now, and a summary without it would
    # have the laptop relay the same state as a second version.
    record(kchain_dir, marker["step"], uploaded, timing)
    cache_bytes = _publish_cache(api, config, kchain_dir, work, notes, clock)
    if cache_bytes:
        record(kchain_dir, marker["step"], uploaded + cache_bytes, timing)
    say(f"state at step {marker['step']} is now a new version of {kaggle.state_dataset} "
        f"({uploaded / 1e6:.1f} MB{f', cache {cache_bytes / 1e6:.1f} MB' if cache_bytes else ''})")
    return 0


def _record_sent(kchain_dir: Path, step: int, before: int | None) -> None:
    """summary.json says the state at step is being sent as the version after `before`, before it is: if
    this session ends before the send is settled, `continue` reads the dataset's versions instead of
    relaying the same state as a second version (chain.relay_state)."""
    summary_path = kchain_dir / layout.SUMMARY
    ended = summary.read(summary_path) or summary.Summary()
    ended.extra[SENT_KEY] = {"step": step, "before": before}
    summary.write(summary_path, ended)


def record(kchain_dir: Path, step: int, nbytes: int, timing: dict) -> None:
    """summary.json says the kernel published the state at step (`continue` then relays nothing)."""
    summary_path = kchain_dir / layout.SUMMARY
    ended = summary.read(summary_path) or summary.Summary()
    ended.published, ended.published_step = "kernel", step
    ended.published_bytes, ended.publish_timing = nbytes, timing
    summary.write(summary_path, ended)


def _publish_cache(api, config: RuntimeConfig, kchain_dir: Path, work: Path, notes: str, clock: Clock) -> int:
    """The staged cache as a version of the job's cache dataset when it changed; its bytes (0: none).
    A failure is said and left: the state stands, and the next session stages its data again."""
    from kchain.common.statefolder import CACHE_MARKER, build_cache_folder, cache_entries

    entries = cache_entries(kchain_dir)
    ref = config.kaggle.cache_dataset
    if not entries or entries == _attached_cache(layout.input_root(os.environ), CACHE_MARKER) or not ref:
        return 0
    cache_bytes = build_cache_folder(kchain_dir, work / "cache")
    try:
        _publish_folder(api, work / "cache", ref, f"{config.job} cache"[:50], notes, "zip", clock)
    except Exception as exc:  # noqa: BLE001 - the cache only saves the next session its staging
        say(f"the staged-data cache was not published ({_brief(exc)}); the next session stages its data again")
        return 0
    return cache_bytes


def _mark_end() -> None:
    """summary.json says when this process ended: the session Kaggle bills runs past the training's end
    through the publish and the push (`kchain budget` and the kernel's own budget count to here)."""
    path = layout.kchain_dir(os.environ) / layout.SUMMARY
    ended = summary.read(path)
    if ended is not None and os.environ.get(layout.SMOKE_ENV) != "1":
        ended.session_ended = round(time.time(), 3)
        summary.write(path, ended)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1])
    finally:
        _mark_end()
    sys.exit(code)
