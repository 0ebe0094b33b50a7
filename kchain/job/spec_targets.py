"""The job file's `skypilot:` and `slurm:` sections (pydantic, strict like the rest of the spec).

Standard pydantic only: spec.py imports these models, and nothing here imports SkyPilot. Bucket
names get a first syntax check here (the rules S3, GCS and R2 share); SkyPilot's own store
validators check them again before a push (`skypilot.check_task`) and in CI.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kchain.common.settings import parse_duration

# Lowercase letters, digits, dots and dashes, 3-63 characters, a letter or digit at each end: what
# S3, GCS and R2 all accept (SkyPilot's S3Store/GcsStore.validate_name check the rest).
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# A Slurm partition, account or accelerator name: no spaces, quotes or shell characters.
SLURM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
ACCELERATOR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(:[1-9][0-9]{0,2})?")
# The shared state folder goes into the script as it is: an absolute path with no shell characters.
STATE_DIR_RE = re.compile(r"/[A-Za-z0-9_.+/-]*")
MAX_SETUP = 4000  # characters of a setup script: a few commands, not a program


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # as spec.py's: no value coerced


class BucketSpec(_Section):
    # The bucket SkyPilot mounts at STATE_MOUNT on every node; each verified checkpoint is published
    # under <mount>/<job name>/ (runtime's state sink), so several jobs can share one bucket.
    name: str
    store: Literal["s3", "gcs", "r2", "azure", "ibm", "oci", "nebius", "coreweave"] = "s3"
    # MOUNT: writes reach the bucket when a file is closed; MOUNT_CACHED: later, in the background
    # (the runtime's publish then says "published" before the bucket has it; docs/targets.md).
    mode: Literal["MOUNT", "MOUNT_CACHED"] = "MOUNT"

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not BUCKET_RE.fullmatch(value) or ".." in value:
            raise ValueError(f"{value[:70]!r} is not a bucket name; use 3-63 lowercase letters, digits, dots and "
                             "dashes, a letter or digit at each end, e.g. my-kchain-state")
        return value


def _setup(value: str) -> str:
    if "\x00" in value or len(value) > MAX_SETUP:
        raise ValueError(f"is not a setup script; write a few shell commands (at most {MAX_SETUP} characters)")
    return value


class SkyPilotSpec(_Section):
    # SkyPilot's own syntax: A100:1, H100:8, L4 (one); its mapping {T4: 1} and its list of candidates
    # [A100:1, V100:1] are read as the same (one entry: NAME:COUNT; several: the list); None: a CPU machine.
    accelerators: str | list[str] | None = None
    use_spot: bool = True
    num_nodes: int = Field(default=1, ge=1, le=64)
    bucket: BucketSpec | None = None
    # Where to run: SkyPilot's infra syntax (aws, gcp/us-central1, k8s, slurm); None: any enabled one.
    infra: str | None = None
    disk_size: int | None = Field(default=None, ge=10, le=65536)  # GB
    # Installs what the code imports (SkyPilot's images have Python, not torch).
    setup: str = "pip install torch numpy"
    # Recoveries after a failure that is not a preemption or "saved, not done" (a crash): 0, never.
    max_restarts_on_errors: int = Field(default=0, ge=0, le=10)

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerators(cls, value: Any) -> str | list[str] | None:
        if value is None:
            return None
        given = value
        if isinstance(value, dict):  # SkyPilot's {NAME: COUNT}
            value = [f"{name}:{count}" if count is not None else str(name) for name, count in value.items()]
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(
                isinstance(n, str) and ACCELERATOR_RE.fullmatch(n) for n in names):
            raise ValueError(f"{str(given)[:70]!r} is not an accelerator; write NAME or NAME:COUNT, e.g. A100:1 "
                             "(or SkyPilot's {A100: 1}, or a list of candidates)")
        return names[0] if len(names) == 1 else names

    @field_validator("infra")
    @classmethod
    def _infra(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9*][A-Za-z0-9_./*-]{0,127}", value):
            raise ValueError(f"{value[:70]!r} is not an infra; write e.g. aws, gcp/us-central1 or k8s")
        return value

    @field_validator("setup")
    @classmethod
    def _setup_script(cls, value: str) -> str:
        return _setup(value)


class SlurmSpec(_Section):
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    time: str | int | float = "12h"  # the job's time limit (sbatch --time), a duration like 30m, 12h, 48h
    gpus: int = Field(default=1, ge=0, le=64)  # GPUs per node
    nodes: int = Field(default=1, ge=1, le=64)
    # A folder on the cluster's shared file system, the same on every node: each verified checkpoint is
    # published there, and a requeued job on another node resumes from it.
    state_dir: str | None = None
    # Shell lines before the run (module load, activate a venv).
    setup: str = ""

    def sink(self, job_name: str) -> str:
        """The job's state folder: its runs publish each verified checkpoint there (KCHAIN_STATE_SINK), and
        `kchain pull` reads the result from it."""
        assert self.state_dir is not None  # load_job refused a Slurm job without one (target_problem)
        return f"{self.state_dir.rstrip('/')}/{job_name}"

    @field_validator("partition", "account")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME_RE.fullmatch(value):
            raise ValueError(f"{value[:70]!r} is not a Slurm name; use letters, digits, _ . : -")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | int | float) -> str | int | float:
        try:
            seconds = parse_duration(value)
        except ValueError:
            raise ValueError(f"{str(value)[:70]!r} is not a duration; write e.g. 90m, 12h or 48h") from None
        if not 60 <= seconds <= 365 * 86400:
            raise ValueError(f"{str(value)[:70]!r} is out of range; write 1m to 8760h, e.g. 12h")
        return value

    @field_validator("state_dir")
    @classmethod
    def _state_dir(cls, value: str | None) -> str | None:
        if value is not None and (not STATE_DIR_RE.fullmatch(value) or len(value) > 1024):
            raise ValueError(f"{value[:70]!r} is not an absolute path of letters, digits and _ . + - /; write the "
                             "shared folder, e.g. /scratch/me/kchain-state")
        return value

    @field_validator("setup")
    @classmethod
    def _setup_script(cls, value: str) -> str:
        return _setup(value)
