"""codecheck: the framework checkpoint calls left in a job's code, read from its sources (nothing imported)."""

from __future__ import annotations

import json

import pytest

from kchain.errors import SmokeFailed
from kchain.job import notebook_code
from kchain.job.codecheck import leftover_saves, refuse_leftover_saves

KEEPS = "kchain already checkpoints the whole state (and a resume would ignore this one)"


def found(**sources: str) -> list[str]:
    """Each finding's line for the files given as name=source (train="..." is code/train.py)."""
    return [str(f) for f in leftover_saves({f"code/{name}.py": text.encode() for name, text in sources.items()})]


def test_accelerate_save_state_and_load_state_are_found_anywhere_and_only_when_accelerate_is_imported():
    code = ("from accelerate import Accelerator\n"
            "def main(run):\n"
            "    accelerator = run.accelerator()\n"
            "    accelerator.load_state(args.resume)\n"
            "    for epoch in run.epochs(3):\n"
            "        if step % 500 == 0:\n"
            "            accelerator.save_state(f'step_{step}')\n"
            "    accelerator.save_model(model, run.export_dir)\n")  # the final export: not a checkpoint
    assert found(train=code) == [
        "train.py:4: accelerator.load_state(...) loads accelerate's own checkpoint: kchain restores its newest "
        "checkpoint itself when run.epochs starts; remove the call and the resume code around it",
        f"train.py:7: accelerator.save_state(...) saves accelerate's own checkpoint: {KEEPS}; remove the call",
    ]
    assert found(train=code.replace("from accelerate import Accelerator", "import torch")) == []
    # the import in another file of the code arms the rule for a helper's call
    assert found(train="import accelerate\n", util="def keep(acc):\n    acc.save_state('x')\n") == [
        f"util.py:2: acc.save_state(...) saves accelerate's own checkpoint: {KEEPS}; remove the call"]


def test_lightning_save_checkpoint_is_found_while_training_not_after_the_fit():
    code = ("import lightning.pytorch as pl\n"
            "class Every(pl.Callback):\n"
            "    def on_train_batch_end(self, trainer, *args):\n"
            "        trainer.save_checkpoint('last.ckpt')\n"
            "def main(run):\n"
            "    trainer = pl.Trainer(callbacks=[run.lightning_callback()])\n"
            "    trainer.fit(model)\n"
            "    trainer.save_checkpoint(run.working / 'final.ckpt')\n")  # once, after the fit: the output
    assert found(train=code) == [
        f"train.py:4: trainer.save_checkpoint(...) saves Lightning's own checkpoint during training: {KEEPS}; "
        "remove the call (one after trainer.fit(...), for the final model, is fine)"]
    looped = "import pytorch_lightning\nfor fold in range(5):\n    trainer.fit(m)\n    trainer.save_checkpoint(p)\n"
    assert [line.split(" ")[0] for line in found(train=looped)] == ["train.py:4:"]


def test_hf_save_model_and_save_state_are_found_inside_a_loop_not_after_it():
    code = ("from transformers import Trainer\n"
            "def main(run):\n"
            "    for epoch in range(3):\n"
            "        trainer.train()\n"
            "        trainer.save_model(f'out/{epoch}')\n"
            "        def later():\n"
            "            trainer.save_model('x')\n"  # a def in the loop starts afresh: not in a loop
            "    else:\n"
            "        trainer.save_state()\n"  # a loop's else: runs once
            "    while True:\n"
            "        trainer.save_state()\n"
            "        break\n"
            "    trainer.save_model()\n"  # after the loop: the final export
            "    trainer.save_state()\n")
    assert found(train=code) == [
        f"train.py:5: trainer.save_model(...) saves the Trainer's model inside a loop: {KEEPS}; remove the call, "
        "or save once after the loop",
        f"train.py:11: trainer.save_state(...) saves the Trainer's state inside a loop: {KEEPS}; remove the call, "
        "or save once after the loop"]
    # with accelerate imported too, a Trainer's save_state after the loop is still the Trainer's (not flagged)
    both = "import accelerate\nimport trl\ntrainer.save_state()\naccelerator.save_state('x')\n"
    assert [line.split(" ")[:2] for line in found(train=both)] == [["train.py:4:", "accelerator.save_state(...)"]]


def test_a_main_guard_never_runs_under_kchain_and_is_not_read_but_its_else_is():
    code = ("import accelerate\n"
            "if __name__ == '__main__':\n"
            "    accelerator.save_state('old_cli')\n"
            "else:\n"
            "    accelerator.save_state('imported')\n")
    assert [line.split(" ")[0] for line in found(train=code)] == ["train.py:5:"]


def test_a_notebooks_cells_are_read_cell_by_cell_and_the_smoke_refuses_with_the_first_call():
    cells = ["import accelerate", "accelerator = run.accelerator()\nfor step in run.steps(9):\n    pass",
             "\naccelerator.save_state('a')\naccelerator.save_state('b')"]
    notebook = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                          for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    module = notebook_code.to_module(json.dumps(notebook).encode(), "train.ipynb")
    files = {"code/train.py": module.text.encode(), "code/broken.py": b"def (:\n", "code/notes.txt": b"x.save_state()"}
    assert [(f.where, f.call) for f in leftover_saves(files)] == [
        ("train.ipynb, cell 3, line 2", "accelerator.save_state(...)"),
        ("train.ipynb, cell 3, line 3", "accelerator.save_state(...)")]
    with pytest.raises(SmokeFailed) as refused:
        refuse_leftover_saves(files)
    assert str(refused.value) == (f"train.ipynb, cell 3, line 2: accelerator.save_state(...) saves accelerate's own "
                                  f"checkpoint: {KEEPS}; remove the call (1 more: train.ipynb, cell 3, line 3)")
    assert refused.value.exit_code == 3
    refuse_leftover_saves({"code/train.py": b"import accelerate\naccelerator.save_model(m, 'out')\n"})  # nothing to say
