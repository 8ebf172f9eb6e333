"""What a stage is, the default configs, and the layer forward every stage shares.

A :class:`Stage` is a set of switches over the kernels of :mod:`.triton_kernels`; the stage modules
(``naive.py``, ``no_recompile.py``, ...) each define one and the registry in ``__init__`` lists them.
All stages run through :class:`LayerRun`, so they have the same signature and differ only by their
switches: a later stage never changes what an earlier one computes or how.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ..common import aligned16
from ..configs.defaults import default_config
from ..quant.fp8 import FP8BlockWeight
from ..quant.mxfp4 import MXFP4_BLOCK, MXFP4Weight
from ..routing import Alignment, align_tokens
from ..shapes import Dims
from .config import BASE_OPS, LORA_OPS, LayerConfig, OpConfig
from .fp8_act import FP8Activations, fp8_act_scale_shape, quantize_fp8_act
from .launchers import (
    fused_moe_gemm,
    fused_moe_gemm_args,
    fused_moe_lora,
    fused_moe_lora_args,
    gated_act,
    gated_act_args,
    lora_expand,
    lora_expand_args,
    lora_shrink,
    lora_shrink_args,
    lora_shrink_rows,
    lora_shrink_rows_args,
    rank_stride,
)
from .topk_reduce import topk_reduce

__all__ = [
    "Stage",
    "LayerRun",
    "Launch",
    "LAUNCH_OPS",
    "LAUNCH_KERNELS",
    "FUSED_LAUNCH_KERNELS",
    "FUSED_LAUNCH_OPS",
    "FUSED_CONFIG_FIELD",
    "default_config",
    "aligned_weight",
    "mxfp4_config",
    "fp8_config",
    "w8a8_config",
    "packed_config",
    "config_weight_format",
    "ACTIVATION_SCHEMES",
    "W8A8_MIN_TOKENS",
    "W8A8_MIN_BLOCK_K",
    "check_activation_scheme",
    "resolve_activation_scheme",
]

#: The ``activation_scheme`` values of :class:`~moelora_lib.MoELoRALayer` and
#: :func:`~moelora_lib.fused_moe_lora`: with block-FP8 expert weights, "dynamic" (W8A8: the base GEMMs'
#: activations quantized per token and per group of the weight's scale-block columns at run time,
#: :func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act`, and multiplied on FP8 tensor cores),
#: "weight_only" (the activations stay in the layer's dtype; each e4m3 weight tile is scaled in
#: registers) or "auto" (per call: "dynamic" from :data:`W8A8_MIN_TOKENS` tokens on, else
#: "weight_only"). Dense and MXFP4 weights run as "weight_only" ("auto" included); "dynamic" needs FP8.
ACTIVATION_SCHEMES: tuple[str, ...] = ("auto", "weight_only", "dynamic")

#: The token count from which ``activation_scheme="auto"`` runs W8A8. Measured crossover (an H100 with
#: the default configs, data/dev/h100_20261207/w8a8_bench.csv and nb15/15_layer.csv): W8A8 beats the
#: weight-only base by 1.2–1.4× from 64 tokens on for GPT-OSS-20B and Qwen3-30B-A3B; below, the tiles are
#: too thin for the FP8 tensor cores (BLOCK_SIZE_M < 64 widens e4m3 to 16 bits) and the two
#: quantization launches do not pay, and at T = 1 stage gemv reads the FP8 weights weight-only. A fixed
#: value until the tuned config files record a per-shape one.
W8A8_MIN_TOKENS = 64

#: The smallest BLOCK_SIZE_K of a W8A8 base GEMM: K of one FP8 tensor-core instruction (32 on Hopper).
W8A8_MIN_BLOCK_K = 32


def check_activation_scheme(value, w13, stage_name: str | None = None) -> str:
    """``value`` when it is one of :data:`ACTIVATION_SCHEMES` that the expert weight ``w13`` (and stage
    ``stage_name``, when given) can run; ValueError naming ``activation_scheme`` otherwise: an unknown
    value, "dynamic" with weights that are not :class:`~moelora_lib.quant.FP8BlockWeight` s, with a
    scale block whose columns hold no power of two ≥ :data:`W8A8_MIN_BLOCK_K` (no FP8 K step fits one
    scale column), or with stage "gemv" (its GEMVs are weight-only)."""
    if not isinstance(value, str) or value not in ACTIVATION_SCHEMES:
        raise ValueError(f"activation_scheme must be one of {list(ACTIVATION_SCHEMES)}, got {value!r}")
    if value != "dynamic":
        return value
    if not isinstance(w13, FP8BlockWeight):
        kind = "MXFP4" if isinstance(w13, MXFP4Weight) else "dense"
        raise ValueError(
            "activation_scheme 'dynamic' (W8A8) needs block-FP8 expert weights (FP8BlockWeight w13 and w2), "
            f"got {kind} weights"
        )
    bk = w13.block[1]
    if (bk & -bk) < W8A8_MIN_BLOCK_K:
        raise ValueError(
            f"activation_scheme 'dynamic' (W8A8): the scale block's {bk} columns (w13.block = {w13.block}) "
            f"must be a multiple of {W8A8_MIN_BLOCK_K} (an FP8 dot's K step reads one scale column)"
        )
    if stage_name == "gemv":
        raise ValueError(
            "activation_scheme 'dynamic' (W8A8) does not run in stage 'gemv' (weight-only GEMVs): use "
            "'auto' or 'weight_only', or another stage"
        )
    return value


def resolve_activation_scheme(scheme: str, w13, T: int, min_tokens: int = W8A8_MIN_TOKENS) -> str:
    """The concrete scheme, "weight_only" or "dynamic", of a call of ``T`` tokens under a checked
    ``scheme`` (:func:`check_activation_scheme`): "weight_only" for weights that are not FP8, and for
    "auto" below ``min_tokens`` tokens or where the scale block admits no W8A8 K step."""
    if not isinstance(w13, FP8BlockWeight) or scheme == "weight_only":
        return "weight_only"
    if scheme == "dynamic":
        return "dynamic"
    bk = w13.block[1]
    return "dynamic" if T >= min_tokens and (bk & -bk) >= W8A8_MIN_BLOCK_K else "weight_only"


#: The launches of one layer, in call order, and the kernel each one runs.
LAUNCH_KERNELS: dict[str, str] = {
    "base_gate_up": "fused_moe",
    "gate_up_shrink": "lora_shrink",
    "gate_up_expand": "lora_expand",
    "act": "gated_act",
    "base_down": "fused_moe",
    "down_shrink": "lora_shrink",
    "down_expand": "lora_expand",
}
LAUNCH_OPS: tuple[str, ...] = tuple(LAUNCH_KERNELS)
#: The launches of one layer in a stage with ``fused_gemm`` (stage ``fused``), in call order: each
#: projection's shrink, then its base GEMM with the LoRA expand (and, for gate_up, the activation)
#: inside; the top-k sum follows as in every stage.
FUSED_LAUNCH_KERNELS: dict[str, str] = {
    "gate_up_shrink": "lora_shrink_rows",
    "fused_gate_up": "fused_moe_lora_act",
    "down_shrink": "lora_shrink_rows",
    "fused_down": "fused_moe_lora",
}
FUSED_LAUNCH_OPS: tuple[str, ...] = tuple(FUSED_LAUNCH_KERNELS)
#: Which :class:`LayerConfig` field configures each launch of a ``fused_gemm`` stage (the record is the
#: same six-field one: the fused GEMMs take the base GEMMs' fields, the expand fields are unused).
FUSED_CONFIG_FIELD: dict[str, str] = {
    "gate_up_shrink": "gate_up_shrink",
    "fused_gate_up": "base_gate_up",
    "down_shrink": "down_shrink",
    "fused_down": "base_down",
}


def _stage_from_state(cls: type, state: dict) -> Stage:
    """The registered stage equal to (cls, state), else a new one (a stage defined outside the
    registry)."""
    from . import AUTO_STAGE, GEMV_STAGE, STAGES

    st = object.__new__(cls)
    for k, v in state.items():
        object.__setattr__(st, k, v)
    return next((r for r in (*STAGES.values(), AUTO_STAGE, GEMV_STAGE) if r == st), st)


@dataclass(frozen=True)
class Stage:
    """Switches of one optimization stage.

    Attributes:
        name: registry name.
        title: one line for tables and plots.
        specialize_lengths: True = Triton's default integer specialization (recompiles per length
            class); False = ``do_not_specialize`` on length-dependent arguments.
        split_k: honour the config's SPLIT_K for the shrink ops (else 1).
        swizzle: honour the config's GROUP_SIZE_M for the LoRA ops (else 1, row-major order).
        even_k: unmasked K loops in the LoRA ops when K divides evenly.
        fused_add: expand adds into the output tile it holds; else it writes a zeroed delta buffer
            that a separate torch add puts into the output.
        fused_gemm: the LoRA expand runs inside each projection's base GEMM and the activation in
            the gate_up GEMM's epilogue (:data:`FUSED_LAUNCH_OPS`: four launches and the top-k sum
            instead of seven); the shrinks write a [T·K, S, R16] intermediate (stage ``fused``).
    """

    name: str
    title: str
    specialize_lengths: bool
    split_k: bool = False
    swizzle: bool = False
    even_k: bool = False
    fused_add: bool = False
    fused_gemm: bool = False

    def __reduce__(self):
        # copy, deepcopy and pickle give back the registered stage object itself: the layer and the
        # public call compare stages by identity (``stage is GEMV_STAGE``)
        return (_stage_from_state, (type(self), dict(self.__dict__)))

    def uses_adapter_order(self, adapter_order: bool | None = None) -> bool:
        """Whether a layer of this stage builds its base alignment in adapter order
        (:class:`LayerRun`'s ``adapter_order``): the given flag, else on for ``fused_gemm`` stages."""
        return bool(self.fused_gemm) if adapter_order is None else bool(adapter_order)

    @property
    def launch_ops(self) -> tuple[str, ...]:
        """The launches of one layer of this stage (before the top-k sum), in call order."""
        return FUSED_LAUNCH_OPS if self.fused_gemm else LAUNCH_OPS

    def config_for(self, dims: Dims) -> LayerConfig:
        """The config a call of ``dims`` starts from: :func:`default_config` (stages ``tuned`` and
        ``fused`` override this with their config loaders)."""
        return default_config(dims)

    def adapt(self, cfg: LayerConfig) -> LayerConfig:
        """The config this stage actually launches: features it lacks are switched off."""
        changes = {}
        for op in LORA_OPS:
            c = getattr(cfg, op)
            new = {}
            if not self.split_k and c.SPLIT_K != 1:
                new["SPLIT_K"] = 1
            if not self.swizzle and c.GROUP_SIZE_M != 1:
                new["GROUP_SIZE_M"] = 1
            if new:
                changes[op] = replace(c, **new)
        if not self.fused_gemm and cfg.base_down.SPLIT_K != 1:  # only stage fused's down GEMM splits K
            changes["base_down"] = replace(cfg.base_down, SPLIT_K=1)
        if cfg.base_gate_up.SPLIT_K != 1:  # only stage gemv's gate_up GEMV splits K
            changes["base_gate_up"] = replace(cfg.base_gate_up, SPLIT_K=1)
        return replace(cfg, **changes) if changes else cfg


def aligned_weight(w, name: str):
    """:func:`~moelora_lib.common.aligned16` of an expert weight: a tensor, or an
    :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` whose blocks and scales are each aligned (the same
    object when both already are), or an :class:`~moelora_lib.quant.FP8BlockWeight` whose weight and
    scale_inv are."""
    if isinstance(w, FP8BlockWeight):
        q, sc = aligned16(w.weight, f"{name}.weight"), aligned16(w.scale_inv, f"{name}.scale_inv")
        return w if (q is w.weight and sc is w.scale_inv) else FP8BlockWeight(q, sc, w.block)
    if not isinstance(w, MXFP4Weight):
        return aligned16(w, name)
    q, sc = aligned16(w.blocks, f"{name}.blocks"), aligned16(w.scales, f"{name}.scales")
    return w if (q is w.blocks and sc is w.scales) else MXFP4Weight(q, sc)


def mxfp4_config(cfg: LayerConfig) -> LayerConfig:
    """``cfg`` with the base GEMMs' BLOCK_SIZE_K raised to 32 where it is smaller (16): a K step of an
    MXFP4 weight decodes whole 32-value scale blocks. The other fields and ops are unchanged."""
    changes = {
        op: replace(getattr(cfg, op), BLOCK_SIZE_K=MXFP4_BLOCK)
        for op in BASE_OPS
        if getattr(cfg, op).BLOCK_SIZE_K < MXFP4_BLOCK
    }
    return replace(cfg, **changes) if changes else cfg


def fp8_config(cfg: LayerConfig, bk: int) -> LayerConfig:
    """``cfg`` with the base GEMMs' BLOCK_SIZE_K lowered to the largest power of two dividing ``bk``
    (the columns of an FP8 scale block) where it does not divide ``bk``: a K step of a block-FP8
    weight reads one scale column. Left unchanged where that power of two is below 16 (the smallest
    dot K; the launchers then refuse the weight). The other fields and ops are unchanged."""
    p2 = bk & -bk  # the largest power of two dividing bk
    changes = {
        op: replace(getattr(cfg, op), BLOCK_SIZE_K=p2)
        for op in BASE_OPS
        if bk % getattr(cfg, op).BLOCK_SIZE_K and p2 >= 16
    }
    return replace(cfg, **changes) if changes else cfg


def w8a8_config(cfg: LayerConfig, bk: int) -> LayerConfig:
    """``cfg`` for W8A8 base GEMMs on block-FP8 weights whose scale blocks (and activation groups) span
    ``bk`` columns: each base GEMM's BLOCK_SIZE_K becomes min(2·BLOCK_SIZE_K, the largest power of two
    dividing bk), at least :data:`W8A8_MIN_BLOCK_K`. Twice the K of a tile tuned for 16-bit operands
    moves the same bytes per K step into shared memory (so the tuned pipelining depth still fits) and
    halves the per-step scaling work (each K step ends with the fp32 partial times the two scales);
    a K step never leaves one scale column. The other fields and ops are unchanged.

    Raises ValueError naming ``bk`` when its largest power-of-two divisor is below W8A8_MIN_BLOCK_K."""
    p2 = bk & -bk
    if p2 < W8A8_MIN_BLOCK_K:
        raise ValueError(
            f"bk = {bk}: W8A8 needs scale blocks of a multiple of {W8A8_MIN_BLOCK_K} columns (an FP8 dot's K)"
        )
    changes = {}
    for op in BASE_OPS:
        c = getattr(cfg, op)
        want = max(W8A8_MIN_BLOCK_K, min(2 * c.BLOCK_SIZE_K, p2))
        if want != c.BLOCK_SIZE_K:
            changes[op] = replace(c, BLOCK_SIZE_K=want)
    return replace(cfg, **changes) if changes else cfg


def packed_config(cfg: LayerConfig, w, activation_scheme: str = "weight_only") -> LayerConfig:
    """``cfg`` adapted to the expert weight ``w``'s format: :func:`mxfp4_config` for an
    :class:`~moelora_lib.quant.mxfp4.MXFP4Weight`, :func:`fp8_config` for an
    :class:`~moelora_lib.quant.FP8BlockWeight` (:func:`w8a8_config` when ``activation_scheme`` is
    "dynamic"), ``cfg`` itself for a dense weight."""
    if isinstance(w, MXFP4Weight):
        return mxfp4_config(cfg)
    if isinstance(w, FP8BlockWeight):
        if activation_scheme == "dynamic":
            return w8a8_config(cfg, w.block[1])
        return fp8_config(cfg, w.block[1])
    return cfg


def config_weight_format(w, activation_scheme: str = "weight_only") -> str:
    """The :attr:`~moelora_lib.shapes.Dims.weight_format` whose tuned files configure a layer on the expert
    weight ``w`` running ``activation_scheme`` ("weight_only" or "dynamic"): "mxfp4", "fp8_w8a8" /
    "fp8" for an FP8BlockWeight, else "dense"."""
    if isinstance(w, MXFP4Weight):
        return "mxfp4"
    if isinstance(w, FP8BlockWeight):
        return "fp8_w8a8" if activation_scheme == "dynamic" else "fp8"
    return "dense"


class Launch(NamedTuple):
    """One kernel launch of a layer, as compile-only checks need it (nothing allocated, nothing run).

    kernel: the :data:`~moelora_lib.kernels.triton_kernels.KERNELS` name; grid, args, constexprs: what
    the launcher's ``*_args`` builder returns; num_warps/num_stages: from ``cfg`` (None for the
    activation, which runs with Triton's defaults); cfg: the OpConfig launched (None for the activation).
    """

    kernel: str
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int | None
    num_stages: int | None
    cfg: OpConfig | None


class LayerRun:
    """One MoE+LoRA layer call split into its launches, with alignments and buffers made up front.

    This is the one launch plan of a layer: which tensors, alignment, config and stage switches each
    of the seven launches (:data:`LAUNCH_OPS`) gets. ``LayerRun(...)()`` computes the layer;
    :meth:`base_part` and :meth:`lora_part` run the base launches or the four LoRA ops alone on the
    buffers of the last full call, which is what the benchmarks time; :meth:`op_fn` hands one launch
    alone to a benchmark or the tuner (optionally with another OpConfig), and :meth:`launch_args` the
    arguments of one launch to compile-only checks. All inputs must already be validated (see
    :func:`moelora_lib.fused_moe_lora`); meta tensors work for :meth:`launch_args`.

    Optional inputs let a caller that owns its memory (:class:`moelora_lib.layer.MoELoRALayer`)
    run the same plan without allocating or aligning here:

    * ``alignments = (base, lora_gate_up, lora_down)``: precomputed :class:`Alignment` s (e.g. from
      :func:`moelora_lib.kernels.align.align_tokens_triton`); ``None`` for a LoRA projection means no
      LoRA launch for it. Default: :func:`moelora_lib.routing.align_tokens` here, one LoRA alignment
      shared by both projections.
    * ``buffers``: preallocated contiguous tensors by name — ``h`` [P, 2I], ``g`` [P, I], ``y`` [P, H]
      (hidden_states' dtype), ``tw`` [P] float32 (receives the flat routing weights), ``inter_gate_up``
      [S, P, R] and ``inter_down`` [1, P, R] float32 (the rank intermediates), and for stages without
      fused add ``delta_gate_up`` [P, 2I] and ``delta_down`` [P, H] (float32 when hidden_states is
      float16, else its dtype); P = T·K. A missing name is allocated here.
    * ``nan_on_bad_ids``: the final top-k sum gives NaN rows for tokens whose topk_ids leave [0, E) or
      whose lora_ids leave [-1, L) (:func:`~moelora_lib.kernels.topk_reduce.topk_reduce`, one launch
      like torch's sum) instead of summing pair rows the alignment dropped — for callers that do not
      check id values (the serving layer); default False (the ids were checked).
    * ``skip_remote``: a top-k id of -1 marks a pair whose expert is on another rank (expert parallelism,
      :class:`moelora_lib.MoELoRALayer`'s ``expert_map``): the alignment drops it (no work) and the top-k
      sum leaves it out instead of giving a NaN row (``topk_reduce``'s ``skip_remote``); default False.
    * ``proj_lora_ids = (gate_up, down)``: the adapter ids [T] each projection's LoRA alignment was
      built from, when they differ from ``lora_ids`` (a slot covering one projection only: -1 where
      the slot does not cover it). Only stages with ``fused_gemm`` read them (their GEMMs find each
      row's adapter from these ids, not from the LoRA alignment); default: ``lora_ids`` for both.
    * ``w13`` / ``w2`` may be :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` s (dense shapes [E, 2I, H]
      / [E, H, I]; blocks and scales uint8): every base GEMM (the seven-launch stages' ``base_gate_up``
      and ``base_down``, stage ``fused``'s two GEMMs) then decodes the packed weight in registers
      (``W_MXFP4``, :mod:`.triton_kernels`); the LoRA launches are unchanged. The base GEMMs'
      BLOCK_SIZE_K must be a multiple of 32: :func:`mxfp4_config` raises a config's 16 to 32 (the
      serving layer applies it); given 16, the launchers raise ValueError. Or both
      :class:`~moelora_lib.quant.FP8BlockWeight` s (e4m3 [E, N, K] and block scales, ``W_FP8``): the
      base GEMMs' BLOCK_SIZE_K must divide the scale block's columns (:func:`fp8_config` lowers it).
    * ``activation_scheme``: "weight_only" (default; the base GEMMs read the activations in their dtype)
      or, with FP8 weights, "dynamic" (W8A8, ``A_FP8`` in :mod:`.triton_kernels`): every base GEMM (the
      seven-launch stages' ``base_gate_up`` / ``base_down``, stage ``fused``'s two GEMMs) first quantizes
      its input with :func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act` — hidden_states in groups of
      w13's scale-block columns, the activation output g in groups of w2's — and multiplies on FP8
      tensor cores; the quantization launch belongs to that base op (:meth:`op_fn` times both, and
      :meth:`launch_args` describes the GEMM). The LoRA launches read the unquantized x and g, as
      before. Buffers ``xq`` [T, H] float8_e4m3fn, ``xs`` [T, ceil(H/bk13)] float32, ``gq`` [T·K, I]
      float8_e4m3fn, ``gs`` [T·K, ceil(I/bk2)] float32 (contiguous) receive the quantized activations;
      missing ones are allocated once per LayerRun. BLOCK_SIZE_K of the base GEMMs must be ≥ 32 and
      divide the scale blocks' columns (:func:`w8a8_config`). ValueError naming ``activation_scheme``
      for another value, or "dynamic" with weights that are not both FP8BlockWeight s.
    * ``adapter_order``: build the base alignment (when ``alignments`` is None or its first entry is
      None) with each expert's pairs ordered by adapter (:func:`~moelora_lib.routing.align_tokens`'s
      ``sort_lora_ids``), so that a base tile holds the rows of one or two adapters; None (default) =
      on for stages with ``fused_gemm`` (whose GEMMs run one LoRA dot per adapter present in a tile),
      off otherwise. The result does not depend on it (a row's sums are the same, only which rows
      share a tile changes); the torch alignment then serves the base GEMMs (the Triton alignments
      have no adapter order).

    Stages with ``fused_gemm`` (stage ``fused``) run :data:`FUSED_LAUNCH_OPS` instead of the seven
    launches: ``gate_up_shrink`` into a [T·K, S, R16] float32 intermediate (``inter_gate_up`` buffer
    of that shape; ``inter_down`` [T·K, 1, R16]), the gate_up GEMM with the LoRA expand and the
    activation inside (writes ``g``; no ``h``, so the ``h`` buffer is neither allocated nor used),
    ``down_shrink``, the down GEMM with its expand (writes ``y``), the top-k sum. Their configs are
    the :class:`LayerConfig` fields of :data:`FUSED_CONFIG_FIELD`. The single-launch methods of the
    seven-launch plan (:meth:`base_gate_up`, :meth:`act`, ...) and :meth:`lora_part` do not apply there.
    """

    def __init__(
        self,
        stage: Stage,
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
        activation: str,
        b13=None,
        b2=None,
        config: LayerConfig,
        alignments: tuple[Alignment, Alignment | None, Alignment | None] | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
        nan_on_bad_ids: bool = False,
        proj_lora_ids: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        adapter_order: bool | None = None,
        activation_scheme: str = "weight_only",
        skip_remote: bool = False,
    ):
        if activation_scheme not in ("weight_only", "dynamic"):
            raise ValueError(
                "activation_scheme must be 'weight_only' or 'dynamic' (resolved per call), got "
                f"{activation_scheme!r}"
            )
        if activation_scheme == "dynamic" and not (
            isinstance(w13, FP8BlockWeight) and isinstance(w2, FP8BlockWeight)
        ):
            raise ValueError(
                "activation_scheme 'dynamic' (W8A8) needs FP8BlockWeight w13 and w2, got "
                f"{type(w13).__name__} and {type(w2).__name__}"
            )
        self.w8a8 = activation_scheme == "dynamic"
        self._fp8_acts: dict[str, FP8Activations] = {}  # W8A8: the quantized x / g (buffers or own)
        self.stage = stage
        self.skip_remote = bool(skip_remote)
        self.adapter_order = stage.uses_adapter_order(adapter_order)
        self.proj_lora_ids = proj_lora_ids
        self.buffers = buffers or {}
        self.nan_on_bad_ids = bool(nan_on_bad_ids)
        self.topk_ids, self.lora_ids = topk_ids, lora_ids
        self.cfg = stage.adapt(config)
        # Every tensor the kernels read starts 16-byte aligned (a copy only for a misaligned view):
        # Triton specializes pointers on alignment, so an offset view would compile a second binary.
        # Caller-given ``buffers`` are prefixes of aligned allocations and are used as they are.
        self.x = aligned16(hidden_states, "hidden_states")
        self.w13, self.w2 = aligned_weight(w13, "w13"), aligned_weight(w2, "w2")
        self.b13 = None if b13 is None else aligned16(b13, "b13")
        self.b2 = None if b2 is None else aligned16(b2, "b2")
        self.lora = tuple(
            aligned16(t, n)
            for t, n in zip(
                (lora_a13, lora_b13, lora_a2, lora_b2), ("lora_a13", "lora_b13", "lora_a2", "lora_b2")
            )
        )
        self.activation = activation
        T, H = hidden_states.shape
        E = w13.shape[0]
        self.T, self.H, self.K = T, H, topk_ids.shape[1]
        self.I = w2.shape[2]
        self.L = lora_a13.shape[0]
        tw = self.buffers.get("tw")
        if tw is None:
            # (.contiguous() keeps a misaligned contiguous view such as buf[1:17] as it is)
            self.topk_w = aligned16(topk_weights.reshape(-1).float().contiguous(), "topk_weights")
        else:  # the caller's own aligned fp32 copy
            self.topk_w = tw.copy_(topk_weights.reshape(-1))
        if alignments is None:
            lora_align = align_tokens(
                topk_ids,
                E,
                self.cfg.lora_block_size_m,
                lora_ids=lora_ids,
                num_adapters=self.L,
                check_values=False,
            )
            alignments = (None, lora_align, lora_align)
        self.base_align, self.lora_align, self.lora_align_down = alignments
        if self.base_align is None:  # built here: with the adapter order where asked
            sort_ids = dict(sort_lora_ids=lora_ids, num_adapters=self.L) if self.adapter_order else {}
            self.base_align = align_tokens(
                topk_ids, E, self.cfg.base_block_size_m, check_values=False, **sort_ids
            )
        P = T * self.K
        dt, dev = hidden_states.dtype, hidden_states.device
        self.h = self.buffers.get("h")
        if self.h is None and not stage.fused_gemm:  # the fused stage has no h
            self.h = torch.empty((P, 2 * self.I), dtype=dt, device=dev)
        if stage.fused_gemm:  # its gate_up GEMM writes g directly: one buffer for every call
            g = self.buffers.get("g")
            self._g_buf = g if g is not None else torch.empty((P, self.I), dtype=dt, device=dev)
        self.y = self.buffers.get("y")
        if self.y is None:
            self.y = torch.empty((P, H), dtype=dt, device=dev)
        self._y32: torch.Tensor | None = None  # the split-K down GEMM's fp32 y, once used (_y32_buf)
        self.g = None

    @property
    def _y_split(self) -> bool:
        """Stage fused with SPLIT_K > 1 on its down GEMM: the programs add their shares into a zeroed fp32
        y (``buffers["y32"]`` or a new one per call), which the top-k sum rounds to y's dtype once."""
        return bool(self.stage.fused_gemm) and self.cfg.base_down.SPLIT_K > 1

    @property
    def dims(self) -> Dims:
        """The sizes of this call (T, H, I, E, top_k, adapters, rank, slices) and its experts' form."""
        a13 = self.lora[0]
        return Dims(
            T=self.T,
            H=self.H,
            I=self.I,
            E=self.w13.shape[0],
            top_k=self.K,
            adapters=self.L,
            rank=a13.shape[3],
            slices=a13.shape[2],
            weight_format=config_weight_format(self.w13, "dynamic" if self.w8a8 else "weight_only"),
        )

    # --- the wiring: which tensors each launch reads and writes ---------------------------------
    def _act_out(self) -> torch.Tensor:
        """The activation output g [T·K, I] of the last call (an unwritten buffer before any call)."""
        if self.g is None:
            g = self.buffers.get("g")
            if g is not None:
                return g
            return torch.empty((self.T * self.K, self.I), dtype=self.x.dtype, device=self.x.device)
        return self.g

    def _base_io(self, op: str) -> dict[str, Any]:
        if op == "base_gate_up":
            return dict(x=self.x, w=self.w13, out=self.h, rows_div=self.K, bias=self.b13, topk_weights=None)
        if op == "base_down":
            return dict(
                x=self._act_out(), w=self.w2, out=self.y, rows_div=1, bias=self.b2, topk_weights=self.topk_w
            )
        raise ValueError(f"op must be one of {BASE_OPS}, got {op!r}")

    def _lora_io(self, op: str) -> dict[str, Any]:
        a13, b13l, a2, b2l = self.lora
        if op in ("gate_up_shrink", "gate_up_expand"):
            return dict(
                x=self.x, a=a13, b=b13l, out=self.h, rows_div=self.K, topk_weights=None, align=self.lora_align
            )
        if op in ("down_shrink", "down_expand"):
            return dict(
                x=self._act_out(),
                a=a2,
                b=b2l,
                out=self.y,
                rows_div=1,
                topk_weights=self.topk_w,
                align=self.lora_align_down,
            )
        raise ValueError(f"op must be one of {LORA_OPS}, got {op!r}")

    def _a_operand(self, op: str, x: torch.Tensor, run: bool):
        """The A operand of base op ``op`` (``base_gate_up`` / ``fused_gate_up`` read x,
        ``base_down`` / ``fused_down`` read g): ``x`` itself, or with W8A8 its
        :class:`~moelora_lib.kernels.fp8_act.FP8Activations` in the ``xq``/``xs`` (``gq``/``gs``) buffers,
        quantized now when ``run`` (one launch), placeholders of the right shape otherwise."""
        if not self.w8a8:
            return x
        which, w = ("x", self.w13) if op in ("base_gate_up", "fused_gate_up") else ("g", self.w2)
        group = w.block[1]
        fa = self._fp8_acts.get(which)
        if fa is None:
            q, sc = self.buffers.get(f"{which}q"), self.buffers.get(f"{which}s")
            dev = self.x.device
            if q is None:
                q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev)
            if sc is None:
                sc = torch.empty(fp8_act_scale_shape(*x.shape, group), dtype=torch.float32, device=dev)
            fa = self._fp8_acts[which] = FP8Activations(q, sc, group)
        if run:
            quantize_fp8_act(x, group, out=(fa.q, fa.scale))
        return fa

    def _op_cfg(self, op: str, cfg: OpConfig | None) -> OpConfig:
        return cfg if cfg is not None else getattr(self.cfg, FUSED_CONFIG_FIELD.get(op, op))

    def _base(self, op: str, cfg: OpConfig | None = None):
        io = self._base_io(op)
        return fused_moe_gemm(
            self._a_operand(op, io["x"], run=True),
            io["w"],
            io["out"],
            self.base_align,
            self._op_cfg(op, cfg),
            rows_div=io["rows_div"],
            bias=io["bias"],
            topk_weights=io["topk_weights"],
            specialize_lengths=self.stage.specialize_lengths,
        )

    def _shrink(
        self, op: str, cfg: OpConfig | None = None, inter: torch.Tensor | None = None
    ) -> torch.Tensor:
        io, st = self._lora_io(op), self.stage
        return lora_shrink(
            io["x"],
            io["a"],
            io["align"],
            self._op_cfg(op, cfg),
            rows_div=io["rows_div"],
            use_even_k=st.even_k,
            specialize_lengths=st.specialize_lengths,
            inter=inter,
        )

    def _expand(
        self, op: str, inter: torch.Tensor, out: torch.Tensor, add_inputs: bool, cfg: OpConfig | None = None
    ):
        io, st = self._lora_io(op), self.stage
        return lora_expand(
            inter,
            io["b"],
            out,
            io["align"],
            self._op_cfg(op, cfg),
            topk_weights=io["topk_weights"],
            add_inputs=add_inputs,
            use_even_k=st.even_k,
            specialize_lengths=st.specialize_lengths,
        )

    def _lora_pair(self, proj: str):
        io = self._lora_io(f"{proj}_expand")
        if io["align"] is None:  # no adapter covers this projection: no LoRA launch
            return
        inter = self._shrink(f"{proj}_shrink", inter=self.buffers.get(f"inter_{proj}"))
        out = io["out"]
        if self.stage.fused_add:
            self._expand(f"{proj}_expand", inter, out, add_inputs=True)
        else:
            delta = self.buffers.get(f"delta_{proj}")
            if delta is None:
                # fp16 stores the delta in fp32: a delta beyond 65 504 on a base that brings the sum
                # back into range must not overflow (the fused add never rounds the delta alone)
                dt = torch.float32 if out.dtype == torch.float16 else out.dtype
                delta = torch.zeros(out.shape, dtype=dt, device=out.device)
            else:
                delta.zero_()
            self._expand(f"{proj}_expand", inter, delta, add_inputs=False)
            out.add_(delta)

    # --- the launches -------------------------------------------------------------------------
    def base_gate_up(self):
        self._base("base_gate_up")

    def lora_gate_up(self):
        self._lora_pair("gate_up")

    def act(self):
        self.g = gated_act(
            self.h,
            self.activation,
            specialize_lengths=self.stage.specialize_lengths,
            out=self.buffers.get("g"),
        )

    def base_down(self):
        self._base("base_down")

    def lora_down(self):
        self._lora_pair("down")

    def reduce(self) -> torch.Tensor:
        # one kernel for every caller (same summation order); NaN rows for bad ids when they were not
        # checked (the serving layer) instead of summing stale pair rows
        y = self._y32 if self._y_split and self._y32 is not None else self.y
        return topk_reduce(
            y,
            self.topk_ids,
            self.w13.shape[0],
            self.lora_ids,
            self.L,
            check_ids=self.nan_on_bad_ids,
            out_dtype=self.x.dtype,
            skip_remote=self.skip_remote,
        )

    # --- stages with fused_gemm (stage ``fused``) -----------------------------------------------
    def _proj_ids(self, proj: int) -> torch.Tensor:
        """The adapter ids [T] that the LoRA alignment of ``proj`` (0 gate_up, 1 down) was built from."""
        if self.proj_lora_ids is not None and self.proj_lora_ids[proj] is not None:
            return self.proj_lora_ids[proj]
        return self.lora_ids

    def _inter_shape(self, proj: str) -> tuple[int, int, int]:
        """(T·K, S, R16): the shape of ``proj``'s rank intermediate in a ``fused_gemm`` stage."""
        a = self.lora[0] if proj == "gate_up" else self.lora[2]
        S = a.shape[2] if a.dim() == 5 else 1
        return (self.T * self.K, S, rank_stride(a.shape[-2]))

    def _inter_rows(self, proj: str) -> torch.Tensor:
        """A placeholder [T·K, S, R16] float32 intermediate (compile-only checks; nothing is run)."""
        return torch.empty(self._inter_shape(proj), dtype=torch.float32, device=self.x.device)

    def _rows_shrink(self, proj: str, cfg: OpConfig | None = None, inter: torch.Tensor | None = None):
        io = self._lora_io(f"{proj}_shrink")
        return lora_shrink_rows(
            io["x"],
            io["a"],
            io["align"],
            self._op_cfg(f"{proj}_shrink", cfg),
            rows_div=io["rows_div"],
            use_even_k=self.stage.even_k,
            inter=inter,
        )

    def _fused_io(self, op: str, inter: torch.Tensor | None, split: bool) -> dict[str, Any]:
        """The keyword arguments of :func:`~.launchers.fused_moe_lora` for ``op`` (no LoRA when
        ``inter`` is None); ``split``: the launch's config splits the down GEMM over K, so it adds into
        the fp32 y."""
        has = inter is not None
        if op == "fused_gate_up":
            return dict(
                x=self.x,
                w=self.w13,
                out=self._g_buf,
                activation=self.activation,
                bias=self.b13,
                inter=inter,
                lora_b=self.lora[1] if has else None,
                lora_ids=self._proj_ids(0) if has else None,
            )
        if op == "fused_down":
            return dict(
                x=self._g_buf,
                w=self.w2,
                out=self._y32_buf() if split else self.y,
                bias=self.b2,
                topk_weights=self.topk_w,
                inter=inter,
                lora_b=self.lora[3] if has else None,
                lora_ids=self._proj_ids(1) if has else None,
            )
        raise ValueError(f"op must be one of {FUSED_LAUNCH_OPS}, got {op!r}")

    def _y32_buf(self) -> torch.Tensor:
        """The fp32 [T·K, H] y of a split-K down GEMM (``buffers["y32"]`` or a new one, kept for the
        call); its values are whatever the last launch left (:meth:`_fused_gemm` zeroes it)."""
        if self._y32 is None:
            buf = self.buffers.get("y32")
            if buf is None:
                buf = torch.empty(self.y.shape, dtype=torch.float32, device=self.x.device)
            self._y32 = buf
        return self._y32

    def _fused_gemm(self, op: str, inter: torch.Tensor | None, cfg: OpConfig | None = None):
        c = self._op_cfg(op, cfg)
        split = op == "fused_down" and c.SPLIT_K > 1  # (a replacement config may differ from the layer's)
        if split:  # the split-K programs add into the fp32 y
            self._y32_buf().zero_()
        io = self._fused_io(op, inter, split)
        fused_moe_lora(
            self._a_operand(op, io.pop("x"), run=True),
            io.pop("w"),
            io.pop("out"),
            self.base_align,
            c,
            top_k=self.K,
            **io,
        )

    def _fused_call(self, with_lora: bool) -> torch.Tensor:
        inter13 = inter2 = None
        if with_lora and self.lora_align is not None:
            inter13 = self._rows_shrink("gate_up", inter=self.buffers.get("inter_gate_up"))
        self._fused_gemm("fused_gate_up", inter13)
        self.g = self._g_buf
        if with_lora and self.lora_align_down is not None:
            inter2 = self._rows_shrink("down", inter=self.buffers.get("inter_down"))
        self._fused_gemm("fused_down", inter2)
        return self.reduce()

    # --- groupings used by callers and benchmarks ---------------------------------------------
    def __call__(self, with_lora: bool = True) -> torch.Tensor:
        if self.stage.fused_gemm:
            return self._fused_call(with_lora)
        self.base_gate_up()
        if with_lora:
            self.lora_gate_up()
        self.act()
        self.base_down()
        if with_lora:
            self.lora_down()
        return self.reduce()

    def base_part(self) -> torch.Tensor:
        """The base MoE layer alone (no LoRA launches)."""
        return self(with_lora=False)

    def lora_part(self) -> None:
        """The four LoRA ops (and, in stages without fused add, their delta buffers and adds) alone.

        Reuses the activation buffer of the last full call; adds the deltas into ``h`` and ``y``
        again (the values are not meaningful afterwards, the cost is).

        Raises ValueError in a stage with ``fused_gemm``: its LoRA expands run inside the base GEMMs,
        so the LoRA part is not a set of launches (time the layer and :meth:`base_part`, or one launch
        with :meth:`op_fn`).
        """
        if self.stage.fused_gemm:
            raise ValueError(
                f"stage {self.stage.name!r} runs the LoRA expands inside the base GEMMs: its LoRA part is "
                "not separable (time the whole layer and base_part(), or single launches with op_fn)"
            )
        if self.g is None:
            self()
        self.lora_gate_up()
        self.lora_down()

    # --- one launch alone: for benchmarks, the tuner and compile-only checks -------------------
    def op_fn(self, op: str, cfg: OpConfig | None = None) -> Callable[[], Any]:
        """A no-argument callable launching one op of this layer alone, on the buffers of a full call.

        op: a base GEMM (``base_gate_up``, ``base_down``), a LoRA op (``gate_up_shrink``,
            ``gate_up_expand``, ``down_shrink``, ``down_expand``) or ``act``.
        cfg: an :class:`~moelora_lib.kernels.OpConfig` replacing ``self.cfg.<op>`` (its BLOCK_SIZE_M must
            equal the alignment's of the op's group); launched as given — the stage's switches (EVEN_K,
            fused add, length specialization) apply, SPLIT_K/GROUP_SIZE_M are not clamped by the stage.

        Runs the layer once first if it has not run. A base GEMM writes into the layer's own ``h``/``y``;
        a shrink returns the fp32 intermediate [S, P, R]; an expand adds (fused-add stages) or writes
        (other stages) the delta into a private copy of ``h`` or ``y``, its input computed once here by
        the shrink with the layer's config, so repeated calls cost what one call in the layer costs.
        """
        if self.g is None:
            self()
        if self.stage.fused_gemm:
            return self._fused_op_fn(op, cfg)
        if op in BASE_OPS:
            return lambda: self._base(op, cfg)
        if op == "act":
            return lambda: gated_act(
                self.h, self.activation, specialize_lengths=self.stage.specialize_lengths
            )
        if op.endswith("shrink"):
            self._lora_io(op)  # validates the name
            return lambda: self._shrink(op, cfg)
        io = self._lora_io(op)
        inter = self._shrink(op.replace("expand", "shrink"))
        scratch = io["out"].clone()
        fused = self.stage.fused_add
        return lambda: self._expand(op, inter, scratch, add_inputs=fused, cfg=cfg)

    def launch_args(self, op: str, cfg: OpConfig | None = None) -> Launch:
        """The :class:`Launch` (kernel name, grid, arguments, constexprs, warps, stages) of one op of this
        layer, built by the launchers' ``*_args`` functions from the same tensors :meth:`op_fn` and the
        layer call use; nothing is allocated on the device or launched (meta tensors are fine).

        op and cfg: as in :meth:`op_fn`. An expand is described with ``ADD_INPUTS`` = the stage's fused
        add; the LoRA intermediate and, before any call, the activation output are placeholders of
        the right shape, dtype and device.
        """
        st = self.stage
        if st.fused_gemm:
            return self._fused_launch_args(op, cfg)
        kernel = LAUNCH_KERNELS.get(op)
        if kernel is None:
            raise ValueError(f"op must be one of {LAUNCH_OPS}, got {op!r}")
        if op == "act":
            grid, args, cx = gated_act_args(self.h, self._act_out(), self.activation)
            return Launch(kernel, grid, args, cx, None, None, None)
        c = self._op_cfg(op, cfg)
        if op in BASE_OPS:
            io = self._base_io(op)
            grid, args, cx = fused_moe_gemm_args(
                self._a_operand(op, io["x"], run=False),
                io["w"],
                io["out"],
                self.base_align,
                c,
                rows_div=io["rows_div"],
                bias=io["bias"],
                topk_weights=io["topk_weights"],
            )
            return Launch(kernel, grid, args, cx, c.NUM_WARPS, c.NUM_STAGES, c)
        io = self._lora_io(op)
        align = io["align"]
        if align is None:
            raise ValueError(f"op {op!r}: this layer call has no LoRA alignment for its projection")
        S = io["a"].shape[2] if io["a"].dim() == 5 else 1
        inter = torch.empty(
            (S, align.num_pairs, io["a"].shape[-2]), dtype=torch.float32, device=self.x.device
        )
        if op.endswith("shrink"):
            grid, args, cx = lora_shrink_args(
                io["x"], io["a"], inter, align, c, rows_div=io["rows_div"], use_even_k=st.even_k
            )
        else:
            grid, args, cx = lora_expand_args(
                inter,
                io["b"],
                io["out"],
                align,
                c,
                topk_weights=io["topk_weights"],
                add_inputs=st.fused_add,
                use_even_k=st.even_k,
            )
        return Launch(kernel, grid, args, cx, c.NUM_WARPS, c.NUM_STAGES, c)

    # --- one launch alone, stages with fused_gemm -------------------------------------------------
    def _fused_op_fn(self, op: str, cfg: OpConfig | None) -> Callable[[], Any]:
        """:meth:`op_fn` of a ``fused_gemm`` stage: ``gate_up_shrink``/``down_shrink`` return the fresh
        [T·K, S, R16] intermediate; ``fused_gate_up``/``fused_down`` rewrite the layer's own ``g``/``y``
        (same values) from an intermediate computed once here with the layer's config."""
        if op not in FUSED_LAUNCH_OPS:
            raise ValueError(f"op must be one of {FUSED_LAUNCH_OPS} in stage {self.stage.name!r}, got {op!r}")
        if op.endswith("shrink"):
            return lambda: self._rows_shrink(op.removesuffix("_shrink"), cfg)
        proj = "gate_up" if op == "fused_gate_up" else "down"
        align = self.lora_align if proj == "gate_up" else self.lora_align_down
        inter = self._rows_shrink(proj) if align is not None else None
        return lambda: self._fused_gemm(op, inter, cfg)

    def _fused_launch_args(self, op: str, cfg: OpConfig | None) -> Launch:
        kernel = FUSED_LAUNCH_KERNELS.get(op)
        if kernel is None:
            raise ValueError(f"op must be one of {FUSED_LAUNCH_OPS} in stage {self.stage.name!r}, got {op!r}")
        c = self._op_cfg(op, cfg)
        if op.endswith("shrink"):
            proj = op.removesuffix("_shrink")
            io = self._lora_io(op)
            if io["align"] is None:
                raise ValueError(f"op {op!r}: this layer call has no LoRA alignment for its projection")
            grid, args, cx = lora_shrink_rows_args(
                io["x"],
                io["a"],
                self._inter_rows(proj),
                io["align"],
                c,
                rows_div=io["rows_div"],
                use_even_k=self.stage.even_k,
            )
            return Launch(kernel, grid, args, cx, c.NUM_WARPS, c.NUM_STAGES, c)
        proj = "gate_up" if op == "fused_gate_up" else "down"
        align = self.lora_align if proj == "gate_up" else self.lora_align_down
        io = self._fused_io(op, self._inter_rows(proj) if align is not None else None, c.SPLIT_K > 1)
        name, grid, args, cx = fused_moe_lora_args(
            self._a_operand(op, io.pop("x"), run=False),
            io.pop("w"),
            io.pop("out"),
            self.base_align,
            c,
            top_k=self.K,
            **io,
        )
        assert name == kernel
        return Launch(kernel, grid, args, cx, c.NUM_WARPS, c.NUM_STAGES, c)
