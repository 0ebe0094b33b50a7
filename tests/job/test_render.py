import json
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
from helpers import REPO, copy_job, invoke

from kchain.job.render import render_job, write_rendered
from kchain.job.spec import load_job


def test_render_is_byte_identical_and_valid(tmp_path):
    job = load_job(REPO / "jobs" / "tinygpt" / "job.yaml")
    a, b = render_job(job, owner="alice"), render_job(job, owner="alice")
    assert a.notebook == b.notebook and a.metadata == b.metadata and a.fingerprint == b.fingerprint
    nb = nbformat.reads(a.notebook, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kchain"]["fingerprint"] == a.fingerprint
    assert a.fingerprint in nb.cells[0].source and a.fingerprint in nb.cells[1].source
    meta = json.loads(a.metadata)
    assert meta["id"] == "alice/tinygpt-notes"
    assert meta["code_file"] == "tinygpt-notes.ipynb" and meta["kernel_type"] == "notebook"
    assert meta["enable_internet"] is False and meta["enable_gpu"] is True
    assert meta["machine_shape"] == "NvidiaTeslaT4"


def test_fingerprint_follows_code_and_params(tmp_path):
    path = copy_job("tinygpt", tmp_path)
    base = render_job(load_job(path), owner="alice").fingerprint
    changed = copy_job("tinygpt", tmp_path / "b", params={"steps": 2000, "lr": 1e-3})
    assert render_job(load_job(changed), owner="alice").fingerprint != base
    code = path.parent / "train.py"
    code.write_text(code.read_text() + "\n# a comment\n")
    assert render_job(load_job(path), owner="alice").fingerprint != base


def test_cpu_job_has_no_machine_shape(tmp_path):
    path = copy_job("classifier", tmp_path, kaggle={"accelerator": "none", "internet": True})
    meta = json.loads(render_job(load_job(path), owner="bob").metadata)
    assert "machine_shape" not in meta
    assert meta["enable_gpu"] is False and meta["enable_internet"] is True


def test_render_command_writes_what_a_push_sends(tmp_path):
    out = tmp_path / "out"
    result = invoke("render", REPO / "jobs" / "classifier" / "job.yaml", "-o", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["blobs-classifier.ipynb", "kernel-metadata.json"]


def test_no_credential_lands_in_the_rendered_files(tmp_path, monkeypatch):
    key = "f" * 8 + "0123456789abcdef" + "9" * 8
    (Path.home() / ".kaggle" / "kaggle.json").write_text(json.dumps({"username": "carol", "key": key}))
    monkeypatch.setenv("KAGGLE_KEY", key)
    out = tmp_path / "out"
    result = invoke("render", REPO / "jobs" / "tinygpt" / "job.yaml", "-o", out)
    assert result.exit_code == 0, result.output
    for path in out.iterdir():
        assert key not in path.read_text()
    assert json.loads((out / "kernel-metadata.json").read_text())["id"] == "carol/tinygpt-notes"


def test_templates_ship_inside_the_wheel(tmp_path):
    """Render from an installed wheel, not from the source tree."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True, capture_output=True,
    )
    wheel = next(wheels.glob("kchain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kchain/kernel_templates/notebook.ipynb.j2" in names
    assert "kchain/kernel_templates/kernel-metadata.json.j2" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    job = copy_job("tinygpt", tmp_path / "job")
    script = (
        "import kchain.job.render as r, kchain.job.spec as s;"
        f"x = r.render_job(s.load_job({str(job)!r}), owner='alice');"
        "print(r.templates_dir()); print(x.fingerprint)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, check=True,
    )
    templates, fingerprint = done.stdout.split()
    assert templates.startswith(str(site))
    assert fingerprint == render_job(load_job(job), owner="alice").fingerprint
    write_rendered(render_job(load_job(job), owner="alice"), tmp_path / "r")


def test_the_fingerprint_does_not_depend_on_who_pushes_or_which_session():
    job = load_job(REPO / "jobs" / "tinygpt" / "job.yaml")
    alone = render_job(job, owner=None)
    alice = render_job(job, owner="alice")
    later = render_job(job, owner="alice", extra_sources=["alice/tinygpt-notes-state/4"], session=5)
    assert alone.fingerprint == alice.fingerprint == later.fingerprint
    assert "| session | 5 of the chain; state attached: alice/tinygpt-notes-state/4 |" in later.notebook.replace("\\n", "\n")
    assert json.loads(later.metadata)["dataset_sources"] == ["alice/tinygpt-notes-state/4"]


def test_kaggle_image_pins_the_first_sessions_image_unless_it_says_latest(tmp_path):
    pinned = json.loads(render_job(load_job(copy_job("classifier", tmp_path)), owner="alice").metadata)
    assert pinned["docker_image_pinning_type"] == "original"
    latest = copy_job("classifier", tmp_path / "b", kaggle={"image": "latest"})
    assert json.loads(render_job(load_job(latest), owner="alice").metadata)["docker_image_pinning_type"] == "latest"
