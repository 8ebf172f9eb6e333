"""The Triton kernels of the MoE + multi-LoRA layer (one source for every stage).

Each stage of the notebook suite switches features of these kernels on with constexpr flags, so two
stages differ only by what the stage changes (see ``moelora_lib/kernels/stages.py``):

* ``_fused_moe_kernel``   base grouped GEMM: out[p] = x[p // rows_div]·W[e]ᵀ (+ b[e]) (· w[p])
* ``_lora_shrink_kernel`` inter[s, p] = x[p // rows_div]·A[l, e, s]ᵀ   (rank intermediate, fp32)
* ``_lora_expand_kernel`` out[p, s·N:(s+1)·N] (+)= inter[s, p]·B[l, e, s]ᵀ (· w[p])
* ``_gated_act_kernel``   silu(gate)·up or GPT-OSS swigluoai over [P, 2I] -> [P, I]
* ``_fused_moe_lora_act_kernel`` / ``_fused_moe_lora_kernel`` (stage ``fused``): the base GEMM with the LoRA
  expand inside, gate_up also with the activation (writes [P, I]); down with the routing weight

p is a (token, k) pair index t·K + k taken from an :class:`~moelora_lib.routing.Alignment`; every
BLOCK_SIZE_M block of the alignment has one expert e (and one adapter l for the LoRA ops).

Features switched by the stages:

* specialization: every kernel exists twice, once plain and once with ``do_not_specialize`` on the
  arguments that follow the prompt length (num_pairs, num_blocks, length-dependent strides), the fix
  of vLLM PR #27445 (Triton specializes ints on == 1 and % 16 == 0, so new lengths recompiled);
* ``SPLIT_K`` (shrink): SPLIT_K programs share one output tile, each taking the K-chunks
  s, s + SPLIT_K, ... and combining with ``tl.atomic_add(sem="relaxed")`` into a zeroed fp32 buffer;
* ``GROUP_SIZE_M``: grouped program order (Triton matmul tutorial "L2 cache optimizations"):
  GROUP_SIZE_M consecutive M-blocks are visited for one N column before moving on, so neighbouring
  programs reuse the same weight tile from L2; 1 = plain row-major order;
* ``EVEN_K``: K % (BLOCK_SIZE_K·SPLIT_K) == 0, the K loop loads without masks (rows and columns are
  clamped into range instead, their results are never stored); else masked loads;
* ``ADD_INPUTS`` (expand): add the delta into the tile already in ``out`` (no delta buffer).
* ``W_MXFP4`` (the three base GEMM kernels): the expert weight is packed MXFP4 instead of a dense
  [E, N, K] tensor — ``w_ptr`` the e2m1 codes ``blocks`` uint8 [E, N, K/32, 16] (two per byte, low
  nibble first; the last two dims contiguous, so byte K/2-index b of a row is at b·stride_wk) and
  ``ws_ptr`` the e8m0 ``scales`` uint8 [E, N, K/32] (:mod:`moelora_lib.quant.mxfp4`; OCP Microscaling
  Formats v1.0, the layout of the published GPT-OSS checkpoints). Each K step loads [BLOCK_SIZE_K/2,
  BLOCK_SIZE_N] bytes (K down the rows, the order the dot takes) and [BLOCK_SIZE_K/32, BLOCK_SIZE_N]
  scales, decodes them elementwise in registers (:func:`_mxfp4_w`: bit operations, no lookup table)
  into the fp32 weights of the even and of the odd K (low and high nibbles), rounds them once to the
  activations' dtype and adds two dots, x_even·W_lo + x_odd·W_hi (:func:`_mxfp4_dot`, fp32
  accumulation): the dense path's products, summed in another order. BLOCK_SIZE_K must be a multiple
  of 32 (the launchers check it); K is one by construction, so with EVEN_K False a byte or a scale is
  in range exactly when its first element is.
* ``W_FP8`` (the three base GEMM kernels): the expert weight is block-scaled FP8
  (:class:`~moelora_lib.quant.FP8BlockWeight`) — ``w_ptr`` float8_e4m3fn [E, N, K] with the dense
  weight's strides and ``ws_ptr`` its ``scale_inv`` (fp32/bf16/fp16) [E, ceil(N/fp8_bn), ceil(K/fp8_bk)],
  one scale per fp8_bn x fp8_bk block. Each K step loads the e4m3 tile as the dense path loads its
  weight tile, and per tile column n the scale of block (n // fp8_bn, k0 // fp8_bk) (a [BLOCK_SIZE_N]
  gather, so any BLOCK_SIZE_N works); fp32(code)·fp32(scale) rounded once to the activations' dtype,
  exactly :func:`~moelora_lib.quant.dequantize_fp8_block` in that dtype, then the same tl.dot.
  BLOCK_SIZE_K must divide fp8_bk (one scale column per K step; the launchers check it).
* ``A_FP8`` (with ``W_FP8``, the three base GEMM kernels): W8A8, the block-FP8 scheme of the DeepSeek-V3
  report (§3.3) — the activations are FP8 too, quantized per row and group of ``act_group`` columns by
  :func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act`: ``x_ptr`` float8_e4m3fn [rows, K] and ``xs_ptr``
  its float32 scales [rows, ceil(K/act_group)] (row r of x, group j at r·stride_xsm + j·stride_xsk). Each
  K step is one FP8 × FP8 tl.dot into a fresh fp32 partial (tensor cores at twice the bf16 rate on
  Hopper), multiplied by the row's activation scale and the column's weight block scale and added to
  the fp32 accumulator (:func:`_fp8_dot_scaled`): the partial sums BLOCK_SIZE_K products (at most the
  128 columns of the published checkpoints' scale blocks) before it is promoted to the fp32
  accumulator, the promotion interval DeepSeek-V3 gives for Hopper's limited-precision FP8
  accumulation (Triton lets an sm_90 FP8 dot accumulate imprecisely over its whole K). BLOCK_SIZE_K
  must be at least 32 (an FP8 dot's K) and divide act_group and fp8_bk (one scale column of each per K
  step; the launchers check it). On sm_90 the FP8 dot is a wgmma on e4m3 operands
  when BLOCK_SIZE_M ≥ 64 (a warpgroup's rows); a smaller tile makes Triton widen both operands to fp16
  (exact) for mma.sync — the same numbers at the 16-bit rate, one reason W8A8 is for prefill sizes.
  vLLM's ``fused_moe_kernel`` with ``use_fp8_w8a8`` and a block shape does the same per-step scaling. The
  epilogue (bias, LoRA delta, activation, routing weight) and the output dtype are those of the other
  paths.
* ``HAS_LORA`` (stage ``fused``: ``_fused_moe_lora_act_kernel`` for gate_up, ``_fused_moe_lora_kernel``
  for down): the LoRA expand runs inside the base GEMM's program. The tile iterates over the base
  (expert-only) alignment; after the K loop it reads each row's adapter id (``lora_ids[p // top_k]``)
  and, once per adapter l present in the tile, runs one dot inter[p]·B[l, e]ᵀ over the tile's rows
  and selects its result into the same fp32 accumulator for the rows of l only (the other rows keep
  theirs, so a non-finite value in one adapter's weights stays in that adapter's rows), so ``h``/``y``
  is written once (no expand launch, no read-modify-write).
  The gate_up kernel also applies the activation in its epilogue (two accumulators: gate and up
  columns) and writes ``g`` [P, I] directly (no ``h`` buffer, no activation launch). Its rank
  intermediate is laid out [P, S, R16] (R rounded up to 16), so no stride depends on the length.

Precision. Every dot accumulates in fp32. The rank intermediate ``inter`` (x·Aᵀ, g·A2ᵀ) is
accumulated and stored in fp32, and the expand's dot reads it in a form chosen at compile time from
the dtype of B:

* bf16: rounded to bf16 (fp32's exponent range, 7-bit mantissa), bf16 tensor-core dot;
* fp16: kept in fp32, with B widened to fp32 (exactly), dot at Triton's default input_precision,
  tf32 on the GPU (fp32's range, fp16's 10-bit mantissa). fp16 ends at 65 504, so rounding the
  intermediate to fp16 would turn an intermediate beyond it into inf although the fp32 math is finite;
* fp32: fp32 operands (tf32 on the GPU).

Only the expand's result (the delta, or tile + delta with ``ADD_INPUTS``) is rounded to the output's
dtype.

Kernels are the project's own; the structure (pair gather through sorted_token_ids, per-block
expert/adapter ids, split-K atomics, grouped ordering) follows vLLM's fused_moe_kernel and
_fused_moe_lora_kernel (vllm/model_executor/layers/fused_moe/fused_moe.py,
vllm/lora/ops/triton_ops/fused_moe_lora_op.py) as described in docs/upstream-vllm-moe-lora.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: 2^126: an e2m1 code placed in fp32 bits (exponent field 0 or 1–3) reads as its value times 2^-126.
_TWO_POW_126 = tl.constexpr(2.0**126)


@triton.jit
def _pid_to_mn(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """Grouped ordering of a flat program id into (pid_m, pid_n); GROUP_SIZE_M = 1 is row-major."""
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)  # the last group may be partial
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _mxfp4_w(wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K: tl.constexpr):
    """(W_lo, W_hi), fp32 [BLOCK_SIZE_K/2, BLOCK_SIZE_N]: the weights of one K step of a packed MXFP4
    weight at elements k0 + 2j (low nibbles) and k0 + 2j + 1 (high nibbles), decoded elementwise from
    the bytes in the orientation they are loaded in. ``wq_ptrs`` [BLOCK_SIZE_K/2, BLOCK_SIZE_N] point
    to the packed bytes (rows ``offs_kb``: byte j of a weight row holds element 2j in its low nibble and
    2j + 1 in its high nibble; a row's bytes are contiguous, so the tile loads along memory in [K, N]
    order), ``ws_ptrs`` [BLOCK_SIZE_K/32, BLOCK_SIZE_N] to the e8m0 scales (rows ``offs_ks``), each
    repeated over its 16 bytes. Without EVEN_K the bytes and scales at or beyond ``k_left`` elements
    read 0 (weights 0, never NaN; K is a multiple of 32, so a byte or a scale is in range exactly when
    its first element is).

    W = e2m1(code)·2^(s − 127), exactly :func:`moelora_lib.quant.mxfp4.dequantize_mxfp4` in fp32 for
    every code and every scale byte (IEEE arithmetic, no flush to zero). Decoding with bit operations
    (OCP Microscaling Formats v1.0, FP4 e2m1: sign bit 3, exponent bits 1–2 with bias 1, mantissa bit
    0): a code's bits placed in an fp32 pattern — sign at bit 31, exponent and mantissa at bits 22–24 —
    read as e2m1(code)·2^−126 exactly (exponent 0 becomes an fp32 subnormal: 0 or 0.5·2^−126); times
    2^126 it is the e2m1 value. The scale's power of two is built as fp32 bits: byte s in the exponent
    field (s << 23) is 2^(s − 127) for s = 1–254 and +inf for 255 (the OCP NaN byte; like the
    reference, codes ±0 then give NaN and the others ±inf); byte 0 is the subnormal 2^−127 (bit 22).
    The product is exact (an e2m1 value has two significant bits) unless it leaves fp32's range (scale
    bytes ≥ 253 with large codes: ±inf, as in the reference). The two factors are two multiplies: their
    product 2^(s − 1) is beyond fp32's range for s > 128."""
    if EVEN_K:
        q = tl.load(wq_ptrs)
        s = tl.load(ws_ptrs)
    else:
        q = tl.load(wq_ptrs, mask=(2 * offs_kb)[:, None] < k_left, other=0)
        s = tl.load(ws_ptrs, mask=(32 * offs_ks)[:, None] < k_left, other=0)
    q = q.to(tl.uint32)
    s = s.to(tl.int32)
    sf = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    sf = tl.reshape(tl.broadcast_to(sf[:, None, :], (sf.shape[0], 16, sf.shape[1])), q.shape)  # per byte
    lo = (((q & 8) << 28) | ((q & 7) << 22)).to(tl.float32, bitcast=True) * _TWO_POW_126
    hi = (((q & 128) << 24) | ((q & 112) << 18)).to(tl.float32, bitcast=True) * _TWO_POW_126
    return lo * sf, hi * sf


@triton.jit
def _mxfp4_dot(acc, xa, wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K: tl.constexpr):
    """``acc`` + xa·W[e]ᵀ over one K step of a packed MXFP4 weight, as two dots in the weight's own
    order: x_even·W_lo + x_odd·W_hi (W_lo, W_hi of :func:`_mxfp4_w`, rounded once to the activations'
    dtype: exact wherever finite there, e2m1·2^k). ``xa`` [BLOCK_SIZE_M, BLOCK_SIZE_K] is the step's
    activations, loaded as on the dense path (out-of-range columns 0); x_even / x_odd are its columns
    k0 + 2j / k0 + 2j + 1. The weight tile is never interleaved, reshaped or transposed; the
    activations (BLOCK_SIZE_M rows against the weight's BLOCK_SIZE_N) are split instead, in registers,
    so their load stays one contiguous, pipelined copy (loads of x_even / x_odd through strided
    pointers would be 2-byte gathers). The sum runs in another order than the dense dot over the
    interleaved columns, so it equals the dense layer's result within rounding, not bit for bit."""
    lo, hi = _mxfp4_w(wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
    xe, xo = tl.split(tl.reshape(xa, (xa.shape[0], xa.shape[1] // 2, 2)))
    return tl.dot(xo, hi.to(xa.dtype), tl.dot(xe, lo.to(xa.dtype), acc))


@triton.jit
def _fp8_scale(wa, s_ptrs, k, stride_sk, fp8_bk, BLOCK_SIZE_K: tl.constexpr, dtype: tl.constexpr):
    """The e4m3 tile ``wa`` [BLOCK_SIZE_K, BLOCK_SIZE_N] of K step ``k`` dequantized in ``dtype``:
    fp32(wa)·fp32(scale) rounded once, the scale of each column read at ``s_ptrs`` [BLOCK_SIZE_N] (its
    block row) plus the block column (k·BLOCK_SIZE_K) // fp8_bk (BLOCK_SIZE_K divides fp8_bk)."""
    s = tl.load(s_ptrs + ((k * BLOCK_SIZE_K) // fp8_bk) * stride_sk)
    return (wa.to(tl.float32) * s.to(tl.float32)[None, :]).to(dtype)


@triton.jit
def _fp8_dot_scaled(acc, xa, wa, xs_ptrs, s_ptrs, k, stride_xsk, stride_sk, act_group, fp8_bk,
                    BLOCK_SIZE_K: tl.constexpr):  # fmt: skip
    """``acc`` + (xa·wa)·a_s·w_s for K step ``k`` of a W8A8 GEMM: ``xa`` e4m3 [BLOCK_SIZE_M, BLOCK_SIZE_K],
    ``wa`` e4m3 [BLOCK_SIZE_K, BLOCK_SIZE_N], their FP8 dot into a fresh fp32 partial, multiplied by each
    row's activation scale (``xs_ptrs`` [BLOCK_SIZE_M] plus group column (k·BLOCK_SIZE_K) // act_group)
    and each column's weight block scale (``s_ptrs`` [BLOCK_SIZE_N] plus block column
    (k·BLOCK_SIZE_K) // fp8_bk), added to the fp32 ``acc`` (BLOCK_SIZE_K divides both)."""
    k0 = k * BLOCK_SIZE_K
    a_s = tl.load(xs_ptrs + (k0 // act_group) * stride_xsk)
    w_s = tl.load(s_ptrs + (k0 // fp8_bk) * stride_sk).to(tl.float32)
    return acc + tl.dot(xa, wa) * a_s[:, None] * w_s[None, :]


def _fused_moe_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_post_ptr,
    num_pairs,
    num_blocks,
    N,
    K,
    rows_div,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_be,
    stride_bn,
    ws_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    fp8_bn,
    fp8_bk,
    xs_ptr,
    stride_xsm,
    stride_xsk,
    act_group,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    W_MXFP4: tl.constexpr = False,
    W_FP8: tl.constexpr = False,
    A_FP8: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    x_row = tl.where(row_mask, pair // rows_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if W_MXFP4:  # packed bytes [N, K/2] and scales [N, K/32] of expert e, decoded per K step
        offs_kb = tl.arange(0, BLOCK_SIZE_K // 2)
        offs_ks = tl.arange(0, BLOCK_SIZE_K // 32)
        wq_ptrs = w_ptr + expert * stride_we + offs_kb[:, None] * stride_wk + offs_n_ld[None, :] * stride_wn
        ws_ptrs = ws_ptr + expert * stride_se + offs_ks[:, None] * stride_sk + offs_n_ld[None, :] * stride_sn
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            k_left = K - k * BLOCK_SIZE_K
            if EVEN_K:
                xa = tl.load(x_ptrs)
            else:
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            acc = _mxfp4_dot(acc, xa, wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            wq_ptrs += (BLOCK_SIZE_K // 2) * stride_wk
            ws_ptrs += (BLOCK_SIZE_K // 32) * stride_sk
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_n_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk
        s_ptrs = ws_ptr + expert * stride_se + (offs_n_ld // fp8_bn) * stride_sn  # W_FP8: scale rows
        xs_ptrs = xs_ptr + x_row * stride_xsm  # A_FP8: the rows' activation scales
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            if EVEN_K:
                xa = tl.load(x_ptrs)
                wa = tl.load(w_ptrs)
            else:
                k_left = K - k * BLOCK_SIZE_K
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                wa = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if A_FP8:
                acc = _fp8_dot_scaled(
                    acc, xa, wa, xs_ptrs, s_ptrs, k, stride_xsk, stride_sk, act_group, fp8_bk, BLOCK_SIZE_K
                )
            else:
                if W_FP8:
                    wa = _fp8_scale(wa, s_ptrs, k, stride_sk, fp8_bk, BLOCK_SIZE_K, xa.dtype)
                acc = tl.dot(xa, wa, acc)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            w_ptrs += BLOCK_SIZE_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        wt = tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * wt[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    block_lora_ptr,
    num_post_ptr,
    num_pairs,
    num_blocks,
    N,
    K,
    rows_div,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_as,
    stride_an,
    stride_ak,
    stride_os,
    stride_om,
    stride_on,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    slice_id = tl.program_id(1)
    pid_sk = pid % SPLIT_K
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid // SPLIT_K, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    lora = tl.load(block_lora_ptr + pid_m).to(tl.int64)
    if lora < 0:
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    x_row = tl.where(row_mask, pair // rows_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_k = pid_sk * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_base = a_ptr + lora * stride_al + expert * stride_ae + slice_id * stride_as
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if EVEN_K:
        offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
        a_ptrs = a_base + offs_n_ld[None, :] * stride_an + offs_k[:, None] * stride_ak
        for _ in range(0, tl.cdiv(K, BLOCK_SIZE_K * SPLIT_K)):
            xa = tl.load(x_ptrs)
            aa = tl.load(a_ptrs)
            acc = tl.dot(xa, aa, acc)
            x_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_xk
            a_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_ak
    else:
        a_ptrs = a_base + offs_n.to(tl.int64)[None, :] * stride_an + offs_k[:, None] * stride_ak
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K * SPLIT_K)):
            k_left = K - k * (BLOCK_SIZE_K * SPLIT_K)
            xa = tl.load(x_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            aa = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
            acc = tl.dot(xa, aa, acc)
            x_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_xk
            a_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_ak
    out_ptrs = (
        out_ptr + slice_id * stride_os + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    )
    mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


def _lora_expand_kernel(
    inter_ptr,
    b_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    block_lora_ptr,
    num_post_ptr,
    num_pairs,
    num_blocks,
    N,
    K,
    stride_is,
    stride_im,
    stride_ik,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_bk,
    stride_om,
    stride_on,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):
    pid = tl.program_id(0)
    slice_id = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    lora = tl.load(block_lora_ptr + pid_m).to(tl.int64)
    if lora < 0:
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    i_row = tl.where(row_mask, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    i_ptrs = inter_ptr + slice_id * stride_is + i_row[:, None] * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = (
        b_ptr
        + lora * stride_bl
        + expert * stride_be
        + slice_id * stride_bs
        + offs_n_ld[None, :] * stride_bn
        + offs_k[:, None] * stride_bk
    )
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            ia = tl.load(i_ptrs)
            ba = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_SIZE_K
            ia = tl.load(i_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            ba = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
        # inter is fp32 (module docstring, "Precision"). fp16 ends at 65 504: with fp16 weights the
        # dot takes fp32 operands (tf32 on the GPU: fp32's range, fp16's 10-bit mantissa; K = rank
        # is small, so the halved tensor-core rate costs little). bf16 has fp32's exponent range:
        # inter is rounded to bf16 for a bf16 dot. A dtype comparison, resolved at compile time.
        if b_ptr.dtype.element_ty == tl.float16:
            acc = tl.dot(ia, ba.to(tl.float32), acc)
        else:
            acc = tl.dot(ia.to(ba.dtype), ba, acc)
        i_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        wt = tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * wt[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + (slice_id * N + offs_n)[None, :] * stride_on
    mask = row_mask[:, None] & n_mask[None, :]
    if ADD_INPUTS:
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        acc = acc + prev.to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swigluoai(gate, up):
    """GPT-OSS's gated activation of fp32 gate and up: (clamp(up, -7, 7) + 1)·g·sigmoid(1.702·g) with
    g = min(gate, 7). The clamps propagate NaN, as torch's clamp does: the GPU's plain min/max return
    the operand that is not NaN, which would turn a NaN pre-activation into a finite value."""
    gate = tl.minimum(gate, 7.0, propagate_nan=tl.PropagateNan.ALL)
    up = tl.maximum(up, -7.0, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(up, 7.0, propagate_nan=tl.PropagateNan.ALL)
    return (up + 1.0) * gate / (1.0 + tl.exp(-1.702 * gate))


def _gated_act_kernel(
    h_ptr,
    out_ptr,
    n_rows,
    I,
    stride_hm,
    stride_om,
    ACTIVATION: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < I
    if ACTIVATION == "silu":
        gate = tl.load(h_ptr + row * stride_hm + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_hm + I + offs, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:  # swigluoai: interleaved gate/up columns, GPT-OSS clamp 7.0 and alpha 1.702
        gate = tl.load(h_ptr + row * stride_hm + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_hm + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        out = _swigluoai(gate, up)
    tl.store(out_ptr + row * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_cols_dot(
    acc,
    inter_ptr,
    b_ptr,
    pair_ld,
    sel,
    lora,
    expert,
    cols,
    col_mask,
    R,
    NS,
    stride_im,
    stride_is,
    stride_ir,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_SIZE_R: tl.constexpr,
):
    """acc[sel] += inter[pair, s]·B[lora, expert, s, n]ᵀ for the columns ``cols`` of h / y; rows not in
    ``sel`` keep ``acc`` unchanged.

    Column c belongs to slice s = c // NS, row n = c % NS of B (NS = rows per slice). Usually every
    column of a tile is in one slice (one dot); a tile that straddles two slices (swigluoai with S = 2)
    takes one dot per slice, with the other slice's columns masked to zero. Rows not in ``sel`` never
    load the intermediate (masked to zero) and take the dot's result only through a select, so no value
    of this adapter's A or B (an inf or NaN included) reaches them. Precision as in the expand kernel:
    inter is fp32; bf16 weights: inter rounded to bf16; fp16 weights: B widened to fp32 (tf32 dot on
    the GPU). The rows of ``sel`` accumulate into ``acc`` inside the dot, as the expand kernel does.
    """
    offs_r = tl.arange(0, BLOCK_SIZE_R)
    r_mask = offs_r < R
    col_s = cols // NS
    col_n = (cols - col_s * NS).to(tl.int64)
    s_lo = tl.min(tl.where(col_mask, col_s, 1 << 30))
    s_hi = tl.max(tl.where(col_mask, col_s, -1))
    b_base = b_ptr + lora * stride_bl + expert * stride_be
    for s in range(s_lo, s_hi + 1):
        ia = tl.load(
            inter_ptr + pair_ld[:, None] * stride_im + s * stride_is + offs_r[None, :] * stride_ir,
            mask=sel[:, None] & r_mask[None, :],
            other=0.0,
        )
        bb = tl.load(
            b_base + s * stride_bs + col_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=r_mask[:, None] & (col_mask & (col_s == s))[None, :],
            other=0.0,
        )
        if b_ptr.dtype.element_ty == tl.float16:
            d = tl.dot(ia, bb.to(tl.float32), acc)
        else:
            d = tl.dot(ia.to(bb.dtype), bb, acc)
        # the dot gives every row of the tile ia[row]·B[lora]: a row of another adapter (ia = 0) would
        # get 0·NaN = NaN from a non-finite B, so only the rows of ``sel`` take the new value
        acc = tl.where(sel[:, None], d, acc)
    return acc


@triton.jit
def _row_adapters(lora_ids_ptr, pair_ld, row_mask, top_k, num_adapters):
    """Adapter id of each row's token (lora_ids[p // top_k]); -1 for padding rows and for ids
    outside [0, L) (no adapter: never indexes B)."""
    lid = tl.load(lora_ids_ptr + pair_ld // top_k, mask=row_mask, other=-1).to(tl.int32)
    return tl.where((lid >= 0) & (lid < num_adapters), lid, -1)


def _fused_moe_lora_act_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    inter_ptr,
    b_ptr,
    lora_ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_post_ptr,
    num_pairs,
    num_blocks,
    I,
    K,
    top_k,
    R,
    num_adapters,
    NS,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_ce,
    stride_cn,
    stride_im,
    stride_is,
    stride_ir,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_br,
    ws_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    fp8_bn,
    fp8_bk,
    xs_ptr,
    stride_xsm,
    stride_xsk,
    act_group,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    ACTIVATION: tl.constexpr,
    W_MXFP4: tl.constexpr = False,
    W_FP8: tl.constexpr = False,
    A_FP8: tl.constexpr = False,
):
    """g[p, j] = act(h[p, gate(j)], h[p, up(j)]) with h = x·W13[e]ᵀ + LoRA delta (+ b13[e]), one tile of
    BLOCK_SIZE_N columns j of g; gate(j), up(j) = j, I + j (silu) or 2j, 2j + 1 (swigluoai)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    pair_ld = tl.where(row_mask, pair, 0).to(tl.int64)
    x_row = pair_ld // top_k
    offs_j = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    j_mask = offs_j < I
    offs_j_ld = tl.where(j_mask, offs_j, 0).to(tl.int64)
    if ACTIVATION == "silu":  # [gate | up] halves
        gate_col = offs_j_ld
        up_col = offs_j_ld + I
    else:  # swigluoai: interleaved rows 2j (gate), 2j + 1 (up)
        gate_col = 2 * offs_j_ld
        up_col = gate_col + 1
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk
    acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if W_MXFP4:  # the gate and up rows of the packed W13[e], decoded per K step
        offs_kb = tl.arange(0, BLOCK_SIZE_K // 2)
        offs_ks = tl.arange(0, BLOCK_SIZE_K // 32)
        wq_base = w_ptr + expert * stride_we + offs_kb[:, None] * stride_wk
        ws_base = ws_ptr + expert * stride_se + offs_ks[:, None] * stride_sk
        wgq_ptrs = wq_base + gate_col[None, :] * stride_wn
        wuq_ptrs = wq_base + up_col[None, :] * stride_wn
        wgs_ptrs = ws_base + gate_col[None, :] * stride_sn
        wus_ptrs = ws_base + up_col[None, :] * stride_sn
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            k_left = K - k * BLOCK_SIZE_K
            if EVEN_K:
                xa = tl.load(x_ptrs)
            else:
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            acc_g = _mxfp4_dot(acc_g, xa, wgq_ptrs, wgs_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
            acc_u = _mxfp4_dot(acc_u, xa, wuq_ptrs, wus_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            wgq_ptrs += (BLOCK_SIZE_K // 2) * stride_wk
            wuq_ptrs += (BLOCK_SIZE_K // 2) * stride_wk
            wgs_ptrs += (BLOCK_SIZE_K // 32) * stride_sk
            wus_ptrs += (BLOCK_SIZE_K // 32) * stride_sk
    else:
        w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
        wg_ptrs = w_base + gate_col[None, :] * stride_wn
        wu_ptrs = w_base + up_col[None, :] * stride_wn
        s_base = ws_ptr + expert * stride_se  # W_FP8: the scale rows of the gate and up columns
        sg_ptrs = s_base + (gate_col // fp8_bn) * stride_sn
        su_ptrs = s_base + (up_col // fp8_bn) * stride_sn
        xs_ptrs = xs_ptr + x_row * stride_xsm  # A_FP8: the rows' activation scales
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            if EVEN_K:
                xa = tl.load(x_ptrs)
                wg = tl.load(wg_ptrs)
                wu = tl.load(wu_ptrs)
            else:
                k_left = K - k * BLOCK_SIZE_K
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if A_FP8:
                acc_g = _fp8_dot_scaled(
                    acc_g, xa, wg, xs_ptrs, sg_ptrs, k, stride_xsk, stride_sk, act_group, fp8_bk, BLOCK_SIZE_K
                )
                acc_u = _fp8_dot_scaled(
                    acc_u, xa, wu, xs_ptrs, su_ptrs, k, stride_xsk, stride_sk, act_group, fp8_bk, BLOCK_SIZE_K
                )
            else:
                if W_FP8:
                    wg = _fp8_scale(wg, sg_ptrs, k, stride_sk, fp8_bk, BLOCK_SIZE_K, xa.dtype)
                    wu = _fp8_scale(wu, su_ptrs, k, stride_sk, fp8_bk, BLOCK_SIZE_K, xa.dtype)
                acc_g = tl.dot(xa, wg, acc_g)
                acc_u = tl.dot(xa, wu, acc_u)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            wg_ptrs += BLOCK_SIZE_K * stride_wk
            wu_ptrs += BLOCK_SIZE_K * stride_wk
    if HAS_LORA:  # the expand of the gate_up LoRA, in this tile: one pass per adapter present
        lid = _row_adapters(lora_ids_ptr, pair_ld, row_mask, top_k, num_adapters)
        cur = tl.min(tl.where(lid >= 0, lid, num_adapters))
        while cur < num_adapters:
            sel = lid == cur
            lora = cur.to(tl.int64)
            acc_g = _lora_cols_dot(
                acc_g, inter_ptr, b_ptr, pair_ld, sel, lora, expert, gate_col, j_mask, R, NS,
                stride_im, stride_is, stride_ir, stride_bl, stride_be, stride_bs, stride_bn, stride_br,
                BLOCK_SIZE_R,
            )  # fmt: skip
            acc_u = _lora_cols_dot(
                acc_u, inter_ptr, b_ptr, pair_ld, sel, lora, expert, up_col, j_mask, R, NS,
                stride_im, stride_is, stride_ir, stride_bl, stride_be, stride_bs, stride_bn, stride_br,
                BLOCK_SIZE_R,
            )  # fmt: skip
            cur = tl.min(tl.where(lid > cur, lid, num_adapters))
    if HAS_BIAS:
        c_base = bias_ptr + expert * stride_ce
        acc_g += tl.load(c_base + gate_col * stride_cn, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(c_base + up_col * stride_cn, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "silu":
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:  # GPT-OSS clamp 7.0 and alpha 1.702, as _gated_act_kernel
        out = _swigluoai(acc_g, acc_u)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_j[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & j_mask[None, :])


def _fused_moe_lora_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    topk_w_ptr,
    inter_ptr,
    b_ptr,
    lora_ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_post_ptr,
    num_pairs,
    num_blocks,
    N,
    K,
    top_k,
    R,
    num_adapters,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_ce,
    stride_cn,
    stride_im,
    stride_is,
    stride_ir,
    stride_bl,
    stride_be,
    stride_bs,
    stride_bn,
    stride_br,
    ws_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    fp8_bn,
    fp8_bk,
    xs_ptr,
    stride_xsm,
    stride_xsk,
    act_group,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_R: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    W_MXFP4: tl.constexpr = False,
    W_FP8: tl.constexpr = False,
    A_FP8: tl.constexpr = False,
):
    """y[p] = (g[p]·W2[e]ᵀ + LoRA delta (+ b2[e]))·w[p] over the base alignment (rows are pairs).

    SPLIT_K > 1 (decode): program (pid, s) covers the K blocks s·KB/SPLIT_K … (s+1)·KB/SPLIT_K and adds
    its share times w[p] into a zeroed fp32 ``out`` with a relaxed atomic add; split 0 adds the LoRA
    delta and the bias (the sum is linear, so the shares add up to the unsplit row)."""
    pid = tl.program_id(0)
    if SPLIT_K > 1:
        pid_k = pid % SPLIT_K
        pid = pid // SPLIT_K
    else:
        pid_k = 0
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    pair_ld = tl.where(row_mask, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    num_k = tl.cdiv(K, BLOCK_SIZE_K)
    k_lo = (pid_k * num_k) // SPLIT_K
    k_hi = ((pid_k + 1) * num_k) // SPLIT_K
    x_ptrs = x_ptr + pair_ld[:, None] * stride_xm + (k_lo * BLOCK_SIZE_K + offs_k)[None, :] * stride_xk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if W_MXFP4:  # packed W2[e] from K block k_lo on, decoded per K step
        offs_kb = tl.arange(0, BLOCK_SIZE_K // 2)
        offs_ks = tl.arange(0, BLOCK_SIZE_K // 32)
        wq_ptrs = w_ptr + expert * stride_we + offs_n_ld[None, :] * stride_wn
        wq_ptrs += (k_lo * (BLOCK_SIZE_K // 2) + offs_kb)[:, None] * stride_wk
        ws_ptrs = ws_ptr + expert * stride_se + offs_n_ld[None, :] * stride_sn
        ws_ptrs += (k_lo * (BLOCK_SIZE_K // 32) + offs_ks)[:, None] * stride_sk
        for k in range(k_lo, k_hi):
            k_left = K - k * BLOCK_SIZE_K
            if EVEN_K:
                xa = tl.load(x_ptrs)
            else:
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            acc = _mxfp4_dot(acc, xa, wq_ptrs, ws_ptrs, offs_kb, offs_ks, k_left, EVEN_K)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            wq_ptrs += (BLOCK_SIZE_K // 2) * stride_wk
            ws_ptrs += (BLOCK_SIZE_K // 32) * stride_sk
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_n_ld[None, :] * stride_wn
        w_ptrs += (k_lo * BLOCK_SIZE_K + offs_k)[:, None] * stride_wk
        s_ptrs = ws_ptr + expert * stride_se + (offs_n_ld // fp8_bn) * stride_sn  # W_FP8: scale rows
        xs_ptrs = xs_ptr + pair_ld * stride_xsm  # A_FP8: the rows' activation scales
        for k in range(k_lo, k_hi):
            if EVEN_K:
                xa = tl.load(x_ptrs)
                wa = tl.load(w_ptrs)
            else:
                k_left = K - k * BLOCK_SIZE_K
                xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                wa = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if A_FP8:  # k counts from K block 0, so the split's scale columns are its own
                acc = _fp8_dot_scaled(
                    acc, xa, wa, xs_ptrs, s_ptrs, k, stride_xsk, stride_sk, act_group, fp8_bk, BLOCK_SIZE_K
                )
            else:
                if W_FP8:
                    wa = _fp8_scale(wa, s_ptrs, k, stride_sk, fp8_bk, BLOCK_SIZE_K, xa.dtype)
                acc = tl.dot(xa, wa, acc)
            x_ptrs += BLOCK_SIZE_K * stride_xk
            w_ptrs += BLOCK_SIZE_K * stride_wk
    if HAS_LORA and pid_k == 0:  # the expand of the down LoRA, in this tile (split 0 only)
        lid = _row_adapters(lora_ids_ptr, pair_ld, row_mask, top_k, num_adapters)
        cur = tl.min(tl.where(lid >= 0, lid, num_adapters))
        while cur < num_adapters:  # one pass per adapter present
            acc = _lora_cols_dot(
                acc, inter_ptr, b_ptr, pair_ld, lid == cur, cur.to(tl.int64), expert, offs_n_ld, n_mask,
                R, N, stride_im, stride_is, stride_ir, stride_bl, stride_be, stride_bs, stride_bn,
                stride_br, BLOCK_SIZE_R,
            )  # fmt: skip
            cur = tl.min(tl.where(lid > cur, lid, num_adapters))
    if HAS_BIAS and pid_k == 0:
        bias = tl.load(bias_ptr + expert * stride_ce + offs_n * stride_cn, mask=n_mask, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    wt = tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0)
    acc = acc * wt[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    if SPLIT_K > 1:
        tl.atomic_add(out_ptrs, acc, mask=row_mask[:, None] & n_mask[None, :], sem="relaxed")
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# Arguments whose values follow the prompt length (vLLM #27445 marked the same kind of arguments).
LENGTH_ARGS = {
    "fused_moe": ["num_pairs", "num_blocks"],
    "lora_shrink": ["num_pairs", "num_blocks", "stride_os"],
    "lora_expand": ["num_pairs", "num_blocks", "stride_is"],
    "gated_act": ["n_rows"],
    # stage fused: the shrink writes the [P, S, R16] intermediate, whose strides do not follow the
    # length (so only the counts are left unspecialized and the stores keep their 16-byte hint); the
    # fused GEMMs also leave the caller's lora_ids pointer unspecialized (an offset view of the ids
    # must not compile a second binary)
    "lora_shrink_rows": ["num_pairs", "num_blocks"],
    "fused_moe_lora_act": ["num_pairs", "num_blocks", "lora_ids_ptr"],
    "fused_moe_lora": ["num_pairs", "num_blocks", "lora_ids_ptr"],
}
_SRC = {
    "fused_moe": _fused_moe_kernel,
    "lora_shrink": _lora_shrink_kernel,
    "lora_expand": _lora_expand_kernel,
    "gated_act": _gated_act_kernel,
    "lora_shrink_rows": _lora_shrink_kernel,
    "fused_moe_lora_act": _fused_moe_lora_act_kernel,
    "fused_moe_lora": _fused_moe_lora_kernel,
}

#: KERNELS[name][specialize_lengths] -> the jitted kernel. ``True`` is Triton's default behaviour
#: (integers specialized on == 1 and % 16), ``False`` adds do_not_specialize on LENGTH_ARGS[name].
KERNELS = {
    name: {True: triton.jit(fn), False: triton.jit(fn, do_not_specialize=LENGTH_ARGS[name])}
    for name, fn in _SRC.items()
}
