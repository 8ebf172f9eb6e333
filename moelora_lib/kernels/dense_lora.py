"""Dense multi-LoRA kernels (SGMV-style): the LoRA part of ``y = x·Wᵀ (+ b) + Σ_s B_s[a]·(A_s[a]·x)``
for attention and dense-MLP projections, with one adapter slot a = lora_ids[t] per token.

Two Triton kernels, one launch each per projection whatever the number of output slices:

* ``_dense_shrink_kernel``: ``inter[t, s·R + r] = Σ_h x[t, h]·A[a, s, r, h]`` — the S slices' A
  matrices of slot a, stacked as one [S·R, H] matrix, in ONE GEMM of width S·R. x is read once for
  all slices (a grid with a slice axis, as vLLM's dense ``lora_shrink``, reads x once per slice).
  fp32 accumulation, fp32 result.
* ``_dense_expand_kernel``: ``out[t, n] (+)= Σ_r inter[t, s(n)·R + r]·B[a, n, r]`` where s(n) is the
  slice that holds output column n. Slices may have different widths (fused qkv with GQA: q 4096,
  k 512, v 512); their widths are a constexpr tuple ``SLICE_WIDTHS``, and the program's column tile
  index walks the slices (``tl.static_range`` over the tuple, resolved at compile time): slice s owns
  cdiv(N_s, BLOCK_SIZE_N) tiles, so a tile never straddles two slices and no program is spent on the
  padding of a narrow slice (with a slice axis of max_s cdiv(N_s, BN) tiles, as in vLLM's grid, 7
  of every 8 programs of k and v return at once for a 4096 + 512 + 512 qkv).

Tokens are grouped by adapter with the package's (adapter, expert) alignment taken with E = 1 and
top_k = 1 (:func:`moelora_lib.routing.align_tokens`, or on CUDA the Triton
:func:`~moelora_lib.kernels.align_small.align_tokens_pair` /
:func:`~moelora_lib.kernels.align.align_tokens_triton`): ``sorted_token_ids`` lists the tokens of
adapter 0, then adapter 1, ..., each run padded to BLOCK_SIZE_M with the sentinel T, and
``block_lora_ids`` gives each BLOCK_SIZE_M block its adapter; tokens without adapter (-1) are not in
it, so they cost no LoRA program at all. These are Punica's SGMV segments (Chen et al., "Punica:
Multi-Tenant LoRA Serving", arXiv:2310.18547): each segment is one adapter's tokens, and a program
handles a block of one segment, i.e. one adapter's weights against a tile of its tokens.

Layouts (and why). ``lora_a`` [L, S, R, H]: one A per slice (PEFT's ``lora_A.weight`` [r, in] of
q_proj, k_proj, v_proj), all of the same [R, H] shape, so stacking them costs nothing and the shrink
reads them as one [S·R, H] matrix. ``lora_b`` [L, N_total, R]: the slices' B matrices (PEFT's
``lora_B.weight`` [out_s, r]) concatenated along the output dimension exactly as the fused base
weight concatenates Wq, Wk, Wv, so row n of B[a] belongs to output column n: one pointer and one
set of strides for all slices, no padding of narrow slices to the widest (a padded [L, S, N_max, R]
layout holds 3·4096 rows instead of 5120 for a GQA qkv), and no per-slice pointer table (vLLM's
dense ops pass lists of per-slice tensors and build a device table of their data pointers, cached
by ``data_ptr``).

Switches, the same :class:`~moelora_lib.kernels.stages.Stage` fields as the MoE kernels
(:mod:`moelora_lib.kernels.triton_kernels`):

* ``specialize_lengths``: every kernel exists plain and with ``do_not_specialize`` on the arguments
  that follow the number of tokens (``num_tokens``, ``num_blocks``); no stride follows T here (the
  rank intermediate is [T, S·R], its row stride is S·R);
* ``split_k`` (shrink): SPLIT_K programs share one output tile, each taking the K chunks
  s, s + SPLIT_K, ... and adding their partial tile into a zeroed fp32 buffer with
  ``tl.atomic_add(sem="relaxed")``;
* ``swizzle``: GROUP_SIZE_M grouped program order (Triton matmul tutorial), for both kernels;
* ``even_k``: the K loop loads without masks when K % (BLOCK_SIZE_K·SPLIT_K) == 0 (padding rows read
  a real row — x's row 0 in the shrink, the block's first token in the expand, whose rank row the
  shrink wrote — and columns past the edge are clamped into range; neither is ever stored);
* ``fused_add`` (expand): add the delta into the output tile (the base ``F.linear`` result) it holds;
  without it the expand stores the delta into a buffer that a torch add puts into the output.

Precision: as the MoE kernels. Dots accumulate in fp32; the rank intermediate is kept in fp32; the
expand's dot takes it as bf16 with bf16 weights (fp32's exponent range), as fp32 with fp16 weights
(B widened exactly; tf32 on the GPU, so an intermediate beyond fp16's 65 504 does not overflow) and
fp32 with fp32 weights. Only the expand's result is rounded to the output dtype, once.

Design references: vLLM's ``vllm/lora/ops/triton_ops/lora_shrink_op.py`` / ``lora_expand_op.py``
(split-K with relaxed atomics, EVEN_K, grouped order, ADD_INPUTS; docs/upstream-vllm-moe-lora.md §5)
and Punica's SGMV. The code is this project's own.

Configs: :class:`~moelora_lib.configs.schema.DenseLoRAConfig` (one
:class:`~moelora_lib.configs.schema.OpConfig` per kernel, sharing BLOCK_SIZE_M, the alignment's block
size) and :func:`~moelora_lib.configs.defaults.default_dense_config` (hand-picked H200 starting points
by T; both re-exported here). Stage ``tuned`` reads tuned configs (:func:`dense_config_for` ->
:func:`moelora_lib.configs.load_dense_config`: vLLM's dense ``{gpu}_SHRINK.json`` /
``{gpu}_EXPAND_TRUE.json`` files, same folders and precedence as the MoE configs) written by
:mod:`moelora_lib.studies.dense_tuning`, and falls back to the defaults where there are none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import aligned16
from ..configs import load_dense_config, tuned_dense_block_sizes_m
from ..configs.defaults import default_dense_config, dense_block_sizes_m
from ..configs.schema import DenseLoRAConfig, OpConfig
from ..routing import Alignment
from .launchers import even_k
from .triton_kernels import _pid_to_mn

__all__ = [
    "DenseLoRAConfig",
    "default_dense_config",
    "dense_block_sizes_m",
    "adapt_dense_config",
    "dense_config_for",
    "dense_block_sizes_for",
    "DENSE_KERNELS",
    "DENSE_LENGTH_ARGS",
    "DenseLaunch",
    "dense_shrink_args",
    "dense_expand_args",
    "dense_shrink",
    "dense_expand",
    "dense_lora_add",
    "dense_launches",
    "num_column_tiles",
]


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _slice_tile(pid_n, SLICE_WIDTHS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """(slice id, first column, end column of its slice) of column tile pid_n, where slice s owns
    cdiv(SLICE_WIDTHS[s], BLOCK_SIZE_N) consecutive tiles (compile-time tile bounds: no tile straddles two
    slices)."""
    slice_id = 0
    col0 = 0
    col_end = SLICE_WIDTHS[0]
    tile_start = 0
    slice_start = 0
    for s in tl.static_range(NUM_SLICES):
        nt = (SLICE_WIDTHS[s] + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
        hit = (pid_n >= tile_start) & (pid_n < tile_start + nt)
        slice_id = tl.where(hit, s, slice_id)
        col0 = tl.where(hit, slice_start + (pid_n - tile_start) * BLOCK_SIZE_N, col0)
        col_end = tl.where(hit, slice_start + SLICE_WIDTHS[s], col_end)
        tile_start += nt
        slice_start += SLICE_WIDTHS[s]
    return slice_id, col0, col_end


def _dense_shrink_kernel(
    x_ptr,
    a_ptr,
    inter_ptr,
    sorted_ids_ptr,
    block_lora_ptr,
    num_post_ptr,
    num_tokens,
    num_blocks,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_al,
    stride_an,
    stride_ak,
    stride_im,
    stride_in,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # inter[t, n] = x[t]·A[l, n]ᵀ for the tokens t of one adapter block; N = S·R, K = H.
    pid = tl.program_id(0)
    pid_sk = pid % SPLIT_K
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid // SPLIT_K, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    lora = tl.load(block_lora_ptr + pid_m).to(tl.int64)
    if lora < 0:
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    tok = tl.load(sorted_ids_ptr + offs_m)
    row_mask = tok < num_tokens
    x_row = tl.where(row_mask, tok, 0).to(tl.int64)  # padding rows read row 0, never stored
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = pid_sk * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + lora * stride_al + offs_n_ld[None, :] * stride_an + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K * SPLIT_K)):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            aa = tl.load(a_ptrs)
        else:
            k_left = K - k * (BLOCK_SIZE_K * SPLIT_K)
            xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            aa = tl.load(a_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(xa, aa, acc)
        x_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_xk
        a_ptrs += BLOCK_SIZE_K * SPLIT_K * stride_ak
    out_ptrs = inter_ptr + tok.to(tl.int64)[:, None] * stride_im + offs_n[None, :] * stride_in
    mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


def _dense_expand_kernel(
    inter_ptr,
    b_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_lora_ptr,
    num_post_ptr,
    num_tokens,
    num_blocks,
    R,
    stride_im,
    stride_ik,
    stride_bl,
    stride_bn,
    stride_bk,
    stride_om,
    stride_on,
    SLICE_WIDTHS: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):
    # out[t, n] (+)= inter[t, s(n)·R : (s(n)+1)·R]·B[l, n]ᵀ; slice s owns cdiv(N_s, BN) column tiles.
    num_pid_n = 0
    for s in tl.static_range(NUM_SLICES):
        num_pid_n += (SLICE_WIDTHS[s] + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
    pid = tl.program_id(0)
    pid_m, pid_n = _pid_to_mn(pid, num_blocks, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    lora = tl.load(block_lora_ptr + pid_m).to(tl.int64)
    if lora < 0:
        return
    slice_id, col0, col_end = _slice_tile(pid_n, SLICE_WIDTHS, NUM_SLICES, BLOCK_SIZE_N)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    tok = tl.load(sorted_ids_ptr + offs_m)
    row_mask = tok < num_tokens
    # padding rows read the block's first row (a real token of this adapter, so a row the shrink
    # wrote: inter rows of tokens without adapter are never written) and are never stored
    tok0 = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M)
    i_row = tl.where(row_mask, tok, tok0).to(tl.int64)
    offs_n = col0 + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < col_end
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    i_ptrs = (
        inter_ptr + i_row[:, None] * stride_im + (slice_id * R + offs_k).to(tl.int64)[None, :] * stride_ik
    )
    b_ptrs = b_ptr + lora * stride_bl + offs_n_ld[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(R, BLOCK_SIZE_K)):
        if EVEN_K:
            ia = tl.load(i_ptrs)
            ba = tl.load(b_ptrs)
        else:
            k_left = R - k * BLOCK_SIZE_K
            ia = tl.load(i_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            ba = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # inter is fp32 (module docstring, "Precision"): fp16 weights -> fp32 dot (no fp16 overflow of
        # the intermediate), bf16 -> bf16 dot, fp32 -> fp32. A dtype comparison, resolved at compile time.
        if b_ptr.dtype.element_ty == tl.float16:
            acc = tl.dot(ia, ba.to(tl.float32), acc)
        else:
            acc = tl.dot(ia.to(ba.dtype), ba, acc)
        i_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += BLOCK_SIZE_K * stride_bk
    out_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    mask = row_mask[:, None] & n_mask[None, :]
    if ADD_INPUTS:
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        acc = acc + prev.to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: Arguments whose values follow the number of tokens (never specialized without length specialization).
DENSE_LENGTH_ARGS = {
    "dense_shrink": ["num_tokens", "num_blocks"],
    "dense_expand": ["num_tokens", "num_blocks"],
}
_SRC = {"dense_shrink": _dense_shrink_kernel, "dense_expand": _dense_expand_kernel}

#: DENSE_KERNELS[name][specialize_lengths] -> the jitted kernel (True = Triton's default integer
#: specialization, False = ``do_not_specialize`` on DENSE_LENGTH_ARGS[name]).
DENSE_KERNELS = {
    name: {True: triton.jit(fn), False: triton.jit(fn, do_not_specialize=DENSE_LENGTH_ARGS[name])}
    for name, fn in _SRC.items()
}


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------
def adapt_dense_config(stage, cfg: DenseLoRAConfig) -> DenseLoRAConfig:
    """The config ``stage`` (a :class:`~moelora_lib.kernels.stages.Stage`) launches: SPLIT_K → 1
    without ``split_k``, GROUP_SIZE_M → 1 without ``swizzle`` (as ``Stage.adapt`` does for the MoE)."""
    changes = {}
    for op in ("shrink", "expand"):
        c = getattr(cfg, op)
        new = {}
        if not stage.split_k and c.SPLIT_K != 1:
            new["SPLIT_K"] = 1
        if not stage.swizzle and c.GROUP_SIZE_M != 1:
            new["GROUP_SIZE_M"] = 1
        if new:
            changes[op] = replace(c, **new)
    return replace(cfg, **changes) if changes else cfg


def _is_tuned(stage) -> bool:
    from .tuned import TunedStage

    return isinstance(stage, TunedStage)


def dense_config_for(
    stage,
    T: int,
    *,
    hidden: int,
    slices: tuple[int, ...],
    rank: int,
    adapters: int,
    folder=None,
    gpu_name: str | None = None,
) -> DenseLoRAConfig:
    """The config a call of T tokens starts from: for stage ``tuned``,
    :func:`moelora_lib.configs.load_dense_config` (tuned files: the ``folder`` argument, else
    ``$MOELORA_TUNED_CONFIG_FOLDER``, else the files shipped for this GPU, else the defaults; the
    stage's fused add picks the ``EXPAND_TRUE`` file); for every other stage
    :func:`default_dense_config` (``folder`` / ``gpu_name`` are then ignored)."""
    if _is_tuned(stage):
        return load_dense_config(
            T,
            hidden,
            slices,
            rank,
            adapters,
            folder=folder,
            gpu_name=gpu_name,
            add_inputs=stage.fused_add,
        )
    return default_dense_config(T, hidden=hidden, slices=slices, rank=rank, adapters=adapters)


def dense_block_sizes_for(
    stage, max_tokens: int, *, hidden: int, slices: tuple[int, ...], rank: int, adapters: int
) -> tuple[int, ...]:
    """Every BLOCK_SIZE_M :func:`dense_config_for` picks for ``stage`` and 1 ≤ T ≤ max_tokens
    (ascending): the tuned files' (:func:`moelora_lib.configs.tuned_dense_block_sizes_m`) for stage
    ``tuned``, :func:`dense_block_sizes_m` for the others."""
    if _is_tuned(stage):
        return tuned_dense_block_sizes_m(
            max_tokens, hidden=hidden, slices=slices, rank=rank, adapters=adapters, add_inputs=stage.fused_add
        )
    return dense_block_sizes_m(max_tokens, adapters)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def _kernel(name: str, specialize_lengths: bool):
    return DENSE_KERNELS[name][bool(specialize_lengths)]


def num_column_tiles(slices: tuple[int, ...], block_size_n: int) -> int:
    """Column tiles of the expand: Σ_s cdiv(N_s, BLOCK_SIZE_N) (no tile straddles two slices)."""
    return sum(triton.cdiv(n, block_size_n) for n in slices)


def _stacked_a(lora_a: torch.Tensor) -> torch.Tensor:
    """[L, S, R, H] -> [L, S·R, H] (a view when the (S, R) dims are mergeable, else a copy)."""
    L, S, R, H = lora_a.shape
    return lora_a.reshape(L, S * R, H)


def dense_shrink_args(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    inter: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    use_even_k: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`dense_shrink` launch; allocates and launches nothing
    (meta tensors work). The single source of the launch arguments, shared with compile-only checks."""
    assert cfg.BLOCK_SIZE_M == align.block_size_m
    a3 = _stacked_a(lora_a)
    L, N, K = a3.shape
    grid = (cfg.SPLIT_K * align.num_blocks * triton.cdiv(N, cfg.BLOCK_SIZE_N),)
    args = (
        x,
        a3,
        inter,
        align.sorted_token_ids,
        align.block_lora_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        align.num_blocks,
        N,
        K,
        x.stride(0),
        x.stride(1),
        a3.stride(0),
        a3.stride(1),
        a3.stride(2),
        inter.stride(0),
        inter.stride(1),
    )
    constexprs = dict(
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        SPLIT_K=cfg.SPLIT_K,
        EVEN_K=bool(use_even_k and even_k(K, cfg.BLOCK_SIZE_K, cfg.SPLIT_K)),
    )
    return grid, args, constexprs


def dense_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    use_even_k: bool = False,
    specialize_lengths: bool = False,
    inter: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense LoRA shrink: inter[t, s·R + r] = x[t]·A[a, s, r]ᵀ for the tokens of adapter blocks.

    Args:
        x: [T, H] fp16/bf16/fp32.
        lora_a: [L, S, R, H], x's dtype.
        align: adapter alignment of the T tokens (E = 1, top_k = 1) with BLOCK_SIZE_M = cfg's.
        cfg: SPLIT_K > 1 splits the K loop and combines with relaxed fp32 atomics.
        use_even_k: unmasked K loop when H % (BLOCK_SIZE_K·SPLIT_K) == 0.
        specialize_lengths: Triton's default specialization of num_tokens / num_blocks.
        inter: optional preallocated [T, S·R] float32 tensor with unit column stride (zeroed here
            when SPLIT_K > 1).
    Returns:
        inter [T, S·R] float32; rows of tokens without adapter are not written (uninitialized when
        SPLIT_K = 1, zero otherwise).
    """
    L, S, R, H = lora_a.shape
    T = x.shape[0]
    if inter is None:
        alloc = torch.zeros if cfg.SPLIT_K > 1 else torch.empty  # atomics need a zeroed buffer
        inter = alloc((T, S * R), dtype=torch.float32, device=x.device)
    else:
        if tuple(inter.shape) != (T, S * R) or inter.dtype != torch.float32 or inter.stride(1) != 1:
            raise ValueError(
                f"inter must be a float32 tensor [T={T}, S·R={S * R}] with unit column stride, "
                f"got shape {tuple(inter.shape)}, dtype {inter.dtype}"
            )
        if cfg.SPLIT_K > 1:
            inter.zero_()
    grid, args, cx = dense_shrink_args(x, lora_a, inter, align, cfg, use_even_k=use_even_k)
    _kernel("dense_shrink", specialize_lengths)[grid](
        *args, **cx, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return inter


def dense_expand_args(
    inter: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    slices: tuple[int, ...],
    add_inputs: bool = True,
    use_even_k: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`dense_expand` launch; allocates and launches nothing."""
    assert cfg.BLOCK_SIZE_M == align.block_size_m and cfg.SPLIT_K == 1
    L, N_total, R = lora_b.shape
    slices = tuple(int(n) for n in slices)
    grid = (align.num_blocks * num_column_tiles(slices, cfg.BLOCK_SIZE_N),)
    args = (
        inter,
        lora_b,
        out,
        align.sorted_token_ids,
        align.block_lora_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        align.num_blocks,
        R,
        inter.stride(0),
        inter.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
    )
    constexprs = dict(
        SLICE_WIDTHS=slices,
        NUM_SLICES=len(slices),
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        EVEN_K=bool(use_even_k and even_k(R, cfg.BLOCK_SIZE_K)),
        ADD_INPUTS=bool(add_inputs),
    )
    return grid, args, constexprs


def dense_expand(
    inter: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    slices: tuple[int, ...],
    add_inputs: bool = True,
    use_even_k: bool = False,
    specialize_lengths: bool = False,
) -> torch.Tensor:
    """Dense LoRA expand: out[t, n] (+)= inter[t, s(n)·R : (s(n)+1)·R]·B[a, n]ᵀ, s(n) the slice of n.

    Args:
        inter: [T, S·R] float32 from :func:`dense_shrink`.
        lora_b: [L, N_total, R], slices concatenated along N_total (fp16/bf16/fp32; the dot's
            precision follows its dtype, module docstring).
        out: [T, N_total]; with add_inputs the delta is added to what it holds (the base output),
            else the delta is stored (rows of tokens without adapter are left untouched).
        slices: output widths N_s, Σ = N_total (a constexpr tuple: one binary per projection shape).
    Only the result is rounded to out's dtype.
    """
    grid, args, cx = dense_expand_args(
        inter, lora_b, out, align, cfg, slices=slices, add_inputs=add_inputs, use_even_k=use_even_k
    )
    _kernel("dense_expand", specialize_lengths)[grid](
        *args, **cx, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return out


class DenseLaunch(NamedTuple):
    """One dense LoRA launch as compile-only checks need it: kernel name (a :data:`DENSE_KERNELS` key),
    grid, positional args, constexprs, num_warps, num_stages, the OpConfig."""

    kernel: str
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    cfg: OpConfig


def dense_launches(
    stage,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: DenseLoRAConfig,
    *,
    slices: tuple[int, ...],
) -> tuple[DenseLaunch, DenseLaunch]:
    """The (shrink, expand) launches :func:`dense_lora_add` makes for ``stage`` (after
    :func:`adapt_dense_config`), described without allocating on a device or launching (meta tensors
    work; the rank intermediate is a placeholder of the right shape, dtype and device)."""
    c = adapt_dense_config(stage, cfg)
    L, S, R, H = lora_a.shape
    inter = torch.empty((x.shape[0], S * R), dtype=torch.float32, device=x.device)
    g, a, cx = dense_shrink_args(x, lora_a, inter, align, c.shrink, use_even_k=stage.even_k)
    shrink = DenseLaunch("dense_shrink", g, a, cx, c.shrink.NUM_WARPS, c.shrink.NUM_STAGES, c.shrink)
    g, a, cx = dense_expand_args(
        inter,
        lora_b,
        out,
        align,
        c.expand,
        slices=slices,
        add_inputs=stage.fused_add,
        use_even_k=stage.even_k,
    )
    expand = DenseLaunch("dense_expand", g, a, cx, c.expand.NUM_WARPS, c.expand.NUM_STAGES, c.expand)
    return shrink, expand


def dense_lora_add(
    stage,
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    align: Alignment,
    cfg: DenseLoRAConfig,
    *,
    slices: tuple[int, ...],
    inter: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the LoRA delta of every token with an adapter into ``out`` (the base output), as ``stage``
    launches it: shrink, then the expand adding into ``out`` (fused add) or storing into a delta
    buffer followed by ``out.add_(delta)``.

    Args:
        stage: a :class:`~moelora_lib.kernels.stages.Stage` (its switches; ``cfg`` is adapted to it).
        out: [T, N_total], modified in place and returned.
        x: [T, H]; lora_a [L, S, R, H]; lora_b [L, N_total, R] (validated by the caller).
        align: adapter alignment (E = 1, top_k = 1) with BLOCK_SIZE_M = cfg.block_size_m.
        slices: output widths, Σ = N_total.
        inter: optional preallocated [T, S·R] float32 rank intermediate.
        delta: optional preallocated [T, N_total] delta buffer for stages without fused add (float32
            when out is float16 — a delta beyond 65 504 on a base that brings the sum back into range
            must not overflow — else out's dtype).
    The delta buffer is filled with -0.0, the additive identity (x + -0.0 == x bit for bit, also for
    x = +0.0 and -0.0), so rows of tokens without adapter come out of the add exactly as the base.
    """
    c = adapt_dense_config(stage, cfg)
    x = aligned16(x, "x")
    lora_a, lora_b = aligned16(lora_a, "lora_a"), aligned16(lora_b, "lora_b")
    inter = dense_shrink(
        x,
        lora_a,
        align,
        c.shrink,
        use_even_k=stage.even_k,
        specialize_lengths=stage.specialize_lengths,
        inter=inter,
    )
    common = dict(slices=slices, use_even_k=stage.even_k, specialize_lengths=stage.specialize_lengths)
    if stage.fused_add:
        dense_expand(inter, lora_b, out, align, c.expand, add_inputs=True, **common)
        return out
    dt = torch.float32 if out.dtype == torch.float16 else out.dtype
    if delta is None:
        delta = torch.empty(out.shape, dtype=dt, device=out.device)
    elif tuple(delta.shape) != tuple(out.shape) or delta.dtype != dt:
        raise ValueError(
            f"delta must be a {dt} tensor of out's shape {tuple(out.shape)}, "
            f"got {tuple(delta.shape)} {delta.dtype}"
        )
    delta.fill_(-0.0)
    dense_expand(inter, lora_b, delta, align, c.expand, add_inputs=False, **common)
    out.add_(delta)
    return out
