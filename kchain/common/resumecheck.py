"""The kernel knows what it must resume: a session that would train from the wrong state stops at once.

`kchain continue` writes the expected resume step and state-dataset version into the rendered
config (`kaggle.resume`). If the checkpoint the runtime found does not match (an ignored version
pin mounted another version, the mount path changed, a relay left an empty state), training from
it would silently burn the session on a run that is not the user's: the runtime raises WrongState
before the first step instead, in its first minute.

Before that, the launcher waits (await_state, bounded by kaggle.mount_wait) for the expected state to
appear at all: "ready" is not "mounted". A state still missing after the wait ends the session as
`state_not_mounted`, which `kchain continue` answers by pushing the same session again. A state version
that is mounted is never waited on: without its pointer (kchain-state.json) it is read by its checkpoint's
own manifest, and one that holds neither is left to check() at once, with the fix said.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kchain.common import layout
from kchain.common.checkpoint_files import CheckpointInvalid, read_manifest


class WrongState(RuntimeError):
    """The attached input does not hold the checkpoint this session was pushed to resume."""


class DamagedState(WrongState):
    """The attached input's checkpoints fail verification (truncated, corrupted): the state version is damaged,
    and sending it again would be refused the same way (`kchain continue` republishes a verified copy)."""


def expected(resume: dict | None) -> dict | None:
    """config.kaggle.resume when it names a step, else None (a fresh chain, a local run)."""
    return resume if isinstance(resume, dict) and resume.get("step") is not None else None


def check(resume: dict | None, found_step: int | None, found_where: str | None, damaged: Sequence[str] = ()) -> None:
    """Raise WrongState if the found checkpoint is not the one the chain pushed this session for; DamagedState
    when checkpoints that failed verification (`damaged`, one line each) were passed over to find it."""
    want = expected(resume)
    if want is None:
        return
    step = int(want["step"])
    version = want.get("state_version")
    if (found_step or 0) == step:
        return
    found = f"step {found_step} ({found_where})" if found_step is not None else "no checkpoint"
    if damaged:
        raise DamagedState(
            f"this session was pushed to resume step {step} from state version {version}, but the attached "
            f"input holds {found} that verifies: {'; '.join(damaged)}; stopping before training from a damaged state"
        )
    raise WrongState(
        f"this session was pushed to resume step {step} from state version {version}, but the attached "
        f"input holds {found}; stopping before training from the wrong state"
    )


class StateNotMounted(RuntimeError):
    """The state version this session was pushed to resume did not appear in its input in time."""


def held_step(mount: Path) -> int | None:
    """The step a mounted state version holds: its pointer's (kchain-state.json), else, for a version without
    a readable pointer, its checkpoint's own manifest's when that manifest is kchain's and every file it lists
    is there at its size (the checksums are compared when it is loaded); None when neither says."""
    try:
        return int(json.loads((mount / layout.STATE_MARKER).read_text()).get("step") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        return int(read_manifest(mount)["step"])
    except (CheckpointInvalid, KeyError, TypeError, ValueError):
        return None


def attached_step(input_root: Path) -> int | None:
    """The newest step any attached kchain state holds (held_step), or None when none is there."""
    steps = [held_step(mount) for mount in layout.mounts(input_root, layout.STATE_KINDS)]
    return max((step for step in steps if step is not None), default=None)


def _unreadable(input_root: Path, state_slug: str | None) -> Path | None:
    """The state dataset's mounted version when it holds no step that can be read (no pointer, no manifest
    that holds together): a damaged version, mounted; waiting for it changes nothing."""
    for mount in layout.mounts(input_root, layout.STATE_KINDS) if state_slug else []:
        if mount.name == state_slug and held_step(mount) is None:
            return mount
    return None


def await_state(resume: dict | None, input_root: Path, wait_s: float, say: Callable[[str], None],
                every_s: float = 30.0, poll_s: float = 0.5, state_slug: str | None = None) -> None:
    """Wait until the state this session was pushed to resume is in its input: Kaggle has answered a
    dataset version "ready" minutes before a session saw it mounted (docs/emulator.md, mount_lag_s).

    Returns at once without an expected state (a fresh chain, a local run) or when it is there; says a
    line when it first finds the state missing and every `every_s` while it waits; raises StateNotMounted
    after `wait_s`. A different step found is left to check() once the checkpoint is read (a wrong
    version, not a late one, is WrongState), and so is the state dataset's version (state_slug) once it is
    mounted holding no step that can be read: said in one line with the fix, never waited on."""
    want = expected(resume)
    if want is None:
        return
    step, version = int(want["step"]), want.get("state_version")
    start = time.monotonic()
    said = start - every_s  # the first look that misses says so at once, then a line every `every_s`
    while attached_step(input_root) != step:
        damaged = _unreadable(input_root, state_slug)
        if damaged is not None:
            say(f"state version {version} is mounted ({damaged}) but holds neither its {layout.STATE_MARKER} nor a "
                f"checkpoint whose {layout.MANIFEST} holds together: not waiting for it, the session stops; fix: a "
                f"verified copy of step {step} as a new state version (`kchain continue` publishes the laptop's), or "
                "`kchain continue --from-state N` for an earlier version")
            return
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise StateNotMounted(
                f"state version {version} (step {step}) was not mounted within {wait_s:g} s "
                f"(kaggle.mount_wait); stopping without training so the chain pushes this session again")
        if time.monotonic() - said >= every_s:
            said = time.monotonic()
            say(f"waiting for state version {version} (step {step}) to be mounted: {waited:.0f} s of {wait_s:g} s")
        time.sleep(poll_s)
    if time.monotonic() - start > poll_s:
        say(f"state version {version} (step {step}) mounted after {time.monotonic() - start:.0f} s")
    for mount in layout.mounts(input_root, layout.STATE_KINDS) if state_slug else []:
        if mount.name == state_slug and not (mount / layout.STATE_MARKER).is_file():
            say(f"state version {version} has no {layout.STATE_MARKER}: step {step} read from its checkpoint's "
                f"{layout.MANIFEST} ({mount})")
