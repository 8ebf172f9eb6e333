"""Generate notebooks/08_helion_linear.ipynb (no outputs). Run: python scripts/make_notebook_08.py"""

from pathlib import Path

import nbformat as nbf

MD1 = r"""# 08 — Helion linear backend: tuned Helion GEMMs behind a linear-method API (issue 5)

**What changes.** The dense projections (QKV, O, gate_up, down) of Llama-3.1-8B, Qwen3-32B and
Llama-3.3-70B run through `moelora_lib.helion_linear.HelionLinearMethod`: Helion 1.4.0 kernels
(plain GEMM, fused SwiGLU, split-K for small M) with configs pre-tuned per M bucket on this GPU
(`python -m moelora_lib.helion_tune`: 4–12 explicit candidates per bucket, shipped as
`moelora_lib/configs/helion/NVIDIA_H200.json`), compiled once at warm-up, with `F.linear` (cuBLAS)
as fallback. The baseline is `TorchLinearMethod` (cuBLAS) measured side by side in the same run.

**Why.** At decode (M = 1–32) these GEMMs are bound by weight bandwidth: cuBLAS takes ≈ 40 µs for
[M, 4096]×[4096, 14336] bf16 (117 MB of weights) at every M ≤ 64 under do_bench's method, i.e.
≈ 2.9 TB/s of the measured 4.3 TB/s copy ceiling. A per-shape tuned kernel can close part of that gap.

**First run (commit 18fd37d, 2–4 candidates per bucket, timed after do_bench's L2 flush):** decode
geomean 1.00× cuBLAS, prefill 0.92×, fused SwiGLU 1.09×. Both libraries sat on one line,
time ≈ (weight bytes + ≈ 50–60 MB) / 4.3 TB/s, for every shape from 33 MB to 940 MB. Hence this run's
other timing modes.

**The L2 state (hypothesis, written before this run).** do_bench flushes L2 by *zeroing* 256 MB, so
the timed call starts with ≈ 60 MB of dirty lines of the flush buffer in L2 and writes them back as
it evicts them: ≈ 14 µs of extra HBM traffic, shared by every implementation, which compresses every
decode ratio toward 1. In a real decode step the L2 holds the previous layer's weights (clean).
Predictions: with the L2 evicted by a *read* (`flush_l2="clean"`), cuBLAS M = 1 at 4096×4096
(33.5 MB) drops from ≈ 19 µs to ≈ 10–11 µs, at 4096×14336 from ≈ 40 to ≈ 29–30 µs, at 8192×28672
from ≈ 121 to ≈ 110 µs; rotating through enough weight copies to stream 4× the L2 (no flush at all)
gives the same times as the clean flush. Every ratio below is reported in three graph modes:
`graph` (do_bench flush, the method of the MoE anchors), `graph_clean`, and `graph_rotate`
(M ≤ 32: one graph replays the GEMM over weight copies that stream 4× the L2, no flush; time per
GEMM = replay / copies: back-to-back layers as in a captured decode step). `graph_rotate` was added
to the sweep after the second GPU run's probe showed rotation 2–3 µs under the clean flush (the
clean-flush mode also times one graph launch, ≈ 5 µs for a one-element kernel): see
docs/perf_notes.md for the predictions against what was measured.

**Predictions for the ratios (written before this run).**
* Decode, graph-replayed, clean L2: cuBLAS already streams the large weights at ≈ 3.5–4 TB/s, so the
  best any kernel can do there is ≈ 1.1× (computed per row below as `max_speedup`); the small
  projections (O, QKV of 8B: 33–50 MB) leave more room. Expected geomean 1.05–1.15×: the 1.15×
  target is met only where the bound allows it. With do_bench's flush: ≈ 1.0–1.05×.
* Decode, eager: Helion **slower** than cuBLAS (≈ 30 µs of Python dispatch per call; vLLM uses Helion
  only under CUDA-graph replay).
* Prefill (M = 256–4096): the new M = 256 candidates (64×64 tiles, split-K for narrow N) lift the
  worst rows (0.64–0.77×) to ≥ 0.9×; geomean ≥ 0.95× plausible.
* Fused SwiGLU vs PyTorch (one merged GEMM + silu·mul): both read the same weights; the fusion saves
  the [M, 2I] write+read and two small launches, ≈ 5–10 µs of a 70–230 µs decode call, so ≈ 1.05–1.15×;
  the issue's ≥ 1.3× lies above the bound computed below at every shape.

On `PROFILE = "cpu"` the same code runs tiny shapes (K = 64, N = 96) through the Triton interpreter
in fp32/fp16: correctness only; its timing table measures the interpreter, not a kernel.
"""

PARAMS = """PROFILE = "gpu"
SEED = 0
TUNE = True
TUNE_BUDGET_S = 240"""

DERIVED = """import json
import os

if PROFILE == "cpu":
    # Before anything imports triton: @triton.jit reads TRITON_INTERPRET when it decorates (triton's
    # own helpers at import, Helion's generated kernel at warm-up). The runner sets it too.
    os.environ.setdefault("TRITON_INTERPRET", "1")
import shutil
import subprocess
import sys
import time

import pandas as pd

from moelora_lib import bench
from moelora_lib.helion_linear import LINEAR_MODELS, gpu_config_name, load_configs, shipped_config_path
from moelora_lib.helion_linear import study

assert PROFILE in ("cpu", "gpu"), PROFILE
if PROFILE == "gpu":
    assert os.environ.get("TRITON_INTERPRET", "0") == "0", "the gpu profile must not run the Triton interpreter"

MODELS = list(LINEAR_MODELS)                       # llama3-8b, qwen3-32b, llama3-70b
MS = [1, 2, 4, 8, 16, 32, 256, 1024, 4096] if PROFILE == "gpu" else [1, 5, 17]
TIMING = dict(warmup_ms=10, rep_ms=40)             # bench.time_cuda budgets per measurement
CSV = bench.data_path("08_helion_linear.csv") if PROFILE == "gpu" else bench.data_path("cpu", "08_helion_linear.csv")
FIG_DIR = bench.data_path("figures") if PROFILE == "gpu" else bench.data_path("cpu", "figures")
TUNE_CSV = bench.data_path("helion_tuning.csv")
t_notebook = time.perf_counter()
print(bench.env_record())"""

PROBE_MD = """## Ceilings and the L2 state (GPU only)
Measured here, now: the copy ceiling (bytes read + written) and the read ceiling (a `torch.sum` over
2 GB: the bound of a weight-streaming GEMM), the graph-replayed cost of one tiny kernel, and one
decode GEMM (M = 1) per weight size timed four ways: `dirty` (do_bench's zeroing flush), `clean`
(L2 evicted by a read), `rotate` (no flush; the graph cycles through copies of W that stream 4× the
L2) and `warm` (no flush, one W)."""

PROBE = """CEIL = None
if PROFILE == "gpu":
    CEIL = study.ceilings()
    bench.data_path("08_ceilings.json").write_text(json.dumps({**CEIL, **bench.env_record()}, indent=1, default=str))
    print({k: round(v, 3) for k, v in CEIL.items() if k != "nbytes"})
    probe = pd.DataFrame(study.l2_probe(configs=None))
    bench.write_rows(bench.data_path("08_l2_probe.csv"), probe.to_dict("records"))
    probe["us"] = probe.ms_p50 * 1e3
    print(probe.pivot_table(index=["K", "N", "impl"], columns="l2", values="us").round(2).to_string())
    print(probe.pivot_table(index=["K", "N", "impl"], columns="l2", values="tb_per_s").round(2).to_string())"""

TUNE_MD = """## Tuning (GPU only)
The tuner runs as a subprocess (Helion/our precompile workers are spawned processes and need a real
`__main__`). It times 4–12 hand-picked configs per (shape, M bucket) with `bench.time_cuda` in graph
mode with a clean L2 (`--l2 clean`), keeps every tried config in `data/helion_tuning.csv`, and writes
the winners into the shipped JSON; a copy goes to `data/`. It is resumable: buckets already in the
JSON are skipped (the shipped file was tuned before this notebook ran; see the tuning CSV)."""

TUNE = """CONFIG_PATH = None
if PROFILE == "gpu":
    CONFIG_PATH = shipped_config_path(gpu_config_name())
    if TUNE:
        cmd = [sys.executable, "-m", "moelora_lib.helion_tune",
               "--shapes", ",".join(MODELS), "--m", ",".join(map(str, MS)),
               "--epilogues", "none,swiglu", "--out", str(CONFIG_PATH),
               "--csv", str(TUNE_CSV), "--budget-s", str(TUNE_BUDGET_S)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-6000:])
        print(proc.stderr[-3000:])
        assert proc.returncode == 0, f"tuner failed with {proc.returncode}"
        print(f"tuner wall time: {time.perf_counter() - t0:.1f} s")
    table = load_configs(CONFIG_PATH)
    shutil.copy(CONFIG_PATH, bench.data_path(f"helion_configs_{CONFIG_PATH.stem}.json"))
    print("tuning seconds (all runs):", table["_meta"]["tuning_seconds"])
    tune = pd.read_csv(TUNE_CSV)
    print(tune.groupby(["impl", "status"]).size())"""

SWEEP_MD = """## Sweep: Helion vs cuBLAS, eager and graph-replayed, with correctness
Every projection × M; for gate_up also the fused SwiGLU against PyTorch's merged GEMM + silu·mul and
against two separate GEMMs. Rows go to the CSV; everything below is read back from it."""

SWEEP = """rows = study.sweep(profile=PROFILE, models=MODELS, ms=MS, configs=CONFIG_PATH, seed=SEED, timing_kw=TIMING)
bench.write_rows(CSV, rows)
df = pd.read_csv(CSV)
print(len(df), "rows ->", CSV)"""

CHECK = """# Correctness: every implementation within the dtype's tolerance of the fp32 PyTorch result.
bad = df[df.rel_err > df.dtype.map(study.REL_TOL)]
assert bad.empty, bad[["model", "proj", "epilogue", "M", "impl", "rel_err"]]
# Every tuned shape really took the Helion path where a config exists (no silent fallback).
helion_rows = df[df.impl == "helion"]
print(helion_rows.groupby("path").size())
if PROFILE == "gpu":
    assert helion_rows.path.str.startswith("helion:").any(), "no shape ran through Helion"
print("max rel err per dtype/impl:")
print(df.groupby(["dtype", "impl"]).rel_err.max())"""

SUMMARY = """s = study.summary(df)
pd.set_option("display.width", 200, "display.max_rows", 400)
cols = ["model", "proj", "epilogue", "M", "timing_mode", "helion_us", "torch_us", "speedup",
        "helion_tb_per_s", "torch_tb_per_s", "helion_tflops", "torch_tflops", "helion_path"]
if "speedup_vs_two_gemm" in s:
    cols += ["two_gemm_us", "speedup_vs_two_gemm"]
if PROFILE == "cpu":
    print("CPU-interpreter timings: interpreter cost, NOT kernel performance")
print(s[cols].round(3).to_string(index=False))"""

FIGS = """paths = study.plot(df, FIG_DIR, read_tb_per_s=CEIL["read_tb_per_s"] if CEIL else None)
print([str(p) for p in paths])"""

CONCL = """# Conclusions, computed from the CSV just written.
import numpy as np

def gmean(v):
    v = np.asarray(v, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(np.exp(np.log(v).mean())) if len(v) else float("nan")

# Dense bf16 peak for the bounds: the top of the 769-798 TFLOP/s that an 8192^3 torch matmul reached on
# these machines (device tool KINDS.md), so a floor is never above what cuBLAS shows it can do.
PEAK_TFLOPS = 800.0
modes = ["graph", "graph_clean", "graph_rotate"] if PROFILE == "gpu" else ["cpu"]
lines, targets, bounds = [], [], []
for mode in modes:
    sm = s[s.timing_mode == mode]
    plain = sm[sm.epilogue == "none"]
    decode, prefill = plain[plain.M <= 32], plain[plain.M >= 256]
    sw = sm[sm.epilogue == "swiglu"]
    sw2 = sw.get("speedup_vs_two_gemm", pd.Series(dtype=float))
    lines.append(f"[{mode}] decode (M<=32) Helion vs cuBLAS geomean {gmean(decode.speedup):.3f}x "
                 f"(min {decode.speedup.min():.3f}, max {decode.speedup.max():.3f}); target >= 1.15x")
    if len(prefill):
        lines.append(f"[{mode}] prefill (M>=256) geomean {gmean(prefill.speedup):.3f}x "
                     f"(min {prefill.speedup.min():.3f}); target >= 0.95x")
    lines.append(f"[{mode}] fused SwiGLU (all M) vs merged GEMM + silu*mul geomean {gmean(sw.speedup):.3f}x, "
                 f"vs two GEMMs {gmean(sw2):.3f}x; target >= 1.3x")
    if PROFILE == "gpu":
        lines.append(f"[{mode}] decode achieved bandwidth: Helion median {decode.helion_tb_per_s.median():.2f} TB/s, "
                     f"cuBLAS {decode.torch_tb_per_s.median():.2f} TB/s (read ceiling {CEIL['read_tb_per_s']:.2f}, "
                     f"copy ceiling {CEIL['copy_tb_per_s']:.2f})")
        if len(prefill):
            lines.append(f"[{mode}] prefill: Helion median {prefill.helion_tflops.median():.0f} TFLOP/s, "
                         f"cuBLAS {prefill.torch_tflops.median():.0f}")
        # The best ratio any kernel could reach in this mode (`max_speedup`): PyTorch's time over a
        # floor = bytes at the best bandwidth seen in this mode (the read ceiling or any row's achieved
        # TB/s) or flops at the best rate seen (800 or any row's TFLOP/s), no launch cost. Every
        # measured speedup is <= this by construction (asserted). `est_speedup` adds one graph launch
        # (the tiny kernel) in the clean mode: an estimate, since a launch partly overlaps the kernel.
        # Not for "graph": there the timed call also writes back the flush's dirty lines, which no
        # floor here holds.
        bound = bound_sw = est = float("nan")
        if mode in ("graph_clean", "graph_rotate"):
            bw = max(CEIL["read_tb_per_s"], sm.helion_tb_per_s.max(), sm.torch_tb_per_s.max())
            tf = max(PEAK_TFLOPS, sm.helion_tflops.max(), sm.torch_tflops.max())
            b = study.best_ratio_bounds(sm, bw, tf)
            launch = CEIL["tiny_kernel_us"] if mode == "graph_clean" else 0.0
            b["est_speedup"] = study.best_ratio_bounds(sm, bw, tf, launch_us=launch).max_speedup
            beaten = b[b.speedup > b.max_speedup * (1 + 1e-9)]
            assert beaten.empty, beaten
            bd, bs = b[(b.M <= 32) & (b.epilogue == "none")], b[b.epilogue == "swiglu"]
            bound, bound_sw, est = gmean(bd.max_speedup), gmean(bs.max_speedup), gmean(bd.est_speedup)
            lines.append(f"[{mode}] best-possible speedup over PyTorch (rates: {bw:.2f} TB/s, {tf:.0f} TFLOP/s): "
                         f"decode geomean {bound:.3f}x (max {bd.max_speedup.max():.3f}; with one launch "
                         f"{est:.3f}x); SwiGLU vs merged, all M: {bound_sw:.3f}x")
            bounds.append(b.assign(bound_tb_per_s=bw, bound_tflops=tf, launch_us=launch))
        targets += [
            dict(mode=mode, target="decode >= 1.15x", measured=gmean(decode.speedup), goal=1.15, bound=bound,
                 bound_with_launch=est),
            dict(mode=mode, target="SwiGLU >= 1.3x (vs merged)", measured=gmean(sw.speedup), goal=1.3,
                 bound=bound_sw),
            dict(mode=mode, target="SwiGLU >= 1.3x (vs two GEMMs)", measured=gmean(sw2), goal=1.3),
        ]
        if len(prefill):  # graph_rotate times decode sizes only
            targets.append(dict(mode=mode, target="prefill >= 0.95x", measured=gmean(prefill.speedup), goal=0.95))
if PROFILE == "gpu":
    eager = s[(s.timing_mode == "eager") & (s.epilogue == "none") & (s.M <= 32)]
    lines.append(f"decode eager (Python dispatch included) geomean: {gmean(eager.speedup):.3f}x")
    bb = pd.concat(bounds)
    bb.to_csv(bench.data_path("08_bounds.csv"), index=False)
    show = ["timing_mode", "model", "proj", "epilogue", "M", "torch_us", "helion_us", "floor_us",
            "max_speedup", "est_speedup", "speedup"]
    print(bb[bb.M <= 32][show].round(3).to_string(index=False))
    tt = pd.DataFrame(targets)
    tt["met"] = tt.measured >= tt.goal
    tt.to_csv(bench.data_path("08_targets.csv"), index=False)
    print(tt.round(3).to_string(index=False))
else:
    lines.append("(cpu profile: interpreter timings, ratios are meaningless)")
lines.append(f"notebook wall time: {time.perf_counter() - t_notebook:.0f} s")
print("\\n".join(lines))"""


def main() -> None:
    nb = nbf.v4.new_notebook()
    cells = [
        nbf.v4.new_markdown_cell(MD1),
        nbf.v4.new_code_cell(PARAMS, metadata={"tags": ["parameters"]}),
        nbf.v4.new_code_cell(DERIVED),
        nbf.v4.new_markdown_cell(PROBE_MD),
        nbf.v4.new_code_cell(PROBE),
        nbf.v4.new_markdown_cell(TUNE_MD),
        nbf.v4.new_code_cell(TUNE),
        nbf.v4.new_markdown_cell(SWEEP_MD),
        nbf.v4.new_code_cell(SWEEP),
        nbf.v4.new_code_cell(CHECK),
        nbf.v4.new_code_cell(SUMMARY),
        nbf.v4.new_code_cell(FIGS),
        nbf.v4.new_code_cell(CONCL),
    ]
    for i, c in enumerate(cells):
        c.id = f"cell-{i:02d}"  # stable ids: regenerating an unchanged notebook changes nothing
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    out = Path(__file__).resolve().parent.parent / "notebooks" / "08_helion_linear.ipynb"
    nbf.write(nb, out)
    print(out)


if __name__ == "__main__":
    main()
