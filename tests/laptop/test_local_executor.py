"""kchain/local.py: the executor's kernel listens on unix sockets of its own (no TCP port races)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

from kchain.local import SOCKET_PATH_MAX, execute_notebook

CELL = "from ipykernel.kernelapp import IPKernelApp\nprint('transport', IPKernelApp.instance().transport)\n"


def notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def transport(result) -> str:
    assert result.ok, result.error
    return next(m["data"].split()[1] for m in result.log if m["data"].startswith("transport"))


def test_the_kernel_listens_on_unix_sockets_that_are_gone_afterwards(tmp_path):
    result = execute_notebook(notebook(tmp_path / "nb.ipynb"), tmp_path / "root")
    assert transport(result) == "ipc"
    assert not list(Path(tempfile.gettempdir()).glob("kchain-k-*"))  # the sockets' folder is removed


def test_a_temp_dir_too_deep_for_a_socket_path_falls_back_to_tcp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * (SOCKET_PATH_MAX - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    result = execute_notebook(notebook(tmp_path / "nb.ipynb"), tmp_path / "root")
    assert transport(result) == "tcp"
