"""Expert parallelism for :class:`moelora_lib.MoELoRALayer`: each rank of a process group holds E/world
experts and their adapter slots, and the ranks' shares of the top-k sum are added by a collective.

The layer itself does the per-rank part (its ``expert_map``: global expert id -> local id, -1 = held
elsewhere; a pair routed elsewhere costs no GEMM work and adds zero). :class:`ExpertParallelMoELoRALayer`
adds the communication, in one of two forms (``tokens``):

* ``"replicated"``: every rank holds the same T tokens — the hidden states after a tensor-parallel
  attention's all-reduce, or of a replicated attention. Each rank routes all of them (the router is
  replicated), runs its local experts' base + LoRA on the pairs routed to them, and one all-reduce of the
  [T, H] output sums the shares. No dispatch is needed: the tokens, their routing and their adapter ids
  are already on every rank.
* ``"sharded"``: each rank holds its own T tokens (data-parallel attention). The hidden states, the
  routing (router logits, or top-k weights and ids) and the adapter ids are all-gathered (world·T rows on
  every rank, rank r's at [r·T, (r+1)·T)), each rank runs its local experts on the pairs routed to them,
  and a reduce-scatter returns to each rank the sum of the shares of its own rows. This is the naive
  dispatch/combine of vLLM's expert-parallel MoE (all-gather + reduce-scatter); an all-to-all dispatch that
  sends each pair only to the rank of its expert pays off when world·T·H bytes dominate, and is not
  implemented here. Every rank must pass the same T (pad to the largest); ``max_tokens`` bounds the
  gathered world·T.

The adapter ids travel with their tokens (all-gathered with them in the sharded form), so every rank
applies each token's adapter to the pairs it computes — the per-token adapter ids carried through the
dispatch of vLLM's expert-parallel MoE LoRA (vllm-project/vllm#40867). An adapter is loaded on every rank
from the same (whole) tensors; each rank keeps its experts' rows (``MoELoRALayer.load_adapter`` with an
expert_map).

Reference designs (read to understand, not copied): vLLM's ``FusedMoE`` expert map and naive all2all
manager, and its MoE LoRA layer with expert parallelism (#40867).
"""

from __future__ import annotations

import torch

from ..common import is_int
from ..layer import MoELoRALayer
from ..quant.fp8 import FP8BlockWeight
from ..quant.mxfp4 import MXFP4Weight
from .comm import all_gather, all_reduce, group_rank_world, reduce_scatter

__all__ = ["contiguous_expert_map", "shard_experts", "ExpertParallelMoELoRALayer", "TOKEN_LAYOUTS"]

#: the two forms of :class:`ExpertParallelMoELoRALayer` (its ``tokens`` argument)
TOKEN_LAYOUTS = ("replicated", "sharded")


def contiguous_expert_map(num_experts: int, rank: int, world_size: int, device=None) -> torch.Tensor:
    """The expert_map of ``rank`` when E experts are split into ``world_size`` contiguous runs: global
    expert e is on rank e // (E/world) with local id e % (E/world).

    Returns: [E] int32 (on ``device``, default CPU): local id, or -1 for the experts of other ranks.
    Raises: ValueError naming the argument: num_experts / world_size not ints ≥ 1, rank not in
    [0, world_size), world_size not dividing num_experts.
    """
    for name, v in (("num_experts", num_experts), ("world_size", world_size)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    if num_experts % world_size:
        raise ValueError(
            f"world_size = {world_size} must divide num_experts = {num_experts} (each rank holds E/world "
            "experts)"
        )
    n = num_experts // world_size
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[rank * n : (rank + 1) * n] = torch.arange(n, dtype=torch.int32)
    return m.to(device) if device is not None else m


def _local_experts(expert_map: torch.Tensor) -> torch.Tensor:
    """The global ids of the local experts, in local-id order: [E_local] int64 on the CPU."""
    m = expert_map.detach().to("cpu", torch.int64)
    local = m >= 0
    order = torch.argsort(m[local])
    return local.nonzero().flatten()[order]


def shard_experts(w, expert_map: torch.Tensor):
    """The rows of ``w`` (dim 0 = the E_global experts) that a rank with ``expert_map`` holds, in local-id
    order: a tensor [E_global, ...] (weights, biases, adapter factors), an
    :class:`~moelora_lib.quant.MXFP4Weight` or an :class:`~moelora_lib.quant.FP8BlockWeight`; None stays
    None. A copy on w's device.

    Raises: ValueError naming ``w`` when its dim 0 is not E_global = len(expert_map)."""
    if w is None:
        return None
    Eg = expert_map.shape[0]
    if not isinstance(w, (torch.Tensor, MXFP4Weight, FP8BlockWeight)) or w.shape[0] != Eg:
        raise ValueError(
            f"w must have the E_global = {Eg} experts in dim 0, got {type(w).__name__} "
            f"{tuple(getattr(w, 'shape', ()))}"
        )
    idx = _local_experts(expert_map)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, idx.to(t.device)).contiguous()

    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(rows(w.blocks), rows(w.scales))
    if isinstance(w, FP8BlockWeight):
        return FP8BlockWeight(rows(w.weight), rows(w.scale_inv), w.block)
    return rows(w)


class ExpertParallelMoELoRALayer(MoELoRALayer):
    """A :class:`~moelora_lib.MoELoRALayer` holding one rank's experts, whose forward returns the whole MoE
    output by communicating over ``group`` (module docstring: the ``"replicated"`` and ``"sharded"`` forms).

    Args:
        w13: [E_local, 2I, H], w2: [E_local, H, I]: this rank's experts (dense, or packed as the layer
            takes them), in local-id order; :func:`shard_experts` cuts them from the whole weights, and
            :meth:`from_full` does it for every expert tensor.
        group: a ``torch.distributed`` process group, or None (the default group; without
            torch.distributed initialized, one process holding every expert).
        expert_map: [E_global] int (global id -> local id, -1 = on another rank); None = the contiguous
            split :func:`contiguous_expert_map` (E_global = E_local·world).
        tokens: "replicated" (default) or "sharded" (module docstring).
        b13: [E_local, 2I] or None; b2: [E_local, H] or None.
        Other keywords: :class:`~moelora_lib.MoELoRALayer`'s (top_k, num_adapters, max_rank, max_tokens,
        slices, dtype, activation, renormalize, stage, config, debug, deterministic, share_scratch).
        ``max_tokens`` bounds the tokens one rank computes: T ("replicated"), world·T ("sharded").
    Raises:
        ValueError naming the argument: tokens not one of :data:`TOKEN_LAYOUTS`, group not a process group,
        an expert_map whose local experts are not w13's E_local, and what MoELoRALayer raises.

    Adapters: :meth:`load_adapter` takes the whole adapter ([E_global, ...] factors, as every rank reads it
    from one folder) and keeps this rank's experts' rows. Every rank must make the same calls in the same
    order (forward, with the same T; load/unload): the forward's collectives pair up across ranks.
    """

    def __init__(
        self, w13, w2, *, group=None, expert_map: torch.Tensor | None = None, tokens: str = "replicated", **kw
    ):
        if tokens not in TOKEN_LAYOUTS:
            raise ValueError(f"tokens must be one of {TOKEN_LAYOUTS}, got {tokens!r}")
        rank, world = group_rank_world(group)
        E = w13.shape[0] if hasattr(w13, "shape") else None
        if expert_map is None and is_int(E):
            expert_map = contiguous_expert_map(E * world, rank, world)
        super().__init__(w13, w2, expert_map=expert_map, **kw)
        self.group, self.tokens, self.rank, self.world_size = group, tokens, rank, world

    @classmethod
    def from_full(cls, w13, w2, *, group=None, expert_map=None, b13=None, b2=None, **kw):
        """The layer of this rank built from the whole expert tensors ([E_global, ...]: w13, w2, b13, b2),
        keeping the rows of its experts (``expert_map``, default the contiguous split over ``group``).
        Other arguments as the constructor. Raises ValueError naming the argument (world size not
        dividing E_global included)."""
        rank, world = group_rank_world(group)
        if expert_map is None:
            Eg = w13.shape[0] if hasattr(w13, "shape") else None
            if not is_int(Eg):
                raise ValueError(
                    f"w13 must be a tensor [E_global, 2I, H] or a packed weight, got {type(w13).__name__}"
                )
            try:
                expert_map = contiguous_expert_map(Eg, rank, world)
            except ValueError as exc:
                raise ValueError(f"group: {exc}") from None
        names = ("w13", "w2", "b13", "b2")
        parts = {}
        for name, t in zip(names, (w13, w2, b13, b2)):
            try:
                parts[name] = shard_experts(t, expert_map)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return cls(
            parts["w13"],
            parts["w2"],
            group=group,
            expert_map=expert_map,
            b13=parts["b13"],
            b2=parts["b2"],
            **kw,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tokens={self.tokens!r}, rank={self.rank}/{self.world_size}"

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        lora_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The whole MoE layer on this rank's T tokens (arguments and errors as
        :meth:`MoELoRALayer.forward <moelora_lib.MoELoRALayer.forward>`, expert ids global).

        "replicated": the local experts' share, all-reduced over the group: [T, H], the same on every
        rank. "sharded": hidden_states, the routing and lora_ids all-gathered to world·T rows, the local
        experts' share of those, reduce-scattered back to this rank's [T, H]."""
        if self.world_size == 1:
            return super().forward(
                hidden_states, router_logits, topk_weights=topk_weights, topk_ids=topk_ids, lora_ids=lora_ids
            )
        if self.tokens == "replicated":
            out = super().forward(
                hidden_states, router_logits, topk_weights=topk_weights, topk_ids=topk_ids, lora_ids=lora_ids
            )
            return all_reduce(out, self.group)
        # sharded: the arguments are checked on this rank's rows before anything is sent
        self._check_runs_here(self._ref.device)
        T = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else 0
        if isinstance(hidden_states, torch.Tensor) and T * self.world_size > self.max_tokens:
            raise ValueError(
                f"hidden_states: T = {T} per rank gathers to world·T = {T * self.world_size} tokens, more "
                f"than the layer's max_tokens = {self.max_tokens}"
            )
        self._check_call(hidden_states, router_logits, topk_weights, topk_ids, lora_ids)
        g = self.group
        x = all_gather(hidden_states, g)
        ids = all_gather(lora_ids, g)
        if router_logits is not None:
            out = super().forward(x, all_gather(router_logits, g), lora_ids=ids)
        else:
            out = super().forward(
                x, topk_weights=all_gather(topk_weights, g), topk_ids=all_gather(topk_ids, g), lora_ids=ids
            )
        return reduce_scatter(out, g)
