"""What `kchain continue` does next, decided from the chain's records alone (no I/O, no Kaggle call).

`chain.py` gathers what this reads (the records, Kaggle's word on the kernel, the code's fingerprint),
calls `decide`, then performs the decision (`chain.act`). The table, first match wins:

  no session yet                                  -> stop: push first
  Kaggle runs a session kchain did not start      -> stop: wait for it
  the last session is queued or running           -> running (its last heartbeat)
  finished                                        -> finished (the final weights)
  stopped (the loop left run.steps on purpose)    -> finished: no further session
  no_checkpoint                                   -> stop: nothing to resume
  deadline without training a step                -> stop: start-up fills the session
  no accelerator                                  -> stop unless --retry
  crashed or hung, the same error as before       -> stop: fix the code
  crashed or hung, the same code, no --retry      -> stop: fix it, or --retry
  ended, but its output could not be fetched      -> refetch (then decide again)
  two sessions in a row saved no step past the    -> stop: no progress; raise the margin or save
    one they resumed at, same code, no --retry         more often, or --retry
  code that never passed a smoke run              -> stop unless --skip-smoke
  otherwise (deadline, killed, timed out, ...)    -> push the next session from the newest state
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain.errors import ChainStop, KchainError, NotSmoked
from kchain.kernel_states import LIVE, TERMINAL
from kchain.runtime import layout
from kchain.runtime.summary import Status
from kchain.sessions import SessionRecord, summary_of

# Session ends that another identical session would repeat: each needs --retry (or a code change).
NEEDS_A_PERSON = (Status.CRASHED, Status.HUNG, Status.NO_ACCELERATOR)


@dataclass
class Decision:
    action: str  # running | finished | stop | refetch | push from decide(); pushed once act() pushed
    message: str
    record: SessionRecord | None = None
    stop: KchainError | None = None  # what act() raises for a stop


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
    """The next step of the chain; output_settled: the last session's lost output was fetched again
    or given up with --from-state, so it is not asked for again."""
    if not now.chain:
        name = now.kernel.split("/", 1)[-1]
        return _stop(ChainStop(f"{name} has no session yet: start it with `kchain push {job_file}`"))
    last = now.chain[-1]
    decision = _while_live(now, last) or _after_end(last, len(now.chain), job_file)
    if decision is not None:
        return decision
    fingerprint = now.fingerprint()
    decision = _after_crash(now.chain, fingerprint, job_file, retry)
    if decision is not None:
        return decision
    if last["status"] in TERMINAL and not last.get("output") and last.get("output_error") and not output_settled:
        return Decision("refetch", f"the output of session {last['session']} could not be fetched", last)
    decision = _without_progress(now.chain, fingerprint, job_file, retry)
    if decision is not None:
        return decision
    if not now.smoked(fingerprint) and not skip_smoke:
        return _stop(NotSmoked.for_job(job_file))
    return Decision("push", f"push session {last['session'] + 1} from the newest state", last)


def _stop(error: KchainError) -> Decision:
    return Decision("stop", str(error), stop=error)


def _while_live(now: Situation, last: SessionRecord) -> Decision | None:
    if now.on_kaggle in LIVE and last["status"] not in LIVE:
        return _stop(ChainStop(f"{now.kernel} has a session {now.on_kaggle.lower()} on Kaggle that kchain did not "
                               "start; wait for it to end, then run `kchain continue` again"))
    if last["status"] in LIVE:
        beat = last.get("heartbeat") or "no heartbeat yet"  # refresh() just read the log
        return Decision("running", f"session {last['session']} is {last['status'].lower()}: {beat}", last)
    return None


def _after_end(last: SessionRecord, sessions: int, job_file: Path) -> Decision | None:
    """The session ended in a way that another session cannot or should not follow."""
    summary = summary_of(last)
    status = summary.status
    if status == Status.FINISHED:
        best = summary.best or {}
        best_text = f", best {best['name']} {best['value']:.6g} at step {best['step']}" if best.get("name") else ""
        return Decision("finished", f"training is complete: {summary.step}/{summary.total} steps"
                        f"{best_text}; final weights in {final_weights(last)}", last)
    if status == Status.STOPPED:
        # The code left its loop on purpose (early stopping): another session would be the user's
        # decision, not the chain's.
        return Decision("finished", f"training stopped early on purpose at step {summary.step}/"
                        f"{summary.total} (the loop left run.steps); no further session is pushed", last)
    if status == Status.NO_CHECKPOINT:
        return _stop(ChainStop(f"session {last['session']} wrote no checkpoint: the loop did not use run.steps, "
                               f"run.epochs or run.save, so there is nothing to resume; see `kchain smoke {job_file}`"))
    if status == Status.DEADLINE and summary.step == last.get("resumes_at", 0):
        # Another session would burn its quota the same way: start-up filled the whole session.
        return _stop(ChainStop(
            f"session {last['session']} reached its deadline without training a step (it resumed at "
            f"step {summary.step}): loading and start-up take the whole session; stage the data "
            "with run.stage so later sessions load a cache, or raise train.session_limit"
        ))
    return None


def _after_crash(chain: list[SessionRecord], fingerprint: str, job_file: Path, retry: bool) -> Decision | None:
    """A crash, a hang or a missing accelerator: repeated only with --retry, never the same crash twice."""
    last = chain[-1]
    crash = crash_of(last)
    if crash is None:
        return None
    no_gpu = summary_of(last).status == Status.NO_ACCELERATOR
    if no_gpu and not retry:
        return _stop(ChainStop(f"session {last['session']} got no accelerator: {crash.get('message')}; check the GPU "
                               "quota (`kchain budget`) and kaggle.accelerator, then pass --retry to push again"))
    earlier = [s for s in chain[:-1] if _same_error(crash_of(s), crash)]
    if earlier and not no_gpu:
        return _stop(ChainStop(f"the same error as session {earlier[-1]['session']}: {crash.get('type')}: "
                               f"{crash.get('message')}; fix the code, run `kchain smoke {job_file}`"))
    if fingerprint == last.get("fingerprint") and not retry:
        return _stop(ChainStop(
            f"session {last['session']} crashed: {crash.get('type')}: {crash.get('message')}; "
            f"fix the code and run `kchain smoke {job_file}`, or pass --retry to run it again as it is"
        ))
    return None


def _without_progress(chain: list[SessionRecord], fingerprint: str, job_file: Path,
                      retry: bool) -> Decision | None:
    """Two sessions in a row saved no step past the one they resumed at: the next would lose its
    work the same way (stopped before its first save, its output lost to an overrun), quota and all."""
    if len(chain) < 2 or retry or fingerprint != chain[-1].get("fingerprint"):
        return None
    before, last = chain[-2], chain[-1]
    step = last.get("resumes_at") or 0
    if step > (before.get("resumes_at") or 0) or (saved_step(last) or 0) > step:
        return None
    summary = summary_of(last)
    if summary.status:
        how = f"session {last['session']} ended {summary.status} at step {summary.step}"
    else:
        how = f"session {last['session']}: {last.get('failure_message') or last['status']}"
    return _stop(ChainStop(
        f"no progress: sessions {before['session']} and {last['session']} both ended without saving a step past "
        f"{step} ({how}), and the next would lose its work the same way: raise train.session_limit or "
        "train.margin so a session saves before it is stopped, or save more often (train.checkpoint_every), then "
        f"run `kchain continue {job_file}`, or pass --retry to push one more session as it is"
    ))


def saved_step(record: SessionRecord) -> int | None:
    """The step of the newest checkpoint a session left: the state published from it, else what its
    downloaded output holds, else the checkpoint its summary names (which may be the one it resumed)."""
    publish = record.get("publish") or {}
    if publish.get("published") and publish.get("step") is not None:
        return int(publish["step"])
    if "saved_step" in record:
        return record["saved_step"]
    name = Path(summary_of(record).checkpoint or "").name
    number = name.removeprefix(layout.CHECKPOINT_PREFIX)
    return int(number) if name != number and number.isdigit() else None


def crash_of(record: SessionRecord) -> dict[str, Any] | None:
    """The error of a session that crashed, hung or got no accelerator (not a kill, not a timeout), if any."""
    summary = summary_of(record)
    if summary.status in NEEDS_A_PERSON:
        return record.get("error") or summary.error or {"type": summary.status, "message": ""}
    if record["status"] == "ERROR" and record.get("error") and record["error"].get("type") not in (
        "SessionError", "TrainingFailed",
    ):
        return record["error"]
    return None


def _same_error(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    return a is not None and a.get("type") == b.get("type") and a.get("message") == b.get("message")


def final_weights(record: SessionRecord) -> Path:
    """Where a finished session's last checkpoint is, in its downloaded output."""
    return Path(record.get("output") or "") / layout.KCHAIN_DIR / (summary_of(record).checkpoint or "")
