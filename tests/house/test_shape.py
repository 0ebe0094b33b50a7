"""The runtime's shape, as issue #21 asked for it: a thin Run over parts that never see it."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import make_run

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "kchain" / "runtime"
COMMON = ROOT / "kchain" / "common"
MAX_FUNCTION_LINES = 60


def test_the_run_holds_only_its_parts_and_records(tmp_path):
    from kchain.common import config, layout, settings, trace, trackers
    from kchain.runtime import clock, distributed, ladder, loop, precision, progress
    from kchain.runtime.checkpoint import checkpointer
    from kchain.runtime.frameworks import tensorboard
    from kchain.runtime.run import Params

    run = make_run(tmp_path)
    kinds = (config.RuntimeConfig, settings.Settings, Params, layout.Paths, distributed.Ranks, precision.Amp,
             progress.Progress, clock.SessionClock, trace.Trace, checkpointer.Checkpointer, loop.Loop, ladder.Rung,
             trackers.RunIds, tensorboard.Log)
    held = vars(run)
    assert len(held) <= 25 and all(name.startswith("_") for name in held)
    assert [name for name, part in held.items() if not isinstance(part, kinds)] == []
    run.close()


def test_no_runtime_part_imports_the_run():
    importers = []
    for path in sorted(RUNTIME.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module == "kchain.runtime.run" or (
                    node.module == "kchain.runtime" and any(a.name == "run" for a in node.names))):
                importers.append(path.name)
    assert sorted(set(importers)) == ["launch.py"]  # the launcher builds the Run; no part does


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted([*ROOT.glob("kchain/**/*.py"), *ROOT.glob("kernel_templates/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None  # ast.parse sets it on every node
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_runtime_reads_its_config_through_the_typed_record_only():
    reads = [f"{path.name}:{n}" for path in sorted([*RUNTIME.rglob("*.py"), *COMMON.glob("*.py")])
             for n, line in enumerate(path.read_text().splitlines(), 1) if "config.get(" in line]
    assert reads == []


def test_the_laptop_parses_python_through_the_one_thread_safe_parse():
    # CPython 3.11's AST converter is not thread-safe (python/cpython#106905): rehearse renders in two threads.
    direct = []
    for path in sorted(ROOT.glob("kchain/**/*.py")):
        if RUNTIME in path.parents or COMMON in path.parents or path.name == "notebook_code.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in {"ast.parse", "compile"}:
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert direct == []


def test_no_test_reaches_into_the_runs_private_parts():
    """Tests use the Run as the user and the launcher do (its public members, run.launcher), or test a part
    directly; a test that reads run._something breaks with every reshape and proves nothing the user sees."""
    import re

    here = Path(__file__).resolve()
    private = re.compile(r"\brun\._[a-z]")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "tests").rglob("*.py")) if path != here
             for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert found == []
