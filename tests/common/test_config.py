"""The runtime config: one typed record from the renderer to the kernel's runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from kchain.common.config import KaggleConfig, RuntimeConfig
from kchain.job.render import render_job
from kchain.job.spec import load_job

JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.mark.parametrize("name", sorted(p.name for p in JOBS.iterdir() if (p / "job.yaml").exists()))
def test_the_config_a_notebook_embeds_reads_back_as_the_same_record(name):
    facts = {"publish": {"start_s": 5.0}, "resume": {"step": 40, "state_version": 3}}
    rendered = render_job(load_job(JOBS / name / "job.yaml"), owner="me", session_facts=facts)
    config = RuntimeConfig.from_dict(rendered.config)
    assert config.to_dict() == rendered.config
    job = config.job
    assert config.kaggle.resume == facts["resume"] and config.kaggle.state_dataset == f"me/{job}-state"
    assert config.state_slug == f"{job}-state" and config.fingerprint == rendered.fingerprint


def test_a_partial_config_gets_the_defaults_and_an_unknown_key_is_named():
    config = RuntimeConfig.from_dict({"job": "unit", "train": {"keep": 3}})
    assert config.train.keep == 3 and config.train.gpus == "auto" and config.kaggle == KaggleConfig()
    assert config.state_slug is None and config.params == {}
    with pytest.raises(ValueError, match="config.train: unknown key 'kep'"):
        RuntimeConfig.from_dict({"train": {"kep": 3}})
    with pytest.raises(ValueError, match="config: unknown key 'trian'"):
        RuntimeConfig.from_dict({"trian": {}})
