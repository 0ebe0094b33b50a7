# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""`kchain doctor`'s quick save whose answer is lost: settled from the kernel's versions, as a push is,
never reported as a failure and never saved twice."""

from __future__ import annotations

from emulator_helpers import USER, emulator  # noqa: F401
from helpers import copy_job, invoke

DOCTOR_REF = f"{USER}/tinygpt-notes-doctor"


def test_a_quick_save_whose_answer_is_lost_is_settled_from_the_kernels_versions(emulator, tmp_path):
    job = copy_job("tinygpt", tmp_path)
    emulator.faults.fail_after_save = 1  # the quick save creates the version, then answers 500
    result = invoke("doctor", job, "--no-probe")
    assert result.exit_code == 0, result.output
    assert (f"warn  metadata     the job's notebook was saved as {DOCTOR_REF} version 1 without running, but "
            "Kaggle's answer was lost: which sources it calls invalid is unknown; run "
            f"`kchain doctor {job}` again to see them") in result.output
    assert emulator.calls["SaveKernel"] == 1 and [s["version"] for s in emulator.sessions()] == [1]
