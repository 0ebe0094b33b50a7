"""The only module that imports `kaggle`: credentials, timeouts, retries and loud errors.

The official client sets no timeout on API calls and retries only a few of them, so every call here
goes through `KaggleClient._call`: a requests-level timeout on the client's session, and retries
with exponential backoff and jitter on 429 (honouring Retry-After), 5xx and connection errors.
Calls that create something (SaveKernel, CreateDataset, CreateDatasetVersion) are never retried
once the request may have reached Kaggle: an ambiguous failure raises `OutcomeUnknown`, and the
caller checks the kernel's or dataset's current version before trying again. The client's own
`with_retry`, which would re-send them after a connection reset, is bypassed for them
(`CREATING_SDK_CALLS`); tests/kaggle/test_kaggle_internals.py fails loudly if what this module reaches
into (that method, the SDK's HTTP session, the SDK types it reads) changes shape.

`kaggle` is imported lazily, inside `KaggleClient`, because importing it authenticates and
creates a config directory.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, TypeVar

import requests
from requests.adapters import HTTPAdapter

from kchain.common.sendonce import CREATING_SDK_CALLS, sent_once  # noqa: F401 - CREATING_SDK_CALLS: re-exported
from kchain.common.sessionstate import LIVE, SessionState
from kchain.common.statefolder import DATASET_METADATA
from kchain.errors import CredentialsError, KaggleError, KchainError
from kchain.kaggle import credentials

T = TypeVar("T")

MISSING_CREDENTIALS = ("Kaggle credentials not found: put kaggle.json in ~/.kaggle or set KAGGLE_USERNAME and "
                       "KAGGLE_KEY (or KAGGLE_API_TOKEN)")
REJECTED_CREDENTIALS = ("Kaggle rejected the credentials (HTTP 401): check KAGGLE_USERNAME and KAGGLE_KEY (or "
                        "KAGGLE_API_TOKEN, or kaggle.json), or create a new API token on kaggle.com/settings")
# RPCs that create something: an ambiguous failure after sending them must not be retried blindly.
CREATING_RPCS = ("/SaveKernel", "/CreateDataset", "/CreateDatasetVersion", "/CreateDatasetVersionById",
                 "/CreateModel", "/CreateModelInstance", "/CreateModelInstanceVersion")
# The same calls as the SDK's client methods. kaggle 2.2.5 passes create_dataset and
# create_dataset_version[_by_id] through its own `KaggleApi.with_retry` (up to 10 attempts), which
# re-sends on a connection error even when Kaggle acted before the connection broke: one lost answer,
# two state versions. kchain's client sends these once (a 429 is still retried in place: nothing
# was done) and its `_call` turns the lost answer into OutcomeUnknown. save_kernel is not wrapped in
# 2.2.5; it is listed so that a client which starts wrapping it changes nothing.
# (CREATING_SDK_CALLS lives in kchain/common/sendonce.py, shared with the kernel's publish.)


# Kaggle answers 403 for what does not exist or is not visible to the caller, so the namespace cannot
# be probed (kagglehub treats both as missing); kchain does the same for its own kernel and datasets.
MISSING = (403, 404)


def missing(exc: BaseException) -> bool:
    """True if exc is Kaggle's answer for "not there (or not visible to you)"."""
    return _status_code(exc) in MISSING


class OutcomeUnknown(KaggleError):
    """A creating call was sent but its answer was lost: check the current version before retrying."""


class SessionCapReached(KaggleError):
    """SaveKernel answered "Maximum batch GPU session count of N reached": the account already runs N
    GPU sessions (two on Kaggle, measured). No version was created."""

    def __init__(self, message: str, cap: int | None) -> None:
        super().__init__(message)
        self.cap = cap


# Kaggle's answer in SaveKernel's `error` (Unsloth's Kaggle CI, 2026-08: "Maximum batch GPU session
# count of 2 reached.").
SESSION_CAP = re.compile(r"Maximum batch GPU session count of (\d+) reached")


class InvalidSources(KaggleError):
    """SaveKernel answered with invalid sources: Kaggle still created the version and started its
    session, without them (a client cannot cancel it: the session id is not exposed)."""

    def __init__(self, message: str, version: int | None, url: str, dropped: str) -> None:
        super().__init__(message)
        self.version, self.url, self.dropped = version, url, dropped


class _TimeoutAdapter(HTTPAdapter):
    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.timeout_s
        return super().send(request, **kwargs)


def _http_error(exc: BaseException) -> requests.HTTPError | None:
    """The HTTPError behind exc (the client wraps 401/403 in ValueError for some calls)."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, requests.HTTPError) and exc.response is not None:
            return exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


def _response(exc: BaseException) -> requests.Response | None:
    """Kaggle's answer behind exc (None: no answer came)."""
    http = _http_error(exc)
    return http.response if http is not None else None


def _status_code(exc: BaseException) -> int | None:
    response = _response(exc)
    return response.status_code if response is not None else None


def unreachable(exc: BaseException) -> str | None:
    """Why Kaggle could not be reached at all, in one line, or None: a host name that does not resolve (no
    network, DNS) or a refused connection (nothing listens: the local Kaggle not started). Neither is worth
    retrying: the same call fails the same way a second later."""
    host = where = ""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        text = f"{cur!s} {cur!r}"
        found = re.search(r"host=\\?'([^'\\]+)\\?'(?:, port=(\d+))?", text)
        if found and not host:
            host, port = found.group(1), found.group(2)
            where = f"{host}:{port}" if port else host
        if "NameResolutionError" in text or "Name or service not known" in text or "Failed to resolve" in text:
            return (f"cannot reach Kaggle: the name {host or 'of its API'} does not resolve (no network, or a DNS "
                    "problem); check the connection and try again")
        if isinstance(cur, ConnectionRefusedError) or "Connection refused" in text:
            return (f"cannot reach Kaggle: {where or 'its API'} refused the connection (nothing listens there; for the "
                    "local Kaggle, start `kchain emulator serve` and set what it prints)")
        cur = cur.__cause__ or cur.__context__ or next((a for a in getattr(cur, "args", ()) if isinstance(a, BaseException)), None)
        seen += 1
    return None


def _retry_after_s(response: requests.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Quota:
    """Kaggle's answer to quota_view: a figure it left out is None (the GPU figures may be missing)."""

    used_s: float | None  # GPU time used in the current weekly window
    total_s: float | None  # the GPU time this account is allowed per window (accounts differ)
    refresh: float | None  # epoch seconds at which the window resets


def _utc_epoch(moment: datetime | None) -> float | None:
    """kagglesdk returns times as naive UTC (it strips the `Z`); `.timestamp()` on a naive datetime
    reads it as the laptop's local time, so the zone is put back first."""
    if moment is None:
        return None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)).timestamp()


def _folder_id(folder: Path, metadata: str) -> str:
    """What a push or upload folder is for, as its metadata file names it (`id`), else the folder itself
    (usually a deleted temp dir) for messages."""
    try:
        return str(json.loads((folder / metadata).read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(folder)


PROGRESS_S = 5.0  # how often a long transfer says how far it is


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*") if path.is_dir() else ():
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # a file the client renamed or removed under us
            pass
    return total


@contextlib.contextmanager
def transfer_progress(enabled: bool, verb: str, what: str, folder: Path, total: int | None = None,
                      every_s: float = PROGRESS_S, write: Callable[[str], Any] | None = None) -> Iterator[None]:
    """While the body runs, one line every `every_s` seconds saying how far a transfer is (`verb` `what`:
    the bytes now in `folder`, of `total` when known, or only the time for an upload the client does not
    report on); nothing for a transfer quicker than that. Lines, not a bar: they never break another line."""
    if not enabled:
        yield
        return
    out = write or (lambda line: print(line, file=sys.stderr, flush=True))
    done, t0 = threading.Event(), time.monotonic()

    def watch() -> None:
        while not done.wait(every_s):
            took = time.monotonic() - t0
            if total is not None:
                out(f"  {verb} {what}: {total / 1e6:.1f} MB, {took:.0f} s so far")
            else:
                out(f"  {verb} {what}: {_tree_bytes(folder) / 1e6:.1f} MB so far ({took:.0f} s)")

    thread = threading.Thread(target=watch, name="kchain-transfer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class KaggleClient:
    """The Kaggle API as kchain uses it. Construct it, then call methods; each may raise KaggleError."""

    def __init__(self, timeout_s: float = 60.0, attempts: int = 6, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, sleep: Callable[[float], None] = time.sleep,
                 progress: bool = False) -> None:
        # progress: kchain's own line every PROGRESS_S while an upload or download lasts (the client's bars
        # are always off: they broke kchain's lines).
        self.progress = progress
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep
        self._api: Any = None

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def api(self) -> Any:
        if self._api is None:
            if credentials.find() is None:
                raise CredentialsError(MISSING_CREDENTIALS)
            # Importing kaggle authenticates and prints a help text when that fails; we say it in one line.
            with contextlib.redirect_stdout(io.StringIO()):
                from kaggle.api.kaggle_api_extended import KaggleApi

                api = KaggleApi()
                try:
                    api.authenticate()
                except SystemExit as e:
                    raise CredentialsError(MISSING_CREDENTIALS) from e
                except Exception as e:
                    raise self._translate(e, "authenticate") from e
            build = api.build_kaggle_client
            timeout_s = self.timeout_s

            def build_with_timeout() -> Any:
                client = build()
                client._http_client._init_session()
                session = client._http_client._session
                adapter = _TimeoutAdapter(timeout_s)
                session.mount("http://", adapter)
                session.mount("https://", adapter)
                return client

            api.build_kaggle_client = build_with_timeout
            api.with_retry = sent_once(api.with_retry, self.attempts, self._delay, lambda s: self.sleep(s))
            self._api = api
        return self._api

    def _translate(self, exc: BaseException, what: str) -> KchainError:
        http, code = _http_error(exc), _status_code(exc)
        if code == 401:
            return CredentialsError(REJECTED_CREDENTIALS)
        if http is None and (why := unreachable(exc)):
            return KaggleError(f"Kaggle {what} failed: {why}")
        if http is not None:
            return KaggleError(f"Kaggle {what} failed: HTTP {code}: {http}")
        return KaggleError(f"Kaggle {what} failed: {type(exc).__name__}: {exc}")

    def _delay(self, attempt: int, exc: BaseException) -> float:
        response = _response(exc)
        if response is not None and response.status_code == 429:
            after = _retry_after_s(response)
            if after is not None:
                return min(after, self.max_backoff_s) + random.uniform(0, 0.25)
        base = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
        return base / 2 + random.uniform(0, base / 2)  # "equal jitter": spread retries, keep a floor

    def _call(self, what: str, fn: Callable[[], T], creating: bool = False) -> T:
        for attempt in range(self.attempts):
            try:
                return fn()
            except (requests.RequestException, ValueError) as exc:
                http, code = _http_error(exc), _status_code(exc)
                request = getattr(http or exc, "request", None)
                url = getattr(request, "url", "") or ""
                sent_creating = creating and (not url or url.endswith(CREATING_RPCS))
                safe_connect = isinstance(exc, requests.ConnectTimeout) or (
                    isinstance(exc, requests.ConnectionError) and "NewConnectionError" in repr(exc))
                if code == 429:
                    retry = True
                elif code is not None and code >= 500:
                    retry = not sent_creating
                    if sent_creating:
                        raise OutcomeUnknown(f"Kaggle {what}: HTTP {code} after the request was sent; check the "
                                             "current version before trying again") from exc
                elif http is None and unreachable(exc):
                    raise self._translate(exc, what) from exc  # the same a second later: said at once
                elif http is None and isinstance(exc, requests.RequestException):
                    if sent_creating and not safe_connect:
                        raise OutcomeUnknown(f"Kaggle {what}: {type(exc).__name__} after the request was sent; "
                                             "check the current version before trying again") from exc
                    retry = True
                else:
                    raise self._translate(exc, what) from exc
                if not retry or attempt == self.attempts - 1:
                    raise self._translate(exc, what) from exc
                self.sleep(self._delay(attempt, exc))
        raise AssertionError("unreachable")

    def _uploading(self, folder: str | Path) -> contextlib.AbstractContextManager[None]:
        """kchain's progress lines for an upload of folder's files (the client reports none while quiet)."""
        size = _tree_bytes(Path(folder)) if self.progress else 0
        return transfer_progress(self.progress, "uploading", _folder_id(Path(folder), DATASET_METADATA), Path(folder), total=size)

    @staticmethod
    def _ref(ref: str, version: int | None) -> str:
        return f"{ref}/{version}" if version is not None else ref

    # -- who and where ------------------------------------------------------------------------

    @property
    def username(self) -> str:
        """The Kaggle user the credentials belong to (owner of kernels and datasets by default)."""
        name = self.api.config_values.get("username")
        if not name:
            raise CredentialsError(MISSING_CREDENTIALS)
        return str(name)

    @staticmethod
    def kernel_url(ref: str) -> str:
        return f"https://www.kaggle.com/code/{ref}"

    # -- kernels ------------------------------------------------------------------------------

    def kernel_version(self, ref: str) -> int | None:
        """The kernel's newest version number (GetKernel), or None if it does not exist yet."""
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

        owner, slug = ref.split("/", 1)

        def get() -> Any:
            with self.api.build_kaggle_client() as kaggle:
                request = ApiGetKernelRequest()
                request.user_name = owner
                request.kernel_slug = slug
                return kaggle.kernels.kernels_api_client.get_kernel(request)

        try:
            response = self._call("kernel", get)
        except KaggleError as exc:
            if _status_code(exc) in MISSING:  # also after a retried 429/500: "not there" is an answer
                return None
            raise
        return int(response.metadata.current_version_number or 0) or None

    def log(self, ref: str, version: int | None = None) -> str:
        """The session's log as Kaggle keeps it (a JSON array of stream chunks), "" if none yet."""
        return str(self._call("log", lambda: self.api.kernels_logs(self._ref(ref, version))) or "")

    def log_stream(self, ref: str, version: int | None = None) -> Iterator[dict[str, Any]]:
        """The session's log as it is written (kernels_logs_stream: live while it runs, the whole log
        once it ended). KaggleError if Kaggle does not serve the stream (then only the end log exists)."""
        try:
            yield from self.api.kernels_logs_stream(self._ref(ref, version))
        except (requests.RequestException, ValueError) as exc:
            raise self._translate(exc, "log stream") from exc

    def log_so_far(self, ref: str, version: int | None = None, idle_s: float = 3.0) -> list[dict[str, Any]] | None:
        """The live log's events so far ({stream_name, time, data}), read from kernels_logs_stream until it
        ends or stays quiet for idle_s (a session that runs never ends the stream; one whose runner died
        sends nothing more); None when it gave nothing: not served (404), refused this time (429, 5xx), not
        reachable, or no line yet."""
        quick = KaggleClient(timeout_s=idle_s, attempts=1)  # its socket timeout is the quiet time
        events: list[dict[str, Any]] = []
        try:
            for event in quick.log_stream(ref, version):
                events.append(event)
        except KaggleError as exc:
            if isinstance(exc, CredentialsError) or _status_code(exc) is not None:
                return None
        return events or None

    def kernel_image(self, ref: str, version: int) -> str | None:
        """The image a kernel version ran on: the `docker_image` that `kaggle kernels pull -m` writes into
        kernel-metadata.json (ApiKernelMetadata.docker_image), or None when Kaggle names none."""
        folder = Path(tempfile.mkdtemp(prefix="kchain-pull-"))
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                self._call("pull", lambda: self.api.kernels_pull(f"{ref}/{version}", str(folder), metadata=True))
            metadata = json.loads((folder / "kernel-metadata.json").read_text())
        except (OSError, ValueError):
            return None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return str(metadata.get("docker_image") or "") or None

    def delete_kernel(self, ref: str) -> bool:
        """Delete the kernel with every version's output (`kaggle kernels delete -y`): the one call that
        stops a session Kaggle keeps RUNNING after its runner died, and its GPU bill (Unsloth's Kaggle CI,
        2026-08). True once deleted; False if it was not there (a retry after a lost answer lands here)."""
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                self._call("delete", lambda: self.api.kernels_delete(ref, no_confirm=True))
        except KaggleError as exc:
            if _status_code(exc) in MISSING:
                return False
            raise
        return True

    def push(self, folder: str | Path, timeout_s: int | None = None, accelerator: str | None = None) -> tuple[int, str]:
        """Push the kernel in folder; return (version_number, url). Refusals raise KaggleError."""
        api = self.api
        timeout = str(int(timeout_s)) if timeout_s else None
        with contextlib.redirect_stdout(io.StringIO()):
            resp = self._call("push", lambda: api.kernels_push(str(folder), timeout=timeout, acc=accelerator),
                              creating=True)
        kernel = _folder_id(Path(folder), "kernel-metadata.json")
        if resp.error:
            cap = SESSION_CAP.search(str(resp.error))
            if cap:
                raise SessionCapReached(f"Kaggle refused the push of {kernel}: {resp.error}", int(cap[1]))
            raise KaggleError(f"Kaggle refused the push of {kernel}: {resp.error}")
        invalid = {"dataset": resp.invalid_dataset_sources, "kernel": resp.invalid_kernel_sources,
                   "competition": resp.invalid_competition_sources, "model": resp.invalid_model_sources}
        bad = [f"{kind} sources {names}" for kind, names in invalid.items() if names]
        if bad:
            raise InvalidSources(f"Kaggle dropped invalid {'; '.join(bad)} from the push of {kernel} (version "
                                 f"{resp.version_number})", int(resp.version_number or 0) or None, str(resp.url),
                                 "; ".join(bad))
        return int(resp.version_number), str(resp.url)

    def running_gpu_kernels(self, window_h: float = 13.0, page_size: int = 50, pages: int = 5) -> list[dict[str, Any]]:
        """The account's kernels that ask for a GPU and whose newest session is queued or running:
        {ref, version, status}. Kaggle lists no running sessions, so the account's kernels are walked
        most recently run first and each one's status asked, stopping at the first one last run more
        than window_h ago (a session lasts 12 h at most: the walk is exhaustive, as in Unsloth's Kaggle
        CI gate). Kaggle's status answers for a kernel's newest session only, so an older session of a
        kernel pushed again while it ran is not among them."""
        cutoff = time.time() - window_h * 3600
        running: list[dict[str, Any]] = []
        for page in range(1, pages + 1):
            listed = self._call("kernels list", functools.partial(self.api.kernels_list,
                mine=True, page=page, page_size=page_size, sort_by="dateRun")) or []
            for kernel in listed:
                last = _utc_epoch(getattr(kernel, "last_run_time", None))
                if last is not None and last < cutoff:
                    return running
                entry = self._live_gpu_kernel(kernel)
                if entry is not None:
                    running.append(entry)
            if len(listed) < page_size:
                break
        return running

    def _live_gpu_kernel(self, kernel: Any) -> dict[str, Any] | None:
        """{ref, version, status} of a listed kernel whose newest session is live and may hold a GPU
        (it asks for one, or the listing does not say)."""
        ref = str(getattr(kernel, "ref", "") or "")
        gpu = getattr(kernel, "enable_gpu", None)
        if not ref or (gpu is False and not str(getattr(kernel, "machine_shape", "") or "").startswith("Nvidia")):
            return None
        try:
            status = self.status(ref)[0]
        except KaggleError:
            return None  # deleted, or unreadable: one kernel's status is not worth failing the explanation for
        if status not in LIVE:
            return None
        return {"ref": ref, "version": getattr(kernel, "current_version_number", None), "status": status}

    def status(self, ref: str, version: int | None = None) -> tuple[SessionState, str]:
        """(state, failure message) of ref's session at version (default: latest)."""
        resp = self._call("status", lambda: self.api.kernels_status(self._ref(ref, version)))
        return SessionState(resp.status.name), resp.failure_message or ""

    def output(self, ref: str, version: int | None, dest: str | Path) -> tuple[list[Path], str]:
        """Download a session's output files into dest; return (files, log text)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        with transfer_progress(self.progress, "downloading", f"the output of {self._ref(ref, version)}", dest):
            files, _ = self._call("output", lambda: self.api.kernels_output(
                self._ref(ref, version), str(dest), force=True, quiet=True))
        log_path = dest / f"{ref.split('/')[-1]}.log"
        log = log_path.read_text(encoding="utf-8") if log_path.exists() else ""
        return [Path(f) for f in files if Path(f) != log_path], log

    def quota_view(self) -> Quota:
        """Kaggle's GPU quota answer (GetAcceleratorQuotaStatistics), each figure None when left out."""
        resp = self._call("quota", lambda: self.api.quota_view())
        gpu = getattr(resp, "gpu_quota", None)
        used = getattr(gpu, "time_used", None) if gpu is not None else None
        total = getattr(gpu, "total_time_allowed", None) if gpu is not None else None
        return Quota(used_s=used.total_seconds() if used is not None else None,
                     total_s=total.total_seconds() if total is not None else None,
                     refresh=_utc_epoch(getattr(resp, "quota_refresh_time", None)))

    def quota(self) -> dict[str, float] | None:
        """This week's GPU quota: used_s, total_s, and refresh (epoch seconds); None when Kaggle's
        answer has no GPU figures (it may not), so the caller falls back to its own ledger."""
        answer = self.quota_view()
        if answer.used_s is None and answer.total_s is None:
            return None
        return {"used_s": answer.used_s or 0.0, "total_s": answer.total_s or 0.0, "refresh": answer.refresh or 0.0}

    # -- datasets -----------------------------------------------------------------------------

    def dataset_status(self, ref: str) -> str:
        """"ready", "blobs_received", ... ; KaggleError (HTTP 404) for an unknown dataset."""
        return str(self._call("dataset status", lambda: self.api.dataset_status(ref)))

    def dataset_version_number(self, ref: str) -> int:
        answer = self._call("dataset status", lambda: self.api.dataset_status(ref, format="json"))
        return int(json.loads(answer)["current_version_number"])

    def dataset_exists(self, ref: str) -> bool:
        try:
            self.dataset_status(ref)
        except KaggleError as exc:
            if _status_code(exc) in MISSING:  # also after a retried 429/500: "not there" is an answer
                return False
            raise
        return True

    def _created(self, what: str, resp: Any) -> str:
        status = resp.get("status", "") if isinstance(resp, dict) else getattr(resp, "status", "")
        if str(status).lower() != "ok":
            error = resp.get("error") if isinstance(resp, dict) else getattr(resp, "error", "")
            raise KaggleError(f"Kaggle refused to {what}: {error or status}")
        return str(getattr(resp, "ref", "") or "")

    def create_dataset(self, folder: str | Path, public: bool = False, dir_mode: str = "zip") -> str:
        """Create the dataset described by folder/dataset-metadata.json; return its ref."""
        with contextlib.redirect_stdout(io.StringIO()), self._uploading(folder):
            resp = self._call("create dataset", lambda: self.api.dataset_create_new(
                str(folder), public=public, quiet=True, dir_mode=dir_mode), creating=True)
        return self._created(f"create the dataset in {folder}", resp)

    def version_dataset(self, folder: str | Path, notes: str, dir_mode: str = "zip",
                        delete_old_versions: bool = False) -> None:
        """Upload folder as a new version of its dataset (poll dataset_status until "ready" after)."""
        with contextlib.redirect_stdout(io.StringIO()), self._uploading(folder):
            resp = self._call("version dataset", lambda: self.api.dataset_create_version(
                str(folder), notes, quiet=True, dir_mode=dir_mode, delete_old_versions=delete_old_versions),
                creating=True)
        self._created(f"version the dataset in {folder}", resp)

    def download_dataset(self, ref: str, version: int | None, dest: str | Path, unzip: bool = True) -> Path:
        dest = Path(dest)
        with contextlib.redirect_stdout(io.StringIO()), transfer_progress(
                self.progress, "downloading", self._ref(ref, version), dest):
            self._call("download dataset", lambda: self.api.dataset_download_files(
                self._ref(ref, version), str(dest), force=True, quiet=True, unzip=unzip))
        return dest

    def download_dataset_file(self, ref: str, version: int | None, name: str, dest: str | Path) -> Path:
        """One file of a dataset version into dest (a large file the server sent zipped is unzipped)."""
        dest = Path(dest)
        with contextlib.redirect_stdout(io.StringIO()), transfer_progress(
                self.progress, "downloading", f"{name} of {self._ref(ref, version)}", dest):
            self._call("download dataset file", lambda: self.api.dataset_download_file(
                self._ref(ref, version), name, str(dest), force=True, quiet=True, unzip=True))
        return dest / name

    # -- models -------------------------------------------------------------------------------

    def model_exists(self, model: str) -> bool:
        """Whether `owner/model` exists and this account sees it (403 and 404 read as no)."""
        try:
            self._call("model", lambda: self.api.model_get(model))
        except KaggleError as exc:
            if missing(exc):
                return False
            raise
        return True

    def _model_created(self, what: str, resp: Any) -> None:
        error = getattr(resp, "error", "") or ""
        if error:
            raise KaggleError(f"Kaggle refused to {what}: {error}")

    def create_model(self, folder: str | Path) -> None:
        """The model folder/model-metadata.json describes (the card its variations hang under)."""
        with contextlib.redirect_stdout(io.StringIO()):
            resp = self._call("create model", lambda: self.api.model_create_new(str(folder)), creating=True)
        self._model_created(f"create the model in {folder}", resp)

    def create_model_instance(self, folder: str | Path) -> None:
        """The variation folder/model-instance-metadata.json describes, with folder's files as version 1."""
        with contextlib.redirect_stdout(io.StringIO()), self._uploading(folder):
            resp = self._call("create model instance", lambda: self.api.model_instance_create(
                str(folder), quiet=True, dir_mode="zip"), creating=True)
        self._model_created(f"create the model variation in {folder}", resp)

    def create_model_instance_version(self, instance: str, folder: str | Path, notes: str) -> None:
        """folder's files as a new version of `owner/model/framework/variation`."""
        with contextlib.redirect_stdout(io.StringIO()), self._uploading(folder):
            resp = self._call("create model version", lambda: self.api.model_instance_version_create(
                instance, str(folder), notes, quiet=True, dir_mode="zip"), creating=True)
        self._model_created(f"version {instance}", resp)

    def model_versions(self, instance: str, page_size: int = 50) -> list[int]:
        """The version numbers of a model variation, `owner/model/framework/variation`, every page of
        the client's model_instance_versions_list (ListModelInstanceVersions; the client has no call
        for one version). KaggleError (HTTP 403 or 404) for a model that does not exist or is hidden."""
        numbers: list[int] = []
        token: str | None = None
        while True:
            page = self._call("model versions", functools.partial(self.api.model_instance_versions_list,
                instance, page_size=page_size, page_token=token))
            listed = page.version_list.versions if page.version_list else []
            numbers += [int(v.version_number) for v in listed]
            token = page.next_page_token or None
            if not token or not listed:
                return sorted(numbers)

    # -- kchain doctor ------------------------------------------------------------------------

    def lookup_code(self, kind: str, ref: str) -> int:
        """The HTTP status Kaggle answers a lookup of a kernel or dataset with: 200 if it is there,
        else the refusal's code (Kaggle may answer 403 rather than 404 for what does not exist)."""
        try:
            if kind == "kernel":
                return 200 if self.kernel_version(ref) is not None else 404
            self.dataset_status(ref)
        except CredentialsError:
            raise
        except KaggleError as exc:
            code = _status_code(exc)
            if code is None:
                raise
            return code
        return 200

    def save_without_running(self, folder: str | Path) -> dict[str, Any]:
        """Save the kernel in folder as a new version without running it (the client's quick save,
        `no_run`): nothing starts. Returns {version, url, error, invalid: {kind: [sources]}} as
        Kaggle answered, so a caller can report each refused source by name."""
        api = self.api
        with contextlib.redirect_stdout(io.StringIO()):
            resp = self._call("save", lambda: api.kernels_push(str(folder), no_run=True), creating=True)
        invalid = {"dataset": list(resp.invalid_dataset_sources or []),
                   "kernel": list(resp.invalid_kernel_sources or []),
                   "competition": list(resp.invalid_competition_sources or []),
                   "model": list(resp.invalid_model_sources or [])}
        return {"version": resp.version_number, "url": resp.url, "error": resp.error or "",
                "invalid": {kind: names for kind, names in invalid.items() if names}}


def lost_answer(exc: BaseException) -> bool:
    """The laptop client's word for an answer lost after Kaggle may have acted."""
    return isinstance(exc, OutcomeUnknown)


def new_kernel_version(client: KaggleClient, ref: str, before: int | None) -> int | None:
    """The kernel's version when it is newer than `before` (a send landed), else None."""
    try:
        version = client.kernel_version(ref)
    except KaggleError as exc:
        raise OutcomeUnknown(f"Kaggle push of {ref}: the answer was lost and the kernel's version could "
                             f"not be read ({exc}); the next `kchain push` or `kchain continue` settles it") from exc
    return version if version and version != before else None
