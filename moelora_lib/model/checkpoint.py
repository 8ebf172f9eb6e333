"""Building a :class:`~moelora_lib.model.MultiLoRAModel`: from a Hugging Face checkpoint folder
(:func:`load_hf_checkpoint`) or with random weights at any dimensions (:func:`random_model`).

Checkpoint keys (transformers 5.24's ``save_pretrained``, checked on tiny models; ``{p}`` is
``model.layers.{l}.``) and where they go:

* ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when tied);
  ``{p}input_layernorm.weight``, ``{p}post_attention_layernorm.weight``;
* ``{p}self_attn.{q,k,v}_proj.{weight,bias}`` -> ``qkv_proj`` (rows concatenated q | k | v),
  ``{p}self_attn.o_proj.*``, ``{p}self_attn.{q_norm,k_norm}.weight`` (qwen3*),
  ``{p}self_attn.sinks`` (gpt_oss);
* GPT-OSS: ``{p}mlp.router.{weight,bias}``; ``{p}mlp.experts.gate_up_proj`` [E, H, 2I] (``x @ W`` layout,
  gate/up columns interleaved) -> ``w13`` [E, 2I, H] (transposed, interleaving kept),
  ``gate_up_proj_bias`` [E, 2I] -> ``b13``, ``down_proj`` [E, I, H] -> ``w2`` [E, H, I],
  ``down_proj_bias`` -> ``b2``;
* Qwen3-MoE: ``{p}mlp.gate.weight`` -> router; experts either fused (transformers 5 in memory:
  ``{p}mlp.experts.gate_up_proj`` [E, 2I, H] rows [gate | up], ``down_proj`` [E, H, I]) or per expert —
  what transformers 5.24 *writes* (it converts back to the transformers 4 names on save) and what
  transformers 4 wrote: ``{p}mlp.experts.{e}.{gate,up,down}_proj.weight`` [I, H], [I, H], [H, I];
* Qwen3: ``{p}mlp.{gate,up,down}_proj.weight`` -> ``gate_up_proj`` (rows gate | up) and ``down_proj``.

GPT-OSS as published (openai/gpt-oss-20b, -120b): config.json carries ``"quantization_config":
{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` and the experts are packed MXFP4 (layout:
:mod:`moelora_lib.quant.mxfp4`), rows = output features, so no transpose:

* ``{p}mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] + ``gate_up_proj_scales`` uint8
  [E, 2I, H/32] -> ``w13`` [E, 2I, H] (gate/up rows interleaved);
* ``{p}mlp.experts.down_proj_blocks`` uint8 [E, H, I/32, 16] + ``down_proj_scales`` uint8 [E, H, I/32]
  -> ``w2`` [E, H, I];
* ``gate_up_proj_bias``, ``down_proj_bias`` and every other tensor dense (bf16 in the files).

Only the experts are packed in these files (``modules_to_not_convert`` names the dense rest; the list is
accepted as given).

Qwen3 / Qwen3-MoE block FP8 as published (Qwen/Qwen3-32B-FP8, Qwen/Qwen3-30B-A3B-FP8; layout:
:mod:`moelora_lib.quant.fp8`): config.json carries ``"quantization_config": {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (absent
``weight_block_size``: [128, 128]; optional ``modules_to_not_convert``), and each quantized linear
``X_proj`` is stored as

* ``X_proj.weight`` float8_e4m3fn [N, K] + ``X_proj.weight_scale_inv`` float32 (or bfloat16 / float16)
  [ceil(N/bn), ceil(K/bk)], ``[bn, bk] = weight_block_size``;

for the attention ``{p}self_attn.{q,k,v,o}_proj``, the dense MLP ``{p}mlp.{gate,up,down}_proj`` and the
per-expert ``{p}mlp.experts.{e}.{gate,up,down}_proj`` — the keys of the bf16 files, each with its
``weight_scale_inv``. The embeddings, norms, router (``{p}mlp.gate``) and lm_head are dense. The files
decide what is FP8: a projection is read as FP8 exactly when its ``weight_scale_inv`` is present (a
module listed in ``modules_to_not_convert`` is simply dense in the file; the list itself is only checked
to be a list of strings; a file that declares fp8 but holds no scales at all is refused). The fused
q | k | v, gate | up and the stacked experts are combined from these parts as in the bf16 files.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import check_bool, is_int
from ..quant import FP8_BLOCK, MXFP4_BLOCK, FP8BlockWeight, MXFP4Weight, fp8_scale_grid
from .config import REAL_CONFIGS, ModelConfig
from .modeling import MultiLoRAModel, packed_expert_formats, packed_linear_formats, random_weights

__all__ = ["load_hf_checkpoint", "random_model", "hf_key_plan", "QUANT_METHODS"]

#: The ``quantization_config.quant_method`` values :func:`load_hf_checkpoint` reads.
QUANT_METHODS = ("mxfp4", "fp8")
# the model types each method is read for (as published: GPT-OSS in MXFP4, Qwen3 / Qwen3-MoE in FP8)
_QUANT_MODEL_TYPES = {"mxfp4": ("gpt_oss",), "fp8": ("qwen3", "qwen3_moe")}
_FP8_SCALE = ".weight_scale_inv"
_FP8_SCALE_DTYPES = ("F32", "BF16", "F16")  # safetensors' names of float32, bfloat16, float16

# one entry per tensor of the model: our name -> (HF keys, their expected shapes, combine function); the
# combine gives a tensor, an MXFP4Weight for packed experts, or an _FP8Parts for FP8 projections
Plan = dict[
    str, tuple[list[str], list[tuple[int, ...]], Callable[..., "torch.Tensor | MXFP4Weight | _FP8Parts"]]
]


def _one(t: torch.Tensor) -> torch.Tensor:
    return t


def _cat(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _t12(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Weight:
    return MXFP4Weight(blocks, scales)


def _fp8_cat(*ws: FP8BlockWeight) -> FP8BlockWeight:
    return FP8BlockWeight.cat(ws)


def _fp8_stack(*ws: FP8BlockWeight) -> FP8BlockWeight:
    scale_dtypes = {w.scale_inv.dtype for w in ws}
    if len(scale_dtypes) > 1:
        raise ValueError(f"experts' scales in several dtypes {sorted(map(str, scale_dtypes))}")
    return FP8BlockWeight(
        torch.stack([w.weight for w in ws]), torch.stack([w.scale_inv for w in ws]), ws[0].block
    )


def _fp8_stack_pairs(*ws: FP8BlockWeight) -> FP8BlockWeight:
    return _fp8_stack(*(FP8BlockWeight.cat(ws[i : i + 2]) for i in range(0, len(ws), 2)))


@dataclass(frozen=True)
class _FP8Parts:
    """One model tensor read from a block-FP8 file: ``parts``, one per checkpoint projection in plan
    order, each an :class:`FP8BlockWeight` (the file's FP8 projection) or a tensor (a projection the file
    keeps dense); ``dense`` combines dense parts into the model tensor, ``pack`` FP8 parts into one
    FP8BlockWeight (rows concatenated, experts stacked)."""

    parts: tuple
    dense: Callable[..., torch.Tensor]
    pack: Callable[..., FP8BlockWeight]

    def dequantize(self, dtype: torch.dtype, device) -> torch.Tensor:
        """The model tensor in ``dtype`` on ``device``, FP8 parts dequantized exactly there."""
        return self.dense(
            *(
                p.to(device).dequantize(dtype)
                if isinstance(p, FP8BlockWeight)
                else p.to(device=device, dtype=dtype)
                for p in self.parts
            )
        )

    def packed(self) -> FP8BlockWeight | None:
        """The model tensor as one FP8BlockWeight, or None where it cannot be one: some part is dense
        in the file, or a fused part other than the last ends in a ragged block row (its last scale
        would cover rows of the next part), or the experts' scales differ in dtype."""
        if not all(isinstance(p, FP8BlockWeight) for p in self.parts):
            return None
        try:
            return self.pack(*self.parts)
        except ValueError:  # FP8BlockWeight.cat / _fp8_stack: the parts do not fuse
            return None


def _fp8_combine(*ts: torch.Tensor, quantized, block, dense, pack) -> _FP8Parts:
    """The plan's combine for FP8 projections: tensors in plan order (``weight`` then its
    ``weight_scale_inv`` where ``quantized`` says so) -> :class:`_FP8Parts`."""
    it = iter(ts)
    parts = [FP8BlockWeight(next(it), next(it), block) if q else next(it) for q in quantized]
    return _FP8Parts(tuple(parts), dense, pack)


def hf_key_plan(
    config: ModelConfig,
    keys: set[str] | frozenset[str],
    quant_method: str | None = None,
    fp8_block: Sequence[int] = FP8_BLOCK,
) -> Plan:
    """Map every tensor of the model to the checkpoint keys it is built from.

    ``keys`` (the checkpoint's key set) decides between the fused and the per-expert Qwen3-MoE expert
    layouts of each layer, and with ``quant_method`` "fp8" which projections are FP8. ``quant_method``
    "mxfp4" (GPT-OSS only): the experts' ``w13`` / ``w2`` come from ``*_blocks`` + ``*_scales`` keys,
    combined into an :class:`~moelora_lib.quant.MXFP4Weight` (H and I must be multiples of 32).
    ``quant_method`` "fp8" (Qwen3 / Qwen3-MoE): every projection ``X_proj.weight`` (attention, dense MLP,
    per-expert) whose ``X_proj.weight_scale_inv`` is in ``keys`` is read with it (expected shape the
    scale grid of ``fp8_block``, :func:`~moelora_lib.quant.fp8_scale_grid`), and its model tensor's
    combine gives an ``_FP8Parts`` (dequantized or packed by the loader). Returns {our name: (HF keys,
    expected HF shapes, combine)}."""
    c = config
    block = tuple(fp8_block)

    def proj(name: str, hf: list[str], shapes: list[tuple[int, ...]], dense: Callable, pack: Callable):
        """The plan entry of a model tensor built from projections' ``.weight`` keys ``hf``."""
        quantized = [k.removesuffix(".weight") + _FP8_SCALE in keys for k in hf]
        if quant_method != "fp8" or not any(quantized):
            plan[name] = (hf, shapes, dense)
            return
        all_keys, all_shapes = [], []
        for k, shape, q in zip(hf, shapes, quantized):
            all_keys.append(k)
            all_shapes.append(shape)
            if q:
                all_keys.append(k.removesuffix(".weight") + _FP8_SCALE)
                all_shapes.append(fp8_scale_grid(shape, block))
        combine = functools.partial(
            _fp8_combine, quantized=tuple(quantized), block=block, dense=dense, pack=pack
        )
        plan[name] = (all_keys, all_shapes, combine)

    H, V, hd = c.hidden_size, c.vocab_size, c.head_dim
    plan: Plan = {
        "embed_tokens.weight": (["model.embed_tokens.weight"], [(V, H)], _one),
        "norm.weight": (["model.norm.weight"], [(H,)], _one),
    }
    if not c.tie_word_embeddings:
        plan["lm_head.weight"] = (["lm_head.weight"], [(V, H)], _one)
    for li in range(c.num_hidden_layers):
        p, o = f"model.layers.{li}.", f"layers.{li}."
        a, sa = f"{p}self_attn.", f"{o}self_attn."
        plan[f"{o}input_layernorm.weight"] = ([f"{p}input_layernorm.weight"], [(H,)], _one)
        plan[f"{o}post_attention_layernorm.weight"] = ([f"{p}post_attention_layernorm.weight"], [(H,)], _one)
        widths = (c.q_width, c.kv_width, c.kv_width)
        qkv = [f"{a}{n}_proj" for n in "qkv"]
        proj(f"{sa}qkv_proj.weight", [f"{k}.weight" for k in qkv], [(w, H) for w in widths], _cat, _fp8_cat)
        proj(f"{sa}o_proj.weight", [f"{a}o_proj.weight"], [(H, c.q_width)], _one, _one)
        if c.attention_bias:
            plan[f"{sa}qkv_proj.bias"] = ([f"{k}.bias" for k in qkv], [(w,) for w in widths], _cat)
            plan[f"{sa}o_proj.bias"] = ([f"{a}o_proj.bias"], [(H,)], _one)
        if c.qk_norm:
            plan[f"{sa}q_norm.weight"] = ([f"{a}q_norm.weight"], [(hd,)], _one)
            plan[f"{sa}k_norm.weight"] = ([f"{a}k_norm.weight"], [(hd,)], _one)
        if c.sinks:
            plan[f"{sa}sinks"] = ([f"{a}sinks"], [(c.num_attention_heads,)], _one)
        m, om = f"{p}mlp.", f"{o}mlp."
        if c.model_type == "gpt_oss":
            E, I = c.num_experts, c.moe_intermediate_size
            plan[f"{om}router.weight"] = ([f"{m}router.weight"], [(E, H)], _one)
            plan[f"{om}router.bias"] = ([f"{m}router.bias"], [(E,)], _one)
            x = f"{m}experts."
            if quant_method == "mxfp4":  # rows = output features already: [E, N, K/32, 16]
                for ours, hf, (n, k) in (("w13", "gate_up_proj", (2 * I, H)), ("w2", "down_proj", (H, I))):
                    g = k // MXFP4_BLOCK
                    plan[f"{om}experts.{ours}"] = (
                        [f"{x}{hf}_blocks", f"{x}{hf}_scales"],
                        [(E, n, g, MXFP4_BLOCK // 2), (E, n, g)],
                        _mxfp4,
                    )
            else:
                plan[f"{om}experts.w13"] = ([f"{x}gate_up_proj"], [(E, H, 2 * I)], _t12)
                plan[f"{om}experts.w2"] = ([f"{x}down_proj"], [(E, I, H)], _t12)
            plan[f"{om}experts.b13"] = ([f"{x}gate_up_proj_bias"], [(E, 2 * I)], _one)
            plan[f"{om}experts.b2"] = ([f"{x}down_proj_bias"], [(E, H)], _one)
        elif c.model_type == "qwen3_moe":
            E, I = c.num_experts, c.moe_intermediate_size
            plan[f"{om}router.weight"] = ([f"{m}gate.weight"], [(E, H)], _one)
            x = f"{m}experts."
            if f"{x}gate_up_proj" in keys or f"{x}0.gate_proj.weight" not in keys:  # fused (transformers 5)
                plan[f"{om}experts.w13"] = ([f"{x}gate_up_proj"], [(E, 2 * I, H)], _one)
                plan[f"{om}experts.w2"] = ([f"{x}down_proj"], [(E, H, I)], _one)
            else:  # per expert (transformers 4 names; what transformers 5.24 writes)

                def stack_gate_up(*ts, _E=E):
                    return torch.stack([torch.cat((ts[2 * e], ts[2 * e + 1]), 0) for e in range(_E)])

                gu = [f"{x}{e}.{n}_proj.weight" for e in range(E) for n in ("gate", "up")]
                proj(f"{om}experts.w13", gu, [(I, H)] * (2 * E), stack_gate_up, _fp8_stack_pairs)
                dn = [f"{x}{e}.down_proj.weight" for e in range(E)]
                proj(f"{om}experts.w2", dn, [(H, I)] * E, lambda *ts: torch.stack(ts), _fp8_stack)
        else:
            I = c.intermediate_size
            gu = [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
            proj(f"{om}gate_up_proj.weight", gu, [(I, H), (I, H)], _cat, _fp8_cat)
            proj(f"{om}down_proj.weight", [f"{m}down_proj.weight"], [(H, I)], _one, _one)
    return plan


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; ValueError naming the file otherwise."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _open_safetensors(file: Path):
    """safetensors' ``safe_open`` of ``file``; ValueError naming the file if it cannot be read."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError and OSError: a corrupt, truncated or unreadable file
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None


def _key_files(path: Path) -> dict[str, Path]:
    """{key: safetensors file} from model.safetensors or model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' dict")
        out = {k: path / f for k, f in weight_map.items()}
        for f in sorted(set(out.values())):
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name}, which is not in {path}")
        return out
    if single.is_file():
        with _open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    raise ValueError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


def _quant_config(raw: dict) -> tuple[str | None, tuple[int, int]]:
    """The checkpoint's ``quantization_config``: ``(quant_method, fp8 block)`` — the method if it is one
    the loader reads for this model_type (None when the config has no quantization_config) and, for
    "fp8", its ``weight_block_size`` (default (128, 128); :data:`~moelora_lib.quant.FP8_BLOCK` otherwise).
    ValueError naming the field otherwise: an unknown method (the message lists :data:`QUANT_METHODS`),
    a method on another model_type, a malformed ``modules_to_not_convert``, and for fp8 a ``fmt`` other
    than "e4m3", an ``activation_scheme`` other than "dynamic", a ``scale_fmt`` other than "float", an
    ``expert_dtype`` other than "fp8", a ``weight_block_size`` that is not two positive ints."""
    q = raw.get("quantization_config")
    if q is None:
        return None, FP8_BLOCK
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported; supported: {list(QUANT_METHODS)}"
        )
    types = _QUANT_MODEL_TYPES[method]
    if raw.get("model_type") not in types:
        what = "packed MXFP4 experts are" if method == "mxfp4" else "block-FP8 weights are"
        raise ValueError(
            f"quantization_config.quant_method {method!r}: {what} read for model_type "
            f"{' / '.join(repr(t) for t in types)} only, got model_type {raw.get('model_type')!r}"
        )
    skip = q.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise ValueError(
            f"quantization_config.modules_to_not_convert: expected a list of strings, got {skip!r}"
        )
    if method != "fp8":
        return method, FP8_BLOCK
    for field, default, supported, why in (
        ("fmt", "e4m3", "e4m3", "weights are read as float8_e4m3fn"),
        ("activation_scheme", "dynamic", "dynamic", "activations are quantized per token at run time"),
        ("scale_fmt", "float", "float", "weight_scale_inv is read as float32 / bfloat16 / float16"),
        ("expert_dtype", "fp8", "fp8", "experts are read as block FP8 like the other projections"),
    ):
        v = q.get(field, default)
        if v != supported:
            raise ValueError(
                f"quantization_config.{field}: {v!r} is not supported; only {supported!r} ({why})"
            )
    block = q.get("weight_block_size", list(FP8_BLOCK))
    ok = isinstance(block, list) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(
            f"quantization_config.weight_block_size: expected two positive ints [rows, columns] (one scale "
            f"per block), got {block!r}"
        )
    return method, (block[0], block[1])


def _check_mxfp4_files(config: ModelConfig, files: Mapping[str, Path], path: Path) -> None:
    """The MXFP4-specific refusals, each naming a key: a reduction dim (H for gate_up, I for down) that is
    not a multiple of 32, a ``*_blocks`` key without its ``*_scales``, dense expert weights in a file that
    declares MXFP4."""
    H, I = config.hidden_size, config.moe_intermediate_size
    x = "model.layers.0.mlp.experts."
    for hf, k, what in (("gate_up_proj", H, "hidden_size"), ("down_proj", I, "intermediate_size")):
        if k % MXFP4_BLOCK:
            raise ValueError(
                f"checkpoint key {x}{hf}_blocks: MXFP4 packs the reduction dim K = {what} = {k} in blocks "
                f"of {MXFP4_BLOCK}; {k} is not a multiple of {MXFP4_BLOCK}"
            )
    for key in sorted(files):
        if key.endswith("_blocks") and key.removesuffix("_blocks") + "_scales" not in files:
            raise ValueError(
                f"checkpoint {path}: key {key.removesuffix('_blocks') + '_scales'!r} is missing: the MXFP4 "
                f"blocks {key!r} need their e8m0 scales"
            )
    dense = sorted(k for k in files if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    if dense:
        raise ValueError(
            f"checkpoint {path}: config.json declares quantization_config.quant_method 'mxfp4' but "
            f"{_few(dense)} hold dense expert weights; a dequantized checkpoint has no quantization_config"
        )


def _check_header(
    handle, key: str, want: tuple[int, ...], plan_keys: list[str], fp8_block: tuple[int, int]
) -> None:
    """The shape and, for packed keys, the dtype of ``key`` from its file header; ValueError naming the
    key otherwise: MXFP4 blocks/scales not uint8 (a scales key of the wrong shape names its blocks'
    shape); an FP8 ``*.weight_scale_inv`` not float32/bfloat16/float16 or not the scale grid of its
    weight; a float8 weight without its ``weight_scale_inv`` among ``plan_keys`` (the keys its model
    tensor is read from), or in float8 other than e4m3, or a weight with a scale that is not float8."""
    sl = handle.get_slice(key)
    got = tuple(sl.get_shape())
    dt = sl.get_dtype()
    packed = key.endswith(("_blocks", "_scales"))
    if packed and dt != "U8":
        raise ValueError(f"checkpoint key {key!r}: MXFP4 {key.rsplit('_', 1)[1]} must be uint8, got {dt}")
    if key.endswith(_FP8_SCALE):
        weight = key.removesuffix("_scale_inv")
        if dt not in _FP8_SCALE_DTYPES:
            raise ValueError(
                f"checkpoint key {key!r}: FP8 block scales must be float32, bfloat16 or float16 "
                f"({'/'.join(_FP8_SCALE_DTYPES)}), got {dt}"
            )
        if got != tuple(want):
            raise ValueError(
                f"checkpoint key {key!r}: shape {list(got)} does not match its weight {weight!r}: expected "
                f"{list(want)} (ceil(N/{fp8_block[0]}) x ceil(K/{fp8_block[1]}), weight_block_size "
                f"{list(fp8_block)})"
            )
        return
    scale = key.removesuffix(".weight") + _FP8_SCALE if key.endswith(".weight") else key + "_scale_inv"
    if dt.startswith("F8_"):
        if scale not in plan_keys:
            raise ValueError(
                f"checkpoint key {key!r}: a float8 ({dt}) weight needs its block scales {scale!r}, which "
                "the checkpoint does not have (or its config.json declares no quantization_config "
                "quant_method 'fp8')"
            )
        if dt != "F8_E4M3":
            raise ValueError(
                f"checkpoint key {key!r}: FP8 weights must be float8_e4m3fn (F8_E4M3, fmt 'e4m3'), got {dt}"
            )
    elif scale in plan_keys:
        raise ValueError(
            f"checkpoint key {key!r}: has block scales {scale!r} but is {dt}, not float8_e4m3fn (F8_E4M3)"
        )
    if got == tuple(want):
        return
    if key.endswith("_scales") and key.removesuffix("_scales") + "_blocks" in plan_keys:
        blocks = key.removesuffix("_scales") + "_blocks"
        raise ValueError(
            f"checkpoint key {key!r}: shape {list(got)} does not match its blocks {blocks!r}: expected "
            f"{list(want)} (blocks.shape[:-1], one e8m0 scale per 32 values)"
        )
    raise ValueError(f"checkpoint key {key!r}: expected shape {list(want)}, got {list(got)}")


def _few(keys) -> str:
    keys = sorted(keys)
    return f"{len(keys)} key(s), e.g. {keys[:5]}"


def _keep_fp8(plan: Plan, dequantize: bool | None) -> dict[str, bool]:
    """Where an FP8 checkpoint's FP8 weights stay FP8: {"experts": ..., "linear": ...} (the MoE layer's
    w13 / w2; LoRALinear's attention and dense MLP weights), from ``dequantize`` and the formats the
    layers run (:func:`packed_expert_formats`, :func:`packed_linear_formats`). NotImplementedError for
    ``dequantize=False`` when a layer that would receive FP8 weights has no FP8 kernels."""
    if dequantize:
        return {"experts": False, "linear": False}
    runs = {"experts": "fp8" in packed_expert_formats(), "linear": "fp8" in packed_linear_formats()}
    if dequantize is None:
        return runs
    fp8 = {"experts": [], "linear": []}
    for name, (keys, _, _) in plan.items():
        scale = next((k for k in keys if k.endswith(_FP8_SCALE)), None)
        if scale is not None:
            fp8["experts" if ".experts." in name else "linear"].append(scale.removesuffix("_scale_inv"))
    layers = {"experts": "MoELoRALayer (experts)", "linear": "LoRALinear (attention, dense MLP)"}
    lacking = [f"{layers[kind]}, e.g. {fp8[kind][0]!r}" for kind in layers if fp8[kind] and not runs[kind]]
    if lacking:
        raise NotImplementedError(
            "dequantize=False: the checkpoint's block-FP8 weights need FP8 kernels in "
            + " and ".join(lacking)
            + ", which the layers do not have yet (their PACKED_FORMATS list no 'fp8'); pass "
            "dequantize=True (or leave it None) to dequantize them exactly to the model dtype at load"
        )
    return runs


def _warn_long_max_seq(config: ModelConfig, max_seq) -> None:
    """UserWarning naming ``max_seq`` when it exceeds the positions the checkpoint was made for: its
    ``max_position_embeddings``, or with YaRN rope scaling factor × original_max_position_embeddings if
    larger (Qwen3's long-context setup keeps max_position_embeddings at 40960 while YaRN extends it).
    A warning, not an error: the cache and rope tables are built for any max_seq, and a model sized
    generously (a common max_seq for several checkpoints) serves short prompts correctly; only tokens
    beyond the trained positions are out of distribution."""
    if not is_int(max_seq):
        return  # MultiLoRAModel names the bad value
    limit = config.max_position_embeddings
    rs = config.rope_scaling
    if rs:
        limit = max(limit, int(rs["factor"] * rs["original_max_position_embeddings"]))
    if max_seq > limit:
        warnings.warn(
            f"max_seq = {max_seq} exceeds the checkpoint's max_position_embeddings = "
            f"{config.max_position_embeddings}"
            + (f" (YaRN: {limit} positions)" if limit != config.max_position_embeddings else "")
            + "; positions past it are beyond what the model was trained for",
            UserWarning,
            stacklevel=3,
        )


def load_hf_checkpoint(
    path,
    *,
    dtype: torch.dtype,
    device,
    num_adapters: int,
    max_rank: int,
    max_batch: int,
    max_seq: int,
    max_tokens: int,
    stage: str = "auto",
    deterministic: bool = False,
    dequantize: bool | None = None,
    activation_scheme: str = "auto",
    tp_group=None,
    ep_group=None,
) -> MultiLoRAModel:
    """A :class:`MultiLoRAModel` from a Hugging Face folder (config.json + model.safetensors or a
    sharded model.safetensors.index.json), weights cast to ``dtype`` on ``device``.

    Quantized checkpoints: GPT-OSS as published (``quantization_config`` with ``quant_method: mxfp4``,
    experts as MXFP4 ``*_blocks`` / ``*_scales``; the module docstring lists the keys) loads as is.
    ``dequantize`` says what becomes of its packed experts:

    * True: dequantized exactly (:func:`~moelora_lib.quant.dequantize_mxfp4`, on ``device``) to
      ``dtype`` — the dense weights transformers' ``Mxfp4Config(dequantize=True)`` builds — and the
      dense MoE path runs;
    * False: kept packed (:class:`~moelora_lib.quant.MXFP4Weight`, 4.25 bits per weight) and handed to
      the MoE layer through :func:`~moelora_lib.model.modeling.packed_expert_weight`: its base GEMMs
      decode them in registers and compute as the dense path on the dequantized weights does;
    * None (default): packed when the MoE layer runs the format
      (:func:`~moelora_lib.model.modeling.packed_expert_formats`, which lists "mxfp4"), else dequantized.

    Qwen3 / Qwen3-MoE block FP8 as published (``quant_method: fp8``, ``X_proj.weight`` float8_e4m3fn +
    ``X_proj.weight_scale_inv`` for the attention, dense MLP and expert projections; the module docstring
    lists the keys) loads as is. ``dequantize``:

    * True: every FP8 projection dequantized exactly (:func:`~moelora_lib.quant.dequantize_fp8_block`,
      on ``device``: float32 product, one cast) to ``dtype`` — the weights transformers'
      ``FineGrainedFP8Config(dequantize=True)`` builds — and the dense path runs;
    * False: FP8 kept (:class:`~moelora_lib.quant.FP8BlockWeight`) for the layers to run:
      :class:`moelora_lib.MoELoRALayer`'s FP8 expert GEMMs and :class:`moelora_lib.LoRALinear`'s block-FP8
      dense GEMM (:mod:`moelora_lib.kernels.dense_fp8`, in the form ``activation_scheme`` picks);
      NotImplementedError naming ``dequantize=True`` where a layer class does not list "fp8" in its
      PACKED_FORMATS;
    * None (default): FP8 kept where the layer it goes to runs it ("fp8" in
      :func:`~moelora_lib.model.modeling.packed_linear_formats` for the attention / dense MLP, in
      :func:`~moelora_lib.model.modeling.packed_expert_formats` for the experts — both list it), else
      dequantized as with True.

    ``activation_scheme`` (:class:`MultiLoRAModel`'s; for every projection kept FP8, dense and expert):
    "auto" (default: weight-only GEMMs below a token count per forward, W8A8 with the checkpoints'
    dynamic per-token, per-128-column activation quantization from there), "weight_only" (equal to the
    dequantized model up to summation order) or "dynamic" (each activation element within 2^-4
    relative of its value before an FP8 GEMM).

    Where FP8 is kept, a fused tensor (q | k | v, gate | up, the stacked experts) whose parts cannot form
    one FP8 weight (a part dense in the file, or a part other than the last ending in a ragged block
    row) is dequantized. ``dequantize`` has no effect on a checkpoint without quantization_config.

    The other arguments are :class:`MultiLoRAModel`'s. Every key, shape (and packed dtype) is checked
    from the files' headers before any tensor is read; tensors are then read one model tensor at a time
    (with ``tp_group`` / ``ep_group``, each rank reads whole tensors on the CPU and copies its shard to
    ``device``).
    Raises:
        ValueError: no config.json / safetensors, an unsupported model_type or field
            (:meth:`ModelConfig.from_hf`), a quantization_config other than mxfp4 on gpt_oss or fp8 on
            qwen3 / qwen3_moe (an unknown method: the message lists the supported ones), missing or
            unexpected keys (a few listed; e.g. a ``weight_scale_inv`` on the router or lm_head), a key
            whose shape differs (naming the key and the expected shape); for MXFP4: a ``*_blocks`` key
            without its ``*_scales`` (naming the scales key), H or I not a multiple of 32, scales whose
            shape is not the blocks' shape[:-1], blocks/scales not uint8, dense expert weights under an
            mxfp4 config; for FP8: ``fmt`` other than
            "e4m3", ``activation_scheme`` other than "dynamic", a bad ``weight_block_size``, a float8
            weight without its ``weight_scale_inv`` (in any checkpoint), a float8 weight other than e4m3,
            a scale grid that is not ceil(N/bn) x ceil(K/bk) or not float32/bfloat16/float16, an fp8
            config over a checkpoint without any ``weight_scale_inv``;
            ``dequantize`` not a bool or None; and :class:`MultiLoRAModel`'s own errors (e.g. weights
            not finite after dequantization); ``dequantize=False`` on an MXFP4 checkpoint whose packed
            format the MoE layer does not run (not in ``packed_expert_formats()``).
        NotImplementedError: ``dequantize=False`` on an FP8 checkpoint while a layer class its FP8 weights
            go to has no FP8 kernels (the message names ``dequantize=True``).
    Warns:
        UserWarning when ``max_seq`` exceeds the checkpoint's max_position_embeddings (with YaRN, the
        positions its rope scaling reaches): such a model builds and runs, but positions past that
        are beyond what the model was trained for.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a checkpoint folder (str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        why = "is a file" if path.exists() else "does not exist"
        raise ValueError(f"path must be a checkpoint folder (config.json + *.safetensors): {path} {why}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json")
    if dequantize is not None:
        check_bool("dequantize", dequantize)
    raw = _read_json(cfg_file)
    quant, fp8_block = _quant_config(raw)
    config = ModelConfig.from_hf(raw)
    _warn_long_max_seq(config, max_seq)
    files = _key_files(path)
    if quant == "mxfp4":
        _check_mxfp4_files(config, files, path)
    if quant is None and any(k.endswith("_blocks") for k in files):
        raise ValueError(
            f"checkpoint {path}: {_few(k for k in files if k.endswith('_blocks'))} look like MXFP4 expert "
            "blocks, but config.json declares no quantization_config (quant_method 'mxfp4' is needed to "
            "read them)"
        )
    if quant == "fp8" and not any(k.endswith(_FP8_SCALE) for k in files):
        raise ValueError(
            f"checkpoint {path}: config.json declares quantization_config.quant_method 'fp8' but no key "
            f"holds block scales (*{_FP8_SCALE}); a dequantized checkpoint has no quantization_config"
        )
    plan = hf_key_plan(config, frozenset(files), quant, fp8_block)
    needed = {k for keys, _, _ in plan.values() for k in keys}
    missing = needed - set(files)
    if missing:
        raise ValueError(f"checkpoint {path}: missing {_few(missing)}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = set(files) - needed - ignorable
    if unexpected:
        raise ValueError(
            f"checkpoint {path}: unexpected {_few(unexpected)} (for model_type {config.model_type!r})"
        )
    handles: dict[Path, object] = {}

    def handle(f: Path):
        if f not in handles:
            handles[f] = _open_safetensors(f)
        return handles[f]

    for keys, shapes, _ in plan.values():
        for k, want in zip(keys, shapes):
            _check_header(handle(files[k]), k, tuple(want), keys, fp8_block)
    keep_fp8 = {"experts": False, "linear": False}
    if quant == "fp8":
        packed = False
        keep_fp8 = _keep_fp8(plan, dequantize)
    elif quant is not None:
        packed = (quant in packed_expert_formats()) if dequantize is None else not dequantize
        if packed and quant not in packed_expert_formats():
            raise ValueError(
                f"dequantize=False: the checkpoint's experts are packed {quant.upper()}, which MoELoRALayer "
                f"does not run (it runs {sorted(packed_expert_formats())}); pass dequantize=True (or leave "
                "it None) to dequantize them exactly to the model dtype at load"
            )
    else:
        packed = False

    def source(name, shape, *, kind, dtype, device):
        if name not in plan:
            raise ValueError(f"internal: no checkpoint plan for {name!r}")
        keys, _, combine = plan[name]
        t = combine(*(handle(files[k]).get_tensor(k) for k in keys))
        if isinstance(t, MXFP4Weight):  # unpacked on the target device, straight into the model dtype
            t = t.to(device)
            return t if packed else t.dequantize(dtype)
        if isinstance(t, _FP8Parts):
            w = t.packed() if keep_fp8["experts" if ".experts." in name else "linear"] else None
            return w.to(device) if w is not None else t.dequantize(dtype, device)
        return t

    return MultiLoRAModel(
        config,
        dtype=dtype,
        device=device,
        num_adapters=num_adapters,
        max_rank=max_rank,
        max_batch=max_batch,
        max_seq=max_seq,
        max_tokens=max_tokens,
        stage=stage,
        deterministic=deterministic,
        weights=source,
        activation_scheme=activation_scheme,
        tp_group=tp_group,
        ep_group=ep_group,
    )


def random_model(
    config: ModelConfig | Mapping | str,
    *,
    seed: int = 0,
    dtype: torch.dtype,
    device,
    num_adapters: int,
    max_rank: int,
    max_batch: int,
    max_seq: int,
    max_tokens: int,
    stage: str = "auto",
    std: float = 0.02,
    deterministic: bool = False,
    tp_group=None,
    ep_group=None,
) -> MultiLoRAModel:
    """A :class:`MultiLoRAModel` with random weights (:func:`~moelora_lib.model.modeling.random_weights`:
    N(0, std²) drawn on ``device`` directly, norms ones), for timing at real dimensions.

    ``config``: a :class:`ModelConfig`, a config.json dict, or a :data:`REAL_CONFIGS` name
    ("gpt-oss-20b", "qwen3-30b-a3b", "qwen3-32b").
    The other arguments (sizes, ``stage``, ``deterministic``, ``tp_group``, ``ep_group``) are
    :class:`MultiLoRAModel`'s.
    Raises: ValueError for an unknown name and :class:`MultiLoRAModel`'s errors."""
    if isinstance(config, str):
        if config not in REAL_CONFIGS:
            raise ValueError(f"config: unknown name {config!r}; known: {sorted(REAL_CONFIGS)}")
        config = REAL_CONFIGS[config]
    if isinstance(config, Mapping):
        config = ModelConfig.from_hf(config)
    return MultiLoRAModel(
        config,
        dtype=dtype,
        device=device,
        num_adapters=num_adapters,
        max_rank=max_rank,
        max_batch=max_batch,
        max_seq=max_seq,
        max_tokens=max_tokens,
        stage=stage,
        deterministic=deterministic,
        weights=random_weights(seed, std),
        tp_group=tp_group,
        ep_group=ep_group,
    )
