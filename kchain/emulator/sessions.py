"""Running pushed notebooks as local sessions with Kaggle's limits.

Each session is a real process tree: a Jupyter kernel running the notebook (the same executor as
`kchain smoke`) in its own process group, inside a sandbox laid out like /kaggle. The executor that sends
the cells is `python -m kchain.local.executor run NOTEBOOK --root ROOT --log-jsonl LOG`, a process that dies with
the session, or what the laptop's side passes as `start_notebook` (local.start_session: a thread of this
process; the emulator imports no laptop module). A watcher thread per session enforces the time limit and
injected kills with SIGKILL on the whole tree, then captures ROOT/working as the version's output and the
log in Kaggle's format.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

from kchain.common import layout, resumecheck
from kchain.common.sessionstate import SessionState
from kchain.emulator.state import Store, model_key, new_secret

REPO_ROOT = Path(__file__).resolve().parents[2]

# Kaggle images ship this module; ours talks to the emulator's secrets endpoint the same way.
KAGGLE_SECRETS_PY = '''"""Kaggle user secrets, as the Kaggle images provide them (emulator copy)."""
import json
import os
import re
import urllib.request


class CredentialError(Exception):
    pass


class BackendError(Exception):
    pass


class UserSecretsClient:
    def __init__(self):
        self._token = os.environ.get("KAGGLE_USER_SECRETS_TOKEN")
        if not self._token:
            raise CredentialError("A user secrets token is required (KAGGLE_USER_SECRETS_TOKEN is not set)")
        self._url = os.environ.get("KAGGLE_URL_BASE", "https://www.kaggle.com").rstrip("/")

    def get_secret(self, label):
        body = json.dumps({"Label": label, "JWE": self._token}).encode()
        request = urllib.request.Request(
            self._url + "/requests/GetUserSecretByLabelRequest", data=body,
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.loads(response.read().decode())
        except Exception as e:
            raise BackendError("Unexpected response from the service: %s" % e) from e
        if not answer.get("wasSuccessful"):
            raise BackendError("Unexpected response from the service: %s" % answer)
        return answer["result"]["secret"]
'''

# Kaggle credentials of the emulator's own process must never leak into a session.
_SCRUBBED_ENV = ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR", "KAGGLE_TOKEN",
                 "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
                 "http_proxy", "https_proxy", "all_proxy", "no_proxy")


# How a session killed by the kill_after_checkpoint fault is described (its failure message).
CHECKPOINT_KILL = "Session was killed (fault injection after it saved step"
# A session whose notebook runner crashed (faults.crash_runner_on_output), as `crashed_runner: error` ends it.
RUNNER_CRASHED = "The notebook runner crashed (fault injection)"
# Who ended a session whose kernel was deleted (emu.cancellations()' `by`): its output goes with the kernel.
KERNEL_DELETED = "kernel deleted"


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (a session death is a real process death)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


class Notebook(Protocol):
    """A session's running notebook as the runner watches it (a process, or local.NotebookThread)."""

    @property
    def pid(self) -> int | None: ...  # the leader of the notebook's process group, once it has started

    def poll(self) -> int | None: ...  # the exit code once it has ended, 0 when every cell ran

    def wait(self) -> int: ...

    def kill(self) -> None: ...  # SIGKILL the whole tree (now, or as soon as it starts)


# start_notebook(notebook, root, env, log_jsonl, stdout, stderr): the notebook runs with ROOT/working as its
# working dir, in exactly `env`; its streams go to stdout and stderr (its error as stderr's last line), its
# log entries ({"stream_name", "time", "data"}, one JSON line each) to log_jsonl.
StartNotebook = Callable[[Path, Path, dict[str, str], Path, Path, Path], Notebook]


class _Process:
    """The default executor: `python -m kchain.local.executor run` in a process group of its own; it dies whole."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        return self.proc.wait()

    def kill(self) -> None:
        kill_tree(self.proc.pid)


def start_process(notebook: Path, root: Path, env: dict[str, str], log_jsonl: Path, stdout: Path,
                  stderr: Path) -> Notebook:
    """The emulator's own executor (no laptop module imported): a process per session."""
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        return _Process(subprocess.Popen(
            [sys.executable, "-m", "kchain.local.executor", "run", str(notebook), "--root", str(root),
             "--log-jsonl", str(log_jsonl)],
            cwd=root / layout.WORKING_DIR, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
            start_new_session=True))


def _kill_training(pid: int) -> None:
    """SIGKILL the training process trees (`python -m kchain.runtime.launch`, with their ranks and workers)
    under a session's process `pid`, and nothing else of the session: the OOM killer's kill."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    launched = {}
    for proc in procs:
        try:
            if "kchain.runtime.launch" in proc.cmdline():
                launched[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    for proc in launched.values():
        try:
            if proc.ppid() not in launched:  # the top of its tree: its ranks and workers go with it
                kill_tree(proc.pid)
        except psutil.NoSuchProcess:
            continue


def _make_read_only(top: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(dirpath, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)


def _mount(files: Path, dest: Path) -> None:
    """A dataset version appears in a session's input whole (copied beside it, then renamed), read-only."""
    part = dest.with_name(f".mounting-{dest.name}")
    shutil.copytree(files, part)
    _make_read_only(part)
    part.rename(dest)


def _mount_late(files: Path, dest: Path, root: Path, stopping: threading.Event, now: threading.Event,
                late: float) -> None:
    """The lagging mount arrives after `late` seconds, or once `now` is set (Emulator.mount_now), if the
    session's sandbox is still there."""
    now.wait(late)
    if stopping.is_set() or not (root / layout.INPUT_DIR).is_dir():
        return
    try:
        _mount(files, dest)
    except OSError:  # the session ended (its sandbox went) while this copied
        pass


def remove_tree(top: Path) -> None:
    """rmtree that first makes read-only inputs writable again."""
    if not top.exists():
        return
    for dirpath, _dirnames, _filenames in os.walk(top):
        os.chmod(dirpath, stat.S_IRWXU)
    shutil.rmtree(top, ignore_errors=True)


def log_entries(log_jsonl: Path) -> list[dict[str, Any]]:
    """The executor's JSON lines as Kaggle's log entries {stream_name, time, data}, whole lines only: a
    last line still being written (or torn by a kill) is left out."""
    try:
        lines = log_jsonl.read_text(encoding="utf-8", errors="replace").split("\n")[:-1]
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line torn by the kill
        entries.append({"stream_name": entry.get("stream_name", "stdout"),
                        "time": entry.get("time", 0.0), "data": entry.get("data", "")})
    return entries


def _kaggle_log(log_jsonl: Path) -> str:
    """Kaggle's log once the session ended: one JSON array of its entries."""
    return json.dumps(log_entries(log_jsonl))


def _as_notebook(text: str, kernel_type: str) -> str:
    """A script kernel becomes a one-cell notebook so the one executor can run it."""
    if kernel_type == "notebook":
        return text
    return json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": text}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    })


class SessionRunner:
    """Starts, watches and finishes sessions; owned by the Emulator."""

    def __init__(self, store: Store, proxy_url: Callable[[], str], closed_proxy_url: str,
                 start_notebook: StartNotebook = start_process) -> None:
        self.store = store
        self.proxy_url = proxy_url
        self.closed_proxy_url = closed_proxy_url
        self.start_notebook = start_notebook
        self.secret_tokens: dict[str, tuple[str, str]] = {}  # per-session secrets token -> (user, kernel ref)
        self._threads: dict[str, threading.Thread] = {}
        self._procs: dict[str, Notebook] = {}
        self._cancels: dict[str, str] = {}  # session id -> who cancelled it
        self._expired: set[str] = set()  # sessions whose time limit a test declared reached
        self._mount_now: dict[str, threading.Event] = {}  # per session: its lagging mounts arrive now
        self._stopping = threading.Event()
        # Test switch: extra environment for every session, standing for another kernel image (the doctor's
        # probe reads layout.TEST_IMAGE_TORCH_ENV / TEST_IMAGE_NUMPY_ENV as the image's versions).
        self.image_env: dict[str, str] = {}
        # Test switch: extra environment for the sessions of one kernel (owner/slug), after image_env: a fault
        # one run of a rehearsed queue meets (KCHAIN_FAULT), where the others run clean.
        self.kernel_env: dict[str, dict[str, str]] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def launch(self, session_id: str) -> None:
        thread = threading.Thread(target=self._run, args=(session_id,), name=f"session-{session_id}", daemon=True)
        self._threads[session_id] = thread
        thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def cancel(self, session_id: str, by: str) -> None:
        """Ask a live session to end as CANCEL_ACKNOWLEDGED; its watcher kills it within 50 ms."""
        self._cancels.setdefault(session_id, by)

    def delete(self, session_id: str) -> None:
        """The session's kernel was deleted: end it now (CANCEL_ACKNOWLEDGED), its output gone, whatever
        it was doing; the only end of a session whose runner crashed."""
        self._cancels[session_id] = KERNEL_DELETED

    def expire(self, session_id: str) -> None:
        """Reach the session's time limit now (a clock control: tests need not wait for the limit)."""
        self._expired.add(session_id)

    def mount_now(self, session_id: str) -> None:
        """The session's lagging mounts (mount_lag_s) arrive now (a clock control, as expire)."""
        self._mount_now.setdefault(session_id, threading.Event()).set()

    def stop(self) -> None:
        """Kill every live session without recording an end: after a restart they read as lost."""
        self._stopping.set()
        for now in list(self._mount_now.values()):
            now.set()  # a lagging mount's thread sees the stop and mounts nothing
        procs = list(self._procs.values())
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()  # reap it: a killed child left unwaited is a zombie and a ResourceWarning
        for thread in list(self._threads.values()):
            thread.join(timeout=10)

    def reap_orphans(self, sessions: list[dict[str, Any]]) -> None:
        """Kill processes of sessions lost by a crashed emulator, if they are still alive."""
        for session in sessions:
            pid, created = session.get("pid"), session.get("pid_created")
            if not pid:
                continue
            try:
                if abs(psutil.Process(pid).create_time() - created) < 1:
                    kill_tree(pid)
            except psutil.NoSuchProcess:
                pass

    # -- one session ----------------------------------------------------------------------------

    def _env(self, session: dict[str, Any], kernel: dict[str, Any], sdir: Path, root: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        home = sdir / "home"
        (home / ".kaggle").mkdir(parents=True, exist_ok=True)
        lib = sdir / "lib"
        lib.mkdir(exist_ok=True)
        (lib / "kaggle_secrets.py").write_text(KAGGLE_SECRETS_PY)
        paths = [str(lib), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env.update({
            "HOME": str(home), "KAGGLE_CONFIG_DIR": str(home / ".kaggle"), "PYTHONPATH": os.pathsep.join(paths),
            layout.ROOT_ENV: str(root), "KAGGLE_KERNEL_RUN_TYPE": "Batch", "PYTHONUNBUFFERED": "1",
        })
        if not session.get("no_gpu"):
            # The GPUs the kernel asked for are granted, emulated by CPU ranks (gloo): the runtime's
            # granted-accelerator check would otherwise stop every session on this GPU-less machine.
            env[layout.ACCELERATOR_CHECK_ENV] = "off"
        if kernel.get("enable_internet", True):
            token = new_secret()
            # The session's calls carry its token as proxy credentials (Proxy-Authorization), so the local
            # Kaggle tells a call from inside a kernel (switches.kernel_may_push) from the laptop's.
            proxy = self.proxy_url().replace("://", f"://kernel:{token}@", 1)
            self.secret_tokens[token] = (session["owner"], session["kernel"])
            env.update({"HTTP_PROXY": proxy, "http_proxy": proxy, "NO_PROXY": "", "no_proxy": "",
                        "KAGGLE_API_ENVIRONMENT": "LOCALHOST", "KAGGLE_USER_SECRETS_TOKEN": token,
                        "KAGGLE_URL_BASE": "http://localhost"})
        else:
            dead = self.closed_proxy_url
            env.update({name: dead for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                                                "http_proxy", "https_proxy", "all_proxy")})
            env.pop("KAGGLE_API_ENVIRONMENT", None)
        env.update(self.image_env)
        env.update(self.kernel_env.get(session["kernel"], {}))
        if session.get("kill_after_checkpoint"):
            # The kill follows the session's first checkpoint past its resume: the kernel waits after each
            # save, so the kill lands right after that checkpoint however fast it trains (never a later one).
            env[layout.FAULT_ENV] = ",".join(filter(None, [env.get(layout.FAULT_ENV), "hold_after_save=1"]))
        return env

    def _mount_inputs(self, session: dict[str, Any], root: Path) -> list[str]:
        """Copy each attached dataset version under input/datasets/<owner>/<slug>/, and each model version
        under input/models/<owner>/<model>/<framework>/<variation>/<N>/ (layout.model_mount), read-only."""
        mounted = []
        for source in session["dataset_sources"]:
            parts = source.split("/")
            ref = "/".join(parts[:2])
            dataset = self.store.datasets.get(ref)
            if dataset is None:
                continue
            ready = self.store.ready_versions(dataset)
            if len(parts) == 3 and not session.get("ignore_version_pin"):
                ready = [v for v in ready if v["number"] == int(parts[2])]
            if not ready:
                continue
            version = ready[-1]
            dest = root / layout.INPUT_DIR / "datasets" / ref
            files = self.store.version_files_dir(ref, version["number"])
            late = version["ready_at"] + session.get("mount_lag_s", 0.0) - time.time()
            if late > 0:  # ready, not yet mounted (switches.mount_lag_s)
                now = self._mount_now.setdefault(session["id"], threading.Event())
                threading.Thread(target=_mount_late, args=(files, dest, root, self._stopping, now, late),
                                 name=f"mount-{session['id']}", daemon=True).start()
            else:
                _mount(files, dest)
            mounted.append(f"{ref}/{version['number']}")
        for source in session.get("model_sources", []):
            parts = source.split("/")
            files = self.store.model_files_dir(model_key(*parts[:4]), int(parts[4]))
            dest = root / layout.INPUT_DIR / layout.model_mount(source)
            if not files.is_dir() or dest.exists():  # (the same version named twice is mounted once)
                continue
            shutil.copytree(files, dest)
            _make_read_only(dest)
            mounted.append(source)
        return mounted

    def _update(self, session_id: str, **fields: Any) -> None:
        with self.store.lock:
            self.store.session(session_id).update(fields)
            self.store.save()

    def _run(self, session_id: str) -> None:
        try:
            self._run_session(session_id)
        except Exception as e:  # a bug here must not leave the session RUNNING forever
            if not self._stopping.is_set():
                self._update(session_id, status=SessionState.ERROR, ended=time.time(),
                             failure_message=f"emulator error: {type(e).__name__}: {e}")
        finally:
            self._procs.pop(session_id, None)

    def _wait(self, session_id: str, until: float) -> bool:
        """Sleep until `until`; False as soon as the emulator stops or the session is cancelled."""
        while time.time() < until:
            if self._stopping.is_set() or session_id in self._cancels:
                return False
            time.sleep(0.05)
        return not self._stopping.is_set() and session_id not in self._cancels

    def _run_session(self, session_id: str) -> None:
        session = self.store.session(session_id)
        sdir = self.store.session_dir(session_id)
        root = sdir / "root"
        (root / layout.INPUT_DIR).mkdir(parents=True, exist_ok=True)
        (root / layout.WORKING_DIR).mkdir(parents=True, exist_ok=True)
        if not self._wait(session_id, session["queued"] + session.get("queue_s", 0.0)):
            return self._end_early(session_id, sdir, root)
        # The session's clock starts now: the container boots on the session's time.
        started = time.time()
        self._update(session_id, status=SessionState.RUNNING, started=started, mounted=self._mount_inputs(session, root))
        limit, kill_at = session["limit_s"], session["kill_at"]
        limit_reason = f"Session exceeded its time limit of {limit:g} seconds and was stopped"
        deadline, reason = started + limit, limit_reason
        if kill_at is not None and kill_at < limit:
            deadline, reason = started + kill_at, f"Session was killed (fault injection after {kill_at:.1f} s)"
        if not self._wait(session_id, min(started + session.get("boot_s", 0.0), deadline)):
            return self._end_early(session_id, sdir, root)
        proc = self._launch(session_id, session, sdir, root) if time.time() < deadline else None
        killed_by = reason if proc is None else self._watch(session_id, proc, deadline, reason, limit_reason)
        if proc is not None:
            proc.kill()  # stray grandchildren of a finished notebook die with the session
        if killed_by == RUNNER_CRASHED and session.get("crashed_runner") == "running":
            self._wedged(session_id)
        if self._stopping.is_set():
            return  # stop() killed the tree; the record stays RUNNING and reads as lost on restart
        if session_id in self._cancels:
            return self._end_early(session_id, sdir, root)
        lose = killed_by is not None and (
            session["lose_output"] or (killed_by == limit_reason and session.get("output_at_limit") == "lost"))
        self._capture(sdir, root, lose)
        if killed_by is not None:
            status, message = SessionState.ERROR, killed_by
        elif proc is not None and proc.poll() == 0:
            status, message = SessionState.COMPLETE, ""
        else:
            lines = [ln for ln in (sdir / "stderr.txt").read_text(errors="replace").splitlines() if ln.strip()]
            status, message = SessionState.ERROR, (lines[-1].strip() if lines else f"exit code {proc and proc.poll()}")
        self._update(session_id, status=status, failure_message=message, ended=time.time(),
                     returncode=proc.poll() if proc else None, output_lost=lose, **_resumed(sdir))

    def _launch(self, session_id: str, session: dict[str, Any], sdir: Path, root: Path) -> Notebook:
        """Start the notebook's process tree in its own process group (its first cell runs now)."""
        notebook = sdir / "kernel.ipynb"
        notebook.write_text(_as_notebook((sdir / "source").read_text(encoding="utf-8"), session["kernel_type"]))
        env = self._env(session, self.store.kernels.get(session["kernel"], {}), sdir, root)  # {}: just deleted
        proc = self.start_notebook(notebook, root, env, sdir / "log.jsonl", sdir / "stdout.txt", sdir / "stderr.txt")
        self._procs[session_id] = proc
        self._update(session_id, first_cell=time.time())
        self._record_pid(session_id, proc.pid)
        return proc

    def _record_pid(self, session_id: str, pid: int | None) -> bool:
        """The session's process-group leader in its record (reap_orphans, tests); False until it has one."""
        if pid is None:
            return False
        try:
            created = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            created = None
        self._update(session_id, pid=pid, pid_created=created)
        return True

    def _watch(self, session_id: str, proc: Notebook, deadline: float, reason: str,
               limit_reason: str) -> str | None:
        """Wait for the process; kill its tree at the deadline, on a marker fault, an expiry or a cancel.
        Returns why it was killed, or None if it ended by itself (or the emulator is stopping)."""
        session = self.store.session(session_id)
        marker, crash = session.get("kill_on_output"), session.get("crash_runner_on_output")
        log_jsonl = self.store.session_dir(session_id) / "log.jsonl"
        root = self.store.session_dir(session_id) / "root"
        resumed = _attached_state_step(root / layout.INPUT_DIR) if session.get("kill_after_checkpoint") else None
        recorded = "pid" in self.store.session(session_id)
        while proc.poll() is None:
            recorded = recorded or self._record_pid(session_id, proc.pid)
            if self._stopping.is_set():  # stop() may have looked at the live sessions before this one started
                proc.kill()
                proc.wait()
                return None
            text = log_jsonl.read_text(errors="replace") if (marker or crash) and log_jsonl.exists() else ""
            if marker and marker in text:
                deadline, reason = time.time(), f"Session was killed (fault injection on output {marker!r})"
            if crash and crash in text:
                deadline, reason = time.time(), RUNNER_CRASHED
            if resumed is not None:  # a state mounted late (mount_lag_s) is the one the session resumes from
                resumed = max(resumed, _attached_state_step(root / layout.INPUT_DIR))
            saved = _new_checkpoint(root, resumed) if resumed is not None else None
            if saved is not None and session.get("kill_training_only") and proc.pid is not None:
                _kill_training(proc.pid)  # the notebook lives on: it reports the death, publishes, pushes
                self._update(session_id, training_killed=saved, training_killed_at=time.time())
                resumed = None
            elif saved is not None:
                deadline, reason = time.time(), f"{CHECKPOINT_KILL} {saved})"
            if session_id in self._expired:
                deadline, reason = time.time(), limit_reason
            if time.time() >= deadline or session_id in self._cancels:
                proc.kill()
                proc.wait()
                return reason
            time.sleep(0.05)
        return None

    def _wedged(self, session_id: str) -> None:
        """The runner crashed and Kaggle never heard: the session stays RUNNING, its time limit and a
        cancel ignored, until its kernel is deleted (or the emulator stops)."""
        self._update(session_id, runner_crashed=time.time())
        while not self._stopping.is_set() and self._cancels.get(session_id) != KERNEL_DELETED:
            if session_id in self._expired and "limit_ignored" not in self.store.session(session_id):
                self._update(session_id, limit_ignored=time.time())  # its time limit came: still RUNNING
            time.sleep(0.05)

    def _capture(self, sdir: Path, root: Path, lose: bool) -> None:
        """Keep ROOT/working as the version's output (or nothing), and the log in Kaggle's format."""
        output = sdir / "output"
        if lose:
            output.mkdir(exist_ok=True)
        else:
            os.replace(root / layout.WORKING_DIR, output)
        (sdir / "log.json").write_text(_kaggle_log(sdir / "log.jsonl"), encoding="utf-8")
        remove_tree(root)

    def _end_early(self, session_id: str, sdir: Path, root: Path) -> None:
        """A session cancelled while queued, booting or running (or the emulator stopping)."""
        if self._stopping.is_set() and session_id not in self._cancels:
            return
        session = self.store.session(session_id)
        deleted = self._cancels[session_id] == KERNEL_DELETED
        lose = deleted or session.get("output_at_limit") == "lost" or session["lose_output"]
        self._capture(sdir, root, lose)
        now = time.time()
        with self.store.lock:
            was = session["status"]
            session.update(status=SessionState.CANCEL_ACKNOWLEDGED, failure_message="", ended=now, output_lost=lose,
                           **_resumed(sdir))
            self.store.cancellations.append({"session": session_id, "kernel": session["kernel"],
                                             "version": session["version"], "by": self._cancels[session_id],
                                             "status_before": was, "at": now})
            self.store.save()


def _attached_state_step(input_root: Path) -> int:
    """The step of the kchain state attached to a session (0 when none): its marker's step, read as the
    session's launcher reads it (resumecheck.attached_step)."""
    return resumecheck.attached_step(input_root) or 0


def _new_checkpoint(root: Path, resumed: int) -> int | None:
    """The step of a complete checkpoint the session saved past `resumed` (its name says the step;
    its manifest is written last), or None."""
    folder = root / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    try:
        names = [p.name for p in folder.iterdir() if (p / layout.MANIFEST).is_file()]
    except OSError:
        return None
    steps = [int(n.removeprefix(layout.CHECKPOINT_PREFIX)) for n in names
             if n.startswith(layout.CHECKPOINT_PREFIX) and n.removeprefix(layout.CHECKPOINT_PREFIX).isdigit()]
    return max((step for step in steps if step > resumed), default=None)


_RESUMED = re.compile(r"resumed from step (\d+)")


def _resumed(sdir: Path) -> dict[str, Any]:
    """What a session says it resumed from: its summary.json if the output kept one, else its log."""
    fields: dict[str, Any] = {"resumed_from": None, "summary": None}
    found = sorted((sdir / "output").rglob("summary.json")) if (sdir / "output").exists() else []
    for path in found:
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict):
            keys = ("status", "step", "total", "resumed_from", "started", "ended")  # started/ended: its training's
            fields["summary"] = {k: summary.get(k) for k in keys}
            fields["resumed_from"] = summary.get("resumed_from")
            return fields
    log = sdir / "log.jsonl"
    match = _RESUMED.search(log.read_text(errors="replace")) if log.exists() else None
    if match:
        fields["resumed_from"] = int(match[1])
    return fields
