"""The resume verdict on the state: two runs' checkpoints compared value by value, at every step both saved.

A trace can agree while the state does not: an EMA updated once too often after a resume moves no
logged number, yet the weights a user keeps differ. Each checkpoint carries digests.json, a digest of
every value it holds (kchain/runtime/checkpoint/statedigest.py: model, optimizer, schedulers, scaler, loader
positions, RNGs, every tracked object, each rank's own); `compare` reads them on the laptop, with no
torch, and names what differs first. Only then is torch asked, in a child process, how far apart the
differing tensors are (`largest`). Used by smoke and rehearse alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kchain import traces
from kchain.common import layout


@dataclass(frozen=True)
class Saved:
    """One checkpoint a run left: its step, its folder and its digests."""

    step: int
    path: Path
    digests: dict[str, str]


@dataclass(frozen=True)
class Difference:
    """The values that differ at one step both runs saved."""

    step: int
    keys: tuple[str, ...]  # the digests' dotted keys, in order
    reference: Path
    other: Path


@dataclass(frozen=True)
class Comparison:
    steps: tuple[int, ...]  # the steps both runs saved, compared
    values: int  # values compared over those steps
    differences: tuple[Difference, ...]  # one per step that differs, oldest first
    unhashed: int = 0  # values with no digest in one run or both (live CUDA tensors streamed): not compared

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    @property
    def whole(self) -> bool:
        """Every value at the compared steps was compared."""
        return self.unhashed == 0

    def not_compared(self) -> str:
        """What was left out ('' when nothing was): a verdict never claims values it did not compare."""
        if self.whole:
            return ""
        return f"{self.unhashed} more, tensors streamed from the GPU without a digest, not compared"

    def counted(self) -> str:
        """'448 values', and what was left out."""
        values = f"{self.values} value{'s' if self.values != 1 else ''}"
        return f"{values}; {self.not_compared()}" if not self.whole else values


def saved(folders: Iterable[Path]) -> dict[int, Saved]:
    """The complete checkpoints with digests under each `checkpoints` folder, by step (a later folder
    wins a step two hold: pass the sessions oldest first)."""
    out: dict[int, Saved] = {}
    for folder in folders:
        for ckpt in sorted(folder.glob(f"{layout.CHECKPOINT_PREFIX}*")) if folder.is_dir() else []:
            try:
                step = int(json.loads((ckpt / layout.MANIFEST).read_text())["step"])
                digests = json.loads((ckpt / layout.DIGESTS).read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue  # incomplete, or written before digests existed
            out[step] = Saved(step, ckpt, digests)
    return out


def checkpoints_of(working: Path) -> Path:
    """Where a run whose working dir is `working` keeps its checkpoints."""
    return working / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR


def compare(reference: dict[int, Saved], other: dict[int, Saved]) -> Comparison:
    """Every step both runs saved, every value compared exactly (a value one holds and the other
    lacks differs too)."""
    steps = sorted(set(reference) & set(other))
    differences = []
    values = unhashed = 0
    for step in steps:
        a, b = reference[step].digests, other[step].digests
        keys = sorted(set(a) | set(b), key=_order)
        blind = {k for k in keys if _unhashed(a.get(k), b.get(k))}
        values += len(keys) - len(blind)
        unhashed += len(blind)
        differing = tuple(k for k in keys if a.get(k) != b.get(k) and k not in blind)
        if differing:
            differences.append(Difference(step, differing, reference[step].path, other[step].path))
    return Comparison(tuple(steps), values, tuple(differences), unhashed)


def _unhashed(a: str | None, b: str | None) -> bool:
    """A live CUDA tensor streamed to the file is not digested: not comparable, not a difference."""
    return a is not None and b is not None and (a.endswith(":unhashed") or b.endswith(":unhashed"))


def _order(key: str) -> tuple[int, str]:
    """Tracked objects first (in the order a user reads them), then the RNGs, then the rest."""
    return (0 if key.startswith("tracked.") else 1 if key.startswith("rng.") else 2, key)


def name(key: str) -> str:
    """A digest key as the user knows it: `model_ema.module.fc.weight`, `rank 1's model_ema...`."""
    rank = ""
    if key.startswith("ranks."):
        _, r, key = key.split(".", 2)
        rank = f"rank {r}'s "
    if key.startswith("tracked."):
        return rank + key.removeprefix("tracked.")
    if key.startswith("rng."):
        return f"{rank}global {key.removeprefix('rng.')} RNG state"
    return rank + key


def objects(keys: Iterable[str]) -> list[str]:
    """The tracked objects (or RNGs) the keys belong to, in order, each once."""
    out: list[str] = []
    for key in keys:
        parts = key.split(".")
        if parts[0] == "ranks" and len(parts) > 2:
            parts = parts[2:]
        obj = parts[1] if parts[0] in ("tracked", "rng") and len(parts) > 1 else parts[0]
        obj = "RNGs" if parts[0] == "rng" else obj
        if obj not in out:
            out.append(obj)
    return out


def largest(diff: Difference, limit: int = 3) -> dict[str, float | None]:
    """How far apart the first differing tensors are (torch, in a child process: the laptop's
    process never imports it). {} when it cannot tell."""
    keys = [k for k in diff.keys if k.split(".")[0] in ("tracked", "ranks")][:limit]
    if not keys:
        return {}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kchain.runtime.checkpoint.statedigest", str(diff.reference), str(diff.other), *keys],
            capture_output=True, text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


def describe(diff: Difference, far: dict[str, float | None], traces_agree: bool) -> str:
    """'model_ema.module.fc.weight differs at step 4 (largest 1.5e-03), and 17 more values of model_ema;
    the logged values agree'."""
    key = diff.keys[0]
    gap = far.get(key)
    line = f"{name(key)} differs at step {diff.step}" + (f" (largest {gap:.1e})" if gap else "")
    more = len(diff.keys) - 1
    if more:
        line += f", and {more} more value{'s' if more > 1 else ''} of {', '.join(objects(diff.keys))}"
    return line + ("; the logged values agree" if traces_agree else "")


def cause(comparison: Comparison, resume_step: int, traces_agree: bool = True) -> str:
    """The likely cause, from what differs and when (and whether the logged values moved with it)."""
    diff = comparison.first
    assert diff is not None
    if diff.step <= resume_step:
        return f"the state differs before any resume: the training is not deterministic ({traces.NOT_DETERMINISTIC})"
    what = objects(diff.keys)
    optimizers = objects(k for k in _all_keys(comparison) if ".param_groups." in k or ".state." in k)
    differing_optimizers = [o for o in what if o in optimizers]
    if what == ["files"]:
        return ("the framework's own checkpoint files differ (the Trainer's model, optimizer, scheduler or RNG "
                f"file: {', '.join(k.removeprefix('files.') for k in diff.keys[:3])}): the training after the "
                "resume is not the uninterrupted one though kchain's own state agrees")
    modules = [o for o in what if o not in optimizers and o not in ("RNGs", "files") and not o.startswith("loader")]
    if modules and not differing_optimizers and traces_agree:
        return (f"{', '.join(modules)} differ{'s' if len(modules) == 1 else ''} while the optimizer's state agrees: "
                "an object updated outside the optimizer (an EMA, an AveragedModel, a running statistic) is updated "
                "on a schedule that restarts at a resume. A batch index from `enumerate(loader)` starts at 0 again "
                "after a mid-epoch resume: count such updates with the global step (the step run.steps yields, or "
                "run.step) instead")
    if what == ["RNGs"]:
        return ("only the global RNG state differs: something draws random numbers a different number of times "
                "after a resume (a module built lazily, a shuffle or augmentation outside run.loader); draw from "
                "a generator passed to run.track, or from the same place in both")
    if any(o.startswith("loader") for o in what):
        return ("a loader's position differs: the resumed run reads a different number of batches (a loader read "
                "outside the loop, or twice per step)")
    return (f"{', '.join(what)} differ{'s' if len(what) == 1 else ''} after the resume: state the training "
            "depends on is not in run.track (a second optimizer, a scheduler, a GradScaler, a generator, an object "
            "that holds the next batch), or a batch is fetched in the step before the one that trains on it")


def _all_keys(comparison: Comparison) -> list[str]:
    return [k for d in comparison.differences for k in d.keys]
