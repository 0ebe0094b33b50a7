# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain queue` against the local Kaggle (strict defaults, two GPU slots, real sessions): three runs of
one job on two slots, the second crashing; and a week that cannot hold the plan, refused before any push."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from emulator_helpers import emulator  # noqa: F401
from helpers import error_line, invoke, runtime_job

from kchain.chain.budget import plan_for
from kchain.chain.queue import most_at_once
from kchain.common import layout
from kchain.common.sessionstate import SessionState
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import QUEUE_FILE, Ledger


def _job(tmp_path: Path, weekly_h: float) -> Path:
    """tiny_job's classifier, 12 steps, whose run with params.seed 2 crashes at step 3 (a bug one variant
    meets), a week of `weekly_h` GPU-hours and a slack of 2."""
    path = runtime_job(tmp_path, "tiny_job", "main", "q", params={"d_model": 8, "steps": 12, "rows": 64})
    code = path.parent / "code" / "tiny_job.py"
    code.write_text(code.read_text().replace(
        "        trainer.step()\n",
        "        trainer.step()\n        if step == 3 and p.get('seed') == 2:\n"
        "            raise ValueError('boom in the seed 2 run')\n"))
    data = yaml.safe_load(path.read_text())
    data["budget"] = {"weekly_gpu_hours": weekly_h, "slack": 2}
    path.write_text(yaml.safe_dump(data))
    return path


def test_three_runs_on_two_slots_a_crash_stops_its_run_alone(tmp_path, emulator, monkeypatch):
    path = _job(tmp_path, weekly_h=30)
    assert invoke("smoke", path).exit_code == 0  # the pace the plan sizes the runs from
    # Each session stops (its deadline) after 8 steps: a run of 12 steps is a chain of two sessions.
    monkeypatch.setenv(layout.FAULT_ENV, "deadline_after_steps=8")
    events = tmp_path / "events.txt"
    told = f'echo "$KCHAIN_EVENT $KCHAIN_JOB $KCHAIN_SESSION" >> {events}'
    result = invoke("queue", path, "--seeds", "1,2,3", "--steps", "12", "--skip-smoke", "--poll", "1",
                    "--notify", told)
    assert result.exit_code == 0, result.output

    queue = json.loads((Path(os.environ["KCHAIN_HOME"]) / QUEUE_FILE).read_text())
    r1, r2, r3 = queue["runs"]
    assert [(r["chain"], r["sets"], r["state"]) for r in queue["runs"]] == [
        ("q-main-1", {"seed": 1}, "finished"), ("q-main-2", {"seed": 2}, "stopped"),
        ("q-main-3", {"seed": 3}, "finished")]
    assert "ValueError: boom in the seed 2 run" in r2["said"]
    assert r3["started"] >= r2["ended"]  # run 3 took the slot run 2's crash gave back
    assert r3["slot"] is None and r1["slot"] is None  # every slot given back at the end

    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    chains = {name: ledger.sessions(name) for name in ("q-main-1", "q-main-2", "q-main-3")}
    assert [len(c) for c in chains.values()] == [2, 1, 2]  # the crashed run never got a second session
    assert not [s for c in ledger.all_sessions().values() for s in c if s["status"] == SessionState.FAILED_TO_PUSH]
    ours = [s for s in emulator.sessions() if s["kernel"].startswith("alice/q-main-")]
    assert len(ours) == 5 and most_at_once(ours) <= 2  # no third session ever live, none refused at the cap

    job = load_job(path)
    week = plan_for(job, ledger, KaggleClient(timeout_s=10))
    assert week.used_h <= week.weekly_h - 2  # the slack unspent
    assert sum(r["spent_h"] for r in queue["runs"]) <= sum(r["planned_h"] for r in queue["runs"])

    said = events.read_text().splitlines()
    assert "needs_person q-main-2 1" in said and "finished q-main-1 2" in said and "finished q-main-3 2" in said
    assert said[-1] == "queue_ended q-main "  # the queue's end, once, last
    assert {line for line in said if line.startswith("session_ended")} == {"session_ended q-main-1 2",
                                                                          "session_ended q-main-3 2"}

    status = invoke("status", path)
    assert "queue of 3 run(s) on Kaggle's 2 GPU slots" in status.output
    assert "3 run(s): 2 finished, 1 stopped" in status.output
    assert "q-main has no session yet" not in status.output  # the job's runs are the queue's chains
    week_log = invoke("week", path)  # the run log of the week: one row per run, what it changed
    rows = [line for line in week_log.output.splitlines() if line.startswith(("r1 ", "r2 ", "r3 "))]
    assert len(rows) == 3 and rows[1].endswith("seed 1 -> 2") and rows[2].endswith("seed 2 -> 3")
    assert "failed: ValueError: boom in the seed 2 run" in week_log.output

    assert f"`kchain pull {path} --run r1 --final`" in r1["said"]  # the run's own pull, as its line names it
    pulled = invoke("pull", path, "--run", "r1", "--final", "-o", tmp_path / "r1-final")
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "r1-final" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "r1-final" / "metrics.json").read_text())["step"] == 12
    wrong = invoke("pull", path, "--run", "r9")
    assert wrong.exit_code != 0 and error_line(wrong).endswith("--run r9: the queue's runs are r1, r2, r3")

    again = invoke("queue", path, "--seeds", "1,2,3", "--steps", "12", "--skip-smoke")  # a queue that is done
    assert again.exit_code == 0 and "queue: 3 run(s) kept in" in again.output  # a new one: every chain has ended
    assert len([s for s in emulator.sessions() if s["kernel"].startswith("alice/q-main-")]) == 5, again.output


def test_a_week_that_cannot_hold_the_plan_is_refused_before_any_push(tmp_path, emulator):
    path = _job(tmp_path, weekly_h=2.5)  # 0.5 GPU-h plannable beside the slack of 2
    assert invoke("smoke", path).exit_code == 0
    result = invoke("queue", path, "--seeds", "1,2,3", "--steps", "12", "--skip-smoke", "--poll", "1")
    assert result.exit_code == 5
    assert "can be planned this week" in error_line(result) and "drop r" in error_line(result)
    assert emulator.sessions() == [] and not (Path(os.environ["KCHAIN_HOME"]) / QUEUE_FILE).exists()


def test_a_rehearsed_queue_shows_the_week_with_a_crash_in_one_run(tmp_path):
    """`kchain queue --rehearse`: no Kaggle of the test's own, the plan's runs on a private local Kaggle."""
    path = runtime_job(tmp_path, "tiny_job", "main", "q", params={"d_model": 8, "steps": 12, "rows": 64})
    assert invoke("smoke", path).exit_code == 0
    result = invoke("queue", path, "--seeds", "1,2,3", "--steps", "12", "--rehearse", "--crash", "r2")
    assert result.exit_code == 0, result.output
    assert ("verdict: the queue ran as planned: r1 finished in 2 session(s), r2 stopped in 1 session(s), r3 finished "
            "in 2 session(s); at most 2 GPU session(s) at once, none refused at the cap") in result.output
    assert "a crash injected at step 1 (fault raise_at_step=1)" in result.output
    assert not (Path(os.environ["KCHAIN_HOME"]) / QUEUE_FILE).exists()  # the rehearsal's queue is its own
    wrong = invoke("queue", path, "--seeds", "1,2,3", "--steps", "12", "--rehearse", "--crash", "r9")
    assert wrong.exit_code != 0 and "--crash r9: the plan's runs are r1, r2, r3; name one of them" in error_line(wrong)


def test_a_queue_killed_on_the_laptop_goes_on_where_it_was(tmp_path, emulator):
    """The queue's process dies (SIGKILL) in the middle of run 2's push (Kaggle started the session, the record
    still says pushing: the answer not yet heard); `kchain queue` again settles that push from the kernel's versions and takes both runs
    up from queue.json and the ledger, pushing nothing twice."""
    path = _job(tmp_path, weekly_h=30)
    assert invoke("smoke", path).exit_code == 0
    args = ["queue", str(path), "--seeds", "1,3", "--steps", "12", "--skip-smoke", "--poll", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "kchain.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        deadline, ledger = time.monotonic() + 300, Ledger(Path(os.environ["KCHAIN_HOME"]))
        while not ([s for s in ledger.sessions("q-main-2") if s["status"] == SessionState.PUSHING]
                   and [s for s in emulator.sessions() if s["kernel"] == "alice/q-main-2"]):
            assert proc.poll() is None and time.monotonic() < deadline, "the queue ended before run 2's push"
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "queue: going on with" in result.output
    queue = json.loads((Path(os.environ["KCHAIN_HOME"]) / QUEUE_FILE).read_text())
    assert [r["state"] for r in queue["runs"]] == ["finished", "finished"], [r["said"] for r in queue["runs"]]
    ours = [s for s in emulator.sessions() if s["kernel"].startswith("alice/q-main-")]
    assert sorted(s["kernel"] for s in ours) == ["alice/q-main-1", "alice/q-main-2"]  # one session each, once


def test_every_run_is_smoked_before_any_push_and_a_run_that_fails_its_smoke_stops_the_queue(tmp_path, emulator):
    path = _job(tmp_path, weekly_h=30)
    assert invoke("smoke", path).exit_code == 0
    result = invoke("queue", path, "--seeds", "1,2", "--steps", "12", "--poll", "1")
    assert result.exit_code != 0
    assert "queue: smoke of r1 (q-main-1) before any push" in result.output  # its own code and params: it passes
    assert error_line(result).startswith("Error: r2 (q-main-2): smoke failed")
    assert "ValueError: boom in the seed 2 run" in error_line(result) and "nothing was pushed" in error_line(result)
    assert emulator.sessions() == []


def test_a_push_whose_answer_is_lost_is_taken_up_not_pushed_again_nor_stopped(tmp_path, emulator):
    """Kaggle starts run 1's session but its answer is lost (a 500 after acting): the queue's next look
    settles it from the kernel's versions and runs it as the run's session 1."""
    path = _job(tmp_path, weekly_h=30)
    assert invoke("smoke", path).exit_code == 0
    emulator.faults.reset_after_acting = 2  # the state dataset's creation and the push act, then no answer
    result = invoke("queue", path, "--seeds", "1,3", "--steps", "12", "--skip-smoke", "--poll", "1")
    assert result.exit_code == 0, result.output
    queue = json.loads((Path(os.environ["KCHAIN_HOME"]) / QUEUE_FILE).read_text())
    assert [r["state"] for r in queue["runs"]] == ["finished", "finished"], [r["said"] for r in queue["runs"]]
    ours = [s for s in emulator.sessions() if s["kernel"].startswith("alice/q-main-")]
    assert sorted(s["kernel"] for s in ours) == ["alice/q-main-1", "alice/q-main-2"]  # one session each
