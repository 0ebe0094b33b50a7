"""A job's attached inputs on this machine: `kaggle.local` folders or downloads cached in .kchain/inputs.

The smoke run and `rehearse` lay them out under a sandbox's `input/` the way Kaggle mounts them. A
Kaggle Model's local folder is usually a stand-in: a smaller model of the same architecture (a 2B
base does not fit a laptop), mounted where Kaggle mounts the real one, so the code that reads it is
the code that runs on Kaggle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kchain.common import layout
from kchain.errors import SpecError
from kchain.job import kagglepip
from kchain.job.spec import Job
from kchain.store.names import pip_dataset

Echo = Callable[[str], None]


def _input_refs(job: Job) -> list[tuple[str, str, str, str | None]]:
    """(kind, owner, slug, version) of every attached input."""
    refs: list[tuple[str, str, str, str | None]] = []
    for ref in job.kaggle.datasets:
        parts = ref.split("/")
        refs.append(("datasets", parts[0], parts[1], parts[2] if len(parts) > 2 else None))
    if job.kaggle.competition:
        refs.append(("competitions", "", job.kaggle.competition, None))
    return refs


def local_inputs(job: Job, cache: Path, download: bool = False, echo: Echo = print) -> dict[tuple[str, str, str], Path]:
    """Where each input lives on this machine: kaggle.local, else a download cached under .kchain/inputs.
    A model's key is ("models", owner, "<model>/<framework>/<variation>/<version>"), its mount below
    input/models/<owner>/ (layout.model_mount)."""
    found: dict[tuple[str, str, str], Path] = {}
    for ref in job.kaggle.models:
        mount = layout.model_mount(ref)
        found[(mount.parts[0], mount.parts[1], "/".join(mount.parts[2:]))] = _local_model(job, ref, cache, echo)
    for kind, owner, slug, version in _input_refs(job):
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
            from kchain.kaggle.client import KaggleClient

            echo(f"  download   {owner}/{slug}{f'/{version}' if version else ''} into {cached}")
            KaggleClient(progress=True).download_dataset(f"{owner}/{slug}", int(version) if version else None,
                                                         cached, unzip=True)
        found[(kind, owner, slug)] = cached
    if job.kaggle.pip:  # the wheels dataset kchain attaches (render.job_sources): built here, never downloaded
        owner, slug = pip_dataset(job.kaggle.owner or "local", job.name).split("/")
        found[("datasets", owner, slug)] = kagglepip.local_folder(job, echo)
    return found


def _local_model(job: Job, ref: str, cache: Path, echo: Echo = print) -> Path:
    """The folder that stands in for model version ref on this machine, said in one line: kaggle.local
    under the full ref or the model's slug, else a copy put under .kchain/inputs/models/<ref>."""
    model = ref.split("/")[1]
    key = ref if ref in job.kaggle.local else model
    local = job.kaggle.local.get(key)
    if local is not None:
        source = (job.root / local).resolve()
        if not source.is_dir():
            raise SpecError(f"{job.path}: kaggle.local.{key}: {local!r} is not a folder; fix the path")
        echo(f"  model      {ref}: stand-in {source} (kaggle.local.{key})")
        return source
    cached = cache / "models" / ref
    if not (cached.is_dir() and any(cached.iterdir())):
        raise SpecError(
            f"{job.path}: kaggle.local.{model}: no local copy of model {ref} for the smoke run; add kaggle.local: "
            f"{{{model}: path/to/a/stand-in}} (a smaller model of the same architecture will do)"
        )
    echo(f"  model      {ref}: local copy {cached}")
    return cached


def mount_inputs(root: Path, sources: dict[tuple[str, str, str], Path]) -> None:
    """Lay the inputs out under ROOT/input like Kaggle's current layout (links, nothing copied)."""
    for (kind, owner, slug), source in sources.items():
        target = root / layout.INPUT_DIR / kind / owner / slug if owner else root / layout.INPUT_DIR / kind / slug
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)
