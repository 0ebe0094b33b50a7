"""Attached datasets: a local copy for the smoke, a cached download, and the rehearsal's local Kaggle."""

# ruff: noqa: F811
import os
from pathlib import Path

from emulator_helpers import emulator, kaggle_api, wait_dataset_ready, write_dataset  # noqa: F401  (fixtures)
from helpers import copy_job, error_line, invoke

from kchain.common import layout
from kchain.job.inputs import local_inputs
from kchain.job.spec import load_job
from kchain.local.rehearse import rehearse

READS_INPUT = (
    "    torch.manual_seed(p.seed)\n",
    "    torch.manual_seed(p.seed)\n"
    "    notes = (run.input('delivery-notes') / 'notes.txt').read_text()\n"
    "    assert notes.startswith('DN-'), notes[:20]\n",
)


def job_reading_an_input(tmp_path: Path, ref: str, local: dict | None) -> Path:
    kaggle: dict[str, object] = {"datasets": [ref]}
    if local is not None:
        kaggle["local"] = local
    path = copy_job("classifier", tmp_path, params={"steps": 1500, "num_workers": 0}, kaggle=kaggle)
    code = path.parent / "train.py"
    code.write_text(code.read_text().replace(*READS_INPUT))
    return path


def test_the_smoke_mounts_the_local_copy_like_kaggle(tmp_path):
    path = job_reading_an_input(tmp_path, "carol/delivery-notes", {"delivery-notes": "data"})
    (path.parent / "data").mkdir()
    (path.parent / "data" / "notes.txt").write_text("DN-10001 12 x pallets of flour\n")
    result = invoke("smoke", path, "--quiet", "--ranks", "1")
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


def test_without_a_local_copy_the_smoke_says_how_to_get_one_and_downloads_it_once(tmp_path, emulator, kaggle_api):
    folder = write_dataset(tmp_path / "ds", "alice/delivery-notes", {"notes.txt": "DN-20001 3 x drums of oil\n"})
    kaggle_api.dataset_create_new(str(folder), quiet=True)
    wait_dataset_ready(kaggle_api, "alice/delivery-notes")  # a new dataset is hidden a while, as on Kaggle
    path = job_reading_an_input(tmp_path, "alice/delivery-notes", None)

    refused = invoke("smoke", path, "--ranks", "1")
    assert refused.exit_code == 10
    assert error_line(refused) == (
        f"Error: {path}: kaggle.local.delivery-notes: no local copy of dataset 'delivery-notes' for the smoke "
        "run; add kaggle.local: {delivery-notes: path/to/a/small/copy} or pass --download to fetch it once"
    )
    fetched = invoke("smoke", path, "--download", "--quiet", "--ranks", "1")
    assert fetched.exit_code == 0, fetched.output
    cached = Path(os.environ["KCHAIN_HOME"]) / "inputs" / "datasets" / "alice" / "delivery-notes" / "latest"
    assert (cached / "notes.txt").read_text().startswith("DN-20001")
    # No --download needed now: the smoke's input lookup takes the cache (the smoke above ran on it).
    cache = Path(os.environ["KCHAIN_HOME"]) / "inputs"
    assert list(local_inputs(load_job(path), cache, echo=lambda _: None).values()) == [cached]


def test_a_rehearsal_puts_the_inputs_on_the_local_kaggle(tmp_path, monkeypatch):
    path = job_reading_an_input(tmp_path, "carol/delivery-notes", {"delivery-notes": "data"})
    (path.parent / "data").mkdir()
    (path.parent / "data" / "notes.txt").write_text("DN-10001 12 x pallets of flour\n")
    # Sessions end by a deadline after 30 steps (a clock for tests), never by racing a short limit.
    monkeypatch.setenv(layout.FAULT_ENV, "deadline_after_steps=30")
    result = rehearse(path, sessions=None, session_limit_s=600,
                      kills=0, params={"steps": 60}, echo=lambda _: None, ranks=1)
    assert result.passed and len(result.sessions) == 2, result.verdict
    assert all("carol/delivery-notes" in s["dataset_sources"] for s in result.emulator_sessions)
