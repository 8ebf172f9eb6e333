"""Stage ``gemv``: the MoE+LoRA layer at decode as split-K GEMVs, one program per (pair, N tile, K split).

At decode a layer call holds a few (token, k) pairs (T·K ≤ :data:`GEMV_MAX_PAIRS`) and most experts see
one row, so the base GEMMs are matrix-vector products that stream the experts' weights once. Tensor-core
tiles pad each expert's single row to 16 and pipeline few bytes per program; here each program loads a
whole ``[BLOCK_SIZE_N, BLOCK_SIZE_K]`` weight tile into registers per step (rows of ``2·BLOCK_SIZE_K``
contiguous bytes) and multiplies it with its pair's activation row on the CUDA cores, and the grid
(pairs × N tiles × ``SPLIT_K``) holds several programs per SM. Pairs are visited in expert order
(``argsort`` of the flat top-k ids, when T > 1), so two pairs of one expert run side by side and the
second read of a weight tile is an L2 hit. No alignment and no padding: a program knows its pair, hence
its expert and its token's adapter.

The launches of one call (:func:`gemv_moe_lora`), on fp32 buffers (one memset when a launch adds
into them with atomics, none otherwise):

1. ``gate_up_shrink`` (when an adapter covers gate_up): ``inter13[p, s, q] = x[t]·A13[l, e, s]ᵀ`` over
   K split q, one program per (pair, slice, split), each storing its own partial sum (no atomics, so no
   zeroed buffer); pairs without an adapter exit. It also zeroes ``inter2`` for step 2's atomics.
2. ``gate_up``: ``h[p, n] (+)= x[t]·W13[e, n]`` over a K split; the split-0 program adds the expand
   ``(Σ_q inter13[p, s(n), q])·B13[l, e, s(n), n']``. ``h`` is the fp32 pre-activation (no bias, no
   activation). Unsplit (``SPLIT_K`` = 1), a program holds the gate and up rows of the same intermediate
   columns j and so their final pre-activations: it also adds its part of the down shrink,
   ``inter2[p] += act(h[p, j] + b13[e, j])·A2[l, e, :, j]ᵀ`` (relaxed fp32 atomics), the activation
   rounded to the activation dtype as the unfused path stores it.
3. ``down_shrink``, only when step 2 is split over K: the same sum over all of I in a launch of its own.
4. ``down``: ``y[p, n] (+)= w_p·(g·W2[e, n] + [split 0] (b2[e, n] + inter2[p]·B2[l, e, n]))``, with
   ``g = act(h[p] + b13[e])`` computed while loading.
5. the top-k sum :func:`~moelora_lib.kernels.topk_reduce.topk_reduce` over ``y`` [T·K, H] fp32, rounded
   once to the output dtype, with NaN rows for tokens whose ids leave [0, E) / [-1, L) (the kernels
   skip such pairs, never reading out of bounds).

So with both GEMVs unsplit a call is 3 launches without adapters (2 GEMVs, the sum; plus the
``argsort`` when T > 1) against stage ``tuned``'s alignment + 5, and 4 with adapters: the gate_up shrink
stays a launch of its own because every gate_up program's expand needs its complete K reduction.

Weights are bf16/fp16/fp32 ``[E, N, K]`` (nn.Linear layout, K contiguous) or packed MXFP4
(:class:`~moelora_lib.quant.MXFP4Weight`: e2m1 codes two per byte, one e8m0 scale per 32 K values),
unpacked in registers: each nibble's bits placed in an fp16 pattern give its value times 2^-14, and
each group of 32 products is summed before one multiply by 2^14 and the group's e8m0 scale (exact:
powers of two; every scale byte 0–254, byte 0 being the subnormal 2^-127; byte 255, NaN in e8m0, makes
the group's sum ±inf or NaN); or block-scaled FP8
(:class:`~moelora_lib.quant.FP8BlockWeight`: e4m3 codes [E, N, K], one scale per bn x bk block, any
block and BLOCK_SIZE_K), each element's code times its block's scale in fp32, rounded once to the
activations' dtype.

Accumulation is fp32; with ``SPLIT_K`` > 1 the order of the atomic adds varies from run to run (the
same bound as the other split-K ops, :mod:`moelora_lib.testing`). Source of the method: split-K GEMV
for decode as in gpt-fast's int8/int4 weight-only kernels and FlashDecoding++'s flat GEMM; the expert
ordering and fused epilogues are this project's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..configs.schema import GEMV_MAX_PAIRS, LayerConfig
from ..quant.fp8 import FP8BlockWeight
from ..shapes import Dims
from .stages import Stage, config_weight_format

__all__ = [
    "GEMV_MAX_PAIRS",
    "GEMV_MAX_SHRINK_SPLIT",
    "STAGE",
    "GemvStage",
    "GemvRun",
    "gemv_moe_lora",
    "gemv_scratch_numel",
]

#: Largest SPLIT_K of the gate_up shrink (its partial sums are kept apart and added by the expand).
GEMV_MAX_SHRINK_SPLIT = 32

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _mx_tile(w_ptr, s_ptr, expert, offs_n, n_mask, t, K, stride_we, stride_wn, stride_se, stride_sn,
             BLOCK_SIZE_K: tl.constexpr):  # fmt: skip
    """(lo, hi, sf) of K tile t of packed MXFP4 W[e]: lo/hi fp32 [BN, BK/32, 16] = e2m1(code)·2^-14 at
    k = t·BK + 32b + 2i (low nibble) and k + 1 (high nibble); sf fp32 [BN, BK/32] = 2^(byte − 127), the
    e8m0 scale of each 32 values (byte 0: the subnormal 2^-127; byte 255: +inf).

    A code's bits placed in an fp16 pattern (sign at bit 15, exponent and mantissa at bits 9–11) read as
    e2m1(code)·2^-14 exactly (exponent 0 becomes an fp16 subnormal: 0 or 0.5·2^-14): a few integer ops
    and one conversion per value. The caller multiplies each group's partial sum by 2^14 and sf, which
    is exact (powers of two) and saves the per-value multiplies."""
    offs_b = tl.arange(0, BLOCK_SIZE_K // 32)
    offs_i = tl.arange(0, 16)
    blk = t * (BLOCK_SIZE_K // 32) + offs_b
    b_mask = n_mask[:, None] & (blk < K // 32)[None, :]
    sc = tl.load(
        s_ptr + expert * stride_se + offs_n[:, None] * stride_sn + blk[None, :], mask=b_mask, other=0
    ).to(tl.int32)
    sf = tl.where(sc == 0, 0x00400000, sc << 23).to(tl.float32, bitcast=True)
    byte_ptrs = w_ptr + expert * stride_we + offs_n[:, None, None] * stride_wn + (blk * 16)[None, :, None]
    b = tl.load(byte_ptrs + offs_i[None, None, :], mask=b_mask[:, :, None], other=0).to(tl.uint16)
    lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi, sf


@triton.jit
def _act_math(g, u, ACTIVATION: tl.constexpr, G_DTYPE: tl.constexpr):
    """act(gate g, up u) (fp32, biases added), rounded to G_DTYPE as the unfused path stores it, as fp32."""
    if ACTIVATION == "silu":
        out = g / (1.0 + tl.exp(-g)) * u
    else:  # GPT-OSS: gate clamped to ≤ 7, up to [-7, 7], alpha 1.702; NaN propagates through the clamps
        g = tl.where(g > 7.0, 7.0, g)
        u = tl.where(u > 7.0, 7.0, tl.where(u < -7.0, -7.0, u))
        out = (u + 1.0) * (g / (1.0 + tl.exp(-1.702 * g)))
    return out.to(G_DTYPE).to(tl.float32)


@triton.jit
def _act(h_ptr, b_ptr, pair, expert, offs_j, I, stride_hm, stride_be, HAS_BIAS: tl.constexpr,
         ACTIVATION: tl.constexpr, G_DTYPE: tl.constexpr):  # fmt: skip
    """g = act(h[pair] + b13[expert]) at columns offs_j (0 past I), rounded to G_DTYPE, as fp32."""
    m = offs_j < I
    if ACTIVATION == "silu":  # [gate | up] halves
        gc = offs_j
        uc = offs_j + I
    else:  # swigluoai: interleaved rows 2j (gate), 2j + 1 (up)
        gc = 2 * offs_j
        uc = gc + 1
    g = tl.load(h_ptr + pair * stride_hm + gc, mask=m, other=0.0)
    u = tl.load(h_ptr + pair * stride_hm + uc, mask=m, other=0.0)
    if HAS_BIAS:
        g += tl.load(b_ptr + expert * stride_be + gc, mask=m, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + expert * stride_be + uc, mask=m, other=0.0).to(tl.float32)
    return tl.where(m, _act_math(g, u, ACTIVATION, G_DTYPE), 0.0)


@triton.jit
def _pair_of(order_ptr, ids_ptr, idx, E, top_k, ORDERED: tl.constexpr):
    """(pair, expert, token, ok) of the idx-th pair in expert order (ORDERED; else pair idx itself); ok
    False for an expert id outside [0, E) (the program then does nothing; the top-k sum gives the token a
    NaN row)."""
    if ORDERED:
        pair = tl.load(order_ptr + idx).to(tl.int64)
    else:
        pair = idx.to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    return pair, expert, pair // top_k, (expert >= 0) & (expert < E)


@triton.jit
def _input(
    in_ptr,
    b13_ptr,
    pair,
    row,
    expert,
    k_idx,
    K,
    stride_in,
    stride_b13e,
    ACT_INPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    G_DTYPE: tl.constexpr,
):
    """A program's input vector at columns k_idx (0 past K), fp32: x[row] (gate_up), or with ACT_INPUT
    the activation of h[pair] (down; in_ptr is h and K is I)."""
    if ACT_INPUT:
        return _act(
            in_ptr, b13_ptr, pair, expert, k_idx, K, stride_in, stride_b13e, HAS_BIAS, ACTIVATION, G_DTYPE
        )
    else:
        return tl.load(in_ptr + row * stride_in + k_idx, mask=k_idx < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_k_loop(
    in_ptr,
    b13_ptr,
    w_ptr,
    s_ptr,
    pair,
    row,
    expert,
    offs_n,
    n_mask,
    ks,
    K,
    stride_in,
    stride_b13e,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    MXFP4: tl.constexpr,
    ACT_INPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    G_DTYPE: tl.constexpr,
    W_FP8: tl.constexpr,
    FP8_BN: tl.constexpr,
    FP8_BK: tl.constexpr,
):
    """Σ_k W[e, n-tile, k]·v[k] (fp32 [BLOCK_SIZE_N]) over the K tiles of split ``ks`` (v: :func:`_input`):
    one [BLOCK_SIZE_N, BLOCK_SIZE_K] weight tile per step, loaded whole, multiplied on the CUDA cores.

    W_FP8: ``w_ptr`` holds float8_e4m3fn codes [E, N, K] and ``s_ptr`` their scale grid [E, ceil(N/FP8_BN),
    ceil(K/FP8_BK)] (last dim contiguous); each element is fp32(code)·fp32(scale of its block) rounded once
    to the activations' dtype (``G_DTYPE`` with ACT_INPUT, else the input's), the dense weight
    :func:`~moelora_lib.quant.dequantize_fp8_block` gives in that dtype."""
    n_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    per = tl.cdiv(n_tiles, SPLIT_K)
    acc = tl.zeros((BLOCK_SIZE_N,), dtype=tl.float32)
    if MXFP4:  # even and odd K apart: the low and high nibbles of each byte
        offs_b = tl.arange(0, BLOCK_SIZE_K // 32)
        offs_i = tl.arange(0, 16)
        for t in range(ks * per, tl.minimum(ks * per + per, n_tiles)):
            lo, hi, sf = _mx_tile(w_ptr, s_ptr, expert, offs_n, n_mask, t, K, stride_we, stride_wn, stride_se,
                                  stride_sn, BLOCK_SIZE_K)  # fmt: skip
            kx = t * BLOCK_SIZE_K + (offs_b * 32)[:, None] + (2 * offs_i)[None, :]
            ve = _input(
                in_ptr,
                b13_ptr,
                pair,
                row,
                expert,
                kx,
                K,
                stride_in,
                stride_b13e,
                ACT_INPUT,
                HAS_BIAS,
                ACTIVATION,
                G_DTYPE,
            )
            vo = _input(
                in_ptr,
                b13_ptr,
                pair,
                row,
                expert,
                kx + 1,
                K,
                stride_in,
                stride_b13e,
                ACT_INPUT,
                HAS_BIAS,
                ACTIVATION,
                G_DTYPE,
            )
            part = tl.sum(lo * ve[None, :, :] + hi * vo[None, :, :], axis=2)  # [BN, BK/32], ·2^-14
            acc += tl.sum((part * 16384.0) * sf, axis=1)
    else:
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
        for t in range(ks * per, tl.minimum(ks * per + per, n_tiles)):
            k_idx = t * BLOCK_SIZE_K + offs_k
            w = tl.load(w_rows + k_idx[None, :], mask=n_mask[:, None] & (k_idx < K)[None, :], other=0.0)
            if W_FP8:
                s_blk = (offs_n // FP8_BN)[:, None] * stride_sn + (k_idx // FP8_BK)[None, :]
                sc = tl.load(s_ptr + expert * stride_se + s_blk, mask=n_mask[:, None] & (k_idx < K)[None, :],
                             other=0.0)  # fmt: skip
                w = w.to(tl.float32) * sc.to(tl.float32)
                if ACT_INPUT:
                    w = w.to(G_DTYPE)
                else:
                    w = w.to(in_ptr.dtype.element_ty)
            v = _input(
                in_ptr,
                b13_ptr,
                pair,
                row,
                expert,
                k_idx,
                K,
                stride_in,
                stride_b13e,
                ACT_INPUT,
                HAS_BIAS,
                ACTIVATION,
                G_DTYPE,
            )
            acc += tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    return acc


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, order_ptr, ids_ptr, lid_ptr, inter_ptr, b_ptr,
    b13_ptr, lid2_ptr, a2_ptr, inter2_ptr,
    N, K, E, top_k, num_adapters, NS, R, I,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
    stride_im, stride_is, stride_ik, stride_bl, stride_be, stride_bs, stride_bn,
    stride_b13e, stride_a2l, stride_a2e, stride_a2r, stride_i2m,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, SPLIT_K: tl.constexpr, MXFP4: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_SIZE_R: tl.constexpr, SHRINK_SPLITS: tl.constexpr,
    FUSE_SHRINK2: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, G_DTYPE: tl.constexpr,
    W_FP8: tl.constexpr = False, FP8_BN: tl.constexpr = 1, FP8_BK: tl.constexpr = 1,
    ORDERED: tl.constexpr = True,
):  # fmt: skip
    """h[p, n-tile] (+)= x[t]·W13[e, n-tile] over this program's K split (+ the expand on split 0).

    FUSE_SHRINK2 (SPLIT_K = 1): the tile holds the gate and up rows of BLOCK_SIZE_N / 2 intermediate
    columns j, interleaved, so the program has the final pre-activation of those columns and adds its
    part of the down shrink, act(h[p, j] + b13[e, j])·A2[l2, e, :, j]ᵀ, into inter2[p] (relaxed atomics)."""
    ks = tl.program_id(0) % SPLIT_K
    pair, expert, row, ok = _pair_of(order_ptr, ids_ptr, tl.program_id(0) // SPLIT_K, E, top_k, ORDERED)
    if ok:
        if FUSE_SHRINK2:  # element 2i: gate row of column j0 + i, element 2i + 1: its up row
            half = tl.arange(0, BLOCK_SIZE_N) // 2
            offs_jn = tl.program_id(1) * (BLOCK_SIZE_N // 2) + half
            if ACTIVATION == "silu":  # [gate | up] halves
                offs_n = offs_jn + (tl.arange(0, BLOCK_SIZE_N) % 2) * I
            else:  # swigluoai: rows 2j, 2j + 1
                offs_n = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
            n_mask = offs_jn < I
        else:
            offs_n = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
            n_mask = offs_n < N
        acc = _gemv_k_loop(
            x_ptr,
            x_ptr,
            w_ptr,
            s_ptr,
            pair,
            row,
            expert,
            offs_n,
            n_mask,
            ks,
            K,
            stride_xm,
            0,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            BLOCK_SIZE_N,
            BLOCK_SIZE_K,
            SPLIT_K,
            MXFP4,
            False,
            False,
            "silu",
            tl.float32,
            W_FP8,
            FP8_BN,
            FP8_BK,
        )
        offs_r = tl.arange(0, BLOCK_SIZE_R)
        r_mask = offs_r < R
        if HAS_LORA:
            lid = tl.load(lid_ptr + row)
            if (ks == 0) & (lid >= 0) & (lid < num_adapters):
                nr_mask = n_mask[:, None] & r_mask[None, :]
                sl = offs_n // NS
                nn = offs_n - sl * NS
                i_rows = inter_ptr + pair * stride_im + sl[:, None] * stride_is + offs_r[None, :]
                inter = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_R), dtype=tl.float32)
                for q in tl.static_range(SHRINK_SPLITS):  # the shrink's per-split partial sums
                    inter += tl.load(i_rows + q * stride_ik, mask=nr_mask, other=0.0)
                b_rows = (
                    b_ptr
                    + lid.to(tl.int64) * stride_bl
                    + expert * stride_be
                    + sl * stride_bs
                    + nn * stride_bn
                )
                bt = tl.load(b_rows[:, None] + offs_r[None, :], mask=nr_mask, other=0.0)
                acc += tl.sum(inter * bt.to(tl.float32), axis=1)
        out = h_ptr + pair * stride_hm + offs_n
        if SPLIT_K == 1:
            tl.store(out, acc, mask=n_mask)
        else:
            tl.atomic_add(out, acc, mask=n_mask, sem="relaxed")
        if FUSE_SHRINK2:
            lid2 = tl.load(lid2_ptr + row)
            if (lid2 >= 0) & (lid2 < num_adapters):
                hb = acc
                if HAS_BIAS:
                    hb += tl.load(b13_ptr + expert * stride_b13e + offs_n, mask=n_mask, other=0.0).to(
                        tl.float32
                    )
                g, u = tl.split(tl.reshape(hb, (BLOCK_SIZE_N // 2, 2)))
                offs_j = tl.program_id(1) * (BLOCK_SIZE_N // 2) + tl.arange(0, BLOCK_SIZE_N // 2)
                j_mask = offs_j < I
                v = tl.where(j_mask, _act_math(g, u, ACTIVATION, G_DTYPE), 0.0)
                a_rows = a2_ptr + lid2.to(tl.int64) * stride_a2l + expert * stride_a2e + offs_j[:, None]
                a = tl.load(a_rows + offs_r[None, :] * stride_a2r, mask=j_mask[:, None] & r_mask[None, :],
                            other=0.0)  # fmt: skip
                part = tl.sum(v[:, None] * a.to(tl.float32), axis=0)
                tl.atomic_add(inter2_ptr + pair * stride_i2m + offs_r, part, mask=r_mask, sem="relaxed")


@triton.jit
def _gemv_down_kernel(
    h_ptr, b13_ptr, w_ptr, s_ptr, b2_ptr, tw_ptr, y_ptr, order_ptr, ids_ptr, lid_ptr, inter_ptr, bl_ptr,
    N, I, E, top_k, num_adapters, R,
    stride_hm, stride_b13e, stride_we, stride_wn, stride_se, stride_sn, stride_b2e, stride_ym,
    stride_im, stride_bl, stride_be, stride_bn,
    BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, SPLIT_K: tl.constexpr, MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, G_DTYPE: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr, W_FP8: tl.constexpr = False, FP8_BN: tl.constexpr = 1,
    FP8_BK: tl.constexpr = 1, ORDERED: tl.constexpr = True,
):  # fmt: skip
    """y[p, n-tile] (+)= w_p·(g·W2[e, n-tile] over this K split + on split 0: b2 + the expand)."""
    ks = tl.program_id(0) % SPLIT_K
    pair, expert, tok, ok = _pair_of(order_ptr, ids_ptr, tl.program_id(0) // SPLIT_K, E, top_k, ORDERED)
    if ok:
        offs_n = tl.program_id(1) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        n_mask = offs_n < N
        acc = _gemv_k_loop(
            h_ptr,
            b13_ptr,
            w_ptr,
            s_ptr,
            pair,
            tok,
            expert,
            offs_n,
            n_mask,
            ks,
            I,
            stride_hm,
            stride_b13e,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            BLOCK_SIZE_N,
            BLOCK_SIZE_K,
            SPLIT_K,
            MXFP4,
            True,
            HAS_BIAS,
            ACTIVATION,
            G_DTYPE,
            W_FP8,
            FP8_BN,
            FP8_BK,
        )
        if ks == 0:
            if HAS_BIAS:
                acc += tl.load(b2_ptr + expert * stride_b2e + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_LORA:
                lid = tl.load(lid_ptr + tok)
                if (lid >= 0) & (lid < num_adapters):
                    offs_r = tl.arange(0, BLOCK_SIZE_R)
                    inter = tl.load(inter_ptr + pair * stride_im + offs_r, mask=offs_r < R, other=0.0)
                    b_rows = bl_ptr + lid.to(tl.int64) * stride_bl + expert * stride_be + offs_n * stride_bn
                    nr_mask = n_mask[:, None] & (offs_r < R)[None, :]
                    bt = tl.load(b_rows[:, None] + offs_r[None, :], mask=nr_mask,
                                 other=0.0)  # fmt: skip
                    acc += tl.sum(inter[None, :] * bt.to(tl.float32), axis=1)
        acc = acc * tl.load(tw_ptr + pair)
        out = y_ptr + pair * stride_ym + offs_n
        if SPLIT_K == 1:
            tl.store(out, acc, mask=n_mask)
        else:
            tl.atomic_add(out, acc, mask=n_mask, sem="relaxed")


@triton.jit
def _gemv_shrink_kernel(
    x_ptr, b13_ptr, a_ptr, inter_ptr, ids_ptr, lid_ptr, zero_ptr,
    K, E, top_k, num_adapters, R,
    stride_xm, stride_b13e, stride_al, stride_ae, stride_as, stride_ar, stride_im, stride_is, stride_ik,
    stride_zm,
    BLOCK_SIZE_R: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, SPLIT_K: tl.constexpr, ACT_INPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, G_DTYPE: tl.constexpr, PARTIALS: tl.constexpr,
    ZERO: tl.constexpr,
):  # fmt: skip
    """inter[p, s] += v·A[l, e, s]ᵀ over this K split, v = x[t] (gate_up) or, with ACT_INPUT, the
    activation of h[p] (down: x_ptr is h, K is I). Programs (pair, slice, split). PARTIALS: each split
    stores its own partial sum at inter[p, s, split] (no atomics, no zeroed buffer; the reader adds the
    SPLIT_K partials). ZERO: program (p, 0, 0) also zeroes zero_ptr[p, :R] (the fused down shrink's
    accumulator), whatever the pair's adapter."""
    pair = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    ks = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_SIZE_R)
    r_mask = offs_r < R
    if ZERO:
        if (sl == 0) & (ks == 0):
            tl.store(
                zero_ptr + pair * stride_zm + offs_r, tl.zeros((BLOCK_SIZE_R,), dtype=tl.float32), mask=r_mask
            )
    row = pair // top_k
    lid = tl.load(lid_ptr + row)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (lid >= 0) & (lid < num_adapters) & (expert >= 0) & (expert < E):
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        n_tiles = tl.cdiv(K, BLOCK_SIZE_K)
        per = tl.cdiv(n_tiles, SPLIT_K)
        acc = tl.zeros((BLOCK_SIZE_R,), dtype=tl.float32)
        a_rows = (
            a_ptr
            + lid.to(tl.int64) * stride_al
            + expert * stride_ae
            + sl * stride_as
            + offs_r[:, None] * stride_ar
        )
        for t in range(ks * per, tl.minimum(ks * per + per, n_tiles)):
            k_idx = t * BLOCK_SIZE_K + offs_k
            a = tl.load(a_rows + k_idx[None, :], mask=r_mask[:, None] & (k_idx < K)[None, :], other=0.0)
            a = a.to(tl.float32)
            v = _input(
                x_ptr,
                b13_ptr,
                pair,
                row,
                expert,
                k_idx,
                K,
                stride_xm,
                stride_b13e,
                ACT_INPUT,
                HAS_BIAS,
                ACTIVATION,
                G_DTYPE,
            )
            acc += tl.sum(a * v[None, :], axis=1)
        out = inter_ptr + pair * stride_im + sl * stride_is + offs_r
        if PARTIALS:
            tl.store(out + ks * stride_ik, acc, mask=r_mask)
        elif SPLIT_K == 1:
            tl.store(out, acc, mask=r_mask)
        else:
            tl.atomic_add(out, acc, mask=r_mask, sem="relaxed")


def gemv_scratch_numel(T: int, top_k: int, H: int, I: int, S: int, R: int,
                       shrink_split: int = GEMV_MAX_SHRINK_SPLIT) -> int:  # fmt: skip
    """fp32 elements of the buffers one call takes: h [P, 2I], y [P, H], inter13 [P, S, shrink_split, R]
    (the gate_up shrink's per-split partial sums), inter2 [P, R] (P = T·top_k). The default holds any
    gate_up shrink SPLIT_K the GEMVs accept."""
    P = T * top_k
    return P * (2 * I + H + S * shrink_split * R + R)


def _weight_args(w) -> tuple:
    """(weight pointer, scales pointer, stride_we, stride_wn, stride_se, stride_sn, is_mxfp4,
    {W_FP8, FP8_BN, FP8_BK})."""
    no_fp8 = dict(W_FP8=False, FP8_BN=1, FP8_BK=1)
    if isinstance(w, FP8BlockWeight):  # e4m3 [E, N, K] (K contiguous) and its scale grid, made contiguous
        q, sc = w.weight, w.scale_inv.contiguous()
        fp8 = dict(W_FP8=True, FP8_BN=w.block[0], FP8_BK=w.block[1])
        return q, sc, q.stride(0), q.stride(1), sc.stride(0), sc.stride(1), False, fp8
    blocks = getattr(w, "blocks", None)
    if blocks is not None:  # MXFP4Weight: blocks [E, N, K/32, 16] viewed as [E, N, K/2] bytes
        b, s = blocks, w.scales
        return b, s, b.stride(0), b.stride(1), s.stride(0), s.stride(1), True, no_fp8
    return w, w, w.stride(0), w.stride(1), 0, 0, False, no_fp8


def gemv_moe_lora(
    hidden_states: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str,
    config,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    lora_ids: torch.Tensor | None = None,
    lora: tuple | None = None,
    scratch: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    skip_remote: bool = False,
) -> torch.Tensor:
    """The MoE+LoRA layer on T tokens as split-K GEMVs (module docstring), for validated inputs.

    Args:
        hidden_states: [T, H] float16/bfloat16/float32, rows contiguous.
        w13: [E, 2I, H] of hidden_states' dtype (K contiguous) or an :class:`~moelora_lib.quant.MXFP4Weight`
            or :class:`~moelora_lib.quant.FP8BlockWeight` (K contiguous) of that shape; w2: [E, H, I]
            likewise.
        topk_weights: [T, K] float32 (contiguous); topk_ids: [T, K] int32/int64 (contiguous), any values
            (pairs with ids outside [0, E) are skipped and their token's row is NaN).
        activation: "silu" ([gate | up] halves) or "swigluoai" (interleaved gate/up, GPT-OSS clamp).
        config: a :class:`~moelora_lib.configs.LayerConfig`: ``base_gate_up`` / ``base_down`` give
            BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K and NUM_WARPS of the two GEMVs, ``gate_up_shrink`` /
            ``down_shrink`` BLOCK_SIZE_K, SPLIT_K and NUM_WARPS of the shrinks (the other fields are
            unused). MXFP4 weights need BLOCK_SIZE_K ≥ 32 (always true: ≥ 16 and a power of two… and
            a multiple of 32 is checked here).
        b13: [E, 2I] or None; b2: [E, H] or None (both or neither).
        lora_ids: [T] int32/int64, the adapter id of each token as given (ids outside [-1, L) give NaN
            rows); None = no adapters.
        lora: None (no LoRA launch) or ``(ids13, ids2, a13, bl13, a2, bl2)``: per-projection adapter ids
            [T] (-1 where the token's slot does not cover that projection; None = no launch for it; both
            None: no LoRA launch, lora_ids still checked against L = a13.shape[0]), the
            slots a13 [L, E, S, R, H], bl13 [L, E, S, 2I/S, R], a2 [L, E, R, I], bl2 [L, E, H, R]
            (scaling folded into B; any R ≥ 1).
        scratch: flat float32 of at least :func:`gemv_scratch_numel` elements, or None (allocated).
        out: [T, H] of hidden_states' dtype or None.
        skip_remote: expert parallelism: a top-k id of exactly -1 is an expert held on another rank; its
            pair does no work (as every id outside [0, E)) and adds zero instead of making the row NaN
            (:func:`~moelora_lib.kernels.topk_reduce.topk_reduce`'s ``skip_remote``).
    Returns:
        [T, H] of hidden_states' dtype.
    Raises:
        ValueError: T·K above :data:`GEMV_MAX_PAIRS`, a scratch too small, an MXFP4 weight with a
            BLOCK_SIZE_K not a multiple of 32.
    """
    from .topk_reduce import topk_reduce

    x = hidden_states
    T, H = x.shape
    K = topk_ids.shape[1]
    P = T * K
    if P > GEMV_MAX_PAIRS:
        raise ValueError(f"stage gemv takes at most {GEMV_MAX_PAIRS} (token, k) pairs, got T·K = {P}")
    E = w13.shape[0]
    I = w2.shape[2]
    w13a, w2a = _weight_args(w13), _weight_args(w2)
    for name, wa, op in (("w13", w13a, config.base_gate_up), ("w2", w2a, config.base_down)):
        if wa[6] and op.BLOCK_SIZE_K % 32:
            raise ValueError(
                f"{name} is MXFP4: its GEMV's BLOCK_SIZE_K must be a multiple of 32, got {op.BLOCK_SIZE_K}"
            )
    L_ids = 0  # the slot count lora_ids are checked against (NaN rows outside [-1, L_ids))
    if lora is not None:
        ids13, ids2, a13, bl13, a2, bl2 = lora
        L, S, R = a13.shape[0], a13.shape[2], a13.shape[3]
        L_ids = L
        if ids13 is None and ids2 is None:  # slots but no launch: ids are still checked against L
            lora = None
    if lora is None:
        ids13 = ids2 = None
        L, S, R = 0, 0, 0
    r_p = max(16, triton.next_power_of_2(max(R, 1)))
    gu, dn, sh13, sh2 = config.base_gate_up, config.base_down, config.gate_up_shrink, config.down_shrink
    split13 = sh13.SPLIT_K if ids13 is not None else 1
    if split13 > GEMV_MAX_SHRINK_SPLIT:
        raise ValueError(
            f"gate_up_shrink.SPLIT_K must be at most {GEMV_MAX_SHRINK_SPLIT} in stage gemv, got {split13}"
        )
    # The down shrink runs in the gate_up GEMV's epilogue when that GEMV is unsplit (it then holds the
    # final pre-activations): one launch less.
    fuse2 = ids2 is not None and gu.SPLIT_K == 1
    need = gemv_scratch_numel(T, K, H, I, S, R, split13)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=x.device)
    elif scratch.numel() < need:
        raise ValueError(f"scratch must hold at least {need} float32 elements, got {scratch.numel()}")
    splits = (gu.SPLIT_K, dn.SPLIT_K) + ((sh2.SPLIT_K,) if ids2 is not None and not fuse2 else ())
    buf = scratch[:need]
    zeroed = any(s > 1 for s in splits)
    if zeroed:  # atomics add into zeros; single-split launches store every element
        buf.zero_()
    h = buf[: P * 2 * I].view(P, 2 * I)
    o = P * 2 * I
    y = buf[o : o + P * H].view(P, H)
    o += P * H
    inter13 = buf[o : o + P * S * split13 * R].view(P, S, split13, R)
    o += P * S * split13 * R
    inter2 = buf[o : o + P * R].view(P, R)
    ids = topk_ids.reshape(-1)
    # Expert order only matters when pairs of several tokens can share an expert (the second read of its
    # weights then hits L2); one token's pairs are read in place, saving the sort's launches.
    ordered = T > 1
    order = torch.argsort(ids, stable=True) if ordered else ids
    tw = topk_weights.reshape(-1)
    g_dt = _TL[x.dtype]
    has_bias = b13 is not None
    dummy = h
    if ids13 is not None:
        _gemv_shrink_kernel[(P, S, split13)](
            x, dummy, a13, inter13, ids, ids13, inter2, H, E, K, L, R,
            x.stride(0), 0, a13.stride(0), a13.stride(1), a13.stride(2), a13.stride(3),
            inter13.stride(0), inter13.stride(1), inter13.stride(2), inter2.stride(0),
            BLOCK_SIZE_R=r_p, BLOCK_SIZE_K=sh13.BLOCK_SIZE_K, SPLIT_K=split13, ACT_INPUT=False,
            HAS_BIAS=False, ACTIVATION=activation, G_DTYPE=g_dt, PARTIALS=True, ZERO=fuse2 and not zeroed,
            num_warps=sh13.NUM_WARPS,
        )  # fmt: skip
        l13 = (ids13, inter13, bl13, L, (2 * I) // S, inter13.stride(0), inter13.stride(1), inter13.stride(2),
               bl13.stride(0), bl13.stride(1), bl13.stride(2), bl13.stride(3))  # fmt: skip
    else:
        if fuse2 and not zeroed:
            inter2.zero_()
        l13 = (ids, dummy, dummy, L, 1, 0, 0, 0, 0, 0, 0, 0)
    if fuse2:
        f2 = (ids2, a2, inter2, b13.stride(0) if has_bias else 0, a2.stride(0), a2.stride(1), a2.stride(2),
              inter2.stride(0))  # fmt: skip
        gu_cols = triton.cdiv(I, gu.BLOCK_SIZE_N // 2)
    else:
        f2 = (ids, dummy, dummy, 0, 0, 0, 0, 0)
        gu_cols = triton.cdiv(2 * I, gu.BLOCK_SIZE_N)
    _gemv_gate_up_kernel[(P * gu.SPLIT_K, gu_cols)](
        x, w13a[0], w13a[1], h, order, ids, l13[0], l13[1], l13[2],
        b13 if has_bias else dummy, f2[0], f2[1], f2[2],
        2 * I, H, E, K, l13[3], l13[4], R, I,
        x.stride(0), w13a[2], w13a[3], w13a[4], w13a[5], h.stride(0), *l13[5:], *f2[3:],
        BLOCK_SIZE_N=gu.BLOCK_SIZE_N, BLOCK_SIZE_K=gu.BLOCK_SIZE_K, SPLIT_K=gu.SPLIT_K, MXFP4=w13a[6],
        HAS_LORA=ids13 is not None, BLOCK_SIZE_R=r_p, SHRINK_SPLITS=split13, FUSE_SHRINK2=fuse2,
        HAS_BIAS=has_bias, ACTIVATION=activation, G_DTYPE=g_dt, **w13a[7], ORDERED=ordered,
        num_warps=gu.NUM_WARPS,
    )  # fmt: skip
    if ids2 is not None and not fuse2:
        _gemv_shrink_kernel[(P, 1, sh2.SPLIT_K)](
            h, b13 if has_bias else dummy, a2, inter2, ids, ids2, dummy, I, E, K, L, R,
            h.stride(0), b13.stride(0) if has_bias else 0, a2.stride(0), a2.stride(1), 0, a2.stride(2),
            inter2.stride(0), 0, 0, 0,
            BLOCK_SIZE_R=r_p, BLOCK_SIZE_K=sh2.BLOCK_SIZE_K, SPLIT_K=sh2.SPLIT_K, ACT_INPUT=True,
            HAS_BIAS=has_bias, ACTIVATION=activation, G_DTYPE=g_dt, PARTIALS=False, ZERO=False,
            num_warps=sh2.NUM_WARPS,
        )  # fmt: skip
    if ids2 is not None:
        l2 = (ids2, inter2, bl2, L, inter2.stride(0), bl2.stride(0), bl2.stride(1), bl2.stride(2))
    else:
        l2 = (ids, dummy, dummy, 0, 0, 0, 0, 0)
    _gemv_down_kernel[(P * dn.SPLIT_K, triton.cdiv(H, dn.BLOCK_SIZE_N))](
        h, b13 if has_bias else dummy, w2a[0], w2a[1], b2 if has_bias else dummy, tw, y, order, ids,
        l2[0], l2[1], l2[2], H, I, E, K, l2[3], R,
        h.stride(0), b13.stride(0) if has_bias else 0, w2a[2], w2a[3], w2a[4], w2a[5],
        b2.stride(0) if has_bias else 0, y.stride(0), *l2[4:],
        BLOCK_SIZE_N=dn.BLOCK_SIZE_N, BLOCK_SIZE_K=dn.BLOCK_SIZE_K, SPLIT_K=dn.SPLIT_K, MXFP4=w2a[6],
        HAS_BIAS=has_bias, ACTIVATION=activation, G_DTYPE=g_dt, HAS_LORA=ids2 is not None,
        BLOCK_SIZE_R=r_p, **w2a[7], ORDERED=ordered, num_warps=dn.NUM_WARPS,
    )  # fmt: skip
    return topk_reduce(
        y, topk_ids, E, lora_ids, L_ids, check_ids=True, out=out, out_dtype=x.dtype, skip_remote=skip_remote
    )


@dataclass(frozen=True)
class GemvStage(Stage):
    """Stage ``gemv``: :func:`gemv_moe_lora` for calls of at most :data:`GEMV_MAX_PAIRS` (token, k) pairs.

    Not a set of switches over :class:`~moelora_lib.kernels.stages.LayerRun`'s launches (it has its own,
    module docstring), so it is not in :data:`~moelora_lib.kernels.STAGES` (the studies that sweep every
    stage skip it); ``stage="auto"`` picks it where the config files say so, and ``stage="gemv"`` runs it
    explicitly (ValueError above the pair limit)."""

    def config_for(self, dims: Dims, folder=None, gpu_name: str | None = None) -> LayerConfig:
        """:func:`moelora_lib.configs.load_gemv_config` for ``dims``."""
        from ..configs import load_gemv_config  # lazy: loaded on the first config lookup

        return load_gemv_config(dims, folder=folder, gpu_name=gpu_name)

    def adapt(self, cfg: LayerConfig) -> LayerConfig:
        """The config as given: every field the GEMVs read is honoured (SPLIT_K included)."""
        return cfg


STAGE = GemvStage(
    name="gemv",
    title="split-K GEMVs per (token, k) pair, LoRA in the epilogues (decode)",
    specialize_lengths=False,
    split_k=True,
    fused_add=True,
)


class GemvRun:
    """One validated stage-``gemv`` layer call, built once and run by ``run()`` (what
    :func:`moelora_lib.moe_lora.make_layer_run` returns for stage ``gemv``, beside the
    :class:`~moelora_lib.kernels.LayerRun` of the other stages).

    ``run()`` computes the layer (every slot covers both projections: a slot's zero B adds nothing);
    :meth:`base_part` the base MoE alone (no LoRA launch). Arguments as :func:`moelora_lib.fused_moe_lora`
    (already validated), ``config`` the stage's LayerConfig. Raises ValueError for more than
    :data:`GEMV_MAX_PAIRS` (token, k) pairs.
    """

    stage = STAGE

    def __init__(self, hidden_states, w13, w2, topk_weights, topk_ids, lora_ids, lora_a13, lora_b13, lora_a2,
                 lora_b2, *, activation: str, config: LayerConfig, b13=None, b2=None):  # fmt: skip
        T, K = topk_ids.shape
        if T * K > GEMV_MAX_PAIRS:
            raise ValueError(
                f"stage 'gemv' takes at most {GEMV_MAX_PAIRS} (token, k) pairs per call, "
                f"got T·top_k = {T}·{K}"
            )
        self.x, self.w13, self.w2 = hidden_states, w13, w2
        self.topk_w = topk_weights.float().contiguous()
        self.topk_ids, self.lora_ids = topk_ids.contiguous(), lora_ids
        self.lora = (lora_a13, lora_b13, lora_a2, lora_b2)
        self.activation, self.cfg, self.b13, self.b2 = activation, config, b13, b2

    def _run(self, with_lora: bool) -> torch.Tensor:
        lora = None
        if with_lora and self.lora[0].shape[0] > 0:
            lora = (self.lora_ids, self.lora_ids, *self.lora)
        return gemv_moe_lora(
            self.x, self.w13, self.w2, self.topk_w, self.topk_ids, activation=self.activation,
            config=self.cfg,
            b13=self.b13, b2=self.b2, lora_ids=self.lora_ids if with_lora else None, lora=lora,
        )  # fmt: skip

    def __call__(self) -> torch.Tensor:
        return self._run(True)

    def base_part(self) -> torch.Tensor:
        """The base MoE alone (the LoRA launches left out), [T, H]."""
        return self._run(False)

    def lora_part(self) -> None:
        """Not a set of launches here (the expands run inside the GEMVs): ValueError."""
        raise ValueError("stage gemv: the LoRA part is not a set of launches (time the layer and base_part)")

    @property
    def dims(self) -> Dims:
        """The sizes of this call."""
        a13 = self.lora[0]
        T, H = self.x.shape
        return Dims(T=T, H=H, I=self.w2.shape[2], E=self.w13.shape[0], top_k=self.topk_ids.shape[1],
                    adapters=a13.shape[0], rank=a13.shape[3], slices=a13.shape[2],
                    weight_format=config_weight_format(self.w13))  # fmt: skip
