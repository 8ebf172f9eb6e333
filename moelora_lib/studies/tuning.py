"""The tuner: joint BLOCK_SIZE_M search for the four LoRA ops, the base GEMMs tuned the same way.

Run::

    python -m moelora_lib.studies.tuning --model gpt-oss-20b,qwen3-30b-a3b --ranks 32 --copy-ranks 16,64 \\
        --adapters 8 --tokens 1,8,64,256,1600,8192 --out moelora_lib/configs/NVIDIA_H200 \\
        --csv data/07_tuning_trials.csv --budget-s 240

What it does per workload (model, R, L, T), on the inputs of
:func:`moelora_lib.studies.moe_bench.layer_inputs`
(uniform adapter ids, silu, no biases — the vLLM side-by-side setting; activation and biases do not
change the GEMM shapes):

1. **LoRA ops, jointly.** The four ops share one (adapter, expert) alignment, so they share
   BLOCK_SIZE_M. For each candidate BLOCK_SIZE_M (:func:`lora_bm_candidates`: 16/32/64 pruned by the
   average rows per (adapter, expert) group, at most ``max_bms``) a
   :class:`~moelora_lib.kernels.LayerRun` of stage ``even_k_fused_add`` is built with that BM, and
   each op's other parameters are tuned independently over a short list
   (:func:`lora_op_candidates`: ≤ 6, the default config first), timing the op alone
   (:meth:`moelora_lib.kernels.LayerRun.op_fn`, the layer's one launch plan). The BM with the
   smallest **sum** of the four best medians wins (as vLLM's ``benchmark_lora_tuning.py``), its
   four configs are written.
2. **Base GEMMs**, the same way: BM shared by base_gate_up and base_down
   (:func:`base_bm_candidates`, :func:`base_op_candidates`), sum of the two best medians. Tuned once
   per (model, T) (the rank does not change them).

Timing: :func:`moelora_lib.studies.bench.time_fn` — CUDA graph replay, L2 flushed, warm-up 5 ms, rep 20 ms
on a GPU; one interpreted call on the CPU, where the "tuning" is only a functional test of this code path.

Bookkeeping: every tried config and its time is appended, row by row, to the trials CSV
(``kind`` = trial / bm_sum / choice / copied / session); a workload whose ``choice`` rows are already
in the CSV is skipped (resumable), and its choices are re-written into the JSON files from the CSV.
The JSON files (:mod:`moelora_lib.configs` format) are rewritten atomically after every workload.
``--budget-s``: no new workload (and no further BLOCK_SIZE_M of a workload in progress) starts past
the budget; what was not tuned is listed and left to the loader's nearest-bucket lookup.
``--copy-ranks``: writes the chosen configs of the first tuned rank for these ranks too, with the
rank-sized tile adjusted (shrink BLOCK_SIZE_N, expand BLOCK_SIZE_K = max(16, next_pow2(R))), marked
``copied`` in the CSV — a stand-in, not a tune.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import configs
from ..common import parse_dtype
from ..kernels import default_config
from ..kernels.config import BASE_OPS, LORA_OPS, LayerConfig, OpConfig, next_pow2
from ..shapes import Dims, MoEShape, check_int, get_shape
from . import bench
from .tuner_common import (
    BUDGET_WORKLOAD_NOTE,
    RUN_COLUMNS,
    TRIAL_COLUMNS,
    ConfigFiles,
    TrialLog,
    append_config_row,
    arg_type,
    budget_type,
    check_budget,
    check_csv,
    check_device,
    check_out,
    choose_bm,
    dedupe,
    int_list_type,
    over_budget,
    parse_int,
    path_type,
    sweep_bms,
    with_bm,
)

__all__ = [
    "CSV_COLUMNS",
    "lora_bm_candidates",
    "base_bm_candidates",
    "lora_op_candidates",
    "base_op_candidates",
    "base_op_fn",
    "tune_workload",
    "tune",
    "main",
    "compare_tuned_vs_default",
    "op_breakdown",
    "targets_table",
    "TARGETS",
]

TUNE_STAGE = "even_k_fused_add"
CSV_COLUMNS = [
    "kind",
    "model",
    "R",
    "L",
    "T",
    "H",
    "I",
    "E",
    "K",
    "S",
    "group",
    *TRIAL_COLUMNS,
    *RUN_COLUMNS,
]
LORA_BMS = (16, 32, 64)
BASE_BMS = (16, 32, 64, 128)


# ------------------------------------------------------------------------------------------------
# Candidate lists (pruned by hand: the whole cartesian product is ~10^4 configs per op)
# ------------------------------------------------------------------------------------------------


def lora_bm_candidates(T: int, K: int, E: int, L: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates for the LoRA ops: 16/32/64 up to 2× the average rows per (adapter,
    expert) group (more is padding), the largest ``max_bms`` of them plus the default's BM."""
    g = T * K / max(1, L * E)
    cap = max(16, 2 * next_pow2(math.ceil(g)))
    bms = [bm for bm in LORA_BMS if bm <= cap][-max_bms:]
    dflt = default_config(Dims(T=T, H=64, I=64, E=E, top_k=K, adapters=L, rank=16)).lora_block_size_m
    return sorted(set(bms) | {dflt}) if max_bms > 1 else [dflt]


def base_bm_candidates(T: int, K: int, E: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates for the base GEMMs: up to 2× the average rows per expert, the largest
    ``max_bms`` of 16/32/64/128 plus the default's BM."""
    m = T * K / E
    cap = max(16, 2 * next_pow2(math.ceil(m)))
    bms = [bm for bm in BASE_BMS if bm <= cap][-max_bms:]
    dflt = default_config(Dims(T=T, H=64, I=64, E=E, top_k=K, adapters=1, rank=16)).base_block_size_m
    return sorted(set(bms) | {dflt}) if max_bms > 1 else [dflt]


def lora_op_candidates(
    op: str, bm: int, dflt: OpConfig, R: int, k_dim: int, limit: int = 6
) -> list[OpConfig]:
    """≤ ``limit`` configs of one LoRA op at BLOCK_SIZE_M = bm; the default (with bm) first.

    shrink (K = H or I, N = R): BLOCK_SIZE_N = max(16, next_pow2(R)); SPLIT_K in {sk/2, sk, 2·sk}
    around the default's; BLOCK_SIZE_K 64 or 128; 4 or 8 warps. expand (K = R, N = 2I/S or H):
    BLOCK_SIZE_K = max(16, next_pow2(R)); BLOCK_SIZE_N 64/128/256; GROUP_SIZE_M 1 or 8; 2-3 stages.
    """
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    r = max(16, next_pow2(R))
    if op.endswith("shrink"):
        sk = d.SPLIT_K
        raw = [d]
        for bk, s, w, st in [
            (64, sk, 4, 3),
            (64, max(1, sk // 2), 4, 3),
            (64, min(32, 2 * sk), 4, 3),
            (128, sk, 4, 3),
            (128, max(1, sk // 2), 8, 3),
            (64, sk, 4, 4),
        ]:
            if bk * s <= k_dim:
                raw.append(OpConfig(bm, r, bk, 8, s, w, st))
    else:
        raw = [d] + [
            OpConfig(bm, bn, r, g, 1, w, st)
            for bn, g, w, st in [
                (64, 8, 4, 2),
                (128, 8, 4, 2),
                (128, 8, 4, 3),
                (256, 8, 8, 3),
                (64, 1, 4, 3),
                (128, 1, 8, 2),
            ]
        ]
    return dedupe(raw, limit)


def base_op_candidates(bm: int, dflt: OpConfig, limit: int = 5) -> list[OpConfig]:
    """≤ ``limit`` configs of one base GEMM at BLOCK_SIZE_M = bm; the default (with bm) first.
    Decode-sized tiles (bm ≤ 32: weight streaming) and prefill-sized tiles (bm ≥ 64: tensor cores)."""
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    if bm <= 32:
        grid = [
            (64, 64, 1, 4, 5),
            (64, 128, 1, 4, 4),
            (128, 64, 1, 4, 4),
            (128, 128, 1, 8, 3),
            (32, 128, 1, 4, 5),
        ]
    else:
        grid = [
            (128, 64, 8, 4, 4),
            (128, 64, 8, 8, 4),
            (128, 128, 8, 8, 3),
            (256, 64, 8, 8, 3),
            (64, 128, 8, 4, 4),
        ]
    return dedupe([d] + [OpConfig(bm, bn, bk, g, 1, w, st) for bn, bk, g, w, st in grid], limit)


# ------------------------------------------------------------------------------------------------
# Timing one op alone
# ------------------------------------------------------------------------------------------------


def base_op_fn(run, op: str, cfg: OpConfig) -> Callable[[], Any]:
    """A no-argument callable launching one base GEMM of ``run`` (a LayerRun) with ``cfg`` (its
    BLOCK_SIZE_M must equal the run's base alignment's): :meth:`LayerRun.op_fn
    <moelora_lib.kernels.LayerRun.op_fn>` restricted to the base GEMMs."""
    if op not in BASE_OPS:
        raise ValueError(f"op must be one of {BASE_OPS}, got {op!r}")
    return run.op_fn(op, cfg)


# ------------------------------------------------------------------------------------------------
# CSV (appended row by row)
# ------------------------------------------------------------------------------------------------


class _TrialLog(TrialLog):
    def __init__(self, path: Path):
        super().__init__(path, CSV_COLUMNS)

    def choices(self, model: str, group: str, T: int, R: int | None, L: int | None) -> dict[str, OpConfig]:
        """The chosen configs of a finished workload (empty if none), from ``choice``/``copied`` rows."""
        out = {}
        for r in self.rows:
            if (
                r.get("kind") in ("choice", "copied")
                and r.get("model") == model
                and r.get("group") == group
                and int(float(r["T"])) == T
                and (R is None or int(float(r["R"])) == R)
                and (L is None or int(float(r["L"])) == L)
            ):
                out[r["op"]] = OpConfig.from_dict(json.loads(r["config_json"]), where=f"{self.path}")
        ops = LORA_OPS if group == "lora" else BASE_OPS
        return out if set(out) == set(ops) else {}


# ------------------------------------------------------------------------------------------------
# One workload
# ------------------------------------------------------------------------------------------------


def _tune_group(
    group: str,
    shape: MoEShape,
    T: int,
    R: int,
    L: int,
    weights,
    device,
    log: _TrialLog,
    deadline: float,
    max_bms: int,
    max_cands: int,
    t0: float,
) -> dict[str, OpConfig]:
    from .moe_bench import layer_inputs, make_run

    H, I, E, K, S = shape.hidden, shape.intermediate, shape.experts, shape.top_k, weights.lora_a13.shape[2]
    dflt = default_config(Dims.of(shape, T, rank=R, adapters=L, slices=S))
    ops = LORA_OPS if group == "lora" else BASE_OPS
    bms = lora_bm_candidates(T, K, E, L, max_bms) if group == "lora" else base_bm_candidates(T, K, E, max_bms)
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
    k_dims = {"gate_up_shrink": H, "down_shrink": I}
    ids = dict(model=shape.name, R=R, L=L, T=T, H=H, I=I, E=E, K=K, S=S, group=group)

    def candidates(op: str, bm: int) -> list[OpConfig]:
        base_cfg = getattr(dflt, op)
        if group == "lora":
            return lora_op_candidates(op, bm, base_cfg, R, k_dims.get(op, R), max_cands)
        return base_op_candidates(bm, base_cfg, max_cands)

    best = sweep_bms(
        bms,
        lambda bm: make_run(TUNE_STAGE, inp, with_bm(dflt, ops, bm)),
        ops,
        candidates,
        device,
        log,
        ids,
        deadline=deadline,
        t0=t0,
    )
    return choose_bm(best, ops, log, ids, t0=t0, what=f"{shape.name} T={T} {group}")


def tune_workload(
    shape: MoEShape,
    T: int,
    R: int,
    L: int,
    weights,
    device,
    log: _TrialLog,
    *,
    deadline: float = math.inf,
    max_bms: int = 2,
    max_cands: int = 6,
    t0: float | None = None,
    groups: Sequence[str] = ("lora", "base"),
) -> dict[str, dict[str, OpConfig]]:
    """Tune the groups ("lora": the four LoRA ops jointly; "base": the two base GEMMs) of one
    workload; returns {group: {op: OpConfig}} and logs every trial to ``log``."""
    t0 = time.perf_counter() if t0 is None else t0
    return {
        g: _tune_group(g, shape, T, R, L, weights, device, log, deadline, max_bms, max_cands, t0)
        for g in groups
    }


# ------------------------------------------------------------------------------------------------
# JSON files
# ------------------------------------------------------------------------------------------------


class _ConfigFiles(ConfigFiles):
    """The five JSON files of one folder, read once, updated in memory, saved atomically."""

    def __init__(self, folder: Path, gpu: str):
        super().__init__(folder, gpu, LORA_OPS + ("base",))

    def path(self, op: str) -> Path:
        return self.folder / configs.config_file_name(self.gpu, op)

    def put_lora(self, shape: MoEShape, T: int, R: int, L: int, S: int, cfgs: dict[str, OpConfig]) -> None:
        dims = Dims.of(shape, T, rank=R, adapters=L, slices=S)
        for op in LORA_OPS:
            configs.set_entry(self.data[op], configs.lora_keys(op, dims), cfgs[op].to_dict())

    def put_base(self, shape: MoEShape, T: int, cfgs: dict[str, OpConfig]) -> None:
        keys = configs.base_keys(Dims.of(shape, T))  # the base keys do not depend on R, L or S
        configs.set_entry(self.data["base"], keys, {op: cfgs[op].to_dict() for op in BASE_OPS})


def _for_rank(cfgs: dict[str, OpConfig], R: int) -> dict[str, OpConfig]:
    """Adjust the rank-sized tile of LoRA configs to rank R (shrink BN, expand BK)."""
    r = max(16, next_pow2(R))
    return {
        op: dataclasses.replace(c, **({"BLOCK_SIZE_N": r} if op.endswith("shrink") else {"BLOCK_SIZE_K": r}))
        for op, c in cfgs.items()
    }


# ------------------------------------------------------------------------------------------------
# The whole run
# ------------------------------------------------------------------------------------------------


_TRIAL_KEY_COLUMNS = ("kind", "model", "R", "L", "T", "group", "op", "config_json")


def _check_csv(csv_path, name: str | None = "csv_path") -> Path:
    """``csv_path`` must be a trials CSV of this tuner (resumed), an empty file, or a new file."""
    return check_csv(csv_path, name, _TRIAL_KEY_COLUMNS)


def _check_int_list(name: str, values, lo: int, *, allow_empty: bool = False) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a list of ints >= {lo}, got {values!r}")
    if not values and not allow_empty:
        raise ValueError(f"{name}: expected at least one int >= {lo}, got an empty list")
    return [check_int(name, v, lo) for v in values]


def _check_tune_args(
    models,
    ranks,
    adapters,
    tokens,
    out,
    csv_path,
    budget_s,
    copy_ranks,
    device,
    dtype,
    max_bms,
    max_cands,
    seed,
) -> tuple[list[MoEShape], torch.device]:
    """Validate every argument of :func:`tune` before any work; ValueError naming the argument."""
    if isinstance(models, str) or not isinstance(models, Sequence) or not models:
        raise ValueError(f"models: expected a non-empty list of preset names, got {models!r}")
    shapes = []
    for m in models:
        try:
            shapes.append(get_shape(m))
        except ValueError as e:
            raise ValueError(f"models: {e}") from None
    _check_int_list("ranks", ranks, 1)
    _check_int_list("copy_ranks", copy_ranks, 1, allow_empty=True)
    _check_int_list("tokens", tokens, 1)
    check_int("adapters", adapters, 1)
    check_int("max_bms", max_bms, 1)
    check_int("max_cands", max_cands, 1)
    check_int("seed", seed)
    check_budget(budget_s, "budget_s")
    if dtype is not None:
        try:
            parse_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"dtype: {e}") from None
    dev = check_device(device)
    check_out(out)
    _check_csv(csv_path)
    return shapes, dev


def tune(
    models: Sequence[str],
    ranks: Sequence[int],
    adapters: int,
    tokens: Sequence[int],
    out: str | os.PathLike,
    csv_path: str | os.PathLike,
    *,
    budget_s: float = math.inf,
    copy_ranks: Sequence[int] = (),
    device: str | None = None,
    dtype: torch.dtype | None = None,
    max_bms: int = 2,
    max_cands: int = 6,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Tune every (model, rank, T) workload (interleaved over models, T in the given order) and write
    the JSON files into ``out``; returns a summary dict (tuned, skipped, not_tuned, copied, elapsed_s).

    Raises ValueError naming the argument, before any work: an unknown preset, empty ranks/tokens, a
    rank/T/adapters/max_bms/max_cands that is not an int >= 1, a negative or NaN budget, a device the
    tuner cannot use on this machine, an ``out`` that is a file, a ``csv_path`` that is a folder or
    not a trials CSV.
    """
    from moelora_lib.studies.notebook import progress as tqdm  # a text bar, also in notebooks

    from .moe_bench import layer_inputs

    shapes, dev = _check_tune_args(
        models,
        ranks,
        adapters,
        tokens,
        out,
        csv_path,
        budget_s,
        copy_ranks,
        device,
        dtype,
        max_bms,
        max_cands,
        seed,
    )
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    dtype = dtype if dtype is None else parse_dtype(dtype)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    gpu = configs.gpu_name() if dev.type == "cuda" else "cpu"
    log = _TrialLog(Path(csv_path))
    files = _ConfigFiles(Path(out), gpu)
    weights: dict[tuple[str, int], Any] = {}
    summary: dict[str, Any] = dict(tuned=[], skipped=[], not_tuned=[], copied=[], out=str(out), gpu=gpu)
    jobs = [(s, R, T) for R in ranks for T in tokens for s in shapes]
    bar = tqdm(jobs, desc="tuning", disable=not progress)
    for s, R, T in bar:
        bar.set_postfix_str(f"{s.name} R={R} T={T} {time.perf_counter() - t0:.0f}s")
        S = s.lora_slices
        need = [
            g
            for g in ("lora", "base")
            if not log.choices(s.name, g, T, R if g == "lora" else None, L=adapters if g == "lora" else None)
        ]
        done = {
            g: log.choices(s.name, g, T, R if g == "lora" else None, adapters if g == "lora" else None)
            for g in ("lora", "base")
            if g not in need
        }
        if not need:
            summary["skipped"].append((s.name, R, T))
        elif over_budget(deadline, log, BUDGET_WORKLOAD_NOTE, model=s.name, R=R, L=adapters, T=T):
            summary["not_tuned"].append((s.name, R, T))
        else:
            key = (s.name, R)
            if key not in weights:
                weights.clear()  # keep one model's weights at a time on the device
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                weights[key] = layer_inputs(
                    s, 1, rank=R, num_adapters=adapters, dtype=dtype, device=dev, seed=seed, bias=False
                )
            got = tune_workload(
                s,
                T,
                R,
                adapters,
                weights[key],
                dev,
                log,
                deadline=deadline,
                max_bms=max_bms,
                max_cands=max_cands,
                t0=t0,
                groups=need,
            )
            done.update(got)
            summary["tuned"].append((s.name, R, T))
        if "lora" in done:
            files.put_lora(s, T, R, adapters, S, done["lora"])
        if "base" in done:
            files.put_base(s, T, done["base"])
        files.save()
    for s in shapes:
        src = next((R for R in ranks), None)
        for Rc in copy_ranks:
            if Rc in ranks or src is None:
                continue
            for T in tokens:
                if log.choices(s.name, "lora", T, Rc, adapters):
                    files.put_lora(
                        s, T, Rc, adapters, s.lora_slices, log.choices(s.name, "lora", T, Rc, adapters)
                    )
                    continue
                cfgs = log.choices(s.name, "lora", T, src, adapters)
                if not cfgs:
                    continue
                cfgs = _for_rank(cfgs, Rc)
                ids = dict(model=s.name, R=Rc, L=adapters, T=T, H=s.hidden, I=s.intermediate, E=s.experts)
                ids.update(K=s.top_k, S=s.lora_slices, group="lora")
                for op, c in cfgs.items():
                    note = f"copied from R={src} (not tuned)"
                    append_config_row(log, "copied", ids, op, c.BLOCK_SIZE_M, c, note=note)
                files.put_lora(s, T, Rc, adapters, s.lora_slices, cfgs)
                summary["copied"].append((s.name, Rc, T))
    files.save()
    elapsed = time.perf_counter() - t0
    log.append(
        kind="session",
        elapsed_s=round(elapsed, 2),
        note=f"tuned {len(summary['tuned'])}, skipped {len(summary['skipped'])}, "
        f"not tuned (budget) {len(summary['not_tuned'])}, copied {len(summary['copied'])}",
    )
    summary["elapsed_s"] = elapsed
    return summary


def _models_type(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError(f"expected comma-separated preset names, got {text!r}")
    for m in names:
        get_shape(m)  # ValueError naming the known presets
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring). Every argument is checked before any work: a bad one
    exits with code 2 and one error line naming the flag."""
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.studies.tuning", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model",
        required=True,
        type=arg_type(_models_type, "models"),
        help="preset name(s), comma-separated",
    )
    p.add_argument(
        "--ranks",
        default="32",
        type=int_list_type(1),
        help="ranks to tune, comma-separated (the first is the copy source)",
    )
    p.add_argument(
        "--copy-ranks",
        default="",
        type=int_list_type(1, allow_empty=True),
        help="ranks that get the first rank's choices (not tuned)",
    )
    pos_int = arg_type(lambda t: parse_int(t, 1), "int >= 1")
    p.add_argument("--adapters", type=pos_int, default=8, help="L, adapter slots")
    p.add_argument(
        "--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192", type=int_list_type(1)
    )
    p.add_argument(
        "--out",
        required=True,
        type=arg_type(path_type(check_out), "folder"),
        help="config folder to write the JSON files into",
    )
    p.add_argument(
        "--csv",
        required=True,
        type=arg_type(path_type(_check_csv), "csv file"),
        help="trials CSV (appended; resumable)",
    )
    p.add_argument(
        "--budget-s",
        type=arg_type(budget_type, "seconds"),
        default=math.inf,
        help="no new workload starts past this",
    )
    p.add_argument(
        "--device",
        default=None,
        type=arg_type(lambda t: str(check_device(t, None)), "device"),
        help="cuda or cpu (default: cuda if available)",
    )
    p.add_argument(
        "--max-bms", type=pos_int, default=2, help="BLOCK_SIZE_M candidates per group (+ the default's)"
    )
    p.add_argument("--max-candidates", type=pos_int, default=6, help="configs per op and BLOCK_SIZE_M")
    p.add_argument("--seed", type=arg_type(lambda t: parse_int(t, None), "int"), default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:  # the default device and whatever argparse cannot see (all before any work)
        check_device(a.device, "--device")
        _check_tune_args(
            a.model,
            a.ranks,
            a.adapters,
            a.tokens,
            a.out,
            a.csv,
            a.budget_s,
            a.copy_ranks,
            a.device,
            None,
            a.max_bms,
            a.max_candidates,
            a.seed,
        )
    except ValueError as e:
        p.error(str(e))
    summary = tune(
        a.model,
        a.ranks,
        a.adapters,
        a.tokens,
        a.out,
        a.csv,
        budget_s=a.budget_s,
        copy_ranks=a.copy_ranks,
        device=a.device,
        max_bms=a.max_bms,
        max_cands=a.max_candidates,
        seed=a.seed,
        progress=not a.no_progress,
    )
    print(
        f"tuning: {len(summary['tuned'])} workloads tuned, {len(summary['skipped'])} already done, "
        f"{len(summary['not_tuned'])} not tuned (budget): {summary['not_tuned']}, "
        f"{len(summary['copied'])} copied; wrote {summary['out']} ({summary['gpu']}); "
        f"elapsed {summary['elapsed_s']:.1f} s"
    )
    return 0


# ------------------------------------------------------------------------------------------------
# Notebook 07 helpers: tuned vs default, per-op breakdown, targets
# ------------------------------------------------------------------------------------------------


def compare_tuned_vs_default(
    models: Sequence[str],
    tokens: Sequence[int],
    *,
    rank: int = 32,
    num_adapters: int = 8,
    device="cuda",
    dtype=torch.bfloat16,
    seed: int = 0,
    folder=None,
    warmup_ms: float = 10,
    rep_ms: float = 40,
    progress: bool = True,
    weights=None,
    min_reps: int | None = None,
) -> list[dict]:
    """:func:`moelora_lib.studies.moe_bench.bench_layer` rows (parts base, lora, total) of stage
    ``even_k_fused_add`` with :func:`default_config` and stage ``tuned`` (configs from
    :func:`moelora_lib.configs.load_layer_config`; ``folder`` None = the loader's precedence) per
    (model, T); uniform ids, silu, no biases (the vLLM side-by-side setting), graph mode.
    ``weights``: a :class:`~moelora_lib.studies.moe_bench.LayerWeights` of the same rank, L, dtype,
    device and seed to take each model's bias-free weight set from (None: generated here)."""
    from moelora_lib.studies.notebook import progress as tqdm  # a text bar, also in notebooks

    from .moe_bench import bench_layer, layer_inputs

    if weights is not None and (weights.rank, weights.num_adapters, weights.seed) != (
        rank,
        num_adapters,
        seed,
    ):
        raise ValueError(
            f"weights: a LayerWeights of rank {weights.rank}, L {weights.num_adapters}, seed {weights.seed}; "
            f"expected rank {rank}, L {num_adapters}, seed {seed}"
        )
    rows = []
    for m in models:
        s = get_shape(m)
        if weights is not None:
            w = weights.get(s, bias=False)
        else:
            w = layer_inputs(
                s, 1, rank=rank, num_adapters=num_adapters, dtype=dtype, device=device, seed=seed, bias=False
            )
        for T in tqdm(list(tokens), desc=f"{m} tuned vs default", disable=not progress):
            for stage in (TUNE_STAGE, "tuned"):
                cfg = None
                if stage == "tuned" and folder is not None:
                    cfg = configs.load_layer_config(
                        Dims.of(s, T, rank=rank, adapters=num_adapters),
                        folder=folder,
                        gpu_name=None if torch.device(device).type == "cuda" else "cpu",
                    )
                rows += bench_layer(
                    stage,
                    s,
                    T,
                    rank=rank,
                    num_adapters=num_adapters,
                    pattern="uniform",
                    dtype=dtype,
                    device=device,
                    config=cfg,
                    seed=seed,
                    activation="silu",
                    bias=False,
                    weights=w,
                    warmup_ms=warmup_ms,
                    rep_ms=rep_ms,
                    min_reps=min_reps,
                )
        del w
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def op_breakdown(
    stage: str,
    model: str,
    T: int,
    *,
    rank: int = 32,
    num_adapters: int = 8,
    device="cuda",
    dtype=torch.bfloat16,
    seed: int = 0,
    config: LayerConfig | None = None,
    weights=None,
    warmup_ms: float = 10,
    rep_ms: float = 40,
    min_reps: int | None = None,
) -> list[dict]:
    """Each of the six launches of one layer timed alone (graph mode on the GPU), with its FLOPs,
    bytes, floor and the achieved TB/s and TFLOP/s (:func:`moelora_lib.studies.moe_bench.op_costs`)."""
    from .moe_bench import layer_inputs, make_run, op_costs

    s = get_shape(model)
    inp = layer_inputs(
        s,
        T,
        rank=rank,
        num_adapters=num_adapters,
        pattern="uniform",
        dtype=dtype,
        device=device,
        seed=seed,
        activation="silu",
        bias=False,
        weights=weights,
    )
    run = make_run(stage, inp, config)
    run()
    costs = {
        c["op"]: c
        for c in op_costs(
            s,
            run.dims,
            dtype_bytes=inp.hidden_states.element_size(),
            topk_ids=inp.topk_ids,
            lora_ids=inp.lora_ids,
        )
    }
    rows = []
    for op in BASE_OPS + LORA_OPS:
        cfg = getattr(run.cfg, op)
        tm = bench.time_fn(run.op_fn(op, cfg), "graph", device, warmup_ms, rep_ms, min_reps=min_reps)
        c = costs[op]
        sec = tm.ms_p50 * 1e-3
        rows.append(
            bench.result_row(
                stage=stage,
                model=model,
                T=T,
                R=rank,
                L=num_adapters,
                op=op,
                config=cfg.short(),
                config_source=run.cfg.source,
                mode=tm.mode,
                ms_p50=tm.ms_p50,
                us_p50=tm.ms_p50 * 1e3,
                flops=c["flops"],
                bytes=c["bytes"],
                floor_us=c["floor_us"],
                bound=c["bound"],
                achieved_tb_s=c["bytes"] / sec / 1e12,
                achieved_tflops=c["flops"] / sec / 1e12,
            )
        )
    return rows


#: The stage-7 targets (notebook 07): (name, description). Evaluated by :func:`targets_table`.
TARGETS = {
    "tuned_not_slower": "tuned ≤ default (LoRA part, base and whole layer; 3 % noise allowance)",
    "lora_vs_vllm": "LoRA part ≥ 2.5× faster than vLLM's best at T ≤ 64, ≥ 2× at T ≥ 256",
    "lora_share": "LoRA part ≤ 25 % of our base at T ≤ 64, ≤ 10 % at T ≥ 1600",
    "total_vs_vllm": "whole layer ≥ 1.5× faster than vLLM's best at every T",
    "base_vs_floor": "base layer within 1.5× of the physical floor",
}
NOISE = 1.03


def targets_table(df, anchors=None):
    """One row per (model, T) from :func:`compare_tuned_vs_default` rows (a DataFrame) with the
    tuned and default µs per part, vLLM's figures
    (``anchors``: :func:`moelora_lib.studies.moe_bench.anchor_table`,
    joined where present), the ratios and a met? column per target (None where a target does not
    apply or vLLM has no figure)."""
    import pandas as pd

    piv = df.pivot_table(index=["model", "T"], columns=["stage", "part"], values="us_p50")
    floor = df[(df.stage == "tuned") & (df.part == "base")].set_index(["model", "T"]).floor_us
    t = pd.DataFrame(index=piv.index)
    for part in ("lora", "base", "total"):
        t[f"{part}_default_us"] = piv[(TUNE_STAGE, part)]
        t[f"{part}_tuned_us"] = piv[("tuned", part)]
        t[f"{part}_speedup"] = t[f"{part}_default_us"] / t[f"{part}_tuned_us"]
    t["base_floor_us"] = floor
    t = t.reset_index()
    if anchors is not None and len(anchors):
        a = anchors[["model", "T", "lora_best_us", "total_best_us", "base_us"]].rename(
            columns={"base_us": "vllm_base_us"}
        )
        t = t.merge(a, on=["model", "T"], how="left")
    else:
        t["lora_best_us"] = float("nan")
        t["total_best_us"] = float("nan")
        t["vllm_base_us"] = float("nan")
    t["met_tuned_not_slower"] = (
        (t.lora_tuned_us <= NOISE * t.lora_default_us)
        & (t.base_tuned_us <= NOISE * t.base_default_us)
        & (t.total_tuned_us <= NOISE * t.total_default_us)
    )
    t["lora_vs_vllm_x"] = t.lora_best_us / t.lora_tuned_us
    need = t["T"].map(lambda T: 2.5 if T <= 64 else 2.0)
    t["met_lora_vs_vllm"] = [None if math.isnan(x) else bool(x >= n) for x, n in zip(t.lora_vs_vllm_x, need)]
    t["lora_share"] = t.lora_tuned_us / t.base_tuned_us
    t["met_lora_share"] = [
        bool(sh <= 0.25) if T <= 64 else (bool(sh <= 0.10) if T >= 1600 else None)
        for T, sh in zip(t["T"], t.lora_share)
    ]
    t["total_vs_vllm_x"] = t.total_best_us / t.total_tuned_us
    t["met_total_vs_vllm"] = [None if math.isnan(x) else bool(x >= 1.5) for x in t.total_vs_vllm_x]
    t["base_over_floor"] = t.base_tuned_us / t.base_floor_us
    t["met_base_vs_floor"] = t.base_over_floor <= 1.5
    return t


def cumulative_table(stages_csv, tuned_csv, *, pattern: str = "uniform"):
    """The cumulative table naive → … → even_k_fused_add → tuned, per model and T (µs, graph mode).

    Args:
        stages_csv: notebook 06's CSV (every stage up to even_k_fused_add, silu, no biases).
        tuned_csv: notebook 07's CSV (stage ``tuned``, same shapes and method).
        pattern: adapter-id pattern of the 06 rows to use (07 ran ``uniform``).
    Returns:
        DataFrame with columns model, T, part, one column per stage, ``run`` naming the CSVs. The
        two CSVs come from separate runs of the same harness, so a ratio between the ``tuned``
        column and the others is across runs (compare only beyond run-to-run spread).
    """
    import pandas as pd

    order = ["naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add", "tuned"]
    a = pd.read_csv(stages_csv)
    a = a[(a.pattern == pattern) & (a.activation == "silu")]
    b = pd.read_csv(tuned_csv)
    b = b[b.stage == "tuned"]
    both = pd.concat([a, b], ignore_index=True)
    both = both[both.part.isin(["lora", "total"])]
    t = both.pivot_table(index=["model", "T", "part"], columns="stage", values="us_p50").reset_index()
    t = t[["model", "T", "part"] + [s for s in order if s in t.columns]]
    t["run"] = f"{os.path.basename(str(stages_csv))} + {os.path.basename(str(tuned_csv))}"
    return t


if __name__ == "__main__":
    sys.exit(main())
