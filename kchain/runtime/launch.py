"""The training child: `python -m kchain.runtime.launch CONFIG_JSON`.

Builds a Run, imports the entry (`module:function`), calls it, and writes summary.json in every
outcome but a SIGKILL. Exit code 0 for finished, deadline or interrupted; 1 for a crash.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

# The session clock's fallback: as close to process start as Python lets us get.
PROCESS_START = time.time()

from . import layout  # noqa: E402  (after the clock on purpose)

SUMMARY_RESERVE = 64 * 1024  # bytes held for summary.json from the start, for a disk that fills up


def _reserve_path(path: Path) -> Path:
    return path.with_name(f".reserve-{path.name}")


def _reserve(path: Path) -> None:
    """SUMMARY_RESERVE bytes set aside beside summary.json while the disk still has room."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(_reserve_path(path), "wb") as f:
        f.write(b" " * SUMMARY_RESERVE)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: dict) -> None:
    """Atomic: the notebook (or the next session) never reads half a summary.

    When the disk is full the temporary file cannot be written: the summary then goes into the
    reserved file (its blocks are already allocated), padded with spaces, renamed into place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(obj, indent=2, default=str) + "\n").encode()
    tmp = path.with_name(f"{layout.TMP_PREFIX}{path.name}")
    reserve = _reserve_path(path)
    try:
        tmp.write_bytes(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not reserve.is_file() or reserve.stat().st_size < len(text):
            raise
        print(f"[kchain] summary: {e.strerror or e}; written into the space reserved for it", flush=True)
        with open(reserve, "r+b") as f:
            f.write(text + b" " * (reserve.stat().st_size - len(text)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(reserve, path)
    reserve.unlink(missing_ok=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kchain.runtime.launch CONFIG_JSON", file=sys.stderr)
        return 2
    config = json.loads(Path(argv[1]).read_text())
    from .run import Run  # torch is imported here, after the clock started

    run = None
    error = None
    try:
        run = Run(config, os.environ, started=PROCESS_START)
        _reserve(run.summary_path)
        module_name, _, func_name = config["entry"].partition(":")
        run.phase = "build"
        entry = getattr(importlib.import_module(module_name), func_name or "main")
        entry(run)
        if run.status == "running":
            run.end_without_loop()
    except KeyboardInterrupt:
        if run is not None:
            run.status = "interrupted"
        print("[kchain] interrupted", flush=True)
    except BaseException as e:
        traceback.print_exc()
        stage = run.phase if run is not None else "build"
        error = {"type": type(e).__name__, "message": _first_line(e), "stage": stage}
        if run is not None:
            run.status = "crashed"
        print(f"[kchain] crashed in {stage}: {type(e).__name__}: {_first_line(e)}", flush=True)
    finally:
        if run is not None:
            try:
                run.close()  # never exit with a checkpoint write in flight
            except BaseException as e:
                traceback.print_exc()
                if error is None:
                    error = {"type": type(e).__name__, "message": _first_line(e), "stage": "checkpoint"}
                    run.status = "crashed"

    if run is not None:
        summary = run.summary(error=error)
        path = run.summary_path
    else:
        summary = {"status": "crashed", "error": error, "started": PROCESS_START, "ended": time.time(),
                   "fingerprint": config.get("fingerprint"), "published": None}
        path = layout.kchain_dir(os.environ) / layout.SUMMARY
    _write_json(path, summary)
    print(f"[kchain] summary: {json.dumps({k: summary.get(k) for k in ('status', 'step', 'total', 'checkpoint')})}",
          flush=True)
    return 1 if summary["status"] == "crashed" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
