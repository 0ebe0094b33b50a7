# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""A kernel's push of the next session (common/nextkernel.push_once) against the local Kaggle with the unmodified
client, which does not retry a push itself: a 429 is sent again in place once its Retry-After has passed, an
answer lost after Kaggle acted is settled by the kernel's version and never sent twice. Either way the chain
stays in Kaggle's hands; giving up would leave it to a laptop that may be shut."""

from __future__ import annotations

import time

from emulator_helpers import USER, emulator, kaggle_api, write_kernel  # noqa: F401

from kchain.common import nextkernel

REF = f"{USER}/next-session"


def test_a_push_turned_away_three_times_with_429_lands_once(emulator, kaggle_api, tmp_path):
    folder = write_kernel(tmp_path / "k", REF, ["print('session 2')"])
    kaggle_api.kernels_push(str(folder))  # session 1, pushed by the laptop
    emulator.faults.refuse_save = "429,429,429"
    sent = nextkernel.push_once(kaggle_api, folder, REF, 600, time.monotonic() + 120)
    assert sent == {"version_before": 1, "version": 2}, sent
    assert emulator.calls["SaveKernel"] == 1 + 4 and emulator.faults.refuse_save == ""
    assert sorted(s["version"] for s in emulator.sessions()) == [1, 2]


def test_a_push_whose_answer_was_lost_after_a_429_is_settled_never_sent_twice(emulator, kaggle_api, tmp_path):
    folder = write_kernel(tmp_path / "k", REF, ["print('session 2')"])
    kaggle_api.kernels_push(str(folder))
    emulator.faults.refuse_save, emulator.faults.fail_after_save = "429", 1  # turned away, then acted and lost
    sent = nextkernel.push_once(kaggle_api, folder, REF, 600, time.monotonic() + 120)
    assert sent == {"version_before": 1, "version": 2}, sent
    assert emulator.calls["SaveKernel"] == 1 + 2
    assert sorted(s["version"] for s in emulator.sessions()) == [1, 2]
