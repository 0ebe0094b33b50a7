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


# kchain ddp: under torchrun only rank 0 narrates; the other ranks' warnings carry their rank.
_RANK = os.environ.get("RANK", "0") if os.environ.get("WORLD_SIZE", "1") != "1" else "0"


def emit(text: str) -> None:
    """One whole line in one write: the checkpoint writer's thread warns while the training thread
    prints its heartbeat, and print()'s separate write of the newline lets them interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def say(msg: str) -> None:
    if _RANK == "0":
        emit(f"[kchain] {msg}")


def warn(msg: str) -> None:
    emit(f"[kchain{'' if _RANK == '0' else f' rank {_RANK}'}] WARNING: {msg}")
