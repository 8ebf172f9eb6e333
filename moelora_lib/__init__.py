"""moelora_lib: Triton kernels for serving many LoRA adapters on one Mixture-of-Experts model.

Public entry points: :func:`fused_moe_lora` (the MoE + multi-LoRA layer) and :func:`route`
(softmax top-k routing). Kernel stages are listed in :data:`moelora_lib.kernels.STAGES`.
Importing the package runs no kernel and reads no environment variable.
"""

from .kernels import STAGES, LayerConfig, OpConfig
from .moe_lora import fused_moe_lora
from .routing import route

__all__ = ["fused_moe_lora", "route", "STAGES", "LayerConfig", "OpConfig"]
