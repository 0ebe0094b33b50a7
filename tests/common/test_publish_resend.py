"""The kernel's publisher sends a creating call again while the session's time allows, each send settled first:
giving up after a fixed count handed an unattended chain to the laptop under the documented fault mix. Where the
session's time is unknown it keeps its old bound; where the time is spent it sends no more."""

from __future__ import annotations

import time

import pytest
import requests

from kchain.common import layout, publishplan, sendonce
from kchain.common.config import RuntimeConfig
from kchain.common.publish import ATTEMPTS, Clock, Resends

PLAN = {"start_s": 1.0, "create_s": 1.0, "rate_bps": 1e7, "processing_s": 1.0}  # a quick upload, by the plan


def answered_429(times: int):
    """A creating call answered 429 (Retry-After: 0, after the client's own tries) `times` times, then "ok";
    and the sends it saw."""
    sends: list[int] = []

    def send() -> str:
        sends.append(1)
        if len(sends) <= times:
            response = requests.Response()
            response.status_code, response.headers["Retry-After"] = 429, "0"
            raise requests.HTTPError("429", response=response)
        return "ok"
    return send, sends


def publish_once(send, clock: Clock):
    """send as the publisher sends a version: settled by a read that shows nothing landed, sent again by Resends."""
    resends = Resends(clock, 1000)
    return sendonce.send_and_settle(send, lambda: None, lost=resends.noting(lambda exc: True),
                                    attempts=resends.attempts, settle_s=0.0, may_resend=resends)


def session(monkeypatch, started_s_ago: float, limit_s: float = 3600) -> Clock:
    monkeypatch.setenv(layout.SESSION_START_ENV, str(time.time() - started_s_ago))
    monkeypatch.setenv(layout.SESSION_LIMIT_ENV, str(limit_s))
    return Clock(RuntimeConfig(), PLAN)


def test_a_send_that_did_not_land_goes_again_past_the_old_count_while_the_session_has_time(monkeypatch, capsys):
    send, sends = answered_429(ATTEMPTS + 3)
    assert publish_once(send, session(monkeypatch, started_s_ago=60)) == ("ok", None)
    assert len(sends) == ATTEMPTS + 4
    said = capsys.readouterr().out.splitlines()
    assert said[0] == "[kchain] publish: the send did not land (HTTPError: 429); sending it again in 0s (send 2)"
    assert len(said) == ATTEMPTS + 3


def test_no_send_goes_again_once_the_session_has_no_time_for_another_upload(monkeypatch):
    send, sends = answered_429(1)
    left_s = 10.0 + publishplan.seconds(PLAN, 1000) - PLAN["start_s"] - 1.0  # the reserve, and not quite the upload
    with pytest.raises(sendonce.NotLanded):
        publish_once(send, session(monkeypatch, started_s_ago=3600 - left_s))
    assert len(sends) == 1


def test_where_the_sessions_time_is_unknown_the_sends_keep_their_bound(monkeypatch):
    monkeypatch.delenv(layout.SESSION_START_ENV, raising=False)
    send, sends = answered_429(ATTEMPTS + 3)
    with pytest.raises(sendonce.NotLanded):
        publish_once(send, Clock(RuntimeConfig(), PLAN))
    assert len(sends) == ATTEMPTS
