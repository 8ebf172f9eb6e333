"""Generate notebooks/07_tuning.ipynb (no outputs). Run: python scripts/make_notebook_07.py"""

from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parent.parent

MD1 = r"""# 07 — Tuned configs for the final stage: joint BLOCK_SIZE_M, shipped H200 configs (issue 4)

**What changes.** Stage `tuned` runs the kernels of `even_k_fused_add` unchanged; only the launch
configs differ. They come from JSON files (vLLM's file names and nesting, `moelora_lib/configs/README.md`)
written by the tuner `python -m moelora_lib.tuning`, loaded by `moelora_lib.configs.load_layer_config`
(explicit folder > `$MOELORA_TUNED_CONFIG_FOLDER` > shipped `moelora_lib/configs/<gpu>/` > defaults).
The tuner picks one BLOCK_SIZE_M for the four LoRA ops jointly (one alignment serves all four: the BM
with the smallest *sum* of the four best per-op medians, as vLLM's `benchmark_lora_tuning.py`), tunes
each op's other parameters over ≤ 6 candidates, and tunes the base GEMMs the same way (BM shared by
w13 and w2).

**What should move (written before measuring).**
* LoRA part: the defaults of `default_config` were hand-picked by rows per group; expected gain
  **1.0–1.3×**, largest at T = 256–1600 where the default BM (16/32) and SPLIT_K guesses are least sure.
  Never slower than the default (the default config is always the first candidate; 3 % noise allowance).
* Base layer: the default BM=128/BN=128 prefill tile and BM=16 decode tile are untuned; expected
  **1.0–1.4×** at T ≥ 256 (vLLM's default runs GPT-OSS-20B's prefill GEMMs at ~⅓ of dense peak),
  ≈ 1.0× at decode (weight streaming is already near bandwidth).
* Whole layer: follows the base (the LoRA part is ≲ 10–25 % of it).
* Issue 4's targets (checked below, `met?` columns): LoRA ≥ 2.5× faster than vLLM's best at T ≤ 64 and
  ≥ 2× at T ≥ 256; LoRA ≤ 25 % of our base at T ≤ 64 and ≤ 10 % at T ≥ 1600; whole layer ≥ 1.5× faster
  than vLLM's; base within 1.5× of the physical floor.

GPU time: tuning ≤ `TUNE_BUDGET_S` (no new workload starts past it) for GPT-OSS-20B and Qwen3-30B-A3B
at R = 32, L = 8, T ∈ {1, 8, 64, 256, 1600, 8192}; R = 16 and 64 get R = 32's choices (rank tile adjusted;
marked `copied` in the trials CSV — not tuned). The comparison adds ≈ 1–2 minutes.

On `PROFILE = "cpu"`: tiny shapes through the Triton interpreter (1–2 candidates), outputs under
`data/cpu/`; its timings measure the interpreter, not kernels."""

PARAMS = """PROFILE = "gpu"
SEED = 0
TUNE = True
TUNE_BUDGET_S = 240"""

DERIVED = """import os

if PROFILE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
import shutil
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch

from moelora_lib import bench, configs, tuning
from moelora_lib import moe_bench as mb
from moelora_lib.kernels import STAGES

assert PROFILE in ("cpu", "gpu"), PROFILE
assert "tuned" in STAGES
if PROFILE == "gpu":
    assert torch.cuda.is_available(), "the gpu profile needs a GPU"
    assert os.environ.get("TRITON_INTERPRET", "0") == "0"
    MODELS = ["gpt-oss-20b", "qwen3-30b-a3b"]
    TOKENS = [1, 8, 64, 256, 1600, 8192]
    R, L = 32, 8
    COPY_RANKS = [16, 64]
    DEVICE, DTYPE = "cuda", torch.bfloat16
    DATA = bench.data_path()
    GPU = configs.gpu_name()
    OUT = configs.shipped_folder(GPU)            # the shipped configs are produced by this run
    TUNER_ARGS = []
    TIMING = dict(warmup_ms=10, rep_ms=40)
else:
    MODELS = ["tiny", "tiny-oss"]
    TOKENS = [1, 5]
    R, L = 16, 2
    COPY_RANKS = [32]
    DEVICE, DTYPE = "cpu", torch.float32
    DATA = bench.data_path("cpu")
    GPU = "cpu"
    OUT = DATA / "07_configs"
    TUNER_ARGS = ["--device", "cpu", "--max-bms", "1", "--max-candidates", "2"]
    TIMING = dict(warmup_ms=0, rep_ms=0)
FIG = DATA / "figures"
FIG.mkdir(parents=True, exist_ok=True)
TRIALS_CSV = DATA / "07_tuning_trials.csv"
CSV = DATA / "07_tuning.csv"
env_on_entry = os.environ.get(configs.ENV_VAR)
t_notebook = time.perf_counter()
print(bench.env_record())
print("config folder written:", OUT)"""

TUNE_MD = """## Tuning
The tuner runs in a subprocess (a fresh process: its compiled variants and memory do not mix with
the measurements below). Every tried config is appended to the trials CSV; a workload already there is
skipped (resumable); the JSON files are rewritten atomically after every workload."""

TUNE_CELL = """if PROFILE == "cpu" and TUNE:  # a fresh tiny tune every time on the CPU
    shutil.rmtree(OUT, ignore_errors=True)
    TRIALS_CSV.unlink(missing_ok=True)
if TUNE:
    cmd = [sys.executable, "-m", "moelora_lib.tuning", "--model", ",".join(MODELS), "--ranks", str(R),
           "--copy-ranks", ",".join(map(str, COPY_RANKS)), "--adapters", str(L),
           "--tokens", ",".join(map(str, TOKENS)), "--out", str(OUT), "--csv", str(TRIALS_CSV),
           "--budget-s", str(TUNE_BUDGET_S), "--no-progress", *TUNER_ARGS]
    print(" ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"tuning subprocess: {time.perf_counter() - t0:.1f} s wall")
trials = pd.read_csv(TRIALS_CSV)
tuning_s = trials[trials.kind == "session"].elapsed_s.sum()
print(f"tuning time recorded in {TRIALS_CSV.name}: {tuning_s:.1f} s over "
      f"{int((trials.kind == 'session').sum())} session(s); {int((trials.kind == 'trial').sum())} configs tried")
for op in configs.LORA_FILE_OPS:
    assert (OUT / configs.config_file_name(GPU, op)).is_file(), op
assert (OUT / configs.config_file_name(GPU, "base")).is_file()
# every workload that was tuned has four LoRA choices and two base choices
ch = trials[trials.kind == "choice"]
print(ch.groupby(["model", "group"]).T.nunique().rename("T buckets tuned").to_string())
not_tuned = trials[(trials.kind == "note") & trials.note.str.contains("workload not tuned", na=False)]
if len(not_tuned):
    print("NOT tuned (budget):", not_tuned[["model", "R", "T"]].drop_duplicates().to_dict("records"))"""

CHOICES_MD = """### What the tuner chose
One row per (model, T, group): the BLOCK_SIZE_M chosen and the sum of the per-op medians at each BM
candidate (ms; on the CPU: interpreter wall clock)."""

CHOICES = """bm = trials[trials.kind == "bm_sum"].pivot_table(index=["model", "T", "group"], columns="BLOCK_SIZE_M",
                                                   values="sum_ms", aggfunc="last")
chosen = ch.groupby(["model", "T", "group"]).BLOCK_SIZE_M.first().rename("chosen_BM")
tab = bm.join(chosen)
print(tab.round(4).to_string())
loaded = []
for m in MODELS:
    s = mb.get_shape(m)
    for T in TOKENS:
        c = configs.load_layer_config(T, s.hidden, s.intermediate, s.experts, s.top_k, R, L, s.lora_slices,
                                      folder=OUT, gpu_name=GPU)
        loaded.append(dict(model=m, T=T, source=c.source, config=c.short()))
        assert "default" not in c.source, c.source
        for Rc in COPY_RANKS:  # the copied ranks load too
            configs.load_layer_config(T, s.hidden, s.intermediate, s.experts, s.top_k, Rc, L, s.lora_slices,
                                      folder=OUT, gpu_name=GPU)
pd.DataFrame(loaded)"""

COMPARE_MD = """## Tuned vs default
Stage `even_k_fused_add` with `default_config` against stage `tuned` (configs through the loader: on
the GPU the shipped files just written, on the CPU the explicit folder), R = 32, L = 8, uniform adapter
ids, silu, no biases (vLLM's anchor setting), CUDA-graph replay, L2 flushed
(`moe_bench.bench_layer`, parts `lora`, `base`, `total`)."""

COMPARE = """rows = tuning.compare_tuned_vs_default(MODELS, TOKENS, rank=R, num_adapters=L, device=DEVICE, dtype=DTYPE,
                                       seed=SEED, folder=None if PROFILE == "gpu" else OUT, **TIMING)
bench.write_rows(CSV, rows)
df = pd.read_csv(CSV)
src = df[df.stage == "tuned"].config_source.unique()
print("config sources of the tuned rows:", src)
if PROFILE == "gpu" and not env_on_entry:
    assert (df[df.stage == "tuned"].config_source == f"shipped:{GPU}").all()
else:
    assert not df[df.stage == "tuned"].config_source.str.startswith("default").any()
assert (df[df.stage == "even_k_fused_add"].config_source == "default").all()
if PROFILE == "cpu":
    print("CPU profile: interpreter wall clock, NOT kernel performance.")
df.pivot_table(index=["model", "T"], columns=["part", "stage"], values="us_p50").round(1)"""

CHECK = """# the tuned configs compute the same layer (fp32 reference) at one small T per model
from moelora_lib.testing import TOLERANCES

checks = []
for m in MODELS:
    s = mb.get_shape(m)
    T = TOKENS[1]
    cfg = configs.load_layer_config(T, s.hidden, s.intermediate, s.experts, s.top_k, R, L, s.lora_slices,
                                    folder=OUT, gpu_name=GPU)
    checks.append(mb.check_layer("tuned", s, T, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED,
                                 config=cfg))
ck = pd.DataFrame(checks)
print(ck[["model", "T", "rel_err", "delta_rel", "no_adapter_bitwise"]].to_string(index=False))
assert (ck.rel_err <= TOLERANCES[DTYPE]).all() and ck.no_adapter_bitwise.all() and (ck.delta_rel > 0.01).all()"""

TARGETS_MD = """## Targets of issue 4, side by side with vLLM's figures on this H200
`moe_bench.anchor_table()` (../shared/notes/anchors-h200.md; best of vLLM's two implementations).
`met?` columns: True / False; empty where the target does not apply (T = 256 for the LoRA share) or
vLLM has no figure at that T (Qwen3 at T = 8, 256, 8192). On the CPU profile there are no vLLM rows."""

TARGETS = """anchors = mb.anchor_table() if PROFILE == "gpu" else None
tgt = tuning.targets_table(df, anchors)
bench.write_rows(DATA / "07_targets.csv", tgt.to_dict("records"))
tgt = pd.read_csv(DATA / "07_targets.csv")
for k, v in tuning.TARGETS.items():
    print(f"{k:18s} {v}")
cols = ["model", "T", "lora_default_us", "lora_tuned_us", "lora_speedup", "base_default_us", "base_tuned_us",
        "base_speedup", "total_default_us", "total_tuned_us", "total_speedup", "met_tuned_not_slower",
        "lora_best_us", "lora_vs_vllm_x", "met_lora_vs_vllm", "lora_share", "met_lora_share", "total_best_us",
        "total_vs_vllm_x", "met_total_vs_vllm", "base_floor_us", "base_over_floor", "met_base_vs_floor"]
tgt[cols].round(3)"""

PEROP_MD = """### Where the time goes where a target is missed
Each of the six launches of the tuned layer timed alone (graph mode), with the achieved TB/s (bytes
read + written, minimal) and TFLOP/s against the floors (4.3 TB/s copy, 675 TFLOP/s bf16 dense)."""

PEROP = """met_cols = [c for c in tgt.columns if c.startswith("met_")]
missed = tgt[tgt[met_cols].apply(lambda r: any(v is False or v == False for v in r if pd.notna(v)), axis=1)]
if PROFILE == "cpu":
    missed = tgt.head(1)  # exercise the code path only
per_op = []
for m in MODELS:
    Ts = missed[missed.model == m]["T"].astype(int).tolist()
    if not Ts:
        continue
    s = mb.get_shape(m)
    w = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=False)
    for T in Ts:
        per_op += tuning.op_breakdown("tuned", m, T, rank=R, num_adapters=L, device=DEVICE, dtype=DTYPE, seed=SEED,
                                      weights=w, config=configs.load_layer_config(
                                          T, s.hidden, s.intermediate, s.experts, s.top_k, R, L, s.lora_slices,
                                          folder=OUT, gpu_name=GPU), **TIMING)
    del w
if per_op:
    bench.write_rows(DATA / "07_per_op.csv", per_op)
    po = pd.read_csv(DATA / "07_per_op.csv")
    po["over_floor"] = po.us_p50 / po.floor_us
    print(po[["model", "T", "op", "config", "us_p50", "floor_us", "over_floor", "bound", "achieved_tb_s",
              "achieved_tflops"]].round(3).to_string(index=False))
else:
    print("every target met: no per-op breakdown needed")"""

FIGS = """fig, axes = plt.subplots(len(MODELS), 3, figsize=(15, 4.2 * len(MODELS)), squeeze=False)
for i, m in enumerate(MODELS):
    for j, part in enumerate(["lora", "base", "total"]):
        ax = axes[i][j]
        for st, style in [("even_k_fused_add", "o--"), ("tuned", "o-")]:
            q = df[(df.model == m) & (df.stage == st) & (df.part == part)].sort_values("T")
            ax.plot(q["T"], q.us_p50, style, ms=3, label=f"{st} ({'default' if st != 'tuned' else 'tuned'} configs)")
        if anchors is not None:
            a = anchors[anchors.model == m].sort_values("T")
            col = {"lora": "lora_best_us", "base": "base_us", "total": "total_best_us"}[part]
            ax.plot(a["T"], a[col], "k^:", label="vLLM (best)")
        q = df[(df.model == m) & (df.stage == "tuned") & (df.part == part)].sort_values("T")
        ax.plot(q["T"], q.floor_us, "k--", lw=1, label="floor")
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_xlabel("tokens T"); ax.set_ylabel("µs")
        ax.set_title(f"{m}: {part}"); ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIG / "07_tuned_vs_default.png", dpi=120)

tr = trials[(trials.kind == "trial") & (trials.ms_p50 < float("inf"))].copy()
tr["rel"] = tr.ms_p50 / tr.groupby(["model", "T", "op"]).ms_p50.transform("min")
ops = list(tr.op.unique())
fig2, ax = plt.subplots(figsize=(10, 4))
for k, op in enumerate(ops):
    q = tr[tr.op == op]
    ax.scatter(k + (q["T"].rank(method="dense") - 1) * 0.05, q.rel, s=8, alpha=0.6)
ax.set_xticks(range(len(ops))); ax.set_xticklabels(ops, rotation=20); ax.set_yscale("log")
ax.set_ylabel("trial time / best of (model, T, op)"); ax.set_title("spread of the tried configs")
fig2.tight_layout()
fig2.savefig(FIG / "07_tuning_trials.png", dpi=120)"""

CONCL = """df = pd.read_csv(CSV)
tgt = pd.read_csv(DATA / "07_targets.csv")
trials = pd.read_csv(TRIALS_CSV)
print(f"tuning took {trials[trials.kind == 'session'].elapsed_s.sum():.1f} s in total "
      f"({int((trials.kind == 'trial').sum())} configs timed); ranks {COPY_RANKS} copied from R={R} (not tuned)")
for _, r in tgt.iterrows():
    print(f"{r.model:14s} T={int(r['T']):5d}: LoRA {r.lora_default_us:9.1f} -> {r.lora_tuned_us:9.1f} µs "
          f"({r.lora_speedup:.2f}x), base {r.base_default_us:9.1f} -> {r.base_tuned_us:9.1f} ({r.base_speedup:.2f}x), "
          f"total {r.total_default_us:9.1f} -> {r.total_tuned_us:9.1f} ({r.total_speedup:.2f}x)")
for c in [c for c in tgt.columns if c.startswith("met_")]:
    v = tgt[c].dropna()
    print(f"{c:24s} met {int((v == True).sum())}/{len(v)}")
if PROFILE == "cpu":
    print("(CPU profile: interpreter times; no performance conclusion)")
print(f"notebook wall time: {time.perf_counter() - t_notebook:.0f} s")"""


CUMUL_MD = """### Cumulative table naive → tuned
Notebook 06's CSV (every stage to `even_k_fused_add`, same shapes and method) joined with this notebook's
`tuned` rows (`tuning.cumulative_table`). The two CSVs come from separate runs: ratios against the
`tuned` column are across runs."""

CUMUL = """stages_csv = DATA / "06_even_k_fused_add.csv"
if stages_csv.is_file():
    cum = tuning.cumulative_table(stages_csv, CSV)
    cum.to_csv(DATA / "07_cumulative.csv", index=False)
    print(cum.round(1).to_string(index=False))
else:
    print(f"{stages_csv} not found: run notebook 06 first for the cumulative table")"""


def main() -> None:
    nb = nbf.v4.new_notebook()
    cells = [nbf.v4.new_markdown_cell(MD1)]
    p = nbf.v4.new_code_cell(PARAMS)
    p.metadata["tags"] = ["parameters"]
    cells += [p, nbf.v4.new_code_cell(DERIVED), nbf.v4.new_markdown_cell(TUNE_MD), nbf.v4.new_code_cell(TUNE_CELL),
              nbf.v4.new_markdown_cell(CHOICES_MD), nbf.v4.new_code_cell(CHOICES),
              nbf.v4.new_markdown_cell(COMPARE_MD), nbf.v4.new_code_cell(COMPARE), nbf.v4.new_code_cell(CHECK),
              nbf.v4.new_markdown_cell(TARGETS_MD), nbf.v4.new_code_cell(TARGETS),
              nbf.v4.new_markdown_cell(PEROP_MD), nbf.v4.new_code_cell(PEROP), nbf.v4.new_code_cell(FIGS),
              nbf.v4.new_markdown_cell(CUMUL_MD), nbf.v4.new_code_cell(CUMUL),
              nbf.v4.new_markdown_cell("### Conclusions (read back from the CSVs)"), nbf.v4.new_code_cell(CONCL)]
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbf.validate(nb)
    path = ROOT / "notebooks" / "07_tuning.ipynb"
    nbf.write(nb, str(path))
    print("wrote", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
