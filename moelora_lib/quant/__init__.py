"""Quantized weight formats: MXFP4 (GPT-OSS experts as published)."""

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
    "MXFP4_BLOCK",
    "MXFP4Weight",
    "dequantize_mxfp4",
    "e8m0_to_float32",
    "quantize_mxfp4",
]
