"""A short week as a wheel user has it (issue 61): kchain's wheel, built once from a copy of this checkout
(`pip wheel --no-deps`), installed into a fresh venv outside the source tree, run from a folder of its own.
The venv reuses the dependencies already installed here (a `.pth` naming this environment's site-packages,
whose own `.pth` files, the editable kchain's among them, are not run), so `kchain` is the wheel's: the test
checks `kchain.__file__`. From there: `kchain init`, `kchain smoke`, a local Kaggle (`kchain emulator serve`,
strict), a push, its session to the end, a pull, and `pull --force -o` on the job's own folder, refused with
the job and its ledger left whole (issue 61, item 1)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from emulator_helpers import fake_key
from test_packaging import LEFT_BEHIND

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a hung step fails the test instead of hanging CI; never a speed bound


def run(args: list[str], cwd: Path, env: dict[str, str], code: int = 0) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    said = done.stdout + done.stderr
    assert done.returncode == code, f"{' '.join(args[:3])} exited {done.returncode}:\n{said[-4000:]}"
    return said


def fresh_venv(root: Path, wheel_dir: Path) -> Path:
    """The wheel, built from a copy of the checkout, installed into a fresh venv that sees this environment's
    packages; returns the venv's bin folder."""
    source = root / "kchain-src"
    shutil.copytree(REPO, source, ignore=LEFT_BEHIND)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
         str(wheel_dir), str(source)], root, dict(os.environ))
    (wheel,) = wheel_dir.glob("kchain-*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, dict(os.environ))
    bin_dir = venv / "bin"
    site = Path(run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    root, dict(os.environ)).strip())
    (site / "_reuse_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], root,
        dict(os.environ))
    return bin_dir


def serve(bin_dir: Path, state: Path, cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, dict[str, str]]:
    """`kchain emulator serve` from the venv, and the environment its `export` lines give."""
    proc = subprocess.Popen([str(bin_dir / "kchain"), "emulator", "serve", "--state", str(state), "--user",
                             f"alice:{fake_key()}"], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    exported: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").strip().partition("=")
            exported[name] = value
        if "KAGGLE_KEY" in exported:
            return proc, exported
    raise AssertionError(f"the emulator ended ({proc.wait()}) before it printed its environment")


@pytest.mark.slow
def test_a_week_from_the_wheel_in_a_fresh_venv(tmp_path):
    bin_dir = fresh_venv(tmp_path / "build", tmp_path / "wheel")
    home = tmp_path / "user"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KCHAIN_HOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    where = run([str(bin_dir / "python"), "-c", "import kchain; print(kchain.__file__)"], home, env).strip()
    assert Path(where).is_relative_to(bin_dir.parent) and not Path(where).is_relative_to(REPO / "kchain"), where

    run(["kchain", "init", "myjob"], home, env)
    job = home / "myjob" / "job.yaml"
    job.write_text(job.read_text().replace("steps: 600 ", "steps: 40  "))  # a short week
    assert "PASS" in run(["kchain", "smoke", "myjob/job.yaml", "--quiet"], home, env)

    emulator, exported = serve(bin_dir, tmp_path / "kaggle", home, env)
    try:
        env.update(exported)
        run(["kchain", "push", "myjob/job.yaml"], home, env)
        run(["kchain", "logs", "myjob/job.yaml", "--follow", "--poll", "1"], home, env)
        assert "training is complete" in run(["kchain", "continue", "myjob/job.yaml"], home, env)
        run(["kchain", "pull", "myjob/job.yaml", "-o", "weights"], home, env)
        assert (home / "weights" / "model.safetensors").is_file()

        before = sorted(p.relative_to(home / "myjob") for p in (home / "myjob").rglob("*"))
        refused = run(["kchain", "pull", "myjob/job.yaml", "--force", "-o", "myjob"], home, env, code=1)
        assert refused.splitlines()[-1].startswith("Error: myjob is a job's folder ("), refused
        assert sorted(p.relative_to(home / "myjob") for p in (home / "myjob").rglob("*")) == before
        assert {"job.yaml", "train.py", ".kchain"} <= {p.name for p in (home / "myjob").iterdir()}
    finally:
        os.killpg(emulator.pid, signal.SIGINT)
        emulator.communicate(timeout=60)  # its pipe read to the end and closed
