"""The heartbeat line: progress, speed, where the time goes, and how much is left."""

from __future__ import annotations

import math


def duration(seconds: float | None) -> str:
    """3h05m, 4m10s, 12s; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def line(step, total, metrics, steps_per_s, data_share, eta_s, left_s, next_ckpt, ranks: int = 1) -> str:
    parts = [f"step {step}/{total}" + (f" x{ranks} ranks" if ranks > 1 else "")]
    parts += [f"{k} {_fmt(v)}" for k, v in metrics.items()]
    parts.append(f"{steps_per_s:.2f} steps/s" if steps_per_s else "- steps/s")
    parts.append(f"data wait {data_share:.0%}")
    parts.append(f"eta {duration(eta_s)}")
    parts.append(f"left {duration(left_s)}")
    parts.append(f"ckpt in {next_ckpt}")
    return "[kchain] " + " | ".join(parts)
