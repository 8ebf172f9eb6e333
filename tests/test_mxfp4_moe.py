"""The MXFP4 weight path of the MoE base GEMMs (``W_MXFP4`` in moelora_lib.kernels.triton_kernels): packed
e2m1 blocks and e8m0 scales (GPT-OSS's published layout, moelora_lib.quant.mxfp4) decoded in registers.

CPU: the Triton interpreter in fp32 and fp16 (bf16 arithmetic is wrong there, environment.md §2). The decode
must equal ``dequantize_mxfp4`` bit for bit (every code, every scale byte, both nibbles); a GEMM whose
activation rows each hold one nonzero value must equal x_k·W[e, n, k] exactly (each decoded weight reaches
the dot unchanged, in the even and in the odd K). A GEMM or a layer on packed weights must equal the same
GEMM or layer on the dequantized dense weights in the activations' dtype within rounding (the packed path
sums the even and the odd K in two dots, another order than the dense dot: fp32 within 1e-5, as the gemv
MXFP4 tests; fp16 within one fp16 rounding of the outputs, 2^-10) and the fp32 reference within the
tolerance table. sm_90: the MXFP4 variants of the four base GEMM launches compile (no GPU needed).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from quant_helpers import (
    DT_IDS,
    F16,
    F32,
    K_TOP,
    MXFP4_SM90,
    SPLIT_DOWN,
    E,
    L,
    R,
    adapted_layers,
    assert_gemm_equals_dense,
    assert_layer_equals_dense,
    functional_args,
    layer_reference,
    sm90_report,
    split_down_outputs,
)

from moelora_lib import fused_moe_lora
from moelora_lib.kernels import STAGES
from moelora_lib.kernels.config import LayerConfig, OpConfig
from moelora_lib.kernels.launchers import fused_moe_gemm
from moelora_lib.kernels.stages import mxfp4_config
from moelora_lib.kernels.triton_kernels import _mxfp4_w
from moelora_lib.layer import MoELoRALayer
from moelora_lib.quant.mxfp4 import MXFP4Weight, dequantize_mxfp4
from moelora_lib.reference import route_reference
from moelora_lib.routing import align_tokens
from moelora_lib.testing import assert_close_rel

# packed vs the dequantized dense weights: the same products summed in another order (fp32: as the gemv MXFP4
# tests; fp16: the outputs, rounded to fp16, may differ by a rounding)
DENSE_TOL = {F32: 1e-5, F16: 2.0**-10}


def _mx(shape, seed, scale=0.1) -> MXFP4Weight:
    g = torch.Generator().manual_seed(seed)
    return MXFP4Weight.quantize(torch.randn(*shape, generator=g) * scale)


def _dense(w: MXFP4Weight, dt) -> torch.Tensor:
    """The exact weights in the activations' dtype: dequantized in fp32, rounded once (as the kernel)."""
    return w.dequantize(torch.float32).to(dt)


def _same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit-identical floats, NaN positions included (any NaN payload)."""
    nan = torch.isnan(ref)
    if not torch.equal(torch.isnan(out), nan):
        return False
    return torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))


# --------------------------------------------------------------------------------------------------
# the decode: every code in both nibbles, every scale byte
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode_probe(q_ptr, s_ptr, out_ptr, k_left, EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # the kernels' pointer tiles: bytes [BK/2, BN] and scales [BK/32, BN] of rows n, K down the rows;
    # W_lo goes to out rows 2j, W_hi to rows 2j + 1 (out [BK, BN] = W tile transposed)
    offs_n = tl.arange(0, BN)
    offs_kb = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    wq_ptrs = q_ptr + offs_kb[:, None] + offs_n[None, :] * (BK // 2)
    ws_ptrs = s_ptr + offs_ks[:, None] + offs_n[None, :] * (BK // 32)
    lo, hi = _mxfp4_w(wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
    out_ptrs = out_ptr + (2 * offs_kb)[:, None] * BN + offs_n[None, :]
    tl.store(out_ptrs, lo)
    tl.store(out_ptrs + BN, hi)


# the interpreter's numpy reports the overflow to inf and the 0·inf = NaN that the test asks for
@pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)
def test_decode_every_code_and_scale_byte_is_exact():
    # row n has scale byte min(n, 254) in all 16 blocks and the 256 bytes 0..255 (every (low, high) code
    # pair):
    # the decoded fp32 tile equals dequantize_mxfp4 bit for bit — subnormal results (byte 0 and 1),
    # overflow to ±inf (bytes 253, 254) included; byte 255 (NaN in e8m0) is refused by the layer and the
    # public call (test_scale_byte_255_refused), so the kernels need not decode it
    N, K = 256, 512
    blocks = torch.arange(256, dtype=torch.uint8).repeat(N, 1).view(N, K // 32, 16).contiguous()
    scales = torch.arange(N).clamp(max=254).to(torch.uint8)[:, None].repeat(1, K // 32).contiguous()
    ref = dequantize_mxfp4(blocks, scales, torch.float32)  # [N, K]
    out = torch.full((K, N), 1234.5)
    _decode_probe[(1,)](blocks, scales, out, K, EVEN_K=True, BN=N, BK=K)
    assert _same(out.T, ref)
    # the masked K step (EVEN_K False): bytes and scales at or beyond k_left elements read as weight 0
    out.fill_(1234.5)
    _decode_probe[(1,)](blocks, scales, out, 96, EVEN_K=False, BN=N, BK=K)
    assert _same(out.T[:, :96], ref[:, :96]) and torch.equal(out[96:], torch.zeros(K - 96, N))


# --------------------------------------------------------------------------------------------------
# the base GEMM launcher
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [F32, F16], ids=DT_IDS.get)
@pytest.mark.parametrize(
    "K,bk,down",
    [
        (64, 32, False),  # EVEN_K, two K steps, rows_div = top_k (gate_up), no bias
        (96, 64, True),  # K % BLOCK_SIZE_K = 32: the masked last step; bias and routing weights (down)
        (32, 64, False),  # K < BLOCK_SIZE_K: one masked step of one scale block
    ],
)
def test_gemm_close_to_dequantized_dense(dt, K, bk, down):
    w = _mx((E, 48, K), seed=K)  # N = 48: a ragged last N tile of 32
    assert_gemm_equals_dense(w, _dense(w, dt), dt, OpConfig(16, 32, bk), down, tol=DENSE_TOL[dt])


@pytest.mark.parametrize("dt", [F32, F16], ids=DT_IDS.get)
def test_gemm_one_nonzero_per_row_is_exact(dt):
    # row p of x holds one nonzero value, at column k = p: every output is x_k·W[e, n, k] rounded once, so
    # each decoded weight, at an even and at an odd k, in both K steps, in the first and the masked last
    # step, reaches the dot exactly (96 = one full step of 64 and a masked one)
    E, N, K = 2, 48, 96
    w = _mx((E, N, K), seed=3)
    topk = torch.arange(K, dtype=torch.int32)[:, None] % E
    align = align_tokens(topk, E, 16)
    g = torch.Generator().manual_seed(2)
    xk = (torch.rand(K, generator=g) + 0.5).to(dt)
    x = torch.diag(xk)  # [K rows, K]
    out = torch.full((K, N), 1234.5, dtype=dt)
    fused_moe_gemm(x, w, out, align, OpConfig(16, 32, 64), rows_div=1)
    wd = _dense(w, dt).double()[topk[:, 0].long(), :, torch.arange(K)]  # [K, N]: W[e_p, n, p]
    assert torch.equal(out, (xk.double()[:, None] * wd).to(dt))


def test_gemm_bad_inputs_name_the_argument():
    E, N, K, T = 2, 32, 64, 3
    w = _mx((E, N, K), seed=0)
    topk = torch.zeros(T, 1, dtype=torch.int32)
    align = align_tokens(topk, E, 16)
    x, out = torch.randn(T, K), torch.empty(T, N)
    # BLOCK_SIZE_K 16: a K step would split a 32-value scale block
    with pytest.raises(ValueError, match=r"cfg\.BLOCK_SIZE_K = 16 must be a multiple of 32"):
        fused_moe_gemm(x, w, out, align, OpConfig(16, 32, 16), rows_div=1)
    # activations whose K (48) is not the weight's 64 (nor a multiple of 32)
    with pytest.raises(ValueError, match=r"x must have K = 64 columns.*multiple of 32"):
        fused_moe_gemm(torch.randn(T, 48), w, out, align, OpConfig(16, 32, 32), rows_div=1)
    # a row's 16-byte blocks not contiguous (every other 16 bytes of a wider buffer)
    wide = torch.zeros(E, N, K // 32, 32, dtype=torch.uint8)
    strided = MXFP4Weight(wide[..., :16], w.scales)
    with pytest.raises(ValueError, match=r"w\.blocks must be contiguous in its last two dims"):
        fused_moe_gemm(x, strided, out, align, OpConfig(16, 32, 32), rows_div=1)
    # blocks without the expert dim
    with pytest.raises(ValueError, match=r"w: an MXFP4 weight must hold blocks uint8 \[E, N, K/32, 16\]"):
        fused_moe_gemm(x, MXFP4Weight(w.blocks[0], w.scales[0]), out, align, OpConfig(16, 32, 32), rows_div=1)
    # scales of the wrong shape: refused by MXFP4Weight itself, naming scales
    with pytest.raises(ValueError, match=r"scales must have shape blocks\.shape\[:-1\]"):
        MXFP4Weight(w.blocks, w.scales[..., :1])
    # and a K that is not a multiple of 32 cannot be packed at all (the quantizer names w)
    with pytest.raises(ValueError, match=r"w's last dim K must be a multiple of 32"):
        MXFP4Weight.quantize(torch.randn(E, N, 48))


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------
def _layers(dt, stage, act, S, bias, H, I, config=None):
    """(MXFP4 layer, the same layer on the dequantized dense weights), the same adapters in slots 0, 1."""
    w13, w2 = _mx((E, 2 * I, H), seed=H + I), _mx((E, H, I), seed=H * I)
    return *adapted_layers(w13, w2, dt, stage, act, S, bias, config, dense=_dense), (w13, w2)


# (dtype, stage, activation, S, bias, H, I): H and I multiples of 32
LAYER_CASES = [
    (F32, "tuned", "silu", 2, False, 64, 64),  # EVEN_K in both GEMMs
    (F16, "tuned", "swigluoai", 1, True, 64, 64),  # GPT-OSS: interleaved gate/up, clamp, biases, S = 1
    (F32, "tuned", "swigluoai", 2, True, 96, 32),  # masked K: H = 96 (gate_up), I = 32 < BLOCK_SIZE_K (down)
    (F16, "fused", "silu", 2, True, 64, 64),  # stage fused: the expand and the activation inside the GEMMs
    (F32, "fused", "swigluoai", 1, True, 96, 32),  # stage fused, masked K in both GEMMs
]


@pytest.mark.parametrize(
    "dt,stage,act,S,bias,H,I",
    LAYER_CASES,
    ids=[f"{c[1]}-{c[2]}-S{c[3]}-H{c[5]}-I{c[6]}-{DT_IDS[c[0]]}" for c in LAYER_CASES],
)
def test_layer_close_to_dequantized_dense_layer(device, dt, stage, act, S, bias, H, I):
    if device != "cpu":
        pytest.skip("CPU interpreter test (fp16/fp32)")
    mx, dense, (w13, w2) = _layers(dt, stage, act, S, bias, H, I)
    for T in (1, 33):  # a decode token; 66 pairs with ragged last blocks
        # the same operand values; the packed base GEMMs sum the even and the odd K apart
        assert_layer_equals_dense(mx, dense, w13, w2, act, T, H, dt, tol=DENSE_TOL[dt])


def test_layer_block_size_k_16_is_raised_and_packed_parameters():
    # a fixed config whose base GEMMs step 16 along K: the MXFP4 layer launches them with 32 (whole scale
    # blocks), the LoRA ops as given; the result is the dense layer's within the tolerance
    base16 = OpConfig(16, 32, 16)
    lora = OpConfig(16, 32, 32)
    cfg = LayerConfig(base16, base16, lora, lora, lora, lora)
    assert mxfp4_config(cfg).base_gate_up.BLOCK_SIZE_K == 32 and mxfp4_config(cfg).gate_up_shrink == lora
    mx, dense, _ = _layers(F32, "tuned", "silu", 2, False, 64, 32, config=cfg)
    assert mx.config_for(5).base_down.BLOCK_SIZE_K == 32 and dense.config_for(5).base_down.BLOCK_SIZE_K == 16
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(5, 64, generator=g), torch.randn(5, E, generator=g)
    ids = torch.tensor([0, -1, 1, 1, -1], dtype=torch.int32)
    assert_close_rel(mx(x, logits, lora_ids=ids), dense(x, logits, lora_ids=ids).double(), F32, tol=1e-5)
    # the packed tensors are the layer's parameters (w13/w2 None), counted by memory_report
    names = {n for n, _ in mx.named_parameters()}
    assert names == {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales"} and mx.w13 is None
    assert mx.weight_format == "mxfp4" and "weights=mxfp4" in repr(mx)
    packed = sum(p.numel() for p in mx.parameters())  # uint8: one byte each
    assert mx.memory_report()["weights"] == packed == E * (2 * 32 * 64 + 64 * 32) * 17 // 32


@pytest.mark.parametrize("dt", [F16], ids=DT_IDS.get)
def test_layer_fused_split_down(dt):
    # stage fused's down GEMM split over K (decode): I = 64 in two K steps of 32, one per program, each
    # decoding its own scale block (the split's byte and scale offsets); the dense layer's result
    mx, dense, (w13, w2) = _layers(dt, "fused", "swigluoai", 1, True, 64, 64, config=SPLIT_DOWN)
    x, logits, ids, out, want = split_down_outputs(mx, dense, dt)
    assert_close_rel(out, want, tol=DENSE_TOL[dt], what="packed vs dequantized dense layer")
    tw, ti = route_reference(logits, K_TOP)
    assert_close_rel(out, layer_reference(mx, x, w13, w2, tw, ti, ids, "swigluoai"), dt)


def test_layer_bad_weights_name_the_argument():
    H, I = 64, 32
    w13, w2 = _mx((E, 2 * I, H), seed=1), _mx((E, H, I), seed=2)
    kw = dict(top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=8, dtype=F32)
    # one packed weight, one dense: both or neither
    with pytest.raises(ValueError, match=r"^w2 must be an MXFP4Weight like w13"):
        MoELoRALayer(w13, _dense(w2, F32), **kw)
    # dense shapes that disagree (w2's I = 64 where w13 says 32): named as for dense weights
    with pytest.raises(ValueError, match=r"^w2 must have shape \[E, H, I\] = \(4, 64, 32\)"):
        MoELoRALayer(w13, _mx((E, H, 64), seed=3), **kw)
    # packed blocks without the expert dim
    with pytest.raises(ValueError, match=r"^w13 must be an MXFP4Weight of dense shape \[E, 2I, H\]"):
        MoELoRALayer(MXFP4Weight(w13.blocks[0], w13.scales[0]), w2, **kw)
    # blocks whose rows are not contiguous 16-byte blocks
    wide = torch.zeros(E, H, I // 32, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^w2\.blocks must be contiguous in its last two dims"):
        MoELoRALayer(w13, MXFP4Weight(wide[..., :16], w2.scales), **kw)
    # biases of another dtype than the layer's
    with pytest.raises(ValueError, match=r"b13"):
        MoELoRALayer(w13, w2, b13=torch.zeros(E, 2 * I, dtype=F16), **kw)
    # biases holding NaN/inf are refused as with dense weights (every row on that expert would be NaN)
    with pytest.raises(ValueError, match=r"^b13 holds non-finite values"):
        MoELoRALayer(w13, w2, b13=torch.full((E, 2 * I), float("nan")), **kw)
    with pytest.raises(ValueError, match=r"^b2 holds non-finite values"):
        MoELoRALayer(w13, w2, b2=torch.full((E, H), float("inf")), **kw)
    # a dtype that contradicts dense weights
    with pytest.raises(ValueError, match=r"^dtype = torch.float16 differs from w13's torch.float32"):
        MoELoRALayer(_dense(w13, F32), _dense(w2, F32), **{**kw, "dtype": F16})
    # bfloat16 (the default dtype with packed weights) is refused on the CPU, naming dtype
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"dtype \(the layer's, with MXFP4 weights\)"):
            MoELoRALayer(w13, w2, **{**kw, "dtype": None})


@pytest.mark.parametrize("stage", ["tuned", "fused"])
def test_fused_moe_lora_takes_mxfp4_weights(device, stage):
    # the functional API on packed weights: the serving layer's result bit for bit, and the dense call on
    # the dequantized weights with the same (32-step) config within rounding; its checks see the dense
    # shapes
    if device != "cpu":
        pytest.skip("CPU interpreter test (fp16/fp32)")
    dt, H, I = F16, 64, 32
    mx, dense, (w13, w2) = _layers(dt, stage, "swigluoai", 1, True, H, I)
    T = 6
    x, tw, ti, ids, slots, kw = functional_args(mx, "swigluoai", stage, T, H, dt)
    out = fused_moe_lora(x, w13, w2, tw, ti, ids, *slots, **kw)
    assert out.dtype == dt and out.shape == (T, H)
    assert torch.equal(out, mx(x, topk_weights=tw, topk_ids=ti, lora_ids=ids))
    cfg = mxfp4_config(STAGES[stage].config_for(mx._dims(T)))
    want = fused_moe_lora(x, _dense(w13, dt), _dense(w2, dt), tw, ti, ids, *slots, **kw, config=cfg)
    assert_close_rel(out, want, tol=DENSE_TOL[dt], what="packed vs dequantized dense call")
    # refusals name the argument, as for dense weights
    with pytest.raises(ValueError, match=r"^w2 must be an MXFP4Weight like w13"):
        fused_moe_lora(x, w13, _dense(w2, dt), tw, ti, ids, *slots, **kw)
    with pytest.raises(ValueError, match=r"^w2 .*I=32"):  # packed w2 of I = 64 where the rest says 32
        fused_moe_lora(x, w13, _mx((E, H, 64), seed=5), tw, ti, ids, *slots, **kw)
    # packed weights take hidden_states' dtype: fp32 activations with fp16 adapters name the adapters
    with pytest.raises(ValueError, match=r"^lora_a13 must have dtype torch.float32 \(like hidden_states\)"):
        fused_moe_lora(x.float(), w13, w2, tw, ti, ids, *slots, **kw)


# --------------------------------------------------------------------------------------------------
# sm_90: the MXFP4 variants compile (no GPU)
# --------------------------------------------------------------------------------------------------
def test_mxfp4_variants_compile_for_sm90():
    # the base GEMM launches on MXFP4 weights at gpt-oss-20b T = 64 (quant_helpers.mxfp4_sm90_report)
    r = sm90_report(MXFP4_SM90)
    print(f"\nMXFP4 base GEMMs, sm_90, gpt-oss-20b T=64: {r}")
    assert set(r) == {"base_gate_up", "base_down", "fused_gate_up", "fused_down"}
    for op, v in r.items():
        # the packed variant, with its dot on the tensor cores; no flush-to-zero arithmetic (a scale byte
        # of 0 or 1 gives subnormal weights, kept as the reference keeps them)
        assert v["W_MXFP4"] is True and v["mma"] > 0 and v["ftz"] == 0, (op, v)


def test_scale_byte_255_refused():
    # e8m0 byte 255 is NaN: the layer and the public call refuse it naming the tensor
    E, H, I = 2, 64, 32
    w13 = MXFP4Weight.quantize(torch.randn(E, 2 * I, H))
    w2 = MXFP4Weight.quantize(torch.randn(E, H, I))
    bad = MXFP4Weight(w2.blocks, w2.scales.clone())
    bad.scales[1, 3, 0] = 255
    with pytest.raises(ValueError, match="w2.scales holds the e8m0 byte 255"):
        MoELoRALayer(w13, bad, top_k=1, num_adapters=1, max_rank=4, max_tokens=4, dtype=torch.float32)


def test_values_beyond_the_layer_dtype_refused():
    # a block whose scale puts a value beyond float16's range (4 · 2^14 = 65536 > 65504) would make every
    # row reading it inf/NaN in a float16 layer: refused naming the weight; 3 · 2^14 = 49152 fits. The
    # float32 layer takes both and equals the fp32 reference.
    E, H, I = 2, 64, 32
    w13, w2 = _mx((E, 2 * I, H), seed=1), _mx((E, H, I), seed=2)
    blocks, scales = w2.blocks.clone(), w2.scales.clone()
    scales[1, 5, 0] = 127 + 14
    blocks[1, 5, 0] = 0  # the block's other 31 values: zero
    for code, fits in ((0x5, True), (0x6, False)):  # e2m1 codes of 3 and 4
        blocks[1, 5, 0, 0] = code  # element 0 of the block (low nibble)
        big = MXFP4Weight(blocks.clone(), scales)
        assert big.dequantize(F32)[1, 5, 0] == (3 if fits else 4) * 2.0**14
        kw = dict(top_k=1, num_adapters=1, max_rank=4, max_tokens=4)
        if fits:
            MoELoRALayer(w13, big, dtype=F16, **kw)
        else:
            with pytest.raises(ValueError, match=r"^w2: dequantized to the layer's dtype torch\.float16"):
                MoELoRALayer(w13, big, dtype=F16, **kw)
        layer = MoELoRALayer(w13, big, dtype=F32, **kw)
        x, logits = torch.randn(3, H), torch.randn(3, E)
        ids = torch.full((3,), -1, dtype=torch.int32)
        tw, ti = route_reference(logits, 1)
        out = layer(x, topk_weights=tw.float(), topk_ids=ti.to(torch.int32), lora_ids=ids)
        assert torch.isfinite(out).all()
        assert_close_rel(out, layer_reference(layer, x, w13, big, tw.float(), ti, ids, "silu"), F32)
