# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""Hostile and careless input: no secret leaves the laptop, and every bad input is one `Error:` line.

The secret tests plant each kind of credential in a job's folder and look for it, byte for byte,
in the rendered notebook, its metadata, the zip payload inside the notebook, and what the local
Kaggle stored for a real push with the unmodified client.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from emulator_helpers import emulator  # noqa: F401
from helpers import copy_job, error_line, invoke

from kchain.emulator.app import PATIENCE_S
from kchain.store.ledger import Ledger

TRAIN = "def main(run):\n    pass\n"
JOB = "name: secret-test\ncode: src\nkaggle: {accelerator: none}\ntrain: {session_limit: 10m, margin: 1m}\n"
# Each kind of secret, by name (relative to the code folder), with a marker only that file holds.
PLANTED = ["kaggle.json", ".env", ".env.production", "deploy/server.pem", "tls.key", "id_rsa", "id_rsa.pub",
           ".netrc", ".git/config", ".kchain/sessions.json", ".venv/lib/site.py", "__pycache__/train.cpython-311.pyc",
           "sub/.env", "data/big.bin", "notes.secret"]


def marker(name: str) -> str:
    return "PLANTED-" + re.sub(r"[^A-Za-z0-9]", "-", name) + "-7f3a9c"


def job_with_secrets(root: Path) -> Path:
    src = root / "src"
    src.mkdir(parents=True)
    (src / "train.py").write_text(TRAIN)
    for name in PLANTED:
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(marker(name) + "\n")
    (src / ".kchainignore").write_text("# the user's own exclusions\ndata/\n")
    (root / ".kchainignore").write_text("src/*.secret\n")
    job = root / "job.yaml"
    job.write_text(JOB)
    return job


def payload_files(notebook_text: str) -> dict[str, bytes]:
    """The zip embedded in a rendered notebook, file by file."""
    nb = nbformat.reads(notebook_text, as_version=4)
    source = next(c.source for c in nb.cells if "KCHAIN_PAYLOAD = " in c.source)
    found = re.search(r'KCHAIN_PAYLOAD = "([A-Za-z0-9+/=]+)"', source)
    assert found is not None, "no payload in the notebook"
    encoded = found.group(1)
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(encoded))) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def leaks(texts: dict[str, bytes]) -> list[str]:
    return [f"{name} in {where}" for name in PLANTED for where, data in texts.items() if marker(name).encode() in data]


def test_render_embeds_no_planted_secret_and_lists_what_it_left_out(tmp_path):
    job = job_with_secrets(tmp_path)
    out = tmp_path / "out"
    result = invoke("render", job, "-o", out)
    assert result.exit_code == 0, result.output
    notebook = (out / "secret-test.ipynb").read_text()
    files = payload_files(notebook)
    code = sorted(n for n in files if n.startswith("code/"))
    assert code == ["code/.kchainignore", "code/train.py"]
    texts = {"notebook": notebook.encode(), "metadata": (out / "kernel-metadata.json").read_bytes(), **files}
    assert leaks(texts) == []
    assert "embedded code/train.py (24 B)" in result.output
    for name, why in [("kaggle.json", "a credential file"), (".env", "a credential file"),
                      ("deploy/server.pem", "a credential file"), ("id_rsa.pub", "a credential file"),
                      ("sub/.env", "a credential file"), (".git/", "a credential file")]:
        assert f"left out code/{name} ({why})" in result.output or name == ".git/", result.output
    assert "left out code/data/ (in .kchainignore)" in result.output
    assert "left out code/notes.secret (in .kchainignore)" in result.output
    assert "payload: 2 files of your code" in result.output


def test_a_push_sends_no_planted_secret(emulator, tmp_path):
    job = job_with_secrets(tmp_path / "job")
    pushed = invoke("push", job, "--skip-smoke")
    assert pushed.exit_code == 0, pushed.output
    for session in emulator.sessions():
        emulator.wait_session(session["kernel"], session["version"])
    stored = {str(p): p.read_bytes() for p in emulator.store.root.rglob("*") if p.is_file()}
    sources = [data for path, data in stored.items() if path.endswith("/source")]
    assert sources, sorted(stored)
    for data in sources:
        stored.update({f"payload {n}": b for n, b in payload_files(data.decode()).items()})
    assert leaks(stored) == []


def test_a_file_holding_the_kaggle_key_is_refused_and_nothing_is_pushed(emulator, tmp_path):
    root = tmp_path / "job"
    (root / "src").mkdir(parents=True)
    (root / "src" / "train.py").write_text(TRAIN)
    (root / "src" / "settings.py").write_text(f"KEY = {os.environ['KAGGLE_KEY']!r}\n")
    (root / "job.yaml").write_text(JOB)
    pushed = invoke("push", root / "job.yaml", "--skip-smoke")
    assert pushed.exit_code == 10
    assert error_line(pushed) == (
        f"Error: {root / 'job.yaml'}: code: code/settings.py holds your Kaggle key; remove it (attach it to the "
        "notebook as a Kaggle Secret instead) or list the file in .kchainignore"
    )
    assert emulator.sessions() == []
    (root / "src" / ".kchainignore").write_text("settings.py\n")
    assert invoke("render", root / "job.yaml", "-o", tmp_path / "out").exit_code == 0


@pytest.mark.parametrize("where", ["env", "token-file", "kaggle.json"])
def test_the_key_is_found_where_the_kaggle_client_reads_it(tmp_path, monkeypatch, where):
    key = "k" * 8 + "5e1f0a2b3c4d" + "z" * 8
    if where == "env":
        monkeypatch.setenv("KAGGLE_API_TOKEN", key)
    elif where == "token-file":
        (Path.home() / ".kaggle" / "access_token").write_text(key + "\n")
    else:
        (Path(os.environ["KAGGLE_CONFIG_DIR"]) / "kaggle.json").write_text(json.dumps({"username": "u", "key": key}))
    (tmp_path / "train.py").write_text(TRAIN + f"# {key}\n")
    (tmp_path / "job.yaml").write_text("name: secret-test\ncode: train.py\n")
    result = invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert "code: code/train.py holds your Kaggle key" in error_line(result)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "job.yaml").write_text(f"name: secret-test\ncode: train.py\nparams: {{token: {key}}}\n")
    result = invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out")
    assert error_line(result) == (f"Error: {tmp_path / 'job.yaml'}: params: a value holds your Kaggle key; remove it "
                                  "(attach it to the notebook as a Kaggle Secret instead)")
    assert not (tmp_path / "out").exists()


def test_code_outside_the_job_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "train.py").write_text(TRAIN)
    root = tmp_path / "job"
    root.mkdir()
    (root / "job.yaml").write_text("name: secret-test\ncode: ../elsewhere\n")
    result = invoke("render", root / "job.yaml")
    assert error_line(result) == (f"Error: {root / 'job.yaml'}: code: '../elsewhere' resolves to "
                                  f"{outside}, outside the job's folder; move the code next to the job file")
    (root / "linked").symlink_to(outside)
    (root / "job.yaml").write_text("name: secret-test\ncode: linked\n")
    assert "outside the job's folder" in error_line(invoke("render", root / "job.yaml"))
    # A link inside the code folder to a file out of the job's folder: refused, not followed.
    (root / "src").mkdir()
    (root / "src" / "train.py").write_text(TRAIN)
    (root / "src" / "creds.txt").symlink_to(Path.home() / ".kaggle" / "whatever.txt")
    (root / "job.yaml").write_text("name: secret-test\ncode: src\n")
    result = invoke("render", root / "job.yaml", "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert error_line(result) == (
        f"Error: {root / 'job.yaml'}: code: creds.txt links to {Path.home() / '.kaggle' / 'whatever.txt'}, outside "
        "the job's folder; copy the file in or list it in .kchainignore"
    )
    (root / "src" / ".kchainignore").write_text("creds.txt\n")
    assert invoke("render", root / "job.yaml", "-o", tmp_path / "out").exit_code == 0


def test_a_payload_over_the_limit_names_the_biggest_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(TRAIN)
    (src / "weights.bin").write_bytes(b"\0" * (4 * 2**20))
    (src / "tokens.npy").write_bytes(b"\0" * (2 * 2**20))
    (tmp_path / "job.yaml").write_text("name: secret-test\ncode: src\n")
    result = invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert error_line(result) == (
        f"Error: {tmp_path / 'job.yaml'}: code: 'src' holds 6.0 MB, over the 5.0 MB limit (biggest: code/weights.bin "
        "4.0 MB, code/tokens.npy 2.0 MB, code/train.py 24 B); list data in .kchainignore and attach it as a dataset"
    )
    (src / ".kchainignore").write_text("*.bin\n")
    assert invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out").exit_code == 0


# -- train.py and the job file as files -----------------------------------------------------------


@pytest.mark.parametrize("content, message", [
    ("def main(run):\n    return 'é'\n".encode("utf-16"), "train.py is UTF-16 text; save it as UTF-8 Python source"),
    ("def main(run):\n    return 'é'\n".encode("latin-1"),
     "train.py is not UTF-8 (byte 0xe9 at offset 27; Latin-1?); save it as UTF-8 Python source"),
    (bytes(range(256)), "train.py is not text (it holds NUL bytes); save it as UTF-8 Python source"),
])
def test_a_train_py_that_is_not_utf8_is_one_line(tmp_path, content, message):
    (tmp_path / "train.py").write_bytes(content)
    (tmp_path / "job.yaml").write_text("name: tinygpt-notes\ncode: train.py\n")
    result = invoke("render", tmp_path / "job.yaml")
    assert result.exit_code == 10
    assert error_line(result) == f"Error: {tmp_path / 'job.yaml'}: code: {message}"


def test_a_job_file_that_is_a_folder_or_empty(tmp_path):
    (tmp_path / "job.yaml").mkdir()
    result = invoke("render", tmp_path / "job.yaml")
    assert result.exit_code == 10
    assert error_line(result) == f"Error: {tmp_path / 'job.yaml'}: is a folder; pass the path of your job.yaml"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for command in ("render", "smoke", "push", "status", "logs", "continue", "budget", "plot", "rehearse"):
        result = invoke(command, empty)
        assert result.exit_code == 10, (command, result.output)
        assert error_line(result) == f"Error: {empty}: is empty; write at least name: and code: (see the README)"


# -- other commands' input ------------------------------------------------------------------------


def good_job(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    job = tmp_path / "job.yaml"
    job.write_text("name: tinygpt-notes\ncode: train.py\n")
    return job


@pytest.mark.parametrize("args, message", [
    (["logs", "--session", "abc"], "Error: Invalid value for '--session': 'abc' is not a valid integer range."),
    (["logs", "--session", "0"], "Error: Invalid value for '--session': 0 is not in the range x>=1."),
    (["logs", "--poll", "nan"], "Error: Invalid value for '--poll': 'nan' is not a number of seconds"),
    (["rehearse", "--session-limit", "-1"], "Error: Invalid value for '--session-limit': -1.0 is not in the range "
                                            "1.0<=x<=43200.0."),
    (["rehearse", "--kills", "-3"], "Error: Invalid value for '--kills': -3 is not in the range 0<=x<=100."),
    (["rehearse", "--set", "steps"], "Error: --set 'steps': write it as name=value, e.g. --set steps=300"),
    (["rehearse", "--set", "steps=[1, 2"], "Error: --set 'steps=[1, 2': the value is not one YAML value; quote it, "
                                           "e.g. --set 'steps=\"...\"'"),
    (["rehearse", "--set", "start=!!timestamp 2024-01-01"], "Error: --set 'start=!!timestamp 2024-01-01': the date "
                                                            "'2024-01-01' is not JSON; quote it"),
    (["rehearse", "--set", "x=&a [*a]"], "Error: --set 'x=&a [*a]': the value is not one YAML value; quote it, "
                                         "e.g. --set 'x=\"...\"'"),
])
def test_bad_options_are_one_error_line(tmp_path, args, message):
    job = good_job(tmp_path)
    result = invoke(args[0], job, *args[1:])
    assert result.exit_code == 2, result.output
    assert error_line(result) == message
    assert "Traceback" not in result.output


def test_a_damaged_sessions_file_is_refused_with_its_path_and_kept(tmp_path):
    job = good_job(tmp_path)
    state = Path(os.environ["KCHAIN_HOME"])
    state.mkdir(parents=True)
    sessions = state / "sessions.json"
    for damaged, why in [('{"tinygpt-notes": [{"session": 1, "status": "RUNNING"', "not valid JSON"),
                         (b"\xff\xfe{}".decode("latin-1"), "not UTF-8 text"),
                         ('["a list"]', "expected a JSON object"),
                         ('{"tinygpt-notes": [{"session": "one", "status": "COMPLETE"}]}', "'session' is not a number"),
                         ('{"tinygpt-notes": [{"session": 1, "status": "COMPLETE", "started": "yesterday"}]}',
                          "'started' is not a time")]:
        sessions.write_bytes(damaged.encode("latin-1"))
        for command in ("status", "budget", "logs"):
            result = invoke(command, job)
            assert "Traceback" not in result.output
            assert result.exit_code == 1, (command, result.output)
            assert error_line(result).startswith(f"Error: {sessions}: "), (command, result.output)
            assert why in error_line(result)
            assert error_line(result).endswith("fix it by hand, or move the file aside and kchain starts a new one")
        assert sessions.read_bytes() == damaged.encode("latin-1")  # nothing the user recorded is lost


def test_a_damaged_run_log_is_refused_or_padded_and_never_loses_a_row(tmp_path):
    job = good_job(tmp_path)
    runs = Path(os.environ["KCHAIN_HOME"]) / "runs.csv"
    runs.parent.mkdir(parents=True)
    header = "run_id,date,channel,job,config,steps,val,checkpoint,note\n"
    # A short row (an older kchain, a hand edit) is padded: shown, and kept when a row is added.
    runs.write_text(header + "smoke-1,2026-01-01T00:00:00Z,smoke,tinygpt-notes\n")
    result = invoke("runs", job)
    assert result.exit_code == 0 and "smoke-1" in result.output
    Ledger(runs.parent).append_run(run_id="smoke-2", channel="smoke", job="tinygpt-notes")
    assert [r["run_id"] for r in Ledger(runs.parent).runs()] == ["smoke-1", "smoke-2"]
    cases: list[tuple[str | bytes, str]] = [(header + "a,b,c,d,e,f,g,h,i,j,k\n", "row 2 has 11 fields, the header 9"),
                                            ("who,what\nx,y\n", "the header is not run_id,date,"),
                                            (header.encode() + b"\xe9t\xe9\n", "not UTF-8 text")]
    for damaged, why in cases:
        data = damaged if isinstance(damaged, bytes) else damaged.encode()
        runs.write_bytes(data)
        result = invoke("runs", job)
        assert result.exit_code == 1, result.output
        assert error_line(result).startswith(f"Error: {runs}: ") and why in error_line(result), result.output
        with pytest.raises(Exception, match="move the file aside"):
            Ledger(runs.parent).append_run(run_id="smoke-3", channel="smoke", job="tinygpt-notes")
        assert runs.read_bytes() == data


def test_native_windows_is_refused_at_start_with_use_wsl():
    code = "import os; os.name = 'nt'; from kchain.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "render"], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 1
    assert done.stderr.strip() == ("Error: kchain runs on Linux and macOS only (it needs POSIX signals and file "
                                   "locks); on Windows, use WSL")


def test_links_inside_the_code_folder_are_listed_not_followed(tmp_path):
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    (src / "train.py").write_text(TRAIN)
    (src / "loop").symlink_to(src / "loop")
    (src / "alias").symlink_to(src / "lib")
    (tmp_path / "job.yaml").write_text("name: secret-test\ncode: src\n")
    result = invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "left out code/loop (a broken link)" in result.output
    assert "left out code/alias/ (a linked folder (not followed))" in result.output


def test_a_path_the_machine_refuses_is_one_line_with_its_own_exit_code(tmp_path):
    import errno

    from kchain.errors import MachineError

    job = copy_job("tinygpt", tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = invoke("render", job, "--out", blocker / "out")
    assert result.exit_code == MachineError.exit_code == 11, result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert line == (f"Error: Not a directory: {blocker / 'out'} (a part of the path is a file, not a folder: check "
                    "the path)")
    assert "Traceback" not in result.output
    full = MachineError.of(OSError(errno.ENOSPC, "No space left on device", "/k/state.pt"))
    assert str(full).startswith("No space left on device: /k/state.pt (the disk is full: free some space")
    assert "read-only file system" in str(MachineError.of(OSError(errno.EROFS, "Read-only file system", "/k")))
