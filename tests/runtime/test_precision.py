"""Precision and RNG: accumulation, the dtype choice and its refusals, the CUDA RNG on restore."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_run, saved_names
from torch import nn

from kchain.runtime import precision
from kchain.runtime.checkpoint.snapshot import restore_rng, rng_state
from kchain.runtime.precision import Amp


def test_accumulate_4_micro_batches_of_64_equals_one_batch_of_256(tmp_path):
    run = make_run(tmp_path)
    torch.manual_seed(0)
    x, y = torch.randn(256, 20), torch.randint(0, 5, (256,))
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
    big = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
    big.load_state_dict(model.state_dict())

    trainer = run.optimize(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
    assert isinstance(trainer, precision.Stepper) and precision.Trainer is precision.Stepper  # the old name stays
    for i in range(trainer.accumulate):
        trainer.backward(F.cross_entropy(model(x[i * 64 : (i + 1) * 64]), y[i * 64 : (i + 1) * 64]))
    F.cross_entropy(big(x), y).backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), big.parameters(), strict=True))
    assert diff < 1e-5
    trainer.step()
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    run.close()


def test_cuda_rng_mismatch_is_said_loudly(capsys):
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2  # saved on a 2-GPU machine
    restore_rng(state)
    out = capsys.readouterr().out
    assert "CUDA RNG states for 2 device(s) but this machine has 0" in out and "NO LONGER BIT-EXACT" in out


def test_bf16_on_a_gpu_without_it_is_refused_with_the_reason():
    from kchain.runtime.precision import choose_dtype

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"bf16 but this GPU \(compute capability 7.5, e.g. a T4\) has no bf16"):
        choose_dtype(cuda, "bf16", capability=(7, 5))
    assert choose_dtype(cuda, "bf16", capability=(8, 0))[0] == torch.bfloat16
    assert choose_dtype(cuda, "auto", capability=(7, 5))[0] == torch.float16


def test_fp16_autocast_without_run_optimize_warns_once_with_the_fix(tmp_path, capsys, monkeypatch):
    amp = Amp(torch.device("cpu"), torch.float16)  # what a T4 gets; the warning does not depend on the device
    for _ in range(3):
        with amp.autocast():
            pass
    out = capsys.readouterr().out
    assert out.count("WARNING: run.autocast() in fp16 without run.optimize") == 1
    assert "trainer = run.optimize(opt)" in out
    assert Amp(torch.device("cpu"), torch.float32).scaler() is None
    # The Run a T4 gets (fp16, chosen for its compute capability 7.5), built on this CPU.
    monkeypatch.setattr(precision, "choose_dtype", lambda device, requested: (torch.float16, "a T4's fp16"))
    run = make_run(tmp_path)
    assert run.dtype == torch.float16
    run.optimize(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))  # makes the GradScaler
    with run.autocast():
        pass
    assert "WARNING" not in capsys.readouterr().out
    run.save(0)
    run.close()
    assert "scaler" in saved_names(tmp_path)  # tracked beside the optimizer
