"""torch._dynamo imported when something compiles, not at the first optimizer: 1.9 s of CPU per training process.

torch marks its optimizers' functions "not to be compiled" (`torch._compile._disable_dynamo` on
`add_param_group`, `zero_grad`, `state_dict`, ...; `torch.optim.optimizer._use_grad_for_differentiable`
on every `step`, with a `graph_break()` either side), and both marks import torch._dynamo on their
first call: about 1.9 s of CPU, two fifths of a training process's start (a smoke starts three, a
rehearsal one a session). The marks act only while torch._dynamo traces a frame, and nothing traces
before torch._dynamo is imported (`torch.compile`, `torch.export` and a job that imports it itself
all import it first). So `install()`, called by the launcher before torch is imported, wraps both
marks: with torch._dynamo imported they run as torch wrote them; before, the marked function runs
bare (a `step` with the grad mode torch's wrapper sets, `differentiable` or not). The arithmetic is
the same either way. A torch whose optimizer wrapper does more than that is left as it is.

DistributedDataParallel's `__init__` imports it too, for one question: `torch._dynamo.utils.
get_optimize_ddp_mode()`, read from `torch._dynamo.config.optimize_ddp`. Before torch._dynamo is loaded
nobody can have changed that setting, so its answer is the default's (`True`: "ddp_optimizer"). While a DDP
is built and torch._dynamo is not loaded, `torch._dynamo` is a stand-in that gives that answer and imports
the real package for anything else; the same 1.9 s of CPU per rank, on every model that two ranks wrap.

Standard library only; torch is touched only as its modules load.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

DYNAMO = "torch._dynamo"
COMPILE = "torch._compile"  # defines _disable_dynamo, before anything in torch uses it
OPTIMIZER = "torch.optim.optimizer"  # defines _use_grad_for_differentiable, before the optimizers use it
DDP_MODULE = "torch.nn.parallel.distributed"  # defines DistributedDataParallel
# torch._dynamo.config.optimize_ddp's default (True) as get_optimize_ddp_mode names it (torch 2.13).
DEFAULT_DDP_MODE = "ddp_optimizer"
# What torch's `_use_grad` wrapper refers to (torch 2.13): the grad mode set from the optimizer's
# `differentiable` default around the step, and dynamo's graph breaks. A wrapper that names more is kept.
USE_GRAD_NAMES = {"torch._dynamo", "torch", "cast", "Optimizer", "is_grad_enabled", "set_grad_enabled",
                  "defaults", "_dynamo", "graph_break"}


def _tracing_possible() -> bool:
    """True once torch._dynamo is imported (only then can a frame be traced, or a mark matter)."""
    return DYNAMO in sys.modules


def _lazy_disable_dynamo(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch._compile._disable_dynamo whose mark imports nothing until torch._dynamo is loaded."""

    def _disable_dynamo(fn: Callable[..., Any] | None = None, recursive: bool = True) -> Any:
        if fn is None:  # used as @_disable_dynamo(recursive=False)
            return functools.partial(_disable_dynamo, recursive=recursive)
        marked = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return marked(*args, **kwargs) if _tracing_possible() else fn(*args, **kwargs)

        return inner

    return _disable_dynamo


def _lazy_use_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch.optim.optimizer._use_grad_for_differentiable whose graph breaks wait for torch._dynamo."""
    import torch

    def _use_grad_for_differentiable(func: Callable[..., Any]) -> Callable[..., Any]:
        marked = original(func)

        def _use_grad(*args: Any, **kwargs: Any) -> Any:
            if _tracing_possible():
                return marked(*args, **kwargs)
            prev = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(prev)

        functools.update_wrapper(_use_grad, func)
        return _use_grad

    probe = original(lambda *a, **k: None)
    return _use_grad_for_differentiable if set(probe.__code__.co_names) <= USE_GRAD_NAMES else original


class _UnloadedDynamo:
    """`torch._dynamo` while a DDP is built before it is loaded: the DDP mode its default config gives, and
    the real package (imported then) for anything else."""

    class utils:  # noqa: N801 - torch._dynamo.utils, as DistributedDataParallel.__init__ reads it
        @staticmethod
        def get_optimize_ddp_mode() -> str:
            return DEFAULT_DDP_MODE

    def __getattr__(self, name: str) -> Any:
        import importlib

        return getattr(importlib.import_module(DYNAMO), name)


def _lazy_ddp(cls: Any) -> Any:
    """DistributedDataParallel whose construction asks the stand-in, not torch._dynamo, while it is not loaded."""
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        torch = sys.modules["torch"]
        if _tracing_possible() or "_dynamo" in vars(torch):
            return original(self, *args, **kwargs)
        stand_in = _UnloadedDynamo()
        vars(torch)["_dynamo"] = stand_in
        try:
            return original(self, *args, **kwargs)
        finally:
            if vars(torch).get("_dynamo") is stand_in:
                del vars(torch)["_dynamo"]

    cls.__init__ = __init__
    return cls


PATCHES = {COMPILE: ("_disable_dynamo", _lazy_disable_dynamo), OPTIMIZER: ("_use_grad_for_differentiable", _lazy_use_grad),
           DDP_MODULE: ("DistributedDataParallel", _lazy_ddp)}


class _Patched(importlib.abc.Loader):
    """The module's own loader, then the one name replaced before any other module imports it."""

    def __init__(self, loader: Any, name: str):
        self.loader, self.name = loader, name

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, ...: the module's own
        return getattr(self.loader, attr)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        attr, wrap = PATCHES[self.name]
        original = getattr(module, attr, None)
        if original is not None:
            setattr(module, attr, wrap(original))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Patched(spec.loader, name)
                return spec
        return None


def install() -> bool:
    """Before torch is imported: its optimizers' marks import torch._dynamo only once it is loaded.
    False (and nothing done) when torch is already imported or this is installed already."""
    if "torch" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    return True
