"""docs/design.md held to the code (issue 57 item 6): every kchain path it gives exists, every name a module's
row gives in backticks (`name`, `name(...)`, `Class.member`) is defined in that module, and every
`module.name` the page writes is defined in a kchain module of that name."""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

from kchain.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "kchain"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "init_templates" not in p.parts and p.name != "__init__.py")
# `kaggle.pip`, `train.keep_best`, ...: the job spec's sections, not modules.
SPEC_SECTIONS = {"kaggle", "train", "smoke", "budget", "skypilot", "slurm"}
FILE_KINDS = {"py", "json", "jsonl", "csv", "yaml", "ipynb", "j2", "pt", "md", "sbatch", "safetensors"}  # `cli.py`
# Backticked words in a row that are not kchain's names: other libraries' names, a file's, a status.
NOT_KCHAIN = {
    "save_state", "load_state", "save_checkpoint", "save_model",  # accelerate's, Lightning's, HF's (codecheck.py)
    "model_create_new", "model_instance_create", "model_instance_version_create", "with_retry",  # the client's
    "validate_name",  # SkyPilot's
    "kaggle", "killpg", "Accelerator", "Fabric", "TrainerCallback", "Callback",  # the client's, os's, the frameworks'
    "main",  # the user's main(run)
    "latest", "hung",  # the sink's pointer file, a session status
}
COMMANDS = set(cli.commands)  # `continue`, `status`, ...: kchain's commands


@cache
def defined(path: Path) -> frozenset[str]:
    """Every name the module defines: functions, classes and their members, assigned names, a class made by
    `type("Name", ...)`, and what its `__all__` re-exports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
                and len(node.args) == 3 and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for leaf in (leaf for target in targets for leaf in ast.walk(target)):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names |= {str(e.value) for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    return frozenset(names)


def by_short_name(short: str) -> list[Path]:
    """The modules a page means by `short`: every module of that file name (`nextsession`, `state`), or every
    module of a package of that name (`local`)."""
    return [p for p in MODULES if p.stem == short or short in p.relative_to(PACKAGE).parts[:-1]]


def resolves(short: str, name: str) -> bool:
    """Whether `short.name` is defined: in a module of that name, or a module or name of a package of that name."""
    return any(name in defined(p) or p.stem == name and short in p.relative_to(PACKAGE).parts[:-1]
               for p in by_short_name(short))


def rows() -> list[tuple[str, str]]:
    """(path, concern) for each row of the module map."""
    return re.findall(r"^\| `(kchain/[\w/]+\.py)` \| (.*) \|$", DESIGN.read_text(), re.MULTILINE)


def named(span: str) -> str | None:
    """The name a backticked span gives: `f(x) -> T` -> f; `A.b` -> A.b; `name` -> name; else None."""
    found = re.fullmatch(r"([A-Za-z_]\w*(?:\.\w+)*)(?:\(.*\))?(?:\s*->\s*\w+)?", span)
    return found.group(1) if found else None


def foreign(name: str) -> bool:
    """Not a kchain name to look for: a builtin, a command, a module's own name, a listed other name."""
    return name in NOT_KCHAIN or name in COMMANDS or hasattr(builtins, name) or bool(by_short_name(name))


def unresolved_in_row(path: str, concern: str) -> list[str]:
    """The names a row gives that its module (or, for `other.name`, the module `other`) does not define."""
    module = ROOT / path
    missing = []
    for span in re.findall(r"`([^`]+)`", concern):
        name = named(span)
        if name is None or name.isupper() or name.startswith("self.") or name.rsplit(".", 1)[-1] in FILE_KINDS:
            continue
        first, *rest = name.split(".")
        if rest and by_short_name(first) and first not in SPEC_SECTIONS:
            ok = resolves(first, rest[0])
        elif first in defined(module):
            ok = all(part in defined(module) for part in rest)
        else:  # a dotted name of another library's (`sky.Task.from_yaml`), or a word that is no code of kchain's
            ok = bool(rest) or foreign(first)
        if not ok:
            missing.append(f"{path}: `{span}`")
    return missing


def test_every_kchain_path_the_page_gives_exists():
    paths = set(re.findall(r"(?<![\w./-])kchain/[\w/.]*[\w/]", DESIGN.read_text()))  # not .kchain/, working/kchain/
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_every_name_a_modules_row_gives_is_defined_in_that_module():
    missing = [m for path, concern in rows() for m in unresolved_in_row(path, concern)]
    assert missing == [], "the row names what its module does not define"


def test_every_module_dot_name_on_the_page_is_defined_in_that_module():
    text = DESIGN.read_text()
    missing = sorted({f"`{short}.{name}`" for short, name in re.findall(r"\b([a-z_]\w*)\.([A-Za-z_]\w*)\b", text)
                      if short not in SPEC_SECTIONS and name not in FILE_KINDS and by_short_name(short)
                      and not resolves(short, name)})
    assert missing == [], "the page names these, and no kchain module of that name defines them"
