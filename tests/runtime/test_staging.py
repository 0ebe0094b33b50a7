"""run.stage's cache (built once, memory-mapped, only the job's own cache dataset) and run.input."""

from __future__ import annotations

import collections
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_run, paths

from kchain.common import layout
from kchain.runtime import staging
from kchain.runtime.run import Run


def test_stage_hits_on_same_params_and_renames_on_a_changed_one(tmp_path, capsys):
    run = make_run(tmp_path)
    builds = []

    def build(p):
        builds.append(p)
        return {"x": np.arange(p["n"], dtype=np.float32), "y": np.zeros(p["n"], dtype=np.int64)}

    first = run.stage("tokens", {"n": 10}, build)
    second = run.stage("tokens", {"n": 10}, build)
    assert len(builds) == 1
    assert "stage tokens: cache hit" in capsys.readouterr().out
    assert isinstance(second["x"], np.memmap) and np.array_equal(first["x"], second["x"])
    run.stage("tokens", {"n": 11}, build)
    assert len(builds) == 2
    names = sorted(p.name for p in paths(run).cache.iterdir())
    assert len(names) == 2 and names[0] != names[1] and all(n.startswith("tokens-") for n in names)
    # Anything else picklable goes through torch.save.
    vocab = run.stage("vocab", {"v": 1}, lambda p: {"chars": ["a", "b"], "v": p["v"]})
    assert vocab == {"chars": ["a", "b"], "v": 1} and (paths(run).cache / f"{names[0].rsplit('.', 1)[0]}.npy").exists()
    run.close()

    # The cache attached as a dataset in a later session (fresh working dir) is a hit too.
    other = tmp_path / "other"
    shutil.copytree(paths(run).cache, other / "input/datasets/me/unit-cache/cache")
    later = make_run(other)
    later.stage("tokens", {"n": 10}, build)
    assert len(builds) == 2
    later.close()


def _mapped_file(address: int) -> str | None:
    """The file a memory address is mapped from (/proc/self/maps), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[4] if len(rest) > 4 else None
    return None


def test_every_staged_kind_comes_back_memory_mapped_and_equal_and_a_miss_builds_once(tmp_path):
    run = make_run(tmp_path)
    builds = []
    g = torch.Generator().manual_seed(0)
    mixed = {"w": torch.randn(64, 1024, generator=g), "ids": np.arange(70_000, dtype=np.int64),
             "pair": (torch.ones(3), np.zeros(20_000, np.float32)), "vocab": ["a", "b"], "n": 7}
    single = np.linspace(0, 1, 50_000, dtype=np.float32)
    mixed["read_only"] = single[:10].copy()
    mixed["read_only"].flags.writeable = False  # e.g. a memmap another run.stage handed back

    def build(p):
        builds.append(p["kind"])
        return mixed if p["kind"] == "mixed" else single

    for attempt in ("miss", "hit"):
        got = run.stage("obj", {"kind": "mixed"}, build)
        entry = str(paths(run).cache / f"obj-{staging.fingerprint('obj', {'kind': 'mixed'})}.pt")
        # Tensors and the numpy arrays inside the dict are views of the cache file, not copies in RAM.
        assert _mapped_file(got["w"].data_ptr()) == entry, attempt
        assert _mapped_file(got["ids"].ctypes.data) == entry, attempt
        assert _mapped_file(got["pair"][1].ctypes.data) == entry, attempt
        assert torch.equal(got["w"], mixed["w"]) and np.array_equal(got["ids"], mixed["ids"])
        assert isinstance(got["pair"], tuple) and torch.equal(got["pair"][0], torch.ones(3))
        assert np.array_equal(got["pair"][1], np.zeros(20_000, np.float32)) and got["pair"][1].dtype == np.float32
        assert got["vocab"] == ["a", "b"] and got["n"] == 7 and np.array_equal(got["read_only"], single[:10])
        arr = run.stage("obj", {"kind": "single"}, build)
        assert isinstance(arr, np.memmap) and np.array_equal(arr, single), attempt
    assert builds == ["mixed", "single"]  # each built exactly once: the miss hands back the saved entry
    run.close()


@dataclasses.dataclass
class Corpus:  # a user's own object holding arrays (module level, so pickle finds it)
    ids: np.ndarray
    offsets: list


def test_a_staged_object_comes_back_exactly_and_its_large_arrays_mapped_wherever_they_sit(tmp_path):
    big = np.arange(40_000, dtype=np.int32)
    fortran = np.asfortranarray(np.arange(60_000, dtype=np.float32).reshape(200, 300))
    read_only = np.arange(20_000, dtype=np.float64)
    read_only.flags.writeable = False
    masked = np.ma.masked_array(np.arange(30_000.0), mask=np.arange(30_000) % 3 == 0)
    objects = {
        "custom": Corpus(ids=big, offsets=[0, 10]),
        "fortran": {"m": fortran},
        "read_only": [read_only],
        "big_endian": (big.astype(">i4"),),  # no tensor dtype: pickled as numpy pickles it
        "small": {"a": np.ones(3)},
        "masked": masked,
        "int_keys": {1: big, 0: big[:5]},  # a folder of <key>.npy would give back "0", "1"
        "unsorted": {"b": big, "a": big[:5]},  # nor this order
        "ordered": collections.OrderedDict(x=big),
        "empty": np.zeros((3, 0)),
    }
    run = make_run(tmp_path)
    for attempt in ("miss", "hit"):
        for name, obj in objects.items():
            got = run.stage(name, {}, lambda p, obj=obj: obj)
            assert type(got) is type(obj) or type(obj) is np.ndarray and type(got) is np.memmap, (name, attempt)
            if isinstance(obj, dict):
                assert list(got) == list(obj), (name, attempt)
        got = {name: run.stage(name, {}, lambda p: 1 / 0) for name in objects}  # hits: nothing rebuilt
        entry = str(paths(run).cache / f"custom-{staging.fingerprint('custom', {})}.pt")
        assert _mapped_file(got["custom"].ids.ctypes.data) == entry and got["custom"].offsets == [0, 10]
        assert np.array_equal(got["custom"].ids, big)
        assert got["fortran"]["m"].flags.f_contiguous and np.array_equal(got["fortran"]["m"], fortran)
        assert _mapped_file(got["fortran"]["m"].ctypes.data) is not None
        assert np.array_equal(got["read_only"][0], read_only) and _mapped_file(got["read_only"][0].ctypes.data)
        assert np.array_equal(got["big_endian"][0], big)  # (numpy's own pickle gives back the native order)
        assert np.array_equal(got["small"]["a"], np.ones(3))
        assert np.array_equal(got["masked"].mask, masked.mask) and np.ma.allequal(got["masked"], masked)
        assert np.array_equal(got["int_keys"][1], big) and np.array_equal(got["unsorted"]["a"], big[:5])
        assert got["empty"].shape == (3, 0)
    run.close()


def test_stage_looks_only_in_its_own_cache_dataset_never_in_other_attached_data(tmp_path, capsys):
    params = {"n": 5}
    entry = f"tokens-{staging.fingerprint('tokens', params)}.pt"
    inputs = tmp_path / "input"
    # Decoys under the exact entry name, in datasets that are not this job's cache: never used.
    for foreign in ("datasets/someone/big-corpus", "datasets/someone/big-corpus/cache/deep", "other-data",
                    "competitions/unit-cache", "datasets/stranger/unit-cache"):
        (inputs / foreign).mkdir(parents=True)
        torch.save({"decoy": foreign}, inputs / foreign / entry)
    builds = []

    def build(p):
        builds.append(p)
        return {"built": p["n"]}

    config = {"job": "unit", "params": {}, "train": {"heartbeat_s": 0}, "kaggle": {"cache_dataset": "me/unit-cache"}}
    run = Run(config, {layout.ROOT_ENV: str(tmp_path)})
    assert run.stage("tokens", params, build) == {"built": 5} and len(builds) == 1
    run.close()
    shutil.rmtree(paths(run).cache)  # a later session: a fresh working dir, the job's cache dataset attached
    own = inputs / "datasets/me/unit-cache"
    own.mkdir(parents=True)
    torch.save({"from": "own cache dataset"}, own / entry)
    run = Run(config, {layout.ROOT_ENV: str(tmp_path)})
    assert run.stage("tokens", params, build) == {"from": "own cache dataset"} and len(builds) == 1
    assert f"cache hit {own / entry}" in capsys.readouterr().out
    run.close()


@pytest.mark.parametrize("named, mounted, found", [
    ("me/unit-cache", "datasets/me/unit-cache", True),
    ("me/unit-cache", "unit-cache", True),  # the legacy layout: <input>/<slug>
    ("me/unit-cache", "datasets/stranger/unit-cache", False),  # the same slug, someone else's
    ("unit-cache", "datasets/anyone/unit-cache", True),  # no owner named: any owner's
    ("unit-cache", "competitions/unit-cache", False),  # not a dataset
])
def test_the_cache_dataset_is_found_where_kaggle_mounts_it_and_nowhere_else(tmp_path, named, mounted, found):
    inputs = tmp_path / "input"
    (inputs / mounted).mkdir(parents=True)
    (inputs / "datasets/someone/big-corpus/deep").mkdir(parents=True)  # other data, never listed into
    expected = [inputs / mounted] if found else []
    assert staging.cache_mounts(inputs, named) == expected


def test_input_finds_both_mount_layouts_and_names_what_is_attached(tmp_path):
    (tmp_path / "input/mnist").mkdir(parents=True)
    (tmp_path / "input/datasets/alice/shakespeare").mkdir(parents=True)
    (tmp_path / "input/competitions/titanic").mkdir(parents=True)
    run = make_run(tmp_path)
    assert run.input("mnist") == tmp_path / "input/mnist"
    assert run.input("shakespeare") == tmp_path / "input/datasets/alice/shakespeare"
    assert run.input("alice/shakespeare") == tmp_path / "input/datasets/alice/shakespeare"
    assert run.input("titanic") == tmp_path / "input/competitions/titanic"
    with pytest.raises(FileNotFoundError) as e:
        run.input("cifar10")
    msg = str(e.value)
    assert "'cifar10' is not attached" in msg and str(tmp_path / "input/datasets/*/cifar10") in msg
    assert "attached: titanic, alice/shakespeare, mnist" in msg
    # A folder of the same name inside someone's data is not a mount: never listed, never returned.
    (tmp_path / "input/datasets/bob/images/cifar10").mkdir(parents=True)
    (tmp_path / "input/photos/cifar10").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        run.input("cifar10")
    (tmp_path / "input/datasets/carol/shakespeare").mkdir(parents=True)
    assert run.input("carol/shakespeare") == tmp_path / "input/datasets/carol/shakespeare"
    assert run.input("nobody/shakespeare") == tmp_path / "input/datasets/alice/shakespeare"  # any owner's
    (tmp_path / "input/models/dave/bert").mkdir(parents=True)
    assert run.input("bert") == tmp_path / "input/models/dave/bert"
    run.close()
