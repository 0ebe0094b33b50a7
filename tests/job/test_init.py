"""`kchain init`: the skeleton smoke-passes as written, and nothing is ever overwritten."""

import re
from typing import get_args

import pytest
import yaml
from click.testing import CliRunner
from helpers import error_line, invoke

from kchain.cli import cli
from kchain.errors import SpecError
from kchain.job.init import TEMPLATES, init_job, templates
from kchain.job.spec import KaggleSpec, load_job


def test_init_writes_a_job_that_smoke_passes_and_refuses_to_overwrite(tmp_path):
    folder = tmp_path / "my-model"
    result = invoke("init", folder)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"wrote {folder / 'job.yaml'}", f"wrote {folder / 'train.py'}"]
    assert "name: my-model " in (folder / "job.yaml").read_text()

    smoke = invoke("smoke", folder / "job.yaml", "--quiet", "--ranks", "1")  # 2 ranks: the example jobs' smokes
    assert smoke.exit_code == 0, smoke.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in smoke.output
    assert "not exact" not in smoke.output

    before = (folder / "train.py").read_text()
    again = invoke("init", folder)
    assert again.exit_code == 10
    assert error_line(again) == (
        f"Error: {folder / 'job.yaml'}, {folder / 'train.py'} already exists; kchain init never overwrites: "
        "choose an empty folder"
    )
    assert (folder / "train.py").read_text() == before


@pytest.mark.parametrize("template", ["loop", "notebook"])
def test_the_skeletons_comments_state_the_limits_spec_enforces(tmp_path, template):
    folder = tmp_path / ("a-folder-name-" * 5)  # longer than any job name may be
    assert invoke("init", "--template", template, folder).exit_code == 0
    text = (folder / "job.yaml").read_text()
    lines = text.splitlines()
    name_line = next(line for line in lines if line.startswith("name: "))
    accelerator_line = next(line for line in lines if line.strip().startswith("accelerator: "))
    data = yaml.safe_load(text)

    def loads(name: str | None = None, accelerator: str | None = None) -> bool:
        """Whether spec accepts the skeleton's job.yaml with this name or accelerator instead."""
        job = {**data, "name": name or data["name"],
               "kaggle": {**data["kaggle"], "accelerator": accelerator or data["kaggle"]["accelerator"]}}
        (folder / "probe.yaml").write_text(yaml.safe_dump(job))
        try:
            load_job(folder / "probe.yaml")
        except SpecError:
            return False
        return True

    assert loads()  # the name made from the long folder name is one spec accepts
    slug = re.search(r"slug: (\d+)-(\d+) lowercase", name_line)
    assert slug is not None
    low, high = map(int, slug.groups())
    assert [loads(name="a" * n) for n in (low - 1, low, high, high + 1)] == [False, True, True, False]
    listed = accelerator_line.split("# ")[1].split(" (")[0].split(" | ")
    for value in get_args(KaggleSpec.model_fields["accelerator"].annotation):
        assert (value in listed) == loads(accelerator=value), value


def test_every_template_is_a_folder_copied_with_the_jobs_name_and_loads(tmp_path):
    names = templates()
    assert {"loop", "notebook"} <= set(names)
    assert names == sorted(p.name for p in TEMPLATES.iterdir() if (p / "job.yaml").is_file())
    for name in names:
        folder = tmp_path / f"my-{name}"
        written = init_job(folder, name)
        assert folder / "job.yaml" in written
        for path in written:
            assert b"@NAME@" not in path.read_bytes(), path
            source = (TEMPLATES / name / path.relative_to(folder)).read_bytes()
            assert path.read_bytes() == source.replace(b"@NAME@", folder.name.encode())  # nothing else formatted
        assert load_job(folder / "job.yaml").name == folder.name  # the entry is in the code, it parses


def test_an_unknown_template_is_refused_in_one_line_and_the_help_lists_every_template(tmp_path):
    result = invoke("init", "--template", "../loop", tmp_path / "job")
    assert result.exit_code == 2  # a usage error, as click's own
    assert error_line(result) == f"Error: --template '../loop': no such template; use one of: {', '.join(templates())}"
    assert not (tmp_path / "job").exists()
    # The shell's completion of `kchain init --template l<TAB>` (click's bash protocol: type,value lines).
    completed = CliRunner().invoke(cli, [], prog_name="kchain", env={
        "_KCHAIN_COMPLETE": "bash_complete", "COMP_WORDS": "kchain init --template l", "COMP_CWORD": "3"})
    assert completed.output.splitlines() == [f"plain,{name}" for name in templates() if name.startswith("l")]
    help_text = invoke("init", "--help").output
    examples = [line.strip() for line in help_text.split("Example:\n")[1].split("\n\n")[0].splitlines()]
    assert examples == ["kchain init jobs/my-model && kchain smoke jobs/my-model/job.yaml"] + [
        f"kchain init --template {name} jobs/my-{name}" for name in templates() if name != "loop"]

    folder = tmp_path / "nb"
    assert invoke("init", "-t", "notebook", folder).output.splitlines() == [
        f"wrote {folder / 'job.yaml'}", f"wrote {folder / 'train.ipynb'}"]
    again = invoke("init", "--template", "notebook", folder)
    assert again.exit_code == 10
    assert error_line(again) == (f"Error: {folder / 'job.yaml'}, {folder / 'train.ipynb'} already exists; kchain "
                                 "init never overwrites: choose an empty folder")
