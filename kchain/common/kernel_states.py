"""A Kaggle session's states, as the client reports them, and which of them have ended.

The names are those of kagglesdk's `KernelWorkerStatus` enum (kagglesdk 0.1.38,
kagglesdk/kernels/types/kernels_enums.py), which `kaggle kernels status` prints and the emulator
answers; tests/common/test_kernel_states.py checks them against the installed client.
"""

from __future__ import annotations

QUEUED = "QUEUED"
RUNNING = "RUNNING"
COMPLETE = "COMPLETE"
ERROR = "ERROR"
CANCEL_REQUESTED = "CANCEL_REQUESTED"
CANCEL_ACKNOWLEDGED = "CANCEL_ACKNOWLEDGED"
NEW_SCRIPT = "NEW_SCRIPT"
KAGGLE = (QUEUED, RUNNING, COMPLETE, ERROR, CANCEL_REQUESTED, CANCEL_ACKNOWLEDGED, NEW_SCRIPT)  # the enum's order

# kchain's own state of a session record whose SaveKernel has not answered yet (Kaggle never says it).
PUSHING = "PUSHING"

TERMINAL = (COMPLETE, ERROR, CANCEL_ACKNOWLEDGED)  # the session has ended: its output and log are final
LIVE = (PUSHING, QUEUED, RUNNING, CANCEL_REQUESTED, NEW_SCRIPT)  # not ended yet
