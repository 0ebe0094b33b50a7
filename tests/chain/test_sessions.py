"""The words `kchain status` prints (issue 59 item 6): for a chain that waits on the laptop, and each
session's last heartbeat."""

# ruff: noqa: F811
from __future__ import annotations

import json
import os
from pathlib import Path

from emulator_helpers import emulator  # noqa: F401  (fixture)
from helpers import GENEROUS_S, copy_job, invoke, known

from kchain.chain.sessions import heartbeat_step, waiting
from kchain.common import layout
from kchain.common.sessionstate import SessionState
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger

NAME = "tinygpt-notes"
REF = f"alice/{NAME}"


def test_a_laptop_driven_chain_says_plainly_that_the_next_session_waits_for_continue():
    wait = waiting([{"session": 1, "status": SessionState.COMPLETE, "summary": None}], "job.yaml")
    assert wait == {"for": "continue", "why": "session 1 ended (complete); the laptop drives this chain, so the "
                                              "next session waits for it"}


def test_status_shows_each_sessions_last_heartbeat_even_when_the_kept_log_lags(tmp_path, emulator, monkeypatch):
    # Kaggle's persisted log of a running session may lag its live stream (switches.stale_log_at: it holds the
    # first heartbeat only): `status` reads the stream and shows the newest; once the session ended, the kept
    # output's log has the last one and `status` asks Kaggle for no stream at all.
    monkeypatch.setenv(layout.FAULT_ENV, "stall_step=4")  # a heartbeat every 4 s at most: the stream goes quiet
    emulator.switches.stale_log_at = "[kchain] step "
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path, params={"steps": 1000, "batch": 8, "accumulate": 1},
                    train={"heartbeat": "0s", "session_limit": "600s", "margin": "30s"})
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_output(REF, "[kchain] step 2/")
    kept = "".join(e["data"] for e in json.loads(KaggleClient().log(REF, 1)))
    assert "[kchain] step 1/1000" in kept and "[kchain] step 2/" not in kept  # the lagging log, as switched

    status = invoke("status", path)
    assert status.exit_code == 0, status.output
    record = Ledger(Path(os.environ["KCHAIN_HOME"])).sessions(NAME)[0]
    assert record["status"] == "RUNNING" and known(heartbeat_step(record["heartbeat"])) >= 2, record
    assert record["heartbeat"] in status.output.splitlines()[1]  # the note of session 1: its newest heartbeat

    emulator.cancel(REF, 1)
    emulator.wait_session(REF, 1)
    ended = invoke("status", path)  # fetches the ended session's output and kept log: the last heartbeat
    streams = emulator.calls["GetKernelSessionLogsStream"]
    again = invoke("status", path)
    assert emulator.calls["GetKernelSessionLogsStream"] == streams  # an ended session: no stream asked for
    record = Ledger(Path(os.environ["KCHAIN_HOME"])).sessions(NAME)[0]
    last = [line for line in emulator.live_log(REF, 1).splitlines() if line.startswith("[kchain] step ")][-1]
    assert record["heartbeat"] == last.strip() and known(heartbeat_step(last)) >= 2
    assert ended.output == again.output and ended.output.splitlines()[1].endswith(f"  {last.strip()}"), ended.output
