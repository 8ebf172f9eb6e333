"""A compact decoder (gpt-fast style) for GPT-OSS, Qwen3-MoE and Qwen3 with multi-LoRA projections:
:class:`MultiLoRAModel`.

Every projection that can carry an adapter is one of the package's modules: attention q/k/v (fused, three
slices) and o, and the dense MLP's gate/up (fused, two slices) and down are :class:`moelora_lib.LoRALinear`;
the experts are a :class:`moelora_lib.MoELoRALayer`. Slot l of every one of them is adapter l, so a batch
mixes adapters per request (``lora_ids`` [B], -1 = none). The rest is plain torch, written after the
transformers 5 modules named in each docstring, and checked against them (tests/test_model_base.py).

Decoding state is a preallocated KV cache per layer, [max_batch, kv_heads, max_seq, head_dim] in the
model's dtype, written at (cache row, position) by tensor indexing: the forward makes no host sync and
no Python branch on tensor values (the value checks of ``start_pos``/``cache_rows`` run only for
CPU-resident index tensors), so a decode step can be captured in a CUDA graph.

Errors are ValueErrors naming the argument. Shapes use the letters of moelora_lib/shapes.py plus
B (requests), S (new tokens per request), V (vocab), D (head_dim), NH / NKV (q / kv heads).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..common import check_bool, describe, is_finite, is_int
from ..quant import FP8BlockWeight, MXFP4Weight
from .config import ModelConfig

__all__ = [
    "MultiLoRAModel",
    "RMSNorm",
    "Attention",
    "MoEBlock",
    "DenseMLP",
    "DecoderLayer",
    "rope_tables",
    "packed_expert_formats",
    "packed_expert_weight",
    "packed_linear_formats",
    "packed_linear_weight",
]

#: A weight source: our state-dict name and the expected shape -> a tensor of that shape (any float dtype,
#: any device; cast and moved by the model).
WeightSource = Callable[[str, tuple[int, ...]], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# rotary embedding
# --------------------------------------------------------------------------------------------------
def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention scaling) exactly as transformers 5 computes them
    (``compute_default_rope_parameters`` of the model classes; ``_compute_yarn_parameters`` in
    transformers/modeling_rope_utils.py for rope_type yarn, including ``truncate``)."""
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / pos_freqs, 1.0
    factor = ys["factor"]

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = ys.get("attention_factor")
    if attn is None:
        m, m_all = ys.get("mscale"), ys.get("mscale_all_dim")
        attn = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    orig = ys["original_max_position_embeddings"]

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(ys["beta_fast"]), correction_dim(ys["beta_slow"])
    if ys["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attn)


def rope_tables(config: ModelConfig, max_seq: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """(cos, sin), each [max_seq, D/2] of ``dtype``: cos/sin(position · inv_freq) · attention scaling,
    computed in float32 then cast, as transformers' rotary embedding forward does."""
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.arange(max_seq, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return (
        (freqs.cos() * scale).to(device=device, dtype=dtype),
        (freqs.sin() * scale).to(device=device, dtype=dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D] rotated by halves (``rotate_half``; GPT-OSS's ``_apply_rotary_emb`` is the same
    formula); cos/sin [B, S, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# --------------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 (transformers' ``GptOssRMSNorm`` /
    ``Qwen3RMSNorm``).

    ``weight_fp32=True`` (GPT-OSS, whose norms transformers keeps in fp32): weight [dim] float32,
    out = (weight · x̂).to(dtype); else (Qwen3): weight in the model dtype, out = weight · x̂.to(dtype).
    """

    def __init__(self, weight: torch.Tensor, eps: float, weight_fp32: bool):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.weight_fp32 = eps, weight_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_fp32:
            return (self.weight * xf).to(dt)
        return self.weight * xf.to(dt)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """:meth:`forward` of x [T, dim] in one launch (:func:`~moelora_lib.kernels.norm_rope.rms_norm`);
        with ``residual`` [T, dim]: (norm(x + residual), x + residual), the add fused. Equal to the torch
        path up to the fp32 order of the mean of squares (tests/test_norm_rope.py). Falls back to the torch
        ops where the kernel's dtype contract does not hold (e.g. a GPT-OSS norm weight cast off fp32)."""
        want = torch.float32 if self.weight_fp32 else x.dtype
        if (
            x.dim() != 2
            or self.weight.dtype != want
            or x.dtype not in (torch.float16, torch.bfloat16, torch.float32)
        ):
            if residual is None:
                return self(x)
            s = x + residual
            return self(s), s
        from ..kernels.norm_rope import rms_norm

        return rms_norm(x, self.weight, self.eps, weight_fp32=self.weight_fp32, residual=residual)


class Router(nn.Module):
    """Router logits = x·weightᵀ (+ bias): weight [E, H], bias [E] or None (``GptOssTopKRouter`` /
    ``Qwen3MoeTopKRouter``; the softmax/top-k is done by the MoE layer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Ctx:
    """Per-forward tensors every layer shares (built once by :meth:`MultiLoRAModel.forward`).

    At decode (S = 1): ``seq_lens`` [B] int64 = start_pos + 1 (the cache positions each request sees) and no
    masks (None); at prefill (S > 1): the masks [B, 1, S, kv_len] bool and ``seq_lens`` None."""

    __slots__ = (
        "B",
        "S",
        "ids",
        "cos_tab",
        "sin_tab",
        "t_rows",
        "t_pos",
        "rows",
        "kv_len",
        "mask_full",
        "mask_slide",
        "seq_lens",
    )


class Attention(nn.Module):
    """Causal GQA self-attention with a preallocated KV cache (transformers' ``GptOssAttention`` /
    ``Qwen3MoeAttention`` / ``Qwen3Attention`` with their eager attention; GPT-OSS sinks as in its
    ``eager_attention_forward``: softmax over [scores, sink_h] per head, the sink column dropped).

    Children: ``qkv_proj`` (LoRALinear, slices (NH·D, NKV·D, NKV·D)), ``o_proj`` (LoRALinear, one slice
    H), ``q_norm``/``k_norm`` (qk_norm models), ``sinks`` [NH] (gpt_oss). Buffers ``k_cache``/``v_cache``
    [max_batch, NKV, max_seq, D] (not in the state dict). Under tensor parallelism (``tp`` = (rank, world))
    the layer holds NH/world query heads and NKV/world KV heads (head h on rank h // (NH/world)): qkv_proj
    is a :class:`~moelora_lib.parallel.ColumnParallelLoRALinear` (its q, k, v rows of those heads), o_proj a
    :class:`~moelora_lib.parallel.RowParallelLoRALinear` (its input columns of those heads, all-reduced),
    the KV cache and ``sinks`` hold those heads only; the attention itself is per head, so it needs no
    communication.

    Attention at decode (S = 1), every family (sinks or not, sliding or full layers): the Triton split-KV
    kernel :func:`moelora_lib.kernels.decode_attention.decode_attention` (flash decoding) reads the cache
    rows in place at the visible positions only (p < start_pos + 1, and the window), the NH/NKV query heads
    of a KV head as the rows of one tile, float32 softmax, the sink added to the denominator; two launches
    per layer whatever kv_len (a graph-captured step has kv_len = max_seq). At prefill (S > 1): with sinks,
    one SDPA call with a virtual sink key (:meth:`sinks_sdpa`, no score tensor; float32 softmax inside
    SDPA, where transformers' eager path runs it in the model dtype: equal in fp32, slightly more accurate
    here in bf16/fp16); without sinks, torch SDPA with a boolean mask over NKV heads of NH/NKV·S query rows
    each (the query heads that share a KV head laid out as rows, the mask repeated per head), so the cache
    is read as it is. Not ``enable_gqa``: with a mask that leaves SDPA only its math backend on CUDA, which
    repeats K/V to NH heads and upcasts them to float32 over all ``kv_len`` positions on every call (several
    times the decode step's weight bytes on Qwen3-32B). :meth:`sinks_explicit` (explicit matmul, float32
    scores [B, NKV, NH/NKV·S, kv_len]) is kept as an oracle for tests and notebooks. ``sliding_window`` W
    (sliding layers): query at position p sees keys in (p - W, p].
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        lin: Callable,
        take: Callable,
        max_batch: int,
        max_seq: int,
        tp: tuple[int, int] = (0, 1),
    ):
        super().__init__()
        c = config
        rank, world = tp  # tensor parallelism: this rank's NH/world query and NKV/world KV heads
        self.nh, self.nkv, self.hd = (
            c.num_attention_heads // world,
            c.num_key_value_heads // world,
            c.head_dim,
        )
        self.scale = self.hd**-0.5
        sl = (c.q_width, c.kv_width, c.kv_width)
        self.qkv_proj = lin("qkv_proj", sum(sl), c.hidden_size, c.attention_bias, sl, tp="column")
        self.o_proj = lin("o_proj", c.hidden_size, c.q_width, c.attention_bias, None, tp="row")
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            self.q_norm = RMSNorm(take("q_norm.weight", (self.hd,), "norm"), c.rms_norm_eps, False)
            self.k_norm = RMSNorm(take("k_norm.weight", (self.hd,), "norm"), c.rms_norm_eps, False)
        self.sinks = None
        if c.sinks:
            heads = slice(rank * self.nh, (rank + 1) * self.nh)
            sinks = take("sinks", (c.num_attention_heads,), "weight", shard=lambda t: t[heads])
            self.sinks = nn.Parameter(sinks, requires_grad=False)
        self.sliding = c.layer_types[layer] == "sliding_attention"
        self.sliding_window = c.sliding_window if self.sliding else None
        z = dict(dtype=self.qkv_proj.dtype, device=self.qkv_proj.device)
        shape = (max_batch, self.nkv, max_seq, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape, **z), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, **z), persistent=False)

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """x [T = B·S, H] -> [T, H]; writes this call's K/V into the cache first."""
        B, S, nh, nkv, hd = ctx.B, ctx.S, self.nh, self.nkv, self.hd
        from ..kernels.norm_rope import qk_norm_rope_cache

        qkv = self.qkv_proj(x, ctx.ids)
        qn, kn = self.q_norm, self.k_norm
        # q/k-norm, rope, the K/V cache writes at (row, position): one launch; q [B, NH, S, D] head-major
        q = qk_norm_rope_cache(
            qkv,
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=hd,
            batch=B,
            cos=ctx.cos_tab,
            sin=ctx.sin_tab,
            positions=ctx.t_pos,
            cache_rows=ctx.t_rows,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            q_norm_weight=None if qn is None else qn.weight,
            k_norm_weight=None if kn is None else kn.weight,
            eps=1e-6 if qn is None else qn.eps,
            check_values=False,  # the forward checked its host-side indices; device ones are unchecked
        )
        if S == 1:  # decode: split-KV kernel over the cache in place (no mask, no copy, no score tensor)
            from ..kernels import decode_attention as da

            o = da.decode_attention(
                q.view(B, nh, hd),
                self.k_cache,
                self.v_cache,
                ctx.seq_lens,
                cache_rows=ctx.rows,
                sliding_window=self.sliding_window,
                sinks=self.sinks,
                scale=self.scale,
                check_values=False,
            )
            return self.o_proj(o.view(B, nh * hd), ctx.ids)
        L = ctx.kv_len
        if ctx.rows is None:  # rows 0..B-1: a view, no copy
            kc, vc = self.k_cache[:B, :, :L], self.v_cache[:B, :, :L]
        else:
            kc, vc = self.k_cache[:, :, :L][ctx.rows], self.v_cache[:, :, :L][ctx.rows]
        mask = ctx.mask_slide if self.sliding else ctx.mask_full  # [B, 1, S, L] bool
        g = nh // nkv  # q head h uses kv head h // g (transformers' repeat_kv): rows j·S + s of that head
        qg = q.view(B, nkv, g * S, hd)  # q is head-major already: no copy
        if self.sinks is None:
            mg = mask[:, :, None].expand(B, 1, g, S, L).reshape(B, 1, g * S, L)
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mg, scale=self.scale)
            o = o.reshape(B, nh, S, hd)  # not view: CUDA's fused SDPA kernels return a transposed layout
        else:
            o = self.sinks_sdpa(qg, kc, vc, mask, self.sinks, self.scale).reshape(B, nh, S, hd)
        o = o.transpose(1, 2).reshape(B * S, nh * hd)
        return self.o_proj(o, ctx.ids)

    @staticmethod
    def sinks_explicit(
        qg: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        mask: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Sink attention by an explicit matmul and float32 softmax over [scores, sink_h]: qg [B, NKV, g·S, D]
        (row j·S + s is query head kv·g + j), kc/vc [B, NKV, L, D], mask [B, 1, S, L] bool, sinks [NH]
        -> [B, NKV, g·S, D]. Materializes float32 scores [B, NKV, g·S, L]. Not used by the forward (decode
        runs the split-KV kernel, prefill :meth:`sinks_sdpa`): the oracle of tests and notebooks."""
        B, nkv, L = kc.shape[0], kc.shape[1], kc.shape[2]
        S = mask.shape[-2]
        g = qg.shape[2] // S
        scores = torch.matmul(qg, kc.transpose(-1, -2)).float().view(B, nkv, g, S, L) * scale
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        sink = sinks.float().view(1, nkv, g, 1, 1).expand(B, nkv, g, S, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :L]
        return torch.matmul(probs.to(vc.dtype).view(B, nkv, g * S, L), vc)

    @staticmethod
    def sinks_sdpa(
        qg: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        mask: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """The same as :meth:`sinks_explicit`, by one fused SDPA call (no score tensor; used at prefill).

        One virtual key is appended per KV head at index L, always visible, with value 0: it adds
        exp(logit) to every row's softmax denominator and nothing to the numerator, as the sink does. Its
        logit must be sink_h of the row's QUERY head h, but the g query heads that share a KV head are
        folded into rows of that head (as in the Qwen path: K/V not repeated), so one key cannot carry
        g different sinks. The sink therefore rides on the query side: the head dim is augmented to
        Dp = round_up(D + 2, 8) (fused kernels want a multiple of 8; 64 -> 72) with
            q' = [q, c_hi, c_lo, 0…],  k' = [k, 0, 0, 0…] (real keys),  k_sink = [0…0, 1, 1, 0…],
        c_hi + c_lo = sink_h / scale per row (c_hi = sink_h/scale rounded to the model dtype, c_lo the
        rounding remainder: ~16 significant bits in bf16, exact in fp32). Real keys see q·k + 0 exactly;
        the sink key's logit is scale·(c_hi + c_lo) = sink_h (SDPA accumulates the dot in fp32). ``scale``
        is passed explicitly, so it is the softmax scale of both. The mask gets the sink column
        (always True) and is passed as an additive mask in the model dtype whose row stride is a multiple
        of 16 (so the memory-efficient CUDA kernel takes it without padding a copy).

        Copies: q', k', v' (Dp wide, L + 1 keys) and the additive mask [B, 1, g·S, L + 1]; all O(L·D) or
        O(g·S·L) in the model dtype, against the explicit path's float32 [B, NKV, g·S, L] scores (and
        their several float32 intermediates). No host sync, no branch on tensor values."""
        B, nkv, L, hd = kc.shape
        gS, S = qg.shape[2], mask.shape[-2]
        g = gS // S
        dt, dev = qg.dtype, qg.device
        Dp = (hd + 2 + 7) // 8 * 8
        c = sinks.float().view(nkv, g, 1).expand(nkv, g, S).reshape(1, nkv, gS) / scale
        c_hi = c.to(dt)
        c_lo = (c - c_hi.float()).to(dt)
        qa = qg.new_zeros(B, nkv, gS, Dp)
        qa[..., :hd] = qg
        qa[..., hd] = c_hi
        qa[..., hd + 1] = c_lo
        ka = kc.new_zeros(B, nkv, L + 1, Dp)
        ka[:, :, :L, :hd] = kc
        ka[:, :, L, hd : hd + 2] = 1
        va = vc.new_zeros(B, nkv, L + 1, Dp)  # Dp wide too, so every fused backend accepts equal head dims
        va[:, :, :L, :hd] = vc
        Lp = (L + 1 + 15) // 16 * 16
        madd = torch.zeros(B, g, S, Lp, dtype=dt, device=dev)
        madd[..., :L].masked_fill_(~mask, float("-inf"))  # mask [B, 1, S, L] broadcast over the g heads
        madd = madd.view(B, 1, gS, Lp)[..., : L + 1]  # column L (the sink) stays 0: always visible
        o = F.scaled_dot_product_attention(qa, ka, va, attn_mask=madd, scale=scale)
        return o[..., :hd]


class MoEBlock(nn.Module):
    """Router + experts (transformers' ``GptOssMLP`` / ``Qwen3MoeSparseMoeBlock``): logits = x·W_rᵀ (+ b_r),
    then the MoELoRALayer routes (softmax over E, top-k, renormalize iff ``norm_topk_prob``; for GPT-OSS
    this equals its softmax over the top-k logits) and runs the experts with the tokens' adapters."""

    def __init__(self, router: Router, experts):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return self.experts(x, self.router(x), lora_ids=ctx.ids)


class DenseMLP(nn.Module):
    """silu(gate)·up then down (transformers' ``Qwen3MLP``); ``gate_up_proj`` LoRALinear slices (I, I),
    ``down_proj`` LoRALinear."""

    def __init__(self, gate_up_proj, down_proj):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.I = gate_up_proj.out_features // 2

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, ctx.ids).split(self.I, dim=-1)
        return self.down_proj(F.silu(gate) * up, ctx.ids)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(·)) (transformers' ``*DecoderLayer``)."""

    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(self, x: torch.Tensor, ctx: _Ctx, normed: torch.Tensor | None = None, next_norm=None):
        """x [T, H] -> x [T, H] (torch adds and norms). With ``next_norm`` (how the model's forward calls it):
        ``normed`` = input_layernorm(x) from the previous layer, each residual add fused into the following
        RMSNorm (:meth:`RMSNorm.fused`), and returns (x, next_norm(x))."""
        if next_norm is None:
            x = x + self.self_attn(self.input_layernorm(x), ctx)
            return x + self.mlp(self.post_attention_layernorm(x), ctx)
        h, x = self.post_attention_layernorm.fused(self.self_attn(normed, ctx), residual=x)
        h, x = next_norm.fused(self.mlp(h, ctx), residual=x)
        return x, h


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------
def packed_expert_formats() -> frozenset[str]:
    """The packed expert-weight formats :class:`moelora_lib.MoELoRALayer` takes as they are ("mxfp4":
    :class:`~moelora_lib.quant.MXFP4Weight` for ``w13`` / ``w2``; "fp8":
    :class:`~moelora_lib.quant.FP8BlockWeight`): the class attribute ``MoELoRALayer.PACKED_FORMATS`` (a
    tuple of names), empty where the layer does not define it, i.e. while it runs dense weights only.
    :func:`~moelora_lib.model.load_hf_checkpoint` keeps a checkpoint's packed experts packed by default
    exactly when its format is listed here."""
    from .. import MoELoRALayer

    return frozenset(getattr(MoELoRALayer, "PACKED_FORMATS", ()))


def packed_linear_formats() -> frozenset[str]:
    """The packed weight formats :class:`moelora_lib.LoRALinear` (attention q/k/v/o, the dense MLP) takes
    as they are ("fp8": :class:`~moelora_lib.quant.FP8BlockWeight` as ``weight``): the class attribute
    ``LoRALinear.PACKED_FORMATS`` (a tuple of names), empty where the layer does not define it.
    :func:`~moelora_lib.model.load_hf_checkpoint` keeps a checkpoint's FP8 projections in FP8 by default
    exactly when "fp8" is listed here."""
    from .. import LoRALinear

    return frozenset(getattr(LoRALinear, "PACKED_FORMATS", ()))


def _format_of(w) -> str:
    return "mxfp4" if isinstance(w, MXFP4Weight) else "fp8"


def packed_expert_weight(
    w: MXFP4Weight | FP8BlockWeight, *, name: str, shape: tuple[int, ...], device
) -> MXFP4Weight | FP8BlockWeight:
    """What :class:`moelora_lib.MoELoRALayer` receives for a packed expert weight ``w`` (``name`` the
    model's state-dict name ``layers.{l}.mlp.experts.w13`` or ``.w2``; ``shape`` the dense shape the
    layer expects, w13 [E, 2I, H] or w2 [E, H, I], rows = output features as in the dense layout, gate
    and up interleaved along 2I for GPT-OSS, [gate | up] rows for Qwen3-MoE): ``w`` on ``device``, kept
    packed — MXFP4 (uint8 blocks [..., K/32, 16] and scales [..., K/32], as published) or block FP8
    (float8_e4m3fn [..., N, K] and its scale grid). The one place where packed expert weights enter the
    model; the layer takes its activation dtype from the model (a packed weight carries none).

    A packed MoE kernel path plugs in by listing its format in ``MoELoRALayer.PACKED_FORMATS`` (see
    :func:`packed_expert_formats`) and accepting the weight as ``w13`` / ``w2``; until then such a weight
    raises NotImplementedError here and the dense path runs by dequantizing at load
    (``load_hf_checkpoint(..., dequantize=True)``).

    Raises:
        ValueError: ``w``'s dense shape is not ``shape`` (naming ``name``).
        NotImplementedError: the MoE layer has no kernels for ``w``'s format (not in its
            PACKED_FORMATS).
    """
    shape = tuple(shape)
    fmt = _format_of(w)
    if tuple(w.shape) != shape:
        raise ValueError(
            f"weights[{name!r}]: expected shape {list(shape)}, got {fmt.upper()} of shape {list(w.shape)}"
        )
    if fmt not in packed_expert_formats():
        raise NotImplementedError(
            f"weights[{name!r}]: {fmt.upper()} expert weights need {fmt.upper()} MoE kernels, which "
            "MoELoRALayer does not have (its PACKED_FORMATS: "
            f"{sorted(packed_expert_formats())}); load the checkpoint with load_hf_checkpoint(..., "
            "dequantize=True) (exact dequantization to the model dtype), or pass dense weights"
        )
    return w.to(device)


def packed_linear_weight(w: FP8BlockWeight, *, name: str, shape: tuple[int, ...], device) -> FP8BlockWeight:
    """What :class:`moelora_lib.LoRALinear` receives for a packed projection weight ``w`` (``name`` the
    model's state-dict name, e.g. ``layers.{l}.self_attn.qkv_proj.weight`` or
    ``layers.{l}.mlp.down_proj.weight``; ``shape`` the dense [N_total, H] the layer expects, fused slices
    stacked along the rows): a block-FP8 :class:`~moelora_lib.quant.FP8BlockWeight` (float8_e4m3fn
    [N_total, H] and its scale grid) on ``device``, kept in FP8. The one place where packed dense
    projection weights enter the model.

    LoRALinear lists "fp8" in its ``PACKED_FORMATS`` (see :func:`packed_linear_formats`) and takes the
    weight as ``weight`` with a ``dtype`` keyword (the activations' dtype: the model passes its own,
    since a packed weight carries none, as it does for :class:`moelora_lib.MoELoRALayer`) and the
    model's ``activation_scheme``; where a layer class does not list it, this raises NotImplementedError
    and the dense path runs by dequantizing at load (``load_hf_checkpoint(..., dequantize=True)``).

    Raises:
        ValueError: ``w`` is not an FP8BlockWeight (MXFP4 is read for experts only) or its shape is not
            ``shape`` (naming ``name``).
        NotImplementedError: LoRALinear does not list "fp8" in its PACKED_FORMATS.
    """
    shape = tuple(shape)
    if not isinstance(w, FP8BlockWeight):
        raise ValueError(
            f"weights[{name!r}]: a packed dense projection must be an FP8BlockWeight, got {type(w).__name__}"
        )
    if tuple(w.shape) != shape:
        raise ValueError(f"weights[{name!r}]: expected shape {list(shape)}, got FP8 of shape {list(w.shape)}")
    if "fp8" not in packed_linear_formats():
        raise NotImplementedError(
            f"weights[{name!r}]: FP8 projection weights need block-FP8 GEMMs, which LoRALinear does not have "
            "(its PACKED_FORMATS list no 'fp8'); load the checkpoint with load_hf_checkpoint(..., "
            "dequantize=True) (exact dequantization to the model dtype), or pass dense weights"
        )
    return w.to(device)


def _check_device(device, dtype: torch.dtype) -> torch.device:
    """``device`` as a torch.device the kernels can run ``dtype`` on, else ValueError naming it: a CUDA
    device that exists, or the CPU with the Triton interpreter on and no bfloat16."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be a torch device such as 'cuda', 'cuda:0' or 'cpu', got {device!r}"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(dev)!r}: CUDA is not available here (use device='cpu' on a CPU machine)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    if dev.type != "cpu":
        raise ValueError(f"device must be a CUDA device or the CPU (where the kernels run), got {str(dev)!r}")
    if dtype == torch.bfloat16:
        raise ValueError(
            "dtype: bfloat16 is not supported on the CPU (the Triton interpreter multiplies raw bf16 bit "
            "patterns, triton-lang/triton#11584); use torch.float16 or torch.float32 with device='cpu', "
            "bfloat16 on a GPU"
        )
    from ..linear import _check_cpu_backend

    try:
        _check_cpu_backend(dtype)
    except ValueError:
        raise ValueError(
            "device='cpu': the kernels run on the CPU only through the Triton interpreter: set "
            "TRITON_INTERPRET=1 before moelora_lib builds its first kernel (restart the process if one was "
            "already built), or use a CUDA device"
        ) from None
    return dev


def _parallel_groups(config: ModelConfig, tp_group, ep_group) -> tuple[tuple[int, int], tuple[int, int]]:
    """((tp rank, tp world), (ep rank, ep world)) of the model's process groups ((0, 1) for None), after
    the checks: ValueError naming ``tp_group`` when its size does not divide the attention heads, the KV
    heads (the cache is sharded by heads) or the dense MLP's intermediate size, naming ``ep_group`` when it
    is given for a dense model or its size does not divide num_experts; either not a process group."""
    tp = ep = (0, 1)
    if tp_group is None and ep_group is None:
        return tp, ep
    from ..parallel.comm import check_group, group_rank_world

    if tp_group is not None:
        tp = group_rank_world(check_group(tp_group, "tp_group"))
        w = tp[1]
        sizes = [
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
        ]
        if not config.is_moe:
            sizes.append(("intermediate_size", config.intermediate_size))
        for name, n in sizes:
            if n % w:
                why = "; the KV cache is sharded by heads" if name == "num_key_value_heads" else ""
                raise ValueError(
                    f"tp_group: its size {w} must divide the config's {name} = {n} (each rank holds "
                    f"{name}/world{why})"
                )
    if ep_group is not None:
        if not config.is_moe:
            raise ValueError(
                f"ep_group: a {config.model_type} model has no experts (expert parallelism is for MoE)"
            )
        ep = group_rank_world(check_group(ep_group, "ep_group"))
        if config.num_experts % ep[1]:
            raise ValueError(
                f"ep_group: its size {ep[1]} must divide num_experts = {config.num_experts} (each rank holds "
                "E/world experts)"
            )
    return tp, ep


def _tp_linear(take: Callable, name: str, n_out: int, n_in: int, bias: bool, slices, kind: str, group, kw):
    """The tensor-parallel projection ``name`` (``{name}.weight`` / ``.bias`` through ``take``, each rank
    cutting its shard before the copy to the device): "column" (qkv, gate_up) or "row" (o, down)."""
    from ..parallel import ColumnParallelLoRALinear, RowParallelLoRALinear
    from ..parallel.comm import group_rank_world

    rank, world = group_rank_world(group)

    def packed(w, *, name, shape, device):  # the shard of an FP8 projection is not implemented
        raise NotImplementedError(
            f"weights[{name!r}]: tensor parallelism of packed (FP8) projections is not implemented; load "
            "the checkpoint with dequantize=True"
        )

    if kind == "column":
        sl = (n_out,) if slices is None else tuple(slices)

        def shard(t):
            return ColumnParallelLoRALinear.shard_weight(t, sl, rank, world)

        w = take(f"{name}.weight", (n_out, n_in), packed=packed, shard=shard)
        b = take(f"{name}.bias", (n_out,), "bias", shard=shard) if bias else None
        return ColumnParallelLoRALinear(w, b, slices=sl, group=group, **kw)

    def shard_cols(t):
        return RowParallelLoRALinear.shard_weight(t, rank, world)

    w = take(f"{name}.weight", (n_out, n_in), packed=packed, shard=shard_cols)
    b = take(f"{name}.bias", (n_out,), "bias") if bias else None
    return RowParallelLoRALinear(w, b, group=group, **kw)


def random_weights(seed: int = 0, std: float = 0.02) -> WeightSource:
    """A :data:`WeightSource` of random weights: each tensor N(0, std²) from its own generator seeded by
    (seed, name) on the model's device, so a tensor does not depend on which others were drawn; norm
    weights are ones. With std 0.02 activations stay finite in bf16 through all layers."""

    def source(name: str, shape: tuple[int, ...], *, kind: str, dtype: torch.dtype, device) -> torch.Tensor:
        if kind == "norm":
            return torch.ones(shape, dtype=dtype, device=device)
        g = torch.Generator(device=device)
        g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    source.is_random = True  # type: ignore[attr-defined]
    return source


class MultiLoRAModel(nn.Module):
    """A causal LM with L adapter slots in every LoRA-capable projection and a preallocated KV cache.

    Args:
        config: a :class:`ModelConfig`.
        dtype: float16/bfloat16/float32 (CPU: float16/float32 through the Triton interpreter).
        device: where every weight, slot, cache and scratch buffer lives (built there directly).
        num_adapters: L slots; max_rank: R, the largest rank a slot holds.
        max_batch: rows of the KV cache (and the largest B); max_seq: positions per row (the largest
            start_pos + S); max_tokens: the largest B·S of one forward (sizes the LoRA/MoE scratch),
            at least max_batch (a decode step of max_batch requests is one forward of max_batch tokens).
        stage: "auto" (default): every MoE layer (:class:`moelora_lib.MoELoRALayer`) picks stage "fused"
            or "tuned" per T from the config files (:func:`moelora_lib.configs.load_stage_choice`;
            "tuned" where no file records a choice, e.g. on the CPU), resolved on the host once per T
            (a decode bucket's or padded prefill's CUDA graph is captured after a warm-up at its T);
            the dense projections (:class:`moelora_lib.LoRALinear`; no per-T choice is recorded for
            them) run stage "tuned". Or a name of :data:`moelora_lib.kernels.STAGES` for every LoRA and
            MoE module. The read-only property ``stage`` returns the name given.
        deterministic: every LoRA/MoE module in its bitwise-repeatable mode (their split-K launches —
            the shrinks, stage ``fused``'s down GEMM — run with SPLIT_K = 1; ``MoELoRALayer``'s
            ``deterministic``). The rest of a forward (cuBLAS
            GEMMs, norms, rope, decode attention's split-KV combine, the top-k sum) uses no atomics.
            Fixed at construction (the read-only property ``deterministic``): a Generator's CUDA
            graphs bake the launch configs in. Default False.
        weights: our state-dict names (``model.state_dict()`` keys, e.g.
            ``layers.0.self_attn.qkv_proj.weight``) -> tensors, any float dtype/device (cast and moved);
            or a callable ``(name, shape, *, kind, dtype, device) -> tensor`` (``kind`` "weight", "bias"
            or "norm"); or None = :func:`random_weights` (seed 0). The expert weights
            ``layers.{l}.mlp.experts.w13`` / ``.w2`` may also be packed, both or neither:
            :class:`~moelora_lib.quant.MXFP4Weight` s of the same dense shape, or (a mapping such as a
            packed model's ``state_dict()``) ``{name}_blocks`` + ``{name}_scales`` uint8 tensors in
            place of ``{name}``; they go through :func:`packed_expert_weight` and stay packed in the
            MoE layer, which runs them in ``dtype``.
            Block-FP8 weights (:class:`~moelora_lib.quant.FP8BlockWeight` of the same dense shape) may
            stand for the experts' ``w13`` / ``w2`` and for the dense projections' ``*.weight``
            (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``); they go through
            :func:`packed_expert_weight` / :func:`packed_linear_weight` and stay FP8 in the layers
            (MoELoRALayer's ``W_FP8`` GEMMs; LoRALinear's :mod:`~moelora_lib.kernels.dense_fp8` GEMM).
        activation_scheme: how the FP8 GEMMs treat their activations, for the FP8 attention / dense MLP
            projections (:class:`moelora_lib.LoRALinear`'s ``activation_scheme``) and the FP8 experts
            (:class:`moelora_lib.MoELoRALayer`'s): "auto" (default: per forward, weight-only below a
            token count and W8A8 with dynamic per-token activation quantization from there —
            :data:`~moelora_lib.kernels.dense_fp8.DENSE_W8A8_MIN_TOKENS` for the projections,
            ``MoELoRALayer.W8A8_MIN_TOKENS`` for the experts), "weight_only" or "dynamic" (FP8 scale
            blocks of a multiple of 32 columns). Dense and MXFP4 weights run as they do without it.
        tp_group: a ``torch.distributed`` process group for tensor parallelism, or None (default): each rank
            holds NH/world query and NKV/world KV heads (qkv_proj column-parallel, o_proj row-parallel, the
            KV cache and sinks of those heads; :class:`Attention`) and, in a dense model, I/world of the MLP
            (gate_up column-, down row-parallel), with the S-LoRA split of the adapters
            (:mod:`moelora_lib.parallel.tensor`); embeddings, norms, routers and lm_head are replicated.
        ep_group: a process group for expert parallelism (MoE models), or None: each rank holds E/world
            experts (the contiguous split) and their adapter slots, and the MoE output is all-reduced
            (:class:`~moelora_lib.parallel.ExpertParallelMoELoRALayer`, tokens replicated: every rank runs
            the same batch). Usually the same group as ``tp_group``. With either group, every rank builds
            the model from the same ``weights`` (each cuts its shard before the copy to ``device``), loads
            the same adapters and makes the same calls; the logits are the same on every rank.
    Raises:
        ValueError naming the argument: a stage that is neither "auto" nor a name of
        :data:`~moelora_lib.kernels.STAGES` (the message lists them), sizes not positive ints,
        max_tokens < max_batch, a device that is neither an existing CUDA device nor the CPU (the CPU
        needs TRITON_INTERPRET=1 and float16/float32), a missing/unexpected weight name, a weight of the
        wrong shape or not finite in ``dtype``, a group size that does not divide the heads (tp_group) or
        the experts (ep_group), and what LoRALinear/MoELoRALayer refuse.
        NotImplementedError: packed weights in a format the layer they go to does not run
        (:func:`packed_expert_weight`, :func:`packed_linear_weight`).
    ``device`` and ``dtype`` are properties that follow ``.to()``.

    Slots in use: :meth:`hold_slots` marks slots that a running generate call reads; while held, a
    slot cannot be loaded or unloaded (RuntimeError from :meth:`check_slot_free`, before anything
    changes: every LoRA module's ``slot_guard`` is this model's ``check_slot_free``). ``slots_in_use``
    lists them. :meth:`restrict_slots` narrows the slots a forward serves, so that the LoRA launches no
    served adapter needs are skipped (:meth:`lora_launches`). :meth:`exclusive_forwards` reserves the
    forward for a running generate call: any other forward meanwhile raises RuntimeError instead of
    overwriting the KV cache rows the call uses.

    Shared alignments: the dense projections' token alignment (empty slots mapped to -1, tokens grouped
    by adapter) depends only on the forward's ``lora_ids``, T, BLOCK_SIZE_M, L and the projection's loaded
    slots, so each forward runs its layers inside ``step_alignments.scope()``
    (:class:`~moelora_lib.linear.StepAlignments`): the first projection of each such key aligns and the
    others read it, into workspaces ``step_alignments`` keeps for the model's life (a captured decode
    step records one alignment launch per key instead of one per projection). ``share_alignments =
    False`` aligns per projection; the logits are the same bit for bit.

    Module tree (names the adapter loader relies on): ``embed_tokens``, ``layers[l].input_layernorm``,
    ``.self_attn.{qkv_proj, o_proj, q_norm, k_norm, sinks}``, ``.post_attention_layernorm``, ``.mlp``
    (:class:`MoEBlock` with ``.router``, ``.experts`` or :class:`DenseMLP` with ``.gate_up_proj``,
    ``.down_proj``), ``norm``, ``lm_head``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device,
        num_adapters: int,
        max_rank: int,
        max_batch: int,
        max_seq: int,
        max_tokens: int,
        stage: str = "auto",
        weights: Mapping[str, torch.Tensor] | Callable | None = None,
        deterministic: bool = False,
        activation_scheme: str = "auto",
        tp_group=None,
        ep_group=None,
    ):
        super().__init__()
        check_bool("deterministic", deterministic)
        from .. import LoRALinear, MoELoRALayer
        from ..kernels import AUTO_STAGE, check_stage_name
        from ..kernels.dense_fp8 import ACTIVATION_SCHEMES

        check_stage_name(stage)
        if not isinstance(activation_scheme, str) or activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"activation_scheme must be one of {list(ACTIVATION_SCHEMES)}, got {activation_scheme!r}"
            )
        tp, ep = _parallel_groups(config, tp_group, ep_group)

        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        for name, v in (
            ("num_adapters", num_adapters),
            ("max_rank", max_rank),
            ("max_batch", max_batch),
            ("max_seq", max_seq),
            ("max_tokens", max_tokens),
        ):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if max_tokens < max_batch:
            raise ValueError(
                f"max_tokens = {max_tokens} must be >= max_batch = {max_batch}: a decode step runs up to "
                "max_batch requests of one token each in one forward of at most max_tokens tokens"
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
        device = _check_device(device, dtype)
        self.config = config
        self.num_adapters, self.max_rank = num_adapters, max_rank
        self.max_batch, self.max_seq, self.max_tokens = max_batch, max_seq, max_tokens
        if weights is None:
            weights = random_weights(0)
        used: set[str] = set()
        check_finite = not getattr(weights, "is_random", False)  # random_weights are finite by construction

        def take(
            name: str,
            shape: tuple[int, ...],
            kind: str = "weight",
            dt: torch.dtype = dtype,
            packed: Callable | None = None,
            shard: Callable | None = None,
        ) -> torch.Tensor | MXFP4Weight | FP8BlockWeight:
            shape = tuple(int(s) for s in shape)
            if callable(weights) and not isinstance(weights, Mapping):
                t = weights(name, shape, kind=kind, dtype=dt, device=device)
            elif packed is packed_expert_weight and name not in weights and f"{name}_blocks" in weights:
                # a packed state dict
                parts = (f"{name}_blocks", f"{name}_scales")
                if parts[1] not in weights:
                    raise ValueError(f"weights: {parts[0]!r} without {parts[1]!r}")
                try:
                    t = MXFP4Weight(*(weights[k] for k in parts))
                except ValueError as exc:
                    raise ValueError(f"weights[{parts[0]!r}] / [{parts[1]!r}]: {exc}") from None
                used.update(parts)
            else:
                if name not in weights:
                    raise ValueError(f"weights: missing {name!r} (expected shape {list(shape)})")
                t = weights[name]
            used.add(name)
            if packed is not None and isinstance(t, (MXFP4Weight, FP8BlockWeight)):
                t = packed(t, name=name, shape=shape, device=device)
                return t if shard is None else shard(t)  # experts: shard_experts takes packed weights
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"weights[{name!r}] must be a float tensor, got {describe(t)}")
            if tuple(t.shape) != shape:
                raise ValueError(f"weights[{name!r}]: expected shape {list(shape)}, got {list(t.shape)}")
            if shard is not None:  # this rank's part, cut before the copy to the device
                t = shard(t)
            t = t.detach().to(device=device, dtype=dt).contiguous()
            if check_finite and not is_finite(t):
                raise ValueError(
                    f"weights[{name!r}]: not finite in {dt} (inf/NaN in the source, or values beyond the "
                    f"range of {dt})"
                )
            return t

        c = config
        H, V = c.hidden_size, c.vocab_size
        mods = dict(
            num_adapters=num_adapters,
            max_rank=max_rank,
            max_tokens=max_tokens,
            stage=stage,
            deterministic=deterministic,
        )
        # the dense projections have no per-T stage choice: under "auto" they run stage "tuned"
        dense = dict(mods, stage="tuned" if stage == AUTO_STAGE.name else stage)
        self._deterministic = deterministic
        self._stage = stage
        gpt = c.model_type == "gpt_oss"
        norm_dt = torch.float32 if gpt else dtype

        self.embed_tokens = nn.Embedding.from_pretrained(take("embed_tokens.weight", (V, H)), freeze=True)
        layers = []
        for li in range(c.num_hidden_layers):
            p = f"layers.{li}."

            def lin(name, n_out, n_in, bias, slices, _p=p, _sub="self_attn.", tp=None):
                if tp_group is not None and tp is not None:  # "column" / "row": this rank's shard
                    return _tp_linear(
                        take, f"{_p}{_sub}{name}", n_out, n_in, bias, slices, tp, tp_group, dense
                    )
                w = take(f"{_p}{_sub}{name}.weight", (n_out, n_in), packed=packed_linear_weight)
                b = take(f"{_p}{_sub}{name}.bias", (n_out,), "bias") if bias else None
                # a packed (FP8) weight carries no activation dtype: the layer takes the model's
                fp8 = (
                    {"dtype": dtype, "activation_scheme": activation_scheme}
                    if isinstance(w, FP8BlockWeight)
                    else {}
                )
                return LoRALinear(w, b, slices=slices, **dense, **fp8)

            def take_l(name, shape, kind="weight", _p=p, shard=None):
                return take(f"{_p}self_attn.{name}", shape, kind, shard=shard)

            attn = Attention(c, li, lin, take_l, max_batch, max_seq, tp=tp)
            if c.is_moe:
                E, I = c.num_experts, c.moe_intermediate_size
                router = Router(
                    take(f"{p}mlp.router.weight", (E, H)),
                    take(f"{p}mlp.router.bias", (E,), "bias") if c.router_bias else None,
                )
                cls, ep_kw, shard = MoELoRALayer, {}, None
                if ep_group is not None:  # expert parallelism: this rank's experts, the sum all-reduced
                    from ..parallel import ExpertParallelMoELoRALayer, contiguous_expert_map, shard_experts

                    emap = contiguous_expert_map(E, *ep)

                    def shard(t, _m=emap):
                        return shard_experts(t, _m)

                    cls, ep_kw = ExpertParallelMoELoRALayer, dict(group=ep_group, expert_map=emap)
                w13 = take(f"{p}mlp.experts.w13", (E, 2 * I, H), packed=packed_expert_weight, shard=shard)
                w2 = take(f"{p}mlp.experts.w2", (E, H, I), packed=packed_expert_weight, shard=shard)
                fp8 = {"activation_scheme": activation_scheme} if isinstance(w13, FP8BlockWeight) else {}
                experts = cls(
                    w13,
                    w2,
                    top_k=c.num_experts_per_tok,
                    slices=1 if gpt else 2,
                    b13=take(f"{p}mlp.experts.b13", (E, 2 * I), "bias", shard=shard)
                    if c.expert_bias
                    else None,
                    b2=take(f"{p}mlp.experts.b2", (E, H), "bias", shard=shard) if c.expert_bias else None,
                    dtype=dtype,  # the activations' dtype (packed experts carry none)
                    activation=c.activation,
                    renormalize=c.norm_topk_prob,
                    **mods,
                    **ep_kw,
                    **fp8,
                )
                mlp = MoEBlock(router, experts)
            else:
                I = c.intermediate_size
                mlp = DenseMLP(
                    lin("gate_up_proj", 2 * I, H, False, (I, I), _sub="mlp.", tp="column"),
                    lin("down_proj", H, I, False, None, _sub="mlp.", tp="row"),
                )
            layers.append(
                DecoderLayer(
                    RMSNorm(take(f"{p}input_layernorm.weight", (H,), "norm", norm_dt), c.rms_norm_eps, gpt),
                    attn,
                    RMSNorm(
                        take(f"{p}post_attention_layernorm.weight", (H,), "norm", norm_dt),
                        c.rms_norm_eps,
                        gpt,
                    ),
                    mlp,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(take("norm.weight", (H,), "norm", norm_dt), c.rms_norm_eps, gpt)
        self.lm_head = nn.Linear(H, V, bias=False, device="meta")
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(take("lm_head.weight", (V, H)), requires_grad=False)
        if isinstance(weights, Mapping):
            extra = sorted(set(weights) - used)
            if extra:
                raise ValueError(f"weights: {len(extra)} unexpected name(s), e.g. {extra[:5]}")
        #: the process groups of tensor and expert parallelism (None: not parallel), read-only
        self.tp_group, self.ep_group = tp_group, ep_group
        cos, sin = rope_tables(c, max_seq, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer(
            "_arange", torch.arange(max(max_seq, max_batch), device=device), persistent=False
        )
        from ..linear import StepAlignments

        #: the dense projections' adapter alignments of a forward, made once per key (StepAlignments)
        self.step_alignments = StepAlignments()
        self._install_slot_guards()

    @property
    def device(self) -> torch.device:
        """Where the model is (follows ``.to()``)."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (of the embeddings and projections; follows ``.to()``)."""
        return self.embed_tokens.weight.dtype

    @property
    def stage(self) -> str:
        """The stage name the model was built with ("auto" or a name of
        :data:`moelora_lib.kernels.STAGES`; read-only). Under "auto" each MoE layer's
        ``stage_for(T)`` says which stage a T runs."""
        return self._stage

    # --- adapters ---------------------------------------------------------------------------------
    @property
    def deterministic(self) -> bool:
        """Whether every LoRA/MoE module is in its bitwise-repeatable mode (read-only here). Read from
        the modules themselves, so a module switched by hand after construction (``module.deterministic
        = False``) makes this False rather than leaving a stale True; a Generator built before such a
        switch keeps the configs it captured."""
        mods = self.lora_modules()
        return all(m.deterministic for m in mods.values()) if mods else self._deterministic

    def lora_modules(self) -> dict[str, nn.Module]:
        """{qualified name: module} of every LoRALinear and MoELoRALayer (each holds the L slots)."""
        from .. import LoRALinear, MoELoRALayer

        return {n: m for n, m in self.named_modules() if isinstance(m, (LoRALinear, MoELoRALayer))}

    def unload_adapter(self, slot: int) -> None:
        """Empty slot ``slot`` in every LoRA module (its requests then get the base model).

        Raises: ValueError if slot is not an int in [0, num_adapters); RuntimeError, before anything
        changes, while a running generate call uses the slot (:meth:`check_slot_free`)."""
        self._check_slot(slot)
        self.check_slot_free(slot, "unload_adapter")
        for m in self.lora_modules().values():
            m.unload_adapter(slot)

    # --- slots in use -----------------------------------------------------------------------------
    def _install_slot_guards(self) -> None:
        """No slot held; every LoRA module's own load/unload checks this model's holds."""
        self._held: Counter[int] = Counter()  # slot -> open hold_slots contexts naming it
        for m in self.lora_modules().values():
            m.slot_guard = self.check_slot_free

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._install_slot_guards()  # a copy or an unpickled model: its own modules, nothing held
        self._restriction = None  # and unrestricted (its modules' active_slots are not copied)
        self._exclusive = self._exclusive_call = False  # and its forwards free

    def _check_slot(self, slot) -> int:
        if not is_int(slot) or not 0 <= slot < self.num_adapters:
            raise ValueError(f"slot must be an int in [0, num_adapters={self.num_adapters}), got {slot!r}")
        return int(slot)

    @contextlib.contextmanager
    def hold_slots(self, slots: Iterable[int]) -> Iterator[frozenset[int]]:
        """Mark ``slots`` in use for the body of the ``with``: while held, loading or unloading one of
        them (:meth:`unload_adapter`, :func:`~moelora_lib.model.peft_adapters.load_peft_adapter`, or a LoRA
        module's own ``load_adapter`` / ``unload_adapter``) raises RuntimeError before changing
        anything; the other slots stay free to change. Holds are counted per slot, so nested or
        overlapping holders each keep their slots until they exit (an exception included).
        :meth:`moelora_lib.model.generate.Generator.generate` holds its requests' slots for the whole
        call.

        Args:
            slots: ints in [0, num_adapters) (repeats count once).
        Yields: the held slots as a frozenset.
        Raises: ValueError (nothing held) if a slot is not an int in [0, num_adapters)."""
        try:
            held = frozenset(self._check_slot(s) for s in slots)
        except TypeError:
            raise ValueError(f"slots: expected an iterable of slot ints, got {slots!r}") from None
        self._held.update(held)
        try:
            yield held
        finally:
            self._held.subtract(held)
            for s in held:
                if self._held[s] <= 0:
                    del self._held[s]

    @contextlib.contextmanager
    def restrict_slots(self, slots: Iterable[int] | None) -> Iterator[frozenset[int] | None]:
        """For the body of the ``with``, forwards serve only adapter ``slots``: every LoRA module's
        ``active_slots`` is set to them (the previous values come back on exit, an exception included, so
        contexts nest), so the LoRA launches of projections that none of them covers are skipped, and with
        no slot at all the model is its base path (the launches a set gets: :meth:`lora_launches`).
        :meth:`moelora_lib.model.generate.Generator.generate` enters it for each step with the slots of
        that step's requests.

        The forwards' ``lora_ids`` must need no launch that ``slots`` skip: each slot they name is in
        ``slots`` or covers only projections that an adapter of ``slots`` covers too (a row of another
        slot gets the base output where its launches are skipped: ``active_slots`` of
        :class:`~moelora_lib.LoRALinear`). With ``lora_ids`` on the CPU the forward checks it
        (ValueError); on the device it is the caller's part.

        Args:
            slots: ints in [0, num_adapters) (repeats count once), or None (no restriction).
        Yields: the slots as a frozenset (None for None).
        Raises: ValueError (nothing changed) if a slot is not an int in [0, num_adapters)."""
        if slots is None:
            new = None
        else:
            try:
                new = frozenset(self._check_slot(s) for s in slots)
            except TypeError:
                raise ValueError(f"slots: expected None or an iterable of slot ints, got {slots!r}") from None
        mods = list(self.lora_modules().values())
        before = [m.active_slots for m in mods], self._restriction
        for m in mods:
            m.active_slots = new
        self._restriction = new
        try:
            yield new
        finally:
            for m, prev in zip(mods, before[0]):
                m.active_slots = prev
            self._restriction = before[1]

    #: Whether a forward shares the dense projections' adapter alignments among its LoRALinear modules
    #: (:attr:`step_alignments`; the same result bit for bit, fewer launches). Default True; False makes
    #: each projection align on its own, as a LoRALinear outside a model does.
    share_alignments: bool = True
    #: the slots of the innermost open :meth:`restrict_slots` context (None: unrestricted)
    _restriction: frozenset[int] | None = None
    #: an :meth:`exclusive_forwards` context is open / its callable is running a forward now
    _exclusive: bool = False
    _exclusive_call: bool = False

    @contextlib.contextmanager
    def exclusive_forwards(self) -> Iterator[Callable[..., torch.Tensor]]:
        """Reserve this model's forward for one caller for the body of the ``with``: the callable it
        yields runs the forward (``model(*args, **kwargs)``), and any other call of the forward raises
        RuntimeError before touching anything. :meth:`moelora_lib.model.generate.Generator.generate`
        holds it for the whole call, so a forward from its ``stream`` callback cannot overwrite the KV
        cache rows its requests are using. Host-side only: one flag check per forward; a CUDA graph
        replay runs no Python forward and is unaffected.

        Yields: the callable (same arguments and result as :meth:`forward`).
        Raises: RuntimeError if a reservation is already open (one caller at a time)."""
        if self._exclusive:
            raise RuntimeError(
                "exclusive_forwards: this model's forwards are already reserved (a generate call is running "
                "on it); reserve them after it returns"
            )

        def run(*args, **kwargs) -> torch.Tensor:
            self._exclusive_call = True
            try:
                return self(*args, **kwargs)
            finally:
                self._exclusive_call = False

        self._exclusive = True
        try:
            yield run
        finally:
            self._exclusive = False
            self._exclusive_call = False

    def lora_launches(self, slots: Iterable[int] | None = None) -> tuple[tuple[bool, ...], ...]:
        """Per LoRA module (the order of :meth:`lora_modules`), the projections whose LoRA launches a
        forward restricted to ``slots`` (:meth:`restrict_slots`; None: unrestricted) makes: (gate_up, down)
        of a MoELoRALayer, (lora,) of a LoRALinear (``lora_launches`` of each). Host-side; equal tuples mean
        the same launches, which is how the Generator keys its CUDA graphs: all False for a batch without
        adapters, and eight adapters covering every projection share the tuple of any one of them.
        Raises ValueError if a slot is not an int in [0, num_adapters)."""
        if slots is not None:
            try:
                slots = frozenset(self._check_slot(s) for s in slots)
            except TypeError:
                raise ValueError(f"slots: expected None or an iterable of slot ints, got {slots!r}") from None
        return tuple(m._launches(slots) for m in self.lora_modules().values())

    @property
    def slots_in_use(self) -> frozenset[int]:
        """The slots some open :meth:`hold_slots` context holds (read-only)."""
        return frozenset(s for s, n in self._held.items() if n > 0)

    def check_slot_free(self, slot: int, action: str = "load or unload") -> None:
        """Raise RuntimeError naming ``slot`` and ``action`` if the slot is held (:meth:`hold_slots`): a
        running generate call reads its adapter until the call returns, so it cannot change now. Every
        per-slot mutator calls it before changing anything."""
        if self._held.get(slot, 0) > 0:
            raise RuntimeError(
                f"{action}: slot {slot} is in use by a running generate call (its requests read the slot's "
                f"adapter until the call returns; slots in use: {sorted(self.slots_in_use)}); change it "
                "after the call, or use a free slot"
            )

    # --- forward ----------------------------------------------------------------------------------
    def _check_index_device(self, name: str, t: torch.Tensor) -> None:
        if t.device.type not in ("cpu", self.device.type):
            raise ValueError(
                f"{name} must be on the CPU or on the model's device {self.device}, got {t.device}"
            )

    def _index(self, name: str, v, B: int) -> torch.Tensor:
        """A [B] int tensor: a tensor as given (checked shape/dtype), a list of ints as a CPU int64 tensor."""
        if isinstance(v, torch.Tensor):
            if tuple(v.shape) != (B,) or v.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be an int32/int64 tensor [B={B}], got {describe(v)}")
            self._check_index_device(name, v)
            return v
        if isinstance(v, Sequence) and len(v) == B and all(is_int(i) for i in v):
            return torch.tensor(list(v), dtype=torch.int64)
        raise ValueError(f"{name} must be an int tensor [B={B}] or a list of B ints, got {v!r}")

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos,
        lora_ids,
        *,
        cache_rows=None,
        last_only: bool = False,
        kv_len: int | None = None,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run B requests of S new tokens each, appending their K/V to the cache.

        Args:
            input_ids: [B, S] int64 (int32 accepted) token ids in [0, V).
            start_pos: [B] int (tensor or list): cache position of column 0 of each row.
            lora_ids: [B] int (tensor or list): adapter slot per request, -1 = none.
            cache_rows: [B] int64 cache row per request, or None = rows 0..B-1 (read as a view, no copy).
            last_only: return only the last column's logits.
            last_index: with ``last_only``, [B] int64 device (or CPU) tensor: the column of each row whose
                logits to return instead of the last (a prompt padded to a static length keeps its real
                last token at ``len - 1``); values in [0, S) (not checked on the device).
            kv_len: host-side bound on the cache positions attention reads (every row's start_pos + S
                ≤ kv_len); None = max_seq. Smaller values cut attention work in prefill.
        Returns:
            logits float32 [B, S, V], or [B, V] with ``last_only``.
        Raises:
            ValueError naming the argument: shapes/dtypes, B > max_batch, S or kv_len > max_seq,
            B·S > max_tokens, a tensor on a device other than the CPU or the model's; and, when the
            tensors are on the CPU (checked without a device sync), input_ids outside [0, V),
            start_pos + S > kv_len or < 0, cache_rows outside [0, max_batch) or repeated, lora_ids
            outside [-1, num_adapters), naming a slot that holds no adapter or one needing LoRA
            launches that an open :meth:`restrict_slots` context skips. For CUDA-graph capture
            pass device tensors (a list or CPU tensor is copied to the device, which a capture
            refuses).
        Query i of row b sees cache positions ≤ start_pos[b] + i (and > that − sliding_window on
        sliding layers). Values of device-resident start_pos/cache_rows/lora_ids/input_ids are not
        checked (no host sync); out-of-range ones are undefined behaviour (a device-side index error).

        RuntimeError, before anything runs, while a generate call on this model is running, unless the
        call comes from that generator (:meth:`exclusive_forwards`): e.g. from its ``stream`` callback,
        a forward would overwrite the KV cache rows the call's requests use.
        """
        if self._exclusive and not self._exclusive_call:
            raise RuntimeError(
                "MultiLoRAModel.forward: a generate call is running on this model (called from its stream "
                "callback?) and its requests use the KV cache rows a forward writes; call the forward after "
                "it returns"
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be an int tensor [B, S], got {describe(input_ids)}")
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be int64 (or int32), got {input_ids.dtype}")
        self._check_index_device("input_ids", input_ids)
        B, S = input_ids.shape
        if last_index is not None:
            if not last_only:
                raise ValueError("last_index needs last_only=True (it picks the one column returned per row)")
            if (
                not isinstance(last_index, torch.Tensor)
                or last_index.shape != (B,)
                or last_index.dtype not in (torch.int32, torch.int64)
            ):
                raise ValueError(
                    f"last_index must be an int32/int64 tensor [B = {B}], got {describe(last_index)}"
                )
            if last_index.device.type == "cpu" and B:  # host-side values: checked for free
                lo, hi = int(last_index.min()), int(last_index.max())
                if lo < 0 or hi >= S:
                    raise ValueError(f"last_index values must be in [0, S = {S}), got [{lo}, {hi}]")
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"input_ids: B = {B} must be in [1, max_batch = {self.max_batch}]")
        if not 1 <= S <= self.max_seq:
            raise ValueError(f"input_ids: S = {S} must be in [1, max_seq = {self.max_seq}]")
        if B * S > self.max_tokens:
            raise ValueError(f"input_ids: B·S = {B * S} tokens exceed max_tokens = {self.max_tokens}")
        L = self.max_seq if kv_len is None else kv_len
        if not is_int(L) or not S <= L <= self.max_seq:
            raise ValueError(f"kv_len must be an int in [S = {S}, max_seq = {self.max_seq}], got {kv_len!r}")
        dev = self.device
        start = self._index("start_pos", start_pos, B)
        ids = self._index("lora_ids", lora_ids, B)
        rows = None if cache_rows is None else self._index("cache_rows", cache_rows, B)
        if start.device.type == "cpu":  # host-side values: checked for free
            lo, hi = int(start.min()), int(start.max())
            if lo < 0 or hi + S > L:
                raise ValueError(
                    f"start_pos: every start_pos + S must be in [S, {L}] (kv_len or max_seq), "
                    f"got start_pos in [{lo}, {hi}] with S = {S}"
                )
        if input_ids.device.type == "cpu":
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids: token ids must be in [0, vocab_size = {self.config.vocab_size}), "
                    f"got ids in [{lo}, {hi}]"
                )
        if ids.device.type == "cpu":
            if int(ids.min()) < -1 or int(ids.max()) >= self.num_adapters:
                raise ValueError(
                    f"lora_ids: values must be in [-1, num_adapters = {self.num_adapters}), "
                    f"got {ids.tolist()}"
                )
            used = {int(i) for i in ids.tolist()} - {-1}
            if self._restriction is not None and not used <= self._restriction:
                served = self.lora_launches(self._restriction)
                need = [
                    s
                    for s in sorted(used - self._restriction)
                    if any(n and not h for m, k in zip(self.lora_launches([s]), served) for n, h in zip(m, k))
                ]
                if need:
                    raise ValueError(
                        f"lora_ids: slot(s) {need} need LoRA launches that this forward's restriction to "
                        f"slots {sorted(self._restriction)} skips (restrict_slots)"
                    )
            if used:
                loaded = {s for m in self.lora_modules().values() for s in m.loaded_slots}
                empty = sorted(used - loaded)
                if empty:
                    raise ValueError(
                        f"lora_ids: slot(s) {empty} hold no adapter (loaded: {sorted(loaded)}); "
                        "use -1 for the base model"
                    )
        if rows is not None and rows.device.type == "cpu":
            if int(rows.min()) < 0 or int(rows.max()) >= self.max_batch:
                raise ValueError(
                    f"cache_rows: values must be in [0, max_batch = {self.max_batch}), got {rows.tolist()}"
                )
            if len(set(rows.tolist())) != B:
                raise ValueError(f"cache_rows: each request needs its own cache row, got {rows.tolist()}")
        start, ids = start.to(dev, torch.int64), ids.to(dev, torch.int32)
        ctx = _Ctx()
        ctx.B, ctx.S, ctx.kv_len = B, S, L
        ctx.ids = ids[:, None].expand(B, S).reshape(B * S)  # token-major [B·S] (repeat_interleave)
        pos = start[:, None] + self._arange[:S]  # [B, S]
        ctx.cos_tab, ctx.sin_tab = self.rope_cos, self.rope_sin  # [max_seq, D/2], indexed by position
        if rows is None:
            ctx.rows = None
            ctx.t_rows = self._arange[:B, None].expand(B, S).contiguous().view(B * S)
        else:
            ctx.rows = rows.to(dev, torch.int64)
            ctx.t_rows = ctx.rows[:, None].expand(B, S).contiguous().view(B * S)
        ctx.t_pos = pos.reshape(B * S)  # cache row and position of each token
        if S == 1:  # decode: the split-KV kernel takes the lengths, no mask over the cache positions
            ctx.seq_lens = start + 1
            ctx.mask_full = ctx.mask_slide = None
        else:
            ctx.seq_lens = None
            kpos = self._arange[:L]
            causal = kpos[None, None, :] <= pos[:, :, None]  # [B, S, L]
            ctx.mask_full = causal[:, None]
            ctx.mask_slide = ctx.mask_full
            if self.config.sliding_window is not None:
                ctx.mask_slide = (
                    causal & (kpos[None, None, :] > pos[:, :, None] - self.config.sliding_window)
                )[:, None]
        x = self.embed_tokens(input_ids.to(dev).reshape(B * S))
        h = self.layers[0].input_layernorm.fused(x) if self.layers else self.norm.fused(x)
        # every LoRALinear gets ctx.ids: each (T, BLOCK_SIZE_M, L, loaded slots) key aligns once
        shared = self.step_alignments.scope() if self.share_alignments else contextlib.nullcontext()
        with shared:
            for i, layer in enumerate(self.layers):  # residual adds fused into the next norm
                nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                x, h = layer(x, ctx, normed=h, next_norm=nxt)
        x = h.view(B, S, -1)  # self.norm(x)
        if last_only:
            if last_index is None:
                x = x[:, -1]
            else:
                x = x[self._arange[:B], last_index.to(x.device)]
        return self.lm_head(x).float()
