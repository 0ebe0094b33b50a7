"""Kaggle's own backend tests, run against the emulator (issue #58).

The sdist of the `kaggle` client pyproject.toml pins ships `tests/backend/backend_tests.py` (the unittest suite
Kaggle runs against its local server) and `tests/integration/test_models.py`. This test fetches that sdist from
the package index (nothing of Kaggle's is kept in this repository, and a new pin brings its own suite), serves
the emulator with its strict defaults and the catalogue fixture the suite assumes, runs every test that
kaggle_suite.OUT_OF_SCOPE does not name, and fails on any of them that does not pass. An index it cannot reach
fails it too: a skip would read as green.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from kaggle_suite import FIXTURE, OUT_OF_SCOPE, write_catalogue

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("kaggle_suite.py")


def pinned_client() -> str:
    """The `kaggle` version pyproject.toml pins (kaggle==X)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(re.fullmatch(r"kaggle==(\S+)", d.replace(" ", ""))[1] for d in deps  # type: ignore[index]
                if re.fullmatch(r"kaggle==\S+", d.replace(" ", "")))


def fetch_sdist(version: str, dest: Path) -> Path:
    """The client's sdist from the package index. Only kaggle itself as a source (`--no-binary kaggle`): with
    `:all:`, pip builds even the sdist's build backend from source, about 40 s more."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "kaggle", f"kaggle=={version}",
           "-d", str(dest), "--retries", "1", "--timeout", "30", "-q"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        done = None
    found = sorted(dest.glob(f"kaggle-{version}.tar.gz"))
    if done is None or done.returncode != 0 or not found:
        said = (done.stderr.strip().splitlines() or ["no answer"])[-1] if done else "no answer in 240 s"
        pytest.fail(f"cannot fetch the sdist of kaggle=={version} from the package index ({said}); Kaggle's own "
                    "suite comes from it, so this test fails rather than skips", pytrace=False)
    return found[0]


def test_the_out_of_scope_tests_are_the_ones_docs_emulator_md_lists_with_their_reasons():
    rows = re.findall(r"^\| `(test_\w+?)\*?` \(\d+\) \| (.+) \|$", (REPO / "docs" / "emulator.md").read_text(), re.MULTILINE)
    assert sorted(start for start, _ in rows) == sorted(OUT_OF_SCOPE)
    for start, why in rows:
        assert why.split(":")[0] == OUT_OF_SCOPE[start].split(":")[0], start


def test_the_catalogue_fixture_is_what_its_generator_writes(tmp_path):
    write_catalogue(tmp_path / "catalogue")
    written = {p.relative_to(tmp_path / "catalogue"): p.read_bytes() for p in (tmp_path / "catalogue").rglob("*")
               if p.is_file()}
    kept = {p.relative_to(FIXTURE): p.read_bytes() for p in FIXTURE.rglob("*") if p.is_file()}
    assert kept == written, ("tests/fixtures/kaggle-catalogue differs from kaggle_suite.write_catalogue: run "
                             "python tests/emulator/kaggle_suite.py catalogue tests/fixtures/kaggle-catalogue")


@pytest.mark.slow
def test_kaggles_own_backend_suite_passes_against_the_strict_emulator(tmp_path, capsys):
    version = pinned_client()
    sdist = fetch_sdist(version, tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src", filter="data")
    tests = tmp_path / "src" / f"kaggle-{version}" / "tests"
    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(RUNNER), "run", str(tests), str(FIXTURE), str(tmp_path / "state"),
                          str(result)], capture_output=True, text=True, timeout=480)
    assert result.exists(), f"the runner ended {run.returncode} without a result:\n{run.stderr[-4000:]}"
    outcomes = json.loads(result.read_text())
    in_scope = {name: o for name, o in outcomes.items() if o["scope"] == "in"}
    passed = [name for name, o in in_scope.items() if o["outcome"] == "passed"]
    figure = (f"kaggle=={version}'s own suite against the emulator: {len(passed)} passed / {len(in_scope)} in scope "
              f"/ {len(outcomes) - len(in_scope)} out of scope")
    with capsys.disabled():
        print(f"\n{figure}")
    not_passed = {name: f"{o['outcome']}: {o['why']}" for name, o in in_scope.items() if o["outcome"] != "passed"}
    assert not_passed == {}, f"{figure}\n{run.stderr[-6000:]}"
    assert len(in_scope) >= 41  # kaggle 2.2.5: backend_tests.py's 39 kernel, dataset and model tests + test_models.py's 2
