"""The block-FP8 weight path of the MoE base GEMMs (``W_FP8`` in moelora_lib.kernels.triton_kernels, the FP8
branch of the stage-gemv K loop): float8_e4m3fn experts with one scale per (bn, bk) block (Qwen3 FP8
checkpoints, moelora_lib.quant.fp8) scaled in registers.

CPU: the Triton interpreter in fp32 and fp16. A GEMM or a layer on FP8 weights must equal the same GEMM or
layer on ``dequantize_fp8_block``'d dense weights in the activations' dtype — bit for bit for the
tensor-core stages (same operand values, same sums), within 1e-5 for stage gemv — and the fp32 reference
within the tolerance table. sm_90: the FP8 variants of the four base GEMM launches compile (no GPU).
"""

from __future__ import annotations

import pytest
import torch
from quant_helpers import (
    DT_IDS,
    F16,
    F32,
    FP8_SM90,
    K_TOP,
    SPLIT_DOWN,
    E,
    L,
    R,
    adapted_layers,
    assert_gemm_equals_dense,
    assert_layer_equals_dense,
    fp8_experts,
    fp8_weight,
    functional_args,
    layer_reference,
    sm90_report,
    split_down_outputs,
)

from moelora_lib import fused_moe_lora
from moelora_lib.kernels import STAGES
from moelora_lib.kernels.config import LayerConfig, OpConfig
from moelora_lib.kernels.launchers import fused_moe_gemm
from moelora_lib.kernels.stages import fp8_config
from moelora_lib.layer import MoELoRALayer
from moelora_lib.quant import FP8BlockWeight
from moelora_lib.reference import route_reference
from moelora_lib.routing import align_tokens
from moelora_lib.testing import assert_close_rel


def _dense(w: FP8BlockWeight, dt) -> torch.Tensor:
    """The exact weights in the activations' dtype (fp32 product rounded once, as the kernels)."""
    return w.dequantize(dt)


# --------------------------------------------------------------------------------------------------
# the base GEMM launcher
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [F32, F16], ids=DT_IDS.get)
@pytest.mark.parametrize(
    "K,bk,block,down,scale_dtype",
    [
        (64, 32, (16, 64), False, F32),  # EVEN_K, two K steps in one scale column, rows_div = top_k
        (96, 32, (40, 32), True, F16),  # masked last step, ragged N blocks (48 = 40 + 8), fp16 scales
        (96, 16, (24, 64), False, F32),  # ragged last K block (96 = 64 + 32), four K steps per column
        (32, 64, (32, 64), True, F32),  # K < BLOCK_SIZE_K: one masked step
    ],
)
def test_gemm_equals_dequantized_dense(dt, K, bk, block, down, scale_dtype):
    # N = 48: a ragged last N tile of 32
    w = fp8_weight((E, 48, K), seed=K + bk, block=block, scale_dtype=scale_dtype)
    assert_gemm_equals_dense(w, _dense(w, dt), dt, OpConfig(16, 32, bk), down)


def test_gemm_bad_block_sizes_name_the_argument():
    E, N, K, T = 2, 32, 64, 3
    w = fp8_weight((E, N, K), seed=0, block=(16, 32))
    align = align_tokens(torch.zeros(T, 1, dtype=torch.int32), E, 16)
    x, out = torch.randn(T, K), torch.empty(T, N)
    # BLOCK_SIZE_K 64 spans two 32-column scale blocks
    with pytest.raises(ValueError, match=r"cfg\.BLOCK_SIZE_K = 64 must divide the FP8 scale block's 32 col"):
        fused_moe_gemm(x, w, out, align, OpConfig(16, 32, 64), rows_div=1)
    # activations whose K (48) is not the weight's 64
    with pytest.raises(ValueError, match=r"x must have K = 64 columns, the K of the FP8 weight w"):
        fused_moe_gemm(torch.randn(T, 48), w, out, align, OpConfig(16, 32, 32), rows_div=1)
    # without the expert dim
    w2d = FP8BlockWeight(w.weight[0], w.scale_inv[0], w.block)
    with pytest.raises(ValueError, match=r"w: an FP8 expert weight must be \[E, N, K\]"):
        fused_moe_gemm(x, w2d, out, align, OpConfig(16, 32, 32), rows_div=1)


def test_fp8_config_lowers_block_size_k():
    big, lora = OpConfig(16, 32, 128), OpConfig(16, 32, 64)
    cfg = LayerConfig(big, OpConfig(16, 32, 32), lora, lora, lora, lora)
    low = fp8_config(cfg, 48)  # 48 = 16·3: K steps of 16
    assert low.base_gate_up.BLOCK_SIZE_K == 16 and low.base_down.BLOCK_SIZE_K == 16
    assert low.gate_up_shrink == lora  # the LoRA ops keep theirs
    assert fp8_config(cfg, 128) is cfg  # 128 and 32 divide 128
    assert fp8_config(cfg, 24) is cfg  # no K step ≥ 16 fits 24 columns: left to the refusal


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------
def _layers(dt, stage, act, S, bias, H, I, block, config=None):
    """(FP8 layer, the same layer on the dequantized dense weights), the same adapters in slots 0, 1."""
    w13, w2 = fp8_experts(H, I, block)
    return *adapted_layers(w13, w2, dt, stage, act, S, bias, config, dense=_dense), (w13, w2)


_OP = OpConfig(16, 32, 32)
_FIXED = LayerConfig(_OP, _OP, _OP, _OP, _OP, _OP)
# (dtype, stage, activation, S, bias, H, I, block, config): bit for bit needs the dense layer to sum in
# the same K steps, so a block's columns are at least the config's BLOCK_SIZE_K (or the config is fixed)
LAYER_CASES = [
    (F32, "tuned", "silu", 2, False, 64, 64, (32, 128), None),  # EVEN_K, the CPU tuned configs
    (F16, "tuned", "swigluoai", 1, True, 64, 64, (24, 64), _FIXED),  # interleaved gate/up, biases, S = 1
    (F32, "tuned", "swigluoai", 2, True, 96, 48, (40, 64), _FIXED),  # ragged K and N blocks, masked K
    (F16, "fused", "silu", 2, True, 64, 64, (32, 128), None),  # the expand and the activation inside
    (F32, "fused", "swigluoai", 1, True, 96, 48, (40, 64), _FIXED),  # stage fused, ragged blocks
]


@pytest.mark.parametrize(
    "dt,stage,act,S,bias,H,I,block,config",
    LAYER_CASES,
    ids=[f"{c[1]}-{c[2]}-S{c[3]}-H{c[5]}-I{c[6]}-b{c[7][0]}x{c[7][1]}-{DT_IDS[c[0]]}" for c in LAYER_CASES],
)
def test_layer_equals_dequantized_dense_layer(device, dt, stage, act, S, bias, H, I, block, config):
    if device != "cpu":
        pytest.skip("CPU interpreter test (fp16/fp32)")
    f8, dense, (w13, w2) = _layers(dt, stage, act, S, bias, H, I, block, config)
    for T in (1, 33):  # a decode token; 66 pairs with ragged last blocks
        assert f8.config_for(T) == dense.config_for(T)
        assert_layer_equals_dense(f8, dense, w13, w2, act, T, H, dt)


@pytest.mark.parametrize("act,bias", [("silu", False), ("swigluoai", True)])
def test_layer_gemv_close_to_dequantized_dense_layer(device, act, bias):
    # stage gemv: a per-element scale gather (any block, any BLOCK_SIZE_K); ragged K and N blocks
    if device != "cpu":
        pytest.skip("CPU interpreter test (fp16/fp32)")
    f8, dense, (w13, w2) = _layers(F32, "gemv", act, 2, bias, 96, 48, (40, 48))
    for T in (1, 5):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, 96, generator=g)
        tw, ti = route_reference(torch.randn(T, E, generator=g), K_TOP)
        ids = torch.tensor([0, -1, 1, 2, 0][:T], dtype=torch.int32)
        out = f8(x, topk_weights=tw.float(), topk_ids=ti.to(torch.int32), lora_ids=ids)
        want = dense(x, topk_weights=tw.float(), topk_ids=ti.to(torch.int32), lora_ids=ids)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert_close_rel(out, layer_reference(f8, x, w13, w2, tw, ti, ids, act), F32)


def test_layer_block_size_k_lowered_and_fp8_parameters():
    # a scale block of 48 columns: the tuned base GEMMs step 16 along K (one scale column per step)
    f8, dense, _ = _layers(F32, "tuned", "silu", 2, False, 96, 48, (32, 48))
    cfg = f8.config_for(5)
    assert cfg.base_gate_up.BLOCK_SIZE_K == 16 and cfg.base_down.BLOCK_SIZE_K == 16
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(5, 96, generator=g), torch.randn(5, E, generator=g)
    ids = torch.tensor([0, -1, 1, 1, -1], dtype=torch.int32)
    assert_close_rel(f8(x, logits, lora_ids=ids), dense(x, logits, lora_ids=ids).double(), F32, tol=1e-5)
    # the FP8 tensors are the layer's parameters (w13/w2 None), counted by memory_report
    params = dict(f8.named_parameters())
    assert set(params) == {"w13_fp8", "w13_scale_inv", "w2_fp8", "w2_scale_inv"} and f8.w13 is None
    assert params["w13_fp8"].dtype == torch.float8_e4m3fn and params["w2_scale_inv"].shape == (E, 3, 1)
    assert f8.weight_format == "fp8" and "weights=fp8" in repr(f8)
    w13, w2 = f8.expert_weights()
    assert isinstance(w13, FP8BlockWeight) and w13.block == (32, 48) and w2.shape == (E, 96, 48)
    nbytes = sum(p.numel() * p.element_size() for p in f8.parameters())
    assert f8.memory_report()["weights"] == nbytes == E * (2 * 48 * 96 + 96 * 48) + 4 * E * (3 * 2 + 3 * 1)
    assert set(f8.state_dict()) == set(params)


def test_layer_dtype_cast_keeps_fp8_weights():
    # .to(dtype) casts the adapter slots (the layer's activation dtype) but not the e4m3 codes and scales
    f8, dense, _ = _layers(F32, "tuned", "silu", 2, False, 64, 64, (32, 128))
    codes = f8.w13_fp8.detach().clone()
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(3, 64, generator=g), torch.randn(3, E, generator=g)
    ids = torch.tensor([0, -1, 1], dtype=torch.int32)
    f8.to(F16)
    dense.to(F16)
    assert f8.w13_fp8.dtype == torch.float8_e4m3fn and torch.equal(
        f8.w13_fp8.view(torch.uint8), codes.view(torch.uint8)
    )
    assert f8.w2_scale_inv.dtype == torch.float32 and f8.lora_a13.dtype == F16
    out = f8(x.half(), logits, lora_ids=ids)
    assert out.dtype == F16
    assert_close_rel(out, dense(x.half(), logits, lora_ids=ids).double(), F16)


@pytest.mark.parametrize("dt", [F16], ids=DT_IDS.get)
def test_layer_fused_split_down(dt):
    # stage fused's down GEMM split over K: I = 64 in two K steps of 32, one per program, each reading its
    # own scale column (k counts from the split's first block)
    f8, dense, _ = _layers(dt, "fused", "swigluoai", 1, True, 64, 64, (16, 32), config=SPLIT_DOWN)
    *_, out, want = split_down_outputs(f8, dense, dt)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()


def test_layer_bad_weights_name_the_argument():
    H, I = 64, 32
    w13, w2 = fp8_weight((E, 2 * I, H), seed=1, block=(32, 32)), fp8_weight((E, H, I), seed=2, block=(32, 32))
    kw = dict(top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=8, dtype=F32)
    with pytest.raises(ValueError, match=r"^w2 must be an FP8BlockWeight like w13"):
        MoELoRALayer(w13, _dense(w2, F32), **kw)
    with pytest.raises(ValueError, match=r"^w13 must be an FP8BlockWeight like w2"):
        MoELoRALayer(_dense(w13, F32), w2, **kw)
    # dense shapes that disagree: named as for dense weights
    with pytest.raises(ValueError, match=r"^w2 must have shape \[E, H, I\] = \(4, 64, 32\)"):
        MoELoRALayer(w13, fp8_weight((E, H, 64), seed=3, block=(32, 32)), **kw)
    # a scale block of 24 columns: no K step of 16 or more reads a single scale column
    with pytest.raises(ValueError, match=r"^w2\.block = \(32, 24\): the scale block's 24 columns"):
        MoELoRALayer(w13, fp8_weight((E, H, I), seed=2, block=(32, 24)), **kw)
    # two scale blocks: one K-step rule and one W8A8 group size serve both GEMMs, so both must agree
    with pytest.raises(ValueError, match=r"^w2\.block = \(16, 16\) must equal w13\.block = \(32, 32\)"):
        MoELoRALayer(w13, fp8_weight((E, H, I), seed=2, block=(16, 16)), **kw)
    # e4m3 codes strided along K
    wide = torch.zeros(E, H, 2 * I, dtype=torch.float8_e4m3fn)[..., ::2]
    strided = FP8BlockWeight(wide, w2.scale_inv, w2.block)
    with pytest.raises(ValueError, match=r"^w2\.weight must be contiguous along K"):
        MoELoRALayer(w13, strided, **kw)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"dtype \(the layer's, with FP8 weights\)"):
            MoELoRALayer(w13, w2, **{**kw, "dtype": None})


def _with_byte(w: FP8BlockWeight, index: tuple, byte: int) -> FP8BlockWeight:
    """A copy of ``w`` whose code at ``index`` is the e4m3 byte ``byte``."""
    q = w.weight.clone()
    q.view(torch.uint8)[index] = byte
    return FP8BlockWeight(q, w.scale_inv, w.block)


def test_layer_non_finite_weights_and_biases_refused():
    # FP8 codes and scales and the biases are checked for NaN/inf at construction, as dense weights are
    H, I = 64, 32
    w13, w2 = fp8_weight((E, 2 * I, H), seed=1, block=(32, 32)), fp8_weight((E, H, I), seed=2, block=(32, 32))
    kw = dict(top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=8, dtype=F32)
    for byte in (0x7F, 0xFF):  # e4m3fn's two NaN codes
        with pytest.raises(ValueError, match=r"^w2\.weight holds the float8_e4m3fn NaN code"):
            MoELoRALayer(w13, _with_byte(w2, (3, 5, 7), byte), **kw)
    for bad in (float("nan"), float("inf")):
        s = w13.scale_inv.clone()
        s[1, 0, 1] = bad
        with pytest.raises(ValueError, match=r"^w13\.scale_inv holds NaN or inf"):
            MoELoRALayer(FP8BlockWeight(w13.weight, s, w13.block), w2, **kw)
    b13, b2 = torch.zeros(E, 2 * I), torch.zeros(E, H)
    b13[2, 3], b2[0, 1] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"^b13 holds non-finite values"):
        MoELoRALayer(w13, w2, b13=b13, **kw)
    with pytest.raises(ValueError, match=r"^b2 holds non-finite values"):
        MoELoRALayer(w13, w2, b2=b2, **kw)
    # the largest finite codes (±448) are no NaN: accepted, and the layer is the fp32 reference's
    big13 = _with_byte(_with_byte(w13, (0, 0, 0), 0x7E), (1, 2, 3), 0xFE)
    layer = MoELoRALayer(big13, w2, **kw)
    x, logits = torch.randn(4, H) * 0.1, torch.randn(4, E)
    ids = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    tw, ti = route_reference(logits, K_TOP)
    out = layer(x, topk_weights=tw.float(), topk_ids=ti.to(torch.int32), lora_ids=ids)
    want = layer_reference(layer, x, big13, w2, tw.float(), ti, ids, "silu")
    assert_close_rel(out, want, F32)


@pytest.mark.parametrize("stage", ["tuned", "fused", "gemv"])
def test_fused_moe_lora_takes_fp8_weights(device, stage):
    # the functional API on FP8 weights: the serving layer's result bit for bit, and the dense call on the
    # dequantized weights with the same (lowered) config
    if device != "cpu":
        pytest.skip("CPU interpreter test (fp16/fp32)")
    dt, H, I = F16, 64, 32
    f8, dense, (w13, w2) = _layers(dt, stage, "swigluoai", 1, True, H, I, (16, 16))
    T = 6
    x, tw, ti, ids, slots, kw = functional_args(f8, "swigluoai", stage, T, H, dt)
    out = fused_moe_lora(x, w13, w2, tw, ti, ids, *slots, **kw)
    assert out.dtype == dt and out.shape == (T, H)
    assert torch.equal(out, f8(x, topk_weights=tw, topk_ids=ti, lora_ids=ids))
    if stage != "gemv":
        cfg = fp8_config(STAGES[stage].config_for(f8._dims(T)), 16)
        want = fused_moe_lora(x, _dense(w13, dt), _dense(w2, dt), tw, ti, ids, *slots, **kw, config=cfg)
        assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    with pytest.raises(ValueError, match=r"^w2 must be an FP8BlockWeight like w13"):
        fused_moe_lora(x, w13, _dense(w2, dt), tw, ti, ids, *slots, **kw)
    with pytest.raises(ValueError, match=r"^w2 .*I=32"):  # w2 of I = 64 where the rest says 32
        fused_moe_lora(x, w13, fp8_weight((E, H, 64), seed=5, block=(16, 16)), tw, ti, ids, *slots, **kw)


# --------------------------------------------------------------------------------------------------
# sm_90: the FP8 variants compile (no GPU)
# --------------------------------------------------------------------------------------------------
def test_fp8_variants_compile_for_sm90():
    # the base GEMM launches on block-FP8 weights at qwen3-30b-a3b T = 64 (quant_helpers.fp8_sm90_report)
    r = sm90_report(FP8_SM90)
    print(f"\nFP8 base GEMMs, sm_90, qwen3-30b-a3b T=64: {r}")
    assert set(r) == {"base_gate_up", "base_down", "fused_gate_up", "fused_down"}
    for op, v in r.items():
        assert v["W_FP8"] is True and v["mma"] > 0, (op, v)


def test_values_beyond_the_layer_dtype_refused():
    # a scale that puts a code beyond float16's range (448 · 200 = 89600 > 65504) would make every row
    # reading it inf/NaN in a float16 layer: refused naming the weight (MoELoRALayer and LoRALinear); the
    # float32 layer takes it and equals the fp32 reference
    from moelora_lib import LoRALinear

    H, I = 64, 32
    w13, w2 = fp8_weight((E, 2 * I, H), seed=1, block=(32, 32)), fp8_weight((E, H, I), seed=2, block=(32, 32))
    s = w13.scale_inv.clone()
    s[2, 1, 0] = 200.0
    big = FP8BlockWeight(w13.weight, s, w13.block)
    assert big.dequantize(F32)[2, 32:64, 0:32].abs().max() == 448 * 200
    kw = dict(top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=8)
    with pytest.raises(ValueError, match=r"^w13: dequantized to the layer's dtype torch\.float16, some"):
        MoELoRALayer(big, w2, dtype=F16, **kw)
    lin = FP8BlockWeight(big.weight[2], big.scale_inv[2], big.block)
    with pytest.raises(ValueError, match=r"^weight: dequantized to the layer's dtype torch\.float16"):
        LoRALinear(lin, num_adapters=2, max_rank=4, max_tokens=8, dtype=F16)
    layer = MoELoRALayer(big, w2, dtype=F32, **kw)
    x, logits = torch.randn(4, H) * 0.01, torch.randn(4, E)
    ids = torch.full((4,), -1, dtype=torch.int32)
    tw, ti = route_reference(logits, K_TOP)
    out = layer(x, topk_weights=tw.float(), topk_ids=ti.to(torch.int32), lora_ids=ids)
    assert torch.isfinite(out).all()
    assert_close_rel(out, layer_reference(layer, x, big, w2, tw.float(), ti, ids, "silu"), F32)
