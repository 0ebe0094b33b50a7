"""The checkpointer on its own (no Run): what it tracks, when a save is due, a save and its restore."""

from __future__ import annotations

import pytest
import torch

from kchain.common import layout
from kchain.common.checkpoint_files import CheckpointsDamaged
from kchain.common.faults import Faults
from kchain.common.trace import Trace
from kchain.runtime import ladder
from kchain.runtime.checkpoint.checkpointer import Checkpointer, Policy, Where
from kchain.runtime.distributed import Ranks
from kchain.runtime.progress import Progress


def parts(tmp_path, every=None, halvings=0):
    paths = layout.Paths.of({layout.ROOT_ENV: str(tmp_path)})
    paths.kchain.mkdir(parents=True, exist_ok=True)
    where = Where(paths.checkpoints, paths.input_root, paths.scratch, paths.working, None)
    policy = Policy("unit", every or {"steps": 2}, keep=2, stream=None, manifest={"params": {"lr": 0.1}})
    ckpt = Checkpointer(where, policy, Ranks({}), Faults(), ladder.Rung(True, halvings))
    return ckpt, Progress(), Trace(paths.metrics, writes=True)


def model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_save_restores_into_fresh_objects_with_the_step_the_session_and_the_trace(tmp_path):
    ckpt, progress, trace = parts(tmp_path, halvings=1)
    model, opt = model_and_opt(0)
    ckpt.track("model", model)
    ckpt.track("optimizer", opt)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    progress.step = 3
    trace.log(3, {"loss": 0.5, "val_loss": 0.4})
    assert ckpt.save(progress, trace) >= 0 and progress.saved_step == 3
    ckpt.writer.wait()
    trace.close()
    assert ckpt.newest_rel() == "kchain/checkpoints/step-00000003"

    again, progress2, trace2 = parts(tmp_path)
    fresh, fresh_opt = model_and_opt(1)
    again.track("model", fresh)
    again.track("optimizer", fresh_opt)
    assert again.halvings_found() == 1  # the ladder's rung is in the manifest
    path = again.restore(progress2, trace2, {"lr": 0.1})
    assert path.name == "step-00000003" and again.restore(progress2, trace2, {}) is None  # once
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.state_dict()["state"][0]["step"] == 1
    assert (progress2.step, progress2.resumed_from, progress2.session) == (3, 3, 2)
    assert trace2.best == {"name": "val_loss", "value": 0.4, "step": 3} and b'"loss": 0.5' in trace2.logged()
    trace2.close()
    with pytest.raises(RuntimeError, match="after run.steps started"):
        again.track("late", torch.nn.Linear(1, 1))


def test_names_are_one_object_each_and_the_cadence_says_when(tmp_path):
    ckpt, _, trace = parts(tmp_path, every={"steps": 5})
    model = torch.nn.Linear(2, 2)
    ckpt.track("model", model)
    ckpt.track("again", model)  # the same object under a second name: tracked once
    assert list(ckpt.tracked) == ["model"] and ckpt.free_name("model") == "model2"
    with pytest.raises(ValueError, match="already tracks a Linear"):
        ckpt.track("model", torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="has no state_dict"):
        ckpt.track("x", object())
    assert [s for s in range(1, 16) if ckpt.due(s)] == [5, 10, 15] and ckpt.next_in(7) == "3 steps"
    trace.close()


def test_every_checkpoint_damaged_stops_instead_of_starting_over(tmp_path):
    ckpt, progress, trace = parts(tmp_path)
    ckpt.track("model", torch.nn.Linear(2, 2))
    progress.step = 2
    ckpt.save(progress, trace)
    ckpt.writer.wait()
    state = next(ckpt.where.checkpoints.glob("step-*")) / layout.STATE_FILE
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
    again, progress2, trace2 = parts(tmp_path)
    again.track("model", torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointsDamaged, match="every checkpoint found is damaged"):
        again.restore(progress2, trace2, {})
    trace.close()
    trace2.close()
