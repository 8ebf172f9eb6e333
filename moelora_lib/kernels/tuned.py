"""Stage ``tuned`` (notebook 07): the kernels of ``even_k_fused_add`` with tuned block configs.

Same switches as :mod:`.even_k_fused_add` (split-K, grouped order, EVEN_K, fused add, no length
specialization); what changes is where the launch configs come from when the caller passes none:
:func:`moelora_lib.configs.load_layer_config` (an explicit folder, else
``$MOELORA_TUNED_CONFIG_FOLDER``, else the configs shipped for this GPU, else the defaults), instead
of :func:`~.stages.default_config`. The configs are written by :mod:`moelora_lib.studies.tuning`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import Dims
from .config import LayerConfig
from .stages import Stage, as_dims


@dataclass(frozen=True)
class TunedStage(Stage):
    """A :class:`Stage` whose default configs come from the tuned-config loader."""

    def config_for(self, dims: Dims | int, *legacy: int, folder=None) -> LayerConfig:
        """:func:`moelora_lib.configs.load_layer_config` for a call of ``dims`` (the env var is read now).

        ``dims``: a :class:`~moelora_lib.shapes.Dims` (or the old ints T, H, I, E, K, R, L, S)."""
        from ..configs import load_layer_config  # lazy: configs imports kernels.config

        return load_layer_config(as_dims(dims, *legacy), folder=folder)


STAGE = TunedStage(
    name="tuned",
    title="+ tuned configs",
    specialize_lengths=False,
    split_k=True,
    swizzle=True,
    even_k=True,
    fused_add=True,
)
