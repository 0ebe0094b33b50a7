# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""The public catalogue: objects a workflow reads but does not own, seeded from a folder laid out in the files
Kaggle's own client writes (docs/emulator.md, "A public catalogue"), read back through the unmodified client."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import requests
from emulator_helpers import fake_key
from kaggle_suite import FIXTURE, USER

from kchain.emulator import Emulator
from kchain.errors import KchainError

KCHAIN = Path(sys.executable).parent / "kchain"


def _client(monkeypatch, emu: Emulator, user: str):
    from kaggle.api.kaggle_api_extended import KaggleApi

    for name, value in emu.env(user).items():
        monkeypatch.setenv(name, value)
    api = KaggleApi()
    api.authenticate()
    return api


def test_a_catalogue_serves_others_kernels_datasets_and_models_and_is_seeded_once(tmp_path, monkeypatch):
    users = {USER: fake_key(), "alice": fake_key()}
    with Emulator(tmp_path / "kaggle", users=users, catalogue=FIXTURE) as emu:
        api = _client(monkeypatch, emu, "alice")
        [kernel] = api.kernels_list(user="stevemessick", language="python", sort_by="dateCreated")
        assert (kernel.ref, kernel.total_votes) == ("stevemessick/a-public-notebook", 3)
        assert api.kernels_list(user="stevemessick", language="r") == []
        files, _ = api.kernels_output("kerneler/sqlite-global-default", str(tmp_path / "out"))
        assert sorted(Path(f).name for f in files) == ["results.csv", "sqlite-global-default.log"]
        assert (tmp_path / "out" / "results.csv").read_text() == "id,value\n1,0.5\n"
        [listed] = api.kernels_list_files("kerneler/sqlite-global-default").files
        assert (listed.name, listed.size) == ("results.csv", 15)

        top = api.dataset_list(sort_by="votes")[0]
        assert (top.ref, top.vote_count, top.total_bytes) == (f"{USER}/most-voted-dataset", 1000, 26)
        tables = api.dataset_list(license_name="other", file_type="bigQuery")
        assert len(tables) == 12 and {d.ref.split("/")[0] for d in tables} == {"bigquery"}
        assert [d.ref for d in api.dataset_list(file_type="csv")] == [top.ref]
        assert api.dataset_list(license_name="cc", file_type="bigQuery") == []
        api.dataset_download_files(f"{USER}/most-voted-dataset/1", str(tmp_path / "dl"))
        assert (tmp_path / "dl" / "most-voted-dataset.zip").exists()

        bert = api.model_get("keras/bert")
        assert (bert.id, bert.title, bert.author) == (2819, "BERT", "keras")
        # The fields Kaggle's backend tests name are sent, not only defaulted by the SDK's objects.
        [bert_file] = api.model_instance_version_files("keras/bert/keras/bert_base_en/1").files
        for obj, names in ((top, api.dataset_fields), (bert, api.model_fields), (bert_file, api.model_file_fields)):
            assert [n for n in names if getattr(obj, api.camel_to_snake(n)) in (None, "")] == []
        assert [m.ref for m in api.model_list()] == ["keras/bert"]
        [variation] = api.model_instances_list("keras/bert").instances
        assert (variation.slug, variation.framework.name, variation.version_number) == \
            ("bert_base_en", "MODEL_FRAMEWORK_KERAS", 1)
        archive = api.model_instance_version_download("keras/bert/keras/bert_base_en/1", str(tmp_path / "m"))
        with tarfile.open(archive) as tar:
            assert tar.extractfile("config.json").read() == b'{"layers": 12}\n'  # type: ignore[union-attr]
    with Emulator(tmp_path / "kaggle", users=users) as emu:  # a restart keeps what the run left
        assert emu.add_catalogue(FIXTURE) == {"kernels": 0, "datasets": 0, "models": 0}
        api = _client(monkeypatch, emu, USER)
        api.dataset_delete(USER, "most-voted-dataset", no_confirm=True)
        assert emu.add_catalogue(FIXTURE) == {"kernels": 0, "datasets": 0, "models": 0}  # deleted stays deleted
        with pytest.raises(requests.HTTPError) as info:
            api.dataset_status(f"{USER}/most-voted-dataset")
        assert info.value.response is not None and info.value.response.status_code == 403


def test_a_model_of_the_catalogue_is_not_anyone_elses_to_delete(tmp_path, monkeypatch):
    with Emulator(tmp_path / "kaggle", users={"alice": fake_key()}, catalogue=FIXTURE) as emu:
        api = _client(monkeypatch, emu, "alice")
        with pytest.raises(requests.HTTPError) as info:
            api.model_delete("keras/bert", no_confirm=True)
        assert info.value.response is not None and info.value.response.status_code == 403
        assert api.model_get("keras/bert").id == 2819


def test_a_malformed_catalogue_is_one_line_naming_its_file(tmp_path):
    catalogue = tmp_path / "catalogue"
    shutil.copytree(FIXTURE, catalogue)
    (catalogue / "kernels/stevemessick/a-public-notebook/a-public-notebook.ipynb").unlink()
    meta = catalogue / "kernels/stevemessick/a-public-notebook/kernel-metadata.json"
    with pytest.raises(KchainError) as info:
        Emulator(tmp_path / "kaggle", users={"alice": fake_key()}, catalogue=catalogue)
    assert str(info.value) == (f"{meta}: code_file 'a-public-notebook.ipynb' is not a file beside it; put the "
                               "kernel's code there (kaggle kernels pull -m writes both)")
    (catalogue / "datasets/bigquery/public-table-01/2").mkdir()
    shutil.rmtree(catalogue / "kernels")
    with pytest.raises(KchainError, match=r"public-table-01: version folders must be 1, 2, \.\.\. without a gap, not 2"):
        Emulator(tmp_path / "kaggle2", users={"alice": fake_key()}, catalogue=catalogue)


def test_kchain_emulator_serve_seeds_the_catalogue_folder_of_its_state(tmp_path, monkeypatch):
    shutil.copytree(FIXTURE, tmp_path / "kaggle" / "catalogue")
    # (--quota-week-offset: a Limits field the Emulator once refused as a keyword)
    command = [str(KCHAIN), "emulator", "serve", "--state", str(tmp_path / "kaggle"), "--user", f"alice:{fake_key()}",
               "--quota-week-offset", "3600"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as serve:
        _read_and_ask(serve, tmp_path, monkeypatch)


def _read_and_ask(serve: subprocess.Popen, tmp_path: Path, monkeypatch) -> None:
    from kaggle.api.kaggle_api_extended import KaggleApi

    try:
        _, seeded, *exports = [serve.stdout.readline() for _ in range(9)]  # type: ignore[union-attr]
        assert seeded == f"# public catalogue seeded from {tmp_path / 'kaggle' / 'catalogue'}\n"
        for line in exports:
            name, _, value = line.removeprefix("export ").strip().partition("=")
            monkeypatch.setenv(name, value)
        api = KaggleApi()
        api.authenticate()
        assert api.model_get("keras/bert").id == 2819
    finally:
        serve.terminate()
        serve.wait(30)
