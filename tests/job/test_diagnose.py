"""The hint a failed training process is reported with, by its error's class and first line."""

from __future__ import annotations

import pytest

from kchain.job.diagnose import from_log, hint_for


@pytest.mark.parametrize("module, extra", [
    ("transformers", "hf"), ("peft", "hf"), ("accelerate.utils", "accelerate"), ("pytorch_lightning", "lightning"),
    ("matplotlib", "plot"), ("mlflow", "trackers"),
])
def test_a_missing_framework_names_its_extra(module, extra):
    assert hint_for("ModuleNotFoundError", f"No module named '{module}'") == (
        f"a framework this laptop lacks ({module.split('.')[0]}; `kchain doctor` compares Kaggle's image with this "
        f"laptop): pip install 'kchain[{extra}]'")


def test_lightning_itself_is_no_extra_of_kchains():
    # kchain[lightning] installs pytorch-lightning, which has no `lightning` module: no extra would help.
    assert hint_for("ModuleNotFoundError", "No module named 'lightning'").startswith("a missing module: ")


def test_another_missing_module_is_the_code_folders():
    assert hint_for("ModuleNotFoundError", "No module named 'transformers_utils'").startswith("a missing module: ")
    log = "Traceback (most recent call last):\n  File \"train.py\", line 1\nModuleNotFoundError: No module named 'mylib'\n"
    failure = from_log(log)
    assert failure is not None and failure.hint.endswith("put your own modules in the code folder")
