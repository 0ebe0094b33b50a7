"""How long the in-kernel publish of the end state takes, so the deadline guard leaves room for it.

When the kernel publishes its own state (internet on, a credential in Secrets), the session must
still be alive after the final save for: starting the kaggle client, creating the dataset version,
uploading the checkpoint, and Kaggle's processing of it (and, in an unattended chain, pushing the next
session). The figures come from the rendered config
(`kaggle.publish`: measured by an earlier session's publish or by the rehearsal) or, without them,
from the assumptions below. The deadline guard keeps max(train.margin, save + publish) back.

Standard library only: the publish process (kchain.common.publish) reads the same plan to decide whether
it can still finish, and the laptop relays the state when it cannot.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from kchain.common.config import KaggleConfig

# Assumed on Kaggle until a session measured them: generous, since a publish cut off by the session's
# limit wastes the whole session's progress to the relay's (slower) path, never the state itself.
ASSUMED = {
    "start_s": 30.0,  # interpreter + kaggle client import + authenticate
    "create_s": 15.0,  # StartBlobUpload + CreateDatasetVersion round trips
    "rate_bps": 20e6,  # upload rate from a kernel, bytes per second
    "processing_s": 30.0,  # Kaggle's processing of the new version while the session is still up
}
# An unattended chain's kernel also pushes the next session (SaveKernel, and settling a lost answer by
# the kernel's version number) once its state version is ready: kept on top of the publish.
PUSH_S = 20.0
# What runs between the stop's save and the publisher's own check of its time left, which skips a publish
# that no longer fits: the ranks' teardown, the notebook's next line, the publisher's interpreter and
# imports (about 2-6 s measured on 2 shared cores), plus its sha256 check of the checkpoint's files at
# VERIFY_BPS (a conservative disk and hash rate). Kept on top of the publish by the deadline.
HANDOFF_S = 15.0
VERIFY_BPS = 200e6


def figures(kaggle: KaggleConfig) -> dict | None:
    """The publish figures for this session, or None when the kernel will not publish itself."""
    if not kaggle.internet or not kaggle.state_dataset:
        return None
    given = kaggle.publish or {}
    out = dict(ASSUMED)
    for key in ASSUMED:
        value = given.get(key)
        if isinstance(value, (int, float)) and value >= 0:
            out[key] = float(value)
    out["measured"] = bool(given)
    if kaggle.unattended:
        out["push_s"] = float(given["push_s"]) if isinstance(given.get("push_s"), (int, float)) else PUSH_S
    return out


def seconds(plan: dict, nbytes: int) -> float:
    """Seconds the publish of nbytes takes by the plan."""
    rate = max(plan["rate_bps"], 1.0)
    return plan["start_s"] + plan["create_s"] + nbytes / rate + plan["processing_s"] + plan.get("push_s", 0.0)


def handoff_s(nbytes: int) -> float:
    """Seconds from the stop's save to the publisher's own check, for a checkpoint of nbytes."""
    return HANDOFF_S + nbytes / VERIFY_BPS


def fits(need_s: float, limit_s: float, margin_s: float) -> bool:
    """Whether a session keeps need_s for the publish: at most half of what it has after train.margin, so
    the other half trains (the deadline guard's rule, and `push --unattended`'s refusal)."""
    return need_s <= (limit_s - margin_s) / 2


def measured(timing: dict, processing_s: float | None = None, push_s: float | None = None) -> dict:
    """A session's publish as the next one plans with it: its measured start, rate and bytes, with what the
    kernel measured after them (the wait for its version to be ready, its push of the next session), so
    `seconds` of them is the publish the session took, not the assumed processing and push on top."""
    out = dict(timing)
    if processing_s is not None:
        out["processing_s"] = round(processing_s, 3)
    if push_s is not None:
        out["push_s"] = round(push_s, 3)
    return out


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


PICKLE_PROTOCOL = 2  # torch.save's (torch.serialization.DEFAULT_PROTOCOL)


class _Counter:
    """A file that keeps only the number of bytes written to it."""

    def __init__(self):
        self.n = 0

    def write(self, data) -> None:
        self.n += memoryview(data).nbytes


class _Sizer(pickle.Pickler):
    """Pickles a state as torch.save does, counting tensor and array data instead of writing it.

    torch.save pickles everything but the tensor storages, which it writes as separate records; here
    each storage (and each numpy array) is counted by its bytes, once, and left out of the pickle.
    """

    def __init__(self):
        self.sink = _Counter()
        super().__init__(self.sink, protocol=PICKLE_PROTOCOL)
        self.data = 0
        self._storages: set = set()

    def persistent_id(self, obj):
        if callable(getattr(obj, "untyped_storage", None)) and hasattr(obj, "element_size"):  # a tensor
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in self._storages:  # tied weights share one storage, written once
                self._storages.add(key)
                self.data += storage.nbytes()
            return "tensor"
        dtype = getattr(obj, "dtype", None)
        if isinstance(getattr(obj, "nbytes", None), int) and not getattr(dtype, "hasobject", True):  # numpy
            self.data += obj.nbytes
            return "array"
        return None


def state_bytes(obj) -> int:
    """Bytes a checkpoint of this (nested) state takes, nearly: tensor and array data, and the pickle of the rest.

    Each storage counts once (tied weights). The pickle can be most of a state: a data order kept as
    a list, RNG states. One pickling pass that writes nothing, about as costly as torch.save's own.
    """
    sizer = _Sizer()
    try:
        sizer.dump(obj)
    except Exception:  # not picklable: torch.save will say why; this is only an estimate
        pass
    return sizer.data + sizer.sink.n


def size_text(nbytes: int) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.1f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.0f} kB"
