"""A job's attached inputs on this machine: `kaggle.local` folders or downloads cached in .kchain/inputs.

The smoke run and `rehearse` lay them out under a sandbox's `input/` the way Kaggle mounts them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kchain.errors import SpecError
from kchain.runtime import layout
from kchain.spec import Job

Echo = Callable[[str], None]


def input_refs(job: Job) -> list[tuple[str, str, str, str | None]]:
    """(kind, owner, slug, version) of every attached input."""
    refs: list[tuple[str, str, str, str | None]] = []
    for ref in job.kaggle.datasets:
        parts = ref.split("/")
        refs.append(("datasets", parts[0], parts[1], parts[2] if len(parts) > 2 else None))
    if job.kaggle.competition:
        refs.append(("competitions", "", job.kaggle.competition, None))
    return refs


def local_inputs(job: Job, cache: Path, download: bool = False, echo: Echo = print) -> dict[tuple[str, str, str], Path]:
    """Where each input lives on this machine: kaggle.local, else a download cached under .kchain/inputs."""
    found: dict[tuple[str, str, str], Path] = {}
    for kind, owner, slug, version in input_refs(job):
        local = job.kaggle.local.get(slug)
        if local is not None:
            source = (job.root / local).resolve()
            if not source.is_dir():
                raise SpecError(f"{job.path}: kaggle.local.{slug}: {local!r} is not a folder; fix the path")
            found[(kind, owner, slug)] = source
            continue
        cached = cache / kind / (owner or "_") / slug / (version or "latest")
        if not (cached.is_dir() and any(cached.iterdir())):
            if not download or kind != "datasets":
                how = " or pass --download to fetch it once" if kind == "datasets" else ""
                raise SpecError(
                    f"{job.path}: kaggle.local.{slug}: no local copy of {kind[:-1]} {slug!r} for the smoke run; "
                    f"add kaggle.local: {{{slug}: path/to/a/small/copy}}{how}"
                )
            from kchain.kaggle_api import KaggleClient

            echo(f"  download   {owner}/{slug}{f'/{version}' if version else ''} into {cached}")
            KaggleClient(progress=True).download_dataset(f"{owner}/{slug}", int(version) if version else None,
                                                         cached, unzip=True)
        found[(kind, owner, slug)] = cached
    return found


def mount_inputs(root: Path, sources: dict[tuple[str, str, str], Path]) -> None:
    """Lay the inputs out under ROOT/input like Kaggle's current layout (links, nothing copied)."""
    for (kind, owner, slug), source in sources.items():
        target = root / layout.INPUT_DIR / kind / owner / slug if owner else root / layout.INPUT_DIR / kind / slug
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)
