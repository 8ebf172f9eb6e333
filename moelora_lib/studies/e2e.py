"""Notebook 11's measurements (rows for ``data/11_*.csv``): generation of whole models with random weights
at the real dimensions and multiple adapters, adapter loading, recompilation, a decode step by category,
transformers + PEFT, the floors and the targets; MXFP4 (notebook 14) and block-FP8 (notebook 15) models.
TTFT = call start -> the request's first token on the host; OTPS per request = (tokens − 1) / (last token −
first token); aggregate OTPS = all output tokens / the whole call. Greedy, no eos."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..common import dtype_name
from ..hardware import H200_BF16_TFLOPS, H200_READ_TB_PER_S
from ..model import REAL_CONFIGS, ModelConfig, MultiLoRAModel, random_model
from ..model.modeling import WeightSource, random_weights
from ..quant.fp8 import FP8_BLOCK
from . import bench, dense_bench, moe_bench
from .bench import free_memory

#: The three models of the study (names of :data:`moelora_lib.model.REAL_CONFIGS`).
MODELS = ("gpt-oss-20b", "qwen3-30b-a3b", "qwen3-32b")
#: The CPU profile's stand-in for each model: the same config.json fields at tiny sizes.
TINY_MODELS = {"gpt-oss-20b": "tiny-gpt-oss", "qwen3-30b-a3b": "tiny-qwen3-moe", "qwen3-32b": "tiny-qwen3"}
#: Our scenarios: no adapter loaded at all, and 8 adapters loaded with request i on slot i mod L.
SCENARIOS = ("base", "adapters_mixed")
#: Notebook 13's third scenario: no request with an adapter while adapters are loaded.
NO_ADAPTER_LOADED = "no_adapter_loaded"
#: The baseline's: transformers alone, and transformers + PEFT with one adapter.
HF_SCENARIOS = ("transformers", "transformers_peft")
#: Categories of :func:`step_breakdown` (µs of kernel time per decode step).
CATEGORIES = ("attention", "attn_proj_base", "mlp_base", "lora", "other", "unattributed")

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
_QWEN = dict(_COMMON, intermediate_size=96, max_window_layers=2, bos_token_id=125, eos_token_id=126)
_TINY_SIZES = {
    "gpt_oss": dict(_COMMON, intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
                    num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, vocab_size=128,
                    sliding_window=8, pad_token_id=127, eos_token_id=126),
    "qwen3_moe": dict(_QWEN, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=128),
    "qwen3": dict(_QWEN, vocab_size=128),
}  # fmt: skip
_TINY_OF = {"tiny-gpt-oss": "gpt-oss-20b", "tiny-qwen3-moe": "qwen3-30b-a3b", "tiny-qwen3": "qwen3-32b"}


#: Published models differing from a :data:`moelora_lib.model.REAL_CONFIGS` one in sizes only.
DERIVED_MODELS = {
    "gpt-oss-120b": ("gpt-oss-20b", dict(num_hidden_layers=36, num_local_experts=128,
                                         layer_types=["sliding_attention", "full_attention"] * 18)),
}  # fmt: skip


def config_dict(name: str) -> dict:
    """A fresh config.json dict of a :data:`MODELS`, :data:`DERIVED_MODELS` or :data:`TINY_MODELS` name;
    ValueError for an unknown name."""
    if name in REAL_CONFIGS:
        return REAL_CONFIGS[name]
    if name in DERIVED_MODELS:
        base, fields = DERIVED_MODELS[name]
        return REAL_CONFIGS[base] | json.loads(json.dumps(fields))  # a fresh copy of the lists too
    if name in _TINY_OF:
        d = REAL_CONFIGS[_TINY_OF[name]]
        d.pop("quantization_config", None)
        d.update(_TINY_SIZES[d["model_type"]])
        return d
    known = [*REAL_CONFIGS, *DERIVED_MODELS]
    raise ValueError(f"unknown model {name!r}; known: {known} and {list(_TINY_OF)}")


def model_config(name: str, *, num_layers: int | None = None) -> ModelConfig:
    """:class:`~moelora_lib.model.ModelConfig` of :func:`config_dict`, of the first ``num_layers`` decoder
    layers (None: all); ValueError unless 1 ≤ num_layers ≤ the model's."""
    d = config_dict(name)
    if num_layers is not None:
        n = d["num_hidden_layers"]
        if not (isinstance(num_layers, int) and 1 <= num_layers <= n):
            raise ValueError(f"num_layers must be an int in [1, {n}] for {name!r}, got {num_layers!r}")
        d["num_hidden_layers"] = num_layers
        if "layer_types" in d:
            d["layer_types"] = d["layer_types"][:num_layers]
    return ModelConfig.from_hf(d)


#: Formats of a built model's expert weights, and of its attention and dense-MLP projections.
EXPERT_FORMATS = moe_bench.WEIGHT_FORMATS
PROJECTION_FORMATS = dense_bench.WEIGHT_FORMATS
_EXPERT_WEIGHT = re.compile(r"^layers\.\d+\.mlp\.experts\.(w13|w2)$")
#: The projections a published block-FP8 checkpoint stores in FP8.
_PROJECTION_WEIGHT = re.compile(
    r"^layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))\.weight$"
)
#: A built model's parameters of those projections' base weights (dense, or FP8 codes and scales).
_PROJECTION_PARAM = re.compile(
    r"^layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))\.weight(_fp8|_scale_inv)?$"
)


def _check_formats(experts: str, projections: str) -> None:
    """ValueError unless ``experts`` / ``projections`` are known formats."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
    if projections not in PROJECTION_FORMATS:
        raise ValueError(f"projections must be one of {PROJECTION_FORMATS}, got {projections!r}")


def packed_weights(
    source: WeightSource, *, experts: str = "dense", projections: str = "dense",
    fp8_block: tuple[int, int] = FP8_BLOCK, dequantize: bool = False,
) -> WeightSource:  # fmt: skip
    """A :data:`~moelora_lib.model.modeling.WeightSource` giving ``source``'s weights, except the MoE experts
    in format ``experts`` and the attention / dense-MLP projections in format ``projections`` (MXFP4 or block
    FP8 with ``fp8_block``, quantized a few experts or block rows at a time). ``dequantize``: each quantized
    weight dequantized exactly back to the requested dtype instead. ValueError for an unknown format."""
    from .moe_bench import quantize_to

    _check_formats(experts, projections)

    def wrapped(name: str, shape: tuple[int, ...], *, kind: str, dtype: torch.dtype, device):
        w = source(name, shape, kind=kind, dtype=dtype, device=device)
        fmt = "dense"
        if _EXPERT_WEIGHT.match(name):
            fmt = experts
        elif _PROJECTION_WEIGHT.match(name):
            fmt = projections
        if fmt == "dense":
            return w
        q = quantize_to(w, fmt, fp8_block)
        return q.dequantize(dtype) if dequantize else q

    wrapped.is_random = getattr(source, "is_random", False)  # type: ignore[attr-defined]
    return wrapped


def fp8_formats(name: str) -> dict[str, str]:
    """The :func:`build_model` formats of ``name``'s published block-FP8 checkpoint."""
    return dict(experts="fp8" if model_config(name).is_moe else "dense", projections="fp8")


def build_model(name: str, *, stage: str = "auto", seed: int = 0, experts: str = "dense",
                projections: str = "dense", fp8_block: tuple[int, int] = FP8_BLOCK, dequantize: bool = False,
                activation_scheme: str | None = None, num_layers: int | None = None,
                **sizes) -> MultiLoRAModel:  # fmt: skip
    """A random-weight MultiLoRAModel of ``name``, no adapter loaded. ``stage``: "auto" or a name of
    ``STAGES``; ``experts`` (:data:`EXPERT_FORMATS`), ``projections`` (:data:`PROJECTION_FORMATS`),
    ``fp8_block``, ``dequantize``: as in :func:`packed_weights`; ``activation_scheme``: the model's (None: its
    default); ``num_layers``: :func:`model_config`'s; ``sizes``: ``random_model``'s dtype, device, max_batch,
    max_seq, max_tokens, num_adapters (default 8), max_rank (default 32). ValueError for an unknown format or
    packed experts on a dense model."""
    sizes = {"num_adapters": 8, "max_rank": 32, **sizes}
    _check_formats(experts, projections)
    config = model_config(name, num_layers=num_layers)
    if experts != "dense" and not config.is_moe:
        raise ValueError(f"experts={experts!r}: {name!r} has no MoE experts")
    if experts == "dense" and projections == "dense":
        return random_model(config, seed=seed, stage=stage, **sizes)
    if activation_scheme is not None:
        sizes["activation_scheme"] = activation_scheme
    src = packed_weights(random_weights(seed), experts=experts, projections=projections, fp8_block=fp8_block,
                         dequantize=dequantize)  # fmt: skip
    return MultiLoRAModel(config, stage=stage, weights=src, **sizes)


def model_memory(model: MultiLoRAModel) -> dict[str, float]:
    """GB (1e9 bytes) a built model holds: expert_weight_gb, other_weight_gb, of which projection_weight_gb,
    buffer_gb and allocated_gb (``torch.cuda.memory_allocated``; NaN on the CPU)."""
    seen: set[int] = set()
    experts = other = proj = buffers = 0
    for n, p in model.named_parameters():
        if id(p) in seen:  # a tied lm_head counts once
            continue
        seen.add(id(p))
        nbytes = p.numel() * p.element_size()
        if ".mlp.experts." in n:
            experts += nbytes
        else:
            other += nbytes
            proj += nbytes if _PROJECTION_PARAM.match(n) else 0
    for b in model.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            buffers += b.numel() * b.element_size()
    dev = model.device
    alloc = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else float("nan")
    return dict(expert_weight_gb=experts / 1e9, other_weight_gb=other / 1e9, projection_weight_gb=proj / 1e9,
                buffer_gb=buffers / 1e9, allocated_gb=alloc / 1e9)  # fmt: skip


def memory_estimate_gb(name: str, *, experts: str = "dense", projections: str = "dense",
                       num_adapters: int = 8, max_rank: int = 32, max_batch: int = 1, max_seq: int = 2048,
                       max_tokens: int = 8192, dtype_bytes: int = 2, fp8_block: tuple[int, int] = FP8_BLOCK,
                       num_layers: int | None = None) -> dict[str, float]:  # fmt: skip
    """What :func:`build_model` of ``name`` will hold, in GB, before building it: expert_weight_gb,
    other_weight_gb, of which projection_weight_gb, adapter_slot_gb, kv_gb, scratch_gb, total_gb. Arguments as
    :func:`build_model`'s."""
    from .moe_bench import MXFP4_BYTES_PER_WEIGHT, fp8_bytes_per_weight

    _check_formats(experts, projections)
    c = model_config(name, num_layers=num_layers)
    b, H, Lyr, L, R = dtype_bytes, c.hidden_size, c.num_hidden_layers, num_adapters, max_rank
    fp8_b = fp8_bytes_per_weight(fp8_block)
    pb = fp8_b if projections == "fp8" else b
    qkv_o = H * (c.q_width + 2 * c.kv_width) + c.q_width * H
    attn_slots = L * R * ((3 * H + c.q_width + 2 * c.kv_width) + (c.q_width + H))  # qkv (3 slices), o
    proj = Lyr * qkv_o
    other = c.vocab_size * H * (1 if c.tie_word_embeddings else 2) + (2 * Lyr + 1) * H  # norms
    other += Lyr * ((c.q_width + 2 * c.kv_width + H) if c.attention_bias else 0)
    expert_w = slots = scratch = 0.0
    if c.is_moe:
        E, I, K = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
        S = 1 if c.model_type == "gpt_oss" else 2
        wb = {"mxfp4": MXFP4_BYTES_PER_WEIGHT, "fp8": fp8_b}.get(experts, b)
        expert_w = Lyr * (E * 3 * H * I * wb + (E * (2 * I + H) * b if c.expert_bias else 0))
        other += Lyr * E * (H + (1 if c.router_bias else 0))
        slots = Lyr * L * E * R * (S * H + 2 * I + I + H) * b
        scratch = max_tokens * K * (2 * I + I + H) * b
    else:
        I = c.intermediate_size
        proj += Lyr * 3 * H * I
        attn_slots += L * R * ((H + 2 * I) + (I + H))
    slots += Lyr * attn_slots * b
    kv = max_batch * max_seq * Lyr * 2 * c.kv_width * b
    out = dict(expert_weight_gb=expert_w, other_weight_gb=other * b + proj * pb, adapter_slot_gb=slots,
               kv_gb=kv, scratch_gb=scratch)  # fmt: skip
    out = {k: v / 1e9 for k, v in out.items()}
    return out | dict(projection_weight_gb=proj * pb / 1e9, total_gb=sum(out.values()))


def fits_device(
    est: dict[str, float] | float, *, margin_gb: float, device_gb: float | None
) -> tuple[bool, str]:
    """``(fits, reason)`` for a model of estimate ``est`` (:func:`memory_estimate_gb`'s dict or total_gb) on a
    device of ``device_gb`` GB with ``margin_gb`` to spare; ``reason`` "" when it fits, else the notebooks'
    skip message. ``device_gb`` None or NaN fits."""
    total = float(est["total_gb"] if isinstance(est, dict) else est)
    if device_gb is None or math.isnan(device_gb) or total + margin_gb <= device_gb:
        return True, ""
    return False, f"needs ≈ {total:.0f} GB (+ {margin_gb:g} GB margin), the device has {device_gb:.0f} GB"


def model_logits(model: MultiLoRAModel, *, prompt_len: int, seed: int = 0, adapter: int | None = None
                 ) -> torch.Tensor:  # fmt: skip
    """float32 logits [prompt_len, V] on the host of one prefill of the random prompt ``make_prompts(1,
    prompt_len, vocab, seed)`` on slot ``adapter`` (None: no adapter)."""
    dev = model.device
    ids = torch.tensor(make_prompts(1, prompt_len, model.config.vocab_size, seed), device=dev)
    slot = -1 if adapter is None else int(adapter)
    with torch.no_grad():
        out = model(ids, torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([slot], device=dev))
    return out[0].float().cpu()


def logit_error(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """How far ``logits`` [S, V] are from ``ref`` [S, V]: rel_err = max|Δ| / max|ref|, rms_rel = ‖Δ‖ / ‖ref‖,
    max_abs, top1_agree (share of positions whose argmax agrees), kl_mean / kl_max (KL(softmax(ref) ‖
    softmax(logits)) per position, nats), positions."""
    d = (logits.double() - ref.double()).abs()
    r = ref.double()
    lp, lq = torch.log_softmax(r, dim=-1), torch.log_softmax(logits.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(dim=-1)
    return dict(rel_err=float(d.max() / r.abs().max().clamp_min(1e-30)),
                rms_rel=float(d.norm() / r.norm().clamp_min(1e-30)), max_abs=float(d.max()),
                top1_agree=float((logits.argmax(-1) == ref.argmax(-1)).double().mean()),
                kl_mean=float(kl.mean()), kl_max=float(kl.max()), positions=int(ref.shape[0]))  # fmt: skip


def schemes_at(model: MultiLoRAModel, T: int) -> dict[str, str]:
    """expert_scheme ("none" on a dense model) and projection_scheme: the activation schemes ("dynamic" or
    "weight_only") a forward of T tokens runs in ``model``'s first layer."""
    from .moe_bench import module_scheme

    layer = model.layers[0]
    experts = getattr(layer.mlp, "experts", None)
    scheme = "none" if experts is None else module_scheme(experts, T)
    return dict(expert_scheme=scheme, projection_scheme=module_scheme(layer.self_attn.qkv_proj, T))


#: The CSVs of notebook 11 (``data/11_<name>.csv``) and the function whose rows each holds.
TABLES = ("generation", "breakdown", "recompile", "adapter_load")


def write_tables(folder, **rows) -> dict[str, Path]:
    """Write each of ``rows`` (keyword = a :data:`TABLES` name) to ``<folder>/11_<name>.csv``, replacing the
    file; returns the paths. ValueError for an unknown table name."""
    out = {}
    for name, r in rows.items():
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; expected one of {TABLES}")
        out[name] = Path(folder) / f"11_{name}.csv"
        bench.write_rows(out[name], r)
    return out


_CLASS = {"gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def peft_targets(config: ModelConfig) -> tuple[list[str], list[str] | None]:
    """(target_modules, target_parameters) of the study's adapters."""
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if config.is_moe:
        return modules, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return modules + ["gate_proj", "up_proj", "down_proj"], None


def _normal(seed: int, dtype, device, std: float):
    """A function drawing N(0, std²) tensors of a given shape from one generator seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return lambda *shape: torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)


def adapter_tensors(
    config: ModelConfig, *, rank: int, seed: int, dtype: torch.dtype = torch.bfloat16, device="cpu", std=0.02
) -> dict[str, torch.Tensor]:
    """A random rank-``rank`` adapter as PEFT's ``adapter_model.safetensors`` holds it, {key: tensor}: linear
    modules A [r, in], B [out, r]; 3-D experts A [E·r, in], B [out, E·r]."""
    c, H, rnd = config, config.hidden_size, _normal(seed, dtype, device, std)
    shapes = {"self_attn.q_proj": (H, c.q_width), "self_attn.k_proj": (H, c.kv_width)}  # (in, out)
    shapes |= {"self_attn.v_proj": (H, c.kv_width), "self_attn.o_proj": (c.q_width, H)}
    if not c.is_moe:
        I = c.intermediate_size
        shapes |= {"mlp.gate_proj": (H, I), "mlp.up_proj": (H, I), "mlp.down_proj": (I, H)}
    out: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        p = f"base_model.model.model.layers.{layer}."
        for mod, (d_in, d_out) in shapes.items():
            out[f"{p}{mod}.lora_A.weight"] = rnd(rank, d_in)
            out[f"{p}{mod}.lora_B.weight"] = rnd(d_out, rank)
        if config.is_moe:
            E, I = config.num_experts, config.moe_intermediate_size
            out[f"{p}mlp.experts.base_layer.lora_A.weight"] = rnd(E * rank, H)
            out[f"{p}mlp.experts.base_layer.lora_B.weight"] = rnd(2 * I, E * rank)
            out[f"{p}mlp.experts.lora_A.weight"] = rnd(E * rank, I)
            out[f"{p}mlp.experts.lora_B.weight"] = rnd(H, E * rank)
    return out


def write_peft_adapter(
    folder, config: ModelConfig, *, rank: int, alpha: float, seed: int, dtype=torch.bfloat16, device="cpu",
    std: float = 0.02,
) -> Path:  # fmt: skip
    """Write :func:`adapter_tensors` as a PEFT LoRA folder; returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    modules, params = peft_targets(config)
    cfg = dict(
        peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=None, r=int(rank), lora_alpha=alpha,
        lora_dropout=0.0, bias="none", target_modules=modules, target_parameters=params, use_rslora=False,
        use_dora=False, fan_in_fan_out=False, rank_pattern={}, alpha_pattern={}, modules_to_save=None,
        init_lora_weights=True, inference_mode=True,
    )  # fmt: skip
    tensors = adapter_tensors(config, rank=rank, seed=seed, dtype=dtype, device=device, std=std)
    save_file(
        {k: t.cpu().contiguous() for k, t in tensors.items()}, str(folder / "adapter_model.safetensors")
    )
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def load_random_adapter(model: MultiLoRAModel, slot: int, *, rank: int, alpha: float, seed: int, std=0.02):
    """Fill slot ``slot`` of every LoRA module of :func:`peft_targets` with random rank-``rank`` factors
    (scaling alpha / rank)."""
    rnd, s = _normal(seed, model.dtype, model.device, std), float(alpha) / rank

    def dense(mod):
        a, b = [rnd(rank, mod.in_features) for _ in mod.slices], [rnd(n, rank) for n in mod.slices]
        mod.load_adapter(slot, a if mod.S > 1 else a[0], b if mod.S > 1 else b[0], scaling=s)

    for layer in model.layers:
        dense(layer.self_attn.qkv_proj)
        dense(layer.self_attn.o_proj)
        if hasattr(mlp := layer.mlp, "experts"):
            x = mlp.experts
            gate_up = (rnd(x.E, x.S, rank, x.H), rnd(x.E, x.S, 2 * x.I // x.S, rank))
            x.load_adapter(slot, gate_up=gate_up, down=(rnd(x.E, rank, x.I), rnd(x.E, x.H, rank)), scaling=s)
        else:
            dense(mlp.gate_up_proj)
            dense(mlp.down_proj)


def load_adapters(
    model: MultiLoRAModel, name: str, *, rank: int, alpha: float, seed: int, file_slots=(0,), workdir=None
) -> list[dict[str, Any]]:
    """Load an adapter (seed per slot) into every slot: ``file_slots`` through PEFT files (in ``workdir`` or a
    temporary folder), the others directly. One row per slot: model, stage, slot, source ("peft_file" |
    "direct"), write_s, load_s, file_mb, rank, alpha."""
    from ..model.peft_adapters import load_peft_adapter

    dev, rows = model.device, []
    tmp = tempfile.TemporaryDirectory(prefix="moelora-e2e-") if workdir is None and file_slots else None
    workdir = tmp.name if tmp is not None else workdir
    try:
        for slot in range(model.num_adapters):
            s_seed = seed * 1000 + slot
            row = dict(model=name, stage=model.stage, slot=slot, rank=rank, alpha=alpha)
            row.update(write_s=float("nan"), file_mb=float("nan"))
            bench.sync(dev)
            t0 = time.perf_counter()
            if slot in file_slots:
                dt = torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32
                folder = write_peft_adapter(Path(workdir) / f"{name}-slot{slot}", model.config, rank=rank,
                                            alpha=alpha, seed=s_seed, dtype=dt, device=dev)  # fmt: skip
                row["write_s"] = time.perf_counter() - t0
                row["file_mb"] = (folder / "adapter_model.safetensors").stat().st_size / 1e6
                t0 = time.perf_counter()
                load_peft_adapter(model, slot, folder)
                row["source"] = "peft_file"
            else:
                load_random_adapter(model, slot, rank=rank, alpha=alpha, seed=s_seed)
                row["source"] = "direct"
            bench.sync(dev)
            row["load_s"] = time.perf_counter() - t0
            rows.append(bench.result_row(**row))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [0, vocab) (seeded, on the host)."""
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(int(seed))).tolist()


def adapter_slots(scenario: str, n: int, num_adapters: int) -> list[int | None]:
    """Adapter slot per request of ``scenario``; ValueError for an unknown scenario."""
    if scenario not in (*SCENARIOS, NO_ADAPTER_LOADED):
        raise ValueError(f"scenario must be one of {(*SCENARIOS, NO_ADAPTER_LOADED)}, got {scenario!r}")
    return [i % num_adapters for i in range(n)] if scenario == "adapters_mixed" else [None] * n


def _mode(device) -> str:
    return "graph" if torch.device(device).type == "cuda" else "cpu-interpreter"


def generation_row(res, *, model: str, scenario: str, stage: str | None, impl: str, adapters, **fields):
    """One CSV row of a generation result: times in ms, throughputs in tokens/s; ``fields`` appended."""
    ttft = [t * 1e3 for t in res.ttft_s]
    otps = [x for x in res.request_otps if math.isfinite(x)]
    steps = [s * 1e3 for s in res.step_s]
    nan = float("nan")
    return bench.result_row(
        model=model, impl=impl, scenario=scenario, stage=stage, concurrency=len(res.tokens),
        distinct_adapters=len({a for a in adapters if a is not None and a >= 0}),
        ttft_ms_mean=statistics.fmean(ttft), ttft_ms_p50=statistics.median(ttft), ttft_ms_max=max(ttft),
        otps_per_request=statistics.fmean(otps) if otps else nan,
        otps_per_request_min=min(otps) if otps else nan, otps_aggregate=res.aggregate_otps,
        decode_otps=res.decode_otps, step_ms_p50=statistics.median(steps) if steps else nan,
        step_ms_mean=statistics.fmean(steps) if steps else nan, prefill_ms=res.prefill_s * 1e3,
        decode_s=res.decode_s, total_s=res.total_s, output_tokens=res.output_tokens, **fields,
    )  # fmt: skip


def run_generation(
    gen, name: str, scenario: str, *, concurrency: int, prompt_len: int, new_tokens: int, seed: int = 0,
    warm_tokens: int = 2, progress: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Time one ``gen.generate`` of ``concurrency`` random prompts of ``prompt_len`` tokens making
    ``new_tokens`` each, after an untimed call making ``warm_tokens``: :func:`generation_row`'s row."""
    model = gen.model
    vocab, adapters = model.config.vocab_size, adapter_slots(scenario, concurrency, model.num_adapters)
    if warm_tokens:
        gen.generate(make_prompts(concurrency, prompt_len, vocab, seed + 7919), adapters, warm_tokens)
    prompts = make_prompts(concurrency, prompt_len, vocab, seed)
    res = gen.generate(prompts, adapters, new_tokens, progress=progress)
    assert all(len(t) == new_tokens for t in res.tokens), [len(t) for t in res.tokens]
    loaded = set().union(*(m.loaded_slots for m in model.lora_modules().values()))  # slots of any module
    return generation_row(
        res, model=name, scenario=scenario, stage=model.stage, impl="moelora", adapters=adapters,
        prompt_len=prompt_len, new_tokens=new_tokens, rank=int(model.max_rank), adapters_loaded=len(loaded),
        cuda_graphs=bool(gen.use_cuda_graphs), mode=_mode(model.device), dtype=dtype_name(model.dtype),
    )  # fmt: skip


def compiled_binaries() -> int:
    """Kernel binaries in the JIT caches of every Triton kernel of ``moelora_lib.kernels.*`` on the current
    GPU; 0 on CPU."""
    if not torch.cuda.is_available():
        return 0
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("moelora_lib.kernels.") and m is not None]
    objs = [o for m in mods for o in vars(m).values()]
    for _ in range(2):  # two dict levels (duplicates are dropped below)
        objs += [v for o in objs if isinstance(o, dict) for v in o.values()]
    found = {
        id(o): o for o in objs if not isinstance(o, dict) and getattr(o, "device_caches", None) is not None
    }
    dev = torch.cuda.current_device()
    return sum(len(k.device_caches[dev][0]) for k in found.values() if dev in k.device_caches)


def recompile_rows(
    gen, name: str, *, lengths: Sequence[int], scenario: str = "adapters_mixed", new_tokens: int = 2,
    warm_reps: int = 3, seed: int = 0, prewarm: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per prompt length never run before, concurrency 1: ``ttft_first_ms``, ``ttft_warm_ms`` (median of
    ``warm_reps``), ``ratio`` = first / warm, ``new_binaries``. ``prewarm``: capture every single-prompt
    prefill graph first (``prewarm_s``/``_binaries``)."""
    model = gen.model
    vocab, adapters = model.config.vocab_size, adapter_slots(scenario, 1, model.num_adapters)
    prewarm_s, prewarm_bin = 0.0, 0
    if prewarm:
        before = compiled_binaries()
        bench.sync(model.device)
        t0 = time.perf_counter()
        gen.warmup(batch_sizes=[1], prefill_lengths="all", max_prompts=1)
        bench.sync(model.device)
        prewarm_s, prewarm_bin = time.perf_counter() - t0, compiled_binaries() - before
    rows = []
    for i, length in enumerate(lengths):
        before = compiled_binaries()
        first = gen.generate(make_prompts(1, length, vocab, seed + 100 + i), adapters, new_tokens)
        new = compiled_binaries() - before
        prompts = (make_prompts(1, length, vocab, seed + 200 + 10 * i + k) for k in range(warm_reps))
        warm = [gen.generate(p, adapters, new_tokens).ttft_s[0] for p in prompts]
        f_ms, w_ms = first.ttft_s[0] * 1e3, statistics.median(warm) * 1e3
        rows.append(bench.result_row(
            model=name, stage=model.stage, scenario=scenario, prompt_len=length, new_tokens=new_tokens,
            ttft_first_ms=f_ms, ttft_warm_ms=w_ms, ttft_warm_min_ms=min(warm) * 1e3, ratio=f_ms / w_ms,
            new_binaries=new, warm_reps=warm_reps, prewarm=bool(prewarm), prewarm_s=prewarm_s,
            prewarm_binaries=prewarm_bin, mode=_mode(model.device),
        ))  # fmt: skip
    return rows


_LORA_KERNEL = re.compile(r"_(lora|dense)_(shrink|expand)_kernel")
_ALIGN_KERNEL = re.compile(r"_align_")
_MOE_KERNEL = re.compile(r"_(fused_moe|route|topk_reduce|gated_act|id_bounds)_kernel|_fused_")
_ATTN_KERNEL = re.compile(r"_(decode_split|decode_combine|qk_norm_rope_cache)_kernel")
_NORM_KERNEL = re.compile(r"_rms_norm_kernel")
_SCOPE = "e2e::"


def _category(scopes: list[str], kernel: str) -> str:
    """Category of one kernel (or CPU op) from the e2e scopes around it, innermost first."""
    inner = scopes[0] if scopes else None
    if _LORA_KERNEL.search(kernel) or (inner == "proj" and _ALIGN_KERNEL.search(kernel)):
        return "lora"
    if inner == "proj":
        return "attn_proj_base" if "attention" in scopes else "mlp_base"
    return {"attention": "attention", "mlp": "mlp_base"}.get(inner, "other")


def _category_by_name(kernel: str, *, moe: bool) -> str:
    """Category of a kernel without an op scope, by kernel name."""
    named = ((_LORA_KERNEL, "lora"), (_ALIGN_KERNEL, "mlp_base" if moe else "lora"),
             (_MOE_KERNEL, "mlp_base"), (_ATTN_KERNEL, "attention"), (_NORM_KERNEL, "other"))  # fmt: skip
    return next((cat for rx, cat in named if rx.search(kernel)), "unattributed")


def _scopes(event) -> list[str]:
    out, e = [], event
    while e is not None:
        if e.name.startswith(_SCOPE):
            out.append(e.name[len(_SCOPE) :])
        e = e.cpu_parent
    return out


def _attribute(events, *, cuda: bool, moe: bool) -> dict[str, float]:
    """Sum profiler ``events`` into :data:`CATEGORIES` (GPU: device time; CPU: self CPU time)."""
    from torch.autograd import DeviceType

    totals = dict.fromkeys(CATEGORIES, 0.0)
    linked: Counter = Counter()  # device activities attributed through their op: (name, µs)
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if not cuda:
            totals[_category(_scopes(e), e.name)] += e.self_cpu_time_total
            continue
        for k in e.kernels:
            if not k.name.startswith(_SCOPE):  # an annotation span linked to its scope, not a kernel
                totals[_category(_scopes(e), k.name)] += k.duration
                linked[(k.name, round(k.duration, 3))] += 1
    for e in events if cuda else ():  # device activities the profiler did not link to an op: by name
        scope = getattr(e, "is_user_annotation", False) or e.name.startswith(_SCOPE)  # the scopes' own spans
        if e.device_type == DeviceType.CPU or scope:
            continue
        key = (e.name, round(e.time_range.elapsed_us(), 3))
        if linked[key]:
            linked[key] -= 1
            continue
        totals[_category_by_name(e.name, moe=moe)] += e.time_range.elapsed_us()
    return totals


def step_breakdown(
    model: MultiLoRAModel, *, batch: int, adapters: Sequence[int | None], position: int, steps: int = 3,
    restrict: bool = False,
) -> dict[str, float]:  # fmt: skip
    """µs per decode step by :data:`CATEGORIES` and ``kernel_sum``: ``torch.profiler`` over ``steps`` eager
    decode steps of ``batch`` rows at cache ``position`` (GPU: device time; CPU: self CPU time). ``restrict``:
    inside ``model.restrict_slots`` of the adapters' slots."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from ..linear import LoRALinear
    from ..model.modeling import Attention, DenseMLP, MoEBlock

    dev, stack = model.device, []
    cuda = dev.type == "cuda"

    def pre(label):  # the hook returns None: the inputs stay as they are
        return lambda _mod, _args: stack.append(record_function(_SCOPE + label).__enter__())

    def post(_mod, _args, _out):
        stack.pop().__exit__(None, None, None)

    handles = []
    labels = ((Attention, "attention"), ((MoEBlock, DenseMLP), "mlp"), (LoRALinear, "proj"))
    for m in model.modules():
        if label := next((lab for cls, lab in labels if isinstance(m, cls)), None):
            handles += [m.register_forward_pre_hook(pre(label)), m.register_forward_hook(post)]
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g).to(dev)
    start = torch.full((batch,), int(position), dtype=torch.int64, device=dev)
    lora = torch.tensor([-1 if a is None else a for a in adapters], dtype=torch.int32, device=dev)
    rows = torch.arange(batch, dtype=torch.int64, device=dev)

    def step():
        return model(ids, start, lora, cache_rows=rows, last_only=True).argmax(dim=-1)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop lines would fill the notebook
    slots = {a for a in adapters if a is not None and a >= 0}
    scope = model.restrict_slots(slots) if restrict else contextlib.nullcontext()
    try:
        with torch.no_grad(), scope:
            step()
            bench.sync(dev)
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    step()
                bench.sync(dev)
    finally:
        for h in handles:
            h.remove()
    out = {k: v / steps for k, v in _attribute(prof.events(), cuda=cuda, moe=model.config.is_moe).items()}
    out["kernel_sum"] = sum(out[k] for k in CATEGORIES)
    return out


def breakdown_rows(
    breakdown: dict[str, float], gen_row: dict[str, Any], *, position: int
) -> list[dict[str, Any]]:
    """Rows of one :func:`step_breakdown` beside ``gen_row``: one per category and ``kernel_sum``, ``step``,
    ``gaps`` = step − kernel_sum."""
    key = {k: gen_row[k] for k in ("model", "scenario", "stage", "concurrency", "prompt_len", "mode")}
    step_us = gen_row["step_ms_p50"] * 1e3
    vals = {c: breakdown[c] for c in (*CATEGORIES, "kernel_sum")}
    vals |= {"step": step_us, "gaps": step_us - breakdown["kernel_sum"]}
    return [bench.result_row(**key, category=c, us_per_step=v, position=position) for c, v in vals.items()]


def hf_model(name: str, *, dtype: torch.dtype, device, seed: int = 0):
    """transformers' own model for ``name`` with random weights, on ``device`` in ``dtype``, eval mode."""
    import transformers

    d = config_dict(name)
    d.pop("quantization_config", None)
    cls_name = _CLASS[d["model_type"]]
    cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config")).from_dict(d)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return getattr(transformers, cls_name)(cfg).eval()
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def hf_generate(model, prompt: Sequence[int], new_tokens: int, device):
    """Greedy generation at batch 1 with a transformers model (or PeftModel); returns an object with the
    fields :func:`generation_row` reads."""
    import inspect
    from types import SimpleNamespace

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:  # the forward's KV-cache argument: ``cache`` where the signature has it, else ``past_key_values``
        kw_name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        kw_name = "past_key_values"

    def cache_of(out):
        return out.cache if getattr(out, "cache", None) is not None else out.past_key_values

    bench.sync(dev)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=dev)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    toks = [out.logits[:, -1].argmax(dim=-1)]
    bench.sync(dev)
    t_first = time.perf_counter()
    marks = []
    for _ in range(new_tokens - 1):
        out = model(input_ids=toks[-1][:, None], use_cache=True, logits_to_keep=1, **{kw_name: cache_of(out)})
        toks.append(out.logits[:, -1].argmax(dim=-1))
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
    bench.sync(dev)
    t_end = time.perf_counter()
    # event times relative to the first token, anchored at the last event = t_end
    ends = [t_end - ev.elapsed_time(marks[-1]) / 1e3 for ev in marks] if cuda else list(marks)
    steps = [b - a for a, b in zip([t_first] + ends[:-1], ends)]
    decode_s = (ends[-1] - t_first) if ends else 0.0
    n = len(toks)
    otps = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    return SimpleNamespace(
        tokens=[[int(t) for t in torch.cat(toks).tolist()]], ttft_s=[t_first - t0], request_otps=[otps],
        aggregate_otps=n / (t_end - t0), decode_otps=otps, step_s=steps, prefill_s=t_first - t0,
        decode_s=decode_s, total_s=t_end - t0, output_tokens=n,
    )  # fmt: skip


def hf_baseline_rows(
    name: str, *, dtype: torch.dtype, device, prompt_len: int, new_tokens: int, rank: int, alpha: float,
    seed: int = 0, warm_tokens: int = 2,
) -> list[dict[str, Any]]:  # fmt: skip
    """transformers alone and (``transformers_peft``) + PEFT with one rank-``rank`` adapter, eager,
    concurrency 1, after an untimed call: :func:`generation_row` rows plus implementations and versions. Frees
    the model."""
    import transformers

    model = hf_model(name, dtype=dtype, device=device, seed=seed)
    vocab, rows = model.config.vocab_size, []
    impl = dict(attn_implementation=getattr(model.config, "_attn_implementation", None),
                experts_implementation=getattr(model.config, "_experts_implementation", None),
                transformers=transformers.__version__)  # fmt: skip
    try:
        for scenario in HF_SCENARIOS:
            if scenario == "transformers_peft":
                import peft

                modules, params = peft_targets(model_config(name))
                lc = peft.LoraConfig(
                    r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules,
                    target_parameters=params, init_lora_weights=False,  # random B: B = 0 would time zeros
                )  # fmt: skip
                with warnings.catch_warnings():  # transformers' deprecation notices inside PEFT's wrapping
                    warnings.simplefilter("ignore", FutureWarning)
                    model = peft.get_peft_model(model, lc).eval()
                impl["peft"] = peft.__version__
            if warm_tokens:
                hf_generate(model, make_prompts(1, prompt_len, vocab, seed + 7919)[0], warm_tokens, device)
            res = hf_generate(model, make_prompts(1, prompt_len, vocab, seed)[0], new_tokens, device)
            peft_on = scenario == "transformers_peft"
            rows.append(generation_row(
                res, model=name, scenario=scenario, stage=None, impl=scenario,
                adapters=[0] if peft_on else [None], prompt_len=prompt_len, new_tokens=new_tokens,
                rank=rank if peft_on else 0, adapters_loaded=int(peft_on), cuda_graphs=False,
                mode="eager" if torch.device(device).type == "cuda" else "cpu", dtype=dtype_name(dtype),
                **impl,
            ))  # fmt: skip
    finally:
        del model
        free_memory(device)
    return rows


def _expected_distinct(n_picks_per_token: int, tokens: int, pool: int) -> float:
    """Expected distinct experts hit when ``tokens`` tokens each pick ``n_picks_per_token`` of ``pool``."""
    return pool * (1.0 - (1.0 - n_picks_per_token / pool) ** tokens) if tokens > 0 else 0.0


def decode_floor(
    name: str, *, batch: int, context: int, adapters: int = 0, rank: int = 32, bytes_per_el: int = 2,
    tb_per_s: float = H200_READ_TB_PER_S,
) -> dict[str, float]:  # fmt: skip
    """Bytes one decode step of ``batch`` rows must read (weights once, KV up to ``context``, ``adapters``
    distinct adapters) and its time at ``tb_per_s``. Returns weight_gb, kv_gb, lora_gb, floor_ms,
    otps_ceiling."""
    c = model_config(name)
    H, Lyr, r = c.hidden_size, c.num_hidden_layers, rank
    per_layer = float(H * (c.q_width + 2 * c.kv_width) + c.q_width * H)
    lora, lora_attn = 0.0, r * (H * 3 + c.q_width + 2 * c.kv_width) + r * (c.q_width + H)
    if c.is_moe:
        E, K, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        per_layer += _expected_distinct(K, batch, E) * (3 * H * I) + E * H
        if adapters:
            touched = adapters * _expected_distinct(K, max(1.0, batch / adapters), E)
            lora += touched * r * (H + 2 * I + I + H)
    else:
        I = c.intermediate_size
        per_layer += 3 * H * I
        lora_attn += r * (2 * H + 2 * I) + r * (I + H)
    lora += adapters * lora_attn
    weights = (per_layer * Lyr + c.vocab_size * H + batch * H) * bytes_per_el
    kv = batch * Lyr * 2 * c.kv_width * context * bytes_per_el
    lora_b = lora * Lyr * bytes_per_el
    floor_ms = (weights + kv + lora_b) / (tb_per_s * 1e12) * 1e3
    return dict(weight_gb=weights / 1e9, kv_gb=kv / 1e9, lora_gb=lora_b / 1e9, floor_ms=floor_ms,
                otps_ceiling=1e3 / floor_ms)  # fmt: skip


def prefill_floor(name: str, *, prompt_len: int, tflops: float = H200_BF16_TFLOPS) -> dict[str, float]:
    """FLOPs of one request's prefill and its time at ``tflops``: returns tflop, floor_ms."""
    c = model_config(name)
    H, T = c.hidden_size, prompt_len
    attn_proj = H * (c.q_width + 2 * c.kv_width) + c.q_width * H
    mlp = c.num_experts_per_tok * 3 * H * c.moe_intermediate_size if c.is_moe else 3 * H * c.intermediate_size
    attn = 0.0
    for t in c.layer_types:  # q·k and p·v over the visible keys (causal; a sliding layer sees at most w)
        w = c.sliding_window if t == "sliding_attention" else None
        visible = T * (T + 1) / 2 if w is None else sum(min(i + 1, w) for i in range(T))
        attn += 2 * 2 * c.q_width * visible
    flops = 2 * (attn_proj + mlp) * T * c.num_hidden_layers + attn + 2 * c.vocab_size * H
    return dict(tflop=flops / 1e12, floor_ms=flops / (tflops * 1e12) * 1e3)


#: The targets of notebook 11 (value against threshold): ``ge`` = value ≥ threshold to be met.
TARGETS = {
    "otps_c1": dict(threshold=300.0, ge=True, what="OTPS per request, GPT-OSS-20B, 8 adapters, 1 request"),
    "ttft_c1": dict(threshold=60.0, ge=False, what="TTFT (ms), GPT-OSS-20B, 8 adapters, 1 request"),
    "lora_vs_base": dict(threshold=0.9, ge=True, what="OTPS per request with 8 mixed adapters ÷ base"),
    "vs_transformers": dict(threshold=10.0, ge=True, what="our OTPS ÷ transformers + PEFT's (one adapter)"),
    "recompile": dict(threshold=1.1, ge=False, what="TTFT of the first request at a new length ÷ warm"),
}
HEADLINE = "gpt-oss-20b"


def summary_table(gen, *, final: str = "tuned"):
    """Per (model, concurrency) of stage ``final``: base and adapters_mixed side by side, ``ratio`` /
    ``ratio_aggregate`` = mixed ÷ base OTPS."""
    ours = gen[(gen.impl == "moelora") & (gen.stage == final)]
    cols = ["ttft_ms_mean", "otps_per_request", "otps_aggregate", "step_ms_p50"]
    wide = ours.pivot_table(index=["model", "concurrency"], columns="scenario", values=cols, sort=False)
    wide.columns = [f"{s}_{v}" for v, s in wide.columns]
    wide = wide.reset_index()
    if {"base_otps_per_request", "adapters_mixed_otps_per_request"} <= set(wide.columns):
        wide["ratio"] = wide.adapters_mixed_otps_per_request / wide.base_otps_per_request
        wide["ratio_aggregate"] = wide.adapters_mixed_otps_aggregate / wide.base_otps_aggregate
    return wide


def targets_table(gen, recompile, *, headline: str = HEADLINE, final: str = "tuned"):
    """The :data:`TARGETS` point by point (target, model, concurrency, prompt_len, value, threshold, met);
    targets without rows are left out."""
    import pandas as pd

    out = []

    def add(target, model, conc, plen, value):
        t = TARGETS[target]
        met = value >= t["threshold"] if t["ge"] else value <= t["threshold"]
        out.append(dict(target=target, model=model, concurrency=conc, prompt_len=plen, value=float(value),
                        threshold=t["threshold"], met=bool(met)))  # fmt: skip

    def sel(df, **eq):
        for k, v in eq.items():
            df = df[df[k] == v]
        return df

    ours = gen[(gen.impl == "moelora") & (gen.stage == final)]
    head = sel(ours, model=headline, scenario="adapters_mixed", concurrency=1)
    if len(head):
        h = head.iloc[0]
        add("otps_c1", headline, 1, h.prompt_len, h.otps_per_request)
        add("ttft_c1", headline, 1, h.prompt_len, h.ttft_ms_mean)
    summ = summary_table(gen, final=final) if len(ours) else None
    if summ is not None and "ratio" in summ:
        for _, r in summ.dropna(subset=["ratio"]).iterrows():
            plen = sel(ours, model=r.model, concurrency=r.concurrency).prompt_len.iloc[0]
            add("lora_vs_base", r.model, int(r.concurrency), plen, r.ratio)
    peft_rows = sel(gen, model=headline, impl="transformers_peft")
    if len(head) and len(peft_rows):
        p = peft_rows.iloc[0]
        add("vs_transformers", headline, 1, p.prompt_len, head.iloc[0].otps_per_request / p.otps_per_request)
    if recompile is not None and len(recompile):
        for _, r in recompile[recompile.stage == final].iterrows():
            add("recompile", r.model, 1, int(r.prompt_len), r.ratio)
    return pd.DataFrame(
        out, columns=["target", "model", "concurrency", "prompt_len", "value", "threshold", "met"]
    )
