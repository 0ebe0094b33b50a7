"""`train.keep_best`: the checkpoint of the best step, kept beside the `keep` newest.

A checkpoint is the best when the followed metric was logged at its own step (validate at the steps
you checkpoint) with a value better than that of every earlier such checkpoint. Every manifest carries
the record of the best so far (`keep_best`: metric, mode, value, step), so pruning
(checkpoint_files.prune) spares that step's folder, a resume knows the value to beat, and the end state
(statefolder.py) carries that checkpoint beside the newest as `best.*` files.

The whole checkpoint is kept (state.pt with the optimizer, as the checkpoint holds it), not the weights
alone: one kind of checkpoint, verified like every other and loadable by `kchain pull`. Its bytes are
said in the checkpoint plan line.

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kchain.common.say import say
from kchain.common.trace import Trace, lower_is_better

MODES = ("min", "max")
OFF = "off"


@dataclass(frozen=True)
class Choice:
    """Which metric keep_best follows, and which way is better."""

    metric: str | None = None  # None: the one run.best follows (the first val* metric logged)
    mode: str | None = None  # 'min' or 'max'; None: by the name (a loss, an error: min)

    def describe(self, trace_best: dict | None = None) -> str:
        """'val_acc (max)', 'val_loss' (mode by its name), 'the first val* metric' (none logged yet)."""
        metric = self.metric or (trace_best or {}).get("name") or "the first val* metric"
        return f"{metric} ({self.mode})" if self.mode else metric


def parse(value) -> Choice | None:
    """The config's `train.keep_best` (spec.py checked it): None the default, 'off', a metric, or a map."""
    if value is None:
        return Choice()
    if value == OFF:
        return None
    if isinstance(value, str):
        return Choice(metric=value)
    return Choice(metric=value.get("metric"), mode=value.get("mode"))


def better(value: float, than: float, mode: str) -> bool:
    return value < than if mode == "min" else value > than


class KeepBest:
    """The best checkpoint so far: the record each new manifest carries."""

    def __init__(self, choice: Choice | None):
        self.choice = choice
        self.record: dict | None = None  # {'metric', 'mode', 'value', 'step'}

    def restore(self, record: dict | None) -> None:
        """A resume: the best as the resumed checkpoint recorded it (unless the metric changed)."""
        if self.choice is None or not isinstance(record, dict):
            return
        if self.choice.metric is not None and record.get("metric") != self.choice.metric:
            say(f"keep_best now follows {self.choice.metric!r}, the checkpoint kept {record.get('metric')!r}: "
                "the best starts over")
            return
        self.record = dict(record)

    def at_save(self, step: int, trace: Trace) -> dict | None:
        """The record the checkpoint of `step` carries: this step's, if its value beats the kept one."""
        if self.choice is None:
            return None
        metric = self.choice.metric or (trace.best or {}).get("name")
        if not metric or trace.logged_at.get(metric) != step:
            return self.record
        value = trace.metrics.get(metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self.record
        mode = self.choice.mode or ("min" if lower_is_better(metric) else "max")
        old = self.record
        if old is None or old.get("metric") != metric or better(value, float(old["value"]), mode):
            self.record = {"metric": metric, "mode": mode, "value": value, "step": step}
        return self.record


def adopt(keeper: KeepBest, metric: str, mode: str, setting: str) -> str:
    """A framework's own best-model setting (`setting`, in its words) onto train.keep_best; the line to say.

    job.yaml's explicit keep_best (or off) wins; the default follows the framework's metric and mode.
    """
    if keeper.choice is None:
        return f"{setting} is not applied: train.keep_best is off"
    if keeper.choice != Choice():
        return (f"{setting} is not applied: train.keep_best names {keeper.choice.describe()}, which applies"
                if (keeper.choice.metric, keeper.choice.mode) != (metric, mode) else f"{setting} is train.keep_best's")
    keeper.choice = Choice(metric, mode)
    return (f"{setting} maps onto train.keep_best: the checkpoint with the best {metric} ({mode}) is kept beside "
            "the newest, at the steps a checkpoint is saved; `kchain pull --best` brings its weights home")
