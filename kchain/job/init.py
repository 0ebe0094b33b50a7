"""`kchain init [--template NAME] DIR`: a job folder copied from a template that passes `kchain smoke` as written.

Each template is a folder of kchain/init_templates/ (package data): `loop` (the default: a commented
job.yaml and a train.py skeleton), `notebook` (job.yaml and a train.ipynb written as on Kaggle), and
whatever other folders are present (the framework templates). Its files are copied as they are, with
the literal token @NAME@ replaced by the job's name and nothing else formatted, so a template is plain
Python, YAML or notebook JSON that its own tests can read. Nothing is ever overwritten.
"""

from __future__ import annotations

import re
from pathlib import Path

from kchain.errors import SpecError

TEMPLATES = Path(__file__).resolve().parents[1] / "init_templates"
DEFAULT = "loop"
TOKEN = b"@NAME@"
# What a template folder may hold that is not part of it (an interpreter or editor left it).
_NOT_TEMPLATE = re.compile(r"(^|/)(__pycache__|\.ipynb_checkpoints)(/|$)|\.pyc$|(^|/)\.DS_Store$")


def templates() -> list[str]:
    """The template names: the folders of kchain/init_templates/ that hold a job.yaml, sorted."""
    if not TEMPLATES.is_dir():
        return []
    return sorted(p.name for p in TEMPLATES.iterdir()
                  if p.is_dir() and not p.name.startswith((".", "_")) and (p / "job.yaml").is_file())


def check_template(template: str) -> str:
    """The name, if it is a template's (templates()); an unknown name is one SpecError line."""
    names = templates()
    if template not in names:
        raise SpecError(f"--template {template!r}: no such template; use one of: {', '.join(names)}")
    return template


def _template_files(template: str) -> list[str]:
    """A template's files, as paths relative to its folder (sorted); an unknown name is one SpecError line."""
    folder = TEMPLATES / check_template(template)
    files = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(f for f in files if not _NOT_TEMPLATE.search(f))


def _slug_for(folder: Path) -> str:
    """A job name spec accepts, from the folder name: NAME_MIN-NAME_MAX lowercase letters, digits, single dashes."""
    from kchain.job.spec import NAME_MAX, NAME_MIN

    name = re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-") or "my-job"
    return (name if len(name) >= NAME_MIN else f"{name}-job")[:NAME_MAX].strip("-")


def init_job(folder: Path, template: str = DEFAULT) -> list[Path]:
    """Copy the template's files into folder, @NAME@ replaced by _slug_for(folder); refuse if any exists.
    Returns the paths written."""
    files = _template_files(template)
    targets = [folder / rel for rel in files]
    taken = [str(p) for p in targets if p.exists()]
    if taken:
        raise SpecError(f"{', '.join(taken)} already exists; kchain init never overwrites: choose an empty folder")
    name = _slug_for(folder).encode()
    for rel, target in zip(files, targets, strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((TEMPLATES / template / rel).read_bytes().replace(TOKEN, name))
    return targets
