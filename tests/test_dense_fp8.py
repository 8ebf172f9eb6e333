"""Block-FP8 dense GEMM (moelora_lib.kernels.dense_fp8) and LoRALinear with FP8 weights on the CPU
(Triton interpreter), float32 and float16; compile-only checks for sm_90 in a subprocess.

Oracles, in float64:

* weight-only: ``F.linear`` on the weight dequantized exactly to x's dtype (``dequantize_fp8_block``):
  the kernel scales each e4m3 tile to x's dtype in registers, so only the fp32 summation order differs;
* W8A8: the GEMM of the reference-quantized activations (``quantize_fp8_act_reference``: codes times
  scales, exact in float64) and the dequantized weight: the kernel's products of e4m3 codes are exact
  and its sums fp32.

The interpreter runs ``tl.dot`` on float8 operands (it widens both to float16, exactly, and multiplies in
float32), so the W8A8 form is checked numerically here; the sm_90 compile shows FP8 ``wgmma`` there.
Edge cases: T = 0, 1 and odd; N and K not multiples of the scale block (ragged last block row and
column, masked K loop); several M and N tiles in grouped order; a strided ``out``; bf16 scales; rows
without adapter (bit for bit the FP8 base output) and mixed adapters through LoRALinear.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moelora_lib.kernels import dense_fp8 as df
from moelora_lib.kernels.dense_fp8 import (
    DENSE_W8A8_MIN_TOKENS,
    DenseFP8Config,
    default_dense_fp8_config,
    dense_fp8_linear,
    dense_fp8_reference,
    dense_fp8_w8a8,
    dense_fp8_weight_only,
    quantize_act,
    resolve_dense_scheme,
)
from moelora_lib.linear import LoRALinear, lora_linear, lora_linear_reference
from moelora_lib.quant import FP8BlockWeight, quantize_fp8_act_reference
from moelora_lib.testing import TOLERANCES, assert_close_rel

DTYPES = [torch.float32, torch.float16]  # bf16: wrong under the interpreter (GPU test file)


def _tol(dt):
    return 1e-5 if dt == torch.float32 else TOLERANCES[dt]  # fp32 on the interpreter: no tf32


def _weight(N, K, block, seed=0, scale_dtype=torch.float32) -> FP8BlockWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.1
    w[: min(N, 8), : min(K, 8)] *= 30  # blocks of different scales
    f8 = FP8BlockWeight.quantize(w, block)
    return FP8BlockWeight(f8.weight, f8.scale_inv.to(scale_dtype), tuple(block))


def _qdq(x: torch.Tensor, g: int) -> torch.Tensor:
    """x quantized as the W8A8 form sees it, in float64: codes times their group's scale."""
    q, s = quantize_fp8_act_reference(x, g)
    return q.double() * s.double().repeat_interleave(g, dim=1)[:, : x.shape[1]]


# name -> (T, N, K, block, bias, config or None)
GEMMS = {
    "T0": (0, 64, 64, (32, 32), True, None),
    "T1_ragged_NK": (1, 200, 100, (32, 32), True, None),  # 200 % 32, 100 % 32: ragged block row / column
    "T7_one_ragged_block": (7, 96, 128, (128, 128), False, None),  # N < bn: a single ragged block row
    "T130_prefill": (130, 64, 64, (32, 32), True, None),  # the default config's 128-row M tiles, 2 of them
    # 3 M tiles x 5 N tiles in grouped order (GROUP_SIZE_M 2, the last group partial), masked K loop
    "T33_swizzle": (33, 80, 100, (32, 32), True, DenseFP8Config(16, 16, 32, 2, 4, 2)),
}


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(GEMMS))
def test_weight_only_matches_dequantized_linear(case, dt):
    T, N, K, block, bias, cfg = GEMMS[case]
    w = _weight(N, K, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g).to(dt)
    b = (torch.randn(N, generator=g) * 0.1).to(dt) if bias else None
    y = dense_fp8_weight_only(x, w, b, config=cfg)
    assert y.shape == (T, N) and y.dtype == dt
    ref = F.linear(x.double(), w.dequantize(dt).double(), None if b is None else b.double())
    assert torch.equal(ref, dense_fp8_reference(x, w, b))  # the module's reference is this oracle
    if T:
        assert_close_rel(y, ref, tol=_tol(dt), what=f"weight-only {case} {dt}")


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(GEMMS))
def test_w8a8_matches_quantized_oracle(case, dt):
    T, N, K, block, bias, cfg = GEMMS[case]
    w = _weight(N, K, block, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, K, generator=g) * (1 + 10 * torch.rand(T, 1, generator=g))  # rows of other scales
    b = (torch.randn(N, generator=g) * 0.1).to(dt) if bias else None
    x_q, x_s = quantize_fp8_act_reference(x, block[1])
    y = dense_fp8_w8a8(x_q, x_s, w, b, out_dtype=dt, config=cfg)
    assert y.shape == (T, N) and y.dtype == dt
    ref = F.linear(_qdq(x, block[1]), w.dequantize(torch.float64), None if b is None else b.double())
    assert torch.equal(ref, dense_fp8_reference(x, w, b, activation_scheme="dynamic"))
    if T:
        assert_close_rel(y, ref, tol=_tol(dt), what=f"w8a8 {case} {dt}")
        # and within the activation quantization's error of the unquantized GEMM: |Δy| ≤ 2^-4 Σ|x·W|
        exact = F.linear(x.double(), w.dequantize(torch.float64), None if b is None else b.double())
        bound = 2**-4 * (x.double().abs() @ w.dequantize(torch.float64).abs().T)
        assert ((y.double() - exact).abs() <= bound + 1e-3 * exact.abs().max()).all()


def test_activation_group_other_than_weight_block():
    """Activation groups of 64 columns over a weight of 32-column scale blocks: each K step (32) reads
    one scale of each; bf16 weight scales (as some files publish) are read as they are."""
    w = _weight(48, 160, (16, 32), seed=4, scale_dtype=torch.bfloat16)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
    x_q, x_s = quantize_fp8_act_reference(x, 64)
    y = dense_fp8_w8a8(x_q, x_s, w, group_size=64, out_dtype=torch.float32)
    assert_close_rel(y, F.linear(_qdq(x, 64), w.dequantize(torch.float64)), tol=1e-5)
    yw = dense_fp8_weight_only(x, w)
    assert_close_rel(yw, F.linear(x.double(), w.dequantize(torch.float32).double()), tol=1e-5)


def test_out_buffer_and_forms():
    """``out=`` (a strided view of a larger buffer) is written in place and returned, the rest of the
    buffer untouched; dense_fp8_linear's "dynamic" is quantize_act then dense_fp8_w8a8 bit for bit, its
    "auto" runs weight-only below DENSE_W8A8_MIN_TOKENS (bit for bit) and W8A8 from there."""
    w = _weight(64, 64, (32, 32))
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    buf = torch.full((6, 100), 7.0)
    out = buf[:, 10:74]
    assert dense_fp8_weight_only(x, w, out=out) is out
    assert torch.equal(out, dense_fp8_weight_only(x, w))
    assert (buf[:, :10] == 7).all() and (buf[:, 74:] == 7).all()
    x_q, x_s = quantize_act(x, 32)
    w8a8 = dense_fp8_w8a8(x_q, x_s, w, out_dtype=x.dtype)
    assert torch.equal(dense_fp8_linear(x, w, activation_scheme="dynamic"), w8a8)
    assert torch.equal(dense_fp8_linear(x, w), dense_fp8_weight_only(x, w))  # auto at T = 6
    assert resolve_dense_scheme("auto", w, DENSE_W8A8_MIN_TOKENS - 1) == "weight_only"
    assert resolve_dense_scheme("auto", w, DENSE_W8A8_MIN_TOKENS) == "dynamic"
    assert (
        resolve_dense_scheme("auto", _weight(32, 64, (32, 16)), 10**6) == "weight_only"
    )  # no 32-column step
    assert resolve_dense_scheme("auto", torch.zeros(4, 4), 10**6) == "weight_only"  # dense: F.linear


@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_act_is_the_reference(dt):
    """quantize_act (no host sync) gives quantize_fp8_act_reference's codes and scales bit for bit:
    a ragged last group, an all-zero group, -0.0, values that land in e4m3's subnormals, huge and tiny
    groups, T = 0. (Torch ops only: bf16 is exact here.)"""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 70, generator=g) * torch.logspace(-30, 30, 6)[:, None]
    x[1, :32] = 0.0
    x[2, 5] = -0.0
    x[3, :32] *= torch.logspace(0, -5, 32)  # a group's small entries fall below 2^-6 · scale
    x = x.to(dt) if dt != torch.float16 else x.clamp(-6e4, 6e4).to(dt)
    for T in (6, 0):
        q, s = quantize_act(x[:T], 32)
        rq, rs = quantize_fp8_act_reference(x[:T], 32)
        assert q.shape == rq.shape and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert s.dtype == torch.float32 and torch.equal(s, rs)


def test_default_configs():
    """Per T bucket: BLOCK_SIZE_M 16/32/64/128 (W8A8 ≥ 64: FP8 wgmma), BLOCK_SIZE_K the scale block's
    power-of-two part up to 128 and no wider than K, enough N tiles at decode for two programs per SM."""
    c = default_dense_fp8_config(1, 5120, 8192, w8a8=False, block_k=128)
    assert (c.BLOCK_SIZE_M, c.BLOCK_SIZE_N, c.BLOCK_SIZE_K) == (16, 32, 128)
    c = default_dense_fp8_config(4096, 10240, 5120, w8a8=True, block_k=128)
    assert (c.BLOCK_SIZE_M, c.BLOCK_SIZE_N, c.BLOCK_SIZE_K, c.NUM_WARPS) == (128, 128, 128, 8)
    assert default_dense_fp8_config(8, 64, 64, w8a8=True, block_k=128).BLOCK_SIZE_M == 64
    assert default_dense_fp8_config(40, 64, 48, w8a8=False, block_k=96).BLOCK_SIZE_K == 32
    assert default_dense_fp8_config(40, 64, 48, w8a8=False, block_k=16).BLOCK_SIZE_K == 16


# --------------------------------------------------------------------------------------------------
# LoRALinear with an FP8 weight
# --------------------------------------------------------------------------------------------------
SLICES, H, L, R = (64, 32, 32), 96, 3, 8
BLOCK = (32, 32)


def _parts(seed=0):
    """q | k | v block-FP8 weights fused with FP8BlockWeight.cat, a bias, two adapters."""
    w = FP8BlockWeight.cat([_weight(n, H, BLOCK, seed=seed + i) for i, n in enumerate(SLICES)])
    g = torch.Generator().manual_seed(seed + 10)
    bias = torch.randn(sum(SLICES), generator=g) * 0.1
    ads = [
        (
            [torch.randn(R, H, generator=g) * 0.2 for _ in SLICES],
            [torch.randn(n, R, generator=g) * 0.2 for n in SLICES],
        )
        for _ in range(2)
    ]
    ads[1][0][1] = ads[1][1][1] = None  # the second adapter covers q and v only
    return w, bias, ads


def _layer(weight, bias, ads, dt, **kw) -> LoRALinear:
    dtype = {"dtype": dt} if isinstance(weight, FP8BlockWeight) else {}
    m = LoRALinear(
        weight, bias.to(dt), slices=SLICES, num_adapters=L, max_rank=R, max_tokens=160, **dtype, **kw
    )
    for slot, (a, b) in enumerate(ads):
        cast = [[t if t is None else t.to(dt) for t in ts] for ts in (a, b)]
        m.load_adapter(slot, *cast, 1.5)
    return m  # slot 2 stays empty


def _batch(T, dt, seed=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dt)
    ids = (torch.arange(T) % (L + 1) - 1).to(torch.int32)  # -1, 0, 1, 2 (empty), -1, ...
    return x, ids


def test_layer_weight_only_matches_dequantized_layer():
    """Weight-only FP8 LoRALinear = LoRALinear on the dequantized weight (mixed adapters, an adapter
    covering two of three slices, an empty slot, rows without adapter); rows without adapter (and those
    on the empty slot) are bit for bit the FP8 base GEMM's; the functional lora_linear gives the same.
    (float16: test_layer_state_dict_to_copy_compile.)"""
    dt = torch.float32
    w, bias, ads = _parts()
    f8 = _layer(w, bias, ads, dt, activation_scheme="weight_only")
    dense = _layer(w.dequantize(dt), bias, ads, dt)
    x, ids = _batch(11, dt)
    with torch.no_grad():
        y, yd = f8(x, ids), dense(x, ids)
    assert_close_rel(y, yd.double(), tol=_tol(dt), what=f"FP8 weight-only layer {dt}")
    base = dense_fp8_weight_only(x, w, bias.to(dt))
    plain = (ids == -1) | (ids == 2)
    assert torch.equal(y[plain], base[plain]) and not torch.equal(y[~plain], base[~plain])
    # the functional op on the same arguments (slot 2 empty: -1)
    ids_f = torch.where(ids == 2, -1, ids)
    yf = lora_linear(
        x, w, f8.lora_a, f8.lora_b, ids_f, slices=SLICES, bias=bias.to(dt), stage="tuned",
        activation_scheme="weight_only",
    )  # fmt: skip
    assert torch.equal(yf, y)


def test_layer_dynamic_matches_oracle():
    """W8A8 FP8 LoRALinear: the base on the quantized activations, the LoRA shrink / expand on the
    unquantized ones (as the module docstring says), against the float64 oracle; "auto" resolves
    per T (weight-only at 1 token, W8A8 with a W8A8 config at DENSE_W8A8_MIN_TOKENS); the setter
    validates and drops the per-T choices."""
    dt = torch.float32
    w, bias, ads = _parts(seed=20)
    f8 = _layer(w, bias, ads, dt, activation_scheme="dynamic")
    x, ids = _batch(9, dt, seed=8)
    with torch.no_grad():
        y = f8(x, ids)
    wd = w.dequantize(torch.float64)
    ids_ref = torch.where(ids == 2, -1, ids)  # slot 2 is empty
    ref = lora_linear_reference(x, wd, f8.lora_a, f8.lora_b, ids_ref, slices=SLICES, bias=bias)
    ref += (_qdq(x, BLOCK[1]) - x.double()) @ wd.T  # the base saw the quantized activations
    assert_close_rel(y, ref, tol=1e-5, what="FP8 W8A8 layer")
    auto = _layer(w, bias, ads, dt)
    assert auto.activation_scheme == "auto" and auto.activation_scheme_for(1) == "weight_only"
    T = DENSE_W8A8_MIN_TOKENS
    assert auto.activation_scheme_for(T) == "dynamic" and auto.fp8_config_for(T).BLOCK_SIZE_K == 32
    assert auto.fp8_config_for(T).BLOCK_SIZE_M >= 64  # FP8 wgmma's smallest M tile
    auto.activation_scheme = "weight_only"
    assert auto.activation_scheme_for(T) == "weight_only"
    with pytest.raises(ValueError, match=r"activation_scheme must be one of"):
        auto.activation_scheme = "static"


def test_layer_state_dict_to_copy_compile():
    """Parameters ``weight_fp8`` / ``weight_scale_inv`` / ``bias`` (``weight`` None): a state dict loads
    into an FP8 layer built from other weights; ``.to(float16)`` casts bias and slots but keeps the FP8
    codes and scales; deepcopy and torch.compile (the custom op and its fake) give the eager output."""
    w, bias, ads = _parts(seed=30)
    a = _layer(w, bias, ads, torch.float32)
    b = _layer(_parts(seed=40)[0], bias, ads, torch.float32)
    sd = a.state_dict()
    assert set(sd) == {"weight_fp8", "weight_scale_inv", "bias"} and a.weight is None
    assert sd["weight_fp8"].dtype == torch.float8_e4m3fn and a.base_weight().block == BLOCK
    b.load_state_dict(sd)
    x, ids = _batch(9, torch.float32, seed=11)
    with torch.no_grad():
        ya = a(x, ids)
        assert torch.equal(b(x, ids), ya)
        half = copy.deepcopy(a).to(torch.float16)
        assert half.weight_fp8.dtype == torch.float8_e4m3fn and half.weight_scale_inv.dtype == torch.float32
        assert torch.equal(half.weight_fp8.view(torch.uint8), a.weight_fp8.view(torch.uint8))
        assert half.dtype == torch.float16 and half.bias.dtype == torch.float16
        yh = half(x.half(), ids)
        assert_close_rel(yh, ya.double(), tol=TOLERANCES[torch.float16], what="FP8 layer in fp16")
        plain = ids == -1
        assert torch.equal(yh[plain], dense_fp8_weight_only(x.half(), w, half.bias)[plain])
        compiled = torch.compile(a, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x, ids), ya)
    rep = a.memory_report()
    assert rep["weights"] == w.weight.numel() + w.scale_inv.numel() * 4 + bias.numel() * 4
    assert "weights=fp8 (block [32, 32]), activation_scheme='auto'" in repr(a)


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------
def _poisoned(w: FP8BlockWeight, scale: float | None = None, code: int | None = None) -> FP8BlockWeight:
    """A copy of ``w`` with its last scale set to ``scale`` or its last code's byte set to ``code``."""
    q, s = w.weight.clone(), w.scale_inv.clone()
    if scale is not None:
        s.view(-1)[-1] = scale
    if code is not None:
        q.view(torch.uint8).view(-1)[-1] = code
    return FP8BlockWeight(q, s, w.block)


def _bad_cases():
    w = _weight(64, 64, (32, 32))
    x = torch.randn(3, 64)
    x_q, x_s = quantize_fp8_act_reference(x, 32)
    dense = torch.randn(64, 64)
    kw = dict(num_adapters=2, max_rank=4, max_tokens=8)
    w16 = _weight(64, 64, (32, 16))
    w3d = FP8BlockWeight.quantize(torch.randn(2, 64, 64), (32, 32))
    f32 = dict(dtype=torch.float32)
    wo, w8 = dense_fp8_weight_only, dense_fp8_w8a8
    return {
        "gemm_dense_weight": (lambda: wo(x, dense), r"weight must be an FP8BlockWeight"),
        "w8a8_dense_weight": (lambda: w8(x_q, x_s, dense), r"weight must be an FP8BlockWeight"),
        "w8a8_bf16_cpu": (lambda: w8(x_q, x_s, w), r"out_dtype: bfloat16 is not supported on the CPU"),
        "gemm_K": (lambda: wo(torch.randn(3, 32), w), r"weight: K = 64 .* x's K = 32"),
        "gemm_3d_weight": (lambda: wo(x, w3d), r"weight must be a 2-D FP8BlockWeight"),
        "gemm_x_int": (lambda: wo(x.int(), w), r"x must be a 2-D float16/bfloat16/float32"),
        "gemm_bf16_cpu": (lambda: wo(x.bfloat16(), w), r"x: bfloat16 is not supported on the CPU"),
        "gemm_block_k": (
            lambda: wo(x, w, config=DenseFP8Config(16, 16, 64)),
            r"config\.BLOCK_SIZE_K = 64 must divide the weight's scale block columns weight\.block\[1\] = 32",
        ),
        "gemm_bias_dtype": (lambda: wo(x, w, x[0].half()), r"bias must have dtype torch\.float32"),
        "gemm_out_dtype": (
            lambda: wo(x, w, out=torch.empty(3, 64).half()),
            r"out must have dtype torch\.float32",
        ),
        "w8a8_x_not_fp8": (lambda: w8(x, x_s, w), r"x_q must be a 2-D float8_e4m3fn tensor"),
        "w8a8_scale_shape": (
            lambda: w8(x_q, x_s[:, :1], w),
            r"x_scale must have shape \[T=3, ceil\(K/group_size\)=2\]",
        ),
        "w8a8_block_16": (
            lambda: w8(x_q, quantize_fp8_act_reference(x, 16)[1], w16, out_dtype=torch.float32),
            r"weight\.block = \(32, 16\), group_size = 16: no K step of 32",
        ),
        "w8a8_config_k16": (
            lambda: w8(x_q, x_s, w, out_dtype=torch.float32, config=DenseFP8Config(64, 16, 16)),
            r"config\.BLOCK_SIZE_K = 16: the W8A8 form's FP8 tl\.dot needs a K step of at least 32",
        ),
        "scheme_unknown": (
            lambda: dense_fp8_linear(x, w, activation_scheme="w8a8"),
            r"activation_scheme must be one of \['auto', 'weight_only', 'dynamic'\]",
        ),
        "config_field": (lambda: DenseFP8Config(16, 16, 8), r"BLOCK_SIZE_K must be a power of two >= 16"),
        "layer_dynamic_dense": (
            lambda: LoRALinear(dense, activation_scheme="dynamic", **kw),
            r"activation_scheme 'dynamic' \(W8A8\) needs a block-FP8 weight \(an FP8BlockWeight\), "
            r"got a dense torch\.float32 weight",
        ),
        "layer_dynamic_block16": (
            lambda: LoRALinear(w16, activation_scheme="dynamic", **f32, **kw),
            r"activation_scheme 'dynamic' \(W8A8\): the scale block's 16 columns",
        ),
        "layer_float8_tensor": (
            lambda: LoRALinear(w.weight, **kw),
            r"weight dtype must be float16, bfloat16 or float32 \(FP8 codes need their block scales",
        ),
        "layer_3d_fp8": (
            lambda: LoRALinear(w3d, **kw),
            r"weight must be a 2-D FP8BlockWeight \[N_total, H\]",
        ),
        "layer_block_8": (
            lambda: LoRALinear(_weight(64, 64, (32, 8)), **f32, **kw),
            r"weight\.block = \(32, 8\): the FP8 GEMM needs scale blocks of a multiple of 16 columns",
        ),
        "layer_dtype_int": (
            lambda: LoRALinear(w, dtype=torch.int8, **kw),
            r"dtype \(the layer's, with an FP8 weight\) must be float16",
        ),
        "layer_dtype_bf16_cpu": (  # the default dtype with an FP8 weight
            lambda: LoRALinear(w, **kw),
            r"bfloat16 is not supported on the CPU",
        ),
        "layer_fp8_config_dense": (
            lambda: LoRALinear(dense, fp8_config=DenseFP8Config(), **kw),
            r"fp8_config is for a block-FP8 weight",
        ),
        "layer_fp8_config_k": (
            lambda: LoRALinear(w, fp8_config=DenseFP8Config(16, 16, 64), **f32, **kw),
            r"fp8_config\.BLOCK_SIZE_K = 64 must divide the weight's scale block columns",
        ),
        "layer_fp8_config_k16_auto": (  # "auto" reaches W8A8 at large T
            lambda: LoRALinear(w, fp8_config=DenseFP8Config(16, 16, 16), **f32, **kw),
            r"fp8_config\.BLOCK_SIZE_K = 16: activation_scheme 'auto' runs the W8A8 form",
        ),
        "layer_slices": (
            lambda: LoRALinear(w, slices=(32, 16), **f32, **kw),
            r"slices \(32, 16\) must sum to N_total = weight\.shape\[0\] = 64",
        ),
        # non-finite parameters, refused at construction as a dense weight's are (one host sync each)
        "layer_bias_nan": (
            lambda: LoRALinear(w, torch.full((64,), float("nan")), **f32, **kw),
            r"^bias holds non-finite values \(NaN or inf\)",
        ),
        "layer_scale_inf": (
            lambda: LoRALinear(_poisoned(w, scale=float("inf")), **f32, **kw),
            r"^weight\.scale_inv holds NaN or inf",
        ),
        "layer_nan_code": (
            lambda: LoRALinear(_poisoned(w, code=0xFF), **f32, **kw),
            r"^weight\.weight holds the float8_e4m3fn NaN code",
        ),
        "lora_linear_H": (
            lambda: lora_linear(
                torch.randn(3, 32),
                w,
                torch.zeros(2, 1, 4, 32),
                torch.zeros(2, 64, 4),
                torch.zeros(3, dtype=torch.int32),
                slices=(64,),
            ),  # fmt: skip
            r"weight must have shape \[N_total, H=32\], got FP8 of shape \[64, 64\]",
        ),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    fn, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        fn()


# --------------------------------------------------------------------------------------------------
# sm_90 (compile only)
# --------------------------------------------------------------------------------------------------
def fp8_dense_sm90_report() -> dict:
    """{launch: {"W8A8", "mma_sync", "wgmma", "wgmma_e4m3", "REG", "LOCAL"}} of the FP8 GEMM at Qwen3-32B
    sizes (block (128, 128), fp32 scales, bf16 activations, default configs) compiled for sm_90: the
    decode o_proj (T = 1, weight-only, with bias) and the prefill qkv (T = 4096, W8A8). Meta tensors;
    run in a process without the interpreter."""
    import re

    from moelora_lib.studies import compile_check as cc
    from tests.ptx_text import tensor_core_ops

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    out = {}
    for name, T, N, K, w8a8 in (("o_decode", 1, 5120, 8192, False), ("qkv_prefill", 4096, 10240, 5120, True)):
        w = FP8BlockWeight(
            meta(N, K, dtype=torch.float8_e4m3fn), meta(-(-N // 128), -(-K // 128), dtype=torch.float32)
        )
        cfg = default_dense_fp8_config(T, N, K, w8a8=w8a8, block_k=128)
        if w8a8:
            x, xs = meta(T, K, dtype=torch.float8_e4m3fn), meta(T, -(-K // 128), dtype=torch.float32)
            grid, args, cx = df.dense_fp8_args(x, w, meta(T, N), cfg, x_scale=xs, group_size=128)
        else:
            grid, args, cx = df.dense_fp8_args(meta(T, K), w, meta(T, N), cfg, bias=meta(N))
        k = cc.compile_for_sm90(df.DENSE_FP8_KERNEL, args, cx, cfg.NUM_WARPS, cfg.NUM_STAGES)
        p = cc.ptx(k)
        tc, ru = tensor_core_ops(p), cc.resource_usage(k)
        out[name] = dict(
            W8A8=cx["W8A8"], cfg=cfg.short(), **tc, wgmma_e4m3=len(re.findall(r"wgmma\.mma_async\S*e4m3", p)),
            REG=ru["REG"], LOCAL=ru["LOCAL"],
        )  # fmt: skip
    return out


def test_fp8_dense_compiles_for_sm90():
    """Every form compiles for sm_90 without spills; weight-only decode tiles use tensor cores
    (mma.sync on bf16), W8A8 prefill tiles FP8 wgmma (e4m3 x e4m3)."""
    from moelora_lib.studies.compile_check import run_isolated

    (r,) = run_isolated([dict(op="tests.test_dense_fp8:fp8_dense_sm90_report")], timeout=600)
    print(f"\nFP8 dense GEMM, sm_90, Qwen3-32B sizes: {r}")
    for name, v in r.items():
        assert v["LOCAL"] == 0 and v["mma_sync"] + v["wgmma"] > 0, (name, v)
        assert (v["wgmma_e4m3"] > 0) == v["W8A8"], (name, v)
