"""Device, autocast dtype and the optimizer step (gradient accumulation, loss scaling, clipping)."""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores; older GPUs emulate it slowly
FP16_WITHOUT_SCALER = (
    "run.autocast() in fp16 without run.optimize: no GradScaler, so small gradients underflow to zero; "
    "step the optimizer through trainer = run.optimize(opt) (it scales the loss), or set train.precision: bf16/fp32"
)


def choose_device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return torch.device("cuda"), f"{torch.cuda.device_count()} CUDA device(s), using {name}"
    return torch.device("cpu"), "no CUDA device visible (torch.cuda.is_available() is False)"


def choose_dtype(device: torch.device, requested: str = "auto",
                 capability: tuple[int, int] | None = None) -> tuple[torch.dtype, str]:
    """The autocast dtype and why; fp32 means autocast is off. `capability` overrides the GPU's."""
    if requested not in PRECISIONS:
        raise ValueError(f"train.precision is {requested!r}; use one of {', '.join(PRECISIONS)}")
    if device.type != "cuda":
        why = "CPU: autocast is off" + ("" if requested in ("auto", "fp32") else f" (asked for {requested})")
        return torch.float32, why
    cap = torch.cuda.get_device_capability(device) if capability is None else capability
    if requested == "fp32":
        return torch.float32, "train.precision: fp32"
    if requested == "fp16":
        return torch.float16, "train.precision: fp16 (with GradScaler)"
    if requested == "bf16":
        if cap < BF16_MIN_CAPABILITY:
            raise ValueError(
                f"train.precision is bf16 but this GPU (compute capability {cap[0]}.{cap[1]}, e.g. a T4) "
                "has no bf16 support (it needs 8.0+, e.g. an A100 or L4); use precision auto or fp16"
            )
        return torch.bfloat16, "train.precision: bf16"
    if cap >= BF16_MIN_CAPABILITY:
        return torch.bfloat16, f"auto: compute capability {cap[0]}.{cap[1]} >= 8.0 supports bf16"
    return torch.float16, f"auto: compute capability {cap[0]}.{cap[1]} < 8.0, fp16 with GradScaler"


def autocast(device: torch.device, dtype: torch.dtype, enabled: bool = True, cache_enabled: bool | None = None):
    if device.type != "cuda" or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class Amp:
    """Mixed precision for one run: the device, the autocast dtype, and whether fp16 got its scaler."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.scaled = False  # run.optimize made a GradScaler
        self._warned = False

    def scaler(self):
        """A GradScaler when the dtype is fp16 (small gradients underflow without one), else None."""
        if self.dtype != torch.float16:
            return None
        self.scaled = True
        return torch.amp.GradScaler(self.device.type)

    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None):
        if self.dtype == torch.float16 and not self.scaled and not self._warned and enabled:
            from kchain.common.say import warn

            self._warned = True
            warn(FP16_WITHOUT_SCALER)
        return autocast(self.device, self.dtype, enabled, cache_enabled)


class Stepper:
    """One optimizer step made of `accumulate` backward passes: what `run.optimize` returns.

    backward() divides the loss by `accumulate` (the most common accumulation bug is forgetting it:
    the summed gradient is then `accumulate` times too large) and scales it when fp16 needs a
    GradScaler. step() unscales, clips, steps, updates the scaler and zeroes the gradients.

    Named for what it does: it owns the optimizer step, not the loop (a "Trainer" in Lightning or
    HF owns the loop). It was called Trainer before; that name stays an alias.

    Example::

        stepper = run.optimize(opt, accumulate=4, clip=1.0)
        for _ in range(stepper.accumulate):
            stepper.backward(loss_of(next(loader)))
        norm = stepper.step()
    """

    def __init__(self, optimizer, accumulate: int = 1, clip: float | None = None, scaler=None):
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.optimizer = optimizer
        self.accumulate = accumulate
        self.clip = clip
        self.scaler = scaler

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() for one of `accumulate` micro-batches: divided by `accumulate`, scaled for fp16.

        Example: `stepper.backward(F.cross_entropy(model(x), y))`.
        """
        loss = loss / self.accumulate
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self) -> torch.Tensor | None:
        """Unscale, clip, step, update the scaler, zero the gradients (set_to_none).

        Returns the gradient norm before clipping when clip is set (a tensor: reading it as a
        float would make the CPU wait for the GPU every step). Example::

            norm = stepper.step()
            run.log(grad_norm=norm)   # run.log reads it as a number
        """
        norm = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.clip is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


Trainer = Stepper  # its earlier name: user code that imports it keeps working
