"""`kchain continue`'s decision table (kchain/common/nextsession.py's docstring), one row a case, on constructed
records: no emulator, no Kaggle, no render. The chains under test run in test_chain.py."""

from pathlib import Path
from typing import cast

import pytest

from kchain.chain.advance import decide, stop_error
from kchain.common.nextsession import Chain, Copy
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.errors import ChainStop, NotSmoked

JOB = Path("jobs/x/job.yaml")
CODE = "f" * 64  # the fingerprint of the code as it is now
OTHER = "e" * 64  # an earlier version of the code
BOOM = {"type": "ValueError", "message": "boom at step 25", "stage": "train"}


def session(n: int = 1, status: str = "ERROR", end: str | None = "deadline", **extra) -> SessionRecord:
    """A session record as `sessions.refresh` leaves it once the session ended (output fetched)."""
    record: dict[str, object] = {"session": n, "status": status, "kernel": "alice/x", "version": n, "fingerprint": CODE,
              "output": f"/out/{n}", "resumes_at": 0}
    if end is not None:
        record["summary"] = {"status": end, "step": 40 * n, "total": 100, "checkpoint": f"checkpoints/step-{40 * n}"}
    return cast(SessionRecord, {**record, **extra})


def summary(end: str, **extra) -> dict:
    return {"status": end, "step": 40, "total": 100, **extra}


FINISHED = session(1, "COMPLETE", summary=summary("finished", step=100, checkpoint="kchain/checkpoints/step-00000100",
                                                  best={"name": "val_loss", "value": 1.25, "step": 80}))
CRASHED = session(1, "ERROR", "crashed", error=BOOM)
NO_GPU = session(1, "ERROR", "no-accelerator", error={"type": "NoAccelerator", "message": "asked for GPU T4 x2"})
LOST = session(1, "COMPLETE", None, output=None, output_error="KaggleError: 500")

ROWS = [
    # name, chain, on Kaggle, options, action, what its message says (or the stop's class and message)
    ("no session yet", [], None, {}, "stop", (ChainStop, "x has no session yet: start it with `kchain push")),
    ("a session kchain did not start", [session()], "RUNNING", {}, "stop",
     (ChainStop, "alice/x has a session running on Kaggle that kchain did not start")),
    ("queued", [session(1, "QUEUED", None)], "QUEUED", {}, "running", "session 1 is queued: no heartbeat yet"),
    ("running", [session(1, "RUNNING", None, heartbeat="[kchain] step 12/100")], "RUNNING", {}, "running",
     "session 1 is running: [kchain] step 12/100"),
    ("outcome unknown (a push still unsettled)", [session(1, "PUSHING", None, version=None)], None, {}, "running",
     "session 1 is pushing"),
    ("finished", [FINISHED], "COMPLETE", {}, "finished",
     "training is complete: 100/100 steps, best val_loss 1.25 at step 80; final weights in "
     "/out/1/kchain/checkpoints/step-00000100"),
    ("stopped on purpose", [session(1, "COMPLETE", "stopped")], "COMPLETE", {}, "finished",
     "training stopped early on purpose at step 40/100"),
    ("no checkpoint", [session(1, "COMPLETE", "no_checkpoint")], "COMPLETE", {}, "stop",
     (ChainStop, "session 1 wrote no checkpoint: the loop did not use run.steps")),
    ("deadline without a step", [session(1), session(2, summary=summary("deadline"), resumes_at=40)], "ERROR", {},
     "stop", (ChainStop, "session 2 reached its deadline without training a step (it resumed at step 40)")),
    ("deadline", [session(1)], "ERROR", {}, "push", "push session 2"),
    ("killed (no summary, no traceback)", [session(1, "ERROR", None, failure_message="Killed")], "ERROR", {}, "push",
     "push session 2"),
    ("timed out", [session(1, "ERROR", None, error={"type": "SessionError", "message": "timeout"})], "ERROR", {},
     "push", "push session 2"),
    ("interrupted (stopped by the user)", [session(1, "ERROR", "interrupted", stopped_by_user=True)], "ERROR", {},
     "push", "push session 2"),
    ("crash, same code", [CRASHED], "ERROR", {}, "stop",
     (ChainStop, "session 1 crashed: ValueError: boom at step 25; fix the code and run `kchain smoke")),
    ("crash, same code, --retry", [CRASHED], "ERROR", {"retry": True}, "push", "push session 2"),
    ("crash, code changed since", [{**CRASHED, "fingerprint": OTHER}], "ERROR", {}, "push", "push session 2"),
    ("a traceback without a summary", [session(1, "ERROR", None, error=BOOM)], "ERROR", {}, "stop",
     (ChainStop, "session 1 crashed: ValueError: boom at step 25")),
    ("the same crash twice", [{**CRASHED, "fingerprint": OTHER}, session(2, "ERROR", "crashed", error=BOOM)], "ERROR",
     {"retry": True}, "stop", (ChainStop, "the same error as session 1: ValueError: boom at step 25; fix the code")),
    ("another crash after a crash", [CRASHED, session(2, "ERROR", "crashed", error={**BOOM, "message": "other"})],
     "ERROR", {"retry": True}, "push", "push session 3"),
    ("hung", [session(1, "ERROR", "hung")], "ERROR", {}, "stop", (ChainStop, "session 1 crashed: hung: ;")),
    ("hung, --retry", [session(1, "ERROR", "hung")], "ERROR", {"retry": True}, "push", "push session 2"),
    ("no accelerator", [NO_GPU], "ERROR", {}, "stop",
     (ChainStop, "session 1 got no accelerator: asked for GPU T4 x2; check the GPU quota")),
    ("no accelerator, --retry", [NO_GPU], "ERROR", {"retry": True}, "push", "push session 2"),
    ("no accelerator twice, --retry", [NO_GPU, {**NO_GPU, "session": 2}], "ERROR", {"retry": True}, "push",
     "push session 3"),
    ("output lost", [LOST], "COMPLETE", {}, "refetch", "the output of session 1 could not be fetched"),
    ("output lost, then fetched or given up", [LOST], "COMPLETE", {"output_settled": True}, "push", "push session 2"),
    ("no progress: two sessions in a row saved nothing", [session(1, "ERROR", None, saved_step=None),
     session(2, "ERROR", None, saved_step=None, failure_message="Session exceeded its time limit")], "ERROR", {},
     "stop", (ChainStop, "no progress: sessions 1 and 2 both ended without saving a step past 0 (session 2: Session "
              "exceeded its time limit), and the next would lose its work the same way: raise train.session_limit")),
    ("no progress: the second resumed at the first's step", [session(2, resumes_at=40), session(3, "ERROR", "deadline",
     summary=summary("interrupted"), resumes_at=40)], "ERROR", {}, "stop",
     (ChainStop, "no progress: sessions 2 and 3 both ended without saving a step past 40 (session 3 ended "
      "interrupted at step 40)")),
    ("no progress, --retry", [session(1, "ERROR", None, saved_step=None), session(2, "ERROR", None, saved_step=None)],
     "ERROR", {"retry": True}, "push", "push session 3"),
    ("no progress, code changed since", [session(1, "ERROR", None, saved_step=None),
     session(2, "ERROR", None, saved_step=None, fingerprint=OTHER)], "ERROR", {}, "push", "push session 3"),
    ("one session without progress after one with", [session(1), session(2, "ERROR", None, resumes_at=40,
     saved_step=None)], "ERROR", {}, "push", "push session 3"),
    ("a session that saved past its resume", [session(1, "ERROR", None, saved_step=None),
     session(2, "ERROR", None, saved_step=15)], "ERROR", {}, "push", "push session 3"),
    ("never smoked", [session()], "ERROR", {"smoked": False}, "stop",
     (NotSmoked, "this code has never passed a smoke run: run `kchain smoke jobs/x/job.yaml` first")),
    ("never smoked, --skip-smoke", [session()], "ERROR", {"smoked": False, "skip_smoke": True}, "push",
     "push session 2"),
]


@pytest.mark.parametrize(("chain", "on_kaggle", "options", "action", "says"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_continue_decides_row_by_row(chain, on_kaggle, options, action, says):
    options = dict(options)
    smoked = options.pop("smoked", True)
    rendered: list[str] = []

    def fingerprint() -> str:
        rendered.append(CODE)
        return CODE

    now = Chain(chain, "alice/x", on_kaggle, fingerprint=fingerprint, smoked=lambda fp: fp == CODE and smoked)
    decision = decide(now, JOB, **options)
    assert decision.action == action
    if action == "stop":
        kind, text = says
        error = stop_error(decision, JOB)
        assert type(error) is kind and str(error).startswith(text)
    else:
        assert decision.stop is None and decision.message.startswith(says)
    # The code is rendered only past the ends that need no code: a crash is judged against it.
    early = action in ("running", "finished") or decision.message.startswith(
        ("x has no session", "alice/x has a session", "session 1 wrote no", "session 2 reached its deadline"))
    assert rendered == ([] if early else [CODE])


def unmounted(n: int) -> SessionRecord:
    """A session that did not see its state version mounted in time (it trained nothing)."""
    return session(n, "COMPLETE", summary=summary("state_not_mounted", step=40), resumes_at=40, state_version=3,
                   saved_step=None)


@pytest.mark.parametrize(("tail", "action", "says"), [
    (1, "push", "push session 3: session 2 again from state version 3 (step 40), which it did not see mounted "
                "in time (attempt 2 of 4)"),
    (3, "push", "push session 5: session 4 again from state version 3 (step 40), which it did not see mounted "
                "in time (attempt 4 of 4)"),
    (4, "stop", "sessions 2 to 5 (4 in a row) did not see state version 3 mounted within the mount wait"),
], ids=["once", "three times", "four times: stop"])
def test_a_state_not_mounted_is_pushed_again_three_times_at_most(tail, action, says):
    chain = [session(1)] + [unmounted(n) for n in range(2, 2 + tail)]
    decision = decide(Chain(chain, "alice/x", SessionState.COMPLETE, fingerprint=lambda: CODE, smoked=lambda fp: True), JOB)
    assert decision.action == action and decision.message.startswith(says), decision.message
    assert decision.again == (action == "push") and decision.attempt == (tail + 1 if action == "push" else 1)
    if action == "stop":
        assert decision.stop == "chain_stop"


DAMAGED = {"type": "DamagedState", "message": "this session was pushed to resume step 40 from state version 3, but "
           "the attached input holds no checkpoint that verifies: state.pt: 5 bytes, manifest says 9 (truncated?); "
           "stopping before training from a damaged state", "stage": "build"}
WRONG = {**DAMAGED, "type": "WrongState", "message": "... the attached input holds no checkpoint; stopping ..."}
LAPTOP = Copy("/out/1/kchain/checkpoints/step-00000040", "session 1's output on this laptop")


def refused(error: dict, **extra) -> SessionRecord:
    """Session 2, pushed to resume step 40 from state version 3 (session 1's relay), refused that state."""
    return session(2, "ERROR", "crashed", **{"error": error, "resumes_at": 40, "state_version": 3, **extra})


PUBLISHED = session(1, publish={"published": "relay", "step": 40, "version": 3})


@pytest.mark.parametrize(("tail", "copy", "options", "action", "says"), [
    ([refused(DAMAGED)], LAPTOP, {}, "repair",
     f"session 2 refused state version 3 (step 40): {DAMAGED['message']}; session 1's output on this laptop holds a "
     "verified copy of step 40: publishing it as a new state version and pushing session 3 from it (no step lost)"),
    ([refused(WRONG)], LAPTOP, {}, "repair", "session 2 refused state version 3 (step 40): ... the attached input"),
    ([refused(DAMAGED)], None, {}, "stop",
     f"session 2 refused state version 3 (step 40) as damaged: {DAMAGED['message']}; no verified copy of step 40 is "
     "on this laptop or in an earlier state version, and --retry would send the same damaged version again: run "
     "`kchain continue jobs/x/job.yaml` where session 1's output (step 40) was downloaded"),
    ([refused(DAMAGED)], None, {"retry": True}, "stop", "session 2 refused state version 3 (step 40) as damaged"),
    ([refused(WRONG)], None, {}, "stop", "session 2 crashed: WrongState: ... the attached input holds no checkpoint"),
    ([refused(WRONG)], None, {"retry": True}, "push", "push session 3 from the newest state"),
    ([refused(DAMAGED, publish={"published": "relay", "step": 40, "version": 4, "repair": {
        "refused_version": 3, "from": "session 1's output on this laptop"}}), {**refused(DAMAGED, state_version=4), "session": 3}],
     LAPTOP, {}, "stop", "session 3 refused state version 4 (step 40), itself a copy of step 40 from session 1's "
                         "output on this laptop published after an earlier refusal"),
    ([refused(DAMAGED)], LAPTOP, {"smoked": False}, "stop", "this code has never passed a smoke run"),
], ids=["damaged: repaired", "wrong state: repaired", "damaged, no copy: stop", "damaged, no copy, --retry: stop",
        "wrong state, no copy: a crash", "wrong state, no copy, --retry", "the repair refused too: stop",
        "a repair is a push: never smoked code stops"])
def test_a_refused_state_is_repaired_from_a_verified_copy_and_never_sent_again(tail, copy, options, action, says):
    options = dict(options)
    smoked = options.pop("smoked", True)
    asked: list[tuple[int, int | None]] = []

    def copy_of(step: int, refused: int | None) -> Copy | None:
        asked.append((step, refused))
        return copy

    now = Chain([PUBLISHED, *tail], "alice/x", SessionState.ERROR, fingerprint=lambda: CODE, smoked=lambda fp: smoked,
                copy_of=copy_of)
    decision = decide(now, JOB, **options)
    assert decision.action == action and decision.message.startswith(says), decision.message
    assert decision.copy == (copy if action == "repair" else None)
    if "itself a copy" not in says:
        assert asked == [(40, tail[-1]["state_version"])]  # the copy asked for: that step, not in the refused version


def test_the_session_after_an_unmounted_one_is_judged_against_the_one_that_trained():
    # Session 2 trained nothing (not mounted); session 3, pushed again, trained and saved past 40: no
    # "no progress" from comparing 3 with 2; the next push is a plain one.
    chain = [session(1), unmounted(2), session(3, resumes_at=40, saved_step=60)]
    decision = decide(Chain(chain, "alice/x", SessionState.ERROR, fingerprint=lambda: CODE, smoked=lambda fp: True), JOB)
    assert decision.action == "push" and not decision.again and decision.message == "push session 4 from the newest state"


def test_the_final_weights_are_where_the_output_has_them():
    # The summary names the checkpoint relative to the working dir (an older kchain: to the kchain dir); the
    # path said is the downloaded output's, never with the kchain dir twice, and the kernel's own is relative.
    from kchain.common.nextsession import final_weights

    old = session(1, "COMPLETE", summary=summary("finished", checkpoint="checkpoints/step-00000100"))
    assert str(final_weights(FINISHED)) == str(final_weights(old)) == "/out/1/kchain/checkpoints/step-00000100"
    kernel = cast(SessionRecord, {**FINISHED, "output": None})
    assert decide(Chain([kernel], "alice/x", None, lambda: CODE, lambda _: True), JOB).message.endswith(
        "final weights in kchain/checkpoints/step-00000100 of session 1's output")


def test_the_kernels_budget_counts_the_chains_week():
    # Kaggle's quota answer without GPU figures: the kernel counts the week it was pushed with, this session on top.
    from kchain.common.nextsession import WEEK_S, afford, week_used

    start, hour = 1_800_000_000.0, 3600.0
    used, week = week_used({"start": start, "used_s": 20 * hour}, 2 * hour, start + 3 * 86400)
    assert (used, week) == (22 * hour, {"start": start, "used_s": 22 * hour})
    assert afford(12 * hour, used, 30 * hour, 30 * hour) == (
        "another session of up to 12.00 GPU-hours does not fit the week: 22.00 of 30.00 used")
    # A week that rolled over counts this session alone; a chain pushed without a week, this session alone.
    assert week_used(week, 2 * hour, start + WEEK_S + 60) == (2 * hour, {"start": start + WEEK_S, "used_s": 2 * hour})
    assert week_used(None, 2 * hour, start) == (2 * hour, None)


def test_the_session_billed_runs_to_the_end_of_its_publish():
    from kchain.chain.sessions import billed_span
    from kchain.common.summary import Summary

    assert billed_span(Summary(started=0.0, ended=600.0, session_ended=690.0)) == (
        "1970-01-01T00:00:00Z", "1970-01-01T00:11:30Z")
    assert billed_span(Summary(started=0.0, ended=600.0)) == ("1970-01-01T00:00:00Z", "1970-01-01T00:10:00Z")
    assert billed_span(Summary()) is None
