"""Kernel stages of moelora_lib: ``STAGES[name]`` -> :class:`~moelora_lib.kernels.stages.Stage`.

Stages in order: naive -> no_recompile -> split_k -> swizzle -> even_k_fused_add -> tuned -> fused. Every
stage runs the same layer forward (:class:`~moelora_lib.kernels.stages.LayerRun`) with its own switches.
:data:`GEMV_STAGE` (name ``"gemv"``, not in ``STAGES``: its own launches) runs decode-sized calls as
split-K GEMVs (:mod:`.gemv`). :data:`AUTO_STAGE` (name ``"auto"``, not in ``STAGES``) picks ``tuned``,
``fused`` or ``gemv`` per call from the config files (:mod:`.auto`).
"""

from . import auto, even_k_fused_add, fused, gemv, naive, no_recompile, split_k, swizzle, tuned
from .config import LayerConfig, OpConfig
from .launchers import fused_moe_gemm, gated_act, lora_expand, lora_shrink
from .stages import LAUNCH_OPS, Launch, LayerRun, Stage, default_config

STAGES: dict[str, Stage] = {
    m.STAGE.name: m.STAGE for m in (naive, no_recompile, split_k, swizzle, even_k_fused_add, tuned, fused)
}

#: stage ``auto``: per call, stage ``tuned`` or ``fused`` as the config files choose (:mod:`.auto`)
AUTO_STAGE = auto.STAGE


#: stage ``gemv``: the layer at decode as split-K GEMVs (:mod:`.gemv`; not a LayerRun stage)
GEMV_STAGE = gemv.STAGE

#: the stage names the MoE path accepts: every LayerRun stage, ``"gemv"``, then ``"auto"``
MOE_STAGE_NAMES: tuple[str, ...] = (*STAGES, GEMV_STAGE.name, AUTO_STAGE.name)


def check_stage_name(value, arg: str = "stage", *, auto: bool = True) -> str:
    """``value`` if it is a stage name: a key of :data:`STAGES`, or ``"auto"`` when ``auto`` (the MoE
    path: :data:`MOE_STAGE_NAMES`). Raises ValueError naming ``arg`` and the allowed names otherwise
    (any non-str included)."""
    allowed = list(MOE_STAGE_NAMES) if auto else list(STAGES)  # the dense path: LayerRun stages only
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{arg} must be one of {allowed}, got {value!r}")
    return value


def stage_named(name: str, dims) -> Stage:
    """The concrete stage a call of ``dims`` (a :class:`~moelora_lib.shapes.Dims`) runs under stage
    ``name``: ``STAGES[name]``, or for ``"auto"`` the stage :meth:`AUTO_STAGE.pick
    <moelora_lib.kernels.auto.AutoStage.pick>` returns (host-side, from the config files; ``tuned``
    where they record no choice). ValueError naming ``stage`` and the allowed names for any other
    value."""
    check_stage_name(name)
    if name == AUTO_STAGE.name:
        return AUTO_STAGE.pick(dims)
    return GEMV_STAGE if name == GEMV_STAGE.name else STAGES[name]


__all__ = [
    "STAGES",
    "AUTO_STAGE",
    "GEMV_STAGE",
    "MOE_STAGE_NAMES",
    "check_stage_name",
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
