# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain push`, `status` and `logs` through the CLI, the real kaggle client and the local Kaggle.

Every session here is a real notebook run by the emulator in its own process tree; a session
killed at its limit is a real SIGKILL. Jobs are the example classifier made small (a few dozen
steps, no loader workers, a heartbeat every step) so a session ends in seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
from emulator_helpers import PATIENCE_S, USER, emulator, fake_key  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.common.sessionstate import SessionState
from kchain.store.ledger import Ledger

NAME = "blobs-classifier"
REF = f"{USER}/{NAME}"
SMALL = {"steps": 40, "rows": 4000, "num_workers": 0, "eval_every": 20}


def small_job(tmp_path: Path, steps: int = 40, **overrides) -> Path:
    train = {"heartbeat": "0s", **overrides.pop("train", {})}
    return copy_job("classifier", tmp_path, params={**SMALL, "steps": steps}, train=train, **overrides)


def ledger() -> Ledger:
    return Ledger(Path(os.environ["KCHAIN_HOME"]))


def kernel_versions(emu) -> list[dict]:
    with emu.store.lock:
        return list(emu.store.kernels.get(REF, {}).get("versions", []))


def poll_status(job: Path, until: tuple[str, ...], timeout_s: float = PATIENCE_S) -> str:
    """`kchain status` until the session's row shows one of `until`; return the last table."""
    deadline = time.time() + timeout_s
    while True:
        result = invoke("status", job)
        assert result.exit_code == 0, result.output
        row = result.output.splitlines()[1].split()
        if row[2] in until:
            return result.output
        assert time.time() < deadline, f"session still {row[2]} after {timeout_s} s:\n{result.output}"
        time.sleep(0.5)


def settle(emu) -> None:
    """Let every session end before the emulator stops (stopping kills live ones mid-run)."""
    for session in emu.sessions():
        emu.wait_session(session["kernel"], session["version"])


def process_alive(session: dict) -> bool:
    try:
        return abs(psutil.Process(session["pid"]).create_time() - session["pid_created"]) < 1
    except psutil.NoSuchProcess:
        return False


def files_holding(text: str, *tops: Path) -> list[Path]:
    needle = text.encode()
    return [p for top in tops for p in top.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_push_runs_a_smoked_session_to_complete_and_writes_no_credential(emulator, tmp_path):
    job = small_job(tmp_path)
    smoked = invoke("smoke", job, "--quiet", "--ranks", "1")
    assert smoked.exit_code == 0, smoked.output

    pushed = invoke("push", job)
    assert pushed.exit_code == 0, pushed.output
    assert f"kchain push {job}: session 1 of {REF}" in pushed.output
    assert f"  pushed {REF} version 1: {emulator.url}/code/{REF}" in pushed.output  # the URL Kaggle answered
    assert "  accelerator    GPU T4 x2, 2 ranks (NvidiaTeslaT4)" in pushed.output
    kernel = emulator.store.kernels[REF]
    assert (kernel["machine_shape"], kernel["enable_gpu"], kernel["enable_internet"]) == ("NvidiaTeslaT4", True, False)
    assert emulator.session(REF, 1)["gpu"] is True
    row = ledger().runs()[-1]
    assert row["channel"] == "kaggle" and row["job"] == NAME
    assert row["note"] == f"session 1 pushed; kernel {REF} v1"

    seen = {poll_status(job, ("QUEUED", "RUNNING", "COMPLETE")).splitlines()[1].split()[2]}
    table = poll_status(job, ("COMPLETE", "ERROR"))
    seen.add(table.splitlines()[1].split()[2])
    assert seen & {"QUEUED", "RUNNING"} and "COMPLETE" in seen, table
    header, session = table.splitlines()[:2]
    assert header.split() == ["session", "version", "status", "started", "duration", "steps", "note"]
    assert session.split()[:3] == ["1", "1", "COMPLETE"] and session.split()[5] == "40/40"
    assert "[kchain] step 40/40" in session

    logs = invoke("logs", job)
    assert logs.exit_code == 0, logs.output
    beats = [line for line in logs.output.splitlines() if line.startswith("[kchain] step ")]
    assert beats[0].startswith("[kchain] step 1/40 ") and beats[-1].startswith("[kchain] step 40/40 ")
    assert logs.output.splitlines()[-1] == "[kchain] session 1 is COMPLETE"

    record = ledger().sessions(NAME)[0]
    assert record["summary"] is not None and record["output"] is not None
    assert record["status"] == "COMPLETE" and record["summary"]["status"] == "finished"
    output = Path(record["output"])
    assert (output / "kchain" / "summary.json").is_file() and (output / "log.json").is_file()
    assert json.loads((output / "kchain" / "summary.json").read_text())["step"] == 40

    # No credential anywhere kchain writes: its home, the rendered kernel, what the session saw and left.
    rendered = tmp_path / "rendered"
    assert invoke("render", job, "-o", rendered).exit_code == 0
    key = emulator.users[USER]
    sdir = emulator.store.session_dir(emulator.session(REF, 1)["id"])
    assert files_holding(key, Path(os.environ["KCHAIN_HOME"]), rendered, job.parent, sdir) == []
    assert files_holding(f"{USER}/{NAME}-state", sdir)  # the search does find what is there


def test_a_session_killed_at_its_limit_reads_as_error_with_a_hint(emulator, tmp_path):
    job = small_job(tmp_path, steps=1_000_000)
    pushed = invoke("push", job, "--skip-smoke")
    assert pushed.exit_code == 0, pushed.output
    # The limit comes once the session trained a step (whatever the machine's speed): emu.expire is
    # Kaggle's limit, with its message and its treatment of the output.
    emulator.wait_output(REF, "[kchain] step ")
    emulator.expire(REF)

    table = poll_status(job, ("COMPLETE", "ERROR"))
    message = f"Session exceeded its time limit of {emulator.session_limit_s:g} seconds and was stopped"
    assert table.splitlines()[1].split()[2] == "ERROR" and table.splitlines()[1].endswith(message), table
    assert not process_alive(emulator.session(REF))  # the session's process tree died with it

    logs = invoke("logs", job)
    assert logs.exit_code == 0, logs.output
    assert logs.output.splitlines()[-4:] == [
        "[kchain] session 1 is ERROR",
        f"[kchain] session 1 was killed: {message}",
        f"[kchain] failed: Killed: {message}",
        "[kchain] hint: the process was killed from outside (session limit, memory, or a kill): "
        "resume from the checkpoint",
    ]
    assert "[kchain] step " in logs.output  # it trained until the kill
    key = emulator.users[USER]
    assert files_holding(key, Path(os.environ["KCHAIN_HOME"]), job.parent) == []


def test_bad_credentials_get_the_one_line_fix(emulator, tmp_path, monkeypatch):
    job = small_job(tmp_path)
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 6
    assert error_line(result) == (
        "Error: Kaggle rejected the credentials (HTTP 401): check KAGGLE_USERNAME and KAGGLE_KEY (or "
        "KAGGLE_API_TOKEN, or kaggle.json), or create a new API token on kaggle.com/settings")
    assert kernel_versions(emulator) == []

    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 6
    assert error_line(result) == (
        "Error: Kaggle credentials not found: put kaggle.json in ~/.kaggle or set KAGGLE_USERNAME and "
        "KAGGLE_KEY (or KAGGLE_API_TOKEN)")


def test_push_through_30_percent_api_faults_pushes_exactly_once(emulator, tmp_path):
    job = small_job(tmp_path, steps=5)
    # This seed answers the first SaveKernel with 500 (the push's outcome is then checked, not resent blindly)
    # and the second not at all, whatever other calls came before (one RNG a kind of call), and other calls
    # with 429 and 500.
    emulator.faults.seed = 12
    emulator.faults.rate_429, emulator.faults.rate_500 = 0.15, 0.15
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 0, result.output
    assert len(kernel_versions(emulator)) == 1 and len(emulator.sessions()) == 1
    assert emulator.calls["SaveKernel"] == 2, emulator.calls
    assert [s["status"] for s in ledger().sessions(NAME)] == ["QUEUED"]
    assert ledger().runs()[-1]["note"] == (
        f"session 1 pushed (--skip-smoke: never smoke-tested); kernel {REF} v1")
    settle(emulator)


def test_a_push_over_the_weekly_budget_is_refused_unless_forced(emulator, tmp_path):
    job = small_job(tmp_path, steps=5, budget={"weekly_gpu_hours": 1}, train={"session_limit": "12h"})
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 5
    assert error_line(result) == (
        f"Error: {job}: this session may use 12.00 GPU-h but only 1.00 are left this week "
        "(budget.weekly_gpu_hours 1); wait for Saturday 00:00 UTC, lower train.session_limit, or pass --force")
    assert kernel_versions(emulator) == [] and emulator.calls["SaveKernel"] == 0

    forced = invoke("push", job, "--skip-smoke", "--force")
    assert forced.exit_code == 0, forced.output
    assert len(kernel_versions(emulator)) == 1
    settle(emulator)


def test_kaggles_own_quota_refusal_fails_loudly(emulator, tmp_path):
    emulator.gpu_quota_s = 0
    job = small_job(tmp_path)
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 7
    assert error_line(result) == (
        f"Error: Kaggle refused the push of {REF}: GPU quota exceeded: 0.00 of 0.00 hours used this week; "
        "the quota resets Saturday 00:00 UTC")
    assert kernel_versions(emulator) == []
    assert [s["status"] for s in ledger().sessions(NAME)] == ["FAILED_TO_PUSH"]


def test_a_push_without_a_smoke_pass_is_refused(emulator, tmp_path):
    job = small_job(tmp_path)
    result = invoke("push", job)
    assert result.exit_code == 4
    assert error_line(result) == (
        f"Error: this code has never passed a smoke run: run `kchain smoke {job}` first "
        "(or --skip-smoke, recorded in the run log)")
    assert emulator.calls["SaveKernel"] == 0 and ledger().sessions(NAME) == []


def test_a_lost_push_answer_makes_one_version_and_a_second_push_is_refused(emulator, tmp_path):
    job = small_job(tmp_path, steps=1_000_000)  # still running at the second push, however fast this machine
    emulator.faults.fail_after_save = 1  # Kaggle creates version 1, then the answer is a 500
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 0, result.output
    assert f"  pushed {REF} version 1: https://www.kaggle.com/code/{REF}" in result.output  # no answer: the usual URL
    assert emulator.calls["SaveKernel"] == 1 and len(kernel_versions(emulator)) == 1
    assert len(emulator.sessions()) == 1
    record = ledger().sessions(NAME)[0]
    assert (record["session"], record["status"], record["version"]) == (1, "QUEUED", 1)

    poll_status(job, ("RUNNING",))
    again = invoke("push", job, "--skip-smoke")
    assert again.exit_code == 8
    assert error_line(again) == (
        f"Error: session 1 of {NAME} is still running; watch it with `kchain status` or `kchain logs --follow`")
    assert emulator.calls["SaveKernel"] == 1 and len(kernel_versions(emulator)) == 1
    emulator.expire(REF)  # its limit comes now: the test is done with it
    settle(emulator)


def test_a_name_too_long_for_its_state_dataset_and_a_tpu_are_refused_before_any_call(emulator, tmp_path):
    long_name = "a-classifier-whose-name-is-much-too-long-for-ka"  # 47 characters: "-state" makes 53
    job = small_job(tmp_path)
    job.write_text(job.read_text().replace(f"name: {NAME}", f"name: {long_name}"))
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 10
    assert error_line(result) == (
        f"Error: {job}: name: '{long_name}' is 47 characters; use 5-44, so that <name>-state and <name>-cache "
        "fit Kaggle's 6-50 character dataset slugs")
    tpu = small_job(tmp_path / "tpu", kaggle={"accelerator": "tpu"})
    result = invoke("push", tpu, "--skip-smoke")
    assert result.exit_code == 10
    assert error_line(result) == (
        f"Error: {tpu}: kaggle.accelerator: the runtime does not support TPUs yet; use gpu or none")
    assert sum(emulator.calls.values()) == 0


def test_a_missing_dataset_source_stops_the_push_before_savekernel(emulator, tmp_path):
    job = small_job(tmp_path, kaggle={"datasets": [f"{USER}/no-such-data"]})
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 8, result.output
    assert error_line(result) == (
        f"Error: {job}: kaggle.datasets: dataset {USER}/no-such-data does not exist on Kaggle or is not visible "
        "to you; fix the name, or make it visible to your account")
    assert emulator.calls["SaveKernel"] == 0 and ledger().sessions(NAME) == []


def test_every_push_asks_for_the_jobs_session_limit(emulator, tmp_path):
    job = small_job(tmp_path, steps=5, train={"session_limit": "30s", "margin": "5s"})
    assert invoke("push", job, "--skip-smoke").exit_code == 0
    assert emulator.session(REF, 1)["limit_s"] == 30  # the emulator's own limit is 60 s
    settle(emulator)


def test_status_shows_a_push_whose_outcome_is_unknown(emulator, tmp_path):
    job = small_job(tmp_path)
    # What a push leaves when its answer was lost and Kaggle could not be asked about the kernel.
    ledger().save_session(NAME, {"session": 1, "status": SessionState.PUSHING, "kernel": REF, "version": None,
                                 "version_before": None, "requested": "2026-01-01T00:00:00Z"})
    result = invoke("status", job)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].split()[:3] == ["1", "-", "PUSHING"]
    assert ("outcome unknown: the push was sent and its answer lost; `kchain continue` checks the kernel's "
            "versions before pushing again") in result.output


def test_logs_follow_streams_live_lines_or_says_the_log_comes_at_the_end(emulator, tmp_path):
    job = small_job(tmp_path, steps=20)
    assert invoke("push", job, "--skip-smoke").exit_code == 0
    live = invoke("logs", job, "--follow", "--poll", "1")
    assert live.exit_code == 0, live.output
    assert "no live log from Kaggle" not in live.output
    assert "[kchain] step 20/20 " in live.output and live.output.splitlines()[-1] == "[kchain] session 1 is COMPLETE"

    emulator.switches.log_stream = False
    assert invoke("push", job, "--skip-smoke").exit_code == 8  # a chain exists: continue, not push
    record = ledger().sessions(NAME)[0]
    ended = invoke("logs", job, "--follow", "--poll", "1")
    assert ended.exit_code == 0, ended.output
    assert ended.output.splitlines()[0] == (
        f"[kchain] no live log from Kaggle for session {record['session']}: Kaggle keeps the log only once the "
        "session ends, so it is shown then (status every poll)")
    assert "[kchain] step 20/20 " in ended.output


def test_a_source_kaggle_drops_at_savekernel_stops_the_chain_and_names_it(emulator, tmp_path):
    # A competition whose rules alice never accepted: kchain cannot check that before the push, and
    # Kaggle answers with invalid sources while it starts the session anyway.
    job = small_job(tmp_path, steps=5, kaggle={"competition": "titanic"})
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 8, result.output
    assert error_line(result) == (
        f"Error: Kaggle dropped invalid competition sources ['titanic'] from the push of {REF} (version 1): "
        "Kaggle started that session without them (a session pushed to resume a state stops itself in its "
        f"first minute without it); stop it at {emulator.url}/code/{REF} (Kaggle's API cannot), fix the source, "
        "then run `kchain continue`")
    record = ledger().sessions(NAME)[0]
    assert (record["status"], record["version"]) == ("QUEUED", 1)  # recorded: it runs, and counts
    status = invoke("status", job)
    assert "Kaggle dropped competition sources ['titanic']: the session ran without them" in status.output
    settle(emulator)
