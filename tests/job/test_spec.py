from pathlib import Path

import pytest
from helpers import error_line, invoke

from kchain.errors import SpecError
from kchain.job.spec import load_job, parse_cadence, parse_duration, runtime_config

GOOD = """\
name: tinygpt-notes
code: train.py
params: {lr: 3.0e-3, steps: 2000, seed: 7}
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_minimal_job_loads_with_defaults(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.entry_point == "train:main"
    assert job.kaggle.accelerator == "gpu" and job.kaggle.internet is False
    cfg = runtime_config(job)
    assert cfg.train.checkpoint_every == {"seconds": 600.0}
    assert cfg.train.session_limit_s == 12 * 3600
    assert cfg.params == {"lr": 3.0e-3, "steps": 2000, "seed": 7}


def test_durations_and_cadences():
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    assert parse_cadence("500 steps") == {"steps": 500}
    assert parse_cadence(20) == {"steps": 20}
    assert parse_cadence("10m") == {"seconds": 600}
    with pytest.raises(ValueError):
        parse_duration("10 minutes")


def test_a_bad_duration_names_file_key_and_fix(tmp_path):
    path = write(tmp_path, GOOD + "train:\n  checkpoint_every: 10 minutes\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (
        f"{path}: train.checkpoint_every: '10 minutes' is not a duration; write e.g. 10m or 500 steps"
    )


def test_a_typo_gets_did_you_mean(tmp_path):
    path = write(tmp_path, GOOD + "trian:\n  keep: 3\nsmoke:\n  step: 2\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert "trian: unknown key; did you mean 'train'?" in str(err.value)
    assert "smoke.step: unknown key; did you mean 'steps'?" in str(err.value)


def test_bad_values_are_each_named(tmp_path):
    path = write(tmp_path, GOOD.replace("tinygpt-notes", "My_Job") + "kaggle:\n  accelerator: v100\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    message = str(err.value)
    assert "name: 'My_Job' is not a kernel slug" in message
    assert "kaggle.accelerator: 'v100' is not allowed" in message
    assert "\n" not in message


def test_missing_code_and_missing_keys(tmp_path):
    path = write(tmp_path, "name: tinygpt-notes\ncode: nope.py\n")
    with pytest.raises(SpecError, match=r"code: 'nope.py' does not exist next to the job file"):
        load_job(path)
    path = write(tmp_path, "code: train.py\n")
    with pytest.raises(SpecError, match=r"name: required; add it"):
        load_job(path)


def test_yaml_syntax_error_and_dates_stay_strings(tmp_path):
    path = write(tmp_path, "name: [unclosed\n")
    with pytest.raises(SpecError, match=r"line \d+: .*fix the YAML syntax"):
        load_job(path)
    job = load_job(write(tmp_path, GOOD + "  # comment\n"))
    assert job.name == "tinygpt-notes"


def test_a_session_limit_over_the_cap_is_refused(tmp_path):
    path = write(tmp_path, GOOD + "train:\n  session_limit: 13h\n")
    with pytest.raises(SpecError, match="over Kaggle's 12h cap"):
        load_job(path)


def test_local_inputs_must_be_attached(tmp_path):
    path = write(tmp_path, GOOD + "kaggle:\n  local: {notes: data}\n")
    with pytest.raises(SpecError, match=r"kaggle.local.notes: not an attached dataset"):
        load_job(path)


def test_cli_prints_one_error_line_and_exits_10(tmp_path):
    path = write(tmp_path, GOOD + "train:\n  keep: 0\n")
    result = invoke("render", path, "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert error_line(result).startswith(f"Error: {path}: train.keep: ")
    assert "Traceback" not in result.output
    result = invoke("smoke", tmp_path / "missing.yaml")
    assert result.exit_code == 10
    assert error_line(result) == f"Error: {tmp_path / 'missing.yaml'}: no such job file; pass the path of your job.yaml"


def test_the_entry_must_exist_in_the_code(tmp_path):
    path = write(tmp_path, GOOD + "entry: train:run_training\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (
        f"{path}: entry: train.py defines no function 'run_training'; "
        "add `def run_training(run):` or set entry: train:<your function>"
    )
    path = write(tmp_path, GOOD + "entry: trainer:main\n")
    with pytest.raises(SpecError, match=r"entry: module 'trainer' is not in the code 'train.py'"):
        load_job(path)
    (tmp_path / "train.py").write_text("def main(run)\n    pass\n")
    with pytest.raises(SpecError, match=r"train.py: line 1: .*fix the syntax"):
        load_job(write_only(tmp_path, GOOD))


def write_only(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_code_folder_starts_from_its_train_module(tmp_path):
    pkg = tmp_path / "src"
    (pkg / "models").mkdir(parents=True)
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "train.py").write_text("from models import *\n\ndef main(run):\n    pass\n")
    path = tmp_path / "job.yaml"
    path.write_text("name: folder-job\ncode: src\n")
    assert load_job(path).entry_point == "train:main"


def test_a_key_given_twice_is_refused(tmp_path):
    path = write(tmp_path, GOOD + "params: {lr: 1.0e-3}\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: line 4: key 'params' is given twice; keep one"


def test_merge_keys_work_and_dates_stay_text(tmp_path):
    path = write(tmp_path, GOOD.replace("params: {lr: 3.0e-3, steps: 2000, seed: 7}\n", "") + (
        "params:\n  base: &base {lr: 0.001, steps: 10}\n  fast:\n    <<: *base\n    steps: 2\n  started: 2024-01-01\n"))
    assert load_job(path).params == {"base": {"lr": 0.001, "steps": 10}, "fast": {"lr": 0.001, "steps": 2},
                                     "started": "2024-01-01"}


@pytest.mark.parametrize("kaggle, message", [
    ("{owner: Alice}", "kaggle.owner: 'Alice' is not a Kaggle username; use lowercase letters, digits, underscores "
                       "and single dashes inside"),
    ("{owner: " + "a" * 51 + "}", "kaggle.owner: '" + "a" * 51 + "' is 51 characters; a Kaggle username has 1-50"),
    ("{competition: Titanic}", "kaggle.competition: 'Titanic' is not a Kaggle competition slug; use lowercase "
                               "letters, digits and single dashes inside"),
    ("{datasets: [alice/ab]}", "kaggle.datasets: 'ab' is 2 characters; a Kaggle dataset slug has 3-50"),
    ("{datasets: [alice/notes-data/0]}", "kaggle.datasets: 'alice/notes-data/0' is not a dataset; write owner/slug "
                                         "or owner/slug/version"),
    ('{datasets: ["alice/notes-data\\n"]}', "kaggle.datasets: 'notes-data\\n' is not a Kaggle dataset slug; use "
                                            "lowercase letters, digits and single dashes inside"),
    ("{accelerator: tpu}", "kaggle.accelerator: the runtime does not support TPUs yet; use gpu or none"),
    ("{mount_wait: soon}", "kaggle.mount_wait: 'soon' is not a positive duration; write e.g. 5m or 90s"),
    ("{mount_wait: 0}", "kaggle.mount_wait: 0 is not a positive duration; write e.g. 5m or 90s"),
    ("{mount_wait: 99999999h}", "kaggle.mount_wait: '99999999h' is over 1h: a session would wait that long on its "
                                "GPU clock for a state that Kaggle mounts within minutes; write e.g. 5m"),
    ("{mount_wait: [1]}", "kaggle.mount_wait: [1] is not a duration; write e.g. 5m or 90s"),
    ("{datasets: [alice/notes-data/2], local: {alice/notes-data: ./d}}",
     "kaggle.local.alice/notes-data: name the local copy by the dataset's slug alone, notes-data: "
     "(alice/notes-data is in kaggle.datasets already)"),
    ("[]", "kaggle: [] is not a mapping; write its keys indented under kaggle:"),
])
def test_kaggle_refs_follow_kaggles_rules(tmp_path, kaggle, message):
    path = write(tmp_path, GOOD + f"kaggle: {kaggle}\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: {message}"


def test_no_pydantic_names_or_union_members_reach_an_error(tmp_path):
    path = write(tmp_path, GOOD + "train: {session_limit: [1], checkpoint_every: {a: 1}}\nskypilot: 5\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (
        f"{path}: train.checkpoint_every: {{'a': 1}} is not a duration; write e.g. 10m or 500 steps; "
        "train.session_limit: [1] is not a duration; write e.g. 90s, 10m or 12h; "
        "skypilot: 5 is not a mapping; write its keys indented under skypilot:")


def test_a_name_leaves_room_for_the_state_and_cache_datasets(tmp_path):
    assert load_job(write(tmp_path, GOOD.replace("tinygpt-notes", "a" * 44))).name == "a" * 44
    path = write(tmp_path, GOOD.replace("tinygpt-notes", "a" * 45))
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (
        f"{path}: name: '{'a' * 45}' is 45 characters; use 5-44, so that <name>-state and <name>-cache fit "
        "Kaggle's 6-50 character dataset slugs"
    )


def test_durations_given_as_numbers_must_be_positive(tmp_path):
    path = write(tmp_path, GOOD + "train: {margin: 0, heartbeat: -1, session_limit: -3600, checkpoint_every: 0}\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == (
        f"{path}: train.checkpoint_every: 0 must be positive; write e.g. 10m or 500 steps; "
        "train.session_limit: -3600 must be positive; write e.g. 90s, 10m or 12h; "
        "train.margin: 0 must be positive; write e.g. 90s, 10m or 12h; "
        "train.heartbeat: -1 must be positive; write e.g. 90s, 10m or 12h (or '0s' for a heartbeat every step)"
    )
    job = load_job(write(tmp_path, GOOD + "train: {margin: 90, heartbeat: 0s, session_limit: 7200.5}\n"))
    assert runtime_config(job).train.margin_s == 90 and runtime_config(job).train.heartbeat_s == 0


@pytest.mark.parametrize("section, message", [
    ("train: {checkpoint_every: true}", "train.checkpoint_every: true is not a duration; write e.g. 10m or 500 steps"),
    ("train: {keep: yes}", "train.keep: true is not a whole number; write one without quotes, e.g. keep: 2"),
    ("smoke: {fraction: yes}", "smoke.fraction: true is not a number; write one without quotes, e.g. fraction: 0.02"),
    ("kaggle: {internet: -0.0}", "kaggle.internet: -0.0 is not true or false; write true or false, e.g. internet: false"),
    ("kaggle: {internet: 1}", "kaggle.internet: 1 is not true or false; write true or false, e.g. internet: false"),
    ("train: {gpus: true}", "train.gpus: true is not a GPU count; write auto, 1 or 2"),
    ("budget: {weekly_gpu_hours: on}", "budget.weekly_gpu_hours: true is not a number; write one without quotes, "
                                       "e.g. weekly_gpu_hours: 30.0"),
    ("train: {trackers: {wandb: 1}}", "train.trackers.wandb: 1 is not true or false; write true or false, e.g. "
                                      "wandb: false"),
    ("train: {margin: 1.0e+400}", "train.margin: inf is not a JSON number; write a finite number or quote it"),
    ("target: skypilot\nskypilot: {bucket: {name: my-kchain-state}, use_spot: 0}",
     "skypilot.use_spot: 0 is not true or false; write true or false, e.g. use_spot: true"),
])
def test_no_value_is_coerced_to_another_type(tmp_path, section, message):
    path = write(tmp_path, GOOD + section + "\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: {message}"


def test_set_values_read_numbers_as_a_shell_user_does_and_refuse_an_overflow():
    from kchain.job.spec import parse_overrides

    assert parse_overrides(["lr=1e-3", "steps=300", "tag='1e400'"]) == {"lr": 0.001, "steps": 300, "tag": "1e400"}
    for given, reads in (("steps=1e400", "is too large for a number (it reads as inf)"),
                         ("steps=.nan", "is not a finite number (it reads as nan)")):
        raw = given.split("=")[1]
        with pytest.raises(SpecError) as err:
            parse_overrides([given])
        assert str(err.value) == (f"--set '{given}': {raw} {reads}; write a finite number, or quote it for text: "
                                  f"--set 'steps=\"{raw}\"'")
