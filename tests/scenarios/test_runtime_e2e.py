"""End-to-end tests of kchain/runtime: real child processes, real SIGKILLs.

Each test launches `python -m kchain.runtime.launch cfg.json` with KCHAIN_ROOT pointing at a tmp
dir and compares the metrics trace (one JSON line per run.log) with an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import loss_trace as trace

from kchain.common import layout
from kchain.common.checkpoint_files import ResumeError
from kchain.runtime.run import Run

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
TOTAL = 14
EVERY = 3  # checkpoint cadence in steps for the kill tests
PARAMS = {"d_model": 16, "steps": TOTAL, "workers": 2, "accumulate": 2, "dropout": 0.2, "lr": 0.01}
KILLED = -signal.SIGKILL  # subprocess's returncode for a child killed by SIGKILL
CHILD_TIMEOUT_S = 120  # a hung child fails the test instead of hanging CI


def launch(root: Path, params: dict | None = None, every: int = EVERY, **env: str) -> subprocess.CompletedProcess:
    """Run the tiny job once as a child process under KCHAIN_ROOT=root."""
    return subprocess.run(
        [sys.executable, "-m", "kchain.runtime.launch", str(prepared(root, params, every))],
        env=child_env(root, **env), cwd=root, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )


def prepared(root: Path, params: dict | None = None, every: int = EVERY) -> Path:
    """root made, with the tiny job's cfg.json in it; returns that file."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps(config(params, every)))
    return cfg


def child_env(root: Path, **env: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    out.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), PYTHONUNBUFFERED="1", **env)
    return out


def config(params: dict | None = None, every: int = EVERY) -> dict:
    return {
        "job": "tiny",
        "entry": "tiny_job:main",
        "params": {**PARAMS, **(params or {})},
        "fingerprint": "f00d",
        "kchain_version": "0.1.0",
        "train": {"checkpoint_every": {"steps": every}, "keep": 2, "heartbeat_s": 0},
    }


def in_process(root: Path, params: dict | None = None, every: int = EVERY) -> Run:
    """The same job run inside the test process (fast; for what needs no process death)."""
    if str(JOBS) not in sys.path:
        sys.path.insert(0, str(JOBS))
    import tiny_job

    run = Run(config({"workers": 0, **(params or {})}, every), {layout.ROOT_ENV: str(root)})
    try:
        tiny_job.main(run)
    finally:
        run.close()
    return run


def summary(root: Path) -> dict:
    return json.loads((root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())


def max_diff(a, b) -> float:
    assert [s for s, _ in a] == [s for s, _ in b], "the two traces cover different steps"
    return max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The loss trace of one uninterrupted run."""
    root = tmp_path_factory.mktemp("reference")
    done = launch(root)
    assert done.returncode == 0, done.stdout + done.stderr
    ref = trace(root)
    assert [s for s, _ in ref] == list(range(1, TOTAL + 1))
    return ref


def test_two_sigkills_resume_bit_exact(tmp_path, reference):
    seed = random.SystemRandom().randrange(10**6)
    print(f"kill-step seed: {seed}")  # rerun a failure with random.Random(seed)
    # Each kill lands after a checkpoint its run wrote: the first past step EVERY, the second more than
    # EVERY steps past the first (a kill at step 2 and one at 3, before any save, resume nothing).
    rng = random.Random(seed)
    first = rng.randrange(EVERY + 1, 2 * EVERY + 1)
    second = rng.randrange(first + EVERY + 1, TOTAL)
    for kill in (first, second):
        died = launch(tmp_path, KCHAIN_FAULT=f"kill_at_step={kill}")
        assert died.returncode == KILLED, died.stdout + died.stderr
    done = launch(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[kchain] resumed from step" in done.stdout
    assert summary(tmp_path)["status"] == "finished"
    assert max_diff(trace(tmp_path), reference) == 0.0


# Run as a child: it becomes the reaper of orphans, so it sees how each of the launch's processes died.
REAPER = """
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
launch = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deaths = {}
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    deaths[pid] = os.waitstatus_to_exitcode(status)
print(json.dumps({"launch": deaths.pop(launch.pid), "others": list(deaths.values())}))
"""


def test_a_kill_fault_takes_the_loader_workers_with_it_as_the_end_of_a_session_does(tmp_path):
    # Left alive, the workers would notice their parent gone only at their next check (up to 5 s),
    # then exit on their own, holding the notebook's output pipe open until then.
    cfg = prepared(tmp_path, {"workers": 2})
    out = subprocess.run([sys.executable, "-c", REAPER, sys.executable, "-m", "kchain.runtime.launch", str(cfg)],
                         env=child_env(tmp_path, KCHAIN_FAULT="kill_at_step=4"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)
    deaths = json.loads(out.stdout)
    assert deaths["launch"] == KILLED
    assert len(deaths["others"]) == 2 and set(deaths["others"]) == {KILLED}, deaths  # both workers, by SIGKILL


def test_untracked_optimizer_diverges_after_resume(tmp_path, reference):
    """The control for the test above: it can fail."""
    kill = 2 * EVERY + 1  # resumes from the checkpoint at step 2*EVERY
    died = launch(tmp_path, {"track_optimizer": False}, KCHAIN_FAULT=f"kill_at_step={kill}")
    assert died.returncode == KILLED
    run = in_process(tmp_path, {"track_optimizer": False})
    # The step-6 write may still have been in flight at the kill; then the resume is from step 3.
    resumed = run.resumed_from
    assert resumed in (EVERY, 2 * EVERY)
    got = trace(tmp_path)
    assert max_diff(got[:resumed], reference[:resumed]) == 0.0
    assert max_diff(got[resumed:], reference[resumed:]) > 0.0


SAVE_POINTS = ["after_state", "after_metrics", "before_manifest", "before_rename", "after_rename"]


@pytest.mark.slow
def test_sigkill_inside_a_checkpoint_write_leaves_a_loadable_one(tmp_path, reference, capsys):
    base = tmp_path / "base"
    in_process(base, {"steps": 2}, every=2)
    for point in SAVE_POINTS:
        root = tmp_path / point
        shutil.copytree(base, root)
        died = launch(root, {"steps": 6, "workers": 0}, every=2, KCHAIN_FAULT=f"kill_in_save={point}")
        assert died.returncode == KILLED, f"{point}: {died.stdout + died.stderr}"
        # The next start resumes from step 4 if the rename happened, else from step 2, and finishes.
        run = in_process(root, {"steps": 6}, every=2)
        assert run.resumed_from == (4 if point == "after_rename" else 2), point
        assert run.status == "finished"
        assert max_diff(trace(root), reference[:6]) == 0.0  # workers=0 and 2 give the same batches


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, reference, damage, capsys):
    in_process(tmp_path, {"steps": 4}, every=2)
    newest = tmp_path / "working/kchain/checkpoints" / layout.checkpoint_name(4)
    blob = bytearray((newest / layout.STATE_FILE).read_bytes())
    if damage == "truncate":
        del blob[len(blob) // 2 :]
    else:
        blob[len(blob) // 2] ^= 0x01
    (newest / layout.STATE_FILE).write_bytes(bytes(blob))
    capsys.readouterr()
    run = in_process(tmp_path, {"steps": 6}, every=2)
    out = capsys.readouterr().out
    assert f"WARNING: skipping checkpoint {newest}" in out
    assert ("truncated" if damage == "truncate" else "sha256 does not match") in out
    assert run.resumed_from == 2
    assert max_diff(trace(tmp_path), reference[:6]) == 0.0


def test_deadline_stops_saves_and_resumes_exactly(tmp_path, reference):
    # 6 s session, 20% margin, each step stalled 0.5 s: the run cannot reach TOTAL steps.
    done = launch(tmp_path, KCHAIN_SESSION_LIMIT="6", KCHAIN_FAULT="stall_step=0.5")
    assert done.returncode == layout.EXIT_SAVED_NOT_DONE, done.stdout + done.stderr  # saved, not done
    first = summary(tmp_path)
    assert first["status"] == "deadline"
    assert first["step"] < TOTAL
    assert first["checkpoint"] == f"kchain/checkpoints/{layout.checkpoint_name(first['step'])}"
    assert "[kchain] deadline:" in done.stdout
    run = in_process(tmp_path)
    assert run.resumed_from == first["step"] and run.finished
    assert max_diff(trace(tmp_path), reference) == 0.0


def test_crash_in_main_reports_type_message_and_stage(tmp_path):
    done = launch(tmp_path, {"crash_at": 3, "workers": 0})
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    got = summary(tmp_path)
    assert got["status"] == "crashed"
    assert got["error"] == {"type": "ValueError", "message": "boom at step 3", "stage": "step"}


def test_changed_shape_params_refuse_resume_naming_the_param(tmp_path, capsys):
    in_process(tmp_path, {"steps": 2})
    with pytest.raises(ResumeError, match="d_model: 16 -> 32"):
        in_process(tmp_path, {"steps": 4, "d_model": 32})
    # A param that shapes nothing: a warning naming it, and the resume goes ahead.
    capsys.readouterr()
    run = in_process(tmp_path, {"steps": 4, "lr": 0.02})
    assert "lr: 0.01 -> 0.02" in capsys.readouterr().out
    assert run.resumed_from == 2 and run.finished


def test_refused_resume_is_a_crash_in_stage_resume(tmp_path):
    in_process(tmp_path, {"steps": 2})
    refused = launch(tmp_path, {"steps": 4, "workers": 0, "d_model": 32})
    assert refused.returncode == 1
    error = summary(tmp_path)["error"]
    assert error["type"] == "ResumeError" and error["stage"] == "resume"
    assert "d_model: 16 -> 32" in error["message"]


def test_kill_after_first_checkpoint_leaves_it_complete(tmp_path):
    died = launch(tmp_path, {"workers": 0}, every=2, KCHAIN_FAULT="kill_after_checkpoint=1")
    assert died.returncode == KILLED
    run = in_process(tmp_path, {"steps": 3})
    assert run.resumed_from == 2


def test_sigterm_stops_after_the_step_saves_and_exits_75(tmp_path):
    # Popen by hand: the test signals the child while it runs (each step stalled 0.2 s).
    (tmp_path / "cfg.json").write_text(json.dumps(config({"workers": 0, "steps": 200})))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    env.update(KCHAIN_ROOT=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]),
               PYTHONUNBUFFERED="1", KCHAIN_FAULT="stall_step=0.2")
    with subprocess.Popen([sys.executable, "-m", "kchain.runtime.launch", str(tmp_path / "cfg.json")],
                          env=env, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("[kchain] step 2/"):
                child.send_signal(signal.SIGTERM)
                break
        rest = child.stdout.read()
        assert child.wait(timeout=CHILD_TIMEOUT_S) == layout.EXIT_SAVED_NOT_DONE  # saved, not done
    assert "received SIGTERM" in rest
    got = summary(tmp_path)
    assert got["status"] == "interrupted" and 2 <= got["step"] < 200
    assert got["checkpoint"] == f"kchain/checkpoints/{layout.checkpoint_name(got['step'])}"
