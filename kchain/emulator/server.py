"""HTTP front of the emulator: routing, auth, injected faults, uploads and file serving.

The unmodified client reaches it in two ways: with KAGGLE_API_ENVIRONMENT=LOCALHOST and
HTTP_PROXY pointing here it sends absolute-form requests (`POST http://localhost/api/v1/...`);
anything else sends origin-form ones (`POST /api/v1/...`). Both are routed the same way.

Routes:
    POST /api/v1/<service>/<Rpc>                 an RPC (auth: Basic user:key or Bearer token)
    POST /requests/GetUserSecretByLabelRequest   Kaggle secrets, for sessions (auth: session token)
    PUT  /upload/<upload id>                     blob upload, GCS resumable protocol (pre-signed)
    GET  /out/<sig>/<file>                       a session output file (pre-signed)
    GET  /dl/<sig>/<slug>.zip, /dl/<sig>/file/<name>   dataset downloads (pre-signed)
    GET  /mdl/<sig>/<model>.tar.gz               a model version's download (pre-signed)
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import socket
import struct
import sys
import time
from collections.abc import Callable
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kchain.emulator.rpcs import ApiError, Redirect, ResetConnection, Rpcs
from kchain.emulator.sessions import log_entries

RPC_PATH = re.compile(r"^(?:/api)?/v1/(?P<service>[\w.]+)/(?P<rpc>\w+)$")
LOG_STREAM_PATH = re.compile(r"^(?:/api)?/v1/kernels/logs/stream/(?P<owner>[^/]+)/(?P<slug>[^/]+)$")
END_OF_LOG = "END_OF_LOG"  # the client's _LOG_STREAM_END_SENTINEL
CHUNK = 1 << 20


class EmulatorHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], rpcs: Rpcs, users: dict[str, str], tokens: dict[str, str],
                 count: Callable[[str], None]) -> None:
        self.rpcs = rpcs
        self.users = users  # name -> key
        self.tokens = tokens  # token -> name
        self.count = count  # one call of a kind (an RPC name, or upload_put/_drop/_stall/_probe/_resume)
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a reset, a closed pipe) is the client's business, as on Kaggle: nothing
        is printed. Anything else is printed as socketserver does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    server: EmulatorHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "kchain-emulator"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the call counters are the log; stderr noise would bury test output

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def rpcs(self) -> Rpcs:
        return self.server.rpcs

    def _target(self) -> tuple[str, str]:
        """(path, query) of an origin-form or absolute-form request target."""
        parts = urlsplit(self.path)
        return unquote(parts.path), parts.query

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, code: int, body: bytes = b"", content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(payload).encode(), headers=headers)

    def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(code, {"code": code, "message": message}, headers)

    def _injected(self, code: int, message: str) -> None:
        """An injected fault's answer; a 429 says when to come back (Retry-After: 1), as Kaggle's does."""
        self._error(code, message, {"Retry-After": "1"} if code == 429 else None)

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "basic":
            try:
                name, _, key = base64.b64decode(value).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            return name if key and self.server.users.get(name) == key else None
        if scheme.lower() == "bearer":
            return self.server.tokens.get(value.strip())
        return None

    def _from_kernel(self) -> bool:
        """Whether the call comes from inside a session: its proxy credentials are a session's token."""
        scheme, _, value = (self.headers.get("Proxy-Authorization") or "").partition(" ")
        try:
            token = base64.b64decode(value).decode().partition(":")[2] if scheme.lower() == "basic" else ""
        except (binascii.Error, UnicodeDecodeError):
            return False
        return bool(token) and token in self.rpcs.runner.secret_tokens

    # -- verbs --------------------------------------------------------------------------------

    def do_POST(self) -> None:
        path, _ = self._target()
        body = self._body()
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return self._error(400, "The request body is not JSON")
        if path == "/requests/GetUserSecretByLabelRequest":
            return self._secret(request)
        match = RPC_PATH.match(path)
        if not match:
            return self._error(404, f"No such endpoint: {path}")
        rpc = match["rpc"]
        self.server.count(rpc)
        fault = self.rpcs.faults.api_fault(rpc)
        if fault:
            return self._injected(fault, "TooManyRequests" if fault == 429 else "Internal error (injected)")
        refused = self.rpcs.faults.save_refusal() if rpc == "SaveKernel" else None
        if refused:
            return self._injected(refused, "Push refused (injected)")
        if rpc == "IntrospectToken":
            user = self.server.tokens.get(str(request.get("token", "")))
            return self._json(200, {"active": True, "username": user} if user else {"active": False})
        user = self._user()
        if user is None:
            return self._error(401, "Unauthenticated: missing or invalid Kaggle credentials")
        if rpc == "SaveKernel" and not self.rpcs.switches.kernel_may_push and self._from_kernel():
            self.server.count("SaveKernel_from_kernel_refused")
            return self._error(403, "Permission denied: a kernel may not push a kernel (switches.kernel_may_push)")
        handler = getattr(self.rpcs, rpc, None)
        if handler is None or not rpc[:1].isupper():  # RPCs are the CamelCase methods
            return self._error(404, f"Unknown RPC {match['service']}/{rpc}")
        try:
            # each takes the store's lock for what needs it; a push is told whether a kernel sent it
            answer = handler(user, request, from_kernel=self._from_kernel()) if rpc == "SaveKernel" \
                else handler(user, request)
        except ApiError as e:
            return self._error(e.code, e.message)
        except Redirect as r:
            return self._send(302, b"", "text/plain", {"Location": r.location})
        except ResetConnection:
            return self._reset()  # the call acted; its answer never leaves
        self._json(200, answer)

    def _reset(self) -> None:
        """Drop the connection with a TCP reset and no answer: the client sees a connection error
        after the server acted (linger 0 turns the close into an RST)."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _secret(self, request: dict[str, Any]) -> None:
        secret = self.rpcs.user_secret(str(request.get("JWE", "")), str(request.get("Label", "")))
        if secret is None:
            return self._json(200, {"wasSuccessful": False, "errors": ["No secret with that label for this session"]})
        self._json(200, {"wasSuccessful": True, "result": {"secret": secret}})

    def do_PUT(self) -> None:
        path, _ = self._target()
        match = re.fullmatch(r"/upload/([\w-]+)", path)
        store = self.rpcs.store
        with store.lock:
            found = [(t, b) for t, b in store.blobs.items() if match and b["upload_id"] == match[1]]
        if not found:
            self._body()
            return self._error(404, "Upload not found or expired")
        token, blob = found[0]
        length = int(self.headers.get("Content-Length") or 0)
        content_range = self.headers.get("Content-Range") or ""
        if content_range.startswith("bytes */"):  # resumable-upload status probe
            self._body()
            self.server.count("upload_probe")
            if blob["complete"]:
                return self._json(200, {"token": token})
            headers = {"Range": f"bytes=0-{blob['received'] - 1}"} if blob["received"] else {}
            return self._send(308, b"", "text/plain", headers)
        start = 0
        ranged = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range)
        if ranged:
            start = int(ranged[1])
            self.server.count("upload_resume")
            if start > blob["received"]:
                self._body()
                return self._error(400, f"Content-Range starts at {start}, only {blob['received']} bytes received")
        faults = self.rpcs.faults
        drop = length > 1 and faults.drop_this_upload()
        stall = length > 1 and not drop and faults.stall_this_upload()
        budget = length // 2 if drop or stall else length
        received = start + self._store_body(store.blob_path(token), start, budget)
        with store.lock:
            blob["received"] = received
            blob["complete"] = not (drop or stall) and received >= blob["size"]
            store.save()
        # Counted once the bytes are stored: a test that sees the count sees the upload's stored state.
        self.server.count("upload_stall" if stall else "upload_drop" if drop else "upload_put")
        if stall:
            self.close_connection = True
            return self._hang_until_the_client_goes()
        if drop:
            self.close_connection = True
            try:
                # RST, not FIN: the client sees a reset mid-body, as with a dropped link.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return None
        if not blob["complete"]:
            return self._send(308, b"", "text/plain", {"Range": f"bytes=0-{received - 1}"} if received else {})
        self._json(200, {"token": token})

    def _store_body(self, blob: Path, start: int, budget: int) -> int:
        """Write up to `budget` bytes of the request's body into the blob from `start` (cutting off what
        was there after it); the bytes written."""
        written = 0
        with open(blob, "r+b") as f:
            f.seek(start)
            f.truncate()
            while written < budget:
                chunk = self.rfile.read(min(CHUNK, budget - written))
                if not chunk:
                    break
                f.write(chunk)
                written += len(chunk)
        return written

    def _hang_until_the_client_goes(self) -> None:
        """Read and throw away whatever the client still sends, answering nothing, until it closes the
        connection (or the emulator stops)."""
        self.connection.settimeout(0.5)
        while not self.rpcs.runner.stopping:
            try:
                if not self.connection.recv(CHUNK):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def do_GET(self) -> None:
        path, query = self._target()
        if match := LOG_STREAM_PATH.match(path):
            return self._log_stream(match["owner"], match["slug"], query)
        found, name = self._lookup(path)
        if found is None:
            return self._error(404, f"Not found: {path}")
        types = {".zip": "application/zip", ".gz": "application/gzip"}
        self._file(found[0], found[1], types.get(Path(name).suffix, "application/octet-stream"))

    def _log_stream(self, owner: str, slug: str, query: str) -> None:
        """kernels_logs_stream: SSE `data:` lines while the session lives, then END_OF_LOG; the
        persisted JSON log (not SSE) once it has ended."""
        self.server.count("GetKernelSessionLogsStream")
        fault = self.rpcs.faults.api_fault("GetKernelSessionLogsStream")
        if fault:
            return self._injected(fault, "Injected fault")
        user = self._user()
        if user is None:
            return self._error(401, "Unauthenticated: missing or invalid Kaggle credentials")
        if not self.rpcs.switches.log_stream:
            return self._error(404, "No such endpoint: the live log stream is not served")
        label = parse_qs(query).get("versionLabel", [""])[0]
        try:
            session_id, live = self.rpcs.live_log(user, owner, slug, label)
        except ApiError as e:
            return self._error(e.code, e.message)
        sdir = self.rpcs.store.session_dir(session_id)
        if not live:
            log = sdir / "log.json"
            return self._send(200, log.read_bytes() if log.exists() else b"[]")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")  # each event reaches the client as it happens
        self.end_headers()
        sent = 0
        try:
            while not self.rpcs.runner.stopping:
                done = not self.rpcs.session_live(session_id)
                lines = [json.dumps(entry) for entry in log_entries(sdir / "log.jsonl")]
                for line in lines[sent:]:
                    self._chunk(f"data: {line}\n\n".encode())
                sent = len(lines)
                if done:
                    break
                time.sleep(0.1)
            self._chunk(f"data: {END_OF_LOG}\n\n".encode())
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _lookup(self, path: str) -> tuple[tuple[Path, float] | None, str]:
        rpcs = self.rpcs
        found: tuple[Path, float] | None = None
        name = "file"
        if m := re.fullmatch(r"/out/([\w-]+)/(.+)", path):
            found, name = rpcs.output_file(m[1], m[2]), m[2]
        elif m := re.fullmatch(r"/dl/([\w-]+)/file/(.+)", path):
            found, name = rpcs.dataset_file(m[1], m[2]), m[2]
        elif m := re.fullmatch(r"/dl/([\w-]+)/[^/]+\.zip", path):
            found, name = rpcs.dataset_zip(m[1]), "x.zip"
        elif m := re.fullmatch(r"/mdl/([\w-]+)/[^/]+\.tar\.gz", path):
            found, name = rpcs.model_archive(m[1]), "x.tar.gz"
        return found, name

    do_HEAD = do_GET

    def _file(self, path: Path, modified: float, content_type: str) -> None:
        size = path.stat().st_size
        start, end, code = 0, size - 1, 200
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if ranged and int(ranged[1]) < size:
            start, code = int(ranged[1]), 206
            end = min(int(ranged[2]), size - 1) if ranged[2] else size - 1
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(end - start + 1 if size else 0))
        self.send_header("Last-Modified", formatdate(modified, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD" or not size:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)




def free_closed_port() -> int:
    """A local port with nothing listening (for sessions whose internet is off)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

