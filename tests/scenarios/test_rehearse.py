# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain rehearse` verdicts that must prove something, its kills, its ranks, and chains that stop
advancing (issue 20, items 4 and 5), on the loop shapes of tests/runtime_jobs/chain_job.py.

Sessions are real notebook processes against the local Kaggle; kills are real SIGKILLs. The runtime's
`stall_step` fault caps the speed of a `run.steps` loop and `deadline_after_steps` is its session
clock, so nothing here races the machine; the explicit-save loop caps its own speed.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from emulator_helpers import USER, emulator  # noqa: F401  (fixture)
from helpers import GENEROUS_S, REPO, STALL, copy_job, error_line, invoke

from kchain.chain.advance import watch
from kchain.common import layout
from kchain.common.nextsession import saved_step
from kchain.common.summary import Summary
from kchain.emulator import Faults
from kchain.emulator.sessions import CHECKPOINT_KILL
from kchain.emulator.switches import Switches
from kchain.errors import ChainStop
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.local.rehearse import rehearse, shortcomings
from kchain.store.ledger import Ledger


def chain_job(tmp_path: Path, shape: str, **params) -> Path:
    """tests/runtime_jobs/chain_job.py as a job of its own, in the given loop shape (GPU, gpus: auto)."""
    folder = tmp_path / shape
    folder.mkdir()
    shutil.copy(REPO / "tests" / "runtime_jobs" / "chain_job.py", folder / "train.py")
    spec = {"name": f"chain-{shape.replace('_', '-')}", "code": "train.py",
            "params": {"shape": shape, "seed": 3, **params}, "kaggle": {"accelerator": "gpu"}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder / "job.yaml"


def test_a_chain_that_never_resumed_proves_nothing_and_fails(tmp_path, monkeypatch):
    # One planned session holds the whole run: nothing is killed or resumed, so identical traces prove nothing.
    path = chain_job(tmp_path, "steps", steps=6)
    result = invoke("rehearse", path, "--sessions", 1, "--ranks", 1)
    assert result.exit_code == 1, result.output
    assert error_line(result) == (
        "Error: rehearsal: the chained run proves nothing about resuming: the chain finished in 1 session and no "
        "session resumed from a saved state; plan more sessions (--sessions N; with --by-time, a lower "
        "--session-limit) or raise the steps (--set steps=N) so the chain needs several sessions"
    )
    assert "1 rank per session and in the uninterrupted run (--ranks 1; on Kaggle the job gets 2)" in result.output
    assert "verdict: proves nothing about resuming" in result.output


@pytest.mark.slow
def test_an_explicit_save_loop_is_killed_exactly_as_often_as_asked(tmp_path):
    # run.restore()/run.save(step) and no heartbeat: the kill follows a checkpoint, not a log line. The
    # loop never asks run.should_stop, so no plan can stop it: a session ends at its limit (sessions by
    # time; output kept: --lenient); at 4 steps/s at most, session 1 cannot train 480 steps in a 90-second
    # session. (90 s, not 30: a start-up on a loaded machine took 30 s, and no session saved a step; a
    # start-up of up to a minute still leaves session 1 steps to save.)
    path = chain_job(tmp_path, "explicit", steps=480, save_every=5, sleep_s=0.25)
    result = rehearse(path, sessions=None, session_limit_s=90, kills=1, ranks=1, switches=Switches.lenient(),
                      echo=lambda _: None)
    assert result.passed, result.verdict
    assert result.verdict.startswith("identical: ")
    killed = [s for s in result.emulator_sessions if s["failure_message"].startswith(CHECKPOINT_KILL)]
    assert [s["version"] for s in killed] == result.killed == [2], result.emulator_sessions
    assert result.sessions[-1]["summary"] is not None
    assert result.sessions[-1]["summary"]["status"] == "finished"
    assert result.sessions[-1]["summary"]["step"] == 480


def test_fewer_kills_than_asked_are_named_and_fail(tmp_path, monkeypatch):
    # Two sessions of run.steps (a deadline after 20 steps, 30 asked), no cadence save: the session
    # after the first saves only its last step, so at most one kill can land, not the three asked.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=20")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "1000 steps")
    path = chain_job(tmp_path, "steps", steps=30)
    result = rehearse(path, sessions=None, session_limit_s=GENEROUS_S, kills=3, ranks=1, echo=lambda _: None)
    assert result.identical and not result.passed
    n = len(result.killed)
    assert n <= 1
    assert result.verdict == (
        f"had {n} of the 3 kills asked (--kills 3): the chain finished in session {len(result.sessions)} before "
        f"{'another' if n else 'a'} session saved a checkpoint past its resume to be killed after; plan more sessions "
        "(--sessions N; with --by-time, a lower --session-limit) or raise the steps (--set steps=N) so the chain "
        "needs more sessions, or ask fewer --kills"
    )


@pytest.mark.slow
def test_two_ranks_as_on_kaggle_in_the_sessions_and_the_reference(tmp_path, monkeypatch):
    # train.gpus: auto on a GPU job is 2 ranks on Kaggle: every session and the uninterrupted run
    # train with 2 gloo ranks here, and the push line says so truly.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=8")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "4 steps")
    path = chain_job(tmp_path, "steps", steps=16)  # 0 -> 8 (deadline), 8 -> 12 (killed after its save), 12 -> 16
    lines: list[str] = []
    result = rehearse(path, sessions=None, session_limit_s=GENEROUS_S, kills=1, echo=lines.append)
    assert result.passed, result.verdict
    assert result.ranks == 2 and len(result.killed) == 1
    assert "2 ranks per session and in the uninterrupted run, as on Kaggle" in lines[0]
    assert any("GPU T4 x2, 2 ranks" in line for line in lines)
    assert result.work is not None
    assert "[kchain] launching 2 ranks (" in (result.work / "reference.log").read_text()
    waits = [line[11:] for line in lines if re.match(r"\[\d\d:\d\d:\d\d\] ", line)]
    assert waits and all(a != b for a, b in zip(waits, waits[1:], strict=False)), waits  # said once, not at every poll
    ledger = Ledger(result.work / "ledger")
    for record in result.sessions:
        log = (ledger.root / "sessions" / record["kernel"].split("/")[1] / str(record["session"]) / "log.json")
        assert "launching 2 ranks (" in log.read_text(), record["session"]


def test_a_loop_that_trains_fewer_steps_than_it_asks_for_fails(tmp_path):
    # Every other epoch trains nothing (a Lightning Trainer.fit over run.loader did this): 4 epochs of
    # 8 batches ask for 32 steps, 16 are trained; the chain and the uninterrupted run agree.
    path = chain_job(tmp_path, "skipped_epochs", epochs=4)
    result = rehearse(path, sessions=None, session_limit_s=GENEROUS_S, kills=0, ranks=1, echo=lambda _: None)
    assert result.identical and not result.passed
    assert result.verdict == (
        "trained 16 of the 32 steps asked (its last session ended finished at step 16/32), and on Kaggle it would "
        "train as few: a loop that skips batches (an epoch left empty, a loader that ends early) trains less than "
        "its run.steps or run.epochs total; make it train every step it asks for"
    )


def record(n: int, resumes_at: int, step: int | None = None, total: int | None = 40, status: str = "deadline") -> dict:
    summary = {"status": status, "step": step, "total": total} if step is not None else None
    return {"session": n, "resumes_at": resumes_at, "summary": summary}


@pytest.mark.parametrize(("chain", "alone", "killed", "kills", "says"), [
    ([record(1, 0, 20), record(2, 20, 40, status="finished")], 40, [], 0, []),
    ([record(1, 0, 20), record(2, 20, 38, status="finished")], 40, [], 0,
     ["trained 38 of the 40 steps asked", "trained 38 steps, the uninterrupted run 40: resuming changed"]),
    ([record(1, 0, 20), record(2, 20, 30, total=None, status="finished")], 31, [], 0,
     ["trained 30 steps, the uninterrupted run 31"]),
    ([record(1, 0, 20), record(2, 20, 25, status="stopped")], 25, [], 0, []),  # an early stop on purpose
    ([record(1, 0, 40, status="finished")], 40, [], 0, ["proves nothing about resuming: the chain finished in 1 "]),
    ([record(1, 0, 20), record(2, 20), record(3, 25, 40, status="finished")], 40, [2], 2,
     ["had 1 of the 2 kills asked (--kills 2): the chain finished in session 3 before another session"]),
], ids=["a pass", "short of the total", "another count than the reference", "stopped on purpose", "one session",
        "a kill short"])
def test_the_verdict_fails_what_proves_nothing(chain, alone, killed, kills, says):
    problems = shortcomings(True, None, Summary(step=alone), chain, killed, kills, None)
    assert len(problems) == len(says) and all(p.startswith(s) for p, s in zip(problems, says, strict=True)), problems


def explicit_job_killed_before_its_first_save(tmp_path: Path, emu) -> Path:
    """Every session is killed after 3 steps, before its first save at step 5, and loses its output."""
    emu.session_limit_s = GENEROUS_S
    emu.faults.kill_on_output, emu.faults.lose_output = "[job] trained step 3", True
    return chain_job(tmp_path, "explicit", steps=10**6, save_every=5)


def test_continue_stops_a_chain_whose_sessions_save_nothing(tmp_path, emulator):
    path = explicit_job_killed_before_its_first_save(tmp_path, emulator)
    ref = f"{USER}/chain-explicit"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(ref, 1)
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    # No heartbeat and no summary say how far session 1 got: never "0 steps lost".
    assert ("session 1 left no checkpoint: resuming from step 0 (state version 1); an unknown number of steps "
            "lost (no summary or heartbeat says how far it got)") in second.output
    assert "0 steps lost" not in second.output
    emulator.wait_session(ref, 2)
    stopped = invoke("continue", path, "--skip-smoke")
    assert stopped.exit_code == 8, stopped.output
    assert error_line(stopped) == (
        "Error: no progress: sessions 1 and 2 both ended without saving a step past 0 (session 2: Session was "
        "killed (fault injection on output '[job] trained step 3')), and the next would lose its work the same "
        "way: raise train.session_limit or train.margin so a session saves before it is stopped, or save more "
        f"often (train.checkpoint_every), then run `kchain continue {path}`, or pass --retry to push one more "
        "session as it is"
    )
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    assert [saved_step(s) for s in ledger.sessions("chain-explicit")] == [None, None]
    # The watch stops on the same decision instead of pushing session after session.
    with pytest.raises(ChainStop, match="^no progress: sessions 1 and 2"):
        watch(load_job(path), ledger, KaggleClient(), skip_smoke=True, echo=lambda _: None, poll_s=0.2)
    assert len(emulator.sessions()) == 2


def test_a_rehearsal_stops_when_sessions_save_nothing(tmp_path):
    path = chain_job(tmp_path, "explicit", steps=40, save_every=5)
    faults = Faults(kill_on_output="[job] trained step 3", lose_output=True)
    # Only if the chain is never stopped: the kills end after a while, so the test fails, never hangs.
    safety = threading.Timer(300, lambda: setattr(faults, "kill_on_output", None))
    safety.start()
    lines: list[str] = []
    try:
        result = rehearse(path, sessions=None, session_limit_s=GENEROUS_S,
                          kills=0, ranks=1, faults=faults, echo=lines.append)
    finally:
        safety.cancel()
    assert not result.passed and len(result.sessions) == 2
    assert result.verdict.startswith("stopped: no progress: sessions 1 and 2 both ended without saving a step past 0")
    # The fix is said in rehearse's own flags, not the job's train.session_limit or `kchain continue`.
    assert result.verdict.endswith(", and the next would lose its work the same way: raise --session-limit (now "
                                   "600s) so a session trains and saves before its limit, or leave out --by-time "
                                   "to plan the sessions in steps"), result.verdict
    assert not any("0 steps lost" in line for line in lines)


@pytest.mark.slow
def test_a_lora_fine_tune_chains_identically_through_a_kill_and_a_deadline(tmp_path, monkeypatch):
    # jobs/finetune as it is (transformers + peft, a frozen base from a folder, offline): every session
    # restores the adapters onto a base it rebuilds and fingerprints, and the chain matches the
    # uninterrupted run bit for bit.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=4")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "3 steps")
    path = copy_job("finetune", tmp_path, params={"steps": 9, "n_notes": 400, "eval_every": 4})
    result = rehearse(path, sessions=None, session_limit_s=GENEROUS_S, kills=1, echo=lambda _: None)
    assert result.passed, result.verdict
    assert len(result.killed) == 1 and len(result.sessions) >= 3
    ends = [s.get("end_status") for s in result.sessions]
    assert "deadline" in ends and ends[-1] == "finished", ends


def test_sessions_planned_in_steps_give_the_same_chain_at_any_speed(tmp_path):
    # No speed cap and no test clock: the rehearsal's own plan (the 30 steps in 3 spans) stops session 1 at
    # step 10, kills session 2 right after its mid-span checkpoint of step 15, and stops session 3 at 20:
    # the same sessions, resumes and kill on any machine, loaded or not.
    path = chain_job(tmp_path, "steps", steps=30)
    result = rehearse(path, kills=1, ranks=1, echo=lambda _: None)
    assert result.passed, result.verdict
    assert [s.get("resumes_at") or 0 for s in result.sessions] == [0, 10, 15, 20]
    assert result.killed == [2]
    ended = [(s["summary"] or {}).get("step") for s in result.emulator_sessions]
    assert ended == [10, None, 20, 30], result.emulator_sessions  # the killed session left no summary
    assert [s.get("end_status") for s in result.sessions][::2] == ["deadline", "deadline"]


@pytest.mark.slow
def test_an_unattended_rehearsal_from_the_cli_counts_what_the_laptop_did(tmp_path):
    # `rehearse --unattended`: each kernel publishes its state and pushes the next; the kill takes the training
    # process alone (the kernel lives on to push), so the laptop pushes nothing after session 1.
    path = chain_job(tmp_path, "steps", steps=20)
    result = invoke("rehearse", path, "--unattended", "--sessions", 2, "--ranks", 1)
    assert result.exit_code == 0, result.output
    assert ("unattended, from the local Kaggle's records: 0 laptop pushes after session 1, 0 overlapping sessions, "
            "0 duplicate state versions") in result.output
    assert "verdict: identical: " in result.output and "1 killed" in result.output

