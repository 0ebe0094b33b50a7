"""kchain/local/executor.py: the executor's kernel listens on unix sockets of its own (no TCP port races), and it is this
interpreter's ipykernel whatever kernelspecs the machine holds."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from kchain.local import executor
from kchain.local.executor import SOCKET_PATH_MAX, execute_notebook

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


def test_a_python3_kernelspec_of_another_environment_does_not_run_the_notebook(tmp_path, monkeypatch):
    # `python -m ipykernel install --user`, run once from another environment (a conda env, an older venv),
    # leaves a `python3` kernelspec in the user's Jupyter data dir; outside a venv jupyter_client prefers it to
    # this interpreter's own. Here it would set a variable in its kernel, so the notebook tells which kernel ran.
    data = tmp_path / "jupyter-data"
    spec = data / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (another environment)", "language": "python",
        "env": {"KCHAIN_TEST_OTHER_KERNEL": "1"},
    }))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(data))
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "0")  # as outside a venv: the user's dir comes first
    path = tmp_path / "nb.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, sys\nprint('kernel', os.environ.get('KCHAIN_TEST_OTHER_KERNEL', 'this'), sys.executable)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    result = execute_notebook(path, tmp_path / "root")
    assert result.ok, result.error
    said = next(m["data"].split() for m in result.log if m["data"].startswith("kernel"))
    assert said == ["kernel", "this", sys.executable]


def test_the_environment_given_is_the_kernels_whole_environment(tmp_path, monkeypatch):
    # The smoke runs its notebooks from threads of its own process and drops what the shell may hold (a fault,
    # a session clock); a variable left out of `env` must not come back from this process's environment.
    monkeypatch.setenv("KCHAIN_FAULT", "kill_after_checkpoint=1")
    path = tmp_path / "nb.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nprint('seen', os.environ.get('KCHAIN_FAULT', '-'), os.environ.get('KCHAIN_TEST_GIVEN', '-'))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    env = {k: v for k, v in os.environ.items() if k != "KCHAIN_FAULT"}
    result = execute_notebook(path, tmp_path / "root", env={**env, "KCHAIN_TEST_GIVEN": "1"})
    assert result.ok, result.error
    assert next(m["data"].split() for m in result.log if m["data"].startswith("seen")) == ["seen", "-", "1"]


def test_on_a_thread_the_loop_the_run_made_is_closed_and_the_threads_own_is_kept(tmp_path):
    """jupyter_core's run_sync makes the thread an event loop and leaves it open; the run closes that one
    (left to the garbage collector, it is a ResourceWarning raised inside unrelated code) and gives the
    thread back the loop it had."""
    seen: dict = {}

    def body() -> None:
        own = asyncio.new_event_loop()
        asyncio.set_event_loop(own)
        result = execute_notebook(notebook(tmp_path / "nb.ipynb"), tmp_path / "root",
                                  on_kernel=lambda _pid: seen.setdefault("made", asyncio.get_running_loop()))
        seen.update(ok=result.ok, own=own, current=asyncio.get_event_loop_policy().get_event_loop())
        own.close()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["ok"] and seen["made"] is not seen["own"]
    assert seen["made"].is_closed()
    assert seen["current"] is seen["own"]


def test_the_kernel_is_ipykernels_launcher_less_its_debugger(tmp_path, monkeypatch):
    # The notebook sees the sys.argv and sys.path that `python -m ipykernel_launcher` gives (runpy is what -m
    # runs), and imports debugpy as on Kaggle; only the kernel's start-up no longer loads it.
    path = tmp_path / "nb.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import json, sys\nat_start = 'debugpy' in sys.modules\nimport debugpy\n"
        "print('seen', json.dumps([sys.argv[0], sys.argv[1], sys.path, at_start, debugpy.__name__]))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))

    def seen() -> list:
        result = execute_notebook(path, tmp_path / "root")
        assert result.ok, result.error
        return json.loads(next(m["data"] for m in result.log if m["data"].startswith("seen"))[5:])

    ours = seen()
    monkeypatch.setattr(executor, "KERNEL_MAIN", "import runpy\nrunpy.run_module('ipykernel_launcher', "
                                                 "run_name='__main__', alter_sys=True)\n")
    launcher = seen()
    assert ours[3] is False and launcher[3] is True  # ipykernel's own launcher loads debugpy as it starts
    assert ours[:3] + ours[4:] == launcher[:3] + launcher[4:]
    assert Path(ours[0]).name == "ipykernel_launcher.py" and ours[1] == "-f" and ours[4] == "debugpy"


def test_a_notebook_thread_killed_before_its_kernel_started_kills_the_kernel_as_it_starts(tmp_path, monkeypatch):
    # A session killed at its first moment (a deadline, a cancel, the emulator stopping): the kill comes before
    # the kernel's pid is known, so the kernel dies as soon as it has started, and the thread ends.
    left: list = []  # exit-time callbacks registered and not unregistered since (still registered for real)
    register, unregister = atexit.register, atexit.unregister

    def track(func, *args, **kwargs):
        left.append(func)
        return register(func, *args, **kwargs)

    def untrack(func) -> None:
        left[:] = [f for f in left if f != func]
        unregister(func)

    monkeypatch.setattr(atexit, "register", track)
    monkeypatch.setattr(atexit, "unregister", untrack)
    run = executor.NotebookThread(notebook(tmp_path / "nb.ipynb"), tmp_path / "root", dict(os.environ)).start()
    run.kill()
    assert run.wait() == 1 and run.error  # no cell ran to its end
    assert run.pid is not None and not _alive(run.pid)
    # nbclient's exit-time cleanup of that kernel is not left behind, to fail at this process's exit
    assert not [f for f in left if isinstance(getattr(f, "__self__", None), NotebookClient)]


def test_a_session_on_a_thread_writes_its_streams_its_log_entries_and_its_error(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys\nprint('out line')\nprint('err line', file=sys.stderr)\nraise ValueError('wrong shape')")])
    for cell in nb.cells:
        del cell["id"]  # as a notebook written by hand or by an older tool: nbformat would warn, an error here
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    files = [tmp_path / name for name in ("log.jsonl", "stdout.txt", "stderr.txt")]
    run = executor.start_session(tmp_path / "nb.ipynb", tmp_path / "root", dict(os.environ), *files)
    assert run.wait() == 1
    entries = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [(e["stream_name"], e["data"]) for e in entries[:2]] == [("stdout", "out line\n"), ("stderr", "err line\n")]
    assert files[1].read_text() == "out line\n"
    assert files[2].read_text().splitlines()[-1] == "ValueError: wrong shape"  # where a session's failure is read


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
