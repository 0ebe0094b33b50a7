"""kchain.common.atomic: the one atomic write. A write replaces the whole file, makes its folder,
leaves no temporary file behind (not even when it fails), and two writers never share one."""

from __future__ import annotations

import json
import os
import threading

import pytest

from kchain.common import atomic, layout


def test_a_write_replaces_the_file_whole_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "new" / "state.json"
    atomic.write_json(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic.write_text(path, "short")
    atomic.write_bytes(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    umask = os.umask(0o077)  # the test process's, read back at once
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == atomic.usual_mode() == 0o666 & ~umask  # not mkstemp's 0600
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary_one(tmp_path):
    path = tmp_path / "state" / "ledger.json"
    atomic.write_text(path, "old")
    with pytest.raises(TypeError):
        atomic.write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old" and [p.name for p in path.parent.iterdir()] == ["ledger.json"]


def test_concurrent_writers_of_one_file_never_mix_their_bytes(tmp_path):
    path = tmp_path / "sessions.json"
    payloads = [json.dumps({"writer": n, "pad": "x" * 200_000}) for n in range(8)]

    def write_five_times(text: str) -> None:
        for _ in range(5):
            atomic.write_text(path, text)

    threads = [threading.Thread(target=write_five_times, args=(text,)) for text in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in payloads
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(layout.TMP_PREFIX)]
