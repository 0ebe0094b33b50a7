"""Turn a failed training process into one screen: the error's class, its first line, and a hint.

Read the traceback for its class before its message: shape and dtype errors are code bugs that
belong on the laptop; out-of-memory is a capacity problem; file-not-found is a path or staging
problem. The same hints serve `kchain smoke`, `kchain logs` and `kchain continue`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kchain.common.summary import Summary
from kchain.job import extras

_HINTS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"UnsyncedReplicas"),
        "two ranks (Kaggle's T4 x2) would train two models: use model = run.wrap(model) and call the wrapped model",
    ),
    (
        re.compile(r"UntrackedState"),
        "state no checkpoint holds (a model wrapped but not tracked, an EMA kept beside the model, a "
        "generator the code draws from) would start over at a resume: pass each to run.track(...) before "
        "the loop, or exclude what a resume rebuilds exactly with run.untrack(obj, reason=...)",
    ),
    (
        re.compile(r"PreflightError"),
        "a preflight check failed before training: fix the data or the model so the check holds",
    ),
    (
        re.compile(r"OutOfMemory|out of memory|CUBLAS_STATUS_ALLOC_FAILED|DefaultCPUAllocator", re.I),
        "out of memory: lower the micro-batch and raise accumulate (the effective batch stays the same)",
    ),
    (
        re.compile(r"FileNotFound|No such file|IsADirectory|NotADirectory"),
        "a data path or staging problem: read inputs with run.input(slug) and attach the dataset "
        "(kaggle.datasets; kaggle.local for the laptop)",
    ),
    (
        re.compile(r"shape|size mismatch|mat1 and mat2|must match the size|dimension|expected input", re.I),
        "a shape bug in the code: it fails the same on 2 rows as on 2 million, so fix it here on the laptop",
    ),
    (
        re.compile(r"dtype|scalar type|expected .* but found|Long|Float|Half|BFloat16", re.I),
        "a dtype bug in the code (e.g. float labels for cross-entropy): fix it here on the laptop",
    ),
    (
        re.compile(r"KeyError|IndexError"),
        "a missing key, column or index: check the data's columns and the code that reads them",
    ),
    (
        re.compile(r"Lightning is not installed"),
        "a framework this laptop lacks (Kaggle's image has it): pip install 'kchain[lightning]'",
    ),
    (
        re.compile(r"ModuleNotFound|ImportError"),
        "a missing module: Kaggle's image has the common ones; put your own modules in the code folder",
    ),
    (
        re.compile(r"Killed|SIGKILL|exit code -9|code -9"),
        "the process was killed from outside (session limit, memory, or a kill): resume from the checkpoint",
    ),
]

STAGES = ("preflight", "build", "step", "validation", "checkpoint", "resume")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)|[A-Za-z_][\w.]*Error)(?::\s?(.*))?$")


@dataclass(frozen=True)
class Failure:
    type: str
    message: str
    stage: str | None
    hint: str

    def one_line(self) -> str:
        where = f" during {self.stage}" if self.stage else ""
        return f"{self.type}: {self.message}{where}"


_MISSING = re.compile(r"No module named '(\w+)")


def hint_for(error_type: str, message: str) -> str:
    text = f"{error_type}: {message}"
    missing = _MISSING.search(text)
    if missing and (found := extras.extra(extras.distribution(missing.group(1)))):
        return (f"a framework this laptop lacks ({missing.group(1)}; `kchain doctor` compares Kaggle's image with "
                f"this laptop): {found.install}")
    for pattern, hint in _HINTS:
        if pattern.search(text):
            return hint
    return "read the traceback above; reproduce it with `kchain smoke` before spending GPU time"


def from_summary(summary: Summary | None) -> Failure | None:
    """The failure recorded by the runtime in summary.json, if any."""
    if summary is None or not summary.error:
        return None
    err = summary.error
    etype = str(err.get("type") or "Error")
    message = str(err.get("message") or "")
    return Failure(etype, message, err.get("stage"), hint_for(etype, message))


def from_log(text: str) -> Failure | None:
    """The last exception line of a traceback in a log (for sessions that left no summary)."""
    found: tuple[str, str] | None = None
    in_tb = False
    for raw in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw).strip()
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
            continue
        m = _EXC_LINE.match(line)
        if in_tb and m:
            found = (m.group(1).rsplit(".", 1)[-1], (m.group(2) or "").strip())
            in_tb = False
    if found is None:
        return None
    return Failure(found[0], found[1], None, hint_for(*found))
