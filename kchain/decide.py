"""What `kchain continue` does next: the decision table of `kchain/runtime/nextsession.py`, on the laptop.

The table lives in the runtime (standard library only) because a kernel that chains itself
(`kchain push --unattended`) decides with the same code; its docstring is the table. This adapter
gives `chain.py` its types: `Situation` (what `chain.look` gathered) in, `Decision` out, a stop
carrying the KchainError that `chain.act` raises. No I/O, no Kaggle call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain.errors import ChainStop, KchainError, NotSmoked
from kchain.runtime import nextsession
from kchain.runtime.nextsession import NEEDS_A_PERSON, crash_of, saved_step  # noqa: F401  (the laptop's names)
from kchain.sessions import SessionRecord


@dataclass
class Decision:
    action: str  # running | finished | stop | refetch | push from decide(); pushed once act() pushed
    message: str
    record: SessionRecord | None = None
    stop: KchainError | None = None  # what act() raises for a stop
    again: bool = False  # a push of the same session again (its state was not mounted): same state and step
    attempt: int = 1  # which try of that session this push is


@dataclass(frozen=True)
class Situation:
    """Everything `decide` reads, gathered by `chain.look`."""

    chain: list[SessionRecord]  # the chain's sessions, oldest first (pushes that never landed left out)
    kernel: str  # owner/name
    on_kaggle: str | None  # Kaggle's status of the kernel's newest version (a session kchain did not start counts)
    fingerprint: Callable[[], str]  # the code's fingerprint now (it renders the job: asked only when needed)
    smoked: Callable[[str], bool]  # whether code with that fingerprint passed a smoke run


def decide(now: Situation, job_file: Path, retry: bool = False, skip_smoke: bool = False,
           output_settled: bool = False) -> Decision:
    """The next step of the chain (nextsession.decide); output_settled: the last session's lost output
    was fetched again or given up with --from-state, so it is not asked for again."""
    verdict = nextsession.decide(
        nextsession.Chain(list(now.chain), now.kernel, now.on_kaggle, now.fingerprint, now.smoked),
        str(job_file), retry=retry, skip_smoke=skip_smoke, output_settled=output_settled)
    stop: KchainError | None = None
    if verdict.stop == nextsession.NOT_SMOKED:
        stop = NotSmoked.for_job(job_file)
    elif verdict.stop is not None:
        stop = ChainStop(verdict.message)
    record: Any = verdict.record
    return Decision(verdict.action, str(stop) if stop is not None else verdict.message, record, stop,
                    verdict.again, verdict.attempt)


def final_weights(record: SessionRecord) -> Path:
    """Where a finished session's last checkpoint is, in its downloaded output."""
    return Path(nextsession.final_weights(record))
