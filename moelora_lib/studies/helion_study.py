"""The measurements of notebook 08 (Helion linear backend vs cuBLAS), kept in the library so the
notebook only imports, calls, checks and plots.

Rows (one per (model, projection, epilogue, M, impl, timing mode)): stage "helion_linear", model,
proj, epilogue, M, K, N (weight rows; swiglu N = 2I), dtype, impl ("helion" | "torch" |
"torch_two_gemm"), path (HelionLinearMethod.path_for), mode ("graph": CUDA-graph replay after
do_bench's zeroing L2 flush, which leaves dirty lines the timed call writes back; "graph_clean":
graph replay after an L2 eviction by a read, see ``moelora_lib.studies.bench``; "graph_rotate" (M <= 32): one
graph replays the GEMM over ``copies`` copies of W that stream 4x the L2, no flush, time per GEMM =
replay / copies — back-to-back layers as in a captured decode step, no per-call launch cost;
"eager"; "cpu"), copies,
ms_p50/p20/p80, flops (2·M·N·K), bytes (weight + x + output, each read/written once), tb_per_s,
tflops, rel_err (max |y - ref| / max |ref| against the fp32 PyTorch result), plus the bench
environment columns. Every timing goes through :func:`moelora_lib.studies.bench.time_fn`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..common import dtype_name, is_int
from ..hardware import H200_L2_BYTES
from ..helion_linear.configs import DTYPES, set_entry
from ..helion_linear.method import HelionLinearMethod, Linear, TorchLinearMethod, torch_reference
from ..helion_linear.shapes import LINEAR_MODELS
from ..testing import TOLERANCES

#: Largest accepted rel_err per dtype name against the fp32 PyTorch result of the same inputs: the
#: project's one tolerance table (:data:`moelora_lib.testing.TOLERANCES`), keyed by name for CSV rows.
REL_TOL = {dtype_name(dt): tol for dt, tol in TOLERANCES.items()}
#: graph_rotate: the weight copies of one replay stream at least this many bytes (4x the H200's L2).
ROTATE_BYTES = 4 * H200_L2_BYTES
#: graph_rotate is measured for decode sizes only (M <= this); prefill is compute-bound.
ROTATE_MAX_M = 32
#: The sweep's graph timing modes and the ``bench.time_cuda`` L2 flush each one uses.
GRAPH_MODE_FLUSH = {"graph": True, "graph_clean": "clean", "graph_rotate": False}


def rotation_copies(weight_bytes: int) -> int:
    """How many copies of a weight of ``weight_bytes`` one graph_rotate replay cycles through: enough
    to stream :data:`ROTATE_BYTES` (at least 2), so no call finds its weight in L2."""
    if not (is_int(weight_bytes) and weight_bytes >= 1):
        raise ValueError(f"weight_bytes: expected an int >= 1 (bytes of one weight), got {weight_bytes!r}")
    return max(2, math.ceil(ROTATE_BYTES / weight_bytes))


CPU_SHAPE = (64, 96)  # K, N of the cpu-profile demo (swiglu: I = 48)
CPU_CONFIG = {"block_sizes": [16, 32, 32], "num_warps": 4, "num_stages": 2}


def cpu_demo_table(dtypes: Iterable[str] = ("float32", "float16"), epilogues=("none", "swiglu")) -> dict:
    """A config table for the cpu profile: CPU_SHAPE, every bucket up to 32, one fixed config."""
    k, n = CPU_SHAPE
    t: dict = {}
    for dt in dtypes:
        assert dt in DTYPES
        for epi in epilogues:
            for b in (1, 2, 4, 8, 16, 32):
                set_entry(t, epi, dt, k, n, b, CPU_CONFIG)
    return t


def _per_call(t, calls: int):
    """A Timing of one replay of ``calls`` GEMMs, as the time per GEMM."""
    return dataclasses.replace(t, ms_p50=t.ms_p50 / calls, ms_p20=t.ms_p20 / calls, ms_p80=t.ms_p80 / calls)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _bytes(m: int, k: int, n: int, epilogue: str, elem: int) -> int:
    n_out = n // 2 if epilogue == "swiglu" else n
    return (n * k + m * k + m * n_out) * elem


def _row(common: dict, timing, flops: float, nbytes: float, **extra) -> dict:
    from moelora_lib.studies import bench

    us = timing.ms_p50 * 1e3
    return bench.result_row(
        **common,
        **extra,
        timing=timing,
        flops=flops,
        bytes=nbytes,
        tb_per_s=nbytes / (us * 1e-6) / 1e12,
        tflops=flops / (us * 1e-6) / 1e12,
    )


def sweep_compile_tasks(methods: dict, jobs: Iterable[tuple], ms: Iterable[int]) -> dict[str, dict]:
    """The compile tasks of a sweep (:func:`moelora_lib.studies.helion_tune.precompile_tasks` format):
    per job (name, proj, K, N, epilogue, dtype), the config ``methods[epilogue]`` picks for the bucket
    of each M in ``ms``, with every Triton M-variant its ``warmup`` meets (:func:`warm_m_values` of
    the bucket) and the M itself. Configs shared by several buckets or shapes are one task."""
    from ..helion_linear import bucket_for, lookup, warm_m_values
    from .helion_tune import _task_key

    tasks: dict[str, dict] = {}
    for _, _, k, n, epi, dt in jobs:
        table = methods[epi].table()
        for m in ms:
            b = bucket_for(m)
            cfg = lookup(table, epi, dt, k, n, b)
            if cfg is None:
                continue  # no config: the torch path, nothing to compile
            t = tasks.setdefault(
                _task_key(epi, dt, k, n, cfg),
                {"epilogue": epi, "dtype": dt, "K": k, "N": n, "config": cfg, "ms": []},
            )
            for v in warm_m_values(b) + [m]:
                if v not in t["ms"]:
                    t["ms"].append(v)
    return tasks


def _sweep_jobs(models: Iterable[str], epilogues: Iterable[str], dtype: str) -> list[tuple]:
    """(name, proj, K, N, epilogue, dtype) of every projection of ``models``; "swiglu" for gate_up only."""
    jobs = []
    for name in models:
        for proj, (k, n) in LINEAR_MODELS[name].projections().items():
            for epi in epilogues:
                if epi == "swiglu" and proj != "gate_up":
                    continue
                jobs.append((name, proj, k, n, epi, dtype))
    return jobs


def precompile(
    models: Iterable[str],
    ms: Iterable[int],
    configs: Any = None,
    epilogues: Iterable[str] = ("none", "swiglu"),
    dtype: str = "bfloat16",
    jobs: int = -1,
    log=print,
) -> dict[str, dict]:
    """Compile every config the sweep of ``models`` × ``ms`` meets in ``jobs`` spawned processes (-1:
    one per core but two, at most 14), through :func:`moelora_lib.studies.helion_tune.precompile_tasks`
    (the tuner's parallel precompile, tasks from :func:`sweep_compile_tasks`). Needs a real
    ``__main__`` (spawned workers): call it from a script or through :func:`precompile_in_subprocess`."""
    import os

    from .helion_tune import precompile_tasks

    epilogues = tuple(epilogues)
    methods = {epi: HelionLinearMethod(configs, epi) for epi in epilogues}
    tasks = sweep_compile_tasks(methods, _sweep_jobs(models, epilogues, dtype), list(ms))
    n_jobs = jobs if jobs > 0 else max(1, min(14, (os.cpu_count() or 4) - 2))
    return precompile_tasks(tasks, n_jobs, timeout_s=300, log=log)


def precompile_in_subprocess(
    models: Iterable[str],
    ms: Iterable[int],
    configs: Any = None,
    epilogues: Iterable[str] = ("none", "swiglu"),
    dtype: str = "bfloat16",
    jobs: int = -1,
    timeout_s: float = 360,
) -> bool:
    """:func:`precompile` in ``python -m moelora_lib.studies.helion_study precompile`` (a real
    ``__main__`` for the spawned workers, also from a notebook kernel); prints its log. Returns True
    when it finished; on any failure prints why and returns False (the configs then compile on first
    use, as without it: nothing measured depends on it)."""
    import subprocess
    import sys

    from moelora_lib.studies import bench

    cmd = [
        sys.executable,
        "-m",
        "moelora_lib.studies.helion_study",
        "precompile",
        "--models",
        ",".join(models),
        "--m",
        ",".join(str(int(m)) for m in ms),
        "--epilogues",
        ",".join(epilogues),
        "--dtype",
        dtype,
        "--jobs",
        str(jobs),
    ]
    if configs is not None:
        cmd += ["--configs", str(configs)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(bench.REPO_ROOT)
        )
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[08 precompile] skipped ({type(e).__name__}: {e}); configs compile on first use")
        return False
    out = (proc.stdout + proc.stderr).replace(str(bench.REPO_ROOT) + "/", "").strip()
    print("\n".join(line for line in out.splitlines() if line.startswith("[08 precompile"))[-3000:])
    if proc.returncode != 0:
        print(f"[08 precompile] failed (rc {proc.returncode}): {out[-800:]}; configs compile on first use")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m moelora_lib.studies.helion_study precompile --models A,B --m 1,2,... [--configs P]``."""
    import argparse
    import time

    p = argparse.ArgumentParser(prog="python -m moelora_lib.studies.helion_study")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("precompile", help="compile the sweep's configs in spawned processes")
    c.add_argument("--models", default=",".join(LINEAR_MODELS))
    c.add_argument("--m", default="1,2,4,8,16,32,256,1024,4096")
    c.add_argument("--epilogues", default="none,swiglu")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--configs", default=None, help="config file (default: the shipped one of this GPU)")
    c.add_argument("--jobs", type=int, default=-1)
    a = p.parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[08 precompile {time.perf_counter() - t0:5.1f}s] {msg}", flush=True)

    res = precompile(
        [m for m in a.models.split(",") if m],
        [int(v) for v in a.m.split(",") if v],
        a.configs,
        [e for e in a.epilogues.split(",") if e],
        a.dtype,
        a.jobs,
        log=log,
    )
    bad = [r for r in res.values() if not r.get("ok")]
    for r in bad[:5]:
        log(f"failed: {r.get('epilogue')} K={r.get('K')} N={r.get('N')}: {r.get('error')}")
    return 0


def _two_gemm(x, w_gate, w_up):
    import torch.nn.functional as F

    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def sweep(
    *,
    profile: str,
    models: Iterable[str] = ("llama3-8b", "qwen3-32b", "llama3-70b"),
    ms: Iterable[int] = (1, 2, 4, 8, 16, 32, 256, 1024, 4096),
    dtype: str = "bfloat16",
    configs: Any = None,
    seed: int = 0,
    timing_kw: dict | None = None,
    epilogues: Iterable[str] = ("none", "swiglu"),
    progress: bool = True,
    precompile_jobs: int = -1,
) -> list[dict]:
    """Measure Helion vs PyTorch for every projection, epilogue and M; returns result rows.

    profile "gpu": the models' projections in ``dtype`` on cuda; "none" for qkv/o/gate_up/down,
    "swiglu" for gate_up (torch: merged GEMM + silu·mul, and two GEMMs + silu·mul); timings with
    ``bench.time_cuda`` in graph mode (do_bench flush, clean L2, and rotating weight copies for
    M <= 32) and eager mode. configs: HelionLinearMethod's ``configs`` argument
    (None = the shipped file of this GPU).
    profile "cpu": CPU_SHAPE in fp32 and fp16 through the Triton interpreter (needs
    TRITON_INTERPRET=1), ``configs`` ignored (cpu_demo_table), ``bench.time_cpu`` with one rep.
    Every row carries rel_err; the caller asserts on it.

    GPU: before the first job, every config the sweep will meet is compiled in ``precompile_jobs``
    spawned processes (-1: one per core but two, at most 14; 0: none; skipped for a dict ``configs``)
    by :func:`precompile_in_subprocess` — the tuner's own parallel precompile
    (:func:`moelora_lib.studies.helion_tune.precompile_tasks`): the workers fill Triton's on-disk
    cache, and each job's ``warmup`` then generates Helion's code and loads the binaries instead of
    compiling ~150 of them one after another (nothing timed changes; a failed precompile only means
    they compile on first use, as before).
    Weights are drawn on the device (a seeded generator there; the CPU profile keeps the CPU one).
    """
    from moelora_lib.studies import bench
    from moelora_lib.studies.notebook import progress as tqdm  # a text bar, also in notebooks

    if profile not in ("cpu", "gpu"):
        raise ValueError(f"profile: expected 'cpu' or 'gpu', got {profile!r}")
    timing_kw = dict(timing_kw or {})
    if "flush_l2" in timing_kw or "mode" in timing_kw:
        raise ValueError("timing_kw: 'flush_l2' and 'mode' are set by the sweep's timing modes")
    epilogues, models = tuple(epilogues), list(models)
    ms = list(ms)
    if profile == "cpu":
        jobs = [
            ("tiny", "demo", CPU_SHAPE[0], CPU_SHAPE[1], epi, dt)
            for dt in ("float32", "float16")
            for epi in epilogues
        ]
        device = "cpu"
        methods = {
            epi: HelionLinearMethod(cpu_demo_table(), epi, allow_interpreter=True) for epi in epilogues
        }
        modes = ("cpu",)
    else:
        jobs = _sweep_jobs(models, epilogues, dtype)
        device = "cuda"
        methods = {epi: HelionLinearMethod(configs, epi) for epi in epilogues}
        modes = ("graph", "graph_clean", "graph_rotate", "eager")
        if precompile_jobs and not isinstance(configs, dict):
            precompile_in_subprocess(models, ms, configs, epilogues, dtype, precompile_jobs)

    def timed(fn, mode):
        if mode in ("cpu", "eager"):
            return bench.time_fn(fn, mode, device, **timing_kw)
        t = bench.time_fn(fn, "graph", device, flush_l2=GRAPH_MODE_FLUSH[mode], **timing_kw)
        return dataclasses.replace(t, mode=mode)

    rows: list[dict] = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # W on the device from a generator there (up to 470 M values per job: ~15 s of serial CPU draws for
    # the sweep); the CPU profile draws everything from the CPU generator, as before
    wgen = gen if device == "cpu" else torch.Generator(device=device).manual_seed(seed)
    for name, proj, k, n, epi, dt in tqdm(jobs, desc="08 sweep", disable=not progress):
        tdtype = getattr(torch, dt)
        w = (torch.randn(n, k, generator=wgen, device=device) * k**-0.5).to(dtype=tdtype)
        method = methods[epi]
        layer = Linear.from_weight(w, method)
        torch_layer = Linear.from_weight(w, TorchLinearMethod(epi))
        method.warmup(layer, max(ms))
        # graph_rotate: copies of W that together stream ROTATE_BYTES per replay (layers share runners).
        copies = rotation_copies(n * k * tdtype.itemsize) if "graph_rotate" in modes else 1
        w_rot = [w] + [w.clone() for _ in range(copies - 1)]
        layers_rot = [layer] + [Linear.from_weight(wc, method) for wc in w_rot[1:]]
        torch_rot = [torch_layer] + [Linear.from_weight(wc, TorchLinearMethod(epi)) for wc in w_rot[1:]]
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=tdtype)
            ref = torch_reference(x.float(), w.float(), None, epi)
            path = method.path_for(layer, m)
            y_h = layer(x)
            y_t = torch_layer(x)
            common = dict(stage="helion_linear", model=name, proj=proj, epilogue=epi, M=m, K=k, N=n, dtype=dt)
            flops = 2.0 * m * n * k
            nbytes = _bytes(m, k, n, epi, tdtype.itemsize)
            # (impl, fn, rotating fn over the copies, rel_err, path)
            impls = [
                (
                    "helion",
                    lambda x=x, layer=layer: layer(x),
                    lambda x=x, ls=layers_rot: [lay(x) for lay in ls],
                    _rel_err(y_h, ref),
                    path,
                ),
                (
                    "torch",
                    lambda x=x, tl_=torch_layer: tl_(x),
                    lambda x=x, ls=torch_rot: [lay(x) for lay in ls],
                    _rel_err(y_t, ref),
                    "torch",
                ),
            ]
            if epi == "swiglu":
                i = n // 2
                wg, wu = w[:i], w[i:]
                impls.append(
                    (
                        "torch_two_gemm",
                        lambda x=x, wg=wg, wu=wu: _two_gemm(x, wg, wu),
                        lambda x=x, i=i, ws=w_rot: [_two_gemm(x, wc[:i], wc[i:]) for wc in ws],
                        _rel_err(_two_gemm(x, wg, wu), ref),
                        "torch",
                    )
                )
            for impl, fn, fn_rot, err, p in impls:
                for mode in modes:
                    if mode == "graph_rotate":
                        if m > ROTATE_MAX_M:
                            continue
                        t, c = _per_call(timed(fn_rot, mode), copies), copies
                    else:
                        t, c = timed(fn, mode), 1
                    rows.append(_row(common, t, flops, nbytes, impl=impl, path=p, rel_err=err, copies=c))
            del x, ref, y_h, y_t
        del w, layer, torch_layer, w_rot, layers_rot, torch_rot
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary(df):
    """One line per (model, proj, epilogue, dtype, M, mode): µs of helion / torch (/ two-GEMM),
    speedup torch/helion, achieved TB/s and TFLOP/s of both, Helion's path."""
    import pandas as pd

    key = ["model", "proj", "epilogue", "dtype", "M", "mode"]
    piv = df.pivot_table(index=key, columns="impl", values="ms_p50", aggfunc="first") * 1e3
    out = pd.DataFrame(index=piv.index)
    out["helion_us"] = piv["helion"]
    out["torch_us"] = piv["torch"]
    out["speedup"] = piv["torch"] / piv["helion"]
    if "torch_two_gemm" in piv:
        out["two_gemm_us"] = piv["torch_two_gemm"]
        out["speedup_vs_two_gemm"] = piv["torch_two_gemm"] / piv["helion"]
    for col in ("tb_per_s", "tflops"):
        p = df.pivot_table(index=key, columns="impl", values=col, aggfunc="first")
        out[f"helion_{col}"] = p["helion"]
        out[f"torch_{col}"] = p["torch"]
    paths = df[df.impl == "helion"].groupby(key)["path"].first()
    out["helion_path"] = paths
    out = out.join(df.groupby(key)[["K", "N"]].first())
    return out.reset_index()


def plot(df, out_dir: str | Path, prefix: str = "08", read_tb_per_s: float | None = None) -> list[Path]:
    """Figures from the sweep CSV: speedup vs M per projection (one panel per timing mode), and
    achieved TB/s at decode sizes (graph modes) against the copy ceiling and, if given, the measured
    read ceiling (TB/s). Returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moelora_lib.studies.bench import H200_COPY_TB_PER_S

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = summary(df)
    paths = []
    modes = [m for m in ("graph", "graph_clean", "graph_rotate", "eager", "cpu") if m in set(s["mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sub = s[s["mode"] == mode]
        for (model, proj, epi), g in sub.groupby(["model", "proj", "epilogue"]):
            g = g.sort_values("M")
            ax.plot(
                g.M,
                g.speedup,
                marker="o",
                ms=3,
                label=f"{model} {proj}{' swiglu' if epi == 'swiglu' else ''}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("torch time / Helion time")
        ax.set_title(f"Helion vs PyTorch (cuBLAS), {mode}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    p = out_dir / f"{prefix}_speedup_vs_m.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    bw_modes = [m for m in ("graph", "graph_clean", "graph_rotate") if m in modes]
    if bw_modes:
        fig, axes = plt.subplots(1, len(bw_modes), figsize=(9 * len(bw_modes), 4.5), squeeze=False)
        for ax, mode in zip(axes[0], bw_modes):
            sub = s[(s["mode"] == mode) & (s.M <= 32) & (s.epilogue == "none")]
            g = sub.groupby(["model", "proj"])[["helion_tb_per_s", "torch_tb_per_s"]].median()
            xs = range(len(g))
            ax.bar([i - 0.2 for i in xs], g.torch_tb_per_s, width=0.4, label="cuBLAS")
            ax.bar([i + 0.2 for i in xs], g.helion_tb_per_s, width=0.4, label="Helion")
            copy_label = f"copy ceiling {H200_COPY_TB_PER_S} TB/s"
            ax.axhline(H200_COPY_TB_PER_S, color="r", ls="--", label=copy_label)
            if read_tb_per_s:
                ax.axhline(read_tb_per_s, color="m", ls=":", label=f"read ceiling {read_tb_per_s:.2f} TB/s")
            ax.set_xticks(list(xs), [f"{a}\n{b}" for a, b in g.index], fontsize=7)
            ax.set_ylabel("achieved TB/s (median over M ≤ 32)")
            ax.set_title(
                {
                    "graph": "graph replay, do_bench flush (dirty L2)",
                    "graph_clean": "graph replay, clean L2",
                    "graph_rotate": "graph replay, rotating weight copies",
                }[mode]
            )
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{prefix}_decode_bandwidth.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# Ceilings, the L2-state probe and the best ratio each target allows
# ---------------------------------------------------------------------------------------------
def ceilings(nbytes: int = 2 * 1024**3, timing_kw: dict | None = None) -> dict:
    """Measured memory ceilings of this GPU (TB/s, 1e12 bytes/s): ``copy`` (device-to-device copy of
    ``nbytes``, bytes read + written, as :data:`moelora_lib.hardware.H200_COPY_TB_PER_S` counts it)
    and ``read`` (``torch.sum`` over ``nbytes`` of fp32: a pure read stream, the bound of a
    weight-streaming decode GEMM), both timed with ``bench.time_fn`` in eager mode without an L2
    flush (the buffers are 35x the L2); and
    ``tiny_kernel_us``, the graph-replayed time of a one-element kernel timed after a clean L2 flush
    (the fixed cost of one launch inside a graph as the sweep's graph modes see it, µs)."""
    from moelora_lib.studies import bench

    kw = {"warmup_ms": 10, "rep_ms": 60, **(timing_kw or {}), "flush_l2": False}
    a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t_copy = bench.time_fn(lambda a=a, b=b: b.copy_(a), "eager", "cuda", **kw)
    t_read = bench.time_fn(lambda a=a: torch.sum(a), "eager", "cuda", **kw)
    tiny = torch.zeros(1, device="cuda")
    # After a flush kernel, so the graph is already queued when the start event fires (without one,
    # the CPU's graph-launch latency would be timed instead).
    t_tiny = bench.time_fn(lambda: tiny.add_(1), "graph", "cuda", **{**kw, "flush_l2": "clean"})
    out = {
        "tiny_kernel_us": t_tiny.ms_p50 * 1e3,
        "copy_tb_per_s": 2 * nbytes / (t_copy.ms_p50 * 1e-3) / 1e12,
        "read_tb_per_s": nbytes / (t_read.ms_p50 * 1e-3) / 1e12,
        "nbytes": nbytes,
    }
    del a, b
    torch.cuda.empty_cache()
    return out


def l2_probe(
    shapes: Iterable[tuple[int, int]] = ((4096, 4096), (4096, 28672), (28672, 8192)),
    m: int = 1,
    dtype: str = "bfloat16",
    configs: Any = None,
    timing_kw: dict | None = None,
    seed: int = 0,
) -> list[dict]:
    """How the L2 state before a timed call changes a decode GEMM's time, for cuBLAS and Helion.

    For each (K, N), y = x·Wᵀ at ``m`` rows is timed as a CUDA-graph replay four ways:
    ``dirty`` (do_bench's zeroing flush: L2 full of dirty lines), ``clean`` (L2 evicted by a read),
    ``rotate`` (no flush; the graph cycles through enough copies of W to stream 4x the L2, the
    way this project avoids timing a warm cache; time per GEMM = replay time / copies) and ``warm``
    (no flush, one W: whatever of W fits stays in L2). Rows: K, N, M, impl, l2, ms_p50/p20/p80,
    weight_bytes, copies, tb_per_s (weight bytes per second), plus the bench environment columns.
    """
    from moelora_lib.studies import bench

    kw = {"warmup_ms": 10, "rep_ms": 40, **(timing_kw or {})}
    kw.pop("flush_l2", None)  # set per L2 state below
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tdtype = getattr(torch, dtype)
    rows = []
    method = HelionLinearMethod(configs, "none")
    for k, n in shapes:
        wbytes = n * k * tdtype.itemsize
        copies = rotation_copies(wbytes)
        w0 = (torch.randn(n, k, generator=gen) * k**-0.5).to(device="cuda", dtype=tdtype)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]
        x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=tdtype)
        layers = [Linear.from_weight(w, method) for w in ws]
        method.warmup(layers[0], m)  # the copies share its runner (cached per shape and config)
        tls = [Linear.from_weight(w, TorchLinearMethod("none")) for w in ws]
        impls = {"helion": layers, "torch": tls}
        for impl, ls in impls.items():
            one = ls[0]
            runs = {
                "dirty": (lambda one=one, x=x: one(x), dict(flush_l2=True), 1),
                "clean": (lambda one=one, x=x: one(x), dict(flush_l2="clean"), 1),
                "warm": (lambda one=one, x=x: one(x), dict(flush_l2=False), 1),
                "rotate": (lambda ls=ls, x=x: [lay(x) for lay in ls], dict(flush_l2=False), len(ls)),
            }
            for l2, (fn, fkw, c) in runs.items():
                t = bench.time_fn(fn, "graph", "cuda", **{**kw, **fkw})
                t = _per_call(t, c)
                rows.append(
                    bench.result_row(
                        stage="helion_l2_probe",
                        K=k,
                        N=n,
                        M=m,
                        dtype=dtype,
                        impl=impl,
                        l2=l2,
                        copies=c,
                        weight_bytes=wbytes,
                        timing=t,
                        tb_per_s=wbytes / (t.ms_p50 * 1e-3) / 1e12,
                        path=method.path_for(layers[0], m) if impl == "helion" else "torch",
                    )
                )
        del ws, layers, tls, w0, x
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def best_ratio_bounds(s, read_tb_per_s: float, tflops: float, launch_us: float = 0.0):
    """An estimate of the largest speedup over the measured PyTorch time that any kernel could reach,
    per row of :func:`summary`: ``max_speedup = torch_us / floor_us`` with ``floor_us = max(bytes /
    read_tb_per_s, flops / tflops) + launch_us`` (bytes: weight + x + output once each, at the row's
    dtype; flops 2·M·N·K; swiglu: the fused kernel's output [M, N/2]).

    It is a bound only as far as its rates are: pass the best rates seen (the measured read ceiling
    or the fastest achieved TB/s, the dense peak or the fastest achieved TFLOP/s), and ``launch_us``
    only where a launch cannot overlap the kernel. Rows whose measured speedup exceeds
    ``max_speedup`` show where that failed. Meant for graph-replayed rows.

    s: DataFrame with columns M, K, N, epilogue, dtype, torch_us. Returns a copy with ``floor_us`` and
    ``max_speedup`` added. Raises ValueError for non-positive rates, a negative ``launch_us`` or
    missing columns.
    """
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
    n_out = n.where(out.epilogue != "swiglu", n / 2)
    nbytes = (n * k + m * k + m * n_out) * elem
    flops = 2 * m * n * k
    floor = (nbytes / (read_tb_per_s * 1e12)).combine(flops / (tflops * 1e12), max) * 1e6 + launch_us
    out["floor_us"] = floor
    out["max_speedup"] = out.torch_us / floor
    return out


if __name__ == "__main__":
    import sys

    sys.exit(main())
