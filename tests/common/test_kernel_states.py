"""kchain's names for a Kaggle session's states (kchain/common/sessionstate.py) are the installed client's, and each
is live or ended."""

from __future__ import annotations

from kagglesdk.kernels.types.kernels_enums import KernelWorkerStatus

from kchain.common import sessionstate
from kchain.common.sessionstate import SessionState


def test_the_states_are_the_clients_and_each_is_live_or_terminal():
    assert sessionstate.KAGGLE == tuple(status.name for status in KernelWorkerStatus)
    assert set(sessionstate.LIVE) | set(sessionstate.TERMINAL) == {*sessionstate.KAGGLE, SessionState.PUSHING}
    assert not set(sessionstate.LIVE) & set(sessionstate.TERMINAL)
    assert SessionState.PUSHING not in sessionstate.KAGGLE
