"""Held-out shapes where the logged values agree but the state does not (issue 39).

- `ema`: pytorch/vision's classification reference: AMP through run.autocast, a weight EMA
  (AveragedModel) updated every `ema_steps` batches, a shuffled loader, `for epoch in run.epochs(E)`.
  `count: enumerate` counts the EMA updates as upstream does, by the batch index of
  `enumerate(loader)`, which restarts at 0 after a mid-epoch resume: one update too many, and the
  logged loss does not move. `count: step` counts by the global step (the fix). `gpu_args: true` builds
  the loader with the arguments upstream passes only when CUDA is there (pin_memory,
  persistent_workers, prefetch_factor). `track_ema: false` forgets the EMA, `track_model: false` the model.
- `prefetch`: each rank keeps its own next batch in an object of its own (tracked): a resume must give
  each rank its own back, not rank 0's.
"""

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU(), nn.Linear(16, N_CLASSES))


def ema(run):
    p = run.params
    model = run.wrap(_model())
    stepper = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model_ema = AveragedModel(getattr(model, "module", model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    if p.get("track_model", True):
        run.track(model=model)
    if p.get("track_ema", True):
        run.track(model_ema=model_ema)
    gpu = {"pin_memory": True, "persistent_workers": True, "prefetch_factor": 2, "num_workers": 1} \
        if p.get("gpu_args") else {}
    loader = run.loader(NoisyRows(p.get("rows", 40)), batch_size=8, drop_last=True, **gpu)
    val = NoisyRows(16)
    for epoch in run.epochs(p.epochs):
        model.train()
        for i, (x, y) in enumerate(loader):
            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            stepper.backward(loss)
            stepper.step()
            counter = i if p.get("count", "step") == "enumerate" else run.step
            if counter % p.get("ema_steps", 2) == 0:
                model_ema.update_parameters(getattr(model, "module", model))
            run.log(loss=loss.item(), epoch=epoch)
        with torch.no_grad():
            # what upstream prints: an accuracy too coarse to move with the EMA's small drift
            print(f"ema acc {(model_ema(val.x).argmax(1) == val.y).float().mean().item():.1f}")


class Prefetcher:
    """Holds the batch the next step trains on (each rank its own), as a CUDA prefetcher does."""

    def __init__(self, loader):
        self.loader = loader
        self.next = None

    def take(self):
        batch = self.next if self.next is not None else next(self.loader)
        self.next = next(self.loader)
        return batch

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def prefetch(run):
    model = run.wrap(_model(), gradient_as_bucket_view=True)  # DDP's own arguments pass through run.wrap
    stepper = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = run.loader(NoisyRows(64), batch_size=4)
    ahead = Prefetcher(loader)
    run.track(model=model, ahead=ahead)
    for _ in run.steps(run.params.steps):
        x, y = ahead.take()
        loss = F.cross_entropy(model(x), y)
        stepper.backward(loss)
        stepper.step()
        run.log(loss=loss.item(), mean_over_ranks=True)
