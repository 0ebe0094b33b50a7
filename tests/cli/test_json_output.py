"""`kchain status`, `runs` and `budget` with --json: one JSON document each, in the shape README's
"Machine-readable output" documents (a script's contract: keys are only ever added)."""

from __future__ import annotations

import json
from datetime import timedelta

from helpers import JOBS, invoke

from kchain.chain.sessions import waiting
from kchain.common.sessionstate import SessionState
from kchain.job.spec import load_job
from kchain.store.ledger import Ledger, iso, now_utc, state_dir, week_start

JOB = JOBS / "tinygpt" / "job.yaml"


def a_week_of_sessions() -> tuple[str, Ledger]:
    """A chain of two ended GPU sessions this week, as the ledger keeps them (nothing live to ask Kaggle).
    They began 3 h ago, or when the quota week began if that was later: on a Saturday before 03:00 UTC
    a start 3 h back would lie in last week, and this week would hold none of their hours."""
    name = load_job(JOB).name
    ledger = Ledger(state_dir(JOB))
    now = now_utc()
    start = max(now - timedelta(hours=3), week_start(now))
    ledger.save_session(name, {
        "session": 1, "kernel": f"alice/{name}", "version": 1, "status": SessionState.COMPLETE, "gpu": True,
        "started": iso(start), "ended": iso(start + timedelta(hours=1)), "step": 100, "total": 300,
        "end_status": "saved", "summary": {"status": "saved", "step": 100, "total": 300, "steps_per_s": 0.05}})
    ledger.save_session(name, {
        "session": 2, "kernel": f"alice/{name}", "version": 2, "status": SessionState.ERROR, "gpu": True,
        "started": iso(start + timedelta(hours=1)), "ended": iso(start + timedelta(hours=1, minutes=30)),
        "step": 120, "total": 300, "error": {"type": "RuntimeError", "message": "shape mismatch"}})
    return name, ledger


def document(*args: object) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_status_json(tmp_path):
    name, _ = a_week_of_sessions()
    status = document("status", JOB)
    assert list(status) == ["job", "sessions", "gpu_hours", "waiting", "warnings", "kept_best"]
    assert status["job"] == name and status["warnings"] == []
    first, second = status["sessions"]
    assert list(first) == ["session", "version", "status", "started", "ended", "duration_s", "step", "total",
                           "stale", "note"]
    assert (first["session"], first["version"], first["status"], first["step"], first["total"]) == (1, 1, "COMPLETE",
                                                                                                   100, 300)
    assert first["duration_s"] == 3600.0 and first["stale"] is False and first["note"] == "saved"
    assert (second["status"], second["note"]) == ("ERROR", "RuntimeError: shape mismatch")
    assert list(status["gpu_hours"]) == ["used", "weekly", "left"]
    assert abs(status["gpu_hours"]["used"] - 1.5) < 0.01 and status["gpu_hours"]["weekly"] == 30
    assert status["waiting"] == {"for": "continue", "why": "session 2 ended (error); the laptop drives this "
                                                           "chain, so the next session waits for it"}
    # Before the first session (nothing on Kaggle either): the chain waits for its push, never null.
    assert waiting([], JOB) == {"for": "push", "why": f"no session yet: `kchain push {JOB}` starts one"}


def test_status_says_an_unattended_chain_waits_for_the_laptop_and_the_kernels_reason(tmp_path):
    name, ledger = a_week_of_sessions()
    why = "the kernel could not publish: 21s left before the session limit, and publishing 194 kB needs about 95s"
    record = ledger.sessions(name)[1]
    record.update({"status": SessionState.COMPLETE, "error": None, "summary": {
        "status": "deadline", "step": 120, "total": 300, "next": {"decision": "left to the laptop", "pushed": False,
                                                                  "why": why}}})
    ledger.save_session(name, record)
    lines = invoke("status", JOB).output.splitlines()
    assert lines[-1] == (f"nothing is running; the chain waits for `kchain continue {JOB}`: session 2's kernel did "
                         f"not push the next session: {why}")
    assert record["summary"] is not None
    record["summary"]["status"] = "finished"
    ledger.save_session(name, record)
    assert document("status", JOB)["waiting"] == {"for": "nothing",
                                                  "why": "the chain has ended: session 2 finished at step 120/300"}


def test_budget_json(tmp_path):
    name, _ = a_week_of_sessions()
    budget = document("budget", JOB)
    assert list(budget) == ["job", "week_start", "weekly_gpu_hours", "sessions", "left", "remaining"]
    assert (budget["job"], budget["weekly_gpu_hours"]) == (name, 30)
    assert [list(s) for s in budget["sessions"]] == [["job", "session", "gpu_hours", "left_after", "outcome"]] * 2
    assert [s["outcome"] for s in budget["sessions"]] == ["saved at step 100", "error"]
    assert abs(budget["left"] - 28.5) < 0.01 and abs(budget["sessions"][0]["left_after"] - 29.0) < 0.01
    # From the last session with a summary: 200 steps to go at 0.05 steps/s.
    assert budget["remaining"] == {"steps": 200, "steps_per_s": 0.05, "gpu_hours": 200 / 0.05 / 3600, "sessions": 1}


def test_runs_json(tmp_path):
    assert document("runs", JOB) == {"runs": [], "best": None, "kept_best": None}
    ledger = Ledger(state_dir(JOB))
    ledger.append_run(run_id="r1", channel="smoke", job="j", config="abc", steps=4, val="0.9", checkpoint="c1", note="")
    ledger.append_run(run_id="r2", channel="kaggle", job="j", config="abc", steps=400, val="0.35", checkpoint="c2",
                      note="died, resumed")
    ledger.append_run(run_id="r3", channel="kaggle", job="j", config="abc", steps=None, val=None, checkpoint="",
                      note="")
    runs = document("runs", JOB)
    assert runs["best"] == "r2"
    assert [list(r) for r in runs["runs"]] == [["run_id", "date", "channel", "job", "config", "steps", "val",
                                                "checkpoint", "note"]] * 3
    assert [(r["run_id"], r["steps"], r["val"]) for r in runs["runs"]] == [("r1", 4, 0.9), ("r2", 400, 0.35),
                                                                          ("r3", None, None)]
