"""Tune the Helion linear backend: time a short, hand-picked list of configs per (shape, M bucket) and
write the winners into the per-GPU JSON (moelora_lib/configs/helion/<GPU_NAME>.json format).

Usage (on the GPU; a subprocess from a notebook is fine, it has a proper ``__main__``)::

    python -m moelora_lib.studies.helion_tune --shapes llama3-8b,qwen3-32b,llama3-70b \\
        --m 1,2,4,8,16,32,256,1024,4096 --epilogues none,swiglu \\
        --out moelora_lib/configs/helion/NVIDIA_H200.json --csv data/helion_tuning.csv --budget-s 300

Method:
  * cases: every projection (qkv, o, gate_up, down) of each model for epilogue "none"; gate_up only
    for "swiglu" (and "silu"); every projection for "bias". Identical (epilogue, K, N) are tuned once.
    Each ``--m`` value is timed at exactly that M and its config stored under ``bucket_for(M)``.
  * candidates (:func:`candidates`): 4–12 explicit configs per bucket class — decode (M ≤ 16): BM 16,
    BN 16–64, BK 128–512, 3–6 stages, pointer vs tensor-descriptor (TMA) loads of W, and split-K
    configs when the N tiles alone cannot give every SM two programs; M = 32: BM 32 or 16; prefill:
    64–128 × 64–256 tiles, split-K (also with 128 × 128 tiles on two warpgroups) when the tiles do
    not fill the GPU at M = 256–1024, TMA + persistent programs at M ≥ 1024.
    Decode buckets share their candidate list, so one compile serves several buckets.
  * compile first, in parallel: spawned worker processes generate the code and compile each
    (config, Triton M-variant) without launching (``run(..., warmup=True)``), filling Triton's on-disk
    cache; the timing process then only loads cubins. Failed compiles are logged and skipped.
  * timing: ``moelora_lib.studies.bench.time_fn(fn, "graph", flush_l2=--l2)`` (CUDA-graph replay;
    by default the L2 is evicted by a read before every call, so the timed call does not also pay
    for writing back a dirty flush buffer — see moelora_lib.studies.bench) for every candidate and for the
    PyTorch path (cuBLAS ``F.linear`` + epilogue) at the same M, after a correctness check against
    PyTorch (relative error within :data:`moelora_lib.testing.TOLERANCES` of the dtype, of max |ref|).
  * resumable: a (epilogue, dtype, K, N, bucket) already in ``--out`` is skipped (``--force`` redoes
    it); the JSON is rewritten atomically after every case, the CSV appended after every case.
  * ``--budget-s``: no new case starts after this many seconds; the rest is left for a later run.
    The total tuning seconds (summed over runs) are kept in the JSON's ``_meta.tuning_seconds`` and in
    the CSV column ``tune_elapsed_s``.

CSV: one row per (case, candidate) and one per PyTorch baseline: op (epilogue), models, K, N, M,
bucket, dtype, impl ("helion" | "torch"), candidate, config (JSON), status ("ok" | "compile_error" |
"run_error" | "wrong"), error, rel_err, ms_p50/p20/p80, mode, speedup_vs_torch, best, compile_s, plus
the bench environment columns.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from moelora_lib.hardware import H200_NUM_SMS

DEFAULT_M = (1, 2, 4, 8, 16, 32, 256, 1024, 4096)


# ---------------------------------------------------------------------------------------------
# Candidate configs
# ---------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, warps, stages, indexing="pointer", pid="flat", l2=None, split=None) -> dict:
    c: dict[str, Any] = {
        "block_sizes": [bm, bn, bk],
        "num_warps": warps,
        "num_stages": stages,
        "indexing": indexing,
        "pid_type": pid,
    }
    if l2:
        c["l2_groupings"] = [l2]
    if split:
        c["split_k"] = split
    return c


def _split_factor(k: int, n: int, bn: int, num_sms: int, m_tiles: int = 1) -> int | None:
    """A split_k that brings the output tiles (``m_tiles`` x ceil(N / bn)) up to about two programs
    per SM, or None if not needed. Each chunk keeps at least 1024 elements of K; at most 16 chunks."""
    tiles = m_tiles * math.ceil(n / bn)
    if tiles >= 2 * num_sms:
        return None
    s = 1
    while tiles * s < 2 * num_sms and k // (2 * s) >= 1024 and s < 16:
        s *= 2
    return s if s > 1 else None


#: Largest shared-memory footprint a candidate may ask for (the H200 allows 227 KiB per block).
SMEM_LIMIT_BYTES = 227 * 1024


def smem_bytes(cfg: dict, epilogue: str, elem: int = 2) -> int:
    """Pipelined shared memory of a candidate: num_stages x (x tile + W tile(s)), in bytes."""
    bm, bn, bk = cfg["block_sizes"]
    w_tiles = 2 if epilogue == "swiglu" else 1
    return cfg["num_stages"] * (bm * bk + w_tiles * bn * bk) * elem


def candidates(epilogue: str, k: int, n: int, bucket: int, num_sms: int = H200_NUM_SMS) -> list[dict]:
    """The explicit candidate list for one (epilogue, K, N, bucket); see the module docstring.

    Decode (M <= 16): the weight stream is all that matters, so the list varies what keeps enough
    bytes in flight on every SM: BN 16-64 (more programs for narrow N), BK 128-512, 3-6 stages,
    pointer vs tensor-descriptor (TMA) loads, and split-K when the N tiles alone cannot give every
    SM two programs. M = 32: the same with BM 32, and BM 16 (two row tiles). Prefill: 64-128 x
    64-256 tiles, L2 grouping 8, split-K when the tiles do not fill the GPU (M = 256-1024 with narrow
    N, also on 128 x 128 tiles with two warpgroups), TMA + persistent programs.
    Decode buckets share their candidate list, so one compile serves several buckets. Candidates
    whose pipelined tiles exceed :data:`SMEM_LIMIT_BYTES` are dropped.
    """
    from moelora_lib.common import is_int
    from moelora_lib.helion_linear.configs import BUCKETS, EPILOGUES, SPLIT_K_EPILOGUES

    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
    if bucket not in BUCKETS:
        raise ValueError(f"bucket: expected one of {BUCKETS}, got {bucket!r}")
    for name, v in (("k", k), ("n", n), ("num_sms", num_sms)):
        if not (is_int(v) and v >= 1):
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    splittable = epilogue in SPLIT_K_EPILOGUES

    def split(bm: int, bn: int, bk: int, warps: int, stages: int, m_tiles: int = 1, **kw) -> list[dict]:
        if not splittable:
            return []
        f = _split_factor(k, n, bn, num_sms, m_tiles)
        return [_cfg(bm, bn, bk, warps, stages, split=f, **kw)] if f else []

    out: list[dict]
    if epilogue == "swiglu":  # two W tiles per k step: half the BN (or stages) of the plain GEMM
        if bucket <= 16:
            out = [
                _cfg(16, 64, 128, 4, 4),
                _cfg(16, 32, 256, 4, 4),
                _cfg(16, 32, 256, 4, 5),
                _cfg(16, 16, 512, 4, 4),
                _cfg(16, 64, 256, 4, 3),
                _cfg(16, 64, 128, 4, 4, indexing="tensor_descriptor"),
                _cfg(16, 32, 256, 4, 4, indexing="tensor_descriptor"),
            ]
        elif bucket <= 32:
            out = [
                _cfg(32, 64, 128, 4, 4),
                _cfg(32, 32, 256, 4, 3),
                _cfg(32, 32, 256, 4, 4),
                _cfg(32, 64, 128, 4, 5),
            ]
        else:
            out = [
                _cfg(64, 128, 64, 8, 3, l2=8),
                _cfg(64, 64, 64, 4, 4, l2=8),
                _cfg(128, 64, 64, 8, 3, l2=8),
                _cfg(128, 128, 64, 8, 3, l2=8),
                _cfg(64, 128, 64, 8, 4, indexing="tensor_descriptor", l2=8),
            ]
    elif bucket <= 16:
        out = [
            _cfg(16, 64, 128, 4, 5),
            _cfg(16, 64, 256, 4, 4),
            _cfg(16, 32, 256, 4, 4),
            _cfg(16, 32, 256, 4, 6),
            _cfg(16, 32, 512, 4, 4),
            _cfg(16, 16, 512, 4, 4),
            _cfg(16, 64, 256, 8, 4),
            _cfg(16, 64, 256, 4, 3, indexing="tensor_descriptor"),
            _cfg(16, 32, 256, 4, 4, indexing="tensor_descriptor"),
        ]
        out += split(16, 64, 128, 4, 4) + split(16, 32, 256, 4, 4)
    elif bucket <= 32:
        out = [
            _cfg(32, 64, 128, 4, 4),
            _cfg(32, 32, 256, 4, 4),
            _cfg(32, 64, 256, 4, 3),
            _cfg(32, 32, 128, 4, 5),
            _cfg(32, 32, 256, 4, 6),
            _cfg(32, 64, 256, 4, 4),
            _cfg(32, 32, 512, 4, 3),
            # BM 16 at M = 32: two row tiles share each W tile through L2, half the accumulator.
            _cfg(16, 64, 128, 4, 5),
            _cfg(16, 32, 256, 4, 6),
        ]
        out += split(32, 64, 128, 4, 4) + split(32, 32, 256, 4, 4)
    elif bucket <= 256:
        out = [
            _cfg(64, 128, 64, 4, 4, l2=8),
            _cfg(128, 128, 64, 8, 3, l2=8),
            _cfg(64, 256, 64, 8, 3, l2=8),
            _cfg(64, 64, 128, 4, 4, l2=8),
            _cfg(128, 64, 64, 4, 4, l2=8),
            _cfg(64, 128, 64, 4, 4, indexing="tensor_descriptor", l2=8),
            _cfg(64, 128, 64, 4, 5, l2=8),
            _cfg(64, 256, 64, 4, 3, l2=8),
        ]
        out += split(64, 128, 64, 4, 4, m_tiles=max(1, bucket // 64), l2=8)
        out += split(128, 256, 64, 8, 3, m_tiles=max(1, bucket // 128), l2=8)
        # Two warpgroups per tile (the wgmma rate of one SM) and split-K to still fill the GPU.
        out += split(128, 128, 64, 8, 3, m_tiles=max(1, bucket // 128), l2=8)
        out += split(128, 128, 64, 8, 4, m_tiles=max(1, bucket // 128), indexing="tensor_descriptor", l2=8)
    else:
        out = [
            _cfg(128, 128, 64, 8, 3, l2=8),
            _cfg(128, 256, 64, 8, 3, l2=8),
            _cfg(128, 256, 64, 8, 3, indexing="tensor_descriptor", pid="persistent_interleaved", l2=8),
            _cfg(128, 128, 64, 8, 4, indexing="tensor_descriptor", pid="persistent_interleaved", l2=8),
            _cfg(128, 256, 64, 8, 4, indexing="tensor_descriptor", l2=8),
        ]
        out += split(128, 128, 64, 8, 4, m_tiles=max(1, bucket // 128), indexing="tensor_descriptor", l2=8)
    return [c for c in out if smem_bytes(c, epilogue) <= SMEM_LIMIT_BYTES]


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def build_cases(models: list[str], epilogues: list[str], ms: list[int]) -> list[dict]:
    """``[{"epilogue", "K", "N", "models": "llama3-8b:qkv;...", "m", "bucket"}, ...]``, deduplicated."""
    from moelora_lib.helion_linear import bucket_for, linear_shapes

    groups: dict[tuple[str, int, int], list[str]] = {}
    for model, proj, k, n in linear_shapes(models):
        for epi in epilogues:
            if epi in ("swiglu", "silu") and proj != "gate_up":
                continue
            groups.setdefault((epi, k, n), []).append(f"{model}:{proj}")
    cases = []
    for (epi, k, n), names in groups.items():
        seen = set()
        for m in ms:
            b = bucket_for(m)
            if b in seen:
                continue
            seen.add(b)
            cases.append({"epilogue": epi, "K": k, "N": n, "models": ";".join(names), "m": m, "bucket": b})
    return cases


def cases_to_tune(
    models: list[str],
    epilogues: list[str],
    ms: list[int],
    table: dict,
    dtype: str = "bfloat16",
    force: bool = False,
) -> list[dict]:
    """The cases of :func:`build_cases` that a run would tune: those without an entry in ``table`` (a
    loaded config file; every case with ``force``). Cheap (no GPU, no Helion import): notebook 08 asks
    it first and starts the tuner's process only when something is left to tune."""
    from moelora_lib.helion_linear import lookup

    return [
        c
        for c in build_cases(models, epilogues, ms)
        if force or lookup(table, c["epilogue"], dtype, c["K"], c["N"], c["bucket"]) is None
    ]


# ---------------------------------------------------------------------------------------------
# Parallel precompile (spawned workers; compile without launching)
# ---------------------------------------------------------------------------------------------
def _compile_only_launcher(triton_kernel, grid, *args, num_warps, num_stages, **kwargs):
    """Helion launcher that compiles (and fills Triton's disk cache) but launches nothing."""
    kwargs.setdefault("launch_cooperative_grid", False)
    return triton_kernel.run(
        *args, grid=grid, warmup=True, num_warps=num_warps, num_stages=num_stages, **kwargs
    )


def _precompile(task: dict) -> dict:
    """Worker: build the runner for task["config"] and compile it for each M in task["ms"]."""
    t0 = time.perf_counter()
    try:
        import torch

        from moelora_lib.helion_linear import build_runner, kernel_args

        dtype = getattr(torch, task["dtype"])
        k, n, epi = task["K"], task["N"], task["epilogue"]
        w = torch.empty(n, k, dtype=dtype, device="cuda")
        b = torch.empty(n, dtype=dtype, device="cuda") if epi == "bias" else None
        runner = build_runner(epi, task["config"], w, b)
        for m in task["ms"]:
            x = torch.empty(m, k, dtype=dtype, device="cuda")
            runner(*kernel_args(epi, x, w, b), _launcher=_compile_only_launcher)
        return {**task, "ok": True, "error": "", "compile_s": time.perf_counter() - t0}
    except Exception as e:  # a config that does not compile (e.g. out of shared memory)
        return {
            **task,
            "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:300]}",
            "compile_s": time.perf_counter() - t0,
        }


def _task_key(epi: str, dtype: str, k: int, n: int, cfg: dict) -> str:
    return json.dumps([epi, dtype, k, n, cfg], sort_keys=True)


def precompile(cases: list[dict], dtype: str, jobs: int, timeout_s: float, log) -> dict[str, dict]:
    """Compile every (case candidate, Triton M-variant) in ``jobs`` spawned processes.
    Returns {task_key: result}; a task that did not finish within ``timeout_s`` is absent."""
    from moelora_lib.helion_linear import warm_m_values

    tasks: dict[str, dict] = {}
    for c in cases:
        for cfg in candidates(c["epilogue"], c["K"], c["N"], c["bucket"]):
            key = _task_key(c["epilogue"], dtype, c["K"], c["N"], cfg)
            t = tasks.setdefault(
                key,
                {
                    "epilogue": c["epilogue"],
                    "dtype": dtype,
                    "K": c["K"],
                    "N": c["N"],
                    "config": cfg,
                    "ms": [],
                },
            )
            for m in warm_m_values(c["bucket"]) + [c["m"]]:  # every Triton variant warmup() meets
                if m not in t["ms"]:
                    t["ms"].append(m)
    return precompile_tasks(tasks, jobs, timeout_s, log)


def precompile_tasks(tasks: dict[str, dict], jobs: int, timeout_s: float, log) -> dict[str, dict]:
    """Compile ``tasks`` ({task_key: {"epilogue", "dtype", "K", "N", "config", "ms"}}, see
    :func:`precompile`) in ``jobs`` spawned processes (:func:`_precompile`: the runner of each config
    built and run with a launcher that compiles without launching, for every M; Triton's on-disk cache
    keeps the binaries, so a later build of the same config in another process loads them instead of
    compiling). Returns {task_key: result}; a task that did not finish within ``timeout_s`` is absent."""
    if jobs <= 0 or not tasks:
        return {}
    results: dict[str, dict] = {}
    log(f"precompiling {len(tasks)} (shape, config) tasks in {jobs} processes")
    t0 = time.perf_counter()
    ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
    try:
        futs = {ex.submit(_precompile, t): key for key, t in tasks.items()}
        done, pending = wait(futs, timeout=timeout_s)
        for f in done:
            try:
                results[futs[f]] = f.result()
            except Exception as e:  # a dead worker
                results[futs[f]] = {"ok": False, "error": f"worker: {e}", "compile_s": float("nan")}
        if pending:
            log(f"precompile: {len(pending)} tasks unfinished after {timeout_s:.0f} s; compiled on demand")
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    bad = sum(not r["ok"] for r in results.values())
    log(f"precompile: {len(results)} done ({bad} failed) in {time.perf_counter() - t0:.1f} s")
    return results


# ---------------------------------------------------------------------------------------------
# Tuning
# ---------------------------------------------------------------------------------------------
def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.studies.helion_tune", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shapes", default="llama3-8b,qwen3-32b,llama3-70b", help="models (helion_linear.shapes)")
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="M values to time (one per bucket)")
    p.add_argument("--epilogues", default="none,swiglu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", required=True, help="config JSON to create or extend (atomic writes)")
    p.add_argument("--csv", required=True, help="CSV of every tried config (appended)")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new case after this many seconds")
    p.add_argument(
        "--jobs", type=int, default=-1, help="precompile processes (-1: cpu count - 2, max 14; 0: off)"
    )
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument(
        "--l2",
        default="clean",
        choices=["clean", "dirty"],
        help="L2 state before every timed call (bench.time_cuda flush_l2): 'clean' (evicted by a read, "
        "as in a real decode step) or 'dirty' (do_bench's zeroing flush)",
    )
    p.add_argument("--force", action="store_true", help="re-tune cases already in --out")
    args = p.parse_args(argv)
    # Validate everything here, before the GPU check, so a typo gets a usage error on any machine.
    from moelora_lib.helion_linear import EPILOGUES, LINEAR_MODELS

    shapes = [v for v in args.shapes.split(",") if v]
    bad = [v for v in shapes if v not in LINEAR_MODELS]
    if not shapes or bad:
        p.error(f"--shapes: expected a comma-separated list of {sorted(LINEAR_MODELS)}, got {args.shapes!r}")
    epis = [v for v in args.epilogues.split(",") if v]
    bad = [v for v in epis if v not in EPILOGUES]
    if not epis or bad:
        p.error(f"--epilogues: expected a comma-separated list of {list(EPILOGUES)}, got {args.epilogues!r}")
    try:
        ms = [int(v) for v in args.m.split(",") if v]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        p.error(f"--m: expected a comma-separated list of ints >= 1, got {args.m!r}")
    for name in ("budget_s", "warmup_ms", "rep_ms"):
        v = getattr(args, name)
        if not (v > 0 and math.isfinite(v)):
            p.error(f"--{name.replace('_', '-')}: expected a number > 0, got {v}")
    if args.jobs < -1:
        p.error(f"--jobs: expected -1 (auto), 0 (off) or a positive count, got {args.jobs}")
    if Path(args.out).is_dir():
        p.error(f"--out: expected a JSON file path, got a directory {args.out!r}")
    if Path(args.csv).is_dir():
        p.error(f"--csv: expected a CSV file path, got a directory {args.csv!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    import torch

    from moelora_lib.common import gpu_name
    from moelora_lib.helion_linear import (
        ConfigFileError,
        build_runner,
        kernel_args,
        load_configs,
        save_configs,
        set_entry,
        torch_reference,
    )
    from moelora_lib.studies import bench
    from moelora_lib.studies.notebook import progress as tqdm  # a text bar, also in notebooks
    from moelora_lib.testing import TOLERANCES

    def log(msg: str) -> None:
        print(f"[helion_tune {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if not torch.cuda.is_available():
        print("helion_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    out_path = Path(args.out)
    table: dict = {}
    if out_path.exists():
        try:
            table = load_configs(out_path)
        except ConfigFileError as e:
            print(f"refusing to overwrite a malformed config file: {e}", file=sys.stderr)
            return 2
    prev_seconds = float(table.get("_meta", {}).get("tuning_seconds", 0.0))
    dtype = getattr(torch, args.dtype)
    models = [s for s in args.shapes.split(",") if s]
    epilogues = [s for s in args.epilogues.split(",") if s]
    ms = [int(v) for v in args.m.split(",") if v]
    cases = build_cases(models, epilogues, ms)
    todo = cases_to_tune(models, epilogues, ms, table, args.dtype, args.force)
    log(f"{len(cases)} cases, {len(cases) - len(todo)} already in {out_path}, {len(todo)} to tune")

    jobs = args.jobs if args.jobs >= 0 else max(1, min(14, (os.cpu_count() or 4) - 2))
    compiled = precompile(todo, args.dtype, jobs, timeout_s=0.5 * args.budget_s, log=log)

    gpu = gpu_name(required=True)
    tol = TOLERANCES[dtype]
    timing_kw = dict(flush_l2=args.l2, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    weights: dict[tuple, tuple] = {}
    n_tuned = 0
    bar = tqdm(todo, desc="helion_tune", unit=" cases", disable=not todo)
    for case in bar:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            log(f"budget {args.budget_s:.0f} s reached; {len(todo) - n_tuned} cases left for a later run")
            break
        epi, k, n, m, bucket = case["epilogue"], case["K"], case["N"], case["m"], case["bucket"]
        bar.set_postfix_str(f"{epi} K={k} N={n} M={m}")
        wkey = (epi, k, n)
        if wkey not in weights:
            weights.clear()
            torch.manual_seed(0)
            w = torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5
            b = torch.randn(n, dtype=dtype, device="cuda") if epi == "bias" else None
            weights[wkey] = (w, b)
        w, b = weights[wkey]
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        ref = torch_reference(x, w, b, epi).float()
        common = dict(
            stage="helion_tune", op=epi, models=case["models"], K=k, N=n, M=m, bucket=bucket, dtype=args.dtype
        )
        rows = []
        t_torch = bench.time_fn(
            lambda x=x, w=w, b=b, epi=epi: torch_reference(x, w, b, epi), "graph", "cuda", **timing_kw
        )
        rows.append(
            bench.result_row(**common, impl="torch", candidate=-1, config="", status="ok", timing=t_torch)
        )
        best = None
        for i, cfg in enumerate(candidates(epi, k, n, bucket)):
            row = dict(**common, impl="helion", candidate=i, config=json.dumps(cfg, sort_keys=True))
            pre = compiled.get(_task_key(epi, args.dtype, k, n, cfg))
            row["compile_s"] = pre.get("compile_s") if pre else None
            if pre is not None and not pre["ok"]:
                rows.append(bench.result_row(**row, status="compile_error", error=pre["error"]))
                log(f"skip {epi} K={k} N={n} cand {i}: {pre['error']}")
                continue
            try:
                t0 = time.perf_counter()
                runner = build_runner(epi, cfg, w, b)
                args_k = kernel_args(epi, x, w, b)
                y = runner(*args_k)
                torch.cuda.synchronize()
                if pre is None:
                    row["compile_s"] = time.perf_counter() - t0
                rel = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                row["rel_err"] = rel
                if not rel < tol:
                    rows.append(bench.result_row(**row, status="wrong"))
                    continue
                t = bench.time_fn(
                    lambda runner=runner, args_k=args_k: runner(*args_k), "graph", "cuda", **timing_kw
                )
            except Exception as e:
                rows.append(
                    bench.result_row(**row, status="run_error", error=f"{type(e).__name__}: {str(e)[:300]}")
                )
                log(f"run error {epi} K={k} N={n} M={m} cand {i}: {type(e).__name__}: {str(e)[:200]}")
                continue
            row["speedup_vs_torch"] = t_torch.ms_p50 / t.ms_p50
            rows.append(bench.result_row(**row, status="ok", timing=t))
            if best is None or t.ms_p50 < best[1].ms_p50:
                best = (cfg, t, len(rows) - 1)
        total = prev_seconds + (time.perf_counter() - t_start)
        for r in rows:
            r["best"] = False
            r["tune_elapsed_s"] = round(total, 2)
        if best is not None:
            rows[best[2]]["best"] = True
            set_entry(table, epi, args.dtype, k, n, bucket, best[0])
            n_tuned += 1
        table["_meta"] = {
            "gpu": gpu,
            "tuning_seconds": round(total, 2),
            "helion": bench.env_record()["helion"],
            "torch": torch.__version__,
            "updated_utc": bench.env_record()["timestamp_utc"],
            "timing": f"moelora_lib.studies.bench.time_fn graph mode, flush_l2={args.l2!r}",
        }
        save_configs(table, out_path)
        bench.write_rows(args.csv, rows, append=True)
        del x, ref
    bar.close()
    if not todo:  # nothing tuned: the JSON (and its tuning_seconds) stays as it was
        log(f"nothing to tune; tuning seconds in {out_path}: {prev_seconds:.1f} s")
        return 0
    total = prev_seconds + (time.perf_counter() - t_start)
    log(
        f"tuned {n_tuned}/{len(todo)} cases; this run {time.perf_counter() - t_start:.1f} s; "
        f"total {total:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
