"""The resume verdict on the state: two runs' checkpoints compared value by value, at every step both saved.

A trace can agree while the state does not: an EMA updated once too often after a resume moves no
logged number, yet the weights a user keeps differ. Each checkpoint carries digests.json, a digest of
every value it holds (kchain/runtime/checkpoint/statedigest.py: model, optimizer, schedulers, scaler, loader
positions, RNGs, every tracked object, each rank's own); `compare` reads them on the laptop, with no
torch, and names what differs first. Only then is torch asked, in a child process, how far apart the
differing tensors are (`largest`). Used by smoke and rehearse alike.

Equal state compares equal: before the values are compared each run's digests are put in one form
(`_comparable`): a loader at the end of an epoch is at the start of the next one, and an object one run
saved once (it was equal on every rank) stands for each rank's copy the other run saved. Besides the
checkpoint's own state a smoke or a rehearsal digests what the job did not track
(kchain/runtime/checkpoint/untracked.py: `untracked.<name>.<leaf>`, the name as the code writes it with
its dots as `/`) and lists what it excluded on purpose (`excluded.<name>`: the reason); the untracked
values are compared like the rest, the excluded ones never.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kchain.common import layout, statekeys
from kchain.result import traces


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
class Excluded:
    """An object the job left out of its checkpoints on purpose (`run.untrack(obj, reason=...)`)."""

    name: str  # as the code names it: `self.teacher`
    reason: str


@dataclass(frozen=True)
class Comparison:
    steps: tuple[int, ...]  # the steps both runs saved, compared
    values: int  # values compared over those steps
    differences: tuple[Difference, ...]  # one per step that differs, oldest first
    unhashed: int = 0  # values with no digest in one run or both (live CUDA tensors streamed): not compared
    keys: frozenset[str] = frozenset()  # every key compared, in the one form both runs were put in
    excluded: tuple[Excluded, ...] = ()  # what the job excluded on purpose: listed, never compared

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

    @property
    def ranks(self) -> int:
        """How many ranks saved their own state (1 for a run on one process)."""
        return max(1, len({k.split(".")[1] for k in self.keys if _is_rank_key(k)}))

    def excluded_note(self) -> str:
        """'excluded: self.teacher (frozen, rebuilt from the hub)', '' when the job excluded nothing: a
        verdict says what it did not compare on purpose."""
        if not self.excluded:
            return ""
        return "excluded: " + ", ".join(f"{e.name} ({e.reason})" if e.reason else e.name for e in self.excluded)


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
    lacks differs too), once both are put in one form (`_comparable`)."""
    steps = sorted(set(reference) & set(other))
    differences = []
    values = unhashed = 0
    compared: set[str] = set()
    excluded: dict[str, str] = {}
    for step in steps:
        for digests in (reference[step].digests, other[step].digests):  # the reference's reason first
            for obj, reason in _excluded(digests).items():
                excluded.setdefault(obj, reason)
        a, b = _comparable(reference[step].digests, other[step].digests)
        keys = sorted(set(a) | set(b), key=_order)
        blind = {k for k in keys if _unhashed(a.get(k), b.get(k))}
        values += len(keys) - len(blind)
        unhashed += len(blind)
        compared.update(keys)
        differing = tuple(k for k in keys if a.get(k) != b.get(k) and k not in blind)
        if differing:
            differences.append(Difference(step, differing, reference[step].path, other[step].path))
    return Comparison(tuple(steps), values, tuple(differences), unhashed, frozenset(compared),
                      tuple(Excluded(n, r) for n, r in excluded.items()))


# Loader.state_dict's leaves (kchain/runtime/loader.py), and its seed.
LOADER = frozenset({"epoch", "position", "batches"})
_SECTIONS = ("tracked", statekeys.UNTRACKED)  # the object sections a rank saves its own copy of


def _comparable(a: dict[str, str], b: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Two runs' digests in one form, so that the same state compares equal: what the job excluded set
    aside, each loader's position canonical, and an object one run saved once given to each rank the
    other run saved it for."""
    a, b = _canonical(_kept(a)), _canonical(_kept(b))
    return _per_rank(a, b), _per_rank(b, a)


def _kept(digests: dict[str, str]) -> dict[str, str]:
    """The digests without the job's exclusions (`excluded.<name>`: a reason, not a value)."""
    return {k: v for k, v in digests.items() if _section(k) != statekeys.EXCLUDED}


def _excluded(digests: dict[str, str]) -> dict[str, str]:
    """{the excluded object's name: the reason} (rank 0's list: the job excludes the same on every rank)."""
    prefix = f"{statekeys.EXCLUDED}."
    return {statekeys.code_name(k.removeprefix(prefix)): v for k, v in digests.items() if k.startswith(prefix)}


def _canonical(digests: dict[str, str]) -> dict[str, str]:
    """Each loader's position in one form: at the end of an epoch (position == batches) it is at the start
    of the next one, (epoch + 1, position 0). A run that stopped after the epoch's last batch and one that
    resumed there and began the next pass hold the same point, written two ways."""
    out = dict(digests)
    for prefix in _loaders(digests):
        epoch, position, batches = (digests[f"{prefix}.{leaf}"] for leaf in ("epoch", "position", "batches"))
        try:
            if batches != "None" and int(position) == int(batches):
                out[f"{prefix}.epoch"], out[f"{prefix}.position"] = str(int(epoch) + 1), "0"
        except ValueError:
            continue  # not a number: not a Loader's position after all
    return out


def _loaders(keys: Iterable[str]) -> list[str]:
    """The prefixes holding a loader's state: exactly the leaves epoch, position and batches (and a seed)."""
    leaves = dict.fromkeys(keys)  # in their order: the same list at every run
    children: dict[str, set[str]] = {}
    for key in leaves:
        parts = key.split(".")
        for i in range(1, len(parts)):
            children.setdefault(".".join(parts[:i]), set()).add(parts[i])
    return [p for p, held in children.items()
            if LOADER <= held <= LOADER | {"seed"} and all(f"{p}.{leaf}" in leaves for leaf in held)]


def _per_rank(digests: dict[str, str], other: dict[str, str]) -> dict[str, str]:
    """An object this run saved once (`tracked.X.*` and no `ranks.<r>.tracked.X.*`) held the same value on
    every rank: the checkpointer saves per rank only what it found to differ between them. Where the other
    run saved it per rank, this run's value is given to each of the other run's ranks, so the two compare
    by value (and a rank whose own value differs is still named)."""
    ranks = [k.split(".")[1] for k in other if _is_rank_key(k)]
    once = _saved_per_rank(other) - _saved_per_rank(digests)
    out = dict(digests)
    for key, value in digests.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and (parts[0], parts[1]) in once:
            for r in ranks:
                out.setdefault(f"ranks.{r}.{key}", value)
    return out


def _saved_per_rank(digests: dict[str, str]) -> set[tuple[str, str]]:
    """(section, object) for each object some rank saved its own copy of (`ranks.<r>.tracked.X.*`)."""
    return {(p[2], p[3]) for p in (k.split(".", 4) for k in digests)
            if p[0] == "ranks" and len(p) > 4 and p[2] in _SECTIONS}


def _is_rank_key(key: str) -> bool:
    """`ranks.<r>.rank`: a rank's own state is in this checkpoint."""
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "ranks" and parts[2] == "rank"


def _section(key: str) -> str:
    """What a key's value is (`tracked`, `untracked`, `excluded`, `rng`, `step`, `files`...), a rank's too."""
    parts = key.split(".", 3)
    return parts[2] if parts[0] == "ranks" and len(parts) > 2 else parts[0]


def _unhashed(a: str | None, b: str | None) -> bool:
    """A live CUDA tensor streamed to the file is not digested: not comparable, not a difference."""
    return a is not None and b is not None and (a.endswith(":unhashed") or b.endswith(":unhashed"))


def _order(key: str) -> tuple[int, str]:
    """Untracked objects first (one that differs is named with its fix, whatever it dragged along), then the
    tracked ones (in the order a user reads them), then the RNGs, then the rest."""
    return ({"untracked": 0, "tracked": 1, "rng": 2}.get(key.split(".", 1)[0], 3), key)


def name(key: str) -> str:
    """A digest key as the user knows it: `model_ema.module.fc.weight`, `rank 1's model_ema...`,
    `self.ema.shadow_params.0` (an untracked object, named as the code names it)."""
    rank = ""
    if key.startswith("ranks.") and key.count(".") >= 2:
        _, r, key = key.split(".", 2)
        rank = f"rank {r}'s "
    if key.startswith("tracked."):
        return rank + key.removeprefix("tracked.")
    if key.startswith(("untracked.", "excluded.")):
        obj, dot, leaf = key.split(".", 1)[1].partition(".")
        return rank + statekeys.code_name(obj) + dot + leaf
    if key.startswith("rng."):
        return f"{rank}global {key.removeprefix('rng.')} RNG state"
    return rank + key


def objects(keys: Iterable[str]) -> list[str]:
    """The objects (tracked or not, `self.ema`) or RNGs the keys belong to, in order, each once."""
    out: list[str] = []
    for key in keys:
        obj = _object(key)
        if obj not in out:
            out.append(obj)
    return out


def _object(key: str) -> str:
    parts = key.split(".")
    if parts[0] == "ranks" and len(parts) > 2:
        parts = parts[2:]
    if parts[0] == "rng":
        return "RNGs"
    if parts[0] in ("untracked", "excluded") and len(parts) > 1:
        return statekeys.code_name(parts[1])
    return parts[1] if parts[0] == "tracked" and len(parts) > 1 else parts[0]


def largest(diff: Difference, limit: int = 3) -> dict[str, float | None]:
    """How far apart the first differing tensors are (torch, in a child process: the laptop's
    process never imports it). {} when it cannot tell."""
    keys = [k for k in diff.keys if k.split(".")[0] in ("tracked", "untracked", "ranks")][:limit]
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


# A module's running statistics: BatchNorm's buffers, which no optimizer updates.
RUNNING = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def cause(comparison: Comparison, resume_step: int, traces_agree: bool = True) -> str:
    """The likely cause, derived from what differs and when (and whether the logged values moved with it):
    a state that differs before any resume is the training's own nondeterminism; after it, the hint names
    the differing object and what resets it (an untracked object, a loader read another number of times,
    per-rank BatchNorm buffers, an EMA on a restarting counter, an RNG drawn differently)."""
    diff = comparison.first
    assert diff is not None
    if diff.step <= resume_step:
        return f"the state differs before any resume: the training is not deterministic ({traces.NOT_DETERMINISTIC})"
    what = objects(diff.keys)
    forgotten = next((k for k in diff.keys if _section(k) == "untracked"), None)
    if forgotten is not None:
        obj = _object(forgotten)
        return (f"{obj} is not in run.track, and it differs after the resume (a resume starts it over): add "
                f"run.track({statekeys.track_key(obj)}={obj}) before the loop")
    if what == ["files"]:
        return ("the framework's own checkpoint files differ (the Trainer's model, optimizer, scheduler or RNG "
                f"file: {', '.join(k.removeprefix('files.') for k in diff.keys[:3])}): the training after the "
                "resume is not the uninterrupted one though kchain's own state agrees")
    loaders = set(_loaders(comparison.keys))
    moved = next((p for p, _, leaf in (k.rpartition(".") for k in diff.keys)
                  if p in loaders and leaf in ("epoch", "position")), None)
    if moved is not None:
        return (f"{name(moved)}'s position differs: the resumed run reads {name(moved)} a different number of "
                "times after the resume (a batch read outside the loop, twice in a step, or an epoch left early)")
    optimizers = {_object(k) for k in comparison.keys if _section(k) == "tracked" and _optimizer_leaf(k)}
    differing_optimizers = [o for o in what if o in optimizers]
    per_rank_bn = _per_rank_buffers(diff.keys, comparison.ranks)
    if per_rank_bn and not differing_optimizers:
        return per_rank_bn
    held = {_object(p) for p in loaders}
    modules = [o for o in what if o not in optimizers and o not in ("RNGs", "files") and o not in held]
    if modules and optimizers and not differing_optimizers and traces_agree:
        return (f"{', '.join(modules)} differ{'s' if len(modules) == 1 else ''} while the optimizer's state agrees: "
                "an object updated outside the optimizer (an EMA, an AveragedModel, a running statistic) is updated "
                "on a schedule that restarts at a resume. A batch index from `enumerate(loader)` starts at 0 again "
                "after a mid-epoch resume: count such updates with the global step (the step run.steps yields, or "
                "run.step) instead")
    if what == ["RNGs"]:
        which = ", ".join(dict.fromkeys(_rng(k) for k in diff.keys))
        return (f"only the global RNG state differs ({which}): something draws random numbers a different number "
                "of times after a resume (a module built lazily, a shuffle or augmentation outside run.loader); "
                "draw from a generator passed to run.track, or from the same place in both")
    return (f"{', '.join(what)} differ{'s' if len(what) == 1 else ''} after the resume: state the training "
            "depends on is not in run.track (a second optimizer, a scheduler, a GradScaler, a generator, an object "
            "that holds the next batch), or a batch is fetched in the step before the one that trains on it")


def _optimizer_leaf(key: str) -> bool:
    """A tracked object's key that only an optimizer's state_dict has (its `state` and `param_groups`)."""
    parts = key.split(".")
    parts = parts[2:] if parts[0] == "ranks" else parts
    return len(parts) > 2 and parts[2] in ("state", "param_groups")


def _per_rank_buffers(keys: tuple[str, ...], ranks: int) -> str:
    """The hint when only a module's running statistics differ, on one rank, in a run of several ('' if
    not): BatchNorm under DDP without SyncBatchNorm keeps each rank's own, and a rank that resumes with
    another's goes on from other statistics (its weights, which the optimizer updates, still agree)."""
    stats = [k for k in keys if k.rpartition(".")[2] in RUNNING]
    owners = objects(stats)
    if not stats or any(_object(k) in owners and k.rpartition(".")[2] not in RUNNING for k in keys):
        return ""
    on = sorted({k.split(".")[1] if k.startswith("ranks.") else "0" for k in stats})
    if ranks < 2 and not any(k.startswith("ranks.") for k in stats):
        return ""
    rank = f"rank {on[0]}" if len(on) == 1 else f"ranks {', '.join(on)}"
    return (f"{', '.join(owners)}'s BatchNorm buffers differ on {rank} ({name(stats[0])}) while its weights agree: "
            "BatchNorm buffers differ between ranks (DDP without SyncBatchNorm keeps each rank's own), and each rank "
            f"must resume its own; set `kchain_per_rank = True` on {owners[0]}, or use "
            "torch.nn.SyncBatchNorm.convert_sync_batchnorm to keep them equal")


def _rng(key: str) -> str:
    """Which global RNG a key is of: `numpy`, `rank 1's torch`."""
    rank = f"rank {key.split('.')[1]}'s " if key.startswith("ranks.") else ""
    parts = key.split(".")
    parts = parts[2:] if rank else parts
    return rank + (parts[1] if len(parts) > 1 else parts[0])
