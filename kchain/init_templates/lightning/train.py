"""@NAME@: a classifier trained by Lightning's Trainer.fit.

Written the way a Lightning script is: a LightningModule, a LightningDataModule, a Trainer and
trainer.fit(model, datamodule). One line makes it a kchain job, marked `kchain:` below: the callback
given to the Trainer. kchain then restores the last session's checkpoint into the Trainer, keeps the
training data's shuffle and place, saves on the job's cadence, stops before the session's end and
resumes in the next session at the very batch where it stopped.

Nothing is downloaded: the data is generated (Gaussian blobs). Replace BlobData with your own
LightningDataModule (reading run.input("your-dataset")) and Classifier with your model.
"""

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self, features: int, classes: int, hidden: int, dropout: float, lr: float, epochs: int):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return {"optimizer": opt, "lr_scheduler": sched}  # stepped once an epoch


class BlobData(pl.LightningDataModule):
    """Rows drawn around one centre per class; replace with your dataset."""

    def __init__(self, rows: int, features: int, classes: int, batch: int, num_workers: int, seed: int):
        super().__init__()
        self.rows, self.features, self.classes = rows, features, classes
        self.batch, self.num_workers, self.seed = batch, num_workers, seed

    def setup(self, stage: str):
        rng = np.random.default_rng(self.seed)
        centres = rng.normal(0, 2.0, size=(self.classes, self.features))
        labels = rng.integers(self.classes, size=self.rows)
        x = (centres[labels] + rng.normal(0, 1.5, size=(self.rows, self.features))).astype(np.float32)
        cut = int(0.8 * self.rows)
        self.train = TensorDataset(torch.from_numpy(x[:cut]), torch.from_numpy(labels[:cut]))
        self.val = TensorDataset(torch.from_numpy(x[cut:]), torch.from_numpy(labels[cut:]))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch, shuffle=True, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=256, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)


def main(run):
    p = run.params
    pl.seed_everything(p.seed)
    model = Classifier(p.features, p.classes, p.hidden, p.dropout, p.lr, p.epochs)
    data = BlobData(p.rows, p.features, p.classes, p.batch, p.num_workers, p.seed)
    trainer = pl.Trainer(
        max_epochs=p.epochs,
        accelerator="auto",
        devices="auto",  # both T4s on Kaggle (DDP over kchain's two ranks); the smoke's CPU ranks alike
        enable_progress_bar=False,  # the notebook's log is a file: kchain's heartbeat line replaces the bar
        callbacks=[run.lightning_callback()],  # kchain: checkpoints, the deadline stop and the exact resume
    )
    trainer.fit(model, data)
    if run.finished:  # not after a deadline or SIGTERM stop: the model is final
        trainer.save_checkpoint(run.working / "final.ckpt")  # every rank calls it; rank 0 writes
