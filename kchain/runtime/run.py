"""Run: the one object the user's `main(run)` talks to.

It is built from the job's config dict and an environment mapping (os.environ in the kernel), so a
test or a benchmark can build one in-process without the launcher. Restoring is lazy: `run.steps`
loads the newest checkpoint after the training code has registered everything with `run.track`
and `run.loader`, then yields the remaining step numbers, saving on the job's cadence, at the
deadline, on SIGTERM/SIGINT and at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from . import data, heartbeat, layout, precision, preflight, publishplan, resumecheck, watchdog
from .checkpoint import (
    Snapshotter,
    Writer,
    check_compatible,
    clean_tmp,
    find_latest,
    load_state,
    restore_rng,
    rng_state,
    say,
    warn,
)

DEFAULT_EVERY = {"seconds": 600}  # 10 minutes: a lost session costs at most that much training
DEFAULT_KEEP = 2
DEFAULT_SESSION_LIMIT_S = 12 * 3600  # Kaggle's GPU session limit
DEFAULT_MARGIN_S = 600  # time kept back for the final save and the kernel's own output upload
SHORT_LIMIT_MARGIN = 0.2  # with an overridden (short, local) limit, keep at most 20% back
DEFAULT_HEARTBEAT_S = 60
DEFAULT_SMOKE_FRACTION = 0.05
DEFAULT_SMOKE_STEPS = 20
STEP_TIME_WINDOW = 5  # the deadline guard plans with the slowest of the last few steps


class Params(dict):
    """The job's params: `run.params.lr` and `run.params["lr"]` both work."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"params has no {name!r}; the job defines {sorted(self)}") from None


def parse_every(text: str) -> dict:
    """'20 steps' -> {'steps': 20}; '10m' / '30s' / '1h' -> {'seconds': ...}."""
    m = re.fullmatch(r"\s*(\d+)\s*steps?\s*", text)
    if m:
        return {"steps": int(m.group(1))}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text)
    if m:
        return {"seconds": float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]}
    raise ValueError(f"{layout.CHECKPOINT_EVERY_ENV}={text!r} is not a cadence; write e.g. '20 steps' or '10m'")


def parse_faults(text: str) -> dict[str, str]:
    """KCHAIN_FAULT='kill_at_step=7,stall_step=0.5' -> {'kill_at_step': '7', 'stall_step': '0.5'}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def _state_of(obj):
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    return obj.state_dict()


def _load_into(obj, state) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    else:
        obj.load_state_dict(state)


def _plain(v):
    """A JSON-able number from a tensor / numpy scalar (loss.item() is easy to forget)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


class Run:
    def __init__(self, config: dict, env: Mapping[str, str] | None = None, started: float | None = None):
        env = os.environ if env is None else env
        self.config = config
        self.job = config.get("job", "job")
        self.params = Params(config.get("params") or {})
        train = config.get("train") or {}
        smoke = config.get("smoke") or {}

        self.smoke = env.get(layout.SMOKE_ENV) == "1"
        self.fraction = float(smoke.get("fraction", DEFAULT_SMOKE_FRACTION)) if self.smoke else 1.0
        self._smoke_steps = int(smoke.get("steps", DEFAULT_SMOKE_STEPS))
        self._total_cap = int(env[layout.TOTAL_STEPS_ENV]) if env.get(layout.TOTAL_STEPS_ENV) else None
        self.seed = int(self.params.get("seed", 0))

        self.input_root = layout.input_root(env)
        self.working = layout.working_root(env)
        self.dir = layout.kchain_dir(env)
        self.checkpoints = self.dir / layout.CHECKPOINTS_DIR
        self.cache_dir = self.dir / layout.CACHE_DIR
        self.metrics_path = self.dir / layout.METRICS
        self.summary_path = self.dir / layout.SUMMARY
        self.dir.mkdir(parents=True, exist_ok=True)

        # The session's clock: the notebook's first cell, not this process, when the notebook says.
        self.started = float(env[layout.SESSION_START_ENV]) if env.get(layout.SESSION_START_ENV) else (started or time.time())
        margin = float(train.get("margin_s", DEFAULT_MARGIN_S))
        if env.get(layout.SESSION_LIMIT_ENV):
            limit = float(env[layout.SESSION_LIMIT_ENV])
            margin = min(margin, SHORT_LIMIT_MARGIN * limit)
        else:
            limit = float(train.get("session_limit_s", DEFAULT_SESSION_LIMIT_S))
        self.limit_s, self.margin_s = limit, margin
        self.end = self.started + limit  # the session's hard limit
        self.deadline = self.end - margin  # moved earlier when the kernel publishes its own state
        # The in-kernel publish after the final save (None: the laptop relays the state).
        self.publish_plan = None if self.smoke else publishplan.figures(config)
        self._state_bytes = 0  # the checkpoint's size: estimated at the first heartbeat, then measured
        self._sized_path: Path | None = None
        self._planned = False
        every = env.get(layout.CHECKPOINT_EVERY_ENV)
        self.every_cfg = parse_every(every) if every else dict(train.get("checkpoint_every") or DEFAULT_EVERY)
        self.keep = int(train.get("keep", DEFAULT_KEEP))
        self.heartbeat_s = float(train.get("heartbeat_s", DEFAULT_HEARTBEAT_S))
        self.faults = parse_faults(env.get(layout.FAULT_ENV, ""))

        self.device, why = precision.choose_device()
        say(f"device: {self.device} ({why})")
        self.dtype, why = precision.choose_dtype(self.device, train.get("precision", "auto"))
        say(f"precision: {str(self.dtype).removeprefix('torch.')} ({why})")

        self.step = 0  # steps completed (restored ones included)
        self.total: int | None = None
        self.session = 1
        self.resumed_from: int | None = None
        self.status = "running"
        self.phase = "build"  # what the code is doing, for a crash report
        self.metrics: dict = {}
        self.best: dict | None = None
        self._tracked: dict[str, object] = {}
        self._n_loaders = 0
        self._current = 0  # the step whose body is running
        self._restored = False
        self._stop_reason: str | None = None
        self._saved_step: int | None = None
        self._step_times: list[float] = []
        self._data_wait = 0.0
        self._loop_start: float | None = None
        self._loop_steps = 0
        self._last_save = time.time()
        self._last_heartbeat = 0.0
        self.stalls: list[float] = []  # seconds the training thread spent blocked in each save
        self._snapshots = Snapshotter()
        self.writer = Writer(self.faults.get("kill_in_save"), self.faults.get("kill_after_checkpoint") == "1")

        clean_tmp(self.checkpoints)
        self._resume = find_latest(self.checkpoints, self.input_root, self.dir / ".scratch", self.job)
        if self._resume:
            path, manifest = self._resume
            self.session = int(manifest.get("session", 0)) + 1
            # One continuous history: the trace as it was at the checkpoint; later lines are replayed.
            (self.dir / layout.METRICS).write_bytes((path / layout.METRICS).read_bytes())
            say(f"session {self.session} of {self.job}: will resume from {path}")
            self._state_bytes = publishplan.tree_bytes(path)
        else:
            self.metrics_path.write_bytes(b"")
            say(f"session 1 of {self.job}: no checkpoint found, starting fresh")
        if not self.smoke:
            resumecheck.check(config, int(self._resume[1]["step"]) if self._resume else None,
                              str(self._resume[0]) if self._resume else None)
        self._metrics_file = None  # opened by the first run.log
        self._metrics_bytes = self.metrics_path.stat().st_size

    # --- registration ---------------------------------------------------------------------------

    def track(self, **objects) -> None:
        """Register what a checkpoint must hold, by name (names must stay the same across sessions)."""
        for name, obj in objects.items():
            ok = hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            if not (ok or isinstance(obj, (torch.Generator, np.random.Generator))):
                raise TypeError(
                    f"run.track({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict; "
                    "track modules, optimizers, schedulers, GradScalers or generators"
                )
            if self._restored:
                # A resumed run would silently differ from the uninterrupted one: stop here instead.
                raise RuntimeError(
                    f"run.track({name}=...) after run.steps started: the checkpoint is restored when "
                    "run.steps starts, so build and track everything (run.loader, run.optimize too) before the loop"
                )
            if any(o is obj for o in self._tracked.values()):
                continue
            self._tracked[name] = obj

    def loader(self, dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0,
               drop_last: bool = False, collate_fn: Callable | None = None) -> data.Loader:
        """A DataLoader whose position is checkpointed (registered automatically)."""
        self._n_loaders += 1
        lo = data.Loader(
            dataset, batch_size, shuffle=shuffle, num_workers=num_workers, drop_last=drop_last,
            collate_fn=collate_fn, seed=self.seed, pin_memory=self.device.type == "cuda", on_wait=self._add_wait,
        )
        self.track(**{"loader" if self._n_loaders == 1 else f"loader{self._n_loaders}": lo})
        return lo

    def optimize(self, optimizer, accumulate: int = 1, clip: float | None = None, track: bool = True):
        """A Trainer: .backward(loss) accumulate times, then .step()."""
        scaler = None
        if self.dtype == torch.float16:
            scaler = torch.amp.GradScaler(self.device.type)
        if track:
            self.track(optimizer=optimizer)
            if scaler is not None:
                self.track(scaler=scaler)
        return precision.Trainer(optimizer, accumulate=accumulate, clip=clip, scaler=scaler)

    def autocast(self):
        return precision.autocast(self.device, self.dtype)

    # --- data -----------------------------------------------------------------------------------

    def input(self, name: str) -> Path:
        return data.find_input(name, self.input_root)

    def stage(self, name: str, params, build: Callable):
        return data.stage(name, params, build, self.cache_dir, self.input_root)

    def subset(self, items):
        return data.subset(items, self.fraction) if self.smoke else items

    def check(self, batch=None, x_shape=None, x_dtype=None, num_classes=None, label_dtype=None, splits=None):
        before, self.phase = self.phase, "preflight"
        if splits:
            preflight.check_splits(splits)
        if batch is not None:
            preflight.check_batch(batch, x_shape, x_dtype, num_classes, label_dtype)
        self.phase = before

    # --- the loop -------------------------------------------------------------------------------

    def steps(self, total: int):
        """Yield step numbers restored_step+1 .. total; save on cadence, at the deadline and at the end."""
        if self._total_cap is not None:
            total = min(total, self._total_cap)
        elif self.smoke:  # the smoke driver sets the cap itself (steps, then as many after the kill)
            total = min(total, self._smoke_steps)
        self.total = total
        self._restore()
        old_handlers = self._install_signals()
        self._loop_start = time.perf_counter()
        self._last_save = time.time()
        stall = float(self.faults.get("stall_step", 0))
        kill_at = int(self.faults.get("kill_at_step", -1))
        hang_at = int(self.faults.get("hang_at_step", -1))
        dog = None if self.smoke else watchdog.Watchdog(watchdog.floor_s(self.config, os.environ), self._hung).start()
        try:
            step = self.step
            while step < total:
                if self._should_stop():
                    break
                step += 1
                self._current = step
                self.phase = "step"
                t0 = time.perf_counter()
                yield step
                if stall:
                    time.sleep(stall)
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death: nothing below runs
                if step == hang_at:
                    time.sleep(10**9)  # a step that never returns: the watchdog ends the run
                self.step = step
                self._loop_steps += 1
                self._step_times = (self._step_times + [time.perf_counter() - t0])[-STEP_TIME_WINDOW:]
                self._heartbeat()
                if dog is not None:
                    dog.beat(self._step_times[-1])
                if self._save_due():
                    self.save()
                    if dog is not None:
                        dog.pause()
            if dog is not None:
                dog.stop()
            if self._saved_step != self.step:
                self.save()
            self.phase = "checkpoint"
            self.writer.wait()
            self.status = self._stop_reason or "finished"
            say(f"{self.status} at step {self.step}/{total}; checkpoint {self.checkpoint_rel()}")
        finally:
            if dog is not None:
                dog.stop()
            self._restore_signals(old_handlers)
        self.phase = "validation"  # whatever runs after the loop is usually a final evaluation

    def every(self, n: int) -> bool:
        """True every n steps and on the last step; that step's crash stage is 'validation'."""
        hit = self._current % n == 0 or self._current == self.total
        if hit:
            self.phase = "validation"
        return hit

    @property
    def finished(self) -> bool:
        """The loop reached its total (False after a deadline or interrupt stop)."""
        return self.status == "finished"

    def log(self, **metrics) -> None:
        values = {k: _plain(v) for k, v in metrics.items()}
        row = {"step": self._current or self.step, "time": round(time.time(), 3), **values}
        line = (json.dumps(row) + "\n").encode()
        if self._metrics_file is None:
            self._metrics_file = open(self.metrics_path, "ab")
        self._metrics_file.write(line)
        self._metrics_file.flush()
        self._metrics_bytes += len(line)
        self.metrics.update(values)
        for k, v in values.items():
            # The first val* metric logged is the one "best" follows; lower is better for losses.
            if not k.startswith("val") or not isinstance(v, (int, float)):
                continue
            if self.best is not None and self.best["name"] != k:
                continue
            lower = any(w in k for w in ("loss", "err", "perplexity", "ppl"))
            if self.best is None or (v < self.best["value"] if lower else v > self.best["value"]):
                self.best = {"name": k, "value": v, "step": row["step"]}
            break

    # --- internals ------------------------------------------------------------------------------

    def _add_wait(self, seconds: float) -> None:
        self._data_wait += seconds

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def stop(signum, frame):
            self._stop_reason = "interrupted"
            say(f"received {signal.Signals(signum).name}: stopping after this step and saving")

        return {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(old) -> None:
        for s, handler in (old or {}).items():
            signal.signal(s, handler)

    def _hung(self, waited: float, limit: float) -> None:
        """The watchdog's verdict: a step hangs. The summary says `hung`; no checkpoint is written."""
        def write() -> None:
            self.status = "hung"
            summary = self.summary(error={"type": "Hung", "message": f"no step completed for {waited:.0f}s",
                                          "stage": self.phase})
            tmp = self.summary_path.with_name(f"{layout.TMP_PREFIX}{self.summary_path.name}")
            tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
            os.replace(tmp, self.summary_path)

        watchdog.end_hung(say, write, waited, limit)

    def _should_stop(self) -> bool:
        if self._stop_reason:
            return True
        after = int(self.faults.get("deadline_after_steps", 0) or 0)
        if after and self._loop_steps >= after:
            # A test's clock: the deadline falls after N steps of this session, whatever the machine.
            self._stop_reason = "deadline"
            say(f"deadline (fault deadline_after_steps={after}): stopping at step {self.step} and saving")
            return True
        step_s = max(self._step_times, default=0.0)
        save_s = max(self.stalls, default=0.0) + self.writer.last_write_s
        self.deadline = self.end - self._reserve_s()
        left = self.deadline - time.time()
        if left < step_s + save_s:
            self._stop_reason = "deadline"
            say(
                f"deadline: {left:.1f}s left before the session limit and a step takes {step_s:.2f}s "
                f"(+{save_s:.2f}s to save): stopping at step {self.step} and saving"
            )
            return True
        return False

    def _publish_s(self) -> float:
        """Seconds the in-kernel publish needs, 0 when there is none or it cannot fit the session."""
        if self.publish_plan is None:
            return 0.0
        path = self.writer.last_path
        if path is not None and path != self._sized_path:
            self._sized_path, self._state_bytes = path, publishplan.tree_bytes(path)
        need = publishplan.seconds(self.publish_plan, self._state_bytes)
        return need if need <= (self.limit_s - self.margin_s) / 2 else 0.0

    def _reserve_s(self) -> float:
        """Kept back after the last step besides the final save: train.margin, or the publish if longer."""
        return max(self.margin_s, self._publish_s())

    def _plan(self) -> None:
        """Once, with the first heartbeat: when the session stops and what the time after it is for."""
        self._planned = True
        if self.publish_plan is None:
            return
        if not self._state_bytes:
            self._state_bytes = publishplan.state_bytes(
                {name: _state_of(obj) for name, obj in self._tracked.items()})
        size = publishplan.size_text(self._state_bytes)
        need = publishplan.seconds(self.publish_plan, self._state_bytes)
        source = "measured" if self.publish_plan.get("measured") else "assumed"
        if not self._publish_s():
            say(f"plan: the publish of {size} needs about {heartbeat.duration(need)} ({source}), more than half "
                f"this session: stopping at {heartbeat.duration(self.end - self.margin_s - self.started)}; "
                "`kchain continue` relays the state from the laptop")
            return
        self.deadline = self.end - self._reserve_s()
        say(f"plan: stopping at {heartbeat.duration(self.deadline - self.started)}: "
            f"{heartbeat.duration(self._reserve_s())} for save + publish of {size} ({source} figures)")

    def _save_due(self) -> bool:
        if "steps" in self.every_cfg:
            return self.step % int(self.every_cfg["steps"]) == 0
        return time.time() - self._last_save >= float(self.every_cfg["seconds"])

    def _next_checkpoint(self) -> str:
        if "steps" in self.every_cfg:
            n = int(self.every_cfg["steps"])
            return f"{n - self.step % n} steps"
        return heartbeat.duration(float(self.every_cfg["seconds"]) - (time.time() - self._last_save))

    def _heartbeat(self) -> None:
        if not self._planned:
            self._plan()
        now = time.perf_counter()
        if self.heartbeat_s and now - self._last_heartbeat < self.heartbeat_s:
            return
        self._last_heartbeat = now
        elapsed = now - self._loop_start
        rate = self._loop_steps / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.step) / rate if rate else None
        shown = {k: v for k, v in self.metrics.items() if isinstance(v, (int, float))}
        print(heartbeat.line(
            self.step, self.total, shown, rate, self._data_wait / elapsed if elapsed > 0 else 0.0,
            eta, self.deadline - time.time(), self._next_checkpoint(),
        ), flush=True)

    def _restore(self) -> None:
        if self._restored:
            return
        self._restored = True
        if not self._resume:
            return
        self.phase = "resume"
        path, manifest = self._resume
        saved = load_state(path)
        current = {name: _state_of(obj) for name, obj in self._tracked.items()}
        check_compatible(path, manifest, saved["tracked"], current, dict(self.params))
        for name, obj in self._tracked.items():
            if name in saved["tracked"]:
                _load_into(obj, saved["tracked"][name])
            else:
                warn(f"{name!r} is tracked now but not in the checkpoint: it starts fresh, the run is not exact")
        for name in saved["tracked"]:
            if name not in self._tracked:
                warn(f"the checkpoint holds {name!r} but nothing is tracked under that name now: ignored")
        restore_rng(saved["rng"])
        self.step = self._saved_step = self.resumed_from = int(saved["step"])
        self.metrics = dict(saved.get("metrics") or {})
        self.best = saved.get("best")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(manifest.get("time", 0))))
        say(f"resumed from step {self.step} ({path}, saved at {when})")

    def save(self) -> None:
        """Snapshot the state (blocking) and write it in the background."""
        before, self.phase = self.phase, "checkpoint"
        t0 = time.perf_counter()
        self.writer.wait()  # one write in flight at most: bounds memory to one extra copy
        state = self._snapshots.take({
            "step": self.step,
            "tracked": {name: _state_of(obj) for name, obj in self._tracked.items()},
            "rng": rng_state(),
            "metrics": self.metrics,
            "best": self.best,
        })
        if self._metrics_file is not None:
            self._metrics_file.flush()
        manifest = {
            "job": self.job,
            "step": self.step,
            "time": time.time(),
            "session": self.session,
            "fingerprint": self.config.get("fingerprint"),
            "kchain_version": self.config.get("kchain_version"),
            "params": dict(self.params),
        }
        self.writer.submit(
            checkpoints=self.checkpoints, step=self.step, state=state, metrics_src=self.metrics_path,
            metrics_bytes=self._metrics_bytes, manifest=manifest, keep=self.keep,
        )
        self.stalls.append(time.perf_counter() - t0)
        self._saved_step = self.step
        self._last_save = time.time()
        self.phase = before

    def checkpoint_rel(self) -> str | None:
        """The newest complete checkpoint, relative to the working dir."""
        path = self.writer.last_path
        if path is None and self._resume:
            path = self._resume[0]
        if path is None:
            return None
        try:
            return str(path.relative_to(self.working))
        except ValueError:
            return str(path)

    def close(self) -> None:
        """Join the writer (no write is ever left in flight) and close the trace."""
        try:
            self.writer.wait()
        finally:
            if self._metrics_file is not None:
                self._metrics_file.close()
                self._metrics_file = None

    def summary(self, error: dict | None = None, ended: float | None = None) -> dict:
        elapsed = (time.perf_counter() - self._loop_start) if self._loop_start else 0.0
        return {
            "status": self.status,
            "session": self.session,
            "step": self.step,
            "total": self.total,
            "metrics": self.metrics,
            "best": self.best,
            "checkpoint": self.checkpoint_rel(),
            "error": error,
            "started": self.started,
            "ended": ended or time.time(),
            "steps_per_s": round(self._loop_steps / elapsed, 3) if elapsed > 0 else None,
            "fingerprint": self.config.get("fingerprint"),
            "resumed_from": self.resumed_from,
            "published": None,
        }
