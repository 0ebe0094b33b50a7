"""Lightning Fabric under kchain (runtime/frameworks/lit_fabric.py), on the `kchain init --template fabric` job.

The template (Fabric(accelerator="cuda", precision="16-mixed"), launch(), setup() with a scheduler,
setup_dataloaders(), model.training_step(batch) on the set-up model, no_backward_sync() accumulation,
clip_gradients(); its Fabric and epoch lines changed, its enumerate counting from the loader's position)
smoke-passes as written on 2 gloo ranks: Fabric's DDP over kchain's ranks (the replicas check after the
first step and at each save proves training_step went through DDP's forward), shuffled data read by 2
workers a rank, a deadline stop mid-epoch, a real SIGKILL, a bit-exact resume through the epoch's end. In
process on 1 rank: a deadline stop mid-epoch, inside the epoch's accumulations, and the next session give
the uninterrupted run's trace and state; fabric.save writes its file, fabric.load is refused in one line.
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

TEMPLATE = "fabric"
PARAMS = {"epochs": 2, "lr": 2e-3, "seed": 0, "rows": 200, "features": 8, "classes": 3, "hidden": 16,
          "dropout": 0.2, "batch": 16, "accumulate": 3, "num_workers": 0}


@pytest.mark.slow
def test_the_template_smokes_to_an_exact_pass_on_two_ranks_with_a_stop_mid_epoch(tmp_path):
    folder = tmp_path / "fabric-job"
    init_job(folder, template=TEMPLATE)
    result = invoke("smoke", folder / "job.yaml")
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "fabric: DDPStrategy runs over kchain's 2 ranks" in result.output
    assert "2 ranks (gloo, CPU)" in result.output and "not exact" not in result.output
    # 320 training rows, 2 ranks x 32 a batch: 5 batches an epoch, 3 optimizer steps (2 + 2 + 1); the stop
    # after step 2 is mid-epoch, the resumed run finishes the epoch (its evaluation logs at step 3).
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
    reference = train(tmp_path / "reference")
    assert reference[:3] == ("finished", 8, 8)
    assert train(tmp_path / "chain", {layout.FAULT_ENV: "deadline_after_steps=2"})[:3] == ("deadline", 2, 8)
    resumed = train(tmp_path / "chain")
    assert resumed[:3] == ("finished", 8, 8)
    assert [row["step"] for row in reference[3] if "val_acc" in row] == [4, 8]  # one evaluation an epoch
    assert resumed[3] == reference[3]
    digests = [json.loads((tmp_path / run / "working/kchain/checkpoints" / layout.checkpoint_name(8) /
                           "digests.json").read_text()) for run in ("reference", "chain")]
    assert digests[0] == digests[1]
    names = {key.split(".")[1] for key in digests[0] if key.startswith("tracked.")}
    assert names == {"model", "optimizer", "scheduler", "loader"}


def test_fabric_save_writes_its_file_and_load_is_refused_with_what_to_delete(tmp_path):
    from kchain.runtime.frameworks.lit_fabric import LOAD, FabricSetupError

    run = make_run(tmp_path, params={"seed": 0})
    try:
        fabric = run.fabric(accelerator="cpu", devices=1)
        fabric.launch()  # a no-op: run.fabric launched it
        fabric.save(tmp_path / "state.ckpt", {"answer": 42})  # an export of the script's own
        assert (tmp_path / "state.ckpt").is_file()
        with pytest.raises(FabricSetupError) as loaded:
            fabric.load(tmp_path / "state.ckpt", {})
        assert str(loaded.value) == LOAD and "delete this call" in LOAD
    finally:
        run.close()
