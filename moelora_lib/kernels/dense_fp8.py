"""Block-FP8 dense GEMM: ``y[T, N] = x[T, K]·Wᵀ (+ bias)`` with W a block-FP8
:class:`~moelora_lib.quant.FP8BlockWeight` [N, K] (float8_e4m3fn codes and one ``scale_inv`` per
bn x bk block, the layout of the published Qwen3 FP8 / DeepSeek-V3 checkpoints;
:mod:`moelora_lib.quant.fp8`), for the attention and dense-MLP projections of
:class:`moelora_lib.LoRALinear`.

One Triton kernel, ``_dense_fp8_kernel``, in two forms (the constexpr ``W8A8``):

* **weight-only** (:func:`dense_fp8_weight_only`; decode): x is float16/bfloat16/float32. Each K step
  loads the e4m3 tile W[n, k0:k0+BLOCK_SIZE_K] and, per tile column n, the scale of block
  (n // bn, k0 // bk); the tile is ``fp32(code)·fp32(scale)`` rounded once to x's dtype — exactly
  :func:`~moelora_lib.quant.dequantize_fp8_block` in that dtype — and goes into the same ``tl.dot`` as a
  dense weight (fp32 accumulation). The weight stream is 1 byte per weight plus the scales: half the
  bytes of a bf16 weight, which is what a memory-bound decode step pays for.
* **W8A8** (:func:`dense_fp8_w8a8`; prefill): x is given quantized, e4m3 codes ``x_q`` [T, K] with one
  fp32 scale per (token, group of ``group_size`` columns) ``x_scale`` [T, ceil(K/group_size)] (the
  checkpoints' ``activation_scheme: "dynamic"``, DeepSeek-V3's 1 x 128 activation tiles;
  :func:`quantize_act`). Each K step is one ``tl.dot`` on the two FP8 tiles (FP8 tensor cores on
  sm_90), its fp32 partial started from zero, then multiplied by the row's activation scale and the
  column's weight-block scale and added to an fp32 accumulator:
  ``acc[m, n] += (Σ_k xq[m, k]·wq[n, k])·x_scale[m, k0 // g]·scale_inv[n // bn, k0 // bk]``. Starting
  every K step's dot from zero keeps Hopper's reduced-precision FP8 accumulation (Triton's default on
  sm_90, ``max_num_imprecise_acc``) to at most BLOCK_SIZE_K ≤ 128 products before the fp32 add: the
  promotion interval of 128 the DeepSeek-V3 report uses for the same reason.

Both: BLOCK_SIZE_K must divide the weight's bk (and, W8A8, the activation group size), so a K step
reads one scale column; W8A8 also needs BLOCK_SIZE_K ≥ :data:`W8A8_MIN_BLOCK_K` = 32, the K of one FP8
tensor-core instruction (Triton refuses an FP8 ``tl.dot`` with K < 32 for sm_90). Checked in the
launchers: ValueError naming ``config.BLOCK_SIZE_K``. On sm_90, Triton emits FP8 ``wgmma`` (e4m3 x e4m3)
for W8A8 tiles of BLOCK_SIZE_M ≥ 64; smaller tiles compile to ``mma.sync`` on widened values (same
numbers, no FP8 rate), so the W8A8 default configs use M tiles of at least 64 rows. N and K need not be
multiples of anything: the last tile rows/columns are clamped into range for the loads and
masked at the store; without EVEN_K (K % BLOCK_SIZE_K ≠ 0) the K loop masks its loads with zeros.
Tiles are visited in grouped order (GROUP_SIZE_M M-tiles per column of N-tiles before moving on, the
Triton matmul tutorial's L2 swizzle, :func:`~moelora_lib.kernels.triton_kernels._pid_to_mn`). The
number of tokens is not specialized (``do_not_specialize``): one binary serves every T of a config.
The bias is added in fp32; the result is rounded once to the output dtype.

Which form a call of T tokens runs under ``activation_scheme`` "auto" (:func:`resolve_dense_scheme`):
weight-only below :data:`DENSE_W8A8_MIN_TOKENS` tokens, W8A8 from there on (where the scale block admits
a W8A8 K step, :data:`W8A8_MIN_BLOCK_K`). The estimate behind the threshold (not yet measured): with
1-byte weights a GEMM of T tokens does 2·T FLOP per weight byte, and the H200's bf16 ridge is
~675 TFLOP/s / 4.4 TB/s ≈ 150 FLOP/byte, so below ~75 tokens both forms are bound by the weight stream
and the weight-only form saves the activation quantization pass and its error; from ~2× that, the bf16
dot of the weight-only form (plus its per-tile e4m3 scaling) is the bound and the FP8 dot (twice the
bf16 rate) wins.

Precision: weight-only equals the dense GEMM on the exactly dequantized weights up to fp32 summation
order (tf32 for float32 x on the GPU, Triton's default input precision). W8A8 adds the activation
quantization: each x element is replaced by ``q·scale`` within 2^-4 relative (e4m3 has 3 mantissa bits;
2^-10·scale absolute below e4m3's normal range), so each output is off by at most 2^-4·Σ_k |x_k·W_nk|
from the weight-only result; the rounding errors have random signs, so the typical error is far below
that bound.

Sources: DeepSeek-V3 technical report (arXiv:2412.19437, §3.3: fine-grained 1 x 128 activation / 128 x
128 weight scaling, FP8 GEMM with fp32 promotion per 128 K elements); the block-FP8 GEMM design of
vLLM's ``w8a8_block_fp8_matmul`` (vllm/model_executor/layers/quantization/utils/fp8_utils.py:
per-K-step scale gather by ``k0 // group``, per-column weight-scale gather by ``n // bn``). The code is
this project's own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..common import aligned16, check_cpu_backend, check_tensor, describe
from ..hardware import H200_NUM_SMS
from ..quant.fp8 import FP8BlockWeight
from .fp8_act import quantize_fp8_act
from .stages import ACTIVATION_SCHEMES, W8A8_MIN_BLOCK_K
from .triton_kernels import _pid_to_mn

__all__ = [
    "DENSE_W8A8_MIN_TOKENS",
    "ACTIVATION_SCHEMES",
    "W8A8_MIN_BLOCK_K",
    "DenseFP8Config",
    "default_dense_fp8_config",
    "check_dense_scheme",
    "resolve_dense_scheme",
    "quantize_act",
    "DENSE_FP8_KERNEL",
    "dense_fp8_args",
    "dense_fp8_weight_only",
    "dense_fp8_w8a8",
    "dense_fp8_linear",
    "dense_fp8_reference",
]

#: The fewest tokens at which ``activation_scheme="auto"`` runs the dense W8A8 form (FP8 tensor cores,
#: activations quantized per call); below it the weight-only form. Measured crossover (an H100 with the
#: default configs, data/dev/h100_20261207/nb15/15_dense.csv, Qwen3-32B and Qwen3-30B-A3B projections):
#: W8A8 is within 5 % of weight-only or faster from 64 tokens on and 1.2–2.9× slower at 1–8 tokens.
DENSE_W8A8_MIN_TOKENS = 64

# ACTIVATION_SCHEMES ("auto", "weight_only", "dynamic": the checkpoints' field of that name) and
# W8A8_MIN_BLOCK_K (32, the K of one FP8 tensor-core instruction on Hopper) are the MoE layer's
# (:mod:`moelora_lib.kernels.stages`), re-exported here: one set of values for every FP8 GEMM. For a dense
# projection: "auto" per T (:func:`resolve_dense_scheme`), "weight_only" (activations stay in their
# dtype, each e4m3 weight tile is scaled in registers), "dynamic" (W8A8, :func:`quantize_act`); dense
# weights run as "weight_only" ("auto" included).

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------------
def _dense_fp8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    fp8_bn,
    fp8_bk,
    act_group,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W8A8: tl.constexpr,
):
    # out[m, n] = Σ_k x[m, k]·W[n, k] (+ bias[n]); W = e4m3 codes · scale_inv[n // fp8_bn, k // fp8_bk];
    # W8A8: x = e4m3 codes · xs[m, k // act_group]. BLOCK_SIZE_K divides fp8_bk (and act_group).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = _pid_to_mn(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    m_mask = offs_m < M
    offs_m_ld = tl.where(m_mask, offs_m, 0).to(tl.int64)  # rows past T read row 0, never stored
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    offs_n_ld = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    x_ptrs = x_ptr + offs_m_ld[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk  # Wᵀ tile [BK, BN]
    s_ptrs = ws_ptr + (offs_n_ld // fp8_bn) * stride_sn  # the weight-scale row of each tile column
    xs_ptrs = xs_ptr + offs_m_ld * stride_xsm  # W8A8: the activation-scale row of each tile row
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            wa = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_SIZE_K
            xa = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            wa = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        k0 = k * BLOCK_SIZE_K
        ws = tl.load(s_ptrs + (k0 // fp8_bk) * stride_sk).to(tl.float32)
        if W8A8:
            xs = tl.load(xs_ptrs + (k0 // act_group) * stride_xsk)
            part = tl.dot(xa, wa)  # FP8 x FP8, fp32 result of this K step alone
            acc += part * xs[:, None] * ws[None, :]
        else:
            wa = (wa.to(tl.float32) * ws[None, :]).to(xa.dtype)  # = dequantize_fp8_block in x's dtype
            acc = tl.dot(xa, wa, acc)
        x_ptrs += BLOCK_SIZE_K * stride_xk
        w_ptrs += BLOCK_SIZE_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n_ld)
        acc = acc + bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


#: The jitted kernel; the number of tokens M is not specialized (one binary for every T of a config).
DENSE_FP8_KERNEL = triton.jit(_dense_fp8_kernel, do_not_specialize=["M"])


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------
def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class DenseFP8Config:
    """Launch parameters of one block-FP8 dense GEMM.

    Attributes:
        BLOCK_SIZE_M/N/K: tile sizes, powers of two ≥ 16 (tl.dot's minimum). BLOCK_SIZE_K must also
            divide the weight's scale block columns bk (and, W8A8, the activation group size): a K step
            reads one scale column (the launchers check it against the weight).
        GROUP_SIZE_M: grouped program order (M-tiles per group; 1 = row-major), ≥ 1.
        NUM_WARPS: warps per program, a power of two. NUM_STAGES: software-pipelining depth, ≥ 1.
    Raises:
        ValueError naming the field.
    """

    BLOCK_SIZE_M: int = 64
    BLOCK_SIZE_N: int = 128
    BLOCK_SIZE_K: int = 128
    GROUP_SIZE_M: int = 8
    NUM_WARPS: int = 4
    NUM_STAGES: int = 3

    def __post_init__(self) -> None:
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if not _is_pow2(self.NUM_WARPS):
            raise ValueError(f"NUM_WARPS must be a power of two >= 1, got {self.NUM_WARPS!r}")
        for name in ("GROUP_SIZE_M", "NUM_STAGES"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        """Compact label, e.g. ``m16n64k128g8w4st4``."""
        return (
            f"m{self.BLOCK_SIZE_M}n{self.BLOCK_SIZE_N}k{self.BLOCK_SIZE_K}g{self.GROUP_SIZE_M}"
            f"w{self.NUM_WARPS}st{self.NUM_STAGES}"
        )


def _pow2_divisor(n: int, cap: int = 128) -> int:
    """The largest power of two ≤ cap that divides n (n ≥ 1)."""
    return min(cap, n & -n)


def default_dense_fp8_config(T: int, N: int, K: int, *, w8a8: bool, block_k: int = 128) -> DenseFP8Config:
    """Default config of a block-FP8 GEMM of T tokens, N output features, K input features whose
    weight (and, W8A8, activation) scale blocks span ``block_k`` columns. Hand-picked H200 starting
    points by T bucket, not tuned:

    * BLOCK_SIZE_M: 16 up to 16 tokens, 32 up to 32, 64 up to 64, else 128; W8A8 at least 64 (the
      smallest M tile Triton runs on FP8 wgmma on sm_90);
    * BLOCK_SIZE_K: the largest power of two ≤ 128 dividing ``block_k``, and no wider than K rounded
      up to a power of two (≥ 16; W8A8 ≥ 32);
    * BLOCK_SIZE_N: 128, halved (down to 32) while the grid has fewer than two programs per SM of the
      H200 (decode: a weight-streaming GEMM needs every SM reading);
    * GROUP_SIZE_M 8; NUM_WARPS 8 for 128 x 128 tiles, else 4; NUM_STAGES 4 for M tiles of ≤ 32 rows
      (deeper prefetch of the weight stream), else 3.

    Raises ValueError naming ``block_k`` when it has no power-of-two divisor ≥ 16 (W8A8: ≥ 32): no K
    step fits one scale column.
    """
    min_k = W8A8_MIN_BLOCK_K if w8a8 else 16
    if not isinstance(block_k, int) or block_k < 1 or _pow2_divisor(block_k) < min_k:
        raise ValueError(
            f"block_k = {block_k!r}: the scale block's columns must be a multiple of {min_k} (a K step of "
            f"at least {min_k}, {'an FP8' if w8a8 else 'a'} tl.dot's minimum, must stay inside one scale "
            "column)"
        )
    T = max(1, int(T))
    bm = 16 if T <= 16 else 32 if T <= 32 else 64 if T <= 64 else 128
    if w8a8:
        bm = max(bm, 64)
    bk = min(_pow2_divisor(block_k), max(min_k, triton.next_power_of_2(int(K))))
    bn = 128
    while bn > 32 and triton.cdiv(T, bm) * triton.cdiv(N, bn) < 2 * H200_NUM_SMS:
        bn //= 2
    warps = 8 if bm * bn >= 128 * 128 else 4
    return DenseFP8Config(bm, bn, bk, 8, warps, 4 if bm <= 32 else 3)


def _w8a8_ok(weight) -> bool:
    """Whether ``weight`` can run the W8A8 form: block-FP8 with scale blocks whose columns hold a K step
    of :data:`W8A8_MIN_BLOCK_K`."""
    return isinstance(weight, FP8BlockWeight) and _pow2_divisor(weight.block[1]) >= W8A8_MIN_BLOCK_K


def check_dense_scheme(scheme, weight, name: str = "activation_scheme") -> str:
    """``scheme`` when it is one of :data:`ACTIVATION_SCHEMES` that ``weight`` (a dense tensor or an
    :class:`~moelora_lib.quant.FP8BlockWeight`) can run; ValueError naming ``name`` otherwise: an unknown
    value, or "dynamic" with a dense weight or with a scale block whose columns hold no power of two
    ≥ :data:`W8A8_MIN_BLOCK_K`."""
    if not isinstance(scheme, str) or scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"{name} must be one of {list(ACTIVATION_SCHEMES)}, got {scheme!r}")
    if scheme == "dynamic" and not _w8a8_ok(weight):
        if not isinstance(weight, FP8BlockWeight):
            got = f"a dense {weight.dtype} weight" if isinstance(weight, torch.Tensor) else describe(weight)
            raise ValueError(
                f"{name} 'dynamic' (W8A8) needs a block-FP8 weight (an FP8BlockWeight), got {got}"
            )
        raise ValueError(
            f"{name} 'dynamic' (W8A8): the scale block's {weight.block[1]} columns (weight.block = "
            f"{weight.block}) hold no K step of {W8A8_MIN_BLOCK_K} (an FP8 tl.dot's minimum K) or more; "
            "use 'weight_only'"
        )
    return scheme


def resolve_dense_scheme(scheme: str, weight, T: int, min_tokens: int = DENSE_W8A8_MIN_TOKENS) -> str:
    """The form, "weight_only" or "dynamic", a call of ``T`` tokens runs under a checked ``scheme``
    (:func:`check_dense_scheme`): "weight_only" for a dense weight, and for "auto" below ``min_tokens``
    tokens or where the scale block admits no W8A8 K step; "dynamic" for "dynamic", and for "auto" from
    ``min_tokens`` tokens on."""
    if scheme == "weight_only" or not isinstance(weight, FP8BlockWeight):
        return "weight_only"
    if scheme == "dynamic":
        return "dynamic"
    return "dynamic" if T >= min_tokens and _w8a8_ok(weight) else "weight_only"


# --------------------------------------------------------------------------------------------------
# activation quantization
# --------------------------------------------------------------------------------------------------
def quantize_act(
    x: torch.Tensor, group_size: int, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic per-token, per-group activation quantization the W8A8 form consumes: ``x [T, K]``
    (float16/bfloat16/float32, finite) → ``(x_q float8_e4m3fn [T, K], x_scale float32 [T, ceil(K/g)])``
    with ``g = group_size``: per row and group (the last one ragged) ``scale = amax / 448`` in float32
    (1 for an all-zero group, at least 2^-126), ``x_q = round_e4m3(clamp(x / scale, ±448))`` —
    :func:`~moelora_lib.quant.quantize_fp8_act_reference`'s codes and scales bit for bit. One launch of
    :func:`moelora_lib.kernels.fp8_act.quantize_fp8_act` (no host sync: a CUDA graph captures it;
    ``out`` = its preallocated ``(q, scale)``). Raises its ValueErrors, naming the argument."""
    return quantize_fp8_act(x, group_size, out=out)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def _check_weight(weight, K: int | None, device, name: str = "weight") -> FP8BlockWeight:
    if not isinstance(weight, FP8BlockWeight):
        raise ValueError(
            f"{name} must be an FP8BlockWeight (float8_e4m3fn [N, K] + scale_inv) for the FP8 GEMM, got "
            f"{describe(weight)}"
        )
    if weight.weight.dim() != 2:
        raise ValueError(f"{name} must be a 2-D FP8BlockWeight [N, K], got shape {list(weight.shape)}")
    if K is not None and weight.shape[1] != K:
        raise ValueError(f"{name}: K = {weight.shape[1]} (dim 1) must equal x's K = {K} (x.shape[1])")
    if weight.device != device:
        raise ValueError(f"{name} must be on {device} (like x), got {weight.device}")
    return weight


def _check_block_k(cfg: DenseFP8Config, bk: int, group_size: int | None = None) -> None:
    """BLOCK_SIZE_K divides the weight's bk and (W8A8, ``group_size`` given) the activation group, and
    W8A8 steps at least W8A8_MIN_BLOCK_K; ValueError naming ``config`` otherwise."""
    if not isinstance(cfg, DenseFP8Config):
        raise ValueError(f"config must be a DenseFP8Config or None, got {type(cfg).__name__}")
    if group_size is not None and cfg.BLOCK_SIZE_K < W8A8_MIN_BLOCK_K:
        raise ValueError(
            f"config.BLOCK_SIZE_K = {cfg.BLOCK_SIZE_K}: the W8A8 form's FP8 tl.dot needs a K step of at "
            f"least {W8A8_MIN_BLOCK_K}"
        )
    if bk % cfg.BLOCK_SIZE_K:
        raise ValueError(
            f"config.BLOCK_SIZE_K = {cfg.BLOCK_SIZE_K} must divide the weight's scale block columns "
            f"weight.block[1] = {bk}: a K step reads one scale column"
        )
    if group_size is not None and group_size % cfg.BLOCK_SIZE_K:
        raise ValueError(
            f"config.BLOCK_SIZE_K = {cfg.BLOCK_SIZE_K} must divide group_size = {group_size} (the "
            "activation scale group): a K step reads one activation scale per row"
        )


def _check_cpu(dtype: torch.dtype, device: torch.device, name: str) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} is on {device}: the kernels run on CUDA tensors (or CPU ones through the interpreter)"
        )
    if device.type == "cpu":
        check_cpu_backend(DENSE_FP8_KERNEL, dtype, name)


def _out(out, T: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty((T, N), dtype=dtype, device=device)
    check_tensor("out", out, (("T", T), ("N", N)), (dtype,), device, " (the output dtype)", like="x")
    return out


def dense_fp8_args(
    x: torch.Tensor,
    weight: FP8BlockWeight,
    out: torch.Tensor,
    cfg: DenseFP8Config,
    *,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    group_size: int | None = None,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, constexprs)`` of one ``_dense_fp8_kernel`` launch (W8A8 when ``x_scale`` is given);
    allocates and launches nothing (meta tensors work). The single source of the launch arguments,
    shared with compile-only checks."""
    T, K = x.shape
    N = weight.shape[0]
    q, sc = weight.weight, weight.scale_inv
    bn, bk = weight.block
    w8a8 = x_scale is not None
    xs = x_scale if w8a8 else sc  # a dummy pointer for the weight-only form (never read)
    grid = (triton.cdiv(T, cfg.BLOCK_SIZE_M) * triton.cdiv(N, cfg.BLOCK_SIZE_N),)
    args = (
        x,
        xs,
        q,
        sc,
        bias if bias is not None else sc,
        out,
        T,
        N,
        K,
        x.stride(0),
        x.stride(1),
        xs.stride(0) if w8a8 else 0,
        xs.stride(1) if w8a8 else 0,
        q.stride(0),
        q.stride(1),
        sc.stride(0),
        sc.stride(1),
        out.stride(0),
        out.stride(1),
        bn,
        bk,
        int(group_size) if w8a8 else 1,
    )
    constexprs = dict(
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M,
        BLOCK_SIZE_N=cfg.BLOCK_SIZE_N,
        BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        EVEN_K=K % cfg.BLOCK_SIZE_K == 0,
        HAS_BIAS=bias is not None,
        W8A8=w8a8,
    )
    return grid, args, constexprs


def _launch(x, weight, out, cfg, bias, x_scale=None, group_size=None) -> torch.Tensor:
    if x.shape[0] == 0 or out.shape[1] == 0:
        return out
    x = aligned16(x, "x")
    if bias is not None:
        bias = aligned16(bias.contiguous(), "bias")  # the kernel reads bias[n] at n
    grid, args, cx = dense_fp8_args(x, weight, out, cfg, bias=bias, x_scale=x_scale, group_size=group_size)
    DENSE_FP8_KERNEL[grid](*args, **cx, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES)
    return out


def dense_fp8_weight_only(
    x: torch.Tensor,
    weight: FP8BlockWeight,
    bias: torch.Tensor | None = None,
    *,
    config: DenseFP8Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x·Wᵀ (+ bias)`` with the block-FP8 weight scaled to x's dtype in registers (the decode form).

    Args:
        x: [T, K] float16/bfloat16/float32 (CUDA, or CPU under TRITON_INTERPRET=1, not bfloat16 there).
        weight: :class:`~moelora_lib.quant.FP8BlockWeight` [N, K] (float8_e4m3fn + scale_inv
            float32/bfloat16/float16 [ceil(N/bn), ceil(K/bk)]) on x's device; bk a multiple of 16.
        bias: [N] of x's dtype, or None.
        config: a :class:`DenseFP8Config` (None: :func:`default_dense_fp8_config`).
        out: optional preallocated [T, N] of x's dtype (e.g. a CUDA graph's static output); any strides.
    Returns:
        ``out`` (or a new [T, N] tensor of x's dtype): equal to ``F.linear(x, weight.dequantize(x.dtype),
        bias)`` up to fp32 summation order.
    Raises:
        ValueError naming the argument: x not a 2-D float tensor, on another device, bf16 on the CPU;
        weight not a 2-D FP8BlockWeight, its K ≠ x's, on another device; bias / out of the wrong shape,
        dtype or device; ``config.BLOCK_SIZE_K`` not dividing ``weight.block[1]``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor [T, K], got {describe(x)}")
    _check_cpu(x.dtype, x.device, "x")
    T, K = x.shape
    weight = _check_weight(weight, K, x.device)
    N = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, (("N", N),), (x.dtype,), x.device, " (like x)", like="x")
    cfg = (
        config
        if config is not None
        else default_dense_fp8_config(T, N, K, w8a8=False, block_k=weight.block[1])
    )
    _check_block_k(cfg, weight.block[1])
    return _launch(x, weight, _out(out, T, N, x.dtype, x.device), cfg, bias)


def dense_fp8_w8a8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: FP8BlockWeight,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: DenseFP8Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = (x_q·x_scale)·Wᵀ (+ bias)`` on FP8 tensor cores (the prefill form): both operands e4m3, each K
    step's fp32 dot times the row's activation scale and the column's weight-block scale.

    Args:
        x_q: [T, K] float8_e4m3fn, the activations' codes (:func:`quantize_act`).
        x_scale: [T, ceil(K / group_size)] float32, one scale per token and group of ``group_size``
            columns (x ≈ x_q·x_scale).
        weight: :class:`~moelora_lib.quant.FP8BlockWeight` [N, K] on x_q's device.
        bias: [N] of ``out_dtype``, or None.
        group_size: the activation group's columns (None: ``weight.block[1]``, the checkpoints' 128).
        out_dtype: float16/bfloat16/float32 (not bfloat16 on the CPU).
        config: a :class:`DenseFP8Config` (None: :func:`default_dense_fp8_config`); BLOCK_SIZE_K must
            divide ``weight.block[1]`` and ``group_size`` and be ≥ :data:`W8A8_MIN_BLOCK_K`.
        out: optional preallocated [T, N] of ``out_dtype``.
    Returns:
        ``out`` (or a new [T, N] tensor of ``out_dtype``): ``Σ_k dequant(x)·dequant(W)`` in fp32 (exact
        products of e4m3 codes, fp32 sums), rounded once.
    Raises:
        ValueError naming the argument: ``weight`` not an FP8BlockWeight (e.g. a dense tensor: the W8A8
        form needs FP8 weights) or not 2-D or K ≠ x_q's; x_q not float8_e4m3fn [T, K]; x_scale not
        float32 of the scale grid's shape; group_size not a positive int; bias / out / out_dtype wrong;
        ``config.BLOCK_SIZE_K`` below 32 or not dividing ``weight.block[1]`` or ``group_size`` (with the
        default config: ``block_k`` when no such K step exists).
    """
    if not isinstance(x_q, torch.Tensor) or x_q.dim() != 2 or x_q.dtype != _FP8:
        raise ValueError(f"x_q must be a 2-D float8_e4m3fn tensor [T, K] (quantize_act), got {describe(x_q)}")
    T, K = x_q.shape
    weight = _check_weight(weight, K, x_q.device)
    N = weight.shape[0]
    g = weight.block[1] if group_size is None else group_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    check_tensor(
        "x_scale", x_scale, (("T", T), ("ceil(K/group_size)", -(-K // g))), (torch.float32,), x_q.device,
        like="x_q",
    )  # fmt: skip
    if out_dtype not in _X_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype!r}")
    _check_cpu(out_dtype, x_q.device, "out_dtype")
    if bias is not None:
        check_tensor("bias", bias, (("N", N),), (out_dtype,), x_q.device, " (out_dtype)", like="x_q")
    if config is None and _pow2_divisor(math.gcd(weight.block[1], g)) < W8A8_MIN_BLOCK_K:
        raise ValueError(
            f"weight.block = {weight.block}, group_size = {g}: no K step of {W8A8_MIN_BLOCK_K} or more (an "
            "FP8 tl.dot's minimum K) divides both the weight's scale block columns and the activation group"
        )
    cfg = (
        config
        if config is not None
        else default_dense_fp8_config(T, N, K, w8a8=True, block_k=math.gcd(weight.block[1], g))
    )
    _check_block_k(cfg, weight.block[1], g)
    return _launch(
        x_q, weight, _out(out, T, N, out_dtype, x_q.device), cfg, bias, aligned16(x_scale, "x_scale"), g
    )


def dense_fp8_linear(
    x: torch.Tensor,
    weight: FP8BlockWeight,
    bias: torch.Tensor | None = None,
    *,
    activation_scheme: str = "auto",
    config: DenseFP8Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x·Wᵀ (+ bias)`` for x [T, K] float16/bfloat16/float32 and a block-FP8 ``weight`` [N, K], in
    the form ``activation_scheme`` picks for T (:func:`resolve_dense_scheme`): "weight_only" →
    :func:`dense_fp8_weight_only`; "dynamic" → :func:`quantize_act` (groups of ``weight.block[1]``
    columns) then :func:`dense_fp8_w8a8` with x's dtype as output dtype; "auto" → by T
    (:data:`DENSE_W8A8_MIN_TOKENS`). Returns [T, N] of x's dtype (``out`` when given). Raises what those
    raise, and ValueError naming ``activation_scheme`` (:func:`check_dense_scheme`)."""
    check_dense_scheme(activation_scheme, weight)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor [T, K], got {describe(x)}")
    if resolve_dense_scheme(activation_scheme, weight, x.shape[0]) == "weight_only":
        return dense_fp8_weight_only(x, weight, bias, config=config, out=out)
    weight = _check_weight(weight, x.shape[1], x.device)
    _check_cpu(x.dtype, x.device, "x")
    x_q, x_scale = quantize_act(x, weight.block[1])
    return dense_fp8_w8a8(
        x_q, x_scale, weight, bias, group_size=weight.block[1], out_dtype=x.dtype, config=config, out=out
    )


def dense_fp8_reference(
    x: torch.Tensor,
    weight: FP8BlockWeight,
    bias: torch.Tensor | None = None,
    *,
    activation_scheme: str = "weight_only",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """What the FP8 GEMM computes, in plain torch and ``dtype`` (float64 by default), for tests:
    "weight_only": ``F.linear(x, W, bias)`` with W dequantized exactly to x's dtype (the kernel's
    rounding of each weight tile), then widened; "dynamic": the activations as :func:`quantize_act`
    gives them (``x_q · x_scale``, groups of ``weight.block[1]`` columns) times W dequantized in
    float32 (its scale products rounded once). ``x`` [T, K] float, ``weight`` [N, K], ``bias`` [N] or
    None; returns [T, N] in ``dtype``. Not validated beyond what torch checks."""
    wd = weight.dequantize(x.dtype if activation_scheme == "weight_only" else torch.float32).to(dtype)
    if activation_scheme == "weight_only":
        xd = x.to(dtype)
    else:
        g = weight.block[1]
        q, s = quantize_act(x, g)
        xd = q.to(dtype) * s.to(dtype).repeat_interleave(g, dim=1)[:, : x.shape[1]]
    return F.linear(xd, wd, None if bias is None else bias.to(dtype))
