"""Kernel stages of moelora_lib: ``STAGES[name]`` -> :class:`~moelora_lib.kernels.stages.Stage`.

Stages in order: naive -> no_recompile -> split_k -> swizzle -> even_k_fused_add -> tuned -> fused. Every
stage runs the same layer forward (:class:`~moelora_lib.kernels.stages.LayerRun`) with its own switches.
"""

from . import even_k_fused_add, fused, naive, no_recompile, split_k, swizzle, tuned
from .config import LayerConfig, OpConfig
from .launchers import fused_moe_gemm, gated_act, lora_expand, lora_shrink
from .stages import LAUNCH_OPS, Launch, LayerRun, Stage, default_config

STAGES: dict[str, Stage] = {
    m.STAGE.name: m.STAGE for m in (naive, no_recompile, split_k, swizzle, even_k_fused_add, tuned, fused)
}

__all__ = [
    "STAGES",
    "Stage",
    "LayerRun",
    "Launch",
    "LAUNCH_OPS",
    "LayerConfig",
    "OpConfig",
    "default_config",
    "fused_moe_gemm",
    "lora_shrink",
    "lora_expand",
    "gated_act",
]
