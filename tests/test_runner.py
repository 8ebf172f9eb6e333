"""The notebook runner: executes NN_*.ipynb with papermill, writes executed copies and a run log, and
names the failing notebook and cell. Uses two tiny notebooks built with nbformat in a temp dir."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from moelora_lib.studies import runner  # noqa: E402


def _notebook(*code_cells: str, parameters: str = 'PROFILE = "gpu"'):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells.append(nbformat.v4.new_markdown_cell("# tiny notebook"))
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells.append(params)
    nb.cells.extend(nbformat.v4.new_code_cell(src) for src in code_cells)
    return nb


@pytest.fixture
def nb_dir(tmp_path: Path) -> Path:
    d = tmp_path / "notebooks"
    d.mkdir()
    ok = _notebook(
        "import os\nprint('profile', PROFILE, os.environ.get('TRITON_INTERPRET'))",
        "assert PROFILE == 'cpu'\nassert os.environ.get('TRITON_INTERPRET') == '1'",
    )
    # The failing cell is the 2nd code cell after the parameters cell: index 3 in the source notebook.
    bad = _notebook("x = 1", "y = x + 1\nraise ValueError('boom from the second cell')", "z = 3")
    nbformat.write(ok, str(d / "01_ok.ipynb"))
    nbformat.write(bad, str(d / "02_fails.ipynb"))
    nbformat.write(_notebook("pass"), str(d / "helper_not_a_stage.ipynb"))  # not NN_*: never run
    return d


def test_find_notebooks_order_and_selection(nb_dir: Path):
    assert [p.name for p in runner.find_notebooks(nb_dir)] == ["01_ok.ipynb", "02_fails.ipynb"]
    assert [p.name for p in runner.find_notebooks(nb_dir, ["2"])] == ["02_fails.ipynb"]
    assert [p.name for p in runner.find_notebooks(nb_dir, ["02", "01"])] == ["01_ok.ipynb", "02_fails.ipynb"]
    with pytest.raises(ValueError, match="matches no notebook"):
        runner.find_notebooks(nb_dir, ["07"])


def test_passing_notebook_is_executed_and_logged(nb_dir: Path, tmp_path: Path):
    out = tmp_path / "executed"
    results = runner.run_notebooks(nb_dir, out, "cpu", only=["01"], progress_bar=False)
    assert [(r.notebook, r.status) for r in results] == [("01_ok.ipynb", "ok")]
    executed = nbformat.read(str(out / "01_ok.ipynb"), as_version=4)
    tags = [c.metadata.get("tags", []) for c in executed.cells]
    assert ["injected-parameters"] in tags  # PROFILE was injected by papermill
    printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "profile cpu 1" in printed  # PROFILE=cpu and TRITON_INTERPRET=1 reached the kernel
    with open(out / "run_log.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["notebook"] == "01_ok.ipynb" and rows[0]["status"] == "ok"
    assert rows[0]["profile"] == "cpu" and float(rows[0]["seconds"]) > 0 and rows[0]["git_commit"]


def test_failure_names_notebook_and_cell(nb_dir: Path, tmp_path: Path):
    out = tmp_path / "executed"
    with pytest.raises(runner.NotebookFailure) as info:
        runner.run_notebooks(nb_dir, out, "cpu", progress_bar=False)
    msg = str(info.value)
    assert "02_fails.ipynb" in msg
    assert "cell 3" in msg  # 0-based index in the source notebook
    assert "y = x + 1" in msg  # first source line of the failing cell
    assert "ValueError" in msg and "boom from the second cell" in msg
    statuses = [(r.notebook, r.status) for r in info.value.results]
    assert statuses == [("01_ok.ipynb", "ok"), ("02_fails.ipynb", "failed")]
    assert (out / "02_fails.ipynb").exists()  # the executed copy (with the traceback) is kept


def test_main_exit_code_and_list(nb_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "executed"
    assert runner.main(["--notebooks", str(nb_dir), "--list"]) == 0
    assert capsys.readouterr().out.split() == ["01_ok.ipynb", "02_fails.ipynb"]
    rc = runner.main(
        ["--notebooks", str(nb_dir), "--out", str(out), "--profile", "cpu", "--no-progress", "--keep-going"]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED: notebook 02_fails.ipynb failed at cell 3" in err
    assert runner.main(["--notebooks", str(nb_dir), "--only", "9"]) == 2
