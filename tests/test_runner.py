"""The notebook runner: executes NN_*.ipynb with papermill in its own interpreter's kernel, writes
executed copies and a run log, and names the failing notebook and cell. Uses tiny notebooks built with
nbformat in a temp dir."""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
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
    # The executed copy opens like its source: the source's kernelspec, not the runner's private one,
    # and no absolute machine paths in papermill's metadata.
    assert executed.metadata["kernelspec"]["name"] == "python3"
    pm = executed.metadata["papermill"]
    assert not os.path.isabs(pm["input_path"]) and not os.path.isabs(pm["output_path"])
    # A second run appends one row per notebook to the same log (the runner creates it when missing).
    runner.run_notebooks(nb_dir, out, "cpu", only=["01"], progress_bar=False)
    with open(out / "run_log.csv") as fh:
        assert [r["notebook"] for r in csv.DictReader(fh)] == ["01_ok.ipynb", "01_ok.ipynb"]


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


def test_list_of_a_folder_without_notebooks_is_a_usage_error(tmp_path: Path, capsys):
    """--list of a folder that holds no notebook (a typo, a folder that does not exist) exits 2 naming the
    folder, as a run of it does, instead of listing nothing with exit code 0."""
    for folder in (tmp_path / "missing", tmp_path):
        assert runner.main(["--notebooks", str(folder), "--list"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "no notebooks matching" in captured.err and str(folder) in captured.err


def _kernelspec(jupyter_dir: Path, name: str, argv0: str) -> Path:
    spec_dir = jupyter_dir / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = {"argv": [argv0, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return spec_dir


def test_runs_in_its_own_interpreter_despite_a_foreign_python3_kernelspec(tmp_path: Path, monkeypatch):
    """A `python3` kernelspec for another interpreter first on JUPYTER_PATH (here a wrapper that marks
    that it was used, then starts Python) must not be used: the notebook runs in sys.executable."""
    marker = tmp_path / "foreign_kernel_was_started"
    fake = tmp_path / "other-env" / "bin" / "python3"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\necho used > "{marker}"\nexec "{sys.executable}" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    foreign = tmp_path / "foreign_jupyter"
    _kernelspec(foreign, "python3", str(fake))
    monkeypatch.setenv("JUPYTER_PATH", str(foreign))

    d = tmp_path / "notebooks"
    d.mkdir()
    seen = tmp_path / "executable.txt"
    nbformat.write(
        _notebook(f"import sys\nopen({str(seen)!r}, 'w').write(sys.executable)"), str(d / "01_which.ipynb")
    )
    results = runner.run_notebooks(d, tmp_path / "executed", "cpu", progress_bar=False)
    assert [r.status for r in results] == ["ok"]
    assert os.path.abspath(seen.read_text()) == os.path.abspath(sys.executable)
    assert not marker.exists(), "the foreign python3 kernelspec was started"
    assert os.environ["JUPYTER_PATH"] == str(foreign)  # restored after the run


def test_kernelspec_check_names_a_mismatched_spec(tmp_path: Path, monkeypatch):
    jupyter_dir = tmp_path / "jupyter"
    spec_dir = _kernelspec(jupyter_dir, "moelora-foreign", "/opt/other-env/bin/python3")
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))
    with pytest.raises(runner.KernelSpecMismatch) as info:
        runner.check_kernelspec("moelora-foreign")
    msg = str(info.value)
    assert "'moelora-foreign'" in msg and str(spec_dir) in msg and "/opt/other-env/bin/python3" in msg
    assert sys.executable in msg
    with pytest.raises(runner.KernelSpecMismatch, match="not found"):
        runner.check_kernelspec("moelora-no-such-kernel")


def test_own_kernel_spec_points_at_this_interpreter(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    with runner.own_kernel() as name:
        assert name == runner.kernel_name_for(sys.executable) and name.startswith("moelora-")
        spec = runner.check_kernelspec(name)
        assert spec.argv[0] == os.path.abspath(sys.executable)
        assert spec.argv[1:3] == ["-m", "ipykernel_launcher"] and "{connection_file}" in spec.argv
    assert "JUPYTER_PATH" not in os.environ
    # Another interpreter gets another name, so the two can never shadow each other.
    assert runner.kernel_name_for("/opt/other-env/bin/python3") != name


def test_main_reports_a_kernelspec_mismatch(nb_dir: Path, tmp_path: Path, monkeypatch, capsys):
    def refuse(name, executable=None):
        raise runner.KernelSpecMismatch(f"kernelspec {name!r} (resource dir X) starts '/bin/false'")

    monkeypatch.setattr(runner, "check_kernelspec", refuse)
    rc = runner.main(["--notebooks", str(nb_dir), "--out", str(tmp_path / "out"), "--profile", "cpu"])
    assert rc == 2
    assert "kernelspec 'moelora-" in capsys.readouterr().err
    assert not (tmp_path / "out" / "run_log.csv").exists()  # nothing ran, nothing logged


# ---- usage errors: refused up front, exit status 2, nothing written -------------------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no CUDA device, and papermill must not be reached."""
    torch = pytest.importorskip("torch")
    import papermill

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("papermill.execute_notebook was called")

    monkeypatch.setattr(papermill, "execute_notebook", must_not_run)


def test_gpu_profile_without_cuda_is_refused_before_writing(
    nb_dir: Path, tmp_path: Path, monkeypatch, capsys, no_cuda
):
    # The default --out of the gpu profile holds the committed executed notebooks and their run log.
    committed = tmp_path / "data" / "executed"
    committed.mkdir(parents=True)
    (committed / "01_ok.ipynb").write_text('{"committed": true}')
    (committed / "run_log.csv").write_text(",".join(runner.RUN_LOG_COLUMNS) + "\n")
    before = _snapshot(committed)
    monkeypatch.setattr(runner, "default_out_dir", lambda profile: committed)

    for out_args in ([], ["--out", str(committed)]):
        rc = runner.main(["--notebooks", str(nb_dir), "--profile", "gpu", "--no-progress", *out_args])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --profile gpu needs a CUDA GPU") and err.count("\n") == 1, err
        assert "Traceback" not in err
        assert _snapshot(committed) == before  # nothing overwritten, no failed row appended

    with pytest.raises(runner.NoCudaDevice):
        runner.run_notebooks(nb_dir, committed, "gpu", progress_bar=False)
    assert _snapshot(committed) == before
    assert runner.main(["--notebooks", str(nb_dir), "--profile", "gpu", "--list"]) == 0  # lists only
    assert runner.resolve_profile("auto") == "cpu"


def test_empty_only_is_an_error_not_everything(nb_dir: Path, tmp_path: Path, capsys, no_cuda):
    out = tmp_path / "out"
    for value in ["", " ", ",", " , "]:
        with pytest.raises(SystemExit) as info:
            runner.main(["--notebooks", str(nb_dir), "--only", value, "--out", str(out), "--profile", "cpu"])
        assert info.value.code == 2
        assert "selects no notebook" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="selects no notebook"):
        runner.find_notebooks(nb_dir, [])
    with pytest.raises(ValueError, match="selects no notebook"):
        runner.find_notebooks(nb_dir, ["", " "])
    assert len(runner.find_notebooks(nb_dir, None)) == 2  # no --only at all: every notebook


def test_only_error_shows_what_the_user_typed(nb_dir: Path, capsys):
    assert runner.main(["--notebooks", str(nb_dir), "--only", "99"]) == 2
    err = capsys.readouterr().err
    assert "--only '99' matches no notebook" in err and "99_" not in err
    assert runner.main(["--notebooks", str(nb_dir), "--only", "01,7"]) == 2
    assert "--only '7' matches no notebook" in capsys.readouterr().err


def test_unwritable_out_is_a_one_line_error(nb_dir: Path, tmp_path: Path, capsys, no_cuda):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    bad = [a_file / "out", a_file]  # parent is a file; --out is a file
    if os.geteuid() != 0:  # root writes into read-only folders
        ro = tmp_path / "read_only"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        bad += [ro, ro / "sub"]
    for out in bad:
        rc = runner.main(["--notebooks", str(nb_dir), "--out", str(out), "--profile", "cpu", "--no-progress"])
        assert rc == 2, out
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write the executed notebooks to --out {str(out)!r}: "), err
        assert err.count("\n") == 1 and "Traceback" not in err, err
    assert a_file.read_text() == "not a folder"
    with pytest.raises(OSError, match="cannot write"):
        runner.run_notebooks(nb_dir, a_file / "out", "cpu", progress_bar=False)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "", "nan", "inf", "-inf"])
def test_cell_timeout_must_be_a_positive_number(value, nb_dir: Path, tmp_path: Path, capsys, no_cuda):
    with pytest.raises(SystemExit) as info:
        runner.main(["--notebooks", str(nb_dir), "--out", str(tmp_path / "o"), "--cell-timeout", value])
    assert info.value.code == 2
    assert "--cell-timeout" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cell_timeout_reaches_papermill_as_whole_seconds(nb_dir: Path, tmp_path: Path, monkeypatch):
    assert runner._parse_args(["--cell-timeout", "600"]).cell_timeout == 600
    assert runner._parse_args(["--cell-timeout", "1.5"]).cell_timeout == 2  # rounded up, never 0
    assert runner._parse_args(["--cell-timeout", "0.2"]).cell_timeout == 1
    assert runner._parse_args([]).cell_timeout is None
    with pytest.raises(ValueError):
        runner.run_notebooks(nb_dir, tmp_path / "x", "cpu", cell_timeout=0)
    # A real run with a fractional timeout (nbclient's `timeout` is an Integer trait: a float raised a
    # TraitError before the first cell).
    import papermill

    seen = []
    real = papermill.execute_notebook

    def spy(*args, **kwargs):
        seen.append(kwargs.get("execution_timeout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(papermill, "execute_notebook", spy)
    out = tmp_path / "executed"
    rc = runner.main(
        ["--notebooks", str(nb_dir), "--only", "01", "--out", str(out), "--profile", "cpu"]
        + ["--no-progress", "--cell-timeout", "60.5"]
    )
    assert rc == 0 and seen == [61] and type(seen[0]) is int
    results = runner.run_notebooks(nb_dir, out, "cpu", only=["01"], progress_bar=False, cell_timeout=30.5)
    assert [r.status for r in results] == ["ok"] and seen[-1] == 31
