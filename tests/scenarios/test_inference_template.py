"""`kchain init --template inference`: the internet-off notebook that attaches a released model smoke-passes
with the folder `kchain pull` writes standing in for the model (kaggle.local)."""

from __future__ import annotations

import json

import torch
import yaml
from helpers import invoke
from safetensors.torch import save_file
from torch import nn

from kchain.job.init import init_job
from kchain.job.spec import load_job


def test_the_inference_template_smoke_passes_with_a_pulled_folder_as_the_model(tmp_path):
    folder = tmp_path / "my-inference"
    init_job(folder, "inference")
    job = load_job(folder / "job.yaml")
    assert not job.kaggle.internet and job.kaggle.models == ["you/my-model/pytorch/default/1"]
    assert job.train.keep_best == "off"
    pulled = folder / "pulled"  # as `kchain pull ... -o pulled` writes it: the notebook template's model
    pulled.mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    save_file(model.state_dict(), str(pulled / "model.safetensors"))
    (pulled / "metrics.json").write_text(json.dumps({"step": 4}))
    smoke = invoke("smoke", folder / "job.yaml", "--quiet", "--ranks", "1")
    assert smoke.exit_code == 0, smoke.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in smoke.output
    assert yaml.safe_load((folder / "job.yaml").read_text())["kaggle"]["local"] == {"my-model": "pulled"}
