"""The loop driver: run.steps, run.epochs and run.should_stop, and what each step boundary does.

Between two steps the driver counts the step, beats the hung-step watchdog, prints the heartbeat,
saves when the checkpointer's cadence says so and stops the loop when the session clock says the
next step and a save no longer fit (or on SIGTERM/SIGINT, a test's deadline fault, or at a rehearsal's
planned stop: sessionplan.py). A stop
saves, then raises SessionStopped out of the loop, so no user code runs after it in this session.
Under run.epochs the loader's batches are the steps: the driver is the loader's StepHooks.

kchain ddp: with several ranks, one all-reduce at the start of each step decides the stop and the
save for every rank (distributed.Ranks.agree). The driver never sees the Run: it receives the
progress record, the clock, the checkpointer, the trace, the ranks and the faults.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from kchain.common import heartbeat
from kchain.common.faults import Faults
from kchain.common.say import emit, say, warn
from kchain.common.sessionplan import SessionPlan
from kchain.common.trace import Trace
from kchain.runtime import ladder, replicas, watchdog
from kchain.runtime.checkpoint import untracked
from kchain.runtime.checkpoint.checkpointer import Checkpointer
from kchain.runtime.clock import SessionClock
from kchain.runtime.distributed import Ranks
from kchain.runtime.loader import Loader, left_on_purpose
from kchain.runtime.progress import Progress

PLAIN_LOADER_NOTE = "data order: a DataLoader not made by run.loader restarts its order on resume"


class SessionStopped(BaseException):  # noqa: N818  (a stop, not an error: a BaseException as SystemExit is)
    """A deadline or signal stop: the state at the stop is saved, and `main(run)` ends here.

    Raised out of the training loop (run.steps, run.epochs and the batches of a run.loader), so no
    code after the stop runs in this session: not the rest of an unfinished epoch (a per-epoch
    scheduler step, an evaluation), not the code after the loop. The next session resumes from the
    stop exactly. The launcher catches it; the status is `deadline` or `interrupted`.
    """


class Loop:
    """One run's loop: the step boundaries, the stop and the saves between steps."""

    def __init__(self, progress: Progress, clock: SessionClock, checkpointer: Checkpointer, trace: Trace,
                 ranks: Ranks, faults: Faults, params: dict, *, heartbeat_s: float, hang_s: float | None,
                 on_hang: Callable[[float, float], None], cap: int | None, plan: SessionPlan | None = None,
                 watch_untracked: bool = False, watch_changes: bool = False):
        self.progress, self.clock, self.ckpt, self.trace = progress, clock, checkpointer, trace
        self.ranks, self.faults = ranks, faults
        self.params = params  # the job's: a resume checks they match the checkpoint's
        self.heartbeat_s = heartbeat_s
        self.hang_s = hang_s  # the watchdog's floor; None: no watchdog (a smoke)
        self.on_hang = on_hang  # the watchdog's verdict: write the summary (the process then ends)
        self.cap = cap  # the most steps a loop may reach (a smoke, KCHAIN_TOTAL_STEPS); None: no cap
        self.plan = plan  # a rehearsal's sessions planned in steps (sessionplan.py); None: the clock alone
        self.loaders: list[Loader] = []  # every run.loader, in order
        self.optimizers: list = []  # every optimizer run.optimize was given (tracked or not)
        self.data_wait = 0.0  # seconds the steps waited for a batch
        self._dog: watchdog.Watchdog | None = None  # the hung-step watchdog, while a loop runs
        self._handlers: dict[signal.Signals, Any] | None = None  # the signal handlers ours replaced
        self._last_heartbeat = 0.0
        self._planned = False
        self._sharded: bool | None = None  # kchain ddp: FSDP or DTensor parameters (found once)
        self._eval_step: int | None = None  # the step that ran run.every's evaluation
        self._t0 = 0.0  # the running step's start
        # A smoke or a rehearsal: the state no checkpoint holds, refused at the first step by kind, watched
        # for change (a smoke) and digested at each save for the verdict (untracked.py)
        self._untracked = untracked.Watch(changes=watch_changes) if watch_untracked else None
        if self._untracked is not None:
            checkpointer.audit = self._untracked_digests

    # --- the two loops ------------------------------------------------------------------------------

    def steps(self, total: int):
        """run.steps: yield progress.step+1 .. total (see Run.steps)."""
        p = self.progress
        p.total = self.capped(total)
        self.restore()
        self.start_loop()
        step = p.step
        try:
            while step < p.total:
                if self._must_stop():
                    self.stop_here()
                step += 1
                t0 = self._start_step(step)
                try:
                    yield step
                except GeneratorExit:
                    if left_on_purpose():
                        self._end_step(step, t0, save=False)
                        if self.ranks.active and step < p.total:  # kchain ddp: the others stop with it
                            p.stop_reason = p.stop_reason or "stopped"
                            self._must_stop()
                        self.finish(stopped=step < p.total)
                    raise
                self._end_step(step, t0)
            self.finish()
        finally:
            self.end_loop()

    def epochs(self, epochs: int, lo: Loader):
        """run.epochs: yield epoch numbers from the restored one to epochs-1 (see Run.epochs)."""
        p = self.progress
        p.total = self.capped(epochs * lo.steps_per_epoch())
        self.restore()
        self.start_loop()
        lo.hooks = self
        try:
            while lo.epoch < epochs:
                if not self.may_start():
                    if p.stop_reason:
                        self.stop_here()
                    break
                epoch = lo.epoch
                try:
                    yield epoch
                except GeneratorExit:
                    if not p.stopped and left_on_purpose():
                        nxt = epoch + 1 if lo.epoch == epoch else lo.epoch
                        if self.ranks.active and nxt < epochs and p.step < p.total:
                            p.stop_reason = p.stop_reason or "stopped"  # kchain ddp: agreed
                            self._must_stop()
                        self.finish(stopped=True)
                    raise
                if lo.epoch == epoch and not p.stop_reason:
                    lo.next_epoch()  # the batches were left early: the rest of this epoch is skipped
            self.finish()
        finally:
            lo.hooks = None
            self.end_loop()

    def restore(self) -> None:
        """Load the newest checkpoint into everything tracked, once (the loop's start, or run.restore)."""
        if self.ckpt.restored:
            return
        self.progress.phase = "resume"
        path = self.ckpt.restore(self.progress, self.trace, self.params)
        if path is None:
            self.progress.phase = "build"
        else:
            self.clock.sized(path)

    def capped(self, total: int) -> int:
        self.progress.asked = total
        return total if self.cap is None else min(total, self.cap)

    # --- StepHooks: the loader's batches under run.epochs -------------------------------------------

    def may_start(self) -> bool:
        """False once the loop must end: the step cap reached, or a deadline or signal stop."""
        assert self.progress.total is not None  # the loop that asks set it (steps, epochs, a framework's)
        return self.progress.step < self.progress.total and not self._must_stop()

    def stopping(self) -> bool:
        return bool(self.progress.stop_reason)

    def begin(self) -> int:
        step = self.progress.step + 1
        self._t0 = self._start_step(step)
        return step

    def end(self, step: int) -> None:
        self._end_step(step, self._t0)

    def stop_here(self) -> NoReturn:
        """A deadline or signal stop before the next step: save the state as it is now, end main(run).

        Nothing of the user's code runs after this in the session (see SessionStopped), so the
        checkpoint is the state at the stop, and code written for a finished epoch or a finished
        run never sees an unfinished one."""
        self.finish()
        self.end_loop()
        self.progress.stopped = True
        say(f"the session ends here: the code after the loop runs when the run is finished "
            f"(step {self.progress.total}), in a later session")
        raise SessionStopped(self.progress.stop_reason)

    # --- a loop of the user's own ---------------------------------------------------------------------

    def should_stop(self, step: int | None) -> bool:
        """run.should_stop: True when this session must end after this step (see Run.should_stop)."""
        p = self.progress
        self.clock.poll()
        if step is not None:
            p.step = p.current = step
        p.loop_steps += 1
        self.watch_untracked()
        if self._handlers is None:
            self._handlers = self._install_signals()
        if p.started_at is None:
            p.started_at = time.perf_counter()
        local = p.stop_reason if self._local_stop() else None
        if self.ranks.active:  # kchain ddp: every rank stops at the same step
            agreed, _ = self.ranks.agree(local, False)
            p.stop_reason = agreed or p.stop_reason
        return bool(p.stop_reason)

    def save(self, step: int | None = None) -> None:
        """run.save: checkpoint everything tracked as `step` (default: the step reached)."""
        p = self.progress
        if p.retired:  # kchain ladder: an attempt the out-of-memory ladder replaced is never saved
            return
        if step is not None:
            self.restore()  # a save before any restore would hide the checkpoint to resume from
            p.step = p.current = step
            p.looped = True
        before, p.phase = p.phase, "checkpoint"
        self.ckpt.save(p, self.trace, self.check_replicas)
        if self.faults.hold_after_save:
            self.ckpt.writer.wait()  # the checkpoint is complete: the local Kaggle's kill lands here
            self.faults.hold()
        if self.ranks.is_main and self._dog is not None:
            self._dog.pause()  # a save is not a step: the hang clock restarts after it
        p.phase = before
        if step is not None and p.stop_reason and not p.stopped:
            # A loop of the user's own, saving after run.should_stop said stop: end main(run) as run.steps does.
            self.ckpt.writer.wait()
            self.ranks.barrier()
            p.status, p.stopped = p.stop_reason, True
            say(f"{p.status} at step {p.step}; checkpoint {self.ckpt.newest_rel()}: the session ends here")
            raise SessionStopped(p.stop_reason)

    def every(self, n: int) -> bool:
        """run.every: True every n steps and on the last step (an evaluation's step)."""
        p = self.progress
        self.clock.every_n = n
        hit = p.current % n == 0 or p.current == p.total
        if hit:
            p.phase = "validation"
            self._eval_step = p.current
        return hit

    # --- the loop's start and end ------------------------------------------------------------------------

    def start_loop(self, scan_loaders: bool = True) -> None:
        """`scan_loaders=False`: a framework's loop (lightning.py), whose training loader kchain has already
        replaced and whose own evaluation loaders restart by design: no DataLoader is looked for."""
        self.progress.looped = True
        self._note_plain_loaders(scan_loaders)
        self.check_one_model()
        self._handlers = self._install_signals()
        self.progress.started_at = time.perf_counter()
        self.ckpt.last_save = time.time()
        if self.hang_s is not None:  # a hung step ends the run instead of the session's remaining hours
            self._dog = watchdog.Watchdog(self.hang_s, self.on_hang).start()

    def finish(self, stopped: bool = False) -> None:
        """The loop ends: the final save, every rank waits for it, the status."""
        p = self.progress
        if p.retired:  # an attempt the out-of-memory ladder replaced: nothing of it is kept
            return
        if self._dog is not None:
            self._dog.stop()  # the final save and what follows the loop are not steps
        if stopped:
            p.stop_reason = p.stop_reason or "stopped"
        if p.saved_step != p.step:
            self.save()
        p.phase = "checkpoint"
        self.ckpt.writer.wait()
        self.ranks.barrier()  # kchain ddp: no rank leaves before rank 0's checkpoint is complete
        p.status = p.stop_reason or "finished"
        say(f"{p.status} at step {p.step}/{p.total}; checkpoint {self.ckpt.newest_rel()}")
        if p.status == "finished" and p.total is not None and p.step < p.total:
            # run.epochs ran out of epochs before its steps: some passes gave no batches (a loop that
            # skipped them, a loader read by another consumer). Finished, but not what was asked for.
            p.note = (f"trained {p.step} of the {p.total} steps asked for: some epochs gave no "
                      "batches (read the loader once per epoch, inside run.epochs)")
            warn(p.note)
        p.phase = "validation"  # whatever runs after the loop is usually a final evaluation

    def end_loop(self) -> None:
        if self._dog is not None:
            self._dog.stop()
            self._dog = None
        self.restore_signals()

    def restore_signals(self) -> None:
        for s, handler in (self._handlers or {}).items():
            signal.signal(s, handler)
        self._handlers = None

    # --- a step's start and end ----------------------------------------------------------------------------

    def _start_step(self, step: int) -> float:
        self.progress.current = step
        self.progress.phase = "step"
        if self.progress.loop_steps == 0:
            ladder.injected([lo.batch_size for lo in self.loaders if lo.batch_size], self.faults.oom_above)
        return time.perf_counter()

    def _end_step(self, step: int, t0: float, save: bool = True) -> None:
        """The body of `step` ran to its end: count it, and save when the cadence says so."""
        p = self.progress
        self.faults.at_step_end(step, self.ranks.kill_all)
        p.step = step
        p.loop_steps += 1
        took = time.perf_counter() - t0
        self.clock.step_took(took, evaluated=self._eval_step == step)
        if self.ranks.active and p.loop_steps == 1:
            self.check_replicas(f"after step {step}")
        self.ckpt.frozen.poll()  # a resume onto another base stops here, once its bytes are hashed
        self.watch_untracked()
        self._heartbeat()
        if self._dog is not None:
            self._dog.beat(took)
        # kchain ddp: with several ranks the save is agreed at the start of the next step (_must_stop)
        if save and not self.ranks.active and self.ckpt.due(p.step, p.total):
            self.save()

    def _must_stop(self) -> bool:
        """Whether the loop must end before the next step (checked at the start of every step)."""
        if not self.ranks.active:
            return self._local_stop()
        # kchain ddp: one all-reduce at the start of each step decides for every rank, and saves
        # the step just finished when any rank's cadence says so. The save comes before the stop,
        # so a stop right after a due save writes no second checkpoint.
        p = self.progress
        due = p.loop_steps > 0 and p.saved_step != p.step and self.ckpt.due(p.step, p.total)
        local = p.stop_reason if self._local_stop() else None
        stop, save = self.ranks.agree(local, due)
        if stop and not p.stop_reason:
            say(f"another rank stopped ({stop}): stopping at step {p.step} with it")
        if stop:
            p.stop_reason = stop
        if save:
            self.save()
        return bool(stop)

    def _local_stop(self) -> bool:
        """This process's own view: a signal, a test's deadline fault, a rehearsal's planned stop, or the
        deadline guard."""
        p = self.progress
        if p.stop_reason:
            return True
        line = self.faults.deadline_line(p.step, p.loop_steps, self.ranks.rank)
        if line is None and self.plan is not None:
            line = self.plan.deadline_line(p.step, p.resumed_from or 0, p.total)
        if line is None:
            self.clock.sized(self.ckpt.writer.last_path)
            line = self.clock.too_late(p.step, p.total, self.ckpt.save_s())
        if line is None:
            return False
        p.stop_reason = "deadline"
        say(line)
        return True

    def watch_untracked(self) -> None:
        """A smoke or a rehearsal: stop with UntrackedState when the first step finds state no checkpoint
        holds, or (a smoke) when something untracked changed since the first step."""
        if self._untracked is not None:
            self._untracked.check(self._held(), [obj for obj, _ in self.ckpt.excluded])

    def _untracked_digests(self) -> dict[str, str]:
        """At a save: the digests of the untracked state, beside the checkpoint's own (untracked.py)."""
        assert self._untracked is not None
        return self._untracked.digests(self._held(), self.ckpt.excluded)

    def _held(self) -> list[object]:
        """What a checkpoint holds: the tracked objects and what a framework's own checkpoint covers."""
        return [*self.ckpt.tracked.values(), *self.ckpt.covered.values()]

    def _heartbeat(self) -> None:
        if not self._planned:
            self._planned = True
            line = self.clock.plan(lambda: self._state_bytes())
            if line:
                say(line)
        now = time.perf_counter()
        if not self.ranks.is_main or (self.heartbeat_s and now - self._last_heartbeat < self.heartbeat_s):
            return
        self._last_heartbeat = now
        p = self.progress
        assert p.started_at is not None and p.total is not None  # set as the loop started (start_loop)
        elapsed = now - p.started_at
        rate = p.loop_steps / elapsed if elapsed > 0 else 0.0
        eta = (p.total - p.step) / rate if rate else None
        shown = {k: v for k, v in self.trace.metrics.items() if isinstance(v, (int, float))}
        emit(heartbeat.line(
            p.step, p.total, shown, rate, self.data_wait / elapsed if elapsed > 0 else 0.0,
            eta, self.clock.left_s(), self._next_save(), ranks=self.ranks.world_size,
        ))

    def _next_save(self) -> str:
        """How far the next save is: the cadence's, or a test's planned stop when it comes first (the smoke's
        run to kill saves only at its stop: its cadence is a placeholder that never falls)."""
        p = self.progress
        stop = self.faults.stop_step(p.step, p.loop_steps)
        if stop is not None and stop >= p.step and not any(self.ckpt.due(s, p.total) for s in range(p.step + 1, stop)):
            return f"{stop - p.step} steps (the planned stop)"
        return self.ckpt.next_in(p.step, p.total)

    def _state_bytes(self) -> int:
        from kchain.common.publishplan import state_bytes

        return state_bytes(self.ckpt.states())

    def add_wait(self, seconds: float) -> None:
        self.data_wait += seconds

    def _install_signals(self) -> dict[signal.Signals, Any] | None:
        if threading.current_thread() is not threading.main_thread():
            return None

        def stop(signum, frame):
            self.progress.stop_reason = "interrupted"
            say(f"received {signal.Signals(signum).name}: stopping after this step and saving")

        return {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}

    # --- checks at the loop's start ---------------------------------------------------------------------------

    def _modules(self) -> dict:
        import torch

        return {n: o for n, o in self.ckpt.tracked.items() if isinstance(o, torch.nn.Module)}

    def _optimizers(self) -> list:
        import torch

        tracked = [o for o in self.ckpt.tracked.values() if isinstance(o, torch.optim.Optimizer)]
        return list({id(o): o for o in [*self.optimizers, *tracked]}.values())

    def check_one_model(self) -> None:
        """kchain ddp: before the first step, every parameter an optimizer steps is under DDP (else stop)."""
        if self.ranks.active:
            line = replicas.unsynced(self._optimizers(), self._modules())
            if line:
                raise replicas.UnsyncedReplicas(line)

    def check_replicas(self, when: str) -> None:
        """kchain ddp: every rank holds the same trained parameters, or every rank stops here (one
        gather of a number per parameter tensor; see replicas.py)."""
        params = replicas.trained(self._optimizers(), self._modules())
        if self._sharded is None:
            self._sharded = replicas.sharded(params)
        if self._sharded:
            return  # FSDP / DTensor: each rank holds its own shard, equal sums are not expected
        line = replicas.differing(self.ranks.all_gather(replicas.fingerprint(params)), params)
        if line:
            raise replicas.UnsyncedReplicas(
                f"{when} the ranks hold different weights, first {line}: the gradients were not averaged "
                f"over the ranks; {replicas.FIX}")

    def _note_plain_loaders(self, scan: bool = True) -> None:
        """Name any torch DataLoader the user built (not via run.loader): it restarts on resume."""
        ours = {id(lo.dataloader) for lo in self.loaders}
        tracked = {id(o) for o in self.ckpt.tracked.values()}

        def plain_loaders() -> list:
            # type(o), not isinstance: isinstance reads __class__, which some torch objects warn on.
            # A sequential one (a validation loader) restarting from its start is what it should do.
            return [o for o in gc.get_objects()
                    if issubclass(type(o), DataLoader) and id(o) not in ours and id(o) not in tracked
                    and not isinstance(o.sampler, SequentialSampler) and not _sequential_shards(o.sampler)]

        # A DataLoader made for one batch (a preflight check) is garbage, not a loader in use: when
        # there is a candidate, collect (a pass over the code's objects: the imports' are frozen,
        # launch._freeze_imports) and look again.
        plain = plain_loaders() if scan else []
        if plain:
            del plain
            gc.collect()
            plain = plain_loaders()
        not_exact = self.progress.not_exact
        if plain and not any(line.startswith(PLAIN_LOADER_NOTE) for line in not_exact):
            named = ", ".join(_loader_name(o) for o in plain[:3])
            not_exact.append(f"{PLAIN_LOADER_NOTE}: {named} (pass it to run.loader(...) to keep its place; "
                                  "one used only for evaluation does not change the resume)")
        del plain
        for line in not_exact:
            warn(f"not exact on resume: {line}")


def _sequential_shards(sampler) -> bool:
    """A DistributedSampler that does not shuffle (a framework's evaluation loader): each rank's rows in order."""
    return isinstance(sampler, DistributedSampler) and not sampler.shuffle


def _loader_name(loader) -> str:
    """A DataLoader as the user knows it: the variable that holds it in the code's frames, and what it reads."""
    import os
    import sys

    what = f"a DataLoader over {type(loader.dataset).__name__}, batch_size {loader.batch_size}"
    frame: FrameType | None = sys._getframe(1)
    here = os.path.dirname(__file__)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(here):
            name = next((k for k, v in frame.f_locals.items() if v is loader), None)
            if name is not None:
                return f"`{name}` ({what})"
        frame = frame.f_back
    return what
