"""The per-call scratch the serving modules share (:class:`moelora_lib.layer.MoELoRALayer`,
:class:`moelora_lib.linear.LoRALinear`): one :class:`Scratch` per set of sizes, dtype and device,
attached to every module of those sizes (:func:`attach_scratch`), and the modules' ``memory_report``
(:func:`memory_report`).

Modules of one model run one after another and nothing in the scratch outlives a forward, so one copy
serves them all (unless a module is built with ``share_scratch=False``). A scratch lives as long as a
module uses it: the registry of each module kind holds it weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

__all__ = ["Scratch", "nbytes", "attach_scratch", "memory_report"]


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` (None entries count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Scratch:
    """Flat buffers (``bufs``: name -> tensor, allocated by the subclass) and workspaces built on first
    use (``workspaces``: key -> workspace, :meth:`cached`), with ``users``, the live modules attached.
    Subclasses say which tensors a workspace holds (:meth:`workspace_tensors`), for :meth:`nbytes`."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}
        self.workspaces: dict[tuple, Any] = {}
        self.users: weakref.WeakSet = weakref.WeakSet()  # the live modules using this scratch

    def cached(self, key: tuple, make: Callable[..., Any], *args, **kwargs) -> Any:
        """The workspace under ``key``, made by ``make(*args, **kwargs)`` the first time."""
        ws = self.workspaces.get(key)
        if ws is None:
            ws = make(*args, **kwargs)
            self.workspaces[key] = ws
        return ws

    def workspace_tensors(self, ws) -> list[torch.Tensor]:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the buffers and of the workspaces built so far."""
        ts = list(self.bufs.values())
        for ws in self.workspaces.values():
            ts += self.workspace_tensors(ws)
        return nbytes(ts)


def attach_scratch(
    module, registry: weakref.WeakValueDictionary, key: Hashable, make: Callable[..., Scratch]
) -> Scratch:
    """Attach to ``module`` (its ``_scratch``) the scratch of ``key`` from ``registry``, made by
    ``make(*key)`` when there is none yet (or always, and not registered, when ``module.share_scratch``
    is false); the module moves from its previous scratch's users to the new one's. Returns it."""
    scratch = registry.get(key) if module.share_scratch else None
    if scratch is None:
        scratch = make(*key)
        if module.share_scratch:
            registry[key] = scratch
    if module._scratch is not None:
        module._scratch.users.discard(module)
    scratch.users.add(module)
    module._scratch = scratch
    return scratch


def memory_report(module, weights: int, slots: int) -> dict[str, int]:
    """A module's ``memory_report()``: {"weights", "adapter_slots" (the bytes given), "scratch" (its
    scratch's bytes, shared with every module attached to it), "scratch_shared_by" (those modules),
    "per_layer" (weights + slots, + scratch when not shared)}."""
    scratch = module._scratch.nbytes()
    return {
        "weights": weights,
        "adapter_slots": slots,
        "scratch": scratch,
        "scratch_shared_by": len(module._scratch.users),
        "per_layer": weights + slots + (0 if module.share_scratch else scratch),
    }
