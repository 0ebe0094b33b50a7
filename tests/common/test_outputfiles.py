"""The session's output as Kaggle can serve it (kchain/common/outputfiles.py): the one name rule, links
copied as files or left out with a line naming the whole path, and the state folder under the same rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kchain.common import layout, outputfiles, statefolder
from kchain.common.checkpoint_files import sha256_of


@pytest.mark.parametrize("rel", ["model.safetensors", "kchain/export/tok/vocab.txt", "epoch=0-step=100.ckpt",
                                 "wandb/run-20240101_120000-abc/files/output.log", "notes 1.txt", "modèle.bin",
                                 ".hydra/config.yaml", "a,b@c~(d)[e].json"])
def test_names_the_listing_serves_pass(rel):
    assert outputfiles.name_problem(rel) is None


@pytest.mark.parametrize("rel, why", [
    ("kchain/export/..%2fescape.txt", "'%' reads as an escape in its URL: '..%2f' is '../'"),
    ("../escape.txt", "a '..' part escapes the download folder"),
    ("a//b", "a '' part escapes the download folder"),
    ("/etc/passwd", "an absolute name escapes the download folder"),
    ("run#1/x", "'#' cuts its URL short (a fragment)"),
    ("what?.txt", "'?' cuts its URL short (a query)"),
    ("a\\b.txt", "'\\' is a folder separator on Windows"),
    ("line\nbreak.txt", "a control character ('\\n') cannot go in a URL"),
    (os.fsdecode(b"caf\xe9.txt"), "it is not UTF-8, and the listing is JSON text"),
])
def test_names_the_listing_cannot_serve_are_refused_saying_why(rel, why):
    assert outputfiles.name_problem(rel) == why


def test_the_tidy_copies_links_inside_as_files_and_leaves_out_the_rest_one_whole_line_each(tmp_path):
    working = tmp_path / "working"
    export = working / "kchain" / "export"
    (working / "wandb" / "run-1").mkdir(parents=True)
    export.mkdir(parents=True)
    (export / "model.bin").write_bytes(b"weights")
    (export / "latest.bin").symlink_to("model.bin")  # inside: copied as the file
    (export / "host").symlink_to("/etc/hostname")  # outside: left out
    (export / "..%2fescape.txt").write_text("x")  # a name the listing cannot serve
    (working / "wandb" / "latest-run").symlink_to("run-1", target_is_directory=True)  # a linked folder
    (working / "wandb" / "debug.log").symlink_to(tmp_path / "gone.log")  # dangling
    (working / "run#2").mkdir()
    (working / "run#2" / "a.txt").write_text("a")
    (working / "kchain" / layout.SCRATCH_DIR).mkdir()
    (working / "kchain" / layout.SCRATCH_DIR / "resume.bin").symlink_to("/etc/hostname")  # kchain's own: quiet

    lines = outputfiles.tidy(working)

    rename = "rename it with letters, digits, spaces and . _ -"
    assert lines == [
        f"left out the folder '{working}/run#2' (1 file): Kaggle's output listing cannot serve the name ('#' cuts "
        f"its URL short (a fragment)); {rename}",
        f"left out '{export}/..%2fescape.txt': Kaggle's output listing cannot serve the name ('%' reads as an "
        f"escape in its URL: '..%2f' is '../'); {rename}",
        f"left out '{export}/host': a link to '/etc/hostname', outside the working folder: Kaggle's output cannot "
        f"serve a link; write the file itself under {working}",
        f"copied '{export}/latest.bin' as a file: it was a link to '{export.resolve()}/model.bin', and Kaggle's "
        "output cannot serve a link",
        f"left out '{working}/wandb/debug.log': a link to '{tmp_path}/gone.log', which points to nothing: Kaggle's "
        f"output cannot serve a link; write the file itself under {working}",
        f"left out '{working}/wandb/latest-run': a link to 'run-1', a folder: Kaggle's output cannot serve a link; "
        f"write the file itself under {working}",
    ]
    left = sorted(p.relative_to(working).as_posix() for p in working.rglob("*"))
    assert left == ["kchain", "kchain/.scratch", "kchain/export", "kchain/export/latest.bin",
                    "kchain/export/model.bin", "wandb", "wandb/run-1"]
    assert not (export / "latest.bin").is_symlink() and (export / "latest.bin").read_bytes() == b"weights"
    assert (tmp_path / "working").exists() and os.path.exists("/etc/hostname")  # only links were removed
    assert outputfiles.tidy(working) == []  # a second look finds nothing


def test_the_notebooks_step_says_each_line_and_never_fails_the_session(tmp_path):
    working = tmp_path / layout.WORKING_DIR
    working.mkdir()
    (working / "out").symlink_to("/etc/hostname")
    done = subprocess.run([sys.executable, "-m", "kchain.common.outputfiles"], capture_output=True, text=True,
                          env={**os.environ, layout.ROOT_ENV: str(tmp_path)})
    assert done.returncode == 0 and done.stdout == (
        f"[kchain] output: left out '{working}/out': a link to '/etc/hostname', outside the working folder: "
        f"Kaggle's output cannot serve a link; write the file itself under {working}\n")


def test_the_state_folder_carries_export_dir_under_the_same_rule(tmp_path, capsys):
    # A state built where no tidy ran (a laptop's copy, a target's folder): the same rule, one line each.
    kchain_dir = tmp_path / "working" / layout.KCHAIN_DIR
    ckpt = kchain_dir / layout.CHECKPOINTS_DIR / layout.checkpoint_name(2)
    ckpt.mkdir(parents=True)
    (ckpt / layout.STATE_FILE).write_bytes(b"state")
    (ckpt / layout.MANIFEST).write_text(json.dumps({
        layout.MARKER: layout.FORMAT_VERSION, "job": "j", "step": 2, "session": 1,
        "files": {layout.STATE_FILE: {"sha256": sha256_of(ckpt / layout.STATE_FILE), "size": 5}}}))
    export = kchain_dir / layout.EXPORT_DIR
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "alias.json").symlink_to("config.json")
    (export / "host").symlink_to("/etc/hostname")
    (export / "..%2fescape.txt").write_text("x")
    marker = statefolder.build_state_folder(kchain_dir, tmp_path / "state", "laptop", "j")
    assert marker is not None and marker["export"] == {"export.alias.json": "alias.json",
                                                      "export.config.json": "config.json"}
    assert (tmp_path / "state" / "export.alias.json").read_text() == "{}"
    said = capsys.readouterr().out
    assert f"run.export_dir: '{export}/host' is left out of the state: a link to '/etc/hostname'" in said
    assert f"run.export_dir: '{export}/..%2fescape.txt' is left out of the state" in said
