"""What comes after a session, decided from the chain's records alone: one table for the laptop and the kernel.

`kchain continue` (through `kchain/decide.py`, a thin adapter that turns a stop into its KchainError)
and a kernel that chains itself (`kchain push --unattended`, `common/nextkernel.py`) decide with this
same code, over plain records (the session records of `kchain/chain/sessions.py`, JSON objects). No I/O, no
Kaggle call, standard library only (it is embedded into the kernel). The table, first match wins:

  no session yet                                  -> stop: push first
  Kaggle runs a session kchain did not start      -> stop: wait for it
  the last session is queued or running           -> running (its last heartbeat)
  finished                                        -> finished (the final weights)
  stopped (the loop left run.steps on purpose)    -> finished: no further session
  no_checkpoint                                   -> stop: nothing to resume
  deadline without training a step                -> stop: start-up fills the session
  state_not_mounted more than REMOUNTS in a row   -> stop: the state version never appeared in the input
  the state it was pushed for refused (WrongState) -> repair: publish that copy as a new state version and
    and a verified copy of that step is at hand        push the next session from it (no step lost; --retry or
    (a session's output on this laptop, or an          not, unless the code never passed a smoke run)
    earlier state version)
  ... and the refused state was such a repair     -> stop: the copy was refused too
  refused as damaged (DamagedState), no copy      -> stop, --retry or not: sending it again is refused again
  no accelerator                                  -> stop unless --retry
  crashed or hung, the same error as before       -> stop: fix the code
  crashed or hung, the same code, no --retry      -> stop: fix it, or --retry
  ended, but its output could not be fetched      -> refetch (then decide again)
  two sessions in a row saved no step past the    -> stop: no progress; raise the margin or save
    one they resumed at, same code, no --retry         more often, or --retry
  code that never passed a smoke run              -> stop unless --skip-smoke
  state_not_mounted (at most REMOUNTS in a row)   -> push the same session again (same state version and step)
  otherwise (deadline, killed, timed out, ...)    -> push the next session from the newest state
    (killed: the training alone, or one of its ranks, died by a signal from outside)

The kernel adds what only it must check before it pushes (the laptop's `continue` checks the same
through `kchain/chain/budget.py`): `afford` (the week's GPU quota from Kaggle's quota_view, else the chain's
own hours this week, `week_used`, against the job's budget).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Literal

from kchain.common import layout
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import LIVE, TERMINAL, SessionState
from kchain.common.summary import Status, Summary

Record = SessionRecord  # a session record (sessions.json), a plain JSON object

# Session ends that another identical session would repeat: each needs --retry (or a code change).
NEEDS_A_PERSON = (Status.CRASHED, Status.HUNG, Status.NO_ACCELERATOR)
# A session that did not see its state version mounted is pushed again without a person this many
# times in a row at most (ready is not mounted: a 2026 measurement saw a mount 138 s late).
REMOUNTS = 3
# The kind of a stop: the adapter on the laptop raises ChainStop or NotSmoked for it.
CHAIN_STOP, NOT_SMOKED = "chain_stop", "not_smoked"
# The errors of a session that refused the state it was pushed for (common/resumecheck.py): its checkpoint of
# that step is not in the mounted version, or fails verification there (DAMAGED).
REFUSED_STATE, DAMAGED = ("WrongState", "DamagedState"), "DamagedState"
# The ends no session follows: the chain's finished word, decided here for the table and for every command
# that says where the result is (kchain/chain/outcome.py: continue, status, runs, pull and release).
ENDED = (Status.FINISHED, Status.STOPPED)
# What a verdict says comes next (`decide`'s words, and the laptop's `pushed` once it acted on a push): mypy
# refuses any other text for a verdict's action, made or compared (strict_equality).
Action = Literal["running", "finished", "stop", "refetch", "repair", "push", "pushed"]


@dataclass(frozen=True)
class Verdict:
    """What comes next: action running | finished | stop | refetch | repair | push; for a push, `again` is True
    when it is the same session pushed again (a state not mounted), with `attempt` its number; a repair
    publishes `copy` as a new state version, then pushes the next session from it."""

    action: Action
    message: str
    record: Record | None = None  # the session the verdict is about (the chain's last)
    stop: str | None = None  # CHAIN_STOP or NOT_SMOKED for a stop
    again: bool = False
    attempt: int = 1
    copy: Copy | None = None  # a repair: the verified copy of the refused step to publish


@dataclass(frozen=True)
class Copy:
    """A verified copy of a step, found where the chain keeps its states: a checkpoint folder (in a session's
    downloaded output) or a whole state folder (an earlier state version, downloaded)."""

    path: str
    where: str  # in words: "session 1's output on this laptop", "state version 2"
    state_folder: bool = False  # path is a state version's folder (uploaded as it is), not a checkpoint


def _no_copy(_step: int, _refused: int | None) -> Copy | None:
    return None


@dataclass(frozen=True)
class Chain:
    """Everything `decide` reads: the records, oldest first, and Kaggle's word on the kernel."""

    records: list[Record]
    kernel: str  # owner/name
    on_kaggle: SessionState | None  # Kaggle's state of the kernel's newest session (None: not asked, or no kernel)
    fingerprint: Callable[[], str]  # the code's fingerprint now (asked only when needed)
    smoked: Callable[[str], bool]  # whether code with that fingerprint passed a smoke run
    # A verified copy of a step other than in the refused state version (asked only when a session refused
    # its state); a kernel deciding about itself has none.
    copy_of: Callable[[int, int | None], Copy | None] = field(default=_no_copy)


def summary_of(record: Record) -> Summary:
    return Summary.from_dict(record.get("summary"))


def ended(record: Record | None) -> str | None:
    """How the chain ended with this session (Status.FINISHED or Status.STOPPED), None if it goes on."""
    status = summary_of(record).status if record is not None else None
    return status if status in ENDED else None


def decide(now: Chain, job_file: str, retry: bool = False, skip_smoke: bool = False,
           output_settled: bool = False) -> Verdict:
    """The next step of the chain; output_settled: the last session's lost output was fetched again
    or given up with --from-state, so it is not asked for again."""
    if not now.records:
        name = now.kernel.split("/", 1)[-1]
        return _stop(f"{name} has no session yet: start it with `kchain push {job_file}`")
    chain, last = now.records, now.records[-1]
    verdict = _while_live(now, last) or _after_end(chain, job_file)
    if verdict is not None:
        return verdict
    fingerprint = now.fingerprint()
    repair = _refused_state(now, chain, job_file)
    if repair is not None and repair.action == "stop":
        return repair
    if repair is None:
        verdict = _after_crash(chain, fingerprint, job_file, retry)
        if verdict is not None:
            return verdict
        if last["status"] in TERMINAL and not last.get("output") and last.get("output_error") and not output_settled:
            return Verdict("refetch", f"the output of session {last['session']} could not be fetched", last)
        verdict = _without_progress(chain, fingerprint, job_file, retry)
        if verdict is not None:
            return verdict
    if not now.smoked(fingerprint) and not skip_smoke:
        return _stop(f"this code has never passed a smoke run: run `kchain smoke {job_file}` first "
                     "(or --skip-smoke, recorded in the run log)", NOT_SMOKED)
    if repair is not None:
        return repair
    unmounted = _not_mounted_in_a_row(chain)
    if unmounted:
        state = f"state version {last.get('state_version')} (step {last.get('resumes_at') or 0})"
        return Verdict("push", f"push session {last['session'] + 1}: session {last['session']} again from {state}, "
                       f"which it did not see mounted in time (attempt {unmounted + 1} of {REMOUNTS + 1})", last,
                       again=True, attempt=unmounted + 1)
    return Verdict("push", f"push session {last['session'] + 1} from the newest state", last)


def _stop(message: str, kind: str = CHAIN_STOP) -> Verdict:
    return Verdict("stop", message, stop=kind)


def _while_live(now: Chain, last: Record) -> Verdict | None:
    if now.on_kaggle in LIVE and last["status"] not in LIVE:
        return _stop(f"{now.kernel} has a session {now.on_kaggle.lower()} on Kaggle that kchain did not "
                     "start; wait for it to end, then run `kchain continue` again")
    if last["status"] in LIVE:
        beat = last.get("heartbeat") or "no heartbeat yet"  # refresh() just read the log
        return Verdict("running", f"session {last['session']} is {last['status'].lower()}: {beat}", last)
    return None


def _not_mounted_in_a_row(chain: list[Record]) -> int:
    """How many sessions at the chain's end ended state_not_mounted, one after the other."""
    count = 0
    for record in reversed(chain):
        if summary_of(record).status != Status.STATE_NOT_MOUNTED:
            break
        count += 1
    return count


def _after_end(chain: list[Record], job_file: str) -> Verdict | None:
    """The session ended in a way that another session cannot or should not follow."""
    last = chain[-1]
    summary = summary_of(last)
    status = summary.status
    if status == Status.FINISHED:
        best = summary.best or {}
        best_text = f", best {best['name']} {best['value']:.6g} at step {best['step']}" if best.get("name") else ""
        where = final_weights(last) if last.get("output") else f"{final_weights(last)} of session {last['session']}'s output"
        return Verdict("finished", f"training is complete: {summary.step}/{summary.total} steps"
                       f"{best_text}; final weights in {where}", last)
    if status == Status.STOPPED:
        # The code left its loop on purpose (early stopping): another session would be the user's
        # decision, not the chain's.
        return Verdict("finished", f"training stopped early on purpose at step {summary.step}/"
                       f"{summary.total} (the loop left run.steps); no further session is pushed", last)
    if status == Status.NO_CHECKPOINT:
        return _stop(f"session {last['session']} wrote no checkpoint: the loop did not use run.steps, "
                     f"run.epochs or run.save, so there is nothing to resume; see `kchain smoke {job_file}`")
    if status == Status.DEADLINE and summary.step == last.get("resumes_at", 0):
        # Another session would burn its quota the same way: start-up filled the whole session.
        return _stop(
            f"session {last['session']} reached its deadline without training a step (it resumed at "
            f"step {summary.step}): loading and start-up take the whole session; stage the data "
            "with run.stage so later sessions load a cache, or raise train.session_limit"
        )
    unmounted = _not_mounted_in_a_row(chain)
    if unmounted > REMOUNTS:
        first = chain[-unmounted]["session"]
        return _stop(
            f"sessions {first} to {last['session']} ({unmounted} in a row) did not see state version "
            f"{last.get('state_version')} mounted within the mount wait, so none of them trained: check the state "
            f"dataset on Kaggle (`kchain status {job_file}`), then run `kchain continue {job_file}` to push again"
        )
    return None


def _refused_state(now: Chain, chain: list[Record], job_file: str) -> Verdict | None:
    """The last session refused the state it was pushed for (resumecheck.WrongState: the step is not in the
    mounted version, DamagedState: it fails verification there): a repair from a verified copy of that step
    when one is at hand; a stop when the refused state was such a repair already, or is damaged with no copy
    (--retry would send the same damaged version again); None otherwise (a plain WrongState without a copy
    is a crash like any other)."""
    last = chain[-1]
    error = crash_of(last) or {}
    if error.get("type") not in REFUSED_STATE:
        return None
    version, step = last.get("state_version"), last.get("resumes_at") or 0
    refused = f"session {last['session']} refused state version {version} (step {step})"
    earlier = (chain[-2].get("publish") or {}) if len(chain) > 1 else {}
    if (earlier.get("repair") or {}) and earlier.get("version") == version:
        return _stop(f"{refused}, itself a copy of step {step} from {earlier['repair'].get('from')} published "
                     f"after an earlier refusal: {error.get('message')}; check the state dataset on Kaggle, then "
                     f"run `kchain continue {job_file}`")
    copy = now.copy_of(step, version)
    if copy is not None:
        return Verdict("repair", f"{refused}: {error.get('message')}; {copy.where} holds a verified copy of step "
                       f"{step}: publishing it as a new state version and pushing session {last['session'] + 1} "
                       "from it (no step lost)", last, copy=copy)
    if error.get("type") != DAMAGED:
        return None
    saved = next((f"session {s['session']}'s output" for s in reversed(chain[:-1])
                  if (s.get("publish") or {}).get("step") == step), "the output of the session that saved it")
    return _stop(f"{refused} as damaged: {error.get('message')}; no verified copy of step {step} is on this laptop "
                 "or in an earlier state version, and --retry would send the same damaged version again: run "
                 f"`kchain continue {job_file}` where {saved} (step {step}) was downloaded")


def _after_crash(chain: list[Record], fingerprint: str, job_file: str, retry: bool) -> Verdict | None:
    """A crash, a hang or a missing accelerator: repeated only with --retry, never the same crash twice."""
    last = chain[-1]
    crash = crash_of(last)
    if crash is None:
        return None
    no_gpu = summary_of(last).status == Status.NO_ACCELERATOR
    if no_gpu and not retry:
        return _stop(f"session {last['session']} got no accelerator: {crash.get('message')}; check the GPU "
                     "quota (`kchain budget`) and kaggle.accelerator, then pass --retry to push again")
    earlier = [s for s in chain[:-1] if _same_error(crash_of(s), crash)]
    if earlier and not no_gpu:
        return _stop(f"the same error as session {earlier[-1]['session']}: {crash.get('type')}: "
                     f"{crash.get('message')}; fix the code, run `kchain smoke {job_file}`")
    if fingerprint == last.get("fingerprint") and not retry:
        return _stop(
            f"session {last['session']} crashed: {crash.get('type')}: {crash.get('message')}; "
            f"fix the code and run `kchain smoke {job_file}`, or pass --retry to run it again as it is"
        )
    return None


def _without_progress(chain: list[Record], fingerprint: str, job_file: str, retry: bool) -> Verdict | None:
    """Two sessions in a row saved no step past the one they resumed at: the next would lose its
    work the same way (stopped before its first save, its output lost to an overrun), quota and all.
    A session that did not see its state mounted trained nothing on purpose: it is not counted."""
    trained = [s for s in chain if summary_of(s).status != Status.STATE_NOT_MOUNTED]
    if summary_of(chain[-1]).status == Status.STATE_NOT_MOUNTED or len(trained) < 2 or retry \
            or fingerprint != chain[-1].get("fingerprint"):
        return None
    before, last = trained[-2], trained[-1]
    step = last.get("resumes_at") or 0
    if step > (before.get("resumes_at") or 0) or (saved_step(last) or 0) > step:
        return None
    summary = summary_of(last)
    if summary.status:
        how = f"session {last['session']} ended {summary.status} at step {summary.step}"
    else:
        how = f"session {last['session']}: {last.get('failure_message') or last['status']}"
    return _stop(
        f"no progress: sessions {before['session']} and {last['session']} both ended without saving a step past "
        f"{step} ({how}), and the next would lose its work the same way: raise train.session_limit or "
        "train.margin so a session saves before it is stopped, or save more often (train.checkpoint_every), then "
        f"run `kchain continue {job_file}`, or pass --retry to push one more session as it is"
    )


def saved_step(record: Record) -> int | None:
    """The step of the newest checkpoint a session left: the state published from it, else what its
    downloaded output holds, else the checkpoint its summary names (which may be the one it resumed)."""
    publish = record.get("publish") or {}
    step = publish.get("step")
    if publish.get("published") and step is not None:
        return int(step)
    if "saved_step" in record:
        return record["saved_step"]
    name = PurePath(summary_of(record).checkpoint or "").name
    number = name.removeprefix(layout.CHECKPOINT_PREFIX)
    return int(number) if name != number and number.isdigit() else None


def crash_of(record: Record) -> dict[str, Any] | None:
    """The error of a session that crashed, hung or got no accelerator (not a kill, not a timeout), if any."""
    summary = summary_of(record)
    if summary.status == Status.KILLED:  # a rank killed from outside: its peers' errors are consequences
        return None
    if summary.status in NEEDS_A_PERSON:
        return record.get("error") or summary.error or {"type": summary.status, "message": ""}
    if record["status"] == SessionState.ERROR and (error := record.get("error")) and error.get("type") not in (
        "SessionError", "TrainingFailed",
    ):
        return error
    return None


def _same_error(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    return a is not None and a.get("type") == b.get("type") and a.get("message") == b.get("message")


def final_weights(record: Record) -> PurePath:
    """Where a finished session's last checkpoint is, in its downloaded output (relative to the session's
    working dir where it has none: the kernel deciding about itself). The summary names it relative to the
    working dir (`kchain/checkpoints/...`); a summary of an older kchain relative to the kchain dir."""
    rel = PurePath(summary_of(record).checkpoint or "")
    if rel.parts[:1] != (layout.KCHAIN_DIR,):
        rel = layout.KCHAIN_DIR / rel
    return PurePath(record.get("output") or "") / rel


WEEK_S = 7 * 24 * 3600


def week_used(week: Mapping[str, Any] | None, session_s: float, now: float) -> tuple[float, dict[str, float] | None]:
    """The chain's GPU seconds this quota week with this session's session_s (billed: start to now, its publish
    included), and the week record the next session carries (config.kaggle.week). `week` is what this
    session was pushed with: the week's start and the seconds used before it; a week that has rolled
    over since counts this session alone. Without one (a chain pushed by an older kchain), this session
    alone, and nothing to carry."""
    if not week or not isinstance(week.get("start"), (int, float)):
        return session_s, None
    start, before = float(week["start"]), float(week.get("used_s") or 0.0)
    now_start = start + WEEK_S * ((now - start) // WEEK_S)
    if now_start != start:
        before = 0.0  # a new quota week: what the old one used is not counted in it
    used = before + session_s
    return used, {"start": now_start, "used_s": round(used, 1)}


def afford(session_s: float, used_s: float, allowed_s: float, budget_s: float | None) -> str | None:
    """Why another session of session_s does not fit the week (None: it fits): used_s of allowed_s
    (Kaggle's allowance when its quota answer has one) and of the job's own budget_s."""
    weekly = min(allowed_s, budget_s) if budget_s is not None else allowed_s
    if used_s + session_s <= weekly:
        return None
    return (f"another session of up to {session_s / 3600:.2f} GPU-hours does not fit the week: "
            f"{used_s / 3600:.2f} of {weekly / 3600:.2f} used")
