"""A character-level GPT on generated delivery notes, trained through kchain's runtime.

Everything random flows from params.seed through generators the runtime checkpoints, so a
session killed at any step resumes as the same run.
"""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PLACES = ["Leeds depot", "Bristol hub", "Glasgow yard", "Cardiff store", "York depot", "Hull dock"]
GOODS = ["pallets of flour", "crates of apples", "drums of oil", "rolls of cable", "boxes of tiles"]
NAMES = ["K. Patel", "A. Jones", "M. Okafor", "S. Novak", "L. Chen", "R. Silva"]
WIDTH = 96  # every note is padded to this many characters, so a note is one fixed-size row


def make_notes(p):
    """Generate p['n_notes'] distinct delivery notes; 10% of them (by note) form the validation split."""
    rng = np.random.default_rng(p["seed"])
    notes = []
    for i in range(p["n_notes"]):
        day = 1 + int(rng.integers(28))
        note = (
            f"2026-{1 + i % 12:02d}-{day:02d} | DN-{10000 + i} | {int(rng.integers(1, 40))} x "
            f"{GOODS[rng.integers(len(GOODS))]} to {PLACES[rng.integers(len(PLACES))]} | "
            f"signed: {NAMES[rng.integers(len(NAMES))]}\n"
        )
        notes.append(note.ljust(WIDTH)[:WIDTH])
    vocab = sorted(set("".join(notes)))
    lookup = {c: i for i, c in enumerate(vocab)}
    rows = np.array([[lookup[c] for c in n] for n in notes], dtype=np.uint8)
    order = rng.permutation(len(rows))
    n_val = max(1, len(rows) // 10)
    return {
        "train": rows[order[n_val:]],
        "val": rows[order[:n_val]],
        "vocab": np.frombuffer("".join(vocab).encode("utf-32-le"), dtype=np.uint32),
    }


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, block, d, n_layer, n_head, dropout):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))


def windows(stream, starts, block):
    x = torch.stack([stream[s : s + block] for s in starts.tolist()])
    y = torch.stack([stream[s + 1 : s + 1 + block] for s in starts.tolist()])
    return x.long(), y.long()


def main(run):
    p = run.params
    torch.manual_seed(p.seed)
    data = run.stage("notes", {"n_notes": max(200, int(p.n_notes * run.fraction)), "seed": p.seed}, make_notes)
    vocab_size = len(data["vocab"])
    # np.array copies out of the read-only memory map the cache hands back.
    train = torch.from_numpy(np.array(data["train"]).reshape(-1))
    val = torch.from_numpy(np.array(data["val"]).reshape(-1))

    # Batches are random windows of the training stream, drawn from a generator the checkpoint holds
    # (one per rank: with 2 ranks each draws its own windows, and DDP averages their gradients).
    batches = torch.Generator().manual_seed(p.seed + run.rank)
    run.track(batches=batches)

    def next_batch():
        starts = torch.randint(len(train) - p.block - 1, (p.batch,), generator=batches)
        x, y = windows(train, starts, p.block)
        return x.to(run.device), y.to(run.device)

    x, y = next_batch()
    run.check(batch=(x, y), x_dtype=torch.int64, num_classes=vocab_size,
              splits={"train": data["train"], "val": data["val"]})

    # On run.device; in DistributedDataParallel when train.gpus gives the job several ranks.
    model = run.wrap(TinyGPT(vocab_size, p.block, p.d_model, p.n_layer, p.n_head, p.dropout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=0.01)
    warmup = max(1, p.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, p.steps) / p.steps))
    )
    run.track(model=model, scheduler=schedule)
    trainer = run.optimize(optimizer, accumulate=p.accumulate, clip=1.0)

    # A fixed validation set: the same windows every time, no randomness.
    val_starts = torch.arange(0, len(val) - p.block - 1, max(1, (len(val) - p.block - 1) // 64))[:64]
    val_x, val_y = (t.to(run.device) for t in windows(val, val_starts, p.block))

    for step in run.steps(p.steps):
        model.train()
        for _ in range(trainer.accumulate):
            x, y = next_batch()
            with run.autocast():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            trainer.backward(loss)
        trainer.step()
        schedule.step()
        run.log(loss=loss.item(), lr=schedule.get_last_lr()[0])
        if run.every(p.eval_every):
            model.eval()
            with torch.no_grad(), run.autocast():
                val_loss = F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten()).item()
            run.log(val_loss=val_loss)
