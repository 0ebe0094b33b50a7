"""One session state (issue 57 item 2): no module but kchain/common/sessionstate.py spells a state (every other
reads it through `SessionState`), and none but it writes a session record's `status`."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from kchain.common.sessionstate import SessionState

ROOT = Path(__file__).resolve().parents[2]
STATE_MODULE = ROOT / "kchain" / "common" / "sessionstate.py"
TEMPLATES = ("*.j2", "*.ipynb")  # the notebook templates, read as text
# The emulator is Kaggle, not kchain: its sessions are its own dicts (Kaggle's state of each, which it writes
# with the enum's values), never a session record; the one-writer scan leaves it out, the literal scan does not.
KAGGLE_ITSELF = ROOT / "kchain" / "emulator"
# `"status": ...` written where no session record is: each place and why (the value's source text).
NOT_A_RECORD = {
    ("kchain/chain/doctor.py", "status"): "doctor.json's fact of the relay hop's probe session",
    ("kchain/chain/sessions.py", "s['status']"): "`kchain status --json`'s copy of each record's",
    ("kchain/common/publish.py", "summary.Status.STATE_NOT_MOUNTED"): "a summary's status (summary.Status)",
    ("kchain/common/summary.py", "OLD_STATUSES.get(values['status'], values['status'])"): "a summary's status",
    ("kchain/kaggle/client.py", "status"): "a row of the account's live GPU kernels, Kaggle's answer",
    ("kchain/result/week.py", "r.status"): "`kchain week --json`'s row, the run's words",
    ("kchain/runtime/launch.py", "done.status"): "a summary's status in the launcher's line",
}


def sources() -> Iterator[Path]:
    for folder in (ROOT / "kchain", ROOT / "kernel_templates"):
        yield from (p for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                    and (p.suffix == ".py" or any(p.match(t) for t in TEMPLATES)))


def state_literals(path: Path, text: str) -> list[str]:
    """`where: literal` for every string literal in the file that is a state's name."""
    names = {s.value for s in SessionState}
    if path.suffix != ".py":  # a template: a quoted state name
        pattern = "[\"'](" + "|".join(names) + ")[\"']"
        return [f"{path}: {m[1]}" for m in re.finditer(pattern, text)]
    return [f"{path}:{node.lineno}: {node.value}" for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and node.value in names]


def status_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, the value's source) for each `x["status"] = v`, `{"status": v}`, `.update(status=v)` and
    `.setdefault("status", v)`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(leaf, ast.Subscript) and _is_status(leaf.slice) for t in targets for leaf in ast.walk(t)):
                yield node.lineno, ast.unparse(node.value)
        elif isinstance(node, ast.Dict):
            yield from ((node.lineno, ast.unparse(v)) for k, v in zip(node.keys, node.values, strict=True)
                        if k is not None and _is_status(k))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "update":
                yield from ((node.lineno, ast.unparse(kw.value)) for kw in node.keywords if kw.arg == "status")
            if node.func.attr == "setdefault" and len(node.args) == 2 and _is_status(node.args[0]):
                yield node.lineno, ast.unparse(node.args[1])


def _is_status(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "status"


def test_no_state_is_spelled_outside_the_state_module():
    found = [hit for p in sources() if p != STATE_MODULE for hit in state_literals(p, p.read_text())]
    assert found == [], "read the state through kchain.common.sessionstate.SessionState (or its groups: LIVE, ...)"
    # The scan sees a literal where there is one, in code and in a template.
    assert len(state_literals(STATE_MODULE, STATE_MODULE.read_text())) == len(SessionState)
    assert state_literals(Path("t.j2"), "{% if s == 'RUNNING' %}") == ["t.j2: RUNNING"]


def test_only_the_state_module_writes_a_session_records_status():
    found = []
    for path in sources():
        if path.suffix != ".py" or path == STATE_MODULE or KAGGLE_ITSELF in path.parents:
            continue
        where = path.relative_to(ROOT).as_posix()
        found += [f"{where}:{line}: {value}" for line, value in status_writes(ast.parse(path.read_text()))
                  if (where, value) not in NOT_A_RECORD]
    assert found == [], "move a session's status through kchain.common.sessionstate's transitions (pushed(...), ...)"
    code = 'r["status"] = x\nr.update({"status": y})\nr.update(status=z)\nr.setdefault("status", w)\nr.get("status")\n'
    assert sorted(value for _, value in status_writes(ast.parse(code))) == ["w", "x", "y", "z"]
