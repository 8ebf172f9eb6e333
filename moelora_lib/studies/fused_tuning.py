"""Tuner for stage ``fused``'s two GEMMs (notebook 12): the gate_up GEMM with the LoRA expand and the
activation in it (``fused_gate_up``) and the down GEMM with its expand (``fused_down``).

Run (on the GPU; on the CPU it is only a functional test through the interpreter)::

    python -m moelora_lib.studies.fused_tuning --model gpt-oss-20b,qwen3-30b-a3b \\
        --tokens 1,8,64,256,1600,8192 --rank 32 --adapters 8 \\
        --out moelora_lib/configs/NVIDIA_H200 --csv data/12_fused_tuning.csv --budget-s 240

Per workload (model, T, R, L), on the inputs of :func:`moelora_lib.studies.moe_bench.layer_inputs`
(uniform adapter ids, silu, no biases: the vLLM side-by-side setting):

1. Start from the tuned config of the workload (:func:`moelora_lib.configs.load_layer_config`: the tuned
   shrinks) with the fused GEMMs derived from the tuned base GEMMs
   (:func:`~moelora_lib.kernels.fused.fused_gemm_configs`) — never from the fused file itself, which this
   run is writing (its nearest entry would be another T's choice).
2. The two GEMMs share the base alignment, so they share BLOCK_SIZE_M: for each candidate BM
   (:func:`~.tuning.base_bm_candidates` plus the current one) one
   :class:`~moelora_lib.kernels.LayerRun` of stage ``fused`` (adapter-ordered base alignment, as the
   stage runs), then each GEMM alone (:meth:`LayerRun.op_fn <moelora_lib.kernels.LayerRun.op_fn>`)
   over :func:`fused_op_candidates`; the BM with the smallest sum of the two best medians wins (the
   rule of :mod:`.tuning`, itself vLLM's ``benchmark_lora_tuning.py`` rule).
3. The choice is written into ``{gpu}_FUSED_MOE_LORA_FUSED.json`` (format: :mod:`moelora_lib.configs`)
   atomically after every workload; every timed candidate is a row of the CSV (``kind`` trial /
   bm_sum / choice / note).

Timing: :func:`moelora_lib.studies.bench.time_fn`, CUDA-graph replay with the L2 flushed, warm-up 5 ms,
rep 20 ms (the tuner's setting in :mod:`.tuning`). ``--budget-s``: no new workload or BM starts past
it; untuned workloads are left to the loader's nearest-entry lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import configs
from ..common import parse_dtype
from ..kernels.config import OpConfig
from ..kernels.stages import FUSED_CONFIG_FIELD
from ..shapes import Dims, get_shape
from .tuner_common import (
    RUN_COLUMNS,
    TRIAL_COLUMNS,
    TrialLog,
    check_budget,
    check_device,
    check_out,
    choose_bm,
    dedupe,
    sweep_bms,
    with_bm,
)
from .tuning import base_bm_candidates

__all__ = ["CSV_COLUMNS", "FUSED_OPS", "fused_op_candidates", "tune_fused_workload", "tune_fused", "main"]

#: the two launches tuned here, in call order
FUSED_OPS = ("fused_gate_up", "fused_down")
#: the trials CSV: the workload columns, then tuner_common's trial and run columns (no default_ms: every
#: BLOCK_SIZE_M starts from the config derived from the tuned base GEMMs, marked "current" in ``note``)
CSV_COLUMNS = [
    *("kind", "model", "R", "L", "T", "H", "I", "E", "K"),
    *(c for c in TRIAL_COLUMNS if c != "default_ms"),
    *RUN_COLUMNS,
]

# (BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_WARPS, NUM_STAGES). fused_gate_up's N counts columns of
# g: each program holds two accumulators (gate, up) of BM x N and loads two weight tiles per K step.
_GATE_UP_DECODE = [
    (32, 128, 1, 4, 4),
    (64, 128, 1, 4, 4),
    (64, 64, 1, 4, 5),
    (64, 128, 1, 8, 3),
    (128, 64, 1, 8, 3),
]
_GATE_UP_PREFILL = [
    (64, 64, 8, 4, 4),
    (64, 64, 8, 8, 3),
    (128, 64, 8, 8, 3),
    (64, 128, 8, 8, 3),
    (128, 32, 8, 8, 4),
]
_DOWN_DECODE = [
    (64, 64, 1, 4, 5),
    (64, 128, 1, 4, 4),
    (128, 64, 1, 4, 4),
    (128, 128, 1, 8, 3),
    (32, 128, 1, 4, 5),
]
# (BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, NUM_WARPS, NUM_STAGES): the down GEMM split over K at decode
_DOWN_DECODE_SPLIT = [
    (128, 64, 8, 4, 4),
    (128, 128, 4, 8, 4),
    (64, 64, 4, 4, 4),
]
_DOWN_PREFILL = [
    (128, 64, 8, 4, 4),
    (128, 64, 8, 8, 4),
    (128, 128, 8, 8, 3),
    (256, 64, 8, 8, 3),
    (64, 128, 8, 4, 4),
]


def fused_op_candidates(op: str, bm: int, current: OpConfig, limit: int = 7) -> list[OpConfig]:
    """≤ ``limit`` configs of one fused GEMM (``op`` in :data:`FUSED_OPS`) at BLOCK_SIZE_M = ``bm``:
    the current config (with bm) first, then decode-sized tiles (bm ≤ 32: weight streaming, no
    grouped order) or prefill-sized ones (bm ≥ 64: tensor cores, GROUP_SIZE_M 8). SPLIT_K is 1 except
    for ``fused_down`` at bm ≤ 32, which also gets :data:`_DOWN_DECODE_SPLIT` (K split over 4 or 8
    programs adding into an fp32 y; the decode points of data/dev/12_round4_splitk) on top of
    ``limit``. Raises ValueError for an unknown op."""
    if op not in FUSED_OPS:
        raise ValueError(f"op must be one of {FUSED_OPS}, got {op!r}")
    small = bm <= 32
    grid = (
        (_GATE_UP_DECODE if small else _GATE_UP_PREFILL)
        if op == "fused_gate_up"
        else (_DOWN_DECODE if small else _DOWN_PREFILL)
    )
    split_ok = op == "fused_down" and small
    first = dataclasses.replace(current, BLOCK_SIZE_M=bm, SPLIT_K=current.SPLIT_K if split_ok else 1)
    got = dedupe([first] + [OpConfig(bm, bn, bk, g, 1, w, st) for bn, bk, g, w, st in grid], limit)
    if split_ok:
        split = [OpConfig(bm, bn, bk, 1, sk, w, st) for bn, bk, sk, w, st in _DOWN_DECODE_SPLIT]
        got = dedupe(got + split, limit + len(split))
    return got


def tune_fused_workload(
    model: str,
    T: int,
    R: int,
    L: int,
    weights,
    device: torch.device,
    log: TrialLog,
    *,
    deadline: float = math.inf,
    max_bms: int = 2,
    max_cands: int = 7,
    t0: float | None = None,
) -> dict[str, OpConfig]:
    """Tune the two fused GEMMs of one workload; returns {"fused_gate_up": cfg, "fused_down": cfg}
    (empty when the budget ran out before the first BM) and logs every trial to ``log``."""
    from ..kernels.fused import fused_gemm_configs
    from .moe_bench import layer_inputs, make_run

    t0 = time.perf_counter() if t0 is None else t0
    shape = get_shape(model)
    H, I, E, K = shape.hidden, shape.intermediate, shape.experts, shape.top_k
    S = weights.lora_a13.shape[2]
    dims = Dims.of(shape, T, rank=R, adapters=L, slices=S)
    # the starting point is derived from the tuned base GEMMs, never read from the fused file: that file
    # is being written by this run, and its nearest entry (another T's choice) would steer the BM list
    cur = fused_gemm_configs(configs.load_layer_config(dims))
    cur_bm = cur.base_block_size_m
    bms = sorted(set(base_bm_candidates(T, K, E, max_bms)) | {cur_bm})
    inp = layer_inputs(
        shape,
        T,
        rank=R,
        num_adapters=L,
        pattern="uniform",
        weights=weights,
        seed=0,
        activation="silu",
        bias=False,
    )
    ids = dict(model=model, R=R, L=L, T=T, H=H, I=I, E=E, K=K)

    fields = [FUSED_CONFIG_FIELD[op] for op in FUSED_OPS]
    best = sweep_bms(
        bms,
        lambda bm: make_run("fused", inp, with_bm(cur, fields, bm)),
        FUSED_OPS,
        lambda op, bm: fused_op_candidates(op, bm, getattr(cur, FUSED_CONFIG_FIELD[op]), max_cands),
        device,
        log,
        ids,
        deadline=deadline,
        t0=t0,
        first_note="current",
    )
    if not best:
        return {}
    return choose_bm(best, FUSED_OPS, log, ids, t0=t0, what=f"{model} T={T} fused GEMMs")


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
    dtype=torch.bfloat16,
    gpu: str | None = None,
    max_bms: int = 2,
    max_cands: int = 7,
) -> dict[tuple[str, int], dict[str, OpConfig]]:
    """Tune every (model, T) and write ``out/{gpu}_FUSED_MOE_LORA_FUSED.json`` (merged into an existing
    file; atomically after each workload). Returns {(model, T): {op: OpConfig}}.

    Raises ValueError (before anything is written) for an empty or non-list ``models`` or an unknown
    preset, ``tokens`` not a non-empty list of ints ≥ 1, rank/adapters/max_bms/max_cands not ints ≥ 1
    (bools refused), a negative budget, a ``gpu`` with path separators, an ``out`` that is a file or
    cannot be made, a ``csv_path`` that is a folder or whose folder cannot be made. ``max_bms``: BLOCK_SIZE_M
    candidates besides the current one (:func:`~.tuning.base_bm_candidates`); ``max_cands``: configs per
    GEMM and BM (:func:`fused_op_candidates`)."""
    from .moe_bench import layer_inputs

    if isinstance(models, str) or not isinstance(models, (list, tuple)) or not models:
        raise ValueError(f"models must be a non-empty list of preset names, got {models!r}")
    for m in models:
        get_shape(m)  # ValueError naming the preset
    if (
        not isinstance(tokens, (list, tuple))
        or not tokens
        or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in tokens)
    ):
        raise ValueError(f"tokens must be a non-empty list of ints >= 1, got {tokens!r}")
    for name, v in (("rank", rank), ("adapters", adapters), ("max_bms", max_bms), ("max_cands", max_cands)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    check_budget(budget_s, "budget_s")
    if gpu is not None and (not isinstance(gpu, str) or not gpu or "/" in gpu or "\\" in gpu):
        raise ValueError(f"gpu must be a GPU name for the file names (no path separators), got {gpu!r}")
    dev = check_device("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"))
    out = check_out(out, "out")
    if not isinstance(csv_path, (str, os.PathLike)) or not str(csv_path):
        raise ValueError(f"csv_path must be a file path, got {csv_path!r}")
    csv_p = Path(csv_path)
    if csv_p.is_dir():
        raise ValueError(f"csv_path: {str(csv_p)!r} is a folder, expected a CSV file path")
    check_out(csv_p.parent, "csv_path's folder")
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu or configs.gpu_name()
    path = out / configs.config_file_name(gpu, "fused")
    data = configs.load_config_file(path, "fused") if path.is_file() else {}
    log = TrialLog(csv_p, CSV_COLUMNS)
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    chosen = {}
    for m in models:
        shape = get_shape(m)
        weights = layer_inputs(
            shape, 1, rank=rank, num_adapters=adapters, dtype=dtype, device=dev, seed=0, bias=False
        )
        for T in tokens:
            if time.perf_counter() > deadline:
                log.append(kind="note", model=m, T=T, R=rank, L=adapters, note="budget: workload not tuned")
                continue
            got = tune_fused_workload(
                m, T, rank, adapters, weights, dev, log, deadline=deadline, t0=t0, max_bms=max_bms,
                max_cands=max_cands,
            )  # fmt: skip
            if not got:
                continue
            chosen[(m, T)] = got
            dims = Dims.of(shape, T, rank=rank, adapters=adapters)
            keys = configs.base_keys(dims)
            leaf = {op: c.to_dict() for op, c in got.items()}
            old = configs.lookup(data, keys, exact_levels=tuple(range(len(keys))))
            if old is not None and "lora_stack" in old[1]:  # keep the entry's measured epilogue form
                leaf["lora_stack"] = old[1]["lora_stack"]
            configs.set_entry(data, keys, leaf)
            configs.save_config_file(path, data)
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.studies.fused_tuning", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="comma-separated presets, e.g. gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,256,1600,8192", help="comma-separated T values")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True, help="config folder (the shipped one: moelora_lib/configs/<gpu>)")
    p.add_argument("--csv", required=True, help="trials CSV (appended)")
    p.add_argument("--budget-s", type=float, default=math.inf)
    p.add_argument("--max-bms", type=int, default=2, help="BLOCK_SIZE_M candidates besides the current one")
    p.add_argument("--max-cands", type=int, default=7, help="configs per GEMM and BLOCK_SIZE_M")
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {a.tokens!r}")
    try:
        chosen = tune_fused(
            [m for m in a.model.split(",") if m], tokens, rank=a.rank, adapters=a.adapters, out=a.out,
            csv_path=a.csv, budget_s=a.budget_s, dtype=parse_dtype(a.dtype), max_bms=a.max_bms,
            max_cands=a.max_cands,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    for (m, T), got in chosen.items():
        print(m, T, " ".join(f"{op}={c.short()}" for op, c in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
