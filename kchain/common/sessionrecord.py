"""The session record: one session of a chain, as the laptop's ledger keeps it (sessions.json) and as a
kernel that chains itself reads its chain (nextsession). A plain JSON object; this TypedDict names every
key once, and mypy checks every literal key read or written against it
(tests/common/test_sessionrecord.py checks the keys the code uses).
"""

from __future__ import annotations

from typing import Any, TypedDict

from kchain.common.sessionstate import SessionState


class PendingRelay(TypedDict, total=False):
    """publish["pending"]: a relay from the laptop under way, saved before each upload (chain.relay_state)."""

    step: int  # the step of the state being uploaded
    before: int | None  # the state dataset's version before the upload (a rerun compares)
    version: int | None  # the state version the upload made
    cache_version: int | None  # the cache dataset's version, when the cache changed


class PublishFacts(TypedDict, total=False):
    """record["publish"]: how the session's end state became the state version the next one resumes
    (chain.ready_state; a relay in progress saves only `pending`)."""

    published: str | None  # kernel (the kernel published itself), relay (the laptop did), None: nothing new
    step: int | None  # the step the state version holds
    version: int | None  # the state dataset's version the next session is pinned to
    uploaded_bytes: int  # what the publish uploaded (state and a changed cache)
    checkpoint_bytes: int  # relay: the checkpoint's part of it
    cache_bytes: int  # relay: the cache's part of it
    cache: list[str]  # relay: the staged-data cache entries published with it
    steps_lost: int | None  # steps the session trained past `step` (None: unknown)
    resumes_at: int  # the step the next session resumes at (`step`, or 0)
    pending: PendingRelay
    repair: dict[str, Any]  # chain.repair_and_push: {refused_version, from}: the step republished from a copy


class SessionRecord(TypedDict, total=False):
    """One session of a chain as the ledger keeps it (sessions.json), a plain JSON object.

    `session` and `status` are always there (the ledger refuses a record without them); every other
    key appears when its writer first sets it, so readers use .get().
    """

    # Written by push.push_session before the push is sent (the record is saved first):
    session: int  # its number in the chain, 1 first
    status: SessionState  # Kaggle's word or kchain's (PUSHING, FAILED_TO_PUSH); written only by common/sessionstate.py
    kernel: str  # owner/name
    version: int | None  # the kernel version the session runs; None until the push is answered
    version_before: int | None  # the kernel's version before the push (push.reconcile compares)
    fingerprint: str  # the rendered code's fingerprint
    gpu: bool  # a GPU session: counts against the weekly quota (ledger.gpu_hours_this_week)
    requested: str  # when the push was sent (ISO UTC)
    # Passed to push_session as `extra`:
    smoke: str  # session 1 (push.push_job): the smoke pass's run id, or "skipped"
    params: dict[str, Any]  # session 1 (push.push_job): the params the chain runs with (`kchain week` compares runs)
    state_version: int | None  # later sessions (chain.push_next): the state dataset version attached
    resumes_at: int  # chain.push_next: the step that state holds
    cache_attached: list[str] | None  # chain.push_next: the staged-data cache entries attached
    image_asked: str  # chain.push_next: the image it was pinned to (session 1's, as Kaggle named it)
    unattended: bool  # push --unattended (session 1) and every later one: each session pushes the next itself
    pushed_by: str  # "kernel": adopt_pushed made the record from the previous session's summary (`next`)
    rebuilt: int  # every session of a chain rebuilt from Kaggle alone (sessions.rebuild): the kernel's newest version then
    relay: str  # adopt_pushed: the CPU relay kernel that pushes this session (common/relay.py), until settle_relay
    relay_version: int  # its version that does; settle_relay reads what it did from that session's output
    relay_said: str  # settle_relay: the relay's own line (what it pushed, or why it did not)
    # Written by push.push_session once Kaggle answered (or by push.reconcile after a lost answer):
    url: str  # the kernel's page
    started: str  # ISO UTC: the push's answer, then the kernel's own clock once it ended (refresh)
    invalid_sources: str  # the sources Kaggle dropped: the session ran without them
    # Written by sessions.refresh while and after the session runs:
    heartbeat: str | None  # the last `[kchain] step` line seen in its log
    heartbeat_seen: str  # ISO UTC: when this laptop first saw that line (the stale rule's clock)
    heartbeat_gap_s: float  # the longest time between two heartbeats, by the log's own clock
    log_seen: str  # ISO UTC: when a live log of it was last read (without one, staleness is not judged)
    running_seen: str  # ISO UTC: when refresh first saw it RUNNING
    image: str | None  # the image it ran on: the docker_image `kernels pull -m` names (None: Kaggle named none)
    ended: str  # ISO UTC: when it ended (the kernel's own clock when its summary says)
    failure_message: str | None  # Kaggle's failure message for the session
    output_error: str  # why its output could not be fetched (chain.fetch_or_stop retries)
    # Written by sessions.fetch_output once it ended:
    output: str | None  # the folder its output was downloaded to (None: lost, or a kernel deciding about itself)
    output_files: int  # how many files that output has
    summary: dict[str, Any] | None  # its summary.json (Summary.to_dict()); read it with summary_of
    saved_step: int | None  # the step of the newest complete checkpoint in that output
    kept_best: dict[str, Any] | None  # the keep_best record (metric, mode, value, step) that checkpoint's manifest carries
    error: dict[str, Any] | None  # {type, message, stage}: the failure its summary or log names
    step: int | None  # the summary's step
    total: int | None  # the summary's total
    end_status: str | None  # the summary's status (a summary.Status)
    ranks: int  # the summary's world_size (1 when it has none)
    # Written by chain.py:
    publish: PublishFacts  # push_next: how its end state was published for the next session
    logged: bool  # record_finished: the finished chain's line is in the run log
    stop_requested: str  # stop_chain: ISO UTC, when `kchain stop` was asked for
    stopped_by_user: bool  # stop_chain: the session ended because the user stopped it
    kernel_deleted: str  # stop_chain --delete: ISO UTC, when the kernel that ran it was deleted (its output
    #                      on Kaggle went with it; the laptop keeps what it downloaded)
