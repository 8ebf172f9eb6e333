"""Both token alignments of a layer call in ONE launch, for decode / small batches:
:func:`align_tokens_pair`.

A MoE + multi-LoRA layer call needs two alignments of the same (token, k) pairs: the expert-only one
for the base grouped GEMMs and the (adapter, expert) one for the LoRA ops, each with its own
BLOCK_SIZE_M. :func:`moelora_lib.kernels.align.align_tokens_triton` spends three launches on each; at
T ≤ 256 those six small launches cost more in launch ramp and latency than in work. Here one launch
with grid (2,) does both: program 0 the expert-only alignment, program 1 the LoRA one, each inside
one CTA with every phase in registers plus a small global scratch, phases separated by
``tl.debug_barrier()`` (a CTA barrier, which also orders the CTA's global memory accesses).

Contract: that of :mod:`moelora_lib.kernels.align` (its docstring), i.e. each result is bit for bit
``routing.align_tokens(..., check_values=False)``: the base one with ``lora_ids=None``, the LoRA one
with ``(lora_ids, num_adapters, include_no_adapter)`` (False by default, as the LoRA kernels use it).
Ids out of range (topk_ids ∉ [0, E), lora_ids ∉ [-1, L)) are not checked (no host sync): their
pairs are dropped and never written out of bounds, as the oracle drops them.

Method (per program; the counting-sort layout of vLLM's ``moe_align_block_size``, csrc/moe, with the
stable rank taken from a sort instead of atomic cursors, so every run gives the same bytes). The
pairs p < BLOCK = 2^LOG are seen as NR rows of C pairs (p = r·C + j; C = min(BLOCK, ROW_PAIRS); by
default one row, see below):

0. Load the group key of every pair (key = slot·E + expert; G for pairs past N, dropped, or out of
   range). Prefill ``sorted_token_ids[0:P] = N``, the block ids with -1, and two [NR, G] int32 scratch
   tables (run starts, run ends) with 0. Sort each row's distinct composites ``key·C + j`` with a
   bitonic network (Batcher's sorting network over a [NR] + [2]*log2(C) hypercube view; the partner
   across a bit is ``sum over that size-2 axis - self``): ascending keys, and inside a key ascending
   pair ids — the stable order. Barrier.
1. Neighbours by ``tl.gather``: where a run of equal keys starts (ends) at sorted position j of row
   r, write j (j + 1) to the start (end) table at (r, key). One writer per entry. Barrier.
2. Load both tables: count = end - start (0 for a group absent from the row: both stay 0); per group
   the total count, its padded size, the exclusive ``tl.cumsum`` over groups (padded group start) and
   the sum (``num_tokens_post_padded``); per (row, group) ``base = padded_start + (count in earlier
   rows) - start``. With NR·next_pow2(G) ≤ 8192 this is one register tile, else a loop over group
   chunks that writes ``base`` over the start table (plus a barrier).
3. The pair at sorted position j of row r goes to ``dest = j + base[r, key]`` (``tl.gather`` from
   registers, or a load): write its pair id there. A destination at a multiple of BLOCK_SIZE_M is the
   first row of a block, and every block in use starts with a real pair, so that pair's writer also
   writes the block's expert (and adapter) id; blocks past the end keep the prefilled -1.

No atomics, no host sync, deterministic; two or three barriers.

Sizes. BLOCK (a constexpr) is next_pow2(T·K), at least :data:`MIN_BLOCK`, so a decode step does not
pay for the largest batch: a handful of binaries per model (one per power of two), none per T —
every length-dependent int (N, the block counts) and the ids' pointers and strides are
``do_not_specialize``; the output buffers are views of a workspace at length-independent 128-byte
aligned offsets (:class:`PairWorkspace`).

Why: on the H200 this one launch aligns both problems in 2.4–8.1 µs for T·K ≤ 1024 GPT-OSS-20B pairs,
against 12–13 µs for align.py's two three-launch calls; at 2048 pairs its single CTA per problem is
the slower one for GPT-OSS-20B (17 vs 14 µs; docs/perf_notes.md), hence :data:`PAIR_PATH_MAX_PAIRS`.
Every phase grows with N in one CTA, so more, shorter rows do not help (rows of 64 pairs are slower
than one row of 2048): ROW_PAIRS = SMALL_MAX_PAIRS (one row) by default; the row split is a knob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ..common import is_int
from ..routing import Alignment, max_padded_pairs
from .align import _check_lora_ids, _check_topk_ids, _desc

__all__ = [
    "SMALL_MAX_PAIRS",
    "MAX_GROUPS",
    "MIN_BLOCK",
    "PairWorkspace",
    "pair_workspace",
    "align_tokens_pair",
    "pairs_block",
    "pair_launch_args",
    "PairLaunch",
    "ROW_PAIRS",
    "PAIR_PATH_MAX_PAIRS",
    "use_pair_path",
]

#: Largest N = T·K one program aligns: 2048 covers GPT-OSS-20B (K = 4) to T = 512 and Qwen3-30B-A3B
#: (K = 8) to T = 256. Registers would allow more (2048 pairs, 16 warps: 59 registers, no spill on
#: sm_90; 4096 pairs compiled without spill too), time does not: at 4096 pairs one CTA took 61-78 µs
#: on the H200 (intermediate versions) against 29 µs for the multi-CTA
#: :mod:`moelora_lib.kernels.align`, and already at 2048 GPT-OSS pairs that path is faster (14 vs
#: 17 µs, module docstring).
SMALL_MAX_PAIRS = 2048
#: Where the serving layer and the public call use this one-launch path instead of the three launches
#: of :mod:`moelora_lib.kernels.align` (both alignments): up to 1024 pairs. First H200 check (graph
#: replay, base + LoRA, µs, this path vs align.py): GPT-OSS-20B 2.4 vs 11.9 at 4 pairs, 8.1 vs 13.2 at
#: 1024, 16.9 vs 14.1 at 2048; Qwen3-30B-A3B 3.2 vs 22.9 at 8 pairs, 9.9 vs 25.4 at 1024.
PAIR_PATH_MAX_PAIRS = 1024
#: Largest group count G = (L + 1)·E: the per-group vector (next_pow2(G) entries) is held in registers
#: (G = 4096, e.g. E = 256 with L = 15: 138 registers at 4 warps, no spill on sm_90).
MAX_GROUPS = 4096
#: Smallest pair vector (BLOCK); BLOCK = max(MIN_BLOCK, next_pow2(T·K)).
MIN_BLOCK = 64
#: Pairs per row (C = min(BLOCK, ROW_PAIRS)): a program sorts NR = BLOCK / C rows. One row by default
#: (shorter rows were slower on the H200, module docstring); a workspace holds the tables for the
#: ROW_PAIRS in force when it was built.
ROW_PAIRS = SMALL_MAX_PAIRS
#: Largest [NR, groups] tile phase 2 holds in registers at once.
_REG_TABLE = 8192
#: Workspace sub-buffers start at multiples of this many int32 entries (128 bytes).
_ALIGN = 32
#: Entries one fill iteration writes.
_FILL = 2048
_NO_SPEC = ["topk_ptr", "stride_t", "stride_k", "lora_ptr", "stride_l", "N", "NB_BASE", "NB_LORA"]


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _index_bit(LOG: tl.constexpr, BIT: tl.constexpr):
    """Bit BIT of the in-row index, as a 0/1 tensor broadcastable over a [R] + [2]*LOG hypercube."""
    return tl.reshape(tl.arange(0, 2), [1] + [1] * (LOG - 1 - BIT) + [2] + [1] * BIT)


@triton.jit
def _bitonic_sort_rows(x, LOG: tl.constexpr):
    """Sort every row of x [R, 2^LOG] int32 ascending; values distinct inside a row, and small
    enough that two of them sum in int32.

    Batcher's bitonic network along the row: stage s merges runs of 2^s (ascending where index bit
    s is 0, descending where it is 1; the last stage all ascending) by compare-exchanges across bits
    s - 1, ..., 0. On the [R] + [2]*LOG hypercube view the partner across a bit is the other entry
    of a size-2 axis: ``sum over that axis - self`` (a plain sum: shuffles on the GPU, one numpy
    sum in the interpreter).
    """
    R: tl.constexpr = x.shape[0]
    h = tl.reshape(x, [R] + [2] * LOG)
    for s in tl.static_range(1, LOG + 1):
        for j in tl.static_range(s):
            # compare-exchange across bit s - 1 - j (hypercube axis 1 + LOG - s + j)
            partner = tl.sum(h, axis=1 + LOG - s + j, keep_dims=True) - h
            lo = tl.minimum(h, partner)
            hi = tl.maximum(h, partner)
            if s < LOG:
                take_hi = _index_bit(LOG, s - 1 - j) != _index_bit(LOG, s)
            else:
                take_hi = _index_bit(LOG, s - 1 - j) != 0
            h = tl.where(take_hi, hi, lo)
    return tl.reshape(h, [R, 2**LOG])


@triton.jit
def _align_one(
    topk_ptr,
    stride_t,
    stride_k,
    lora_ptr,
    stride_l,
    sorted_ptr,
    block_e_ptr,
    block_l_ptr,
    npost_ptr,
    start_ptr,
    end_ptr,
    N,
    NB,
    K: tl.constexpr,
    E: tl.constexpr,
    L: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    ROWG: tl.constexpr,
    BM: tl.constexpr,
    NR: tl.constexpr,
    LOGC: tl.constexpr,
    GC: tl.constexpr,
    HAS_LORA: tl.constexpr,
    INCLUDE_NO_ADAPTER: tl.constexpr,
    FILL: tl.constexpr,
):
    """One alignment in one program (phases 0-3 of the module docstring): NR rows of C = 2^LOGC
    pairs; ``start_ptr`` / ``end_ptr``: [NR, ROWG] int32 tables (row r, group g)."""
    C: tl.constexpr = 2**LOGC
    row = tl.arange(0, NR)[:, None]
    col = tl.arange(0, C)[None, :]

    # ---- phase 0: keys; prefill outputs and tables; sort each row ---------------------------------
    p = row * C + col
    live = p < N
    t = p // K
    k = p - t * K
    e = tl.load(topk_ptr + t.to(tl.int64) * stride_t + k.to(tl.int64) * stride_k, mask=live, other=0)
    ok = live & (e >= 0) & (e < E)
    key = e.to(tl.int32)
    if HAS_LORA:
        lo = tl.load(lora_ptr + t.to(tl.int64) * stride_l, mask=live, other=0)
        ok = ok & (lo >= -1) & (lo < L)
        if not INCLUDE_NO_ADAPTER:
            ok = ok & (lo >= 0)
        key = tl.where(lo < 0, L, lo).to(tl.int32) * E + key
    key = tl.where(ok, key, G)

    fill = tl.arange(0, FILL)
    P = NB * BM  # a multiple of BM >= 16: whole-vector masks, so the fill stores vectorize
    for r0 in range(0, P, FILL):
        tl.store(sorted_ptr + r0 + fill, tl.full((FILL,), 0, tl.int32) + N, mask=r0 + fill < P)
    for b0 in range(0, NB, FILL):
        tl.store(block_e_ptr + b0 + fill, tl.full((FILL,), -1, tl.int32), mask=b0 + fill < NB)
        tl.store(block_l_ptr + b0 + fill, tl.full((FILL,), -1, tl.int32), mask=b0 + fill < NB)
    for z0 in tl.static_range(0, NR * ROWG, FILL):
        tl.store(start_ptr + z0 + fill, tl.zeros((FILL,), tl.int32), mask=z0 + fill < NR * ROWG)
        tl.store(end_ptr + z0 + fill, tl.zeros((FILL,), tl.int32), mask=z0 + fill < NR * ROWG)

    sc = _bitonic_sort_rows(key * C + col, LOGC)  # distinct in a row: the stable order by key
    sk = sc >> LOGC
    src = row * C + (sc & (C - 1))
    kept = sk < G
    kg = tl.where(kept, sk, 0)
    jj = col + tl.zeros((NR, C), tl.int32)
    tl.debug_barrier()

    # ---- phase 1: where each key's run starts and ends inside each row ----------------------------
    # (1-D gathers over the flattened rows: Triton 3.6 fails to compile some 2-D ones for sm_90)
    flat = tl.reshape(sk, [NR * C])
    pos = tl.arange(0, NR * C)
    prev = tl.reshape(tl.gather(flat, tl.maximum(pos - 1, 0), 0), [NR, C])
    nxt = tl.reshape(tl.gather(flat, tl.minimum(pos + 1, NR * C - 1), 0), [NR, C])
    first = (jj == 0) | (prev != sk)
    last = (jj == C - 1) | (nxt != sk)
    tl.store(start_ptr + row * ROWG + kg, jj, mask=kept & first)
    tl.store(end_ptr + row * ROWG + kg, jj + 1, mask=kept & last)
    tl.debug_barrier()

    # ---- phase 2: counts, padded group starts, num_tokens_post_padded ----------------------------
    # base[r, g] = padded_start[g] + (pairs of group g in rows < r) - start[r, g]; a pair at sorted
    # position j of row r with key g goes to j + base[r, g].
    if GC >= GP:  # the whole [NR, GP] table in registers
        gg = tl.arange(0, GP)[None, :]
        tab = row * ROWG + gg
        st = tl.load(start_ptr + tab, mask=gg < G, other=0)
        cnt = tl.load(end_ptr + tab, mask=gg < G, other=0) - st
        padded = (tl.sum(cnt, 0) + BM - 1) // BM * BM
        tl.store(npost_ptr, tl.sum(padded, 0))
        base = (tl.cumsum(padded, 0) - padded)[None, :] + tl.cumsum(cnt, 0) - cnt - st
        dest = jj + tl.reshape(
            tl.gather(tl.reshape(base, [NR * GP]), tl.reshape(row * GP + kg, [NR * C]), 0), [NR, C]
        )
    else:  # GC groups at a time, base written over the start table
        total = tl.zeros((), tl.int32)
        for g0 in tl.static_range(0, G, GC):
            gg = g0 + tl.arange(0, GC)[None, :]
            tab = row * ROWG + gg
            st = tl.load(start_ptr + tab, mask=gg < G, other=0)
            cnt = tl.load(end_ptr + tab, mask=gg < G, other=0) - st
            padded = (tl.sum(cnt, 0) + BM - 1) // BM * BM
            base = (total + tl.cumsum(padded, 0) - padded)[None, :] + tl.cumsum(cnt, 0) - cnt - st
            tl.store(start_ptr + tab, base, mask=gg < G)
            total += tl.sum(padded, 0)
        tl.store(npost_ptr, total)
        tl.debug_barrier()
        dest = jj + tl.load(start_ptr + row * ROWG + kg, mask=kept, other=0)

    # ---- phase 3: scatter pair ids; block ids at block starts -------------------------------------
    tl.store(sorted_ptr + dest, src, mask=kept)
    head = kept & (dest % BM == 0)
    blk_id = dest // BM
    tl.store(block_e_ptr + blk_id, sk % E, mask=head)
    if HAS_LORA:
        slot = sk // E
        tl.store(block_l_ptr + blk_id, tl.where(slot < L, slot, -1), mask=head)


@triton.jit(do_not_specialize=_NO_SPEC)
def _align_pair_kernel(
    topk_ptr,
    stride_t,
    stride_k,
    lora_ptr,
    stride_l,
    base_sorted_ptr,
    base_block_e_ptr,
    base_block_l_ptr,
    base_npost_ptr,
    lora_sorted_ptr,
    lora_block_e_ptr,
    lora_block_l_ptr,
    lora_npost_ptr,
    base_start_ptr,
    base_end_ptr,
    lora_start_ptr,
    lora_end_ptr,
    N,
    NB_BASE,
    NB_LORA,
    K: tl.constexpr,
    E: tl.constexpr,
    L: tl.constexpr,
    GP_BASE: tl.constexpr,
    GP_LORA: tl.constexpr,
    ROWG_BASE: tl.constexpr,
    ROWG_LORA: tl.constexpr,
    BM_BASE: tl.constexpr,
    BM_LORA: tl.constexpr,
    NR: tl.constexpr,
    LOGC: tl.constexpr,
    GC_BASE: tl.constexpr,
    GC_LORA: tl.constexpr,
    INCLUDE_NO_ADAPTER: tl.constexpr,
    FILL: tl.constexpr,
):
    """Grid (2,): program 0 = expert-only alignment, program 1 = (adapter, expert) alignment.

    Scratch: per program an int32 start and end table of NR rows, row stride ROWG_BASE / ROWG_LORA."""
    if tl.program_id(0) == 0:
        _align_one(
            topk_ptr,
            stride_t,
            stride_k,
            lora_ptr,
            stride_l,
            base_sorted_ptr,
            base_block_e_ptr,
            base_block_l_ptr,
            base_npost_ptr,
            base_start_ptr,
            base_end_ptr,
            N,
            NB_BASE,
            K,
            E,
            L,
            E,
            GP_BASE,
            ROWG_BASE,
            BM_BASE,
            NR,
            LOGC,
            GC_BASE,
            False,
            False,
            FILL,
        )
    else:
        _align_one(
            topk_ptr,
            stride_t,
            stride_k,
            lora_ptr,
            stride_l,
            lora_sorted_ptr,
            lora_block_e_ptr,
            lora_block_l_ptr,
            lora_npost_ptr,
            lora_start_ptr,
            lora_end_ptr,
            N,
            NB_LORA,
            K,
            E,
            L,
            (L + 1) * E,
            GP_LORA,
            ROWG_LORA,
            BM_LORA,
            NR,
            LOGC,
            GC_LORA,
            True,
            INCLUDE_NO_ADAPTER,
            FILL,
        )


# ----------------------------------------------------------------------------------------------
# sizes, workspace, launcher
# ----------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _up(n: int, m: int = _ALIGN) -> int:
    return -(-int(n) // m) * m


def pairs_block(num_pairs: int) -> int:
    """BLOCK, the pair vector of one program: max(MIN_BLOCK, next_pow2(num_pairs)) (a constexpr: one
    binary per power of two, at most log2(SMALL_MAX_PAIRS / MIN_BLOCK) + 1 of them)."""
    return max(MIN_BLOCK, _pow2(num_pairs))


def _check_bm(name: str, bm) -> int:
    if not is_int(bm) or bm < 16 or bm & (bm - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {bm!r}")
    if bm > 2**16:
        raise ValueError(f"{name} must be <= 65536, got {bm!r}")
    return int(bm)


def _check_model(num_experts, num_adapters) -> tuple[int, int]:
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not is_int(num_adapters) or num_adapters < 1:
        raise ValueError(f"num_adapters must be an int >= 1, got {num_adapters!r}")
    E, L = int(num_experts), int(num_adapters)
    if (L + 1) * E > MAX_GROUPS:
        raise ValueError(
            f"num_experts = {E} and num_adapters = {L} give (L + 1)·E = {(L + 1) * E} groups, above "
            f"MAX_GROUPS = {MAX_GROUPS} of the one-program alignment; use kernels.align.align_tokens_triton"
        )
    return E, L


def _check_pairs(name: str, n) -> int:
    if not is_int(n) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if n > SMALL_MAX_PAIRS:
        raise ValueError(
            f"{name} = {n} exceeds SMALL_MAX_PAIRS = {SMALL_MAX_PAIRS} of the one-program alignment; "
            "use kernels.align.align_tokens_triton"
        )
    return int(n)


@dataclass(frozen=True)
class _Layout:
    """Entry offsets of the workspace's sub-buffers in one flat int32 buffer (all multiples of 32)."""

    sizes: dict
    offsets: dict
    total: int


def _rows(num_pairs: int) -> tuple[int, int]:
    """(NR, C) of a call with ``num_pairs`` pairs under the current ROW_PAIRS."""
    block = pairs_block(num_pairs)
    c = min(block, ROW_PAIRS)
    return block // c, c


def _layout(max_num_pairs: int, E: int, L: int, bm_base: int, bm_lora: int, rows: int) -> _Layout:
    P_b = max_padded_pairs(max_num_pairs, E, bm_base)
    P_l = max_padded_pairs(max_num_pairs, (L + 1) * E, bm_lora)
    tb, tl_ = rows * _up(E), rows * _up((L + 1) * E)
    sizes = {
        "base_sorted": P_b,
        "base_block_e": P_b // bm_base,
        "base_block_l": P_b // bm_base,
        "base_npost": 1,
        "lora_sorted": P_l,
        "lora_block_e": P_l // bm_lora,
        "lora_block_l": P_l // bm_lora,
        "lora_npost": 1,
        "base_start": tb,
        "base_end": tb,
        "lora_start": tl_,
        "lora_end": tl_,
    }
    offsets, off = {}, 0
    for name, n in sizes.items():
        offsets[name] = off
        off += _up(n)
    return _Layout(sizes, offsets, off)


@dataclass(frozen=True)
class PairWorkspace:
    """Preallocated buffers of :func:`align_tokens_pair` (``out=``): no allocation per call, so a CUDA
    graph can capture it.

    One flat int32 ``buffer``; every sub-buffer starts at an entry offset that is a multiple of 32
    (128 bytes) and depends only on (max_num_pairs, E, L, both BLOCK_SIZE_Ms), never on the call's T.
    A call with N = T·K ≤ max_num_pairs uses prefixes of the sub-buffers, and the returned
    :class:`~moelora_lib.routing.Alignment` s hold *views* of them (the next call through the same
    workspace overwrites them). Every entry of a returned prefix is written by the call.

    Attributes:
        buffer: [total] int32, the whole workspace.
        base / lora: dict name -> view of the full-size sub-buffer: ``sorted`` [P_max] int32,
            ``block_e`` / ``block_l`` [P_max / BM] int32, ``npost`` [1] int32.
        tables: dict name -> int32 scratch table [table_rows · (G rounded up to 32)] of run starts /
            run ends per (row, group): ``base_start``, ``base_end`` (G = E), ``lora_start``,
            ``lora_end`` (G = (L + 1)·E).
        table_rows: rows the tables hold (1 unless ROW_PAIRS was lowered before building it).
        max_num_pairs, num_experts, num_adapters, base_block_size_m, lora_block_size_m: what it was
            built for.
    """

    buffer: torch.Tensor
    base: dict
    lora: dict
    tables: dict
    table_rows: int
    max_num_pairs: int
    num_experts: int
    num_adapters: int
    base_block_size_m: int
    lora_block_size_m: int


def pair_workspace(
    max_num_pairs: int,
    num_experts: int,
    base_block_size_m: int,
    num_adapters: int,
    lora_block_size_m: int,
    *,
    device: torch.device | str = "cpu",
) -> PairWorkspace:
    """Allocate a :class:`PairWorkspace` for calls with up to ``max_num_pairs`` = max_tokens·top_k.

    Args:
        max_num_pairs: largest T·K served, 0 ≤ max_num_pairs ≤ SMALL_MAX_PAIRS.
        num_experts: E ≥ 1.
        base_block_size_m: BLOCK_SIZE_M of the expert-only alignment (power of two ≥ 16).
        num_adapters: L ≥ 1 (LoRA slots; G = (L + 1)·E ≤ MAX_GROUPS).
        lora_block_size_m: BLOCK_SIZE_M of the (adapter, expert) alignment.
        device: where the buffer lives.
    Raises:
        ValueError: naming the bad argument.
    """
    n = _check_pairs("max_num_pairs", max_num_pairs)
    E, L = _check_model(num_experts, num_adapters)
    bmb = _check_bm("base_block_size_m", base_block_size_m)
    bml = _check_bm("lora_block_size_m", lora_block_size_m)
    rows = _rows(n)[0]
    lay = _layout(n, E, L, bmb, bml, rows)
    buf = torch.empty(lay.total, dtype=torch.int32, device=device)

    def view(name):
        o = lay.offsets[name]
        return buf[o : o + lay.sizes[name]]

    parts = {
        p: {f: view(f"{p}_{f}") for f in ("sorted", "block_e", "block_l", "npost")} for p in ("base", "lora")
    }
    tables = {f: view(f) for f in ("base_start", "base_end", "lora_start", "lora_end")}
    return PairWorkspace(buf, parts["base"], parts["lora"], tables, rows, n, E, L, bmb, bml)


class PairLaunch(NamedTuple):
    """The one launch of :func:`align_tokens_pair`: ``kernel[grid](*args, **constexprs)`` runs it
    (``constexprs`` holds num_warps too)."""

    kernel: Any
    grid: tuple
    args: tuple
    constexprs: dict


def pair_launch_args(
    topk_ids: torch.Tensor,
    num_experts: int,
    base_block_size_m: int,
    lora_ids: torch.Tensor,
    num_adapters: int,
    lora_block_size_m: int,
    *,
    include_no_adapter: bool = False,
    out: PairWorkspace | None = None,
    num_warps: int | None = None,
) -> tuple[Alignment, Alignment, PairLaunch]:
    """Validate, take the outputs (views of ``out``, or of a new workspace), and build the launch of
    :func:`align_tokens_pair` without running it: ``(base, lora, launch)``. The single source of the
    launch arguments, shared with compile-only inspection (meta tensors work). Arguments and errors:
    as :func:`align_tokens_pair`."""
    T, K = _check_topk_ids(topk_ids)
    _check_lora_ids(lora_ids, topk_ids, num_adapters, check_adapters=False)  # (checked next)
    E, L = _check_model(num_experts, num_adapters)
    bmb = _check_bm("base_block_size_m", base_block_size_m)
    bml = _check_bm("lora_block_size_m", lora_block_size_m)
    N = _check_pairs("topk_ids.numel() (T·K)", T * K)
    if num_warps is not None and (
        not is_int(num_warps) or not 1 <= num_warps <= 32 or num_warps & (num_warps - 1)
    ):
        raise ValueError(f"num_warps must be None or a power of two in [1, 32], got {num_warps!r}")
    dev = topk_ids.device
    if out is None:
        out = pair_workspace(N, E, bmb, L, bml, device=dev)
    elif not isinstance(out, PairWorkspace):
        raise ValueError(f"out must be a PairWorkspace (pair_workspace(...)), got {_desc(out)}")
    else:
        want = (E, L, bmb, bml)
        have = (out.num_experts, out.num_adapters, out.base_block_size_m, out.lora_block_size_m)
        if have != want:
            raise ValueError(
                "out workspace was built for (num_experts, num_adapters, base_block_size_m, "
                f"lora_block_size_m) = {have}, this call needs {want}"
            )
        if out.max_num_pairs < N:
            raise ValueError(f"out workspace holds {out.max_num_pairs} pairs, this call has T·K = {N}")
        if out.buffer.device != dev:
            raise ValueError(f"out workspace is on {out.buffer.device}, topk_ids on {dev}")

    G_l = (L + 1) * E
    P_b, P_l = max_padded_pairs(N, E, bmb), max_padded_pairs(N, G_l, bml)
    NB_b, NB_l = P_b // bmb, P_l // bml

    def views(part: dict, P: int, NB: int, bm: int) -> Alignment:  # the call's prefixes of one part
        return Alignment(part["sorted"][:P], part["block_e"][:NB], part["block_l"][:NB], part["npost"], bm, N)

    base = views(out.base, P_b, NB_b, bmb)
    lora = views(out.lora, P_l, NB_l, bml)
    block = pairs_block(N)
    nr, c = _rows(N)
    if nr > out.table_rows:
        raise ValueError(
            f"out workspace tables hold {out.table_rows} rows, this call needs {nr} (ROW_PAIRS = "
            f"{ROW_PAIRS}); build the workspace under the same ROW_PAIRS"
        )
    gp_b, gp_l = _pow2(E), _pow2(G_l)
    if num_warps is None:
        num_warps = 4 if block <= 256 else 8 if block <= 1024 else 16
    args = (
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        lora_ids,
        lora_ids.stride(0),
        base.sorted_token_ids,
        base.block_expert_ids,
        base.block_lora_ids,
        base.num_tokens_post_padded,
        lora.sorted_token_ids,
        lora.block_expert_ids,
        lora.block_lora_ids,
        lora.num_tokens_post_padded,
        out.tables["base_start"],
        out.tables["base_end"],
        out.tables["lora_start"],
        out.tables["lora_end"],
        N,
        NB_b,
        NB_l,
    )
    constexprs = dict(
        K=max(K, 1),  # K = 0 means N = 0: every pair is masked
        E=E,
        L=L,
        GP_BASE=gp_b,
        GP_LORA=gp_l,
        ROWG_BASE=_up(E),
        ROWG_LORA=_up(G_l),
        BM_BASE=bmb,
        BM_LORA=bml,
        NR=nr,
        LOGC=c.bit_length() - 1,
        GC_BASE=min(gp_b, _REG_TABLE // nr),
        GC_LORA=min(gp_l, _REG_TABLE // nr),
        INCLUDE_NO_ADAPTER=bool(include_no_adapter),
        FILL=_FILL,
        num_warps=num_warps,
    )
    return base, lora, PairLaunch(_align_pair_kernel, (2,), args, constexprs)


def align_tokens_pair(
    topk_ids: torch.Tensor,
    num_experts: int,
    base_block_size_m: int,
    lora_ids: torch.Tensor,
    num_adapters: int,
    lora_block_size_m: int,
    *,
    include_no_adapter: bool = False,
    out: PairWorkspace | None = None,
    num_warps: int | None = None,
) -> tuple[Alignment, Alignment]:
    """Both alignments of a layer call — expert-only and (adapter, expert) — in one Triton launch.

    Bit for bit ``(routing.align_tokens(topk_ids, E, base_block_size_m, check_values=False),
    routing.align_tokens(topk_ids, E, lora_block_size_m, lora_ids, L, include_no_adapter,
    check_values=False))``. One launch with grid (2,), no host sync, no atomics, no allocation with
    ``out`` (method: module docstring).

    Args:
        topk_ids: [T, K] int32/int64, values in [0, E); any strides; T·K ≤ SMALL_MAX_PAIRS.
        num_experts: E.
        base_block_size_m: BLOCK_SIZE_M of the base GEMMs' alignment (power of two ≥ 16).
        lora_ids: [T] int32/int64, adapter of each token in [-1, L) (-1 = no adapter); any stride;
            same device as topk_ids.
        num_adapters: L ≥ 1, with (L + 1)·E ≤ MAX_GROUPS.
        lora_block_size_m: BLOCK_SIZE_M of the LoRA ops' alignment.
        include_no_adapter: keep the pairs of tokens without adapter in the LoRA alignment (slot L,
            laid out last); the LoRA kernels use False.
        out: a :class:`PairWorkspace` (:func:`pair_workspace`, same E, L, both BLOCK_SIZE_Ms,
            max_num_pairs ≥ T·K, same device); the results are then views of it. None = allocate.
        num_warps: of the launch; None = 4 up to a 256-pair vector (BLOCK), 8 up to 1024, else 16
            (the best or near it on the H200).
    Returns:
        ``(base, lora)``: two :class:`~moelora_lib.routing.Alignment`: sorted_token_ids [P] int32 (pair
        ids t·K + k, ascending inside a group, sentinel T·K in padding and past the end), block_expert_ids
        / block_lora_ids [P / BM] int32 (-1 past the end; lora -1 for every base block and the
        no-adapter slot), num_tokens_post_padded [1] int32; P = ``max_padded_pairs(T·K, G, BM)`` with
        G = E (base) and (L + 1)·E (LoRA).
    Raises:
        ValueError: naming the argument: topk_ids / lora_ids shape, dtype or device; num_experts,
            num_adapters (also G > MAX_GROUPS); a block size not a power of two ≥ 16 (or > 65536);
            T·K > SMALL_MAX_PAIRS; ``out`` not a PairWorkspace, built for other sizes, too small or
            on another device, or whose tables hold fewer rows than the call needs (ROW_PAIRS
            lowered after it was built); num_warps not a power of two in [1, 32].
        Id values are not checked (no host sync); out-of-range pairs are dropped.
    """
    base, lora, ln = pair_launch_args(
        topk_ids,
        num_experts,
        base_block_size_m,
        lora_ids,
        num_adapters,
        lora_block_size_m,
        include_no_adapter=include_no_adapter,
        out=out,
        num_warps=num_warps,
    )
    ln.kernel[ln.grid](*ln.args, **ln.constexprs)
    return base, lora


def use_pair_path(num_pairs: int, num_experts: int, num_adapters: int) -> bool:
    """True where :func:`align_tokens_pair` is the faster way to align one layer call (see
    :data:`PAIR_PATH_MAX_PAIRS`): T·K ≤ 1024 pairs and (L + 1)·E ≤ :data:`MAX_GROUPS`."""
    return 0 < num_pairs <= PAIR_PATH_MAX_PAIRS and (num_adapters + 1) * num_experts <= MAX_GROUPS
