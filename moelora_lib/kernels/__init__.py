"""Kernel stages of moelora_lib: ``STAGES[name]`` -> :class:`~moelora_lib.kernels.stages.Stage`.

Stages in order: naive -> no_recompile -> split_k -> swizzle -> even_k_fused_add -> tuned -> fused. Every
stage runs the same layer forward (:class:`~moelora_lib.kernels.stages.LayerRun`) with its own switches.
:data:`AUTO_STAGE` (name ``"auto"``, not in ``STAGES``) picks ``tuned`` or ``fused`` per call from the
config files (:mod:`.auto`).
"""

from . import auto, even_k_fused_add, fused, naive, no_recompile, split_k, swizzle, tuned
from .config import LayerConfig, OpConfig
from .launchers import fused_moe_gemm, gated_act, lora_expand, lora_shrink
from .stages import LAUNCH_OPS, Launch, LayerRun, Stage, default_config

STAGES: dict[str, Stage] = {
    m.STAGE.name: m.STAGE for m in (naive, no_recompile, split_k, swizzle, even_k_fused_add, tuned, fused)
}

#: stage ``auto``: per call, stage ``tuned`` or ``fused`` as the config files choose (:mod:`.auto`)
AUTO_STAGE = auto.STAGE


def stage_named(name: str, dims) -> Stage:
    """The concrete stage a call of ``dims`` (a :class:`~moelora_lib.shapes.Dims`) runs under stage
    ``name``: ``STAGES[name]``, or for ``"auto"`` the stage :meth:`AUTO_STAGE.pick
    <moelora_lib.kernels.auto.AutoStage.pick>` returns. KeyError for an unknown name."""
    return AUTO_STAGE.pick(dims) if name == AUTO_STAGE.name else STAGES[name]


__all__ = [
    "STAGES",
    "AUTO_STAGE",
    "stage_named",
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
