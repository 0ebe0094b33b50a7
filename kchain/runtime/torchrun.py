"""The launcher's half of several ranks: how many, torchrun, and the ranks' error files.

Standard library only, so the launcher of a multi-rank session starts torchrun without importing
torch itself (about 2 s of CPU per session that only its ranks need); `distributed.py` is the
ranks' half (the process group, DDP, sharding) and re-exports these names.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import atomic, layout
from .config import RuntimeConfig

RANK_ERRORS_DIR = "rank-errors"  # under the kchain dir: one JSON per rank that failed
KAGGLE_SESSION_ENV = "KAGGLE_KERNEL_RUN_TYPE"  # set in every Kaggle notebook session


class NoAccelerator(Exception):
    """A Kaggle session without the GPUs the job asked for."""


def in_ranks(env) -> bool:
    """True inside a rank that torchrun started."""
    return "RANK" in env and "WORLD_SIZE" in env


def plan_ranks(config: RuntimeConfig, env, cuda_count: int | None = None) -> tuple[int, str]:
    """(number of ranks, why) for this machine; raises NoAccelerator when Kaggle gave too little."""
    local = env.get(layout.RANKS_ENV)
    smoke = env.get(layout.SMOKE_ENV) == "1"
    on_kaggle = bool(env.get(KAGGLE_SESSION_ENV)) and not smoke and env.get(layout.ACCELERATOR_CHECK_ENV) != "off"
    if local and not on_kaggle:  # smoke / rehearse: the ranks Kaggle would give, on this machine (no torch here)
        return int(local), f"{local} ranks, as on Kaggle ({layout.RANKS_ENV})"
    if cuda_count is None:
        import torch  # the GPUs this machine has: only now, so the launcher of a local run never imports torch

        cuda_count = torch.cuda.device_count()
    asked, accelerator = config.train.gpus, config.kaggle.accelerator
    if on_kaggle and accelerator == "gpu":
        want = 1 if asked == "auto" else int(asked)
        if cuda_count < want:
            got = f"{cuda_count} GPU{'s' if cuda_count != 1 else ''}" if cuda_count else "no GPU"
            raise NoAccelerator(
                f"asked for GPU T4 x{2 if asked == 'auto' else want} (train.gpus: {asked}), got {got}: "
                "the weekly GPU quota may be spent or the kernel's accelerator setting was lost; "
                "stopping instead of training on the CPU"
            )
    if asked == "auto":
        n = max(1, cuda_count)
        return n, f"train.gpus: auto, {cuda_count} CUDA device(s) visible"
    n = int(asked)
    if cuda_count >= n:
        return n, f"train.gpus: {n}"
    return n, f"train.gpus: {n} on {cuda_count} CUDA device(s): {n} CPU ranks with gloo"


def launch_ranks(n: int, config_path: str, env) -> int:
    """Run N ranks under torchrun; returns its exit code (negative for a signal, as subprocess does)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        # Fail fast: one failed rank ends the others at once instead of restarting the group.
        "--max-restarts=0", "--monitor-interval=0.1", "-m", "kchain.runtime.launch", config_path,
    ]
    child_env = dict(env)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on a few cores: no thread oversubscription
    proc = subprocess.Popen(cmd, env=child_env)

    def forward(signum, frame):  # a SIGTERM to the launcher reaches every rank (torchrun forwards it)
        proc.send_signal(signum)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)


def record_error(kchain_dir: Path, rank: int, error: dict) -> None:
    """This rank's error, where the launcher's parent will find it (atomic)."""
    path = kchain_dir / RANK_ERRORS_DIR / f"rank{rank}.json"
    atomic.write_text(path, json.dumps({**error, "rank": rank, "time": time.time()}))


def first_error(kchain_dir: Path) -> dict | None:
    """The earliest error any rank recorded: the cause (later ones are usually its consequences)."""
    folder = kchain_dir / RANK_ERRORS_DIR
    found = []
    for p in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            found.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return min(found, key=lambda e: e.get("time", 0), default=None)


def clear_errors(kchain_dir: Path) -> None:
    folder = kchain_dir / RANK_ERRORS_DIR
    for p in folder.glob("*.json") if folder.is_dir() else []:
        p.unlink(missing_ok=True)
