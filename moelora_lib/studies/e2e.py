"""End-to-end multi-adapter generation (notebook 11): TTFT and output tokens/s of whole models.

What it gives the notebook (rows for ``data/11_*.csv``, each through :func:`moelora_lib.studies.bench.
result_row`, so every row carries the GPU, torch/triton/helion versions and the git commit):

* :data:`MODELS`, :func:`config_dict` / :func:`model_config` — the three models of the study at their real
  dimensions (:data:`moelora_lib.model.REAL_CONFIGS`) and one tiny config of each kind for the CPU profile
  (``tiny-gpt-oss``, ``tiny-qwen3-moe``, ``tiny-qwen3``: same fields, small sizes).
* :func:`build_model` — a :class:`~moelora_lib.model.MultiLoRAModel` with random weights drawn on the
  device (:func:`~moelora_lib.model.random_model`; speed depends only on the shapes).
* :func:`write_peft_adapter` / :func:`load_random_adapter` / :func:`load_adapters` — random rank-R adapters
  on attention (q, k, v, o) and the MLP (GPT-OSS and Qwen3-MoE: the experts' gate_up and down as PEFT's 3-D
  ``target_parameters`` factors; Qwen3: gate, up, down). ``load_adapters`` writes the slots named in
  ``file_slots`` as real PEFT files (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's key
  names and layouts) and loads them through :func:`moelora_lib.model.peft_adapters.load_peft_adapter`,
  so the loading path runs at the real sizes and its time is measured; the other slots are filled with
  random factors directly on the device (``load_adapter`` of every module). Why not every slot from a
  file: one rank-32 adapter of Qwen3-30B-A3B is 2.6 GB of bf16 (48 layers × 128 experts), eight of them
  would be 21 GB written and read back on the host's CPU, minutes of a GPU lease spent with the GPU idle;
  the kernels read slot buffers, so where a slot's values came from does not change any timing.
* :func:`run_generation` — one :meth:`~moelora_lib.model.generate.Generator.generate` call, after an
  untimed call with the same shapes (compilation and first-use costs stay out), as one row: TTFT per
  request (mean, p50, max), output tokens/s per request (mean, min) and aggregate, the median decode step.
* :func:`recompile_rows` — the first request at a prompt length never seen before against warm requests
  of that length, with the number of kernel binaries compiled in between (:func:`compiled_binaries`).
* :func:`step_breakdown` — where one decode step's GPU time goes (attention, attention projections' base
  GEMMs, MLP/MoE base, LoRA, other) from ``torch.profiler`` kernel times of eager steps with the same
  inputs as the captured graph, attributed through ``record_function`` scopes on the model's modules.
* :func:`hf_baseline_rows` — transformers + PEFT at the same dimensions on the same device (random
  weights, eager, one adapter: PEFT refuses mixed-adapter batches), timed the way the generator times.
* :func:`decode_floor` / :func:`prefill_floor` — the bytes a decode step must read and the FLOPs a prefill
  must do, over the H200's measured ceilings (:mod:`moelora_lib.hardware`): the OTPS ceiling and TTFT
  floor the measurements are put against.
* :func:`summary_table` / :func:`targets_table` — shared by the notebook and its conclusion
  (:mod:`moelora_lib.studies.conclusions.nb11`).

Definitions (the generator's, :class:`~moelora_lib.model.generate.GenerationResult`): TTFT = call start ->
the request's first token on the host (its prefill group done, device synchronized); OTPS per request =
(tokens − 1) / (last token − first token); aggregate OTPS = all output tokens / the whole call; a decode
step = the CUDA-graph replay plus the few launches that feed the next token back. Greedy decoding, no eos,
so every request makes exactly ``new_tokens`` tokens. On the CPU profile (Triton interpreter, tiny
configs, fp32, no CUDA graphs) every time is interpreter cost, never performance (``mode =
"cpu-interpreter"``).
"""

from __future__ import annotations

import gc
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
from . import bench

__all__ = [
    "MODELS",
    "TINY_MODELS",
    "SCENARIOS",
    "HF_SCENARIOS",
    "CATEGORIES",
    "TARGETS",
    "config_dict",
    "model_config",
    "build_model",
    "peft_targets",
    "adapter_tensors",
    "write_peft_adapter",
    "load_random_adapter",
    "load_adapters",
    "make_prompts",
    "adapter_slots",
    "run_generation",
    "generation_row",
    "compiled_binaries",
    "recompile_rows",
    "step_breakdown",
    "breakdown_rows",
    "hf_model",
    "hf_generate",
    "hf_baseline_rows",
    "decode_floor",
    "prefill_floor",
    "summary_table",
    "targets_table",
    "free_memory",
    "TABLES",
    "write_tables",
]

#: The three models of the study (names of :data:`moelora_lib.model.REAL_CONFIGS`).
MODELS = ("gpt-oss-20b", "qwen3-30b-a3b", "qwen3-32b")
#: The CPU profile's stand-in for each model: the same config.json fields at tiny sizes.
TINY_MODELS = {"gpt-oss-20b": "tiny-gpt-oss", "qwen3-30b-a3b": "tiny-qwen3-moe", "qwen3-32b": "tiny-qwen3"}
#: Our scenarios: no adapter loaded at all, and 8 adapters loaded with request i on slot i mod L.
SCENARIOS = ("base", "adapters_mixed")
#: The baseline's: transformers alone, and transformers + PEFT with one adapter.
HF_SCENARIOS = ("transformers", "transformers_peft")
#: Categories of :func:`step_breakdown` (µs of kernel time per decode step).
CATEGORIES = ("attention", "attn_proj_base", "mlp_base", "lora", "other", "unattributed")

_TINY_SIZES = {
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_per_token=2,
        vocab_size=128,
        sliding_window=8,
        pad_token_id=127,
        eos_token_id=126,
    ),
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_window_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        bos_token_id=125,
        eos_token_id=126,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_window_layers=2,
        vocab_size=128,
        bos_token_id=125,
        eos_token_id=126,
    ),
}
_TINY_OF = {"tiny-gpt-oss": "gpt-oss-20b", "tiny-qwen3-moe": "qwen3-30b-a3b", "tiny-qwen3": "qwen3-32b"}


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------
def config_dict(name: str) -> dict:
    """The config.json dict of ``name``: a :data:`MODELS` name (the real file) or a tiny one
    (:data:`TINY_MODELS` values: the real file with small sizes). A fresh dict per call.

    Raises ValueError for an unknown name."""
    if name in REAL_CONFIGS:
        return REAL_CONFIGS[name]
    if name in _TINY_OF:
        d = REAL_CONFIGS[_TINY_OF[name]]
        d.pop("quantization_config", None)
        d.update(_TINY_SIZES[d["model_type"]])
        return d
    raise ValueError(f"unknown model {name!r}; known: {list(REAL_CONFIGS)} and {list(_TINY_OF)}")


def model_config(name: str) -> ModelConfig:
    """:class:`~moelora_lib.model.ModelConfig` of :func:`config_dict`."""
    return ModelConfig.from_hf(config_dict(name))


def build_model(
    name: str,
    *,
    stage: str = "tuned",
    dtype: torch.dtype,
    device,
    max_batch: int,
    max_seq: int,
    max_tokens: int,
    num_adapters: int = 8,
    max_rank: int = 32,
    seed: int = 0,
) -> MultiLoRAModel:
    """A random-weight :class:`~moelora_lib.model.MultiLoRAModel` of ``name`` (see the module docstring),
    built directly on ``device``; no adapter loaded."""
    return random_model(
        model_config(name),
        seed=seed,
        dtype=dtype,
        device=device,
        num_adapters=num_adapters,
        max_rank=max_rank,
        max_batch=max_batch,
        max_seq=max_seq,
        max_tokens=max_tokens,
        stage=stage,
    )


#: The CSVs of notebook 11 (``data/11_<name>.csv``) and the function whose rows each holds.
TABLES = ("generation", "breakdown", "recompile", "adapter_load")


def write_tables(folder, **rows) -> dict[str, Path]:
    """Write each of ``rows`` (``generation=[...]``, ``breakdown=[...]``, ... — names of :data:`TABLES`)
    to ``<folder>/11_<name>.csv`` with :func:`~moelora_lib.studies.bench.write_rows`, replacing the file:
    called after every model, so a run cut short still leaves what it measured. Returns the paths."""
    out = {}
    for name, r in rows.items():
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; expected one of {TABLES}")
        out[name] = Path(folder) / f"11_{name}.csv"
        bench.write_rows(out[name], r)
    return out


def free_memory(device) -> None:
    """gc + ``torch.cuda.empty_cache()`` on a GPU: between models (tens of GB of weights, graph pools)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------------------
_CLASS = {"gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def peft_targets(config: ModelConfig) -> tuple[list[str], list[str] | None]:
    """(target_modules, target_parameters) of the study's adapters: attention q/k/v/o everywhere; the
    experts' gate_up and down (3-D parameters) on MoE models, the dense MLP's gate/up/down on Qwen3."""
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if config.is_moe:
        return modules, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return modules + ["gate_proj", "up_proj", "down_proj"], None


def _module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each targeted nn.Linear-like module of one layer."""
    c = config
    H = c.hidden_size
    shapes = {
        "self_attn.q_proj": (H, c.q_width),
        "self_attn.k_proj": (H, c.kv_width),
        "self_attn.v_proj": (H, c.kv_width),
        "self_attn.o_proj": (c.q_width, H),
    }
    if not c.is_moe:
        shapes.update(
            {
                "mlp.gate_proj": (H, c.intermediate_size),
                "mlp.up_proj": (H, c.intermediate_size),
                "mlp.down_proj": (c.intermediate_size, H),
            }
        )
    return shapes


def adapter_tensors(
    config: ModelConfig,
    *,
    rank: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    std: float = 0.02,
) -> dict[str, torch.Tensor]:
    """A random rank-``rank`` adapter as PEFT's ``adapter_model.safetensors`` holds it: {key: tensor}.

    Keys ``base_model.model.model.layers.{l}.<module>.lora_{A,B}.weight``; module LoRA ``lora_A`` [r, in],
    ``lora_B`` [out, r]; 3-D experts (GPT-OSS, Qwen3-MoE; gate_up registered first, so it is the inner
    wrapper ``mlp.experts.base_layer``, down the outer ``mlp.experts``): ``lora_A`` [E·r, in],
    ``lora_B`` [out, E·r] with gate_up in = H, out = 2I and down in = I, out = H. N(0, std²) entries drawn
    on ``device`` (fast on a GPU) in ``dtype``; lora_B nonzero (PEFT's trained adapters are), so no
    kernel ever sees an all-zero factor."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))

    def rnd(*shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    out: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        p = f"base_model.model.model.layers.{layer}."
        for mod, (d_in, d_out) in _module_shapes(config).items():
            out[f"{p}{mod}.lora_A.weight"] = rnd(rank, d_in)
            out[f"{p}{mod}.lora_B.weight"] = rnd(d_out, rank)
        if config.is_moe:
            E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
            out[f"{p}mlp.experts.base_layer.lora_A.weight"] = rnd(E * rank, H)
            out[f"{p}mlp.experts.base_layer.lora_B.weight"] = rnd(2 * I, E * rank)
            out[f"{p}mlp.experts.lora_A.weight"] = rnd(E * rank, I)
            out[f"{p}mlp.experts.lora_B.weight"] = rnd(H, E * rank)
    return out


def write_peft_adapter(
    folder,
    config: ModelConfig,
    *,
    rank: int,
    alpha: float,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    std: float = 0.02,
) -> Path:
    """Write a random adapter (:func:`adapter_tensors`, entries N(0, std²)) as a PEFT LoRA folder:
    ``adapter_config.json`` (PEFT 0.21's fields for plain LoRA with ``target_modules`` /
    ``target_parameters``, lora_dropout 0 as PEFT requires for parameter targets) and
    ``adapter_model.safetensors``. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    modules, params = peft_targets(config)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "target_parameters": params,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    tensors = adapter_tensors(config, rank=rank, seed=seed, dtype=dtype, device=device, std=std)
    host = {k: t.cpu().contiguous() for k, t in tensors.items()}
    save_file(host, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def load_random_adapter(model: MultiLoRAModel, slot: int, *, rank: int, alpha: float, seed: int, std=0.02):
    """Fill slot ``slot`` of every LoRA module of ``model`` with random rank-``rank`` factors drawn on the
    model's device (scaling alpha / rank), covering what :func:`peft_targets` covers: qkv (three slices)
    and o; the experts' gate_up (every slice) and down, or the dense MLP's gate_up (two slices) and
    down."""
    dev, dt = model.device, model.dtype
    g = torch.Generator(device=dev)
    g.manual_seed(int(seed))

    def rnd(*shape):
        return torch.empty(shape, dtype=dt, device=dev).normal_(0.0, std, generator=g)

    s = float(alpha) / rank

    def dense(mod):
        a = [rnd(rank, mod.in_features) for _ in mod.slices]
        b = [rnd(n, rank) for n in mod.slices]
        mod.load_adapter(slot, a if mod.S > 1 else a[0], b if mod.S > 1 else b[0], scaling=s)

    for layer in model.layers:
        dense(layer.self_attn.qkv_proj)
        dense(layer.self_attn.o_proj)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            x = mlp.experts
            gate_up = (rnd(x.E, x.S, rank, x.H), rnd(x.E, x.S, 2 * x.I // x.S, rank))
            x.load_adapter(slot, gate_up=gate_up, down=(rnd(x.E, rank, x.I), rnd(x.E, x.H, rank)), scaling=s)
        else:
            dense(mlp.gate_up_proj)
            dense(mlp.down_proj)


def load_adapters(
    model: MultiLoRAModel,
    name: str,
    *,
    rank: int,
    alpha: float,
    seed: int,
    file_slots: Sequence[int] = (0,),
    workdir=None,
) -> list[dict[str, Any]]:
    """Load an adapter into every slot of ``model``: the slots in ``file_slots`` from PEFT files written
    here (:func:`write_peft_adapter`, in ``workdir`` or a temporary folder removed afterwards) through
    :func:`~moelora_lib.model.peft_adapters.load_peft_adapter`, the others directly
    (:func:`load_random_adapter`). Each slot gets its own seed.

    Returns one row per slot: model, stage, slot, source ("peft_file" | "direct"), write_s (file only),
    load_s, file_mb, rank, alpha — times synchronized with the device."""
    from ..model.peft_adapters import load_peft_adapter

    dev = model.device
    rows = []
    tmp = None
    if workdir is None and file_slots:
        tmp = tempfile.TemporaryDirectory(prefix="moelora-e2e-")
        workdir = tmp.name
    try:
        for slot in range(model.num_adapters):
            s_seed = seed * 1000 + slot
            row = dict(
                model=name,
                stage=_stage_of(model),
                slot=slot,
                rank=rank,
                alpha=alpha,
                write_s=float("nan"),
                file_mb=float("nan"),
            )
            _sync(dev)
            if slot in file_slots:
                t0 = time.perf_counter()
                folder = write_peft_adapter(
                    Path(workdir) / f"{name}-slot{slot}",
                    model.config,
                    rank=rank,
                    alpha=alpha,
                    seed=s_seed,
                    dtype=torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32,
                    device=dev,
                )
                row["write_s"] = time.perf_counter() - t0
                row["file_mb"] = (folder / "adapter_model.safetensors").stat().st_size / 1e6
                t0 = time.perf_counter()
                load_peft_adapter(model, slot, folder)
                _sync(dev)
                row.update(source="peft_file", load_s=time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                load_random_adapter(model, slot, rank=rank, alpha=alpha, seed=s_seed)
                _sync(dev)
                row.update(source="direct", load_s=time.perf_counter() - t0)
            rows.append(bench.result_row(**row))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


# --------------------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [0, vocab) (seeded, on the host)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def adapter_slots(scenario: str, n: int, num_adapters: int) -> list[int | None]:
    """Adapter per request: "base" -> None for all; "adapters_mixed" -> request i on slot i mod L (every
    request a different adapter up to L requests)."""
    if scenario == "base":
        return [None] * n
    if scenario == "adapters_mixed":
        return [i % num_adapters for i in range(n)]
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")


def _mode(device) -> str:
    return "graph" if torch.device(device).type == "cuda" else "cpu-interpreter"


def generation_row(res, *, model: str, scenario: str, stage: str | None, impl: str, adapters, **fields):
    """One CSV row of a :class:`~moelora_lib.model.generate.GenerationResult` (or the same fields of
    :func:`hf_generate`): times in ms, throughputs in tokens/s."""
    ttft = [t * 1e3 for t in res.ttft_s]
    otps = [x for x in res.request_otps if math.isfinite(x)]
    steps = [s * 1e3 for s in res.step_s]
    return bench.result_row(
        model=model,
        impl=impl,
        scenario=scenario,
        stage=stage,
        concurrency=len(res.tokens),
        distinct_adapters=len({a for a in adapters if a is not None and a >= 0}),
        ttft_ms_mean=statistics.fmean(ttft),
        ttft_ms_p50=statistics.median(ttft),
        ttft_ms_max=max(ttft),
        otps_per_request=statistics.fmean(otps) if otps else float("nan"),
        otps_per_request_min=min(otps) if otps else float("nan"),
        otps_aggregate=res.aggregate_otps,
        decode_otps=res.decode_otps,
        step_ms_p50=statistics.median(steps) if steps else float("nan"),
        step_ms_mean=statistics.fmean(steps) if steps else float("nan"),
        prefill_ms=res.prefill_s * 1e3,
        decode_s=res.decode_s,
        total_s=res.total_s,
        output_tokens=res.output_tokens,
        **fields,
    )


def run_generation(
    gen,
    name: str,
    scenario: str,
    *,
    concurrency: int,
    prompt_len: int,
    new_tokens: int,
    seed: int = 0,
    warm_tokens: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    """Time one ``gen.generate`` of ``concurrency`` random prompts of ``prompt_len`` tokens, each making
    ``new_tokens`` tokens with its adapter (:func:`adapter_slots`), after an untimed call of the same
    shapes making ``warm_tokens`` tokens (so the prefill kernels at these lengths and the decode graph of
    this batch are built before the timed call). Returns :func:`generation_row`'s row.

    Asserts that every request made ``new_tokens`` tokens."""
    model = gen.model
    vocab, L = model.config.vocab_size, model.num_adapters
    adapters = adapter_slots(scenario, concurrency, L)
    if warm_tokens:
        gen.generate(make_prompts(concurrency, prompt_len, vocab, seed + 7919), adapters, warm_tokens)
    prompts = make_prompts(concurrency, prompt_len, vocab, seed)
    res = gen.generate(prompts, adapters, new_tokens, progress=progress)
    assert all(len(t) == new_tokens for t in res.tokens), [len(t) for t in res.tokens]
    stage = _stage_of(model)
    return generation_row(
        res,
        model=name,
        scenario=scenario,
        stage=stage,
        impl="moelora",
        adapters=adapters,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        rank=_rank_of(model),
        adapters_loaded=_loaded(model),
        cuda_graphs=bool(gen.use_cuda_graphs),
        mode=_mode(model.device),
        dtype=dtype_name(model.dtype),
    )


def _lora_modules(model) -> list:
    return list(model.lora_modules().values())


def _stage_of(model) -> str:
    return _lora_modules(model)[0].stage.name


def _rank_of(model) -> int:
    return int(model.max_rank)


def _loaded(model) -> int:
    """Slots holding an adapter in any module."""
    slots = set()
    for m in _lora_modules(model):
        s = m.loaded_slots
        slots |= set(s if not isinstance(s, dict) else s.keys())
    return len(slots)


# --------------------------------------------------------------------------------------------------
# recompilation
# --------------------------------------------------------------------------------------------------
def _jit_functions() -> list:
    """Every launched Triton kernel of the package's kernel modules imported so far (JIT functions found
    in their globals and one dict level down, e.g. ``KERNELS[name][flavour]``)."""
    found: dict[int, Any] = {}

    def take(obj):
        try:
            if hasattr(obj, "device_caches"):
                found[id(obj)] = obj
        except Exception:  # a module global with an unusual __getattr__: not a kernel
            pass

    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("moelora_lib.kernels.") or mod is None:
            continue
        for obj in vars(mod).values():
            take(obj)
            if isinstance(obj, dict):
                for v in obj.values():
                    take(v)
                    if isinstance(v, dict):
                        for w in v.values():
                            take(w)
    return list(found.values())


def compiled_binaries() -> int:
    """Kernel binaries in the JIT caches of the package's Triton kernels on the current GPU (0 on the CPU,
    where the interpreter compiles nothing)."""
    if not torch.cuda.is_available():
        return 0
    dev = torch.cuda.current_device()
    n = 0
    for k in _jit_functions():
        caches = getattr(k, "device_caches", None)
        if caches is not None and dev in caches:
            n += len(caches[dev][0])
    return n


def recompile_rows(
    gen,
    name: str,
    *,
    lengths: Sequence[int],
    scenario: str = "adapters_mixed",
    new_tokens: int = 2,
    warm_reps: int = 3,
    seed: int = 0,
    prewarm: bool = False,
) -> list[dict[str, Any]]:
    """The recompilation check, end to end: for each prompt length (never run before on this model), one
    request's TTFT the first time (``ttft_first_ms``) and the median over ``warm_reps`` more requests of
    the same length (``ttft_warm_ms``), at concurrency 1 with the scenario's adapter; ``new_binaries`` =
    kernel binaries compiled by the first request (:func:`compiled_binaries`). ``ratio`` = first / warm.

    ``prewarm``: first capture every single-prompt prefill graph up to ``max_seq``
    (``gen.warmup(prefill_lengths="all")``, what a server does at start-up; its seconds are the row's
    ``prewarm_s``, and the binaries it compiled ``prewarm_binaries``), so that a new length costs neither a
    compile nor a capture; off for the ``naive`` stage, whose point is what a new length costs without it."""
    model = gen.model
    vocab = model.config.vocab_size
    adapters = adapter_slots(scenario, 1, model.num_adapters)
    prewarm_s, prewarm_bin = 0.0, 0
    if prewarm:
        before = compiled_binaries()
        _sync(model.device)
        t0 = time.perf_counter()
        gen.warmup(batch_sizes=[1], prefill_lengths="all")
        _sync(model.device)
        prewarm_s, prewarm_bin = time.perf_counter() - t0, compiled_binaries() - before
    rows = []
    for i, length in enumerate(lengths):
        before = compiled_binaries()
        first = gen.generate(make_prompts(1, length, vocab, seed + 100 + i), adapters, new_tokens)
        new = compiled_binaries() - before
        warm = [
            gen.generate(
                make_prompts(1, length, vocab, seed + 200 + 10 * i + k), adapters, new_tokens
            ).ttft_s[0]
            for k in range(warm_reps)
        ]
        f_ms, w_ms = first.ttft_s[0] * 1e3, statistics.median(warm) * 1e3
        rows.append(
            bench.result_row(
                model=name,
                stage=_stage_of(model),
                scenario=scenario,
                prompt_len=length,
                new_tokens=new_tokens,
                ttft_first_ms=f_ms,
                ttft_warm_ms=w_ms,
                ttft_warm_min_ms=min(warm) * 1e3,
                ratio=f_ms / w_ms,
                new_binaries=new,
                warm_reps=warm_reps,
                prewarm=bool(prewarm),
                prewarm_s=prewarm_s,
                prewarm_binaries=prewarm_bin,
                mode=_mode(model.device),
            )
        )
    return rows


# --------------------------------------------------------------------------------------------------
# per-step breakdown
# --------------------------------------------------------------------------------------------------
_LORA_KERNEL = re.compile(r"_(lora|dense)_(shrink|expand)_kernel")
_ALIGN_KERNEL = re.compile(r"_align_")
_MOE_KERNEL = re.compile(r"_(fused_moe|route|topk_reduce|gated_act|id_bounds)_kernel|_fused_")
_ATTN_KERNEL = re.compile(r"_(decode_split|decode_combine|qk_norm_rope_cache)_kernel")
_NORM_KERNEL = re.compile(r"_rms_norm_kernel")
_SCOPE = "e2e::"


def _category(scopes: list[str], kernel: str) -> str:
    """Category of one kernel (or CPU op) given the e2e scopes around it, innermost first."""
    if _LORA_KERNEL.search(kernel):
        return "lora"
    inner = scopes[0] if scopes else None
    if inner == "proj":  # a LoRALinear: F.linear is the base; its token->adapter grouping serves only LoRA
        if _ALIGN_KERNEL.search(kernel):
            return "lora"
        return "attn_proj_base" if "attention" in scopes else "mlp_base"
    if inner == "attention":
        return "attention"
    if inner == "mlp":
        return "mlp_base"
    return "other"


def _category_by_name(kernel: str, *, moe: bool) -> str:
    """Category of a kernel no op scope was found for: our Triton kernels by name (the alignment serves the
    MoE layer on an MoE model, only the dense LoRA on a dense one), anything else "unattributed"."""
    if _LORA_KERNEL.search(kernel):
        return "lora"
    if _ALIGN_KERNEL.search(kernel):
        return "mlp_base" if moe else "lora"
    if _MOE_KERNEL.search(kernel):
        return "mlp_base"
    if _ATTN_KERNEL.search(kernel):
        return "attention"
    if _NORM_KERNEL.search(kernel):
        return "other"
    return "unattributed"


def _scopes(event) -> list[str]:
    out, e = [], event
    while e is not None:
        if e.name.startswith(_SCOPE):
            out.append(e.name[len(_SCOPE) :])
        e = e.cpu_parent
    return out


def _attribute(events, *, cuda: bool, moe: bool) -> dict[str, float]:
    """Sum profiler ``events`` (``prof.events()``) into :data:`CATEGORIES`: on a GPU the device time of
    every kernel, through the scopes of the op it is linked to (``FunctionEvent.kernels``), else by its
    name (:func:`_category_by_name`); on the CPU the self CPU time of every op."""
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
        if (
            e.device_type == DeviceType.CPU
            or getattr(e, "is_user_annotation", False)
            or e.name.startswith(_SCOPE)
        ):
            continue  # the scopes' own GPU spans (Kineto's gpu_user_annotation) are not kernels
        key = (e.name, round(e.time_range.elapsed_us(), 3))
        if linked[key]:
            linked[key] -= 1
            continue
        totals[_category_by_name(e.name, moe=moe)] += e.time_range.elapsed_us()
    return totals


def step_breakdown(
    model: MultiLoRAModel, *, batch: int, adapters: Sequence[int | None], position: int, steps: int = 3
) -> dict[str, float]:
    """µs per decode step by category (:data:`CATEGORIES`), from ``torch.profiler`` over ``steps`` eager
    decode steps of ``batch`` rows (token ids random, every row at cache position ``position``, adapters as
    given), after one unprofiled step.

    Attribution: ``record_function`` scopes on each :class:`~moelora_lib.model.modeling.Attention`
    ("attention"), MLP block (MoE or dense, "mlp") and :class:`moelora_lib.LoRALinear` ("proj"); a kernel
    counts for the innermost scope of the op that launched it: LoRA shrink/expand kernels are "lora"
    wherever they run (and a LoRALinear's token->adapter alignment); in a LoRALinear the rest is its
    base GEMM ("attn_proj_base" inside attention, else "mlp_base"); inside attention but outside its
    projections "attention" (RoPE, q/k norms, cache writes, the attention itself); in the MLP block
    the router, routing, alignment, expert GEMMs and the top-k reduction ("mlp_base"); outside every
    scope "other" (embedding, norms, residual adds, lm_head, the greedy argmax). Device kernels the
    profiler could not link to an op are classified by name where they are ours (LoRA, MoE, alignment
    kernels), else "unattributed". On a GPU the values are kernel (device) time and ``kernel_sum`` their
    total; on the CPU, self CPU time of the ops (interpreter cost).

    The captured graph replays the same kernels back to back; the difference between its step time and
    ``kernel_sum`` is launch gaps and idle time (computed by :func:`breakdown_rows`)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from ..lora_linear import LoRALinear
    from ..model.modeling import Attention, DenseMLP, MoEBlock

    dev = model.device
    cuda = dev.type == "cuda"
    stack: list = []

    def pre(label):
        def hook(_mod, _args):
            rf = record_function(_SCOPE + label)
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(_mod, _args, _out):
        stack.pop().__exit__(None, None, None)

    handles = []
    for m in model.modules():
        label = (
            "attention"
            if isinstance(m, Attention)
            else "mlp"
            if isinstance(m, (MoEBlock, DenseMLP))
            else "proj"
            if isinstance(m, LoRALinear)
            else None
        )
        if label:
            handles += [m.register_forward_pre_hook(pre(label)), m.register_forward_hook(post)]
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g).to(dev)
    start = torch.full((batch,), int(position), dtype=torch.int64, device=dev)
    lora = torch.tensor([-1 if a is None else a for a in adapters], dtype=torch.int32, device=dev)
    rows = torch.arange(batch, dtype=torch.int64, device=dev)

    def step():
        return model(ids, start, lora, cache_rows=rows, last_only=True).argmax(dim=-1)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # Kineto logs "USDT ... profiler_start/stop" on stderr for every profile, which would fill the executed
    # notebook; level 6 is above its highest. Logging only (a value the caller set is kept).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        with torch.no_grad():
            step()
            _sync(dev)
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    step()
                _sync(dev)
    finally:
        for h in handles:
            h.remove()
    totals = _attribute(prof.events(), cuda=cuda, moe=model.config.is_moe)
    out = {k: v / steps for k, v in totals.items()}
    out["kernel_sum"] = sum(out[k] for k in CATEGORIES)
    return out


def breakdown_rows(
    breakdown: dict[str, float], gen_row: dict[str, Any], *, position: int
) -> list[dict[str, Any]]:
    """Tidy rows of one :func:`step_breakdown` next to the measured decode step of ``gen_row`` (a
    :func:`run_generation` row of the same model, scenario and batch): one row per category plus
    ``kernel_sum``, ``step`` (the median decode step of the timed generate, graph replay on a GPU) and
    ``gaps`` = step − kernel_sum (launch gaps and idle time; negative if eager kernels ran slower)."""
    key = {k: gen_row[k] for k in ("model", "scenario", "stage", "concurrency", "prompt_len", "mode")}
    step_us = gen_row["step_ms_p50"] * 1e3
    parts = [*CATEGORIES, "kernel_sum"]
    rows = [bench.result_row(**key, category=c, us_per_step=breakdown[c], position=position) for c in parts]
    rows.append(bench.result_row(**key, category="step", us_per_step=step_us, position=position))
    rows.append(
        bench.result_row(
            **key, category="gaps", us_per_step=step_us - breakdown["kernel_sum"], position=position
        )
    )
    return rows


# --------------------------------------------------------------------------------------------------
# transformers + PEFT baseline
# --------------------------------------------------------------------------------------------------
def hf_model(name: str, *, dtype: torch.dtype, device, seed: int = 0):
    """transformers' own model class for ``name`` (random weights, ``initializer_range`` std, built
    directly on ``device`` in ``dtype``: a GPT-OSS-20B is 42 GB in bf16, so no fp32 copy), in eval mode.
    The file's ``quantization_config`` is dropped (the weights are bf16)."""
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
            model = getattr(transformers, cls_name)(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def _cache_kw(model) -> str:
    """The forward's name for the KV cache argument: ``cache`` (transformers ≥ 5.24 deprecates
    ``past_key_values``) or ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def hf_generate(model, prompt: Sequence[int], new_tokens: int, device):
    """Greedy generation with a transformers model (a PeftModel too) at batch 1: one prefill forward
    (``logits_to_keep=1``, as ``generate`` does), then one forward per token with the model's own cache;
    timed like the generator (TTFT = call start -> first token on the host after a device sync; the
    decode loop synchronizes once at the end, per-step times from CUDA events). Returns an object with
    the :class:`~moelora_lib.model.generate.GenerationResult` fields :func:`generation_row` reads."""
    from types import SimpleNamespace

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    kw_name = _cache_kw(model.get_base_model() if hasattr(model, "get_base_model") else model)
    _sync(dev)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=dev)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(dim=-1)
    toks = [tok]
    _sync(dev)
    t_first = time.perf_counter()
    cache = _out_cache(out)
    marks = []
    for _ in range(new_tokens - 1):
        out = model(input_ids=tok[:, None], use_cache=True, logits_to_keep=1, **{kw_name: cache})
        cache = _out_cache(out)
        tok = out.logits[:, -1].argmax(dim=-1)
        toks.append(tok)
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())
    _sync(dev)
    t_end = time.perf_counter()
    if cuda and marks:  # event times relative to the first token, anchored at the last event = t_end
        last = marks[-1]
        ends = [t_end - ev.elapsed_time(last) / 1e3 for ev in marks]
    else:
        ends = list(marks)
    steps = [b - a for a, b in zip([t_first] + ends[:-1], ends)]
    decode_s = (ends[-1] - t_first) if ends else 0.0
    tokens = [int(t) for t in torch.cat(toks).tolist()]
    n = len(tokens)
    return SimpleNamespace(
        tokens=[tokens],
        ttft_s=[t_first - t0],
        request_otps=[(n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")],
        aggregate_otps=n / (t_end - t0),
        decode_otps=(n - 1) / decode_s if decode_s > 0 else float("nan"),
        step_s=steps,
        prefill_s=t_first - t0,
        decode_s=decode_s,
        total_s=t_end - t0,
        output_tokens=n,
    )


def hf_baseline_rows(
    name: str,
    *,
    dtype: torch.dtype,
    device,
    prompt_len: int,
    new_tokens: int,
    rank: int,
    alpha: float,
    seed: int = 0,
    warm_tokens: int = 2,
    scenarios: Sequence[str] = HF_SCENARIOS,
) -> list[dict[str, Any]]:
    """transformers (and, with "transformers_peft", + PEFT with one adapter of rank ``rank`` on the same
    modules as ours: attention q/k/v/o and the experts' 3-D gate_up/down, or the dense MLP) at
    concurrency 1, each after an untimed call of ``warm_tokens`` tokens. Eager (transformers' default
    attention and experts implementations, recorded in the rows). The model is freed before returning."""
    import transformers

    model = hf_model(name, dtype=dtype, device=device, seed=seed)
    vocab = model.config.vocab_size
    impl = dict(
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        experts_implementation=getattr(model.config, "_experts_implementation", None),
        transformers=transformers.__version__,
    )
    rows = []
    try:
        for scenario in scenarios:
            if scenario == "transformers_peft":
                import peft

                modules, params = peft_targets(model_config(name))
                lc = peft.LoraConfig(
                    r=rank,
                    lora_alpha=alpha,
                    lora_dropout=0.0,
                    target_modules=modules,
                    target_parameters=params,
                    init_lora_weights=False,  # random A and B (PEFT's default B = 0 would time zeros)
                )
                with warnings.catch_warnings():  # transformers' deprecation notices inside PEFT's wrapping
                    warnings.simplefilter("ignore", FutureWarning)
                    model = peft.get_peft_model(model, lc).eval()
                impl["peft"] = peft.__version__
            elif scenario != "transformers":
                raise ValueError(f"scenario must be one of {HF_SCENARIOS}, got {scenario!r}")
            if warm_tokens:
                hf_generate(model, make_prompts(1, prompt_len, vocab, seed + 7919)[0], warm_tokens, device)
            res = hf_generate(model, make_prompts(1, prompt_len, vocab, seed)[0], new_tokens, device)
            rows.append(
                generation_row(
                    res,
                    model=name,
                    scenario=scenario,
                    stage=None,
                    impl=scenario,
                    adapters=[0] if scenario == "transformers_peft" else [None],
                    prompt_len=prompt_len,
                    new_tokens=new_tokens,
                    rank=rank if scenario == "transformers_peft" else 0,
                    adapters_loaded=1 if scenario == "transformers_peft" else 0,
                    cuda_graphs=False,
                    mode="eager" if torch.device(device).type == "cuda" else "cpu",
                    dtype=dtype_name(dtype),
                    **impl,
                )
            )
    finally:
        del model
        free_memory(device)
    return rows


# --------------------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------------------
def _expected_distinct(n_picks_per_token: int, tokens: int, pool: int) -> float:
    """Expected distinct experts hit when ``tokens`` tokens each pick ``n_picks_per_token`` of ``pool``
    uniformly (no repeats within a token)."""
    if tokens <= 0:
        return 0.0
    return pool * (1.0 - (1.0 - n_picks_per_token / pool) ** tokens)


def decode_floor(
    name: str,
    *,
    batch: int,
    context: int,
    adapters: int = 0,
    rank: int = 32,
    bytes_per_el: int = 2,
    tb_per_s: float = H200_READ_TB_PER_S,
) -> dict[str, float]:
    """Bytes one decode step of ``batch`` rows must read (each weight once; experts: the expected number
    hit under uniform routing; the KV cache up to ``context`` positions per row; ``adapters`` distinct
    adapters of rank ``rank``, their factors of the touched experts) and the time at ``tb_per_s`` (the
    H200's measured read stream). Returns weight_gb, kv_gb, lora_gb, floor_ms and otps_ceiling (per
    request: one token per step)."""
    c = model_config(name)
    H, Lyr = c.hidden_size, c.num_hidden_layers
    attn = H * (c.q_width + 2 * c.kv_width) + c.q_width * H
    per_layer = float(attn)
    lora = 0.0
    r = rank
    lora_attn = r * (H * 3 + c.q_width + 2 * c.kv_width) + r * (c.q_width + H)
    if c.is_moe:
        E, K, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        per_expert = 3 * H * I
        per_layer += _expected_distinct(K, batch, E) * per_expert + E * H
        if adapters:
            per_adapter_tokens = batch / adapters
            touched = adapters * _expected_distinct(K, max(1.0, per_adapter_tokens), E)
            lora += touched * r * (H + 2 * I + I + H)
    else:
        I = c.intermediate_size
        per_layer += 3 * H * I
        lora_attn += r * (2 * H + 2 * I) + r * (I + H)
    lora += adapters * lora_attn
    weights = (per_layer * Lyr + c.vocab_size * H + batch * H) * bytes_per_el
    kv = batch * Lyr * 2 * c.kv_width * context * bytes_per_el
    lora_b = lora * Lyr * bytes_per_el
    total = weights + kv + lora_b
    floor_ms = total / (tb_per_s * 1e12) * 1e3
    return dict(
        weight_gb=weights / 1e9,
        kv_gb=kv / 1e9,
        lora_gb=lora_b / 1e9,
        floor_ms=floor_ms,
        otps_ceiling=1e3 / floor_ms,
    )


def prefill_floor(name: str, *, prompt_len: int, tflops: float = H200_BF16_TFLOPS) -> dict[str, float]:
    """FLOPs of one request's prefill (2 per multiply-add: every projection at ``prompt_len`` tokens, the
    routed experts, causal attention scores and values, the lm_head at the last token only) and the time
    at ``tflops`` (the H200's measured bf16 matmul rate): the TTFT floor at concurrency 1."""
    c = model_config(name)
    H, T = c.hidden_size, prompt_len
    attn_proj = H * (c.q_width + 2 * c.kv_width) + c.q_width * H
    mlp = c.num_experts_per_tok * 3 * H * c.moe_intermediate_size if c.is_moe else 3 * H * c.intermediate_size
    per_token = 2 * (attn_proj + mlp)
    window = [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    attn = 0.0
    for w in window:  # q·k and p·v over the visible keys (causal; sliding layers see at most w)
        visible = T * (T + 1) / 2 if w is None else sum(min(i + 1, w) for i in range(T))
        attn += 2 * 2 * c.q_width * visible
    flops = per_token * T * c.num_hidden_layers + attn + 2 * c.vocab_size * H
    return dict(tflop=flops / 1e12, floor_ms=flops / (tflops * 1e12) * 1e3)


# --------------------------------------------------------------------------------------------------
# summary and targets
# --------------------------------------------------------------------------------------------------
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
    """One row per (model, concurrency) of our stage ``final``: base and adapters_mixed side by side
    (TTFT mean, OTPS per request and aggregate, median step) with ``ratio`` = mixed ÷ base OTPS per
    request (``ratio_aggregate`` the same for aggregate OTPS)."""
    import pandas as pd

    ours = gen[(gen.impl == "moelora") & (gen.stage == final)]
    cols = ["ttft_ms_mean", "otps_per_request", "otps_aggregate", "step_ms_p50"]
    wide = ours.pivot_table(index=["model", "concurrency"], columns="scenario", values=cols, sort=False)
    wide.columns = [f"{s}_{v}" for v, s in wide.columns]
    wide = wide.reset_index()
    if {"base_otps_per_request", "adapters_mixed_otps_per_request"} <= set(wide.columns):
        wide["ratio"] = wide.adapters_mixed_otps_per_request / wide.base_otps_per_request
        wide["ratio_aggregate"] = wide.adapters_mixed_otps_aggregate / wide.base_otps_aggregate
    return pd.DataFrame(wide)


def _row(df, **eq):
    sel = df
    for k, v in eq.items():
        sel = sel[sel[k] == v]
    return sel


def targets_table(gen, recompile, *, headline: str = HEADLINE, final: str = "tuned"):
    """The targets, point by point: target, model, concurrency, prompt_len, value, threshold, met.

    * otps_c1 / ttft_c1: ``headline``, adapters_mixed, stage ``final``, concurrency 1;
    * lora_vs_base: every (model, concurrency) with both scenarios at stage ``final``;
    * vs_transformers: the headline's adapters_mixed OTPS at concurrency 1 ÷ transformers_peft's;
    * recompile: every row of ``recompile`` at stage ``final``.
    Targets whose rows are missing are left out (the conclusion asserts their presence on the GPU)."""
    import pandas as pd

    out = []

    def add(target, model, conc, plen, value):
        t = TARGETS[target]
        met = value >= t["threshold"] if t["ge"] else value <= t["threshold"]
        out.append(
            dict(
                target=target,
                model=model,
                concurrency=conc,
                prompt_len=plen,
                value=float(value),
                threshold=t["threshold"],
                met=bool(met),
            )
        )

    ours = gen[(gen.impl == "moelora") & (gen.stage == final)]
    head = _row(ours, model=headline, scenario="adapters_mixed", concurrency=1)
    if len(head):
        h = head.iloc[0]
        add("otps_c1", headline, 1, h.prompt_len, h.otps_per_request)
        add("ttft_c1", headline, 1, h.prompt_len, h.ttft_ms_mean)
    summ = summary_table(gen, final=final) if len(ours) else None
    if summ is not None and "ratio" in summ:
        for _, r in summ.dropna(subset=["ratio"]).iterrows():
            plen = _row(ours, model=r.model, concurrency=r.concurrency).prompt_len.iloc[0]
            add("lora_vs_base", r.model, int(r.concurrency), plen, r.ratio)
    peft_rows = _row(gen, model=headline, impl="transformers_peft")
    if len(head) and len(peft_rows):
        p = peft_rows.iloc[0]
        add("vs_transformers", headline, 1, p.prompt_len, head.iloc[0].otps_per_request / p.otps_per_request)
    if recompile is not None and len(recompile):
        for _, r in recompile[recompile.stage == final].iterrows():
            add("recompile", r.model, 1, int(r.prompt_len), r.ratio)
    cols = ["target", "model", "concurrency", "prompt_len", "value", "threshold", "met"]
    return pd.DataFrame(out, columns=cols)
