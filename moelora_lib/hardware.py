"""Hardware facts used by default configs, tuners and roofline floors: one place for each number.

All figures are for one NVIDIA H200 (SXM, 141 GB HBM3e), measured (docs/anchors-h200.md, "Physical
limits on this H200") or as reported by the driver:

- ``H200_NUM_SMS``: 132 streaming multiprocessors
  (``torch.cuda.get_device_properties(0).multi_processor_count``).
- ``H200_COPY_TB_PER_S``: ~4.3 TB/s device-to-device copy (bytes read + written; 4.23–4.27 measured).
- ``H200_READ_TB_PER_S``: ~4.46 TB/s for a pure read stream (notebook 08's ceilings, data/08_ceilings.json).
- ``H200_BF16_TFLOPS``: 675 TFLOP/s bf16 dense matmul (torch's 8192³ matmul; 790–815 seen at the top of the
  range, so compute floors built on it are approximate).
- ``H200_FP8_TFLOPS``: ~1351 TFLOP/s FP8 (e4m3) dense matmul, not measured here: the measured bf16 rate
  times the datasheet's FP8 ÷ bf16 ratio (``H200_FP8_SPEC_TFLOPS`` 1979 ÷ ``H200_BF16_SPEC_TFLOPS`` 989,
  dense, without sparsity: ≈ 2). A floor built on it is as approximate as the bf16 one.
- ``H200_L2_BYTES``: 60 MB L2 as PyTorch reports it.

Units: TB/s = 1e12 bytes per second, TFLOP/s = 1e12 FLOP per second.
"""

from __future__ import annotations

__all__ = [
    "H200_NUM_SMS",
    "H200_COPY_TB_PER_S",
    "H200_READ_TB_PER_S",
    "H200_BF16_TFLOPS",
    "H200_FP8_TFLOPS",
    "H200_BF16_SPEC_TFLOPS",
    "H200_FP8_SPEC_TFLOPS",
    "H200_L2_BYTES",
]

H200_NUM_SMS = 132
H200_COPY_TB_PER_S = 4.3
H200_READ_TB_PER_S = 4.46
H200_BF16_TFLOPS = 675.0
H200_BF16_SPEC_TFLOPS = 989.0
H200_FP8_SPEC_TFLOPS = 1979.0
H200_FP8_TFLOPS = H200_BF16_TFLOPS * H200_FP8_SPEC_TFLOPS / H200_BF16_SPEC_TFLOPS
H200_L2_BYTES = 60 * 1024 * 1024
