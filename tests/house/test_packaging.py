"""What a `pip install kchain` user gets: the wheel and the sdist built from a copy of this checkout, as
setuptools builds them for PyPI, without a warning; the metadata a registry shows; the templates in the
wheel; an sdist from which the suite runs (the example jobs and docs its tests read)."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import kchain

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a hung build fails the test instead of hanging CI; never a speed bound
LEFT_BEHIND = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", ".kchain", "__pycache__",
                                     ".pytest_cache", ".ruff_cache", "out")
BUILD = "from setuptools import build_meta as b; b.build_sdist('dist'); b.build_wheel('dist')"


def files_under(root: Path, *folders: str) -> set[str]:
    return {p.relative_to(root).as_posix() for f in folders for p in (root / f).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".kchain" not in p.parts}


def test_the_wheel_and_sdist_build_without_warnings_with_their_metadata_templates_and_suite(tmp_path):
    source = tmp_path / "kchain"
    shutil.copytree(REPO, source, ignore=LEFT_BEHIND)
    # The copy's own setuptools, no build isolation: nothing is downloaded in a test.
    built = subprocess.run([sys.executable, "-c", BUILD], cwd=source, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert built.returncode == 0, built.stderr
    log = built.stdout + built.stderr
    for warning in ("would be ignored", "Deprecat", "is absent from the `packages`"):
        assert warning not in log, log

    (wheel,) = (source / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = email.message_from_bytes(whl.read(f"kchain-{kchain.__version__}.dist-info/METADATA"))
    templates = files_under(REPO, "kchain/init_templates") | {
        f"kchain/{name}" for name in files_under(REPO, "kernel_templates")}
    assert templates - names == set()
    assert f"kchain-{kchain.__version__}.dist-info/licenses/LICENSE" in names
    assert metadata["Version"] == kchain.__version__
    assert metadata["Requires-Python"] == ">=3.11"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("Provides-Extra") == ["hf", "lightning", "accelerate", "plot", "trackers", "dev"]
    requires = metadata.get_all("Requires-Dist")
    assert requires is not None
    assert [r for r in requires if r.startswith("matplotlib")] == ['matplotlib>=3.7; extra == "plot"',
                                                                  'matplotlib>=3.7; extra == "dev"']
    assert not [r for r in requires if "skypilot" in r]

    (sdist,) = (source / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        carried = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert files_under(source, "tests", "jobs", "docs", "kchain", "kernel_templates") - carried == set()
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= carried
