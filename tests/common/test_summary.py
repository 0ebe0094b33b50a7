"""summary.json: its statuses against the docs and the code, its record, its one writer and one reader."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from helpers import REPO, known

from kchain.common import layout, summary
from kchain.common.config import RuntimeConfig
from kchain.common.summary import STATUSES, Status, Summary
from kchain.emulator.app import PATIENCE_S
from kchain.runtime import launch

# The keys a Run's summary has had since before the record existed, in its order.
RUN_KEYS = ["status", "session", "step", "total", "metrics", "best", "checkpoint", "error", "started", "ended",
            "steps_per_s", "fingerprint", "resumed_from", "published", "note", "not_exact", "world_size"]


def documented_statuses() -> list[str]:
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("Session statuses (`summary.Status`", 1)[1].split("\n\n", 2)[1]
    return re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)


def test_the_design_doc_lists_every_status_and_no_other():
    assert documented_statuses() == list(STATUSES)


def test_each_status_has_one_name_in_the_order_of_its_type():
    # StatusName is what mypy checks a status against; Status names each of its words.
    assert tuple(v for k, v in vars(Status).items() if k.isupper()) == STATUSES


def test_every_status_the_runtime_sets_is_a_status():
    # `x.status = "..."` and the stop reasons that become statuses, anywhere in the runtime.
    found = set()
    for path in [*(REPO / "kchain" / "runtime").rglob("*.py"), *(REPO / "kchain" / "common").glob("*.py")]:
        if path.name == "publish.py":  # its `status` is a dataset's, not a session's
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "") for t in targets}
                values = [node.value, *(getattr(node.value, "values", None) or [])]  # `a or "stopped"`
                if names & {"status", "_stop_reason", "stop_reason"}:
                    found |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    assert found, "the scan found no status assignment"
    assert sorted(found - set(STATUSES)) == []


def test_the_record_is_standard_library_only():
    code = ("import sys; import kchain.common.summary; "
            "assert not {'torch', 'numpy'} & set(sys.modules), 'the laptop reader imports torch or numpy'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PATIENCE_S, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_a_run_summary_has_todays_keys_and_round_trips():
    s = Summary(status=Status.FINISHED, session=2, step=40, total=40, metrics={"loss": 0.5},
                best={"name": "val_loss", "value": 0.4, "step": 40}, checkpoint="kchain/checkpoints/step-00000040",
                started=1.0, ended=2.0, steps_per_s=3.5, fingerprint="abc", resumed_from=20, not_exact=[],
                world_size=1)
    data = s.to_dict()
    assert list(data) == RUN_KEYS  # the publish's keys only once it published
    assert Summary.from_dict(json.loads(json.dumps(data))) == s


def test_an_old_partial_summary_reads_with_nulls_and_keeps_what_it_does_not_know():
    old = {"status": "no-accelerator", "step": 0, "error": {"type": "NoAccelerator", "message": "m"},
           "from_a_newer_kchain": {"x": 1}}
    s = Summary.from_dict(old)
    assert s.status == Status.NO_ACCELERATOR  # the old spelling reads as today's status
    assert (s.step, s.total, s.not_exact, s.world_size) == (0, None, None, None)
    assert s.extra == {"from_a_newer_kchain": {"x": 1}}
    data = s.to_dict()
    assert list(data) == [*RUN_KEYS, "from_a_newer_kchain"] and data["status"] == "no_accelerator"
    assert Summary.from_dict(None) == Summary() == Summary.from_dict(cast(Any, [1, 2]))  # not a mapping, on purpose


def test_the_publish_keys_appear_once_it_published():
    s = Summary.from_dict({"status": "deadline", "published": None})
    s.published, s.published_step, s.published_bytes, s.publish_timing = "kernel", 7, 123, {"rate_bps": 1.0}
    data = s.to_dict()
    assert list(data)[len(RUN_KEYS):] == ["published_step", "published_bytes", "publish_timing"]
    assert Summary.from_dict(data) == s


def test_a_summary_is_written_whole_and_the_reserve_goes(tmp_path):
    path = tmp_path / "kchain" / layout.SUMMARY
    summary.reserve(path)
    assert summary.reserve_path(path).stat().st_size == summary.RESERVE_BYTES
    summary.write(path, Summary(status=Status.FINISHED, step=3))
    assert summary.read(path) == Summary(status=Status.FINISHED, step=3)
    assert sorted(p.name for p in path.parent.iterdir()) == [layout.SUMMARY]  # no temp file, no reserve


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_a_summary_on_a_full_disk_goes_into_the_reserved_space(tmp_path, capsys):
    path = tmp_path / "kchain" / layout.SUMMARY
    summary.reserve(path)
    # Its temporary file sits on a full disk: writing it fails with ENOSPC.
    os.symlink("/dev/full", path.with_name(f"{layout.TMP_PREFIX}{path.name}"))
    summary.write(path, Summary(status=Status.CRASHED, error={"type": "OSError", "message": "disk full"}))
    assert "written into the space reserved for it" in capsys.readouterr().out
    assert known(summary.read(path)).error == {"type": "OSError", "message": "disk full"}
    assert path.stat().st_size == summary.RESERVE_BYTES  # padded with spaces: the reserve's blocks
    # Without a reserve the error is the writer's to raise.
    os.symlink("/dev/full", path.with_name(f"{layout.TMP_PREFIX}{path.name}"))
    with pytest.raises(OSError):
        summary.write(path, Summary(status=Status.CRASHED))


def test_the_reader_gives_none_for_what_is_not_a_whole_summary(tmp_path):
    path = tmp_path / layout.SUMMARY
    assert summary.read(path) is None  # missing
    whole = json.dumps(Summary(status=Status.DEADLINE, step=5).to_dict(), indent=2)
    path.write_text(whole[: len(whole) // 2])  # half written (by anything but summary.write)
    assert summary.read(path) is None
    path.write_text("[1, 2]")
    assert summary.read(path) is None  # not an object kchain wrote
    path.write_bytes(b"\xff\xfe")
    assert summary.read(path) is None  # not text
    path.write_text(whole)
    assert known(summary.read(path)).step == 5


def test_a_working_dir_summary_is_searched_below_only_when_asked(tmp_path):
    nested = tmp_path / "extra-level" / layout.KCHAIN_DIR / layout.SUMMARY
    summary.write(nested, Summary(status=Status.FINISHED))
    assert summary.read_working(tmp_path) is None
    assert known(summary.read_working(tmp_path, search=True)).status == Status.FINISHED


def test_the_launchers_fallbacks_are_summaries_with_every_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(layout.ROOT_ENV, str(tmp_path))
    path = layout.kchain_dir({layout.ROOT_ENV: str(tmp_path)}) / layout.SUMMARY
    assert launch._no_accelerator(RuntimeConfig(fingerprint="f"), "asked for GPU T4 x2") == layout.EXIT_NO_ACCELERATOR
    got = json.loads(path.read_text())
    assert list(got) == RUN_KEYS
    assert (got["status"], got["step"], got["fingerprint"], got["error"]["type"]) == (
        "no_accelerator", 0, "f", "NoAccelerator")
    error = {"type": "ImportError", "message": "no module named train", "stage": "build"}
    assert launch._report(RuntimeConfig(fingerprint="f"), None, error) == 1  # the Run was never built
    got = json.loads(path.read_text())
    assert list(got) == RUN_KEYS and (got["status"], got["error"], got["step"]) == ("crashed", error, None)
    assert capsys.readouterr().out.endswith(
        '[kchain] summary: {"status": "crashed", "step": null, "total": null, "checkpoint": null}\n')


def test_the_state_folders_copy_says_who_published_it(tmp_path):
    from kchain.common.statefolder import build_state_folder

    kdir = tmp_path / "kchain"
    ckpt = kdir / layout.CHECKPOINTS_DIR / layout.checkpoint_name(4)
    ckpt.mkdir(parents=True)
    (ckpt / layout.MANIFEST).write_text(json.dumps({"step": 4, "files": {}}))
    summary.write(kdir / layout.SUMMARY, Summary.from_dict({"status": "deadline", "step": 4, "newer": True}))
    build_state_folder(kdir, tmp_path / "state", "relay", found=(ckpt, {"step": 4, "files": {}}))
    copy = json.loads((tmp_path / "state" / layout.SUMMARY).read_text())
    assert (copy["published"], copy["step"], copy["newer"]) == ("relay", 4, True)
    assert known(summary.read(kdir / layout.SUMMARY)).published is None  # the session's own summary is left as it is


def test_a_missing_summary_is_no_summary_in_the_state_folder(tmp_path: Path):
    from kchain.common.statefolder import build_state_folder

    ckpt = tmp_path / "kchain" / layout.CHECKPOINTS_DIR / layout.checkpoint_name(1)
    ckpt.mkdir(parents=True)
    (ckpt / layout.MANIFEST).write_text(json.dumps({"step": 1, "files": {}}))
    build_state_folder(tmp_path / "kchain", tmp_path / "state", "relay", found=(ckpt, {"step": 1, "files": {}}))
    assert not (tmp_path / "state" / layout.SUMMARY).exists()
