"""What `pip install kchain` (the core install, no extra) brings is enough for the commands that need no
extra: every third-party package `kchain pull` and `kchain release` import, at module level or inside a
function, in their modules or the kchain modules they import, comes with a core dependency (or one of
theirs); a package of an extra only where the importing module names `kchain[<extra>]` in its message."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("kchain.result.pull", "kchain.result.release")  # kchain pull, kchain release (cli.py imports them in the command)


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _source(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    return next((p for p in (path / "__init__.py", path.with_suffix(".py")) if p.is_file()), None)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at module level or in a function (names of `from m import n` as m.n too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return found


def third_party(starts: tuple[str, ...]) -> dict[str, Path]:
    """Top-level third-party module -> a kchain file importing it, over every kchain module `starts` import,
    transitively."""
    todo, seen = list(starts), set()
    found: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        if module in seen or (path := _source(module)) is None:
            continue
        seen.add(module)
        for name in sorted(_imports(path)):
            top = name.split(".")[0]
            if top == "kchain":
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, path.relative_to(REPO))
    return found


def core_install(requirements: list[str]) -> set[str]:
    """The distributions a core install brings: the core dependencies and theirs, as installed here."""
    todo, seen = [Requirement(r) for r in requirements], set()
    while todo:
        req = todo.pop()
        if _name(req.name) in seen:
            continue
        seen.add(_name(req.name))
        for line in metadata.requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return seen


def test_pull_and_release_need_only_the_core_install():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = core_install(project["dependencies"])
    extras = {_name(Requirement(r).name): extra for extra, reqs in project["optional-dependencies"].items()
              if extra != "dev" for r in reqs}
    installed_by = metadata.packages_distributions()
    missing = []
    for module, importer in sorted(third_party(COMMANDS).items()):
        dist = _name((installed_by.get(module) or [module])[0])
        if dist in core:
            continue
        extra = extras.get(dist)
        if extra is None or f"kchain[{extra}]" not in (REPO / importer).read_text():
            missing.append(f"{module} ({dist}, imported by {importer}"
                           + (f": in kchain[{extra}], and the module names no `kchain[{extra}]`)" if extra else ")"))
    assert missing == [], "not installed by `pip install kchain`: " + "; ".join(missing)


def test_the_check_sees_imports_inside_functions_and_safetensors_is_core():
    found = third_party(("kchain.result.pull",))
    assert found["safetensors"] == found["torch"] == Path("kchain/result/pull.py")  # both inside write_weights
    assert "safetensors" not in core_install([r for r in tomllib.loads((REPO / "pyproject.toml").read_text())[
        "project"]["dependencies"] if not r.startswith("safetensors")])
