"""A session's end state as a folder ready to become a dataset version.

Kaggle dataset versions hold only the files uploaded with them and only top-level files, so a
state version is flat and self-contained: the newest verified checkpoint's files (its manifest
included, so the next session's runtime finds and verifies it wherever it is mounted), the
session summary, and a small marker saying what it is. The data cache goes to its own dataset,
one archive per entry, and only when the set of entries changed.

Used by both publish paths: inside the kernel (internet on) and by `kchain continue` on the laptop.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kchain.common import layout, outputfiles, summary
from kchain.common.checkpoint_files import (
    BEST_KEY,
    CheckpointInvalid,
    attached_names,
    best_step,
    find_latest,
    verify,
)
from kchain.common.say import warn

STATE_MARKER = layout.STATE_MARKER
CACHE_MARKER = "kchain-cache.json"
EXPORT_GROUP = "export"  # run.export_dir's files travel flat as export.<path with / as -->


DATASET_METADATA = "dataset-metadata.json"  # what the client reads to create or version a dataset


def write_dataset_metadata(folder: Path, ref: str, title: str) -> None:
    """dataset-metadata.json as the client reads it (slug and title 6-50 characters, one license)."""
    meta = {"id": ref, "title": title[:50].ljust(6, "-"), "licenses": [{"name": "CC0-1.0"}]}
    (folder / DATASET_METADATA).write_text(json.dumps(meta, indent=1) + "\n")


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def newest_checkpoint(kchain_dir: Path, job: str | None) -> tuple[Path, dict] | None:
    scratch = Path(tempfile.mkdtemp(prefix="kchain-scan-"))
    try:
        # No input root: only this session's own checkpoints count here.
        return find_latest(kchain_dir / layout.CHECKPOINTS_DIR, scratch / "none", scratch, job)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_state_folder(kchain_dir: Path, dest: Path, published: str, job: str | None = None,
                       found: tuple[Path, dict] | None = None) -> dict | None:
    """Fill dest with the newest verified checkpoint (or `found`, a checkpoint and its manifest), the
    kept best beside it (`best.*`, train.keep_best), run.export_dir's files (`export.*`), summary and
    marker; None if there is none."""
    found = found or newest_checkpoint(kchain_dir, job)
    if found is None:
        return None
    ckpt, manifest = found
    dest.mkdir(parents=True, exist_ok=True)
    size = 0
    for name in [*manifest.get("files", {}), layout.MANIFEST]:
        link_or_copy(ckpt / name, dest / name)
        size += (dest / name).stat().st_size
    best = _kept_best(kchain_dir, ckpt, manifest)
    best_bytes = 0
    if best is not None and best[0] != ckpt:
        for name in [*best[1]["files"], layout.MANIFEST]:
            link_or_copy(best[0] / name, dest / (layout.BEST_PREFIX + name))
            best_bytes += (dest / (layout.BEST_PREFIX + name)).stat().st_size
    export = export_files(kchain_dir)
    exported = {flat: rel for flat, (rel, _) in export.items()}
    for flat, (_, src) in export.items():
        link_or_copy(src, dest / flat)
    ended = summary.read(kchain_dir / layout.SUMMARY)
    if ended is not None:
        # The copy that travels says who published it (the kernel itself, or the laptop's relay).
        ended.published = published
        summary.write(dest / layout.SUMMARY, ended)
    marker = {
        "job": manifest.get("job"),
        "session": manifest.get("session"),
        "step": manifest.get("step"),
        "fingerprint": manifest.get("fingerprint"),
        "checkpoint": ckpt.name,
        "checkpoint_bytes": size,
        "published": published,
        "cache": cache_entries(kchain_dir),
    }
    if best is not None:
        # Where the kept best is in this version: the newest itself (no prefix) or the best.* files.
        marker["best"] = {**best[1][BEST_KEY], "checkpoint": best[0].name, "bytes": best_bytes,
                          "prefix": "" if best[0] == ckpt else layout.BEST_PREFIX}
    if exported:
        marker["export"] = exported  # {name in this version: path under run.export_dir}
    (dest / STATE_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return marker


def export_files(kchain_dir: Path) -> dict[str, tuple[str, Path]]:
    """run.export_dir's files as {name in the version: (path under export_dir, the file to copy)}, under the
    rule of the session's output (outputfiles.problem): a link to a file inside the working folder travels
    as that file; any other link, a name Kaggle cannot serve, or what is not a plain file is left out, one
    line each (the session's own tidy at its end has left them out already, so this is seldom said)."""
    export = kchain_dir / layout.EXPORT_DIR
    if not export.is_dir():
        return {}
    working = kchain_dir.parent
    files: dict[str, tuple[str, Path]] = {}
    for flat, rel in attached_names(EXPORT_GROUP, export).items():
        src = export / rel
        why = outputfiles.problem(src, working)
        if why is not None:
            warn(f"run.export_dir: {str(src)!r} is left out of the state: {why}")
            continue
        files[flat] = (rel, src.resolve() if src.is_symlink() else src)  # a link: to a file inside, copied
    return files


def _kept_best(kchain_dir: Path, newest: Path, manifest: dict) -> tuple[Path, dict] | None:
    """The kept best checkpoint the newest one records (itself, or a verified step folder beside it)."""
    step = best_step(manifest)
    if step is None:
        return None
    if step == int(manifest.get("step", -1)):
        return newest, manifest
    path = kchain_dir / layout.CHECKPOINTS_DIR / layout.checkpoint_name(step)
    if not path.is_dir():
        path = newest.parent / layout.checkpoint_name(step)
    try:
        return path, verify(path)
    except CheckpointInvalid as e:
        warn(f"the kept best checkpoint is left out of the state: {e}")
        return None


def cache_entries(kchain_dir: Path) -> list[str]:
    """Names of the complete entries of the staged-data cache (its fingerprint is this list)."""
    cache = kchain_dir / layout.CACHE_DIR
    if not cache.is_dir():
        return []
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(layout.TMP_PREFIX))


def build_cache_folder(kchain_dir: Path, dest: Path) -> int:
    """One top-level file per cache entry (folders are zipped by the uploader); returns bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in cache_entries(kchain_dir):
        src = kchain_dir / layout.CACHE_DIR / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
            total += sum(p.stat().st_size for p in (dest / name).rglob("*") if p.is_file())
        else:
            link_or_copy(src, dest / name)
            total += (dest / name).stat().st_size
    (dest / CACHE_MARKER).write_text(json.dumps({"entries": cache_entries(kchain_dir)}) + "\n")
    return total
