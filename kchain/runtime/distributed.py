"""Several ranks (one per GPU), made safe for sessions that die.

The pieces, each small:
- `plan_ranks`, `launch_ranks` and the ranks' error files are the launcher's half, in `torchrun.py`
  (standard library only): how many ranks the job gets, with the granted-accelerator check, and N
  processes of `python -m kchain.runtime.launch CONFIG` with torchrun's environment.
- `Ranks`: the process group seen by one rank (rank, world_size, is_main, its device) and the
  collectives the runtime needs: the per-step agreed flag (stop reason and "save now"), gathering
  every rank's private state for the checkpoint, a barrier, a mean for run.log.
- `shard`: which rows of a global batch a rank takes, so N ranks of micro-batch b see exactly what
  one rank of batch N*b sees.

Errors on one rank are not agreed through a collective (the failing rank may be anywhere in its
step, e.g. inside DDP's gradient all-reduce): the rank records its error in a file and exits, the
launcher ends the others at once, and the launcher's parent names the first error in the summary.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kchain.common import atomic, faults, layout
from kchain.common.checkpoint_files import ResumeError
from kchain.common.summary import StatusName
from kchain.runtime.torchrun import (  # noqa: F401  (the launcher's half, standard library only; re-exported)
    KAGGLE_SESSION_ENV,
    RANK_ERRORS_DIR,
    NoAccelerator,
    clear_errors,
    first_error,
    in_ranks,
    launch_ranks,
    plan_ranks,
    record_error,
)

# Stop reasons in the agreed flag, ordered: the largest one any rank raises wins.
STOP_CODES: dict[StatusName | None, int] = {None: 0, "stopped": 1, "deadline": 2, "interrupted": 3}
STOP_NAMES = {v: k for k, v in STOP_CODES.items()}
# A collective that waits longer than this has a dead or stuck peer: fail instead of hanging to the
# 12-hour kill. Generous: a checkpoint gather of a big model may take minutes on a slow disk.
GROUP_TIMEOUT_S = 600


def _rendezvous(env, rank: int, world_size: int, timeout: datetime.timedelta):
    """kchain's launcher: rank 0 binds a store on a port the system picks (none can be taken before it is
    bound) and leaves the port in the rendezvous folder; the others wait for it there. None under an
    outer torchrun. MASTER_ADDR/MASTER_PORT are then set as torchrun sets them, for code that reads them."""
    folder = env.get(layout.RENDEZVOUS_ENV)
    if not folder:
        return None
    path = Path(folder) / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
        atomic.write_text(path, str(store.port))
        port = store.port
    else:
        end = time.monotonic() + timeout.total_seconds()
        while not path.exists():
            if time.monotonic() > end:
                raise RuntimeError(f"rank {rank}: rank 0 never opened the group's store ({path})")
            time.sleep(0.02)
        port = int(path.read_text())
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    return store


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
            # One GPU each for every rank on this machine, or all of them on the CPU: a rank that took NCCL
            # beside one that took gloo (2 ranks, 1 GPU) would never meet it in a collective.
            local_world = int(env.get("LOCAL_WORLD_SIZE") or self.world_size)
            use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
            self.backend = "nccl" if use_cuda else "gloo"
            if use_cuda:
                torch.cuda.set_device(self.local_rank)
            timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
            store = _rendezvous(env, self.rank, self.world_size, timeout)
            if store is None:  # an outer torchrun: its env:// rendezvous
                dist.init_process_group(self.backend, timeout=timeout)
            else:
                dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                        timeout=timeout)
            self.pids = self.all_gather(os.getpid())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def device(self, default: torch.device, why: str) -> tuple[torch.device, str]:
        """The rank's device and why: its own GPU under NCCL, the CPU under gloo (ranks standing in for
        GPUs this machine has too few of), else what the runtime chose."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank), why
        if self.backend == "gloo" and default.type != "cpu":
            return torch.device("cpu"), (f"{self.world_size} ranks and {torch.cuda.device_count()} CUDA device(s) "
                                         "here: every rank on the CPU")
        return default, why

    def describe(self) -> str:
        where = "CUDA" if self.backend == "nccl" else "CPU"
        return f"{self.world_size} ranks ({self.backend}, {where})" if self.active else "1 rank"

    def _tensor(self, values: list[float], dtype=torch.int64) -> torch.Tensor:
        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        return torch.tensor(values, dtype=dtype, device=device)

    def agree(self, stop: StatusName | None, save: bool) -> tuple[StatusName | None, bool]:
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
        """The whole session dies at once (a fault for tests): the launcher, every rank with its workers, this one."""
        faults.die([os.getppid(), *(p for p in self.pids if p != os.getpid())] if self.active else [])

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks, device: torch.device, options: dict | None = None) -> torch.nn.Module:
    """The model on the rank's device, in DistributedDataParallel when there are several ranks;
    `options`: DistributedDataParallel's own arguments (unused with one rank: no DDP)."""
    options = dict(options or {})
    taken = sorted(set(options) & {"device_ids", "output_device", "process_group", "module"})
    if taken:
        raise TypeError(f"run.wrap(..., {', '.join(f'{k}=...' for k in taken)}): kchain chooses the device and the "
                        "group of each rank; leave them out")
    model = model.to(device)
    if not ranks.active:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **options)


def unwrap(obj):
    """The module inside a DDP wrapper: checkpoints hold the same keys with 1 rank or N."""
    return obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


def check_world_size(ckpt: Path, manifest: dict, world_size: int) -> None:
    """Refuse a checkpoint saved by a different number of ranks: the data order would change."""
    saved = int(manifest.get("world_size", 1))
    if saved != world_size:
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
