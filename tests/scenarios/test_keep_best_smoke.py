"""train.keep_best names a metric the smoke saw logged, or the smoke fails naming it and what was logged
(a chain would keep no best, and `kchain pull --best` would fail at its end)."""

from __future__ import annotations

from helpers import copy_job, error_line, invoke

ONE_RANK = ("--ranks", "1")  # the rank count is not what these are about
QUICK = {"steps": 1500, "num_workers": 0}  # jobs/classifier validates under run.every(250): only the smoke's last step


def test_a_keep_best_metric_never_logged_fails_the_smoke_naming_what_was(tmp_path):
    path = copy_job("classifier", tmp_path, params=QUICK, train={"keep_best": "val_f1"})
    result = invoke("smoke", path, "--quiet", *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert error_line(result) == (
        f"Error: smoke failed (during checkpoint): KeepBestNotLogged: {path.resolve()}: train.keep_best: val_f1 was "
        "never logged in the smoke (it logged loss, val_loss, val_acc): log it with run.log(val_f1=...) or name one "
        "of those")
    assert "put it under `if run.every(500):`" in result.output


def test_a_keep_best_metric_logged_past_the_smokes_steps_by_run_every_passes(tmp_path):
    path = copy_job("classifier", tmp_path, params=QUICK, train={"keep_best": {"metric": "val_acc", "mode": "max"}})
    result = invoke("smoke", path, "--quiet", *ONE_RANK)
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
