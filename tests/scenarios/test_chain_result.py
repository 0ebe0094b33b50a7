"""The chain's result, whatever shape the chain took (issues 56 and 61): a chain of one session, a chain whose
session was killed right after saving the final step, and a chain continued and then pulled on laptops that
never saw it. Against the local Kaggle (strict defaults, internet off: the laptop relays every state, the last
one too), the weights `pull --best` and `pull --final` bring home are compared tensor by tensor with the
chain's own checkpoint of that step, and continue, status, runs and pull name the same best."""

# ruff: noqa: F811
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from emulator_helpers import USER, emulator  # noqa: F401  (fixture)
from helpers import STALL, copy_job, invoke
from safetensors.torch import load_file
from test_chain import ROOMY
from test_chain_shapes import hints, run_each

from kchain.chain.advance import watch
from kchain.chain.outcome import best_words
from kchain.common import layout
from kchain.emulator.sessions import CHECKPOINT_KILL
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger

NAME = "tinygpt-notes"
KERNEL = f"{USER}/{NAME}"
STATE = f"{USER}/{NAME}-state"
TINY = {"steps": 20, "eval_every": 10, "batch": 8, "accumulate": 1, "n_notes": 2000}
# A checkpoint (and a validation, so the kept best follows it) every 10 of the 20 steps.
CADENCE = {**ROOMY, "checkpoint_every": "10 steps"}


def tiny_job(tmp_path: Path) -> Path:
    return copy_job("tinygpt", tmp_path, params=TINY, train=CADENCE)


def chain_to_the_end(path: Path, before_each=None, lines: list[str] | None = None) -> str:
    """`continue --watch` on this laptop (in-process, polling fast) until the chain ends; its last line (every
    line it said in `lines`, when given)."""
    lines = [] if lines is None else lines
    done = watch(load_job(path), Ledger(Path(os.environ["KCHAIN_HOME"])), KaggleClient(), skip_smoke=True,
                 echo=lines.append, poll_s=0.2, max_poll_s=1.0, before_each=before_each)
    assert done.action == "finished", lines
    return done.message


def weights_at(emu, step: int) -> dict[str, torch.Tensor]:
    """The model's tensors in the chain's own checkpoint of `step`, from a session's output on the local Kaggle."""
    for session in emu.sessions():
        folder = emu.session_output_dir(session["id"]) / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / \
            layout.checkpoint_name(step)
        if session["kernel"] == KERNEL and (folder / layout.MANIFEST).is_file():
            return torch.load(folder / layout.STATE_FILE, map_location="cpu", weights_only=False)["tracked"]["model"]
    raise AssertionError(f"no session's output holds step {step}")


def pulled(path: Path, which: str, out: Path, emu) -> dict:
    """`kchain pull --best|--final`, its weights equal to the chain's checkpoint of that step; its metrics.json."""
    result = invoke("pull", path, f"--{which}", "-o", out)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    got, want = load_file(out / "model.safetensors"), weights_at(emu, metrics["step"])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    return metrics


def best_named(path: Path) -> str:
    """The kept best as `kchain status` names it, the same as `kchain runs` (text and --json)."""
    status, runs = invoke("status", path), invoke("runs", path)
    best = [line for line in status.output.splitlines() if line.startswith("best: ")]
    assert len(best) == 1 and best[0] in runs.output.splitlines(), (status.output, runs.output)
    kept = json.loads(invoke("runs", path, "--json").output)["kept_best"]
    assert best[0].startswith(f"best: {best_words(kept)} (train.keep_best), in {STATE} version ")
    return best_words(kept)


def test_a_chain_of_one_session_publishes_its_end_and_pulls_it(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, STALL)
    path = tiny_job(tmp_path)
    pushed = invoke("push", path, "--skip-smoke")
    assert pushed.exit_code == 0
    watched: list[str] = []
    said = chain_to_the_end(path, lines=watched)
    # Internet off: the laptop published the end state (version 2) before saying the chain is complete.
    assert said.startswith("training is complete: 20/20 steps, best val_loss ")
    assert said.endswith(f"final weights (step 20) in {STATE} version 2: `kchain pull {path} --final`"), said
    assert [v["notes"] for v in emulator.dataset_versions(STATE)][1:] == ["kchain session 1 step 20"]
    again = invoke("continue", path)  # exactly once: a rerun finds it published
    assert again.exit_code == 0 and again.output.splitlines()[-1] == said, again.output
    assert len(emulator.dataset_versions(STATE)) == 2

    best = best_named(path)
    assert f", best {best};" in said
    metrics = pulled(path, "best", tmp_path / "best", emulator)
    assert best_words({**metrics["keep_best"]}) == best and metrics["step"] == metrics["keep_best"]["step"]
    final = pulled(path, "final", tmp_path / "final", emulator)
    assert final["step"] == 20 and final["chain_status"] == "finished"
    # Item 7: each command these messages tell the user to run works from here.
    told = hints(pushed.output, *watched, again.output, invoke("status", path).output, invoke("runs", path).output)
    assert len(told) >= 2 and run_each(told, tmp_path), told


def test_a_chain_killed_right_after_its_final_checkpoint_is_complete_for_pull_final(tmp_path, emulator, monkeypatch):
    # Session 1 stops at its deadline after 10 steps; session 2 is killed right after it saved step 20 (the
    # last), before any summary; session 3 resumes at step 20 and ends with nothing left to train.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    path = tiny_job(tmp_path)
    assert invoke("push", path, "--skip-smoke").exit_code == 0

    def kill_session_2(n: int) -> None:
        emulator.faults.kill_after_checkpoint = n == 2

    said = chain_to_the_end(path, kill_session_2)
    chain = Ledger(Path(os.environ["KCHAIN_HOME"])).sessions(NAME)
    assert [s["session"] for s in chain] == [1, 2, 3]
    assert CHECKPOINT_KILL in (emulator.session(KERNEL, 2)["failure_message"] or "")
    assert chain[2]["summary"] is not None
    assert chain[2]["resumes_at"] == 20 and chain[2]["summary"]["status"] == "finished"
    # Nothing new to publish: the version session 3 resumed from holds the final step.
    assert said.endswith(f"final weights (step 20) in {STATE} version 3: `kchain pull {path} --final`"), said
    assert len(emulator.dataset_versions(STATE)) == 3
    final = pulled(path, "final", tmp_path / "final", emulator)
    assert final["step"] == 20 and final["chain_status"] == "finished"
    best = best_named(path)
    assert best_words(pulled(path, "best", tmp_path / "best", emulator)["keep_best"]) == best


def another_laptop(tmp_path: Path, name: str, path: Path, monkeypatch) -> Path:
    """A fresh HOME, kchain home and folder holding a copy of the job (its code and job.yaml only)."""
    home = tmp_path / name
    (home / ".kaggle").mkdir(parents=True)
    for var, value in (("HOME", home), ("KCHAIN_HOME", home / "kchain"), ("KAGGLE_CONFIG_DIR", home / ".kaggle")):
        monkeypatch.setenv(var, str(value))
    folder = shutil.copytree(path.parent, home / "work" / path.parent.name)
    return Path(folder) / path.name


def test_a_chain_continued_and_pulled_on_laptops_that_never_saw_it(tmp_path, emulator, monkeypatch):
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    path = tiny_job(tmp_path)
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(KERNEL, 1)

    # Laptop B never saw session 1: status rebuilds it from Kaggle, and B chains on to the end.
    other = another_laptop(tmp_path, "b", path, monkeypatch)
    seen = invoke("status", other)
    assert seen.exit_code == 0 and "no session yet" not in seen.output, seen.output
    assert seen.output.splitlines()[1].split()[:3] == ["1", "1", "COMPLETE"], seen.output
    said = chain_to_the_end(other)
    assert said.endswith(f"final weights (step 20) in {STATE} version 3: `kchain pull {other} --final`"), said

    # Laptop C never saw any of it: every command sees the chain of 2 sessions, and says what B said.
    third = another_laptop(tmp_path, "c", path, monkeypatch)
    status = invoke("status", third)
    assert status.exit_code == 0, status.output
    assert [line.split()[0] for line in status.output.splitlines()[1:3]] == ["1", "2"], status.output
    assert "nothing is running: the chain has ended: session 2 finished at step 20/20" in status.output
    assert f"final: step 20 (finished), in {STATE} version 3: `kchain pull {third} --final`" in status.output
    assert "[kchain] session 2 is COMPLETE" in invoke("logs", third).output
    budget = invoke("budget", third).output
    assert f"{NAME} session 1" in budget and f"{NAME} session 2" in budget, budget
    done = invoke("continue", third)
    assert done.exit_code == 0 and done.output.splitlines()[-1] == said.replace(str(other), str(third)), done.output
    assert len(emulator.dataset_versions(STATE)) == 3  # nothing relayed twice
    best = best_named(third)
    assert best_words(pulled(third, "best", tmp_path / "best", emulator)["keep_best"]) == best
    assert pulled(third, "final", tmp_path / "final", emulator)["step"] == 20
    told = hints(status.output, done.output, invoke("runs", third).output)  # laptop C's, naming its job file
    assert told and all(str(third) in command for command in told) and run_each(told, tmp_path), told
