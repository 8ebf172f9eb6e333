"""moelora_lib: Triton kernels for serving many LoRA adapters on one Mixture-of-Experts model.

Public entry points: :func:`fused_moe_lora` (the MoE + multi-LoRA layer, every input checked),
:class:`MoELoRALayer` (the same layer as an ``nn.Module`` with adapter slots and preallocated buffers,
for serving), :func:`route` (softmax top-k routing), and for dense projections (attention, dense MLPs)
:func:`lora_linear` / :class:`LoRALinear` (multi-LoRA linear with slices of different widths). Kernel
stages are listed in :data:`moelora_lib.kernels.STAGES`.

Importing the package runs no kernel, reads no environment variable and does not import the kernel
modules: the names below load on first use (PEP 562), so a notebook or script can set
``TRITON_INTERPRET=1`` (CPU) after ``import moelora_lib`` and before the first kernel is touched.

Layout: the product (shapes, workloads, reference, routing, configs, kernels, moe_lora, layer, ops,
linear, helion_linear, hardware, common, testing) never imports :mod:`moelora_lib.studies`
(benchmarks, tuners, compile-only checks, the notebook runner); :mod:`moelora_lib.configs` (config types,
defaults, file format, loader) imports no kernel module.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "fused_moe_lora",
    "route",
    "MoELoRALayer",
    "lora_linear",
    "LoRALinear",
    "STAGES",
    "LayerConfig",
    "OpConfig",
]

_LAZY = {
    "fused_moe_lora": ("moe_lora", "fused_moe_lora"),
    "route": ("routing", "route"),
    "MoELoRALayer": ("layer", "MoELoRALayer"),
    "lora_linear": ("linear", "lora_linear"),
    "LoRALinear": ("linear", "LoRALinear"),
    "STAGES": ("kernels", "STAGES"),
    "LayerConfig": ("kernels", "LayerConfig"),
    "OpConfig": ("kernels", "OpConfig"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
