"""Tune the Helion linear backend: time a short, hand-picked list of configs per (shape, M bucket)
and write the winners into the per-GPU JSON (moelora_lib/configs/helion/<GPU_NAME>.json format).

    python -m moelora_lib.studies.helion_tune --shapes llama3-8b,qwen3-32b,llama3-70b \\
        --m 1,2,4,8,16,32,256,1024,4096 --epilogues none,swiglu \\
        --out moelora_lib/configs/helion/NVIDIA_H200.json --csv data/helion_tuning.csv --budget-s 300

Cases in ``--out`` are skipped (``--force`` redoes them); JSON written atomically and CSV appended after
every case; no case starts after ``--budget-s``. CSV status: "ok" | "compile_error" | "run_error" | "wrong".
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

from moelora_lib.hardware import H200_NUM_SMS

DEFAULT_M = (1, 2, 4, 8, 16, 32, 256, 1024, 4096)
#: Largest shared-memory footprint a candidate may ask for (the H200 allows 227 KiB per block).
SMEM_LIMIT_BYTES = 227 * 1024
_TD, _PI = "tensor_descriptor", "persistent_interleaved"


def _cfg(bm, bn, bk, warps, stages, indexing="pointer", pid="flat", l2=None, split=None) -> dict:
    c = dict(block_sizes=[bm, bn, bk], num_warps=warps, num_stages=stages, indexing=indexing, pid_type=pid)
    return c | ({"l2_groupings": [l2]} if l2 else {}) | ({"split_k": split} if split else {})


def _split_factor(k: int, n: int, bn: int, num_sms: int, m_tiles: int = 1) -> int | None:
    """A split_k bringing the output tiles up to about two programs per SM; None if they fill the GPU."""
    tiles = m_tiles * math.ceil(n / bn)
    if tiles >= 2 * num_sms:
        return None
    s = 1
    while tiles * s < 2 * num_sms and k // (2 * s) >= 1024 and s < 16:
        s *= 2
    return s if s > 1 else None


def smem_bytes(cfg: dict, epilogue: str, elem: int = 2) -> int:
    """Pipelined shared memory of a candidate: num_stages x (x tile + W tile(s)), in bytes."""
    bm, bn, bk = cfg["block_sizes"]
    return cfg["num_stages"] * (bm * bk + (2 if epilogue == "swiglu" else 1) * bn * bk) * elem


def candidates(epilogue: str, k: int, n: int, bucket: int, num_sms: int = H200_NUM_SMS) -> list[dict]:
    """The 4–12 configs tried for one (epilogue, K, N, bucket) within :data:`SMEM_LIMIT_BYTES`. ValueError for
    an unknown epilogue or bucket, or a size that is not an int ≥ 1."""
    from moelora_lib.common import is_int
    from moelora_lib.helion_linear.configs import BUCKETS, EPILOGUES, SPLIT_K_EPILOGUES

    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
    if bucket not in BUCKETS:
        raise ValueError(f"bucket: expected one of {BUCKETS}, got {bucket!r}")
    for name, v in (("k", k), ("n", n), ("num_sms", num_sms)):
        if not (is_int(v) and v >= 1):
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")

    def split(bm, bn, bk, warps, stages, m_tiles=1, **kw) -> list[dict]:
        f = _split_factor(k, n, bn, num_sms, m_tiles) if epilogue in SPLIT_K_EPILOGUES else None
        return [_cfg(bm, bn, bk, warps, stages, split=f, **kw)] if f else []

    c, m64, m128 = _cfg, max(1, bucket // 64), max(1, bucket // 128)
    # fmt: off
    if epilogue == "swiglu":
        if bucket <= 16:
            out = [c(16, 64, 128, 4, 4), c(16, 32, 256, 4, 4), c(16, 32, 256, 4, 5), c(16, 16, 512, 4, 4),
                   c(16, 64, 256, 4, 3), c(16, 64, 128, 4, 4, _TD), c(16, 32, 256, 4, 4, _TD)]
        elif bucket <= 32:
            out = [c(32, 64, 128, 4, 4), c(32, 32, 256, 4, 3), c(32, 32, 256, 4, 4), c(32, 64, 128, 4, 5)]
        else:
            out = [c(64, 128, 64, 8, 3, l2=8), c(64, 64, 64, 4, 4, l2=8), c(128, 64, 64, 8, 3, l2=8),
                   c(128, 128, 64, 8, 3, l2=8), c(64, 128, 64, 8, 4, _TD, l2=8)]
    elif bucket <= 16:
        out = [c(16, 64, 128, 4, 5), c(16, 64, 256, 4, 4), c(16, 32, 256, 4, 4), c(16, 32, 256, 4, 6),
               c(16, 32, 512, 4, 4), c(16, 16, 512, 4, 4), c(16, 64, 256, 8, 4), c(16, 64, 256, 4, 3, _TD),
               c(16, 32, 256, 4, 4, _TD)]
        out += split(16, 64, 128, 4, 4) + split(16, 32, 256, 4, 4)
    elif bucket <= 32:
        out = [c(32, 64, 128, 4, 4), c(32, 32, 256, 4, 4), c(32, 64, 256, 4, 3), c(32, 32, 128, 4, 5),
               c(32, 32, 256, 4, 6), c(32, 64, 256, 4, 4), c(32, 32, 512, 4, 3), c(16, 64, 128, 4, 5),
               c(16, 32, 256, 4, 6)]
        out += split(32, 64, 128, 4, 4) + split(32, 32, 256, 4, 4)
    elif bucket <= 256:
        out = [c(64, 128, 64, 4, 4, l2=8), c(128, 128, 64, 8, 3, l2=8), c(64, 256, 64, 8, 3, l2=8),
               c(64, 64, 128, 4, 4, l2=8), c(128, 64, 64, 4, 4, l2=8), c(64, 128, 64, 4, 4, _TD, l2=8),
               c(64, 128, 64, 4, 5, l2=8), c(64, 256, 64, 4, 3, l2=8)]
        out += split(64, 128, 64, 4, 4, m_tiles=m64, l2=8) + split(128, 256, 64, 8, 3, m_tiles=m128, l2=8)
        out += split(128, 128, 64, 8, 3, m_tiles=m128, l2=8)
        out += split(128, 128, 64, 8, 4, m_tiles=m128, indexing=_TD, l2=8)
    else:
        out = [c(128, 128, 64, 8, 3, l2=8), c(128, 256, 64, 8, 3, l2=8),
               c(128, 256, 64, 8, 3, _TD, _PI, l2=8), c(128, 128, 64, 8, 4, _TD, _PI, l2=8),
               c(128, 256, 64, 8, 4, _TD, l2=8)]
        out += split(128, 128, 64, 8, 4, m_tiles=m128, indexing=_TD, l2=8)
    # fmt: on
    return [cfg for cfg in out if smem_bytes(cfg, epilogue) <= SMEM_LIMIT_BYTES]


def build_cases(models: list[str], epilogues: list[str], ms: list[int]) -> list[dict]:
    """``[{"epilogue", "K", "N", "models", "m", "bucket"}, ...]``: one per (epilogue, K, N, bucket)."""
    from moelora_lib.helion_linear import bucket_for, linear_shapes

    groups: dict[tuple[str, int, int], list[str]] = {}
    for model, proj, k, n in linear_shapes(models):
        for epi in epilogues:
            if epi not in ("swiglu", "silu") or proj == "gate_up":
                groups.setdefault((epi, k, n), []).append(f"{model}:{proj}")
    cases = []
    for (epi, k, n), names in groups.items():
        firsts = {}
        for m in ms:
            firsts.setdefault(bucket_for(m), m)
        for b, m in firsts.items():
            cases.append({"epilogue": epi, "K": k, "N": n, "models": ";".join(names), "m": m, "bucket": b})
    return cases


def cases_to_tune(models: list[str], epilogues: list[str], ms: list[int], table: dict,
                  dtype: str = "bfloat16", force=False) -> list[dict]:  # fmt: skip
    """The cases of :func:`build_cases` without an entry in ``table`` (all with ``force``); no GPU needed."""
    from moelora_lib.helion_linear import lookup

    cases = build_cases(models, epilogues, ms)
    new = [c for c in cases if lookup(table, c["epilogue"], dtype, c["K"], c["N"], c["bucket"]) is None]
    return cases if force else new


# --- Parallel precompile (spawned workers; compile without launching) ---------------------------------------
def _compile_only_launcher(triton_kernel, grid, *args, num_warps, num_stages, **kwargs):
    """Helion launcher that compiles (filling Triton's disk cache) but launches nothing."""
    kwargs.setdefault("launch_cooperative_grid", False)
    kwargs |= dict(num_warps=num_warps, num_stages=num_stages)
    return triton_kernel.run(*args, grid=grid, warmup=True, **kwargs)


def _precompile(task: dict) -> dict:
    """Worker: build the runner of task["config"] and compile it for each M of task["ms"]."""
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
        err = f"{type(e).__name__}: {str(e)[:300]}"
        return {**task, "ok": False, "error": err, "compile_s": time.perf_counter() - t0}


def _task_key(epi: str, dtype: str, k: int, n: int, cfg: dict) -> str:
    return json.dumps([epi, dtype, k, n, cfg], sort_keys=True)


def add_task(tasks: dict[str, dict], epi: str, dtype: str, k: int, n: int, cfg: dict, ms) -> None:
    """Add the Ms ``ms`` to the compile task of (epi, dtype, K, N, cfg) in ``tasks``, created if new."""
    new = {"epilogue": epi, "dtype": dtype, "K": k, "N": n, "config": cfg, "ms": []}
    t = tasks.setdefault(_task_key(epi, dtype, k, n, cfg), new)
    t["ms"] += [m for m in dict.fromkeys(ms) if m not in t["ms"]]


def _jobs(jobs: int) -> int:
    """``jobs``, or for -1 one process per core but two, at most 14."""
    return jobs if jobs >= 0 else max(1, min(14, (os.cpu_count() or 4) - 2))


def precompile_tasks(tasks: dict[str, dict], jobs: int, timeout_s: float, log) -> dict[str, dict]:
    """Compile ``tasks`` in ``jobs`` spawned processes into Triton's cache. Returns {key: {"ok", "error",
    "compile_s"}} (unfinished after ``timeout_s``: absent). Needs a real ``__main__``."""
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


def precompile_in_subprocess(tasks: dict[str, dict], jobs: int, timeout_s: float = 360) -> bool:
    """:func:`precompile_tasks` (``jobs`` -1: cores − 2, at most 14) in a fresh interpreter, its log printed;
    False on a failure."""
    import subprocess
    import tempfile

    from moelora_lib.studies import bench

    jobs = _jobs(jobs)
    code = (
        "import json, sys, time; from moelora_lib.studies.helion_tune import precompile_tasks; "
        "t0 = time.time(); precompile_tasks(json.load(open(sys.argv[1])), int(sys.argv[2]), "
        "float(sys.argv[3]), lambda m: print(f'[precompile {time.time() - t0:5.1f}s] {m}', flush=True))"
    )
    with tempfile.TemporaryDirectory(prefix="moelora_helion_precompile_") as tmp:
        path = Path(tmp) / "tasks.json"
        path.write_text(json.dumps(tasks))
        cmd = [sys.executable, "-c", code, str(path), str(jobs), str(max(1.0, timeout_s - 60))]
        try:
            kw = dict(capture_output=True, text=True, timeout=timeout_s, cwd=str(bench.REPO_ROOT))
            proc = subprocess.run(cmd, **kw)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"[precompile] skipped ({type(e).__name__}: {e}); configs compile on first use")
            return False
    out = (proc.stdout + proc.stderr).replace(str(bench.REPO_ROOT) + "/", "").strip()
    print("\n".join(line for line in out.splitlines() if line.startswith("[precompile"))[-3000:])
    if proc.returncode != 0:
        print(f"[precompile] failed (rc {proc.returncode}): {out[-800:]}; configs compile on first use")
    return proc.returncode == 0


# --- Tuning -------------------------------------------------------------------------------------------------
def _parse(argv):
    from moelora_lib.helion_linear import EPILOGUES, LINEAR_MODELS

    p = argparse.ArgumentParser(prog="python -m moelora_lib.studies.helion_tune", description="Tune Helion.")
    p.add_argument("--shapes", default="llama3-8b,qwen3-32b,llama3-70b", help="models (helion_linear.shapes)")
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="M values to time (one per bucket)")
    p.add_argument("--epilogues", default="none,swiglu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", required=True, help="config JSON to create or extend (atomic writes)")
    p.add_argument("--csv", required=True, help="CSV of every tried config (appended)")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new case after this many seconds")
    p.add_argument("--jobs", type=int, default=-1, help="precompile processes (-1: cpus - 2, max 14; 0: off)")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--l2", default="clean", choices=["clean", "dirty"], help="L2 before each timed call")
    p.add_argument("--force", action="store_true", help="re-tune cases already in --out")
    a = p.parse_args(argv)
    # Validated before the GPU check: a typo gets a usage error on any machine.
    a.shapes, a.epilogues = [v for v in a.shapes.split(",") if v], [v for v in a.epilogues.split(",") if v]
    if not a.shapes or set(a.shapes) - set(LINEAR_MODELS):
        p.error(f"--shapes: expected a comma-separated list of {sorted(LINEAR_MODELS)}, got {a.shapes!r}")
    if not a.epilogues or set(a.epilogues) - set(EPILOGUES):
        p.error(f"--epilogues: expected a comma-separated list of {list(EPILOGUES)}, got {a.epilogues!r}")
    ms = [v for v in a.m.split(",") if v]
    if not ms or not all(v.isdigit() and int(v) >= 1 for v in ms):
        p.error(f"--m: expected a comma-separated list of ints >= 1, got {a.m!r}")
    a.m = [int(v) for v in ms]
    for name in ("budget_s", "warmup_ms", "rep_ms"):
        if not (getattr(a, name) > 0 and math.isfinite(getattr(a, name))):
            p.error(f"--{name.replace('_', '-')}: expected a number > 0, got {getattr(a, name)}")
    if a.jobs < -1:
        p.error(f"--jobs: expected -1 (auto), 0 (off) or a positive count, got {a.jobs}")
    for name in ("out", "csv"):
        if Path(getattr(a, name)).is_dir():
            p.error(f"--{name}: expected a file path, got a directory {getattr(a, name)!r}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    import torch

    from moelora_lib import helion_linear as hl
    from moelora_lib.common import gpu_name
    from moelora_lib.studies import bench
    from moelora_lib.studies.notebook import progress
    from moelora_lib.testing import TOLERANCES

    def log(msg: str) -> None:
        print(f"[helion_tune {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if not torch.cuda.is_available():
        print("helion_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    out_path, table = Path(args.out), {}
    if out_path.exists():
        try:
            table = hl.load_configs(out_path)
        except hl.ConfigFileError as e:
            print(f"refusing to overwrite a malformed config file: {e}", file=sys.stderr)
            return 2
    prev_seconds = float(table.get("_meta", {}).get("tuning_seconds", 0.0))
    dtype, tol = getattr(torch, args.dtype), TOLERANCES[getattr(torch, args.dtype)]
    n_cases = len(build_cases(args.shapes, args.epilogues, args.m))
    todo = cases_to_tune(args.shapes, args.epilogues, args.m, table, args.dtype, args.force)
    log(f"{n_cases} cases, {n_cases - len(todo)} already in {out_path}, {len(todo)} to tune")
    tasks: dict[str, dict] = {}  # every candidate of every case, for every Triton M-variant warmup meets
    for c in todo:
        ms = hl.warm_m_values(c["bucket"]) + [c["m"]]
        for cfg in candidates(c["epilogue"], c["K"], c["N"], c["bucket"]):
            add_task(tasks, c["epilogue"], args.dtype, c["K"], c["N"], cfg, ms)
    compiled = precompile_tasks(tasks, _jobs(args.jobs), timeout_s=0.5 * args.budget_s, log=log)

    gpu = gpu_name(required=True)
    timing_kw = dict(flush_l2=args.l2, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    weights: dict[tuple, tuple] = {}
    n_tuned = 0
    bar = progress(todo, desc="helion_tune", unit=" cases", disable=not todo)
    for case in bar:
        if time.perf_counter() - t_start > args.budget_s:
            log(f"budget {args.budget_s:.0f} s reached; {len(todo) - n_tuned} cases left for a later run")
            break
        epi, k, n, m, bucket = case["epilogue"], case["K"], case["N"], case["m"], case["bucket"]
        bar.set_postfix_str(f"{epi} K={k} N={n} M={m}")
        if (epi, k, n) not in weights:
            weights.clear()
            torch.manual_seed(0)
            w = torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5
            weights[(epi, k, n)] = (w, torch.randn(n, dtype=dtype, device="cuda") if epi == "bias" else None)
        w, b = weights[(epi, k, n)]
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        ref = hl.torch_reference(x, w, b, epi).float()
        common = dict(stage="helion_tune", op=epi, models=case["models"], K=k, N=n, M=m, bucket=bucket)
        common["dtype"] = args.dtype
        ref_fn = lambda x=x, w=w, b=b, e=epi: hl.torch_reference(x, w, b, e)  # noqa: E731
        t_torch = bench.time_fn(ref_fn, "graph", "cuda", **timing_kw)
        torch_row = dict(impl="torch", candidate=-1, config="", status="ok", timing=t_torch)
        rows = [bench.result_row(**common, **torch_row)]
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
                runner, args_k = hl.build_runner(epi, cfg, w, b), hl.kernel_args(epi, x, w, b)
                y = runner(*args_k)
                torch.cuda.synchronize()
                if pre is None:
                    row["compile_s"] = time.perf_counter() - t0
                row["rel_err"] = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                if not row["rel_err"] < tol:
                    rows.append(bench.result_row(**row, status="wrong"))
                    continue
                t = bench.time_fn(lambda r=runner, a=args_k: r(*a), "graph", "cuda", **timing_kw)
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(bench.result_row(**row, status="run_error", error=err))
                log(f"run error {epi} K={k} N={n} M={m} cand {i}: {err[:250]}")
                continue
            row["speedup_vs_torch"] = t_torch.ms_p50 / t.ms_p50
            rows.append(bench.result_row(**row, status="ok", timing=t))
            if best is None or t.ms_p50 < best[1].ms_p50:
                best = (cfg, t, len(rows) - 1)
        total = round(prev_seconds + (time.perf_counter() - t_start), 2)
        for j, r in enumerate(rows):
            r["best"], r["tune_elapsed_s"] = best is not None and j == best[2], total
        if best is not None:
            hl.set_entry(table, epi, args.dtype, k, n, bucket, best[0])
            n_tuned += 1
        env, how = bench.env_record(), f"moelora_lib.studies.bench.time_fn graph mode, flush_l2={args.l2!r}"
        meta = dict(gpu=gpu, tuning_seconds=total, helion=env["helion"], torch=torch.__version__)
        table["_meta"] = dict(meta, updated_utc=env["timestamp_utc"], timing=how)
        hl.save_configs(table, out_path)
        bench.write_rows(args.csv, rows, append=True)
        del x, ref
    bar.close()
    if not todo:  # nothing tuned: the JSON (and its tuning_seconds) stays as it was
        log(f"nothing to tune; tuning seconds in {out_path}: {prev_seconds:.1f} s")
        return 0
    total = prev_seconds + (time.perf_counter() - t_start)
    log(f"tuned {n_tuned}/{len(todo)} cases; this run {total - prev_seconds:.1f} s; total {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
