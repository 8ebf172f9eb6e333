"""Public functional entry point: :func:`fused_moe_lora`."""

from __future__ import annotations

import torch

from .kernels import STAGES, LayerConfig, LayerRun, default_config
from .shapes import Dims

__all__ = ["fused_moe_lora", "validate_moe_lora_inputs", "make_layer_run"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATIONS = ("silu", "swigluoai")


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


def _check(name: str, t, shape: tuple, dtypes, device) -> None:
    """Raise ValueError naming ``name`` unless t is a tensor of ``shape`` (None = any) and dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {_desc(t)}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like hidden_states), got {t.device}")


def _check_cpu_backend(dtype: torch.dtype) -> None:
    """CPU tensors run only through the Triton interpreter, which has no correct bf16 arithmetic."""
    from .kernels.triton_kernels import KERNELS

    if type(KERNELS["fused_moe"][True]).__name__ != "InterpretedFunction":
        raise ValueError(
            "hidden_states is on the CPU but the kernels were not built for the Triton "
            "interpreter: use CUDA tensors, or set TRITON_INTERPRET=1 before the first kernel "
            "module is imported (before the first call into moelora_lib; restart the process if "
            "a kernel was already built)"
        )
    if dtype == torch.bfloat16:
        raise ValueError(
            "hidden_states: bfloat16 is not supported on the CPU (the Triton interpreter "
            "multiplies raw bf16 bit patterns, triton-lang/triton#11584); use float16 or "
            "float32 on the CPU, bfloat16 on a GPU"
        )


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
) -> dict:
    """Check every argument of :func:`fused_moe_lora`; return the dims T, H, I, E, K, L, S, R.

    ``check_values`` also checks topk_ids ∈ [0, E) and lora_ids ∈ [-1, L) (a host sync).
    Raises:
        ValueError naming the argument and the expected shape, dtype, device or range.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be a 2-D tensor [T, H], got {_desc(hidden_states)}")
    dt, dev = hidden_states.dtype, hidden_states.device
    if dt not in _FLOAT_DTYPES:
        raise ValueError(f"hidden_states dtype must be float16, bfloat16 or float32, got {dt}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if dev.type == "cpu":
        _check_cpu_backend(dt)
    T, H = hidden_states.shape
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"w13 must have shape [E, 2I, H={H}] with an even 2I, got {_desc(w13)}")
    E, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    _check("w13", w13, (E, two_i, H), (dt,), dev)
    _check("w2", w2, (E, H, inter), (dt,), dev)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [T={T}, K], got {_desc(topk_ids)}")
    K = topk_ids.shape[1]
    _check("topk_ids", topk_ids, (T, K), (torch.int32, torch.int64), dev)
    if not 1 <= K <= E:
        raise ValueError(f"topk_ids: top_k = {K} must be in [1, E={E}]")
    _check("topk_weights", topk_weights, (T, K), (torch.float32,), dev)
    _check("lora_ids", lora_ids, (T,), (torch.int32,), dev)
    if not isinstance(lora_a13, torch.Tensor) or lora_a13.dim() != 5:
        raise ValueError(f"lora_a13 must have shape [L, E={E}, S, R, H={H}], got {_desc(lora_a13)}")
    L, _, S, R, _ = lora_a13.shape
    if S not in (1, 2):
        raise ValueError(f"lora_a13: S (dim 2) must be 1 (fused gate_up) or 2 (gate, up), got {S}")
    if L < 1 or R < 1:
        raise ValueError(f"lora_a13: L and R must be >= 1, got L={L}, R={R}")
    _check("lora_a13", lora_a13, (L, E, S, R, H), (dt,), dev)
    _check("lora_b13", lora_b13, (L, E, S, two_i // S, R), (dt,), dev)
    _check("lora_a2", lora_a2, (L, E, R, inter), (dt,), dev)
    _check("lora_b2", lora_b2, (L, E, H, R), (dt,), dev)
    if b13 is not None:
        _check("b13", b13, (E, two_i), (dt,), dev)
    if b2 is not None:
        _check("b2", b2, (E, H), (dt,), dev)
    if check_values and T > 0:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids values must be in [0, E={E}), got min {lo}, max {hi}")
        lo, hi = int(lora_ids.min()), int(lora_ids.max())
        if lo < -1 or hi >= L:
            raise ValueError(
                f"lora_ids values must be in [-1, L={L}) (-1 = no adapter), got min {lo}, max {hi}"
            )
    return dict(T=T, H=H, I=inter, E=E, K=K, L=L, S=S, R=R)


def _check_stage_and_config(stage, config) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")
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
    stage="naive",
    config: LayerConfig | None = None,
    check_values: bool = True,
) -> LayerRun:
    """Validate and build the :class:`~moelora_lib.kernels.LayerRun` that :func:`fused_moe_lora` runs.

    Benchmarks use it to time parts of the layer or to capture it in a CUDA graph.
    """
    _check_stage_and_config(stage, config)
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
    if config is None:
        dims = Dims(
            T=d["T"], H=d["H"], I=d["I"], E=d["E"], top_k=d["K"], adapters=d["L"], rank=d["R"], slices=d["S"]
        )
        # stage "tuned" loads tuned configs (moelora_lib.configs); the other stages use the defaults
        pick = getattr(STAGES[stage], "config_for", None)
        config = pick(dims) if pick is not None else default_config(dims)
    return LayerRun(
        STAGES[stage],
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
    )


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
    stage="naive",
    config: LayerConfig | None = None,
) -> torch.Tensor:
    """MoE layer with one LoRA adapter per token on both expert projections (four LoRA ops).

    Computes, for token t with adapter a = lora_ids[t] and routed experts e = topk_ids[t, k]
    (weights w = topk_weights[t, k]), the math contract written out in
    :mod:`moelora_lib.reference`: gate_up + LoRA delta (before the activation), activation,
    down + LoRA delta, then Σ_k w·y. Tokens with a = -1 get exactly the base MoE.

    Args:
        hidden_states: [T, H] float16/bfloat16/float32 (CUDA, or CPU under TRITON_INTERPRET=1).
        w13: [E, 2I, H] gate_up weights (nn.Linear layout out × in); rows [gate | up] for "silu",
            interleaved gate/up rows for "swigluoai" (GPT-OSS).
        w2: [E, H, I] down weights.
        topk_weights: [T, K] float32 routing weights (applied once, on the down output).
        topk_ids: [T, K] int32/int64 in [0, E).
        lora_ids: [T] int32 adapter slot of each token in [-1, L); -1 = no adapter.
        lora_a13: [L, E, S, R, H]; lora_b13: [L, E, S, 2I/S, R] (S = 1 fused gate_up, GPT-OSS 3-D
            adapters; S = 2 gate and up slices). Slice s covers h columns [s·2I/S, (s+1)·2I/S).
        lora_a2: [L, E, R, I]; lora_b2: [L, E, H, R]. Scaling alpha/r already folded into B;
            ranks below R zero-padded.
        activation: "silu" or "swigluoai".
        b13: [E, 2I] or None; b2: [E, H] or None (expert biases).
        stage: a name in :data:`moelora_lib.kernels.STAGES`.
        config: a :class:`~moelora_lib.kernels.LayerConfig`; None = :func:`default_config`, or for
            stage "tuned" :func:`moelora_lib.configs.load_layer_config` (tuned files, else defaults).
    Returns:
        [T, H] in hidden_states' dtype ([0, H] when T = 0).
    Raises:
        ValueError: an argument's shape, dtype, device or value range is wrong (the message names
            it), unknown activation or stage; bfloat16 on the CPU (the interpreter's bf16 is wrong).

    The value-range checks of topk_ids and lora_ids synchronize with the host, so this function is
    not meant for CUDA-graph capture: build a :class:`~moelora_lib.kernels.LayerRun` once with
    :func:`make_layer_run` (``check_values=False`` after the first validated call) and capture
    ``run()`` instead, as the benchmarks do.
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
        return hidden_states.new_empty((0, hidden_states.shape[1]))
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
    )
    return run()
