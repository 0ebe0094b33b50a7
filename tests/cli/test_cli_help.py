"""The CLI as a Click user meets it: every command's help, `-h` as well as `--help`, under the click this
environment has and under click 8.1 (`click>=8.1` is the floor kchain declares)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import click
from cli_tree import command_paths, helps
from click.testing import CliRunner

from kchain.cli import cli

REPO = Path(__file__).resolve().parents[2]
# A Python with click 8.1: CI's SkyPilot venv (the README's test command makes it), because SkyPilot 0.14.1
# pins click<8.2. It has click, pydantic, jinja2 and PyYAML, which is all a command's help imports.
CLICK81_PYTHON = REPO / ".venv" / "sky" / "bin" / "python"
TIMEOUT_S = 300  # a hung child fails the test instead of hanging CI; never a speed bound


def leaf(path: tuple[str, ...]) -> bool:
    command: click.Command = cli
    for name in path:
        assert isinstance(command, click.Group), path  # only a group has subcommands
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


def test_the_exit_codes_in_kchain_help_are_the_readme_table_and_a_job_file_error_is_not_a_usage_error():
    from kchain.errors import RenderError, SpecError

    epilog = helps()["kchain"]["output"].split("Exit codes:\n")[1]
    listed = [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^ +(\d+) +.*?(?:\((\w+)\))?$", epilog, re.M)]
    readme = (REPO / "README.md").read_text().split("## Exit codes")[1]
    table = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.*) \|$", readme, re.M)}
    assert sorted({code for code, _ in listed}) == sorted(table) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    for code, name in listed:
        assert name is None or f"`{name}`" in table[code], (code, name)
    assert SpecError.exit_code == RenderError.exit_code == 10


def test_help_examples_run_from_any_folder():
    """A wheel user has no jobs/ folder: the examples use the job `kchain init myjob` writes."""
    for name, answer in helps().items():
        examples = str(answer["output"]).split("Example:\n")[-1] if "Example:" in str(answer["output"]) else ""
        paths = set(re.findall(r"(\S+/job\.yaml)", examples))
        allowed = {"myjob"} | set(re.findall(r"kchain init (?:--template \S+ )?(\S+)", examples))
        assert {p.removesuffix("/job.yaml") for p in paths} <= allowed, (name, paths)
        assert "jobs/tinygpt" not in examples and "nanogpt" not in examples, name


def test_shell_completion_completes_commands():
    done = CliRunner().invoke(cli, [], prog_name="kchain", env={
        "_KCHAIN_COMPLETE": "bash_complete", "COMP_WORDS": "kchain sta", "COMP_CWORD": "1"})
    assert done.output.split() == ["plain,status"]
