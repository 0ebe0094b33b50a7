"""Slot gaps of a week of runs: `kchain queue` against the same runs chained by hand with `continue --watch`.

    python bench/queue_gaps.py [--runs 3] [--steps 12] [--per-session 8] [--poll 30] [--react 0]

One run of the bench, two arms over the same runs (tests/runtime_jobs/tiny_job.py, `--runs` seeds, each
`--steps` steps, a test clock ending each session after `--per-session` steps: two sessions a run), each
against a fresh local Kaggle with Kaggle's two GPU slots:
  - queued: `kchain queue job.yaml --seeds 1,...,N` (one process);
  - by hand: one job file per run; runs 1 and 2 pushed, a `kchain continue --watch` process on each, and a
    person who pushes the next run (and watches it) `--react` seconds after a watch ends (default 0: a
    person at the screen the moment it ends, the best case of this arm).
A slot gap is time a GPU slot sits free while a run still has work: between one session's end and the next
session of its run (a hand-over), and between a run's end and the next run's first session in the slot it
frees (a run start). Times are the local Kaggle's session records (started, ended). The gaps are the
laptop's decide-publish-push time and the polls; on Kaggle each hand-over adds the state publish and the
session's boot (docs/benchmarks.md), the same in both arms. The ratios are taken in this one run.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import runtime_job  # noqa: E402

from kchain.common import layout  # noqa: E402
from kchain.emulator import Emulator  # noqa: E402
from kchain.emulator.app import PATIENCE_S  # noqa: E402
from kchain.local.executor import start_session  # noqa: E402

USER = "alice"
KCHAIN = [sys.executable, "-m", "kchain.cli"]


def _kchain(env: dict[str, str], *args: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*KCHAIN, *(str(a) for a in args)], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"kchain {' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return done


def _emulator(root: Path) -> tuple[Emulator, dict[str, str]]:
    emu = Emulator(root / "kaggle", users={USER: secrets.token_hex(16)}, session_limit_s=PATIENCE_S,
                   gpu_quota_s=30 * 3600, max_gpu_sessions=2, start_notebook=start_session)
    emu.start()
    env = {**os.environ, **emu.env(USER), "KCHAIN_HOME": str(root / "kchain-home"), "HOME": str(root / "home"),
           "KCHAIN_CONFIG_HOME": str(root / "config"), "KAGGLE_CONFIG_DIR": str(root / "home" / ".kaggle")}
    (root / "home" / ".kaggle").mkdir(parents=True)
    return emu, env


def _job(folder: Path, name: str, steps: int, seed: int | None = None) -> Path:
    folder.mkdir(parents=True)
    path = runtime_job(folder, "tiny_job", "main", "q", params={"d_model": 8, "steps": steps, "rows": 64})
    data = yaml.safe_load(path.read_text())
    data["name"] = name
    if seed is not None:
        data["params"]["seed"] = seed
    path.write_text(yaml.safe_dump(data))
    return path


def slot_gaps(sessions: list[dict[str, Any]], runs: list[str]) -> dict[str, list[float]]:
    """The hand-over gaps (within each run) and the run-start gaps (a run's first session after the slot it
    takes was freed by a run that ended), from the local Kaggle's records of the runs' kernels."""
    by_run = {r: sorted((s for s in sessions if s["kernel"] == f"{USER}/{r}" and s.get("started")),
                        key=lambda s: s["started"]) for r in runs}
    handovers = [b["started"] - a["ended"] for chain in by_run.values() for a, b in zip(chain, chain[1:], strict=False)]
    firsts = sorted((chain[0]["started"], r) for r, chain in by_run.items() if chain)
    ends = sorted(chain[-1]["ended"] for chain in by_run.values() if chain)
    starts = []
    for k, (began, _run) in enumerate(firsts[2:]):  # runs 1 and 2 start at once, in the two free slots
        freed = ends[k]  # the k-th run to end freed the slot the (k+3)-th run takes
        starts.append(began - freed)
    return {"handover": handovers, "run_start": starts}


def queued(root: Path, runs: int, steps: int, per_session: int, poll: float) -> dict[str, list[float]]:
    emu, env = _emulator(root)
    try:
        job = _job(root / "job", "q-main", steps)
        _kchain(env, "smoke", job)  # the pace the plan sizes the runs from
        os.environ[layout.FAULT_ENV] = f"deadline_after_steps={per_session}"  # the sessions run in this process
        seeds = ",".join(str(n) for n in range(1, runs + 1))
        _kchain(env, "queue", job, "--seeds", seeds, "--steps", steps, "--skip-smoke", "--poll", poll)
        return slot_gaps(emu.sessions(), [f"q-main-{n}" for n in range(1, runs + 1)])
    finally:
        os.environ.pop(layout.FAULT_ENV, None)
        emu.stop()


def by_hand(root: Path, runs: int, steps: int, per_session: int, poll: float, react: float) -> dict[str, list[float]]:
    emu, env = _emulator(root)
    try:
        jobs = [_job(root / f"run{n}", f"hand-{n}", steps, seed=n) for n in range(1, runs + 1)]
        os.environ[layout.FAULT_ENV] = f"deadline_after_steps={per_session}"  # the sessions run in this process
        waiting = list(jobs)
        lock = threading.Lock()

        def watch(job: Path) -> None:
            _kchain(env, "push", job, "--skip-smoke")
            _kchain(env, "continue", job, "--watch", "--skip-smoke")
            with lock:  # the person sees the watch end, and starts the next run in the slot it freed
                nxt = waiting.pop(0) if waiting else None
            if nxt is not None:
                time.sleep(react)
                watch(nxt)

        threads = []
        for _ in range(2):
            with lock:
                job = waiting.pop(0) if waiting else None
            if job is not None:
                threads.append(threading.Thread(target=watch, args=(job,)))
                threads[-1].start()
        for thread in threads:
            thread.join()
        return slot_gaps(emu.sessions(), [f"hand-{n}" for n in range(1, runs + 1)])
    finally:
        os.environ.pop(layout.FAULT_ENV, None)
        emu.stop()


def _line(name: str, gaps: dict[str, list[float]]) -> str:
    hand, start = gaps["handover"], gaps["run_start"]
    return (f"{name:<9} hand-overs {len(hand)}: {sum(hand):6.1f} s idle ({sum(hand) / max(1, len(hand)):5.1f} s each); "
            f"run starts {len(start)}: {sum(start):6.1f} s idle; all gaps {sum(hand) + sum(start):6.1f} slot-s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--per-session", type=int, default=8)
    ap.add_argument("--poll", type=float, default=30.0,
                    help="the queue's --poll; 30 is where continue --watch starts (it backs off to 300 while it waits)")
    ap.add_argument("--react", type=float, default=0.0, help="seconds the person takes to start the next run by hand")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kc-gaps-") as tmp:
        t0 = time.time()
        q = queued(Path(tmp) / "queued", args.runs, args.steps, args.per_session, args.poll)
        t1 = time.time()
        h = by_hand(Path(tmp) / "hand", args.runs, args.steps, args.per_session, args.poll, args.react)
        t2 = time.time()
    print(f"{args.runs} runs of {args.steps} steps, {args.per_session} steps a session, on 2 GPU slots "
          f"(local Kaggle; queue --poll {args.poll:g}; by hand, the next run {args.react:g} s after a watch ends)")
    print(_line("queued", q) + f"  [{t1 - t0:.0f} s wall]")
    print(_line("by hand", h) + f"  [{t2 - t1:.0f} s wall]")
    for part in ("handover", "run_start"):
        a, b = sum(q[part]), sum(h[part])
        print(f"ratio queued / by hand, {part.replace('_', ' ')}: {a / b:.2f}" if b > 0 else
              f"ratio queued / by hand, {part.replace('_', ' ')}: by hand had no gap")
    total_q, total_h = sum(q["handover"]) + sum(q["run_start"]), sum(h["handover"]) + sum(h["run_start"])
    print(f"ratio queued / by hand, all slot gaps: {total_q / total_h:.2f}" if total_h else "")
    print("by hand, each run start also waits for the person: a person who looks every H hours leaves a freed "
          "slot idle H/2 on average per run start (not measured here: --react sets it)")


if __name__ == "__main__":
    main()
