"""What the two tuners share (:mod:`.tuning`, the MoE tuner; :mod:`.dense_tuning`, the dense one).

- Argument checks that name the argument (or its CLI flag): :func:`check_device`, :func:`check_out`,
  :func:`check_csv`, :func:`check_budget`.
- argparse ``type=`` helpers (a bad flag exits with code 2 and one line naming it): :func:`arg_type`,
  :func:`parse_int`, :func:`int_list_type`, :func:`budget_type`, :func:`path_type`.
- The trials CSV, appended row by row and read back to resume: :class:`TrialLog`,
  :func:`append_config_row`, :func:`time_candidate`, :func:`over_budget`.
- The JSON config files of one folder, read once and saved atomically: :class:`ConfigFiles`.
- :func:`dedupe`: a candidate list without repeats, cut to a limit.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import configs
from ..kernels.config import OpConfig

__all__ = [
    "pfx",
    "first_existing",
    "check_device",
    "check_out",
    "check_csv",
    "check_budget",
    "arg_type",
    "parse_int",
    "int_list_type",
    "budget_type",
    "path_type",
    "dedupe",
    "TrialLog",
    "append_config_row",
    "time_candidate",
    "over_budget",
    "ConfigFiles",
    "BUDGET_WORKLOAD_NOTE",
    "BUDGET_BM_NOTE",
    "TRIAL_COLUMNS",
    "RUN_COLUMNS",
    "choose_bm",
    "sweep_bms",
    "with_bm",
]

#: The trial columns of both trials CSVs (after each tuner's workload columns), and the run columns
#: that close them (:class:`TrialLog` fills gpu ... timestamp_utc).
TRIAL_COLUMNS = (
    "op",
    "BLOCK_SIZE_M",
    "config",
    "config_json",
    "ms_p50",
    "ms_p20",
    "ms_p80",
    "mode",
    "default_ms",
    "sum_ms",
)
RUN_COLUMNS = ("elapsed_s", "note", "gpu", "torch", "triton", "git_commit", "timestamp_utc")
#: The ``note`` of a workload, and of a BLOCK_SIZE_M of one in progress, that the budget skipped.
BUDGET_WORKLOAD_NOTE = "budget spent: workload not tuned"
BUDGET_BM_NOTE = "budget spent: BM skipped"


# ------------------------------------------------------------------------------------------------
# Argument checks (ValueError naming the argument; ``name`` None: no prefix, argparse adds the flag)
# ------------------------------------------------------------------------------------------------
def pfx(name: str | None) -> str:
    return f"{name}: " if name else ""


def first_existing(p: Path) -> Path:
    """``p`` or its nearest existing parent (absolute)."""
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_device(device, name: str | None = "device") -> torch.device:
    """The tuning device: None = cuda if available, else cpu. ValueError naming ``name`` for a device
    the tuner cannot use here (not cpu/cuda, cuda without a GPU, a missing GPU index, cpu without the
    Triton interpreter)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{pfx(name)}expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{pfx(name)}expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{pfx(name)}the tuner runs on 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{pfx(name)}{device!r} needs a CUDA GPU and this machine has none; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{pfx(name)}{device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    else:
        from ..moe_lora import _check_cpu_backend

        try:
            _check_cpu_backend(torch.float32)
        except ValueError:
            raise ValueError(
                f"{pfx(name)}'cpu' runs the kernels through the Triton interpreter: set TRITON_INTERPRET=1 "
                "in the environment before starting the tuner"
            ) from None
    return dev


def _check_writable_parent(p: Path, name: str | None, what: str) -> None:
    """``p``'s nearest existing parent must be a writable folder (``what``: the path in the message)."""
    base = first_existing(p)
    if not base.is_dir():
        raise ValueError(f"{pfx(name)}cannot make {what}: {str(base)!r} is a file")
    if not os.access(base, os.W_OK):
        raise ValueError(f"{pfx(name)}{str(base)!r} is not writable")


def check_out(out, name: str | None = "out") -> Path:
    """``out`` must be a folder, or a path where one can be made."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise ValueError(f"{pfx(name)}expected a folder path, got {out!r}")
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(
            f"{pfx(name)}{str(out)!r} exists and is not a folder (the tuner writes JSON files into it)"
        )
    _check_writable_parent(p, name, f"the folder {str(out)!r}")
    return p


def check_csv(csv_path, name: str | None, key_columns: Sequence[str], tuner: str = "this tuner") -> Path:
    """``csv_path`` must be a trials CSV of ``tuner`` (one with every column of ``key_columns``:
    resumed), an empty file, or a new file in a writable folder."""
    if not isinstance(csv_path, (str, os.PathLike)) or not str(csv_path):
        raise ValueError(f"{pfx(name)}expected a file path, got {csv_path!r}")
    p = Path(csv_path)
    if p.is_dir():
        raise ValueError(f"{pfx(name)}{str(csv_path)!r} is a folder; expected a CSV file path")
    if p.exists():
        if p.stat().st_size > 0:
            with open(p, newline="") as f:
                header = next(csv.reader(f), [])
            missing = [c for c in key_columns if c not in header]
            if missing:
                raise ValueError(
                    f"{pfx(name)}{str(csv_path)!r} is not a trials CSV of {tuner} "
                    f"(no columns {missing}); pass a new file name"
                )
    else:
        _check_writable_parent(p.parent, name, repr(str(csv_path)))
    return p


def check_budget(budget_s, name: str) -> None:
    """``budget_s`` must be a number of seconds >= 0 (inf = no budget; not NaN, not a bool)."""
    if not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or not budget_s >= 0:
        raise ValueError(f"{name}: expected a number of seconds >= 0 (inf = no budget), got {budget_s!r}")


# ------------------------------------------------------------------------------------------------
# argparse types
# ------------------------------------------------------------------------------------------------
def arg_type(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse ``type=``: ``fn``'s ValueError becomes argparse's error for the flag (exit code 2)."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


def parse_int(text: str, lo: int | None) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise ValueError(f"expected an int{'' if lo is None else f' >= {lo}'}, got {text!r}") from None
    if lo is not None and v < lo:
        raise ValueError(f"expected an int >= {lo}, got {v}")
    return v


def int_list_type(lo: int, *, allow_empty: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> list[int]:
        parts = [x for x in text.split(",") if x.strip()]
        if not parts and not allow_empty:
            raise ValueError(f"expected comma-separated ints >= {lo}, got {text!r}")
        try:
            return [parse_int(x, lo) for x in parts]
        except ValueError as e:
            raise ValueError(f"comma-separated ints >= {lo}: {e}") from None

    return arg_type(parse, "int list")


def budget_type(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"expected seconds >= 0 (inf = no budget), got {text!r}") from None
    if not v >= 0:
        raise ValueError(f"expected seconds >= 0 (inf = no budget), got {text!r}")
    return v


def path_type(check: Callable[..., Path]) -> Callable[[str], Any]:
    def parse(text: str) -> str:
        check(text, None)
        return text

    return parse


# ------------------------------------------------------------------------------------------------
# Candidates, the trials CSV, the budget
# ------------------------------------------------------------------------------------------------
def dedupe(cands: list[OpConfig], limit: int) -> list[OpConfig]:
    """``cands`` without repeats (first kept), at most ``limit``."""
    out: list[OpConfig] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:limit]


class TrialLog:
    """A tuner's trials CSV (columns ``columns``): the rows already there are read once (resume),
    every new row is appended and flushed at once, stamped with the environment (gpu, torch, triton,
    git_commit) and timestamp_utc; ``rows`` holds them all as strings (as read back)."""

    def __init__(self, path: Path, columns: Sequence[str]):
        from . import bench

        self.path = Path(path)
        self.columns = list(columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                self.rows = list(csv.DictReader(f))
        env = bench.env_record()
        self.env = {k: env.get(k) for k in ("gpu", "torch", "triton", "git_commit")}

    def append(self, **row) -> None:
        row = {
            **self.env,
            **row,
            "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)
            f.flush()
        self.rows.append({k: ("" if row.get(k) is None else str(row.get(k))) for k in self.columns})


def append_config_row(
    log: TrialLog, kind: str, ids: dict, op: str, bm: int, cfg: OpConfig, *, t0: float | None = None, **more
) -> None:
    """One row of ``kind`` about config ``cfg`` of ``op`` at BLOCK_SIZE_M ``bm``: the workload's
    ``ids``, config (short) and config_json, elapsed_s since ``t0`` (when given) and ``more``."""
    if t0 is not None:
        more["elapsed_s"] = round(time.perf_counter() - t0, 2)
    log.append(
        kind=kind,
        **ids,
        op=op,
        BLOCK_SIZE_M=bm,
        config=cfg.short(),
        config_json=json.dumps(cfg.to_dict()),
        **more,
    )


def time_candidate(
    timer: Callable[[], Any], device: torch.device, note: str, err_chars: int, cpu_mode: str | None = None
) -> tuple[float, dict[str, Any], str]:
    """Time one candidate: ``timer()`` builds and times the op (a :class:`~.bench.Timing`). Returns
    (ms_p50, the columns ms_p20 / ms_p80 / mode, ``note``); a config that does not compile or fit is
    recorded, not raised: (inf, {}, ``note`` + "failed: <error, at most err_chars>"), after a device
    sync on a GPU. ``cpu_mode``: the mode written for CPU timings (interpreter wall clock)."""
    try:
        tm = timer()
        mode = cpu_mode if cpu_mode is not None and device.type == "cpu" else tm.mode
        return tm.ms_p50, dict(ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, mode=mode), note
    except Exception as e:
        note = (note + " " if note else "") + f"failed: {type(e).__name__}: {str(e)[:err_chars]}"
        if device.type == "cuda":
            torch.cuda.synchronize()
        return math.inf, {}, note


def with_bm(cfg, fields: Sequence[str], bm: int):
    """``cfg`` (a LayerConfig) with BLOCK_SIZE_M = ``bm`` in the OpConfig ``fields`` (ops sharing one
    alignment)."""
    import dataclasses

    return cfg.replace(**{f: dataclasses.replace(getattr(cfg, f), BLOCK_SIZE_M=bm) for f in fields})


def sweep_bms(
    bms: Sequence[int],
    make_bm_run: Callable[[int], Any],
    ops: Sequence[str],
    candidates: Callable[[str, int], list[OpConfig]],
    device: torch.device,
    log: TrialLog,
    ids: dict,
    *,
    deadline: float,
    t0: float,
    first_note: str = "default",
) -> dict[int, dict[str, tuple[float, OpConfig]]]:
    """Time every candidate of every op at every BLOCK_SIZE_M (the loop both MoE tuners share).

    Per ``bm``: ``make_bm_run(bm)`` builds the layer's run (called once, untimed, to compile), then each
    op's ``candidates(op, bm)`` (the first marked ``first_note``) is timed alone through ``run.op_fn``
    (graph replay, L2 flushed, warm-up 5 ms, rep 20 ms): one ``trial`` row each (with ``default_ms``,
    the first candidate's time), one ``bm_sum`` row per BM. No BM after the first starts past
    ``deadline`` (a :data:`BUDGET_BM_NOTE` row instead). Returns ``best[bm][op] = (ms, config)``, for
    :func:`choose_bm`."""
    from . import bench

    def timer(run, op, c):
        return bench.time_fn(run.op_fn(op, c), "graph", device, 5, 20)

    best: dict[int, dict[str, tuple[float, OpConfig]]] = {}
    for n_bm, bm in enumerate(bms):
        if n_bm > 0 and over_budget(deadline, log, BUDGET_BM_NOTE, **ids, BLOCK_SIZE_M=bm):
            continue
        run = make_bm_run(bm)
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best[bm] = {}
        for op in ops:
            default_ms = None
            for i, c in enumerate(candidates(op, bm)):
                ms, extra, note = time_candidate(
                    functools.partial(timer, run, op, c), device, first_note if i == 0 else "", 120
                )
                if i == 0:
                    default_ms = ms
                append_config_row(
                    log, "trial", ids, op, bm, c, t0=t0, ms_p50=ms, default_ms=default_ms, note=note, **extra
                )
                if op not in best[bm] or ms < best[bm][op][0]:
                    best[bm][op] = (ms, c)
        log.append(
            kind="bm_sum",
            **ids,
            BLOCK_SIZE_M=bm,
            sum_ms=sum(best[bm][op][0] for op in ops),
            config=";".join(f"{op}={best[bm][op][1].short()}" for op in ops),
        )
        del run
    return best


def choose_bm(
    best: dict[int, dict[str, tuple[float, OpConfig]]],
    ops: Sequence[str],
    log: TrialLog,
    ids: dict,
    *,
    t0: float,
    what: str,
) -> dict[str, OpConfig]:
    """The BLOCK_SIZE_M whose ops' best medians sum lowest (``best[bm][op] = (ms, config)``; vLLM's
    ``benchmark_lora_tuning.py`` rule): one ``choice`` row per op in ``log``, returns {op: config}.
    Raises RuntimeError (naming ``what``) when no candidate ran (every sum infinite)."""
    win = min(best, key=lambda bm: sum(best[bm][op][0] for op in ops))
    total = sum(best[win][op][0] for op in ops)
    if not math.isfinite(total):
        raise RuntimeError(f"{what}: no candidate ran")
    chosen = {op: best[win][op][1] for op in ops}
    for op, c in chosen.items():
        append_config_row(log, "choice", ids, op, win, c, t0=t0, ms_p50=best[win][op][0], sum_ms=total)
    return chosen


def over_budget(deadline: float, log: TrialLog, note: str, **ids) -> bool:
    """True, with a ``note`` row (``ids``) in the log, when the clock is past ``deadline``."""
    if time.perf_counter() <= deadline:
        return False
    log.append(kind="note", **ids, note=note)
    return True


# ------------------------------------------------------------------------------------------------
# The JSON files
# ------------------------------------------------------------------------------------------------
class ConfigFiles:
    """The JSON config files of ``ops`` in one folder (:mod:`moelora_lib.configs` format), read once,
    updated in memory (``data[op]``), saved atomically (:func:`moelora_lib.configs.save_config_file`).
    Subclasses name the files (:meth:`path`)."""

    def __init__(self, folder: Path, gpu: str, ops: Sequence[str]):
        self.folder, self.gpu = Path(folder), gpu
        self.data: dict[str, dict] = {}
        for op in ops:
            p = self.path(op)
            self.data[op] = json.loads(json.dumps(configs.load_config_file(p, op))) if p.is_file() else {}

    def path(self, op: str) -> Path:
        raise NotImplementedError

    def save(self) -> None:
        for op, d in self.data.items():
            if d:
                configs.save_config_file(self.path(op), d)
