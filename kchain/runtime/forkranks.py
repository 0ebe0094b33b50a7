"""Local CPU ranks forked from their launcher after one torch import, instead of each importing it.

A local run of several ranks (`kchain smoke`, `kchain rehearse`, the local Kaggle's sessions) starts
its ranks as gloo processes on the CPU. Spawned, each one imports torch and the runtime again: some
2-4 s of CPU a rank before its first step, most of what a short rank costs. Here the launcher imports
them once and forks each rank from itself, so the ranks start with them in memory. Each rank is still
a process of its own that leads its own session, gets torchrun's environment, runs exactly what a
spawned rank runs (launch.py), and is watched as a spawned one is (torchrun._watch).

Only where forking is safe, else the ranks are spawned as before:
- Linux, and a torch that can reach no GPU (a CPU build, or no NVIDIA device on the machine): the
  ranks run on the CPU, and no CUDA context exists to be forked. On Kaggle's GPUs ranks are spawned.
- One thread in the launcher when it forks (counted from /proc), and ranks of one CPU thread each
  (OMP_NUM_THREADS unset or 1: the smoke's choice below 8 cores). torch's import starts a thread of its
  OpenMP pool when it may use more, and a fork must not copy a pool half alive, so a launcher whose ranks
  get more threads spawns them without importing torch at all. No tensor operation has run before a fork.
- KCHAIN_FORK_RANKS is not "0" (that spawns them, as on Kaggle).

What the launcher imports before it forks reads nothing of a rank's environment at its import (kchain's
own modules read RANK when they print, not at import); the job's frameworks, some of which do, are
imported by each rank after the fork, as in a spawned one.

A forked rank leaves with `os._exit` after the exit handlers (launch._quick_teardown), never through the
interpreter's teardown or a last collection: that collection frees the DDP's gloo group with the GIL held
while a gloo thread waits for it, the likely cause of the hang an earlier forked version showed once
(docs/runtime.md, "Two GPUs").

One difference from spawned ranks remains: the forks share the launcher's string-hash seed, where
spawned ranks draw one each (when PYTHONHASHSEED is unset). Every run still draws its own, so the
smoke's reference and resume still differ in it, and an order taken from a set that changes the values
still fails the resume check; an order that differs only between two ranks of one run is not seen here.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from kchain.common import layout

NOTE = "forked from this launcher's torch import"


class Forked:
    """A forked rank as the watcher sees a subprocess.Popen: pid, poll, wait, send_signal, returncode."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        code = self._reap(0)
        assert code is not None
        return code

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


def alone() -> bool:
    """Whether this process runs one thread (counted from /proc: the native ones too)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False  # unknown: never fork


def _gpu_reachable(torch) -> bool:
    if torch.version.hip is not None:
        return True  # ROCm: do not guess
    return torch.version.cuda is not None and Path("/dev/nvidiactl").exists()


def prepare(env) -> bool:
    """Import torch in this launcher when its ranks may be forked; True when they may (then `alone()`
    says whether they still may, once the launcher imported the rest of what its ranks import)."""
    if env.get(layout.FORK_RANKS_ENV) == "0" or sys.platform != "linux" or not alone():
        return False
    if (env.get("OMP_NUM_THREADS") or "1") != "1":
        return False  # torch's import would start its OpenMP threads here: never forked (and never imported)
    env.setdefault("OMP_NUM_THREADS", "1")  # what each rank gets (torchrun._rank_env), read at torch's import
    import torch

    return not _gpu_reachable(torch)


def start(env: dict[str, str], rank_main: Callable[[], None]) -> Forked:
    """Fork one rank: the child leads its own session, takes `env` as its whole environment, runs
    `rank_main` (which leaves the process itself), and never returns into the launcher's frames."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)
    try:
        os.setsid()  # as a spawned rank (start_new_session): a kill fault takes it with its workers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(line_buffering=True)  # as a spawned rank's `python -u`
        rank_main()  # leaves by os._exit
    except BaseException:  # noqa: BLE001 - never unwind into the launcher's frames (its finally blocks)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
