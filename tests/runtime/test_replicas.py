"""runtime/replicas.py without a Run: what trains outside DDP, and which parameter the ranks disagree on."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from kchain.emulator.app import PATIENCE_S
from kchain.runtime import replicas


def test_an_optimizer_stepping_a_parameter_outside_ddp_is_named(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    line = replicas.unsynced([opt], {"model": model})
    assert line is not None and line.startswith("SGD steps model.0.weight, which is not in DistributedDataParallel")
    assert "model = run.wrap(model)" in line


DDP_AND_FROZEN = """
import sys
import torch, torch.distributed as dist
from torch import nn
from kchain.runtime import replicas
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
frozen = nn.Linear(3, 3).requires_grad_(False)  # a frozen base outside DDP trains nothing
model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
opt = torch.optim.Adam([*model.parameters(), *frozen.parameters()], lr=0.1)
# An untracked optimizer is found too: here the one found steps only DDP's and frozen parameters.
assert replicas.unsynced([], {"model": model}) is None
assert replicas.unsynced([opt], {"model": model, "base": frozen}) is None
stray = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # and one that steps a parameter outside DDP
line = replicas.unsynced([], {"model": model})
assert line is not None and line.startswith("SGD steps a (2, 2) parameter"), line
dist.destroy_process_group()
"""


def test_parameters_under_ddp_and_frozen_ones_pass(tmp_path):
    # In a process of its own: the check finds every live optimizer in the process, and an earlier test's
    # (a framework's Trainer still referenced somewhere) would be found too.
    done = subprocess.run([sys.executable, "-c", DDP_AND_FROZEN, str(tmp_path / "pg")], capture_output=True,
                          text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr


def test_the_first_parameter_whose_sum_differs_is_named_and_a_nan_everywhere_agrees():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    params = replicas.trained([torch.optim.SGD(a.parameters(), lr=0.1)], {"net": a})
    twin = replicas.trained([torch.optim.SGD(b.parameters(), lr=0.1)], {"net": b})
    assert replicas.differing([replicas.fingerprint(params), replicas.fingerprint(twin)], params) is None
    with torch.no_grad():
        b.bias[1] += 1e-6
    line = replicas.differing([replicas.fingerprint(params), replicas.fingerprint(twin)], params)
    assert line is not None and line.startswith("net.bias (sum ")
    with torch.no_grad():
        a.weight.fill_(float("nan"))
        b.weight.fill_(float("nan"))
        b.bias.copy_(a.bias)
    assert replicas.differing([replicas.fingerprint(params), replicas.fingerprint(twin)], params) is None


def test_fsdp_counts_as_keeping_the_ranks_in_step_once_the_job_imports_it():
    # The runtime never imports FSDP itself (most of a second per session); a job that wraps a model
    # in it has imported it, and from then on its modules count as synced and sharded.
    code = ("import sys; from kchain.runtime import run, replicas; "
            "assert 'torch.distributed.fsdp' not in sys.modules, 'the runtime imported FSDP'; "
            "assert replicas._syncing() == (replicas.DistributedDataParallel,); "
            "from torch.distributed.fsdp import FullyShardedDataParallel as F; "
            "assert replicas._syncing()[1] is F")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
