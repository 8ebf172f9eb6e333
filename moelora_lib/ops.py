"""torch.library custom op of the serving layer: ``torch.ops.moelora.moe_lora_layer``.

:class:`moelora_lib.layer.MoELoRALayer` runs its forward through this one op, so ``torch.compile``
(``fullgraph=True``) of a model containing the layer sees one opaque node with a fake (meta)
implementation instead of tracing into the Triton launches, the host-side config pick or the
alignment workspaces.

The op takes the per-call tensors and the layer's *name*; the layer itself (weights, adapter slots,
preallocated buffers) is found in a registry of live layers (weak references, so a deleted layer
disappears from it). This is the pattern of vLLM's ``torch.ops.vllm.moe_forward(..., layer_name)``:
the weights and slots are read at run time, so loading an adapter between calls of a compiled model
needs no recompile, and the buffers the op writes internally (alignment workspaces, ``h``/``g``/``y``)
are private to the layer, never inputs or outputs of the op (hence ``mutates_args=()``).

Registering the op happens when this module is imported (``torch.library.custom_op`` at module
level); nothing else runs at import.
"""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["moe_lora_layer", "register_layer", "get_layer", "OpLayer"]

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register_layer(layer, prefix: str = "moe_lora_layer") -> str:
    """Register a live layer object and return its unique name (what the op's ``layer`` argument takes).

    The registry holds a weak reference: the name stops resolving once the layer is garbage-collected.
    """
    name = f"{prefix}_{next(_COUNTER)}"
    _LAYERS[name] = layer
    return name


def get_layer(name: str):
    """The layer registered under ``name``. Raises KeyError naming it when there is none (deleted)."""
    layer = _LAYERS.get(name)
    if layer is None:
        raise KeyError(
            f"layer {name!r}: no live layer (MoELoRALayer, LoRALinear) is registered under this name"
        )
    return layer


class OpLayer(torch.nn.Module):
    """Base of the modules whose forward runs through a custom op that finds them by name
    (:class:`moelora_lib.MoELoRALayer`, :class:`moelora_lib.LoRALinear`).

    It owns that name: :meth:`_register_op_name` at construction, and again when a copy or an unpickled
    module is made (``copy.copy``, ``copy.deepcopy``, ``torch.load`` go through ``__setstate__``), so a
    copy's op calls reach the copy, never the original. The pickled state leaves out the shared scratch
    (it holds weak references) and marks the buffers for re-attachment on the first call
    (``_buffers_key = None``). :meth:`_check_runs_here` refuses a module on a device the kernels cannot
    run on (e.g. meta, where the dispatcher would silently pick the op's fake implementation).
    """

    _op_prefix = "layer"

    def _cast_exempt(self) -> tuple[str, ...]:
        """Names of the parameters a dtype cast of the module keeps in their dtypes (the FP8 codes and
        their scales); none by default."""
        return ()

    def _apply(self, fn, recurse=True):
        # the parameters of _cast_exempt keep their dtypes through a dtype cast (.to(dtype), .half(), ...),
        # as packed MXFP4's uint8 tensors do by being integers; a device move moves them
        keep = {n: getattr(self, n).data for n in self._cast_exempt()}
        out = super()._apply(fn, recurse)
        for n, old in keep.items():
            p = getattr(self, n)
            if p.dtype != old.dtype:
                p.data = old.to(p.device)
        return out

    @property
    def deterministic(self) -> bool:
        """Bitwise-repeatable mode (SPLIT_K = 1 on the split-K launches: the shrinks, stage ``fused``'s down
        GEMM); setting it validates the value
        and drops the per-T configs resolved so far (``_configs``), so the next forward at every T
        follows it."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        from .common import check_bool

        self._deterministic = check_bool("deterministic", value)
        self._configs.clear()

    #: None, or a callable ``guard(slot, action)`` that ``load_adapter`` / ``unload_adapter`` call after
    #: checking the slot's range and before changing anything; it raises to refuse the change. A
    #: :class:`~moelora_lib.model.modeling.MultiLoRAModel` sets it on each of its modules to its
    #: ``check_slot_free`` (a slot that a running generate call reads cannot change). Not copied or
    #: pickled with the module (a copy of the model sets its own).
    slot_guard = None

    @property
    def active_slots(self) -> frozenset[int] | None:
        """The adapter slots a forward's ``lora_ids`` may name, host-side: None (the default) = any slot;
        else a frozenset of slot ints in [0, L).

        The forward makes a projection's LoRA launches (alignment, shrink, expand) only when an adapter
        loaded in one of these slots covers it (:meth:`lora_launches`); with no such slot it is exactly the
        base path, so a batch without adapters costs nothing while others are loaded.

        A row whose id names a slot outside the set gets its adapter on the projections whose launches
        run and the base output on the others (ids reach the launches mapped by the loaded slots, as
        without a restriction: no row reads an empty slot or another row). So a forward restricted to
        slots X serves a batch of slots Y exactly when every projection that an adapter of Y covers is
        covered by one of X, e.g. when X ⊇ Y or both have the same :meth:`lora_launches`; that is how one
        CUDA graph serves every batch of its launches (the Generator's LoRA variants). Keeping the set
        right is the caller's part (:meth:`~moelora_lib.model.modeling.MultiLoRAModel.restrict_slots`,
        which the Generator enters with each forward's slots); the forward reads no device data to check.

        Setting it takes None or an iterable of ints in [0, L) (ValueError naming ``active_slots``
        otherwise). Not copied or pickled with the module (a copy is unrestricted)."""
        return self._active_slots

    @active_slots.setter
    def active_slots(self, slots) -> None:
        self._active_slots = None if slots is None else self._check_slot_set("active_slots", slots)

    #: the restriction behind :attr:`active_slots` (class default: none)
    _active_slots: frozenset[int] | None = None

    def _check_slot_set(self, name: str, slots) -> frozenset[int]:
        """``slots`` (an iterable of ints in [0, L)) as a frozenset; ValueError naming ``name`` otherwise."""
        from .common import is_int

        want = f"{name}: expected None or an iterable of slot ints in [0, {self.L}), got {slots!r}"
        if isinstance(slots, (str, bytes, torch.Tensor)) or not hasattr(slots, "__iter__"):
            raise ValueError(want)
        try:
            out = frozenset(slots)
        except TypeError:  # an unhashable entry
            raise ValueError(want) from None
        bad = sorted((s for s in out if not (is_int(s) and 0 <= s < self.L)), key=repr)
        if bad:
            raise ValueError(f"{name}: slots must be ints in [0, num_adapters={self.L}), got {bad[0]!r}")
        return frozenset(int(s) for s in out)

    def _guard_slot(self, slot: int, action: str) -> None:
        if self.slot_guard is not None:
            self.slot_guard(slot, action)

    def _register_op_name(self) -> None:
        self.layer_name = register_layer(self, prefix=self._op_prefix)

    def __getstate__(self):
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_scratch"] = None  # holds weak references; re-attached on the first call
        state["_buffers_key"] = None
        state.pop("slot_guard", None)  # the owner's; a copied model installs its own
        state.pop("_active_slots", None)  # the owner's step restriction: a copy is unrestricted
        if "_bufs" in state:
            state["_bufs"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._register_op_name()  # never the original's name: its op calls stay its own

    def _check_runs_here(self, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the layer is on {device}: its kernels run on CUDA or the CPU")


@torch.library.custom_op("moelora::moe_lora_layer", mutates_args=())
def moe_lora_layer(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    lora_ids: torch.Tensor,
    layer: str,
) -> torch.Tensor:
    """One MoE+LoRA layer call of the registered layer ``layer`` (see
    :meth:`moelora_lib.layer.MoELoRALayer.forward` for the arguments).

    Args:
        hidden_states: [T, H] float16/bfloat16/float32 (the layer's dtype and device).
        router_logits: [T, E] float, or None when topk_weights/topk_ids are given.
        topk_weights: [T, K] float32 or None; topk_ids: [T, K] int32/int64 or None.
        lora_ids: [T] int32/int64 in [-1, L), -1 = no adapter.
        layer: name from :func:`register_layer`.
    Returns:
        [T, H] of hidden_states' dtype, a new tensor ([0, H] for T = 0).
    """
    return get_layer(layer)._forward_impl(hidden_states, router_logits, topk_weights, topk_ids, lora_ids)


@moe_lora_layer.register_fake
def _moe_lora_layer_fake(hidden_states, router_logits, topk_weights, topk_ids, lora_ids, layer):
    # Shape/dtype only: [T, H] like hidden_states (T may be symbolic).
    return hidden_states.new_empty(hidden_states.shape)
