"""Every key a laptop module reads or writes on a session record is declared in sessions.SessionRecord.

The scan follows the record types through each function of kchain's laptop modules (kchain/*.py):
a parameter or variable annotated `SessionRecord`, `list[SessionRecord]` or `PublishFacts`, what a
function so annotated returns, the elements of a chain (`chain[-1]`, `for s in chain`, `next(...)`),
`{**record, ...}`, and `record.get("publish")`. A key read (`r["k"]`, `r.get("k")`, `"k" in r`) or
written (`r["k"] = v`, `r.update(k=v)`, a dict literal given where a record is expected) on any of
them must be declared.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

from kchain.common.sessionrecord import PublishFacts, SessionRecord

RECORD, CHAIN, JOBS, JOB_VALUES, JOB_ITEMS, PUBLISH = "record", "chain", "jobs", "job values", "job items", "publish"
DECLARED = {RECORD: set(SessionRecord.__annotations__), PUBLISH: set(PublishFacts.__annotations__)}
NOT_RECORDS = {"emu", "emulator"}  # the local Kaggle's sessions are its own dicts, not the ledger's records


def annotation_kind(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    text = re.sub(r"\b\w+\.(?=SessionRecord|PublishFacts)", "", ast.unparse(node)).removesuffix(" | None")
    # (common/nextsession.py, which the kernel runs too, names a record `Record`: its alias of SessionRecord.)
    return {"SessionRecord": RECORD, "list[SessionRecord]": CHAIN, "dict[str, list[SessionRecord]]": JOBS,
            "PublishFacts": PUBLISH, "Record": RECORD, "list[Record]": CHAIN}.get(text)


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = [*fn.args.posonlyargs, *fn.args.args]
    return [*(args[1:] if args and args[0].arg in ("self", "cls") else args), *fn.args.kwonlyargs]


def signatures(trees: list[ast.Module]) -> dict[str, tuple[list[str], dict[str, str], str | None]]:
    """name -> (parameter names, their record kinds, the return kind), for names defined one way only."""
    found: dict[str, set] = {}
    for tree in trees:
        for fn in functions(tree):
            kinds = {a.arg: k for a in params(fn) if (k := annotation_kind(a.annotation))}
            found.setdefault(fn.name, set()).add(
                (tuple(a.arg for a in params(fn)), tuple(sorted(kinds.items())), annotation_kind(fn.returns)))
    return {name: (list(p), dict(k), r) for name, ways in found.items() if len(ways) == 1 for p, k, r in ways}


class Scan:
    """The record kinds of one function's names, then every key used on them."""

    def __init__(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, sigs: dict, where: str) -> None:
        self.fn, self.sigs, self.where = fn, sigs, where
        self.names: dict[str, str] = {}
        self.keys: list[tuple[str, str, str]] = []  # (where, kind, key)

    def kind(self, node: ast.expr | None) -> str | None:
        """The record kind of an expression, one case per shape; None: not a record."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Subscript):
            outer = self.kind(node.value)
            if outer == CHAIN:
                return CHAIN if isinstance(node.slice, ast.Slice) else RECORD
            if outer == JOBS:
                return CHAIN
            if outer == RECORD and _text(node.slice) == "publish":
                return PUBLISH
            return None
        if isinstance(node, ast.BoolOp):
            return next((k for k in map(self.kind, node.values) if k), None)
        if isinstance(node, ast.IfExp):
            return self.kind(node.body) or self.kind(node.orelse)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            gen = node.generators[0]
            same = isinstance(node.elt, ast.Name) and isinstance(gen.target, ast.Name) and node.elt.id == gen.target.id
            return CHAIN if same and self.kind(gen.iter) == CHAIN else None
        spread = isinstance(node, ast.Dict) and any(
            k is None and self.kind(v) == RECORD for k, v in zip(node.keys, node.values, strict=True))
        if spread:  # {**record, ...}
            return RECORD
        if isinstance(node, ast.Call):
            return self.call_kind(node)
        return None

    def call_kind(self, node: ast.Call) -> str | None:
        func = node.func
        first = self.kind(node.args[0]) if node.args else None
        if isinstance(func, ast.Name):
            if func.id == "next" and first == CHAIN:
                return RECORD
            if func.id in ("reversed", "sorted", "list") and first in (CHAIN, JOB_ITEMS, JOB_VALUES):
                return first
            return self.sigs.get(func.id, (None, None, None))[2]
        if isinstance(func, ast.Attribute):
            owner = self.kind(func.value)
            if owner == RECORD and func.attr == "get" and node.args and _text(node.args[0]) == "publish":
                return PUBLISH
            if owner == JOBS:
                return {"values": JOB_VALUES, "items": JOB_ITEMS, "get": CHAIN}.get(func.attr)
            if isinstance(func.value, ast.Name) and func.value.id not in NOT_RECORDS:
                return self.sigs.get(func.attr, (None, None, None))[2]
        return None

    def bind(self, target: ast.expr, iterated: str | None) -> None:
        """A loop's target over something of kind `iterated`."""
        if iterated == CHAIN and isinstance(target, ast.Name):
            self.names[target.id] = RECORD
        elif iterated == JOB_VALUES and isinstance(target, ast.Name):
            self.names[target.id] = CHAIN
        elif iterated == JOB_ITEMS and isinstance(target, ast.Tuple) and isinstance(target.elts[1], ast.Name):
            self.names[target.elts[1].id] = CHAIN

    def infer(self) -> None:
        for arg in params(self.fn):
            if kind := annotation_kind(arg.annotation):
                self.names[arg.arg] = kind
        for _ in range(5):  # to a fixpoint: a name's kind may come from one bound later in the text
            for node in ast.walk(self.fn):
                if isinstance(node, ast.arg) and (kind := annotation_kind(node.annotation)):
                    self.names[node.arg] = kind
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if kind := annotation_kind(node.annotation) or self.kind(node.value):
                        self.names[node.target.id] = kind
                elif isinstance(node, ast.Assign) and (kind := self.kind(node.value)):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            self.names[target.id] = kind
                elif isinstance(node, (ast.For, ast.comprehension)):
                    iterated = self.kind(node.iter)
                    if isinstance(node.iter, ast.Call) and getattr(node.iter.func, "id", "") == "enumerate":
                        if isinstance(node.target, ast.Tuple) and node.iter.args:
                            self.bind(node.target.elts[1], self.kind(node.iter.args[0]))
                    else:
                        self.bind(node.target, iterated)

    def use(self, kind: str | None, key: ast.expr | str | None, line: int) -> None:
        name = key if isinstance(key, str) else _text(key)
        if kind in DECLARED and name is not None:
            self.keys.append((f"{self.where}:{line}", kind, name))

    def literal(self, kind: str | None, node: ast.expr | None) -> None:
        if kind in DECLARED and isinstance(node, ast.Dict):
            for key in node.keys:
                self.use(kind, key, node.lineno)

    def collect(self) -> list[tuple[str, str, str]]:
        self.infer()
        for node in ast.walk(self.fn):
            if isinstance(node, ast.Subscript):
                self.use(self.kind(node.value), node.slice, node.lineno)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                self.use(self.kind(node.comparators[0]), node.left, node.lineno)
            elif isinstance(node, ast.AnnAssign):
                self.literal(annotation_kind(node.annotation), node.value)
            elif isinstance(node, ast.Dict) and self.kind(node) == RECORD:
                self.literal(RECORD, node)
            elif isinstance(node, ast.Call):
                self.call(node)
        return self.keys

    def call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and (owner := self.kind(func.value)) in DECLARED:
            if func.attr in ("get", "pop", "setdefault") and node.args:
                self.use(owner, node.args[0], node.lineno)
            if func.attr == "update":
                for kw in node.keywords:
                    self.use(owner, kw.arg, node.lineno)
                for arg in node.args:
                    self.literal(owner, arg)
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in self.sigs:
            names, kinds, _ = self.sigs[name]
            for i, arg in enumerate(node.args[: len(names)]):
                self.literal(kinds.get(names[i]), arg)
            for kw in node.keywords:
                self.literal(kinds.get(kw.arg or ""), kw.value)


def _text(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def scan(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(where, kind, key) for every key used on a record or its publish facts in these sources."""
    trees = {where: ast.parse(text) for where, text in sources.items()}
    sigs = signatures(list(trees.values()))
    uses = []
    for where, tree in trees.items():
        for fn in functions(tree):
            uses += Scan(fn, sigs, where).collect()
    return sorted(set(uses))


def laptop_sources() -> dict[str, str]:
    """kchain's laptop modules, and the decision table both the laptop and the kernel run over the records."""
    laptop = ("store", "kaggle", "job", "chain", "result", "local")
    files = [*sorted((REPO / "kchain").glob("*.py")), *(p for f in laptop for p in sorted((REPO / "kchain" / f).glob("*.py"))),
             REPO / "kchain" / "common" / "nextsession.py"]
    return {p.name: p.read_text() for p in files}


def test_every_key_used_on_a_session_record_is_declared():
    uses = scan(laptop_sources())
    undeclared = [f"{where}: {kind}[{key!r}]" for where, kind, key in uses if key not in DECLARED[kind]]
    assert undeclared == [], "declare these in kchain/chain/sessions.py (SessionRecord or PublishFacts)"
    # The scan itself still sees the records where they are used (a scan that finds nothing passes nothing).
    modules = {where.split(":")[0] for where, kind, _ in uses if kind == RECORD}
    assert {"sessions.py", "advance.py", "nextsession.py", "ledger.py", "push.py", "rehearse.py", "plot.py"} <= modules
    keys = {key for _, kind, key in uses if kind == RECORD}
    assert len(keys) >= 30 and {"session", "status", "summary", "publish", "saved_step", "stopped_by_user"} <= keys
    assert {key for _, kind, key in uses if kind == PUBLISH} >= {"published", "step", "pending", "uploaded_bytes"}


def test_an_undeclared_key_fails_the_scan(tmp_path: Path):
    code = '''
def one(chain: list[SessionRecord], ledger) -> None:
    last = chain[-1]
    last["brand_new"] = 1
    for s in ledger.sessions("job"):
        s.get("typo_of_status")
    ledger.save_session("job", {**last, "also_new": True})
    publish = last.get("publish") or {}
    publish.get("nope")
'''
    ledger = '''
class Ledger:
    def sessions(self, job: str) -> list[SessionRecord]: ...
    def save_session(self, job: str, session: SessionRecord) -> None: ...
'''
    uses = scan({"a.py": code, "ledger.py": ledger})
    undeclared = sorted(key for _, kind, key in uses if key not in DECLARED[kind])
    assert undeclared == ["also_new", "brand_new", "nope", "typo_of_status"]
