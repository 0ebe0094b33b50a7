"""The runtime config: what the renderer embeds in the notebook and the kernel's runtime reads.

One typed record, written on the laptop (`spec.runtime_config` + `render._session_config`) and read
in the kernel (`launch.py`, `Run`, the publisher), so a key is spelled once. `to_dict()` is the
JSON in the notebook; `from_dict()` reads it back, with the defaults for what a test's hand-written
config leaves out. `Settings` (settings.py) turns it and the environment into the numbers a Run
uses.

Standard library only: the laptop, the launcher and the publisher read it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    """job.yaml's `train:` in numbers (spec.py parses the text; defaults in settings.py apply to None)."""

    checkpoint_every: dict | None = None  # {'steps': n} or {'seconds': s}
    keep: int | None = None  # complete checkpoints kept
    session_limit_s: float | None = None  # Kaggle's limit for one session
    margin_s: float | None = None  # kept back before the limit for the final save and the upload
    heartbeat_s: float | None = None  # seconds between heartbeat lines
    precision: str | None = None  # auto, fp32, bf16, fp16
    gpus: Any = "auto"  # 'auto' or a rank count (torchrun.plan_ranks)
    micro_batch: Any = None  # 'auto' turns the out-of-memory ladder on
    hang_timeout_s: float | None = None  # the hung-step watchdog's floor (tests set it)
    checkpoint_frozen: bool = False  # checkpoints hold the frozen parameters too (frozen.py)
    keep_best: Any = None  # None: follow run.best's metric; 'off'; {'metric', 'mode'} (keepbest.py)
    trackers: tuple[str, ...] = ()  # the switches of train.trackers that are on (trackers.KINDS)


@dataclass(frozen=True)
class SmokeConfig:
    """job.yaml's `smoke:`."""

    fraction: float | None = None  # the share of the data run.subset keeps
    steps: int | None = None  # steps before the smoke's kill
    params: dict = field(default_factory=dict)  # params the smoke sets over the job's


@dataclass(frozen=True)
class KaggleConfig:
    """Who runs the session and where its state goes: left out of the fingerprint (render.py)."""

    owner: str | None = None
    state_dataset: str | None = None  # owner/slug of the job's state dataset
    cache_dataset: str | None = None  # owner/slug of the job's staging cache dataset
    internet: bool = False  # the kernel may publish its own state
    accelerator: str = "gpu"  # gpu, tpu or none
    resume: dict | None = None  # {'step', 'state_version'}: what `kchain continue` pushed this session to resume
    publish: dict | None = None  # measured publish figures (publishplan.py); None: assumed ones
    mount_wait_s: float = 300.0  # how long a session waits for the state it resumes to be mounted (kaggle.mount_wait)
    unattended: bool = False  # each session pushes the next itself (push --unattended): the plan keeps time for it
    # unattended: {'start', 'used_s'}: the quota week's start (epoch s) and the GPU seconds of it used before this
    # session (the laptop's ledger at its push, then each kernel's tally): nextsession.week_used
    week: dict | None = None


@dataclass(frozen=True)
class RuntimeConfig:
    """The whole config the notebook embeds."""

    job: str = "job"
    entry: str = "train:main"  # module:function the launcher calls with the Run
    params: dict = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    kaggle: KaggleConfig = field(default_factory=KaggleConfig)
    pip: tuple[str, ...] = ()  # kaggle.pip: name==version pins installed from the job's wheels dataset (wheelinstall.py)
    fingerprint: str | None = None  # what the code does (render._fingerprint); None in a test's config
    kchain_version: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RuntimeConfig:
        """The notebook's JSON (or a test's partial dict) as a RuntimeConfig; unknown keys are an error."""
        parts = {"train": TrainConfig, "smoke": SmokeConfig, "kaggle": KaggleConfig}
        values = _known(cls, data, "config")
        for key, kind in parts.items():
            if key in values:
                values[key] = kind(**_known(kind, values[key] or {}, f"config.{key}"))
        if values.get("params") is None:
            values.pop("params", None)
        values["pip"] = tuple(values.get("pip") or ())
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON the notebook embeds: what `from_dict` reads back."""
        out: dict[str, Any] = {"job": self.job, "entry": self.entry, "params": dict(self.params),
                               "train": {k: v for k, v in asdict(self.train).items()
                                         if (k not in ("hang_timeout_s", "keep_best") or v is not None) and (k != "trackers" or v)},
                               "smoke": {k: v for k, v in asdict(self.smoke).items() if k != "params" or v}}
        out["kaggle"] = {k: v for k, v in asdict(self.kaggle).items() if k not in ("resume", "publish") or v is not None}
        if self.pip:  # absent when empty: a job without kaggle.pip keeps its fingerprint
            out["pip"] = list(self.pip)
        for key in ("fingerprint", "kchain_version"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @property
    def state_slug(self) -> str | None:
        """The slug of the job's state dataset (None in a local run)."""
        return (self.kaggle.state_dataset or "").rsplit("/", 1)[-1] or None


def _known(kind, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(names))}")
    return dict(data)
