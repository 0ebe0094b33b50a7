"""@NAME@: a small GPT-2 trained as a causal language model by Hugging Face's Trainer.

Written the way a run_clm script is: a model from a config, text tokenized and grouped into blocks,
TrainingArguments, a Trainer and trainer.train(). Two lines make it a kchain job, both marked
`kchain:` below: the callback given to the Trainer, and resume_from_checkpoint=run.hf_resume(trainer).
kchain then decides when the Trainer saves, keeps its checkpoint folders inside kchain's verified
checkpoints, stops it before the session's end and resumes it in the next session where it stopped.

Nothing is downloaded: the text is generated and the tokenizer is bytes (a vocabulary of 256).
Replace make_text with your corpus (run.input("your-dataset")) and the byte tokenizer with yours.
"""

import math
import os

# A Kaggle session runs with the internet off: never ask the hub (read once, when it is first imported).
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

SUBJECTS = ["the van", "a driver", "the parcel", "our depot", "the night shift", "a courier", "the crate"]
VERBS = ["reached", "left", "missed", "waited at", "returned to", "passed", "loaded at"]
PLACES = ["the Leeds hub", "door 14", "the north gate", "the Bristol yard", "dock 3", "the ring road"]
TIMES = ["at dawn", "before noon", "after six", "on Sunday", "late again", "on time"]


def make_text(lines: int, seed: int) -> str:
    """Generated sentences, one a line: replace with your corpus."""
    rng = np.random.default_rng(seed)
    pick = lambda words: words[rng.integers(len(words))]  # noqa: E731
    return "\n".join(f"{pick(SUBJECTS)} {pick(VERBS)} {pick(PLACES)} {pick(TIMES)}." for _ in range(lines))


def group_texts(ids: np.ndarray, block: int) -> np.ndarray:
    """run_clm's group_texts: the token stream cut into blocks of `block` tokens (the tail dropped)."""
    n = len(ids) // block * block
    return ids[:n].reshape(-1, block)


class Blocks(torch.utils.data.Dataset):
    """Each block is a causal LM example; the model shifts the labels itself."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = torch.from_numpy(blocks)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main(run):
    p = run.params
    ids = np.frombuffer(make_text(p.lines, p.seed).encode(), dtype=np.uint8).astype(np.int64)
    blocks = group_texts(ids, p.block)
    n_val = max(1, len(blocks) // 20)
    train, val = Blocks(blocks[n_val:]), Blocks(blocks[:n_val])

    torch.manual_seed(p.seed)  # the model's initial weights
    config = GPT2Config(vocab_size=256, n_positions=p.block, n_embd=p.d_model, n_layer=p.n_layer,
                        n_head=p.n_head, bos_token_id=10, eos_token_id=10)  # "\n" ends a line
    model = GPT2LMHeadModel(config)

    args = TrainingArguments(
        output_dir="clm-output",  # the Trainer's own folder: kchain moves each checkpoint-N out of it
        max_steps=p.steps,
        per_device_train_batch_size=p.batch,
        per_device_eval_batch_size=p.batch,
        gradient_accumulation_steps=p.accumulate,
        learning_rate=p.lr,
        warmup_steps=p.warmup,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        logging_steps=p.log_every,
        eval_strategy="steps",
        eval_steps=p.eval_every,
        save_steps=500,  # not used under kchain: train.checkpoint_every decides
        seed=p.seed,
        bf16=run.dtype == torch.bfloat16,  # train.precision: bf16 on Ampere+, fp16 on a T4
        fp16=run.dtype == torch.float16,
        report_to="none",
        disable_tqdm=True,  # one printed line per log, not a progress bar in the session's log
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        data_collator=default_data_collator,
        callbacks=[run.hf_callback()],  # kchain: owns the Trainer's checkpoints
    )
    trainer.train(resume_from_checkpoint=run.hf_resume(trainer))  # kchain: the newest checkpoint, or None

    # Reached when the run is over (finished, or stopped early): never after a session's deadline stop.
    metrics = trainer.evaluate()
    print(f"validation loss {metrics['eval_loss']:.4f}, perplexity {math.exp(metrics['eval_loss']):.2f}")
    trainer.save_model(os.path.join(args.output_dir, "final"))
