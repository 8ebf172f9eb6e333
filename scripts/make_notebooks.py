"""Generate the stage notebooks (notebooks/NN_*.ipynb) from the cell sources below.

    python scripts/make_notebooks.py            # writes every notebook
    python scripts/make_notebooks.py 01 02      # only those

Committed notebooks carry no outputs; papermill runs them with ``-p PROFILE cpu|gpu``. Conventions
(DESIGN.md §6): cell 1 markdown (what the stage changes and what should move), cell 2 the
``parameters`` cell with literals only, cell 3 the values derived from the profile; imports from
moelora_lib only, checks are asserts, conclusions are printed from the CSV the notebook just wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"

# --------------------------------------------------------------------------------------------------
# shared cells
# --------------------------------------------------------------------------------------------------


def setup_cell(nn: str, cpu: str, gpu: str, extra_imports: str = "") -> str:
    """Cell 3: derive values from PROFILE. Sets TRITON_INTERPRET before moelora_lib is imported."""
    return f'''# Derived values (papermill does not recompute these): small shapes through the Triton
# interpreter on "cpu", the real presets in bf16 on "gpu".
import os
assert PROFILE in ("cpu", "gpu"), PROFILE
if PROFILE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of moelora_lib

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm

from moelora_lib import bench
from moelora_lib import moe_bench as mb
{extra_imports}
torch.manual_seed(SEED)
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 30)
if PROFILE == "cpu":
    DEVICE, DTYPE = "cpu", torch.float32  # bf16 is wrong under the interpreter
{cpu}
    DATA = bench.data_path("cpu")  # CPU smoke runs never overwrite GPU evidence
else:
    assert torch.cuda.is_available(), "PROFILE='gpu' needs a CUDA GPU"
    DEVICE, DTYPE = "cuda", torch.bfloat16
{gpu}
    DATA = bench.data_path()
FIG = DATA / "figures"
FIG.mkdir(parents=True, exist_ok=True)
ENV = bench.save_env(bench.data_path("env", "{nn}_" + PROFILE + ".json"))
print({{k: ENV[k] for k in ("gpu", "torch", "triton", "git_commit")}}, DEVICE, DTYPE)'''


def params(src: str) -> nbformat.NotebookNode:
    c = new_code_cell(src)
    c.metadata["tags"] = ["parameters"]
    return c


def build(cells: list) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [new_markdown_cell(c[3:]) if isinstance(c, str) and c.startswith("md:") else
                (c if not isinstance(c, str) else new_code_cell(c)) for c in cells]
    return nb


NOTEBOOKS: dict[str, callable] = {}


def notebook(name: str):
    def deco(fn):
        NOTEBOOKS[name] = fn
        return fn
    return deco


# --------------------------------------------------------------------------------------------------
# 01 — the math contract, FLOPs and bytes, reference checks
# --------------------------------------------------------------------------------------------------


@notebook("01_moe_lora_math")
def nb01():
    return build([
        '''md:# 01 — MoE + multi-LoRA: the math, the shapes, the costs

**What this notebook establishes.** The contract every kernel stage computes (DESIGN.md §4), the layer
shapes of the model presets, and what each of the six launches of one layer costs in FLOPs and bytes.
The point to carry into the later stages: the four LoRA ops are *thin* GEMMs — one side is the rank
R = 32, against H = 2880 or 2I = 5760 on the other — so their arithmetic intensity is bounded by about
R FLOP/byte however many tokens share an adapter, far below the H200's ~675 TFLOP/s ÷ 4.3 TB/s
≈ 157 FLOP/byte ridge. They are memory- and latency-bound at every T, while the base GEMMs become
compute-bound once enough tokens share an expert (GPT-OSS-20B: T ≈ 1600). Expected numbers (checked
below from the CSV): at T = 1 the base layer streams ~200 MB of expert weights (≈ 46 µs at 4.3 TB/s)
and the LoRA part ~3.7 MB (≈ 1 µs) — its cost is launches and latency, not bytes.

**Shape letters.** T tokens, H hidden, I intermediate per expert, E experts, K top-k, L adapter slots,
R max rank, S gate_up slices (2 = gate and up adapters, 1 = one fused 2I slice as GPT-OSS's 3-D
adapters). P = T·K (token, expert) pairs.

**The contract.** For token t with adapter a = lora_ids[t] (−1: none) and each routed expert
e = topk_ids[t, k] with weight w = topk_weights[t, k]:

| step | formula | shapes |
|---|---|---|
| gate_up | h = x·W13[e]ᵀ (+ b13[e]) + [a ≥ 0]·concat_s((x·A13[a,e,s]ᵀ)·B13[a,e,s]ᵀ) | x [H], W13 [E, 2I, H], A13 [L, E, S, R, H], B13 [L, E, S, 2I/S, R] |
| act | silu(gate)·up, or GPT-OSS swigluoai (interleaved, clamp 7, α = 1.702, up + 1) | [2I] → [I] |
| down | y = g·W2[e]ᵀ (+ b2[e]) + [a ≥ 0]·(g·A2[a,e]ᵀ)·B2[a,e]ᵀ | W2 [E, H, I], A2 [L, E, R, I], B2 [L, E, H, R] |
| combine | out[t] = Σ_k w·y | [T, H] |

The LoRA delta of gate_up is added *before* the activation; the routing weight is applied once; the
scaling α/r is folded into B at load time. The four LoRA ops: **gate_up_shrink** [P, H]·[H, S·R],
**gate_up_expand** [P, R]·[R, 2I], **down_shrink** [P, I]·[I, R], **down_expand** [P, R]·[R, H] —
each over the pairs grouped by (adapter, expert).
''',
        params('''PROFILE = "gpu"
SEED = 0
COST_MODELS = ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"]
COST_TOKENS = [1, 64, 1600]
RANK = 32
ADAPTERS = 8'''),
        setup_cell("01", cpu='''    CHECK_MODELS, CHECK_TOKENS, CHECK_RANK, CHECK_ADAPTERS = ["tiny", "tiny-oss"], [1, 5, 33], 16, 4''',
                   gpu='''    CHECK_MODELS, CHECK_TOKENS, CHECK_RANK, CHECK_ADAPTERS = ["tiny", "tiny-oss"], [1, 5, 33], 16, 4''',
                   extra_imports="from moelora_lib import reference, routing, shapes, workloads\nfrom moelora_lib.testing import rel_err"),
        '''md:## The presets
Values from each model's published `config.json` (see `moelora_lib/shapes.py`). `expert_MB` is one
expert's w13 + w2 in bf16.''',
        '''preset_rows = [dict(model=s.name, H=s.hidden, I=s.intermediate, E=s.experts, K=s.top_k, layers=s.layers,
                    activation=s.activation, bias=s.has_bias, renormalize=s.renormalize, S=s.lora_slices,
                    expert_MB=s.expert_weight_bytes(2) / 1e6)
               for s in shapes.PRESETS.values()]
presets = bench.write_rows(DATA / "01_presets.csv", preset_rows)
presets''',
        '''md:## FLOPs, bytes and arithmetic intensity of the six launches
`moe_bench.op_costs` counts 2 FLOPs per multiply-add and the minimal bytes: the weights of the experts
(and (adapter, expert) pairs) touched, activations read and written once, the fp32 rank intermediate.
Touched experts are estimated as min(E, T·K), touched LoRA pairs as min(L·E, T·K) with L = 8 (every
token with an adapter). `floor_us` is the larger of bytes at 4.3 TB/s and FLOPs at 675 TFLOP/s.''',
        '''cost_rows = [dict(r, L=ADAPTERS) for m in COST_MODELS for T in COST_TOKENS
             for r in mb.op_costs(m, T, RANK, dtype_bytes=2, num_adapters=ADAPTERS)]
bench.write_rows(DATA / "01_op_costs.csv", cost_rows)
costs = pd.read_csv(DATA / "01_op_costs.csv")
costs["GFLOP"] = costs.flops / 1e9
costs["MB"] = costs.bytes / 1e6
costs.pivot_table(index=["model", "T"], columns="op", values="intensity", sort=False).round(1)''',
        '''costs[["model", "T", "op", "GFLOP", "MB", "intensity", "floor_us", "bound"]].round(3)''',
        '''fig, axes = plt.subplots(1, len(COST_TOKENS), figsize=(5 * len(COST_TOKENS), 4), sharey=True)
ops = ["base_gate_up", "base_down", "gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]
for ax, T in zip(axes, COST_TOKENS):
    sub = costs[costs["T"] == T].pivot_table(index="op", columns="model", values="intensity").loc[ops]
    sub.plot.bar(ax=ax, logy=True, legend=(T == COST_TOKENS[0]))
    ax.axhline(bench.H200_BF16_TFLOPS / bench.H200_COPY_TB_PER_S, color="k", ls="--", lw=1)
    ax.set_title(f"T = {T}  (dashed: H200 ridge)")
    ax.set_ylabel("FLOP / byte")
fig.tight_layout()
fig.savefig(FIG / "01_intensity.png", dpi=120)''',
        '''md:### What the table says (numbers read back from `01_op_costs.csv`)''',
        '''ridge = bench.H200_BF16_TFLOPS / bench.H200_COPY_TB_PER_S
lora_ops = ["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]
for m in ["gpt-oss-20b", "qwen3-30b-a3b"]:
    if m not in COST_MODELS:
        continue
    c = costs[costs.model == m]
    for T in COST_TOKENS:
        ct = c[c["T"] == T].set_index("op")
        base_mb = ct.loc[["base_gate_up", "base_down"], "MB"].sum()
        lora_mb = ct.loc[lora_ops, "MB"].sum()
        print(f"{m:14s} T={T:5d}: base GEMMs move {base_mb:8.1f} MB (floor {ct.loc[['base_gate_up', 'base_down'], 'floor_us'].sum():7.1f} µs, "
              f"intensity {ct.loc['base_gate_up', 'intensity']:6.1f} FLOP/B); LoRA ops move {lora_mb:6.1f} MB "
              f"(floor {ct.loc[lora_ops, 'floor_us'].sum():6.1f} µs), max LoRA intensity "
              f"{ct.loc[lora_ops, 'intensity'].max():5.1f} FLOP/B vs ridge {ridge:.0f}")
assert (costs[costs.op.isin(lora_ops)].intensity < ridge).all(), "a LoRA op is compute-bound?"
assert (costs[costs.op.isin(lora_ops)].bound == "memory").all()
big = costs[(costs.model == "gpt-oss-20b") & (costs["T"] == max(COST_TOKENS)) & (costs.op == "base_gate_up")]
if len(big):
    print(f"gpt-oss-20b base_gate_up at T={max(COST_TOKENS)} is {big.bound.iloc[0]}-bound "
          f"(intensity {big.intensity.iloc[0]:.0f} FLOP/B)")''',
        '''md:Why the LoRA ops stay thin: a shrink over m rows reads m·H activations and R·H weights and does
2·m·H·R FLOPs, so its intensity is ≤ 2·m·R/(2(m + R)) < R FLOP/byte (bf16) for any m; the expand is
the same with H replaced by the output width. With R = 32 that is at most ~32 FLOP/byte — about a
fifth of the H200's ridge — so the LoRA part can only be as fast as its bytes and launches. At decode
sizes the bytes are tiny (see T = 1 above), so the LoRA part is bound by launch latency and by how
many SMs the few (adapter, expert) tiles can keep busy: the motivation for split-K (notebook 04)
and fewer launches (notebook 06).''',
        '''md:## Reference checks
1. `moe_lora_reference` (vectorized fp32) against `moe_lora_loop_reference` (independent per-token loop
   in float64) on tiny shapes, silu and swigluoai with biases, ranks padded, mixed adapter ids.
2. Tokens with lora id −1 get exactly the base MoE (reference with no adapters at all).
3. Routing: `route` against `route_reference`.
4. Alignment invariants on an example.''',
        '''check_rows = []
for m in tqdm(CHECK_MODELS, desc="reference vs loop"):
    for T in CHECK_TOKENS:
        inp = workloads.make_inputs(shapes.get_shape(m), T, rank=CHECK_RANK, num_adapters=CHECK_ADAPTERS,
                                    pattern="mixed", true_rank=CHECK_RANK - 4, dtype=torch.float32,
                                    device=DEVICE, seed=SEED, act_scale=4.0)
        ref = reference.moe_lora_reference(*inp.args(), **inp.kwargs())
        loop = reference.moe_lora_loop_reference(*inp.args(), **inp.kwargs())
        base = reference.moe_lora_reference(inp.hidden_states, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                            torch.full_like(inp.lora_ids, -1), None, None, None, None,
                                            **inp.kwargs())
        none = (inp.lora_ids == -1).cpu()
        check_rows.append(dict(check="reference_vs_loop", model=m, T=T, device=DEVICE,
                               value=rel_err(ref.cpu(), loop), no_adapter_rows=int(none.sum()),
                               no_adapter_max_abs=float((ref.cpu()[none] - base.cpu()[none]).abs().max())
                               if none.any() else 0.0))''',
        '''g = torch.Generator().manual_seed(SEED)
for m in CHECK_MODELS + ["qwen3-30b-a3b", "deepseek-v2-lite"]:
    s = shapes.get_shape(m)
    logits = torch.randn(257, s.experts, generator=g).to(DEVICE)
    w, ids = routing.route(logits, s.top_k, s.renormalize)
    w_ref, ids_ref = reference.route_reference(logits, s.top_k, s.renormalize)
    check_rows.append(dict(check="route_vs_reference", model=m, T=257, device=DEVICE,
                           value=float((w - w_ref).abs().max()), ids_equal=bool(torch.equal(ids, ids_ref))))''',
        '''# Alignment on an example: 13 tokens, top-2 of 4 experts, 3 adapters and some tokens without one.
T_EX, E_EX, K_EX, L_EX, BM = 13, 4, 2, 3, 16
g = torch.Generator().manual_seed(SEED + 1)
topk_ex = torch.stack([torch.randperm(E_EX, generator=g)[:K_EX] for _ in range(T_EX)]).to(torch.int32).to(DEVICE)
lora_ex = workloads.adapter_ids(T_EX, L_EX, "mixed", g).to(DEVICE)
al = routing.align_tokens(topk_ex, E_EX, BM, lora_ids=lora_ex, num_adapters=L_EX)
sorted_ids = al.sorted_token_ids.cpu()
used = int(al.num_tokens_post_padded.item())
real = sorted_ids[:used][sorted_ids[:used] < al.num_pairs]
want = torch.tensor([p for p in range(T_EX * K_EX) if int(lora_ex[p // K_EX]) >= 0])
once = bool(torch.equal(real.sort().values, want))
pad_ok = bool(((sorted_ids < al.num_pairs) | (sorted_ids == al.num_pairs)).all())
blocks_ok = True
for b in range(used // BM):
    rows = sorted_ids[b * BM:(b + 1) * BM]
    rows = rows[rows < al.num_pairs]
    e_b, l_b = int(al.block_expert_ids[b]), int(al.block_lora_ids[b])
    blocks_ok &= bool(len(rows) > 0 and (topk_ex.reshape(-1).cpu()[rows] == e_b).all()
                      and (lora_ex.cpu()[rows // K_EX] == l_b).all())
check_rows.append(dict(check="alignment_each_pair_once", model="example", T=T_EX, device=DEVICE, value=float(once)))
check_rows.append(dict(check="alignment_padding_is_sentinel", model="example", T=T_EX, device=DEVICE, value=float(pad_ok)))
check_rows.append(dict(check="alignment_block_ids", model="example", T=T_EX, device=DEVICE,
                       value=float(blocks_ok and used % BM == 0)))
print("pairs with an adapter:", want.numel(), "of", T_EX * K_EX, "| blocks in use:", used // BM,
      "| buffer blocks:", al.num_blocks, "| sentinel:", al.num_pairs)
print("block expert ids:", al.block_expert_ids[: used // BM].tolist())
print("block lora ids:  ", al.block_lora_ids[: used // BM].tolist())''',
        '''bench.write_rows(DATA / "01_checks.csv", [bench.result_row(**r) for r in check_rows])
checks = pd.read_csv(DATA / "01_checks.csv")
print(checks[[c for c in ["check", "model", "T", "device", "value", "no_adapter_rows", "no_adapter_max_abs",
                          "ids_equal"] if c in checks]].to_string(index=False))
ref_loop = checks[checks.check == "reference_vs_loop"]
assert (ref_loop.value <= 1e-5).all(), "vectorized reference disagrees with the loop"
assert (ref_loop.no_adapter_max_abs == 0).all(), "-1 rows differ from the base MoE"
assert (ref_loop.no_adapter_rows > 0).any(), "no case exercised -1 tokens"
rt = checks[checks.check == "route_vs_reference"]
assert (rt.value <= 1e-6).all() and rt.ids_equal.all()
assert (checks[checks.check.str.startswith("alignment")].value == 1.0).all()
print(f"reference vs loop: max rel_err {ref_loop.value.max():.2e} over {len(ref_loop)} cases; "
      f"-1 rows identical to the base MoE in {int((ref_loop.no_adapter_rows > 0).sum())} cases with such tokens; "
      f"routing max |Δw| {rt.value.max():.1e}; alignment invariants hold.")''',
    ])


# --------------------------------------------------------------------------------------------------
# 02 — the naive stage
# --------------------------------------------------------------------------------------------------


@notebook("02_naive_kernel")
def nb02():
    return build([
        """md:# 02 — The naive fused MoE-LoRA kernels

**What this stage is.** The first Triton implementation of the layer (stage `naive`): a base grouped
GEMM for w13 and w2 over expert-sorted pairs, and the four LoRA ops — shrink and expand for gate_up and
for down — over (adapter, expert)-sorted pairs, each expand writing a zeroed delta buffer that a
separate add puts into the base output (six extra launches: 4 ops + 2 zero-fills + 2 adds). Triton's
default integer specialization is kept (notebook 03 fixes the recompiles it causes).

**What to expect.** Correct against the fp32 reference within the bf16 tolerance of
`moelora_lib.testing.TOLERANCES` at model shapes, and tokens without an adapter bit-identical to the
base MoE. Timing (H200, CUDA-graph replay, L2 flushed, median — the method of vLLM's anchor figures in
`shared/notes/anchors-h200.md`): the base MoE should sit near its weight-streaming floor at decode sizes
(GPT-OSS-20B T = 1: ≈ 46 µs floor, vLLM 82 µs); the LoRA part moves only ~4 MB at T = 1 (≈ 1 µs of
bandwidth), so anything above a few µs per launch is latency — expect the naive LoRA part to be
*slower* than vLLM's best (50 µs at T = 1 for GPT-OSS-20B, 30 µs for Qwen3) because of the extra
launches and the few programs of the shrink; the later stages attack exactly that.

For the side-by-side with vLLM, GPT-OSS-20B runs as the anchor did: silu(gate)·up and no expert biases
(`variant = "as_anchor"`); the real GPT-OSS swigluoai + biases are timed in separate rows
(`variant = "real"`).""",
        params("""PROFILE = "gpu"
SEED = 0
MODELS = ["gpt-oss-20b", "qwen3-30b-a3b"]
TOKENS = [1, 8, 64, 256, 1600, 8192]
CHECK_TOKENS = [1, 13, 48]
EAGER_MAX_T = 64
RANK = 32
ADAPTERS = 8
PATTERN = "uniform\""""),
        setup_cell("02",
                   cpu="""    CPU_MODEL = {"gpt-oss-20b": "tiny-oss", "qwen3-30b-a3b": "tiny"}
    MODELS_RUN = [CPU_MODEL[m] for m in MODELS]
    TOKENS_RUN, CHECK_TOKENS_RUN, R, L = [1, 17], [1, 33], 16, 4""",
                   gpu="""    MODELS_RUN, TOKENS_RUN, CHECK_TOKENS_RUN, R, L = MODELS, TOKENS, CHECK_TOKENS, RANK, ADAPTERS""",
                   extra_imports="from moelora_lib import shapes\nfrom moelora_lib.testing import TOLERANCES"),
        """md:## Correctness against the fp32 reference
`moe_bench.check_layer`: one call of the stage vs `moe_lora_reference` on the same inputs (adapter
pattern `mixed`: every slot plus tokens without an adapter), rel_err = max|out − ref| / max|ref|;
`delta_rel` shows the LoRA contribution is large (so a pass is not a missing delta); and the rows of
tokens with lora id −1 compared bitwise with the base-only output of the same kernels.""",
        """CSV_CHECK = DATA / "02_naive_checks.csv"
check_rows = []
for m in tqdm(MODELS_RUN, desc="check"):
    s = shapes.get_shape(m)
    weights = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED,
                              bias=True)  # one set of weights; variants drop the biases / change act
    variants = [("real", None, s.has_bias)] + ([("as_anchor", "silu", False)] if s.has_bias else [])
    for variant, act, bias in variants:
        for T in CHECK_TOKENS_RUN:
            r = mb.check_layer("naive", s, T, rank=R, num_adapters=L, pattern="mixed", dtype=DTYPE,
                               device=DEVICE, seed=SEED, activation=act, bias=bias, weights=weights)
            check_rows.append(bench.result_row(**r, variant=variant, tol=TOLERANCES[DTYPE]))
    del weights
bench.write_rows(CSV_CHECK, check_rows)
checks = pd.read_csv(CSV_CHECK)
print(checks[["model", "variant", "activation", "bias", "T", "dtype", "rel_err", "tol", "delta_rel",
              "no_adapter_rows", "no_adapter_bitwise"]].to_string(index=False))
assert (checks.rel_err <= checks.tol).all(), checks[checks.rel_err > checks.tol]
if PROFILE == "cpu":
    assert (checks.rel_err <= 1e-4).all()  # fp32 through the interpreter
assert checks.no_adapter_bitwise.all()
assert (checks.no_adapter_rows > 0).any()
assert (checks.delta_rel > 0.05).all()
print(f"max rel_err {checks.rel_err.max():.2e} (tolerance {checks.tol.max():.1e}); -1 rows bitwise equal "
      f"to the base MoE in all {len(checks)} cases ({int(checks.no_adapter_rows.sum())} such rows).")""",
        """md:## Timing: base MoE, LoRA part, whole layer
`moe_bench.bench_layer` per (model, variant, T): parts `base` (the MoE layer without LoRA), `lora`
(the four LoRA ops with their delta buffers and adds), `total` (the whole layer); CUDA-graph replay for
every T, eager calls too (labelled `mode = eager`) for T ≤ 64. On the CPU profile the times are
Triton-interpreter wall clock (`mode = cpu-interpreter`): they check that the code runs, nothing more.""",
        """CSV = DATA / "02_naive_kernel.csv"
rows = []
for m in MODELS_RUN:
    s = shapes.get_shape(m)
    weights = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=True)
    variants = [("as_anchor", "silu", False)] + ([("real", None, True)] if s.has_bias else [])
    for variant, act, bias in variants:
        for T in tqdm(TOKENS_RUN, desc=f"{m} {variant}"):
            modes = ("graph", "eager") if T <= EAGER_MAX_T else ("graph",)
            for r in mb.bench_layer("naive", s, T, rank=R, num_adapters=L, pattern=PATTERN, dtype=DTYPE,
                                    device=DEVICE, modes=modes, seed=SEED, activation=act, bias=bias,
                                    weights=weights):
                r["variant"] = variant
                rows.append(r)
    del weights
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
bench.write_rows(CSV, rows)
df = pd.read_csv(CSV)
if PROFILE == "cpu":
    print("CPU profile: interpreter wall clock, NOT kernel performance.")
wide = df.pivot_table(index=["model", "variant", "mode", "T"], columns="part", values="us_p50", sort=False)
floors = df.pivot_table(index=["model", "variant", "mode", "T"], columns="part", values="floor_us", sort=False)
wide["overhead_lora_over_base"] = wide["lora"] / wide["base"]
wide["floor_total_us"] = floors["total"]
wide["total_over_floor"] = wide["total"] / floors["total"]
wide.round(2)""",
        """md:## Side by side with vLLM on the same H200
vLLM's figures (`moe_bench.anchor_table()`, from `shared/notes/anchors-h200.md`): best of its two LoRA
implementations; same method (CUDA-graph replay, L2 flushed, do_bench median), same shapes (GPT-OSS-20B
with silu and no biases). `ratio` > 1 means we are slower. Only the GPU profile has meaningful values;
on the CPU profile the tiny models do not match any anchor row.""",
        """anchors = mb.anchor_table()
ours = df[(df.variant == "as_anchor") & (df["mode"] == df["mode"].iloc[0])].pivot_table(
    index=["model", "T"], columns="part", values="us_p50").reset_index()
side = ours.merge(anchors, on=["model", "T"], how="left")
side["lora_ratio"] = side["lora"] / side["lora_best_us"]
side["total_ratio"] = side["total"] / side["total_best_us"]
side["base_ratio"] = side["base"] / side["base_us"]
side[["model", "T", "base", "base_us", "base_ratio", "lora", "lora_best_us", "lora_ratio", "total",
      "total_best_us", "total_ratio"]].round(2)""",
        """fig, axes = plt.subplots(1, len(MODELS_RUN), figsize=(6 * len(MODELS_RUN), 4.5), squeeze=False)
for ax, m in zip(axes[0], MODELS_RUN):
    d = df[(df.model == m) & (df.variant == "as_anchor") & (df["mode"] == df["mode"].iloc[0])]
    for part, style in [("base", "o-"), ("lora", "s-"), ("total", "^-")]:
        dp = d[d.part == part].sort_values("T")
        ax.plot(dp["T"], dp.us_p50, style, label=f"naive {part}")
    dt = d[d.part == "total"].sort_values("T")
    ax.plot(dt["T"], dt.floor_us, "k--", lw=1, label="bytes/FLOP floor (total)")
    a = anchors[anchors.model == m]
    if len(a):
        ax.plot(a["T"], a.lora_best_us, "s:", color="gray", label="vLLM LoRA (best)")
        ax.plot(a["T"], a.total_best_us, "^:", color="gray", label="vLLM total (best)")
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel("tokens T"); ax.set_ylabel("µs" if PROFILE == "gpu" else "interpreter ms x1e3")
    ax.set_title(f"{m} ({d['mode'].iloc[0]})")
    ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIG / "02_naive_times.png", dpi=120)

fig, ax = plt.subplots(figsize=(6, 4))
for (m, v), d in wide.reset_index().groupby(["model", "variant"]):
    d = d[d["mode"] == d["mode"].iloc[0]].sort_values("T")
    ax.plot(d["T"], d.overhead_lora_over_base, "o-", label=f"{m} {v}")
ax.set_xscale("log"); ax.set_xlabel("tokens T"); ax.set_ylabel("LoRA part / base MoE")
ax.legend(fontsize=8); fig.tight_layout()
fig.savefig(FIG / "02_naive_overhead.png", dpi=120)""",
        """md:### Conclusions (numbers read back from `02_naive_kernel.csv`)""",
        """df = pd.read_csv(CSV)
g = df[df["mode"] == ("graph" if PROFILE == "gpu" else "cpu-interpreter")]
for (m, v), d in g.groupby(["model", "variant"], sort=False):
    p = d.pivot_table(index="T", columns="part", values="us_p50")
    fl = d[d.part == "total"].set_index("T").floor_us
    for T in p.index:
        a = anchors[(anchors.model == m) & (anchors["T"] == T)]
        vs = (f" | vLLM best LoRA {a.lora_best_us.iloc[0]:.1f}, total {a.total_best_us.iloc[0]:.1f}"
              if len(a) and v == "as_anchor" else "")
        print(f"{m:14s} {v:9s} T={T:5d}: base {p.loc[T, 'base']:9.1f}  LoRA {p.loc[T, 'lora']:9.1f}  "
              f"total {p.loc[T, 'total']:9.1f} µs  (LoRA/base {p.loc[T, 'lora'] / p.loc[T, 'base']:.2f}, "
              f"floor {fl.loc[T]:.1f}){vs}")
if PROFILE == "gpu":
    e = df[df["mode"] == "eager"].pivot_table(index=["model", "variant", "T"], columns="part", values="us_p50")
    gr = g.pivot_table(index=["model", "variant", "T"], columns="part", values="us_p50").loc[e.index]
    print("eager / graph (launch overhead at small T):")
    print((e / gr).round(2).to_string())
    assert (g.us_p50 > 0).all() and (g.us_p50 >= 0.5 * g.floor_us).all(), "faster than the physical floor?"
""",
    ])


# --------------------------------------------------------------------------------------------------
# 03 — no_recompile
# --------------------------------------------------------------------------------------------------


@notebook("03_no_recompile")
def nb03():
    return build([
        """md:# 03 — No recompilation per prompt length (stage `no_recompile`)

**What changes.** Triton specializes integer kernel arguments: a value of 1 becomes a constant and a
multiple of 16 gets a divisibility hint, each combination a separate binary. Arguments that follow the
prompt length — the number of pairs T·K, the number of alignment blocks, the stride of the rank
intermediate (T·K·R), the activation's row count — therefore compile new binaries as new lengths
arrive; upstream vLLM saw TTFT 10× worse than the base model for this reason (PR #27445). Stage
`no_recompile` marks them `do_not_specialize`.

**What should move.** With one fixed launch config, `naive` compiles up to one binary per
specialization class of each length argument (predicted below, from Triton's own specialization
function), `no_recompile` exactly one per kernel. First-call latency of a length in a new class drops
from compile time (~0.1–1 s per binary on the GPU) to launch time; warm-call latency is unchanged.""",
        params("""PROFILE = "gpu"
SEED = 0
MODEL = "gpt-oss-20b"
N_LENGTHS = 24
RANK = 32
ADAPTERS = 8
CONFIG_T = 64"""),
        setup_cell("03", cpu="""    MODEL_RUN, R, L = "tiny", 16, 4""", gpu="""    MODEL_RUN, R, L = MODEL, RANK, ADAPTERS""",
                   extra_imports="from moelora_lib import shapes\nfrom moelora_lib.kernels import default_config"),
        """md:## Predicted variants: Triton's specialization keys of the length arguments
`moe_bench.length_spec_keys` evaluates Triton's `native_specialize_impl` on each length-dependent
argument ("" plain int, "D" multiple of 16, None = not specialized); a distinct key tuple per kernel is
a distinct binary. No GPU needed, so this runs on both profiles.""",
        """lengths = mb.log_spaced_lengths(N_LENGTHS)
assert len(lengths) >= 32 and min(lengths) >= 1 and max(lengths) <= 8192
shape = shapes.get_shape(MODEL_RUN)
cfg = default_config(CONFIG_T, shape.hidden, shape.intermediate, shape.experts, shape.top_k, R, L,
                     shape.lora_slices)
key_rows = []
for stage in ("naive", "no_recompile"):
    for T in lengths:
        for kern, key in mb.length_spec_keys(stage, shape, T, R, L, cfg).items():
            key_rows.append(dict(stage=stage, model=MODEL_RUN, T=T, kernel=kern, key=str(key)))
bench.write_rows(DATA / "03_spec_keys.csv", [bench.result_row(**r) for r in key_rows])
keys = pd.read_csv(DATA / "03_spec_keys.csv")
pred = keys.groupby(["stage", "kernel"]).key.nunique().unstack("kernel")
print(f"{len(lengths)} lengths: {lengths}")
print("predicted binaries per kernel (one fixed config):")
print(pred.to_string())
assert (pred.loc["no_recompile"] == 1).all()
assert (pred.loc["naive"] > 1).any()
keys[(keys.stage == "naive") & keys["T"].isin([1, 7, 16, 33, 64, 8192])].pivot_table(
    index="T", columns="kernel", values="key", aggfunc="first")""",
        """md:## Measured on the GPU: compiled binaries and first-call latency, in a fresh process
Per stage, `moe_bench.recompile_in_subprocess` runs `python -m moelora_lib.moe_bench recompile` with an
empty Triton cache: for each length in order (one fixed config), the first call is timed with a
synchronized wall clock (compilation included), then the median of 3 warm calls, and the binaries in
the kernels' JIT caches (`JITFunction.device_caches[dev][0]`, triton 3.6) are counted. On the CPU
profile the interpreter compiles nothing, so this part is skipped and only the prediction above stands.""",
        """CSV = DATA / "03_no_recompile.csv"
if PROFILE == "gpu":
    rows = []
    for stage in tqdm(["naive", "no_recompile"], desc="fresh processes"):
        for r in mb.recompile_in_subprocess(stage, MODEL_RUN, lengths, rank=R, num_adapters=L, seed=SEED):
            rows.append(bench.result_row(**r, call_index=len([x for x in rows if x["stage"] == stage])))
    bench.write_rows(CSV, rows)
    df = pd.read_csv(CSV)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for stage, d in df.groupby("stage"):
        d = d.sort_values("call_index")
        axes[0].plot(d.call_index, d.compiled_total, "o-", ms=3, label=stage)
        axes[1].plot(d["T"], d.first_call_ms, "o", ms=4, label=f"{stage} first call")
        axes[1].plot(d["T"], d.warm_call_ms, "x", ms=4, label=f"{stage} warm call")
    axes[0].set_xlabel("new prompt length (call order)"); axes[0].set_ylabel("compiled binaries (all kernels)")
    axes[1].set_xscale("log"); axes[1].set_yscale("log")
    axes[1].set_xlabel("prompt length T"); axes[1].set_ylabel("ms (wall clock, synchronized)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIG / "03_recompile.png", dpi=120)
else:
    print("CPU profile: the Triton interpreter compiles nothing; see the predicted variants above.")""",
        """md:### Conclusions (read back from the CSVs)""",
        """if PROFILE == "gpu":
    df = pd.read_csv(DATA / "03_no_recompile.csv")
    for stage, d in df.groupby("stage", sort=False):
        d = d.sort_values("call_index")
        later = d[d.call_index > 0]
        print(f"{stage:13s}: {d.compiled_total.iloc[0]} binaries after the first length, "
              f"{d.compiled_total.iloc[-1]} after {len(d)} lengths; first calls after the first length: "
              f"sum {later.first_call_ms.sum():.0f} ms, max {later.first_call_ms.max():.1f} ms; "
              f"warm calls median {d.warm_call_ms.median():.2f} ms")
    nr = df[df.stage == "no_recompile"].sort_values("call_index")
    nv = df[df.stage == "naive"].sort_values("call_index")
    assert nr.compiled_total.iloc[-1] == nr.compiled_total.iloc[0], "no_recompile compiled per length"
    assert nv.compiled_total.iloc[-1] > nv.compiled_total.iloc[0], "naive did not recompile?"
    measured = {k.replace("compiled_", ""): int(nv[k].iloc[-1]) for k in nv.columns if k.startswith("compiled_") and k != "compiled_total"}
    print("naive binaries per kernel, measured:", measured)
    print("naive binaries per kernel, predicted:", pred.loc["naive"].to_dict())
else:
    print("predicted binaries per kernel over", len(lengths), "lengths:")
    print(pd.read_csv(DATA / "03_spec_keys.csv").groupby(["stage", "kernel"]).key.nunique().unstack().to_string())""",
    ])


# --------------------------------------------------------------------------------------------------
# 04 — split-K shrink
# --------------------------------------------------------------------------------------------------


def sweep_nb(nn: str, title_md: str, stage: str, knob: str, values_literal: str, ops_literal: str,
             cpu_values: str, fig_name: str, csv_name: str) -> nbformat.NotebookNode:
    """Notebooks 04 and 05: sweep one OpConfig field of some LoRA ops, per op and for the LoRA part."""
    return build([
        title_md,
        params(f"""PROFILE = "gpu"
SEED = 0
MODELS = ["gpt-oss-20b", "qwen3-30b-a3b"]
TOKENS = [1, 8, 64, 1600]
VALUES = {values_literal}
OPS = {ops_literal}
RANK = 32
ADAPTERS = 8
WARMUP_MS = 10
REP_MS = 40"""),
        setup_cell(nn, cpu=f"""    CPU_MODEL = {{"gpt-oss-20b": "tiny-oss", "qwen3-30b-a3b": "tiny"}}
    MODELS_RUN, TOKENS_RUN, VALUES_RUN, R, L = [CPU_MODEL[m] for m in MODELS], [1, 17], {cpu_values}, 16, 4""",
                   gpu="""    MODELS_RUN, TOKENS_RUN, VALUES_RUN, R, L = MODELS, TOKENS, VALUES, RANK, ADAPTERS""",
                   extra_imports="import dataclasses\nfrom moelora_lib import shapes\nfrom moelora_lib.testing import rel_err"),
        f"""md:## Sweep: each op alone and the whole LoRA part, stage `{stage}`, `{knob}` ∈ VALUES
Each op is launched alone (`moe_bench.bench_lora_op`, the op's default config with `{knob}` replaced via
`dataclasses.replace`), its output compared with the value-1 output (`err_vs_1`:
max|out − out₁| / max|out₁|); the LoRA part is timed with the same replacement in all swept ops
(`moe_bench.bench_layer`, part `lora`). Graph mode, warm-up {{WARMUP_MS}} ms / rep {{REP_MS}} ms
(recorded in every row).""",
        f"""CSV = DATA / "{csv_name}"
rows = []
for m in MODELS_RUN:
    s = shapes.get_shape(m)
    weights = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=False)
    for T in tqdm(TOKENS_RUN, desc=m):
        inp = mb.layer_inputs(s, T, rank=R, num_adapters=L, pattern="uniform", weights=weights, seed=SEED,
                              activation="silu")
        run = mb.make_run("{stage}", inp)
        run()
        for op in OPS:
            ref_out = None
            for v in VALUES_RUN:
                row, out = mb.bench_lora_op("{stage}", s, T, op, run=run, op_changes={{"{knob}": v}},
                                            warmup_ms=WARMUP_MS, rep_ms=REP_MS, return_output=True)
                if ref_out is None:
                    ref_out = out
                    cfg1 = dataclasses.replace(getattr(run.cfg, op), {knob}=v)
                    again = mb.lora_op_fn(run, op, cfg1)()
                    # only a plain store (SPLIT_K = 1) promises bitwise determinism; atomics reorder sums
                    row["deterministic_repeat"] = (bool(torch.equal(out, again))
                                                   if op.endswith("shrink") and cfg1.SPLIT_K == 1 else None)
                row["err_vs_1"] = rel_err(out, ref_out)
                row["default_value"] = getattr(run.cfg, op).{knob}
                row["{knob.lower()}"] = v
                rows.append(row)
        for v in VALUES_RUN:
            cfg = run.cfg.replace(**{{op: dataclasses.replace(getattr(run.cfg, op), {knob}=v) for op in OPS}})
            for r in mb.bench_layer("{stage}", s, T, rank=R, num_adapters=L, pattern="uniform", dtype=DTYPE,
                                    device=DEVICE, config=cfg, seed=SEED, activation="silu", bias=False,
                                    weights=weights, parts=("lora",), warmup_ms=WARMUP_MS, rep_ms=REP_MS):
                r["{knob.lower()}"] = v
                rows.append(r)
        del run, inp
    del weights
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
bench.write_rows(CSV, rows)
df = pd.read_csv(CSV)
if PROFILE == "cpu":
    print("CPU profile: interpreter wall clock, NOT kernel performance.")
df.pivot_table(index=["model", "T"], columns=["part", "{knob.lower()}"], values="us_p50").round(1)""",
        f"""fig, axes = plt.subplots(len(MODELS_RUN), len(OPS) + 1, figsize=(4.2 * (len(OPS) + 1), 3.6 * len(MODELS_RUN)), squeeze=False)
for i, m in enumerate(MODELS_RUN):
    for j, part in enumerate(list(OPS) + ["lora"]):
        ax = axes[i][j]
        for T, d in df[(df.model == m) & (df.part == part)].groupby("T"):
            d = d.sort_values("{knob.lower()}")
            ax.plot(d["{knob.lower()}"], d.us_p50, "o-", label=f"T={{T}}")
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_title(f"{{m}}: {{part}}", fontsize=9); ax.set_xlabel("{knob}"); ax.set_ylabel("µs")
        ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIG / "{fig_name}", dpi=120)""",
        """md:### Conclusions (read back from the CSV)""",
        f"""df = pd.read_csv(CSV)
ops_df = df[df.part.isin(OPS)]
print(f"max err_vs_1 over all ops and values: {{ops_df.err_vs_1.max():.2e}}")
assert (ops_df[ops_df["{knob.lower()}"] == 1].err_vs_1 == 0).all()
assert ops_df.deterministic_repeat.dropna().astype(bool).all(), "SPLIT_K = 1 shrink not bitwise deterministic"
assert (ops_df.err_vs_1 <= 1e-3).all(), "error beyond the bound"
for (m, T, part), d in df.groupby(["model", "T", "part"], sort=False):
    d = d.set_index("{knob.lower()}").us_p50
    best = d.idxmin()
    default = df[(df.model == m) & (df["T"] == T) & (df.part == part)].default_value.dropna()
    dflt = f", default {{int(default.iloc[0])}}" if len(default) else ""
    print(f"{{m:14s}} T={{T:5d}} {{part:15s}}: {{d.loc[1]:8.1f}} µs at 1 -> best {{d.min():8.1f}} µs at {knob}={{best}} "
          f"({{d.loc[1] / d.min():.2f}}x{{dflt}})")""",
    ])


@notebook("04_split_k")
def nb04():
    return sweep_nb("04", """md:# 04 — Split-K for the thin shrink (stage `split_k`)

**What changes.** The shrink is [pairs, H]·[H, R] with R = 32 and H = 2880 (GPT-OSS-20B) or 2048
(Qwen3-30B-A3B): the output has only ⌈R/BLOCK_SIZE_N⌉ = 1 tile column per (adapter, expert) block, so at
decode sizes a handful of programs each walk the whole K = H loop (45 iterations of 64) while most of
the 132 SMs idle. SPLIT_K programs share one output tile, each taking every SPLIT_K-th K chunk, and
combine with relaxed fp32 atomics into a zeroed buffer (the rank intermediate is fp32 in every stage).
SPLIT_K = 1 stays a plain store and bitwise deterministic; SPLIT_K > 1 only reorders fp32 additions.

**What should move.** Shrink time at T ≤ 64 (few blocks): up to ~SPLIT_K× fewer serial K iterations,
until the extra zero-fill and atomics dominate; at T = 1600 (hundreds of blocks, the GPU already full)
little or a small loss. The expands are unchanged. Error vs SPLIT_K = 1: fp32 reassociation only,
≲ 1e-6 relative.""", "split_k", "SPLIT_K", "[1, 2, 4, 8, 16]", '["gate_up_shrink", "down_shrink"]',
                    "[1, 2, 4]", "04_split_k.png", "04_split_k.csv")


@notebook("05_swizzle")
def nb05():
    nb = sweep_nb("05", """md:# 05 — Grouped program order / CTA swizzle (stage `swizzle`)

**What changes.** Programs are reordered in groups of GROUP_SIZE_M row blocks (Triton matmul tutorial,
"L2 cache optimizations"): consecutive programs visit GROUP_SIZE_M M-blocks for one N column before
moving on, so a weight tile read from HBM is reused from L2 by its neighbours. The last group may be
partial. In the LoRA ops the blocks of one (adapter, expert) group share one weight matrix, so the gain
needs several blocks per group (large T) and an N dimension of several tiles (the expands: 2I/S or H
wide); the shrinks have one N tile (R = 32), where grouping changes nothing.

**What should move.** Expand time at T = 1600 (≈ 25 rows per (adapter, expert) group at 8 adapters) by
a few percent at most; nothing at decode sizes. Where `ncu` can read counters, the L2 hit rate of the
shrink for GROUP_SIZE_M 1 vs 8 is reported (with `--clock-control none`).""", "swizzle", "GROUP_SIZE_M",
                  "[1, 2, 4, 8, 16]", '["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]',
                  "[1, 4]", "05_swizzle.png", "05_swizzle.csv")
    nb.cells.extend([
        new_markdown_cell("""## L2 hit rate with ncu (GPU only)
`moe_bench.ncu_l2_hit_rate` profiles a subprocess that launches the gate_up shrink of stage `swizzle`
with `ncu --clock-control none --metrics lts__t_sector_hit_rate.pct`; when ncu is missing or may not
read the counters, the row says so."""),
        new_code_cell("""NCU_CSV = DATA / "05_ncu_l2.csv"
ncu_rows = []
if PROFILE == "gpu":
    import shutil
    print("ncu:", shutil.which("ncu"))
    for T in [64, 1600]:
        for gsm in [1, 8]:
            r = mb.ncu_l2_hit_rate(MODELS_RUN[0], T, gsm, rank=R, num_adapters=L, seed=SEED)
            ncu_rows.append(bench.result_row(model=MODELS_RUN[0], T=T, op="gate_up_shrink", group_size_m=gsm, **r))
else:
    ncu_rows.append(bench.result_row(model="-", T=0, op="gate_up_shrink", group_size_m=0, ok=False,
                                     l2_hit_pct=float("nan"), launches=0, message="cpu profile: no ncu"))
bench.write_rows(NCU_CSV, ncu_rows)
ncu = pd.read_csv(NCU_CSV)
print(ncu[["model", "T", "group_size_m", "ok", "l2_hit_pct", "launches", "message"]].to_string(index=False))
if not ncu.ok.any():
    print("L2 hit rate not available on this machine:", ncu.message.iloc[0])"""),
    ])
    return nb


# --------------------------------------------------------------------------------------------------
# 06 — EVEN_K + fused add, and the cumulative table
# --------------------------------------------------------------------------------------------------


@notebook("06_even_k_fused_add")
def nb06():
    return build([
        """md:# 06 — EVEN_K and the fused LoRA add (stage `even_k_fused_add`), and the cumulative table

**What changes.** (1) EVEN_K: when K % (BLOCK_SIZE_K·SPLIT_K) == 0 the LoRA K loops load without
masks (rows/columns clamped into range instead); otherwise the masked path stays (GPT-OSS K = 2880 with
BLOCK_SIZE_K 64 and SPLIT_K 4 is not even, 2048 is). (2) Fused add: the expand adds its delta into the
base output tile it already holds — no zeroed delta buffer, no separate add kernel: per layer two
zero-fills and two adds fewer (4 launches, and 2·P·(2I + H) elements of traffic: at GPT-OSS-20B
T = 8192 about 2 × 32768 × 8640 × 2 B ≈ 1.1 GB, ≈ 0.26 ms at 4.3 TB/s).

**What should move.** The LoRA part at every T (fewer launches at decode sizes; less traffic at
prefill sizes), most at T = 8192. Then the cumulative table naive → no_recompile → split_k → swizzle →
even_k_fused_add for both models, R = 32, 8 adapters, uniform and zipf ids, against vLLM's figures on the
same H200, with the targets of issue 3: the final LoRA part faster than vLLM's best LoRA path at every
T, and the whole layer faster than vLLM's whole layer.""",
        params("""PROFILE = "gpu"
SEED = 0
MODELS = ["gpt-oss-20b", "qwen3-30b-a3b"]
TOKENS = [1, 8, 64, 256, 1600, 8192]
PATTERNS = ["uniform", "zipf"]
STAGE_NAMES = ["naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add"]
CHECK_TOKENS = [1, 13, 48]
RANK = 32
ADAPTERS = 8
WARMUP_MS = 10
REP_MS = 40"""),
        setup_cell("06", cpu="""    CPU_MODEL = {"gpt-oss-20b": "tiny-oss", "qwen3-30b-a3b": "tiny"}
    MODELS_RUN, TOKENS_RUN, PATTERNS_RUN = [CPU_MODEL[m] for m in MODELS], [1, 5], ["uniform"]
    CHECK_TOKENS_RUN, R, L = [17], 16, 4""",
                   gpu="""    MODELS_RUN, TOKENS_RUN, PATTERNS_RUN, CHECK_TOKENS_RUN, R, L = MODELS, TOKENS, PATTERNS, CHECK_TOKENS, RANK, ADAPTERS""",
                   extra_imports="from moelora_lib import STAGES, shapes\nfrom moelora_lib.kernels.launchers import even_k\nfrom moelora_lib.testing import TOLERANCES, rel_err"),
        """md:## Correctness: every stage against the reference, EVEN_K on both paths, the add done twice""",
        """check_rows = []
for m in MODELS_RUN:
    s = shapes.get_shape(m)
    weights = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=True)
    for stage in tqdm(STAGE_NAMES, desc=m):
        for T in CHECK_TOKENS_RUN:
            r = mb.check_layer(stage, s, T, rank=R, num_adapters=L, pattern="mixed", dtype=DTYPE, device=DEVICE,
                               seed=SEED, bias=s.has_bias, weights=weights)
            run = mb.make_run(stage, mb.layer_inputs(s, T, rank=R, num_adapters=L, weights=weights, seed=SEED,
                                                     bias=s.has_bias))
            r["even_k_ops"] = ",".join(op for op, k in [("gate_up_shrink", s.hidden), ("down_shrink", s.intermediate)]
                                       if even_k(k, getattr(run.cfg, op).BLOCK_SIZE_K, getattr(run.cfg, op).SPLIT_K))
            check_rows.append(bench.result_row(**r, check="layer_vs_reference", tol=TOLERANCES[DTYPE]))
    # fused add twice: each call adds the same delta (no stale state)
    inp = mb.layer_inputs(s, CHECK_TOKENS_RUN[-1], rank=R, num_adapters=L, weights=weights, seed=SEED,
                          pattern="uniform", bias=s.has_bias)
    run = mb.make_run("even_k_fused_add", inp)
    run()
    for op in ("gate_up_expand", "down_expand"):
        fn = mb.lora_op_fn(run, op)
        before = (run.h if op == "gate_up_expand" else run.y).float().clone()
        once = fn().float().clone()
        twice = fn().float().clone()
        check_rows.append(bench.result_row(check="fused_add_twice", model=m, stage="even_k_fused_add", op=op,
                                           T=CHECK_TOKENS_RUN[-1], dtype=str(DTYPE).replace("torch.", ""),
                                           rel_err=rel_err(twice - once, once - before),
                                           delta_rel=float((once - before).abs().max() / before.abs().max()),
                                           tol=TOLERANCES[DTYPE] * 4))
    del weights
bench.write_rows(DATA / "06_checks.csv", check_rows)
checks = pd.read_csv(DATA / "06_checks.csv")
print(checks[["check", "model", "stage", "T", "rel_err", "tol", "delta_rel", "no_adapter_bitwise", "even_k_ops"]
             ].to_string(index=False))
assert (checks.rel_err <= checks.tol).all()
assert checks[checks.check == "layer_vs_reference"].no_adapter_bitwise.astype(bool).all()
assert (checks.delta_rel > 0.01).all()""",
        """md:## The cumulative table
Per (model, pattern, T): the LoRA part and the whole layer of every stage, the base MoE once (it is the
same kernel in every stage), the bytes floor. GPT-OSS-20B runs with silu and no biases as vLLM's anchor
did; its real swigluoai + biases are timed for the final stage in separate rows (`variant = real`).""",
        """CSV = DATA / "06_even_k_fused_add.csv"
rows = []
stages = list(STAGE_NAMES)  # in order; the last one is the stage the targets are checked on
assert all(st in STAGES for st in stages), stages
for m in MODELS_RUN:
    s = shapes.get_shape(m)
    weights = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=True)
    jobs = [(p, T, st, "as_anchor") for p in PATTERNS_RUN for T in TOKENS_RUN for st in stages]
    if s.has_bias:
        jobs += [("uniform", T, stages[-1], "real") for T in TOKENS_RUN]
    for pattern, T, stage, variant in tqdm(jobs, desc=m):
        act, bias = ("silu", False) if variant == "as_anchor" else (None, True)
        parts = ("base", "lora", "total") if stage == stages[-1] else ("lora", "total")
        for r in mb.bench_layer(stage, s, T, rank=R, num_adapters=L, pattern=pattern, dtype=DTYPE,
                                device=DEVICE, seed=SEED, activation=act, bias=bias, weights=weights,
                                parts=parts, warmup_ms=WARMUP_MS, rep_ms=REP_MS):
            r["variant"] = variant
            rows.append(r)
    del weights
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
bench.write_rows(CSV, rows)
df = pd.read_csv(CSV)
if PROFILE == "cpu":
    print("CPU profile: interpreter wall clock, NOT kernel performance.")
d = df[df.variant == "as_anchor"]
cum = d[d.part != "base"].pivot_table(index=["model", "pattern", "T"], columns=["part", "stage"], values="us_p50",
                                     sort=False)[[("lora", st) for st in stages] + [("total", st) for st in stages]]
cum[("base", "")] = d[d.part == "base"].pivot_table(index=["model", "pattern", "T"], values="us_p50").us_p50
cum[("floor_total", "")] = d[(d.part == "total") & (d.stage == stages[-1])].pivot_table(
    index=["model", "pattern", "T"], values="floor_us").floor_us
cum.round(1)""",
        """md:## Against vLLM's figures (targets of issue 3)
`anchor_table()`: vLLM on this H200, best of its two implementations (uniform ids). The targets
compare our final stage, uniform ids, CUDA-graph replay. On the CPU profile there are no matching rows.""",
        """anchors = mb.anchor_table()
fin = d[(d.stage == stages[-1]) & (d.pattern == "uniform")].pivot_table(index=["model", "T"], columns="part",
                                                                          values="us_p50").reset_index()
tgt = fin.merge(anchors, on=["model", "T"], how="inner")
tgt["lora_target_met"] = tgt["lora"] < tgt["lora_best_us"]
tgt["total_target_met"] = tgt["total"] < tgt["total_best_us"]
tgt["lora_ratio"] = tgt["lora"] / tgt["lora_best_us"]
tgt["total_ratio"] = tgt["total"] / tgt["total_best_us"]
tgt.to_csv(DATA / "06_targets.csv", index=False)  # header even when empty (cpu profile)
tgt[["model", "T", "base", "base_us", "lora", "lora_best_us", "lora_ratio", "lora_target_met", "total",
     "total_best_us", "total_ratio", "total_target_met"]].round(2)""",
        """fig, axes = plt.subplots(len(MODELS_RUN), 2, figsize=(12, 4.2 * len(MODELS_RUN)), squeeze=False)
for i, m in enumerate(MODELS_RUN):
    for j, part in enumerate(["lora", "total"]):
        ax = axes[i][j]
        for st in stages:
            q = d[(d.model == m) & (d.pattern == "uniform") & (d.stage == st) & (d.part == part)].sort_values("T")
            ax.plot(q["T"], q.us_p50, "o-", ms=3, label=st)
        a = anchors[anchors.model == m]
        if len(a):
            ax.plot(a["T"], a[f"{part}_best_us"], "k^:", label="vLLM best")
        q = d[(d.model == m) & (d.pattern == "uniform") & (d.stage == stages[-1]) & (d.part == part)].sort_values("T")
        ax.plot(q["T"], q.floor_us, "k--", lw=1, label="floor")
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_xlabel("tokens T"); ax.set_ylabel("µs")
        ax.set_title(f"{m}: {part} (uniform ids)"); ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIG / "06_cumulative.png", dpi=120)""",
        """md:### Conclusions (read back from the CSVs); per-op times where a target is missed""",
        """df = pd.read_csv(CSV)
tgt = pd.read_csv(DATA / "06_targets.csv")
d = df[df.variant == "as_anchor"]
for (m, p), g in d.groupby(["model", "pattern"], sort=False):
    piv = g.pivot_table(index="T", columns=["part", "stage"], values="us_p50")
    for T in piv.index:
        print(f"{m:14s} {p:8s} T={T:5d}: LoRA naive {piv.loc[T, ('lora', stages[0])]:9.1f} -> final "
              f"{piv.loc[T, ('lora', stages[-1])]:9.1f} µs ({piv.loc[T, ('lora', stages[0])] / piv.loc[T, ('lora', stages[-1])]:.2f}x); "
              f"total {piv.loc[T, ('total', stages[0])]:9.1f} -> {piv.loc[T, ('total', stages[-1])]:9.1f} µs")
real = df[df.variant == "real"].pivot_table(index=["model", "T"], columns="part", values="us_p50")
if len(real):
    print("GPT-OSS real swigluoai + biases, final stage:")
    print(real.round(1).to_string())
per_op = []
for _, row in tgt.iterrows():
    print(f"{row.model:14s} T={int(row['T']):5d}: LoRA {row.lora:8.1f} vs vLLM {row.lora_best_us:8.1f} µs "
          f"-> {'met' if row.lora_target_met else 'MISSED'}; total {row.total:8.1f} vs {row.total_best_us:8.1f} µs "
          f"-> {'met' if row.total_target_met else 'MISSED'}")
    if not (row.lora_target_met and row.total_target_met):
        s = shapes.get_shape(row.model)
        w = mb.layer_inputs(s, 1, rank=R, num_adapters=L, dtype=DTYPE, device=DEVICE, seed=SEED, bias=False)
        run = mb.make_run(stages[-1], mb.layer_inputs(s, int(row["T"]), rank=R, num_adapters=L, weights=w,
                                                      seed=SEED, activation="silu"))
        run()
        for op in ["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]:
            per_op.append(mb.bench_lora_op(stages[-1], s, int(row["T"]), op, run=run, warmup_ms=WARMUP_MS,
                                           rep_ms=REP_MS))
        del run, w
if per_op:
    bench.write_rows(DATA / "06_missed_per_op.csv", per_op)
    po = pd.read_csv(DATA / "06_missed_per_op.csv")
    po["over_floor"] = po.us_p50 / po.floor_us
    print("per-op times where a target was missed (µs; floor = bytes at 4.3 TB/s):")
    print(po[["model", "T", "part", "config", "us_p50", "floor_us", "over_floor"]].round(2).to_string(index=False))
print(f"targets met: LoRA {int(tgt.lora_target_met.sum())}/{len(tgt)}, whole layer "
      f"{int(tgt.total_target_met.sum())}/{len(tgt)}")""",
    ])


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    wanted = [n for n in NOTEBOOKS if not argv or any(n.startswith(a) for a in argv)]
    NB_DIR.mkdir(exist_ok=True)
    for name in wanted:
        nb = NOTEBOOKS[name]()
        nbformat.validate(nb)
        path = NB_DIR / f"{name}.ipynb"
        nbformat.write(nb, str(path))
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
