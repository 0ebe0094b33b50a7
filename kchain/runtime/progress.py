"""Where a run stands: the one small record the loop, the checkpointer and the launcher share.

torchtitan keeps its training progress as one small stateful record beside the trainer; this is
kchain's. The loop moves `step`, the checkpointer sets `saved_step`, `session` and `resumed_from`,
the launcher sets `status` at the end, and the summary reports it. Standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kchain.common.summary import StatusName


@dataclass
class Progress:
    step: int = 0  # steps completed, restored ones included
    total: int | None = None  # the loop's total after the caps (smoke, KCHAIN_TOTAL_STEPS)
    asked: int | None = None  # the loop's total as the code asked for it, before the caps
    current: int = 0  # the step whose body is running (run.every and run.log read it)
    loop_steps: int = 0  # steps this process ran (not restored ones)
    saved_step: int | None = None  # the step of the newest checkpoint this process wrote or restored
    session: int = 1  # 1 + the resumed checkpoint's session
    resumed_from: int | None = None  # the restored checkpoint's step
    status: StatusName = "running"  # summary.Status: set when the loop ends, or by the launcher
    stop_reason: StatusName | None = None  # deadline, interrupted or stopped, once the loop must end
    stopped: bool = False  # a deadline or signal stop was saved and SessionStopped raised
    note: str | None = None  # one line for the summary when the status needs a why
    phase: str = "build"  # what the code is doing, for a crash report
    looped: bool = False  # run.steps, run.epochs, run.save or run.restore was used
    retired: bool = False  # the out-of-memory ladder replaced this attempt: nothing more of it is saved
    started_at: float | None = None  # perf_counter when this process's loop started (its pace)
    not_exact: list[str] = field(default_factory=list)  # what a resume cannot restore exactly, one line each

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def steps_per_s(self) -> float | None:
        """This process's training pace (restored steps not counted), None before a step."""
        elapsed = (time.perf_counter() - self.started_at) if self.started_at else 0.0
        return round(self.loop_steps / elapsed, 3) if elapsed > 0 else None
