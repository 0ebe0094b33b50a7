"""The kernel knows what it must resume: the step the chain pushed a session for against the checkpoint it
found, and the wait for the state to be mounted."""

from __future__ import annotations

import json

import pytest

from kchain.common import layout, resumecheck


def test_without_an_expected_step_anything_found_is_fine():
    for resume in (None, {}, {"step": None}):
        assert resumecheck.expected(resume) is None
        resumecheck.check(resume, 7, "working")


def test_the_expected_step_passes_and_another_is_wrong_state_naming_both():
    resume = {"step": 40, "state_version": 3}
    resumecheck.check(resume, 40, "input")
    with pytest.raises(resumecheck.WrongState, match=r"resume step 40 from state version 3, but the attached input "
                                                     r"holds step 20 \(working\)"):
        resumecheck.check(resume, 20, "working")
    with pytest.raises(resumecheck.WrongState, match="holds no checkpoint"):
        resumecheck.check(resume, None, None)


def _marker(root, kind, slug, step):
    folder = root / kind / "alice" / slug
    folder.mkdir(parents=True)
    (folder / layout.STATE_MARKER).write_text(json.dumps({"step": step}))


def test_the_attached_step_is_the_newest_any_state_marker_says(tmp_path):
    assert resumecheck.attached_step(tmp_path) is None
    _marker(tmp_path, "datasets", "x-state", 20)
    _marker(tmp_path, "notebooks", "x", 60)
    (tmp_path / "datasets" / "alice" / "broken").mkdir()
    (tmp_path / "datasets" / "alice" / "broken" / layout.STATE_MARKER).write_text("{not json")
    assert resumecheck.attached_step(tmp_path) == 60


def test_the_wait_returns_once_the_state_is_there_and_ends_the_session_when_it_never_is(tmp_path):
    lines: list[str] = []
    _marker(tmp_path, "datasets", "x-state", 40)
    resumecheck.await_state({"step": 40, "state_version": 2}, tmp_path, 0.0, lines.append)
    assert lines == []
    with pytest.raises(resumecheck.StateNotMounted, match=r"state version 5 \(step 80\) was not mounted within 0 s"):
        resumecheck.await_state({"step": 80, "state_version": 5}, tmp_path, 0.0, lines.append)


def _flat_version(root, slug, step, pointer=True):
    """A state dataset version as Kaggle mounts it: flat, the checkpoint's files, its manifest, the pointer."""
    folder = root / "datasets" / "alice" / slug
    folder.mkdir(parents=True)
    (folder / layout.STATE_FILE).write_bytes(b"weights")
    (folder / layout.MANIFEST).write_text(json.dumps({layout.MARKER: 1, "step": step, "files": {
        layout.STATE_FILE: {"size": 7, "sha256": "not compared until it is loaded"}}}))
    if pointer:
        (folder / layout.STATE_MARKER).write_text(json.dumps({"step": step}))
    return folder


def test_a_mounted_version_without_its_pointer_is_read_by_its_manifest_not_waited_on(tmp_path):
    lines: list[str] = []
    folder = _flat_version(tmp_path, "x-state", 40, pointer=False)
    assert resumecheck.attached_step(tmp_path) == 40
    # A mount wait long enough that a wait would fail the test by StateNotMounted, not by its time.
    resumecheck.await_state({"step": 40, "state_version": 2}, tmp_path, 30.0, lines.append, state_slug="x-state")
    assert lines == [f"state version 2 has no {layout.STATE_MARKER}: step 40 read from its checkpoint's "
                     f"{layout.MANIFEST} ({folder})"]


def test_a_mounted_version_with_neither_pointer_nor_a_whole_manifest_is_refused_at_once_with_the_fix(tmp_path):
    lines: list[str] = []
    folder = _flat_version(tmp_path, "x-state", 40, pointer=False)
    (folder / layout.STATE_FILE).write_bytes(b"cut")  # truncated: the manifest no longer holds together
    assert resumecheck.attached_step(tmp_path) is None
    resumecheck.await_state({"step": 40, "state_version": 2}, tmp_path, 30.0, lines.append, state_slug="x-state")
    assert lines == [f"state version 2 is mounted ({folder}) but holds neither its {layout.STATE_MARKER} nor a "
                     f"checkpoint whose {layout.MANIFEST} holds together: not waiting for it, the session stops; fix: "
                     "a verified copy of step 40 as a new state version (`kchain continue` publishes the laptop's), or "
                     "`kchain continue --from-state N` for an earlier version"]
    # Only the state dataset's own mount is judged so: the state of another slug, not mounted yet, is waited for.
    with pytest.raises(resumecheck.StateNotMounted):
        resumecheck.await_state({"step": 40, "state_version": 2}, tmp_path, 0.0, lines.append, state_slug="y-state")
