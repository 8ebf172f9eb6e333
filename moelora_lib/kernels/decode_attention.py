"""Decode attention (one new query token per request) over the model's KV cache, read in place: a Triton
split-KV kernel ("flash decoding") and a combine kernel, launched by :func:`decode_attention`.

Method: Flash-Decoding (Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov, "Flash-Decoding for
long-context inference", PyTorch blog / Stanford CRFM, Oct 2023): at decode there is one query row per
head, so parallelism over (request, head) alone leaves most SMs idle; the key positions are split into
chunks, each chunk is reduced by its own program with an online softmax (running max m, sum l, unnormalized
accumulator acc, as FlashAttention), and a second, tiny kernel merges the chunks with their log-sum-exp
weights. GPT-OSS attention sinks follow transformers' ``GptOss`` ``eager_attention_forward``: the softmax
runs over [scores, sink_h] per head and the sink column is dropped, i.e. exp(sink_h) joins the denominator
only (here: in the combine, once per head). The code is this project's own.

Design:

* ``_decode_split_kernel``, grid (B·NKV, num_splits): program (b, kv head, split). The g = NH / NKV query
  heads that share the KV head are the rows of one [BLOCK_G, BLOCK_D] tile (BLOCK_G = max(16, next_pow2(g)),
  padding rows are zeros and never stored), so each K/V block is loaded once per KV head and used by
  ``tl.dot`` for all g heads (GQA). The visible range of request b is [lo, seq_len) with lo = 0 on full
  layers and lo = max(0, seq_len - W) on sliding ones (the model's mask: a query at position pos sees
  (pos - W, pos]). It is cut at run time, from the seq_len the program loads, into num_splits chunks of
  ``chunk = round_up(cdiv(seq_len - lo, num_splits), BLOCK_N)`` positions, so every split works on the
  visible positions only (nothing is spent on the max_seq - seq_len positions a graph-static grid covers);
  a split whose chunk starts at or after seq_len runs no iteration and writes (m, l, acc) = (-inf, 0, 0).
  The loop walks BLOCK_N positions at a time, scores in fp32 (log2 domain: q·k · scale · log2 e, exp2),
  p cast to the cache dtype for the p·V dot (as FlashAttention and the model's explicit path do).
* ``_decode_combine_kernel``, grid (B·NH,): merges the splits of one (b, head) BLOCK_S at a time with the
  weights exp2(m_s - M), empty splits weighing 0 (no -inf - -inf), adds exp(sink_h) to the denominator, and
  writes out[b, h] in q's dtype.
* Scratch (fp32, contiguous, allocated per call with ``torch.empty``; inside a CUDA-graph capture this comes
  from the graph's pool): ``acc`` [B, NH, num_splits, D] and ``ml`` [B, NH, num_splits, 2] (m in log2 units,
  l). Both kernels index it from (b, h, split) and num_splits, so no scratch stride enters a kernel's key.
* CUDA graphs and recompiles: the grid and num_splits come from host ints only (B, NKV, max_seq, the
  sliding window and the device's SM count: :func:`default_num_splits`); nothing reads a tensor value on
  the host. ``num_splits`` is ``do_not_specialize`` in both kernels (it follows B). B never enters a kernel
  (only the grid), seq_lens are a tensor, and the cache strides, which follow max_seq, are always multiples
  of 16 when D is (Triton keys them on ``% 16``, which is kept on purpose: it lets the loads along D
  vectorize), so the binary is one per (dtype, D, g, NH, sliding, sinks, cache_rows given or not);
  tests/test_decode_attention.py checks the keys compile-only for sm_90.

Cost: at decode the K/V bytes are small (GPT-OSS-20B at seq 1600: 1.8 MB per layer on average, ~0.4 µs
at ~4.3 TB/s), so the time is launch latency and dependent loads: the two launches per layer replace
the explicit path's ~8 launches over all max_seq positions (step breakdown: notebook 11).

Errors: ValueError naming the argument and the expected shape/dtype/device (see :func:`decode_attention`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common import check_cpu_backend, describe, is_int
from ..hardware import H200_NUM_SMS
from .config import next_pow2

__all__ = [
    "DecodeAttentionConfig",
    "DEFAULT_DECODE_CONFIG",
    "MAX_DEFAULT_SPLITS",
    "default_num_splits",
    "decode_attention",
    "decode_attention_args",
]

_LOG2E = 1.4426950408889634

#: Upper bound of :func:`default_num_splits` (the combine reads them in ``combine_block_s`` chunks).
MAX_DEFAULT_SPLITS = 64


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Launch parameters: ``block_n`` cache positions per loop step of the split kernel (a power of two
    ≥ 16), ``num_warps``/``num_stages`` of the split kernel, ``combine_block_s`` splits per step of the
    combine (power of two ≥ 1) and its ``combine_num_warps``."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    combine_block_s: int = 32
    combine_num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "combine_block_s"):
            v = getattr(self, name)
            lo = 16 if name == "block_n" else 1
            if not is_int(v) or v < lo or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two >= {lo}, got {v!r}")
        for name in ("num_warps", "num_stages", "combine_num_warps"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"config.{name} must be an int >= 1, got {v!r}")


DEFAULT_DECODE_CONFIG = DecodeAttentionConfig()


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_lens_ptr,
    rows_ptr,
    acc_ptr,
    ml_ptr,
    qk_scale,
    window,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    NH: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # partial softmax of the G query heads of KV head `kvh` of request b over one chunk of its visible
    # cache positions; qk_scale = softmax scale · log2(e)
    NKV: tl.constexpr = NH // G
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NKV
    kvh = pid % NKV
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_ptr + row * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + row * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block holds >= 1 visible position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    slot = (b * NH + heads) * num_splits + split  # [BLOCK_G] index into [B, NH, num_splits]
    tl.store(
        acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :]
    )
    tl.store(ml_ptr + slot * 2, m_i, mask=g_mask)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    acc_ptr,
    ml_ptr,
    sinks_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    NH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # out[b, h] = Σ_s w_s·acc_s / (Σ_s w_s·l_s + exp(sink_h)), w_s = exp2(m_s - M), M the running max
    pid = tl.program_id(0)
    b = pid // NH
    h = pid % NH
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = pid * num_splits
    big_m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    num = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        m_s = tl.load(ml_ptr + (base + offs_s) * 2, mask=s_mask, other=float("-inf"))
        l_s = tl.load(ml_ptr + (base + offs_s) * 2 + 1, mask=s_mask, other=0.0)
        a_s = tl.load(
            acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_new = tl.maximum(big_m, tl.max(m_s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0, no NaN
        c_old = tl.exp2(big_m - m_ref)
        w = tl.exp2(m_s - m_ref)  # empty split (m_s = -inf): 0
        den = den * c_old + tl.sum(w * l_s, 0)
        num = num * c_old + tl.sum(w[:, None] * a_s, 0)
        big_m = m_new
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units, as m
        m_new = tl.maximum(big_m, sink)
        c_old = tl.exp2(big_m - m_new)
        den = den * c_old + tl.exp2(sink - m_new)
        num = num * c_old
    out = num / den
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; elsewhere (the interpreter, compile-only checks) the H200's."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return H200_NUM_SMS


def default_num_splits(
    B: int, num_kv_heads: int, max_seq: int, num_sms: int, block_n: int, sliding_window: int | None = None
) -> int:
    """Splits per (request, KV head), from host ints only (graph-static): enough programs for ~2 per SM,
    ``ceil(2·num_sms / (B·NKV))``, but no more than the BLOCK_N blocks of the longest visible range
    (max_seq, or the sliding window W) and :data:`MAX_DEFAULT_SPLITS`; at least 1. E.g. GPT-OSS-20B on an
    H200 (132 SMs, NKV 8, BLOCK_N 64, max_seq 4096): B = 1 -> 33 (W = 128: 2), B = 8 -> 5, B = 32 -> 2."""
    span = max_seq if sliding_window is None else min(max_seq, sliding_window)
    want = -(-2 * num_sms // (B * num_kv_heads))
    return max(1, min(want, -(-span // block_n), MAX_DEFAULT_SPLITS))


def _check_cpu_backend(name: str, dtype: torch.dtype) -> None:
    check_cpu_backend(_decode_split_kernel, dtype, name)


def _check(name: str, t, shape: tuple, dtypes: tuple, device, want: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {want}, got {describe(t)}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {want} = {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like q), got {t.device}")


def decode_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cache_rows: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    check_values: bool = True,
):
    """Validate and build both launches: ``((split_grid, split_args, split_meta), (combine_grid,
    combine_args, combine_meta), out)`` where the args are positional and the metas the keyword
    constexprs plus num_warps/num_stages. Allocates the scratch (and ``out`` when None) on q's device.
    Used by :func:`decode_attention` and by the compile-only checks (meta tensors work: nothing is read)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a tensor [B, NH, D], got {describe(q)}")
    B, NH, D = q.shape
    dev, dt = q.device, q.dtype
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must have dtype float16, bfloat16 or float32, got {dt}")
    if B < 1 or NH < 1 or D < 1:
        raise ValueError(f"q [B, NH, D] must have B, NH, D >= 1, got {list(q.shape)}")
    if D > 256:
        raise ValueError(f"q: head dim D = {D} > 256 is not supported")
    if dev.type == "cpu":
        _check_cpu_backend("q", dt)
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a tensor [max_batch, NKV, max_seq, D], got {describe(k_cache)}")
    max_batch, NKV, max_seq = k_cache.shape[:3]
    want_kv = "[max_batch, NKV, max_seq, D]"
    _check("k_cache", k_cache, (max_batch, NKV, max_seq, D), (dt,), dev, want_kv + f" with D = {D} (like q)")
    _check("v_cache", v_cache, tuple(k_cache.shape), (dt,), dev, want_kv + " (like k_cache)")
    if NKV < 1 or max_seq < 1 or max_batch < 1:
        raise ValueError(f"k_cache {want_kv} must have every size >= 1, got {list(k_cache.shape)}")
    if NH % NKV:
        raise ValueError(f"q: NH = {NH} query heads must be a multiple of k_cache's NKV = {NKV} KV heads")
    _check("seq_lens", seq_lens, (B,), (torch.int32, torch.int64), dev, f"[B = {B}] int32/int64")
    if cache_rows is None:
        if B > max_batch:
            raise ValueError(
                f"q: B = {B} requests exceed k_cache's max_batch = {max_batch} rows (cache_rows is None)"
            )
    else:
        _check("cache_rows", cache_rows, (B,), (torch.int32, torch.int64), dev, f"[B = {B}] int32/int64")
    if check_values and dev.type == "cpu":  # index values: free on the host (on a GPU: unchecked, no sync)
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1 or hi > max_seq:
            raise ValueError(f"seq_lens must be in [1, max_seq = {max_seq}], got [{lo}, {hi}]")
        if cache_rows is not None:
            lo, hi = int(cache_rows.min()), int(cache_rows.max())
            if lo < 0 or hi >= max_batch:
                raise ValueError(f"cache_rows must be in [0, max_batch = {max_batch}), got [{lo}, {hi}]")
    if sliding_window is not None and (not is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError(f"sinks must be None or a float tensor [NH = {NH}], got {describe(sinks)}")
        _check("sinks", sinks, (NH,), (sinks.dtype,), dev, f"[NH = {NH}]")
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    if not isinstance(config, DecodeAttentionConfig):
        raise ValueError(f"config must be a DecodeAttentionConfig, got {type(config).__name__}")
    if num_splits is None:
        num_splits = default_num_splits(B, NKV, max_seq, _num_sms(dev), config.block_n, sliding_window)
    elif not is_int(num_splits) or num_splits < 1:
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    num_splits = int(num_splits)
    if out is None:
        out = torch.empty((B, NH, D), dtype=dt, device=dev)
    else:
        _check("out", out, (B, NH, D), (dt,), dev, "[B, NH, D] (like q)")

    G = NH // NKV
    acc = torch.empty((B, NH, num_splits, D), dtype=torch.float32, device=dev)
    ml = torch.empty((B, NH, num_splits, 2), dtype=torch.float32, device=dev)
    block_d = max(16, next_pow2(D))
    split = (
        (B * NKV, num_splits),
        (
            q,
            k_cache,
            v_cache,
            seq_lens,
            seq_lens if cache_rows is None else cache_rows,  # not read without HAS_ROWS
            acc,
            ml,
            float(scale) * _LOG2E,
            int(sliding_window or 0),
            num_splits,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
        ),
        dict(
            NH=NH,
            G=G,
            HEAD_DIM=D,
            BLOCK_G=max(16, next_pow2(G)),
            BLOCK_D=block_d,
            BLOCK_N=config.block_n,
            HAS_ROWS=cache_rows is not None,
            SLIDING=sliding_window is not None,
            DOT_PRECISION="ieee" if dt == torch.float32 else "tf32",
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )
    combine = (
        (B * NH,),
        (acc, ml, acc if sinks is None else sinks, out, num_splits, *out.stride()),
        dict(
            NH=NH,
            HEAD_DIM=D,
            BLOCK_D=block_d,
            BLOCK_S=config.combine_block_s,
            HAS_SINKS=sinks is not None,
            num_warps=config.combine_num_warps,
        ),
    )
    return split, combine, out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cache_rows: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeAttentionConfig = DEFAULT_DECODE_CONFIG,
    check_values: bool = True,
) -> torch.Tensor:
    """Attention of one new query token per request over its cache row (flash decoding, see the module).

    For request b, query head h (KV head h // g, g = NH / NKV) and the visible positions
    P_b = {p : lo_b <= p < seq_lens[b]}, lo_b = 0, or max(0, seq_lens[b] - W) with a sliding window W:
    ``out[b, h] = Σ_{p∈P_b} softmax_p · v_cache[r_b, h // g, p]`` where the softmax over P_b of
    ``scale · q[b, h]·k_cache[r_b, h // g, p]`` is computed in float32 and, with ``sinks``, has exp(sinks[h])
    added to its denominator (GPT-OSS; transformers' ``eager_attention_forward``: softmax over
    [scores, sink_h], the sink column dropped). r_b = cache_rows[b] (b when None).

    Args:
        q: [B, NH, D] float16/bfloat16/float32 (after rope and q-norm); any strides.
        k_cache, v_cache: [max_batch, NKV, max_seq, D], q's dtype and device; read in place (any strides),
            only at the visible positions.
        seq_lens: [B] int32/int64 on q's device: request b sees cache positions < seq_lens[b] (at decode
            start_pos + 1). Contract (not checked: no host sync): 1 <= seq_lens[b] <= max_seq.
        cache_rows: [B] int32/int64 on q's device (distinct rows in [0, max_batch), not checked), or None =
            rows 0..B-1.
        sliding_window: W >= 1 (the query at position seq_len - 1 sees positions > seq_len - 1 - W) or None.
        sinks: [NH] float (any float dtype, cast to float32) on q's device, or None.
        scale: softmax scale (> 0), e.g. D ** -0.5.
        num_splits: splits of the positions per (request, KV head); None = :func:`default_num_splits`
            (host ints only: B, NKV, max_seq, W, the SM count). Any value gives the same result up to
            float32 rounding; splits left without a visible position contribute nothing.
        out: [B, NH, D] of q's dtype and device to write (every element is written), or None (allocated).
        config: :class:`DecodeAttentionConfig` (BLOCK_N, warps, stages).
    Returns:
        out [B, NH, D], q's dtype.
    Raises:
        ValueError naming the argument: q not 3-D or not float16/bfloat16/float32 (bfloat16 or a build
        without the interpreter on the CPU), D > 256; k_cache/v_cache shape, dtype or device unlike q's;
        NH not a multiple of NKV; B > max_batch without cache_rows; seq_lens/cache_rows not [B]
        int32/int64 on q's device; sinks not a float [NH] on q's device; sliding_window, scale,
        num_splits, out or config invalid; on the CPU also seq_lens outside [1, max_seq] or cache_rows
        outside [0, max_batch) unless ``check_values=False`` (the model runner, which checks its host-side
        indices itself; on a GPU the values are never read: out-of-range ones are undefined).

    On a GPU: no host sync, no value read on the host: capturable in a CUDA graph (the scratch is a
    ``torch.empty``).
    """
    (sg, sa, sm), (cg, ca, cm), out = decode_attention_args(
        q,
        k_cache,
        v_cache,
        seq_lens,
        cache_rows=cache_rows,
        sliding_window=sliding_window,
        sinks=sinks,
        scale=scale,
        num_splits=num_splits,
        out=out,
        config=config,
        check_values=check_values,
    )
    _decode_split_kernel[sg](*sa, **sm)
    _decode_combine_kernel[cg](*ca, **cm)
    return out
