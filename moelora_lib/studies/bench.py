"""The one benchmark harness: timing, roofline floors, result rows to CSV, the environment record.

Units: :class:`Timing` in ms; the floor helpers in µs. GPU (:func:`time_cuda`): ``triton.testing.do_bench``'s
method (CUDA events, median, p20/p80), the L2 flushed before every repetition (``"dirty"``: zeroes 256 MB;
``"clean"``: reads 256 MB). CPU (:func:`time_cpu`): wall clock, never kernel performance.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import importlib.metadata
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import write_json_atomic
from ..hardware import H200_BF16_TFLOPS, H200_COPY_TB_PER_S  # re-exported: notebooks read them here

REPO_ROOT = Path(__file__).resolve().parents[2]

QUANTILES = (0.5, 0.2, 0.8)
#: The columns :func:`result_row` adds to every row.
ENV_COLUMNS = ("gpu", "torch", "triton", "helion", "git_commit", "tuned_config_folder")
TUNED_CONFIG_ENV = "MOELORA_TUNED_CONFIG_FOLDER"


@dataclass(frozen=True)
class Timing:
    """One timing in milliseconds: median (p50) and the 20th/80th percentiles; ``mode`` is "graph",
    "eager" or "cpu" (a study may relabel a graph timing by its L2 state, e.g. "graph_clean")."""

    ms_p50: float
    ms_p20: float
    ms_p80: float
    mode: str

    @property
    def us_p50(self) -> float:
        """The median in microseconds."""
        return self.ms_p50 * 1e3

    def as_dict(self) -> dict[str, float | str]:
        """``{"ms_p50", "ms_p20", "ms_p80", "mode"}`` for a result row."""
        return {"ms_p50": self.ms_p50, "ms_p20": self.ms_p20, "ms_p80": self.ms_p80, "mode": self.mode}


def _quantiles(times_ms: list[float]) -> tuple[float, float, float]:
    """p50, p20, p80 with linear interpolation (the definition of ``torch.quantile``)."""
    if not times_ms:
        raise ValueError("no timings")
    q = statistics.quantiles(times_ms * 2 if len(times_ms) == 1 else times_ms, n=10, method="inclusive")
    return q[4], q[1], q[7]


#: Bytes read before every repetition by the "clean" L2 flush (about 4x the H200's 60 MB L2).
CLEAN_FLUSH_BYTES = 256 * 1024 * 1024


def _elapsed_ms(fn: Callable[[], Any], n: int) -> float:
    """Mean CUDA-event time of ``n`` back-to-back calls of ``fn``, in ms."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _events(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, before: Callable[[], Any] = lambda: None):
    """do_bench's event loop: per-call CUDA-event times in ms; ``before`` (untimed, e.g. an L2 flush) runs
    ahead of every call and counts in the 5-call estimate of the repetition count, as in do_bench."""
    import torch

    def once():
        before()
        fn()

    torch.cuda.synchronize()
    estimate_ms = max(_elapsed_ms(once, 5), 1e-4)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        once()
    n_repeat = max(1, int(rep_ms / estimate_ms))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_repeat)
    ]
    for s, e in events:
        before()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


@functools.lru_cache(maxsize=1)
def _clean_flush_buffer(device_index: int):
    import torch

    return torch.ones(CLEAN_FLUSH_BYTES // 4, dtype=torch.float32, device=f"cuda:{device_index}")


def clean_l2_flush() -> Callable[[], Any]:
    """A callable that evicts the L2 by reading :data:`CLEAN_FLUSH_BYTES` (``torch.sum`` over a buffer
    allocated once per device), leaving only clean lines behind. Needs CUDA."""
    import torch

    buf = _clean_flush_buffer(torch.cuda.current_device())
    return lambda: torch.sum(buf)


def _warm_up(fn: Callable[[], Any]) -> None:
    """Three calls of ``fn`` on a side stream, then a device synchronization (CUDA)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(fn: Callable[[], Any]):
    """``fn`` warmed up as :func:`time_cuda` does and captured into a ``torch.cuda.CUDAGraph`` (replayed
    once to upload it, outside any timing); returns the graph. CUDA only."""
    import torch

    _warm_up(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on its own side stream
        fn()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_cuda(fn: Callable[[], Any], *, mode: str = "graph", flush_l2: bool | str = True,
              warmup_ms: float = 25, rep_ms: float = 100, min_reps: int | None = None) -> Timing:  # fmt: skip
    """Time ``fn()`` (capturable in graph mode) on the current CUDA device: mode "graph" (replay) or
    "eager" (launch overhead included); ``flush_l2`` True/"dirty", "clean" or False (warm L2);
    ``warmup_ms``/``rep_ms`` do_bench's budgets; ``min_reps`` raises ``rep_ms`` to about that many
    repetitions. ValueError for a bad argument; RuntimeError without CUDA."""
    import torch

    if not (isinstance(flush_l2, bool) or flush_l2 in ("dirty", "clean")):
        raise ValueError(f"flush_l2 must be True, False, 'dirty' or 'clean', got {flush_l2!r}")
    if mode not in ("graph", "eager"):
        raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
    if min_reps is not None and (isinstance(min_reps, bool) or not isinstance(min_reps, int) or min_reps < 1):
        raise ValueError(f"min_reps must be None or an int >= 1, got {min_reps!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA GPU; use studies.bench.time_cpu on the cpu profile")

    graph = capture_graph(fn) if mode == "graph" else _warm_up(fn)  # compilation, autotuning: untimed
    target = graph.replay if graph is not None else fn
    if min_reps is not None:
        rep_ms = max(rep_ms, min_reps * _elapsed_ms(target, 3))
    if flush_l2 == "clean":
        p50, p20, p80 = _quantiles(_events(target, warmup_ms, rep_ms, before=clean_l2_flush()))
    elif flush_l2:  # True or "dirty"
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(target, warmup=warmup_ms, rep=rep_ms, quantiles=[*QUANTILES])
    else:
        p50, p20, p80 = _quantiles(_events(target, warmup_ms, rep_ms))
    del graph
    return Timing(float(p50), float(p20), float(p80), mode)


def time_cpu(fn: Callable[[], Any], *, reps: int = 3, warmup: int = 1) -> Timing:
    """Wall-clock ``fn()`` (``time.perf_counter``): ``warmup`` untimed calls, then ``reps`` timed ones; mode
    "cpu". Under the interpreters the numbers are interpreter cost, never kernel performance."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(*_quantiles(times), "cpu")


#: Timing modes that mean "wall clock on the CPU" (the rows of the cpu profile say "cpu-interpreter").
CPU_MODES = ("cpu", "cpu-interpreter")


def time_fn(fn: Callable[[], Any], mode: str = "graph", device: Any = "cuda", warmup_ms: float = 25,
            rep_ms: float = 100, *, flush_l2: bool | str = True, cpu_reps: int = 1,
            min_reps: int | None = None) -> Timing:  # fmt: skip
    """The one timing dispatch of the studies: :func:`time_cuda` on a GPU; :func:`time_cpu` (``cpu_reps``
    calls, no warm-up) on a CPU device or with mode "cpu"/"cpu-interpreter". The other arguments go to
    :func:`time_cuda`."""
    import torch

    if mode in CPU_MODES or torch.device(device).type == "cpu":
        return time_cpu(fn, reps=cpu_reps, warmup=0)
    return time_cuda(fn, mode=mode, flush_l2=flush_l2, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)


def sync(device) -> None:
    """``torch.cuda.synchronize()`` when ``device`` is a CUDA device; nothing on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory(device) -> None:
    """gc and, on a GPU, a synchronize and ``torch.cuda.empty_cache()`` (between models or projections)."""
    import gc

    import torch

    gc.collect()
    sync(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth_floor_us(nbytes: float, tb_per_s: float = H200_COPY_TB_PER_S) -> float:
    """Lower bound in µs to move ``nbytes`` (read + written) at ``tb_per_s`` TB/s (default: the measured
    H200 device-to-device copy rate, :mod:`moelora_lib.hardware`). ValueError unless ``tb_per_s`` > 0."""
    if tb_per_s <= 0:
        raise ValueError("tb_per_s must be > 0")
    return float(nbytes) / (tb_per_s * 1e12) * 1e6


def compute_floor_us(flops: float, tflops: float = H200_BF16_TFLOPS) -> float:
    """Lower bound in µs to execute ``flops`` (2 per multiply-add) at ``tflops`` TFLOP/s (default: the
    measured H200 bf16 dense matmul rate). ValueError unless ``tflops`` > 0."""
    if tflops <= 0:
        raise ValueError("tflops must be > 0")
    return float(flops) / (tflops * 1e12) * 1e6


def _version(dist: str) -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return "absent"


def _run(*argv: str) -> str | None:
    """``argv``'s stripped stdout, or None when it fails or cannot be started."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _git(*args: str) -> str | None:
    return _run("git", "-C", str(REPO_ROOT), *args)


def git_commit() -> str:
    """``$MOELORA_GIT_COMMIT`` when set (the GPU job sets it: the device's copy may carry a stale ``.git``),
    else ``git rev-parse --short HEAD`` with "-dirty" if files outside ``data/`` differ, else "unknown"."""
    env = os.environ.get("MOELORA_GIT_COMMIT")
    if env:
        return env
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    status = _git("status", "--porcelain", "--", ".", ":(exclude)data")
    return head + ("-dirty" if status else "")


def _gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"gpu": "cpu", "gpu_count": 0, "driver": None, "cuda": None}
    try:
        import torch
    except ImportError:
        return info
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
        driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        info["driver"] = driver.splitlines()[0] if driver else None
    return info


@functools.lru_cache(maxsize=1)
def _static_env() -> dict[str, Any]:
    """The parts of the record that do not change within one process (computed once)."""
    rec = {**_gpu_info(), **{d: _version(d) for d in ("torch", "triton", "helion", "numpy")}}
    return dict(rec, python=platform.python_version(), git_commit=git_commit(), hostname=socket.gethostname())


def env_record() -> dict[str, Any]:
    """Where a number was measured: gpu (name or "cpu"), gpu_count, driver, cuda, torch, triton, helion,
    numpy, python, git_commit, hostname, timestamp_utc, TRITON_INTERPRET, MOELORA_TUNED_CONFIG_FOLDER."""
    rec = dict(_static_env())
    rec["timestamp_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    rec["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    rec[TUNED_CONFIG_ENV] = os.environ.get(TUNED_CONFIG_ENV)
    return rec


def result_row(**fields: Any) -> dict[str, Any]:
    """``fields`` plus the columns :data:`ENV_COLUMNS` (``tuned_config_folder``: the
    ``MOELORA_TUNED_CONFIG_FOLDER`` in force, or None); a :class:`Timing` passed as ``timing=`` becomes
    ms_p50/ms_p20/ms_p80/mode. Explicit fields win over the environment columns."""
    env = env_record()
    row = {k: env[TUNED_CONFIG_ENV if k == "tuned_config_folder" else k] for k in ENV_COLUMNS}
    timing = fields.pop("timing", None)
    if isinstance(timing, Timing):
        fields = {**timing.as_dict(), **fields}
    elif timing is not None:
        fields["timing"] = timing
    return {**fields, **{k: v for k, v in row.items() if k not in fields}}


def write_rows(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]], *, append: bool = False):
    """Write ``rows`` as a tidy CSV (parents created); ``append=True`` keeps the rows already there
    (columns unioned). Returns the DataFrame written."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame([dict(r) for r in rows])
    if append and path.exists() and path.stat().st_size > 0:
        df = pd.concat([pd.read_csv(path), df], ignore_index=True)
    df.to_csv(path, index=False)
    return df


def save_env(path: str | os.PathLike) -> dict[str, Any]:
    """Write :func:`env_record` as JSON to ``path`` atomically (parents created); returns the record."""
    rec = env_record()
    write_json_atomic(path, rec, indent=2, sort_keys=True)
    return rec


def run_side_by_side(cmds: Mapping[str, list[str]], *, envs: Mapping[str, Mapping[str, str]] | None = None,
                     timeout_s: float = 600, cwd: str | os.PathLike | None = None) -> None:  # fmt: skip
    """Start every command of ``cmds`` ({name: argv}; ``envs`` {name: environment}; ``cwd`` default the
    repository) at once and wait for all. RuntimeError naming the command with its output tail when one
    exits non-zero or the group outlives ``timeout_s``; the others are stopped then."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moelora_side_by_side_") as tmp:
        procs: dict[str, tuple[list[str], subprocess.Popen, str]] = {}
        try:
            for name, cmd in cmds.items():
                log = os.path.join(tmp, f"{len(procs)}.log")
                with open(log, "w") as f:
                    env = None if envs is None else dict(envs[name])
                    kw = dict(stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(cwd or REPO_ROOT))
                    proc = subprocess.Popen(cmd, **kw)
                procs[name] = (cmd, proc, log)
            deadline = time.monotonic() + timeout_s
            for cmd, proc, log in procs.values():
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{' '.join(cmd[:6])} timed out after {timeout_s:.0f} s") from None
                if proc.returncode != 0:
                    with open(log) as f:
                        tail = f.read()[-3000:]
                    raise RuntimeError(f"{' '.join(cmd[:6])} failed (rc {proc.returncode}):\n{tail}")
        finally:
            for _, proc, _ in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def data_path(*parts: str) -> Path:
    """``<repo>/data/<parts...>``, whatever the kernel's working directory is."""
    return REPO_ROOT.joinpath("data", *parts)
