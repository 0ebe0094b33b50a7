"""Shared helpers for kchain's tests: writing job files, driving the CLI, building a Run in-process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import yaml
from click.testing import CliRunner

from kchain.cli import cli

if TYPE_CHECKING:
    from kchain.runtime.run import Run

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
# A training fault (kchain/common/faults.py) for rehearsals and chains: at most 20 steps/s, whatever the machine.
STALL = "stall_step=0.05"
# A session's limit where the deadline fault ends every session long before it, however loaded the machine.
GENEROUS_S = 600

T = TypeVar("T")


def known(value: T | None) -> T:
    """`value`, which the test expects to be there (not None): a check that also tells mypy so."""
    assert value is not None
    return value


def copy_job(name: str, dest: Path, **overrides) -> Path:
    """Copy jobs/<name> to dest and apply top-level overrides (dicts are merged one level deep)."""
    target = dest / name
    shutil.copytree(JOBS / name, target, ignore=shutil.ignore_patterns(".kchain", "__pycache__"))
    job_file = target / "job.yaml"
    data = yaml.safe_load(job_file.read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    job_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return job_file


def runtime_job(tmp_path: Path, module: str, entry: str, prefix: str, gpus="auto", smoke: dict | None = None,
                params: dict | None = None) -> Path:
    """A job over tests/runtime_jobs/<module>.py (with tiny_job.py beside it) whose entry is `entry`: a GPU
    job (two ranks with gpus: auto, as Kaggle's T4 x2), internet off."""
    code = tmp_path / "code"
    code.mkdir()
    for name in ("tiny_job.py", f"{module}.py"):  # the job named <prefix>-<entry>
        shutil.copy(REPO / "tests" / "runtime_jobs" / name, code / name)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": f"{prefix}-{entry.replace('_', '-')}", "code": "code",
        "entry": f"{module}:{entry}", "params": params or {}, "kaggle": {"accelerator": "gpu", "internet": False},
        "train": {"gpus": gpus}, "smoke": {"steps": 3, **(smoke or {})},
    }))
    return job


def invoke(*args: object):
    """The CLI run in-process on these arguments, each as its text (a path, a number)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return lines[-1] if lines else ""


def make_run(root: Path, params: dict | None = None, env: dict | None = None, **train) -> Run:
    """A Run built in-process under KCHAIN_ROOT=root (torch is imported here, not by every CLI test)."""
    from kchain.common import layout
    from kchain.runtime.run import Run

    config = {"job": "unit", "params": params or {}, "train": {"heartbeat_s": 0, **train}}
    return Run(config, {layout.ROOT_ENV: str(root), **(env or {})})


def saved_names(root: Path) -> set[str]:
    """The tracked names the newest checkpoint under root (KCHAIN_ROOT) holds, read from its digests.json:
    what a resume would load, seen from outside the Run."""
    import json

    from kchain.common import layout

    folders = sorted((root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).glob(
        f"{layout.CHECKPOINT_PREFIX}*"))
    digests = json.loads((folders[-1] / layout.DIGESTS).read_text())
    return {key.split(".")[1] for key in digests if key.startswith("tracked.")}


def loss_trace(root: Path) -> list[tuple[int, float]]:
    """(step, loss) for every training step in the metrics trace of the run under root (KCHAIN_ROOT)."""
    import json

    from kchain.common import layout

    lines = (root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.METRICS).read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def paths(run):
    """Where a Run's files are, from its public face (run.working), as the runtime lays them out."""
    from kchain.common import layout

    return layout.Paths.of({layout.ROOT_ENV: str(run.working.parent)})


def train_template(root: Path, template: str, params: dict, env: dict | None = None) -> tuple:
    """`kchain init --template TEMPLATE`'s main(run) in this process on 1 rank: (status, step, total, the
    metrics trace without its times)."""
    import importlib.util
    import json

    from kchain.job.init import TEMPLATES
    from kchain.runtime.run import SessionStopped

    spec = importlib.util.spec_from_file_location(f"{template}_template", TEMPLATES / template / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = make_run(root, params=params, env=env)
    try:
        module.main(run)
    except SessionStopped:
        pass
    finally:
        run.close()
    rows = [json.loads(line) for line in (root / "working/kchain/metrics.jsonl").read_text().splitlines()]
    return run.status, run.step, run.total, [{k: v for k, v in row.items() if k != "time"} for row in rows]
