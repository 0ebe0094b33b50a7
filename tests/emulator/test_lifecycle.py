# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Updating, listing and deleting what a user owns (models, their variations and versions, datasets' metadata,
a kernel's output files), through the unmodified `kaggle` client over HTTP, under the strict defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from emulator_helpers import (  # noqa: F401
    USER,
    emulator,
    fake_key,
    kaggle_api,
    wait_dataset_ready,
    write_dataset,
    write_kernel,
)


def _model_folder(folder: Path, slug: str, private: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model-metadata.json").write_text(json.dumps({
        "ownerSlug": USER, "title": slug.title(), "slug": slug, "subtitle": "", "isPrivate": private,
        "description": "# A model\n", "publishTime": "", "provenanceSources": ""}))
    return folder


def _variation_folder(folder: Path, model: str, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "model-instance-metadata.json").write_text(json.dumps({
        "ownerSlug": USER, "modelSlug": model, "instanceSlug": "base", "framework": "pytorch", "overview": "",
        "usage": "", "licenseName": "Apache 2.0", "fineTunable": False, "trainingData": [],
        "modelInstanceType": "Unspecified", "baseModelInstance": "", "externalBaseModelUrl": ""}))
    return folder


def _versions(api, instance: str) -> list[int]:
    return [v.version_number for v in api.model_instance_versions_list(instance).version_list.versions]


def test_a_model_is_updated_listed_and_deleted_down_to_its_versions(emulator, kaggle_api, tmp_path):
    card = _model_folder(tmp_path / "model", "toy-model")
    assert kaggle_api.model_create_new(str(card)).ref == f"{USER}/toy-model"
    assert "already used" in kaggle_api.model_create_new(str(card)).error  # what Kaggle's own test looks for
    (card / "model-metadata.json").write_text(json.dumps({"ownerSlug": USER, "slug": "toy-model", "title": "Toy"}))
    assert kaggle_api.model_update(str(card)).error == ""
    assert kaggle_api.model_get(f"{USER}/toy-model").title == "Toy"

    instance = f"{USER}/toy-model/pytorch/base"
    kaggle_api.model_instance_create(str(_variation_folder(tmp_path / "v1", "toy-model", {"w.txt": "one"})), quiet=True)
    assert _versions(kaggle_api, instance) == []  # processing: not listed yet
    with pytest.raises(requests.HTTPError):
        kaggle_api.model_instance_files(instance)
    emulator.settle(instance)
    assert [f.name for f in kaggle_api.model_instance_files(instance).files] == ["w.txt"]  # the newest version's
    assert [(f.name, f.size) for f in kaggle_api.model_instance_version_files(f"{instance}/1").files] == [("w.txt", 3)]
    [listed] = kaggle_api.model_instances_list(f"{USER}/toy-model").instances
    assert (listed.slug, listed.framework.name, listed.version_number) == ("base", "MODEL_FRAMEWORK_PY_TORCH", 1)
    meta = json.loads((tmp_path / "v1" / "model-instance-metadata.json").read_text())
    (tmp_path / "v1" / "model-instance-metadata.json").write_text(json.dumps(dict(meta, overview="Now described")))
    assert kaggle_api.model_instance_update(str(tmp_path / "v1")).error == ""
    assert kaggle_api.model_instance_get(instance).overview == "Now described"

    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "w.txt").write_text("two!")
    kaggle_api.model_instance_version_create(instance, str(tmp_path / "v2"), quiet=True)
    emulator.settle(instance)
    assert kaggle_api.model_instance_version_delete(f"{instance}/1", no_confirm=True).error == ""
    assert _versions(kaggle_api, instance) == [2]
    kaggle_api.model_instance_version_create(instance, str(tmp_path / "v2"), quiet=True)
    emulator.settle(instance)
    assert _versions(kaggle_api, instance) == [3, 2]  # a deleted version's number is not given again
    assert kaggle_api.model_instance_delete(instance, no_confirm=True).error == ""
    with pytest.raises(requests.HTTPError) as gone:
        kaggle_api.model_instance_get(instance)
    assert gone.value.response is not None and gone.value.response.status_code == 403
    assert kaggle_api.model_delete(f"{USER}/toy-model", no_confirm=True).error == ""
    with pytest.raises(requests.HTTPError):
        kaggle_api.model_get(f"{USER}/toy-model")
    assert kaggle_api.model_create_new(str(_model_folder(tmp_path / "again", "toy-model"))).error in ("", None)


def test_a_metadata_update_that_does_not_say_private_makes_the_dataset_public(emulator, kaggle_api, tmp_path,
                                                                              monkeypatch):
    from kaggle.api.kaggle_api_extended import KaggleApi

    folder = write_dataset(tmp_path / "data", f"{USER}/secret-data", {"a.csv": "x\n1\n"})
    kaggle_api.dataset_create_new(str(folder), quiet=True)  # private: `datasets create` without --public
    wait_dataset_ready(kaggle_api, f"{USER}/secret-data")
    meta = Path(kaggle_api.dataset_metadata(f"{USER}/secret-data", str(tmp_path / "meta")))
    info = json.loads(meta.read_text())["info"]  # the client writes {"info": DatasetInfo}
    assert info.pop("isPrivate") is True
    meta.write_text(json.dumps({"info": dict(info, title="Secret data")}))
    kaggle_api.dataset_metadata_update(f"{USER}/secret-data", str(tmp_path / "meta"))
    emulator.users["bob"] = fake_key()
    monkeypatch.setenv("KAGGLE_USERNAME", "bob")
    monkeypatch.setenv("KAGGLE_KEY", emulator.users["bob"])
    bob = KaggleApi()
    bob.authenticate()
    assert [d.title for d in bob.dataset_list(user=USER)] == ["Secret data"]  # public now
    with pytest.raises(requests.HTTPError) as refused:
        bob.dataset_metadata_update(f"{USER}/secret-data", str(tmp_path / "meta"))
    assert refused.value.response is not None and refused.value.response.status_code == 403
    with pytest.raises(requests.HTTPError):
        bob.dataset_delete(USER, "secret-data", no_confirm=True)

    emulator.switches.metadata_sets_privacy = False
    meta.write_text(json.dumps({"info": dict(info, isPrivate=True)}))
    kaggle_api.dataset_metadata_update(f"{USER}/secret-data", str(tmp_path / "meta"))
    meta.write_text(json.dumps({"info": info}))
    kaggle_api.dataset_metadata_update(f"{USER}/secret-data", str(tmp_path / "meta"))
    assert bob.dataset_list(user=USER) == []  # the switch off: the update kept it private

    assert kaggle_api.dataset_delete(USER, "secret-data", no_confirm=True)
    with pytest.raises(requests.HTTPError):
        kaggle_api.dataset_status(f"{USER}/secret-data")
    assert kaggle_api.dataset_create_new(str(folder), quiet=True).status == "ok"  # the slug is free again


def test_a_kernels_files_are_its_output_listed_once_its_session_ended(emulator, kaggle_api, tmp_path):
    write_kernel(tmp_path / "k", f"{USER}/three-files", [
        "import pathlib, time\nfor n in range(3):\n    pathlib.Path(f'out-{n}.txt').write_text('x' * n)\n"
        "time.sleep(1)"])
    kaggle_api.kernels_push(str(tmp_path / "k"))
    assert kaggle_api.kernels_list_files(f"{USER}/three-files").files == []  # queued: nothing kept yet
    emulator.wait_session(f"{USER}/three-files")
    first = kaggle_api.kernels_list_files(f"{USER}/three-files", page_size=2)
    assert [(f.name, f.size) for f in first.files] == [("out-0.txt", 0), ("out-1.txt", 1)]
    rest = kaggle_api.kernels_list_files(f"{USER}/three-files/1", page_token=first.next_page_token, page_size=2)
    assert [f.name for f in rest.files] == ["out-2.txt"] and not rest.next_page_token
    with pytest.raises(requests.HTTPError) as missing:
        kaggle_api.kernels_list_files(f"{USER}/three-files/2")
    assert missing.value.response is not None and missing.value.response.status_code == 403
