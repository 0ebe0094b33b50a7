"""`kchain plot`: training and validation loss across the whole chain, sessions marked."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kchain.common import layout
from kchain.errors import KchainError
from kchain.result.traces import read_trace

if TYPE_CHECKING:
    from kchain.common.sessionrecord import SessionRecord

INSTALL = "pip install 'kchain[plot]'"


def newest_trace(chain: list[SessionRecord]) -> Path | None:
    for record in reversed(chain):
        if record.get("output"):
            path = Path(record["output"]) / layout.KCHAIN_DIR / layout.METRICS
            if path.is_file():
                return path
    return None


def need_matplotlib() -> None:
    """matplotlib is an extra (some 78 MB for this one command): without it, one line naming the install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KchainError(f"kchain plot needs matplotlib: {INSTALL}") from None


def plot_chain(trace: list[dict[str, Any]], boundaries: list[tuple[int, int]], out: Path, title: str) -> Path:
    """Write a PNG of loss and val_* against step, with a dashed line where each session began."""
    need_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a laptop's CI or a server
    import matplotlib.pyplot as plt

    if not trace:
        raise KchainError(f"no metrics to plot for {title}; a session must log with run.log(loss=...)")
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    keys = sorted({k for r in trace for k, v in r.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and ("loss" in k)})
    for key in keys:
        points = [(r["step"], r[key]) for r in trace if key in r]
        style = {"marker": "o", "markersize": 3} if key.startswith("val") else {"linewidth": 1}
        ax.plot([p[0] for p in points], [p[1] for p in points], label=key, **style)
    for session, step in boundaries:
        ax.axvline(step, color="grey", linestyle="--", linewidth=0.8)
        ax.text(step, ax.get_ylim()[1], f" s{session}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_for(job_file: Path, out: Path | None) -> Path:
    from kchain.job.spec import load_job
    from kchain.store.ledger import Ledger, state_dir

    need_matplotlib()  # first: said before anything else, a chain or not
    job = load_job(job_file)
    ledger = Ledger(state_dir(job.path))
    chain = ledger.sessions(job.name)
    trace_path = newest_trace(chain)
    if trace_path is None:
        raise KchainError(f"{job.name} has no finished session with a metrics trace yet; "
                          "`kchain status` shows the chain")
    boundaries = [(s["session"], s.get("resumes_at", 0)) for s in chain if s.get("version")]
    return plot_chain(read_trace(trace_path), boundaries, out or ledger.root / f"{job.name}-loss.png",
                      f"{job.name}: {len(boundaries)} session(s)")
