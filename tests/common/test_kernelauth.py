# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""One Kaggle door in the kernel: the Secrets lookup and the authenticated client are written once
(kchain/common/kernelauth.py), and through it a kernel of the local Kaggle reaches Kaggle with the Secrets
attached, is told why not without them, and prints no value either way."""

from __future__ import annotations

import json
import re
from pathlib import Path

from emulator_helpers import USER, emulator, write_kernel  # noqa: F401

from kchain.common import kernelauth
from kchain.kaggle.client import KaggleClient

REPO = Path(__file__).resolve().parents[2]
DOOR = REPO / "kchain" / "common" / "kernelauth.py"
STAND_IN = REPO / "kchain" / "emulator" / "sessions.py"  # the local Kaggle's kaggle_secrets for its sessions
KERNEL_SIDE = ("kchain/common", "kchain/runtime", "kernel_templates")  # what runs inside a kernel


def sources(folders: tuple[str, ...]) -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for folder in folders for p in sorted((REPO / folder).rglob("*.py"))
            if "__pycache__" not in p.parts}


def test_the_secrets_lookup_and_the_authenticated_client_are_written_once():
    secrets_lookup = [p.relative_to(REPO) for p, text in sources(("kchain", "kernel_templates")).items()
                      if re.search(r"UserSecretsClient|kaggle_secrets", text) and p not in (DOOR, STAND_IN)]
    assert secrets_lookup == [], f"a second Secrets lookup: use kchain.common.kernelauth in {secrets_lookup}"
    clients = [p.relative_to(REPO) for p, text in sources(KERNEL_SIDE).items()
               if re.search(r"\.authenticate\(\)|KaggleApi\(\)|KAGGLE_API_V1_TOKEN", text) and p != DOOR]
    assert clients == [], f"a second authenticated client in the kernel: use kchain.common.kernelauth in {clients}"


CELL = """from kchain.common import kernelauth
try:
    api = kernelauth.login()
except kernelauth.NoCredential as exc:
    print("no credential:", exc, flush=True)
else:
    print("authenticated; datasets seen:", len(api.dataset_list(user="alice")), flush=True)
"""


def log(ref: str) -> str:
    return "".join(chunk.get("data", "") for chunk in json.loads(KaggleClient().log(ref, 1) or "[]"))


def test_a_kernel_reaches_kaggle_through_the_door_with_its_secrets_and_is_told_why_not_without(emulator, tmp_path):
    key = emulator.users[USER]
    emulator.secrets.update({USER: {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": key}})
    api = KaggleClient()
    for name in ("door-on", "door-off"):
        write_kernel(tmp_path / name, f"{USER}/{name}", [CELL], enable_internet=True)
    emulator.attach_secrets(f"{USER}/door-on")  # the user attached them in the web UI; door-off has none
    for name in ("door-on", "door-off"):
        api.push(tmp_path / name)
        assert emulator.wait_session(f"{USER}/{name}")["status"] == "COMPLETE"
    assert "authenticated; datasets seen: 0" in log(f"{USER}/door-on")
    said = log(f"{USER}/door-off")
    assert "no credential: KAGGLE_USERNAME and KAGGLE_KEY could not be read from this kernel's Secrets (" in said
    for ref in (f"{USER}/door-on", f"{USER}/door-off"):
        assert key not in log(ref)  # the key is never printed, whichever way it went
    assert kernelauth.LABELS == ("KAGGLE_USERNAME", "KAGGLE_KEY")
