"""Softmax top-k routing in one Triton launch (the serving layer's routing step).

:func:`moelora_lib.routing.route` (the reference, torch) costs five kernels — softmax, topk, sum,
divide, cast — which at decode is more launch latency than arithmetic. :func:`route_triton` computes
the same in one launch: each program takes BLOCK_T tokens, loads their E logits as one row each,
computes the softmax in fp32, then picks the K largest probabilities by K rounds of (max, first
index of the max, mask it out) — exact for K ≤ 8 and E ≤ a few hundred, which covers every preset —
and optionally renormalizes them.

Equality with the reference: the expert ids are the same whenever the probabilities have no ties
(ties resolve to the lower expert id here; torch.topk does not promise an order); the weights agree to
fp32 rounding (the exponential is Triton's, not torch's), tested to 1e-6 relative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import aligned16, is_int

__all__ = ["route_triton"]


def _route_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    stride_lt,
    stride_le,
    K: tl.constexpr,
    K_P: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_P)
    rmask = rows < T
    cmask = cols < E
    m = rmask[:, None] & cmask[None, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :] * stride_le
    x = tl.load(ptrs, mask=m, other=-float("inf")).to(tl.float32)
    x_max = tl.max(x, axis=1)
    x_max = tl.where(rmask, x_max, 0.0)
    p = tl.exp(x - x_max[:, None])
    p = tl.where(m, p, 0.0)
    prob = p / tl.where(rmask, tl.sum(p, axis=1), 1.0)[:, None]  # rows past T: no 0/0
    prob = tl.where(m, prob, -1.0)  # padding columns never win
    kcols = tl.arange(0, K_P)
    w_tile = tl.zeros((BLOCK_T, K_P), tl.float32)
    i_tile = tl.zeros((BLOCK_T, K_P), tl.int32)
    for k in tl.static_range(K):
        best = tl.max(prob, axis=1)
        # first column holding the max (the lowest expert id on ties)
        idx = tl.min(tl.where(prob == best[:, None], cols[None, :], E_P), axis=1)
        w_tile = tl.where(kcols[None, :] == k, best[:, None], w_tile)
        i_tile = tl.where(kcols[None, :] == k, idx[:, None], i_tile)
        prob = tl.where(cols[None, :] == idx[:, None], -1.0, prob)
    if RENORMALIZE:
        w_tile = w_tile / tl.where(rmask, tl.sum(w_tile, axis=1), 1.0)[:, None]
    o = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    om = rmask[:, None] & (kcols[None, :] < K)
    tl.store(w_ptr + o, w_tile, mask=om)
    tl.store(ids_ptr + o, i_tile, mask=om)


# T follows the batch: not specialized (one binary for every length)
_route = triton.jit(_route_kernel, do_not_specialize=["T"])


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in one launch; same arguments and results as
    :func:`moelora_lib.routing.route` (to fp32 rounding; see the module docstring).

    Args:
        router_logits: [T, E] float16/bfloat16/float32 (any strides), E ≤ 1024.
        top_k: K, 1 ≤ K ≤ min(E, 16).
        renormalize: divide the K kept probabilities by their sum.
        out: optional preallocated (topk_weights [≥T·K] float32, topk_ids [≥T·K] int32), contiguous;
            the results are views of their first T·K entries (no allocation, for CUDA graphs).
    Returns:
        (topk_weights [T, K] float32, topk_ids [T, K] int32), probabilities in descending order.
    Raises:
        ValueError naming the argument: not a 2-D float tensor, E > 1024, top_k out of range, an
        ``out`` pair of the wrong dtype, size or device.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(f"router_logits must be a 2-D tensor [T, E], got {type(router_logits).__name__}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a float tensor, got dtype {router_logits.dtype}")
    T, E = router_logits.shape
    if E > 1024:
        raise ValueError(f"router_logits: E = {E} experts; route_triton supports E ≤ 1024")
    if not is_int(top_k) or not 1 <= top_k <= min(E, 16):
        raise ValueError(f"top_k must be an int in [1, min(E={E}, 16)], got {top_k!r}")
    K, dev = int(top_k), router_logits.device
    if out is None:
        w = torch.empty(T * K, dtype=torch.float32, device=dev)
        ids = torch.empty(T * K, dtype=torch.int32, device=dev)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                "out must be a pair (topk_weights float32, topk_ids int32) of tensors, "
                f"got {type(out).__name__}"
            )
        w, ids = out
        for name, t, dt in (("out[0]", w, torch.float32), ("out[1]", ids, torch.int32)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dt
                or t.device != dev
                or not t.is_contiguous()
                or t.numel() < T * K
            ):
                raise ValueError(
                    f"{name} must be a contiguous {dt} tensor of ≥ T·K = {T * K} entries on {dev}, "
                    f"got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
        w, ids = w.reshape(-1)[: T * K], ids.reshape(-1)[: T * K]
    if T:
        x = aligned16(router_logits)
        e_p = triton.next_power_of_2(E)
        block_t = max(1, min(16, 4096 // e_p))
        _route[(triton.cdiv(T, block_t),)](
            x, w, ids, T, E, x.stride(0), x.stride(1),
            K=K, K_P=triton.next_power_of_2(K), E_P=e_p, BLOCK_T=block_t, RENORMALIZE=bool(renormalize),
        )  # fmt: skip
    return w.view(T, K), ids.view(T, K)
