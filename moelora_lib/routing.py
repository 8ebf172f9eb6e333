"""Top-k routing and the (adapter, expert) token alignment used by every grouped-GEMM kernel.

The alignment follows the contract of vLLM's ``moe_align_block_size`` / ``moe_lora_align_block_size``
(csrc/moe; see docs/upstream-vllm-moe-lora.md §4), re-derived here with plain torch
ops that never synchronize with the host, so the whole layer can be captured in a CUDA graph:

* every (token, k) pair ``p = t·K + k`` is put in a group ``(slot, expert)``; groups are laid out one
  after another in a flat array, each padded up to a multiple of BLOCK_SIZE_M;
* padding entries hold the sentinel ``num_pairs = T·K``, which is ≥ every real pair index, so a
  kernel masks it with ``row < num_pairs`` and can never mistake it for a real row;
* each BLOCK_SIZE_M block of the flat array belongs to exactly one group: ``block_expert_ids`` and
  ``block_lora_ids`` give its expert and adapter (-1 for blocks past the end);
* the buffer size is a static upper bound (``T·K + min(G, T·K)·(BLOCK_SIZE_M - 1)``, rounded up), and
  ``num_tokens_post_padded`` says how much of it is used.

There are L + 1 slots: adapters 0..L-1, and slot L for tokens without an adapter (lora id -1), laid
out last. The LoRA kernels use ``include_no_adapter=False`` (those pairs need no LoRA work); the base
MoE kernel uses the expert-only alignment (``lora_ids=None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import check_bool, is_int

__all__ = [
    "route",
    "Alignment",
    "align_tokens",
    "max_padded_pairs",
    "check_id_values",
    "check_finite_weights",
    "id_value_bounds",
    "check_id_bounds",
]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """Softmax top-k routing (computed in float32).

    Args:
        router_logits: [T, E] float tensor.
        top_k: K, 1 ≤ K ≤ E.
        renormalize: divide the K kept probabilities by their sum (GPT-OSS, Qwen3-MoE, Mixtral);
            False keeps the softmax probabilities (DeepSeek-V2 with norm_topk_prob=false).
    Returns:
        (topk_weights [T, K] float32, topk_ids [T, K] int32). A row of router_logits holding NaN or +inf
        (or only -inf) gets NaN weights and unspecified ids in [0, E): the values are not checked here (a
        host sync); :func:`moelora_lib.fused_moe_lora` then refuses the weights as not finite, and
        :class:`~moelora_lib.MoELoRALayer` gives that token a NaN output row.
    Raises:
        ValueError: router_logits not a 2-D float tensor, top_k outside [1, E], or renormalize not a
            Python bool.
    """
    check_bool("renormalize", renormalize)
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(f"router_logits must be a 2-D tensor [T, E], got {_desc(router_logits)}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a float tensor, got dtype {router_logits.dtype}")
    E = router_logits.shape[1]
    if not is_int(top_k) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


@dataclass(frozen=True)
class Alignment:
    """Pairs grouped by (slot, expert), each group padded to BLOCK_SIZE_M.

    Attributes:
        sorted_token_ids: [P] int32, pair indices t·K + k; padding = ``num_pairs`` (the sentinel).
        block_expert_ids: [P / BLOCK_SIZE_M] int32, expert of each block, -1 past the end.
        block_lora_ids: [P / BLOCK_SIZE_M] int32, adapter of each block; -1 past the end, for the
            no-adapter slot, and for every block of the expert-only alignment.
        num_tokens_post_padded: [1] int32, entries of ``sorted_token_ids`` in use (multiple of BM).
        block_size_m: BLOCK_SIZE_M.
        num_pairs: T·K, also the sentinel value.
    """

    sorted_token_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    block_lora_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_size_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        """Blocks in the static buffer (an upper bound on the blocks in use)."""
        return self.block_expert_ids.numel()


def max_padded_pairs(num_pairs: int, num_groups: int, block_size_m: int) -> int:
    """Static size of ``sorted_token_ids``: every non-empty group wastes at most BM - 1 rows."""
    p = num_pairs + min(num_groups, num_pairs) * (block_size_m - 1)
    return max(block_size_m, -(-p // block_size_m) * block_size_m)


def id_value_bounds(topk_ids: torch.Tensor, lora_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Min and max of the id tensors, on their device, with no host sync.

    Returns [4] int64: min and max of topk_ids, then of lora_ids. An empty tensor (or lora_ids None)
    gives the in-range pair (0, 0) for topk_ids and (-1, -1) for lora_ids, so it always passes
    :func:`check_id_bounds`. Two reductions (``torch.aminmax``) and one concatenation.
    """
    parts = []
    for t, empty in ((topk_ids, 0), (lora_ids, -1)):
        if t is None or t.numel() == 0:
            parts.append(torch.full((2,), empty, dtype=torch.int64, device=topk_ids.device))
        else:
            lo, hi = torch.aminmax(t.reshape(-1))
            parts.append(torch.stack([lo, hi]).to(torch.int64))
    return torch.cat(parts)


def check_id_bounds(bounds, num_experts: int, num_adapters: int) -> None:
    """Raise ValueError unless ``bounds`` (the 4 values of :func:`id_value_bounds`, on the host) say
    topk_ids ∈ [0, E) and lora_ids ∈ [-1, L). The message names the tensor, the range and the min/max."""
    t_lo, t_hi, l_lo, l_hi = (int(v) for v in bounds)
    if t_lo < 0 or t_hi >= num_experts:
        raise ValueError(f"topk_ids values must be in [0, E={num_experts}), got min {t_lo}, max {t_hi}")
    if l_lo < -1 or l_hi >= num_adapters:
        raise ValueError(
            f"lora_ids values must be in [-1, L={num_adapters}) (-1 = no adapter), got min {l_lo}, max {l_hi}"
        )


def check_id_values(
    topk_ids: torch.Tensor, num_experts: int, lora_ids: torch.Tensor | None = None, num_adapters: int = 0
) -> None:
    """Check the id *values* (one host sync): topk_ids ∈ [0, E) and, if given, lora_ids ∈ [-1, L).

    The one value check of the package: :func:`align_tokens` (``check_values``),
    :func:`moelora_lib.fused_moe_lora` and :class:`moelora_lib.MoELoRALayer` (``debug=True``) use it
    (fused_moe_lora on a GPU reads the same :func:`id_value_bounds` after launching, so its one sync
    waits only for the bounds). Empty tensors pass. Raises ValueError naming the tensor, the range and
    the min/max found.
    """
    check_id_bounds(id_value_bounds(topk_ids, lora_ids).tolist(), num_experts, num_adapters)


def check_finite_weights(topk_weights: torch.Tensor) -> None:
    """ValueError naming topk_weights when it holds NaN or inf (one host sync; empty tensors pass).

    A non-finite routing weight turns the token's output row into NaN (it multiplies the down output).
    """
    if topk_weights.numel() and not bool(torch.isfinite(topk_weights).all()):
        bad = int((~torch.isfinite(topk_weights)).sum())
        raise ValueError(f"topk_weights must be finite, got {bad} NaN or inf value(s)")


def align_tokens(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size_m: int,
    lora_ids: torch.Tensor | None = None,
    num_adapters: int = 0,
    include_no_adapter: bool = False,
    check_values: bool = True,
    *,
    sort_lora_ids: torch.Tensor | None = None,
) -> Alignment:
    """Group (token, k) pairs by (adapter slot, expert) and pad each group to BLOCK_SIZE_M.

    Args:
        topk_ids: [T, K] int32/int64, values in [0, E).
        num_experts: E.
        block_size_m: BLOCK_SIZE_M, a power of two ≥ 16.
        lora_ids: [T] int32, adapter of each token in [-1, L); None = expert-only alignment.
        num_adapters: L (slots); required with lora_ids.
        include_no_adapter: keep pairs of tokens with lora id -1 (slot L, laid out last); the LoRA
            kernels pass False.
        check_values: also check topk_ids ∈ [0, E) and lora_ids ∈ [-1, L) (a host sync; the layer
            passes False after :func:`moelora_lib.fused_moe_lora` has checked them). Without it, pairs
            with an id out of range are dropped (in no group), as the Triton alignments
            (:mod:`moelora_lib.kernels.align`) drop them.
        sort_lora_ids: [T] int32/int64 adapter ids, only for the expert-only alignment (lora_ids
            None; needs num_adapters ≥ 1): the groups stay one per expert, padded as without it, but
            inside each expert's group the pairs are ordered by their token's adapter (ids outside
            [0, L), e.g. -1, last), then by pair index. Stage ``fused`` uses it so that a base tile
            holds the rows of one or two adapters instead of all of them (its GEMMs run one LoRA dot
            per adapter present in a tile; :mod:`moelora_lib.kernels.fused`). The blocks' experts and
            the set of pairs per expert are those of the unsorted alignment.
    Returns:
        :class:`Alignment`. Computed with device-side torch ops only (no host sync unless
        check_values).
    Raises:
        ValueError: block_size_m not a power of two ≥ 16, num_experts < 1, lora_ids without
            num_adapters ≥ 1, bad tensor shapes or dtypes, include_no_adapter / check_values not a bool,
            bad sort_lora_ids, or (check_values) ids out of range.
    """
    if not is_int(block_size_m) or block_size_m < 16 or block_size_m & (block_size_m - 1):
        raise ValueError(f"block_size_m must be a power of two >= 16, got {block_size_m!r}")
    check_bool("include_no_adapter", include_no_adapter)
    check_bool("check_values", check_values)
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got {_desc(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if lora_ids is not None:
        if not isinstance(lora_ids, torch.Tensor) or lora_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lora_ids must be an int32/int64 tensor [T], got {_desc(lora_ids)}")
        if not is_int(num_adapters) or num_adapters < 1:
            raise ValueError(f"num_adapters must be an int >= 1 with lora_ids, got {num_adapters!r}")
    if sort_lora_ids is not None:
        if lora_ids is not None:
            raise ValueError("sort_lora_ids applies to the expert-only alignment: pass lora_ids=None with it")
        if not isinstance(sort_lora_ids, torch.Tensor) or sort_lora_ids.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValueError(f"sort_lora_ids must be an int32/int64 tensor [T], got {_desc(sort_lora_ids)}")
        if sort_lora_ids.shape != (topk_ids.shape[0],):
            raise ValueError(f"sort_lora_ids must be [T={topk_ids.shape[0]}], got {_desc(sort_lora_ids)}")
        if not is_int(num_adapters) or not 1 <= num_adapters < 2**31:
            raise ValueError(
                f"num_adapters must be an int in [1, 2**31) with sort_lora_ids, got {num_adapters!r}"
            )
        if sort_lora_ids.device != topk_ids.device:
            raise ValueError(
                f"sort_lora_ids must be on topk_ids' device {topk_ids.device}, got {sort_lora_ids.device}"
            )
    if check_values:
        check_id_values(topk_ids, num_experts, lora_ids, num_adapters)
    T, K = topk_ids.shape
    dev = topk_ids.device
    num_pairs = T * K
    E = num_experts
    experts = topk_ids.reshape(-1).long()
    out_of_range = (experts < 0) | (experts >= E)
    if lora_ids is None:
        num_slots = 1
        key = experts
    else:
        if lora_ids.shape != (T,):
            raise ValueError(f"lora_ids must be [T={T}], got {_desc(lora_ids)}")
        num_slots = num_adapters + 1
        slot = lora_ids.long().repeat_interleave(K)
        out_of_range |= (slot < -1) | (slot >= num_adapters)
        slot = torch.where(slot < 0, torch.full_like(slot, num_adapters), slot)
        key = slot * E + experts
    G = num_slots * E
    if lora_ids is not None and not include_no_adapter:
        key = torch.where(key >= num_adapters * E, torch.full_like(key, G), key)  # G = dropped
    key = torch.where(out_of_range, torch.full_like(key, G), key)  # dropped, as the Triton alignments do
    P = max_padded_pairs(num_pairs, G, block_size_m)
    BM = block_size_m

    counts = torch.zeros(G + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:G] + BM - 1) // BM * BM
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    # dropped pairs go past the end of the buffer and are cut off below
    starts_ext = torch.cat([starts, ends.new_full((1,), P)])

    if sort_lora_ids is None:
        order = torch.argsort(key, stable=True)
    else:  # by (expert, adapter slot) then pair: each expert's run in `order` stays where it was
        slot = sort_lora_ids.long().repeat_interleave(K)
        slot = torch.where((slot < 0) | (slot >= num_adapters), torch.full_like(slot, num_adapters), slot)
        order = torch.argsort(key * (num_adapters + 1) + slot, stable=True)
    skey = key[order]
    sorted_start = torch.cumsum(counts, 0) - counts  # first position of each group in `order`
    rank = torch.arange(num_pairs, device=dev) - sorted_start[skey]
    dest = starts_ext[skey] + rank
    buf = torch.full((P + num_pairs,), num_pairs, dtype=torch.int32, device=dev)
    buf.scatter_(0, dest, order.to(torch.int32))
    sorted_token_ids = buf[:P].contiguous()

    num_blocks = P // BM
    block_start = torch.arange(num_blocks, device=dev) * BM
    group = torch.searchsorted(ends, block_start, right=True)  # group g: starts[g] <= bs < ends[g]
    valid = group < G
    group_c = group.clamp(max=G - 1)
    block_expert_ids = torch.where(valid, group_c % E, -1).to(torch.int32)
    if lora_ids is None:
        block_lora_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=dev)
    else:
        s = group_c // E
        block_lora_ids = torch.where(valid & (s < num_adapters), s, -1).to(torch.int32)
    num_post = ends[-1:].to(torch.int32)
    return Alignment(sorted_token_ids, block_expert_ids, block_lora_ids, num_post, BM, num_pairs)
