"""Hugging Face Accelerate under kchain (runtime/frameworks/hf_accelerate.py), on the `kchain init --template accelerate` job.

The template (an Accelerator with fp16 and gradient accumulation, prepare(), accumulate(), backward(),
clip_grad_norm_(), gather_for_metrics(); two lines changed) smoke-passes as written on 2 gloo ranks, as on
Kaggle: accelerate's DDP over kchain's ranks, shuffled data read by 2 workers a rank, a deadline stop
mid-epoch inside the epoch's accumulations, a real SIGKILL and a bit-exact resume through the epoch's
end. In-process on 1 rank: a deadline stop mid-epoch and the next session's resume give the uninterrupted
run's losses, lr and accuracies and train every step asked for; save_state and a loop outside run.epochs
are refused with one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import invoke, make_run, train_template

from kchain.common import layout
from kchain.common.summary import read_working
from kchain.job.init import init_job

TEMPLATE = "accelerate"
PARAMS = {"epochs": 2, "lr": 2e-3, "seed": 0, "rows": 200, "features": 8, "classes": 3, "hidden": 16,
          "dropout": 0.2, "batch": 16, "accumulate": 3, "num_workers": 0}


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """accelerate keeps its state per process (AcceleratorState, GradientState): each Run starts anew."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_the_template_smokes_to_an_exact_pass_on_two_ranks_with_a_stop_mid_epoch(tmp_path):
    folder = tmp_path / "acc-job"
    init_job(folder, template=TEMPLATE)
    result = invoke("smoke", folder / "job.yaml")
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "accelerate: the Accelerator's DistributedType.MULTI_CPU runs over kchain's 2 ranks" in result.output
    assert "2 ranks (gloo, CPU)" in result.output and "not exact" not in result.output
    # 320 training rows, 2 ranks x 32 a batch: 5 batches an epoch, 3 optimizer steps (2 + 2 + 1). The stop
    # after step 2 is mid-epoch; the resumed run finishes the epoch (its evaluation logs at step 3).
    lines = [line.split() for line in result.output.splitlines()]
    assert ["3", "val_acc"] == next(words[:2] for words in lines if words[1:2] == ["val_acc"])
    assert ["3", "loss"] == next(words[:2] for words in lines if "<-" in words)
    run_dir = Path(os.environ["KCHAIN_HOME"]) / "smoke"
    resumed = read_working(next(run_dir.iterdir()) / "resume" / layout.WORKING_DIR)
    assert resumed is not None
    assert (resumed.status, resumed.step, resumed.total, resumed.world_size) == ("finished", 4, 4, 2)


def train(root: Path, env: dict | None = None) -> tuple:
    return train_template(root, TEMPLATE, PARAMS, env)


def test_a_deadline_mid_epoch_and_the_next_session_match_the_uninterrupted_run(tmp_path):
    # 160 training rows, 16 a batch: 10 batches an epoch, accumulated by 3 into 4 steps (3 + 3 + 3 + 1), 8 in
    # all. The deadline after step 2 stops at batch 6 of epoch 0: the next session resumes there.
    from accelerate.state import AcceleratorState, GradientState

    reference = train(tmp_path / "reference")
    assert reference[:3] == ("finished", 8, 8)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert train(tmp_path / "chain", {layout.FAULT_ENV: "deadline_after_steps=2"})[:3] == ("deadline", 2, 8)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = train(tmp_path / "chain")
    assert resumed[:3] == ("finished", 8, 8)
    assert [row["step"] for row in reference[3] if "val_acc" in row] == [4, 8]  # one evaluation an epoch
    assert resumed[3] == reference[3]  # every loss, lr and accuracy, bit for bit
    digests = [json.loads((tmp_path / run / "working/kchain/checkpoints" / layout.checkpoint_name(8) /
                           "digests.json").read_text()) for run in ("reference", "chain")]
    assert digests[0] == digests[1]  # the state at the end too: weights, moments, schedule, RNGs, position
    names = {key.split(".")[1] for key in digests[0] if key.startswith("tracked.")}
    assert names == {"accelerator", "model", "optimizer", "scheduler", "loader"}


def test_save_state_and_a_loop_outside_run_epochs_are_refused_with_what_to_write(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from kchain.runtime.frameworks.hf_accelerate import (
        LOAD_STATE,
        OUTSIDE_EPOCHS,
        SAVE_STATE,
        AccelerateSetupError,
    )

    run = make_run(tmp_path, params={"seed": 0})
    try:
        accelerator = run.accelerator()
        data = TensorDataset(torch.randn(8, 2), torch.zeros(8))
        loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True))
        with pytest.raises(AccelerateSetupError, match="^" + OUTSIDE_EPOCHS.replace("(", r"\(").replace(")", r"\)")):
            next(iter(loader))
        with pytest.raises(AccelerateSetupError) as saved:
            accelerator.save_state("ckpt")
        assert str(saved.value) == SAVE_STATE and "delete this call" in SAVE_STATE
        with pytest.raises(AccelerateSetupError, match="delete this call"):
            accelerator.load_state("ckpt")
        assert "delete this call" in LOAD_STATE
    finally:
        run.close()
