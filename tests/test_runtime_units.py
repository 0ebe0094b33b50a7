"""In-process tests of the runtime's parts: accumulation, staging, preflight, inputs, the loader."""

from __future__ import annotations

import collections
import dataclasses
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from kchain.runtime import data, layout, precision
from kchain.runtime.checkpoint import restore_rng, rng_state
from kchain.runtime.preflight import PreflightError
from kchain.runtime.run import Run
from kchain.runtime.settings import Settings


def make_run(root: Path, params: dict | None = None, env: dict | None = None, **train) -> Run:
    config = {"job": "unit", "params": params or {}, "train": {"heartbeat_s": 0, **train}}
    return Run(config, {layout.ROOT_ENV: str(root), **(env or {})})


def test_accumulate_4_micro_batches_of_64_equals_one_batch_of_256(tmp_path):
    run = make_run(tmp_path)
    torch.manual_seed(0)
    x, y = torch.randn(256, 20), torch.randint(0, 5, (256,))
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
    big = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
    big.load_state_dict(model.state_dict())

    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
    assert isinstance(trainer, precision.Stepper) and precision.Trainer is precision.Stepper  # the old name stays
    for i in range(trainer.accumulate):
        trainer.backward(F.cross_entropy(model(x[i * 64 : (i + 1) * 64]), y[i * 64 : (i + 1) * 64]))
    F.cross_entropy(big(x), y).backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), big.parameters(), strict=True))
    assert diff < 1e-5
    trainer.step()
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    run.close()


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
    names = sorted(p.name for p in run.cache_dir.iterdir())
    assert len(names) == 2 and names[0] != names[1] and all(n.startswith("tokens-") for n in names)
    # Anything else picklable goes through torch.save.
    vocab = run.stage("vocab", {"v": 1}, lambda p: {"chars": ["a", "b"], "v": p["v"]})
    assert vocab == {"chars": ["a", "b"], "v": 1} and (run.cache_dir / f"{names[0].rsplit('.', 1)[0]}.npy").exists()
    run.close()

    # The cache attached as a dataset in a later session (fresh working dir) is a hit too.
    other = tmp_path / "other"
    shutil.copytree(run.cache_dir, other / "input/datasets/me/unit-cache/cache")
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
        entry = str(run.cache_dir / f"obj-{data.fingerprint('obj', {'kind': 'mixed'})}.pt")
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
        entry = str(run.cache_dir / f"custom-{data.fingerprint('custom', {})}.pt")
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
    entry = f"tokens-{data.fingerprint('tokens', params)}.pt"
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
    shutil.rmtree(run.cache_dir)  # a later session: a fresh working dir, the job's cache dataset attached
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
    assert data.cache_mounts(inputs, named) == expected


def test_check_catches_float_labels(tmp_path):
    run = make_run(tmp_path)
    x, y = torch.randn(8, 20), torch.rand(8)
    with pytest.raises(PreflightError) as e:
        run.check(batch=(x, y), num_classes=10)
    assert str(e.value) == (
        "labels have dtype torch.float32; cross-entropy needs an integer class index (torch.int64)"
    )
    assert run.phase == "preflight"  # a crash here is reported as a preflight failure
    run.close()


def test_check_catches_out_of_range_labels_and_shapes(tmp_path, capsys):
    run = make_run(tmp_path)
    x = torch.randn(8, 20)
    with pytest.raises(PreflightError, match=r"labels range over \[3, 10\]; with num_classes=10 they must be in \[0, 10\)"):
        run.check(batch=(x, torch.arange(8) + 3), num_classes=10)
    with pytest.raises(PreflightError, match=r"inputs have shape \(8, 20\); expected \(any, 21\)"):
        run.check(batch=(x, torch.zeros(8, dtype=torch.int64)), x_shape=(None, 21))
    with pytest.raises(PreflightError, match="inputs have dtype torch.float32; expected torch.float16"):
        run.check(batch=(x, torch.zeros(8, dtype=torch.int64)), x_dtype=torch.float16)
    capsys.readouterr()
    run.check(batch=(x, torch.arange(8)), x_shape=(None, 20), x_dtype=torch.float32, num_classes=10,
              label_dtype=torch.int64)
    assert capsys.readouterr().out.count("check ok:") == 4
    run.close()


def test_check_catches_train_val_overlap_and_prints_counts(tmp_path, capsys):
    run = make_run(tmp_path)
    x, y = torch.randn(100, 4), torch.randint(0, 3, (100,))
    train, val = TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])
    run.check(splits={"train": train, "val": val})
    assert "[kchain] splits: train 80 | val 20" in capsys.readouterr().out
    with pytest.raises(PreflightError, match=r"share 80 of 80 sampled rows; expected none \(trained on the wrong split\?\)"):
        run.check(splits={"train": train, "val": train})
    with pytest.raises(PreflightError, match="share"):
        run.check(splits={"train": ["a", "b", "c"], "val": ["c", "d"]})
    run.close()


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


def batches_after_resume(root: Path, workers: int, stop_after: int, more: int):
    """Deliver stop_after batches, checkpoint the loader, then `more` from a fresh loader at that state."""
    data = TensorDataset(torch.arange(50))
    run = make_run(root, {"seed": 7})
    lo = run.loader(data, batch_size=4, num_workers=workers)
    for _ in range(stop_after):
        next(lo)
    state = lo.state_dict()
    straight = [next(lo)[0].tolist() for _ in range(more)]
    again = make_run(root, {"seed": 7}).loader(data, batch_size=4, num_workers=workers)
    again.load_state_dict(state)
    resumed = [next(again)[0].tolist() for _ in range(more)]
    run.close()
    return straight, resumed


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch_with_the_next_batch(tmp_path, workers):
    straight, resumed = batches_after_resume(tmp_path, workers, stop_after=5, more=12)  # crosses an epoch
    assert resumed == straight


def test_loader_order_is_the_same_with_and_without_workers_and_leaves_user_rng_alone(tmp_path):
    class Noisy(TensorDataset):
        def __getitem__(self, i):
            return self.tensors[0][i] + torch.rand(()), np.random.rand(), random.random()

    data = Noisy(torch.zeros(20))
    run = make_run(tmp_path)
    torch.manual_seed(3)
    expected_next = torch.rand(())
    torch.manual_seed(3)
    a = [next(run.loader(data, batch_size=5, num_workers=w)) for w in (0, 2) for _ in range(1)]
    assert torch.rand(()) == expected_next  # fetching in the main process did not consume the user's RNG
    for x, y in zip(a[0], a[1], strict=True):
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))
    lo = run.loader(data, batch_size=5, shuffle=False)
    assert len(list(lo)) == 4 and lo.epoch == 1 and len(list(lo)) == 4 and lo.epoch == 2
    run.close()


def tiny_training(root: Path, steps: int, env: dict | None = None) -> Run:
    run = make_run(root, {"seed": 1}, env, checkpoint_every={"steps": 2})
    model = nn.Linear(3, 2)
    run.track(model=model)
    for step in run.steps(steps):
        with torch.no_grad():
            model.weight += step
        run.log(loss=float(step))
    run.close()
    return run


def test_resume_from_an_attached_state_dataset_and_a_zip(tmp_path, capsys):
    first = tiny_training(tmp_path / "s1", 4)
    assert first.session == 1 and first.finished
    # Next session: fresh working dir, the previous output attached under datasets/<owner>/<slug>.
    s2 = tmp_path / "s2"
    shutil.copytree(first.working, s2 / "input/datasets/me/tiny-state")
    second = tiny_training(s2, 6)
    assert second.resumed_from == 4 and second.session == 2
    assert len(second.metrics_path.read_text().splitlines()) == 6  # one history, no duplicated steps
    # A session whose state came as an un-unpacked zip of the checkpoint directory, in a state
    # dataset (its marker file says so: archives anywhere else are never opened).
    s3 = tmp_path / "s3"
    (s3 / "input/tiny-zip").mkdir(parents=True)
    (s3 / "input/tiny-zip" / layout.STATE_MARKER).write_text("{}")
    with zipfile.ZipFile(s3 / "input/tiny-zip/state.zip", "w") as z:
        ckpt = second.checkpoints / layout.checkpoint_name(6)
        for f in ckpt.iterdir():
            z.write(f, f"{ckpt.name}/{f.name}")
    third = tiny_training(s3, 8)
    assert third.resumed_from == 6 and third.session == 3


def test_other_manifests_under_input_are_ignored(tmp_path):
    (tmp_path / "input/some-data").mkdir(parents=True)
    (tmp_path / "input/some-data/manifest.json").write_text('{"step": 99}')
    run = tiny_training(tmp_path, 2)
    assert run.resumed_from is None


def test_cuda_rng_mismatch_is_said_loudly(capsys):
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2  # saved on a 2-GPU machine
    restore_rng(state)
    out = capsys.readouterr().out
    assert "CUDA RNG states for 2 device(s) but this machine has 0" in out and "NO LONGER BIT-EXACT" in out


def test_smoke_caps_steps_subsets_evenly_and_every_fires_on_the_last_step(tmp_path):
    config = {"job": "unit", "params": {}, "smoke": {"fraction": 0.05, "steps": 20},
              "train": {"heartbeat_s": 0, "checkpoint_every": {"steps": 100}}}
    run = Run(config, {layout.ROOT_ENV: str(tmp_path), layout.SMOKE_ENV: "1"})
    assert run.smoke and run.fraction == 0.05
    labels = np.repeat(np.arange(10), 100)  # sorted by class: the first rows are all class 0
    assert set(run.subset(labels)) == set(range(10)) and len(run.subset(labels)) == 50
    assert len(run.subset(list(range(3)))) == 1 and len(run.subset(TensorDataset(torch.zeros(40)))) == 2
    hits = [step for step in run.steps(1000) if run.every(7)]
    assert hits == [7, 14, 20] and run.step == 20 and run.finished
    run.close()
    assert make_run(tmp_path).subset(labels) is labels


def test_cadence_syntax_and_defaults_agree_with_the_spec():
    from kchain.spec import Job

    def every(text):
        return Settings.parse({}, {layout.CHECKPOINT_EVERY_ENV: text}).every

    assert every("20 steps") == {"steps": 20}
    assert every("10m") == {"seconds": 600.0}
    assert every("30s") == {"seconds": 30.0}
    with pytest.raises(ValueError, match="KCHAIN_CHECKPOINT_EVERY='ten minutes' is not a cadence; write e.g."):
        every("ten minutes")
    # A Run built with no train: config plans like a job.yaml without one.
    plain = Settings.parse({}, {}, started=0.0)
    spec = Job(name="defaults", code="train.py")
    assert plain.margin_s == 15 * 60 == settings_seconds(spec.train.margin)
    assert plain.limit_s == settings_seconds(spec.train.session_limit)
    assert plain.every == {"seconds": settings_seconds(spec.train.checkpoint_every)}
    assert plain.keep == spec.train.keep and plain.heartbeat_s == settings_seconds(spec.train.heartbeat)
    smoke = Settings.parse({}, {layout.SMOKE_ENV: "1"})
    assert (smoke.fraction, smoke.smoke_steps) == (spec.smoke.fraction, spec.smoke.steps)


def settings_seconds(text) -> float:
    from kchain.runtime.settings import parse_duration

    return parse_duration(text)


def test_tracking_after_the_loop_started_is_refused(tmp_path):
    run = Run({"job": "late-track", "params": {}, "train": {"checkpoint_every": {"steps": 100}}},
              env={"KCHAIN_ROOT": str(tmp_path)})
    model = torch.nn.Linear(2, 2)
    for _ in run.steps(1):
        with pytest.raises(RuntimeError, match=r"run.track\(model=...\) after run.steps started"):
            run.track(model=model)
    run.close()


def test_bf16_on_a_gpu_without_it_is_refused_with_the_reason():
    from kchain.runtime.precision import choose_dtype

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"bf16 but this GPU \(compute capability 7.5, e.g. a T4\) has no bf16"):
        choose_dtype(cuda, "bf16", capability=(7, 5))
    assert choose_dtype(cuda, "bf16", capability=(8, 0))[0] == torch.bfloat16
    assert choose_dtype(cuda, "auto", capability=(7, 5))[0] == torch.float16


def test_fp16_autocast_without_run_optimize_warns_once_with_the_fix(tmp_path, capsys):
    run = make_run(tmp_path)
    run.dtype = torch.float16  # what a T4 gets; the warning does not depend on the device
    capsys.readouterr()
    for _ in range(3):
        with run.autocast():
            pass
    out = capsys.readouterr().out
    assert out.count("WARNING: run.autocast() in fp16 without run.optimize") == 1
    assert "trainer = run.optimize(opt)" in out
    run.optimize(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))  # makes the GradScaler
    assert "scaler" in run._tracked
    run.close()


def test_a_long_evaluation_in_run_every_stays_in_the_deadline_plan(tmp_path):
    import time

    run = make_run(tmp_path, checkpoint_every={"steps": 1000})
    for step in run.steps(16):
        if run.every(5) and step <= 10:
            time.sleep(0.3)  # the evaluation at steps 5 and 10
    run.close()
    evaluation = run._eval_s
    assert evaluation >= 0.3 and max(run._step_times) < evaluation  # it left the recent-steps window
    # Steps 17..: plan with it before an evaluation step only (time left: between the two).
    run._stop_reason, run.total = None, 30
    # The deadline is the session's end less what is kept back: put it between a step and an evaluation.
    run.end = time.time() + run._reserve_s() + (evaluation + max(run._step_times)) / 2
    run.writer.last_write_s, run.stalls = 0.0, [0.0]
    run.step = 17  # step 18: no evaluation, enough time
    assert not run._should_stop()
    run.step = 19  # step 20 evaluates
    assert run._should_stop() and run._stop_reason == "deadline"


def test_foreign_archives_and_manifests_under_input_are_never_opened(tmp_path, capsys):
    first = tiny_training(tmp_path / "s1", 2)
    s2 = tmp_path / "s2"
    # Someone's dataset holding a zip of a real kchain checkpoint and a .tar.gz that is not even
    # gzip: without the state marker next to them, neither is read, extracted or listed.
    data = s2 / "input/datasets/someone/images"
    data.mkdir(parents=True)
    with zipfile.ZipFile(data / "ckpt.zip", "w") as z:
        ckpt = first.checkpoints / layout.checkpoint_name(2)
        for f in ckpt.iterdir():
            z.write(f, f"inner/{f.name}")
    (data / "shards.tar.gz").write_bytes(b"not a gzip stream")
    capsys.readouterr()
    run = tiny_training(s2, 3)
    assert run.resumed_from is None and run.session == 1
    assert "skipping archive" not in capsys.readouterr().out
    scratch = run.dir / ".scratch"
    assert not scratch.exists() or not any(scratch.iterdir())


def test_loader_workers_under_a_temp_dir_too_long_for_their_sockets_are_refused(tmp_path, monkeypatch):
    """Past 107 bytes a worker's socket cannot bind: its batch is lost and the loader would wait forever."""
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    run = make_run(tmp_path / "root")
    data = TensorDataset(torch.randn(32, 4))
    with pytest.raises(PreflightError, match=r"set TMPDIR to a shorter directory"):
        run.loader(data, batch_size=8, num_workers=2)
    lo = run.loader(data, batch_size=8, num_workers=0)  # no workers, no sockets: allowed
    assert next(lo)[0].shape == (8, 4)
    monkeypatch.setattr(tempfile, "tempdir", None)  # the fixture's short TMPDIR: workers deliver
    lo = run.loader(data, batch_size=8, num_workers=2, name="with_workers")
    assert next(lo)[0].shape == (8, 4)
    run.close()
    del run, lo  # the persistent workers end with their loader, before the fixture removes TMPDIR
    import gc

    gc.collect()


def test_a_consumer_that_reads_exactly_len_batches_gets_every_epoch_whole(tmp_path):
    # Lightning's fit loop takes len(loader) batches an epoch and never asks for the end: each new
    # pass must be the next epoch, not the empty rest of the last one (half the epochs were empty).
    run = make_run(tmp_path)
    lo = run.loader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=False)
    epochs = []
    for _ in range(3):
        it = iter(lo)
        epochs.append([next(it)[0].tolist() for _ in range(len(lo))])
    assert epochs == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]] * 3 and lo.epoch == 2
    run.close()
