"""A dense multi-LoRA projection at decode in ONE launch: :func:`dense_gemv_lora`.

Computes exactly :func:`moelora_lib.linear.lora_linear`'s math for a few tokens (T ≤
:data:`DENSE_GEMV_MAX_TOKENS`)::

    y[t] = x[t]·Wᵀ (+ b) + Σ_s B_s[a_t]·(A_s[a_t]·x[t])        a_t = lora_ids[t], -1 = no adapter

with the layouts of :mod:`moelora_lib.kernels.dense_lora` (weight [N_total, H], lora_a [L, S, R, H],
lora_b [L, N_total, R], slices concatenated along N_total). Where stage ``tuned`` spends a cuBLAS GEMM,
an alignment, a shrink and an expand per projection (four launches whose fixed costs dominate at
decode, when the LoRA bytes are a few percent of the weight's), this is one split-K GEMV.

Grid ``(column tiles, SPLIT_K)``. Column tile j covers BLOCK_SIZE_N columns of one slice s (the tiles
walk the constexpr ``SLICE_WIDTHS`` as the dense expand does, so a tile never straddles two slices);
K split q covers a contiguous run of K tiles. Each program:

1. streams its ``[BLOCK_SIZE_N, BLOCK_SIZE_K]`` weight tiles once and multiplies each with the rows of
   all T tokens on the CUDA cores (``tl.sum`` of a broadcast product; a token row is a vector, so a
   tensor-core tile would be at least 2x padding), fp32 accumulation;
2. in the same K loop computes its partial rank intermediate ``inter_q[t, :] = x[t, Kq]·A[a_t, s, :,
   Kq]ᵀ`` (R values per token, fp32; the A rows are read by every column tile of slice s, so after
   the first they come from L2);
3. adds ``inter_q[t]·B[a_t, tile, :]ᵀ`` (fp32) to its partial output. This is exact algebra: the
   expand is linear in the rank intermediate, so Σ_q inter_q·Bᵀ = (Σ_q inter_q)·Bᵀ;
4. combines the SPLIT_K partial tiles without a memset or a cast launch ("last arriver", the
   threadFenceReduction pattern of the CUDA samples and of serial split-K GEMMs): every program adds
   its partial tile into a persistent fp32 workspace with relaxed atomics, then a CTA barrier, then
   one ``acq_rel`` atomic increment of its tile's counter. The program that reads SPLIT_K − 1 saw
   every other split's release: it loads the tile from the workspace past L1 (``.cg``), adds the
   bias, rounds once to x's dtype, stores y, and writes zeros back into the workspace and 0 into the
   counter, so both are zero again for the next call. With SPLIT_K = 1 the program stores directly.

The workspace (:func:`dense_gemv_workspace`: fp32 [max_tokens, N_total] and int32 counters, zero when
allocated) is kept by the caller across calls; one call at a time may use it (one stream).

Block-FP8 weights (:class:`~moelora_lib.quant.FP8BlockWeight`: float8_e4m3fn codes [N_total, H] and one
fp32/bf16/fp16 scale per (bn, bk) block, scale grid [ceil(N_total/bn), ceil(H/bk)]; the constexpr ``W_FP8``):
the K loop streams the 1-byte code tile instead of the dense one, converts it to fp32, multiplies row n by
the scale of block (n // bn, k0 // bk) and rounds the product once to x's dtype and back to fp32 — the
weight :func:`~moelora_lib.quant.dequantize_fp8_block` gives in x's dtype, so the result equals the dense
path on the dequantized weight up to summation order (the contract of
:func:`~moelora_lib.kernels.dense_fp8.dense_fp8_weight_only`). BLOCK_SIZE_K must divide bk (checked:
ValueError naming ``config``), so a K tile lies in one scale column and its scales are one
[BLOCK_SIZE_N] vector load per K tile (rows of one block share an address), never a per-element
gather. Ragged N and K edges need nothing more: loaded rows are clamped into the weight (so into the
scale grid's last block row) and a K tile starts below H (so in the grid's last block column).

Ids: tokens with id -1 skip the LoRA work, as do tokens whose slot the optional ``slot_mask`` marks
empty; tokens whose id is outside [-1, L) get a NaN row (written by the program that finalizes the tile),
never an out-of-bounds read (ids are clamped before any load and their A/B loads are masked off). Adapter
slots no token uses are never read, so NaN there stays there.

Precision: fp32 accumulation of the base and the LoRA part, the rank intermediate kept in fp32 and
multiplied with B in fp32, one rounding to x's dtype at the end; with SPLIT_K > 1 the fp32 atomic adds
land in an order the hardware picks (the split-K bound of :mod:`moelora_lib.testing`).

Source of the method: split-K GEMV for decode as in gpt-fast's weight-only kernels and
FlashDecoding++'s flat GEMM; the in-kernel split-K reduction by a tile semaphore as in the CUDA
samples' ``threadFenceReduction`` and CUTLASS's serial split-K; the fused shrink/expand is this
project's (the expand's linearity in the intermediate lets it split over K with the base).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import check_activations, check_slices, is_int
from ..common import describe as _desc
from ..quant.fp8 import FP8BlockWeight
from .dense_lora import _slice_tile

__all__ = [
    "DENSE_GEMV_MAX_TOKENS",
    "DenseGemvConfig",
    "DenseGemvWorkspace",
    "default_dense_gemv_config",
    "dense_gemv_workspace",
    "dense_gemv_num_tiles",
    "dense_gemv_args",
    "dense_gemv_lora",
]

#: Largest T one call takes (the token rows are one register block of next_pow2(T) rows).
DENSE_GEMV_MAX_TOKENS = 16


# --------------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------------
def _dense_gemv_lora_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, a_ptr, b_ptr, ids_ptr, mask_ptr, y_ptr, ws_ptr, cnt_ptr,
    T, K, L, R,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_bias, stride_id,
    stride_al, stride_as, stride_ar, stride_ak, stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn, stride_wsm,
    SLICE_WIDTHS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, BLOCK_SIZE_R: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    HAS_MASK: tl.constexpr = False,
    W_FP8: tl.constexpr = False, FP8_BN: tl.constexpr = 1, FP8_BK: tl.constexpr = 1,
):  # fmt: skip
    # y[t, tile] of T tokens over K split pid_k (module docstring); tile pid_n lies in slice slice_id.
    # W_FP8: w_ptr holds float8_e4m3fn codes [N_total, K] and s_ptr their scale grid
    # [ceil(N_total/FP8_BN), ceil(K/FP8_BK)]; BLOCK_SIZE_K divides FP8_BK (checked by the launcher), so a K
    # tile has one scale column.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    slice_id, col0, col_end = _slice_tile(pid_n, SLICE_WIDTHS, NUM_SLICES, BLOCK_SIZE_N)

    # Token t's values live in column t of [*, BLOCK_T] tiles that share the weight tile's layout, so
    # adding a token's [BLOCK_SIZE_N] (or [BLOCK_SIZE_R]) result into them needs no layout change.
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_n = col0 + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < col_end
    n_ld = tl.minimum(offs_n, col_end - 1).to(tl.int64)  # columns past the slice read its last one
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    offs_r = tl.arange(0, BLOCK_SIZE_R)
    r_mask = offs_r < R
    w_rows = w_ptr + n_ld[:, None] * stride_wn
    if W_FP8:
        # each tile row's block row of scales (in range: the clamped row < N); int32 offsets suffice (a scale
        # grid holds far fewer than 2^31 entries)
        s_rows = s_ptr + (tl.minimum(offs_n, col_end - 1) // FP8_BN) * stride_sn

    if HAS_LORA:
        lid = tl.load(ids_ptr + offs_t * stride_id, mask=t_mask, other=-1)
        valid = t_mask & (lid >= 0) & (lid < L)
        bad = t_mask & ((lid < -1) | (lid >= L))
        lid_ld = tl.where(valid, lid, 0)  # clamped before any load
        if HAS_MASK:  # a slot holding no adapter: no LoRA work, exactly the base (as id -1)
            valid = valid & (tl.load(mask_ptr + lid_ld, mask=valid, other=0) != 0)
        a_rows = a_ptr + slice_id * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_SIZE_N, BLOCK_T), dtype=tl.float32)
    inter = tl.zeros((BLOCK_SIZE_R, BLOCK_T), dtype=tl.float32)

    n_kt = tl.cdiv(K, BLOCK_SIZE_K)
    if EVEN_K:
        per = n_kt // SPLIT_K
    else:
        per = tl.cdiv(n_kt, SPLIT_K)
    kt0 = pid_k * per
    kt1 = tl.minimum(kt0 + per, n_kt)
    for kt in range(kt0, kt1):
        k_idx = kt * BLOCK_SIZE_K + offs_k
        k_ok = k_idx < K
        if EVEN_K:
            w = tl.load(w_rows + k_idx[None, :] * stride_wk)
        else:
            w = tl.load(w_rows + k_idx[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
        if W_FP8:
            # the scales of this K tile's one scale column (kt·BLOCK_SIZE_K < K: in range), one per tile row;
            # fp32(code)·fp32(scale) rounded once to x's dtype = dequantize_fp8_block in that dtype
            sc = tl.load(s_rows + ((kt * BLOCK_SIZE_K) // FP8_BK) * stride_sk).to(tl.float32)
            w = (w.to(tl.float32) * sc[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            w = w.to(tl.float32)
        for t in tl.static_range(BLOCK_T):
            if t < T:
                x_ptrs = x_ptr + t * stride_xm + k_idx * stride_xk
                if EVEN_K:
                    xt = tl.load(x_ptrs).to(tl.float32)
                else:
                    xt = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * xt[None, :], axis=1)
                acc += tl.where(offs_t[None, :] == t, part[:, None], 0.0)
                if HAS_LORA:
                    lt = tl.sum(tl.where(offs_t == t, lid_ld, 0), axis=0).to(tl.int64)
                    if tl.sum(tl.where(offs_t == t, valid, 0), axis=0) > 0:
                        a_ptrs = a_rows + lt * stride_al + k_idx[None, :] * stride_ak
                        if EVEN_K:
                            a = tl.load(a_ptrs, mask=r_mask[:, None], other=0.0)
                        else:
                            a = tl.load(a_ptrs, mask=r_mask[:, None] & k_ok[None, :], other=0.0)
                        pr = tl.sum(a.to(tl.float32) * xt[None, :], axis=1)
                        inter += tl.where(offs_t[None, :] == t, pr[:, None], 0.0)

    if HAS_LORA:  # delta[t, n] = Σ_r inter_q[t, r]·B[a_t, n, r], in fp32
        for t in tl.static_range(BLOCK_T):
            if t < T:
                lt = tl.sum(tl.where(offs_t == t, lid_ld, 0), axis=0).to(tl.int64)
                if tl.sum(tl.where(offs_t == t, valid, 0), axis=0) > 0:
                    b_ptrs = b_ptr + lt * stride_bl + n_ld[:, None] * stride_bn + offs_r[None, :] * stride_br
                    bv = tl.load(b_ptrs, mask=r_mask[None, :], other=0.0).to(tl.float32)
                    it = tl.sum(tl.where(offs_t[None, :] == t, inter, 0.0), axis=1)
                    d = tl.sum(bv * it[None, :], axis=1)
                    acc += tl.where(offs_t[None, :] == t, d[:, None], 0.0)

    out_mask = n_mask[:, None] & t_mask[None, :]
    y_ptrs = y_ptr + offs_n.to(tl.int64)[:, None] * stride_yn + offs_t.to(tl.int64)[None, :] * stride_ym
    if SPLIT_K == 1:
        res = acc
        if HAS_BIAS:
            res += tl.load(bias_ptr + n_ld * stride_bias).to(tl.float32)[:, None]
        if HAS_LORA:
            res = tl.where(bad[None, :], float("nan"), res)
        tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        ws_ptrs = ws_ptr + offs_n.to(tl.int64)[:, None] + offs_t.to(tl.int64)[None, :] * stride_wsm
        tl.atomic_add(ws_ptrs, acc, mask=out_mask, sem="relaxed")
        # every thread's adds precede (barrier) the one release below; its acquire half orders the
        # last arriver's loads after every other split's release
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            res = tl.load(ws_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                res += tl.load(bias_ptr + n_ld * stride_bias).to(tl.float32)[:, None]
            if HAS_LORA:
                res = tl.where(bad[None, :], float("nan"), res)
            tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(ws_ptrs, tl.zeros((BLOCK_SIZE_N, BLOCK_T), dtype=tl.float32), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")


#: Arguments whose values follow the number of tokens (never specialized: one binary per BLOCK_T).
DENSE_GEMV_LENGTH_ARGS = ["T"]
_KERNEL = triton.jit(_dense_gemv_lora_kernel, do_not_specialize=DENSE_GEMV_LENGTH_ARGS)


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------
def _pow2(v) -> bool:
    return is_int(v) and v >= 1 and (v & (v - 1)) == 0


@dataclass(frozen=True)
class DenseGemvConfig:
    """Launch config of :func:`dense_gemv_lora`.

    Fields:
        BLOCK_SIZE_N: output columns per program, a power of two in [8, 512].
        BLOCK_SIZE_K: K values per step, a power of two in [16, 1024].
        SPLIT_K: K splits (programs per column tile), an int in [1, 128]; > 1 combines the partial
            tiles in the caller's workspace (module docstring).
        NUM_WARPS: 1, 2, 4, 8 or 16.
        NUM_STAGES: Triton's num_stages, an int in [1, 8] (the K loop's loads feed no tl.dot: compiled for
            sm_90 with Triton 3.6, 1 and 3 give the same loads, no cp.async; kept for GPU sweeps).
    Raises:
        ValueError naming the field and its allowed values.
    """

    BLOCK_SIZE_N: int = 64
    BLOCK_SIZE_K: int = 128
    SPLIT_K: int = 1
    NUM_WARPS: int = 4
    NUM_STAGES: int = 1

    def __post_init__(self):
        checks = (
            ("BLOCK_SIZE_N", _pow2(self.BLOCK_SIZE_N) and 8 <= self.BLOCK_SIZE_N <= 512,
             "a power of two in [8, 512]"),
            ("BLOCK_SIZE_K", _pow2(self.BLOCK_SIZE_K) and 16 <= self.BLOCK_SIZE_K <= 1024,
             "a power of two in [16, 1024]"),
            ("SPLIT_K", is_int(self.SPLIT_K) and 1 <= self.SPLIT_K <= 128, "an int in [1, 128]"),
            ("NUM_WARPS", is_int(self.NUM_WARPS) and self.NUM_WARPS in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
            ("NUM_STAGES", is_int(self.NUM_STAGES) and 1 <= self.NUM_STAGES <= 8, "an int in [1, 8]"),
        )  # fmt: skip
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"DenseGemvConfig.{name} must be {want}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints become Python ints

    def short(self) -> str:
        """A compact name for result rows: ``n64k128s5w4st1``."""
        return f"n{self.BLOCK_SIZE_N}k{self.BLOCK_SIZE_K}s{self.SPLIT_K}w{self.NUM_WARPS}st{self.NUM_STAGES}"

    def even_k(self, hidden: int) -> bool:
        """Whether every K split covers whole K tiles (no K masks): H % (BLOCK_SIZE_K·SPLIT_K) == 0."""
        return hidden % (self.BLOCK_SIZE_K * self.SPLIT_K) == 0


def dense_gemv_num_tiles(slices: tuple[int, ...], block_size_n: int) -> int:
    """Column tiles of a launch: Σ_s cdiv(N_s, BLOCK_SIZE_N) (no tile straddles two slices). ValueError
    naming the argument for bad slices or a block_size_n < 1."""
    if not is_int(block_size_n) or block_size_n < 1:
        raise ValueError(f"block_size_n must be an int >= 1, got {block_size_n!r}")
    return sum(triton.cdiv(n, int(block_size_n)) for n in check_slices(slices))


def _pow2_divisor(n: int) -> int:
    """The largest power of two dividing n (n ≥ 1)."""
    return n & -n


def default_dense_gemv_config(
    T: int,
    n_total: int,
    hidden: int,
    *,
    slices: tuple[int, ...] | None = None,
    num_sms: int = 132,
    block_k: int | None = None,
) -> DenseGemvConfig:
    """A starting config for T tokens on an [n_total, hidden] weight (hand-picked for an H100/H200-class
    GPU of ``num_sms`` SMs; a GPU sweep, data/dev/probes/dense_gemv_probe.py, refines
    it).

    BLOCK_SIZE_N 64 (32 when 64-column tiles give fewer than ``num_sms`` programs even split over K);
    BLOCK_SIZE_K 128 for T ≤ 2, 64 above (a program holds next_pow2(T) output and rank accumulators per
    row of its tile); SPLIT_K the smallest that gives about 4·num_sms programs at T = 1 and 2·num_sms
    above (a lone token's program streams its tile with little arithmetic per byte: more bytes in flight
    per SM pay until the splits' reduction does not), capped at the K tiles (half of them at T = 1: two
    K tiles or more per program) and at 128. Where that split leaves a ragged K loop, the first SPLIT_K up
    to twice the need with H % (BLOCK_SIZE_K·SPLIT_K) == 0 is taken instead (unmasked loads); above T = 1
    BLOCK_SIZE_K is also halved down to 32 in that search; at T = 1 it stays 128 and, when no split
    divides, the K loop stays ragged with the split shrunk to the splits that hold a K tile (fewer than
    4·num_sms programs then: 128-wide K tiles beat an even loop of 64-wide ones on the projections swept,
    docs/perf_notes.md, "Dense projections at decode in one launch").
    ``block_k``: the scale block's columns of a block-FP8 weight (None: a dense weight); every BLOCK_SIZE_K
    considered is then also capped at the largest power of two dividing it (and the halving stops there
    when that is below 32), so BLOCK_SIZE_K divides ``block_k`` and a K tile reads one scale column.
    ValueError naming the argument for a T outside [1, DENSE_GEMV_MAX_TOKENS], sizes < 1, or a ``block_k``
    that is not a multiple of 16 (no K tile of the smallest BLOCK_SIZE_K, 16, fits one scale column).
    """
    for name, v in (("n_total", n_total), ("hidden", hidden), ("num_sms", num_sms)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not is_int(T) or not 1 <= T <= DENSE_GEMV_MAX_TOKENS:
        raise ValueError(f"T must be an int in [1, {DENSE_GEMV_MAX_TOKENS}], got {T!r}")
    if block_k is not None and (not is_int(block_k) or block_k < 1 or block_k % 16):
        raise ValueError(
            f"block_k must be None (a dense weight) or the FP8 scale block's columns, an int multiple of 16, "
            f"got {block_k!r}"
        )
    slices = (int(n_total),) if slices is None else check_slices(slices, n_total)
    bk0 = 128 if T <= 2 else 64
    if block_k is not None:
        bk0 = min(bk0, _pow2_divisor(int(block_k)))
    target = (4 if T == 1 else 2) * num_sms
    bn = 64
    if dense_gemv_num_tiles(slices, bn) * max(1, hidden // bk0) < num_sms:
        bn = 32
    tiles = dense_gemv_num_tiles(slices, bn)

    def max_split(bk: int) -> int:  # at T = 1 every split keeps two K tiles or more; 128 at most
        k_tiles = triton.cdiv(hidden, bk)
        return min(128, max(1, k_tiles // 2) if T == 1 else k_tiles)

    def need(bk: int) -> int:
        return min(max(1, math.ceil(target / tiles)), max_split(bk))

    bk = bk0
    while bk >= (bk0 if T == 1 else min(32, bk0)):
        for split in range(need(bk), min(2 * need(bk), max_split(bk)) + 1):
            if hidden % (bk * split) == 0:
                return DenseGemvConfig(
                    BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, SPLIT_K=split, NUM_WARPS=4, NUM_STAGES=1
                )
        bk //= 2
    # ragged: cdiv(k_tiles, SPLIT_K) tiles per split, so a split count that leaves the last splits empty
    # shrinks to the splits that hold a tile
    k_tiles = triton.cdiv(hidden, bk0)
    split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, need(bk0)))
    return DenseGemvConfig(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk0, SPLIT_K=split, NUM_WARPS=4, NUM_STAGES=1)


# --------------------------------------------------------------------------------------------------
# workspace
# --------------------------------------------------------------------------------------------------
class DenseGemvWorkspace(NamedTuple):
    """The split-K state :func:`dense_gemv_lora` keeps between calls: ``partial`` fp32 [max_tokens,
    N_total] and ``counters`` int32 [n_tiles], both all zero before and after every call."""

    partial: torch.Tensor
    counters: torch.Tensor


def dense_gemv_workspace(max_tokens: int, n_total: int, n_tiles: int, device) -> DenseGemvWorkspace:
    """A zeroed :class:`DenseGemvWorkspace` for calls of up to ``max_tokens`` tokens on an N_total-wide
    output with at most ``n_tiles`` column tiles (:func:`dense_gemv_num_tiles` of the smallest
    BLOCK_SIZE_N used). Keep it across calls (CUDA-graph friendly: fixed addresses); one call at a time
    may use it. ValueError naming the argument for sizes < 1."""
    for name, v in (("max_tokens", max_tokens), ("n_total", n_total), ("n_tiles", n_tiles)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from e
    return DenseGemvWorkspace(
        torch.zeros((max_tokens, n_total), dtype=torch.float32, device=dev),
        torch.zeros((n_tiles,), dtype=torch.int32, device=dev),
    )


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.device.type != "meta" else None


def _check_inputs(x, weight, bias, lora_a, lora_b, lora_ids, slices, out, slot_mask=None) -> dict:
    """Sizes of a :func:`dense_gemv_lora` call (T, H, N, L, S, R, slices, has_lora); ValueError naming the
    argument otherwise."""
    from ..common import check_no_grad, check_tensor

    dt, dev = check_activations("x", x, _KERNEL)
    w = weight.weight if isinstance(weight, FP8BlockWeight) else weight
    check_no_grad(
        ("x", x), ("weight", w), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b), ("out", out)
    )
    T, H = x.shape
    if not 1 <= T <= DENSE_GEMV_MAX_TOKENS:
        raise ValueError(f"x: T = {T} tokens must be in [1, {DENSE_GEMV_MAX_TOKENS}] (decode sizes)")
    if H < 1:
        raise ValueError(f"x: H must be >= 1, got shape {tuple(x.shape)}")
    if isinstance(weight, FP8BlockWeight):
        if weight.weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D FP8BlockWeight [N_total, H], got shape {list(weight.shape)}"
            )
        N = weight.shape[0]
        if weight.shape[1] != H:
            raise ValueError(
                f"weight must have shape [N_total, H={H}], got FP8 of shape {list(weight.shape)}"
            )
        if weight.device != dev:
            raise ValueError(f"weight must be on {dev} (like x), got {weight.device}")
        if weight.block[1] % 16:
            raise ValueError(
                f"weight.block = {weight.block}: the GEMV needs scale blocks of a multiple of 16 columns "
                "(a K tile of at least 16 must lie in one scale column)"
            )
    elif not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            "weight must be a 2-D tensor [N_total, H] (nn.Linear layout) or an FP8BlockWeight, got "
            f"{_desc(weight)}"
        )
    else:
        N = weight.shape[0]
        check_tensor("weight", weight, (("N_total", N), ("H", H)), (dt,), dev, " (like x)", like="x")
    slices = check_slices(slices, N, "N_total = weight.shape[0]")
    S = len(slices)
    if bias is not None:
        check_tensor("bias", bias, (("N_total", N),), (dt,), dev, " (like x)", like="x")
    has_lora = lora_a is not None or lora_b is not None or lora_ids is not None
    L = R = 0
    if has_lora:
        if lora_a is None or lora_b is None or lora_ids is None:
            raise ValueError("lora_a, lora_b and lora_ids must be given together (or all None: base only)")
        if not isinstance(lora_a, torch.Tensor) or lora_a.dim() != 4:
            raise ValueError(f"lora_a must be a 4-D tensor [L, S, R, H], got {_desc(lora_a)}")
        L, R = lora_a.shape[0], lora_a.shape[2]
        if L < 1 or R < 1:
            raise ValueError(f"lora_a: L (dim 0) and R (dim 2) must be >= 1, got L={L}, R={R}")
        check_tensor("lora_a", lora_a, (("L", L), ("S", S), ("R", R), ("H", H)), (dt,), dev, " (like x)",
                     like="x")  # fmt: skip
        check_tensor(
            "lora_b", lora_b, (("L", L), ("N_total", N), ("R", R)), (dt,), dev, " (like x)", like="x"
        )
        check_tensor("lora_ids", lora_ids, (("T", T),), (torch.int32, torch.int64), dev, like="x")
        if slot_mask is not None:
            check_tensor("slot_mask", slot_mask, (("L", L),), (torch.bool,), dev, like="x")
            if slot_mask.stride(0) != 1:
                raise ValueError(f"slot_mask must be contiguous, got stride {slot_mask.stride()}")
    elif slot_mask is not None:
        raise ValueError("slot_mask needs the LoRA arguments (lora_a, lora_b, lora_ids)")
    if out is not None:
        check_tensor("out", out, (("T", T), ("N_total", N)), (dt,), dev, " (like x)", like="x")
        if out.stride(1) != 1 or (T > 1 and out.stride(0) < N):
            raise ValueError(
                f"out must have rows of unit stride that do not overlap, got strides {out.stride()}"
            )
        inputs = (x, w, bias, lora_a, lora_b, lora_ids)
        if _storage(out) is not None and any(_storage(t) == _storage(out) for t in inputs if t is not None):
            raise ValueError("out must not share memory with x, weight, bias or the LoRA arguments")
    return dict(T=T, H=H, N=N, L=L, S=S, R=R, slices=slices, has_lora=has_lora)


def _check_config_block(config: DenseGemvConfig, weight) -> None:
    """ValueError naming ``config`` unless its BLOCK_SIZE_K divides a block-FP8 ``weight``'s scale block
    columns (a K tile must lie in one scale column); nothing to check for a dense weight."""
    if isinstance(weight, FP8BlockWeight) and weight.block[1] % config.BLOCK_SIZE_K:
        raise ValueError(
            f"config.BLOCK_SIZE_K = {config.BLOCK_SIZE_K} must divide the FP8 weight's scale block columns "
            f"weight.block[1] = {weight.block[1]}: a K tile reads one scale column"
        )


def _check_workspace(workspace, T: int, N: int, n_tiles: int, split_k: int, device) -> None:
    """ValueError naming ``workspace`` unless it holds a float32 [>= T, N] partial tile buffer with unit
    column stride and >= n_tiles int32 counters on ``device``."""
    if not isinstance(workspace, DenseGemvWorkspace):
        raise ValueError(
            f"workspace must be a DenseGemvWorkspace (dense_gemv_workspace) or None with SPLIT_K = "
            f"{split_k} > 1, got {_desc(workspace)}"
        )
    p, c = workspace.partial, workspace.counters
    if not (
        isinstance(p, torch.Tensor)
        and p.dim() == 2
        and p.shape[0] >= T
        and p.shape[1] == N
        and p.dtype == torch.float32
        and p.device == device
        and p.stride(1) == 1
        and (p.shape[0] == 1 or p.stride(0) >= N)
    ):
        raise ValueError(
            f"workspace.partial must be a float32 tensor [>= T={T}, N_total={N}] of non-overlapping rows "
            f"with unit column stride on {device}, got {_desc(p)}"
            + (f", strides {p.stride()}" if isinstance(p, torch.Tensor) else "")
        )
    if not (
        isinstance(c, torch.Tensor)
        and c.dim() == 1
        and c.numel() >= n_tiles
        and c.dtype == torch.int32
        and c.device == device
        and c.stride(0) == 1
    ):
        raise ValueError(
            f"workspace.counters must be a contiguous int32 tensor [>= n_tiles={n_tiles}] on {device}, got "
            f"{_desc(c)}"
        )


def dense_gemv_args(x, weight, bias, lora_a, lora_b, lora_ids, out, workspace, config: DenseGemvConfig, *,
                    slices: tuple[int, ...], slot_mask=None) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """``(grid, args, constexprs)`` of one :func:`dense_gemv_lora` launch for checked inputs; allocates and
    launches nothing (meta tensors work: the single source of the launch arguments, shared with compile-only
    checks). ``lora_a``/``lora_b``/``lora_ids`` None: the base GEMV alone; ``workspace`` None: SPLIT_K 1;
    ``weight`` an :class:`~moelora_lib.quant.FP8BlockWeight`: its codes and scale grid (W_FP8);
    ``slot_mask`` a bool [L] (HAS_MASK) or None."""
    T, H = x.shape
    if isinstance(weight, FP8BlockWeight):
        w, sc = weight.weight, weight.scale_inv
        s_str = (sc.stride(0), sc.stride(1))
        fp8 = dict(W_FP8=True, FP8_BN=weight.block[0], FP8_BK=weight.block[1])
    else:
        w, sc, s_str = weight, weight, (0, 0)  # sc never read (W_FP8 False)
        fp8 = dict(W_FP8=False, FP8_BN=1, FP8_BK=1)
    slices = tuple(int(n) for n in slices)
    has_lora = lora_a is not None
    has_bias = bias is not None
    if has_lora:
        L, S, R, _ = lora_a.shape
        a_str = (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3))
        b_str = (lora_b.stride(0), lora_b.stride(1), lora_b.stride(2))
    else:
        L, R = 0, 1
        lora_a = lora_b = lora_ids = x  # never read (HAS_LORA False)
        a_str, b_str = (0, 0, 0, 0), (0, 0, 0)
    has_mask = has_lora and slot_mask is not None
    mask = slot_mask.view(torch.uint8) if has_mask else x  # never read without HAS_MASK
    if config.SPLIT_K > 1:
        ws, cnt = workspace.partial, workspace.counters
    else:
        ws, cnt = out, out  # never touched (SPLIT_K 1 stores directly)
    grid = (dense_gemv_num_tiles(slices, config.BLOCK_SIZE_N), config.SPLIT_K)
    args = (
        x, w, sc, bias if has_bias else x, lora_a, lora_b, lora_ids, mask, out, ws, cnt,
        T, H, L, R,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), *s_str,
        bias.stride(0) if has_bias else 0, lora_ids.stride(0) if has_lora else 0, *a_str, *b_str,
        out.stride(0), out.stride(1), ws.stride(0) if config.SPLIT_K > 1 else 0,
    )  # fmt: skip
    constexprs = dict(
        SLICE_WIDTHS=slices,
        NUM_SLICES=len(slices),
        BLOCK_T=triton.next_power_of_2(T),
        BLOCK_SIZE_N=config.BLOCK_SIZE_N,
        BLOCK_SIZE_K=config.BLOCK_SIZE_K,
        BLOCK_SIZE_R=triton.next_power_of_2(max(R, 1)),
        SPLIT_K=config.SPLIT_K,
        EVEN_K=config.even_k(H),
        HAS_BIAS=has_bias,
        HAS_LORA=has_lora,
        HAS_MASK=has_mask,
        **fp8,
    )
    return grid, args, constexprs


def dense_gemv_lora(
    x: torch.Tensor,
    weight: torch.Tensor | FP8BlockWeight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    lora_ids: torch.Tensor | None,
    *,
    slices: tuple[int, ...],
    config: DenseGemvConfig | None = None,
    workspace: DenseGemvWorkspace | None = None,
    out: torch.Tensor | None = None,
    slot_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """A dense multi-LoRA projection of a few tokens in one launch (module docstring):
    ``y[t] = x[t]·Wᵀ (+ bias) + Σ_s B_s[a_t]·(A_s[a_t]·x[t])``, a_t = lora_ids[t].

    Args:
        x: [T, H] float16/bfloat16/float32 (CUDA, or CPU under TRITON_INTERPRET=1 without bfloat16),
            1 ≤ T ≤ :data:`DENSE_GEMV_MAX_TOKENS`.
        weight: [N_total, H] of x's dtype (nn.Linear layout; the slices' weights concatenated along dim 0),
            or a block-FP8 :class:`~moelora_lib.quant.FP8BlockWeight` [N_total, H] on x's device (codes
            float8_e4m3fn, scale grid [ceil(N_total/bn), ceil(H/bk)] float32/bfloat16/float16, any bn and
            any bk a multiple of 16; fused slices via ``FP8BlockWeight.cat``): each weight tile is
            dequantized in registers to x's dtype (module docstring).
        bias: [N_total] of x's dtype, or None.
        lora_a: [L, S, R, H] of x's dtype (slice s = projection s's A, rank ≤ R zero-padded), or None.
        lora_b: [L, N_total, R] of x's dtype (rows of slice s = projection s's B, scaling folded in), or None.
        lora_ids: [T] int32/int64, each token's slot in [-1, L) (-1 = no adapter), or None. Values are not
            checked on the host (no sync): a token whose id is outside [-1, L) gets a NaN row. The three
            LoRA arguments are given together or all None (the base GEMV alone).
        slices: output widths (N_0, ..., N_{S-1}), Σ = N_total (a constexpr: one binary per projection shape).
        config: a :class:`DenseGemvConfig`; None = :func:`default_dense_gemv_config` (T, N_total, H; an FP8
            weight's ``block_k``). With an FP8 weight its BLOCK_SIZE_K must divide ``weight.block[1]``.
        workspace: a :class:`DenseGemvWorkspace` (:func:`dense_gemv_workspace`) with at least T rows, N_total
            columns and :func:`dense_gemv_num_tiles` counters; needed when SPLIT_K > 1 (None: one is
            allocated for this call). All zero before the call and left all zero by it.
        out: optional [T, N_total] of x's dtype to write into (unit column stride, rows not overlapping, no
            memory shared with the inputs or the workspace).
        slot_mask: optional bool [L] on x's device (with the LoRA arguments): a token whose slot is False
            gets no LoRA work, exactly as id -1 (a slot that holds no adapter: its zero factors would still
            turn an inf of x into NaN).
    Returns:
        y [T, N_total] in x's dtype (``out`` when given). Rows of tokens with id -1 are the base GEMV's
        (fp32 accumulation, not bitwise cuBLAS's). With an FP8 weight: equal to the dense call on
        ``weight.dequantize(x.dtype)`` up to fp32 summation order.
    Raises:
        ValueError naming the argument: not a tensor, shape (in the shape letters), dtype, device, T outside
        [1, DENSE_GEMV_MAX_TOKENS], slices not summing to N_total, LoRA arguments not all given or all None,
        a config that is not a DenseGemvConfig (or, FP8 weight, whose BLOCK_SIZE_K does not divide
        ``weight.block[1]``), a workspace too small or of overlapping rows, an ``out`` that overlaps itself,
        an input or the workspace, an input that requires grad while grad mode is on, bfloat16 on the CPU.
        Any stride of x, weight, bias, the LoRA tensors and lora_ids is read as given.

    Precision: fp32 accumulation and intermediate, one rounding to x's dtype; split-K adds partial tiles with
    fp32 atomics in a hardware-chosen order (not bitwise repeatable across runs when SPLIT_K > 1).
    """
    d = _check_inputs(x, weight, bias, lora_a, lora_b, lora_ids, slices, out, slot_mask)
    block_k = weight.block[1] if isinstance(weight, FP8BlockWeight) else None
    if config is None:
        config = default_dense_gemv_config(d["T"], d["N"], d["H"], slices=d["slices"], block_k=block_k)
    elif not isinstance(config, DenseGemvConfig):
        raise ValueError(f"config must be a DenseGemvConfig or None, got {_desc(config)}")
    _check_config_block(config, weight)
    if config.SPLIT_K > 1:
        n_tiles = dense_gemv_num_tiles(d["slices"], config.BLOCK_SIZE_N)
        if workspace is None:
            workspace = dense_gemv_workspace(d["T"], d["N"], n_tiles, x.device)
        else:
            _check_workspace(workspace, d["T"], d["N"], n_tiles, config.SPLIT_K, x.device)
            if out is not None and _storage(out) in (
                _storage(workspace.partial),
                _storage(workspace.counters),
            ):
                raise ValueError("out must not share memory with the workspace")
    if out is None:
        out = torch.empty((d["T"], d["N"]), dtype=x.dtype, device=x.device)
    grid, args, cx = dense_gemv_args(
        x,
        weight,
        bias,
        lora_a,
        lora_b,
        lora_ids,
        out,
        workspace,
        config,
        slices=d["slices"],
        slot_mask=slot_mask,
    )
    _KERNEL[grid](*args, **cx, num_warps=config.NUM_WARPS, num_stages=config.NUM_STAGES)
    return out
