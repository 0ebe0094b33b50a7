"""A state version damaged on Kaggle is repaired, not retried (issue 59, item 1).

Against the local Kaggle (strict defaults, internet off: the laptop relays each state): session 2's state
version has its state.pt truncated in the emulator's dataset storage before the session mounts it (a lagging
mount, released by the test once the damage is done, so nothing races the machine). The session refuses it
(DamagedState); `continue` refuses to go on, --retry too, while this laptop holds no verified copy of that step;
once session 1's output is back, it publishes that copy as a new state version and pushes on from the same step.
The chain ends bit for bit equal to an uninterrupted run of the same job, with no step lost.
"""

# ruff: noqa: F811
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from emulator_helpers import PATIENCE_S, emulator  # noqa: F401  (fixture)
from helpers import GENEROUS_S, STALL, copy_job, error_line, invoke
from test_chain import ROOMY
from test_chain_result import chain_to_the_end

from kchain.chain.advance import verified_copy
from kchain.common import layout
from kchain.common.checkpoint_files import sha256_of, verify
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.common.statefolder import write_dataset_metadata
from kchain.emulator import Switches
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.kaggle.datasets import ensure_state_dataset, new_version
from kchain.local import statecheck
from kchain.result.traces import compare_traces, read_trace
from kchain.store.ledger import Ledger

NAME = "tinygpt-notes"
REF = f"alice/{NAME}"
STATE = f"{REF}-state"
PARAMS = {"steps": 30, "eval_every": 10, "batch": 8, "accumulate": 1, "n_notes": 2000}
TRAIN = {**ROOMY, "checkpoint_every": "10 steps", "keep": 3}  # both runs save (and keep) steps 10, 20 and 30


def output_of(record: SessionRecord) -> Path:
    """The folder a session's output was downloaded to (an ended session of these chains has one)."""
    assert record["output"] is not None
    return Path(record["output"])


def damage(emu, version: int) -> None:
    """Truncate the checkpoint's state.pt in the emulator's storage of that state version (Kaggle's side)."""
    state = emu.store.version_files_dir(STATE, version) / layout.STATE_FILE
    with open(state, "r+b") as handle:
        handle.truncate(state.stat().st_size // 2)


@pytest.mark.slow
def test_a_damaged_state_version_is_republished_from_the_laptops_copy_and_the_chain_ends_bit_equal(
        tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    emulator.session_limit_s = GENEROUS_S
    path = copy_job("tinygpt", tmp_path / "chain", params=PARAMS, train=TRAIN)
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(REF, 1)
    emulator.switches.mount_lag_s = PATIENCE_S  # session 2's state arrives only with mount_now, below
    second = invoke("continue", path, "--skip-smoke")
    assert second.exit_code == 0, second.output
    version = emulator.session(REF, 2)["dataset_sources"][0].rsplit("/", 1)[1]
    damage(emulator, int(version))
    emulator.mount_now(REF, 2)
    emulator.wait_session(REF, 2)
    emulator.switches.mount_lag_s = Switches().mount_lag_s

    # No verified copy of step 10 here (session 1's download moved away): refused, --retry as well, nothing sent.
    ledger = Ledger(Path(os.environ["KCHAIN_HOME"]))
    kept = output_of(ledger.sessions(NAME)[0])
    shutil.move(kept, tmp_path / "away")
    for retry in ([], ["--retry"]):
        refused = invoke("continue", path, "--skip-smoke", *retry)
        assert refused.exit_code == 8, refused.output
        line = error_line(refused)
        assert line.startswith(f"Error: session 2 refused state version {version} (step 10) as damaged: this session "
                               f"was pushed to resume step 10 from state version {version}, but the attached input "
                               "holds no checkpoint that verifies: "), line
        assert "(truncated?)" in line
        assert line.endswith("no verified copy of step 10 is on this laptop or in an earlier state version, and "
                             "--retry would send the same damaged version again: run "
                             f"`kchain continue {path}` where session 1's output (step 10) was downloaded"), line
    assert len([s for s in emulator.sessions() if s["kernel"] == REF]) == 2
    versions = len(emulator.dataset_versions(STATE))

    # The copy is back: published as a new version, and the chain goes on from step 10.
    shutil.move(tmp_path / "away", kept)
    third = invoke("continue", path, "--skip-smoke")
    assert third.exit_code == 0, third.output
    assert (f"session 2 refused state version {version} (step 10): this session was pushed to resume step 10 from "
            f"state version {version}, but the attached input holds no checkpoint that verifies: ") in third.output
    assert ("; session 1's output on this laptop holds a verified copy of step 10: publishing it as a new state "
            "version and pushing session 3 from it (no step lost)") in third.output
    new = len(emulator.dataset_versions(STATE))
    assert new == versions + 1
    assert (f"session 3 pushed (kernel version 3), resuming at step 10 from state version {new}: step 10 "
            f"republished from session 1's output on this laptop after session 2 refused state version {version}; "
            "0 steps lost") in third.output
    chain_to_the_end(path)
    chain = ledger.sessions(NAME)
    assert [s.get("resumes_at", 0) for s in chain] == [0, 10, 10, 20]
    assert [(s.get("summary") or {}).get("status") for s in chain] == ["deadline", "crashed", "deadline", "finished"]
    assert chain[1]["publish"]["repair"] == {"refused_version": int(version), "from": "session 1's output on this laptop"}
    assert all((s.get("publish") or {}).get("steps_lost") in (0, None) for s in chain)

    # Bit for bit the uninterrupted run: the same job in one session, every value at every step both saved.
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    reference = copy_job("tinygpt", tmp_path / "reference", params=PARAMS, train=TRAIN)
    reference.write_text(reference.read_text().replace(f"name: {NAME}\n", "name: tinygpt-reference\n"))
    assert invoke("push", reference, "--skip-smoke").exit_code == 0
    done = emulator.wait_session("alice/tinygpt-reference", 1)
    working = emulator.session_output_dir(done["id"])
    compared = statecheck.compare(statecheck.saved([statecheck.checkpoints_of(working)]),
                                  statecheck.saved(statecheck.checkpoints_of(output_of(s)) for s in chain))
    assert compared.steps == (10, 20, 30) and compared.first is None and compared.whole, compared
    rows, first = compare_traces(read_trace(working / layout.KCHAIN_DIR / layout.METRICS),
                                 read_trace(output_of(chain[-1]) / layout.KCHAIN_DIR / layout.METRICS))
    assert first is None and {row[0] for row in rows} == set(range(1, 31)), rows


def state_version(client: KaggleClient, folder: Path, step: int, truncated: bool = False) -> int:
    """A state version holding a checkpoint of `step` (made by hand: a manifest over a state.pt), uploaded to the
    local Kaggle as the chain's relay uploads one; truncated: its state.pt cut short after the manifest was made."""
    folder.mkdir(parents=True)
    state = folder / layout.STATE_FILE
    state.write_bytes(os.urandom(4096))
    files = {layout.STATE_FILE: {"size": 4096, "sha256": sha256_of(state)}}
    (folder / layout.MANIFEST).write_text(json.dumps({layout.MARKER: 1, "job": NAME, "step": step, "files": files}))
    (folder / layout.STATE_MARKER).write_text(json.dumps({"job": NAME, "step": step, "published": "relay"}))
    if truncated:
        with open(state, "r+b") as handle:
            handle.truncate(100)
    write_dataset_metadata(folder, STATE, f"{NAME} state")
    return new_version(client, folder, STATE, f"kchain step {step}", "skip", lambda _line: None)


def test_an_earlier_state_version_holding_the_step_is_the_copy_when_no_download_here_has_it(tmp_path, emulator):
    # No session's output is on this laptop: the copy of step 10 is the earlier state version that holds it and
    # verifies, downloaded into the ledger; a damaged one is never a copy, nor is the version refused.
    client, ledger = KaggleClient(), Ledger(tmp_path / "ledger")
    job = load_job(copy_job("tinygpt", tmp_path, params=PARAMS))
    ensure_state_dataset(client, "alice", NAME, lambda _line: None)
    good = state_version(client, tmp_path / "good", 10)
    bad = state_version(client, tmp_path / "bad", 10, truncated=True)
    chain: list[SessionRecord] = [
        {"session": 1, "status": SessionState.COMPLETE, "publish": {"step": 10, "version": good}},
        {"session": 2, "status": SessionState.COMPLETE, "publish": {"step": 10, "version": bad}},
        {"session": 3, "status": SessionState.ERROR, "resumes_at": 10, "state_version": bad}]
    copy = verified_copy(client, ledger, job, "alice", chain, 10, bad)
    assert copy is not None and copy.where == f"state version {good}" and copy.state_folder
    assert Path(copy.path).is_relative_to(ledger.root) and verify(Path(copy.path))["step"] == 10
    assert json.loads((Path(copy.path) / layout.STATE_MARKER).read_text())["step"] == 10
    assert verified_copy(client, ledger, job, "alice", chain, 10, good) is None  # the other one is damaged
    assert verified_copy(client, ledger, job, "alice", chain, 20, None) is None  # no version holds step 20
