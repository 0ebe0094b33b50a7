"""`kchain smoke` on every loop shape of tests/runtime_jobs/loops_job.py: a pass, or the right one-line cause."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from helpers import error_line, invoke

from kchain.runtime.loop import PLAIN_LOADER_NOTE
from kchain.runtime.run import NO_LOOP_NOTE

JOBS = Path(__file__).resolve().parents[1] / "runtime_jobs"


def loop_job(tmp_path: Path, entry: str) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    for name in ("tiny_job.py", "loops_job.py"):
        shutil.copy(JOBS / name, code / name)
    (code / "train.py").write_text("from loops_job import *  # noqa: F403\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": f"loops-{entry.replace('_', '-')}", "code": "code", "entry": f"loops_job:{entry}",
        "params": {"steps": 6, "epochs": 3, "stop_at": 5},
        "kaggle": {"accelerator": "gpu", "internet": False},
        "train": {"gpus": 1},  # the loop shapes on one rank; the default 2 ranks: example jobs, test_ports.py
        "smoke": {"steps": 3},
    }))
    return job


@pytest.mark.parametrize("entry", ["epochs", "sampler", "batch_sampler", "gan", "manual", "stop", "iterable"])
def test_loop_shape_smokes_to_a_pass(entry, tmp_path):
    result = invoke("smoke", loop_job(tmp_path, entry), "--quiet")
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    named = "  not exact  data order: stream reads an IterableDataset" in result.output
    assert named == (entry == "iterable")
    assert ("not exact" in result.output) == (entry == "iterable")


@pytest.mark.slow
def test_a_hand_built_dataloader_fails_the_smoke_naming_it(tmp_path):
    result = invoke("smoke", loop_job(tmp_path, "plain_loader"), "--quiet")
    assert result.exit_code == 3, result.output
    assert "ResumeMismatch" in error_line(result)
    assert f"  hint: {PLAIN_LOADER_NOTE}: `dl` (a DataLoader over NoisyRows, batch_size 4) (pass it to run.loader(...) to keep its place; one used only for evaluation does not change the resume)" in result.output


def test_a_loop_without_run_steps_fails_the_smoke_saying_so(tmp_path):
    result = invoke("smoke", loop_job(tmp_path, "noloop"), "--quiet")
    assert result.exit_code == 3, result.output
    assert error_line(result).startswith(f"Error: smoke failed (during checkpoint): NoCheckpoint: {NO_LOOP_NOTE}; ")
