"""Chain shapes end to end (issue 56, items 3 and 7), each against the uninterrupted run.

An unattended chain (`kchain push --unattended` after the doctor saw a kernel push a kernel: each session
pushes the next, the laptop only looks) of `kchain init --template notebook`'s job is pulled (`--best`,
`--final`) and released (`--best`) on the local Kaggle (strict defaults); the weights are compared tensor
by tensor with one uninterrupted run's checkpoints of the same steps (a module-scoped reference), and
the released model version, downloaded as a user would, is what `kchain init --template inference`'s
notebook smoke-passes with. A SkyPilot and a Slurm job's state folders, after the target's own rehearsal,
pull the best and final weights of its uninterrupted run, and release the best to the local Kaggle. Every command the messages tell the user to run
next parses with kchain's CLI and names a job file that exists; the quick read-only ones are run.
"""

# ruff: noqa: F811
from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from emulator_helpers import USER, emulator  # noqa: F401  (fixture)
from helpers import STALL, invoke
from safetensors.torch import load_file

from kchain.cli import cli
from kchain.common import layout
from kchain.common.sessionstate import TERMINAL
from kchain.job.init import init_job
from kchain.job.spec import load_job
from kchain.local.rehearse import ReferenceRun
from kchain.targets.commands import result_lines
from kchain.targets.rehearsal import rehearse_target

NAME = "shape-notes"
KERNEL = f"{USER}/{NAME}"
STATE = f"{USER}/{NAME}-state"
DOCTOR = f"{USER}/{NAME}-doctor"
MODEL = f"{USER}/shape-notes-model/pytorch/default"
# 20 steps, a validation and a checkpoint every 10: each session of 10 steps (the deadline fault) ends on one.
# A high learning rate: the validation loss rises after step 10, so the kept best (10) is not the final step.
PARAMS = {"steps": 20, "eval_every": 10, "rows": 2000, "batch": 32, "lr": 0.2}
TRAIN = {"checkpoint_every": "10 steps", "keep": 2, "session_limit": "600s", "margin": "30s"}
CHAIN_S = 240  # a net for a chain that hangs, never a clock the test races


def notebook_job(folder: Path, internet: bool) -> Path:
    """`kchain init --template notebook`'s job, small: a CPU job (its kernel pushes the next session itself)."""
    init_job(folder, "notebook")
    path = folder / "job.yaml"
    data = yaml.safe_load(path.read_text())
    data["params"].update(PARAMS)
    data["kaggle"].update(accelerator="none", internet=internet)
    data["train"].update(TRAIN)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict[str, torch.Tensor]]:
    """The job's one uninterrupted run (the same notebook, no session limit): its model at each kept step."""
    top = tmp_path_factory.mktemp("uninterrupted")
    job = load_job(notebook_job(top / NAME, internet=False))
    run = ReferenceRun(job, top / "root", {}, {layout.ACCELERATOR_CHECK_ENV: "off"})
    run.start()
    _trace, summary = run.result()
    assert summary is not None and summary.status == "finished" and summary.step == 20, summary
    assert summary.best is not None and summary.best["step"] == 10, summary.best  # what the chain must keep too
    folder = top / "root" / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    kept = {int(ckpt.name.removeprefix(layout.CHECKPOINT_PREFIX)): ckpt for ckpt in folder.iterdir()
            if (ckpt / layout.MANIFEST).is_file()}
    return {step: torch.load(ckpt / layout.STATE_FILE, map_location="cpu", weights_only=False)["tracked"]["model"]
            for step, ckpt in kept.items()}


def same_as_uninterrupted(weights: Path, step: int, uninterrupted: dict) -> None:
    """A weights file equal, tensor by tensor, to the uninterrupted run's model at `step`."""
    got, want = load_file(weights), uninterrupted[step]
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert all(torch.equal(got[name], want[name]) for name in want), step


def wait_until_ended(emu, kernel: str) -> list[dict]:
    """The chain's sessions once its newest ended without pushing a successor (the kernels chain alone)."""
    deadline = time.time() + CHAIN_S
    while time.time() < deadline:
        ours = [s for s in emu.sessions() if s["kernel"] == kernel]
        if ours and all(s["status"] in TERMINAL for s in ours) and \
                ((ours[-1].get("summary") or {}).get("status") == "finished"):
            return ours
        time.sleep(0.2)
    raise AssertionError(f"the chain did not end: {[s['status'] for s in emu.sessions()]}")


# A command a message tells the user to run: `kchain ...` in backticks.
HINT = re.compile(r"`(kchain [^`]+)`")
READ_ONLY = {"status", "runs", "pull", "continue", "logs", "budget"}  # quick, and safe to run again


def hints(*outputs: str) -> list[str]:
    return sorted({m for text in outputs for m in HINT.findall(text)})


def run_each(commands: list[str], here: Path, run: bool = True) -> list[str]:
    """Each named command, parsed by kchain's own CLI; the quick read-only ones run for real (pull into a
    fresh folder) unless `run` is off. Every one names a job file that exists where the user is."""
    ran = []
    for i, command in enumerate(commands):
        argv = shlex.split(command)[1:]
        name, args = argv[0], argv[1:]
        assert name in cli.commands, command
        cli.commands[name].make_context(name, list(args))  # a usage error raises here
        jobs = [a for a in args if a.endswith(".yaml")]
        assert jobs and all(Path(j).is_file() for j in jobs), command
        if run and name in READ_ONLY:
            extra = ["-o", str(here / f"hint-{i}")] if name == "pull" else []
            done = invoke(*argv, *extra)
            assert done.exit_code == 0, (command, done.output)
            ran.append(name)
    return ran


def test_an_unattended_chain_pulls_releases_and_serves_the_uninterrupted_runs_weights(
        tmp_path, emulator, monkeypatch, uninterrupted):
    # Each session stops at its deadline after 10 steps: the kernel saves, publishes and pushes the next.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    path = notebook_job(tmp_path / NAME, internet=True)
    key = emulator.users[USER]
    emulator.secrets.update({USER: {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": key}})
    emulator.switches.kernel_may_push, emulator.switches.secrets_reset_on_push = True, False
    for ref in (DOCTOR, KERNEL):  # the user attached their Secrets to both notebooks in the web UI
        emulator.attach_secrets(ref)
    doctor = invoke("doctor", path)
    assert doctor.exit_code == 0, doctor.output
    pushed = invoke("push", path, "--unattended", "--skip-smoke")
    assert pushed.exit_code == 0, pushed.output

    chain = wait_until_ended(emulator, KERNEL)
    assert [s["pushed_from"] for s in chain] == ["laptop", "kernel"], chain
    assert chain[1]["summary"]["resumed_from"] == 10
    status = invoke("status", path)
    assert status.exit_code == 0 and "the chain has ended" in status.output, status.output

    best = invoke("pull", path, "--best", "-o", tmp_path / "best")
    assert best.exit_code == 0, best.output
    kept = json.loads((tmp_path / "best" / "metrics.json").read_text())
    assert kept["step"] == kept["keep_best"]["step"] == 10, kept
    same_as_uninterrupted(tmp_path / "best" / "model.safetensors", kept["step"], uninterrupted)
    final = invoke("pull", path, "--final", "-o", tmp_path / "final")
    assert final.exit_code == 0, final.output
    ended = json.loads((tmp_path / "final" / "metrics.json").read_text())
    assert ended["step"] == 20 and ended["chain_status"] == "finished", ended
    same_as_uninterrupted(tmp_path / "final" / "model.safetensors", 20, uninterrupted)

    released = invoke("release", path, "--best", "--model", MODEL)
    assert released.exit_code == 0, released.output
    assert released.output.splitlines()[-2] == f"released step {kept['step']} as {MODEL}/1 (private)", released.output
    again = invoke("release", path, "--best", "--model", MODEL)
    assert again.exit_code == 0 and emulator.model_versions(MODEL) == [1], again.output

    # The released version, downloaded as a user would, is the inference notebook's model in its smoke.
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    infer = tmp_path / "shape-infer"
    init_job(infer, "inference")
    api.model_instance_version_download(f"{MODEL}/1", str(infer / "released"), untar=True)
    same_as_uninterrupted(infer / "released" / "model.safetensors", kept["step"], uninterrupted)
    for name, old, new in (("job.yaml", "you/my-model/pytorch/default/1", f"{MODEL}/1"),
                           ("job.yaml", "my-model: pulled", "shape-notes-model: released"),
                           ("infer.ipynb", "you/my-model/pytorch/default/1", f"{MODEL}/1")):
        text = (infer / name).read_text()
        assert old in text, (name, old)
        (infer / name).write_text(text.replace(old, new))
    smoke = invoke("smoke", infer / "job.yaml", "--quiet", "--ranks", "1")
    assert smoke.exit_code == 0, smoke.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in smoke.output

    # Item 7: every command these messages name runs from here.
    said = hints(pushed.output, status.output, best.output, final.output, released.output, again.output,
                 invoke("continue", path).output, invoke("runs", path).output)
    assert any(c.endswith(f"--best --model {MODEL} --new") for c in said), said  # release's own, whole
    assert run_each(said, tmp_path).count("pull") >= 2, said


@pytest.mark.parametrize("target", ["slurm", "skypilot"])
def test_a_targets_state_folder_pulls_and_releases_the_uninterrupted_runs_best_and_final(tmp_path, monkeypatch,
                                                                                         emulator, target):
    # The target's own rehearsal: a SIGTERM (exit 75), a SIGKILL between a save and its publish, a fresh machine
    # to the end, beside an uninterrupted run on a bucket of its own; 12 steps, a checkpoint and a validation
    # every 4, the best at step 8 (a high learning rate: the loss rises after it).
    path = notebook_job(tmp_path / NAME, internet=False)
    data = yaml.safe_load(path.read_text())
    data["params"].update(lr=0.3, eval_every=4)
    data["smoke"]["steps"] = 4
    shared = tmp_path / "shared"  # the cluster's shared file system
    data.update(target=target, **{target: {"time": "2h", "gpus": 0, "state_dir": str(shared)} if target == "slurm"
                                  else {"bucket": {"name": "my-kchain-state", "store": "s3"}}})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    done = rehearse_target(path, target, smoke=False, echo=lambda _: None, quiet=True)
    assert done.passed, done.verdict
    bucket, alone = (done.work / folder / NAME for folder in ("bucket", "bucket-ref"))
    monkeypatch.chdir(tmp_path)
    if target == "slurm":  # its runs published to state_dir/<name>: pull reads it there, no flag
        elsewhere = invoke("pull", path, "--best", "-o", tmp_path / "best")  # a laptop without the cluster's folder
        assert elsewhere.exit_code == 1 and f"{shared / NAME} does not exist" in elsewhere.output, elsewhere.output
        run_each(hints(elsewhere.output), tmp_path, run=False)
        shutil.copytree(bucket, shared / NAME)
        said = result_lines(path, load_job(path))  # what `kchain status` says after the engine's word
        assert said[0] == f"newest published: step 12 of 12, in {shared / NAME}", said
        assert said[1].startswith("best: val_loss ") and said[1].endswith(f"at step 8 (train.keep_best), in "
                                                                         f"{shared / NAME}: `kchain pull {path} --best`")
        assert said[2] == f"final: step 12 (finished), in {shared / NAME}: `kchain pull {path} --final`", said
        asked = invoke("pull", path, "--best", "-o", tmp_path / "best")
    else:  # the bucket is not a folder here: one line says how to bring it, and the command then
        assert f"`kchain pull {path} --best --from FOLDER`" in result_lines(path, load_job(path))[0]
        refused = invoke("pull", path, "--best", "-o", tmp_path / "best")
        assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output
        [copy] = [c for c in re.findall(r"`([^`]+)`", refused.output) if c.startswith("aws ")]
        assert copy == f"aws s3 sync s3://my-kchain-state/{NAME} {NAME}-state", refused.output
        shutil.copytree(bucket, tmp_path / f"{NAME}-state")  # what that copy writes
        [asked_for] = hints(refused.output)
        asked = invoke(*shlex.split(asked_for)[1:], "-o", tmp_path / "best")
    assert asked.exit_code == 0, asked.output
    best = json.loads((tmp_path / "best" / "metrics.json").read_text())
    assert best["step"] == 8 and best["keep_best"]["step"] == 8, best
    same_as_copy(tmp_path / "best" / "model.safetensors", alone / layout.checkpoint_name(8))
    extra = [] if target == "slurm" else ["--from", f"{NAME}-state"]
    final = invoke("pull", path, "--final", "-o", tmp_path / "final", *extra)
    assert final.exit_code == 0, final.output
    ended = json.loads((tmp_path / "final" / "metrics.json").read_text())
    assert ended["step"] == 12 and ended["chain_status"] == "finished", ended
    same_as_copy(tmp_path / "final" / "model.safetensors", alone / layout.checkpoint_name(12))
    gone = invoke("pull", path, "--step", "4", "-o", tmp_path / "four", *extra)  # pruned (train.keep: 2)
    assert gone.exit_code == 1 and "step 4 is not in the state folder" in gone.output, gone.output

    # Released from the same folder to the local Kaggle: the version holds the uninterrupted run's best.
    model = f"{USER}/{target}-notes-model/pytorch/default"
    if target == "skypilot":  # without --from, the one line names release's own command, whole
        refused = invoke("release", path, "--best", "--model", model)
        assert refused.exit_code == 1 and f"`kchain release {path} --best --from {NAME}-state`" in refused.output
    released = invoke("release", path, "--best", "--model", model, *extra)
    assert released.exit_code == 0, released.output
    assert released.output.splitlines()[-2] == f"released step 8 as {model}/1 (private)", released.output
    again = invoke("release", path, "--best", "--model", model, *extra)
    assert again.exit_code == 0 and emulator.model_versions(model) == [1], again.output
    assert f"--best --model {model}{' --from ' + extra[1] if extra else ''} --new" in again.output, again.output
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    api.model_instance_version_download(f"{model}/1", str(tmp_path / "released"), untar=True)
    same_as_copy(tmp_path / "released" / "model.safetensors", alone / layout.checkpoint_name(8))


def same_as_copy(weights: Path, ckpt: Path) -> None:
    """A weights file equal, tensor by tensor, to the model in a checkpoint folder (the uninterrupted run's)."""
    want = torch.load(ckpt / layout.STATE_FILE, map_location="cpu", weights_only=False)["tracked"]["model"]
    got = load_file(weights)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), ckpt
