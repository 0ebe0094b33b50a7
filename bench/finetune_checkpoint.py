"""A LoRA fine-tune's checkpoint: kchain against what a careful user writes by hand, in one run.

The base is BERT-base built from `BertConfig()` (109M parameters, fp32, nothing downloaded) with
peft LoRA adapters (r=8 on the attention's query and value projections, peft's default for BERT)
and the classifier head that peft trains for a SEQ_CLS task; AdamW over those after one step, so
the optimizer has its moments. The base is saved once with save_pretrained and every fresh model
is from_pretrained of that folder, as a job loads a Kaggle Model (so a resume sees the same base).
Measured, each the best of --rounds interleaved rounds (the order rotates every round):

- kchain: `run.track(model=peft_model)` + `run.optimize(opt)`, then `run.save(step)`: the bytes of
  kchain/checkpoints/step-N, the time the training thread is blocked in run.save (the write runs
  in the background; it is waited for, untimed, before the next task), and `run.restore()` in a
  fresh Run into a fresh model and optimizer (find + verify + load + apply);
- the anchor: `peft_model.save_pretrained(dir)` (the adapters only) + `torch.save(opt.state_dict())`,
  every file fsynced (all of it blocks), restored with `set_peft_model_state_dict` of the adapter
  file (what `PeftModel.from_pretrained` loads) + `opt.load_state_dict`;
- the whole-model save a fine-tune without either writes today: `torch.save({"model":
  model.state_dict(), "opt": opt.state_dict()})` + fsync, restored with torch.load + both
  load_state_dict calls.

kchain's checkpoint holds more than the anchor's: the RNG states, the step, the metrics trace and a
manifest with checksums (and the frozen base's sha256, never its bytes). Building the fresh models
and deleting old files are untimed for all three.

    python bench/finetune_checkpoint.py [--rounds 5]    # about a minute

Targets (issue 22): kchain bytes <= 1.1x the anchor's and >= 20x fewer than the whole-model save;
kchain's blocked time and restore no worse than the anchor's. Prints ratios; asserts nothing.
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
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the base is built from its config
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, TaskType, get_peft_model, set_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kchain.common import layout  # noqa: E402
from kchain.runtime.run import Run  # noqa: E402

# peft 0.21 reads a property that transformers 5 deprecates; the warning is theirs.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

JOB = "bench-finetune"
LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["query", "value"]}
BATCH, TOKENS = 4, 32  # the one training step's batch: enough to give every adapter a gradient
ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes (safetensors by default)


def make_run(root: Path) -> Run:
    config = {"job": JOB, "params": {}, "train": {"checkpoint_every": {"steps": 10**9}, "heartbeat_s": 600}}
    with contextlib.redirect_stdout(io.StringIO()):
        return Run(config, {layout.ROOT_ENV: str(root)})


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def fresh(base: Path):
    """The peft model and its AdamW as a job builds them each session: from_pretrained, then LoRA."""
    model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(base),
                           LoraConfig(task_type=TaskType.SEQ_CLS, **LORA))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def fsynced_tree(path: Path) -> None:
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Bench:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        torch.manual_seed(0)
        self.base = tmp / "base"
        BertForSequenceClassification(BertConfig(num_labels=3)).save_pretrained(self.base)
        self.model, self.opt = fresh(self.base)
        self.n = 0
        self.bytes: dict[str, int] = {}
        # The run to save from, with its loop started (run.restore: fresh) and one training step.
        self.saver = make_run(tmp / "save")
        self.saver.track(model=self.model)
        stepper = self.saver.optimize(self.opt)
        quiet(self.saver.restore)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(self.model.config.vocab_size, (BATCH, TOKENS), generator=g)
        stepper.backward(self.model(input_ids=ids, labels=torch.randint(3, (BATCH,), generator=g)).loss)
        stepper.step()
        # One checkpoint of each kind to restore from (the first kchain save also waits for the
        # frozen base's digests, hashed in the background since the loop started).
        self.kchain_save()
        self.restore_root = tmp / "restore"
        shutil.copytree(tmp / "save", self.restore_root)
        self.anchor_dir = self._anchor_write(tmp / "anchor")
        self.whole_file = self._whole_write(tmp / "whole.pt")

    def _ckpt_dir(self, root: Path, step: int) -> Path:
        return root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / layout.checkpoint_name(step)

    def kchain_save(self) -> float:
        self.n += 1
        t0 = time.perf_counter()
        quiet(self.saver.save, self.n)
        took = time.perf_counter() - t0
        self.saver._ckpt.writer.wait()
        self.bytes["kchain"] = size(self._ckpt_dir(self.tmp / "save", self.n))
        return took

    def _anchor_write(self, where: Path) -> Path:
        self.model.save_pretrained(where)
        with open(where / "optimizer.pt", "wb") as f:
            torch.save(self.opt.state_dict(), f)
        fsynced_tree(where)
        return where

    def anchor_save(self) -> float:
        self.n += 1
        where = self.tmp / f"anchor-{self.n}"
        t0 = time.perf_counter()
        self._anchor_write(where)
        took = time.perf_counter() - t0
        self.bytes["anchor"] = size(where)
        shutil.rmtree(where)
        return took

    def _whole_write(self, path: Path) -> Path:
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return path

    def whole_save(self) -> float:
        self.n += 1
        path = self.tmp / f"whole-{self.n}.pt"
        t0 = time.perf_counter()
        self._whole_write(path)
        took = time.perf_counter() - t0
        self.bytes["whole"] = size(path)
        path.unlink()
        return took

    def kchain_restore(self) -> float:
        run = make_run(self.restore_root)
        model, opt = fresh(self.base)
        run.track(model=model)
        run.optimize(opt)
        t0 = time.perf_counter()
        quiet(run.restore)
        took = time.perf_counter() - t0
        assert run.resumed_from == 1, run.resumed_from
        run.close()
        return took

    def anchor_restore(self) -> float:
        model, opt = fresh(self.base)
        t0 = time.perf_counter()
        set_peft_model_state_dict(model, load_file(self.anchor_dir / ADAPTER_FILE))
        opt.load_state_dict(torch.load(self.anchor_dir / "optimizer.pt", weights_only=True))
        return time.perf_counter() - t0

    def whole_restore(self) -> float:
        model, opt = fresh(self.base)
        t0 = time.perf_counter()
        saved = torch.load(self.whole_file, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as bench/checkpoint_io.py: fewer threads fighting a shared machine
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}; best of {args.rounds} interleaved rounds")
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(Path(tmp))
        tasks = {
            "kchain save": b.kchain_save, "anchor save": b.anchor_save, "whole save": b.whole_save,
            "kchain restore": b.kchain_restore, "anchor restore": b.anchor_restore, "whole restore": b.whole_restore,
        }
        best = dict.fromkeys(tasks, float("inf"))
        names = list(tasks)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                best[name] = min(best[name], tasks[name]())
        b.saver.close()
    params = sum(p.numel() for p in b.model.parameters())
    trainable = sum(p.numel() for p in b.model.parameters() if p.requires_grad)
    print(f"base: BERT-base from BertConfig(), {(params - trainable) / 1e6:.1f}M frozen params fp32; "
          f"LoRA r={LORA['r']} on {', '.join(LORA['target_modules'])} + the classifier head: "
          f"{trainable / 1e6:.2f}M trainable, AdamW after one step")
    ms = {k: v * 1e3 for k, v in best.items()}
    rows = (("whole", "whole-model torch.save + fsync"), ("anchor", "save_pretrained + torch.save(opt), fsync"),
            ("kchain", "kchain run.save"))
    print(f"  {'':42s} {'bytes':>10s} {'blocked':>10s} {'restore':>10s}")
    for key, label in rows:
        print(f"  {label:42s} {b.bytes[key] / 1e6:7.2f} MB {ms[key + ' save']:7.1f} ms {ms[key + ' restore']:7.1f} ms")
    print(f"  kchain bytes / anchor bytes        {b.bytes['kchain'] / b.bytes['anchor']:7.2f}x  (target <= 1.10x)")
    print(f"  whole-model bytes / kchain bytes   {b.bytes['whole'] / b.bytes['kchain']:7.1f}x  (target >= 20x)")
    print(f"  kchain blocked / anchor blocked    {ms['kchain save'] / ms['anchor save']:7.2f}x  (target <= 1.00x)")
    print(f"  kchain restore / anchor restore    {ms['kchain restore'] / ms['anchor restore']:7.2f}x  (target <= 1.00x; "
          f"{ms['kchain restore'] / ms['whole restore']:.2f}x the whole-model restore)")


if __name__ == "__main__":
    main()
