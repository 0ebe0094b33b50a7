# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
""""Ready" is not "mounted": a session waits for the state it resumes, and one that never saw it is pushed again.

A 2026 measurement saw a kernel miss its attached dataset for 138 s after the dataset API had said
"ready" (docs/emulator.md, `mount_lag_s`). The emulator mounts such a version only that long after it
became ready; the session's launcher waits for the expected state (kaggle.mount_wait), and a session
whose state never came ends `state_not_mounted`, which `kchain continue` answers by pushing the same
session again, without a person. The unmodified client, the local Kaggle, real notebook processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from emulator_helpers import USER, emulator  # noqa: F401
from helpers import copy_job, invoke

from kchain.common import layout
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger
from kchain.store.names import state_dataset

NAME = "tinygpt-notes"
REF = f"alice/{NAME}"


def set_mount_wait(path: Path, wait: str) -> None:
    data = yaml.safe_load(path.read_text())
    data["kaggle"] = {**data.get("kaggle", {}), "mount_wait": wait}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def log_of(session: int) -> str:
    root = Ledger(Path(os.environ["KCHAIN_HOME"])).root
    return "".join(e["data"] for e in json.loads((root / "sessions" / NAME / str(session) / "log.json").read_text()))


@pytest.mark.slow
def test_a_late_mount_is_waited_for_and_a_missing_one_is_pushed_again(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, "stall_step=0.05,deadline_after_steps=10")
    path = copy_job("tinygpt", tmp_path, params={"steps": 20, "eval_every": 20, "batch": 8, "accumulate": 1},
                    train={"session_limit": "600s", "margin": "30s"})
    set_mount_wait(path, "2s")
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(REF, 1)

    # Session 2: its state version is ready, and stays unmounted far longer than the session waits.
    emulator.switches.mount_lag_s = 1000.0
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    emulator.wait_session(REF, 2)
    # Session 3 (pushed by continue without --retry): the same state still lags, and arrives once the
    # session has said it waits for it (mount_now), however long the machine took to start the session.
    set_mount_wait(path, "5m")
    third = invoke("continue", path, "--skip-smoke")
    assert third.exit_code == 0, third.output
    emulator.wait_output(REF, "[kchain] waiting for state version", version=3)
    emulator.mount_now(REF, 3)
    emulator.wait_session(REF, 3)  # it finishes the run
    done = invoke("continue", path, "--skip-smoke")
    assert done.exit_code == 0, done.output

    chain = Ledger(Path(os.environ["KCHAIN_HOME"])).sessions(NAME)
    ended_as = [(r.get("summary") or {}).get("status") for r in chain]
    assert ended_as == ["deadline", "state_not_mounted", "finished"], ended_as
    # Session 2 trained nothing and said why in one line; session 3 was pushed for the same state.
    assert chain[0]["summary"] is not None and chain[1]["summary"] is not None
    assert chain[1]["summary"]["step"] == chain[0]["summary"]["step"] == 10
    assert chain[2]["resumes_at"] == chain[1]["resumes_at"] == 10
    assert "[kchain] state-not-mounted: state version" in log_of(2) and "(kaggle.mount_wait)" in log_of(2)
    assert emulator.session(REF, 2)["status"] == "COMPLETE"  # a stop, not a failed notebook
    # Session 3 waited for the mount, then resumed exactly where session 1 stopped.
    assert "[kchain] state version" in log_of(3) and "mounted after" in log_of(3)
    assert emulator.session(REF, 3)["resumed_from"] == 10
    assert chain[2]["summary"] is not None
    assert chain[2]["summary"]["step"] == 20


def kernel_log(version: int) -> str:
    """A session's log as the client reads it from the local Kaggle (the laptop may not have fetched it yet)."""
    return "".join(chunk.get("data", "") for chunk in json.loads(KaggleClient().log(REF, version) or "[]"))


def _mounted_from(emulator, version: int, session: int, damage) -> None:
    """Once session `session` waits for its lagging state version, that version is changed on the local Kaggle
    (as a user editing the dataset would) and then mounted."""
    emulator.wait_output(REF, "[kchain] waiting for state version", version=session)
    damage(emulator.store.version_files_dir(state_dataset(USER, NAME), version))
    emulator.mount_now(REF, session)


@pytest.mark.slow
def test_a_mounted_version_without_its_pointer_resumes_by_its_manifest_and_a_damaged_one_stops_at_once(
        tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, "stall_step=0.05,deadline_after_steps=10")
    path = copy_job("tinygpt", tmp_path, params={"steps": 30, "eval_every": 10, "batch": 8, "accumulate": 1},
                    train={"session_limit": "600s", "margin": "30s"})
    set_mount_wait(path, "5m")  # far past the test's patience: a wait would show as a session that never ends
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(REF, 1)
    emulator.switches.mount_lag_s = 1000.0  # every state version mounts only when the test says (mount_now)
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))

    # Session 2's state version loses its pointer: the session reads the step from the checkpoint's manifest.
    assert invoke("continue", path, "--skip-smoke").exit_code == 0
    second_state = ledger.sessions(NAME)[1]["state_version"]
    assert second_state is not None
    _mounted_from(emulator, second_state, 2,
                  lambda files: (files / layout.STATE_MARKER).unlink())
    emulator.wait_session(REF, 2)
    assert f"[kchain] state version {ledger.sessions(NAME)[1]['state_version']} has no {layout.STATE_MARKER}: " \
           "step 10 read from its checkpoint's manifest.json" in kernel_log(2)
    assert emulator.session(REF, 2)["resumed_from"] == 10

    # Session 3's loses its pointer and its checkpoint is cut short: refused at once, the fix said, not waited on.
    assert invoke("continue", path, "--skip-smoke").exit_code == 0
    third_state = ledger.sessions(NAME)[2]["state_version"]
    assert third_state is not None
    _mounted_from(emulator, third_state, 3, lambda files: (
        (files / layout.STATE_MARKER).unlink(), (files / layout.STATE_FILE).write_bytes(b"cut")))
    third = emulator.wait_session(REF, 3)
    assert emulator.session(REF, 2)["summary"]["step"] == 20
    said = kernel_log(3)
    assert "but holds neither its kchain-state.json nor a checkpoint whose manifest.json holds together: not " \
           "waiting for it, the session stops; fix: " in said, said
    # Stopped by the check of what it resumes, in its first minute: never the mount wait's end.
    assert "was not mounted within" not in said and "stopping before training from" in said, said
    assert third["summary"]["status"] != "state_not_mounted" and third["summary"]["step"] is None
