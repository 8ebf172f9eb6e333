"""The architecture of a model the runner builds: :class:`ModelConfig`, read from a transformers
``config.json`` dict by :meth:`ModelConfig.from_hf`, and :data:`REAL_CONFIGS`, the config.json files of
the three supported models (values: docs/models-and-peft.md §1).

Supported ``model_type`` values and what they imply (transformers 5 sources in brackets):

* ``gpt_oss`` (models/gpt_oss/configuration_gpt_oss.py, modeling_gpt_oss.py): MoE in every layer,
  router with bias, top-k of the logits then softmax over the k (the runner routes with a softmax over
  all E, top-k and renormalization, which is the same numbers), experts with biases and the clamped
  ``swigluoai`` activation on interleaved gate/up columns (limit 7.0, alpha 1.702 — the kernels' constants;
  other ``swiglu_limit``/``swiglu_alpha`` values are refused), attention biases, per-head sinks, YaRN RoPE,
  ``layer_types`` alternating sliding (even index) / full when the file has none.
* ``qwen3_moe`` (models/qwen3_moe): MoE in every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``),
  router without bias, softmax over all E, top-k, renormalized iff ``norm_topk_prob``, silu experts with
  [gate | up] rows, RMSNorm over head_dim on q and k, no sliding window.
* ``qwen3`` (models/qwen3): dense silu MLP, q/k norm, ``layer_types`` derived as transformers does
  (sliding only with ``use_sliding_window`` for layers ≥ ``max_window_layers``).

RoPE: transformers 5 files carry ``rope_parameters`` (``rope_theta`` inside); older files carry
``rope_theta`` and ``rope_scaling``. Both are read; ``rope_type`` "default" or "yarn" only.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..common import is_int

__all__ = ["ModelConfig", "REAL_CONFIGS", "MODEL_TYPES"]

#: The model_type values :meth:`ModelConfig.from_hf` accepts.
MODEL_TYPES = ("gpt_oss", "qwen3_moe", "qwen3")
_LAYER_TYPES = ("sliding_attention", "full_attention")
# (num_key_value_heads, head_dim) of a config.json without them: the defaults of transformers' config
# classes (GptOssConfig, Qwen3MoeConfig, Qwen3Config); head_dim None: hidden_size // num_attention_heads
# (Qwen3MoeConfig has no head_dim field, and its attention takes hidden // heads)
_HEAD_DEFAULTS = {"gpt_oss": (8, 64), "qwen3_moe": (4, None), "qwen3": (32, 128)}
# the constants the swigluoai kernels hard-code (moelora_lib/kernels/triton_kernels.py)
_SWIGLU_LIMIT, _SWIGLU_ALPHA = 7.0, 1.702


@dataclass(frozen=True)
class ModelConfig:
    """What the runner needs of a model's config.json (shape letters of moelora_lib/shapes.py).

    Fields:
        model_type: "gpt_oss" | "qwen3_moe" | "qwen3".
        hidden_size: H. num_hidden_layers. num_attention_heads, num_key_value_heads (GQA), head_dim
            (q width = heads·head_dim, kv width = kv_heads·head_dim; need not equal H). vocab_size: V.
            A config.json without num_key_value_heads / head_dim gets what transformers' config class
            gives it: gpt_oss 8 / 64, qwen3 32 / 128, qwen3_moe 4 / hidden_size // num_attention_heads;
            one with null there gets num_attention_heads / hidden_size // num_attention_heads.
        rms_norm_eps. rope_theta. rope_scaling: None (plain RoPE) or the YaRN dict with keys rope_type
            ("yarn"), factor, beta_fast, beta_slow, original_max_position_embeddings, truncate (and
            attention_factor / mscale / mscale_all_dim when the file has them). max_position_embeddings.
        attention_bias: q/k/v/o biases. qk_norm: RMSNorm over head_dim on q and k (qwen3*).
        sinks: per-head attention sinks (gpt_oss). sliding_window: window of the sliding layers, or None.
        layer_types: per layer "sliding_attention" | "full_attention".
        num_experts (E), num_experts_per_tok (top_k), moe_intermediate_size (I; gpt_oss: its
            intermediate_size), router_bias, expert_bias, activation ("silu" | "swigluoai"): MoE models;
            None for dense.
        intermediate_size: the dense MLP's I (qwen3); None for MoE models.
        tie_word_embeddings: lm_head shares the embedding matrix.
        norm_topk_prob: renormalize the top-k routing weights (extra field beyond the issue's spec:
            Qwen3-MoE's flag; True for gpt_oss, whose softmax over the k is already normalized).
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    qk_norm: bool
    sinks: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.model_type in ("gpt_oss", "qwen3_moe")

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read a transformers ``config.json`` dict (the input is not modified).

        Raises:
            ValueError naming the field: model_type not in :data:`MODEL_TYPES`, a required field missing
            or of the wrong type, an unsupported value (rope_type other than default/yarn, a qwen3_moe
            with dense layers or a sliding window, gpt_oss swiglu constants other than 7.0/1.702, an
            activation other than silu, inconsistent head counts or layer_types).
        """
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
        d = dict(config)
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type: must be one of {list(MODEL_TYPES)}, got {mt!r}")

        def req(name: str, *aliases: str, kind: str = "int"):
            for key in (name, *aliases):
                if d.get(key) is not None:
                    return _typed(key, d[key], kind)
            names = " or ".join(repr(k) for k in (name, *aliases))
            raise ValueError(f"{mt} config: required field {names} is missing (or null)")

        def opt(name: str, default, kind: str):
            return default if d.get(name) is None else _typed(name, d[name], kind)

        H = req("hidden_size")
        n_layers = req("num_hidden_layers")
        heads = req("num_attention_heads")
        # a field the file lacks gets the default of transformers' config class (what transformers builds);
        # one set to null, num_attention_heads / hidden_size // num_attention_heads
        kv_default, hd_default = _HEAD_DEFAULTS[mt]
        kv = opt("num_key_value_heads", heads if "num_key_value_heads" in d else kv_default, "int")
        head_dim = opt("head_dim", H // heads if "head_dim" in d else hd_default or H // heads, "int")
        if heads % kv:
            default = "" if "num_key_value_heads" in d else f" (the {mt} default: the file has none)"
            raise ValueError(
                f"num_key_value_heads: {kv}{default} must divide num_attention_heads = {heads} "
                "(grouped-query attention)"
            )
        if head_dim % 2:
            raise ValueError(f"head_dim: must be even for RoPE, got {head_dim}")
        vocab = req("vocab_size")
        eps = req("rms_norm_eps", kind="float")
        max_pos = req("max_position_embeddings")
        rope_theta, rope_scaling = _read_rope(d, max_pos)
        tie = opt("tie_word_embeddings", False, "bool")
        gpt = mt == "gpt_oss"
        attention_bias = opt("attention_bias", gpt, "bool")

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {act!r}")
        if gpt:
            for key, want in (("swiglu_limit", _SWIGLU_LIMIT), ("swiglu_alpha", _SWIGLU_ALPHA)):
                v = d.get(key)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != want):
                    raise ValueError(f"{key}: the swigluoai kernels use {want}, got {v!r}")
            sliding_window = req("sliding_window")
            layer_types = d.get("layer_types")
            if layer_types is None:
                layer_types = [_LAYER_TYPES[i % 2] for i in range(n_layers)]
        else:
            use_sw = opt("use_sliding_window", False, "bool")
            sliding_window = opt("sliding_window", None, "int") if use_sw else None
            if mt == "qwen3_moe" and use_sw:
                raise ValueError(
                    "use_sliding_window: sliding-window attention is not supported for qwen3_moe"
                )
            layer_types = d.get("layer_types")
            if layer_types is None:
                mwl = opt("max_window_layers", n_layers, "int")
                layer_types = [
                    "sliding_attention" if sliding_window is not None and i >= mwl else "full_attention"
                    for i in range(n_layers)
                ]
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n_layers:
            raise ValueError(
                f"layer_types: must list num_hidden_layers = {n_layers} entries, got {layer_types!r}"
            )
        for t in layer_types:
            if t not in _LAYER_TYPES:
                raise ValueError(f"layer_types: entries must be in {list(_LAYER_TYPES)}, got {t!r}")
        if "sliding_attention" in layer_types and (sliding_window is None or sliding_window < 1):
            raise ValueError(
                f"sliding_window: a positive int is needed by the sliding layers, got {sliding_window!r}"
            )

        moe: dict[str, Any] = {}
        if mt == "gpt_oss":
            moe = dict(
                num_experts=req("num_local_experts", "num_experts"),
                num_experts_per_tok=req("num_experts_per_tok", "experts_per_token"),
                moe_intermediate_size=req("intermediate_size"),
                router_bias=True,
                expert_bias=True,
                activation="swigluoai",
                norm_topk_prob=True,
            )
        elif mt == "qwen3_moe":
            if opt("decoder_sparse_step", 1, "int") != 1:
                raise ValueError("decoder_sparse_step: only 1 (every layer MoE) is supported")
            if d.get("mlp_only_layers"):
                raise ValueError(
                    "mlp_only_layers: dense layers in a qwen3_moe are not supported, "
                    f"got {d['mlp_only_layers']}"
                )
            moe = dict(
                num_experts=req("num_experts", "num_local_experts"),
                num_experts_per_tok=req("num_experts_per_tok"),
                moe_intermediate_size=req("moe_intermediate_size"),
                activation="silu",
                norm_topk_prob=opt("norm_topk_prob", False, "bool"),
            )
        else:
            moe = dict(intermediate_size=req("intermediate_size"))
        if "num_experts_per_tok" in moe and not 1 <= moe["num_experts_per_tok"] <= moe["num_experts"]:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts = {moe['num_experts']}], "
                f"got {moe['num_experts_per_tok']}"
            )
        return cls(
            model_type=mt,
            hidden_size=H,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            attention_bias=attention_bias,
            qk_norm=mt != "gpt_oss",
            sinks=gpt,
            sliding_window=sliding_window if "sliding_attention" in layer_types else None,
            layer_types=tuple(layer_types),
            tie_word_embeddings=tie,
            **moe,
        )


def _typed(name: str, v, kind: str):
    if kind == "int":
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
        return int(v)
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}: must be a positive finite number, got {v!r}")
        return float(v)
    if not isinstance(v, bool):
        raise ValueError(f"{name}: must be true or false, got {v!r}")
    return v


def _read_rope(d: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, YaRN dict or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older files), as transformers' ``standardize_rope_params`` reads them."""
    rp = d.get("rope_parameters")
    if rp is not None and not isinstance(rp, Mapping):
        raise ValueError(f"rope_parameters: must be a dict, got {rp!r}")
    if rp is not None and any(isinstance(v, Mapping) for v in rp.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    rs = d.get("rope_scaling")
    if not rp and rs is not None and not isinstance(rs, Mapping):
        raise ValueError(f"rope_scaling: must be a dict or null, got {rs!r}")
    scaling = dict(rp) if rp else dict(rs or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta")
    if theta is None:
        raise ValueError(
            f"{d['model_type']} config: required field 'rope_theta' (top level or in rope_parameters) "
            "is missing"
        )
    theta = _typed("rope_theta", theta, "float")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(
            f"rope_scaling.rope_type: only 'default' and 'yarn' are supported, got {rope_type!r}"
        )
    orig = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor")
    if factor is None:
        factor = max_pos / orig
    out = dict(
        rope_type="yarn",
        factor=_typed("rope_scaling.factor", factor, "float"),
        beta_fast=_typed("rope_scaling.beta_fast", scaling.get("beta_fast") or 32.0, "float"),
        beta_slow=_typed("rope_scaling.beta_slow", scaling.get("beta_slow") or 1.0, "float"),
        original_max_position_embeddings=_typed("rope_scaling.original_max_position_embeddings", orig, "int"),
        truncate=bool(scaling.get("truncate", True)),
    )
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            v = scaling[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"rope_scaling.{key}: must be a finite number >= 0, got {v!r}")
            out[key] = float(v)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_scaling.partial_rotary_factor: only 1.0 is supported")
    return theta, out


# --------------------------------------------------------------------------------------------------
# the three real config.json files (docs/models-and-peft.md §1)
# --------------------------------------------------------------------------------------------------
_GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": [_LAYER_TYPES[i % 2] for i in range(24)],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "max_window_layers": 64,
    "model_type": "qwen3",
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


class _FreshCopies(Mapping):
    """A read-only mapping whose values are deep copies: transformers' config classes edit the dicts
    they are given (``standardize_rope_params`` adds rope_theta into rope_scaling), which must not
    change the module's data."""

    def __init__(self, data: dict):
        self._data = data

    def __getitem__(self, key):
        return copy.deepcopy(self._data[key])

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


#: The config.json of each real model, as a fresh dict per access (pass it to :meth:`ModelConfig.from_hf`
#: or a transformers config class); the files' values, including fields the runner ignores such as
#: quantization_config.
REAL_CONFIGS: Mapping[str, dict] = _FreshCopies(
    {"gpt-oss-20b": _GPT_OSS_20B, "qwen3-30b-a3b": _QWEN3_30B_A3B, "qwen3-32b": _QWEN3_32B}
)
