"""The kernel's one door to Kaggle: the credential in the kernel's Secrets, and the official client authenticated with it.

Every process kchain runs inside a kernel that talks to Kaggle goes through here: the publisher
(`publish.py`), the CPU relay (`relay.py`) and the doctor's probe (`kernel_templates/kchain_probe.py`, and the
version of its kernel it pushes, which carries this module). Kaggle's images ship `kaggle_secrets`; the local
Kaggle's sessions get a stand-in that talks to its secrets endpoint the same way (kchain/emulator/sessions.py).

The credential lives in the environment of the process that asked for it, and nowhere else: it is never
printed, logged or written to a file, and a failure is named by its exception's class, never its text (a
backend's message may carry what it was sent). Standard library and kchain.common; `kaggle_secrets` and the
official client are imported inside the functions that use them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kchain.common import sendonce

LABELS = ("KAGGLE_USERNAME", "KAGGLE_KEY")  # the Secrets' labels kchain reads: the user's name and API key
# Kaggle mounts a session token that the client prefers to the user's key (kagglesdk 1.3): dropped first.
SESSION_TOKEN_ENV = "KAGGLE_API_V1_TOKEN"


class NoCredential(Exception):
    """No usable credential in this kernel's Secrets; the message says why and holds no value."""


def _secrets() -> Any:
    from kaggle_secrets import UserSecretsClient

    return UserSecretsClient()


def visible(labels: Sequence[str] = LABELS) -> dict[str, Any]:
    """{"visible": {label: whether the kernel sees a value}, "error": the last failure's class or None}.
    Each value is dropped as soon as it is read."""
    try:
        client = _secrets()
    except Exception as exc:  # noqa: BLE001 - any failure means "no Secrets here"
        return {"visible": {label: False for label in labels}, "error": type(exc).__name__}
    seen, error = {}, None
    for label in labels:
        try:
            seen[label] = bool(client.get_secret(label))
        except Exception as exc:  # noqa: BLE001 - not attached, or the backend refused
            seen[label], error = False, type(exc).__name__
    return {"visible": seen, "error": error}


def credential(labels: Sequence[str] = LABELS) -> dict[str, str]:
    """{label: value} for each label, every one non-empty; else NoCredential, saying why."""
    try:
        client = _secrets()
        found = {label: client.get_secret(label) for label in labels}
    except Exception as exc:  # noqa: BLE001 - not attached, no Secrets service, or the backend refused
        raise NoCredential(f"{' and '.join(labels)} could not be read from this kernel's Secrets "
                           f"({type(exc).__name__})") from None
    empty = [label for label in labels if not found[label]]
    if empty:
        raise NoCredential(f"{' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty in this kernel's Secrets")
    return found


def client(cred: dict[str, str]) -> Any:
    """The official client authenticated with cred, which goes into this process's environment (where the
    client reads it), its creating calls sent once (sendonce.sent_once)."""
    os.environ.pop(SESSION_TOKEN_ENV, None)
    os.environ.update(cred)
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    if callable(getattr(api, "with_retry", None)):  # kaggle 2.x; a client without it has nothing to bypass
        api.with_retry = sendonce.sent_once(api.with_retry)
    return api


def login(labels: Sequence[str] = LABELS) -> Any:
    """client(credential()): the authenticated client, or NoCredential."""
    return client(credential(labels))
