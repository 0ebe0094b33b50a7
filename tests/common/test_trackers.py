"""One run across sessions for the experiment trackers: the chain's run id, the trackers' variables,
and one TensorBoard run and one MLflow run through a real SIGKILL between two checkpoints, read back
with each tracker's own reader (EventAccumulator, MlflowClient)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import known

from kchain.common import eventfiles, layout, statefolder, trackers

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
KILLED = -9
STEPS = 10
TAGS = ("train/loss", "train/weight_norm", "train/half_step", "loss")  # the job's three, and run.log's mirror


def launch(root: Path, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cfg.json").write_text(json.dumps({
        "job": "tb", "entry": "tb_job:main", "params": {"steps": STEPS},
        "train": {"checkpoint_every": {"steps": 3}, "keep": 2, "heartbeat_s": 0,
                  "trackers": ["tensorboard", "wandb", "mlflow"]},
    }))
    child_env = {k: v for k, v in os.environ.items()
                 if not k.startswith(("KCHAIN_", "WANDB_", "TENSORBOARD_", "MLFLOW_"))}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(root / "cfg.json")], env=child_env,
                          cwd=root, capture_output=True, text=True, timeout=300)


def kdir(root: Path) -> Path:
    return root / layout.WORKING_DIR / layout.KCHAIN_DIR


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard itself reads the folder (purges included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_runs(root: Path) -> dict[str, list[tuple[int, float]]]:
    """{run id: [(step, train_loss), ...]} as MLflow's own client reads the store the chain carried."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(kdir(root) / layout.MLFLOW_DIR).as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {r.info.run_id: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "train_loss"))
            for r in runs}


def checkpoint_ids(root: Path) -> set[str]:
    ckpts = kdir(root) / layout.CHECKPOINTS_DIR
    return {json.loads((p / layout.MANIFEST).read_text())[trackers.RUN_ID_KEY]
            for p in ckpts.iterdir() if p.name.startswith(layout.CHECKPOINT_PREFIX)}


@pytest.mark.slow
def test_a_sigkill_between_checkpoints_leaves_one_tracker_run_equal_to_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process's reader; the sessions get it from kchain
    ref = launch(tmp_path / "ref")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    want = scalars(kdir(tmp_path / "ref") / layout.TENSORBOARD_DIR)
    assert sorted(want) == sorted(TAGS)
    assert all([s for s, _ in want[tag]] == list(range(1, STEPS + 1)) for tag in TAGS)
    [want_mlflow] = mlflow_runs(tmp_path / "ref").values()
    assert [s for s, _ in want_mlflow] == list(range(1, STEPS + 1))

    # Session 1 dies at step 8: checkpoints at 3 and 6 (written in the training thread, so both are
    # complete by then on a busy machine too); steps 7 and 8 are in its event file on disk.
    root = tmp_path / "chain"
    died = launch(root, KCHAIN_FAULT="kill_at_step=8", **{layout.CHECKPOINT_STREAM_ENV: "1"})
    assert died.returncode == KILLED, died.stdout + died.stderr
    logdir = kdir(root) / layout.TENSORBOARD_DIR
    assert [s for s, _ in scalars(logdir)["train/loss"]] == list(range(1, 9))
    [(mlflow_id, logged)] = mlflow_runs(root).items()
    assert [s for s, _ in logged] == list(range(1, 9))
    run_id = checkpoint_ids(root)
    assert len(run_id) == 1

    # As on Kaggle: a fresh working dir, the state version (flat) attached as an input.
    fresh = tmp_path / "fresh"
    statefolder.build_state_folder(kdir(root), fresh / layout.INPUT_DIR / "tb-state", "test", job="tb")
    again = launch(fresh)
    assert again.returncode == 0 and "resumed from step 6" in again.stdout, again.stdout + again.stderr
    assert scalars(kdir(fresh) / layout.TENSORBOARD_DIR) == want
    assert mlflow_runs(fresh) == {mlflow_id: want_mlflow}  # session 1's run, steps 7 and 8 once
    assert checkpoint_ids(fresh) == run_id  # the same run in every session

    # In the killed session's own working dir: its events of steps 7 and 8 are superseded.
    resumed = launch(root)
    assert resumed.returncode == 0 and "resumed from step 6" in resumed.stdout, resumed.stdout + resumed.stderr
    assert scalars(logdir) == want
    assert mlflow_runs(root) == {mlflow_id: want_mlflow}
    assert checkpoint_ids(root) == run_id

    # What `kchain pull --logs` will lay out from the last state: the same one run.
    state = tmp_path / "state"
    statefolder.build_state_folder(kdir(root), state, "test", job="tb")
    assert scalars(known(eventfiles.state_dir(state, tmp_path / "pulled"))) == want


def test_the_run_id_is_chosen_once_and_read_back_from_the_newest_checkpoint(tmp_path):
    from helpers import make_run

    first = make_run(tmp_path, checkpoint_every={"steps": 2})
    chosen = first.id
    assert len(chosen) == 16
    for _ in first.steps(4):
        pass
    first.close()
    manifest = json.loads((kdir(tmp_path) / layout.CHECKPOINTS_DIR / layout.checkpoint_name(4) / layout.MANIFEST)
                          .read_text())
    assert manifest[trackers.RUN_ID_KEY] == chosen
    second = make_run(tmp_path, checkpoint_every={"steps": 2})
    assert second.id == chosen  # read before any user code, before the restore
    second.close()
    assert make_run(tmp_path / "other").id != chosen


def test_the_trackers_variables_are_exported_before_the_user_code(tmp_path, monkeypatch):
    from helpers import make_run

    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_RUN_ID", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.delenv(name, raising=False)
    run = make_run(tmp_path, trackers=["wandb", "tensorboard"])
    assert os.environ["WANDB_RUN_ID"] == run.id and os.environ["WANDB_RESUME"] == "allow"
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(run.tensorboard_dir)
    assert "MLFLOW_RUN_ID" not in os.environ  # no MLflow run exists yet
    run.close()
    ids = trackers.RunIds.of({trackers.RUN_ID_KEY: "abc", trackers.MLFLOW_KEY: "f00"})
    store = tmp_path / "mlflow"
    assert trackers.environ(["mlflow"], ids, tmp_path, store, {}) == {
        "MLFLOW_RUN_ID": "f00", "MLFLOW_TRACKING_URI": store.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    server = {"MLFLOW_TRACKING_URI": "http://mlflow.example:5000"}  # the user's own tracking server is kept
    assert trackers.environ(["mlflow"], ids, tmp_path, store, server) == {"MLFLOW_RUN_ID": "f00"}


def test_the_mlflow_run_active_at_a_save_is_kept_for_the_next_session(tmp_path, monkeypatch):
    import mlflow
    from helpers import make_run

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_RUN_ID"):
        monkeypatch.setenv(name, "")  # unset for kchain and MLflow alike, and restored after the test
    run = make_run(tmp_path, checkpoint_every={"steps": 2}, trackers=["mlflow"])
    # No store or opt-in of the user's: kchain's file store, which travels in every checkpoint.
    assert os.environ["MLFLOW_TRACKING_URI"] == (kdir(tmp_path) / layout.MLFLOW_DIR).as_uri()
    with mlflow.start_run() as active:
        for _ in run.steps(2):
            pass
    run.close()
    nxt = make_run(tmp_path, checkpoint_every={"steps": 2}, trackers=["mlflow"])
    assert os.environ["MLFLOW_RUN_ID"] == active.info.run_id
    nxt.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*does not have many workers:UserWarning")
def test_lightnings_tensorboard_logger_on_the_chains_folder_is_one_run_across_a_stop(tmp_path):
    # Lightning's logger flushes every 120 s by itself: what reaches the checkpoint at the stop is what
    # kchain's callback flushed (logger.save()) before it copied the folder.
    import pytorch_lightning as pl
    from helpers import make_run
    from pytorch_lightning.loggers import TensorBoardLogger
    from test_lightning import lightning_job, load_template

    from kchain.runtime.run import SessionStopped

    template = load_template(lightning_job(tmp_path).parent)

    def fit(root: Path, **env: str) -> Path:
        pl.seed_everything(0)
        run = make_run(root, params={"seed": 0}, env=env, checkpoint_every={"steps": 2})
        logger = TensorBoardLogger(run.tensorboard_dir, name="", version="", default_hp_metric=False)
        trainer = pl.Trainer(max_epochs=2, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, callbacks=[run.lightning_callback()])
        try:
            trainer.fit(template.Classifier(8, 2, 16, 0.3, 1e-2, 2), template.BlobData(160, 8, 2, 32, 0, 0))
        except SessionStopped:
            pass
        finally:
            run.close()
        return kdir(root) / layout.TENSORBOARD_DIR

    want = scalars(fit(tmp_path / "reference"))
    assert [s for s, _ in want["train_loss"]] == list(range(8))  # 128 rows, 32 a step, 2 epochs; Lightning counts from 0
    fit(tmp_path / "chain", KCHAIN_FAULT="deadline_after_steps=5")
    assert scalars(fit(tmp_path / "chain")) == want


@pytest.mark.slow
def test_the_hf_trainers_report_to_tensorboard_is_one_run_across_a_stop_without_a_line_of_code(tmp_path, monkeypatch):
    # train.trackers.tensorboard sets TENSORBOARD_LOGGING_DIR, which the Trainer's TensorBoardCallback reads
    # when it is built; run.hf_resume restores the folder before the callback's writer opens it.
    from helpers import make_run
    from test_hf import template_module

    from kchain.runtime.run import SessionStopped

    monkeypatch.delenv(trackers.TENSORBOARD_ENV, raising=False)

    def train(root: Path, **env: str) -> Path:
        import numpy as np
        import torch
        from transformers import (
            GPT2Config,
            GPT2LMHeadModel,
            Trainer,
            TrainingArguments,
            default_data_collator,
        )

        run = make_run(root, env={layout.CHECKPOINT_EVERY_ENV: "2 steps", **env}, trackers=["tensorboard"])
        t = template_module()
        blocks = t.group_texts(np.frombuffer(t.make_text(400, 0).encode(), dtype=np.uint8).astype(np.int64), 16)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        args = TrainingArguments(output_dir=str(run.working / "out"), max_steps=6, per_device_train_batch_size=8,
                                 learning_rate=1e-3, logging_steps=1, seed=0, report_to="tensorboard",
                                 disable_tqdm=True, dataloader_pin_memory=False)
        trainer = Trainer(model=model, args=args, train_dataset=t.Blocks(blocks), data_collator=default_data_collator,
                          callbacks=[run.hf_callback()])
        try:
            trainer.train(resume_from_checkpoint=run.hf_resume(trainer))
        except SessionStopped:
            pass
        finally:
            run.close()
        return kdir(root) / layout.TENSORBOARD_DIR

    def curves(logdir: Path) -> dict:  # the per-step curves (the closing summary's timings differ by nature)
        return {tag: points for tag, points in scalars(logdir).items()
                if tag in ("train/loss", "train/grad_norm", "train/learning_rate")}

    want = curves(train(tmp_path / "reference"))
    assert [s for s, _ in want["train/loss"]] == [1, 2, 3, 4, 5, 6]
    train(tmp_path / "chain", **{layout.FAULT_ENV: "deadline_after_steps=3"})
    assert curves(train(tmp_path / "chain")) == want
