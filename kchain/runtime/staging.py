"""Staging and inputs: run.stage's cache (built once, saved atomically, loaded memory-mapped) and
finding what is attached under the input root (/kaggle/input).

Only mount points are ever listed (layout.mounts), never what an attached input holds, so finding
an input or the job's own cache dataset costs the same however much else is attached.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kchain.common import layout
from kchain.common.atomic import fsync_path

ARRAYS_EXT = "npy"  # one array, or a folder of <key>.npy files (a dict of arrays): loaded memory-mapped
PICKLE_EXT = "pt"  # anything else torch.save can pickle: loaded with torch.load(mmap=True)
PICKLE_PROTOCOL = 4  # see _save
_SAFE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # a dict key that is also a file name
MAPPED_MIN_BYTES = 64 * 1024  # a staged numpy array this large comes back memory-mapped (_MappingPickler)
CACHE_SUFFIX = "-cache"  # the job's cache dataset is <owner>/<job>-cache (kchain/store/names.py)


def fingerprint(name: str, params) -> str:
    """12 hex chars from name+params: change a parameter and the cache file name changes."""
    blob = json.dumps({"name": name, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _is_array(obj) -> bool:
    """One plain numpy array that a .npy file holds exactly (a masked array would lose its mask)."""
    return type(obj) in (np.ndarray, np.memmap) and not obj.dtype.hasobject


def _is_arrays(obj) -> bool:
    """A dict of arrays that a folder of <key>.npy gives back exactly: a plain dict whose keys are file
    names, in the sorted order the folder is read back in. Any other mapping goes to the pickle."""
    keys = list(obj) if type(obj) is dict else []
    return (bool(keys) and keys == sorted(keys, key=str) and all(type(k) is str and _SAFE_KEY.fullmatch(k) for k in keys)
            and all(_is_array(v) for v in obj.values()))


def _mapped_array(tensor: torch.Tensor, fortran: bool) -> np.ndarray:
    """How _MappingPickler's arrays are rebuilt: a view of the tensor's storage, which torch.load(mmap=True)
    maps from the entry's file, so the array is read only where it is touched."""
    arr = tensor.numpy()
    return arr.T if fortran else arr


class _MappingPickler(pickle.Pickler):
    """The pickler torch.save uses for a staged entry: every numpy array of MAPPED_MIN_BYTES or more,
    wherever it sits (a dict, a list, a dataclass, a user's class), is written as a tensor, so
    its bytes become a storage of their own in the file and come back memory-mapped (_mapped_array).

    Smaller arrays, object and string arrays, subclasses that carry more than their data (masked
    arrays, matrices) and dtypes torch has no tensor for are pickled as numpy pickles them.
    """

    def reducer_override(self, obj):
        if not _is_array(obj) or obj.nbytes < MAPPED_MIN_BYTES or not obj.dtype.isnative:  # (torch: native order)
            return NotImplemented
        fortran = obj.ndim > 1 and obj.flags.f_contiguous and not obj.flags.c_contiguous
        try:
            with warnings.catch_warnings():  # a read-only array (a staged memmap): torch.save only reads it
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(np.ascontiguousarray(obj.T if fortran else obj))
        except (TypeError, ValueError):  # no tensor dtype for it (strings, structured)
            return NotImplemented
        return _mapped_array, (tensor, fortran)


class _MappingPickleModule(types.ModuleType):
    """What torch.save takes as its pickle_module: a module (torch reads its __name__) with our Pickler."""

    Pickler = _MappingPickler


_MAPPING_PICKLE = _MappingPickleModule("kchain_mapping_pickle")


def _load(path: Path):
    """An entry memory-mapped: a hit costs opening the files, not reading them."""
    if path.is_dir():  # a dict of arrays
        return {p.stem: np.load(p, mmap_mode="r") for p in sorted(path.glob("*.npy"), key=lambda p: p.stem)}
    if path.suffix == f".{ARRAYS_EXT}":  # one array
        return np.load(path, mmap_mode="r")
    # weights_only=False: an entry may be any picklable object, and it is this job's own cache
    # (kchain's working dir, or the job's own <job>-cache dataset), never a foreign file.
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def _save(obj, final: Path) -> None:
    """Write an entry under a temporary name, fsync it, then rename it into place."""
    tmp = final.with_name(f"{layout.TMP_PREFIX}{final.name}-{os.getpid()}")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    if _is_arrays(obj):
        tmp.mkdir(parents=True)
        for key, arr in obj.items():
            np.save(tmp / f"{key}.npy", arr)
            fsync_path(tmp / f"{key}.npy")
        fsync_path(tmp)
    elif _is_array(obj):
        with open(tmp, "wb") as f:
            np.save(f, obj)
    else:
        # Protocol 4 (frames, short strings) unpickles a list of strings about twice as fast as torch's 2.
        torch.save(obj, tmp, pickle_module=_MAPPING_PICKLE, pickle_protocol=PICKLE_PROTOCOL)
    if not tmp.is_dir():
        fsync_path(tmp)
    os.replace(tmp, final)  # atomic: a killed build never leaves a half entry that looks complete
    fsync_path(final.parent)


def cache_mounts(input_root: Path, dataset: str) -> list[Path]:
    """Where the job's own cache dataset (`[owner/]<job>-cache`) is mounted (layout.mounts: only
    the input root and its dataset and owner folders are listed, never what an input holds)."""
    owner, _, slug = dataset.rpartition("/")
    return [m for m in layout.mounts(input_root, ("datasets",))
            if m.name == slug and (not owner or m.parent == input_root or m.parent.name == owner)]


def _find_entry(names: list[str], cache_dir: Path, input_root: Path, dataset: str | None) -> Path | None:
    """This session's cache first, then the cache dataset: its top level, or its cache/ folder."""
    for path in (cache_dir / n for n in names):
        if path.exists():
            return path
    for mount in cache_mounts(input_root, dataset) if dataset else []:
        for path in (folder / n for folder in (mount, mount / layout.CACHE_DIR) for n in names):
            if path.exists():
                return path
    return None


def stage(name: str, params, build: Callable, cache_dir: Path, input_root: Path, dataset: str | None = None):
    """build(params) once per distinct (name, params); later calls load the saved result, memory-mapped.

    `dataset` names the job's cache dataset (`owner/<job>-cache`, or `<job>-cache` with any owner):
    only where it is mounted is looked at, never anything else attached.
    """
    stem = f"{name}-{fingerprint(name, params)}"
    names = [f"{stem}.{ARRAYS_EXT}", f"{stem}.{PICKLE_EXT}"]
    t0 = time.perf_counter()
    path = _find_entry(names, cache_dir, input_root, dataset)
    if path is not None:
        obj = _load(path)
        print(f"[kchain] stage {name}: cache hit {path} ({time.perf_counter() - t0:.3f}s)", flush=True)
        return obj
    obj = build(params)
    final = cache_dir / (names[0] if _is_arrays(obj) or _is_array(obj) else names[1])
    cache_dir.mkdir(parents=True, exist_ok=True)
    _save(obj, final)
    del obj  # the caller gets the mapped entry, as on a hit: the built copy can be freed
    print(f"[kchain] stage {name}: built in {time.perf_counter() - t0:.1f}s, saved {final}", flush=True)
    return _load(final)


def attached(input_root: Path) -> list[str]:
    """The slugs of everything attached, e.g. ['mnist', 'owner/state', 'google/gemma/transformers/2b/1']:
    a Kaggle Model by each of its mounted versions."""
    out: list[str] = []
    if not input_root.is_dir():
        return out
    for p in sorted(input_root.iterdir()):
        if p.name in layout.INPUT_KINDS and p.is_dir():
            for q in sorted(p.iterdir()):
                subs = sorted(q.iterdir()) if p.name != "competitions" and q.is_dir() else []
                found = []
                for s in (s for s in subs if s.is_dir()):
                    versions = layout.model_versions(s, legacy=False) if p.name == "models" else []
                    found += [f"{q.name}/{v.relative_to(q).as_posix()}" for v in versions] or [f"{q.name}/{s.name}"]
                out += found or [q.name]
        else:
            versions = layout.model_versions(p, legacy=True) if p.is_dir() else []
            out += [v.relative_to(input_root).as_posix() for v in versions] or [p.name]
    return out


def find_input(slug: str, input_root: Path) -> Path:
    """The mounted folder of an attached input; `slug` may be 'name' or 'owner/name', and a Kaggle
    Model also 'owner/model/framework/variation/version'.

    Only mount points are looked at: <input>/<name>, <input>/competitions/<name>, then
    <input>/<kind>/<owner>/<name> (datasets, notebooks, models; that owner's first when one is
    given). Nothing inside an attached input is listed, so the call costs the same whatever else
    is attached. A model's answer is its version folder, where the weights are
    (<mount>/<framework>/<variation>/<version>, layout.model_versions).
    """
    parts = slug.rstrip("/").split("/")
    if len(parts) == 5:
        return _find_model_version(slug, parts, input_root)
    name, owner = parts[-1], parts[0] if len(parts) > 1 else None
    mounted = [m for m in layout.mounts(input_root, layout.OWNED_KINDS) if m.name == name]
    competition = input_root / "competitions" / name
    for tier in ([m for m in mounted if m.parent == input_root], [competition] if competition.is_dir() else [],
                 [m for m in mounted if m.parent != input_root]):
        if owner:  # owner given: prefer the mount under that owner
            tier = [p for p in tier if p.parent.name == owner] or tier
        if tier:
            return _model_version_or_mount(slug, tier[0], input_root)
    tried = [input_root / name, competition, *(input_root / k / "*" / name for k in layout.OWNED_KINDS)]
    raise _not_attached(slug, tried, input_root)


def _model_version_or_mount(slug: str, mount: Path, input_root: Path) -> Path:
    """A model's one mounted version folder, else the mount itself (a dataset, a competition, a
    kernel's output, or a model folder without the framework/variation/version levels)."""
    legacy = mount.parent == input_root
    if not legacy and mount.parent.parent != input_root / "models":
        return mount
    versions = layout.model_versions(mount, legacy)
    if len(versions) > 1:
        raise ValueError(f"input {slug!r} is a model attached in {len(versions)} versions "
                         f"({', '.join(str(v) for v in versions)}); name one in full, "
                         "e.g. run.input('owner/model/framework/variation/version')")
    return versions[0] if versions else mount


def _find_model_version(slug: str, parts: list[str], input_root: Path) -> Path:
    """owner/model/framework/variation/version, where Kaggle mounts it: the 2025+ layout, then the
    legacy one (which has no owner level); the framework as Kaggle matches it (case aside)."""
    owner, model, framework, variation, version = parts
    want = (layout.model_framework_key(framework), variation, version)
    bases = [input_root / "models" / owner / model, input_root / model]
    for base in bases:
        for found in layout.model_versions(base, legacy=base.parent == input_root):
            rel = found.relative_to(base).parts
            if (layout.model_framework_key(rel[0]), rel[1], rel[2]) == want:
                return found
    mount = layout.model_mount("/".join(parts))
    raise _not_attached(slug, [input_root / mount, input_root / Path(*mount.parts[2:])], input_root)


def _not_attached(slug: str, tried: list[Path], input_root: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"input {slug!r} is not attached: looked in {', '.join(map(str, tried))}; attached: "
        f"{', '.join(attached(input_root)) or 'nothing'}. Add it to the job's inputs"
    )
