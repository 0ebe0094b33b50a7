"""A rehearsal's sessions planned in steps (`KCHAIN_SESSION_PLAN=K`, set by `kchain rehearse` only).

The run's total is cut into K spans of (nearly) equal steps. A session stops through the deadline
path (saved, status `deadline`, SessionStopped) at the first span end past the step it resumed
from, and saves in the middle of each span: the checkpoint after which the local Kaggle kills the
session the rehearsal chose (its kill_after_checkpoint). The plan adds those saves to the job's own
cadence in steps, which stays (a job validates at the steps it checkpoints, and train.keep_best keeps
the best of those); a cadence in seconds is replaced, so the same job makes the same sessions, stops
and checkpoints on any machine, loaded or not; the wall-clock deadline stays on behind it as a safety
net. The uninterrupted reference run gets the plan's saves without its stops (`K/saves`): it saves at
every step a session of the chain saves at, so both keep the same best. A loop with no total (a loop
of the user's own, run.should_stop) cannot be cut: its clock and cadence decide, as without a plan.

Standard library only: Settings parses it before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SessionPlan:
    sessions: int  # the spans the run's total is cut into: the sessions of a chain no one kills
    stops: bool = True  # False: the reference run, saving where the sessions save and stop, never stopping

    def ends(self, total: int) -> list[int]:
        """The steps at which a span ends before the total: ceil(i * total / sessions), i < sessions."""
        return sorted({end for i in range(1, self.sessions) if 0 < (end := -(-i * total // self.sessions)) < total})

    def stop_at(self, resumed: int, total: int) -> int | None:
        """The step a session that resumed at `resumed` stops at (None: it runs to the total)."""
        return next((end for end in self.ends(total) if end > resumed), None)

    def saves_at(self, step: int, total: int) -> bool:
        """Whether the plan saves after `step`: the middle of a span (its end is a stop, which saves)."""
        bounds = [0, *self.ends(total), total]
        if not self.stops and step in bounds[1:-1]:
            return True  # where a session of the chain stops (and saves)
        return any(a < step < b and step == (a + b) // 2 for a, b in zip(bounds, bounds[1:], strict=False))

    def deadline_line(self, step: int, resumed: int, total: int | None) -> str | None:
        """The line to say when this session's planned stop is reached at `step`, else None."""
        end = self.stop_at(resumed, total) if total and self.stops else None
        if end is None or step < end:
            return None
        return (f"deadline (the rehearsal's plan: {self.sessions} spans of the {total} steps) at step {step}: "
                "stopping and saving")


SAVES_ONLY = "/saves"  # the reference run's plan: '3/saves'


def parse(text: str | None) -> SessionPlan | None:
    """KCHAIN_SESSION_PLAN's value ('3') -> SessionPlan(3); '3/saves' -> the reference's; unset or empty -> None."""
    if not text:
        return None
    saves_only = text.endswith(SAVES_ONLY)
    try:
        sessions = int(text.removesuffix(SAVES_ONLY))
    except ValueError:
        sessions = 0
    if sessions < 1:
        raise ValueError(f"KCHAIN_SESSION_PLAN={text!r} is not a number of sessions; write e.g. 3")
    return SessionPlan(sessions, stops=not saves_only)


def reference(sessions: int) -> str:
    """KCHAIN_SESSION_PLAN for the uninterrupted reference of a chain planned in `sessions` spans."""
    return f"{sessions}{SAVES_ONLY}"
