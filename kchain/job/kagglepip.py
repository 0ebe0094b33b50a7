"""`kaggle.pip`: packages Kaggle's image lacks, for a kernel with the internet off.

The laptop downloads each pinned package's wheel for the kernel's interpreter (`pip download --no-deps
--only-binary=:all: --platform ... --python-version ...`, bounded, a progress line per batch), once: the wheels are kept under the job's
state folder by a fingerprint of the pins and the kernel's Python and platform (`build`). `push` and
`continue` make the newest version of `<owner>/<name>-pip` hold exactly those wheels, uploading a version
only when the fingerprint changed (`ensure`); render attaches that dataset, and the notebook installs
from it with no index before training (kchain/common/wheelinstall.py). A smoke and a rehearsal mount the
same wheels plus this laptop's own (`_mount_folder`), so the code that imports them runs here too.

The kernel's Python and platform come from the doctor's probe when it has run (the image's own), else
from what Kaggle's image is known to run (KERNEL_PYTHON, KERNEL_PLATFORM: an assumption, said so).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kchain.common import atomic, layout
from kchain.common.statefolder import write_dataset_metadata
from kchain.errors import KaggleError, KchainError, SpecError
from kchain.job.spec import Job
from kchain.store.ledger import Ledger, state_dir

Echo = Callable[[str], None]
FORMAT = "kchain-wheels/1"
# Kaggle's image, as assumed until the doctor's probe has looked: CPython 3.11 on Ubuntu 22.04 (glibc 2.35).
KERNEL_PYTHON, KERNEL_PLATFORM = "3.11", "manylinux_2_35_x86_64"
KERNEL_DIR, HERE_DIR, MOUNT_DIR = "kernel", "here", "mount"
CACHE_DIR = "wheels"  # under the job's state folder: one folder per fingerprint


@dataclass(frozen=True)
class Target:
    """The interpreter the wheels are for: CPython `python` (major.minor) on `platform` (a wheel platform tag)."""

    python: str
    platform: str
    source: str  # "probe" (the doctor saw the image) or "assumed"

    def said(self) -> str:
        seen = "as the doctor's probe saw the image" if self.source == "probe" else \
            "Kaggle's image as assumed; `kchain doctor` reads the real one"
        return f"CPython {self.python} on {self.platform} ({seen})"


def kernel_target(probe: dict[str, Any] | None) -> Target:
    """The kernel's interpreter from the doctor's probe report (python, platform), else the assumed one."""
    probe = probe or {}
    version = re.match(r"(\d+)\.(\d+)", str(probe.get("python") or ""))
    if not version:
        return Target(KERNEL_PYTHON, KERNEL_PLATFORM, "assumed")
    machine = (probe.get("platform") or {}).get("machine") or "x86_64"
    glibc = re.match(r"(\d+)\.(\d+)", str((probe.get("platform") or {}).get("glibc") or ""))
    platform = f"manylinux_{glibc[1]}_{glibc[2]}_{machine}" if glibc else KERNEL_PLATFORM
    return Target(f"{version[1]}.{version[2]}", platform, "probe")


def fingerprint(pins: list[str], target: Target) -> str:
    """What the wheels are: the pins (in any order) and the interpreter they are for."""
    data = {"format": FORMAT, "pins": sorted(pins), "python": target.python, "platform": target.platform}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# Every pip call is bounded: each network wait PIP_TIMEOUT_S, PIP_RETRIES more tries of a failed one, and the
# whole call PIP_CALL_S (a batch of large wheels on a slow line may take long; a pip that hangs does not).
PIP_TIMEOUT_S, PIP_RETRIES, PIP_CALL_S = 15, 2, 3600
BATCH = 100  # pins per pip call: one pip start per batch, not per pin, and a progress line per batch
# pip's words for an index it could not reach (urllib3's errors and pip's own).
_UNREACHABLE = re.compile(r"NewConnectionError|ConnectTimeoutError|ReadTimeoutError|NameResolutionError|"
                          r"Max retries exceeded|connection broken by|Could not fetch URL|ProxyError")
_NO_WHEEL = re.compile(r"No matching distribution found for (\S+)")


def pip_command(pins: list[str], dest: Path, target: Target | None) -> list[str]:
    """pip download of the pins' wheels into dest (for target, or for this interpreter when None), bounded
    (PIP_TIMEOUT_S, PIP_RETRIES). pip's own settings apply (an index mirror, PIP_FIND_LINKS)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES)]
    if target is not None:
        cmd += ["--platform", target.platform, "--python-version", target.python, "--implementation", "cp"]
    return [*cmd, *pins]


def _download(pins: list[str], dest: Path, target: Target | None) -> str | None:
    """Download the pins' wheels; None when they all landed, else the pin pip found no wheel of (pip stops at
    the first). An index pip could not reach, or any other failure, is a KchainError in one line."""
    try:
        proc = subprocess.run(pip_command(pins, dest, target), capture_output=True, text=True, timeout=PIP_CALL_S)
    except OSError as exc:
        raise KchainError(f"kaggle.pip: cannot run pip ({exc.strerror}); install pip in this environment") from None
    except subprocess.TimeoutExpired:
        raise KchainError(f"kaggle.pip: pip took more than {PIP_CALL_S} s to download {len(pins)} wheel(s) "
                          f"({pins[0]} ...) and was stopped; check the connection and run the command again") from None
    if proc.returncode == 0:
        return None
    said = proc.stderr + proc.stdout
    if "No module named pip" in said:
        raise KchainError(f"kaggle.pip: this environment ({sys.executable}) has no pip; install it "
                          "(python -m ensurepip) and run the command again")
    if _UNREACHABLE.search(said):
        raise KchainError(f"kaggle.pip: the package index {_indexes(said)} cannot be reached (pip gave up after "
                          f"{PIP_RETRIES} retries with a {PIP_TIMEOUT_S} s timeout each); check the connection, or "
                          "pip's index settings (PIP_INDEX_URL, pip.conf), and run the command again")
    if (found := _NO_WHEEL.search(said)) and (pin := _pin_named(found[1], pins)) is not None:
        return pin
    lines = [line.strip() for line in said.splitlines() if line.strip() and not line.startswith(("Looking in",
                                                                                                   "Collecting"))]
    why = (lines[-1] if lines else f"pip exited {proc.returncode}")[:300]
    raise KchainError(f"kaggle.pip: pip could not download {pins[0] if len(pins) == 1 else f'{len(pins)} wheels'}: "
                      f"{why}; check the connection (or pip's index settings) and run the command again")


def _indexes(said: str) -> str:
    """The network indexes pip says it looked in ("Looking in indexes: ..."), without any user or password; pip
    names none when it uses its default index alone."""
    looked = next((line.split(":", 1)[1] for line in said.splitlines() if line.startswith("Looking in indexes:")), "")
    urls = [urlsplit(u.strip()) for u in looked.split(",") if u.strip().startswith(("http://", "https://"))]
    named = [urlunsplit(u._replace(netloc=u.hostname + (f":{u.port}" if u.port else "")))
             for u in urls if u.hostname]
    return " or ".join(named) if named else "https://pypi.org/simple (pip's default)"


def _pin_named(requirement: str, pins: list[str]) -> str | None:
    """The pin a requirement pip names is ("Foo_Bar==1.0" for foo-bar==1.0)."""
    def name(text: str) -> str:
        return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~;\[ ]", text, maxsplit=1)[0]).lower()
    return next((pin for pin in pins if name(pin) == name(requirement)), None)


def _fetch(pins: list[str], dest: Path, target: Target | None) -> list[str]:
    """Download the pins' wheels in one pip call (again without each pin pip found no wheel of); the pins
    with no wheel."""
    left, missing = list(pins), []
    while left:
        pin = _download(left, dest, target)
        if pin is None:
            break
        missing.append(pin)
        left.remove(pin)
    return missing


def build(job: Job, target: Target, cache: Path, echo: Echo) -> Path:
    """The folder of the job's wheels for target: kernel/ (what the dataset holds, with WHEELS_MANIFEST) and
    here/ (this laptop's own, for a smoke), downloaded once per fingerprint, BATCH pins a pip call (a line
    each when there are more); a pin with no wheel for either is a SpecError naming it."""
    pins = list(job.kaggle.pip)
    done = cache / fingerprint(pins, target)[:16]
    if (done / KERNEL_DIR / layout.WHEELS_MANIFEST).is_file():
        return done
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=layout.TMP_PREFIX, dir=cache))
    try:
        echo(f"  kaggle.pip downloading {len(pins)} wheel(s) for {target.said()}, once")
        missing: list[str] = []
        for first in range(0, len(pins), BATCH):
            batch = pins[first:first + BATCH]
            if len(pins) > BATCH:
                echo(f"  kaggle.pip: wheels {first + 1}-{first + len(batch)} of {len(pins)} (for the kernel, then "
                     "this laptop)")
            for where, dest in ((target, work / KERNEL_DIR), (None, work / HERE_DIR)):
                missing += [f"{pin} ({'the kernel' if where else 'this laptop'})" for pin in _fetch(batch, dest, where)]
        if missing:
            raise SpecError(f"{job.path}: kaggle.pip: no wheel of {', '.join(missing)} for {target.said()} or this "
                            "laptop; pin a version that ships a wheel (pip cannot build one in a kernel with the "
                            "internet off)")
        wheels = sorted(p.name for p in (work / KERNEL_DIR).glob("*.whl"))
        atomic.write_json(work / KERNEL_DIR / layout.WHEELS_MANIFEST, {
            "format": FORMAT, "job": job.name, "pins": pins, "python": target.python, "platform": target.platform,
            "fingerprint": fingerprint(pins, target), "wheels": wheels})
        shutil.rmtree(done, ignore_errors=True)
        os.replace(work, done)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done


def _mount_folder(built: Path) -> Path:
    """One flat folder of both sets (the kernel's and this laptop's: the same file where the two agree), as the
    smoke and the rehearsal mount the dataset, so pip on this machine finds a wheel it can install."""
    mount = built / MOUNT_DIR
    if mount.is_dir():
        return mount
    work = Path(tempfile.mkdtemp(prefix=layout.TMP_PREFIX, dir=built))
    for folder in (built / KERNEL_DIR, built / HERE_DIR):
        for path in folder.iterdir():
            if not (work / path.name).exists():
                shutil.copy2(path, work / path.name)
    os.replace(work, mount)
    return mount


def _job_ledger(job: Job) -> Ledger:
    """The job's own state folder (not a rehearsal's): its doctor's record and its wheels cache."""
    return Ledger(state_dir(job.path))


def local_folder(job: Job, echo: Echo) -> Path:
    """The folder a smoke or a rehearsal mounts as the job's wheels dataset."""
    ledger = _job_ledger(job)
    target = kernel_target(ledger.doctor_entry(job.name).get("probe"))
    return _mount_folder(build(job, target, ledger.root / CACHE_DIR, echo))


def ensure(client: Any, job: Job, owner: str, echo: Echo) -> str:
    """Before a push: the newest version of <owner>/<name>-pip holds the wheels for these pins and the kernel's
    interpreter (read from its WHEELS_MANIFEST); else they are built (once) and uploaded as a new version, sent
    once and a lost answer settled by reading. Returns the dataset's ref."""
    from kchain.kaggle import datasets
    from kchain.store.names import pip_dataset

    ref = pip_dataset(owner, job.name)
    ledger = _job_ledger(job)
    target = kernel_target(ledger.doctor_entry(job.name).get("probe"))
    cache = ledger.root / CACHE_DIR
    wanted = fingerprint(list(job.kaggle.pip), target)
    if _newest_fingerprint(client, ref, echo) == wanted:
        return ref
    built = build(job, target, cache, echo)
    created = datasets.ensure_dataset(client, ref, f"{job.name} wheels", echo)
    upload = Path(tempfile.mkdtemp(prefix="kchain-wheels-"))
    try:
        folder = upload / "wheels"
        shutil.copytree(built / KERNEL_DIR, folder)
        write_dataset_metadata(folder, ref, f"{job.name} wheels")
        number = datasets.new_version(client, folder, ref, f"kchain wheels {wanted[:12]}", "skip", echo)  # ready
    finally:
        shutil.rmtree(upload, ignore_errors=True)
    echo(f"  kaggle.pip {ref} version {number}{' (new dataset)' if created else ''}: "
         f"{', '.join(job.kaggle.pip)} for {target.said()}")
    return ref


def _newest_fingerprint(client: Any, ref: str, echo: Echo) -> str | None:
    """The fingerprint in the newest version's WHEELS_MANIFEST; None when there is no dataset or no manifest."""
    from kchain.kaggle.client import missing

    if not client.dataset_exists(ref):
        return None
    from kchain.kaggle import datasets

    datasets.wait_ready(client, ref, echo)
    folder = Path(tempfile.mkdtemp(prefix="kchain-wheels-"))
    try:
        path = client.download_dataset_file(ref, None, layout.WHEELS_MANIFEST, folder)
        return json.loads(Path(path).read_text(encoding="utf-8")).get("fingerprint")
    except KaggleError as exc:
        if missing(exc):
            return None
        raise
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
