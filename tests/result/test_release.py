"""`kchain release` against the emulator: a model version sent exactly once under lost answers and
connection resets, attachable by a later job's `kaggle.models`; a slug Kaggle refuses is one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from emulator_helpers import USER, emulator, kaggle_api, wait_dataset_ready  # noqa: F401  (fixtures)
from test_pull import job_file, publish_state

from kchain.cli import cli
from kchain.common import summary
from kchain.errors import KaggleError
from kchain.kaggle.client import KaggleClient, missing
from kchain.kaggle.models import model_problem
from kchain.result.pull import Want
from kchain.result.release import release

INSTANCE = f"{USER}/tiny-pull/pytorch/default"


def test_a_release_under_resets_and_lost_answers_leaves_one_version_each_time(emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    said: list[str] = []
    client = KaggleClient()

    emulator.faults.reset_after_acting = 2  # the model's creation and the variation's both act, then reset
    lines = release(job, Want("best"), INSTANCE, None, False, "Apache 2.0", said.append, client)
    assert emulator.faults.resets == 2 and emulator.model_versions(INSTANCE) == [1]
    assert lines == [f"released step 4 as {INSTANCE}/1 (private)",
                     f"attach it: kaggle.models: [{INSTANCE}/1]   (kernel-metadata.json: \"model_sources\": "
                     f"[\"{INSTANCE}/1\"])"]
    card = kaggle_api.model_get(f"{USER}/tiny-pull")
    assert card.is_private and "Weights of step 4 (best): loss 0.25, val_loss 0.3." in card.description
    assert "- sessions: 1" in card.description and "code fingerprint: " + "f" * 64 in card.description

    emulator.faults.rate_lost_answer = 1.0  # every creating call acts, then answers 500
    lines = release(job, Want("final"), INSTANCE, None, False, "Apache 2.0", said.append, client)
    emulator.faults.rate_lost_answer = 0.0
    assert emulator.model_versions(INSTANCE) == [1, 2] and lines[0] == f"released step 8 as {INSTANCE}/2 (private)"
    assert any("the answer to versioning" in line and "it landed" in line for line in said)

    # A later job pins the released version: the check `kchain push` and doctor make finds it.
    assert model_problem(client, f"{INSTANCE}/2") is None
    files = sorted(p.name for p in emulator.store.model_files_dir(
        "alice/tiny-pull/pytorch/default", 2).iterdir())
    assert files == ["export", "metrics.json", "model.safetensors"]
    assert json.loads((emulator.store.model_files_dir("alice/tiny-pull/pytorch/default", 1) / "metrics.json")
                      .read_text())["step"] == 4


def test_a_model_slug_kaggle_refuses_is_one_line_and_creates_nothing(emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    result = CliRunner().invoke(cli, ["release", str(job), "--model", f"{USER}/Tiny_GPT/pytorch/default"])
    assert result.exit_code == 2
    assert result.output == (f"Error: --model '{USER}/Tiny_GPT/pytorch/default': Kaggle refuses the model slug "
                             "'Tiny_GPT'; use 3-50 lowercase letters, digits and single dashes inside, e.g. --model "
                             "alice/tiny-gpt/pytorch/default\n")
    assert emulator.store.data.get("model_cards", {}) == {}


def test_a_new_version_is_not_mountable_while_processed_and_a_missing_model_reads_as_forbidden(emulator, tmp_path):  # noqa: F811
    client = KaggleClient()
    assert not client.model_exists(f"{USER}/nothing-here")
    with pytest.raises(KaggleError) as e:
        client.model_versions(f"{USER}/nothing-here/pytorch/default")
    assert missing(e.value) and "403" in str(e.value)
    emulator.faults.processing_s = 3600.0  # processed long after this test
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "model-metadata.json").write_text(json.dumps({
        "ownerSlug": USER, "slug": "slow-model", "title": "Slow Model", "isPrivate": True, "description": "d"}))
    client.create_model(folder)
    (folder / "model-instance-metadata.json").write_text(json.dumps({
        "ownerSlug": USER, "modelSlug": "slow-model", "instanceSlug": "default", "framework": "pytorch",
        "licenseName": "Apache 2.0"}))
    client.create_model_instance(folder)
    instance = f"{USER}/slow-model/pytorch/default"
    assert emulator.model_versions(instance) == [1] and client.model_versions(instance) == []
    assert model_problem(client, f"{instance}/1") is not None  # a push would list it as an invalid source


def test_best_and_final_together_are_a_usage_error_naming_both(tmp_path):
    result = CliRunner().invoke(cli, ["release", str(job_file(tmp_path)), "--best", "--final", "--model", INSTANCE])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == "Error: --best and --final cannot be given together: choose one"


def test_the_chains_own_datasets_are_refused_in_one_line_and_another_dataset_is_sent_once(  # noqa: F811
        emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    for suffix, what in (("-state", "state"), ("-cache", "cache"), ("-pip", "pip")):
        result = CliRunner().invoke(cli, ["release", str(job), "--best", "--dataset", f"{USER}/pulljob{suffix}"])
        assert result.exit_code == 2
        assert result.output == (f"Error: --dataset {USER}/pulljob{suffix}: that is the chain's own {what} dataset, "
                                 f"which pull and continue read; release to another, e.g. --dataset "
                                 f"{USER}/pulljob-model\n")
    assert sum(emulator.calls.values()) == 0  # refused before any call to Kaggle

    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    ref = f"{USER}/pulljob-model"
    first = CliRunner().invoke(cli, ["release", str(job), "--best", "--dataset", ref])
    assert first.exit_code == 0 and f"released step 4 as dataset {ref} version 2" in first.output, first.output
    again = CliRunner().invoke(cli, ["release", str(job), "--best", "--dataset", ref])
    assert again.exit_code == 0 and (f"step 4 is released already as dataset {ref} version 2, these same weights: "
                                     f"nothing sent (`kchain release {job} --best --dataset {ref} --new` publishes "
                                     "them again)") in again.output
    assert [v["notes"] for v in emulator.dataset_versions(ref)] == ["Initial release", "kchain release"]


def test_a_release_killed_after_its_creating_call_settles_on_the_rerun_and_is_never_sent_twice(
        emulator, kaggle_api, tmp_path):  # noqa: F811
    job = job_file(tmp_path)
    publish_state(kaggle_api, tmp_path, summary.Status.FINISHED)
    emulator.faults.processing_s = 3600.0  # the new variation stays unlisted: the release waits for it
    command = [sys.executable, "-c", "from kchain.cli import main; main()", "release", str(job), "--best",
               "--model", INSTANCE]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while emulator.model_versions(INSTANCE) != [1]:  # its creating call acted (version 1, processing)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
    finally:
        proc.kill()  # SIGKILL: no handler runs, the ledger holds what it recorded before the send
        out = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL and "released" not in out, out  # killed before it settled
    emulator.settle(INSTANCE)  # processed now

    said: list[str] = []
    attach = f"attach it: kaggle.models: [{INSTANCE}/1]   (kernel-metadata.json: \"model_sources\": [\"{INSTANCE}/1\"])"
    again = [f"step 4 is released already as {INSTANCE}/1 (private), these same weights: nothing sent (`kchain "
             f"release {job} --best --model {INSTANCE} --new` publishes them again)", attach]
    assert release(job, Want("best"), INSTANCE, None, False, "Apache 2.0", said.append) == again
    assert any("was sent and never settled" in line for line in said)
    assert release(job, Want("best"), INSTANCE, None, False, "Apache 2.0", said.append) == again  # after a finish
    assert emulator.model_versions(INSTANCE) == [1] and emulator.calls["CreateModelInstance"] == 1
    assert emulator.calls["CreateModelInstanceVersion"] == 0
    emulator.faults.processing_s = 0.0
    lines = release(job, Want("best"), INSTANCE, None, False, "Apache 2.0", said.append, new=True)
    assert lines[0] == f"released step 4 as {INSTANCE}/2 (private)" and emulator.model_versions(INSTANCE) == [1, 2]


def test_an_over_long_licence_name_is_refused_naming_the_bound_before_anything_is_sent(tmp_path):
    result = CliRunner().invoke(cli, ["release", str(job_file(tmp_path)), "--model", INSTANCE,
                                      "--license", "x" * 100_000])
    assert result.exit_code == 2
    assert result.output == ("Error: --license '" + "x" * 40 + "'...: is 100000 characters; a licence name is at "
                             "most 100 characters on one line (kchain's bound: Kaggle publishes none, and its names "
                             "are short), e.g. --license 'Apache 2.0'\n")
