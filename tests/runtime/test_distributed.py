# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Several ranks under torchrun (gloo on this CPU): exact resume, agreed stops, errors, sharding.

Every run is a real `python -m kchain.runtime.launch` that starts 2 ranks through
`python -m torch.distributed.run`; session deaths are real SIGKILLs of every rank.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from emulator_helpers import emulator, kaggle_api  # noqa: F401  (fixtures)
from helpers import copy_job, invoke

from kchain.chain.sessions import session_note
from kchain.common import layout, nextsession
from kchain.common.config import RuntimeConfig
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.common.summary import Summary
from kchain.emulator.app import PATIENCE_S
from kchain.job import diagnose
from kchain.runtime import distributed, forkranks
from kchain.runtime.checkpoint.state import load_state

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
TOTAL = 8
EPOCHS = {"dropout": 0.3, "epochs": 2}  # 64 rows, 2 ranks x 8: 4 steps an epoch, 8 in all
KILLED = -signal.SIGKILL
CHILD_TIMEOUT_S = 240  # generous: a hung rank fails the test instead of hanging CI; never a speed bound


def launch(root: Path, gpus: int = 2, every: int = 3, params: dict | None = None, **env: str):
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "ddp", "entry": "ddp_job:main", "params": {"steps": TOTAL, **(params or {})},
        "fingerprint": "f00d", "kchain_version": "0.1.0",
        "train": {"checkpoint_every": {"steps": every}, "keep": 2, "heartbeat_s": 0, "gpus": gpus},
        "kaggle": {"accelerator": "gpu"},
    }))
    drop = ("KCHAIN_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "KAGGLE_KERNEL_RUN_TYPE")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
                     PYTHONUNBUFFERED="1", **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def kdir(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR


def trace(root: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (kdir(root) / layout.METRICS).read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def summary(root: Path) -> dict:
    return json.loads((kdir(root) / layout.SUMMARY).read_text())


def checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in (kdir(root) / layout.CHECKPOINTS_DIR).iterdir())


def out(done) -> str:
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    root = tmp_path_factory.mktemp("ddp-reference")
    done = launch(root, params=EPOCHS)
    assert done.returncode == 0, out(done)
    assert out(done).count("[kchain] check ok: inputs shape (8, 6)") == 1  # both ranks checked; one says so
    ref = trace(root)
    assert [s for s, _ in ref] == list(range(1, TOTAL + 1))
    return ref


@pytest.mark.slow
def test_two_ranks_sigkill_at_a_random_step_resume_bit_exact(tmp_path, reference):
    """The epoch loop (run.epochs, `for batch in loader`): a kill may land in either epoch."""
    seed = random.SystemRandom().randrange(10**6)
    # Checkpoints every 2 steps: the one of step 4 waits for step 2's write, so a kill at the end of
    # step 5 or later always leaves a complete checkpoint (a later one may still be in flight).
    kill = random.Random(seed).randrange(5, TOTAL)
    print(f"kill at step {kill} (seed {seed})")
    # The killed session's ranks are spawned, each its own interpreter, as on Kaggle's GPUs; the reference's
    # and the resume's are forked from their launcher's torch import (forkranks.py): the three are one run.
    died = launch(tmp_path, every=2, params=EPOCHS, KCHAIN_FAULT=f"kill_at_step={kill}", KCHAIN_FORK_RANKS="0")
    assert died.returncode == KILLED, out(died)
    assert "2 ranks (gloo, CPU)" in died.stdout and forkranks.NOTE not in died.stdout
    done = launch(tmp_path, every=2, params=EPOCHS)
    assert done.returncode == 0, out(done)
    assert "[kchain] resumed from step" in done.stdout and forkranks.NOTE in done.stdout
    for output in (died.stdout, done.stdout):  # only rank 0 narrates, forked (its modules imported before) or not
        assert output.count("[kchain] device: cpu") == 1, output
    got = trace(tmp_path)
    assert [s for s, _ in got] == [s for s, _ in reference]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, reference, strict=True)) == 0.0
    # One checkpoint, written once by rank 0, holding both ranks' RNG and loader positions.
    last = kdir(tmp_path) / layout.CHECKPOINTS_DIR / checkpoints(tmp_path)[-1]
    assert json.loads((last / layout.MANIFEST).read_text())["world_size"] == 2
    ranks = load_state(last)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all("loader" in r["tracked"] for r in ranks)
    assert summary(tmp_path)["world_size"] == 2


@pytest.mark.slow
def test_deadline_on_one_rank_stops_both_with_one_checkpoint(tmp_path):
    done = launch(tmp_path, every=100, KCHAIN_FAULT="deadline_at_step=3,deadline_rank=1")
    assert done.returncode == layout.EXIT_SAVED_NOT_DONE, out(done)
    s = summary(tmp_path)
    assert (s["status"], s["step"]) == ("deadline", 3)
    assert checkpoints(tmp_path) == [layout.checkpoint_name(3)]
    assert "another rank stopped (deadline)" in done.stdout
    # Resuming with another number of ranks is refused in one line that says what differs.
    again = launch(tmp_path, gpus=1)
    assert again.returncode == 1
    err = summary(tmp_path)["error"]
    assert err["type"] == "ResumeError"
    assert "saved by 2 rank(s) and this session runs 1" in err["message"] and "train.gpus: 2" in err["message"]


def test_break_on_one_rank_stops_both(tmp_path):
    done = launch(tmp_path, every=100, params={"break_at": 2, "break_rank": 1})
    assert done.returncode == 0, out(done)
    s = summary(tmp_path)
    assert (s["status"], s["step"]) == ("stopped", 2)
    assert checkpoints(tmp_path) == [layout.checkpoint_name(2)]


def test_error_on_rank_1_ends_rank_0_with_the_error_in_the_summary(tmp_path):
    # Ending at all is the point: before, rank 0 waited in a collective until the 12-hour kill.
    done = launch(tmp_path, params={"crash_at": 2, "crash_rank": 1})
    assert done.returncode == 1, out(done)
    s = summary(tmp_path)
    assert s["status"] == "crashed"
    assert s["error"]["rank"] == 1 and s["error"]["type"] == "ValueError"
    assert s["error"]["message"] == "boom on rank 1 at step 2"
    assert "[kchain] rank 1 crashed in step: ValueError: boom on rank 1 at step 2" in done.stdout


def test_rank_0_sigkilled_alone_is_a_kill_on_two_ranks_and_the_chain_goes_on(tmp_path):
    # The OOM killer's SIGKILL of rank 0 alone, right after its checkpoint at step 4; rank 1 then fails on the
    # broken connection. The kill is named, not rank 1's error, and the launcher dies as one rank would.
    died = launch(tmp_path, every=2, KCHAIN_FAULT="kill_training_at_step=4")
    assert died.returncode == KILLED, out(died)
    s = summary(tmp_path)
    assert s["status"] == "killed" and s["world_size"] == 2
    assert {k: s["error"][k] for k in ("type", "rank", "signal")} == {"type": "RankKilled", "rank": 0,
                                                                       "signal": "SIGKILL"}
    assert (s["step"], Path(s["checkpoint"]).name) == (4, layout.checkpoint_name(4))
    assert "[kchain] rank 0 of 2 was killed by SIGKILL from outside the training" in died.stdout
    assert "[kchain] rank 1 crashed" not in died.stdout  # rank 1's own traceback is a consequence
    # The laptop (and the kernel) read it as a kill: the chain pushes on from the newest state.
    failure = diagnose.from_summary(Summary.from_dict(s))
    assert failure is not None
    record: SessionRecord = {"session": 1, "status": SessionState.ERROR, "fingerprint": "f00d", "summary": s, "resumes_at": 0,
              "error": {"type": failure.type, "message": failure.message, "stage": failure.stage}}
    assert nextsession.crash_of(record) is None
    chain = nextsession.Chain([record], "me/ddp", SessionState.ERROR, lambda: "f00d", lambda _fp: True)
    assert nextsession.decide(chain, "job.yaml").action == "push"
    assert session_note(record).startswith("RankKilled: rank 0 of 2 was killed by SIGKILL")
    assert "killed from outside" in failure.hint


@pytest.mark.slow
def test_one_rank_and_two_ranks_train_the_same_with_the_same_effective_batch(tmp_path):
    one = launch(tmp_path / "one", gpus=1, params={"batch": 16})
    two = launch(tmp_path / "two", gpus=2, params={"batch": 8})
    assert one.returncode == 0 and two.returncode == 0, out(one) + out(two)
    a, b = trace(tmp_path / "one"), trace(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, TOTAL + 1))
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-5
    # The control: a different effective batch trains differently, so the comparison can fail.
    other = launch(tmp_path / "other", gpus=2, params={"batch": 4})
    c = trace(tmp_path / "other")
    assert other.returncode == 0 and max(abs(x - y) for (_, x), (_, y) in zip(a, c, strict=True)) > 1e-3


def test_ranks_are_forked_only_from_a_launcher_of_one_thread_unless_switched_off():
    """Forking a process with other threads can copy a lock one of them holds: such a launcher spawns. Ranks
    of more than one CPU thread are spawned without a torch import in the launcher (it would start threads)."""
    assert not forkranks.prepare({layout.FORK_RANKS_ENV: "0"})
    probe = subprocess.run([sys.executable, "-c", "import os, sys; from kchain.runtime import forkranks; "
                            "print(forkranks.prepare(os.environ), 'torch' in sys.modules)"],
                           env={**os.environ, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, cwd=REPO)
    assert probe.stdout.split() == ["False", "False"], probe.stdout + probe.stderr
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not forkranks.prepare({})
    finally:
        release.set()
        other.join()


def test_shards_of_a_global_batch_are_the_one_rank_batch():
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    for b in range(2):
        both = distributed.shard(order, 8, b, 0, 2) + distributed.shard(order, 8, b, 1, 2)
        assert both == order[b * 16 : (b + 1) * 16].tolist()
    # A short last global batch is padded from the start of the epoch: every rank takes 8 rows.
    assert distributed.shard(order, 8, 2, 1, 2) == order[:8].tolist()
    assert distributed.batches_per_rank(40, 8, 2, drop_last=False) == 3
    assert distributed.batches_per_rank(40, 8, 2, drop_last=True) == 2


def test_a_kaggle_session_without_the_asked_gpu_stops_at_once(tmp_path):
    done = launch(tmp_path, gpus=2, KAGGLE_KERNEL_RUN_TYPE="Batch")
    assert done.returncode == layout.EXIT_NO_ACCELERATOR
    lines = [line for line in done.stdout.splitlines() if "no-accelerator" in line]
    assert lines == ["[kchain] no-accelerator: asked for GPU T4 x2 (train.gpus: 2), got no GPU: the weekly GPU "
                     "quota may be spent or the kernel's accelerator setting was lost; stopping instead of "
                     "training on the CPU"]
    s = summary(tmp_path)
    assert s["status"] == "no_accelerator" and s["error"]["type"] == "NoAccelerator"
    assert not (kdir(tmp_path) / layout.CHECKPOINTS_DIR).exists()


def test_plan_ranks():
    def cfg(gpus, accelerator):
        return RuntimeConfig.from_dict({"train": {"gpus": gpus}, "kaggle": {"accelerator": accelerator}})

    auto = cfg("auto", "gpu")
    assert distributed.plan_ranks(auto, {}, cuda_count=2)[0] == 2
    assert distributed.plan_ranks(auto, {}, cuda_count=0)[0] == 1
    two = cfg(2, "gpu")
    assert distributed.plan_ranks(two, {}, cuda_count=0)[0] == 2  # the smoke: 2 gloo ranks on the CPU
    kaggle = {"KAGGLE_KERNEL_RUN_TYPE": "Batch"}
    with pytest.raises(distributed.NoAccelerator, match="got 1 GPU:"):
        distributed.plan_ranks(two, kaggle, cuda_count=1)
    assert distributed.plan_ranks(two, {**kaggle, "KCHAIN_ACCELERATOR_CHECK": "off"}, cuda_count=0)[0] == 2
    cpu_job = cfg("auto", "none")
    assert distributed.plan_ranks(cpu_job, kaggle, cuda_count=0)[0] == 1
    # SkyPilot or Slurm (a state sink): GPUs asked of the engine and none visible is exit 69, not a CPU run.
    target = {"KCHAIN_STATE_SINK": "/bucket/job"}
    with pytest.raises(distributed.NoAccelerator, match="target asked for GPUs"):
        distributed.plan_ranks(auto, target, cuda_count=0)
    assert distributed.plan_ranks(auto, target, cuda_count=1)[0] == 1
    assert distributed.plan_ranks(cpu_job, target, cuda_count=0)[0] == 1
    assert distributed.plan_ranks(auto, {**target, "KCHAIN_ACCELERATOR_CHECK": "off"}, cuda_count=0)[0] == 1


def test_the_emulator_runs_a_two_gpu_job_as_two_ranks_and_stops_a_gpuless_session(emulator, kaggle_api, tmp_path):
    """The same notebook: 2 gloo ranks when GPUs are granted; no-accelerator when the session has none."""
    small = {"steps": 6, "rows": 2000, "num_workers": 0, "eval_every": 3}
    job = copy_job("classifier", tmp_path, train={"gpus": 2}, params=small)
    assert invoke("render", job, "-o", tmp_path / "kernel").exit_code == 0
    ref = "alice/blobs-classifier"
    for version, no_gpu in ((1, False), (2, True)):
        emulator.faults.no_gpu = no_gpu
        assert kaggle_api.kernels_push(str(tmp_path / "kernel")).version_number == version
        session = emulator.wait_session(ref)
        kaggle_api.kernels_output(f"{ref}/{version}", str(tmp_path / f"out{version}"))
        result = json.loads((tmp_path / f"out{version}" / "kchain" / layout.SUMMARY).read_text())
        log = (tmp_path / f"out{version}" / "blobs-classifier.log").read_text()
        if not no_gpu:
            assert session["status"] == "COMPLETE", log
            assert (result["status"], result["step"], result["world_size"]) == ("finished", 6, 2)
            assert "2 ranks (gloo, CPU)" in log
        else:
            assert session["status"] == "ERROR"
            assert result["status"] == "no_accelerator"
            assert "asked for GPU T4 x2 (train.gpus: 2), got no GPU" in result["error"]["message"]


def test_status_shows_the_ranks_of_a_finished_session():
    from kchain.chain.sessions import status_table

    row: SessionRecord = {"session": 1, "version": 1, "status": SessionState.COMPLETE, "step": 6, "total": 6,
                          "end_status": "finished", "ranks": 2}
    assert status_table([row], 0.0, 30)[1].endswith("6/6  finished, 2 ranks")


def test_the_launcher_of_several_ranks_plans_them_without_importing_torch(tmp_path):
    # torchrun's ranks import torch; the launcher above them need not (2 s of CPU per local session).
    code = ("import sys; from kchain.runtime import torchrun; "
            "from kchain.common.config import RuntimeConfig; "
            "n, why = torchrun.plan_ranks(RuntimeConfig(), {'KCHAIN_RANKS': '2', 'KCHAIN_SMOKE': '1'}); "
            "assert n == 2 and 'as on Kaggle' in why, why; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
