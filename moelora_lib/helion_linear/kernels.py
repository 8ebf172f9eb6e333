"""The Helion kernels of the linear backend (helion 1.4.0 API).

Every kernel computes ``y = x · Wᵀ`` with the weight in ``nn.Linear`` layout, plus an epilogue:

===========================  ==========================================  ===============
kernel                       computes                                    ``block_sizes``
===========================  ==========================================  ===============
``linear_kernel``            ``x · Wᵀ``                                  [BM, BN, BK]
``linear_bias_kernel``       ``x · Wᵀ + b``                              [BM, BN, BK]
``linear_silu_kernel``       ``silu(x · Wᵀ)``                            [BM, BN, BK]
``swiglu_kernel``            ``silu(x · W_gateᵀ) * (x · W_upᵀ)``          [BM, BN, BK]
``linear_split_k_kernel``    ``x · Wᵀ``, K split over programs            [BM, BN, BK] + split_k
``linear_bias_split_k_kernel`` ``x · Wᵀ + b``, K split over programs      [BM, BN, BK] + split_k
===========================  ==========================================  ===============

Tensors (M rows of activations, K input features, N output features, I = N / 2 for SwiGLU):

* ``x``: [M, K], fp16 / bf16 / fp32 (fp32 only for CPU interpreter tests), row-major
  (any strides work; stride 1 along K is the fast path).
* ``w``: [N, K], same dtype as ``x`` (``nn.Linear.weight`` layout, contiguous).
* ``bias``: [N], same dtype; added in fp32 before the cast.
* ``w_gate``, ``w_up``: [I, K] each — row views ``w_gate_up[:I]`` and ``w_gate_up[I:]`` of vLLM's
  merged ``MergedColumnParallelLinear`` weight [2I, K], so nothing is copied.
* returns ``y``: [M, N] (SwiGLU: [M, I]) in ``x.dtype``; fp32 accumulation throughout.

Shape policy: ``static_shapes=False`` with ``hl.specialize`` on K and N (the pattern of vLLM's Helion
``scaled_mm``, see docs/helion.md §2-§3): K and N are compile-time constants, M is a runtime
argument, so one compiled runner per config serves every M (Helion would otherwise key M on
{0, 1, ≥2}; the runners are compiled from a binding with M = 2 and are also correct for M = 1).
Triton itself still specializes the integer M on ``M == 1`` and ``M % 16 == 0``, so a runner has up
to three Triton variants; ``HelionLinearMethod.warmup`` triggers all of them.

SiLU is written ``v * sigmoid(v)``: ``F.silu`` lowers to a libdevice call that crashes the CPU
Triton interpreter (environment.md §4); on the GPU both compile to the same instructions.

Split-K (``split_k`` is an ``hl.register_tunable`` power of two, read back from ``Config``; the
pattern of Helion's ``examples/matmul_split_k.py`` and vLLM's "3-in-1" linear kernel): the top-level
tile loop also runs over ``split_k`` chunks of K; each program accumulates its chunk in fp32 and
``hl.atomic_add``-s it into an fp32 [M, N] buffer, which the host code then casts to ``x.dtype``.
This costs a zero-fill and a cast (two tiny extra kernels), and its summation order varies from run
to run (the fp32 error bound is ``split_k`` roundings of the partial sums, far below the bf16 output
rounding). The bias is added by the chunk that starts at k = 0 only.

Source of the method: Helion's ``examples/matmul.py`` / ``examples/matmul_split_k.py`` and the
docs' "Advanced Manual Deployment" (bind + compile_config), and the design of vLLM's Helion linear
backend (pre-tuned per-shape configs, no runtime autotuning) as summarized in
docs/helion.md §2, §3, §8. The code here is our own.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
from helion.autotuner import PowerOfTwoFragment

#: Settings shared by every kernel: M dynamic (K and N are specialized inside the kernels), never
#: autotune implicitly (a direct call without a config uses Helion's default config), and no warning
#: for the host-side fp32 -> x.dtype cast of the split-K kernels.
_SETTINGS = dict(
    static_shapes=False,
    autotune_effort="none",
    ignore_warnings=[helion.exc.TensorOperationInWrapper],
)

#: Largest split_k the tuner may ask for.
MAX_SPLIT_K = 64


@helion.kernel(**_SETTINGS)
def linear_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] · w[N, K]ᵀ -> [M, N]`` in x.dtype (fp32 accumulation)."""
    m, k = x.size()
    n, k_w = w.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            acc = hl.dot(x[tile_m, tile_k], w[tile_n, tile_k].T, acc=acc)
        out[tile_m, tile_n] = acc.to(out.dtype)
    return out


@helion.kernel(**_SETTINGS)
def linear_bias_kernel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x [M, K] · w[N, K]ᵀ + bias[N] -> [M, N]``; the bias is added in fp32."""
    m, k = x.size()
    n, k_w = w.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            acc = hl.dot(x[tile_m, tile_k], w[tile_n, tile_k].T, acc=acc)
        acc = acc + bias[tile_n].to(torch.float32)[None, :]
        out[tile_m, tile_n] = acc.to(out.dtype)
    return out


@helion.kernel(**_SETTINGS)
def linear_silu_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(x [M, K] · w[N, K]ᵀ) -> [M, N]``; SiLU in fp32 as ``v * sigmoid(v)``."""
    m, k = x.size()
    n, k_w = w.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            acc = hl.dot(x[tile_m, tile_k], w[tile_n, tile_k].T, acc=acc)
        out[tile_m, tile_n] = (acc * torch.sigmoid(acc)).to(out.dtype)
    return out


@helion.kernel(**_SETTINGS)
def swiglu_kernel(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x · w_gateᵀ) * (x · w_upᵀ) -> [M, I]``: both GEMMs share every x tile, the [M, 2I]
    intermediate never goes to memory. ``w_gate``, ``w_up``: [I, K] (row halves of w_gate_up)."""
    m, k = x.size()
    n, k_w = w_gate.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc_gate = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        acc_up = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            x_tile = x[tile_m, tile_k]
            acc_gate = hl.dot(x_tile, w_gate[tile_n, tile_k].T, acc=acc_gate)
            acc_up = hl.dot(x_tile, w_up[tile_n, tile_k].T, acc=acc_up)
        out[tile_m, tile_n] = (acc_gate * torch.sigmoid(acc_gate) * acc_up).to(out.dtype)
    return out


@helion.kernel(**_SETTINGS)
def linear_split_k_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] · w[N, K]ᵀ -> [M, N]`` with K split into ``Config["split_k"]`` chunks that are
    reduced with fp32 ``hl.atomic_add``; the buffer is cast to x.dtype on the host side."""
    m, k = x.size()
    n, k_w = w.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    acc_out = torch.zeros([m, n], dtype=torch.float32, device=x.device)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, MAX_SPLIT_K))
    k_chunk = helion.next_power_of_2(helion.cdiv(k, split_k))
    for tile_m, tile_n, chunk_k in hl.tile([m, n, k], block_size=[None, None, k_chunk]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(chunk_k.begin, chunk_k.end):
            acc = hl.dot(x[tile_m, tile_k], w[tile_n, tile_k].T, acc=acc)
        hl.atomic_add(acc_out, [tile_m, tile_n], acc)
    return acc_out.to(x.dtype)


@helion.kernel(**_SETTINGS)
def linear_bias_split_k_kernel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Split-K ``x · wᵀ + bias``; the chunk starting at k = 0 adds the bias (fp32)."""
    m, k = x.size()
    n, k_w = w.size()
    k = hl.specialize(k)
    n = hl.specialize(n)
    acc_out = torch.zeros([m, n], dtype=torch.float32, device=x.device)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, MAX_SPLIT_K))
    k_chunk = helion.next_power_of_2(helion.cdiv(k, split_k))
    for tile_m, tile_n, chunk_k in hl.tile([m, n, k], block_size=[None, None, k_chunk]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(chunk_k.begin, chunk_k.end):
            acc = hl.dot(x[tile_m, tile_k], w[tile_n, tile_k].T, acc=acc)
        if chunk_k.begin == 0:
            acc = acc + bias[tile_n].to(torch.float32)[None, :]
        hl.atomic_add(acc_out, [tile_m, tile_n], acc)
    return acc_out.to(x.dtype)


#: (epilogue, split) -> kernel. ``split`` is True when the config carries ``split_k``.
KERNELS = {
    ("none", False): linear_kernel,
    ("bias", False): linear_bias_kernel,
    ("silu", False): linear_silu_kernel,
    ("swiglu", False): swiglu_kernel,
    ("none", True): linear_split_k_kernel,
    ("bias", True): linear_bias_split_k_kernel,
}
