"""Dev probe (not part of the library): the one-launch dense decode GEMV (moelora_lib.kernels.dense_gemv)
against the base GEMM alone and stage ``tuned``, per projection and T, with a small config sweep; plus a
race check of its split-K last-arriver reduction (300 repeated calls against the reference, the workspace
left all zero). Rows have moelora_lib.studies.dense_bench's columns.

Run on a GPU host from the repo root: ``OUT=dir python data/dev/probes/dense_gemv_probe.py DENSE FP8``
where DENSE and FP8 are comma-separated "<model>/<proj>" lists (bf16 weights, then block-FP8 weights).
Writes ``$OUT/dense_gemv_bench.csv`` after each projection. On a CPU (``DEV=cpu``, TRITON_INTERPRET=1)
it runs at the sizes given (e.g. tiny/qkv) as a smoke test.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moelora_lib.kernels import dense_gemv as dg
from moelora_lib.linear import lora_linear_reference
from moelora_lib.quant.fp8 import FP8_BLOCK
from moelora_lib.studies.bench import free_memory
from moelora_lib.studies.dense_bench import (
    ProjectionInputs,
    _kw,
    _point,
    _rel_err,
    _time_row,
    build_module,
    dequantized,
    fp8_weight,
    get_projection,
    make_inputs,
)
from moelora_lib.testing import TOLERANCES


def gemv_sweep_configs(T: int, proj, *, num_sms: int = 132, block_k: int | None = None) -> list:
    """:func:`~moelora_lib.kernels.dense_gemv.default_dense_gemv_config` first, then 8 warps, 2 stages,
    BLOCK_SIZE_N 128 (SPLIT_K doubled) and 32 (halved), SPLIT_K doubled and halved, BLOCK_SIZE_K halved and
    doubled (32..256); SPLIT_K within the K tiles; ``block_k`` (an FP8 weight's block columns): BLOCK_SIZE_K | it."""
    import dataclasses

    p = get_projection(proj)
    d = dg.default_dense_gemv_config(
        T, p.n_total, p.hidden, slices=p.slices, num_sms=num_sms, block_k=block_k
    )

    def cfg(bn=d.BLOCK_SIZE_N, bk=d.BLOCK_SIZE_K, split=d.SPLIT_K, **kw):
        split = max(1, min(split, -(-p.hidden // bk)))
        return dataclasses.replace(d, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, SPLIT_K=split, **kw)

    out = [d, cfg(NUM_WARPS=8), cfg(NUM_STAGES=2), cfg(bn=128, split=2 * d.SPLIT_K),
           cfg(bn=32, split=max(1, d.SPLIT_K // 2)), cfg(split=2 * d.SPLIT_K), cfg(split=max(1, d.SPLIT_K // 2)),
           cfg(bk=max(32, d.BLOCK_SIZE_K // 2)), cfg(bk=min(256, 2 * d.BLOCK_SIZE_K))]  # fmt: skip
    return list(dict.fromkeys(c for c in out if block_k is None or block_k % c.BLOCK_SIZE_K == 0))


def dense_gemv_bench(projs: Sequence, tokens: Sequence[int], *, patterns=("uniform", "mixed"),
                     configs=None, rank: int = 32, adapters: int = 8, dtype=torch.bfloat16, device="cuda",
                     seed: int = 0, mode: str = "graph", warmup_ms: float = 25, rep_ms: float = 100,
                     min_reps: int | None = None, fp8: bool = False,
                     fp8_block: tuple[int, int] = FP8_BLOCK) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`~moelora_lib.kernels.dense_gemv.dense_gemv_lora` against the base GEMM alone and stage
    ``tuned`` per projection ("<model>/<proj>") and T in [1, DENSE_GEMV_MAX_TOKENS]; ``fp8``: all on the
    weight quantized to block FP8 (``fp8_block``). Rows: :func:`bench_projection`'s columns plus
    ``weight_format``, ``rel_err`` (against ``lora_linear_reference``; FP8: on the dequantized weight) and
    ``x_base`` (÷ the base GEMM): impl "cublas" / "fp8_weight_only" (part base), "tuned" (total, per
    pattern), "gemv_base" (base: no LoRA part) and "gemv" (total; pattern "none" = every id -1, then
    ``patterns``), each gemv point at every config of ``configs(T, proj)`` (default
    :func:`gemv_sweep_configs`) as two rows: config_source "default" and "sweep-best" (fastest within
    tolerance). ValueError for an unknown projection, a T out of range or a block the GEMV refuses."""
    bad = [T for T in tokens if not 1 <= int(T) <= dg.DENSE_GEMV_MAX_TOKENS]
    if bad:
        raise ValueError(f"tokens must be in [1, {dg.DENSE_GEMV_MAX_TOKENS}], got {bad}")
    bk = fp8_block[1] if fp8 else None
    configs = configs or (lambda T, p: gemv_sweep_configs(T, p, block_k=bk))
    timing = dict(mode=mode, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)
    rows: list[dict[str, Any]] = []
    for proj in projs:
        inp = make_inputs(
            proj, max(tokens), rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed
        )
        weight = fp8_weight(inp, tuple(fp8_block)) if fp8 else None
        for T in tokens:
            rows += _gemv_point(inp, T, patterns, configs, timing, weight)
        del inp, weight
        free_memory(device)
    return rows


def _gemv_point(inp: ProjectionInputs, T: int, patterns, configs, timing, weight) -> list[dict[str, Any]]:
    """The rows of :func:`dense_gemv_bench` at one (projection, T); ``weight``: an FP8 weight or None."""
    from moelora_lib.kernels.dense_fp8 import dense_fp8_weight_only

    ref_inp = inp if weight is None else dequantized(inp, weight)  # the weight the kernels' results equal
    ref_dtype, fmt = torch.float64 if inp.device.type == "cpu" else torch.float32, dict(weight_format="dense")
    x = inp.x_for(T)
    if weight is None:
        base_fn, base_impl = (lambda: F.linear(x, inp.weight)), "cublas"
    else:
        base_fn, base_impl, fmt = (
            (lambda: dense_fp8_weight_only(x, weight)),
            "fp8_weight_only",
            {"weight_format": "fp8"},
        )
    mod = build_module(inp, "tuned", max_tokens=T, weight=weight)  # its weight format sets the costs too
    costs = _point(inp, T, "uniform", mod)[1]
    base = _time_row(base_fn, inp, T, "none", costs["base"], _kw(base_impl, None, "base"), timing)
    rows = [base | fmt | dict(rel_err=math.nan)]

    def ids_ref(pat):
        ids = (
            torch.full((T,), -1, dtype=torch.int32, device=inp.device)
            if pat == "none"
            else inp.lora_ids(T, pat)
        )
        a = ref_inp
        return ids, lora_linear_reference(
            x, a.weight, a.lora_a, a.lora_b, ids, slices=a.proj.slices, dtype=ref_dtype
        )

    for pat in patterns:
        ids, ref = ids_ref(pat)
        kw = _kw("tuned", "tuned", "total", mod.config_for(T))
        r = _time_row(
            lambda ids=ids: mod(x, ids), inp, T, pat, _point(inp, T, pat, mod)[1]["total"], kw, timing
        )
        rows.append(r | fmt | dict(rel_err=_rel_err(mod(x, ids), ref)))
    for impl, part, pat in [("gemv_base", "base", "none"), ("gemv", "total", "none")] + [
        ("gemv", "total", p) for p in patterns
    ]:
        ids, ref = ids_ref(pat)
        lora = (inp.lora_a, inp.lora_b, ids) if impl == "gemv" else (None, None, None)
        cost, timed = (costs if pat == "none" else _point(inp, T, pat, mod)[1])[part], []
        for cfg in configs(T, inp.proj):
            ws = dg.dense_gemv_workspace(
                T, inp.proj.n_total, dg.dense_gemv_num_tiles(inp.proj.slices, 8), x.device
            )
            out = torch.empty((T, inp.proj.n_total), dtype=inp.dtype, device=inp.device)
            kw = dict(slices=inp.proj.slices, config=cfg, workspace=ws, out=out)
            call = lambda kw=kw, lora=lora: dg.dense_gemv_lora(x, weight or inp.weight, None, *lora, **kw)  # noqa: E731
            row = dict(
                impl=impl, stage=None, part=part, config=cfg.short(), config_source="sweep", block_size_m=None
            )
            timed.append(
                _time_row(call, inp, T, pat, cost, row, timing) | fmt | dict(rel_err=_rel_err(call(), ref))
            )
        ok = [r for r in timed if r["rel_err"] <= TOLERANCES[inp.dtype]]
        rows.append(dict(timed[0], config_source="default"))
        rows.append(dict(min(ok or timed[:1], key=lambda r: r["us_p50"]), config_source="sweep-best"))
    return [r | dict(x_base=r["us_p50"] / base["us_p50"]) for r in rows]


def race_check(proj: str, dev: str, dtype: torch.dtype, reps: int) -> None:
    """``reps`` split-K calls at T = 1 and 8 (one adapter per token) against the reference: the worst error
    and whether the workspace is all zero afterwards."""
    p = get_projection(proj)
    inp = make_inputs(p, 8, rank=32, adapters=8, dtype=dtype, device=dev, seed=0)
    for T in (1, 8):
        ids = torch.arange(T, dtype=torch.int32, device=dev) % 8
        x = inp.x_for(T)
        ref = lora_linear_reference(x, inp.weight, inp.lora_a, inp.lora_b, ids, slices=p.slices).float()
        cfg = dg.default_dense_gemv_config(T, p.n_total, p.hidden, slices=p.slices)
        ws = dg.dense_gemv_workspace(8, p.n_total, dg.dense_gemv_num_tiles(p.slices, 8), dev)
        worst = 0.0
        for _ in range(reps):
            y = dg.dense_gemv_lora(
                x, inp.weight, None, inp.lora_a, inp.lora_b, ids, slices=p.slices, config=cfg, workspace=ws
            )
            worst = max(worst, ((y.float() - ref).norm() / ref.norm()).item())
        zero = bool((ws.partial == 0).all()) and bool((ws.counters == 0).all())
        print(f"race {proj} T={T} cfg={cfg.short()} worst_rel_err={worst:.3e} ws_zero={zero}", flush=True)


def main() -> None:
    dev = os.environ.get("DEV", "cuda")
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    out, t0, rows_all = os.environ["OUT"], time.time(), []
    dense, fp8 = (sys.argv[1:3] + ["", ""])[:2]
    race_check(os.environ.get("PROJ0", "gpt-oss-20b/qkv"), dev, dtype, 300 if dev == "cuda" else 2)
    plan = [(n, False) for n in dense.split(",") if n] + [(n, True) for n in fp8.split(",") if n]
    tokens = [1, 2, 4, 8] if dev == "cuda" else [1, 2]
    for name, is_fp8 in plan:
        rows = dense_gemv_bench([name], tokens, warmup_ms=10, rep_ms=40, dtype=dtype, device=dev, fp8=is_fp8)
        rows_all += rows
        keys = list(dict.fromkeys(k for r in rows_all for k in r))
        with open(f"{out}/dense_gemv_bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows_all)
        for r in rows:
            print(r.get("weight_format"), r.get("model"), r.get("proj"), r["T"], r["impl"], r["pattern"],
                  r.get("config_source"), r.get("config"), f"{r['us_p50']:.2f}", f"x_base={r['x_base']:.3f}",
                  f"rel_err={r['rel_err']:.2e}", flush=True)  # fmt: skip
        print(f"-- {name} fp8={is_fp8} done at {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
