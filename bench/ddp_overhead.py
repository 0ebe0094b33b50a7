"""What two ranks cost the training loop, as ratios measured in one run (on this CPU, gloo).

Two measurements, each a ratio so the machine's speed cancels:
  1. the agreed stop: one all-reduce of two integers per step (what `run.steps` adds with several
     ranks), as a share of a DDP training step of a small MLP with 2 ranks;
  2. the checkpoint: the blocking part of `run.save()` with 2 ranks (the gather of every rank's RNG
     and loader state, then rank 0's snapshot) against the same save with 1 rank.

    python bench/ddp_overhead.py [--steps 200] [--hidden 512]

The GPU figures (NCCL on two T4s) wait for a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kchain.common import layout  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(rank: int, world: int, port: int, steps: int, hidden: int, root: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if world == 1:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(k)
    torch.set_num_threads(1)
    from torch.utils.data import TensorDataset

    from kchain.runtime.run import Run

    config = {"job": "bench", "params": {}, "train": {"checkpoint_every": {"steps": 10**9}, "heartbeat_s": 0}}
    run = Run(config, {**os.environ, layout.ROOT_ENV: root})
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)))
    opt = torch.optim.Adam(model.parameters())
    run.track(model=model, optimizer=opt)
    loader = run.loader(TensorDataset(torch.randn(4096, hidden), torch.randint(0, 10, (4096,))), batch_size=32)

    def step() -> None:
        x, y = next(loader)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(10):  # warm-up
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    step_s = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        run._ranks.agree(None, False)
    agree_s = (time.perf_counter() - t0) / steps
    saves = []
    for i in range(5):
        t0 = time.perf_counter()
        run.save(i + 1)
        saves.append(time.perf_counter() - t0)
        run._ckpt.writer.wait()
    run._ranks.barrier()
    run.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": step_s, "agree_s": agree_s, "save_s": statistics.median(saves)}))


def run_ranks(world: int, steps: int, hidden: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(measure, args=(world, free_port(), steps, hidden, os.path.join(tmp, "root"), out), nprocs=world)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    one = run_ranks(1, args.steps, args.hidden)
    two = run_ranks(2, args.steps, args.hidden)
    print(f"MLP {args.hidden}x{args.hidden}, batch 32 per rank, {args.steps} steps, gloo on this CPU")
    print(f"step: 1 rank {one['step_s'] * 1e3:.2f} ms, 2 ranks (DDP) {two['step_s'] * 1e3:.2f} ms")
    print(f"agreed-stop all-reduce per step: {two['agree_s'] * 1e6:.0f} us = "
          f"{two['agree_s'] / two['step_s']:.3f} of a 2-rank step")
    print(f"blocking part of a save: 1 rank {one['save_s'] * 1e3:.2f} ms, 2 ranks {two['save_s'] * 1e3:.2f} ms "
          f"= {two['save_s'] / one['save_s']:.2f}x")


if __name__ == "__main__":
    main()
