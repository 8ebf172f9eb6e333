"""Kernel configs: the config types, the built-in defaults, the tuned-file format and its loader.

Modules (none imports :mod:`moelora_lib.kernels`; the kernels import these):

* :mod:`~moelora_lib.configs.schema` — :class:`OpConfig` (one launch), :class:`LayerConfig` (the six
  launches of a MoE layer), :class:`DenseLoRAConfig` (the two launches of a dense projection).
* :mod:`~moelora_lib.configs.defaults` — the built-in defaults (:func:`default_config`,
  :func:`fused_default_config`, :func:`default_dense_config`): hand-picked starting points, no tuning.
* :mod:`~moelora_lib.configs.files` — the JSON file format (vLLM's names and nesting): file names,
  lookup keys, validation, lookup, atomic writes.
* :mod:`~moelora_lib.configs.loader` — which config a call gets: the ``folder`` argument, else
  ``$MOELORA_TUNED_CONFIG_FOLDER``, else the files shipped under ``moelora_lib/configs/<gpu>/``, else
  the defaults; GPU name mapping (:func:`map_gpu_name`); :class:`TunedConfigWarning` on fallbacks.

Shapes travel as one :class:`~moelora_lib.shapes.Dims`. The shipped files and the differences from
vLLM's: ``moelora_lib/configs/README.md``.
"""

from __future__ import annotations

from ..common import gpu_name
from .defaults import (
    default_config,
    default_dense_config,
    dense_block_sizes_m,
    fused_default_config,
    fused_gemm_configs,
)
from .files import (
    BASE_FILE_OP,
    DENSE_FILE_OPS,
    FUSED_FILE_KEYS,
    FUSED_FILE_OP,
    GEMV_KEY,
    GEMV_LEAF_KEYS,
    LORA_FILE_OPS,
    STAGE_CHOICES,
    STAGE_KEY,
    base_keys,
    config_file_name,
    dense_config_file_name,
    dense_keys,
    dense_leaf,
    load_config_file,
    lookup,
    lora_keys,
    save_config_file,
    set_entry,
)
from .loader import (
    ENV_VAR,
    SHIPPED_DIR,
    TunedConfigWarning,
    clear_cache,
    gpu_name_map,
    load_dense_config,
    load_fused_config,
    load_gemv_config,
    load_layer_config,
    load_stage_choice,
    map_gpu_name,
    shipped_folder,
    shipped_gpus,
    tuned_dense_block_sizes_m,
)
from .schema import BASE_OPS, LORA_OPS, DenseLoRAConfig, LayerConfig, OpConfig, next_pow2

__all__ = [
    # types
    "OpConfig",
    "LayerConfig",
    "DenseLoRAConfig",
    "LORA_OPS",
    "BASE_OPS",
    "next_pow2",
    # defaults
    "default_config",
    "fused_gemm_configs",
    "fused_default_config",
    "default_dense_config",
    "dense_block_sizes_m",
    # file format
    "LORA_FILE_OPS",
    "BASE_FILE_OP",
    "FUSED_FILE_OP",
    "FUSED_FILE_KEYS",
    "STAGE_KEY",
    "GEMV_KEY",
    "GEMV_LEAF_KEYS",
    "STAGE_CHOICES",
    "DENSE_FILE_OPS",
    "config_file_name",
    "lora_keys",
    "base_keys",
    "load_config_file",
    "lookup",
    "save_config_file",
    "set_entry",
    "dense_config_file_name",
    "dense_keys",
    "dense_leaf",
    # loader
    "ENV_VAR",
    "SHIPPED_DIR",
    "TunedConfigWarning",
    "map_gpu_name",
    "gpu_name_map",
    "shipped_gpus",
    "shipped_folder",
    "gpu_name",
    "load_layer_config",
    "load_fused_config",
    "load_gemv_config",
    "load_stage_choice",
    "load_dense_config",
    "tuned_dense_block_sizes_m",
    "clear_cache",
]
