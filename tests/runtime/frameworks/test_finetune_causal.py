"""A causal LM loaded with AutoModelForCausalLM.from_pretrained from a local folder (internet off, no
hub), wrapped with a peft LoRA config: its checkpoint holds the adapters and their optimizer state
only, and a session stopped at its deadline resumes bit for bit. (jobs/finetune covers
AutoModelForSequenceClassification end to end through the smoke.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_run

from kchain.common import layout
from kchain.runtime.checkpoint.state import load_state
from kchain.runtime.loop import SessionStopped

# peft 0.21 reads a property transformers 5 deprecates: their warning, once per wrap.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
TOTAL = 6
VOCAB = 40


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny GPT-2 written by save_pretrained: the "pretrained" base a Kaggle Model would mount."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2-base")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def session(root, base, stop_after=None):
    """One session: from_pretrained, LoRA, AdamW over the adapters, run.steps over token batches."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    env = {layout.FAULT_ENV: f"deadline_after_steps={stop_after}"} if stop_after else {}
    run = make_run(root, params={"seed": 1}, env=env, checkpoint_every={"steps": 100})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(run.params.seed)  # the adapters' initial values and LoRA's dropout draw from it
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                      fan_in_fan_out=True)  # GPT-2's c_attn is a Conv1D (weights stored transposed)
    model = get_peft_model(model, lora).train()  # from_pretrained returns the model in eval mode
    stepper = run.optimize(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    run.track(model=model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (48, 12), generator=g)
    loader = run.loader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    losses = {}
    try:
        for step in run.steps(TOTAL):
            (ids,) = next(loader)
            loss = model(input_ids=ids, labels=ids).loss  # dropout inside LoRA: the RNG must resume too
            stepper.backward(loss)
            stepper.step()
            losses[step] = loss.item()
    except SessionStopped:
        pass
    run.close()
    return run, model, losses


def test_a_causal_lm_with_lora_checkpoints_the_adapters_only_and_resumes_bit_exact(tmp_path, base_folder):
    _, whole, whole_losses = session(tmp_path / "ref", base_folder)
    _, _, first = session(tmp_path / "run", base_folder, stop_after=3)
    ckpt = sorted((tmp_path / "run/working/kchain/checkpoints").glob("step-*"))[-1]
    saved = load_state(ckpt)["tracked"]["model"]
    assert saved and all("lora_" in name for name in saved), sorted(saved)[:5]
    frozen = json.loads((ckpt / layout.MANIFEST).read_text())["frozen"]["model"]
    assert any(name.endswith("wte.weight") for name in frozen)  # the base is fingerprinted, not saved
    run, resumed, rest = session(tmp_path / "run", base_folder)
    assert run.resumed_from == 3 and run.finished
    assert {**first, **rest} == whole_losses  # the same float at every step, across the stop
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
