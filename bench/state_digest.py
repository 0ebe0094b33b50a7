"""What the state's digests (digests.json, issue 39) cost a checkpoint write.

A model + Adam state of about --mb MB on the host (as a background save holds it), written by the
checkpoint writer with and without the digests, best of --rounds interleaved rounds; and the digest
alone. The digest runs in the writer's thread pool while torch.save writes, from the host copy the
save already holds: the training thread is not blocked by it. Prints the ratios.

    python bench/state_digest.py [--mb 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.runtime.checkpoint import state as checkpoint  # noqa: E402
from kchain.runtime.checkpoint.state import CheckpointJob, write_checkpoint  # noqa: E402
from kchain.runtime.checkpoint.statedigest import digest_state  # noqa: E402


def state_of(mb: int) -> dict:
    """A state shaped like a model's and its Adam moments: 3 tensors per parameter of ~1 MB each."""
    n = max(1, mb // 3)
    params = {f"layer{i}.weight": torch.randn(512, 512) for i in range(n)}
    adam = {i: {"exp_avg": torch.randn(512, 512), "exp_avg_sq": torch.rand(512, 512), "step": torch.tensor(7.0)}
            for i in range(n)}
    return {"step": 7, "tracked": {"model": params, "optimizer": {"state": adam, "param_groups": [{"lr": 1e-3}]}},
            "rng": {"torch": torch.get_rng_state()}, "metrics": {}, "best": None}


def timed_write(state: dict, root: Path, digests: bool) -> float:
    job = CheckpointJob(checkpoints=root, step=7, metrics_src=root / "none", metrics_bytes=0,
                        manifest={"job": "bench"}, keep=1)
    saved = checkpoint.digest_state
    if not digests:
        checkpoint.digest_state = lambda state: {}  # the same writer without the digests' pass
    try:
        t0 = time.perf_counter()
        write_checkpoint(state, job)
        return time.perf_counter() - t0
    finally:
        checkpoint.digest_state = saved
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    state = state_of(args.mb)
    size = sum(t.numel() * t.element_size() for t in _tensors(state)) / 2**20
    best = {"without": float("inf"), "with": float("inf"), "digest": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            best["without"] = min(best["without"], timed_write(state, Path(tmp) / "a", digests=False))
            best["with"] = min(best["with"], timed_write(state, Path(tmp) / "b", digests=True))
            t0 = time.perf_counter()
            digest_state(state)
            best["digest"] = min(best["digest"], time.perf_counter() - t0)
    print(f"state {size:.0f} MB, best of {args.rounds} rounds (the writer's thread; training is not blocked)")
    print(f"  write without digests  {best['without']:.3f}s")
    print(f"  write with digests     {best['with']:.3f}s   ratio {best['with'] / best['without']:.2f}")
    print(f"  digest alone           {best['digest']:.3f}s   {size / best['digest']:.0f} MB/s")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    main()
