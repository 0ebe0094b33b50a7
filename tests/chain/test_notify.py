"""`kchain continue --watch --notify CMD`: the command runs in the shell at each event of the chain, with
KCHAIN_EVENT, KCHAIN_JOB, KCHAIN_MESSAGE and KCHAIN_SESSION in its environment. The unmodified client, the
local Kaggle, real notebook processes; the command appends the event to a file, as a user's would."""

# ruff: noqa: F811
from __future__ import annotations

import os
from pathlib import Path

from emulator_helpers import USER, emulator  # noqa: F401  (fixture)
from helpers import STALL, copy_job, invoke

from kchain.chain.advance import watch
from kchain.chain.notify import notifier
from kchain.common import layout
from kchain.job.spec import load_job
from kchain.kaggle.client import KaggleClient
from kchain.store.ledger import Ledger

NAME = "tinygpt-notes"


def appender(events: Path) -> str:
    return f'echo "$KCHAIN_EVENT|$KCHAIN_SESSION|$KCHAIN_JOB|$KCHAIN_MESSAGE" >> {events}; echo told'


def test_a_watched_chain_tells_each_session_end_and_the_finish_once(tmp_path, emulator, monkeypatch):
    # Session 1 stops itself after 10 of the 20 steps (its deadline), session 2 trains the rest.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    path = copy_job("tinygpt", tmp_path, params={"steps": 20, "eval_every": 20, "batch": 8, "accumulate": 1},
                    train={"session_limit": "600s", "margin": "30s"})
    events = tmp_path / "events.txt"
    assert invoke("push", path, "--skip-smoke").exit_code == 0
    emulator.wait_session(f"{USER}/{NAME}", 1)

    lines: list[str] = []
    job, ledger = load_job(path), Ledger(Path(os.environ["KCHAIN_HOME"]))
    done = watch(job, ledger, KaggleClient(), skip_smoke=True, echo=lines.append, poll_s=0.2, max_poll_s=1.0,
                 notify=notifier(appender(events), job.name, lines.append))
    assert done.action == "finished", lines
    told = [line.split("|") for line in events.read_text().splitlines()]
    assert [row[:3] for row in told] == [["session_ended", "1", NAME], ["finished", "2", NAME]]
    assert told[0][3].startswith("session 1 ended; session 2 pushed (kernel version 2), resuming at step 10")
    assert told[1][3] == done.message and done.message.startswith("training is complete: 20/20 steps")
    assert lines.count("[notify] told") == 2

    # The CLI's watch of a finished chain: the finish told and printed once.
    result = invoke("continue", path, "--watch", "--notify", appender(events))
    assert result.exit_code == 0, result.output
    assert result.output.count("training is complete") == 1, result.output
    assert events.read_text().splitlines()[-1].split("|")[:3] == ["finished", "2", NAME]


def test_a_failing_notifier_is_one_line_and_notify_needs_watch(tmp_path):
    lines: list[str] = []
    notifier("echo broken >&2; exit 3", NAME, lines.append)("finished", "training is complete", 2)
    assert lines == ["[notify] broken", "[kchain] --notify for finished exited 3; the chain goes on"]
    lines.clear()
    notifier("sleep 600 & sleep 600", NAME, lines.append, timeout_s=0.5)("finished", "training is complete", 2)
    assert lines == ["[kchain] --notify for finished: still running after 0.5s, stopped; the chain goes on"]
    refused = invoke("continue", copy_job("tinygpt", tmp_path), "--notify", "true")
    assert refused.exit_code == 2
    assert refused.output.splitlines()[-1] == "Error: --notify tells of a watched chain's events; give it with --watch"


def test_a_watch_that_fails_tells_it(tmp_path):
    """No credentials: the watch stops at its first call to Kaggle, and says so to the command."""
    events = tmp_path / "events.txt"
    result = invoke("continue", copy_job("tinygpt", tmp_path), "--watch", "--notify", appender(events))
    assert result.exit_code != 0
    event, session, job, message = events.read_text().splitlines()[0].split("|")
    assert (event, job) == ("failed", NAME) and result.output.splitlines()[-1] == f"Error: {message}"
