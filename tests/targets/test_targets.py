"""target: skypilot and target: slurm — the job sections, the pure render, the guards, SkyPilot's own
check of the rendered task, and push/status/logs/stop as the engine's command lines.

No cloud and no Slurm here: the engine commands are stand-ins on PATH that record the command line
kchain sends (sky, sbatch, sacct, scancel). SkyPilot's check is SkyPilot itself (skypilot==0.14.1, in
a Python of its own: .venv/sky in CI), with the small catalog copy in tests/fixtures/skypilot-catalog/.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from helpers import error_line, invoke

from kchain.errors import RenderError
from kchain.job.render import render_job
from kchain.job.spec import load_job
from kchain.targets import skypilot, slurm
from kchain.targets.commands import render_for
from kchain.targets.workfolder import write_folder

CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "skypilot-catalog"
SKYPILOT = {"accelerators": "A100:1", "bucket": {"name": "my-kchain-state", "store": "s3"}}
SLURM = {"partition": "gpu", "time": "2h", "gpus": 2, "state_dir": "/shared/me/kchain-state"}


def code_job(tmp_path: Path, **sections) -> Path:
    """A job whose code is a folder: a credential file by name, a file .kchainignore lists, a helper."""
    root = tmp_path / "job"
    (root / "src").mkdir(parents=True)
    (root / "src" / "train.py").write_text("import helper\n\n\ndef main(run):\n    helper.go(run)\n")
    (root / "src" / "helper.py").write_text("def go(run):\n    pass\n")
    (root / "src" / "kaggle.json").write_text('{"username": "me", "key": "0123"}')
    (root / "src" / "data.bin").write_bytes(b"\0" * 64)
    (root / ".kchainignore").write_text("data.bin\n")
    job = {"name": "target-job", "code": "src", "kaggle": {"accelerator": "gpu"}, **sections}
    (root / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return root / "job.yaml"


def test_render_is_pure_keeps_the_guards_and_says_the_contract(tmp_path, monkeypatch):
    path = code_job(tmp_path, target="skypilot", skypilot={**SKYPILOT, "num_nodes": 2}, slurm=SLURM)
    job = load_job(path)
    for target in ("skypilot", "slurm"):
        first, again = render_for(job, target), render_for(job, target)
        assert first.files == again.files  # byte-identical
        # The fingerprint is the Kaggle notebook's: a `kchain smoke` pass counts for every target.
        assert first.fingerprint == render_job(job, owner="someone").fingerprint
        code = sorted(name for name in first.files if name.startswith("code/"))
        assert code == ["code/helper.py", "code/train.py"]  # no credential file, nothing .kchainignore lists
        assert {"code/kaggle.json", "code/data.bin"} <= {name for name, _ in first.payload.left_out}
        out = write_folder(first, tmp_path / target)[0].parent
        write_folder(again, out)  # replaced whole, the same bytes
        assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == first.files
        assert json.loads(first.files["config.json"])["fingerprint"] == first.fingerprint

    task = yaml.safe_load(render_for(job, "skypilot").engine_text)
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [75]
    assert task["resources"]["accelerators"] == "A100:1"
    # SkyPilot's other spellings (its docs' {T4: 1}, a list of candidates) are read as SkyPilot reads them.
    for given, rendered in (({"T4": 1}, "T4:1"), (["A100:1", "V100:1"], ["A100:1", "V100:1"])):
        other = load_job(code_job(tmp_path / str(len(str(given))), target="skypilot",
                                  skypilot={**SKYPILOT, "accelerators": given}))
        assert yaml.safe_load(render_for(other, "skypilot").engine_text)["resources"]["accelerators"] == rendered
    assert task["file_mounts"] == {"/kchain-state": {"name": "my-kchain-state", "store": "s3", "mode": "MOUNT",
                                                     "persistent": True}}
    assert task["envs"] == {"KCHAIN_STATE_SINK": "/kchain-state/target-job"}
    assert "-m torch.distributed.run --nnodes=\"$SKYPILOT_NUM_NODES\" --node_rank=\"$SKYPILOT_NODE_RANK\"" in task["run"]
    assert 'python -m kchain.runtime.launch --exit-code "$code"; code=$?' in task["run"]  # torchrun says 0 or 1
    sbatch = render_for(job, "slurm").engine_text
    assert "#SBATCH --requeue" in sbatch and "#SBATCH --time=120" in sbatch and "#SBATCH --gpus-per-node=2" in sbatch
    assert 'if [ "$code" -eq 75 ] && [ -n "${SLURM_JOB_ID:-}" ]; then' in sbatch
    assert 'export KCHAIN_SESSION_LIMIT="${KCHAIN_SESSION_LIMIT:-7200}"' in sbatch  # the job's time limit
    for script in (task["run"], sbatch):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell

    # The Kaggle key, in the code or in a setup line, never reaches a work folder.
    key = "f" * 32
    monkeypatch.setenv("KAGGLE_KEY", key)
    (path.parent / "src" / "more.py").write_text(f"KEY = '{key}'\n")
    for target in ("skypilot", "slurm"):
        with pytest.raises(RenderError, match="code/more.py holds your Kaggle key"):
            render_for(job, target)
    (path.parent / "src" / "more.py").unlink()
    keyed = code_job(tmp_path / "k", target="slurm", slurm={**SLURM, "setup": f"export TOKEN={key}"})
    with pytest.raises(RenderError, match="slurm: a value holds your Kaggle key"):
        render_for(load_job(keyed), "slurm")


@pytest.mark.parametrize("sections, line", [
    ({"target": "skypilot"}, "skypilot.bucket: required for target skypilot (the checkpoints must outlive the "
                             "machine); add e.g. bucket: {name: my-kchain-state, store: s3}"),
    ({"target": "skypilot", "skypilot": {**SKYPILOT, "spot": True}}, "skypilot.spot: unknown key; did you mean "
                                                                     "'use_spot'?"),
    ({"skypilot": {"bucket": {"name": "My_Bucket"}}},
     "skypilot.bucket.name: 'My_Bucket' is not a bucket name; use 3-63 lowercase letters, digits, dots and dashes, "
     "a letter or digit at each end, e.g. my-kchain-state"),
    ({"skypilot": {"bucket": {"name": "abc", "mode": "COPY"}}},
     "skypilot.bucket.mode: 'COPY' is not allowed; input should be 'mount' or 'mount_cached'"),
    ({"target": "slurm", "slurm": {"state_dir": "scratch/x"}},
     "slurm.state_dir: 'scratch/x' is not an absolute path of letters, digits and _ . + - /; write the shared "
     "folder, e.g. /scratch/me/kchain-state"),
    ({"target": "slurm", "slurm": {**SLURM, "time": "two days"}},
     "slurm.time: 'two days' is not a duration; write e.g. 90m, 12h or 48h"),
    ({"target": "aws"}, "target: 'aws' is not allowed; input should be 'kaggle', 'skypilot' or 'slurm'"),
])
def test_a_bad_target_section_is_one_line_naming_the_key_and_the_fix(tmp_path, sections, line):
    path = code_job(tmp_path, **sections)
    result = invoke("render", path)
    assert result.exit_code == 10, result.output
    assert error_line(result) == f"Error: {path}: {line}"


# Where CI keeps SkyPilot apart from kchain's environment (its click<8.2 pin; docs/targets.md).
SKY_VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "sky" / "bin" / "python"


def sky_python() -> str:
    """A Python that has SkyPilot: kchain's, the `sky` command's, or CI's .venv/sky."""
    python = skypilot.sky_python() or (str(SKY_VENV_PYTHON) if SKY_VENV_PYTHON.exists() else None)
    # Never a skip: what CI does not run is not tested. The README's test command installs it.
    assert python is not None, ("SkyPilot is not installed: python3 -m venv .venv/sky && .venv/sky/bin/pip install "
                                "-q skypilot==0.14.1 (the README's test command does; docs/targets.md)")
    return python


def test_skypilot_checks_the_rendered_task_and_bucket_names_then_push_launches_it(tmp_path, monkeypatch):
    runtime = tmp_path / "sky-runtime"
    shutil.copytree(CATALOG, runtime / ".sky" / "catalogs")  # SkyPilot writes its lock files beside it
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(runtime))
    python = sky_python()
    # Two nodes: the run under the outer torchrun; SkyPilot reads the run as text, whatever the count.
    path = code_job(tmp_path, target="skypilot", skypilot={**SKYPILOT, "num_nodes": 2, "infra": "aws",
                                                           "disk_size": 100})
    folder = write_folder(render_for(load_job(path), "skypilot"), tmp_path / "sky")[0].parent
    assert skypilot.check_task(folder, "s3", "my-kchain-state", python) == "0.14.1"
    # Names kchain's first check lets through and a store refuses: each store's own rules.
    with pytest.raises(RenderError, match='Invalid store name: name xn--kchain must not start with the prefix "xn--"'):
        skypilot.check_task(folder, "s3", "xn--kchain", python)
    with pytest.raises(RenderError, match='cannot begin with the "goog" prefix'):
        skypilot.check_task(folder, "gcs", "goog-kchain", python)

    # push: SkyPilot's check (found through the `sky` command's Python, as with pipx), then the launch.
    # The `sky` on PATH is a stand-in on SkyPilot's Python that records what kchain asks of it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sky").write_text(f"#!{python}\nimport os, sys\nwith open({str(bin_dir / 'calls')!r}, 'a') as f:\n"
                                 "    f.write(os.getcwd() + ' ' + ' '.join(sys.argv[1:]) + '\\n')\n")
    (bin_dir / "sky").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    for command in (("push", path, "--skip-smoke"), ("status", path), ("logs", path), ("stop", path)):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
    work = tmp_path / "kchain-home" / "targets" / "target-job-skypilot"
    assert (bin_dir / "calls").read_text().splitlines() == [
        f"{work} jobs launch --name target-job --yes --detach-run task.yaml",
        f"{Path.cwd()} jobs queue", f"{Path.cwd()} jobs logs --name target-job --no-follow",
        f"{Path.cwd()} jobs cancel --name target-job --yes",
    ]


def stand_ins(folder: Path, job_id: str) -> Path:
    """sbatch, sacct and scancel that record their command line (and sbatch answers a job id)."""
    folder.mkdir()
    for name, answer in (("sbatch", f"{job_id};cluster"), ("sacct", f"{job_id}|target-job|RUNNING|0:0"),
                         ("scancel", "")):
        tool = folder / name
        tool.write_text(f'#!/bin/sh\necho "$PWD $0 $*" >> "{folder}/calls"\necho "{answer}"\n')
        tool.chmod(stat.S_IRWXU)
    return folder


def test_push_refuses_unsmoked_code_then_sends_the_engine_its_command_lines(tmp_path, monkeypatch):
    path = code_job(tmp_path, target="slurm", slurm=SLURM)
    result = invoke("push", path)
    assert result.exit_code == 4
    assert error_line(result) == (f"Error: this code has never passed a smoke run: run `kchain smoke {path}` first "
                                  "(or --skip-smoke, recorded in the run log)")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = invoke("status", path)
    assert error_line(result) == f"Error: target-job was never pushed to slurm; run `kchain push {path}` first"
    result = invoke("push", path, "--skip-smoke")
    assert error_line(result) == ("Error: sbatch is not installed here (sbatch --parsable job.sbatch is what kchain "
                                  "runs); run kchain on the cluster's login node, where Slurm's commands are")
    bin_dir = stand_ins(tmp_path / "bin", "5150")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    result = invoke("push", path, "--skip-smoke")
    assert result.exit_code == 0, result.output
    home = tmp_path / "kchain-home"
    folder = home / "targets" / "target-job-slurm"
    assert f"submitted Slurm job 5150; its log: {folder / 'slurm-5150.out'}" in result.output
    (folder / "slurm-5150.out").write_text("[kchain] step 1\n")
    status = invoke("status", path)
    assert status.exit_code == 0
    assert status.output.splitlines()[-1].startswith("no checkpoint published to "), status.output  # nothing yet
    assert invoke("logs", path).output == "[kchain] step 1\n"
    assert invoke("stop", path).exit_code == 0
    assert (bin_dir / "calls").read_text().splitlines() == [
        f"{folder} {bin_dir}/sbatch --parsable job.sbatch",
        f"{Path.cwd()} {bin_dir}/sacct --jobs 5150 --format=JobID,JobName,State,ExitCode,Elapsed,Start,End --parsable2",
        f"{Path.cwd()} {bin_dir}/scancel 5150",
    ]
    notes = [line.split(",")[-1] for line in (home / "runs.csv").read_text().splitlines()[1:]]
    assert notes == ["pushed: slurm job 5150 (--skip-smoke: never smoke-tested)", "stopped: slurm job 5150"]
    record = json.loads((home / "targets.json").read_text())["target-job"]
    assert record["id"] == "5150" and record["smoke"] == "skipped"
    assert slurm.queue_command("5150")[:3] == ["squeue", "--jobs", "5150"]


NOBODY = 65534  # the unprivileged user and group a root test runs the script as too (setpriv, util-linux)


def run_rendered(script: str, tmp_path: Path, sink: Path, as_user: int | None = None) -> subprocess.CompletedProcess:
    """The rendered script under bash, as the engine runs it, with a stand-in `python` that notes its launch;
    as_user: run as that uid and gid instead (only root can)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text('#!/bin/sh\ntouch "$KCHAIN_ROOT/launched"\n')
    (bin_dir / "python").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "KCHAIN_STATE_SINK": str(sink),
           "KCHAIN_ROOT": str(tmp_path / "root")}
    drop = [] if as_user is None else ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups"]
    return subprocess.run([*drop, "bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def users() -> list[int | None]:
    """Who runs the rendered script: this user; and, when this is root (CI here is), an unprivileged one too,
    for whom a read-only parent also refuses the mkdir (issue 59 item 3: root and not)."""
    return [None, NOBODY] if os.geteuid() == 0 and shutil.which("setpriv") else [None]


@pytest.mark.parametrize("target", ["skypilot", "slurm"])
@pytest.mark.parametrize("as_user", users(), ids=lambda uid: "this-user" if uid is None else f"uid-{uid}")
def test_a_missing_mount_stops_the_rendered_script_before_it_creates_anything(target, as_user):
    # For the unprivileged run, a folder every user reaches: pytest's and this suite's temporary folders are
    # root's alone (0700), so a path under them "does not exist" for another user.
    tmp_path = Path(tempfile.mkdtemp(prefix="kchain-sink-", dir=None if as_user is None else "/tmp"))
    tmp_path.chmod(0o777)
    job = load_job(code_job(tmp_path, target=target, skypilot=SKYPILOT, slurm=SLURM))
    text = render_for(job, target).engine_text
    script = yaml.safe_load(text)["run"] if target == "skypilot" else text
    # The mount point absent under a writable folder, and under a read-only one (which stops a mkdir only when
    # the user is not root: as root the check alone stops it).
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        for mount in (tmp_path / "kchain-state", read_only / "kchain-state"):
            done = run_rendered(script, tmp_path, mount / "target-job", as_user)
            assert done.returncode == 1, done.stderr
            assert done.stderr.splitlines() == [
                f"[kchain] the state sink {mount / 'target-job'} cannot be there: {mount} does not exist (a bucket "
                "that is not mounted, or a wrong name or path); stopping instead of training from nothing: fix the "
                "mount or KCHAIN_STATE_SINK's folder"]
            assert not mount.exists() and not (tmp_path / "root").exists()  # nothing made, nothing launched
        (tmp_path / "kchain-state").mkdir(mode=0o777)  # the mount there: the job's folder in it is made, run launched
        (tmp_path / "kchain-state").chmod(0o777)
        done = run_rendered(script, tmp_path, tmp_path / "kchain-state" / "target-job", as_user)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "kchain-state" / "target-job").is_dir() and (tmp_path / "root" / "launched").is_file()
        if as_user is not None:
            assert (tmp_path / "kchain-state" / "target-job").stat().st_uid == as_user  # it really ran as them
    finally:
        read_only.chmod(0o755)
        shutil.rmtree(tmp_path, ignore_errors=True)
