"""A small job for the rehearsal tests, in the loop shapes a port ends up with (params.shape):

- `steps`: `run.steps` over a `run.loader`, the model under `run.wrap` (DDP with 2 ranks);
- `explicit`: a loop kchain cannot drive, `run.restore()` and `run.save(step)` every `save_every`
  steps; it prints no heartbeat, only its own `[job] trained step N` line, and sleeps `sleep_s`
  a step (a speed cap, so a session of a given limit can never finish the run);
- `skipped_epochs`: `run.epochs` whose odd epochs train nothing (as a Lightning `Trainer.fit` over
  `run.loader` did): the loop trains half the steps its total asks for.
"""

import time

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
    model = run.wrap(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = run.optimize(opt)
    run.track(model=model)
    loader = run.loader(TensorDataset(x, y), batch_size=8, drop_last=True)

    def train(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        trainer.backward(loss)
        trainer.step()
        return loss.item()

    if p.shape == "explicit":
        start = run.restore()
        for step in range(start + 1, p.steps + 1):
            run.log(step=step, loss=train(*next(loader)))
            if run.is_main:
                print(f"[job] trained step {step}", flush=True)
            time.sleep(p.get("sleep_s", 0.05))
            if step % p.save_every == 0 or step == p.steps:
                run.save(step)
    elif p.shape == "skipped_epochs":
        for epoch in run.epochs(p.epochs):
            if epoch % 2:
                continue  # an epoch whose batches never come
            for xb, yb in loader:
                run.log(loss=train(xb, yb))
    else:
        for _ in run.steps(p.steps):
            xb, yb = next(loader)
            run.log(loss=train(xb, yb))
