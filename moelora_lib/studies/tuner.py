"""The tuning engine that :mod:`.tuning` (MoE LoRA ops and base GEMMs), :mod:`.dense_tuning` (dense LoRA)
and :mod:`.fused_tuning` (stage ``fused``'s two GEMMs) configure.

A tuner supplies its workloads, its candidate lists and a timer per BLOCK_SIZE_M; the engine checks the
arguments, sweeps (:func:`sweep`, :func:`choose_bm`), logs trials (:class:`TrialLog`), saves configs
(:class:`ConfigFiles`) and loops over workloads (:func:`run_workloads`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import configs
from ..common import parse_dtype
from ..kernels.config import OpConfig
from ..shapes import check_int, get_shape
from . import bench

#: The trial columns of every trials CSV, and the run columns that close them.
TRIAL_COLUMNS = (
    *("op", "BLOCK_SIZE_M", "config", "config_json", "ms_p50", "ms_p20", "ms_p80", "mode"),
    *("default_ms", "sum_ms"),
)
RUN_COLUMNS = ("elapsed_s", "note", "gpu", "torch", "triton", "git_commit", "timestamp_utc")
#: The ``note`` of a workload, and of a BLOCK_SIZE_M of one in progress, that the budget skipped.
BUDGET_WORKLOAD_NOTE = "budget spent: workload not tuned"
BUDGET_BM_NOTE = "budget spent: BM skipped"
#: The warm-up and repetition budgets (ms) of one timed candidate (do_bench's defaults).
WARMUP_MS, REP_MS = 5.0, 20.0


# --- Argument checks: ValueError naming the argument (``name`` None: no prefix, argparse adds the flag) -----
def _pfx(name: str | None) -> str:
    return f"{name}: " if name else ""


def check_device(device, name: str | None = "device") -> torch.device:
    """The tuning device (None: cuda if available, else cpu); ValueError naming ``name`` for one the tuner
    cannot use here."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bad = f"{_pfx(name)}expected 'cpu', 'cuda' or 'cuda:N', got {device!r}"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(bad)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(bad) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(bad)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{_pfx(name)}{device!r} needs a CUDA GPU and this machine has none; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise ValueError(f"{_pfx(name)}{device!r} but this machine has {n} CUDA device(s)")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{_pfx(name)}'cpu' runs the kernels through the Triton interpreter: set TRITON_INTERPRET=1 "
            "in the environment before starting the tuner"
        )
    return dev


def _check_writable_parent(p: Path, name: str | None, what: str) -> None:
    base = p.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{_pfx(name)}cannot make {what}: {str(base)!r} is a file")
    if not os.access(base, os.W_OK):
        raise ValueError(f"{_pfx(name)}{str(base)!r} is not writable")


def check_out(out, name: str | None = "out") -> Path:
    """``out`` must be a folder, or a path where one can be made (the tuner writes JSON files into it)."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise ValueError(f"{_pfx(name)}expected a folder path, got {out!r}")
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{_pfx(name)}{str(out)!r} exists and is not a folder (the tuner writes JSON files)")
    _check_writable_parent(p, name, f"the folder {str(out)!r}")
    return p


def check_csv(csv_path, name: str | None, key_columns: Sequence[str], tuner: str = "this tuner") -> Path:
    """``csv_path`` must be a trials CSV of ``tuner`` (every column of ``key_columns``), an empty file, or a
    new file in a writable folder."""
    if not isinstance(csv_path, (str, os.PathLike)) or not str(csv_path):
        raise ValueError(f"{_pfx(name)}expected a file path, got {csv_path!r}")
    p = Path(csv_path)
    if p.is_dir():
        raise ValueError(f"{_pfx(name)}{str(csv_path)!r} is a folder; expected a CSV file path")
    if p.exists() and p.stat().st_size > 0:
        with open(p, newline="") as f:
            header = next(csv.reader(f), [])
        missing = [c for c in key_columns if c not in header]
        if missing:
            raise ValueError(
                f"{_pfx(name)}{str(csv_path)!r} is not a trials CSV of {tuner} (no columns {missing}); "
                "pass a new file name"
            )
    elif not p.exists():
        _check_writable_parent(p.parent, name, repr(str(csv_path)))
    return p


def check_budget(budget_s, name: str = "budget_s") -> float:
    """``budget_s`` must be a number of seconds >= 0 (inf = no budget; not NaN, not a bool)."""
    if not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or not budget_s >= 0:
        raise ValueError(f"{name}: expected a number of seconds >= 0 (inf = no budget), got {budget_s!r}")
    return float(budget_s)


def check_ints(name: str, values, lo: int = 1, *, allow_empty: bool = False) -> list[int]:
    """``values`` must be a list of ints >= ``lo`` (non-empty unless ``allow_empty``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a list of ints >= {lo}, got {values!r}")
    if not values and not allow_empty:
        raise ValueError(f"{name}: expected a non-empty list of ints >= {lo}, got an empty list")
    return [check_int(name, v, lo) for v in values]


def check_models(models, name: str = "models") -> list:
    """``models`` must be a non-empty list of MoE preset names; returns their :class:`MoEShape`\\ s."""
    if isinstance(models, str) or not isinstance(models, Sequence) or not models:
        raise ValueError(f"{name}: expected a non-empty list of preset names, got {models!r}")
    try:
        return [get_shape(m) for m in models]
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


# --- argparse types: a ValueError becomes argparse's error for the flag (exit code 2) -----------------------
def arg_type(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


def parse_int(text: str, lo: int | None = None) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise ValueError(f"expected an int{'' if lo is None else f' >= {lo}'}, got {text!r}") from None
    if lo is not None and v < lo:
        raise ValueError(f"expected an int >= {lo}, got {v}")
    return v


def int_type(lo: int | None) -> Callable[[str], int]:
    return arg_type(lambda t: parse_int(t, lo), "int" if lo is None else f"int >= {lo}")


def int_list_type(lo: int = 1, *, allow_empty: bool = False) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        parts = [x for x in text.split(",") if x.strip()]
        if not parts and not allow_empty:
            raise ValueError(f"expected comma-separated ints >= {lo}, got {text!r}")
        try:
            return [parse_int(x, lo) for x in parts]
        except ValueError as e:
            raise ValueError(f"comma-separated ints >= {lo}: {e}") from None

    return arg_type(parse, "int list")


def _budget(text: str) -> float:
    try:
        return check_budget(float(text), "")
    except ValueError:
        raise ValueError(f"expected seconds >= 0 (inf = no budget), got {text!r}") from None


#: Every tuner argument -> its CLI flag: the name a command-line error gives (``names=FLAGS``).
FLAGS = dict(
    models="--model", projections="--projections", ranks="--ranks", rank="--rank", copy_ranks="--copy-ranks",
    adapters="--adapters", tokens="--tokens", out="--out", csv_path="--csv", budget_s="--budget-s",
    device="--device", dtype="--dtype", max_bms="--max-bms", max_cands="--max-candidates", seed="--seed",
    jobs="--jobs", warmup_ms="--warmup-ms", rep_ms="--rep-ms", l2="--l2", weight_format="--weight-format",
)  # fmt: skip


def parser(prog: str, doc: str, tokens: str) -> argparse.ArgumentParser:
    """The command line every tuner shares (``--tokens`` default ``tokens``); a malformed number exits with
    code 2."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(doc.split("\n\n")[0].split()).rstrip(":"))
    add = p.add_argument
    add("--tokens", default=tokens, type=int_list_type(1), help="T values, comma-separated")
    add("--adapters", type=int_type(1), default=8, help="L, adapter slots")
    add("--out", required=True, help="config folder to write the JSON files into")
    add("--csv", required=True, help="trials CSV (appended; resumable)")
    add(
        "--budget-s", type=arg_type(_budget, "seconds"), default=math.inf, help="no workload starts past this"
    )
    add("--device", default=None, help="cuda or cpu (default: cuda if available)")
    add("--dtype", default=None, help="bfloat16 (GPU default), float16 or float32 (CPU default)")
    add("--max-bms", type=int_type(1), default=None, help="BLOCK_SIZE_M candidates (+ the default's)")
    add("--max-candidates", "--max-cands", dest="max_cands", type=int_type(1), help="configs per op and BM")
    add("--seed", type=int_type(None), default=0)
    add("--no-progress", action="store_true")
    return p


def check_run(names, *, tokens, budget_s, device, dtype, out, csv_path, key_columns, what, ints,
              lists=None) -> tuple[torch.device, torch.dtype]:  # fmt: skip
    """The arguments every tuner takes, before any work: ValueError naming the argument (``names``: argument
    -> name). ``ints``: {argument: (value, lo, hi)}; ``lists``: {argument: (values, allow_empty)}. Returns
    (device, dtype)."""
    names = names or {}
    for a, (v, allow_empty) in {"tokens": (tokens, False), **(lists or {})}.items():
        check_ints(names.get(a, a), v, allow_empty=allow_empty)
    for a, (v, lo, hi) in ints.items():
        check_int(names.get(a, a), v, lo, hi)
    check_budget(budget_s, names.get("budget_s", "budget_s"))
    n_dev, n_dt = names.get("device", "device"), names.get("dtype", "dtype")
    dev = check_device(device, n_dev)
    default = torch.bfloat16 if dev.type == "cuda" else torch.float32
    try:
        dt = parse_dtype(dtype) if dtype is not None else default
    except ValueError as e:
        raise ValueError(f"{n_dt}: {e}") from None
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{n_dt}: expected float16, bfloat16 or float32, got {dtype!r}")
    if dev.type == "cpu" and dt == torch.bfloat16:
        raise ValueError(
            f"{n_dt}: bfloat16 does not run on the CPU (Triton's interpreter); use float16 or float32"
        )
    check_out(out, names.get("out", "out"))
    check_csv(csv_path, names.get("csv_path", "csv_path"), key_columns, what)
    return dev, dt


# --- Candidates, the trials CSV, timing ---------------------------------------------------------------------
def dedupe(cands: list[OpConfig], limit: int) -> list[OpConfig]:
    """``cands`` without repeats (first kept), at most ``limit``."""
    out: list[OpConfig] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:limit]


def with_bm(cfg, fields: Sequence[str], bm: int):
    """``cfg`` (a LayerConfig) with BLOCK_SIZE_M = ``bm`` in the OpConfig ``fields``."""
    return cfg.replace(**{f: dataclasses.replace(getattr(cfg, f), BLOCK_SIZE_M=bm) for f in fields})


class TrialLog:
    """A tuner's trials CSV: rows already there are read once (resume); every new row is appended and flushed
    at once, stamped with gpu, torch, triton, git_commit and timestamp_utc."""

    def __init__(self, path: Path, columns: Sequence[str]):
        self.path, self.columns = Path(path), list(columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                self.rows = list(csv.DictReader(f))
        env = bench.env_record()
        self.env = {k: env.get(k) for k in ("gpu", "torch", "triton", "git_commit")}

    def append(self, **row) -> None:
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        row = {**self.env, **row, "timestamp_utc": now}
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)
        self.rows.append({k: "" if row.get(k) is None else str(row.get(k)) for k in self.columns})

    def config_row(self, kind: str, ids: dict, op: str, cfg: OpConfig, *, t0: float | None = None, **more):
        """One row of ``kind`` about ``cfg`` of ``op``: ``ids``, BLOCK_SIZE_M, config, config_json, elapsed_s
        and ``more``."""
        if t0 is not None:
            more["elapsed_s"] = round(time.perf_counter() - t0, 2)
        cj = json.dumps(cfg.to_dict())
        self.append(
            kind=kind, **ids, op=op, BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, config=cfg.short(), config_json=cj, **more
        )

    def choices(self, ops: Sequence[str], **match) -> dict[str, OpConfig]:
        """{op: config} of the ``choice`` / ``copied`` rows matching ``match``, if every op of ``ops`` has
        one, else empty."""
        want = {k: str(v) for k, v in match.items() if v is not None}
        out = {}
        for r in self.rows:
            if r.get("kind") in ("choice", "copied") and all(r.get(k) == v for k, v in want.items()):
                out[r["op"]] = OpConfig.from_dict(json.loads(r["config_json"]), where=str(self.path))
        return out if set(out) >= set(ops) else {}


def over_budget(deadline: float, log: TrialLog, note: str, **ids) -> bool:
    """True, with a ``note`` row (``ids``) in the log, when the clock is past ``deadline``."""
    if time.perf_counter() <= deadline:
        return False
    log.append(kind="note", **ids, note=note)
    return True


def time_candidate(timer: Callable[[], Any], device: torch.device, cpu_mode: str | None = None):
    """Time one candidate (``timer()``). Returns (ms_p50, {ms_p20, ms_p80, mode}, note); a failing config
    gives (inf, {}, "failed: <error>")."""
    try:
        tm = timer()
    except Exception as e:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return math.inf, {}, f"failed: {type(e).__name__}: {str(e)[:160]}"
    mode = cpu_mode if cpu_mode is not None and device.type == "cpu" else tm.mode
    return tm.ms_p50, dict(ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, mode=mode), ""


def sweep(
    bms: Sequence[int],
    prepare: Callable[[int], Callable[[str, OpConfig], Any]],
    ops: Sequence[str],
    candidates: Callable[[str, int], list[OpConfig]],
    device: torch.device,
    log: TrialLog,
    ids: dict,
    *,
    deadline: float,
    t0: float,
    first_note: str = "default",
    fixed: dict[str, OpConfig] | None = None,
    cpu_mode: str | None = None,
) -> dict[int, dict[str, list[tuple[float, OpConfig]]]]:
    """Time every candidate of every op at every BLOCK_SIZE_M: per ``bm`` ``prepare(bm)`` returns a timer
    ``(op, config) -> Timing``, each op's ``candidates(op, bm)`` (``fixed`` ops: that config alone) gives one
    ``trial`` row each, then one ``bm_sum`` row; no BM after the first starts past ``deadline``. Returns
    ``ranked[bm][op]``: [(ms, config)] fastest first."""
    fixed = fixed or {}
    ranked: dict[int, dict[str, list[tuple[float, OpConfig]]]] = {}
    for n_bm, bm in enumerate(bms):
        if n_bm > 0 and over_budget(deadline, log, BUDGET_BM_NOTE, **ids, BLOCK_SIZE_M=bm):
            continue
        timer = prepare(bm)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ranked[bm] = {}
        for op in ops:
            cands = [fixed[op]] if op in fixed else candidates(op, bm)
            first = "shared entry (not tuned here)" if op in fixed else first_note
            res, default_ms = [], None
            for i, c in enumerate(cands):
                ms, extra, err = time_candidate(lambda: timer(op, c), device, cpu_mode)  # noqa: B023
                if i == 0 and op not in fixed:
                    default_ms = ms
                note = " ".join(x for x in (first if i == 0 else "", err) if x)
                log.config_row(
                    "trial", ids, op, c, t0=t0, ms_p50=ms, default_ms=default_ms, note=note, **extra
                )
                res.append((ms, c))
            ranked[bm][op] = sorted(res, key=lambda r: r[0])
        best = {op: ranked[bm][op][0] for op in ops}
        log.append(
            kind="bm_sum",
            **ids,
            BLOCK_SIZE_M=bm,
            sum_ms=sum(b[0] for b in best.values()),
            config=";".join(f"{op}={b[1].short()}" for op, b in best.items()),
        )
    return ranked


def graph_timer(run, device: torch.device, adapt=lambda op, c: c):
    """The timer of one op of ``run`` (a LayerRun) alone, candidate c launched as ``adapt(op, c)``: graph
    replay, L2 flushed; ``run`` is called once first."""
    run()
    return lambda op, c: bench.time_fn(run.op_fn(op, adapt(op, c)), "graph", device, WARMUP_MS, REP_MS)


def tune_layer_ops(stage: str, shape, T: int, weights, cfg, fields: Sequence[str], ops: Sequence[str],
                   bms: Sequence[int], candidates, device, log: TrialLog, ids: dict, *, what: str,
                   activation_scheme: str = "auto", **sweep_kw):  # fmt: skip
    """:func:`sweep` then :func:`choose_bm` over ``ops`` of a LayerRun of ``stage`` on ``shape``'s seeded
    inputs of T tokens (``weights``: a layer_inputs of this shape, R, L; ``activation_scheme`` as in
    :func:`~.moe_bench.make_run`). Returns {op: OpConfig}, empty when the budget left no BM."""
    from ..kernels.stages import packed_config
    from .moe_bench import layer_inputs, make_run

    inp = layer_inputs(shape, T, pattern="uniform", weights=weights, seed=0, activation="silu", bias=False)

    f = dict(zip(ops, fields))  # op -> its LayerConfig field

    def prepare(bm: int):  # a candidate runs as the layer runs that file entry: adapted to packed experts
        run = make_run(stage, inp, with_bm(cfg, fields, bm), activation_scheme=activation_scheme)
        sc = "dynamic" if getattr(run, "w8a8", False) else "weight_only"
        adapt = lambda op, c: getattr(packed_config(cfg.replace(**{f[op]: c}), inp.w13, sc), f[op])  # noqa: E731
        return graph_timer(run, device, adapt)

    ranked = sweep(bms, prepare, ops, candidates, device, log, ids, **sweep_kw)
    return choose_bm(ranked, ops, log, ids, t0=sweep_kw["t0"], what=what) if ranked else {}


def layer_weights(cache: dict, shape, R: int, L: int, dtype, device: torch.device, seed: int,
                  weight_format: str = "dense"):  # fmt: skip
    """The seeded weight set of (``shape``, R) (a layer_inputs without biases, experts in ``weight_format``)
    in ``cache``, made after every other entry is dropped."""
    from .moe_bench import layer_inputs

    key = (shape.name, R, weight_format)
    if key not in cache:
        cache.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        kw = dict(rank=R, num_adapters=L, dtype=dtype, device=device, seed=seed, bias=False)
        cache[key] = layer_inputs(shape, 1, weight_format=weight_format, **kw)
    return cache[key]


def choose_bm(ranked, ops: Sequence[str], log: TrialLog, ids: dict, *, t0: float, what: str):
    """The BLOCK_SIZE_M whose ops' best medians sum lowest: one ``choice`` row per op, returns {op: config}.
    RuntimeError naming ``what`` when no candidate ran."""
    total = {bm: sum(r[op][0][0] for op in ops) for bm, r in ranked.items()}
    win = min(total, key=total.get)
    if not math.isfinite(total[win]):
        raise RuntimeError(f"{what}: no candidate ran")
    chosen = {op: ranked[win][op][0] for op in ops}
    for op, (ms, c) in chosen.items():
        log.config_row("choice", ids, op, c, t0=t0, ms_p50=ms, sum_ms=total[win])
    return {op: c for op, (_, c) in chosen.items()}


# --- The JSON files and the loop over workloads -------------------------------------------------------------
class ConfigFiles:
    """The JSON config files of ``ops`` in ``folder``, named ``name(gpu, op)``, read once, updated in memory,
    saved atomically."""

    def __init__(self, folder: Path, gpu: str, ops: Sequence[str], name: Callable[[str, str], str]):
        self.folder, self.gpu, self.name = Path(folder), gpu, name
        self.data: dict[str, dict] = {}
        for op in ops:
            p = self.path(op)
            self.data[op] = json.loads(json.dumps(configs.load_config_file(p, op))) if p.is_file() else {}

    def path(self, op: str) -> Path:
        return self.folder / self.name(self.gpu, op)

    def put(self, op: str, keys: tuple[int, ...], leaf) -> None:
        configs.set_entry(self.data[op], keys, leaf)

    def save(self) -> None:
        for op, d in self.data.items():
            if d:
                configs.save_config_file(self.path(op), d)


def run_workloads(
    jobs: Sequence,
    log: TrialLog,
    files: ConfigFiles,
    summary: dict[str, Any],
    *,
    label: Callable[[Any], tuple],
    ids: Callable[[Any], dict],
    todo: Callable[[Any], bool],
    tune: Callable[[Any], bool],
    deadline: float,
    t0: float,
    progress: bool,
    desc: str,
) -> dict[str, Any]:
    """Each job in order: ``skipped`` when not ``todo(job)``, ``not_tuned`` past ``deadline``, else
    ``tune(job)`` (True: ``tuned``, False: ``conflicts``); the files saved after each."""
    from .notebook import progress as bar_of

    for k in ("tuned", "skipped", "not_tuned", "conflicts"):
        summary.setdefault(k, [])
    bar = bar_of(list(jobs), desc=desc, disable=not progress)
    for j in bar:
        bar.set_postfix_str(f"{' '.join(map(str, label(j)))} {time.perf_counter() - t0:.0f}s")
        if not todo(j):
            key = "skipped"
        elif over_budget(deadline, log, BUDGET_WORKLOAD_NOTE, **ids(j)):
            key = "not_tuned"
        else:
            key = "tuned" if tune(j) else "conflicts"
        summary[key].append(label(j))
        files.save()
    return summary


def summary_line(prog: str, s: dict[str, Any], more: str = "") -> str:
    """The one line a tuner's command line prints about its summary ``s`` (``more`` after the budget part)."""
    return (
        f"{prog}: {len(s['tuned'])} workloads tuned, {len(s['skipped'])} already done, "
        f"{len(s['not_tuned'])} not tuned (budget): {s['not_tuned']}{more}; wrote {s['out']} ({s['gpu']}); "
        f"elapsed {s['elapsed_s']:.1f} s"
    )


def finish(log: TrialLog, summary: dict[str, Any], t0: float, note: str = "") -> dict[str, Any]:
    """The closing ``session`` row (elapsed_s, the count of each list in ``summary``, ``note``)."""
    summary["elapsed_s"] = time.perf_counter() - t0
    counts = ", ".join(f"{k.replace('_', ' ')} {len(v)}" for k, v in summary.items() if isinstance(v, list))
    log.append(kind="session", elapsed_s=round(summary["elapsed_s"], 2), note=counts + note)
    return summary
