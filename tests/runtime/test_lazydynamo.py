"""The training child's optimizers without torch._dynamo's import: the same numbers, and torch's marks once it is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Two optimizers of two kinds, their schedulers, zero_grad and a state_dict round trip: every mark
# torch puts on an optimizer runs. (Compiling the step is left out: 7 s of CPU for dynamo's tracing.)
TRAIN = '''
import hashlib, torch

def train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opts = [torch.optim.AdamW(model[0].parameters(), lr=1e-2), torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2) for o in opts]

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        return loss

    for _ in range(4):
        step(torch.randn(4, 8))
        for s in scheds:
            s.step()
    for o in opts:
        o.load_state_dict(o.state_dict())
    grad_mode = torch.is_grad_enabled()
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(), grad_mode
'''

CHILD = TRAIN + '''
import inspect, json, sys
import torch.optim.optimizer as optimizer_module
assert "def _use_grad_for_differentiable" in inspect.getsource(optimizer_module)  # its loader still reads it
plain = train()
loaded_by_optimizers = "torch._dynamo" in sys.modules
import torch._dynamo  # what torch.compile imports first: from now on torch's own marks run
print(json.dumps({"plain": plain, "loaded": loaded_by_optimizers, "marked": train()}))
'''


@pytest.mark.slow
def test_the_optimizers_run_the_same_without_importing_dynamo():
    setup = "from kchain.runtime import lazydynamo\nassert lazydynamo.install()\n"
    out = subprocess.run([sys.executable, "-c", setup + CHILD], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = json.loads(out.stdout.splitlines()[-1])
    assert child["loaded"] is False  # no optimizer call imported torch._dynamo
    namespace: dict = {}
    exec(TRAIN, namespace)  # this process: torch's own marks (torch was imported before any install)
    expected = list(namespace["train"]())
    assert child["plain"] == child["marked"] == expected and expected[1] is True


def test_install_is_a_no_op_once_torch_is_imported():
    import torch  # noqa: F401

    from kchain.runtime import lazydynamo

    assert lazydynamo.install() is False


# A model two ranks share, built and trained by kchain's launcher's child (gloo, a group of one here).
DDP_CHILD = '''
import hashlib, json, os, sys
from kchain.runtime import lazydynamo
if sys.argv[1] == "lazy":
    assert lazydynamo.install()
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                                      torch.nn.Linear(16, 1)))
built_without = "torch._dynamo" not in sys.modules
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({"built_without_dynamo": built_without, "python_reducer": model._use_python_reducer,
                  "stand_in_left": "_dynamo" in vars(torch) and "torch._dynamo" not in sys.modules,
                  "weights": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()}))
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_a_ddp_is_built_without_importing_dynamo_and_trains_the_same():
    import socket

    def run(mode: str) -> dict:
        with socket.socket() as s:  # a free port for the group's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", DDP_CHILD, mode, str(port)], cwd=REPO, capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        return json.loads(out.stdout.splitlines()[-1])

    lazy, plain = run("lazy"), run("plain")
    assert lazy["built_without_dynamo"] is True and plain["built_without_dynamo"] is False  # DDP imports it
    assert lazy["python_reducer"] is plain["python_reducer"] is False  # the mode torch's default config gives
    assert lazy["stand_in_left"] is False  # torch._dynamo is torch's own again after the construction
    assert lazy["weights"] == plain["weights"]
