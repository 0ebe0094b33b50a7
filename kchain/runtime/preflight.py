"""Preflight checks: cheap tests of the values the training code hands over, before the loop.

Each failure raises PreflightError saying what was expected and what was found; each success prints
one line, so the log shows what was checked (on the main rank only, quiet=True elsewhere: every rank
checks its own batch, and identical lines from each rank would only repeat).
"""

from __future__ import annotations

import hashlib
import itertools
import tempfile

import numpy as np
import torch

SAMPLE_ROWS = 512  # rows hashed per split for the overlap check: cheap, and catches a swapped split


class PreflightError(Exception):
    """A preflight check failed; the message says what was expected and what was found."""


# A DataLoader worker hands each batch's tensors to the training process over a Unix socket made in
# <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX; Linux caps that path at 107 bytes. Past it the worker's send
# fails in a background thread, the batch is lost and the loader waits for it forever.
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def check_worker_tmpdir(num_workers: int) -> None:
    """Refuse DataLoader workers under a temp dir too long for their sockets (they would hang)."""
    tmp = tempfile.gettempdir()
    if num_workers > 0 and len(tmp.encode()) + SOCKET_SUFFIX > SOCKET_PATH_MAX:
        raise PreflightError(
            f"the temp dir {tmp} is {len(tmp.encode())} bytes long: DataLoader workers pass batches over a "
            f"Unix socket under it, whose path may hold at most {SOCKET_PATH_MAX} bytes, so the first batch "
            f"would never arrive; set TMPDIR to a shorter directory (at most "
            f"{SOCKET_PATH_MAX - SOCKET_SUFFIX} bytes, e.g. /tmp) or use num_workers=0"
        )


def _say(line: str, quiet: bool) -> None:
    if not quiet:
        print(f"[kchain] {line}", flush=True)


def _as_tensor(v, what: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    raise PreflightError(f"{what} is a {type(v).__name__}; expected a tensor or numpy array")


def _shape_ok(shape: tuple, want: tuple) -> bool:
    return len(shape) == len(want) and all(w is None or w == s for s, w in zip(shape, want, strict=True))


def check_batch(batch, x_shape=None, x_dtype=None, num_classes=None, label_dtype=None, quiet=False) -> None:
    if isinstance(batch, (tuple, list)):
        x, y = batch[0], (batch[1] if len(batch) > 1 else None)
    else:
        x, y = batch, None
    x = _as_tensor(x, "batch[0]")
    if x_shape is not None:
        want = tuple(x_shape)
        if not _shape_ok(tuple(x.shape), want):
            shown = "(" + ", ".join("any" if w is None else str(w) for w in want) + ")"
            raise PreflightError(f"inputs have shape {tuple(x.shape)}; expected {shown}")
        _say(f"check ok: inputs shape {tuple(x.shape)}", quiet)
    if x_dtype is not None:
        if x.dtype != x_dtype:
            raise PreflightError(f"inputs have dtype {x.dtype}; expected {x_dtype}")
        _say(f"check ok: inputs dtype {x.dtype}", quiet)
    if y is None or (num_classes is None and label_dtype is None):
        return
    y = _as_tensor(y, "batch[1] (labels)")
    indices = not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool)
    if label_dtype is not None and y.dtype != label_dtype:
        raise PreflightError(f"labels have dtype {y.dtype}; expected {label_dtype}")
    if label_dtype is None and not indices:  # the default: class indices, as cross-entropy takes them
        raise PreflightError(f"labels have dtype {y.dtype}; cross-entropy needs an integer class index (torch.int64)")
    _say(f"check ok: labels dtype {y.dtype}", quiet)
    if num_classes is not None and not indices:
        raise PreflightError(f"num_classes checks class indices, and labels of dtype {y.dtype} are not: "
                             "drop num_classes, or pass integer labels")
    if num_classes is not None and y.numel():
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise PreflightError(
                f"labels range over [{lo}, {hi}]; with num_classes={num_classes} they must be in [0, {num_classes})"
            )
        _say(f"check ok: labels in [{lo}, {hi}] within [0, {num_classes})", quiet)


def _row_hash(row, h) -> None:
    if isinstance(row, torch.Tensor):
        row = row.detach().cpu().numpy()
    if isinstance(row, np.ndarray):
        h.update(f"{row.dtype}{row.shape}".encode())
        h.update(np.ascontiguousarray(row).tobytes())
    elif isinstance(row, (tuple, list)):
        for item in row:
            _row_hash(item, h)
            h.update(b"|")
    elif isinstance(row, dict):
        for k in sorted(row, key=str):
            h.update(str(k).encode())
            _row_hash(row[k], h)
    elif isinstance(row, bytes):
        h.update(row)
    else:
        h.update(repr(row).encode())


def _sample_hashes(data, n: int = SAMPLE_ROWS) -> set[bytes]:
    size = len(data)
    idx = np.unique(np.linspace(0, size - 1, min(size, n)).round().astype(np.int64)) if size else []
    out = set()
    for i in idx:
        h = hashlib.blake2b(digest_size=16)
        _row_hash(data[int(i)], h)
        out.add(h.digest())
    return out


def check_splits(splits: dict, quiet=False) -> None:
    _say("splits: " + " | ".join(f"{name} {len(data):,}" for name, data in splits.items()), quiet)
    for name, data in splits.items():
        if len(data) == 0:
            raise PreflightError(f"split {name!r} is empty; expected at least one row")
    hashes = {name: _sample_hashes(data) for name, data in splits.items()}
    for a, b in itertools.combinations(splits, 2):
        shared = hashes[a] & hashes[b]
        if shared:
            raise PreflightError(
                f"splits {a!r} and {b!r} share {len(shared)} of {min(len(hashes[a]), len(hashes[b]))} sampled rows; "
                "expected none (trained on the wrong split?)"
            )
    _say(f"check ok: no overlap between {', '.join(splits)} (sampled up to {SAMPLE_ROWS} rows each)", quiet)
