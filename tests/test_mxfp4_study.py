"""Notebook 14's study helpers for MXFP4 experts on the CPU (tiny presets, Triton interpreter, fp32).

* ``moe_bench``: expert weights quantized a few experts at a time equal the quantizer on the whole tensor;
  the formats convert both ways; the base GEMMs' bytes count 4.25 bits per MXFP4 weight; ``bench_layer``,
  ``check_layer`` and ``bench_module`` take MXFP4 experts; the ``matmul_ogs`` anchor table reads the copied
  CSVs.
* ``e2e``: a model with MXFP4 experts holds the dense model's random experts quantized; its memory against
  the estimate made before building; GPT-OSS-120B's config derived from GPT-OSS-20B's.
"""

from __future__ import annotations

import math

import pytest
import torch

from moelora_lib.quant import MXFP4Weight, quantize_mxfp4
from moelora_lib.studies import e2e, serving
from moelora_lib.studies import moe_bench as mb
from moelora_lib.testing import TOLERANCES

CPU = dict(dtype=torch.float32, device="cpu")
KW = dict(rank=4, num_adapters=3, seed=0, **CPU)


@pytest.fixture(scope="module")
def weights():
    """Dense (fp32) and MXFP4 weight sets of tiny-oss (swigluoai, biases), the same adapters."""
    dense = mb.layer_inputs("tiny-oss", 1, bias=True, **KW)
    return {"dense": dense, "mxfp4": mb.with_weight_format(dense, "mxfp4")}


def test_quantize_experts_equals_the_whole_tensor_and_refuses_bad_weights():
    w = torch.randn(5, 8, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    for max_elements in (1, 8 * 64, 3 * 8 * 64, 1 << 24):  # one expert per step, a few, all at once
        q = mb.quantize_experts(w, max_elements=max_elements)
        assert isinstance(q, MXFP4Weight) and q.shape == (5, 8, 64)
        assert torch.equal(q.blocks, blocks) and torch.equal(q.scales, scales)
    with pytest.raises(ValueError, match=r"quantize_experts: w must be a tensor \[E, N, K\]"):
        mb.quantize_experts(w[0])
    with pytest.raises(ValueError, match="K = 48 .* multiple of 32"):
        mb.quantize_experts(torch.randn(2, 4, 48))


def test_weight_formats_convert_both_ways(weights):
    dense, mx = weights["dense"], weights["mxfp4"]
    assert mb.weight_format_of(dense) == "dense" and mb.weight_format_of(mx) == "mxfp4"
    assert mx.lora_a13 is dense.lora_a13 and mx.b13 is dense.b13  # only the experts change
    assert mb.with_weight_format(mx, "mxfp4") is mx and mb.with_weight_format(dense, "dense") is dense
    back = mb.with_weight_format(mx, "dense")
    assert back.w13.dtype == torch.float32 and torch.equal(back.w13, mx.w13.dequantize(torch.float32))
    assert torch.equal(back.w2, mx.w2.dequantize(torch.float32))
    with pytest.raises(ValueError, match="weight_format must be one of"):
        mb.with_weight_format(dense, "int4")
    # layer_inputs with reused MXFP4 weights: the activations take the adapters' dtype and device
    inp = mb.layer_inputs("tiny-oss", 5, weights=mx, **KW)
    assert (
        inp.w13 is mx.w13 and inp.hidden_states.dtype == torch.float32 and inp.hidden_states.shape == (5, 64)
    )
    assert (
        mb.weight_format_of(mb.layer_inputs("tiny-oss", 5, weights=dense, weight_format="mxfp4", **KW))
        == "mxfp4"
    )


def test_op_costs_count_mxfp4_bytes_for_the_base_gemms_only(weights):
    inp = mb.layer_inputs("tiny-oss", 6, weights=weights["dense"], **KW)
    run = mb.make_run("tuned", inp)
    c = dict(dtype_bytes=4, topk_ids=inp.topk_ids, lora_ids=inp.lora_ids)
    dense = {r["op"]: r for r in mb.op_costs("tiny-oss", run.dims, **c)}
    mx = {r["op"]: r for r in mb.op_costs("tiny-oss", run.dims, **c, weight_bytes=mb.MXFP4_BYTES_PER_WEIGHT)}
    assert mb.MXFP4_BYTES_PER_WEIGHT == 17 / 32  # 4.25 bits
    for op in dense:
        if op in mb.BASE_OPS:
            assert mx[op]["weight_bytes"] == pytest.approx(dense[op]["weight_bytes"] * 17 / 32 / 4)
            assert mx[op]["bytes"] - mx[op]["weight_bytes"] == dense[op]["bytes"] - dense[op]["weight_bytes"]
        else:
            assert mx[op] == dense[op]
    with pytest.raises(ValueError, match="weight_bytes must be None or a number > 0"):
        mb.op_costs("tiny-oss", run.dims, weight_bytes=0)


def test_bench_layer_and_check_layer_take_mxfp4_experts(weights):
    rows = {}
    for fmt in ("dense", "mxfp4"):
        for r in mb.bench_layer("tuned", "tiny-oss", 2, weights=weights[fmt], parts=("base", "total"), **KW):
            rows[fmt, r["part"]] = r
    assert {r["weight_format"] for (f, _), r in rows.items() if f == "mxfp4"} == {"mxfp4"}
    assert (
        rows["dense", "base"]["weight_format"] == "dense"
        and rows["mxfp4", "base"]["mode"] == "cpu-interpreter"
    )
    assert rows["mxfp4", "base"]["bytes"] < rows["dense", "base"]["bytes"]
    lora = {f: rows[f, "total"]["bytes"] - rows[f, "base"]["bytes"] for f in ("dense", "mxfp4")}
    assert lora["dense"] == lora["mxfp4"]  # the adapters stay in the activations' dtype
    # weight_format converts dense weights on the fly
    r = mb.bench_layer(
        "gemv", "tiny-oss", 1, weights=weights["dense"], weight_format="mxfp4", parts=("base",), **KW
    )
    assert r[0]["weight_format"] == "mxfp4" and r[0]["stage"] == "gemv"
    for stage in ("tuned", "fused", "gemv"):
        c = mb.check_layer(stage, "tiny-oss", 5, weights=weights["mxfp4"], **KW)
        assert c["weight_format"] == "mxfp4" and c["dtype"] == "float32"
        assert (
            c["rel_err"] <= TOLERANCES[torch.float32] and c["rel_err_vs_dense"] <= TOLERANCES[torch.float32]
        )
        assert c["no_adapter_bitwise"] and c["delta_rel"] > 0
        # every stage dots the operand values of the dequantized weights; the packed kernels sum the even and
        # the odd K apart, so the rounding differs (fp32: within 1e-5, as tests/test_stage_gemv_layer.py)
        assert c["rel_err_vs_dense"] <= 1e-5 and isinstance(c["bitwise_vs_dense"], bool)
    c = mb.check_layer("tuned", "tiny-oss", 5, weights=weights["dense"], **KW)
    assert (
        c["weight_format"] == "dense" and math.isnan(c["rel_err_vs_dense"]) and c["bitwise_vs_dense"] is None
    )


def test_bench_module_times_the_layer_from_logits(weights):
    layer = serving.build_layer(weights["mxfp4"], "tiny-oss", max_tokens=4, stage="auto", dtype=torch.float32)
    inp = mb.layer_inputs("tiny-oss", 3, weights=weights["mxfp4"], **KW)
    rows = mb.bench_module(layer, inp, "tiny-oss")
    assert [r["part"] for r in rows] == ["base", "total"] and layer.active_slots is None
    assert all(r["stage"] == "auto" and r["resolved_stage"] == layer.stage_for(3).name for r in rows)
    assert all(r["weight_format"] == "mxfp4" and r["mode"] == "cpu-interpreter" and r["T"] == 3 for r in rows)
    assert rows[0]["bytes"] < rows[1]["bytes"] and rows[0]["floor_us"] > 0
    with pytest.raises(ValueError, match="bench_module: parts must be among"):
        mb.bench_module(layer, inp, "tiny-oss", parts=("lora",))


def test_mxfp4_anchor_table_reads_the_copied_rows():
    t = mb.mxfp4_anchor_table().set_index("T")
    assert list(t.index) == [1, 8, 64, 256, 1600, 8192] and set(t.model) == {"gpt-oss-20b"}
    assert t.loc[1, "tk_us"] == pytest.approx(90.752) and t.loc[1, "routing_us"] == pytest.approx(19.872)
    # the floor the anchor quotes: 4 touched experts of GPT-OSS-20B at 4.25 bits per weight
    assert t.loc[1, "weight_bytes"] == 4 * 3 * 2880 * 2880 * mb.MXFP4_BYTES_PER_WEIGHT
    assert (t.tk_floor_us < t.tk_us).all() and t[["gate_up_us", "down_us"]].notna().all().all()


def test_build_model_with_mxfp4_experts_and_its_memory():
    kw = dict(max_batch=2, max_seq=8, max_tokens=16, num_adapters=2, max_rank=4, seed=3, **CPU)
    dense = e2e.build_model("tiny-gpt-oss", **kw)
    mx = e2e.build_model("tiny-gpt-oss", experts="mxfp4", **kw)
    for ld, lm in zip(dense.layers, mx.layers):
        d, m = ld.mlp.experts, lm.mlp.experts
        assert d.weight_format == "dense" and m.weight_format == "mxfp4"
        for w_d, w_m in zip(d.expert_weights(), m.expert_weights()):  # the same random experts, quantized
            q = mb.quantize_experts(w_d)
            assert torch.equal(q.blocks, w_m.blocks) and torch.equal(q.scales, w_m.scales)
        assert torch.equal(d.b13, m.b13) and torch.equal(
            ld.self_attn.o_proj.weight, lm.self_attn.o_proj.weight
        )
    mem = {f: e2e.model_memory(m) for f, m in (("dense", dense), ("mxfp4", mx))}
    assert mem["dense"]["other_weight_gb"] == mem["mxfp4"]["other_weight_gb"] and math.isnan(
        mem["mxfp4"]["allocated_gb"]
    )
    # fp32 experts: 32 bits -> 4.25 bits per weight (the biases stay fp32)
    assert 17 / 32 / 4 < mem["mxfp4"]["expert_weight_gb"] / mem["dense"]["expert_weight_gb"] < 0.2
    sizes = dict(num_adapters=2, max_rank=4, max_batch=2, max_seq=8, max_tokens=16, dtype_bytes=4)
    for f in ("dense", "mxfp4"):
        est = e2e.memory_estimate_gb("tiny-gpt-oss", experts=f, **sizes)
        assert est["expert_weight_gb"] == pytest.approx(mem[f]["expert_weight_gb"])
        assert est["other_weight_gb"] == pytest.approx(mem[f]["other_weight_gb"], rel=1e-3)
        assert est["adapter_slot_gb"] + est["kv_gb"] == pytest.approx(mem[f]["buffer_gb"], rel=1e-2)
    with pytest.raises(ValueError, match="experts must be one of"):
        e2e.build_model("tiny-gpt-oss", experts="int4", **kw)
    with pytest.raises(ValueError, match="has no MoE experts"):
        e2e.build_model("tiny-qwen3", experts="mxfp4", **kw)


def test_gpt_oss_120b_config_and_estimates():
    c20, c120 = e2e.model_config("gpt-oss-20b"), e2e.model_config("gpt-oss-120b")
    assert (c120.num_hidden_layers, c120.num_experts, c120.num_experts_per_tok) == (36, 128, 4)
    assert c120.layer_types == ("sliding_attention", "full_attention") * 18
    assert (c120.hidden_size, c120.moe_intermediate_size, c120.vocab_size) == (2880, 2880, c20.vocab_size)
    d = e2e.config_dict("gpt-oss-120b")
    d["layer_types"].append("x")  # a fresh copy each time
    assert len(e2e.config_dict("gpt-oss-120b")["layer_types"]) == 36
    assert e2e.config_dict("gpt-oss-20b")["num_hidden_layers"] == 24
    mx, bf = (e2e.memory_estimate_gb("gpt-oss-120b", experts=f) for f in ("mxfp4", "dense"))
    # the published figures: ≈ 65 GB with MXFP4 experts, ≈ 240 GB in bf16 (weights alone)
    assert 60 < mx["expert_weight_gb"] + mx["other_weight_gb"] < 70
    assert 220 < bf["expert_weight_gb"] + bf["other_weight_gb"] < 250
    with pytest.raises(ValueError, match="unknown model"):
        e2e.config_dict("gpt-oss-7b")
