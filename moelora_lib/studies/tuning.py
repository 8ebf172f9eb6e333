"""The MoE tuner: joint BLOCK_SIZE_M search for the four LoRA ops, the base GEMMs tuned the same way.

Run::

    python -m moelora_lib.studies.tuning --model gpt-oss-20b,qwen3-30b-a3b --ranks 32 --copy-ranks 16,64 \\
        --adapters 8 --tokens 1,8,64,256,1600,8192 --out moelora_lib/configs/NVIDIA_H200 \\
        --csv data/07_tuning_trials.csv --budget-s 240

Per workload (model, R, L, T), through :mod:`.tuner`: the four LoRA ops share one BLOCK_SIZE_M
(:func:`lora_bm_candidates`, :func:`lora_op_candidates`), the base GEMMs likewise
(:func:`base_bm_candidates`, :func:`base_op_candidates`). CSV kinds: trial / bm_sum / choice / copied /
note / session. ``--copy-ranks``: the first rank's choices with the rank-sized tile adjusted.
``--weight-format mxfp4|fp8|fp8_w8a8``: the base GEMMs only, on packed experts, into that form's base file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import configs
from ..kernels import default_config
from ..kernels.config import BASE_OPS, LORA_OPS, OpConfig, next_pow2
from ..shapes import CONFIG_WEIGHT_FORMATS, Dims, MoEShape
from . import tuner
from .tuner import RUN_COLUMNS, TRIAL_COLUMNS

TUNE_STAGE = "even_k_fused_add"
CSV_COLUMNS = ["kind", "model", "R", "L", "T", "H", "I", "E", "K", "S", "group", *TRIAL_COLUMNS, *RUN_COLUMNS]
_KEY_COLUMNS = ("kind", "model", "R", "L", "T", "group", "op", "config_json")
LORA_BMS = (16, 32, 64)
BASE_BMS = (16, 32, 64, 128)
GROUP_OPS = {"lora": LORA_OPS, "base": BASE_OPS}
#: experts' form -> (moe_bench weight format, activation_scheme) where they differ from (form, "auto")
_FORMS = {"fp8": ("fp8", "weight_only"), "fp8_w8a8": ("fp8", "dynamic")}


# --- Candidate lists (pruned by hand: the whole cartesian product is ~10^4 configs per op) ------------------
def _bms(choices: Sequence[int], rows: float, max_bms: int, dflt: int) -> list[int]:
    cap = max(16, 2 * next_pow2(math.ceil(rows)))  # more than 2x the rows per group is padding
    bms = [bm for bm in choices if bm <= cap][-max_bms:]
    return sorted(set(bms) | {dflt}) if max_bms > 1 else [dflt]


def lora_bm_candidates(T: int, K: int, E: int, L: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates of the LoRA ops: of 16/32/64 those up to 2× the average rows per (adapter,
    expert) group, the largest ``max_bms`` plus the default's BM."""
    dflt = default_config(Dims(T=T, H=64, I=64, E=E, top_k=K, adapters=L, rank=16)).lora_block_size_m
    return _bms(LORA_BMS, T * K / max(1, L * E), max_bms, dflt)


def base_bm_candidates(T: int, K: int, E: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates of the base GEMMs: of 16/32/64/128 those up to 2× the average rows per
    expert, the largest ``max_bms`` plus the default's BM."""
    dflt = default_config(Dims(T=T, H=64, I=64, E=E, top_k=K, adapters=1, rank=16)).base_block_size_m
    return _bms(BASE_BMS, T * K / E, max_bms, dflt)


def lora_op_candidates(op: str, bm: int, dflt: OpConfig, R: int, k_dim: int, limit: int = 6) -> list:
    """≤ ``limit`` configs of one LoRA op at BLOCK_SIZE_M = bm, the default first. shrink: BLOCK_SIZE_N =
    max(16, next_pow2(R)), SPLIT_K around the default's, BLOCK_SIZE_K 64/128, 4 or 8 warps; expand:
    BLOCK_SIZE_K = max(16, next_pow2(R)), BLOCK_SIZE_N 64–256, GROUP_SIZE_M 1 or 8, 2–3 stages."""
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    r = max(16, next_pow2(R))
    if op.endswith("shrink"):
        sk = d.SPLIT_K
        grid = [(64, sk, 4, 3), (64, max(1, sk // 2), 4, 3), (64, min(32, 2 * sk), 4, 3), (128, sk, 4, 3)]
        grid += [(128, max(1, sk // 2), 8, 3), (64, sk, 4, 4)]
        raw = [d] + [OpConfig(bm, r, bk, 8, s, w, st) for bk, s, w, st in grid if bk * s <= k_dim]
    else:
        grid = [(64, 8, 4, 2), (128, 8, 4, 2), (128, 8, 4, 3), (256, 8, 8, 3), (64, 1, 4, 3), (128, 1, 8, 2)]
        raw = [d] + [OpConfig(bm, bn, r, g, 1, w, st) for bn, g, w, st in grid]
    return tuner.dedupe(raw, limit)


def base_op_candidates(bm: int, dflt: OpConfig, limit: int = 5) -> list[OpConfig]:
    """≤ ``limit`` configs of one base GEMM at BLOCK_SIZE_M = bm; the default (with bm) first.
    Decode-sized tiles (bm ≤ 32: weight streaming) and prefill-sized tiles (bm ≥ 64: tensor cores)."""
    if bm <= 32:
        grid = [(64, 64, 1, 4, 5), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4), (128, 128, 1, 8, 3)]
        grid.append((32, 128, 1, 4, 5))
    else:
        grid = [(128, 64, 8, 4, 4), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3)]
        grid.append((64, 128, 8, 4, 4))
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    return tuner.dedupe([d] + [OpConfig(bm, bn, bk, g, 1, w, st) for bn, bk, g, w, st in grid], limit)


# --- One workload -------------------------------------------------------------------------------------------
def tune_workload(shape: MoEShape, T: int, R: int, L: int, weights, device, log: tuner.TrialLog, *,
                  deadline: float = math.inf, max_bms: int = 2, max_cands: int = 6, t0: float | None = None,
                  groups: Sequence[str] = ("lora", "base"),
                  weight_format: str = "dense") -> dict[str, dict[str, OpConfig]]:  # fmt: skip
    """Tune the groups ("lora": the LoRA ops jointly; "base" or "base_<weight_format>": the base GEMMs) of one
    workload (``weights``: layer_inputs of this shape, R, L, experts in ``weight_format``); returns {group:
    {op: OpConfig}}, every trial in ``log``."""
    t0 = time.perf_counter() if t0 is None else t0
    H, I, E, K, S = shape.hidden, shape.intermediate, shape.experts, shape.top_k, weights.lora_a13.shape[2]
    dflt = default_config(Dims.of(shape, T, rank=R, adapters=L, slices=S))
    k_dims = {"gate_up_shrink": H, "down_shrink": I}

    def candidates(op: str, bm: int) -> list[OpConfig]:
        if op in LORA_OPS:
            return lora_op_candidates(op, bm, getattr(dflt, op), R, k_dims.get(op, R), max_cands)
        return base_op_candidates(bm, getattr(dflt, op), max_cands)

    out = {}
    for group in groups:
        ops = GROUP_OPS[group.split("_")[0]]
        ids = dict(model=shape.name, R=R, L=L, T=T, H=H, I=I, E=E, K=K, S=S, group=group)
        lora = group == "lora"
        bms = lora_bm_candidates(T, K, E, L, max_bms) if lora else base_bm_candidates(T, K, E, max_bms)
        out[group] = tuner.tune_layer_ops(
            TUNE_STAGE, shape, T, weights, dflt, ops, ops, bms, candidates, device, log, ids,
            what=f"{shape.name} T={T} {group}", deadline=deadline, t0=t0,
            activation_scheme=_FORMS.get(weight_format, (weight_format, "auto"))[1],
        )  # fmt: skip
    return out


# --- The whole run ------------------------------------------------------------------------------------------
def _put(files: tuner.ConfigFiles, s: MoEShape, T: int, R: int, L: int, group: str, cfgs) -> None:
    """The choices of one group into the files (the base keys do not depend on R, L or S)."""
    if group.startswith("base"):
        files.put("base", configs.base_keys(Dims.of(s, T)), {op: cfgs[op].to_dict() for op in BASE_OPS})
        return
    dims = Dims.of(s, T, rank=R, adapters=L, slices=s.lora_slices)
    for op in LORA_OPS:
        files.put(op, configs.lora_keys(op, dims), cfgs[op].to_dict())


def _for_rank(cfgs: dict[str, OpConfig], R: int) -> dict[str, OpConfig]:
    """LoRA configs with the rank-sized tile adjusted to rank R (shrink BLOCK_SIZE_N, expand BLOCK_SIZE_K)."""
    r = max(16, next_pow2(R))
    key = {True: "BLOCK_SIZE_N", False: "BLOCK_SIZE_K"}
    return {op: dataclasses.replace(c, **{key[op.endswith("shrink")]: r}) for op, c in cfgs.items()}


def _check_tune_args(
    models, ranks, adapters, tokens, out, csv_path, *, budget_s, copy_ranks, device, dtype, max_bms,
    max_cands, seed, weight_format="dense", names=None
) -> tuple[list[MoEShape], torch.device, torch.dtype]:  # fmt: skip
    """Every argument of :func:`tune`, before any work; ValueError naming the argument (``names``: argument
    -> name, e.g. :data:`.tuner.FLAGS`). Returns (shapes, device, dtype)."""
    n = names or {}
    if weight_format not in CONFIG_WEIGHT_FORMATS:
        raise ValueError(f"{n.get('weight_format', 'weight_format')} must be one of {CONFIG_WEIGHT_FORMATS}")
    if weight_format != "dense" and copy_ranks:  # packed forms tune the base GEMMs only
        raise ValueError(f"{n.get('copy_ranks', 'copy_ranks')} copies LoRA configs: weight_format dense only")
    shapes = tuner.check_models(models, n.get("models", "models"))
    ints = dict(adapters=(adapters, 1, None), max_bms=(max_bms, 1, None), max_cands=(max_cands, 1, None))
    dev, dt = tuner.check_run(
        names, tokens=tokens, budget_s=budget_s, device=device, dtype=dtype, out=out, csv_path=csv_path,
        key_columns=_KEY_COLUMNS, what="the MoE tuner", ints=dict(ints, seed=(seed, None, None)),
        lists=dict(ranks=(ranks, False), copy_ranks=(copy_ranks, True)),
    )  # fmt: skip
    return shapes, dev, dt


def tune(models: Sequence[str], ranks: Sequence[int], adapters: int, tokens: Sequence[int],
         out: str | os.PathLike, csv_path: str | os.PathLike, *, budget_s: float = math.inf,
         copy_ranks: Sequence[int] = (), device: str | None = None, dtype: torch.dtype | None = None,
         max_bms: int = 2, max_cands: int = 6, seed: int = 0, progress: bool = True,
         weight_format: str = "dense") -> dict[str, Any]:  # fmt: skip
    """Tune every (model, rank, T) workload (ranks, then T, then models) and write the JSON files into
    ``out``; returns a summary (tuned, skipped, not_tuned, copied: lists of (model, R, T); elapsed_s, out,
    gpu). ``weight_format``: module docstring. ValueError naming the argument before any work (presets,
    ints, budget, device, out, csv, weight_format)."""
    kw = dict(budget_s=budget_s, copy_ranks=copy_ranks, device=device, dtype=dtype, seed=seed)
    kw |= dict(max_bms=max_bms, max_cands=max_cands, weight_format=weight_format)
    shapes, dev, dtype = _check_tune_args(models, ranks, adapters, tokens, out, csv_path, **kw)
    t0 = time.perf_counter()
    gpu = configs.gpu_name() if dev.type == "cuda" else "cpu"
    log = tuner.TrialLog(Path(csv_path), CSV_COLUMNS)
    dense = weight_format == "dense"  # packed experts: their base GEMMs only
    known = dict(GROUP_OPS) if dense else {f"base_{weight_format}": BASE_OPS}  # CSV group -> ops
    ops = (*LORA_OPS, "base") if dense else ("base",)
    files = tuner.ConfigFiles(
        Path(out), gpu, ops, lambda g, op: configs.config_file_name(g, op, weight_format)
    )

    def done(s: MoEShape, R: int, T: int, group: str) -> dict[str, OpConfig]:
        R, L = (R, adapters) if group == "lora" else (None, None)
        return log.choices(known[group], model=s.name, group=group, T=T, R=R, L=L)

    jobs = [(s, R, T) for R in ranks for T in tokens for s in shapes]
    for s, R, T in jobs:  # finished work into the files first (resume)
        for g in known:
            if cfgs := done(s, R, T, g):
                _put(files, s, T, R, adapters, g, cfgs)
    weights: dict[tuple, Any] = {}
    wfmt = _FORMS.get(weight_format, (weight_format, "auto"))[0]  # the experts' moe_bench format

    def tune_one(job) -> bool:
        s, R, T = job
        w = tuner.layer_weights(weights, s, R, adapters, dtype, dev, seed, wfmt)
        groups = [g for g in known if not done(s, R, T, g)]
        kw = dict(deadline=t0 + budget_s, max_bms=max_bms, max_cands=max_cands, t0=t0, groups=groups)
        kw["weight_format"] = weight_format
        for g, cfgs in tune_workload(s, T, R, adapters, w, dev, log, **kw).items():
            _put(files, s, T, R, adapters, g, cfgs)
        return True

    summary: dict[str, Any] = dict(out=str(out), gpu=gpu)
    tuner.run_workloads(
        jobs, log, files, summary, label=lambda j: (j[0].name, j[1], j[2]),
        ids=lambda j: dict(model=j[0].name, R=j[1], L=adapters, T=j[2]),
        todo=lambda j: any(not done(*j, g) for g in known), tune=tune_one, deadline=t0 + budget_s, t0=t0,
        progress=progress, desc="tuning",
    )  # fmt: skip
    weights.clear()
    summary["copied"] = []
    src = ranks[0]
    for s, Rc, T in ((s, Rc, T) for s in shapes for Rc in copy_ranks if Rc not in ranks for T in tokens):
        if cfgs := done(s, Rc, T, "lora"):  # copied by an earlier run
            _put(files, s, T, Rc, adapters, "lora", cfgs)
        elif cfgs := done(s, src, T, "lora"):
            cfgs = _for_rank(cfgs, Rc)
            ids = dict(model=s.name, R=Rc, L=adapters, T=T, H=s.hidden, I=s.intermediate, E=s.experts)
            ids.update(K=s.top_k, S=s.lora_slices, group="lora")
            for op, c in cfgs.items():
                log.config_row("copied", ids, op, c, note=f"copied from R={src} (not tuned)")
            _put(files, s, T, Rc, adapters, "lora", cfgs)
            summary["copied"].append((s.name, Rc, T))
    files.save()
    summary.pop("conflicts")
    return tuner.finish(log, summary, t0)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring). Every argument is checked before any work: a bad one exits
    with code 2 and one error line naming the flag."""
    tokens = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
    p = tuner.parser("python -m moelora_lib.studies.tuning", __doc__, tokens)
    p.add_argument("--model", required=True, help="preset names, comma-separated")
    p.add_argument("--ranks", default="32", type=tuner.int_list_type(1), help="ranks (first: copy source)")
    p.add_argument("--copy-ranks", default="", type=tuner.int_list_type(1, allow_empty=True),
                   help="ranks given the first rank's choices (not tuned)")  # fmt: skip
    p.add_argument(
        "--weight-format", default="dense", choices=CONFIG_WEIGHT_FORMATS, help="packed: base only"
    )
    p.set_defaults(max_bms=2, max_cands=6)
    a = p.parse_args(argv)
    args = ([m.strip() for m in a.model.split(",") if m.strip()], a.ranks, a.adapters, a.tokens, a.out, a.csv)
    kw = dict(budget_s=a.budget_s, copy_ranks=a.copy_ranks, device=a.device, dtype=a.dtype, seed=a.seed)
    kw.update(max_bms=a.max_bms, max_cands=a.max_cands, weight_format=a.weight_format)
    try:
        _check_tune_args(*args, **kw, names=tuner.FLAGS)
    except ValueError as e:
        p.error(str(e))
    s = tune(*args, **kw, progress=not a.no_progress)
    print(tuner.summary_line("tuning", s, f", {len(s['copied'])} copied"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
