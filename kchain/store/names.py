"""Names kchain derives from a job's name, and whether Kaggle can hold them.

A chain uses three Kaggle names: the kernel `<owner>/<name>` and the datasets `<owner>/<name>-state`
and `<owner>/<name>-cache` (and `<owner>/<name>-pip` for `kaggle.pip`, shorter than both, and the doctor's CPU kernel `<owner>/<name>-doctor`, an unattended chain's relay). Kaggle's dataset slugs are 6 to 50 characters, so a name longer than
50 - len("-state") = 44 characters cannot carry its state. spec.py may call `name_problem` to
refuse such a name when the job is loaded; push and continue call it before creating anything.
"""

from __future__ import annotations

from kchain.common.layout import CACHE_SUFFIX, PIP_SUFFIX, STATE_SUFFIX

DATASET_SLUG_MIN, DATASET_SLUG_MAX = 6, 50  # Kaggle's dataset slug limits
SUFFIXES = (STATE_SUFFIX, CACHE_SUFFIX)
MAX_NAME = DATASET_SLUG_MAX - max(len(s) for s in SUFFIXES)


def state_dataset(owner: str, name: str) -> str:
    """`<owner>/<name>-state`: the dataset each session's end state is versioned into."""
    return f"{owner}/{name}{STATE_SUFFIX}"


def cache_dataset(owner: str, name: str) -> str:
    """`<owner>/<name>-cache`: the data staged by run.stage, versioned when it changes."""
    return f"{owner}/{name}{CACHE_SUFFIX}"


def pip_dataset(owner: str, name: str) -> str:
    """`<owner>/<name>-pip`: the wheels of `kaggle.pip`, a version each time the pins or the kernel's Python change."""
    return f"{owner}/{name}{PIP_SUFFIX}"


def doctor_kernel(owner: str, name: str) -> str:
    """`<owner>/<name>-doctor`: the doctor's CPU kernel (quick save, probe), and an unattended chain's relay
    (common/relay.py: the kernel whose Secrets and kernel push the doctor proved), within 50 characters."""
    return f"{owner}/{name[:43].rstrip('-')}-doctor"


def name_problem(name: str) -> str | None:
    """Why Kaggle cannot hold this job's datasets (one clause naming the limit), or None."""
    longest = max((name + s for s in SUFFIXES), key=len)
    if len(longest) > DATASET_SLUG_MAX:
        return (f"{name!r} is {len(name)} characters, so its dataset {longest!r} would be {len(longest)}; Kaggle's "
                f"dataset slugs are {DATASET_SLUG_MIN}-{DATASET_SLUG_MAX} characters: shorten name to at most "
                f"{MAX_NAME} characters")
    return None
