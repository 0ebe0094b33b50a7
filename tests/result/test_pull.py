"""`kchain pull` against the emulator: a state version made by the checkpointer itself (no notebook),
uploaded with the official client, pulled back as a plain folder and compared tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from emulator_helpers import USER, emulator, kaggle_api, wait_dataset_ready  # noqa: F401  (fixtures)
from helpers import error_line, invoke
from safetensors.torch import load_file

from kchain.cli import cli
from kchain.common import atomic, keepbest, layout, statefolder, summary
from kchain.common.faults import Faults
from kchain.common.trace import Trace
from kchain.errors import KchainError
from kchain.kaggle.client import KaggleClient
from kchain.kaggle.datasets import write_dataset_metadata
from kchain.result.pull import PULL_MARK, Want, pull
from kchain.runtime import ladder
from kchain.runtime.checkpoint.checkpointer import Checkpointer, Policy, Where
from kchain.runtime.distributed import Ranks
from kchain.runtime.frameworks import tensorboard
from kchain.runtime.progress import Progress

NAME = "pulljob"


def job_file(tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.py").write_text("def main(run):\n    pass\n")
    (folder / "job.yaml").write_text(f"name: {NAME}\ncode: train.py\n")
    return folder / "job.yaml"


def publish_state(api, tmp_path, status: summary.StatusName, logs: bool = False) -> dict[int, torch.Tensor]:
    """A session that checkpoints steps 2-8 (best val_loss at 4, keep 1), exports, ends `status`; its end
    state uploaded as version 1 of alice/pulljob-state. Returns the model's weight at each step."""
    paths = layout.Paths.of({layout.ROOT_ENV: str(tmp_path / "session")})
    paths.kchain.mkdir(parents=True)
    where = Where(paths.checkpoints, paths.input_root, paths.scratch, paths.working, None)
    policy = Policy(NAME, {"steps": 2}, keep=1, stream=None, manifest={"params": {}, "fingerprint": "f" * 64},
                    keep_best=keepbest.Choice())
    ckpt = Checkpointer(where, policy, Ranks({}), Faults(), ladder.Rung(False, 0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ckpt.track("model", model)
    ckpt.track("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    progress, trace, weights = Progress(), Trace(paths.metrics, writes=True), {}
    for step, val in {2: 0.5, 4: 0.3, 6: 0.4, 8: 0.6}.items():
        with torch.no_grad():
            model[0].weight.mul_(1.5)
        progress.step = step
        trace.log(step, {"loss": 1.0 / step, "val_loss": val})
        if logs and step == 8:  # the chain's TensorBoard log, carried in the newest checkpoint as run.tensorboard_dir's
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(tmp_path / "tb") as tb:
                for s in (2, 4, 6, 8):
                    tb.add_scalar("loss", 1.0 / s, s)
            ckpt.attach(tensorboard.GROUP, tmp_path / "tb")
        ckpt.save(progress, trace)
        ckpt.writer.wait()
        weights[step] = model[0].weight.detach().clone()
    trace.close()
    (paths.export / "tok").mkdir(parents=True)
    (paths.export / "config.json").write_text('{"hidden": 4}\n')
    (paths.export / "tok" / "vocab.txt").write_text("a\nb\n")
    summary.write(paths.summary, summary.Summary(status=status, session=1, step=8, total=8))
    state = tmp_path / "state"
    statefolder.build_state_folder(paths.kchain, state, "kernel", NAME)
    write_dataset_metadata(state, f"{USER}/{NAME}-state", f"{NAME} state")
    KaggleClient().create_dataset(state, public=False, dir_mode="skip")
    wait_dataset_ready(api, f"{USER}/{NAME}-state")  # a new dataset is hidden while it is processed
    return weights


def test_pull_best_and_final_bring_the_weights_of_those_steps(emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    weights = publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    said: list[str] = []

    best = pull(job, Want("best"), tmp_path / "best", echo=said.append)
    assert best.step == 4 and best.weights == {"model": "model.safetensors"} and best.fetched_bytes > 0
    tensors = load_file(best.folder / "model.safetensors")
    assert torch.equal(tensors["0.weight"], weights[4]) and set(tensors) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    facts = json.loads((best.folder / "metrics.json").read_text())
    assert facts["step"] == 4 and facts["metrics"] == {"loss": 0.25, "val_loss": 0.3} and facts["sessions"] == 1
    assert facts["fingerprint"] == "f" * 64 and facts["keep_best"]["step"] == 4
    assert not (best.folder / "export").exists()  # export/ is the finishing session's: --final only
    # Each file readable as any file the user writes (safetensors' own write makes a 0600 one).
    assert {p.name: p.stat().st_mode & 0o777 for p in best.folder.iterdir()} == dict.fromkeys(
        ["model.safetensors", "metrics.json", PULL_MARK], atomic.usual_mode())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(layout.TMP_PREFIX)) == []

    final = pull(job, Want("final"), tmp_path / "final", echo=said.append)
    assert final.step == 8 and torch.equal(load_file(final.folder / "model.safetensors")["0.weight"], weights[8])
    assert (final.folder / "export" / "tok" / "vocab.txt").read_text() == "a\nb\n"
    assert "pulled step 8 from alice/pulljob-state version 1" in final.lines()[0]

    assert pull(job, Want("step", 4), tmp_path / "four", echo=said.append).step == 4
    with pytest.raises(KchainError, match=r"step 6 is not in the state: alice/pulljob-state version 1 holds step 8 "
                                          r"\(the newest\) and step 4 \(the best val_loss\)"):
        pull(job, Want("step", 6), tmp_path / "six", echo=said.append)
    assert not (tmp_path / "six").exists()

    # The CLI: an existing folder is refused in one line before anything is fetched; --force replaces it.
    runner = CliRunner()
    result = runner.invoke(cli, ["pull", str(job), "--best", "-o", str(tmp_path / "final")])
    assert result.exit_code == 1
    assert result.output == f"Error: {tmp_path / 'final'} exists and is not empty: pass --force to replace it, " \
                            "or -o another folder\n"
    result = runner.invoke(cli, ["pull", str(job), "--best", "-o", str(tmp_path / "final"), "--force"])
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(tmp_path / "final" / "model.safetensors")["0.weight"], weights[4])


def test_nothing_finished_and_no_state_are_one_line_and_write_nothing(emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["pull", str(job), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "nothing to pull, alice/pulljob-state does not exist" in result.output

    publish_state(kaggle_api, tmp_path, summary.Status.DEADLINE)
    result = runner.invoke(cli, ["pull", str(job), "--final", "-o", str(tmp_path / "out")])
    last = result.output.splitlines()[-1]  # after the client's transfer bars (marker, summary)
    assert result.exit_code == 1 and last.startswith("Error: ")
    assert "nothing finished yet: alice/pulljob-state version 1 holds step 8 (the newest) and step 4" in result.output
    assert "ended deadline" in last and f"`kchain pull {job} --step 8` pulls those weights" in last
    assert not (tmp_path / "out").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(layout.TMP_PREFIX)] == []
    # The best so far is there whatever the chain's state.
    assert runner.invoke(cli, ["pull", str(job), "--best", "-o", str(tmp_path / "out")]).exit_code == 0


def test_weights_safetensors_cannot_hold_fall_back_to_a_torch_state_dict_and_say_why(tmp_path):
    from kchain.result.pull import write_weights

    odd = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)  # a dtype safetensors has no name for
    plain = torch.nn.Linear(2, 2).state_dict()
    torch.save({"tracked": {"model": plain, "quant": {"w": odd}, "optimizer": {"state": {}}}},
               tmp_path / "state.pt")
    written, note = write_weights(tmp_path / "state.pt", ["model", "quant"], tmp_path)
    assert written == {"model": "model.safetensors", "quant": "quant.state_dict.pt"}
    assert note is not None
    assert note.startswith("quant: written as quant.state_dict.pt (torch.load), not safetensors, which cannot hold it")
    assert torch.equal(load_file(tmp_path / "model.safetensors")["weight"], plain["weight"])
    assert torch.equal(torch.load(tmp_path / "quant.state_dict.pt")["w"], odd)


def test_lightnings_tracked_trainer_and_the_hf_trainers_own_files_are_the_weights(tmp_path):
    from kchain.result.pull import write_attached, write_weights

    module = torch.nn.Linear(2, 2).state_dict()
    torch.save({"tracked": {"lightning": {"trainer": {"state_dict": module, "epoch": 1}, "data": []}}},
               tmp_path / "state.pt")
    written, note = write_weights(tmp_path / "state.pt", [], tmp_path)
    assert written == {"lightning": "model.safetensors"} and note is None
    assert torch.equal(load_file(tmp_path / "model.safetensors")["bias"], module["bias"])

    raw, folder = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    folder.mkdir()
    (raw / "best.hf.model.safetensors").write_bytes(b"w")
    (raw / "best.hf.sub--config.json").write_text("{}")
    manifest = {"attached": {"hf": {"hf.model.safetensors": "model.safetensors", "hf.sub--config.json": "sub/config.json"}}}
    assert write_attached(raw, "best.", manifest, folder) == ["hf"]
    assert (folder / "hf" / "sub" / "config.json").read_text() == "{}"
    torch.save({"tracked": {"window": {"rows": []}}}, tmp_path / "hf.pt")
    assert write_weights(tmp_path / "hf.pt", [], folder, ["hf"]) == ({}, "the model is the framework's own files, under hf/")


def test_pull_logs_brings_the_chains_one_tensorboard_run_home(emulator, kaggle_api, tmp_path):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = job_file(tmp_path)
    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED, logs=True)
    result = CliRunner().invoke(cli, ["pull", str(job), "--logs", "-o", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("pulled the TensorBoard log of step 8 from alice/pulljob-state version 1 (")
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(2, 0.5), (4, 0.25), (6, 0.1667), (8, 0.125)]


def test_pull_logs_of_a_chain_that_logged_nothing_to_tensorboard_is_one_line(emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    result = CliRunner().invoke(cli, ["pull", str(job), "--logs", "-o", str(tmp_path / "runs")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {job}: alice/pulljob-state version 1 holds no TensorBoard log: ")
    assert not (tmp_path / "runs").exists()


def test_pull_never_deletes_what_it_did_not_write(emulator, kaggle_api, tmp_path):  # noqa: F811
    """`-o` over a job's folder, a plain file, someone else's folder or a pull's folder with a file added is
    refused, --force or not, naming what is there; a pull's own folder is replaced; dead pulls' scratch goes."""
    import os
    import subprocess

    job = job_file(tmp_path)
    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    folder = job.parent
    (folder / "notes.md").write_text("ideas\n")
    (folder / ".kchain").mkdir()
    (folder / ".kchain" / "sessions.json").write_text("[]\n")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    result = invoke("pull", job, "--best", "-o", folder, "--force")
    assert result.exit_code == 1
    assert error_line(result) == f"Error: {folder} is a job's folder (.kchain/, job.yaml, notes.md, train.py): a pull " \
                                 "never writes over a job or its ledger, --force or not; -o a new folder"
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before

    plain = tmp_path / "weights.bin"
    plain.write_text("mine\n")
    result = invoke("pull", job, "--best", "-o", plain, "--force")
    assert error_line(result) == f"Error: {plain} is a file, not a folder: a pull never replaces it, --force or not; " \
                                 "-o a new folder (or one an earlier pull wrote)"
    assert plain.read_text() == "mine\n"

    theirs = tmp_path / "theirs"
    (theirs / "sub").mkdir(parents=True)
    for name in "abcdef":
        (theirs / f"{name}.txt").write_text(name)
    result = invoke("pull", job, "--best", "-o", theirs, "--force")
    assert error_line(result) == f"Error: {theirs} was not written by kchain pull (a.txt, b.txt, c.txt, d.txt, e.txt " \
                                 "and 2 more): --force replaces only a pull's own folder; -o a new folder"
    assert len(list(theirs.iterdir())) == 7

    # A pull's own folder, with a file added, is refused; without it, --force replaces it. Scratch folders of
    # dead pulls beside it are removed; a live pull's (this process's) and others' are not.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live, other = (tmp_path / f".tmp-pull-{dead.pid}-best-x1", tmp_path / f".tmp-pull-{os.getpid()}-best-x2",
                          tmp_path / ".tmp-other")
    for scratch in (stale, live, other):
        (scratch / "fetched").mkdir(parents=True)
    best = tmp_path / "best"
    assert invoke("pull", job, "--best", "-o", best).exit_code == 0
    assert not stale.exists() and live.exists() and other.exists()
    mark = json.loads((best / ".kchain-pull.json").read_text())
    assert mark["files"] == ["metrics.json", "model.safetensors"] and mark["state"] == f"{USER}/{NAME}-state/1"
    (best / "notes.md").write_text("mine\n")
    result = invoke("pull", job, "--best", "-o", best, "--force")
    assert error_line(result) == f"Error: {best} holds files kchain pull did not write (notes.md): --force replaces " \
                                 "only a folder holding nothing else; move them out, or -o a new folder"
    assert (best / "notes.md").read_text() == "mine\n"
    (best / "notes.md").unlink()
    assert invoke("pull", job, "--final", "-o", best, "--force").exit_code == 0
    assert json.loads((best / "metrics.json").read_text())["step"] == 8 and (best / "export" / "config.json").is_file()


@pytest.mark.parametrize(("flags", "named"), [(("--best", "--final"), "--best and --final"),
                                              (("--best", "--step", "4"), "--best and --step"),
                                              (("--final", "--step", "4"), "--final and --step")])
def test_conflicting_choices_of_weights_are_a_usage_error_naming_both(tmp_path, flags, named):
    result = invoke("pull", job_file(tmp_path), *flags)
    assert result.exit_code == 2
    assert error_line(result) == f"Error: {named} cannot be given together: choose one"
