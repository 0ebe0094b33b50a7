"""`code: train.ipynb`: a notebook's code cells become the job's module (kchain/job/notebook_code.py)."""

from __future__ import annotations

import base64
import io
import os
import re
import traceback
import zipfile
from pathlib import Path

import nbformat
import pytest
from helpers import error_line, invoke
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from kchain.errors import RenderError, SpecError
from kchain.job import notebook_code
from kchain.job.notebook_code import NotebookError, to_module
from kchain.job.render import render_job
from kchain.job.spec import load_job

KEY = "f" * 8 + "0123456789abcdef" + "9" * 8  # a Kaggle key, as test_render writes one


def notebook(*cells: str) -> bytes:
    """A notebook of code cells; a cell given as "# md: ..." is a markdown cell."""
    nb = new_notebook()
    nb.cells = [new_markdown_cell(c[6:]) if c.startswith("# md: ") else new_code_cell(c) for c in cells]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return nbformat.writes(nb).encode()


def payload_files(notebook_text: str) -> dict[str, bytes]:
    cells = nbformat.reads(notebook_text, as_version=4).cells
    source = next(c.source for c in cells if "KCHAIN_PAYLOAD = " in c.source)
    found = re.search(r'KCHAIN_PAYLOAD = "([A-Za-z0-9+/=]+)"', source)
    assert found is not None, "no payload in the notebook"
    encoded = found.group(1)
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(encoded))) as zf:
        return {name: zf.read(name) for name in zf.namelist() if name.startswith("code/")}


def saved_as_on_kaggle(path: Path, output_text: str) -> None:
    """The notebook as its author saved it after working in it: code cells run out of order, every
    output kept (a printed line, a traceback, a 6 MB image), Kaggle's metadata."""
    nb = nbformat.read(path, as_version=4)
    counts = iter([7, 3, 12, 5, 9, 1, 2, 4, 6, 8])
    image = base64.b64encode(os.urandom(4_500_000)).decode()  # 6 MB: over the payload's limit by itself
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.execution_count = next(counts)
        cell.metadata.update({"trusted": True, "execution": {"iopub.status.busy": "2024-05-01T10:00:00.000Z"}})
        cell.outputs = [new_output("stream", name="stdout", text=f"{output_text}\n"),
                        new_output("error", ename="NameError", evalue="name 'x' is not defined", traceback=["..."]),
                        new_output("execute_result", data={"text/plain": "(320, 80)"},
                                   execution_count=cell.execution_count)]
    nb.cells[1].outputs.append(new_output("display_data", data={"image/png": image}))
    nb.metadata["kaggle"] = {"accelerator": "gpu", "dataSources": [], "isInternetEnabled": False}
    nbformat.write(nb, path)


def test_a_kaggle_notebook_round_trips_through_render_and_an_exact_smoke(tmp_path):
    folder = tmp_path / "my-notebook"
    assert invoke("init", "--template", "notebook", folder).exit_code == 0
    job = folder / "job.yaml"
    clean = render_job(load_job(job))
    saved_as_on_kaggle(folder / "train.ipynb", output_text="val_acc 0.93 (printed while trying things)")
    assert (folder / "train.ipynb").stat().st_size > 6_000_000

    used = render_job(load_job(job))
    assert used.notebook == clean.notebook and used.fingerprint == clean.fingerprint  # outputs never travel
    module = payload_files(used.notebook)["code/train.py"].decode()
    assert "printed while trying" not in module and "NameError" not in module
    assert re.findall(r"'train.ipynb, cell (\d+)'", module) == ["2", "4", "6", "8", "10"]  # the file's order
    out = invoke("render", job, "-o", tmp_path / "r").output.splitlines()
    assert "left out code/train.ipynb cell 2, line 9 `%matplotlib inline`: display only (dropped)" in out
    assert out[0] == f"embedded code/train.py ({len(module) / 1024:.1f} KB)"

    smoke = invoke("smoke", job, "--quiet", "--ranks", "1")
    assert smoke.exit_code == 0, smoke.output
    assert "PASS: resumed run equals the uninterrupted run bit for bit" in smoke.output
    assert "not exact" not in smoke.output


@pytest.mark.parametrize(("line", "why"), [
    ("%matplotlib inline", "display only"),
    ("%config InlineBackend.figure_format = 'retina'", "display only"),
    ("%load_ext autoreload", "display only"),
    ("%autoreload 2", "display only"),
    ("model?", "help, display only"),
    ("%env", "shows the environment, display only"),
])
def test_display_magics_are_dropped_with_a_note(line, why):
    module = to_module(notebook("import torch", f"x = 1\n{line}", "for s in run.steps(1):\n    pass"), "nb.ipynb")
    assert module.notes == (f"cell 2, line 2 `{line}`: {why}",)
    assert f"# dropped: cell 2, line 2 `{line}`: {why}\n" in module.text
    assert repr(f"x = 1\npass  # kchain: {line}") in module.text


@pytest.mark.parametrize(("cell", "line", "what"), [
    ("!pip install timm", 1, notebook_code.INSTALL),
    ("import sys\n!{sys.executable} -m pip install -q timm", 2, notebook_code.INSTALL),
    ("%pip install timm", 1, notebook_code.INSTALL),
    ("%conda install -y faiss", 1, notebook_code.INSTALL),
    ("%%capture\n!pip install -q timm", 2, notebook_code.INSTALL),
    ("!ls /kaggle/input", 1, notebook_code.SHELL),
    ("files = !ls /kaggle/input", 1, notebook_code.SHELL),
    ("if True:\n    !nvidia-smi", 2, notebook_code.SHELL),
    ("%%bash\necho hello", 1, notebook_code.SHELL),
    ("%%writefile utils.py\ndef f():\n    pass", 1, notebook_code.WRITEFILE),
    ("%timeit sum(range(10))", 1, notebook_code.TIMEIT),
    ("%cd /kaggle/working", 1, notebook_code.REFUSED_LINE["cd"]),
    ("%run helpers.py", 1, notebook_code.REFUSED_LINE["run"]),
    ("%load_ext cudf.pandas", 1, notebook_code.EXTENSION),
    ("%store x", 1, notebook_code.UNKNOWN),
    ("%%sql\nSELECT 1", 1, notebook_code.UNKNOWN),
    ("shell = get_ipython()", 1, notebook_code.GET_IPYTHON),
    ("from accelerate import notebook_launcher\nnotebook_launcher(train, (config,), num_processes=2)", 2,
     notebook_code.LAUNCHER),
    ("%foo a \\\n  b", 1, ("a magic or shell line continued onto the next line",
                          "write it on one line, or in Python")),
    ("x = (1,\ny = 2", 1, ("'(' was never closed", "fix the syntax")),
    ("await something()", 1, ("'await' outside function", "fix the syntax")),
])
def test_other_ipython_syntax_is_refused_naming_the_cell_the_line_and_the_fix(cell, line, what):
    with pytest.raises(NotebookError) as err:
        to_module(notebook("# md: Setup", "import os", cell, "run.steps(1)"), "nb.ipynb")
    text = cell.split("\n")[line - 1].strip()
    assert str(err.value) == f"nb.ipynb cell 3, line {line} `{text}`: {what[0]}; {what[1]}"


def test_kept_magics_become_python_and_the_cells_run_in_the_files_order(monkeypatch):
    monkeypatch.setenv("KCHAIN_NOTEBOOK_TEST", "before")  # restored after the test
    module = to_module(notebook(
        "%env KCHAIN_NOTEBOOK_TEST=set by %env",
        "%%time\norder = ['time cell']\n%time timed = 2",
        "# md: notes between the cells",
        "%%capture --no-stderr\norder.append('capture cell')",
        "import os\nenv_value = os.environ['KCHAIN_NOTEBOOK_TEST']\ndisplay('display() prints')",
        "def main(run):\n    return run",
    ), "nb.ipynb")
    assert module.entry == "main" and module.code_cells == 5 and module.other_cells == 1
    namespace: dict = {"__name__": "nbtest"}
    exec(compile(module.text, "nbtest.py", "exec"), namespace)  # a main(run) notebook's cells run on import
    assert namespace["order"] == ["time cell", "capture cell"] and namespace["timed"] == 2
    assert namespace["env_value"] == "set by %env" and namespace["main"]("the run") == "the run"


def test_a_traceback_names_the_notebooks_cell_and_line():
    module = to_module(notebook("# md: A title", "rows = run * 2", "print(rows)\nraise ValueError(f'bad rows {rows}')"),
                       "nb.ipynb")
    assert module.entry == "cells"
    namespace: dict = {"__name__": "nbtest"}
    exec(compile(module.text, "nbtest.py", "exec"), namespace)
    with pytest.raises(ValueError, match="bad rows 42") as err:
        namespace["main"](21)  # the cells are the training, with run bound
    last = traceback.extract_tb(err.value.__traceback__)[-1]
    assert (last.filename, last.lineno, last.line) == ("nb.ipynb, cell 3", 2, "raise ValueError(f'bad rows {rows}')")


@pytest.mark.parametrize(("cells", "function", "named", "message"), [
    (["def main():\n    pass"], "main", False,
     "nb.ipynb cell 1, line 1 `def main():`: `def main()` cannot be called as main(run); write def main(run):"),
    (["async def main(run):\n    pass"], "main", False,
     "nb.ipynb cell 1, line 1 `async def main(run):`: `async def main(run)` cannot be called as main(run); "
     "write def main(run):"),
    (["def main(run):\n    pass", "main(run)"], "main", False,
     "nb.ipynb cell 2, line 1 `main(run)`: uses run outside main(run), where it is undefined; kchain calls "
     "main(run) itself: move the line into main, or delete main to make the cells the training"),
    (["x = 1", "print(x)"], "main", False,
     "nb.ipynb: no cell uses run and none defines main(run); train in a cell with `for step in run.steps(N):` "
     "(kchain binds run), or define main(run)"),
    (["def run(x):\n    return x", "for step in run.steps(3):\n    pass"], "main", False,
     "nb.ipynb cell 1, line 1 `def run(x):`: binds `run` itself, which hides the run kchain gives the cells; "
     "rename it (or define main(run))"),
    (["for step in run.steps(3):\n    pass"], "fit", True,
     "nb.ipynb: defines no function 'fit'; add `def fit(run):` in a cell, or remove entry: to make the cells "
     "the training"),
])
def test_the_entry_is_main_run_or_the_cells_and_anything_else_is_refused(cells, function, named, message):
    with pytest.raises(NotebookError) as err:
        to_module(notebook(*cells), "nb.ipynb", function, named)
    assert str(err.value) == message
    assert to_module(notebook("def fit(run, extra=1):\n    pass", "x = fit"), "nb.ipynb", "fit", True).entry == "main"


def test_a_job_names_its_refused_notebook_line_in_one_error(tmp_path):
    (tmp_path / "train.ipynb").write_bytes(notebook("import torch", "%%capture\n!pip install -q timm"))
    (tmp_path / "job.yaml").write_text("name: pip-notebook\ncode: train.ipynb\n")
    result = invoke("render", tmp_path / "job.yaml", "-o", tmp_path / "out")
    assert result.exit_code == 10
    assert error_line(result) == (
        f"Error: {tmp_path / 'job.yaml'}: code: train.ipynb cell 2, line 2 `!pip install -q timm`: a package "
        "install; Kaggle's image has the common packages: delete the line, or attach the wheels as a dataset "
        "and pip install them in Python with --no-index --find-links run.input(...)"
    )
    (tmp_path / "train.ipynb").write_text("{not json")
    with pytest.raises(SpecError, match=r"code: train.ipynb: not a notebook nbformat can read \(Notebook does"):
        load_job(tmp_path / "job.yaml")
    kernel = {"display_name": "R", "language": "R", "name": "ir"}
    r_notebook = nbformat.writes(new_notebook(metadata={"kernelspec": kernel}))
    (tmp_path / "train.ipynb").write_text(r_notebook)
    with pytest.raises(SpecError, match=r"train.ipynb: is a notebook in R; kchain runs Python"):
        load_job(tmp_path / "job.yaml")


def test_a_code_folder_runs_its_entry_notebook_and_never_sends_another(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.ipynb").write_bytes(notebook("from helpers import total", "for step in run.steps(total):\n    pass"))
    entry = nbformat.read(src / "train.ipynb", as_version=4)
    entry.cells[0].outputs = [new_output("stream", name="stdout", text=f"{KEY}\n")]  # printed once: never sent
    nbformat.write(entry, src / "train.ipynb")
    (src / "helpers.py").write_text("total = 3\n")
    (src / "explore.ipynb").write_bytes(notebook(f"print('{KEY}')"))  # not the entry: it never travels
    (tmp_path / "job.yaml").write_text("name: folder-notebook\ncode: src\n")
    monkeypatch.setenv("KAGGLE_KEY", KEY)
    rendered = render_job(load_job(tmp_path / "job.yaml"))
    assert sorted(payload_files(rendered.notebook)) == ["code/helpers.py", "code/train.py"]
    assert ("code/explore.ipynb", "a notebook that is not the entry: only the entry notebook's code cells "
                                  "travel") in rendered.left_out

    (src / "train.ipynb").write_bytes(notebook(f"key = '{KEY}'", "for step in run.steps(3):\n    pass"))
    err: pytest.ExceptionInfo[Exception]  # a RenderError, then a SpecError
    with pytest.raises(RenderError) as err:
        render_job(load_job(tmp_path / "job.yaml"))  # a code cell travels: the key guard reads the module
    assert str(err.value) == (f"{tmp_path / 'job.yaml'}: code: a code cell of src/train.ipynb holds your Kaggle "
                              "key; remove it (attach it to the notebook as a Kaggle Secret instead)")
    (src / "train.py").write_text("def main(run):\n    pass\n")
    with pytest.raises(SpecError) as err:
        load_job(tmp_path / "job.yaml")
    assert str(err.value) == (f"{tmp_path / 'job.yaml'}: code: the code has both src/train.py and src/train.ipynb "
                              "for the entry module; delete or rename one")


# --- a script that trains at module level (issue 39) ------------------------------------------------

SCRIPT = """import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = run.wrap(nn.Linear(4, 2))
stepper = run.optimize(torch.optim.SGD(model.parameters(), lr=0.1))
run.track(model=model)
loader = run.loader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4)
for step in run.steps(run.params.steps):
    x, y = next(loader)
    loss = F.cross_entropy(model(x), y)
    stepper.backward(loss)
    stepper.step()
    run.log(loss=loss.item())
"""


def _script_job(tmp_path, script: str):
    (tmp_path / "train.py").write_text(script)
    job = tmp_path / "job.yaml"
    job.write_text("name: module-script\ncode: train.py\nparams: {steps: 6}\nkaggle: {accelerator: none}\n"
                   "smoke: {steps: 2}\n")
    return job


def test_a_script_that_trains_at_module_level_smokes_as_it_is(tmp_path):
    # nanoGPT's train.py shape: no main(run), the loop in the file's body; kchain runs it with run bound.
    result = invoke("smoke", _script_job(tmp_path, SCRIPT), "--quiet")
    assert result.exit_code == 0, result.output
    assert "bit for bit, state and trace" in result.output


def test_a_script_or_notebook_that_binds_run_itself_is_refused_in_one_line(tmp_path):
    result = invoke("render", _script_job(tmp_path, "def run():\n    pass\n\n" + SCRIPT), "-o", str(tmp_path / "out"))
    assert result.exit_code != 0
    assert "train.py binds `run` itself, which hides the run kchain gives the script; rename it" in result.output
