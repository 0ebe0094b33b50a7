"""Checkpoint I/O against its anchors, in one run: durable write, blocked time, restore, search.

The state is the `small` GPT of bench/checkpoint_overhead.py (~3.2M parameters) with its AdamW
moments after one step: ~39 MB. Measured, each the best of --rounds interleaved rounds (the order
rotates every round, because a shared machine drifts more than the effects measured):

- durable write: kchain's write_checkpoint (state.pt hashed, fsynced, metrics and manifest fsynced,
  rename, dir fsyncs) against `torch.save` into a file + `fsync`; deleting the file afterwards is
  untimed for both, and what pruning one old checkpoint costs is printed apart;
- blocked: how long run.save holds the training thread (the write itself runs in the background),
  against the same torch.save + fsync, and against its floor: a bare copy_ of the same tensors into
  host buffers kept from the last round (what any synchronous snapshot must do), and against what
  torch.distributed.checkpoint.async_save holds the training thread for the same state (its own
  staging copy; the write runs in its background thread, untimed);
- restore: run.restore() (find + verify + load + apply) against `torch.load` alone and against
  `torch.load` + load_state_dict (the same apply);
- search: the checkpoint search (checkpoint_files.candidates) with --attached files under a foreign dataset
  next to the state dataset in a temporary input root, and with only the state dataset attached.

    python bench/checkpoint_io.py [--rounds 7] [--attached 50000]

Targets (issue 14): write <= 1.1x torch.save + fsync; blocked <= 0.25x it; restore <= 1.0x
torch.load; search <= 5 ms whatever else is attached.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from checkpoint_overhead import build, train_step  # noqa: E402

from kchain.common import layout  # noqa: E402
from kchain.common.checkpoint_files import candidates, remove  # noqa: E402
from kchain.runtime.checkpoint.snapshot import rng_state, snapshot  # noqa: E402
from kchain.runtime.checkpoint.state import CheckpointJob, write_checkpoint  # noqa: E402
from kchain.runtime.run import Run  # noqa: E402

JOB = "bench-io"
FILES_PER_DIR = 100  # the foreign dataset: folders of 100 files, three levels deep


def trained():
    model, opt, data, block = build("small")
    train_step(model, opt, data, block, torch.Generator().manual_seed(1))  # fills AdamW's moments
    return model, opt


def make_run(root: Path) -> Run:
    config = {"job": JOB, "params": {}, "train": {"checkpoint_every": {"steps": 10**9}, "heartbeat_s": 600}}
    with contextlib.redirect_stdout(io.StringIO()):
        return Run(config, {layout.ROOT_ENV: str(root)})


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


class Bench:
    def __init__(self, tmp: Path, attached: int):
        self.tmp = tmp
        self.model, self.opt = trained()
        live = {"step": 1, "tracked": {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()},
                "rng": rng_state(), "metrics": {}, "best": None}
        self.state = snapshot(live)
        self.n = 0
        self.prunes: list[float] = []  # what pruning one old checkpoint costs, timed apart
        # A run to save from, and one checkpoint in another root to restore from.
        self.saver = make_run(tmp / "save")
        self.saver.track(model=self.model, optimizer=self.opt)
        quiet(self.saver.save, 1)
        self.saver._ckpt.writer.wait()
        self.restore_root = tmp / "restore"
        shutil.copytree(tmp / "save", self.restore_root)
        # The anchors load the very file run.restore loads.
        self.anchor_file = (self.restore_root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
                            / layout.checkpoint_name(1) / layout.STATE_FILE)
        self.size = self.anchor_file.stat().st_size
        self.search_roots = self._inputs(attached)
        tensors = [*self.model.state_dict().values(),
                   *(t for s in self.opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t))]
        self.floor_pairs = [(t.clone(), t) for t in tensors]

    def _inputs(self, attached: int) -> dict[str, Path]:
        """Two input roots holding the state dataset; one also holds `attached` files of someone's data."""
        roots = {}
        for name, n in (("nothing else", 0), (f"{attached} files", attached)):
            inp = self.tmp / f"input-{n}"
            state = inp / "datasets" / "me" / f"{JOB}-state"
            shutil.copytree(self.saver._paths.checkpoints / layout.checkpoint_name(1), state)
            (state / layout.STATE_MARKER).write_text("{}\n")
            for i in range(n):
                d = inp / "datasets" / "someone" / "images" / f"{i // 10_000}" / f"{i // FILES_PER_DIR}"
                if i % FILES_PER_DIR == 0:
                    d.mkdir(parents=True)
                (d / f"{i}.png").write_bytes(b"")
            roots[name] = inp
        return roots

    def anchor_write(self) -> float:
        self.n += 1
        path = self.tmp / f"anchor-{self.n}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - t0
        path.unlink()
        return took

    def kchain_write(self) -> float:
        """write_checkpoint until the new checkpoint is durable and in place (nothing to prune)."""
        self.n += 1
        ckpts = self.tmp / "ckpts"
        job = CheckpointJob(ckpts, self.n, self.tmp / "none.jsonl", 0, {"job": JOB}, 10**6)
        took = timed(write_checkpoint, self.state, job)
        self.prunes.append(timed(remove, ckpts / layout.checkpoint_name(self.n)))  # the anchor's unlink is untimed too
        return took

    def blocked(self) -> float:
        self.n += 1
        quiet(self.saver.save, self.n)
        stall = self.saver._ckpt.stalls[-1]
        self.saver._ckpt.writer.wait()
        return stall

    def dcp_async_blocked(self) -> float:
        self.n += 1
        where = self.tmp / f"dcp-{self.n}"
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process, as here
            t0 = time.perf_counter()
            pending = dcp.async_save(state, checkpoint_id=str(where))
            took = time.perf_counter() - t0
            pending.result()
        shutil.rmtree(where)
        return took

    def copy_floor(self) -> float:
        t0 = time.perf_counter()
        for buf, t in self.floor_pairs:
            buf.copy_(t)
        return time.perf_counter() - t0

    def restore(self) -> float:
        run = make_run(self.restore_root)
        model, opt = trained()
        run.track(model=model, optimizer=opt)
        took = timed(quiet, run.restore)
        assert run.resumed_from == 1
        return took

    def torch_load(self) -> float:
        t0 = time.perf_counter()
        torch.load(self.anchor_file, map_location="cpu", weights_only=False)
        return time.perf_counter() - t0

    def torch_load_apply(self) -> float:
        model, opt = trained()
        t0 = time.perf_counter()
        saved = torch.load(self.anchor_file, map_location="cpu", weights_only=False)
        model.load_state_dict(saved["tracked"]["model"])
        opt.load_state_dict(saved["tracked"]["optimizer"])
        return time.perf_counter() - t0

    def search(self, which: str) -> float:
        inp = self.search_roots[which]
        t0 = time.perf_counter()
        found = candidates(self.tmp / "no-checkpoints", inp, self.tmp / "scratch")
        took = time.perf_counter() - t0
        assert len(found) == 1, found
        return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--attached", type=int, default=50_000)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as bench/checkpoint_overhead.py: fewer threads fighting a shared machine
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; best of {args.rounds} interleaved rounds")
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(Path(tmp), args.attached)
        many = f"{args.attached} files"
        tasks = {
            "torch.save + fsync": b.anchor_write,
            "kchain durable write": b.kchain_write,
            "run.save blocked": b.blocked,
            "bare copy of the state": b.copy_floor,
            "dcp.async_save blocked": b.dcp_async_blocked,
            "torch.load": b.torch_load,
            "torch.load + apply": b.torch_load_apply,
            "run.restore": b.restore,
            "search, nothing else": lambda: b.search("nothing else"),
            f"search, {many}": lambda: b.search(many),
        }
        best = dict.fromkeys(tasks, float("inf"))
        names = list(tasks)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                best[name] = min(best[name], tasks[name]())
    ms = {k: v * 1e3 for k, v in best.items()}
    save, load = ms["torch.save + fsync"], ms["torch.load"]
    print(f"state: {b.size / 1e6:.1f} MB ({sum(p.numel() for p in b.model.parameters()) / 1e6:.2f}M params + AdamW)")
    print(f"  torch.save + fsync         {save:7.1f} ms")
    print(f"  kchain durable write       {ms['kchain durable write']:7.1f} ms  "
          f"{ms['kchain durable write'] / save:.2f}x torch.save + fsync (target <= 1.10x)")
    print(f"  (pruning one old checkpoint, best {min(b.prunes) * 1e3:.1f} ms, is not in the write above)")
    blocked = ms["run.save blocked"]
    print(f"  run.save blocked           {blocked:7.1f} ms  {blocked / save:.2f}x torch.save + fsync (target <= 0.25x)")
    print(f"  bare copy of the state     {ms['bare copy of the state']:7.1f} ms  (copy_ into buffers kept from the last "
          f"round: the floor of a synchronous snapshot) run.save blocked is {blocked / ms['bare copy of the state']:.2f}x this")
    print(f"  dcp.async_save blocked     {ms['dcp.async_save blocked']:7.1f} ms  "
          f"run.save blocked is {blocked / ms['dcp.async_save blocked']:.2f}x this")
    print(f"  torch.load                 {load:7.1f} ms")
    print(f"  torch.load + apply         {ms['torch.load + apply']:7.1f} ms")
    print(f"  run.restore (find + verify + load + apply) {ms['run.restore']:7.1f} ms  "
          f"{ms['run.restore'] / load:.2f}x torch.load (target <= 1.00x), "
          f"{ms['run.restore'] / ms['torch.load + apply']:.2f}x torch.load + apply")
    print(f"  checkpoint search, state dataset only     {ms['search, nothing else']:7.2f} ms")
    print(f"  checkpoint search, + {many} attached {ms[f'search, {many}']:7.2f} ms  (target <= 5 ms)")


if __name__ == "__main__":
    main()
