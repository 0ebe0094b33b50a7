"""What kchain remembers on the laptop: the run log, smoke passes, sessions and the GPU-hour week.

Everything lives in the project's state folder: `$KCHAIN_HOME` if set, else `.kchain/` next to the
job file. Every write is atomic (the files are small, so a write rewrites the whole file).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kchain.common import sessionstate
from kchain.common.atomic import write_json as atomic_write_json
from kchain.common.atomic import write_text as atomic_write_text
from kchain.common.sessionrecord import SessionRecord
from kchain.common.summary import Summary
from kchain.errors import StateError
from kchain.store import account

RUNS_FILE = "runs.csv"
DOCTOR_FILE = "doctor.json"  # what `kchain doctor` learned, by job (doctor.py writes it)
PUBLISH_FILE = "publish.json"
SMOKE_FILE = "smoke-passes.json"
SESSIONS_FILE = "sessions.json"
RELEASES_FILE = "releases.json"  # what `kchain release` sent, by target and weights (release.py)
PLAN_FILE = "plan.json"  # the week's runs as `kchain plan` planned them (kchain/chain/plan.py)
QUEUE_FILE = "queue.json"  # the plan `kchain queue` runs, each run's state in it (kchain/chain/queue.py)
RUN_FIELDS = ["run_id", "date", "channel", "job", "config", "steps", "val", "checkpoint", "note"]


def state_dir(job_path: Path | None = None) -> Path:
    home = os.environ.get("KCHAIN_HOME")
    if home:
        return Path(home)
    base = Path(job_path).resolve().parent if job_path else Path.cwd()
    return base / ".kchain"


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{now_utc().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


WEEK = timedelta(days=7)


def week_start(moment: datetime, refresh: datetime | None = None) -> datetime:
    """The start of the GPU quota week holding moment. With Kaggle's refresh time (quota_view's
    quota_refresh_time, an aware datetime), the week ends there: its start is a whole number of weeks
    before it. Without one, Saturday 00:00 UTC, kchain's assumption (no public source states the
    week's start, and accounts may differ)."""
    moment = moment.astimezone(timezone.utc)
    if refresh is not None:
        start = refresh.astimezone(timezone.utc) - WEEK
        return start + WEEK * ((moment - start) // WEEK)
    days_since_saturday = (moment.weekday() - 5) % 7
    start = moment - timedelta(days=days_since_saturday)
    return start.replace(hour=0, minute=0, second=0, microsecond=0)


@dataclass
class Ledger:
    root: Path

    # -- what the doctor learned -------------------------------------------------------------
    def doctor_entry(self, job: str) -> dict[str, Any]:
        """The doctor's record of this job ({} when it never ran, or the file is not the doctor's)."""
        try:
            data = json.loads((self.root / DOCTOR_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        entry = data.get("jobs", {}).get(job) if isinstance(data, dict) and isinstance(data.get("jobs"), dict) else None
        return entry if isinstance(entry, dict) else {}

    # -- the run log ------------------------------------------------------------------------
    @property
    def runs_path(self) -> Path:
        return self.root / RUNS_FILE

    def runs(self) -> list[dict[str, str]]:
        """The run log's rows. A short row is padded (nothing is lost); anything kchain could only
        rewrite by dropping what the user recorded is refused with the path and line."""
        path = self.runs_path
        text = _read_state_text(path)
        if text is None:
            return []
        try:
            table = [row for row in csv.reader(io.StringIO(text)) if row]
        except csv.Error as exc:
            raise StateError(f"{path}: {exc}; {_FIX}") from None
        if not table:
            return []
        header, rows = table[0], table[1:]
        if set(header) - set(RUN_FIELDS) or len(set(header)) != len(header):
            raise StateError(f"{path}: the header is not {','.join(RUN_FIELDS)}; {_FIX}")
        out = []
        for number, row in enumerate(rows, start=2):
            if len(row) > len(header):
                raise StateError(f"{path}: row {number} has {len(row)} fields, the header {len(header)}; {_FIX}")
            record = dict.fromkeys(RUN_FIELDS, "")
            record.update(zip(header, row, strict=False))  # a short row is padded with ''
            out.append(record)
        return out

    def append_run(self, **row: Any) -> dict[str, str]:
        unknown = set(row) - set(RUN_FIELDS)
        if unknown:
            raise ValueError(f"unknown run-log fields: {sorted(unknown)}")
        record = {k: "" if row.get(k) is None else str(row.get(k)) for k in RUN_FIELDS}
        record["date"] = record["date"] or iso(now_utc())
        rows = self.runs() + [record]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=RUN_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.runs_path, buf.getvalue())
        return record

    # -- smoke passes -----------------------------------------------------------------------
    def record_smoke_pass(self, fingerprint: str, run_id: str, job: str,
                          measured: dict[str, Any] | None = None) -> None:
        """The pass push looks for; `measured`: what the smoke's reference run measured (`steps_per_s`, the
        laptop's pace; `total`, the loop's total as the code asked for it; `sets`, the --set it ran with)."""
        passes = _read_state_json(self.root / SMOKE_FILE)
        passes[fingerprint] = {"run_id": run_id, "job": job, "date": iso(now_utc()), **(measured or {})}
        atomic_write_json(self.root / SMOKE_FILE, passes)

    def smoke_measured(self, job: str, fingerprint: str | None = None) -> dict[str, Any] | None:
        """The smoke pass of `fingerprint` if it measured a pace, else the job's newest one that did (an older
        code's), with its fingerprint added; None when no smoke of the job measured one."""
        passes = _read_state_json(self.root / SMOKE_FILE)
        timed = {fp: p for fp, p in passes.items() if isinstance(p, dict) and p.get("job") == job
                 and isinstance(p.get("steps_per_s"), (int, float)) and p["steps_per_s"] > 0}
        if fingerprint in timed:
            return {**timed[fingerprint], "fingerprint": fingerprint}
        newest = max(timed, key=lambda fp: str(timed[fp].get("date")), default=None)
        return None if newest is None else {**timed[newest], "fingerprint": newest}

    def smoke_passed(self, fingerprint: str) -> dict[str, Any] | None:
        return _read_state_json(self.root / SMOKE_FILE).get(fingerprint)

    # -- sessions (one chain per job) -------------------------------------------------------
    def sessions(self, job: str) -> list[SessionRecord]:
        return self.all_sessions().get(job, [])

    def save_session(self, job: str, session: SessionRecord) -> None:
        """Insert or update the session with the same number."""
        data = self.all_sessions()
        chain = [s for s in data.get(job, []) if s["session"] != session["session"]]
        chain.append(session)
        chain.sort(key=lambda s: s["session"])
        data[job] = chain
        atomic_write_json(self.root / SESSIONS_FILE, data)
        self._note_account(job, session)

    def _note_account(self, job: str, session: SessionRecord) -> None:
        """A GPU session Kaggle started is noted in its account's week too (store/account.py), by its kernel's
        owner and version, so the account's other job folders count its hours."""
        kernel, version = session.get("kernel") or "", session.get("version")
        owner = kernel.split("/")[0]
        if not session.get("gpu") or not session.get("started") or not version or not ACCOUNT_NAME.fullmatch(owner):
            return
        fields: dict[str, Any] = dict(session)
        entry = {key: fields[key] for key in account.FIELDS if fields.get(key) is not None}
        account.note(owner, f"{kernel}/{version}", {**entry, "job": job, "folder": str(Path(self.root).resolve())},
                     since=iso(now_utc() - account.KEEP))

    def publish_figures(self, job: str) -> dict[str, Any] | None:
        """How long the in-kernel publish takes, as last measured: by a session of the chain (its
        summary's publish_timing) or by a rehearsal (save_publish_figures); None if never measured."""
        for record in reversed(self.sessions(job)):
            timing = Summary.from_dict(record.get("summary")).publish_timing
            if timing:
                return dict(timing)
        return _read_state_json(self.root / PUBLISH_FILE).get(job)

    def save_publish_figures(self, job: str, figures: dict[str, Any]) -> None:
        data = _read_state_json(self.root / PUBLISH_FILE)
        data[job] = figures
        atomic_write_json(self.root / PUBLISH_FILE, data)

    # -- releases -------------------------------------------------------------------------
    def release_record(self, target: str, digest: str) -> dict[str, Any] | None:
        """What this laptop sent of the weights `digest` to `target` (a model variation or a dataset):
        {before, number (None until it settled), step, which, sent}, or None when it never sent them."""
        entry = _read_state_json(self.root / RELEASES_FILE).get(target)
        record = entry.get(digest) if isinstance(entry, dict) else None
        return record if isinstance(record, dict) else None

    def save_release(self, target: str, digest: str, record: dict[str, Any]) -> None:
        data = _read_state_json(self.root / RELEASES_FILE)
        entry = data.get(target)
        data[target] = {**(entry if isinstance(entry, dict) else {}), digest: record}
        atomic_write_json(self.root / RELEASES_FILE, data)

    def all_sessions(self) -> dict[str, list[SessionRecord]]:
        path = self.root / SESSIONS_FILE
        data = _read_state_json(path)
        for job, chain in data.items():
            if not isinstance(chain, list):
                raise StateError(f"{path}: {job[:60]!r} is not a list of sessions; {_FIX}")
            for i, record in enumerate(chain):
                problem = _session_problem(record)
                if problem:
                    raise StateError(f"{path}: {job[:60]!r} entry {i + 1}: {problem}; {_FIX}")
                sessionstate.typed(record)
        return data

    # -- the GPU-hour week ------------------------------------------------------------------
    def week_tally(self, moment: datetime | None = None, user: str | None = None) -> dict[str, float]:
        """An unattended chain's week as its kernels count it on when Kaggle reports no GPU figures
        (config.kaggle.week, nextsession.week_used): the quota week's start (epoch seconds, kchain's
        assumption) and the GPU seconds this ledger holds for it, every job's (with user, the account's)."""
        moment = moment or now_utc()
        start = week_start(moment)
        used_h = self.gpu_hours_this_week(moment, start, user)
        return {"start": start.timestamp(), "used_s": round(used_h * 3600, 1)}

    def elsewhere(self, user: str | None, moment: datetime | None = None,
                  start: datetime | None = None) -> list[dict[str, Any]]:
        """The account's GPU sessions this quota week that this ledger does not hold: those its other job
        folders noted (store/account.py), oldest first, each {job, session, status, started, ended, folder}."""
        if not user:
            return []
        start = start or week_start(moment or now_utc())
        ours = {f"{s.get('kernel')}/{s.get('version')}" for chain in self.all_sessions().values() for s in chain}
        noted = sorted(account.noted(user).items(), key=lambda item: str(item[1].get("started")))
        return [e for key, e in noted if key not in ours and (began := _time(e.get("started"))) and began >= start]

    def gpu_hours_this_week(self, moment: datetime | None = None, start: datetime | None = None,
                            user: str | None = None) -> float:
        """GPU-hours of every GPU session (all jobs) that started in the current quota week (from start,
        e.g. the week Kaggle reports; default: week_start's assumption); with user, the account's sessions
        its other job folders noted too (elsewhere)."""
        moment = moment or now_utc()
        start = start or week_start(moment)
        total = sum(noted_hours(e, moment) for e in self.elsewhere(user, moment, start))
        for chain in self.all_sessions().values():
            for s in chain:
                if not s.get("gpu") or not s.get("started"):
                    continue
                began = parse_iso(s["started"])
                if began < start:
                    continue
                ended = parse_iso(s["ended"]) if s.get("ended") else moment
                total += max(0.0, (ended - began).total_seconds()) / 3600
        return total


# -- reading the state files: damaged ones are refused with their path, never rewritten ----------

_FIX = "fix it by hand, or move the file aside and kchain starts a new one"


def _read_state_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"{path}: cannot read it ({exc.strerror or exc}); check the file and its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StateError(f"{path}: not UTF-8 text (byte {exc.start}); {_FIX}") from None


def _read_state_json(path: Path) -> dict[str, Any]:
    text = _read_state_text(path)
    if text is None or not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateError(f"{path}: not valid JSON ({str(exc)[:80]}); {_FIX}") from None
    except RecursionError:
        raise StateError(f"{path}: not valid JSON (nested too deep); {_FIX}") from None
    if not isinstance(data, dict):
        raise StateError(f"{path}: expected a JSON object; {_FIX}")
    return data


def _session_problem(record: Any) -> str | None:
    """What is wrong with one session record, for the fields kchain reads back; None if fine."""
    if not isinstance(record, dict):
        return "not an object"
    if not isinstance(record.get("session"), int) or isinstance(record.get("session"), bool):
        return "'session' is not a number"
    if problem := sessionstate.problem(record.get("status")):
        return problem
    for key in ("started", "ended"):
        value = record.get(key)
        if value is None:
            continue
        try:
            parse_iso(value)
        except (TypeError, ValueError):
            return f"{key!r} is not a time like 2026-01-31T12:00:00Z"
    for key in ("kernel", "requested"):
        if record.get(key) is not None and not isinstance(record[key], str):
            return f"{key!r} is not text"
    for key in ("summary", "error"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"{key!r} is not an object"
    if isinstance(record.get("error"), dict) and not {"type", "message"} <= set(record["error"]):
        return "'error' has no type and message"
    return None


# -- what `kchain budget` and `kchain runs` print --------------------------------------------------


# A session another job folder last saw running counts up to now, but never past Kaggle's longest (12 h,
# kaggle-api.md 6.1): that folder may never look again.
LONGEST_SESSION_H = 12.0
ACCOUNT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a Kaggle username: a file name under accounts/


def _time(text: Any) -> datetime | None:
    """parse_iso of a time a file holds; None when it is none."""
    try:
        return parse_iso(text)
    except (TypeError, ValueError):
        return None


def noted_hours(entry: dict[str, Any], moment: datetime | None = None) -> float:
    """The GPU-hours of a session another job folder noted (Ledger.elsewhere)."""
    began, ended = _time(entry.get("started")), _time(entry.get("ended"))
    if began is None:
        return 0.0
    if ended is None:
        return min(LONGEST_SESSION_H, max(0.0, ((moment or now_utc()) - began).total_seconds() / 3600))
    return max(0.0, (ended - began).total_seconds()) / 3600


def session_hours(session: SessionRecord, moment: datetime | None = None) -> float:
    if not session.get("started"):
        return 0.0
    end = parse_iso(session["ended"]) if session.get("ended") else (moment or now_utc())
    return max(0.0, (end - parse_iso(session["started"])).total_seconds()) / 3600


def sessions_needed(hours: float, usable_session_h: float) -> int:
    """The sessions `hours` of training take at `usable_session_h` each (the session limit less its margin)."""
    return int(-(-hours // usable_session_h)) if hours > 0 else 0


def budget_document(ledger: Ledger, weekly_h: float, job: str | None = None,
                    usable_session_h: float = 11.75, start: datetime | None = None,
                    kaggle_used_h: float | None = None, elsewhere: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`kchain budget --json`: this quota week's GPU sessions, what is left, and what the job's remaining
    steps need at its measured pace (the shape README's "Machine-readable output" documents). weekly_h is
    the week's allowance (the smaller of the job's budget and Kaggle's), start the week Kaggle reports, and
    kaggle_used_h Kaggle's own count, which wins where it is higher (GPU time spent outside kchain); elsewhere:
    the account's sessions its other job folders noted (Ledger.elsewhere), listed after this ledger's."""
    moment = now_utc()
    start = start or week_start(moment)
    sessions, left = [], weekly_h
    for name, chain in sorted(ledger.all_sessions().items()):
        for s in chain:
            if not s.get("gpu") or not s.get("started") or parse_iso(s["started"]) < start:
                continue
            hours = session_hours(s, moment)
            left -= hours
            summary = Summary.from_dict(s.get("summary"))
            outcome = summary.status or s["status"].lower()
            if summary.step is not None:
                outcome += f" at step {summary.step}"
            sessions.append({"job": name, "session": s["session"], "gpu_hours": hours, "left_after": left,
                             "outcome": outcome})
    for noted in elsewhere or []:
        hours = noted_hours(noted, moment)
        left -= hours
        sessions.append({"job": noted.get("job"), "session": noted.get("session"), "gpu_hours": hours,
                         "left_after": left, "outcome": f"{str(noted.get('status') or '').lower()} (another job "
                         f"folder's ledger: {noted.get('folder')})", "folder": noted.get("folder")})
    remaining = None
    done = [Summary.from_dict(s.get("summary")) for s in (ledger.sessions(job) if job else []) if s.get("summary")]
    if done and done[-1].total and done[-1].steps_per_s:
        last = done[-1]
        steps = max(0, (last.total or 0) - (last.step or 0))
        hours = steps / (last.steps_per_s or 1.0) / 3600
        remaining = {"steps": steps, "steps_per_s": last.steps_per_s, "gpu_hours": hours,
                     "sessions": sessions_needed(hours, usable_session_h) if steps else 0}
    if kaggle_used_h is not None:
        left = min(left, weekly_h - kaggle_used_h)
    return {"job": job, "week_start": iso(start), "weekly_gpu_hours": weekly_h, "sessions": sessions,
            "left": max(0.0, left), "remaining": remaining}


def budget_lines(ledger: Ledger, weekly_h: float, job: str | None = None, usable_session_h: float = 11.75,
                 week: dict[str, Any] | None = None, refresh: str = "Saturday 00:00 UTC") -> list[str]:
    """The week like a quota table, and what the job's remaining steps need at its measured pace."""
    week = week or budget_document(ledger, weekly_h, job, usable_session_h)
    lines = [f"GPU quota week from {week['week_start']} (resets {refresh})",
             f"{'session':<34} {'GPU-h':>7} {f'left of {weekly_h:g}':>11}  outcome"]
    for s in week["sessions"]:
        lines.append(f"{s['job'] + ' session ' + str(s['session']):<34} {s['gpu_hours']:7.2f} {s['left_after']:11.2f}  "
                     f"{s['outcome']}")
    lines.append(f"{week['left']:.2f} GPU-hours left this week.")
    if (todo := week["remaining"]) is not None:
        lines.append(f"{job}: {todo['steps']} steps to go at {todo['steps_per_s']:.2f} steps/s = "
                     f"{todo['gpu_hours']:.2f} GPU-h, {todo['sessions']} more session(s)")
    return lines


def _best_run(rows: list[dict[str, str]]) -> dict[str, str] | None:
    scored = [r for r in rows if r.get("val")]
    try:
        return min(scored, key=lambda r: float(r["val"])) if scored else None
    except ValueError:
        return None


def runs_lines(ledger: Ledger, chain_lines: list[str] | None = None, job_file: Path | str = "job.yaml") -> list[str]:
    """The run log, then what the chain's records say of its result (chain_lines: the kept best and the final
    weights, kchain/chain/outcome.py), or, with no chain, the row with the best validation value."""
    rows = ledger.runs()
    lines = [f"{'run':<28} {'date':<20} {'channel':<8} {'job':<18} {'config':<12} {'steps':>6} {'val':>9}  "
             f"{'checkpoint':<30} note"]
    for r in rows:
        lines.append(f"{r['run_id']:<28} {r['date']:<20} {r['channel']:<8} {r['job']:<18} {r['config']:<12} "
                     f"{r['steps']:>6} {r['val']:>9}  {r['checkpoint']:<30} {r['note']}")
    best = _best_run(rows)
    if chain_lines:
        if not rows:
            lines.append("no run log on this laptop: the chain's records were rebuilt from Kaggle")
        lines += chain_lines
    elif best:
        # A row's val is the value at its own step; the best checkpoint is the chain's kept best, named once
        # a chain kept one (train.keep_best).
        lines.append(f"best row by val: {best['run_id']} at val {best['val']} (job {best['job']})")
    elif not rows:
        lines.append(f"the run log is empty: `kchain smoke {job_file}` writes its first line")
    return lines


def runs_json(ledger: Ledger) -> dict[str, Any]:
    """`kchain runs --json`'s rows, steps and val as numbers (null when empty), and the best row's run_id."""
    rows = ledger.runs()
    best = _best_run(rows)

    def number(text: str, kind: type) -> Any:
        try:
            return kind(text) if text else None
        except ValueError:
            return None  # the run log is the user's file too: a hand-edited cell is not a number

    return {"runs": [{**r, "steps": number(r["steps"], int), "val": number(r["val"], float)} for r in rows],
            "best": best["run_id"] if best else None}
