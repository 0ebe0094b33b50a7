"""The frozen base of a fine-tune: parameters that never train stay out of the checkpoints.

A fine-tune's state that can change is the trainable parameters, the buffers, the optimizer's
moments, the step, the RNGs and the data order; the pretrained base is rebuilt by the user's code
every session (from_pretrained of an attached input). Saving the base again at every checkpoint
costs its whole size per save and per published state version (GBs for a 1-3B base in fp16
against ~100 MB of LoRA adapters and their moments). So a parameter is left out of a checkpoint
while it is frozen: requires_grad False and never written in place since the loop started (an EMA
copy with requires_grad False changes in place: it is saved). The manifest records each one left
out by name, shape, dtype and the sha256 of its bytes; a resume checks the base the code has just
built against them and stops with one line at the first tensor that differs, so a resume onto
another base (another revision, another model) is never silent. The shapes and dtypes are checked
before anything is loaded; the bytes are hashed in background threads (hashlib releases the GIL)
while the first steps run, and the check is joined before the first checkpoint is written and
polled after every step: a wrong base stops the run within a few steps, before anything of it is
saved, and the restore does not wait for a pass over GBs. A parameter that starts training
mid-run (progressive unfreezing) is saved from its first checkpoint after that.
`train.checkpoint_frozen: true` keeps the whole model in every checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Set
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kchain.common.checkpoint_files import ResumeError
from kchain.runtime import distributed

HASH_THREADS = 2  # hashlib releases the GIL on large buffers: two tensors hash at once


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, for any dtype (half, bf16, int8, bool) and device."""
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def _frozen_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict keys of `module`'s parameters that do not require grad (tied ones under each key)."""
    return {k: p for k, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


class FrozenBase:
    """Which tracked parameters are left out of checkpoints, and their fingerprints."""

    def __init__(self, enabled: bool):
        self.enabled = enabled  # False: train.checkpoint_frozen, every checkpoint holds the whole model
        self._left_out: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}  # name -> key -> (tensor, version)
        self._digests: Future | None = None  # {(name, key): sha256}, hashed in the background
        self._pending: tuple[object, dict] | None = None  # (checkpoint, recorded): the resume's check, not joined yet

    def mark(self, tracked: dict, ckpt=None, recorded: dict | None = None) -> None:
        """At the loop's start (after a restore): the frozen parameters as they are now, their sha256
        computed in the background (overlapping the first steps). After a resume, `recorded` is what
        the checkpoint's manifest says of them: check() compares once the hashes are in."""
        if recorded:
            self._pending = (ckpt, recorded)
        if not self.enabled and not recorded:
            return
        for name, obj in tracked.items():
            live = distributed.unwrap(obj)
            if isinstance(live, torch.nn.Module):
                found = {k: (p, p._version) for k, p in _frozen_params(live).items()}
                if found:
                    self._left_out[name] = found
        todo = {(n, k): t for n, keys in self._left_out.items() for k, (t, _) in keys.items()}
        if not todo:
            return  # nothing frozen (a run from scratch): no threads, nothing to record
        pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="kchain-frozen")

        def hash_all() -> dict[tuple[str, str], str]:
            try:
                return dict(zip(todo, pool.map(digest, todo.values()), strict=True))
            finally:
                pool.shutdown(wait=False)

        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kchain-frozen")
        self._digests = runner.submit(hash_all)
        runner.shutdown(wait=False)  # its one task still runs; the thread ends with it

    def keys(self, name: str) -> set[str]:
        """The keys of tracked object `name` left out of this save: still frozen, never written in place."""
        out: set[str] = set()
        if not self.enabled:
            return out
        for key, (t, version) in self._left_out.get(name, {}).items():
            if t.requires_grad or t._version != version:
                continue  # it trains now (or is written in place, an EMA): saved from here on
            out.add(key)
        return out

    def without(self, name: str, state):
        """The state of tracked object `name` without its frozen parameters."""
        keys = self.keys(name)
        if not keys or not isinstance(state, dict):
            return state
        return type(state)((k, v) for k, v in state.items() if k not in keys)

    def poll(self) -> None:
        """After a step: once the hashes are in, the resume's check (ResumeError on another base)."""
        if self._pending is not None and self._digests is not None and self._digests.done():
            self.verified()

    def verified(self) -> None:
        """Join the resume's check of the base (before a checkpoint is written: never one of another base)."""
        if self._pending is None:
            return
        ckpt, recorded = self._pending
        self._pending = None
        digests = self._digests.result() if self._digests is not None else {}
        for name, keys in recorded.items():
            for key, want in keys.items():
                if digests.get((name, key), want["sha256"]) != want["sha256"]:
                    raise _differs(ckpt, f"{name}.{key} holds other values")

    def record(self) -> dict | None:
        """What the manifest says of the parameters left out of this save (None: nothing left out)."""
        self.verified()
        if self._digests is None or not self.enabled:
            return None
        digests = self._digests.result()
        out = {}
        for name in self._left_out:
            keys = self.keys(name)
            if keys:
                out[name] = {k: {"shape": list(self._left_out[name][k][0].shape),
                                 "dtype": str(self._left_out[name][k][0].dtype).removeprefix("torch."),
                                 "sha256": digests[(name, k)]} for k in sorted(keys)}
        return out or None

    def check_shapes(self, ckpt, recorded: dict | None, tracked: dict) -> None:
        """Before a resume loads anything: every parameter the checkpoint left out is there, frozen,
        with its shape and dtype (the bytes are checked as they are hashed: verified())."""
        for name, keys in (recorded or {}).items():
            obj = tracked.get(name)
            live = distributed.unwrap(obj) if obj is not None else None
            params = dict(live.named_parameters(remove_duplicate=False)) if isinstance(live, torch.nn.Module) else {}
            for key, want in keys.items():
                t = params.get(key)
                if t is None:
                    raise _differs(ckpt, f"{name}.{key} is missing")
                got = (list(t.shape), str(t.dtype).removeprefix("torch."))
                if got != (want["shape"], want["dtype"]):
                    raise _differs(ckpt, f"{name}.{key} is {got[1]} {got[0]}, was {want['dtype']} {want['shape']}")
                if t.requires_grad:
                    raise _differs(ckpt, f"{name}.{key} is trainable now; it was frozen (left out of the checkpoint)")


def _differs(ckpt, what: str) -> ResumeError:
    return ResumeError(
        f"cannot resume from {ckpt}: the frozen base is not the one this run trained on: {what} (another "
        "revision or another model?). Attach the base the run started from, or start fresh by detaching "
        "the state dataset"
    )


def load_module(module: torch.nn.Module, state: dict, frozen_keys: Set[str]) -> None:
    """load_state_dict of a checkpoint that left `frozen_keys` out: strict about every other key."""
    result = module.load_state_dict(state, strict=not frozen_keys)
    if frozen_keys:
        missing = [k for k in result.missing_keys if k not in frozen_keys]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                               f"{missing}, unexpected keys {list(result.unexpected_keys)}")
