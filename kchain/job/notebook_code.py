"""A Kaggle notebook as a job's code (`code: train.ipynb`): its code cells become the job's module.

`to_module(data, name)` is pure: the same cells give the same module text, whatever the notebook's
outputs and execution counts. Those never travel (they may hold secrets or megabytes, and running the
notebook again must not change the fingerprint); markdown and raw cells are dropped. The cells run in
the file's order, not their execution counts', each compiled under the name "<notebook>, cell N" (N
counts every cell from 1, markdown too, as the notebook shows them) in the module's namespace, as
Jupyter runs them: a traceback names the notebook's cell and line, and shows the line.

The entry: a notebook that defines `main(run)` (or the function `entry:` names) is a module like a .py
file, its cells run when it is imported and kchain calls main(run). A notebook without one is the
training itself: the module's generated main(run) binds `run` as a global and runs the cells.

IPython syntax: a cell that is not plain Python goes through IPython's own transformer (what Jupyter
and Kaggle run), and each magic, shell or help line it finds is handled by the tables below. Display
and interactive ones are dropped (the line becomes `pass`, with a note); %time, %%time, %%capture
and %env become plain Python; everything else is refused with the cell, the line and the fix.
"""

from __future__ import annotations

import ast
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeGuard, cast

MAX_SHOWN = 60  # characters of a cell's line quoted in a message

INSTALL = ("a package install",
           "Kaggle's image has the common packages: delete the line, or attach the wheels as a dataset and pip "
           "install them in Python with --no-index --find-links run.input(...)")
SHELL = ("a shell command", "the training is a Python process: write it in Python (subprocess.run([...], "
                            "check=True), shutil, pathlib)")
WRITEFILE = ("writes a file", "put the file beside the notebook (code: a folder holding both) or write it "
                              "with open() in Python")
TIMEIT = ("a benchmark that runs its statement many times", "delete it, or time one run with time.perf_counter()")
UNKNOWN = ("an IPython magic the training process does not have", "write it in Python, or delete it")
EXTENSION = ("an IPython extension", "import what it provides in Python instead")
GET_IPYTHON = ("IPython's get_ipython()", "the training is a plain Python process: write it in Python")
LAUNCHER = ("accelerate's notebook_launcher starts training processes of its own, and kchain's ranks are the "
            "job's processes (one per GPU)", "call the function itself, e.g. training_function(*args), with its "
            "Accelerator from run.accelerator(...)")

# Line magics that only display or steer the interactive session: dropped, the line becomes `pass`.
DISPLAY_LINE = {
    "matplotlib", "config", "autoreload", "aimport", "xmode", "pdb", "precision", "pprint", "colors",
    "who", "whos", "who_ls", "pwd", "lsmagic", "magic", "quickref", "history", "hist", "tensorboard",
}
HELP_LINE = {"pinfo", "pinfo2", "pdoc", "pdef", "psource", "pfile", "psearch"}  # obj? and obj??
DROPPED_EXTENSIONS = {"autoreload", "tensorboard"}  # %load_ext of these only serves the above
REFUSED_LINE = {
    **dict.fromkeys(("pip", "conda", "mamba", "micromamba", "uv"), INSTALL),
    **dict.fromkeys(("sx", "sc", "system", "bash", "sh"), SHELL),
    "cd": ("changes the folder", "use absolute paths: run.working, run.input(...)"),
    "run": ("runs another file", "import it: put the file beside the notebook (code: a folder holding both)"),
    "timeit": TIMEIT,
}
# Cell magics: the body kept (the cell runs, untimed or uncaptured), the cell dropped, or refused.
KEPT_CELL = {"time": "the cell runs untimed", "capture": "the cell runs and its output is printed"}
DISPLAY_CELL = {"html", "javascript", "js", "latex", "markdown", "svg"}
REFUSED_CELL = {
    **dict.fromkeys(("bash", "sh", "script", "system", "sx", "perl", "ruby", "python", "python2", "python3",
                     "pypy"), SHELL),
    "writefile": WRITEFILE, "file": WRITEFILE, "timeit": TIMEIT,
}
_INSTALL_COMMAND = re.compile(r"\b(pip3?|conda|mamba|micromamba|uv|apt|apt-get)\b.*\binstall\b")


# CPython 3.11 keeps the AST converter's recursion depth in state shared by all threads: two threads that
# parse at once can fail with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905,
# seen in CI when rehearse renders its reference run in a thread while a session renders). Every parse and
# every compile of a tree on the laptop goes through this lock.
_AST_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """ast.parse, safe to call from several threads at once (see _AST_LOCK)."""
    with _AST_LOCK:
        return ast.parse(source, filename=filename)


class NotebookError(ValueError):
    """A notebook kchain cannot run as a job's code; the message names the cell, the line and the fix."""


@dataclass(frozen=True)
class Module:
    """A notebook made a module: its text, its entry kind, what it held and what was dropped."""

    text: str
    entry: str  # "main": the notebook defines the entry; "cells": the cells are the training
    code_cells: int
    other_cells: int  # markdown and raw cells, dropped
    notes: tuple[str, ...]  # each dropped line, e.g. "cell 2, line 1 `%matplotlib inline`: display only"

    def summary(self, module_name: str) -> str:
        """What `kchain render` says of the notebook, e.g. "5 code cells made code/train.py; ..."."""
        return (f"{_count(self.code_cells, 'code cell')} made {module_name}; "
                f"{_count(self.other_cells, 'markdown or raw cell')} and every output left out")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


@dataclass
class _Cell:
    """One code cell as written, and what refusals and notes say about its lines."""

    notebook: str
    number: int
    lines: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def filename(self) -> str:
        return f"{self.notebook}, cell {self.number}"

    def at(self, line: int) -> str:
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        text = text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."
        return f"cell {self.number}, line {line} `{text}`"

    def refuse(self, line: int, what: tuple[str, str]) -> NotebookError:
        return NotebookError(f"{self.notebook} {self.at(line)}: {what[0]}; {what[1]}")

    def drop(self, line: int, why: str) -> None:
        self.notes.append(f"{self.at(line)}: {why}")


def to_module(data: bytes, name: str, function: str = "main", named: bool = False) -> Module:
    """The module text of the notebook `name` (as shown in messages and tracebacks, e.g. train.ipynb).
    `function` is the entry's function; `named`: the job's entry: names it, so it must be defined."""
    cells, other = _read(data, name)
    kept: list[tuple[_Cell, str, ast.Module]] = []
    notes: list[str] = []
    for number, source in cells:
        cell = _Cell(name, number, source.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
        converted = _cell_python(cell)
        notes += cell.notes
        if converted is not None:
            kept.append((cell, *converted))
    for cell, _, tree in kept:
        launch = next((n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) == "notebook_launcher"), None)
        if launch is not None:
            raise cell.refuse(launch.lineno, LAUNCHER)
    entry = _entry([(cell, tree) for cell, _, tree in kept], name, function, named)
    text = _module_text(name, [(cell.filename, code) for cell, code, _ in kept], entry, notes)
    return Module(text=text, entry=entry, code_cells=len(cells), other_cells=other, notes=tuple(notes))


def script_module(source: str, name: str) -> str:
    """The module text of a training script written at module level (nanoGPT's train.py shape: no
    main(run), the training in the file's own body): the file runs as a notebook's one cell runs, with
    `run` bound, under its own name so a traceback names its lines."""
    tree = parse_python(source, name)
    if any(_binds(node, "run") for node in tree.body):
        raise NotebookError(f"{name} binds `run` itself, which hides the run kchain gives the script; rename it")
    return _module_text(name, [(name, source)], "cells", [])


def runs_at_module_level(tree: ast.Module, function: str) -> bool:
    """A script that trains in its own body: it defines no `function` and uses `run` outside functions."""
    return not any(_binds(node, function) for node in tree.body) and any(True for _ in _module_scope_runs(tree))


def _read(data: bytes, name: str) -> tuple[list[tuple[int, str]], int]:
    """The code cells (number, source) in the file's order, and how many other cells it has."""
    import nbformat

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{name}: is not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start}); "
                            "save the notebook from Jupyter or Kaggle again") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. cells without ids (older notebooks): ids are not used
            notebook = nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat raises JSON, schema and version errors of several kinds
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise NotebookError(f"{name}: not a notebook nbformat can read ({first}); save it from Jupyter or "
                            "Kaggle again") from None
    meta = notebook.get("metadata") or {}
    language = (meta.get("kernelspec") or {}).get("language") or (meta.get("language_info") or {}).get("name")
    if isinstance(language, str) and language.lower() not in ("python", "python3"):
        raise NotebookError(f"{name}: is a notebook in {language}; kchain runs Python: port it to a Python notebook")
    cells, other = [], 0
    for number, cell in enumerate(notebook.get("cells") or [], 1):
        if cell.get("cell_type") != "code":
            other += 1
            continue
        source = cell.get("source") or ""
        cells.append((number, "".join(source) if isinstance(source, list) else str(source)))
    return cells, other


def _cell_python(cell: _Cell) -> tuple[str, ast.Module] | None:
    """A cell's Python, with the cell's line numbers, and its tree; None for a cell dropped whole."""
    lines = list(cell.lines)
    while lines and not lines[-1].strip():
        lines.pop()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    head = lines[first].strip()
    if head.startswith("%%"):
        magic, _, arg = head[2:].partition(" ")
        if not _cell_magic(cell, first + 1, magic, arg.strip()):
            return None
        lines[first] = ""  # the body keeps its line numbers
    code = "\n".join(lines)
    try:
        tree = _compile(code, cell, plain=True)
    except SyntaxError:  # not plain Python: IPython syntax, or a syntax error _compile names below
        code = _ipython(code, cell)
        tree = _compile(code, cell)
    return _apply_magics(code, tree, cell)


def _cell_magic(cell: _Cell, line: int, magic: str, arg: str) -> bool:
    """Whether a cell magic's body is kept (True), the cell dropped (False); or the refusal."""
    if magic in KEPT_CELL and not (magic == "capture" and arg and not arg.startswith("-")):
        cell.drop(line, f"{KEPT_CELL[magic]} (%%{magic} dropped)")
        return True
    if magic == "capture":
        raise cell.refuse(line, ("keeps the output in a variable",
                                 "write %%capture alone, or read the output from the training log"))
    if magic in DISPLAY_CELL:
        cell.drop(line, "a display cell, dropped whole")
        return False
    raise cell.refuse(line, REFUSED_CELL.get(magic, UNKNOWN))


def _compile(code: str, cell: _Cell, plain: bool = False) -> ast.Module:
    """The cell's tree, compiled once to find every syntax error (`return` or `await` outside a
    function too). plain: the first try, as plain Python; its SyntaxError goes on to IPython's syntax."""
    try:
        with _AST_LOCK:
            tree = ast.parse(code, filename=cell.filename)
            compile(tree, cell.filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        if plain:
            raise
        raise cell.refuse(exc.lineno or 1, (exc.msg, "fix the syntax")) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte, a nesting too deep
        raise cell.refuse(1, (f"cannot be compiled ({str(exc)[:80]})", "fix the cell")) from None
    return tree


def _ipython(code: str, cell: _Cell) -> str:
    """The cell as IPython runs it, its magics as get_ipython() calls, on the same line numbers."""
    from IPython.core.inputtransformer2 import TransformerManager

    lines = code.split("\n")
    lead = next(i for i, line in enumerate(lines) if line.strip())  # IPython drops leading blank lines
    try:
        out = [""] * lead + TransformerManager().transform_cell(code).rstrip("\n").split("\n")
    except Exception:  # IPython's tokenizer gave up (an unclosed string...): the syntax error is named next
        return code
    if len(out) != len(lines):  # a magic continued with a backslash: IPython joined its lines
        line = next((i for i, text in enumerate(lines) if text.rstrip().endswith("\\")), 0) + 1
        raise cell.refuse(line, ("a magic or shell line continued onto the next line",
                                 "write it on one line, or in Python"))
    return "\n".join(out)


def _apply_magics(code: str, tree: ast.Module, cell: _Cell) -> tuple[str, ast.Module]:
    """Each get_ipython() statement becomes `pass` (dropped) or its Python; any other use is refused."""
    lines = code.split("\n")
    handled: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Expr) or not _is_magic(node.value) or node.lineno != node.end_lineno:
            continue
        call = node.value
        replacement = _magic(call, cell, node.lineno)
        handled.add(id(_get_ipython(call)))
        line = lines[node.lineno - 1]
        lines[node.lineno - 1] = (f"{line[:node.col_offset]}{replacement}{line[node.end_col_offset:]}"
                                  f"  # kchain: {cell.lines[node.lineno - 1].strip()}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_ipython" and id(node) not in handled:
            outer = next((c for c in ast.walk(tree) if _is_magic(c) and _get_ipython(c) is node), None)
            raise cell.refuse(node.lineno, _refusal(outer) if outer is not None else GET_IPYTHON)
    if not handled:
        return code, tree
    code = "\n".join(lines)
    return code, _compile(code, cell)


def _is_magic(node: ast.AST | None) -> TypeGuard[ast.Call]:
    """get_ipython().method(...): how IPython writes a magic, a shell line or a help line."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call) and not node.func.value.args
            and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "get_ipython")


def _method(magic: ast.Call) -> str:
    """The method a magic calls (run_line_magic, system, ...); its func is an Attribute (_is_magic)."""
    return cast(ast.Attribute, magic.func).attr


def _get_ipython(magic: ast.Call) -> ast.expr:
    """The `get_ipython` name a magic calls; its func is get_ipython().method (_is_magic)."""
    return cast(ast.Call, cast(ast.Attribute, magic.func).value).func


def _arguments(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _refusal(call: ast.Call) -> tuple[str, str]:
    """Why a magic used as a value (`x = !ls`, `y = %sx ls`) is refused."""
    method, args = _method(call), _arguments(call)
    if method in ("system", "getoutput"):
        return INSTALL if args and _INSTALL_COMMAND.search(args[0]) else SHELL
    if method == "run_line_magic" and args:
        return REFUSED_LINE.get(args[0], ("an IPython magic used as a value", "write it in Python"))
    return GET_IPYTHON


def _magic(call: ast.Call, cell: _Cell, line: int) -> str:
    """The Python a magic statement becomes (`pass` for one dropped, with a note); or the refusal."""
    method, args = _method(call), _arguments(call)
    if method != "run_line_magic" or len(args) != 2 or len(call.args) != 2:
        raise cell.refuse(line, _refusal(call))
    name, arg = args
    if name in DISPLAY_LINE or name in HELP_LINE:
        cell.drop(line, "help, display only" if name in HELP_LINE else "display only")
        return "pass"
    if name in ("load_ext", "reload_ext", "unload_ext"):
        if arg.split()[:1] and arg.split()[0] in DROPPED_EXTENSIONS:
            cell.drop(line, "display only")
            return "pass"
        raise cell.refuse(line, EXTENSION)
    if name == "time":
        cell.drop(line, "the statement runs untimed (%time dropped)")
        return arg.strip() or "pass"
    if name == "env":
        return _env(arg, cell, line)
    raise cell.refuse(line, REFUSED_LINE.get(name, UNKNOWN))


def _env(arg: str, cell: _Cell, line: int) -> str:
    """%env NAME=value (or NAME value) as IPython's set_env reads it; %env alone only displays."""
    if "$" in arg or "{" in arg:
        raise cell.refuse(line, ("IPython's $variable expansion", "set it in Python: os.environ[NAME] = value"))
    bits = arg.split("=" if "=" in arg else " ", 1)
    if len(bits) < 2 or not bits[0].strip():
        cell.drop(line, "shows the environment, display only")
        return "pass"
    return f"__import__('os').environ[{bits[0].strip()!r}] = {bits[1].strip()!r}"


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Name) and t.id == name for t in targets)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    return False


def _takes_run(node: ast.stmt) -> bool:
    """A function kchain can call as f(run): one positional argument, nothing else required."""
    if not isinstance(node, ast.FunctionDef):
        return not isinstance(node, ast.AsyncFunctionDef)  # an assignment or import: spec cannot tell
    args = node.args
    positional = args.posonlyargs + args.args
    required = len(positional) - len(args.defaults)
    return required <= 1 and bool(positional or args.vararg) and all(d is not None for d in args.kw_defaults)


def _called(call: ast.Call) -> str | None:
    """The name a call calls: `f(...)` and `mod.f(...)` both call f."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _module_scope_runs(node: ast.AST) -> Iterator[ast.Name]:
    """Each name `run` at the module's top level, outside every function body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.Name) and child.id == "run":
            yield child
        yield from _module_scope_runs(child)


def _entry(cells: list[tuple[_Cell, ast.Module]], name: str, function: str, named: bool) -> str:
    """"main" when the notebook defines the entry function, "cells" when its cells are the training."""
    bound = [(cell, node) for cell, tree in cells for node in tree.body if _binds(node, function)]
    if bound:
        cell, node = bound[-1]  # as in Jupyter, the last definition wins
        if not _takes_run(node):
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))  # _takes_run is True otherwise
            signature = f"{'async ' * isinstance(node, ast.AsyncFunctionDef)}def {function}({ast.unparse(node.args)})"
            raise cell.refuse(node.lineno, (f"`{signature}` cannot be called as {function}(run)",
                                            f"write def {function}(run):"))
        names = [(cell, n) for cell, tree in cells for n in _module_scope_runs(tree)]
        if names and not any(isinstance(n.ctx, ast.Store) for _, n in names):  # a notebook may set run itself
            cell, use = names[0]
            raise cell.refuse(use.lineno, (f"uses run outside {function}(run), where it is undefined",
                                           f"kchain calls {function}(run) itself: move the line into {function}, "
                                           f"or delete {function} to make the cells the training"))
        return "main"
    if named:
        raise NotebookError(f"{name}: defines no function {function!r}; add `def {function}(run):` in a cell, "
                            "or remove entry: to make the cells the training")
    uses = any(isinstance(n, ast.Name) and n.id == "run" for _, tree in cells for n in ast.walk(tree))
    shadow = next(((cell, node) for cell, tree in cells for node in tree.body if _binds(node, "run")), None)
    if uses and shadow is not None:  # the cells run with kchain's `run` bound: their own would hide it
        raise shadow[0].refuse(shadow[1].lineno, ("binds `run` itself, which hides the run kchain gives the cells",
                                                  "rename it (or define main(run))"))
    if not uses:
        raise NotebookError(f"{name}: no cell uses run and none defines {function}(run); train in a cell with "
                            "`for step in run.steps(N):` (kchain binds run), or define main(run)")
    return "cells"


def _module_text(name: str, cells: list[tuple[str, str]], entry: str, notes: list[str]) -> str:
    """The module: the cells' code by name, a display() fallback, and the entry."""
    out = [
        f"# {name!r} made a module by kchain render (kchain/job/notebook_code.py): its code cells in order,",
        "# markdown and raw cells and every output left out. Each cell runs in this module's namespace, as",
        "# Jupyter runs it, compiled as '<notebook>, cell N' so that a traceback names its cell and line.",
        *(f"# dropped: {note}" for note in notes),
        "import linecache as _kchain_linecache",
        "",
        "_KCHAIN_CELLS = (",
        *(f"    ({filename!r}, {code!r})," for filename, code in cells),
        ")",
        "",
        "",
        "def display(*objects, **options):",
        '    """IPython\'s display() for a notebook that calls it without importing it: prints each object."""',
        "    for obj in objects:",
        "        print(obj)",
        "",
        "",
        "def _kchain_run_cells():",
        "    for name, code in _KCHAIN_CELLS:",
        "        lines = [line + '\\n' for line in code.split('\\n')]  # what a traceback shows of each line",
        "        _kchain_linecache.cache[name] = (len(code), None, lines, name)",
        "        exec(compile(code, name, 'exec', dont_inherit=True), globals())",
        "",
        "",
    ]
    if entry == "cells":
        out += ["def main(run):",
                '    """The notebook defines no main(run): its cells are the training, run with `run` bound."""',
                "    globals()['run'] = run",
                "    _kchain_run_cells()"]
    else:
        out += ["_kchain_run_cells()  # the notebook defines its entry: its cells run on import, like a module's"]
    return "\n".join(out) + "\n"
