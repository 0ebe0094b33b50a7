"""Render a job into exactly what a push sends: <name>.ipynb and kernel-metadata.json.

Rendering is pure: the same job, owner and sources give byte-identical files. The notebook embeds
the kchain runtime and the user's code as a deterministic zip, so it runs with the internet off.
The kernel fingerprint is a hash of that payload (code, params, runtime and settings).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import stat
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pathspec

import kchain
from kchain.common import atomic, layout, nextkernel
from kchain.common.config import KaggleConfig
from kchain.errors import RenderError
from kchain.job import notebook_code
from kchain.job.spec import Job, decode_text, notebook_name, parse_duration, runtime_config
from kchain.kaggle.credentials import secret_strings
from kchain.store.names import cache_dataset, doctor_kernel, pip_dataset, state_dataset

METADATA_FILE = "kernel-metadata.json"
IGNORE_FILE = ".kchainignore"
# Code folders are embedded in the notebook; data belongs in a dataset.
MAX_CODE_BYTES = 5 * 1024 * 1024
# Never embedded, whatever .kchainignore says (gitignore syntax): credentials by name ...
SECRET_PATTERNS = ["kaggle.json", ".env*", "*.pem", "*.key", "id_rsa*", ".netrc", "access_token",
                   "access_token.txt", "credentials.json"]
# ... and what is never training code.
SKIP_PATTERNS = [".git/", ".kchain/", ".venv/", "__pycache__/", "*.pyc", ".ipynb_checkpoints/", "node_modules/",
                 ".DS_Store"]
_SECRETS = pathspec.GitIgnoreSpec.from_lines(SECRET_PATTERNS)
_SKIPS = pathspec.GitIgnoreSpec.from_lines(SKIP_PATTERNS)
# Kaggle's default GPU is "GPU T4 x2" (shared/reference/kaggle-api.md 6.6).
MACHINE_SHAPES = {"gpu": "NvidiaTeslaT4", "tpu": "TpuV5E8", "none": None}


@dataclass(frozen=True)
class Rendered:
    name: str
    notebook: str
    metadata: str
    fingerprint: str
    config: dict[str, Any]
    # The user's files in the payload (name, bytes) and those left out (name, why).
    embedded: tuple[tuple[str, int], ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()

    @property
    def notebook_file(self) -> str:
        return f"{self.name}.ipynb"


def templates_dir() -> Path:
    """kernel_templates/ ships inside the wheel as kchain.kernel_templates."""
    try:
        import kchain.kernel_templates as pkg

        return Path(pkg.__file__).parent
    except ImportError:  # running from a source tree without an install
        return Path(__file__).resolve().parents[2] / "kernel_templates"


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


KERNEL_PACKAGES = ("common", "runtime")  # what travels in a payload: the kernel's packages (their import rules)


def _runtime_files() -> dict[str, bytes]:
    package = Path(__file__).resolve().parents[1]
    files = {
        f"kchain/{p.relative_to(package).as_posix()}": p.read_bytes()
        for name in KERNEL_PACKAGES
        for p in sorted((package / name).rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    # A minimal package root: inside the kernel only the runtime and kchain.common exist.
    files["kchain/__init__.py"] = f'__version__ = "{kchain.__version__}"\n'.encode()
    return files


def _ignore_specs(job: Job) -> list[tuple[Path, pathspec.PathSpec]]:
    """.kchainignore files, in the job's folder and in the code folder, each relative to its folder."""
    specs: list[tuple[Path, pathspec.PathSpec]] = []
    for folder in dict.fromkeys([job.root.resolve(), job.code_path if job.code_path.is_dir() else None]):
        if folder is None or not (folder / IGNORE_FILE).is_file():
            continue
        try:
            lines = (folder / IGNORE_FILE).read_text(encoding="utf-8").splitlines()
            specs.append((folder, pathspec.GitIgnoreSpec.from_lines(lines)))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RenderError(f"{folder / IGNORE_FILE}: cannot be read as gitignore patterns ({str(exc)[:80]}); "
                              "fix it") from None
    return specs


def _why_left_out(path: Path, rel: str, is_dir: bool, specs: list[tuple[Path, pathspec.PathSpec]]) -> str | None:
    name = rel + "/" if is_dir else rel
    if _SECRETS.match_file(name):
        return "a credential file"
    if _SKIPS.match_file(name):
        return None if is_dir or name.endswith(".pyc") else "not code"
    for base, spec in specs:
        if path.is_relative_to(base):
            inner = path.relative_to(base).as_posix()
            if spec.match_file(inner + "/" if is_dir else inner):
                return f"in {IGNORE_FILE}"
    return None


def _skipped_quietly(rel: str, is_dir: bool) -> bool:
    return bool(_SKIPS.match_file(rel + "/" if is_dir else rel)) and not _SECRETS.match_file(rel)


def _code_candidates(job: Job) -> tuple[list[tuple[str, Path, int]], list[tuple[str, str]]]:
    """The files of the payload (name, path, size) and those left out (name, why), by a walk that
    follows no symlink out of the job's folder and reads nothing yet."""
    src, root = job.code_path, job.root.resolve()
    where = f"{job.path}: code"
    if src.is_file():
        if _SECRETS.match_file(src.name):
            raise RenderError(f"{where}: {src.name!r} is a credential file; point code at your training code")
        return [(f"code/{src.name}", src, src.stat().st_size)], []
    specs = _ignore_specs(job)
    keep: list[tuple[str, Path, int]] = []
    left: list[tuple[str, str]] = []
    for folder, dirs, names in os.walk(src, followlinks=False):
        here = Path(folder)
        for d in sorted(dirs):
            path = here / d
            rel = path.relative_to(src).as_posix()
            why = _why_left_out(path, rel, True, specs)
            if why is None and not _skipped_quietly(rel, True) and path.is_symlink():
                why = "a linked folder (not followed)"
            if why is not None or _skipped_quietly(rel, True):
                dirs.remove(d)
                if why is not None:
                    left.append((f"code/{rel}/", why))
        for n in sorted(names):
            path = here / n
            rel = path.relative_to(src).as_posix()
            why = _why_left_out(path, rel, False, specs)
            if why is None and _skipped_quietly(rel, False):
                continue
            if why is None:
                try:
                    target = path.resolve()
                except (OSError, RuntimeError):  # a symlink loop
                    target = None
                    why = "a broken link"
                if target is not None and not target.is_relative_to(root):
                    raise RenderError(
                        f"{where}: {rel} links to {target}, outside the job's folder; copy the file in or list "
                        f"it in {IGNORE_FILE}"
                    )
                if why is None:
                    try:
                        info = path.stat()
                    except OSError:
                        why = "cannot be read"
                    else:
                        if not stat.S_ISREG(info.st_mode):
                            why = "not a regular file"
            if why is not None:
                left.append((f"code/{rel}", why))
                continue
            keep.append((f"code/{rel}", path, info.st_size))
    return keep, left


def _mb(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    return f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size / 1024:.1f} KB"


def _notebook_modules(job: Job, keep: list[tuple[str, Path, int]], left: list[tuple[str, str]]
                      ) -> tuple[list[tuple[str, Path, int]], dict[str, bytes]]:
    """The entry notebook becomes its module, <name>.py (its code cells only: outputs never travel), each
    line it dropped a left-out line; any other notebook of a code folder is left out whole."""
    entry = job.entry_notebook
    out: list[tuple[str, Path, int]] = []
    made: dict[str, bytes] = {}
    script = job.entry_script
    for name, path, size in keep:
        if script is not None and path == script:  # a script that trains at module level: main(run) runs it
            try:
                made[name] = notebook_code.script_module(decode_text(path.read_bytes()), notebook_name(job, path)).encode()
            except (OSError, ValueError, notebook_code.NotebookError) as exc:
                raise RenderError(f"{job.path}: code: {exc}") from None
            out.append((name, path, len(made[name])))
            left.append((name, f"trains at module level: run as one cell with run bound, as main(run) ({name})"))
        elif not name.endswith(".ipynb"):
            out.append((name, path, size))
        elif path != entry:
            left.append((name, "a notebook that is not the entry: only the entry notebook's code cells travel"))
        else:
            module_name = name.removesuffix(".ipynb") + ".py"
            try:
                module = notebook_code.to_module(path.read_bytes(), notebook_name(job, path),
                                                 job.entry_point.split(":")[1], bool(job.entry))
            except OSError as exc:
                raise RenderError(f"{job.path}: code: {name} cannot be read ({exc.strerror}); fix it") from None
            except notebook_code.NotebookError as exc:
                raise RenderError(f"{job.path}: code: {exc}") from None
            made[module_name] = module.text.encode()
            if any(secret.encode() in made[module_name] for secret in secret_strings()):  # outputs never travel
                raise RenderError(f"{job.path}: code: a code cell of {notebook_name(job, path)} holds your Kaggle "
                                  "key; remove it (attach it to the notebook as a Kaggle Secret instead)")
            out.append((module_name, path, len(made[module_name])))
            left.append((name, module.summary(module_name)))
            left.extend((f"{name} {note}", "dropped") for note in module.notes)
    return out, made


def code_files(job: Job) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """The user's code for the payload: only files inside the job's folder, no credential by name
    or by content, nothing .kchainignore lists, and at most MAX_CODE_BYTES."""
    keep, left = _code_candidates(job)
    keep, made = _notebook_modules(job, keep, left)
    total = sum(size for _, _, size in keep)
    if total > MAX_CODE_BYTES:
        biggest = ", ".join(f"{name} {_mb(size)}" for name, _, size in sorted(keep, key=lambda k: -k[2])[:3])
        raise RenderError(
            f"{job.path}: code: {job.code!r} holds {_mb(total)}, over the {_mb(MAX_CODE_BYTES)} limit (biggest: "
            f"{biggest}); list data in {IGNORE_FILE} and attach it as a dataset"
        )
    secrets = [s.encode() for s in secret_strings()]
    files: dict[str, bytes] = {}
    for name, path, _ in keep:
        try:
            data = made[name] if name in made else path.read_bytes()
        except OSError as exc:
            raise RenderError(f"{job.path}: code: {name} cannot be read ({exc.strerror}); fix or ignore it") from None
        if any(secret in data for secret in secrets):
            raise RenderError(
                f"{job.path}: code: {name} holds your Kaggle key; remove it (attach it to the notebook as a Kaggle "
                f"Secret instead) or list the file in {IGNORE_FILE}"
            )
        files[name] = data
    if not any(name.endswith(".py") for name in files):
        raise RenderError(f"{job.path}: code: {job.code!r} has no .py file; point it at your training code")
    return files, left


def payload_lines(rendered: Rendered) -> list[str]:
    """What `kchain render` says about the payload: each file embedded, each left out, the total."""
    shown = 50
    lines = [f"embedded {name} ({_mb(size)})" for name, size in rendered.embedded[:shown]]
    if len(rendered.embedded) > shown:
        lines.append(f"embedded ... and {len(rendered.embedded) - shown} more files")
    lines += [f"left out {name} ({why})" for name, why in rendered.left_out[:shown]]
    if len(rendered.left_out) > shown:
        lines.append(f"left out ... and {len(rendered.left_out) - shown} more")
    total = sum(size for _, size in rendered.embedded)
    lines.append(f"payload: {len(rendered.embedded)} files of your code, {_mb(total)} "
                 f"(limit {_mb(MAX_CODE_BYTES)}), plus the kchain runtime")
    return lines


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


def render_job(job: Job, owner: str | None = None, extra_sources: list[str] | None = None,
               session: int = 1, session_facts: dict | None = None, unattended: bool = False) -> Rendered:
    """Pure: job (+ the Kaggle owner, the session number, pinned state sources) -> notebook and
    metadata text. The session number and sources only label the notebook: the fingerprint is the
    same for every session of a chain. session_facts (what this session must resume, the measured
    publish figures) go into config["kaggle"], which the fingerprint leaves out. unattended: the
    payload also holds the next session's template (common/nextkernel.py), from which this notebook is
    filled too, so the kernel can push the next session as this function would render it."""
    owner = job.kaggle.owner or owner
    config = _session_config(job, owner, session_facts, unattended)
    code, left_out = code_files(job)
    files = {**_runtime_files(), **code}
    payload = _zip(files)
    config["fingerprint"] = fingerprint = _fingerprint(config, payload)
    env = _environment()
    values = dict(
        job=job.name,
        job_file=job.path.name,
        session=session,
        state_sources=nextkernel.state_text(extra_sources or []),
        fingerprint=fingerprint,
        entry=job.entry_point,
        version=kchain.__version__,
        config_json=json.dumps(config, sort_keys=True),
        payload=base64.b64encode(payload).decode(),
        kaggle_accelerator={"gpu": "nvidiaTeslaT4", "tpu": "tpuV5E8", "none": "none"}[job.kaggle.accelerator],
        internet=job.kaggle.internet,
        gpu=job.kaggle.accelerator == "gpu",
        session_start_env=layout.SESSION_START_ENV,
        unattended=unattended,
        pip=bool(job.kaggle.pip),
    )
    if unattended:
        template = _next_template(env, values, job, owner)
        payload = _zip({**files, nextkernel.NEXT_FILE: template.encode()})
        notebook = nextkernel.fill_notebook(json.loads(template)["notebook"], session, extra_sources or [], config,
                                            base64.b64encode(payload).decode())
    else:
        notebook = env.get_template("notebook.ipynb.j2").render(**values)
    rendered = Rendered(
        name=job.name,
        notebook=_canonical(notebook),
        metadata=_canonical(_metadata(env, job, owner, extra_sources)),
        fingerprint=fingerprint,
        config=config,
        embedded=tuple((name, len(data)) for name, data in sorted(code.items())),
        left_out=tuple(left_out),
    )
    if any(secret in json.dumps(config) + rendered.metadata for secret in secret_strings()):
        raise RenderError(f"{job.path}: params: a value holds your Kaggle key; remove it (attach it to the "
                          "notebook as a Kaggle Secret instead)")
    return rendered


@dataclass(frozen=True)
class Payload:
    """What the notebook embeds, unpacked: the work folder of the other targets (kchain/targets/)."""

    files: dict[str, bytes]  # the runtime and the user's code, by path in the folder
    config: dict[str, Any]  # the runtime config, its fingerprint included
    fingerprint: str  # the same as render_job's for this job: a smoke pass counts for every target
    embedded: tuple[tuple[str, int], ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()


def render_payload(job: Job, accelerator: str) -> Payload:
    """Pure: the runtime and code files, the config and the fingerprint, with the same guards as
    render_job (no credential file or key, nothing .kchainignore lists). `accelerator` (gpu or none)
    is what the runtime checks it was given; config["kaggle"] holds no Kaggle owner or dataset."""
    config = _session_config(job, None, None)
    config["kaggle"] = {**config["kaggle"], "accelerator": accelerator}
    code, left_out = code_files(job)
    files = {**_runtime_files(), **code}
    config["fingerprint"] = fingerprint = _fingerprint(config, _zip(files))
    if any(secret in json.dumps(config) for secret in secret_strings()):
        raise RenderError(f"{job.path}: params: a value holds your Kaggle key; remove it")
    return Payload(files=files, config=config, fingerprint=fingerprint,
                   embedded=tuple((name, len(data)) for name, data in sorted(code.items())),
                   left_out=tuple(left_out))


def _next_template(env: jinja2.Environment, values: dict[str, Any], job: Job, owner: str | None) -> str:
    """The unattended chain's template (nextkernel.NEXT_FILE): the notebook with the values that change
    from session to session as placeholders, the metadata with the job's own sources, and what the
    kernel needs to push (its ref, the session limit, the budget)."""
    placeholders = {"session": nextkernel.SESSION, "state_sources": nextkernel.STATES,
                    "config_json": nextkernel.CONFIG, "payload": nextkernel.PAYLOAD}
    notebook = _canonical(env.get_template("notebook.ipynb.j2").render(**{**values, **placeholders}))
    chain = {"kernel": f"{owner}/{job.name}", "session_limit_s": job.train.session_limit_s,
             "weekly_gpu_hours": job.budget.weekly_gpu_hours, "gpu": job.gpu, "job_file": job.path.name,
             "cache_dataset": cache_dataset(owner, job.name) if owner else None, "image": None,
             # A GPU chain hands each push to a CPU relay (common/relay.py), so it holds one GPU slot at a time.
             "relay": doctor_kernel(owner, job.name) if owner and job.gpu else None}
    return json.dumps({"format": nextkernel.FORMAT, "notebook": notebook, "chain": chain,
                       "metadata": _canonical(_metadata(env, job, owner, None))}, sort_keys=True)


def _session_config(job: Job, owner: str | None, session_facts: dict | None, unattended: bool = False) -> dict:
    """The runtime's config plus who runs it and where its state goes (config["kaggle"]), as the
    notebook embeds it (RuntimeConfig.to_dict)."""
    kaggle = KaggleConfig(
        owner=owner,
        state_dataset=state_dataset(owner, job.name) if owner else None,
        cache_dataset=cache_dataset(owner, job.name) if owner else None,
        internet=job.kaggle.internet,
        accelerator=job.kaggle.accelerator,
        mount_wait_s=parse_duration(job.kaggle.mount_wait),
        unattended=unattended,
        **(session_facts or {}),
    )
    return dataclasses.replace(runtime_config(job), kaggle=kaggle, kchain_version=kchain.__version__).to_dict()


def _fingerprint(config: dict, payload: bytes) -> str:
    """What the code does: the code, params, settings and runtime. Not who runs it or where its state
    goes (config["kaggle"]), so a smoke pass made before the credentials were set still counts."""
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in config.items() if k != "kaggle"}, sort_keys=True).encode())
    digest.update(payload)
    return digest.hexdigest()


def _metadata(env, job: Job, owner: str | None, extra_sources: list[str] | None) -> str:  # noqa: ANN001
    return env.get_template("kernel-metadata.json.j2").render(
        kernel_id=f"{owner}/{job.name}" if owner else job.name,
        title=job.name,
        code_file=f"{job.name}.ipynb",
        private=job.kaggle.private,
        gpu=job.kaggle.accelerator == "gpu",
        tpu=job.kaggle.accelerator == "tpu",
        internet=job.kaggle.internet,
        machine_shape=MACHINE_SHAPES[job.kaggle.accelerator],
        dataset_sources=list(job.kaggle.datasets) + job_sources(job, owner) + list(extra_sources or []),
        competition_sources=[job.kaggle.competition] if job.kaggle.competition else [],
        model_sources=list(job.kaggle.models),
        pinning="original" if job.kaggle.image == "pin" else "latest",
    )


def job_sources(job: Job, owner: str | None) -> list[str]:
    """The datasets kchain attaches for the job itself beside its own: the wheels of kaggle.pip (the newest
    version, which push makes the one for these pins: kagglepip.ensure)."""
    return [pip_dataset(owner, job.name)] if job.kaggle.pip and owner else []


def write_rendered(rendered: Rendered, out_dir: Path) -> list[Path]:
    """Write the notebook and kernel-metadata.json into out_dir (atomically) and return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    nb_path = out_dir / rendered.notebook_file
    meta_path = out_dir / METADATA_FILE
    atomic.write_text(nb_path, rendered.notebook)
    atomic.write_text(meta_path, rendered.metadata)
    return [nb_path, meta_path]


def render_probe(job: Job, ref: str, sources: list[str], state: str | None,
                 secret_labels: tuple[str, ...], packages: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """Pure: the doctor's probe notebook (kernel_templates/probe.ipynb.j2, the runtime and
    kchain_probe.py embedded) and its metadata as a dict: kernel ref, accelerator none, the job's
    internet setting, the given dataset and model sources (a model's ref has five parts) and the job's
    competition; `packages`: the modules the job's code imports whose versions the probe reports."""
    competitions = [job.kaggle.competition] if job.kaggle.competition else []
    models = [s for s in sources if s.count("/") == 4]
    datasets = [s for s in sources if s not in models]
    config = {"job": job.name, "sources": sources + competitions, "state_dataset": state,
              "secret_labels": list(secret_labels),
              "internet": job.kaggle.internet, "kernel": ref, "packages": list(packages), "pip": list(job.kaggle.pip)}
    files = {**_runtime_files(), "kchain_probe.py": (templates_dir() / "kchain_probe.py").read_bytes()}
    notebook = _environment().get_template("probe.ipynb.j2").render(
        job=job.name, version=kchain.__version__, internet=job.kaggle.internet,
        config_json=json.dumps(config, sort_keys=True), payload=base64.b64encode(_zip(files)).decode())
    metadata = {"id": ref, "language": "python", "kernel_type": "notebook", "is_private": True,
                "enable_gpu": False, "enable_tpu": False, "enable_internet": job.kaggle.internet,
                "dataset_sources": datasets, "competition_sources": competitions, "kernel_sources": [],
                "model_sources": models,
                "keywords": [], "docker_image_pinning_type": "original"}
    return _canonical(notebook), metadata
