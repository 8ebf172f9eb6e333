"""Dense multi-LoRA measurement layer (notebook 10) on top of :mod:`moelora_lib.studies.bench`.

What it gives the notebook (no timing code of its own: every timing goes through
:func:`moelora_lib.studies.bench.time_fn`):

* :data:`MODELS` / :func:`projections` / :func:`get_projection` — the attention (qkv, o) and dense-MLP
  (gate_up, down) projections of GPT-OSS-20B, Qwen3-30B-A3B, Qwen3-32B and Llama-3.3-70B, built from
  each model's hidden size, head counts and MLP width (they match the shapes of vLLM's anchor table
  :data:`ANCHOR_FILE` exactly; a test checks it), plus ``tiny`` shapes for the CPU profile.
* :func:`make_inputs` — seeded inputs of one projection (x, the fused base weight, L adapters of rank
  R with the scaling folded into B), generated on the target device in the target dtype (no fp32 copy
  on the host: a Llama-3.3-70B gate_up weight is 0.94 GB in bf16); :meth:`ProjectionInputs.lora_ids`
  gives the adapter slot of each token for a pattern of :func:`moelora_lib.workloads.adapter_ids`.
* :func:`part_costs` — FLOPs, minimal bytes and the H200 floor of the base GEMM, the LoRA part and
  their sum (:mod:`moelora_lib.hardware` ceilings).
* :func:`bench_projection` — one stage at one T: the base alone (``F.linear``, cuBLAS), the LoRA part
  alone (shrink + expand with a precomputed adapter alignment, adding into a copy of the base output:
  vLLM's ``add_lora_linear`` measured the same way) and the total (:class:`moelora_lib.lora_linear.
  LoRALinear`'s forward: ``F.linear`` + the Triton token→adapter alignment + shrink + expand, all in one
  CUDA graph).
* :func:`bench_baselines` — the two torch baselines of the LoRA part, timed the same way: a loop over
  adapters (gather its tokens, x·Aᵀ·Bᵀ, ``index_add_``) and a gather + bmm (each token's A and B
  gathered, two batched matmuls).
* :func:`bench_alignment` — the token→adapter alignment alone (what "total" adds to base + LoRA).
* :func:`check_projection` — every stage (LoRA part), the module (total) and both baselines against
  :func:`moelora_lib.lora_linear.lora_linear_reference` on the same inputs, with tokens without an
  adapter checked bit for bit against ``F.linear``.
* :func:`anchor_table` — vLLM's dense multi-LoRA figures on the same H200.
* :func:`summary_table` / :func:`targets_table` — the per-point table and the issue's targets, shared by
  the notebook and its conclusion (:mod:`moelora_lib.studies.conclusions.nb10`).

Method (GPU): CUDA graph captured once and replayed, ``triton.testing.do_bench`` median with p20/p80,
L2 flushed before every repetition — the method of the anchor table (docs/anchors-h200.md). The
alignment of the LoRA part and the torch baselines' index lists are built before timing (vLLM's
figures exclude its token→adapter metadata step too); "total" includes the alignment. On the CPU
(Triton interpreter) rows say ``mode = "cpu-interpreter"``: interpreter wall clock, never kernel
performance.

Units: ``ms_p50/p20/p80`` in ms, ``us_p50`` and ``floor_us`` in µs; FLOPs count 2 per multiply-add;
bytes are read + written. Letters: T tokens, H the input width (K of the anchor table), N the fused
output width (Σ of the slices), S slices, L adapter slots, R rank.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..common import dtype_name
from ..kernels import STAGES
from ..kernels.dense_lora import (
    adapt_dense_config,
    dense_config_for,
    dense_expand,
    dense_lora_add,
    dense_shrink,
)
from ..lora_linear import LoRALinear, _align_oneshot, lora_linear_reference
from ..shapes import DENSE_CPU_MODELS, DENSE_GPU_MODELS, DENSE_PRESETS, DenseModel, DenseProjection
from ..testing import TOLERANCES
from ..workloads import adapter_ids
from . import bench

__all__ = [
    "MODELS",
    "TINY_MODELS",
    "ModelDims",
    "Projection",
    "projections",
    "get_projection",
    "ProjectionInputs",
    "make_inputs",
    "part_costs",
    "LoRAPart",
    "TorchLoop",
    "TorchGatherBmm",
    "build_module",
    "bench_projection",
    "bench_baselines",
    "bench_alignment",
    "bench_kernels",
    "check_projection",
    "ANCHOR_FILE",
    "ANCHOR_SOURCE",
    "anchor_table",
    "summary_table",
    "targets_table",
    "TARGETS",
    "BASELINES",
    "PARTS",
    "free_memory",
    "predicted_seconds",
    "check_projections",
    "check_in_subprocesses",
]

#: Parts of one projection call that :func:`bench_projection` times.
PARTS = ("base", "lora", "total")
#: The torch baselines (impl names of their rows).
BASELINES = ("torch_loop", "torch_gbmm")

# ------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------


#: One model's dense sizes (:class:`moelora_lib.shapes.DenseModel`: name, hidden, q/kv heads, head_dim,
#: intermediate or None) and one fused projection (:class:`moelora_lib.shapes.DenseProjection`: model,
#: proj, hidden, slices; ``name`` = ``"<model>/<proj>"``, ``n_total``, ``slices_str``).
ModelDims = DenseModel
Projection = DenseProjection

#: The four models of the issue: GPT-OSS-20B and Qwen3-30B-A3B (attention only: their MLPs are MoE),
#: Qwen3-32B and Llama-3.3-70B (attention and dense MLP) — :data:`moelora_lib.shapes.DENSE_PRESETS`.
MODELS: dict[str, ModelDims] = {m: DENSE_PRESETS[m] for m in DENSE_GPU_MODELS}
#: Tiny shapes for the CPU profile (Triton interpreter): GQA qkv 48 → 64 + 16 + 16, o 64 → 48 and a
#: gate_up / down of width 96 (96 is not a multiple of BLOCK_SIZE_K 64: the masked K loop).
TINY_MODELS: dict[str, ModelDims] = {m: DENSE_PRESETS[m] for m in DENSE_CPU_MODELS}


def _all_models() -> dict[str, ModelDims]:
    return {**MODELS, **TINY_MODELS}


def projections(model: str | ModelDims) -> list[Projection]:
    """The projections of ``model`` (a name of :data:`MODELS` / :data:`TINY_MODELS`): qkv (q heads·d,
    kv heads·d, kv heads·d from the hidden size), o (q heads·d → hidden) and, with a dense MLP,
    gate_up (hidden → 2 × intermediate) and down (intermediate → hidden)
    (:meth:`moelora_lib.shapes.DenseModel.projections`).

    Raises ValueError naming the argument for an unknown model.
    """
    if isinstance(model, str):
        models = _all_models()
        if model not in models:
            raise ValueError(f"model: expected one of {sorted(models)}, got {model!r}")
        model = models[model]
    return model.projections()


def get_projection(name: str | Projection) -> Projection:
    """A :class:`Projection` by ``"<model>/<proj>"`` (e.g. ``"qwen3-32b/gate_up"``); a Projection is
    returned as is. Raises ValueError naming the argument for an unknown name."""
    if isinstance(name, Projection):
        return name
    if not isinstance(name, str) or "/" not in name:
        raise ValueError(f"projection: expected '<model>/<proj>', got {name!r}")
    model, proj = name.split("/", 1)
    for p in projections(model):
        if p.proj == proj:
            return p
    raise ValueError(
        f"projection: {model} has no projection {proj!r} (have {[p.proj for p in projections(model)]})"
    )


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass
class ProjectionInputs:
    """Seeded inputs of one projection, sized for ``max_tokens`` (a call at T uses ``x[:T]``).

    Attributes:
        proj: the :class:`Projection`.
        x: [max_tokens, H] ~ N(0, 1).
        weight: [N, H] ~ N(0, 1/H) (the fused base weight, nn.Linear layout).
        lora_a: [L, S, R, H] ~ N(0, 1/H).
        lora_b: [L, N, R] ~ N(0, 1/R) × scaling (folded).
        seed: the seed the tensors and the adapter ids derive from.
        scaling: the LoRA scaling folded into B (lora_alpha / r).
    """

    proj: Projection
    x: torch.Tensor
    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    seed: int
    scaling: float

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def L(self) -> int:
        return self.lora_a.shape[0]

    @property
    def R(self) -> int:
        return self.lora_a.shape[2]

    @property
    def max_tokens(self) -> int:
        return self.x.shape[0]

    def x_for(self, T: int) -> torch.Tensor:
        """x[:T] (contiguous rows of the one x); ValueError if T exceeds max_tokens."""
        if not 0 < T <= self.max_tokens:
            raise ValueError(f"T = {T} must be in [1, max_tokens = {self.max_tokens}]")
        return self.x[:T]

    def lora_ids(self, T: int, pattern: str = "uniform") -> torch.Tensor:
        """[T] int32 on the device: the adapter slot of each token for ``pattern`` ("uniform": tokens
        spread evenly over the L slots, as in the anchor table; "mixed": every slot plus about a
        third of the tokens without adapter, -1; see :func:`moelora_lib.workloads.adapter_ids`), seeded
        by (seed, T)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + T)
        return adapter_ids(T, self.L, pattern, g).to(device=self.device, dtype=torch.int32)


def _randn(shape, std: float, g: torch.Generator, dtype, device) -> torch.Tensor:
    t = torch.randn(shape, generator=g, dtype=dtype, device=device)
    return t.mul_(std)


def make_inputs(
    proj: str | Projection,
    max_tokens: int,
    *,
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
    scaling: float = 2.0,
) -> ProjectionInputs:
    """Seeded inputs of ``proj`` (see :class:`ProjectionInputs`), generated on ``device`` directly in
    ``dtype`` with a generator of that device seeded by ``seed`` (the same seed gives the same tensors
    on the same device; CPU and GPU streams differ). Memory: x, weight and adapters only (a Llama-3.3-70B
    gate_up: 0.94 GB of weight, 0.13 GB of x at 8192 tokens, 30 MB of adapters in bf16).
    """
    p = get_projection(proj)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(int(seed))
    H, N, S = p.hidden, p.n_total, len(p.slices)
    kw = dict(g=g, dtype=dtype, device=dev)
    weight = _randn((N, H), H**-0.5, **kw)
    lora_a = _randn((adapters, S, rank, H), H**-0.5, **kw)
    lora_b = _randn((adapters, N, rank), rank**-0.5 * scaling, **kw)
    x = _randn((max_tokens, H), 1.0, **kw)
    return ProjectionInputs(p, x, weight, lora_a, lora_b, int(seed), float(scaling))


# ------------------------------------------------------------------------------------------------
# FLOPs and bytes
# ------------------------------------------------------------------------------------------------


def _touched(lora_ids: torch.Tensor | None, T: int, L: int) -> tuple[int, int]:
    """(tokens with an adapter, distinct adapters touched)."""
    if lora_ids is None:
        return T, min(T, L)
    ids = lora_ids.detach().cpu()
    keep = ids[ids >= 0]
    return int(keep.numel()), int(torch.unique(keep).numel())


def part_costs(
    proj: str | Projection,
    T: int,
    *,
    rank: int = 32,
    adapters: int = 8,
    dtype_bytes: int = 2,
    lora_ids: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """FLOPs, minimal bytes and the H200 floor of the parts of one projection call at T tokens.

    Returns ``{"base", "shrink", "expand", "lora", "total"}`` -> dict with flops, bytes, floor_us (the
    larger of bytes at :data:`~moelora_lib.hardware.H200_COPY_TB_PER_S` and FLOPs at
    :data:`~moelora_lib.hardware.H200_BF16_TFLOPS`) and bound ("memory" or "compute").

    Bytes counted (each tensor read or written once; T_a tokens with an adapter, n_a adapters touched,
    counted from ``lora_ids`` when given, else T_a = T and n_a = min(T, L)):
        base:   W [N, H] + x [T, H] + y [T, N] written.
        shrink: A of the touched adapters (n_a·S·R·H) + x rows [T_a, H] + the fp32 rank intermediate
                [T_a, S·R] written.
        expand: B of the touched adapters (n_a·N·R) + the intermediate read + y rows [T_a, N] read and
                written (the add into the base output).
        lora:   shrink + expand.  total: base + lora (a LoRA fused into the base GEMM's epilogue would
                save the y round trip).
    """
    p = get_projection(proj)
    H, N, S, R = p.hidden, p.n_total, len(p.slices), rank
    b, f32 = dtype_bytes, 4
    Ta, na = _touched(lora_ids, T, adapters)
    raw = {
        "base": (2 * T * H * N, N * H * b + T * H * b + T * N * b),
        "shrink": (2 * Ta * H * S * R, na * S * R * H * b + Ta * H * b + Ta * S * R * f32),
        "expand": (2 * Ta * R * N, na * N * R * b + Ta * S * R * f32 + 2 * Ta * N * b),
    }
    raw["lora"] = tuple(x + y for x, y in zip(raw["shrink"], raw["expand"]))
    raw["total"] = tuple(x + y for x, y in zip(raw["base"], raw["lora"]))
    out = {}
    for part, (fl, by) in raw.items():
        t_mem, t_cmp = bench.copy_bandwidth_floor_us(by), bench.compute_floor_us(fl)
        out[part] = dict(
            flops=int(fl),
            bytes=int(by),
            floor_us=max(t_mem, t_cmp),
            bound="memory" if t_mem >= t_cmp else "compute",
        )
    return out


# ------------------------------------------------------------------------------------------------
# The timed callables
# ------------------------------------------------------------------------------------------------


class LoRAPart:
    """The LoRA part of one stage at T tokens: shrink + expand (+ the delta fill and add in stages
    without fused add) adding into ``out``, a private copy of the base output, with the alignment,
    the fp32 rank intermediate and the delta buffer built once (as :class:`LoRALinear` holds them).

    ``part()`` launches it (returns ``out``); ``reset()`` copies the base output back into ``out``, so
    ``reset(); part()`` gives one call's result (the timing calls keep adding into ``out``).
    Attributes: cfg (the stage's config before its adapt), launched (after it: what the kernels get),
    base, out, align.
    """

    def __init__(self, stage: str, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor, config=None):
        st = STAGES[stage]
        p = inp.proj
        self.stage, self.slices = st, p.slices
        self.x = inp.x_for(T)
        self.lora_a, self.lora_b = inp.lora_a, inp.lora_b
        self.cfg = config or dense_config_for(
            st, T, hidden=p.hidden, slices=p.slices, rank=inp.R, adapters=inp.L
        )
        self.launched = adapt_dense_config(st, self.cfg)  # what the stage launches (for the rows)
        self.align = _align_oneshot(lora_ids, inp.L, self.cfg.block_size_m)
        self.base = F.linear(self.x, inp.weight)
        self.out = self.base.clone()
        S = len(p.slices)
        self.inter = torch.zeros((T, S * inp.R), dtype=torch.float32, device=inp.device)
        ddt = torch.float32 if inp.dtype == torch.float16 else inp.dtype
        self.delta = None if st.fused_add else torch.empty((T, p.n_total), dtype=ddt, device=inp.device)

    def reset(self) -> None:
        self.out.copy_(self.base)

    def shrink(self) -> torch.Tensor:
        """The shrink launch alone (as :func:`dense_lora_add` makes it; zeroes the intermediate first
        under split-K); returns the fp32 intermediate."""
        st, c = self.stage, self.launched
        return dense_shrink(
            self.x,
            self.lora_a,
            self.align,
            c.shrink,
            use_even_k=st.even_k,
            specialize_lengths=st.specialize_lengths,
            inter=self.inter,
        )

    def expand(self) -> torch.Tensor:
        """The expand launch alone: adding into ``out`` (fused add) or storing into the delta buffer
        (the fill and the torch add of those stages are not in it); reads the intermediate of the last
        :meth:`shrink`."""
        st, c = self.stage, self.launched
        return dense_expand(
            self.inter,
            self.lora_b,
            self.out if st.fused_add else self.delta,
            self.align,
            c.expand,
            slices=self.slices,
            add_inputs=st.fused_add,
            use_even_k=st.even_k,
            specialize_lengths=st.specialize_lengths,
        )

    def __call__(self) -> torch.Tensor:
        return dense_lora_add(
            self.stage,
            self.out,
            self.x,
            self.lora_a,
            self.lora_b,
            self.align,
            self.cfg,
            slices=self.slices,
            inter=self.inter,
            delta=self.delta,
        )


class _TorchBaseline:
    """Shared set-up of the torch baselines: x[:T], the base output and a private copy to add into;
    the tokens with an adapter (index list built on the host before timing, like vLLM's metadata)."""

    def __init__(self, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor):
        p = inp.proj
        self.x = inp.x_for(T)
        self.slices, self.offsets = p.slices, [sum(p.slices[:s]) for s in range(len(p.slices) + 1)]
        self.lora_a, self.lora_b = inp.lora_a, inp.lora_b
        self.base = F.linear(self.x, inp.weight)
        self.out = self.base.clone()
        L, S, R, H = inp.lora_a.shape
        self.a3 = inp.lora_a.reshape(L, S * R, H)
        self.R = R
        self.ids = lora_ids

    def reset(self) -> None:
        self.out.copy_(self.base)


class TorchLoop(_TorchBaseline):
    """Torch baseline 1, a loop over adapters: for each adapter with tokens, gather its rows of x,
    shrink (x_a·A[a]ᵀ for all slices at once), expand slice by slice into a delta [T_a, N], and
    ``index_add_`` the delta into the output rows. 3 + S launches per adapter; bf16 intermediate."""

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
            xa = self.x.index_select(0, rows)
            shrunk = xa @ self.a3[a].T  # [T_a, S·R]
            delta = torch.empty((rows.numel(), o[-1]), dtype=self.out.dtype, device=self.out.device)
            for s in range(len(self.slices)):
                r0 = s * self.R
                torch.matmul(
                    shrunk[:, r0 : r0 + self.R],
                    self.lora_b[a, o[s] : o[s + 1]].T,
                    out=delta[:, o[s] : o[s + 1]],
                )
            self.out.index_add_(0, rows, delta)
        return self.out


class TorchGatherBmm(_TorchBaseline):
    """Torch baseline 2, gather + bmm: each token's A (all slices, [S·R, H]) and, slice by slice, its
    B ([N_s, R]) gathered by its adapter id, then two batched matmuls per slice; the delta is added
    into the output rows of the tokens with an adapter (all of them with uniform ids). Memory: the
    gathered B of one slice is T·N_s·R elements (15 GiB for Llama-3.3-70B gate_up at T = 8192)."""

    def __init__(self, inp: ProjectionInputs, T: int, lora_ids: torch.Tensor):
        super().__init__(inp, T, lora_ids)
        ids = lora_ids.detach().cpu()
        keep = (ids >= 0).nonzero().squeeze(1)
        self.all_rows = keep.numel() == T
        self.rows = keep.to(inp.device)
        self.sel = lora_ids[self.rows].long() if not self.all_rows else lora_ids.long()

    def __call__(self) -> torch.Tensor:
        o = self.offsets
        xs = self.x if self.all_rows else self.x.index_select(0, self.rows)
        shrunk = torch.bmm(self.a3[self.sel], xs.unsqueeze(2))  # [T_a, S·R, 1]
        for s in range(len(self.slices)):
            r0 = s * self.R
            b_tok = self.lora_b[self.sel, o[s] : o[s + 1]]  # [T_a, N_s, R]
            d = torch.bmm(b_tok, shrunk[:, r0 : r0 + self.R]).squeeze(2)  # [T_a, N_s]
            del b_tok
            if self.all_rows:
                self.out[:, o[s] : o[s + 1]] += d
            else:
                self.out[:, o[s] : o[s + 1]].index_add_(0, self.rows, d)
        return self.out


_BASELINE_CLASSES = {"torch_loop": TorchLoop, "torch_gbmm": TorchGatherBmm}


def build_module(inp: ProjectionInputs, stage: str = "tuned", *, max_tokens: int | None = None) -> LoRALinear:
    """A :class:`~moelora_lib.lora_linear.LoRALinear` of ``stage`` on ``inp``'s weight (shared, not
    copied) with ``inp``'s L adapters loaded through ``load_adapter`` (scaling 1: it is folded in B
    already); ``max_tokens`` defaults to inp.max_tokens."""
    p = inp.proj
    m = LoRALinear(
        inp.weight,
        slices=p.slices,
        num_adapters=inp.L,
        max_rank=inp.R,
        max_tokens=max_tokens or inp.max_tokens,
        stage=stage,
    )
    o = [sum(p.slices[:s]) for s in range(len(p.slices) + 1)]
    for a in range(inp.L):
        m.load_adapter(
            a,
            [inp.lora_a[a, s] for s in range(len(p.slices))],
            [inp.lora_b[a, o[s] : o[s + 1]] for s in range(len(p.slices))],
            scaling=1.0,
        )
    return m


# ------------------------------------------------------------------------------------------------
# Benchmarks
# ------------------------------------------------------------------------------------------------


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _fields(inp: ProjectionInputs, T: int, pattern: str) -> dict[str, Any]:
    p = inp.proj
    return dict(
        model=p.model,
        proj=p.proj,
        H=p.hidden,
        N=p.n_total,
        slices=p.slices_str,
        S=len(p.slices),
        T=T,
        L=inp.L,
        R=inp.R,
        dtype=dtype_name(inp.dtype),
        pattern=pattern,
    )


def _timing(fn, device, mode: str, warmup_ms: float, rep_ms: float, min_reps=None) -> dict[str, Any]:
    """Time ``fn`` (:func:`moelora_lib.studies.bench.time_fn`; on the CPU mode "cpu-interpreter":
    interpreter wall clock, not kernel performance): a row's mode, ms_p50, ms_p20, ms_p80, us_p50."""
    m = "cpu-interpreter" if torch.device(device).type == "cpu" else mode
    tm = bench.time_fn(fn, m, device, warmup_ms, rep_ms, min_reps=min_reps)
    return dict(mode=m, ms_p50=tm.ms_p50, ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, us_p50=tm.ms_p50 * 1e3)


def _time_row(
    fn,
    inp,
    T,
    pattern,
    *,
    impl,
    stage,
    part,
    cost,
    config,
    config_source,
    mode,
    warmup_ms,
    rep_ms,
    min_reps=None,
    block_size_m=None,
):
    return bench.result_row(
        **_fields(inp, T, pattern),
        impl=impl,
        stage=stage,
        part=part,
        config=config,
        config_source=config_source,
        block_size_m=block_size_m,
        **_timing(fn, inp.device, mode, warmup_ms, rep_ms, min_reps),
        flops=cost["flops"],
        bytes=cost["bytes"],
        floor_us=cost["floor_us"],
        bound=cost["bound"],
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        min_reps=min_reps,
    )


def _inputs_for(proj, T, inputs, **kw) -> ProjectionInputs:
    if inputs is not None:
        if inputs.proj != get_projection(proj):
            raise ValueError(f"inputs are for {inputs.proj.name}, not {get_projection(proj).name}")
        return inputs
    return make_inputs(proj, T, **kw)


def _point(proj, T, inputs, pattern, **kw) -> tuple[ProjectionInputs, torch.Tensor, dict[str, dict]]:
    """(inputs, adapter ids of ``pattern``, :func:`part_costs`) of one timed point."""
    inp = _inputs_for(proj, T, inputs, **kw)
    ids = inp.lora_ids(T, pattern)
    costs = part_costs(
        inp.proj, T, rank=inp.R, adapters=inp.L, dtype_bytes=inp.x.element_size(), lora_ids=ids
    )
    return inp, ids, costs


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")


def _stage_fields(stage: str, cfg, launched=None) -> dict[str, Any]:
    """The row fields of a stage's launch with ``cfg`` (``launched``: the config after the stage's
    adapt, when it is not ``cfg``)."""
    shown = cfg if launched is None else launched
    return dict(
        impl=stage, stage=stage, config=shown.short(), config_source=cfg.source, block_size_m=cfg.block_size_m
    )


def bench_projection(
    stage: str,
    proj: str | Projection,
    T: int,
    *,
    parts: Sequence[str] = PARTS,
    inputs: ProjectionInputs | None = None,
    module: LoRALinear | None = None,
    pattern: str = "uniform",
    mode: str = "graph",
    config=None,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    min_reps: int | None = None,
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time the parts of one projection call of ``stage`` at T tokens; one row per part.

    Parts: "base" = ``F.linear(x, W)`` (cuBLAS; impl "cublas", the same kernel for every stage);
    "lora" = :class:`LoRAPart` (shrink + expand into a copy of the base output, alignment prebuilt);
    "total" = the :class:`~moelora_lib.lora_linear.LoRALinear` forward of ``stage`` (``F.linear`` +
    alignment + LoRA in one graph; ``module`` reuses one built by :func:`build_module` for this stage,
    else one is built for this call).
    Inputs: ``inputs`` (from :func:`make_inputs`, reused across T), else generated from the keywords.
    ``config``: a DenseLoRAConfig for the LoRA part (None = the stage's, :func:`dense_config_for`).
    Every callable runs once before timing (compilation, untimed).

    Returns rows (:func:`moelora_lib.studies.bench.result_row`) with model, proj, H, N, slices, S, T,
    L, R, dtype, pattern, impl, stage, part, config, config_source, block_size_m (the alignment's, None
    for the base), mode, ms_p50, ms_p20, ms_p80, us_p50, flops, bytes, floor_us, bound, warmup_ms,
    rep_ms, min_reps (:func:`moelora_lib.studies.bench.time_cuda`'s) and the environment columns.
    """
    _check_stage(stage)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"parts must be in {PARTS}, got {bad}")
    kw = dict(rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed)
    inp, ids, costs = _point(proj, T, inputs, pattern, **kw)
    x = inp.x_for(T)
    common = dict(mode=mode, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)
    rows = []
    for part in parts:
        if part == "base":
            fn = lambda w=inp.weight: F.linear(x, w)  # noqa: E731
            kw = dict(impl="cublas", stage=None, config=None, config_source=None)
        elif part == "lora":
            fn = LoRAPart(stage, inp, T, ids, config)
            kw = _stage_fields(stage, fn.cfg, fn.launched)
        else:
            mod = module if module is not None else build_module(inp, stage, max_tokens=T)
            if mod.stage.name != stage:
                raise ValueError(f"module is of stage {mod.stage.name!r}, not {stage!r}")
            fn = lambda m=mod: m(x, ids)  # noqa: E731
            kw = _stage_fields(stage, mod.config_for(T))
        fn()  # compile outside the timed region
        _sync(inp.device)
        rows.append(_time_row(fn, inp, T, pattern, part=part, cost=costs[part], **kw, **common))
        del fn
    return rows


def bench_baselines(
    proj: str | Projection,
    T: int,
    *,
    impls: Sequence[str] = BASELINES,
    inputs: ProjectionInputs | None = None,
    pattern: str = "uniform",
    mode: str = "graph",
    warmup_ms: float = 25,
    rep_ms: float = 100,
    min_reps: int | None = None,
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time the torch baselines' LoRA part (``impls`` ⊂ :data:`BASELINES`: :class:`TorchLoop`,
    :class:`TorchGatherBmm`) at T tokens, the same way as :func:`bench_projection` (rows with part
    "lora", stage None; same columns)."""
    bad = [i for i in impls if i not in BASELINES]
    if bad:
        raise ValueError(f"impls must be in {BASELINES}, got {bad}")
    kw = dict(rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed)
    inp, ids, costs = _point(proj, T, inputs, pattern, **kw)
    common = dict(
        stage=None,
        config=None,
        config_source=None,
        mode=mode,
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        min_reps=min_reps,
    )
    rows = []
    for impl in impls:
        fn = _BASELINE_CLASSES[impl](inp, T, ids)
        fn()
        _sync(inp.device)
        rows.append(_time_row(fn, inp, T, pattern, impl=impl, part="lora", cost=costs["lora"], **common))
        del fn
    return rows


def bench_kernels(
    stage: str,
    proj: str | Projection,
    T: int,
    *,
    inputs: ProjectionInputs | None = None,
    pattern: str = "uniform",
    mode: str = "graph",
    warmup_ms: float = 25,
    rep_ms: float = 100,
    min_reps: int | None = None,
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time the two launches of ``stage``'s LoRA part alone (:meth:`LoRAPart.shrink`,
    :meth:`LoRAPart.expand`): rows like :func:`bench_projection`'s with part "shrink" / "expand" and
    each kernel's own FLOPs, bytes and floor — the per-kernel numbers that explain a missed target
    (vLLM's are in :func:`anchor_table`: shrink_us, expand_us)."""
    _check_stage(stage)
    kw = dict(rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed)
    inp, ids, costs = _point(proj, T, inputs, pattern, **kw)
    lp = LoRAPart(stage, inp, T, ids)
    lp.shrink()
    lp.expand()
    _sync(inp.device)
    common = dict(
        **_stage_fields(stage, lp.cfg, lp.launched),
        mode=mode,
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        min_reps=min_reps,
    )
    return [
        _time_row(fn, inp, T, pattern, part=part, cost=costs[part], **common)
        for part, fn in (("shrink", lp.shrink), ("expand", lp.expand))
    ]


def bench_alignment(
    T: int,
    *,
    block_size_m: int,
    adapters: int = 8,
    pattern: str = "uniform",
    mode: str = "graph",
    warmup_ms: float = 25,
    rep_ms: float = 100,
    min_reps: int | None = None,
    device="cuda",
    seed: int = 0,
) -> dict[str, Any]:
    """Time the token→adapter alignment of T tokens alone (what :class:`LoRALinear` launches before
    the shrink: one Triton launch up to 1024 tokens, three above; the torch oracle on the CPU).
    Returns one row with impl "align", part "align", T, L, block_size_m, mode, ms_p50/p20/p80, us_p50."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + T)
    ids = adapter_ids(T, adapters, pattern, g).to(device=device, dtype=torch.int32)
    fn = lambda: _align_oneshot(ids, adapters, block_size_m)  # noqa: E731
    fn()
    _sync(device)
    return bench.result_row(
        impl="align",
        part="align",
        T=T,
        L=adapters,
        block_size_m=block_size_m,
        pattern=pattern,
        **_timing(fn, device, mode, warmup_ms, rep_ms, min_reps),
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        min_reps=min_reps,
    )


# ------------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out − ref| / max|ref|, computed on ref's device in ref's dtype (inf for NaN/inf or a shape
    mismatch): :func:`moelora_lib.testing.rel_err` without the copy to the host (GBs at T = 8192)."""
    if out.shape != ref.shape:
        return float("inf")
    o = out.to(ref.dtype)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    den = ref.abs().max().clamp_min(1e-30)
    return float((o - ref).abs().max() / den) if ref.numel() else 0.0


def check_projection(
    proj: str | Projection,
    T: int,
    *,
    stages: Sequence[str] = tuple(s for s in STAGES if not STAGES[s].fused_gemm),  # fused = tuned (dense)
    module_stages: Sequence[str] = ("tuned",),
    baselines: Sequence[str] = BASELINES,
    inputs: ProjectionInputs | None = None,
    modules: dict[str, LoRALinear] | None = None,
    pattern: str = "mixed",
    ref_dtype: torch.dtype | None = None,
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Every implementation of one projection at T tokens against
    :func:`~moelora_lib.lora_linear.lora_linear_reference` (computed once, in ``ref_dtype``: float64
    on the CPU, float32 on a GPU by default) on the same inputs.

    Checked: the LoRA part of every stage in ``stages`` (one call into the base output), the
    :class:`~moelora_lib.lora_linear.LoRALinear` forward of every stage in ``module_stages`` (part
    "total"; ``modules`` maps stage -> a module built by :func:`build_module`, else one is built) and
    the torch ``baselines``. ``pattern`` "mixed" (default) puts tokens without an adapter in the batch.

    Returns one row per implementation: model, proj, T, ..., impl, part, check="vs_reference",
    rel_err (max|out − ref| / max|ref|), tol (:data:`moelora_lib.testing.TOLERANCES` of the dtype),
    delta_rel (max|ref − ref_base| / max|ref|, so a passing rel_err is not a LoRA never added),
    no_adapter_rows, no_adapter_bitwise (rows of tokens without adapter equal ``F.linear``'s bit for
    bit; True when there are none), config, config_source.
    """
    inp = _inputs_for(proj, T, inputs, rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed)
    p = inp.proj
    ids = inp.lora_ids(T, pattern)
    x = inp.x_for(T)
    if ref_dtype is None:
        ref_dtype = torch.float64 if inp.device.type == "cpu" else torch.float32
    ref = lora_linear_reference(x, inp.weight, inp.lora_a, inp.lora_b, ids, slices=p.slices, dtype=ref_dtype)
    ref_base = x.to(ref_dtype) @ inp.weight.to(ref_dtype).T
    delta_rel = float((ref - ref_base).abs().max() / ref.abs().max().clamp_min(1e-30))
    del ref_base
    base = F.linear(x, inp.weight)
    none = ids < 0
    n_none = int(none.sum())
    tol = TOLERANCES[inp.dtype]

    def row(impl, stage, part, out, cfg=None):
        bitwise = bool(torch.equal(out[none], base[none])) if n_none else True
        return bench.result_row(
            **_fields(inp, T, pattern),
            impl=impl,
            stage=stage,
            part=part,
            check="vs_reference",
            rel_err=_rel_err(out, ref),
            tol=tol,
            delta_rel=delta_rel,
            no_adapter_rows=n_none,
            no_adapter_bitwise=bitwise,
            config=cfg.short() if cfg is not None else None,
            config_source=cfg.source if cfg is not None else None,
        )

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


def check_projections(
    projs: Sequence[str | Projection],
    tokens: Sequence[int],
    *,
    stages: Sequence[str],
    module_stages: Sequence[str] = ("tuned",),
    rank: int = 32,
    adapters: int = 8,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Notebook 10's correctness loop for ``projs``: per projection, inputs for ``max(tokens)``
    (:func:`make_inputs`) and one module per stage of ``module_stages`` (:func:`build_module`), then
    :func:`check_projection` at every T; memory freed before the next projection. Returns the rows in
    (projection, T) order."""
    rows: list[dict[str, Any]] = []
    for p in projs:
        inp = make_inputs(p, max(tokens), rank=rank, adapters=adapters, dtype=dtype, device=device, seed=seed)
        modules = {st: build_module(inp, st) for st in module_stages}
        for T in tokens:
            rows += check_projection(
                p, T, stages=stages, module_stages=module_stages, inputs=inp, modules=modules
            )
        del inp, modules
        free_memory(device)
    return rows


def check_in_subprocesses(
    projs: Sequence[str | Projection],
    tokens: Sequence[int],
    *,
    stages: Sequence[str],
    module_stages: Sequence[str] = ("tuned",),
    jobs: int = 4,
    rank: int = 32,
    adapters: int = 8,
    dtype: str = "bfloat16",
    device: str = "cuda",
    seed: int = 0,
    timeout_s: float = 600,
) -> list[dict[str, Any]]:
    """:func:`check_projections` on the GPU split over ``jobs`` processes side by side
    (``python -m moelora_lib.studies.dense_bench check``; projections dealt round robin, so the two
    whose torch gather baseline peaks at ~15 GB at T = 8192 — Qwen3-32B and Llama-3.3-70B gate_up, four
    apart in :func:`projections` order — fall to one process for ``jobs`` = 2 or 4, and at most two run
    at once otherwise). Same rows, same order, as one process: a check is a computation against the fp32
    reference, not a timing, so running several at once changes no number; and each process compiles its
    projections' kernels into Triton's on-disk cache, which the timing cell then loads instead of
    compiling the ~150 binaries one after another. Raises RuntimeError when a process fails."""
    import json
    import sys
    import tempfile

    names = [get_projection(p).name for p in projs]
    chunks = [names[i :: max(1, jobs)] for i in range(max(1, jobs))]
    chunks = [c for c in chunks if c]
    with tempfile.TemporaryDirectory(prefix="moelora_dense_checks_") as tmp:
        cmds = {}
        for i, chunk in enumerate(chunks):
            cmds[str(i)] = [
                sys.executable,
                "-m",
                "moelora_lib.studies.dense_bench",
                "check",
                "--projs",
                ",".join(chunk),
                "--tokens",
                ",".join(str(int(t)) for t in tokens),
                "--stages",
                ",".join(stages),
                "--module-stages",
                ",".join(module_stages),
                "--rank",
                str(rank),
                "--adapters",
                str(adapters),
                "--dtype",
                dtype,
                "--device",
                str(device),
                "--seed",
                str(seed),
                "--out",
                os.path.join(tmp, f"{i}.json"),
            ]
        bench.run_side_by_side(cmds, timeout_s=timeout_s)
        by_proj: dict[str, list[dict[str, Any]]] = {}
        for i in range(len(chunks)):
            with open(os.path.join(tmp, f"{i}.json")) as f:
                for r in json.load(f):
                    by_proj.setdefault(f"{r['model']}/{r['proj']}", []).append(r)
    return [r for n in names for r in by_proj.get(n, [])]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moelora_lib.studies.dense_bench check --projs M/qkv,M/o --tokens 1,8 --stages a,b
    --out rows.json``: :func:`check_projections` in this process, rows written as JSON."""
    import argparse
    import json

    from ..common import DTYPES

    ap = argparse.ArgumentParser(prog="python -m moelora_lib.studies.dense_bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="notebook 10's correctness checks for some projections")
    c.add_argument("--projs", required=True)
    c.add_argument("--tokens", required=True)
    c.add_argument("--stages", required=True)
    c.add_argument("--module-stages", default="tuned")
    c.add_argument("--rank", type=int, default=32)
    c.add_argument("--adapters", type=int, default=8)
    c.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    c.add_argument("--device", default="cuda")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = check_projections(
        [p for p in a.projs.split(",") if p],
        [int(t) for t in a.tokens.split(",") if t],
        stages=[st for st in a.stages.split(",") if st],
        module_stages=[st for st in a.module_stages.split(",") if st],
        rank=a.rank,
        adapters=a.adapters,
        dtype=DTYPES[a.dtype],
        device=a.device,
        seed=a.seed,
    )
    with open(a.out, "w") as f:
        json.dump(rows, f, default=str)
    return 0


def free_memory(device) -> None:
    """gc + ``torch.cuda.empty_cache()`` on a GPU (between projections: GBs of weights and graph pools)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# vLLM anchors
# ------------------------------------------------------------------------------------------------

#: vLLM's dense multi-LoRA ops (``lora_shrink`` / ``lora_expand``) measured on the same H200.
ANCHOR_FILE = bench.REPO_ROOT / "data" / "anchors" / "vllm_dense_lora_h200.csv"
ANCHOR_SOURCE = "data/anchors/vllm_dense_lora_h200.csv (method: docs/anchors-h200.md, last section)"


def anchor_table(path: str | os.PathLike | None = None):
    """vLLM's dense multi-LoRA figures on the H200 (µs, CUDA-graph replay, do_bench median, L2 flushed
    every rep; bf16, R = 32, 8 adapter slots, tokens spread evenly), from :data:`ANCHOR_FILE` (``path``
    overrides it).

    One row per (model, proj, T) with H (the file's K), slices ("4096+512+512"), base_us (cuBLAS
    ``F.linear``), lora_us (vLLM's ``add_lora_linear``: shrink + expand adding into the base output),
    shrink_us, expand_us, total_us (base + LoRA in one graph), gbmm_us (the anchor's torch gather +
    bmm), meta_us (vLLM's per-batch token→adapter metadata step, eager, outside any graph: per T, the
    same for every projection), lora_config (vLLM's kernel settings).
    """
    import pandas as pd

    a = pd.read_csv(path or ANCHOR_FILE)
    meta = a[(a.impl == "vllm_meta") & (a.part == "metadata_eager")][["T", "median_us"]]
    meta = meta.assign(T=meta["T"].astype(int)).rename(columns={"median_us": "meta_us"})
    d = a[a.model != "-"].copy()
    d["T"] = d["T"].astype(int)
    d["H"] = d["K"].astype(int)
    key = ["model", "proj", "H", "slices", "T"]
    cols = {
        ("cublas", "base"): "base_us",
        ("vllm", "lora"): "lora_us",
        ("vllm", "shrink"): "shrink_us",
        ("vllm", "expand"): "expand_us",
        ("vllm", "total"): "total_us",
        ("torch_gbmm", "lora"): "gbmm_us",
    }
    t = None
    for (impl, part), name in cols.items():
        s = d[(d.impl == impl) & (d.part == part)].set_index(key).median_us.rename(name)
        t = s.to_frame() if t is None else t.join(s, how="outer")
    cfg = d[(d.impl == "vllm") & (d.part == "lora")].set_index(key).config.rename("lora_config")
    t = t.join(cfg).reset_index().merge(meta, on="T", how="left")
    return t.sort_values(["model", "proj", "T"], ignore_index=True)


# ------------------------------------------------------------------------------------------------
# Tables shared by the notebook and its conclusion
# ------------------------------------------------------------------------------------------------

#: The issue's targets: the final stage's LoRA part against vLLM's (ratio vLLM ÷ ours) at small and
#: large T, its share of the base projection (ours ÷ base), and against the faster torch baseline.
TARGETS: dict[str, dict[str, Any]] = {
    "vs_vllm_small_T": dict(t_lo=0, t_hi=64, kind="speedup", threshold=3.0, vs="vllm"),
    "vs_vllm_large_T": dict(t_lo=1600, t_hi=None, kind="speedup", threshold=1.5, vs="vllm"),
    "share_of_base_small_T": dict(t_lo=0, t_hi=64, kind="share", threshold=0.15, vs="base"),
    "share_of_base_large_T": dict(t_lo=1600, t_hi=None, kind="share", threshold=0.08, vs="base"),
    "vs_torch": dict(t_lo=64, t_hi=None, kind="speedup", threshold=3.0, vs="torch"),
}


def summary_table(df, anchors=None, *, final: str = "tuned"):
    """One row per (model, proj, T) from the timing rows of the notebook (``df``: the rows of
    :func:`bench_projection` and :func:`bench_baselines` with mode graph or cpu-interpreter).

    Columns: model, proj, slices, T; base (our cuBLAS base, µs); ``lora_<stage>`` for every stage
    timed; lora (the ``final`` stage's LoRA part); total (the final stage's total when timed);
    lora_floor; torch_loop, torch_gbmm, torch_best (the faster baseline); share = lora ÷ base;
    x_torch = torch_best ÷ lora; and with ``anchors`` (:func:`anchor_table`): vllm_base, vllm_lora,
    vllm_total, x_vllm = vllm_lora ÷ lora, vllm_share = vllm_lora ÷ vllm_base.
    """
    import numpy as np

    key = ["model", "proj", "slices", "T"]
    d = df[df.part.isin(["base", "lora", "total"])]
    d = d.assign(slices=d.slices.astype(str))  # "2880" may come back from a CSV as an int
    out = d[d.part == "base"].groupby(key).us_p50.median().rename("base").to_frame()
    ours = d[(d.part == "lora") & d.stage.notna()]
    for st, g in ours.groupby("stage", sort=False):
        out = out.join(g.groupby(key).us_p50.median().rename(f"lora_{st}"), how="outer")
    fin = ours[ours.stage == final]
    out = out.join(fin.groupby(key).us_p50.median().rename("lora"), how="left")
    out = out.join(fin.groupby(key).floor_us.median().rename("lora_floor"), how="left")
    tot = d[(d.part == "total") & (d.stage == final)]
    out = out.join(tot.groupby(key).us_p50.median().rename("total"), how="left")
    for impl in BASELINES:
        g = d[(d.part == "lora") & (d.impl == impl)]
        out = out.join(g.groupby(key).us_p50.median().rename(impl), how="left")
    out = out.reset_index()
    for c in ("lora", "total", *BASELINES):
        if c not in out:
            out[c] = np.nan
    out["torch_best"] = out[list(BASELINES)].min(axis=1, skipna=True)
    out["share"] = out["lora"] / out["base"]
    out["x_torch"] = out["torch_best"] / out["lora"]
    if anchors is not None and len(anchors):
        a = anchors[["model", "proj", "T", "base_us", "lora_us", "total_us"]].rename(
            columns={"base_us": "vllm_base", "lora_us": "vllm_lora", "total_us": "vllm_total"}
        )
        out = out.merge(a, on=["model", "proj", "T"], how="left")
        out["x_vllm"] = out["vllm_lora"] / out["lora"]
        out["vllm_share"] = out["vllm_lora"] / out["vllm_base"]
    return out.sort_values(["model", "proj", "T"], ignore_index=True)


def targets_table(summary):
    """The issue's targets (:data:`TARGETS`) at every (model, proj, T) of ``summary`` (from
    :func:`summary_table`) where they apply and the needed numbers exist.

    Columns: target, model, proj, T, ours_us (the final LoRA part), ref_us (vLLM's LoRA part, our base,
    or the faster torch baseline), value (vLLM ÷ ours, ours ÷ base, or torch ÷ ours), threshold,
    kind ("speedup": met when value ≥ threshold; "share": met when value ≤ threshold), met.
    """
    import pandas as pd

    rows = []
    ref_col = {"vllm": "vllm_lora", "base": "base", "torch": "torch_best"}
    for name, t in TARGETS.items():
        col = ref_col[t["vs"]]
        if col not in summary:
            continue
        sel = summary[summary["T"] >= t["t_lo"]]
        if t["t_hi"] is not None:
            sel = sel[sel["T"] <= t["t_hi"]]
        for _, r in sel.iterrows():
            ours, ref = r["lora"], r[col]
            if not (math.isfinite(ours) and math.isfinite(ref)) or ours <= 0:
                continue
            value = ref / ours if t["kind"] == "speedup" else ours / ref
            met = value >= t["threshold"] if t["kind"] == "speedup" else value <= t["threshold"]
            rows.append(
                dict(
                    target=name,
                    model=r["model"],
                    proj=r["proj"],
                    T=int(r["T"]),
                    ours_us=ours,
                    ref_us=ref,
                    value=value,
                    threshold=t["threshold"],
                    kind=t["kind"],
                    met=bool(met),
                )
            )
    cols = ["target", "model", "proj", "T", "ours_us", "ref_us", "value", "threshold", "kind", "met"]
    return pd.DataFrame(rows, columns=cols)


def predicted_seconds(
    n_graphs: int, n_binaries: int, per_graph_s: float = 0.3, per_binary_s: float = 1.0
) -> float:
    """The run-time estimate the notebook prints before it starts: timed graphs × ``per_graph_s`` +
    new kernel binaries × ``per_binary_s`` (rough: capture, do_bench warm-up and repetitions, Python)."""
    return n_graphs * per_graph_s + n_binaries * per_binary_s


if __name__ == "__main__":
    import sys

    sys.exit(main())
