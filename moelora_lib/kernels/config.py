"""The config types the kernels launch with, re-exported from :mod:`moelora_lib.configs.schema`
(``from moelora_lib.kernels.config import OpConfig`` and ``from moelora_lib.configs import OpConfig``
name the same class)."""

from ..configs.schema import BASE_OPS, LORA_OPS, DenseLoRAConfig, LayerConfig, OpConfig, next_pow2

__all__ = ["OpConfig", "LayerConfig", "DenseLoRAConfig", "LORA_OPS", "BASE_OPS", "next_pow2"]
