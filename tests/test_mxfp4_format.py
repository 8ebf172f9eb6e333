"""The MXFP4 format module (moelora_lib.quant.mxfp4), CPU.

The oracle for dequantization is transformers' ``convert_moe_packed_tensors`` (pure torch; it returns the
transposed [E, K, N] layout and takes 4-D [E, N, K/32, 16] blocks): equal bit for bit on random blocks
and scales, including extreme scale bytes whose values stay finite in the output dtype. The quantizer is
checked by properties that do not reuse its code: values on the grid come back exactly, every value is a
nearest grid point (ties to the even code, listed by hand), saturation at 6·2^e, the OCP scale rule
computed with Python's math.frexp, all-zero blocks. Bad inputs raise ValueError naming the argument.
"""

from __future__ import annotations

import math

import pytest
import torch

from moelora_lib.quant import E2M1_VALUES, MXFP4Weight, dequantize_mxfp4, e8m0_to_float32, quantize_mxfp4

convert_moe_packed_tensors = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype])
    )


def _random_packed(E: int, N: int, G: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, N, G, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi + 1, (E, N, G), dtype=torch.uint8, generator=g)
    return blocks, scales


# --------------------------------------------------------------------------------------------------
# dequantization against transformers
# --------------------------------------------------------------------------------------------------
# scale byte ranges whose values are finite in the dtype: bf16 / fp32 share float32's exponent range
# (6 · 2^(252 − 127) = 1.5 · 2^127 is the largest finite; byte 0 gives 0.5 · 2^-127, a subnormal);
# float16: 6 · 2^(140 − 127) = 49152 <= 65504, and 0.5 · 2^(104 − 127) = 2^-24, its smallest subnormal
RANGES = {torch.bfloat16: (0, 252), torch.float32: (0, 252), torch.float16: (104, 140)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_equals_transformers_bit_for_bit(dtype):
    lo, hi = RANGES[dtype]
    blocks, scales = _random_packed(3, 40, 4, lo, hi, seed=1)
    # force the extremes and the unit scale into every expert
    for i, byte in enumerate((lo, lo + 1, 126, 127, 128, hi - 1, hi)):
        scales[:, i, :] = byte
    ours = dequantize_mxfp4(blocks, scales, dtype)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.dtype == dtype and ours.shape == (3, 40, 128)
    assert bool(torch.isfinite(ours).all())
    assert _bits_equal(ours, ref)


def test_dequantize_layout_by_hand():
    """Low nibble first, codes 0–15 as E2M1_VALUES, scale 2^(byte − 127) per block of 32 along K."""
    blocks = torch.zeros(1, 2, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21  # element 0 = code 1 (0.5), element 1 = code 2 (1.0)
    blocks[0, 0, 1, 15] = 0xF7  # element 62 = code 7 (6.0), element 63 = code 15 (-6.0)
    blocks[0, 1, 0, 3] = 0x9A  # row 1: element 6 = code 10 (-1.0), element 7 = code 9 (-0.5)
    scales = torch.tensor([[[127, 130], [125, 127]]], dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    expect = torch.zeros(1, 2, 64)
    expect[0, 0, 0], expect[0, 0, 1] = 0.5, 1.0
    expect[0, 0, 62], expect[0, 0, 63] = 6.0 * 8, -6.0 * 8
    expect[0, 1, 6], expect[0, 1, 7] = -1.0 / 4, -0.5 / 4
    assert torch.equal(w, expect)
    # every code through the table, any leading dims
    codes = torch.arange(16, dtype=torch.uint8)
    row = (codes[0::2] | (codes[1::2] << 4)).repeat(2)  # 32 codes: 0..15 twice
    w = dequantize_mxfp4(row.view(1, 1, 16), torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    assert w.tolist() == [list(E2M1_VALUES) * 2]
    assert torch.equal(torch.signbit(w[0, 8]), torch.tensor(True))  # code 8 is -0.0


def test_e8m0_values():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float32(b)
    assert v[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(v[6].item())  # 0xFF is NaN in the OCP spec
    assert torch.isnan(
        dequantize_mxfp4(torch.zeros(1, 1, 16, dtype=torch.uint8), b[6:].view(1, 1), torch.float32)
    ).all()


# --------------------------------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------------------------------
def _grid_packed(shape: tuple[int, ...], seed: int):
    """Packed weights whose every block has a code of magnitude 4 or 6 (so its amax is in [4, 6]·2^e,
    the binade the OCP scale rule lands in) and no -0 code (the quantizer writes +0)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*shape, 32), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0
    pos = torch.randint(0, 32, shape, generator=g)
    top = torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[torch.randint(0, 4, shape, generator=g)]
    codes.scatter_(-1, pos.unsqueeze(-1), top.unsqueeze(-1))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(1, 250, shape, dtype=torch.uint8, generator=g)
    return blocks.contiguous(), scales


def test_round_trip_on_grid_is_exact():
    blocks, scales = _grid_packed((2, 24, 3), seed=2)
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    qb, qs = quantize_mxfp4(w)
    assert torch.equal(qs, scales) and torch.equal(qb, blocks)
    for dt in (torch.bfloat16, torch.float64):  # the weight in another float dtype: the same codes
        assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(w.to(dt)), (blocks, scales)))


def test_rounding_to_nearest_ties_to_even_code():
    """One block at scale 2^0 (its amax 6 sets exponent floor(log2 6) − 2 = 0): the midpoints between
    neighbouring e2m1 values go to the even code, everything else to the nearest value."""
    x = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.26, 0.74, 1.3, 4.9]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -2.0, -4.0, 0.5, 0.5, 1.5, 4.0]
    x += [0.0] * (32 - len(x))
    want += [0.0] * (32 - len(want))
    for e in (0, 7, -9):  # the same codes at another power of two
        w = torch.tensor(x, dtype=torch.float64).mul(2.0**e).view(1, 32)
        blocks, scales = quantize_mxfp4(w)
        assert scales.item() == 127 + e
        got = dequantize_mxfp4(blocks, scales, torch.float64)[0]
        assert got.tolist() == [v * 2.0**e for v in want]
    assert not torch.signbit(got[8])  # -0.25 rounds to +0


def test_nearest_grid_point_and_scale_rule():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 16, 128, generator=g) * torch.logspace(-30, 30, 16).view(1, 16, 1)
    blocks, scales = quantize_mxfp4(w)
    q = dequantize_mxfp4(blocks, scales, torch.float64)
    wb = w.double().view(3, 16, 4, 32)
    for idx in [(0, 0, 0), (1, 7, 2), (2, 15, 3), (2, 3, 1)]:
        amax = wb[idx].abs().max().item()
        assert scales[idx].item() == 127 + math.frexp(amax)[1] - 1 - 2  # floor(log2 amax) − 2
    scale = e8m0_to_float32(scales).double().unsqueeze(-1)
    cands = torch.tensor(E2M1_VALUES, dtype=torch.float64) * scale.unsqueeze(-1)  # [3, 16, 4, 1, 16]
    clamped = torch.minimum(wb.abs(), 6 * scale) * wb.sign()
    best = (clamped.unsqueeze(-1) - cands).abs().amin(-1)
    assert torch.equal((clamped - q.view_as(wb)).abs(), best)  # no grid point is nearer
    assert bool(((q.view_as(wb) - wb).abs() <= 2 * scale).all())


def test_saturation_and_amax_binade():
    """Values in (6, 8)·2^e (the top binade past e2m1's largest value) saturate to ±6·2^e."""
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([7.9, -6.5, 6.0, 3.0]) * 2.0**5
    w[1, 0] = 4.0 * 2.0**-3  # amax exactly 4·2^e: the bottom of the binade
    w[1, 1] = 7.999 * 2.0**-3
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[132], [124]]
    q = dequantize_mxfp4(blocks, scales, torch.float32)
    assert q[0, :4].tolist() == [6.0 * 32, -6.0 * 32, 6.0 * 32, 3.0 * 32]
    assert q[1, :2].tolist() == [0.5, 6.0 / 8]


def test_scale_exponent_just_below_a_power_of_two():
    """amax = 2^k·(1 − 2^-24) has floor(log2) = k − 1, where float32 log2 rounds up to k: the exponent is
    read from the float's bits."""
    k = torch.arange(-20, 20, dtype=torch.float64)
    w = torch.zeros(40, 32)
    w[:, 0] = (2.0**k * (1 - 2.0**-24)).float()
    _, scales = quantize_mxfp4(w)
    assert scales[:, 0].tolist() == (127 + k - 1 - 2).int().tolist()


def test_zero_and_tiny_blocks():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-1, 1, 32) * 2.0**-140  # amax below 4·2^-127: exponent clamped to -127
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[0, 0], [0, 0]]
    assert not blocks[0].any() and not blocks[1, 0].any()  # all-zero blocks: code 0 everywhere
    q = dequantize_mxfp4(blocks, scales, torch.float32)
    assert not q[0].any() and not q[1, :32].any()
    assert bool(((q[1, 32:] - w[1, 32:]).abs() <= 2.0**-128).all())


def test_mxfp4_weight():
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    m = MXFP4Weight.quantize(w)
    assert m.shape == (2, 8, 64) and m.device == torch.device("cpu") and m.nbytes == 2 * 8 * (32 + 2)
    assert m.blocks.shape == (2, 8, 2, 16) and m.scales.shape == (2, 8, 2)
    assert torch.equal(m.dequantize(torch.float32), dequantize_mxfp4(m.blocks, m.scales, torch.float32))
    assert m.dequantize().dtype == torch.bfloat16
    moved = m.to("cpu")
    assert torch.equal(moved.blocks, m.blocks) and torch.equal(moved.scales, m.scales)
    with pytest.raises(ValueError, match="scales must have shape"):
        MXFP4Weight(m.blocks, m.scales[:, :, :1])


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
_B, _S = torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8)


@pytest.mark.parametrize(
    "blocks, scales, dtype, match",
    [
        (_B.to(torch.int8), _S, torch.float32, "blocks must be a uint8"),
        (_B[0, 0], _S[0, 0], torch.float32, "blocks must be a uint8 tensor"),  # 2-D: no row axis
        (_B[..., :15], _S, torch.float32, "blocks must have a last dim of 16"),
        (_B, _S.float(), torch.float32, "scales must be a uint8"),
        (_B, _S[:, :3], torch.float32, r"scales must have shape blocks.shape\[:-1\] = \(2, 4, 2\)"),
        (_B, _S, torch.int32, "dtype must be one of"),
        ("blocks", _S, torch.float32, "blocks must be a uint8 tensor .* got str"),
    ],
)
def test_dequantize_refusals(blocks, scales, dtype, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales, dtype)


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.zeros(4, 64, dtype=torch.int32), "w must be a float tensor"),
        (torch.zeros(64), r"w must be a float tensor \[..., N, K\]"),
        (torch.zeros(4, 48), "w's last dim K must be a multiple of 32.*K = 48"),
        (torch.full((4, 32), float("inf")), "w must be finite"),
        (torch.full((4, 32), 1e300, dtype=torch.float64), "w must be finite in float32"),
        ([[0.0] * 32], "w must be a float tensor .* got list"),
    ],
)
def test_quantize_refusals(w, match):
    with pytest.raises(ValueError, match=match):
        quantize_mxfp4(w)
