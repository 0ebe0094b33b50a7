""""Bit for bit" means the state (issue 39): the smoke and rehearse compare every value of the saved
state at every step both runs saved, not only what the job logs; state the job forgot is named; each
rank keeps its own state; the loader takes the GPU branches' arguments.

The jobs are tests/runtime_jobs/state_job.py, the held-out shapes the issue found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import error_line, invoke, runtime_job

from kchain.common import layout
from kchain.local import statecheck
from kchain.local.rehearse import rehearse

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
EPOCHS = {"epochs": 2, "rows": 40}  # 5 batches an epoch: the smoke's kill after step 3 is mid-epoch


def state_job(tmp_path: Path, entry: str, gpus=1, **params) -> Path:
    return runtime_job(tmp_path, "state_job", entry, "state", gpus, None, params)


# --- 1. the verdict compares the state -------------------------------------------------------------------

def test_an_ema_counted_by_a_restarting_batch_index_fails_the_smoke_though_the_losses_agree(tmp_path):
    # torchvision's reference counts EMA updates with `i` from enumerate(loader): after the mid-epoch
    # resume `i` starts at 0 again and the EMA is updated once too often. No logged value moves.
    result = invoke("smoke", state_job(tmp_path, "ema", count="enumerate", **EPOCHS), "--quiet")
    assert result.exit_code == 3, result.output
    line = error_line(result)
    assert line.startswith("Error: smoke failed (during resume): StateMismatch: model_ema.module."), line
    assert " differs at step 6 (largest " in line and line.endswith("; the logged values agree")
    assert "  hint: model_ema differs while the optimizer's state agrees" in result.output
    assert "`enumerate(loader)` starts at 0 again" in result.output
    assert "PASS" not in result.output


def test_the_ema_counted_by_the_step_with_the_gpu_branch_loader_arguments_passes_state_and_trace(tmp_path):
    # The fix, and pytorch/examples' CUDA-only loader arguments (pin_memory, persistent_workers,
    # prefetch_factor, a worker) taken as they are on the CPU.
    result = invoke("smoke", state_job(tmp_path, "ema", count="step", gpu_args=True, **EPOCHS), "--quiet")
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit, state and trace" in result.output
    assert " values equal at steps 3, 6 (every tracked tensor" in result.output


@pytest.mark.slow
def test_rehearse_fails_the_same_ema_naming_it_though_the_chained_trace_is_identical(tmp_path):
    # 20 steps in 3 planned sessions (stops at 7 and 14, mid-epoch: resumes at batch 2 and 4 of 5) and a
    # kill; an update every 3 batches: every mid-epoch resume restarts the
    # batch index, the logged losses still agree, and the final EMA weights do not.
    result = rehearse(state_job(tmp_path, "ema", count="enumerate", ema_steps=3, epochs=4, rows=40), kills=1, ranks=1,
                      echo=lambda _: None)
    assert not result.passed
    assert result.verdict.startswith("the state differs: model_ema.module."), result.verdict
    assert "; the logged values agree: model_ema differs while the optimizer's state agrees" in result.verdict


# --- 2. state the job forgot ---------------------------------------------------------------------------

def test_an_untracked_ema_and_an_untracked_wrapped_model_fail_naming_run_track(tmp_path):
    job = state_job(tmp_path, "ema", track_ema=False, track_model=False, ema_steps=1, **EPOCHS)
    result = invoke("smoke", job, "--quiet")
    assert result.exit_code == 3, result.output
    line = error_line(result)
    assert line.startswith("Error: smoke failed (during step): UntrackedState: "), line
    # The EMA is refused by its kind at the first step, before either has changed (issue 55).
    assert "model_ema (an EMA: torch.optim.swa_utils.AveragedModel) is state the training keeps, but no " \
           "checkpoint holds it" in line
    assert "run.track(model_ema=model_ema)" in line


# --- 3. per-rank state ---------------------------------------------------------------------------------

def test_each_rank_resumes_its_own_prefetched_batch(tmp_path):
    # A tracked object of the job's own holds each rank's next batch: its state differs between the
    # ranks, so each rank's copy is saved and given back to that rank (rank 0's copy for both differs).
    result = invoke("smoke", state_job(tmp_path, "prefetch", gpus="auto", steps=6), "--quiet")
    assert result.exit_code == 0, result.output
    assert "2 ranks (gloo, CPU)" in result.output
    assert "bit for bit, state and trace" in result.output


# --- the comparison itself, on digests ----------------------------------------------------------------------

def _ckpt(root: Path, step: int, digests: dict) -> None:
    d = root / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / layout.checkpoint_name(step)
    d.mkdir(parents=True)
    (d / layout.MANIFEST).write_text(f'{{"step": {step}}}')
    (d / layout.DIGESTS).write_text(__import__("json").dumps(digests))


@pytest.mark.parametrize(("ref", "got", "says", "cause"), [
    ({"tracked.model.w": "a", "tracked.optimizer.state.0.exp_avg": "m", "rng.torch": "r"},
     {"tracked.model.w": "a", "tracked.optimizer.state.0.exp_avg": "m", "rng.torch": "r"}, None, None),
    ({"tracked.model_ema.module.w": "a", "tracked.optimizer.state.0.exp_avg": "m"},
     {"tracked.model_ema.module.w": "b", "tracked.optimizer.state.0.exp_avg": "m"},
     "model_ema.module.w differs at step 4", "enumerate(loader)"),
    ({"rng.numpy.1": "a", "tracked.model.w": "w"}, {"rng.numpy.1": "b", "tracked.model.w": "w"},
     "global numpy.1 RNG state differs at step 4", "only the global RNG state differs"),
    ({"ranks.1.tracked.ahead.next.0": "a"}, {"ranks.1.tracked.ahead.next.0": "b"},
     "rank 1's ahead.next.0 differs at step 4", "ahead differs"),
    ({"tracked.model.w": "a"}, {}, "model.w differs at step 4", "model"),  # a value one run lacks differs
])
def test_the_comparison_names_the_first_differing_value_and_its_likely_cause(tmp_path, ref, got, says, cause):
    _ckpt(tmp_path / "ref", 4, ref)
    _ckpt(tmp_path / "run", 4, got)
    _ckpt(tmp_path / "run", 2, ref)  # a step the reference did not save: not compared
    found = statecheck.compare(statecheck.saved([statecheck.checkpoints_of(tmp_path / "ref")]),
                               statecheck.saved([statecheck.checkpoints_of(tmp_path / "run")]))
    assert found.steps == (4,)
    if says is None:
        assert found.first is None and found.values == 3
        return
    assert found.first is not None
    assert statecheck.describe(found.first, {}, traces_agree=True).startswith(says)
    assert cause in statecheck.cause(found, resume_step=2, traces_agree=True)
    assert "before any resume" in statecheck.cause(found, resume_step=4)


def test_a_checkpoint_carries_the_digest_of_every_value_it_holds(tmp_path):
    import torch

    from kchain.runtime.checkpoint.statedigest import digest_state, largest_differences

    state: dict[str, Any] = {
        "step": 3, "tracked": {"model": {"w": torch.arange(4.0), "flag": torch.tensor(True)},
                               "sched": {"last_epoch": 3, "_last_lr": [0.1]}},
        "rng": {"python": (3, tuple(range(625)), None)}, "metrics": {"loss": 1.0}, "best": None}
    digests = digest_state(state)
    assert set(digests) == {"step", "tracked.model.w", "tracked.model.flag", "tracked.sched.last_epoch",
                            "tracked.sched._last_lr.0", "rng.python.0", "rng.python.1", "rng.python.2"}
    assert digests["tracked.model.w"].startswith("float32[4]:") and digests["step"] == "3"
    moved = {**state, "tracked": {**state["tracked"], "model": {"w": torch.arange(4.0) + 1e-3,
                                                                 "flag": torch.tensor(True)}}}
    assert digest_state(moved)["tracked.model.w"] != digests["tracked.model.w"]
    for name, s in (("a", state), ("b", moved)):
        (tmp_path / name).mkdir()
        torch.save(s, tmp_path / name / layout.STATE_FILE)
    far = largest_differences(tmp_path / "a", tmp_path / "b", ["tracked.model.w", "tracked.sched.last_epoch"])
    assert far["tracked.model.w"] == pytest.approx(1e-3, rel=1e-3) and far["tracked.sched.last_epoch"] == 0.0


def test_an_ema_built_when_the_entry_is_imported_is_watched_like_one_built_in_main(tmp_path):
    # The runtime sets what its imports made outside the collector's passes before it imports the code
    # (launch._freeze_imports): what the code builds at its own import must still be walked.
    job = runtime_job(tmp_path, "import_job", "main", "state", 1, None, {})
    result = invoke("smoke", job, "--quiet")
    assert result.exit_code == 3, result.output
    line = error_line(result)
    assert line.startswith("Error: smoke failed (during step): UntrackedState: "), line
    assert "net_ema (an EMA: torch.optim.swa_utils.AveragedModel) is state the training keeps" in line, line
    assert "run.track(net_ema=net_ema)" in line, line


def test_a_value_without_a_digest_is_neither_a_difference_nor_counted_as_compared(tmp_path):
    """A live CUDA tensor streamed to the file has no digest: the verdict says it was not compared."""
    _ckpt(tmp_path / "ref", 4, {"tracked.model.w": "float32[4]:unhashed", "rng.torch": "r"})
    _ckpt(tmp_path / "run", 4, {"tracked.model.w": "float32[4]:unhashed", "rng.torch": "r"})
    found = statecheck.compare(statecheck.saved([statecheck.checkpoints_of(tmp_path / "ref")]),
                               statecheck.saved([statecheck.checkpoints_of(tmp_path / "run")]))
    assert found.first is None and (found.values, found.unhashed) == (1, 1) and not found.whole
    assert found.counted() == "1 value; 1 more, tensors streamed from the GPU without a digest, not compared"


# --- equal state compares equal; hints from what differs (issue 55) -------------------------------------

def _compared(ref: dict, got: dict, step: int = 4) -> statecheck.Comparison:
    return statecheck.compare({step: statecheck.Saved(step, Path("ref"), ref)},
                              {step: statecheck.Saved(step, Path("run"), got)})


def _loader(prefix: str, epoch: int, position: int, batches: int | None) -> dict:
    return {f"{prefix}.epoch": str(epoch), f"{prefix}.position": str(position), f"{prefix}.seed": "0",
            f"{prefix}.batches": str(batches)}


TWO_RANKS = {"ranks.0.rank": "0", "ranks.1.rank": "1", "ranks.0.rng.torch": "r0", "ranks.1.rng.torch": "r1"}


def test_a_loader_at_the_end_of_an_epoch_equals_one_at_the_start_of_the_next(tmp_path):
    # One batch an epoch: the reference saved step 2 as (epoch 1, position 1), the resumed run as (2, 0).
    ref = {**_loader("tracked.loader", 1, 1, 1), **_loader("ranks.1.tracked.loader", 1, 1, 1), "step": "2"}
    got = {**_loader("tracked.loader", 2, 0, 1), **_loader("ranks.1.tracked.loader", 2, 0, 1), "step": "2"}
    found = _compared(ref, got, step=2)
    assert found.first is None and found.values == 9


@pytest.mark.parametrize(("ref", "got", "says"), [
    (_loader("tracked.loader", 1, 3, 5), _loader("tracked.loader", 1, 4, 5), "loader.position differs at step 4"),
    (_loader("ranks.1.tracked.loader", 1, 5, 5), _loader("ranks.1.tracked.loader", 1, 0, 5),
     "rank 1's loader.epoch differs at step 4"),
    # a stream's length is unknown: the end of its epoch is not known either
    (_loader("tracked.loader", 1, 1, None), _loader("tracked.loader", 2, 0, None), "loader.epoch differs"),
])
def test_a_loader_at_another_position_still_differs_and_the_hint_says_it_is_read_more_often(ref, got, says):
    found = _compared({**ref, "tracked.model.w": "w"}, {**got, "tracked.model.w": "w"})
    assert found.first is not None
    assert statecheck.describe(found.first, {}, traces_agree=True).startswith(says)
    hint = statecheck.cause(found, resume_step=2)
    assert "'s position differs: the resumed run reads " in hint and "a different number of times" in hint, hint
    assert "not deterministic" not in hint


def test_only_a_loader_shaped_group_is_put_in_the_canonical_form():
    # an object of the job's own with the same leaves and one more is compared as it is
    ref = {**_loader("tracked.sampler", 1, 1, 1), "tracked.sampler.offset": "3"}
    got = {**_loader("tracked.sampler", 2, 0, 1), "tracked.sampler.offset": "3"}
    assert _compared(ref, got).first is not None


SCHEDULER = {"last_epoch": "3", "base_lrs.0": "0.1", "_last_lr.0": "0.05"}


def _scheduler(prefix: str, **values) -> dict:
    return {f"{prefix}.lr_scheduler.{k}": v for k, v in {**SCHEDULER, **values}.items()}


@pytest.mark.parametrize("reference_per_rank", [True, False])
def test_an_object_saved_per_rank_in_one_run_and_once_in_the_other_is_compared_by_value(reference_per_rank):
    # timm's scheduler: found to differ between the ranks in one run (saved per rank), not in the other
    # (saved once: equal on every rank).
    per_rank = {**TWO_RANKS, **_scheduler("tracked"), **_scheduler("ranks.0.tracked"), **_scheduler("ranks.1.tracked")}
    once = {**TWO_RANKS, **_scheduler("tracked")}
    found = _compared(per_rank, once) if reference_per_rank else _compared(once, per_rank)
    assert found.first is None, found.first
    assert found.values == len(per_rank)


def test_a_rank_whose_own_value_differs_from_the_single_one_still_fails_naming_that_rank():
    per_rank = {**TWO_RANKS, **_scheduler("tracked"), **_scheduler("ranks.0.tracked"),
                **_scheduler("ranks.1.tracked", last_epoch="4")}
    found = _compared(per_rank, {**TWO_RANKS, **_scheduler("tracked")})
    assert found.first is not None and found.first.keys == ("ranks.1.tracked.lr_scheduler.last_epoch",)
    line = statecheck.describe(found.first, {}, traces_agree=True)
    assert line == "rank 1's lr_scheduler.last_epoch differs at step 4; the logged values agree"


TRAINED = {"tracked.model.w": "w", "tracked.optimizer.state.0.exp_avg": "m", "tracked.optimizer.param_groups.0.lr": "0.1"}


@pytest.mark.parametrize(("key", "named", "fix"), [
    ("untracked.self/ema.shadow_params.0", "self.ema", "run.track(ema=self.ema)"),
    ("untracked.ema_model.decay", "ema_model", "run.track(ema_model=ema_model)"),
    ("untracked.gens[0].state", "gens[0]", "run.track(gens=gens[0])"),
    ("untracked.self/state['ema'].module.0.weight", "self.state['ema']", "run.track(ema=self.state['ema'])"),
])
def test_an_untracked_object_that_differs_is_named_as_the_code_names_it_with_its_run_track_fix(key, named, fix):
    found = _compared({**TRAINED, key: "a"}, {**TRAINED, key: "b"})
    assert found.first is not None and statecheck.objects(found.first.keys) == [named]
    leaf = key.split(".", 2)[2]
    assert statecheck.describe(found.first, {}, traces_agree=True).startswith(f"{named}.{leaf} differs at step 4")
    assert statecheck.cause(found, resume_step=2) == (
        f"{named} is not in run.track, and it differs after the resume (a resume starts it over): add {fix} "
        "before the loop")


def test_an_untracked_object_is_named_first_when_tracked_state_differs_with_it():
    # a forgotten generator drives dropout: the model differs because the generator was started over
    ref = {**TRAINED, "untracked.self/gen.0": "a"}
    got = {**TRAINED, "tracked.model.w": "v", "untracked.self/gen.0": "b"}
    found = _compared(ref, got)
    assert found.first is not None and statecheck.name(found.first.keys[0]) == "self.gen.0"
    assert "add run.track(gen=self.gen) before the loop" in statecheck.cause(found, resume_step=2)


def test_what_the_job_excluded_is_listed_with_its_reason_and_never_differs():
    reason = "frozen, rebuilt from the hub"
    ref = {**TRAINED, "excluded.self/teacher": reason}
    for got in ({**TRAINED, "excluded.self/teacher": reason}, {**TRAINED, "excluded.self/teacher": "another"},
                TRAINED):
        found = _compared(ref, got)
        assert found.first is None and found.values == len(TRAINED)
        assert found.excluded == (statecheck.Excluded("self.teacher", reason),)
        assert found.excluded_note() == "excluded: self.teacher (frozen, rebuilt from the hub)"
    assert _compared(TRAINED, TRAINED).excluded_note() == ""


def _bn(prefix: str, mean: str) -> dict:
    return {f"{prefix}.model.bn.weight": "w", f"{prefix}.model.bn.running_mean": mean,
            f"{prefix}.model.bn.num_batches_tracked": "6"}


@pytest.mark.parametrize(("ref", "got", "rank"), [
    # the reference saved the model per rank (its buffers differ between ranks), the resumed run once:
    # rank 1 resumed with rank 0's statistics
    ({**_bn("tracked", "m0"), **_bn("ranks.0.tracked", "m0"), **_bn("ranks.1.tracked", "m1")},
     _bn("tracked", "m0"), "rank 1"),
    # both saved from rank 0 only; `--dist-bn reduce` averaged rank 1's other statistics into rank 0's
    (_bn("tracked", "m0"), _bn("tracked", "m2"), "rank 0"),
])
def test_batchnorm_buffers_that_differ_on_one_rank_get_the_per_rank_hint(ref, got, rank):
    optimizer = {"tracked.optimizer.state.0.exp_avg": "m"}
    found = _compared({**TWO_RANKS, **optimizer, **ref}, {**TWO_RANKS, **optimizer, **got})
    assert found.first is not None and found.ranks == 2
    hint = statecheck.cause(found, resume_step=2)
    assert hint.startswith(f"model's BatchNorm buffers differ on {rank} ("), hint
    assert "BatchNorm buffers differ between ranks (DDP without SyncBatchNorm keeps each rank's own)" in hint
    assert "kchain_per_rank = True" in hint


def test_running_statistics_on_one_process_or_with_the_weights_are_not_blamed_on_the_ranks():
    optimizer = {"tracked.optimizer.state.0.exp_avg": "m"}
    one = _compared({**optimizer, **_bn("tracked", "m0")}, {**optimizer, **_bn("tracked", "m1")})
    assert "BatchNorm" not in statecheck.cause(one, resume_step=2)
    moved = {**_bn("tracked", "m1"), "tracked.model.bn.weight": "v"}
    both = _compared({**TWO_RANKS, **optimizer, **_bn("tracked", "m0")}, {**TWO_RANKS, **optimizer, **moved})
    assert "BatchNorm" not in statecheck.cause(both, resume_step=2)


@pytest.mark.parametrize(("optimizer", "ema_hint"), [
    ({"tracked.optimizer.state.0.exp_avg": "m"}, True),  # the optimizer agrees: updated outside it
    ({}, False),  # no optimizer to agree: nothing says the object is updated outside one
])
def test_the_restarting_counter_hint_needs_an_optimizer_that_agrees(optimizer, ema_hint):
    found = _compared({**optimizer, "tracked.model_ema.module.w": "a"}, {**optimizer, "tracked.model_ema.module.w": "b"})
    hint = statecheck.cause(found, resume_step=2)
    assert ("`enumerate(loader)` starts at 0 again" in hint) is ema_hint, hint
    assert hint.startswith("model_ema differs")
    moved = _compared({"tracked.model_ema.module.w": "a", "tracked.optimizer.state.0.exp_avg": "m"},
                      {"tracked.model_ema.module.w": "b", "tracked.optimizer.state.0.exp_avg": "n"})
    assert "enumerate" not in statecheck.cause(moved, resume_step=2)


def test_only_the_rngs_differing_names_which():
    found = _compared({**TRAINED, "rng.numpy.1": "a", "ranks.1.rng.torch": "t"},
                      {**TRAINED, "rng.numpy.1": "b", "ranks.1.rng.torch": "u"})
    assert statecheck.cause(found, resume_step=2).startswith(
        "only the global RNG state differs (numpy, rank 1's torch): something draws random numbers")
