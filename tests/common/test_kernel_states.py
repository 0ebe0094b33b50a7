"""kchain's names for a Kaggle session's states are the installed client's, and each is live or ended."""

from __future__ import annotations

from kagglesdk.kernels.types.kernels_enums import KernelWorkerStatus

from kchain.common import kernel_states


def test_the_states_are_the_clients_and_each_is_live_or_terminal():
    assert kernel_states.KAGGLE == tuple(status.name for status in KernelWorkerStatus)
    assert set(kernel_states.LIVE) | set(kernel_states.TERMINAL) == {*kernel_states.KAGGLE, kernel_states.PUSHING}
    assert not set(kernel_states.LIVE) & set(kernel_states.TERMINAL)
    assert kernel_states.PUSHING not in kernel_states.KAGGLE
