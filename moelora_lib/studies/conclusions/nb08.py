"""Conclusion of notebook 08 (Helion linear backend vs cuBLAS), and the bounds/targets tables it writes."""

from __future__ import annotations

import math

__all__ = [
    "conclusion",
    "normalize",
    "gmean",
    "speedups",
    "bounds_and_targets",
    "PEAK_TFLOPS",
    "GRAPH_MODES",
]

#: Dense bf16 peak for the bounds: the top of the 769–798 TFLOP/s that an 8192³ torch matmul reached on
#: these machines (docs/environment.md), so a floor is never above what cuBLAS shows it can do.
PEAK_TFLOPS = 800.0
GRAPH_MODES = ("graph", "graph_clean", "graph_rotate")
DECODE_MAX_M = 32
PREFILL_MIN_M = 256
#: bands the GPU claims are asserted in (geomeans, Helion time ÷ cuBLAS time inverted: > 1 Helion faster).
DECODE_BAND = (0.97, 1.10)
PREFILL_BAND = (0.85, 1.0)
SWIGLU_BAND = (1.0, 1.2)
EAGER_MAX = 0.9


def normalize(df):
    """``df`` with the timing column named ``mode`` (older CSVs and summaries call it ``timing_mode``)."""
    if "timing_mode" in df.columns and "mode" not in df.columns:
        df = df.rename(columns={"timing_mode": "mode"})
    return df


def gmean(values) -> float:
    """Geometric mean of the finite positive entries (nan if none)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x)) and float(x) > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def speedups(df):
    """One row per (model, proj, epilogue, dtype, M, mode) of the sweep CSV:
    :func:`moelora_lib.studies.helion_study.summary` (helion_us, torch_us, ``speedup`` = torch ÷ helion,
    rates, path), with ``speedup_vs_two_gemm`` NaN where the two-GEMM baseline did not run."""
    from ..helion_study import summary

    out = summary(normalize(df))
    if "speedup_vs_two_gemm" not in out:
        out["speedup_vs_two_gemm"] = float("nan")
    return out


def _groups(sm):
    plain = sm[sm.epilogue == "none"]
    return plain[plain.M <= DECODE_MAX_M], plain[plain.M >= PREFILL_MIN_M], sm[sm.epilogue == "swiglu"]


def bounds_and_targets(s, ceilings: dict, peak_tflops: float = PEAK_TFLOPS):
    """The best ratio any kernel could reach per row, and the targets table, from the study's summary.

    Args:
        s: :func:`moelora_lib.studies.helion_study.summary` of the sweep (``mode`` or ``timing_mode``).
        ceilings: :func:`moelora_lib.studies.helion_study.ceilings` (read_tb_per_s, tiny_kernel_us, ...).
        peak_tflops: the compute rate of the floors.
    Returns:
        (bounds, targets) DataFrames. ``bounds`` (graph_clean and graph_rotate): the summary rows with
        ``floor_us``, ``max_speedup`` (PyTorch's time over a floor at the best rates seen in the mode: bytes
        at max(read ceiling, fastest achieved TB/s), flops at max(peak, fastest TFLOP/s); no launch cost)
        and ``est_speedup`` (one graph launch, the tiny kernel's time, added to the floor in the clean
        mode). ``targets``: per graph mode the measured geomean of decode, SwiGLU and prefill against the
        issue's goals, with the bounds and ``met``.
    Raises:
        AssertionError: a measured speedup above its ``max_speedup`` (the floor would be wrong).
    """
    import pandas as pd

    from moelora_lib.studies import helion_study as study

    s = normalize(s)
    bounds, targets = [], []
    for mode in GRAPH_MODES:
        sm = s[s["mode"] == mode]
        if sm.empty:
            continue
        decode, prefill, sw = _groups(sm)
        bound = bound_sw = est = float("nan")
        if mode in ("graph_clean", "graph_rotate"):
            bw = max(ceilings["read_tb_per_s"], sm.helion_tb_per_s.max(), sm.torch_tb_per_s.max())
            tf = max(peak_tflops, sm.helion_tflops.max(), sm.torch_tflops.max())
            b = study.best_ratio_bounds(sm, bw, tf)
            launch = ceilings["tiny_kernel_us"] if mode == "graph_clean" else 0.0
            b["est_speedup"] = study.best_ratio_bounds(sm, bw, tf, launch_us=launch).max_speedup
            beaten = b[b.speedup > b.max_speedup * (1 + 1e-9)]
            assert beaten.empty, beaten
            bd, bs = b[(b.M <= DECODE_MAX_M) & (b.epilogue == "none")], b[b.epilogue == "swiglu"]
            bound, bound_sw, est = gmean(bd.max_speedup), gmean(bs.max_speedup), gmean(bd.est_speedup)
            bounds.append(b.assign(bound_tb_per_s=bw, bound_tflops=tf, launch_us=launch))
        sw2 = sw["speedup_vs_two_gemm"] if "speedup_vs_two_gemm" in sw else []
        targets += [
            dict(
                mode=mode,
                target="decode >= 1.15x",
                measured=gmean(decode.speedup),
                goal=1.15,
                bound=bound,
                bound_with_launch=est,
            ),
            dict(
                mode=mode,
                target="SwiGLU >= 1.3x (vs merged)",
                measured=gmean(sw.speedup),
                goal=1.3,
                bound=bound_sw,
            ),
            dict(mode=mode, target="SwiGLU >= 1.3x (vs two GEMMs)", measured=gmean(sw2), goal=1.3),
        ]
        if len(prefill):  # graph_rotate times decode sizes only
            targets.append(
                dict(mode=mode, target="prefill >= 0.95x", measured=gmean(prefill.speedup), goal=0.95)
            )
    tt = pd.DataFrame(targets)
    if len(tt):
        tt["met"] = tt.measured >= tt.goal
    bb = pd.concat(bounds, ignore_index=True) if bounds else pd.DataFrame()
    return bb, tt


def conclusion(df, bounds=None, targets=None, *, profile: str) -> str:
    """The written conclusion of notebook 08.

    Args:
        df: ``08_helion_linear.csv`` (DataFrame): every projection × M × implementation (helion, torch,
            torch_two_gemm) × timing mode (``mode``; ``timing_mode`` accepted), with ``ms_p50``,
            ``rel_err``, ``path``, ``dtype``.
        bounds: ``08_bounds.csv`` (GPU) or None.
        targets: ``08_targets.csv`` (GPU) or None.
        profile: "gpu" or "cpu" (cpu: correctness only; the interpreter's timings are not compared).

    Asserts: every output within its dtype's tolerance of the fp32 result; some shape ran through a
    Helion kernel. GPU only: decode geomean (M ≤ 32) inside ``DECODE_BAND`` in every graph mode, prefill
    (M ≥ 256) inside ``PREFILL_BAND``, fused SwiGLU vs the merged GEMM inside ``SWIGLU_BAND``; no measured
    speedup above its bound; the targets table agrees. Eager decode is reported against ``EAGER_MAX``
    (predicted: Helion slower), not asserted: it times the host's Python dispatch, which moves with the
    machine (6c00f8f's run: 0.64×; f26749d's: 1.02×, data/dev/08_failed_f26749d).

    Returns:
        Markdown: which predictions of cell 1 held, which did not and why.
    """
    from moelora_lib.studies import helion_study as study

    df = normalize(df)
    tol = df.dtype.map(study.REL_TOL)
    bad = df[df.rel_err > tol]
    assert bad.empty, bad[["model", "proj", "epilogue", "M", "impl", "rel_err"]]
    helion = df[df.impl == "helion"]
    via_helion = helion.path.astype(str).str.startswith("helion")
    assert via_helion.any(), "no shape ran through Helion"
    errs = "; ".join(
        f"{d} {e:.1e} (tolerance {study.REL_TOL[d]:g})" for d, e in df.groupby("dtype").rel_err.max().items()
    )
    out = [
        "## Conclusion",
        f"**Correctness (held).** All {len(df)} outputs (Helion, cuBLAS, two-GEMM SwiGLU) are within their "
        f"dtype's tolerance of the fp32 result; worst per dtype: {errs}. {int(via_helion.sum())} of "
        f"{len(helion)} Helion rows ran a Helion kernel"
        + (
            " (the rest fell back to `F.linear`, by design where no config exists)."
            if (~via_helion).any()
            else "."
        ),
    ]
    if profile != "gpu":
        out.append(
            "**Timing: not concluded on this profile.** The CPU profile runs tiny shapes through the Triton "
            "interpreter: its times are the interpreter's. The predictions of cell 1 (decode 1.05–1.15× "
            "cuBLAS "
            "with a clean L2, prefill ≥ 0.95×, fused SwiGLU 1.05–1.15×, eager slower) need the GPU profile."
        )
        return "\n\n".join(out)

    s = speedups(df)
    res = {}
    for mode in GRAPH_MODES:
        decode, prefill, sw = _groups(s[s["mode"] == mode])
        if decode.empty:
            continue
        res[mode] = dict(
            decode=gmean(decode.speedup),
            dmin=decode.speedup.min(),
            dmax=decode.speedup.max(),
            prefill=gmean(prefill.speedup) if len(prefill) else float("nan"),
            swiglu=gmean(sw.speedup),
            two=gmean(sw.speedup_vs_two_gemm),
        )
    assert res, "no graph-mode rows"
    for mode, r in res.items():
        assert DECODE_BAND[0] <= r["decode"] <= DECODE_BAND[1], (mode, r["decode"])
        assert SWIGLU_BAND[0] <= r["swiglu"] <= SWIGLU_BAND[1], (mode, r["swiglu"])
        if not math.isnan(r["prefill"]):
            assert PREFILL_BAND[0] <= r["prefill"] <= PREFILL_BAND[1], (mode, r["prefill"])
    eager = s[(s["mode"] == "eager") & (s.epilogue == "none") & (s.M <= DECODE_MAX_M)]
    eager_g = gmean(eager.speedup)

    def per_mode(key: str) -> str:
        return " / ".join(f"{res[m][key]:.3f}× ({m})" for m in res if not math.isnan(res[m][key]))

    d_lo, d_hi = min(r["dmin"] for r in res.values()), max(r["dmax"] for r in res.values())
    out.append(
        f"**Decode (M ≤ {DECODE_MAX_M}): predicted 1.05–1.15× with a clean L2, ≈ 1.0–1.05× with do_bench's "
        "flush; "
        f"measured geomean {per_mode('decode')}** (rows {d_lo:.2f}–{d_hi:.2f}×). Parity to slightly ahead: "
        + (
            "below the prediction"
            if res.get("graph_clean", {}).get("decode", 0) < 1.05
            else "inside the prediction"
        )
        + ", and the 1.15× target is missed in every mode."
    )
    if bounds is not None and len(bounds):
        b = normalize(bounds)
        beaten = b[b.speedup > b.max_speedup * (1 + 1e-9)]
        assert beaten.empty, "a measured speedup above its bound"
        parts = []
        for mode, g in b[(b.M <= DECODE_MAX_M) & (b.epilogue == "none")].groupby("mode"):
            est = gmean(g.est_speedup) if "est_speedup" in g else float("nan")
            parts.append(
                f"{mode}: {gmean(g.max_speedup):.2f}× strict"
                + (
                    f", {est:.2f}× with one graph launch"
                    if mode == "graph_clean" and not math.isnan(est)
                    else ""
                )
            )
        out.append(
            "**Why 1.15× is missed (08_bounds.csv).** The best decode geomean any kernel could reach over "
            "cuBLAS "
            f"(cuBLAS's time over a floor at the best rates seen, no launch cost): {'; '.join(parts)}. The "
            "large "
            "weights (235–940 MB) are already streamed near the read ceiling by cuBLAS, so their room is ≈ "
            "1.1×, "
            "most of which Helion takes; the small projections (34–170 MB) have room that a per-GEMM config "
            "search did not reach — a single-wave launch has a fixed ramp-up and drain of a few µs that only "
            "cross-kernel overlap (PDL-style early launch, prefetching the next layer) would hide "
            "(docs/perf_notes.md)."
        )
    pre = s[s["mode"].isin(GRAPH_MODES) & (s.epilogue == "none") & (s.M >= PREFILL_MIN_M)]
    by_m = ", ".join(f"M = {int(m)}: {gmean(g.speedup):.2f}×" for m, g in pre.groupby("M"))
    if any(not math.isnan(r["prefill"]) for r in res.values()):
        out.append(
            f"**Prefill (M ≥ {PREFILL_MIN_M}): predicted ≥ 0.95×, measured {per_mode('prefill')}** — missed. "
            f"Geomean per M: {by_m}. The smallest prefill M stays the worst: the generated code's per-SM "
            "matmul "
            "rate at these mid sizes is the limit "
            "(Helion 1.4.0's config space for this kernel has no warp specialization), not occupancy: "
            "split-K "
            "candidates did not help."
        )
    out.append(
        f"**Fused SwiGLU: predicted 1.05–1.15× over the merged GEMM + silu·mul, measured "
        f"{per_mode('swiglu')}** "
        f"(vs two GEMMs {per_mode('two')}) — as predicted; the ≥ 1.3× target lies above the bound on average "
        "(both paths read the same weights; the fusion saves the [M, 2I] round trip and two small launches)."
    )
    if len(eager):
        held = eager_g < EAGER_MAX
        out.append(
            f"**Eager (Python dispatch included): predicted slower (< {EAGER_MAX}×), measured {eager_g:.2f}× "
            "at decode** — "
            + (
                "held: serve Helion only under CUDA-graph replay, as vLLM does."
                if held
                else "not held in this run: the eager time is mostly the host's dispatch, which was faster "
                "here than the prediction assumed; graph replay stays the way to serve Helion, as vLLM does."
            )
        )
    if targets is not None and len(targets):
        t = normalize(targets)
        met = t.met.astype(str).str.lower().eq("true")
        out.append(
            f"**Targets (08_targets.csv): {int(met.sum())} of {len(t)} met**"
            + (f" ({', '.join(t[met].target + ' [' + t[met]['mode'] + ']')})" if met.any() else "")
            + "."
        )
    return "\n\n".join(out)
