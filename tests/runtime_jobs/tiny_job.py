"""A tiny classifier that exercises everything resume must get right.

Dropout (global torch RNG), per-sample noise in the dataset (RNG inside the loader's workers), Adam
(optimizer state), a StepLR schedule, gradient accumulation and a shuffled multi-worker loader.
Params switch pieces on and off for the tests.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

N_FEATURES = 8
N_CLASSES = 4


class NoisyRows(Dataset):
    """Fixed rows plus fresh noise per fetch: augmentation, seeded by the runtime per batch."""

    def __init__(self, n_rows: int):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n_rows, N_FEATURES, generator=g)
        self.y = (self.x @ torch.randn(N_FEATURES, N_CLASSES, generator=g)).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(N_FEATURES), self.y[i]


def main(run):
    p = run.params
    if p.get("seed_in_main", True):  # False: main leaves the global RNGs as it finds them
        torch.manual_seed(p.get("seed", 0))
    data = NoisyRows(p.get("rows", 96))
    model = run.wrap(nn.Sequential(  # on run.device; DDP under several ranks
        nn.Linear(N_FEATURES, p.d_model), nn.ReLU(), nn.Dropout(p.get("dropout", 0.2)), nn.Linear(p.d_model, N_CLASSES)
    ))
    opt = torch.optim.Adam(model.parameters(), lr=p.get("lr", 1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    trainer = run.optimize(opt, accumulate=p.get("accumulate", 2), clip=1.0, track=p.get("track_optimizer", True))
    run.track(model=model, sched=sched)
    loader = run.loader(data, batch_size=p.get("batch", 8), num_workers=p.get("workers", 0), drop_last=True)

    for step in run.steps(p.steps):
        model.train()
        total = 0.0
        for _ in range(trainer.accumulate):
            x, y = (t.to(run.device) for t in next(loader))
            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            trainer.backward(loss)
            total += loss.item()
        trainer.step()
        sched.step()
        run.log(loss=total / trainer.accumulate, lr=sched.get_last_lr()[0], epoch=loader.epoch)
        if step == p.get("crash_at"):
            raise ValueError(f"boom at step {step}\nsecond line")
        if run.every(p.get("val_every", 5)):
            model.eval()
            with torch.no_grad():
                run.log(val_loss=F.cross_entropy(model(data.x.to(run.device)), data.y.to(run.device)).item())
