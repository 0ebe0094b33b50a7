"""The exit-code contract a supervisor acts on (SkyPilot, Slurm --requeue, a shell loop, the notebook).

One real `python -m kchain.runtime.launch` per code: 75 after a real SIGTERM (its checkpoint in the
state sink before the exit), 0 for the run that resumes it on an empty working folder, 1 for the
resume guard's stop once the sink's newest copy is damaged, 69 for a Kaggle session without its GPU;
and the code a node gives after an outer torchrun (`--exit-code`), read from its summary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kchain.common import layout, sink
from kchain.common.summary import STATUSES, Status
from kchain.runtime.launch import exit_code

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
DOCS = REPO / "docs" / "runtime.md"
TIMEOUT_S = 120  # a hung child fails the test instead of hanging CI; never a speed bound


def env_for(root: Path, **extra: str) -> dict[str, str]:
    drop = ("KCHAIN_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "KAGGLE_KERNEL_RUN_TYPE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), PYTHONUNBUFFERED="1",
               **extra)
    return env


def prepared(root: Path, **train) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cfg.json").write_text(json.dumps({
        "job": "tiny", "entry": "tiny_job:main", "fingerprint": "f00d", "kchain_version": "0.1.0",
        "params": {"d_model": 16, "steps": 60, "workers": 0},
        "train": {"checkpoint_every": {"steps": 1000}, "keep": 2, "heartbeat_s": 0, **train},
    }))
    return [sys.executable, "-m", "kchain.runtime.launch", str(root / "cfg.json")]


def launch(root: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(prepared(root), env=env_for(root, **extra), cwd=root, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def summary(root: Path) -> dict:
    return json.loads((root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())


def test_every_status_has_the_documented_exit_code():
    row = re.compile(r"^\| `(\d+)` \| (.*?) \|")
    documented = {}
    for line in DOCS.read_text().splitlines():
        if m := row.match(line):
            documented.update({s: int(m.group(1)) for s in re.findall(r"`([a-z_]+)`", m.group(2))})
    assert documented == {s: exit_code(s) for s in STATUSES if s != Status.RUNNING}
    assert exit_code(Status.RUNNING) == 1 and exit_code(None) == 1
    # The notebook's launch cell ends the session well for "saved, not done", as for 0.
    template = (REPO / "kernel_templates" / "notebook.ipynb.j2").read_text()
    assert f"if code not in (0, {layout.EXIT_SAVED_NOT_DONE}):" in template


@pytest.mark.slow
def test_sigterm_75_resume_0_guard_1_no_gpu_69(tmp_path):
    bucket = tmp_path / "bucket"
    first = tmp_path / "first"
    # 75: a real SIGTERM while it trains (each step stalled 0.2 s); the stop's checkpoint reaches the sink first.
    with subprocess.Popen(prepared(first), env=env_for(first, KCHAIN_FAULT="stall_step=0.2",
                                                       KCHAIN_STATE_SINK=str(bucket), KCHAIN_ACCELERATOR_CHECK="off"),
                          stdout=subprocess.PIPE, text=True, cwd=first) as child:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("[kchain] step 2/"):
                child.send_signal(signal.SIGTERM)
                break
        rest = child.stdout.read()
        assert child.wait(timeout=TIMEOUT_S) == layout.EXIT_SAVED_NOT_DONE, rest
    stopped = summary(first)
    assert stopped["status"] == "interrupted" and 2 <= stopped["step"] < 60
    pointer = sink.read_pointer(bucket)
    assert pointer is not None and pointer["step"] == stopped["step"]
    # After an outer torchrun (which returns 0 or 1): the node of rank 0 exits with its summary's code,
    # another node (no summary) with torchrun's.
    for root, launcher, want in ((first, 1, layout.EXIT_SAVED_NOT_DONE), (tmp_path / "node1", 0, 0)):
        after = subprocess.run([sys.executable, "-m", "kchain.runtime.launch", "--exit-code", str(launcher)],
                               env=env_for(root), capture_output=True, text=True, timeout=TIMEOUT_S)
        assert after.returncode == want, after.stdout + after.stderr

    # 0: a fresh machine (an empty working folder) resumes from the sink and finishes.
    second = tmp_path / "second"
    done = launch(second, KCHAIN_STATE_SINK=str(bucket), KCHAIN_ACCELERATOR_CHECK="off")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (summary(second)["status"], summary(second)["resumed_from"]) == ("finished", stopped["step"])
    pointer = sink.read_pointer(bucket)
    assert pointer is not None and pointer["step"] == 60

    # 1: the sink's newest copy is damaged; the older one verifies, but the pointer says 60: stop, never resume older.
    state = bucket / layout.checkpoint_name(60) / layout.STATE_FILE
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    third = tmp_path / "third"
    guarded = launch(third, KCHAIN_STATE_SINK=str(bucket), KCHAIN_ACCELERATOR_CHECK="off")
    assert guarded.returncode == 1, guarded.stdout + guarded.stderr
    error = summary(third)["error"]
    assert (error["type"], error["stage"]) == ("StateLost", "resume")
    assert f"says {layout.checkpoint_name(60)} (step 60) was published" in error["message"]
    assert "the newest that verifies is step" in error["message"] and "sha256 does not match" in error["message"]
    assert not (third / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).exists()

    # 69: a Kaggle GPU session that got no GPU.
    fourth = tmp_path / "fourth"
    no_gpu = launch(fourth, KAGGLE_KERNEL_RUN_TYPE="Batch")
    assert no_gpu.returncode == layout.EXIT_NO_ACCELERATOR, no_gpu.stdout + no_gpu.stderr
    assert summary(fourth)["status"] == "no_accelerator"
