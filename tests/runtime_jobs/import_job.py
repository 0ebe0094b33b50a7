"""A script-shaped job: its model and a weight EMA are built when the module is imported, before main(run)
runs, as a notebook's cells or a module-level script build them. The EMA is never tracked, so a resume
starts it over: the smoke's watch for untracked state must see objects made at the entry's import too.
"""

import torch
import torch.nn.functional as F
from tiny_job import N_CLASSES, N_FEATURES, NoisyRows
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU(), nn.Linear(16, N_CLASSES))
net_ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))


def main(run):
    model = run.wrap(net)
    run.track(model=model)
    stepper = run.optimize(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = run.loader(NoisyRows(40), batch_size=8, drop_last=True)
    for _ in run.epochs(2):
        for x, y in loader:
            stepper.backward(F.cross_entropy(model(x), y))
            stepper.step()
            net_ema.update_parameters(net)
            run.log(loss=0.0)
