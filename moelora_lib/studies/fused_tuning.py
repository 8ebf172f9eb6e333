"""Tuner of stage ``fused``'s two GEMMs (notebook 12): the gate_up GEMM with the LoRA expand and the
activation in it (``fused_gate_up``) and the down GEMM with its expand (``fused_down``)::

    python -m moelora_lib.studies.fused_tuning --model gpt-oss-20b,qwen3-30b-a3b \\
        --tokens 1,8,64,256,1600,8192 --rank 32 --adapters 8 \\
        --out moelora_lib/configs/NVIDIA_H200 --csv data/12_fused_tuning.csv --budget-s 240

Per workload (model, T, R, L), through :mod:`.tuner`: the two GEMMs share one BLOCK_SIZE_M; per candidate
BM each GEMM is timed alone over :func:`fused_op_candidates`, and the BM with the smallest sum of the two
best medians wins, merged into ``{gpu}_FUSED_MOE_LORA_FUSED.json``. CSV kinds: trial / bm_sum / choice /
note / session. The per-T ``"stage"`` key comes from notebook 12's layer totals
(:func:`stage_choices_from_csv`, :func:`write_stage_choices`); a rewritten leaf drops it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import configs
from ..kernels.config import OpConfig
from ..kernels.stages import FUSED_CONFIG_FIELD
from ..shapes import Dims
from . import tuner
from .tuner import RUN_COLUMNS, TRIAL_COLUMNS
from .tuning import base_bm_candidates

#: the two launches tuned here, in call order
FUSED_OPS = ("fused_gate_up", "fused_down")
#: the workload columns, then the engine's
CSV_COLUMNS = [*("kind", "model", "R", "L", "T", "H", "I", "E", "K"), *TRIAL_COLUMNS, *RUN_COLUMNS]
CSV_COLUMNS.remove("default_ms")

# (BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_WARPS, NUM_STAGES)
_GATE_UP_DECODE = [(32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (64, 64, 1, 4, 5), (64, 128, 1, 8, 3)]
_GATE_UP_DECODE += [(128, 64, 1, 8, 3)]
_GATE_UP_PREFILL = [(64, 64, 8, 4, 4), (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), (64, 128, 8, 8, 3)]
_GATE_UP_PREFILL += [(128, 32, 8, 8, 4)]
_DOWN_DECODE = [(64, 64, 1, 4, 5), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4), (128, 128, 1, 8, 3)]
_DOWN_DECODE += [(32, 128, 1, 4, 5)]
_DOWN_PREFILL = [(128, 64, 8, 4, 4), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3)]
_DOWN_PREFILL += [(64, 128, 8, 4, 4)]
# (BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, NUM_WARPS, NUM_STAGES): the down GEMM split over K at decode
_DOWN_DECODE_SPLIT = [(128, 64, 8, 4, 4), (128, 128, 4, 8, 4), (64, 64, 4, 4, 4)]


def fused_op_candidates(op: str, bm: int, current: OpConfig, limit: int = 7) -> list[OpConfig]:
    """≤ ``limit`` configs of ``op`` (:data:`FUSED_OPS`) at BLOCK_SIZE_M = ``bm``, the current config first;
    ``fused_down`` at bm ≤ 32 also gets :data:`_DOWN_DECODE_SPLIT`. ValueError for an unknown op."""
    if op not in FUSED_OPS:
        raise ValueError(f"op must be one of {FUSED_OPS}, got {op!r}")
    small = bm <= 32
    if op == "fused_gate_up":
        grid = _GATE_UP_DECODE if small else _GATE_UP_PREFILL
    else:
        grid = _DOWN_DECODE if small else _DOWN_PREFILL
    split_ok = op == "fused_down" and small
    first = dataclasses.replace(current, BLOCK_SIZE_M=bm, SPLIT_K=current.SPLIT_K if split_ok else 1)
    got = tuner.dedupe([first] + [OpConfig(bm, bn, bk, g, 1, w, st) for bn, bk, g, w, st in grid], limit)
    if split_ok:
        split = [OpConfig(bm, bn, bk, 1, sk, w, st) for bn, bk, sk, w, st in _DOWN_DECODE_SPLIT]
        got = tuner.dedupe(got + split, limit + len(split))
    return got


def tune_fused_workload(
    model: str,
    T: int,
    R: int,
    L: int,
    weights,
    device: torch.device,
    log: tuner.TrialLog,
    *,
    deadline: float = math.inf,
    max_bms: int = 2,
    max_cands: int = 7,
    t0: float | None = None,
) -> dict[str, OpConfig]:
    """Tune the two fused GEMMs of one workload; returns {op: cfg} (empty when the budget ran out first)."""
    from ..kernels.fused import fused_gemm_configs

    t0 = time.perf_counter() if t0 is None else t0
    s = tuner.check_models([model])[0]
    dims = Dims.of(s, T, rank=R, adapters=L, slices=weights.lora_a13.shape[2])
    cur = fused_gemm_configs(configs.load_layer_config(dims))
    bms = sorted(set(base_bm_candidates(T, s.top_k, s.experts, max_bms)) | {cur.base_block_size_m})
    ids = dict(model=model, R=R, L=L, T=T, H=s.hidden, I=s.intermediate, E=s.experts, K=s.top_k)
    fields = [FUSED_CONFIG_FIELD[op] for op in FUSED_OPS]

    def candidates(op: str, bm: int) -> list[OpConfig]:
        return fused_op_candidates(op, bm, getattr(cur, FUSED_CONFIG_FIELD[op]), max_cands)

    return tuner.tune_layer_ops(
        "fused", s, T, weights, cur, fields, FUSED_OPS, bms, candidates, device, log, ids,
        what=f"{model} T={T} fused GEMMs", deadline=deadline, t0=t0, first_note="current",
    )  # fmt: skip


def _check_args(models, tokens, *, rank, adapters, out, csv_path, budget_s, device, dtype, gpu, max_bms,
                max_cands, seed, names=None):  # fmt: skip
    """(shapes, device, dtype) of :func:`tune_fused`'s arguments; ValueError naming a bad one."""
    shapes = tuner.check_models(models, (names or {}).get("models", "models"))
    if gpu is not None and (not isinstance(gpu, str) or not gpu or "/" in gpu or "\\" in gpu):
        raise ValueError(f"gpu: expected a GPU name for the file names (no path separators), got {gpu!r}")
    ints = dict(rank=(rank, 1, None), adapters=(adapters, 1, None), max_bms=(max_bms, 1, None))
    dev, dtype = tuner.check_run(
        names, tokens=tokens, budget_s=budget_s, device=device, dtype=dtype, out=out, csv_path=csv_path,
        key_columns=("kind", "model", "T", "op", "config_json"), what="the fused tuner",
        ints=dict(ints, max_cands=(max_cands, 1, None), seed=(seed, None, None)),
    )  # fmt: skip
    return shapes, dev, dtype


def tune_fused(
    models: Sequence[str],
    tokens: Sequence[int],
    *,
    rank: int = 32,
    adapters: int = 8,
    out: str | Path,
    csv_path: str | Path,
    budget_s: float = math.inf,
    device=None,
    dtype=None,
    gpu: str | None = None,
    max_bms: int = 2,
    max_cands: int = 7,
    seed: int = 0,
    progress: bool = False,
    names: dict[str, str] | None = None,
) -> dict[tuple[str, int], dict[str, OpConfig]]:
    """Tune every (model, T) and merge the choices into ``out/{gpu}_FUSED_MOE_LORA_FUSED.json``. Returns
    {(model, T): {op: OpConfig}}. ``max_bms``: BLOCK_SIZE_M candidates besides the current one; ``max_cands``:
    configs per GEMM and BM; ``dtype`` None: bfloat16 on a GPU, float32 on the CPU. ValueError naming a bad
    argument before anything is written."""
    shapes, dev, dtype = _check_args(
        models, tokens, rank=rank, adapters=adapters, out=out, csv_path=csv_path, budget_s=budget_s,
        device=device, dtype=dtype, gpu=gpu, max_bms=max_bms, max_cands=max_cands, seed=seed, names=names,
    )  # fmt: skip
    gpu = gpu or (configs.gpu_name() if dev.type == "cuda" else "cpu")
    t0 = time.perf_counter()
    log = tuner.TrialLog(Path(csv_path), CSV_COLUMNS)
    files = tuner.ConfigFiles(Path(out), gpu, ["fused"], configs.config_file_name)
    chosen: dict[tuple[str, int], dict[str, OpConfig]] = {}
    weights: dict[tuple[str, int], object] = {}

    def tune_one(job) -> bool:
        s, T = job
        w = tuner.layer_weights(weights, s, rank, adapters, dtype, dev, seed)
        kw = dict(deadline=t0 + budget_s, t0=t0, max_bms=max_bms, max_cands=max_cands)
        if got := tune_fused_workload(s.name, T, rank, adapters, w, dev, log, **kw):
            chosen[s.name, T] = got
            leaf = {op: c.to_dict() for op, c in got.items()}
            files.put("fused", configs.base_keys(Dims.of(s, T, rank=rank, adapters=adapters)), leaf)
        return True

    summary = tuner.run_workloads(
        [(s, T) for s in shapes for T in tokens],
        log,
        files,
        {},
        label=lambda j: (j[0].name, j[1]),
        ids=lambda j: dict(model=j[0].name, T=j[1], R=rank, L=adapters),
        todo=lambda j: True,
        tune=tune_one,
        deadline=t0 + budget_s,
        t0=t0,
        progress=progress,
        desc="fused tuning",
    )
    weights.clear()
    summary.pop("conflicts")
    tuner.finish(log, summary, t0)
    return chosen


def stage_choices_from_csv(
    csv_path: str | Path, *, variant: str = "as_anchor", part: str = "total"
) -> dict[tuple[int, int, int, int], str]:
    """The fastest stage per (E, 2I, H, T) of a layer benchmark CSV (``data/12_fused.csv``,
    ``data/13_gemv.csv``) among those with a ``us_p50`` for both ``tuned`` and ``fused``: ``{(E, 2I, H, T):
    "tuned" | "fused" | "gemv"}`` (rows of ``part`` and ``variant``; ties: the earlier in
    :data:`~moelora_lib.configs.STAGE_CHOICES`). ValueError naming the file for a missing column or duplicate
    rows."""
    import csv

    path = Path(csv_path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    need = {"stage", "T", "H", "I", "E", "part", "variant", "us_p50"}
    if rows and not need <= set(rows[0]):
        raise ValueError(f"{path}: missing columns {sorted(need - set(rows[0]))}")
    times: dict[tuple[int, int, int, int], dict[str, float]] = {}
    for r in rows:
        if r["part"] != part or r["variant"] != variant or r["stage"] not in configs.STAGE_CHOICES:
            continue
        key = (int(r["E"]), 2 * int(r["I"]), int(r["H"]), int(r["T"]))
        got = times.setdefault(key, {})
        if r["stage"] in got:
            raise ValueError(f"{path}: two rows for stage {r['stage']!r} at (E, 2I, H, T) = {key}")
        got[r["stage"]] = float(r["us_p50"])
    order = {st: i for i, st in enumerate(configs.STAGE_CHOICES)}  # ties: the earlier (tuned first)
    return {
        k: min(t, key=lambda st: (t[st], order[st]))
        for k, t in sorted(times.items())
        if {"tuned", "fused"} <= set(t)
    }


def _edit_leaves(path: str | Path, entries: dict, what: str, edit) -> Path:
    """Apply ``edit`` to the leaves of ``path`` at ``entries``' keys and write it atomically; ValueError for
    keys without an exact leaf."""
    import json

    path = Path(path)
    configs.load_config_file(path, "fused")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for keys, value in entries.items():
        kp = "".join(f"[{json.dumps(str(k))}]" for k in keys)
        edit(None, value, kp)  # the value's own checks, before the keys'
        node = data
        for k in keys:
            if not isinstance(node, dict) or str(k) not in node:
                raise ValueError(f"{path}: no entry at {kp} to record {what(value)} in")
            node = node[str(k)]
        edit(node, value, kp)
    out = configs.save_config_file(path, data)
    configs.load_config_file(out, "fused")
    return out


def write_stage_choices(path: str | Path, choices: dict[tuple[int, int, int, int], str]) -> Path:
    """Set ``"stage"`` in the leaves of the fused config file ``path`` named by ``choices`` (as
    :func:`stage_choices_from_csv` returns) and write it atomically. ValueError naming the key path for a
    choice without an exact leaf, a value outside :data:`moelora_lib.configs.STAGE_CHOICES`, or ``"gemv"`` for
    a leaf without gemv configs; nothing is written then."""

    def edit(node, stage, kp):
        if stage not in configs.STAGE_CHOICES:
            allowed = list(configs.STAGE_CHOICES)
            raise ValueError(f"{path} at {kp}: stage must be one of {allowed}, got {stage!r}")
        if node is None:
            return
        if stage == "gemv" and configs.GEMV_KEY not in node:
            raise ValueError(
                f"{path} at {kp}: stage 'gemv' needs the leaf's {configs.GEMV_KEY!r} configs "
                "(write_gemv_configs first)"
            )
        node[configs.STAGE_KEY] = stage

    return _edit_leaves(path, choices, lambda stage: f"stage {stage!r}", edit)


def write_gemv_configs(path: str | Path, entries: dict[tuple[int, int, int, int], dict]) -> Path:
    """Set the ``"gemv"`` key of the fused config file's leaves named by ``entries`` ({(E, N, K, m):
    {"gate_up", "down", "shrink": OpConfig}}) and write it atomically. ValueError naming the key path for an
    entry without an exact leaf or the three configs; nothing is written then."""

    def edit(node, cfgs, kp):
        if not isinstance(cfgs, dict) or set(cfgs) != set(configs.GEMV_LEAF_KEYS):
            raise ValueError(f"{path} at {kp}: gemv configs must be {list(configs.GEMV_LEAF_KEYS)}")
        if node is not None:
            node[configs.GEMV_KEY] = {k: c.to_dict() for k, c in cfgs.items()}

    return _edit_leaves(path, entries, lambda _: "the gemv configs", edit)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); a bad argument exits with code 2 and one line naming it."""
    p = tuner.parser("python -m moelora_lib.studies.fused_tuning", __doc__, "1,8,64,256,1600,8192")
    p.add_argument("--model", required=True, help="comma-separated presets, e.g. gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--rank", type=tuner.int_type(1), default=32)
    p.set_defaults(max_bms=2, max_cands=7)
    a = p.parse_args(argv)
    kw = dict(rank=a.rank, adapters=a.adapters, out=a.out, csv_path=a.csv, budget_s=a.budget_s, dtype=a.dtype)
    kw.update(max_bms=a.max_bms, max_cands=a.max_cands, device=a.device, seed=a.seed)
    models = [m for m in a.model.split(",") if m]
    try:  # every flag checked before any work; an error during the run is not a usage error
        _check_args(models, a.tokens, **kw, gpu=None, names=tuner.FLAGS)
    except ValueError as e:
        p.error(str(e))
    chosen = tune_fused(models, a.tokens, **kw, progress=not a.no_progress, names=tuner.FLAGS)
    for (m, T), got in chosen.items():
        print(m, T, " ".join(f"{op}={c.short()}" for op, c in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
