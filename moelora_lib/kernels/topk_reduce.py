"""The layer's last step, Σ_k over the top-k pair rows (optionally NaN rows for out-of-range ids).

Every :class:`~moelora_lib.kernels.LayerRun` reduces with it (so the module and the public call sum in
the same order, bit for bit); the serving layer asks for the id check.

``out[t] = Σ_k y[t·K + k]`` (fp32 accumulation, k ascending, one rounding to out's dtype, by default
y's) — what ``y.view(T, K, H).sum(dim=1)`` computes — in one launch, with one difference: a token
whose top-k ids leave [0, E) or whose adapter id leaves [-1, L) gets a NaN row. Such pairs are dropped by the
alignment (never read or written out of bounds), so their ``y`` rows hold whatever an earlier call left in the
scratch; summing them would hand one request another request's activations. The serving layer
(:class:`moelora_lib.MoELoRALayer`) checks no id values (that would need a host sync), so it uses this
reduction: bad ids show up as NaN rows instead of silently wrong or leaked values. NaN router logits
give out-of-range ids too (:func:`moelora_lib.kernels.route.route_triton`), hence NaN rows, as in the
fp32 reference.

Expert parallelism (:class:`moelora_lib.MoELoRALayer`'s ``expert_map``) adds one id value with a meaning of
its own: with ``skip_remote``, a top-k id of exactly -1 marks a pair whose expert lives on another rank. The
alignment drops it like any out-of-range id (no GEMM work), and this sum leaves its row out (the pair adds
zero here; the rank that holds the expert adds its part), so it is never read; every other id outside
[0, E) still gives a NaN row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["topk_reduce"]


def _topk_reduce_kernel(
    y_ptr,
    ids_ptr,
    lora_ptr,
    out_ptr,
    H,
    E,
    L,
    stride_ym,
    stride_it,
    stride_ik,
    stride_lt,
    stride_ot,
    K: tl.constexpr,
    K_P: tl.constexpr,
    CHECK_IDS: tl.constexpr,
    SKIP_REMOTE: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in tl.static_range(K):
        if SKIP_REMOTE:  # id -1: the expert is on another rank; its row is neither read nor added
            here = tl.load(ids_ptr + t * stride_it + k * stride_ik) != -1
            v = tl.load(y_ptr + (t * K + k) * stride_ym + offs, mask=hmask & here, other=0.0)
            acc = tl.where(here, acc + v.to(tl.float32), acc)
        else:
            acc += tl.load(y_ptr + (t * K + k) * stride_ym + offs, mask=hmask, other=0.0).to(tl.float32)
    if CHECK_IDS:
        ks = tl.arange(0, K_P)
        e = tl.load(ids_ptr + t * stride_it + ks * stride_ik, mask=ks < K, other=0)
        if SKIP_REMOTE:  # -1 is "on another rank", not a bad id
            bad = tl.sum(((ks < K) & ((e < -1) | (e >= E))).to(tl.int32), axis=0)
        else:
            bad = tl.sum(((ks < K) & ((e < 0) | (e >= E))).to(tl.int32), axis=0)
        if HAS_LORA:
            lo = tl.load(lora_ptr + t * stride_lt)
            bad += ((lo < -1) | (lo >= L)).to(tl.int32)
        acc = tl.where(bad > 0, float("nan"), acc)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


# H and y's/out's strides are fixed per layer; T only sets the grid. The caller's id tensors (topk_ids,
# lora_ids) may be offset views or any strides: their pointers and strides are do_not_specialize (one
# id load per row, the 16-byte alignment hint buys nothing) so an offset view keeps the binary.
_topk_reduce = triton.jit(
    _topk_reduce_kernel, do_not_specialize=["ids_ptr", "lora_ptr", "stride_it", "stride_ik", "stride_lt"]
)


def topk_reduce(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    lora_ids: torch.Tensor | None = None,
    num_adapters: int = 0,
    *,
    check_ids: bool = True,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    skip_remote: bool = False,
) -> torch.Tensor:
    """``y.view(T, K, H).sum(dim=1)`` with NaN rows for tokens with out-of-range ids (module docstring).

    Args:
        y: [T·K, H] float16/bfloat16/float32, rows contiguous (stride(1) == 1).
        topk_ids: [T, K] int32/int64 (any strides). num_experts: E.
        lora_ids: [T] int32/int64 or None (then adapter ids are not checked); num_adapters: L.
        check_ids: False = the plain sum (ids already checked by the caller; no id loads).
        out: optional [T, H] of ``out_dtype`` (rows contiguous); None allocates.
        out_dtype: the output's dtype (float16/bfloat16/float32; default: out's, else y's): stage
            ``fused``'s split-K down GEMM leaves an fp32 y that is rounded here once.
        skip_remote: pairs whose top-k id is exactly -1 (an expert on another rank, expert parallelism)
            are left out of the sum (their y rows are not read) and do not make the row NaN; a token whose
            every pair is remote gets a zero row. Default False (-1 is an out-of-range id like any other).
    Returns:
        [T, H] of ``out_dtype``.
    Raises:
        ValueError naming the argument for shapes/dtypes that do not fit.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be an int32/int64 tensor [T, K], got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    T, K = topk_ids.shape
    if y.dim() != 2 or y.shape[0] != T * K or y.stride(1) != 1:
        raise ValueError(f"y must be [T·K = {T * K}, H] with contiguous rows, got {tuple(y.shape)}")
    H = y.shape[1]
    if lora_ids is not None and (lora_ids.shape != (T,) or lora_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"lora_ids must be an int32/int64 tensor [T={T}], got {tuple(lora_ids.shape)}")
    if out_dtype is None:
        out_dtype = y.dtype if out is None else out.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            "out_dtype (default: out's dtype, else y's) must be torch.float16, torch.bfloat16 or "
            f"torch.float32, got {out_dtype!r}"
        )
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    elif out.shape != (T, H) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a {out_dtype} tensor [T={T}, H={H}] with contiguous rows")
    if T == 0:
        return out
    if not isinstance(skip_remote, bool):
        raise ValueError(f"skip_remote must be a bool, got {skip_remote!r}")
    grid, args, constexprs = reduce_launch_args(
        y, topk_ids, num_experts, lora_ids, num_adapters, check_ids, out, skip_remote=skip_remote
    )
    _topk_reduce[grid](*args, **constexprs)
    return out


def reduce_launch_args(
    y, topk_ids, num_experts, lora_ids, num_adapters, check_ids, out, *, skip_remote=False
):
    """(grid, positional args, constexprs) of the one launch :func:`topk_reduce` makes for checked
    arguments (also used by :mod:`moelora_lib.studies.compile_check` to compute specialization keys
    without launching)."""
    T, K = topk_ids.shape
    H = y.shape[1]
    block_h = min(1024, triton.next_power_of_2(H))
    lo = lora_ids if lora_ids is not None else topk_ids
    args = (
        y, topk_ids, lo, out, H, int(num_experts), int(num_adapters),
        y.stride(0), topk_ids.stride(0), topk_ids.stride(1),
        lora_ids.stride(0) if lora_ids is not None else 0, out.stride(0),
    )  # fmt: skip
    constexprs = dict(
        K=K, K_P=triton.next_power_of_2(K), CHECK_IDS=bool(check_ids), SKIP_REMOTE=bool(skip_remote)
    )
    constexprs.update(HAS_LORA=lora_ids is not None, BLOCK_H=block_h)
    return (T, triton.cdiv(H, block_h)), args, constexprs
