"""State the job did not hand to run.track (issue 55): refused at the smoke's first step by its kind,
compared at every save whatever its kind, excluded only on purpose; per-rank buffers resumed exactly.
Real notebooks, real kills, tiny models (tests/runtime_jobs/forgotten_job.py)."""

import json
from pathlib import Path

import pytest
from helpers import error_line, invoke, runtime_job

FIX = "if a resume rebuilds it exactly)"


def forgotten(tmp_path: Path, entry: str, **params) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return runtime_job(tmp_path, "forgotten_job", entry, "forgot", "auto", None, {"steps": 6, **params})


@pytest.mark.parametrize(("entry", "named"), [
    # not a module: diffusers' shape, a list of shadow tensors
    ("ema_list", "ema_model (an EMA: diffusers' EMAModel) is state the training keeps, but no checkpoint holds it: "
                 "a resume would start it over; add run.track(ema_model=ema_model) before the loop"),
    # updated every 32 steps: unchanged in the smoke's steps, refused by its kind
    ("averaged", "model_ema (an EMA: torch.optim.swa_utils.AveragedModel) is state the training keeps"),
    # an object of no EMA kind is refused when it changes: inside a list, named as the code writes it
    ("generator_in_list", "gens[0] (Generator) changes between steps but no checkpoint holds it: a resume "
                          "would start it over; add run.track(gens=gens[0]) before the loop"),
])
def test_forgotten_state_stops_the_smoke_naming_it(tmp_path, entry, named):
    result = invoke("smoke", forgotten(tmp_path, entry), "--quiet")
    assert result.exit_code == 3, result.output
    line = error_line(result)
    assert line.startswith("Error: smoke failed (during step): UntrackedState: "), line
    assert "  hint: state no checkpoint holds" in result.output
    assert named in line and line.endswith(FIX), line
    assert "PASS" not in result.output


def test_an_ema_of_no_known_kind_is_found_by_its_tensors_and_tracked_as_a_list(tmp_path):
    result = invoke("smoke", forgotten(tmp_path / "a", "shadow"), "--quiet")
    assert result.exit_code == 3, result.output
    assert error_line(result).startswith(
        "Error: smoke failed (during step): UntrackedState: avg.params (list) changes between steps but no "
        "checkpoint holds it: a resume would start it over; add run.track(params=avg.params) before the loop")
    tracked = invoke("smoke", forgotten(tmp_path / "b", "shadow", track=1))
    assert tracked.exit_code == 0, tracked.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in tracked.output


def test_state_excluded_on_purpose_passes_and_the_verdict_lists_it(tmp_path):
    result = invoke("smoke", forgotten(tmp_path, "shadow", untrack=1))
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "excluded: avg (rebuilt from the weights)" in result.output


def test_batchnorm_buffers_of_each_rank_are_saved_per_rank_and_resumed_exactly(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("KCHAIN_HOME", str(home))
    result = invoke("smoke", forgotten(tmp_path, "batchnorm"))
    assert result.exit_code == 0, result.output
    assert "2 ranks (gloo, CPU)" in result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    # Each rank's running statistics are in the checkpoint, and the verdict compared rank 1's too.
    digests = json.loads(next(home.glob("smoke/*/reference/working/kchain/checkpoints/*/digests.json")).read_text())
    ones = {k.removeprefix("ranks.1.buffers.") for k in digests if k.startswith("ranks.1.buffers.model.")}
    assert {"model.1.running_mean", "model.1.running_var"} <= ones, sorted(digests)
    assert digests["ranks.0.buffers.model.1.running_mean"] != digests["ranks.1.buffers.model.1.running_mean"]


@pytest.mark.slow
def test_rehearse_fails_forgotten_state_of_no_known_kind_naming_it(tmp_path):
    # A rehearsal's sessions do not watch for change (a smoke does): the digests of the untracked state at
    # each save, compared with the uninterrupted run's, are what see it. 12 steps in 3 planned sessions.
    from kchain.local.rehearse import rehearse

    result = rehearse(forgotten(tmp_path, "shadow", steps=12), kills=1, ranks=1, echo=lambda _: None)
    assert not result.passed
    assert result.verdict.startswith("the state differs: avg.params.0 differs at step "), result.verdict
    assert "avg.params is not in run.track, and it differs after the resume" in result.verdict
    assert "add run.track(params=avg.params) before the loop" in result.verdict
