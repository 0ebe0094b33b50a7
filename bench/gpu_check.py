"""The CUDA paths only a GPU can check, in one run of a few minutes (the device machine; never CI).

    PYTHONPATH=. python3 bench/gpu_check.py [--out DIR] [--only resume lora snapshot]

1. resume: bench/gpu_check_job.py through the real launcher (`python -m kchain.runtime.launch`), in fp16
   with its GradScaler (Kaggle's T4 path) and in `auto` (bf16 where the GPU has it): an uninterrupted
   run, the same run again (is the GPU's arithmetic repeatable at all?), a run SIGKILLed by the
   kill_at_step fault, and its resume. Verdict: the resumed trace (loss, a CUDA generator draw, the
   scaler's scale) equals the reference's value for value, and the state at every step both saved
   equals it too (kchain.local.statecheck over the checkpoints' digests: model, optimizer, scaler, loader,
   RNGs, the CUDA generator's among them).
2. lora: jobs/finetune (transformers + peft, LoRA on a tiny BERT built from a config) the same way, in
   fp16, with the checkpoint holding only what trains.
   templates: the HF Trainer, Lightning, Fabric and accelerate templates the same way, each in its own
   fp16 (the Trainer's, "16-mixed", accelerate's "fp16"), SIGKILLed once their first checkpoint is written.
3. ladder: `train.micro_batch: auto` against a real CUDA out-of-memory error (a memory cap the job sets),
   against the same training with the micro-batch set by hand, killed and resumed.
   stream: the resume job with its checkpoints streamed from the live CUDA tensors (forced).
4. ranks: two ranks on a machine with fewer GPUs (a smoke's KCHAIN_RANKS=2 on one GPU): every rank on
   the CPU with gloo, spawned, never forked beside a GPU (runtime/forkranks.py), killed and resumed.
5. snapshot: the time a checkpoint's host copy blocks training (Snapshotter.take) for a state of CUDA
   tensors, kept pinned buffers against kept pageable ones (the old way) and a bare
   `{k: v.to("cpu")}`, for a state under checkpointer.REUSE_MAX_BYTES and one above it.

Prints one line per check and writes DIR/gpu_check.json. Exits 1 when a verdict fails.
`--device cpu` runs the same on a machine with no GPU (the CUDA parts are then not exercised): a
dry run of the script, not a check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.common import layout  # noqa: E402
from kchain.local import statecheck  # noqa: E402

KILLED = -signal.SIGKILL
RESULTS: dict = {}
FAILED: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)


def verdict(name: str, ok: bool, detail: str) -> None:
    say(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    RESULTS.setdefault("verdicts", {})[name] = {"ok": ok, "detail": detail}
    if not ok:
        FAILED.append(name)


# Set in every run of a check that asks for it (the streamed checkpoint: KCHAIN_CHECKPOINT_STREAM=1).
EXTRA_ENV: dict[str, str] = {}


def start(root: Path, cfg: dict, code: Path, fault: str = "") -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cfg.json").write_text(json.dumps(cfg))
    drop = ("KCHAIN_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "KAGGLE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(code)]), PYTHONUNBUFFERED="1",
               **EXTRA_ENV)
    if fault:
        env["KCHAIN_FAULT"] = fault
    log = open(root / f"out{'-killed' if fault else ''}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "kchain.runtime.launch", str(root / "cfg.json")], env=env,
                            cwd=root, stdout=log, stderr=subprocess.STDOUT)


def kdir(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR


def trace(root: Path) -> list[dict]:
    rows = [json.loads(line) for line in (kdir(root) / layout.METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "elapsed", "wall")} for r in rows if "loss" in r]


def logs(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(root.glob("out*.log")))


def kill_resume(name: str, cfg: dict, code: Path, fault: str, scratch: Path, reference: dict | None = None,
                env_fault: str = "") -> dict:
    """Reference, reference again and the killed run side by side; then the resume. The verdicts.
    With `reference`, the reference runs that config and "again" runs `cfg` uninterrupted."""
    roots = {k: scratch / name / k for k in ("reference", "again", "resumed")}
    t0 = time.perf_counter()
    both = ",".join(f for f in (env_fault, fault) if f)
    procs = {"reference": start(roots["reference"], reference or cfg, code),
             "again": start(roots["again"], cfg, code, fault=env_fault),
             "killed": start(roots["resumed"], cfg, code, fault=both)}
    codes = {k: p.wait(timeout=400) for k, p in procs.items()}
    resumed = start(roots["resumed"], cfg, code, fault=env_fault)
    codes["resumed"] = resumed.wait(timeout=400)
    wall = time.perf_counter() - t0
    out = {"codes": codes, "wall_s": round(wall, 1)}
    ok_codes = codes == {"reference": 0, "again": 0, "killed": KILLED, "resumed": 0}
    text = logs(roots["resumed"])
    if not ok_codes:
        verdict(f"{name}: exit codes", False, f"{codes}; the logs are under {scratch / name}")
        for k, root in roots.items():
            say(f"--- {k}: the end of its log\n" + "\n".join(logs(root).splitlines()[-25:]))
        return out
    ref, again, got = trace(roots["reference"]), trace(roots["again"]), trace(roots["resumed"])
    resumed_from = next((line for line in text.splitlines() if "resumed from step" in line), "")
    precision = next((line.strip() for line in logs(roots["reference"]).splitlines() if "precision" in line.lower()), "")
    out.update(precision_line=precision, resumed_line=resumed_from.strip(), steps=len(ref))
    say(f"  {name}: {len(ref)} steps; {precision}; {resumed_from.strip()}; all four runs {wall:.1f} s")
    repeatable = ref == again
    verdict(f"{name}: {'the same as the hand-set run' if reference else 'the GPU repeats itself'}", repeatable,
            "two uninterrupted runs logged the same values" if repeatable else
            f"two uninterrupted runs differ first at step {first_difference(ref, again)}")
    same = [r["step"] for r in got] == [r["step"] for r in ref] and got == ref
    gap = max((abs(a[k] - b[k]) for a, b in zip(ref, got, strict=False) for k in a
               if isinstance(a.get(k), float) and isinstance(b.get(k), float)), default=0.0)
    verdict(f"{name}: trace after the kill", same and bool(resumed_from),
            f"{len(got)} steps, every value equal" if same else
            f"differs first at step {first_difference(ref, got)} (largest gap {gap:.3g})")
    comparison = statecheck.compare(statecheck.saved([statecheck.checkpoints_of(roots['reference'] / layout.WORKING_DIR)]),
                                    statecheck.saved([statecheck.checkpoints_of(roots['resumed'] / layout.WORKING_DIR)]))
    first = comparison.first
    keys = sorted({k for s in statecheck.saved([statecheck.checkpoints_of(roots['resumed'] / layout.WORKING_DIR)]).values()
                   for k in s.digests})
    cuda_rng = [k for k in keys if k.startswith("rng.cuda")]
    scaler = [k for k in keys if "scaler" in k]
    out.update(state_steps=list(comparison.steps), state_values=comparison.values,
               state_first_difference=None if first is None else {"step": first.step, "keys": list(first.keys[:5])},
               cuda_rng_keys=len(cuda_rng), scaler_keys=scaler[:6], unhashed=[k for s in statecheck.saved(
                   [statecheck.checkpoints_of(roots['resumed'] / layout.WORKING_DIR)]).values()
                   for k, v in s.digests.items() if v.endswith(":unhashed")][:5])
    verdict(f"{name}: state after the kill", first is None and len(comparison.steps) >= 2,
            f"equal at steps {list(comparison.steps)} ({comparison.values} values; CUDA RNG keys {len(cuda_rng)}, "
            f"scaler keys {len(scaler)})" if first is None else
            f"{statecheck.name(first.keys[0])} differs at step {first.step} ({len(first.keys)} values)")
    return out


def first_difference(a: list[dict], b: list[dict]):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return x.get("step")
    return None if len(a) == len(b) else min(len(a), len(b)) + 1


def check_resume(scratch: Path, cuda: bool) -> None:
    code = REPO / "bench"
    for precision in (("fp16", "auto") if cuda else ("fp32",)):
        cfg = {"job": f"gpu-check-{precision}", "entry": "gpu_check_job:main", "params": {"steps": 40},
               "train": {"checkpoint_every": {"steps": 5}, "keep": 20, "heartbeat_s": 0, "gpus": 1,
                         "precision": precision},
               "kaggle": {"accelerator": "gpu"}}
        RESULTS[f"resume-{precision}"] = kill_resume(f"resume-{precision}", cfg, code, "kill_at_step=23", scratch)


def check_ranks(scratch: Path, cuda: bool) -> None:
    """Two ranks where the machine has fewer GPUs (a smoke's KCHAIN_RANKS=2 on a one-GPU machine): every
    rank on the CPU with gloo (before, rank 0 took NCCL on the GPU and rank 1 gloo: no collective could
    meet), each spawned: a launcher never forks ranks where torch can reach a GPU (forkranks.py)."""
    from kchain.runtime import forkranks

    probe = subprocess.run([sys.executable, "-c", "from kchain.runtime import forkranks; ok = forkranks.prepare({}); "
                            "import torch; print(ok, torch.cuda.is_initialized())"],
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    want = ["False", "False"] if cuda else ["True", "False"]
    verdict("ranks: forked only where no GPU is reachable", probe.stdout.split() == want,
            f"forkranks.prepare, torch.cuda.is_initialized(): {probe.stdout.strip() or probe.stderr[-300:]}")
    cfg = {"job": "gpu-check-ranks", "entry": "gpu_check_job:main", "params": {"steps": 24},
           "train": {"checkpoint_every": {"steps": 4}, "keep": 20, "heartbeat_s": 0, "gpus": 2, "precision": "auto"},
           "kaggle": {"accelerator": "gpu"}}
    EXTRA_ENV.update({layout.RANKS_ENV: "2", "OMP_NUM_THREADS": "1"})  # as a smoke's 2 ranks below 8 cores
    try:
        RESULTS["ranks"] = kill_resume("ranks", cfg, REPO / "bench", "kill_at_step=13", scratch)
    finally:
        EXTRA_ENV.clear()
    text = logs(scratch / "ranks" / "resumed")
    placed = "2 ranks (gloo, CPU)" in text and "device: cpu" in text
    spawned = forkranks.NOTE not in text
    verdict("ranks: every rank on the CPU with gloo" + (", spawned" if cuda else ", forked"),
            placed and spawned == cuda, next((line.strip() for line in text.splitlines() if "device:" in line), "")
            + ("; spawned" if spawned else "; forked"))


def check_lora(scratch: Path, cuda: bool) -> None:
    job = yaml.safe_load((REPO / "jobs" / "finetune" / "job.yaml").read_text())
    params = {**job["params"], "steps": 30, "n_notes": 2000, "eval_every": 10, "warmup": 5}
    cfg = {"job": "gpu-check-lora", "entry": "train:main", "params": params,
           "train": {"checkpoint_every": {"steps": 5}, "keep": 20, "heartbeat_s": 0, "gpus": 1,
                     "precision": "fp16" if cuda else "fp32"},
           "kaggle": {"accelerator": "gpu"}}
    out = RESULTS["lora"] = kill_resume("lora", cfg, REPO / "jobs" / "finetune", "kill_at_step=17", scratch)
    ckpts = sorted(statecheck.checkpoints_of(scratch / "lora" / "resumed" / layout.WORKING_DIR).glob(
        f"{layout.CHECKPOINT_PREFIX}*"))
    if ckpts:
        from kchain.common.checkpoint_files import FROZEN_KEY

        manifest = json.loads((ckpts[-1] / layout.MANIFEST).read_text())
        left_out = sum(len(v) for v in manifest.get(FROZEN_KEY, {}).values())
        size = sum(f.stat().st_size for f in ckpts[-1].iterdir() if f.is_file())
        out.update(frozen_left_out=left_out, checkpoint_bytes=size)
        verdict("lora: only what trains is saved", left_out > 0,
                f"{left_out} frozen base tensors left out of the checkpoint; {size / 1e3:.0f} KB on disk")


# The framework templates (`kchain init --template NAME`), smaller; each trains in the mixed precision its
# own code asks for (the Trainer's fp16 from train.precision, Lightning's and Fabric's "16-mixed",
# accelerate's "fp16"), and is SIGKILLed once its first checkpoint (step 5) is written: mid-epoch for
# the epoch loops.
TEMPLATES = {
    "hf-trainer": {"steps": 40, "lines": 2000, "warmup": 5, "log_every": 5, "eval_every": 20},
    "lightning": {"epochs": 2, "rows": 2000},
    "fabric": {"epochs": 2, "rows": 2000},
    "accelerate": {"epochs": 2, "rows": 2000},
}


def check_templates(scratch: Path, cuda: bool, only: list[str]) -> None:
    from kchain.job.init import TEMPLATES as FOLDER

    for name, params in TEMPLATES.items():
        if only and name not in only:
            continue
        job = yaml.safe_load((FOLDER / name / "job.yaml").read_text().replace("@NAME@", name))
        cfg = {"job": f"gpu-check-{name}", "entry": "train:main", "params": {**job["params"], **params},
               "train": {"checkpoint_every": {"steps": 5}, "keep": 20, "heartbeat_s": 0, "gpus": 1,
                         "precision": "fp16" if cuda else "fp32"},
               "kaggle": {"accelerator": "gpu"}}
        RESULTS[name] = kill_resume(name, cfg, FOLDER / name, "kill_after_checkpoint=1", scratch)


def check_ladder(scratch: Path, cuda: bool) -> None:
    """train.micro_batch: auto against a real CUDA out-of-memory error (the CPU dry run injects it):
    micro-batch 16384 under a 1.5 GiB cap must halve twice to 4096 x 4 and train as the hand-set
    4096 x 4 does, and resume exactly with the size that fitted."""
    base = {"rows": 65536, "hidden": 32768, "steps": 8} if cuda else {"rows": 4096, "hidden": 256, "steps": 8}
    top, fits = (16384, 4096) if cuda else (1024, 256)
    train = {"checkpoint_every": {"steps": 2}, "keep": 20, "heartbeat_s": 0, "gpus": 1, "precision": "fp16" if cuda else "fp32"}
    hand = {"job": "gpu-check-ladder", "entry": "gpu_check_job:ladder", "kaggle": {"accelerator": "gpu"},
            "params": {**base, "batch": fits, "accumulate": top // fits, "mem_cap_gb": 0}, "train": train}
    auto = {**hand, "params": {**base, "batch": top, "accumulate": 1, "mem_cap_gb": 1.5},
            "train": {**train, "micro_batch": "auto"}}
    out = RESULTS["ladder"] = kill_resume("ladder", auto, REPO / "bench", "kill_at_step=5", scratch, reference=hand,
                                          env_fault="" if cuda else f"oom_above={fits}")
    rungs = [line.strip() for line in logs(scratch / "ladder" / "resumed").splitlines() if "out of memory at micro-batch" in line]
    out["rungs"] = rungs
    say("  ladder: " + (" | ".join(rungs) or "no out-of-memory error"))
    verdict("ladder: a real out-of-memory error halves the micro-batch", len(rungs) == 2,
            f"{len(rungs)} halvings before the first step (expected 2: {top} -> {top // 2} -> {fits})")


def check_stream(scratch: Path, cuda: bool) -> None:
    """The streamed checkpoint (a state too large for a host copy: torch.save of the live CUDA tensors,
    blocking), forced for the fp16 job: the resume must still be exact. Its CUDA tensors are written
    without a digest (":unhashed"), so the state verdict compares only what was digested: said."""
    cfg = {"job": "gpu-check-stream", "entry": "gpu_check_job:main", "params": {"steps": 40},
           "train": {"checkpoint_every": {"steps": 5}, "keep": 20, "heartbeat_s": 0, "gpus": 1,
                     "precision": "fp16" if cuda else "fp32"},
           "kaggle": {"accelerator": "gpu"}}
    EXTRA_ENV[layout.CHECKPOINT_STREAM_ENV] = "1"
    try:
        out = RESULTS["stream"] = kill_resume("stream", cfg, REPO / "bench", "kill_at_step=23", scratch)
    finally:
        EXTRA_ENV.clear()
    saved = statecheck.saved([statecheck.checkpoints_of(scratch / "stream" / "resumed" / layout.WORKING_DIR)])
    digests = [v for s in saved.values() for v in s.digests.values()]
    unhashed = sum(v.endswith(":unhashed") for v in digests)
    out.update(unhashed=unhashed, digested=len(digests) - unhashed)
    say(f"  stream: {unhashed} of {len(digests)} values in the checkpoints have no digest (live CUDA tensors "
        "streamed): the state verdict above compared the other "
        f"{len(digests) - unhashed}")


def check_snapshot(cuda: bool) -> None:
    import torch

    from kchain.runtime.checkpoint.checkpointer import REUSE_MAX_BYTES
    from kchain.runtime.checkpoint.snapshot import Snapshotter

    class Pageable(Snapshotter):  # kept buffers in pageable memory: what a save did before this check
        @staticmethod
        def _pinned_like(t):
            return None

    device = torch.device("cuda" if cuda else "cpu")

    def state(d: int, layers: int) -> dict:
        """A GPT-like model's state and its AdamW moments (fp32): many tensors, a few large."""
        g = torch.Generator(device=device).manual_seed(0)
        model = {}
        for i in range(layers):
            for name, shape in (("qkv", (3 * d, d)), ("proj", (d, d)), ("fc", (4 * d, d)), ("out", (d, 4 * d)),
                                ("ln1", (d,)), ("ln2", (d,)), ("b_fc", (4 * d,))):
                model[f"h{i}.{name}"] = torch.randn(shape, generator=g, device=device)
        moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in model.items()}
        return {"tracked": {"model": model, "optimizer": {"state": moments}}}

    def flat(s):
        out: list = []
        for v in s.values():
            out.extend(flat(v) if isinstance(v, dict) else [v])
        return out

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()  # no-op for take(), which waits for its copies itself
        return time.perf_counter() - t

    def measure(label: str, live: dict) -> None:
        tensors = flat(live)
        size = sum(t.numel() * t.element_size() for t in tensors)
        keep = size <= REUSE_MAX_BYTES
        row: dict = {"bytes": size, "tensors": len(tensors), "keep": keep}
        row["bare_s"] = min(timed(lambda: [t.to("cpu") for t in tensors]) for _ in range(3))
        pinned, pageable = Snapshotter(), Pageable()
        row["pinned_s"] = [timed(lambda: pinned.take(live, keep=True)) for _ in range(4)]
        row["pageable_kept_s"] = [timed(lambda: pageable.take(live, keep=True)) for _ in range(4)]
        row["not_kept_s"] = [timed(lambda: Snapshotter().take(live, keep=False)) for _ in range(2)]
        copy = pinned.take(live, keep=True)
        exact = all(torch.equal(a.cpu(), b) for a, b in zip(tensors, flat(copy), strict=True))
        row["pinned_buffers"] = all(b.is_pinned() for b in flat(copy)) if cuda else False
        RESULTS.setdefault("snapshot", {})[label] = row
        gbps = size / 1e9
        best = min(row["pinned_s" if keep else "not_kept_s"][1:] or row["not_kept_s"])
        say(f"  snapshot, {label}: {size / 2**20:.0f} MiB in {len(tensors)} tensors; bare .to('cpu') "
            f"{row['bare_s'] * 1e3:.0f} ms ({gbps / row['bare_s']:.1f} GB/s); pinned kept: first "
            f"{row['pinned_s'][0] * 1e3:.0f} ms, then {min(row['pinned_s'][1:]) * 1e3:.0f} ms "
            f"({gbps / min(row['pinned_s'][1:]):.1f} GB/s); pageable kept: first {row['pageable_kept_s'][0] * 1e3:.0f} ms, "
            f"then {min(row['pageable_kept_s'][1:]) * 1e3:.0f} ms; not kept {min(row['not_kept_s']) * 1e3:.0f} ms")
        verdict(f"snapshot, {label}: exact copy", exact and (row["pinned_buffers"] or not cuda),
                f"values equal{', host buffers pinned' if row['pinned_buffers'] else ''}")
        say(f"  snapshot, {label}: what a save blocks for ({'pinned kept' if keep else 'not kept'}) / bare copy = "
            f"{best / row['bare_s']:.2f}; pinned kept / pageable kept = "
            f"{min(row['pinned_s'][1:]) / min(row['pageable_kept_s'][1:]):.2f}")

    for label, d, layers in (("kept (under REUSE_MAX_BYTES)", 384, 12), ("too large to keep", 768, 12)):
        measure(label, state(d, layers))
        if cuda:
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--only", nargs="*",
                        default=["ranks", "resume", "lora", "templates", "ladder", "stream", "snapshot"])
    parser.add_argument("--templates", nargs="*", default=[], help="only these templates (default: all)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; --device cpu runs it as a dry run", file=sys.stderr)
        return 2
    RESULTS["machine"] = {"torch": torch.__version__, "python": sys.version.split()[0],
                          "gpu": torch.cuda.get_device_name(0) if cuda else None,
                          "capability": list(torch.cuda.get_device_capability(0)) if cuda else None}
    say(f"gpu_check: torch {torch.__version__}, {RESULTS['machine']['gpu'] or 'CPU (dry run)'}"
        + (f", capability {torch.cuda.get_device_capability(0)}" if cuda else ""))
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    try:
        if "ranks" in args.only:
            check_ranks(scratch, cuda)
        if "resume" in args.only:
            check_resume(scratch, cuda)
        if "lora" in args.only:
            check_lora(scratch, cuda)
        if "templates" in args.only:
            check_templates(scratch, cuda, args.templates)
        if "ladder" in args.only:
            check_ladder(scratch, cuda)
        if "stream" in args.only:
            check_stream(scratch, cuda)
        if "snapshot" in args.only:
            check_snapshot(cuda)
    finally:
        RESULTS["wall_s"] = round(time.perf_counter() - t0, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        if not FAILED:
            shutil.rmtree(scratch, ignore_errors=True)
    say(f"gpu_check: {'all passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)} in {RESULTS['wall_s']} s")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
