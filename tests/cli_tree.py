"""Every kchain command and subcommand's `--help`, run with CliRunner; the tests run it in-process and,
as a script, under click 8.1 (`python tests/cli_tree.py` prints one JSON object).

Standard library, click and kchain only: the click 8.1 Python is CI's SkyPilot venv, which has nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TypedDict

import click
from click.testing import CliRunner

from kchain.cli import cli


class Help(TypedDict):
    """One command's answer to its help option."""

    exit_code: int
    output: str
    error: str | None  # the exception it raised (not SystemExit), as "Type: message"


def command_paths(command: click.Command = cli, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command under command, itself first (() is `kchain` itself)."""
    yield path
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from command_paths(command.commands[name], (*path, name))


def helps(option: str = "--help") -> dict[str, Help]:
    """{'kchain emulator serve': {'exit_code': 0, 'output': ..., 'error': None}, ...} for every command."""
    runner = CliRunner()
    answers: dict[str, Help] = {}
    for path in command_paths():
        result = runner.invoke(cli, [*path, option], prog_name="kchain")
        answers[" ".join(("kchain", *path))] = {
            "exit_code": result.exit_code, "output": result.output,
            "error": None if result.exception is None or isinstance(result.exception, SystemExit)
            else f"{type(result.exception).__name__}: {result.exception}"}
    return answers


if __name__ == "__main__":
    import importlib.metadata

    print(json.dumps({"click": importlib.metadata.version("click"), "helps": helps()}))
