"""The runtime's settings, parsed once: the job's `train` / `smoke` config and the environment.

Standard library only: `kchain/job/spec.py` validates job.yaml with the same parsers and defaults, so
a duration means the same thing on the laptop and in the kernel.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kchain.common import keepbest, layout, sessionplan
from kchain.common.config import RuntimeConfig
from kchain.common.faults import NO_FAULTS, Faults
from kchain.common.sessionplan import SessionPlan

# The defaults of job.yaml's train: and smoke: keys (spec.py uses these too).
CHECKPOINT_EVERY = "10m"  # a lost session costs at most this much training
KEEP = 2
SESSION_LIMIT = "12h"  # Kaggle's GPU session limit
MARGIN = "15m"  # kept back for the final save and the kernel's own output upload
HEARTBEAT = "60s"
PRECISION: Final = "auto"
SMOKE_FRACTION = 0.02
SMOKE_STEPS = 2
SHORT_LIMIT_MARGIN = 0.2  # with an overridden (short, local) limit, keep at most 20% back

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s)")
_STEPS_RE = re.compile(r"\s*(\d+)\s*steps?\s*")
_MAX_DURATION_CHARS = 32  # keeps the regexes linear in practice: a long run of digits would backtrack


def parse_duration(text: Any) -> float:
    """'90s', '10m', '1h30m', '12h' (or a number of seconds) -> seconds. ValueError for anything else."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower().replace(" ", "")
    if not s or len(s) > _MAX_DURATION_CHARS or _DURATION_PART.sub("", s):
        raise ValueError(text)
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in _DURATION_PART.findall(s))


def parse_cadence(text: Any) -> dict[str, float]:
    """A checkpoint cadence: '500 steps' (or an int) -> {'steps': 500}; '10m' -> {'seconds': 600}."""
    if isinstance(text, int) and not isinstance(text, bool):
        return {"steps": text}
    s = str(text)
    m = _STEPS_RE.fullmatch(s) if len(s) <= _MAX_DURATION_CHARS else None
    if m:
        return {"steps": int(m.group(1))}
    return {"seconds": parse_duration(text)}


def _env_cadence(text: str) -> dict[str, float]:
    try:
        return parse_cadence(text)
    except ValueError:
        raise ValueError(f"{layout.CHECKPOINT_EVERY_ENV}={text!r} is not a cadence; write e.g. '20 steps' or '10m'") from None


HANG_FLOOR_S = 30 * 60  # the hung-step watchdog's default floor: no step in 30 minutes


def _hang_floor_s(hang_timeout_s: float | None, env: Mapping[str, str]) -> float:
    """The watchdog's floor: the environment's override, else train.hang_timeout_s, else 30 minutes."""
    if env.get(layout.HANG_ENV):
        return float(env[layout.HANG_ENV])
    return float(HANG_FLOOR_S if hang_timeout_s is None else hang_timeout_s)


@dataclass(frozen=True)
class Settings:
    """Everything a Run reads from its config and environment, in numbers: parsed once, never changed."""

    job: str
    smoke: bool
    fraction: float  # the share of the data run.subset keeps (1.0 outside a smoke)
    smoke_steps: int
    total_cap: int | None  # KCHAIN_TOTAL_STEPS
    started: float  # the session's start, epoch seconds
    limit_s: float  # the session's hard limit, seconds after `started`
    margin_s: float  # kept back before the limit for the final save and the output upload
    every: dict[str, float]  # {'steps': n} or {'seconds': s}
    keep: int
    heartbeat_s: float
    precision: str
    stream: str | None  # KCHAIN_CHECKPOINT_STREAM: '1', '0' or None (by size)
    params: dict = field(default_factory=dict)  # the job's params, then smoke.params and --set in a smoke
    smoke_params: dict = field(default_factory=dict)  # smoke.params, then --set (KCHAIN_SMOKE_PARAMS); smoke only
    faults: Faults = NO_FAULTS
    micro_auto: bool = False  # train.micro_batch: auto, the out-of-memory ladder
    checkpoint_frozen: bool = False  # train.checkpoint_frozen: the frozen base is saved too
    keep_best: keepbest.Choice | None = keepbest.Choice()  # train.keep_best: the metric and mode; None: off
    hang_s: float = 1800.0  # the hung-step watchdog's floor (_hang_floor_s)
    cache_dataset: str = ""  # the job's staging cache dataset, as the kernel mounts it
    state_slug: str | None = None  # the slug of the job's state dataset (None in a local run)
    publish: dict | None = None  # the in-kernel publish's figures (publishplan), None when the laptop relays
    resume: dict | None = None  # the step `kchain continue` pushed this session to resume (resumecheck)
    fingerprint: str | None = None
    kchain_version: str | None = None
    sink: str | None = None  # KCHAIN_STATE_SINK: a mounted bucket folder each complete checkpoint is published to
    requeued: bool = False  # a requeued run (SLURM_RESTART_COUNT > 0) without KCHAIN_START_OVER=1: an empty sink is lost state
    plan: SessionPlan | None = None  # KCHAIN_SESSION_PLAN: a rehearsal's sessions planned in steps
    audit: bool = False  # a smoke or a rehearsal (KCHAIN_AUDIT_STATE): the untracked state refused and digested
    trackers: tuple[str, ...] = ()  # train.trackers switched on: tensorboard, wandb, mlflow (trackers.py)
    multi_node: bool = False  # the ranks span machines (an outer torchrun with --nnodes > 1): no disk is shared

    @classmethod
    def parse(cls, config: RuntimeConfig, env: Mapping[str, str], started: float | None = None) -> Settings:
        from kchain.common import publishplan

        train, smoke_cfg = config.train, config.smoke
        smoke = env.get(layout.SMOKE_ENV) == "1"
        # The session's clock: the notebook's first cell, not this process, when the notebook says.
        start = float(env[layout.SESSION_START_ENV]) if env.get(layout.SESSION_START_ENV) else (started or time.time())
        margin = float(parse_duration(MARGIN) if train.margin_s is None else train.margin_s)
        if env.get(layout.SESSION_LIMIT_ENV):
            limit = float(env[layout.SESSION_LIMIT_ENV])
            margin = min(margin, SHORT_LIMIT_MARGIN * limit)
        else:
            limit = float(parse_duration(SESSION_LIMIT) if train.session_limit_s is None else train.session_limit_s)
        every = env.get(layout.CHECKPOINT_EVERY_ENV)
        smoke_params = {**smoke_cfg.params, **json.loads(env.get(layout.SMOKE_PARAMS_ENV) or "{}")} if smoke else {}
        return cls(
            job=config.job,
            smoke=smoke,
            fraction=float(SMOKE_FRACTION if smoke_cfg.fraction is None else smoke_cfg.fraction) if smoke else 1.0,
            smoke_steps=int(SMOKE_STEPS if smoke_cfg.steps is None else smoke_cfg.steps),
            total_cap=int(env[layout.TOTAL_STEPS_ENV]) if env.get(layout.TOTAL_STEPS_ENV) else None,
            started=start,
            limit_s=limit,
            margin_s=margin,
            every=_env_cadence(every) if every else dict(train.checkpoint_every or parse_cadence(CHECKPOINT_EVERY)),
            keep=int(KEEP if train.keep is None else train.keep),
            heartbeat_s=float(parse_duration(HEARTBEAT) if train.heartbeat_s is None else train.heartbeat_s),
            precision=train.precision or PRECISION,
            stream=env.get(layout.CHECKPOINT_STREAM_ENV),
            params={**config.params, **smoke_params},
            smoke_params=smoke_params,
            faults=Faults.parse(env.get(layout.FAULT_ENV, "")),
            micro_auto=train.micro_batch == "auto",
            checkpoint_frozen=bool(train.checkpoint_frozen),
            keep_best=keepbest.parse(train.keep_best),
            hang_s=_hang_floor_s(train.hang_timeout_s, env),
            cache_dataset=config.kaggle.cache_dataset or f"{config.job}{layout.CACHE_SUFFIX}",
            state_slug=config.state_slug,
            publish=None if smoke else publishplan.figures(config.kaggle),
            resume=config.kaggle.resume,
            fingerprint=config.fingerprint,
            kchain_version=config.kchain_version,
            sink=env.get(layout.STATE_SINK_ENV) or None,
            requeued=int(env.get(layout.RESTART_COUNT_ENV) or 0) > 0 and env.get(layout.START_OVER_ENV) != "1",
            plan=sessionplan.parse(env.get(layout.SESSION_PLAN_ENV)),
            audit=smoke or env.get(layout.AUDIT_ENV) == "1",
            trackers=tuple(train.trackers or ()),
            multi_node=int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or 1) < int(env.get("WORLD_SIZE") or 1),
        )
