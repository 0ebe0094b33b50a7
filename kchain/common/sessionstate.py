"""A session's state (a session record's `status`): Kaggle's states and kchain's own, and the one writer of it.

`SessionState` names every state once. Kaggle's seven are the names of kagglesdk's `KernelWorkerStatus`
(kagglesdk 0.1.38, kagglesdk/kernels/types/kernels_enums.py, in its order), which `kaggle kernels status`
prints and the emulator answers (tests/common/test_kernel_states.py checks them against the installed
client); kchain adds the two Kaggle never says: PUSHING (the push is sent and its answer not in yet: the
record is saved first) and FAILED_TO_PUSH (Kaggle created no version: the session never ran). A `StrEnum`:
each member is its own name as text, so sessions.json, the kernel's records and Kaggle's answers hold the
same strings as before and read back unchanged.

This module alone writes a record's status, through the named transitions of `TRANSITIONS` (drawn in
docs/chain.md, "A session's life"; tests/common/test_sessionstate.py holds the drawing to the table): each
sets the status on the record it is given and returns it, and refuses a move the table does not hold
(`TransitionError`, naming the session, from and to). Every other module reads the status through the enum.
Standard library only: the kernel's publisher and relay load it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TypeVar, cast


class SessionState(StrEnum):
    """A session's state; the value is the name, as sessions.json and Kaggle write it."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    ERROR = "ERROR"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCEL_ACKNOWLEDGED = "CANCEL_ACKNOWLEDGED"
    NEW_SCRIPT = "NEW_SCRIPT"
    # kchain's own, never Kaggle's:
    PUSHING = "PUSHING"  # the push is sent, its answer not in yet (push.reconcile settles a lost one)
    FAILED_TO_PUSH = "FAILED_TO_PUSH"  # Kaggle created no version: the session never ran, and `continue` pushes it


KAGGLE = tuple(s for s in SessionState if s not in (SessionState.PUSHING, SessionState.FAILED_TO_PUSH))  # its order
TERMINAL = (SessionState.COMPLETE, SessionState.ERROR, SessionState.CANCEL_ACKNOWLEDGED)  # ended: output and log final
ON_KAGGLE = tuple(s for s in KAGGLE if s not in TERMINAL)  # Kaggle holds the session and it has not ended
LIVE = (SessionState.PUSHING, *ON_KAGGLE)  # not ended yet (FAILED_TO_PUSH is neither: it never began)
S = SessionState  # for the table below

NEW = None  # the state of a record being made: it has no status yet

# name -> (the states it moves a session from, the states it may move it to). Kaggle's word wins while it holds
# the session: `seen` takes any state Kaggle reports, as it reports it (kchain only reads snapshots of it).
TRANSITIONS: dict[str, tuple[tuple[SessionState | None, ...], tuple[SessionState, ...]]] = {
    "pushing": ((NEW,), (S.PUSHING,)),  # push.push_session saves it before it sends; adopt_pushed: answer unknown
    "pushed": ((NEW, S.PUSHING), (S.QUEUED,)),  # Kaggle created the version (the answer, reconcile, the relay)
    "failed_to_push": ((S.PUSHING,), (S.FAILED_TO_PUSH,)),  # Kaggle created none
    "seen": (ON_KAGGLE, KAGGLE),  # sessions.refresh: Kaggle's word on a session it holds
    "rebuilt": ((NEW,), KAGGLE),  # sessions.rebuild: a record made from Kaggle's word alone
    "stopped": (LIVE, (S.CANCEL_ACKNOWLEDGED,)),  # `kchain stop --delete` deleted its kernel
    "ending": ((NEW,), (S.COMPLETE,)),  # the kernel's publisher: its own session, ending as it decides the next
}

Record = TypeVar("Record", bound=Mapping[str, object])  # a session record (SessionRecord), or one being made


class TransitionError(ValueError):
    """A move the lifecycle does not hold: a bug in kchain (or a hand-edited ledger), never a Kaggle answer."""


def _move(record: Record, name: str, to: SessionState) -> Record:
    was = record.get("status")
    sources, targets = TRANSITIONS[name]
    if was not in sources or to not in targets or was == to:
        origin = f"from {was}" if was is not None else "as a new record"
        allowed = ", ".join("a new record" if s is NEW else str(s) for s in sources)
        raise TransitionError(f"session {record.get('session')}: `{name}` cannot move it {origin} to {to} "
                              f"(`{name}` moves a session from {allowed} to {', '.join(targets)})")
    cast(dict[str, Any], record)["status"] = to
    return record


def pushing(record: Record) -> Record:
    """A new record whose push is about to be sent, or was sent and its answer lost: PUSHING."""
    return _move(record, "pushing", S.PUSHING)


def pushed(record: Record) -> Record:
    """Kaggle created the session's version (its answer, or read back after a lost one): QUEUED."""
    return _move(record, "pushed", S.QUEUED)


def failed_to_push(record: Record) -> Record:
    """Kaggle created no version for the push: FAILED_TO_PUSH (the session never ran)."""
    return _move(record, "failed_to_push", S.FAILED_TO_PUSH)


def seen(record: Record, state: SessionState) -> Record:
    """Kaggle's word on a session it holds, another state than the record's."""
    return _move(record, "seen", SessionState(state))


def rebuilt(record: Record, state: SessionState) -> Record:
    """A new record made from Kaggle's word alone (sessions.rebuild), in the state Kaggle reports."""
    return _move(record, "rebuilt", SessionState(state))


def stopped(record: Record) -> Record:
    """A live session whose kernel `kchain stop --delete` deleted: CANCEL_ACKNOWLEDGED."""
    return _move(record, "stopped", S.CANCEL_ACKNOWLEDGED)


def ending(record: Record) -> Record:
    """The kernel's own session as its publisher decides what follows it: a new record, COMPLETE."""
    return _move(record, "ending", S.COMPLETE)


def problem(value: object) -> str | None:
    """What is wrong with a status read back from a file, or None: one of SessionState's values."""
    if not isinstance(value, str):
        return "'status' is not text"
    if value not in frozenset(SessionState):
        return f"'status' is {value[:40]!r}, not a session state ({', '.join(SessionState)})"
    return None


def typed(record: Record) -> Record:
    """A record read back from JSON (`problem` found nothing): its status as the enum, the same string."""
    cast(dict[str, Any], record)["status"] = SessionState(str(record["status"]))
    return record
