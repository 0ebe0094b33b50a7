"""The holes ported code fell into (issue 20), each on a small job of tests/runtime_jobs/ports_job.py.

Two ranks that train two models, a stop mid-epoch that ran the epoch's own code before the save,
a resume that could read the killed run's working dir: each used to pass the smoke.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import error_line, invoke, runtime_job

from kchain.common import layout
from kchain.common.config import RuntimeConfig
from kchain.common.settings import Settings

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
CHILD_TIMEOUT_S = 120
EPOCHS: dict[str, Any] = {"epochs": 3, "rows": 40, "batch": 8}  # 5 batches an epoch: 15 steps


def port_job(tmp_path: Path, entry: str, gpus="auto", smoke: dict | None = None, **params) -> Path:
    return runtime_job(tmp_path, "ports_job", entry, "port", gpus, smoke, {"steps": 6, **params})


# --- 1. two ranks, two models --------------------------------------------------------------------

def test_the_smoke_runs_the_two_ranks_kaggle_gives_and_a_stop_mid_epoch_resumes_exactly(tmp_path):
    # gpus: auto with a GPU accelerator is T4 x2 on Kaggle: 2 ranks here too. The run to kill stops at
    # a deadline after step 3, mid-epoch (5 batches an epoch): the epoch's scheduler step and
    # evaluation must not run before its checkpoint, or the resume differs from step 4 on.
    result = invoke("smoke", port_job(tmp_path, "epoch_eval", **EPOCHS))
    assert result.exit_code == 0, result.output
    assert "2 ranks (gloo, CPU), the whole group SIGKILLed" in result.output
    assert "a deadline stop, its checkpoint, SIGKILL" in result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output


@pytest.mark.parametrize(("entry", "says"), [
    ("unwrapped", "UnsyncedReplicas: Adam steps model.0.weight, which is not in DistributedDataParallel: "
                  "each rank would train its own model; wrap the model with `model = run.wrap(model)`"),
    # wrapped, but the forward goes around DDP: caught by the ranks' weights after the first step
    ("bypassed", "UnsyncedReplicas: after step 1 the ranks hold different weights, first model."),
])
def test_two_ranks_that_would_train_two_models_stop_the_smoke_naming_run_wrap(tmp_path, entry, says):
    result = invoke("smoke", port_job(tmp_path, entry), "--quiet")
    assert result.exit_code == 3, result.output
    assert says in error_line(result) and "run.wrap" in error_line(result)
    assert "  hint: two ranks (Kaggle's T4 x2) would train two models" in result.output


# --- 2. a stop leaves the state as it was at the stop ------------------------------------------------

def launch(root: Path, entry: str, params: dict, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "ports", "entry": entry if ":" in entry else f"ports_job:{entry}", "params": params, "fingerprint": "f00d",
        "train": {"checkpoint_every": {"steps": 1000}, "keep": 2, "heartbeat_s": 0},
    }))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
                     PYTHONUNBUFFERED="1", **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def rows(root: Path) -> list[dict]:
    text = (root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.METRICS).read_text()
    return [json.loads(line) for line in text.splitlines()]


def summary(root: Path) -> dict:
    return json.loads((root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())


@pytest.mark.parametrize("stop_at", [3, 5], ids=["mid-epoch", "at-the-epoch-end"])
def test_a_deadline_stop_saves_the_state_at_the_stop_and_runs_no_code_after_it(tmp_path, stop_at):
    ref = launch(tmp_path / "ref", "epoch_eval", EPOCHS)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    stopped = launch(tmp_path / "run", "epoch_eval", EPOCHS, KCHAIN_FAULT=f"deadline_at_step={stop_at}")
    assert stopped.returncode == layout.EXIT_SAVED_NOT_DONE, stopped.stdout + stopped.stderr
    assert (summary(tmp_path / "run")["status"], summary(tmp_path / "run")["step"]) == ("deadline", stop_at)
    # The epoch's own code (scheduler step, evaluation) ran only for a finished epoch: mid-epoch, no
    # val_loss yet; at the epoch's end, exactly one.
    assert sum("val_loss" in r for r in rows(tmp_path / "run")) == (stop_at // 5)
    assert "the session ends here" in stopped.stdout
    resumed = launch(tmp_path / "run", "epoch_eval", EPOCHS)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"[kchain] resumed from step {stop_at}" in resumed.stdout

    def strip(trace):
        return [{k: v for k, v in r.items() if k != "time"} for r in trace]

    assert strip(rows(tmp_path / "run")) == strip(rows(tmp_path / "ref"))  # every value, bit for bit


# --- 3. the smoke's resume starts like a Kaggle session --------------------------------------------

def test_state_kept_only_in_the_working_dir_fails_the_smoke(tmp_path):
    # The resume gets an empty working dir and the checkpoint as an attached input: a model kept in
    # the job's own file would be gone, as on Kaggle. The smoke stops before that, at its second step:
    # the model changes and no checkpoint holds it (untracked.py).
    result = invoke("smoke", port_job(tmp_path, "file_state", gpus=1), "--quiet")
    assert result.exit_code == 3, result.output
    assert ("UntrackedState: model (Sequential) changes between steps but no checkpoint holds it: a resume would "
            "start it over; add run.track(model=model) before the loop") in error_line(result)


# --- 6. smoke params -----------------------------------------------------------------------------

def test_smoke_params_and_set_apply_only_under_the_smoke(tmp_path):
    config = {"params": {"n_layer": 12, "eval_iters": 200}, "smoke": {"params": {"n_layer": 1}}}
    smoke_env = {layout.SMOKE_ENV: "1", layout.SMOKE_PARAMS_ENV: json.dumps({"eval_iters": 2})}
    assert Settings.parse(RuntimeConfig.from_dict(config), smoke_env).smoke_params == {"n_layer": 1, "eval_iters": 2}
    assert Settings.parse(RuntimeConfig.from_dict(config), {layout.SMOKE_PARAMS_ENV: '{"eval_iters": 2}'}).smoke_params == {}


def test_smoke_set_runs_with_the_param_and_a_bad_set_is_one_line(tmp_path):
    job = port_job(tmp_path, "epoch_eval", smoke={"params": {"rows": 48}}, **EPOCHS)
    result = invoke("smoke", job, "--set", "batch=4", "--ranks", "1")  # --ranks 1: one rank when told
    assert result.exit_code == 0, result.output
    assert "[kchain] smoke params: rows=48, batch=4" in result.output
    assert "1 rank (CPU)" in result.output
    bad = invoke("smoke", job, "--set", "batch")
    assert bad.exit_code == 2
    assert error_line(bad) == "Error: --set 'batch': write it as name=value, e.g. --set steps=300"


def test_a_loop_of_its_own_stops_at_the_deadline_with_should_stop_and_resumes_exactly(tmp_path):
    params = {"steps": 12, "save_every": 100}
    ref = launch(tmp_path / "ref", "explicit", params)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    stopped = launch(tmp_path / "run", "explicit", params, KCHAIN_FAULT="deadline_after_steps=5")
    assert stopped.returncode == layout.EXIT_SAVED_NOT_DONE, stopped.stdout + stopped.stderr
    got = summary(tmp_path / "run")
    assert (got["status"], got["step"], got["checkpoint"]) == ("deadline", 5, f"kchain/checkpoints/{layout.checkpoint_name(5)}")
    assert not any("after_the_loop" in r for r in rows(tmp_path / "run"))  # nothing after the stop ran
    resumed = launch(tmp_path / "run", "explicit", params)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert summary(tmp_path / "run")["status"] == "finished"

    def strip(trace):
        return [{k: v for k, v in r.items() if k != "time"} for r in trace]

    assert strip(rows(tmp_path / "run")) == strip(rows(tmp_path / "ref"))


def test_a_finished_loop_that_trained_fewer_steps_than_asked_says_so(tmp_path):
    # run.epochs whose odd epochs never read the loader: 4 epochs of 8 batches ask for 32 steps.
    done = launch(tmp_path, "chain_job:main", {"shape": "skipped_epochs", "epochs": 4})
    assert done.returncode == 0, done.stdout + done.stderr
    got = summary(tmp_path)
    assert (got["status"], got["step"], got["total"]) == ("finished", 16, 32)
    assert got["note"].startswith("trained 16 of the 32 steps asked for: some epochs gave no batches")
    assert f"WARNING: {got['note']}" in done.stdout


def test_a_leftover_accelerate_save_state_is_refused_at_the_smoke_before_any_training(tmp_path):
    # issue 55: accelerate's own save_state every 500 steps passed the smoke's few steps and would end the
    # Kaggle session at step 500; the smoke reads the code (kchain/job/codecheck.py) and stops before training.
    job = port_job(tmp_path, "epoch_eval")
    (tmp_path / "code" / "accel_loop.py").write_text(
        "import accelerate  # read, never imported: the smoke stops first\n\n\n"
        "def main(run):\n"
        "    accelerator = run.accelerator()\n"
        "    for epoch in run.epochs(2):\n"
        "        accelerator.save_state(f'ckpt/{epoch}')  # as the script did, every epoch\n")
    result = invoke("smoke", job, "--quiet")
    assert result.exit_code == 3, result.output
    assert error_line(result) == ("Error: accel_loop.py:7: accelerator.save_state(...) saves accelerate's own "
                                  "checkpoint: kchain already checkpoints the whole state (and a resume would "
                                  "ignore this one); remove the call")
    assert "  train " not in result.output and "  render " not in result.output
