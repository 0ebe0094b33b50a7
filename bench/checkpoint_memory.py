"""What a checkpoint costs in host memory and disk, for a state of more than 1 GB, and for 1B params.

A stack of Linear layers (~90M parameters) with AdamW after one step: about 1.1 GB of state
(fp32 weights 4 bytes + AdamW's two moments 8 bytes per parameter). In a child process per mode,
three saves with keep=2 under run.save, measuring:

- peak extra RSS during a save, over the state size (sampled every 5 ms from /proc/self/status;
  anonymous memory, since the page cache of the file being written is not the process's to keep);
- peak disk used by checkpoints, over the state size (sampled every 5 ms);
- peak extra anonymous memory while resuming (torch.load with mmap=True), over the state size.

Modes: `snapshot` (copy to host RAM, write in the background: what small states use) and `stream`
(write from the live tensors, one at a time: what a state above 25% of free RAM uses).

    python bench/checkpoint_memory.py [--params-m 90]

Then the accounting for a 1B-parameter model with AdamW on a Kaggle box. Prints ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GB = 1e9
SAMPLE_S = 0.005
KAGGLE = {"disk": 19.5 * GB, "ram": 29 * GB}  # /kaggle/working and host RAM of a GPU session


def anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


class Peak:
    """Samples a function in a thread; .peak is the largest value seen between start and stop."""

    def __init__(self, fn):
        self.fn, self.peak, self._stop = fn, 0, threading.Event()

    def __enter__(self):
        self.peak = self.fn()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.fn())
            time.sleep(SAMPLE_S)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.fn())


def build(params_m: int):
    import torch
    from torch import nn

    width = 4096
    layers = max(1, round(params_m * 1e6 / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the two moments
    for p in model.parameters():
        p.grad = None
    return model, opt


def child(mode: str, params_m: int, root: Path) -> dict:
    from kchain.common import layout
    from kchain.common.publishplan import state_bytes
    from kchain.runtime.run import Run

    env = {layout.ROOT_ENV: str(root), layout.CHECKPOINT_STREAM_ENV: "1" if mode == "stream" else "0"}
    config = {"job": "mem", "params": {}, "train": {"keep": 2, "heartbeat_s": 0, "checkpoint_every": {"steps": 10**9}}}
    model, opt = build(params_m)
    run = Run(config, env)
    run.track(model=model, opt=opt)
    size = state_bytes({"m": model.state_dict(), "o": opt.state_dict()})
    base = anon_bytes()
    saves = []
    with Peak(lambda: disk_bytes(run._paths.checkpoints)) as disk:
        for step in (1, 2, 3):
            t0 = time.perf_counter()
            with Peak(anon_bytes) as mem:
                run.save(step)
                run._ckpt.writer.wait()
            saves.append({"extra_ram": mem.peak - base, "s": time.perf_counter() - t0})
    run.close()
    del run, model, opt

    # Resume in this process: fresh objects, then restore (mmap load + copy into the live tensors).
    model, opt = build(params_m)
    run = Run(config, env)
    run.track(model=model, opt=opt)
    base = anon_bytes()
    t0 = time.perf_counter()
    with Peak(anon_bytes) as mem:
        step = run.restore()
    run.close()
    return {"mode": mode, "state": size, "saves": saves, "disk_peak": disk.peak, "resumed": step,
            "resume_extra_ram": mem.peak - base,
            "resume_s": time.perf_counter() - t0}


def accounting(params: float = 1e9) -> list[str]:
    state = params * 12  # fp32 weights + AdamW moments (the fp16/bf16 copy lives on the GPU)
    lines = [f"1B-parameter model with AdamW: state {state / GB:.1f} GB (4 + 8 bytes per parameter)",
             f"  Kaggle box: {KAGGLE['disk'] / GB:.1f} GB disk in /kaggle/working, ~{KAGGLE['ram'] / GB:.0f} GB RAM"]
    ram_mode = "stream" if state > 0.25 * KAGGLE["ram"] else "snapshot"
    lines.append(f"  save: {state / GB:.1f} GB > 25% of RAM -> {ram_mode}: extra host RAM = one tensor at a time "
                 "(largest tensor, e.g. a 50k x 2048 embedding = 0.4 GB), not a second 12 GB copy")
    for keep in (2, 1):
        peak = (keep + 1) * state
        fits = peak <= KAGGLE["disk"]
        lines.append(f"  keep {keep}: peak disk {keep} x {state / GB:.0f} + {state / GB:.0f} in flight = {peak / GB:.0f} GB: "
                     f"{'fits' if fits else 'does not fit'}")
    pruned = 2 * state
    lines.append(f"  pruned before writing (newest kept until the new one is complete): {pruned / GB:.0f} GB: "
                 f"{'fits' if pruned <= KAGGLE['disk'] else 'does not fit -> kchain refuses at the first save, in one line'}")
    for what, per_param in (("bf16 AdamW moments", 4 + 4), ("8-bit AdamW moments", 4 + 2)):
        small = params * per_param
        lines.append(f"  with {what}: state {small / GB:.0f} GB; newest + one in flight {2 * small / GB:.0f} GB: "
                     f"{'fits' if 2 * small <= KAGGLE['disk'] else 'does not fit'}; keep 2 needs {3 * small / GB:.0f} GB: "
                     f"{'fits' if 3 * small <= KAGGLE['disk'] else 'older ones are pruned before each write'}")
    lines.append("  resume: torch.load(mmap=True): the file is paged in while copied into the live tensors, "
                 "no second anonymous copy")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=int, default=90, help="millions of parameters (90 -> ~1.1 GB of state)")
    ap.add_argument("--child", choices=["snapshot", "stream"])
    ap.add_argument("--root")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.params_m, Path(args.root))))
        return
    for mode in ("snapshot", "stream"):
        with tempfile.TemporaryDirectory(prefix="kchain-mem-") as tmp:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--params-m", str(args.params_m),
                                  "--root", tmp], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        s = r["state"]
        worst = max(x["extra_ram"] for x in r["saves"])
        print(f"{mode:>8}: state {s / GB:.2f} GB | peak extra RSS in a save {worst / s:.2f} x state "
              f"(save {min(x['s'] for x in r['saves']):.1f}s) | peak disk {r['disk_peak'] / s:.2f} x state (keep 2) | "
              f"resume (mmap): peak extra RSS {r['resume_extra_ram'] / s:.2f} x state ({r['resume_s']:.1f}s)")
    print()
    print("\n".join(accounting()))


if __name__ == "__main__":
    main()
