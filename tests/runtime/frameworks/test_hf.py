"""The Hugging Face Trainer under kchain (issue 23, part 1): kchain/runtime/frameworks/hf.py and the hf-trainer template.

The template (a run_clm-style script: a tiny GPT-2 from a GPT2Config, generated text, TrainingArguments,
`Trainer(..., callbacks=[run.hf_callback()])`, `trainer.train(resume_from_checkpoint=run.hf_resume(trainer))`)
smokes as written with 2 gloo ranks, as on Kaggle: a stop mid-epoch, a real SIGKILL, a bit-exact resume.
A rehearsal chains it through a deadline stop mid-epoch (inside a logging window) and a kill. In-process,
with a Run built by hand: an EarlyStoppingCallback ends the run `stopped`, and a deadline stop's
checkpoint whose Trainer file was tampered with is skipped for the one before it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import invoke, make_run

from kchain.common import layout
from kchain.common.checkpoint_files import verify
from kchain.job.init import TEMPLATES, init_job
from kchain.local.rehearse import rehearse
from kchain.result import traces

TEMPLATE = "hf-trainer"


def template_job(tmp_path: Path) -> Path:
    folder = tmp_path / "hf-clm"
    init_job(folder, template=TEMPLATE)
    return folder / "job.yaml"


@pytest.mark.slow
def test_the_template_smokes_to_an_exact_pass_on_two_ranks_with_a_mid_epoch_kill(tmp_path):
    path = template_job(tmp_path)
    result = invoke("smoke", path)  # the ranks it gets on Kaggle: GPU T4 x2, 2 gloo ranks here
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "2 ranks (gloo, CPU)" in result.output
    assert "hf: the Trainer's DDP runs over kchain's 2 ranks" in result.output
    assert "finished at step 4/4" in result.output  # smoke.steps caps the Trainer's max_steps (3000)
    work = next((Path(tmp_path / "kchain-home") / "smoke").iterdir())
    resumed = traces.read_trace(traces.sandbox_trace(work / "resume"))
    at_stop = next(row for row in resumed if row["step"] == 2 and "loss" in row)
    assert 0 < at_stop["epoch"] < 1  # the stop, the kill and the resume are mid-epoch
    assert {row["step"] for row in resumed} >= {1, 2, 3, 4}
    # The Trainer's checkpoint-2 is inside kchain's checkpoint, every file in the verified manifest.
    ckpt = work / "run" / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / layout.checkpoint_name(2)
    manifest = verify(ckpt)
    trainer_files = set(manifest["attached"]["hf"].values())
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= trainer_files
    assert not list((work / "run" / layout.WORKING_DIR / "clm-output").glob("checkpoint-*"))  # moved, not copied


@pytest.mark.slow
def test_a_rehearsal_chains_through_a_deadline_mid_epoch_and_a_kill(tmp_path, monkeypatch):
    # 0 -> 8 (a deadline, inside the logging window 6..10), 8 -> 12 (killed after its save), 12 -> 16;
    # every stop is mid-epoch (395 steps an epoch), and the resumed windows log what the reference logs.
    monkeypatch.setenv(layout.FAULT_ENV, "deadline_after_steps=8")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "4 steps")
    path = template_job(tmp_path)
    result = rehearse(path, sessions=None, session_limit_s=600, kills=1, ranks=1, params={"steps": 16, "log_every": 5},
                      echo=lambda _: None)
    assert result.passed, result.verdict
    assert result.verdict.startswith("identical: ")
    assert result.killed == [2]
    first, last = result.sessions[0]["summary"], result.sessions[-1]["summary"]
    assert first is not None and last is not None
    assert (first["status"], first["step"], first["total"]) == ("deadline", 8, 16)
    assert (last["status"], last["step"]) == ("finished", 16)
    logged = {row["step"]: row for row in result.chained if "loss" in row}
    assert sorted(logged) == [5, 10, 15] and all(0 < row["epoch"] < 1 for row in logged.values())


def template_module():
    spec = importlib.util.spec_from_file_location("hf_template", TEMPLATES / TEMPLATE / "train.py")
    assert spec is not None and spec.loader is not None  # a .py file always has a spec and a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_trainer(run, callbacks: list, max_steps: int, **arguments):
    """The template's data and a 1-layer GPT-2, as the template builds them (in this process)."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    t = template_module()
    ids = np.frombuffer(t.make_text(400, 0).encode(), dtype=np.uint8).astype(np.int64)
    blocks = t.group_texts(ids, 16)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                        bos_token_id=10, eos_token_id=10))
    args = TrainingArguments(output_dir=str(run.working / "out"), max_steps=max_steps, per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, learning_rate=1e-3, logging_steps=1, seed=0,
                             report_to="none", disable_tqdm=True, dataloader_pin_memory=False, **arguments)
    return Trainer(model=model, args=args, train_dataset=t.Blocks(blocks[8:]), eval_dataset=t.Blocks(blocks[:8]),
                   data_collator=default_data_collator, callbacks=callbacks)


def test_an_early_stopping_callback_ends_the_run_stopped(tmp_path):
    from transformers import EarlyStoppingCallback

    run = make_run(tmp_path)
    # Patience 1 and a threshold no evaluation can beat: the evaluation at step 4 stops the Trainer.
    trainer = tiny_trainer(run, [run.hf_callback(), EarlyStoppingCallback(1, early_stopping_threshold=100.0)],
                           max_steps=20, eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss")
    try:
        trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        assert (run.status, run.step, run.total) == ("stopped", 4, 20)
        saved = run.working / "kchain" / "checkpoints" / layout.checkpoint_name(4)
        assert "hf.model.safetensors" in verify(saved)["files"]
    finally:
        run.close()


def test_a_tampered_trainer_file_makes_the_resume_fall_back_to_the_checkpoint_before(tmp_path):
    from kchain.runtime.run import SessionStopped

    env = {layout.CHECKPOINT_EVERY_ENV: "2 steps"}
    run = make_run(tmp_path, env={**env, layout.FAULT_ENV: "deadline_after_steps=3"})
    trainer = tiny_trainer(run, [run.hf_callback()], max_steps=6)
    try:
        with pytest.raises(SessionStopped):  # the deadline after step 3 saves it and ends the session
            trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        assert (run.status, run.step, run.total) == ("deadline", 3, 6)
    finally:
        run.close()
    checkpoints = run.working / "kchain" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [layout.checkpoint_name(2), layout.checkpoint_name(3)]
    optimizer = checkpoints / layout.checkpoint_name(3) / "hf.optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, the size unchanged
    optimizer.write_bytes(bytes(data))

    run = make_run(tmp_path, env=env)
    trainer = tiny_trainer(run, [run.hf_callback()], max_steps=6)
    try:
        folder = run.hf_resume(trainer)
        assert folder is not None
        assert run.resumed_from == 2 and Path(folder).name == "checkpoint-2"
        trainer.train(resume_from_checkpoint=folder)
        assert (run.status, run.step) == ("finished", 6)
    finally:
        run.close()
    rows = [json.loads(line) for line in (run.working / "kchain" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]  # step 3 again, once


def mlm_collator():
    """DataCollatorForLanguageModeling(mlm=True) over a word-level tokenizer built in code (32 ids)."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(27)])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                        pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                        mask_token="[MASK]")
    return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)


def token_rows(n: int) -> list[dict]:
    """n generated rows of 12 token ids, [CLS] ... [SEP], as a tokenized dataset gives them."""
    import torch

    rows = torch.Generator().manual_seed(1)
    return [{"input_ids": [2, *torch.randint(5, 32, (10,), generator=rows).tolist(), 3]} for _ in range(n)]


def masked_lm_trainer(run, workers: int, max_steps: int):
    """A 1-layer BertForMaskedLM, 16 rows (4 steps an epoch), the mlm collator, `workers` loader workers."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16))
    args = TrainingArguments(output_dir=str(run.working / "out"), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, seed=0, report_to="none", disable_tqdm=True,
                             dataloader_pin_memory=False, dataloader_num_workers=workers)
    return Trainer(model=model, args=args, train_dataset=token_rows(16), data_collator=mlm_collator(),
                   callbacks=[run.hf_callback()])


def test_the_seeded_collator_draws_a_fixed_function_of_seed_batch_and_epoch():
    import pickle
    import random

    import numpy as np
    import torch
    from transformers import default_data_collator

    from kchain.runtime.frameworks.hf import SeededCollator

    rows, collator = token_rows(8), mlm_collator()
    seeded = SeededCollator(collator, seed=0)
    torch.manual_seed(7)
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    first = seeded(rows[:4])
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[2]
    assert (np.random.get_state()[1] == states[1]).all()  # the training's RNG streams did not move
    assert (first["labels"] != -100).any()  # it masked
    again = pickle.loads(pickle.dumps(seeded))(rows[:4])  # a loader worker's copy: the same masks
    assert all(torch.equal(again[k], first[k]) for k in ("input_ids", "labels"))
    seeded.epoch = 1
    assert not torch.equal(seeded(rows[:4])["labels"], first["labels"])  # another epoch, other masks
    assert not torch.equal(SeededCollator(collator, seed=1)(rows[:4])["labels"], first["labels"])
    assert seeded.tokenizer is collator.tokenizer  # the Trainer saves data_collator.tokenizer
    plain = SeededCollator(default_data_collator, seed=0)(rows)  # a collator that draws nothing: as it was
    assert torch.equal(plain["input_ids"], default_data_collator(rows)["input_ids"])


def logged_losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run.working / "kchain" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_masking_collator_resumes_bit_exact_mid_epoch(tmp_path, capsys, workers):
    # 6 steps over 1.5 epochs; the deadline after step 3 stops mid-epoch 0, the resume crosses into epoch 1.
    from kchain.runtime.run import SessionStopped

    reference = make_run(tmp_path / "reference")
    trainer = masked_lm_trainer(reference, workers, max_steps=6)
    try:
        trainer.train(resume_from_checkpoint=reference.hf_resume(trainer))
        assert (reference.status, reference.step) == ("finished", 6)
    finally:
        reference.close()

    run = make_run(tmp_path / "chained", env={layout.FAULT_ENV: "deadline_after_steps=3"})
    trainer = masked_lm_trainer(run, workers, max_steps=6)
    try:
        with pytest.raises(SessionStopped):
            trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        assert (run.status, run.step) == ("deadline", 3)
    finally:
        run.close()
    run = make_run(tmp_path / "chained")  # a fresh Run in the same root: the next session
    trainer = masked_lm_trainer(run, workers, max_steps=6)
    try:
        trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        assert (run.status, run.step, run.resumed_from) == ("finished", 6, 3)
    finally:
        run.close()
    expected = logged_losses(reference)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert logged_losses(run) == expected  # every step's loss, as floats: the masks and the dropout the same
    assert "not exact" not in capsys.readouterr().err + capsys.readouterr().out
