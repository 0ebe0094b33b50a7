"""The emulator's persistent store: one JSON document plus the files it points at.

Layout of the state folder:

    state.json                          kernels, datasets, models, sessions, blobs (written atomically)
    blobs/<token>                       uploaded bytes (possibly partial)
    datasets/<owner>/<slug>/<N>/files/  a dataset version's files, zips already unpacked
    models/<owner>/<model>/<framework>/<variation>/<N>/files/  a model version's files
    sessions/<id>/                      notebook, log, sandbox while running, output/ after

Every mutation happens under `store.lock` and ends with `store.save()`, so a crash loses at most
the call in flight and a restarted emulator sees what the last answer promised.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kchain.common import atomic, layout
from kchain.common.sessionstate import LIVE, SessionState


def iso(ts: float) -> str:
    """Epoch seconds as the ISO string the client parses ("2025-01-02T03:04:05.123Z")."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def new_secret() -> str:
    return secrets.token_urlsafe(24)


FRAMEWORK_ENUM_PREFIX = "MODEL_FRAMEWORK_"  # how the SDK sends a framework (ModelFramework by name)


def model_key(owner: str, model: str, framework: str, variation: str) -> str:
    """One model variation's key whatever the framework's spelling: `.../Transformers/...` in a
    source, `MODEL_FRAMEWORK_TRANSFORMERS` in an SDK request and `transformers` are one."""
    framework = framework.removeprefix(FRAMEWORK_ENUM_PREFIX)
    return f"{owner}/{model}/{layout.model_framework_key(framework)}/{variation}"


# The SDK's ModelFramework members (kagglesdk 0.1.38 models/types/model_enums.py), without their prefix: an
# answer names a framework so, since the client parses "pytorch" into no member ("PyTorch" or PY_TORCH it does).
FRAMEWORKS = ("TENSOR_FLOW_1", "TENSOR_FLOW_2", "TF_LITE", "TF_JS", "PY_TORCH", "JAX", "FLAX", "PAX", "MAX_TEXT",
              "GEMMA_CPP", "GGML", "GGUF", "CORAL", "SCIKIT_LEARN", "MXNET", "ONNX", "KERAS", "TRANSFORMERS", "API",
              "OTHER", "TENSOR_RT_LLM", "TRITON", "VLLM")


def framework_enum(framework: str) -> str:
    """A framework however spelt ('pytorch', 'PyTorch', 'MODEL_FRAMEWORK_PY_TORCH') as the SDK's enum name;
    one the SDK does not know is MODEL_FRAMEWORK_OTHER."""
    key = layout.model_framework_key(framework.removeprefix(FRAMEWORK_ENUM_PREFIX))
    name = next((n for n in FRAMEWORKS if layout.model_framework_key(n) == key), "OTHER")
    return FRAMEWORK_ENUM_PREFIX + name


class Store:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("blobs", "datasets", "models", "sessions"):
            (self.root / sub).mkdir(exist_ok=True)
        self.path = self.root / "state.json"
        self.lock = threading.RLock()
        self.data: dict[str, Any] = {"next_id": 1, "kernels": {}, "datasets": {}, "models": {}, "sessions": {},
                                     "blobs": {}, "cancellations": [], "secrets_attached": [], "secrets_reset": [],
                                     "images": [], "runs_pushed": 0}
        if self.path.exists():
            self.data.update(json.loads(self.path.read_text()))

    def save(self) -> None:
        with self.lock:
            atomic.write_bytes(self.path, json.dumps(self.data, indent=1, sort_keys=True).encode())

    def next_id(self) -> int:
        with self.lock:
            value = self.data["next_id"]
            self.data["next_id"] = value + 1
            return value

    # -- paths ------------------------------------------------------------------------------

    def blob_path(self, token: str) -> Path:
        return self.root / "blobs" / token

    def version_files_dir(self, ref: str, number: int) -> Path:
        return self.root / "datasets" / ref / str(number) / "files"

    def model_files_dir(self, key: str, number: int) -> Path:
        return self.root / "models" / key / str(number) / "files"

    def session_dir(self, session_id: int | str) -> Path:
        return self.root / "sessions" / str(session_id)

    # -- lookups ----------------------------------------------------------------------------

    @property
    def kernels(self) -> dict[str, Any]:
        return self.data["kernels"]

    @property
    def datasets(self) -> dict[str, Any]:
        return self.data["datasets"]

    @property
    def models(self) -> dict[str, Any]:
        """model_key -> {owner, is_private, versions: [N, ...]}."""
        return self.data["models"]

    @property
    def sessions(self) -> dict[str, Any]:
        return self.data["sessions"]

    @property
    def blobs(self) -> dict[str, Any]:
        return self.data["blobs"]

    def session(self, session_id: int | str) -> dict[str, Any]:
        return self.sessions[str(session_id)]

    @property
    def cancellations(self) -> list[dict[str, Any]]:
        return self.data["cancellations"]

    @property
    def secrets_attached(self) -> list[str]:
        return self.data["secrets_attached"]

    @property
    def secrets_reset(self) -> list[str]:
        """Kernels whose Secret attachments a push from inside a kernel reset (switches.secrets_reset_on_push)."""
        return self.data.setdefault("secrets_reset", [])

    @property
    def images(self) -> list[str]:
        """Kaggle's images so far, oldest first: the last is the newest (switches.new_image_every)."""
        return self.data["images"]

    def version_visible(self, version: dict[str, Any], now: float | None = None) -> bool:
        """A new version is invisible (its dataset reads as missing, its number lags) for a while."""
        return (now or time.time()) >= version.get("visible_at", version["created"])

    def version_ready(self, version: dict[str, Any], now: float | None = None) -> bool:
        return (now or time.time()) >= version["ready_at"]

    def visible_versions(self, dataset: dict[str, Any]) -> list[dict[str, Any]]:
        now = time.time()
        return [v for v in dataset["versions"] if self.version_visible(v, now)]

    def ready_versions(self, dataset: dict[str, Any]) -> list[dict[str, Any]]:
        now = time.time()
        return [v for v in dataset["versions"] if self.version_visible(v, now) and self.version_ready(v, now)]

    def recover_after_restart(self) -> list[dict[str, Any]]:
        """Mark sessions that were live when the emulator went away as lost; return them."""
        lost = []
        with self.lock:
            for session in self.sessions.values():
                if session["status"] in LIVE:
                    session["status"] = SessionState.ERROR
                    session["failure_message"] = "session lost: emulator restarted"
                    session["ended"] = session.get("ended") or time.time()
                    lost.append(session)
            if lost:
                self.save()
        return lost
