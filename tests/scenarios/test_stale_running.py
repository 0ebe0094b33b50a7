# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""A session whose notebook runner crashed stays RUNNING, and only deleting its kernel stops it.

Unsloth's Kaggle CI (2026-08-11): a kernel pushed with a 90-minute timeout whose runner crashed at
406 s stayed RUNNING for over two hours and stopped only when the kernel was deleted, which also
stopped the GPU bill. The emulator's `crashed_runner` switch (strict: "running") and its
`crash_runner_on_output` fault stand for it; kchain flags the session as stale by its heartbeat,
`continue --watch` stops on it instead of waiting for ever, and `kchain stop --delete` (or the
watch's delete_stale) deletes the kernel once the chain's state is safe. The unmodified client, the
local Kaggle, real notebook processes.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from emulator_helpers import USER, emulator, kaggle_api  # noqa: F401
from helpers import STALL, copy_job, invoke

from kchain.chain.sessions import StaleRule, stale
from kchain.cli import cli
from kchain.common import layout
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.errors import ChainStop
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger

NAME = "tinygpt-notes"
REF = f"{USER}/{NAME}"
# The stale rule in seconds, not an hour: 5 s without a new heartbeat (the job's come every step); the
# watch that deletes and chains on allows 20 s, and 5 minutes of set-up, so that the healthy session it
# pushes next is not judged stale on a loaded machine.
QUICK = StaleRule(heartbeat_s=0.0, margin_s=0.0, limit_s=600.0, quiet_s=5.0, setup_s=300.0)
PATIENT = StaleRule(heartbeat_s=0.0, margin_s=0.0, limit_s=600.0, quiet_s=20.0, setup_s=300.0)


def wait_for(what, timeout_s: float = 120.0):
    deadline = time.time() + timeout_s
    while not (found := what()):
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
    return found


def test_a_crashed_runner_stays_running_is_flagged_stale_and_deleting_its_kernel_stops_it(
        emulator, kaggle_api, tmp_path, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    emulator.session_limit_s = 600
    emulator.switches.quota_has_gpu = True  # the quota answer names the GPU time used
    path = copy_job("tinygpt", tmp_path,
                    params={"steps": 30, "eval_every": 30, "batch": 8, "accumulate": 1, "n_notes": 2000},
                    train={"session_limit": "600s", "margin": "30s", "heartbeat": "0s"})
    emulator.faults.crash_runner_on_output = "[kchain] step "  # the runner dies once it trained a step
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    wait_for(lambda: emulator.session(REF, 1).get("runner_crashed"))
    emulator.faults.crash_runner_on_output = None
    emulator.expire(REF, 1)  # its time limit is reached: Kaggle does not end it either
    wait_for(lambda: emulator.session(REF, 1).get("limit_ignored"))  # the emulator saw the limit and kept it
    assert kaggle_api.kernels_status(REF).status.name == "RUNNING"
    # And it bills on: its GPU time is its time since it started, up to the moment of each quota read.
    started = emulator.session(REF, 1)["started"]
    for _ in range(2):
        before = time.time()
        used = kaggle_api.quota_view().gpu_quota.time_used.total_seconds()
        assert before - started - 0.001 <= used <= time.time() - started + 0.001  # (ms in the answer)

    status = invoke("status", path)  # reads the live log: the heartbeat the session printed before it died
    assert status.exit_code == 0, status.output
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    [record] = ledger.sessions(NAME)
    assert record["heartbeat"] is not None
    assert record["status"] == "RUNNING" and re.match(r"\[kchain\] step \d+/30 ", record["heartbeat"])
    reached = int(record["heartbeat"].split()[2].split("/")[0])
    assert record["heartbeat_seen"] and record["log_seen"] and record["image"] == emulator.session(REF, 1)["image"]
    assert "STALE" not in status.output  # not yet: the job's rule allows 3 heartbeats + 30m + the margin
    rule = StaleRule.for_job(load_job(path))
    assert stale(record, rule, time.time()) is None
    later = stale(record, rule, time.time() + 2 * 3600)  # two hours on, still no new heartbeat
    assert later is not None and later.burnt_h >= 2.0
    assert later.message(path) == (
        f"session 1 is stale: Kaggle says RUNNING, but no new heartbeat came for 2h00m (more than 3 x its "
        f"0s heartbeat + 30m00s for a step the runtime's watchdog would end + the 30s margin); its notebook "
        f"runner has most likely died, and Kaggle's time limit does not reliably end such a session; it has burnt "
        f"at least {later.burnt_h:.2f} GPU-hours since and goes on billing; `kchain stop --delete {path}` deletes "
        f"its kernel, the only stop Kaggle honours for it (it checks first that the chain's state is safe in a "
        f"state version)")

    # `continue --watch` does not wait for ever on it (here with a rule of seconds, not an hour).
    from kchain.chain.advance import watch

    client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
    job = load_job(path)
    with pytest.raises(ChainStop, match=r"^session 1 is stale: Kaggle says RUNNING, but no new heartbeat came"):
        watch(job, ledger, client, skip_smoke=True, echo=lambda _: None, poll_s=0.2, max_poll_s=1.0, stale=QUICK)

    # `kchain stop --delete` says what the delete keeps and loses, and asks.
    declined = CliRunner().invoke(cli, ["stop", str(path), "--delete"], input="n\n", catch_exceptions=False)
    assert declined.exit_code == 0, declined.output
    assert "session 1 is running: deleting alice/tinygpt-notes stops it and its GPU time" in declined.output
    assert "  kept: nothing to resume yet: session 1 started fresh" in declined.output
    assert (f"  lost with the kernel: session 1's work since step 0 (it reached step {reached}) and its log"
            in declined.output)
    assert f"{REF} not deleted; session 1 is still running" in declined.output
    assert REF in emulator.store.kernels and emulator.session(REF, 1)["status"] == "RUNNING"

    # The watch that may delete a stale kernel deletes it and chains on: no human, no second session beside it.
    lines: list[str] = []
    done = watch(job, ledger, client, skip_smoke=True, echo=lines.append, poll_s=0.2, max_poll_s=1.0, stale=PATIENT,
                 delete_stale=True)
    assert done.action == "finished", lines
    assert f"deleted {REF}: session 1 ended with it, and its GPU time with it; `kchain continue {path}` pushes " \
           "the next session (a new kernel of the same name) from a fresh start" in lines
    first, second = emulator.sessions()
    assert (first["status"], first["output_lost"]) == ("CANCEL_ACKNOWLEDGED", True) and first["kernel_deleted"]
    assert [c["by"] for c in emulator.cancellations()] == ["kernel deleted"]
    assert second["queued"] >= first["ended"] and (second["kernel"], second["version"]) == (REF, 1)
    # The deleted session billed until the delete only; the recreated kernel kept the chain's image.
    billed = kaggle_api.quota_view().gpu_quota.time_used.total_seconds()
    assert billed == pytest.approx(sum(s["ended"] - s["started"] for s in (first, second)), abs=0.01)
    assert len(emulator.store.images) > 1 and second["image"] == first["image"]
    chain = ledger.sessions(NAME)
    assert [(r["status"], r.get("stopped_by_user")) for r in chain] == [("CANCEL_ACKNOWLEDGED", True),
                                                                       ("COMPLETE", None)]
    assert chain[0]["kernel_deleted"] and chain[1]["image_asked"] == chain[0]["image"] == chain[1]["image"]
    final = invoke("status", path)
    assert "image:" not in final.output and "STALE" not in final.output, final.output


def test_the_stale_rule_waits_for_slow_steps_and_judges_nothing_it_cannot_see():
    rule = StaleRule(heartbeat_s=60.0, margin_s=900.0, limit_s=3600.0)
    now = time.time()
    ago = lambda s: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - s))  # noqa: E731
    running: SessionRecord = {"session": 2, "status": SessionState.RUNNING, "gpu": True, "running_seen": ago(1800)}
    assert stale(running, rule, now) is None  # no log read yet: nothing tells
    assert stale({**running, "log_seen": ago(10)}, rule, now) is None  # 30m: within the set-up allowance
    quiet: SessionRecord = {**running, "log_seen": ago(10), "heartbeat": "[kchain] step 9/90 | ...",
                            "heartbeat_seen": ago(3000)}
    judged_quiet = stale(quiet, rule, now)
    assert judged_quiet is not None
    assert judged_quiet.quiet_s >= 3000  # 3 x 1m + 30m + the 15m margin is 48m
    slow: SessionRecord = {**quiet, "heartbeat_gap_s": 1200.0}  # steps of 20 minutes: 3 of them + 30m + 15m
    assert stale(slow, rule, now) is None and stale(slow, rule, now + 3 * 3600) is not None
    # No log at all (Kaggle serves no live one): judged only once RUNNING past its limit and the allowance.
    unseen: SessionRecord = {**running, "running_seen": ago(3600 + 4800 + 60)}
    judged = stale(unseen, rule, now)
    assert judged is not None and judged.overdue and judged.message("job.yaml").startswith(
        "session 2 is stale: still RUNNING past its time limit for 1h21m (more than the 1h18m allowed after its "
        "1h00m time limit, with no log to read its heartbeat in)")
    assert stale({**unseen, "status": SessionState.COMPLETE}, rule, now) is None


def test_a_state_kaggle_gave_no_answer_about_is_unchecked_not_missing(
        emulator, tmp_path):
    # Before deleting a stale kernel, the state its session resumed from must be a version on Kaggle. When
    # Kaggle answers the check with errors only, that is unknown, not "missing": `kchain stop --delete` refuses
    # (the user runs it again), and the watch that may delete asks again at its next look instead of ending.
    from kchain.chain.advance import _delete_plan

    path = copy_job("tinygpt", tmp_path)
    record: SessionRecord = {"kernel": REF, "session": 2, "version": 2, "status": SessionState.RUNNING,
                             "state_version": 1, "resumes_at": 20}
    emulator.faults.rate_500 = 1.0
    plan = _delete_plan(KaggleClient(attempts=2, backoff_s=0.01), load_job(path), [record], record)
    assert plan.blockers == [] and plan.unchecked == [
        f"state version 1 of {USER}/{NAME}-state (step 20), which could not be checked (Kaggle dataset status "
        "failed: HTTP 500: Internal error (injected))"]
    with pytest.raises(ChainStop, match=r"not deleting alice/tinygpt-notes: .*which could not be checked"):
        plan.refuse_if_unsafe()
    emulator.faults.rate_500 = 0.0  # answered now: no such dataset (403), so the state is missing, a blocker
    plan = _delete_plan(KaggleClient(attempts=2, backoff_s=0.01), load_job(path), [record], record)
    assert plan.unchecked == [] and plan.blockers == [
        f"state version 1 of {USER}/{NAME}-state (step 20), which Kaggle does not have (Kaggle dataset status "
        f"failed: HTTP 403: Permission denied: dataset {USER}/{NAME}-state does not exist or you cannot see it)"]
