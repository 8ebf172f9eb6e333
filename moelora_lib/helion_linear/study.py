"""The measurements of notebook 08 (Helion linear backend vs cuBLAS), kept in the library so the
notebook only imports, calls, checks and plots.

Rows (one per (model, projection, epilogue, M, impl, timing mode)): stage "helion_linear", model,
proj, epilogue, M, K, N (weight rows; swiglu N = 2I), dtype, impl ("helion" | "torch" |
"torch_two_gemm"), path (HelionLinearMethod.path_for), timing_mode ("graph" | "eager" | "cpu"),
ms_p50/p20/p80, flops (2·M·N·K), bytes (weight + x + output, each read/written once), tb_per_s,
tflops, rel_err (max |y - ref| / max |ref| against the fp32 PyTorch result), plus the bench
environment columns.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .configs import DTYPES, set_entry
from .method import HelionLinearMethod, Linear, TorchLinearMethod, torch_reference
from .shapes import LINEAR_MODELS

#: bf16 vs the fp32 PyTorch result of the same bf16 inputs (output rounding + accumulation order).
REL_TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-5}
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


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _bytes(m: int, k: int, n: int, epilogue: str, elem: int) -> int:
    n_out = n // 2 if epilogue == "swiglu" else n
    return (n * k + m * k + m * n_out) * elem


def _row(common: dict, timing, flops: float, nbytes: float, **extra) -> dict:
    from moelora_lib import bench

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
) -> list[dict]:
    """Measure Helion vs PyTorch for every projection, epilogue and M; returns result rows.

    profile "gpu": the models' projections in ``dtype`` on cuda; "none" for qkv/o/gate_up/down,
    "swiglu" for gate_up (torch: merged GEMM + silu·mul, and two GEMMs + silu·mul); timings with
    ``bench.time_cuda`` in graph and eager mode. configs: HelionLinearMethod's ``configs`` argument
    (None = the shipped file of this GPU).
    profile "cpu": CPU_SHAPE in fp32 and fp16 through the Triton interpreter (needs
    TRITON_INTERPRET=1), ``configs`` ignored (cpu_demo_table), ``bench.time_cpu`` with one rep.
    Every row carries rel_err; the caller asserts on it.
    """
    from tqdm.auto import tqdm

    from moelora_lib import bench

    timing_kw = dict(timing_kw or {})
    epilogues = tuple(epilogues)
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
        jobs = []
        for name in models:
            for proj, (k, n) in LINEAR_MODELS[name].projections().items():
                for epi in epilogues:
                    if epi == "swiglu" and proj != "gate_up":
                        continue
                    jobs.append((name, proj, k, n, epi, dtype))
        device = "cuda"
        methods = {epi: HelionLinearMethod(configs, epi) for epi in epilogues}
        modes = ("graph", "eager")

    def timed(fn, mode):
        if mode == "cpu":
            return bench.time_cpu(fn, reps=1, warmup=0)
        return bench.time_cuda(fn, mode=mode, **timing_kw)

    rows: list[dict] = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, proj, k, n, epi, dt in tqdm(jobs, desc="08 sweep", disable=not progress):
        tdtype = getattr(torch, dt)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=device, dtype=tdtype)
        method = methods[epi]
        layer = Linear.from_weight(w, method)
        torch_layer = Linear.from_weight(w, TorchLinearMethod(epi))
        method.warmup(layer, max(ms))
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=tdtype)
            ref = torch_reference(x.float(), w.float(), None, epi)
            path = method.path_for(layer, m)
            y_h = layer(x)
            y_t = torch_layer(x)
            common = dict(stage="helion_linear", model=name, proj=proj, epilogue=epi, M=m, K=k, N=n, dtype=dt)
            flops = 2.0 * m * n * k
            nbytes = _bytes(m, k, n, epi, tdtype.itemsize)
            impls = [
                ("helion", lambda x=x, layer=layer: layer(x), _rel_err(y_h, ref), path),
                ("torch", lambda x=x, tl_=torch_layer: tl_(x), _rel_err(y_t, ref), "torch"),
            ]
            if epi == "swiglu":
                i = n // 2
                wg, wu = w[:i], w[i:]
                impls.append(
                    (
                        "torch_two_gemm",
                        lambda x=x, wg=wg, wu=wu: _two_gemm(x, wg, wu),
                        _rel_err(_two_gemm(x, wg, wu), ref),
                        "torch",
                    )
                )
            for impl, fn, err, p in impls:
                for mode in modes:
                    t = timed(fn, mode)
                    rows.append(_row(common, t, flops, nbytes, impl=impl, path=p, rel_err=err))
            del x, ref, y_h, y_t
        del w, layer, torch_layer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary(df):
    """One line per (model, proj, epilogue, M, timing_mode): µs of helion / torch (/ two-GEMM),
    speedup torch/helion, achieved TB/s and TFLOP/s of both, Helion's path."""
    import pandas as pd

    key = ["model", "proj", "epilogue", "M", "timing_mode"]
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
    return out.reset_index()


def plot(df, out_dir: str | Path, prefix: str = "08") -> list[Path]:
    """Figures from the sweep CSV: speedup vs M per projection (graph and eager), and achieved TB/s
    at decode sizes against the copy ceiling. Returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moelora_lib.bench import H200_COPY_TB_PER_S

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = summary(df)
    paths = []
    modes = [m for m in ("graph", "eager", "cpu") if m in set(s.timing_mode)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sub = s[s.timing_mode == mode]
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

    if "graph" in modes:
        sub = s[(s.timing_mode == "graph") & (s.M <= 32) & (s.epilogue == "none")]
        g = sub.groupby(["model", "proj"])[["helion_tb_per_s", "torch_tb_per_s"]].median()
        fig, ax = plt.subplots(figsize=(9, 4.5))
        xs = range(len(g))
        ax.bar([i - 0.2 for i in xs], g.torch_tb_per_s, width=0.4, label="cuBLAS")
        ax.bar([i + 0.2 for i in xs], g.helion_tb_per_s, width=0.4, label="Helion")
        ax.axhline(H200_COPY_TB_PER_S, color="r", ls="--", label=f"copy ceiling {H200_COPY_TB_PER_S} TB/s")
        ax.set_xticks(list(xs), [f"{a}\n{b}" for a, b in g.index], fontsize=7)
        ax.set_ylabel("achieved TB/s (median over M ≤ 32, graph)")
        ax.legend()
        fig.tight_layout()
        p = out_dir / f"{prefix}_decode_bandwidth.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths
