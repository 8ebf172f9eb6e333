"""Stage ``tuned`` (notebook 07): the kernels of ``even_k_fused_add`` with tuned block configs.

Same switches as :mod:`.even_k_fused_add` (split-K, grouped order, EVEN_K, fused add, no length
specialization); what changes is where the launch configs come from when the caller passes none:
:func:`moelora_lib.configs.load_layer_config` (an explicit folder, else
``$MOELORA_TUNED_CONFIG_FOLDER``, else the configs shipped for this GPU, else the defaults), instead
of :func:`~.stages.default_config`. The configs are written by :mod:`moelora_lib.studies.tuning`.

On a GPU with no tuned configs (a name other than the shipped ones, e.g. "NVIDIA H200 NVL") the
defaults are used with one :class:`moelora_lib.configs.TunedConfigWarning`; to use another GPU's
configs there, say so explicitly: ``moelora_lib.configs.map_gpu_name("NVIDIA H200 NVL",
"NVIDIA_H200")`` (process-wide) or ``STAGES["tuned"].config_for(dims, gpu_name="NVIDIA_H200")``
(one config, pass it as ``config=``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import Dims
from .config import LayerConfig
from .stages import Stage


@dataclass(frozen=True)
class TunedStage(Stage):
    """A :class:`Stage` whose default configs come from the tuned-config loader."""

    def config_for(self, dims: Dims, folder=None, gpu_name: str | None = None) -> LayerConfig:
        """:func:`moelora_lib.configs.load_layer_config` for a call of ``dims`` (the env var is read now).

        ``dims``: a :class:`~moelora_lib.shapes.Dims`.
        ``folder``: a config folder (else ``$MOELORA_TUNED_CONFIG_FOLDER``, else the shipped one).
        ``gpu_name``: whose configs to use (e.g. ``"NVIDIA_H200"`` on an H200 NVL, explicitly);
        None = the :func:`moelora_lib.configs.map_gpu_name` mapping of this GPU, else its own name."""
        from ..configs import load_layer_config  # lazy: loaded on the first config lookup

        return load_layer_config(dims, folder=folder, gpu_name=gpu_name)


STAGE = TunedStage(
    name="tuned",
    title="+ tuned configs",
    specialize_lengths=False,
    split_k=True,
    swizzle=True,
    even_k=True,
    fused_add=True,
)
