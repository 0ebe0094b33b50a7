"""`kaggle.pip` in the session: the job's pinned wheels, installed from its attached `<job>-pip` dataset
before training starts.

    python -m kchain.common.wheelinstall CONFIG_JSON TARGET

The notebook runs this before the training process (on Kaggle and in a smoke alike). pip installs with
no index (an internet-off kernel has none; on the laptop nothing is downloaded either), no dependencies
(the pins are the whole list: the laptop built exactly these wheels) and only wheels, into TARGET, a
folder of its own that the notebook puts on the training process's PYTHONPATH. The image's
site-packages, and in a smoke the laptop's environment, are never changed.

Exit 0 when every pin is installed (or the job pins nothing); 1 with one `[kchain] kaggle.pip:` line
that names what is missing and what to do. Standard library only: pip runs as a child.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from kchain.common import layout
from kchain.common.config import RuntimeConfig
from kchain.common.say import emit

POLL_S = 2.0


def slug(job: str) -> str:
    """The slug of the job's wheels dataset, as the laptop names it (names.pip_dataset)."""
    return f"{job}{layout.PIP_SUFFIX}"


def find_mount(input_root: Path, job: str) -> Path | None:
    """The attached `<job>-pip` dataset, in either input layout; None if it is not mounted."""
    for mount in layout.mounts(input_root, ("datasets",)):
        if mount.name == slug(job):
            return mount
    return None


def _await_mount(input_root: Path, job: str, wait_s: float, sleep=time.sleep) -> Path | None:  # noqa: ANN001
    """The mount, waited for up to wait_s (Kaggle mounts a fresh version late, as it does the state)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = find_mount(input_root, job)
        if found is not None or time.monotonic() >= deadline:
            return found
        sleep(POLL_S)


def here() -> str:
    """This interpreter and machine, as the laptop's build names them (CPython 3.11, Linux x86_64)."""
    return f"{platform.python_implementation()} {sys.version_info[0]}.{sys.version_info[1]}, " \
           f"{platform.system()} {platform.machine()}"


def _install_command(pins: list[str], folder: Path, target: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "pip", "install", "--no-index", "--find-links", str(folder), "--no-deps",
            "--only-binary=:all:", "--target", str(target), "--disable-pip-version-check", "--no-input",
            "--no-warn-script-location", "--quiet", *pins]


def install(pins: list[str], folder: Path, target: Path) -> str | None:
    """Install the pins from folder alone into target; None when done, else the one line that says why not.
    pip's own settings (PIP_* variables: an index, extra find-links) are left out: the wheels are all it gets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    proc = subprocess.run(_install_command(pins, folder, target), capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return None
    said = proc.stderr + proc.stdout
    missing = re.findall(r"No matching distribution found for (\S+)", said)
    if missing:
        return (f"no wheel of {', '.join(missing)} in {folder} for this interpreter ({here()}): the laptop built "
                "the wheels for another Python or platform; run `kchain doctor` (it records the image's Python), "
                "smoke and push again")
    last = [line.strip() for line in said.splitlines() if line.strip()][-1:] or [f"pip exited {proc.returncode}"]
    return f"pip could not install {', '.join(pins)} from {folder}: {last[0][:300]}"


def main(argv: list[str]) -> int:
    config = RuntimeConfig.from_dict(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    pins = list(config.pip)
    if not pins:
        return 0
    target = Path(argv[1])
    job = config.job
    wait_s = config.kaggle.mount_wait_s
    folder = _await_mount(layout.input_root(os.environ), job, wait_s)
    if folder is None:
        emit(f"[kchain] kaggle.pip: the dataset {slug(job)} is not attached to this session (waited {wait_s:.0f}s); "
             "push the job with kchain, which builds and attaches it")
        return 1
    started = time.monotonic()
    problem = install(pins, folder, target)
    if problem:
        emit(f"[kchain] kaggle.pip: {problem}")
        return 1
    emit(f"[kchain] kaggle.pip: installed {', '.join(pins)} from {folder} (no index) in "
         f"{time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
