"""Quantized weight formats: MXFP4 (GPT-OSS experts as published) and block-scaled FP8 (Qwen3 FP8
checkpoints as published)."""

import torch

from .fp8 import (
    E4M3_MAX,
    FP8_BLOCK,
    FP8BlockWeight,
    check_fp8_finite,
    dequantize_fp8_block,
    fp8_scale_grid,
    quantize_fp8_act_reference,
    quantize_fp8_block,
)
from .mxfp4 import (
    E2M1_VALUES,
    MXFP4_BLOCK,
    MXFP4Weight,
    dequantize_mxfp4,
    e8m0_to_float32,
    quantize_mxfp4,
)

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "FP8BlockWeight",
    "MXFP4_BLOCK",
    "MXFP4Weight",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "check_dequantized_finite",
    "e8m0_to_float32",
    "fp8_scale_grid",
    "quantize_fp8_act_reference",
    "quantize_fp8_block",
    "quantize_mxfp4",
]


#: Dense elements of one chunk :func:`check_dequantized_finite` dequantizes at a time: on the CPU, and on
#: a GPU (larger: fewer launches over a 100B-parameter model's experts, 128 MiB of bfloat16 temporaries).
_CHECK_CHUNK = 1 << 22
_CHECK_CHUNK_CUDA = 1 << 26


def _row_chunks(w: MXFP4Weight | FP8BlockWeight):
    """``w`` [..., N, K] as packed weights of at most about ``_CHECK_CHUNK`` (``_CHECK_CHUNK_CUDA``) dense
    elements each, covering every row once (FP8: whole block rows, each with its own scale rows)."""
    chunk = _CHECK_CHUNK_CUDA if w.device.type == "cuda" else _CHECK_CHUNK
    if isinstance(w, MXFP4Weight):
        b = w.blocks.reshape(-1, *w.blocks.shape[-2:])
        s = w.scales.reshape(-1, w.scales.shape[-1])
        rows = max(1, chunk // w.shape[-1])
        for r0 in range(0, b.shape[0], rows):
            yield MXFP4Weight(b[r0 : r0 + rows], s[r0 : r0 + rows])
        return
    bn = w.block[0]
    q = w.weight.reshape(-1, *w.weight.shape[-2:])
    s = w.scale_inv.reshape(-1, *w.scale_inv.shape[-2:])
    N, K = q.shape[-2:]
    rows = bn * max(1, chunk // (bn * max(K, 1)))
    for e in range(q.shape[0]):
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            yield FP8BlockWeight(q[e, r0:r1], s[e, r0 // bn : -(-r1 // bn)], w.block)


def check_dequantized_finite(name: str, w: MXFP4Weight | FP8BlockWeight, dtype: torch.dtype) -> None:
    """ValueError naming ``name`` unless every value of the packed weight ``w`` dequantized to ``dtype``
    (``w.dequantize(dtype)``, what the kernels compute with) is finite: a scale that puts a value
    beyond ``dtype``'s range (e.g. above float16's 65504) would make every output row reading it inf or
    NaN. Dequantizes chunk by chunk (4M elements on the CPU, 64M on a GPU), one host sync; for weights at
    construction, never per call. Meta tensors are not read. An FP8 weight holding a NaN code or a
    NaN/inf scale raises :func:`~moelora_lib.quant.fp8.check_fp8_finite`'s error, naming which."""
    if w.device.type == "meta":
        return
    ok = torch.ones((), dtype=torch.bool, device=w.device)
    for part in _row_chunks(w):
        if part.blocks.numel() if isinstance(part, MXFP4Weight) else part.weight.numel():
            lo, hi = torch.aminmax(part.dequantize(dtype))
            ok &= torch.isfinite(lo) & torch.isfinite(hi)
    if not bool(ok):
        if isinstance(w, FP8BlockWeight):  # a NaN code or a NaN/inf scale: named as such
            check_fp8_finite(name, w)
        hint = "; float32 or bfloat16 hold them" if dtype == torch.float16 else ""
        raise ValueError(
            f"{name}: dequantized to the layer's dtype {dtype}, some values are not finite (beyond its "
            f"range, largest {torch.finfo(dtype).max:g}): every output row reading them would be inf or "
            f"NaN{hint}"
        )
