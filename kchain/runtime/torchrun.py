"""The launcher's half of several ranks: how many, starting them, and the ranks' error files.

Standard library only: the launcher of a multi-rank session starts its ranks itself, as torchrun's
agent would, without importing torch (torchrun cost about 2 s of CPU a session that only its ranks
need). `distributed.py` is the ranks' half (the rendezvous, the process group, DDP, sharding) and
re-exports these names. Under an outer torchrun (several machines) the launcher is one rank and
starts nothing (`in_ranks`).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kchain.common import atomic, layout
from kchain.common.config import RuntimeConfig
from kchain.runtime import forkranks

RANK_ERRORS_DIR = "rank-errors"  # under the kchain dir: one JSON per rank that failed
KAGGLE_SESSION_ENV = "KAGGLE_KERNEL_RUN_TYPE"  # set in every Kaggle notebook session
# After one rank failed, how long the others get to leave on SIGTERM before SIGKILL (torchrun: 30 s).
RANK_GRACE_S = 30
# After a rank failed with a code, how long the launcher waits before it reads which ranks a signal ended:
# a process's sockets close in its exit a moment before its exit status can be read.
KILL_SETTLE_S = 0.2


class NoAccelerator(Exception):
    """A Kaggle session without the GPUs the job asked for."""


@dataclass(frozen=True)
class RanksEnded:
    """How the ranks ended: `code` 0 (every rank well) or 1 (as torchrun), and `killed`: (rank, signal
    number) of each rank a signal from outside ended (the OOM killer, a segfault), seen when the first
    rank failed, before the launcher signalled any (a peer's error after it is a consequence)."""

    code: int
    killed: tuple[tuple[int, int], ...] = ()


def signal_name(signum: int) -> str:
    """SIGKILL for 9; `signal 99` for a number this system does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def in_ranks(env) -> bool:
    """True inside a rank that torchrun started."""
    return "RANK" in env and "WORLD_SIZE" in env


def _on_kaggle(env) -> bool:
    smoke = env.get(layout.SMOKE_ENV) == "1"
    return bool(env.get(KAGGLE_SESSION_ENV)) and not smoke and env.get(layout.ACCELERATOR_CHECK_ENV) != "off"


def _on_a_target(env) -> bool:
    """A SkyPilot or Slurm job (its state sink set): the engine was asked for GPUs, so none visible is a refusal."""
    smoke = env.get(layout.SMOKE_ENV) == "1"
    return bool(env.get(layout.STATE_SINK_ENV)) and not smoke and env.get(layout.ACCELERATOR_CHECK_ENV) != "off"


def local_ranks(env) -> int | None:
    """The ranks a local run starts as Kaggle would give them (KCHAIN_RANKS: smoke, rehearse), or None."""
    local = env.get(layout.RANKS_ENV)
    return int(local) if local and not _on_kaggle(env) else None


def plan_ranks(config: RuntimeConfig, env, cuda_count: int | None = None) -> tuple[int, str]:
    """(number of ranks, why) for this machine; raises NoAccelerator when Kaggle gave too little."""
    on_kaggle = _on_kaggle(env)
    local = local_ranks(env)
    if local is not None:  # smoke / rehearse: the ranks Kaggle would give, on this machine (no torch here)
        return local, f"{local} ranks, as on Kaggle ({layout.RANKS_ENV})"
    if cuda_count is None:
        import torch  # the GPUs this machine has: only now (a local run's launcher imports it only to fork its CPU ranks)

        cuda_count = torch.cuda.device_count()
    asked, accelerator = config.train.gpus, config.kaggle.accelerator
    if _on_a_target(env) and accelerator == "gpu" and cuda_count == 0:
        raise NoAccelerator("the job's target asked for GPUs (skypilot.accelerators or slurm.gpus) and this machine "
                            "shows none: stopping instead of training on the CPU; check the engine's allocation")
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


def _rank_env(env, rank: int, n: int, rendezvous: str) -> dict:
    """What torchrun gives rank RANK of N on one machine, with kchain's rendezvous folder instead of a port.

    RANK/WORLD_SIZE (torch), LOCAL_RANK (one GPU each), GROUP_RANK/LOCAL_WORLD_SIZE/ROLE_* (Lightning
    and accelerate recognise a torchrun worker by them). MASTER_PORT is left for rank 0 to choose
    (distributed.py): a port picked here and bound by rank 0 seconds later could be taken in between.
    """
    out = {k: v for k, v in env.items() if k not in ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}
    one = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_RANK": 0,
           "GROUP_WORLD_SIZE": 1, "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": n,
           "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
           layout.RENDEZVOUS_ENV: rendezvous}
    out.update({k: str(v) for k, v in one.items()})
    out.setdefault("OMP_NUM_THREADS", "1")  # N ranks on a few cores: no thread oversubscription
    return out


def launch_ranks(n: int, config_path: str, env, fork: Callable[[], None] | None = None) -> RanksEnded:
    """Run N ranks as children of this process; code 0 when every rank ended well, else 1 (as torchrun).

    What torchrun's agent did for kchain, without importing torch (about 2 s of CPU a session): each
    rank leads a session of its own (so a kill fault takes a rank with its DataLoader workers), a
    SIGTERM or SIGINT to the launcher reaches every rank, and one rank that fails ends the others:
    SIGTERM, then SIGKILL after RANK_GRACE_S. Each rank is `python -m kchain.runtime.launch`, or,
    given `fork` (what a rank runs, in a launcher that imported torch: forkranks.py), a fork of this one.
    """
    rendezvous = tempfile.mkdtemp(prefix="kchain-ranks-")
    try:
        if fork is not None:
            procs: list = [forkranks.start(_rank_env(env, r, n, rendezvous), fork) for r in range(n)]
        else:
            cmd = [sys.executable, "-u", "-m", "kchain.runtime.launch", config_path]
            procs = [subprocess.Popen(cmd, env=_rank_env(env, r, n, rendezvous), start_new_session=True)
                     for r in range(n)]
        return _watch_ranks(procs)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def _watch_ranks(procs: list) -> RanksEnded:
    """_watch with SIGTERM and SIGINT passed on to every rank while it waits."""
    forwarded: set[int] = set()
    return _forwarding(procs, lambda: _watch(procs, forwarded), forwarded)


def _forwarding(procs: list, wait: Callable[[], RanksEnded], forwarded: set[int]) -> RanksEnded:
    def forward(signum, frame):
        forwarded.add(signum)  # a rank this signal ends was not killed from outside
        for p in procs:
            _signal(p, signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _signal(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _watch(procs: list[subprocess.Popen], forwarded: set[int]) -> RanksEnded:
    """Wait for every rank; the first failure (any code but 0 and 'saved, not done') ends the rest.

    The ranks a signal ended are read at that first failure, before the launcher signals any: a rank
    SIGKILLed from outside is dead (its code read) before a peer notices the broken connection, since
    the peer notices it through that death, so the kill is named and not the peer's error."""
    ok = (0, layout.EXIT_SAVED_NOT_DONE)
    while True:
        codes = [p.poll() for p in procs]
        if any(c is not None and c not in ok for c in codes):
            if not any(c is not None and c < 0 for c in codes):
                # A peer may see the dead rank's sockets close a moment before its exit status can be read.
                time.sleep(KILL_SETTLE_S)
                codes = [p.poll() for p in procs]
            killed = tuple((rank, -c) for rank, c in enumerate(codes)
                           if c is not None and c < 0 and -c not in forwarded)
            for p in procs:
                _signal(p, signal.SIGTERM)
            end = time.monotonic() + RANK_GRACE_S
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.05)
            for p in procs:
                _signal(p, signal.SIGKILL)
                p.wait()
            return RanksEnded(1, killed)
        if all(c is not None for c in codes):
            return RanksEnded(0)
        time.sleep(0.05)


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
