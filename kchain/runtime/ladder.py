"""The out-of-memory ladder (`train.micro_batch: auto`).

A T4 has 15 GB; a micro-batch that does not fit crashes the session at step 1. With the ladder on,
an out-of-memory error before the first step of this process finishes is caught by the launcher:
it frees what it can, then runs `main(run)` again with every `run.loader` batch halved and every
`run.optimize` accumulation doubled, so the effective batch (batch x accumulate) is the same, and the
global RNGs put back as the first attempt found them (launch.py), so the retry draws what it would have. The
number of halvings is written in every checkpoint's manifest, so a later session starts with the
size that fitted, and a resume stays exact (the micro-batch schedule is part of the state).

On the CPU the ladder is exercised with the fault `KCHAIN_FAULT=oom_above=N`: the first step
raises torch.OutOfMemoryError while a run.loader batch is larger than N.
"""

from __future__ import annotations

import gc

import torch

MANIFEST_KEY = "micro_batch_halvings"
OutOfMemory = torch.OutOfMemoryError


def _factor(halvings: int) -> int:
    return 2**halvings


def injected(batch_sizes: list[int], oom_above: int | None) -> None:
    """KCHAIN_FAULT=oom_above=N: the out-of-memory error a too-large micro-batch gives on a GPU."""
    if oom_above is not None and any(b > oom_above for b in batch_sizes):
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by KCHAIN_FAULT=oom_above={oom_above}: micro-batch {max(batch_sizes)})"
        )


class Rung:
    """Where this attempt stands on the ladder: how many halvings, and the batch sizes asked for."""

    def __init__(self, enabled: bool, halvings: int):
        self.enabled = enabled  # train.micro_batch: auto
        self.halvings = halvings if enabled else 0
        self.asked: list[int] = []  # run.loader's batch sizes as the code asks for them

    def batch(self, size: int | None) -> int | None:
        """The micro-batch this rung gives a run.loader that asks for `size`."""
        if not self.enabled or not size:
            return size
        self.asked.append(size)
        return size // _factor(self.halvings)

    def accumulate(self, n: int) -> int:
        """The accumulation that keeps the effective batch: n times the halving factor."""
        return n * _factor(self.halvings) if self.enabled else n

    def next(self, stepped: bool, ranks: int) -> str | None:
        """After an out-of-memory error: the line announcing the next rung, or None (see next_rung)."""
        return next_rung(self.asked, self.halvings, self.enabled, stepped, ranks)


def next_rung(asked: list[int], halvings: int, enabled: bool, stepped: bool, ranks: int) -> str | None:
    """The line announcing one more halving, or None when the ladder cannot take it (then the
    out-of-memory error stands): off, a step already ran, several ranks, or a batch that no longer halves."""
    if not enabled or stepped or ranks > 1 or not asked:
        return None
    new = _factor(halvings + 1)
    if any(b % new for b in asked):
        return None
    now = ", ".join(str(b // _factor(halvings)) for b in asked)
    return (f"out of memory at micro-batch {now}: halving it to {', '.join(str(b // new) for b in asked)} "
            f"and accumulating x{new}; the effective batch stays {', '.join(str(b) for b in asked)}")


def free() -> None:
    """Give back what the failed attempt held before the next one allocates."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
