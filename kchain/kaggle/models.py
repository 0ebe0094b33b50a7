"""Kaggle Models attached as inputs (`kaggle.models`: pretrained weights to fine-tune from).

A pinned model version that does not exist would be dropped by SaveKernel, and the session would
start without it (as an unknown dataset source is: shared/reference/kaggle-api.md 8), so each one is
looked up through the official client before a push and by `kchain doctor`.
"""

from __future__ import annotations

from kchain.errors import KaggleError
from kchain.kaggle.client import KaggleClient, missing


def model_problem(client: KaggleClient, ref: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) for model version ref (owner/model/framework/variation/N), or None when
    Kaggle has it. Other failures of the lookup raise KaggleError."""
    instance, _, version = ref.rpartition("/")
    try:
        versions = client.model_versions(instance)
    except KaggleError as exc:
        if missing(exc):  # 403 or 404: missing, private, or a gated model whose terms were not accepted
            return (f"model {instance} does not exist on Kaggle or is not visible to you",
                    "fix the name, or accept the model's terms on its Kaggle page")
        raise
    if int(version) not in versions:
        listed = ", ".join(map(str, versions)) or "none"
        return f"model {instance} has no version {version} (its versions: {listed})", "pin a version that exists"
    return None
