"""Block-scaled FP8 (float8_e4m3fn weights, one scale per block of rows × columns) in the layout of the
published Qwen3 FP8 checkpoints (Qwen3-30B-A3B-FP8, Qwen3-32B-FP8) and DeepSeek-V3.

A weight ``W [..., N, K]`` (rows = output features N, K the reduction axis) is stored as

* ``weight`` float8_e4m3fn ``[..., N, K]``;
* ``scale_inv`` ``[..., ceil(N / bn), ceil(K / bk)]``, one scale per block of ``block = (bn, bk)``
  (the config's ``weight_block_size``, [128, 128] in every published file; float32 in most files, bfloat16
  or float16 in some: each is accepted). N and K need not be multiples of the block: the last block row /
  column is ragged (fewer rows or columns) and still has its scale.

``W[..., n, k] = float(weight[..., n, k]) * scale_inv[..., n // bn, k // bk]``: the dequantization is the
product in float32 (the FP8 value and the scale converted exactly), cast once to the output dtype — what
transformers' ``FineGrainedFP8Config(dequantize=True)`` load builds (``Fp8Dequantize`` in
``transformers/integrations/finegrained_fp8.py``; tests/test_fp8_format.py checks it bit for bit).

float8_e4m3fn (OCP 8-bit floating point, "fn": finite, no infinities): 1 sign, 4 exponent (bias 7), 3
mantissa bits; largest magnitude 448, smallest normal 2^-6, smallest subnormal 2^-9; codes 0x7F and 0xFF
are NaN. Rounding a real to it has relative error at most 2^-4 in the normal range and absolute error at
most 2^-10 below it.

Sources: the ``quantization_config`` and ``*.weight_scale_inv`` tensors of Qwen/Qwen3-30B-A3B-FP8 and
Qwen/Qwen3-32B-FP8; the DeepSeek-V3 report (fine-grained 128 × 128 weight blocks, scale = amax / 448);
the OCP 8-bit Floating Point Specification (OFP8) for e4m3.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "E4M3_MAX",
    "FP8_BLOCK",
    "FP8BlockWeight",
    "check_fp8_finite",
    "dequantize_fp8_block",
    "fp8_scale_grid",
    "quantize_fp8_block",
    "quantize_fp8_act_reference",
]

#: The default block (rows, columns) sharing one scale: ``weight_block_size`` [128, 128].
FP8_BLOCK: tuple[int, int] = (128, 128)
#: The largest finite float8_e4m3fn magnitude.
E4M3_MAX = 448.0
_FP8 = torch.float8_e4m3fn
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# weight elements dequantized per step: bounds the float32 temporaries (~32 MiB each)
_ELEMS_PER_CHUNK = 1 << 23


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def _check_block(block) -> tuple[int, int]:
    """``block`` as a (rows, columns) tuple of positive ints; ValueError naming it otherwise."""
    ok = (
        isinstance(block, Sequence)
        and len(block) == 2
        and all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
        raise ValueError(f"block must be two positive ints (rows, columns), e.g. (128, 128), got {block!r}")
    return int(block[0]), int(block[1])


def fp8_scale_grid(shape: Sequence[int], block: Sequence[int] = FP8_BLOCK) -> tuple[int, ...]:
    """The ``scale_inv`` shape of a weight of dense ``shape (..., N, K)``:
    ``(..., ceil(N / block[0]), ceil(K / block[1]))``. Raises ValueError naming ``block``."""
    bn, bk = _check_block(block)
    *lead, n, k = shape
    return (*lead, -(-n // bn), -(-k // bk))


def _check_packed(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> tuple[int, int]:
    bn, bk = _check_block(block)
    if not isinstance(weight, torch.Tensor) or weight.dtype != _FP8 or weight.dim() < 2:
        raise ValueError(f"weight must be a float8_e4m3fn tensor [..., N, K], got {_desc(weight)}")
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype not in _SCALE_DTYPES:
        raise ValueError(
            "scale_inv must be a float32, bfloat16 or float16 tensor [..., ceil(N/bn), ceil(K/bk)], got "
            f"{_desc(scale_inv)}"
        )
    want = fp8_scale_grid(weight.shape, (bn, bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv must have shape {list(want)} (one scale per {bn} x {bk} block of weight "
            f"{list(weight.shape)}, last blocks ragged), got {list(scale_inv.shape)}"
        )
    if weight.device != scale_inv.device:
        raise ValueError(
            f"weight and scale_inv must be on one device, got {weight.device} and {scale_inv.device}"
        )
    return bn, bk


def check_fp8_finite(name: str, w: FP8BlockWeight) -> None:
    """ValueError naming ``{name}.scale_inv`` or ``{name}.weight`` when the block-FP8 weight ``w`` is not
    finite: a NaN or infinite scale, or a NaN code (0x7F or 0xFF; float8_e4m3fn has no infinities) —
    every output row reading it would be NaN. The codes are read in chunks of rows (temporaries of about
    8 MiB at most), with two host syncs; for weights at construction, never per call. Meta tensors are
    not read."""
    if w.weight.device.type == "meta":
        return
    s = w.scale_inv
    if s.numel() and not bool(torch.isfinite(s).all()):
        raise ValueError(
            f"{name}.scale_inv holds NaN or inf: every output row reading its block would be NaN"
        )
    codes = w.weight.view(torch.uint8)
    codes = codes.reshape(-1, codes.shape[-1])  # an FP8BlockWeight has at least 2 dims
    rows = max(1, _ELEMS_PER_CHUNK // max(codes.shape[1], 1))
    bad = torch.zeros((), dtype=torch.bool, device=codes.device)
    for r0 in range(0, codes.shape[0], rows):
        bad |= ((codes[r0 : r0 + rows] & 0x7F) == 0x7F).any()
    if bool(bad):
        raise ValueError(
            f"{name}.weight holds the float8_e4m3fn NaN code (0x7F or 0xFF): every output row reading it "
            "would be NaN"
        )


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: Sequence[int] = FP8_BLOCK,
) -> torch.Tensor:
    """The dense weight ``[..., N, K]`` of block-FP8 ``weight`` float8_e4m3fn ``[..., N, K]`` and
    ``scale_inv`` float32/bfloat16/float16 ``[..., ceil(N/bn), ceil(K/bk)]`` (``block = (bn, bk)``), in
    ``dtype`` (float16, bfloat16, float32 or float64), on the inputs' device.

    Each element is ``float32(weight) * float32(scale_inv[block])`` — both conversions exact, the product
    rounded once in float32 — cast once to ``dtype``: the numbers transformers' FP8 dequantization at load
    gives (bit for bit, tests/test_fp8_format.py). float64 gets the float32 product widened. Works in
    chunks of whole block rows, so the float32 temporaries stay small next to the output.

    Raises ValueError naming ``weight``, ``scale_inv``, ``block`` or ``dtype`` on a wrong dtype, shape
    (the scale grid must be ceil(N/bn) x ceil(K/bk)) or device.
    """
    bn, bk = _check_packed(weight, scale_inv, block)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_OUT_DTYPES)}, got {dtype!r}")
    *lead, N, K = weight.shape
    w3 = weight.reshape(-1, N, K)
    s3 = scale_inv.reshape(-1, *scale_inv.shape[-2:])
    out = torch.empty(w3.shape, dtype=dtype, device=weight.device)
    rows = max(bn, (_ELEMS_PER_CHUNK // max(K, 1)) // bn * bn)  # whole block rows per chunk
    for e in range(w3.shape[0]):
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            s = s3[e, r0 // bn : -(-r1 // bn)].float()
            s = s.repeat_interleave(bn, dim=0)[: r1 - r0].repeat_interleave(bk, dim=1)[:, :K]
            out[e, r0:r1] = (w3[e, r0:r1].float() * s).to(dtype)
    return out.view(*lead, N, K)


def quantize_fp8_block(
    w: torch.Tensor, block: Sequence[int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` (float16/bfloat16/float32/float64, finite in float32) to block FP8:
    ``(weight float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)])`` on ``w``'s
    device, ``block = (bn, bk)``; N and K need not be multiples of the block (ragged last blocks).

    Per block (the DeepSeek-V3 / Qwen FP8 scheme): ``scale_inv = amax / 448`` in float32 (amax the
    block's largest magnitude of ``w`` in float32), each value ``w / scale_inv`` (float32 division)
    clamped to ±448 and rounded to the nearest e4m3 value, ties to even (torch's float32 → float8_e4m3fn
    conversion). Choices at the edges: an all-zero block gets ``scale_inv = 1`` (its codes are zeros; so
    does transformers' own quantizer); a block whose ``amax / 448`` underflows float32's normal range
    (amax < 448 · 2^-126) gets the smallest normal float32, 2^-126, so no division by zero.
    ``dequantize_fp8_block`` of the result is within 2^-4 relative (2^-10 · scale_inv absolute below
    e4m3's normal range) of ``w`` per element; a block's largest magnitude maps to ±448.

    Raises ValueError naming ``w`` (dtype, fewer than 2 dims, inf/NaN or beyond float32's range) or
    ``block``.
    """
    bn, bk = _check_block(block)
    if not isinstance(w, torch.Tensor) or w.dtype not in _IN_DTYPES or w.dim() < 2:
        raise ValueError(
            f"w must be a float tensor [..., N, K] (float16/bfloat16/float32/float64), got {_desc(w)}"
        )
    *lead, N, K = w.shape
    gn, gk = -(-N // bn), -(-K // bk)
    wf = w.float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("w must be finite in float32 (inf/NaN have no e4m3 value)")
    padded = torch.zeros((*lead, gn * bn, gk * bk), dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = wf
    blocks = padded.view(*lead, gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    tiny = torch.finfo(torch.float32).tiny
    scale_inv = torch.where(amax > 0, (amax / E4M3_MAX).clamp(min=tiny), torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(_FP8)
    q = q.view(*lead, gn * bn, gk * bk)[..., :N, :K]
    return q.contiguous(), scale_inv.contiguous()


def quantize_fp8_act_reference(
    x: torch.Tensor, group_size: int = FP8_BLOCK[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-group activation quantization (the ``activation_scheme: "dynamic"`` of the
    published block-FP8 checkpoints), written for clarity: the oracle the W8A8 kernels, which quantize
    their activation tiles in registers, are tested against.

    ``x [T, K]`` (float16/bfloat16/float32) → ``(q float8_e4m3fn [T, K], scale float32 [T, ceil(K/g)])``
    with ``g = group_size``: per row and group of ``g`` columns (the last one ragged), the same rule as
    :func:`quantize_fp8_block` — ``scale = amax / 448`` in float32 (an all-zero group gets 1, an amax
    below 448 · 2^-126 gets 2^-126), ``q = round_e4m3(clamp(x / scale, ±448))`` (float32 division, ties to
    even). ``x ≈ float(q) * scale`` within 2^-4 relative per element in e4m3's normal range.

    Raises ValueError naming ``x`` (not a finite 2-D float tensor) or ``group_size`` (not a positive int).
    Source: DeepSeek-V3 report (1 × 128 activation tiles); vLLM's ``per_token_group_quant_fp8`` follows
    the same rule with an epsilon in place of the zero-group case.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _IN_DTYPES:
        raise ValueError(f"x must be a 2-D float tensor [T, K], got {_desc(x)}")
    if not bool(torch.isfinite(x.float()).all()):
        raise ValueError("x must be finite in float32 (inf/NaN have no e4m3 value)")
    if x.shape[0]:
        q, s = quantize_fp8_block(x, (1, group_size))
    else:
        q = torch.empty(x.shape, dtype=_FP8, device=x.device)
        s = torch.empty((0, -(-x.shape[1] // group_size)), dtype=torch.float32, device=x.device)
    return q, s


@dataclass(frozen=True)
class FP8BlockWeight:
    """A block-FP8 weight ``[..., N, K]``: ``weight`` float8_e4m3fn ``[..., N, K]`` and ``scale_inv``
    float32/bfloat16/float16 ``[..., ceil(N/bn), ceil(K/bk)]`` on one device, ``block = (bn, bk)``
    (default (128, 128)); see the module docstring for the layout.

    Raises ValueError (from the constructor) naming ``weight``, ``scale_inv`` or ``block`` on a wrong
    dtype, shape or device."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = FP8_BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", _check_packed(self.weight, self.scale_inv, self.block))

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape ``(..., N, K)``."""
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Bytes of ``weight`` and ``scale_inv`` together (8 bits per weight plus the scales)."""
        return self.weight.numel() + self.scale_inv.numel() * self.scale_inv.element_size()

    def to(self, device) -> FP8BlockWeight:
        """The same weight with ``weight`` and ``scale_inv`` on ``device`` (contiguous)."""
        return FP8BlockWeight(
            self.weight.to(device).contiguous(), self.scale_inv.to(device).contiguous(), self.block
        )

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight ``[..., N, K]`` in ``dtype`` (:func:`dequantize_fp8_block`; exact)."""
        return dequantize_fp8_block(self.weight, self.scale_inv, dtype, self.block)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: Sequence[int] = FP8_BLOCK) -> FP8BlockWeight:
        """:func:`quantize_fp8_block` of ``w [..., N, K]``."""
        return cls(*quantize_fp8_block(w, block), _check_block(block))

    @classmethod
    def cat(cls, parts: Sequence[FP8BlockWeight]) -> FP8BlockWeight:
        """The weights of ``parts`` stacked along the rows N (as the fused q | k | v or gate | up
        projections are): ``weight`` and ``scale_inv`` concatenated along dim -2. Every part must have
        the same block, leading dims, K and scale dtype, and every part but the last a multiple of the
        block's rows (a ragged block row inside the result would share one scale between two parts).

        Raises ValueError naming ``parts``."""
        parts = list(parts)
        if not parts or not all(isinstance(p, FP8BlockWeight) for p in parts):
            raise ValueError(f"parts must be a non-empty sequence of FP8BlockWeight, got {parts!r}")
        first = parts[0]
        for i, p in enumerate(parts):
            if (
                p.block != first.block
                or p.shape[:-2] != first.shape[:-2]
                or p.shape[-1] != first.shape[-1]
                or p.scale_inv.dtype != first.scale_inv.dtype
                or p.device != first.device
            ):
                raise ValueError(
                    f"parts[{i}]: block {p.block}, shape {list(p.shape)}, scale_inv {p.scale_inv.dtype} on "
                    f"{p.device} do not match parts[0]'s {first.block}, {list(first.shape)}, "
                    f"{first.scale_inv.dtype} on {first.device} (all but N must agree)"
                )
            if i < len(parts) - 1 and p.shape[-2] % first.block[0]:
                raise ValueError(
                    f"parts[{i}]: N = {p.shape[-2]} is not a multiple of the block rows {first.block[0]}; "
                    "only the last part may end in a ragged block row"
                )
        return cls(
            torch.cat([p.weight for p in parts], dim=-2),
            torch.cat([p.scale_inv for p in parts], dim=-2),
            first.block,
        )
