"""run.check: a sample batch and the splits checked before the loop, each failure saying what to fix."""

from __future__ import annotations

import pytest
import torch
from helpers import make_run
from torch.utils.data import TensorDataset

from kchain.runtime import preflight
from kchain.runtime.preflight import PreflightError


def test_check_catches_float_labels(tmp_path):
    run = make_run(tmp_path)
    x, y = torch.randn(8, 20), torch.rand(8)
    with pytest.raises(PreflightError) as e:
        run.check(batch=(x, y), num_classes=10)
    assert str(e.value) == (
        "labels have dtype torch.float32; cross-entropy needs an integer class index (torch.int64)"
    )
    assert run.launcher.phase == "preflight"  # a crash here is reported as a preflight failure
    run.close()


def test_float_labels_asked_for_are_checked_as_such(capsys):
    # label_dtype is the documented way to check float labels (a regression, soft targets): no cross-entropy rule.
    x = torch.randn(8, 20)
    preflight.check_batch((x, torch.rand(8)), label_dtype=torch.float32)
    assert capsys.readouterr().out == "[kchain] check ok: labels dtype torch.float32\n"
    with pytest.raises(PreflightError, match=r"^labels have dtype torch.float64; expected torch.float32$"):
        preflight.check_batch((x, torch.rand(8, dtype=torch.float64)), label_dtype=torch.float32)
    with pytest.raises(PreflightError, match="num_classes checks class indices, and labels of dtype torch.float32"):
        preflight.check_batch((x, torch.rand(8)), label_dtype=torch.float32, num_classes=3)


def test_check_catches_out_of_range_labels_and_shapes(tmp_path, capsys):
    run = make_run(tmp_path)
    x = torch.randn(8, 20)
    with pytest.raises(PreflightError, match=r"labels range over \[3, 10\]; with num_classes=10 they must be in \[0, 10\)"):
        run.check(batch=(x, torch.arange(8) + 3), num_classes=10)
    with pytest.raises(PreflightError, match=r"inputs have shape \(8, 20\); expected \(any, 21\)"):
        run.check(batch=(x, torch.zeros(8, dtype=torch.int64)), x_shape=(None, 21))
    with pytest.raises(PreflightError, match="inputs have dtype torch.float32; expected torch.float16"):
        run.check(batch=(x, torch.zeros(8, dtype=torch.int64)), x_dtype=torch.float16)
    capsys.readouterr()
    run.check(batch=(x, torch.arange(8)), x_shape=(None, 20), x_dtype=torch.float32, num_classes=10,
              label_dtype=torch.int64)
    assert capsys.readouterr().out.count("check ok:") == 4
    run.close()


def test_a_quiet_check_still_refuses_and_prints_nothing(capsys):
    """Ranks other than the main one check quietly: the main rank's lines are theirs too."""
    x = torch.randn(8, 20)
    preflight.check_batch((x, torch.arange(8)), x_shape=(None, 20), num_classes=10, quiet=True)
    preflight.check_splits({"train": x[:4], "val": x[4:]}, quiet=True)
    assert capsys.readouterr().out == ""
    with pytest.raises(PreflightError, match=r"inputs have shape \(8, 20\); expected \(any, 21\)"):
        preflight.check_batch((x, torch.arange(8)), x_shape=(None, 21), quiet=True)


def test_check_catches_train_val_overlap_and_prints_counts(tmp_path, capsys):
    run = make_run(tmp_path)
    x, y = torch.randn(100, 4), torch.randint(0, 3, (100,))
    train, val = TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])
    run.check(splits={"train": train, "val": val})
    assert "[kchain] splits: train 80 | val 20" in capsys.readouterr().out
    with pytest.raises(PreflightError, match=r"share 80 of 80 sampled rows; expected none \(trained on the wrong split\?\)"):
        run.check(splits={"train": train, "val": train})
    with pytest.raises(PreflightError, match="share"):
        run.check(splits={"train": ["a", "b", "c"], "val": ["c", "d"]})
    run.close()
