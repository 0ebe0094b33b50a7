"""Fault injection inside the kernel (`KCHAIN_FAULT`), for tests and the smoke: one typed object.

`KCHAIN_FAULT='kill_at_step=7,stall_step=0.5'` is parsed once into a frozen `Faults`; the parts
that inject (the loop driver, the checkpoint writer, the out-of-memory ladder) receive it and ask
it, never a dict. A key it does not know is an error: a misspelled fault that silently never fires
would make a test prove nothing. The emulator's faults (Kaggle's side) are in
kchain/emulator/faults.py; docs/runtime.md lists these ones, and tests/common/test_faults.py checks the
list against this class.

The kills are real deaths, as when a Kaggle session ends: the whole machine goes, with every
process the training started. The training process leads a process group of its own (lead(),
called at launch when a kill fault is set; a torchrun rank leads one already), so one killpg()
takes it with its DataLoader workers. A worker left behind would keep the notebook's pipe open
until it noticed its parent had gone, up to 5 s (torch's MP_STATUS_CHECK_INTERVAL): the smoke's
resume would wait that long. Without a kill fault no group is made and nothing is killed.

Standard library only: the launcher reads it before it imports torch.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields

# Where kill_in_save can end the writer, in the order a write passes them (checkpoint.py).
SAVE_POINTS = ("after_state", "after_metrics", "before_manifest", "before_rename", "after_rename", "in_prune")
# Where sink_kill can end a publish to the state sink, in the order a publish passes them (sink.py):
# saved locally and nothing published yet, between two files, before the manifest, before the
# `latest` pointer moves, before the older copies are pruned.
SINK_POINTS = ("after_local", "mid_files", "before_manifest", "before_pointer", "before_prune")


class FaultSpecError(ValueError):
    """KCHAIN_FAULT names a fault or a value this runtime does not know."""


@dataclass(frozen=True)
class Faults:
    """What KCHAIN_FAULT asks for; every field's default is "no fault"."""

    # SIGKILL every rank once step N's body has run (before it counts): a session's end mid-run.
    kill_at_step: int | None = None
    # SIGKILL every rank right after the first checkpoint of this process is complete.
    kill_after_checkpoint: bool = False
    # SIGKILL inside the checkpoint writer at this point (one of SAVE_POINTS).
    kill_in_save: str | None = None
    # Seconds every step sleeps at its end: a slow step, for the deadline guard and the watchdog.
    stall_step: float = 0.0
    # Step N never returns (it sleeps): the hung-step watchdog must end the run.
    hang_at_step: int | None = None
    # The deadline falls once step N is reached (the smoke's run to kill uses it) ...
    deadline_at_step: int | None = None
    # ... on this rank only (kchain ddp: the ranks must agree on one stop); every rank when unset.
    deadline_rank: int | None = None
    # The deadline falls after N steps of this session, whatever the machine's speed: a test's clock.
    deadline_after_steps: int = 0
    # The first step raises torch.OutOfMemoryError while a run.loader batch is larger than N (ladder.py).
    oom_above: int | None = None
    # SIGKILL inside the first publish to the state sink that reaches this point (one of SINK_POINTS).
    sink_kill: str | None = None
    # Seconds each publish to the state sink sleeps before it starts: a slow bucket, which falls behind.
    sink_stall: float = 0.0
    # SIGKILL the training process tree alone (the notebook lives on: the OOM killer, a segfault) right after
    # the first checkpoint at a step >= N is complete, in a process that started below N (so a chain, which
    # resumes from that checkpoint, is killed there once). An unattended chain publishes and pushes on.
    kill_training_at_step: int | None = None
    # Step N raises an error at its end, as a bug in the job's code would (`kchain queue --rehearse --crash RUN`):
    # the session ends crashed, and the chain's same-crash guard must stop it.
    raise_at_step: int | None = None
    # After each save this process makes, it waits there until it is killed: the local Kaggle's kill after a
    # checkpoint (its kill_after_checkpoint sets this in the session) then lands right after that checkpoint,
    # whatever the machine's speed, never after a later one.
    hold_after_save: bool = False

    @classmethod
    def parse(cls, text: str) -> Faults:
        """'kill_at_step=7,stall_step=0.5' -> Faults(kill_at_step=7, stall_step=0.5)."""
        known = {f.name: f for f in fields(cls)}
        given: dict[str, object] = {}
        for item in filter(None, (s.strip() for s in (text or "").split(","))):
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in known:
                raise FaultSpecError(f"KCHAIN_FAULT: unknown fault {key!r}; known: {', '.join(known)}")
            given[key] = _value(key, value, str(known[key].type))  # a str: annotations are postponed
        if given.get("kill_in_save") not in (None, *SAVE_POINTS):
            raise FaultSpecError(f"KCHAIN_FAULT: kill_in_save={given['kill_in_save']} is not one of {', '.join(SAVE_POINTS)}")
        if given.get("sink_kill") not in (None, *SINK_POINTS):
            raise FaultSpecError(f"KCHAIN_FAULT: sink_kill={given['sink_kill']} is not one of {', '.join(SINK_POINTS)}")
        return cls(**given)  # type: ignore[arg-type]

    @property
    def kills(self) -> bool:
        """A real death is asked for somewhere: the launcher then leads a process group (lead())."""
        return (self.kill_at_step is not None or self.kill_after_checkpoint or self.kill_in_save is not None
                or self.sink_kill is not None or self.kill_training_at_step is not None)

    def deadline_line(self, step: int, loop_steps: int, rank: int) -> str | None:
        """The line to say when a test's deadline clock has run out at `step`, else None."""
        if self.deadline_at_step is not None and step >= self.deadline_at_step \
                and self.deadline_rank in (None, rank):
            return f"deadline (fault: this rank's clock) at step {step}: stopping and saving"
        if self.deadline_after_steps and loop_steps >= self.deadline_after_steps:
            return (f"deadline (fault deadline_after_steps={self.deadline_after_steps}): "
                    f"stopping at step {step} and saving")
        return None

    def stop_step(self, step: int, loop_steps: int) -> int | None:
        """The step a test's deadline clock stops the run at (the stop saves there; the smoke's run to kill
        has no cadence of its own), or None."""
        if self.deadline_at_step is not None:
            return self.deadline_at_step
        if self.deadline_after_steps:
            return step + self.deadline_after_steps - loop_steps
        return None

    def at_step_end(self, step: int, kill_all) -> None:
        """The faults of a step's end, in order: a stall, a kill (of every rank), a hang, a crash."""
        _FIRST_STEP.setdefault("step", step)  # where this process started (kill_training_at_step)
        if self.stall_step:
            time.sleep(self.stall_step)
        if step == self.kill_at_step:
            kill_all()  # a real death: nothing after this runs
        if step == self.hang_at_step:
            time.sleep(10**9)  # a step that never returns: the watchdog ends the run
        if step == self.raise_at_step:
            raise RuntimeError(f"a crash injected at step {step} (fault raise_at_step={step})")

    def hold(self) -> None:
        """hold_after_save: wait to be killed (the session's limit ends a wait no kill comes to)."""
        while True:
            time.sleep(3600)

    def in_save(self, point: str) -> None:
        """kill_in_save=<point>: this process (and its group) dies here, inside the writer."""
        if self.kill_in_save == point:
            die()
        if point == "after_rename" and self.kill_training_at_step is not None:
            n, first = self.kill_training_at_step, _FIRST_STEP.get("step")
            if first is not None and first <= n and (_newest_step() or 0) >= n:
                die()  # this process and the group it leads (the launcher's tree), not the notebook

    def in_sink(self, point: str, kill_all=None) -> None:
        """sink_kill=<point>: the session dies here, inside a publish to the state sink (every rank)."""
        if self.sink_kill == point:
            (kill_all or die)()


NO_FAULTS = Faults()
_FIRST_STEP: dict[str, int] = {}  # the first step this process ran (at_step_end's first call)


def _newest_step() -> int | None:
    """The step of the newest complete checkpoint in this session's working dir (kill_training_at_step)."""
    from kchain.common import layout

    folder = layout.kchain_dir(os.environ) / layout.CHECKPOINTS_DIR
    steps = [int(p.name.removeprefix(layout.CHECKPOINT_PREFIX)) for p in folder.glob(f"{layout.CHECKPOINT_PREFIX}*")
             if p.name.removeprefix(layout.CHECKPOINT_PREFIX).isdigit()]
    return max(steps, default=None)


def wanted(text: str) -> bool:
    """Whether KCHAIN_FAULT asks for a real death (the launcher reads it before torch; a bad
    KCHAIN_FAULT is reported by the Run, with the session's summary)."""
    try:
        return Faults.parse(text).kills
    except FaultSpecError:
        return False


def _value(key: str, text: str, kind: str) -> object:
    try:
        if "bool" in kind:
            if text not in ("0", "1"):
                raise ValueError(text)
            return text == "1"
        if "float" in kind:
            return float(text)
        if "int" in kind:
            return int(text)
        return text or None
    except ValueError:
        raise FaultSpecError(f"KCHAIN_FAULT: {key}={text!r} is not a {kind.split(' ')[0]}") from None


def lead() -> None:
    """Lead a new process group, which the processes this one starts join (not torchrun's ranks:
    each of those leads its own)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # already a session leader (a torchrun rank): it leads its group
        pass


def die(others: Iterable[int] = ()) -> None:
    """SIGKILL the processes `others` (each with its group, if it leads one), then this process with
    its group if it leads one (its DataLoader workers), else this process alone. Never returns."""
    for pid in others:
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)  # one system call: nothing of this process runs between the deaths
    os.kill(os.getpid(), signal.SIGKILL)
