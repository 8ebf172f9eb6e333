"""MXFP4 (OCP Microscaling Formats v1.0, FP4 e2m1 elements, one e8m0 scale per 32) in the layout of
the published GPT-OSS checkpoints.

A weight ``W [..., N, K]`` (rows = output features N, K the reduction axis) is stored as

* ``blocks`` uint8 ``[..., N, K // 32, 16]``: 32 e2m1 codes per block, two per byte, the **low nibble
  first** (element 2i in bits 0–3 of byte i, element 2i + 1 in bits 4–7);
* ``scales`` uint8 ``[..., N, K // 32]``: the e8m0 exponent of each block, value ``2 ** (byte - 127)``
  (byte 255 is NaN, as the OCP spec defines it).

Code c in 0–7 is +{0, 0.5, 1, 1.5, 2, 3, 4, 6}[c]; 8–15 the same values negated. So
``W[..., n, 32 b + j] = e2m1(code) * 2 ** (scales[..., n, b] - 127)``. The oracle the tests use is
transformers' ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (which returns the
transposed ``[..., K, N]`` layout).

Source of the format: the OCP Microscaling Formats (MX) v1.0 specification, and the
``*_blocks`` / ``*_scales`` tensors of openai/gpt-oss-20b's ``model.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "MXFP4Weight",
    "dequantize_mxfp4",
    "e8m0_to_float32",
    "quantize_mxfp4",
]

#: Elements sharing one scale.
MXFP4_BLOCK = 32
#: The 16 e2m1 values, indexed by code (bit 3 is the sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
_E2M1_MAX = 6.0
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# blocks dequantized per step: bounds the int32 codes and fp32 values held at once (~64 MiB each)
_ROWS_PER_CHUNK = 1 << 19


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() < 3:
        raise ValueError(f"blocks must be a uint8 tensor [..., N, K/32, 16], got {_desc(blocks)}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"blocks must have a last dim of 16 bytes (32 e2m1 codes), got {tuple(blocks.shape)}"
        )
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise ValueError(f"scales must be a uint8 tensor [..., N, K/32], got {_desc(scales)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"scales must have shape blocks.shape[:-1] = {tuple(blocks.shape[:-1])} (one e8m0 byte per "
            f"32 values), got {tuple(scales.shape)}"
        )
    if blocks.device != scales.device:
        raise ValueError(f"blocks and scales must be on one device, got {blocks.device} and {scales.device}")


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """The float32 value of e8m0 bytes: ``2 ** (byte - 127)``, built from its bits (exact, including
    byte 0 = 2^-127, a float32 subnormal); byte 255 is NaN (OCP MX v1.0)."""
    b = scales.to(torch.int32)
    bits = b << 23  # the float32 exponent field; mantissa 0
    bits = torch.where(b == 0, torch.full_like(bits, 1 << 22), bits)  # 2^-127: subnormal, mantissa MSB
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)  # quiet NaN
    return bits.view(torch.float32)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The dense weight ``[..., N, K]`` (``K = 32 * blocks.shape[-2]``) of packed MXFP4 ``blocks``
    uint8 ``[..., N, K/32, 16]`` and ``scales`` uint8 ``[..., N, K/32]``, in ``dtype`` (float16,
    bfloat16, float32 or float64), on the inputs' device.

    Exact to the format: each value e2m1(code) · 2^(byte − 127) is formed in float32 (exact: e2m1 has
    two significant bits and the smallest nonzero value, 0.5 · 2^-127, is a float32 subnormal) and cast
    once. The cast is exact for bfloat16 and float32 wherever the value is finite there (scale bytes up
    to 252 for |code value| 6); values past float32's range are ±inf and byte 255 gives NaN. Equal bit
    for bit to transformers' ``convert_moe_packed_tensors`` transposed (tests/test_mxfp4_format.py).
    Works block-row chunk by chunk, so the temporaries stay small next to the output.

    Raises ValueError naming ``blocks``, ``scales`` or ``dtype`` on a wrong dtype, shape or device.
    """
    _check_packed(blocks, scales)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_OUT_DTYPES)}, got {dtype!r}")
    lead = tuple(blocks.shape[:-1])  # (..., N, K/32)
    rows = blocks.reshape(-1, MXFP4_BLOCK // 2)
    row_scales = scales.reshape(-1)
    out = torch.empty((rows.shape[0], MXFP4_BLOCK), dtype=dtype, device=blocks.device)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    for r0 in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        b = rows[r0 : r0 + _ROWS_PER_CHUNK]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2).to(torch.int32)  # low nibble first
        scale = e8m0_to_float32(row_scales[r0 : r0 + _ROWS_PER_CHUNK])
        out[r0 : r0 + _ROWS_PER_CHUNK] = (lut[codes] * scale[:, None]).to(dtype)
    return out.view(*lead[:-1], lead[-1] * MXFP4_BLOCK)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``w [..., N, K]`` (float16/bfloat16/float32/float64, finite, K a multiple of 32) into MXFP4
    ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])`` on ``w``'s device.

    Per block of 32 (the OCP MX v1.0 conversion): the scale is ``2 ** (floor(log2(amax)) - 2)`` (the
    block's largest magnitude lands in e2m1's top binade [4, 8)), with the exponent taken exactly from
    the float's bits and clamped to e8m0's [-127, 127]; each value divided by the scale is rounded to
    the nearest e2m1 value, ties to the even code (round half to even, as IEEE), and magnitudes above 6
    saturate to 6. A value that rounds to zero gets code 0 (+0). An all-zero block gets scale byte 0 and
    codes 0. ``dequantize_mxfp4`` of the result is the quantized weight; a ``w`` already on the grid
    (e2m1 values times one power of two per block, its largest magnitude in [4, 6] · 2^e) comes back
    exactly.

    Raises ValueError naming ``w`` when it is not such a tensor (dtype, dims, last dim, inf/NaN or
    beyond float32's range).
    """
    if not isinstance(w, torch.Tensor) or w.dtype not in _OUT_DTYPES or w.dim() < 2:
        raise ValueError(
            f"w must be a float tensor [..., N, K] (float16/bfloat16/float32/float64), got {_desc(w)}"
        )
    K = w.shape[-1]
    if K % MXFP4_BLOCK:
        raise ValueError(
            f"w's last dim K must be a multiple of {MXFP4_BLOCK} (one scale per 32), got K = {K}"
        )
    wb = w.float().reshape(*w.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    if not bool(torch.isfinite(wb).all()):
        raise ValueError("w must be finite in float32 (inf/NaN have no MXFP4 code)")
    amax = wb.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: amax = m · 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1
    exp = torch.frexp(amax).exponent.to(torch.int32) - 1 - _E2M1_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    scale_byte = (exp + 127).to(torch.uint8)
    scaled = wb / e8m0_to_float32(scale_byte).unsqueeze(-1)  # division by a power of two: exact
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = scaled.abs().clamp(max=_E2M1_MAX)
    dist = (mag.unsqueeze(-1) - grid).abs()
    nearest = dist == dist.amin(dim=-1, keepdim=True)  # one grid point, or two on a tie
    even = torch.arange(8, device=w.device) % 2 == 0
    code = (nearest.to(torch.int8) * (1 + even.to(torch.int8))).argmax(dim=-1)  # a tie takes the even code
    sign = (scaled < 0) & (code > 0)
    code = (code + 8 * sign.long()).to(torch.uint8)
    code = code.reshape(*code.shape[:-1], MXFP4_BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), scale_byte.contiguous()


@dataclass(frozen=True)
class MXFP4Weight:
    """A packed MXFP4 weight ``[..., N, K]``: ``blocks`` uint8 ``[..., N, K/32, 16]`` and ``scales``
    uint8 ``[..., N, K/32]`` on one device (see the module docstring for the layout).

    Raises ValueError (from the constructor) naming ``blocks`` or ``scales`` on a wrong dtype, shape or
    device."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        _check_packed(self.blocks, self.scales)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape ``(..., N, K)``."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * MXFP4_BLOCK)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        """Bytes of ``blocks`` and ``scales`` together (4.25 bits per weight)."""
        return self.blocks.numel() + self.scales.numel()

    def to(self, device) -> MXFP4Weight:
        """The same weight with ``blocks`` and ``scales`` on ``device`` (contiguous)."""
        return MXFP4Weight(self.blocks.to(device).contiguous(), self.scales.to(device).contiguous())

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight ``[..., N, K]`` in ``dtype`` (:func:`dequantize_mxfp4`; exact)."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> MXFP4Weight:
        """:func:`quantize_mxfp4` of ``w [..., N, K]``."""
        return cls(*quantize_mxfp4(w))
