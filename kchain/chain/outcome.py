"""Where the chain's result is: one answer shared by `continue`, `status`, `runs`, `pull` and `release`.

Pure, over the chain's session records (the ledger's, or rebuilt from Kaggle alone by sessions.rebuild):
- the chain's end: its last session ended finished or stopped (`nextsession.ended`, the decision table's own
  word), at the step its summary says;
- the newest verified checkpoint any session left (`nextsession.saved_step`), and whether a state version
  holds it: the one the laptop relayed or the kernel published (a record's `publish`, the summary's
  `published_step`), or the one a later session resumed from; until then it is only in that session's output
  (on Kaggle, and in this laptop's copy);
- the kept best (train.keep_best): the record the newest checkpoint's manifest carries (`kept_best`, noted by
  sessions.fetch_output), which the state version carries as its `best`, so `pull --best` brings home the
  step and value named here.
Off Kaggle (a SkyPilot or Slurm target) there are no session records: a state folder (the runs' state sink)
holds the result, and its newest published checkpoint's manifest says it (`of_state_folder`): the run has
ended, finished, once that checkpoint is of the loop's last step (its `total`).
Every line that says what to run next names the job file as the user gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kchain.common import layout
from kchain.common.checkpoint_files import BEST_KEY
from kchain.common.nextsession import ended, saved_step, summary_of
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.common.summary import Status


@dataclass(frozen=True)
class Result:
    """The chain's result as its records show it (every field None or False for a chain with no session)."""

    ended: str | None = None  # Status.FINISHED or Status.STOPPED once the chain has ended, else None
    step: int | None = None  # the step its last session reached (the final step once it ended)
    total: int | None = None
    newest: int | None = None  # the step of the newest checkpoint a session left
    published: bool = False  # a state version holds that checkpoint
    version: int | None = None  # that state version's number, where the records know it
    best: dict[str, Any] | None = None  # the kept best: {metric, mode, value, step}
    session: int | None = None  # the last session's number
    output: str | None = None  # the last session's output on this laptop

    @property
    def final(self) -> bool:
        """The chain has ended, and its newest checkpoint is its last step's (the final weights)."""
        return self.ended is not None and self.newest is not None and self.newest == self.step

    def end_words(self) -> str:
        """How the chain ended, as continue says it."""
        if self.ended == Status.STOPPED:
            return (f"training stopped early on purpose at step {self.step}/{self.total} (the loop left run.steps); "
                    "no further session is pushed")
        return f"training is complete: {self.step}/{self.total} steps"

    def where(self, state_ref: str) -> str:
        """Where the newest checkpoint is: a state version, or only a session's output."""
        if self.published:
            return f"{state_ref} version {self.version}" if self.version else state_ref
        kept = f", here in {Path(self.output) / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR}" if self.output else ""
        return f"session {self.session}'s output on Kaggle{kept}"

    def finished_message(self, job_file: Path | str, state_ref: str) -> str:
        """continue's line for an ended chain: how it ended, the kept best, where the final weights are and
        the command that brings them home (or the one that publishes them first)."""
        best = f", best {best_words(self.best)}" if self.best else ""
        if self.newest is None:
            return f"{self.end_words()}{best}; it left no checkpoint to pull"
        return f"{self.end_words()}{best}; final weights (step {self.newest}) in {self.where(state_ref)}: " \
               + self._fetch(job_file, "--final", "them")

    def _fetch(self, job_file: Path | str, flag: str, what: str) -> str:
        """The command that brings them home, after the one that publishes them where no state version has them."""
        if self.published:
            return f"`kchain pull {job_file} {flag}`"
        return f"`kchain continue {job_file}` publishes {what} as a state version, then `kchain pull {job_file} {flag}`"

    def lines(self, job_file: Path | str, state_ref: str) -> list[str]:
        """What status and runs say of the result: the kept best and, once the chain ended, its final weights."""
        out = []
        if self.best:
            out.append(f"best: {best_words(self.best)} (train.keep_best), in {self.where(state_ref)}: "
                       + self._fetch(job_file, "--best", "it"))
        if self.final:
            out.append(f"final: step {self.newest} ({self.ended}), in {self.where(state_ref)}: "
                       + self._fetch(job_file, "--final", "them"))
        return out


def best_words(best: dict[str, Any]) -> str:
    """The kept best as every command names it: `val_loss 0.100187 at step 40`."""
    value = best.get("value")
    shown = f"{value:.6g}" if isinstance(value, (int, float)) else str(value)
    return f"{best.get('metric')} {shown} at step {best.get('step')}"


def of_chain(chain: list[SessionRecord]) -> Result:
    """The result the records show (FAILED_TO_PUSH records, which never ran, are left out)."""
    ran = [r for r in chain if r.get("status") != SessionState.FAILED_TO_PUSH]
    if not ran:
        return Result()
    last = ran[-1]
    summary = summary_of(last)
    steps = [step for r in ran if (step := saved_step(r)) is not None]
    newest = max(steps, default=None)
    published, version = False, None
    for record in ran:
        publish, said = record.get("publish") or {}, summary_of(record)
        if newest is None:
            break
        if publish.get("version") and publish.get("step") == newest:
            published, version = True, publish["version"]
        elif said.published == "kernel" and said.published_step == newest:
            published = True
        elif record is not ran[0] and newest in (record.get("resumes_at"), said.resumed_from):
            # A session resumed from it: it was mounted, so a state version holds it.
            published, version = True, record.get("state_version") or version
    best = next((r["kept_best"] for r in reversed(ran) if r.get("kept_best")), None)
    return Result(ended=ended(last), step=summary.step if summary.step is not None else last.get("step"),
                  total=summary.total, newest=newest, published=published, version=version, best=best,
                  session=last["session"], output=last.get("output"))


def of_state_folder(manifest: dict[str, Any]) -> Result:
    """The result a state folder shows, from its newest published checkpoint's manifest: finished when that
    checkpoint is of the loop's last step (the manifest's `total`), else not ended; the kept best it records."""
    step, total = int(manifest["step"]), manifest.get("total")
    done = isinstance(total, int) and step >= total
    return Result(ended=Status.FINISHED if done else None, step=step, total=total if isinstance(total, int) else None,
                  newest=step, published=True, best=manifest.get(BEST_KEY))
