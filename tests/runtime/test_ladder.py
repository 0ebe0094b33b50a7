"""The out-of-memory ladder (train.micro_batch: auto), driven by the injected fault on this CPU.

The fault raises the same torch.OutOfMemoryError at the first step while a micro-batch is above the chosen
size; the real CUDA out-of-memory path runs in bench/gpu_check.py on a GPU machine (docs/runtime.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kchain.common import layout
from kchain.runtime import ladder

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
TOTAL = 10
CHILD_TIMEOUT_S = 120  # a hung child fails the test instead of hanging CI


def launch(root: Path, batch: int, accumulate: int, micro: str, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "tiny", "entry": "tiny_job:main", "fingerprint": "f00d", "kchain_version": "0.1.0",
        # seed_in_main False: main draws its model's initial weights from the global RNGs as it finds them, so a retry
        # down the ladder must find them as the first attempt did
        "params": {"d_model": 16, "steps": TOTAL, "workers": 0, "batch": batch, "accumulate": accumulate,
                   "dropout": 0.2, "lr": 0.01, "seed_in_main": False},
        "train": {"checkpoint_every": {"steps": 3}, "keep": 2, "heartbeat_s": 0, "micro_batch": micro},
    }))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
                     PYTHONUNBUFFERED="1", **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def trace(root: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.METRICS).read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_the_ladder_halves_until_it_fits_keeps_the_effective_batch_and_resumes_with_the_size_that_fitted(tmp_path):
    # The reference: micro-batch 4 x 4 accumulations written by hand (effective batch 16).
    ref = launch(tmp_path / "ref", batch=4, accumulate=4, micro="off")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    # Batch 16 does not "fit" above 4: two halvings, then the same training, bit for bit.
    fault = "oom_above=4"
    died = launch(tmp_path / "run", batch=16, accumulate=1, micro="auto", KCHAIN_FAULT=f"{fault},kill_at_step=7")
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    rungs = [line for line in died.stdout.splitlines() if "out of memory at micro-batch" in line]
    assert rungs == [
        "[kchain] out of memory at micro-batch 16: halving it to 8 and accumulating x2; the effective batch stays 16",
        "[kchain] out of memory at micro-batch 8: halving it to 4 and accumulating x4; the effective batch stays 16",
    ]
    ckpt = sorted((tmp_path / "run" / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).iterdir())[-1]
    assert json.loads((ckpt / layout.MANIFEST).read_text())[ladder.MANIFEST_KEY] == 2
    # The next session starts with the size that fitted: no out-of-memory error, an exact resume.
    done = launch(tmp_path / "run", batch=16, accumulate=1, micro="auto", KCHAIN_FAULT=fault)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "out of memory" not in done.stdout and "[kchain] resumed from step" in done.stdout
    got, want = trace(tmp_path / "run"), trace(tmp_path / "ref")
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, TOTAL + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) == 0.0


def test_without_the_ladder_the_out_of_memory_error_stands(tmp_path):
    done = launch(tmp_path, batch=16, accumulate=1, micro="off", KCHAIN_FAULT="oom_above=4")
    assert done.returncode == 1
    s = json.loads((tmp_path / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())
    assert s["status"] == "crashed" and s["error"]["type"] == "OutOfMemoryError"


def test_next_rung_refuses_what_it_cannot_do():
    assert ladder.next_rung([16], 0, True, False, 1) is not None
    assert ladder.next_rung([6], 1, True, False, 1) is None  # 6 does not halve twice
    assert ladder.next_rung([16], 0, True, True, 1) is None  # a step already ran: not the first step
    assert ladder.next_rung([16], 0, True, False, 2) is None  # several ranks: not supported
    assert ladder.next_rung([16], 0, False, False, 1) is None  # train.micro_batch is off
