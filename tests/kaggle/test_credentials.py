"""kchain.kaggle.credentials follows the official client's credential lookup, and every place that asks agrees.

Each case plants a credential where the client would (or would not) look: the real client, asked
in a subprocess (importing kaggle authenticates and fixes its config folder at import), must pick
the same file and user as `credentials.find`; `kchain doctor --offline` names that source;
`kchain render` refuses training code holding its key; and `KaggleClient` refuses early exactly
when nothing is found.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_job, error_line, invoke

from kchain.emulator.app import PATIENCE_S
from kchain.errors import CredentialsError
from kchain.kaggle import credentials
from kchain.kaggle.client import MISSING_CREDENTIALS, KaggleClient

KEY = "c0ffee" * 4 + "5e1f0a2b"
DECOY = "decafbad" * 3 + "0b5e55ed"
ASK_THE_CLIENT = (
    "import json, kaggle\n"
    "v = kaggle.api.config_values\n"
    "print(json.dumps({'config': kaggle.api.config, 'user': v.get('username'), 'method': v.get('auth_method')}))\n"
)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the client reads XDG_CONFIG_HOME on Linux only")


def client_view() -> dict:
    """What the unmodified client picks with this environment, in a fresh process (an API key needs no
    network to be chosen; nothing here reaches Kaggle)."""
    done = subprocess.run([sys.executable, "-c", ASK_THE_CLIENT], env=dict(os.environ), capture_output=True,
                          text=True, timeout=PATIENCE_S, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_key(folder: Path, user: str, key: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kaggle.json"
    path.write_text(json.dumps({"username": user, "key": key}))
    path.chmod(0o600)
    return path


def credential_of(env: dict[str, str]) -> credentials.Credential:
    """The credential credentials.find picks with this environment, where there is one."""
    credential = credentials.find(env)
    assert credential is not None
    return credential


def home() -> Path:
    return Path(os.environ["HOME"])


def xdg_kaggle() -> Path:
    return Path(os.environ["XDG_CONFIG_HOME"]) / "kaggle"


def plant(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Put KEY where `case` says; the (source the client will use, its user)."""
    if case == "xdg":  # no ~/.kaggle and no KAGGLE_CONFIG_DIR: the client follows XDG
        monkeypatch.delenv("KAGGLE_CONFIG_DIR")
        shutil.rmtree(home() / ".kaggle")
        return str(write_key(xdg_kaggle(), "xdg-user", KEY)), "xdg-user"
    if case == "home-over-xdg":  # ~/.kaggle exists: it wins over XDG, whose key the client never reads
        monkeypatch.delenv("KAGGLE_CONFIG_DIR")
        write_key(xdg_kaggle(), "xdg-decoy", DECOY)
        return str(write_key(home() / ".kaggle", "home-user", KEY)), "home-user"
    if case == "config-dir":
        monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "elsewhere"))
        write_key(home() / ".kaggle", "home-decoy", DECOY)
        return str(write_key(tmp_path / "elsewhere", "dir-user", KEY)), "dir-user"
    if case == "env":  # both variables set: they replace kaggle.json's username and key
        write_key(Path(os.environ["KAGGLE_CONFIG_DIR"]), "file-decoy", DECOY)
        monkeypatch.setenv("KAGGLE_USERNAME", "env-user")
        monkeypatch.setenv("KAGGLE_KEY", KEY)
        return "KAGGLE_USERNAME/KAGGLE_KEY", "env-user"
    if case == "env-user-file-key":  # the client merges them, key by key
        path = write_key(Path(os.environ["KAGGLE_CONFIG_DIR"]), "file-user", KEY)
        monkeypatch.setenv("KAGGLE_USERNAME", "env-user")
        return f"KAGGLE_USERNAME and {path}", "env-user"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [pytest.param("xdg", marks=linux_only), pytest.param("home-over-xdg", marks=linux_only),
                                  "config-dir", "env", "env-user-file-key"])
def test_every_lookup_place_agrees_with_the_client(case, tmp_path, monkeypatch):
    source, user = plant(case, tmp_path, monkeypatch)
    found = credentials.find()
    assert found is not None and (found.kind, found.source) == (credentials.API_KEY, source)
    assert credentials.configured_username() == user

    client = client_view()
    assert (client["user"], client["method"]) == (user, "LEGACY_API_KEY")
    assert client["config"] == str(credentials.config_dir() / "kaggle.json")

    job = copy_job("tinygpt", tmp_path / "job")
    doctor = invoke("doctor", job, "--offline")
    assert f"ok    credentials  the client will use {source}" in doctor.output.splitlines(), doctor.output

    assert KEY in credentials.secret_strings()
    train = job.parent / "train.py"
    train.write_text(train.read_text() + f"# {KEY}\n")
    refused = invoke("render", job, "-o", tmp_path / "out")
    assert refused.exit_code == 10 and "code: code/train.py holds your Kaggle key" in error_line(refused)


@linux_only
def test_a_key_only_under_xdg_while_home_kaggle_exists_is_not_a_credential(tmp_path, monkeypatch):
    monkeypatch.delenv("KAGGLE_CONFIG_DIR")
    write_key(xdg_kaggle(), "xdg-user", KEY)  # ~/.kaggle exists (empty): the client never looks under XDG
    assert credentials.find() is None and credentials.configured_username() is None
    assert client_view()["user"] is None
    with pytest.raises(CredentialsError, match="^" + MISSING_CREDENTIALS.replace("(", r"\(").replace(")", r"\)")):
        KaggleClient().api  # noqa: B018 - refused before kaggle is imported
    doctor = invoke("doctor", copy_job("tinygpt", tmp_path / "job"), "--offline")
    assert f"FAIL  credentials  {MISSING_CREDENTIALS}" in doctor.output.splitlines()
    assert KEY in credentials.secret_strings()  # still never written: the client moves there once ~/.kaggle goes


def test_access_tokens_come_first_in_the_clients_order(tmp_path, monkeypatch):
    env = {"HOME": str(tmp_path), "KAGGLE_USERNAME": "u", "KAGGLE_KEY": KEY}
    (tmp_path / ".kaggle").mkdir()
    assert credential_of(env).source == "KAGGLE_USERNAME/KAGGLE_KEY"
    (tmp_path / ".kaggle" / "access_token.txt").write_text(f"{DECOY}\n")
    assert credentials.find(env) == credentials.Credential(credentials.ACCESS_TOKEN,
                                                           str(tmp_path / ".kaggle" / "access_token.txt"),
                                                           tmp_path / ".kaggle" / "access_token.txt")
    token_file = tmp_path / "token"
    token_file.write_text("")  # KAGGLE_API_TOKEN naming an empty file: no token at all, the key is next
    assert credential_of({**env, "KAGGLE_API_TOKEN": str(token_file)}).kind == credentials.API_KEY
    token_file.write_text("KGAT_" + DECOY)
    assert credential_of({**env, "KAGGLE_API_TOKEN": str(token_file)}).file == token_file
    assert "KGAT_" + DECOY in credentials.secret_strings({**env, "KAGGLE_API_TOKEN": str(token_file)})
    assert credential_of({**env, "KAGGLE_API_TOKEN": "KGAT_" + DECOY}).source == "KAGGLE_API_TOKEN"


def test_oauth_credentials_count_only_with_a_refresh_token(tmp_path):
    env = {"HOME": str(tmp_path)}
    (tmp_path / ".kaggle").mkdir()
    oauth = tmp_path / ".kaggle" / "credentials.json"
    oauth.write_text(json.dumps({"username": "u"}))
    assert credentials.find(env) is None
    oauth.write_text(json.dumps({"username": "u", "refresh_token": DECOY}))
    assert credentials.find(env) == credentials.Credential(credentials.OAUTH, str(oauth), oauth)
    assert credentials.secret_strings(env) == [DECOY]
