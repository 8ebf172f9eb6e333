"""MXFP4 (OCP Microscaling Formats v1.0, FP4 e2m1 elements, one e8m0 scale per 32) in the layout of
the published GPT-OSS checkpoints.

A weight ``W [..., N, K]`` (rows = output features N, K the reduction axis) is stored as

* ``blocks`` uint8 ``[..., N, K // 32, 16]``: 32 e2m1 codes per block, two per byte, the **low nibble
  first** (element 2i in bits 0–3 of byte i, element 2i + 1 in bits 4–7);
* ``scales`` uint8 ``[..., N, K // 32]``: the e8m0 exponent of each block, value ``2 ** (byte - 127)``.

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

__all__ = ["E2M1_VALUES", "MXFP4_BLOCK", "MXFP4Weight", "dequantize_mxfp4", "quantize_mxfp4"]

#: Elements sharing one scale.
MXFP4_BLOCK = 32
#: The 16 e2m1 values, indexed by code (bit 3 is the sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
_E2M1_MAX = 6.0
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2


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


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The dense weight ``[..., N, K]`` (``K = 32 * blocks.shape[-2]``) of packed MXFP4 ``blocks``
    uint8 ``[..., N, K/32, 16]`` and ``scales`` uint8 ``[..., N, K/32]``, in ``dtype``.

    Exact: every value is a power of two times an e2m1 value, computed in fp32 and cast once (exact in
    bf16 for scales in bf16's exponent range; float32 for any). Raises ValueError naming the tensor on a
    wrong dtype or shape.
    """
    _check_packed(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    vals = torch.stack((lut[lo], lut[hi]), dim=-1).flatten(-2)  # [..., N, K/32, 32], low nibble first
    exp = scales.to(torch.int32) - 127
    vals = torch.ldexp(vals, exp.unsqueeze(-1).to(torch.float32))
    return vals.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``w [..., N, K]`` (float, K a multiple of 32) into MXFP4 ``(blocks, scales)``.

    Per block of 32: the scale is ``2 ** (floor(log2(amax)) - 2)`` (the OCP rule: the block's largest
    magnitude lands in e2m1's top binade), each value divided by it is rounded to the nearest e2m1 value
    (ties to the even code), and magnitudes above 6 saturate to 6. An all-zero block gets scale byte 0
    and codes 0. ``dequantize_mxfp4`` of the result is the quantized weight.

    Raises ValueError when ``w`` is not a float tensor with a last dim divisible by 32.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"w must be a float tensor [..., N, K], got {_desc(w)}")
    K = w.shape[-1]
    if K % MXFP4_BLOCK:
        raise ValueError(
            f"w's last dim K must be a multiple of {MXFP4_BLOCK} (one scale per 32), got K = {K}"
        )
    wb = w.float().reshape(*w.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wb.abs().amax(dim=-1)
    exp = torch.floor(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))) - _E2M1_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0)).clamp(-127, 127)
    scaled = wb / torch.ldexp(torch.ones_like(exp), exp).unsqueeze(-1)
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
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


@dataclass(frozen=True)
class MXFP4Weight:
    """A packed MXFP4 weight ``[..., N, K]``: ``blocks`` uint8 ``[..., N, K/32, 16]`` and ``scales``
    uint8 ``[..., N, K/32]`` on one device (see the module docstring for the layout)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        _check_packed(self.blocks, self.scales)
        if self.blocks.device != self.scales.device:
            raise ValueError(
                f"blocks and scales must be on one device, got {self.blocks.device} and {self.scales.device}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape ``(..., N, K)``."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * MXFP4_BLOCK)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight ``[..., N, K]`` in ``dtype`` (exact)."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> MXFP4Weight:
        """:func:`quantize_mxfp4` of ``w [..., N, K]``."""
        return cls(*quantize_mxfp4(w))
