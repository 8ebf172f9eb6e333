"""Model presets and the shape letters used everywhere in moelora_lib.

Shape letters (fixed here, used in every docstring):

====  =====================================================================
T     tokens in the batch
H     hidden size (model dimension)
I     intermediate size of one expert (``moe_intermediate_size``)
E     number of routed experts
K     top_k: experts per token
L     adapter (LoRA) slots; a token's adapter id is in [-1, L), -1 = no adapter
R     max LoRA rank of the slots (smaller true ranks are zero-padded to R)
S     slices of the gate_up LoRA: 2 = separate gate and up adapters (per-expert
      2-D adapters, Qwen3-MoE/Mixtral/DeepSeek), 1 = one fused slice of 2I rows
      (GPT-OSS-style 3-D adapters)
====  =====================================================================

The preset values are taken from each model's published ``config.json`` on the
Hugging Face hub (openai/gpt-oss-20b, openai/gpt-oss-120b, Qwen/Qwen3-30B-A3B,
mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V2-Lite; for the dense projections also
Qwen/Qwen3-32B and meta-llama/Llama-3.3-70B-Instruct).

Dense multi-LoRA presets (:mod:`moelora_lib.lora_linear`): :class:`DenseModel` (:data:`DENSE_PRESETS`)
gives each model's attention (qkv, o) and dense-MLP (gate_up, down) projections as
:class:`DenseProjection` (:data:`DENSE_PROJECTIONS`); the one definition the dense studies
(``studies/dense_bench.py``, ``studies/dense_tuning.py``) build on.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = [
    "MoEShape",
    "Dims",
    "CONFIG_WEIGHT_FORMATS",
    "PRESETS",
    "get_shape",
    "check_int",
    "check_dims",
    "DenseModel",
    "DenseProjection",
    "DENSE_PRESETS",
    "DENSE_GPU_MODELS",
    "DENSE_CPU_MODELS",
    "DENSE_PROJECTIONS",
]

ACTIVATIONS = ("silu", "swigluoai")

#: The expert-weight forms a config is tuned for (:attr:`Dims.weight_format`): "dense" (bf16/fp16/fp32
#: weights), "mxfp4" (MXFP4 experts), "fp8" (block-FP8 experts, weight-only: dequantized in the GEMM),
#: "fp8_w8a8" (block-FP8 experts with activations quantized per token and group).
CONFIG_WEIGHT_FORMATS = ("dense", "mxfp4", "fp8", "fp8_w8a8")


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer's dimensions.

    Attributes:
        name: preset name.
        hidden: H.
        intermediate: I, per expert (w13 has 2I rows, w2 has I columns).
        experts: E, routed experts (shared experts are not modelled here).
        top_k: K.
        layers: number of MoE layers in the model (for whole-model estimates).
        activation: ``"silu"`` (silu(gate)·up on [gate | up] halves) or ``"swigluoai"``
            (GPT-OSS: gate/up rows interleaved, clamp 7.0, alpha 1.702, (up + 1)).
        has_bias: the experts carry biases b13 [E, 2I] and b2 [E, H] (GPT-OSS).
        renormalize: top-k weights renormalized to sum to 1 after the softmax.
        lora_slices: S used for this model's gate_up adapters (1 for GPT-OSS 3-D adapters, else 2).
    """

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int
    activation: str = "silu"
    has_bias: bool = False
    renormalize: bool = True
    lora_slices: int = 2

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")
        if self.lora_slices not in (1, 2):
            raise ValueError(f"lora_slices must be 1 or 2, got {self.lora_slices}")

    # Bytes/FLOPs of the frozen expert weights (bf16 = 2 bytes/element).
    def expert_weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of one expert's w13 [2I, H] plus w2 [H, I]."""
        return 3 * self.intermediate * self.hidden * dtype_bytes

    def base_flops(self, tokens: int) -> int:
        """FLOPs of the two base grouped GEMMs for ``tokens`` tokens (2·m·n·k each)."""
        pairs = tokens * self.top_k
        return 2 * pairs * self.hidden * (2 * self.intermediate) + 2 * pairs * self.intermediate * self.hidden


PRESETS: dict[str, MoEShape] = {
    # openai/gpt-oss-20b: hidden 2880, intermediate 2880, 32 local experts, 4 per token, 24 layers,
    # swiglu_limit 7.0, experts with biases; router softmax over the top-4 logits.
    "gpt-oss-20b": MoEShape("gpt-oss-20b", 2880, 2880, 32, 4, 24, "swigluoai", True, True, 1),
    # openai/gpt-oss-120b: same layer shape, 128 experts, 36 layers.
    "gpt-oss-120b": MoEShape("gpt-oss-120b", 2880, 2880, 128, 4, 36, "swigluoai", True, True, 1),
    # Qwen/Qwen3-30B-A3B: hidden 2048, moe_intermediate_size 768, 128 experts, 8 per token, 48 layers,
    # norm_topk_prob true.
    "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8, 48, "silu", False, True, 2),
    # mistralai/Mixtral-8x7B: hidden 4096, intermediate 14336, 8 experts, top-2, 32 layers.
    "mixtral-8x7b": MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, 32, "silu", False, True, 2),
    # deepseek-ai/DeepSeek-V2-Lite: hidden 2048, moe_intermediate_size 1408, 64 routed experts, 6 per
    # token, 27 layers (26 MoE + first dense; 2 shared experts not modelled), norm_topk_prob false.
    "deepseek-v2-lite": MoEShape("deepseek-v2-lite", 2048, 1408, 64, 6, 26, "silu", False, False, 2),
    # CPU preset: small enough for the Triton interpreter.
    "tiny": MoEShape("tiny", 64, 32, 4, 2, 1, "silu", False, True, 2),
    "tiny-oss": MoEShape("tiny-oss", 64, 32, 4, 2, 1, "swigluoai", True, True, 1),
}


def get_shape(name: str) -> MoEShape:
    """Return the preset ``name``; raises ValueError listing the known presets."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


def check_int(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int when it is an integer (Python or numpy, not a bool) in [lo, hi]; else ValueError
    naming ``name``, the expected range and what was given (no silent ``int()`` truncation of 2.7 or '4').
    """
    rng = (
        f" in [{lo}, {hi}]"
        if lo is not None and hi is not None
        else f" >= {lo}"
        if lo is not None
        else f" <= {hi}"
        if hi is not None
        else ""
    )
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise ValueError(f"{name} must be an int{rng}, got {v!r} ({type(v).__name__})")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be an int{rng}, got {v}")
    return v


@dataclass(frozen=True)
class Dims:
    """The sizes of one MoE+LoRA layer call, in the shape letters of this module (ints: T ≥ 0, the
    others ≥ 1).

    Attributes:
        T: tokens (0 = an empty batch). H: hidden. I: intermediate per expert. E: experts. top_k: K.
        adapters: L, LoRA slots. rank: R, max rank of the slots. slices: S, gate_up LoRA slices (1 or 2).
        weight_format: the experts' form, one of :data:`CONFIG_WEIGHT_FORMATS` (default "dense"): the
            base and fused GEMMs' configs are looked up in that form's files where they exist
            (:func:`moelora_lib.configs.config_file_name`).

    Used instead of loose positional ints wherever a layer's sizes travel together (config keys, default
    configs, op costs, compile-only launches). Build one with :meth:`of` from a preset, or
    :meth:`from_tensors` from a layer's inputs. Raises ValueError naming the field for a non-int,
    a negative T, another size < 1, S not in (1, 2), top_k > E, or a weight_format outside
    :data:`CONFIG_WEIGHT_FORMATS`.
    """

    T: int
    H: int
    I: int
    E: int
    top_k: int
    adapters: int
    rank: int
    slices: int = 2
    weight_format: str = "dense"

    def __post_init__(self) -> None:
        for f in ("T", "H", "I", "E", "top_k", "adapters", "rank", "slices"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if f == "T" else 1):
                raise ValueError(f"Dims.{f} must be an int >= {0 if f == 'T' else 1}, got {v!r}")
        if self.slices not in (1, 2):
            raise ValueError(f"Dims.slices must be 1 or 2, got {self.slices}")
        if self.top_k > self.E:
            raise ValueError(f"Dims.top_k must be <= E={self.E}, got {self.top_k}")
        if self.weight_format not in CONFIG_WEIGHT_FORMATS:
            raise ValueError(
                f"Dims.weight_format must be one of {CONFIG_WEIGHT_FORMATS}, got {self.weight_format!r}"
            )

    # The short letters of shapes.py, for formulas.
    @property
    def K(self) -> int:
        return self.top_k

    @property
    def L(self) -> int:
        return self.adapters

    @property
    def R(self) -> int:
        return self.rank

    @property
    def S(self) -> int:
        return self.slices

    @property
    def pairs(self) -> int:
        """T·top_k (token, expert) pairs."""
        return self.T * self.top_k

    @classmethod
    def of(
        cls,
        shape: MoEShape | str,
        T: int,
        *,
        rank: int = 32,
        adapters: int = 8,
        slices: int | None = None,
        weight_format: str = "dense",
    ) -> Dims:
        """Dims of preset ``shape`` (a :class:`MoEShape` or its name) at T tokens.

        T, rank and adapters must be ints (numpy ints accepted; floats, strings and bools raise
        ValueError naming the argument); ``slices`` None = the preset's S, else 1 or 2;
        ``weight_format``: one of :data:`CONFIG_WEIGHT_FORMATS`.
        """
        if isinstance(shape, MoEShape):
            sh = shape
        elif isinstance(shape, str):
            sh = get_shape(shape)
        else:
            raise TypeError(f"Dims.of: shape must be a MoEShape or a preset name, got {type(shape).__name__}")
        return cls(
            T=check_int("Dims.of: T", T, 0),
            H=sh.hidden,
            I=sh.intermediate,
            E=sh.experts,
            top_k=sh.top_k,
            adapters=check_int("Dims.of: adapters", adapters, 1),
            rank=check_int("Dims.of: rank", rank, 1),
            slices=sh.lora_slices if slices is None else check_int("Dims.of: slices", slices, 1, 2),
            weight_format=weight_format,
        )

    @classmethod
    def from_tensors(cls, hidden_states, w2, topk_ids, lora_a13, weight_format: str = "dense") -> Dims:
        """Dims of a layer call: hidden_states [T, H], w2 [E, H, I], topk_ids [T, K],
        lora_a13 [L, E, S, R, H]; ``weight_format`` as in :meth:`of`."""
        T, H = hidden_states.shape
        E, _, I = w2.shape
        L, _, S, R, _ = lora_a13.shape
        return cls(
            T=T,
            H=H,
            I=I,
            E=E,
            top_k=topk_ids.shape[1],
            adapters=L,
            rank=R,
            slices=S,
            weight_format=weight_format,
        )


def check_dims(name: str, dims) -> Dims:
    """``dims`` when it is a :class:`Dims`; else TypeError naming ``name`` and what was given (a layer's
    sizes travel as one Dims: build it with :meth:`Dims.of` or :meth:`Dims.from_tensors`)."""
    if not isinstance(dims, Dims):
        raise TypeError(
            f"{name} must be a moelora_lib.shapes.Dims (Dims.of(preset, T, ...)), got {type(dims).__name__}: "
            f"{dims!r}"
        )
    return dims


# ------------------------------------------------------------------------------------------------
# Dense multi-LoRA projections (attention and dense MLP)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseProjection:
    """One fused dense projection: x [T, hidden] -> [T, Σ slices] (fused qkv, fused gate_up, or one).

    Attributes:
        model: model name. proj: "qkv", "o", "gate_up" or "down".
        hidden: H, the input width (the K of vLLM's dense anchor table).
        slices: output widths N_s (Σ = N), fused in one weight.
    """

    model: str
    proj: str
    hidden: int
    slices: tuple[int, ...]

    @property
    def name(self) -> str:
        """``"<model>/<proj>"``."""
        return f"{self.model}/{self.proj}"

    @property
    def n_total(self) -> int:
        """N = Σ slices."""
        return sum(self.slices)

    @property
    def slices_str(self) -> str:
        """The slices as the anchor table writes them: ``"4096+512+512"``."""
        return "+".join(str(n) for n in self.slices)


@dataclass(frozen=True)
class DenseModel:
    """The dense projections' sizes of one model (from its published config.json).

    Attributes:
        name: model name (as in vLLM's dense anchor table).
        hidden: hidden size.
        q_heads, kv_heads, head_dim: attention heads (GQA: kv_heads < q_heads).
        intermediate: dense MLP width, or None (MoE models: their MLP is the experts).
    """

    name: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int | None = None

    def projections(self) -> list[DenseProjection]:
        """qkv (q heads·d, kv heads·d, kv heads·d from the hidden size), o (q heads·d → hidden) and,
        with a dense MLP, gate_up (hidden → 2 × intermediate) and down (intermediate → hidden)."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        out = [
            DenseProjection(self.name, "qkv", self.hidden, (q, kv, kv)),
            DenseProjection(self.name, "o", q, (self.hidden,)),
        ]
        if self.intermediate:
            i = self.intermediate
            out += [
                DenseProjection(self.name, "gate_up", self.hidden, (i, i)),
                DenseProjection(self.name, "down", i, (self.hidden,)),
            ]
        return out


#: The four models of the dense study: GPT-OSS-20B and Qwen3-30B-A3B (attention only: their MLPs are
#: MoE), Qwen3-32B and Llama-3.3-70B (attention and dense MLP); then ``tiny``, the CPU preset (Triton
#: interpreter): GQA qkv 48 -> 64 + 16 + 16, o 64 -> 48, gate_up 48 -> 96 + 96, down 96 -> 48 (48 and
#: 96 are not multiples of BLOCK_SIZE_K 64: the masked K loop).
DENSE_PRESETS: dict[str, DenseModel] = {
    m.name: m
    for m in (
        DenseModel("gpt-oss-20b", 2880, 64, 8, 64),
        DenseModel("qwen3-30b-a3b", 2048, 32, 4, 128),
        DenseModel("qwen3-32b", 5120, 64, 8, 128, 25600),
        DenseModel("llama-3.3-70b", 8192, 64, 8, 128, 28672),
        DenseModel("tiny", 48, 4, 1, 16, 96),
    )
}
#: The GPU models of :data:`DENSE_PRESETS` (12 projections) and the CPU smoke preset.
DENSE_GPU_MODELS = ("gpt-oss-20b", "qwen3-30b-a3b", "qwen3-32b", "llama-3.3-70b")
DENSE_CPU_MODELS = ("tiny",)
#: Every dense projection by ``"<model>/<proj>"`` (the 12 of the GPU models, then the tiny ones).
DENSE_PROJECTIONS: dict[str, DenseProjection] = {
    p.name: p for m in DENSE_PRESETS.values() for p in m.projections()
}
