"""Dense multi-LoRA linear layers (attention and dense-MLP projections): :func:`lora_linear`,
:class:`LoRALinear` and the fp64 oracle :func:`lora_linear_reference`.

Math (per token t with adapter slot a = lora_ids[t], -1 = none; output slices s of widths N_s at
column offsets o_s, Σ_s N_s = N_total)::

    y[t]                 = x[t]·Wᵀ (+ b)              # base: torch F.linear (cuBLAS); block-FP8 W: dense_fp8
    y[t, o_s : o_s+N_s] += [a ≥ 0]·B_s[a]·(A_s[a]·x[t])    for every slice s

Several projections of one input share a launch as slices of one fused weight: q, k, v of a fused
qkv (GQA: different widths, e.g. 4096 + 512 + 512) or gate and up of a fused gate_up (two equal
widths). The LoRA scaling (PEFT's lora_alpha / r) is folded into B when an adapter is loaded; a rank
r < R adapter is zero-padded to R. Following vLLM's ``MergedQKVParallelLinearWithLoRA`` /
``MergedColumnParallelLinearWithLoRA`` semantics (vllm/lora/layers), with Punica's SGMV grouping of
tokens by adapter (arXiv:2310.18547).

Layouts (the argument for them is in :mod:`moelora_lib.kernels.dense_lora`):

* ``lora_a`` [L, S, R, H]: slice s holds PEFT's ``lora_A.weight`` [r_s, H] of projection s, zero-padded
  to R rows;
* ``lora_b`` [L, N_total, R]: rows o_s .. o_s+N_s-1 hold PEFT's ``lora_B.weight`` [N_s, r_s] of
  projection s (times its scaling), zero-padded to R columns — the slices concatenated along the
  output dimension the same way the fused base weight concatenates its projections. vLLM keeps
  per-slice lists ([L, 1, N_s, R] each) and passes the kernels a device table of their data pointers;
  one tensor needs no table, no padding of narrow slices, and B row n is output column n.

How a call runs: ``F.linear`` for the base (a block-FP8 weight, :class:`~moelora_lib.quant.FP8BlockWeight`:
the GEMM of :mod:`moelora_lib.kernels.dense_fp8`, weight-only or W8A8 by ``activation_scheme``; the LoRA
part below is the same); the tokens grouped by adapter with the package's
(adapter, expert) alignment at E = 1, top_k = 1 (CPU: the torch oracle
:func:`moelora_lib.routing.align_tokens`; CUDA: one launch of
:func:`~moelora_lib.kernels.align_small.align_tokens_pair` up to
:data:`~moelora_lib.kernels.align_small.PAIR_PATH_MAX_PAIRS` tokens, else the three of
:func:`~moelora_lib.kernels.align.align_tokens_triton`; inside a :class:`StepAlignments` scope, which
a model forward opens, made once per key and read by every :class:`LoRALinear` of that key); then
the stage's two LoRA launches (:func:`~moelora_lib.kernels.dense_lora.dense_lora_add`): one shrink for
all slices, one expand for all slices that adds into the base output (stages with fused add) or into a
delta buffer added by torch (the others). Stages are the MoE ones (:data:`moelora_lib.kernels.STAGES`,
same switches).

Configs: stage ``tuned`` reads tuned configs through :func:`moelora_lib.configs.load_dense_config`
(vLLM's dense ``{gpu}_SHRINK.json`` / ``{gpu}_EXPAND_TRUE.json`` files; the ``folder`` > env >
shipped > defaults precedence of the MoE configs) written by :mod:`moelora_lib.studies.dense_tuning`;
where no tuned file applies it launches :func:`~moelora_lib.configs.defaults.default_dense_config`
(silently for a shipped folder that has only MoE configs). Timings against vLLM's dense ops:
notebook 10 (docs/anchors-h200.md, last section).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from . import ops
from .common import (
    KERNEL_DTYPES,
    check_activations,
    check_bool,
    check_cpu_backend,
    check_finite,
    check_kernel_device,
    check_kernel_dtype,
    check_no_grad,
    check_real_scalar,
    check_slices,
    check_tensor,
    is_finite,
    is_int,
)
from .common import describe as _desc
from .kernels import AUTO_STAGE, STAGES, Stage, check_stage_name
from .kernels.align import AlignWorkspace, align_tokens_triton, align_workspace
from .kernels.align_small import PAIR_PATH_MAX_PAIRS, align_tokens_pair, pair_workspace, use_pair_path
from .kernels.dense_fp8 import (
    W8A8_MIN_BLOCK_K,
    DenseFP8Config,
    check_dense_scheme,
    default_dense_fp8_config,
    dense_fp8_linear,
    dense_fp8_w8a8,
    dense_fp8_weight_only,
    quantize_act,
    resolve_dense_scheme,
)
from .kernels.dense_gemv import (
    DENSE_GEMV_MAX_TOKENS,
    DenseGemvConfig,
    DenseGemvWorkspace,
    default_dense_gemv_config,
    dense_gemv_lora,
    dense_gemv_num_tiles,
    dense_gemv_workspace,
)
from .kernels.dense_lora import (
    DENSE_KERNELS,
    DenseLoRAConfig,
    adapt_dense_config,
    dense_block_sizes_for,
    dense_config_for,
    dense_lora_add,
)
from .quant import check_dequantized_finite
from .quant.fp8 import FP8BlockWeight
from .routing import Alignment, align_tokens
from .scratch import Scratch, attach_scratch, memory_report, nbytes

__all__ = [
    "lora_linear",
    "lora_linear_reference",
    "validate_lora_linear_inputs",
    "LoRALinear",
    "lora_linear_module",
    "StepAlignments",
]


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------
def _check(name: str, t, shape: tuple, dtypes, device) -> None:
    """:func:`moelora_lib.common.check_tensor` with x as the reference: ValueError naming ``name``
    unless t is a tensor of ``shape`` ((letter, size) pairs), dtype (one: "(like x)"), device."""
    check_tensor(name, t, shape, dtypes, device, " (like x)" if len(dtypes) == 1 else "", like="x")


def _check_cpu_backend(dtype: torch.dtype, name: str = "x") -> None:
    """:func:`~moelora_lib.common.check_cpu_backend` for the dense kernels."""
    check_cpu_backend(DENSE_KERNELS["dense_shrink"][True], dtype, name)


def _check_values(lora_ids: torch.Tensor, L: int) -> None:
    """lora_ids ∈ [-1, L): one host sync (aminmax, then .tolist())."""
    if lora_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(lora_ids)).tolist())
    if lo < -1 or hi >= L:
        raise ValueError(f"lora_ids values must be in [-1, L={L}) (-1 = no adapter), got min {lo}, max {hi}")


def _check_dense_weight_dtype(weight: torch.Tensor) -> None:
    """A float8 tensor as ``weight`` is refused by name: without its block scales it is not the weight."""
    if weight.dtype not in KERNEL_DTYPES:
        hint = (
            " (FP8 codes need their block scales: pass FP8BlockWeight(weight, scale_inv, block))"
            if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            else ""
        )
        raise ValueError(f"weight dtype must be float16, bfloat16 or float32{hint}, got {weight.dtype}")


def _check_fp8_weight(weight: FP8BlockWeight, H: int, device) -> int:
    """N_total of a block-FP8 ``weight`` [N_total, H] on ``device`` whose scale block's columns hold a
    K step of the FP8 GEMM (a multiple of 16); ValueError naming ``weight`` otherwise."""
    if weight.weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D FP8BlockWeight [N_total, H], got shape {list(weight.shape)}")
    N, K = weight.shape
    if K != H:
        raise ValueError(f"weight must have shape [N_total, H={H}], got FP8 of shape {list(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"weight must be on {device} (like x), got {weight.device}")
    bk = weight.block[1]
    if bk & -bk < 16:
        raise ValueError(
            f"weight.block = {weight.block}: the FP8 GEMM needs scale blocks of a multiple of 16 columns "
            "(a K step of at least 16, tl.dot's minimum, reads one scale column)"
        )
    return N


def _check_fp8_args(weight, activation_scheme, fp8_config) -> None:
    """``activation_scheme`` one of ACTIVATION_SCHEMES that ``weight`` runs
    (:func:`~moelora_lib.kernels.dense_fp8.check_dense_scheme`: "dynamic" needs an FP8BlockWeight whose
    scale block admits a W8A8 K step) and ``fp8_config`` a DenseFP8Config or None, given only with an
    FP8BlockWeight, its BLOCK_SIZE_K dividing the weight's scale block columns (and ≥ 32 where the
    scheme can run W8A8). ValueError naming the argument."""
    check_dense_scheme(activation_scheme, weight)
    if fp8_config is None:
        return
    if not isinstance(fp8_config, DenseFP8Config):
        raise ValueError(f"fp8_config must be a DenseFP8Config or None, got {type(fp8_config).__name__}")
    if not isinstance(weight, FP8BlockWeight):
        raise ValueError("fp8_config is for a block-FP8 weight (an FP8BlockWeight); weight is dense")
    bk = fp8_config.BLOCK_SIZE_K
    if weight.block[1] % bk:
        raise ValueError(
            f"fp8_config.BLOCK_SIZE_K = {bk} must divide the weight's scale block columns weight.block[1] = "
            f"{weight.block[1]}: a K step reads one scale column"
        )
    if bk < W8A8_MIN_BLOCK_K and resolve_dense_scheme(activation_scheme, weight, 1 << 30) == "dynamic":
        raise ValueError(
            f"fp8_config.BLOCK_SIZE_K = {bk}: activation_scheme {activation_scheme!r} runs the W8A8 form "
            f"(at large T for 'auto'), whose FP8 tl.dot needs a K step of at least {W8A8_MIN_BLOCK_K}"
        )


def _hidden_size(x: torch.Tensor, weight, lora_a) -> tuple[int, int]:
    """(T, H) of a call: H is weight's in_features (dim 1) unless x and lora_a (dim 3) agree on another
    size, so a wrong H is blamed on the one argument that disagrees (as fused_moe_lora does): ValueError
    naming x when x is that argument; a disagreeing weight or lora_a fails its own shape check."""

    def dim(t, nd: int, d: int) -> int | None:  # None: not a tensor of that rank (fails its own check)
        t = t.weight if isinstance(t, FP8BlockWeight) else t
        return t.shape[d] if isinstance(t, torch.Tensor) and t.dim() == nd else None

    votes = [
        ("weight's in_features", dim(weight, 2, 1)),
        ("x", x.shape[1]),
        ("lora_a's H (dim 3)", dim(lora_a, 4, 3)),
    ]
    sizes = [v for _, v in votes if v is not None]
    H = max(sizes, key=lambda v: (sizes.count(v), -sizes.index(v)))  # ties: weight, then x
    if x.shape[1] != H:
        source = next(what for what, v in votes if v == H)
        raise ValueError(f"x must have shape [T, H={H}] ({source}), got {tuple(x.shape)}")
    return x.shape[0], H


def validate_lora_linear_inputs(
    x, weight, lora_a, lora_b, lora_ids, slices, bias=None, check_values: bool = True
) -> dict:
    """Check every argument of :func:`lora_linear`; return the sizes T, H, N (N_total), L, S, R and
    ``slices`` (a tuple of ints). H is weight's in_features unless x and lora_a agree on another size,
    so a wrong H names the argument that disagrees (x with a wrong H is blamed, not weight).

    Raises:
        ValueError naming the argument: not a tensor, wrong rank/shape (the message gives the expected
        shape in the shape letters), dtype (x: float16/bfloat16/float32; the others like x, lora_ids
        int32 or int64; a float8 tensor as weight: pass an FP8BlockWeight), device (like x), an
        FP8BlockWeight weight that is not [N_total, H] or whose scale block's columns are not a
        multiple of 16, ``slices`` not positive ints or not summing to weight.shape[0], S of
        lora_a ≠ len(slices), rank R of lora_b ≠ lora_a's, L or R < 1, bfloat16 on the CPU, a device other
        than CPU/CUDA (meta), an input that requires grad while grad mode is on (inference only), and
        with ``check_values`` lora_ids values outside [-1, L) (one host sync).
    """
    dt, dev = check_activations("x", x, DENSE_KERNELS["dense_shrink"][True])
    T, H = _hidden_size(x, weight, lora_a)
    if isinstance(weight, FP8BlockWeight):
        N = _check_fp8_weight(weight, H, dev)
    elif not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            "weight must be a 2-D tensor [N_total, H] (nn.Linear layout) or an FP8BlockWeight, got "
            f"{_desc(weight)}"
        )
    else:
        N = weight.shape[0]
    slices = check_slices(slices, N, "N_total = weight.shape[0]")
    S = len(slices)
    if not isinstance(weight, FP8BlockWeight):
        _check_dense_weight_dtype(weight)
        _check("weight", weight, (("N_total", N), ("H", H)), (dt,), dev)
    if not isinstance(lora_a, torch.Tensor) or lora_a.dim() != 4:
        raise ValueError(f"lora_a must be a 4-D tensor [L, S, R, H], got {_desc(lora_a)}")
    L, R = lora_a.shape[0], lora_a.shape[2]
    if L < 1 or R < 1:
        raise ValueError(f"lora_a: L (dim 0) and R (dim 2) must be >= 1, got L={L}, R={R}")
    if lora_a.shape[1] != S:
        raise ValueError(
            f"lora_a: S (dim 1) = {lora_a.shape[1]} must equal the number of slices len(slices) = {S}"
        )
    _check("lora_a", lora_a, (("L", L), ("S", S), ("R", R), ("H", H)), (dt,), dev)
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != 3:
        raise ValueError(f"lora_b must be a 3-D tensor [L, N_total, R], got {_desc(lora_b)}")
    if lora_b.shape[2] != R:
        raise ValueError(
            f"lora_b: rank R (dim 2) = {lora_b.shape[2]} must equal lora_a's R (dim 2) = {R} "
            "(pad a smaller rank with zeros)"
        )
    _check("lora_b", lora_b, (("L", L), ("N_total", N), ("R", R)), (dt,), dev)
    _check("lora_ids", lora_ids, (("T", T),), (torch.int32, torch.int64), dev)
    if bias is not None:
        _check("bias", bias, (("N_total", N),), (dt,), dev)
    # the LoRA part is Triton launches with no autograd formula (an FP8BlockWeight is skipped: no tensor)
    check_no_grad(("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b), ("bias", bias))
    if check_bool("check_values", check_values):
        _check_values(lora_ids, L)
    return dict(T=T, H=H, N=N, L=L, S=S, R=R, slices=slices)


def _check_stage_and_config(stage, config) -> None:
    if stage == AUTO_STAGE.name:  # a clear word on the MoE path's name
        raise ValueError(
            f"stage must be one of {list(STAGES)}, got 'auto': the dense LoRA op has no per-T stage choice "
            "(the config files record one for the MoE layer only; MultiLoRAModel(stage='auto') runs its "
            "dense projections in stage 'tuned')"
        )
    check_stage_name(stage, auto=False)
    if config is not None and not isinstance(config, DenseLoRAConfig):
        raise ValueError(f"config must be a DenseLoRAConfig or None, got {type(config).__name__}")


def _align_oneshot(lora_ids: torch.Tensor, L: int, block_size_m: int) -> Alignment:
    """The adapter alignment of T tokens (E = 1, top_k = 1), allocated for this call: the torch oracle
    on the CPU; on CUDA the Triton alignments (no host sync)."""
    T = lora_ids.shape[0]
    zeros = torch.zeros((T, 1), dtype=torch.int32, device=lora_ids.device)  # the one "expert"
    if lora_ids.device.type != "cuda":
        return align_tokens(zeros, 1, block_size_m, lora_ids=lora_ids, num_adapters=L, check_values=False)
    if use_pair_path(T, 1, L):  # one launch (its unused expert-only half costs next to nothing)
        return align_tokens_pair(zeros, 1, block_size_m, lora_ids, L, block_size_m)[1]
    return align_tokens_triton(zeros, 1, block_size_m, lora_ids=lora_ids, num_adapters=L)


# --------------------------------------------------------------------------------------------------
# functional op and reference
# --------------------------------------------------------------------------------------------------
def lora_linear(
    x,
    weight,
    lora_a,
    lora_b,
    lora_ids,
    *,
    slices,
    bias=None,
    stage: str = "tuned",
    config: DenseLoRAConfig | None = None,
    check_values: bool = True,
    deterministic: bool = False,
    activation_scheme: str = "auto",
    fp8_config: DenseFP8Config | None = None,
) -> torch.Tensor:
    """Dense linear layer with one LoRA adapter per token over S output slices.

    ``y[t] = x[t]·Wᵀ (+ bias)``, then for every slice s (columns o_s .. o_s+N_s-1) and token t with
    a = lora_ids[t] ≥ 0: ``y[t, o_s:o_s+N_s] += (x[t]·A[a, s]ᵀ)·B[a, o_s:o_s+N_s]ᵀ``.

    Args:
        x: [T, H] float16/bfloat16/float32 (CUDA, or CPU under TRITON_INTERPRET=1, not bfloat16 there).
        weight: [N_total, H] (nn.Linear layout: the slices' weights concatenated along dim 0), x's dtype;
            or a block-FP8 :class:`~moelora_lib.quant.FP8BlockWeight` [N_total, H] (float8_e4m3fn +
            scale_inv, scale block columns a multiple of 16; fused slices via ``FP8BlockWeight.cat``),
            kept in FP8: the base GEMM is :func:`~moelora_lib.kernels.dense_fp8.dense_fp8_linear`
            (``activation_scheme``).
        lora_a: [L, S, R, H], x's dtype; slice s = projection s's A (rank r_s ≤ R, zero-padded).
        lora_b: [L, N_total, R], x's dtype; rows of slice s = projection s's B, scaling folded in,
            zero-padded to R columns.
        lora_ids: [T] int32/int64, slot of each token in [-1, L); -1 = no adapter (exactly the base).
        slices: output widths (N_0, ..., N_{S-1}), Σ = N_total, e.g. (q, k, v) = (4096, 512, 512).
        bias: [N_total] or None.
        stage: a name in :data:`moelora_lib.kernels.STAGES`, default "tuned" (its switches: length
            specialization, split-K shrink, grouped order, EVEN_K, fused add). Not "auto" (the MoE
            layer's per-T choice; the config files record none for the dense op): ValueError.
        config: a :class:`~moelora_lib.kernels.dense_lora.DenseLoRAConfig`; None = stage ``tuned``:
            :func:`moelora_lib.configs.load_dense_config` (tuned files, else the defaults); the other
            stages: :func:`~moelora_lib.kernels.dense_lora.default_dense_config`.
        check_values: check lora_ids ∈ [-1, L) — one host sync. Pass False for CUDA-graph capture
            (ids out of range are then dropped by the alignment: no out-of-bounds access, result for
            those tokens unspecified), or use :class:`LoRALinear`.
        deterministic: bitwise-repeatable LoRA path: the shrink runs with SPLIT_K = 1
            (``DenseLoRAConfig.deterministic()``; split-K's fp32 atomics add in an order the
            hardware picks). The base GEMM is cuBLAS's: repeatable on one GPU and stream (see
            PyTorch's reproducibility notes, ``CUBLAS_WORKSPACE_CONFIG``); the FP8 GEMM uses no
            atomics. Default False.
        activation_scheme: with an FP8 weight, the base GEMM's form: "weight_only" (e4m3 tiles
            scaled to x's dtype in registers), "dynamic" (W8A8: x quantized per token and group of
            ``weight.block[1]`` columns, FP8 tensor cores; the scale block's columns a multiple of 32),
            or "auto" (default): weight-only below
            :data:`~moelora_lib.kernels.dense_fp8.DENSE_W8A8_MIN_TOKENS` tokens, W8A8 from there (where
            the block allows it). Dense weights run "auto" / "weight_only" as F.linear; "dynamic" with a
            dense weight: ValueError.
        fp8_config: a :class:`~moelora_lib.kernels.dense_fp8.DenseFP8Config` for the FP8 GEMM (None:
            :func:`~moelora_lib.kernels.dense_fp8.default_dense_fp8_config` by T); FP8 weights only.
    Returns:
        [T, N_total] in x's dtype: the base output ``F.linear(x, weight, bias)`` (FP8 weights: the FP8
        GEMM's) with the LoRA deltas added; rows of tokens with id -1 are bit for bit the base output.
    Raises:
        ValueError: naming the argument (:func:`validate_lora_linear_inputs`), an unknown stage, a
            config that is not a DenseLoRAConfig, a bad ``activation_scheme`` / ``fp8_config``.

    Precision: the base is cuBLAS's (or torch's CPU) GEMM; the LoRA path accumulates in fp32, keeps the
    rank intermediate in fp32, and rounds once: the sum (fused-add stages) or, in the other stages, the
    delta is stored (fp32 for fp16 outputs, else x's dtype) and added by torch.
    """
    _check_stage_and_config(stage, config)
    check_bool("deterministic", deterministic)
    _check_fp8_args(weight, activation_scheme, fp8_config)
    d = validate_lora_linear_inputs(x, weight, lora_a, lora_b, lora_ids, slices, bias, check_values)
    st = STAGES[stage]
    if isinstance(weight, FP8BlockWeight):
        out = dense_fp8_linear(x, weight, bias, activation_scheme=activation_scheme, config=fp8_config)
    else:
        out = F.linear(x, weight, bias)
    if d["T"] == 0:
        return out
    if config is None:
        config = dense_config_for(st, d["T"], hidden=d["H"], slices=d["slices"], rank=d["R"], adapters=d["L"])
    if deterministic:
        config = config.deterministic()
    align = _align_oneshot(lora_ids, d["L"], config.block_size_m)
    return dense_lora_add(st, out, x, lora_a, lora_b, align, config, slices=d["slices"])


def lora_linear_reference(
    x, weight, lora_a, lora_b, lora_ids, *, slices, bias=None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The dense multi-LoRA linear in ``dtype`` (float64 by default), one adapter group at a time.

    Same arguments as :func:`lora_linear` (any float dtypes; never indexes the adapters with -1; an
    FP8BlockWeight is dequantized exactly, float32 products widened to ``dtype``).
    Returns [T, N_total] in ``dtype``, on x's device.
    """
    xd = x.to(dtype)
    if isinstance(weight, FP8BlockWeight):
        weight = weight.dequantize(torch.float32)
    out = xd @ weight.to(dtype).T
    if bias is not None:
        out = out + bias.to(dtype)
    offsets = [0]
    for n in slices:
        offsets.append(offsets[-1] + int(n))
    for a in sorted(set(lora_ids.tolist())):
        if a < 0:
            continue  # no adapter
        rows = (lora_ids == a).nonzero().squeeze(1)
        for s in range(len(slices)):
            o0, o1 = offsets[s], offsets[s + 1]
            shrunk = xd[rows] @ lora_a[a, s].to(dtype).T  # [rows, R]
            out[rows, o0:o1] += shrunk @ lora_b[a, o0:o1].to(dtype).T
    return out


# --------------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------------
def _align_workspace(kind: str, max_tokens: int, bm: int, L: int, device):
    """An alignment workspace for up to ``max_tokens`` tokens at E = 1 and BLOCK_SIZE_M ``bm``: kind
    "pair" (:func:`~moelora_lib.kernels.align_small.align_tokens_pair`, up to PAIR_PATH_MAX_PAIRS tokens)
    or "multi" (:func:`~moelora_lib.kernels.align.align_tokens_triton`)."""
    if kind == "pair":
        return pair_workspace(min(max_tokens, PAIR_PATH_MAX_PAIRS), 1, bm, L, bm, device=device)
    return align_workspace(max_tokens, 1, bm, L, device=device)


class _Scratch(Scratch):
    """Per-call buffers of LoRALinear modules of one set of sizes: the fp32 rank intermediate
    [max_tokens, S·R], the delta buffer [max_tokens, N_total] (stages without fused add), a zero
    "expert id" column [max_tokens, 1] int32 for the alignment (read only), and the alignment
    workspaces by (kind, BLOCK_SIZE_M)."""

    def __init__(self, dt, dev, max_tokens, SR, N, L, fused_add):
        super().__init__()
        self.bufs = dict(
            inter=torch.zeros(max_tokens * SR, dtype=torch.float32, device=dev),
            zeros=torch.zeros((max_tokens, 1), dtype=torch.int32, device=dev),
        )
        if not fused_add:
            ddt = torch.float32 if dt == torch.float16 else dt
            self.bufs["delta"] = torch.zeros(max_tokens * N, dtype=ddt, device=dev)
        self.max_tokens, self.L, self.device = max_tokens, L, dev

    def workspace(self, kind: str, bm: int):
        return self.cached((kind, bm), self._make_workspace, kind, bm)

    def _make_workspace(self, kind: str, bm: int):
        return _align_workspace(kind, self.max_tokens, bm, self.L, self.device)

    def gemv_workspace(self, slices: tuple[int, ...]) -> DenseGemvWorkspace:
        """The decode GEMV's split-K workspace for ``slices`` (rows for min(max_tokens,
        DENSE_GEMV_MAX_TOKENS) tokens, counters for the smallest BLOCK_SIZE_N, 8): every call leaves it
        zero, so the modules sharing this scratch, which run one after another, share it too."""
        return self.cached(("gemv", slices), self._make_gemv_workspace, slices)

    def _make_gemv_workspace(self, slices: tuple[int, ...]) -> DenseGemvWorkspace:
        rows = min(self.max_tokens, DENSE_GEMV_MAX_TOKENS)
        return dense_gemv_workspace(rows, sum(slices), dense_gemv_num_tiles(slices, 8), self.device)

    def workspace_tensors(self, ws) -> list[torch.Tensor]:
        if isinstance(ws, DenseGemvWorkspace):
            return [ws.partial, ws.counters]
        if isinstance(ws, AlignWorkspace):  # num_tokens_post_padded not counted (MoELoRALayer counts it)
            return [ws.sorted_token_ids, ws.block_expert_ids, ws.block_lora_ids, ws.scratch]
        return [ws.buffer]


_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

#: The open step of a :class:`StepAlignments` in this thread (context), or None: LoRALinear then aligns
#: per call.
_OPEN_STEP: contextvars.ContextVar = contextvars.ContextVar("moelora_lora_alignment_step", default=None)


class _Step:
    """The state of one open :meth:`StepAlignments.scope`: ``entries`` key -> (the lora_ids tensor of
    the key, held so that its ``id`` stays unique for the step; its Alignment), ``used`` the workspaces
    of each pool key handed out so far in the step."""

    __slots__ = ("owner", "entries", "used")

    def __init__(self, owner: StepAlignments):
        self.owner = owner
        self.entries: dict[tuple, tuple[torch.Tensor, Alignment]] = {}
        self.used: Counter[tuple] = Counter()

    def alignment(self, layer: LoRALinear, lora_ids: torch.Tensor, T: int, bm: int) -> Alignment:
        key = (id(lora_ids), T, bm, layer.L, tuple(layer._loaded))
        hit = self.entries.get(key)
        if hit is not None:
            return hit[1]
        align = layer._align(layer._map_empty_slots(lora_ids), T, bm, workspace=self._workspace_for(layer))
        self.entries[key] = (lora_ids, align)
        return align

    def _workspace_for(self, layer: LoRALinear) -> Callable[[str, int], object]:
        def take(kind: str, bm: int):
            pool_key = (kind, bm, layer.L, layer.max_tokens, layer.device)
            j = self.used[pool_key]
            self.used[pool_key] = j + 1
            pool = self.owner._pool.setdefault(pool_key, [])
            if j == len(pool):
                pool.append(_align_workspace(kind, layer.max_tokens, bm, layer.L, layer.device))
            return pool[j]

        return take


class StepAlignments:
    """The adapter alignments of one model step, made once and read by every :class:`LoRALinear` of it.

    A LoRALinear's forward groups its T tokens by adapter: ids of empty slots mapped to -1 (three small
    torch ops, when some slot is empty), then the alignment at the config's BLOCK_SIZE_M (one launch up
    to PAIR_PATH_MAX_PAIRS tokens, else three). The result depends only on the ``lora_ids`` tensor, T,
    BLOCK_SIZE_M, L and which slots the module holds, and in a model step every projection of every layer
    gets the same ``lora_ids`` tensor; so within :meth:`scope` the first LoRALinear of each key
    ``(lora_ids (the tensor object), T, BLOCK_SIZE_M, L, the module's loaded-slot flags)`` maps and aligns
    (the same torch ops and kernels as outside a scope, on the same ids: the same Alignment bit for bit),
    and every later one of that key reuses it. Modules holding different slots (an adapter covering some
    projections only) differ in their flags and get their own mapping and alignment. Outside every scope
    a LoRALinear aligns per call, in its scratch's workspaces. :class:`~moelora_lib.model.MultiLoRAModel`
    opens one around its layers in each forward, so a decode step of a model whose projections hold the
    same slots and pick the same BLOCK_SIZE_M at T aligns once instead of once per projection.

    Workspaces: owned by this object and kept for its life (freed with it), never the modules' shared
    scratch, whose workspaces the next module of the step would overwrite. Per pool key (path "pair" /
    "multi", BLOCK_SIZE_M, L, max_tokens, device) the j-th key of a step that needs one takes the j-th
    workspace (built on first need: a few KB), so no two keys of a step share storage and every
    alignment of a step stays intact until the step ends. A CUDA graph captured over a step records the
    launch of each key once and these persistent addresses, which its later kernels read; graphs sharing
    them replay one at a time, each writing before it reads, as with the modules' shared scratch.

    Not thread-safe for concurrent steps of one object (a model's forwards are not either); the open
    step is a context variable, so other threads see none.
    """

    def __init__(self) -> None:
        #: pool key (kind, BLOCK_SIZE_M, L, max_tokens, device) -> workspaces, handed out in order per step
        self._pool: dict[tuple, list] = {}

    def __getstate__(self) -> dict:
        return {"_pool": {}}  # workspaces are rebuilt on first need (a copy gets its own)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Share alignments among the LoRALinear forwards run in the body of the ``with`` (one model
        step). Host-side only. Re-entering while this object's scope is open joins the open step (its
        alignments and workspaces); the cached alignments are dropped on exit, an exception included."""
        open_step = _OPEN_STEP.get()
        if open_step is not None and open_step.owner is self:
            yield
            return
        token = _OPEN_STEP.set(_Step(self))
        try:
            yield
        finally:
            _OPEN_STEP.reset(token)


class LoRALinear(ops.OpLayer):
    """A dense linear layer (fused over S output slices) with L LoRA adapter slots, for serving.

    Computes :func:`lora_linear` for the adapters loaded in its slots, with no host sync in forward
    (shape checks and the launch config — picked from T alone, cached per T — happen on the host; id
    values are not checked unless ``debug``), so a CUDA graph can capture a forward. Its forward goes
    through the custom op ``torch.ops.moelora.lora_linear_module`` (a fake implementation gives
    [T, N_total]), so ``torch.compile(fullgraph=True)`` of a model holding it sees one opaque node;
    adapters loaded between calls are read at run time (no recompile).

    Args:
        weight: [N_total, H] float16/bfloat16/float32 (CUDA, or CPU under the Triton interpreter, not
            bfloat16 there): the layer's dtype and device. Or a block-FP8
            :class:`~moelora_lib.quant.FP8BlockWeight` [N_total, H] (float8_e4m3fn codes + ``scale_inv``
            [ceil(N_total/bn), ceil(H/bk)], as Qwen3 FP8 checkpoints publish them; bk a multiple of 16;
            fused slices stacked with ``FP8BlockWeight.cat``), kept in FP8: the base GEMM is
            :mod:`moelora_lib.kernels.dense_fp8`'s instead of ``F.linear`` (``activation_scheme``).
            Kept, not copied (an FP8 weight's codes and scales, and bias, too): the layer aliases the
            caller's tensors; modifying them afterwards changes the layer, and its finiteness check ran at
            construction only (``load_state_dict`` writes into them as well).
        bias: [N_total] of the layer's dtype, or None.
        slices: output widths, Σ = N_total (default: one slice of N_total), e.g. (q, k, v) widths.
        num_adapters: L ≥ 1 slots. max_rank: R ≥ 1, the largest rank a slot holds.
        max_tokens: largest T a forward accepts; the buffers are sized for it.
        stage: a name in :data:`moelora_lib.kernels.STAGES` (default "tuned" = the fastest switches,
            configs from :func:`moelora_lib.configs.load_dense_config`, resolved when a T is first seen).
            Not "auto" (the MoE layer's per-T choice; the config files record none for the dense op):
            ValueError saying so.
        config: a fixed :class:`~moelora_lib.kernels.dense_lora.DenseLoRAConfig` for every T (None =
            per T, as :func:`lora_linear` picks it).
        debug: check lora_ids ∈ [-1, L) in forward (a host sync).
        deterministic: bitwise-repeatable LoRA path (the shrink's SPLIT_K = 1, as
            :func:`lora_linear`'s ``deterministic``). Default False.
        share_scratch: share the per-call buffers (rank intermediate, delta buffer, alignment
            workspaces) with every LoRALinear of the same sizes, dtype and device (default): layers run
            one after another, and nothing in them outlives a forward.
        dtype: the layer's dtype (activations, bias, adapters) with an FP8 weight, which carries none
            (default bfloat16); with a dense weight None or weight's dtype.
        activation_scheme: with an FP8 weight, the base GEMM's form per call of T tokens (the
            checkpoints' field of that name): "weight_only" (e4m3 tiles scaled to the layer's dtype in
            registers; the result equals ``F.linear`` on the dequantized weight up to summation order),
            "dynamic" (W8A8: the activations quantized per token and group of ``weight.block[1]``
            columns, then FP8 tensor cores; each activation within 2^-4 relative of its value; needs
            scale blocks of a multiple of 32 columns), or "auto" (default): weight-only below
            :data:`~moelora_lib.kernels.dense_fp8.DENSE_W8A8_MIN_TOKENS` tokens, W8A8 from there on where
            the block allows it (:meth:`activation_scheme_for`). Settable later (the property). A dense
            weight runs "auto" and "weight_only" as ``F.linear``; "dynamic" needs an FP8 weight.
        fp8_config: a fixed :class:`~moelora_lib.kernels.dense_fp8.DenseFP8Config` for the FP8 GEMM at
            every T (None: :func:`~moelora_lib.kernels.dense_fp8.default_dense_fp8_config` per T); its
            BLOCK_SIZE_K must divide ``weight.block[1]``. FP8 weights only.
    Raises:
        ValueError naming the argument (a dense weight or bias holding NaN/inf too, an FP8 weight holding a
        NaN code or a NaN/inf scale or values beyond ``dtype``'s range: one host sync each).

    Parameters (frozen, in the state dict): ``weight``, ``bias``; with an FP8 weight ``weight_fp8``
    (float8_e4m3fn [N_total, H]) and ``weight_scale_inv`` (its scale grid; the block in ``fp8_block``)
    instead of ``weight`` (which is None; :meth:`base_weight` gives what the base GEMM takes). A dtype
    cast of the module (``.to(dtype)``, ``.half()``) casts the bias and slots and leaves the FP8 codes
    and scales as they are. Buffers (runtime state, not in the state dict): ``lora_a`` [L, S, R, H],
    ``lora_b`` [L, N_total, R] (layouts: module docstring) and ``slot_loaded`` [L] bool. Tokens whose
    slot holds no adapter get exactly the base output.

    Per forward on a GPU: the base GEMM (``F.linear``; FP8: one Triton GEMM, W8A8 after the activation
    quantization); the token alignment: when some slots are empty, three small torch ops mapping the ids
    of empty slots to -1, then the alignment (one launch up to PAIR_PATH_MAX_PAIRS tokens, else three);
    shrink and expand (and, in stages without fused add, a fill and an add) on the activations in the
    layer's dtype, whatever the base weight's format. Inside a :class:`StepAlignments` scope (a
    :class:`~moelora_lib.model.MultiLoRAModel` forward opens one around its layers) the alignment is made
    only by the step's first module of its key (the lora_ids tensor, T, BLOCK_SIZE_M, L, the loaded
    slots) into the scope's own workspaces; the other modules of that key read it and launch only the
    base GEMM, shrink and expand. With no adapter loaded at all, or none in :attr:`active_slots`
    (``MultiLoRAModel.restrict_slots``), only the base GEMM. Alignment workspaces are allocated at
    construction for every BLOCK_SIZE_M the configs up to max_tokens use (a few KB; stage ``tuned``:
    those of the tuned files found at construction); a call under another config allocates its own once.
        gemv_max_tokens: calls of T ≤ this many tokens run as one launch each
            (:func:`~moelora_lib.kernels.dense_gemv.dense_gemv_lora`: split-K GEMV with the shrink and
            expand inside it) instead of the base GEMM + alignment + shrink + expand; an int in
            [0, DENSE_GEMV_MAX_TOKENS], 0 = never; default 1: one token (one request's decode step) is
            where the GEMV beats the four launches on every projection measured, and from two tokens on
            the per-token A reads and CUDA-core work make it slower (docs/perf_notes.md, "Dense projections
            at decode in one launch"). Which calls of such a T take it:

            * dense weight: those with LoRA launches; calls without keep ``F.linear`` (cuBLAS, bit for
              bit). The GEMV's rows with id -1 equal the base up to summation order (fp32, not cuBLAS's).
            * block-FP8 weight: every call whose form (:meth:`activation_scheme_for`) is "weight_only",
              with or without LoRA launches (without: the base GEMV alone, the LoRA arguments None). The
              FP8 base is this package's kernel either way, so one kernel serves both: a batch's rows
              without an adapter get the same arithmetic whether or not another row has one (a CUDA graph
              captured with adapters and one without agree on them), and the weight-only GEMM's 16-row
              tensor-core tiles, mostly padding at decode, are not used. Its result equals ``F.linear``
              on the weight dequantized to the layer's dtype up to summation order, as the weight-only
              GEMM's does. A call whose form is "dynamic" (W8A8: ``activation_scheme="dynamic"``) keeps
              the W8A8 GEMM and the LoRA launches.

            Ids out of [-1, L) give NaN rows on the GEMV.
    """

    _op_prefix = "lora_linear"

    #: Packed weight formats the layer takes as ``weight`` as they are ("fp8":
    #: :class:`~moelora_lib.quant.FP8BlockWeight`); read by
    #: :func:`moelora_lib.model.modeling.packed_linear_formats`.
    PACKED_FORMATS = ("fp8",)

    def __init__(
        self,
        weight: torch.Tensor | FP8BlockWeight,
        bias: torch.Tensor | None = None,
        *,
        slices: Sequence[int] | None = None,
        num_adapters: int,
        max_rank: int,
        max_tokens: int,
        stage: str = "tuned",
        config: DenseLoRAConfig | None = None,
        debug: bool = False,
        deterministic: bool = False,
        share_scratch: bool = True,
        dtype: torch.dtype | None = None,
        activation_scheme: str = "auto",
        fp8_config: DenseFP8Config | None = None,
        gemv_max_tokens: int = 1,
    ):
        super().__init__()
        check_bool("deterministic", deterministic)
        for name, v in (("num_adapters", num_adapters), ("max_rank", max_rank), ("max_tokens", max_tokens)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        _check_stage_and_config(stage, config)
        _check_fp8_args(weight, activation_scheme, fp8_config)
        fp8 = isinstance(weight, FP8BlockWeight)
        if fp8:
            if weight.weight.dim() != 2:
                raise ValueError(
                    f"weight must be a 2-D FP8BlockWeight [N_total, H], got shape {list(weight.shape)}"
                )
            dt = torch.bfloat16 if dtype is None else dtype
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"dtype must be a torch dtype, got {dt!r}")
            check_kernel_dtype(
                dt, weight.device, "dtype (the layer's, with an FP8 weight)", _check_cpu_backend
            )
        else:
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
                raise ValueError(
                    "weight must be a 2-D float tensor [N_total, H] or an FP8BlockWeight, got "
                    f"{_desc(weight)}"
                )
            _check_dense_weight_dtype(weight)
            if dtype is not None and dtype != weight.dtype:
                raise ValueError(
                    f"dtype must be None or weight's dtype {weight.dtype} with a dense weight, got {dtype!r}"
                )
            dt = weight.dtype
            if weight.device.type == "cpu":
                _check_cpu_backend(dt, "weight")
            check_finite("weight", weight)
        if fp8:
            # NaN codes or scales, values beyond the layer dtype's range
            check_dequantized_finite("weight", weight, dt)
        if isinstance(bias, torch.Tensor):
            check_finite("bias", bias)
        check_kernel_device("weight", weight.device)  # the rest must be on weight's device (checked below)
        N, H = weight.shape
        slices = check_slices((N,) if slices is None else slices, N, "N_total = weight.shape[0]")
        L, R, S = num_adapters, max_rank, len(slices)
        dev = weight.device
        z = dict(dtype=dt, device=dev)
        lora_a = torch.zeros((L, S, R, H), **z)
        lora_b = torch.zeros((L, N, R), **z)
        with torch.no_grad():  # a weight that requires grad (an nn.Linear's) is taken and frozen
            validate_lora_linear_inputs(
                torch.empty((0, H), **z),
                weight,
                lora_a,
                lora_b,
                torch.empty((0,), dtype=torch.int32, device=dev),
                slices,
                bias,
                check_values=False,
            )
        self.fp8_block = None  # FP8: the (bn, bk) of the weight's scale blocks
        if fp8:
            self.register_parameter("weight", None)
            self.weight_fp8 = torch.nn.Parameter(weight.weight, requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(weight.scale_inv, requires_grad=False)
            self.fp8_block = weight.block
        else:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_format = "fp8" if fp8 else "dense"
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.register_buffer("slot_loaded", torch.zeros(L, dtype=torch.bool, device=dev), persistent=False)
        self.in_features, self.out_features = H, N
        self.slices, self.L, self.R, self.S = slices, L, R, S
        self.offsets = tuple(sum(slices[:s]) for s in range(S))
        self.max_tokens = max_tokens
        self._stage = STAGES[stage]
        self.fixed_config = config
        self.fixed_fp8_config = fp8_config
        self.debug = check_bool("debug", debug)
        self._configs: dict[int, DenseLoRAConfig] = {}
        self._schemes: dict[int, str] = {}
        self._fp8_configs: dict[int, DenseFP8Config] = {}
        self.activation_scheme = activation_scheme  # property: validates, clears the per-T choices
        self.deterministic = deterministic  # property: validates, clears the per-T configs
        self.share_scratch = check_bool("share_scratch", share_scratch)
        self._gemv_configs: dict[tuple[int, bool], DenseGemvConfig] = {}
        self.gemv_max_tokens = gemv_max_tokens  # property: validates
        self._loaded = [False] * L  # host copy of slot_loaded
        self._scratch = None
        self._buffers_key = None
        self._alloc_buffers()
        self._register_op_name()

    def extra_repr(self) -> str:
        fp8 = ""
        if self.weight_format == "fp8":
            fp8 = (
                f", weights=fp8 (block {list(self.fp8_block)}), activation_scheme={self.activation_scheme!r}"
            )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, slices={self.slices}, "
            f"adapters={self.L}, max_rank={self.R}, max_tokens={self.max_tokens}, "
            f"stage={self.stage.name!r}, dtype={self.dtype}"
            + fp8
            + (", deterministic=True" if self.deterministic else "")
            + (f", gemv_max_tokens={self.gemv_max_tokens}" if self.gemv_max_tokens else "")
        )

    # --- weights ----------------------------------------------------------------------------------
    @property
    def _ref(self) -> torch.Tensor:
        """The tensor whose dtype and device are the layer's: the adapter slot ``lora_a`` (``.to()``
        moves and casts it; an FP8 weight carries no activation dtype)."""
        return self.lora_a

    @property
    def dtype(self) -> torch.dtype:
        """The layer's dtype: activations, output, bias and adapter slots (follows ``.to()``)."""
        return self.lora_a.dtype

    @property
    def device(self) -> torch.device:
        """The layer's device (follows ``.to()``)."""
        return self.lora_a.device

    def base_weight(self) -> torch.Tensor | FP8BlockWeight:
        """The base GEMM's weight [N_total, H]: the dense Parameter, or an
        :class:`~moelora_lib.quant.FP8BlockWeight` over ``weight_fp8`` / ``weight_scale_inv``."""
        if self.weight_format == "fp8":
            return FP8BlockWeight(self.weight_fp8, self.weight_scale_inv, self.fp8_block)
        return self.weight

    @property
    def activation_scheme(self) -> str:
        """The FP8 base GEMM's activation scheme ("auto", "weight_only", "dynamic"; see the
        constructor). Setting it validates the value (ValueError naming ``activation_scheme``) and drops
        the per-T choices made so far, so the next forward at every T follows it (a CUDA graph captured
        before keeps the form it captured)."""
        return self._activation_scheme

    @activation_scheme.setter
    def activation_scheme(self, value: str) -> None:
        _check_fp8_args(self.base_weight(), value, self.fixed_fp8_config)
        self._activation_scheme = value
        self._schemes.clear()
        self._fp8_configs.clear()

    @property
    def stage(self) -> Stage:
        """The layer's stage (a :class:`~moelora_lib.kernels.stages.Stage` of
        :data:`~moelora_lib.kernels.STAGES`). Set it by name, as at construction (or to a Stage object):
        ValueError naming
        ``stage`` for another value; the per-T configs resolved so far are dropped and the scratch is
        re-sized on the next forward when the new stage needs other buffers (a CUDA graph captured before
        keeps the stage it captured). A ``config`` given at construction still applies."""
        return self._stage

    @stage.setter
    def stage(self, value: str | Stage) -> None:
        if not isinstance(value, Stage):
            _check_stage_and_config(value, None)
        new = value if isinstance(value, Stage) else STAGES[value]
        if new.fused_add != self._stage.fused_add:
            self._buffers_key = None  # the scratch's delta buffer depends on it
        self._stage = new
        self._configs.clear()

    @property
    def gemv_max_tokens(self) -> int:
        """Largest T run by the one-launch decode GEMV (0 = never; see the constructor). Setting it
        validates the value (ValueError naming ``gemv_max_tokens``); a CUDA graph captured before keeps
        the path it captured."""
        return self._gemv_max_tokens

    @gemv_max_tokens.setter
    def gemv_max_tokens(self, value: int) -> None:
        if not is_int(value) or not 0 <= value <= DENSE_GEMV_MAX_TOKENS:
            raise ValueError(f"gemv_max_tokens must be an int in [0, {DENSE_GEMV_MAX_TOKENS}], got {value!r}")
        self._gemv_max_tokens = int(value)

    def gemv_config_for(self, T: int) -> DenseGemvConfig:
        """The :class:`~moelora_lib.kernels.dense_gemv.DenseGemvConfig` of the decode GEMV at T tokens
        (:func:`~moelora_lib.kernels.dense_gemv.default_dense_gemv_config` for this device's SM count and,
        FP8 weight, its scale block's columns; SPLIT_K = 1 when ``deterministic``); resolved once per T."""
        key = (T, self.deterministic)
        cfg = self._gemv_configs.get(key)
        if cfg is None:
            sms = 132
            if self.device.type == "cuda":
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            block_k = self.fp8_block[1] if self.weight_format == "fp8" else None
            cfg = default_dense_gemv_config(
                T, self.out_features, self.in_features, slices=self.slices, num_sms=sms, block_k=block_k
            )
            if self.deterministic:
                cfg = replace(cfg, SPLIT_K=1)
            self._gemv_configs[key] = cfg
        return cfg

    def runs_gemv(self, T: int, lora: bool = True) -> bool:
        """Whether a call of T tokens (``lora``: with LoRA launches, i.e. an active slot covers the call)
        runs as the one-launch decode GEMV (:meth:`gemv_config_for`) rather than the base GEMM plus the
        stage's LoRA launches: T ≤ ``gemv_max_tokens`` and, dense weight, ``lora``; FP8 weight, the
        weight-only form at T (see the constructor's ``gemv_max_tokens``). Host-side, no sync. ValueError
        naming T for a T that is not an int >= 0."""
        if not is_int(T) or T < 0:
            raise ValueError(f"T must be an int >= 0, got {T!r}")
        if not 0 < T <= self._gemv_max_tokens:
            return False
        if self.weight_format == "fp8":
            return self.activation_scheme_for(T) == "weight_only"
        return lora

    def _gemv(self, x: torch.Tensor, lora_ids: torch.Tensor | None, T: int) -> torch.Tensor:
        """The decode GEMV's output [T, N_total] (a new tensor), its split-K workspace in the module's
        scratch (shared, see ``share_scratch``); ``lora_ids`` None: the base GEMV alone (no LoRA launch
        needed)."""
        cfg = self.gemv_config_for(T)
        ws = None
        if cfg.SPLIT_K > 1:
            if self._buffers_key != (self.dtype, self.device):
                self._alloc_buffers()
            ws = self._scratch.gemv_workspace(self.slices)
        lora = (None, None, None) if lora_ids is None else (self.lora_a, self.lora_b, lora_ids)
        # slots holding no adapter: no LoRA work, as id -1 (checked in the kernel, no extra launch)
        mask = None if lora_ids is None or all(self._loaded) else self.slot_loaded
        try:
            return dense_gemv_lora(
                x,
                self.base_weight(),
                self.bias,
                *lora,
                slices=self.slices,
                config=cfg,
                workspace=ws,
                slot_mask=mask,
            )
        except BaseException:  # a call cut short (an interrupt under the interpreter) may leave partial sums
            if ws is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                ws.partial.zero_()
                ws.counters.zero_()
            raise

    def activation_scheme_for(self, T: int) -> str:
        """The form the base GEMM runs at T tokens: "dynamic" (W8A8) or "weight_only"
        (:func:`~moelora_lib.kernels.dense_fp8.resolve_dense_scheme` of :attr:`activation_scheme`;
        "weight_only" for a dense weight, which runs ``F.linear``); resolved on the host once per T."""
        got = self._schemes.get(T)
        if got is None:
            got = self._schemes[T] = resolve_dense_scheme(self._activation_scheme, self.base_weight(), T)
        return got

    def fp8_config_for(self, T: int) -> DenseFP8Config | None:
        """The :class:`~moelora_lib.kernels.dense_fp8.DenseFP8Config` the FP8 base GEMM launches at T
        tokens (the fixed ``fp8_config``, else
        :func:`~moelora_lib.kernels.dense_fp8.default_dense_fp8_config` for the form of
        :meth:`activation_scheme_for`); resolved once per T. None for a dense weight."""
        if self.weight_format != "fp8":
            return None
        cfg = self._fp8_configs.get(T)
        if cfg is None:
            cfg = self.fixed_fp8_config
            if cfg is None:
                w8a8 = self.activation_scheme_for(T) == "dynamic"
                N, H, bk = self.out_features, self.in_features, self.fp8_block[1]
                cfg = default_dense_fp8_config(T, N, H, w8a8=w8a8, block_k=bk)
            self._fp8_configs[T] = cfg
        return cfg

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """The base output [T, N_total] (a new tensor): ``F.linear``, or the FP8 GEMM in the form of
        :meth:`activation_scheme_for` with the config of :meth:`fp8_config_for`."""
        if self.weight_format != "fp8":
            return F.linear(x, self.weight, self.bias)
        T = x.shape[0]
        cfg = self.fp8_config_for(T)
        w = self.base_weight()
        if self.activation_scheme_for(T) == "weight_only":
            return dense_fp8_weight_only(x, w, self.bias, config=cfg)
        bk = self.fp8_block[1]
        x_q, x_scale = quantize_act(x, bk)
        return dense_fp8_w8a8(x_q, x_scale, w, self.bias, group_size=bk, out_dtype=x.dtype, config=cfg)

    def _cast_exempt(self) -> tuple[str, ...]:
        """FP8 codes and scales keep their dtypes through a dtype cast (:class:`~moelora_lib.ops.OpLayer`)."""
        return ("weight_fp8", "weight_scale_inv") if self.weight_format == "fp8" else ()

    # --- buffers ----------------------------------------------------------------------------------
    def _alloc_buffers(self) -> None:
        dt, dev = self.dtype, self.device
        key = (dt, dev, self.max_tokens, self.S * self.R, self.out_features, self.L, self.stage.fused_add)
        scratch = attach_scratch(self, _SCRATCH, key, _Scratch)
        self._buffers_key = (dt, dev)
        # the alignment workspaces of every BLOCK_SIZE_M the forward will use, up front
        bms = (
            (self.fixed_config.block_size_m,)
            if self.fixed_config is not None
            else dense_block_sizes_for(
                self.stage,
                self.max_tokens,
                hidden=self.in_features,
                slices=self.slices,
                rank=self.R,
                adapters=self.L,
            )
        )
        for bm in bms:
            scratch.workspace("pair", bm)
            if self.max_tokens > PAIR_PATH_MAX_PAIRS:
                scratch.workspace("multi", bm)

    def _view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._scratch.bufs[name][: math.prod(shape)].view(shape)

    def memory_report(self) -> dict[str, int]:
        """Bytes held on the device: {"weights", "adapter_slots", "scratch" (shared, see share_scratch),
        "scratch_shared_by", "per_layer" (weights + slots (+ scratch when not shared))}."""
        weights = nbytes(
            (self.weight, getattr(self, "weight_fp8", None), getattr(self, "weight_scale_inv", None))
        )
        weights += nbytes((self.bias,))
        return memory_report(self, weights, nbytes((self.lora_a, self.lora_b, self.slot_loaded)))

    def config_for(self, T: int) -> DenseLoRAConfig:
        """The config (after the stage's adapt) the forward launches at T tokens; resolved once per T."""
        cfg = self._configs.get(T)
        if cfg is None:
            cfg = self.fixed_config
            if cfg is None:
                cfg = dense_config_for(
                    self.stage, T, hidden=self.in_features, slices=self.slices, rank=self.R, adapters=self.L
                )
            cfg = adapt_dense_config(self.stage, cfg)
            if self.deterministic:
                cfg = cfg.deterministic()
            self._configs[T] = cfg
        return cfg

    # --- adapter slots ----------------------------------------------------------------------------
    def _check_slot(self, slot) -> int:
        if not is_int(slot) or not 0 <= slot < self.L:
            raise ValueError(f"slot must be an int in [0, num_adapters={self.L}), got {slot!r}")
        return int(slot)

    def _per_slice(self, name: str, v) -> list:
        if isinstance(v, torch.Tensor) and self.S == 1:
            return [v]
        if not isinstance(v, (list, tuple)) or len(v) != self.S:
            raise ValueError(
                f"{name} must be a list of S = {self.S} entries (one per slice {self.slices}, None for a "
                f"slice the adapter lacks), got {_desc(v) if not isinstance(v, (list, tuple)) else len(v)}"
            )
        return list(v)

    def load_adapter(self, slot: int, lora_a, lora_b, scaling: float | Sequence[float] = 1.0) -> None:
        """Copy an adapter into slot ``slot`` (replacing what it held), its scaling folded into B.

        Args:
            slot: int in [0, L).
            lora_a: per slice s, PEFT's ``lora_A.weight`` [r_s, H] of projection s, or None when the
                adapter does not cover it (e.g. a q/v-only adapter on a fused qkv: [A_q, None, A_v]).
                A single tensor is accepted when S = 1.
            lora_b: per slice s, ``lora_B.weight`` [N_s, r_s], or None where lora_a is None.
            scaling: a finite real number (e.g. lora_alpha / r), or a list/tuple of one per slice: a
                Python or numpy int or float, a numbers.Real or a 0-d real tensor
                (:func:`~moelora_lib.common.check_real_scalar`); multiplied into B in fp32 before the
                cast to the layer's dtype.
        Any rank 1 ≤ r_s ≤ R per slice; everything else in the slot is zeroed, so the result is exactly
        that of the rank-r adapter whatever the slot held. Float tensors on the layer's device.
        Raises:
            ValueError naming the argument: slot out of range, not S entries, A/B None mismatch, no
            slice given, rank outside [1, R], shape, non-float dtype, device, non-finite scaling;
            what ``slot_guard`` raises (a MultiLoRAModel's: RuntimeError while a running generate call
            uses the slot).
        Nothing is written unless every check passes. Plain copies on the current stream: not while a
        captured forward replays on another stream.
        """
        slot = self._check_slot(slot)
        self._guard_slot(slot, "load_adapter")
        As, Bs = self._per_slice("lora_a", lora_a), self._per_slice("lora_b", lora_b)
        if isinstance(scaling, (list, tuple)):
            if len(scaling) != self.S:
                raise ValueError(
                    f"scaling must be one real number or a list of S = {self.S} (one per slice), got "
                    f"{len(scaling)} entries"
                )
            scales = [check_real_scalar(f"scaling[{s}]", v) for s, v in enumerate(scaling)]
        else:
            scales = [check_real_scalar("scaling", scaling)] * self.S
        pairs = []
        for s, (a, b) in enumerate(zip(As, Bs)):
            if a is None and b is None:
                pairs.append(None)
                continue
            if a is None or b is None:
                raise ValueError(f"slice {s}: lora_a and lora_b must both be tensors or both None")
            for what, t in (("lora_a", a), ("lora_b", b)):
                if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                    raise ValueError(f"{what}[{s}] must be a 2-D float tensor, got {_desc(t)}")
                if t.device != self.device:
                    raise ValueError(f"{what}[{s}] must be on {self.device}, got {t.device}")
            # the layout before the rank range: a transposed factor is a shape error, not a rank error
            if a.shape[1] != self.in_features:
                raise ValueError(
                    f"lora_a[{s}] must have shape [r, H] = (r, {self.in_features}), got {tuple(a.shape)}"
                )
            r = a.shape[0]
            if tuple(b.shape) != (self.slices[s], r):
                raise ValueError(
                    f"lora_b[{s}] must have shape [N_s, r] = ({self.slices[s]}, {r}) (r from lora_a[{s}]), "
                    f"got {tuple(b.shape)}"
                )
            if not 1 <= r <= self.R:
                raise ValueError(f"lora_a[{s}]: rank r = {r} must be in [1, max_rank R = {self.R}]")
            pairs.append((a, b, r))
        if all(p is None for p in pairs):
            raise ValueError("load_adapter: every slice is None; to clear a slot use unload_adapter")
        dt = self.dtype
        with torch.no_grad():
            cast = []
            for s, p in enumerate(pairs):
                if p is None:
                    cast.append(None)
                    continue
                a, b, r = p
                a_c, b_c = a.to(dt), (b.float() * scales[s]).to(dt)
                for what, t in ((f"lora_a[{s}]", a_c), (f"lora_b[{s}]·scaling ({scales[s]:g})", b_c)):
                    if not is_finite(t):  # one host sync per load, not per call
                        raise ValueError(
                            f"{what} is not finite in the layer's dtype {dt} (inf/NaN, or beyond its range): "
                            "the slot would make every token on it inf/NaN"
                        )
                cast.append((a_c, b_c, r))
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            for s, p in enumerate(cast):
                if p is None:
                    continue
                a, b, r = p
                o, n = self.offsets[s], self.slices[s]
                self.lora_a[slot, s, :r].copy_(a)
                self.lora_b[slot, o : o + n, :r].copy_(b)
            self.slot_loaded[slot] = True
        self._loaded[slot] = True

    def unload_adapter(self, slot: int) -> None:
        """Empty slot ``slot`` (zeros); its tokens then get exactly the base output.

        Raises: ValueError if slot is not an int in [0, L); what ``slot_guard`` raises (a
        MultiLoRAModel's: RuntimeError while a running generate call uses the slot)."""
        slot = self._check_slot(slot)
        self._guard_slot(slot, "unload_adapter")
        with torch.no_grad():
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.slot_loaded[slot] = False
        self._loaded[slot] = False

    @property
    def loaded_slots(self) -> list[int]:
        """Slots holding an adapter (host-side)."""
        return [i for i, v in enumerate(self._loaded) if v]

    def lora_launches(self, slots=None) -> tuple[bool]:
        """(lora,): whether a forward whose :attr:`active_slots` are ``slots`` makes the LoRA launches
        (alignment, shrink, expand; one of each for all slices), i.e. one of ``slots`` (None: any slot)
        holds an adapter. Host-side. Raises ValueError naming ``slots`` unless None or an iterable of ints
        in [0, L)."""
        return self._launches(None if slots is None else self._check_slot_set("slots", slots))

    def _launches(self, slots: frozenset[int] | None) -> tuple[bool]:
        return (any(self._loaded) if slots is None else any(self._loaded[s] for s in slots),)

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, lora_ids: torch.Tensor) -> torch.Tensor:
        """The layer on T tokens, through ``torch.ops.moelora.lora_linear_module``.

        Args:
            x: [T, H] of the layer's dtype and device, T ≤ max_tokens.
            lora_ids: [T] int32/int64 on the layer's device, slot of each token in [-1, L); -1 or an empty
                slot = no adapter. With :attr:`active_slots` set and none of them loaded, no LoRA launch
                runs (see there).
        Returns:
            [T, N_total] of the layer's dtype (a new tensor).
        Raises:
            ValueError naming the argument for a wrong shape, dtype or device, T > max_tokens, x
            requiring grad while grad mode is on (inference only: run under torch.no_grad() /
            torch.inference_mode()); with ``debug`` also for id values out of range (otherwise
            unchecked: no host sync; out-of-range ids are dropped by the alignment, their rows' LoRA
            part unspecified; on the GEMV path, T ≤ ``gemv_max_tokens``, their rows are NaN).
        """
        # checked before the op too: a meta or foreign tensor would otherwise reach its fake impl
        self._check_runs_here(self.device)
        self._check_call(x, lora_ids)
        check_no_grad(("x", x))  # inference only (the custom op has no autograd formula); host-side
        return lora_linear_module(x, lora_ids, self.layer_name)

    def _check_call(self, x, lora_ids) -> None:
        dt, dev = self.dtype, self.device
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be a tensor [T, H={self.in_features}], got {_desc(x)}")
        if x.dtype != dt or x.device != dev:
            raise ValueError(f"x must be {dt} on {dev} (the layer's), got {x.dtype} on {x.device}")
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"x: T = {T} exceeds the layer's max_tokens = {self.max_tokens}")
        if (
            not isinstance(lora_ids, torch.Tensor)
            or tuple(lora_ids.shape) != (T,)
            or lora_ids.dtype not in (torch.int32, torch.int64)
            or lora_ids.device != dev
        ):
            raise ValueError(
                f"lora_ids must be an int32/int64 tensor [T={T}] on {dev}, got {_desc(lora_ids)}"
            )

    def _map_empty_slots(self, lora_ids: torch.Tensor) -> torch.Tensor:
        """lora_ids [T] with the ids of slots this module holds no adapter in set to -1 (no work, exactly
        the base): three torch ops on the device, none when every slot holds one. By the loaded slots
        alone, as MoELoRALayer: one launch sequence serves every active set with launches."""
        if all(self._loaded):
            return lora_ids
        L = self.L
        covered = self.slot_loaded[lora_ids.clamp(0, L - 1).long()] & (lora_ids >= 0) & (lora_ids < L)
        return torch.where(covered, lora_ids, torch.full_like(lora_ids, -1))

    def _align(
        self, ids: torch.Tensor, T: int, bm: int, workspace: Callable[[str, int], object] | None = None
    ) -> Alignment:
        """The alignment of ids [T] (empty slots already -1) at BLOCK_SIZE_M ``bm``, E = 1: one launch up to
        PAIR_PATH_MAX_PAIRS tokens, else three; into ``workspace(kind, bm)`` ("pair" / "multi"; default:
        the scratch's, which the next module sharing it overwrites)."""
        ws = self._scratch.workspace if workspace is None else workspace
        zeros = self._scratch.bufs["zeros"][:T]
        if use_pair_path(T, 1, self.L):
            return align_tokens_pair(zeros, 1, bm, ids, self.L, bm, out=ws("pair", bm))[1]
        return align_tokens_triton(zeros, 1, bm, lora_ids=ids, num_adapters=self.L, out=ws("multi", bm))

    def _lora_alignment(self, lora_ids: torch.Tensor, T: int, bm: int) -> Alignment:
        """The alignment the LoRA launches of a forward read: the open :class:`StepAlignments` step's for
        this key (made by the step's first module of the key), else this call's own."""
        step = _OPEN_STEP.get()
        if step is None:
            return self._align(self._map_empty_slots(lora_ids), T, bm)
        return step.alignment(self, lora_ids, T, bm)

    def _forward_impl(self, x: torch.Tensor, lora_ids: torch.Tensor) -> torch.Tensor:
        """The eager body of the custom op (see :meth:`forward`).

        A call of T ≤ ``gemv_max_tokens`` tokens runs the one-launch decode GEMV: with a dense weight when
        it has LoRA launches (otherwise ``F.linear`` alone); with a block-FP8 weight whenever its form at T
        is weight-only, with or without LoRA launches (without: the base GEMV alone), so every call of that
        T gives its rows without an adapter the same arithmetic. Other calls: the base GEMM
        (:meth:`_base`), then, with LoRA launches, the alignment, shrink and expand.
        """
        self._check_call(x, lora_ids)
        if self._buffers_key != (self.dtype, self.device):  # built, moved (.to()) or unpickled
            dt, dev = self.dtype, self.device
            check_kernel_dtype(dt, dev, "the layer's dtype (after .to())", _check_cpu_backend)
            self._check_runs_here(dev)
        if self.debug:
            _check_values(lora_ids, self.L)
        T = x.shape[0]
        lora = T > 0 and self._launches(self._active_slots)[0]  # host-side flags
        # T ≤ gemv_max_tokens: one GEMV launch; dense weights only when LoRA launches run (else cuBLAS),
        # FP8 weights for every weight-only call, so the base rows' arithmetic is one kernel's either way
        if self.runs_gemv(T, lora):
            return self._gemv(x, lora_ids if lora else None, T)
        out = self._base(x)
        if not lora:  # no LoRA launch at all
            return out
        if self._buffers_key != (self.dtype, self.device):
            self._alloc_buffers()
        cfg = self.config_for(T)
        align = self._lora_alignment(lora_ids, T, cfg.block_size_m)
        inter = self._view("inter", (T, self.S * self.R))
        delta = None if self.stage.fused_add else self._view("delta", (T, self.out_features))
        return dense_lora_add(
            self.stage,
            out,
            x,
            self.lora_a,
            self.lora_b,
            align,
            cfg,
            slices=self.slices,
            inter=inter,
            delta=delta,
        )


@torch.library.custom_op("moelora::lora_linear_module", mutates_args=())
def lora_linear_module(x: torch.Tensor, lora_ids: torch.Tensor, layer: str) -> torch.Tensor:
    """One forward of the registered :class:`LoRALinear` ``layer`` (a name from
    :func:`moelora_lib.ops.register_layer`): x [T, H], lora_ids [T] int32/int64 -> [T, N_total] (new tensor).
    The weights and adapter slots are read from the live module at run time."""
    return ops.get_layer(layer)._forward_impl(x, lora_ids)


@lora_linear_module.register_fake
def _lora_linear_module_fake(x, lora_ids, layer):
    # shape/dtype only: [T, N_total] (T may be symbolic); N_total is the registered layer's constant
    return x.new_empty((x.shape[0], ops.get_layer(layer).out_features))
