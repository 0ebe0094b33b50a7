"""How long the in-kernel publish of the end state takes, so the deadline guard leaves room for it.

When the kernel publishes its own state (internet on, a credential in Secrets), the session must
still be alive after the final save for: starting the kaggle client, creating the dataset version,
uploading the checkpoint, and Kaggle's processing of it. The figures come from the rendered config
(`kaggle.publish`: measured by an earlier session's publish or by the rehearsal) or, without them,
from the assumptions below. The deadline guard keeps max(train.margin, save + publish) back.

Standard library only: the publish process (kchain_publish) reads the same plan to decide whether
it can still finish, and the laptop relays the state when it cannot.
"""

from __future__ import annotations

import os
from pathlib import Path

# Assumed on Kaggle until a session measured them: generous, since a publish cut off by the session's
# limit wastes the whole session's progress to the relay's (slower) path, never the state itself.
ASSUMED = {
    "start_s": 30.0,  # interpreter + kaggle client import + authenticate
    "create_s": 15.0,  # StartBlobUpload + CreateDatasetVersion round trips
    "rate_bps": 20e6,  # upload rate from a kernel, bytes per second
    "processing_s": 30.0,  # Kaggle's processing of the new version while the session is still up
}


def figures(config: dict) -> dict | None:
    """The publish figures for this session, or None when the kernel will not publish itself."""
    kaggle = config.get("kaggle") or {}
    if not kaggle.get("internet") or not kaggle.get("state_dataset"):
        return None
    given = kaggle.get("publish") or {}
    out = dict(ASSUMED)
    for key in ASSUMED:
        value = given.get(key)
        if isinstance(value, (int, float)) and value >= 0:
            out[key] = float(value)
    out["measured"] = bool(given)
    return out


def seconds(plan: dict, nbytes: int) -> float:
    """Seconds the publish of nbytes takes by the plan."""
    rate = max(plan["rate_bps"], 1.0)
    return plan["start_s"] + plan["create_s"] + nbytes / rate + plan["processing_s"]


def tree_bytes(path: Path | None) -> int:
    """Bytes of the files under path (a checkpoint directory)."""
    if path is None or not path.is_dir():
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass
    return total


def state_bytes(obj) -> int:
    """Bytes of the tensors and arrays in a (nested) state dict: the size a checkpoint will have."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
        return int(obj.element_size() * obj.nelement())
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def size_text(nbytes: int) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.1f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.0f} kB"
