"""The session's output as Kaggle can serve it: every file under the working folder listed and fetchable.

Kaggle keeps /kaggle/working as the version's output and serves it file by file: ListKernelSessionOutput
lists each file's name with a URL, and `kaggle kernels output` (what `kchain continue` and `pull --final`
fetch with) downloads each in turn, so one file it cannot serve fails the whole fetch, and with it the relay
of the session's state: the trained steps would be lost to an output listing. Two kinds are never served:

- a symlink. The output is the folder's files; a link is listed and answers 404 (issue #61: the link W&B's
  offline mode leaves; the official client fails on it too). One that points to a file inside the working
  folder is replaced by a copy of that file; any other (outside it, to a folder, dangling) is left out.
- a name the listing cannot carry (`name_problem`, the one rule; the local Kaggle answers such a file 404
  too, its `unservable_output` switch).

`tidy` runs once the training has ended, whatever its end, in the notebook's last cell before the publish
(`python -m kchain.common.outputfiles`, the working folder from KCHAIN_ROOT), so a file is left out while the
session still runs, each in one line naming its whole path, never found by a fetch after it. The state
folder (statefolder.py) applies `problem` to run.export_dir's files wherever it is built.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

from kchain.common import layout

PREFIX = "[kchain] output:"

# Characters the listing cannot carry in a name, each with why (the sources: name_problem). The listing hands
# every file out as `<url>/<name>` and the client fetches that URL (kaggle 2.2.5 kernels_output: requests.get).
ESCAPES = {
    "%": "'%' reads as an escape in its URL: '..%2f' is '../'",
    "#": "'#' cuts its URL short (a fragment)",
    "?": "'?' cuts its URL short (a query)",
    "\\": "'\\' is a folder separator on Windows",
}
RENAME = "rename it with letters, digits, spaces and . _ -"


def name_problem(rel: str) -> str | None:
    """Why Kaggle's output listing cannot serve the file at `rel` (its path under the working folder, `/`
    between the parts), or None.

    Refused, with their sources: an absolute name and an empty, `.` or `..` part ([CODE] kaggle 2.2.5
    `kernels_output` raises on a name that resolves outside its download folder); `%`, `#` and `?` (ESCAPES:
    the listing's URL carries the name, and how Kaggle quotes it there is not known, so the worse case: the
    local Kaggle puts it in as it is); `\\` (the worse case: a Windows laptop's separator); a control character
    (the worse case: requests quotes one, http.client refuses one left in a URL); bytes that are not UTF-8
    (the listing is JSON text). Everything else is served (spaces and UTF-8 letters: requests quotes them in
    the URL and the server reads them back).
    """
    if not rel or rel.startswith("/"):
        return "an absolute name escapes the download folder"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"a {part!r} part escapes the download folder"
    for ch in rel:
        if ch in ESCAPES:
            return ESCAPES[ch]
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0:
            return f"a control character ({ch!r}) cannot go in a URL"
        if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for a byte that is not UTF-8
            return "it is not UTF-8, and the listing is JSON text"
    return None


def link_target(path: Path, working: Path) -> Path | None:
    """The plain file inside `working` that the link `path` points to (through any links), else None:
    a link outside the working folder, to a folder, or to nothing."""
    try:
        target = path.resolve(strict=True)
        inside = target.is_relative_to(working.resolve(strict=True))
        return target if inside and stat.S_ISREG(target.stat().st_mode) else None
    except (OSError, RuntimeError):  # dangling, or a loop of links
        return None


def problem(path: Path, working: Path) -> str | None:
    """Why the file at `path` (under `working`) cannot be served as it is and is not copied into a file
    that can be, or None: a name the listing refuses, a link to anything but a file inside the working
    folder, or something that is not a plain file (a socket, a pipe, a device)."""
    why = name_problem(path.relative_to(working).as_posix())
    if why is not None:
        return f"Kaggle's output listing cannot serve the name ({why}); {RENAME}"
    if path.is_symlink():
        if link_target(path, working) is not None:
            return None
        return (f"a link to {os.readlink(path)!r}, {_where(path, working)}: Kaggle's output cannot serve a link; "
                f"write the file itself under {working}")
    if not stat.S_ISREG(path.lstat().st_mode):
        return "not a plain file (a socket, a pipe or a device): Kaggle's output holds plain files only"
    return None


def _where(link: Path, working: Path) -> str:
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):
        return "which points to nothing"
    if not target.is_relative_to(working.resolve()):
        return "outside the working folder"
    return "a folder" if target.is_dir() else "not a plain file"


def tidy(working: Path) -> list[str]:
    """Make every file under `working` one Kaggle's output can serve: a link to a file inside it copied
    as that file (atomic: a `.tmp-` copy renamed over the link), anything `problem` names removed, a folder
    whose name the listing refuses removed whole. Returns the lines said, one per file or folder, each
    naming its whole path."""
    lines: list[str] = []
    if not working.is_dir():
        return lines
    scratch = working / layout.KCHAIN_DIR / layout.SCRATCH_DIR  # kchain's own links (a resume's): gone quietly
    for top, dirs, files in os.walk(working, followlinks=False):
        here = Path(top)
        dirs.sort()  # the lines in one order on any file system
        for name in list(dirs):
            path = here / name
            why = name_problem(path.relative_to(working).as_posix())
            if path.is_symlink():
                dirs.remove(name)
                files.append(name)  # a link to a folder: judged (and left out) as a link below
            elif why is not None:
                dirs.remove(name)
                count = sum(len(f) for _, _, f in os.walk(path))
                shutil.rmtree(path, ignore_errors=True)
                lines.append(f"left out the folder {str(path)!r} ({count} file{'s' * (count != 1)}): Kaggle's "
                             f"output listing cannot serve the name ({why}); {RENAME}")
        for name in sorted(files):
            try:
                line = _tidy_file(here / name, working)
                line = None if line is not None and here.is_relative_to(scratch) else line
            except OSError as exc:  # one file kchain cannot mend: said, and the others still looked over
                line = f"could not mend {str(here / name)!r} ({exc}); a fetch of the output may fail on it"
            if line is not None:
                lines.append(line)
    return lines


def _tidy_file(path: Path, working: Path) -> str | None:
    why = problem(path, working)
    if why is not None:
        path.unlink(missing_ok=True)
        return f"left out {str(path)!r}: {why}"
    target = link_target(path, working) if path.is_symlink() else None
    if target is None:
        return None
    copy = path.with_name(f"{layout.TMP_PREFIX}link-{os.getpid()}")
    shutil.copyfile(target, copy)
    os.replace(copy, path)
    return (f"copied {str(path)!r} as a file: it was a link to {str(target)!r}, and Kaggle's output cannot "
            "serve a link")


def main(argv: list[str]) -> int:
    """`python -m kchain.common.outputfiles [WORKING]`: tidy the working folder (KCHAIN_ROOT's, else
    /kaggle/working), one line for each file it copied or left out. Never fails the session."""
    working = Path(argv[1]) if len(argv) > 1 else layout.working_root(os.environ)
    try:
        lines = tidy(working)
    except OSError as exc:  # a tidy that cannot finish must not cost the session its publish
        lines = [f"could not look over {str(working)!r} ({exc}); a file Kaggle cannot serve may stop the fetch"]
    for line in lines:
        print(f"{PREFIX} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
