"""The docs against the code: every name a user sees on a Run, every runtime module in the design's table."""

from __future__ import annotations

import re

from helpers import REPO, make_run

RUNTIME_DOC = REPO / "docs" / "runtime.md"
DESIGN_DOC = REPO / "docs" / "design.md"
RUNTIME = REPO / "kchain" / "runtime"


def test_every_public_name_on_a_run_is_documented_in_runtime_md(tmp_path):
    run = make_run(tmp_path)
    public = [n for n in dir(run) if not n.startswith("_")]
    run.close()
    doc = RUNTIME_DOC.read_text()
    # \b: `run.step` is not documented by `run.steps`.
    undocumented = [n for n in public if not re.search(rf"run\.{re.escape(n)}\b", doc)]
    assert undocumented == [], f"docs/runtime.md never says run.<name> for: {', '.join(undocumented)}"


def test_every_runtime_module_has_its_row_in_the_design_table():
    rows = set(re.findall(r"^\| `kchain/runtime/(\w+\.py)` \|", DESIGN_DOC.read_text(), re.MULTILINE))
    modules = {p.name for p in RUNTIME.glob("*.py") if p.name != "__init__.py"}  # the package has its own row
    missing, gone = sorted(modules - rows), sorted(rows - modules)
    assert missing == [], f"docs/design.md's module table has no row for: {', '.join(missing)}"
    assert gone == [], f"docs/design.md's module table names modules that are gone: {', '.join(gone)}"


def test_the_readme_opens_with_the_pitch_the_set_up_and_a_week():
    top = (REPO / "README.md").read_text().splitlines()[:40]
    headings = [line for line in top if line.startswith("## ")]
    assert headings == ["## Set-up: two commands", "## A week with kchain"], headings
    assert sum(line.startswith("```") for line in top) == 4  # both blocks, closed within the 40 lines
