"""Min and max of the routing ids in one launch: the device half of the public call's value check.

:func:`moelora_lib.fused_moe_lora` checks topk_ids ∈ [0, E) and lora_ids ∈ [-1, L) (its contract). On a
GPU it launches :func:`id_bounds_triton` first, copies the four values to pinned host memory without
waiting, launches the layer, and reads them only afterwards (so the host never waits for the layer's
kernels). The torch equivalent (:func:`moelora_lib.routing.id_value_bounds`, two ``aminmax`` and
~6 more small ops) costs ~8 launches of host time; this is one.

One program walks both tensors in chunks of BLOCK elements (T·K ≤ a few 10⁵ at most: a few µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import aligned16

__all__ = ["id_bounds_triton"]

_BLOCK = 1024
_BIG = 2**62


@triton.jit
def _minmax(ptr, n, BLOCK: tl.constexpr, BIG: tl.constexpr):
    lo = tl.full((BLOCK,), BIG, tl.int64)
    hi = tl.full((BLOCK,), -BIG, tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        v = tl.load(ptr + offs, mask=m, other=0).to(tl.int64)
        lo = tl.minimum(lo, tl.where(m, v, BIG))
        hi = tl.maximum(hi, tl.where(m, v, -BIG))
    return tl.min(lo, axis=0), tl.max(hi, axis=0)


def _id_bounds_kernel(topk_ptr, n_topk, lora_ptr, n_lora, out_ptr, BLOCK: tl.constexpr, BIG: tl.constexpr):
    t_lo, t_hi = _minmax(topk_ptr, n_topk, BLOCK, BIG)
    t_lo = tl.where(n_topk > 0, t_lo, 0)
    t_hi = tl.where(n_topk > 0, t_hi, 0)
    l_lo, l_hi = _minmax(lora_ptr, n_lora, BLOCK, BIG)
    l_lo = tl.where(n_lora > 0, l_lo, -1)
    l_hi = tl.where(n_lora > 0, l_hi, -1)
    tl.store(out_ptr + 0, t_lo)
    tl.store(out_ptr + 1, t_hi)
    tl.store(out_ptr + 2, l_lo)
    tl.store(out_ptr + 3, l_hi)


# n_topk / n_lora follow T: not specialized (one binary for every length, as the layer's kernels)
_id_bounds = triton.jit(_id_bounds_kernel, do_not_specialize=["n_topk", "n_lora"])


def id_bounds_triton(topk_ids: torch.Tensor, lora_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[4] int64 on the ids' device: min and max of topk_ids, then of lora_ids — one launch, no sync.

    Same values as :func:`moelora_lib.routing.id_value_bounds` (empty tensors or lora_ids None give
    (0, 0) and (-1, -1)). Args: topk_ids [T, K] and lora_ids [T], int32 or int64, on one device; any
    layout (a non-contiguous or misaligned input is copied first). Raises ValueError for other dtypes.
    """
    for name, t in (("topk_ids", topk_ids), ("lora_ids", lora_ids)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(
                f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
    # contiguous and 16-byte aligned (an offset view would otherwise compile a second binary)
    t = aligned16(topk_ids.reshape(-1).contiguous())
    lo = t if lora_ids is None else aligned16(lora_ids.reshape(-1).contiguous())
    out = torch.empty(4, dtype=torch.int64, device=t.device)
    _id_bounds[(1,)](t, t.numel(), lo, 0 if lora_ids is None else lo.numel(), out, BLOCK=_BLOCK, BIG=_BIG)
    return out
