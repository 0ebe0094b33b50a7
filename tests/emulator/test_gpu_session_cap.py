# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Two GPU batch sessions per account (CPU sessions apart), and a push to a kernel that still runs.

Kaggle refuses a third GPU session with "Maximum batch GPU session count of 2 reached" (measured by
Unsloth's Kaggle CI, 2026-08) and creates no version; a push to a kernel whose session still runs
starts a second session beside it. `kchain push` names the sessions that hold the slots, and
refuses to push beside a running session of its own kernel. The unmodified client, the local Kaggle.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from emulator_helpers import USER, emulator, kaggle_api, write_kernel  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.store.ledger import Ledger

NAME = "blobs-classifier"
SLEEPER = ["import time\nprint('up', flush=True)\ntime.sleep(300)"]


def gpu_sessions(emu) -> list[dict]:
    return [s for s in emu.sessions() if s["gpu"]]


def wait_running(emu, ref: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while emu.session(ref, version)["status"] != "RUNNING":
        assert time.time() < deadline, emu.session(ref, version)
        time.sleep(0.1)


def test_a_third_gpu_session_is_refused_and_kchain_names_the_two_that_run(emulator, kaggle_api, tmp_path):
    twice = f"{USER}/gpu-twice"
    write_kernel(tmp_path / "twice", twice, SLEEPER, enable_gpu=True)
    assert kaggle_api.kernels_push(str(tmp_path / "twice")).error == ""
    wait_running(emulator, twice, 1)
    again = kaggle_api.kernels_push(str(tmp_path / "twice"))  # pushed again while it runs
    assert (again.error, again.version_number) == ("", 2)
    wait_running(emulator, twice, 2)
    assert emulator.session(twice, 1)["status"] == "RUNNING"  # the first runs on beside the second
    assert kaggle_api.kernels_status(twice).status.name == "RUNNING"  # the newest session only

    write_kernel(tmp_path / "third", f"{USER}/gpu-third", SLEEPER, machine_shape="NvidiaTeslaT4")
    refused = kaggle_api.kernels_push(str(tmp_path / "third"))
    assert refused.error == "Maximum batch GPU session count of 2 reached" and not refused.version_number
    assert len(emulator.sessions()) == 2
    # CPU sessions do not count against the GPU cap; they have their own (switches.Limits.max_cpu_sessions).
    for n in (1, 2, 3):
        write_kernel(tmp_path / f"cpu{n}", f"{USER}/cpu-{n}", SLEEPER)
    assert [kaggle_api.kernels_push(str(tmp_path / f"cpu{n}")).error for n in (1, 2)] == ["", ""]
    assert kaggle_api.kernels_push(str(tmp_path / "cpu3")).error == "Maximum batch CPU session count of 2 reached"
    for n in (1, 2):
        emulator.expire(f"{USER}/cpu-{n}", 1)
        emulator.wait_session(f"{USER}/cpu-{n}", 1)

    job = copy_job("classifier", tmp_path, params={"steps": 5, "rows": 4000, "num_workers": 0})
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 7, result.output
    assert error_line(result) == (
        f"Error: Kaggle refused the push of {USER}/{NAME}: Maximum batch GPU session count of 2 reached; running "
        f"now: {twice} v2 (running) and 1 more: an older session of a kernel pushed again while it ran, which "
        f"Kaggle's status does not show; wait until one ends, or stop one on its page "
        f"(https://www.kaggle.com/code/{twice}), then run `kchain push {job}` again")
    assert [s["status"] for s in Ledger(Path(os.environ["KCHAIN_HOME"])).sessions(NAME)] == ["FAILED_TO_PUSH"]
    assert len(gpu_sessions(emulator)) == 2

    # The job's own kernel runs a session kchain did not start: a push would run a second one beside it.
    emulator.expire(twice, 1)
    emulator.wait_session(twice, 1)
    write_kernel(tmp_path / "by-hand", f"{USER}/{NAME}", SLEEPER, enable_gpu=True)
    assert kaggle_api.kernels_push(str(tmp_path / "by-hand")).error == ""
    wait_running(emulator, f"{USER}/{NAME}", 1)
    beside = invoke("push", job, "--skip-smoke")
    assert beside.exit_code == 8, beside.output
    assert error_line(beside) == (
        f"Error: {USER}/{NAME} version 1 is running on Kaggle: a push now would start a second session beside it "
        f"(Kaggle runs and bills both); let it end, or stop it on its page (https://www.kaggle.com/code/{USER}/{NAME}), "
        f"then run `kchain push {job}` again")
    assert len(gpu_sessions(emulator)) == 3
    for session in emulator.live_sessions():
        emulator.expire(session["kernel"], session["version"])
