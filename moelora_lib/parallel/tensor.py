"""Tensor parallelism for the dense multi-LoRA projections (:class:`moelora_lib.LoRALinear`), in the
column/row-parallel form of Megatron-LM, the LoRA factors split along with their base weight.

* :class:`ColumnParallelLoRALinear` (attention qkv, the dense MLP's gate_up): the base weight's output
  rows are split over the ranks, each slice on its own (rank r holds rows [r·N_s/w, (r+1)·N_s/w) of every
  slice s: its q heads, its KV heads, its part of gate and of up). The shrink needs the whole input,
  which every rank has (x replicated), so A is held whole and the shrink needs no communication; B is
  split like the base rows. The output is this rank's columns [T, Σ N_s/w]: the next op (the rank's
  attention heads, the activation) works on them. (vLLM's ``ColumnParallelLinearWithLoRA`` splits the same
  way; S-LoRA splits A too and all-reduces the rank intermediate, holding no factor whole.)
* :class:`RowParallelLoRALinear` (attention o, the dense MLP's down), the split of S-LoRA (Sheng et al.,
  "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", arXiv:2311.03285): the base weight's input
  columns are split (rank r holds columns [r·H/w, (r+1)·H/w), matching the column-parallel output before
  it), and so is A. Each rank computes its partial base output x_r·W_rᵀ and its partial rank intermediate
  x_r·A_rᵀ; the intermediate ([T, S·R] fp32, small) is all-reduced, so every rank holds the whole x·Aᵀ;
  each rank expands it with its rows of B (output columns [r·N/w, (r+1)·N/w)) into the same columns of
  its partial output, and one all-reduce of the [T, N] output adds the partial base outputs and places
  each rank's delta columns: the delta's communication rides on the base all-reduce. The bias is added
  once, after it. (vLLM's ``RowParallelLinearWithLoRA`` instead holds B whole and expands the partial
  intermediate on every rank: no intermediate all-reduce, world times the expand work and B's memory.)

Every rank holds its shard from construction on: the constructors take the shard (the static
``shard_weight`` cuts it from a whole weight); :meth:`~ColumnParallelLoRALinear.load_adapter` takes the
whole adapter (as every rank reads it from one folder) and keeps its part. All ranks must make the same
calls in the same order (forward with the same T and slot restriction, load/unload).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..common import check_kernel_dtype, check_slices
from ..common import describe as _desc
from ..kernels.dense_lora import dense_expand, dense_shrink
from ..linear import LoRALinear, _check_cpu_backend, _check_values
from .comm import all_reduce, group_rank_world

__all__ = ["ColumnParallelLoRALinear", "RowParallelLoRALinear"]


def _shard_of(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ValueError(f"{what} = {n} must be divisible by the tensor-parallel world size {world}")
    k = n // world
    return rank * k, (rank + 1) * k


class ColumnParallelLoRALinear(LoRALinear):
    """A :class:`~moelora_lib.LoRALinear` holding one rank's output rows of every slice (module docstring).

    Args:
        weight: [Σ_s N_s/w, H], this rank's rows of each slice, slices concatenated
            (:meth:`shard_weight` cuts them from the whole [N_total, H] weight).
        bias: [Σ_s N_s/w] (cut the same way) or None.
        slices: the whole layer's slice widths (N_0, ..., N_{S-1}) (default: one slice, N_total =
            weight rows · world); each must be divisible by the world size.
        group: a ``torch.distributed`` process group or None (the default group; one process without
            torch.distributed initialized).
        Other keywords: :class:`~moelora_lib.LoRALinear`'s (num_adapters, max_rank, max_tokens, stage,
        config, debug, deterministic, share_scratch).
    Forward: x [T, H] (the whole input, the same on every rank), lora_ids [T] -> [T, Σ_s N_s/w], this rank's
    columns of each slice (no communication).
    Raises: ValueError naming the argument (slices not divisible by the world size, weight rows not
    Σ N_s/w, group not a process group) and what LoRALinear raises.

    Attributes beyond LoRALinear's (whose ``slices`` / ``out_features`` are this rank's): ``global_slices``,
    ``global_in_features`` (the whole layer's, what :meth:`load_adapter` takes), ``rank``, ``world_size``,
    ``group``.
    """

    def __init__(self, weight, bias=None, *, slices: Sequence[int] | None = None, group=None, **kw):
        rank, world = group_rank_world(group)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D tensor [Σ N_s/world, H] (this rank's rows), got {_desc(weight)}"
            )
        n_local = weight.shape[0]
        slices = check_slices((n_local * world,) if slices is None else slices)
        for n in slices:
            _shard_of(n, rank, world, f"slices: width {n} in {slices}")
        local = tuple(n // world for n in slices)
        if sum(local) != n_local:
            raise ValueError(
                f"weight has {n_local} rows; this rank's share of slices {slices} over {world} ranks is "
                f"Σ N_s/world = {sum(local)} (cut it with ColumnParallelLoRALinear.shard_weight)"
            )
        super().__init__(weight, bias, slices=local, **kw)
        self.global_slices, self.global_in_features = slices, self.in_features
        self.group, self.rank, self.world_size = group, rank, world

    @staticmethod
    def shard_weight(t: torch.Tensor, slices: Sequence[int], rank: int, world_size: int) -> torch.Tensor:
        """This rank's rows of each slice of ``t`` (dim 0 = N_total = Σ slices: a weight [N_total, H], a
        bias [N_total] or an adapter B [N_total, r]), concatenated: [Σ N_s/world, ...] (a copy).
        Raises ValueError naming the argument (t's dim 0 not Σ slices, a slice not divisible)."""
        slices = check_slices(slices)
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != sum(slices):
            raise ValueError(f"t must have N_total = {sum(slices)} rows (dim 0), got {_desc(t)}")
        parts, o = [], 0
        for n in slices:
            a, b = _shard_of(n, rank, world_size, f"slices: width {n} in {slices}")
            parts.append(t[o + a : o + b])
            o += n
        return torch.cat(parts).contiguous()

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + f", global_slices={self.global_slices}, rank={self.rank}/{self.world_size}"
        )

    def load_adapter(self, slot: int, lora_a, lora_b, scaling=1.0) -> None:
        """Load the whole adapter (as :meth:`LoRALinear.load_adapter <moelora_lib.LoRALinear.load_adapter>`,
        shapes of the whole layer: lora_a[s] [r, H], lora_b[s] [N_s, r] with N_s of ``global_slices``);
        this rank keeps A whole and its rows of each B. Raises ValueError naming the argument."""
        As, Bs = self._per_slice("lora_a", lora_a), self._per_slice("lora_b", lora_b)
        local = []
        for s, b in enumerate(Bs):
            if isinstance(b, torch.Tensor) and b.dim() == 2:
                n = self.global_slices[s]
                if b.shape[0] != n:
                    raise ValueError(f"lora_b[{s}] must have shape [N_s, r] = ({n}, r), got {tuple(b.shape)}")
                a0, a1 = _shard_of(n, self.rank, self.world_size, f"slices: width {n}")
                b = b[a0:a1]
            local.append(b)
        super().load_adapter(slot, As, local, scaling)


class RowParallelLoRALinear(LoRALinear):
    """A :class:`~moelora_lib.LoRALinear` holding one rank's input columns, whose forward all-reduces
    (module docstring: the S-LoRA split of A, the intermediate all-reduced, B's rows by output column).

    Args:
        weight: [N, H/w], this rank's input columns (:meth:`shard_weight`); N must be divisible by the
            world size (each rank expands N/w output columns).
        bias: [N] (whole) or None: added once, after the all-reduce.
        group: a ``torch.distributed`` process group or None (as :class:`ColumnParallelLoRALinear`).
        Other keywords: :class:`~moelora_lib.LoRALinear`'s; one slice only (``slices`` is not taken), and
            ``gemv_max_tokens`` 0 only.
    Forward: x [T, H/w] (this rank's columns of the input, e.g. its attention heads' output), lora_ids [T]
    -> [T, N], the whole output, the same on every rank.
    Raises: ValueError naming the argument (N not divisible by the world size, group not a process group)
    and what LoRALinear raises.

    Attributes beyond LoRALinear's (whose ``in_features`` is this rank's H/w, ``slices`` this rank's
    (N/w,) of the expand and ``lora_b`` [L, N/w, R] its rows of B; ``out_features`` stays N):
    ``global_slices`` = (N,), ``global_in_features`` = H, ``rank``, ``world_size``, ``group``.
    """

    def __init__(self, weight, bias=None, *, group=None, **kw):
        if "slices" in kw:
            raise ValueError("slices: a RowParallelLoRALinear has one output slice (o_proj, down_proj)")
        if kw.get("gemv_max_tokens"):  # its forward all-reduces the rank intermediate between the launches
            raise ValueError(
                "gemv_max_tokens must be 0 for a RowParallelLoRALinear (no one-launch decode path)"
            )
        kw["gemv_max_tokens"] = 0
        rank, world = group_rank_world(group)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D tensor [N, H/world] (this rank's columns), got {_desc(weight)}"
            )
        N = weight.shape[0]
        self._cols = _shard_of(N, rank, world, "weight: N (output features, dim 0)")  # B rows = output cols
        super().__init__(weight, bias, **kw)
        self.global_slices, self.global_in_features = (N,), self.in_features * world
        self.group, self.rank, self.world_size = group, rank, world
        c0, c1 = self._cols  # the slots keep this rank's rows of B; the expand writes those output columns
        self.lora_b = self.lora_b[:, c0:c1].clone()
        self.slices, self.offsets = (c1 - c0,), (0,)
        self._configs.clear()

    @staticmethod
    def shard_weight(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """This rank's columns (last dim) of ``t`` (a weight [N, H], or an adapter A [r, H]): [..., H/world]
        (a copy). Raises ValueError naming the argument (H not divisible by world_size)."""
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"t must be a tensor [..., H], got {_desc(t)}")
        a, b = _shard_of(t.shape[-1], rank, world_size, "t: H (input features, last dim)")
        return t[..., a:b].contiguous()

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", global_in_features={self.global_in_features}, rank={self.rank}/{self.world_size}"
        )

    def load_adapter(self, slot: int, lora_a, lora_b, scaling=1.0) -> None:
        """Load the whole adapter (lora_a [r, H], lora_b [N, r], as LoRALinear's with the whole layer's
        shapes; one-entry lists are accepted too): this rank keeps its columns of A and its rows of B.
        Raises ValueError naming the argument."""
        As, Bs = self._per_slice("lora_a", lora_a), self._per_slice("lora_b", lora_b)
        a, b = As[0], Bs[0]
        if isinstance(a, torch.Tensor) and a.dim() == 2:
            if a.shape[1] != self.global_in_features:
                raise ValueError(
                    f"lora_a[0] must have shape [r, H] = (r, {self.global_in_features}), got {tuple(a.shape)}"
                )
            a = self.shard_weight(a, self.rank, self.world_size)
        if isinstance(b, torch.Tensor) and b.dim() == 2:
            N = self.global_slices[0]
            if b.shape[0] != N:
                raise ValueError(f"lora_b[0] must have shape [N, r] = ({N}, r), got {tuple(b.shape)}")
            b = b[self._cols[0] : self._cols[1]]
        super().load_adapter(slot, [a], [b], scaling)

    def _forward_impl(self, x: torch.Tensor, lora_ids: torch.Tensor) -> torch.Tensor:
        """The eager body of the custom op: partial base, shrink of this rank's columns, all-reduce of
        the rank intermediate, expand of this rank's output columns into the partial output, all-reduce
        of the output, bias."""
        self._check_call(x, lora_ids)
        dt, dev = self.weight.dtype, self.weight.device
        if self._buffers_key != (dt, dev):  # built, moved (.to()) or unpickled
            check_kernel_dtype(dt, dev, "the layer's weight (after .to())", _check_cpu_backend)
            self._check_runs_here(dev)
        if self.debug:
            _check_values(lora_ids, self.L)
        out = F.linear(x, self.weight)  # this rank's partial sum; the bias after the all-reduce
        T = x.shape[0]
        if T and self._launches(self._active_slots)[0]:  # host-side: the same on every rank
            if self._buffers_key != (dt, dev):
                self._alloc_buffers()
            cfg, st = self.config_for(T), self.stage
            # empty slots -> -1, aligned (shared within a StepAlignments scope), as LoRALinear
            align = self._lora_alignment(lora_ids, T, cfg.block_size_m)
            inter = self._view("inter", (T, self.S * self.R))
            if cfg.shrink.SPLIT_K == 1:  # rows without an adapter are not written: no stale values summed
                inter.zero_()
            inter = dense_shrink(
                x, self.lora_a, align, cfg.shrink, use_even_k=st.even_k,
                specialize_lengths=st.specialize_lengths, inter=inter,
            )  # fmt: skip
            all_reduce(inter, self.group)  # x·Aᵀ of the whole input on every rank
            c0, c1 = self._cols
            cols, b = out[:, c0:c1], self.lora_b  # this rank's output columns, its rows of B
            common = dict(slices=(c1 - c0,), use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)
            if st.fused_add:
                dense_expand(inter, b, cols, align, cfg.expand, add_inputs=True, **common)
            else:
                delta = torch.full(
                    cols.shape, -0.0, dtype=torch.float32 if dt == torch.float16 else dt, device=dev
                )
                dense_expand(inter, b, delta, align, cfg.expand, add_inputs=False, **common)
                cols.add_(delta)
        all_reduce(out, self.group)
        if self.bias is not None:
            out.add_(self.bias)
        return out
