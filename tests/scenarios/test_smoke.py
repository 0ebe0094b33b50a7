"""The smoke run end to end: real notebooks, real kernels, real SIGKILLs."""

import csv
from pathlib import Path

import pytest
from helpers import JOBS, copy_job, error_line, invoke

from kchain.job.spec import load_job
from kchain.local.smoke import KILLED_LINE, kaggle_ranks, ranks_label
from kchain.result import traces
from kchain.runtime.launch import GATE_NOTE
from kchain.store.ledger import Ledger


def runs(home: Path) -> list[dict]:
    with open(home / "runs.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("job", sorted(p.name for p in JOBS.iterdir() if (p / "job.yaml").exists()))
def test_every_example_job_smokes_to_a_pass(job, tmp_path, monkeypatch):
    path = copy_job(job, tmp_path)
    result = invoke("smoke", path)
    assert result.exit_code == 0, result.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in result.output
    assert "<- resumed here" in result.output
    # The ranks the job gets on Kaggle (gpus: auto on a GPU: T4 x2; jobs/finetune asks for one).
    assert ranks_label(kaggle_ranks(load_job(path))) in result.output
    home = Path(monkeypatch_env("KCHAIN_HOME"))
    row = runs(home)[-1]
    assert row["channel"] == "smoke" and row["note"] == "smoke pass" and row["job"]
    assert row["checkpoint"]
    assert_resume_was_held_until_the_kill(home / "smoke" / row["run_id"])
    passes = Ledger(home)
    fingerprint = next(line.split()[-1] for line in invoke("render", path, "-o", tmp_path / "r").output.splitlines()
                       if line.startswith("fingerprint"))
    assert passes.smoke_passed(fingerprint) is not None


def assert_resume_was_held_until_the_kill(work: Path) -> None:
    """The resume started beside the runs, waited at its gate, and built its Run only after the kill."""
    killed = (work / "run.log").read_text().splitlines()
    assert any(line.startswith(KILLED_LINE) for line in killed)  # the line that releases the resume
    resumed = (work / "resume.log").read_text().splitlines()
    held = next(i for i, line in enumerate(resumed) if GATE_NOTE in line)
    session = next(i for i, line in enumerate(resumed) if "resuming from" in line)
    assert held < session and (work / "resume.gate").read_text() == "go"


# One rank where the rank count is not what a test is about: a 2-rank smoke costs about twice the
# CPU; the example jobs keep the ranks Kaggle gives (2: their gpus: auto on a GPU).
ONE_RANK = ("--ranks", "1")


def monkeypatch_env(name: str) -> str:
    import os

    return os.environ[name]


def mutate(path: Path, old: str, new: str) -> None:
    code = path.parent / "train.py"
    text = code.read_text()
    assert old in text, old
    code.write_text(text.replace(old, new))


BROKEN = {
    "label dtype": (
        '"y_train": labels[train].astype(np.int64)',
        '"y_train": labels[train].astype(np.float32)',
        "preflight", "PreflightError", "label",
    ),
    "shape": (
        "nn.Linear(p.features, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),\n        nn.Linear(p.hidden, p.hidden)",
        "nn.Linear(p.features, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),\n        nn.Linear(p.hidden + 1, p.hidden)",
        "step", "RuntimeError", "a shape bug in the code",
    ),
    "validation is the training split": (
        'splits={"train": data["x_train"], "val": data["x_val"]}',
        'splits={"train": data["x_train"], "val": data["x_train"]}',
        "preflight", "PreflightError", "trained on the wrong split",
    ),
    "a path that only exists on the laptop": (
        "    torch.manual_seed(p.seed)\n",
        '    torch.manual_seed(p.seed)\n    np.loadtxt("/home/student/data/points.csv")\n',
        "build", "FileNotFoundError", "a data path or staging problem",
    ),
    "missing input": (
        "    torch.manual_seed(p.seed)\n",
        '    torch.manual_seed(p.seed)\n    run.input("delivery-notes")\n',
        "build", "FileNotFoundError", "a data path or staging problem",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_job_fails_fast_with_its_hint(case, tmp_path):
    old, new, stage, etype, clue = BROKEN[case]
    path = copy_job("classifier", tmp_path)
    mutate(path, old, new)
    result = invoke("smoke", path, *ONE_RANK)
    assert result.exit_code == 3, result.output
    line = error_line(result)
    assert line.startswith(f"Error: smoke failed (during {stage}): {etype}: "), line
    assert clue in result.output
    row = runs(Path(monkeypatch_env("KCHAIN_HOME")))[-1]
    assert row["note"].startswith(f"{etype}: ")
    assert "PASS" not in result.output


def test_an_untracked_optimizer_fails_the_resume_check(tmp_path):
    path = copy_job("tinygpt", tmp_path)
    mutate(path, "trainer = run.optimize(optimizer, accumulate=p.accumulate, clip=1.0)",
           "trainer = run.optimize(optimizer, accumulate=p.accumulate, clip=1.0, track=False)")
    result = invoke("smoke", path, *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert "ResumeMismatch" in error_line(result)
    assert "optimizer, LR scheduler or GradScaler state is not in run.track" in result.output


def test_an_untracked_batch_generator_fails_the_smoke_naming_it(tmp_path):
    # The generator the batches are drawn from changes every step and no checkpoint holds it: the smoke
    # stops at its second step (untracked.py) instead of leaving a resume to differ.
    path = copy_job("tinygpt", tmp_path)
    mutate(path, "    run.track(batches=batches)\n", "")
    result = invoke("smoke", path, *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert error_line(result).endswith(
        "UntrackedState: batches (Generator) changes between steps but no checkpoint holds it: a resume would "
        "start it over; add run.track(batches=batches) before the loop (or run.untrack(batches, reason=...) if "
        "a resume rebuilds it exactly)")


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])  # 2: the first resumed step's logged loss still matches
def test_a_batch_prefetched_in_the_previous_step_fails_the_resume_check_naming_the_prefetch(tmp_path, accumulate):
    """nanoGPT's loop: the next batch is fetched at the end of the step (the first one before the loop)."""
    path = copy_job("tinygpt", tmp_path, params={"accumulate": accumulate})
    mutate(path, "            x, y = next_batch()\n            with run.autocast():\n"
                 "                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())\n",
           "            with run.autocast():\n"
           "                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())\n"
           "            x, y = next_batch()\n")
    result = invoke("smoke", path, *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert "ResumeMismatch" in error_line(result)
    first = "the first step after the resume differs" if accumulate == 1 else "later ones drift"
    assert first in result.output and traces.PREFETCH in result.output


@pytest.mark.slow
def test_an_order_taken_from_a_set_of_strings_fails_though_the_laptop_fixes_the_hash_seed(tmp_path, monkeypatch):
    """Each process of a Kaggle session draws its own hash seed: a vocabulary in a set's order differs after every
    resume there. A PYTHONHASHSEED in the laptop's environment must not give the smoke's runs one seed (a pass)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    path = copy_job("tinygpt", tmp_path)
    mutate(path, 'vocab = sorted(set("".join(notes)))', 'vocab = list(set("".join(notes)))')
    result = invoke("smoke", path, *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert "ResumeMismatch" in error_line(result)
    assert "each process draws its own hash seed" in result.output


def test_a_passing_smoke_is_not_a_pass_for_changed_code(tmp_path):
    path = copy_job("classifier", tmp_path, params={"steps": 1500, "num_workers": 0})
    assert invoke("smoke", path, *ONE_RANK).exit_code == 0
    ledger = Ledger(Path(monkeypatch_env("KCHAIN_HOME")))
    mutate(path, "lr=p.lr)", "lr=p.lr * 0.5)")
    out = invoke("render", path, "-o", tmp_path / "r").output
    fingerprint = out.strip().split()[-1]
    assert ledger.smoke_passed(fingerprint) is None


def test_a_loss_that_is_already_nan_fails_the_smoke(tmp_path):
    path = copy_job("classifier", tmp_path, params={"steps": 1500, "num_workers": 0})
    mutate(path, "loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))",
           "loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device)) * float('nan')")
    result = invoke("smoke", path, "--quiet", *ONE_RANK)
    assert result.exit_code == 3, result.output
    assert error_line(result) == "Error: smoke failed (during step): NonFiniteMetric: loss is nan at step 1"
    assert "check the learning rate" in result.output


@pytest.mark.parametrize(("gpus", "accelerator", "ranks"), [("auto", "gpu", 2), ("auto", "none", 1), (2, "gpu", 2),
                                                          (1, "gpu", 1), (2, "none", 2)])
def test_the_smoke_runs_the_ranks_the_job_gets_on_kaggle(tmp_path, gpus, accelerator, ranks):
    """GPU T4 x2 for gpus: auto; the whole-smoke proof at 2 ranks is the example jobs' (their default)."""
    from kchain.job.spec import load_job
    from kchain.local.smoke import kaggle_ranks, ranks_label
    from kchain.local.smoke import ranks as smoke_ranks

    job = load_job(copy_job("classifier", tmp_path, train={"gpus": gpus}, kaggle={"accelerator": accelerator}))
    assert kaggle_ranks(job) == smoke_ranks(job) == ranks and smoke_ranks(job, 1) == 1
    assert ranks_label(ranks).startswith(f"{ranks} rank")
