"""The built-in default configs: hand-picked H200 starting points, no tuning.

They apply wherever no tuned file does (every stage but ``tuned``; stage ``tuned`` on a GPU or shape
without a tuned entry; the CPU interpreter). Functions of the layer sizes only, so they live beside the
config types and the loaders fall back to them without importing the kernels.
"""

from __future__ import annotations

from dataclasses import replace

from ..hardware import H200_NUM_SMS
from ..shapes import Dims, check_dims
from .schema import DenseLoRAConfig, LayerConfig, OpConfig, next_pow2

__all__ = [
    "default_config",
    "fused_gemm_configs",
    "fused_default_config",
    "default_dense_config",
    "dense_block_sizes_m",
]


def default_config(dims: Dims) -> LayerConfig:
    """The MoE layer's default configs for a call of ``dims`` (a :class:`~moelora_lib.shapes.Dims`).

    Base GEMMs: by T·K/E rows per expert. LoRA ops: by T·K/(L·E) rows per (adapter, expert) group
    (assuming every token has an adapter). SPLIT_K targets about two programs per SM of the H200
    for the shrink. BLOCK_SIZE_K = 64 keeps EVEN_K for every preset's hidden/intermediate.
    Raises TypeError when ``dims`` is not a Dims.
    """
    d = check_dims("default_config: dims", dims)
    pairs = max(1, d.T * d.top_k)
    m_avg = pairs / d.E
    if m_avg <= 8:
        base = OpConfig(16, 64, 64, 1, 1, 4, 5)
    elif m_avg <= 64:
        base = OpConfig(32, 64, 64, 8, 1, 4, 4)
    elif m_avg <= 256:
        base = OpConfig(64, 128, 64, 8, 1, 4, 4)
    else:
        base = OpConfig(128, 128, 64, 8, 1, 8, 4)

    groups = max(1, d.adapters) * d.E
    g_avg = pairs / groups
    bm = 16 if g_avg <= 16 else (32 if g_avg <= 48 else 64)
    est_blocks = min(pairs, groups) + pairs // bm

    def shrink(K: int, S: int) -> OpConfig:
        bn = max(16, next_pow2(d.rank))
        bk = 64
        sk = 1
        while sk < 16 and est_blocks * S * sk < 2 * H200_NUM_SMS and bk * sk * 4 <= K:
            sk *= 2
        return OpConfig(bm, bn, bk, 8, sk, 4, 3)

    def expand(N: int) -> OpConfig:
        bn = 128 if N >= 1024 and g_avg > 16 else 64
        return OpConfig(bm, bn, max(16, next_pow2(d.rank)), 8, 1, 4, 2)

    return LayerConfig(
        base_gate_up=base,
        base_down=base,
        gate_up_shrink=shrink(d.H, d.slices),
        gate_up_expand=expand(2 * d.I // d.slices),
        down_shrink=shrink(d.I, 1),
        down_expand=expand(d.H),
        source="default",
    )


def fused_gemm_configs(cfg: LayerConfig) -> LayerConfig:
    """Stage ``fused``'s two GEMM configs derived from a base-GEMM record (``base_gate_up``,
    ``base_down`` of ``cfg``; the other fields kept).

    * ``base_gate_up`` (the fused gate_up+activation GEMM): the base tile with BLOCK_SIZE_N halved
      (≥ 32): each program holds two accumulators (gate and up) and loads two weight tiles per K
      step, so halving N keeps registers and shared memory per program at the base GEMM's and covers
      the same 2·BLOCK_SIZE_N columns of h. At most 3 pipeline stages for the widest tiles (shared
      memory per stage is BM·BK + 2·BK·BN elements).
    * ``base_down`` (the fused down GEMM): the base tile (one accumulator, as the base GEMM).
    """
    gu = cfg.base_gate_up
    gu = replace(gu, BLOCK_SIZE_N=max(32, gu.BLOCK_SIZE_N // 2))
    if gu.BLOCK_SIZE_M >= 128:
        gu = replace(gu, NUM_STAGES=min(gu.NUM_STAGES, 3))
    return replace(cfg, base_gate_up=gu)


def fused_default_config(dims: Dims) -> LayerConfig:
    """Default configs of stage ``fused``: :func:`default_config`'s shrinks and :func:`fused_gemm_configs`
    of its base tiles; ``source`` ``"default:fused"``. Raises TypeError when ``dims`` is not a Dims."""
    d = check_dims("fused_default_config: dims", dims)
    return replace(fused_gemm_configs(default_config(d)), source="default:fused")


def gemv_default_config(dims: Dims) -> LayerConfig:
    """Default configs of stage ``gemv`` (:mod:`moelora_lib.kernels.gemv`): GEMVs of 32-row N tiles over
    256-wide K steps (16 KB of bf16 weights per step and program), gate_up unsplit, down split over K
    in 2 when I ≥ 1024; shrinks over 128-wide K steps split in 4. :func:`default_config`'s other
    fields; ``source`` ``"default:gemv"``. Raises TypeError when ``dims`` is not a Dims."""
    d = check_dims("gemv_default_config: dims", dims)
    base = default_config(d)
    gemv = OpConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, NUM_WARPS=4)
    # (BLOCK_SIZE_M is unused by the GEMVs; the shrinks keep the LoRA ops' shared one)
    shrink = replace(base.gate_up_shrink, BLOCK_SIZE_K=128, SPLIT_K=4, NUM_WARPS=4)
    return replace(
        base,
        base_gate_up=gemv,
        base_down=replace(gemv, SPLIT_K=2 if d.I >= 1024 else 1),
        gate_up_shrink=shrink,
        down_shrink=shrink,
        source="default:gemv",
    )


def _block_m(T: int, adapters: int) -> int:
    """BLOCK_SIZE_M by tokens per adapter (T / L, assuming every token has one, spread evenly)."""
    g_avg = max(1, T) / max(1, adapters)
    return 16 if g_avg <= 16 else (32 if g_avg <= 48 else 64)


def dense_block_sizes_m(max_tokens: int, adapters: int) -> tuple[int, ...]:
    """Every BLOCK_SIZE_M :func:`default_dense_config` picks for 1 ≤ T ≤ max_tokens (ascending), so a
    module can allocate its alignment workspaces up front."""
    edges = (1, 16 * adapters + 1, 48 * adapters + 1)  # the first T of each BLOCK_SIZE_M bucket
    return tuple(sorted({_block_m(T, adapters) for T in edges if T <= max(1, max_tokens)}))


def default_dense_config(
    T: int, *, hidden: int, slices: tuple[int, ...], rank: int, adapters: int
) -> DenseLoRAConfig:
    """Default config of a dense multi-LoRA projection of T tokens.

    Args:
        T: tokens of the call. hidden: H (the shrink's K). slices: output widths (N_s).
        rank: R (max rank of the slots). adapters: L.
    BLOCK_SIZE_M by tokens per adapter T/L (16 up to 16, 32 up to 48, else 64), as the MoE defaults do
    per (adapter, expert) group. Shrink: one column tile for S·R up to 128 (BLOCK_SIZE_N =
    next_pow2(S·R), 16..128), BLOCK_SIZE_K 64 (EVEN_K for H % 64 == 0 at SPLIT_K 1), SPLIT_K doubled
    (≤ 16, K chunks ≥ 4·BLOCK_SIZE_K) until about two programs per SM of the H200. Expand:
    BLOCK_SIZE_K = next_pow2(R) ≥ 16 (the whole rank in one step), BLOCK_SIZE_N 64 (128 for slices
    ≥ 1024 wide at more than 16 tokens per adapter), clamped to the widest slice.
    """
    S = len(slices)
    bm = _block_m(T, adapters)
    n_shrink = S * rank
    est_blocks = min(max(1, T), adapters) + max(1, T) // bm
    bn = min(128, max(16, next_pow2(n_shrink)))
    n_tiles = -(-n_shrink // bn)
    bk = 64
    sk = 1
    while sk < 16 and est_blocks * n_tiles * sk < 2 * H200_NUM_SMS and bk * sk * 8 <= hidden:
        sk *= 2
    shrink = OpConfig(bm, bn, bk, 8, sk, 4, 3)
    widest = max(slices)
    bn_e = 128 if widest >= 1024 and max(1, T) / max(1, adapters) > 16 else 64
    bn_e = max(16, min(bn_e, next_pow2(widest)))
    expand = OpConfig(bm, bn_e, max(16, next_pow2(rank)), 8, 1, 4, 2)
    return DenseLoRAConfig(shrink, expand, source="default")
