"""The doctor's probe: what today's Kaggle image really is, seen from inside a free CPU session.

Embedded into the probe notebook next to the kchain runtime (`kchain doctor` renders it) and run
as its own process with the same PYTHONPATH a training child gets. Standard library only, plus
torch and numpy when the image has them. It writes one JSON document, format `kchain-probe/1`,
to the kernel's output (`/kaggle/working/kchain-probe.json`) and prints it. Secrets are tested by
label and reported as visible or not: a value is never printed, written or kept.

    python -m kchain_probe CONFIG_JSON

Test switch: `KCHAIN_TEST_IMAGE_TORCH` / `KCHAIN_TEST_IMAGE_NUMPY`, when set (only the local
emulator sets them, to stand for an image with other versions), are reported as the image's torch
and numpy versions, and the output says they came from that switch.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

# The runtime is embedded next to this file; these parts of it are standard library only.
from kchain.common import atomic, kernelauth, layout, wheelinstall

FORMAT = "kchain-probe/1"
OUTPUT = "kchain-probe.json"
TEST_SWITCHES = {"torch": layout.TEST_IMAGE_TORCH_ENV, "numpy": layout.TEST_IMAGE_NUMPY_ENV}


def _module(name: str) -> dict:
    """Version of an importable module, or why it is not importable."""
    switch = TEST_SWITCHES.get(name)
    if switch and os.environ.get(switch):
        return {"version": os.environ[switch], "source": switch, "error": None}
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure means "the image cannot import it"
        return {"version": None, "source": "import", "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"version": str(getattr(module, "__version__", "unknown")), "source": "import", "error": None}


def _torch_build() -> dict:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return {"cuda_build": None, "cuda_available": False}
    return {"cuda_build": torch.version.cuda, "cuda_available": bool(torch.cuda.is_available())}


def _distribution(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _packages(modules: list[str]) -> dict:
    """Each package the job's code imports: its distribution and version in this image, or None where the
    image has no such module. Looked up, never imported (a framework's import takes seconds)."""
    import importlib.util
    from importlib.metadata import packages_distributions

    switched = json.loads(os.environ.get(layout.TEST_IMAGE_PACKAGES_ENV) or "{}")
    installed_by = packages_distributions()
    out = {}
    for name in modules:
        if name in switched:
            out[name] = {"distribution": name if switched[name] else None, "version": switched[name],
                         "source": layout.TEST_IMAGE_PACKAGES_ENV}
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        dist = (installed_by.get(name) or [None])[0] if found else None
        out[name] = {"distribution": dist, "version": (_distribution(dist) if dist else "unknown") if found else None,
                     "source": "import"}
    return out


def _mount(input_root: Path, ref: str) -> str | None:
    """Where an attached dataset owner/slug[/version], model owner/model/framework/variation/version or
    competition slug is mounted, whatever today's layout is (shared/reference/kaggle-api.md 6.2:
    datasets/<owner>/<slug>, models/<owner>/<model>/<framework>/<variation>/<version>,
    competitions/<slug>, or the legacy <slug> and <model>/...), else found by a shallow walk."""
    parts = ref.split("/")
    if len(parts) == 5:
        nested = input_root / layout.model_mount(ref)
        legacy = input_root / Path(*nested.parts[-4:])  # <model>/<framework>/<variation>/<version>
        found = [str(p) for p in (nested, legacy) if p.is_dir()]
        return found[0] if found else None
    slug = parts[1] if len(parts) > 1 else parts[0]
    nested = input_root / "datasets" / parts[0] / slug if len(parts) > 1 else input_root / "competitions" / slug
    for candidate in (nested, input_root / slug):
        if candidate.is_dir():
            return str(candidate)
    if input_root.is_dir():
        for dirpath, dirnames, _files in os.walk(input_root):
            depth = len(Path(dirpath).relative_to(input_root).parts)
            if slug in dirnames:
                return str(Path(dirpath) / slug)
            if depth >= 3:
                dirnames[:] = []
    return None


def _runtime(input_root: Path, job: str) -> dict:
    """Does the embedded runtime import, and which checkpoint would a session resume from?"""
    try:
        import kchain.runtime.checkpoint.state  # noqa: F401  (the torch half: does it import on this image?)
        from kchain.common.checkpoint_files import find_latest
    except Exception as exc:  # noqa: BLE001
        return {"imports": False, "error": f"{type(exc).__name__}: {exc}"[:300], "checkpoint": None}
    scratch = Path(tempfile.mkdtemp(prefix="kchain-probe-"))
    try:
        found = find_latest(scratch / "none", input_root, scratch, job)
    except Exception as exc:  # noqa: BLE001
        return {"imports": True, "error": f"{type(exc).__name__}: {exc}"[:300], "checkpoint": None}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if found is None:
        return {"imports": True, "error": None, "checkpoint": None}
    path, manifest = found
    return {"imports": True, "error": None,
            "checkpoint": {"path": str(path), "step": manifest.get("step"), "session": manifest.get("session")}}


def _ram_bytes() -> dict:
    meminfo: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            meminfo[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"total": meminfo.get("MemTotal"), "available": meminfo.get("MemAvailable")}


HOP_OUTPUT = "kchain-hop.json"
HOP_FORMAT = "kchain-hop/1"
# The version this probe pushes of its own kernel: does a kernel-pushed version keep its Secrets? (A report
# says `kaggle kernels push` resets a kernel's Secrets: kaggle-api.md 6.5.) It carries kchain.common as the
# probe got it (hop_payload) and reads the Secrets through its door (kernelauth.visible): whether each label was
# visible, never a value.
HOP_CELL = """# kchain doctor: a version pushed from inside a kernel: are its Secrets still attached?
import base64, io, json, sys, tempfile, zipfile
src = tempfile.mkdtemp(prefix="kchain-hop-")
zipfile.ZipFile(io.BytesIO(base64.b64decode(@PAYLOAD@))).extractall(src)
sys.path.insert(0, src)
from kchain.common import kernelauth
seen = kernelauth.visible()["visible"]
with open("@OUTPUT@", "w") as f:
    json.dump({"format": "@FORMAT@", "secrets": {"visible": seen}}, f)
print("[kchain] hop: Secret labels visible:", seen, flush=True)
""".replace("@OUTPUT@", HOP_OUTPUT).replace("@FORMAT@", HOP_FORMAT)


def hop_payload() -> str:
    """kchain.common as this probe runs it (its package root and modules), as a base64 zip: what the hop's
    cell needs to import the door, carried as the probe's own payload carried it."""
    package = Path(kernelauth.__file__).resolve().parents[1]  # .../kchain
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("kchain/__init__.py", (package / "__init__.py").read_bytes())
        for path in sorted((package / "common").glob("*.py")):
            z.writestr(f"kchain/common/{path.name}", path.read_bytes())
    return base64.b64encode(buffer.getvalue()).decode()


def _kernel_push(config: dict, secrets: dict) -> dict:
    """Whether a kernel may push a kernel on this account (an unattended chain needs it; Kaggle documents
    neither way): the next version of this probe's own kernel, pushed from inside it with the Secrets' key,
    runs HOP_CELL on a CPU session (accelerator none); `kchain doctor` reads its HOP_OUTPUT. The key lives
    in this process's environment only and is never printed or kept."""
    ref = config["kernel"] if "kernel" in config else None  # a probe rendered by an older kchain has none
    if not config["internet"] or not ref:
        return {"tried": False, "ok": False, "error": "internet is off for this kernel"}
    if not all(secrets["visible"].get(label) for label in kernelauth.LABELS):
        return {"tried": False, "ok": False, "error": f"no {' and '.join(kernelauth.LABELS)} in this kernel's Secrets"}
    folder = Path(tempfile.mkdtemp(prefix="kchain-probe-push-"))
    try:
        api = kernelauth.login()
        source = HOP_CELL.replace("@PAYLOAD@", json.dumps(hop_payload()))
        cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
        (folder / "probe.ipynb").write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4,
                                                        "nbformat_minor": 5}))
        (folder / "kernel-metadata.json").write_text(json.dumps({
            "id": ref, "title": ref.split("/", 1)[1], "code_file": "probe.ipynb", "language": "python",
            "kernel_type": "notebook", "is_private": True, "enable_gpu": False, "enable_internet": True}))
        answer = api.kernels_push(str(folder))
    except Exception as exc:  # noqa: BLE001 - the answer, whatever it is, is what the doctor records
        code = getattr(getattr(exc, "response", None), "status_code", None)  # requests' HTTPError has it
        said = f"HTTP {code}" if code else type(exc).__name__
        return {"tried": True, "ok": False, "error": f"{said}: {str(exc)[:200]}"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    error = str(getattr(answer, "error", "") or "")
    version = int(getattr(answer, "version_number", 0) or 0) or None
    return {"tried": True, "ok": not error, "error": error[:200] or None, "version": None if error else version}


def _pip(config: dict, input_root: Path) -> dict | None:
    """kaggle.pip proved: the job's wheels installed from its attached dataset with no index, as a session
    installs them, into a folder put on this process's path (so the packages' versions are looked up there)."""
    pins = list(config.get("pip") or [])
    if not pins:
        return None
    mount = wheelinstall.find_mount(input_root, config["job"])
    if mount is None:
        return {"pins": pins, "ok": False, "error": f"the dataset {wheelinstall.slug(config['job'])} is not mounted"}
    target = Path(tempfile.mkdtemp(prefix="kchain-site-"))
    error = wheelinstall.install(pins, mount, target)
    if error is None:
        sys.path.insert(0, str(target))
    return {"pins": pins, "ok": error is None, "error": error}


def probe(config: dict) -> dict:
    input_root, working = layout.input_root(os.environ), layout.working_root(os.environ)
    sources = list(config["sources"])
    pip = _pip(config, input_root)  # first: the packages below are looked up with its wheels installed
    report = {
        "format": FORMAT,
        "job": config["job"],
        "python": platform.python_version(),
        "torch": {**_module("torch"), **_torch_build()},
        "numpy": _module("numpy"),
        "kaggle_client": _distribution("kaggle"),
        "mounts": {ref: _mount(input_root, ref) for ref in sources},
        "state_dataset": config["state_dataset"],
        "runtime": _runtime(input_root, config["job"]),
        "disk_free_working": shutil.disk_usage(working if working.is_dir() else layout.root(os.environ)).free,
        "ram": _ram_bytes(),
        "kaggle_env": sorted(name for name in os.environ if name.startswith("KAGGLE_")),
        "secrets": kernelauth.visible(list(config["secret_labels"])),
        "internet": config["internet"],
        "packages": _packages(list(config.get("packages", []))),
        "platform": {"glibc": platform.libc_ver()[1] or None, "machine": platform.machine()},
        **({"pip": pip} if pip is not None else {}),
    }
    report["kernel_push"] = _kernel_push(config, report["secrets"])
    return report


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[1]).read_text())
    report = probe(config)
    text = json.dumps(report, indent=1, sort_keys=True)
    atomic.write_text(layout.working_root(os.environ) / OUTPUT, text + "\n")
    print(f"[kchain] probe {FORMAT}:\n{text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
