"""One model over the ranks, never two (kchain ddp): the checks that stop unsynchronised replicas.

With two ranks each process builds its own copy of the model. Only DistributedDataParallel averages
the gradients, so a parameter an optimizer steps outside DDP (a model moved with `.to(run.device)`
instead of `run.wrap`) trains one model per rank, and so does a DDP model whose forward is bypassed
(`model.module(x)`, a Lightning module's `training_step` called directly): DDP all-reduces only the
gradients of a backward that followed its own forward. Nothing fails; the checkpoint holds rank 0's
model and the resumed run is not the run that was smoked. Two checks, both on every rank at once:

- at the loop's start, the parameters the optimizers step against those under DDP (`unsynced`);
- after the session's first step and at every save, one number per parameter tensor gathered from
  every rank and compared (`differing`): DDP keeps the parameters bitwise equal on every rank (the
  same averaged gradients, the same optimizer arithmetic), so any difference is a replica that
  trains alone. Buffers are left out: DDP broadcasts them before each forward, and BatchNorm's
  running statistics then move on each rank's own batch.
"""

from __future__ import annotations

import gc
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

FIX = ("wrap the model with `model = run.wrap(model)` before making the optimizer and call the "
       "wrapped model for the forward pass (or set train.gpus: 1 to train on one GPU)")


def _syncing() -> tuple[type, ...]:
    """The wrappers that keep the ranks' parameters in step: DDP, and FSDP once the job imported it.
    A model wrapped in FSDP means torch.distributed.fsdp is loaded; importing it here would cost
    every session most of a second at start-up (it pulls in DTensor)."""
    kinds: list[type] = [DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and hasattr(fsdp, "FullyShardedDataParallel"):
        kinds.append(fsdp.FullyShardedDataParallel)
    return tuple(kinds)


def sharded(params: list[tuple[str, torch.Tensor]]) -> bool:
    """Parameters that differ per rank by design (FSDP's shards, DTensors): their sums are not compared.
    One pass over the collector's objects: call it once per session."""
    if any(type(p).__name__ in ("DTensor", "FlatParameter") for _, p in params):
        return True
    syncing = _syncing()
    return any(issubclass(type(o), syncing[1:]) for o in gc.get_objects()) if len(syncing) > 1 else False


class UnsyncedReplicas(RuntimeError):
    """The ranks would train (or trained) different models; the message names a parameter and the fix."""


def _param_names(modules: dict[str, torch.nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for tracked, module in modules.items():
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        for name, p in inner.named_parameters():
            names.setdefault(id(p), f"{tracked}.{name}")
    return names


def unsynced(optimizers: list[torch.optim.Optimizer], modules: dict[str, torch.nn.Module]) -> str | None:
    """One line when an optimizer steps a trainable parameter that no DistributedDataParallel holds.

    `optimizers` are the ones kchain knows (tracked or run.optimize'd); every live optimizer and DDP
    module is found too (one pass over the collector's objects), so an untracked optimizer or a DDP
    built by hand counts as well."""
    line = _unsynced(optimizers, modules)
    if line is not None:  # an optimizer found may be garbage (an earlier attempt's): collect, look again
        gc.collect()
        line = _unsynced(optimizers, modules)
    return line


def _unsynced(optimizers: list[torch.optim.Optimizer], modules: dict[str, torch.nn.Module]) -> str | None:
    # type(o), not isinstance: isinstance reads __class__, which some torch objects warn on.
    syncing = _syncing()
    found = gc.get_objects()
    live = [o for o in found if issubclass(type(o), torch.optim.Optimizer)]
    synced = {id(p) for o in found if issubclass(type(o), syncing) for p in o.parameters()}
    del found
    optimizers = list({id(o): o for o in [*optimizers, *live]}.values())
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in synced:
                    name = _param_names(modules).get(id(p), f"a {tuple(p.shape)} parameter")
                    return (f"{type(opt).__name__} steps {name}, which is not in DistributedDataParallel: "
                            f"each rank would train its own model; {FIX}")
    return None


def trained(optimizers: list[torch.optim.Optimizer], modules: dict[str, torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parameters the optimizers step, each once, named by the tracked module that holds it."""
    names = _param_names(modules)
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), (names.get(id(p), f"parameter {len(seen)} of {type(opt).__name__}"), p))
    return list(seen.values())


def fingerprint(params: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each parameter tensor's sum in float64 (summed on its own device), on the CPU, in order."""
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([p.detach().sum(dtype=torch.float64).reshape(1) for _, p in params]).cpu()


def differing(gathered: list[torch.Tensor], params: list[tuple[str, torch.Tensor]]) -> str | None:
    """The first parameter whose sum differs between ranks, named; None when every rank agrees."""
    first = gathered[0]
    for other in gathered[1:]:
        if other.shape != first.shape:
            return f"the ranks track different parameters ({first.numel()} vs {other.numel()} tensors)"
        both_nan = other.isnan() & first.isnan()  # a nan on every rank is the same model (a nan loss says so)
        diff = ((other != first) & ~both_nan).nonzero()
        if diff.numel():
            i = int(diff[0])
            return f"{params[i][0]} (sum {first[i].item():.6g} on rank 0, {other[i].item():.6g} on another rank)"
    return None
