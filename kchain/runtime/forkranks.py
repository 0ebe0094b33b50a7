"""Local CPU ranks from one interpreter: torch is imported once, then each rank is a fork of it (opt-in).

Off by default (KCHAIN_FORK_RANKS=1 turns it on): in one 2-rank smoke's reference run under heavy load,
rank 1 was gone and rank 0 waited in a collective for good; the cause is not found yet.

`python -m kchain.runtime.forkranks N CONFIG RENDEZVOUS`, started by the launcher for the gloo ranks of
a local run (`kchain smoke`, `kchain rehearse`, the emulator's sessions: KCHAIN_RANKS on this machine).
Each rank of a 2-rank session otherwise spends about 4 s of CPU importing torch and torch._dynamo (the
first optimizer imports it: torch/_compile.py) before its first step; forked from a process that did it
once, the ranks start with both in memory, and a 2-rank smoke costs a third less CPU. Nothing else
changes: each rank leads its own session (a kill fault takes it with its DataLoader workers), gets
torchrun's environment, and is watched as the launcher watches spawned ranks (torchrun.watch: one that
fails ends the others; SIGTERM and SIGINT reach every rank).

Only where it is safe: a CPU process that has run no tensor operation (so no OpenMP pool exists to be
forked half-alive) and has no CUDA context. On Kaggle, with GPUs, the launcher spawns each rank
(torchrun.launch_ranks), never this.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import traceback

from . import launch, torchrun  # launch first: standard library, and it sets MKL_DYNAMIC/OMP_DYNAMIC


class Forked:
    """A forked rank as the watcher sees a subprocess.Popen: poll, send_signal, wait, returncode."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        return self._reap(0)

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


def _run_rank(rank: int, n: int, config_path: str, rendezvous: str) -> None:
    """In the child: become rank RANK of N and run the launcher's rank, then leave as a process would."""
    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun's ranks (faults.lead, kill_all)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        mine = torchrun.rank_env(os.environ, rank, n, rendezvous)
        for key in set(os.environ) - set(mine):  # what rank_env leaves out (a port chosen early)
            del os.environ[key]
        os.environ.update(mine)
        code = launch.main(["kchain.runtime.launch", config_path])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's own crash path records its errors; this is a last word
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's exit runs (the runtime's, torch's, the code's)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def main(argv: list[str]) -> int:
    n, config_path, rendezvous = int(argv[1]), argv[2], argv[3]
    # What every rank imports before its first step; no tensor is made here (fork safety, above).
    # (launch, imported above, fixed MKL's and OpenMP's thread counts before torch loads them.)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    importlib.import_module(f"{__package__}.run")  # loaded for the ranks; this process builds no Run

    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, n, config_path, rendezvous)
        ranks.append(Forked(pid))
    return torchrun.watch_ranks(ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
