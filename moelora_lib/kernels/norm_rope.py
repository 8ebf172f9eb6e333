"""Two small serving kernels of the model runner (moelora_lib.model): RMSNorm with the residual add fused,
and q/k-norm + rotary embedding + KV-cache write of one attention layer in one launch.

Why: at decode these are many tiny launches: each torch RMSNorm is ~6 element-wise launches (cast,
square, mean, add eps, rsqrt, scale, weight, cast) plus one for the residual add, and rope + two
index-put cache writes another ~10, per layer. Each moves a few KB, so they cost their launch and ramp
(~2–3 µs each in a CUDA graph), not bytes. These kernels make that one launch per norm
(residual add included) and one per attention layer for q/k-norm, rope and both cache writes.

Numerics: the same operations in the same dtype steps as the torch modules they replace, so results are
bit-identical to them except for the fp32 summation order of the mean of squares (compiled with
``enable_fp_fusion=False``: a fused multiply-add would round x1·cos - x2·sin once where torch rounds each
product, a 1-ulp difference on the H200):

* :func:`rms_norm` — transformers' ``GptOssRMSNorm`` / ``Qwen3RMSNorm`` (moelora_lib.model.modeling.
  RMSNorm): s = x + residual rounded to x's dtype (torch's add), x̂ = s·rsqrt(mean(s²) + eps) in fp32, then
  (w·x̂).to(dtype) for fp32 weights (GPT-OSS) or w·x̂.to(dtype) rounded (Qwen3).
* :func:`qk_norm_rope_cache` — per head: optional RMSNorm over D (Qwen3's q_norm/k_norm), then
  ``rotate_half`` rope as torch computes it in the model dtype (x1·cos and x2·sin rounded, then their
  difference rounded; likewise the second half), q written out head-major [B, NH, S, D] (the layout the
  attention reads without a copy), k (roped) and v written into the cache at (cache row, position).

Method: the fused add + RMSNorm follows the common practice of inference engines (e.g. vLLM's
``fused_add_rms_norm`` CUDA op, whose interface — residual updated in place, normed output — this
mirrors); the rope formula is transformers' ``apply_rotary_pos_emb`` / ``rotate_half``. Own code.

Effect on GPT-OSS-20B decode at batch 1 (24 layers): 49 norms and 24 adds, ~340 launches, become 49;
rope + cache writes, ~240 launches, become 24 (step breakdown: notebook 11).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_cpu_backend, describe

__all__ = ["rms_norm", "qk_norm_rope_cache"]


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    N,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RES: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's add in the model dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    xh = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if WEIGHT_FP32:
        out = w.to(tl.float32) * xh
    else:
        out = xh.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm = triton.jit(_rms_norm_kernel)


def _check_rows(name: str, t, n: int, dtype: torch.dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {dtype} tensor [T, {n}], got {describe(t)}")
    if t.dim() != 2 or t.shape[1] != n or t.stride(1) != 1 or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor [T, {n}] with contiguous rows on {device}, "
            f"got {tuple(t.shape)} {t.dtype} on {t.device}"
        )


def _check_backend(name: str, t: torch.Tensor) -> None:
    """The devices and dtypes the kernels run: CUDA, or the CPU through the Triton interpreter (fp16/fp32:
    its bf16 arithmetic is wrong)."""
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on a CUDA device or the CPU, got {t.device}")
    if t.device.type == "cpu":
        check_cpu_backend(_rms_norm, t.dtype, name)


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or eps != eps:
        raise ValueError(f"eps must be a number > 0, got {eps!r}")
    return float(eps)


def _check_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    weight_fp32: bool,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
):
    """RMSNorm over the last dim, optionally after a residual add, in one launch (module docstring).

    Args:
        x: [T, N] float16/bfloat16/float32, rows contiguous (any row stride).
        weight: [N]; float32 when ``weight_fp32`` (GPT-OSS: out = (w·x̂).to(dtype)), else x's dtype
            (Qwen3: out = w·x̂.to(dtype)).
        eps: the norm's epsilon (> 0).
        residual: optional [T, N] of x's dtype: s = x + residual is normalized and returned too.
        out / residual_out: optional [T, N] outputs of x's dtype (rows contiguous); ``residual_out`` may be
            ``x`` or ``residual`` itself (in place: each row is read whole before it is written).
    Returns:
        out [T, N] (x's dtype); with ``residual``: (out, s).
    Raises:
        ValueError naming the argument for shapes, dtypes or devices that do not fit, eps not > 0, and
        bfloat16 on the CPU (the interpreter's bf16 is wrong).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"x must be a tensor [T, N >= 1] with contiguous rows, got {describe(x)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    _check_backend("x", x)
    T, N = x.shape
    wdt = torch.float32 if weight_fp32 else x.dtype
    if (
        not isinstance(weight, torch.Tensor)
        or weight.shape != (N,)
        or weight.dtype != wdt
        or weight.device != x.device
        or weight.stride(0) != 1
    ):
        raise ValueError(
            f"weight must be a contiguous {wdt} tensor [{N}] on {x.device}, got {describe(weight)}"
        )
    eps = _check_eps(eps)
    if residual is not None:
        _check_rows("residual", residual, N, x.dtype, x.device)
        if residual.shape[0] != T:
            raise ValueError(f"residual must have T = {T} rows like x, got {residual.shape[0]}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _check_rows("out", out, N, x.dtype, x.device)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty_like(out)
        _check_rows("residual_out", residual_out, N, x.dtype, x.device)
    if out.shape[0] != T or (residual_out is not None and residual_out.shape[0] != T):
        raise ValueError(f"out and residual_out must have T = {T} rows")
    if T:
        r = residual if residual is not None else x
        ro = residual_out if residual_out is not None else out
        _rms_norm[(T,)](
            x, r, weight, out, ro, N, float(eps),
            x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
            HAS_RES=residual is not None, WEIGHT_FP32=bool(weight_fp32),
            BLOCK_N=triton.next_power_of_2(N), num_warps=4 if N <= 4096 else 8, enable_fp_fusion=False,
        )  # fmt: skip
    return out if residual is None else (out, residual_out)


def _qk_norm_rope_cache_kernel(
    qkv_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    S,
    eps,
    stride_qkv,
    stride_cos,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_vb,
    stride_vh,
    stride_vp,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    HALF_P: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF_P)
    m = offs < HALF
    row = tl.load(rows_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    src = qkv_ptr + t * stride_qkv
    if h < NH + NKV:  # q head h, or k head h - NH: norm (optional) + rope
        base = src + h * D
        x1 = tl.load(base + offs, mask=m, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=m, other=0.0)
        dt = x1.dtype
        if QK_NORM:  # Qwen3RMSNorm over the head dim: w · (x·rsqrt(mean(x²) + eps)).to(dtype)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            var = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D
            rinv = 1.0 / tl.sqrt(var + eps)
            if h < NH:
                w1 = tl.load(qw_ptr + offs, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(qw_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + offs, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(kw_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
            x1 = ((f1 * rinv).to(dt).to(tl.float32) * w1).to(dt)
            x2 = ((f2 * rinv).to(dt).to(tl.float32) * w2).to(dt)
        c = tl.load(cos_ptr + pos * stride_cos + offs, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + offs, mask=m, other=0.0).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # torch in the model dtype: each product rounded, then the sum rounded
        o1 = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
        if h < NH:
            b = t // S
            sq = t - b * S
            dst = q_out_ptr + ((b * NH + h) * S + sq) * D
        else:
            dst = k_cache_ptr + row * stride_cb + (h - NH) * stride_ch + pos * stride_cp
        tl.store(dst + offs, o1, mask=m)
        tl.store(dst + HALF + offs, o2, mask=m)
    else:  # v head h - NH - NKV: copied into the cache as it is
        j = h - NH - NKV
        base = src + (NH + NKV + j) * D
        dst = v_cache_ptr + row * stride_vb + j * stride_vh + pos * stride_vp
        tl.store(dst + offs, tl.load(base + offs, mask=m), mask=m)
        tl.store(dst + HALF + offs, tl.load(base + HALF + offs, mask=m), mask=m)


# S and the position-table stride vary with the call and the model; rows/pos are index tensors whose
# pointers may be offset views.
_qk_norm_rope_cache = triton.jit(
    _qk_norm_rope_cache_kernel, do_not_specialize=["S", "rows_ptr", "pos_ptr", "stride_qkv", "stride_cos"]
)


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """q/k-norm (optional), rope, and the KV-cache write of one attention layer, in one launch.

    Args:
        qkv: [T = B·S, (NH + 2·NKV)·D] the fused q/k/v projection output (rows contiguous), token-major
            (row b·S + s is request b's s-th new token).
        num_heads / num_kv_heads / head_dim: NH, NKV, D (D even). batch: B (T must be a multiple of it).
        cos / sin: [max_seq, D/2] the rope tables (qkv's dtype), indexed by position.
        positions: [T] int64/int32 cache position of each token; cache_rows: [T] int64/int32 cache row (any
            stride; pass contiguous ones to save a copy).
        k_cache / v_cache: [max_batch, NKV, max_seq, D] of qkv's dtype (last dim contiguous); written at
            [cache_rows[t], :, positions[t]] (k roped, v as it is).
        q_norm_weight / k_norm_weight: [D] of qkv's dtype, both or neither (Qwen3's per-head RMSNorm, eps).
        q_out: optional [B, NH, S, D] contiguous output (None allocates).
        check_values: on the CPU, check the index values (the model runner passes False: it checks its
            host-side indices once per forward, and its traced steps must read no tensor value).
    Returns:
        q [B, NH, S, D] of qkv's dtype (roped; head-major, so the g = NH/NKV heads of one KV head are
        consecutive rows of [B, NKV, g·S, D]).
    Raises:
        ValueError naming the argument for sizes that are not positive ints, NH not a multiple of NKV, an
        odd D, eps not > 0, shapes/dtypes/devices that do not fit, bfloat16 on the CPU; on the CPU also
        positions or cache rows out of range. On a GPU index values are not checked (no host sync):
        out-of-range rows/positions are undefined behaviour, as in the model.
    """
    NH, NKV = _check_int("num_heads", num_heads), _check_int("num_kv_heads", num_kv_heads)
    D, batch = _check_int("head_dim", head_dim, 2), _check_int("batch", batch)
    if NH % NKV:
        raise ValueError(f"num_heads ({NH}) must be a multiple of num_kv_heads ({NKV})")
    if D % 2:
        raise ValueError(f"head_dim must be even (rope rotates halves), got {D}")
    eps = _check_eps(eps)
    W = (NH + 2 * NKV) * D
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != W or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be a tensor [T, (NH + 2·NKV)·D = {W}] with contiguous rows, got {describe(qkv)}"
        )
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qkv must be float16/bfloat16/float32, got {qkv.dtype}")
    _check_backend("qkv", qkv)
    dt, dev = qkv.dtype, qkv.device
    T = qkv.shape[0]
    if T % batch:
        raise ValueError(f"batch must divide T = {T}, got {batch}")
    S = T // batch
    for name, tab in (("cos", cos), ("sin", sin)):
        ok = isinstance(tab, torch.Tensor) and tab.dim() == 2 and tab.shape[1] == D // 2
        if not ok or tab.stride(1) != 1 or tab.dtype != dt or tab.device != dev:
            raise ValueError(
                f"{name} must be a {dt} tensor [max_seq, D/2 = {D // 2}] on {dev}, got {describe(tab)}"
            )
    if sin.shape != cos.shape or sin.stride(0) != cos.stride(0):
        raise ValueError(
            f"cos and sin must have the same shape and row stride, got {describe(cos)}, {describe(sin)}"
        )
    for name, ix in (("positions", positions), ("cache_rows", cache_rows)):
        ok = isinstance(ix, torch.Tensor) and ix.shape == (T,)
        if not ok or ix.dtype not in (torch.int32, torch.int64) or ix.device != dev:
            raise ValueError(f"{name} must be an int32/int64 tensor [T = {T}] on {dev}, got {describe(ix)}")
    # the kernel reads index t at ptr + t (an expanded view, stride 0, is copied: one small launch)
    positions, cache_rows = positions.contiguous(), cache_rows.contiguous()
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        ok = isinstance(c, torch.Tensor) and c.dim() == 4 and c.shape[1] == NKV and c.shape[3] == D
        if not ok or c.dtype != dt or c.stride(3) != 1 or c.device != dev:
            raise ValueError(
                f"{name} must be a {dt} tensor [max_batch, NKV = {NKV}, max_seq, D = {D}] on {dev}, "
                f"got {describe(c)}"
            )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if check_values and dev.type == "cpu" and T:  # index values: free on the host (GPU: undefined behaviour)
        max_batch, max_seq = k_cache.shape[0], k_cache.shape[2]
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= min(max_seq, cos.shape[0]):
            raise ValueError(
                f"positions must be in [0, min(max_seq = {max_seq}, rope table rows = {cos.shape[0]})), "
                f"got [{lo}, {hi}]"
            )
        lo, hi = int(cache_rows.min()), int(cache_rows.max())
        if lo < 0 or hi >= max_batch:
            raise ValueError(f"cache_rows must be in [0, max_batch = {max_batch}), got [{lo}, {hi}]")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight: pass both or neither")
    qk_norm = q_norm_weight is not None
    if qk_norm:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            ok = isinstance(w, torch.Tensor) and w.shape == (D,)
            if not ok or w.dtype != dt or w.device != dev or w.stride(0) != 1:
                raise ValueError(
                    f"{name} must be a contiguous {dt} tensor [D = {D}] on {dev}, got {describe(w)}"
                )
    if q_out is None:
        q_out = torch.empty((batch, NH, S, D), dtype=dt, device=dev)
    elif (
        not isinstance(q_out, torch.Tensor)
        or q_out.shape != (batch, NH, S, D)
        or q_out.dtype != dt
        or q_out.device != dev
        or not q_out.is_contiguous()
    ):
        raise ValueError(f"q_out must be a contiguous {dt} tensor [B, NH, S, D] = {(batch, NH, S, D)}")
    if T:
        qw = q_norm_weight if qk_norm else cos
        kw = k_norm_weight if qk_norm else cos
        _qk_norm_rope_cache[(T, NH + 2 * NKV)](
            qkv, q_out, k_cache, v_cache, cos, sin, cache_rows, positions, qw, kw, S, float(eps),
            qkv.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NH=NH, NKV=NKV, D=D, HALF_P=triton.next_power_of_2(D // 2), QK_NORM=qk_norm,
            num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return q_out
