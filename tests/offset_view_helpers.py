"""sm_90 specialization keys of layer, alignment and reduction launches under offset views and
strided id tensors (tests/test_offset_views.py). Nothing is compiled: keys come from
:func:`moelora_lib.studies.compile_check.specialization_key`. In a process that decorated the kernels
under TRITON_INTERPRET, run them through :func:`~moelora_lib.studies.compile_check.run_isolated` with
the ops :data:`OFFSET_KEYS`, :data:`ALIGN_KEYS` and :data:`REDUCE_KEYS` (:func:`reduce_keys` does it
itself)."""

from __future__ import annotations

import torch

from moelora_lib.studies.compile_check import (
    _jit,
    _layer_tensors,
    _routing,
    _stage,
    run_isolated,
    specialization_key,
)

OFFSET_KEYS = "tests.offset_view_helpers:offset_view_keys"
ALIGN_KEYS = "tests.offset_view_helpers:align_length_keys"
REDUCE_KEYS = "tests.offset_view_helpers:reduce_keys"
ID_LAYOUTS = ("contiguous", "offset", "transposed")


def _offset_view(t, offset: bool = True):
    """``t``, or a copy of it one element into a fresh buffer (data pointer not 16-byte aligned)."""
    if not offset:
        return t
    v = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    v.copy_(t)
    return v


def _id_layout(topk_ids, lora_ids, layout: str):
    """The id tensors as ``layout``: contiguous; offset views (data pointers not 16-byte aligned);
    transposed/strided (topk_ids column-major, lora_ids every other element)."""
    if layout not in ID_LAYOUTS:
        raise ValueError(f"layout must be one of {ID_LAYOUTS}, got {layout!r}")
    if layout == "offset":
        topk_ids, lora_ids = _offset_view(topk_ids), _offset_view(lora_ids)
        assert topk_ids.data_ptr() % 16 and lora_ids.data_ptr() % 16
    elif layout == "transposed":
        topk_ids = topk_ids.t().contiguous().t()
        lora_ids = torch.stack([lora_ids, lora_ids], 1).reshape(-1)[::2]
    return topk_ids, lora_ids


def _cpu_layer_run(dims, dtype, activation: str, has_bias: bool, offset: bool):
    """A CPU LayerRun (seeded inputs, ``default_config(dims)``); with ``offset`` every input is an
    offset view and topk_weights is ``buf[1:T+1]`` of a [T + 1, K] float32 buffer.
    Returns (run, names of misaligned inputs)."""
    from moelora_lib.kernels.stages import LayerRun, default_config

    T, E, K, L = dims.T, dims.E, dims.top_k, dims.adapters
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return _offset_view((torch.randn(*shape, generator=g) * 0.1).to(dtype), offset)

    topk_ids, lora_ids = _routing(T, E, K, L)
    w = torch.rand(T, K, generator=g)
    if offset:
        w = torch.cat([torch.zeros(1, K), w])[1 : T + 1]
    inputs = _layer_tensors(dims, rnd, False)
    inputs |= dict(
        topk_weights=w, topk_ids=_offset_view(topk_ids, offset), lora_ids=_offset_view(lora_ids, offset)
    )
    bias = dict(b13=rnd(E, 2 * dims.I), b2=rnd(E, dims.H)) if has_bias else {}
    run = LayerRun(_stage(), **inputs, **bias, activation=activation, config=default_config(dims))
    return run, sorted(n for n, t in {**inputs, **bias}.items() if t.data_ptr() % 16)


def offset_view_keys(T=16, H=64, I=32, E=8, K=6, L=2, R=16, *, S=2, dtype="float16", activation="silu",
                     has_bias=True, realign=True) -> dict:  # fmt: skip
    """Does an offset view of any input give a layer launch a new key? The same values as fresh
    tensors and as misaligned views; the key of every launch of ``LAUNCH_OPS`` compared.
    ``realign=False`` replaces ``aligned16`` by the identity in the offset run (what the check detects
    without it). Returns ``{"same": {launch: bool}, "misaligned_inputs": [names], "keys": {launch:
    [aligned, offset]}}``."""
    from contextlib import nullcontext
    from unittest import mock

    from moelora_lib.common import parse_dtype
    from moelora_lib.kernels.stages import LAUNCH_OPS
    from moelora_lib.shapes import Dims

    dims = Dims(T=T, H=H, I=I, E=E, top_k=K, adapters=L, rank=R, slices=S)
    keys: dict[str, list[str]] = {op: [] for op in LAUNCH_OPS}
    misaligned: list[str] = []
    for offset in (False, True):
        identity = mock.patch("moelora_lib.kernels.stages.aligned16", lambda t, name="": t)
        with identity if offset and not realign else nullcontext():
            run, bad = _cpu_layer_run(dims, parse_dtype(dtype), activation, has_bias, offset)
        misaligned = bad if offset else misaligned
        for op in LAUNCH_OPS:
            la = run.launch_args(op)
            jf = _jit(la.kernel, False)
            keys[op].append(specialization_key(jf, la.args, la.constexprs, la.num_warps, la.num_stages))
    same = {op: k[0] == k[1] for op, k in keys.items()}
    return {"same": same, "misaligned_inputs": misaligned, "keys": keys}


def align_length_keys(lengths, *, E=32, K=4, L=8, block_size_m=16, layout="contiguous", workspace=True,
                      tile=None) -> dict:  # fmt: skip
    """Keys of the Triton alignment launches (``align_launch_args``, nothing launched) of the base and
    LoRA alignments of ``_routing``'s ids for each T of ``lengths``, through one ``align_workspace`` for
    the largest T (``workspace``, as the serving layer) or fresh outputs; ``layout`` of the ids as
    :func:`_id_layout`; ``tile`` pins TILE. Returns ``{role_launch: {"keys", "classes",
    "max_keys_per_class", "per_length": {T: key index}, "key_list"}}``; a class is one tuple of
    constexpr values, so ``max_keys_per_class == 1`` means no int or pointer argument adds a variant."""
    from moelora_lib.kernels.align import align_launch_args, align_workspace

    lengths = [int(t) for t in lengths]
    if layout not in ID_LAYOUTS:
        raise ValueError(f"layout must be one of {ID_LAYOUTS}, got {layout!r}")
    ws = {}
    if workspace:
        ws = {n: align_workspace(max(lengths) * K, E, block_size_m, n, tile=tile) for n in (0, L)}
    out: dict[str, dict] = {}
    for T in lengths:
        topk_ids, lora_ids = _id_layout(*_routing(T, E, K, L), layout)
        for role, lo, n_ad in (("base", None, 0), ("lora", lora_ids, L)):
            _, launches = align_launch_args(topk_ids, E, block_size_m, lo, n_ad, out=ws.get(n_ad), tile=tile)
            for ln in launches:
                r = out.setdefault(f"{role}_{ln.name}", {"key_list": [], "per_length": {}, "by_class": {}})
                key = specialization_key(ln.kernel, ln.args, ln.constexprs)
                if key not in r["key_list"]:
                    r["key_list"].append(key)
                r["by_class"].setdefault(repr(sorted(ln.constexprs.items())), set()).add(key)
                r["per_length"][T] = r["key_list"].index(key)
    return {
        name: {
            "keys": len(r["key_list"]),
            "classes": len(r["by_class"]),
            "max_keys_per_class": max(len(v) for v in r["by_class"].values()),
            "per_length": r["per_length"],
            "key_list": r["key_list"],
        }
        for name, r in out.items()
    }


def _interpreted() -> bool:
    """True when this process decorated the kernels under TRITON_INTERPRET (they cannot compile)."""
    from triton.runtime.jit import JITFunction

    return not isinstance(_jit("lora_shrink", True), JITFunction)


def reduce_keys(T: int = 5, E: int = 32, K: int = 4, L: int = 8, H: int = 64) -> dict:
    """Keys of ``topk_reduce`` (id check on, with lora ids) for the ids in each layout of
    :func:`_id_layout`, y and out fixed. Returns ``{layout: key}``."""
    if _interpreted():
        return run_isolated([dict(op=REDUCE_KEYS, T=T, E=E, K=K, L=L, H=H)])[0]
    from moelora_lib.kernels.topk_reduce import _topk_reduce, reduce_launch_args

    y = torch.zeros(T * K, H, dtype=torch.bfloat16)
    out = torch.zeros(T, H, dtype=torch.bfloat16)
    keys = {}
    for layout in ID_LAYOUTS:
        topk_ids, lora_ids = _id_layout(*_routing(T, E, K, L), layout)
        _, args, cx = reduce_launch_args(y, topk_ids, E, lora_ids, L, True, out)
        keys[layout] = specialization_key(_topk_reduce, args, cx)
    return keys
