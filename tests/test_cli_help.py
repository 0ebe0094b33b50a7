"""The CLI as a Click user meets it: every command's help, `-h` as well as `--help`, under the click this
environment has and under click 8.1 (`click>=8.1` is the floor kchain declares)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cli_tree import command_paths, helps

from kchain.cli import cli

REPO = Path(__file__).resolve().parent.parent
# A Python with click 8.1: CI's SkyPilot venv (the README's test command makes it), because SkyPilot 0.14.1
# pins click<8.2. It has click, pydantic, jinja2 and PyYAML, which is all a command's help imports.
CLICK81_PYTHON = REPO / ".venv" / "sky" / "bin" / "python"
TIMEOUT_S = 300  # a hung child fails the test instead of hanging CI; never a speed bound


def leaf(path: tuple[str, ...]) -> bool:
    command = cli
    for name in path:
        command = command.commands[name]
    return not hasattr(command, "commands")


def test_every_command_answers_help_and_h_with_an_example():
    long, short = helps("--help"), helps("-h")
    assert list(long) == [" ".join(("kchain", *p)) for p in command_paths()]
    for name, answer in long.items():
        assert (answer["exit_code"], answer["error"]) == (0, None), (name, answer)
        assert short[name] == answer, name
        assert answer["output"].startswith(f"Usage: {name} "), name
    assert all("Example:" in long[" ".join(("kchain", *p))]["output"] for p in command_paths() if leaf(p))


def test_every_command_answers_help_under_click_8_1():
    assert CLICK81_PYTHON.exists(), (
        f"no Python with click 8.1 at {CLICK81_PYTHON}: python3 -m venv .venv/sky && .venv/sky/bin/pip install "
        "-q skypilot==0.14.1 (the README's test command does)")
    done = subprocess.run([str(CLICK81_PYTHON), str(REPO / "tests" / "cli_tree.py")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert answers["click"].startswith("8.1."), f"{CLICK81_PYTHON} has click {answers['click']}, not 8.1"
    failed = {name: a for name, a in answers["helps"].items() if (a["exit_code"], a["error"]) != (0, None)}
    assert failed == {}
    serve = " ".join(answers["helps"]["kchain emulator serve"]["output"].split())
    assert "--missing-status [403|404] Switch: the answer for a missing or invisible kernel or dataset. " \
           "[default: 403]" in serve  # the emulator's own default, shown by click 8.1 too
