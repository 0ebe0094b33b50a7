"""What the runtime prints: `[kchain] ...` lines, rank-aware, and sizes in words.

Standard library only: the checkpoint search (checkpoint_files) narrates with these, and it must
stay importable without torch.
"""

from __future__ import annotations

import os
import sys

GB = 1e9


def gb(n: float) -> str:
    if n >= 0.1 * GB:
        return f"{n / GB:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} KB"


def _rank() -> str:
    """kchain ddp: under torchrun only rank 0 narrates; the other ranks' warnings carry their rank. Read at
    each line, not at import: a forked rank imported this module in its launcher (runtime/forkranks.py)."""
    return os.environ.get("RANK", "0") if os.environ.get("WORLD_SIZE", "1") != "1" else "0"


def emit(text: str) -> None:
    """One whole line in one write: the checkpoint writer's thread warns while the training thread
    prints its heartbeat, and print()'s separate write of the newline lets them interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def say(msg: str) -> None:
    if _rank() == "0":
        emit(f"[kchain] {msg}")


def warn(msg: str) -> None:
    rank = _rank()
    emit(f"[kchain{'' if rank == '0' else f' rank {rank}'}] WARNING: {msg}")
