"""Launchers of the kernels in :mod:`moelora_lib.kernels.triton_kernels`.

Each launcher checks what the kernel relies on, allocates its output when asked to, computes the grid
and launches — nothing else. Input validation of user-facing arguments happens once, in
:func:`moelora_lib.fused_moe_lora`.
"""

from __future__ import annotations

import torch
import triton

from ..common import describe as _desc
from ..common import is_int
from ..quant.fp8 import FP8BlockWeight
from ..quant.mxfp4 import MXFP4_BLOCK, MXFP4Weight
from ..routing import Alignment
from .config import OpConfig
from .fp8_act import FP8Activations
from .triton_kernels import KERNELS

__all__ = [
    "fused_moe_gemm",
    "lora_shrink",
    "lora_expand",
    "gated_act",
    "even_k",
    "fused_moe_gemm_args",
    "lora_shrink_args",
    "lora_expand_args",
    "gated_act_args",
    "rank_stride",
    "lora_shrink_rows_args",
    "lora_shrink_rows",
    "fused_moe_lora_args",
    "fused_moe_lora",
    "weight_operand",
    "act_operand",
    "fp8_block_k_error",
]


def even_k(K: int, block_size_k: int, split_k: int = 1) -> bool:
    """EVEN_K: the K loop of every split covers K exactly, so loads need no K mask."""
    return K % (block_size_k * split_k) == 0


def _kernel(name: str, specialize_lengths: bool):
    return KERNELS[name][bool(specialize_lengths)]


def fp8_block_k_error(block_size_k: int, bk: int, name: str) -> str | None:
    """Why a K step of ``block_size_k`` cannot run on a block-FP8 weight ``name`` with scale blocks of
    ``bk`` columns (None when it can): a K step must stay inside one scale column, so BLOCK_SIZE_K must
    divide bk."""
    if bk % block_size_k == 0:
        return None
    return (
        f"BLOCK_SIZE_K = {block_size_k} must divide the FP8 scale block's {bk} columns of {name} "
        f"(block {name}.block[1]): a K step reads one scale column"
    )


def weight_operand(w, x: torch.Tensor, cfg: OpConfig, name: str = "w") -> tuple[tuple, tuple, dict]:
    """The kernel arguments of a base GEMM's expert weight ``w``: ``((w_ptr, stride_we, stride_wn,
    stride_wk), (ws_ptr, stride_se, stride_sn, stride_sk, fp8_bn, fp8_bk), {"W_MXFP4": …, "W_FP8": …})``.

    ``w``: a dense [E, N, K] tensor (nn.Linear layout; the scale arguments are dummies: w, zeros, 1),
    an :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` of dense shape [E, N, K] — ``blocks`` uint8
    [E, N, K/32, 16] whose last two dims are contiguous (byte b of a row's K/2 packed bytes at
    b·stride_wk) and ``scales`` uint8 [E, N, K/32] (the published GPT-OSS layout,
    :mod:`moelora_lib.quant.mxfp4`), or an :class:`~moelora_lib.quant.FP8BlockWeight` [E, N, K]
    (float8_e4m3fn ``weight`` read with its own strides, ``scale_inv`` [E, ceil(N/bn), ceil(K/bk)]);
    ``x`` [rows, K] the activations it multiplies.
    Raises ValueError naming the argument (``name``, ``x``, ``cfg.BLOCK_SIZE_K``) for an MXFP4 weight
    that is not [E, N, K/32, 16] / [E, N, K/32], whose last two dims are not contiguous, that is on
    another device than x, whose K differs from x's (K must be a multiple of 32: one e8m0 scale per 32
    values), or a BLOCK_SIZE_K that is not a multiple of 32 (a K step must hold whole scale blocks);
    for an FP8 weight that is not 3-D, on another device than x, whose K differs from x's, or whose
    scale block's columns bk are not a multiple of BLOCK_SIZE_K (a K step reads one scale column).
    Dense weights are not checked here (:func:`moelora_lib.fused_moe_lora` validates them).
    """
    if isinstance(w, FP8BlockWeight):
        q, sc = w.weight, w.scale_inv
        bn, bk = w.block
        if q.dim() != 3:
            raise ValueError(f"{name}: an FP8 expert weight must be [E, N, K], got {tuple(q.shape)}")
        if q.device != x.device:
            raise ValueError(f"{name} must be on {x.device} (x's device), got {q.device}")
        if x.dim() != 2 or x.shape[1] != q.shape[2]:
            raise ValueError(
                f"x must have K = {q.shape[2]} columns, the K of the FP8 weight {name} {tuple(q.shape)}, "
                f"got x {tuple(x.shape)}"
            )
        err = fp8_block_k_error(cfg.BLOCK_SIZE_K, bk, name)
        if err:
            raise ValueError(f"cfg.{err}")
        w_args = (q, q.stride(0), q.stride(1), q.stride(2))
        return (
            w_args,
            (sc, sc.stride(0), sc.stride(1), sc.stride(2), bn, bk),
            {"W_MXFP4": False, "W_FP8": True},
        )
    if not isinstance(w, MXFP4Weight):
        return (
            (w, w.stride(0), w.stride(1), w.stride(2)),
            (w, 0, 0, 0, 1, 1),
            {"W_MXFP4": False, "W_FP8": False},
        )
    q, sc = w.blocks, w.scales
    if q.dim() != 4 or sc.dim() != 3 or tuple(sc.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"{name}: an MXFP4 weight must hold blocks uint8 [E, N, K/32, 16] and scales uint8 [E, N, K/32], "
            f"got blocks {tuple(q.shape)} and scales {tuple(sc.shape)}"
        )
    if q.stride(3) != 1 or q.stride(2) != MXFP4_BLOCK // 2:
        raise ValueError(
            f"{name}.blocks must be contiguous in its last two dims (the K/2 packed bytes of a row), got "
            f"strides {tuple(q.stride())}"
        )
    if q.device != x.device:
        raise ValueError(f"{name} must be on {x.device} (x's device), got {q.device}")
    K = w.shape[2]
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(
            f"x must have K = {K} columns, the K of the MXFP4 weight {name} (blocks {tuple(q.shape)}: "
            f"K/32 = {q.shape[2]} scale blocks; K must be a multiple of {MXFP4_BLOCK}), "
            f"got x {tuple(x.shape)}"
        )
    if cfg.BLOCK_SIZE_K % MXFP4_BLOCK:
        raise ValueError(
            f"cfg.BLOCK_SIZE_K = {cfg.BLOCK_SIZE_K} must be a multiple of {MXFP4_BLOCK} for the MXFP4 weight "
            f"{name} (a K step decodes whole blocks of 32 values sharing one e8m0 scale)"
        )
    q_args = (q, q.stride(0), q.stride(1), q.stride(3))
    return q_args, (sc, sc.stride(0), sc.stride(1), sc.stride(2), 1, 1), {"W_MXFP4": True, "W_FP8": False}


def act_operand(x, w, cfg: OpConfig, name: str = "x") -> tuple[torch.Tensor, tuple, dict]:
    """The kernel arguments of a base GEMM's activations ``x``: ``(x tensor, (xs_ptr, stride_xsm,
    stride_xsk, act_group), {"A_FP8": …})``.

    ``x``: a dense [rows, K] tensor (weight-only or dense GEMM; the scale arguments are dummies), or
    :class:`~moelora_lib.kernels.fp8_act.FP8Activations` (W8A8, ``A_FP8``): ``q`` float8_e4m3fn
    [rows, K] and ``scale`` float32 [rows, ceil(K/g)] of
    :func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act`,
    whose x tensor is ``q``. Raises ValueError naming ``name`` for FP8 activations with a weight ``w``
    that is not an :class:`~moelora_lib.quant.FP8BlockWeight` (W8A8 needs FP8 on both operands), a ``q``
    that is not a 2-D float8_e4m3fn tensor, a ``scale`` that is not float32 [rows, ceil(K/g)] on q's
    device, a group size that is not a positive int; naming ``cfg.BLOCK_SIZE_K`` when it does not divide
    the group (a K step reads one activation scale column) or is below 32 (the smallest K of an FP8
    tensor-core dot).
    """
    if not isinstance(x, FP8Activations):
        return x, (x, 0, 0, 1), {"A_FP8": False}
    if not isinstance(w, FP8BlockWeight):
        raise ValueError(
            f"{name}: FP8 activations (W8A8) need a block-FP8 weight (FP8BlockWeight), got {_desc(w)}"
        )
    q, sc, g = x.q, x.scale, x.group_size
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.q must be a float8_e4m3fn tensor [rows, K], got {_desc(q)}")
    if not is_int(g) or g < 1:
        raise ValueError(f"{name}.group_size must be a positive int, got {g!r}")
    want = (q.shape[0], -(-q.shape[1] // g))
    if (
        not isinstance(sc, torch.Tensor)
        or tuple(sc.shape) != want
        or sc.dtype != torch.float32
        or sc.device != q.device
    ):
        raise ValueError(
            f"{name}.scale must be a float32 tensor {list(want)} (one scale per row and {g} columns of "
            f"{name}.q) on {q.device}, got {_desc(sc)}"
        )
    if g % cfg.BLOCK_SIZE_K or cfg.BLOCK_SIZE_K < 32:
        raise ValueError(
            f"cfg.BLOCK_SIZE_K = {cfg.BLOCK_SIZE_K} must be at least 32 (an FP8 dot's K) and divide the "
            f"activation group of {g} columns of {name} ({name}.group_size): a K step reads one "
            "activation scale column"
        )
    return q, (sc, sc.stride(0), sc.stride(1), int(g)), {"A_FP8": True}


def fused_moe_gemm_args(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    use_even_k: bool = True,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`fused_moe_gemm` launch; allocates and launches nothing.

    The single source of the launch arguments, shared with compile-only inspection
    (:mod:`moelora_lib.studies.compile_check`). num_warps/num_stages come from ``cfg``.
    """
    assert cfg.BLOCK_SIZE_M == align.block_size_m and cfg.SPLIT_K == 1
    x, xs_args, afmt = act_operand(x, w, cfg)
    (wt, *w_strides), s_args, wfmt = weight_operand(w, x, cfg)
    E, N, K = w.shape
    grid = (align.num_blocks * triton.cdiv(N, cfg.BLOCK_SIZE_N),)
    b = bias if bias is not None else wt  # dummy pointer when HAS_BIAS is False
    tw = topk_weights if topk_weights is not None else out
    args = (
        x,
        wt,
        out,
        b,
        tw,
        align.sorted_token_ids,
        align.block_expert_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        align.num_blocks,
        N,
        K,
        rows_div,
        x.stride(0),
        x.stride(1),
        *w_strides,
        out.stride(0),
        out.stride(1),
        bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0,
        *s_args,
        *xs_args,
    )
    constexprs = dict(
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        EVEN_K=bool(use_even_k and even_k(K, cfg.BLOCK_SIZE_K)),
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        **wfmt,
        **afmt,
    )
    return grid, args, constexprs


def fused_moe_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    use_even_k: bool = True,
    specialize_lengths: bool = False,
) -> torch.Tensor:
    """Base grouped GEMM: out[p] = x[p // rows_div]·w[e]ᵀ (+ bias[e]) (· topk_weights[p]).

    Args:
        x: [rows, K] activations (hidden_states [T, H] with rows_div = top_k, or the activation
            output [T·K, I] with rows_div = 1); or, with an FP8 ``w``, their
            :class:`~moelora_lib.kernels.fp8_act.FP8Activations` (W8A8: FP8 × FP8 dots, each K step's
            fp32 partial times the row's activation scale and the weight block's scale; BLOCK_SIZE_K ≥ 32
            dividing the activation group and the scale block's columns; :func:`act_operand`). The
            output dtype is ``out``'s.
        w: [E, N, K] expert weights (nn.Linear layout), or an
            :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` of that dense shape (packed e2m1 codes and
            e8m0 scales, decoded in registers and rounded to x's dtype for the dot; BLOCK_SIZE_K a
            multiple of 32; ValueError naming the argument otherwise, :func:`weight_operand`), or an
            :class:`~moelora_lib.quant.FP8BlockWeight` (e4m3 times its block scale, rounded to x's
            dtype; BLOCK_SIZE_K dividing the scale block's columns).
        out: [T·K, N] written for every real pair (padding rows never).
        align: expert-only alignment with BLOCK_SIZE_M = cfg.BLOCK_SIZE_M.
        cfg: launch config (SPLIT_K must be 1).
        bias: [E, N] or None. topk_weights: [T·K] float32 or None (multiplies after the bias).
        use_even_k: allow the unmasked K loop when K % BLOCK_SIZE_K == 0.
        specialize_lengths: True = Triton's default specialization of length-dependent ints.
    """
    grid, args, constexprs = fused_moe_gemm_args(
        x, w, out, align, cfg, rows_div=rows_div, bias=bias, topk_weights=topk_weights, use_even_k=use_even_k
    )
    _kernel("fused_moe", specialize_lengths)[grid](
        *args, **constexprs, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return out


def lora_shrink_args(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    inter: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    use_even_k: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`lora_shrink` launch writing ``inter`` [S, T·K, R]."""
    assert cfg.BLOCK_SIZE_M == align.block_size_m
    a5 = lora_a if lora_a.dim() == 5 else lora_a.unsqueeze(2)
    L, E, S, R, K = a5.shape
    grid = (cfg.SPLIT_K * align.num_blocks * triton.cdiv(R, cfg.BLOCK_SIZE_N), S)
    args = (
        x,
        a5,
        inter,
        align.sorted_token_ids,
        align.block_expert_ids,
        align.block_lora_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        align.num_blocks,
        R,
        K,
        rows_div,
        x.stride(0),
        x.stride(1),
        a5.stride(0),
        a5.stride(1),
        a5.stride(2),
        a5.stride(3),
        a5.stride(4),
        inter.stride(0),
        inter.stride(1),
        inter.stride(2),
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


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    use_even_k: bool = False,
    specialize_lengths: bool = False,
    inter: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA shrink: inter[s, p] = x[p // rows_div]·lora_a[l, e, s]ᵀ for pairs of adapter blocks.

    Args:
        x: [rows, K] fp16/bf16/fp32.
        lora_a: [L, E, S, R, K] (gate_up) or [L, E, R, K] (down, S = 1).
        align: (adapter, expert) alignment with BLOCK_SIZE_M = cfg.BLOCK_SIZE_M.
        cfg: SPLIT_K > 1 splits the K loop and combines with relaxed fp32 atomics.
    Returns:
        inter: [S, T·K, R] float32. Rows of pairs without an adapter are not written (uninitialized
        when SPLIT_K = 1, zero otherwise). The rank intermediate is accumulated (fp32 dot) and kept
        in fp32 (vLLM keeps it in the activation dtype), so a value beyond fp16's 65 504 stays
        finite; :func:`lora_expand` reads it as bf16 with bf16 weights, as fp32 otherwise.
    Optional ``inter``: a preallocated contiguous [S, T·K, R] float32 output (no allocation; it is
        zeroed here when SPLIT_K > 1). Default None allocates.
    """
    a5 = lora_a if lora_a.dim() == 5 else lora_a.unsqueeze(2)
    L, E, S, R, K = a5.shape
    if inter is None:
        alloc = torch.zeros if cfg.SPLIT_K > 1 else torch.empty  # atomics need a zeroed buffer
        inter = alloc((S, align.num_pairs, R), dtype=torch.float32, device=x.device)
    else:
        if (
            inter.shape != (S, align.num_pairs, R)
            or inter.dtype != torch.float32
            or not inter.is_contiguous()
        ):
            raise ValueError(
                f"inter must be a contiguous float32 tensor [S={S}, T·K={align.num_pairs}, R={R}], "
                f"got shape {tuple(inter.shape)}, dtype {inter.dtype}"
            )
        if cfg.SPLIT_K > 1:
            inter.zero_()  # atomics need a zeroed buffer
    grid, args, constexprs = lora_shrink_args(
        x, lora_a, inter, align, cfg, rows_div=rows_div, use_even_k=use_even_k
    )
    _kernel("lora_shrink", specialize_lengths)[grid](
        *args, **constexprs, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return inter


def lora_expand_args(
    inter: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    topk_weights: torch.Tensor | None = None,
    add_inputs: bool = True,
    use_even_k: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`lora_expand` launch."""
    assert cfg.BLOCK_SIZE_M == align.block_size_m and cfg.SPLIT_K == 1
    b5 = lora_b if lora_b.dim() == 5 else lora_b.unsqueeze(2)
    L, E, S, N, R = b5.shape
    tw = topk_weights if topk_weights is not None else inter
    grid = (align.num_blocks * triton.cdiv(N, cfg.BLOCK_SIZE_N), S)
    args = (
        inter,
        b5,
        out,
        tw,
        align.sorted_token_ids,
        align.block_expert_ids,
        align.block_lora_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        align.num_blocks,
        N,
        R,
        inter.stride(0),
        inter.stride(1),
        inter.stride(2),
        b5.stride(0),
        b5.stride(1),
        b5.stride(2),
        b5.stride(3),
        b5.stride(4),
        out.stride(0),
        out.stride(1),
    )
    constexprs = dict(
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        EVEN_K=bool(use_even_k and even_k(R, cfg.BLOCK_SIZE_K)),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        ADD_INPUTS=bool(add_inputs),
    )
    return grid, args, constexprs


def lora_expand(
    inter: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    topk_weights: torch.Tensor | None = None,
    add_inputs: bool = True,
    use_even_k: bool = False,
    specialize_lengths: bool = False,
) -> torch.Tensor:
    """LoRA expand: out[p, s·N + n] (+)= (inter[s, p]·lora_b[l, e, s]ᵀ)[n] (· topk_weights[p]).

    Args:
        inter: [S, T·K, R] float32 from :func:`lora_shrink`. Precision of its dot (fp32 accumulation
            in every case), chosen at compile time from lora_b's dtype: bf16 weights — inter rounded
            to bf16 (fp32's exponent range), bf16 tensor-core dot; fp16 weights — inter
            kept in fp32 and lora_b widened to fp32, dot at Triton's default input_precision (tf32
            on the GPU: fp32's range, fp16's 10-bit mantissa), so an intermediate beyond fp16's
            65 504 does not overflow; fp32 — fp32 operands (tf32 on the GPU).
        lora_b: [L, E, S, N, R] (gate_up) or [L, E, N, R] (down, S = 1).
        out: [T·K, S·N]; with add_inputs the delta is added to what ``out`` holds (read-modify-write
            of the tile, no delta buffer); without, the delta is stored (rows of pairs without an
            adapter are left untouched).
        topk_weights: [T·K] float32 or None; multiplies the delta (down projection).
    Only the result (the delta, or out + delta) is rounded to ``out``'s dtype, once.
    """
    grid, args, constexprs = lora_expand_args(
        inter,
        lora_b,
        out,
        align,
        cfg,
        topk_weights=topk_weights,
        add_inputs=add_inputs,
        use_even_k=use_even_k,
    )
    _kernel("lora_expand", specialize_lengths)[grid](
        *args, **constexprs, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return out


def gated_act_args(
    h: torch.Tensor, out: torch.Tensor, activation: str, *, block_size: int = 1024
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`gated_act` launch (Triton's default warps/stages)."""
    P, two_i = h.shape
    inter_size = two_i // 2
    bs = min(block_size, triton.next_power_of_2(inter_size))
    grid = (P, triton.cdiv(inter_size, bs))
    args = (h, out, P, inter_size, h.stride(0), out.stride(0))
    return grid, args, dict(ACTIVATION=activation, BLOCK_SIZE=bs)


def gated_act(
    h: torch.Tensor,
    activation: str,
    *,
    specialize_lengths: bool = False,
    block_size: int = 1024,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated activation [P, 2I] -> [P, I] in h's dtype (computed in fp32).

    ``"silu"``: silu(h[:, :I])·h[:, I:]; ``"swigluoai"``: GPT-OSS, interleaved gate/up columns,
    (clamp(up, ±7) + 1)·g·sigmoid(1.702·g) with g = min(gate, 7).
    Optional ``out``: a preallocated contiguous [P, I] tensor of h's dtype (no allocation); default
    None allocates.
    """
    P, two_i = h.shape
    inter_size = two_i // 2
    if out is None:
        out = torch.empty((P, inter_size), dtype=h.dtype, device=h.device)
    elif out.shape != (P, inter_size) or out.dtype != h.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {h.dtype} tensor [P={P}, I={inter_size}], "
            f"got shape {tuple(out.shape)}, dtype {out.dtype}"
        )
    if P == 0:
        return out
    grid, args, constexprs = gated_act_args(h, out, activation, block_size=block_size)
    _kernel("gated_act", specialize_lengths)[grid](*args, **constexprs)
    return out


# --------------------------------------------------------------------------------------------------
# stage ``fused``: shrink into a [P, S, R16] intermediate, expand (and activation) inside the base GEMM
# --------------------------------------------------------------------------------------------------
def rank_stride(R: int) -> int:
    """Row stride of the fused stage's rank intermediate: R rounded up to a multiple of 16 elements,
    so every stride of [P, S, R16] is a multiple of 16 (Triton's divisibility hint: 16-byte vector
    stores in the shrink and vector loads in the fused GEMMs) and none depends on the length."""
    return -(-int(R) // 16) * 16


def lora_shrink_rows_args(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    inter: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    use_even_k: bool = False,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one :func:`lora_shrink_rows` launch writing ``inter`` [P, S, R16]:
    the shrink kernel with the slice stride R16 and the pair stride S·R16 (neither follows T)."""
    a5 = lora_a if lora_a.dim() == 5 else lora_a.unsqueeze(2)
    S, R = a5.shape[2], a5.shape[3]
    assert inter.dim() == 3 and inter.shape[1] == S and inter.shape[2] >= R
    # the same launch as lora_shrink's on an [S, P, R16] view of the [P, S, R16] buffer (same pointer)
    view = inter.permute(1, 0, 2)
    return lora_shrink_args(x, lora_a, view, align, cfg, rows_div=rows_div, use_even_k=use_even_k)


def lora_shrink_rows(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    rows_div: int,
    use_even_k: bool = False,
    inter: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA shrink of stage ``fused``: inter[p, s, :R] = x[p // rows_div]·lora_a[l, e, s]ᵀ.

    Same kernel and arithmetic as :func:`lora_shrink` (split-K with relaxed fp32 atomics), but the
    intermediate is [T·K, S, R16] float32 (:func:`rank_stride`), launched without length
    specialization on the counts only. Rows of pairs without an adapter are not written
    (uninitialized when SPLIT_K = 1, zero otherwise); columns R..R16 are never written or read.
    Optional ``inter``: a preallocated contiguous [T·K, S, R16] float32 buffer (zeroed here when
    SPLIT_K > 1).
    """
    a5 = lora_a if lora_a.dim() == 5 else lora_a.unsqueeze(2)
    L, E, S, R, K = a5.shape
    shape = (align.num_pairs, S, rank_stride(R))
    if inter is None:
        alloc = torch.zeros if cfg.SPLIT_K > 1 else torch.empty  # atomics need a zeroed buffer
        inter = alloc(shape, dtype=torch.float32, device=x.device)
    else:
        if tuple(inter.shape) != shape or inter.dtype != torch.float32 or not inter.is_contiguous():
            raise ValueError(
                f"inter must be a contiguous float32 tensor [T·K={shape[0]}, S={S}, R16={shape[2]}], "
                f"got shape {tuple(inter.shape)}, dtype {inter.dtype}"
            )
        if cfg.SPLIT_K > 1:
            inter.zero_()
    grid, args, constexprs = lora_shrink_rows_args(
        x, lora_a, inter, align, cfg, rows_div=rows_div, use_even_k=use_even_k
    )
    _kernel("lora_shrink_rows", False)[grid](
        *args, **constexprs, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return inter


def fused_moe_lora_args(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    top_k: int,
    activation: str | None = None,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_ids: torch.Tensor | None = None,
    use_even_k: bool = True,
) -> tuple[str, tuple, tuple, dict]:
    """``(kernel, grid, args, constexprs)`` of one :func:`fused_moe_lora` launch; nothing allocated.

    ``x`` may be :class:`~moelora_lib.kernels.fp8_act.FP8Activations` with an FP8 ``w`` (W8A8,
    :func:`act_operand`).
    ``activation`` given: the gate_up kernel (``fused_moe_lora_act``, x = hidden_states [T, H], w = w13
    [E, 2I, H], out = g [T·K, I]); None: the down kernel (``fused_moe_lora``, x = g [T·K, I], w = w2
    [E, H, I], out = y [T·K, H], topk_weights required). ``w`` dense or an
    :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` or :class:`~moelora_lib.quant.FP8BlockWeight` of that
    dense shape (:func:`weight_operand`).
    ``inter``/``lora_b``/``lora_ids`` together or not at all (HAS_LORA).
    """
    assert cfg.BLOCK_SIZE_M == align.block_size_m and (cfg.SPLIT_K == 1 or activation is None)
    x, xs_args, afmt = act_operand(x, w, cfg)
    (wt, *w_strides), s_args, wfmt = weight_operand(w, x, cfg)
    E, N, K = w.shape
    has_lora = inter is not None
    assert has_lora == (lora_b is not None) == (lora_ids is not None)
    if has_lora:
        b5 = lora_b if lora_b.dim() == 5 else lora_b.unsqueeze(2)
        L, _, S, NS, R = b5.shape
        i_strides = (inter.stride(0), inter.stride(1), inter.stride(2))
        b_strides = tuple(b5.stride(d) for d in range(5))
        ids = lora_ids
    else:  # dummies (never read): HAS_LORA is False
        b5, L, S, NS, R, ids = wt, 0, 1, N, 16, align.sorted_token_ids
        i_strides, b_strides = (0, 0, 0), (0, 0, 0, 0, 0)
        inter = out
    b = bias if bias is not None else wt
    c_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    cx = dict(
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        BLOCK_SIZE_R=max(16, triton.next_power_of_2(R)),
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        EVEN_K=bool(use_even_k and even_k(K, cfg.BLOCK_SIZE_K)),
        HAS_BIAS=bias is not None,
        HAS_LORA=has_lora,
        **wfmt,
        **afmt,
    )
    head = (x, wt, out, b)
    counts = (align.sorted_token_ids, align.block_expert_ids, align.num_tokens_post_padded)
    counts += (align.num_pairs, align.num_blocks)
    strides = (x.stride(0), x.stride(1), *w_strides, out.stride(0), out.stride(1))
    strides += c_strides + i_strides + b_strides + tuple(s_args) + tuple(xs_args)
    if activation is not None:
        assert N % 2 == 0 and (not has_lora or NS * S == N)
        inter_size = N // 2
        grid = (align.num_blocks * triton.cdiv(inter_size, cfg.BLOCK_SIZE_N),)
        args = head + (inter, b5, ids) + counts + (inter_size, K, top_k, R, L, NS) + strides
        return "fused_moe_lora_act", grid, args, dict(cx, ACTIVATION=activation)
    assert topk_weights is not None
    if cfg.SPLIT_K > 1:  # split-K partial sums are added into a zeroed fp32 y
        assert out.dtype == torch.float32
        cx["SPLIT_K"] = cfg.SPLIT_K
    grid = (align.num_blocks * triton.cdiv(N, cfg.BLOCK_SIZE_N) * cfg.SPLIT_K,)
    args = head + (topk_weights, inter, b5, ids) + counts + (N, K, top_k, R, L) + strides
    return "fused_moe_lora", grid, args, cx


def fused_moe_lora(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    cfg: OpConfig,
    *,
    top_k: int,
    activation: str | None = None,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    inter: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_ids: torch.Tensor | None = None,
    use_even_k: bool = True,
) -> torch.Tensor:
    """The base grouped GEMM of stage ``fused`` with the LoRA expand (and, for gate_up, the activation)
    in the same program, over the expert-only alignment ``align``.

    gate_up (``activation`` = "silu" / "swigluoai"): out = g [T·K, I] = act(x·w13[e]ᵀ + delta (+ b13[e]));
    down (``activation`` None): out = y [T·K, H] = (g·w2[e]ᵀ + delta (+ b2[e]))·topk_weights.
    delta[p] = inter[p, s]·lora_b[l, e, s]ᵀ per slice s, for the rows whose adapter l =
    lora_ids[p // top_k] is in [0, L) (others: no delta, bit-identical to the base). ``inter``:
    [T·K, S, R16] float32 from :func:`lora_shrink_rows`, its rows written for exactly those pairs;
    ``lora_b``: [L, E, S, N/S, R] (gate_up) or [L, E, H, R] (down). The whole row is accumulated in fp32
    and rounded once (the base, the delta, the bias, the activation, the routing weight). ``w`` may be an
    :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` or :class:`~moelora_lib.quant.FP8BlockWeight`
    (decoded in registers; :func:`weight_operand` says
    what is checked).
    """
    kernel, grid, args, constexprs = fused_moe_lora_args(
        x,
        w,
        out,
        align,
        cfg,
        top_k=top_k,
        activation=activation,
        bias=bias,
        topk_weights=topk_weights,
        inter=inter,
        lora_b=lora_b,
        lora_ids=lora_ids,
        use_even_k=use_even_k,
    )
    _kernel(kernel, False)[grid](*args, **constexprs, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES)
    return out
