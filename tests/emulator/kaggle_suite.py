"""Kaggle's own backend tests against the emulator: what is in scope, the public catalogue they assume, and the
runner that test_kaggle_suite.py starts in a process of its own (the suite imports `kaggle`, which reads its
environment once, at import).

    python tests/emulator/kaggle_suite.py run TESTS CATALOGUE STATE RESULT   # TESTS: the sdist's tests/ folder
    python tests/emulator/kaggle_suite.py catalogue tests/fixtures/kaggle-catalogue   # write the fixture again

Nothing of Kaggle's is kept here: the suite comes from the pinned client's sdist at test time. Its fixed waits
(30 s after a push, 10 s after a create, 5 s between status polls) end as soon as the emulator has nothing in
flight (`Emulator.wait_settled`), never later than the suite's own seconds: the emulator runs its strict
defaults, lags and queues included, and only the idle part of each wait is cut.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import sys
import time
import unittest
from pathlib import Path
from typing import Any

# The suite's user (KAGGLE_USERNAME): the catalogue's most-voted dataset is theirs, since the suite updates the
# metadata of whichever dataset `kaggle datasets list --sort-by votes` names first.
USER = "kaggle-suite"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kaggle-catalogue"
# The suite's tests kchain does not serve, by the start of their name, each with its reason. Every other test
# of the suite is in scope: one a new pin of the client adds is held to the emulator too.
OUT_OF_SCOPE = {
    "test_competition_": "competitions (list, submit, leaderboards, topics): kchain never enters or submits to "
                         "one; a competition is only a source a kernel mounts (`kchain emulator serve --competition`)",
    "test_forums_": "forums and discussions: no part of a training workflow",
    "test_files_upload": "the inbox upload: no part of a training workflow (and it returns at once unless edited)",
}
SUITES = (("backend", "backend_tests", "TestKaggleApi"), ("integration", "test_models", "TestModels"))


def out_of_scope(name: str) -> str | None:
    """Why test method `name` is out of scope, or None when the emulator must pass it."""
    return next((why for start, why in OUT_OF_SCOPE.items() if name.startswith(start)), None)


# -- the catalogue the suite assumes --------------------------------------------------------------------

def _json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _kernel(folder: Path, ref: str, title: str, votes: int, created: str) -> None:
    slug = ref.split("/")[1]
    notebook = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                           "source": "print('a public notebook of the catalogue')"}],
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (folder / ref).mkdir(parents=True, exist_ok=True)
    (folder / ref / f"{slug}.ipynb").write_text(json.dumps(notebook, indent=1) + "\n")
    _json(folder / ref / "kernel-metadata.json", {
        "id": ref, "id_no": 0, "title": title, "code_file": f"{slug}.ipynb", "language": "python",
        "kernel_type": "notebook", "is_private": False, "enable_gpu": False, "enable_tpu": False,
        "enable_internet": True, "keywords": [], "dataset_sources": [], "kernel_sources": [],
        "competition_sources": [], "model_sources": [], "docker_image": None, "machine_shape": None,
        "totalVotes": votes, "created": created})


def write_catalogue(folder: Path) -> None:
    """The public objects the suite reads but does not make, each the smallest that satisfies it."""
    kernels, datasets, models = folder / "kernels", folder / "datasets", folder / "models"
    _kernel(kernels, "stevemessick/a-public-notebook", "A public notebook", 3, "2024-06-11")
    _kernel(kernels, "kerneler/sqlite-global-default", "SQLite global default", 12, "2020-02-02")
    output = kernels / "kerneler/sqlite-global-default/output"
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.csv").write_text("id,value\n1,0.5\n")
    log = [{"stream_name": "stdout", "time": 0.5, "data": "a public notebook of the catalogue\n"}]
    (output / "sqlite-global-default.log").write_text(json.dumps(log) + "\n")
    top = datasets / USER / "most-voted-dataset"
    _json(top / "dataset-metadata.json", {
        "datasetId": 100, "datasetSlug": "most-voted-dataset", "ownerUser": USER, "title": "Most voted dataset",
        "subtitle": "The catalogue's most voted public dataset", "description": "Two rows of fruit.",
        "isPrivate": False, "licenses": [{"name": "CC0-1.0"}], "keywords": [], "totalVotes": 1000,
        "totalViews": 5000, "totalDownloads": 800, "usabilityRating": 1.0, "created": "2021-03-04"})
    (top / "1").mkdir(parents=True, exist_ok=True)
    (top / "1" / "data.csv").write_text("id,fruit\n1,apple\n2,banana\n")
    for n in range(1, 13):  # `datasets list --file-type bigQuery --license other` finds more than ten
        _json(datasets / "bigquery" / f"public-table-{n:02d}" / "dataset-metadata.json", {
            "datasetId": 200 + n, "datasetSlug": f"public-table-{n:02d}", "ownerUser": "bigquery",
            "title": f"Public table {n:02d}", "isPrivate": False, "licenses": [{"name": "other"}],
            "totalVotes": n, "bigQuery": True, "created": "2019-01-01"})
    bert = models / "keras" / "bert"
    _json(bert / "model-metadata.json", {  # tests/integration/test_models.py: keras/bert has id 2819
        "id": 2819, "ownerSlug": "keras", "slug": "bert", "title": "BERT", "subtitle": "A public model",
        "isPrivate": False, "description": "# BERT\n", "publishTime": "", "voteCount": 100, "created": "2023-11-01"})
    _json(bert / "keras" / "bert_base_en" / "model-instance-metadata.json", {
        "id": 3000, "ownerSlug": "keras", "modelSlug": "bert", "instanceSlug": "bert_base_en", "framework": "keras",
        "overview": "", "usage": "", "licenseName": "Apache 2.0", "fineTunable": True, "trainingData": []})
    (bert / "keras" / "bert_base_en" / "1").mkdir(parents=True, exist_ok=True)
    (bert / "keras" / "bert_base_en" / "1" / "config.json").write_text('{"layers": 12}\n')
    (folder / "README.md").write_text(README)


README = f"""# The public catalogue Kaggle's own backend tests assume

Written by `python tests/emulator/kaggle_suite.py catalogue tests/fixtures/kaggle-catalogue` (edit that
function, not these files: tests/emulator/test_kaggle_suite.py checks they match). The emulator seeds it with
`Emulator(..., catalogue=FOLDER)`, or `kchain emulator serve --state S` with it copied to `S/catalogue/`; its
layout is in docs/emulator.md ("A public catalogue"). What the suite (kaggle 2.2.5's sdist) reads:

- `kernels/stevemessick/`: `kernels_list(user="stevemessick", language="python")` finds one or more.
- `kernels/kerneler/sqlite-global-default/`: `kernels_output` of another user's public kernel.
- `datasets/{USER}/most-voted-dataset/`: `dataset_list(sort_by="votes")` names it first; the suite then reads its
  metadata, files and version 1 and updates its metadata, so it belongs to the suite's user, `{USER}`.
- `datasets/bigquery/`: `dataset_list(license_name="other", file_type="bigQuery")` finds more than ten.
- `models/keras/bert/`: `model_list()` finds one or more; `model_get("keras/bert").id` is 2819.
"""


# -- the runner ------------------------------------------------------------------------------------------

class SuiteClock:
    """`time` as the suite's module sees it: a fixed wait ends once the emulator has nothing in flight."""

    def __init__(self, settle: Any) -> None:
        self._settle = settle

    def sleep(self, seconds: float) -> None:
        self._settle(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class Recorder(unittest.TextTestResult):
    """A text result that also keeps each test's outcome and first line of failure."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, str]] = {}

    def _keep(self, test: unittest.TestCase, outcome: str, why: str = "") -> None:
        self.outcomes[test.id()] = {"scope": "in", "outcome": outcome, "why": why}

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's names
        super().addSuccess(test)
        self._keep(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._keep(test, "failed", f"{err[0].__name__}: {str(err[1]).splitlines()[0] if str(err[1]) else ''}")

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self._keep(test, "error", f"{err[0].__name__}: {str(err[1]).splitlines()[0] if str(err[1]) else ''}")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._keep(test, "skipped", reason)


def run(tests: Path, catalogue: Path, state: Path, result: Path) -> None:
    """Serve the emulator (strict defaults, the catalogue seeded), run the suite's in-scope tests against it in
    this process, and write each test's outcome (and each out-of-scope one with its reason) to `result`."""
    from kchain.emulator import Emulator
    from kchain.local.executor import (
        start_session,  # sessions driven from a thread, as the tests' emulator fixture's
    )

    emu = Emulator(state, users={USER: secrets.token_hex(16)}, catalogue=catalogue, start_notebook=start_session)
    emu.start()
    os.environ.update(emu.env(USER))  # before the suite imports kaggle
    try:
        outcomes = _run_suites(tests, emu.wait_settled)
    finally:
        emu.stop()
    result.write_text(json.dumps(outcomes, indent=1))


def _run_suites(tests: Path, settle: Any) -> dict[str, dict[str, str]]:
    os.chdir(tests / "backend")  # the suite's paths are relative to its folder
    sys.path[:0] = [str(tests / folder) for folder, _, _ in SUITES]
    chosen, outcomes = unittest.TestSuite(), {}
    for _, module_name, case in SUITES:
        module = importlib.import_module(module_name)
        if hasattr(module, "time"):
            vars(module)["time"] = SuiteClock(settle)
        for test in unittest.defaultTestLoader.loadTestsFromTestCase(getattr(module, case)):
            assert isinstance(test, unittest.TestCase)  # a case's suite holds its tests, no nested suite
            why = out_of_scope(test.id().rsplit(".", 1)[1])
            if why:
                outcomes[test.id()] = {"scope": "out", "outcome": "not run", "why": why}
            else:
                chosen.addTest(test)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Recorder)
    recorded = runner.run(chosen)
    assert isinstance(recorded, Recorder)
    return {**outcomes, **recorded.outcomes}


if __name__ == "__main__":
    if sys.argv[1:2] == ["catalogue"] and len(sys.argv) == 3:
        write_catalogue(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 6:
        run(*(Path(a).resolve() for a in sys.argv[2:]))
    else:
        sys.exit(__doc__)
