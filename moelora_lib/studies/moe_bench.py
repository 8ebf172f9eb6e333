"""MoE-LoRA measurements for the notebooks, on top of :mod:`.bench` (which times).

Expert weight formats (:data:`WEIGHT_FORMATS`): "dense" (the activations' dtype), "mxfp4"
(:class:`~moelora_lib.quant.MXFP4Weight`) or "fp8" (:class:`~moelora_lib.quant.FP8BlockWeight`); with FP8
experts the layer's ``activation_scheme`` ("weight_only", "dynamic" = W8A8, "auto") is a parameter of
:func:`make_run`, :func:`bench_layer`, :func:`check_layer` and :func:`bench_lora_op`.

Units: ms (``ms_p50/p20/p80``), µs (``us_p50``, ``floor_us``); 2 FLOPs per multiply-add; bytes read +
written; P = T·K. On the CPU rows say ``mode="cpu-interpreter"`` (no performance number).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..common import DTYPES, dtype_name
from ..hardware import H200_BF16_TFLOPS, H200_FP8_TFLOPS
from ..kernels import STAGES, LayerConfig, default_config
from ..kernels.config import BASE_OPS, LORA_OPS
from ..kernels.stages import config_weight_format
from ..quant.fp8 import FP8_BLOCK, FP8BlockWeight, quantize_fp8_block
from ..quant.mxfp4 import MXFP4_BLOCK, MXFP4Weight, quantize_mxfp4
from ..reference import moe_lora_reference
from ..routing import max_padded_pairs, route
from ..shapes import Dims, MoEShape, get_shape
from ..testing import rel_err
from ..workloads import MoELoRAInputs, Workload, adapter_ids, make_inputs
from . import bench

PARTS = ("base", "lora", "total")
#: Formats of the expert weights w13 / w2.
WEIGHT_FORMATS = ("dense", "mxfp4", "fp8")
#: Bytes per MXFP4 weight (4.25 bits).
MXFP4_BYTES_PER_WEIGHT = (MXFP4_BLOCK // 2 + 1) / MXFP4_BLOCK


def fp8_bytes_per_weight(block: tuple[int, int] = FP8_BLOCK, scale_bytes: int = 4) -> float:
    """Bytes per block-FP8 weight: one e4m3 byte plus a ``scale_bytes`` scale per ``block`` (bn, bk) of
    weights."""
    return 1.0 + scale_bytes / (block[0] * block[1])


# --- vLLM anchors ----------------------------------------------------------------------------------------

#: vLLM's MoE (+ multi-LoRA) kernels measured side by side with this project in one process on one H200.
ANCHOR_FILE = bench.REPO_ROOT / "data" / "anchors" / "vllm_vs_moelora_moe_h200.csv"
#: impl names of the anchor file: vLLM's base MoE, its current LoRA path, and its two two-kernel paths.
_VLLM_BASE, _VLLM_CURRENT, _VLLM_TWO_KERNEL = "vllm", "vllm_main", ("2k_tma_pdl", "2k_notma")


def anchor_table(path: str | os.PathLike | None = None):
    """vLLM's figures on the H200 (µs; bf16, R = 32, L = 8) from :data:`ANCHOR_FILE` (or ``path``), one row
    per (model, T): base_us, lora/total_current_us, lora/total_two_kernel_us (faster two-kernel path),
    lora/total_best_us."""
    import pandas as pd

    a = pd.read_csv(path or ANCHOR_FILE)
    a = a[a.impl.isin((_VLLM_BASE, _VLLM_CURRENT) + _VLLM_TWO_KERNEL)]
    a = a.assign(T=a["T"].astype(int), median_us=a.median_us.astype(float))
    base = a[(a.impl == _VLLM_BASE) & (a.part == "base")].set_index(["shape", "T"]).median_us
    t = pd.DataFrame({"base_us": base})
    for part in ("lora", "total"):
        p = a[a.part == part]
        t[f"{part}_current_us"] = p[p.impl == _VLLM_CURRENT].set_index(["shape", "T"]).median_us
        t[f"{part}_two_kernel_us"] = p[p.impl.isin(_VLLM_TWO_KERNEL)].groupby(["shape", "T"]).median_us.min()
    for part in ("lora", "total"):
        t[f"{part}_best_us"] = t[[f"{part}_current_us", f"{part}_two_kernel_us"]].min(axis=1)
    t = t.rename_axis(["model", "T"]).reset_index().sort_values(["model", "T"], ignore_index=True)
    cols = ["model", "T", "base_us", "lora_current_us", "total_current_us", "lora_two_kernel_us"]
    return t[cols + ["total_two_kernel_us", "lora_best_us", "total_best_us"]]


#: GPT-OSS-20B's MXFP4 MoE layer through ``triton_kernels`` on one H200 (data/anchors/README.md).
_ANCHORS = bench.REPO_ROOT / "data" / "anchors"
MXFP4_ANCHOR_FILE = _ANCHORS / "triton_kernels_mxfp4_moe_h200.csv"
MXFP4_ANCHOR_BREAKDOWN_FILE = _ANCHORS / "triton_kernels_mxfp4_moe_breakdown_h200.csv"
#: The model of the MXFP4 anchor rows (their CSV has no model column).
MXFP4_ANCHOR_MODEL = "gpt-oss-20b"


def mxfp4_anchor_table(path: str | os.PathLike | None = None, breakdown: str | os.PathLike | None = None):
    """``matmul_ogs``'s MXFP4 MoE layer on the H200 (µs; no LoRA) from :data:`MXFP4_ANCHOR_FILE` (or ``path``)
    and its breakdown file, one row per (model, T): experts_touched, tk_us / tk_p20_us / tk_p80_us,
    weight_bytes, tk_floor_us, routing_us / gate_up_us / down_us (NaN where the breakdown has no row)."""
    import pandas as pd

    a = pd.read_csv(path or MXFP4_ANCHOR_FILE)
    t = pd.DataFrame(
        dict(model=MXFP4_ANCHOR_MODEL, T=a["T"].astype(int), experts_touched=a.experts_touched.astype(int))
    )
    t = t.assign(tk_us=a.tk_graph_us_med, tk_p20_us=a.tk_graph_us_p20, tk_p80_us=a.tk_graph_us_p80)
    t = t.assign(weight_bytes=a.weight_bytes.astype(int), tk_floor_us=a.floor_us_copybw)
    b = pd.read_csv(breakdown or MXFP4_ANCHOR_BREAKDOWN_FILE)
    b = b[["T", "routing_us", "gate_up_us", "down_us"]].assign(T=b["T"].astype(int))
    return t.merge(b, on="T", how="left").sort_values("T", ignore_index=True)


# --- FLOPs and bytes -------------------------------------------------------------------------------------


def floor_us(flops: float, nbytes: float, tflops: float = H200_BF16_TFLOPS) -> float:
    """Roofline floor in µs: the larger of ``nbytes`` at 4.3 TB/s and ``flops`` at ``tflops``."""
    return max(bench.copy_bandwidth_floor_us(nbytes), bench.compute_floor_us(flops, tflops))


def _touched(T: int, E: int, K: int, num_adapters: int | None, topk_ids, lora_ids) -> tuple[int, int]:
    """(distinct experts, distinct (adapter, expert) pairs with an adapter) touched by T tokens."""
    if topk_ids is not None:
        ids = topk_ids.detach().long().cpu()
        n_e = int(torch.unique(ids).numel())
        if lora_ids is not None:
            lid = lora_ids.detach().long().cpu().repeat_interleave(K)
            keep = lid >= 0
            n_pair = int(torch.unique(lid[keep] * E + ids.reshape(-1)[keep]).numel())
        else:
            n_pair = min((num_adapters or 1) * n_e, T * K)
    else:
        n_e = min(E, T * K)
        n_pair = min((num_adapters or 1) * E, T * K)
    return n_e, n_pair


def op_costs(shape: MoEShape | str, dims: Dims, *, dtype_bytes: int = 2, topk_ids: torch.Tensor | None = None,
             lora_ids: torch.Tensor | None = None, weight_bytes: float | None = None,
             base_tflops: float | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """FLOPs, minimal bytes (each tensor once; the rank intermediate fp32), intensity and H200 floor of the
    six launches. Touched experts/pairs come from ``topk_ids`` [T, K] / ``lora_ids`` [T] when given, else
    min(E, T·K) / min(L·E, T·K). ``weight_bytes`` / ``base_tflops``: bytes per expert weight and FLOP rate of
    the two base GEMMs (None: ``dtype_bytes``, bf16). One dict per op: model, op, T, H, I, E, K, R, S,
    experts_touched, lora_pairs_touched, flops, bytes, weight_bytes, intensity, tflops, flops_floor_us,
    floor_us, bound ("memory"/"compute"). TypeError / ValueError for bad ``dims``, ``weight_bytes``,
    ``base_tflops``."""
    shape = get_shape(shape) if isinstance(shape, str) else shape
    if not isinstance(dims, Dims):
        raise TypeError(f"op_costs: dims must be a Dims, got {type(dims).__name__}")
    if weight_bytes is not None and not (isinstance(weight_bytes, (int, float)) and weight_bytes > 0):
        raise ValueError(f"op_costs: weight_bytes must be None or a number > 0, got {weight_bytes!r}")
    if base_tflops is not None and not (isinstance(base_tflops, (int, float)) and base_tflops > 0):
        raise ValueError(f"op_costs: base_tflops must be None or a number > 0, got {base_tflops!r}")
    d = dims
    T, H, I, E, K, R, S = d.T, d.H, d.I, d.E, d.top_k, d.rank, d.slices
    b, P, f32 = dtype_bytes, d.pairs, 4
    wb = b if weight_bytes is None else weight_bytes
    n_e, n_pair = _touched(T, E, K, d.adapters, topk_ids, lora_ids)
    ops = [  # name, flops, weight bytes, activation bytes
        ("base_gate_up", 2 * P * 2 * I * H, n_e * 2 * I * H * wb, T * H * b + P * 2 * I * b),
        ("base_down", 2 * P * H * I, n_e * H * I * wb, P * I * b + P * H * b),
        ("gate_up_shrink", 2 * P * H * R * S, n_pair * S * R * H * b, T * H * b + S * P * R * f32),
        ("gate_up_expand", 2 * P * R * 2 * I, n_pair * 2 * I * R * b, S * P * R * f32 + 2 * P * 2 * I * b),
        ("down_shrink", 2 * P * I * R, n_pair * R * I * b, P * I * b + P * R * f32),
        ("down_expand", 2 * P * R * H, n_pair * H * R * b, P * R * f32 + 2 * P * H * b),
    ]
    rows = []
    for op, flops, wbytes, abytes in ops:
        nbytes = wbytes + abytes
        rate = base_tflops if (op in BASE_OPS and base_tflops is not None) else H200_BF16_TFLOPS
        t_mem, t_cmp = bench.copy_bandwidth_floor_us(nbytes), bench.compute_floor_us(flops, rate)
        rows.append(
            dict(model=shape.name, op=op, T=T, H=H, I=I, E=E, K=K, R=R, S=S, experts_touched=n_e)
            | dict(lora_pairs_touched=n_pair, flops=int(flops), bytes=int(nbytes), weight_bytes=int(wbytes))
            | dict(intensity=flops / nbytes, tflops=float(rate), flops_floor_us=t_cmp)
            | dict(floor_us=max(t_mem, t_cmp), bound="memory" if t_mem >= t_cmp else "compute")
        )
    return rows


def _part_cost(costs: list[dict], part: str) -> dict[str, float]:
    """flops, bytes, floor_us, bytes_floor_us, flops_floor_us of a part (or one op) of :func:`op_costs`'
    rows."""
    ops = {"base": BASE_OPS, "lora": LORA_OPS, "total": BASE_OPS + LORA_OPS}.get(part, (part,))
    sel = [c for c in costs if c["op"] in ops]
    nbytes = sum(c["bytes"] for c in sel)
    b = bench.copy_bandwidth_floor_us(nbytes)
    f = sum(c.get("flops_floor_us", bench.compute_floor_us(c["flops"])) for c in sel)
    return dict(flops=sum(c["flops"] for c in sel), bytes=nbytes, floor_us=max(b, f), bytes_floor_us=b,
                flops_floor_us=f)  # fmt: skip


# --- Inputs ----------------------------------------------------------------------------------------------

#: The keyword form of a :class:`Workload` here: keyword -> Workload field (defaults: the Workload's).
_WORKLOAD_KW = dict(rank="rank", num_adapters="adapters", pattern="pattern", dtype="dtype", device="device")
_WORKLOAD_KW |= dict(seed="seed", activation="activation", bias="bias")


def _workload(shape, T, inputs: dict, pattern: str = "uniform") -> Workload:
    """``shape`` if a :class:`Workload`, else ``Workload(shape, T, **inputs)``; TypeError for both forms, no T
    or an unknown keyword."""
    unknown = sorted(set(inputs) - set(_WORKLOAD_KW))
    if unknown:
        raise TypeError(f"unknown input keyword(s) {unknown}; the inputs are {sorted(_WORKLOAD_KW)}")
    if isinstance(shape, Workload):
        if T is not None or inputs:
            raise TypeError(
                "pass the inputs either as a Workload or as (shape, T, keywords), not both; "
                f"also given: {(['T'] if T is not None else []) + sorted(inputs)}"
            )
        return shape
    if T is None:
        raise TypeError("T (tokens) is required unless a Workload is passed")
    return Workload(
        model=shape, T=T, **{"pattern": pattern} | {_WORKLOAD_KW[k]: v for k, v in inputs.items()}
    )


def layer_inputs(
    shape: MoEShape | str | Workload, T: int | None = None, *, weights: MoELoRAInputs | None = None,
    weight_format: str | None = None, **inputs,
) -> MoELoRAInputs:  # fmt: skip
    """Seeded inputs of one layer call (a Workload or its keyword form, :data:`_WORKLOAD_KW`); with
    ``weights`` (an earlier result of the same shape, R, L, dtype, device) its weights are reused and only
    tokens, routing and adapter ids are new. ``weight_format``: None keeps the experts, else
    :func:`with_weight_format`. ValueError for ``bias`` True with reused weights that have none."""
    inp = _inputs(_workload(shape, T, inputs), weights)
    return inp if weight_format is None else with_weight_format(inp, weight_format)


def quantize_experts(w: torch.Tensor, *, max_elements: int = 1 << 24) -> MXFP4Weight:
    """The :class:`~moelora_lib.quant.MXFP4Weight` of ``w`` [E, N, K] (K a multiple of 32), quantized at most
    ``max_elements`` weights per step; equal to quantizing ``w`` at once. ValueError for another shape."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"quantize_experts: w must be a tensor [E, N, K], got {_desc(w)}")
    E, N, K = w.shape
    if K % MXFP4_BLOCK:
        raise ValueError(f"quantize_experts: K = {K} (w's last dim) must be a multiple of {MXFP4_BLOCK}")
    blocks = torch.empty((E, N, K // MXFP4_BLOCK, MXFP4_BLOCK // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((E, N, K // MXFP4_BLOCK), dtype=torch.uint8, device=w.device)
    step = max(1, int(max_elements) // max(1, N * K))
    for e in range(0, E, step):
        blocks[e : e + step], scales[e : e + step] = quantize_mxfp4(w[e : e + step])
    return MXFP4Weight(blocks, scales)


def quantize_fp8_weight(
    w: torch.Tensor, *, block: tuple[int, int] = FP8_BLOCK, max_elements: int = 1 << 24
) -> FP8BlockWeight:
    """The :class:`~moelora_lib.quant.FP8BlockWeight` of a float weight ``w`` [..., N, K], quantized at most
    ``max_elements`` weights per step (at least one block row); equal to quantizing ``w`` at once. ValueError
    for another ``w``."""
    if not isinstance(w, torch.Tensor) or w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_weight: w must be a float tensor [..., N, K], got {_desc(w)}")
    *lead, N, K = w.shape
    bn, bk = block
    w3 = w.reshape(-1, N, K)
    E = w3.shape[0]
    q = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    sc = torch.empty((E, -(-N // bn), -(-K // bk)), dtype=torch.float32, device=w.device)
    max_elements = int(max_elements)
    if N * K <= max_elements:  # whole experts per step
        step = max(1, max_elements // max(1, N * K))
        for e in range(0, E, step):
            q[e : e + step], sc[e : e + step] = quantize_fp8_block(w3[e : e + step], block)
    else:  # whole block rows of one expert per step
        rows = max(bn, max_elements // max(1, K) // bn * bn)
        for e in range(E):
            for r in range(0, N, rows):
                q[e, r : r + rows], sc[e, r // bn : -(-(r + rows) // bn)] = quantize_fp8_block(
                    w3[e, r : r + rows], block
                )
    return FP8BlockWeight(q.view(*lead, N, K), sc.view(*lead, *sc.shape[1:]), tuple(block))


#: The :data:`WEIGHT_FORMATS` name of an expert weight (``weight_format(w)``).
weight_format = config_weight_format


def quantize_to(w: torch.Tensor, fmt: str, fp8_block: tuple[int, int] = FP8_BLOCK):
    """A dense expert (or projection) weight in format ``fmt`` (:data:`WEIGHT_FORMATS`; "dense": ``w``)."""
    if fmt == "mxfp4":
        return quantize_experts(w)
    return quantize_fp8_weight(w, block=fp8_block) if fmt == "fp8" else w


def weight_format_of(inp: MoELoRAInputs) -> str:
    """:func:`weight_format` of ``inp``'s experts (w13 and w2 are of one format)."""
    return weight_format(inp.w13)


def with_weight_format(
    inp: MoELoRAInputs, fmt: str, *, fp8_block: tuple[int, int] = FP8_BLOCK
) -> MoELoRAInputs:
    """``inp`` with both expert weights in format ``fmt`` (:data:`WEIGHT_FORMATS`): quantized ("mxfp4", "fp8"
    with ``fp8_block``) or dequantized exactly into the adapters' dtype ("dense"); weights already in ``fmt``
    are kept. ValueError for another ``fmt``."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    dt = inp.lora_a13.dtype

    def conv(w):
        if weight_format(w) == fmt:
            return w
        if weight_format(w) != "dense":
            w = w.dequantize(dt)  # exact, cast once
        return quantize_to(w, fmt, fp8_block)

    w13, w2 = conv(inp.w13), conv(inp.w2)
    return inp if (w13 is inp.w13 and w2 is inp.w2) else dataclasses.replace(inp, w13=w13, w2=w2)


def _desc(t) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


#: Where :class:`LayerWeights` keeps generated weight sets on the GPU profile (git-ignored).
WEIGHTS_CACHE = bench.REPO_ROOT / ".cache" / "layer_weights"


@functools.cache
def _generator_code_hash() -> str:
    """Hash of the code that generates the inputs: part of every :class:`LayerWeights` file name."""
    import inspect

    from .. import routing, shapes, workloads

    src = "".join(inspect.getsource(m) for m in (workloads, routing, shapes))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class LayerWeights:
    """The seeded weights of each (model, bias), made once: ``get(shape, bias=)`` returns what
    ``layer_inputs(shape, 1, ...)`` returns, kept until :meth:`drop`. With ``folder`` a generated set is also
    saved there atomically, named by a hash of every generation input."""

    def __init__(self, *, rank: int = 32, num_adapters: int = 8, dtype=torch.bfloat16, device="cuda",
                 seed: int = 0, folder: str | os.PathLike | None = None):  # fmt: skip
        self.rank, self.num_adapters, self.dtype, self.seed = rank, num_adapters, dtype, seed
        self.device = torch.device(device)
        self.folder = None if folder is None else os.fspath(folder)
        self._sets: dict[tuple[str, bool], MoELoRAInputs] = {}

    def _key(self, shape: MoEShape, bias: bool) -> str:
        fields = dict(shape=dataclasses.asdict(shape), T=1, rank=self.rank, adapters=self.num_adapters)
        fields |= dict(slices=shape.lora_slices, pattern="uniform", dtype=dtype_name(self.dtype))
        fields |= dict(device=self.device.type, seed=self.seed, bias=bias, torch=torch.__version__)
        fields |= dict(code=_generator_code_hash())
        h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return (
            f"{shape.name}-r{self.rank}-l{self.num_adapters}-{dtype_name(self.dtype)}-s{self.seed}-"
            f"{'bias' if bias else 'nobias'}-{h}.pt"
        )

    def get(self, shape: MoEShape | str, *, bias: bool | None = None) -> MoELoRAInputs:
        """The weight set of ``shape`` with (True) or without (False) expert biases (None: the preset's); the
        same object until :meth:`drop`."""
        shape = get_shape(shape) if isinstance(shape, str) else shape
        use_bias = shape.has_bias if bias is None else bool(bias)
        k = (shape.name, use_bias)
        if k in self._sets:
            return self._sets[k]
        path = None if self.folder is None else os.path.join(self.folder, self._key(shape, use_bias))
        inp = None
        if path is not None and os.path.exists(path):
            try:
                state = torch.load(path, map_location=self.device, weights_only=True)
                inp = MoELoRAInputs(**state)
            except Exception:  # a truncated or foreign file: generate and overwrite it
                inp = None
        if inp is None:
            kw = dict(rank=self.rank, num_adapters=self.num_adapters, dtype=self.dtype, device=self.device)
            inp = layer_inputs(shape, 1, **kw, seed=self.seed, bias=use_bias)
            if path is not None:
                self._save(inp, path)
        self._sets[k] = inp
        return inp

    def drop(self, shape: MoEShape | str | None = None) -> None:
        """Forget the sets of ``shape`` (all when None) in this process (the files stay)."""
        name = None if shape is None else (shape if isinstance(shape, str) else shape.name)
        for k in [k for k in self._sets if name is None or k[0] == name]:
            del self._sets[k]

    def _save(self, inp: MoELoRAInputs, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


def _inputs(wl: Workload, weights: MoELoRAInputs | None) -> MoELoRAInputs:
    shape, T, seed, bias = wl.shape, wl.T, wl.seed, wl.bias
    act = wl.activation or shape.activation
    if weights is None:
        kw = dict(
            rank=wl.rank, num_adapters=wl.adapters, pattern=wl.pattern, dtype=wl.dtype, device=wl.device
        )
        return dataclasses.replace(make_inputs(shape, T, **kw, seed=seed, bias=bias), activation=act)
    use_bias = (weights.b13 is not None) if bias is None else bias
    if use_bias and weights.b13 is None:
        raise ValueError("bias=True but the reused weights have no biases; build them with bias=True")
    g = torch.Generator().manual_seed(seed * 1_000_003 + T)
    # the adapters carry the layer's dtype and device whatever the experts' format
    x = torch.randn(T, shape.hidden, generator=g).to(weights.lora_a13.dtype)
    logits = torch.randn(T, shape.experts, generator=g)
    topk_w, topk_ids = route(logits, shape.top_k, shape.renormalize)
    ids = adapter_ids(T, weights.lora_a13.shape[0], wl.pattern, g)
    dev = weights.lora_a13.device
    new = dict(hidden_states=x, topk_weights=topk_w, topk_ids=topk_ids, lora_ids=ids, router_logits=logits)
    new = {k: v.to(dev) for k, v in new.items()}
    return dataclasses.replace(weights, **new, activation=act, b13=weights.b13 if use_bias else None,
                               b2=weights.b2 if use_bias else None)  # fmt: skip


def make_run(stage: str, inp: MoELoRAInputs, config: LayerConfig | None = None, *, adapter_order=None,
             activation_scheme: str = "auto"):  # fmt: skip
    """The :class:`~moelora_lib.kernels.LayerRun` of ``stage`` on ``inp`` (``config`` None: the stage's for
    T); ``adapter_order`` as in :func:`moelora_lib.moe_lora.make_layer_run`; ``activation_scheme`` (FP8
    experts): "weight_only", "dynamic" or "auto", ValueError otherwise."""
    from ..moe_lora import make_layer_run

    kw = dict(stage=stage, config=config, check_values=False, adapter_order=adapter_order)
    return make_layer_run(*inp.args(), **inp.kwargs(), **kw, activation_scheme=activation_scheme)


def run_scheme(run) -> str:
    """The activation scheme a LayerRun (or GemvRun) runs: "dynamic" (W8A8) or "weight_only"."""
    return "dynamic" if getattr(run, "w8a8", False) else "weight_only"


def _run_fields(shape: MoEShape, run, pattern: str) -> dict[str, Any]:
    """The identifying columns of a row, read from a LayerRun."""
    d = run.dims
    f = dict(stage=run.stage.name, model=shape.name, T=d.T, H=d.H, I=d.I, E=d.E, K=d.top_k, L=d.adapters)
    f |= dict(R=d.rank, S=d.slices, dtype=dtype_name(run.x.dtype), activation=run.activation)
    f |= dict(bias=run.b13 is not None, pattern=pattern, weight_format=weight_format(run.w13))
    return f | dict(activation_scheme=run_scheme(run))


def _costs(shape, dims, inp_or_x, w13, topk_ids=None, lora_ids=None) -> list[dict[str, Any]]:
    """:func:`op_costs` of a run on expert weight ``w13`` (its bytes per weight and FLOP rate)."""
    wb, rate = (MXFP4_BYTES_PER_WEIGHT if weight_format(w13) == "mxfp4" else None), None
    if isinstance(w13, FP8BlockWeight):
        wb, rate = w13.nbytes / math.prod(w13.shape), H200_FP8_TFLOPS
    return op_costs(shape, dims, dtype_bytes=inp_or_x.element_size(), topk_ids=topk_ids, lora_ids=lora_ids,
                    weight_bytes=wb, base_tflops=rate)  # fmt: skip


# --- Benchmarks ------------------------------------------------------------------------------------------


def _timed_row(fields, part, config, source, mode, tm, cost, budget, **extra) -> dict[str, Any]:
    """A result row: ``fields``, part, config, source, the timing, the cost, the budget and ``extra``."""
    row = dict(part=part, config=config, config_source=source, mode=mode)
    row |= dict(ms_p50=tm.ms_p50, ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, us_p50=tm.ms_p50 * 1e3)
    row |= cost | dict(zip(("warmup_ms", "rep_ms", "min_reps"), budget))
    return bench.result_row(**fields, **row, **extra)


def bench_layer(stage: str, shape: MoEShape | str | Workload, T: int | None = None, *,
                modes: Sequence[str] = ("graph",), config: LayerConfig | None = None,
                weights: MoELoRAInputs | None = None, parts: Sequence[str] = PARTS, warmup_ms: float = 25,
                rep_ms: float = 100, min_reps: int | None = None, adapter_order: bool | None = None,
                weight_format: str | None = None, activation_scheme: str = "auto",
                **inputs) -> list[dict[str, Any]]:  # fmt: skip
    """Time the parts of one layer of ``stage`` at T tokens, one row per (part, mode): "base", "lora",
    "total"; built and called once untimed first. ``weights`` / ``weight_format``: as in :func:`layer_inputs`;
    ``activation_scheme``: as in :func:`make_run`. Rows (:func:`.bench.result_row`): stage, part, model, T, H,
    I, E, K, L, R, S, dtype, activation, bias, pattern, weight_format, activation_scheme, config,
    config_source, mode, ms_p50/p20/p80, us_p50, flops, bytes, floor_us, bytes_floor_us, flops_floor_us,
    warmup_ms, rep_ms, min_reps and the environment columns. ValueError for T < 1."""
    wl = _workload(shape, T, inputs)
    if wl.T < 1:
        raise ValueError(
            f"bench_layer: T must be >= 1 (a layer call of no tokens has nothing to time), got {wl.T}"
        )
    shape, device = wl.shape, wl.device
    inp = layer_inputs(wl, weights=weights, weight_format=weight_format)
    run = make_run(stage, inp, config, adapter_order=adapter_order, activation_scheme=activation_scheme)
    run()  # compile outside the timed region
    bench.sync(device)
    costs = _costs(shape, run.dims, inp.hidden_states, inp.w13, inp.topk_ids, inp.lora_ids)
    fns = {"base": run.base_part, "lora": run.lora_part, "total": run}
    is_cpu = torch.device(device).type == "cpu"
    fields, rows = _run_fields(shape, run, wl.pattern), []
    for part in parts:
        for mode in ("cpu-interpreter",) if is_cpu else tuple(modes):
            tm = bench.time_fn(fns[part], mode, device, warmup_ms, rep_ms, min_reps=min_reps)
            cost, budget = _part_cost(costs, part), (warmup_ms, rep_ms, min_reps)
            rows.append(_timed_row(fields, part, run.cfg.short(), run.cfg.source, mode, tm, cost, budget))
    return rows


#: :func:`bench_module`'s parts: the forward with no LoRA launch, and with the adapters of ``lora_ids``.
MODULE_PARTS = ("base", "total")


def bench_module(layer, inp: MoELoRAInputs, shape: MoEShape | str, *, parts: Sequence[str] = MODULE_PARTS,
                 warmup_ms: float = 25, rep_ms: float = 100, min_reps: int | None = None,
                 pattern: str = "uniform") -> list[dict[str, Any]]:  # fmt: skip
    """Time a :class:`~moelora_lib.MoELoRALayer` forward from router logits at ``inp``'s T, one row per part:
    "base" (``active_slots`` empty) and "total" (the adapters of ``inp.lora_ids``). ``inp``: inputs of the
    layer's sizes, dtype and device. Rows: :func:`bench_layer`'s columns with ``stage`` the layer's,
    ``resolved_stage`` and ``activation_scheme`` the ones it runs at T."""
    shape = get_shape(shape) if isinstance(shape, str) else shape
    unknown = sorted(set(parts) - set(MODULE_PARTS))
    if unknown:
        raise ValueError(f"bench_module: parts must be among {MODULE_PARTS}, got {unknown}")
    x, logits, ids = inp.hidden_states, inp.router_logits, inp.lora_ids
    T, device = x.shape[0], x.device
    w13 = layer.expert_weights()[0]
    ly = layer
    d = Dims(T=T, H=ly.H, I=ly.I, E=ly.E, top_k=ly.K, adapters=ly.L, rank=ly.R, slices=ly.S)
    costs = _costs(shape, d, x, w13, inp.topk_ids, ids)
    saved, rows = layer.active_slots, []
    mode = "cpu-interpreter" if device.type == "cpu" else "graph"
    fields = dict(stage=layer.stage.name, resolved_stage=layer.stage_for(T).name, model=shape.name, T=T)
    fields |= dict(H=d.H, I=d.I, E=d.E, K=d.top_k, L=d.adapters, R=d.rank, S=d.slices)
    fields |= dict(dtype=dtype_name(x.dtype), activation=ly.activation, bias=ly.b13 is not None)
    fields |= dict(pattern=pattern, weight_format=weight_format(w13), activation_scheme=module_scheme(ly, T))
    try:
        for part in parts:
            layer.active_slots = frozenset() if part == "base" else saved
            fn = functools.partial(layer, x, logits, lora_ids=ids)
            if device.type != "cpu":  # the interpreter compiles nothing: one call, timed, on the CPU
                fn()  # compiled (and the scratch allocated) outside the timed region
                bench.sync(device)
            tm = bench.time_fn(fn, mode, device, warmup_ms, rep_ms, min_reps=min_reps)
            cfg, cost, budget = layer.config_for(T), _part_cost(costs, part), (warmup_ms, rep_ms, min_reps)
            rows.append(_timed_row(fields, part, cfg.short(), cfg.source, mode, tm, cost, budget))
    finally:
        layer.active_slots = saved
    return rows


def module_scheme(layer, T: int) -> str:
    """The activation scheme a MoELoRALayer or LoRALinear runs at T ("dynamic" or "weight_only")."""
    return layer.activation_scheme_for(T)


def build_module(inp: MoELoRAInputs, shape: MoEShape | str, *, max_tokens: int, stage: str = "auto",
                 activation_scheme: str = "auto", **kw):  # fmt: skip
    """:func:`.serving.build_layer` on ``inp``'s weights with the adapters of ``inp`` in slots 0..L-1, in
    ``stage``."""
    from .serving import build_layer

    kw = dict(dtype=inp.lora_a13.dtype, activation_scheme=activation_scheme) | kw
    return build_layer(inp, shape, max_tokens=max_tokens, stage=stage, **kw)


def lora_op_fn(run, op: str, op_config=None) -> Callable[[], torch.Tensor]:
    """``run.op_fn(op, op_config)`` for a LoRA op (ValueError for another); the expand writes into a private
    copy, so repeated calls cost what one call in the layer costs."""
    if op not in LORA_OPS:
        raise ValueError(f"op must be one of {LORA_OPS}, got {op!r}")
    return run.op_fn(op, op_config)


def bench_lora_op(stage: str, shape: MoEShape | str, T: int, op: str, *, mode: str = "graph",
                  config: LayerConfig | None = None, op_changes: dict | None = None,
                  weights: MoELoRAInputs | None = None, warmup_ms: float = 10, rep_ms: float = 40, run=None,
                  return_output: bool = False, min_reps: int | None = None, activation_scheme: str = "auto",
                  **inputs):  # fmt: skip
    """Time one LoRA op alone (:func:`lora_op_fn`); one row like :func:`bench_layer`'s with part = op and the
    ``op_changes`` as columns. Inputs: the keyword form of :func:`layer_inputs`, or ``run``, a LayerRun to
    reuse. ``return_output``: (row, output)."""
    shape = get_shape(shape) if isinstance(shape, str) else shape
    pattern = inputs.get("pattern", "uniform")
    if run is None:
        inp = layer_inputs(shape, T, weights=weights, **inputs)
        run = make_run(stage, inp, config, activation_scheme=activation_scheme)
        run()
    device = run.x.device
    op_cfg = getattr(run.cfg, op)
    if op_changes:
        op_cfg = dataclasses.replace(op_cfg, **op_changes)
    fn = lora_op_fn(run, op, op_cfg)
    out = fn()
    if return_output:
        out = out.clone()
    bench.sync(device)
    # touched (adapter, expert) pairs estimated as min(L·E, T·K) (the run keeps no topk_ids)
    costs = _costs(shape, run.dims, run.x, run.w13)
    m = "cpu-interpreter" if torch.device(device).type == "cpu" else mode
    tm = bench.time_fn(fn, m, device, warmup_ms, rep_ms, min_reps=min_reps)
    fields, budget = _run_fields(shape, run, pattern), (warmup_ms, rep_ms, min_reps)
    row = _timed_row(fields, op, op_cfg.short(), run.cfg.source, m, tm, _part_cost(costs, op), budget,
                     **(op_changes or {}))  # fmt: skip
    return (row, out) if return_output else row


# --- Correctness -----------------------------------------------------------------------------------------


#: The relative error W8A8 may add to a layer's output: two e4m3 roundings of 2^-4 each.
W8A8_REL_TOL = 2.0**-3


def check_tolerance(dtype: torch.dtype, activation_scheme: str = "weight_only") -> float:
    """The tolerance of :func:`check_layer`: the dtype's (:data:`~moelora_lib.testing.TOLERANCES`), at least
    :data:`W8A8_REL_TOL` for "dynamic"."""
    from ..testing import TOLERANCES

    tol = TOLERANCES[dtype]
    return max(tol, W8A8_REL_TOL) if activation_scheme == "dynamic" else tol


def check_layer(stage: str, shape: MoEShape | str | Workload, T: int | None = None, *,
                weights: MoELoRAInputs | None = None, config: LayerConfig | None = None,
                weight_format: str | None = None, activation_scheme: str = "auto",
                **inputs) -> dict[str, Any]:  # fmt: skip
    """One layer call against ``moe_lora_reference`` (fp32; default pattern "mixed"). Returns stage, model, T,
    dtype, activation, bias, pattern, weight_format, activation_scheme, rel_err, tol, no_adapter_rows,
    no_adapter_bitwise, delta_rel (max|ref − ref without LoRA| / max|ref|), rel_err_vs_dense, bitwise_vs_dense
    (packed experts against the same stage on the dequantized weights; NaN and None for dense), config. The
    reference holds [P, 2I, H] fp32: keep P = T·K modest."""
    wl = _workload(shape, T, inputs, pattern="mixed")
    inp = layer_inputs(wl, weights=weights, weight_format=weight_format)
    run = make_run(stage, inp, config, activation_scheme=activation_scheme)
    out = run().clone()
    base = run.base_part().clone()
    packed = weight_format_of(inp) != "dense"
    dense = with_weight_format(inp, "dense") if packed else inp
    args = dense.args()
    if packed:  # the reference on the exact weights in fp32
        args = (args[0], inp.w13.dequantize(torch.float32), inp.w2.dequantize(torch.float32), *args[3:])
    ref = moe_lora_reference(*args, **inp.kwargs())
    none = inp.lora_ids == -1
    bitwise = bool(torch.equal(out[none], base[none])) if bool(none.any()) else True
    no_lora = (torch.full_like(inp.lora_ids, -1), None, None, None, None)
    ref_base = moe_lora_reference(*args[:5], *no_lora, **inp.kwargs())
    delta_rel = float((ref - ref_base).abs().max() / ref.abs().max().clamp_min(1e-30))
    vs_dense, same_as_dense = float("nan"), None
    if packed:
        out_dense = make_run(run.stage.name, dense, run.cfg)()
        vs_dense, same_as_dense = rel_err(out, out_dense), bool(torch.equal(out, out_dense))
    dt = dtype_name(inp.hidden_states.dtype)
    r = dict(stage=stage, model=wl.model_name, T=wl.T, dtype=dt, activation=inp.activation)
    scheme = run_scheme(run)
    r |= dict(
        bias=inp.b13 is not None,
        pattern=wl.pattern,
        weight_format=weight_format_of(inp),
        activation_scheme=scheme,
        rel_err=rel_err(out, ref),
        tol=check_tolerance(inp.hidden_states.dtype, scheme),
        no_adapter_rows=int(none.sum()),
    )
    r |= dict(no_adapter_bitwise=bitwise, delta_rel=delta_rel, rel_err_vs_dense=vs_dense)
    return r | dict(bitwise_vs_dense=same_as_dense, config=run.cfg.short())


# --- Recompilation (notebook 03) -------------------------------------------------------------------------


def log_spaced_lengths(n: int = 40, lo: int = 1, hi: int = 8192) -> list[int]:
    """≥ n distinct prompt lengths in [lo, hi]: log-spaced, each with an odd neighbour and a multiple of 16,
    sorted."""
    out: set[int] = set()
    for i in range(n):
        v = round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / max(1, n - 1)))
        out.add(v)
        if len(out) < 2 * n:
            out.add(min(hi, v | 1))
            out.add(min(hi, max(16, (v + 15) // 16 * 16)))
    return sorted(x for x in out if lo <= x <= hi)


def length_spec_keys(
    stage: str, shape: MoEShape, T: int, rank: int, num_adapters: int, config: LayerConfig
) -> dict[str, tuple]:
    """Triton's specialization key of each kernel's length-dependent int arguments at T, valued as the
    launchers pass them: a new key is a new binary."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from ..kernels.triton_kernels import LENGTH_ARGS

    spec = STAGES[stage].specialize_lengths
    P, E = T * shape.top_k, shape.experts
    bm_b, bm_l = config.base_block_size_m, config.lora_block_size_m
    lora_blocks = max_padded_pairs(P, (num_adapters + 1) * E, bm_l) // bm_l
    values = {
        "fused_moe": dict(num_pairs=P, num_blocks=max_padded_pairs(P, E, bm_b) // bm_b),
        "lora_shrink": dict(num_pairs=P, num_blocks=lora_blocks, stride_os=P * rank),
        "lora_expand": dict(num_pairs=P, num_blocks=lora_blocks, stride_is=P * rank),
        "gated_act": dict(n_rows=P),
    }
    keys = {}
    for kern, args in values.items():
        assert set(args) == set(LENGTH_ARGS[kern]), (kern, args, LENGTH_ARGS[kern])
        keys[kern] = tuple(
            native_specialize_impl(BaseBackend, args[a], False, spec, True)[1:] for a in LENGTH_ARGS[kern]
        )
    return keys


def count_compiled_variants(specialize_lengths: bool, device: int | None = None) -> dict[str, int]:
    """Compiled binaries in ``JITFunction.device_caches[device][0]`` of each kernel of one flavour (GPU)."""
    from ..kernels.triton_kernels import KERNELS

    dev = torch.cuda.current_device() if device is None else device
    out = {}
    for name, flavours in KERNELS.items():
        caches = getattr(flavours[bool(specialize_lengths)], "device_caches", None)
        out[name] = len(caches[dev][0]) if caches is not None and dev in caches else 0
    return out


class _TimedSection:
    """Holds an exclusive ``flock`` on ``path`` for the block (no-op for None)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path, self.fd = path, None

    def __enter__(self):
        if self.path is not None:
            import fcntl

            self.fd = os.open(os.fspath(self.path), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def run_recompile(stage: str, model: str, lengths: Sequence[int], *, rank: int = 32, num_adapters: int = 8,
                  dtype: str = "bfloat16", config_T: int = 64, seed: int = 0, warm_reps: int = 3,
                  lock_path: str | os.PathLike | None = None,
                  weights_folder: str | os.PathLike | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """In this (fresh) process, per length in order: build the layer, time the first call (compilation
    included) and the median of ``warm_reps`` warm calls, and count the compiled binaries, with one config
    (:func:`default_config` at ``config_T``). GPU only. ``lock_path``: a file locked around each length's
    timed calls; ``weights_folder``: a :class:`LayerWeights` folder."""
    shape = get_shape(model)
    kw = dict(rank=rank, num_adapters=num_adapters, seed=seed)
    store = LayerWeights(**kw, dtype=DTYPES[dtype], device="cuda", folder=weights_folder)
    weights = store.get(shape, bias=False)
    cfg = default_config(Dims.of(shape, config_T, rank=rank, adapters=num_adapters))
    spec = STAGES[stage].specialize_lengths
    rows = []
    for T in lengths:
        run = make_run(stage, layer_inputs(shape, T, **kw, weights=weights), cfg)
        torch.cuda.synchronize()
        with _TimedSection(lock_path):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            warm = []
            for _ in range(warm_reps):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                warm.append((time.perf_counter() - t0) * 1e3)
            counts = count_compiled_variants(spec)
        row = dict(
            stage=stage, model=model, T=T, first_call_ms=first_ms, warm_call_ms=sorted(warm)[len(warm) // 2]
        )
        row |= dict(compiled_total=sum(counts.values()), **{f"compiled_{k}": v for k, v in counts.items()})
        rows.append(row | dict(config=cfg.short()))
    return rows


def _opts(**opts) -> list[str]:
    """``--opt value ...`` of keyword arguments (``_`` becomes ``-``; None left out)."""
    out = []
    for k, v in opts.items():
        if v is not None:
            out += [f"--{k.replace('_', '-')}", os.fspath(v) if isinstance(v, os.PathLike) else str(v)]
    return out


def _cli(cmd: str, **opts) -> list[str]:
    """argv of ``python -m moelora_lib.studies.moe_bench <cmd> --opt value ...``."""
    return [sys.executable, "-m", "moelora_lib.studies.moe_bench", cmd] + _opts(**opts)


def _recompile_cmd(
    stage, model, lengths, out, *, rank, num_adapters, dtype, seed, lock_path=None, weights_folder=None
):
    lens = ",".join(str(int(t)) for t in lengths)
    cmd = _cli(
        "recompile", stage=stage, model=model, lengths=lens, rank=rank, adapters=num_adapters, dtype=dtype
    )
    return cmd + _opts(seed=seed, out=out, lock=lock_path, weights_folder=weights_folder)


def recompile_in_subprocesses(stages: Sequence[str], model: str, lengths: Sequence[int], *, rank: int = 32,
                              num_adapters: int = 8, dtype: str = "bfloat16", seed: int = 0,
                              timeout_s: float = 400, weights_folder: str | os.PathLike | None = None,
                              ) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """:func:`run_recompile` per stage in fresh processes started at once, each with an empty
    ``TRITON_CACHE_DIR``. Returns {stage: rows}; RuntimeError with a failing child's output tail."""
    stages = list(stages)
    with tempfile.TemporaryDirectory(prefix="moelora_recompile_") as tmp:
        lock = os.path.join(tmp, "timed.lock") if len(stages) > 1 else None
        cmds, envs = {}, {}
        for st in stages:
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="moelora_triton_cache_", dir=tmp))
            env.pop("TRITON_INTERPRET", None)
            envs[st] = env
            out, kw = os.path.join(tmp, f"{st}.json"), dict(rank=rank, num_adapters=num_adapters, dtype=dtype)
            cmds[st] = _recompile_cmd(
                st, model, lengths, out, **kw, seed=seed, lock_path=lock, weights_folder=weights_folder
            )
        bench.run_side_by_side(cmds, envs=envs, timeout_s=timeout_s)
        rows = {}
        for st in stages:
            with open(os.path.join(tmp, f"{st}.json")) as f:
                rows[st] = json.load(f)
        return rows


# --- Compile pass in helper processes (before a timing loop) ---------------------------------------------


def layer_point(stage: str, model: str, T: int, *, weights_bias: bool | None = None,
                activation: str | None = None, bias: bool | None = None, pattern: str = "uniform",
                op_changes: Sequence[tuple[str, dict]] = ()) -> dict[str, Any]:  # fmt: skip
    """One point of :func:`compile_points`: the layer of ``stage`` at T on the ``weights_bias`` weight set of
    ``model``, plus each LoRA op with ``op_changes`` applied."""
    pt = dict(stage=stage, model=model, T=int(T), weights_bias=weights_bias, activation=activation, bias=bias)
    return pt | dict(pattern=pattern, op_changes=[[op, dict(ch)] for op, ch in op_changes])


def compile_points(points: Sequence[dict[str, Any]], weights: LayerWeights) -> list[str]:
    """Launch once, untimed, all a timing loop over ``points`` launches, compiling every binary into Triton's
    cache. Returns one message per failed point."""
    failed = []
    for pt in points:
        try:
            w = weights.get(pt["model"], bias=pt["weights_bias"])
            kw = dict(
                rank=weights.rank, num_adapters=weights.num_adapters, pattern=pt["pattern"], seed=weights.seed
            )
            inp = layer_inputs(
                pt["model"], pt["T"], **kw, activation=pt["activation"], bias=pt["bias"], weights=w
            )
            run = make_run(pt["stage"], inp)
            run()
            run.base_part()
            run.lora_part()
            for op, ch in pt["op_changes"]:
                lora_op_fn(run, op, dataclasses.replace(getattr(run.cfg, op), **ch))()
            bench.sync(inp.hidden_states.device)
            del run, inp
        except Exception as e:  # reported, never hidden: the timing loop meets it again
            failed.append(f"{pt['stage']} {pt['model']} T={pt['T']}: {type(e).__name__}: {str(e)[:200]}")
    return failed


def precompile_in_subprocesses(
    points: Sequence[dict[str, Any]], weights: LayerWeights, *, jobs: int = 8, timeout_s: float = 300
) -> dict[str, Any]:
    """:func:`compile_points` over ``jobs`` helper processes side by side, filling the on-disk cache; needs
    ``weights.folder`` (else does nothing). Returns dict(seconds, processes, points, failed)."""
    t0 = time.perf_counter()
    points = list(points)
    if weights.folder is None or not points or jobs < 1:
        return dict(seconds=0.0, processes=0, points=len(points), failed=[])
    for key in dict.fromkeys((pt["model"], pt["weights_bias"]) for pt in points):
        weights.get(key[0], bias=key[1])  # generated and saved once, here, before any helper loads it
    by_model: dict[str, list[dict]] = {}
    for pt in points:
        by_model.setdefault(pt["model"], []).append(pt)
    per_model = max(1, jobs // max(1, len(by_model)))
    chunks = [c for pts in by_model.values() for i in range(per_model) if (c := pts[i::per_model])]
    failed: list[str] = []
    w = weights
    with tempfile.TemporaryDirectory(prefix="moelora_compile_") as tmp:
        cmds = {}
        for i, chunk in enumerate(chunks):
            src = os.path.join(tmp, f"{i}.json")
            with open(src, "w") as f:
                json.dump(chunk, f)
            out = os.path.join(tmp, f"{i}.out.json")
            kw = dict(rank=w.rank, adapters=w.num_adapters, dtype=dtype_name(w.dtype), device=w.device)
            cmds[str(i)] = _cli("compile", points=src, out=out, **kw, seed=w.seed, weights_folder=w.folder)
        bench.run_side_by_side(cmds, timeout_s=timeout_s)
        for i in range(len(chunks)):
            with open(os.path.join(tmp, f"{i}.out.json")) as f:
                failed += json.load(f)
    return dict(seconds=time.perf_counter() - t0, processes=len(chunks), points=len(points), failed=failed)


# --- ncu (notebook 05) -----------------------------------------------------------------------------------

#: ``_lora_shrink_kernel`` launches :func:`_ncu_target` makes per point (2 in the layer call + 3).
NCU_LAUNCHES_PER_POINT = 5


def _ncu_target(model: str, points, rank: int, num_adapters: int, seed: int, weights_folder=None) -> None:
    """The process ncu profiles: per (T, GROUP_SIZE_M), one stage-``swizzle`` layer call, then its gate_up
    shrink three times."""
    shape = get_shape(model)
    kw = dict(rank=rank, num_adapters=num_adapters, seed=seed)
    store = LayerWeights(**kw, dtype=torch.bfloat16, device="cuda", folder=weights_folder)
    weights = store.get(shape, bias=False)
    for T, group_size_m in points:
        run = make_run(
            "swizzle", layer_inputs(shape, T, **kw, activation="silu", bias=False, weights=weights)
        )
        run()
        cfg = dataclasses.replace(run.cfg.gate_up_shrink, GROUP_SIZE_M=group_size_m)
        fn = lora_op_fn(run, "gate_up_shrink", cfg)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        del run, fn


def ncu_l2_hit_rates(model: str, points: Sequence[tuple[int, int]], *, rank: int = 32, num_adapters: int = 8,
                     seed: int = 0, weights_folder: str | os.PathLike | None = None,
                     timeout_s: float = 300) -> list[dict[str, Any]]:  # fmt: skip
    """``ncu --metrics lts__t_sector_hit_rate.pct`` over one :func:`_ncu_target` process. One dict per point:
    T, group_size_m, ok, l2_hit_pct, launches, message; ok=False with the reason when ncu is missing or fails
    or its launch count does not split into the points."""
    import shutil
    import subprocess

    points = [(int(t), int(g)) for t, g in points]

    def failed(msg: str) -> list[dict[str, Any]]:
        nan = float("nan")
        return [
            dict(T=t, group_size_m=g, ok=False, l2_hit_pct=nan, launches=0, message=msg) for t, g in points
        ]

    ncu = shutil.which("ncu")
    if ncu is None:
        return failed("ncu not found on PATH")
    pts = ",".join(f"{t}:{g}" for t, g in points)
    target = _cli("ncu-target", model=model, points=pts, rank=rank, adapters=num_adapters, seed=seed)
    target += _opts(weights_folder=weights_folder)
    metric = "lts__t_sector_hit_rate.pct"
    cmd = [ncu, "--clock-control", "none", "--metrics", metric, "--csv", "-k", "regex:_lora_shrink_kernel"]
    try:
        proc = subprocess.run(
            cmd + target, capture_output=True, text=True, timeout=timeout_s, cwd=str(bench.REPO_ROOT)
        )
    except (OSError, subprocess.SubprocessError) as e:
        return failed(f"ncu failed: {e}")
    vals = []
    for line in proc.stdout.splitlines():
        if metric in line:
            try:
                vals.append(float(line.split('","')[-1].strip('"').replace(",", "")))
            except ValueError:
                pass
    if not vals:
        tail = (proc.stdout + proc.stderr)[-400:].replace("\n", " | ")
        return failed(f"no metric in ncu output (rc {proc.returncode}): {tail}")
    n = NCU_LAUNCHES_PER_POINT
    if len(vals) != n * len(points):
        return failed(
            f"ncu profiled {len(vals)} launches, expected {n} per point for {len(points)} points "
            f"(rc {proc.returncode})"
        )
    pct = [sum(vals[i * n : (i + 1) * n]) / n for i in range(len(points))]
    return [
        dict(T=t, group_size_m=g, ok=True, l2_hit_pct=p, launches=n, message="ok")
        for (t, g), p in zip(points, pct)
    ]


# --- Command line (fresh processes) ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moelora_lib.studies.moe_bench recompile --stage S --lengths 1,7,... --out F.json``,
    ``... compile --points P.json --out F.json`` or ``... ncu-target --points 64:1,64:8``."""
    p = argparse.ArgumentParser(prog="python -m moelora_lib.studies.moe_bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recompile", help="compiled variants and first/warm call latency per length")
    r.add_argument("--stage", required=True, choices=list(STAGES))
    r.add_argument("--lengths", required=True, help="comma-separated prompt lengths, in call order")
    r.add_argument("--config-T", type=int, default=64)
    r.add_argument("--lock", default=None, help="lock file held around each length's timed calls")
    c = sub.add_parser("compile", help="launch layer points once, untimed (a compile pass)")
    c.add_argument("--points", required=True, help="JSON file: a list of layer_point() dicts")
    c.add_argument("--device", default="cuda")
    n = sub.add_parser("ncu-target", help="launch the gate_up shrink (profiled by ncu)")
    n.add_argument("--points", required=True, help="T:GROUP_SIZE_M,... in order")
    for s in (r, c, n):
        s.add_argument("--model", default="gpt-oss-20b")
        s.add_argument("--rank", type=int, default=32)
        s.add_argument("--adapters", type=int, default=8)
        s.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
        s.add_argument("--seed", type=int, default=0)
        s.add_argument(
            "--weights-folder", default=None, help="LayerWeights folder (load/save the weight set)"
        )
        if s is not n:
            s.add_argument(
                "--out", required=True, help="JSON file for the rows (recompile) or failures (compile)"
            )
    a = p.parse_args(argv)
    if a.cmd == "ncu-target":
        points = [tuple(int(v) for v in pt.split(":")) for pt in a.points.split(",") if pt]
        _ncu_target(a.model, points, a.rank, a.adapters, a.seed, a.weights_folder)
        return 0
    if a.cmd == "compile":
        with open(a.points) as f:
            points = json.load(f)
        kw = dict(rank=a.rank, num_adapters=a.adapters, dtype=DTYPES[a.dtype], device=a.device, seed=a.seed)
        result = compile_points(points, LayerWeights(**kw, folder=a.weights_folder))
    else:
        kw = dict(rank=a.rank, num_adapters=a.adapters, dtype=a.dtype, config_T=a.config_T, seed=a.seed)
        lengths = [int(x) for x in a.lengths.split(",") if x]
        result = run_recompile(
            a.stage, a.model, lengths, **kw, lock_path=a.lock, weights_folder=a.weights_folder
        )
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
