"""A rehearsal proves the kept best too (issue 56): its planned sessions add saves and stops, but the job's
own cadence in steps stays, and the chain's kept best is compared with the uninterrupted run's."""

import yaml
from helpers import runtime_job

from kchain.local.rehearse import best_problem, rehearse


def test_the_chain_keeps_the_best_the_uninterrupted_run_keeps_at_the_jobs_own_cadence(tmp_path):
    job = runtime_job(tmp_path, "best_job", "main", "best", 1, None, {"steps": 40})
    spec = yaml.safe_load(job.read_text())
    spec["train"].update({"checkpoint_every": "8 steps", "keep": 2, "keep_best": "val_loss"})
    job.write_text(yaml.safe_dump(spec))
    # 3 spans of 40 steps: stops at 14 and 27, the plan's saves at 7, 20 and 33; none at 16, the best.
    result = rehearse(job, kills=1, ranks=1, echo=lambda _: None)
    assert result.passed, result.verdict
    assert "; the same best kept (step 16)" in result.verdict, result.verdict


def test_a_kept_best_that_differs_is_named_with_both_steps():
    ours = {"metric": "val_loss", "mode": "min", "value": 0.98, "step": 60}
    theirs = {"metric": "val_loss", "mode": "min", "value": 0.099, "step": 40}
    differs = best_problem((theirs, ours))
    assert differs is not None
    assert differs.startswith(
        "the kept best differs: the chain kept step 60 (val_loss 0.98), the uninterrupted run step 40 (val_loss 0.099)")
    assert best_problem((theirs, dict(theirs))) is None
    assert best_problem((None, ours)) is None  # no checkpoint to read: the other checks say why
