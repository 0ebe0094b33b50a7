"""State the job forgot to track: modules and generators that change between a smoke's steps, but that
no checkpoint holds.

A model wrapped but never passed to run.track, an EMA kept beside the model, a generator the code
draws from: each changes as training goes on, and a resume starts it over, so the resumed run is not
the uninterrupted one, and often nothing it logs shows it. In a smoke (only there: it walks the
garbage collector's objects) the loop asks `Watch.check` at each step's end: the first call records
a digest of every module and generator that no tracked object covers, later calls compare, and the
first that changed stops the run with `UntrackedState`, naming each as the code names it (a local
variable of the user's frames, or `obj.attr`) and the `run.track(...)` line that fixes it.

What a framework saves itself (the Trainer's model, a LightningModule) is covered by the integration
(`Checkpointer.cover`).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import sysconfig
import types
import weakref

import numpy as np
import torch

from kchain.runtime import distributed

_HERE = os.path.dirname(os.path.dirname(__file__))  # the kchain package: not the user's frames
_LIBRARIES = tuple({p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"),
                                sysconfig.get_paths().get("platlib")) if p})


class UntrackedState(Exception):  # noqa: N818  (named for what the user sees)
    """Something changes across steps but is in no checkpoint: a resume would start it over."""


class Watch:
    """Digests of the untracked modules and generators at the first step, compared at later ones."""

    def __init__(self):
        self._first: dict[int, tuple[weakref.ref | object, str]] = {}  # id -> (the object or a ref, digest)
        self._started = False

    def check(self, covered: list[object]) -> None:
        """Record (the first call) or compare (later calls); UntrackedState when any changed."""
        found = _candidates(covered)
        if not self._started:
            self._started = True
            self._first = {id(o): (_ref(o), _digest(o)) for o in found}
            return
        changed = []
        for obj in found:
            seen = self._first.get(id(obj))
            if seen is None:
                self._first[id(obj)] = (_ref(obj), _digest(obj))  # built after the first step: from now on
            elif _alive(seen[0]) is obj and _digest(obj) != seen[1]:
                changed.append(obj)
        if changed:
            raise UntrackedState(message(changed))


def message(changed: list[object]) -> str:
    names = [(_name(o), type(o).__name__) for o in changed]
    listed = ", ".join(f"{n} ({t})" if n else f"a {t}" for n, t in names)
    fix = ", ".join(f"{_key(n)}={n}" for n, _ in names if n) or "name=obj"
    return (f"{listed} change{'s' if len(changed) == 1 else ''} between steps but no checkpoint holds "
            f"{'it' if len(changed) == 1 else 'them'}: a resume would start {'it' if len(changed) == 1 else 'them'} "
            f"over; add run.track({fix}) before the loop")


def _key(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj  # a numpy Generator takes no weak reference; holding it keeps its id ours


def _alive(ref):
    return ref() if isinstance(ref, weakref.ref) else ref


# --- what is looked at ------------------------------------------------------------------------------


def _candidates(covered: list[object]) -> list[object]:
    """Every module with state that no covered object holds (the outermost of each), and every
    generator the user's frames hold that no covered object is."""
    inside: set[int] = set()
    for obj in covered:
        for o in (obj, distributed.unwrap(obj)):
            inside.add(id(o))
            if isinstance(o, torch.nn.Module):
                inside.update(id(m) for m in o.modules())
    held = {id(v) for obj in covered if not isinstance(obj, torch.nn.Module)
            for v in (getattr(obj, "__dict__", None) or {}).values()}  # a tracked loader's own generator
    saved = {t.data_ptr() for obj in covered if isinstance(distributed.unwrap(obj), torch.nn.Module)
             for t in distributed.unwrap(obj).state_dict().values() if isinstance(t, torch.Tensor)}
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module) and id(o) not in inside]
    below = {id(m) for o in modules for m in o.modules() if m is not o}
    # A wrapper around a covered model (DDP, a framework's) holds no state of its own: not a candidate.
    found: list[object] = [m for m in modules if id(m) not in below and _own_state(m, saved)]
    inside |= held
    inside.add(id(torch.default_generator))  # the global RNGs: every checkpoint holds them (snapshot.rng_state)
    for frame in _user_frames():
        for value in [*frame.f_locals.values(), *_attrs(frame.f_locals.values())]:
            if isinstance(value, (torch.Generator, np.random.Generator)) and id(value) not in inside \
                    and all(value is not f for f in found):
                found.append(value)
    return found


def _own_state(module: torch.nn.Module, saved: set[int]) -> bool:
    """Whether the module holds a tensor that no covered module holds."""
    return any(isinstance(t, torch.Tensor) and t.data_ptr() not in saved for t in module.state_dict().values())


def _digest(obj) -> str:
    h = hashlib.sha256()
    if isinstance(obj, torch.Generator):
        h.update(obj.get_state().numpy().tobytes())
    elif isinstance(obj, np.random.Generator):
        h.update(repr(obj.bit_generator.state).encode())
    else:
        for key, t in obj.state_dict().items():
            h.update(key.encode())
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                data = t.detach().reshape(-1).contiguous().cpu()
                h.update((data.to(torch.uint8) if data.dtype == torch.bool else data).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- how the code names it --------------------------------------------------------------------------


def _user_frames():
    """The frames of the job's own code, innermost first (not kchain's, not a library's)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_HERE) and not path.startswith(_LIBRARIES) and "site-packages" not in path:
            yield frame
        frame = frame.f_back


def _attrs(values) -> list:
    """One level down: the attributes of the frames' objects (`self.ema`), modules aside."""
    out: list = []
    for value in list(values):
        d = getattr(value, "__dict__", None)
        if isinstance(d, dict) and not isinstance(value, (type, types.ModuleType)):
            out.extend(d.values())
    return out


def _name(obj) -> str | None:
    """`model_ema`, or `self.ema`: where the user's frames hold it; None if they do not."""
    for frame in _user_frames():
        scopes = [frame.f_locals, frame.f_globals] if frame.f_globals is not frame.f_locals else [frame.f_locals]
        for scope in scopes:
            for key, value in list(scope.items()):
                if value is obj:
                    return key
        for key, value in list(frame.f_locals.items()):
            d = getattr(value, "__dict__", None)
            if isinstance(d, dict) and not isinstance(value, (type, types.ModuleType)):
                for attr, inner in list(d.items()):
                    if inner is obj:
                        return f"{key}.{attr}"
                    if isinstance(inner, dict):  # a module's _modules, a dict of the user's
                        hit = next((k for k, v in inner.items() if v is obj), None)
                        if hit is not None:
                            return f"{key}.{hit}"
    return None
