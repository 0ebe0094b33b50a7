"""Session chaining through the real kaggle client and the local Kaggle.

Sessions are real notebook processes; kills are real SIGKILLs of their process trees. The runtime's
`stall_step` fault caps the training speed, so a chain needs several sessions on any machine.
"""

# ruff: noqa: F811
import json
import secrets
from pathlib import Path

from emulator_helpers import emulator  # noqa: F401  (fixture)
from helpers import copy_job, error_line, invoke

from kchain.emulator import Faults
from kchain.ledger import Ledger
from kchain.rehearse import rehearse
from kchain.runtime import layout

STALL = "stall_step=0.05"  # at most 20 steps/s, whatever the machine


def no_overlap(sessions: list[dict]) -> bool:
    ran = sorted((s["started"], s["ended"]) for s in sessions if s.get("started"))
    return all(later[0] >= earlier[1] for earlier, later in zip(ran, ran[1:], strict=False))


def test_a_chain_with_a_kill_deadlines_and_flaky_api_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    job = copy_job("tinygpt", tmp_path, params={"steps": 480, "eval_every": 120, "batch": 8, "accumulate": 1})
    faults = Faults(rate_429=0.1, rate_500=0.1, processing_s=2.0, seed=5)
    result = rehearse(job, session_limit_s=12, kills=1, seed=2, faults=faults, echo=lambda _: None)

    assert result.identical, result.verdict
    chain = result.sessions
    assert len(chain) >= 4
    ended_as = [(s.get("summary") or {}).get("status") for s in chain]
    assert "deadline" in ended_as and ended_as[-1] == "finished"
    killed = [s for s in result.emulator_sessions if "killed" in (s.get("failure_message") or "").lower()]
    assert killed, [s.get("failure_message") for s in result.emulator_sessions]
    # No two sessions ran at once.
    assert no_overlap(result.emulator_sessions)
    # Every session after the first was pushed only once its pinned state version was ready.
    ready_at = {v["number"]: v["ready_at"] for v in result.dataset_versions}
    for session in result.emulator_sessions[1:]:
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


def test_the_kernel_publishes_its_own_state_when_it_has_internet_and_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    job = copy_job("tinygpt", tmp_path, params={"steps": 100, "eval_every": 50, "batch": 8, "accumulate": 1})
    key = secrets.token_hex(16)
    result = rehearse(job, session_limit_s=12, kills=0, seed=1, internet=True, echo=lambda _: None, key=key)
    assert result.identical, result.verdict
    # The credential reached the kernel through Secrets and was never written anywhere.
    for path in result.work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert key.encode() not in path.read_bytes(), path
    assert len(result.sessions) >= 2
    first = result.sessions[0]
    assert first["summary"]["published"] == "kernel"
    assert first["publish"]["published"] == "kernel"
    assert first["publish"]["uploaded_bytes"] > 0
    # The state version holds the kernel's checkpoint: the next session resumed from it.
    assert result.sessions[1]["resumes_at"] == first["summary"]["published_step"] > 0
    # The finished chain is one line of the run log, naming the final weights.
    last_run = Ledger(result.work / "ledger").runs()[-1]
    assert last_run["note"] == f"finished after {len(result.sessions)} session(s)"
    assert last_run["steps"] == "100" and "checkpoints/step-00000100" in last_run["checkpoint"]
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
    path = crashing_job(tmp_path)
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1, timeout=120)

    first = invoke("continue", path)
    assert first.exit_code == 8
    assert error_line(first) == (
        "Error: session 1 crashed: ValueError: boom at step 25; fix the code and run "
        f"`kchain smoke {path}`, or pass --retry to run it again as it is"
    )
    again = invoke("continue", path, "--retry", "--skip-smoke")
    assert again.exit_code == 0, again.output
    emulator.wait_session(ref, 2, timeout=120)
    refused = invoke("continue", path, "--retry", "--skip-smoke")
    assert refused.exit_code == 8
    assert error_line(refused) == (
        f"Error: the same error as session 1: ValueError: boom at step 25; fix the code, run `kchain smoke {path}`"
    )
    status = invoke("status", path)
    assert "ValueError: boom at step 25" in status.output


def test_a_session_whose_output_was_lost_resumes_from_the_last_good_state(tmp_path, emulator):
    path = copy_job(
        "tinygpt", tmp_path,
        params={"steps": 10**6, "eval_every": 500, "batch": 8, "accumulate": 1},
        train={"session_limit": "9s", "margin": "2s", "checkpoint_every": "2s", "heartbeat": "0s"},
    )
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1, timeout=60)
    emulator.faults.lose_output = True
    emulator.faults.kill_after_s = 6
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    emulator.wait_session(ref, 2, timeout=60)
    emulator.faults.lose_output = False
    emulator.faults.kill_after_s = None

    third = invoke("continue", path, "--skip-smoke")
    assert third.exit_code == 0, third.output
    ledger = Ledger(Path(__import__("os").environ["KCHAIN_HOME"]))
    chain = ledger.sessions("tinygpt-notes")
    published = chain[0]["publish"]["step"]
    assert published > 0
    assert chain[1]["publish"]["published"] is None
    assert chain[1]["publish"]["steps_lost"] > 0
    assert chain[2]["resumes_at"] == published
    assert f"session 2 left no checkpoint: resuming from step {published}" in third.output
    assert f"{chain[1]['publish']['steps_lost']} steps lost" in third.output


def test_continue_never_starts_a_second_session_while_one_runs(tmp_path, emulator):
    path = copy_job("tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1},
                    train={"session_limit": "20s", "margin": "3s"})
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    result = invoke("continue", path, "--skip-smoke")
    assert result.exit_code == 0
    assert "session 1 is" in result.output and "pushed" not in result.output
    assert len(emulator.sessions()) == 1
    emulator.wait_session("alice/tinygpt-notes", 1, timeout=60)
    summary = json.loads(next(Path(emulator.session_output_dir(emulator.sessions()[0]["id"])).rglob(
        layout.SUMMARY)).read_text())
    assert summary["status"] == "deadline"


def test_continue_refuses_a_session_the_budget_cannot_cover_and_publishes_only_once(tmp_path, emulator):
    path = copy_job(
        "tinygpt", tmp_path, params={"steps": 10**6, "batch": 8, "accumulate": 1},
        train={"session_limit": "9s", "margin": "2s", "checkpoint_every": "2s"},
        budget={"weekly_gpu_hours": 0.002},  # 7.2 s: session 1 spends it
    )
    ref = "alice/tinygpt-notes"
    assert invoke("push", path, "--skip-smoke", "--force").exit_code == 0
    emulator.wait_session(ref, 1, timeout=60)
    refused = invoke("continue", path, "--skip-smoke")
    assert refused.exit_code == 5, refused.output
    assert "are left this week (budget.weekly_gpu_hours 0.002)" in error_line(refused)
    versions = emulator.dataset_versions("alice/tinygpt-notes-state")
    assert len(versions) == 2  # the marker, then session 1's state
    forced = invoke("continue", path, "--skip-smoke", "--force")
    assert forced.exit_code == 0, forced.output
    assert len(emulator.dataset_versions("alice/tinygpt-notes-state")) == 2
    assert emulator.session(ref, 2)["dataset_sources"][0] == "alice/tinygpt-notes-state/2"
