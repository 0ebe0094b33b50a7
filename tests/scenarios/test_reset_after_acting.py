# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""A creating call that Kaggle acted on, then a connection reset instead of its answer.

kaggle 2.2.5 wraps CreateDataset and CreateDatasetVersion in its own `KaggleApi.with_retry`, which
re-sends on a connection error (a 500 it never re-sends): left to it, one lost answer is a second
state version before kchain sees anything. SaveKernel is not wrapped, so its reset reaches kchain.
Through the CLI, the unmodified client and the local Kaggle's `reset_after_acting` fault.
"""

from __future__ import annotations

import json

from emulator_helpers import USER, emulator  # noqa: F401
from helpers import copy_job, invoke

from kchain.kaggle.client import KaggleClient
from kchain.kaggle.datasets import new_version, write_dataset_metadata
from kchain.store.names import state_dataset

NAME = "blobs-classifier"
REF = f"{USER}/{NAME}"


def test_a_reset_after_kaggle_acted_makes_one_dataset_one_session_and_one_version(emulator, tmp_path):
    job = copy_job("classifier", tmp_path, params={"steps": 5, "rows": 4000, "num_workers": 0})
    state = state_dataset(USER, NAME)
    # `kchain push` creates the state dataset, then saves the kernel: both act, then the connection resets.
    emulator.faults.reset_after_acting = 2
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 0, result.output
    assert emulator.faults.reset_after_acting == 0  # both resets happened
    assert emulator.calls["SaveKernel"] == 1 and [s["version"] for s in emulator.sessions()] == [1]
    assert len(emulator.dataset_versions(state)) == 1
    emulator.expire(REF)  # the session is not what this test is about

    # The next state version: Kaggle adds it, the answer is a reset; the client must not send it again.
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / "kchain-state.json").write_text(json.dumps({"step": 5}))
    write_dataset_metadata(folder, state, f"{NAME} state")
    emulator.settle(state)
    emulator.faults.reset_after_acting = 1
    lines: list[str] = []
    client = KaggleClient(timeout_s=10, backoff_s=0.01, sleep=lambda s: None)
    assert new_version(client, folder, state, "kchain session 1 step 5", "skip", lines.append) == 2
    assert emulator.calls["CreateDatasetVersion"] == 1
    assert [v["number"] for v in emulator.dataset_versions(state)] == [1, 2]
    assert f"  the answer to the upload was lost, but {state} has version 2: using it" in lines
