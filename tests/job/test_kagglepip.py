# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kaggle.pip`: a package Kaggle's image lacks, installed in an internet-off kernel from a dataset of wheels the
laptop built once (kchain/job/kagglepip.py, kchain/common/wheelinstall.py).

The package here is a wheel made in the test and served to the laptop's pip through PIP_FIND_LINKS with
PIP_NO_INDEX (nothing is downloaded); it is in no site-packages of the test environment, so the job's code
can only import it from the wheels dataset. The notebook's pip gets no PIP_* setting: the mounted dataset is
all it can install from.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import socket
import zipfile
from pathlib import Path

import pytest
from emulator_helpers import USER, emulator, fake_key  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.common import layout, wheelinstall
from kchain.errors import SpecError
from kchain.job import kagglepip
from kchain.job.spec import load_job

TOY = "kcwheeltoy"
NAME = "blobs-classifier"
SMALL = {"steps": 6, "rows": 2000, "num_workers": 0, "eval_every": 3}


def make_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel (py3-none-any) of one module, RECORD hashes and all, written with zipfile."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kchain-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.fixture
def wheelhouse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The laptop's pip finds the toy package here and nowhere else."""
    house = tmp_path / "wheelhouse"
    make_wheel(house, TOY, "1.0", 'VERSION = "1.0"\nSCALE = 1.0\n')
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    assert importlib.util.find_spec(TOY) is None  # only the wheels dataset can bring it
    return house


def toy_job(tmp_path: Path, pins: list[str], **overrides) -> Path:
    """The example classifier, one rank on the CPU, whose code imports the toy package at its top."""
    job = copy_job("classifier", tmp_path, params=SMALL, train={"heartbeat": "0s"},
                   kaggle={"accelerator": "none", "internet": False, "pip": pins}, **overrides)
    code = job.parent / "train.py"
    code.write_text(f"import {TOY}\n\nassert {TOY}.VERSION == '1.0'\n" + code.read_text())
    return job


@pytest.mark.parametrize("pin, said", [
    ("peft", "is not pinned to one version"),
    ("peft>=0.17", "is not pinned to one version"),
    ("peft==0.*", "is not pinned to one version"),
    ("peft[torch]==0.17.1", "extras cannot be installed with no index"),
    ("peft==0.17.1; python_version<'3.9'", "a marker cannot be installed"),
    ("peft @ https://example.com/peft.whl", "a URL cannot be installed"),
    ("not a pin!", "is not a pinned package"),
])
def test_a_pin_that_is_not_one_version_is_one_line_naming_the_key(tmp_path, pin, said):
    job = toy_job(tmp_path, [pin])
    with pytest.raises(SpecError) as err:
        load_job(job)
    line = str(err.value)
    assert "\n" not in line and "kaggle.pip" in line and said in line and str(job) in line, line


def test_the_same_package_pinned_twice_is_refused(tmp_path):
    with pytest.raises(SpecError, match="Foo_Bar is already pinned as 'foo-bar==1.0'"):
        load_job(toy_job(tmp_path, ["foo-bar==1.0", "Foo_Bar==2.0"]))


def test_the_wheels_are_built_once_per_fingerprint_for_the_kernels_python(tmp_path, wheelhouse):
    job = load_job(toy_job(tmp_path, [f"{TOY}==1.0"]))
    said: list[str] = []
    folder = kagglepip.local_folder(job, said.append)
    assert sorted(p.name for p in folder.iterdir()) == [layout.WHEELS_MANIFEST, f"{TOY}-1.0-py3-none-any.whl"]
    manifest = json.loads((folder / layout.WHEELS_MANIFEST).read_text())
    target = kagglepip.kernel_target(None)
    assert (manifest["pins"], manifest["python"], manifest["platform"]) == ([f"{TOY}==1.0"], "3.11",
                                                                            "manylinux_2_35_x86_64")
    assert manifest["fingerprint"] == kagglepip.fingerprint([f"{TOY}==1.0"], target)
    assert any("downloading 1 wheel(s) for CPython 3.11 on manylinux_2_35_x86_64" in line for line in said), said

    # Cached: with nothing to download from, the same folder comes back without pip being asked.
    (wheelhouse / f"{TOY}-1.0-py3-none-any.whl").unlink()
    said.clear()
    assert kagglepip.local_folder(job, said.append) == folder and said == []

    # The doctor's probe saw another Python: another fingerprint, so another build (which now finds no wheel).
    probe = {"python": "3.12.4", "platform": {"glibc": "2.39", "machine": "x86_64"}}
    assert kagglepip.kernel_target(probe) == kagglepip.Target("3.12", "manylinux_2_39_x86_64", "probe")
    with pytest.raises(SpecError) as err:
        kagglepip.build(job, kagglepip.kernel_target(probe), tmp_path / "cache", said.append)
    assert f"kaggle.pip: no wheel of {TOY}==1.0 (the kernel), {TOY}==1.0 (this laptop) for CPython 3.12" in str(err.value)


def test_a_session_without_the_wheel_for_its_python_stops_in_one_line(tmp_path, wheelhouse):
    mount = tmp_path / "kaggle" / "input" / "datasets" / USER / f"{NAME}{layout.PIP_SUFFIX}"
    mount.mkdir(parents=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"job": NAME, "pip": [f"{TOY}==1.0"], "kaggle": {"mount_wait_s": 0}}))
    lines: list[str] = []
    env = {layout.ROOT_ENV: str(tmp_path / "kaggle")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setattr("kchain.common.wheelinstall.emit", lines.append)
        assert wheelinstall.main([str(config), str(tmp_path / "site")]) == 1  # the wheelhouse is not the dataset
        assert lines == [f"[kchain] kaggle.pip: no wheel of {TOY}==1.0 in {mount} for this interpreter "
                         f"({wheelinstall.here()}): the laptop built the wheels for another Python or platform; run "
                         "`kchain doctor` (it records the image's Python), smoke and push again"]
        lines.clear()
        mount.rmdir()
        assert wheelinstall.main([str(config), str(tmp_path / "site")]) == 1
        assert lines[0].startswith(f"[kchain] kaggle.pip: the dataset {NAME}{layout.PIP_SUFFIX} is not attached")


def test_a_pin_with_no_wheel_fails_the_smoke_in_one_line_before_anything_runs(tmp_path, wheelhouse):
    job = toy_job(tmp_path, [f"{TOY}==1.0", "kcwheelmissing==2.0"])
    result = invoke("smoke", job, "--quiet")
    assert result.exit_code == SpecError.exit_code, result.output
    assert error_line(result) == (
        f"Error: {job}: kaggle.pip: no wheel of kcwheelmissing==2.0 (the kernel), kcwheelmissing==2.0 (this laptop) "
        "for CPython 3.11 on manylinux_2_35_x86_64 (Kaggle's image as assumed; `kchain doctor` reads the real one) "
        "or this laptop; pin a version that ships a wheel (pip cannot build one in a kernel with the internet off)")


def test_an_unreachable_index_is_one_bounded_line_naming_it_after_a_progress_line(tmp_path, monkeypatch):
    # 101 pins: two batches, a progress line before each; the first pip call meets a refused connection and
    # gives up within its bound (--timeout, --retries, whatever PIP_DEFAULT_TIMEOUT says), naming the index.
    pins = [f"kcnowhere{i}==1.0" for i in range(kagglepip.BATCH + 1)]
    job = toy_job(tmp_path, pins)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: every connection to it is refused
        index = f"http://127.0.0.1:{closed.getsockname()[1]}/simple"
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf of this machine's
        monkeypatch.setenv("PIP_INDEX_URL", index.replace("http://", "http://someone:secret@"))
        for name in ("PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL"):
            monkeypatch.delenv(name, raising=False)
        result = invoke("smoke", job, "--quiet")
    assert result.exit_code != 0
    lines = result.output.splitlines()
    assert f"  kaggle.pip downloading {len(pins)} wheel(s) for CPython 3.11 on manylinux_2_35_x86_64 (Kaggle's " \
           "image as assumed; `kchain doctor` reads the real one), once" in lines, lines
    assert f"  kaggle.pip: wheels 1-{kagglepip.BATCH} of {len(pins)} (for the kernel, then this laptop)" in lines, lines
    assert error_line(result) == (
        f"Error: kaggle.pip: the package index {index} cannot be reached (pip gave up after {kagglepip.PIP_RETRIES} "
        f"retries with a {kagglepip.PIP_TIMEOUT_S} s timeout each); check the connection, or pip's index settings "
        "(PIP_INDEX_URL, pip.conf), and run the command again")
    assert "secret" not in result.output
    # What pip was run with: the bound, for the kernel's interpreter and for this one.
    for target in (kagglepip.kernel_target(None), None):
        command = kagglepip.pip_command(pins[:kagglepip.BATCH], tmp_path, target)
        assert command[command.index("--timeout") + 1] == str(kagglepip.PIP_TIMEOUT_S) == "15"
        assert command[command.index("--retries") + 1] == str(kagglepip.PIP_RETRIES) == "2"
        assert command[-kagglepip.BATCH:] == pins[:kagglepip.BATCH]  # one pip call a batch


@pytest.mark.slow
def test_a_job_importing_a_package_only_its_wheels_hold_smokes_and_trains_on_the_local_kaggle(
        emulator, tmp_path, wheelhouse):
    job = toy_job(tmp_path, [f"{TOY}==1.0"])
    smoked = invoke("smoke", job)
    assert smoked.exit_code == 0, smoked.output
    assert "PASS" in smoked.output
    assert importlib.util.find_spec(TOY) is None  # the smoke left the laptop's environment as it was

    pushed = invoke("push", job)
    assert pushed.exit_code == 0, pushed.output
    ref = f"{USER}/{NAME}{layout.PIP_SUFFIX}"
    assert f"  kaggle.pip {ref} version 2 (new dataset): {TOY}==1.0 for CPython 3.11" in pushed.output
    kernel = emulator.store.kernels[f"{USER}/{NAME}"]
    assert ref in kernel["dataset_sources"] and kernel["enable_internet"] is False
    session = emulator.wait_session(f"{USER}/{NAME}", 1)
    log = invoke("logs", job).output
    assert session["status"] == "COMPLETE", log
    assert f"[kchain] kaggle.pip: installed {TOY}==1.0 from " in log
    assert f"[kchain] step {SMALL['steps']}/{SMALL['steps']}" in log

    # The same pins again: the newest version already holds them, so nothing is uploaded.
    said: list[str] = []
    from kchain.kaggle.client import KaggleClient

    assert kagglepip.ensure(KaggleClient(), load_job(job), USER, said.append) == ref
    assert said == [] and len(emulator.dataset_versions(ref)) == 2

    # The doctor's probe (a CPU session) installs the wheels in the image as a session does, and counts the
    # package the code imports as present there and here alike.
    doctor = invoke("doctor", job)
    assert f"ok    kaggle.pip   {TOY}==1.0 installed in the image's Python from the job's wheels dataset" in doctor.output
    assert f"ok    packages     {TOY}==1.0 from kaggle.pip, in the image and in the smoke alike" in doctor.output
    assert len(emulator.dataset_versions(ref)) == 2  # still the same version
