"""The run's settings: the cadence syntax and the defaults, the same as the spec's."""

from __future__ import annotations

import pytest

from kchain.common import layout
from kchain.common.config import RuntimeConfig
from kchain.common.settings import Settings


def test_cadence_syntax_and_defaults_agree_with_the_spec():
    from kchain.job.spec import Job

    def every(text):
        return Settings.parse(RuntimeConfig(), {layout.CHECKPOINT_EVERY_ENV: text}).every

    assert every("20 steps") == {"steps": 20}
    assert every("10m") == {"seconds": 600.0}
    assert every("30s") == {"seconds": 30.0}
    with pytest.raises(ValueError, match="KCHAIN_CHECKPOINT_EVERY='ten minutes' is not a cadence; write e.g."):
        every("ten minutes")
    # A Run built with no train: config plans like a job.yaml without one.
    plain = Settings.parse(RuntimeConfig(), {}, started=0.0)
    spec = Job(name="defaults", code="train.py")
    assert plain.margin_s == 15 * 60 == settings_seconds(spec.train.margin)
    assert plain.limit_s == settings_seconds(spec.train.session_limit)
    assert plain.every == {"seconds": settings_seconds(spec.train.checkpoint_every)}
    assert plain.keep == spec.train.keep and plain.heartbeat_s == settings_seconds(spec.train.heartbeat)
    smoke = Settings.parse(RuntimeConfig(), {layout.SMOKE_ENV: "1"})
    assert (smoke.fraction, smoke.smoke_steps) == (spec.smoke.fraction, spec.smoke.steps)


def settings_seconds(text) -> float:
    from kchain.common.settings import parse_duration

    return parse_duration(text)
