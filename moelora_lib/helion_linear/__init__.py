"""Helion linear backend: tuned Helion GEMMs behind an engine-style linear-method API, with an
``F.linear`` (cuBLAS) fallback. Notebook 08.

What is here
------------
* ``kernels`` — Helion kernels (helion 1.4.0), y = x·Wᵀ with W in nn.Linear layout [N, K]:
  plain, + bias, + SiLU, fused SwiGLU (gate and up GEMMs share every x tile; W = merged
  [2I, K] gate_up, gate = rows [0, I), up = rows [I, 2I); output [M, I]), and split-K variants
  (plain, + bias) that reduce K chunks with fp32 ``hl.atomic_add``. bf16 and fp16 on the GPU; fp32
  and fp16 run through the CPU Triton interpreter in tests. fp32 accumulation everywhere.
  K and N are specialized (``hl.specialize``) and M is dynamic (``static_shapes=False``), so one
  compiled runner per config serves every M of its bucket.
* ``configs`` — M buckets {1, 2, 4, …, 1024, ≥2048} and the JSON config table
  ``moelora_lib/configs/helion/<GPU_NAME>.json`` (GPU_NAME = torch.cuda.get_device_name() with
  spaces and '-' replaced by '_', e.g. ``NVIDIA_H200``)::

      {"_meta": {...},
       "<epilogue>": {"<dtype>": {"<K>,<N>": {"<bucket>": {<helion.Config fields>[, "split_k": s]}}}}}

  epilogue ∈ none | bias | silu | swiglu; dtype ∈ bfloat16 | float16 | float32; K, N the weight's
  [N, K] (swiglu: N = 2I); bucket ∈ 1 2 4 8 16 32 64 128 256 512 1024 2048 ("2048" = every M > 1024).
  ``block_sizes`` [BM, BN, BK] is required; a ``split_k`` field selects the split-K kernel.
  Malformed files raise ``ConfigFileError`` (a ValueError) naming the file and key; writes are atomic.
* ``method`` — ``LinearMethodBase`` (``create_weights(layer, input_size, output_size, dtype)``,
  ``process_weights_after_loading(layer)``, ``apply(layer, x, bias=None)``), ``TorchLinearMethod``
  (F.linear + PyTorch epilogue) and ``HelionLinearMethod(configs=..., epilogue=...)`` with
  ``warmup(layer, max_m)``, ``path_for(layer, m)`` ("helion:<bucket>" or "torch: <reason>") and a
  one-warning-per-reason fallback (untuned shapes and buckets, and tuned configs that Helion/Triton
  cannot build or compile — remembered per bucket); ``Linear`` is a minimal layer using them.
* ``shapes`` — the dense-model projections (Llama-3.1-8B, Qwen3-32B, Llama-3.3-70B) used by the
  tuner (``python -m moelora_lib.studies.helion_tune``) and notebook 08.

Errors: bad input to ``apply`` (x not 2-D, K mismatch, dtype or device different from the weight's,
bias not fitting the epilogue) raises ValueError naming the argument and the expected shape/dtype.

Sources: the Helion docs and examples (``examples/matmul.py``, ``examples/matmul_split_k.py``,
"Advanced Manual Deployment": bind + compile_config) and the design of vLLM's Helion linear backend
(pre-tuned per-GPU JSON configs, shape buckets, no runtime autotuning, native fallback, CUDA-graph
replay for decode), as summarized in docs/helion.md. The code is our own.

Importing this package does not import helion; the kernels module is imported on first use, and a
failed helion import only turns every path into the fallback.
"""

from __future__ import annotations

from .configs import (
    BUCKETS,
    CONFIG_DIR,
    DTYPES,
    EPILOGUES,
    ConfigFileError,
    bucket_for,
    gpu_config_name,
    load_configs,
    lookup,
    save_configs,
    set_entry,
    shape_key,
    shipped_config_path,
    validate_table,
)
from .method import (
    HelionFallbackWarning,
    HelionLinearMethod,
    Linear,
    LinearMethodBase,
    TorchLinearMethod,
    build_runner,
    helion_available,
    kernel_args,
    torch_reference,
    warm_m_values,
)
from .shapes import LINEAR_MODELS, DenseModel, linear_shapes

__all__ = [
    "BUCKETS",
    "CONFIG_DIR",
    "DTYPES",
    "EPILOGUES",
    "LINEAR_MODELS",
    "ConfigFileError",
    "DenseModel",
    "HelionFallbackWarning",
    "HelionLinearMethod",
    "Linear",
    "LinearMethodBase",
    "TorchLinearMethod",
    "bucket_for",
    "build_runner",
    "gpu_config_name",
    "helion_available",
    "kernel_args",
    "linear_shapes",
    "load_configs",
    "lookup",
    "save_configs",
    "set_entry",
    "shape_key",
    "shipped_config_path",
    "torch_reference",
    "validate_table",
    "warm_m_values",
]
