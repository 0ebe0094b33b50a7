"""The house's rules, checked over every module (issue #36): each package's `__init__` states its import
rule in its first line and this file enforces it; no import circle and no upward import, TYPE_CHECKING
and function-level imports included; every module has its row in docs/design.md's map."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kchain"
DESIGN = ROOT / "docs" / "design.md"
LAPTOP = ("store", "kaggle", "job", "chain", "result", "local", "targets")  # the laptop's folders, bottom first
RUNTIME_LAZY = {"transformers", "lightning", "lightning_fabric", "pytorch_lightning", "accelerate", "peft", "safetensors",
                "tensorboard"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "init_templates" not in p.parts}
PACKAGES = sorted(module_name(p) for p in PACKAGE.rglob("__init__.py") if "init_templates" not in p.parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, inside a function) for every import in the file, TYPE_CHECKING blocks included;
    `from package import module` names the module."""
    found: list[tuple[str, bool]] = []

    def walk(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, deeper) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0 and child.module, f"{path}: a relative import; write it absolute"
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, deeper))
            walk(child, deeper)

    walk(ast.parse(path.read_text()), False)
    return found


def third_party(name: str) -> bool:
    return name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "kchain"


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def rule_breaks(package: str, name: str, inside: bool) -> bool:
    """Whether importing `name` breaks the rule of the package the importer is in (its __init__'s first line)."""
    if package == "kchain.common":
        return not (within(name, "kchain.common") or not third_party(name) and not within(name, "kchain")
                    or inside and within(name, "kaggle", "kaggle_secrets", "kagglesdk"))
    if within(package, "kchain.runtime"):
        return within(name, "kchain") and not within(name, "kchain.common", "kchain.runtime") or third_party(name) \
            and not within(name, "numpy", "torch") and not (inside and name.split(".")[0] in RUNTIME_LAZY)
    if package == "kchain.emulator":
        return within(name, "kchain") and not within(name, "kchain.common", "kchain.errors", "kchain.emulator") \
            or third_party(name) and not within(name, "psutil")
    if package == "kchain":  # cli.py and errors.py: the laptop's top
        return within(name, "kchain.runtime") or not inside and within(name, "torch", "numpy")
    # the laptop's folders, each over the ones before it in LAPTOP (kchain.emulator from local up); the official
    # client only in kchain.kaggle
    layer = LAPTOP.index(package.split(".")[1])
    allowed = ("kchain.common", "kchain.errors", "kchain.kernel_templates", *(f"kchain.{f}" for f in LAPTOP[:layer + 1]),
               *(("kchain.emulator",) if layer >= LAPTOP.index("local") else ()))
    return within(name, "kchain") and name != "kchain" and not within(name, *allowed) \
        or not inside and within(name, "torch", "numpy") \
        or within(name, "kaggle", "kagglesdk") and package != "kchain.kaggle"


def package_of(module: str) -> str:
    return module if module in PACKAGES else module.rsplit(".", 1)[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_states_its_import_rule_and_keeps_it(package):
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert doc.startswith("Import rule: "), f"{init}: the docstring's first line states the import rule"
    broken = [f"{MODULES[m].relative_to(ROOT)}: {name}{' (in a function)' * inside}"
              for m in MODULES if package_of(m) == package for name, inside in imports(MODULES[m])
              if rule_breaks(package, name, inside)]
    assert broken == [], f"{package}: {doc.splitlines()[0]}"


def graph(node_of) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for m, path in MODULES.items():
        for name, _ in imports(path):
            if name in MODULES and node_of(name) != node_of(m):
                edges.setdefault(node_of(m), set()).add(node_of(name))
    return edges


def a_circle(edges: dict[str, set[str]]) -> list[str]:
    """One circle in the graph, or []."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_module_imports_itself_round_a_circle():
    assert a_circle(graph(lambda m: m)) == []


def test_no_import_goes_up():
    # A subpackage is one node (what it holds sits at one level); the laptop's own modules are each one:
    # a circle here is an arrow up, as spec -> targets/ was while targets/ imports spec.
    def node(m: str) -> str:
        return m if package_of(m) == "kchain" else package_of(m).split(".")[1] if m.count(".") > 1 else m

    assert a_circle(graph(node)) == []


def test_every_module_has_its_row_in_the_map():
    rows = set(re.findall(r"^\| `(kchain/[\w/]+\.py)` \|", DESIGN.read_text(), re.MULTILINE))
    modules = {p.relative_to(ROOT).as_posix() for p in MODULES.values() if p.name != "__init__.py"}
    assert sorted(modules - rows) == [], "docs/design.md's map has no row for these"
    assert sorted(rows - modules) == [], "docs/design.md's map names modules that are gone"
