"""Quantized weight formats: MXFP4 (GPT-OSS experts as published) and block-scaled FP8 (Qwen3 FP8
checkpoints as published)."""

from .fp8 import (
    E4M3_MAX,
    FP8_BLOCK,
    FP8BlockWeight,
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
    "e8m0_to_float32",
    "fp8_scale_grid",
    "quantize_fp8_act_reference",
    "quantize_fp8_block",
    "quantize_mxfp4",
]
