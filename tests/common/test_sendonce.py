"""The one exactly-once rule (common/sendonce.send_and_settle), on its own: a creating call is sent once, a
lost answer is settled by reading, and only a call that did not land is sent again. Its callers are tested
against the emulator's lost answers and resets (test_push, test_kernel_publish_once, test_reset_after_acting,
test_release, test_doctor_quick_save)."""

from __future__ import annotations

import pytest

from kchain.common.sendonce import NotLanded, again_after_429, send_and_settle, settle


class Lost(Exception):
    """An answer lost after Kaggle may have acted (a 5xx, a reset)."""


class Refused(Exception):
    """Kaggle said no: it did nothing."""


class Kaggle:
    """A creating call whose answers are lost `losses` times; `lands` says whether each lost send acted."""

    def __init__(self, losses: int, lands: list[bool]):
        self.losses, self.lands, self.versions, self.sends, self.reads = losses, lands, 3, 0, 0

    def send(self) -> str:
        self.sends += 1
        if self.sends <= self.losses:
            if self.lands[self.sends - 1]:
                self.versions += 1
            raise Lost(f"lost answer {self.sends}")
        self.versions += 1
        return f"version {self.versions}"

    def landed(self) -> int | None:
        self.reads += 1
        return self.versions if self.versions != 3 else None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, s: float) -> None:
        self.now += s

    def monotonic(self) -> float:
        return self.now


def call(kaggle: Kaggle, **options) -> tuple:
    clock = Clock()
    return send_and_settle(kaggle.send, kaggle.landed, lost=lambda exc: isinstance(exc, Lost), sleep=clock.sleep,
                           monotonic=clock.monotonic, **options)


def test_an_answered_call_is_sent_once_and_nothing_is_read():
    kaggle = Kaggle(0, [])
    assert call(kaggle) == ("version 4", None) and (kaggle.sends, kaggle.reads) == (1, 0)


def test_a_lost_answer_that_landed_is_read_not_sent_again():
    kaggle = Kaggle(1, [True])
    assert call(kaggle) == (None, 4) and kaggle.sends == 1 and kaggle.versions == 4


def test_a_lost_answer_that_did_not_land_is_sent_again_once_the_reading_says_so():
    kaggle = Kaggle(2, [False, False])
    assert call(kaggle, settle_s=5.0, poll_s=1.0) == ("version 4", None)
    assert kaggle.sends == 3 and kaggle.versions == 4 and kaggle.reads >= 2 * 5  # read for the whole settle time


def test_every_answer_lost_and_none_landed_gives_up_with_the_last_error():
    kaggle = Kaggle(9, [False] * 9)
    with pytest.raises(NotLanded) as caught:
        call(kaggle, attempts=3, settle_s=0.0)
    assert caught.value.attempts == 3 and str(caught.value.last) == "lost answer 3" and kaggle.versions == 3


def test_a_refusal_is_raised_as_it_is_and_nothing_is_read():
    kaggle = Kaggle(0, [])

    def refuse() -> str:
        kaggle.sends += 1
        raise Refused("409: already in use")

    with pytest.raises(Refused):
        send_and_settle(refuse, kaggle.landed, lost=lambda exc: isinstance(exc, Lost))
    assert (kaggle.sends, kaggle.reads) == (1, 0)


def test_no_second_send_when_the_caller_has_no_room_for_it():
    kaggle = Kaggle(1, [False])
    with pytest.raises(NotLanded) as caught:
        call(kaggle, settle_s=0.0, may_resend=lambda: False)
    assert caught.value.attempts == 1 and kaggle.sends == 1


def test_settle_reads_at_least_once_and_for_its_time_at_most():
    clock = Clock()
    reads: list[float] = []
    assert settle(lambda: reads.append(clock.now), 0.0, 1.0, clock.sleep, clock.monotonic) is None
    assert len(reads) == 1
    answers = iter([None, None, 7])
    assert settle(lambda: next(answers), 10.0, 1.0, clock.sleep, clock.monotonic) == 7


class Answer(Exception):
    """An HTTP error answer, read by its status code as the client's is."""

    def __init__(self, code: int):
        super().__init__(f"HTTP {code}")
        self.response = type("Response", (), {"status_code": code, "headers": {"Retry-After": "1"}})()


def answers(*codes: int):
    """A call answered with these error codes in turn, then "done"; its sends are counted."""
    sent: list[int] = []

    def call() -> str:
        sent.append(1)
        if len(sent) <= len(codes):
            raise Answer(codes[len(sent) - 1])
        return "done"
    return call, sent


def test_a_429_is_sent_again_in_place_after_its_retry_after():
    clock = Clock()
    call, sent = answers(429, 429, 429)
    assert again_after_429(call, sleep=clock.sleep, monotonic=clock.monotonic) == "done"
    assert len(sent) == 4 and 3.0 <= clock.now <= 3.75  # Retry-After: 1, plus under 0.25 s of jitter each


def test_any_other_error_reaches_the_caller_at_once_to_be_settled():
    clock = Clock()
    call, sent = answers(500)
    with pytest.raises(Answer, match="500"):
        again_after_429(call, sleep=clock.sleep, monotonic=clock.monotonic)
    assert len(sent) == 1 and clock.now == 0.0


def test_no_429_is_waited_for_past_the_callers_time_or_attempts():
    clock = Clock()
    call, sent = answers(429, 429, 429)
    with pytest.raises(Answer, match="429"):
        again_after_429(call, sleep=clock.sleep, monotonic=clock.monotonic, until=1.5)
    assert len(sent) == 2  # the second wait would end past 1.5 s
    call, sent = answers(429, 429, 429)
    with pytest.raises(Answer, match="429"):
        again_after_429(call, attempts=2, sleep=clock.sleep, monotonic=clock.monotonic)
    assert len(sent) == 2
