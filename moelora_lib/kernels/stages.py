"""What a stage is, the default configs, and the layer forward every stage shares.

A :class:`Stage` is a set of switches over the kernels of :mod:`.triton_kernels`; the stage modules
(``naive.py``, ``no_recompile.py``, ...) each define one and the registry in ``__init__`` lists them.
All stages run through :class:`LayerRun`, so they have the same signature and differ only by their
switches: a later stage never changes what an earlier one computes or how.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..routing import Alignment, align_tokens
from .config import LORA_OPS, LayerConfig, OpConfig, next_pow2
from .launchers import fused_moe_gemm, gated_act, lora_expand, lora_shrink

__all__ = ["Stage", "LayerRun", "default_config"]

NUM_SMS_H200 = 132


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


def default_config(T: int, hidden: int, intermediate: int, experts: int, top_k: int,
                   rank: int, adapters: int, slices: int = 2) -> LayerConfig:
    """Hand-picked H200 starting configs by average rows per group (no tuning).

    Base GEMMs: by T·K/E rows per expert. LoRA ops: by T·K/(L·E) rows per (adapter, expert) group
    (assuming every token has an adapter). SPLIT_K targets about two programs per SM of the H200
    for the shrink. BLOCK_SIZE_K = 64 keeps EVEN_K for every preset's hidden/intermediate.
    """
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
        while sk < 16 and est_blocks * S * sk < 2 * NUM_SMS_H200 and bk * sk * 4 <= K:
            sk *= 2
        return OpConfig(bm, bn, bk, 8, sk, 4, 3)

    def expand(N: int) -> OpConfig:
        bn = 128 if N >= 1024 and g_avg > 16 else 64
        return OpConfig(bm, bn, max(16, next_pow2(rank)), 8, 1, 4, 2)

    return LayerConfig(
        base_gate_up=base, base_down=base,
        gate_up_shrink=shrink(hidden, slices), gate_up_expand=expand(2 * intermediate // slices),
        down_shrink=shrink(intermediate, 1), down_expand=expand(hidden),
        source="default",
    )


class LayerRun:
    """One MoE+LoRA layer call split into its launches, with alignments and buffers made up front.

    ``LayerRun(...)()`` computes the layer; :meth:`base_part` and :meth:`lora_part` run the base
    launches or the four LoRA ops alone on the buffers of the last full call, which is what the
    benchmarks time. All inputs must already be validated (see :func:`moelora_lib.fused_moe_lora`).
    """

    def __init__(self, stage: Stage, hidden_states, w13, w2, topk_weights, topk_ids, lora_ids,
                 lora_a13, lora_b13, lora_a2, lora_b2, *, activation: str, b13=None, b2=None,
                 config: LayerConfig):
        self.stage = stage
        self.cfg = stage.adapt(config)
        self.x, self.w13, self.w2 = hidden_states, w13, w2
        self.b13, self.b2 = b13, b2
        self.lora = (lora_a13, lora_b13, lora_a2, lora_b2)
        self.activation = activation
        T, H = hidden_states.shape
        E = w13.shape[0]
        self.T, self.H, self.K = T, H, topk_ids.shape[1]
        self.I = w2.shape[2]
        self.L = lora_a13.shape[0]
        self.topk_w = topk_weights.reshape(-1).float().contiguous()
        self.base_align: Alignment = align_tokens(topk_ids, E, self.cfg.base_block_size_m,
                                                  check_values=False)
        self.lora_align: Alignment = align_tokens(topk_ids, E, self.cfg.lora_block_size_m,
                                                  lora_ids=lora_ids, num_adapters=self.L, check_values=False)
        P = T * self.K
        dt, dev = hidden_states.dtype, hidden_states.device
        self.h = torch.empty((P, 2 * self.I), dtype=dt, device=dev)
        self.y = torch.empty((P, H), dtype=dt, device=dev)
        self.g = None

    # --- the launches -------------------------------------------------------------------------
    def _lora_pair(self, x, lora_a, lora_b, out, shrink_cfg, expand_cfg, rows_div, topk_weights):
        st = self.stage
        inter = lora_shrink(x, lora_a, self.lora_align, shrink_cfg, rows_div=rows_div,
                            use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)
        if st.fused_add:
            lora_expand(inter, lora_b, out, self.lora_align, expand_cfg, topk_weights=topk_weights,
                        add_inputs=True, use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)
        else:
            delta = torch.zeros_like(out)
            lora_expand(inter, lora_b, delta, self.lora_align, expand_cfg, topk_weights=topk_weights,
                        add_inputs=False, use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)
            out.add_(delta)

    def base_gate_up(self):
        fused_moe_gemm(self.x, self.w13, self.h, self.base_align, self.cfg.base_gate_up, rows_div=self.K,
                       bias=self.b13, specialize_lengths=self.stage.specialize_lengths)

    def lora_gate_up(self):
        a13, b13l, _, _ = self.lora
        self._lora_pair(self.x, a13, b13l, self.h, self.cfg.gate_up_shrink, self.cfg.gate_up_expand,
                        self.K, None)

    def act(self):
        self.g = gated_act(self.h, self.activation, specialize_lengths=self.stage.specialize_lengths)

    def base_down(self):
        fused_moe_gemm(self.g, self.w2, self.y, self.base_align, self.cfg.base_down, rows_div=1,
                       bias=self.b2, topk_weights=self.topk_w,
                       specialize_lengths=self.stage.specialize_lengths)

    def lora_down(self):
        _, _, a2, b2l = self.lora
        self._lora_pair(self.g, a2, b2l, self.y, self.cfg.down_shrink, self.cfg.down_expand, 1, self.topk_w)

    def reduce(self) -> torch.Tensor:
        return self.y.view(self.T, self.K, self.H).sum(dim=1)

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
