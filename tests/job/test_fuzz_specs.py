"""Zero tracebacks, zero hangs: any job file ends in exit 0, or exit 10 with one `Error:` line.

A property-based test with a fixed budget (derandomized, so CI sees the same cases every run) and
a stored corpus of the hostile files found so far, each with the message it must keep giving.
Each case runs under a hang detector: a generous bound that only a hang exceeds (faulthandler
dumps the stack and stops the run if a case never returns), not a timing assertion.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from spec_strategies import CORPUS, corpus, job_files, problem, render_bytes

HANG_S = 30  # per case; a render takes well under a second even on a loaded 2-core machine
CASES = corpus()


def checked(folder: Path, data: bytes):
    faulthandler.dump_traceback_later(HANG_S * 4, exit=True)  # a case that never returns stops the run
    try:
        outcome = render_bytes(folder, data)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert outcome.seconds < HANG_S, f"a case took {outcome.seconds:.0f} s (a hang?): {data[:200]!r}"
    return outcome


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=job_files())
def test_any_job_file_renders_or_gives_one_error_line(tmp_path, data):
    outcome = checked(tmp_path / "case", data)
    assert problem(outcome) is None, f"{problem(outcome)}\njob file: {data[:300]!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_corpus_stays_green(tmp_path, name):
    outcome = checked(tmp_path, (CORPUS / name).read_bytes())
    assert problem(outcome) is None, problem(outcome)
    expected = CASES[name]
    assert outcome.exit_code == expected["exit"], outcome.output
    if expected["error"]:
        assert outcome.error_lines[0].startswith(f"Error: {tmp_path / 'job.yaml'}: ")
        assert expected["error"] in outcome.error_lines[0]


def test_a_5_mb_value_is_refused_by_size_with_a_short_line(tmp_path):
    data = b"name: tinygpt-notes\ncode: train.py\ntrain: {margin: '" + b"9" * 5_000_000 + b"'}\n"
    outcome = checked(tmp_path, data)
    assert outcome.exit_code == 10
    assert outcome.error_lines == [f"Error: {tmp_path / 'job.yaml'}: over 256 KB; a job file is a few lines of YAML"]


@pytest.mark.parametrize("name", ["alias-bomb-9.yaml", "deep-lists.yaml", "utf16.yaml", "merge-keys.yaml"])
def test_real_processes_give_the_same_answer(tmp_path, name):
    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    job = tmp_path / "job.yaml"
    job.write_bytes((CORPUS / name).read_bytes())
    done = subprocess.run([sys.executable, "-m", "kchain.cli", "render", str(job), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=HANG_S * 4, env={**os.environ})
    assert done.returncode == CASES[name]["exit"], done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == (1 if CASES[name]["exit"] else 0)
    if errors:
        assert CASES[name]["error"] in errors[0]
