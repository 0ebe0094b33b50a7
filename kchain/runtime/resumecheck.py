"""The kernel knows what it must resume: a session that would train from the wrong state stops at once.

`kchain continue` writes the expected resume step and state-dataset version into the rendered
config (`kaggle.resume`). If the checkpoint the runtime found does not match (an ignored version
pin mounted another version, the mount path changed, a relay left an empty state), training from
it would silently burn the session on a run that is not the user's: the runtime raises WrongState
before the first step instead, in its first minute.
"""

from __future__ import annotations


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
