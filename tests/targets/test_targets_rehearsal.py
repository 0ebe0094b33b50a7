"""`kchain smoke --target`: the engine's rendered script run here with its environment variables, a
local folder as the bucket, a real SIGKILL after a checkpoint is saved locally and before it is
published, and a resume on a fresh, empty machine that must match an uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import copy_job, invoke
from test_targets import SKYPILOT, SLURM, stand_ins

from kchain.store.ledger import Ledger

pytestmark = pytest.mark.slow


def smoke_row(home: Path) -> list[str]:
    return (home / "runs.csv").read_text().splitlines()[-1].split(",")


def test_smoke_target_slurm_passes_the_exit_code_contract_and_opens_the_push_gate(tmp_path, monkeypatch):
    # The classifier's loader has two worker processes, whose batches come back over a Unix socket made under
    # TMPDIR (Slurm's machine root), and the job's state folder is deep: the socket's path must still fit.
    home = tmp_path / ("deep-folder-" * 5) / ("deeper-still-" * 5) / "kchain-home"
    monkeypatch.setenv("KCHAIN_HOME", str(home))
    path = copy_job("classifier", tmp_path, target="slurm", slurm=SLURM, params={"rows": 4000, "num_workers": 2})
    result = invoke("smoke", path, "--target", "slurm", "--quiet")
    assert result.exit_code == 0, result.output
    for line in ("  machine-1  exit 75  interrupted at step ", "  machine-2  exit 137  killed, no summary",
                 "  machine-3  exit 0  finished at step 6", "PASS: resumed run equals the uninterrupted run bit for bit"):
        assert line in result.output
    assert "<- resumed here" in result.output
    row = smoke_row(home)
    assert row[2] == "smoke-slurm" and row[-1] == "smoke-slurm pass"
    work = home / "targets-rehearsal" / row[0]
    assert (work / "bin" / "scontrol.calls").read_text() == "requeue 4242\n"  # asked once, by machine 1 (exit 75)
    # The pass opens push's gate: no --skip-smoke needed.
    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path / 'bin', '77')}:/usr/bin:/bin")
    pushed = invoke("push", path)
    assert pushed.exit_code == 0, pushed.output
    record = json.loads((home / "targets.json").read_text())["blobs-classifier"]
    assert record["smoke"] == row[0] and Ledger(home).smoke_passed(record["fingerprint"]) is not None


def test_smoke_target_skypilot_runs_the_task_run_and_resumes_from_the_bucket(tmp_path):
    path = copy_job("tinygpt", tmp_path, target="skypilot", skypilot=SKYPILOT)
    result = invoke("smoke", path, "--target", "skypilot", "--quiet")
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    home = tmp_path / "kchain-home"
    work = home / "targets-rehearsal" / smoke_row(home)[0]
    # The fresh machine's checkpoints reached the bucket: its pointer names the last step.
    pointer = json.loads((work / "bucket" / "tinygpt-notes" / "latest").read_text())
    assert pointer["step"] == 6
