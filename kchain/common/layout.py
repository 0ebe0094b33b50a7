"""Every file and directory name the runtime reads or writes, and every KCHAIN_* environment variable.

The laptop side imports this module too (it must stay standard-library only), so a renamed file is
renamed in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Environment the notebook (or the local executor) sets for the training child; see docs/design.md.
ROOT_ENV = "KCHAIN_ROOT"
SMOKE_ENV = "KCHAIN_SMOKE"
SESSION_START_ENV = "KCHAIN_SESSION_START"
SESSION_LIMIT_ENV = "KCHAIN_SESSION_LIMIT"
CHECKPOINT_EVERY_ENV = "KCHAIN_CHECKPOINT_EVERY"
TOTAL_STEPS_ENV = "KCHAIN_TOTAL_STEPS"
# local only (rehearse): the sessions planned in steps, the run's total in this many spans (sessionplan.py)
SESSION_PLAN_ENV = "KCHAIN_SESSION_PLAN"
# local only (rehearse; a smoke always): "1" audits the state no checkpoint holds (runtime/checkpoint/untracked.py)
AUDIT_ENV = "KCHAIN_AUDIT_STATE"
FAULT_ENV = "KCHAIN_FAULT"
GATE_ENV = "KCHAIN_GATE"  # PID:PATH, the smoke's early-started resume waits here until the kill (launch.py)
CHECKPOINT_STREAM_ENV = "KCHAIN_CHECKPOINT_STREAM"  # 1: stream saves from live tensors, 0: copy to RAM
# local only (smoke, rehearse): the rank count the job gets on Kaggle, run here as gloo ranks on the CPU
RANKS_ENV = "KCHAIN_RANKS"
# local only: "0" starts each local CPU rank as its own interpreter instead of forking them (forkranks.py)
FORK_RANKS_ENV = "KCHAIN_FORK_RANKS"
# Set by kchain's launcher for its ranks: a folder where rank 0 leaves the port of the store it bound.
RENDEZVOUS_ENV = "KCHAIN_RENDEZVOUS"
SMOKE_PARAMS_ENV = "KCHAIN_SMOKE_PARAMS"  # local only: JSON params over the job's, from `kchain smoke --set`
HANG_ENV = "KCHAIN_HANG_TIMEOUT"  # tests: seconds, the hang watchdog's floor (watchdog.py)
ACCELERATOR_CHECK_ENV = "KCHAIN_ACCELERATOR_CHECK"  # "off": a CPU stand-in for a Kaggle GPU session (the emulator)
# The emulator's test switch `runner.image_env`: the probe reports these as the image's versions.
TEST_IMAGE_TORCH_ENV = "KCHAIN_TEST_IMAGE_TORCH"
TEST_IMAGE_NUMPY_ENV = "KCHAIN_TEST_IMAGE_NUMPY"
# JSON {module: version or null}: what the doctor's probe reports for those packages instead of looking (tests).
TEST_IMAGE_PACKAGES_ENV = "KCHAIN_TEST_IMAGE_PACKAGES"
# The laptop's, never the kernel's: the state folder (run log, sessions, smoke passes), else .kchain/.
HOME_ENV = "KCHAIN_HOME"
# The laptop's: kchain's config home (the account's week across job folders, store/account.py).
CONFIG_HOME_ENV = "KCHAIN_CONFIG_HOME"

# Exit codes a supervisor (SkyPilot's recover_on_exit_codes, Slurm --requeue, a shell loop) acts on.
EXIT_SAVED_NOT_DONE = 75  # EX_TEMPFAIL: the state is saved and training is not finished (deadline, SIGTERM)
EXIT_NO_ACCELERATOR = 69  # EX_UNAVAILABLE: the machine lacks the GPUs the job asked for; nothing trained
# Targets other than Kaggle: a folder on a mounted bucket that each verified checkpoint is published to.
STATE_SINK_ENV = "KCHAIN_STATE_SINK"
START_OVER_ENV = "KCHAIN_START_OVER"  # "1": a requeued or recovered job may start fresh on an empty state sink
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"  # Slurm's: how many times this job was requeued (0 or unset: its first run)
# What `continue --watch --notify CMD` puts in CMD's environment (kchain/chain/notify.py).
NOTIFY_EVENT_ENV = "KCHAIN_EVENT"  # session_ended, failed, finished, needs_person
NOTIFY_JOB_ENV = "KCHAIN_JOB"  # the job's name
NOTIFY_MESSAGE_ENV = "KCHAIN_MESSAGE"  # the line kchain printed for the event
NOTIFY_SESSION_ENV = "KCHAIN_SESSION"  # the session it concerns, or empty

# The job's datasets on Kaggle: <owner>/<job>-state holds its checkpoints, <owner>/<job>-cache its staging cache,
# <owner>/<job>-pip the wheels of `kaggle.pip` (common/wheelinstall.py), with WHEELS_MANIFEST beside them.
STATE_SUFFIX, CACHE_SUFFIX, PIP_SUFFIX = "-state", "-cache", "-pip"
WHEELS_MANIFEST = "kchain-wheels.json"

DEFAULT_ROOT = "/kaggle"
INPUT_DIR = "input"  # attached datasets, read-only on Kaggle
WORKING_DIR = "working"  # the kernel's output, becomes the next session's state dataset
KCHAIN_DIR = "kchain"  # our corner of the working dir

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"  # a checkpoint or file being written (atomic.py); never loaded, removed at the next start
CORRUPT_PREFIX = ".corrupt-"  # a checkpoint that failed verification, set aside for a human
MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
METRICS = "metrics.jsonl"
DIGESTS = "digests.json"  # in a checkpoint: every value of its state, digested (statedigest.py), for the judges
SUMMARY = "summary.json"
PUBLISH_SENT_KEY = "publish_sent"  # in summary.json: the kernel's state send {step, before}, before it settles
CACHE_DIR = "cache"
SCRATCH_DIR = ".scratch"  # where an attached archive is unpacked and a framework's resume is linked: kchain's own
# The user's own export (run.export_dir: save_pretrained, ONNX, anything), under the kchain dir so it
# travels in the state version the finishing session publishes; `kchain pull` brings it home.
EXPORT_DIR = "export"
# A state version is flat: the kept best checkpoint (train.keep_best) travels beside the newest as
# these names, `best.manifest.json`, `best.state.pt`, ...; the resume search only reads `manifest.json`.
BEST_PREFIX = "best."
# run.tensorboard_dir, <working>/kchain/tensorboard: carried in every checkpoint as the files of this group
# (the manifest's "attached"), so every session of a chain appends to one TensorBoard run (tensorboard.py).
TENSORBOARD_DIR = "tensorboard"
# train.trackers.mlflow: MLflow's file store, <working>/kchain/mlflow, carried in every checkpoint as the files
# of this group, so every session of a chain logs into one MLflow run (frameworks/mlflow_store.py).
MLFLOW_DIR = "mlflow"

# The marker file of a state dataset version (and of the state dataset's first, empty version).
STATE_MARKER = "kchain-state.json"
RELAY_FILE = "kchain-relay.json"  # an unattended chain's CPU relay's output: what it did (common/relay.py)

# A manifest.json is ours only if it carries this key: attached datasets hold other manifests.
MARKER = "kchain_checkpoint"
FORMAT_VERSION = 1

# Where Kaggle mounts an attached input: /kaggle/input/<slug> (legacy) or /kaggle/input/<kind>/...:
# datasets/<owner>/<slug>, notebooks/<owner>/<slug>, competitions/<slug>, models/<owner>/<model>/...
INPUT_KINDS = ("datasets", "competitions", "notebooks", "models")
STATE_KINDS = ("datasets", "notebooks")  # the kinds that can hold kchain's state (a dataset, a kernel's output)
OWNED_KINDS = ("datasets", "notebooks", "models")  # mounted as <input>/<kind>/<owner>/<slug>

# Archived checkpoints found under the input root (a state dataset uploaded without unpacking).
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")

# Kaggle's model frameworks: kagglesdk 0.1.38 models/types/model_enums.py ModelFramework (less
# UNSPECIFIED), spelled as the client's lookup_enum matches them: case and underscores do not count,
# so pyTorch, PyTorch and pytorch are one (model_framework_key).
MODEL_FRAMEWORKS = ("tensorflow1", "tensorflow2", "tflite", "tfjs", "pytorch", "jax", "flax", "pax", "maxtext",
                    "gemmacpp", "ggml", "gguf", "coral", "scikitlearn", "mxnet", "onnx", "keras", "transformers",
                    "api", "other", "tensorrtllm", "triton", "vllm")


def model_framework_key(framework: str) -> str:
    """A framework as Kaggle matches it: 'Transformers', 'tensorFlow2' -> 'transformers', 'tensorflow2'."""
    return framework.lower().replace("_", "")


def model_mount(ref: str) -> Path:
    """Where Kaggle mounts model version owner/model/framework/variation/version, under the input root:
    models/<owner>/<model>/<framework>/<variation>/<version> (the 2025+ layout; the legacy one is
    <model>/<framework>/<variation>/<version>), the framework as Kaggle names it (model_framework_key).
    Sources: shared/reference/kaggle-api.md 6.2, and public kernels whose model_sources name
    .../Transformers/bfloat16/1 and that read /kaggle/input/models/<owner>/<model>/transformers/bfloat16/1."""
    owner, model, framework, variation, version = ref.split("/")
    return Path("models", owner, model, model_framework_key(framework), variation, version)


def checkpoint_name(step: int) -> str:
    """step-00000120: zero-padded so a plain sort is a step sort."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def root(env) -> Path:
    return Path(env.get(ROOT_ENV) or DEFAULT_ROOT)


def input_root(env) -> Path:
    return root(env) / INPUT_DIR


def working_root(env) -> Path:
    return root(env) / WORKING_DIR


def kchain_dir(env) -> Path:
    return working_root(env) / KCHAIN_DIR


@dataclass(frozen=True)
class Paths:
    """Where one run's files are, from the environment (KCHAIN_ROOT, else /kaggle)."""

    input_root: Path  # attached inputs, read-only on Kaggle
    working: Path  # the kernel's output
    kchain: Path  # kchain's corner of it
    checkpoints: Path
    cache: Path  # the staging cache (run.stage)
    metrics: Path
    summary: Path
    scratch: Path  # where an attached archive of checkpoints is unpacked
    export: Path  # run.export_dir: the user's own export, carried by the state version

    @property
    def tensorboard(self) -> Path:
        """run.tensorboard_dir: the chain's one TensorBoard log dir (tensorboard.py)."""
        return self.kchain / TENSORBOARD_DIR

    @property
    def mlflow(self) -> Path:
        """train.trackers.mlflow's file store (MLFLOW_TRACKING_URI): the chain's MLflow runs (mlflow_store.py)."""
        return self.kchain / MLFLOW_DIR

    @classmethod
    def of(cls, env) -> Paths:
        here = kchain_dir(env)
        return cls(input_root=input_root(env), working=working_root(env), kchain=here,
                   checkpoints=here / CHECKPOINTS_DIR, cache=here / CACHE_DIR, metrics=here / METRICS,
                   summary=here / SUMMARY, scratch=here / SCRATCH_DIR, export=here / EXPORT_DIR)


def _subdirs(path: Path) -> list[Path]:
    """The folders in path (through links: mounts may be links), from one listing; [] if none."""
    try:
        with os.scandir(path) as entries:
            return sorted(Path(e.path) for e in entries if not e.name.startswith(TMP_PREFIX) and e.is_dir())
    except OSError:
        return []


def mounts(input_root: Path, kinds: tuple[str, ...]) -> list[Path]:
    """The folder of every attached input of these kinds (each <kind>/<owner>/<slug>), and of every
    input in the legacy layout (<input>/<slug>).

    Only the input root and the kind and owner folders are listed, never anything inside an attached
    input: the cost is the number of inputs attached, not their files. The checkpoint search, the
    staging cache and run.input all find their inputs here, so the two layouts are spelled once.
    """
    found: list[Path] = []
    for top in _subdirs(input_root):
        if top.name in kinds:
            for owner in _subdirs(top):
                found += _subdirs(owner)
        elif top.name not in INPUT_KINDS:
            found.append(top)  # the legacy layout
    return found


def model_versions(mount: Path, legacy: bool) -> list[Path]:
    """The version folders (<framework>/<variation>/<N>, where the weights are) of a model mounted at
    `mount`, from a few listings of the model's own folders. In the legacy layout a model's mount
    (<input>/<model>) looks like a dataset's, so only folders named for a Kaggle framework are looked
    at there (a stat each): a dataset's own top level is never listed."""
    if legacy:
        frameworks = [mount / name for name in MODEL_FRAMEWORKS if (mount / name).is_dir()]
    else:
        frameworks = _subdirs(mount)
    return [version for framework in frameworks for variation in _subdirs(framework)
            for version in _subdirs(variation) if version.name.isdigit()]
