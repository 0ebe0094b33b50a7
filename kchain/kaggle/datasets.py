"""Kaggle datasets as kchain uses them: create one if missing, wait until a version is ready, add a
version exactly once. A lost answer is always settled by looking at the dataset, never by sending
the same request blindly again.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kchain.common.layout import STATE_MARKER
from kchain.common.sendonce import TAKEN, NotLanded, send_and_settle, settle
from kchain.common.statefolder import write_dataset_metadata
from kchain.errors import KaggleError
from kchain.kaggle.client import KaggleClient, lost_answer, missing
from kchain.store.names import state_dataset

Echo = Callable[[str], None]


def ensure_dataset(client: KaggleClient, ref: str, title: str, echo: Echo, attempts: int = 4,
                   settle_s: float = 30.0) -> bool:
    """Create a private dataset holding only a marker if it does not exist; True if it was made.
    A lost answer is settled by looking for the dataset (a new one can stay hidden for a while)."""
    if client.dataset_exists(ref):
        return False
    folder = Path(tempfile.mkdtemp(prefix="kchain-dataset-"))
    try:
        (folder / STATE_MARKER).write_text(json.dumps({"dataset": ref, "session": 0, "step": None}) + "\n")
        write_dataset_metadata(folder, ref, title)
        # A new dataset may stay hidden a while, so a lost answer is read once and sent again at once: if
        # the lost one landed, Kaggle refuses the slug as taken. Only the last is given settle_s to show.
        try:
            send_and_settle(lambda: client.create_dataset(folder, public=False, dir_mode="skip"),
                            lambda: client.dataset_exists(ref), lost=lost_answer, attempts=attempts, settle_s=0.0)
        except NotLanded as exc:
            if not settle(lambda: client.dataset_exists(ref), settle_s):
                raise KaggleError(f"{ref}: {exc}; run the command again later") from exc
        except KaggleError as exc:
            if TAKEN not in str(exc):
                raise  # else an earlier send whose answer was lost created it
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    echo(f"  created dataset {ref}")
    return True


def ensure_state_dataset(client: KaggleClient, owner: str, name: str, echo: Echo) -> None:
    """<owner>/<name>-state, which the chain versions with each session's end state."""
    ensure_dataset(client, state_dataset(owner, name), f"{name} state", echo)


def wait_ready(client: KaggleClient, ref: str, echo: Echo, timeout_s: float = 1800, poll_s: float = 0.5,
               hidden_s: float = 600) -> None:
    """Poll the dataset until its newest version is ready. A version that is still processing can
    answer 403 or 404 for a while (Kaggle hides it until it is ready): that is waited out for
    hidden_s, then taken as "missing"."""
    started = time.time()
    delay = poll_s
    last = None
    while True:
        try:
            status = client.dataset_status(ref)
        except KaggleError as exc:
            if not missing(exc) or time.time() - started > hidden_s:
                raise
            status = "not visible yet"
        if status == "ready":
            return
        if status in ("failed", "deleted"):
            raise KaggleError(f"dataset {ref} is {status}; look at it on Kaggle, then run `kchain continue` again")
        if status != last:
            echo(f"  waiting for {ref}: {status}")
            last = status
        if time.time() - started > timeout_s:
            raise KaggleError(f"dataset {ref} is still {status} after {timeout_s:.0f}s; run `kchain continue` later")
        time.sleep(delay * (0.8 + 0.4 * random.random()))
        delay = min(delay * 1.5, 30.0)


def current_version(client: KaggleClient, ref: str, echo: Echo) -> int:
    """The dataset's newest version number, read once it is ready (a processing version's number lags)."""
    wait_ready(client, ref, echo)
    return client.dataset_version_number(ref)


def new_version(client: KaggleClient, folder: Path, ref: str, notes: str, dir_mode: str, echo: Echo,
                before: int | None = None, attempts: int = 4) -> int:
    """Upload folder as a new version of ref exactly once and return its number. A lost answer is
    settled by looking at the dataset's versions: a new one means it landed, else it is sent again."""
    if before is None:
        before = current_version(client, ref, echo)

    def landed() -> int | None:
        now = current_version(client, ref, echo)
        return now if now != before else None

    try:
        _, now = send_and_settle(lambda: client.version_dataset(folder, notes, dir_mode=dir_mode), landed,
                                 lost=lost_answer, attempts=attempts, settle_s=0.0)
    except NotLanded as exc:
        raise KaggleError(f"{ref}: {exc}; run `kchain continue` again later") from exc
    if now:
        echo(f"  the answer to the upload was lost, but {ref} has version {now}: using it")
        return now
    return current_version(client, ref, echo)
