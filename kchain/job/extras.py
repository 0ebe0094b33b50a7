"""The packages a job's code imports, and how each reaches the laptop and the kernel.

A job imports its own modules, the standard library, kchain, and packages: torch, and often a framework
(transformers, peft, accelerate, Lightning) or anything else. For each package the laptop's smoke needs it
installed here, and the Kaggle session needs it in Kaggle's image (or in `kaggle.pip`'s wheels). `doctor`
compares the two sides with what this module finds:

- `imported(files)`: the top-level names the job's code imports that are not its own, the standard
  library's or kchain's, read from the code (nothing is imported);
- `sources(files)`: each Python source of the code parsed, under the name messages give it (a notebook's
  cells one by one), what `imported` and codecheck.py read;
- `distribution(module)`: the distribution that installs a module here (`pytorch_lightning` is
  `pytorch-lightning`), or the module's own name, normalised, when this laptop does not have it;
- `extra(distribution)`: kchain's extra that installs it and the floor it asks for, read from kchain's
  own installed metadata, the one place pyproject.toml's extras are written down.

Standard library only, and `packaging` for version specifiers.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata

from kchain.job.notebook_code import parse_python

OWN = {"kchain", "__future__"}
# The tuple of (name, code) a notebook made a module holds its cells in (notebook_code._module_text), as a
# script that trains at module level holds its one: its code is in strings, not in the module's tree.
CELLS = "_KCHAIN_CELLS"


@dataclass(frozen=True)
class Extra:
    name: str  # pip install 'kchain[<name>]'
    specifier: str  # what kchain asks of the distribution, e.g. ">=5.24"

    @property
    def install(self) -> str:
        return f"pip install 'kchain[{self.name}]'"


def imported(files: dict[str, bytes]) -> list[str]:
    """The top-level modules the payload's Python files import that are not the job's own (a module or
    package in its code folder), the standard library's or kchain's; sorted. A file that does not parse
    is skipped (render and the smoke say why)."""
    own = {name.removeprefix("code/").split("/")[0].removesuffix(".py") for name in files}
    found: set[str] = set()
    for _, tree in sources(files):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return sorted(m for m in found if m not in own and m not in OWN and m not in sys.stdlib_module_names)


def sources(files: dict[str, bytes]) -> Iterator[tuple[str, ast.Module]]:
    """Each Python source of the payload's files, parsed: a .py file under its path in the code folder
    (`train.py`), a notebook made a module (or a script that trains at module level) by each cell it runs,
    under the name its traceback gives it (`train.ipynb, cell 3`; the script's own name), so line numbers
    are the cell's. A source that does not parse is skipped (render and the smoke say why)."""
    for name, data in files.items():
        if not name.endswith(".py"):
            continue
        try:
            tree = parse_python(data.decode("utf-8", errors="replace"), name)
        except (SyntaxError, ValueError):
            continue
        cells = next((node.value for node in tree.body if isinstance(node, ast.Assign) and len(node.targets) == 1
                      and isinstance(node.targets[0], ast.Name) and node.targets[0].id == CELLS), None)
        if cells is None:
            yield name.removeprefix("code/"), tree
            continue
        try:
            made = ast.literal_eval(cells)
        except ValueError:
            continue
        for cell, code in made:
            try:
                yield cell, parse_python(code, cell)
            except (SyntaxError, ValueError):
                continue


def _normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _installed_by() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def distribution(module: str) -> str:
    """The distribution that installs `module` on this laptop, else the module's name normalised."""
    found = _installed_by().get(module)
    return _normalise(found[0]) if found else _normalise(module)


def pinned(pins: tuple[str, ...] | list[str]) -> dict[str, str]:
    """kaggle.pip's pins (name==version, checked by the spec) by their distribution's normalised name."""
    return {_normalise(re.split(r"[=<>!~;@\[ ]", pin, maxsplit=1)[0]): pin for pin in pins}


def version(dist: str) -> str | None:
    """The installed version of a distribution on this laptop, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _extras() -> dict[str, Extra]:
    """kchain's extras by the distribution each installs (the first extra that names it; not `dev`)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: dict[str, Extra] = {}
    try:
        requires = metadata.requires("kchain") or []
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return out
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        named = re.search(r"""extra\s*==\s*["']([^"']+)["']""", str(req.marker or ""))
        if named and named.group(1) != "dev":
            out.setdefault(_normalise(req.name), Extra(named.group(1), str(req.specifier)))
    return out


def extra(dist: str) -> Extra | None:
    """The kchain extra that installs this distribution, or None."""
    return _extras().get(_normalise(dist))


def admits(dist: str, version_text: str) -> bool | None:
    """Whether kchain's extra for `dist` admits this version (None: no extra names it, or an unreadable version)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = extra(dist)
    if found is None:
        return None
    try:
        return Version(version_text) in SpecifierSet(found.specifier)
    except InvalidVersion:
        return None


def install_hint(module: str) -> str:
    """How to install a package this laptop lacks: kchain's extra when one has it, else pip."""
    dist = distribution(module)
    found = extra(dist)
    return found.install if found else f"pip install {dist}"
