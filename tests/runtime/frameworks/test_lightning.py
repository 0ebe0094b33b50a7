"""Lightning's `trainer.fit` under kchain (runtime/frameworks/lightning.py), on the `kchain init --template lightning` job.

The template smoke-passes as written (2 ranks: Lightning's DDP over kchain's torchrun, a stop mid-epoch,
shuffled data read by 2 workers a rank); a chained run with a deadline mid-epoch and a SIGKILL after a
checkpoint at an epoch's end matches the uninterrupted fit bit for bit and trains every step it asks for;
EarlyStopping ends the run `stopped`. Smoke and rehearsal sessions are real notebook processes and their
kills real SIGKILLs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import STALL, invoke, make_run

from kchain.common import layout
from kchain.common.summary import read_working
from kchain.job.init import init_job
from kchain.local.rehearse import rehearse


def lightning_job(tmp_path: Path, **params) -> Path:
    """The lightning template as `kchain init --template lightning` writes it, params overridden."""
    folder = tmp_path / "lit-job"
    init_job(folder, template="lightning")
    path = folder / "job.yaml"
    if params:
        spec = yaml.safe_load(path.read_text())
        spec["params"].update(params)
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def load_template(folder: Path):
    """The template's train.py as a module (its LightningModule and LightningDataModule)."""
    spec = importlib.util.spec_from_file_location("lit_template", folder / "train.py")
    assert spec is not None and spec.loader is not None  # a .py file always has a spec and a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_template_smokes_to_an_exact_pass_on_two_ranks_with_a_stop_mid_epoch(tmp_path):
    path = lightning_job(tmp_path)
    result = invoke("smoke", path)
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "2 ranks (gloo, CPU)" in result.output and "not exact" not in result.output
    # 480 training rows of the smoke, 2 ranks x 64 a step: 4 steps an epoch, the stop after step 3 is
    # mid-epoch; the resumed run finishes the epoch and validates at its end (step 4), as the reference.
    lines = [line.split() for line in result.output.splitlines()]
    assert ["4", "val_loss"] == next(words[:2] for words in lines if words[1:2] == ["val_loss"])
    assert ["4", "loss"] == next(words[:2] for words in lines if "<-" in words)
    run_dir = Path(os.environ["KCHAIN_HOME"]) / "smoke"
    resumed = read_working(next(run_dir.iterdir()) / "resume" / layout.WORKING_DIR)
    assert resumed is not None
    assert (resumed.status, resumed.step, resumed.total, resumed.world_size) == ("finished", 6, 6, 2)


@pytest.mark.slow
def test_a_chain_matches_the_uninterrupted_fit_through_a_deadline_mid_epoch_and_a_kill(tmp_path, monkeypatch):
    # 96 training rows, 32 a step: 3 steps an epoch, 9 in all. Session 1 saves at step 3 (the cadence) and
    # stops at the deadline after step 4, mid-epoch; session 2 resumes there and is SIGKILLed after its
    # checkpoint of step 6, an epoch's end (its validation done); session 3 resumes at epoch 2's start.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=4")
    monkeypatch.setenv(layout.CHECKPOINT_EVERY_ENV, "3 steps")
    path = lightning_job(tmp_path, rows=120, batch=32, epochs=3, num_workers=0)
    result = rehearse(path, sessions=None, session_limit_s=600, kills=1, ranks=1, echo=lambda _: None)
    assert result.passed, result.verdict
    assert result.verdict.startswith("identical: ")
    assert result.killed == [2]
    assert [s.get("resumes_at") or 0 for s in result.sessions] == [0, 4, 6]
    assert [s.get("end_status") for s in result.sessions][::2] == ["deadline", "finished"]
    last = result.sessions[-1]["summary"]
    assert last is not None
    assert (last["step"], last["total"]) == (9, 9)  # every step asked for was trained
    assert [row["step"] for row in result.chained if "val_loss" in row] == [3, 6, 9]  # one validation an epoch


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*does not have many workers:UserWarning")
def test_early_stopping_ends_the_run_stopped(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import EarlyStopping

    template = load_template(lightning_job(tmp_path).parent)
    run = make_run(tmp_path / "root", params={"seed": 0})
    try:
        model = template.Classifier(features=8, classes=2, hidden=16, dropout=0.1, lr=1e-2, epochs=5)
        data = template.BlobData(rows=160, features=8, classes=2, batch=32, num_workers=0, seed=0)
        stop = EarlyStopping(monitor="val_loss", stopping_threshold=1e9)  # met at the first validation
        trainer = pl.Trainer(max_epochs=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[run.lightning_callback(), stop])
        trainer.fit(model, data)
        assert trainer.should_stop and trainer.current_epoch == 1
        assert (run.status, run.step, run.total) == ("stopped", 4, 20)  # 128 rows, 32 a step: 4 an epoch
        assert run.metrics["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]))
    finally:
        run.close()


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*does not have many workers:UserWarning")
def test_sigterm_saves_at_the_next_step_and_the_next_session_resumes_exactly(tmp_path):
    # Lightning puts its own SIGTERM handler in at the fit's start (a SIGTERMException after the batch,
    # before any save); kchain's replaces it for the fit, so the stop saves at the next step boundary. A
    # model whose setup() draws random numbers (after kchain's restore) still resumes exactly.
    import signal

    import pytorch_lightning as pl
    import torch

    from kchain.runtime.run import SessionStopped

    template = load_template(lightning_job(tmp_path).parent)

    classifier: Any = template.Classifier  # the template's LightningModule (a module loaded from its file)

    class Drawing(classifier):
        def setup(self, stage):
            torch.rand(3)

    class Terminate(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    def fit(root: Path, *callbacks) -> tuple:
        pl.seed_everything(0)
        run = make_run(root, params={"seed": 0})
        trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[run.lightning_callback(), *callbacks])
        try:
            trainer.fit(Drawing(8, 2, 16, 0.3, 1e-2, 2), template.BlobData(160, 8, 2, 32, 0, 0))
        except SessionStopped:
            assert not trainer.received_sigterm  # Lightning's handler never ran
        finally:
            run.close()
        return run.status, run.step, run.total, (root / "working/kchain/metrics.jsonl").read_text()

    reference = fit(tmp_path / "reference")
    assert fit(tmp_path / "chain", Terminate())[:3] == ("interrupted", 2, 8)  # 128 rows, 32 a step, 2 epochs
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers in place before the fit are back
    resumed = fit(tmp_path / "chain")
    assert resumed[:3] == reference[:3] == ("finished", 8, 8)
    rows = [[json.loads(row) for row in trace.splitlines()] for trace in (reference[3], resumed[3])]
    assert rows[0] and [[(r["step"], r.get("loss"), r.get("val_loss")) for r in trace] for trace in rows] == \
        [[(r["step"], r.get("loss"), r.get("val_loss")) for r in rows[0]]] * 2
