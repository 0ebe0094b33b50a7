"""What run.tensorboard_dir adds to each state version, and to each save, for a long session.

A session logs `--scalars` scalars every step for `--steps` steps through SummaryWriter (as
run.summary_writer() makes it), and the log is copied for a checkpoint at the end (Log.stage, what
every save does); then a second session restores that log, logs as many steps again, and is copied
again (its restored file linked, its own copied). Prints the log's bytes per step, what each state
version carries, and the time the training thread spends copying, per save.

    python bench/tracker_logs.py                # 40,000 steps of 3 scalars, about a 12-hour session at 1 step/s
    python bench/tracker_logs.py --steps 4000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from kchain.runtime.frameworks import tensorboard


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def session(root: Path, found, steps: range, scalars: int) -> tuple[Path, tuple[float, float]]:
    """One session's logging, then the copy a save makes: (the copy, (wall, CPU) seconds it took)."""
    log = tensorboard.Log(root / "tensorboard", root / "scratch", True, found)
    w = log.writer()
    for step in steps:
        for i in range(scalars):
            w.add_scalar(f"train/metric{i}", 1.0 / step + i, step)
    w.flush()  # the writer's own thread catches up first: what is timed is the copy a save adds
    t0, c0 = time.perf_counter(), time.process_time()
    staged = log.stage()
    took = (time.perf_counter() - t0, time.process_time() - c0)
    log.close()
    assert staged is not None  # scalars were written: a save copies them
    return staged, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40_000)
    ap.add_argument("--scalars", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kchain-tblog-"))
    try:
        first, took1 = session(root / "s1", lambda: None, range(1, args.steps + 1), args.scalars)
        size1 = folder_bytes(first)
        # Session 2 resumes from a checkpoint holding session 1's copy (the manifest's attached group).
        ckpt = root / "ckpt"
        names = {f"{tensorboard.GROUP}.{p.relative_to(first).as_posix()}": p.relative_to(first).as_posix()
                 for p in first.rglob("*") if p.is_file()}
        ckpt.mkdir()
        for flat, rel in names.items():
            shutil.copyfile(first / rel, ckpt / flat)
        manifest = {"step": args.steps, "attached": {tensorboard.GROUP: names}}
        second, took2 = session(root / "s2", lambda: (ckpt, manifest),
                                range(args.steps + 1, 2 * args.steps + 1), args.scalars)
        size2 = folder_bytes(second)
        print(f"{args.steps} steps x {args.scalars} scalars a session, SummaryWriter's event files:")
        print(f"  {size1 / args.steps:.0f} bytes a step ({size1 / args.steps / args.scalars:.0f} a scalar)")
        print(f"  state version after session 1: +{size1 / 2**20:.2f} MiB; after session 2: +{size2 / 2**20:.2f} MiB "
              "(the whole chain's log travels in each version)")
        print(f"  copy at a save (training thread), wall / CPU: {took1[0] * 1000:.0f} / {took1[1] * 1000:.0f} ms "
              f"after session 1's steps, {took2[0] * 1000:.0f} / {took2[1] * 1000:.0f} ms after session 2's "
              "(session 1's file linked, not copied); a save every 10 minutes copies the whole live file but "
              "walks only its new records")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
