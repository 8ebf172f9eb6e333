"""Notebook 08's measurements: the Helion linear backend against cuBLAS (PyTorch), the memory ceilings,
the L2-state probe and the best ratio each row allows.

Sweep modes (:func:`.bench.time_fn`): "graph", "graph_clean", "graph_rotate" (M ≤ :data:`ROTATE_MAX_M`:
one replay over ``copies`` copies of W, time per GEMM), "eager", "cpu".
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..common import dtype_name, is_int
from ..hardware import H200_L2_BYTES
from ..helion_linear.configs import DTYPES, set_entry
from ..helion_linear.method import HelionLinearMethod, Linear, TorchLinearMethod, torch_reference
from ..helion_linear.shapes import LINEAR_MODELS
from ..testing import TOLERANCES
from . import bench

#: Largest accepted rel_err per dtype name (:data:`moelora_lib.testing.TOLERANCES`, keyed for CSV rows).
REL_TOL = {dtype_name(dt): tol for dt, tol in TOLERANCES.items()}
#: graph_rotate: the weight copies of one replay stream at least this many bytes (4x the H200's L2).
ROTATE_BYTES = 4 * H200_L2_BYTES
#: graph_rotate is measured for decode sizes only (M <= this); prefill is compute-bound.
ROTATE_MAX_M = 32
#: The sweep's graph timing modes and the ``bench.time_cuda`` L2 flush each one uses.
GRAPH_MODE_FLUSH = {"graph": True, "graph_clean": "clean", "graph_rotate": False}
#: Dense bf16 rate of the bounds: the best an 8192³ torch matmul reaches on the H200.
PEAK_TFLOPS = 800.0
CPU_SHAPE = (64, 96)  # K, N of the cpu profile (swiglu: I = 48)
CPU_CONFIG = {"block_sizes": [16, 32, 32], "num_warps": 4, "num_stages": 2}


def rotation_copies(weight_bytes: int) -> int:
    """Copies of a weight of ``weight_bytes`` one graph_rotate replay cycles through (≥ 2, streaming
    :data:`ROTATE_BYTES`). ValueError unless an int ≥ 1."""
    if not (is_int(weight_bytes) and weight_bytes >= 1):
        raise ValueError(f"weight_bytes: expected an int >= 1 (bytes of one weight), got {weight_bytes!r}")
    return max(2, math.ceil(ROTATE_BYTES / weight_bytes))


def cpu_demo_table(dtypes: Iterable[str] = ("float32", "float16"), epilogues=("none", "swiglu")) -> dict:
    """The cpu profile's config table: :data:`CPU_SHAPE`, every bucket up to 32, :data:`CPU_CONFIG`."""
    t: dict = {}
    for dt in dtypes:
        assert dt in DTYPES
        for epi in epilogues:
            for b in (1, 2, 4, 8, 16, 32):
                set_entry(t, epi, dt, *CPU_SHAPE, b, CPU_CONFIG)
    return t


def _sweep_jobs(models: Iterable[str], epilogues: Iterable[str], dtype: str) -> list[tuple]:
    """(name, proj, K, N, epilogue, dtype) of every projection of ``models``; "swiglu" for gate_up only."""
    return [
        (name, proj, k, n, epi, dtype)
        for name in models
        for proj, (k, n) in LINEAR_MODELS[name].projections().items()
        for epi in epilogues
        if epi != "swiglu" or proj == "gate_up"
    ]


def sweep_compile_tasks(methods: dict, jobs: Iterable[tuple], ms: Iterable[int]) -> dict[str, dict]:
    """The compile tasks (``helion_tune.add_task``) of a sweep."""
    from ..helion_linear import bucket_for, lookup, warm_m_values
    from .helion_tune import add_task

    tasks: dict[str, dict] = {}
    for _, _, k, n, epi, dt in jobs:
        for m in ms:
            cfg = lookup(methods[epi].table(), epi, dt, k, n, bucket_for(m))
            if cfg is not None:  # no config: the torch path, nothing to compile
                add_task(tasks, epi, dt, k, n, cfg, warm_m_values(bucket_for(m)) + [m])
    return tasks


def _calls(x, fs):
    """(a call of fs[0] on x, a call of every f of fs on x): one layer, and the layers over W's copies."""
    return (lambda: fs[0](x)), (lambda: [f(x) for f in fs])


def _two_gemm(x, w_gate, w_up):
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _per_call(t, calls: int):
    """A Timing of one replay of ``calls`` GEMMs, as the time per GEMM."""
    return dataclasses.replace(t, ms_p50=t.ms_p50 / calls, ms_p20=t.ms_p20 / calls, ms_p80=t.ms_p80 / calls)


def sweep(*, profile: str, models: Iterable[str] = ("llama3-8b", "qwen3-32b", "llama3-70b"),
          ms: Iterable[int] = (1, 2, 4, 8, 16, 32, 256, 1024, 4096), dtype: str = "bfloat16",
          configs: Any = None, seed: int = 0, timing_kw: dict | None = None,
          epilogues: Iterable[str] = ("none", "swiglu"), progress: bool = True, precompile_jobs: int = -1,
          ) -> list[dict]:  # fmt: skip
    """Helion against PyTorch for every projection, epilogue and M; ``configs``: HelionLinearMethod's (None:
    this GPU's file); ``precompile_jobs`` processes (-1 auto, 0 none). "cpu": :data:`CPU_SHAPE` with
    :func:`cpu_demo_table`. Rows (one per model, proj, epilogue, M, impl, mode): stage, K, N, dtype, impl
    ("helion" | "torch" | "torch_two_gemm"), path, mode, copies, ms_p50/p20/p80, flops, bytes, tb_per_s,
    tflops, rel_err, environment columns."""
    from .helion_tune import precompile_in_subprocess
    from .notebook import progress as tqdm

    if profile not in ("cpu", "gpu"):
        raise ValueError(f"profile: expected 'cpu' or 'gpu', got {profile!r}")
    timing_kw = dict(timing_kw or {})
    if "flush_l2" in timing_kw or "mode" in timing_kw:
        raise ValueError("timing_kw: 'flush_l2' and 'mode' are set by the sweep's timing modes")
    epilogues, models, ms = tuple(epilogues), list(models), list(ms)
    if profile == "cpu":
        jobs = [("tiny", "demo", *CPU_SHAPE, epi, dt) for dt in ("float32", "float16") for epi in epilogues]
        device, modes = "cpu", ("cpu",)
        methods = {e: HelionLinearMethod(cpu_demo_table(), e, allow_interpreter=True) for e in epilogues}
    else:
        jobs = _sweep_jobs(models, epilogues, dtype)
        device, modes = "cuda", ("graph", "graph_clean", "graph_rotate", "eager")
        methods = {epi: HelionLinearMethod(configs, epi) for epi in epilogues}
        if precompile_jobs and not isinstance(configs, dict):
            precompile_in_subprocess(sweep_compile_tasks(methods, jobs, ms), precompile_jobs)

    def timed(fn, mode):
        if mode in ("cpu", "eager"):
            return bench.time_fn(fn, mode, device, **timing_kw)
        t = bench.time_fn(fn, "graph", device, flush_l2=GRAPH_MODE_FLUSH[mode], **timing_kw)
        return dataclasses.replace(t, mode=mode)

    rows: list[dict] = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    wgen = gen if device == "cpu" else torch.Generator(device=device).manual_seed(seed)
    for name, proj, k, n, epi, dt in tqdm(jobs, desc="08 sweep", disable=not progress):
        tdtype = getattr(torch, dt)
        w = (torch.randn(n, k, generator=wgen, device=device) * k**-0.5).to(dtype=tdtype)
        method = methods[epi]
        layer, torch_layer = Linear.from_weight(w, method), Linear.from_weight(w, TorchLinearMethod(epi))
        method.warmup(layer, max(ms))
        # graph_rotate: copies of W that together stream ROTATE_BYTES per replay (layers share runners)
        copies = rotation_copies(n * k * tdtype.itemsize) if "graph_rotate" in modes else 1
        w_rot = [w] + [w.clone() for _ in range(copies - 1)]
        layers_rot = [layer] + [Linear.from_weight(wc, method) for wc in w_rot[1:]]
        torch_rot = [torch_layer] + [Linear.from_weight(wc, TorchLinearMethod(epi)) for wc in w_rot[1:]]
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=tdtype)
            ref = torch_reference(x.float(), w.float(), None, epi)
            common = dict(stage="helion_linear", model=name, proj=proj, epilogue=epi, M=m, K=k, N=n, dtype=dt)
            flops = 2.0 * m * n * k
            nbytes = (n * k + m * k + m * (n // 2 if epi == "swiglu" else n)) * tdtype.itemsize
            # (impl, one call, one call of every copy, path)
            impls = [("helion", *_calls(x, layers_rot), method.path_for(layer, m))]
            impls.append(("torch", *_calls(x, torch_rot), "torch"))
            if epi == "swiglu":
                two = [lambda v, wc=wc, i=n // 2: _two_gemm(v, wc[:i], wc[i:]) for wc in w_rot]
                impls.append(("torch_two_gemm", *_calls(x, two), "torch"))
            for impl, fn, fn_rot, p in impls:
                err = _rel_err(fn(), ref)
                for mode in modes:
                    if mode == "graph_rotate" and m > ROTATE_MAX_M:
                        continue
                    c = copies if mode == "graph_rotate" else 1
                    t = _per_call(timed(fn_rot, mode), c) if mode == "graph_rotate" else timed(fn, mode)
                    us = t.ms_p50 * 1e3
                    rate = dict(tb_per_s=nbytes / (us * 1e-6) / 1e12, tflops=flops / (us * 1e-6) / 1e12)
                    row = dict(common, impl=impl, path=p, rel_err=err, copies=c)
                    rows.append(bench.result_row(**row, timing=t, flops=flops, bytes=nbytes, **rate))
            del x, ref, impls
        del w, layer, torch_layer, w_rot, layers_rot, torch_rot
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary(df):
    """One row per (model, proj, epilogue, dtype, M, mode): helion_us, torch_us, speedup, two_gemm_us,
    speedup_vs_two_gemm, helion_/torch_tb_per_s, helion_/torch_tflops, helion_path, K, N."""
    import pandas as pd

    key = ["model", "proj", "epilogue", "dtype", "M", "mode"]
    piv = df.pivot_table(index=key, columns="impl", values="ms_p50", aggfunc="first") * 1e3
    out = pd.DataFrame(index=piv.index)
    out["helion_us"], out["torch_us"] = piv["helion"], piv["torch"]
    out["speedup"] = piv["torch"] / piv["helion"]
    if "torch_two_gemm" in piv:
        out["two_gemm_us"] = piv["torch_two_gemm"]
        out["speedup_vs_two_gemm"] = piv["torch_two_gemm"] / piv["helion"]
    for col in ("tb_per_s", "tflops"):
        p = df.pivot_table(index=key, columns="impl", values=col, aggfunc="first")
        out[f"helion_{col}"], out[f"torch_{col}"] = p["helion"], p["torch"]
    out["helion_path"] = df[df.impl == "helion"].groupby(key)["path"].first()
    return out.join(df.groupby(key)[["K", "N"]].first()).reset_index()


def ceilings(nbytes: int = 2 * 1024**3, timing_kw: dict | None = None) -> dict:
    """Measured ceilings: ``copy_tb_per_s``, ``read_tb_per_s`` (TB/s over ``nbytes``) and
    ``tiny_kernel_us``."""
    kw = {"warmup_ms": 10, "rep_ms": 60, **(timing_kw or {}), "flush_l2": False}
    a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t_copy = bench.time_fn(lambda a=a, b=b: b.copy_(a), "eager", "cuda", **kw)
    t_read = bench.time_fn(lambda a=a: torch.sum(a), "eager", "cuda", **kw)
    tiny = torch.zeros(1, device="cuda")
    # after a flush kernel: the graph is queued when the start event fires (no host launch latency)
    t_tiny = bench.time_fn(lambda: tiny.add_(1), "graph", "cuda", **{**kw, "flush_l2": "clean"})
    del a, b
    torch.cuda.empty_cache()
    copy, read = 2 * nbytes / (t_copy.ms_p50 * 1e-3) / 1e12, nbytes / (t_read.ms_p50 * 1e-3) / 1e12
    return dict(tiny_kernel_us=t_tiny.ms_p50 * 1e3, copy_tb_per_s=copy, read_tb_per_s=read, nbytes=nbytes)


def l2_probe(shapes: Iterable[tuple[int, int]] = ((4096, 4096), (4096, 28672), (28672, 8192)), m: int = 1,
             dtype: str = "bfloat16", configs: Any = None, timing_kw: dict | None = None,
             seed: int = 0) -> list[dict]:  # fmt: skip
    """A decode GEMM of each (K, N), cuBLAS and Helion, graph-replayed after four L2 states (``dirty``,
    ``clean``, ``rotate``, ``warm``). Rows: stage "helion_l2_probe", K, N, M, dtype, impl, l2, copies,
    weight_bytes, ms_p50/p20/p80, mode, tb_per_s, path, environment columns."""
    kw = {"warmup_ms": 10, "rep_ms": 40, **(timing_kw or {})}
    kw.pop("flush_l2", None)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tdtype, rows = getattr(torch, dtype), []
    method = HelionLinearMethod(configs, "none")
    for k, n in shapes:
        wbytes = n * k * tdtype.itemsize
        w0 = (torch.randn(n, k, generator=gen) * k**-0.5).to(device="cuda", dtype=tdtype)
        ws = [w0] + [w0.clone() for _ in range(rotation_copies(wbytes) - 1)]
        x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=tdtype)
        layers = [Linear.from_weight(w, method) for w in ws]
        method.warmup(layers[0], m)  # the copies share its runner
        path = method.path_for(layers[0], m)
        torch_layers = [Linear.from_weight(w, TorchLinearMethod("none")) for w in ws]
        for impl, ls in (("helion", layers), ("torch", torch_layers)):
            one, every = _calls(x, ls)
            runs = {"dirty": (one, True, 1), "clean": (one, "clean", 1), "warm": (one, False, 1)}
            runs["rotate"] = (every, False, len(ls))
            for l2, (fn, flush, c) in runs.items():
                t = _per_call(bench.time_fn(fn, "graph", "cuda", **kw, flush_l2=flush), c)
                row = dict(stage="helion_l2_probe", K=k, N=n, M=m, dtype=dtype, impl=impl, l2=l2, copies=c)
                tb = wbytes / (t.ms_p50 * 1e-3) / 1e12
                path_ = path if impl == "helion" else "torch"
                rows.append(bench.result_row(**row, weight_bytes=wbytes, timing=t, tb_per_s=tb, path=path_))
        del ws, layers, torch_layers, w0, x
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def best_ratio_bounds(s, read_tb_per_s: float, tflops: float, launch_us: float = 0.0):
    """Per :func:`summary` row, ``floor_us`` = max(bytes / read_tb_per_s, flops / tflops) + ``launch_us`` and
    ``max_speedup`` = torch_us / floor_us. ValueError for a rate ≤ 0, a negative ``launch_us`` or missing
    columns."""
    for name, v in (("read_tb_per_s", read_tb_per_s), ("tflops", tflops)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: expected a finite rate > 0, got {v!r}")
    if not (isinstance(launch_us, (int, float)) and math.isfinite(launch_us) and launch_us >= 0):
        raise ValueError(f"launch_us: expected a finite number >= 0, got {launch_us!r}")
    missing = sorted({"M", "K", "N", "epilogue", "dtype", "torch_us"} - set(s.columns))
    if missing:
        raise ValueError(f"s: missing column(s) {missing} (expected study.summary rows)")
    out = s.copy()
    elem = out.dtype.map(lambda d: getattr(torch, d).itemsize).astype(float)
    k, n, m = out.K.astype(float), out.N.astype(float), out.M.astype(float)
    nbytes = (n * k + m * k + m * n.where(out.epilogue != "swiglu", n / 2)) * elem
    floor = (nbytes / (read_tb_per_s * 1e12)).combine(2 * m * n * k / (tflops * 1e12), max) * 1e6 + launch_us
    out["floor_us"] = floor
    out["max_speedup"] = out.torch_us / floor
    return out


def gmean(values) -> float:
    """Geometric mean of the finite positive entries (nan if none)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x)) and float(x) > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def bounds_and_targets(s, ceilings: dict, peak_tflops: float = PEAK_TFLOPS):
    """(bounds, targets) from :func:`summary` ``s`` and :func:`ceilings`: bounds per mode
    (:func:`best_ratio_bounds` plus est_speedup, bound_tb_per_s, bound_tflops, launch_us); targets: target,
    measured, goal, bound, bound_with_launch, met. AssertionError if a measured speedup exceeds its bound."""
    import pandas as pd

    bounds, targets = [], []
    for mode in GRAPH_MODE_FLUSH:
        sm = s[s["mode"] == mode]
        if sm.empty:
            continue
        plain, sw = sm[sm.epilogue == "none"], sm[sm.epilogue == "swiglu"]
        decode, prefill = plain[plain.M <= 32], plain[plain.M >= 256]
        bound = bound_sw = est = float("nan")
        if mode != "graph":
            bw = max(ceilings["read_tb_per_s"], sm.helion_tb_per_s.max(), sm.torch_tb_per_s.max())
            tf = max(peak_tflops, sm.helion_tflops.max(), sm.torch_tflops.max())
            launch = ceilings["tiny_kernel_us"] if mode == "graph_clean" else 0.0
            b = best_ratio_bounds(sm, bw, tf)
            b["est_speedup"] = best_ratio_bounds(sm, bw, tf, launch_us=launch).max_speedup
            beaten = b[b.speedup > b.max_speedup * (1 + 1e-9)]
            assert beaten.empty, beaten
            bd = b[(b.M <= 32) & (b.epilogue == "none")]
            bound, est = gmean(bd.max_speedup), gmean(bd.est_speedup)
            bound_sw = gmean(b[b.epilogue == "swiglu"].max_speedup)
            bounds.append(b.assign(bound_tb_per_s=bw, bound_tflops=tf, launch_us=launch))
        two = sw["speedup_vs_two_gemm"] if "speedup_vs_two_gemm" in sw else []

        def row(target, speedups, goal, mode=mode, **kw):
            return dict(mode=mode, target=target, measured=gmean(speedups), goal=goal, **kw)

        targets += [
            row("decode >= 1.15x", decode.speedup, 1.15, bound=bound, bound_with_launch=est),
            row("SwiGLU >= 1.3x (vs merged)", sw.speedup, 1.3, bound=bound_sw),
            row("SwiGLU >= 1.3x (vs two GEMMs)", two, 1.3),
        ]
        if len(prefill):  # graph_rotate times decode sizes only
            targets.append(row("prefill >= 0.95x", prefill.speedup, 0.95))
    tt = pd.DataFrame(targets)
    if len(tt):
        tt["met"] = tt.measured >= tt.goal
    return (pd.concat(bounds, ignore_index=True) if bounds else pd.DataFrame()), tt
