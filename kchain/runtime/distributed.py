"""Several ranks (one per GPU) through torchrun, made safe for sessions that die.

The pieces, each small:
- `plan_ranks`: how many ranks the job gets (train.gpus against what the machine has), and the
  granted-accelerator check: in a Kaggle session a job that asked for a GPU and sees none stops.
- `launch_ranks`: the launcher's parent runs `python -m torch.distributed.run --standalone
  --nproc_per_node=N -m kchain.runtime.launch CONFIG`; each rank then runs `main(run)`.
- `Ranks`: the process group seen by one rank (rank, world_size, is_main, its device) and the
  collectives the runtime needs: the per-step agreed flag (stop reason and "save now"), gathering
  every rank's private state for the checkpoint, a barrier, a mean for run.log.
- `shard`: which rows of a global batch a rank takes, so N ranks of micro-batch b see exactly what
  one rank of batch N*b sees.

Errors on one rank are not agreed through a collective (the failing rank may be anywhere in its
step, e.g. inside DDP's gradient all-reduce): the rank records its error in a file and exits, torchrun
ends the others at once, and the launcher's parent names the first error in the summary.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import death, layout

# Stop reasons in the agreed flag, ordered: the largest one any rank raises wins.
STOP_CODES = {None: 0, "stopped": 1, "deadline": 2, "interrupted": 3}
STOP_NAMES = {v: k for k, v in STOP_CODES.items()}
# A collective that waits longer than this has a dead or stuck peer: fail instead of hanging to the
# 12-hour kill. Generous: a checkpoint gather of a big model may take minutes on a slow disk.
GROUP_TIMEOUT_S = 600
RANK_ERRORS_DIR = "rank-errors"  # under the kchain dir: one JSON per rank that failed
KAGGLE_SESSION_ENV = "KAGGLE_KERNEL_RUN_TYPE"  # set in every Kaggle notebook session
ACCELERATOR_CHECK_ENV = "KCHAIN_ACCELERATOR_CHECK"  # "off": a CPU stand-in for Kaggle (the emulator)


class NoAccelerator(Exception):
    """A Kaggle session without the GPUs the job asked for."""


def in_ranks(env) -> bool:
    """True inside a rank that torchrun started."""
    return "RANK" in env and "WORLD_SIZE" in env


def plan_ranks(config: dict, env, cuda_count: int | None = None) -> tuple[int, str]:
    """(number of ranks, why) for this machine; raises NoAccelerator when Kaggle gave too little."""
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    asked = (config.get("train") or {}).get("gpus", "auto")
    accelerator = (config.get("kaggle") or {}).get("accelerator", "gpu")
    smoke = env.get(layout.SMOKE_ENV) == "1"
    on_kaggle = bool(env.get(KAGGLE_SESSION_ENV)) and not smoke and env.get(ACCELERATOR_CHECK_ENV) != "off"
    if on_kaggle and accelerator == "gpu":
        want = 1 if asked == "auto" else int(asked)
        if cuda_count < want:
            got = f"{cuda_count} GPU{'s' if cuda_count != 1 else ''}" if cuda_count else "no GPU"
            raise NoAccelerator(
                f"asked for GPU T4 x{2 if asked == 'auto' else want} (train.gpus: {asked}), got {got}: "
                "the weekly GPU quota may be spent or the kernel's accelerator setting was lost; "
                "stopping instead of training on the CPU"
            )
    local = env.get(layout.RANKS_ENV)
    if local and not on_kaggle:  # smoke / rehearse: the ranks Kaggle would give, on this machine
        n = int(local)
        if cuda_count >= n:
            return n, f"{n} ranks, as on Kaggle ({layout.RANKS_ENV})"
        return n, f"{n} ranks, as on Kaggle: {n} CPU ranks with gloo ({layout.RANKS_ENV})"
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


class Ranks:
    """One rank's view of the group; with world_size 1 every collective is a no-op."""

    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.world_size = int(env.get("WORLD_SIZE", 1)) if in_ranks(env) else 1
        self.rank = int(env.get("RANK", 0)) if self.world_size > 1 else 0
        self.local_rank = int(env.get("LOCAL_RANK", self.rank)) if self.world_size > 1 else 0
        self.backend: str | None = None
        self.pids: list[int] = [os.getpid()]
        if self.world_size > 1:
            use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > self.local_rank
            self.backend = "nccl" if use_cuda else "gloo"
            if use_cuda:
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
            self.pids = self.all_gather(os.getpid())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def device(self, default: torch.device) -> torch.device:
        """The rank's device: its own GPU under NCCL, else what the runtime chose."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return default

    def describe(self) -> str:
        where = "CUDA" if self.backend == "nccl" else "CPU"
        return f"{self.world_size} ranks ({self.backend}, {where})" if self.active else "1 rank"

    def _tensor(self, values: list[float], dtype=torch.int64) -> torch.Tensor:
        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        return torch.tensor(values, dtype=dtype, device=device)

    def agree(self, stop: str | None, save: bool) -> tuple[str | None, bool]:
        """One small all-reduce per step: (the strongest stop reason of any rank, any rank due to save)."""
        if not self.active:
            return stop, save
        t = self._tensor([STOP_CODES[stop], int(save)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        code, any_save = t.tolist()
        return STOP_NAMES[int(code)], bool(any_save)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """The mean of each number over ranks (every rank must call it with the same keys)."""
        if not self.active or not values:
            return values
        keys = sorted(values)
        t = self._tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return {k: v / self.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    def all_gather(self, obj) -> list:
        if not self.active:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather(self, obj) -> list | None:
        """Every rank's obj on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        out: list | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def kill_all(self) -> None:
        """The whole session dies at once (a fault for tests): torchrun, every rank with its workers, this one."""
        death.die([os.getppid(), *(p for p in self.pids if p != os.getpid())] if self.active else [])

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """The model on the rank's device, in DistributedDataParallel when there are several ranks."""
    model = model.to(device)
    if not ranks.active:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(obj):
    """The module inside a DDP wrapper: checkpoints hold the same keys with 1 rank or N."""
    return obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


def check_world_size(ckpt: Path, manifest: dict, world_size: int) -> None:
    """Refuse a checkpoint saved by a different number of ranks: the data order would change."""
    saved = int(manifest.get("world_size", 1))
    if saved != world_size:
        from .checkpoint import ResumeError

        raise ResumeError(
            f"cannot resume from {ckpt}: it was saved by {saved} rank(s) and this session runs {world_size} "
            f"(each rank's data shard and RNG streams are in the checkpoint); set train.gpus: {saved} "
            "to resume exactly, or start fresh by detaching the state dataset"
        )


def shard(order: torch.Tensor, batch_size: int, index: int, rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s rows of global batch `index`: the global batch is world_size * batch_size rows of
    `order`, cut in rank order. A short last batch is padded from the epoch's start so every rank
    takes the same number of rows (as torch's DistributedSampler does)."""
    n = len(order)
    start = (index * world_size + rank) * batch_size
    return [int(order[i % n]) for i in range(start, start + batch_size)] if n else []


def batches_per_rank(n: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    """Global batches in an epoch (each rank takes one micro-batch of each)."""
    per = batch_size * world_size
    return n // per if drop_last else -(-n // per)


def record_error(kchain_dir: Path, rank: int, error: dict) -> None:
    """This rank's error, where the launcher's parent will find it (atomic)."""
    folder = kchain_dir / RANK_ERRORS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    tmp = folder / f"{layout.TMP_PREFIX}rank{rank}.json"
    tmp.write_text(json.dumps({**error, "rank": rank, "time": time.time()}))
    os.replace(tmp, path)


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
