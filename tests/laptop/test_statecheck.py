""""Bit for bit" means the state (issue 39): the smoke and rehearse compare every value of the saved
state at every step both runs saved, not only what the job logs; state the job forgot is named; each
rank keeps its own state; the loader takes the GPU branches' arguments.

The jobs are tests/runtime_jobs/state_job.py, the held-out shapes the issue found.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import error_line, invoke, runtime_job

from kchain import statecheck
from kchain.common import layout
from kchain.rehearse import rehearse

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
    assert "model_ema (AveragedModel)" in line and "model (Sequential)" in line
    assert "change between steps but no checkpoint holds them" in line
    assert "run.track(" in line and "model_ema=model_ema" in line and "model=model" in line


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

    state = {"step": 3, "tracked": {"model": {"w": torch.arange(4.0), "flag": torch.tensor(True)},
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
    assert "net_ema (AveragedModel) changes between steps but no checkpoint holds it" in line, line
    assert "run.track(net_ema=net_ema)" in line, line


def test_a_value_without_a_digest_is_neither_a_difference_nor_counted_as_compared(tmp_path):
    """A live CUDA tensor streamed to the file has no digest: the verdict says it was not compared."""
    _ckpt(tmp_path / "ref", 4, {"tracked.model.w": "float32[4]:unhashed", "rng.torch": "r"})
    _ckpt(tmp_path / "run", 4, {"tracked.model.w": "float32[4]:unhashed", "rng.torch": "r"})
    found = statecheck.compare(statecheck.saved([statecheck.checkpoints_of(tmp_path / "ref")]),
                               statecheck.saved([statecheck.checkpoints_of(tmp_path / "run")]))
    assert found.first is None and (found.values, found.unhashed) == (1, 1) and not found.whole
    assert found.counted() == "1 value; 1 more, tensors streamed from the GPU without a digest, not compared"
