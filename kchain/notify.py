"""`kchain continue --watch --notify CMD`: a shell command run at each event of a watched chain, with
the event in its environment, so that a user wires it to whatever they read (a desktop notification,
a chat webhook, a mail).

The environment holds KCHAIN_EVENT (one of EVENTS), KCHAIN_JOB (the job's name), KCHAIN_MESSAGE (the
line kchain printed for it) and KCHAIN_SESSION (the session it concerns, or empty). A command that
fails or hangs is reported in one line and never stops the chain.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

Echo = Callable[[str], None]
Notify = Callable[[str, str, "int | None"], None]

SESSION_ENDED = "session_ended"  # a session ended and the watch pushed the next one
FINISHED = "finished"  # training is complete: the watch ends
NEEDS_PERSON = "needs_person"  # the chain stopped for a decision that needs you (a crash, no progress, the quota)
FAILED = "failed"  # the watch itself failed (Kaggle unreachable past its retries, credentials, an error)
EVENTS = (SESSION_ENDED, FINISHED, NEEDS_PERSON, FAILED)
TIMEOUT_S = 60  # a notifier is a quick call; one that hangs must not hold the chain


def nobody(event: str, message: str, session: int | None = None) -> None:
    """No --notify: events go nowhere (the watch prints its lines anyway)."""


def notifier(command: str, job: str, echo: Echo) -> Notify:
    """A Notify that runs command in the shell with the event in its environment; its output is echoed."""

    def notify(event: str, message: str, session: int | None = None) -> None:
        env = {**os.environ, "KCHAIN_EVENT": event, "KCHAIN_JOB": job, "KCHAIN_MESSAGE": message,
               "KCHAIN_SESSION": "" if session is None else str(session)}
        try:
            done = subprocess.run(command, shell=True, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            echo(f"[kchain] --notify for {event}: still running after {TIMEOUT_S}s, left behind; the chain goes on")
            return
        for line in (done.stdout + done.stderr).splitlines():
            echo(f"[notify] {line}")
        if done.returncode != 0:
            echo(f"[kchain] --notify for {event} exited {done.returncode}; the chain goes on")

    return notify
