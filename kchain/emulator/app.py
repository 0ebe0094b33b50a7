"""The Emulator object: a local Kaggle that the unmodified `kaggle` client talks to over HTTP.

    with Emulator(tmp_path / "kaggle", users={"alice": key}) as emu:
        monkeypatch.setenv(...emu.env("alice"))
        KaggleApi().kernels_push(folder)

It wires the persistent store, the session runner and the HTTP server together, exposes the fault
switches (`emu.faults`) and a few read-only views for tests (`sessions()`, `dataset_versions()`,
`calls`). `serve()` is the blocking form behind `kchain emulator serve`.
"""

from __future__ import annotations

import errno
import json
import secrets as _secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kchain.common.sessionstate import LIVE, TERMINAL
from kchain.emulator.faults import Faults
from kchain.emulator.rpcs import Rpcs
from kchain.emulator.server import EmulatorHTTPServer, free_closed_port
from kchain.emulator.sessions import SessionRunner, StartNotebook, log_entries, start_process
from kchain.emulator.state import Store, model_key
from kchain.emulator.switches import Limits, Switches
from kchain.errors import KchainError

# How long wait_session and wait_output wait by default: a net for a session that hangs, far above what the
# slowest machine needs, never a time a test counts on (a test that needs a limit reached calls expire()).
PATIENCE_S = 900.0


def _shared(holder: str, name: str) -> property:
    """An Emulator attribute that lives on one of its parts, so a test's change reaches the server."""
    def get(self: Emulator) -> Any:
        return getattr(getattr(self, holder), name)

    def set_(self: Emulator, value: Any) -> None:
        setattr(getattr(self, holder), name, value)

    return property(get, set_)


class Emulator:
    session_limit_s = _shared("limits", "session_limit_s")
    gpu_quota_s = _shared("limits", "gpu_quota_s")
    max_gpu_sessions = _shared("limits", "max_gpu_sessions")
    max_cpu_sessions = _shared("limits", "max_cpu_sessions")
    quota_week_offset_s = _shared("limits", "quota_week_offset_s")
    faults = _shared("rpcs", "faults")
    switches = _shared("rpcs", "switches")

    def __init__(self, state_dir: str | Path, users: dict[str, str] | None = None,
                 tokens: dict[str, str] | None = None, session_limit_s: float = 12 * 3600,
                 gpu_quota_s: float = 30 * 3600, max_gpu_sessions: int = 2,
                 secrets: dict[str, dict[str, str]] | None = None, port: int = 0,
                 faults: Faults | None = None, switches: Switches | None = None,
                 competitions: dict[str, list[str]] | None = None,
                 start_notebook: StartNotebook = start_process,
                 max_cpu_sessions: int = 2, attached: list[str] | None = None,
                 quota_week_offset_s: float = 0.0, catalogue: str | Path | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.users = dict(users or {})
        self.tokens = dict(tokens or {})  # token -> user name
        self.limits = Limits(session_limit_s, gpu_quota_s, max_gpu_sessions, quota_week_offset_s, max_cpu_sessions)
        self.secrets = dict(secrets or {})
        self.competitions = {slug: list(users) for slug, users in (competitions or {}).items()}  # rules accepted by
        self.port = port
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        self.store = Store(self.state_dir)
        self.runner = SessionRunner(self.store, lambda: self.url,
                                    f"http://127.0.0.1:{free_closed_port()}", start_notebook)
        self.rpcs = Rpcs(self.store, self.runner, faults or Faults(), switches or Switches(), self.limits,
                         lambda: self.url, self.secrets, self.competitions)
        self._server: EmulatorHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for ref in attached or ():
            self.attach_secrets(ref)
        if catalogue is not None:
            self.add_catalogue(catalogue)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> str:
        """Serve in a background thread; return the base URL (http://127.0.0.1:PORT)."""
        lost = self.store.recover_after_restart()
        self.runner.reap_orphans(lost)
        self._server = EmulatorHTTPServer(("127.0.0.1", self.port), self.rpcs, self.users, self.tokens, self.count)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kaggle-emulator", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and kill live sessions; they read as lost when this state is served again."""
        self.runner.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Emulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, user: str | None = None) -> dict[str, str]:
        """Environment a client process needs to reach this emulator (with user's key if given)."""
        env = {"KAGGLE_API_ENVIRONMENT": "LOCALHOST", "HTTP_PROXY": self.url, "http_proxy": self.url,
               "NO_PROXY": "", "no_proxy": ""}
        if user is not None:
            env.update({"KAGGLE_USERNAME": user, "KAGGLE_KEY": self.users[user]})
        return env

    # -- views for tests ----------------------------------------------------------------------

    def count(self, rpc: str) -> None:
        with self._calls_lock:
            self.calls[rpc] += 1

    def sessions(self) -> list[dict[str, Any]]:
        """Every session: id, kernel ref, version, pushed_from (kernel | laptop), status, failure_message,
        gpu/tpu, queued/started/first_cell/ended times, requested_sources / dataset_sources (valid) /
        invalid_sources, model_sources (valid) / invalid_model_sources, mounted (owner/slug/N and model refs actually attached), resumed_from and
        summary (status, step, total, resumed_from, and the training's started and ended times, if the
        session's output or log shows them)."""
        with self.store.lock:
            return [dict(s) for s in sorted(self.store.sessions.values(), key=lambda s: int(s["id"]))]

    def session(self, ref: str, version: int | None = None) -> dict[str, Any]:
        """The session of kernel ref (owner/slug) at version (default: latest)."""
        with self.store.lock:
            versions = self.store.kernels[ref]["versions"]
            chosen = versions[-1] if version is None else next(v for v in versions if v["number"] == version)
            return dict(self.store.session(chosen["session"]))

    def wait_session(self, ref: str, version: int | None = None, timeout: float = PATIENCE_S) -> dict[str, Any]:
        """Block until the session reaches a terminal status; return it."""
        deadline = time.time() + timeout
        while True:
            session = self.session(ref, version)
            if session["status"] in TERMINAL:
                return session
            if time.time() > deadline:
                raise TimeoutError(f"session of {ref} still {session['status']} after {timeout} s")
            time.sleep(0.05)

    def attach_secrets(self, ref: str) -> None:
        """Stands for "the user attached their Secrets to kernel ref in the web UI" (no API can), and attaches
        them again after each push of their own (switches.secrets_reset_on_push; a push from a kernel: nobody)."""
        with self.store.lock:
            if ref not in self.store.secrets_attached:
                self.store.secrets_attached.append(ref)
            if ref in self.store.secrets_reset:
                self.store.secrets_reset.remove(ref)
            self.store.save()

    def cancel(self, ref: str, version: int | None = None) -> None:
        """Stands for "the user stopped the session in the web UI"."""
        self.runner.cancel(self.session(ref, version)["id"], by="web UI")

    def expire(self, ref: str, version: int | None = None) -> None:
        """The session reaches its time limit now: killed, ERROR, output as `switches.output_at_limit` says."""
        self.runner.expire(self.session(ref, version)["id"])

    def mount_now(self, ref: str, version: int | None = None) -> None:
        """The session's lagging mounts (switches.mount_lag_s) arrive now: a clock control, so a test can
        mount a state only after the session said it waits for it, on a machine of any speed."""
        self.runner.mount_now(self.session(ref, version)["id"])

    def settle(self, ref: str) -> None:
        """Every version of dataset ref (or of model variation owner/model/framework/variation) is visible
        and ready now (a clock control: a test need not wait out a lag or a processing time it made long so
        that nothing races the machine)."""
        now = time.time()
        with self.store.lock:
            if ref.count("/") == 3:
                pending = self.store.models[model_key(*ref.split("/"))].get("pending", {})
                pending.update({n: min(at, now) for n, at in pending.items()})
                self.store.save()
                return
            for version in self.store.datasets[ref]["versions"]:
                version["visible_at"] = min(version.get("visible_at", version["created"]), now)
                version["ready_at"] = min(version["ready_at"], now)
            self.store.save()

    def add_model(self, ref: str, files: dict[str, bytes | str] | Path, private: bool = False) -> None:
        """Model version ref (owner/model/framework/variation/N) with these files (name -> content, or a
        folder to copy) exists now: stands for a model someone published on Kaggle (a public one by
        default; private: only its owner sees it). Its card and variation are made when missing."""
        with self.store.lock:
            self.rpcs.seed_model_version(ref, files, private=private)
            self.store.save()

    def add_catalogue(self, folder: str | Path) -> dict[str, int]:
        """Seed the public objects of a catalogue folder (docs/emulator.md, "A public catalogue"): other users'
        kernels with their output, datasets with their versions, models with their variations, each in the
        files Kaggle's own client writes for it. Each is seeded once (its ref is remembered), so a restart adds
        none twice and one a test deleted stays deleted. Returns how many of each kind it added."""
        return seed_catalogue(self.rpcs, Path(folder))

    def settled(self) -> bool:
        """Nothing is in flight: no session queued or running, every dataset version visible and ready, no
        model version processing."""
        now = time.time()
        with self.store.lock:
            return not (any(s["status"] in LIVE for s in self.store.sessions.values())
                        or any(not (self.store.version_visible(v, now) and self.store.version_ready(v, now))
                               for d in self.store.datasets.values() for v in d["versions"])
                        or any(at > now for m in self.store.models.values() for at in m.get("pending", {}).values()))

    def wait_settled(self, timeout: float) -> bool:
        """Block until settled() or for timeout seconds; whether it settled. What a fixed wait of a client's
        ("sleep 10 s: the new dataset stabilises") waits for, ended as soon as it happened."""
        deadline = time.time() + timeout
        while not self.settled():
            if time.time() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def model_versions(self, instance: str) -> list[int]:
        """Every version of a model variation (owner/model/framework/variation), processing ones too:
        count what a release created."""
        with self.store.lock:
            entry = self.store.models.get(model_key(*instance.split("/")))
            if entry is None:
                return []
            return sorted({*entry["versions"], *(int(n) for n in entry.get("pending", {}))})

    def cancellations(self) -> list[dict[str, Any]]:
        """Every cancelled session: session id, kernel, version, by ("api" / "web UI"), status_before, at."""
        with self.store.lock:
            return [dict(c) for c in self.store.cancellations]

    def live_sessions(self) -> list[dict[str, Any]]:
        return [s for s in self.sessions() if s["status"] in LIVE]

    def dataset_versions(self, ref: str) -> list[dict[str, Any]]:
        """Versions of dataset ref: number, created, visible and ready (bools), notes, files [{name, size}]."""
        with self.store.lock:
            return [dict(v, visible=self.store.version_visible(v), ready=self.store.version_ready(v))
                    for v in self.store.datasets[ref]["versions"]]

    def live_log(self, ref: str, version: int | None = None) -> str:
        """What the session has printed so far, while it runs (Kaggle's log is written when it ends)."""
        path = self.store.session_dir(self.session(ref, version)["id"]) / "log.jsonl"
        return "".join(entry["data"] for entry in log_entries(path))

    def wait_output(self, ref: str, text: str, version: int | None = None, timeout: float = PATIENCE_S) -> str:
        """Block until the session has printed text; its log so far. An event, not a time: a test acts at the
        point the session reached, on a machine of any speed. Raises if it ends or times out first."""
        deadline = time.time() + timeout
        while text not in (log := self.live_log(ref, version)):
            status = self.session(ref, version)["status"]
            if status in TERMINAL or time.time() > deadline:
                raise TimeoutError(f"session of {ref} is {status} and never printed {text!r}:\n{log[-2000:]}")
            time.sleep(0.05)
        return log

    def session_output_dir(self, session_id: str) -> Path:
        return self.store.session_dir(session_id) / "output"


# A catalogue object's time when its files do not say (`"created": "2020-01-01"`): long before any test.
CATALOGUE_EPOCH = "2020-01-01T00:00:00Z"
CATALOGUE_DIR = "catalogue"  # `kchain emulator serve --state S` seeds S/catalogue/ when it is there


def seed_catalogue(rpcs: Rpcs, folder: Path) -> dict[str, int]:
    """The objects of a catalogue folder into the store (Emulator.add_catalogue), each once:

        kernels/<owner>/<slug>/kernel-metadata.json     `kaggle kernels pull -m`, plus "totalVotes", "created"
        kernels/<owner>/<slug>/<its code_file>, output/   `kaggle kernels output` (output/<slug>.log: the log)
        datasets/<owner>/<slug>/dataset-metadata.json   `kaggle datasets metadata`, plus "bigQuery", "created"
        datasets/<owner>/<slug>/<N>/                    version N's files (1, 2, ...; none: one empty version)
        models/<owner>/<slug>/model-metadata.json       `kaggle models get -p`, plus "voteCount", "created"
        models/<owner>/<slug>/<framework>/<variation>/model-instance-metadata.json, <N>/   a variation, its versions
    """
    if not folder.is_dir():
        raise KchainError(f"{folder}: no such catalogue folder; give a folder laid out as docs/emulator.md says")
    added = {"kernels": 0, "datasets": 0, "models": 0}
    store = rpcs.store
    with store.lock:
        seeded = store.data.setdefault("catalogue_seeded", [])
        for kind, pattern in (("kernels", "kernel-metadata.json"), ("datasets", "dataset-metadata.json"),
                              ("models", "model-metadata.json")):
            for meta_path in sorted(folder.glob(f"{kind}/*/*/{pattern}")):
                ref = f"{meta_path.parent.parent.name}/{meta_path.parent.name}"
                if f"{kind}:{ref}" in seeded:
                    continue
                _SEEDERS[kind](rpcs, ref, meta_path.parent, _read_meta(meta_path))
                seeded.append(f"{kind}:{ref}")
                added[kind] += 1
        ids = [k["id"] for k in store.kernels.values()] + [d["id"] for d in store.datasets.values()] + \
            [c["id"] for c in store.data.get("model_cards", {}).values()] + [m.get("id", 0) for m in store.models.values()]
        store.data["next_id"] = max([store.data["next_id"], *(i + 1 for i in ids)])
        store.save()
    return added


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KchainError(f"{path}: not a JSON metadata file ({exc}); write it as Kaggle's client does") from None
    if not isinstance(meta, dict):
        raise KchainError(f"{path}: a metadata file holds one JSON object")
    return meta


def _created(meta: dict[str, Any], path: Path) -> float:
    text = str(meta.get("created") or CATALOGUE_EPOCH).replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(text if "T" in text or "+" in text else f"{text}T00:00:00+00:00")
    except ValueError:
        raise KchainError(f"{path}: created {meta.get('created')!r} is not an ISO date; write e.g. 2020-01-31") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def _numbered(folder: Path) -> list[Path]:
    """The version folders 1, 2, ... of a dataset or variation folder, in order (a gap is an error)."""
    found = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if [int(p.name) for p in found] != list(range(1, len(found) + 1)):
        raise KchainError(f"{folder}: version folders must be 1, 2, ... without a gap, not "
                          f"{', '.join(p.name for p in found)}")
    return found


def _seed_kernel(rpcs: Rpcs, ref: str, folder: Path, meta: dict[str, Any]) -> None:
    code = folder / str(meta.get("code_file") or "")
    if not meta.get("code_file") or not code.is_file():
        raise KchainError(f"{folder / 'kernel-metadata.json'}: code_file {meta.get('code_file')!r} is not a file "
                          "beside it; put the kernel's code there (kaggle kernels pull -m writes both)")
    output, log = folder / "output", folder / "output" / f"{ref.split('/')[1]}.log"
    log_text = log.read_text(encoding="utf-8") if log.is_file() else None
    kept = None
    if output.is_dir():
        kept = Path(tempfile.mkdtemp(prefix="catalogue-", dir=rpcs.store.root))
        shutil.copytree(output, kept, dirs_exist_ok=True)
        (kept / log.name).unlink(missing_ok=True)
    try:
        rpcs.seed_kernel(ref, meta, code.read_text(encoding="utf-8"), kept, log_text, _created(meta, code))
    finally:
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)


def _seed_dataset(rpcs: Rpcs, ref: str, folder: Path, meta: dict[str, Any]) -> None:
    versions: list[Path | None] = list(_numbered(folder))
    rpcs.seed_dataset(ref, meta.get("info") or meta, versions or [None], _created(meta, folder / "dataset-metadata.json"))


def _seed_model(rpcs: Rpcs, ref: str, folder: Path, meta: dict[str, Any]) -> None:
    """The card, then each variation's versions; every file read and checked before the store changes."""
    created = _created(meta, folder / "model-metadata.json")
    variations = []
    for instance_meta in sorted(folder.glob("*/*/model-instance-metadata.json")):
        versions = _numbered(instance_meta.parent)
        if not versions:
            raise KchainError(f"{instance_meta.parent}: a variation needs its version folders 1, 2, ...")
        variations.append((instance_meta.parent, _read_meta(instance_meta), versions))
    owner, slug = ref.split("/")
    rpcs.seed_model(owner, slug, meta, created)
    for variation, instance, versions in variations:
        for version in versions:
            rpcs.seed_model_version(f"{ref}/{variation.parent.name}/{variation.name}/{version.name}", version,
                                    instance, created)


_SEEDERS = {"kernels": _seed_kernel, "datasets": _seed_dataset, "models": _seed_model}


def emulator_options(lenient: bool = False, **given: Any) -> dict[str, Any]:
    """Emulator(...) keyword arguments from values named after fields of Limits, Switches and Faults
    (what `kchain emulator serve` was given); the others keep their defaults, the kind ones with lenient."""
    def take(cls: type) -> dict[str, Any]:
        return {f.name: given.pop(f.name) for f in fields(cls) if f.init and f.name in given}

    limits, switches, faults = take(Limits), take(Switches), take(Faults)
    if given:
        raise TypeError(f"not a field of Limits, Switches or Faults: {', '.join(sorted(given))}")
    return {**limits, "faults": Faults(**faults),
            "switches": Switches.lenient(**switches) if lenient else Switches(**switches)}


def serve(state_dir: str | Path, port: int = 0, users: dict[str, str] | None = None,
          tokens: dict[str, str] | None = None, faults: Faults | None = None, out=None, **options: Any) -> None:
    """Run an emulator in the foreground until interrupted, printing the env lines to export.

    With no users, one user "kchain" with a fresh random key is made up for this run. A `catalogue/` folder in
    the state folder is seeded (Emulator.add_catalogue), unless `catalogue` names another.
    """
    out = out or sys.stdout
    users = dict(users or {})
    if not users and not tokens:
        users = {"kchain": _secrets.token_hex(16)}
    if options.get("catalogue") is None and (Path(state_dir) / CATALOGUE_DIR).is_dir():
        options["catalogue"] = Path(state_dir) / CATALOGUE_DIR
    emu = Emulator(state_dir, users=users, tokens=tokens, port=port, faults=faults, **options)
    try:
        emu.start()
    except OSError as exc:
        emu.stop()
        what = "is in use (another emulator?)" if exc.errno == errno.EADDRINUSE else f"cannot be served: {exc.strerror}"
        raise KchainError(f"port {port} on 127.0.0.1 {what}; pass another --port, or --port 0 for a free one") from None
    user = next(iter(users), None)
    print(f"# Kaggle emulator on {emu.url}, state in {Path(state_dir).resolve()}", file=out)
    if options.get("catalogue") is not None:
        print(f"# public catalogue seeded from {Path(options['catalogue']).resolve()}", file=out)
    for name, value in emu.env(user).items():
        print(f"export {name}={value}", file=out)
    out.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        emu.stop()
