"""Dense multi-LoRA linear (moelora_lib.lora_linear, moelora_lib.kernels.dense_lora) on the CPU
interpreter, against the fp64 reference; plus compile-only checks for sm_90 in a subprocess.

Every stage is checked on the same curated cases: T = 1; T below and not a multiple of BLOCK_SIZE_M;
GQA slice widths (q 64, k 16, v 16 with H = 64); one slice, two equal slices (gate_up) and three;
ranks 8, 16, 64; H = 72 (not EVEN_K for BLOCK_SIZE_K 64 or for 16·SPLIT_K 2); explicit configs with
SPLIT_K 2 and GROUP_SIZE_M 4 over several row blocks and column tiles (the default configs at these
small H never split K). Tokens with id -1 must come out bit for bit as F.linear's.
"""

from __future__ import annotations

import fractions
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moelora_lib.kernels import STAGES, OpConfig
from moelora_lib.kernels.dense_lora import DenseLoRAConfig, default_dense_config, dense_block_sizes_m
from moelora_lib.linear import LoRALinear, lora_linear, lora_linear_reference
from moelora_lib.routing import align_tokens
from moelora_lib.testing import assert_close_rel

DTYPES = [torch.float32, torch.float16]  # bf16: refused on the CPU (interpreter), see test below
L = 3

# name -> (T, H, slices, R, ids pattern, config or None)
CASES = {
    "T1": (1, 64, (64, 16, 16), 16, "mixed", None),
    "T37_gqa": (37, 64, (64, 16, 16), 16, "mixed", None),  # 37 < 3 blocks of 16, not a multiple
    "one_slice_r8": (21, 64, (96,), 8, "mixed", None),
    "gate_up_r64": (19, 64, (48, 48), 64, "mixed", None),
    "odd_H72": (29, 72, (64, 16, 16), 16, "mixed", None),  # 72 % 64 != 0: masked K loop
    "every_slot": (12, 64, (64, 16, 16), 16, "every", None),  # 0, 1, 2, -1, 0, 1, ...
    # SPLIT_K 2 (EVEN_K: 64 % 32 == 0), GROUP_SIZE_M 4, expand BLOCK_SIZE_N 16: 3 + 1 + 1 column tiles
    "splitk_swizzle": (
        45,
        64,
        (48, 16, 16),
        16,
        "mixed",
        DenseLoRAConfig(OpConfig(16, 16, 16, 4, 2, 4, 2), OpConfig(16, 16, 16, 4, 1, 4, 2)),
    ),
    # the same at H = 72: 72 % (16·2) != 0, masked split-K path; expand BLOCK_SIZE_K 32 > R = 16
    "splitk_odd_H72": (
        45,
        72,
        (48, 16, 16),
        16,
        "mixed",
        DenseLoRAConfig(OpConfig(16, 16, 16, 4, 2, 4, 2), OpConfig(16, 16, 32, 4, 1, 4, 2)),
    ),
}


def _inputs(T, H, slices, R, dt, ids="mixed", seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    N = sum(slices)
    x = torch.randn(T, H, generator=g).to(dt)
    w = (torch.randn(N, H, generator=g) * 0.1).to(dt)
    b = (torch.randn(N, generator=g) * 0.1).to(dt) if bias else None
    a = (torch.randn(L, len(slices), R, H, generator=g) * 0.1).to(dt)
    bb = (torch.randn(L, N, R, generator=g) * 0.1).to(dt)
    if ids == "mixed":
        lora_ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    elif ids == "every":
        lora_ids = (torch.arange(T) % (L + 1)).to(torch.int32)
        lora_ids[lora_ids == L] = -1
    else:  # "none"
        lora_ids = torch.full((T,), -1, dtype=torch.int32)
    return x, w, b, a, bb, lora_ids


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (also tells +0.0 from -0.0)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(it), b.view(it))


# ---- the reference -----------------------------------------------------------------------------
def test_reference_matches_token_loop():
    # the oracle (one adapter group at a time) against an independent per-token, per-slice loop
    x, w, b, a, bb, ids = _inputs(9, 24, (16, 8, 8), 4, torch.float32, "every")
    ref = lora_linear_reference(x, w, a, bb, ids, slices=(16, 8, 8), bias=b)
    loop = torch.zeros(9, 32, dtype=torch.float64)
    for t in range(9):
        xt = x[t].double()
        loop[t] = w.double() @ xt + b.double()
        if ids[t] >= 0:
            for s, (o, n) in enumerate(((0, 16), (16, 8), (24, 8))):
                loop[t, o : o + n] += bb[ids[t], o : o + n].double() @ (a[ids[t], s].double() @ xt)
    torch.testing.assert_close(ref, loop, rtol=1e-12, atol=1e-12)


# ---- alignment with E = 1, top_k = 1 -----------------------------------------------------------
@pytest.mark.parametrize("T", [1, 37])
def test_triton_alignments_accept_one_expert(T):
    # the module's one-launch and three-launch alignments with E = 1, K = 1 are the oracle's, bit for bit
    from moelora_lib.kernels.align import align_tokens_triton
    from moelora_lib.kernels.align_small import align_tokens_pair

    ids = torch.randint(-1, L, (T,), generator=torch.Generator().manual_seed(T), dtype=torch.int32)
    z = torch.zeros(T, 1, dtype=torch.int32)
    ref = align_tokens(z, 1, 16, lora_ids=ids, num_adapters=L, check_values=False)
    pair = align_tokens_pair(z, 1, 16, ids, L, 16)[1]
    multi = align_tokens_triton(z, 1, 16, lora_ids=ids, num_adapters=L)
    for al in (pair, multi):
        for f in ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded"):
            assert torch.equal(getattr(al, f), getattr(ref, f)), f


# ---- every stage against the reference ---------------------------------------------------------
#: every case on stage "tuned" (all switches on), and every stage on the case that takes every kernel
#: path (split K, grouped order, masked K loop, several column tiles) and at T = 1; both dtypes
STAGE_GRID = sorted(
    {("tuned", dt, c) for dt in DTYPES for c in CASES}
    | {(st, dt, "splitk_odd_H72") for st in STAGES for dt in DTYPES}
    | {(st, torch.float32, "T1") for st in STAGES},
    key=lambda p: (p[0], str(p[1]), p[2]),
)


@pytest.mark.parametrize("stage, dtype, case", STAGE_GRID, ids=lambda v: str(v).removeprefix("torch."))
def test_stage_matches_reference(stage, dtype, case):
    T, H, slices, R, pattern, cfg = CASES[case]
    x, w, b, a, bb, ids = _inputs(T, H, slices, R, dtype, pattern)
    out = lora_linear(x, w, a, bb, ids, slices=slices, bias=b, stage=stage, config=cfg)
    ref = lora_linear_reference(x, w, a, bb, ids, slices=slices, bias=b)
    assert out.shape == (T, sum(slices)) and out.dtype == dtype
    assert_close_rel(out, ref, dtype, what=f"{stage}/{case}")
    base = F.linear(x, w, b)
    none = ids < 0
    assert _same_bits(out[none], base[none])  # -1 tokens: exactly the base (fused add or -0.0 delta)


@pytest.mark.parametrize("stage", list(STAGES))
def test_all_no_adapter_is_f_linear_bit_for_bit(stage):
    x, w, b, a, bb, ids = _inputs(20, 64, (64, 16, 16), 16, torch.float16, "none")
    x[3] = -0.0  # a row of signed zeros in the base output: an add of +0.0 would flip -0.0 to +0.0
    out = lora_linear(x, w, a, bb, ids, slices=(64, 16, 16), stage=stage)
    assert _same_bits(out, F.linear(x, w))


DENSE_POISON = [(st, "nan", torch.float32) for st in STAGES] + [("tuned", "inf", torch.float16)]


@pytest.mark.parametrize("stage, value, dtype", DENSE_POISON, ids=lambda v: str(v).removeprefix("torch."))
def test_non_finite_adapter_weights_stay_in_their_slot(stage, value, dtype):
    # slot 1's lora_a and slot 2's lora_b hold a NaN/inf (rank 0 of every slice), slot 0 is finite:
    # rows of slots 1 and 2 are non-finite exactly where the fp64 reference is; rows of slot 0 are the
    # reference's and rows without adapter F.linear's bit for bit (split K, several column tiles)
    T, H, slices, R, _, cfg = CASES["splitk_odd_H72"]
    x, w, b, a, bb, ids = _inputs(15, H, slices, R, dtype, "every")
    starts = [sum(slices[:s]) for s in range(len(slices))]
    a[1, :, 0, 0] = float(value)
    bb[2, starts, 0] = float(value)
    out = lora_linear(x, w, a, bb, ids, slices=slices, bias=b, stage=stage, config=cfg)
    ref = lora_linear_reference(x, w, a, bb, ids, slices=slices, bias=b)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    for slot in (1, 2):
        assert not torch.isfinite(ref[ids == slot]).all()  # guards the case
    clean = ids == 0
    assert_close_rel(out[clean], ref[clean], dtype, what=f"{stage}: rows of the finite slot")
    none = ids < 0
    assert _same_bits(out[none], F.linear(x, w, b)[none])


def test_empty_batch():
    x, w, b, a, bb, ids = _inputs(0, 64, (64, 16, 16), 16, torch.float32)
    assert lora_linear(x, w, a, bb, ids, slices=(64, 16, 16), bias=b, stage="tuned").shape == (0, 96)


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
def test_fp16_rank_intermediate_beyond_fp16_range(stage):
    # x·Aᵀ ≈ 64·300·300 = 5.8e6 > 65 504 while the delta (B ~ 1e-4) fits fp16: kept in fp32, finite
    T, H, slices, R = 5, 64, (32,), 16
    x = torch.full((T, H), 300.0, dtype=torch.float16)
    w = torch.zeros(32, H, dtype=torch.float16)
    a = torch.full((L, 1, R, H), 300.0, dtype=torch.float16)
    bb = torch.full((L, 32, R), 1e-4, dtype=torch.float16)
    ids = torch.tensor([0, 1, -1, 2, 0], dtype=torch.int32)
    out = lora_linear(x, w, a, bb, ids, slices=slices, stage=stage)
    ref = lora_linear_reference(x, w, a, bb, ids, slices=slices)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, torch.float16)


def test_out_of_range_ids_unchecked_are_dropped():
    # check_values=False: ids outside [-1, L) are dropped by the alignment (no out-of-bounds access)
    x, w, b, a, bb, ids = _inputs(8, 64, (64, 16, 16), 16, torch.float32)
    ids[2], ids[5] = L, -7
    out = lora_linear(x, w, a, bb, ids, slices=(64, 16, 16), stage="tuned", check_values=False)
    ok = (ids >= -1) & (ids < L)
    ref = lora_linear_reference(x, w, a, bb, torch.where(ok, ids, -1), slices=(64, 16, 16))
    assert_close_rel(out[ok], ref[ok], torch.float32)


def test_strided_and_offset_views():
    # x a column slice of a wider buffer (row stride 2H) and lora_b an offset view (data pointer not
    # 16-byte aligned: copied once by aligned16, so the kernels keep one binary): same result
    T, H_, slices = 13, 64, (64, 16, 16)
    x, w, b, a, bb, ids = _inputs(T, H_, slices, 16, torch.float32)
    wide = torch.zeros(T, 2 * H_)
    wide[:, H_:] = x
    buf = torch.zeros(bb.numel() + 1)
    bb_off = buf[1:].view(bb.shape)
    bb_off.copy_(bb)
    assert bb_off.data_ptr() % 16
    out = lora_linear(wide[:, H_:], w, a, bb_off, ids, slices=slices, bias=b, stage="tuned")
    ref = lora_linear(x, w, a, bb, ids, slices=slices, bias=b, stage="tuned")
    assert torch.equal(out, ref)


# ---- configs -----------------------------------------------------------------------------------
def test_default_config_buckets_and_block_sizes():
    qkv = dict(hidden=2880, slices=(4096, 512, 512), rank=32, adapters=8)
    c1, c8k = default_dense_config(1, **qkv), default_dense_config(8192, **qkv)
    assert (c1.block_size_m, c8k.block_size_m) == (16, 64)
    assert c1.shrink.SPLIT_K == 8 and c8k.shrink.SPLIT_K == 2  # ~2 programs per SM: decode splits more
    assert c1.shrink.BLOCK_SIZE_N == 128 and c1.expand.BLOCK_SIZE_K == 32
    assert dense_block_sizes_m(8192, 8) == (16, 32, 64) and dense_block_sizes_m(100, 8) == (16,)
    for T in (1, 128, 129, 384, 385, 8192):
        assert default_dense_config(T, **qkv).block_size_m in dense_block_sizes_m(8192, 8)
    with pytest.raises(ValueError, match="BLOCK_SIZE_M"):
        DenseLoRAConfig(OpConfig(16), OpConfig(32))
    with pytest.raises(ValueError, match="SPLIT_K"):
        DenseLoRAConfig(OpConfig(16), OpConfig(16, SPLIT_K=2))


# ---- bad inputs --------------------------------------------------------------------------------
def _bad(name):
    x, w, b, a, bb, ids = _inputs(6, 64, (64, 16, 16), 16, torch.float32)
    kw = dict(x=x, weight=w, lora_a=a, lora_b=bb, lora_ids=ids, slices=(64, 16, 16), bias=b)
    if name == "x_1d":
        kw["x"] = x[0]
    elif name == "x_int":
        kw["x"] = x.long()
    elif name == "x_bf16_cpu":
        kw.update({k: kw[k].bfloat16() for k in ("x", "weight", "lora_a", "lora_b", "bias")})
    elif name == "x_H":  # weight and lora_a agree on H = 64: x is the one named
        kw["x"] = torch.randn(6, 65)
    elif name == "weight_H":
        kw["weight"] = w[:, :32]
    elif name == "weight_dtype":
        kw["weight"] = w.half()
    elif name == "slices_sum":
        kw["slices"] = (64, 16, 8)
    elif name == "slices_type":
        kw["slices"] = (64, 16.0, 16)
    elif name == "lora_a_S":
        kw["lora_a"] = a[:, :2]
    elif name == "lora_a_H":
        kw["lora_a"] = a[..., :32]
    elif name == "rank_mismatch":
        kw["lora_b"] = bb[..., :8]
    elif name == "lora_b_L":
        kw["lora_b"] = bb[:2]
    elif name == "lora_b_N":
        kw["lora_b"] = bb[:, :90]
    elif name == "ids_dtype":
        kw["lora_ids"] = ids.short()
    elif name == "ids_T":
        kw["lora_ids"] = ids[:5]
    elif name == "ids_range":
        kw["lora_ids"] = ids.clone().fill_(L)
    elif name == "ids_below":
        kw["lora_ids"] = ids.clone().fill_(-2)
    elif name == "bias_shape":
        kw["bias"] = b[:10]
    elif name == "device":
        kw["lora_b"] = bb.to("meta")
    return kw


BAD = {
    "x_1d": "x must be a 2-D tensor",
    "x_int": "x dtype must be",
    "x_bf16_cpu": "bfloat16 is not supported on the CPU",
    "x_H": r"^x must have shape \[T, H=64\] \(weight's in_features\), got \(6, 65\)$",
    "weight_H": r"weight must have shape \[N_total=96, H=64\]",
    "weight_dtype": "weight must have dtype torch.float32",
    "slices_sum": "slices .* must sum to N_total",
    "slices_type": "slices must be a non-empty tuple",
    "lora_a_S": r"lora_a: S \(dim 1\) = 2 must equal",
    "lora_a_H": r"lora_a must have shape \[L=3, S=3, R=16, H=64\]",
    "rank_mismatch": r"lora_b: rank R \(dim 2\) = 8 must equal lora_a's R",
    "lora_b_L": r"lora_b must have shape \[L=3",
    "lora_b_N": r"lora_b must have shape .*N_total=96",
    "ids_dtype": r"lora_ids must have dtype in \['torch.int32', 'torch.int64'\], got torch.int16$",
    "ids_T": r"lora_ids must have shape \[T=6\]",
    "ids_range": r"lora_ids values must be in \[-1, L=3\)",
    "ids_below": r"lora_ids values must be in \[-1, L=3\)",
    "bias_shape": r"bias must have shape \[N_total=96\]",
    "device": "lora_b must be on cpu",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_name_the_argument(name):
    kw = _bad(name)
    with pytest.raises(ValueError, match=BAD[name]):
        lora_linear(
            kw.pop("x"), kw.pop("weight"), kw.pop("lora_a"), kw.pop("lora_b"), kw.pop("lora_ids"), **kw
        )


def test_bad_stage_and_config():
    x, w, b, a, bb, ids = _inputs(4, 64, (96,), 8, torch.float32)
    with pytest.raises(ValueError, match="stage must be one of"):
        lora_linear(x, w, a[:, :1], bb, ids, slices=(96,), stage="fast")
    with pytest.raises(ValueError, match="config must be a DenseLoRAConfig"):
        lora_linear(x, w, a[:, :1], bb, ids, slices=(96,), config=OpConfig())


# ---- the module --------------------------------------------------------------------------------
H, SLICES, R = 64, (64, 16, 16), 16


def _adapter(r, seed, dt=torch.float16, slices=SLICES):
    g = torch.Generator().manual_seed(seed)
    A = [(torch.randn(r, H, generator=g) * 0.1).to(dt) for _ in slices]
    B = [(torch.randn(n, r, generator=g) * 0.1).to(dt) for n in slices]
    return A, B


def _padded(adapters: dict):
    """The [L, S, R, H] / [L, N, R] float64 tensors of {slot: (A list, B list, per-slice scalings)},
    built independently of the module (None slices stay zero)."""
    a = torch.zeros(L, len(SLICES), R, H, dtype=torch.float64)
    b = torch.zeros(L, sum(SLICES), R, dtype=torch.float64)
    for slot, (As, Bs, sc) in adapters.items():
        o = 0
        for s, n in enumerate(SLICES):
            if As[s] is not None:
                r = As[s].shape[0]
                a[slot, s, :r] = As[s].double()
                b[slot, o : o + n, :r] = Bs[s].double() * sc[s]
            o += n
    return a, b


def _module(stage="tuned", dt=torch.float16, max_tokens=48, **kw):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(sum(SLICES), H, generator=g) * 0.1).to(dt)
    b = (torch.randn(sum(SLICES), generator=g) * 0.1).to(dt)
    return LoRALinear(
        w, b, slices=SLICES, num_adapters=L, max_rank=R, max_tokens=max_tokens, stage=stage, **kw
    )


@pytest.mark.parametrize("stage", ["naive", "split_k", "tuned"])
def test_module_load_unload_rank_change(stage):
    m = _module(stage)
    g = torch.Generator().manual_seed(3)
    T = 29
    x = torch.randn(T, H, generator=g).half()
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    base = F.linear(x, m.weight, m.bias)
    assert _same_bits(m(x, ids), base)  # nothing loaded: F.linear only

    def check(adapters):
        a, b = _padded(adapters)
        ref = lora_linear_reference(x, m.weight, a, b, ids, slices=SLICES, bias=m.bias)
        out = m(x, ids)
        assert_close_rel(out, ref, torch.float16)
        empty = ~torch.isin(ids, torch.tensor(m.loaded_slots, dtype=torch.int32))
        assert _same_bits(out[empty], base[empty])  # -1 and empty slots: exactly the base
        # bit for bit the functional op on the module's own slot tensors, for the loaded slots
        ids_f = torch.where(empty, -1, ids).to(torch.int32)
        f = lora_linear(x, m.weight, m.lora_a, m.lora_b, ids_f, slices=SLICES, bias=m.bias, stage=stage)
        assert torch.equal(out, f)

    A16, B16 = _adapter(16, 1)
    m.load_adapter(0, A16, B16, scaling=0.5)
    check({0: (A16, B16, [0.5] * 3)})
    A8, B8 = _adapter(8, 2)  # rank 8 in an R = 16 slot, replacing a rank-16 adapter
    m.load_adapter(0, A8, B8, scaling=2.0)
    assert (m.lora_a[0, :, 8:] == 0).all() and (m.lora_b[0, :, 8:] == 0).all()
    Aq, Bq = _adapter(4, 5)  # a q/v-only adapter (PEFT's default target_modules), per-slice scaling
    Aq[1] = Bq[1] = None
    m.load_adapter(2, Aq, Bq, scaling=[1.0, 1.0, 3.0])
    check({0: (A8, B8, [2.0] * 3), 2: (Aq, Bq, [1.0, 1.0, 3.0])})
    assert (m.lora_a[2, 1] == 0).all() and (m.lora_b[2, 64:80] == 0).all()  # k slice: none
    m.unload_adapter(0)
    m.unload_adapter(2)
    assert m.loaded_slots == [] and _same_bits(m(x, ids), base)


def test_module_all_slots_loaded_and_compile():
    m = _module("even_k_fused_add")
    for slot in range(L):
        A, B = _adapter(16 if slot else 8, 10 + slot)
        m.load_adapter(slot, A, B)
    x = torch.randn(1, H).half()
    ids = torch.tensor([2], dtype=torch.int32)
    eager = m(x, ids)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")  # custom op + its fake
    assert torch.equal(compiled(x, ids), eager)
    x2 = torch.randn(33, H).half()
    ids2 = (torch.arange(33) % (L + 1) - 1).to(torch.int32)
    assert torch.equal(compiled(x2, ids2), m(x2, ids2))
    rep = m.memory_report()
    assert rep["adapter_slots"] == (L * 3 * R * H + L * 96 * R) * 2 + L and rep["scratch"] > 0


def test_module_errors():
    m = _module()
    A, B = _adapter(8, 1)
    with pytest.raises(ValueError, match="slot must be an int"):
        m.load_adapter(3, A, B)
    with pytest.raises(ValueError, match="rank r = 32 must be in"):
        m.load_adapter(0, *_adapter(32, 1))
    with pytest.raises(ValueError, match=r"lora_b\[1\] must have shape \[N_s, r\] = \(16, 8\)"):
        m.load_adapter(0, A, [B[0], B[0], B[2]])
    with pytest.raises(ValueError, match="list of S = 3 entries"):
        m.load_adapter(0, A[:2], B[:2])
    with pytest.raises(ValueError, match="both be tensors or both None"):
        m.load_adapter(0, [A[0], None, A[2]], B)
    with pytest.raises(ValueError, match="scaling must be a finite real number"):
        m.load_adapter(0, A, B, scaling=float("inf"))
    with pytest.raises(ValueError, match=r"scaling\[1\] must be a finite real number .*got nan"):
        m.load_adapter(0, A, B, scaling=[1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="scaling must be one real number or a list of S = 3"):
        m.load_adapter(0, A, B, scaling=[1.0, 2.0])
    assert m.loaded_slots == [] and (m.lora_a == 0).all()  # nothing written by a failed load
    with pytest.raises(ValueError, match="exceeds the layer's max_tokens = 48"):
        m(torch.zeros(49, H).half(), torch.zeros(49, dtype=torch.int32))
    with pytest.raises(ValueError, match="lora_ids must be an int32/int64 tensor"):
        m(torch.zeros(4, H).half(), torch.zeros(4, dtype=torch.int16))
    with pytest.raises(ValueError, match="x must be torch.float16"):
        m(torch.zeros(4, H), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="slices .* must sum to N_total"):
        LoRALinear(m.weight, slices=(64, 16), num_adapters=L, max_rank=R, max_tokens=8)
    dbg = _module(debug=True)
    with pytest.raises(ValueError, match="lora_ids values must be in"):
        dbg(torch.zeros(2, H).half(), torch.tensor([0, 5], dtype=torch.int32))


# ---- compile-only (sm_90) in a subprocess without TRITON_INTERPRET -----------------------------
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json
    from dataclasses import replace
    import torch
    from moelora_lib.kernels import STAGES, OpConfig
    from moelora_lib.kernels.dense_lora import (
        DENSE_KERNELS, DenseLoRAConfig, adapt_dense_config, default_dense_config, dense_launches)
    from moelora_lib.routing import align_tokens
    from moelora_lib.studies.compile_check import (
        compile_for_sm90, ptx, resource_usage, specialization_key)
    from tests.ptx_text import has_atomic_add, tensor_core_ops

    H, SLICES, R, L = 2048, (4096, 512, 512), 32, 8   # Qwen3-30B-A3B qkv (GQA), bf16
    LENGTHS = [1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 1000, 1024, 4096, 8192]
    FIXED = DenseLoRAConfig(OpConfig(32, 128, 64, 8, 4, 4, 3), OpConfig(32, 64, 32, 8, 1, 4, 2))
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, b = torch.empty(L, len(SLICES), R, H, **meta), torch.empty(L, sum(SLICES), R, **meta)
    META = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")

    def launches(stage, T, cfg):
        ids = (torch.arange(T) % (L + 1) - 1).to(torch.int32)
        al = align_tokens(torch.zeros(T, 1, dtype=torch.int32), 1, cfg.block_size_m, lora_ids=ids,
                          num_adapters=L, check_values=False)
        al = replace(al, **{f: getattr(al, f).to("meta") for f in META})
        x, out = torch.empty(T, H, **meta), torch.empty(T, sum(SLICES), **meta)
        return dense_launches(stage, x, a, b, out, al, cfg, slices=SLICES)

    res = {}
    for name, st in STAGES.items():
        for mode in ("fixed", "auto"):  # one config for every T / default_dense_config(T)
            keys, cfgs = {}, {"dense_shrink": set(), "dense_expand": set()}
            for T in LENGTHS:
                cfg = FIXED if mode == "fixed" else default_dense_config(
                    T, hidden=H, slices=SLICES, rank=R, adapters=L)
                c = adapt_dense_config(st, cfg)
                cfgs["dense_shrink"].add(c.shrink)
                cfgs["dense_expand"].add(c.expand)
                for ln in launches(st, T, cfg):
                    jf = DENSE_KERNELS[ln.kernel][st.specialize_lengths]
                    k = specialization_key(jf, ln.args, ln.constexprs, ln.num_warps, ln.num_stages)
                    keys.setdefault(ln.kernel, {}).setdefault(k, ln)
            res[f"{name}/{mode}"] = {kn: (len(v), len(cfgs[kn])) for kn, v in keys.items()}
            if mode == "fixed" and name in ("no_recompile", "even_k_fused_add"):
                for kn, v in keys.items():
                    (ln,) = v.values()
                    c = compile_for_sm90(DENSE_KERNELS[kn][False], ln.args, ln.constexprs,
                                         ln.num_warps, ln.num_stages)
                    res[f"{name}/{kn}"] = dict(
                        atomic=has_atomic_add(ptx(c)), tc=tensor_core_ops(ptx(c)), res=resource_usage(c),
                        bf16="bf16" in ptx(c), EVEN_K=ln.constexprs["EVEN_K"])
    print(json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def compiled():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"\ndense compile-only subprocess: {time.perf_counter() - t0:.1f} s")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "naive"])
def test_one_variant_per_config_over_19_lengths(compiled, stage):
    # do_not_specialize on num_tokens / num_blocks: one key per kernel for a fixed config over 19 lengths
    # (values: [keys, distinct configs])
    r = compiled[f"{stage}/fixed"]
    assert r == {"dense_shrink": [1, 1], "dense_expand": [1, 1]}, r
    # with the default config per T (as the layer picks it): exactly one key per distinct config
    r = compiled[f"{stage}/auto"]
    assert r["dense_shrink"][1] >= 2, r
    assert all(keys == n_cfg for keys, n_cfg in r.values()), r


def test_naive_recompiles(compiled):
    # Triton's default specialization (== 1, % 16 on num_tokens / num_blocks): several binaries per config
    r = compiled["naive/fixed"]
    assert r["dense_shrink"][0] > 1 and r["dense_expand"][0] > 1, r


def test_compiled_kernels_sm90(compiled):
    # both kernels build for sm_90 with bf16 tensor-core dots and no spills; the split-K shrink
    # (even_k_fused_add keeps SPLIT_K 4) adds with relaxed atomics, no_recompile's (SPLIT_K 1) stores
    for name in ("no_recompile", "even_k_fused_add"):
        for kn in ("dense_shrink", "dense_expand"):
            r = compiled[f"{name}/{kn}"]
            assert r["tc"]["mma_sync"] + r["tc"]["wgmma"] > 0 and r["bf16"], (name, kn, r)
            assert r["res"]["LOCAL"] == 0, (name, kn, r["res"])
    sk = compiled["even_k_fused_add/dense_shrink"]
    assert (
        sk["atomic"]["ptx_atomic_add"] > 0 and sk["atomic"]["ptx_relaxed"] == sk["atomic"]["ptx_atomic_add"]
    )
    assert sk["EVEN_K"] is True  # 2048 % (64·4) == 0
    assert compiled["no_recompile/dense_shrink"]["atomic"]["ptx_atomic_add"] == 0
    assert compiled["no_recompile/dense_shrink"]["EVEN_K"] is False  # stage without even_k


# --- found by a new-user trial of the dense module: each case kept as a test -------------------------
def _trial_module(**kw):
    from moelora_lib.linear import LoRALinear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g) * 0.1
    m = LoRALinear(
        w, None, slices=(64, 16, 16), num_adapters=3, max_rank=8, max_tokens=8, stage="naive", **kw
    )
    a = [torch.randn(8, 64, generator=g) * 0.1 for _ in range(3)]
    b = [torch.randn(n, 8, generator=g) * 0.1 for n in (64, 16, 16)]
    return m, a, b


def test_trial_module_dtype_after_to_copy_pickle_and_load_checks():
    import copy
    import io

    x = torch.randn(5, 64)
    ids = torch.tensor([0, 1, -1, 2, 0], dtype=torch.int32)
    m, a, b = _trial_module()
    m.load_adapter(0, a, b, scaling=2.0)
    want = m(x, ids)
    with pytest.raises(ValueError, match="bfloat16 is not supported on the CPU"):
        copy.deepcopy(m).to(torch.bfloat16)(x.bfloat16(), ids)
    with pytest.raises(ValueError, match="must be float16, bfloat16 or float32, got torch.float64"):
        copy.deepcopy(m).to(torch.float64)(x.double(), ids)
    c = copy.deepcopy(m)
    assert c.layer_name != m.layer_name
    c.unload_adapter(0)
    assert not torch.equal(c(x, ids), want) and torch.equal(m(x, ids), want)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x, ids), want)
    with pytest.raises(ValueError, match=r"x must be torch.float32 on cpu .*meta"):
        m(x.to("meta"), ids.to("meta"))
    m16, a16, b16 = _trial_module()
    m16 = m16.half()
    with pytest.raises(
        ValueError, match=r"lora_b\[0\]·scaling .* not finite in the layer's dtype torch.float16"
    ):
        m16.load_adapter(
            0, [t.half() for t in a16], [torch.full_like(t, 1000.0).half() for t in b16], scaling=100.0
        )
    with pytest.raises(ValueError, match=r"lora_a\[0\] is not finite"):
        m16.load_adapter(0, [torch.full_like(t, float("nan")) for t in a16], b16)
    assert m16.loaded_slots == []


def test_module_keeps_weight_and_bias_not_copied():
    """As documented: the layer aliases the caller's weight and bias."""
    w, b = torch.randn(96, H).half(), torch.randn(96).half()
    m = LoRALinear(w, b, slices=SLICES, num_adapters=L, max_rank=R, max_tokens=8)
    assert m.weight.data_ptr() == w.data_ptr() and m.bias.data_ptr() == b.data_ptr()
    w.zero_()  # a change by the caller is the layer's
    assert not m.weight.any()


@pytest.mark.parametrize(
    "scaling",
    [
        2,
        2.0,
        np.float32(2.0),
        np.float64(2.0),
        np.int64(2),
        torch.tensor(2.0),
        torch.tensor(2, dtype=torch.int32),
        fractions.Fraction(2, 1),
        [np.float32(2.0), torch.tensor(2.0), fractions.Fraction(4, 2)],  # one per slice, mixed kinds
    ],
    ids=repr,
)
def test_load_adapter_accepts_any_finite_real_scaling(scaling):
    """Every finite real scalar kind (Python, numpy, numbers.Real, 0-d tensor) scales B like 2.0 does."""
    m, ref = _module(), _module()
    A, B = _adapter(8, 1)
    ref.load_adapter(0, A, B, scaling=2.0)
    m.load_adapter(0, A, B, scaling=scaling)
    assert torch.equal(m.lora_a, ref.lora_a) and torch.equal(m.lora_b, ref.lora_b)


@pytest.mark.parametrize(
    "scaling",
    [True, 1 + 2j, torch.tensor([2.0]), torch.tensor(True), torch.tensor(2.0, device="meta"), "2.0", None,
     np.float32("inf"), torch.tensor(float("nan")), 10**400],
    ids=repr,
)  # fmt: skip
def test_load_adapter_refuses_non_real_or_non_finite_scaling(scaling):
    """The message names scaling and lists the accepted kinds; nothing is written."""
    m = _module()
    with pytest.raises(
        ValueError, match=r"scaling must be a finite real number \(a Python int or float, a numpy"
    ):
        m.load_adapter(0, *_adapter(8, 1), scaling=scaling)
    assert m.loaded_slots == [] and not m.lora_b.any()


def test_trial_functional_meta_and_requires_grad_refused():
    from moelora_lib.linear import lora_linear

    x = torch.randn(3, 64)
    w = torch.randn(96, 64)
    la = torch.randn(2, 3, 8, 64)
    lb = torch.randn(2, 96, 8)
    ids = torch.tensor([0, -1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="x is on meta"):
        lora_linear(x.to("meta"), w, la, lb, ids, slices=(64, 16, 16), check_values=False)
    with pytest.raises(ValueError, match="^x requires grad: moelora_lib is inference only; call under"):
        lora_linear(x.requires_grad_(), w, la, lb, ids, slices=(64, 16, 16))
    with pytest.raises(ValueError, match="^lora_b requires grad: .*or pass a detached tensor$"):
        lora_linear(x.detach(), w, la, lb.requires_grad_(), ids, slices=(64, 16, 16))
    with torch.no_grad():
        assert lora_linear(x, w, la, lb, ids, slices=(64, 16, 16)).shape == (3, 96)
    with torch.inference_mode():
        assert lora_linear(x, w, la, lb, ids, slices=(64, 16, 16)).shape == (3, 96)


def test_module_forward_refuses_x_that_requires_grad():
    """The output would carry no gradient (the custom op has none): refused unless grad mode is off."""
    m = _module()
    m.load_adapter(0, *_adapter(8, 1))
    x, ids = torch.randn(3, H).half().requires_grad_(), torch.tensor([0, -1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="^x requires grad: moelora_lib is inference only"):
        m(x, ids)
    with torch.no_grad():
        want = m(x, ids)
    assert torch.equal(m(x.detach(), ids), want)


def test_package_names_are_the_function_and_the_class_in_any_import_order():
    """``moelora_lib.lora_linear`` is the function, also after the module defining it was imported."""
    import types

    import moelora_lib
    import moelora_lib.linear as module
    from moelora_lib import LoRALinear, lora_linear

    assert lora_linear is module.lora_linear and not isinstance(lora_linear, types.ModuleType)
    assert LoRALinear is module.LoRALinear and moelora_lib.lora_linear is module.lora_linear


def test_lora_ids_int64_accepted_like_int32():
    x, w, b, a, bb, ids = _inputs(13, 64, (64, 16, 16), 16, torch.float32)
    ref = lora_linear(x, w, a, bb, ids, slices=(64, 16, 16), bias=b)
    assert _same_bits(lora_linear(x, w, a, bb, ids.long(), slices=(64, 16, 16), bias=b), ref)
    m = _module(dt=torch.float32)
    m.load_adapter(1, *_adapter(8, 1, dt=torch.float32))
    xm = x.float()
    assert _same_bits(m(xm, ids.long()), m(xm, ids))
    with pytest.raises(ValueError, match=r"^lora_ids must be an int32/int64 tensor \[T=13\]"):
        m(xm, ids.to(torch.uint8))


def test_module_takes_an_nn_linear_weight_that_requires_grad_and_freezes_it():
    lin = torch.nn.Linear(32, 24).half()
    m = LoRALinear(lin.weight, lin.bias, num_adapters=2, max_rank=4, max_tokens=8)
    assert not m.weight.requires_grad and not m.bias.requires_grad
    x, ids = torch.randn(3, 32).half(), torch.tensor([0, -1, 1], dtype=torch.int32)
    with torch.no_grad():
        ref = lin(x)
    assert torch.equal(m(x, ids), ref)  # empty slots: exactly the base


def test_stage_set_after_construction_runs_that_stage():
    m = _module("tuned", dt=torch.float32)
    A, B = _adapter(8, 5, dt=torch.float32)
    m.load_adapter(1, A, B)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, H, generator=g)
    ids = torch.randint(-1, L, (13,), generator=g, dtype=torch.int32)
    m(x, ids)
    for name in ("naive", "split_k", "tuned"):
        m.stage = name
        other = _module(name, dt=torch.float32)
        other.load_adapter(1, A, B)
        assert m.stage.name == name and torch.equal(m(x, ids), other(x, ids)), name
    for bad in ("auto", "fastest", None):
        with pytest.raises(ValueError, match="stage must be one of"):
            m.stage = bad
    assert m.stage.name == "tuned"
