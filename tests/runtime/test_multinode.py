"""Two localhost "nodes" under an outer torchrun, as a SkyPilot run section starts them from
SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS: `python -m torch.distributed.run --nnodes=2 --node_rank=R
--master_addr=... --nproc_per_node=1 -m kchain.runtime.launch CONFIG` on each, gloo on the CPU.

The launcher sees it is a rank already and starts none; each node has its own working folder and
the state is at one path both read (the state sink). A real SIGKILL of every rank, then both nodes
start again on fresh, empty working folders: the resume must match the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kchain.common import checkpoint_files, layout, sink
from kchain.common.checkpoint_files import CheckpointInvalid

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
TOTAL = 8
TIMEOUT_S = 240  # a hung node fails the test instead of hanging CI; never a speed bound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepared(where: Path, gpus: int) -> Path:
    where.mkdir(parents=True)
    cfg = where / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "ddp", "entry": "ddp_job:main", "params": {"steps": TOTAL, "dropout": 0.3},
        "fingerprint": "f00d", "kchain_version": "0.1.0",
        "train": {"checkpoint_every": {"steps": 2}, "keep": 2, "heartbeat_s": 0, "gpus": gpus},
    }))
    return cfg


def node_env(root: Path, **extra: str) -> dict[str, str]:
    drop = ("KCHAIN_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "KAGGLE_KERNEL_RUN_TYPE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), PYTHONUNBUFFERED="1",
               **extra)
    return env


def two_nodes(where: Path, bucket: Path, fault: str = "") -> list[int]:
    """Both nodes' torchrun, each with its own KCHAIN_ROOT (an empty machine), run to their end."""
    port, procs = free_port(), []
    cfg = prepared(where, gpus=1)
    for node in (0, 1):
        env = node_env(where / f"node{node}", KCHAIN_STATE_SINK=str(bucket), KCHAIN_FAULT=fault)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
             "--master_addr=127.0.0.1", f"--master_port={port}", "--nproc_per_node=1", "--max-restarts=0",
             "--monitor-interval=0.1", "-m", "kchain.runtime.launch", str(cfg)],
            env=env, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert all(c in (0, -signal.SIGKILL, 1) for c in codes), "\n".join(outs)
    return codes


def kdir(where: Path, node: int) -> Path:
    return where / f"node{node}" / layout.WORKING_DIR / layout.KCHAIN_DIR


def trace(where: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (kdir(where, 0) / layout.METRICS).read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def verifies(copy: Path) -> bool:
    try:
        checkpoint_files.verify(copy)
        return True
    except CheckpointInvalid:
        return False


@pytest.mark.slow
def test_two_nodes_under_an_outer_torchrun_resume_from_the_sink_bit_exact(tmp_path):
    # The uninterrupted run: the same 2 ranks started by kchain's own launcher on one machine (cheaper
    # than two more torchruns, and the same arithmetic: two nodes of one rank are two ranks).
    reference = tmp_path / "reference"
    done = subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(prepared(reference, gpus=2))],
                          env=node_env(reference / "node0"), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    ref = trace(reference)
    assert [s for s, _ in ref] == list(range(1, TOTAL + 1))

    bucket = tmp_path / "bucket"
    codes = two_nodes(tmp_path / "killed", bucket, "kill_at_step=5")
    assert -signal.SIGKILL in codes
    # The newest copy published whole and intact: 4, or 2 when the kill beat step 4's publish (on a loaded
    # machine even step 2's: then the bucket is empty and the next run starts fresh, which must match as
    # well). A kill in the middle of a manifest's plain write leaves a copy that does not verify: not it.
    whole = [d for d in (sink.candidates(bucket) if bucket.exists() else []) if verifies(d)]
    published = sink.step_of(whole[0]) if whole else None
    assert published in (None, 2, 4)

    resumed = tmp_path / "resumed"  # two fresh machines: nothing local, the bucket alone
    assert two_nodes(resumed, bucket) == [0, 0]
    got = json.loads((kdir(resumed, 0) / layout.SUMMARY).read_text())
    assert (got["status"], got["resumed_from"]) == ("finished", published)
    assert (got["world_size"], trace(resumed)) == (2, ref)
    pointer = sink.read_pointer(bucket)
    assert pointer is not None and pointer["step"] == TOTAL
    assert not (kdir(resumed, 1) / layout.CHECKPOINTS_DIR).exists()  # rank 0 alone writes, on its node
