"""W8A8 block-FP8 MoE: dynamic per-token activation quantization (moelora_lib.kernels.fp8_act) and the
FP8 × FP8 base GEMMs (``A_FP8`` in moelora_lib.kernels.triton_kernels).

CPU: the Triton interpreter. The quantization kernel equals ``quantize_fp8_act_reference`` bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from moelora_lib.kernels.fp8_act import quantize_fp8_act
from moelora_lib.quant import quantize_fp8_act_reference

F32, F16 = torch.float32, torch.float16
DT_IDS = {F32: "fp32", F16: "fp16"}


def _bits_equal(got: tuple, want: tuple) -> None:
    """q codes and float32 scales identical bit for bit (−0.0 codes and scales included)."""
    (q, s), (qr, sr) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == qr.shape and s.shape == sr.shape
    diff = q.view(torch.uint8) != qr.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"
    assert torch.equal(s.view(torch.int32), sr.view(torch.int32)), (s - sr).abs().max()


# --------------------------------------------------------------------------------------------------
# quantize_fp8_act: bit for bit against the reference
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [F32, F16], ids=DT_IDS.get)
@pytest.mark.parametrize("T,K,g", [(5, 300, 128), (33, 256, 128), (3, 77, 16), (2, 40, 64)])
def test_quant_kernel_bit_exact(dt, T, K, g):
    # K = 300: a ragged last group of 44; K = 77, g = 16: 13 columns; K < g: one ragged group
    gen = torch.Generator().manual_seed(T * K + g)
    # magnitudes over 2^-20 … 2^9 per element: normal and subnormal e4m3 codes in every group
    x = torch.randn(T, K, generator=gen) * torch.exp2(torch.randint(-20, 10, (T, K), generator=gen).float())
    x = x.to(dt)
    if T > 2:
        x[1] = 0.0  # all-zero groups: scale 1, codes 0
        x[2, : min(g, K)] = -0.0  # a group of −0.0: codes 0x80, scale 1
    _bits_equal(quantize_fp8_act(x, g), quantize_fp8_act_reference(x, g))


def test_quant_kernel_ties_tiny_and_rounding():
    # every finite e4m3 value and every midpoint between neighbours, in one group whose amax is 448
    # (scale 1): the midpoints test round-half-even, in the subnormal range too
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[torch.isfinite(codes) & (codes >= 0)].sort().values
    mids = (vals[:-1] + vals[1:]) / 2
    row = torch.cat([vals, mids, -vals, -mids])
    x = row[None, :].clone()
    _bits_equal(quantize_fp8_act(x, x.shape[1]), quantize_fp8_act_reference(x, x.shape[1]))
    # groups of tiny values: amax / 448 below 2^-126 (scale clamped to 2^-126), float32 subnormals
    x = torch.zeros(2, 64)
    x[0, :5] = torch.tensor([1e-40, -3e-39, 2e-45, 0.0, -1e-41])
    x[1, 32:] = torch.linspace(-1e-36, 1e-36, 32)
    _bits_equal(quantize_fp8_act(x, 32), quantize_fp8_act_reference(x, 32))
    # random float32 bit patterns (every exponent, then any magnitude per group)
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (16, 256), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[:, ::2] |= -(2**31)  # negative half
    x = bits.view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).clamp(-1e35, 1e35)
    _bits_equal(quantize_fp8_act(x, 128), quantize_fp8_act_reference(x, 128))


def test_quant_kernel_empty_strided_and_out_buffers():
    # T = 0 and K = 0: nothing launched, the shapes of the reference
    for shape in ((0, 130), (4, 0)):
        q, s = quantize_fp8_act(torch.empty(shape), 128)
        assert q.shape == shape and s.shape == (shape[0], -(-shape[1] // 128))
    # a strided x and preallocated strided outputs (a CUDA graph's buffers): filled in place
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 2 * 200, generator=gen).to(F16)
    x = base[:, ::2]  # stride (400, 2)
    qbuf = torch.zeros(6, 208, dtype=torch.float8_e4m3fn)
    sbuf = torch.zeros(2, 6, dtype=torch.float32).t()  # [6, 2] column-major
    q, s = quantize_fp8_act(x, 128, out=(qbuf[:, :200], sbuf))
    assert q.data_ptr() == qbuf.data_ptr() and s.data_ptr() == sbuf.data_ptr()
    _bits_equal((q, s), quantize_fp8_act_reference(x.contiguous(), 128))
    assert not qbuf[:, 200:].view(torch.uint8).any()  # nothing written outside


def test_quant_kernel_bad_input_names_the_argument():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"^group_size must be a positive int, got 0"):
        quantize_fp8_act(x, 0)
    with pytest.raises(ValueError, match=r"^group_size must be a positive int, got True"):
        quantize_fp8_act(x, True)
    with pytest.raises(ValueError, match=r"^x must be a 2-D float16/bfloat16/float32 tensor \[T, K\]"):
        quantize_fp8_act(x[0], 32)
    with pytest.raises(ValueError, match=r"^x must be a 2-D .* dtype torch.int32"):
        quantize_fp8_act(x.int(), 32)
    with pytest.raises(ValueError, match=r"^out must be a pair \(q, scale\)"):
        quantize_fp8_act(x, 32, out=torch.empty(4, 64))
    q, s = torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.empty(4, 2)
    with pytest.raises(ValueError, match=r"^out\[0\] \(q\) must be a torch.float8_e4m3fn tensor \[4, 64\]"):
        quantize_fp8_act(x, 32, out=(q.view(torch.uint8), s))
    with pytest.raises(ValueError, match=r"^out\[1\] \(scale\) must be a torch.float32 tensor \[4, 2\]"):
        quantize_fp8_act(x, 32, out=(q, torch.empty(4, 3)))
