"""The hint a failed training process is reported with, by its error's class and first line."""

from __future__ import annotations

import pytest

from kchain.diagnose import from_log, hint_for


@pytest.mark.parametrize("message, extra", [
    ("No module named 'transformers'", "kchain[hf]"),
    ("No module named 'peft'", "kchain[hf]"),
    ("No module named 'accelerate.utils'", "kchain[hf]"),
    ("No module named 'pytorch_lightning'", "kchain[lightning]"),
    ("No module named 'lightning'", "kchain[lightning]"),
])
def test_a_missing_framework_names_its_extra(message, extra):
    assert hint_for("ModuleNotFoundError", message) == (
        f"a framework this laptop lacks (Kaggle's image has it): pip install '{extra}'"
        + (" (transformers + peft)" if extra == "kchain[hf]" else ""))


def test_another_missing_module_is_the_code_folders():
    assert hint_for("ModuleNotFoundError", "No module named 'transformers_utils'").startswith("a missing module: ")
    log = "Traceback (most recent call last):\n  File \"train.py\", line 1\nModuleNotFoundError: No module named 'mylib'\n"
    assert from_log(log).hint.endswith("put your own modules in the code folder")
