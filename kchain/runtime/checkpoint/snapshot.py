"""What a save captures in host memory: private copies of the state and the global RNGs.

The copy is the only part of a save that blocks training; checkpoint.Writer writes it to disk in a
thread. available_ram() is what the Run weighs a copy against (a state too large is streamed).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import torch

from kchain.common.say import warn

_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


class Snapshotter:
    """Private copies of the state: tensors detached and copied to host memory, the rest deep-copied.

    This is the only part of a save that blocks training; the write happens in a thread. With
    `keep`, the host buffers are kept and reused by the next snapshot (same key path, shape and
    dtype): copying into memory already touched avoids a page fault per 4 KiB, which dominates a
    fresh copy. Reuse is safe because a snapshot is taken only after the previous write finished.
    A kept buffer for a CUDA tensor is pinned (page-locked), and all its copies are queued without
    waiting and awaited once at the end: a copy from the GPU into pageable memory is synchronous and
    staged through a pinned buffer of the driver's (bench/gpu_check.py measures the two). Without
    `keep` (a large state: a second full host copy must not outlive its write), each copy is fresh
    pageable memory, and pinned memory is never held by a state too large to keep: torch caches
    freed pinned blocks for the process's lifetime. A tensor seen twice in one state (tied weights)
    is copied once, so torch.save writes it once.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._seen: dict[tuple, torch.Tensor] = {}
        self._pending: set[torch.device] = set()  # CUDA devices with copies in flight

    def take(self, obj, keep: bool = True):
        """A private host copy of obj, complete when this returns."""
        self._seen, self._pending = {}, set()
        try:
            return self._take(obj, (), keep)
        finally:
            for device in self._pending:
                torch.cuda.current_stream(device).synchronize()
            if not keep:
                self._buffers = {}

    def _take(self, obj, path: tuple, keep: bool):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.numel() and view in self._seen:
                return self._seen[view]  # tied weights: one copy, one storage in the file
            buf = self._buffers.get(path) if keep else None
            filled = False
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._pinned_like(t) if keep and t.is_cuda else None
                if buf is None:
                    # clone even on CPU: the optimizer updates its tensors in place while the writer runs.
                    buf, filled = t.to("cpu", copy=True), True
                if keep:
                    self._buffers[path] = buf
            if not filled and t.is_cuda and buf.is_pinned():
                buf.copy_(t, non_blocking=True)  # awaited once, at the end of take()
                self._pending.add(t.device)
            elif not filled:
                buf.copy_(t)  # from any device: a CUDA tensor comes back to the same host buffer
            self._seen[view] = buf
            return buf
        if type(obj) in _ATOMS:
            return obj  # immutable: sharing it is a copy
        if isinstance(obj, dict):
            return {k: self._take(v, (*path, k), keep) for k, v in obj.items()}
        if type(obj) is tuple and all(type(v) in _ATOMS for v in obj):
            return obj  # e.g. python's RNG state, 625 ints: no need to visit each one
        if type(obj) in (list, tuple):
            return type(obj)(self._take(v, (*path, i), keep) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    @staticmethod
    def _pinned_like(t: torch.Tensor) -> torch.Tensor | None:
        """Pinned host memory shaped as t, or None where it cannot be had (the OS's locked-memory limit)."""
        try:
            return torch.empty_like(t, device="cpu", pin_memory=True)
        except RuntimeError:
            return None


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def snapshot(obj):
    """A one-off private copy (see Snapshotter)."""
    return Snapshotter().take(obj, keep=False)


# Python's and numpy's global RNGs start from the OS's entropy, and so does torch's CPU generator (torch
# 2.13: `torch.initial_seed()` differs in every process). The launcher starts all three from one fixed
# seed, so two processes of the same code draw the same numbers: the smoke's and rehearse's uninterrupted
# and resumed runs are then comparable value by value (an unseeded stream the code never draws from would
# otherwise differ in every checkpoint). Code that seeds them itself (at import or later) overrides this.
GLOBAL_SEED = 67280421310721  # torch's historical default seed


def seed_globals() -> None:
    random.seed(GLOBAL_SEED)
    np.random.seed(GLOBAL_SEED % 2**32)
    torch.default_generator.manual_seed(GLOBAL_SEED)  # the CPU's; CUDA's start from a fixed seed already


def rng_state() -> dict:
    """The global RNGs: always saved, so dropout and augmentation replay exactly."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda") or []
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved) != here:
        # Never silently: a resume that is no longer bit-exact must say so.
        warn(
            f"the checkpoint holds CUDA RNG states for {len(saved)} device(s) but this machine has "
            f"{here}; restored {min(len(saved), here)}, so the run is NO LONGER BIT-EXACT from here"
        )
    for i in range(min(len(saved), here)):
        torch.cuda.set_rng_state(saved[i], device=i)
