"""Run a rendered notebook on this machine, in a sandbox laid out like /kaggle.

The same executor serves `kchain smoke`, the emulator's sessions and `kchain rehearse`, so the
notebook that runs here is byte for byte the one Kaggle will run. It runs on a thread of the caller's
process (`NotebookThread`: the smoke's three notebooks, the local Kaggle's sessions, rehearse's reference
run), watched and killed as a process would be: the kernel, its training processes and their deaths are
real processes, and only the client that sends the cells is not a Python started and importing nbclient
again for each notebook. `python -m kchain.local.executor run ...` runs one as a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kchain.common import layout
from kchain.common.summary import Summary, read_working
from kchain.emulator.sessions import kill_tree

OutputFn = Callable[[str, str], None]
KernelFn = Callable[[int], None]  # told the kernel's pid once it has started
HASH_SEED_ENV = "PYTHONHASHSEED"
SOCKET_PATH_MAX = 100  # a unix socket's path is at most 104 bytes on macOS, 108 on Linux


@dataclass
class ExecResult:
    ok: bool
    error: str | None
    log: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    kernel_start_s: float = 0.0
    summary: Summary | None = None


def _prepare_root(root: Path) -> tuple[Path, Path]:
    """Create ROOT/input and ROOT/working (the /kaggle layout) and return them."""
    inputs, working = root / layout.INPUT_DIR, root / layout.WORKING_DIR
    inputs.mkdir(parents=True, exist_ok=True)
    working.mkdir(parents=True, exist_ok=True)
    return inputs, working


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


# The kernel's command: what `python -m ipykernel_launcher` runs (ipykernel_launcher.py, then
# IPKernelApp.launch_instance), except that ipykernel's visual debugger is not loaded. The kernel imports
# debugpy when it starts, for a front end's breakpoints, which a notebook run to its end never uses: about
# a fifth of the kernel's start-up CPU, paid by each of the smoke's and each local Kaggle session's
# notebooks. debugpy is importable again once the kernel is set up, so a notebook's own code imports it as
# on Kaggle, and sys.argv and sys.path are the launcher's (tests/local/test_executor.py).
KERNEL_MAIN = """\
import sys  # ipykernel_launcher, without ipykernel's debugger (kchain/local/executor.py)
if sys.path[0] == "":
    del sys.path[0]
import ipykernel_launcher  # its code runs only as __main__: here, its path for sys.argv[0], as there
sys.argv[0] = ipykernel_launcher.__file__
sys.modules["debugpy"] = None
from ipykernel.kernelapp import IPKernelApp
app = IPKernelApp.instance()
app.initialize()
del sys.modules["debugpy"]
app.start()
"""


def _kernel_manager_class():  # noqa: ANN202  (jupyter_client is imported only when a notebook runs)
    """A kernel manager whose kernel is always this interpreter's ipykernel.

    jupyter_client would look `python3` up in the Jupyter data dirs: outside a venv a `python3` kernelspec
    that another environment installed in the user's dir comes first, and the notebook would run under that
    environment's Python, without this one's packages; the lookup also imports IPython and ipykernel into
    the executor. The command is ipykernel's own launcher, less its debugger (KERNEL_MAIN)."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-c", KERNEL_MAIN, "-f", "{connection_file}"],
                              display_name="Python 3 (ipykernel)", language="python", resource_dir="")

    class ThisPythonKernel(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _this_python(self) -> ThisPython:
            return ThisPython(parent=self)

    return ThisPythonKernel


def _live_client_class():  # noqa: ANN202  (nbclient is imported only when a notebook runs)
    from nbclient import NotebookClient

    class LiveClient(NotebookClient):
        """nbclient collects outputs per cell; this one hands each message on as it arrives, so a
        heartbeat printed at minute six is shown at minute six."""

        t0: float = 0.0
        messages: list[dict[str, Any]]  # not `log`: that is nbclient's logger
        on_output: OutputFn | None = None
        on_kernel: KernelFn | None = None
        kernel_ready: float = 0.0

        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            if msg.get("msg_type") == "stream":
                name, text = content.get("name", "stdout"), content.get("text", "")
            elif msg.get("msg_type") == "error":
                name, text = "stderr", "\n".join(content.get("traceback", [])) + "\n"
            else:
                name, text = "", ""
            if text:
                self.messages.append({"stream_name": name, "time": round(time.time() - self.t0, 3), "data": text})
                if self.on_output is not None:
                    self.on_output(name, text)
            return super().output(outs, msg, display_id, cell_index)

        async def async_start_new_kernel(self, **kwargs):
            await super().async_start_new_kernel(**kwargs)
            process = getattr(getattr(self.km, "provisioner", None), "process", None)
            if self.on_kernel is not None and process is not None:
                self.on_kernel(process.pid)

        async def async_start_new_kernel_client(self):
            result = await super().async_start_new_kernel_client()
            self.kernel_ready = time.time() - self.t0
            return result

    return LiveClient


def _kernel_channels(sockets: Path) -> dict[str, Any]:
    """The kernel's channels as unix sockets in a folder of their own, where the path is short enough.

    Over TCP each executor picks 5 free ports and the kernel binds them a moment later; executors
    starting together (the smoke starts three) can pick the same port, and the kernel that loses
    dies with 'Address already in use' while its executor waits 60 s for it. A socket file in a
    fresh folder cannot be taken by another kernel.
    """
    prefix = sockets / "k"  # the kernel's channels are k-1 .. k-5
    if len(str(prefix)) + 3 > SOCKET_PATH_MAX:
        return {}
    return {"KernelManager": {"transport": "ipc", "ip": str(prefix)}}


def _execute(client: Any, env: dict[str, str], working: Path, stderr_path: Path) -> str | None:
    """Run every cell; the error as `Class: first line`, or None."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    # The kernel process's own stderr holds only its start-up chatter (the cells' output comes over
    # the messaging channel); keep it beside the sandbox, out of the session's output folder.
    with open(stderr_path, "ab") as kernel_stderr:
        try:
            client.execute(env=env, cwd=str(working), stderr=kernel_stderr)
        except CellExecutionError as exc:
            ename = getattr(exc, "ename", "") or "CellExecutionError"
            return f"{ename}: {_first_line(getattr(exc, 'evalue', '') or str(exc))}"
        except CellTimeoutError as exc:
            return f"Timeout: {_first_line(str(exc))}"
        except DeadKernelError as exc:
            return f"DeadKernelError: {_first_line(str(exc))}"
    return None


def _read_notebook(path: Path) -> Any:
    """The notebook as nbformat's node, each cell given the id nbformat 4.5 asks for where it has none.

    A notebook written by hand or by an older tool (Kaggle runs those) lacks them; nbformat adds them itself
    but warns first, and a warning is an error in a process that turns warnings into errors (the one that
    drives this notebook from a thread, under pytest's `error`). Changing the warning filters instead would
    change them for every thread of that process."""
    import nbformat

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if (data.get("nbformat", 0), data.get("nbformat_minor", 0)) >= (4, 5):
        taken = {cell["id"] for cell in data.get("cells", []) if "id" in cell}
        for n, cell in enumerate(data.get("cells", [])):
            if "id" not in cell:
                cell["id"] = next(name for k in itertools.count() if (name := f"cell-{n}-{k}") not in taken)
                taken.add(cell["id"])
    return nbformat.reads(json.dumps(data), as_version=4)


def execute_notebook(
    notebook_path: Path,
    root: Path,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    on_output: OutputFn | None = None,
    on_kernel: KernelFn | None = None,
) -> ExecResult:
    """Execute the notebook with a fresh ipykernel whose working dir is ROOT/working, in `env` (this
    process's environment if None); `on_kernel` is told the kernel's pid, so a caller running this on a
    thread can kill the notebook's process tree."""
    from traitlets.config import Config

    root = Path(root).resolve()
    _, working = _prepare_root(root)
    # `env`, when given, is the kernel's whole environment: a variable the caller left out of it (the smoke drops
    # a session clock or a fault the shell set) must not come back from this process's own.
    kernel_env = {**(os.environ if env is None else env), layout.ROOT_ENV: str(root)}
    # A Kaggle session never has the laptop's PYTHONHASHSEED: each of its processes draws its own. Kept, it would
    # give the smoke's three runs one hash seed, and a run that takes an order from a set of strings (a
    # vocabulary) would pass here and differ after every resume there.
    kernel_env.pop(HASH_SEED_ENV, None)
    kernel_env.setdefault("PYTHONUNBUFFERED", "1")
    sockets = Path(tempfile.mkdtemp(prefix="kchain-k-"))
    client = _live_client_class()(
        _read_notebook(notebook_path),
        timeout=timeout,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        resources={"metadata": {"path": str(working)}},
        allow_errors=False,
        record_timing=False,
        shutdown_kernel="immediate",
        config=Config(_kernel_channels(sockets)),
    )
    client.t0, client.messages, client.on_output, client.on_kernel = time.time(), [], on_output, on_kernel
    try:
        with _closing_new_thread_loop():
            error = _execute(client, kernel_env, working, root / "kernel-stderr.log")
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        # nbclient leaves its exit-time kernel cleanup registered when the kernel dies while its client
        # starts (a session killed at its first moment); at this process's exit it would fail on the
        # manager it already let go, a traceback in the middle of a long-lived process's exit.
        atexit.unregister(client._cleanup_kernel)
    return ExecResult(
        ok=error is None,
        error=error,
        log=client.messages,
        wall_s=time.time() - client.t0,
        kernel_start_s=client.kernel_ready,
        summary=read_working(working),
    )


@contextlib.contextmanager
def _closing_new_thread_loop() -> Iterator[None]:
    """On a thread other than the main one, close the event loop the run made for it, and only that one.

    nbclient's calls go through jupyter_core's run_sync, which makes this thread an event loop and leaves
    it open. Collected later, an open loop is a ResourceWarning raised inside whatever code the garbage
    collector interrupts (under pytest's warnings-as-errors, a parse: python/cpython#106905). A loop the
    thread had before is left as it was; the main thread's loop is the process's and is left alone.
    """
    if threading.current_thread() is threading.main_thread():
        yield
        return
    before = _thread_loop()
    try:
        yield
    finally:
        made = _thread_loop()
        if made is not None and made is not before:
            asyncio.set_event_loop(before)
            made.close()


def _thread_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop set for this (non-main) thread, or None; never makes one."""
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:  # none set: off the main thread, the policy makes none
        return None


class SessionLog:
    """A notebook's output as a session keeps it, written as it arrives: each stream to its file, and each
    message as a line of JSON (`{"stream_name", "time", "data"}`, Kaggle's log entry) when `jsonl` is given."""

    def __init__(self, out: IO[str], err: IO[str], jsonl: IO[str] | None = None) -> None:
        self.out, self.err, self.jsonl, self.t0 = out, err, jsonl, time.time()

    def __call__(self, name: str, text: str) -> None:
        stream = self.err if name == "stderr" else self.out
        stream.write(text)
        stream.flush()
        if self.jsonl is not None:
            entry = {"stream_name": name, "time": round(time.time() - self.t0, 3), "data": text}
            self.jsonl.write(json.dumps(entry) + "\n")
            self.jsonl.flush()

    def ended(self, error: str | None) -> None:
        """The notebook's error (`Class: first line`), if any, as its stderr's last line, where a session's
        failure is read."""
        if error is not None:
            self.err.write(f"{error}\n")
            self.err.flush()


class NotebookThread:
    """`execute_notebook` on a thread of this process, watched and ended as a process would be.

    `pid` is the kernel's once it has started (it leads a process group: the notebook's whole tree);
    `poll()` and `wait()` give `returncode`, 0 when every cell ran and 1 otherwise (`error` says why);
    `kill()` SIGKILLs the tree now, or as soon as the kernel starts if it has not yet. A killed kernel
    ends the thread within about a second (nbclient looks at the kernel once a second). `on_end(error)` runs
    on the thread after the last output and before `returncode` is set.
    """

    def __init__(self, notebook: Path, root: Path, env: Mapping[str, str], on_output: OutputFn | None = None,
                 on_end: Callable[[str | None], None] | None = None, name: str = "notebook") -> None:
        self.pid: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._killing = False
        self._thread = threading.Thread(target=self._body, args=(notebook, root, dict(env), on_output, on_end),
                                        name=name, daemon=True)

    def start(self) -> NotebookThread:
        self._thread.start()
        return self

    def _body(self, notebook: Path, root: Path, env: dict[str, str], on_output: OutputFn | None,
              on_end: Callable[[str | None], None] | None) -> None:
        try:
            error = execute_notebook(notebook, root, env=env, on_output=on_output, on_kernel=self._started).error
        except Exception as e:  # noqa: BLE001  (the kernel could not start: the notebook's failure, said as its error)
            error = f"{type(e).__name__}: {e}"
        self.error = error
        try:
            if on_end is not None:
                on_end(error)
        finally:
            self.returncode = 0 if error is None else 1

    def _started(self, pid: int) -> None:
        with self._lock:
            self.pid, killing = pid, self._killing
        if killing:
            kill_tree(pid)

    def kill(self) -> None:
        with self._lock:
            self._killing, pid = True, self.pid
        if pid is not None:
            kill_tree(pid)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def wait(self) -> int:
        self._thread.join()
        assert self.returncode is not None
        return self.returncode


def start_session(notebook: Path, root: Path, env: Mapping[str, str], log_jsonl: Path, stdout: Path,
                  stderr: Path) -> NotebookThread:
    """A local Kaggle session's notebook on a thread (what `Emulator(start_notebook=...)` takes): its streams
    to `stdout` and `stderr`, its log entries to `log_jsonl`, its error as stderr's last line."""
    files = [open(path, "w", encoding="utf-8") for path in (stdout, stderr, log_jsonl)]  # noqa: SIM115
    log = SessionLog(*files)

    def end(error: str | None) -> None:
        log.ended(error)
        for f in files:
            f.close()

    return NotebookThread(notebook, root, env, on_output=log, on_end=end, name=f"session-{root.parent.name}").start()


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kchain.local.executor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute a notebook in a /kaggle-like sandbox")
    run.add_argument("notebook", type=Path)
    run.add_argument("--root", type=Path, required=True)
    run.add_argument("--timeout", type=float, default=None)
    run.add_argument("--log-jsonl", type=Path, default=None)
    args = parser.parse_args(argv)

    log_file = open(args.log_jsonl, "a", encoding="utf-8") if args.log_jsonl else None  # noqa: SIM115
    log = SessionLog(sys.stdout, sys.stderr, log_file)
    try:
        result = execute_notebook(args.notebook, args.root, timeout=args.timeout, on_output=log)
    finally:
        if log_file is not None:
            log_file.close()
    log.ended(result.error)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(_cli())
