"""Checkpoints sized for a Kaggle box: failed writes, pruning, verification, fallbacks, tied weights,
the one-pass hashing of state.pt and the search for attached state.

Session deaths are real SIGKILLs and the file-size limit is a real RLIMIT_FSIZE in the child.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import paths
from torch import nn

from kchain.common import checkpoint_files, layout, publishplan
from kchain.common.checkpoint_files import (
    CheckpointInvalid,
    CheckpointsDamaged,
    CheckpointTooLarge,
    candidates,
    find_latest,
    make_room,
    read_manifest,
    sha256_of,
    verify,
)
from kchain.emulator.app import PATIENCE_S
from kchain.runtime.checkpoint import snapshot
from kchain.runtime.checkpoint.state import load_state, load_verified
from kchain.runtime.run import Run

REPO = Path(__file__).resolve().parents[3]
JOBS = REPO / "tests" / "runtime_jobs"
KILLED = -9
PARAMS = {"d_model": 2048, "steps": 12, "workers": 0, "accumulate": 1, "dropout": 0.2, "lr": 0.01}  # ~400 KB of state


def launch(root: Path, params: dict, fsize: int | None = None, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cfg.json").write_text(json.dumps({
        "job": "tiny", "entry": "tiny_job:main", "params": params, "fingerprint": "f00d",
        "train": {"checkpoint_every": {"steps": 3}, "keep": 2, "heartbeat_s": 0},
    }))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), **env)

    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(root / "cfg.json")], env=child_env,
                          cwd=root, capture_output=True, text=True, timeout=PATIENCE_S, preexec_fn=limit)


def kdir(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR


def losses(root: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (kdir(root) / layout.METRICS).read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_a_write_over_the_file_size_limit_is_reported_and_the_previous_checkpoint_stays(tmp_path):
    first = launch(tmp_path, {**PARAMS, "steps": 6})
    assert first.returncode == 0, first.stderr
    # Session 2 cannot write a state file (RLIMIT_FSIZE below its size), and its summary's temporary
    # file sits on a full disk (/dev/full): the summary still lands, in the space reserved for it.
    os.symlink("/dev/full", kdir(tmp_path) / f"{layout.TMP_PREFIX}{layout.SUMMARY}")
    failed = launch(tmp_path, PARAMS, fsize=200_000)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    line = next(x for x in failed.stdout.splitlines() if "checkpoint write failed" in x)
    assert line.startswith("[kchain] WARNING: checkpoint write failed: file too large (a file-size limit) on ")
    assert "(needs " in line and "the previous checkpoint stays in use" in line
    assert "written into the space reserved for it" in failed.stdout
    got = json.loads((kdir(tmp_path) / layout.SUMMARY).read_text())
    assert got["status"] == "crashed" and got["error"]["type"] == "CheckpointWriteFailed"
    assert got["checkpoint"] == f"kchain/checkpoints/{layout.checkpoint_name(6)}"
    ckpts = kdir(tmp_path) / layout.CHECKPOINTS_DIR
    assert not [p for p in ckpts.iterdir() if p.name.startswith(layout.TMP_PREFIX)]  # its temp folder went
    verify(ckpts / layout.checkpoint_name(6))
    # Session 3 (room again) resumes from step 6 and matches an uninterrupted run exactly.
    done = launch(tmp_path, PARAMS)
    assert done.returncode == 0 and "resumed from step 6" in done.stdout, done.stdout + done.stderr
    ref = launch(tmp_path / "ref", PARAMS)
    assert ref.returncode == 0
    assert losses(tmp_path) == losses(tmp_path / "ref")


def test_a_sigkill_in_the_middle_of_a_prune_leaves_no_half_checkpoint(tmp_path):
    died = launch(tmp_path, PARAMS, KCHAIN_FAULT="kill_in_save=in_prune")  # at step 9: step-3 is pruned
    assert died.returncode == KILLED, died.stdout + died.stderr
    ckpts = kdir(tmp_path) / layout.CHECKPOINTS_DIR
    names = sorted(p.name for p in ckpts.iterdir())
    assert [n for n in names if n.startswith(layout.CHECKPOINT_PREFIX)] == [layout.checkpoint_name(s) for s in (6, 9)]
    assert any(n.startswith(f"{layout.TMP_PREFIX}prune-") for n in names)
    done = launch(tmp_path, PARAMS)
    assert "resumed from step 9" in done.stdout, done.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == [layout.checkpoint_name(s) for s in (9, 12)]


def make_run(root: Path, **env: str) -> Run:
    return Run({"job": "unit", "params": {}, "train": {"heartbeat_s": 0, "checkpoint_every": {"steps": 2}, "keep": 2}},
               {layout.ROOT_ENV: str(root), **env})


def train(root: Path, steps: int, model: nn.Module | None = None, **env: str) -> Run:
    run = make_run(root, **env)
    model = model or nn.Linear(4, 4)
    run.track(model=model)
    for step in run.steps(steps):
        with torch.no_grad():
            model.weight += step
        run.log(loss=float(model.weight.detach().sum()))
    run.close()
    return run


def test_a_manifest_without_its_file_list_does_not_verify(tmp_path):
    run = train(tmp_path, 2)
    ckpt = paths(run).checkpoints / layout.checkpoint_name(2)
    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    del manifest["files"]
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointInvalid, match="no file list with state.pt"):
        verify(ckpt)


def test_a_checkpoint_that_verifies_but_does_not_load_falls_back(tmp_path, capsys):
    train(tmp_path, 4)
    newest = kdir_of(tmp_path) / layout.checkpoint_name(4)
    (newest / layout.STATE_FILE).write_bytes(b"not a torch file")
    manifest = json.loads((newest / layout.MANIFEST).read_text())
    manifest["files"][layout.STATE_FILE] = {"sha256": sha256_of(newest / layout.STATE_FILE), "size": 16}
    (newest / layout.MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    run = train(tmp_path, 6)
    assert f"checkpoint {newest} verifies but does not load" in capsys.readouterr().out
    assert run.resumed_from == 2 and run.finished


def kdir_of(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR


def test_when_every_checkpoint_is_damaged_the_run_stops_naming_them(tmp_path):
    first = train(tmp_path / "s1", 4)
    state = tmp_path / "s2/input/datasets/me/job-state"
    shutil.copytree(first._paths.checkpoints / layout.checkpoint_name(4), state)
    (state / layout.STATE_MARKER).write_text("{}")
    (state / layout.STATE_FILE).write_bytes(b"x")
    run = make_run(tmp_path / "s2")
    run.track(model=nn.Linear(4, 4))
    with pytest.raises(CheckpointsDamaged, match=rf"every checkpoint found is damaged: {state}/state.pt: 1 bytes"):
        run.restore()
    assert run.launcher.phase == "resume"
    # A first session with nothing attached starts fresh.
    assert train(tmp_path / "s3", 2).resumed_from is None


def test_tied_weights_are_written_once(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.out = nn.Linear(64, 1000, bias=False)
            self.out.weight = self.emb.weight
            self.weight = self.emb.weight  # what train() updates

    for stream in ("0", "1"):
        root = tmp_path / stream
        model = Tied()
        run = train(root, 2, model, KCHAIN_CHECKPOINT_STREAM=stream)
        path = paths(run).checkpoints / layout.checkpoint_name(2) / layout.STATE_FILE
        one_copy = 1000 * 64 * 4
        assert one_copy < path.stat().st_size < 1.5 * one_copy, stream
        saved = load_state(path.parent)["tracked"]["model"]
        assert saved["emb.weight"].untyped_storage().data_ptr() == saved["out.weight"].untyped_storage().data_ptr()


def test_resume_loads_memory_mapped(tmp_path):
    run = train(tmp_path, 2)
    path = paths(run).checkpoints / layout.checkpoint_name(2)
    state = load_state(path)
    maps = Path("/proc/self/maps").read_text()
    assert str(path / layout.STATE_FILE) in maps
    del state


def test_make_room_prunes_the_oldest_first_and_refuses_in_one_line(tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4):
        (ckpts / layout.checkpoint_name(step)).mkdir(parents=True)
        (ckpts / layout.checkpoint_name(step) / layout.STATE_FILE).write_bytes(b"x" * 1000)
    free = {"bytes": 1500}

    def disk_usage(path):
        gone = 2 - len([p for p in ckpts.iterdir() if p.name.startswith(layout.CHECKPOINT_PREFIX)])
        return shutil._ntuple_diskusage(10**6, 0, free["bytes"] + 1000 * gone)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)  # the disk's free space, not a kchain function
    assert make_room(ckpts, 1000) is None  # fits: nothing pruned
    assert make_room(ckpts, 2000) == f"pruned {layout.checkpoint_name(2)} before writing to make room"
    assert sorted(p.name for p in ckpts.iterdir()) == [layout.checkpoint_name(4)]  # the newest stays
    with pytest.raises(CheckpointTooLarge) as e:
        make_room(ckpts, 10_000)
    assert str(e.value).startswith(f"checkpoint needs 10 KB but {ckpts} has 2 KB free (the newest checkpoint, ")
    assert "set train.keep: 1" in str(e.value)


def test_a_state_two_copies_of_which_cannot_fit_is_refused_at_the_first_save(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path)
    run.track(model=nn.Linear(100, 100))  # 40 KB of weights + 12 KB of RNG states, pickled ints counted
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 0, 50_000))
    with pytest.raises(CheckpointTooLarge) as e:
        run.save(1)
    assert str(e.value).startswith("checkpoint needs 52 KB, and two must fit while one is written (0.1 MB), but ")
    assert "has 50 KB for checkpoints: free disk space" in str(e.value)
    monkeypatch.undo()
    run.save(1)
    run.close()
    assert ("checkpoint plan: 52 KB per checkpoint, keep 2 + the best by the first val* metric kept whole "
            "(train.keep_best: up to 52 KB more per state version) + 1 being written = 0.2 MB") in capsys.readouterr().out


class DataOrder:
    """State that is mostly Python objects and a numpy array: a data order, a vocabulary, counts."""

    def __init__(self):
        self.order = list(range(300_000))  # ~1.4 MB pickled, no tensor in it
        self.vocab = {f"word-{i}": i for i in range(20_000)}
        self.counts = np.arange(50_000, dtype=np.int64)  # 400 KB

    def state_dict(self):
        return {"order": self.order, "vocab": self.vocab, "counts": self.counts}

    def load_state_dict(self, state):
        self.order, self.vocab, self.counts = state["order"], state["vocab"], state["counts"]


def test_the_size_estimate_counts_what_is_not_tensors():
    model = nn.Linear(100, 100)
    state = {"model": model.state_dict(), "tied": model.weight, "data": DataOrder().state_dict(),
             "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state())}
    written = io.BytesIO()
    torch.save(state, written)
    assert 0.95 < publishplan.state_bytes(state) / len(written.getvalue()) < 1.05


def test_the_checkpoint_plan_states_the_size_of_a_mostly_python_state(tmp_path, capsys):
    run = make_run(tmp_path)
    run.track(model=nn.Linear(4, 4), data=DataOrder())
    run.save(1)
    run.close()
    said = next(line for line in capsys.readouterr().out.splitlines() if "checkpoint plan: " in line)
    planned = float(said.split("checkpoint plan: ")[1].split(" MB per checkpoint")[0]) * 1e6
    written = (paths(run).checkpoints / layout.checkpoint_name(1) / layout.STATE_FILE).stat().st_size
    assert 0.9 < planned / written < 1.1, said


# --- one pass over state.pt: hashed as written, hashed as read ---------------------------------


@pytest.mark.parametrize("stream", ["0", "1"])
def test_the_checksum_hashed_while_writing_is_the_files(tmp_path, stream):
    run = train(tmp_path, 2, nn.Linear(300, 300), KCHAIN_CHECKPOINT_STREAM=stream)  # ~360 KB: hashed in blocks
    ckpt = paths(run).checkpoints / layout.checkpoint_name(2)
    manifest = verify(ckpt)
    data = (ckpt / layout.STATE_FILE).read_bytes()
    assert manifest["files"][layout.STATE_FILE] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def flip_a_weight_byte(ckpt: Path, weight: torch.Tensor) -> None:
    """Corrupt one byte inside a tensor's data: the zip and the pickle stay intact, so it still loads."""
    path = ckpt / layout.STATE_FILE
    data = bytearray(path.read_bytes())
    at = data.find(weight.detach().numpy().tobytes()) + 7
    assert at > 7
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_byte_flipped_in_state_pt_is_caught_as_it_is_read_and_the_previous_checkpoint_is_used(tmp_path, capsys):
    model = nn.Linear(64, 64)
    first = train(tmp_path, 4, model)
    newest = first._paths.checkpoints / layout.checkpoint_name(4)
    flip_a_weight_byte(newest, model.weight)
    loaded = torch.load(newest / layout.STATE_FILE, weights_only=False)  # torch alone would not notice
    assert not torch.equal(loaded["tracked"]["model"]["weight"], model.weight)
    with pytest.raises(CheckpointInvalid, match="sha256 does not match the manifest"):
        load_verified(newest, read_manifest(newest))
    capsys.readouterr()
    resumed = train(tmp_path, 6, nn.Linear(64, 64))
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: {newest / layout.STATE_FILE}: sha256 does not match the manifest" in out
    assert resumed.resumed_from == 2 and resumed.finished
    assert any(p.name.startswith(f"{layout.CORRUPT_PREFIX}{newest.name}") for p in first._paths.checkpoints.iterdir())


def test_the_hash_started_at_run_start_is_used_only_for_the_file_it_hashed(tmp_path, capsys):
    """Run() starts hashing the newest state.pt (overlapping the user's set-up); a file changed after
    that is hashed again as it is read, so a byte flipped late is still caught."""
    model = nn.Linear(64, 64)
    first = train(tmp_path, 4, model)
    newest = first._paths.checkpoints / layout.checkpoint_name(4)
    run = make_run(tmp_path)  # the early hash of the intact file starts here
    flip_a_weight_byte(newest, model.weight)  # ... and the file changes while the user builds a model
    live = nn.Linear(64, 64)
    run.track(model=live)
    capsys.readouterr()
    assert run.restore() == 2
    assert f"skipping checkpoint {newest}: {newest / layout.STATE_FILE}: sha256 does not match" in capsys.readouterr().out
    run.close()
    # Unchanged since Run(): the early digest is the one used, and the state is the checkpoint's.
    again = train(tmp_path / "again", 4, nn.Linear(64, 64))
    newest = again._paths.checkpoints / layout.checkpoint_name(4)
    run = make_run(tmp_path / "again")
    assert str(newest / layout.STATE_FILE) in checkpoint_files._early
    live = nn.Linear(64, 64)
    run.track(model=live)
    assert run.restore() == 4
    assert str(newest / layout.STATE_FILE) not in checkpoint_files._early  # taken by load_verified
    assert torch.equal(live.weight, torch.load(newest / layout.STATE_FILE, weights_only=False)["tracked"]["model"]["weight"])
    run.close()


def test_an_intact_checkpoint_loads_verified_as_torch_loads_it(tmp_path):
    run = train(tmp_path, 2, nn.Linear(64, 64))
    ckpt = paths(run).checkpoints / layout.checkpoint_name(2)
    got = load_verified(ckpt, read_manifest(ckpt))["tracked"]["model"]
    want = torch.load(ckpt / layout.STATE_FILE, weights_only=False)["tracked"]["model"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# --- the search: kchain's own inputs at their mount points, nothing else -----------------------


def state_version(ckpt: Path, dest: Path, marker: bool = True) -> Path:
    """A flat state dataset version, as kchain publishes one (statefolder.py)."""
    shutil.copytree(ckpt, dest)
    if marker:
        (dest / layout.STATE_MARKER).write_text("{}\n")
    return dest


@pytest.mark.parametrize("where", ["legacy", "datasets", "notebook output", "slug without marker"])
def test_the_search_finds_a_state_dataset_in_each_mount_layout(tmp_path, where):
    ckpt = train(tmp_path / "s1", 2)._paths.checkpoints / layout.checkpoint_name(2)
    inp = tmp_path / "s2" / layout.INPUT_DIR
    slug = None
    if where == "legacy":
        want = state_version(ckpt, inp / "unit-state")
    elif where == "datasets":
        want = state_version(ckpt, inp / "datasets/me/unit-state")
    elif where == "notebook output":  # a kernel's /kaggle/working attached as its output
        want = inp / "notebooks/me/unit" / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / ckpt.name
        shutil.copytree(ckpt, want)
    else:  # no marker: known by the slug the job's config names
        want = state_version(ckpt, inp / "datasets/me/unit-state", marker=False)
        slug = "unit-state"
    state_version(ckpt, inp / "datasets/me/unit-state-copy", marker=False)  # not ours: no marker, another slug
    found = candidates(tmp_path / "none", inp, tmp_path / "scratch", state_slug=slug)
    assert found == [want]
    latest = find_latest(tmp_path / "none", inp, tmp_path / "scratch", "unit", state_slug=slug)
    assert latest is not None
    assert latest[0] == want


def test_a_run_finds_its_state_dataset_by_the_slug_in_its_config(tmp_path):
    ckpt = train(tmp_path / "s1", 2)._paths.checkpoints / layout.checkpoint_name(2)
    state_version(ckpt, tmp_path / "s2/input/datasets/me/unit-state", marker=False)
    config = {"job": "unit", "params": {}, "train": {"heartbeat_s": 0, "checkpoint_every": {"steps": 2}},
              "kaggle": {"state_dataset": "me/unit-state"}}
    run = Run(config, {layout.ROOT_ENV: str(tmp_path / "s2"), layout.SMOKE_ENV: "1"})
    run.track(model=nn.Linear(4, 4))
    assert run.restore() == 2


def test_a_foreign_input_is_never_listed_and_its_checkpoints_never_used(tmp_path, monkeypatch):
    ckpt = train(tmp_path / "s1", 4)._paths.checkpoints / layout.checkpoint_name(4)
    s2 = tmp_path / "s2"
    state = state_version(train(tmp_path / "s0", 2)._paths.checkpoints / layout.checkpoint_name(2),
                          s2 / "input/datasets/me/unit-state")
    # Someone's dataset: wide and deep, holding a real (newer) kchain checkpoint three levels down.
    foreign = s2 / "input/datasets/someone/images"
    deep = foreign.joinpath(*[f"level{i}" for i in range(12)])
    deep.mkdir(parents=True)
    for i in range(2000):
        (foreign / f"{i}.png").write_bytes(b"")
    shutil.copytree(ckpt, foreign / "level0/level1" / ckpt.name)
    (s2 / "input/competitions/titanic").mkdir(parents=True)
    listed: list[str] = []
    real_scandir = os.scandir

    def scandir(path="."):  # records what is listed, lists it for real
        listed.append(os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    run = make_run(s2)
    run.track(model=nn.Linear(4, 4))
    assert run.restore() == 2  # the state dataset's step, not the newer one inside someone's data
    monkeypatch.undo()
    assert not [p for p in listed if Path(p).is_relative_to(foreign)], listed
    assert not [p for p in listed if Path(p).is_relative_to(s2 / "input/competitions")], listed
    assert state.as_posix() in listed  # ours is searched


def test_a_snapshot_is_a_private_copy_into_host_buffers_kept_for_the_next_save():
    model = nn.Linear(4, 3)
    model.weight.data[:] = 1.0
    head = nn.Linear(4, 3, bias=False)
    head.weight = model.weight  # tied
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    live = {"step": 1, "tracked": {"model": model.state_dict(), "head": head.state_dict(), "optimizer": opt.state_dict()}}
    snaps = snapshot.Snapshotter()

    first = snaps.take(live)
    w = first["tracked"]["model"]["weight"]
    assert w.data_ptr() != model.weight.data_ptr() and torch.equal(w, model.weight)
    assert first["tracked"]["head"]["weight"] is w  # tied weights: one copy, one storage in the file
    frozen = w.clone()
    opt.step()  # the optimizer updates its tensors in place while the writer would still run
    assert torch.equal(w, frozen) and not torch.equal(w, model.weight)

    second = snaps.take(live)  # the next save: the same host memory, refilled
    assert second["tracked"]["model"]["weight"].data_ptr() == w.data_ptr()
    assert torch.equal(second["tracked"]["model"]["weight"], model.weight)
    moments = second["tracked"]["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(moments, opt.state[model.weight]["exp_avg"])
    assert moments.data_ptr() != opt.state[model.weight]["exp_avg"].data_ptr()

    large = snaps.take(live, keep=False)  # a large state: the host copy goes with its write
    assert large["tracked"]["model"]["weight"].data_ptr() != w.data_ptr()
    assert torch.equal(large["tracked"]["model"]["weight"], model.weight)
    assert snaps.take(live)["tracked"]["model"]["weight"].data_ptr() not in (w.data_ptr(), model.weight.data_ptr())
