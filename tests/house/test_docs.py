"""The docs against the code: every name a user sees on a Run, the README's opening (every module's row in the
map and every import rule: test_house.py)."""

from __future__ import annotations

import re

from helpers import REPO, make_run

RUNTIME_DOC = REPO / "docs" / "runtime.md"
DESIGN_DOC = REPO / "docs" / "design.md"


def test_every_public_name_on_a_run_is_documented_in_runtime_md(tmp_path):
    run = make_run(tmp_path)
    public = [n for n in dir(run) if not n.startswith("_")]
    run.close()
    doc = RUNTIME_DOC.read_text()
    # \b: `run.step` is not documented by `run.steps`.
    undocumented = [n for n in public if not re.search(rf"run\.{re.escape(n)}\b", doc)]
    assert undocumented == [], f"docs/runtime.md never says run.<name> for: {', '.join(undocumented)}"


def test_the_readme_opens_with_the_pitch_the_set_up_and_a_week():
    top = (REPO / "README.md").read_text().splitlines()[:40]
    headings = [line for line in top if line.startswith("## ")]
    assert headings == ["## Set-up: two commands", "## A week with kchain"], headings
    assert sum(line.startswith("```") for line in top) == 4  # both blocks, closed within the 40 lines
