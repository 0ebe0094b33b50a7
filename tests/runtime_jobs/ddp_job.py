"""A small job for the multi-rank tests: DDP through run.wrap, a sharded loader, dropout.

Each step logs the loss averaged over ranks, so a 1-rank run with batch N*b and an N-rank run with
micro-batch b log the same numbers (within floating-point tolerance, without dropout).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def main(run):
    p = run.params
    torch.manual_seed(p.get("seed", 0))
    g = torch.Generator().manual_seed(99)
    x = torch.randn(p.get("rows", 64), 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    run.check(batch=(x[:8], y[:8]), x_shape=(None, 6), num_classes=3)  # each rank checks; the main rank says so
    model = run.wrap(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(p.get("dropout", 0.0)), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=p.get("lr", 0.1), momentum=0.9)
    trainer = run.optimize(opt)
    run.track(model=model)
    loader = run.loader(TensorDataset(x, y), batch_size=p.get("batch", 8), drop_last=True)
    if p.get("epochs"):  # the epoch loop: each batch is one step
        for _ in run.epochs(p.epochs):
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                trainer.backward(loss)
                trainer.step()
                run.log(loss=loss.item(), mean_over_ranks=True)
        return
    for step in run.steps(p.steps):
        xb, yb = next(loader)
        loss = F.cross_entropy(model(xb), yb)
        trainer.backward(loss)
        trainer.step()
        run.log(loss=loss.item(), mean_over_ranks=True)
        if step == p.get("crash_at") and run.rank == p.get("crash_rank", 1):
            raise ValueError(f"boom on rank {run.rank} at step {step}")
        if step == p.get("break_at") and run.rank == p.get("break_rank", 1):
            break
