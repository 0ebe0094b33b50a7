"""The kernel's publisher asks a read again after a transient failure, and keeps asking while the session's
time allows: giving up hands the chain to the laptop (an unattended chain saw six failures in a row)."""

from __future__ import annotations

import time

import pytest
import requests

from kchain.common.publish import read


def failing(times: int, status: int = 429):
    """A call answered `status` (Retry-After: 0) `times` times, then "ready"."""
    left = [times]

    def call() -> str:
        if left[0] > 0:
            left[0] -= 1
            response = requests.Response()
            response.status_code, response.headers["Retry-After"] = status, "0"
            raise requests.HTTPError(f"{status}", response=response)
        return "ready"
    return call


def test_a_read_is_asked_again_while_the_session_has_time_and_given_up_without_it(capsys):
    assert read("reading x", failing(5)) == "ready"  # within its attempts
    with pytest.raises(requests.HTTPError):
        read("reading x", failing(6))  # six failures, no deadline: the sixth is raised
    assert read("reading x", failing(9), until=time.monotonic() + 60) == "ready"  # time left: asked again
    with pytest.raises(requests.HTTPError):
        read("reading x", failing(9), until=time.monotonic() - 1)  # the session's time is spent
    said = capsys.readouterr().out.splitlines()
    assert said[0] == "[kchain] publish: reading x failed (HTTPError: 429); retrying in 0s"
    assert len(said) == 5 + 5 + 9 + 5  # every retry said: 5, 5, 9, and 5 before the spent time stops it


def test_an_answer_that_is_not_transient_is_raised_at_once():
    calls = failing(1, status=403)
    with pytest.raises(requests.HTTPError):
        read("reading x", calls, until=time.monotonic() + 60)
