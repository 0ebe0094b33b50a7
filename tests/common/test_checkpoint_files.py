"""Checkpoints on disk without torch: the manifest, checksums, pruning and finding the newest one.

Checkpoint dirs are written by the real writer or by hand (the same layout, with made-up bytes for
state.pt: nothing here opens it as a torch file). The last test proves the split holds: the laptop
side and the publisher find and verify checkpoints without importing torch or numpy.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kchain.common import layout
from kchain.common.checkpoint_files import (
    CheckpointInvalid,
    complete,
    find_latest,
    prune,
    read_manifest,
    verify,
)
from kchain.runtime.checkpoint.state import CheckpointJob, write_checkpoint

REPO = Path(__file__).resolve().parents[2]


def by_hand(checkpoints: Path, step: int, name: str | None = None) -> Path:
    """A checkpoint as the writer leaves it, its state.pt a few made-up bytes."""
    ckpt = checkpoints / (name or layout.checkpoint_name(step))
    ckpt.mkdir(parents=True)
    files = {}
    for fname, data in ((layout.STATE_FILE, f"state at {step}".encode()), (layout.METRICS, b'{"step": 1}\n')):
        (ckpt / fname).write_bytes(data)
        files[fname] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest = {layout.MARKER: layout.FORMAT_VERSION, "job": "unit", "step": step, "files": files}
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))
    return ckpt


def flip_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_written_checkpoint_verifies_and_a_flipped_byte_names_the_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    job = CheckpointJob(checkpoints=tmp_path / "ckpts", step=2, metrics_src=metrics,
                        metrics_bytes=len(metrics.read_bytes()), manifest={"job": "unit", "session": 1}, keep=2)
    ckpt = write_checkpoint({"w": torch.arange(64, dtype=torch.float32)}, job)

    manifest = read_manifest(ckpt)
    assert manifest["step"] == 2 and manifest["job"] == "unit" and manifest[layout.MARKER] == layout.FORMAT_VERSION
    assert set(manifest["files"]) == {layout.STATE_FILE, layout.METRICS, layout.DIGESTS}
    assert verify(ckpt) == manifest

    flip_byte(ckpt / layout.STATE_FILE, at=-1)
    read_manifest(ckpt)  # the size still matches: only the checksum tells
    with pytest.raises(CheckpointInvalid, match="sha256 does not match the manifest") as e:
        verify(ckpt)
    assert str(e.value).startswith(f"{ckpt / layout.STATE_FILE}: ")


def test_a_missing_or_truncated_file_fails_the_cheap_check(tmp_path):
    ckpt = by_hand(tmp_path, 3)
    (ckpt / layout.METRICS).write_bytes(b"{")
    with pytest.raises(CheckpointInvalid, match=r"1 bytes, manifest says 12 \(truncated\?\)") as e:
        read_manifest(ckpt)
    assert str(e.value).startswith(f"{ckpt / layout.METRICS}: ")
    (ckpt / layout.METRICS).unlink()
    with pytest.raises(CheckpointInvalid, match=f"^{ckpt / layout.METRICS}: missing$"):
        read_manifest(ckpt)
    (ckpt / layout.MANIFEST).unlink()
    with pytest.raises(CheckpointInvalid, match="no manifest.json"):
        read_manifest(ckpt)


def test_prune_keeps_the_newest_n(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (10, 20, 30, 40, 50):
        by_hand(ckpts, step)
    prune(ckpts, keep=2)
    newest_two = [layout.checkpoint_name(40), layout.checkpoint_name(50)]
    assert [p.name for p in complete(ckpts)] == newest_two
    assert sorted(p.name for p in ckpts.iterdir()) == newest_two  # nothing left aside either
    prune(ckpts, keep=5)  # fewer than keep: nothing goes
    assert [p.name for p in complete(ckpts)] == newest_two


def test_find_latest_takes_the_newest_complete_one(tmp_path, capsys):
    ckpts = tmp_path / "ckpts"
    by_hand(ckpts, 5)
    want = by_hand(ckpts, 7)
    damaged = by_hand(ckpts, 8)
    flip_byte(damaged / layout.STATE_FILE)
    # A newer one still being written (or killed while it was): complete inside, but never loaded.
    by_hand(ckpts, 9, name=f"{layout.TMP_PREFIX}{layout.checkpoint_name(9)}-1234")

    latest = find_latest(ckpts, tmp_path / "no-input", tmp_path / "scratch", "unit")
    assert latest is not None
    path, manifest = latest
    assert (path, manifest["step"]) == (want, 7)
    assert f"WARNING: skipping checkpoint {damaged}: {damaged / layout.STATE_FILE}: sha256" in capsys.readouterr().out
    # The damaged one is set aside, so neither the next start nor a prune counts it.
    assert [p.name for p in complete(ckpts)] == [layout.checkpoint_name(5), layout.checkpoint_name(7)]
    assert find_latest(ckpts, tmp_path / "no-input", tmp_path / "scratch", "another job") is None


def test_finding_and_verifying_imports_neither_torch_nor_numpy():
    code = (
        "import sys\n"
        "import kchain.chain.advance, kchain.common.statefolder, kchain.common.checkpoint_files\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
