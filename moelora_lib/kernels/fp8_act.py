"""Dynamic FP8 activation quantization: one Triton kernel, :func:`quantize_fp8_act`.

The ``activation_scheme: "dynamic"`` of the published block-FP8 checkpoints (Qwen3 FP8, DeepSeek-V3):
activations are quantized at run time per token and per group of ``g`` consecutive columns (1 × 128 tiles
in the DeepSeek-V3 report), so that a GEMM with block-FP8 weights (:class:`~moelora_lib.quant.FP8BlockWeight`)
runs on FP8 tensor cores (W8A8). For ``x [T, K]`` and each row t and group j (columns j·g … j·g + g − 1,
the last group ragged):

* ``scale[t, j] = amax / 448`` in float32 (amax the group's largest magnitude in float32; the division
  correctly rounded), 1 for an all-zero group, and at least 2^-126 (float32's smallest normal);
* ``q[t, k] = round_e4m3(clamp(x[t, k] / scale[t, j], −448, 448))``: a correctly rounded float32
  division, then float8_e4m3fn round-to-nearest-even.

``x[t, k] ≈ float(q[t, k]) · scale[t, j]`` within 2^-4 relative in e4m3's normal range (2^-10 · scale
absolute below it). The result equals :func:`moelora_lib.quant.quantize_fp8_act_reference` bit for bit
(codes and scales; tests/test_fp8_w8a8_moe.py).

How the kernel gets there on any backend: both divisions use ``tl.math.div_rn`` (IEEE division; Triton's
``/`` on float32 is an approximate division on the GPU), and the e4m3 code is built from the float32 bits
with integer operations (:func:`_e4m3_code`), not with a float8 conversion, so the Triton interpreter
(whose float → float8 cast truncates the subnormals and does not round to even) and the GPU give the same
codes.

Sources: DeepSeek-V3 technical report (arXiv 2412.19437, §3.3: 1 × 128 activation tiles, 128 × 128 weight
blocks, scale = amax / 448); the OCP 8-bit floating point specification (e4m3: bias 7, no infinities,
largest 448, subnormals m · 2^-9). vLLM's ``per_token_group_quant_fp8`` computes the same kind of scale
(with an epsilon floor instead of the all-zero rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common import check_cpu_backend, is_int
from ..common import describe as _desc

__all__ = ["quantize_fp8_act", "fp8_act_scale_shape", "FP8Activations", "FP8_ACT_GROUP"]

#: The default group: 128 columns share one scale (the published checkpoints' weight_block_size[1]).
FP8_ACT_GROUP = 128
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 4096  # elements per program (rows × padded group)


@triton.jit
def _e4m3_code(v):
    """The float8_e4m3fn bit pattern (int32, 0…255) of float32 ``v`` with |v| ≤ 448, rounded to nearest,
    ties to even; the sign is kept (−0.0 → 0x80).

    float32 |v| = 1.m · 2^(e − 127) with 23 mantissa bits. Normal e4m3 (|v| ≥ 2^-6, e ≥ 121): exponent
    e − 120 (bias 7), the top 3 mantissa bits rounded to even by adding 2^19 − 1 plus the kept lowest
    bit before shifting 20 bits out (a carry moves into the exponent, as it should). Subnormal e4m3
    (|v| < 2^-6): the code is |v| / 2^-9 rounded to an integer 0…8, i.e. the 24-bit significand shifted
    right by 141 − e with round-half-even on the bits shifted out (8 is 2^-6, the smallest normal, whose
    code is 8 too); float32 zeros and subnormals give 0."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 31) & 1
    a = b & 0x7FFFFFFF
    e = a >> 23
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    shift = tl.minimum(tl.maximum(141 - e, 21), 31)
    mant = (a & 0x7FFFFF) | 0x800000
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(e >= 121, normal, q) | (sign << 7)


@triton.jit(do_not_specialize=["T"])
def _quantize_fp8_act_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    T,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sk,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Program (i, j): rows i·BLOCK_M … of group j. ``q_ptr`` is the e4m3 output viewed as uint8."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = tl.arange(0, BLOCK_G)
    cols = tl.program_id(1) * GROUP + offs_g
    r_mask = rows < T
    mask = r_mask[:, None] & ((offs_g < GROUP) & (cols < K))[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + c64[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    e4m3_max = tl.full((BLOCK_M,), 448.0, tl.float32)
    scale = tl.maximum(tl.math.div_rn(amax, e4m3_max), 2.0**-126)  # the smallest normal fp32
    scale = tl.where(amax > 0.0, scale, 1.0)
    v = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (BLOCK_M, BLOCK_G)))
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    code = _e4m3_code(v).to(tl.uint8)
    tl.store(q_ptr + r64[:, None] * stride_qm + c64[None, :] * stride_qk, code, mask=mask)
    tl.store(s_ptr + r64 * stride_sm + tl.program_id(1) * stride_sk, scale, mask=r_mask)


def fp8_act_scale_shape(T: int, K: int, group_size: int = FP8_ACT_GROUP) -> tuple[int, int]:
    """The shape ``(T, ceil(K / group_size))`` of :func:`quantize_fp8_act`'s scales."""
    return (T, -(-K // group_size))


def _check_cpu(x: torch.Tensor) -> None:
    if x.device.type == "cpu":
        check_cpu_backend(_quantize_fp8_act_kernel, None, "x")


def quantize_fp8_act(
    x: torch.Tensor,
    group_size: int = FP8_ACT_GROUP,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations ``x`` per token and per group of ``group_size`` columns to FP8 (one launch).

    Args:
        x: [T, K] float16/bfloat16/float32 (any strides), CUDA or (under the Triton interpreter) CPU.
            Must be finite; not checked (no host sync): a group holding inf or NaN gets unspecified codes
            and scale. bfloat16 is only read and widened to float32, so it is exact on the interpreter too.
        group_size: g ≥ 1 columns per scale; the last group of a row may be ragged (K % g columns).
        out: optional preallocated ``(q, scale)``: q float8_e4m3fn [T, K], scale float32
            [T, ceil(K/g)], on x's device (any strides). Nothing is allocated and nothing waits on the
            device, so the call can be captured in a CUDA graph.
    Returns:
        ``(q, scale)``: q float8_e4m3fn [T, K], scale float32 [T, ceil(K/g)] with
        ``x[t, k] ≈ float(q[t, k]) · scale[t, k // g]`` — exactly the codes and scales of
        :func:`moelora_lib.quant.quantize_fp8_act_reference` (the rule is in the module docstring).
        T = 0 or K = 0 launches nothing.
    Raises:
        ValueError naming the argument: ``x`` not a 2-D float16/bfloat16/float32 tensor (or on the CPU
        without the interpreter), ``group_size`` not a positive int, ``out`` not a pair of tensors of the
        right shape, dtype and device.
    """
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    group_size = int(group_size)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _IN_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor [T, K], got {_desc(x)}")
    _check_cpu(x)
    T, K = x.shape
    s_shape = fp8_act_scale_shape(T, K, group_size)
    if out is None:
        q = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(s_shape, dtype=torch.float32, device=x.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"out must be a pair (q, scale) of tensors or None, got {_desc(out)}")
        q, scale = out
        for what, t, shape, dt in (
            ("q", q, (T, K), torch.float8_e4m3fn),
            ("scale", scale, s_shape, torch.float32),
        ):
            if (
                not isinstance(t, torch.Tensor)
                or tuple(t.shape) != shape
                or t.dtype != dt
                or t.device != x.device
            ):
                raise ValueError(
                    f"out[{0 if what == 'q' else 1}] ({what}) must be a {dt} tensor {list(shape)} on "
                    f"{x.device}, got {_desc(t)}"
                )
    if T == 0 or K == 0:
        return q, scale
    block_g = triton.next_power_of_2(group_size)
    block_m = max(1, min(64, _TILE // block_g))
    grid = (triton.cdiv(T, block_m), s_shape[1])
    q8 = q.view(torch.uint8)
    _quantize_fp8_act_kernel[grid](
        x,
        q8,
        scale,
        T,
        K,
        x.stride(0),
        x.stride(1),
        q8.stride(0),
        q8.stride(1),
        scale.stride(0),
        scale.stride(1),
        GROUP=group_size,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return q, scale


@dataclass(frozen=True)
class FP8Activations:
    """Activations quantized by :func:`quantize_fp8_act`, as the W8A8 base GEMMs take their A operand:
    ``q`` float8_e4m3fn [rows, K], ``scale`` float32 [rows, ceil(K/group_size)] (row r, columns
    j·g … j·g + g − 1 of q times scale[r, j]), ``group_size`` g. No checks here: the launchers check
    what the kernels need (:func:`moelora_lib.kernels.launchers.act_operand`)."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int = FP8_ACT_GROUP

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        group_size: int = FP8_ACT_GROUP,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> FP8Activations:
        """:func:`quantize_fp8_act` of ``x`` [rows, K] (one launch), as an :class:`FP8Activations`."""
        return cls(*quantize_fp8_act(x, group_size, out=out), group_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """(rows, K), the shape of ``q``."""
        return tuple(self.q.shape)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[rows, K]: float(q)·scale per element, computed in float64 (exact: an e4m3 value has 4
        significant bits, a float32 scale 24) and cast once to ``dtype`` — the values the W8A8 GEMMs
        multiply."""
        K = self.q.shape[1]
        s = self.scale.double().repeat_interleave(self.group_size, dim=1)[:, :K]
        return (self.q.double() * s).to(dtype)
