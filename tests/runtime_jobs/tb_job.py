"""A tiny regression that logs to TensorBoard the ways a user would: run.summary_writer() (three
scalars a step, flushed every step as the Hugging Face Trainer's callback does, so a killed session
leaves events past its last checkpoint on disk) and run.log, which train.trackers.tensorboard mirrors;
and to MLflow as its docs show, `mlflow.start_run()` and `log_metric` each step (train.trackers.mlflow:
no tracking URI or store of its own)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def main(run):
    import mlflow

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
    mlflow.start_run()  # from the second session on, MLFLOW_RUN_ID makes it the chain's run
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
        mlflow.log_metric("train_loss", loss.item(), step=step)
    mlflow.end_run()
