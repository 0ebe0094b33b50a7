"""The smoke's held resume (runtime/launch.py `released`) and the training child's quick exit.

Real `python -m kchain.runtime.launch` children: a run SIGKILLed after its checkpoint, then a fresh
process started at a gate, which must read nothing of the working dir until it is told `go`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from kchain.common import layout
from kchain.runtime.launch import GATE_NOTE

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
CHILD_TIMEOUT_S = 120  # a hung child fails the test instead of hanging CI
PARAMS = {"d_model": 16, "steps": 4, "workers": 0, "accumulate": 2, "dropout": 0.2, "lr": 0.01}


def start(root: Path, code_dir: Path = JOBS, entry: str = "tiny_job:main",
          env: Mapping[str, str] | None = None) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "job": "tiny", "entry": entry, "params": PARAMS, "fingerprint": "f00d", "kchain_version": "0.1.0",
        "train": {"checkpoint_every": {"steps": 2}, "keep": 2, "heartbeat_s": 0},
    }))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KCHAIN_")}
    child_env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(code_dir)]),
                     PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "kchain.runtime.launch", str(cfg)], env=child_env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def killed_at_its_checkpoint(root: Path) -> dict[str, bytes]:
    """Run the tiny job until the SIGKILL after its step-2 checkpoint; every file it left, by content."""
    with start(root, env={"KCHAIN_FAULT": "kill_after_checkpoint=1"}) as child:
        child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGKILL
    return snapshot(root)


def snapshot(root: Path) -> dict[str, bytes]:
    kdir = root / layout.WORKING_DIR / layout.KCHAIN_DIR
    return {str(p.relative_to(kdir)): p.read_bytes() for p in sorted(kdir.rglob("*")) if p.is_file()}


def held(root: Path, gate: Path, pid: int | None = None,
         env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A fresh process at the gate, once it says it is waiting (what it printed so far)."""
    child = start(root, env={"KCHAIN_GATE": f"{pid or os.getpid()}:{gate}", **(env or {})})
    assert child.stdout is not None
    seen = ""
    for line in child.stdout:
        seen += line
        if GATE_NOTE in line:
            return child, seen
    child.wait(timeout=CHILD_TIMEOUT_S)
    raise AssertionError(f"the child never waited at the gate:\n{seen}")


def test_a_held_resume_reads_nothing_until_go_then_resumes_from_the_checkpoint(tmp_path):
    before = killed_at_its_checkpoint(tmp_path)
    gate = tmp_path / "gate"
    # The notebook's clock started long before the gate (a 90 s session that began at the epoch): the session
    # counts from the release, so the resume trains to its end instead of stopping at a deadline at once.
    child, _ = held(tmp_path, gate, env={layout.SESSION_START_ENV: "1.0", layout.SESSION_LIMIT_ENV: "90"})
    with child:
        assert snapshot(tmp_path) == before  # metrics, checkpoints, no summary: as the kill left them
        gate.write_text("go")
        rest, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, rest
    assert "resumed from step 2" in rest
    summary = json.loads((tmp_path / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())
    assert summary["status"] == "finished" and summary["step"] == 4 and summary["session"] == 2


def test_a_held_resume_told_to_stop_leaves_everything_as_it_was(tmp_path):
    before = killed_at_its_checkpoint(tmp_path)
    gate = tmp_path / "gate"
    child, _ = held(tmp_path, gate)
    with child:
        gate.write_text("stop")
        rest, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, rest
    assert snapshot(tmp_path) == before
    assert "[kchain]" not in rest


def test_a_held_resume_leaves_when_the_smoke_that_holds_it_is_gone(tmp_path):
    before = killed_at_its_checkpoint(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    child, _ = held(tmp_path, tmp_path / "gate", pid=gone.pid)
    with child:
        rest, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, rest
    assert snapshot(tmp_path) == before


CYCLIC_JOB = '''
class Report:
    """Writes its file when it is finalized: the code relies on __del__."""

    def __init__(self, path):
        self.path = path

    def __del__(self):
        with open(self.path, "w") as f:
            f.write("finalized at exit\\n")


def main(run):
    cycle = {"report": Report(run.working / "report.txt")}
    cycle["self"] = cycle  # only the garbage collector can free it
'''


def run_source(tmp_path: Path, module: str, source: str, **env: str) -> str:
    """Run `source` as the job's module to its end (not gated); its output, after it exited 0."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{module}.py").write_text(source)
    with start(tmp_path / "root", code_dir=tmp_path / "code", entry=f"{module}:main", env=env) as child:
        out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, out
    return out


def test_the_quick_exit_still_finalizes_the_codes_garbage_cycles(tmp_path):
    """The teardown skips the interpreter's repeated collections, not the one that runs __del__."""
    run_source(tmp_path, "cyclic", CYCLIC_JOB)
    assert (tmp_path / "root" / layout.WORKING_DIR / "report.txt").read_text() == "finalized at exit\n"


RANK_EXIT_JOB = '''
import atexit
import os

import torch


class Freed:
    def __init__(self, path):
        self.path = path

    def __del__(self):
        self.path.write_text("freed")


def main(run):
    model = run.wrap(torch.nn.Linear(2, 2))  # a DDP over a gloo group: its end must not hang the rank
    rank = os.environ["RANK"]
    cycle = {"model": model, "freed": Freed(run.working / f"freed-{rank}.txt")}
    cycle["self"] = cycle  # only a collection would free the DDP (and its group) with it
    atexit.register((run.working / f"rank-{rank}.txt").write_text, "exit handler ran\\n")
'''


def test_each_rank_of_two_runs_its_exit_handlers_and_never_frees_its_process_group(tmp_path):
    """A rank leaves with os._exit after the other exit handlers (launch._quick_teardown): freeing its gloo group
    from Python can deadlock with a gloo thread waiting for the GIL (a finished 2-rank resume hung so)."""
    run_source(tmp_path, "ranked", RANK_EXIT_JOB, KCHAIN_RANKS="2")
    working = tmp_path / "root" / layout.WORKING_DIR
    for rank in (0, 1):
        assert (working / f"rank-{rank}.txt").read_text() == "exit handler ran\n"
        assert not (working / f"freed-{rank}.txt").exists()  # the cycle holding the DDP was never collected


ONE_BATCH_LOADER_JOB = '''
import gc

import torch
from torch.utils.data import DataLoader, TensorDataset


def main(run):
    gc.disable()  # no automatic collection: the garbage below waits for the loop's start
    data = TensorDataset(torch.arange(32.0).reshape(16, 2))
    peek = DataLoader(data, batch_size=4, shuffle=True)  # one batch for a check, then dropped
    holder = {"loader": peek}
    holder["self"] = holder  # in a cycle: only the garbage collector frees it
    run.check(batch=next(iter(peek))[0])
    del peek, holder
    w = torch.zeros(2, requires_grad=True)
    opt = run.optimize(torch.optim.SGD([w], lr=0.1))
    for step in run.steps(2):
        opt.backward((w - step).pow(2).sum())
        opt.step()
        run.log(loss=float(w.sum()))
'''


def test_a_dropped_one_batch_loader_is_not_named_as_a_plain_loader(tmp_path):
    """The loop's start collects garbage before it names hand-built DataLoaders."""
    out = run_source(tmp_path, "peek", ONE_BATCH_LOADER_JOB)
    summary = json.loads((tmp_path / "root" / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.SUMMARY).read_text())
    assert summary["status"] == "finished" and not summary.get("not_exact"), summary
    assert "not exact" not in out
