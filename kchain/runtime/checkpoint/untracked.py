"""State the job forgot to track: everything the training holds that no checkpoint does.

A model wrapped but never passed to run.track, an EMA kept beside the model (diffusers' `EMAModel` is
not even a module: its `shadow_params` are a list of tensors), a generator the code draws from: a
resume starts each over, so the resumed run is not the uninterrupted one, and often nothing it logs
shows it. In a smoke or a rehearsal (only there: it walks the user's frames and the garbage
collector's objects) the loop asks the `Watch` three things:

- at the first step's end (`check`): any object of a kind that is state by nature (an EMA helper,
  an optimizer, a scheduler, a GradScaler, a generator, a module with trainable parameters) that
  is neither tracked nor excluded with `run.untrack` stops the run with `UntrackedState`, naming it
  as the code names it (`ema_model`, `self.ema`) and the `run.track(...)` line that fixes it;
  whether it changed yet does not matter (a torchvision EMA updated every 32 steps has not);
- at later steps' ends (a smoke: `changes=True`): any other untracked module or generator that
  changed since the first step stops the run the same way;
- at each save (`digests`): a digest of every untracked object the user's frames reach (modules,
  EMA helpers, optimizers, schedulers, generators, and lists, dicts and attributes holding
  tensors), as `untracked.<name>.<leaf>` keys beside the checkpoint's own digests, and each
  excluded object as `excluded.<name>` with its reason. The laptop's judge (kchain/local/statecheck.py)
  compares them between the uninterrupted and the resumed run like the tracked state, so an
  untracked object that differs after a resume fails the verdict however rarely it changes.

A name's dots are written as `/` in a digest key (`untracked.self/ema.shadow_params.0`), so the key's
own dots still separate the leaves. What a framework saves itself (the Trainer's model, a
LightningModule) is covered by the integration (`Checkpointer.cover`).
"""

from __future__ import annotations

import collections
import gc
import hashlib
import os
import random
import re
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from kchain.common import statekeys
from kchain.runtime import distributed
from kchain.runtime.checkpoint import statedigest

_HERE = os.path.dirname(os.path.dirname(__file__))  # the kchain package: not the user's frames
_LIBRARIES = tuple({p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"),
                                sysconfig.get_paths().get("platlib")) if p})
_DEPTH = 4  # how far below a frame's variable the walk looks (`self.state.ema.shadow_params.0`)
_VISITS = 20000  # objects visited per walk at most: a dataset of a million items is not walked
_WIDE = 4096  # a list or dict longer than this is walked only if its first item holds state

# EMA helpers users bring, by class name (and the package they come from), so the message says what it is.
EMA_HELPERS = {
    "AveragedModel": "torch.optim.swa_utils.AveragedModel",
    "ExponentialMovingAverage": "torchvision's ExponentialMovingAverage",
    "ModelEma": "timm's ModelEma", "ModelEmaV2": "timm's ModelEmaV2", "ModelEmaV3": "timm's ModelEmaV3",
    "EMAModel": "diffusers' EMAModel",
    "EMA": "ema-pytorch's EMA", "PostHocEMA": "ema-pytorch's PostHocEMA",
}
_EMA_NAME = re.compile(r"(^|[a-z_])(EMA|Ema)([A-Z_]|V\d|$)")  # a user's own EMA, ema-pytorch's KarrasEMA, ...
_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


class UntrackedState(Exception):  # noqa: N818  (named for what the user sees)
    """State the training keeps that no checkpoint holds: a resume would start it over."""


class Watch:
    """The untracked state: refused at the first step by kind, watched for change (a smoke), and
    digested at each save."""

    def __init__(self, changes: bool = True):
        self.changes = changes  # a smoke: later steps compare the first step's digests
        self._first: dict[int, tuple[weakref.ref | object, str]] = {}  # id -> (the object or a ref, digest)
        self._started = False

    def check(self, covered: list[object], excluded: list[object]) -> None:
        """Refuse (the first call) or compare (later calls, with `changes`); UntrackedState when any."""
        if self._started and not self.changes:
            return  # a rehearsal: the first step's refusal only (the saves' digests do the rest)
        inside, saved = _scope(covered, excluded)
        if not self._started:
            self._started = True
            refused: list[tuple[str | None, object]] = [(n, o) for n, o in _reachable(inside, saved)
                                                        if _state_by_nature(o)]
            named = {id(o) for _, o in refused}
            refused += [(_name(o), o) for o in _loose_modules(inside, saved)
                        if id(o) not in named and _state_by_nature(o)]
            if refused:
                raise UntrackedState(message(refused, changed=False))
            if self.changes:
                self._first = {id(o): (_ref(o), _digest(o)) for _, o in _changing(inside, saved)}
            return
        changed: list[tuple[str | None, object]] = []
        for name, obj in _changing(inside, saved):
            seen = self._first.get(id(obj))
            if seen is None:
                self._first[id(obj)] = (_ref(obj), _digest(obj))  # built after the first step: from now on
            elif _alive(seen[0]) is obj and _digest(obj) != seen[1]:
                changed.append((name, obj))
        if changed:
            raise UntrackedState(message(changed, changed=True))

    def digests(self, covered: list[object], excluded: list[tuple[object, str]]) -> dict[str, str]:
        """{`untracked.<name>.<leaf>`: digest} of every untracked object the user's frames reach, and
        {`excluded.<name>`: reason} of each object excluded on purpose."""
        inside, saved = _scope(covered, [o for o, _ in excluded])
        out: dict[str, str] = {}
        for name, obj in _reachable(inside, saved):
            _leaves(_state(obj), f"{statekeys.UNTRACKED}.{statekeys.written(name)}", out)
        for obj, reason in excluded:
            out[f"{statekeys.EXCLUDED}.{statekeys.written(_name(obj) or type(obj).__name__)}"] = reason
        return out


def message(found: list[tuple[str | None, object]], changed: bool) -> str:
    listed = ", ".join(f"{n} ({what(o)})" if n else f"a {what(o)}" for n, o in found)
    one = len(found) == 1
    fix = ", ".join(f"{statekeys.track_key(n)}={n}" for n, _ in found if n) or "name=obj"
    them = "it" if one else "them"
    does = (f"change{'s' if one else ''} between steps but no checkpoint holds {them}" if changed else
            f"{'is' if one else 'are'} state the training keeps, but no checkpoint holds {them}")
    return (f"{listed} {does}: a resume would start {them} over; add run.track({fix}) before the loop "
            f"(or run.untrack({'obj' if not one or not found[0][0] else found[0][0]}, reason=...) if a resume "
            "rebuilds it exactly)")


def what(obj) -> str:
    """`Generator`, or `an EMA: diffusers' EMAModel` for the helpers users bring."""
    name = type(obj).__name__
    known = next((EMA_HELPERS[c.__name__] for c in type(obj).__mro__ if c.__name__ in EMA_HELPERS), None)
    return f"an EMA: {known}" if known else name


def _ref(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj  # a numpy Generator takes no weak reference; holding it keeps its id ours


def _alive(ref):
    return ref() if isinstance(ref, weakref.ref) else ref


# --- what is covered ------------------------------------------------------------------------------


def _scope(covered, excluded) -> tuple[set[int], set[int]]:
    """The ids of what a checkpoint holds or the job excluded (each object, its unwrapped module, the
    modules inside, and the objects a tracked object holds directly: a loader's own generator, a
    prepared optimizer's inner one), and the storages of every covered module's tensors."""
    inside: set[int] = set()
    saved: set[int] = set()
    for obj in [*covered, *excluded]:
        for o in (obj, distributed.unwrap(obj)):
            inside.add(id(o))
            if isinstance(o, torch.nn.Module):
                inside.update(id(m) for m in o.modules())
                saved.update(t.data_ptr() for t in o.state_dict().values() if isinstance(t, torch.Tensor))
            elif not isinstance(o, _GENERATORS):
                inside.update(id(v) for v in (getattr(o, "__dict__", None) or {}).values() if not _atom(v))
    inside.add(id(torch.default_generator))  # the global RNGs: every checkpoint holds them (snapshot.rng_state)
    inside.add(id(random._inst))  # python's global RNG, saved the same way
    return inside, saved


def _state_by_nature(obj) -> bool:
    """An EMA helper: state whether or not it changed yet, refused untracked at the first step. A smoke's
    few steps may end before its first update (every 32 steps upstream), and a resumed run builds it again
    before the restore, so no comparison can see it in time. Other kinds (an optimizer, a generator, a
    model) are refused when they change, or when they differ at a save: an inference job's model and a
    generator drawn from only to build the data are not state, and must pass."""
    return any(c.__name__ in EMA_HELPERS or _EMA_NAME.search(c.__name__) for c in type(obj).__mro__)


# --- what is looked at ------------------------------------------------------------------------------


def _reachable(inside: set[int], saved: set[int]) -> list[tuple[str, object]]:
    """(name, object) for each untracked object with state the user's frames reach, outermost first:
    a stateful object (a module, an optimizer, a scheduler, an EMA helper, anything with a state_dict,
    a generator) whole, else a tensor in a list, dict or attribute of the user's own objects."""
    found: list[tuple[str, object]] = []
    seen = set(inside)
    visits = 0
    queue: collections.deque[tuple[str, object, int]] = collections.deque()
    for frame in _user_frames():
        scopes = [frame.f_locals] if frame.f_globals is frame.f_locals else [frame.f_locals, frame.f_globals]
        for scope in scopes:
            queue.extend((k, v, 0) for k, v in list(scope.items()) if not k.startswith("__"))
    while queue and visits < _VISITS:
        name, value, depth = queue.popleft()
        if id(value) in seen or _opaque(value):
            continue
        seen.add(id(value))
        visits += 1
        if tensors_only(value):
            # A tensor, or a list or dict of them, of the user's own objects (a plain tensor local, the
            # last batch or a loss, is the step's own): as run.track takes it.
            if depth > 0 and not _shared(value, saved):
                found.append((name, value))
            continue
        if _stateful(value):
            if _wrapper(value, inside):
                continue  # a framework's wrapper of a tracked object (Fabric's optimizer): its state is that one's
            if not isinstance(value, torch.nn.Module) or _own_state(value, saved):
                found.append((name, value))
            continue
        if depth >= _DEPTH:
            continue
        queue.extend((name + k, v, depth + 1) for k, v in _children(value))
    return found


def _wrapper(value, inside: set[int]) -> bool:
    """A stateful object that is not an EMA and holds a tracked one directly (accelerate's and Fabric's
    optimizer and scheduler wrappers). An EMA that holds the live model beside its copy is still state."""
    if _state_by_nature(value) or isinstance(value, torch.nn.Module):
        return False
    return any(id(v) in inside for v in (getattr(value, "__dict__", None) or {}).values())


def _atom(value) -> bool:
    """A plain value: its id says nothing of who holds it (small ints and strings are shared)."""
    return isinstance(value, (str, bytes, int, float, complex, bool, type(None)))


def _opaque(value) -> bool:
    """What the walk never enters: code, classes, modules, plain atoms, kchain's own objects (the run,
    its loaders and steppers: what they hold is tracked or kchain's), and a library's objects without
    a state_dict (a Trainer, a tokenizer: a framework's own state is its integration's)."""
    if _atom(value) or isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                          types.BuiltinFunctionType, range)):
        return True
    module = type(value).__module__ or ""
    if module.startswith("kchain"):
        return True
    if isinstance(value, (torch.Tensor, list, tuple, dict, *_GENERATORS)) or _stateful(value):
        return False
    return not _users(type(value))


def _users(cls) -> bool:
    """A class of the job's own code (not kchain's, not a library's, not a builtin)."""
    path = getattr(sys.modules.get(cls.__module__ or ""), "__file__", None) or ""
    return bool(path) and _users_file(path)


def _users_file(path: str) -> bool:
    """A file of the job's own code: not kchain's, not the standard library's, not an installed package's."""
    return not path.startswith(_HERE) and not path.startswith(_LIBRARIES) and "site-packages" not in path


def _stateful(value) -> bool:
    return isinstance(value, (torch.nn.Module, *_GENERATORS)) or callable(getattr(type(value), "state_dict", None))


def _children(value) -> Iterator[tuple[str, object]]:
    """(`.attr`, `[0]` or `['key']`: the suffix the code would write, the value) of what `value` holds."""
    items: list[tuple[str, object]]
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items() if isinstance(k, (str, int))]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        items = [(f".{k}", v) for k, v in (getattr(value, "__dict__", None) or {}).items() if not k.startswith("__")]
    if len(items) > _WIDE and not isinstance(items[0][1], (torch.Tensor, dict, list)):
        return iter(())
    return iter(items)


def tensors_only(obj) -> bool:
    """A tensor, or a list, tuple or dict whose every leaf is one (an EMA's shadow tensors): what run.track
    takes as it is and loads back in place (checkpointer.py), and what the walk names as one object."""
    if isinstance(obj, torch.Tensor):
        return True
    if not isinstance(obj, (dict, list, tuple)):
        return False
    values = list(obj.values()) if isinstance(obj, dict) else list(obj)
    return bool(values) and all(tensors_only(v) for v in values)


def _shared(value, saved: set[int]) -> bool:
    """Parameters, or tensors a covered module holds (a list of the model's own parameters)."""
    if isinstance(value, torch.Tensor):
        return isinstance(value, torch.nn.Parameter) or value.data_ptr() in saved
    items = value.values() if isinstance(value, dict) else value
    return all(_shared(v, saved) for v in items)


def _own_state(module: torch.nn.Module, saved: set[int]) -> bool:
    """Whether the module holds a tensor that no covered module holds."""
    return any(isinstance(t, torch.Tensor) and t.data_ptr() not in saved for t in module.state_dict().values())


def _loose_modules(inside: set[int], saved: set[int]) -> list[torch.nn.Module]:
    """Every module with state of its own that no covered object holds (the outermost of each), found
    by the garbage collector: a model kept where the user's frames do not reach."""
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module) and id(o) not in inside]
    below = {id(m) for o in modules for m in o.modules() if m is not o}
    # A wrapper around a covered model (DDP, a framework's) holds no state of its own: not a candidate.
    return [m for m in modules if id(m) not in below and _own_state(m, saved)]


def _changing(inside: set[int], saved: set[int]) -> list[tuple[str | None, object]]:
    """What a smoke watches for change, with its name: every untracked object the frames reach (a tensor
    alone aside: the step's own), and the loose modules."""
    found = [(n, o) for n, o in _reachable(inside, saved) if not isinstance(o, torch.Tensor)]
    ids = {id(o) for _, o in found}
    return [*found, *((_name(m), m) for m in _loose_modules(inside, saved) if id(m) not in ids)]


# --- an object's state and its digest --------------------------------------------------------------


def _state(obj):
    """What a checkpoint of `obj` would hold (its state_dict, a generator's state, a tensor itself)."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, np.random.RandomState):
        return obj.get_state(legacy=False)
    if isinstance(obj, random.Random):
        return repr(obj.getstate())
    if tensors_only(obj):
        return obj
    try:
        return obj.state_dict()
    except Exception as e:  # noqa: BLE001  (a user's state_dict that fails is named, not fatal to the digest)
        return f"state_dict() failed: {type(e).__name__}"


def _leaves(state, path: str, out: dict[str, str]) -> None:
    """A digest per leaf, as a checkpoint's digests.json holds them, CUDA tensors copied back to be hashed."""
    statedigest.walk(state, path, out, live=True)


def digests_of(state) -> dict[str, str]:
    """{leaf: digest} of a live state (what the ranks compare of their buffers)."""
    out: dict[str, str] = {}
    _leaves(state, "", out)
    return out


def _digest(obj) -> str:
    out: dict[str, str] = {}
    _leaves(_state(obj), "", out)
    return hashlib.sha256(repr(sorted(out.items())).encode()).hexdigest()


# --- how the code names it --------------------------------------------------------------------------


def _user_frames():
    """The frames of the job's own code, innermost first (not kchain's, not a library's)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if _users_file(frame.f_code.co_filename):
            yield frame
        frame = frame.f_back


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
