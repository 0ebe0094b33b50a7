"""A tiny regression that logs to TensorBoard the ways a user would: run.summary_writer() (three
scalars a step, flushed every step as the Hugging Face Trainer's callback does, so a killed session
leaves events past its last checkpoint on disk) and run.log, which train.trackers.tensorboard mirrors."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def main(run):
    p = run.params
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    model = run.wrap(nn.Linear(4, 1))
    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    run.track(model=model)
    loader = run.loader(TensorDataset(x, y), batch_size=4, drop_last=True)
    tb = run.summary_writer()
    for step in run.steps(p.steps):
        xb, yb = next(loader)
        loss = F.mse_loss(model(xb), yb)
        trainer.backward(loss)
        trainer.step()
        tb.add_scalar("train/loss", loss.item(), step)
        tb.add_scalar("train/weight_norm", model.weight.norm().item(), step)
        tb.add_scalar("train/half_step", step / 2, step)
        tb.flush()
        run.log(loss=loss.item())
