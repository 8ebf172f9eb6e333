"""Notebook 15's study helpers for block-FP8 weights on the CPU (tiny presets, Triton interpreter, fp32).

* ``moe_bench``: expert weights quantized a few experts (or block rows) at a time equal the quantizer on the
  whole tensor; the formats convert both ways; the base GEMMs' bytes count 1 byte plus the block scales per
  FP8 weight and their FLOP floor the FP8 rate; ``check_layer`` / ``bench_layer`` / ``bench_module`` take FP8
  experts and an activation scheme (weight-only bit for bit as the dequantized layer, W8A8 within its bound).
* ``dense_bench``: the FP8 costs by hand; an FP8 ``LoRALinear`` checked and timed in both schemes.
* ``e2e``: FP8 experts and projections hold the dense model's random weights quantized, the dequantized twin
  their exact values; memory against the estimate; logits and their error; a shallower stand-in.
* ``fp8_study``: the tables and the targets on hand-made rows.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from moelora_lib.hardware import H200_BF16_TFLOPS, H200_FP8_TFLOPS
from moelora_lib.quant import FP8BlockWeight
from moelora_lib.studies import bench, e2e
from moelora_lib.studies import dense_bench as db
from moelora_lib.studies import fp8_study as fs
from moelora_lib.studies import moe_bench as mb
from moelora_lib.testing import TOLERANCES

CPU = dict(dtype=torch.float32, device="cpu")
KW = dict(rank=4, num_adapters=3, seed=0, **CPU)
BLOCK = (16, 32)  # several scale blocks per tiny weight, W8A8-capable (32 columns)


def _same(a: FP8BlockWeight, b: FP8BlockWeight) -> bool:
    return torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)) and torch.equal(
        a.scale_inv, b.scale_inv
    )


@pytest.fixture(scope="module")
def weights():
    """Dense (fp32) and FP8 weight sets of the tiny preset (silu, 2 slices), the same adapters."""
    dense = mb.layer_inputs("tiny", 1, **KW)
    return {"dense": dense, "fp8": mb.with_weight_format(dense, "fp8", fp8_block=BLOCK)}


def test_quantize_fp8_weight_equals_the_whole_tensor_and_refuses_bad_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 72, generator=g)  # ragged last blocks in both dims
    whole = FP8BlockWeight.quantize(w, BLOCK)
    for max_elements in (1, 40 * 72, 2 * 40 * 72, 1 << 24):  # block rows of one expert, one, two, all
        q = mb.quantize_fp8_weight(w, block=BLOCK, max_elements=max_elements)
        assert q.shape == (3, 40, 72) and q.block == BLOCK and _same(q, whole)
    w2 = w[0]  # a projection [N, K]
    assert _same(
        mb.quantize_fp8_weight(w2, block=BLOCK, max_elements=16 * 72), FP8BlockWeight.quantize(w2, BLOCK)
    )
    with pytest.raises(ValueError, match=r"quantize_fp8_weight: w must be a float tensor \[..., N, K\]"):
        mb.quantize_fp8_weight(torch.ones(4))
    assert mb.fp8_bytes_per_weight() == 1 + 4 / (128 * 128)
    assert mb.fp8_bytes_per_weight(BLOCK) == 1 + 4 / 512


def test_fp8_format_converts_both_ways_and_counts_its_bytes_and_flops(weights):
    dense, f8 = weights["dense"], weights["fp8"]
    assert mb.weight_format_of(f8) == "fp8" and f8.w13.block == BLOCK and f8.lora_a13 is dense.lora_a13
    assert mb.with_weight_format(f8, "fp8") is f8
    back = mb.with_weight_format(f8, "dense")
    assert torch.equal(back.w13, f8.w13.dequantize(torch.float32))
    mx = mb.with_weight_format(dense, "mxfp4")  # a packed weight of the other format: dequantized first
    assert _same(mb.with_weight_format(mx, "fp8").w2, mb.quantize_fp8_weight(mx.w2.dequantize(torch.float32)))
    inp = mb.layer_inputs("tiny", 6, weights=f8, **KW)
    run = mb.make_run("tuned", inp)
    c = dict(dtype_bytes=2, topk_ids=inp.topk_ids, lora_ids=inp.lora_ids)
    bf = {r["op"]: r for r in mb.op_costs("tiny", run.dims, **c)}
    wb = f8.w13.nbytes / math.prod(f8.w13.shape)
    fp = {
        r["op"]: r for r in mb.op_costs("tiny", run.dims, **c, weight_bytes=wb, base_tflops=H200_FP8_TFLOPS)
    }
    for op in bf:
        if op in mb.BASE_OPS:
            assert fp[op]["weight_bytes"] == pytest.approx(bf[op]["weight_bytes"] * wb / 2, abs=1)
            assert fp[op]["tflops"] == H200_FP8_TFLOPS and bf[op]["tflops"] == H200_BF16_TFLOPS
            assert fp[op]["flops_floor_us"] == pytest.approx(bf[op]["flops_floor_us"] * 675 / H200_FP8_TFLOPS)
        else:
            assert fp[op] == bf[op]  # the adapters and their FLOPs stay bf16's
    with pytest.raises(ValueError, match="base_tflops must be None or a number > 0"):
        mb.op_costs("tiny", run.dims, base_tflops=0)


def test_check_and_bench_fp8_experts_per_activation_scheme(weights):
    c = mb.check_layer("tuned", "tiny", 5, weights=weights["fp8"], activation_scheme="weight_only", **KW)
    assert c["weight_format"] == "fp8" and c["activation_scheme"] == "weight_only"
    assert c["bitwise_vs_dense"] and c["rel_err_vs_dense"] == 0.0 and c["rel_err"] <= c["tol"]
    assert c["tol"] == TOLERANCES[torch.float32] and c["no_adapter_bitwise"] and c["delta_rel"] > 0
    rows = {}
    for fmt, parts in (("dense", ("base",)), ("fp8", ("base", "total"))):
        for r in mb.bench_layer("tuned", "tiny", 2, weights=weights[fmt], parts=parts, **KW):
            rows[fmt, r["part"]] = r
    f, d = rows["fp8", "base"], rows["dense", "base"]
    assert f["weight_format"] == "fp8" and f["activation_scheme"] == "weight_only" and f["bytes"] < d["bytes"]
    assert f["flops"] == d["flops"] and f["flops_floor_us"] == pytest.approx(
        d["flops_floor_us"] * 675 / 1350.68, 1e-3
    )
    assert f["floor_us"] == max(f["bytes_floor_us"], f["flops_floor_us"])
    assert (
        rows["fp8", "total"]["bytes"] > f["bytes"]
        and rows["fp8", "total"]["activation_scheme"] == "weight_only"
    )
    c = mb.check_layer("tuned", "tiny", 5, weights=weights["fp8"], activation_scheme="dynamic", **KW)
    assert c["activation_scheme"] == "dynamic" and c["tol"] == mb.W8A8_REL_TOL and not c["bitwise_vs_dense"]
    assert 1e-4 < c["rel_err"] <= c["tol"] and c["rel_err_vs_dense"] <= c["tol"] and c["no_adapter_bitwise"]
    layer = mb.build_module(weights["fp8"], "tiny", max_tokens=4, activation_scheme="dynamic")
    inp = mb.layer_inputs("tiny", 3, weights=weights["fp8"], **KW)
    rows = mb.bench_module(layer, inp, "tiny", parts=("base",))
    assert (
        rows[0]["activation_scheme"] == "dynamic" == mb.module_scheme(layer, 3)
        and rows[0]["mode"] == "cpu-interpreter"
    )
    auto = mb.build_module(weights["fp8"], "tiny", max_tokens=4)
    assert mb.module_scheme(auto, 1) == "weight_only"  # decode sizes: weight-only under "auto"
    with pytest.raises(ValueError, match="activation_scheme must be one of"):
        mb.make_run("tuned", inp, activation_scheme="w8a8")


def test_dense_fp8_costs_by_hand():
    p = db.get_projection("qwen3-32b/gate_up")  # H 5120, N 51200
    H, N, T, b = 5120, 51200, 8, 2
    wb = mb.fp8_bytes_per_weight()
    c = db.part_costs(p, T, weight_bytes=wb, base_tflops=H200_FP8_TFLOPS)
    d = db.part_costs(p, T)
    assert (
        c["base"]["bytes"] == round(N * H * wb + T * H * b + T * N * b)
        and d["base"]["bytes"] == N * H * b + T * H * b + T * N * b
    )
    assert c["base"]["flops_floor_us"] == pytest.approx(
        bench.compute_floor_us(2 * T * H * N, H200_FP8_TFLOPS)
    )
    assert c["lora"] == d["lora"] and c["total"]["bytes"] == c["base"]["bytes"] + c["lora"]["bytes"]
    assert c["total"]["flops_floor_us"] == pytest.approx(
        c["base"]["flops_floor_us"] + d["lora"]["flops_floor_us"]
    )
    for part in c.values():
        assert part["floor_us"] == max(part["bytes_floor_us"], part["flops_floor_us"])


def test_dense_fp8_projection_checked_and_timed():
    inp = db.make_inputs("tiny/qkv", 4, rank=4, adapters=3, seed=0, **CPU)
    w8 = db.fp8_weight(inp, BLOCK)
    assert w8.shape == tuple(inp.weight.shape) and torch.equal(
        db.dequantized(inp, w8).weight, w8.dequantize(torch.float32)
    )
    r = db.check_fp8_projection(inp, 3, w8, activation_scheme="weight_only")
    assert r["activation_scheme"] == "weight_only" and r["rel_err"] <= r["tol"] == TOLERANCES[torch.float32]
    assert r["rel_err_vs_dense"] <= 1e-5 and r["no_adapter_bitwise"] and r["delta_rel"] > 0
    mod = db.build_module(inp, weight=w8, activation_scheme="dynamic")
    r = db.check_fp8_projection(inp, 3, w8, module=mod)
    assert r["activation_scheme"] == "dynamic" and 1e-4 < r["rel_err"] <= r["tol"] == db.W8A8_REL_TOL
    rows = {
        (f, r["part"]): r
        for f, m in (("fp8", mod), ("dense", db.build_module(inp)))
        for r in db.bench_module(m, inp, 2)
    }
    assert (
        rows["fp8", "base"]["weight_format"] == "fp8"
        and rows["fp8", "base"]["activation_scheme"] == "dynamic"
    )
    assert (
        rows["fp8", "base"]["bytes"] < rows["dense", "base"]["bytes"]
        and rows["dense", "base"]["weight_format"] == "dense"
    )
    assert rows["fp8", "total"]["mode"] == "cpu-interpreter" and mod.active_slots is None
    with pytest.raises(ValueError, match="activation_scheme"):
        db.build_module(inp, activation_scheme="dynamic")  # W8A8 needs an FP8 weight


def test_build_model_fp8_its_twin_and_memory():
    kw = dict(
        max_batch=2, max_seq=8, max_tokens=16, num_adapters=2, max_rank=4, seed=3, fp8_block=BLOCK, **CPU
    )
    name = "tiny-qwen3-moe"
    fmts = e2e.fp8_formats(name)
    assert fmts == dict(experts="fp8", projections="fp8")
    assert e2e.fp8_formats("tiny-qwen3") == dict(experts="dense", projections="fp8")
    dense = e2e.build_model(name, **kw)
    f8 = e2e.build_model(name, **fmts, **kw)
    twin = e2e.build_model(name, **fmts, dequantize=True, **kw)
    for ld, lf, lt in zip(dense.layers, f8.layers, twin.layers):
        d, f, t = ld.mlp.experts, lf.mlp.experts, lt.mlp.experts
        assert f.weight_format == "fp8" and t.weight_format == "dense"
        for w_d, w_f, w_t in zip(d.expert_weights(), f.expert_weights(), t.expert_weights()):
            assert _same(w_f, mb.quantize_fp8_weight(w_d, block=BLOCK)) and w_f.block == BLOCK
            assert torch.equal(w_t, w_f.dequantize(torch.float32))
        qkv_d, qkv_f, qkv_t = ld.self_attn.qkv_proj, lf.self_attn.qkv_proj, lt.self_attn.qkv_proj
        assert _same(qkv_f.base_weight(), mb.quantize_fp8_weight(qkv_d.weight, block=BLOCK))
        assert torch.equal(qkv_t.weight, qkv_f.base_weight().dequantize(torch.float32))
        assert torch.equal(ld.mlp.router.weight, lf.mlp.router.weight)  # the router stays dense
    sizes = dict(
        num_adapters=2, max_rank=4, max_batch=2, max_seq=8, max_tokens=16, dtype_bytes=4, fp8_block=BLOCK
    )
    for m, f in ((dense, {}), (f8, fmts)):
        mem, est = e2e.model_memory(m), e2e.memory_estimate_gb(name, **f, **sizes)
        assert mem["projection_weight_gb"] == pytest.approx(est["projection_weight_gb"], rel=2e-2)
        assert mem["expert_weight_gb"] == pytest.approx(
            est["expert_weight_gb"], rel=2e-2
        )  # ragged blocks: a bit more
        assert mem["other_weight_gb"] == pytest.approx(est["other_weight_gb"], rel=2e-2)
        assert mem["projection_weight_gb"] < mem["other_weight_gb"]
    one = e2e.build_model(name, num_layers=1, **fmts, **kw)
    assert len(one.layers) == 1 and e2e.model_config(name, num_layers=1).num_hidden_layers == 1
    est1 = e2e.memory_estimate_gb(name, num_layers=1, **fmts, **sizes)
    assert est1["expert_weight_gb"] == pytest.approx(
        e2e.memory_estimate_gb(name, **fmts, **sizes)["expert_weight_gb"] / 2
    )
    with pytest.raises(ValueError, match="num_layers must be an int in"):
        e2e.model_config(name, num_layers=3)
    with pytest.raises(ValueError, match="projections must be one of"):
        e2e.build_model(name, projections="mxfp4", **kw)
    with pytest.raises(ValueError, match="has no MoE experts"):
        e2e.build_model("tiny-qwen3", experts="fp8", **kw)
    # a published FP8 model's size at the real dimensions: about half the bf16 weights
    b16, q8 = (e2e.memory_estimate_gb("qwen3-32b", **f) for f in ({}, e2e.fp8_formats("qwen3-32b")))
    assert (
        0.5 < q8["projection_weight_gb"] / b16["projection_weight_gb"] < 0.501
        and 60 < b16["other_weight_gb"] < 70
    )


def test_logits_and_their_error():
    ref = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 4.0]])
    e = e2e.logit_error(ref, ref)
    assert e["rel_err"] == 0 and e["top1_agree"] == 1 and abs(e["kl_mean"]) < 1e-12 and e["positions"] == 2
    off = ref.clone()
    off[0, 0] = 2.5  # position 0's argmax moves
    e = e2e.logit_error(off, ref)
    assert (
        e["rel_err"] == pytest.approx(1.5 / 4)
        and e["max_abs"] == 1.5
        and e["top1_agree"] == 0.5
        and e["kl_max"] > 0
    )
    kw = dict(max_batch=1, max_seq=4, max_tokens=4, num_adapters=1, max_rank=4, seed=1, num_layers=1, **CPU)
    name, fmts = "tiny-qwen3-moe", e2e.fp8_formats("tiny-qwen3-moe")
    f8 = e2e.build_model(name, **fmts, fp8_block=BLOCK, **kw)
    twin = e2e.build_model(name, **fmts, fp8_block=BLOCK, dequantize=True, **kw)
    for m in (f8, twin):
        e2e.load_random_adapter(m, 0, rank=4, alpha=8, seed=5)
    a, b = (e2e.model_logits(m, prompt_len=3, seed=2, adapter=0) for m in (f8, twin))
    assert a.shape == (3, f8.config.vocab_size) and a.dtype == torch.float32 and a.device.type == "cpu"
    err = e2e.logit_error(a, b)
    assert err["rel_err"] < 1e-5 and err["top1_agree"] == 1.0  # weight-only: the same values in another order
    s = e2e.schemes_at(f8, 3)
    assert s == dict(expert_scheme="weight_only", projection_scheme="weight_only")


def _layer_rows():
    rows = []
    for T, us in ((1, (10.0, 12.0, 20.0)), (1600, (300.0, 200.0, 400.0))):
        for var, u in zip(fs.VARIANTS, us):
            fmt = "dense" if var == "dense" else "fp8"
            for part, k in (("base", 1.0), ("total", 1.5)):
                floors = dict(floor_us=5.0, bytes_floor_us=5.0 if fmt == "fp8" else 10.0, flops_floor_us=1.0)
                rows.append(dict(T=T, variant=var, weight_format=fmt, part=part, us_p50=u * k, **floors))
    return pd.DataFrame(rows)


def test_fp8_study_tables_and_targets():
    lt = fs.layer_table(_layer_rows(), {1: "weight_only", 1600: "dynamic"}).set_index("T")
    assert list(lt.fp8_auto) == ["weight_only", "dynamic"] and list(lt.fp8_auto_base) == [10.0, 200.0]
    assert lt.loc[1, "dense_x_fp8_base"] == 2.0 and lt.loc[1600, "dense_x_fp8_base"] == 2.0
    assert (
        lt.loc[1600, "dense_x_fp8_weight_only_base"] == 400 / 300
        and lt.loc[1, "fp8_base_x_bytes_floor"] == 2.0
    )
    assert (
        lt.loc[1, "dense_floor_us"] == 5.0
        and lt.loc[1, "fp8_bytes_floor_us"] == 5.0
        and lt.loc[1, "fp8_lora_x_base"] == 1.5
    )
    dt = fs.dense_table(_layer_rows().assign(model="m", proj="qkv"), {1: "weight_only", 1600: "dynamic"})
    assert list(dt.columns[:3]) == ["model", "proj", "T"] and list(dt.dense_x_fp8_base) == [2.0, 2.0]
    runs = (("fp8", fs.BASE, 100.0), ("fp8", fs.MIXED, 95.0), ("dense", fs.MIXED, 50.0))
    cols = ("model", "concurrency", "format", "scenario", "otps_per_request")
    gen = pd.DataFrame(
        [(m, c, f, s, v) for m in ("moe", "dense") for c in (1, 32) for f, s, v in runs], columns=cols
    )
    gen = gen.assign(otps_aggregate=gen.otps_per_request, ttft_ms_mean=1.0)
    gt = fs.generation_table(gen)
    assert set(gt.otps_fp8_x_dense) == {1.9} and set(gt.otps_adapters_x_base) == {0.95}
    t = fs.targets_table(lt.reset_index(), gt, moe_model="moe", dense_model="dense", small_tokens=[1],
                         large_tokens=[1600], concurrency=[1, 32], dense_concurrency=[1])  # fmt: skip
    got = {(r.target, r.model, r.point): (r.value, r.met) for r in t.itertuples()}
    assert got[("moe_dense_x_fp8_base", "moe", "T = 1600 (dynamic)")] == (2.0, True)
    assert got[("moe_fp8_base_x_bytes_floor", "moe", "T = 1 (weight_only)")] == (2.0, False)
    assert got[("otps_moe_fp8_x_dense", "moe", "32 requests")] == (1.9, True)
    assert got[("otps_moe_fp8_adapters_x_base", "moe", "1 request")] == (0.95, True)
    assert got[("otps_dense_fp8_x_dense", "dense", "1 request")] == (1.9, True) and len(t) == 7
    lines = fs.target_lines(t)
    assert len(lines) == len(fs.TARGETS) and any("**missed** at 1 of 1" in x for x in lines)
