"""What checkpointing costs a training loop: a plain loop vs the same loop under run.steps.

Two char-level GPTs on the CPU (nanoGPT-style, written out below): tiny (d=64, 2 layers) and small
(d=256, 4 layers, ~3.2M parameters). For each: steps/s of a plain loop, of run.steps with the
default 10-minute cadence (a), and with a checkpoint every 20 steps (b); the stall per save (time
the training thread is blocked in run.save) against a synchronous torch.save of the same state; the
checkpoint size. Then, in child processes, time from process start to the first step of a fresh run
and of a resumed one.

    python bench/checkpoint_overhead.py [--rounds 3]

Variants are interleaved over rounds and the best round of each is kept, because a shared machine's
noise is larger than the effect measured. Targets: (a) within 1% of plain; (b) stall <= 1/3 sync save.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.common import layout  # noqa: E402
from kchain.runtime.run import Run  # noqa: E402

VOCAB = 65  # the tiny-shakespeare character set
BATCH = 8
MODELS = {
    # name: (d_model, layers, heads, block_size, steps per measurement)
    "tiny": (64, 2, 4, 64, 300),
    "small": (256, 4, 4, 64, 60),
}
EVERY_STEPS = 20
WARMUP_STEPS = 5  # untimed: the allocator and caches settle in the first steps


# --- a small GPT, nanoGPT-style ----------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, heads, T, head_dim): attention per head
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, block_size: int):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as in GPT-2

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.blocks(self.wte(idx) + self.wpe(pos))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def build(name: str, seed: int = 0):
    d, layers, heads, block, _ = MODELS[name]
    torch.manual_seed(seed)
    model = GPT(d, layers, heads, block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, VOCAB, (20_000,), generator=torch.Generator().manual_seed(seed))
    return model, opt, data, block


def batch(data, block, g):
    ix = torch.randint(len(data) - block - 1, (BATCH,), generator=g)
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
    return x, y


def train_step(model, opt, data, block, g):
    loss = model(*batch(data, block, g))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# --- in-process measurements -------------------------------------------------------------------


def plain(name: str) -> float:
    model, opt, data, block = build(name)
    g = torch.Generator().manual_seed(1)
    steps = MODELS[name][4]
    for _ in range(WARMUP_STEPS):
        train_step(model, opt, data, block, g)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, data, block, g)
    return steps / (time.perf_counter() - t0)


def under_run(name: str, every: dict, root: Path) -> tuple[float, Run]:
    model, opt, data, block = build(name)
    g = torch.Generator().manual_seed(1)
    steps = MODELS[name][4]
    for _ in range(WARMUP_STEPS):
        train_step(model, opt, data, block, g)
    config = {"job": f"bench-{name}", "params": {}, "train": {"checkpoint_every": every, "heartbeat_s": 600}}
    with contextlib.redirect_stdout(io.StringIO()):  # the Run's start-up lines
        run = Run(config, {layout.ROOT_ENV: str(root)})
        run.track(model=model, optimizer=opt)
        t0 = time.perf_counter()
        for _ in run.steps(steps):
            train_step(model, opt, data, block, g)
        elapsed = time.perf_counter() - t0
        run.close()
    return steps / elapsed, run


def sync_save_s(name: str, root: Path) -> float:
    """A synchronous torch.save of the same state (model, optimizer after one step, RNGs), best of 3."""
    model, opt, data, block = build(name)
    train_step(model, opt, data, block, torch.Generator().manual_seed(1))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}
    times = []
    for i in range(3):
        t0 = time.perf_counter()
        torch.save(state, root / f"sync-{i}.pt")
        times.append(time.perf_counter() - t0)
    return min(times)


# --- start-up, in child processes --------------------------------------------------------------


def job(run):
    """The entry for the start-up measurement: prints the wall-clock time of its first step."""
    model, opt, data, block = build(run.params["model"])
    run.track(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    first = True
    for _ in run.steps(run.params["steps"]):
        if first:
            print(f"[bench] first step at {time.time():.6f}", flush=True)
            first = False
        train_step(model, opt, data, block, g)


def time_to_first_step(root: Path, name: str, steps: int) -> float:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({"job": "bench-startup", "entry": "checkpoint_overhead:job",
                               "params": {"model": name, "steps": steps}, "train": {"heartbeat_s": 600}}))
    env = {**os.environ, layout.ROOT_ENV: str(root), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")])}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=env,
                         capture_output=True, text=True, check=True).stdout
    line = next(s for s in out.splitlines() if s.startswith("[bench] first step at"))
    return float(line.rsplit(" ", 1)[1]) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # One thread: on a shared 2-core machine, OpenMP threads fighting other processes add more noise
    # than the effect measured.
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name in MODELS:
            d, layers, heads, block, steps = MODELS[name]
            n_params = sum(p.numel() for p in build(name)[0].parameters())
            best = {"plain": 0.0, "10m": 0.0, "20 steps": 0.0}
            stalls: list[float] = []
            size = 0
            for r in range(args.rounds):
                # Rotate the order each round so no variant always runs first (or hottest).
                for variant in list(best)[r % 3 :] + list(best)[: r % 3]:
                    if variant == "plain":
                        best["plain"] = max(best["plain"], plain(name))
                        continue
                    every = {"seconds": 600} if variant == "10m" else {"steps": EVERY_STEPS}
                    rate, run = under_run(name, every, tmp / f"{name}-{variant}-{r}".replace(" ", ""))
                    best[variant] = max(best[variant], rate)
                    if variant == "20 steps":
                        stalls += run._ckpt.stalls[:-1]  # the last save is the final one, not a cadence save
                        size = (run._paths.checkpoints / layout.checkpoint_name(steps) / layout.STATE_FILE).stat().st_size
            sync = sync_save_s(name, tmp)
            stall = sorted(stalls)[len(stalls) // 2]  # median
            print(f"\n{name}: d={d}, {layers} layers, {n_params / 1e6:.2f}M params, batch {BATCH}x{block}, "
                  f"{steps} steps per measurement, best of {args.rounds}")
            print(f"  plain loop                    {best['plain']:8.2f} steps/s")
            print(f"  run.steps, 10m cadence (a)    {best['10m']:8.2f} steps/s  ratio {best['10m'] / best['plain']:.3f}")
            print(f"  run.steps, every 20 steps (b) {best['20 steps']:8.2f} steps/s  "
                  f"ratio {best['20 steps'] / best['plain']:.3f}")
            print(f"  stall per save (median of {len(stalls)}) {stall * 1e3:8.1f} ms")
            print(f"  synchronous torch.save        {sync * 1e3:8.1f} ms  stall/sync {stall / sync:.3f}")
            print(f"  checkpoint size               {size / 2**20:8.2f} MiB")
        name = "small"
        root = tmp / "startup"
        time_to_first_step(tmp / "warm", name, steps=1)  # warms the file cache for the imports
        fresh = min(time_to_first_step(tmp / f"fresh{i}", name, steps=1) for i in range(2))
        time_to_first_step(root, name, steps=1)  # leaves a checkpoint at step 1
        resumed = min(time_to_first_step(root, name, steps=2 + i) for i in range(2))
        print(f"\nstart-up ({name}): process start to first step: fresh {fresh:.2f} s, "
              f"resumed {resumed:.2f} s (difference {(resumed - fresh) * 1e3:+.0f} ms: find, verify, load)")
        assert math.isfinite(resumed)


if __name__ == "__main__":
    main()
