"""@NAME@: a classifier trained by a Lightning Fabric loop.

Written the way a Fabric script is: Fabric(...), launch(), setup(), setup_dataloaders(), a loop over
epochs and batches calling the model's training_step, backward() with no_backward_sync() between the
accumulated batches, clip_gradients(). Three lines make it a kchain job, marked `kchain:` below: the
Fabric comes from run.fabric(...) with the same arguments, the epochs from run.epochs(...), and the
batch index the accumulation reads counts from the loader's position (a loop without accumulation
keeps its plain enumerate). kchain then
checkpoints the model, the optimizer, the scheduler and the RNG states, keeps the training data's
shuffle and place, saves on the job's cadence, stops before the session's end and resumes in the next
session at the very batch where it stopped.

Nothing is downloaded: the data is generated (Gaussian blobs). Replace blobs() with your dataset
(reading run.input("your-dataset")) and the model with yours.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(rows: int, features: int, classes: int, seed: int):
    """Rows drawn around one centre per class, 80% train and 20% validation; replace with your dataset."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2.0, size=(classes, features))
    labels = rng.integers(classes, size=rows)
    x = torch.from_numpy((centres[labels] + rng.normal(0, 1.5, size=(rows, features))).astype(np.float32))
    y = torch.from_numpy(labels)
    cut = int(0.8 * rows)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


class Classifier(nn.Module):
    def __init__(self, features: int, classes: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):  # called on the set-up model: Fabric runs it through DDP's forward
        x, y = batch
        return F.cross_entropy(self(x), y)


def main(run):
    p = run.params
    # kchain: was Fabric(accelerator="cuda", devices="auto", precision="16-mixed"); accumulate= is kchain's
    fabric = run.fabric(accelerator="cuda", devices="auto", precision="16-mixed", accumulate=p.accumulate)
    fabric.launch()
    fabric.seed_everything(p.seed)
    train_set, val_set = blobs(p.rows, p.features, p.classes, p.seed)
    model = Classifier(p.features, p.classes, p.hidden, p.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=p.epochs)  # stepped once an epoch
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=p.batch, shuffle=True, num_workers=p.num_workers),
        DataLoader(val_set, batch_size=128))

    for epoch in run.epochs(p.epochs):  # kchain: was range(p.epochs)
        model.train()
        # kchain: enumerate from the loader's position (its batches already trained this epoch, > 0 after a
        # resume mid-epoch), so the accumulation steps at the batches it stepped at without the resume.
        for i, batch in enumerate(train_loader, train_loader.position):
            accumulating = (i + 1) % p.accumulate != 0 and i + 1 != len(train_loader)
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = model.training_step(batch)
                fabric.backward(loss / p.accumulate)
            if not accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
                fabric.log_dict({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
        scheduler.step()

        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for x, y in val_loader:
                predictions = model(x).argmax(dim=-1)
                correct += fabric.all_reduce((predictions == y).sum(), reduce_op="sum").item()
                seen += fabric.all_reduce(torch.tensor(y.numel(), device=fabric.device), reduce_op="sum").item()
        fabric.log("val_acc", correct / seen)
        fabric.print(f"epoch {epoch}: accuracy {correct / seen:.3f}")

    if run.finished:  # not after a deadline or SIGTERM stop: the model is final
        if fabric.is_global_zero:  # fabric.save is kchain's job now: the export is a plain state dict
            torch.save(model.state_dict(), run.export_dir / "model.pt")
