"""`kchain init DIR`: a commented job.yaml and a train.py skeleton that pass `kchain smoke` as written."""

from __future__ import annotations

import re
from pathlib import Path

from kchain.errors import SpecError
from kchain.spec import ACCELERATORS, NAME_MAX, NAME_MIN

JOB_YAML = """\
# {name}: written by `kchain init`. Every key below is optional except name and code.
#   kchain smoke {folder}/job.yaml    # proves checkpoint + exact resume on this CPU, in seconds
#   kchain push {folder}/job.yaml     # a GPU session on Kaggle (after a smoke pass)
#   kchain continue {folder}/job.yaml # the next session, from the last checkpoint
name: {name}           # the Kaggle kernel's slug: {name_min}-{name_max} lowercase letters, digits, single dashes
code: train.py         # a file or a folder (then train.py in it); main(run) is the entry
params:                # anything: main reads run.params.<key>; change one and the resume says so
  steps: 600           # optimizer steps of the whole run (all sessions together)
  lr: 1.0e-3
  seed: 0
  rows: 20000          # generated rows; the smoke sees smoke.fraction of them
  batch: 64
  eval_every: 100
kaggle:
  accelerator: gpu     # {accelerators} (gpu: Kaggle's T4 x2)
  internet: false      # the runtime needs no internet
  private: true
  datasets: []         # attached inputs, owner/slug[/version]; read them with run.input("slug")
  local: {{}}            # slug: a small local copy of each dataset, for the smoke
train:
  checkpoint_every: 10m  # or e.g. 500 steps
  keep: 2                # checkpoints kept; older ones are pruned (before a write if the disk is short)
  session_limit: 12h     # Kaggle's cap; the run saves and stops `margin` before it
  margin: 15m
  precision: auto        # auto (bf16 on Ampere+, fp16 on a T4) | fp32 | bf16 | fp16
  gpus: auto             # one rank per visible GPU (2 on Kaggle); train.py's run.wrap keeps them one model
smoke:
  fraction: 0.02         # share of the data the smoke run uses (run.subset)
  steps: 2               # steps before the kill; as many again after the resume
budget:
  weekly_gpu_hours: 30
"""

TRAIN_PY = '''\
"""{name}: a small classifier on generated data. Replace the data and the model with yours.

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
    return {{"x_train": x[:cut].numpy(), "y_train": y[:cut].numpy(), "x_val": x[cut:].numpy(), "y_val": y[cut:].numpy()}}


def main(run):
    p = run.params
    torch.manual_seed(p.seed)
    rows = max(400, int(p.rows * run.fraction))          # a small slice in the smoke run
    data = run.stage("data", {{"rows": rows, "seed": p.seed}}, make_data)  # built once, then cached
    train = TensorDataset(torch.tensor(data["x_train"]), torch.tensor(data["y_train"]))
    val_x, val_y = torch.tensor(data["x_val"]).to(run.device), torch.tensor(data["y_val"]).to(run.device)
    run.check(batch=train[:8], x_shape=(None, 16), num_classes=4,   # shape/label bugs stop here
              splits={{"train": data["x_train"], "val": data["x_val"]}})

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
'''


def slug_for(folder: Path) -> str:
    """A job name spec accepts, from the folder name: NAME_MIN-NAME_MAX lowercase letters, digits, single dashes."""
    name = re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-") or "my-job"
    return (name if len(name) >= NAME_MIN else f"{name}-job")[:NAME_MAX].strip("-")


def render(template: str, name: str, folder: Path) -> str:
    """A skeleton file's text; the job.yaml's comments state the limits spec.py enforces."""
    return template.format(name=name, folder=folder, name_min=NAME_MIN, name_max=NAME_MAX,
                           accelerators=" | ".join(ACCELERATORS))


def init_job(folder: Path) -> list[Path]:
    """Write folder/job.yaml and folder/train.py; refuse if either exists. Returns the paths written."""
    files = {folder / "job.yaml": JOB_YAML, folder / "train.py": TRAIN_PY}
    taken = [str(p) for p in files if p.exists()]
    if taken:
        raise SpecError(f"{', '.join(taken)} already exists; kchain init never overwrites: choose an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    name = slug_for(folder)
    for path, text in files.items():
        path.write_text(render(text, name, folder))
    return list(files)
