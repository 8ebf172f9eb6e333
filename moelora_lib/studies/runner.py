"""Run the notebook suite headless with papermill.

    python -m moelora_lib.studies.runner [--profile cpu|gpu|auto] [--only 01,02] [--out DIR]
                                 [--log-output] [--keep-going] [--cell-timeout S] [--list]

Executed copies go to ``<out>/<same name>``, one row per notebook to ``<out>/run_log.csv``
(:data:`RUN_LOG_COLUMNS`). Exit status: 0 all ok; 1 a notebook failed; 2 a usage error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
PROFILES = ("cpu", "gpu")
REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_LOG_NAME = "run_log.csv"
RUN_LOG_COLUMNS = ("notebook", "profile", "seconds", "status", "git_commit", "finished_utc", "error")


@dataclass(frozen=True)
class NotebookResult:
    """Outcome of one notebook: ``status`` is "ok" or "failed"; ``seconds`` is wall time."""

    notebook: str
    profile: str
    seconds: float
    status: str
    output: Path
    error: str | None = None


class KernelSpecMismatch(RuntimeError):
    """The kernelspec the runner would execute with does not start this interpreter."""


class NoCudaDevice(RuntimeError):
    """The gpu profile was asked for, but torch sees no CUDA device."""


class NotebookFailure(RuntimeError):
    """Raised by :func:`run_notebooks` (without ``keep_going``) when a notebook fails."""

    def __init__(self, message: str, results: list[NotebookResult]):
        super().__init__(message)
        self.results = results


def cuda_available() -> bool:
    """``torch.cuda.is_available()``; False when torch cannot be imported."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_profile(profile: str) -> str:
    """Map "auto" to "gpu" when CUDA is available, else "cpu"; ValueError for an unknown profile."""
    if profile == "auto":
        return "gpu" if cuda_available() else "cpu"
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {PROFILES + ('auto',)}")
    return profile


def require_cuda(profile: str) -> None:
    """Raise :class:`NoCudaDevice` when ``profile`` is "gpu" and torch sees no CUDA device."""
    if profile == "gpu" and not cuda_available():
        raise NoCudaDevice("--profile gpu needs a CUDA GPU, and torch sees none on this machine; nothing was "
                           "run or written. Use --profile cpu (or auto) here.")  # fmt: skip


def prepare_out_dir(out: str | os.PathLike) -> Path:
    """Create ``out`` if needed and check it is writable; OSError naming the folder otherwise."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".moelora-write-check-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise OSError(f"cannot write the executed notebooks to --out {str(out)!r}: {reason}{where}") from exc
    return path


def timeout_seconds(value: float | int | None) -> int | None:
    """A per-cell timeout in whole seconds, rounded up; ValueError unless positive; None stays None."""
    if value is None:
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"the cell timeout must be a positive number of seconds, got {value!r}")
    return int(math.ceil(seconds))


def find_notebooks(notebook_dir: str | os.PathLike, only: Sequence[str] | None = None) -> list[Path]:
    """The notebooks ``NN_*.ipynb`` in ``notebook_dir``, sorted, filtered by ``only`` (stage numbers or name
    prefixes; None: all). ValueError for a selector that matches nothing or an ``only`` without a selector."""
    notebooks = sorted(Path(notebook_dir).glob(NOTEBOOK_GLOB))
    if only is None:
        return notebooks
    selectors = [s.strip() for s in only if s.strip()]
    if not selectors:
        raise ValueError(f"--only {','.join(only)!r} {_NO_SELECTION}")
    selected: list[Path] = []
    for sel in selectors:
        prefix = f"{int(sel):02d}_" if sel.isdigit() else sel
        hits = [nb for nb in notebooks if nb.name.startswith(prefix)]
        if not hits:
            names = ", ".join(nb.name for nb in notebooks) or "none"
            raise ValueError(f"--only {sel!r} matches no notebook in {notebook_dir} (have: {names})")
        selected.extend(h for h in hits if h not in selected)
    return sorted(selected)


def default_out_dir(profile: str) -> Path:
    """``data/executed`` for the gpu profile, ``data/executed/cpu`` for the cpu profile."""
    base = REPO_ROOT / "data" / "executed"
    return base if profile == "gpu" else base / "cpu"


_NO_SELECTION = "selects no notebook: give stage numbers or name prefixes, e.g. --only 01,02"


@contextlib.contextmanager
def kernel_environment(profile: str) -> Iterator[None]:
    """The kernel inherits ``TRITON_INTERPRET=1`` (cpu) or no ``TRITON_INTERPRET`` (gpu); restored
    afterwards."""
    saved = os.environ.get("TRITON_INTERPRET")
    try:
        _set_env("TRITON_INTERPRET", "1" if profile == "cpu" else None)
        yield
    finally:
        _set_env("TRITON_INTERPRET", saved)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def kernel_name_for(executable: str | None = None) -> str:
    """The runner's kernelspec name for ``executable`` (default ``sys.executable``): ``moelora-<hash>``."""
    exe = os.path.abspath(executable or sys.executable)
    return "moelora-" + hashlib.sha256(exe.encode()).hexdigest()[:10]


def write_kernelspec(jupyter_dir: str | os.PathLike, executable: str | None = None) -> str:
    """Write ``<jupyter_dir>/kernels/<name>/kernel.json`` for an ipykernel in ``executable``; returns the
    name."""
    exe = os.path.abspath(executable or sys.executable)
    name = kernel_name_for(exe)
    spec_dir = Path(jupyter_dir) / "kernels" / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [exe, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = dict(argv=argv, display_name="Python 3 (moelora runner)", language="python")
    spec["metadata"] = {"debugger": False}
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
    return name


def check_kernelspec(name: str, executable: str | None = None):
    """Resolve kernelspec ``name`` as papermill will and return it; :class:`KernelSpecMismatch` unless it
    starts ``executable``."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    exe = os.path.abspath(executable or sys.executable)
    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel as exc:
        path = os.environ.get("JUPYTER_PATH", "")
        raise KernelSpecMismatch(f"kernelspec {name!r} not found (JUPYTER_PATH={path!r})") from exc
    argv0 = spec.argv[0] if spec.argv else "<empty argv>"
    # Compare paths, not resolved files: a venv's python is a symlink to the base interpreter.
    if os.path.abspath(argv0) != exe:
        raise KernelSpecMismatch(f"kernelspec {name!r} (resource dir {spec.resource_dir}) starts {argv0!r}, "
                                 f"not this interpreter {exe!r}; remove or rename it.")  # fmt: skip
    return spec


@contextlib.contextmanager
def own_kernel(executable: str | None = None) -> Iterator[str]:
    """The name of a checked kernelspec that starts ``executable``, in a temporary folder first on
    ``JUPYTER_PATH``."""
    saved = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory(prefix="moelora-kernel-") as tmp:
        name = write_kernelspec(tmp, executable)
        os.environ["JUPYTER_PATH"] = os.pathsep.join([tmp, *([saved] if saved else [])])
        try:
            check_kernelspec(name, executable)
            yield name
        finally:
            _set_env("JUPYTER_PATH", saved)


def _repo_relative(path: str) -> str:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except (ValueError, OSError):
        return Path(path).name


def _tidy_executed(executed: Path, source: Path) -> None:
    """The executed copy gets the source's ``metadata.kernelspec`` and repo-relative papermill paths."""
    import nbformat

    if not executed.exists():
        return
    nb = nbformat.read(str(executed), as_version=4)
    src_meta = nbformat.read(str(source), as_version=4).metadata
    if "kernelspec" in src_meta:
        nb.metadata["kernelspec"] = src_meta["kernelspec"]
    pm = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if pm.get(key):
            pm[key] = _repo_relative(pm[key])
    nbformat.write(nb, str(executed))


def _source_cell_index(notebook: Path, executed_index: int, source: str) -> int:
    """Papermill's cell index mapped back to the source notebook."""
    try:
        import nbformat

        cells = nbformat.read(str(notebook), as_version=4).cells
    except Exception:
        return executed_index
    candidates = [i for i, c in enumerate(cells) if c.cell_type == "code" and c.source == source]
    if not candidates:
        return executed_index
    return min(candidates, key=lambda i: (abs(i - (executed_index - 1)), i))


def describe_failure(notebook: Path, exc: BaseException) -> str:
    """One readable message naming the notebook, the failing cell and the exception."""
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, PapermillExecutionError):
        src_index = _source_cell_index(notebook, exc.cell_index, exc.source)
        lines = [ln for ln in (exc.source or "").splitlines() if ln.strip()]
        first = lines[0].strip() if lines else "<empty>"
        where = f"cell {src_index} (0-based, In [{exc.exec_count}]; {exc.cell_index} in the executed copy)"
        return f"notebook {notebook.name} failed at {where}: `{first}` -> {exc.ename}: {exc.evalue}"
    return f"notebook {notebook.name} failed before or outside a cell: {type(exc).__name__}: {exc}"


def _log_row(out: Path, notebook: str, profile: str, seconds: float, status: str, commit: str, error):
    """Append one row to ``<out>/run_log.csv`` (header written when the file is new)."""
    path = out / RUN_LOG_NAME
    new_file = not path.exists() or path.stat().st_size == 0
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    with path.open("a", newline="") as fh:
        writer = csv.writer(fh)
        if new_file:
            writer.writerow(RUN_LOG_COLUMNS)
        writer.writerow([notebook, profile, f"{seconds:.2f}", status, commit, now, error or ""])


def run_notebooks(notebook_dir: str | os.PathLike, out_dir: str | os.PathLike | None, profile: str,
                  only: Sequence[str] | None = None, *, log_output: bool = False, progress_bar: bool = True,
                  keep_going: bool = False, cell_timeout: float | None = None,
                  cwd: str | os.PathLike | None = None) -> list[NotebookResult]:  # fmt: skip
    """Execute the notebooks in order, one result each; copies and ``run_log.csv`` in ``out_dir`` (None:
    :func:`default_out_dir`). Without ``keep_going`` the first failure raises :class:`NotebookFailure`. Before
    any file is written: :class:`NoCudaDevice`, ValueError, FileNotFoundError, OSError."""
    import papermill

    from .bench import git_commit

    profile = resolve_profile(profile)
    require_cuda(profile)
    cell_timeout = timeout_seconds(cell_timeout)
    out = Path(out_dir) if out_dir is not None else default_out_dir(profile)
    notebooks = find_notebooks(notebook_dir, only)
    if not notebooks:
        raise FileNotFoundError(f"no notebooks matching {NOTEBOOK_GLOB} in {notebook_dir}")
    prepare_out_dir(out)
    commit = git_commit()
    results: list[NotebookResult] = []
    n = len(notebooks)
    with own_kernel() as kernel_name:
        print(f"kernel: {kernel_name} -> {sys.executable}", flush=True)
        for i, nb in enumerate(notebooks, 1):
            dst = out / nb.name
            print(f"[{i}/{n}] {nb.name} (profile={profile}) ...", flush=True)
            t0 = time.perf_counter()
            error: str | None = None
            try:
                with kernel_environment(profile):
                    kw = dict(kernel_name=kernel_name, language="python", progress_bar=progress_bar)
                    kw |= dict(log_output=log_output, cwd=str(cwd if cwd is not None else nb.parent))
                    papermill.execute_notebook(str(nb), str(dst), parameters={"PROFILE": profile},
                                               execution_timeout=cell_timeout, **kw)  # fmt: skip
            except KeyboardInterrupt:  # e.g. `timeout --signal=INT` in scripts/gpu_job.sh
                seconds = time.perf_counter() - t0
                _log_row(out, nb.name, profile, seconds, "interrupted", commit, "interrupted")
                print(f"[{i}/{n}] {nb.name}: interrupted after {seconds:.1f} s", file=sys.stderr, flush=True)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
                error = describe_failure(nb, exc)
            finally:
                with contextlib.suppress(Exception):
                    _tidy_executed(dst, nb)
            seconds = time.perf_counter() - t0
            result = NotebookResult(nb.name, profile, seconds, "failed" if error else "ok", dst, error)
            results.append(result)
            _log_row(out, nb.name, profile, seconds, result.status, commit, error)
            print(f"[{i}/{n}] {nb.name}: {result.status} in {seconds:.1f} s -> {dst}", flush=True)
            if error:
                print(f"FAILED: {error}", file=sys.stderr, flush=True)
                if not keep_going:
                    raise NotebookFailure(error, results)
    return results


def _only_arg(text: str) -> list[str]:
    selectors = [s.strip() for s in text.split(",") if s.strip()]
    if not selectors:
        raise argparse.ArgumentTypeError(f"{text!r} {_NO_SELECTION}")
    return selectors


def _timeout_arg(text: str) -> int:
    try:
        return timeout_seconds(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds") from None


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moelora_lib.studies.runner", description="Run the notebooks.")
    p.add_argument("--profile", default="auto", choices=[*PROFILES, "auto"])
    p.add_argument("--only", default=None, type=_only_arg, help="stage numbers or name prefixes, e.g. 01,02")
    p.add_argument("--out", default=None, help="executed copies + run_log.csv (default: data/executed[/cpu])")
    p.add_argument("--notebooks", default=str(REPO_ROOT / "notebooks"), help="folder of NN_*.ipynb")
    p.add_argument("--log-output", action="store_true", help="stream cell outputs to this process's log")
    p.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    p.add_argument("--keep-going", action="store_true", help="run the remaining notebooks after a failure")
    p.add_argument("--cell-timeout", type=_timeout_arg, default=None, help="seconds per cell (default: none)")
    p.add_argument("--list", action="store_true", help="list the notebooks that would run, then exit")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    # usage errors are refused before anything is written (a failed gpu run would overwrite data/executed/)
    try:
        notebooks = find_notebooks(args.notebooks, args.only)
        if not notebooks:
            raise ValueError(f"no notebooks matching {NOTEBOOK_GLOB} in {args.notebooks}")
        if args.list:
            for nb in notebooks:
                print(nb.name)
            return 0
        profile = resolve_profile(args.profile)
        require_cuda(profile)
        prepare_out_dir(args.out if args.out is not None else default_out_dir(profile))
    except (ValueError, NoCudaDevice, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        kw = dict(log_output=args.log_output, progress_bar=not args.no_progress, keep_going=args.keep_going)
        kw |= dict(cell_timeout=args.cell_timeout)
        results = run_notebooks(args.notebooks, args.out, profile, args.only, **kw)
    except NotebookFailure as exc:
        results = exc.results
    except (KernelSpecMismatch, NoCudaDevice) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; executed copies and run_log.csv so far are kept", file=sys.stderr)
        return 130
    failed = [r for r in results if r.status != "ok"]
    total = time.perf_counter() - t0
    print(f"\n{len(results) - len(failed)} of {len(notebooks)} notebooks ok, profile={profile}, {total:.1f}s")
    for r in results:
        print(f"  {r.status:6s} {r.seconds:8.1f} s  {r.notebook}")
    if len(notebooks) > len(results):
        n = len(notebooks) - len(results)
        print(f"  ({n} not run after the first failure; use --keep-going to run them)")
    for r in failed:
        print(f"FAILED: {r.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
