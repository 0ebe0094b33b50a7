"""train.keep_best: the best step's checkpoint survives pruning, travels in every state version and is
brought along by the next session; the checkpointer driven directly (no notebook, no Run)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from kchain.chain.advance import relay_state
from kchain.common import keepbest, layout, statefolder
from kchain.common.checkpoint_files import BEST_KEY, complete, find_latest, verify
from kchain.common.faults import Faults
from kchain.common.sessionrecord import SessionRecord
from kchain.common.trace import Trace
from kchain.runtime import ladder
from kchain.runtime.checkpoint.checkpointer import Checkpointer, Policy, Where
from kchain.runtime.distributed import Ranks
from kchain.runtime.progress import Progress

DEFAULT = keepbest.Choice()  # follow run.best's metric, mode by its name


def parts(root, choice=DEFAULT, keep=1):
    paths = layout.Paths.of({layout.ROOT_ENV: str(root)})
    paths.kchain.mkdir(parents=True, exist_ok=True)
    where = Where(paths.checkpoints, paths.input_root, paths.scratch, paths.working, "kbest-state")
    policy = Policy("kbest", {"steps": 2}, keep=keep, stream=None, manifest={"params": {}}, keep_best=choice)
    ckpt = Checkpointer(where, policy, Ranks({}), Faults(), ladder.Rung(False, 0))
    model = torch.nn.Linear(3, 2)
    ckpt.track("model", model)
    return ckpt, Progress(), Trace(paths.metrics, writes=True), model, paths


def train(ckpt, progress, trace, model, vals: dict[int, float], metric="val_loss"):
    """A step is a weight change; at each step in vals the metric is logged, then a checkpoint saved."""
    weights = {}
    for step, value in vals.items():
        with torch.no_grad():
            model.weight.add_(step)
        progress.step = step
        trace.log(step, {"loss": 1.0, metric: value})
        ckpt.save(progress, trace)
        ckpt.writer.wait()
        weights[step] = model.weight.detach().clone()
    return weights


def steps_in(folder):
    return [int(p.name.removeprefix(layout.CHECKPOINT_PREFIX)) for p in complete(folder)]


def test_the_best_checkpoint_survives_pruning_and_travels_in_the_state_beside_the_newest(tmp_path):
    ckpt, progress, trace, model, paths = parts(tmp_path / "s1")
    weights = train(ckpt, progress, trace, model, {2: 0.5, 4: 0.3, 6: 0.4, 8: 0.6})
    trace.close()
    assert steps_in(paths.checkpoints) == [4, 8]  # keep 1, and the best beside it
    newest = json.loads((paths.checkpoints / "step-00000008" / layout.MANIFEST).read_text())
    assert newest[BEST_KEY] == {"metric": "val_loss", "mode": "min", "value": 0.3, "step": 4}

    state = tmp_path / "input" / "datasets" / "me" / "kbest-state"
    marker = statefolder.build_state_folder(paths.kchain, state, "kernel", "kbest")
    assert marker is not None
    assert marker["step"] == 8 and marker["best"]["step"] == 4 and marker["best"]["prefix"] == layout.BEST_PREFIX
    assert marker["best"]["bytes"] > 0 and verify(state, layout.BEST_PREFIX)["step"] == 4
    # The resume search reads manifest.json alone: the best never becomes the resume point.
    found = find_latest(tmp_path / "none", tmp_path / "input", tmp_path / "scratch", "kbest", "kbest-state")
    assert found is not None and found[1]["step"] == 8

    # Session 2 resumes step 8 and brings the best (step 4) into its own checkpoints; a worse value
    # at step 10 leaves it the best, so session 2's state carries it again.
    root2 = tmp_path / "s2"
    shutil.copytree(tmp_path / "input", root2 / "input")
    ckpt2, progress2, trace2, model2, paths2 = parts(root2)
    assert ckpt2.restore(progress2, trace2, {}) is not None and torch.equal(model2.weight, weights[8])
    # Killed now, its output holds the best alone (step 4, before the resume): the laptop's relay publishes
    # nothing, never the older step as the newest state.
    said: list[str] = []
    record: SessionRecord = {"session": 2, "resumes_at": 8, "output": str(paths2.kchain.parent)}
    # Stand-ins: it returns before it reads the client or the job, or saves publish facts.
    assert relay_state(None, SimpleNamespace(name="kbest"), "me", record, said.append,  # type: ignore[arg-type]
                       said.append) is None  # type: ignore[arg-type]
    assert said == ["  session 2's output holds no checkpoint past step 8, where it resumed: nothing to publish"]
    train(ckpt2, progress2, trace2, model2, {10: 0.45})
    trace2.close()
    assert steps_in(paths2.checkpoints) == [4, 10]
    state2 = tmp_path / "v2"
    marker2 = statefolder.build_state_folder(paths2.kchain, state2, "kernel", "kbest")
    assert marker2 is not None
    assert (marker2["step"], marker2["best"]["step"]) == (10, 4)
    best = torch.load(state2 / (layout.BEST_PREFIX + layout.STATE_FILE), weights_only=False)
    assert torch.equal(best["tracked"]["model"]["weight"], weights[4])


def test_a_new_best_replaces_the_kept_one_and_the_newest_best_is_not_copied_twice(tmp_path):
    ckpt, progress, trace, model, paths = parts(tmp_path, keepbest.Choice("val_acc", None), keep=1)
    train(ckpt, progress, trace, model, {2: 0.5, 4: 0.7, 6: 0.9}, metric="val_acc")  # higher is better
    trace.close()
    assert steps_in(paths.checkpoints) == [6]
    marker = statefolder.build_state_folder(paths.kchain, tmp_path / "v", "kernel", "kbest")
    assert marker is not None
    assert marker["best"] | {"bytes": 0} == {"metric": "val_acc", "mode": "max", "value": 0.9, "step": 6,
                                            "checkpoint": "step-00000006", "bytes": 0, "prefix": ""}
    assert not list((tmp_path / "v").glob(layout.BEST_PREFIX + "*"))


def test_a_metric_logged_between_checkpoints_keeps_nothing_and_off_keeps_nothing(tmp_path, capsys):
    ckpt, progress, trace, model, paths = parts(tmp_path / "a", keepbest.Choice("val_loss", "max"))
    with torch.no_grad():
        model.weight.add_(1)
    trace.log(3, {"val_loss": 0.1})  # step 3 has no checkpoint: no weights of that step exist
    train(ckpt, progress, trace, model, {2: 0.9, 4: 0.8}, metric="loss")
    trace.close()
    assert steps_in(paths.checkpoints) == [4]
    assert BEST_KEY not in json.loads((paths.checkpoints / "step-00000004" / layout.MANIFEST).read_text())

    off, progress, trace, model, paths = parts(tmp_path / "b", None)
    train(off, progress, trace, model, {2: 0.5, 4: 0.7})
    trace.close()
    assert steps_in(paths.checkpoints) == [4]
    assert "keep_best" not in capsys.readouterr().out.split("checkpoint plan:")[-1].splitlines()[0]


def test_the_plan_line_says_the_best_costs_a_whole_checkpoint(tmp_path, capsys):
    ckpt, progress, trace, model, _ = parts(tmp_path)
    train(ckpt, progress, trace, model, {2: 0.5})
    trace.close()
    plan = next(line for line in capsys.readouterr().out.splitlines() if "checkpoint plan:" in line)
    assert "the best by val_loss kept whole (train.keep_best: up to" in plan


@pytest.mark.parametrize(("value", "want"), [
    ("{metric: val acc}", "train.keep_best: metric: 'val acc' is not a metric name"),
    ("{metric: val_acc, mode: up}", "train.keep_best: mode: Input should be 'min' or 'max'"),
    ("3", "train.keep_best: 3: write a metric name"),
])
def test_a_bad_keep_best_is_one_line_naming_the_key(tmp_path, value, want):
    from kchain.errors import SpecError
    from kchain.job.spec import load_job

    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: kbest\ncode: train.py\ntrain:\n  keep_best: {value}\n")
    with pytest.raises(SpecError) as e:
        load_job(job)
    assert want in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("value", "want"), [
    ("off", "off"), ("val_acc", "val_acc"), ("{metric: val_acc, mode: max}", {"metric": "val_acc", "mode": "max"}),
])
def test_keep_best_reaches_the_runtime_config(tmp_path, value, want):
    from kchain.job.spec import load_job, runtime_config

    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: kbest\ncode: train.py\ntrain:\n  keep_best: {value}\n")
    assert runtime_config(load_job(job)).train.keep_best == want
