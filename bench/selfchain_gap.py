"""The gap between sessions of a chain: kernels that push the next session themselves against the laptop relaying.

    python bench/selfchain_gap.py [--steps 60] [--per-session 20]

One run, two rehearsals of the same job (jobs/tinygpt, small) against the local Kaggle, one after the
other, with the same sessions (a test clock ends each session after --per-session steps):
  - unattended: `kchain push --unattended`, then every session pushes the next one from inside its
    kernel (publish, wait until the version is ready, decide, push);
  - laptop-relayed: `kchain push`, then `kchain continue --watch` on this machine pushes each next
    session once the last one ended (the kernel still publishes its own state: internet on, Secrets).
Per boundary it prints the gap from one session's last step to the next session's first step, split
into: end -> push (the last step's time to the next version's push), queue, boot (the emulator's
modelled waits), start -> first step (the notebook's unpack, the mount, the restore, the first
step). Times come from the emulator's session records (queued = the push, started, first_cell) and
from each session's metrics trace (every row carries its wall time); the in-kernel figures from
each session's summary.json (`next.waited_s`: waiting for its own state version to be ready;
`next.idle_s`: the whole publish-wait-decide-push while the GPU is held). The emulator's queue and
boot are its defaults (Switches: 1 s each); its dataset processing is 0 s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import copy_job  # noqa: E402

from kchain.common import layout  # noqa: E402
from kchain.common.sessionrecord import SessionRecord  # noqa: E402
from kchain.local.rehearse import Rehearsal, rehearse  # noqa: E402
from kchain.result.traces import read_trace  # noqa: E402

PARTS = ("end->push", "queue", "boot", "start->step")


def session_rows(record: SessionRecord) -> list[dict[str, Any]]:
    """The trace rows a session trained itself (past the step it resumed at), from its output."""
    output = record.get("output")
    if not output:
        return []
    rows = read_trace(Path(output) / layout.KCHAIN_DIR / layout.METRICS)
    return [r for r in rows if r["step"] > (record.get("resumes_at") or 0) and "time" in r]


def gaps(result: Rehearsal) -> list[dict[str, Any]]:
    """One row per boundary: the times of the gap's parts, from the emulator's records and the traces."""
    ours = [s for s in result.emulator_sessions if s["kernel"] == result.sessions[0]["kernel"]]  # not the relays
    emulated = {s["version"]: s for s in ours}
    out = []
    for before, after in zip(result.sessions, result.sessions[1:], strict=False):
        last, first = session_rows(before), session_rows(after)
        emu = emulated.get(after["version"]) or {}
        if not last or not first or not emu.get("first_cell"):
            continue
        end, step = max(r["time"] for r in last), min(r["time"] for r in first)
        parts = (emu["queued"] - end, emu["started"] - emu["queued"], emu["first_cell"] - emu["started"],
                 step - emu["first_cell"])
        told = (before.get("summary") or {}).get("next") or {}
        out.append({"boundary": f"{before['session']}->{after['session']}", "parts": parts, "gap": step - end,
                    "waited_s": told.get("waited_s"), "idle_s": told.get("idle_s")})
    return out


def show(name: str, rows: list[dict[str, Any]]) -> float:
    print(f"{name}:")
    print(f"  {'boundary':<9}" + "".join(f"{p:>13}" for p in PARTS) + f"{'gap':>9}{'waited':>9}{'idle':>8}")
    for r in rows:
        extra = "".join(f"{v:>8.1f}s" if v is not None else f"{'-':>9}" for v in (r["waited_s"], r["idle_s"]))
        print(f"  {r['boundary']:<9}" + "".join(f"{v:>12.2f}s" for v in r["parts"]) + f"{r['gap']:>8.2f}s{extra}")
    total = sum(r["gap"] for r in rows)
    print(f"  total gap {total:.2f}s over {len(rows)} boundaries")
    return total


def one(job: Path, unattended: bool, per_session: int) -> Rehearsal:
    os.environ[layout.FAULT_ENV] = f"stall_step=0.05,deadline_after_steps={per_session}"
    result = rehearse(job, sessions=None, session_limit_s=600, kills=0, seed=2, echo=lambda _: None, ranks=1,
                      key=secrets.token_hex(16), unattended=unattended, internet=True)
    print(f"{'unattended' if unattended else 'laptop-relayed'} rehearsal: {result.verdict}")
    return result


def main(steps: int, per_session: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kc-gap-") as tmp:
        os.environ.update({"HOME": tmp, "KCHAIN_HOME": str(Path(tmp) / "kchain-home"), "TMPDIR": tmp,
                           "KAGGLE_CONFIG_DIR": str(Path(tmp) / ".kaggle")})
        (Path(tmp) / ".kaggle").mkdir()
        for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
            os.environ.pop(var, None)
        params = {"steps": steps, "eval_every": per_session, "batch": 8, "accumulate": 1}
        results = {}
        for unattended in (True, False):
            job = copy_job("tinygpt", Path(tmp) / ("alone" if unattended else "relayed"), params=params)
            results[unattended] = one(job, unattended, per_session)
        rows = {unattended: gaps(result) for unattended, result in results.items()}  # the outputs are in tmp
    alone = show("unattended (each kernel pushes the next)", rows[True])
    relayed = show("laptop-relayed (`continue --watch` pushes)", rows[False])
    if relayed:
        print(f"unattended gap / laptop-relayed gap: {alone / relayed:.2f}")
    pushed = [s.get("pushed_by") for s in results[True].sessions[1:]]
    print(f"unattended sessions after the first pushed by a kernel: {pushed.count('kernel')} of {len(pushed)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--per-session", type=int, default=20)
    args = parser.parse_args()
    main(args.steps, args.per_session)
