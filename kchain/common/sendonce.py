"""Every creating call kchain makes, sent once: the one rule, for the laptop and the kernel alike.

The rule (`send_and_settle`): a creating call (a kernel push, a quick save, a dataset's creation or
version, a model's, a variation's) is sent once. When its answer is lost (a 5xx, a reset, a timeout:
Kaggle may have acted), Kaggle is read until it shows the call landed (a new version number, the thing
now exists) or a settle time passes; only a call Kaggle shows did not land is sent again, while
attempts (and the caller's time) remain. Its callers: push.py, doctor.py (the quick save), datasets.py,
release.py, and in the kernel publish.py and nextkernel.py.

Below it, the client's own retry:

kaggle 2.2.5 wraps CreateDataset and CreateDatasetVersion[ById] in `KaggleApi.with_retry` (up to 10
attempts), which re-sends on a connection error even when Kaggle acted before the connection broke:
one lost answer, two dataset versions. `sent_once(api.with_retry, ...)` is a drop-in replacement
that leaves every other call to the client's own retry and sends a creating call once, retrying
only a 429 in place (Kaggle did nothing); its caller then settles a lost answer by looking at the
dataset or the kernel. The laptop's client (`kchain/kaggle/client.py`) and the kernel's publish
(`kchain/common/publish.py`) install the same one.

Standard library only (the exception is read by its attributes, not by importing requests): it is
embedded into the kernel with the runtime, and the kaggle client there is whichever Kaggle's image has.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

# The SDK client methods that create something, by name. save_kernel is not wrapped in 2.2.5; it is
# listed so that a client which starts wrapping it changes nothing.
CREATING_SDK_CALLS = ("save_kernel", "create_dataset", "create_dataset_version", "create_dataset_version_by_id",
                      "create_model", "create_model_instance", "create_model_instance_version")

Delay = Callable[[int, BaseException], float]
TAKEN = "already in use"  # the client's and Kaggle's words for a slug that exists: a resend of one that landed
T = TypeVar("T")


class NotLanded(Exception):
    """Every send lost its answer and Kaggle shows none of them landed; `last` is the last send's error."""

    def __init__(self, attempts: int, last: BaseException):
        super().__init__(f"{attempts} sends in a row lost their answer and none landed ({last})")
        self.attempts, self.last = attempts, last


def send_and_settle(send: Callable[[], T], landed: Callable[[], Any], *, lost: Callable[[BaseException], bool],
                    attempts: int = 4, settle_s: float = 6.0, poll_s: float = 1.0,
                    may_resend: Callable[[], bool] = lambda: True, sleep: Callable[[float], None] = time.sleep,
                    monotonic: Callable[[], float] = time.monotonic) -> tuple[T | None, Any]:
    """(send's answer, None) when it answered; (None, what landed() read) when an answer was lost but
    Kaggle shows the call landed. landed() reads Kaggle: a true value (the new version, True) once the
    call shows, a false one until then; it is read at least once and for settle_s at most. An error
    `lost` does not call a lost answer (a refusal) is raised as it is; after the last lost answer, or
    when may_resend() says no, NotLanded (its `last` the send's own error)."""
    for attempt in range(attempts):
        try:
            return send(), None
        except Exception as exc:
            if not lost(exc):
                raise
            seen = settle(landed, settle_s, poll_s, sleep, monotonic)
            if seen:
                return None, seen
            if attempt == attempts - 1 or not may_resend():
                raise NotLanded(attempt + 1, exc) from exc
    raise AssertionError("unreachable")


def settle(landed: Callable[[], Any], within_s: float, poll_s: float = 1.0, sleep: Callable[[float], None] = time.sleep,
           monotonic: Callable[[], float] = time.monotonic) -> Any:
    """What landed() reads once it is true, polled for within_s at most (read once at least); else its last
    false answer. How a lost answer is settled, and how a sent call is waited for: by reading."""
    deadline = monotonic() + within_s
    while True:
        seen = landed()
        if seen or monotonic() + poll_s > deadline:
            return seen
        sleep(poll_s)


def status_code(exc: BaseException | None) -> int | None:
    """The HTTP status behind exc, from it or the errors it was raised from (None: no answer came)."""
    for _ in range(5):
        if exc is None:
            return None
        code = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(code, int):
            return code
        exc = exc.__cause__ or exc.__context__
    return None


def retry_delay_s(attempt: int, exc: BaseException, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Seconds before attempt+1: a 429's Retry-After in seconds when it gives one, else an
    exponential backoff with equal jitter (a floor, and retries spread apart)."""
    headers: Any = getattr(getattr(exc, "response", None), "headers", None)  # any client's answer
    after: Any = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return min(max(0.0, float(after)), cap_s) + random.uniform(0, 0.25)
    except (TypeError, ValueError):
        base = min(cap_s, base_s * 2 ** attempt)
        return base / 2 + random.uniform(0, base / 2)


def sent_once(with_retry: Callable[..., Any], attempts: int = 6, delay: Delay = retry_delay_s,
              sleep: Callable[[float], None] = time.sleep) -> Callable[..., Any]:
    """The client's with_retry, except for the creating SDK calls (CREATING_SDK_CALLS): those are
    retried on a 429 only, so an answer lost after Kaggle acted (a 5xx, a reset connection) reaches
    the caller instead of being sent again. Install it as `api.with_retry = sent_once(api.with_retry)`."""
    def choose(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if getattr(func, "__name__", "") not in CREATING_SDK_CALLS:
            return with_retry(func, *args, **kwargs)

        def send(*call_args: Any, **call_kwargs: Any) -> Any:
            return again_after_429(lambda: func(*call_args, **call_kwargs), attempts, delay, sleep)
        return send
    return choose


def again_after_429(call: Callable[[], T], attempts: int = 6, delay: Delay = retry_delay_s,
                    sleep: Callable[[float], None] = time.sleep, until: float | None = None,
                    monotonic: Callable[[], float] = time.monotonic) -> T:
    """call(), sent again after a 429 only (Kaggle did nothing), once its Retry-After has passed: `attempts`
    sends at most, and none whose wait would end past `until` (a monotonic deadline) when one is given. Every
    other error reaches the caller as it is: an answer lost after Kaggle may have acted is the caller's to settle."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - all but a 429 go to the caller, which settles them
            if status_code(exc) != 429 or attempt == attempts - 1:
                raise
            wait = delay(attempt, exc)
            if until is not None and monotonic() + wait > until:
                raise
            sleep(wait)
    raise AssertionError("unreachable")
