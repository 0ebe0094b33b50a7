"""kchain's own usage checks exit 2, as click's do (issue 61's frictions): a bad `release --model`, `--dataset`
(the chain's own datasets too) or `--license`, neither target given, and the seconds and version numbers of
`stop`, `doctor` and `continue`. Each is one `Error:` line, before anything reads the job's chain or Kaggle."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import error_line, invoke

from kchain.errors import UsageError
from kchain.result.pull import Want
from kchain.result.release import release

EXAMPLE = "e.g. --model alice/tiny-gpt/pytorch/default"


def job(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("def main(run):\n    pass\n")
    (tmp_path / "job.yaml").write_text("name: usage-job\ncode: train.py\n")
    return tmp_path / "job.yaml"


@pytest.mark.parametrize("args, message", [
    (["release", "--model", "alice/tiny"], f"Error: --model 'alice/tiny': write OWNER/MODEL/FRAMEWORK/VARIATION, {EXAMPLE}"),
    (["release", "--model", "al ice/tiny-gpt/pytorch/default"],
     f"Error: --model 'al ice/tiny-gpt/pytorch/default': 'al ice' is not a Kaggle username, {EXAMPLE}"),
    (["release", "--model", "alice/tiny-gpt/caffe/default"],
     "Error: --model 'alice/tiny-gpt/caffe/default': 'caffe' is not a Kaggle model framework; use one of "),
    (["release", "--dataset", "alice"],
     "Error: --dataset 'alice': write OWNER/SLUG, the slug 6-50 lowercase letters, digits and dashes"),
    (["release", "--dataset", "alice/usage-job-state"],
     "Error: --dataset alice/usage-job-state: that is the chain's own state dataset, which pull and continue read; "
     "release to another, e.g. --dataset alice/usage-job-model"),
    (["release"], "Error: kchain release: give one of --model OWNER/MODEL/FRAMEWORK/VARIATION or --dataset OWNER/SLUG"),
    (["release", "--model", "alice/tiny-gpt/pytorch/default", "--dataset", "alice/weights"],
     "Error: kchain release: give one of --model OWNER/MODEL/FRAMEWORK/VARIATION or --dataset OWNER/SLUG"),
    (["release", "--dataset", "alice/weights", "--license", " "],
     "Error: --license ' ': is not a licence name; a licence name is at most 100 characters on one line"),
    (["stop", "--wait", "-5"], "Error: Invalid value for '--wait': -5.0 is not in the range 0.0<=x<=604800.0."),
    (["stop", "--poll", "0"], "Error: Invalid value for '--poll': 0.0 is not in the range 0.1<=x<=3600.0."),
    (["doctor", "--probe-timeout", "nan"], "Error: Invalid value for '--probe-timeout': 'nan' is not a number of seconds"),
    (["continue", "--from-state", "0"], "Error: Invalid value for '--from-state': 0 is not in the range x>=1."),
])
def test_each_usage_mistake_exits_2_in_one_line(tmp_path, args, message):
    result = invoke(args[0], job(tmp_path), *args[1:])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith(message), result.output
    assert "Traceback" not in result.output


def test_release_called_as_a_library_refuses_a_bad_target_before_the_job_is_read(tmp_path):
    with pytest.raises(UsageError, match="^--model 'alice': write OWNER/MODEL/FRAMEWORK/VARIATION"):
        release(tmp_path / "no-such-job.yaml", Want("final"), "alice", None, False, "Apache 2.0", print)
