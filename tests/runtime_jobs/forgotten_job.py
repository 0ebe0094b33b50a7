"""State a ported script keeps beside what it hands to run.track (issue 55), each in the shape users bring.

- `ema_list`: diffusers' `EMAModel` shape: not a module, its `shadow_params` a list of tensors, with a
  state_dict; left out of run.track (`ema` param "track": tracked, the fix).
- `averaged`: torchvision's reference EMA, an `AveragedModel` updated every 32 steps, left out: it has
  not changed yet when the smoke's steps end, and a resume rebuilds it from the resumed weights.
- `generator_in_list`: a torch.Generator kept in a list, drawn from at every step, left out.
- `shadow`: a hand-written EMA of no known kind (a plain object holding a list of tensors), updated every
  2 steps, left out: only the state comparison at the saves sees it (`untrack`: excluded on purpose).
- `batchnorm`: BatchNorm under two ranks in DDP without SyncBatchNorm and without buffer broadcasts:
  each rank keeps its own running statistics, tracked as one model.
"""

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn


class EMAModel:
    """The shape of diffusers.training_utils.EMAModel: shadow tensors in a list, a counter, a state_dict."""

    def __init__(self, parameters, decay: float = 0.9):
        self.shadow_params = [p.detach().clone() for p in parameters]
        self.decay = decay
        self.optimization_step = 0

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        for s, p in zip(self.shadow_params, parameters, strict=True):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "optimization_step": self.optimization_step, "shadow_params": self.shadow_params}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.optimization_step = state["decay"], state["optimization_step"]
        for s, v in zip(self.shadow_params, state["shadow_params"], strict=True):
            s.copy_(v)


class Shadow:
    """A hand-written EMA of no known kind: a plain object holding a list of tensors."""

    def __init__(self, model):
        self.params = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model) -> None:
        for s, p in zip(self.params, model.parameters(), strict=True):
            s.mul_(0.5).add_(p.detach(), alpha=0.5)


def _model(norm: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(N_FEATURES, 16), *([nn.BatchNorm1d(16)] if norm else []), nn.ReLU(), nn.Linear(16, N_CLASSES)]
    return nn.Sequential(*layers)


def _loop(run, model, after_step=lambda step: None, noise=None):
    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    run.track(model=model)
    loader = run.loader(NoisyRows(40), batch_size=4)
    for step in run.steps(run.params.steps):
        x, y = next(loader)
        if noise is not None:
            x = x + 0.01 * torch.randn(x.shape, generator=noise())
        loss = F.cross_entropy(model(x), y)
        trainer.backward(loss)
        trainer.step()
        after_step(step)
        run.log(loss=loss.item())


def ema_list(run):
    model = run.wrap(_model())
    ema_model = EMAModel(model.parameters())
    if run.params.get("track"):
        run.track(ema_model=ema_model)
    _loop(run, model, lambda step: ema_model.step(model.parameters()))


def averaged(run):
    model = run.wrap(_model())
    model_ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    _loop(run, model, lambda step: model_ema.update_parameters(model) if step % 32 == 0 else None)


def generator_in_list(run):
    model = run.wrap(_model())
    gens = [torch.Generator().manual_seed(5)]
    _loop(run, model, noise=lambda: gens[0])


def shadow(run):
    model = run.wrap(_model())
    avg = Shadow(model)
    if run.params.get("untrack"):
        run.untrack(avg, reason="rebuilt from the weights")
    if run.params.get("track"):
        run.track(shadow=avg.params)  # a list of tensors, loaded back in place
    _loop(run, model, lambda step: avg.update(model) if step % 2 == 0 else None)


def batchnorm(run):
    model = run.wrap(_model(norm=True), broadcast_buffers=False)
    _loop(run, model)
