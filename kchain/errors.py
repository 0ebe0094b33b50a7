"""Every error kchain raises for a user to read.

Library code raises a subclass of KchainError with a one-line message that says what to do next;
cli.py turns it into a click error in one place. Special exit codes live here as class attributes
and are listed in the README.
"""

from __future__ import annotations


class KchainError(Exception):
    """A problem the user can fix; the message is one line and names the fix."""

    exit_code = 1


class UsageError(KchainError):
    """A value given on the command line that kchain's own check refuses: exit 2, as click's usage errors."""

    exit_code = 2


class SpecError(KchainError):
    """The job file is missing, unreadable or invalid; the message names the file, the key and the fix."""

    exit_code = 10  # not 2, which is click's for a usage error


class RenderError(KchainError):
    """The job could not be rendered into a notebook (e.g. its code file is missing)."""

    exit_code = 10


class SmokeFailed(KchainError):
    """The smoke run failed: a check, a crash, or a resume that did not match."""

    exit_code = 3


class NotSmoked(KchainError):
    """push refused: this exact code never passed a smoke run."""

    exit_code = 4

    @classmethod
    def for_job(cls, job_file: object) -> NotSmoked:
        return cls(f"this code has never passed a smoke run: run `kchain smoke {job_file}` first "
                   "(or --skip-smoke, recorded in the run log)")


class BudgetExceeded(KchainError):
    """push/continue refused: the week's GPU quota cannot cover the session."""

    exit_code = 5


class CredentialsError(KchainError):
    """Kaggle credentials are missing or were rejected."""

    exit_code = 6


class KaggleError(KchainError):
    """The Kaggle API (or the emulator) refused or failed a call."""

    exit_code = 7


class ChainStop(KchainError):
    """continue refused: a crash needs a human, or a session is still running."""

    exit_code = 8


class DoctorFailed(KchainError):
    """kchain doctor found a problem; a FAIL line in its checklist names the fix."""

    exit_code = 9


class ProbeFormatError(KchainError):
    """The doctor's probe wrote output that is not a document of the format this kchain reads."""


class StateError(KchainError):
    """A file kchain keeps (.kchain/sessions.json, runs.csv) is damaged; the message names it and
    how to recover. kchain refuses rather than rewrite it, so nothing recorded is lost."""

    exit_code = 1


class MachineError(KchainError):
    """This machine refused a file operation: no permission, a read-only or full disk, a missing folder."""

    exit_code = 11

    # errno -> what the user does about it
    FIXES = {
        "EACCES": "you may not write there: choose a folder you own, or fix its permissions",
        "EPERM": "you may not write there: choose a folder you own, or fix its permissions",
        "EROFS": "a read-only file system: choose a writable folder (e.g. KCHAIN_HOME for kchain's own files)",
        "ENOSPC": "the disk is full: free some space (old smoke and rehearse folders under KCHAIN_HOME are safe to "
                  "delete) and run the command again",
        "EDQUOT": "your disk quota is used up: free some space and run the command again",
        "ENOENT": "a folder on the way does not exist: check the path",
        "ENOTDIR": "a part of the path is a file, not a folder: check the path",
    }

    @classmethod
    def of(cls, exc: OSError) -> MachineError:
        """The OSError in one line: what failed, on which path, and the fix."""
        import errno

        name = errno.errorcode.get(exc.errno or 0, "")
        where = f": {exc.filename}" if exc.filename else ""
        fix = cls.FIXES.get(name, "check the path and the disk, then run the command again")
        return cls(f"{exc.strerror or type(exc).__name__}{where} ({fix})")


def exit_code_lines() -> list[str]:
    """`kchain --help`'s list of exit codes: 0, 1 and click's 2, then each code a class here has, with the
    first line of the class's doc."""
    classes: list[type[KchainError]] = []
    todo = [KchainError]
    while todo:
        cls = todo.pop(0)
        classes.append(cls)
        todo.extend(sub for sub in cls.__subclasses__() if sub.__module__ == __name__)
    lines = ["0   done", "1   any other error: the Error: line says why",
             "2   a usage error: an unknown command or option, or a bad value (click's)"]
    for cls in sorted((c for c in classes if c.exit_code > 2), key=lambda c: c.exit_code):
        doc = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
        lines.append(f"{cls.exit_code:<3} {doc} ({cls.__name__})")
    return lines
