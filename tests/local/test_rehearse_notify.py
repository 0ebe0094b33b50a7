"""`kchain rehearse --notify CMD`: the command runs in the shell once, when the rehearsal ends (finished for a
pass, needs_person when the chain stopped for a decision, failed otherwise), with KCHAIN_EVENT, KCHAIN_JOB,
KCHAIN_MESSAGE and KCHAIN_SESSION in its environment. Real notebook processes against the local Kaggle; the
command appends the event to a file, as a user's would (tests/chain/test_notify.py's sink)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from helpers import REPO, error_line, invoke

from kchain.local.rehearse import Rehearsal
from kchain.store import account


def appender(events: Path) -> str:
    return f'echo "$KCHAIN_EVENT|$KCHAIN_SESSION|$KCHAIN_JOB|$KCHAIN_MESSAGE" >> {events}; echo told'


def job(folder: Path, name: str, code: str | None = None, **params) -> Path:
    """tests/runtime_jobs/chain_job.py (or the given code) as a job of its own, on the CPU."""
    folder.mkdir()
    if code is None:
        shutil.copy(REPO / "tests" / "runtime_jobs" / "chain_job.py", folder / "train.py")
    else:
        (folder / "train.py").write_text(code)
    (folder / "job.yaml").write_text(yaml.safe_dump({"name": name, "code": "train.py", "params": params}))
    return folder / "job.yaml"


def test_a_rehearsal_that_passes_tells_finished_once(tmp_path):
    events = tmp_path / "events.txt"
    path = job(tmp_path / "steps", "notify-pass", shape="steps", seed=3, steps=10)
    result = invoke("rehearse", path, "--sessions", 2, "--kills", 0, "--ranks", 1, "--notify", appender(events))
    assert result.exit_code == 0, result.output
    (told,) = [line.split("|") for line in events.read_text().splitlines()]
    assert told[:3] == ["finished", "2", "notify-pass"]
    verdict = next(line for line in result.output.splitlines() if line.startswith("verdict: "))
    assert told[3] == f"rehearsal: the chained run {verdict.removeprefix('verdict: ')}"
    assert told[3].startswith("rehearsal: the chained run identical: ")
    assert result.output.count("[notify] told") == 1
    assert not account.path_of("rehearsal").exists()  # the local Kaggle's account week stays in the rehearsal's folder


def test_a_rehearsal_whose_chain_stops_for_a_person_tells_it_with_its_error_line(tmp_path):
    events = tmp_path / "events.txt"
    path = job(tmp_path / "crash", "notify-crash", code='def main(run):\n    raise ValueError("a bug in the loop")\n')
    result = invoke("rehearse", path, "--ranks", 1, "--notify", appender(events))
    assert result.exit_code == 1, result.output
    (told,) = [line.split("|", 3) for line in events.read_text().splitlines()]
    assert (told[0], told[2]) == ("needs_person", "notify-crash") and told[1] in ("1", "2"), told  # the last session
    assert error_line(result) == f"Error: {told[3]}"
    assert "ValueError: a bug in the loop" in told[3]


def test_each_end_is_its_event_and_notify_is_refused_with_a_target(tmp_path):
    def ended(passed: bool, stopped: bool) -> str:
        return Rehearsal(passed, "v", [], [], [], passed=passed, stopped=stopped).event()

    assert [ended(True, False), ended(False, True), ended(False, False)] == ["finished", "needs_person", "failed"]
    refused = invoke("rehearse", job(tmp_path / "j", "notify-target", shape="steps", steps=4),
                     "--target", "slurm", "--notify", "true")
    assert refused.exit_code == 2
    assert error_line(refused) == "Error: --notify tells of a rehearsal against the local Kaggle; leave out --target"
