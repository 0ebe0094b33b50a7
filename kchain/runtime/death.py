"""The kill faults' death: the training's processes SIGKILLed at once, as when a Kaggle session ends.

On Kaggle the whole machine goes, with every process the training started. A kill fault
(KCHAIN_FAULT, for tests and the smoke) models that. The training process leads a process group of
its own (lead(), called at launch when a kill fault is set; a torchrun rank leads one already), so
one killpg() takes it together with its DataLoader workers. A worker left behind would keep the
notebook's pipe open until it noticed its parent had gone, which takes it up to 5 s
(torch's MP_STATUS_CHECK_INTERVAL): the smoke's resume would wait that long.

Nothing here runs on a normal session: without a kill fault no group is made and nothing is killed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

from . import settings


def wanted(fault_text: str) -> bool:
    """Whether KCHAIN_FAULT asks for a real death somewhere (kill_at_step, kill_after_checkpoint, kill_in_save)."""
    return any(key.startswith("kill_") for key in settings.parse_faults(fault_text))


def lead() -> None:
    """Lead a new process group, which the processes this one starts join (not torchrun's ranks:
    each of those leads its own)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # already a session leader (a torchrun rank): it leads its group
        pass


def die(others: Iterable[int] = ()) -> None:
    """SIGKILL the processes `others` (each with its group, if it leads one), then this process with
    its group if it leads one (its DataLoader workers), else this process alone. Never returns."""
    for pid in others:
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)  # one system call: nothing of this process runs between the deaths
    os.kill(os.getpid(), signal.SIGKILL)
