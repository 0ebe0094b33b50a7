"""summary.json: what a session says about how it ended, written in the kernel, read on the laptop.

One typed record (`Summary`), its statuses (the type `StatusName`, each by name in `Status`), the one writer (`write`: atomic, with a disk
reserve taken at the start for a disk that fills up) and the one reader (`read`: None for a missing
or half-written file). The launcher and the Run build it, the in-kernel publish and the state folder
patch `published`, and the laptop (`kchain continue`, smoke, rehearse, the ledger) reads it back,
also from kernels rendered by an older kchain: unknown keys are kept, missing ones default to None.

Standard library only: the laptop and the publisher read it without torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal, get_args

from kchain.common import atomic, layout

RESERVE_BYTES = 64 * 1024  # held for summary.json from the start, for a disk that fills up


# Every status a session's summary can hold, as a type: mypy refuses any other text where a status goes.
StatusName = Literal["running", "finished", "stopped", "deadline", "interrupted", "crashed", "hung", "killed",
                     "no_checkpoint", "no_accelerator", "state_not_mounted"]


class Status:
    """Every status by name, in StatusName's order (docs/design.md lists them; tests compare all three)."""

    RUNNING: Final = "running"  # still training: the Run's state until the loop ends; a summary never ends with it
    FINISHED: Final = "finished"  # the loop ran to its total (or main returned after a run.save)
    STOPPED: Final = "stopped"  # the code left run.steps on purpose (early stopping): no further session
    DEADLINE: Final = "deadline"  # the session clock ran out: saved at the stop, the next session resumes there
    INTERRUPTED: Final = "interrupted"  # SIGTERM or SIGINT: saved at the stop, like a deadline
    CRASHED: Final = "crashed"  # an exception ended the run; `error` names it and its stage
    HUNG: Final = "hung"  # the watchdog saw no step complete for too long; nothing new is saved
    # a rank died by a signal from outside (the OOM killer, a segfault): its newest verified checkpoint is
    # handed on, as after a deadline; `error` names the rank and the signal
    KILLED: Final = "killed"
    NO_CHECKPOINT: Final = "no_checkpoint"  # main returned without a loop kchain drives: nothing to resume
    NO_ACCELERATOR: Final = "no_accelerator"  # a Kaggle session got fewer GPUs than the job asked for
    # the state version this session was pushed to resume was not mounted within the wait: push again
    STATE_NOT_MOUNTED: Final = "state_not_mounted"


STATUSES: tuple[StatusName, ...] = get_args(StatusName)
# Statuses an older kchain wrote under another spelling, read as today's.
OLD_STATUSES: dict[str, StatusName] = {"no-accelerator": Status.NO_ACCELERATOR}


@dataclass
class Summary:
    """summary.json as a record. `to_dict` is the file's JSON; `from_dict` reads any version of it."""

    status: StatusName | None = None  # a Status; None only in a summary kchain did not write
    session: int | None = None  # the session's number in its chain (1 + the resumed checkpoint's)
    step: int | None = None  # steps completed, restored ones included
    total: int | None = None  # the loop's total, when known
    # The total the code asked for, where a cap cut it (a smoke, KCHAIN_TOTAL_STEPS): `kchain plan` sizes a run by it.
    total_asked: int | None = None
    metrics: dict | None = None  # the last value logged of each metric
    best: dict | None = None  # {name, value, step}: the best validation metric, if any
    checkpoint: str | None = None  # the newest complete checkpoint, relative to the working dir
    error: dict | None = None  # {type, message, stage[, rank]} of a crash, a hang or a missing GPU
    started: float | None = None  # the session clock's start, unix seconds
    ended: float | None = None  # when the summary was written, unix seconds
    steps_per_s: float | None = None  # this process's training pace (restored steps not counted)
    fingerprint: str | None = None  # the rendered code's fingerprint
    resumed_from: int | None = None  # the step of the checkpoint this session resumed, or None
    published: str | None = None  # who published the end state: None, kernel, relay (or smoke)
    note: str | None = None  # one line when the status needs a why
    not_exact: list[str] | None = None  # what a resume cannot restore exactly, one line each
    world_size: int | None = None  # ranks (kchain ddp)
    torch: str | None = None  # the session's torch (torch.__version__): the image it ran on, with `cuda`
    cuda: str | None = None  # the CUDA build of that torch (torch.version.cuda), None for a CPU build
    # Written by the in-kernel publish (kchain/common/publish.py), absent until it publishes:
    published_step: int | None = None  # the step of the state it published
    published_bytes: int | None = None  # bytes uploaded (the state and a changed cache)
    publish_timing: dict | None = None  # measured figures the next session's deadline guard plans with
    # When the publish process ended (its publish and an unattended push included), unix seconds: the GPU time
    # Kaggle bills runs to here, past `ended` (absent where no publish process ran: a smoke, a failed training).
    session_ended: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this kchain does not know, kept as they are

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Summary:
        """Any summary.json's JSON (a newer, an older or a partial one); None or a non-object: empty."""
        if not isinstance(data, Mapping):
            return cls()
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        if isinstance(values.get("status"), str):
            values["status"] = OLD_STATUSES.get(values["status"], values["status"])
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON of summary.json: every key always, but the publish's only once it published (its end
        once it ended) and the torch and CUDA versions only when known."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        for key in (*_PUBLISH_KEYS, *_RUNTIME_KEYS, "session_ended", "total_asked"):
            if out[key] is None:
                del out[key]
        return {**out, **self.extra}


_PUBLISH_KEYS = ("published_step", "published_bytes", "publish_timing")
_RUNTIME_KEYS = ("torch", "cuda")  # written once known: an older kernel's summary has neither


def reserve_path(path: Path) -> Path:
    return path.with_name(f".reserve-{path.name}")


def reserve(path: Path) -> None:
    """RESERVE_BYTES set aside beside summary.json while the disk still has room (the launcher, at start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(reserve_path(path), "wb") as f:
        f.write(b" " * RESERVE_BYTES)
        f.flush()
        os.fsync(f.fileno())


def write(path: Path, summary: Summary) -> None:
    """Atomic: the notebook (or the next session) never reads half a summary.

    When the disk is full the temporary file cannot be written: the summary then goes into the
    reserved file (its blocks are already allocated), padded with spaces, renamed into place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(summary.to_dict(), indent=2, default=str) + "\n").encode()
    tmp = path.with_name(f"{layout.TMP_PREFIX}{path.name}")  # fixed: a full disk is tested through it
    spare = reserve_path(path)
    try:
        atomic.write_bytes(path, text, tmp=tmp)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not spare.is_file() or spare.stat().st_size < len(text):
            raise
        print(f"[kchain] summary: {e.strerror or e}; written into the space reserved for it", flush=True)
        with open(spare, "r+b") as f:
            f.write(text + b" " * (spare.stat().st_size - len(text)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(spare, path)
    spare.unlink(missing_ok=True)


def read(path: Path) -> Summary | None:
    """The summary in one file; None when it is missing, unreadable, half written or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return Summary.from_dict(data) if isinstance(data, dict) else None


def read_working(working: Path, search: bool = False) -> Summary | None:
    """The summary in a working dir (a sandbox's `working/` or a downloaded output).

    With `search`, a summary anywhere below is taken when the usual place has none (an output
    downloaded with an extra folder level).
    """
    candidates = [working / layout.KCHAIN_DIR / layout.SUMMARY]
    if search:
        candidates += sorted(working.rglob(layout.SUMMARY))
    for path in candidates:
        found = read(path)
        if found is not None:
            return found
    return None
