"""The dense multi-LoRA study layer (moelora_lib.studies.dense_bench, notebook 10) on the CPU interpreter:
the projection presets against vLLM's anchor table, the anchor reader, the bytes/FLOPs of the parts, the
seeded inputs, every implementation (stages, module, torch baselines) against the reference, the timing
rows, and the summary/targets tables the notebook and its conclusion share."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from moelora_lib.studies import bench
from moelora_lib.studies import dense_bench as db

ANCHOR_T = [1, 8, 64, 256, 1600, 8192]
TINY = dict(rank=8, adapters=3, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def anchors() -> pd.DataFrame:
    return db.anchor_table()


# ---- shapes and anchors ---------------------------------------------------------------------------------


def test_presets_are_the_anchor_shapes(anchors):
    ours = {(p.model, p.proj): p for m in db.MODELS for p in db.projections(m)}
    theirs = anchors[["model", "proj", "H", "slices"]].drop_duplicates()
    assert len(theirs) == len(ours) == 12
    for r in theirs.itertuples():
        p = ours[(r.model, r.proj)]
        assert (p.hidden, p.slices_str) == (r.H, r.slices), (p, r)


def test_presets_from_heads():
    p = {q.proj: q for q in db.projections("gpt-oss-20b")}
    assert p["qkv"].slices == (4096, 512, 512) and p["qkv"].hidden == 2880
    assert p["o"].hidden == 4096 and p["o"].slices == (2880,)
    assert set(p) == {"qkv", "o"}  # MoE model: no dense MLP
    ll = {q.proj: q for q in db.projections("llama-3.3-70b")}
    assert ll["gate_up"].slices == (28672, 28672) and ll["down"].hidden == 28672
    assert ll["qkv"].n_total == 8192 + 2 * 1024
    assert db.get_projection("qwen3-32b/down").slices == (5120,)


@pytest.mark.parametrize("bad", ["nomodel/qkv", "gpt-oss-20b/gate_up", "qkv", 3])
def test_get_projection_rejects(bad):
    with pytest.raises(ValueError):
        db.get_projection(bad)


def test_anchor_table(anchors):
    assert len(anchors) == 12 * len(ANCHOR_T)
    assert sorted(anchors["T"].unique()) == ANCHOR_T
    for col in ("base_us", "lora_us", "shrink_us", "expand_us", "total_us", "gbmm_us", "meta_us"):
        assert anchors[col].notna().all(), col
    # docs/anchors-h200.md, last section: GPT-OSS-20B qkv at T = 64 base 16 µs, vLLM LoRA 54 µs
    r = anchors[(anchors.model == "gpt-oss-20b") & (anchors.proj == "qkv") & (anchors["T"] == 64)].iloc[0]
    assert r.base_us == pytest.approx(16.06) and r.lora_us == pytest.approx(53.92)
    assert r.shrink_us == pytest.approx(37.66) and r.gbmm_us == pytest.approx(83.33)
    assert anchors.meta_us.between(160, 240).all()


# ---- costs ----------------------------------------------------------------------------------------------


def test_part_costs_by_hand():
    p = db.get_projection("gpt-oss-20b/qkv")  # H 2880, N 5120, S 3
    c = db.part_costs(p, 64, rank=32, adapters=8)
    H, N, S, R, T, b = 2880, 5120, 3, 32, 64, 2
    assert c["base"]["flops"] == 2 * T * H * N
    assert c["base"]["bytes"] == N * H * b + T * H * b + T * N * b
    assert c["shrink"]["bytes"] == 8 * S * R * H * b + T * H * b + T * S * R * 4
    assert c["expand"]["bytes"] == 8 * N * R * b + T * S * R * 4 + 2 * T * N * b
    assert c["lora"]["bytes"] == c["shrink"]["bytes"] + c["expand"]["bytes"]
    assert c["total"]["flops"] == c["base"]["flops"] + c["lora"]["flops"]
    for part in c.values():
        assert part["floor_us"] == pytest.approx(
            max(bench.copy_bandwidth_floor_us(part["bytes"]), bench.compute_floor_us(part["flops"]))
        )
    # T = 1 touches one adapter; ids with -1 touch fewer tokens
    assert db.part_costs(p, 1)["shrink"]["bytes"] == S * R * H * b + H * b + S * R * 4
    ids = torch.tensor([-1, 0, 0, -1], dtype=torch.int32)
    c4 = db.part_costs(p, 4, lora_ids=ids)
    assert c4["shrink"]["flops"] == 2 * 2 * H * S * R


# ---- inputs ---------------------------------------------------------------------------------------------


def test_inputs_seeded_and_shaped():
    a = db.make_inputs("tiny/qkv", 16, seed=3, **TINY)
    b = db.make_inputs("tiny/qkv", 16, seed=3, **TINY)
    c = db.make_inputs("tiny/qkv", 16, seed=4, **TINY)
    assert a.x.shape == (16, 48) and a.weight.shape == (96, 48)
    assert a.lora_a.shape == (3, 3, 8, 48) and a.lora_b.shape == (3, 96, 8)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.lora_b, b.lora_b)
    assert not torch.equal(a.weight, c.weight)
    u = a.lora_ids(16, "uniform")
    assert u.dtype == torch.int32 and (u >= 0).all()
    assert torch.bincount(u.long()).tolist() == [6, 5, 5]  # spread evenly
    assert torch.equal(u, a.lora_ids(16, "uniform"))
    assert (a.lora_ids(16, "mixed") == -1).any()
    assert a.L == 3 and a.R == 8 and a.max_tokens == 16 and a.dtype == torch.float32
    with pytest.raises(ValueError):
        a.x_for(17)
    named = db.make_inputs("tiny/qkv", 16, seed=3, **{**TINY, "dtype": "float32"})
    assert torch.equal(named.weight, a.weight)  # a dtype by name, as the check processes pass it


# ---- correctness (interpreter) --------------------------------------------------------------------------


@pytest.mark.parametrize("proj, T", [("tiny/qkv", 37), ("tiny/down", 1)])  # 3 slices, -1 rows; K = 96
def test_every_implementation_matches_the_reference(proj, T):
    inp = db.make_inputs(proj, T, **TINY)
    rows = db.check_projection(inp, T, stages=("naive", "split_k", "even_k_fused_add", "tuned"))
    df = pd.DataFrame(rows)
    assert list(df.impl) == ["naive", "split_k", "even_k_fused_add", "tuned", "tuned", *db.BASELINES]
    assert list(df.part) == ["lora"] * 4 + ["total"] + ["lora"] * 2
    assert (df.rel_err <= df.tol).all(), df[["impl", "rel_err"]]
    assert (df.rel_err < 1e-5).all()  # fp32 under the interpreter
    assert df.no_adapter_bitwise.all()
    assert (df.delta_rel > 0.1).all()
    if T == 37:
        assert (df.no_adapter_rows > 0).all()


def test_baselines_with_uniform_ids_match():
    inp = db.make_inputs("tiny/gate_up", 20, **TINY)
    ids = inp.lora_ids(20, "uniform")
    from moelora_lib.linear import lora_linear_reference

    ref = lora_linear_reference(inp.x, inp.weight, inp.lora_a, inp.lora_b, ids, slices=inp.proj.slices)
    for cls in (db.TorchLoop, db.TorchGatherBmm):
        fn = cls(inp, 20, ids)
        fn.reset()
        out = fn().double()
        assert (out - ref).abs().max() / ref.abs().max() < 1e-5, cls.__name__
        fn()  # a second call keeps adding into the same buffer (the timing calls do)
        assert not torch.equal(fn.out.double(), out)


# ---- timing rows ----------------------------------------------------------------------------------------


def test_timing_rows_on_cpu():
    inp = db.make_inputs("tiny/o", 8, **TINY)
    rows = db.bench_projection("tuned", inp, 5)
    rows += db.bench_projection("naive", inp, 5, parts=("lora",))
    rows += db.bench_projection("tuned", inp, 5, parts=db.BASELINES + db.KERNELS)
    rows.append(db.bench_alignment(5, block_size_m=16, adapters=3, device="cpu"))
    df = pd.DataFrame(rows)
    assert list(zip(df.impl, df.part)) == [
        ("cublas", "base"),
        ("tuned", "lora"),
        ("tuned", "total"),
        ("naive", "lora"),
        ("torch_loop", "lora"),
        ("torch_gbmm", "lora"),
        ("tuned", "shrink"),
        ("tuned", "expand"),
        ("align", "align"),
    ]
    assert (df["mode"] == "cpu-interpreter").all()
    assert (df.us_p50 > 0).all()
    t = df[df.part != "align"]
    assert (t.model == "tiny").all() and (t.proj == "o").all() and (t.slices == "48").all()
    assert t[t.part == "lora"].floor_us.nunique() == 1  # one floor for every implementation of the part
    assert df[df.part == "lora"].block_size_m.dropna().eq(16).all()
    assert df[df.stage.isna() & (df.part == "lora")].impl.tolist() == list(db.BASELINES)
    with pytest.raises(ValueError, match="stage"):
        db.bench_projection("fastest", inp, 5)
    with pytest.raises(ValueError, match="parts"):
        db.bench_projection("tuned", inp, 5, parts=("everything",))


def test_module_rows_name_the_decode_gemv_where_it_runs():
    # LoRALinear runs a one-token call with adapters as the decode GEMV: the row's config says so; its
    # base (no active slot) and a two-token call run the stage's launches and show the stage's config
    inp = db.make_inputs("tiny/o", 8, **TINY)
    mod = db.build_module(inp, "tuned")
    rows = db.bench_projection("tuned", inp, 1, parts=("total",), module=mod)
    rows += db.bench_projection("tuned", inp, 2, parts=("total",), module=mod)
    rows += db.bench_module(mod, inp, 1)
    df = pd.DataFrame(rows)
    gemv = "gemv:" + mod.gemv_config_for(1).short()
    assert list(df.config) == [gemv, mod.config_for(2).short(), mod.config_for(1).short(), gemv]
    assert list(df.config_source == "default:dense_gemv") == [True, False, False, True]
    assert df[df.config_source == "default:dense_gemv"].block_size_m.isna().all()


def test_module_total_of_another_stage_is_refused():
    inp = db.make_inputs("tiny/o", 8, **TINY)
    mod = db.build_module(inp, "even_k_fused_add")
    assert mod.loaded_slots == [0, 1, 2]
    with pytest.raises(ValueError, match="stage"):
        db.bench_projection("tuned", inp, 4, parts=("total",), module=mod)


# ---- summary and targets --------------------------------------------------------------------------------


def _rows(points: dict) -> pd.DataFrame:
    """Timing rows from {(proj, T): dict(base=, lora=, torch_loop=, torch_gbmm=)} (one stage, "tuned")."""
    rows = []
    for (name, T), v in points.items():
        p = db.get_projection(name)
        key = dict(model=p.model, proj=p.proj, slices=p.slices_str, T=T, mode="graph")
        rows.append(dict(key, part="base", impl="cublas", stage=None, us_p50=v["base"], floor_us=1.0))
        rows.append(dict(key, part="lora", impl="tuned", stage="tuned", us_p50=v["lora"], floor_us=0.5))
        rows.append(dict(key, part="total", impl="tuned", stage="tuned", us_p50=v["base"] + v["lora"] + 3))
        for impl in db.BASELINES:
            if impl in v:
                rows.append(dict(key, part="lora", impl=impl, stage=None, us_p50=v[impl], floor_us=0.5))
    return pd.DataFrame(rows)


def test_summary_and_targets(anchors):
    a = anchors.set_index(["model", "proj", "T"]).lora_us
    pts = {
        # vLLM 21.38 µs: 7.1 µs is 3.01× (met), base 100 → 7.1 % (met)
        ("gpt-oss-20b/qkv", 1): dict(base=100.0, lora=7.1),
        # vLLM 53.92: 20 µs is 2.7× (missed); torch 61 / 20 = 3.05× (met); share 20 % (missed)
        ("gpt-oss-20b/qkv", 64): dict(base=100.0, lora=20.0, torch_loop=61.0, torch_gbmm=80.0),
        # T = 256: no vLLM or share target; torch 2.5× (missed)
        ("gpt-oss-20b/qkv", 256): dict(base=100.0, lora=20.0, torch_loop=70.0, torch_gbmm=50.0),
        # vLLM 517.07: 1.5× needs ≤ 344.7; share 8 % of 4000 = 320
        ("gpt-oss-20b/qkv", 8192): dict(base=4000.0, lora=320.0, torch_loop=900.0),
    }
    s = db.summary_table(_rows(pts), anchors)
    assert list(s["T"]) == [1, 64, 256, 8192]
    r64 = s[s["T"] == 64].iloc[0]
    assert r64.torch_best == 61.0 and r64.x_torch == pytest.approx(61 / 20)
    assert r64.x_vllm == pytest.approx(a[("gpt-oss-20b", "qkv", 64)] / 20)
    assert r64.share == pytest.approx(0.2) and r64.total == pytest.approx(123.0)
    t = db.targets_table(s).set_index(["target", "T"])
    assert t.loc[("vs_vllm_small_T", 1)].met and not t.loc[("vs_vllm_small_T", 64)].met
    assert t.loc[("share_of_base_small_T", 1)].met and not t.loc[("share_of_base_small_T", 64)].met
    assert t.loc[("vs_torch", 64)].met and not t.loc[("vs_torch", 256)].met
    assert t.loc[("vs_vllm_large_T", 8192)].met and t.loc[("share_of_base_large_T", 8192)].met  # ≤ is met
    assert ("vs_torch", 1) not in t.index  # not timed there, and the target starts at 64
    assert ("vs_vllm_small_T", 256) not in t.index and ("share_of_base_large_T", 256) not in t.index
    assert len(t) == 2 + 2 + 1 + 1 + 3  # vLLM and share at T = 1, 64; both at 8192; torch at 64/256/8192
    v = t.loc[("vs_vllm_large_T", 8192)]
    assert v.value == pytest.approx(a[("gpt-oss-20b", "qkv", 8192)] / 320) and v.kind == "speedup"
    assert math.isclose(t.loc[("share_of_base_large_T", 8192)].value, 0.08)


def test_targets_empty_without_rows():
    t = db.targets_table(db.summary_table(_rows({("tiny/qkv", 5): dict(base=1.0, lora=1.0)})).iloc[0:0])
    assert t.empty and list(t.columns)[:4] == ["target", "model", "proj", "T"]


# ---- the one-launch decode GEMV's dev probe (data/dev/probes/dense_gemv_probe.py) ------------------------


def _probe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "dev" / "probes" / "dense_gemv_probe.py"
    spec = importlib.util.spec_from_file_location("dense_gemv_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dense_gemv_bench_rows_on_cpu():
    # tiny qkv (3 slices, H 48) at T 1 and 2 with two configs: the row set, the default/sweep-best pair
    from moelora_lib.kernels.dense_gemv import DenseGemvConfig

    cfgs = [DenseGemvConfig(16, 16, 3), DenseGemvConfig(32, 16, 1)]
    rows = _probe().dense_gemv_bench(["tiny/qkv"], [1, 2], configs=lambda T, p: cfgs, rank=8, adapters=3,
                               dtype=torch.float32, device="cpu")  # fmt: skip
    df = pd.DataFrame(rows)
    per_T = [
        ("cublas", "base", "none", "-"),
        ("tuned", "total", "uniform", "-"),
        ("tuned", "total", "mixed", "-"),
        *[(impl, part, pat, src) for impl, part, pat in
          [("gemv_base", "base", "none"), ("gemv", "total", "none"), ("gemv", "total", "uniform"),
           ("gemv", "total", "mixed")] for src in ("default", "sweep-best")],
    ]  # fmt: skip
    got = list(zip(df.impl, df.part, df.pattern, df.config_source.where(df.impl.str.startswith("gemv"), "-")))
    assert got == per_T * 2
    assert list(df["T"]) == [1] * len(per_T) + [2] * len(per_T)
    assert (df["mode"] == "cpu-interpreter").all() and (df.us_p50 > 0).all()
    g = df[df.impl.str.startswith("gemv")]
    assert (g.rel_err < 1e-5).all() and g.config.isin([c.short() for c in cfgs]).all()
    assert (g[g.config_source == "default"].config == cfgs[0].short()).all()
    assert (df[df.impl == "tuned"].rel_err < 1e-5).all()
    assert df.x_base.notna().all() and (df[df.impl == "cublas"].x_base == 1.0).all()
    for col in ("model", "proj", "H", "N", "slices", "S", "L", "R", "dtype", "flops", "bytes", "floor_us"):
        assert df[col].notna().all(), col
    with pytest.raises(ValueError, match="tokens must be in"):
        _probe().dense_gemv_bench(["tiny/qkv"], [0], device="cpu", dtype=torch.float32)


def test_dense_gemv_bench_fp8_rows_on_cpu():
    # the same rows on the block-FP8 weight (32 x 32 blocks: H 48 ends in a ragged scale column), the FP8
    # weight-only GEMM as the base; rel_err against the reference on the dequantized weight
    from moelora_lib.kernels.dense_gemv import DenseGemvConfig

    cfgs = [DenseGemvConfig(16, 16, 3), DenseGemvConfig(32, 32, 1)]
    kw = dict(configs=lambda T, p: cfgs, rank=8, adapters=3, dtype=torch.float32, device="cpu")
    df = pd.DataFrame(
        _probe().dense_gemv_bench(["tiny/qkv"], [2], patterns=("mixed",), fp8=True, fp8_block=(32, 32), **kw)
    )
    dense = pd.DataFrame(_probe().dense_gemv_bench(["tiny/qkv"], [2], patterns=("mixed",), **kw))
    assert list(df.columns) == list(dense.columns)  # one CSV holds both
    assert (df.weight_format == "fp8").all() and (dense.weight_format == "dense").all()
    assert list(df.impl) == ["fp8_weight_only", "tuned"] + ["gemv_base"] * 2 + ["gemv"] * 4
    assert list(dense.impl) == ["cublas", *df.impl[1:]]
    g = df[df.impl != "fp8_weight_only"]
    assert (g.rel_err < 1e-5).all() and df.x_base.notna().all()
    assert (df[df.impl == "fp8_weight_only"].x_base == 1.0).all()
    # the base reads one byte per weight plus the scales: fewer bytes than the dense rows' base
    assert (df[df.part == "base"].bytes.values < dense[dense.part == "base"].bytes.values).all()
    with pytest.raises(ValueError, match="must divide"):  # a K tile spanning two 16-wide scale columns
        _probe().dense_gemv_bench(["tiny/qkv"], [1], patterns=(), fp8=True, fp8_block=(16, 16), **kw)


def test_gemv_sweep_configs():
    cfgs = _probe().gemv_sweep_configs(1, "gpt-oss-20b/qkv")
    assert cfgs[0].short() == "n64k128s6w4st1" and len(cfgs) == len(set(cfgs)) >= 6
    assert {"n64k128s12w4st1", "n64k128s3w4st1", "n64k64s6w4st1"} <= {c.short() for c in cfgs}
    assert all(c.SPLIT_K <= -(-2880 // c.BLOCK_SIZE_K) for c in cfgs)
    # a block-FP8 weight's scale columns: every config's K tile lies in one
    fp8 = _probe().gemv_sweep_configs(1, "gpt-oss-20b/qkv", block_k=64)
    assert fp8 and all(64 % c.BLOCK_SIZE_K == 0 for c in fp8)
