"""An unattended chain's hand-over through a CPU relay, so that the chain holds one GPU slot, never two.

Kaggle runs at most two GPU batch sessions per account at once (shared/reference/kaggle-api.md 9). A GPU
session that pushed the next one itself would still be running (publishing, pushing, ending) when the next
one starts: two slots for a moment, and with any other GPU session on the account (a second chain, a
notebook open in the browser) Kaggle refuses the push. So session N pushes no GPU session: it pushes a
small CPU-only relay (no accelerator: never counted against the GPU cap or quota), the next version of the
job's doctor kernel (`<name>-doctor`: internet on, the Secrets `kchain doctor` proved are attached), and
ends. The relay waits until session N has ended (its status, read through the client), pushes session
N+1 exactly once (a lost answer settled by the kernel's version, `nextkernel.push_once`) unless the kernel
already has a version past N (a laptop took the chain over), writes what it did to `RELAY_FILE` in its
output (the laptop reads it: `sessions.settle_relay`), and ends.

Both halves live here, standard library only: `send` runs in session N's publish process (the only one
with the credential), `main` in the relay's own process (`python -m kchain.common.relay CONFIG_JSON`).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from kchain.common import atomic, kernelauth, layout, nextkernel, sendonce, sessionstate, summary
from kchain.common.sessionstate import TERMINAL

RELAY_FILE = layout.RELAY_FILE  # the relay's output: what it did (its `version` is the session it pushed)
FORMAT = "kchain-relay/1"
NEXT_DIR = "next"  # in the relay's payload: the next session's kernel folder, rendered by session N
GRACE_S = 600.0  # how much longer than session N's time left the relay waits for Kaggle to say it ended
CPU_LIMIT_S = 12 * 3600  # a CPU session's limit (kaggle-api.md 6.1); sessionTimeoutSeconds must stay below it
POLL_S = 1.0  # between two reads of session N's status
PUSH_S = 600.0  # how long the relay may spend pushing session N+1 (its reads and sends): it has a CPU session's hours

CELL = '''# kchain relay: waits until the GPU session before it has ended, then pushes the next one once
import base64, io, json, os, subprocess, sys, tempfile, zipfile

relay_config = json.loads(@CONFIG@)
relay_payload = @PAYLOAD@
src = tempfile.mkdtemp(prefix="kchain-relay-")
zipfile.ZipFile(io.BytesIO(base64.b64decode(relay_payload))).extractall(src)
config_path = os.path.join(src, "relay-config.json")
with open(config_path, "w") as f:
    json.dump(relay_config, f)
env = dict(os.environ)
env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
# Its own process, as the publish's: the credential lives in that process's environment only.
child = subprocess.Popen([sys.executable, "-m", "kchain.common.relay", config_path], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
for line in child.stdout:
    print(line, end="", flush=True)
if child.wait() != 0:
    raise RuntimeError(f"the kchain relay exited with code {child.returncode}; see the lines above")
'''


def say(msg: str) -> None:
    print(f"[kchain] relay: {msg}", flush=True)


# -- session N's half: hand the push over ---------------------------------------------------------


def notebook(config: dict[str, Any], payload_b64: str) -> str:
    """The relay's notebook: one cell that unpacks the payload and runs `main` in its own process."""
    source = CELL.replace("@CONFIG@", json.dumps(json.dumps(config, sort_keys=True))).replace(
        "@PAYLOAD@", json.dumps(payload_b64))
    cell: dict[str, Any] = {"cell_type": "code", "execution_count": None, "id": "kchain-relay", "metadata": {},
                            "outputs": [], "source": source}
    return nextkernel.canonical({"cells": [cell], "metadata": {"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5})


def metadata(relay: str) -> str:
    """The relay's kernel-metadata.json: no accelerator (a CPU session), internet on (it calls the API)."""
    slug = relay.split("/", 1)[1]
    return nextkernel.canonical({"id": relay, "title": slug, "code_file": f"{slug}.ipynb", "language": "python",
                                 "kernel_type": "notebook", "is_private": True, "enable_gpu": False,
                                 "enable_tpu": False, "enable_internet": True})


def sources() -> dict[str, bytes]:
    """The modules the relay runs with (this one and what it imports, standard library only) and their
    packages' `__init__.py`, by path, as this process loaded them: a moved module moves with its import."""
    files: dict[str, bytes] = {}
    for module in (sys.modules[__name__], atomic, kernelauth, layout, nextkernel, sendonce, sessionstate, summary):
        parts = module.__name__.split(".")
        for depth in range(1, len(parts)):
            package = sys.modules[".".join(parts[:depth])]
            files["/".join(parts[:depth]) + "/__init__.py"] = Path(str(package.__file__)).read_bytes()
        files["/".join(parts) + ".py"] = Path(str(module.__file__)).read_bytes()
    return files


def payload(next_folder: Path) -> str:
    """The runtime files the relay needs and the next session's kernel folder, as a base64 zip."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(sources().items()):
            zf.writestr(name, data)
        for path in sorted(next_folder.iterdir()):
            zf.writestr(f"{NEXT_DIR}/{path.name}", path.read_bytes())
    return base64.b64encode(buf.getvalue()).decode("ascii")


def send(api: Any, template: dict[str, Any], src: Path, config: dict[str, Any], plan: dict[str, Any],
         wait_s: float, until: float) -> dict[str, Any]:
    """Session plan["session"] rendered (nextkernel.write_next) into a relay pushed once as the next version of
    the relay kernel: {relay, version_before (the job's kernel now: this session's version), relay_version |
    refused | unknown}."""
    chain = template["chain"]
    kernel, relay = chain["kernel"], chain["relay"]
    wait_s = min(wait_s + GRACE_S, CPU_LIMIT_S - GRACE_S)
    before = nextkernel.read_version(api, kernel, until)
    out: dict[str, Any] = {"relay": relay, "version_before": before}
    if before is None:
        return {**out, "refused": f"{kernel}'s version could not be read, so a relay could not tell its push from "
                                  "a laptop's"}
    work = Path(tempfile.mkdtemp(prefix="kchain-relay-"))
    try:
        nextkernel.write_next(work / NEXT_DIR, template, src, config, plan)
        relay_config = {"format": FORMAT, "kernel": kernel, "after_version": before, "session": plan["session"],
                        "wait_s": round(wait_s, 1), "timeout_s": int(chain["session_limit_s"])}
        nextkernel.write_kernel(work / "relay", relay.split("/", 1)[1], notebook(relay_config, payload(
            work / NEXT_DIR)), metadata(relay))
        sent = nextkernel.push_once(api, work / "relay", relay, int(wait_s + GRACE_S), until)  # its own limit
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if sent.get("version"):
        return {**out, "relay_version": sent["version"]}
    return {**out, **{k: v for k, v in sent.items() if k in ("refused", "unknown")}}


# -- the relay's half: wait, then push once ------------------------------------------------------


def status(api: Any, ref: str) -> str:
    """A session's status name (ref: owner/slug/version), or `unknown (...)` when no answer came."""
    try:
        answer = api.kernels_status(ref).status
    except Exception as exc:  # noqa: BLE001 - asked again until the wait's end
        return f"unknown ({type(exc).__name__})"
    return str(getattr(answer, "name", answer))


def _wait_ended(api: Any, ref: str, until: float) -> str:
    """Session ref's status once it has ended, or the last one read when the wait ran out."""
    while True:
        now = status(api, ref)
        if now in TERMINAL or time.monotonic() + POLL_S > until:
            return now
        time.sleep(POLL_S)


def relay(config: dict[str, Any], src: Path) -> dict[str, Any]:
    """Wait until the session before has ended, then push the next one once: what was done, for RELAY_FILE."""
    kernel, after = config["kernel"], int(config["after_version"])
    try:
        api = kernelauth.login()
    except kernelauth.NoCredential:
        return {"pushed": False, "why": f"no {' and '.join(kernelauth.LABELS)} in this relay's Secrets (not attached, "
                                        "or reset by the push that started it), so the laptop pushes the next session"}
    ended = _wait_ended(api, f"{kernel}/{after}", time.monotonic() + float(config["wait_s"]))
    if ended not in TERMINAL:
        return {"pushed": False, "why": f"{kernel} version {after} was still {ended} after {config['wait_s']:g}s"}
    until = time.monotonic() + PUSH_S
    now = nextkernel.read_version(api, kernel, until)
    if now is None:
        return {"pushed": False, "after": ended, "why": f"{kernel}'s version could not be read, so the relay could "
                f"not tell whether someone pushed after version {after}; the laptop pushes the next session"}
    if now != after:
        return {"pushed": False, "after": ended, "why": f"{kernel} has version {now}, not {after}: someone else "
                f"pushed after it (a laptop took the chain over), so the relay pushes nothing"}
    sent = nextkernel.push_once(api, src / NEXT_DIR, kernel, int(config["timeout_s"]), until)
    why = (f"pushed session {config['session']} as {kernel} version {sent['version']}" if sent.get("version") else
           f"Kaggle refused the push: {sent['refused']}" if sent.get("refused") else
           f"the push's answer was lost ({sent.get('unknown')}); the laptop settles it from the kernel's versions")
    return {"pushed": bool(sent.get("version")), "after": ended, "why": why, **sent}


def main(config_path: str) -> int:
    t0 = time.monotonic()
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    try:
        record = relay(config, Path(config_path).parent)
    except Exception as exc:  # noqa: BLE001 - whether it pushed is then read from the kernel's versions
        said = f"{type(exc).__name__}: {str(exc)[:200]}"
        record = {"pushed": False, "unknown": said, "why": f"the relay failed ({said}); the laptop settles from "
                                                             "the kernel's versions whether it pushed"}
    record = {"format": FORMAT, "session": config["session"], **record, "waited_s": round(time.monotonic() - t0, 3)}
    atomic.write_json(layout.working_root(os.environ) / RELAY_FILE, record)
    say(record["why"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
