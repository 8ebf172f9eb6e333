"""Dense multi-LoRA measurements (notebook 10): the attention (qkv, o) and dense-MLP (gate_up, down)
projections of :data:`MODELS`: seeded inputs, floors, timed parts, torch baselines, checks, vLLM's
anchor figures and the targets table; for notebook 15 block-FP8 base weights (:data:`WEIGHT_FORMATS`).

Timing: :func:`.bench.time_fn`; CPU rows say ``mode = "cpu-interpreter"``. Units: ms_p50/p20/p80 ms,
us_p50 and floor_us µs. Letters: T tokens, H input width, N = Σ slices, S slices, L slots, R rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..common import dtype_name, parse_dtype
from ..hardware import H200_BF16_TFLOPS, H200_FP8_TFLOPS
from ..kernels import STAGES
from ..kernels import dense_lora as dl
from ..linear import LoRALinear, _align_oneshot, lora_linear_reference
from ..quant.fp8 import FP8_BLOCK, FP8BlockWeight
from ..shapes import DENSE_CPU_MODELS, DENSE_GPU_MODELS, DENSE_PRESETS, DenseModel, DenseProjection
from ..testing import TOLERANCES
from ..workloads import adapter_ids
from . import bench
from .bench import free_memory
from .moe_bench import MODULE_PARTS, PARTS, W8A8_REL_TOL, check_tolerance, module_scheme  # noqa: F401

#: What :func:`bench_projection` times besides :data:`PARTS`: the LoRA part's launches, torch baselines.
KERNELS = ("shrink", "expand")
BASELINES = ("torch_loop", "torch_gbmm")
#: GPT-OSS-20B and Qwen3-30B-A3B (attention only: their MLPs are MoE), Qwen3-32B and Llama-3.3-70B.
MODELS: dict[str, DenseModel] = {m: DENSE_PRESETS[m] for m in DENSE_GPU_MODELS}
#: Tiny shapes for the CPU profile: GQA qkv 48 → 64 + 16 + 16, o 64 → 48, gate_up / down of width 96.
TINY_MODELS: dict[str, DenseModel] = {m: DENSE_PRESETS[m] for m in DENSE_CPU_MODELS}
#: Formats of a projection's base weight.
WEIGHT_FORMATS = ("dense", "fp8")


def fp8_weight(inp: ProjectionInputs, block: tuple[int, int] = FP8_BLOCK) -> FP8BlockWeight:
    """``inp.weight`` [N, H] quantized to block FP8 with ``block`` scale blocks, on ``inp``'s device."""
    from .moe_bench import quantize_fp8_weight

    return quantize_fp8_weight(inp.weight, block=block)


def dequantized(inp: ProjectionInputs, weight: FP8BlockWeight) -> ProjectionInputs:
    """``inp`` with its base weight replaced by ``weight`` dequantized exactly to ``inp``'s dtype."""
    import dataclasses

    return dataclasses.replace(inp, weight=weight.dequantize(inp.dtype))


def projections(model: str | DenseModel) -> list[DenseProjection]:
    """qkv, o and (dense MLP only) gate_up, down of ``model``; ValueError for an unknown model."""
    if isinstance(model, str):
        models = {**MODELS, **TINY_MODELS}
        if model not in models:
            raise ValueError(f"model: expected one of {sorted(models)}, got {model!r}")
        model = models[model]
    return model.projections()


def get_projection(name: str | DenseProjection) -> DenseProjection:
    """A projection by ``"<model>/<proj>"``, or ``name`` itself; ValueError for an unknown name."""
    if isinstance(name, DenseProjection):
        return name
    if not isinstance(name, str) or "/" not in name:
        raise ValueError(f"projection: expected '<model>/<proj>', got {name!r}")
    model, proj = name.split("/", 1)
    have = projections(model)
    for p in have:
        if p.proj == proj:
            return p
    raise ValueError(f"projection: {model} has no projection {proj!r} (have {[p.proj for p in have]})")


@dataclass
class ProjectionInputs:
    """Seeded inputs of one projection for up to ``max_tokens``: x [max_tokens, H] ~ N(0, 1); weight [N, H] ~
    N(0, 1/H); lora_a [L, S, R, H] ~ N(0, 1/H); lora_b [L, N, R] ~ N(0, 1/R) × scaling."""

    proj: DenseProjection
    x: torch.Tensor
    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    seed: int
    scaling: float

    def __post_init__(self):
        self.device, self.dtype, self.max_tokens = self.x.device, self.x.dtype, self.x.shape[0]
        self.L, self.R = self.lora_a.shape[0], self.lora_a.shape[2]

    def x_for(self, T: int) -> torch.Tensor:
        """x[:T]; ValueError if T is not in [1, max_tokens]."""
        if not 0 < T <= self.max_tokens:
            raise ValueError(f"T = {T} must be in [1, max_tokens = {self.max_tokens}]")
        return self.x[:T]

    def lora_ids(self, T: int, pattern: str = "uniform") -> torch.Tensor:
        """[T] int32 adapter slots of :func:`moelora_lib.workloads.adapter_ids`, seeded by (seed, T)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + T)
        return adapter_ids(T, self.L, pattern, g).to(device=self.device, dtype=torch.int32)


def make_inputs(proj: str | DenseProjection, max_tokens: int, *, rank: int = 32, adapters: int = 8,
                dtype=torch.bfloat16, device="cuda", seed: int = 0,
                scaling: float = 2.0) -> ProjectionInputs:  # fmt: skip
    """:class:`ProjectionInputs` drawn directly on ``device`` in ``dtype`` (name or torch dtype), seeded."""
    p, dtype = get_projection(proj), parse_dtype(dtype)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(int(seed))
    H, N, S = p.hidden, p.n_total, len(p.slices)

    def randn(shape, std):
        return torch.randn(shape, generator=g, dtype=dtype, device=dev).mul_(std)

    weight = randn((N, H), H**-0.5)
    lora_a = randn((adapters, S, rank, H), H**-0.5)
    lora_b = randn((adapters, N, rank), rank**-0.5 * scaling)
    x = randn((max_tokens, H), 1.0)
    return ProjectionInputs(p, x, weight, lora_a, lora_b, int(seed), float(scaling))


def part_costs(proj: str | DenseProjection, T: int, *, rank: int = 32, adapters: int = 8,
               dtype_bytes: int = 2, lora_ids: torch.Tensor | None = None, weight_bytes: float | None = None,
               base_tflops: float = H200_BF16_TFLOPS) -> dict[str, dict[str, float]]:  # fmt: skip
    """{part: {flops, bytes, floor_us, bytes_floor_us, flops_floor_us, bound}} of "base", "shrink", "expand",
    "lora", "total" at T (each tensor once; the rank intermediate fp32). ``weight_bytes``: bytes per base
    weight (None: ``dtype_bytes``); ``base_tflops``: the base GEMM's rate (None: bf16's)."""
    p = get_projection(proj)
    H, N, S, R, b, f32 = p.hidden, p.n_total, len(p.slices), rank, dtype_bytes, 4
    wb = b if weight_bytes is None else weight_bytes
    if lora_ids is None:
        Ta, na = T, min(T, adapters)
    else:
        keep = lora_ids.detach().cpu()
        keep = keep[keep >= 0]
        Ta, na = int(keep.numel()), int(torch.unique(keep).numel())
    raw = {
        "base": (2 * T * H * N, N * H * wb + T * H * b + T * N * b),
        "shrink": (2 * Ta * H * S * R, na * S * R * H * b + Ta * H * b + Ta * S * R * f32),
        "expand": (2 * Ta * R * N, na * N * R * b + Ta * S * R * f32 + 2 * Ta * N * b),
    }
    raw["lora"] = tuple(x + y for x, y in zip(raw["shrink"], raw["expand"]))
    raw["total"] = tuple(x + y for x, y in zip(raw["base"], raw["lora"]))
    cmp = {k: bench.compute_floor_us(raw[k][0]) for k in ("shrink", "expand", "lora")}
    cmp["base"] = bench.compute_floor_us(raw["base"][0], base_tflops)
    cmp["total"] = cmp["base"] + cmp["lora"]
    out = {}
    for part, (fl, by) in raw.items():
        t_mem, t_cmp = bench.copy_bandwidth_floor_us(by), cmp[part]
        bound = "memory" if t_mem >= t_cmp else "compute"
        out[part] = dict(flops=int(fl), bytes=int(round(by)))
        out[part] |= dict(floor_us=max(t_mem, t_cmp), bytes_floor_us=t_mem, flops_floor_us=t_cmp, bound=bound)
    return out


# --- The timed callables ------------------------------------------------------------------------------------


class LoRAPart:
    """The LoRA part of ``stage`` at T tokens, adding into ``out`` (a private copy of the base output), with
    its buffers built once; ``reset(); part()`` gives one call's result. ``cfg``: the stage's config (or
    ``config``); ``launched``: after the stage's adapt."""

    def __init__(self, stage: str, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor, config=None):
        st, p = STAGES[stage], inp.proj
        self.stage, self.slices = st, p.slices
        self.x, self.lora_a, self.lora_b = inp.x_for(T), inp.lora_a, inp.lora_b
        self.cfg = config or dl.dense_config_for(
            st, T, hidden=p.hidden, slices=p.slices, rank=inp.R, adapters=inp.L
        )
        self.launched = dl.adapt_dense_config(st, self.cfg)
        self.align = _align_oneshot(lora_ids, inp.L, self.cfg.block_size_m)
        self.base = F.linear(self.x, inp.weight)
        self.out = self.base.clone()
        self.inter = torch.zeros((T, len(p.slices) * inp.R), dtype=torch.float32, device=inp.device)
        ddt = torch.float32 if inp.dtype == torch.float16 else inp.dtype
        self.delta = None if st.fused_add else torch.empty((T, p.n_total), dtype=ddt, device=inp.device)
        self.kw = dict(use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)

    def reset(self) -> None:
        self.out.copy_(self.base)

    def shrink(self) -> torch.Tensor:
        """The shrink launch alone (zeroing the intermediate first under split-K)."""
        return dl.dense_shrink(
            self.x, self.lora_a, self.align, self.launched.shrink, inter=self.inter, **self.kw
        )

    def expand(self) -> torch.Tensor:
        """The expand launch alone, reading the last shrink's intermediate."""
        fused = self.stage.fused_add
        out, cfg = self.out if fused else self.delta, self.launched.expand
        return dl.dense_expand(
            self.inter, self.lora_b, out, self.align, cfg, slices=self.slices, add_inputs=fused, **self.kw
        )

    def __call__(self) -> torch.Tensor:
        args = (self.stage, self.out, self.x, self.lora_a, self.lora_b, self.align, self.cfg)
        return dl.dense_lora_add(*args, slices=self.slices, inter=self.inter, delta=self.delta)


class _TorchBaseline:
    """x[:T], the base output and a private copy to add into; ``reset()`` restores the copy."""

    def __init__(self, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor):
        p = inp.proj
        self.x, self.slices = inp.x_for(T), p.slices
        self.offsets = [sum(p.slices[:s]) for s in range(len(p.slices) + 1)]
        self.lora_b = inp.lora_b
        self.base = F.linear(self.x, inp.weight)
        self.out = self.base.clone()
        L, S, R, H = inp.lora_a.shape
        self.a3, self.R = inp.lora_a.reshape(L, S * R, H), R

    def reset(self) -> None:
        self.out.copy_(self.base)


class TorchLoop(_TorchBaseline):
    """A loop over adapters: gather rows, shrink all slices at once, expand slice by slice, ``index_add_``
    into the output (row lists built before timing)."""

    def __init__(self, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor):
        super().__init__(inp, T, lora_ids)
        ids = lora_ids.detach().cpu()
        self.groups = []
        for a in range(inp.L):
            rows = (ids == a).nonzero().squeeze(1)
            if rows.numel():
                self.groups.append((a, rows.to(device=inp.device)))

    def __call__(self) -> torch.Tensor:
        o = self.offsets
        for a, rows in self.groups:
            shrunk = self.x.index_select(0, rows) @ self.a3[a].T  # [T_a, S·R]
            delta = torch.empty((rows.numel(), o[-1]), dtype=self.out.dtype, device=self.out.device)
            for s in range(len(self.slices)):
                r = shrunk[:, s * self.R : (s + 1) * self.R]
                torch.matmul(r, self.lora_b[a, o[s] : o[s + 1]].T, out=delta[:, o[s] : o[s + 1]])
            self.out.index_add_(0, rows, delta)
        return self.out


class TorchGatherBmm(_TorchBaseline):
    """Gather + bmm: each token's A and B gathered by adapter id, two batched matmuls per slice, the delta
    added into the rows with an adapter."""

    def __init__(self, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor):
        super().__init__(inp, T, lora_ids)
        keep = (lora_ids.detach().cpu() >= 0).nonzero().squeeze(1)
        self.all_rows = keep.numel() == T
        self.rows = keep.to(inp.device)
        self.sel = lora_ids.long() if self.all_rows else lora_ids[self.rows].long()

    def __call__(self) -> torch.Tensor:
        o = self.offsets
        xs = self.x if self.all_rows else self.x.index_select(0, self.rows)
        shrunk = torch.bmm(self.a3[self.sel], xs.unsqueeze(2))  # [T_a, S·R, 1]
        for s in range(len(self.slices)):
            b_tok = self.lora_b[self.sel, o[s] : o[s + 1]]  # [T_a, N_s, R]
            d = torch.bmm(b_tok, shrunk[:, s * self.R : (s + 1) * self.R]).squeeze(2)  # [T_a, N_s]
            del b_tok
            if self.all_rows:
                self.out[:, o[s] : o[s + 1]] += d
            else:
                self.out[:, o[s] : o[s + 1]].index_add_(0, self.rows, d)
        return self.out


_BASELINE_CLASSES = {"torch_loop": TorchLoop, "torch_gbmm": TorchGatherBmm}


def build_module(inp: ProjectionInputs, stage: str = "tuned", *, max_tokens: int | None = None,
                 weight: FP8BlockWeight | None = None,
                 activation_scheme: str = "auto") -> LoRALinear:  # fmt: skip
    """A :class:`LoRALinear` of ``stage`` on ``inp``'s weight (or the block-FP8 ``weight``) with its L
    adapters loaded (scaling 1); ``max_tokens`` defaults to inp.max_tokens; ``activation_scheme``:
    LoRALinear's."""
    p, S = inp.proj, len(inp.proj.slices)
    kw = dict(num_adapters=inp.L, max_rank=inp.R, max_tokens=max_tokens or inp.max_tokens, stage=stage)
    kw |= dict(activation_scheme=activation_scheme)
    if weight is None:
        m = LoRALinear(inp.weight, slices=p.slices, **kw)
    else:
        if not isinstance(weight, FP8BlockWeight) or weight.shape != tuple(inp.weight.shape):
            raise ValueError(f"weight must be an FP8BlockWeight of shape {list(inp.weight.shape)}")
        m = LoRALinear(weight, slices=p.slices, dtype=inp.dtype, **kw)
    o = [sum(p.slices[:s]) for s in range(S + 1)]
    for a in range(inp.L):
        bs = [inp.lora_b[a, o[s] : o[s + 1]] for s in range(S)]
        m.load_adapter(a, [inp.lora_a[a, s] for s in range(S)], bs, scaling=1.0)
    return m


# --- Benchmarks ---------------------------------------------------------------------------------------------


def _fields(inp: ProjectionInputs, T: int, pattern: str) -> dict[str, Any]:
    """model, proj, H, N, slices, S, T, L, R, dtype, pattern: the columns naming a point."""
    p = inp.proj
    f = dict(model=p.model, proj=p.proj, H=p.hidden, N=p.n_total, slices=p.slices_str, S=len(p.slices))
    return dict(f, T=T, L=inp.L, R=inp.R, dtype=dtype_name(inp.dtype), pattern=pattern)


def _timing(fn, device, mode: str, warmup_ms: float, rep_ms: float, min_reps=None) -> dict[str, Any]:
    """Run ``fn`` once untimed, then time it: mode, ms_p50/p20/p80, us_p50."""
    if torch.device(device).type == "cuda":
        fn()
        torch.cuda.synchronize()
    m = "cpu-interpreter" if torch.device(device).type == "cpu" else mode
    tm = bench.time_fn(fn, m, device, warmup_ms, rep_ms, min_reps=min_reps)
    return dict(mode=m, ms_p50=tm.ms_p50, ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, us_p50=tm.ms_p50 * 1e3)


def _time_row(fn, inp, T, pattern, cost, kw, timing) -> dict[str, Any]:
    """A timing row: the point's fields, ``kw``, the timing, the part's cost and the timing parameters."""
    cost = {k: cost[k] for k in ("flops", "bytes", "floor_us", "bytes_floor_us", "flops_floor_us", "bound")}
    budget = {k: timing[k] for k in ("warmup_ms", "rep_ms", "min_reps")}
    return bench.result_row(
        **_fields(inp, T, pattern), **kw, **_timing(fn, inp.device, **timing), **cost, **budget
    )


def _point(inp: ProjectionInputs, T: int, pattern: str, module: LoRALinear | None = None):
    """(adapter ids of ``pattern``, :func:`part_costs`) of one timed point; a ``module`` on an FP8 weight
    gives the base its FP8 bytes and rate."""
    ids, kw = inp.lora_ids(T, pattern), {}
    if module is not None and module.weight_format == "fp8":
        w = module.base_weight()
        kw = dict(weight_bytes=w.nbytes / (w.shape[0] * w.shape[1]), base_tflops=H200_FP8_TFLOPS)
    elem = inp.x.element_size()
    return ids, part_costs(inp.proj, T, rank=inp.R, adapters=inp.L, dtype_bytes=elem, lora_ids=ids, **kw)


def _module_kw(module: LoRALinear, impl: str, part: str, T: int) -> dict[str, Any]:
    """:func:`_kw` of a ``module`` forward at T (part "base": no active slot); config ``gemv:<config>``,
    source ``default:dense_gemv`` where that call runs the one-launch decode GEMV (LoRALinear.runs_gemv)."""
    if not module.runs_gemv(T, lora=part != "base"):
        return _kw(impl, module.stage.name, part, module.config_for(T))
    gemv = f"gemv:{module.gemv_config_for(T).short()}"
    return dict(_kw(impl, module.stage.name, part), config=gemv, config_source="default:dense_gemv")


def _kw(impl: str, stage: str | None, part: str, cfg=None, launched=None) -> dict[str, Any]:
    """impl, stage, part, config, config_source and block_size_m of ``cfg``."""
    shown = cfg if launched is None else launched
    cfg_fields = (shown.short(), cfg.source, cfg.block_size_m) if cfg is not None else (None,) * 3
    names = ("impl", "stage", "part", "config", "config_source", "block_size_m")
    return dict(zip(names, (impl, stage, part, *cfg_fields)))


def bench_projection(stage: str, inp: ProjectionInputs, T: int, *, parts: Sequence[str] = PARTS,
                     module: LoRALinear | None = None, pattern: str = "uniform", config=None,
                     mode: str = "graph", warmup_ms: float = 25, rep_ms: float = 100,
                     min_reps: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Time ``parts`` of ``stage`` at T, one row per part (each run once untimed first): "base", "lora",
    "total", "shrink"/"expand", "torch_loop"/"torch_gbmm". Rows: model, proj, H, N, slices, S, T, L, R, dtype,
    pattern, impl, stage, part, config, config_source, block_size_m, mode, ms_p50/p20/p80, us_p50, flops,
    bytes, floor_us, bound, warmup_ms, rep_ms, min_reps, environment columns. ValueError for an unknown stage
    or part, or a module of another stage."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")
    bad = [p for p in parts if p not in PARTS + KERNELS + BASELINES]
    if bad:
        raise ValueError(f"parts must be in {PARTS + KERNELS + BASELINES}, got {bad}")
    ids, costs = _point(inp, T, pattern)
    x = inp.x_for(T)
    timing = dict(mode=mode, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)
    kernels = None  # one LoRAPart for both launches, built at the first
    rows = []
    for part in parts:
        if part == "base":
            fn, kw, cost = (lambda w=inp.weight: F.linear(x, w)), _kw("cublas", None, part), costs[part]
        elif part == "lora":
            fn = LoRAPart(stage, inp, T, ids, config)
            kw, cost = _kw(stage, stage, part, fn.cfg, fn.launched), costs[part]
        elif part == "total":
            mod = module if module is not None else build_module(inp, stage, max_tokens=T)
            if mod.stage.name != stage:
                raise ValueError(f"module is of stage {mod.stage.name!r}, not {stage!r}")
            fn, kw, cost = (lambda m=mod: m(x, ids)), _module_kw(mod, stage, part, T), costs[part]
        elif part in KERNELS:
            kernels = kernels or LoRAPart(stage, inp, T, ids)
            fn, cost = getattr(kernels, part), costs[part]
            kw = _kw(stage, stage, part, kernels.cfg, kernels.launched)
            if part == "expand":
                kernels.shrink()  # the intermediate the expand reads
        else:
            fn, kw, cost = _BASELINE_CLASSES[part](inp, T, ids), _kw(part, None, "lora"), costs["lora"]
        rows.append(_time_row(fn, inp, T, pattern, cost, kw, timing))
        del fn
    return rows


def bench_module(module: LoRALinear, inp: ProjectionInputs, T: int, *, parts: Sequence[str] = MODULE_PARTS,
                 pattern: str = "uniform", mode: str = "graph", warmup_ms: float = 25, rep_ms: float = 100,
                 min_reps: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Time a :class:`LoRALinear` forward at T tokens of ``inp``, one row per part: "base" (``active_slots``
    empty) and "total". Rows: :func:`bench_projection`'s columns (impl "module") plus weight_format and
    activation_scheme. ValueError for another part."""
    bad = sorted(set(parts) - set(MODULE_PARTS))
    if bad:
        raise ValueError(f"bench_module: parts must be among {MODULE_PARTS}, got {bad}")
    ids, costs = _point(inp, T, pattern, module)
    x = inp.x_for(T)
    timing = dict(mode=mode, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)
    saved, rows = module.active_slots, []
    fields = dict(weight_format=module.weight_format, activation_scheme=module_scheme(module, T))
    try:
        for part in parts:
            module.active_slots = frozenset() if part == "base" else saved
            kw = _module_kw(module, "module", part, T) | fields
            rows.append(_time_row(lambda: module(x, ids), inp, T, pattern, costs[part], kw, timing))
    finally:
        module.active_slots = saved
    return rows


def check_fp8_projection(inp: ProjectionInputs, T: int, weight: FP8BlockWeight, *,
                         activation_scheme: str = "auto", stage: str = "tuned", pattern: str = "mixed",
                         module: LoRALinear | None = None, dense_module: LoRALinear | None = None,
                         ref_dtype: torch.dtype | None = None) -> dict[str, Any]:  # fmt: skip
    """The :class:`LoRALinear` forward on the FP8 ``weight`` at T against ``lora_linear_reference`` on the
    dequantized weight (``ref_dtype``: float64 on the CPU, float32 on a GPU) and against ``dense_module`` (or
    built) on it. One row: the point's fields, impl "module", stage, part "total", weight_format "fp8",
    activation_scheme, rel_err, rel_err_vs_dense, tol, delta_rel, no_adapter_rows, no_adapter_bitwise."""
    ids, x, ref, delta_rel = _reference(inp, T, pattern, weight, ref_dtype)
    deq = dequantized(inp, weight)
    if module is None:
        module = build_module(inp, stage, max_tokens=T, weight=weight, activation_scheme=activation_scheme)
    mod = module
    dmod = dense_module if dense_module is not None else build_module(deq, stage, max_tokens=T)
    out = mod(x, ids)
    saved = mod.active_slots
    try:
        mod.active_slots = frozenset()
        base = mod(x, ids)
    finally:
        mod.active_slots = saved
    none = ids < 0
    n_none = int(none.sum())
    form = module_scheme(mod, T)
    r = dict(impl="module", stage=mod.stage.name, part="total", weight_format="fp8", activation_scheme=form)
    r |= dict(check="vs_reference", rel_err=_rel_err(out, ref), rel_err_vs_dense=_rel_err(out, dmod(x, ids)))
    r |= dict(tol=check_tolerance(inp.dtype, form), delta_rel=delta_rel)
    r |= dict(no_adapter_rows=n_none, no_adapter_bitwise=bool(torch.equal(out[none], base[none])))
    return bench.result_row(**_fields(inp, T, pattern), **r)


def bench_alignment(T: int, *, block_size_m: int, adapters: int = 8, pattern: str = "uniform", device="cuda",
                    seed: int = 0, **timing) -> dict[str, Any]:  # fmt: skip
    """Time the token→adapter alignment alone. One row: impl and part "align", T, L, block_size_m, pattern,
    mode, ms_p50/p20/p80, us_p50, warmup_ms, rep_ms, min_reps."""
    timing = dict(dict(mode="graph", warmup_ms=25, rep_ms=100, min_reps=None), **timing)
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + T)
    ids = adapter_ids(T, adapters, pattern, g).to(device=device, dtype=torch.int32)
    row = dict(impl="align", part="align", T=T, L=adapters, block_size_m=block_size_m, pattern=pattern)
    tm = _timing(lambda: _align_oneshot(ids, adapters, block_size_m), device, **timing)
    return bench.result_row(**row, **tm, **{k: timing[k] for k in ("warmup_ms", "rep_ms", "min_reps")})


# --- Correctness --------------------------------------------------------------------------------------------


def _reference(inp: ProjectionInputs, T: int, pattern: str, weight, ref_dtype):
    """(ids, x, ref, delta_rel) of one check at T: ``lora_linear_reference`` on ``weight`` (dense or FP8) in
    ``ref_dtype`` (None: float64 on the CPU, float32 on a GPU); delta_rel = max|ref − ref without LoRA| /
    max|ref|."""
    ids, x = inp.lora_ids(T, pattern), inp.x_for(T)
    if ref_dtype is None:
        ref_dtype = torch.float64 if inp.device.type == "cpu" else torch.float32
    w = weight.dequantize(torch.float32) if isinstance(weight, FP8BlockWeight) else weight  # exact, once
    ref = lora_linear_reference(x, w, inp.lora_a, inp.lora_b, ids, slices=inp.proj.slices, dtype=ref_dtype)
    ref_base = x.to(ref_dtype) @ w.to(ref_dtype).T
    return ids, x, ref, float((ref - ref_base).abs().max() / ref.abs().max().clamp_min(1e-30))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out − ref| / max|ref| on ref's device; inf for a non-finite output or a shape mismatch."""
    if out.shape != ref.shape:
        return float("inf")
    o = out.to(ref.dtype)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def check_projection(inp: ProjectionInputs, T: int, *,
                     stages: Sequence[str] = tuple(s for s in STAGES if not STAGES[s].fused_gemm),
                     module_stages: Sequence[str] = ("tuned",), baselines: Sequence[str] = BASELINES,
                     modules: dict[str, LoRALinear] | None = None, pattern: str = "mixed",
                     ref_dtype: torch.dtype | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The LoRA part of each of ``stages``, the :class:`LoRALinear` forward of each of ``module_stages`` and
    the torch ``baselines`` against ``lora_linear_reference``. One row each: the point's fields, impl, stage,
    part, check "vs_reference", rel_err, tol, delta_rel, no_adapter_rows, no_adapter_bitwise, config,
    config_source."""
    ids, x, ref, delta_rel = _reference(inp, T, pattern, inp.weight, ref_dtype)
    base = F.linear(x, inp.weight)
    none = ids < 0
    n_none = int(none.sum())

    def row(impl, stage, part, out, cfg=None):
        r = dict(impl=impl, stage=stage, part=part, check="vs_reference", rel_err=_rel_err(out, ref))
        r |= dict(tol=TOLERANCES[inp.dtype], delta_rel=delta_rel, no_adapter_rows=n_none)
        r |= dict(no_adapter_bitwise=bool(torch.equal(out[none], base[none])) if n_none else True)
        r |= dict(
            config=cfg.short() if cfg is not None else None,
            config_source=cfg.source if cfg is not None else None,
        )
        return bench.result_row(**_fields(inp, T, pattern), **r)

    rows = []
    for stage in stages:
        fn = LoRAPart(stage, inp, T, ids)
        fn.reset()
        rows.append(row(stage, stage, "lora", fn(), fn.launched))
        del fn
    for stage in module_stages:
        mod = (modules or {}).get(stage) or build_module(inp, stage, max_tokens=T)
        rows.append(row(stage, stage, "total", mod(x, ids), mod.config_for(T)))
        del mod
    for impl in baselines:
        fn = _BASELINE_CLASSES[impl](inp, T, ids)
        fn.reset()
        rows.append(row(impl, None, "lora", fn()))
        del fn
    return rows


def check_projections(projs: Sequence[str | DenseProjection], tokens: Sequence[int], *,
                      stages: Sequence[str], module_stages: Sequence[str] = ("tuned",),
                      **input_kw) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`check_projection` at every T for each projection; rows in (projection, T) order."""
    rows: list[dict[str, Any]] = []
    for p in projs:
        inp = make_inputs(p, max(tokens), **input_kw)
        modules = {st: build_module(inp, st) for st in module_stages}
        for T in tokens:
            rows += check_projection(inp, T, stages=stages, module_stages=module_stages, modules=modules)
        del inp, modules
        free_memory(input_kw.get("device", "cuda"))
    return rows


def check_in_subprocesses(projs: Sequence[str | DenseProjection], tokens: Sequence[int], *, jobs: int = 4,
                          timeout_s: float = 600, **kw) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`check_projections` over ``jobs`` processes side by side: the same rows in the same order as one
    process. RuntimeError when a process fails."""
    import json
    import sys
    import tempfile

    names = [get_projection(p).name for p in projs]
    chunks = [c for c in (names[i :: max(1, jobs)] for i in range(max(1, jobs))) if c]
    code = (
        "import json, sys; from moelora_lib.studies.dense_bench import check_projections; "
        "rows = check_projections(**json.load(open(sys.argv[1]))); "
        "json.dump(rows, open(sys.argv[2], 'w'), default=str)"
    )
    with tempfile.TemporaryDirectory(prefix="moelora_dense_checks_") as tmp:
        cmds = {}
        for i, chunk in enumerate(chunks):
            with open(os.path.join(tmp, f"{i}.args.json"), "w") as f:
                json.dump(dict(kw, projs=chunk, tokens=[int(t) for t in tokens]), f)
            cmds[str(i)] = [sys.executable, "-c", code, f.name, os.path.join(tmp, f"{i}.json")]
        bench.run_side_by_side(cmds, timeout_s=timeout_s)
        by_proj: dict[str, list[dict[str, Any]]] = {}
        for i in range(len(chunks)):
            with open(os.path.join(tmp, f"{i}.json")) as f:
                for r in json.load(f):
                    by_proj.setdefault(f"{r['model']}/{r['proj']}", []).append(r)
    return [r for n in names for r in by_proj.get(n, [])]


# --- vLLM anchors, the summary and the targets --------------------------------------------------------------

#: vLLM's dense multi-LoRA ops (``lora_shrink`` / ``lora_expand``) measured on the same H200.
ANCHOR_FILE = bench.REPO_ROOT / "data" / "anchors" / "vllm_dense_lora_h200.csv"


def anchor_table(path: str | os.PathLike | None = None):
    """vLLM's dense multi-LoRA figures (µs; bf16, R = 32, 8 slots) from :data:`ANCHOR_FILE` (or ``path``): one
    row per (model, proj, T) with H, slices, base_us, lora_us, shrink_us, expand_us, total_us, gbmm_us,
    meta_us, lora_config."""
    import pandas as pd

    a = pd.read_csv(path or ANCHOR_FILE)
    meta = a[(a.impl == "vllm_meta") & (a.part == "metadata_eager")][["T", "median_us"]]
    meta = meta.assign(T=meta["T"].astype(int)).rename(columns={"median_us": "meta_us"})
    d = a[a.model != "-"].copy()
    d["T"], d["H"] = d["T"].astype(int), d["K"].astype(int)
    key = ["model", "proj", "H", "slices", "T"]
    cols = {("cublas", "base"): "base_us", ("vllm", "lora"): "lora_us", ("vllm", "shrink"): "shrink_us"}
    cols |= {
        ("vllm", "expand"): "expand_us",
        ("vllm", "total"): "total_us",
        ("torch_gbmm", "lora"): "gbmm_us",
    }
    series = [
        d[(d.impl == i) & (d.part == p)].set_index(key).median_us.rename(n) for (i, p), n in cols.items()
    ]
    t = pd.concat(series, axis=1, join="outer")
    t = t.join(d[(d.impl == "vllm") & (d.part == "lora")].set_index(key).config.rename("lora_config"))
    t = t.reset_index().merge(meta, on="T", how="left")
    return t.sort_values(["model", "proj", "T"], ignore_index=True)


#: The targets on the final stage's LoRA part, over t_lo ≤ T ≤ t_hi.
TARGETS: dict[str, dict[str, Any]] = {
    "vs_vllm_small_T": dict(t_lo=0, t_hi=64, kind="speedup", threshold=3.0, vs="vllm"),
    "vs_vllm_large_T": dict(t_lo=1600, t_hi=None, kind="speedup", threshold=1.5, vs="vllm"),
    "share_of_base_small_T": dict(t_lo=0, t_hi=64, kind="share", threshold=0.15, vs="base"),
    "share_of_base_large_T": dict(t_lo=1600, t_hi=None, kind="share", threshold=0.08, vs="base"),
    "vs_torch": dict(t_lo=64, t_hi=None, kind="speedup", threshold=3.0, vs="torch"),
}


def summary_table(df, anchors=None, *, final: str = "tuned"):
    """One row per (model, proj, slices, T) of the timing rows ``df``: base, ``lora_<stage>``, lora,
    lora_floor, total, torch_loop, torch_gbmm, torch_best, share, x_torch; with ``anchors`` vllm_base,
    vllm_lora, vllm_total, x_vllm, vllm_share."""
    import numpy as np

    key = ["model", "proj", "slices", "T"]
    d = df[df.part.isin(["base", "lora", "total"])]
    d = d.assign(slices=d.slices.astype(str))  # "2880" may come back from a CSV as an int

    def med(rows, col, name):
        return rows.groupby(key)[col].median().rename(name)

    out = med(d[d.part == "base"], "us_p50", "base").to_frame()
    ours = d[(d.part == "lora") & d.stage.notna()]
    for st, g in ours.groupby("stage", sort=False):
        out = out.join(med(g, "us_p50", f"lora_{st}"), how="outer")
    fin = ours[ours.stage == final]
    out = out.join(med(fin, "us_p50", "lora")).join(med(fin, "floor_us", "lora_floor"))
    out = out.join(med(d[(d.part == "total") & (d.stage == final)], "us_p50", "total"))
    for impl in BASELINES:
        out = out.join(med(d[(d.part == "lora") & (d.impl == impl)], "us_p50", impl))
    out = out.reset_index()
    for c in ("lora", "total", *BASELINES):
        if c not in out:
            out[c] = np.nan
    out["torch_best"] = out[list(BASELINES)].min(axis=1, skipna=True)
    out["share"] = out["lora"] / out["base"]
    out["x_torch"] = out["torch_best"] / out["lora"]
    if anchors is not None and len(anchors):
        a = anchors[["model", "proj", "T", "base_us", "lora_us", "total_us"]]
        a = a.rename(columns={"base_us": "vllm_base", "lora_us": "vllm_lora", "total_us": "vllm_total"})
        out = out.merge(a, on=["model", "proj", "T"], how="left")
        out["x_vllm"] = out["vllm_lora"] / out["lora"]
        out["vllm_share"] = out["vllm_lora"] / out["vllm_base"]
    return out.sort_values(["model", "proj", "T"], ignore_index=True)


def targets_table(summary):
    """:data:`TARGETS` at every row of ``summary`` where they apply: target, model, proj, T, ours_us, ref_us,
    value, threshold, kind, met."""
    import pandas as pd

    cols = ["target", "model", "proj", "T", "ours_us", "ref_us", "value", "threshold", "kind", "met"]
    ref_col = {"vllm": "vllm_lora", "base": "base", "torch": "torch_best"}
    rows = []
    for name, t in TARGETS.items():
        col = ref_col[t["vs"]]
        if col not in summary:
            continue
        sel = summary[(summary["T"] >= t["t_lo"]) & (summary["T"] <= (t["t_hi"] or math.inf))]
        for r in sel.itertuples(index=False):
            ours, ref = r.lora, getattr(r, col)
            if not (math.isfinite(ours) and math.isfinite(ref)) or ours <= 0:
                continue
            speedup = t["kind"] == "speedup"
            value = ref / ours if speedup else ours / ref
            met = value >= t["threshold"] if speedup else value <= t["threshold"]
            rows.append(
                (name, r.model, r.proj, int(r.T), ours, ref, value, t["threshold"], t["kind"], bool(met))
            )
    return pd.DataFrame(rows, columns=cols)
