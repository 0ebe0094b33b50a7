"""`kchain init`: the skeleton smoke-passes as written, and nothing is ever overwritten."""

from helpers import error_line, invoke


def test_init_writes_a_job_that_smoke_passes_and_refuses_to_overwrite(tmp_path):
    folder = tmp_path / "my-model"
    result = invoke("init", folder)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"wrote {folder / 'job.yaml'}", f"wrote {folder / 'train.py'}"]
    assert "name: my-model " in (folder / "job.yaml").read_text()

    smoke = invoke("smoke", folder / "job.yaml", "--quiet")
    assert smoke.exit_code == 0, smoke.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in smoke.output
    assert "not exact" not in smoke.output

    before = (folder / "train.py").read_text()
    again = invoke("init", folder)
    assert again.exit_code == 2
    assert error_line(again) == (
        f"Error: {folder / 'job.yaml'}, {folder / 'train.py'} already exists; kchain init never overwrites: "
        "choose an empty folder"
    )
    assert (folder / "train.py").read_text() == before
