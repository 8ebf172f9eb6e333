"""Public functional entry point: :func:`fused_moe_lora`."""

from __future__ import annotations

import torch

from .common import (
    KERNEL_DTYPES,
    check_activations,
    check_bool,
    check_cpu_backend,
    check_no_grad,
    check_tensor,
)
from .common import describe as _desc
from .kernels import GEMV_STAGE, STAGES, LayerConfig, LayerRun, check_stage_name, stage_named
from .kernels.gemv import GemvRun
from .kernels.stages import (
    check_activation_scheme,
    config_weight_format,
    packed_config,
    resolve_activation_scheme,
)
from .quant.fp8 import FP8BlockWeight
from .quant.mxfp4 import MXFP4_BLOCK, MXFP4Weight
from .routing import check_finite_weights, check_id_bounds, check_id_values
from .shapes import Dims

__all__ = ["fused_moe_lora", "validate_moe_lora_inputs", "make_layer_run"]

_ACTIVATIONS = ("silu", "swigluoai")


def _check(
    name: str, t, shape: tuple, dtypes, device, dtype_note: str = "", like: str = "hidden_states"
) -> None:
    """:func:`moelora_lib.common.check_tensor` with ``like`` (hidden_states unless a caller names
    another) as the reference: ValueError naming ``name`` unless t is a tensor of ``shape`` ((letter,
    size) pairs, the sizes most arguments agree on, :func:`_agree`), dtype and device."""
    check_tensor(name, t, shape, dtypes, device, dtype_note, like=like)


def _agree(votes: list[tuple[str, int | None]]) -> int:
    """The size most arguments give for one shape letter (ties: the earlier argument wins).

    ``votes`` are (argument, size) pairs in priority order; None = that argument does not vote
    (absent, or not a tensor of the right rank: it fails its own check later).
    """
    sizes = [v for _, v in votes if v is not None]
    return max(sizes, key=lambda v: (sizes.count(v), -sizes.index(v)))


_NDIMS = {
    "w13": ("[E, 2I, H]", 3),
    "w2": ("[E, H, I]", 3),
    "topk_weights": ("[T, K]", 2),
    "topk_ids": ("[T, K]", 2),
    "lora_ids": ("[T]", 1),
    "lora_a13": ("[L, E, S, R, H]", 5),
    "lora_b13": ("[L, E, S, 2I/S, R]", 5),
    "lora_a2": ("[L, E, R, I]", 4),
    "lora_b2": ("[L, E, H, R]", 4),
    "b13": ("[E, 2I]", 2),
    "b2": ("[E, H]", 2),
}


def _check_cpu_backend(dtype: torch.dtype, name: str = "hidden_states") -> None:
    """:func:`~moelora_lib.common.check_cpu_backend` for the MoE kernels; ``name``: the argument the message
    names."""
    from .kernels.triton_kernels import KERNELS

    check_cpu_backend(KERNELS["fused_moe"][True], dtype, name)


def _weight_format(w) -> str:
    """The format of an expert weight as the kernels take it: "mxfp4", "fp8" or "dense"."""
    if isinstance(w, MXFP4Weight):
        return "mxfp4"
    return "fp8" if isinstance(w, FP8BlockWeight) else "dense"


def _dense_views(w13, w2, dtype) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(w13, w2, format)``: the dense weights as given (format "dense"), or for packed weights —
    :class:`MXFP4Weight` s ("mxfp4") or :class:`~moelora_lib.quant.FP8BlockWeight` s ("fp8") —
    zero-byte stand-ins of their dense shapes ([E, 2I, H], [E, H, I]) in ``dtype`` (the activations'
    dtype: :class:`~moelora_lib.MoELoRALayer`'s ``dtype``, hidden_states' in
    :func:`validate_moe_lora_inputs`; None = bfloat16) on their device, so that the dense shape, dtype
    and device checks (:func:`validate_moe_lora_inputs`, the layer's ``_check_expert_weights``) apply to
    them unchanged.

    Raises ValueError naming the argument: w13 and w2 of different formats; an MXFP4 weight whose
    blocks are not [E, N, K/32, 16] or not contiguous in the last two dims, or whose scales hold the
    e8m0 byte 255 (NaN: the kernels would decode it as inf); an FP8 weight that is not 3-D, not
    contiguous along K, or whose scale block's columns have no power-of-two divisor of at least 16
    (no K step fits one scale column); FP8 w13 and w2 of different scale blocks; ``dtype`` given with dense
    weights and different from w13's, not a torch.dtype, or with packed weights not float16, bfloat16
    or float32.
    """
    f13, f2 = _weight_format(w13), _weight_format(w2)
    if f13 != f2:
        name, other, fmt = ("w2", "w13", f13) if f13 != "dense" else ("w13", "w2", f2)
        kind = {"mxfp4": "an MXFP4Weight", "fp8": "an FP8BlockWeight"}[fmt]
        raise ValueError(
            f"{name} must be {kind} like {other} (both expert weights in one format, or both dense), "
            f"got {_desc(w2 if name == 'w2' else w13)}"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if f13 == "dense":
        if dtype is not None and isinstance(w13, torch.Tensor) and dtype != w13.dtype:
            raise ValueError(
                f"dtype = {dtype} differs from w13's {w13.dtype}: with dense weights the layer's dtype is "
                "w13's (dtype is for MXFP4 and FP8 weights)"
            )
        return w13, w2, "dense"
    dt = torch.bfloat16 if dtype is None else dtype
    if dt not in KERNEL_DTYPES:  # the layer's dtype (hidden_states' is checked before this)
        raise ValueError(
            f"dtype (the layer's, with {f13.upper()} weights) must be float16, bfloat16 or float32, got {dt}"
        )

    def standin(w):  # a zero-stride view: no memory
        return torch.empty((), dtype=dt, device=w.device).expand(w.shape)

    if f13 == "fp8":
        for name, w, layout in (("w13", w13, "[E, 2I, H]"), ("w2", w2, "[E, H, I]")):
            if w.weight.dim() != 3:
                raise ValueError(
                    f"{name} must be an FP8BlockWeight of dense shape {layout}, got {list(w.shape)}"
                )
            if w.weight.stride(2) != 1:
                raise ValueError(
                    f"{name}.weight must be contiguous along K (stride 1 in its last dim), got strides "
                    f"{tuple(w.weight.stride())}"
                )
            bk = w.block[1]
            if (bk & -bk) < 16:
                raise ValueError(
                    f"{name}.block = {w.block}: the scale block's {bk} columns must be a multiple of 16 "
                    "(a base GEMM's K step, at least 16, reads one scale column)"
                )
        if tuple(w2.block) != tuple(w13.block):  # one K-step rule and one W8A8 group size serve both GEMMs
            raise ValueError(
                f"w2.block = {tuple(w2.block)} must equal w13.block = {tuple(w13.block)} (one scale block "
                "for both expert weights, as the published checkpoints have)"
            )
        return standin(w13), standin(w2), "fp8"
    for name, w, layout in (("w13", w13, "[E, 2I, H]"), ("w2", w2, "[E, H, I]")):
        q = w.blocks
        if q.dim() != 4:
            raise ValueError(
                f"{name} must be an MXFP4Weight of dense shape {layout}: blocks [E, N, K/32, 16], scales "
                f"[E, N, K/32], got blocks {tuple(q.shape)}"
            )
        if q.stride(3) != 1 or q.stride(2) != MXFP4_BLOCK // 2:
            raise ValueError(
                f"{name}.blocks must be contiguous in its last two dims (the K/2 packed bytes of a row), "
                f"got strides {tuple(q.stride())}"
            )
        if w.scales.device.type != "meta" and bool((w.scales == 255).any()):  # one host read
            raise ValueError(
                f"{name}.scales holds the e8m0 byte 255 (NaN in MXFP4): the weights would not be finite"
            )
    return standin(w13), standin(w2), "mxfp4"


def validate_moe_lora_inputs(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora_ids,
    lora_a13,
    lora_b13,
    lora_a2,
    lora_b2,
    activation="silu",
    b13=None,
    b2=None,
    check_values: bool = True,
    *,
    like: str = "hidden_states",
) -> dict:
    """Check every argument of :func:`fused_moe_lora`; return the dims T, H, I, E, K, L, S, R.

    ``check_values`` also checks topk_ids ∈ [0, E), lora_ids ∈ [-1, L) and that topk_weights is finite
    (a host sync). w13 / w2 may both be :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` s or both
    :class:`~moelora_lib.quant.FP8BlockWeight` s: they are checked as dense weights of their dense
    shapes, of hidden_states' dtype, on their packed tensors' device.
    Each shape letter (T, H, I, E, K, L, R) takes the size most arguments agree on, so a wrong size is
    reported on the argument that disagrees (a wrong H in hidden_states names hidden_states, not w13).
    ``like``: the argument the others' dtype and device must match, as the messages name it
    (:class:`~moelora_lib.MoELoRALayer` passes "w13": the hidden_states it checks with is a stand-in of
    w13's dtype and device).
    Raises:
        ValueError naming the argument and the expected shape, dtype, device or range; a
        check_values that is not a bool; a float input that requires grad while grad mode is on
        (inference only: :func:`~moelora_lib.common.check_no_grad`).
    """
    check_bool("check_values", check_values)
    from .kernels.triton_kernels import KERNELS

    dt, dev = check_activations("hidden_states", hidden_states, KERNELS["fused_moe"][True])
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if {_weight_format(w13), _weight_format(w2)} != {"dense"}:  # checked as dense weights of dtype dt
        w13, w2, _ = _dense_views(w13, w2, dt)
    args = dict(
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        lora_ids=lora_ids,
        lora_a13=lora_a13,
        lora_b13=lora_b13,
        lora_a2=lora_a2,
        lora_b2=lora_b2,
        b13=b13,
        b2=b2,
    )
    for name, (letters, nd) in _NDIMS.items():
        t = args[name]
        if t is None and name in ("b13", "b2"):
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-D tensor {letters}, got {_desc(t)}")
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must have shape [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")

    def size(name: str, dim: int) -> int | None:
        t = hidden_states if name == "hidden_states" else args[name]
        return None if t is None else t.shape[dim]

    # Each shape letter takes the size most arguments agree on, so a check below names the one
    # argument that disagrees (hidden_states with a wrong H is blamed, not w13).
    T = _agree(
        [("hidden_states", size("hidden_states", 0))]
        + [(n, size(n, 0)) for n in ("topk_ids", "topk_weights", "lora_ids")]
    )
    H = _agree(
        [
            ("hidden_states", size("hidden_states", 1)),
            ("w13", size("w13", 2)),
            ("w2", size("w2", 1)),
            ("lora_a13", size("lora_a13", 4)),
            ("lora_b2", size("lora_b2", 2)),
            ("b2", size("b2", 1)),
        ]
    )
    E = _agree(
        [(n, size(n, 0)) for n in ("w13", "w2", "b13", "b2")]
        + [(n, size(n, 1)) for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2")]
    )
    two_i = _agree(
        [
            ("w13", size("w13", 1)),
            ("w2", 2 * size("w2", 2)),
            ("lora_a2", 2 * size("lora_a2", 3)),
            ("b13", size("b13", 1)),
        ]
    )
    inter = two_i // 2
    k_ids, k_weights = size("topk_ids", 1), size("topk_weights", 1)
    if k_ids is not None and k_weights is not None and k_ids != k_weights:  # a tie: name both
        raise ValueError(
            f"topk_weights must have shape [T, K] like topk_ids (the two disagree): "
            f"topk_ids has K={k_ids}, topk_weights has K={k_weights}"
        )
    K = _agree([("topk_ids", k_ids), ("topk_weights", k_weights)])
    L = _agree([(n, size(n, 0)) for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2")])
    R = _agree(
        [
            ("lora_a13", size("lora_a13", 3)),
            ("lora_b13", size("lora_b13", 4)),
            ("lora_a2", size("lora_a2", 2)),
            ("lora_b2", size("lora_b2", 3)),
        ]
    )
    S = lora_a13.shape[2]
    if S not in (1, 2):
        raise ValueError(f"lora_a13: S (dim 2) must be 1 (fused gate_up) or 2 (gate, up), got {S}")
    if lora_a13.shape[0] < 1 or lora_a13.shape[3] < 1:
        raise ValueError(f"lora_a13: L and R must be >= 1, got L={lora_a13.shape[0]}, R={lora_a13.shape[3]}")
    if L < 1 or R < 1:
        raise ValueError(f"lora_a13 and the other adapters: L and R must be >= 1, got L={L}, R={R}")
    if H < 1 or inter < 1 or E < 1:  # sizes the kernels cannot tile (empty weights)
        raise ValueError(
            f"w13 [E, 2I, H] and w2 [E, H, I] must have E, I and H >= 1, got E={E}, I={inter}, H={H}"
        )
    note = f" (like {like})"
    _check("hidden_states", hidden_states, (("T", T), ("H", H)), (dt,), dev, like=like)
    _check("w13", w13, (("E", E), ("2I", two_i), ("H", H)), (dt,), dev, note, like)
    _check("w2", w2, (("E", E), ("H", H), ("I", inter)), (dt,), dev, note, like)
    _check("topk_ids", topk_ids, (("T", T), ("K", K)), (torch.int32, torch.int64), dev, like=like)
    if not 1 <= K <= E:
        raise ValueError(f"topk_ids: top_k = {K} must be in [1, E={E}]")
    _check("topk_weights", topk_weights, (("T", T), ("K", K)), (torch.float32,), dev, like=like)
    _check("lora_ids", lora_ids, (("T", T),), (torch.int32, torch.int64), dev, like=like)
    _check("lora_a13", lora_a13, (("L", L), ("E", E), ("S", S), ("R", R), ("H", H)), (dt,), dev, note, like)
    _check(
        "lora_b13",
        lora_b13,
        (("L", L), ("E", E), ("S", S), ("2I/S", two_i // S), ("R", R)),
        (dt,),
        dev,
        note,
        like,
    )
    _check("lora_a2", lora_a2, (("L", L), ("E", E), ("R", R), ("I", inter)), (dt,), dev, note, like)
    _check("lora_b2", lora_b2, (("L", L), ("E", E), ("H", H), ("R", R)), (dt,), dev, note, like)
    if b13 is not None:
        _check("b13", b13, (("E", E), ("2I", two_i)), (dt,), dev, note, like)
    if b2 is not None:
        _check("b2", b2, (("E", E), ("H", H)), (dt,), dev, note, like)
    # Triton launches with no autograd formula: a float input that requires grad is refused (host-side)
    check_no_grad(
        ("hidden_states", hidden_states),
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("lora_a13", lora_a13),
        ("lora_b13", lora_b13),
        ("lora_a2", lora_a2),
        ("lora_b2", lora_b2),
        ("b13", b13),
        ("b2", b2),
    )
    if check_values:
        check_finite_weights(topk_weights)
        check_id_values(topk_ids, E, lora_ids, L)
    return dict(T=T, H=H, I=inter, E=E, K=K, L=L, S=S, R=R)


def _check_stage_and_config(stage, config) -> None:
    check_stage_name(stage)
    if config is not None and not isinstance(config, LayerConfig):
        raise ValueError(f"config must be a LayerConfig or None, got {type(config).__name__}")


def make_layer_run(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora_ids,
    lora_a13,
    lora_b13,
    lora_a2,
    lora_b2,
    *,
    activation="silu",
    b13=None,
    b2=None,
    stage="auto",
    config: LayerConfig | None = None,
    check_values: bool = True,
    deterministic: bool = False,
    adapter_order: bool | None = None,
    activation_scheme: str = "auto",
) -> LayerRun | GemvRun:
    """Validate and build the :class:`~moelora_lib.kernels.LayerRun` that :func:`fused_moe_lora` runs
    (same arguments; ``stage="auto"``, the default, resolved to the concrete stage of these dims; for
    stage ``gemv`` a :class:`~moelora_lib.kernels.gemv.GemvRun`).

    Benchmarks use it to time parts of the layer or to capture it in a CUDA graph. ``deterministic``
    and MXFP4 ``w13`` / ``w2``: as in :func:`fused_moe_lora`. ``adapter_order``: as in
    :class:`~moelora_lib.kernels.LayerRun` (None = the stage's choice: on for stage ``fused``); a
    performance knob, the result does not depend on it beyond fp32 rounding order (bit-identical in
    practice, see the test). ``activation_scheme``: as in :func:`fused_moe_lora`.
    """
    _check_stage_and_config(stage, config)
    check_activation_scheme(activation_scheme, w13, stage)
    check_bool("deterministic", deterministic)
    if adapter_order is not None:
        check_bool("adapter_order", adapter_order)
    d = validate_moe_lora_inputs(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        lora_ids,
        lora_a13,
        lora_b13,
        lora_a2,
        lora_b2,
        activation,
        b13,
        b2,
        check_values,
    )
    scheme = resolve_activation_scheme(activation_scheme, w13, d["T"])
    dims = Dims(
        T=d["T"], H=d["H"], I=d["I"], E=d["E"], top_k=d["K"], adapters=d["L"], rank=d["R"], slices=d["S"],
        weight_format=config_weight_format(w13, scheme),
    )  # fmt: skip
    st = stage_named(stage, dims)  # "auto": the stage the config files choose for these dims
    if scheme == "dynamic" and st is GEMV_STAGE:  # stage auto picked gemv (weight-only): W8A8 runs tuned
        st = STAGES["tuned"]
    if config is None:
        # stages "tuned" and "fused" load tuned configs (moelora_lib.configs); the others the defaults
        config = st.config_for(dims)
    # MXFP4: whole 32-value scale blocks; FP8: one scale column per K step (W8A8: K steps of ≥ 32)
    config = packed_config(config, w13, scheme)
    if deterministic:
        config = config.deterministic()
    if st is GEMV_STAGE:  # its own launches, no alignment (kernels/gemv.py)
        return GemvRun(
            hidden_states, w13, w2, topk_weights, topk_ids, lora_ids, lora_a13, lora_b13, lora_a2, lora_b2,
            activation=activation, config=config, b13=b13, b2=b2,
        )  # fmt: skip
    return LayerRun(
        st,
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        lora_ids,
        lora_a13,
        lora_b13,
        lora_a2,
        lora_b2,
        activation=activation,
        b13=b13,
        b2=b2,
        config=config,
        adapter_order=adapter_order,
        activation_scheme=scheme,
        alignments=_device_alignments(
            st, config, topk_ids, lora_ids, d["E"], d["L"], adapter_order=adapter_order
        ),
    )


def _device_alignments(
    stage, config: LayerConfig, topk_ids, lora_ids, E: int, L: int, adapter_order: bool | None = None
):
    """On CUDA: the Triton alignments, no host sync — up to
    :data:`~moelora_lib.kernels.align_small.PAIR_PATH_MAX_PAIRS` pairs both in one launch
    (:func:`~moelora_lib.kernels.align_small.align_tokens_pair`), above that
    :func:`~moelora_lib.kernels.align.align_tokens_triton` (2 × 3 launches); pairs with out-of-range
    ids are dropped, never read out of bounds; one LoRA alignment shared by both projections. On the
    CPU: None, so :class:`LayerRun` aligns with the torch oracle (bit-identical; cheaper than the
    interpreted kernels). With the adapter order (``adapter_order``, default on for stage ``fused``)
    the base entry is None: LayerRun builds it with the torch alignment (device ops, no host sync),
    which alone has that order."""
    if topk_ids.device.type != "cuda":
        return None
    from .kernels.align import align_tokens_triton
    from .kernels.align_small import align_tokens_pair, use_pair_path

    cfg = stage.adapt(config)
    bmb, bml = cfg.base_block_size_m, cfg.lora_block_size_m
    sorted_base = stage.uses_adapter_order(adapter_order)
    if use_pair_path(topk_ids.numel(), E, L):  # small T: both alignments in one launch
        base, lora = align_tokens_pair(topk_ids, E, bmb, lora_ids, L, bml)
    else:  # (no Triton base alignment when LayerRun builds the adapter-ordered one)
        base = None if sorted_base else align_tokens_triton(topk_ids, E, bmb)
        lora = align_tokens_triton(topk_ids, E, bml, lora_ids=lora_ids, num_adapters=L)
    return (None if sorted_base else base), lora, lora


def fused_moe_lora(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora_ids,
    lora_a13,
    lora_b13,
    lora_a2,
    lora_b2,
    *,
    activation="silu",
    b13=None,
    b2=None,
    stage="auto",
    config: LayerConfig | None = None,
    deterministic: bool = False,
    activation_scheme: str = "auto",
) -> torch.Tensor:
    """MoE layer with one LoRA adapter per token on both expert projections (four LoRA ops).

    Computes, for token t with adapter a = lora_ids[t] and routed experts e = topk_ids[t, k]
    (weights w = topk_weights[t, k]), the math contract written out in
    :mod:`moelora_lib.reference`: gate_up + LoRA delta (before the activation), activation,
    down + LoRA delta, then Σ_k w·y. Tokens with a = -1 get exactly the base MoE.

    Precision: every GEMM accumulates in fp32; h (gate_up output), the activation output and y are
    stored in hidden_states' dtype between launches, as in vLLM. The LoRA rank intermediate
    (x·A13ᵀ, g·A2ᵀ) is kept in fp32 — not rounded to fp16 — and enters the expand's dot as bf16
    for bf16 inputs (fp32's exponent range), as fp32 for fp16 and fp32 inputs (tf32 on the GPU:
    fp32's range with fp16's 10-bit mantissa). So a rank intermediate beyond fp16's 65 504 does not
    overflow an fp16 layer; a value that is itself stored in fp16 still must fit fp16: h, the
    activation output, y, the output, and in the stages without fused add (naive, no_recompile,
    split_k, swizzle) the LoRA delta alone, stored before it is added to h or y.

    Args:
        hidden_states: [T, H] float16/bfloat16/float32 (CUDA, or CPU under TRITON_INTERPRET=1).
        w13: [E, 2I, H] gate_up weights (nn.Linear layout out × in); rows [gate | up] for "silu",
            interleaved gate/up rows for "swigluoai" (GPT-OSS).
        w2: [E, H, I] down weights.
            Or both :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` s of those dense shapes (blocks uint8
            [E, N, K/32, 16], scales uint8 [E, N, K/32]; H and I multiples of 32): the base GEMMs decode
            them in registers and compute as with the dequantized weights in hidden_states' dtype; the
            config's base BLOCK_SIZE_K is raised to 32 where it is 16
            (:func:`~moelora_lib.kernels.stages.mxfp4_config`). Or both
            :class:`~moelora_lib.quant.FP8BlockWeight` s (float8_e4m3fn [E, N, K] and scale_inv
            [E, ceil(N/bn), ceil(K/bk)]): each weight tile is fp32(code)·fp32(scale) rounded once to
            hidden_states' dtype, as :func:`~moelora_lib.quant.dequantize_fp8_block`; the config's base
            BLOCK_SIZE_K is lowered to divide bk where it does not
            (:func:`~moelora_lib.kernels.stages.fp8_config`; bk a multiple of 16).
        topk_weights: [T, K] float32 routing weights (applied once, on the down output), finite.
        topk_ids: [T, K] int32/int64 in [0, E).
        lora_ids: [T] int32/int64 adapter slot of each token in [-1, L); -1 = no adapter.
        lora_a13: [L, E, S, R, H]; lora_b13: [L, E, S, 2I/S, R] (S = 1 fused gate_up, GPT-OSS 3-D
            adapters; S = 2 gate and up slices). Slice s covers h columns [s·2I/S, (s+1)·2I/S).
        lora_a2: [L, E, R, I]; lora_b2: [L, E, H, R]. Scaling alpha/r already folded into B;
            ranks below R zero-padded.
        activation: "silu" or "swigluoai".
        b13: [E, 2I] or None; b2: [E, H] or None (expert biases).
        stage: "auto" (default, as :class:`~moelora_lib.MoELoRALayer`): stage "fused" or "tuned" as the
            config files choose for this call's dims and T bucket
            (:func:`moelora_lib.configs.load_stage_choice`; "tuned" where no file records a choice,
            e.g. on the CPU); ``"gemv"`` (:mod:`moelora_lib.kernels.gemv`: split-K GEMVs per (token, k)
            pair, at most :data:`~moelora_lib.kernels.gemv.GEMV_MAX_PAIRS` pairs); or a name in
            :data:`moelora_lib.kernels.STAGES`.
        config: a :class:`~moelora_lib.kernels.LayerConfig`; None = the stage's ``config_for``: for
            "tuned" :func:`moelora_lib.configs.load_layer_config` (tuned files, else the defaults), for
            "fused" :func:`moelora_lib.configs.load_fused_config`, else :func:`default_config`.
        deterministic: bitwise-repeatable output: the config (given or picked) runs with SPLIT_K = 1
            on both shrinks and on stage ``fused``'s down GEMM (``LayerConfig.deterministic()``), the
            only launches whose fp32 atomics add in an order the hardware picks; every other launch
            (alignment, the other base GEMMs, expands, activation, top-k sum) already writes each element
            from one program in a fixed order. Same inputs, config, GPU and software give the same bits.
            Its cost is the split-K speed-up of those launches (notebook 04 for the shrinks, notebook 12's
            ``fused_deterministic`` lever for stage ``fused``). Default False.
        activation_scheme: with FP8 ``w13``/``w2``, how the base GEMMs treat the activations
            (:data:`~moelora_lib.kernels.stages.ACTIVATION_SCHEMES`): "dynamic" — W8A8, the
            ``activation_scheme: "dynamic"`` of the published FP8 checkpoints: hidden_states and the
            activation output are quantized per token and per group of the weight's scale-block columns
            (:func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act`, one launch each; scale = amax/448) and
            the base GEMMs run FP8 × FP8 on tensor cores, each K step's fp32 partial times the two scales
            (DeepSeek-V3's block-FP8 scheme). The result differs from the weight-only one by the
            activation rounding: about 2^-4 relative per activation element at most, far less on sums
            (tests/test_fp8_w8a8_moe.py). The LoRA ops still read the unquantized activations. The base
            GEMMs' BLOCK_SIZE_K becomes min(2·BLOCK_SIZE_K, the scale block's largest power-of-two
            divisor) ≥ 32 (:func:`~moelora_lib.kernels.stages.w8a8_config`); where stage "auto" would pick
            "gemv" (weight-only GEMVs), "tuned" runs. "weight_only" — each e4m3 weight tile is scaled
            to hidden_states' dtype in registers, the activations are not quantized. "auto" (default) —
            "dynamic" from :data:`~moelora_lib.kernels.stages.W8A8_MIN_TOKENS` tokens on, "weight_only"
            below (decode sizes). Dense and MXFP4 weights run as before under "auto" and "weight_only".
    Returns:
        [T, H] in hidden_states' dtype ([0, H] when T = 0).
    Raises:
        ValueError: an argument's shape, dtype, device or value range is wrong (the message names
            it; NaN or inf in topk_weights included; one expert weight MXFP4 and the other not),
            unknown activation or stage, a non-bool deterministic; a float input (hidden_states, a
            dense weight, topk_weights, an adapter, a bias) that requires grad while grad mode is on
            (inference only; under torch.no_grad() / torch.inference_mode() or detached it runs);
            bfloat16 on the CPU (the
            interpreter's bf16 is wrong); ``activation_scheme`` not one of its values, or "dynamic" with
            weights that are not FP8 (or whose scale blocks' columns are not a multiple of 32) or with
            stage "gemv".

    The value check of topk_ids, lora_ids and topk_weights synchronizes with the host once, so this
    function is not meant for CUDA-graph capture: use :class:`moelora_lib.MoELoRALayer` (no host sync),
    or build a :class:`~moelora_lib.kernels.LayerRun` once with :func:`make_layer_run`
    (``check_values=False``) and capture ``run()``, as the benchmarks do. On a GPU the check is deferred
    so that the host never waits for the layer's kernels: the id bounds and the finiteness of
    topk_weights are reduced on the device and copied to pinned host memory first, the alignment
    (Triton, :mod:`moelora_lib.kernels.align`; it drops out-of-range pairs instead of reading out of
    bounds) and the layer are launched, and only then does the host wait for the bounds and raise if
    they are out of range or a weight is not finite (the result is then discarded). On the CPU the
    check comes first.

    Eager host cost (notebook 09 measures it): one call validates ~11 tensors in Python, picks the
    config, and issues 1 (id bounds, :mod:`moelora_lib.kernels.id_bounds`) + 1 or 6 (alignment) + the
    stage's layer launches, the finiteness reduction of topk_weights (``torch.isfinite(...).all()``) and
    two copies to pinned memory, with one host sync (the deferred value check).
    """
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2 and hidden_states.shape[0] == 0:
        validate_moe_lora_inputs(
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            lora_ids,
            lora_a13,
            lora_b13,
            lora_a2,
            lora_b2,
            activation,
            b13,
            b2,
            check_values=False,
        )
        _check_stage_and_config(stage, config)
        check_bool("deterministic", deterministic)
        check_activation_scheme(activation_scheme, w13, stage)
        return hidden_states.new_empty((0, hidden_states.shape[1]))
    on_gpu = isinstance(hidden_states, torch.Tensor) and hidden_states.device.type == "cuda"
    run = make_layer_run(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        lora_ids,
        lora_a13,
        lora_b13,
        lora_a2,
        lora_b2,
        activation=activation,
        b13=b13,
        b2=b2,
        stage=stage,
        config=config,
        check_values=not on_gpu,  # on the GPU: deferred, below
        deterministic=deterministic,
        activation_scheme=activation_scheme,
    )
    if not on_gpu:
        return run()
    from .kernels.id_bounds import id_bounds_triton

    bounds = torch.empty(4, dtype=torch.int64, pin_memory=True)
    bounds.copy_(id_bounds_triton(topk_ids, lora_ids), non_blocking=True)
    finite = torch.empty(1, dtype=torch.bool, pin_memory=True)
    finite.copy_(torch.isfinite(topk_weights).all().reshape(1), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    out = run()
    copied.synchronize()  # waits for the bounds only, not for the layer's kernels
    check_id_bounds(bounds.tolist(), w13.shape[0], lora_a13.shape[0])
    if not bool(finite[0]):
        check_finite_weights(topk_weights)  # raises, with the count
    return out
