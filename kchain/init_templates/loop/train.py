"""@NAME@: a small classifier on generated data. Replace the data and the model with yours.

Build everything, register it (run.track, run.optimize, run.loader), then loop with run.steps:
the runtime checkpoints on the job's cadence, at the session deadline and at the end, and a new
session resumes exactly where the last one stopped. docs/porting.md shows every loop shape.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def make_data(p):
    """Generated rows: replace with run.input("your-dataset") and your own reader."""
    g = torch.Generator().manual_seed(p["seed"])
    x = torch.randn(p["rows"], 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()  # 4 classes
    cut = int(0.8 * p["rows"])
    return {"x_train": x[:cut].numpy(), "y_train": y[:cut].numpy(), "x_val": x[cut:].numpy(), "y_val": y[cut:].numpy()}


def main(run):
    p = run.params
    torch.manual_seed(p.seed)
    rows = max(400, int(p.rows * run.fraction))          # a small slice in the smoke run
    data = run.stage("data", {"rows": rows, "seed": p.seed}, make_data)  # built once, then cached
    train = TensorDataset(torch.tensor(data["x_train"]), torch.tensor(data["y_train"]))
    val_x, val_y = torch.tensor(data["x_val"]).to(run.device), torch.tensor(data["y_val"]).to(run.device)
    run.check(batch=train[:8], x_shape=(None, 16), num_classes=4,   # shape/label bugs stop here
              splits={"train": data["x_train"], "val": data["x_val"]})

    # run.wrap: on run.device, and in DistributedDataParallel when train.gpus gives 2 ranks (Kaggle's
    # two T4s), so both ranks train one model; .to(run.device) alone would train two that drift apart.
    model = run.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr)
    trainer = run.optimize(optimizer)                    # tracked, with the GradScaler fp16 needs
    run.track(model=model)                               # everything else the checkpoint holds
    loader = run.loader(train, batch_size=p.batch, drop_last=True)  # its position is checkpointed

    for step in run.steps(p.steps):                      # resumes after the last checkpoint
        model.train()
        x, y = next(loader)
        with run.autocast():
            loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
        trainer.backward(loss)
        trainer.step()
        run.log(loss=loss)                               # the trace the smoke compares
        if run.every(p.eval_every):                      # and on the last step
            model.eval()
            with torch.no_grad():
                logits = model(val_x)
                run.log(val_loss=F.cross_entropy(logits, val_y), val_acc=(logits.argmax(1) == val_y).float().mean())
