"""Shared fixtures for tests that need a Kaggle: the local emulator and throwaway credentials.

Credentials are made at run time (a random key per test), never committed. Use in a test module:

    from emulator_helpers import emulator, kaggle_api, write_kernel  # noqa: F401  (fixtures)

    def test_x(emulator, kaggle_api, tmp_path):
        write_kernel(tmp_path / "k", "alice/hello-world", ["print('hi')"])
        kaggle_api.kernels_push(str(tmp_path / "k"))
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kchain.emulator import Emulator
from kchain.emulator.app import PATIENCE_S
from kchain.local.executor import (
    start_session,  # each session's notebook driven from a thread, as rehearse's are
)

USER = "alice"


def fake_key() -> str:
    """A fresh random key in the shape of a Kaggle API key."""
    return secrets.token_hex(16)


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    """A running emulator with user alice (random key), the client env pointed at it, and Kaggle's strict
    behaviour (the default Switches(): 403 for missing, invisible new versions, ...). A session's time limit
    is only a net for one that hangs: a test whose session must reach its limit calls emulator.expire, so
    no test depends on how fast this machine starts and runs a session."""
    emu = Emulator(tmp_path / "kaggle-state", users={USER: fake_key()}, session_limit_s=PATIENCE_S,
                   gpu_quota_s=30 * 3600, max_gpu_sessions=2, start_notebook=start_session)
    emu.start()
    for name, value in emu.env(USER).items():
        monkeypatch.setenv(name, value)
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def kaggle_api(emulator: Emulator) -> Any:
    """The official client, authenticated against the emulator as alice."""
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    return api


def notebook_json(cells: list[str]) -> str:
    return json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c}
                  for c in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    })


def write_kernel(folder: Path, ref: str, cells: list[str], **metadata: Any) -> Path:
    """A kernel folder (notebook + kernel-metadata.json) that `kernels_push` accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.ipynb").write_text(notebook_json(cells))
    meta = {"id": ref, "title": ref.split("/")[1].replace("-", " ").title(), "code_file": "kernel.ipynb",
            "language": "python", "kernel_type": "notebook", "is_private": True, "enable_gpu": False,
            "enable_internet": False}
    meta.update(metadata)
    (folder / "kernel-metadata.json").write_text(json.dumps(meta))
    return folder


def write_dataset(folder: Path, ref: str, files: Mapping[str, bytes | str], title: str | None = None) -> Path:
    """A dataset folder (files + dataset-metadata.json) for dataset_create_new / _version."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    meta = {"id": ref, "title": title or ref.split("/")[1].replace("-", " ").title(),
            "licenses": [{"name": "CC0-1.0"}]}
    (folder / "dataset-metadata.json").write_text(json.dumps(meta))
    return folder


def wait_dataset_ready(api: Any, ref: str, timeout: float = 60) -> None:
    """Poll the dataset's status through the client until "ready"; a new version answers 403/404 a while."""
    import requests

    deadline = time.time() + timeout
    while True:
        try:
            if api.dataset_status(ref) == "ready":
                return
        except requests.HTTPError as e:
            if e.response is None or e.response.status_code not in (403, 404):
                raise
        if time.time() > deadline:
            raise TimeoutError(f"dataset {ref} not ready after {timeout} s")
        time.sleep(0.1)


def wait_dataset_mounted(api: Any, ref: str, emu: Emulator) -> None:
    """Ready, then the emulator's mount lag (switches.mount_lag_s): a session started now gets it mounted.
    "Ready" is not "mounted" on Kaggle either (docs/emulator.md); a test not about the lag waits it out."""
    wait_dataset_ready(api, ref)
    time.sleep(emu.switches.mount_lag_s)
