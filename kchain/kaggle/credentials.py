"""Where the official `kaggle` client finds the user's Kaggle credential, read without importing it.

Importing `kaggle` authenticates (and makes a config folder), so kchain follows the client's lookup
itself, here only: `kaggle_api` refuses early when there is no credential, `doctor` names the one the
client will use, `render` refuses a notebook that holds any secret found. The order is the client's,
read from kaggle 2.2.5 (`KaggleApi.authenticate`, the class attribute `KaggleApi.config_dir`,
`read_config_file`, `read_config_environment`) and kagglesdk 0.1.38 (`kaggle_env.get_access_token_from_env`,
`KaggleCredentials.load`):

1. an access token: inside a Kaggle notebook, the file KAGGLE_API_V1_TOKEN names; then
   KAGGLE_API_TOKEN (the token, or the path of a file holding it; an empty file means no token);
   then ~/.kaggle/access_token, then ~/.kaggle/access_token.txt;
2. a legacy API key: username and key from kaggle.json in the config folder, each replaced by
   KAGGLE_USERNAME / KAGGLE_KEY when set;
3. OAuth: the refresh token in ~/.kaggle/credentials.json (`kaggle auth login` writes it).

The config folder is KAGGLE_CONFIG_DIR; else ~/.kaggle, except on Linux when ~/.kaggle does not
exist: then $XDG_CONFIG_HOME/kaggle (default ~/.config/kaggle). The client asks Kaggle whether an
access token is valid and falls through to the next source when it is not; offline, the first
source found is the one it tries.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCESS_TOKEN, API_KEY, OAUTH = "access token", "API key", "OAuth"
TOKEN_ENV, USERNAME_ENV, KEY_ENV, CONFIG_DIR_ENV = "KAGGLE_API_TOKEN", "KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_CONFIG_DIR"
# Inside a Kaggle notebook (kagglesdk's is_in_kaggle_notebook): the session's own token file.
NOTEBOOK_ENVS, NOTEBOOK_TOKEN_ENV = ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_DATA_PROXY_URL"), "KAGGLE_API_V1_TOKEN"
CONFIG_FILE, OAUTH_FILE = "kaggle.json", "credentials.json"
TOKEN_FILES = ("access_token", "access_token.txt")  # under ~/.kaggle, whatever KAGGLE_CONFIG_DIR says
# A secret shorter than this is not looked for in what kchain writes: it would match by chance.
MIN_SECRET_CHARS = 8


@dataclass(frozen=True)
class Credential:
    """The credential the client will use: names and paths only, never the secret itself."""

    kind: str  # ACCESS_TOKEN, API_KEY or OAUTH
    source: str  # what a user reads: environment variable names, a file's path, or both
    file: Path | None = None  # the file it comes from, if any (its mtime dates the credential)

    def record(self) -> dict[str, Any]:
        """What doctor.json keeps: the source, the file and its mtime (a changed file is a new credential)."""
        try:
            mtime = self.file.stat().st_mtime if self.file else None
        except OSError:
            mtime = None
        return {"source": self.source, "file": str(self.file) if self.file else None, "mtime": mtime}


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())  # the client's expanduser("~") reads HOME


def _config_dirs(env: Mapping[str, str]) -> list[Path]:
    """Every folder the client may take kaggle.json from, its choice first."""
    if env.get(CONFIG_DIR_ENV):
        return [Path(env[CONFIG_DIR_ENV])]
    home_dir = _home(env) / ".kaggle"
    xdg = Path(env.get("XDG_CONFIG_HOME") or _home(env) / ".config") / "kaggle"
    # ~/.kaggle wins where it exists (the client's backward compatibility), and always off Linux.
    use_xdg = sys.platform.startswith("linux") and not home_dir.exists()
    return [xdg, home_dir] if use_xdg else [home_dir, xdg]


def config_dir(env: Mapping[str, str] | None = None) -> Path:
    """The folder the client reads kaggle.json from."""
    return _config_dirs(_env(env))[0]


def _text(path: Path) -> str | None:
    """A token file's text, stripped; None if it is not a readable file or holds nothing."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip() or None
    except (OSError, ValueError):
        return None


def _json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict; {} if it is missing or not a JSON object (the client ignores it then)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_file(value: str) -> bool:
    try:
        return Path(value).exists()
    except (OSError, ValueError):  # too long for a path, or a NUL in it: a token, not a file
        return False


def _access_token(env: Mapping[str, str]) -> tuple[Credential, str] | None:
    """kagglesdk's get_access_token_from_env: the first token found and where it came from."""
    if all(env.get(name) is not None for name in NOTEBOOK_ENVS) and env.get(NOTEBOOK_TOKEN_ENV):
        path = Path(env[NOTEBOOK_TOKEN_ENV])
        token = _text(path)
        if token:
            return Credential(ACCESS_TOKEN, NOTEBOOK_TOKEN_ENV, path), token
    value = env.get(TOKEN_ENV)
    if value:
        if not _is_file(value):
            return Credential(ACCESS_TOKEN, TOKEN_ENV), value
        token = _text(Path(value))
        # An empty token file ends the token search (the client returns there, files below unread).
        return (Credential(ACCESS_TOKEN, TOKEN_ENV, Path(value)), token) if token else None
    for name in TOKEN_FILES:
        path = _home(env) / ".kaggle" / name
        token = _text(path)
        if token:
            return Credential(ACCESS_TOKEN, str(path), path), token
    return None


def _api_key(env: Mapping[str, str]) -> Credential | None:
    """The legacy key: kaggle.json's username and key, each replaced by its environment variable."""
    path = config_dir(env) / CONFIG_FILE
    stored = _json(path)
    if not ((env.get(USERNAME_ENV) or stored.get("username")) and (env.get(KEY_ENV) or stored.get("key"))):
        return None
    from_env = [name for name in (USERNAME_ENV, KEY_ENV) if env.get(name)]
    if len(from_env) == 2:
        return Credential(API_KEY, f"{USERNAME_ENV}/{KEY_ENV}")
    return Credential(API_KEY, f"{from_env[0]} and {path}" if from_env else str(path), path)


def find(env: Mapping[str, str] | None = None) -> Credential | None:
    """The credential the client will try first, in its order; None when it would find none."""
    env = _env(env)
    token = _access_token(env)
    if token:
        return token[0]
    key = _api_key(env)
    if key:
        return key
    path = _home(env) / ".kaggle" / OAUTH_FILE
    if _json(path).get("refresh_token"):
        return Credential(OAUTH, str(path), path)
    return None


def configured_username(env: Mapping[str, str] | None = None) -> str | None:
    """The Kaggle user of the configured API key (KAGGLE_USERNAME, else kaggle.json's), without
    asking Kaggle; None when there is none. The key itself is never read."""
    env = _env(env)
    if env.get(USERNAME_ENV):
        return env[USERNAME_ENV]
    name = _json(config_dir(env) / CONFIG_FILE).get("username")
    return str(name) if name else None


def secret_strings(env: Mapping[str, str] | None = None) -> list[str]:
    """Every Kaggle secret where the client may look, for what kchain writes to refuse them: the
    key and the tokens, from the environment and from the files, whichever the client would use
    (kaggle.json in both candidate folders: the client moves to the other when ~/.kaggle goes).
    Strings shorter than MIN_SECRET_CHARS are left out: they would match by chance."""
    env = _env(env)
    found = [env.get(KEY_ENV, ""), env.get(TOKEN_ENV, "")]
    files = [_home(env) / ".kaggle" / name for name in TOKEN_FILES]
    files += [Path(env[name]) for name in (TOKEN_ENV, NOTEBOOK_TOKEN_ENV) if env.get(name) and _is_file(env[name])]
    found += [_text(path) or "" for path in files]
    for path in [folder / CONFIG_FILE for folder in _config_dirs(env)] + [_home(env) / ".kaggle" / OAUTH_FILE]:
        data = _json(path)
        found += [str(data.get(k) or "") for k in ("key", "refresh_token", "access_token")]
    return sorted({s for s in found if len(s) >= MIN_SECRET_CHARS})
