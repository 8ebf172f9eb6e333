"""The block-FP8 format module (moelora_lib.quant.fp8), CPU.

Oracle for dequantization: transformers' own block-FP8 dequantization
(transformers/integrations/finegrained_fp8.py): ``Fp8Dequantize._dequantize_one`` — the conversion that
loading with ``FineGrainedFP8Config(dequantize=True)`` applies to every (weight, weight_scale_inv) pair —
equal bit for bit in float32, bfloat16 and float16 on whole blocks, with float32 / bfloat16 / float16
scales; it derives the block from the grid and so refuses ragged grids, for which
``_dequantize_fp8_weight`` (the same file's backward-pass dequantization, ragged blocks handled; float32
there is the same float32 product) is the oracle. tests/test_fp8_checkpoint.py checks the loaded
parameters of a whole model against ``FineGrainedFP8Config(dequantize=True)`` too.

The quantizer is checked by properties that do not reuse its code: each code is a nearest e4m3 value of
``w / scale_inv`` (the table of all 254 finite e4m3 values, ties to the even code listed by hand), the
scale is amax / 448 in float32 per block (ragged last blocks included), the round trip error is within
e4m3's 2^-4 relative (2^-10 absolute below its normal range) after scaling, all-zero and tiny blocks.
Bad inputs raise ValueError naming the argument.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora_lib.quant import (
    E4M3_MAX,
    FP8_BLOCK,
    FP8BlockWeight,
    dequantize_fp8_block,
    fp8_scale_grid,
    quantize_fp8_block,
)

fp8_integration = pytest.importorskip("transformers.integrations.finegrained_fp8")

_FP8 = torch.float8_e4m3fn
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype])
    )


def _random_fp8(shape, seed: int) -> torch.Tensor:
    """Random finite e4m3 codes (every bit pattern but the NaNs 0x7F / 0xFF), signed zeros included."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b[(b & 0x7F) == 0x7F] = 0x80  # NaN -> -0
    return b.view(_FP8)


def _random_scales(shape, dtype: torch.dtype, lo: float, hi: float, seed: int) -> torch.Tensor:
    """Positive scales log-uniform in [2^lo, 2^hi], with random mantissas (not powers of two)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(lo + (hi - lo) * torch.rand(shape, generator=g)).to(dtype)


def _transformers_dequant(weight, scale_inv, dtype):
    """Fp8Dequantize's per-pair conversion (the FineGrainedFP8Config(dequantize=True) load path)."""
    return fp8_integration.Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)


# --------------------------------------------------------------------------------------------------
# dequantization against transformers
# --------------------------------------------------------------------------------------------------
# scale exponents whose products stay finite and mostly normal in the output dtype: e4m3 spans
# [2^-9, 448]; float16's normal range is [2^-14, 65504]
SCALE_RANGE = {torch.float32: (-40.0, 40.0), torch.bfloat16: (-40.0, 40.0), torch.float16: (-5.0, 7.0)}


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_dequantize_equals_transformers_bit_for_bit(block, dtype, scale_dtype):
    """Whole blocks, 3 experts: ours == Fp8Dequantize bit for bit (fp32 product, one cast)."""
    bn, bk = block
    shape = (3, 2 * bn, 3 * bk)
    weight = _random_fp8(shape, seed=1)
    lo, hi = SCALE_RANGE[dtype]
    if scale_dtype == torch.float16:
        lo, hi = max(lo, -14.0), min(hi, 15.0)
    scale_inv = _random_scales(fp8_scale_grid(shape, block), scale_dtype, lo, hi, seed=2)
    ours = dequantize_fp8_block(weight, scale_inv, dtype, block)
    ref = _transformers_dequant(weight, scale_inv, dtype)
    assert ours.dtype == dtype and ours.shape == shape
    assert bool(torch.isfinite(ours).all())
    assert _bits_equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(130, 129), (2, 100, 300), (1, 1), (256, 7)])
def test_ragged_blocks_equal_transformers(shape, dtype):
    """N or K not multiples of 128: ceil-sized grids; the last block row / column has its own scale.
    Oracle: _dequantize_fp8_weight in float32 (bit for bit), cast once for the narrower dtypes."""
    weight = _random_fp8(shape, seed=3)
    scale_inv = _random_scales(fp8_scale_grid(shape), torch.float32, -4.0, 4.0, seed=4)
    ours = dequantize_fp8_block(weight, scale_inv, dtype)
    ref32 = fp8_integration._dequantize_fp8_weight(weight, scale_inv, list(FP8_BLOCK), torch.float32)
    assert _bits_equal(ours, ref32.to(dtype))


def test_dequantize_by_hand():
    """W[n, k] = weight[n, k] · scale_inv[n // bn, k // bk]; block (2, 3), ragged last row and column."""
    vals = torch.tensor(
        [[1.0, -2.0, 0.5, 448.0], [3.0, 0.0, -0.25, 1.5], [-6.0, 2**-9, 10.0, -448.0]], dtype=torch.float32
    )
    weight = vals.to(_FP8)
    assert torch.equal(weight.float(), vals)  # every value is an e4m3 value
    scale_inv = torch.tensor([[2.0, 0.5], [-1.0, 3.0]])  # grid ceil(3/2) x ceil(4/3) = 2 x 2
    w = dequantize_fp8_block(weight, scale_inv, torch.float64, block=(2, 3))
    expect = [[vals[n, k].item() * scale_inv[n // 2, k // 3].item() for k in range(4)] for n in range(3)]
    assert w.dtype == torch.float64 and w.tolist() == expect


def test_large_weights_are_chunked_exactly():
    """A weight larger than one dequantization chunk (2^23 elements) equals the unchunked product."""
    shape = (4160, 2050)  # 8.5M elements, ragged in both dims
    weight = _random_fp8(shape, seed=5)
    scale_inv = _random_scales(fp8_scale_grid(shape), torch.float32, -3.0, 3.0, seed=6)
    ours = dequantize_fp8_block(weight, scale_inv, torch.bfloat16)
    s = scale_inv.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert _bits_equal(ours, (weight.float() * s).to(torch.bfloat16))


# --------------------------------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------------------------------
def _e4m3_table() -> torch.Tensor:
    """All finite e4m3 values, float64, sorted (from the 256 bit patterns, NaNs dropped)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_FP8).double()
    return torch.unique(v[torch.isfinite(v)])


def test_e4m3_table():
    t = _e4m3_table()
    assert t.numel() == 253  # 254 finite codes, +0 and -0 merged
    assert t.max().item() == E4M3_MAX and t[t > 0].min().item() == 2**-9


@pytest.mark.parametrize("block", [(128, 128), (32, 16), (5, 7)])
def test_codes_are_nearest_e4m3_and_scale_is_amax_over_448(block):
    g = torch.Generator().manual_seed(7)
    shape = (2, 70, 45)  # ragged for every block here
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == _FP8 and q.shape == shape and s.dtype == torch.float32
    assert s.shape == fp8_scale_grid(shape, block)
    bn, bk = block
    # the scale of every block: its amax / 448 in float32 (Python loops, independent of the quantizer)
    for e in range(shape[0]):
        for i in range(s.shape[1]):
            for j in range(s.shape[2]):
                amax = w[e, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max()
                assert s[e, i, j].item() == (amax / torch.tensor(448.0)).item()
    full = s.repeat_interleave(bn, -2)[..., : shape[1], :].repeat_interleave(bk, -1)[..., : shape[2]]
    x = (w / full).double()  # float32 division, as the quantizer divides
    table = _e4m3_table()
    dist = (x.unsqueeze(-1) - table).abs().amin(-1)
    assert torch.equal((q.double() - x).abs(), dist)  # a nearest e4m3 value
    # the block's largest magnitude maps to ±448
    for e in range(shape[0]):
        assert q[e, :bn, :bk].double().abs().max().item() == E4M3_MAX


def test_ties_round_to_even_code():
    """Halfway between two e4m3 values, the one with the even mantissa: scale 1 (amax 448)."""
    w = torch.zeros(1, 8)
    w[0, 0] = 448.0
    # (x, expected): 1.0625 between 1.0 (m=0) and 1.125 (m=1) -> 1.0; 1.1875 between 1.125 and 1.25 (m=2)
    # -> 1.25; 2^-10 between 0 and 2^-9 (subnormal m=1) -> 0; 3 · 2^-10 between 2^-9 and 2^-8 -> 2^-8
    cases = [(1.0625, 1.0), (1.1875, 1.25), (2**-10, 0.0), (3 * 2**-10, 2**-8), (-1.0625, -1.0), (-3.5, -3.5)]
    for i, (x, _) in enumerate(cases, start=1):
        w[0, i] = x
    q, s = quantize_fp8_block(w, (1, 8))
    assert s.item() == 1.0
    assert q[0, 1:7].float().tolist() == [y for _, y in cases]


@pytest.mark.parametrize("scale_exp", [-30, 0, 12])
def test_round_trip_error_bound(scale_exp):
    """Per element, after scaling: |q − w/s| ≤ 2^-4 |w/s| where |w/s| ≥ 2^-6 (e4m3 normals), ≤ 2^-10
    below; so the dequantized weight is within 2^-4 |w| + 2^-10 s of w (plus float32 rounding)."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(3, 260, 200, generator=g) * 2.0**scale_exp
    w[0, :5, :5] *= 1e-4  # small values in a block with a large amax: e4m3 subnormals
    for block in ((128, 128), (16, 32)):
        q, s = quantize_fp8_block(w, block)
        bn, bk = block
        full = s.double().repeat_interleave(bn, -2)[..., :260, :].repeat_interleave(bk, -1)[..., :200]
        x = w.double() / full
        err = (q.double() - x).abs()
        normal = x.abs() >= 2**-6
        assert bool((err[normal] <= 2**-4 * x.abs()[normal] * (1 + 2**-18)).all())
        assert bool((err[~normal] <= 2**-10 * (1 + 2**-18)).all())
        deq = dequantize_fp8_block(q, s, torch.float32, block).double()
        bound = (2**-4 * w.double().abs() + 2**-10 * full) * (1 + 2**-18)
        assert bool(((deq - w.double()).abs() <= bound).all())
        rel = ((deq - w.double()).abs() / w.double().abs())[normal]
        assert rel.max().item() <= 2**-4 * (1 + 2**-18)


def test_values_on_the_grid_come_back_exactly():
    """e4m3 values times one scale per block, each block reaching ±448 · s: the round trip is exact."""
    weight = _random_fp8((2, 64, 48), seed=9)
    weight[:, ::32, ::16] = torch.tensor(448.0).to(_FP8)  # every (32, 16) block's amax is 448
    scale_inv = torch.exp2(torch.randint(-10, 10, (2, 2, 3)).float())  # powers of two: products exact
    w = dequantize_fp8_block(weight, scale_inv, torch.float32, (32, 16))
    q, s = quantize_fp8_block(w, (32, 16))
    assert torch.equal(s, scale_inv)
    assert torch.equal(q.float(), weight.float())


def test_zero_and_tiny_blocks():
    """An all-zero block gets scale_inv 1 and zero codes; a block whose amax / 448 underflows float32's
    normal range gets 2^-126 (no division by zero); both round-trip to within the bound."""
    w = torch.zeros(4, 256)
    w[:, 128:] = 1e-42  # a float32 subnormal: amax / 448 < 2^-126
    w[0, 200] = -2e-42
    q, s = quantize_fp8_block(w)
    assert s.tolist() == [[1.0, 2.0**-126]]
    assert torch.equal(q[:, :128].float(), torch.zeros(4, 128))
    deq = dequantize_fp8_block(q, s, torch.float32)
    assert torch.equal(deq[:, :128], torch.zeros(4, 128))
    assert bool(torch.isfinite(deq).all()) and (deq - w).abs().max().item() <= 2**-126


def test_bfloat16_and_float64_inputs():
    g = torch.Generator().manual_seed(10)
    w = torch.randn(3, 130, 140, generator=g)
    for x in (w.to(torch.bfloat16), w.double()):
        q, s = quantize_fp8_block(x)
        q32, s32 = quantize_fp8_block(x.float())
        assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)


# --------------------------------------------------------------------------------------------------
# the weight container
# --------------------------------------------------------------------------------------------------
def test_fp8_block_weight_container():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4, 200, 300, generator=g)
    fw = FP8BlockWeight.quantize(w)
    assert fw.shape == (4, 200, 300) and fw.device == torch.device("cpu") and fw.block == (128, 128)
    assert fw.scale_inv.shape == (4, 2, 3)
    assert fw.nbytes == 4 * 200 * 300 + 4 * 2 * 3 * 4  # 1 byte per weight + fp32 scales
    assert torch.equal(
        fw.dequantize(torch.float32), dequantize_fp8_block(fw.weight, fw.scale_inv, torch.float32)
    )
    assert fw.dequantize().dtype == torch.bfloat16
    moved = fw.to("cpu")
    assert isinstance(moved, FP8BlockWeight) and moved.block == fw.block
    with pytest.raises(dataclasses.FrozenInstanceError):
        fw.weight = fw.weight  # type: ignore[misc]
    # bf16 scales (as some files publish them): accepted, 2 bytes each, dequantized from float32 values
    half = FP8BlockWeight(fw.weight, fw.scale_inv.to(torch.bfloat16), [128, 128])
    assert half.block == (128, 128) and half.nbytes == 4 * 200 * 300 + 4 * 2 * 3 * 2
    expect = _transformers_dequant(fw.weight[:, :128, :128], half.scale_inv[:, :1, :1], torch.float32)
    assert torch.equal(half.dequantize(torch.float32)[:, :128, :128], expect)
    other = FP8BlockWeight.quantize(w[0], block=(16, 32))
    assert other.block == (16, 32) and other.scale_inv.shape == (13, 10)


def test_cat_along_rows():
    """q | k | v style: rows concatenated, scale grids concatenated; the dequantized result is the
    concatenation of the parts'. Only the last part may end in a ragged block row."""
    g = torch.Generator().manual_seed(12)
    parts = [FP8BlockWeight.quantize(torch.randn(n, 100, generator=g), (32, 32)) for n in (64, 32, 40)]
    fused = FP8BlockWeight.cat(parts)
    assert fused.shape == (136, 100) and fused.scale_inv.shape == (5, 4)
    assert torch.equal(
        fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts])
    )
    ragged = [parts[2], parts[0]]
    with pytest.raises(ValueError, match=r"parts\[0\]: N = 40 is not a multiple of the block rows 32"):
        FP8BlockWeight.cat(ragged)
    other_k = FP8BlockWeight.quantize(torch.randn(32, 64, generator=g), (32, 32))
    with pytest.raises(ValueError, match=r"parts\[1\]: .*do not match parts\[0\]"):
        FP8BlockWeight.cat([parts[0], other_k])
    with pytest.raises(ValueError, match=r"parts must be a non-empty sequence of FP8BlockWeight"):
        FP8BlockWeight.cat([])


def test_scale_grid():
    assert fp8_scale_grid((128, 256)) == (1, 2)
    assert fp8_scale_grid((3, 129, 1)) == (3, 2, 1)
    assert fp8_scale_grid((100, 100), (32, 16)) == (4, 7)


# --------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------
_W = torch.zeros(256, 128, dtype=_FP8)
_S = torch.ones(2, 1)

BAD_DEQUANT = {
    "weight_dtype": (
        dict(weight=torch.zeros(256, 128, dtype=torch.bfloat16)),
        r"weight must be a float8_e4m3fn",
    ),
    "weight_e5m2": (
        dict(weight=torch.zeros(256, 128, dtype=torch.float8_e5m2)),
        r"weight must be a float8_e4m3fn",
    ),
    "weight_1d": (
        dict(weight=torch.zeros(256, dtype=_FP8)),
        r"weight must be a float8_e4m3fn tensor \[\.\.\., N, K\]",
    ),
    "weight_not_tensor": (dict(weight=[1.0]), r"weight must be .* got list"),
    "scale_dtype": (
        dict(scale_inv=torch.ones(2, 1, dtype=torch.float64)),
        r"scale_inv must be a float32, bfloat16",
    ),
    "scale_int": (
        dict(scale_inv=torch.ones(2, 1, dtype=torch.int32)),
        r"scale_inv must be a float32, bfloat16",
    ),
    "scale_grid_floor": (
        dict(weight=torch.zeros(257, 130, dtype=_FP8), scale_inv=torch.ones(2, 1)),
        r"scale_inv must have shape \[3, 2\] \(one scale per 128 x 128 block of weight \[257, 130\]",
    ),
    "scale_grid_transposed": (dict(scale_inv=torch.ones(1, 2)), r"scale_inv must have shape \[2, 1\]"),
    "scale_lead_dims": (
        dict(weight=torch.zeros(2, 256, 128, dtype=_FP8), scale_inv=torch.ones(3, 2, 1)),
        r"scale_inv must have shape \[2, 2, 1\]",
    ),
    "device": (
        dict(scale_inv=torch.ones(2, 1, device="meta")),
        r"weight and scale_inv must be on one device",
    ),
    "block_len": (dict(block=(128,)), r"block must be two positive ints"),
    "block_zero": (dict(block=(0, 128)), r"block must be two positive ints"),
    "block_float": (dict(block=(128.0, 128)), r"block must be two positive ints"),
    "block_bool": (dict(block=(True, 128)), r"block must be two positive ints"),
    "out_dtype": (dict(dtype=torch.int8), r"dtype must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_DEQUANT))
def test_bad_dequantize_inputs(case):
    kw = dict(weight=_W, scale_inv=_S, dtype=torch.float32, block=FP8_BLOCK)
    edits, match = BAD_DEQUANT[case]
    kw.update(edits)
    with pytest.raises(ValueError, match=match):
        dequantize_fp8_block(**kw)
    if "dtype" not in edits:  # the container refuses the same
        with pytest.raises(ValueError, match=match):
            FP8BlockWeight(kw["weight"], kw["scale_inv"], kw["block"])


BAD_QUANT = {
    "int": (torch.zeros(4, 4, dtype=torch.int32), FP8_BLOCK, r"w must be a float tensor \[\.\.\., N, K\]"),
    "fp8": (torch.zeros(4, 4, dtype=_FP8), FP8_BLOCK, r"w must be a float tensor"),
    "1d": (torch.zeros(4), FP8_BLOCK, r"w must be a float tensor \[\.\.\., N, K\].*shape \(4,\)"),
    "inf": (torch.tensor([[1.0, float("inf")]]), FP8_BLOCK, r"w must be finite in float32"),
    "nan": (torch.tensor([[float("nan"), 1.0]]), FP8_BLOCK, r"w must be finite in float32"),
    "too_large": (torch.tensor([[1e300]], dtype=torch.float64), FP8_BLOCK, r"w must be finite in float32"),
    "block": (torch.zeros(4, 4), (4, -1), r"block must be two positive ints"),
}


@pytest.mark.parametrize("case", list(BAD_QUANT))
def test_bad_quantize_inputs(case):
    w, block, match = BAD_QUANT[case]
    with pytest.raises(ValueError, match=match):
        quantize_fp8_block(w, block)
    with pytest.raises(ValueError, match=match):
        FP8BlockWeight.quantize(w, block)


def test_act_reference_per_token_group():
    """Per row and 128-column group (the last one ragged): scale = amax / 448, the group's largest
    magnitude maps to ±448, an all-zero group gets scale 1 and zero codes; a per-element loop agrees."""
    from moelora_lib.quant import quantize_fp8_act_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, generator=g, dtype=torch.float32) * torch.tensor([[1.0], [1e-3], [40.0]])
    x[1, 128:256] = 0.0
    q, s = quantize_fp8_act_reference(x)
    assert q.dtype == _FP8 and q.shape == (3, 300) and s.dtype == torch.float32 and s.shape == (3, 3)
    for t in range(3):
        for j in range(3):
            grp = x[t, j * 128 : (j + 1) * 128]
            amax = grp.abs().max()
            want = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            assert s[t, j] == want
            codes = (grp / want).clamp(-448, 448).to(_FP8)
            assert torch.equal(q[t, j * 128 : (j + 1) * 128].view(torch.uint8), codes.view(torch.uint8))
    assert torch.all(q[1, 128:256].float() == 0) and s[1, 1] == 1.0
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    assert torch.allclose(back, x, rtol=2**-4, atol=0)
    e, se = quantize_fp8_act_reference(torch.zeros(0, 300))
    assert e.shape == (0, 300) and se.shape == (0, 3)


@pytest.mark.parametrize(
    "x, group, match",
    [
        (torch.zeros(2, 3, 4), 128, r"x must be a 2-D float tensor \[T, K\]"),
        (torch.zeros(2, 4, dtype=torch.int32), 128, r"x must be a 2-D float tensor"),
        (torch.tensor([[1.0, float("nan")]]), 128, r"x must be finite"),
        (torch.zeros(2, 4), 0, r"group_size must be a positive int"),
    ],
)
def test_act_reference_bad_input(x, group, match):
    from moelora_lib.quant import quantize_fp8_act_reference

    with pytest.raises(ValueError, match=match):
        quantize_fp8_act_reference(x, group)


def test_block_accepts_numpy_ints():
    import numpy as np

    w = torch.randn(64, 48)
    q, s = quantize_fp8_block(w, (np.int64(32), np.int32(16)))
    fw = FP8BlockWeight(q, s, (np.int64(32), 16))
    assert fw.block == (32, 16) and all(type(b) is int for b in fw.block)
    ref = FP8BlockWeight.quantize(w, (32, 16))
    assert torch.equal(fw.dequantize(torch.float32), ref.dequantize(torch.float32))


@pytest.mark.parametrize("form", ["mxfp4", "fp8"])
def test_dequantized_finite_check_covers_every_chunk(monkeypatch, form):
    # small chunks: the overflow sits in the last row (the last chunk) of the last expert, then the first
    import moelora_lib.quant as quant
    from moelora_lib.quant import MXFP4Weight, check_dequantized_finite

    monkeypatch.setattr(quant, "_CHECK_CHUNK", 96)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 64, generator=g)
    for row in ((2, 39), (0, 0)):
        if form == "mxfp4":
            pw = MXFP4Weight.quantize(w)
            sc = pw.scales.clone()
            sc[row[0], row[1], 1] = 127 + 15  # 2^15 · up to 6: beyond float16's 65504
            bad = MXFP4Weight(pw.blocks, sc)
        else:
            pw = FP8BlockWeight.quantize(w, (16, 32))
            s = pw.scale_inv.clone()
            s[row[0], row[1] // 16, 1] = 1e3  # codes up to 448 · 1000
            bad = FP8BlockWeight(pw.weight, s, (16, 32))
        check_dequantized_finite("w13", pw, torch.float16)  # the unmodified weight fits
        check_dequantized_finite("w13", bad, torch.float32)  # float32 holds it
        with pytest.raises(ValueError, match=r"w13: dequantized to the layer's dtype torch.float16"):
            check_dequantized_finite("w13", bad, torch.float16)
