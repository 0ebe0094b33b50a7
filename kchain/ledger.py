"""What kchain remembers on the laptop: the run log, smoke passes, sessions and the GPU-hour week.

Everything lives in the project's state folder: `$KCHAIN_HOME` if set, else `.kchain/` next to the
job file. Every write is atomic (the files are small, so a write rewrites the whole file).
"""

from __future__ import annotations

import csv
import io
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kchain.fsutil import atomic_write_json, atomic_write_text, read_json

RUNS_FILE = "runs.csv"
SMOKE_FILE = "smoke-passes.json"
SESSIONS_FILE = "sessions.json"
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


def week_start(moment: datetime) -> datetime:
    """Kaggle's GPU quota week starts on Saturday 00:00 UTC."""
    moment = moment.astimezone(timezone.utc)
    days_since_saturday = (moment.weekday() - 5) % 7
    start = moment - timedelta(days=days_since_saturday)
    return start.replace(hour=0, minute=0, second=0, microsecond=0)


@dataclass
class Ledger:
    root: Path

    # -- the run log ------------------------------------------------------------------------
    @property
    def runs_path(self) -> Path:
        return self.root / RUNS_FILE

    def runs(self) -> list[dict[str, str]]:
        try:
            text = self.runs_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return list(csv.DictReader(io.StringIO(text)))

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
    def record_smoke_pass(self, fingerprint: str, run_id: str, job: str) -> None:
        passes = read_json(self.root / SMOKE_FILE, {})
        passes[fingerprint] = {"run_id": run_id, "job": job, "date": iso(now_utc())}
        atomic_write_json(self.root / SMOKE_FILE, passes)

    def smoke_passed(self, fingerprint: str) -> dict[str, Any] | None:
        return read_json(self.root / SMOKE_FILE, {}).get(fingerprint)

    # -- sessions (one chain per job) -------------------------------------------------------
    def sessions(self, job: str) -> list[dict[str, Any]]:
        return read_json(self.root / SESSIONS_FILE, {}).get(job, [])

    def save_session(self, job: str, session: dict[str, Any]) -> None:
        """Insert or update the session with the same number."""
        data = read_json(self.root / SESSIONS_FILE, {})
        chain = [s for s in data.get(job, []) if s["session"] != session["session"]]
        chain.append(session)
        chain.sort(key=lambda s: s["session"])
        data[job] = chain
        atomic_write_json(self.root / SESSIONS_FILE, data)

    def all_sessions(self) -> dict[str, list[dict[str, Any]]]:
        return read_json(self.root / SESSIONS_FILE, {})

    # -- the GPU-hour week ------------------------------------------------------------------
    def gpu_hours_this_week(self, moment: datetime | None = None) -> float:
        """GPU-hours of every GPU session (all jobs) that started in the current quota week."""
        moment = moment or now_utc()
        start = week_start(moment)
        total = 0.0
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
