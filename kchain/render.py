"""Render a job into exactly what a push sends: <name>.ipynb and kernel-metadata.json.

Rendering is pure: the same job, owner and sources give byte-identical files. The notebook embeds
the kchain runtime and the user's code as a deterministic zip, so it runs with the internet off.
The kernel fingerprint is a hash of that payload (code, params, runtime and settings).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

import kchain
from kchain.errors import RenderError
from kchain.spec import Job, runtime_config

METADATA_FILE = "kernel-metadata.json"
# Code folders are embedded in the notebook; data belongs in a dataset.
MAX_CODE_BYTES = 5 * 1024 * 1024
_SKIP_DIRS = {"__pycache__", ".git", ".kchain", ".venv", ".ipynb_checkpoints", "node_modules"}
# Kaggle's default GPU is "GPU T4 x2" (shared/reference/kaggle-api.md 6.6).
MACHINE_SHAPES = {"gpu": "NvidiaTeslaT4", "tpu": "TpuV5E8", "none": None}


@dataclass(frozen=True)
class Rendered:
    name: str
    notebook: str
    metadata: str
    fingerprint: str
    config: dict[str, Any]

    @property
    def notebook_file(self) -> str:
        return f"{self.name}.ipynb"


def templates_dir() -> Path:
    """kernel_templates/ ships inside the wheel as kchain.kernel_templates."""
    try:
        import kchain.kernel_templates as pkg

        return Path(pkg.__file__).parent
    except ImportError:  # running from a source tree without an install
        return Path(__file__).resolve().parent.parent / "kernel_templates"


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _runtime_files() -> dict[str, bytes]:
    runtime = Path(__file__).resolve().parent / "runtime"
    files = {
        f"kchain/runtime/{p.relative_to(runtime).as_posix()}": p.read_bytes()
        for p in sorted(runtime.rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    # A minimal package root: inside the kernel only the runtime exists.
    files["kchain/__init__.py"] = f'__version__ = "{kchain.__version__}"\n'.encode()
    files["kchain_publish.py"] = (templates_dir() / "kchain_publish.py").read_bytes()
    return files


def _code_files(job: Job) -> dict[str, bytes]:
    src = job.code_path
    if src.is_file():
        return {f"code/{src.name}": src.read_bytes()}
    files: dict[str, bytes] = {}
    total = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part in _SKIP_DIRS for part in rel.parts) or not p.is_file() or p.suffix == ".pyc":
            continue
        data = p.read_bytes()
        total += len(data)
        if total > MAX_CODE_BYTES:
            raise RenderError(
                f"{job.path}: code: {job.code!r} holds over {MAX_CODE_BYTES // 2**20} MB; "
                "keep data out of the code folder and attach it as a dataset"
            )
        files[f"code/{rel.as_posix()}"] = data
    if not any(name.endswith(".py") for name in files):
        raise RenderError(f"{job.path}: code: {job.code!r} has no .py file; point it at your training code")
    return files


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[name])
    return buf.getvalue()


def _canonical(text: str) -> str:
    return json.dumps(json.loads(text), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def state_dataset(owner: str | None, name: str) -> str:
    return f"{owner or '<you>'}/{name}-state"


def render_job(job: Job, owner: str | None = None, extra_sources: list[str] | None = None,
               session: int = 1, session_facts: dict | None = None) -> Rendered:
    """Pure: job (+ the Kaggle owner, the session number, pinned state sources) -> notebook and
    metadata text. The session number and sources only label the notebook: the fingerprint is the
    same for every session of a chain. session_facts (what this session must resume, the measured
    publish figures) go into config["kaggle"], which the fingerprint leaves out."""
    owner = job.kaggle.owner or owner
    config = runtime_config(job)
    config["kaggle"] = {
        "owner": owner,
        "state_dataset": f"{owner}/{job.name}-state" if owner else None,
        "cache_dataset": f"{owner}/{job.name}-cache" if owner else None,
        "internet": job.kaggle.internet,
        **(session_facts or {}),
    }
    config["kchain_version"] = kchain.__version__
    files = {**_runtime_files(), **_code_files(job)}
    payload = _zip(files)
    # What the code does: the code, params, settings and runtime. Not who runs it or where its state
    # goes (config["kaggle"]), so a smoke pass made before the credentials were set still counts.
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in config.items() if k != "kaggle"}, sort_keys=True).encode())
    digest.update(payload)
    fingerprint = digest.hexdigest()
    config["fingerprint"] = fingerprint

    env = _environment()
    gpu = job.kaggle.accelerator == "gpu"
    notebook = env.get_template("notebook.ipynb.j2").render(
        job=job.name,
        job_file=job.path.name,
        session=session,
        state_sources=", ".join(extra_sources or []) or "none (a fresh start)",
        fingerprint=fingerprint,
        entry=job.entry_point,
        version=kchain.__version__,
        config_json=json.dumps(config, sort_keys=True),
        payload=base64.b64encode(payload).decode(),
        kaggle_accelerator={"gpu": "nvidiaTeslaT4", "tpu": "tpuV5E8", "none": "none"}[job.kaggle.accelerator],
        internet=job.kaggle.internet,
        gpu=gpu,
    )
    sources = list(job.kaggle.datasets) + list(extra_sources or [])
    metadata = env.get_template("kernel-metadata.json.j2").render(
        kernel_id=f"{owner}/{job.name}" if owner else job.name,
        title=job.name,
        code_file=f"{job.name}.ipynb",
        private=job.kaggle.private,
        gpu=gpu,
        tpu=job.kaggle.accelerator == "tpu",
        internet=job.kaggle.internet,
        machine_shape=MACHINE_SHAPES[job.kaggle.accelerator],
        dataset_sources=sources,
        competition_sources=[job.kaggle.competition] if job.kaggle.competition else [],
    )
    return Rendered(
        name=job.name,
        notebook=_canonical(notebook),
        metadata=_canonical(metadata),
        fingerprint=fingerprint,
        config=config,
    )


def write_rendered(rendered: Rendered, out_dir: Path) -> list[Path]:
    """Write the notebook and kernel-metadata.json into out_dir (atomically) and return the paths."""
    from kchain.fsutil import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    nb_path = out_dir / rendered.notebook_file
    meta_path = out_dir / METADATA_FILE
    atomic_write_text(nb_path, rendered.notebook)
    atomic_write_text(meta_path, rendered.metadata)
    return [nb_path, meta_path]
