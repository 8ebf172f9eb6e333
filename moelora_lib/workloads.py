"""Seeded inputs for tests, notebooks and benchmarks.

Values are scaled like a trained layer (unit-variance activations, weights ~ N(0, 1/fan_in)), so
outputs stay O(1) in bf16, and never zeros (zeros would hide outputs a kernel never wrote).

:class:`Workload` names one such input set (model, T, rank, adapters, pattern, dtype, seed, device)
as a record, so the benchmarks and checks take one value instead of eight keywords.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import parse_dtype
from .routing import route
from .shapes import ACTIVATIONS, Dims, MoEShape, check_int, get_shape

__all__ = ["ADAPTER_PATTERNS", "MoELoRAInputs", "Workload", "make_inputs", "adapter_ids"]

ADAPTER_PATTERNS = ("uniform", "zipf", "one", "mixed", "none")


def _check_pattern(name: str, pattern) -> None:
    if not isinstance(pattern, str) or pattern not in ADAPTER_PATTERNS:
        raise ValueError(f"{name} must be one of {ADAPTER_PATTERNS}, got {pattern!r}")


def _check_device(name: str, device) -> None:
    """A torch device string ("cpu", "cuda", "cuda:1") or a torch.device; availability is not checked."""
    if isinstance(device, torch.device):
        return
    if not isinstance(device, str):
        raise TypeError(
            f"{name} must be a device string like 'cpu' or 'cuda' or a torch.device, "
            f"got {type(device).__name__}"
        )
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"{name} must be a device string like 'cpu', 'cuda' or 'cuda:0', got {device!r} ({e})"
        ) from None


def _check_shape(name: str, shape) -> MoEShape:
    if isinstance(shape, MoEShape):
        return shape
    if isinstance(shape, str):
        return get_shape(shape)  # ValueError listing the presets
    raise TypeError(f"{name} must be a MoEShape or a preset name, got {type(shape).__name__}")


def _check_optional_bool(name: str, v) -> None:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"{name} must be None or a bool, got {v!r} ({type(v).__name__})")


def _check_real(name: str, v) -> None:
    import math
    import numbers

    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite real number, got {v!r}")


def adapter_ids(
    num_tokens: int,
    num_adapters: int,
    pattern: str,
    generator: torch.Generator,
    used_slots: int | None = None,
) -> torch.Tensor:
    """Adapter slot per token, [T] int32 on the CPU.

    Patterns: ``uniform`` — tokens spread evenly over the slots (round robin over a random permutation,
    like the anchor benchmark); ``zipf`` — slot i drawn with probability ∝ 1/(i+1); ``one`` — every
    token on slot 0; ``mixed`` — every slot used plus about a quarter of the tokens at -1 (no adapter);
    ``none`` — all -1. ``used_slots`` restricts uniform/zipf/mixed to the first slots (e.g. L = 8 with
    two slots in use).

    Raises ValueError naming the argument: num_tokens not an int >= 0, num_adapters not an int >= 1,
    used_slots not None or an int in [1, num_adapters], an unknown pattern, a generator that is not a
    torch.Generator.
    """
    num_tokens = check_int("adapter_ids: num_tokens", num_tokens, 0)
    num_adapters = check_int("adapter_ids: num_adapters", num_adapters, 1)
    _check_pattern("adapter_ids: pattern", pattern)
    if used_slots is not None:
        used_slots = check_int("adapter_ids: used_slots", used_slots, 1, num_adapters)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"adapter_ids: generator must be a torch.Generator, got {type(generator).__name__}")
    n = used_slots or num_adapters
    if pattern == "uniform":
        ids = torch.arange(num_tokens) % n
        ids = ids[torch.randperm(num_tokens, generator=generator)]
    elif pattern == "zipf":
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
        ids = torch.multinomial(p / p.sum(), num_tokens, replacement=True, generator=generator)
    elif pattern == "one":
        ids = torch.zeros(num_tokens, dtype=torch.long)
    elif pattern == "mixed":
        ids = torch.arange(num_tokens) % (n + 1) - 1  # every slot and -1
        ids = ids[torch.randperm(num_tokens, generator=generator)]
        extra = torch.rand(num_tokens, generator=generator) < 0.25
        ids = torch.where(extra, torch.full_like(ids, -1), ids)
        ids[: min(num_tokens, n)] = torch.arange(min(num_tokens, n))  # keep every slot present
    elif pattern == "none":
        ids = torch.full((num_tokens,), -1, dtype=torch.long)
    else:
        raise ValueError(f"pattern must be one of {ADAPTER_PATTERNS}, got {pattern!r}")
    return ids.to(torch.int32)


@dataclass(frozen=True)
class Workload:
    """The inputs of one layer call, by name: what :func:`moelora_lib.studies.moe_bench.layer_inputs`,
    ``bench_layer`` and ``check_layer`` build and measure.

    Attributes:
        model: a preset name of :data:`moelora_lib.shapes.PRESETS` (or a :class:`MoEShape`).
        T: tokens. rank: R, max LoRA rank. adapters: L, adapter slots.
        pattern: adapter ids, one of :data:`ADAPTER_PATTERNS`.
        dtype: of the float tensors (a torch dtype or its name, ``"bf16"`` accepted; stored as a torch dtype).
        seed: of the CPU generator the inputs are drawn from. device: where they live.
        activation: None = the preset's; ``"silu"`` for the vLLM side-by-side rows of GPT-OSS-20B.
        bias: None = the preset's expert biases; False drops them.
    The defaults are the benchmark setting (R = 32, L = 8, uniform ids, bf16 on CUDA). Raises
    ValueError naming the field for an unknown preset, pattern, dtype or activation, a size that is not
    an int >= 1 (T: >= 0), a seed that is not an int, a bias that is not None or a bool, or a device
    string torch does not know; TypeError for a model or device of the wrong type.
    """

    model: str | MoEShape
    T: int
    rank: int = 32
    adapters: int = 8
    pattern: str = "uniform"
    dtype: torch.dtype | str = torch.bfloat16
    seed: int = 0
    device: str | torch.device = "cuda"
    activation: str | None = None
    bias: bool | None = None

    def __post_init__(self) -> None:
        _check_shape("Workload.model", self.model)  # ValueError naming the presets
        check_int("Workload.T", self.T, 0)
        check_int("Workload.rank", self.rank, 1)
        check_int("Workload.adapters", self.adapters, 1)
        _check_pattern("Workload.pattern", self.pattern)
        try:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        except ValueError as e:
            raise ValueError(f"Workload.{e}") from None
        check_int("Workload.seed", self.seed)
        _check_device("Workload.device", self.device)
        if self.activation is not None and (
            not isinstance(self.activation, str) or self.activation not in ACTIVATIONS
        ):
            raise ValueError(
                f"Workload.activation must be None (the preset's) or one of {ACTIVATIONS}, "
                f"got {self.activation!r}"
            )
        _check_optional_bool("Workload.bias", self.bias)
        _ = self.dims  # validates T, rank and adapters together

    @property
    def shape(self) -> MoEShape:
        """The preset."""
        return self.model if isinstance(self.model, MoEShape) else get_shape(self.model)

    @property
    def model_name(self) -> str:
        return self.shape.name

    @property
    def dims(self) -> Dims:
        """The layer sizes of this workload (slices: the preset's)."""
        return Dims.of(self.shape, self.T, rank=self.rank, adapters=self.adapters)


@dataclass
class MoELoRAInputs:
    """Everything :func:`moelora_lib.fused_moe_lora` takes, as keyword arguments via :meth:`args`."""

    hidden_states: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    lora_ids: torch.Tensor
    lora_a13: torch.Tensor
    lora_b13: torch.Tensor
    lora_a2: torch.Tensor
    lora_b2: torch.Tensor
    activation: str
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    router_logits: torch.Tensor

    def args(self) -> tuple:
        return (
            self.hidden_states,
            self.w13,
            self.w2,
            self.topk_weights,
            self.topk_ids,
            self.lora_ids,
            self.lora_a13,
            self.lora_b13,
            self.lora_a2,
            self.lora_b2,
        )

    def kwargs(self) -> dict:
        return dict(activation=self.activation, b13=self.b13, b2=self.b2)


def make_inputs(
    shape: MoEShape,
    num_tokens: int,
    *,
    rank: int = 16,
    num_adapters: int = 4,
    pattern: str = "uniform",
    slices: int | None = None,
    true_rank: int | None = None,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    bias: bool | None = None,
    used_slots: int | None = None,
    logit_scale: float = 1.0,
    act_scale: float = 1.0,
    experts_override: torch.Tensor | None = None,
) -> MoELoRAInputs:
    """Seeded random MoE + LoRA inputs for ``shape``.

    Args:
        shape: a :class:`~moelora_lib.shapes.MoEShape`.
        num_tokens: T.
        rank: R, slot rank; ``true_rank`` < R zero-pads the adapters' ranks (as when a rank-24
            adapter is loaded into rank-32 slots).
        num_adapters: L. pattern: see :func:`adapter_ids`.
        slices: S (default ``shape.lora_slices``).
        dtype, device: of every float tensor (topk_weights stays float32).
        bias: expert biases (default ``shape.has_bias``).
        act_scale: multiplies w13 so pre-activations reach beyond GPT-OSS's clamp (±7).
        experts_override: [T, K] ids to use instead of routing (e.g. all tokens on one expert).
    Generation happens on the CPU in float32 with a fixed seed, then moves to device/dtype.

    Raises:
        ValueError naming the argument: num_tokens not an int >= 0; rank or num_adapters not an
        int >= 1; true_rank not None or an int in [1, rank]; slices not None, 1 or 2; an unknown
        pattern; used_slots not None or an int in [1, num_adapters]; a seed that is not an int; a
        dtype that is not a floating torch dtype (or a name of :func:`~moelora_lib.common.parse_dtype`);
        an unknown device string; bias not None or a bool; a non-finite scale; experts_override not
        an integer tensor [T, K] with values in [0, E).
        TypeError: shape is not a MoEShape (or preset name), device of the wrong type.
    """
    shape = _check_shape("make_inputs: shape", shape)
    num_tokens = check_int("make_inputs: num_tokens", num_tokens, 0)
    rank = check_int("make_inputs: rank", rank, 1)
    num_adapters = check_int("make_inputs: num_adapters", num_adapters, 1)
    _check_pattern("make_inputs: pattern", pattern)
    if slices is not None:
        slices = check_int("make_inputs: slices", slices, 1, 2)
    if true_rank is not None:
        true_rank = check_int("make_inputs: true_rank", true_rank, 1, rank)
    if used_slots is not None:
        used_slots = check_int("make_inputs: used_slots", used_slots, 1, num_adapters)
    check_int("make_inputs: seed", seed)
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"make_inputs: dtype must be a floating torch dtype, got {dtype}")
    else:
        try:
            dtype = parse_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"make_inputs: {e}") from None
    _check_device("make_inputs: device", device)
    _check_optional_bool("make_inputs: bias", bias)
    _check_real("make_inputs: logit_scale", logit_scale)
    _check_real("make_inputs: act_scale", act_scale)
    if experts_override is not None:
        want = (num_tokens, shape.top_k)
        ok = (
            isinstance(experts_override, torch.Tensor)
            and tuple(experts_override.shape) == want
            and not experts_override.dtype.is_floating_point
            and experts_override.dtype != torch.bool
            and not experts_override.is_complex()
        )
        if not ok:
            got = (
                f"shape {tuple(experts_override.shape)}, dtype {experts_override.dtype}"
                if isinstance(experts_override, torch.Tensor)
                else type(experts_override).__name__
            )
            raise ValueError(
                f"make_inputs: experts_override must be an integer tensor [T={want[0]}, K={want[1]}], "
                f"got {got}"
            )
        if num_tokens and (int(experts_override.min()) < 0 or int(experts_override.max()) >= shape.experts):
            raise ValueError(
                f"make_inputs: experts_override values must be in [0, E={shape.experts}), got min "
                f"{int(experts_override.min())}, max {int(experts_override.max())}"
            )
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = num_tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k
    S = slices or shape.lora_slices
    L, R = num_adapters, rank
    r_true = true_rank or R

    def randn(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    x = randn(T, H)
    w13 = randn(E, 2 * I, H, scale=act_scale / H**0.5)
    w2 = randn(E, H, I, scale=1.0 / I**0.5)
    use_bias = shape.has_bias if bias is None else bias
    b13 = randn(E, 2 * I, scale=0.1) if use_bias else None
    b2 = randn(E, H, scale=0.1) if use_bias else None
    # LoRA: A ~ N(0, 1/in), B ~ N(0, 0.5/R) so the deltas are a sizeable fraction of the base output
    a13 = randn(L, E, S, R, H, scale=1.0 / H**0.5)
    b13l = randn(L, E, S, 2 * I // S, R, scale=0.5 / R**0.5)
    a2 = randn(L, E, R, I, scale=1.0 / I**0.5)
    b2l = randn(L, E, H, R, scale=0.5 / R**0.5)
    if r_true < R:  # zero-padded rank, as when loading a smaller adapter into a larger slot
        a13[..., r_true:, :] = 0
        b13l[..., r_true:] = 0
        a2[..., r_true:, :] = 0
        b2l[..., r_true:] = 0
    logits = randn(T, E, scale=logit_scale)
    topk_w, topk_ids = route(logits, K, shape.renormalize)
    if experts_override is not None:
        topk_ids = experts_override.to(torch.int32)
    lora_ids = adapter_ids(T, L, pattern, g, used_slots)

    def dev(t, d=dtype):
        return None if t is None else t.to(device=device, dtype=d)

    return MoELoRAInputs(
        hidden_states=dev(x),
        w13=dev(w13),
        w2=dev(w2),
        topk_weights=dev(topk_w, torch.float32),
        topk_ids=topk_ids.to(device),
        lora_ids=lora_ids.to(device),
        lora_a13=dev(a13),
        lora_b13=dev(b13l),
        lora_a2=dev(a2),
        lora_b2=dev(b2l),
        activation=shape.activation,
        b13=dev(b13),
        b2=dev(b2),
        router_logits=dev(logits, torch.float32),
    )
