"""The session clock: the one deadline, the step times it is planned with, and the publish plan.

Kaggle ends a session at its limit without warning. The guard stops the loop while the next step
and a save still fit before the deadline: the session's end less what is kept back after the last
step (train.margin, or the in-kernel publish of the state when that needs longer). The deadline is
computed here and nowhere else; the loop asks `too_late()` before each step.

Standard library only (the publish figures come from publishplan.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kchain.common import heartbeat, publishplan

STEP_TIME_WINDOW = 5  # the guard plans with the slowest of the last few steps


class SessionClock:
    """When this session must stop, from its start, its limit and what the steps take."""

    def __init__(self, started: float, limit_s: float, margin_s: float, publish: dict | None):
        self.started = started  # the session's start (the notebook's first cell), epoch seconds
        self.end = started + limit_s  # the session's hard limit
        self.limit_s, self.margin_s = limit_s, margin_s
        self.publish = publish  # the in-kernel publish's figures; None when the laptop relays the state
        self.step_times: list[float] = []  # the last STEP_TIME_WINDOW steps, seconds
        self.eval_s = 0.0  # the longest step that ran run.every's evaluation
        self.every_n: int | None = None  # the n of run.every(n): which steps evaluate
        self._state_bytes = 0  # the checkpoint's size: estimated at the plan, then measured
        self._sized: Path | None = None  # the checkpoint _state_bytes was measured on
        self._last_poll: float | None = None  # run.should_stop's previous call (its step timer)

    def step_took(self, seconds: float, evaluated: bool = False) -> None:
        """One step's time; a step that ran run.every's evaluation is also remembered apart."""
        self.step_times = (self.step_times + [seconds])[-STEP_TIME_WINDOW:]
        if evaluated:
            self.eval_s = max(self.eval_s, seconds)

    def poll(self) -> None:
        """run.should_stop's timer: the time since its previous call is one step's."""
        now = time.perf_counter()
        if self._last_poll is not None:
            self.step_took(now - self._last_poll)
        self._last_poll = now

    def sized(self, checkpoint: Path | None) -> None:
        """The newest checkpoint on disk: its size is what the publish will upload."""
        if checkpoint is not None and checkpoint != self._sized:
            self._sized, self._state_bytes = checkpoint, publishplan.tree_bytes(checkpoint)

    def publish_s(self) -> float:
        """Seconds the in-kernel publish needs from the stop's save (the hand-over to the publisher included,
        so its own check of the time left finds what it planned), 0 when there is none or it cannot fit."""
        if self.publish is None:
            return 0.0
        need = publishplan.seconds(self.publish, self._state_bytes) + publishplan.handoff_s(self._state_bytes)
        return need if publishplan.fits(need, self.limit_s, self.margin_s) else 0.0

    def reserve_s(self) -> float:
        """Kept back after the last step besides the final save: train.margin, or the publish if longer."""
        return max(self.margin_s, self.publish_s())

    def deadline(self) -> float:
        """The time (epoch seconds) by which the last step and its save must be done."""
        return self.end - self.reserve_s()

    def left_s(self) -> float:
        return self.deadline() - time.time()

    def too_late(self, step: int, total: int | None, save_s: float) -> str | None:
        """Before step+1: the line to say when it and a save no longer fit before the deadline, else None."""
        step_s = max(self.step_times, default=0.0)
        nxt = step + 1
        if self.every_n and (nxt % self.every_n == 0 or nxt == total):
            # The next step runs run.every's evaluation: plan with the longest such step seen,
            # which may have left the window of recent steps long ago.
            step_s = max(step_s, self.eval_s)
        left = self.left_s()
        if left >= step_s + save_s:
            return None
        return (f"deadline: {left:.1f}s left before the session limit and a step takes {step_s:.2f}s "
                f"(+{save_s:.2f}s to save): stopping at step {step} and saving")

    def plan(self, state_bytes: Callable[[], int]) -> str | None:
        """Once, at the first heartbeat: when the session stops and what the time after it is for."""
        if self.publish is None:
            return None
        if not self._state_bytes:
            self._state_bytes = state_bytes()
        size = publishplan.size_text(self._state_bytes)
        need = publishplan.seconds(self.publish, self._state_bytes) + publishplan.handoff_s(self._state_bytes)
        source = "measured" if self.publish.get("measured") else "assumed"
        if not self.publish_s():
            return (f"plan: the publish of {size} needs about {heartbeat.duration(need)} ({source}), more than half "
                    f"this session: stopping at {heartbeat.duration(self.end - self.margin_s - self.started)}; "
                    "`kchain continue` relays the state from the laptop")
        return (f"plan: stopping at {heartbeat.duration(self.deadline() - self.started)}: "
                f"{heartbeat.duration(self.reserve_s())} for save + publish of {size} ({source} figures)")
