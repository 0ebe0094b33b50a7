"""The sessions of a chain as Kaggle sees them: refresh, fetch output, the status table, the log.

Each session's record lives in the ledger (sessions.json); its output (checkpoint, metrics trace,
summary, log) is downloaded once it ends to `.kchain/sessions/<job>/<n>/`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kchain.chain import outcome
from kchain.common import layout, nextsession, sessionstate
from kchain.common.checkpoint_files import BEST_KEY
from kchain.common.heartbeat import duration
from kchain.common.nextkernel import NEXT_KEY
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import LIVE, TERMINAL, SessionState
from kchain.common.summary import Summary, read_working
from kchain.errors import KaggleError, KchainError
from kchain.job import diagnose
from kchain.job.spec import Job, parse_duration
from kchain.kaggle import credentials
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger, iso, now_utc, parse_iso, runs_json, runs_lines
from kchain.store.names import state_dataset

Echo = Callable[[str], None]
HEARTBEAT = "[kchain] step"


def summary_of(record: SessionRecord) -> Summary:
    """The summary the session left, as its output was fetched (an empty Summary when it left none)."""
    return Summary.from_dict(record.get("summary"))


def billed_span(summary: Summary) -> tuple[str, str] | None:
    """The GPU session Kaggle bills, by the kernel's own clock: from the session clock's start to the end of
    its publish process (the publish and an unattended push run after the training's `ended`), as ISO
    start and end; None when the summary says neither (the laptop's own times stand)."""
    start, end = summary.started, summary.ended
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return None
    if isinstance(summary.session_ended, (int, float)):
        end = max(end, summary.session_ended)
    return iso(datetime.fromtimestamp(start, timezone.utc)), iso(datetime.fromtimestamp(end, timezone.utc))


def output_dir(ledger: Ledger, job: str, session: int) -> Path:
    return ledger.root / "sessions" / job / str(session)


def _parse_log(text: str) -> list[dict[str, Any]]:
    """Kaggle's log: a JSON array of {stream_name, time, data}; plain text is taken as stdout."""
    if not text:
        return []
    try:
        entries = json.loads(text)
        if isinstance(entries, list):
            return [e for e in entries if isinstance(e, dict) and "data" in e]
    except ValueError:
        pass
    return [{"stream_name": "stdout", "time": 0.0, "data": text}]


def _log_text(entries: list[dict[str, Any]]) -> str:
    return "".join(str(e.get("data", "")) for e in entries)


def _last_heartbeat(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(HEARTBEAT)]
    return lines[-1] if lines else None


def _manifests(output: Path) -> dict[int, Path]:
    """The complete checkpoints in a session's downloaded output, by step: each one's manifest (written
    last; its folder name says the step)."""
    found = {}
    for manifest in output.rglob(layout.MANIFEST):
        folder = manifest.parent
        number = folder.name.removeprefix(layout.CHECKPOINT_PREFIX)
        if folder.parent.name == layout.CHECKPOINTS_DIR and folder.name != number and number.isdigit():
            found[int(number)] = manifest
    return found


def saved_step(output: Path) -> int | None:
    """The step of the newest complete checkpoint in a session's downloaded output, or None: what
    the session saved."""
    return max(_manifests(output), default=None)


def kept_best(output: Path) -> dict[str, Any] | None:
    """The kept best (train.keep_best: metric, mode, value, step) the newest checkpoint in a session's output
    records, read from its manifest (nothing is hashed: the relay and pull verify what they send and fetch)."""
    found = _manifests(output)
    if not found:
        return None
    try:
        best = json.loads(found[max(found)].read_text(encoding="utf-8")).get(BEST_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None


def fetch_output(client: KaggleClient, ledger: Ledger, job: str, record: SessionRecord) -> SessionRecord:
    """Download a finished session's output and log; fold its summary into the record."""
    dest = output_dir(ledger, job, record["session"])
    dest.mkdir(parents=True, exist_ok=True)
    files, text = client.output(record["kernel"], record["version"], dest)
    entries = _parse_log(text)
    (dest / "log.json").write_text(json.dumps(entries))
    summary = read_working(dest, search=True)  # an output may come with an extra folder level
    body = _log_text(entries)
    failure = diagnose.from_summary(summary) or (diagnose.from_log(body) if record["status"] == SessionState.ERROR else None)
    record.update({
        "output": str(dest),
        "output_files": len(files),
        "summary": None if summary is None else summary.to_dict(),
        "heartbeat": _last_heartbeat(body),
        "saved_step": saved_step(dest),
        "kept_best": kept_best(dest),
        "error": None if failure is None else {"type": failure.type, "message": failure.message, "stage": failure.stage},
    })
    if summary is not None:
        record["step"] = summary.step
        record["total"] = summary.total
        record["end_status"] = summary.status
        record["ranks"] = summary.world_size or 1
    return record


def refresh(client: KaggleClient, ledger: Ledger, job: str, live_log: bool = False) -> list[SessionRecord]:
    """Ask Kaggle about every live session of the chain; fetch the output of those that ended.
    live_log: a running session's heartbeat is also read from the live log stream (`kchain status`),
    since Kaggle may keep its log only for the end. An empty ledger first rebuilds an unattended chain."""
    if not ledger.sessions(job):
        rebuild(client, ledger, job)
    for record in ledger.sessions(job):
        if record["status"] == SessionState.PUSHING and record.get("relay"):
            settle_relay(client, ledger, job, record)
        if record["status"] not in LIVE or record.get("version") is None:
            continue
        status, failure = client.status(record["kernel"], record["version"])
        changed = status != SessionState.QUEUED and _note_image(client, record)
        if status == SessionState.RUNNING:
            # Whatever log Kaggle has so far: its last heartbeat says how far the session got.
            changed = _read_heartbeat(client, record, live_log) or changed
        if status == record["status"]:
            if changed:
                ledger.save_session(job, record)
            continue
        sessionstate.seen(record, status)
        if status == SessionState.RUNNING and not record.get("running_seen"):
            record["running_seen"] = iso(now_utc())
        if status in TERMINAL:
            record["ended"] = iso(now_utc())
            record["failure_message"] = failure or None
            try:
                fetch_output(client, ledger, job, record)
            except Exception as exc:  # noqa: BLE001 - a missing output is recorded, not fatal
                record["output_error"] = f"{type(exc).__name__}: {exc}"
            # The kernel's own clock measures the session it ran; the queue before it is not GPU time.
            if (span := billed_span(summary_of(record))) is not None:
                record["started"], record["ended"] = span
        ledger.save_session(job, record)
    if adopt_pushed(ledger, job):
        return refresh(client, ledger, job, live_log)  # the session a kernel pushed: asked about now
    return ledger.sessions(job)


def rebuild(client: KaggleClient, ledger: Ledger, job: str) -> bool:
    """An empty ledger (another laptop, a lost state folder): the chain's records from Kaggle alone, one
    session per version of its kernel (owner: this user), whoever pushed it: its status, its output fetched
    once it ended (summary, checkpoints, log), the step it resumed at and, where the session before it pushed
    it from its kernel (`next` in its summary), the state version it was pinned to; session 1's `next` says
    the chain is unattended. Saved only once every version was read (a failure leaves the ledger empty, to
    be rebuilt at the next look), and only once session 1 ended. True if rebuilt; no credentials: False."""
    try:
        kernel = f"{client.username}/{job}"
    except KchainError:  # no credentials: nothing to rebuild from
        return False
    newest = client.kernel_version(kernel) or 0
    chain: list[SessionRecord] = []
    for version in range(1, newest + 1):
        status, failure = client.status(kernel, version)
        if version == 1 and status not in TERMINAL:
            return False  # only session 1's summary says whether its kernel pushes the next: asked once it ended
        record: SessionRecord = {"session": version, "kernel": kernel, "version": version, "gpu": True,
                                 "failure_message": failure or None, "requested": iso(now_utc()), "rebuilt": newest}
        sessionstate.rebuilt(record, status)
        told = (chain[-1].get("summary") or {}).get(NEXT_KEY) or {} if chain else {}
        if told.get("session") == version:  # the kernel before pushed it: what it pushed it with
            record.update({"state_version": told.get("state_version"), "resumes_at": told.get("resumes_at") or 0,
                           "pushed_by": "kernel"})
        if status in TERMINAL:
            record["ended"] = iso(now_utc())
            try:
                fetch_output(client, ledger, job, record)
            except Exception as exc:  # noqa: BLE001 - a missing output is recorded, not fatal (as refresh does)
                record["output_error"] = f"{type(exc).__name__}: {exc}"
        summary = summary_of(record)
        record["fingerprint"] = summary.fingerprint or ""
        if summary.resumed_from is not None and "resumes_at" not in record:
            record["resumes_at"] = summary.resumed_from
        if (span := billed_span(summary)) is not None:
            record["started"], record["ended"] = span
        chain.append(record)
    if chain and NEXT_KEY in summary_of(chain[0]).extra:
        for record in chain:
            record["unattended"] = True
    _note_published(client, kernel, job, chain)
    for record in chain:
        ledger.save_session(job, record)
    return bool(chain)


def _note_published(client: KaggleClient, kernel: str, job: str, chain: list[SessionRecord]) -> None:
    """Rebuilt records have no publish facts: the newest state version's marker names the checkpoint it holds,
    so the newest session whose output holds that step is recorded as published there (by the laptop that ran
    the chain, or by its kernel), and nothing relays it again."""
    ref = state_dataset(kernel.split("/", 1)[0], job)
    scratch = Path(tempfile.mkdtemp(prefix="kchain-marker-"))
    try:
        version = client.dataset_version_number(ref)
        marker = json.loads(client.download_dataset_file(ref, version, layout.STATE_MARKER, scratch).read_text())
    except (KchainError, OSError, ValueError, AttributeError):
        return  # no state version to read: every state is relayed as a chain's would be
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    step = marker.get("step") if isinstance(marker, dict) else None
    holder = next((r for r in reversed(chain) if step is not None and r.get("saved_step") == step), None)
    if holder is not None:
        holder["publish"] = {"published": marker.get("published"), "step": step, "version": version,
                             "resumes_at": step}


def adopt_pushed(ledger: Ledger, job: str) -> bool:
    """An unattended chain: the session the last one pushed from inside its kernel, as that session's
    summary.json (on Kaggle, in its output) records it (`next`, kchain/common/nextkernel.py), becomes the
    chain's next record; True if one was added. A push whose answer the kernel lost is PUSHING (push.reconcile
    settles it from the kernel's versions); a kernel that did not push leaves the next step to `continue`."""
    chain = ledger.sessions(job)
    if not chain or not chain[0].get("unattended"):
        return False
    last = chain[-1]
    pushed = (last.get("summary") or {}).get(NEXT_KEY) or {}
    if last["status"] not in TERMINAL or not pushed.get("session") or pushed["session"] <= last["session"]:
        return False
    record: SessionRecord = {
        "session": pushed["session"], "kernel": last["kernel"], "fingerprint": last.get("fingerprint", ""),
        "gpu": bool(last.get("gpu")), "requested": last.get("ended", iso(now_utc())),
        "state_version": pushed.get("state_version"), "resumes_at": pushed.get("resumes_at") or 0,
        "version_before": pushed.get("version_before"), "unattended": True, "pushed_by": "kernel",
    }
    if pushed.get("version"):
        record.update({"version": pushed["version"], "started": record["requested"]})
        sessionstate.pushed(record)
    elif pushed.get("decision") == "relayed":  # a CPU relay pushes it once `last` has ended: settle_relay
        record.update({"version": None, "relay": pushed["relay"], "relay_version": pushed["relay_version"]})
        sessionstate.pushing(record)
    elif pushed.get("decision") == "outcome unknown":
        record["version"] = None
        sessionstate.pushing(record)
    else:
        return False
    ledger.save_session(job, record)
    return True


def settle_relay(client: KaggleClient, ledger: Ledger, job: str, record: SessionRecord) -> None:
    """A session an unattended chain's CPU relay pushes (common/relay.py), once the relay has ended: QUEUED as
    the version it pushed, FAILED_TO_PUSH when it pushed nothing (`continue` pushes it), or, when what it did is
    unknown (its output lost, the push's answer lost), PUSHING for push.reconcile to settle from the kernel's
    versions. While the relay runs the record stays PUSHING: nobody else pushes."""
    relay, number = record["relay"], record.get("relay_version")
    status, _failure = client.status(relay, number)
    if status not in TERMINAL:
        return
    dest = ledger.root / "relays" / job / str(record["session"])
    try:
        client.output(relay, number, dest)
        said = json.loads((dest / layout.RELAY_FILE).read_text(encoding="utf-8"))
    except (KchainError, OSError, ValueError):
        said = {}
    del record["relay"]
    record["relay_said"] = str(said.get("why") or f"the relay {relay} version {number} ended {status} and left no "
                                                  f"{layout.RELAY_FILE}")
    if said.get("version"):
        record.update({"version": int(said["version"]), "started": record.get("requested", iso(now_utc()))})
        sessionstate.pushed(record)
    elif said and not said.get("unknown"):
        record["failure_message"] = f"the relay did not push it: {record['relay_said']}"
        sessionstate.failed_to_push(record)
    ledger.save_session(job, record)


def _note_image(client: KaggleClient, record: SessionRecord) -> bool:
    """Record the image the session runs on, once (`kernels pull -m`'s docker_image); True if recorded."""
    if "image" in record:
        return False
    try:
        record["image"] = client.kernel_image(record["kernel"], int(record["version"] or 0))
    except KaggleError:
        return False  # asked again on the next look
    return True


def _read_heartbeat(client: KaggleClient, record: SessionRecord, live: bool) -> bool:
    """Fold the newest heartbeat of a running session's log into its record; True if it changed. With `live`
    (`kchain status`, a watch's look at a quiet session) the live stream first: the log Kaggle keeps while a
    session runs may lag it (hold its first heartbeat, never its last). Kaggle's kept log without `live`, or
    when the stream showed no heartbeat (one call fewer when it did)."""
    if live:
        events = client.log_so_far(record["kernel"], record["version"])
        if events is not None:
            record["log_seen"] = iso(now_utc())
            if _last_heartbeat(_log_text(events)) is not None:
                return _note_heartbeat(record, events)
    return _note_heartbeat(record, _parse_log(client.log(record["kernel"], record["version"])))


def heartbeat_step(line: str | None) -> int | None:
    """The step a heartbeat line says (`[kchain] step 12/30 | ...`: 12), None when it says none."""
    if not line:
        return None
    try:
        return int(line.split("step", 1)[1].split("/", 1)[0].strip())
    except (IndexError, ValueError):
        return None


def _note_heartbeat(record: SessionRecord, entries: list[dict[str, Any]]) -> bool:
    """The newest heartbeat line of a log (its entries' `time`: seconds by the session's clock), when this
    laptop first saw it, and the longest gap between two heartbeats; True if the record changed."""
    beats = [(float(e.get("time") or 0.0), line.strip()) for e in entries
             for line in str(e.get("data", "")).splitlines() if line.strip().startswith(HEARTBEAT)]
    if not beats:
        return False
    changed = False
    gap = max((later[0] - earlier[0] for earlier, later in zip(beats, beats[1:], strict=False)), default=0.0)
    if gap > (record.get("heartbeat_gap_s") or 0.0):
        record["heartbeat_gap_s"], changed = round(gap, 3), True
    newest, before = heartbeat_step(beats[-1][1]), heartbeat_step(record.get("heartbeat"))
    if newest is not None and before is not None and newest < before:
        return changed  # a kept log that lags what this laptop has already seen: never a step back
    if beats[-1][1] != record.get("heartbeat"):
        record["heartbeat"], record["heartbeat_seen"], changed = beats[-1][1], iso(now_utc()), True
    return changed


# When a RUNNING session is stale (its runner most likely died while Kaggle keeps it RUNNING, which
# Kaggle's own time limit does not reliably end: Unsloth's Kaggle CI, 2026-08): no new heartbeat for
# longer than STALE_BEATS heartbeats (the job's train.heartbeat, or the longest gap seen between two,
# for steps slower than it) + QUIET_S + the job's margin (the final save and publish), or, before the
# first heartbeat, that + SETUP_S since it was first seen running; or RUNNING past its time limit + that.
STALE_BEATS = 3
QUIET_S = 30 * 60  # the runtime's hung-step watchdog ends a step that hangs this long (its default floor)
SETUP_S = 30 * 60  # before the first heartbeat: booting, imports, staging the data, loading the checkpoint


@dataclass(frozen=True)
class StaleRule:
    """The stale rule for one job (StaleRule.for_job); tests shorten quiet_s and setup_s."""

    heartbeat_s: float
    margin_s: float
    limit_s: float
    quiet_s: float = QUIET_S
    setup_s: float = SETUP_S

    @classmethod
    def for_job(cls, job: Job) -> StaleRule:
        return cls(heartbeat_s=parse_duration(job.train.heartbeat), margin_s=job.train.margin_s,
                   limit_s=job.train.session_limit_s)

    def allowed_s(self, record: SessionRecord) -> float:
        """How long this session may show no new heartbeat before it is stale."""
        beat = max(self.heartbeat_s, float(record.get("heartbeat_gap_s") or 0.0))
        setup = 0.0 if record.get("heartbeat") else self.setup_s
        return STALE_BEATS * beat + self.quiet_s + self.margin_s + setup

    def words(self, record: SessionRecord) -> str:
        beat = max(self.heartbeat_s, float(record.get("heartbeat_gap_s") or 0.0))
        setup = "" if record.get("heartbeat") else f" + {duration(self.setup_s)} of set-up before the first one"
        return (f"{STALE_BEATS} x its {duration(beat)} heartbeat + {duration(self.quiet_s)} for a step the runtime's "
                f"watchdog would end + the {duration(self.margin_s)} margin{setup}")


@dataclass(frozen=True)
class Stale:
    """A RUNNING session judged stale: for how long, under which rule, and the GPU time it has burnt."""

    session: int
    quiet_s: float  # how long it has shown no sign of life (or run past its limit, when overdue)
    rule: str  # the rule it broke, in words
    gpu: bool
    overdue: bool  # no log to judge by, but RUNNING past its time limit + the allowance

    @property
    def burnt_h(self) -> float:
        """GPU-hours billed since the heartbeat stopped (at least: it stopped no later than it was seen)."""
        return self.quiet_s / 3600 if self.gpu else 0.0

    def note(self) -> str:
        return f"STALE: {'past its time limit' if self.overdue else 'no new heartbeat'} for {duration(self.quiet_s)}"

    def message(self, job_file: Path | str) -> str:
        what = ("still RUNNING past its time limit" if self.overdue
                else "Kaggle says RUNNING, but no new heartbeat came")
        bill = (f"it has burnt at least {self.burnt_h:.2f} GPU-hours since and goes on billing" if self.gpu
                else "it holds a session slot (no GPU time)")
        return (f"session {self.session} is stale: {what} for {duration(self.quiet_s)} (more than {self.rule}); its "
                f"notebook runner has most likely died, and Kaggle's time limit does not reliably end such a session; "
                f"{bill}; `kchain stop --delete {job_file}` deletes its kernel, the only stop Kaggle honours for it "
                "(it checks first that the chain's state is safe in a state version)")


def _epoch(text: str | None) -> float | None:
    return parse_iso(text).timestamp() if text else None


def stale(record: SessionRecord, rule: StaleRule, now: float) -> Stale | None:
    """Whether a RUNNING session is stale at `now` (epoch seconds), by the laptop's own clock: since this
    laptop first saw its newest heartbeat, or, before any, since it first saw it running (judged only once
    a live log of it was read); None when it is not, or when nothing tells."""
    if record["status"] != SessionState.RUNNING:
        return None
    running, seen = _epoch(record.get("running_seen")), _epoch(record.get("heartbeat_seen"))
    allowed, gpu = rule.allowed_s(record), bool(record.get("gpu"))
    since = seen if record.get("heartbeat") else (running if record.get("log_seen") else None)
    if since is not None and now - since > allowed:
        return Stale(record["session"], now - since, rule.words(record), gpu, overdue=False)
    if running is not None and now - running > rule.limit_s + allowed:
        words = (f"the {duration(allowed)} allowed after its {duration(rule.limit_s)} time limit, with no log "
                 "to read its heartbeat in")
        return Stale(record["session"], now - running - rule.limit_s, words, gpu, overdue=True)
    return None


def check_stale(client: KaggleClient, ledger: Ledger, job: str, record: SessionRecord, rule: StaleRule,
                now: float) -> Stale | None:
    """`continue --watch`'s look at a running session: once it has been quiet for half its allowance,
    its live log is read again (a read waits for the stream to go quiet, so not on every poll), then
    the stale rule is applied."""
    if record["status"] != SessionState.RUNNING:
        return None
    since = _epoch(record.get("heartbeat_seen") if record.get("heartbeat") else record.get("running_seen"))
    if since is not None and now - since > rule.allowed_s(record) / 2:
        _read_heartbeat(client, record, live=True)
        ledger.save_session(job, record)
    return stale(record, rule, time.time())


def short_image(name: str | None) -> str:
    """An image name with its digest cut to 12 characters, as a line can show it."""
    if not name:
        return "an image Kaggle did not name"
    repo, found, digest = name.partition("@sha256:")
    return f"{repo}@sha256:{digest[:12]}" if found else name


def _runtime(record: SessionRecord) -> tuple[str | None, str | None, str | None]:
    summary = summary_of(record)
    return record.get("image"), summary.torch, summary.cuda


def _said(runtime: tuple[str | None, str | None, str | None]) -> str:
    image, torch, cuda = runtime
    versions = f"torch {torch}, " + (f"CUDA {cuda}" if cuda else "no CUDA") if torch else "torch unknown"
    return f"{short_image(image)} ({versions})"


def image_drift(chain: list[SessionRecord]) -> list[str]:
    """One warning for each session that ran on another image (or torch, or CUDA build) than session 1."""
    ran = [s for s in chain if s.get("version") is not None]
    if not ran:
        return []
    first = _runtime(ran[0])
    lines = []
    for record in ran[1:]:
        now = _runtime(record)
        if not any(a and b and a != b for a, b in zip(first, now, strict=True)):
            continue
        asked = (f"kchain asked for session {ran[0]['session']}'s image and Kaggle ran another"
                 if record.get("image_asked") else "it was pushed without an image pin")
        lines.append(
            f"image: session {record['session']} ran on {_said(now)}, session {ran[0]['session']} on {_said(first)}: "
            f"{asked}; its numerics may differ from the sessions before it, and a checkpoint written under another "
            "torch may not load")
    return lines


def _seconds(record: SessionRecord) -> float | None:
    if not record.get("started"):
        return None
    end = parse_iso(record["ended"]) if record.get("ended") else now_utc()
    return (end - parse_iso(record["started"])).total_seconds()


def _duration(record: SessionRecord) -> str:
    if (seconds := _seconds(record)) is None:
        return "-"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m{int(seconds % 60):02d}s"


def session_note(s: SessionRecord, stale_now: dict[int, Stale] | None = None) -> str:
    """A session's last words: stale, outcome unknown, dropped sources, a failure, its heartbeat or its end."""
    if s["session"] in (stale_now or {}):
        return (stale_now or {})[s["session"]].note()
    if s["status"] == SessionState.PUSHING and s.get("relay"):
        return (f"handed to the relay {s['relay']} version {s.get('relay_version')} (a CPU session): it pushes this "
                "session once the one before has ended")
    if s["status"] == SessionState.PUSHING:
        return ("outcome unknown: the push was sent and its answer lost; `kchain continue` checks the "
                "kernel's versions before pushing again")
    if s.get("invalid_sources"):
        return f"Kaggle dropped {s['invalid_sources']}: the session ran without them"
    if error := s.get("error"):
        return f"{error['type']}: {error['message']}"
    if failure := s.get("failure_message"):
        return failure
    if heartbeat := s.get("heartbeat"):
        return heartbeat
    if end := s.get("end_status"):
        return end + (f", {s['ranks']} ranks" if (s.get("ranks") or 1) > 1 else "")
    return ""


def status_table(chain: list[SessionRecord], used_h: float, weekly_h: float,
                 stale_now: dict[int, Stale] | None = None) -> list[str]:
    rows = [f"{'session':>7}  {'version':>7}  {'status':<10} {'started':<20} {'duration':>10}  {'steps':>11}  note"]
    for s in chain:
        steps = f"{s.get('step') or 0}/{s.get('total') or '?'}" if s.get("step") is not None else "-"
        note = session_note(s, stale_now) + (" (see below)" if s["session"] in (stale_now or {}) else "")
        rows.append(
            f"{s['session']:>7}  {str(s.get('version') or '-'):>7}  {s['status']:<10} "
            f"{s.get('started') or s.get('requested', '-'):<20} {_duration(s):>10}  {steps:>11}  {note}"
        )
    rows.append(f"GPU-hours this week: {used_h:.2f} used of {weekly_h:g}, {max(0.0, weekly_h - used_h):.2f} left")
    return rows


def _show_log(client: KaggleClient, record: SessionRecord, echo: Echo, follow: bool = False,
             poll_s: float = 5.0, timeout_s: float | None = None) -> diagnose.Failure | None:
    """Print the session's log; with follow, stream it live where Kaggle serves the stream, else say
    that Kaggle gives the log only at the end and poll until the session ends."""
    shown = 0
    started = time.time()
    if follow and _stream_log(client, record, echo, timeout_s):
        follow = False  # the stream ran to the end of the log; what follows reads the final status
        shown = -1
    elif follow:
        echo(f"[kchain] no live log from Kaggle for session {record['session']}: Kaggle keeps the log only once "
             "the session ends, so it is shown then (status every poll)")
    while True:
        status, failure_message = client.status(record["kernel"], record["version"])
        text = _log_text(_parse_log(client.log(record["kernel"], record["version"])))
        if len(text) > shown >= 0:
            echo(text[shown:].rstrip("\n"))
            shown = len(text)
        if status in TERMINAL or not follow:
            break
        if follow and not shown:
            echo(f"[kchain] session {record['session']} is {status}")
        if timeout_s is not None and time.time() - started > timeout_s:
            break
        time.sleep(poll_s)
    echo(f"[kchain] session {record['session']} is {status}")
    failure = diagnose.from_log(text) if status == SessionState.ERROR else None
    if status == SessionState.ERROR and failure is None and failure_message:
        # No traceback: nothing in the kernel failed, the session was stopped from outside.
        echo(f"[kchain] session {record['session']} was killed: {failure_message}")
        failure = diagnose.Failure("Killed", failure_message, None, diagnose.hint_for("Killed", failure_message))
    if failure is not None:
        echo(f"[kchain] failed: {failure.one_line()}")
        echo(f"[kchain] hint: {failure.hint}")
    return failure


def _stream_log(client: KaggleClient, record: SessionRecord, echo: Echo, timeout_s: float | None,
               reconnects: int = 5) -> bool:
    """Echo the live log stream to its end; False if Kaggle does not serve it. A dropped connection
    is reopened (the stream starts over, so lines already shown are skipped)."""
    from kchain.errors import KaggleError

    shown, failures, started = 0, 0, time.time()
    while True:
        seen = 0
        try:
            for event in client.log_stream(record["kernel"], record["version"]):
                seen += 1
                if seen > shown:
                    echo(str(event.get("data", "")).rstrip("\n"))
                    shown = seen
                if timeout_s is not None and time.time() - started > timeout_s:
                    return True
            return True
        except KaggleError:
            if shown == 0 and failures == 0:
                return False
            failures += 1
            if failures > reconnects:
                echo("[kchain] the live log stream keeps dropping; the full log comes with the session's end")
                return True
            time.sleep(1.0)


def _chain_now(job_file: Path) -> tuple[Job, Ledger, list[SessionRecord], dict[int, Stale]]:
    """The job, its ledger, the chain as Kaggle reports it now, and its stale sessions."""
    from kchain.job.spec import load_job
    from kchain.store.ledger import state_dir

    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    chain = refresh(KaggleClient(), ledger, job.name, live_log=True)  # an empty ledger: rebuilt from Kaggle
    rule, now = StaleRule.for_job(job), time.time()
    return job, ledger, chain, {s["session"]: judged for s in chain if (judged := stale(s, rule, now)) is not None}


def waiting(chain: list[SessionRecord], job_file: Path | str) -> dict[str, str] | None:
    """What a chain with nothing running waits for (`for`: push before its first session, continue, or nothing
    once it ended) and why: an unattended kernel's reason is its summary's `next` record (it could not publish,
    the time left, the cap, no Secret, the budget); None while a session is live or was pushed. Pure: `kchain
    status` says it."""
    if not chain:
        return {"for": "push", "why": f"no session yet: `kchain push {job_file}` starts one"}
    last = chain[-1]
    if last["status"] not in TERMINAL:
        return None
    ended = summary_of(last)
    if nextsession.ended(last):
        return {"for": "nothing", "why": f"the chain has ended: session {last['session']} {ended.status} at step "
                                         f"{ended.step}/{ended.total}"}
    told = ended.extra.get(NEXT_KEY)
    if isinstance(told, dict) and told.get("pushed"):
        return None  # adopt_pushed makes the pushed session's record at the next look
    if isinstance(told, dict):
        why = f"session {last['session']}'s kernel did not push the next session: {told.get('why') or told.get('decision')}"
    else:
        why = (f"session {last['session']} ended ({ended.status or last['status'].lower()}); the laptop drives this "
               "chain, so the next session waits for it")
    return {"for": "continue", "why": why}


def _waiting_line(wait: dict[str, str] | None, job_file: Path | str) -> list[str]:
    if wait is None:
        return []
    if wait["for"] == "nothing":
        return [f"nothing is running: {wait['why']}"]
    return [f"nothing is running; the chain waits for `kchain continue {job_file}`: {wait['why']}"]


def status_for(job_file: Path) -> list[str]:
    job, ledger, chain, found = _chain_now(job_file)
    if not chain:
        return [f"{job.name} has no session yet: `kchain push {job_file}` starts one"]
    return [*status_table(chain, ledger.gpu_hours_this_week(user=_owner(job, chain) or None), job.budget.weekly_gpu_hours,
                          found),
            *_waiting_line(waiting(chain, job_file), job_file),
            *outcome.of_chain(chain).lines(job_file, _state_ref(job, chain)),
            *(judged.message(job_file) for judged in found.values()), *image_drift(chain)]


def _owner(job: Job, chain: list[SessionRecord]) -> str:
    """The chain's kernel's owner (the job's owner, else the pushing account): its account's week, its datasets."""
    return job.kaggle.owner or (chain[0].get("kernel", "").split("/", 1)[0] if chain else "")


def _state_ref(job: Job, chain: list[SessionRecord]) -> str:
    """The chain's state dataset: its kernel's owner's."""
    return state_dataset(_owner(job, chain), job.name)


def records(job: Job, ledger: Ledger) -> list[SessionRecord]:
    """The chain's records on this laptop; none here (another laptop ran it): rebuilt from Kaggle, as status
    does (no credentials, or no answer: none, and the command says what it has)."""
    chain = ledger.sessions(job.name)
    if chain:
        return chain
    try:
        return refresh(KaggleClient(timeout_s=15, attempts=2), ledger, job.name)  # as budget asks: briefly
    except KchainError:
        return []


def status_document(job_file: Path) -> dict[str, Any]:
    """`kchain status --json`: the shape README's "Machine-readable output" documents (keys are only added)."""
    job, ledger, chain, found = _chain_now(job_file)
    user = _owner(job, chain) or credentials.configured_username()  # no chain yet: the API key's user
    used_h, weekly_h = ledger.gpu_hours_this_week(user=user), job.budget.weekly_gpu_hours
    sessions = [{"session": s["session"], "version": s.get("version"), "status": s["status"],
                 "started": s.get("started"), "ended": s.get("ended"), "duration_s": _seconds(s),
                 "step": s.get("step"), "total": s.get("total"), "stale": s["session"] in found,
                 "note": session_note(s, found)} for s in chain]
    return {"job": job.name, "sessions": sessions,
            "gpu_hours": {"used": used_h, "weekly": weekly_h, "left": max(0.0, weekly_h - used_h)},
            "waiting": waiting(chain, job_file),
            "warnings": [*(judged.message(job_file) for judged in found.values()), *image_drift(chain)],
            "kept_best": outcome.of_chain(chain).best}


def runs_for(job_file: Path) -> list[str]:
    """`kchain runs`: the run log, and the chain's result from its records (rebuilt from Kaggle when this
    laptop has none): the kept best and final weights status, pull and release name."""
    job, ledger, chain = _job_records(job_file)
    said = outcome.of_chain(chain).lines(job_file, _state_ref(job, chain)) if job is not None else None
    return runs_lines(ledger, said, job_file)


def runs_document(job_file: Path) -> dict[str, Any]:
    """`kchain runs --json`: the shape README's "Machine-readable output" documents (keys are only added):
    the rows, the best row's run_id, and `kept_best`, the chain's kept best (the one `pull --best` brings)."""
    _job, ledger, chain = _job_records(job_file)
    return {**runs_json(ledger), "kept_best": outcome.of_chain(chain).best}


def _job_records(job_file: Path) -> tuple[Job | None, Ledger, list[SessionRecord]]:
    """The job, its ledger and its chain's records; no job file (`kchain runs` in a folder of several
    jobs): the run log of the folder's ledger alone."""
    from kchain.job.spec import load_job
    from kchain.store.ledger import state_dir

    if not Path(job_file).exists():
        return None, Ledger(state_dir(job_file)), []
    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    return job, ledger, records(job, ledger)


def logs_for(job_file: Path, number: int | None, follow: bool, poll_s: float, echo: Echo) -> None:
    from kchain.errors import KchainError
    from kchain.job.spec import load_job
    from kchain.store.ledger import state_dir

    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    chain = [s for s in records(job, ledger) if s.get("version")]
    if not chain:
        raise KchainError(f"{job.name} has no session yet: `kchain push {job_file}` starts one")
    record = chain[-1] if number is None else next((s for s in chain if s["session"] == number), None)
    if record is None:
        raise KchainError(f"{job.name} has no session {number}; sessions: {', '.join(str(s['session']) for s in chain)}")
    if record.get("kernel_deleted"):
        # Its kernel was deleted (`kchain stop --delete`): Kaggle's copy went with it; a newer kernel of the
        # same name numbers its versions from 1 again.
        kept = output_dir(ledger, job.name, record["session"]) / "log.json"
        text = _log_text(_parse_log(kept.read_text())) if kept.is_file() else ""
        echo(text.rstrip("\n") if text else f"[kchain] session {record['session']}'s log went with its kernel "
             f"(deleted {record['kernel_deleted']}) before it was downloaded")
        return
    client = KaggleClient()
    _show_log(client, record, echo, follow=follow, poll_s=poll_s)
    refresh(client, ledger, job.name)
