"""A hung step does not burn the session: a watchdog thread ends the run when no step completes.

The limit is max(floor, 10 x the slowest step so far): 30 minutes by default (`train.hang_timeout_s`
in the config, or KCHAIN_HANG_TIMEOUT seconds for tests). Before the first step completes only the
floor applies (compilation, the first batch). When it fires it prints every thread's stack to the
log, writes the summary with status `hung` (and no new checkpoint: the state of a hung step is not
trusted) and ends the process at once; `kchain continue` then resumes from the last checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

SLOWEST_FACTOR = 10
EXIT_HUNG = 3


def _stacks() -> str:
    """Every thread's stack, as the log shows it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


class Watchdog:
    """Started by run.steps; `beat(step_s)` after each step; `stop()` when the loop ends."""

    def __init__(self, floor: float, on_hang: Callable[[float, float], None], poll_s: float = 1.0) -> None:
        self.floor = floor
        self.on_hang = on_hang
        self.poll_s = min(poll_s, max(0.05, floor / 10))
        self.slowest = 0.0
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kchain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step_s: float) -> None:
        self.slowest = max(self.slowest, step_s)
        self.last = time.monotonic()

    def pause(self) -> None:
        """Not a step: a save or a validation between steps is timed separately (restarts the clock)."""
        self.last = time.monotonic()

    def limit(self) -> float:
        return max(self.floor, SLOWEST_FACTOR * self.slowest)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = time.monotonic() - self.last
            if waited > self.limit():
                self.on_hang(waited, self.limit())
                return


def end_hung(say: Callable[[str], None], write_summary: Callable[[], None], waited: float, limit: float) -> None:
    """What the watchdog does: stacks to the log, the summary, and the process ends now."""
    say(f"hung: no step completed for {waited:.0f}s (limit {limit:.0f}s: the larger of the floor and "
        f"{SLOWEST_FACTOR}x the slowest step); every thread's stack follows; nothing new is saved")
    print(_stacks(), flush=True)
    try:
        write_summary()
    finally:
        sys.stdout.flush()
        os._exit(EXIT_HUNG)
