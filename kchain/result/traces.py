"""Metrics traces and the resume verdict, shared by `smoke`, `rehearse` and `plot`.

A trace is the runtime's `metrics.jsonl`: one JSON object per `run.log` call, with `step`. Two traces
are judged step by step; the first value that differs names the state the code forgot to track.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kchain.common import layout
from kchain.job import diagnose

Row = tuple[int, str, float, float | None]  # step, metric, uninterrupted, resumed (None: missing)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """A metrics trace (JSON lines); [] when the run never logged."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def sandbox_trace(root: Path) -> Path:
    """Where a notebook run under the /kaggle-like ROOT leaves its metrics trace."""
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.METRICS


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))
    }


def compare_traces(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]]
) -> tuple[list[Row], tuple[int, str] | None]:
    """Rows (step, metric, reference, resumed) and the first (step, metric) that differs."""
    rows: list[Row] = []
    first: tuple[int, str] | None = None
    by_step: dict[tuple[int, str], float] = {}
    for rec in resumed:
        for key, value in _numbers(rec).items():
            by_step[(rec["step"], key)] = value
    for rec in reference:
        for key, value in _numbers(rec).items():
            other = by_step.get((rec["step"], key))
            rows.append((rec["step"], key, value, other))
            same = other is not None and (other == value or (math.isnan(value) and math.isnan(other)))
            if not same and first is None:
                first = (rec["step"], key)
    return rows, first


# A batch drawn in the step before: the resumed process draws its first one before the checkpoint is
# restored (run.steps restores it), so that step trains on another batch than the uninterrupted run.
PREFETCH = (
    "a batch is fetched in the step before the one that trains on it (a prefetch like nanoGPT's "
    "`x, y = get_batch()` at the end of the step): fetch each batch at the start of its step instead"
)


# What makes two runs differ with no resume between them. Each run of a smoke is a process of its own, as each
# Kaggle session is, with a hash seed of its own (local.py drops a PYTHONHASHSEED the laptop has).
NOT_DETERMINISTIC = ("an unseeded RNG, a nondeterministic kernel, a value read from the clock, or an order taken "
                     "from a set of strings: each process draws its own hash seed")


def likely_cause(first: tuple[int, str], resume_step: int, not_exact: list[str] | None = None) -> str:
    """The state most likely missing from the checkpoint, from where the traces first part."""
    step, key = first
    if step <= resume_step:
        return f"the trace before the kill differs: the training is not deterministic even without a resume ({NOT_DETERMINISTIC})"
    if not_exact:  # the runtime already named what it cannot restore (a hand-built DataLoader, a stream)
        return not_exact[0]
    if key.startswith("val"):
        return "only validation differs: validation uses randomness that is not seeded or tracked"
    if step == resume_step + 1:
        return (
            "the first step after the resume differs: the data order is not from run.loader, a generator "
            f"or RNG the model uses is not in run.track, or {PREFETCH}"
        )
    # With accumulation a prefetched batch is the step's first micro-batch, not the one whose loss is logged.
    return (
        "the first resumed step matches but later ones drift: optimizer, LR scheduler or GradScaler "
        f"state is not in run.track (run.optimize tracks the optimizer for you), or {PREFETCH}"
    )


def judge(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]], resume_step: int, total_steps: int,
    not_exact: list[str] | None = None,
) -> tuple[list[Row], diagnose.Failure | None, str]:
    """Compare an uninterrupted trace with a killed-and-resumed one: (rows, failure or None, verdict)."""
    rows, first = compare_traces(reference, resumed)
    bad = next(((step, key, value) for step, key, value, _ in rows if not math.isfinite(value)), None)
    if not rows:
        return rows, diagnose.Failure(
            "NoMetrics", "nothing was logged; call run.log(loss=...) every step", "step",
            "the smoke compares logged losses to prove the resume",
        ), ""
    if bad is not None:
        return rows, diagnose.Failure(
            "NonFiniteMetric", f"{bad[1]} is {bad[2]} at step {bad[0]}", "step",
            "a loss that is already nan or inf in two steps will be on the GPU too: check the learning "
            "rate, the input scale, the labels and any log/division in the loss",
        ), ""
    if max(r[0] for r in rows) <= resume_step or not any(rec["step"] > resume_step for rec in resumed):
        return rows, diagnose.Failure(
            "ResumeNotExercised", f"no step after the checkpoint at step {resume_step} was compared",
            "resume", f"run.steps(total) must allow at least {total_steps} steps in a smoke run",
        ), ""
    if first is not None:
        return rows, diagnose.Failure(
            "ResumeMismatch", f"{first[1]} at step {first[0]} differs from the uninterrupted run",
            "resume", likely_cause(first, resume_step, not_exact),
        ), ""
    biggest = max(abs(r[2] - (r[3] or 0.0)) for r in rows)
    return rows, None, (
        f"PASS: resumed run equals the uninterrupted run bit for bit "
        f"({len(rows)} values over {total_steps} steps, largest difference {biggest:.1e})"
    )


def last_val(trace: list[dict[str, Any]]) -> str:
    """The last validation metric logged, formatted for the run log; '' when none was."""
    for rec in reversed(trace):
        for key, value in rec.items():
            if key.startswith("val") and isinstance(value, (int, float)):
                return f"{value:.6g}"
    return ""


def print_traces(echo: Callable[[str], None], rows: list[Row], resume_step: int) -> None:
    """The two traces side by side, the first resumed step marked."""
    echo(f"  {'step':>6}  {'metric':<12} {'uninterrupted':>16} {'killed+resumed':>16}  diff")
    for step, key, ref, got in rows:
        marker = "  <- resumed here" if step == resume_step + 1 and key == rows[0][1] else ""
        if got is None:
            echo(f"  {step:>6}  {key:<12} {ref:>16.8g} {'missing':>16}  -{marker}")
        else:
            echo(f"  {step:>6}  {key:<12} {ref:>16.8g} {got:>16.8g}  {abs(ref - got):.1e}{marker}")
