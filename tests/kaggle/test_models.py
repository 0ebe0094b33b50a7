# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Kaggle Models as inputs (`kaggle.models`): the spec, the rendered model_sources, run.input over both
mount layouts, the local Kaggle mounting and dropping model sources, the check before a push, and the
smoke's stand-in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from emulator_helpers import USER, emulator, kaggle_api, write_kernel  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.errors import SpecError
from kchain.job.render import render_job
from kchain.job.spec import load_job
from kchain.runtime import staging

GEMMA = "google/gemma/transformers/2b/1"
GOOD = "name: tune-notes\ncode: train.py\n"


def write(tmp_path: Path, kaggle: str) -> Path:
    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    path = tmp_path / "job.yaml"
    path.write_text(GOOD + f"kaggle: {kaggle}\n")
    return path


@pytest.mark.parametrize("kaggle, message", [
    ("{models: [google/gemma]}", "kaggle.models: 'google/gemma' is not a model version; write "
                                 "owner/model/framework/variation/version, e.g. google/gemma/transformers/2b/1"),
    ("{models: [google/gemma/transformers/2b/latest]}", "kaggle.models: 'google/gemma/transformers/2b/latest': the "
                                                        "version 'latest' is not a number; pin one, e.g. "
                                                        "google/gemma/transformers/2b/1"),
    ("{models: [google/gemma/torch/2b/1]}", "kaggle.models: 'torch' is not a Kaggle model framework; did you mean "
                                            "'pytorch'?"),
    ("{models: [google/Gemma/transformers/2b/1]}", "kaggle.models: 'Gemma' is not a Kaggle model slug; copy it from "
                                                   "the model's page, e.g. google/gemma/transformers/2b/1"),
    ("{models: [Google/gemma/transformers/2b/1]}", "kaggle.models: 'Google' is not a Kaggle username; use lowercase "
                                                   "letters, digits, underscores and single dashes inside"),
    ("{models: [" + GEMMA + "], local: {llama: x}}", "kaggle.local.llama: not an attached dataset or model; add it to "
                                                     "kaggle.datasets or kaggle.models, or remove it"),
])
def test_a_model_source_is_checked_like_kaggles_client_checks_it(tmp_path, kaggle, message):
    path = write(tmp_path, kaggle)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: {message}"


def test_model_sources_are_rendered_as_the_job_names_them(tmp_path):
    refs = ["google/gemma/Transformers/2b/1", "sorokin/qwen3_4b_grids15_sft139/transformers/bfloat16/3"]
    job = load_job(write(tmp_path, "{models: [" + ", ".join(refs) + "], local: {gemma: x, " + refs[1] + ": y}}"))
    assert json.loads(render_job(job, owner=USER).metadata)["model_sources"] == refs
    plain = load_job(write(tmp_path, "{}"))
    assert json.loads(render_job(plain, owner=USER).metadata)["model_sources"] == []


@pytest.mark.parametrize("mount", ["models/google/gemma/transformers/2b/1", "gemma/transformers/2b/1"])
def test_run_input_finds_a_models_version_folder_in_both_layouts(tmp_path, mount):
    inputs = tmp_path / "input"
    (inputs / mount).mkdir(parents=True)
    (inputs / mount / "config.json").write_text("{}")
    (inputs / "notes-data/other").mkdir(parents=True)  # a dataset in the legacy layout stays a dataset
    for name in ("gemma", "google/gemma", GEMMA, "google/gemma/Transformers/2b/1"):
        assert staging.find_input(name, inputs) == inputs / mount, name
    assert staging.find_input("notes-data", inputs) == inputs / "notes-data"
    with pytest.raises(FileNotFoundError) as err:
        staging.find_input("google/gemma/transformers/7b/1", inputs)
    assert re.search(r"attached: .*gemma/transformers/2b/1", str(err.value)), err.value
    with pytest.raises(FileNotFoundError, match=r"'llama' is not attached: .* attached: .*gemma/transformers/2b/1"):
        staging.find_input("llama", inputs)

    (inputs / mount).with_name("2").mkdir()  # two versions attached: the short names are ambiguous
    with pytest.raises(ValueError, match="attached in 2 versions"):
        staging.find_input("gemma", inputs)
    assert staging.find_input(GEMMA.replace("/1", "/2"), inputs) == (inputs / mount).with_name("2")


def test_the_local_kaggle_mounts_a_model_and_drops_an_unknown_one(emulator, kaggle_api, tmp_path):
    emulator.switches.queue_s = emulator.switches.boot_s = 0.0
    emulator.add_model(GEMMA, {"config.json": '{"hidden": 32}', "weights/model.bin": b"\x00\x01"})
    emulator.add_model("bob/secret/pytorch/base/1", {"w.bin": b"x"}, private=True)  # bob's own, hidden from alice
    cell = ("import os, json, pathlib\nroot = pathlib.Path(os.environ['KCHAIN_ROOT']) / 'input'\n"
            "found = sorted(str(p.relative_to(root)) for p in root.rglob('*') if p.is_file())\n"
            "pathlib.Path('inputs.json').write_text(json.dumps(found))")
    sources = ["google/gemma/Transformers/2b/1", "google/gemma/transformers/2b/9", "bob/secret/pytorch/base/1"]
    write_kernel(tmp_path / "k", f"{USER}/model-reader", [cell], model_sources=sources)
    pushed = kaggle_api.kernels_push(str(tmp_path / "k"))
    assert pushed.error == "" and pushed.version_number == 1  # pushed all the same, as for datasets
    assert pushed.invalid_model_sources == sources[1:]

    session = emulator.wait_session(f"{USER}/model-reader")
    assert session["status"] == "COMPLETE" and session["mounted"] == sources[:1]
    kaggle_api.kernels_output(f"{USER}/model-reader", str(tmp_path / "out"))
    assert json.loads((tmp_path / "out/inputs.json").read_text()) == [
        "models/google/gemma/transformers/2b/1/config.json", "models/google/gemma/transformers/2b/1/weights/model.bin"]


def test_a_rehearsal_puts_the_stand_in_on_the_local_kaggle_where_the_client_lists_its_versions(emulator, tmp_path):
    from kchain.job.inputs import local_inputs
    from kchain.kaggle.client import KaggleClient
    from kchain.local.rehearse import upload_inputs

    for version in (1, 2):
        emulator.add_model(f"google/gemma/transformers/2b/{version}", {"config.json": "{}"})
    job = load_job(small_job(tmp_path, ["google/gemma/Transformers/2b/3"], local={"gemma": "tiny"}))
    (job.root / "tiny").mkdir()
    (job.root / "tiny" / "config.json").write_text('{"hidden": 8}')
    said: list[str] = []
    upload_inputs(emulator, job, local_inputs(job, tmp_path / "cache", echo=said.append), {}, tmp_path / "up",
                  said.append)
    assert said[-1] == f"  input google/gemma/transformers/2b/3: the stand-in {job.root / 'tiny'} is on the local Kaggle"
    # Every page of the official client's listing (ListModelInstanceVersions), one version a page.
    assert KaggleClient().model_versions("google/gemma/Transformers/2b", page_size=1) == [1, 2, 3]
    files = emulator.store.model_files_dir("google/gemma/transformers/2b", 3)
    assert (files / "config.json").read_text() == '{"hidden": 8}'


def small_job(tmp_path: Path, models: list[str], **kaggle) -> Path:
    return copy_job("classifier", tmp_path, params={"steps": 10, "num_workers": 0},
                    kaggle={"models": models, **kaggle})


def test_push_and_doctor_refuse_a_model_version_that_does_not_exist(emulator, tmp_path):
    emulator.add_model(GEMMA, {"config.json": "{}"})
    job = small_job(tmp_path, ["google/gemma/transformers/2b/2"])
    result = invoke("push", job, "--skip-smoke")
    assert result.exit_code == 8, result.output
    assert error_line(result) == (f"Error: {job}: kaggle.models: model google/gemma/transformers/2b has no version 2 "
                                  "(its versions: 1); pin a version that exists")
    missing = small_job(tmp_path / "missing", ["google/no-such-model/pytorch/base/1"])
    result = invoke("push", missing, "--skip-smoke")
    assert result.exit_code == 8, result.output
    assert error_line(result) == (f"Error: {missing}: kaggle.models: model google/no-such-model/pytorch/base does "
                                  "not exist on Kaggle or is not visible to you; fix the name, or accept the model's "
                                  "terms on its Kaggle page")
    assert emulator.calls["SaveKernel"] == 0

    doctor = invoke("doctor", job, "--no-probe")
    assert doctor.exit_code == 9, doctor.output
    assert (f"FAIL  sources      model google/gemma/transformers/2b has no version 2 (its versions: 1): pin a "
            f"version that exists (kaggle.models in {job})") in doctor.output
    assert "FAIL  metadata     Kaggle calls model source google/gemma/transformers/2b/2 invalid" in doctor.output


def test_the_smoke_mounts_the_stand_in_where_kaggle_mounts_the_model_and_says_so(tmp_path):
    from kchain.local.smoke import prepare

    job = small_job(tmp_path, [GEMMA])
    refused = invoke("smoke", job, "--ranks", "1")
    assert refused.exit_code == 10
    assert error_line(refused) == (
        f"Error: {job}: kaggle.local.gemma: no local copy of model {GEMMA} for the smoke run; add kaggle.local: "
        "{gemma: path/to/a/stand-in} (a smaller model of the same architecture will do)")

    job = small_job(tmp_path / "with-stand-in", [GEMMA], local={"gemma": "tiny-gemma"})
    stand_in = job.parent / "tiny-gemma"  # a smaller model of the same architecture
    stand_in.mkdir()
    (stand_in / "config.json").write_text('{"hidden": 32}')
    said: list[str] = []
    prep = prepare(job, said.append, download=False)
    assert f"  model      {GEMMA}: stand-in {stand_in} (kaggle.local.gemma)" in said
    for sandbox in ("reference", "run", "resume"):
        inputs = prep.work / sandbox / "input"
        assert (inputs / "models/google/gemma/transformers/2b/1").resolve() == stand_in
        assert (staging.find_input("gemma", inputs) / "config.json").read_text() == '{"hidden": 32}'
