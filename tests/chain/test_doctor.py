# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain doctor` against the local Kaggle: the checklist a user sees, what doctor.json keeps,
and that a doctor run starts no GPU session and writes no credential anywhere.

The probe runs as a real CPU session of the emulator (a notebook in its own process tree). An
image with other versions is the emulator's test switch `runner.image_env`, which the probe
reports as the image's versions and says so.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from emulator_helpers import USER, emulator, fake_key, kaggle_api, wait_dataset_ready, write_dataset  # noqa: F401
from helpers import copy_job, error_line, invoke, known

from kchain.chain.doctor import PROBE_FORMAT, parse_probe
from kchain.common import layout
from kchain.errors import ProbeFormatError

NAME = "tinygpt-notes"
DOCTOR_REF = f"{USER}/{NAME}-doctor"
DATA = f"{USER}/notes-extra"
STATE = f"{USER}/{NAME}-state"
MODEL = "google/gemma/transformers/2b/1"


def job_file(tmp_path: Path, **kaggle) -> Path:
    return copy_job("tinygpt", tmp_path, kaggle={"internet": True, **kaggle})


def doctor_entry() -> dict:
    return json.loads((Path(os.environ["KCHAIN_HOME"]) / "doctor.json").read_text())["jobs"][NAME]


def lines(result, name: str) -> list[str]:
    return [line for line in result.output.splitlines() if re.match(rf"^(ok|warn|FAIL)\s+{name}\s", line)]


def files_holding(text: str, top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def gpu_sessions_run(emu) -> list[dict]:
    return [s for s in emu.sessions() if s["gpu"] and (s.get("run") or s.get("started"))]


@pytest.mark.slow
def test_doctor_all_ok_probes_a_cpu_session_and_writes_no_credential(emulator, kaggle_api, tmp_path):
    import torch

    from kchain.runtime.checkpoint.state import CheckpointJob, write_checkpoint

    key = emulator.users[USER]
    emulator.secrets.update({USER: {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": key}})
    emulator.attach_secrets(DOCTOR_REF)  # the user attached them to the notebook in the web UI
    emulator.switches.quota_has_gpu = True  # this account's quota answer carries the GPU figures
    kaggle_api.dataset_create_new(str(write_dataset(tmp_path / "data", DATA, {"notes.txt": "a note\n"})), quiet=True)
    # The state dataset as a chain leaves it: a real checkpoint written by the runtime, flat.
    ckpt = write_checkpoint({"w": torch.zeros(2)}, CheckpointJob(tmp_path / "ckpts", 12, tmp_path / "none", 0,
                                                                 {"job": NAME, "session": 1}, keep=1))
    files: dict[str, bytes | str] = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    files[layout.STATE_MARKER] = json.dumps({"dataset": STATE, "session": 1, "step": 12})  # kchain's own state
    kaggle_api.dataset_create_new(str(write_dataset(tmp_path / "state", STATE, files)), quiet=True)
    for ref in (DATA, STATE):  # a new dataset is hidden a while, as on Kaggle; the user's are older
        wait_dataset_ready(kaggle_api, ref)
    emulator.add_model(MODEL, {"config.json": "{}"})
    job = job_file(tmp_path, datasets=[DATA], models=[MODEL])

    result = invoke("doctor", job)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "ok    credentials  the client will use KAGGLE_USERNAME/KAGGLE_KEY" in out
    assert f"ok    account      user {USER}; GPU quota left this week 30.0 of 30.0 h" in out
    assert re.search(r"ok    missing      Kaggle answers a lookup of a missing kernel with (403|404), of a missing "
                     r"dataset with (403|404) \(recorded\)", out), out
    assert f"ok    sources      dataset {DATA} exists and is ready" in out
    assert f"ok    sources      model {MODEL} exists" in out
    assert re.search(rf"ok    metadata     notebook \(\d+ KB\) and kernel-metadata.json accepted: saved as "
                     rf"{DOCTOR_REF} version 1 without running", out), out
    mounts = lines(result, "mounts")
    assert [m.split(" is mounted at ")[0] for m in mounts] == [f"ok    mounts       {ref}" for ref in (DATA, STATE, MODEL)]
    assert [m.split("/input/", 1)[1] for m in mounts] == [f"datasets/{DATA}", f"datasets/{STATE}", f"models/{MODEL}"]
    torch_line = lines(result, "torch")[0]
    assert re.match(r"ok    torch        torch \d+\.\d+ on both: checkpoints load both ways", torch_line), out
    assert f"ok    state        state dataset {STATE} exists (attached to the probe)" in out
    [runtime] = lines(result, "runtime")
    assert runtime.startswith("ok    runtime      the embedded runtime imports and would resume from step 12 (")
    assert runtime.endswith(f"input/datasets/{STATE})")
    assert "Secret labels visible: KAGGLE_USERNAME, KAGGLE_KEY" in out
    assert "ok    publishing   in-kernel publish: internet on and Secrets KAGGLE_USERNAME and KAGGLE_KEY visible" in out
    # The probe tried a kernel push from inside itself; this emulator says no (kernel_may_push off, the worse case).
    [unattended] = lines(result, "unattended")
    assert unattended.startswith("warn  unattended   the probe could not push a kernel from inside itself (HTTP "
                                 "403: ") and unattended.endswith("`kchain push --unattended` is refused; chains go on "
                                                         "through `kchain continue`"), unattended
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith(("warn", "FAIL"))] == ["smoke", "unattended"]
    assert out.rstrip().endswith("kchain doctor: all checks passed (warnings above)")

    # The quick save ran nothing; the probe ran on the CPU; no GPU session at all.
    versions = emulator.store.kernels[DOCTOR_REF]["versions"]
    quick, probe = (emulator.store.session(v["session"]) for v in versions)
    assert (quick["run"], quick["started"]) == (False, None)
    assert (probe["gpu"], probe["status"]) == (False, "COMPLETE")
    assert gpu_sessions_run(emulator) == []

    [log] = (Path(os.environ["KCHAIN_HOME"]) / "doctor-probe" / NAME).glob("*.log")
    assert f"[kchain] probe {PROBE_FORMAT}:" in log.read_text()  # the probe's report is in the session log too
    entry = doctor_entry()
    assert entry["user"] == USER and entry["probed"] is True and entry["publish"] == "kernel"
    assert entry["missing"]["kernel"] in (403, 404) and entry["probe"]["format"] == PROBE_FORMAT
    assert entry["probe"]["mounts"][DATA].endswith(f"input/datasets/{DATA}")
    assert entry["probe"]["secrets"]["visible"] == {"KAGGLE_USERNAME": True, "KAGGLE_KEY": True}
    pushed = invoke("push", job)  # refused (never smoked), and no hint: the doctor checked exactly this
    assert pushed.exit_code == 4 and "hint:" not in pushed.output
    assert entry["probe"]["kernel_push"]["tried"] is True and entry["probe"]["kernel_push"]["ok"] is False
    refused = invoke("push", job, "--unattended", "--skip-smoke")
    assert refused.exit_code == 8 and refused.output.count("Error:") == 1
    assert error_line(refused).startswith("Error: --unattended: kchain doctor has not seen a kernel push a kernel on "
                                          "this account (its probe said: "), refused.output

    # A Kaggle that lets a kernel push a kernel: the probe's push of its own kernel from inside itself lands
    # and runs (a CPU session), the doctor says so, and `push --unattended` goes ahead. That kernel-pushed
    # version saw no Secrets (the strict switch: a push resets them, and nobody attached them again), so the
    # doctor and the push both say the chain hands over to the laptop on its first hop.
    emulator.switches.kernel_may_push = True
    again = invoke("doctor", job)
    assert again.exit_code == 0, again.output
    assert lines(again, "unattended") == [
        f"ok    unattended   a kernel may push a kernel on this account: the probe pushed {DOCTOR_REF} from inside "
        "itself; `kchain push --unattended` can chain sessions with the laptop shut"]
    assert lines(again, "secrets") == [
        f"warn  secrets      {DOCTOR_REF} version 5, pushed from inside the probe, saw no Secrets: Kaggle reset them "
        "at the push (as a report says `kaggle kernels push` does), so an unattended chain hands over to the laptop "
        "on its first hop (`kchain continue` pushes each session after the first)"]
    assert doctor_entry()["probe"]["kernel_push"] == {"tried": True, "ok": True, "error": None, "version": 5}
    assert doctor_entry()["hop"] == {"version": 5, "status": "COMPLETE", "secrets_kept": False}
    versions = emulator.store.kernels[DOCTOR_REF]["versions"]
    assert [emulator.store.session(v["session"])["run"] for v in versions] == [False, True, False, True, True]
    # The key the probe read is nowhere: not in doctor.json, the fetched output, the job, the session.
    assert files_holding(key, tmp_path) == []
    assert files_holding(DATA, Path(os.environ["KCHAIN_HOME"]))  # the search does find what is there
    pushed = invoke("push", job, "--unattended", "--skip-smoke")
    assert pushed.exit_code == 0 and "Error:" not in pushed.output, pushed.output
    assert pushed.output.splitlines()[0] == (
        "  hand-over: kchain doctor saw a kernel-pushed kernel lose its Secrets on this account, so no kernel can "
        "push the next session: session 1 publishes its state, then the laptop takes the chain over (run `kchain "
        f"continue --watch {job}`)")
    assert (f"  GPU slots      1 of the account's 2 at any time: each session hands the push of the next to a CPU "
            f"relay ({DOCTOR_REF}, no accelerator), which pushes it once the session has ended") in pushed.output
    assert [s["version"] for s in emulator.sessions() if s["kernel"] == f"{USER}/{NAME}"] == [1]

    # A Kaggle whose kernel push keeps the kernel's Secrets: the kernel-pushed version sees them, the doctor says
    # the chain's relays and sessions can push, and push --unattended has no hand-over to announce.
    emulator.switches.secrets_reset_on_push = False
    kept = invoke("doctor", job)
    assert kept.exit_code == 0, kept.output
    [line] = lines(kept, "secrets")
    assert line.startswith(f"ok    secrets      {DOCTOR_REF} version ") and line.endswith(
        ", pushed from inside the probe, still saw Secrets KAGGLE_USERNAME and KAGGLE_KEY: a kernel-pushed kernel "
        "keeps them, so an unattended chain's relays and sessions can push"), line
    assert doctor_entry()["hop"]["secrets_kept"] is True
    from kchain.chain.doctor import unattended_note
    from kchain.job.spec import load_job

    assert unattended_note(load_job(job)) is None


def test_doctor_warns_for_another_torch_and_numpy_and_says_relay_without_secrets(emulator, tmp_path):
    import numpy
    import torch

    major = int(torch.__version__.split(".")[0])
    older_numpy = f"{int(numpy.__version__.split('.')[0]) - 1}.26.4"
    emulator.runner.image_env = {"KCHAIN_TEST_IMAGE_TORCH": f"{major + 1}.0.1", "KCHAIN_TEST_IMAGE_NUMPY": older_numpy,
                                 # the image's transformers is older than kchain[hf]'s floor; it has a package
                                 # this laptop lacks
                                 layout.TEST_IMAGE_PACKAGES_ENV: json.dumps({"transformers": "4.57.1",
                                                                              "kchain_absent_pkg": "1.2.3"})}
    job = copy_job("tinygpt", tmp_path, kaggle={"internet": True}, code="code", entry="train:main")
    (job.parent / "code").mkdir()
    (job.parent / "train.py").rename(job.parent / "code" / "train.py")
    (job.parent / "code" / "more_imports.py").write_text(  # the job's code imports frameworks beside torch
        "import os\nimport pytorch_lightning\nfrom transformers import Trainer\nimport kchain_absent_pkg.sub\n"
        "from . import train\nimport train\n")

    result = invoke("doctor", job)
    assert result.exit_code == 0, result.output
    assert "[test switch: torch from KCHAIN_TEST_IMAGE_TORCH, numpy from KCHAIN_TEST_IMAGE_NUMPY]" in result.output
    [torch_line] = lines(result, "torch")
    assert torch_line == (f"warn  torch        the image has torch {major + 1}.0.1, your laptop {torch.__version__}: "
                          "a different major version, so a checkpoint written by one may not load in the other "
                          f"and the smoke run proved another torch; install torch {major + 1}.0 here")
    from importlib.metadata import version

    from kchain.job.extras import extra
    hf_floor = known(extra("transformers")).specifier
    assert lines(result, "packages") == [
        "warn  packages     the image has kchain-absent-pkg 1.2.3, this laptop none: the smoke cannot run the code "
        "that imports kchain_absent_pkg; pip install kchain-absent-pkg",
        f"ok    packages     pytorch-lightning {version('pytorch-lightning')} in the image, "
        f"{version('pytorch-lightning')} here: the same minor version",
        f"warn  packages     the image has transformers 4.57.1, your laptop {version('transformers')}: the smoke proved "
        "another transformers, whose defaults and behaviour may differ; pip install 'transformers==4.57.1' here to "
        f"smoke what Kaggle runs; kchain[hf] asks for transformers{hf_floor}, which the image's 4.57.1 does not meet"]
    [numpy_line] = lines(result, "numpy")
    assert numpy_line.startswith(f"warn  numpy        the image has numpy {older_numpy}, your laptop "
                                 f"{numpy.__version__}: the major version differs, so pickled caches")
    [publish] = lines(result, "publishing")
    assert publish == (f"warn  publishing   laptop relay: `kchain continue` downloads each session's output and "
                       f"versions {USER}/{NAME}-state from this machine: Secrets KAGGLE_USERNAME, KAGGLE_KEY are "
                       "not attached to the kernel; attach them in the notebook's Add-ons > Secrets to publish "
                       "from the kernel")
    assert result.output.rstrip().endswith("kchain doctor: all checks passed (warnings above)")
    assert doctor_entry()["publish"] == "relay" and gpu_sessions_run(emulator) == []


def test_doctor_with_a_bad_key_prints_the_401_line(emulator, tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    result = invoke("doctor", job_file(tmp_path))
    assert result.exit_code == 6, result.output
    [line] = [ln for ln in lines(result, "credentials") if ln.startswith("FAIL")]
    assert line == ("FAIL  credentials  Kaggle rejected the credentials (HTTP 401): check KAGGLE_USERNAME and "
                    "KAGGLE_KEY (or KAGGLE_API_TOKEN, or kaggle.json), or create a new API token on "
                    "kaggle.com/settings")
    assert error_line(result).startswith("Error: kchain doctor: 1 check(s) failed: Kaggle rejected the credentials")
    assert emulator.sessions() == [] and doctor_entry()["checks"][-1]["level"] == "FAIL"


def test_doctor_names_a_missing_source_and_push_suggests_a_fresh_doctor(emulator, tmp_path):
    job = job_file(tmp_path, datasets=[f"{USER}/no-such-data"])
    never = invoke("push", job)  # refused (not smoked), but first the one-line suggestion
    assert never.exit_code == 4
    assert never.output.splitlines()[0] == (f"  hint: kchain doctor never checked {NAME} on Kaggle; run `kchain "
                                            f"doctor {job}` (free: no GPU session) to check the account and the "
                                            "image first")

    result = invoke("doctor", job, "--no-probe")
    assert result.exit_code == 9, result.output
    assert re.search(rf"FAIL  sources      dataset {USER}/no-such-data does not exist or {USER} cannot see it "
                     rf"\(HTTP (403|404)\): fix kaggle.datasets in {re.escape(str(job))}", result.output), result.output
    assert (f"FAIL  metadata     Kaggle calls dataset source {USER}/no-such-data invalid: it would be dropped from "
            "the session") in result.output
    assert not lines(result, "torch") and [s["run"] for s in emulator.sessions()] == [False]  # no probe ran
    assert error_line(result).startswith(f"Error: kchain doctor: 2 check(s) failed: dataset {USER}/no-such-data")

    fresh = invoke("push", job)  # checked, but the problem is still there
    assert fresh.exit_code == 4
    assert fresh.output.splitlines()[0] == (f"  hint: the last kchain doctor found 2 problem(s), first: dataset "
                                            f"{USER}/no-such-data does not exist or {USER} cannot see it (HTTP "
                                            f"{doctor_entry()['missing']['dataset']}): fix kaggle.datasets in {job}")
    job.parent.joinpath("train.py").write_text(job.parent.joinpath("train.py").read_text() + "\n# changed\n")
    stale = invoke("push", job)
    assert stale.output.splitlines()[0].startswith("  hint: the last kchain doctor (")
    assert "checked other code or credentials; run `kchain doctor" in stale.output.splitlines()[0]
    assert files_holding(emulator.users[USER], tmp_path) == [] and gpu_sessions_run(emulator) == []


def test_offline_doctor_checks_only_the_laptop(tmp_path, monkeypatch):
    result = invoke("doctor", job_file(tmp_path), "--offline")
    assert result.exit_code == 6, result.output
    assert "kchain doctor" in result.output and "(offline: laptop-side checks only)" in result.output
    assert lines(result, "credentials")[0].startswith("FAIL  credentials  Kaggle credentials not found")
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    result = invoke("doctor", job_file(tmp_path / "again"), "--offline")
    assert result.exit_code == 0, result.output
    assert "warn  smoke        this code never passed a smoke run" in result.output
    assert not lines(result, "account") and doctor_entry()["offline"] is True


def _probe_of(tmp_path: Path, monkeypatch) -> dict:
    """The probe module run here, in a /kaggle-like folder with a dataset in the older flat layout."""
    import importlib
    import sys

    from kchain.job.render import templates_dir

    (tmp_path / "root" / "input" / "notes-extra").mkdir(parents=True)
    (tmp_path / "root" / "working").mkdir()
    monkeypatch.setenv("KCHAIN_ROOT", str(tmp_path / "root"))
    monkeypatch.syspath_prepend(str(templates_dir()))
    probe = importlib.import_module("kchain_probe")
    try:
        return probe.probe({"job": NAME, "sources": [DATA, f"{USER}/absent"], "state_dataset": None,
                            "secret_labels": ["KAGGLE_KEY"], "internet": False,
                            "packages": ["pytorch_lightning", "kchain_absent_pkg"]})
    finally:
        sys.modules.pop("kchain_probe", None)


def test_probe_output_is_parsed_strictly(tmp_path, monkeypatch):
    report = _probe_of(tmp_path, monkeypatch)
    assert report["mounts"] == {DATA: str(tmp_path / "root" / "input" / "notes-extra"), f"{USER}/absent": None}
    assert report["secrets"]["visible"] == {"KAGGLE_KEY": False} and report["runtime"]["imports"] is True
    from importlib.metadata import version

    assert report["packages"] == {  # looked up, not imported
        "pytorch_lightning": {"distribution": "pytorch-lightning", "version": version("pytorch-lightning"),
                              "source": "import"},
        "kchain_absent_pkg": {"distribution": None, "version": None, "source": "import"}}
    assert parse_probe(json.dumps(report)) == report
    with pytest.raises(ProbeFormatError, match="packages is not a map"):
        parse_probe(json.dumps({**report, "packages": {"x": {"version": 3}}}))
    bad: tuple[dict[str, object], ...] = {"format": "kchain-probe/2"}, {"disk_free_working": True}, {"surprise": 1}
    messages = ("has format 'kchain-probe/2', this kchain reads kchain-probe/1", "'disk_free_working' is a bool",
                "has unknown keys ['surprise']")
    for change, message in zip(bad, messages, strict=True):
        with pytest.raises(ProbeFormatError, match=re.escape(message)):
            parse_probe(json.dumps({**report, **change}))
    with pytest.raises(ProbeFormatError, match="has no 'mounts'"):
        parse_probe(json.dumps({k: v for k, v in report.items() if k != "mounts"}))


def test_the_probe_renders_byte_identical_and_never_asks_for_an_accelerator(tmp_path):
    from kchain.job.render import render_probe
    from kchain.job.spec import load_job

    job = load_job(job_file(tmp_path, accelerator="gpu", datasets=[DATA], competition="titanic"))
    first = render_probe(job, DOCTOR_REF, [DATA], STATE, ("KAGGLE_KEY",))
    assert first == render_probe(job, DOCTOR_REF, [DATA], STATE, ("KAGGLE_KEY",))
    notebook, metadata = first
    assert (metadata["enable_gpu"], metadata["enable_tpu"], "machine_shape" in metadata) == (False, False, False)
    assert (metadata["enable_internet"], metadata["dataset_sources"], metadata["competition_sources"]) == (
        True, [DATA], ["titanic"])
    assert json.loads(notebook)["metadata"]["kaggle"]["accelerator"] == "none"


def test_push_unattended_says_what_the_doctor_saw_of_a_kernel_pushed_kernels_secrets(tmp_path):
    from kchain.chain.doctor import doctor_file, unattended_note
    from kchain.common import atomic
    from kchain.job.spec import load_job

    job = load_job(job_file(tmp_path))
    for kept in (True, False, None):
        atomic.write_json(doctor_file(job), {"format": 1, "jobs": {NAME: {"hop": {"version": 3, "secrets_kept": kept}}}})
        note = unattended_note(job)
        if kept:
            assert note is None
        elif kept is False:
            assert note is not None and note.startswith("  hand-over: kchain doctor saw a kernel-pushed kernel lose")
        else:
            assert note == ("  note: kchain doctor did not see whether a kernel-pushed kernel keeps its Secrets; if it "
                            "does not, the laptop takes the chain over after session 1 (`kchain doctor "
                            f"{job.path}` checks it)")


def test_each_package_the_code_imports_is_compared_with_the_image_and_a_missing_one_fails():
    from kchain.chain.doctor import Report, _Checklist, compare_packages
    from kchain.job.extras import distribution, extra, imported, install_hint

    code = {"code/train.py": b"import torch, numpy\nimport json\nfrom peft import LoraConfig\nfrom .util import x\n"
                             b"import util\nimport lightning.pytorch as pl\n",
            "code/util/__init__.py": b"import sklearn\n", "code/notes.txt": b"import nothing\n",
            "code/broken.py": b"def (:\n"}
    assert imported(code) == ["lightning", "numpy", "peft", "sklearn", "torch"]  # not its own, stdlib's or text's
    assert (distribution("pytorch_lightning"), distribution("Some_Thing")) == ("pytorch-lightning", "some-thing")
    assert (known(extra("pytorch-lightning")).name, known(extra("PEFT")).name,
            known(extra("accelerate")).name) == ("lightning", "hf", "accelerate")
    assert install_hint("transformers") == "pip install 'kchain[hf]'" and extra("torch") is None
    report = Report(NAME, Path("job.yaml"))
    compare_packages({"peft": {"version": None}}, {"peft": {"distribution": "peft", "version": "0.21.0"}},
                     _Checklist(report, lambda _: None))
    [check] = report.checks
    assert (check.level, check.name) == ("FAIL", "packages")
    assert check.text.startswith("the job's code imports peft, which Kaggle's image does not have: the session "
                                 "would stop at that import")
