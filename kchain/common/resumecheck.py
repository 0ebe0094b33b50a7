"""The kernel knows what it must resume: a session that would train from the wrong state stops at once.

`kchain continue` writes the expected resume step and state-dataset version into the rendered
config (`kaggle.resume`). If the checkpoint the runtime found does not match (an ignored version
pin mounted another version, the mount path changed, a relay left an empty state), training from
it would silently burn the session on a run that is not the user's: the runtime raises WrongState
before the first step instead, in its first minute.

Before that, the launcher waits (await_state, bounded by kaggle.mount_wait) for the expected state to
appear at all: "ready" is not "mounted". A state still missing after the wait ends the session as
`state_not_mounted`, which `kchain continue` answers by pushing the same session again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from kchain.common import layout


class WrongState(RuntimeError):
    """The attached input does not hold the checkpoint this session was pushed to resume."""


def expected(resume: dict | None) -> dict | None:
    """config.kaggle.resume when it names a step, else None (a fresh chain, a local run)."""
    return resume if isinstance(resume, dict) and resume.get("step") is not None else None


def check(resume: dict | None, found_step: int | None, found_where: str | None) -> None:
    """Raise WrongState if the found checkpoint is not the one the chain pushed this session for."""
    want = expected(resume)
    if want is None:
        return
    step = int(want["step"])
    version = want.get("state_version")
    if (found_step or 0) == step:
        return
    found = f"step {found_step} ({found_where})" if found_step is not None else "no checkpoint"
    raise WrongState(
        f"this session was pushed to resume step {step} from state version {version}, but the attached "
        f"input holds {found}; stopping before training from the wrong state"
    )


class StateNotMounted(RuntimeError):
    """The state version this session was pushed to resume did not appear in its input in time."""


def attached_step(input_root: Path) -> int | None:
    """The newest step any attached kchain state says it holds (its marker), or None when none is there."""
    steps = []
    for mount in layout.mounts(input_root, layout.STATE_KINDS):
        try:
            steps.append(int(json.loads((mount / layout.STATE_MARKER).read_text()).get("step") or 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return max(steps, default=None)


def await_state(resume: dict | None, input_root: Path, wait_s: float, say: Callable[[str], None],
                every_s: float = 30.0, poll_s: float = 0.5) -> None:
    """Wait until the state this session was pushed to resume is in its input: Kaggle has answered a
    dataset version "ready" minutes before a session saw it mounted (docs/emulator.md, mount_lag_s).

    Returns at once without an expected state (a fresh chain, a local run) or when it is there; says a
    line when it first finds the state missing and every `every_s` while it waits; raises StateNotMounted
    after `wait_s`. A different step found is left to check() once the checkpoint is read (a wrong
    version, not a late one, is WrongState)."""
    want = expected(resume)
    if want is None:
        return
    step, version = int(want["step"]), want.get("state_version")
    start = time.monotonic()
    said = start - every_s  # the first look that misses says so at once, then a line every `every_s`
    while attached_step(input_root) != step:
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
