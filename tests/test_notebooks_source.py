"""The notebooks are the source: checks on the committed ``notebooks/NN_*.ipynb`` files,
plus the layering rule that the product never imports the studies.

Per notebook (the shape of notebook 01): a first cell of Markdown with the question and the prediction,
at most 250 words; committed without outputs; one ``parameters`` cell of literal assignments with
``PROFILE = "auto"``; the kernelspec/language metadata papermill needs; a last cell that renders the
written conclusion as Markdown (``conclude(...)`` or ``Markdown(...)``); no run history in any cell
(commit hashes, dates, "last run", session talk); no references a clone does not have and no unformatted
``{NAME}`` placeholders in prose. For the suite: ``ruff check notebooks/`` is clean.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PACKAGE = ROOT / "moelora_lib"

# Text a clone does not have or that only means something inside this project's sessions.
FORBIDDEN = {
    "shared/notes": re.compile(r"shared/notes"),
    "/work/": re.compile(r"/work/"),
    "issue <n>": re.compile(r"\bissue \d", re.IGNORECASE),
    # each notebook writes its conclusion in its last cell; the package that rendered them is gone
    "studies.conclusions": re.compile(r"studies\.conclusions|studies import conclusions"),
}
#: Words allowed in a notebook's first (Markdown) cell: the question, the prediction, how to read it.
INTRO_WORDS = 250
# Run history has no place in a notebook: it lives in git log and docs/perf_notes.md.
HISTORY = {
    "commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "date": re.compile(
        r"\b20\d\d-[01]\d-[0-3]\d\b"
        r"|\b\d{1,2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d\b"
        r"|\b(January|February|March|April|May|June|July|August|September|October|November|December) "
        r"\d{1,2},? 20\d\d\b"
    ),
    "run history": re.compile(
        r"\b(sessions?|last run|previous run|earlier run|this round|round \d+"
        r"|(first|second|third|next) round)\b",
        re.IGNORECASE,
    ),
}
# A `{WARMUP_MS}`-style placeholder left in Markdown prose (it only renders in an f-string).
PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
# How to fix a notebook saved with outputs (README, "Notebooks and git"). --keep-id keeps the cell ids
# (nbstripout renumbers them otherwise); the filter is set for notebooks/ only: the executed copies in
# data/executed/ are committed with their outputs, and `nbstripout --install` would strip every *.ipynb.
STRIP_HINT = """Strip them (keeps the cell ids, the kernelspec and the `parameters` tag):
    .venv/bin/nbstripout --keep-id notebooks/*.ipynb
To strip notebooks/ on every commit, once per clone:
    git config filter.nbstripout.clean "'$PWD/.venv/bin/nbstripout' --keep-id"
    git config filter.nbstripout.smudge cat
    echo 'notebooks/*.ipynb filter=nbstripout' >> .git/info/attributes
(not `nbstripout --install`: it would also strip the executed copies in data/executed/, which keep their
outputs)."""


def _read(path: Path):
    return nbformat.read(str(path), as_version=4)


def _ids(paths):
    return [p.name for p in paths]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"


def _words(markdown: str) -> int:
    return len([w for w in markdown.split() if re.search(r"[A-Za-z0-9]", w)])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_first_cell_is_a_short_markdown_intro(path: Path):
    first = _read(path).cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell is {first.cell_type}, not Markdown"
    n = _words(first.source)
    assert n <= INTRO_WORDS, (
        f"{path.name}: the first cell has {n} words; keep the question, the prediction and how to read "
        f"the notebook within {INTRO_WORDS} (details go next to the code they explain)"
    )


def _history_text(cell, what: str) -> str:
    """Where ``what`` is looked for: hashes and dates anywhere; run-history words in Markdown and in code
    comments (code may name a CSV value such as the tuner's ``kind == "session"`` rows)."""
    if what != "run history" or cell.cell_type == "markdown":
        return cell.source
    return "\n".join(line.split("#", 1)[1] for line in cell.source.splitlines() if "#" in line)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_no_run_history(path: Path):
    problems = [
        f"cell {i}: {what} {m.group()!r} in {text[max(0, m.start() - 40) : m.end() + 40]!r}"
        for i, cell in enumerate(_read(path).cells)
        for what, pattern in HISTORY.items()
        for text in [_history_text(cell, what)]
        for m in pattern.finditer(text)
    ]
    assert not problems, (
        f"{path.name} carries run history (it belongs in git log and docs/perf_notes.md):\n  "
        + "\n  ".join(problems)
    )


def test_history_patterns():
    """The run-history scanner itself: hashes, dates and session talk found; colours, numbers and
    ordinary words not."""
    found = lambda text: [w for w, p in HISTORY.items() if p.search(text)]  # noqa: E731
    assert found("measured at 2c3c5d1 on the H200") == ["commit hash"]
    assert found("run on 2026-12-01") == ["date"] and found("on 3 Dec 2026") == ["date"]
    assert found("In the last run it was faster") == ["run history"]
    assert found("this session measured it") == ["run history"]
    for text in ("color='#1f77b4'", "T = 1600000", "a decade of deadbeef", "NotebookSession", "2 ** 20"):
        assert found(text) == [], text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_without_outputs(path: Path):
    nb = _read(path)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs or an execution count (JupyterLab saves them into the "
        f"notebook). {STRIP_HINT}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_one_parameters_cell_of_literals_with_profile_auto(path: Path):
    nb = _read(path)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged `parameters`, expected exactly 1"
    cell = tagged[0]
    assert cell.cell_type == "code", f"{path.name}: the `parameters` cell is not a code cell"
    values = {}
    for stmt in ast.parse(cell.source).body:
        line = ast.get_source_segment(cell.source, stmt)
        assert isinstance(stmt, ast.Assign), (
            f"{path.name}: `{line}` in the parameters cell is not an assignment"
        )
        assert all(isinstance(t, ast.Name) for t in stmt.targets), (
            f"{path.name}: `{line}` assigns no plain name"
        )
        try:
            value = ast.literal_eval(stmt.value)
        except ValueError:
            pytest.fail(
                f"{path.name}: `{line}` in the parameters cell is not a literal (papermill overrides it)"
            )
        for t in stmt.targets:
            values[t.id] = value
    assert values.get("PROFILE") == "auto", (
        f'{path.name}: the parameters cell must set PROFILE = "auto" (got {values.get("PROFILE")!r}), so '
        "Run All works in JupyterLab on a CPU machine as well as on a GPU"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_kernel_metadata_for_papermill(path: Path):
    meta = _read(path).metadata
    assert meta.get("kernelspec", {}).get("name"), f"{path.name}: metadata.kernelspec.name missing"
    assert meta.get("language_info", {}).get("name") == "python", f"{path.name}: language_info.name != python"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_ends_with_the_written_conclusion(path: Path):
    """The last cell renders the written conclusion from the CSV the notebook just wrote (Markdown via
    ``conclude(...)`` or ``IPython.display.Markdown``), so a reader does not decode printed tables."""
    last = _read(path).cells[-1]
    assert last.cell_type == "code" and ("conclude(" in last.source or "Markdown(" in last.source), (
        f"{path.name}: the last cell must be a code cell rendering the conclusion as Markdown "
        f"(conclude(...) or Markdown(...)); it is a {last.cell_type} cell starting "
        f"{last.source.strip()[:60]!r}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_no_project_internal_references_or_placeholders(path: Path):
    problems = []
    for i, cell in enumerate(_read(path).cells):
        for what, pattern in FORBIDDEN.items():
            for m in pattern.finditer(cell.source):
                problems.append(
                    f"cell {i}: {what!r} in {cell.source[max(0, m.start() - 30) : m.end() + 30]!r}"
                )
        if cell.cell_type == "markdown":
            for m in PLACEHOLDER.finditer(cell.source):
                problems.append(f"cell {i} (markdown): unformatted placeholder {m.group()}")
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


def test_ruff_check_notebooks_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed in this interpreter (pip install -e .[dev])")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "notebooks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"ruff check notebooks/ failed:\n{proc.stdout}{proc.stderr}"


# ---- the product never imports the studies -------------------------------------------------------------


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every module ``path`` imports, relative imports resolved;
    ``from X import y`` yields both X and X.y (y may be a submodule). ``importlib.import_module``
    and ``__import__`` calls with a literal name count too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = _module_parts(path)
    package = parts if path.name == "__init__.py" else parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((node.lineno, mod))
            found.extend((node.lineno, f"{mod}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                text = "".join(
                    v.value
                    for v in ([arg] if isinstance(arg, ast.Constant) else getattr(arg, "values", []))
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                )
                level = len(text) - len(text.lstrip("."))
                if level:
                    rest = [x for x in text[level:].split(".") if x]
                    text = ".".join([*package[: len(package) - (level - 1)], *rest])
                found.append((node.lineno, text))
    return found


PRODUCT_MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "studies" not in p.relative_to(PACKAGE).parts)


def test_product_modules_found():
    names = {p.relative_to(PACKAGE).as_posix() for p in PRODUCT_MODULES}
    assert "__init__.py" in names and "shapes.py" in names, sorted(names)


@pytest.mark.parametrize(
    "path", PRODUCT_MODULES, ids=[p.relative_to(ROOT).as_posix() for p in PRODUCT_MODULES]
)
def test_product_never_imports_studies(path: Path):
    bad = [
        f"line {line}: {mod}"
        for line, mod in _imported_modules(path)
        if mod == "moelora_lib.studies"
        or mod.startswith("moelora_lib.studies.")
        or mod.split(".")[0] == "studies"
    ]
    assert not bad, f"{path.relative_to(ROOT)} (product) imports the studies: {bad}"


def test_import_scanner_sees_relative_and_absolute_imports(tmp_path: Path, monkeypatch):
    """The scanner itself: relative, absolute and import_module forms of a studies import are found."""
    pkg = tmp_path / "moelora_lib" / "kernels"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text(
        "from ..studies import bench\n"
        "from .. import studies\n"
        "import moelora_lib.studies.tuning\n"
        "import importlib\n"
        "importlib.import_module('..studies.bench', __package__)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = [m for _, m in _imported_modules(src)]
    assert mods.count("moelora_lib.studies") == 2  # `from ..studies import` and `from .. import studies`
    assert "moelora_lib.studies.bench" in mods and "moelora_lib.studies.tuning" in mods
    assert (
        mods.count("moelora_lib.studies.bench") == 2
    )  # the from-import and import_module('..studies.bench')


# ---- progress bars print as text in executed notebooks ---------------------------------------------------

WIDGET_TQDM = re.compile(r"\btqdm\.(auto|notebook|autonotebook)\b|\bfrom tqdm import (auto|notebook)\b")
KERNEL_SIDE = [*NOTEBOOKS, *sorted((PACKAGE / "studies").rglob("*.py"))]


@pytest.mark.parametrize("path", KERNEL_SIDE, ids=[p.relative_to(ROOT).as_posix() for p in KERNEL_SIDE])
def test_no_widget_progress_bars(path: Path):
    """tqdm.auto/notebook draw ipywidgets inside a Jupyter kernel: the executed copies then show bars
    frozen at 0 %. Code that may run in a notebook uses the text bar, moelora_lib.studies.notebook.progress
    (or tqdm.std)."""
    if path.suffix == ".ipynb":
        sources = [c.source for c in _read(path).cells if c.cell_type == "code"]
    else:
        sources = [path.read_text()]
    hits = [m.group() for s in sources for m in WIDGET_TQDM.finditer(s)]
    assert not hits, (
        f"{path.relative_to(ROOT)} uses {sorted(set(hits))}; use moelora_lib.studies.notebook.progress"
    )
