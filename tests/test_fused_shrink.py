"""Stage ``fused`` with ``LayerConfig.fuse_shrink``: each fused GEMM computes its rows' LoRA rank
intermediate itself (moelora_lib/kernels/triton_kernels.py, FUSE_SHRINK), so the two shrink launches are
not made.

CPU: the Triton interpreter in fp32 and fp16 at decode sizes (T = 1, 3, 16), against
stage ``fused`` without the switch (bit for bit: with the shrink's SPLIT_K = 1, the same K tile and the down
GEMM unsplit, the two paths add the same fp32 products in the same order, and the intermediate is fp32 in
both, unrounded before the expand; close otherwise) and against the fp32 reference; non-finite values in
one slot's A or B never reach another slot's rows; the launch plan; the config key through the file loader;
and, compiled for sm_90 (one subprocess), the switched-on kernels at GPT-OSS-20B and Qwen3-30B-A3B decode
shapes without spills.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sm90_helpers import run_sm90_script

import moelora_lib.kernels.stages as plan
from moelora_lib import STAGES, configs, fused_moe_lora
from moelora_lib.kernels import LayerConfig, OpConfig
from moelora_lib.kernels.route import route_triton
from moelora_lib.layer import MoELoRALayer
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_reference
from moelora_lib.shapes import Dims, MoEShape, get_shape
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs

ROOT = Path(__file__).resolve().parents[1]
TINY = get_shape("tiny")  # H 64, I 32, E 4, K 2, silu, S = 2
TINY_OSS = get_shape("tiny-oss")  # swigluoai, biases, S = 1
E7 = MoEShape("e7", 64, 48, 7, 3, 1)  # I = 48: the down shrink's K loop masked at BLOCK_SIZE_K 32
F32, F16 = torch.float32, torch.float16


def _cfg(bm=16, gu_n=16, dn_n=32, bk=32, shrink_sk=1, shrink_bk=32, down_sk=1):
    """Small tiles (several N tiles and K steps at the tiny shapes); the shrink's K tile is the fused
    shrink's K tile. ``fuse_shrink`` off: the caller switches it on."""
    base_gu, base_dn = OpConfig(bm, gu_n, bk, 4, 1, 4, 2), OpConfig(bm, dn_n, bk, 4, down_sk, 4, 2)
    shrink = OpConfig(16, 16, shrink_bk, 4, shrink_sk, 4, 2)
    expand = OpConfig(16, 32, 16, 1, 1, 4, 2)
    return LayerConfig(base_gu, base_dn, shrink, expand, shrink, expand)


def _inputs(shape, dtype, **kw):
    kw.setdefault("rank", 16)
    kw.setdefault("num_adapters", 3)
    kw.setdefault("pattern", "mixed")
    return make_inputs(shape, dtype=dtype, device="cpu", **kw)


def _both(inp, cfg):
    """(stage fused as shipped, the same with fuse_shrink) on the same inputs and tiles."""
    off = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    on = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg.replace(fuse_shrink=True))
    return off, on


# (id, shape, make_inputs kwargs, config, dtype, bit-identical to the switch off) — one comment per edge
CASES = [
    ("T1_silu_S2", TINY, dict(num_tokens=1, pattern="one"), _cfg(), F16, True),  # one decode token
    ("T3_oai_S1_bias", TINY_OSS, dict(num_tokens=3), _cfg(gu_n=32), F32, True),  # one slice, biases
    ("T16_oai_S2_straddle", TINY_OSS, dict(num_tokens=16, slices=2), _cfg(gu_n=32), F16, True),  # 2 slices
    ("T16_silu_S1", TINY, dict(num_tokens=16, slices=1), _cfg(gu_n=32), F32, True),  # gate, up: one shrink
    ("T3_rank24_in_R32", TINY, dict(num_tokens=3, rank=32, true_rank=24), _cfg(), F16, True),  # zero-padded
    ("T16_rank8_R16", TINY_OSS, dict(num_tokens=16, rank=8), _cfg(), F32, True),  # R < BLOCK_SIZE_R
    ("T16_E7_masked_k", E7, dict(num_tokens=16), _cfg(bk=32), F32, True),  # I = 48: masked shrink K loop
    ("T16_L8_zipf_bm32", TINY, dict(num_tokens=16, num_adapters=8, pattern="zipf"), _cfg(bm=32), F16, True),
    ("T3_all_minus1", TINY, dict(num_tokens=3, pattern="none"), _cfg(), F16, True),  # no LoRA row at all
    # the shrink launch split over K (its fp32 atomics add in another order): close, not bit-equal
    ("T16_shrink_split", TINY, dict(num_tokens=16), _cfg(shrink_sk=2), F32, False),
    # the down GEMM split over K: each split computes the intermediate over its own K tiles and adds that
    # part's delta (I = 32, BLOCK_SIZE_K 16: one tile each at 2 splits; at 4 two splits get none, so an
    # empty part, exact zeros); the parts add in another order than one sum: close, not bit-equal
    ("T3_down_split2", TINY_OSS, dict(num_tokens=3), _cfg(bk=16, down_sk=2), F16, False),
    ("T16_down_split4", TINY, dict(num_tokens=16), _cfg(bk=16, down_sk=4), F32, False),
    ("T16_E7_down_split2_masked", E7, dict(num_tokens=16), _cfg(bk=32, down_sk=2), F32, False),  # I = 32 + 16
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] + ("-fp32" if c[4] == F32 else "-fp16") for c in CASES])
def test_fuse_shrink_equals_fused_and_reference(case):
    _, shape, kw, cfg, dtype, exact = case
    inp = _inputs(shape, dtype, **kw)
    off, on = _both(inp, cfg)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    assert on.dtype == dtype and on.shape == ref.shape
    if exact:
        assert torch.equal(on, off)
    else:
        tol = 1e-5 if dtype == F32 else 2e-3
        assert_close_rel(on, off, tol=tol, what="fuse_shrink vs fused with the shrink launch")
    assert_close_rel(on, ref, dtype)


def test_rows_without_adapter_bit_identical_to_base():
    inp = _inputs(TINY_OSS, F16, num_tokens=16)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=_cfg().replace(fuse_shrink=True))
    with_lora = run().clone()
    base = run.base_part()
    none = inp.lora_ids == -1
    assert none.any() and (~none).any()
    assert torch.equal(with_lora[none], base[none])
    assert not torch.equal(with_lora[~none], base[~none])


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_non_finite_slot_reaches_its_own_rows_only(dtype):
    # slot 2 is used by no token: NaN in all of its A and B changes nothing (bit for bit); slot 1's A
    # of both projections made inf: slot 1's rows turn non-finite, every other row (slot 0, no adapter,
    # sharing tiles with slot 1 in the adapter-ordered alignment) is unchanged bit for bit
    inp = _inputs(TINY, dtype, num_tokens=16, num_adapters=3, pattern="uniform")
    inp.lora_ids[:] = torch.tensor([0, 1, -1, 1] * 4, dtype=inp.lora_ids.dtype)
    cfg = _cfg(bm=32).replace(fuse_shrink=True)
    clean = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    for t in (inp.lora_a13, inp.lora_b13, inp.lora_a2, inp.lora_b2):
        t[2] = float("nan")
    assert torch.equal(fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg), clean)
    inp.lora_a13[1, :, :, 0, 0] = float("inf")
    inp.lora_a2[1, :, 0, 0] = float("-inf")
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    one = inp.lora_ids == 1
    assert not torch.isfinite(out[one]).all(dim=1).any()
    assert torch.equal(out[~one], clean[~one])


def test_launch_plan_without_shrinks(monkeypatch):
    calls = []
    for name in ("lora_shrink_rows", "fused_moe_lora", "lora_shrink", "lora_expand", "gated_act"):
        real = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    inp = _inputs(TINY, F32, num_tokens=3)
    cfg = _cfg()
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    run()
    assert calls == ["lora_shrink_rows", "fused_moe_lora", "lora_shrink_rows", "fused_moe_lora"]
    calls.clear()
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=cfg.replace(fuse_shrink=True))
    out = run()
    assert calls == ["fused_moe_lora", "fused_moe_lora"]  # two launches fewer per layer
    # one launch alone and its compile-only description follow the switch: A read, no intermediate
    calls.clear()
    for op in ("fused_gate_up", "fused_down"):
        run.op_fn(op)()
        la = run.launch_args(op)
        assert la.constexprs["FUSE_SHRINK"]
        assert la.constexprs["BLOCK_SIZE_KS"] == cfg.gate_up_shrink.BLOCK_SIZE_K
    assert calls == ["fused_moe_lora", "fused_moe_lora"]
    assert torch.equal(run.reduce(), out)
    # switched off, the launch keeps its constexprs of before (no FUSE_SHRINK key at all)
    off = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    assert "FUSE_SHRINK" not in off.launch_args("fused_down").constexprs


@pytest.mark.parametrize("act,S,dtype", [("silu", 2, F32), ("swigluoai", 1, F16)], ids=["silu", "oai"])
def test_layer_partial_coverage_mixed_ranks_absent_slots(monkeypatch, act, S, dtype):
    # MoELoRALayer, fuse_shrink on: slot 0 gate_up only (rank 8), slot 1 down only (rank 4), slot 2 both
    # (rank 16), slot 3 never loaded; the projections a slot lacks are poisoned with NaN; ids -1, every
    # slot, and 3 (the absent slot): finite, equal to the layer without the switch, no shrink launch
    E, H, I, K, L, R = 4, 64, 32, 2, 4, 16
    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.1).to(dtype)

    cfg = _cfg(gu_n=32 if S == 1 else 16)
    w = dict(w13=rnd(E, 2 * I, H), w2=rnd(E, H, I), b13=rnd(E, 2 * I), b2=rnd(E, H))
    adapters = {
        0: dict(gate_up=(rnd(E, S, 8, H), rnd(E, S, 2 * I // S, 8))),
        1: dict(down=(rnd(E, 4, I), rnd(E, H, 4))),
        2: dict(gate_up=(rnd(E, S, R, H), rnd(E, S, 2 * I // S, R)), down=(rnd(E, R, I), rnd(E, H, R))),
    }
    layers = {}
    for fuse in (False, True):
        layer = MoELoRALayer(
            w["w13"], w["w2"], b13=w["b13"], b2=w["b2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=16,
            slices=S, activation=act, stage="fused", config=cfg.replace(fuse_shrink=fuse),
        )  # fmt: skip
        for slot, ad in adapters.items():
            layer.load_adapter(slot, **ad)
        layers[fuse] = layer
    ref_layer = layers[False]
    for t in (ref_layer.lora_a13, ref_layer.lora_b13, ref_layer.lora_a2, ref_layer.lora_b2):
        t[3] = float("nan")  # the absent slot: unread in either layer
    layer = layers[True]
    layer.lora_a2[0].fill_(float("nan"))
    layer.lora_b2[0].fill_(float("nan"))
    layer.lora_a13[1].fill_(float("nan"))
    layer.lora_b13[1].fill_(float("nan"))
    for t in (layer.lora_a13, layer.lora_b13, layer.lora_a2, layer.lora_b2):
        t[3] = float("nan")
    calls = []
    real = plan.lora_shrink_rows
    monkeypatch.setattr(plan, "lora_shrink_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    for T in (1, 3, 16):
        x, logits = rnd(T, H), torch.randn(T, E, generator=g)
        ids = (torch.arange(T) % (L + 1) - 1).to(torch.int32)  # -1, 0, 1, 2, 3 (absent), ...
        out = layer(x, logits, lora_ids=ids)
        assert calls == [], T
        want = ref_layer(x, logits, lora_ids=ids)
        assert calls == [1, 1], T  # the layer without the switch: its two shrink launches
        calls.clear()
        assert torch.isfinite(out).all(), T
        assert torch.equal(out, want), T
        tw, ti = route_triton(logits, K)
        a13, b13, a2, b2 = (t.clone() for t in (layer.lora_a13, layer.lora_b13, layer.lora_a2, layer.lora_b2))
        for t in (a13, b13, a2, b2):
            t[3] = 0
        a2[0], b2[0], a13[1], b13[1] = 0, 0, 0, 0  # what the reference reads for the uncovered parts
        args = (x, layer.w13, layer.w2, tw, ti, torch.where(ids == 3, -1, ids), a13, b13, a2, b2)
        ref = moe_lora_reference(*args, b13=layer.b13, b2=layer.b2, activation=act)
        assert_close_rel(out, ref, dtype)
    assert layer.config_for(1).fuse_shrink and not ref_layer.config_for(1).fuse_shrink


# ---- the config key ---------------------------------------------------------------------------------
DIMS = Dims.of("gpt-oss-20b", 1, rank=32, adapters=8)
_LEAF = {
    "fused_gate_up": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64},
    "fused_down": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "SPLIT_K": 8},
}


def test_config_key_round_trips_through_the_file(tmp_path):
    configs.clear_cache()
    data = configs.set_entry({}, configs.base_keys(DIMS), dict(_LEAF, fuse_shrink=True))
    data = configs.set_entry(data, configs.base_keys(Dims.of("gpt-oss-20b", 64, rank=32, adapters=8)), _LEAF)
    configs.save_config_file(tmp_path / configs.config_file_name("NVIDIA_H200", "fused"), data)
    with pytest.warns(configs.TunedConfigWarning):
        on = configs.load_fused_config(DIMS, folder=tmp_path, gpu_name="NVIDIA_H200")
    off = configs.load_fused_config(Dims.of("gpt-oss-20b", 64, rank=32, adapters=8), folder=tmp_path,
                                    gpu_name="NVIDIA_H200")  # fmt: skip
    assert on.fuse_shrink is True and off.fuse_shrink is False
    assert on.base_down.SPLIT_K == 8 and on.to_dict()["fuse_shrink"] is True
    assert on.short().endswith("fuse_shrink")
    assert "fuse_shrink" not in off.to_dict() and STAGES["fused"].adapt(on).fuse_shrink
    assert not STAGES["tuned"].adapt(on).fuse_shrink  # the seven-launch stages have no GEMM to hold it
    assert on.deterministic().fuse_shrink
    configs.clear_cache()


@pytest.mark.parametrize("bad", [1, "true", None, [True]])
def test_bad_config_key_is_named(tmp_path, bad):
    p = tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_FUSED.json"
    p.write_text(json.dumps(configs.set_entry({}, (32, 5760, 2880, 1), dict(_LEAF, fuse_shrink=bad))))
    with pytest.raises(ValueError, match=r"\[\"fuse_shrink\"\]: 'fuse_shrink' must be true or false"):
        configs.load_config_file(p, "fused")
    with pytest.raises(ValueError, match="LayerConfig.fuse_shrink must be a bool"):
        _cfg().replace(fuse_shrink=bad)


def test_shipped_configs_and_defaults_leave_it_off():
    configs.clear_cache()
    for model in ("gpt-oss-20b", "qwen3-30b-a3b"):
        for T in (1, 8, 64, 1600):
            d = Dims.of(model, T, rank=32, adapters=8)
            assert not configs.load_fused_config(d, gpu_name="NVIDIA_H200").fuse_shrink
            assert not STAGES["fused"].config_for(d).fuse_shrink


# ---- compile-only sm_90 ---------------------------------------------------------------------------------
_SM90_SCRIPT = r"""
import json
from moelora_lib.configs import load_fused_config
from moelora_lib.shapes import Dims
from moelora_lib.studies import compile_check as cc
out = []
for shape in ("gpt-oss-20b", "qwen3-30b-a3b"):
    sh = cc._shape(shape)
    for T in (1, 8):
        d = Dims.of(sh, T, rank=32, adapters=8)
        cfg = load_fused_config(d, gpu_name="NVIDIA_H200")  # the shipped decode tiles
        for fuse in (False, True):
            run = cc._fused_meta_run(d, activation=sh.activation, has_bias=sh.has_bias, dtype="bfloat16",
                                     config=cfg.replace(fuse_shrink=fuse))
            for op in ("fused_gate_up", "fused_down"):
                la = run.launch_args(op)
                assert bool(la.constexprs.get("FUSE_SHRINK")) == fuse
                k = cc._compile_launch(la)
                ru = cc.resource_usage(k)
                out.append(dict(shape=shape, T=T, op=op, fuse=fuse, cfg=la.cfg.short(),
                                KS=la.constexprs.get("BLOCK_SIZE_KS"), REG=ru["REG"], LOCAL=ru["LOCAL"],
                                smem=int(k.metadata.shared)))
print(json.dumps(out))
"""


def test_fused_shrink_compiles_for_sm90_without_spills():
    rows = run_sm90_script(_SM90_SCRIPT)
    assert len(rows) == 16
    print("\nsm_90 (shape, T, op, fuse_shrink): REG LOCAL smem cfg KS")
    for r in rows:
        print(f"  {r['shape']} T={r['T']} {r['op']} fuse={r['fuse']}: {r['REG']} {r['LOCAL']} {r['smem']} "
              f"{r['cfg']} {r['KS']}")  # fmt: skip
        assert r["LOCAL"] == 0 and 0 < r["REG"] <= 255 and r["smem"] <= 232448, r
