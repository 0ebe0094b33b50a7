"""KCHAIN_FAULT as one typed object: parsed strictly, and documented key for key."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from kchain.common.faults import SAVE_POINTS, Faults, FaultSpecError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def test_faults_parse_into_typed_values_and_nothing_is_a_fault_by_default():
    f = Faults.parse("kill_at_step=7, stall_step=0.5,kill_after_checkpoint=1,kill_in_save=before_rename,"
                     "deadline_at_step=3,deadline_rank=1,oom_above=16")
    assert (f.kill_at_step, f.stall_step, f.kill_after_checkpoint, f.kill_in_save) == (7, 0.5, True, "before_rename")
    assert (f.deadline_at_step, f.deadline_rank, f.oom_above) == (3, 1, 16) and f.kills
    none = Faults.parse("")
    assert none == Faults() and not none.kills and none.deadline_line(10**6, 10**6, 0) is None


@pytest.mark.parametrize("text, says", [
    ("kill_at_stp=3", "unknown fault 'kill_at_stp'"),
    ("kill_at_step=three", "kill_at_step='three' is not a int"),
    ("kill_after_checkpoint=yes", "kill_after_checkpoint='yes' is not a bool"),
    ("kill_in_save=halfway", "kill_in_save=halfway is not one of after_state"),
])
def test_a_fault_this_runtime_does_not_know_is_an_error_not_a_silent_no_op(text, says):
    with pytest.raises(FaultSpecError, match=re.escape(says)):
        Faults.parse(text)


def test_the_deadline_clocks_of_a_test_fall_where_they_say():
    at = Faults.parse("deadline_at_step=4,deadline_rank=1")
    assert at.deadline_line(3, 3, 1) is None and at.deadline_line(4, 1, 0) is None  # rank 0's clock runs on
    line = at.deadline_line(4, 1, 1)
    assert line is not None and "at step 4" in line
    after = Faults.parse("deadline_after_steps=2")
    assert after.deadline_line(50, 1, 0) is None and (line := after.deadline_line(51, 2, 0)) is not None
    assert "deadline_after_steps=2" in line


def test_docs_runtime_md_lists_every_fault_and_no_other():
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `KCHAIN_FAULT`"))
    documented = set(re.findall(r"`([a-z_]+)=", row))
    assert documented == {f.name for f in fields(Faults)}
    assert all(point in row for point in SAVE_POINTS)
