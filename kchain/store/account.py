"""One Kaggle account's GPU sessions, across job folders: Kaggle's weekly GPU quota is the account's, but
each job folder keeps its own ledger (`.kchain/`), so a second job folder would plan as if the first had
spent nothing. Every GPU session a ledger on this laptop saves is noted here too, under the user's kchain
config home (`$KCHAIN_CONFIG_HOME`, else `$XDG_CONFIG_HOME/kchain`, else `~/.config/kchain`), in
`accounts/<username>.json`, keyed by the kernel version it ran (`owner/slug/N`, one session on Kaggle);
the username is the kernel's owner, the credential's user. No key or token is ever read or stored here.

Two commands may note sessions at once (two job folders pushing): each note is a read-modify-write under
an exclusive lock on `accounts/<username>.lock`, written atomically (common/atomic.py). Notes of sessions
that started more than KEEP ago are dropped (the ledger says when), so the file stays a few weeks long.
A damaged file is refused with its path, never rewritten. Kaggle's own count (quota_view's gpu_quota)
wins where it answers with a higher one (kchain/chain/budget.py); its strict answer has no GPU figures.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from kchain.common.atomic import write_json
from kchain.common.layout import CONFIG_HOME_ENV
from kchain.errors import StateError

ACCOUNTS_DIR = "accounts"
KEEP = timedelta(days=15)  # two quota weeks and a day: every session of this week and the last
# What a note keeps of a session record (sessionrecord.SessionRecord's names), beside its job and folder.
FIELDS = ("session", "status", "started", "ended")


def config_home() -> Path:
    """kchain's config home: $KCHAIN_CONFIG_HOME, else $XDG_CONFIG_HOME/kchain, else ~/.config/kchain."""
    if os.environ.get(CONFIG_HOME_ENV):
        return Path(os.environ[CONFIG_HOME_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kchain"


def path_of(user: str) -> Path:
    return config_home() / ACCOUNTS_DIR / f"{user}.json"


def noted(user: str) -> dict[str, dict[str, Any]]:
    """The account's noted GPU sessions: `owner/slug/N` -> {job, session, status, started, ended, folder}."""
    return _read(path_of(user))


def note(user: str, key: str, entry: dict[str, Any], since: str) -> None:
    """Note (or update) one GPU session of the account, locked against another command's note; notes of
    sessions that started before `since` (ISO UTC, as the ledger writes times: they sort as text) are dropped."""
    path = path_of(user)
    with _locked(path):
        before = _read(path)
        data = {k: e for k, e in {**before, key: entry}.items() if str(e.get("started") or since) >= since}
        if data != before:  # most notes of a session that is polled change nothing
            write_json(path, data)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a note is quick: wait for the other command's
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    fix = "fix it by hand, or move the file aside: kchain starts a new one (this laptop then forgets the account's week)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise StateError(f"{path}: cannot read it ({exc}); {fix}") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        raise StateError(f"{path}: not valid JSON; {fix}") from None
    if not isinstance(data, dict) or not all(isinstance(e, dict) for e in data.values()):
        raise StateError(f"{path}: expected an object of sessions; {fix}")
    return data
