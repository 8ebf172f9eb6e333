"""What a stage is, the default configs, and the layer forward every stage shares.

A :class:`Stage` is a set of switches over the kernels of :mod:`.triton_kernels`; the stage modules
(``naive.py``, ``no_recompile.py``, ...) each define one and the registry in ``__init__`` lists them.
All stages run through :class:`LayerRun`, so they have the same signature and differ only by their
switches: a later stage never changes what an earlier one computes or how.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ..common import aligned16
from ..hardware import H200_NUM_SMS
from ..routing import Alignment, align_tokens
from ..shapes import Dims
from .config import BASE_OPS, LORA_OPS, LayerConfig, OpConfig, next_pow2
from .launchers import (
    fused_moe_gemm,
    fused_moe_gemm_args,
    gated_act,
    gated_act_args,
    lora_expand,
    lora_expand_args,
    lora_shrink,
    lora_shrink_args,
)
from .topk_reduce import topk_reduce

__all__ = ["Stage", "LayerRun", "Launch", "LAUNCH_OPS", "LAUNCH_KERNELS", "default_config", "as_dims"]

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
    """

    name: str
    title: str
    specialize_lengths: bool
    split_k: bool = False
    swizzle: bool = False
    even_k: bool = False
    fused_add: bool = False

    def config_for(self, dims: Dims | int, *legacy: int) -> LayerConfig:
        """The config a call of ``dims`` starts from: :func:`default_config` (stage ``tuned`` overrides
        this with the tuned-config loader). ``dims``: a Dims or the old ints T, H, I, E, K, R, L, S."""
        return default_config(dims, *legacy)

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
        return replace(cfg, **changes) if changes else cfg


def as_dims(dims: Dims | int, *rest: int) -> Dims:
    """A :class:`~moelora_lib.shapes.Dims`, or the old positional form (T, H, I, E, K, R, L[, S]) as one.

    The positional form keeps the order the config loader has always used: R (rank) before L (adapters).
    """
    if isinstance(dims, Dims):
        if rest:
            raise TypeError("pass either a Dims or the positional ints (T, H, I, E, K, R, L[, S]), not both")
        return dims
    if len(rest) not in (6, 7):
        raise TypeError(f"expected a Dims or the ints T, H, I, E, K, R, L[, S]; got {1 + len(rest)} values")
    T, H, I, E, K, R, L, *S = (operator.index(v) for v in (dims, *rest))
    return Dims(T=T, H=H, I=I, E=E, top_k=K, adapters=L, rank=R, slices=S[0] if S else 2)


def default_config(dims: Dims | int, *legacy: int) -> LayerConfig:
    """Hand-picked H200 starting configs by average rows per group (no tuning).

    ``dims``: a :class:`~moelora_lib.shapes.Dims` (``default_config(Dims.of("qwen3-30b-a3b", 64))``);
    the old positional form ``default_config(T, H, I, E, K, R, L, S=2)`` is still accepted.

    Base GEMMs: by T·K/E rows per expert. LoRA ops: by T·K/(L·E) rows per (adapter, expert) group
    (assuming every token has an adapter). SPLIT_K targets about two programs per SM of the H200
    for the shrink. BLOCK_SIZE_K = 64 keeps EVEN_K for every preset's hidden/intermediate.
    """
    d = as_dims(dims, *legacy)
    T, top_k, experts, adapters, rank = d.T, d.top_k, d.E, d.adapters, d.rank
    hidden, intermediate, slices = d.H, d.I, d.slices
    pairs = max(1, T * top_k)
    m_avg = pairs / experts
    if m_avg <= 8:
        base = OpConfig(16, 64, 64, 1, 1, 4, 5)
    elif m_avg <= 64:
        base = OpConfig(32, 64, 64, 8, 1, 4, 4)
    elif m_avg <= 256:
        base = OpConfig(64, 128, 64, 8, 1, 4, 4)
    else:
        base = OpConfig(128, 128, 64, 8, 1, 8, 4)

    groups = max(1, adapters) * experts
    g_avg = pairs / groups
    bm = 16 if g_avg <= 16 else (32 if g_avg <= 48 else 64)
    est_blocks = min(pairs, groups) + pairs // bm

    def shrink(K: int, S: int) -> OpConfig:
        bn = max(16, next_pow2(rank))
        bk = 64
        sk = 1
        while sk < 16 and est_blocks * S * sk < 2 * H200_NUM_SMS and bk * sk * 4 <= K:
            sk *= 2
        return OpConfig(bm, bn, bk, 8, sk, 4, 3)

    def expand(N: int) -> OpConfig:
        bn = 128 if N >= 1024 and g_avg > 16 else 64
        return OpConfig(bm, bn, max(16, next_pow2(rank)), 8, 1, 4, 2)

    return LayerConfig(
        base_gate_up=base,
        base_down=base,
        gate_up_shrink=shrink(hidden, slices),
        gate_up_expand=expand(2 * intermediate // slices),
        down_shrink=shrink(intermediate, 1),
        down_expand=expand(hidden),
        source="default",
    )


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

    Two optional inputs let a caller that owns its memory (:class:`moelora_lib.layer.MoELoRALayer`)
    run the same plan without allocating or aligning here:

    * ``alignments = (base, lora_gate_up, lora_down)``: precomputed :class:`Alignment` s (e.g. from
      :func:`moelora_lib.kernels.align.align_tokens_triton`); ``None`` for a LoRA projection means no
      LoRA launch for it. Default: :func:`moelora_lib.routing.align_tokens` here, one LoRA alignment
      shared by both projections.
    * ``buffers``: preallocated contiguous tensors by name — ``h`` [P, 2I], ``g`` [P, I], ``y`` [P, H]
      (hidden_states' dtype), ``tw`` [P] float32 (receives the flat routing weights), ``inter_gate_up``
      [S, P, R] and ``inter_down`` [1, P, R] float32 (the rank intermediates), and for stages without
      fused add ``delta_gate_up`` [P, 2I] and ``delta_down`` [P, H] (float32 when hidden_states is
      float16, else its dtype); P = T·K. A missing name is
      allocated as before.
    * ``nan_on_bad_ids``: the final top-k sum gives NaN rows for tokens whose topk_ids leave [0, E) or
      whose lora_ids leave [-1, L) (:func:`~moelora_lib.kernels.topk_reduce.topk_reduce`, one launch
      like torch's sum) instead of summing pair rows the alignment dropped — for callers that do not
      check id values (the serving layer); default False (the ids were checked).
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
    ):
        self.stage = stage
        self.buffers = buffers or {}
        self.nan_on_bad_ids = bool(nan_on_bad_ids)
        self.topk_ids, self.lora_ids = topk_ids, lora_ids
        self.cfg = stage.adapt(config)
        # Every tensor the kernels read starts 16-byte aligned (a copy only for a misaligned view):
        # Triton specializes pointers on alignment, so an offset view would compile a second binary.
        # Caller-given ``buffers`` are prefixes of aligned allocations and are used as they are.
        self.x = aligned16(hidden_states, "hidden_states")
        self.w13, self.w2 = aligned16(w13, "w13"), aligned16(w2, "w2")
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
            self.base_align: Alignment = align_tokens(
                topk_ids, E, self.cfg.base_block_size_m, check_values=False
            )
            self.lora_align: Alignment | None = align_tokens(
                topk_ids,
                E,
                self.cfg.lora_block_size_m,
                lora_ids=lora_ids,
                num_adapters=self.L,
                check_values=False,
            )
            self.lora_align_down: Alignment | None = self.lora_align
        else:
            self.base_align, self.lora_align, self.lora_align_down = alignments
        P = T * self.K
        dt, dev = hidden_states.dtype, hidden_states.device
        self.h = self.buffers.get("h")
        if self.h is None:
            self.h = torch.empty((P, 2 * self.I), dtype=dt, device=dev)
        self.y = self.buffers.get("y")
        if self.y is None:
            self.y = torch.empty((P, H), dtype=dt, device=dev)
        self.g = None

    @property
    def dims(self) -> Dims:
        """The sizes of this call (T, H, I, E, top_k, adapters, rank, slices)."""
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

    def _op_cfg(self, op: str, cfg: OpConfig | None) -> OpConfig:
        return cfg if cfg is not None else getattr(self.cfg, op)

    def _base(self, op: str, cfg: OpConfig | None = None):
        io = self._base_io(op)
        return fused_moe_gemm(
            io["x"],
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
        return topk_reduce(
            self.y, self.topk_ids, self.w13.shape[0], self.lora_ids, self.L, check_ids=self.nan_on_bad_ids
        )

    # --- groupings used by callers and benchmarks ---------------------------------------------
    def __call__(self, with_lora: bool = True) -> torch.Tensor:
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
        """
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
                io["x"],
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
