"""Every loop shape of tests/runtime_jobs/loops_job.py, killed with a real SIGKILL and resumed.

A shape is exact when the killed-and-resumed run's loss trace equals an uninterrupted run's
(max diff 0.0); the shapes that cannot be exact say so in one line in the summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import saved_names
from torch import nn

from kchain.common import layout
from kchain.runtime.run import Run

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
KILLED = -signal.SIGKILL
CHILD_TIMEOUT_S = 120
EVERY = 3


def launch(root: Path, entry: str, params: dict, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "loops", "entry": f"loops_job:{entry}", "params": params, "fingerprint": "f00d",
        "train": {"checkpoint_every": {"steps": EVERY}, "keep": 2, "heartbeat_s": 0},
    }))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
                     PYTHONUNBUFFERED="1", **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def kchain_dir(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR


def trace(root: Path) -> list[tuple[int, float]]:
    lines = (kchain_dir(root) / layout.METRICS).read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def summary(root: Path) -> dict:
    return json.loads((kchain_dir(root) / layout.SUMMARY).read_text())


def max_diff(a, b) -> float:
    assert [s for s, _ in a] == [s for s, _ in b], f"the traces cover different steps: {a} vs {b}"
    return max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True))


def kill_and_resume(tmp_path: Path, entry: str, params: dict, kill: int, fault: str | None = None):
    """(reference trace, resumed trace, the resumed run's summary, its stdout)."""
    ref = launch(tmp_path / "ref", entry, params)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    died = launch(tmp_path / "run", entry, params, KCHAIN_FAULT=fault or f"kill_at_step={kill}")
    assert died.returncode == KILLED, died.stdout + died.stderr
    done = launch(tmp_path / "run", entry, params)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[kchain] resumed from step" in done.stdout
    return trace(tmp_path / "ref"), trace(tmp_path / "run"), summary(tmp_path / "run"), done.stdout


def test_break_saves_the_step_reached_and_ends_stopped(tmp_path):
    done = launch(tmp_path, "stop", {"steps": 20, "stop_at": 7})
    assert done.returncode == 0, done.stdout + done.stderr
    got = summary(tmp_path)
    assert (got["status"], got["step"]) == ("stopped", 7)
    assert got["checkpoint"] == f"kchain/checkpoints/{layout.checkpoint_name(7)}"
    assert "[kchain] stopped at step 7/20" in done.stdout
    # The saved state is the one after step 7: a longer run resumed from it equals an uninterrupted one.
    again = launch(tmp_path, "stop", {"steps": 10, "stop_at": 99})
    assert "resumed from step 7" in again.stdout and summary(tmp_path)["status"] == "finished"
    ref = launch(tmp_path / "ref", "stop", {"steps": 10, "stop_at": 99})
    assert ref.returncode == 0
    assert max_diff(trace(tmp_path), trace(tmp_path / "ref")) == 0.0


def test_a_crash_inside_the_loop_saves_nothing_of_the_broken_step(tmp_path):
    done = launch(tmp_path, "stop", {"steps": 20, "stop_at": 99, "rows": 0})  # no rows: next(loader) raises
    assert done.returncode == 1
    assert summary(tmp_path)["status"] == "crashed"
    assert not list((kchain_dir(tmp_path) / layout.CHECKPOINTS_DIR).glob("step-*"))


def test_epoch_loop_killed_on_an_epoch_boundary(tmp_path):
    # step 10 is the last batch of epoch 0; the checkpoint at step 9 sits one batch before it.
    ref, got, _, _ = kill_and_resume(tmp_path, "epochs", {"epochs": 2}, kill=10)
    assert max_diff(got, ref) == 0.0


# A SIGKILL between two saves (steps lost and replayed). The other loop shapes (sampler,
# batch_sampler, a GAN's two optimizers, manual save/restore, a hand-built DataLoader, mid-epoch) are
# killed and resumed by the smoke in tests/scenarios/test_smoke_loops.py, which judges the traces bit for bit.
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["iterable"])
def test_loop_shape_resumes_exactly_after_sigkill(tmp_path, entry):
    ref, got, end, out = kill_and_resume(tmp_path, entry, {"steps": 16}, kill=11)
    assert max_diff(got, ref) == 0.0
    assert end["status"] == "finished"
    if entry == "iterable":
        assert any("IterableDataset" in line for line in end["not_exact"])
        assert "not exact on resume: data order: stream reads an IterableDataset" in out
    else:
        assert end["not_exact"] == []


def test_no_run_steps_says_no_checkpoint_was_written(tmp_path):
    done = launch(tmp_path, "noloop", {"steps": 3})
    assert done.returncode == 0, done.stderr
    got = summary(tmp_path)
    assert got["status"] == "no_checkpoint"
    assert got["note"] == "no checkpoint was written: the loop did not use run.steps"
    assert got["checkpoint"] is None


def make_run(root: Path) -> Run:
    return Run({"job": "unit", "params": {}, "train": {"heartbeat_s": 0, "checkpoint_every": {"steps": 100}}},
               {layout.ROOT_ENV: str(root)})


def test_a_duplicate_name_is_an_error_and_two_optimizers_get_their_own(tmp_path):
    run = make_run(tmp_path)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    run.optimize(torch.optim.SGD(a.parameters(), lr=0.1))
    run.optimize(torch.optim.SGD(b.parameters(), lr=0.1))
    run.optimize(torch.optim.SGD(b.parameters(), lr=0.1), name="disc")
    with pytest.raises(ValueError, match="the name 'disc' already tracks a SGD; give each object its own name"):
        run.optimize(torch.optim.SGD(a.parameters(), lr=0.1), name="disc")
    run.track(model=a)
    with pytest.raises(ValueError, match="'model' already tracks a Linear"):
        run.track(model=b)
    run.save(0)
    run.close()
    assert saved_names(tmp_path) == {"optimizer", "optimizer2", "disc", "model"}


@pytest.mark.parametrize("saved_wrapped", [True, False])
def test_dataparallel_prefix_is_matched_both_ways(tmp_path, saved_wrapped):
    torch.manual_seed(0)
    first = nn.Linear(3, 2)
    run = make_run(tmp_path)
    run.track(model=nn.DataParallel(first) if saved_wrapped else first)
    for _ in run.steps(2):
        pass
    run.close()
    second = nn.Linear(3, 2)
    again = make_run(tmp_path)
    again.track(model=second if saved_wrapped else nn.DataParallel(second))
    assert again.restore() == 2
    assert torch.equal(second.weight, first.weight) and torch.equal(second.bias, first.bias)
    again.close()
