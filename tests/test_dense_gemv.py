"""The one-launch decode GEMV of a dense multi-LoRA projection (moelora_lib.kernels.dense_gemv) on the CPU
interpreter against the float64 reference ``lora_linear_reference``, its split-K workspace contract
(left all zero by every call), ids out of range (NaN rows), NaN in an unused slot, input checks, the
default config picker, block-FP8 weights (against the reference on the dequantized weight), LoRALinear's
``gemv_max_tokens`` with dense and FP8 weights, and a compile-only check for sm_90 of the last-arriver
reduction's PTX and of the FP8 variant's loads and registers."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moelora_lib.kernels.dense_gemv import (
    DENSE_GEMV_MAX_TOKENS,
    DenseGemvConfig,
    DenseGemvWorkspace,
    default_dense_gemv_config,
    dense_gemv_lora,
    dense_gemv_num_tiles,
    dense_gemv_workspace,
)
from moelora_lib.linear import lora_linear_reference
from moelora_lib.testing import TOLERANCES, rel_err

ROOT = Path(__file__).resolve().parents[1]
L, R = 3, 8
SLOT_RANK = (8, 3, 8)  # slot 1 holds a rank-3 adapter, zero-padded to R = 8
ONE = (64,)
THREE = (32, 16, 16)  # unequal slices; with BLOCK_SIZE_N 32 a 16-wide slice fills half a tile
# (name, config, H): unsplit; split 3 with EVEN_K (96 = 32·3); split 2 over 6 ragged K tiles (88 = 16·5.5)
CONFIGS = [
    ("sk1", DenseGemvConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, SPLIT_K=1), 96),
    ("sk3_even", DenseGemvConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, SPLIT_K=3), 96),
    ("sk2_ragged", DenseGemvConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, SPLIT_K=2), 88),
]


def _inputs(T, H, slices, dtype, seed=0, bias=True):
    """x, weight, bias, lora_a, lora_b, ids: N(0, 1) activations, weights scaled so outputs are O(1),
    the adapters' deltas of the same order as the base; ids mix every slot and -1."""
    g = torch.Generator().manual_seed(seed)
    N, S = sum(slices), len(slices)

    def rnd(*shape, std=1.0):
        return (torch.randn(shape, generator=g) * std).to(dtype)

    x = rnd(T, H)
    w = rnd(N, H, std=H**-0.5)
    b = rnd(N) if bias else None
    a = rnd(L, S, R, H, std=H**-0.5)
    bb = rnd(L, N, R, std=R**-0.5)
    for slot, r in enumerate(SLOT_RANK):
        a[slot, :, r:] = 0
        bb[slot, :, r:] = 0
    ids = torch.tensor([(t % (L + 1)) - 1 for t in range(T)][::-1], dtype=torch.int32)  # ..., 1, 0, -1
    return x, w, b, a, bb, ids


def _workspace(T, slices, cfg):
    return dense_gemv_workspace(max(T, 8), sum(slices), dense_gemv_num_tiles(slices, cfg.BLOCK_SIZE_N), "cpu")


def _is_zero(ws: DenseGemvWorkspace) -> bool:
    return bool((ws.partial == 0).all() and (ws.counters == 0).all())


@pytest.mark.parametrize("slices", [ONE, THREE], ids=["one_slice", "three_slices"])
@pytest.mark.parametrize("name, cfg, H", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, T, name, cfg, H, slices):
    # bias on every other case (T odd: bias), so both forms meet every config and slice layout
    x, w, b, a, bb, ids = _inputs(T, H, slices, dtype, seed=T + H, bias=T % 2 == 1)
    ws = _workspace(T, slices, cfg)
    y = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    ref = lora_linear_reference(x, w, a, bb, ids, slices=slices, bias=b)
    assert y.dtype == dtype and y.shape == (T, sum(slices))
    err = rel_err(y, ref)
    assert err <= (1e-5 if dtype == torch.float32 else TOLERANCES[dtype]), err
    if (ids >= 0).any():  # the LoRA part is really there
        base = lora_linear_reference(x, w, a, bb, torch.full_like(ids, -1), slices=slices, bias=b)
        assert rel_err(base, ref) > 0.05
    assert _is_zero(ws)


def test_base_only_and_all_rows_without_adapter():
    T, H, slices = 5, 96, THREE
    x, w, b, a, bb, ids = _inputs(T, H, slices, torch.float32)
    none = torch.full_like(ids, -1)
    ref = lora_linear_reference(x, w, a, bb, none, slices=slices, bias=b)
    for cfg in (CONFIGS[0][1], CONFIGS[1][1]):
        ws = _workspace(T, slices, cfg)
        y0 = dense_gemv_lora(x, w, b, None, None, None, slices=slices, config=cfg, workspace=ws)
        y1 = dense_gemv_lora(x, w, b, a, bb, none, slices=slices, config=cfg, workspace=ws)
        assert rel_err(y0, ref) < 1e-6 and torch.equal(y0, y1)  # ids -1 skip the LoRA work exactly
        assert _is_zero(ws)


def test_default_config_and_workspace_allocated_when_omitted():
    T, H, slices = 3, 96, THREE
    x, w, b, a, bb, ids = _inputs(T, H, slices, torch.float32)
    y = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices)
    assert rel_err(y, lora_linear_reference(x, w, a, bb, ids, slices=slices, bias=b)) < 1e-5
    # out= is written and returned; int64 ids work alike
    out = torch.empty_like(y)
    got = dense_gemv_lora(x, w, b, a, bb, ids.long(), slices=slices, config=CONFIGS[1][1], out=out)
    assert got is out and rel_err(out, y) < 1e-6


@pytest.mark.parametrize("name, cfg, H", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_ids_out_of_range_give_nan_rows_and_leave_the_others_exact(name, cfg, H):
    T, slices = 6, THREE
    x, w, b, a, bb, _ = _inputs(T, H, slices, torch.float32)
    ids = torch.tensor([0, L, -2, 2, -1, 1 << 20], dtype=torch.int32)
    ws = _workspace(T, slices, cfg)
    y = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    bad = torch.tensor([False, True, True, False, False, True])
    assert torch.isnan(y[bad]).all()
    fixed = torch.where(bad, torch.full_like(ids, -1), ids)
    y_ok = dense_gemv_lora(x, w, b, a, bb, fixed, slices=slices, config=cfg, workspace=ws)
    assert torch.equal(y[~bad], y_ok[~bad])  # bit for bit
    assert _is_zero(ws)


@pytest.mark.parametrize("name, cfg, H", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_nan_in_an_unused_slot_stays_there(name, cfg, H):
    T, slices = 5, THREE
    x, w, b, a, bb, _ = _inputs(T, H, slices, torch.float16)
    ids = torch.tensor([0, -1, 1, 0, -1], dtype=torch.int32)  # slot 2 unused
    y_clean = dense_gemv_lora(
        x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=_workspace(T, slices, cfg)
    )
    a[2], bb[2] = float("nan"), float("nan")
    # an id out of range is clamped before its loads, never to a slot it would read NaN from
    y = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=_workspace(T, slices, cfg))
    assert torch.isfinite(y).all() and torch.equal(y, y_clean)


def test_workspace_is_left_zero_and_reused():
    slices, H = THREE, 96
    cfg = CONFIGS[1][1]
    ws = dense_gemv_workspace(8, sum(slices), dense_gemv_num_tiles(slices, 16), "cpu")
    x, w, b, a, bb, ids = _inputs(8, H, slices, torch.float32, seed=5)
    first = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    assert _is_zero(ws)
    second = dense_gemv_lora(x, w, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    assert torch.equal(first, second) and _is_zero(ws)
    # a smaller call and another tile width on the same workspace
    cfg2 = DenseGemvConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, SPLIT_K=2)
    y = dense_gemv_lora(x[:3], w, b, a, bb, ids[:3], slices=slices, config=cfg2, workspace=ws)
    assert torch.equal(y, first[:3]) or rel_err(y, first[:3]) < 1e-6
    assert _is_zero(ws)


# ---- bad inputs -------------------------------------------------------------------------------------------


def _bad(name):
    T, H, slices = 4, 32, THREE
    x, w, b, a, bb, ids = _inputs(T, H, slices, torch.float32)
    kw = dict(x=x, weight=w, bias=b, lora_a=a, lora_b=bb, lora_ids=ids, slices=slices)
    cfg2 = DenseGemvConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, SPLIT_K=2)
    changes = {
        "x_1d": dict(x=x[0]),
        "x_dtype": dict(x=x.double()),
        "x_bf16_cpu": dict(x=x.bfloat16()),
        "x_too_many_tokens": dict(x=torch.zeros(DENSE_GEMV_MAX_TOKENS + 1, H)),
        "weight_H": dict(weight=w[:, :16]),
        "weight_dtype": dict(weight=w.half()),
        "slices_sum": dict(slices=(32, 16, 8)),
        "slices_type": dict(slices=64),
        "bias_shape": dict(bias=b[:10]),
        "lora_a_S": dict(lora_a=a[:, :2]),
        "lora_b_R": dict(lora_b=bb[..., :4]),
        "ids_dtype": dict(lora_ids=ids.to(torch.int16)),
        "ids_T": dict(lora_ids=ids[:2]),
        "lora_partial": dict(lora_b=None),
        "config": dict(config="n64"),
        "workspace_type": dict(config=cfg2, workspace=(1, 2)),
        "workspace_rows": dict(config=cfg2, workspace=dense_gemv_workspace(2, 64, 8, "cpu")),
        "workspace_tiles": dict(config=cfg2, workspace=dense_gemv_workspace(8, 64, 2, "cpu")),
        "out_shape": dict(out=torch.empty(T, 63)),
        "device": dict(lora_b=bb.to("meta")),
        "out_expanded": dict(out=torch.empty(1, 64).expand(T, 64)),
        "out_is_x": dict(
            x=torch.zeros(T, 64), weight=torch.zeros(64, 64), lora_a=a.new_zeros(L, 3, R, 64), out="x"
        ),  # fmt: skip
        "out_is_workspace": dict(config=cfg2, workspace=_ws, out="ws"),
        "workspace_expanded": dict(
            config=cfg2,
            workspace=DenseGemvWorkspace(torch.zeros(1, 64).expand(8, 64), torch.zeros(8, dtype=torch.int32)),
        ),
        "counters_expanded": dict(
            config=cfg2,
            workspace=DenseGemvWorkspace(torch.zeros(8, 64), torch.zeros(1, dtype=torch.int32).expand(8)),
        ),
        "x_requires_grad": dict(x=x.clone().requires_grad_()),
        "slot_mask_dtype": dict(slot_mask=torch.ones(L, dtype=torch.int32)),
        "slot_mask_no_lora": dict(
            lora_a=None, lora_b=None, lora_ids=None, slot_mask=torch.ones(L, dtype=torch.bool)
        ),
    }
    kw.update(changes[name])
    if kw.get("out") == "x":
        kw["out"] = kw["x"]
    elif kw.get("out") == "ws":
        kw["out"] = kw["workspace"].partial[:T]
    return kw


_ws = dense_gemv_workspace(8, 64, 8, "cpu")


BAD = {
    "x_1d": r"x must be a 2-D tensor \[T, H\]",
    "x_dtype": "x dtype must be float16, bfloat16 or float32, got torch.float64",
    "x_bf16_cpu": "bfloat16 is not supported on the CPU",
    "x_too_many_tokens": rf"x: T = {DENSE_GEMV_MAX_TOKENS + 1} tokens must be in \[1, ",
    "weight_H": r"weight must have shape \[N_total=64, H=32\]",
    "weight_dtype": "weight must have dtype torch.float32",
    "slices_sum": "slices .* must sum to N_total",
    "slices_type": "slices must be a non-empty tuple",
    "bias_shape": r"bias must have shape \[N_total=64\]",
    "lora_a_S": r"lora_a must have shape \[L=3, S=3, R=8, H=32\]",
    "lora_b_R": r"lora_b must have shape \[L=3, N_total=64, R=8\]",
    "ids_dtype": r"lora_ids must have dtype in \['torch.int32', 'torch.int64'\], got torch.int16",
    "ids_T": r"lora_ids must have shape \[T=4\]",
    "lora_partial": "lora_a, lora_b and lora_ids must be given together",
    "config": "config must be a DenseGemvConfig or None",
    "workspace_type": "workspace must be a DenseGemvWorkspace",
    "workspace_rows": r"workspace.partial must be a float32 tensor \[>= T=4, N_total=64\]",
    "workspace_tiles": r"workspace.counters must be a contiguous int32 tensor \[>= n_tiles=4\]",
    "out_shape": r"out must have shape \[T=4, N_total=64\]",
    "device": "lora_b must be on cpu",
    "out_expanded": "out must have rows of unit stride that do not overlap",
    "out_is_x": "out must not share memory with x",
    "out_is_workspace": "out must not share memory with the workspace",
    "workspace_expanded": "workspace.partial must be a float32 tensor .* of non-overlapping rows",
    "counters_expanded": "workspace.counters must be a contiguous int32 tensor",
    "x_requires_grad": "x requires grad: moelora_lib is inference only",
    "slot_mask_dtype": r"slot_mask must have dtype torch.bool",
    "slot_mask_no_lora": "slot_mask needs the LoRA arguments",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_name_the_argument(name):
    kw = _bad(name)
    args = [kw.pop(k) for k in ("x", "weight", "bias", "lora_a", "lora_b", "lora_ids")]
    with pytest.raises(ValueError, match=BAD[name]):
        dense_gemv_lora(*args, **kw)


@pytest.mark.parametrize(
    "field, value",
    [("BLOCK_SIZE_N", 48), ("BLOCK_SIZE_N", 4), ("BLOCK_SIZE_K", 8), ("SPLIT_K", 0), ("SPLIT_K", 2.0),
     ("NUM_WARPS", 3), ("NUM_STAGES", 0)],
)  # fmt: skip
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"DenseGemvConfig.{field} must be"):
        DenseGemvConfig(**{field: value})


def test_workspace_and_picker_argument_checks():
    with pytest.raises(ValueError, match="n_tiles must be an int >= 1"):
        dense_gemv_workspace(8, 64, 0, "cpu")
    with pytest.raises(ValueError, match=rf"T must be an int in \[1, {DENSE_GEMV_MAX_TOKENS}\]"):
        default_dense_gemv_config(0, 64, 64)
    with pytest.raises(ValueError, match="hidden must be an int >= 1"):
        default_dense_gemv_config(1, 64, 0)


# (H, slices) of the GPU presets: GPT-OSS-20B qkv / o, Qwen3-30B-A3B qkv / o,
# Qwen3-32B qkv / o / gate_up / down
GPU_SHAPES = [
    (2880, (4096, 512, 512)),
    (4096, (2880,)),
    (2048, (4096, 512, 512)),
    (4096, (2048,)),
    (5120, (8192, 1024, 1024)),
    (8192, (5120,)),
    (5120, (25600, 25600)),
    (25600, (5120,)),
]


@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("H, slices", GPU_SHAPES, ids=[f"{h}x{sum(s)}" for h, s in GPU_SHAPES])
def test_default_config_fills_the_gpu(T, H, slices):
    cfg = default_dense_gemv_config(T, sum(slices), H, slices=slices)
    tiles = dense_gemv_num_tiles(slices, cfg.BLOCK_SIZE_N)
    k_tiles = -(-H // cfg.BLOCK_SIZE_K)
    per = -(-k_tiles // cfg.SPLIT_K)
    assert (cfg.SPLIT_K - 1) * per < k_tiles  # no split without a K tile
    assert cfg.BLOCK_SIZE_N in (32, 64)
    if T == 1:  # >= 4 programs per SM, >= 2 K tiles per program, 128-wide K tiles
        assert tiles * cfg.SPLIT_K >= 3 * 132 or 2 * cfg.SPLIT_K >= k_tiles - 1, cfg
        assert per >= 2 and cfg.BLOCK_SIZE_K == 128, cfg
    else:  # >= 2 programs per SM; every preset admits an unmasked K loop at the picked split
        assert tiles * cfg.SPLIT_K >= 2 * 132 or cfg.SPLIT_K == k_tiles, cfg
        assert cfg.even_k(H), cfg


def test_default_config_at_one_token_follows_the_sweep():
    """T = 1 on the projections data/dev/h100_20261207_dense_gemv/ swept: the sweep's fastest K split (or, on
    GPT-OSS-20B qkv, 128-wide ragged K tiles, whose 6 splits replace the sweep's 5)."""
    for H, slices, want in [
        (2880, (4096, 512, 512), "n64k128s6"),  # GPT-OSS-20B qkv: H = 22.5 K tiles
        (4096, (2880,), "n64k128s16"),  # GPT-OSS-20B o (swept best n128k128s16)
        (5120, (8192, 1024, 1024), "n64k128s4"),  # Qwen3-32B qkv
        (25600, (5120,), "n64k128s8"),  # Qwen3-32B down
        (2048, (4096, 512, 512), "n64k128s8"),  # Qwen3-30B-A3B qkv
    ]:
        cfg = default_dense_gemv_config(1, sum(slices), H, slices=slices)
        assert cfg.short().startswith(want), (H, slices, cfg)
        assert default_dense_gemv_config(1, sum(slices), H, slices=slices, block_k=128) == cfg


# ---- block-FP8 weights ------------------------------------------------------------------------------------
# (name, block, config, H, slices):
#   b16x32: small blocks, 3 unequal slices, one scale column per 32-wide K tile, unsplit, EVEN_K;
#   b16x32_ragged: N = 81 (last block row holds 1 row) and H = 88 (last scale column 24 wide, K tiles of 16
#     ragged over 2 splits); the 17-wide slice starts mid block row, so its tiles read two scale rows;
#   b64x64: a 16-wide tile of the 30-wide slice crosses the block row at 64; H = 160 = 2.5 scale columns,
#     3 splits over 3 K tiles of 64 (EVEN_K off: 160 % 192);
#   b128x128: the published block on small sizes: N = 80 < bn (one ragged block row), H = 160 (scale columns
#     of 128 and 32), BLOCK_SIZE_K 32 over 2 splits.
FP8_CASES = [
    ("b16x32", (16, 32), DenseGemvConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, SPLIT_K=1), 96, THREE),
    (
        "b16x32_ragged",
        (16, 32),
        DenseGemvConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, SPLIT_K=2),
        88,
        (40, 24, 17),
    ),
    ("b64x64", (64, 64), DenseGemvConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=64, SPLIT_K=3), 160, (50, 30)),
    ("b128x128", (128, 128), DenseGemvConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, SPLIT_K=2), 160, (80,)),
]


def _fp8(w, block):
    from moelora_lib.quant.fp8 import FP8BlockWeight, quantize_fp8_block

    return FP8BlockWeight(*quantize_fp8_block(w.float(), block), block)


def _dequantized(fw, dtype):
    """The dense weight the FP8 GEMV's result equals (up to summation order): codes·scales in fp32, rounded
    once to the activations' dtype."""
    from moelora_lib.quant.fp8 import dequantize_fp8_block

    return dequantize_fp8_block(fw.weight, fw.scale_inv, dtype, fw.block)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name, block, cfg, H, slices", FP8_CASES, ids=[c[0] for c in FP8_CASES])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_weight_matches_reference_on_the_dequantized_weight(dtype, T, name, block, cfg, H, slices, bias):
    x, w, b, a, bb, ids = _inputs(T, H, slices, dtype, seed=7 * T + H, bias=bias)
    fw = _fp8(w, block)
    deq = _dequantized(fw, dtype)
    ws = _workspace(T, slices, cfg)
    y = dense_gemv_lora(x, fw, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    ref = lora_linear_reference(x, deq, a, bb, ids, slices=slices, bias=b)
    assert y.dtype == dtype and y.shape == (T, sum(slices))
    err = rel_err(y, ref)
    assert err <= (1e-5 if dtype == torch.float32 else TOLERANCES[dtype]), err
    assert _is_zero(ws)
    # each tile is the dequantized weight exactly: the interpreter adds in one order, so the dense GEMV on
    # that weight gives the same bits (on a GPU the split-K adds may land in another order)
    y_dense = dense_gemv_lora(x, deq, b, a, bb, ids, slices=slices, config=cfg, workspace=ws)
    assert torch.equal(y, y_dense)
    # the base GEMV alone (no LoRA arguments) gives the id -1 rows bit for bit
    y0 = dense_gemv_lora(x, fw, b, None, None, None, slices=slices, config=cfg, workspace=ws)
    none = ids < 0
    assert torch.equal(y0[none], y[none]) and _is_zero(ws)
    if T > 1:  # the quantization is visible: FP8 is not the unquantized weight
        assert not torch.equal(y0, dense_gemv_lora(x, w, b, None, None, None, slices=slices, config=cfg))


def test_fp8_default_config_and_scale_dtypes():
    from moelora_lib.quant.fp8 import FP8BlockWeight

    T, H, slices = 3, 96, THREE
    x, w, b, a, bb, ids = _inputs(T, H, slices, torch.float32)
    fw = _fp8(w, (16, 32))
    y = dense_gemv_lora(x, fw, b, a, bb, ids, slices=slices)  # the picker's BLOCK_SIZE_K divides 32
    ref = lora_linear_reference(x, _dequantized(fw, torch.float32), a, bb, ids, slices=slices, bias=b)
    assert rel_err(y, ref) < 1e-5
    # float16 scales (some checkpoints) are widened exactly, as dequantize_fp8_block does
    fh = FP8BlockWeight(fw.weight, fw.scale_inv.half(), fw.block)
    yh = dense_gemv_lora(x, fh, b, a, bb, ids, slices=slices, config=CONFIGS[0][1])
    refh = lora_linear_reference(x, _dequantized(fh, torch.float32), a, bb, ids, slices=slices, bias=b)
    assert rel_err(yh, refh) < 1e-5


FP8_BAD = {
    # BLOCK_SIZE_K 64 would span two 32-wide scale columns
    "block_k_not_dividing": (dict(block=(16, 32), config=DenseGemvConfig(16, 64, 1)),
                             r"config.BLOCK_SIZE_K = 64 must divide .* weight.block\[1\] = 32"),
    "block_not_16": (dict(block=(16, 24)), r"weight.block = \(16, 24\): .* multiple of 16 columns"),
    "weight_H": (dict(block=(16, 16), H=48), r"weight must have shape \[N_total, H=32\]"),
    "weight_device": (dict(block=(16, 32), device="meta"), "weight must be on cpu"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FP8_BAD))
def test_fp8_bad_inputs_name_the_argument(name):
    from moelora_lib.quant.fp8 import FP8BlockWeight

    kw, msg = FP8_BAD[name]
    T, H, slices = 2, 32, THREE
    x, w, b, a, bb, ids = _inputs(T, kw.get("H", H), slices, torch.float32)
    fw = _fp8(w, kw["block"])
    if "device" in kw:
        fw = FP8BlockWeight(fw.weight.to(kw["device"]), fw.scale_inv.to(kw["device"]), fw.block)
    x = x[:, :H]
    with pytest.raises(ValueError, match=msg):
        dense_gemv_lora(x, fw, None, None, None, None, slices=slices, config=kw.get("config"))


@pytest.mark.parametrize("block_k", [16, 32, 48, 128, 384])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("H, slices", GPU_SHAPES[:4], ids=[f"{h}x{sum(s)}" for h, s in GPU_SHAPES[:4]])
def test_default_config_keeps_block_k_divisible(H, slices, T, block_k):
    cfg = default_dense_gemv_config(T, sum(slices), H, slices=slices, block_k=block_k)
    assert block_k % cfg.BLOCK_SIZE_K == 0, cfg
    assert cfg.SPLIT_K <= -(-H // cfg.BLOCK_SIZE_K)
    if block_k % 128 == 0:  # the published block changes nothing
        assert cfg == default_dense_gemv_config(T, sum(slices), H, slices=slices)


def test_default_config_block_k_checks():
    for bad in (24, 0, 8, 2.0):
        with pytest.raises(ValueError, match="block_k must be None"):
            default_dense_gemv_config(1, 64, 64, block_k=bad)


# ---- compile-only for sm_90: the last arriver's memory ordering in the PTX ---------------------------------
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from moelora_lib.kernels import dense_gemv as dg
    from moelora_lib.quant.fp8 import FP8BlockWeight
    from moelora_lib.studies.compile_check import compile_for_sm90, ptx, resource_usage

    H, SLICES, R, L = 2880, (4096, 512, 512), 32, 8   # GPT-OSS-20B qkv, bf16
    meta = dict(device="meta", dtype=torch.bfloat16)
    N = sum(SLICES)
    w, bias = torch.empty(N, H, **meta), torch.empty(N, **meta)
    # the same projection in block FP8, 128 x 128 blocks (H = 22.5 scale columns: the last one ragged)
    wq = FP8BlockWeight(torch.empty(N, H, dtype=torch.float8_e4m3fn, device="meta"),
                        torch.empty(-(-N // 128), -(-H // 128), device="meta"), (128, 128))
    a, b = torch.empty(L, len(SLICES), R, H, **meta), torch.empty(L, N, R, **meta)
    res = {}
    for T in (1, 8):
        x, y = torch.empty(T, H, **meta), torch.empty(T, N, **meta)
        ids = torch.empty(T, dtype=torch.int32, device="meta")
        cfg = dg.default_dense_gemv_config(T, N, H, slices=SLICES)
        for split in (cfg.SPLIT_K, 1):
            c = dg.DenseGemvConfig(cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, split, cfg.NUM_WARPS, cfg.NUM_STAGES)
            ws = dg.dense_gemv_workspace(8, N, dg.dense_gemv_num_tiles(SLICES, c.BLOCK_SIZE_N), "meta")
            grid, args, cx = dg.dense_gemv_args(x, w, bias, a, b, ids, y, ws, c, slices=SLICES)
            k = compile_for_sm90(dg._KERNEL, args, cx, c.NUM_WARPS, c.NUM_STAGES)
            res[f"T{T}/" + ("split" if split > 1 else "unsplit")] = dict(
                ptx=ptx(k), res=resource_usage(k), grid=list(grid))
        cfg = dg.default_dense_gemv_config(T, N, H, slices=SLICES, block_k=128)
        for split in (cfg.SPLIT_K, 1):
            c = dg.DenseGemvConfig(cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, split, cfg.NUM_WARPS, cfg.NUM_STAGES)
            ws = dg.dense_gemv_workspace(8, N, dg.dense_gemv_num_tiles(SLICES, c.BLOCK_SIZE_N), "meta")
            for name, weight in (("fp8", wq), ("fp8dense", w)):  # and the dense weight at the same config
                grid, args, cx = dg.dense_gemv_args(x, weight, bias, a, b, ids, y, ws, c, slices=SLICES)
                k = compile_for_sm90(dg._KERNEL, args, cx, c.NUM_WARPS, c.NUM_STAGES)
                res[f"T{T}/{name}_" + ("split" if split > 1 else "unsplit")] = dict(
                    ptx=ptx(k), res=resource_usage(k), grid=list(grid), config=c.short())
    print(json.dumps(res))
    """
)


def _compile_only_available() -> bool:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.fixture(scope="module")
def compiled():
    if not _compile_only_available():
        pytest.skip("compile-only for sm_90 needs triton's NVIDIA backend and its bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_RELAXED_ADD = re.compile(r"(?<![\w.])(?:red|atom)\.global\.gpu\.relaxed\.add\.(?:v\d\.)?f32")
_ACQ_REL = re.compile(r"atom\.global\.gpu\.acq_rel\.add\.u32")


@pytest.mark.parametrize("T", [1, 8])
def test_sm90_last_arriver_ordering(compiled, T):
    r = compiled[f"T{T}/split"]
    p = r["ptx"]
    assert r["grid"][1] > 1
    adds = [m.end() for m in _RELAXED_ADD.finditer(p)]
    acq = [m.start() for m in _ACQ_REL.finditer(p)]
    assert adds and len(acq) == 1, (len(adds), len(acq))
    # the partial tile's relaxed fp32 adds, then a CTA barrier, then the one acq_rel arrival
    assert max(adds) < acq[0], "an fp32 add follows the arrival"
    assert "bar.sync" in p[max(adds) : acq[0]], "no bar.sync between the partial adds and the arrival"
    # the last arriver reads the workspace past L1 and puts the counter back to 0
    assert re.search(r"ld\.global\.cg\.", p[acq[0] :]), "the workspace load is not .cg"
    assert re.search(r"atom\.global\.gpu\.relaxed\.exch\.b32", p[acq[0] :]), "no counter reset"
    assert r["res"]["LOCAL"] == 0, r["res"]  # no spills
    # unsplit: no workspace, no atomics, no barrier for them
    one = compiled[f"T{T}/unsplit"]
    assert not _RELAXED_ADD.search(one["ptx"]) and not _ACQ_REL.search(one["ptx"])
    assert one["res"]["LOCAL"] == 0, one["res"]


# --------------------------------------------------------------------------------------------------
# LoRALinear(gemv_max_tokens=...): the decode GEMV wired into the module
# --------------------------------------------------------------------------------------------------
def _module(gemv_max_tokens, dtype=torch.float32, **kw):
    from moelora_lib.linear import LoRALinear

    x, w, b, a, bb, _ = _inputs(8, 96, THREE, dtype)
    m = LoRALinear(w, b, slices=THREE, num_adapters=L, max_rank=R, max_tokens=16,
                   gemv_max_tokens=gemv_max_tokens, **kw)  # fmt: skip
    for slot, r in enumerate(SLOT_RANK):
        As = [a[slot, s, :r] for s in range(3)]
        Bs = [bb[slot, o : o + n, :r] for o, n in ((0, 32), (32, 16), (48, 16))]
        m.load_adapter(slot, As, Bs)
    return m, x, w, b, a, bb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_lora_linear_module_runs_the_gemv_up_to_its_threshold(dtype, monkeypatch):
    import moelora_lib.linear as lin

    m, x, w, b, a, bb = _module(4, dtype)
    calls = []
    real = lin.dense_gemv_lora
    monkeypatch.setattr(lin, "dense_gemv_lora", lambda *p, **k: calls.append(p[0].shape[0]) or real(*p, **k))
    for T in (1, 3, 4, 6):
        ids = torch.tensor([(t % (L + 1)) - 1 for t in range(T)], dtype=torch.int32)
        y = m(x[:T], ids)
        ref = lora_linear_reference(x[:T], w, a, bb, ids, slices=THREE, bias=b)
        assert rel_err(y, ref) <= TOLERANCES[dtype], (T, rel_err(y, ref))
    assert calls == [1, 3, 4]  # T = 6 > 4: F.linear + the LoRA launches


def test_lora_linear_module_gemv_settings_and_checks():
    m, x, *_ = _module(8)
    assert "gemv_max_tokens=8" in repr(m)
    assert m.gemv_config_for(2).SPLIT_K >= 1
    m.deterministic = True
    assert m.gemv_config_for(2).SPLIT_K == 1
    ids = torch.full((2,), -1, dtype=torch.int32)
    m.active_slots = ()  # no LoRA launch: F.linear, bit for bit
    assert torch.equal(m(x[:2], ids), torch.nn.functional.linear(x[:2], m.weight, m.bias))
    for bad in (-1, DENSE_GEMV_MAX_TOKENS + 1, 2.0, True):
        with pytest.raises(ValueError, match="gemv_max_tokens"):
            m.gemv_max_tokens = bad


def _fp8_module(gemv_max_tokens, dtype, block=(16, 32), **kw):
    """A LoRALinear on the block-FP8 weight of _module's inputs, its adapters loaded alike."""
    from moelora_lib.linear import LoRALinear

    x, w, b, a, bb, _ = _inputs(8, 96, THREE, dtype)
    fw = _fp8(w, block)
    m = LoRALinear(fw, b, slices=THREE, num_adapters=L, max_rank=R, max_tokens=16, dtype=dtype,
                   gemv_max_tokens=gemv_max_tokens, **kw)  # fmt: skip
    for slot, r in enumerate(SLOT_RANK):
        As = [a[slot, s, :r] for s in range(3)]
        Bs = [bb[slot, o : o + n, :r] for o, n in ((0, 32), (32, 16), (48, 16))]
        m.load_adapter(slot, As, Bs)
    return m, x, _dequantized(fw, dtype), b, a, bb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_lora_linear_fp8_runs_the_gemv_with_and_without_adapters(dtype, monkeypatch):
    import moelora_lib.linear as lin

    m, x, deq, b, a, bb = _fp8_module(4, dtype)
    assert m.gemv_config_for(3).BLOCK_SIZE_K <= 32  # divides the scale block's 32 columns
    calls = []
    real = lin.dense_gemv_lora

    def counted(*p, **k):  # (T, with LoRA arguments)
        calls.append((p[0].shape[0], p[3] is not None))
        return real(*p, **k)

    monkeypatch.setattr(lin, "dense_gemv_lora", counted)
    for T in (1, 3, 6):
        ids = torch.tensor([(t % (L + 1)) - 1 for t in range(T)], dtype=torch.int32)
        y = m(x[:T], ids)
        ref = lora_linear_reference(x[:T], deq, a, bb, ids, slices=THREE, bias=b)
        assert rel_err(y, ref) <= TOLERANCES[dtype], (T, rel_err(y, ref))
        m.active_slots = frozenset()  # no LoRA launch: the base alone, still the GEMV up to T = 4
        y0 = m(x[:T], ids)
        m.active_slots = None
        base = lora_linear_reference(x[:T], deq, a, bb, torch.full_like(ids, -1), slices=THREE, bias=b)
        assert rel_err(y0, base) <= TOLERANCES[dtype], (T, rel_err(y0, base))
        if T <= 4:  # one kernel both ways: rows without an adapter agree bit for bit (one order on the CPU)
            assert torch.equal(y0[ids < 0], y[ids < 0])
    # T = 6 > 4: the weight-only GEMM (+ LoRA launches), no GEMV
    assert calls == [(1, True), (1, False), (3, True), (3, False)]


def test_lora_linear_fp8_gemv_follows_the_activation_scheme():
    m, *_ = _fp8_module(4, torch.float32)
    assert m.runs_gemv(2, False) and m.runs_gemv(2, True) and not m.runs_gemv(5, True)
    m.activation_scheme = "dynamic"  # W8A8 requested: the GEMV (a weight-only form) is not used
    assert not m.runs_gemv(2, True) and not m.runs_gemv(2, False)
    m.activation_scheme = "auto"  # weight-only at decode sizes
    assert m.runs_gemv(2, False)
    m.gemv_max_tokens = 0
    assert not m.runs_gemv(1, True)
    # a dense weight keeps F.linear for calls without LoRA launches
    d, *_ = _module(4)
    assert d.runs_gemv(2, True) and not d.runs_gemv(2, False)


_B32_LOAD = re.compile(r"ld\.global(?:\.(?!v\d)\w+)*\.b32 ")  # scalar 32-bit loads, not vectors


@pytest.mark.parametrize("split", ["split", "unsplit"])
@pytest.mark.parametrize("T", [1, 8])
def test_sm90_fp8_variant(compiled, T, split):
    r, d = compiled[f"T{T}/fp8_{split}"], compiled[f"T{T}/fp8dense_{split}"]
    p = r["ptx"]
    assert r["res"]["LOCAL"] == 0, r["res"]  # no local-memory spills
    assert "e4m3x2" in p, "the codes are not converted from e4m3"
    # the scales: one [BLOCK_SIZE_N] vector per K tile, a couple of scalar 32-bit loads per thread (the dense
    # weight at the same config has none of them), not one per weight element (64·BLOCK_SIZE_K / 128 threads)
    extra = len(_B32_LOAD.findall(p)) - len(_B32_LOAD.findall(d["ptx"]))
    assert 1 <= extra <= 4, extra
    if split == "split":  # the last-arriver reduction is the dense one's
        assert _ACQ_REL.search(p) and _RELAXED_ADD.search(p)


def test_lora_linear_modules_share_one_gemv_workspace_left_zero():
    # the split-K workspace lives in the shared scratch (one per sizes, counted by memory_report), not per
    # module; every call leaves it zero, so modules that run one after another can share it
    from moelora_lib.kernels.dense_gemv import DenseGemvWorkspace

    m1, x, w, b, a, bb = _module(2)
    m2 = _module(2)[0]
    ids = torch.tensor([1, 0], dtype=torch.int32)
    for m in (m1, m2, m1):
        y = m(x[:2], ids)
        assert rel_err(y, lora_linear_reference(x[:2], w, a, bb, ids, slices=THREE, bias=b)) <= 1e-5
    # the default config splits K at T = 2 on H = 96 (32-wide K tiles; T = 1 keeps 128-wide ones, one split
    # here): a workspace is used
    assert m1.gemv_config_for(2).SPLIT_K > 1
    assert m1._scratch is m2._scratch
    ws = [v for v in m1._scratch.workspaces.values() if isinstance(v, DenseGemvWorkspace)]
    assert len(ws) == 1 and _is_zero(ws[0])
    assert m1.memory_report()["scratch"] >= ws[0].partial.numel() * 4 + ws[0].counters.numel() * 4


# ---- strides, slot masks, the picker's bounds, a call cut short -------------------------------------------
@pytest.mark.parametrize("cfg", [c[1] for c in CONFIGS[:2]], ids=[c[0] for c in CONFIGS[:2]])
def test_strided_ids_and_bias_are_read_as_given(cfg):
    # views whose stride is not 1 (a column of a table, every other element, an expanded id): the kernel
    # reads them through their strides (the bias in both the unsplit and the last-arriver store), the
    # result is the contiguous inputs' one
    T, H = 4, 96
    x, w, b, a, bb, _ = _inputs(T, H, THREE, torch.float32)
    table = torch.tensor([[0, 9], [1, 9], [2, 9], [-1, 9]], dtype=torch.int32)
    big_bias = torch.stack([b, torch.full_like(b, 1e6)], dim=1)
    for ids, bias in ((table[:, 0], big_bias[:, 0]), (torch.tensor([2], dtype=torch.int32).expand(T), b)):
        assert not ids.is_contiguous() or not bias.is_contiguous()
        ref = lora_linear_reference(x, w, a, bb, ids.contiguous(), slices=THREE, bias=bias.contiguous())
        y = dense_gemv_lora(x, w, bias, a, bb, ids, slices=THREE, config=cfg)
        assert rel_err(y, ref) <= 1e-5


def test_slot_mask_gives_masked_slots_exactly_the_base():
    T, H, cfg = 4, 96, CONFIGS[0][1]
    x, w, b, a, bb, _ = _inputs(T, H, THREE, torch.float32)
    x[1, 5] = float("inf")  # an inf on a masked slot's token: the base's inf, never inf·0 = NaN
    ids = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    mask = torch.tensor([True, False, True])
    y = dense_gemv_lora(x, w, b, a, bb, ids, slices=THREE, config=cfg, slot_mask=mask)
    as_none = dense_gemv_lora(x, w, b, a, bb, torch.tensor([0, -1, -1, -1], dtype=torch.int32), slices=THREE,
                              config=cfg)  # fmt: skip
    assert torch.equal(y[~torch.isnan(as_none)], as_none[~torch.isnan(as_none)])
    assert not torch.isnan(y[1]).any() and torch.isinf(y[1]).any()


def test_picker_bounds_and_arguments():
    # SPLIT_K never above the config's 128, at T = 1 and above, whatever H (Llama-405B's 16384, larger)
    for T, N, H in ((4, 128, 16384), (1, 128, 65536), (2, 64, 1 << 20)):
        assert default_dense_gemv_config(T, N, H).SPLIT_K <= 128
    for bad in ((0,), (), (-64,), (100,), ("a",), 64):
        with pytest.raises(
            ValueError, match=r"slices (must be a non-empty tuple|\(100,\) must sum to N_total)"
        ):
            default_dense_gemv_config(1, 64, 96, slices=bad)
    with pytest.raises(ValueError, match="block_size_n must be an int >= 1"):
        dense_gemv_num_tiles((64,), 0)
    with pytest.raises(ValueError, match="device must be a torch.device"):
        dense_gemv_workspace(1, 64, 1, "nope")
    import numpy as np

    cfg = DenseGemvConfig(BLOCK_SIZE_N=np.int64(16), BLOCK_SIZE_K=np.int32(32), SPLIT_K=np.int64(2))
    assert all(type(v) is int for v in (cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, cfg.SPLIT_K))


def test_lora_linear_zeroes_the_workspace_when_a_call_is_cut_short(monkeypatch):
    # a GEMV call interrupted mid-kernel (possible under the interpreter) would leave partial sums and
    # counters in the shared workspace; the module zeroes it before the error propagates
    import moelora_lib.linear as lin

    m, x, w, b, a, bb = _module(2)
    ids = torch.tensor([1, 0], dtype=torch.int32)
    m(x[:2], ids)  # the workspace exists

    def cut_short(*args, workspace=None, **kw):
        workspace.partial.fill_(3.0)
        workspace.counters.fill_(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(lin, "dense_gemv_lora", cut_short)
    with pytest.raises(KeyboardInterrupt):
        m(x[:2], ids)
    monkeypatch.undo()
    from moelora_lib.kernels.dense_gemv import DenseGemvWorkspace as WS

    assert all(_is_zero(v) for v in m._scratch.workspaces.values() if isinstance(v, WS))
    y = m(x[:2], ids)
    assert rel_err(y, lora_linear_reference(x[:2], w, a, bb, ids, slices=THREE, bias=b)) <= 1e-5


def test_lora_linear_gemv_skips_slots_that_hold_no_adapter():
    m, x, w, b, a, bb = _module(1)
    m.unload_adapter(1)
    x1 = x[:1].clone()
    x1[0, 3] = float("inf")
    ids = torch.tensor([1], dtype=torch.int32)
    assert m.runs_gemv(1)
    y = m(x1, ids)
    base = torch.nn.functional.linear(x1.double(), w.double(), b.double())
    assert torch.equal(torch.isnan(y), torch.isnan(base)) and torch.equal(torch.isinf(y), torch.isinf(base))
    fin = torch.isfinite(base)
    assert rel_err(y[fin], base[fin]) <= 1e-5
