"""A session's states: the named transitions move a record only as the lifecycle allows, the diagram in
docs/chain.md draws that table, and a status is written and read back as the same string."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from helpers import REPO

from kchain.common import sessionstate
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import (
    KAGGLE,
    LIVE,
    ON_KAGGLE,
    TERMINAL,
    TRANSITIONS,
    SessionState,
    TransitionError,
)
from kchain.errors import StateError
from kchain.store.ledger import SESSIONS_FILE, Ledger

CHAIN_MD = REPO / "docs" / "chain.md"
S = SessionState
# Every transition, called with the state it is given where it takes one (Kaggle's word).
MOVES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "pushing": sessionstate.pushing,
    "pushed": sessionstate.pushed,
    "failed_to_push": sessionstate.failed_to_push,
    "seen": lambda r: sessionstate.seen(r, S.COMPLETE),
    "rebuilt": lambda r: sessionstate.rebuilt(r, S.COMPLETE),
    "stopped": sessionstate.stopped,
    "ending": sessionstate.ending,
}


def record(status: SessionState | None = None) -> dict[str, Any]:
    return {"session": 4, "kernel": "alice/x", **({"status": status} if status else {})}


def test_a_push_makes_a_pushing_record_that_ends_queued_or_failed():
    made = sessionstate.pushing(record())
    assert made["status"] is S.PUSHING
    assert sessionstate.pushed(dict(made))["status"] is S.QUEUED
    assert sessionstate.failed_to_push(dict(made))["status"] is S.FAILED_TO_PUSH
    assert sessionstate.pushed(record())["status"] is S.QUEUED  # adopted: the kernel that pushed it knew its version


def test_a_refused_move_names_the_session_and_from_and_to_and_leaves_the_record_as_it_was():
    queued = record(S.QUEUED)
    with pytest.raises(TransitionError) as refused:
        sessionstate.failed_to_push(queued)
    assert str(refused.value) == ("session 4: `failed_to_push` cannot move it from QUEUED to FAILED_TO_PUSH "
                                  "(`failed_to_push` moves a session from PUSHING to FAILED_TO_PUSH)")
    assert queued == record(S.QUEUED)
    with pytest.raises(TransitionError, match=r"`pushing` cannot move it from PUSHING to PUSHING"):
        sessionstate.pushing(record(S.PUSHING))  # pushed twice
    with pytest.raises(TransitionError, match=r"`ending` cannot move it from RUNNING to COMPLETE"):
        sessionstate.ending(record(S.RUNNING))


def test_an_ended_session_and_one_never_pushed_never_move_again():
    for state in (*TERMINAL, S.FAILED_TO_PUSH):
        for name, move in MOVES.items():
            with pytest.raises(TransitionError, match=f"`{name}` cannot move it from {state} to "):
                move(record(state))


def test_kaggles_word_wins_while_it_holds_the_session_and_only_then():
    for was in ON_KAGGLE:
        for now in KAGGLE:
            if now != was:
                assert sessionstate.seen(record(was), now)["status"] is now
    with pytest.raises(TransitionError, match="from PUSHING to RUNNING"):
        sessionstate.seen(record(S.PUSHING), S.RUNNING)  # no version yet: Kaggle cannot be asked about it
    with pytest.raises(TransitionError, match="from QUEUED to PUSHING"):
        sessionstate.seen(record(S.QUEUED), S.PUSHING)  # kchain's own states are never Kaggle's word
    for state in KAGGLE:
        assert sessionstate.rebuilt(record(), state)["status"] is state


def test_a_stop_ends_every_live_session_and_the_kernel_records_itself_complete():
    for was in LIVE:
        assert sessionstate.stopped(record(was))["status"] is S.CANCEL_ACKNOWLEDGED
    assert sessionstate.ending(record())["status"] is S.COMPLETE


def test_a_status_is_written_and_read_back_as_the_same_string(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.save_session("job", sessionstate.pushed(SessionRecord(session=1, version=3)))
    assert json.loads((tmp_path / SESSIONS_FILE).read_text()) == {"job": [{"session": 1, "version": 3,
                                                                            "status": "QUEUED"}]}
    # A ledger an older kchain wrote: the same strings, read back as the enum.
    older = {"job": [{"session": n, "status": name} for n, name in enumerate(SessionState, 1)]}
    (tmp_path / SESSIONS_FILE).write_text(json.dumps(older))
    back = [s["status"] for s in ledger.sessions("job")]
    assert back == list(SessionState) and all(type(s) is SessionState for s in back)
    assert [f"{s}" for s in back] == [s["status"] for s in older["job"]]


def test_a_ledger_with_a_status_no_session_has_is_refused_with_its_path(tmp_path):
    (tmp_path / SESSIONS_FILE).write_text(json.dumps({"job": [{"session": 1, "status": "complete"}]}))
    with pytest.raises(StateError) as refused:
        Ledger(tmp_path).sessions("job")
    assert str(refused.value) == (
        f"{tmp_path / SESSIONS_FILE}: 'job' entry 1: 'status' is 'complete', not a session state (QUEUED, RUNNING, "
        "COMPLETE, ERROR, CANCEL_REQUESTED, CANCEL_ACKNOWLEDGED, NEW_SCRIPT, PUSHING, FAILED_TO_PUSH); fix it by "
        "hand, or move the file aside and kchain starts a new one")


# -- the diagram in docs/chain.md ---------------------------------------------------------------------------


def drawn(text: str) -> tuple[dict[str, set[str]], set[str | None], set[tuple[str | None, str, str | None]]]:
    """The diagram under "A session's life": its groups (ON_KAGGLE { ... }), every state it names, and its
    arrows as (from, transition, to), each group's arrow once for each state in it ([*]: None, a new record)."""
    section = text.split("## A session's life", 1)[1]
    block = section.split("```mermaid\n", 1)[1].split("```", 1)[0]
    groups: dict[str, set[str]] = {}
    lines: list[tuple[str, str, str]] = []
    group = None
    for line in (raw.strip() for raw in block.splitlines()):
        if found := re.fullmatch(r"state (\w+) \{", line):
            group = found[1]
            groups[group] = set()
        elif line == "}":
            group = None
        elif found := re.fullmatch(r"(\S+) --> (\S+): (\w+)", line):
            lines.append((found[1], found[3], found[2]))
        elif group is not None and re.fullmatch(r"[A-Z_]+", line):
            groups[group].add(line)
        else:
            assert line == "stateDiagram-v2", f"docs/chain.md's diagram: a line this test does not read: {line!r}"

    def states(node: str) -> set[str | None]:
        return {None} if node == "[*]" else set(groups.get(node, {node}))

    arrows = {(a, name, b) for was, name, to in lines for a in states(was) for b in states(to) if a != b}
    named = set().union(*map(states, {n for was, _, to in lines for n in (was, to)}), *groups.values()) - {None}
    return groups, named, arrows


def table() -> set[tuple[str | None, str, str | None]]:
    return {(None if a is None else str(a), name, str(b)) for name, (sources, targets) in TRANSITIONS.items()
            for a in sources for b in targets if a != b}


def test_the_diagram_draws_every_state_and_exactly_the_transitions_the_module_allows():
    groups, named, arrows = drawn(CHAIN_MD.read_text())
    assert groups == {"ON_KAGGLE": set(ON_KAGGLE), "TERMINAL": set(TERMINAL)}
    assert named == set(SessionState)
    assert arrows == table()
    assert set(TRANSITIONS) == set(MOVES) and all(callable(getattr(sessionstate, name)) for name in TRANSITIONS)


def test_a_missing_or_an_extra_arrow_fails_the_comparison():
    text = CHAIN_MD.read_text()
    assert drawn(text.replace("    PUSHING --> CANCEL_ACKNOWLEDGED: stopped\n", ""))[2] != table()
    assert drawn(text.replace("    [*] --> COMPLETE: ending\n", "    [*] --> ERROR: ending\n"))[2] != table()
