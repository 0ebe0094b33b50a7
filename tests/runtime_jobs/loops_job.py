"""The loop shapes people port to kchain, one entry each (tests/scenarios/test_runtime_loops.py kills them).

Every entry trains the same tiny classifier on NoisyRows (per-fetch noise, dropout, Adam), logs
`loss` once per step, and picks its loop shape from the entry name.
"""

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, WeightedRandomSampler


def _model(run, p):
    """The classifier, through run.wrap: on run.device, in DDP under several ranks."""
    torch.manual_seed(p.get("seed", 0))
    return run.wrap(nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, N_CLASSES)))


def _step(model, trainer, batch) -> float:
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in batch)
    loss = F.cross_entropy(model(x), y)
    trainer.backward(loss)
    trainer.step()
    return loss.item()


def _basic(run, **loader_kw):
    p = run.params
    model = _model(run, p)
    trainer = run.optimize(torch.optim.Adam(model.parameters(), lr=0.01))
    run.track(model=model)
    data = NoisyRows(p.get("rows", 40))
    loader = run.loader(data, **({"batch_size": 4} | loader_kw))
    return model, trainer, loader, data


def stop(run):
    """Early stopping: break out of run.steps."""
    model, trainer, loader, _ = _basic(run)
    for step in run.steps(run.params.steps):
        run.log(loss=_step(model, trainer, next(loader)))
        if step == run.params.stop_at:
            break


def epochs(run):
    """for epoch in run.epochs(E): for batch in loader, with a per-epoch scheduler step."""
    p = run.params
    model, trainer, loader, _ = _basic(run, drop_last=True)
    sched = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
    run.track(sched=sched)
    for epoch in run.epochs(p.epochs):
        for batch in loader:
            run.log(loss=_step(model, trainer, batch), epoch=epoch, lr=sched.get_last_lr()[0])
        sched.step()


def sampler(run):
    data = NoisyRows(run.params.get("rows", 40))
    weights = torch.linspace(0.1, 1.0, len(data))
    model, trainer, loader, _ = _basic(run, sampler=WeightedRandomSampler(weights, len(data)))
    for _ in run.steps(run.params.steps):
        run.log(loss=_step(model, trainer, next(loader)))


def batch_sampler(run):
    data = NoisyRows(run.params.get("rows", 40))
    bs = BatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(5)), 4, drop_last=False)
    model, trainer, loader, _ = _basic(run, batch_sampler=bs)
    for _ in run.steps(run.params.steps):
        run.log(loss=_step(model, trainer, next(loader)))


class Stream(IterableDataset):
    """A stream that yields the same rows in the same order each pass."""

    def __init__(self, n):
        self.rows = NoisyRows(n)

    def __iter__(self):
        for i in range(len(self.rows)):
            yield self.rows.x[i], self.rows.y[i]


def iterable(run):
    model, trainer, loader, _ = _basic(run)
    stream = run.loader(Stream(run.params.get("rows", 40)), batch_size=4, name="stream")
    for _ in run.steps(run.params.steps):
        run.log(loss=_step(model, trainer, next(stream)))


def gan(run):
    """Two models, two optimizers, two schedulers: names derived (optimizer, optimizer2)."""
    p = run.params
    a, b = _model(run, p), _model(run, {"seed": 1})
    ta = run.optimize(torch.optim.Adam(a.parameters(), lr=0.01))
    tb = run.optimize(torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9))
    sa = torch.optim.lr_scheduler.StepLR(ta.optimizer, 2, 0.7)
    sb = torch.optim.lr_scheduler.StepLR(tb.optimizer, 3, 0.5)
    run.track(a=a, b=b, sched_a=sa, sched_b=sb)
    loader = run.loader(NoisyRows(p.get("rows", 40)), batch_size=4)
    for _ in run.steps(p.steps):
        batch = next(loader)
        la, lb = _step(a, ta, batch), _step(b, tb, batch)
        sa.step()
        sb.step()
        run.log(loss=la + lb)


def manual(run):
    """A loop kchain does not drive: run.restore() and run.save(step)."""
    p = run.params
    model, trainer, loader, _ = _basic(run)
    start = run.restore()
    for step in range(start + 1, p.steps + 1):
        run.log(loss=_step(model, trainer, next(loader)), step=step)
        if step % 3 == 0 or step == p.steps:
            run.save(step)
        if step == p.get("kill_at"):
            import os
            import signal

            run.close()  # let the save land first, as a session killed later would have
            os.kill(os.getpid(), signal.SIGKILL)


def noloop(run):
    """Plain PyTorch: no run.steps, so nothing is ever checkpointed."""
    model, trainer, loader, _ = _basic(run)
    for _ in range(run.params.steps):
        run.log(loss=_step(model, trainer, next(loader)))


def plain_loader(run):
    """A DataLoader built by hand: its order restarts on resume."""
    p = run.params
    model = _model(run, p)
    trainer = run.optimize(torch.optim.Adam(model.parameters(), lr=0.01))
    run.track(model=model)
    dl = DataLoader(NoisyRows(p.get("rows", 40)), batch_size=4, shuffle=True)
    it = iter(dl)
    for _ in run.steps(p.steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(dl)
            batch = next(it)
        run.log(loss=_step(model, trainer, batch))
