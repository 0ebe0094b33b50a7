"""Framework checkpoint calls left in a job's code, found by reading it before the smoke trains.

kchain checkpoints the whole training state itself, and a resume reads only its own checkpoint. A call
that saves a framework's own checkpoint still runs under kchain, and fails late: accelerate's
`save_state` every 500 steps fills the session's disk or writes to a read-only path, and the session dies
at step 500, hours in, while the smoke's few steps never reach it. `leftover_saves(files)` reads the code
(nothing is imported), as extras.imported reads its imports, from the same sources (extras.sources: a
.py file, a notebook's cells), and names each such call with its file and line. The smoke refuses the
code with the first one (`refuse_leftover_saves`), so push never gets a smoke pass for it.

Each rule needs the framework imported by the job's code (any of its files), and a method name alone:
- accelerate: `X.save_state(...)`, `X.load_state(...)` anywhere;
- Lightning (`lightning`, `pytorch_lightning`): `X.save_checkpoint(...)` while training runs: inside a
  `for`/`while` body or a hook (`def on_...`, `def ..._step`). One after `trainer.fit(...)` is the run's
  output, written once by the session that finishes (kchain's lightning template does it);
- Hugging Face (`transformers`, `trl`): `X.save_model(...)`, `X.save_state(...)` inside a `for`/`while`
  body. After the loop they are the final export. An accelerate `save_state` on a receiver named
  `...trainer` is the Trainer's when transformers is imported too, and goes by this rule.
"Inside a loop" is lexical, within one function: a `def` in a loop body starts afresh, and a loop's
`else:` runs once. What the reading misses (a call through a helper, a name built at run time) fails at
the call instead: run.accelerator's save_state and load_state raise (runtime/frameworks/hf_accelerate.py).

Standard library only.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from kchain.errors import SmokeFailed
from kchain.job import extras

KEEPS = "kchain already checkpoints the whole state (and a resume would ignore this one)"


@dataclass(frozen=True)
class Rule:
    method: str  # the method called, e.g. "save_state"
    frameworks: frozenset[str]  # top-level modules; the job's code importing one of them arms the rule
    inside: str  # where the call counts: "anywhere", "loop" (a for/while body), "training" (a loop or a hook)
    what: str  # what the call does, after the call in the message
    fix: str


ACCELERATE = frozenset({"accelerate"})
LIGHTNING = frozenset({"lightning", "pytorch_lightning"})
HF = frozenset({"transformers", "trl"})
RULES = (
    Rule("save_state", ACCELERATE, "anywhere", f"saves accelerate's own checkpoint: {KEEPS}", "remove the call"),
    Rule("load_state", ACCELERATE, "anywhere", "loads accelerate's own checkpoint: kchain restores its newest "
         "checkpoint itself when run.epochs starts", "remove the call and the resume code around it"),
    Rule("save_checkpoint", LIGHTNING, "training", f"saves Lightning's own checkpoint during training: {KEEPS}",
         "remove the call (one after trainer.fit(...), for the final model, is fine)"),
    Rule("save_model", HF, "loop", f"saves the Trainer's model inside a loop: {KEEPS}",
         "remove the call, or save once after the loop"),
    Rule("save_state", HF, "loop", f"saves the Trainer's state inside a loop: {KEEPS}",
         "remove the call, or save once after the loop"),
)


@dataclass(frozen=True)
class Finding:
    """One leftover call: where it is (a file, or a notebook's cell), its line, the call, the rule."""

    source: str  # "train.py", "pkg/loop.py", or "train.ipynb, cell 3"
    line: int
    call: str  # as written, its arguments elided: "accelerator.save_state(...)"
    rule: Rule

    @property
    def where(self) -> str:
        return f"{self.source}, line {self.line}" if ", cell " in self.source else f"{self.source}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.call} {self.rule.what}; {self.rule.fix}"


def leftover_saves(files: dict[str, bytes]) -> list[Finding]:
    """Pure: the framework checkpoint calls in the payload's code (name -> bytes, as render.code_files
    gives them), in file and line order."""
    imported = set(extras.imported(files))
    rules = [rule for rule in RULES if rule.frameworks & imported]
    if not rules:
        return []
    found: list[Finding] = []
    for source, tree in extras.sources(files):
        _Reader(source, rules, bool(HF & imported), found).visit(tree)
    return sorted(found, key=lambda f: (f.source, f.line))


def refuse_leftover_saves(files: dict[str, bytes]) -> None:
    """Raise SmokeFailed (the smoke's exit code, 3) naming the first leftover call, and how many more."""
    found = leftover_saves(files)
    if found:
        more = f" ({len(found) - 1} more: {', '.join(f.where for f in found[1:4])}" \
               f"{', ...' if len(found) > 4 else ''})" if len(found) > 1 else ""
        raise SmokeFailed(f"{found[0]}{more}")


class _Reader(ast.NodeVisitor):
    """Walks one source, knowing whether the node at hand is inside a loop or a hook of its function."""

    def __init__(self, source: str, rules: list[Rule], hf: bool, found: list[Finding]):
        self.source, self.rules, self.hf, self.found = source, rules, hf, found
        self.loop = False  # inside a for/while body of the current function (or module)
        self.hook = False  # inside a Lightning hook: def on_*() or def *_step()

    def _visit_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self.loop, self.hook
        self.loop, self.hook = False, node.name.startswith("on_") or node.name.endswith("_step")
        for child in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if child is not None:
                self.visit(child)
        for stmt in node.body:
            self.visit(stmt)
        self.loop, self.hook = outer

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_def

    def _visit_loop(self, node: ast.For | ast.AsyncFor | ast.While) -> None:
        self.visit(node.iter if isinstance(node, (ast.For, ast.AsyncFor)) else node.test)
        outer, self.loop = self.loop, True
        for stmt in node.body:
            self.visit(stmt)
        self.loop = outer
        for stmt in node.orelse:  # a loop's else: runs once
            self.visit(stmt)

    visit_For = visit_AsyncFor = visit_While = _visit_loop

    def visit_If(self, node: ast.If) -> None:
        # kchain imports the job's module and calls main(run): __name__ is the module's, never "__main__", so
        # the block never runs (a script keeps its old command-line entry there). Its else: does run.
        if _is_main_guard(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            receiver = ast.unparse(func.value)
            for rule in self.rules:
                if rule.method == func.attr and self._counts(rule, receiver):
                    self.found.append(Finding(self.source, node.lineno, f"{receiver}.{func.attr}(...)", rule))
                    break
        self.generic_visit(node)

    def _counts(self, rule: Rule, receiver: str) -> bool:
        if rule.frameworks is ACCELERATE and self.hf and receiver.lower().endswith("trainer"):
            return False  # an HF Trainer's save_state: the HF rule judges it
        if rule.inside == "loop":
            return self.loop
        if rule.inside == "training":
            return self.loop or self.hook
        return True


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
