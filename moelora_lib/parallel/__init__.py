"""moelora_lib.parallel: the MoE+LoRA layer and the dense LoRA projections over several GPUs, on
``torch.distributed`` process groups (NCCL on GPUs, gloo on the CPU; no communication layer of our own).

* Expert parallelism (:mod:`.expert`): :class:`ExpertParallelMoELoRALayer` — each rank holds E/world
  experts and their adapter slots (:class:`moelora_lib.MoELoRALayer`'s ``expert_map``), the ranks' shares
  of the top-k sum added by an all-reduce (tokens replicated, as after a tensor-parallel attention) or an
  all-gather + reduce-scatter (tokens sharded); :func:`contiguous_expert_map`, :func:`shard_experts`.
* Tensor parallelism (:mod:`.tensor`): :class:`ColumnParallelLoRALinear` and
  :class:`RowParallelLoRALinear`, the column/row-parallel projections with the S-LoRA split of the LoRA
  factors (arXiv:2311.03285).
* :mod:`.comm`: the collectives they call (:func:`group_rank_world`, :func:`all_reduce`, ...).

:class:`moelora_lib.model.MultiLoRAModel` builds itself with them (``tp_group``, ``ep_group``), and
``python -m moelora_lib.parallel.run`` under ``torchrun`` generates with it (docs/parallel.md).

Importing this package builds no kernel (its names load on first use, as ``moelora_lib``'s do), so
``TRITON_INTERPRET=1`` can still be set afterwards on a CPU.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ExpertParallelMoELoRALayer": "expert",
    "contiguous_expert_map": "expert",
    "shard_experts": "expert",
    "TOKEN_LAYOUTS": "expert",
    "ColumnParallelLoRALinear": "tensor",
    "RowParallelLoRALinear": "tensor",
    "group_rank_world": "comm",
    "all_reduce": "comm",
    "all_gather": "comm",
    "reduce_scatter": "comm",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
