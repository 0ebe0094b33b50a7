"""Test isolation: every test gets its own HOME, kchain home, Kaggle config dir and TMPDIR.

The official kaggle client reads KAGGLE_API_ENVIRONMENT once, when it is first imported, so the
emulator's routing (LOCALHOST + an HTTP proxy) is set here, before any test can import it.
"""

from __future__ import annotations

import compileall
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
# One OpenMP thread per training process: 3 xdist workers each run sessions, smokes and references
# at once on 2 cores, and torch's default of a thread per core makes OpenMP threads spin-wait for
# each other (the smoke makes the same choice for its runs: smoke.threads_each). Every run of a
# comparison gets the same count, so traces stay comparable bit for bit.
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR"):
    os.environ.pop(_var, None)

REPO = Path(__file__).resolve().parent.parent
# The shared helpers (tests/*.py), and each folder's test modules by their unique names: a test may use
# another's fixture builders (`from test_checkpointer import parts`), as pytest imports them (rootdir, prepend).
sys.path[:0] = [str(REPO / "tests"), *sorted({str(p.parent) for p in (REPO / "tests").glob("*/**/test_*.py")})]


def pytest_configure(config: pytest.Config) -> None:
    """kchain byte-compiled once, by the process that starts the suite, before its workers exist. Where the
    environment sets PYTHONDONTWRITEBYTECODE (this project's machines do), no process writes a .pyc, so each
    worker, CLI and executor the suite starts compiled kchain again: about 4 CPU-s a worker. A .pyc is
    checked against its source's size and time when read, so one left from an older tree is never used.
    (A notebook's copy of the runtime is unpacked anew by each session, as on Kaggle, and compiles there.)"""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(REPO / "kchain", quiet=1)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path / "home"
    (home / ".kaggle").mkdir(parents=True)
    # Short, as Kaggle's /tmp is: DataLoader workers make Unix sockets under TMPDIR, and a path past
    # 107 bytes (easy under pytest-of-<user>/pytest-N/popen-gwN/<test name>) loses their batches.
    tmp = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KCHAIN_HOME", str(tmp_path / "kchain-home"))
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(home / ".kaggle"))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield home
    shutil.rmtree(tmp, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order CI's workers take the tests in (`-n 6 --dist loadgroup`: one test at a time to whichever
    worker is free). The `slow` ones go first, so the suite ends on short tests, not on a chain that
    started late while the other cores sit idle. Tests that share a module-scoped fixture of their module
    (a reference run) form one group, so a worker runs it once for all of them."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d[-1].scope == "module" and d[-1].baseid == item.nodeid.split("::")[0] for d in defs.values() if d):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
