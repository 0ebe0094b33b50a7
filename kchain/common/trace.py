"""The metrics trace: `run.log`'s rows in metrics.jsonl, the last values and the best one.

Rank 0 appends one JSON line per call to `<working>/kchain/metrics.jsonl`; every checkpoint holds a
copy of the trace as it was at that step, so a resume puts the history back before this session's
lines (`adopt`) and the trace reads as one uninterrupted run.

Standard library only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

LOWER_IS_BETTER = ("loss", "err", "perplexity", "ppl")  # in a val* metric's name: lower is better


def lower_is_better(name: str) -> bool:
    """Whether a metric improves downwards, by its name (a loss, an error, a perplexity)."""
    return any(w in name for w in LOWER_IS_BETTER)


class Trace:
    """The metrics of this run: the file rank 0 writes, the last values and the best val* value."""

    def __init__(self, path: Path, writes: bool):
        self.path = path
        self.writes = writes  # rank 0 writes the file; the other ranks only keep their last values
        self.metrics: dict = {}  # the last value logged under each name
        self.best: dict | None = None  # {'name', 'value', 'step'} of the first val* metric logged
        self.logged_at: dict[str, int] = {}  # the step each name was last logged at (keepbest.py reads it)
        self.bytes = 0  # the file's size after the last complete row: what a checkpoint copies
        self._file: IO[bytes] | None = None  # opened by the first row
        self.mirror: Callable[[int, dict], None] | None = None  # rank 0: each row also goes here (TensorBoard)
        if writes:
            path.write_bytes(b"")  # this session's lines; a resume puts the history before them

    def log(self, step: int, values: dict) -> None:
        """One row of plain values (numbers, strings, lists) at `step`."""
        self.logged_at.update(dict.fromkeys(values, step))
        if not self.writes:
            self.metrics.update(values)
            return
        row = {"step": step, "time": round(time.time(), 3), **values}
        line = (json.dumps(row) + "\n").encode()
        if self._file is None:
            self._file = open(self.path, "ab")
        self._file.write(line)
        self._file.flush()
        self.bytes += len(line)
        self.metrics.update(values)
        self._follow_best(step, values)
        if self.mirror is not None:
            self.mirror(step, values)

    def _follow_best(self, step: int, values: dict) -> None:
        """The first val* metric logged is the one `best` follows; lower is better for losses."""
        for k, v in values.items():
            if not k.startswith("val") or not isinstance(v, (int, float)):
                continue
            if self.best is not None and self.best["name"] != k:
                continue
            lower = lower_is_better(k)
            if self.best is None or (v < self.best["value"] if lower else v > self.best["value"]):
                self.best = {"name": k, "value": v, "step": step}
            break

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def logged(self) -> bytes:
        """What this process has logged so far (before a resume's history is put in front of it)."""
        self.flush()
        return self.path.read_bytes() if self.writes else b""

    def adopt(self, history: bytes, logged: bytes) -> None:
        """A resume: the trace as the checkpoint holds it, then what this process logged before its loop."""
        if self.writes:
            self.path.write_bytes(history + logged)
            self.bytes = self.path.stat().st_size

    def restore(self, metrics: dict | None, best: dict | None) -> None:
        self.metrics, self.best = dict(metrics or {}), best

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
