"""The runtime's own guards, each through a real child process of the launcher: the hung-step
watchdog and the expected-resume check (the kernel stops before training from a wrong state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kchain.common import layout

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
PARAMS = {"d_model": 16, "steps": 12, "workers": 0, "accumulate": 1, "dropout": 0.0, "lr": 0.01}


def launch(root: Path, config: dict, **env: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps(config))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
                     PYTHONUNBUFFERED="1", **env)
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                          capture_output=True, text=True, timeout=300)


def config(**kaggle) -> dict:
    return {"job": "tiny", "entry": "tiny_job:main", "params": PARAMS, "fingerprint": "f00d",
            "kchain_version": "0.1.0", "kaggle": kaggle,
            "train": {"checkpoint_every": {"steps": 3}, "keep": 2, "heartbeat_s": 0}}


def summary(root: Path) -> dict:
    return json.loads((root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())


def checkpoints(root: Path) -> list[str]:
    folder = root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(layout.CHECKPOINT_PREFIX))


def test_a_hung_step_ends_the_run_with_every_stack_and_nothing_new_saved(tmp_path):
    # Step 7 never returns. The watchdog fires after max(3 s, 10x the slowest step): on a slow moment
    # of the machine only later; the test waits for the verdict, never for a time.
    done = launch(tmp_path, config(), KCHAIN_FAULT="hang_at_step=7", KCHAIN_HANG_TIMEOUT="3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[kchain] hung: no step completed for " in done.stdout
    assert "--- thread MainThread ---" in done.stdout and "time.sleep(10**9)" in done.stdout
    result = summary(tmp_path)
    assert result["status"] == "hung" and result["error"]["type"] == "Hung"
    assert result["step"] == 6  # the hung step never completed
    assert checkpoints(tmp_path)[-1] == layout.checkpoint_name(6)  # saved on the cadence before, nothing after


def test_a_session_without_its_expected_state_stops_before_training(tmp_path):
    # Nothing attached after the mount wait: state_not_mounted (75, "saved, not done"; the chain pushes
    # the same session again), nothing trained, the step it was pushed for kept.
    late = launch(tmp_path / "late", config(resume={"step": 40, "state_version": 5}, mount_wait_s=1.0))
    assert late.returncode == layout.EXIT_SAVED_NOT_DONE, late.stdout + late.stderr
    assert ("[kchain] state-not-mounted: state version 5 (step 40) was not mounted within 1 s "
            "(kaggle.mount_wait)") in late.stdout
    assert (summary(tmp_path / "late")["status"], summary(tmp_path / "late")["step"]) == ("state_not_mounted", 40)
    # A state that says step 40 is mounted, but holds no checkpoint: the wrong state, not a late one.
    marker = tmp_path / "wrong" / layout.INPUT_DIR / "datasets" / "alice" / "tiny-state" / layout.STATE_MARKER
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"step": 40}))
    done = launch(tmp_path / "wrong", config(resume={"step": 40, "state_version": 5}))
    assert done.returncode == 1
    assert ("[kchain] crashed in build: WrongState: this session was pushed to resume step 40 from state "
            "version 5, but the attached input holds no checkpoint; stopping before training from the wrong "
            "state") in done.stdout
    assert summary(tmp_path / "wrong")["status"] == "crashed"
    for root in (tmp_path / "late", tmp_path / "wrong"):
        assert not (root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR).exists() or \
            checkpoints(root) == []
