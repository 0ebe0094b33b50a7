"""Which checkpoint a session resumes from: the attached state dataset (a folder or a zip), never someone's data."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import torch
from helpers import make_run, paths
from torch import nn

from kchain.common import layout
from kchain.runtime.run import Run


def tiny_training(root: Path, steps: int, env: dict | None = None) -> Run:
    run = make_run(root, {"seed": 1}, env, checkpoint_every={"steps": 2})
    model = nn.Linear(3, 2)
    run.track(model=model)
    for step in run.steps(steps):
        with torch.no_grad():
            model.weight += step
        run.log(loss=float(step))
    run.close()
    return run


def test_resume_from_an_attached_state_dataset_and_a_zip(tmp_path, capsys):
    first = tiny_training(tmp_path / "s1", 4)
    assert first.session == 1 and first.finished
    # Next session: fresh working dir, the previous output attached under datasets/<owner>/<slug>.
    s2 = tmp_path / "s2"
    shutil.copytree(first.working, s2 / "input/datasets/me/tiny-state")
    second = tiny_training(s2, 6)
    assert second.resumed_from == 4 and second.session == 2
    assert len(second._paths.metrics.read_text().splitlines()) == 6  # one history, no duplicated steps
    # A session whose state came as an un-unpacked zip of the checkpoint directory, in a state
    # dataset (its marker file says so: archives anywhere else are never opened).
    s3 = tmp_path / "s3"
    (s3 / "input/tiny-zip").mkdir(parents=True)
    (s3 / "input/tiny-zip" / layout.STATE_MARKER).write_text("{}")
    with zipfile.ZipFile(s3 / "input/tiny-zip/state.zip", "w") as z:
        ckpt = second._paths.checkpoints / layout.checkpoint_name(6)
        for f in ckpt.iterdir():
            z.write(f, f"{ckpt.name}/{f.name}")
    third = tiny_training(s3, 8)
    assert third.resumed_from == 6 and third.session == 3


def test_other_manifests_under_input_are_ignored(tmp_path):
    (tmp_path / "input/some-data").mkdir(parents=True)
    (tmp_path / "input/some-data/manifest.json").write_text('{"step": 99}')
    run = tiny_training(tmp_path, 2)
    assert run.resumed_from is None


def test_foreign_archives_and_manifests_under_input_are_never_opened(tmp_path, capsys):
    first = tiny_training(tmp_path / "s1", 2)
    s2 = tmp_path / "s2"
    # Someone's dataset holding a zip of a real kchain checkpoint and a .tar.gz that is not even
    # gzip: without the state marker next to them, neither is read, extracted or listed.
    data = s2 / "input/datasets/someone/images"
    data.mkdir(parents=True)
    with zipfile.ZipFile(data / "ckpt.zip", "w") as z:
        ckpt = first._paths.checkpoints / layout.checkpoint_name(2)
        for f in ckpt.iterdir():
            z.write(f, f"inner/{f.name}")
    (data / "shards.tar.gz").write_bytes(b"not a gzip stream")
    capsys.readouterr()
    run = tiny_training(s2, 3)
    assert run.resumed_from is None and run.session == 1
    assert "skipping archive" not in capsys.readouterr().out
    scratch = paths(run).kchain / ".scratch"
    assert not scratch.exists() or not any(scratch.iterdir())
