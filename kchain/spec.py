"""The job spec: job.yaml, validated strictly, loaded through one function.

`load_job(path)` is the only way in. Any YAML or validation problem becomes one SpecError line that
names the file, each bad key path, and the fix (with "did you mean" for typos).
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kchain.errors import SpecError
from kchain.runtime import settings
from kchain.runtime.settings import parse_cadence, parse_duration

__all__ = ["Job", "SpecError", "load_job", "parse_cadence", "parse_duration", "runtime_config"]

SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{3,48})[a-z0-9]$")
DATASET_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:/[0-9]+)?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KaggleSpec(_Strict):
    owner: str | None = None
    accelerator: Literal["none", "gpu", "tpu"] = "gpu"
    internet: bool = False
    private: bool = True
    datasets: list[str] = Field(default_factory=list)
    competition: str | None = None
    local: dict[str, str] = Field(default_factory=dict)

    @field_validator("datasets")
    @classmethod
    def _datasets(cls, value: list[str]) -> list[str]:
        for ref in value:
            if not DATASET_RE.match(ref):
                raise ValueError(f"{ref!r} is not a dataset; write owner/slug or owner/slug/version")
        return value


class TrainSpec(_Strict):
    # The defaults live with the runtime's parsers (kchain/runtime/settings.py): one meaning each.
    checkpoint_every: str | int = settings.CHECKPOINT_EVERY
    keep: int = Field(default=settings.KEEP, ge=1, le=20)
    session_limit: str | int = settings.SESSION_LIMIT
    margin: str | int = settings.MARGIN
    heartbeat: str | int = settings.HEARTBEAT
    precision: Literal["auto", "fp32", "bf16", "fp16"] = settings.PRECISION
    # Ranks (one per GPU) under torchrun; auto: every visible GPU. 2 on the CPU: 2 gloo ranks.
    gpus: Literal["auto", 1, 2] = "auto"
    # auto: on out-of-memory at the first step, halve run.loader's batch and double run.optimize's
    # accumulation (the effective batch stays the same); the size that fitted is in the checkpoint.
    micro_batch: Literal["auto", "off"] = "off"

    @field_validator("checkpoint_every")
    @classmethod
    def _cadence(cls, value: str | int) -> str | int:
        try:
            cadence = parse_cadence(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration; write e.g. 10m or 500 steps") from None
        if min(cadence.values()) <= 0:
            raise ValueError(f"{value!r} must be positive; write e.g. 10m or 500 steps")
        return value

    @field_validator("session_limit", "margin", "heartbeat")
    @classmethod
    def _duration(cls, value: str | int) -> str | int:
        try:
            parse_duration(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 10m or 12h") from None
        return value

    @model_validator(mode="after")
    def _margin_fits(self) -> TrainSpec:
        if parse_duration(self.margin) >= parse_duration(self.session_limit):
            raise ValueError("margin must be shorter than session_limit")
        if parse_duration(self.session_limit) > 12 * 3600:
            raise ValueError("session_limit is over Kaggle's 12h cap; write 12h or less")
        return self


class SmokeSpec(_Strict):
    fraction: float = Field(default=settings.SMOKE_FRACTION, gt=0, le=1)
    steps: int = Field(default=settings.SMOKE_STEPS, ge=1, le=50)


class BudgetSpec(_Strict):
    weekly_gpu_hours: float = Field(default=30.0, gt=0, le=168)


class Job(_Strict):
    name: str
    code: str
    entry: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    kaggle: KaggleSpec = Field(default_factory=KaggleSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    smoke: SmokeSpec = Field(default_factory=SmokeSpec)
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    # Where the job file lives; set by load_job, not by the YAML.
    path: Path = Field(default=Path("job.yaml"), exclude=True)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not SLUG_RE.match(value):
            raise ValueError(f"{value!r} is not a kernel slug; use 5-50 lowercase letters, digits and dashes")
        return value

    @field_validator("entry")
    @classmethod
    def _entry(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
            raise ValueError(f"{value!r} is not an entry point; write module:function, e.g. train:main")
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
        # A folder of code is unpacked as it is, so its train.py is the module to start from.
        return "train:main" if self.code_path.is_dir() else f"{Path(self.code).stem}:main"

    @property
    def gpu(self) -> bool:
        return self.kaggle.accelerator == "gpu"


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice (YAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        allowed = _fields_at(Job, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
        return f"{key}: unknown key; {hint}"
    if error["type"] == "missing":
        return f"{key}: required; add it"
    msg = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] in ("literal_error",):
        msg = f"{error.get('input')!r} is not allowed; {msg.lower()}"
    return f"{key}: {msg}"


def load_job(path: str | Path) -> Job:
    """Read and validate a job file; every problem is one SpecError line."""
    path = Path(path)
    if path.is_dir():
        path = path / "job.yaml"
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{label}: no such job file; pass the path of your job.yaml") from None
    except OSError as exc:
        raise SpecError(f"{label}: cannot read it ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        fix = "" if "; " in problem else "; fix the YAML syntax"  # our own problems carry their fix
        raise SpecError(f"{label}: {where}{problem}{fix}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{label}: expected a mapping of keys (name, code, params, ...)")
    if "path" in data:
        raise SpecError(f"{label}: path: unknown key; remove it")
    try:
        job = Job.model_validate({**data, "path": path.resolve()})
    except ValidationError as exc:
        problems = [_describe(e) for e in exc.errors()]
        raise SpecError(f"{label}: " + "; ".join(problems)) from None
    if not job.code_path.exists():
        raise SpecError(f"{label}: code: {job.code!r} does not exist next to the job file; fix the path")
    _check_entry(job, label)
    for slug in job.kaggle.local:
        known = {ref.split("/")[1] for ref in job.kaggle.datasets}
        if job.kaggle.competition:
            known.add(job.kaggle.competition)
        if slug not in known:
            raise SpecError(
                f"{label}: kaggle.local.{slug}: not an attached dataset; add it to kaggle.datasets or remove it"
            )
    return job


def _check_entry(job: Job, label: str) -> None:
    """The entry module is in the code and defines the function: a typo fails here, not on a GPU."""
    module, function = job.entry_point.split(":")
    base = job.code_path if job.code_path.is_dir() else job.code_path.parent
    rel = Path(*module.split("."))
    candidates = [base / rel.with_suffix(".py"), base / rel / "__init__.py"]
    if job.code_path.is_file():
        candidates = [c for c in candidates if c == job.code_path]
    source = next((c for c in candidates if c.is_file()), None)
    key = "entry" if job.entry else "code"
    if source is None:
        raise SpecError(
            f"{label}: {key}: module {module!r} is not in the code {job.code!r}; "
            "write entry: <module>:<function> naming a .py file of the code"
        )
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except SyntaxError as exc:
        raise SpecError(f"{source}: line {exc.lineno}: {exc.msg}; fix the syntax") from None
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if function not in names:
        raise SpecError(
            f"{label}: {key}: {source.name} defines no function {function!r}; "
            f"add `def {function}(run):` or set entry: {module}:<your function>"
        )


def runtime_config(job: Job) -> dict[str, Any]:
    """The part of the job the kernel's runtime needs (embedded in the notebook)."""
    return {
        "job": job.name,
        "entry": job.entry_point,
        "params": job.params,
        "train": {
            "checkpoint_every": parse_cadence(job.train.checkpoint_every),
            "keep": job.train.keep,
            "session_limit_s": parse_duration(job.train.session_limit),
            "margin_s": parse_duration(job.train.margin),
            "heartbeat_s": parse_duration(job.train.heartbeat),
            "precision": job.train.precision,
            "gpus": job.train.gpus,
            "micro_batch": job.train.micro_batch,
        },
        "smoke": {"fraction": job.smoke.fraction, "steps": job.smoke.steps},
    }
