"""The job spec: job.yaml, validated strictly, loaded through one function.

`load_job(path)` is the only way in. Any YAML or validation problem becomes one SpecError line that
names the file, each bad key path, and the fix (with "did you mean" for typos). A job file is
untrusted input: it is read with a size cap, parsed with nesting and alias-expansion limits before
anything is built from it, and every value that reaches the notebook must be plain JSON.
"""

from __future__ import annotations

import ast
import datetime
import difflib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kchain.common import layout, settings, trackers
from kchain.common.config import RuntimeConfig, SmokeConfig, TrainConfig
from kchain.common.settings import parse_cadence, parse_duration
from kchain.errors import SpecError
from kchain.job.notebook_code import parse_python
from kchain.job.spec_targets import SkyPilotSpec, SlurmSpec
from kchain.store.names import MAX_NAME

__all__ = ["Job", "SpecError", "load_job", "parse_cadence", "parse_duration", "runtime_config"]

# Kaggle's slug syntax, as the official client checks it (kaggle_api_extended._validate_slug_syntax):
# lowercase letters and digits, single dashes inside; owners may also use underscores.
SLUG_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
OWNER_RE = re.compile(r"[a-z0-9]+(?:[_-][a-z0-9]+)*")
# Kernel slugs are at least 5 characters (validate_kernel_string); dataset slugs 6-50 on creation,
# and kchain creates <name>-state and <name>-cache, so a name can be at most 50 - 6 characters.
NAME_MIN, NAME_MAX = 5, MAX_NAME
DATASET_SLUG_MIN, DATASET_SLUG_MAX = 3, 50  # Kaggle's documented range for an existing dataset
OWNER_MAX = 50
COMPETITION_MAX = 100
# Model and variation slugs of existing Kaggle Models also hold dots and underscores (public kernels attach
# e.g. sorokin/qwen3_4b_grids15_sft139/Transformers/bfloat16/1 and .../pytorch/7b-v0.1-hf/1).
MODEL_SLUG_RE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
MODEL_SLUG_MAX = 100  # a bound on what is echoed and mounted, not a documented Kaggle limit
MODEL_EXAMPLE = "google/gemma/transformers/2b/1"
# What kaggle.accelerator may be; KaggleSpec's type also names tpu, so that its refusal can say why.
ACCELERATORS = ("none", "gpu")
# A job file is a few hundred bytes; these bound what a hostile or broken one can cost.
MAX_JOB_BYTES = 256 * 1024
MAX_DEPTH = 50  # nesting levels, counted after aliases are expanded
MAX_EXPANDED = 1_000_000  # values + characters after aliases are expanded (an alias bomb stops here)
MAX_PATH_CHARS = 1024
MAX_SHOWN = 60  # characters of a value echoed in an error
# The longest kaggle.mount_wait: the wait runs on the session's GPU clock before it trains, and the longest
# mount lag measured was 138 s (docs/emulator.md); an hour is far past any lag and still inside a session.
MOUNT_WAIT_MAX_S = 3600


def shown(value: Any) -> str:
    """repr(value), cut to a readable length: an error never echoes a 5 MB value."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN - 15]}...({len(text)} chars)"


def _key_name(part: Any) -> str:
    if isinstance(part, str) and part.isprintable() and 0 < len(part) <= MAX_SHOWN:
        return part
    return shown(part) if not isinstance(part, int) else str(part)


def _key_path(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(_key_name(p) for p in loc) or "(top level)"


def _check_slug(value: str, what: str, low: int, high: int, pattern: re.Pattern[str] = SLUG_RE) -> None:
    if not pattern.fullmatch(value):
        extra = ", underscores" if pattern is OWNER_RE else ""
        raise ValueError(f"{shown(value)} is not a Kaggle {what}; use lowercase letters, digits{extra} and "
                         "single dashes inside")
    if not low <= len(value) <= high:
        raise ValueError(f"{shown(value)} is {len(value)} characters; a Kaggle {what} has {low}-{high}")


class _Strict(BaseModel):
    # strict: a value is taken as the type written, never coerced (YAML's `yes` is no count, `1` and `-0.0`
    # are no switch, `"3"` is no number); _describe turns each refusal into the key and the fix.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class KaggleSpec(_Strict):
    owner: str | None = None
    accelerator: Literal["none", "gpu", "tpu"] = "gpu"
    internet: bool = False
    private: bool = True
    datasets: list[str] = Field(default_factory=list)
    # Kaggle Models (pretrained weights), each pinned: owner/model/framework/variation/version.
    models: list[str] = Field(default_factory=list)
    competition: str | None = None
    local: dict[str, str] = Field(default_factory=dict)
    # pin: every session runs on the image session 1 ran on (docker_image_pinning_type original, and
    # session 1's docker_image from session 2 on); latest: each session on Kaggle's newest image.
    image: Literal["pin", "latest"] = "pin"
    # How long a session waits for the state it resumes to be mounted: Kaggle has answered a version
    # "ready" minutes before a session saw it (once 138 s). Then it stops, and continue pushes it again.
    mount_wait: str | int | float = "5m"
    # Packages Kaggle's image lacks, each pinned (name==version): the laptop downloads their wheels for the
    # kernel's Python once, as the dataset <owner>/<name>-pip the kernel installs from with no index (kagglepip.py).
    pip: list[str] = Field(default_factory=list)

    @field_validator("pip")
    @classmethod
    def _pip(cls, value: list[str]) -> list[str]:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.utils import canonicalize_name

        seen: dict[str, str] = {}
        for pin in value:
            example = "write name==version, e.g. peft==0.17.1"
            try:
                req = Requirement(pin)
            except InvalidRequirement:
                raise ValueError(f"{shown(pin)} is not a pinned package; {example}") from None
            specs = list(req.specifier)
            if req.url or req.marker or req.extras:
                what = "a URL" if req.url else "a marker" if req.marker else "extras"
                raise ValueError(f"{shown(pin)}: {what} cannot be installed with no index; {example}, and list each "
                                 "package the image lacks the same way")
            if len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
                raise ValueError(f"{shown(pin)} is not pinned to one version: the kernel installs exactly what the "
                                 f"laptop built; {example}")
            name = canonicalize_name(req.name)
            if name in seen:
                raise ValueError(f"{shown(pin)}: {req.name} is already pinned as {shown(seen[name])}; keep one")
            seen[name] = pin
        return value

    @field_validator("mount_wait")
    @classmethod
    def _mount_wait(cls, value: str | int | float) -> str | int | float:
        try:
            seconds = _positive_duration(value)
        except (OverflowError, ValueError):
            raise ValueError(f"{shown(value)} is not a positive duration; write e.g. 5m or 90s") from None
        if seconds > MOUNT_WAIT_MAX_S:
            raise ValueError(f"{shown(value)} is over 1h: a session would wait that long on its GPU clock for a state "
                             "that Kaggle mounts within minutes; write e.g. 5m")
        return value

    @field_validator("owner")
    @classmethod
    def _owner(cls, value: str | None) -> str | None:
        if value is not None:
            _check_slug(value, "username", 1, OWNER_MAX, OWNER_RE)
        return value

    @field_validator("accelerator")
    @classmethod
    def _accelerator(cls, value: str) -> str:
        if value not in ACCELERATORS:
            raise ValueError("the runtime does not support TPUs yet; use gpu or none")
        return value

    @field_validator("datasets")
    @classmethod
    def _datasets(cls, value: list[str]) -> list[str]:
        for ref in value:
            parts = ref.split("/")
            if len(parts) not in (2, 3) or (len(parts) == 3 and not re.fullmatch(r"[1-9][0-9]{0,8}", parts[2])):
                raise ValueError(f"{shown(ref)} is not a dataset; write owner/slug or owner/slug/version")
            _check_slug(parts[0], "username", 1, OWNER_MAX, OWNER_RE)
            _check_slug(parts[1], "dataset slug", DATASET_SLUG_MIN, DATASET_SLUG_MAX)
        return value

    @field_validator("models")
    @classmethod
    def _models(cls, value: list[str]) -> list[str]:
        # The client's own check (validate_model_instance_version_string): five parts, an int version.
        for ref in value:
            parts = ref.split("/")
            if len(parts) != 5 or not all(parts):
                raise ValueError(f"{shown(ref)} is not a model version; write owner/model/framework/variation/"
                                 f"version, e.g. {MODEL_EXAMPLE}")
            owner, model, framework, variation, version = parts
            _check_slug(owner, "username", 1, OWNER_MAX, OWNER_RE)
            for slug, what in ((model, "model slug"), (variation, "model variation")):
                if not MODEL_SLUG_RE.fullmatch(slug) or len(slug) > MODEL_SLUG_MAX:
                    raise ValueError(f"{shown(slug)} is not a Kaggle {what}; copy it from the model's page, e.g. "
                                     f"{MODEL_EXAMPLE}")
            if layout.model_framework_key(framework) not in layout.MODEL_FRAMEWORKS:
                close = difflib.get_close_matches(framework.lower(), layout.MODEL_FRAMEWORKS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(layout.MODEL_FRAMEWORKS)}"
                raise ValueError(f"{shown(framework)} is not a Kaggle model framework; {hint}")
            if not re.fullmatch(r"[1-9][0-9]{0,8}", version):
                raise ValueError(f"{shown(ref)}: the version {shown(version)} is not a number; pin one, e.g. "
                                 f"{MODEL_EXAMPLE}")
        return value

    @field_validator("competition")
    @classmethod
    def _competition(cls, value: str | None) -> str | None:
        if value is not None:
            _check_slug(value, "competition slug", 1, COMPETITION_MAX)
        return value

    @field_validator("local")
    @classmethod
    def _local(cls, value: dict[str, str]) -> dict[str, str]:
        for slug, folder in value.items():
            if "\x00" in folder or not folder.strip() or len(folder) > MAX_PATH_CHARS:
                raise ValueError(f"{slug}: {shown(folder)} is not a folder path; write e.g. data/small-copy")
        return value


def _positive_duration(value: str | int | float, allow_zero_text: bool = False) -> float:
    """Seconds of a duration field; a bare number is seconds and must be positive."""
    seconds = parse_duration(value)
    if not math.isfinite(seconds):
        raise ValueError(value)
    if seconds < 0 or (seconds == 0 and not (allow_zero_text and isinstance(value, str))):
        raise OverflowError(value)  # in range for the parser, out of range for the field
    return seconds


class KeepBestSpec(_Strict):
    """`train.keep_best: {metric: val_acc, mode: max}`: the metric whose best checkpoint is kept."""

    metric: str
    mode: Literal["min", "max"] | None = None  # None: by the name (a loss, an error: min; else max)

    @field_validator("metric")
    @classmethod
    def _metric(cls, value: str) -> str:
        return _metric_name(value)


def _metric_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]{0,99}", value):
        raise ValueError(f"{shown(value)} is not a metric name; write the name run.log uses, e.g. val_loss, or off")
    return value


class TrackersSpec(_Strict):
    # Each on: the experiment tracker sees the chain as one run (common/trackers.py, docs/runtime.md).
    tensorboard: bool = False  # every run.log value mirrored into run.tensorboard_dir; TENSORBOARD_LOGGING_DIR set
    wandb: bool = False  # WANDB_RUN_ID=run.id and WANDB_RESUME=allow in the training process
    # MLflow's file store carried in the state (MLFLOW_TRACKING_URI, MLFLOW_ALLOW_FILE_STORE) and MLFLOW_RUN_ID:
    # the MLflow run the code had active at the last checkpoint
    mlflow: bool = False

    def on(self) -> tuple[str, ...]:
        return tuple(kind for kind in trackers.KINDS if getattr(self, kind))


class TrainSpec(_Strict):
    # The defaults live with the runtime's parsers (kchain/common/settings.py): one meaning each.
    checkpoint_every: str | int | float = settings.CHECKPOINT_EVERY
    keep: int = Field(default=settings.KEEP, ge=1, le=20)
    session_limit: str | int | float = settings.SESSION_LIMIT
    margin: str | int | float = settings.MARGIN
    heartbeat: str | int | float = settings.HEARTBEAT
    precision: Literal["auto", "fp32", "bf16", "fp16"] = settings.PRECISION
    # Ranks (one per GPU) under torchrun; auto: every visible GPU. 2 on the CPU: 2 gloo ranks.
    gpus: Literal["auto", 1, 2] = "auto"

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        if isinstance(value, bool):  # a Literal takes True for 1, strict or not
            raise ValueError(f"{str(value).lower()} is not a GPU count; write auto, 1 or 2")
        return value

    # auto: on out-of-memory at the first step, halve run.loader's batch and double run.optimize's
    # accumulation (the effective batch stays the same); the size that fitted is in the checkpoint.
    micro_batch: Literal["auto", "off"] = "off"
    # true: every checkpoint holds the frozen parameters too (by default a fine-tune's frozen base is
    # left out and fingerprinted in the manifest: runtime/checkpoint/frozen.py).
    checkpoint_frozen: bool = False
    # The checkpoint of the best step kept beside the `keep` newest (common/keepbest.py): by default
    # the metric run.best follows (the first val* metric logged); a metric name, {metric, mode}, or off.
    keep_best: str | KeepBestSpec | None = None

    @field_validator("keep_best", mode="before")
    @classmethod
    def _keep_best(cls, value: Any) -> str | KeepBestSpec | None:
        if value is None or value is True or isinstance(value, KeepBestSpec):
            return None if value is True else value
        if value is False or isinstance(value, str):  # YAML reads a bare off as false
            value = "off" if value is False else value
            return value if value == "off" else _metric_name(value)
        if isinstance(value, dict):
            try:
                return KeepBestSpec.model_validate(value)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
        raise ValueError(f"{shown(value)}: write a metric name (keep_best: val_loss), {{metric: val_acc, mode: max}} "
                         "or off")

    # {tensorboard: true, wandb: true, mlflow: true}: the trackers' own resume variables and the run.log mirror.
    trackers: TrackersSpec = Field(default_factory=TrackersSpec)

    @field_validator("checkpoint_every")
    @classmethod
    def _cadence(cls, value: str | int | float) -> str | int | float:
        try:
            cadence = parse_cadence(value)
        except ValueError:
            raise ValueError(f"{shown(value)} is not a duration; write e.g. 10m or 500 steps") from None
        amount = min(cadence.values())
        if not math.isfinite(amount) or amount <= 0:
            raise ValueError(f"{shown(value)} must be positive; write e.g. 10m or 500 steps")
        return value

    @field_validator("session_limit", "margin", "heartbeat")
    @classmethod
    def _duration(cls, value: str | int | float, info: Any) -> str | int | float:
        heartbeat = info.field_name == "heartbeat"
        try:
            _positive_duration(value, allow_zero_text=heartbeat)
        except OverflowError:
            zero = " (or '0s' for a heartbeat every step)" if heartbeat else ""
            raise ValueError(f"{shown(value)} must be positive; write e.g. 90s, 10m or 12h{zero}") from None
        except ValueError:
            raise ValueError(f"{shown(value)} is not a duration; write e.g. 90s, 10m or 12h") from None
        return value

    @property
    def session_limit_s(self) -> float:
        """train.session_limit in seconds: the one parse of it on the laptop."""
        return parse_duration(self.session_limit)

    @property
    def margin_s(self) -> float:
        return parse_duration(self.margin)

    @model_validator(mode="after")
    def _margin_fits(self) -> TrainSpec:
        if self.margin_s >= self.session_limit_s:
            raise ValueError("margin must be shorter than session_limit")
        if self.session_limit_s > 12 * 3600:
            raise ValueError("session_limit is over Kaggle's 12h cap; write 12h or less")
        return self


class SmokeSpec(_Strict):
    fraction: float = Field(default=settings.SMOKE_FRACTION, gt=0, le=1)
    steps: int = Field(default=settings.SMOKE_STEPS, ge=1, le=50)
    # Params the smoke runs with instead of the job's (a smaller model, a short evaluation); the
    # notebook is the same, the runtime applies them only under `kchain smoke`.
    params: dict[str, Any] = Field(default_factory=dict)


class BudgetSpec(_Strict):
    weekly_gpu_hours: float = Field(default=30.0, gt=0, le=168)
    # GPU-hours `kchain plan` holds back from the week for the mistake not yet made (never planned into);
    # None: one session's worth (train.session_limit).
    slack: float | None = Field(default=None, ge=0, le=168)


class Job(_Strict):
    name: str
    code: str
    entry: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    kaggle: KaggleSpec = Field(default_factory=KaggleSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    smoke: SmokeSpec = Field(default_factory=SmokeSpec)
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    # Where `kchain push` runs the job: Kaggle (the default), SkyPilot managed jobs or a Slurm cluster;
    # each other target reads its own section (kchain/job/spec_targets.py, docs/targets.md).
    target: Literal["kaggle", "skypilot", "slurm"] = "kaggle"
    skypilot: SkyPilotSpec = Field(default_factory=SkyPilotSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    # Where the job file lives; set by load_job, not by the YAML.
    path: Path = Field(default=Path("job.yaml"), exclude=True)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not SLUG_RE.fullmatch(value):
            raise ValueError(f"{shown(value)} is not a kernel slug; use {NAME_MIN}-{NAME_MAX} lowercase letters, "
                             "digits and single dashes inside")
        if not NAME_MIN <= len(value) <= NAME_MAX:
            raise ValueError(
                f"{shown(value)} is {len(value)} characters; use {NAME_MIN}-{NAME_MAX}, so that <name>-state and "
                "<name>-cache fit Kaggle's 6-50 character dataset slugs"
            )
        return value

    @field_validator("code")
    @classmethod
    def _code(cls, value: str) -> str:
        if "\x00" in value or not value.strip():
            raise ValueError(f"{shown(value)} is not a path; write the file or folder of your code, e.g. train.py "
                             "or train.ipynb")
        if len(value) > MAX_PATH_CHARS or any(len(part.encode("utf-8", "replace")) > 255 for part in value.split("/")):
            raise ValueError(f"{shown(value)} is too long for a path; write the file or folder of your code, "
                             "e.g. train.py")
        if Path(value).is_absolute():
            raise ValueError(f"{shown(value)} is an absolute path; write it relative to the job file, e.g. train.py")
        return value

    @field_validator("entry")
    @classmethod
    def _entry(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, sep, function = value.partition(":")
        if (not sep or len(value) > 200 or not function.isidentifier()
                or not all(part.isidentifier() for part in module.split("."))):
            raise ValueError(f"{shown(value)} is not an entry point; write module:function, e.g. train:main")
        return value

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def code_path(self) -> Path:
        return (self.root / self.code).resolve()

    @property
    def entry_point(self) -> str:
        if self.entry:
            return self.entry
        # A folder of code is unpacked as it is, so its train.py (or train.ipynb) is the module to start from.
        return "train:main" if self.code_path.is_dir() else f"{Path(self.code).stem}:main"

    @property
    def entry_sources(self) -> list[Path]:
        """The files the entry module can come from that exist: <module>.py, <module>/__init__.py, and
        <module>.ipynb, a notebook whose code cells render makes the module (kchain/job/notebook_code.py)."""
        module = self.entry_point.split(":")[0]
        base = self.code_path if self.code_path.is_dir() else self.code_path.parent
        rel = Path(*module.split("."))
        candidates = (base / rel.with_suffix(".py"), base / rel / "__init__.py", base / rel.with_suffix(".ipynb"))
        found = [c for c in candidates if c.is_file()]
        return [c for c in found if c == self.code_path] if self.code_path.is_file() else found

    @property
    def entry_notebook(self) -> Path | None:
        """The notebook that becomes the entry module, when the entry comes from one."""
        sources = self.entry_sources
        return sources[0] if len(sources) == 1 and sources[0].suffix == ".ipynb" else None

    @property
    def entry_script(self) -> Path | None:
        """The entry .py file when it trains at module level (no main(run), `run` used in its body, no
        entry: named): render makes it a module whose main(run) runs the file (notebook_code.script_module)."""
        sources = self.entry_sources
        if self.entry or len(sources) != 1 or sources[0].suffix != ".py":
            return None
        from kchain.job import notebook_code

        try:
            tree = notebook_code.parse_python(decode_text(sources[0].read_bytes()))
        except (OSError, ValueError, SyntaxError, RecursionError, MemoryError):
            return None
        return sources[0] if notebook_code.runs_at_module_level(tree, self.entry_point.split(":")[1]) else None

    @property
    def gpu(self) -> bool:
        return self.kaggle.accelerator == "gpu"


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _JobLoader(yaml.SafeLoader):
    """safe_load with limits: nesting depth while composing, a key given twice refused (YAML would
    silently keep the last one), a list or map used as a key refused, and dates kept as strings."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested over {MAX_DEPTH} levels deep; keep the job file flatter",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a list or map is used as a key; keys are plain names", key_node.start_mark
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {shown(key)} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _SetLoader(_JobLoader):
    """A --set value: as a job file's, and 1e-3 or 1e400 a number, as YAML 1.2 and every shell user reads it
    (YAML 1.1 wants a dot and a signed exponent: 1.0e-3), so that an overflow is refused, not passed on as text."""


_SetLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))


def _measure(root: yaml.Node) -> None:
    """Refuse a recursive alias or one whose expansion is too big or too deep, before anything is
    built from the nodes. Iterative and memoized: a billion-laughs file costs what its nodes cost."""
    done: dict[int, tuple[int, int]] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if finished:
            size = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            size += sum(done[id(c)][0] for c in children)
            depth = 1 + max((done[id(c)][1] for c in children), default=0)
            active.discard(id(node))
            done[id(node)] = (size, depth)
            if size > MAX_EXPANDED:
                raise _LimitError(node, f"its aliases expand to over {MAX_EXPANDED:,} values and characters; "
                                        "write the values out instead of nesting aliases")
            if depth > MAX_DEPTH:
                raise _LimitError(node, f"its aliases nest over {MAX_DEPTH} levels deep; keep the job file flatter")
            continue
        if id(node) in done:
            continue
        active.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in active:
                raise _LimitError(child, "an alias refers to a value that holds it; remove the recursive alias")
            if id(child) not in done:
                stack.append((child, False))


class _LimitError(Exception):
    def __init__(self, node: yaml.Node, problem: str) -> None:
        super().__init__(problem)
        self.line = node.start_mark.line + 1
        self.problem = problem


def _json_problem(value: Any, loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """The first value that is not plain JSON (what the notebook embeds), with its key path."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, loc)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    return where + (key,), f"the key {shown(key)} is not text; quote it"
                stack.append((key, where + (key,)))
                stack.append((sub, where + (key,)))
        elif isinstance(item, list):
            stack.extend((sub, where + (i,)) for i, sub in enumerate(item))
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where, f"{shown(item)} holds a lone surrogate; remove the \\u escape"
        elif isinstance(item, float) and not math.isfinite(item):
            return where, f"{shown(item)} is not a JSON number; write a finite number or quote it"
        elif isinstance(item, (datetime.date, datetime.datetime)):
            return where, f"the date {shown(str(item))} is not JSON; quote it"
        elif isinstance(item, (bytes, bytearray)):
            return where, "binary data (!!binary) is not JSON; put the data in a file or a dataset"
        elif isinstance(item, (set, frozenset)):
            return where, "a set (!!set) is not JSON; write a list"
        elif item is not None and not isinstance(item, (bool, int, float)):
            return where, f"a {type(item).__name__} is not JSON; write a number, text, list or map"
    return None


def _parse_yaml(text: str, loader_class: type[_JobLoader] = _JobLoader) -> Any:
    """YAML text -> plain data with the job file's limits. Raises yaml.YAMLError or _LimitError."""
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_error(label: str, exc: yaml.YAMLError) -> SpecError:
    if isinstance(exc, yaml.reader.ReaderError):
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        return SpecError(f"{label}: character {shown(char)} at position {exc.position} is not allowed in YAML; "
                         "remove it")
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or "invalid YAML").split())
    fix = "" if "; " in problem else "; fix the YAML syntax"  # our own problems carry their fix
    return SpecError(f"{label}: {where}{problem[:200]}{fix}")


def _read_text_file(path: Path, label: str, max_bytes: int = MAX_JOB_BYTES) -> str:
    """A UTF-8 text file (a BOM is allowed) with a size cap; anything else is one SpecError line."""
    try:
        if not path.is_file():
            if path.is_dir():
                raise SpecError(f"{label}: is a folder; pass the path of your job.yaml")
            if not path.exists():
                raise SpecError(f"{label}: no such job file; pass the path of your job.yaml")
            raise SpecError(f"{label}: not a regular file; pass the path of your job.yaml")
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise SpecError(f"{label}: cannot read it ({exc.strerror or exc}); check the path and its permissions") from None
    if len(data) > max_bytes:
        raise SpecError(f"{label}: over {max_bytes // 1024} KB; a job file is a few lines of YAML")
    try:
        return decode_text(data)
    except ValueError as exc:
        raise SpecError(f"{label}: {exc}; save it as UTF-8") from None


def decode_text(data: bytes) -> str:
    """UTF-8 (a BOM is allowed); anything else is a ValueError that says what the bytes look like."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError("is UTF-16 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if b"\x00" in data:
            raise ValueError("is not text (it holds NUL bytes)") from None
        raise ValueError(f"is not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start}; Latin-1?)") from None


# A str | int | float field's member names, which pydantic adds to the key of each member's error.
SCALAR_TAGS = ("str", "int", "float")


def _field_at(loc: tuple[Any, ...]) -> Any:
    """The pydantic field that loc names in a Job (through optional sections), or None."""
    current: Any = Job
    field = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not fields or not isinstance(part, str) or part not in fields:
            return None
        field = fields[part]
        members = get_args(field.annotation) or (field.annotation,)
        current = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
    return field


def _annotation_at(loc: tuple[Any, ...]) -> Any:
    """The annotation of the field that loc names in a Job (through optional sections), or None."""
    field = _field_at(loc)
    return None if field is None else field.annotation


# A strict field's refusal of a value of another type (YAML's yes for a count, 1 for a switch): what it
# is not, and what to write, with the field's default as the example when it has one of that type.
STRICT_TYPES = {"bool_type": ("true or false", bool, "true or false"),
                "int_type": ("a whole number", int, "one without quotes"),
                "float_type": ("a number", float, "one without quotes"),
                "string_type": ("text", str, "text in quotes")}


def _strict_refusal(error: Mapping[str, Any], key: str) -> str:
    what, kind, fix = STRICT_TYPES[error["type"]]
    loc = tuple(error["loc"])
    field = _field_at(loc)
    default = getattr(field, "default", None)
    if isinstance(default, kind) and (kind is not int or not isinstance(default, bool)) and default != "":
        shown_default = str(default).lower() if isinstance(default, bool) else default
        fix = f"{fix}, e.g. {_key_name(loc[-1])}: {shown_default}"
    return f"{key}: {_shown_input(error.get('input'))} is not {what}; write {fix}"


def _shown_input(value: Any) -> str:
    """A value as the user wrote it: YAML's yes, on and true are all true."""
    return str(value).lower() if isinstance(value, bool) else shown(value)


def _plain_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """pydantic's errors with a str | int | float field's three member errors (`mount_wait.str ... .int ...
    .float`) as one error of the field, `scalar_union`: the user wrote neither text nor a number."""
    out, seen = [], set()
    for error in errors:
        loc = tuple(error["loc"])
        if len(loc) > 1 and loc[-1] in SCALAR_TAGS and set(get_args(_annotation_at(loc[:-1]))) >= {str, int, float}:
            if loc[:-1] in seen:
                continue
            seen.add(loc[:-1])
            error = {**error, "loc": loc[:-1], "type": "scalar_union"}
        out.append(error)
    return out


def _describe(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    key = _key_path(loc)
    if error["type"] == "scalar_union":
        example = {"checkpoint_every": "10m or 500 steps", "mount_wait": "5m or 90s"}.get(loc[-1], "90s, 10m or 12h")
        return f"{key}: {_shown_input(error.get('input'))} is not a duration; write e.g. {example}"
    if error["type"] in STRICT_TYPES:
        return _strict_refusal(error, key)
    if error["type"] in ("model_type", "dict_type"):
        return f"{key}: {shown(error.get('input'))} is not a mapping; write its keys indented under {_key_name(loc[-1])}:"
    if error["type"] == "extra_forbidden":
        allowed = _fields_at(Job, loc[:-1])
        last = str(loc[-1])
        close = difflib.get_close_matches(last, allowed, n=1) if len(last) <= MAX_SHOWN else []
        hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
        return f"{key}: unknown key; {hint}"
    if error["type"] == "missing":
        return f"{key}: required; add it"
    msg = " ".join(str(error["msg"]).removeprefix("Value error, ").split())
    if error["type"] in ("literal_error",):
        msg = f"{shown(error.get('input'))} is not allowed; {msg.lower()}"
    return f"{key}: {msg[:300]}"


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The allowed keys of the model reached by following loc (for 'did you mean')."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            current = annotation
        else:
            return []
    return [name for name in current.model_fields if name != "path"]


def load_job(path: str | Path) -> Job:
    """Read and validate a job file; every problem is one SpecError line."""
    path = Path(path)
    try:
        if path.is_dir() and (path / "job.yaml").exists():
            path = path / "job.yaml"
    except OSError:
        pass  # _read_text_file names the problem
    label = str(path) if str(path).isprintable() else repr(str(path))  # the error stays one line
    text = _read_text_file(path, label)
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(label, exc) from None
    except _LimitError as exc:
        raise SpecError(f"{label}: line {exc.line}: {exc.problem}") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of thousands of digits
        raise SpecError(f"{label}: a value cannot be read ({str(exc)[:80]}); fix it") from None
    if data is None:
        raise SpecError(f"{label}: is empty; write at least name: and code: (see the README)")
    if not isinstance(data, dict):
        raise SpecError(f"{label}: expected a mapping of keys (name, code, params, ...)")
    if "path" in data:
        raise SpecError(f"{label}: path: unknown key; remove it")
    problem = _json_problem(data, ())
    if problem is not None:
        raise SpecError(f"{label}: {_key_path(problem[0])}: {problem[1]}")
    try:
        job = Job.model_validate({**data, "path": path.resolve()})
    except ValidationError as exc:
        errors = _plain_errors(exc.errors())
        problems = [_describe(e) for e in errors[:5]]
        more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
        raise SpecError(f"{label}: " + "; ".join(problems) + more) from None
    _check_code_path(job, label)
    _check_entry(job, label)
    unfit = target_problem(job, job.target)
    if unfit:
        raise SpecError(f"{label}: {unfit}")
    for slug in job.kaggle.local:
        known = {ref.split("/")[1] for ref in job.kaggle.datasets}
        # A model's stand-in is named by its slug, or by its full ref when two attached versions share it.
        known |= {ref.split("/")[1] for ref in job.kaggle.models} | set(job.kaggle.models)
        if job.kaggle.competition:
            known.add(job.kaggle.competition)
        if slug not in known and slug in {"/".join(ref.split("/")[:2]) for ref in job.kaggle.datasets}:
            raise SpecError(f"{label}: kaggle.local.{_key_path((slug,))}: name the local copy by the dataset's slug alone, "
                            f"{slug.split('/')[1]}: ({slug} is in kaggle.datasets already)")
        if slug not in known:
            raise SpecError(
                f"{label}: kaggle.local.{_key_path((slug,))}: not an attached dataset or model; add it to "
                "kaggle.datasets or kaggle.models, or remove it"
            )
    return job


def _check_code_path(job: Job, label: str) -> None:
    """The code is inside the job's folder: a `..` or a symlink out of it would upload other files."""
    root = job.root.resolve()
    try:
        code = job.code_path
        exists = code.exists()
    except (OSError, RuntimeError):  # a symlink loop, a name the file system refuses
        raise SpecError(f"{label}: code: {shown(job.code)} cannot be resolved; fix the path") from None
    if code != root and not code.is_relative_to(root):
        raise SpecError(
            f"{label}: code: {shown(job.code)} resolves to {code}, outside the job's folder; "
            "move the code next to the job file"
        )
    if not exists:
        raise SpecError(f"{label}: code: {shown(job.code)} does not exist next to the job file; fix the path")


def _check_entry(job: Job, label: str) -> None:
    """The entry module is in the code and defines the function: a typo fails here, not on a GPU."""
    module, function = job.entry_point.split(":")
    sources = job.entry_sources
    key = "entry" if job.entry else "code"
    if not sources:
        raise SpecError(
            f"{label}: {key}: module {shown(module)} is not in the code {shown(job.code)}; "
            "write entry: <module>:<function> naming a .py file or a notebook of the code"
        )
    if any(c.suffix == ".ipynb" for c in sources):
        _check_notebook(job, label, key, sources, function)
        return
    source = sources[0]
    try:
        text = decode_text(source.read_bytes())
    except ValueError as exc:
        raise SpecError(f"{label}: {key}: {source.name} {exc}; save it as UTF-8 Python source") from None
    try:
        tree = parse_python(text, str(source))
    except SyntaxError as exc:
        raise SpecError(f"{source}: line {exc.lineno}: {exc.msg}; fix the syntax") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise SpecError(f"{label}: {key}: {source.name} cannot be parsed as Python ({str(exc)[:80]}); "
                        "fix the file") from None
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    from kchain.job import notebook_code

    if function not in names and not job.entry and notebook_code.runs_at_module_level(tree, function):
        try:  # a script that trains at module level: rendered as a one-cell notebook (entry_script)
            notebook_code.script_module(text, notebook_name(job, source))
        except notebook_code.NotebookError as exc:
            raise SpecError(f"{label}: {key}: {exc}") from None
        return
    if function not in names:
        raise SpecError(
            f"{label}: {key}: {source.name} defines no function {shown(function)}; "
            f"add `def {function}(run):` or set entry: {module}:<your function>"
        )


def target_problem(job: Job, target: str) -> str | None:
    """What the job's section for `target` lacks to be rendered (key and fix), or None."""
    if target == "skypilot" and job.skypilot.bucket is None:
        return ("skypilot.bucket: required for target skypilot (the checkpoints must outlive the machine); "
                "add e.g. bucket: {name: my-kchain-state, store: s3}")
    if target == "slurm" and job.slurm.state_dir is None:
        return ("slurm.state_dir: required for target slurm (a requeued job may start on another node); "
                "add a folder on the shared file system, e.g. state_dir: /scratch/me/kchain-state")
    return None


def notebook_name(job: Job, notebook: Path) -> str:
    """How messages and tracebacks name a notebook of the code: its path from the job's folder."""
    return notebook.relative_to(job.root.resolve()).as_posix()


def _check_notebook(job: Job, label: str, key: str, sources: list[Path], function: str) -> None:
    """The entry notebook converts (kchain/job/notebook_code.py: magics, syntax, main(run) or the cells)."""
    from kchain.job import notebook_code

    notebook = sources[-1]
    if len(sources) > 1:
        raise SpecError(f"{label}: {key}: the code has both {notebook_name(job, sources[0])} and "
                        f"{notebook_name(job, notebook)} for the entry module; delete or rename one")
    try:
        notebook_code.to_module(notebook.read_bytes(), notebook_name(job, notebook), function, bool(job.entry))
    except OSError as exc:
        raise SpecError(f"{label}: {key}: {notebook.name} cannot be read ({exc.strerror}); fix it") from None
    except notebook_code.NotebookError as exc:
        raise SpecError(f"{label}: {key}: {exc}") from None


def parse_overrides(values: tuple[str, ...] | list[str], label: str = "--set") -> dict[str, Any]:
    """--set steps=300 --set lr=1e-3 -> {'steps': 300, 'lr': 0.001}: each value read as one YAML
    value, with the job file's limits, and it must be plain JSON like every param."""
    out: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key.strip() or not key.isprintable() or len(key) > MAX_SHOWN:
            raise SpecError(f"{label} {shown(value)}: write it as name=value, e.g. {label} steps=300")
        try:
            parsed = _parse_yaml(raw, _SetLoader)
        except (yaml.YAMLError, _LimitError, ValueError, OverflowError):
            raise SpecError(f"{label} {shown(value)}: the value is not one YAML value; quote it, e.g. "
                            f"{label} '{key}=\"...\"'") from None
        if isinstance(parsed, float) and not math.isfinite(parsed):
            what = "is too large for a number" if math.isinf(parsed) and "inf" not in raw.lower() else "is not a finite number"
            raise SpecError(f"{label} {shown(value)}: {raw.strip()[:20]} {what} (it reads as {parsed}); write a finite "
                            f"number, or quote it for text: {label} '{key}=\"{raw.strip()[:20]}\"'")
        problem = _json_problem(parsed, ("params", key))
        if problem is not None:
            raise SpecError(f"{label} {shown(value)}: {problem[1]}")
        out[key] = parsed
    return out


def runtime_config(job: Job) -> RuntimeConfig:
    """The part of the job the kernel's runtime needs (embedded in the notebook; render.py adds
    who runs it, where its state goes and the fingerprint)."""
    return RuntimeConfig(
        job=job.name,
        entry=job.entry_point,
        params=job.params,
        train=TrainConfig(
            checkpoint_every=parse_cadence(job.train.checkpoint_every),
            keep=job.train.keep,
            session_limit_s=job.train.session_limit_s,
            margin_s=job.train.margin_s,
            heartbeat_s=parse_duration(job.train.heartbeat),
            precision=job.train.precision,
            gpus=job.train.gpus,
            micro_batch=job.train.micro_batch,
            checkpoint_frozen=job.train.checkpoint_frozen,
            keep_best=job.train.keep_best.model_dump(exclude_none=True)
            if isinstance(job.train.keep_best, KeepBestSpec) else job.train.keep_best,
            trackers=job.train.trackers.on(),
        ),
        smoke=SmokeConfig(fraction=job.smoke.fraction, steps=job.smoke.steps, params=job.smoke.params or {}),
        pip=tuple(job.kaggle.pip),
    )
