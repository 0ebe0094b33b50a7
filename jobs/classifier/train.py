"""A two-layer classifier on generated Gaussian blobs, with a held-out validation split.

The data order comes from run.loader (shuffled, two worker processes) so a resumed session sees
exactly the batches the uninterrupted run would have seen.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def make_blobs(p):
    """Rows drawn around one centre per class; the last 20% of a shuffled order is validation."""
    rng = np.random.default_rng(p["seed"])
    centres = rng.normal(0, 2.0, size=(p["classes"], p["features"]))
    labels = rng.integers(p["classes"], size=p["rows"])
    x = centres[labels] + rng.normal(0, 1.5, size=(p["rows"], p["features"]))
    order = rng.permutation(p["rows"])
    cut = int(0.8 * p["rows"])
    train, val = order[:cut], order[cut:]
    return {
        "x_train": x[train].astype(np.float32), "y_train": labels[train].astype(np.int64),
        "x_val": x[val].astype(np.float32), "y_val": labels[val].astype(np.int64),
    }


def main(run):
    p = run.params
    torch.manual_seed(p.seed)
    rows = max(400, int(p.rows * run.fraction))
    data = run.stage("blobs", {"rows": rows, "features": p.features, "classes": p.classes, "seed": p.seed}, make_blobs)
    train = TensorDataset(torch.from_numpy(np.array(data["x_train"])), torch.from_numpy(np.array(data["y_train"])))
    val_x = torch.from_numpy(np.array(data["x_val"])).to(run.device)
    val_y = torch.from_numpy(np.array(data["y_val"])).to(run.device)

    loader = run.loader(train, batch_size=p.batch, shuffle=True, num_workers=p.num_workers, drop_last=True)
    x, y = next(iter(torch.utils.data.DataLoader(train, batch_size=p.batch)))
    run.check(batch=(x, y), x_shape=(None, p.features), x_dtype=torch.float32,
              num_classes=p.classes, label_dtype=torch.int64,
              splits={"train": data["x_train"], "val": data["x_val"]})

    # On run.device; in DistributedDataParallel when train.gpus gives the job several ranks.
    model = run.wrap(nn.Sequential(
        nn.Linear(p.features, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),
        nn.Linear(p.hidden, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),
        nn.Linear(p.hidden, p.classes),
    ))
    optimizer = torch.optim.Adam(model.parameters(), lr=p.lr)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, p.steps // 3), gamma=0.3)
    run.track(model=model, scheduler=schedule)
    trainer = run.optimize(optimizer, accumulate=p.accumulate)

    for step in run.steps(p.steps):
        model.train()
        for _ in range(trainer.accumulate):
            x, y = next(loader)
            with run.autocast():
                loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
            trainer.backward(loss)
        trainer.step()
        schedule.step()
        run.log(loss=loss.item())
        if run.every(p.eval_every):
            model.eval()
            with torch.no_grad():
                logits = model(val_x)
                run.log(val_loss=F.cross_entropy(logits, val_y).item(),
                        val_acc=(logits.argmax(1) == val_y).float().mean().item())
