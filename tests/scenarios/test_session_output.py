# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""The session's output is always fetchable (issues #56 item 6, #61 item 6): a job that leaves links and a
name Kaggle's output listing cannot serve in run.export_dir and the working folder. The local Kaggle answers
such files 404 (its `unservable_output` switch, strict by default), as the official client meets them on Kaggle;
the session mends its output before it ends, saying each in one line, so the whole output is fetched and the
chain goes on."""

from __future__ import annotations

import json
import textwrap

import yaml
from emulator_helpers import USER, emulator  # noqa: F401
from helpers import invoke

from kchain.kaggle.client import KaggleClient

NAME = "linky"
REF = f"{USER}/{NAME}"

TRAIN = '''
import os

import torch


def main(run):
    model = torch.nn.Linear(2, 2)
    run.track(model=model)
    for _ in run.steps(2):
        run.log(loss=1.0)
    export = run.export_dir
    (export / "config.json").write_text("{}")
    os.symlink("config.json", export / "alias.json")  # inside the working folder: copied as the file
    os.symlink("/etc/hostname", export / "host")  # outside it: left out
    (export / "..%2fescape.txt").write_text("x")  # a name the listing cannot serve: left out
    os.symlink("/nonexistent/debug.log", run.working / "debug.log")  # as W&B's offline mode leaves
'''


def test_links_and_unservable_names_are_mended_in_the_session_so_its_whole_output_is_fetched(emulator, tmp_path):
    emulator.switches.queue_s = emulator.switches.boot_s = 0.0  # not what this test is about
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(textwrap.dedent(TRAIN))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": NAME, "code": "code", "entry": "train:main",
                                   "kaggle": {"accelerator": "none"}}))
    assert invoke("push", job, "--skip-smoke").exit_code == 0
    assert emulator.wait_session(REF, 1)["status"] == "COMPLETE"
    log = "".join(chunk.get("data", "") for chunk in json.loads(KaggleClient().log(REF, 1)))
    said = sorted(line.split("/working/", 1)[1].split("'")[0] for line in log.splitlines()
                  if line.startswith("[kchain] output: "))  # each names its whole path
    assert said == ["debug.log", "kchain/export/..%2fescape.txt", "kchain/export/alias.json", "kchain/export/host"], log

    files, _ = KaggleClient().output(REF, 1, tmp_path / "fetched")  # the official client: every file served
    fetched = {p.relative_to(tmp_path / "fetched").as_posix() for p in files}
    assert "kchain/export/alias.json" in fetched and (tmp_path / "fetched/kchain/export/alias.json").read_text() == "{}"
    assert not {"kchain/export/host", "kchain/export/..%2fescape.txt", "debug.log"} & fetched

    result = invoke("continue", job, "--skip-smoke")  # the output fetched whole: the chain's state relayed
    assert result.exit_code == 0, result.output
    assert "--from-state" not in result.output, result.output
