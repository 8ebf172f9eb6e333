"""The collectives the parallel modules use, as thin calls of ``torch.distributed`` on one process group.

A ``group`` argument is a ``torch.distributed`` process group, or None for the default group — or, when
``torch.distributed`` is not initialized, a group of one process (rank 0 of 1), in which every collective
is the identity: the parallel modules then compute exactly what the one-process modules do, which is how
they are tested without spawning processes. No communication layer of our own: NCCL on CUDA tensors,
gloo on CPU tensors, whatever backend the group was created with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["group_rank_world", "all_reduce", "all_gather", "reduce_scatter", "check_group"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def check_group(group, name: str = "group"):
    """``group`` if it is None or a ``torch.distributed`` ProcessGroup; ValueError naming ``name``
    otherwise (e.g. a rank list, which torch.distributed would take as a different call)."""
    if group is None:
        return None
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise ValueError(
            f"{name} must be a torch.distributed ProcessGroup (dist.new_group(...), dist.group.WORLD) or "
            f"None (the default group), got {type(group).__name__}"
        )
    return group


def group_rank_world(group) -> tuple[int, int]:
    """(rank of this process in ``group``, size of ``group``); (0, 1) for None without torch.distributed
    initialized. Raises ValueError naming ``group`` if this process is not a member of it."""
    check_group(group)
    if group is None and not _initialized():
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group")
    return rank, dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` in place; returns ``t``."""
    if group_rank_world(group)[1] > 1:
        dist.all_reduce(t, group=group)
    return t


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on every rank -> [world·n, ...], rank r's rows at [r·n, (r+1)·n) (every rank passes the same
    shape; the collective fails or hangs otherwise)."""
    world = group_rank_world(group)[1]
    if world == 1:
        return t
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t.contiguous(), group=group)
    return out


def reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
    """[world·n, ...] on every rank -> [n, ...]: rank r gets rows [r·n, (r+1)·n) of the sum over ranks."""
    world = group_rank_world(group)[1]
    if world == 1:
        return t
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: {t.shape[0]} rows do not split over {world} ranks")
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, t.contiguous(), group=group)
    return out
