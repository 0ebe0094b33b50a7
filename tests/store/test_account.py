# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""The week's GPU-hours per Kaggle account, across job folders (store/account.py): each folder's ledger notes
its GPU sessions in the account's record under kchain's config home, so `budget`, `push`'s budget check and
`status` in a second job folder count the first's hours. The unmodified client, the local Kaggle with its
strict defaults (its quota answer has no GPU figures), real notebook sessions; two commands note at once
under the record's lock."""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from emulator_helpers import USER, emulator  # noqa: F401  (fixture)
from helpers import STALL, copy_job, error_line, invoke

from kchain.common import layout
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.errors import StateError
from kchain.store import account
from kchain.store.ledger import Ledger, iso, now_utc


def gpu_session(n: int, started: datetime, hours: float | None, kernel: str = f"{USER}/job-a") -> SessionRecord:
    record: SessionRecord = {"session": n, "status": SessionState.RUNNING, "gpu": True, "kernel": kernel,
                             "version": n, "started": iso(started)}
    if hours is not None:
        record["status"], record["ended"] = SessionState.COMPLETE, iso(started + timedelta(hours=hours))
    return record


def test_a_second_job_folder_counts_the_first_ones_hours_and_no_session_twice(tmp_path):
    start = now_utc() - timedelta(hours=5)
    first, second = Ledger(tmp_path / "a" / ".kchain"), Ledger(tmp_path / "b" / ".kchain")
    first.save_session("job-a", gpu_session(1, start, 2.0))
    first.save_session("job-a", gpu_session(2, start + timedelta(hours=3), None))  # still running, over there
    first.save_session("job-a", {"session": 3, "status": SessionState.PUSHING, "gpu": True, "kernel": f"{USER}/job-a"})
    second.save_session("job-b", gpu_session(1, start, 1.0, kernel=f"{USER}/job-b"))
    assert second.gpu_hours_this_week() == pytest.approx(1.0)  # without the account: this folder only
    assert second.gpu_hours_this_week(user=USER) == pytest.approx(1.0 + 2.0 + 2.0, abs=0.01)
    assert [(e["job"], e["session"], e["folder"]) for e in second.elsewhere(USER)] == [
        ("job-a", 1, str(tmp_path / "a" / ".kchain")), ("job-a", 2, str(tmp_path / "a" / ".kchain"))]
    assert first.gpu_hours_this_week(user=USER) == pytest.approx(5.0, abs=0.01)  # its own sessions once
    assert second.gpu_hours_this_week(user="someone-else") == pytest.approx(1.0)

    noted = json.loads(account.path_of(USER).read_text())
    assert noted[f"{USER}/job-a/1"] == {"job": "job-a", "session": 1, "status": "COMPLETE", "started": iso(start),
                                         "ended": iso(start + timedelta(hours=2)),
                                         "folder": str(tmp_path / "a" / ".kchain")}
    assert account.path_of(USER) == Path(os.environ["XDG_CONFIG_HOME"]) / "kchain" / "accounts" / f"{USER}.json"


def test_a_session_another_folder_saw_running_counts_at_most_kaggles_longest_and_old_weeks_go():
    long_ago = now_utc() - timedelta(days=3)
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    Ledger(Path(os.environ["HOME"]) / "other").save_session("job-a", gpu_session(1, long_ago, None))
    moment = long_ago + timedelta(days=1)
    assert ledger.gpu_hours_this_week(moment, start=long_ago - timedelta(minutes=1), user=USER) == pytest.approx(12.0)
    account.note(USER, f"{USER}/old/1", {"started": iso(now_utc() - timedelta(days=20))},
                 since=iso(now_utc() - account.KEEP))
    assert f"{USER}/old/1" not in account.noted(USER)
    assert f"{USER}/job-a/1" in account.noted(USER)


def test_a_damaged_record_is_refused_with_its_path_and_kept():
    path = account.path_of(USER)
    path.parent.mkdir(parents=True)
    path.write_text('{"alice/job-a/1": ')
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    with pytest.raises(StateError, match=f"^{path}: not valid JSON; fix it by hand, or move the file aside"):
        ledger.save_session("job-a", gpu_session(1, now_utc(), 1.0))
    assert path.read_text() == '{"alice/job-a/1": '


def _note_many(config_home: str, who: str, count: int) -> None:
    os.environ[account.CONFIG_HOME_ENV] = config_home
    for n in range(count):
        account.note(USER, f"{USER}/{who}/{n}", {"started": iso(now_utc())}, since="2000-01-01T00:00:00Z")


def test_two_commands_noting_at_once_lose_no_session(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_note_many, args=(str(tmp_path / "config"), who, 40)) for who in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    os.environ[account.CONFIG_HOME_ENV] = str(tmp_path / "config")
    try:
        assert sorted(account.noted(USER)) == sorted(f"{USER}/{who}/{n}" for who in "ab" for n in range(40))
    finally:
        del os.environ[account.CONFIG_HOME_ENV]


def test_two_job_folders_of_one_account_share_its_week(tmp_path, emulator, monkeypatch):
    """Job A's session runs on the local Kaggle; job B, in another folder with its own .kchain/, counts it: its
    `budget` lists it, and its push of a 1 h session against a 1 GPU-hour week is refused in one line."""
    monkeypatch.delenv("KCHAIN_HOME")  # each job folder keeps its own ledger, as on a laptop
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=3")
    small = {"steps": 10**6, "batch": 8, "accumulate": 1}
    a = copy_job("tinygpt", tmp_path / "a", params=small, train={"session_limit": "1h", "checkpoint_every": "2s"})
    b = copy_job("tinygpt", tmp_path / "b", params=small, train={"session_limit": "1h"},
                 budget={"weekly_gpu_hours": 1})  # exactly one session's hours: whatever A spent, B does not fit
    b.write_text(b.read_text().replace("name: tinygpt-notes", "name: tinygpt-other"))
    assert invoke("push", a, "--skip-smoke").exit_code == 0
    emulator.wait_session(f"{USER}/tinygpt-notes", 1)
    assert invoke("status", a).exit_code == 0  # A's ledger (and the account's record) learn the session ended
    (ran,) = Ledger(a.parent / ".kchain").sessions("tinygpt-notes")
    assert ran["ended"] > ran["started"]

    shown = invoke("budget", b)
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.output.splitlines() if line.startswith("tinygpt-notes session 1 "))
    assert row.endswith(f"(another job folder's ledger: {a.parent / '.kchain'})"), shown.output
    week = json.loads(invoke("budget", b, "--json").output)
    assert [(s["job"], s["session"]) for s in week["sessions"]] == [("tinygpt-notes", 1)]
    assert week["left"] < 1 and week["sessions"][0]["gpu_hours"] == pytest.approx(1 - week["left"])

    status = json.loads(invoke("status", b, "--json").output)
    assert status["sessions"] == [] and status["gpu_hours"]["left"] == pytest.approx(week["left"], abs=0.01)
    refused = invoke("push", b, "--skip-smoke")
    assert refused.exit_code == 5, refused.output
    assert error_line(refused) == (
        f"Error: {b}: this session may use 1.00 GPU-h but only {week['left']:.2f} are left this week "
        "(budget.weekly_gpu_hours 1); wait for Saturday 00:00 UTC, lower train.session_limit, or pass --force")
    assert "(account alice, every job folder on this laptop)" in refused.output
    assert [s["kernel"] for s in emulator.sessions()] == [f"{USER}/tinygpt-notes"]  # B pushed nothing
    assert os.environ["KAGGLE_KEY"] not in account.path_of(USER).read_text()
