"""The shapes real ported scripts take, where a resume used to differ silently (issue 20).

- `epoch_eval`: pytorch/examples mnist: `for epoch in run.epochs(E)`, the batches, then a
  per-epoch StepLR step and an evaluation; a stop mid-epoch must not run them before the save.
- `unwrapped`: the model moved with `.to(run.device)`, not `run.wrap`: two ranks, two models.
- `bypassed`: wrapped, but the forward goes around DDP (`model.module(x)`, as calling a Lightning
  module's `training_step` does): no gradient is averaged.
- `file_state`: the model kept in a file of the job's own in the working dir, nothing tracked; a
  fresh session (empty working dir) cannot see it.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, N_CLASSES))


def _train_step(model, trainer, x, y) -> float:
    loss = F.cross_entropy(model(x), y)
    trainer.backward(loss)
    trainer.step()
    return loss.item()


def epoch_eval(run):
    p = run.params
    model = run.wrap(_model())
    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
    run.track(model=model, sched=sched)
    loader = run.loader(NoisyRows(p.get("rows", 40)), batch_size=p.get("batch", 8), drop_last=True)
    val = NoisyRows(16)
    for epoch in run.epochs(p.epochs):
        model.train()
        for x, y in loader:
            run.log(loss=_train_step(model, trainer, x, y), lr=sched.get_last_lr()[0], epoch=epoch)
        sched.step()  # per epoch, after the batches: must never run for an unfinished epoch
        model.eval()
        with torch.no_grad():
            run.log(val_loss=F.cross_entropy(model(val.x), val.y).item())


def _two_models(run, model, forward):
    """run.steps over the tiny classifier, stepping `model`'s parameters, the forward through `forward`."""
    trainer = run.optimize(torch.optim.Adam(model.parameters(), lr=0.01))
    run.track(model=model)
    loader = run.loader(NoisyRows(40), batch_size=4)
    for _ in run.steps(run.params.steps):
        x, y = next(loader)
        run.log(loss=_train_step(forward, trainer, x, y))


def unwrapped(run):
    model = _model().to(run.device)  # the porting mistake: each rank trains its own copy
    _two_models(run, model, model)


def bypassed(run):
    model = run.wrap(_model())
    _two_models(run, model, getattr(model, "module", model))  # the forward skips DDP, as training_step() does


def file_state(run):
    own = Path("own_model.pt")  # the job's own file in the working dir (cwd), as a ported script keeps it
    model = _model()
    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05), track=False)
    if own.exists():
        model.load_state_dict(torch.load(own))
    loader = run.loader(NoisyRows(40), batch_size=4)
    for _ in run.steps(run.params.steps):
        model.eval()  # no dropout: the file alone would be the whole state
        x, y = next(loader)
        run.log(loss=_train_step(model, trainer, x, y))
        torch.save(model.state_dict(), own)


def explicit(run):
    """A loop kchain cannot drive: run.restore, run.should_stop and run.save(step) of its own."""
    p = run.params
    model = run.wrap(_model())
    trainer = run.optimize(torch.optim.Adam(model.parameters(), lr=0.01))
    run.track(model=model)
    loader = run.loader(NoisyRows(40), batch_size=4)
    start = run.restore()
    for step in range(start + 1, p.steps + 1):
        x, y = next(loader)
        run.log(step=step, loss=_train_step(model, trainer, x, y))
        stop = run.should_stop(step)
        if stop or step % p.save_every == 0 or step == p.steps:
            run.save(step)
    run.log(step=p.steps, after_the_loop=1.0)  # runs only when the run is finished
