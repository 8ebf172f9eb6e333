"""The Triton kernels of the MoE + multi-LoRA layer (one source for every stage).

Each stage of the notebook suite switches features of these kernels on with constexpr flags, so two
stages differ only by what the stage changes (see ``moelora_lib/kernels/stages.py``):

* ``_fused_moe_kernel``   base grouped GEMM: out[p] = x[p // rows_div]·W[e]ᵀ (+ b[e]) (· w[p])
* ``_lora_shrink_kernel`` inter[s, p] = x[p // rows_div]·A[l, e, s]ᵀ   (rank intermediate, fp32)
* ``_lora_expand_kernel`` out[p, s·N:(s+1)·N] (+)= inter[s, p]·B[l, e, s]ᵀ (· w[p])
* ``_gated_act_kernel``   silu(gate)·up or GPT-OSS swigluoai over [P, 2I] -> [P, I]

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

Precision. Every dot accumulates in fp32. The rank intermediate ``inter`` (x·Aᵀ, g·A2ᵀ) is
accumulated and stored in fp32, and the expand's dot reads it in a form chosen at compile time from
the dtype of B:

* bf16: rounded to bf16 (fp32's exponent range, 7-bit mantissa), bf16 tensor-core dot;
* fp16: kept in fp32, with B widened to fp32 (exactly), dot at Triton's default input_precision,
  tf32 on the GPU (fp32's range, fp16's 10-bit mantissa). fp16 ends at 65 504, so rounding the
  intermediate to fp16 made an intermediate beyond it inf although the fp32 math is finite (issue 10);
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
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
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
    w_ptrs = w_ptr + expert * stride_we + offs_n_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            wa = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_SIZE_K
            xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            wa = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
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
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        out = (up + 1.0) * gate / (1.0 + tl.exp(-1.702 * gate))
    tl.store(out_ptr + row * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


# Arguments whose values follow the prompt length (vLLM #27445 marked the same kind of arguments).
LENGTH_ARGS = {
    "fused_moe": ["num_pairs", "num_blocks"],
    "lora_shrink": ["num_pairs", "num_blocks", "stride_os"],
    "lora_expand": ["num_pairs", "num_blocks", "stride_is"],
    "gated_act": ["n_rows"],
}
_SRC = {
    "fused_moe": _fused_moe_kernel,
    "lora_shrink": _lora_shrink_kernel,
    "lora_expand": _lora_expand_kernel,
    "gated_act": _gated_act_kernel,
}

#: KERNELS[name][specialize_lengths] -> the jitted kernel. ``True`` is Triton's default behaviour
#: (integers specialized on == 1 and % 16), ``False`` adds do_not_specialize on LENGTH_ARGS[name].
KERNELS = {
    name: {True: triton.jit(fn), False: triton.jit(fn, do_not_specialize=LENGTH_ARGS[name])}
    for name, fn in _SRC.items()
}
