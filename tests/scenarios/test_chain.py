"""Session chaining through the real kaggle client and the local Kaggle.

Sessions are real notebook processes; kills are real SIGKILLs of their process trees. The runtime's
`stall_step` fault caps the training speed, and its `deadline_after_steps` fault is the sessions'
clock in the rehearsals here: a session reaches its deadline after that many steps, whatever the
machine's speed at the moment, so the session limit only has to be generous (never raced).
"""

# ruff: noqa: F811
import json
import os
import secrets
import threading
import time
from pathlib import Path

import pytest
from emulator_helpers import PATIENCE_S, emulator  # noqa: F401  (fixture)
from helpers import GENEROUS_S, STALL, copy_job, error_line, invoke

from kchain.chain.sessions import StaleRule
from kchain.common import layout
from kchain.emulator import Faults, Switches
from kchain.local.rehearse import rehearse
from kchain.store.ledger import Ledger

ROOMY = {"session_limit": "600s", "margin": "30s"}
# Stale after 20 s without a new heartbeat (the chain's come every step), 90 s of set-up before the first.
PATIENT = StaleRule(heartbeat_s=0.0, margin_s=0.0, limit_s=600.0, quiet_s=20.0, setup_s=90.0)


def no_overlap(sessions: list[dict]) -> bool:
    ran = sorted((s["started"], s["ended"]) for s in sessions if s.get("started"))
    return all(later[0] >= earlier[1] for earlier, later in zip(ran, ran[1:], strict=False))


@pytest.mark.slow
def test_a_chain_with_a_kill_deadlines_and_flaky_api_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    # Every strict switch at once (the emulator's defaults: 403 for missing, lagging and processing
    # versions, ignored version pins, output lost at the limit, queue and boot time, no GPU figures in
    # the quota) and a flaky API: 25% of calls answered 429 or 500, 10% of creating calls act and lose
    # their answer, 10% act and reset the connection, and the first one surely (the client's own retry must
    # not send them again),
    # every 4th upload dropped, and the killed session's output lost; two GPU sessions at most per account
    # (the emulator's default cap; the chain's sessions are GPU sessions); Kaggle releases a new image with
    # every push (the chain must stay on session 1's); each new state version is mounted seconds after it
    # is ready (mount_lag_s); the 4th session's notebook runner crashes after its first step and the session
    # stays RUNNING (crashed_runner): the watch judges it stale and deletes the kernel once the state is
    # safe (`continue --watch --delete-stale`). One `watch`, no rerun.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=20")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "5 steps")  # the kill comes after a save mid-session
    job = copy_job("tinygpt", tmp_path, params={"steps": 60, "eval_every": 20, "batch": 8, "accumulate": 1},
                   train={"heartbeat": "0s"})  # a heartbeat every step: the stale rule below is seconds
    faults = Faults(rate_429=0.15, rate_500=0.10, rate_lost_answer=0.1, drop_upload_every=4, processing_s=2.0,
                    lose_output=True, rate_reset_after_acting=0.1, reset_after_acting=1, seed=5,
                    crash_runner_on_output="[kchain] step ", crash_runner_in=4)
    switches = Switches(new_image_every=1, mount_lag_s=3.0)
    result = rehearse(job, sessions=None, session_limit_s=GENEROUS_S,
                      kills=1, seed=2, faults=faults, echo=lambda _: None, ranks=1,
                      switches=switches, stale=PATIENT)

    assert result.passed, result.verdict
    wedged = [s for s in result.emulator_sessions if s.get("runner_crashed")]
    assert len(wedged) == 1 and wedged[0]["status"] == "CANCEL_ACKNOWLEDGED", wedged  # ended by the delete
    assert faults.resets >= 1 and all(s["gpu"] for s in result.emulator_sessions)  # both were in play
    # Every session ran on session 1's image, the one its record names, though newer ones came out.
    assert len({s["image"] for s in result.emulator_sessions}) == 1
    assert result.sessions[0]["image"] == result.emulator_sessions[0]["image"]
    chain = result.sessions
    assert len(chain) >= 4
    ended_as = [(s.get("summary") or {}).get("status") for s in chain]
    assert "deadline" in ended_as and ended_as[-1] == "finished"
    killed = [s for s in result.emulator_sessions if "killed" in (s.get("failure_message") or "").lower()]
    assert [s["version"] for s in killed] == result.killed and len(killed) == 1, result.emulator_sessions
    # No two sessions ran at once, and every session Kaggle ran is one of the chain's (no double push).
    assert no_overlap(result.emulator_sessions)
    # (Versions count again from 1 once the stale session's kernel is deleted: pair them in push order.)
    ran = sorted(result.emulator_sessions, key=lambda s: s["queued"])
    assert [s["version"] for s in ran] == [r["version"] for r in chain]
    # No state was uploaded twice: each step is in one state version only.
    published = [v["notes"] for v in result.dataset_versions if "step" in (v.get("notes") or "")]
    assert len(published) == len({n.rsplit("step", 1)[1] for n in published}), published
    # No session trained from a state other than the one it was pushed for.
    for session, record in zip(ran, chain, strict=True):
        if session.get("resumed_from") is not None:
            assert session["resumed_from"] == record.get("resumes_at", 0), session
    # Every session after the first was pushed only once its pinned state version was ready.
    ready_at = {v["number"]: v["ready_at"] for v in result.dataset_versions}
    for session in ran[1:]:
        pinned = [src for src in session["dataset_sources"] if src.endswith("-state/" + src.rsplit("/", 1)[-1])]
        assert pinned, session["dataset_sources"]
        assert ready_at[int(pinned[0].rsplit("/", 1)[-1])] <= session["queued"]
    # The laptop relayed the state (internet off) and uploaded about a checkpoint's worth each time.
    for record in chain[:-1]:
        publish = record["publish"]
        if publish["published"] == "relay":
            expected = publish["checkpoint_bytes"] + publish["cache_bytes"]
            assert expected <= publish["uploaded_bytes"] <= 1.05 * expected
    assert {r["publish"]["published"] for r in chain[:-1]} <= {"relay", None}
    assert any(r["publish"]["published"] == "relay" for r in chain[:-1])


@pytest.mark.slow
def test_the_kernel_publishes_its_own_state_when_it_has_internet_and_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=25")
    job = copy_job("tinygpt", tmp_path, params={"steps": 50, "eval_every": 25, "batch": 8, "accumulate": 1})
    key = secrets.token_hex(16)
    lines: list[str] = []
    result = rehearse(job, sessions=None, session_limit_s=GENEROUS_S,
                      kills=0, seed=1, internet=True, echo=lines.append, key=key,
                      ranks=1)
    assert result.passed, result.verdict
    assert result.work is not None
    # The credential reached the kernel through Secrets and was never written anywhere.
    for path in result.work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert key.encode() not in path.read_bytes(), path
    assert len(result.sessions) >= 2
    first = result.sessions[0]
    # The first heartbeat came with the plan: when to stop, and the time kept for save + publish.
    log = session_log(Ledger(result.work / "ledger"), first["kernel"].split("/")[1], 1)
    assert "[kchain] plan: stopping at " in log and "for save + publish of" in log
    assert first["summary"] is not None
    assert first["summary"]["published"] == "kernel"
    assert first["publish"]["published"] == "kernel"
    assert first["publish"]["uploaded_bytes"] > 0
    # The state version holds the kernel's checkpoint: the next session resumed from it.
    assert result.sessions[1]["resumes_at"] == first["summary"]["published_step"] > 0
    # The finished chain is one line of the run log, naming the state version its final weights are in.
    last_run = Ledger(result.work / "ledger").runs()[-1]
    assert last_run["note"] == f"finished after {len(result.sessions)} session(s)"
    assert last_run["steps"] == "50" and last_run["checkpoint"].endswith(
        f"-state/{result.sessions[-1]['publish']['version']}") and result.sessions[-1]["publish"]["step"] == 50
    assert float(last_run["val"]) > 0


def crashing_job(tmp_path: Path) -> Path:
    path = copy_job("tinygpt", tmp_path, params={"steps": 60, "eval_every": 30, "batch": 8, "accumulate": 1})
    code = path.parent / "train.py"
    code.write_text(code.read_text().replace(
        "        trainer.step()\n",
        "        trainer.step()\n        if step == 25:\n            raise ValueError('boom at step 25')\n",
    ))
    return path


def test_the_same_crash_twice_is_refused(tmp_path, emulator):
    emulator.session_limit_s = GENEROUS_S
    path = crashing_job(tmp_path)
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)

    first = invoke("continue", path)
    assert first.exit_code == 8
    assert error_line(first) == (
        "Error: session 1 crashed: ValueError: boom at step 25; fix the code and run "
        f"`kchain smoke {path}`, or pass --retry to run it again as it is"
    )
    # A watch stops there too, and its --notify command hears that the chain needs a person.
    events = tmp_path / "events.txt"
    watched = invoke("continue", path, "--watch", "--notify", f'echo "$KCHAIN_EVENT $KCHAIN_SESSION" >> {events}')
    assert watched.exit_code == 8 and error_line(watched) == error_line(first)
    assert events.read_text() == "needs_person 1\n"
    again = invoke("continue", path, "--retry", "--skip-smoke")
    assert again.exit_code == 0, again.output
    emulator.wait_session(ref, 2)
    refused = invoke("continue", path, "--retry", "--skip-smoke")
    assert refused.exit_code == 8
    assert error_line(refused) == (
        f"Error: the same error as session 1: ValueError: boom at step 25; fix the code, run `kchain smoke {path}`"
    )
    status = invoke("status", path)
    assert "ValueError: boom at step 25" in status.output


def test_a_session_whose_output_was_lost_resumes_from_the_last_good_state(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    emulator.session_limit_s = GENEROUS_S
    path = copy_job(
        "tinygpt", tmp_path,
        params={"steps": 10**6, "eval_every": 500, "batch": 8, "accumulate": 1},
        train={**ROOMY, "heartbeat": "0s"},
    )
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    emulator.faults.lose_output = True
    emulator.faults.kill_on_output = "[kchain] step "  # killed once it trained a step, whatever the speed
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    emulator.wait_session(ref, 2)
    emulator.faults.lose_output = False
    emulator.faults.kill_on_output = None

    third = invoke("continue", path, "--skip-smoke")
    assert third.exit_code == 0, third.output
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    chain = ledger.sessions("tinygpt-notes")
    published = chain[0]["publish"]["step"]
    assert published == 10
    assert chain[1]["publish"]["published"] is None
    assert chain[1]["publish"]["steps_lost"] is not None
    assert chain[1]["publish"]["steps_lost"] > 0
    assert chain[2]["resumes_at"] == published
    assert f"session 2 left no checkpoint: resuming from step {published}" in third.output
    assert f"{chain[1]['publish']['steps_lost']} steps lost" in third.output
    emulator.wait_session(ref, 3)


def test_continue_never_starts_a_second_session_while_one_runs(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=30")
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1}, train=ROOMY)
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    result = invoke("continue", path, "--skip-smoke")
    assert result.exit_code == 0
    assert "session 1 is" in result.output and "pushed" not in result.output
    assert len(emulator.sessions()) == 1
    emulator.wait_session("alice/tinygpt-notes", 1)
    summary = json.loads(next(Path(emulator.session_output_dir(emulator.sessions()[0]["id"])).rglob(
        layout.SUMMARY)).read_text())
    assert summary["status"] == "deadline"


def test_continue_refuses_a_session_the_budget_cannot_cover_and_publishes_only_once(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=5")
    emulator.session_limit_s = 2 * 3600
    path = copy_job(
        "tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1},
        train={"session_limit": "1h", "checkpoint_every": "2s"},
        budget={"weekly_gpu_hours": 1},  # exactly one session: whatever session 1 spent, the next does not fit
    )
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    refused = invoke("continue", path, "--skip-smoke")
    assert refused.exit_code == 5, refused.output
    assert "are left this week (budget.weekly_gpu_hours 1)" in error_line(refused)
    versions = emulator.dataset_versions("alice/tinygpt-notes-state")
    assert len(versions) == 2  # the marker, then session 1's state
    forced = invoke("continue", path, "--skip-smoke", "--force")
    assert forced.exit_code == 0, forced.output
    assert len(emulator.dataset_versions("alice/tinygpt-notes-state")) == 2
    assert emulator.session(ref, 2)["dataset_sources"][0] == "alice/tinygpt-notes-state/2"
    emulator.wait_session(ref, 2)


def session_log(ledger: Ledger, job: str, session: int) -> str:
    entries = json.loads((ledger.root / "sessions" / job / str(session) / "log.json").read_text())
    return "".join(e["data"] for e in entries)


def test_a_publish_that_cannot_fit_the_session_is_left_to_the_relay(tmp_path, emulator, monkeypatch):
    # A publish measured at an hour cannot fit a 10-minute session: the kernel plans without it, says
    # `published: none`, and `continue` relays the state from the laptop.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=20")
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1},
                    kaggle={"internet": True}, train=ROOMY)
    Ledger(Path(os.environ["KCHAIN_HOME"])).save_publish_figures(
        "tinygpt-notes", {"start_s": 3600.0, "create_s": 10.0, "rate_bps": 1e6, "processing_s": 10.0})
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    first = ledger.sessions("tinygpt-notes")[0]
    log = session_log(ledger, "tinygpt-notes", 1)
    assert "[kchain] plan: the publish of" in log and "more than half this session" in log
    assert "[kchain] published: none (" in log
    assert first["summary"] is not None
    assert first["summary"]["published"] is None and first["publish"]["published"] == "relay"
    assert f"publishing step {first['summary']['step']} to {ref}-state from the laptop" in second.output


def test_stop_names_the_page_waits_for_the_stop_and_continue_resumes(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1}, train=ROOMY)
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    assert invoke("continue", path, "--skip-smoke").exit_code == 0  # session 2, from step 10
    monkeypatch.setenv(layout.FAULT_ENV, STALL)  # session 2 would train until its limit

    def user_stops_it_in_the_web_ui() -> None:
        deadline = time.time() + PATIENCE_S
        while emulator.session(ref, 2)["status"] != "RUNNING" and time.time() < deadline:
            time.sleep(0.1)
        emulator.cancel(ref, 2)

    threading.Thread(target=user_stops_it_in_the_web_ui, daemon=True).start()
    stopped = invoke("stop", path, "--poll", "0.5")
    assert stopped.exit_code == 0, stopped.output
    assert ("session 2 is queued: Kaggle's API cannot stop a session (it does not expose the session id), so "
            "stop it on its page: ") in stopped.output or "session 2 is running: Kaggle's API" in stopped.output
    assert "session 2 ended (CANCEL_ACKNOWLEDGED); `kchain continue" in stopped.output
    record = Ledger(Path(os.environ["KCHAIN_HOME"])).sessions("tinygpt-notes")[1]
    assert record["stopped_by_user"] and record["status"] == "CANCEL_ACKNOWLEDGED"
    third = invoke("continue", path, "--skip-smoke")
    assert third.exit_code == 0, third.output
    assert "resuming at step 10" in third.output


def test_an_early_stop_ends_the_chain_and_a_session_without_a_gpu_needs_retry(tmp_path, emulator):
    """A loop left on purpose is the user's decision: continue pushes nothing more. A session that got
    no GPU would get none again: continue waits for --retry."""
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path / "stop", params={"steps": 60, "eval_every": 30, "batch": 8, "accumulate": 1})
    code = path.parent / "train.py"
    code.write_text(code.read_text().replace(
        "        trainer.step()\n", "        trainer.step()\n        if step == 25:\n            break\n"))
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    done = invoke("continue", path, "--skip-smoke")
    assert done.exit_code == 0, done.output
    assert "training stopped early on purpose at step 25/60" in done.output
    assert len([s for s in emulator.sessions() if s["kernel"] == ref]) == 1

    other = copy_job("classifier", tmp_path / "gpu", params={"steps": 6, "rows": 2000, "eval_every": 3})
    emulator.faults.no_gpu = True
    assert invoke("push", other, "--skip-smoke").exit_code == 0
    emulator.wait_session("alice/blobs-classifier", 1)
    refused = invoke("continue", other, "--skip-smoke")
    assert refused.exit_code == 8, refused.output
    assert error_line(refused).startswith("Error: session 1 got no accelerator: asked for GPU T4 x2")
    assert error_line(refused).endswith("then pass --retry to push again")
