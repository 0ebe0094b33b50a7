"""The reference a newcomer can navigate (issue 57 item 6): every long page opens with a contents list of its
sections, and the README's lines fit 120 characters, but for the test command CI runs, kept whole."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONG = 300  # lines: a page longer than this opens with its contents
WIDTH = 120
# README.md is left out: its opening is the pitch and the two set-up commands within 40 lines
# (test_docs.py's test_the_readme_opens_with_the_pitch_the_set_up_and_a_week); its sections are few.
PAGES = sorted(ROOT.glob("docs/*.md")) + [ROOT / "CHANGELOG.md"]


def sections(lines: list[str]) -> list[str]:
    """The `## ` headings outside code blocks, in order."""
    found, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            found.append(line[3:].strip())
    return found


def anchor(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, only letters, digits, `-`, `_` and spaces kept, spaces as
    dashes; a repeat gets -1, -2, ..."""
    base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(base, 0)
    seen[base] = count + 1
    return base if count == 0 else f"{base}-{count}"


def contents(lines: list[str]) -> list[tuple[str, str]]:
    """The `- [section](#anchor)` entries before the first section."""
    head = lines[:next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))]
    return [(m.group(1), m.group(2)) for line in head if (m := re.fullmatch(r"- \[(.+)\]\(#([\w-]+)\)", line))]


def test_every_long_page_opens_with_a_contents_list_of_its_sections():
    wrong = {}
    for page in PAGES:
        lines = page.read_text().splitlines()
        if len(lines) > LONG:
            seen: dict[str, int] = {}
            want = [(heading, anchor(heading, seen)) for heading in sections(lines)]
            if contents(lines) != want:
                wrong[page.relative_to(ROOT).as_posix()] = want
    assert wrong == {}, "each needs, before its first ## heading, these `- [section](#anchor)` lines, in order"


def test_the_contents_check_reads_code_blocks_and_anchors_as_github_does():
    lines = ["# T", "- [`run` reference](#run-reference)", "- [A, b (c/d.py)](#a-b-cdpy)", "- [A, b (c/d.py)](#a-b-cdpy-1)",
             "## `run` reference", "```", "## not a section", "```", "## A, b (c/d.py)", "## A, b (c/d.py)"]
    seen: dict[str, int] = {}
    assert contents(lines) == [(h, anchor(h, seen)) for h in sections(lines)]
    assert sections(lines) == ["`run` reference", "A, b (c/d.py)", "A, b (c/d.py)"]


def ci_command() -> str:
    """The command .ci/run runs: its line that makes the venv, less the log's tee."""
    line = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv"))
    return line.removesuffix(' 2>&1 | tee "$log"')


def test_the_readme_holds_the_command_ci_runs_as_one_line():
    assert ci_command() in (ROOT / "README.md").read_text().splitlines()


def test_readme_lines_fit_120_characters_but_the_command_ci_runs():
    wide = [f"{n}: {len(line)}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > WIDTH and line != ci_command()]
    assert wide == [], f"README.md: lines over {WIDTH} characters (line: width)"
