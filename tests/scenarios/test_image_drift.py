# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Kaggle updates its images about every two weeks: a chain over ten days can straddle two.

Each session's image is what `kaggle kernels pull -m` writes as `docker_image`; a push pins one by
digest (`docker_image`) or with `docker_image_pinning_type: original` (the kernel's first version's).
The emulator releases a new image every `new_image_every` pushes (strict: every push) and honours
the pins unless `ignore_image_pin`. `kchain status` warns when a session ran on another image (or
torch, or CUDA build) than session 1. The unmodified client against the local Kaggle.
"""

from __future__ import annotations

import json

from emulator_helpers import USER, emulator, kaggle_api, write_kernel  # noqa: F401

from kchain.chain.sessions import image_drift, short_image
from kchain.common.sessionrecord import SessionRecord
from kchain.common.sessionstate import SessionState
from kchain.common.summary import Summary
from kchain.kaggle.client import KaggleClient

PRINT = ["print('hi')"]


def pulled_image(api, ref: str, version: int, folder) -> str:
    api.kernels_pull(f"{ref}/{version}", str(folder), metadata=True)
    return json.loads((folder / "kernel-metadata.json").read_text())["docker_image"]


def test_each_version_runs_on_an_image_pull_names_and_pins_hold_unless_ignored(emulator, kaggle_api, tmp_path):
    ref = f"{USER}/images-kernel"
    emulator.max_cpu_sessions = 6  # five versions pushed back to back: the images are under test, not the CPU cap
    folder = write_kernel(tmp_path / "k", ref, PRINT, docker_image_pinning_type="latest")
    assert kaggle_api.kernels_push(str(folder)).version_number == 1
    first = pulled_image(kaggle_api, ref, 1, tmp_path / "p1")
    assert first.startswith("gcr.io/kaggle-images/python@sha256:") and emulator.store.images == [first]
    assert kaggle_api.kernels_push(str(folder)).version_number == 2  # latest: the image Kaggle released since
    second = pulled_image(kaggle_api, ref, 2, tmp_path / "p2")
    assert second == emulator.store.images[-1] != first
    write_kernel(folder, ref, PRINT, docker_image_pinning_type="original")
    kaggle_api.kernels_push(str(folder))  # original: version 1's image, whatever is newer
    assert pulled_image(kaggle_api, ref, 3, tmp_path / "p3") == first
    write_kernel(folder, ref, PRINT, docker_image=second)  # by digest
    kaggle_api.kernels_push(str(folder))
    assert KaggleClient().kernel_image(ref, 4) == second  # kchain reads it as `kernels pull -m` writes it
    write_kernel(folder, ref, PRINT, docker_image="gcr.io/kaggle-images/python@sha256:" + "0" * 64)
    assert kaggle_api.kernels_push(str(folder)).error.endswith("is not one of Kaggle's images")

    emulator.switches.ignore_image_pin = True
    write_kernel(folder, ref, PRINT, docker_image=first, docker_image_pinning_type="original")
    kaggle_api.kernels_push(str(folder))
    drifted = KaggleClient().kernel_image(ref, 5)
    assert drifted == emulator.store.images[-1] not in (first, second)

    # `kchain status`'s warning, from the records a chain keeps (the image, the summary's torch and CUDA).
    records: list[SessionRecord] = [
        {"session": 1, "status": SessionState.COMPLETE, "version": 1, "image": first,
         "summary": {"status": "deadline", "torch": "2.6.0+cu124", "cuda": "12.4"}},
        {"session": 2, "status": SessionState.COMPLETE, "version": 3, "image": first, "image_asked": first,
         "summary": {"status": "deadline", "torch": "2.6.0+cu124", "cuda": "12.4"}},
        {"session": 3, "status": SessionState.RUNNING, "version": 5, "image": drifted, "image_asked": first},
    ]
    assert image_drift(records[:2]) == []
    assert image_drift(records) == [
        f"image: session 3 ran on {short_image(drifted)} (torch unknown), session 1 on {short_image(first)} "
        "(torch 2.6.0+cu124, CUDA 12.4): kchain asked for session 1's image and Kaggle ran another; its numerics "
        "may differ from the sessions before it, and a checkpoint written under another torch may not load"]
    records[2]["image"] = first  # one image, but another torch (a summary with the runtime's versions)
    records[2]["summary"] = {"status": "finished", "torch": "2.7.1+cu126", "cuda": "12.6"}
    assert image_drift(records)[0].startswith(f"image: session 3 ran on {short_image(first)} (torch 2.7.1+cu126")
    # An older kernel's summary has neither key: both read as None, and neither is written back.
    old = Summary.from_dict({"status": "deadline", "step": 4})
    assert (old.torch, old.cuda) == (None, None) and "torch" not in old.to_dict()
    assert Summary.from_dict({"status": "deadline", "torch": "2.6.0", "cuda": None}).to_dict()["torch"] == "2.6.0"
