"""The job bench/gpu_check.py trains on a GPU: mixed precision through run.autocast and run.optimize (fp16
gets its GradScaler), dropout and an explicit draw from the CUDA generator every step, a shuffled
loader. Each step logs the loss, the CUDA draw and the scaler's scale, so a resume that restored the
CUDA RNG or the scaler wrongly shows in the trace as well as in the state.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def main(run):
    p = run.params
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(1)
    model = run.wrap(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.GELU(),
                                   nn.Dropout(0.2), nn.Linear(256, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stepper = run.optimize(opt)
    run.track(model=model)
    loader = run.loader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=True)
    for _ in run.steps(p.steps):
        xb, yb = next(loader)
        xb, yb = xb.to(run.device), yb.to(run.device)
        noise = torch.rand(1, device=run.device)  # a draw from the CUDA generator the resume must restore
        with run.autocast():
            logits = model(xb + 0.01 * noise)
            loss = F.cross_entropy(logits, yb)
        stepper.backward(loss)
        stepper.step()
        scale = stepper.scaler.get_scale() if stepper.scaler is not None else 0.0
        run.log(loss=loss.item(), cuda_draw=noise.item(), scale=scale, logits_fp16=float(logits.dtype == torch.float16))


# The ladder's job seeds at import, as many scripts do, not in main: a retry of main after an
# out-of-memory error must then start from the RNG state the first attempt started from.
torch.manual_seed(0)


def ladder(run):
    """train.micro_batch: auto against a real CUDA out-of-memory error: the process may use `mem_cap_gb`
    of the GPU, and a micro-batch of `batch` rows does not fit it (each row holds a few hundred KB of
    activations in the wide hidden layer)."""
    p = run.params
    if p.get("mem_cap_gb") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(p.mem_cap_gb * 2**30 / total)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(p.rows, 256, generator=g)
    y = (x @ torch.randn(256, 8, generator=g)).argmax(1)
    model = run.wrap(nn.Sequential(nn.Linear(256, p.hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(p.hidden, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper = run.optimize(opt, accumulate=p.accumulate)
    run.track(model=model)
    loader = run.loader(TensorDataset(x, y), batch_size=p.batch, shuffle=True, drop_last=True)
    for _ in run.steps(p.steps):
        for _ in range(stepper.accumulate):
            xb, yb = next(loader)
            with run.autocast():
                loss = F.cross_entropy(model(xb.to(run.device)), yb.to(run.device))
            stepper.backward(loss)
        stepper.step()
        run.log(loss=loss.item())
