"""The frameworks' own best-model settings land in train.keep_best: the HF Trainer's
load_best_model_at_end + metric_for_best_model, Lightning's ModelCheckpoint(monitor=, mode=)."""

from __future__ import annotations

import json

import pytest
from helpers import make_run

from kchain.common import layout
from kchain.common.checkpoint_files import BEST_KEY, complete


def newest_best(run) -> dict:
    newest = complete(run.working / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR)[-1]
    return json.loads((newest / layout.MANIFEST).read_text())[BEST_KEY]


def test_hf_load_best_model_at_end_keeps_the_best_eval_metric_checkpoint(tmp_path, capsys):
    from test_hf import tiny_trainer

    run = make_run(tmp_path, env={layout.CHECKPOINT_EVERY_ENV: "2 steps"})
    trainer = tiny_trainer(run, [run.hf_callback()], max_steps=4, eval_strategy="steps", eval_steps=2,
                           save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                           metric_for_best_model="eval_loss")
    try:
        trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
    finally:
        run.close()
    assert "hf: load_best_model_at_end (metric_for_best_model=eval_loss) maps onto train.keep_best" \
        in capsys.readouterr().out
    best = newest_best(run)
    assert (best["metric"], best["mode"]) == ("val_loss", "min") and best["step"] in (2, 4)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*does not have many workers:UserWarning")
def test_lightning_model_checkpoint_monitor_and_mode_land_in_keep_best(tmp_path, capsys):
    import pytorch_lightning as pl
    from test_lightning import lightning_job, load_template

    template = load_template(lightning_job(tmp_path).parent)
    run = make_run(tmp_path / "root", params={"seed": 0}, env={layout.CHECKPOINT_EVERY_ENV: "4 steps"})
    try:
        model = template.Classifier(features=8, classes=2, hidden=16, dropout=0.1, lr=1e-2, epochs=2)
        data = template.BlobData(rows=160, features=8, classes=2, batch=32, num_workers=0, seed=0)
        watch = pl.callbacks.ModelCheckpoint(monitor="val_acc", mode="max", dirpath=tmp_path / "mc")
        trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[run.lightning_callback(), watch])
        trainer.fit(model, data)
    finally:
        run.close()
    assert "lightning: ModelCheckpoint(monitor='val_acc', mode='max') maps onto train.keep_best" \
        in capsys.readouterr().out
    best = newest_best(run)
    assert (best["metric"], best["mode"]) == ("val_acc", "max") and best["step"] in (4, 8)
