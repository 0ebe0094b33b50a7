"""A short fine-tune whose best is early (issue 56's `best-early`): validated at the steps it checkpoints
(`checkpoint_every: 8 steps`), its val_loss lowest at step 16, the run 40 steps long."""

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn


def main(run):
    torch.manual_seed(0)
    model = run.wrap(nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU(), nn.Linear(16, N_CLASSES)))
    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    run.track(model=model)
    loader = run.loader(NoisyRows(40), batch_size=4)
    for step in run.steps(run.params.steps):
        x, y = next(loader)
        loss = F.cross_entropy(model(x), y)
        trainer.backward(loss)
        trainer.step()
        run.log(loss=loss.item())
        if step % 8 == 0:  # an over-fitting curve: best at step 16, worse after
            run.log(val_loss=1.0 + (step - 16) ** 2 / 100 + 1e-3 * loss.item())
