"""Token alignment in Triton: :func:`align_tokens_triton`, the device version of
:func:`moelora_lib.routing.align_tokens` (for the serving layer).

Contract (the torch function stays the oracle; its contract is this one's): every (token, k) pair
``p = t·K + k`` goes to a group ``(slot, expert)`` (key ``slot·E + expert``; one slot for the
expert-only alignment, L + 1 for the LoRA one, slot L = lora id -1, laid out last); groups follow one
another in a flat buffer, each padded up to a multiple of BLOCK_SIZE_M; pairs of a group keep their
ascending pair order; padding holds the sentinel ``T·K``; each block gets its expert and adapter
(-1 past the end, -1 adapter for the no-adapter slot and for the expert-only alignment). The result
is bit-for-bit that of ``routing.align_tokens(..., check_values=False)``, with the same static sizes
(:func:`~moelora_lib.routing.max_padded_pairs`).

Method — a stable counting sort over the G = slots·E group keys in three launches, all sizes static,
no host sync, no atomics (every output is deterministic: counts are sums, ranks are positions):

1. ``_align_count_kernel``, grid (NT,): pairs are cut into NT tiles of TILE (a power of two,
   next_pow2(T·K / 8) clamped to [64, 512] unless the ``tile`` argument says otherwise); each program
   writes its tile's histogram over the groups (``tl.histogram``, GB groups at a time) into row
   ``tile`` of ``tile_counts [NT, G]``. Every entry is written, so the scratch needs no zeroing launch.
2. ``_align_scan_kernel``, grid (1,): per group, an exclusive scan over the tiles turns
   ``tile_counts`` into each tile's offset inside its group (in place) and gives the group's count;
   then the padded prefix sum over the groups gives ``group_end`` (padded, inclusive) and
   ``num_tokens_post_padded``.
3. ``_align_scatter_kernel``, grid (NT + fill programs,): a tile program sorts its pairs by
   ``key·TILE + position`` (``tl.sort``; the composite is unique, so the order is fixed), gets each
   pair's rank inside its key's run by a segmented scan, and writes the pair index at
   ``group_start + tile_offset + rank`` — the stable rank without any atomic position. A fill
   program takes BLOCKS blocks: finds each block's group (number of padded group ends ≤ its start),
   writes ``block_expert_ids`` / ``block_lora_ids`` and the sentinel into the block's padding rows.
   Tile and fill programs write disjoint entries, so the one launch needs no ordering between them.

The idea is that of vLLM's ``moe_align_block_size`` and its LoRA variant ``moe_lora_align_block_size``
(csrc/moe; docs/upstream-vllm-moe-lora.md §4): count per expert (per slot), padded cumsum, then
scatter, and fill the per-block expert ids. Unlike vLLM's one-CTA-per-slot kernel this one spreads the
pairs over tiles (so T = 8192 is not one CTA's loop), and it ranks pairs by a sort instead of an
atomic cursor, so the order inside a group is the oracle's (ascending pair index) on every run.

Base and LoRA alignments are separate calls (three launches each): the two group sets differ (E vs
(L + 1)·E keys) and each call returns one :class:`~moelora_lib.routing.Alignment`. Where the launches
cost more than the work (T·K ≤ :data:`~moelora_lib.kernels.align_small.PAIR_PATH_MAX_PAIRS`),
:func:`~moelora_lib.kernels.align_small.align_tokens_pair` does both alignments in one launch instead.

One binary per constexpr class, whatever T and the inputs' offsets: Triton specializes int
arguments on == 1 and % 16 and pointers on 16-byte alignment, so every length-dependent int (N, NT,
num_blocks) and every stride of the caller's id tensors is ``do_not_specialize``, and so are the
``topk_ids`` / ``lora_ids`` pointers (a caller's offset view, e.g. ``ids[1:]``, keeps the binary;
their loads are gathers through ``p // K``, so the alignment hint would buy nothing). The int32
scratch is laid out with length-independent, 16-byte aligned offsets: group ends at 0, group counts
at Gp, tile counts at 2·Gp (Gp = G rounded up to a multiple of 4 entries), so no sub-buffer's
alignment follows NT·G. What still follows T are the constexpr tile sizes (TILE from T·K, the scan's
TC from NT and its GB from TC): a few classes, each compiled once
(``tests/offset_view_helpers.py`` counts them).

Ids out of range (topk_ids ∉ [0, E), lora_ids ∉ [-1, L)) are not checked (that would need a host
sync): such pairs are dropped, never written out of bounds, and the torch oracle (without its value
check) drops the same pairs.

Default tile: next_pow2(T·K / 8) clamped to [64, 512], the H200's best totals in a tile sweep (tiles of
64–256 at T = 256, 512 at T = 8192; docs/perf_notes.md). The scatter/fill launch dominates the time.

Used by :class:`moelora_lib.layer.MoELoRALayer` and :mod:`moelora_lib.lora_linear` on CUDA above the pair
path's size (:func:`~moelora_lib.kernels.align_small.use_pair_path`), with preallocated workspaces
(:func:`align_workspace`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ..common import is_int
from ..routing import Alignment, max_padded_pairs

__all__ = [
    "align_tokens_triton",
    "align_launch_args",
    "AlignLaunch",
    "AlignSizes",
    "align_sizes",
    "AlignWorkspace",
    "align_workspace",
    "SCRATCH_ALIGN",
]

INT32_MAX = 2**31 - 1
#: Rows of ``sorted_token_ids`` each fill program covers (BLOCKS = FILL_ROWS // BLOCK_SIZE_M blocks).
FILL_ROWS = 1024
#: Elements of one 2-D register tile in the scan and fill loops.
_TILE_ELEMS = 8192
#: int32 entries the scratch sub-buffers are aligned to (4 = 16 bytes, Triton's pointer alignment).
SCRATCH_ALIGN = 4
#: Length-dependent (or caller-layout-dependent) arguments of the kernels: never specialized.
_NO_SPEC_IDS = ["topk_ptr", "stride_topk_t", "stride_topk_k", "lora_ptr", "stride_lora_t"]


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pair_keys(
    topk_ptr,
    stride_topk_t,
    stride_topk_k,
    lora_ptr,
    stride_lora_t,
    p,
    N,
    K,
    E,
    L,
    G,
    HAS_LORA: tl.constexpr,
    INCLUDE_NO_ADAPTER: tl.constexpr,
):
    """Group key of pairs p (slot·E + expert); G for pairs past N, dropped, or with ids out of range."""
    live = p < N
    t = p // K
    k = p - t * K
    e = tl.load(
        topk_ptr + t.to(tl.int64) * stride_topk_t + k.to(tl.int64) * stride_topk_k, mask=live, other=0
    )
    ok = live & (e >= 0) & (e < E)
    key = e.to(tl.int32)
    if HAS_LORA:
        lo = tl.load(lora_ptr + t.to(tl.int64) * stride_lora_t, mask=live, other=0)
        ok = ok & (lo >= -1) & (lo < L)
        if not INCLUDE_NO_ADAPTER:
            ok = ok & (lo >= 0)
        slot = tl.where(lo < 0, L, lo).to(tl.int32)
        key = slot * E + key
    return tl.where(ok, key, G)


@triton.jit
def _run_start(k1, f1, k2, f2):
    # Segmented scan on sorted keys: the first position of the run of equal keys. Associative on
    # sorted input (k1 == k3 implies k2 equal too), which is all it is used on.
    return k2, tl.where(k1 == k2, f1, f2)


@triton.jit(do_not_specialize=_NO_SPEC_IDS + ["N"])
def _align_count_kernel(
    topk_ptr,
    stride_topk_t,
    stride_topk_k,
    lora_ptr,
    stride_lora_t,
    tile_counts_ptr,
    N,
    K,
    E,
    L,
    G,
    HAS_LORA: tl.constexpr,
    INCLUDE_NO_ADAPTER: tl.constexpr,
    TILE: tl.constexpr,
    GB: tl.constexpr,
):
    """tile_counts[tile, g] = pairs of the tile in group g (every entry written)."""
    pid = tl.program_id(0)
    p = pid * TILE + tl.arange(0, TILE)
    key = _pair_keys(
        topk_ptr,
        stride_topk_t,
        stride_topk_k,
        lora_ptr,
        stride_lora_t,
        p,
        N,
        K,
        E,
        L,
        G,
        HAS_LORA,
        INCLUDE_NO_ADAPTER,
    )
    row = tile_counts_ptr + pid * G
    for g0 in range(0, G, GB):
        rel = key - g0
        h = tl.histogram(rel, GB, mask=(rel >= 0) & (rel < GB) & (key < G))
        g = g0 + tl.arange(0, GB)
        tl.store(row + g, h, mask=g < G)


@triton.jit(do_not_specialize=["NT"])
def _align_scan_kernel(
    tile_counts_ptr,
    group_end_ptr,
    group_count_ptr,
    num_post_ptr,
    NT,
    G,
    BM: tl.constexpr,
    TC: tl.constexpr,
    GB: tl.constexpr,
):
    """tile_counts -> exclusive offsets over tiles (in place); group counts; padded group ends."""
    total = tl.zeros((), dtype=tl.int32)
    for g0 in range(0, G, GB):
        g = g0 + tl.arange(0, GB)
        gmask = g < G
        run = tl.zeros((GB,), dtype=tl.int32)
        for t0 in range(0, NT, TC):
            tt = t0 + tl.arange(0, TC)
            m = (tt[:, None] < NT) & gmask[None, :]
            ptrs = tile_counts_ptr + tt[:, None] * G + g[None, :]
            c = tl.load(ptrs, mask=m, other=0)
            tl.store(ptrs, tl.cumsum(c, axis=0) - c + run[None, :], mask=m)
            run += tl.sum(c, axis=0)
        padded = (run + BM - 1) // BM * BM
        ends = total + tl.cumsum(padded, axis=0)
        tl.store(group_end_ptr + g, ends, mask=gmask)
        tl.store(group_count_ptr + g, run, mask=gmask)
        total += tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total)


@triton.jit(do_not_specialize=_NO_SPEC_IDS + ["N", "NT", "num_blocks"])
def _align_scatter_kernel(
    topk_ptr,
    stride_topk_t,
    stride_topk_k,
    lora_ptr,
    stride_lora_t,
    tile_offsets_ptr,
    group_end_ptr,
    group_count_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_lora_ptr,
    N,
    K,
    E,
    L,
    G,
    NT,
    num_blocks,
    HAS_LORA: tl.constexpr,
    INCLUDE_NO_ADAPTER: tl.constexpr,
    TILE: tl.constexpr,
    BM: tl.constexpr,
    BLOCKS: tl.constexpr,
    GB: tl.constexpr,
):
    """Programs < NT scatter their tile's pairs; the others fill block ids and padding sentinels."""
    pid = tl.program_id(0)
    # (names differ between the two branches: the compiler requires one type per name across them)
    if pid < NT:
        loc = tl.arange(0, TILE)
        key = _pair_keys(
            topk_ptr,
            stride_topk_t,
            stride_topk_k,
            lora_ptr,
            stride_lora_t,
            pid * TILE + loc,
            N,
            K,
            E,
            L,
            G,
            HAS_LORA,
            INCLUDE_NO_ADAPTER,
        )
        sc = tl.sort(key * TILE + loc)  # unique composites: a fixed order, stable by position
        sk = sc // TILE
        src = sc - sk * TILE
        _, first = tl.associative_scan((sk, loc), 0, _run_start)
        live = sk < G
        g = tl.where(live, sk, 0)
        cnt = tl.load(group_count_ptr + g, mask=live, other=0)
        start = tl.load(group_end_ptr + g, mask=live, other=0) - (cnt + BM - 1) // BM * BM
        off = tl.load(tile_offsets_ptr + pid * G + g, mask=live, other=0)
        tl.store(sorted_ptr + start + off + (loc - first), pid * TILE + src, mask=live)
    else:
        b = (pid - NT) * BLOCKS + tl.arange(0, BLOCKS)
        bmask = b < num_blocks
        bs = b * BM
        grp = tl.zeros((BLOCKS,), dtype=tl.int32)
        for g0 in range(0, G, GB):
            gg = g0 + tl.arange(0, GB)
            ends = tl.load(group_end_ptr + gg, mask=gg < G, other=2147483647)
            grp += tl.sum((ends[None, :] <= bs[:, None]).to(tl.int32), axis=1)
        valid = grp < G
        bg = tl.where(valid, grp, 0)
        tl.store(block_expert_ptr + b, tl.where(valid, bg % E, -1), mask=bmask)
        if HAS_LORA:
            s = bg // E
            lora = tl.where(valid & (s < L), s, -1)
        else:
            lora = tl.full((BLOCKS,), -1, tl.int32)
        tl.store(block_lora_ptr + b, lora, mask=bmask)
        bcnt = tl.load(group_count_ptr + bg, mask=bmask & valid, other=0)
        end = tl.load(group_end_ptr + bg, mask=bmask & valid, other=0)
        real_end = end - (bcnt + BM - 1) // BM * BM + bcnt
        rows = bs[:, None] + tl.arange(0, BM)[None, :]
        pad = (~valid)[:, None] | (rows >= real_end[:, None])
        tl.store(sorted_ptr + rows, tl.full((BLOCKS, BM), 0, tl.int32) + N, mask=bmask[:, None] & pad)


# ----------------------------------------------------------------------------------------------
# sizes, workspace, launcher
# ----------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _groups_padded(num_groups: int) -> int:
    """Gp: G rounded up to SCRATCH_ALIGN entries (the offset of the group counts and the tile counts)."""
    return -(-int(num_groups) // SCRATCH_ALIGN) * SCRATCH_ALIGN


@dataclass(frozen=True)
class AlignSizes:
    """Static sizes of one alignment (Python ints, computed on the host from shapes only).

    Attributes:
        num_pairs: N = T·K (also the sentinel).
        num_groups: G = slots·E.
        block_size_m: BLOCK_SIZE_M.
        padded: P = :func:`~moelora_lib.routing.max_padded_pairs` (N, G, BM), entries of sorted_token_ids.
        num_blocks: P / BM.
        tile: pairs per tile program (power of two, 16..1024).
        num_tiles: NT = max(1, ceil(N / tile)).
        scratch: int32 scratch entries, 2·Gp + NT·G: group ends at [0, G), group counts at
            [Gp, Gp + G), tile counts at [2·Gp, 2·Gp + NT·G), Gp = G rounded up to a multiple of
            :data:`SCRATCH_ALIGN` (4 entries, 16 bytes), so every sub-buffer starts 16-byte aligned
            at an offset that does not depend on T.
    """

    num_pairs: int
    num_groups: int
    block_size_m: int
    padded: int
    num_blocks: int
    tile: int
    num_tiles: int
    scratch: int


def align_sizes(num_pairs: int, num_groups: int, block_size_m: int, tile: int | None = None) -> AlignSizes:
    """The static sizes of an alignment, checked against the int32 offsets the kernels use.

    Pure arithmetic on Python ints (no tensor), so the int32 edge can be tested without huge tensors.
    ``tile`` (pairs per tile program, a power of two in [16, 1024]) defaults to next_pow2(T·K / 8)
    clamped to [64, 512] (the H200's best tiles, see the module docstring).

    Raises:
        ValueError: ``num_pairs`` (T·top_k), ``num_groups`` or their padded size too large for int32
            offsets: P + FILL_ROWS, NT·TILE, NT·G and (G + 1)·TILE must stay ≤ 2^31 - 1.
    """
    N, G, BM = int(num_pairs), int(num_groups), int(block_size_m)
    P = max_padded_pairs(N, G, BM)
    if tile is None:
        tile = min(512, max(64, _pow2(N // 8)))
    elif not is_int(tile) or not 16 <= tile <= 1024 or tile & (tile - 1):
        raise ValueError(f"tile must be None or a power of two in [16, 1024], got {tile!r}")
    nt = max(1, -(-N // tile))
    limits = {
        "padded size P + FILL_ROWS": P + FILL_ROWS,
        "tiled pair count NT·TILE": nt * tile,
        "scratch NT·G + 2·Gp": nt * G + 2 * _groups_padded(G),
        "sort key (G + 1)·TILE": (G + 1) * tile,
    }
    for what, v in limits.items():
        if v > INT32_MAX:
            raise ValueError(
                f"num_pairs (T·top_k = {N}) with num_groups = {G}, block_size_m = {BM}: {what} = {v} "
                f"exceeds the int32 offsets of the alignment kernels (max {INT32_MAX}); "
                "split the batch into smaller calls"
            )
    return AlignSizes(N, G, BM, P, P // BM, tile, nt, nt * G + 2 * _groups_padded(G))


@dataclass(frozen=True)
class AlignWorkspace:
    """Preallocated buffers of :func:`align_tokens_triton` (``out=``), for allocation-free calls.

    Built by :func:`align_workspace` for up to ``max_num_pairs`` pairs; a call with N ≤ max_num_pairs
    pairs uses prefixes of these buffers, so one workspace serves every T up to a ``max_tokens`` and a
    CUDA graph can capture the call. The returned :class:`Alignment` holds *views* of the workspace:
    the next call through the same workspace overwrites them.

    Attributes:
        sorted_token_ids: [P_max] int32.
        block_expert_ids: [P_max / BM] int32.
        block_lora_ids: [P_max / BM] int32.
        num_tokens_post_padded: [1] int32.
        scratch: [S_max] int32: group ends, group counts, tile counts/offsets (layout in
            :class:`AlignSizes`).
        max_num_pairs, num_experts, num_adapters (0 = expert-only), block_size_m: what it was built for.
    """

    sorted_token_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    block_lora_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    scratch: torch.Tensor
    max_num_pairs: int
    num_experts: int
    num_adapters: int
    block_size_m: int


def _num_groups(num_experts: int, num_adapters: int) -> int:
    return num_experts * (num_adapters + 1 if num_adapters else 1)


def align_workspace(
    max_num_pairs: int,
    num_experts: int,
    block_size_m: int,
    num_adapters: int = 0,
    *,
    device: torch.device | str = "cpu",
    tile: int | None = None,
) -> AlignWorkspace:
    """Allocate an :class:`AlignWorkspace` for up to ``max_num_pairs`` = max_tokens·top_k pairs.

    Args:
        max_num_pairs: largest T·K the workspace serves (≥ 0).
        num_experts: E.
        block_size_m: BLOCK_SIZE_M (power of two ≥ 16).
        num_adapters: L for the (adapter, expert) alignment, 0 for the expert-only one.
        device: where the buffers live.
        tile: the ``tile`` the calls will pass (None = the default); the scratch is sized for it.
    Raises:
        ValueError: bad sizes (as :func:`align_sizes` and :func:`align_tokens_triton`).
    """
    _check_scalars(num_experts, block_size_m)
    if not is_int(max_num_pairs) or max_num_pairs < 0:
        raise ValueError(f"max_num_pairs must be an int >= 0, got {max_num_pairs!r}")
    if not is_int(num_adapters) or num_adapters < 0:
        raise ValueError(f"num_adapters must be an int >= 0 (0 = expert-only), got {num_adapters!r}")
    G = _num_groups(num_experts, num_adapters)
    sz = align_sizes(max_num_pairs, G, block_size_m, tile)
    scratch = sz.scratch
    if tile is None:
        # The default tile shrinks with N = T·K, so a call with fewer pairs can need more tiles than
        # max_num_pairs does (520 pairs: 5 tiles of 128; 322 pairs: 6 tiles of 64). The default tile
        # is N // 8 rounded up to a power of two, clamped to [64, 512], so no call needs more than
        # max(9, ceil(max_num_pairs / 512)) tiles.
        scratch = max(scratch, max(9, -(-int(max_num_pairs) // 512)) * G + 2 * _groups_padded(G))
    i32 = dict(dtype=torch.int32, device=device)
    return AlignWorkspace(
        sorted_token_ids=torch.empty(sz.padded, **i32),
        block_expert_ids=torch.empty(sz.num_blocks, **i32),
        block_lora_ids=torch.empty(sz.num_blocks, **i32),
        num_tokens_post_padded=torch.empty(1, **i32),
        scratch=torch.empty(scratch, **i32),
        max_num_pairs=int(max_num_pairs),
        num_experts=int(num_experts),
        num_adapters=int(num_adapters),
        block_size_m=int(block_size_m),
    )


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _check_topk_ids(topk_ids) -> tuple[int, int]:
    """(T, K) of topk_ids [T, K] int32/int64; else ValueError (messages as routing.align_tokens)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got {_desc(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    T, K = topk_ids.shape
    return T, K


def _check_lora_ids(lora_ids, topk_ids: torch.Tensor, num_adapters, check_adapters: bool = True) -> None:
    """lora_ids must be an int32/int64 tensor [T] on topk_ids' device; with ``check_adapters``,
    num_adapters an int >= 1 (checked between dtype and shape, in routing.align_tokens' order)."""
    if not isinstance(lora_ids, torch.Tensor) or lora_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lora_ids must be an int32/int64 tensor [T], got {_desc(lora_ids)}")
    if check_adapters and (not is_int(num_adapters) or num_adapters < 1):
        raise ValueError(f"num_adapters must be an int >= 1 with lora_ids, got {num_adapters!r}")
    T = topk_ids.shape[0]
    if lora_ids.shape != (T,):
        raise ValueError(f"lora_ids must be [T={T}], got {_desc(lora_ids)}")
    if lora_ids.device != topk_ids.device:
        raise ValueError(f"lora_ids is on {lora_ids.device}, topk_ids on {topk_ids.device}")


def _check_scalars(num_experts, block_size_m) -> None:
    # Same checks and messages as routing.align_tokens.
    if not is_int(block_size_m) or block_size_m < 16 or block_size_m & (block_size_m - 1):
        raise ValueError(f"block_size_m must be a power of two >= 16, got {block_size_m!r}")
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")


class AlignLaunch(NamedTuple):
    """One kernel launch of an alignment (nothing allocated, nothing run).

    name: ``"count"``, ``"scan"`` or ``"scatter"``; kernel: the jitted kernel; grid; args: the
    positional launch arguments; constexprs: the keyword constexprs (num_warps/num_stages: Triton's
    defaults). ``kernel[grid](*args, **constexprs)`` runs it.
    """

    name: str
    kernel: Any
    grid: tuple
    args: tuple
    constexprs: dict


def align_launch_args(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size_m: int,
    lora_ids: torch.Tensor | None = None,
    num_adapters: int = 0,
    include_no_adapter: bool = False,
    *,
    out: AlignWorkspace | None = None,
    tile: int | None = None,
) -> tuple[Alignment, tuple[AlignLaunch, ...]]:
    """The :class:`Alignment` (outputs allocated, or views of ``out``; not yet written) and the three
    :class:`AlignLaunch` es of :func:`align_tokens_triton`; validates and allocates, launches nothing.

    The single source of the alignment's launch arguments, shared with compile-only inspection
    (counted by ``align_length_keys`` in ``tests/offset_view_helpers.py``). Arguments and errors: as
    :func:`align_tokens_triton`. ``kernel[grid](*args, **constexprs)`` for each launch, in order,
    computes the alignment.
    """
    _check_scalars(num_experts, block_size_m)
    T, K = _check_topk_ids(topk_ids)
    has_lora = lora_ids is not None
    if has_lora:
        _check_lora_ids(lora_ids, topk_ids, num_adapters)
    L = int(num_adapters) if has_lora else 0
    E, BM = int(num_experts), int(block_size_m)
    G = _num_groups(E, L)
    sz = align_sizes(T * K, G, BM, tile)
    N, P, NB, NT = sz.num_pairs, sz.padded, sz.num_blocks, sz.num_tiles
    dev = topk_ids.device

    if out is None:
        i32 = dict(dtype=torch.int32, device=dev)
        sorted_ids = torch.empty(P, **i32)
        block_e = torch.empty(NB, **i32)
        block_l = torch.empty(NB, **i32)
        num_post = torch.empty(1, **i32)
        scratch = torch.empty(sz.scratch, **i32)
    else:
        if not isinstance(out, AlignWorkspace):
            raise ValueError(f"out must be an AlignWorkspace (align_workspace(...)), got {_desc(out)}")
        want = (E, L, BM)
        have = (out.num_experts, out.num_adapters, out.block_size_m)
        if have != want:
            raise ValueError(
                f"out workspace was built for (num_experts, num_adapters, block_size_m) = {have}, "
                f"this call needs {want}"
            )
        if out.max_num_pairs < N or out.scratch.numel() < sz.scratch:
            raise ValueError(
                f"out workspace holds {out.max_num_pairs} pairs and {out.scratch.numel()} scratch entries, "
                f"this call has T·K = {N} and needs {sz.scratch} (tile {sz.tile})"
            )
        if out.sorted_token_ids.device != dev:
            raise ValueError(f"out workspace is on {out.sorted_token_ids.device}, topk_ids on {dev}")
        sorted_ids = out.sorted_token_ids[:P]
        block_e = out.block_expert_ids[:NB]
        block_l = out.block_lora_ids[:NB]
        num_post = out.num_tokens_post_padded
        scratch = out.scratch

    Gp = _groups_padded(G)
    group_end = scratch[:G]
    group_count = scratch[Gp : Gp + G]
    tile_counts = scratch[2 * Gp : 2 * Gp + NT * G]
    lora_arg = lora_ids if has_lora else topk_ids  # dummy pointer without LoRA
    stride_lora = lora_ids.stride(0) if has_lora else 0
    gp = _pow2(G)
    tile = sz.tile
    common = dict(HAS_LORA=has_lora, INCLUDE_NO_ADAPTER=bool(include_no_adapter), TILE=tile)
    ids_args = (topk_ids, topk_ids.stride(0), topk_ids.stride(1), lora_arg, stride_lora)
    count = AlignLaunch(
        "count",
        _align_count_kernel,
        (NT,),
        (*ids_args, tile_counts, N, K, E, L, G),
        dict(GB=min(gp, 1024), **common),
    )
    tc = min(_pow2(NT), 32)
    scan = AlignLaunch(
        "scan",
        _align_scan_kernel,
        (1,),
        (tile_counts, group_end, group_count, num_post, NT, G),
        dict(BM=BM, TC=tc, GB=min(gp, max(64, _TILE_ELEMS // tc))),
    )
    blocks = max(1, FILL_ROWS // BM)
    scatter = AlignLaunch(
        "scatter",
        _align_scatter_kernel,
        (NT + triton.cdiv(NB, blocks),),
        (*ids_args, tile_counts, group_end, group_count, sorted_ids, block_e, block_l, N, K, E, L, G, NT, NB),
        dict(BM=BM, BLOCKS=blocks, GB=min(gp, max(16, _TILE_ELEMS // blocks)), **common),
    )
    return Alignment(sorted_ids, block_e, block_l, num_post, BM, N), (count, scan, scatter)


def align_tokens_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size_m: int,
    lora_ids: torch.Tensor | None = None,
    num_adapters: int = 0,
    include_no_adapter: bool = False,
    *,
    out: AlignWorkspace | None = None,
    tile: int | None = None,
) -> Alignment:
    """Group (token, k) pairs by (adapter slot, expert), pad each group to BLOCK_SIZE_M — in Triton.

    Same arguments and result as :func:`moelora_lib.routing.align_tokens` with ``check_values=False``
    (bit for bit); three launches, no host sync, static sizes (see the module docstring for the method).

    Args:
        topk_ids: [T, K] int32/int64, values in [0, E); any strides.
        num_experts: E.
        block_size_m: BLOCK_SIZE_M, a power of two ≥ 16.
        lora_ids: [T] int32/int64, adapter of each token in [-1, L) (-1 = no adapter); None =
            expert-only alignment (the base GEMMs).
        num_adapters: L (slots); required (≥ 1) with lora_ids.
        include_no_adapter: keep pairs of tokens with lora id -1 (slot L, laid out last); the LoRA
            kernels pass False.
        out: optional :class:`AlignWorkspace` (from :func:`align_workspace`, same E, BLOCK_SIZE_M and
            L — 0 for expert-only —, max_num_pairs ≥ T·K, same device): no allocation at all, for CUDA
            graph capture; the result then holds views of it. Without it, outputs and a small int32
            scratch (2·Gp + NT·G entries, see :class:`AlignSizes`) are allocated.
        tile: pairs per tile program, a power of two in [16, 1024]; None = next_pow2(T·K / 8) clamped
            to [64, 512]. A performance knob only (the result does not depend on it); with ``out``, build
            the workspace with the same ``tile``.
    Returns:
        :class:`~moelora_lib.routing.Alignment`: sorted_token_ids [P] int32 (pair ids t·K + k, stable
        inside a group, sentinel T·K in padding), block_expert_ids / block_lora_ids [P / BM] int32
        (-1 past the end; lora -1 for the no-adapter slot and the expert-only alignment),
        num_tokens_post_padded [1] int32, with P = ``max_padded_pairs(T·K, G, BM)``.
    Raises:
        ValueError: as routing.align_tokens (block_size_m, num_experts, topk_ids/lora_ids shapes and
            dtypes, lora_ids without num_adapters ≥ 1), plus: tensors on different devices, T·K or G too
            large for int32 offsets (:func:`align_sizes`), an ``out`` workspace that does not fit.
        Id values are not checked (no host sync); out-of-range pairs are dropped.
    """
    alignment, launches = align_launch_args(
        topk_ids,
        num_experts,
        block_size_m,
        lora_ids,
        num_adapters,
        include_no_adapter,
        out=out,
        tile=tile,
    )
    for ln in launches:
        ln.kernel[ln.grid](*ln.args, **ln.constexprs)
    return alignment
