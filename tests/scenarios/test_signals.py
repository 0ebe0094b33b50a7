"""kchain ended by a signal (`kill <pid>`, `timeout`, a closed terminal) stops what it started.

A smoke's notebooks and a rehearsal's reference run and sessions run in processes of their own (a
session in a process group of its own, as the emulator starts it). SIGTERM to kchain alone used to end
it at once, without its `finally` blocks, and leave those processes training for minutes. Each test
waits for an event (two training processes alive), signals, then checks every process kchain had
started is gone. The steps are slowed by the runtime's `stall_step` fault so both still train when the
signal comes, whatever the machine's speed.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from helpers import REPO

from kchain.common import layout

STALL = "stall_step=0.2"  # at most 5 steps/s: the smoke's 50 and 100 steps take 10 and 20 s at least


def _job(tmp_path: Path) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(REPO / "tests" / "runtime_jobs" / "chain_job.py", folder / "train.py")
    spec = {"name": "signalled", "code": "train.py", "params": {"shape": "steps", "seed": 3, "steps": 100_000},
            "smoke": {"steps": 50}, "kaggle": {"accelerator": "gpu"}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder / "job.yaml"


def _training(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in root.children(recursive=True):
        try:
            if "kchain.runtime.launch" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("command", ["smoke", "rehearse"])
def test_kchain_ended_by_sigterm_leaves_no_process_behind(tmp_path, monkeypatch, command):
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    monkeypatch.setenv(layout.HOME_ENV, str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "kchain.cli", command, str(_job(tmp_path)), "--ranks", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kchain = psutil.Process(proc.pid)
    polls = 0
    while len(_training(kchain)) < 2 and proc.poll() is None and polls < 3000:  # smoke: the reference and the
        time.sleep(0.1)                                                         # run; rehearse: the reference
        polls += 1                                                              # and session 1
    assert proc.poll() is None and len(_training(kchain)) >= 2, "two training processes never ran side by side"
    started = kchain.children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=300)
    _gone, alive = psutil.wait_procs(started, timeout=60)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
    assert code == 128 + signal.SIGTERM  # the shell's convention for a process ended by a signal
