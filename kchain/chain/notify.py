"""`kchain continue --watch --notify CMD` (and `kchain queue --notify`, `kchain rehearse --notify`): a shell command run at each event of a watched chain, with
the event in its environment, so that a user wires it to whatever they read (a desktop notification,
a chat webhook, a mail).

The environment holds KCHAIN_EVENT (one of EVENTS), KCHAIN_JOB (the job's name), KCHAIN_MESSAGE (the
line kchain printed for it) and KCHAIN_SESSION (the session it concerns, or empty). A command that
fails, or runs past TIMEOUT_S (then it is stopped, with its children), is one line and never stops
the chain.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

from kchain.common import layout

Echo = Callable[[str], None]
Notify = Callable[[str, str, "int | None"], None]

SESSION_ENDED = "session_ended"  # a session ended and the watch pushed the next one
FINISHED = "finished"  # training is complete: the watch ends
NEEDS_PERSON = "needs_person"  # the chain stopped for a decision that needs you (a crash, no progress, the quota)
FAILED = "failed"  # the watch itself failed (Kaggle unreachable past its retries, credentials, an error)
QUEUE_ENDED = "queue_ended"  # `kchain queue`: every run of the queue finished, stopped or was skipped
EVENTS = (SESSION_ENDED, FINISHED, NEEDS_PERSON, FAILED, QUEUE_ENDED)
TIMEOUT_S = 60  # a notifier is a quick call; one that hangs must not hold the chain


def nobody(event: str, message: str, session: int | None = None) -> None:
    """No --notify: events go nowhere (the watch prints its lines anyway)."""


def notifier(command: str, job: str, echo: Echo, timeout_s: float = TIMEOUT_S) -> Notify:
    """A Notify that runs command in the shell with the event in its environment; its output is echoed."""

    def notify(event: str, message: str, session: int | None = None) -> None:
        env = {**os.environ, layout.NOTIFY_EVENT_ENV: event, layout.NOTIFY_JOB_ENV: job,
               layout.NOTIFY_MESSAGE_ENV: message, layout.NOTIFY_SESSION_ENV: "" if session is None else str(session)}
        # A session of its own: on a timeout the whole group goes, so no child left holding the pipe.
        with subprocess.Popen(command, shell=True, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                echo(f"[kchain] --notify for {event}: still running after {timeout_s:g}s, stopped; the chain goes on")
                return
        for line in output.splitlines():
            echo(f"[notify] {line}")
        if proc.returncode != 0:
            echo(f"[kchain] --notify for {event} exited {proc.returncode}; the chain goes on")

    return notify
