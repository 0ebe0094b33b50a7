"""Every KCHAIN_* environment variable kchain reads or sets has one home: a constant in
kchain/common/layout.py, and a row in docs/design.md's table of variables.

The scan reads the names in strings and comments of kchain/ and kernel_templates/ (Python tokens,
so `layout.KCHAIN_DIR` or the notebook's `KCHAIN_SRC` variable are names, not variables), and the
quoted ones in the notebook templates.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from kchain.common import layout

REPO = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"(?<![\w.])KCHAIN_[A-Z_]*[A-Z]")
QUOTED = re.compile(r"(?<=[\"'`$])KCHAIN_[A-Z_]*[A-Z]")
ROW = re.compile(r"^\| (`KCHAIN_[^|]*)\|", re.M)


def variables_in_source() -> dict[str, list[str]]:
    """name -> the files that mention it."""
    found: dict[str, list[str]] = {}
    for path in sorted([*(REPO / "kchain").rglob("*.py"), *(REPO / "kernel_templates").glob("*")]):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            tokens = tokenize.generate_tokens(io.StringIO(text).readline)
            names = [n for t in tokens if t.type in (tokenize.STRING, tokenize.COMMENT) for n in VARIABLE.findall(t.string)]
        elif path.suffix == ".j2":
            names = QUOTED.findall(text)
        else:
            continue
        for name in names:
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def layout_variables() -> dict[str, str]:
    """value -> constant, for layout's KCHAIN_* strings."""
    return {value: name for name, value in vars(layout).items()
            if name.isupper() and isinstance(value, str) and value.startswith("KCHAIN_")}


def documented_variables() -> set[str]:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    return {name for cell in ROW.findall(text) for name in re.findall(r"`(KCHAIN_[A-Z_]*[A-Z])", cell)}


def test_every_variable_in_the_source_is_a_layout_constant_and_documented():
    found = variables_in_source()
    assert {"KCHAIN_ROOT", "KCHAIN_SESSION_START", "KCHAIN_FAULT"} <= set(found)  # the scan sees them
    constants = layout_variables()
    assert [f"{name} ({', '.join(sorted(set(files)))})" for name, files in sorted(found.items())
            if name not in constants] == []
    assert sorted(set(constants) - documented_variables()) == []
    assert sorted(documented_variables() - set(constants)) == []  # no row for a variable nothing reads


def test_the_layout_constants_are_distinct():
    constants = [v for k, v in vars(layout).items() if k.endswith("_ENV") and isinstance(v, str)]
    assert len(constants) == len(set(constants))
