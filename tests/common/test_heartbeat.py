"""The heartbeat line: durations in words, and each part of the line in its place."""

from __future__ import annotations

import math

import pytest

from kchain.common import heartbeat


@pytest.mark.parametrize(("seconds", "words"), [(None, "-"), (math.inf, "-"), (math.nan, "-"), (-5, "0s"), (12.7, "12s"),
                                                (250, "4m10s"), (3600, "1h00m"), (11_100, "3h05m")])
def test_a_duration_reads_in_hours_minutes_or_seconds(seconds, words):
    assert heartbeat.duration(seconds) == words


def test_the_line_names_progress_metrics_speed_and_what_is_left():
    text = heartbeat.line(40, 120, {"loss": 0.123456, "lr": 3}, 2.5, 0.07, 32.0, 4000, "20 steps")
    assert text == ("[kchain] step 40/120 | loss 0.1235 | lr 3 | 2.50 steps/s | data wait 7% | eta 32s | "
                    "left 1h06m | ckpt in 20 steps")


def test_several_ranks_are_counted_and_an_unknown_speed_is_a_dash():
    text = heartbeat.line(1, 10, {}, None, 0.0, None, None, "10m", ranks=2)
    assert text == "[kchain] step 1/10 x2 ranks | - steps/s | data wait 0% | eta - | left - | ckpt in 10m"
