"""PEFT LoRA adapter files (``adapter_config.json`` + ``adapter_model.safetensors``) read into the
slot layout of :class:`moelora_lib.LoRALinear` and :class:`moelora_lib.MoELoRALayer`.

Two entry points:

* :func:`read_peft_adapter` parses and checks one adapter against a :class:`ModelConfig` and returns a
  :class:`PeftAdapter` (no model needed; fp32 tensors on the CPU).
* :func:`load_peft_adapter` reads an adapter, checks it against a ``MultiLoRAModel`` (ranks against
  each module's max rank R, slot against L), empties the slot everywhere and loads every module's part.
  Nothing is written to the model unless every check passes.

File formats (facts in docs/models-and-peft.md §4; keys are
``base_model.model.`` + module path + ``.lora_A.weight`` / ``.lora_B.weight``):

* **Module LoRA** (``target_modules``): ``self_attn.{q,k,v,o}_proj`` on all three models, dense
  ``mlp.{gate,up,down}_proj`` on Qwen3, per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` on
  Qwen3-MoE (files written with transformers 4). ``lora_A`` [r, in], ``lora_B`` [out, r]; ΔW = s·B·A.
* **3-D expert LoRA** (``target_parameters`` on ``mlp.experts.gate_up_proj`` / ``down_proj``; GPT-OSS,
  and Qwen3-MoE under transformers 5). ``lora_A`` [E·r, in] expert-major, ``lora_B`` [out, E·r] with the
  expert index fastest: A_e = ``lora_A[e·r : e·r+r]``, B_e = ``lora_B[:, e::E]``. in/out are those of
  the equivalent nn.Linear (gate_up: H → 2I, down: I → H), whatever the base parameter's storage.
  When both parameters are targeted, gate_up is the inner wrapper (``mlp.experts.base_layer.lora_*``)
  and down the outer one (``mlp.experts.lora_*``); with one targeted parameter its factors are
  ``mlp.experts.lora_*`` and which one it is comes from ``target_parameters``, checked against the
  shapes (the two projections never have the same pair of shapes).

**Orientation of 3-D adapters** (docs/models-and-peft.md §4.6). PEFT 0.19.0, PEFT ≥ 0.19.1 with
transformers 4 (GPT-OSS)
and PEFT ≤ 0.18 with transformers 5 (Qwen3-MoE) wrote the two factors with swapped roles: lora_A
[E·r, out], lora_B [in, E·r], the update being x·B_e·A_e. Such files are **loaded correctly** when
the shapes show it (shrink = B_eᵀ, expand = A_eᵀ): gate_up whenever H ≠ 2I (true for all three real
models), down whenever H ≠ I. A file in which every 3-D projection is ambiguous (a down-only adapter
on gpt-oss-20b, where H = I = 2880) is read in the normal orientation, the one every current PEFT +
transformers 5 writes; one file with contradicting orientations is refused.

Scaling per module: ``lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``), r and alpha overridden
by ``rank_pattern`` / ``alpha_pattern`` matched the way PEFT matches them (the first pattern key ``k``
in file order for which ``(.*\\.)?(k)$`` matches the module's name, e.g.
``model.layers.0.self_attn.q_proj`` or ``model.layers.0.mlp.experts.gate_up_proj``).

Slot layout produced (``PeftAdapter.layers[l]``):

* ``"q" "k" "v" "o" "gate" "up" "down"`` → ``(A [r, in], B [out, r], scaling)``: plain module LoRA.
* ``"experts_gate_up"`` → ``(A [E, S, r, H], B [E, S, 2I/S, r], scaling)``. 3-D files: every slice's A
  is A_e, and slice s's B is rows ``s·2I/S … (s+1)·2I/S − 1`` of B_e (B_e's rows follow the base
  parameter's output order: interleaved gate/up for GPT-OSS, [gate | up] for Qwen3-MoE — the order
  MultiLoRAModel keeps in ``w13``). So GPT-OSS S = 1 is ``(A_e, B_e)`` as is, and Qwen3-MoE S = 2 is
  ``(A_e, B_e[:I])``, ``(A_e, B_e[I:])``. Per-expert files: S = 2 → slice 0 gate, slice 1 up; S = 1 →
  rank r_gate + r_up, ``A = [A_gate; A_up]``, ``B = blockdiag(B_gate, B_up)`` (w13 rows [gate | up]).
* ``"experts_down"`` → ``(A [E, r, I], B [E, H, r], scaling)``.

Where the pieces of one entry have different scalings (per-expert files with ``rank_pattern``), they
are folded into B and the entry's scaling is 1.0. Ranks below the entry's r are zero-padded.

adapter_config.json fields (every dataclass field of ``peft.LoraConfig`` 0.21.2), by what the loader
does with them:

* **read**: ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern`` (the scalings);
  ``target_parameters`` (which 3-D expert parameter a key is; only the experts' ``gate_up_proj`` /
  ``down_proj``); ``peft_type`` (must be LORA); ``auto_mapping.base_model_class`` (must be this family);
  ``init_lora_weights`` (see below).
* **no effect on the loaded update** (training, bookkeeping, or which modules got factors; the file's
  keys are what is loaded): ``task_type``, ``peft_version``, ``base_model_name_or_path``, ``revision``,
  ``inference_mode``, ``target_modules``, ``exclude_modules``, ``layers_to_transform``,
  ``layers_pattern``, ``lora_dropout``, ``megatron_core``, ``qalora_group_size``, ``runtime_config``,
  ``ensure_weight_tying``, and the init settings ``loftq_config``, ``eva_config``, ``corda_config``,
  ``lora_ga_config`` (they act only through ``init_lora_weights``).
* **refused when set** (not falsy; ``bias`` when not "none"): ``use_dora``, ``lora_bias``, ``bias``,
  ``fan_in_fan_out``, ``modules_to_save``, ``trainable_token_indices``, ``alora_invocation_tokens``,
  ``use_qalora``, ``layer_replication``, ``megatron_config``, ``use_bdlora``, ``arrow_config``,
  ``kasa_config``, ``velora_config``, ``monteclora_config``: each adds weights or changes the forward in a
  way the slots do not implement.
* ``init_lora_weights``: ``true``, ``false``, ``"gaussian"``, ``"eva"``, ``"orthogonal"``, ``"mica"`` only
  set the factors' starting values (the forward is plain LoRA) and are accepted. ``"pissa"``,
  ``"pissa_niter_<n>"``, ``"olora"``, ``"corda"``, ``"lora_ga"`` subtract the initial factors from the base
  weights, and ``"loftq"`` replaces them by quantized ones; PEFT reloads such a file by rewriting the base
  weights, which a base shared by all slots cannot do, so they are refused. The fix for the first five is
  PEFT's conversion to a plain LoRA: ``save_pretrained(out, path_initial_model_for_weight_conversion=init)``
  where ``init`` holds the adapter saved right after ``get_peft_model`` (before training); the result has
  ``init_lora_weights: true`` and rank 2r, and loads here. Any other value is refused.
* **any other field** with a set value (not null / false / empty) is refused, naming it: the loader
  cannot tell whether it changes the math.

Also refused with ValueError naming the key: keys of modules the model does not have (embeddings,
lm_head, routers, dense MLP on an MoE model, per-expert keys on GPT-OSS, layers ≥ num_hidden_layers,
experts ≥ E), a lone lora_A or lora_B, shapes that do not fit the config (the expected shape is in the
message), ranks that disagree with the config's r / ``rank_pattern``, and at load time a rank above the
module's R or a slot outside [0, L). Every refusal happens before anything is written to the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..common import is_finite, is_int
from .config import ModelConfig

__all__ = ["PeftAdapter", "read_peft_adapter", "load_peft_adapter"]

ATTENTION = ("q", "k", "v", "o")
DENSEMLP = ("gate", "up", "down")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")

# adapter_config.json fields, by what the loader does with them (the module docstring has the table)
_READ_FIELDS = (
    "peft_type",
    "auto_mapping",
    "r",
    "lora_alpha",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "target_parameters",
    "init_lora_weights",
    "bias",
)
_NO_EFFECT_FIELDS = (
    "task_type",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "lora_dropout",
    "megatron_core",
    "qalora_group_size",
    "runtime_config",
    "ensure_weight_tying",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
)
# set (truthy) values add weights or change the forward in ways the slots do not implement
_REFUSED_TRUTHY = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "layer_replication",
    "megatron_config",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)
# init_lora_weights values that only choose the factors' starting values (the forward is plain LoRA)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# init_lora_weights values after which PEFT's reload rewrites the base weights
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "lora_ga")  # and every "pissa…" / "corda…" value
_CLASS_PREFIX = {"gpt_oss": "GptOss", "qwen3_moe": "Qwen3Moe", "qwen3": "Qwen3"}

_KEY_RE = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(.+))\.lora_([AB])\.weight$")
_ATTN_RE = re.compile(r"^self_attn\.([qkvo])_proj$")
_DENSERE = re.compile(r"^mlp\.(gate|up|down)_proj$")
_PER_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
_EXPERTS3D_RE = re.compile(r"^mlp\.experts(\.base_layer)?$")  # outer / inner wrapper


@dataclass
class PeftAdapter:
    """One PEFT LoRA adapter in the slot layout (see the module docstring for the entries).

    Attributes:
        layers: per decoder layer l, a dict name → (A, B, scaling); fp32 CPU tensors. Names: "q", "k",
            "v", "o", "gate", "up", "down" (A [r, in], B [out, r]); "experts_gate_up"
            (A [E, S, r, H], B [E, S, 2I/S, r]); "experts_down" (A [E, r, I], B [E, H, r]).
        rank: the largest r of any entry (what a slot's max rank R must hold).
        path: the adapter folder.
        peft_config: adapter_config.json as a dict.
        expert_slices: S used for "experts_gate_up".
        expert_orientation: "normal" or "swapped" for files with 3-D expert factors, else None.
        sources: (layer, name) → the module path in the file (for messages).
        slot: the adapter slot :func:`load_peft_adapter` loaded it into; None from
            :func:`read_peft_adapter`.

    Its repr is one line (slot, rank, lora_alpha, scalings, tensor count, projections, layers, path),
    not the tensors.
    """

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]]
    rank: int
    path: str
    peft_config: dict
    expert_slices: int
    expert_orientation: str | None = None
    sources: dict[tuple[int, str], str] = field(default_factory=dict)
    slot: int | None = None

    def __repr__(self) -> str:
        entries = [(layer, name, e) for layer, d in enumerate(self.layers) for name, e in d.items()]
        order = {n: i for i, n in enumerate(_ENTRY_ORDER)}
        names = sorted({n for _, n, _ in entries}, key=lambda n: (order.get(n, len(order)), n))
        alpha = self.peft_config.get("lora_alpha")
        scalings = sorted({float(e[2]) for _, _, e in entries})
        if len(scalings) == 1:
            scaling = f"{scalings[0]:g}"
        elif len(scalings) <= 4:
            scaling = "[" + ", ".join(f"{v:g}" for v in scalings) + "]"
        else:  # per-module patterns: the range, not every value
            scaling = f"{scalings[0]:g}..{scalings[-1]:g} ({len(scalings)} values)"
        return (
            f"PeftAdapter(slot={self.slot}, rank={self.rank}, lora_alpha={alpha}, "
            f"scaling={scaling}, tensors={2 * len(entries)}, projections=[{', '.join(names)}], "
            f"layers={_ranges(sorted({layer for layer, _, _ in entries}))} of {len(self.layers)}, "
            f"path={str(self.path)!r})"
        )


#: Entry names in the order a decoder layer runs them (for PeftAdapter's repr).
_ENTRY_ORDER = ("q", "k", "v", "o", "gate", "up", "down", "experts_gate_up", "experts_down")


def _ranges(ids: list[int]) -> str:
    """Sorted ints as ranges: [0, 1, 2, 5] -> "0-2,5"; [] -> "none"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


# --- small helpers ---------------------------------------------------------------------------------
def _cfg(config, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _pattern_value(patterns: dict, module_key: str, default, what: str):
    """PEFT's get_pattern_key: the first key k (file order) with re.match(rf"(.*\\.)?({k})$", name)."""
    for k, v in patterns.items():
        try:
            hit = re.match(rf"(.*\.)?({k})$", module_key)
        except re.error as exc:
            raise ValueError(f"adapter_config.json: {what} key {k!r} is not a valid regex ({exc})") from None
        if hit:
            return v
    return default


def _read_config(path: str) -> dict:
    if os.path.isfile(path):
        raise ValueError(
            f"{path!r} is a file; expected a PEFT adapter folder (adapter_config.json + "
            "adapter_model.safetensors)"
        )
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r}: no adapter_config.json (expected a PEFT adapter folder)")
    with open(cfg_path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    return cfg


def _check_init(init) -> None:
    """``init_lora_weights``: accept the values whose forward is plain LoRA on the unchanged base."""
    if any(init is v or (isinstance(init, str) and init == v) for v in _PLAIN_INITS):
        return
    text = init.lower() if isinstance(init, str) else None
    if text is not None and (text in _BASE_REWRITING_INITS or text.startswith(("pissa", "corda"))):
        raise ValueError(
            f"adapter_config.json: init_lora_weights = {init!r}: PEFT reloads this adapter by subtracting "
            "its initial factors from the base weights, which a base shared by all adapter slots cannot do. "
            "Convert it to a plain LoRA with PEFT: save_pretrained(out, "
            "path_initial_model_for_weight_conversion=<the adapter saved right after get_peft_model, before "
            "training>); the converted folder (init_lora_weights true, rank 2r) loads here"
        )
    if text == "loftq":
        raise ValueError(
            "adapter_config.json: init_lora_weights = 'loftq': the factors complement LoftQ-quantized base "
            "weights, which this loader does not produce; only plain LoRA on the unchanged base is supported"
        )
    raise ValueError(
        f"adapter_config.json: init_lora_weights = {init!r} is not supported (accepted: true, false, "
        "'gaussian', 'eva', 'orthogonal', 'mica')"
    )


def _check_peft_config(cfg: dict, config) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {peft_type!r} is not supported (only LORA)")
    for name in _REFUSED_TRUTHY:
        v = cfg.get(name)
        if v:
            raise ValueError(f"adapter_config.json: {name} = {v!r} is not supported (only plain LoRA)")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"adapter_config.json: bias = {bias!r} is not supported (only 'none')")
    _check_init(cfg.get("init_lora_weights", True))
    known = set(_READ_FIELDS) | set(_NO_EFFECT_FIELDS) | set(_REFUSED_TRUTHY)
    for name, v in cfg.items():
        if name not in known and v not in (None, False, "", [], {}):
            raise ValueError(
                f"adapter_config.json: unknown field {name} = {v!r}: not a LoraConfig field this loader "
                "knows (PEFT 0.21.2), so it cannot tell whether it changes the adapter's math; refused"
            )
    for name in ("r", "lora_alpha"):
        v = cfg.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"adapter_config.json: {name} must be a positive number, got {v!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(name)
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"adapter_config.json: {name} must be a dict, got {v!r}")
    cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    if cls is not None:
        prefix = _CLASS_PREFIX[config.model_type]
        if not re.fullmatch(rf"{prefix}(For\w+|Model)", str(cls)):
            raise ValueError(
                f"adapter_config.json: auto_mapping.base_model_class = {cls!r}: the adapter was made for "
                f"another model, this one is {config.model_type!r} ({prefix}ForCausalLM)"
            )


def _targeted_params(cfg: dict, config, layer: int) -> list[str]:
    """Which of the experts' parameters target_parameters names in layer ``layer`` (PEFT's matching)."""
    targets = cfg.get("target_parameters") or []
    out = []
    for p in EXPERT_PARAMS:
        key = f"model.layers.{layer}.mlp.experts.{p}"
        if any(key == t or key.endswith("." + t) for t in targets):
            out.append(p)
    return out


def _check_target_parameters(cfg: dict, config) -> None:
    targets = cfg.get("target_parameters") or []
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)):
        raise ValueError(f"adapter_config.json: target_parameters must be a list, got {targets!r}")
    if targets and config.model_type == "qwen3":
        raise ValueError(
            f"adapter_config.json: target_parameters = {list(targets)!r}: a dense Qwen3 model has no "
            "3-D expert parameters"
        )
    for t in targets:
        hit = any(
            key == t or key.endswith("." + t)
            for layer in range(config.num_hidden_layers)
            for key in (f"model.layers.{layer}.mlp.experts.{p}" for p in EXPERT_PARAMS)
        )
        if not hit:
            raise ValueError(
                f"adapter_config.json: target_parameters entry {t!r} is not supported; only the experts' "
                "'mlp.experts.gate_up_proj' and 'mlp.experts.down_proj' can be loaded"
            )


def _scaling(cfg: dict, module_key: str) -> tuple[int, float]:
    r = _pattern_value(cfg.get("rank_pattern") or {}, module_key, cfg["r"], "rank_pattern")
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module_key, cfg["lora_alpha"], "alpha_pattern")
    if not is_int(r) or r < 1:
        raise ValueError(f"adapter_config.json: rank for {module_key!r} must be a positive int, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(
            f"adapter_config.json: lora_alpha for {module_key!r} must be a number, got {alpha!r}"
        )
    s = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(s)


def _fold(pieces: list[tuple[torch.Tensor, float]]) -> tuple[list[torch.Tensor], float]:
    """One scaling for several B pieces: keep it when they agree, else fold each into its B (→ 1.0)."""
    scales = {s for _, s in pieces}
    if len(scales) <= 1:
        return [b for b, _ in pieces], (scales.pop() if scales else 1.0)
    return [b * s for b, s in pieces], 1.0


# --- module LoRA -----------------------------------------------------------------------------------
def _module_dims(config, layer: int, name: str) -> tuple[int, int]:
    H = config.hidden_size
    qw = config.num_attention_heads * config.head_dim
    kvw = config.num_key_value_heads * config.head_dim
    if name == "q":
        return H, qw
    if name in ("k", "v"):
        return H, kvw
    if name == "o":
        return qw, H
    inter = config.intermediate_size if name in DENSEMLP and config.model_type == "qwen3" else None
    if name in ("gate", "up"):
        return H, inter
    if name == "down":
        return inter, H
    raise AssertionError(name)


def _module_lora(cfg, module_key, a, b, d_in, d_out) -> tuple[torch.Tensor, torch.Tensor, float]:
    r_cfg, s = _scaling(cfg, module_key)
    want_a, want_b = (r_cfg, d_in), (d_out, r_cfg)
    for what, t, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{module_key}.{what}.weight has shape {tuple(t.shape)}, expected {want} "
                f"(r = {r_cfg} from adapter_config.json r/rank_pattern; the model's dims)"
            )
    return a, b, s


# --- 3-D expert LoRA -------------------------------------------------------------------------------
def _expert_io(config, param: str) -> tuple[int, int]:
    """(in, out) of the nn.Linear equivalent of one expert's parameter."""
    H, Inter = config.hidden_size, config.moe_intermediate_size
    return (H, 2 * Inter) if param == "gate_up_proj" else (Inter, H)


def _orientations(config, param, a, b, E) -> set[str]:
    """Orientations in which (lora_A, lora_B) fit ``param``: 'normal' A [E·r, in], B [out, E·r];
    'swapped' A [E·r, out], B [in, E·r]."""
    d_in, d_out = _expert_io(config, param)
    if a.shape[0] != b.shape[1] or a.shape[0] % E:
        return set()
    found = set()
    if (a.shape[1], b.shape[0]) == (d_in, d_out):
        found.add("normal")
    if (a.shape[1], b.shape[0]) == (d_out, d_in):
        found.add("swapped")
    return found


def _split_experts(a, b, E, r, orientation) -> tuple[torch.Tensor, torch.Tensor]:
    """(shrink [E, r, in], expand [E, out, r]) per expert from PEFT's 3-D factors."""
    a_e = a.reshape(E, r, a.shape[1])  # A_e = rows e·r … e·r+r-1
    b_e = b.reshape(b.shape[0], r, E).permute(2, 0, 1)  # B_e = lora_B[:, e::E]  -> [E, d, r]
    if orientation == "normal":
        return a_e.contiguous(), b_e.contiguous()
    return b_e.transpose(1, 2).contiguous(), a_e.transpose(1, 2).contiguous()


# --- the reader ------------------------------------------------------------------------------------
def read_peft_adapter(path, config, *, expert_slices: int) -> PeftAdapter:
    """Read a PEFT LoRA adapter folder and lay it out for the model described by ``config``.

    Args:
        path: folder with adapter_config.json and adapter_model.safetensors (as written by
            ``PeftModel.save_pretrained``).
        config: the model's ModelConfig (model_type, hidden_size, heads, head_dim, num_experts,
            moe_intermediate_size, intermediate_size, num_hidden_layers are read), or its config.json
            dict (read with :meth:`ModelConfig.from_hf`).
        expert_slices: S of the MoE layers' gate_up (1 or 2; GPT-OSS uses 1, Qwen3-MoE 2). Ignored for a
            dense model.
    Returns: a :class:`PeftAdapter` (fp32 CPU tensors).
    Raises: ValueError naming the key or field (see the module docstring for what is refused), the
        path when it is a file, or ``config`` when it is neither a ModelConfig nor a config.json dict.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"path must be a PEFT adapter folder (str or os.PathLike), got {type(path).__name__}"
        )
    path = os.fspath(path)
    if isinstance(config, Mapping):
        config = ModelConfig.from_hf(config)
    if not isinstance(config, ModelConfig):
        raise ValueError(
            "config must be a ModelConfig (or a config.json dict: ModelConfig.from_hf), "
            f"got {type(config).__name__}"
        )
    model_type = config.model_type
    is_moe = model_type != "qwen3"
    if is_moe:
        if expert_slices not in (1, 2) or isinstance(expert_slices, bool):
            raise ValueError(f"expert_slices must be 1 or 2, got {expert_slices!r}")
    cfg = _read_config(path)
    _check_peft_config(cfg, config)
    _check_target_parameters(cfg, config)

    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        extra = (
            " (adapter_model.bin is not read: re-save with safe_serialization)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise ValueError(f"{path!r}: no adapter_model.safetensors{extra}")
    from safetensors.torch import load_file

    try:
        tensors = load_file(st_path, device="cpu")
    except Exception as exc:  # SafetensorError / OSError: a corrupt, truncated or unreadable file
        raise ValueError(f"{st_path}: not a readable safetensors file ({exc})") from None
    if not tensors:
        raise ValueError(f"{st_path}: no tensors")

    NL = config.num_hidden_layers
    E = _cfg(config, "num_experts") if is_moe else None
    # group factors: (layer, module path) -> {"A": t, "B": t}
    groups: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    full_key: dict[tuple[int, str], str] = {}
    for key in sorted(tensors):
        t = tensors[key]
        m = _KEY_RE.match(key)
        rest = m.group(3) if m else None
        ok = m is not None and (
            _ATTN_RE.match(rest)
            or (model_type == "qwen3" and _DENSERE.match(rest))
            or (model_type == "qwen3_moe" and _PER_EXPERT_RE.match(rest))
            or (is_moe and _EXPERTS3D_RE.match(rest))
        )
        if not ok:
            raise ValueError(
                f"unknown key {key!r}: not the LoRA factor of a module this {model_type} model can load "
                "(attention q/k/v/o_proj"
                + {
                    "qwen3": ", mlp.gate/up/down_proj",
                    "qwen3_moe": ", mlp.experts.{e}.gate/up/down_proj",
                    "gpt_oss": "",
                }[model_type]
                + (", mlp.experts 3-D factors" if is_moe else "")
                + ")"
            )
        layer = int(m.group(2))
        if layer >= NL:
            raise ValueError(f"key {key!r}: layer {layer} >= the model's num_hidden_layers {NL}")
        pe = _PER_EXPERT_RE.match(rest)
        if pe and int(pe.group(1)) >= E:
            raise ValueError(f"key {key!r}: expert {pe.group(1)} >= the model's num_experts {E}")
        if t.dim() != 2 or not t.is_floating_point():
            raise ValueError(
                f"key {key!r}: expected a 2-D float tensor, got shape {tuple(t.shape)} {t.dtype}"
            )
        groups.setdefault((layer, rest), {})[m.group(4)] = t.float()
        full_key[(layer, rest)] = m.group(1)
    for (layer, rest), ab in groups.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{full_key[(layer, rest)]}: {missing}.weight is missing from the file")

    layers: list[dict] = [{} for _ in range(NL)]
    sources: dict[tuple[int, str], str] = {}
    per_expert: dict[int, dict[str, dict[int, tuple]]] = {}  # layer -> proj -> e -> (A, B, s)
    three_d: dict[tuple[int, str], tuple] = {}  # (layer, param) -> (A, B, module_key, orientations)

    for (layer, rest), ab in sorted(groups.items()):
        a, b, mkey = ab["A"], ab["B"], full_key[(layer, rest)]
        if m := _ATTN_RE.match(rest):
            name = m.group(1)
            layers[layer][name] = _module_lora(cfg, mkey, a, b, *_module_dims(config, layer, name))
            sources[(layer, name)] = mkey
        elif model_type == "qwen3" and (m := _DENSERE.match(rest)):
            name = m.group(1)
            layers[layer][name] = _module_lora(cfg, mkey, a, b, *_module_dims(config, layer, name))
            sources[(layer, name)] = mkey
        elif m := _PER_EXPERT_RE.match(rest):
            e, proj = int(m.group(1)), m.group(2)
            d_in, d_out = _expert_io(config, "down_proj" if proj == "down" else "gate_up_proj")
            if proj != "down":
                d_out //= 2
            per_expert.setdefault(layer, {}).setdefault(proj, {})[e] = _module_lora(
                cfg, mkey, a, b, d_in, d_out
            )
        else:
            depth = 1 if _EXPERTS3D_RE.match(rest).group(1) else 0
            targeted = _targeted_params(cfg, config, layer)
            if not targeted:
                raise ValueError(
                    f"{mkey}: 3-D expert factors in the file, but adapter_config.json target_parameters "
                    f"({cfg.get('target_parameters')!r}) names no experts parameter of layer {layer}"
                )
            if len(targeted) == 2:  # gate_up registered first -> inner wrapper (base_layer)
                param = "gate_up_proj" if depth == 1 else "down_proj"
            elif depth == 0:
                param = targeted[0]
            else:
                raise ValueError(
                    f"{mkey}: nested 3-D factors but adapter_config.json target_parameters names only "
                    f"{targeted[0]!r} in layer {layer}"
                )
            orients = _orientations(config, param, a, b, E)
            if not orients:
                d_in, d_out = _expert_io(config, param)
                other = "down_proj" if param == "gate_up_proj" else "gate_up_proj"
                hint = ""
                if _orientations(config, other, a, b, E):
                    hint = (
                        f"; these are the shapes of {other}, but adapter_config.json target_parameters "
                        f"({cfg.get('target_parameters')!r}) makes this key {param}"
                    )
                raise ValueError(
                    f"{mkey}.lora_A/lora_B ({param}): shapes {tuple(a.shape)} / {tuple(b.shape)}, expected "
                    f"[E·r, {d_in}] / [{d_out}, E·r] with E = {E} (or the swapped PEFT orientation "
                    f"[E·r, {d_out}] / [{d_in}, E·r]){hint}"
                )
            three_d[(layer, param)] = (
                a,
                b,
                f"{mkey.rsplit('.mlp.experts', 1)[0]}.mlp.experts.{param}",
                orients,
            )

    # --- per-expert vs 3-D in one layer -----------------------------------------------------------
    for layer in per_expert:
        if any(l_ == layer for l_, _ in three_d):
            raise ValueError(
                f"layer {layer}: both per-expert keys (mlp.experts.{{e}}.*) and 3-D expert factors; "
                "a file has one or the other"
            )

    # --- orientation of the 3-D factors (one per file) ---------------------------------------------
    orientation = None
    if three_d:
        possible = {"normal", "swapped"}
        for _key, (_, _, mkey, orients) in sorted(three_d.items()):
            if not possible & orients:
                raise ValueError(
                    f"{mkey}: its shapes fit only the {sorted(orients)} orientation, but other 3-D factors "
                    f"in the file fit only {sorted(possible)}"
                )
            possible &= orients
        orientation = "normal" if "normal" in possible else "swapped"

    S = expert_slices if is_moe else None
    rank = 0
    for (layer, param), (a, b, mkey, _) in sorted(three_d.items()):
        r_cfg, s = _scaling(cfg, mkey)
        if a.shape[0] != E * r_cfg:
            raise ValueError(
                f"{mkey}: lora_A has {a.shape[0]} rows, expected E·r = {E}·{r_cfg} = {E * r_cfg} "
                "(r from adapter_config.json r/rank_pattern)"
            )
        shrink, expand = _split_experts(a, b, E, r_cfg, orientation)
        if param == "gate_up_proj":
            H = config.hidden_size
            n = expand.shape[1] // S
            A13 = shrink.unsqueeze(1).expand(E, S, r_cfg, H).contiguous()
            B13 = expand.reshape(E, S, n, r_cfg).contiguous()  # slice s = rows s·n … s·n+n-1 of B_e
            layers[layer]["experts_gate_up"] = (A13, B13, s)
            sources[(layer, "experts_gate_up")] = mkey
        else:
            layers[layer]["experts_down"] = (shrink, expand, s)
            sources[(layer, "experts_down")] = mkey

    for layer, projs in sorted(per_expert.items()):
        base = f"model.layers.{layer}.mlp.experts"
        H, Inter = config.hidden_size, config.moe_intermediate_size
        if "down" in projs:
            r = max(p[0].shape[0] for p in projs["down"].values())
            A2 = torch.zeros(E, r, Inter)
            pieces = []
            for e, (a, b, s) in projs["down"].items():
                A2[e, : a.shape[0]] = a
                pieces.append((b, s))
            bs, s = _fold(pieces)
            B2 = torch.zeros(E, H, r)
            for e, bb in zip(projs["down"], bs):
                B2[e, :, : bb.shape[1]] = bb
            layers[layer]["experts_down"] = (A2, B2, s)
            sources[(layer, "experts_down")] = f"{base}.{{e}}.down_proj"
        if "gate" in projs or "up" in projs:
            items = [
                (si, e, p) for si, proj in enumerate(("gate", "up")) for e, p in projs.get(proj, {}).items()
            ]
            bs, s = _fold([(p[1], p[2]) for _, _, p in items])
            if S == 2:
                r = max(p[0].shape[0] for _, _, p in items)
                A13, B13 = torch.zeros(E, 2, r, H), torch.zeros(E, 2, Inter, r)
                for (si, e, (a, _, _)), bb in zip(items, bs):
                    A13[e, si, : a.shape[0]] = a
                    B13[e, si, :, : bb.shape[1]] = bb
            else:  # one fused slice: rank r_gate + r_up, B block-diagonal, rows [gate | up]
                rg = max((p[0].shape[0] for si, _, p in items if si == 0), default=0)
                ru = max((p[0].shape[0] for si, _, p in items if si == 1), default=0)
                A13, B13 = torch.zeros(E, 1, rg + ru, H), torch.zeros(E, 1, 2 * Inter, rg + ru)
                for (si, e, (a, _, _)), bb in zip(items, bs):
                    off, r_ = (0, a.shape[0]) if si == 0 else (rg, a.shape[0])
                    A13[e, 0, off : off + r_] = a
                    B13[e, 0, si * Inter : (si + 1) * Inter, off : off + r_] = bb
            layers[layer]["experts_gate_up"] = (A13, B13, s)
            sources[(layer, "experts_gate_up")] = f"{base}.{{e}}.gate_proj/up_proj"

    for entries in layers:
        for a, _, _ in entries.values():
            rank = max(rank, a.shape[-2])
    if rank == 0:
        raise ValueError(f"{st_path}: no LoRA factors")
    return PeftAdapter(
        layers=layers,
        rank=rank,
        path=path,
        peft_config=cfg,
        expert_slices=S if is_moe else 0,
        expert_orientation=orientation,
        sources=sources,
    )


# --- loading into a model --------------------------------------------------------------------------
def _lora_modules(model):
    from ..layer import MoELoRALayer
    from ..linear import LoRALinear

    return [m for m in model.modules() if isinstance(m, (LoRALinear, MoELoRALayer))]


def _prep(t: torch.Tensor, scale: float, module, what: str) -> torch.Tensor:
    """t·scale in fp32, cast to the module's dtype/device; refused if not finite there."""
    ref = module._ref  # a tensor of the module's dtype and device (its weight may be packed)
    out = (t.float() * float(scale)).to(device=ref.device, dtype=ref.dtype)
    if not is_finite(out):
        raise ValueError(f"{what}: not finite in the model's dtype {ref.dtype} (inf/NaN or out of range)")
    return out


def load_peft_adapter(model, slot: int, path) -> PeftAdapter:
    """Read the PEFT adapter at ``path`` and load it into adapter slot ``slot`` of ``model``.

    Args:
        model: a MultiLoRAModel (``model.config`` a ModelConfig; modules at
            ``model.layers[l].self_attn.qkv_proj / o_proj`` (LoRALinear) and ``.mlp.experts``
            (MoELoRALayer) or ``.mlp.gate_up_proj / down_proj`` (LoRALinear, dense); a tree under
            ``model.model.layers`` is accepted too).
        slot: int in [0, L).
        path: the adapter folder.
    Every check (file, config, shapes, each module's rank ≤ R, slot range, finiteness in the model's
    dtype) runs before anything is written; then the slot is emptied in every module and each covered
    module's part is loaded (the scalings are folded into B here, so modules get scaling 1.0).
    Returns: the :class:`PeftAdapter` that was loaded (its ``slot`` set; a one-line repr).
    Raises: ValueError naming the key/field (see :func:`read_peft_adapter`), or the module and its R;
        RuntimeError, before reading the files, while a running generate call uses the slot
        (``model.check_slot_free``).
    """
    if not isinstance(getattr(model, "config", None), ModelConfig) or not isinstance(model, torch.nn.Module):
        raise ValueError(
            "model must be a MultiLoRAModel (an nn.Module with a ModelConfig .config), "
            f"got {type(model).__name__}"
        )
    config = model.config
    layers_mod = model.layers if hasattr(model, "layers") else model.model.layers
    modules = _lora_modules(model)
    if not modules:
        raise ValueError("model has no LoRALinear / MoELoRALayer modules")
    if not is_int(slot):
        raise ValueError(f"slot must be an int, got {slot!r}")
    for mod in modules:
        if not 0 <= slot < mod.L:
            raise ValueError(f"slot must be in [0, num_adapters={mod.L}), got {slot}")
    guard = getattr(model, "check_slot_free", None)
    if callable(guard):  # before reading anything: a slot a running generate call uses cannot change
        guard(slot, "load_peft_adapter")
    is_moe = config.model_type != "qwen3"
    S = layers_mod[0].mlp.experts.S if is_moe else 1
    adapter = read_peft_adapter(path, config, expert_slices=S)

    plan = []  # (module, args, kwargs)

    def rank_ok(mod, r, name, layer, mod_name):
        if r > mod.R:
            src = adapter.sources.get((layer, name), f"layer {layer} {name}")
            raise ValueError(
                f"{src}: rank {r} exceeds the model's max_rank R = {mod.R} (layers[{layer}].{mod_name})"
            )

    for layer, entries in enumerate(adapter.layers):
        if not entries:
            continue
        lm = layers_mod[layer]
        groups = [
            ("self_attn.qkv_proj", lm.self_attn.qkv_proj, ("q", "k", "v")),
            ("self_attn.o_proj", lm.self_attn.o_proj, ("o",)),
        ]
        if not is_moe:
            groups += [
                ("mlp.gate_up_proj", lm.mlp.gate_up_proj, ("gate", "up")),
                ("mlp.down_proj", lm.mlp.down_proj, ("down",)),
            ]
        for mod_name, mod, names in groups:
            if not any(n in entries for n in names):
                continue
            if mod.S != len(names):
                raise ValueError(f"layers[{layer}].{mod_name} has {mod.S} slices, expected {len(names)}")
            As, Bs = [], []
            for si, n in enumerate(names):
                if n not in entries:
                    As.append(None)
                    Bs.append(None)
                    continue
                a, b, s = entries[n]
                rank_ok(mod, a.shape[0], n, layer, mod_name)
                # a tensor-parallel module takes the whole adapter (its global_*) and keeps its shard
                n_s = getattr(mod, "global_slices", mod.slices)[si]
                d_in = getattr(mod, "global_in_features", mod.in_features)
                if tuple(b.shape) != (n_s, a.shape[0]) or a.shape[1] != d_in:
                    raise ValueError(
                        f"{adapter.sources[(layer, n)]}: shapes {tuple(a.shape)} / {tuple(b.shape)} "
                        "don't fit "
                        f"layers[{layer}].{mod_name} slice {si} ([r, {d_in}] / [{n_s}, r])"
                    )
                As.append(_prep(a, 1.0, mod, adapter.sources[(layer, n)] + ".lora_A"))
                Bs.append(_prep(b, s, mod, adapter.sources[(layer, n)] + ".lora_B·scaling"))
            plan.append((mod, (As, Bs, 1.0), {}))
        if is_moe and ("experts_gate_up" in entries or "experts_down" in entries):
            mod = lm.mlp.experts
            kw = {}
            for name, arg in (("experts_gate_up", "gate_up"), ("experts_down", "down")):
                if name not in entries:
                    continue
                a, b, s = entries[name]
                rank_ok(mod, a.shape[-2], name, layer, "mlp.experts")
                src = adapter.sources[(layer, name)]
                kw[arg] = (_prep(a, 1.0, mod, src + " A"), _prep(b, s, mod, src + " B·scaling"))
            E = mod.num_global_experts  # expert parallelism: the whole adapter, each rank keeps its experts
            want = {
                "gate_up": ((E, mod.S, None, mod.H), (E, mod.S, 2 * mod.I // mod.S, None)),
                "down": ((E, None, mod.I), (E, mod.H, None)),
            }
            for arg, (a, b) in kw.items():
                for which, t, w in zip(("A", "B"), (a, b), want[arg]):
                    if any(x is not None and x != y for x, y in zip(w, t.shape)) or t.dim() != len(w):
                        w_txt = tuple("r" if x is None else x for x in w)
                        raise ValueError(
                            f"{adapter.sources[(layer, 'experts_' + arg)]}: {arg} {which} has shape "
                            f"{tuple(t.shape)}, layers[{layer}].mlp.experts needs {w_txt} (r = the rank)"
                        )
            plan.append((mod, (), dict(kw, scaling=1.0)))

    # every check passed: empty the slot everywhere, then write
    if callable(getattr(model, "unload_adapter", None)):
        model.unload_adapter(slot)
    for mod in modules:
        mod.unload_adapter(slot)
    for mod, args, kw in plan:
        mod.load_adapter(slot, *args, **kw)
    adapter.slot = slot
    return adapter
