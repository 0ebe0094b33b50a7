"""Publish this session's end state from inside the kernel (internet on, credential in Secrets).

Embedded into the notebook next to the runtime and run as its own process after training, so the
credential lives only in this process's environment: it is never printed, logged or written to
a file. Without internet or without a credential it says so and leaves the work to the laptop
(`kchain continue` relays the state from the session's output).

    python -m kchain_publish CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

PROCESS_START = time.monotonic()  # the client's start-up (the kaggle import) is measured from here

from kchain.runtime import layout, summary  # noqa: E402
from kchain.runtime.config import RuntimeConfig  # noqa: E402

SECRET_LABELS = ("KAGGLE_USERNAME", "KAGGLE_KEY")


def say(msg: str) -> None:
    print(f"[kchain] publish: {msg}", flush=True)


def none(why: str) -> int:
    """The summary keeps `published: null`: `kchain continue` relays the state from the session's output."""
    print(f"[kchain] published: none ({why}); `kchain continue` will relay the state from the laptop", flush=True)
    return 0


def time_left(config: RuntimeConfig) -> float | None:
    """Seconds until the session's hard limit, by the notebook's clock; None if unknown."""
    start = os.environ.get(layout.SESSION_START_ENV)
    limit = os.environ.get(layout.SESSION_LIMIT_ENV) or config.train.session_limit_s
    if not start or not limit:
        return None
    return float(start) + float(limit) - time.time()


def credential() -> dict[str, str] | None:
    """KAGGLE_USERNAME and KAGGLE_KEY from the kernel's attached Secrets, or None."""
    try:
        from kaggle_secrets import UserSecretsClient

        client = UserSecretsClient()
        return {label: client.get_secret(label) for label in SECRET_LABELS}
    except Exception as exc:  # noqa: BLE001 - any failure means "no credential here"
        say(f"no Kaggle credential in this kernel's Secrets ({type(exc).__name__}); "
            "attach secrets KAGGLE_USERNAME and KAGGLE_KEY to publish from the kernel")
        return None


def retry(what: str, call, attempts: int = 6):
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - 429/5xx/connection errors: back off and retry
            if attempt == attempts - 1:
                raise
            wait = min(30.0, 1.0 * 2**attempt)
            say(f"{what} failed ({type(exc).__name__}: {str(exc)[:120]}); retrying in {wait:.0f}s")
            time.sleep(wait)


def publish_folder(api, folder: Path, ref: str, title: str, notes: str, dir_mode: str) -> None:
    (folder / "dataset-metadata.json").write_text(json.dumps(
        {"id": ref, "title": title, "licenses": [{"name": "CC0-1.0"}]}))
    try:
        api.dataset_status(ref)
        exists = True
    except Exception:  # noqa: BLE001 - a 404 means it does not exist yet
        exists = False
    if exists:
        result = retry("dataset version", lambda: api.dataset_create_version(
            str(folder), notes, quiet=True, dir_mode=dir_mode))
    else:
        result = retry("dataset create", lambda: api.dataset_create_new(
            str(folder), public=False, quiet=True, dir_mode=dir_mode))
    status = getattr(result, "status", None) or (result.get("status") if isinstance(result, dict) else None)
    error = getattr(result, "error", None) or (result.get("error") if isinstance(result, dict) else None)
    if str(status).lower() != "ok":
        raise RuntimeError(f"{ref}: {error or status}")


def attached_cache(input_root: Path, marker_name: str) -> list[str] | None:
    for marker in input_root.rglob(marker_name) if input_root.is_dir() else []:
        try:
            return json.loads(marker.read_text())["entries"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def main(config_path: str) -> int:
    config = RuntimeConfig.from_dict(json.loads(Path(config_path).read_text()))
    kchain_dir = layout.kchain_dir(os.environ)
    if os.environ.get(layout.SMOKE_ENV) == "1":
        return 0  # a smoke run publishes nothing
    if not config.kaggle.internet:
        return none("internet is off for this kernel")
    if not config.kaggle.state_dataset:
        return none("the job has no Kaggle owner, so there is no state dataset to publish to")
    # Standard library only (statefolder finds and verifies without torch): a session near its limit
    # must not spend its last seconds importing torch.
    from kchain.runtime import publishplan
    from kchain.runtime.statefolder import newest_checkpoint

    plan = publishplan.figures(config.kaggle)
    found = newest_checkpoint(kchain_dir, config.job)
    if found is None:
        return none("no verified checkpoint in this session's output")
    nbytes = publishplan.tree_bytes(found[0])
    need, left = publishplan.seconds(plan, nbytes), time_left(config)
    if left is not None and left < need:
        return none(f"{left:.0f}s left before the session limit, and publishing "
                    f"{publishplan.size_text(nbytes)} needs about {need:.0f}s")
    cred = credential()
    if cred is None:
        return none("no credential in this kernel's Secrets")

    # The session token Kaggle mounts would take precedence over the user's key (kagglesdk 1.3).
    os.environ.pop("KAGGLE_API_V1_TOKEN", None)
    os.environ.update(cred)
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    work = Path(tempfile.mkdtemp(prefix="kchain-publish-"))
    try:
        return publish(api, config, kchain_dir, work)
    except Exception as exc:  # noqa: BLE001 - the laptop relay is the fallback; say why
        return none(f"failed: {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(api, config: RuntimeConfig, kchain_dir: Path, work: Path) -> int:
    """The state (and a changed cache) as new dataset versions; the figures into summary.json."""
    from kchain.runtime.statefolder import CACHE_MARKER, build_cache_folder, build_state_folder, cache_entries

    kaggle = config.kaggle
    marker = build_state_folder(kchain_dir, work / "state", published="kernel", job=config.job)
    if marker is None:
        return none("no verified checkpoint in this session's output")
    notes = f"kchain session {marker['session']} step {marker['step']}"
    t1 = time.monotonic()
    publish_folder(api, work / "state", kaggle.state_dataset, f"{config.job} state"[:50], notes, "skip")
    uploaded = sum(p.stat().st_size for p in (work / "state").iterdir() if p.is_file())
    # Measured here, planned with by the next session (continue passes them on in its config).
    took = max(time.monotonic() - t1, 1e-3)
    # The creation's round trips are folded into the rate: sessions of a chain publish similar sizes.
    timing = {"start_s": round(t1 - PROCESS_START, 3), "create_s": 0.0,
              "rate_bps": round(uploaded / took, 1), "bytes": uploaded}
    cache_bytes = 0
    entries = cache_entries(kchain_dir)
    if entries and entries != attached_cache(layout.input_root(os.environ), CACHE_MARKER) and kaggle.cache_dataset:
        cache_bytes = build_cache_folder(kchain_dir, work / "cache")
        publish_folder(api, work / "cache", kaggle.cache_dataset, f"{config.job} cache"[:50], notes, "zip")
    summary_path = kchain_dir / layout.SUMMARY
    ended = summary.read(summary_path) or summary.Summary()
    ended.published, ended.published_step = "kernel", marker["step"]
    ended.published_bytes, ended.publish_timing = uploaded + cache_bytes, timing
    summary.write(summary_path, ended)
    say(f"state at step {marker['step']} is now a new version of {kaggle.state_dataset} "
        f"({uploaded / 1e6:.1f} MB{f', cache {cache_bytes / 1e6:.1f} MB' if cache_bytes else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
