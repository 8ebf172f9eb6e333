"""Stage ``fused`` (moelora_lib/kernels/fused.py): the LoRA expand inside the base GEMMs, the activation in
the gate_up epilogue, the [P, S, R16] rank intermediate.

CPU: the Triton interpreter in fp32 and fp16 against the fp32 reference (the whole-layer curated cases of
tests/test_fused_moe_lora.py run this stage in fp32 on the edges CASES leaves out), the launch plan,
rows without an adapter bit-identical to the base, partial-projection adapters through MoELoRALayer, and
compile-only sm_90 facts (one subprocess): one binary per config over prompt lengths, vector stores of
the intermediate (against tuned's scalar ones), registers and spills.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import moelora_lib.kernels.stages as plan
from moelora_lib import STAGES, fused_moe_lora
from moelora_lib.kernels import LayerConfig, OpConfig
from moelora_lib.kernels.fused import fused_default_config
from moelora_lib.kernels.launchers import rank_stride
from moelora_lib.kernels.route import route_triton
from moelora_lib.kernels.stages import FUSED_LAUNCH_OPS, LAUNCH_OPS
from moelora_lib.layer import MoELoRALayer
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_reference
from moelora_lib.shapes import Dims, MoEShape, get_shape
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs

TINY = get_shape("tiny")  # H 64, I 32, E 4, K 2, silu, S = 2
TINY_OSS = get_shape("tiny-oss")  # swigluoai, biases, S = 1
E7 = MoEShape("e7", 64, 48, 7, 3, 1)  # I = 48: K of the down GEMM not a multiple of 32
DTYPES = [torch.float32, torch.float16]
DT_IDS = ["fp32", "fp16"]


def _inputs(shape, dtype, **kw):
    kw.setdefault("rank", 16)
    kw.setdefault("num_adapters", 3)
    kw.setdefault("pattern", "mixed")
    return make_inputs(shape, dtype=dtype, device=_device(), **kw)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(bm=16, gu_n=16, dn_n=32, bk=32, shrink_sk=2):
    """Small tiles so the tiny shapes take several N tiles, K iterations and (S = 2, swigluoai) a gate_up
    tile that straddles both slices (gu_n = 32: columns 2j, 2j + 1 for j < 32 cover h's [0, 64))."""
    base_gu, base_dn = OpConfig(bm, gu_n, bk, 4, 1, 4, 2), OpConfig(bm, dn_n, bk, 4, 1, 4, 2)
    shrink = OpConfig(16, 16, 32, 4, shrink_sk, 4, 2)
    expand = OpConfig(16, 32, 16, 1, 1, 4, 2)
    return LayerConfig(base_gu, base_dn, shrink, expand, shrink, expand)


F32, F16 = torch.float32, torch.float16
# (id, shape, make_inputs kwargs, config, dtype) — one comment per edge; each edge runs in one dtype
CASES = [
    ("T1", TINY, dict(num_tokens=1), None, F16),  # one decode token, default config
    ("T37_ragged", TINY, dict(num_tokens=37), None, F32),  # 74 pairs: not a multiple of BLOCK_SIZE_M
    ("swigluoai_S1_bias_clamp", TINY_OSS, dict(num_tokens=13, act_scale=12.0), None, F16),  # |pre-act| >> 7
    ("swigluoai_S2_straddle", TINY_OSS, dict(num_tokens=9, slices=2), _cfg(gu_n=32), F32),  # 2 slices/tile
    ("swigluoai_no_bias", TINY_OSS, dict(num_tokens=7, bias=False), _cfg(), F16),
    ("silu_bias_S2_tiles", TINY, dict(num_tokens=21, bias=True), _cfg(), F32),  # 2 N tiles, 2 K steps, SK 2
    ("silu_S1", TINY, dict(num_tokens=11, slices=1), _cfg(gu_n=32, shrink_sk=1), F16),
    ("rank8_in_tile16", TINY, dict(num_tokens=9, rank=8), None, F32),  # R < 16: R16 = 16, columns masked
    ("true_rank24_in_R32", TINY, dict(num_tokens=9, rank=32, true_rank=24), None, F16),  # zero-padded rank
    ("E7_K3_masked_k", E7, dict(num_tokens=19), _cfg(bk=32), F32),  # I = 48: the down GEMM's masked K loop
    ("all_minus1", TINY, dict(num_tokens=10, pattern="none"), None, F16),
    ("L8_zipf", TINY, dict(num_tokens=29, num_adapters=8, pattern="zipf"), _cfg(bm=32), F16),  # 8 per tile
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{DT_IDS[DTYPES.index(c[4])]}" for c in CASES])
def test_fused_matches_reference(case):
    _, shape, kw, cfg, dtype = case
    inp = _inputs(shape, dtype, **kw)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=cfg)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close_rel(out, ref, dtype)


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
def test_rows_without_adapter_equal_base_exactly(dtype):
    # mixed batch: rows of -1 tokens are bit-identical to this stage's base part (no LoRA term at all,
    # not a zero added after rounding); rows with an adapter differ
    inp = _inputs(TINY_OSS, dtype, num_tokens=23)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=_cfg())
    with_lora = run().clone()
    base_only = run.base_part()
    none = inp.lora_ids == -1
    assert none.any() and (~none).any()
    assert torch.equal(with_lora[none], base_only[none])
    assert not torch.equal(with_lora[~none], base_only[~none])


def test_launch_plan(monkeypatch):
    # four launches and the top-k sum: no expand, no activation, no unfused base GEMM, no h
    calls = []
    for name in (
        "lora_shrink_rows",
        "fused_moe_lora",
        "lora_shrink",
        "lora_expand",
        "gated_act",
        "fused_moe_gemm",
    ):
        real = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    inp = _inputs(TINY, torch.float32, num_tokens=5)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused")
    run()
    assert calls == ["lora_shrink_rows", "fused_moe_lora", "lora_shrink_rows", "fused_moe_lora"]
    assert run.h is None and STAGES["fused"].launch_ops == FUSED_LAUNCH_OPS
    assert STAGES["tuned"].launch_ops == LAUNCH_OPS and len(FUSED_LAUNCH_OPS) == 4
    calls.clear()
    run.base_part()
    assert calls == ["fused_moe_lora", "fused_moe_lora"]


def test_config_op_fn_and_launch_args():
    st = STAGES["fused"]
    d = Dims.of("gpt-oss-20b", 64, rank=32, adapters=8)
    c = st.config_for(d)
    assert c == fused_default_config(d) and c.source == "default:fused"
    assert c.base_gate_up.BLOCK_SIZE_N * 2 == plan.default_config(d).base_gate_up.BLOCK_SIZE_N
    inp = _inputs(TINY, torch.float32, num_tokens=6)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=_cfg())
    out = run().clone()
    for op in FUSED_LAUNCH_OPS:
        la = run.launch_args(op)
        assert la.kernel == plan.FUSED_LAUNCH_KERNELS[op] and la.cfg == getattr(
            run.cfg, plan.FUSED_CONFIG_FIELD[op]
        )
        res = run.op_fn(op)()
        if op.endswith("shrink"):
            S = 2 if op == "gate_up_shrink" else 1
            assert res.shape == (12, S, rank_stride(16)) and res.dtype == torch.float32
    assert torch.equal(run.reduce(), out)  # op_fn rewrote g and y with the same values
    with pytest.raises(ValueError, match="not separable"):
        run.lora_part()
    with pytest.raises(ValueError, match="op must be one of"):
        run.op_fn("gate_up_expand")


@pytest.mark.parametrize("act,S,dtype", [("silu", 2, F32), ("swigluoai", 1, F16)], ids=["silu", "oai"])
def test_layer_partial_coverage_and_equal_to_functional(act, S, dtype):
    # MoELoRALayer with stage fused: slot 0 covers gate_up only, slot 1 down only, slot 2 both; the
    # absent projections are poisoned with NaN (a fused GEMM that read them, or an unwritten row of the
    # intermediate, would give NaN); equals the public call (unpoisoned layer) and tuned within tolerance
    # (the layer groups rows into tiles by its active slots; the interpreter's dot may round a row
    # differently at another position in a tile, seen on an AMD EPYC's OpenBLAS)
    E, H, I, K, L, R = 4, 64, 32, 2, 3, 16
    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.1).to(dtype)

    layer = MoELoRALayer(
        rnd(E, 2 * I, H), rnd(E, H, I), b13=rnd(E, 2 * I), b2=rnd(E, H), top_k=K, num_adapters=L,
        max_rank=R, max_tokens=40, slices=S, activation=act, stage="fused",
    )  # fmt: skip
    layer.load_adapter(0, gate_up=(rnd(E, S, 8, H), rnd(E, S, 2 * I // S, 8)))
    layer.load_adapter(1, down=(rnd(E, 4, I), rnd(E, H, 4)))
    layer.load_adapter(
        2, gate_up=(rnd(E, S, R, H), rnd(E, S, 2 * I // S, R)), down=(rnd(E, R, I), rnd(E, H, R))
    )
    x, logits = rnd(33, H), torch.randn(33, E, generator=g)
    ids = (torch.arange(33) % (L + 1) - 1).to(torch.int32)
    tw, ti = route_triton(logits, K)  # the layer's routing
    args = (x, layer.w13, layer.w2, tw, ti, ids, layer.lora_a13, layer.lora_b13, layer.lora_a2, layer.lora_b2)
    kw = dict(b13=layer.b13, b2=layer.b2, activation=act)
    functional = fused_moe_lora(*args, **kw, stage="fused")
    tuned = fused_moe_lora(*args, **kw, stage="tuned")
    ref = moe_lora_reference(*args, **kw)
    layer.lora_a2[0].fill_(float("nan"))
    layer.lora_b2[0].fill_(float("nan"))
    layer.lora_a13[1].fill_(float("nan"))
    layer.lora_b13[1].fill_(float("nan"))
    out = layer(x, logits, lora_ids=ids)
    assert torch.isfinite(out).all()
    assert_close_rel(out, functional, dtype)
    assert_close_rel(out, ref, dtype)
    assert_close_rel(out, tuned.float(), dtype)


def test_layer_bad_adapter_ids_give_nan_rows_only():
    # ids unchecked in the serving layer: an adapter id ≥ L never indexes B (treated as no adapter in the
    # fused GEMMs); the top-k sum marks its row NaN; the other rows stay finite
    E, H, I, K, L = 4, 64, 32, 2, 3
    layer = MoELoRALayer(
        torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, top_k=K, num_adapters=L, max_rank=16,
        max_tokens=8, stage="fused",
    )  # fmt: skip
    layer.load_adapter(0, gate_up=(torch.randn(E, 2, 16, H), torch.randn(E, 2, I, 16)))
    out = layer(torch.randn(3, H), torch.randn(3, E), lora_ids=torch.tensor([0, L, -1], dtype=torch.int32))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


# ---- compile-only sm_90 -------------------------------------------------------------------------
LENGTHS = [1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 1000, 1024, 4096, 8192]


def swigluoai_min_max_ops() -> dict:
    """{launch: {"min_nan", "max_nan", "min", "max": count}} of the f32 min/max instructions in the sm_90
    PTX of the two launches that apply GPT-OSS's clamps: ``act`` (gated_act, the seven-launch stages) and
    ``fused_gate_up`` (its epilogue), at gpt-oss-20b, T = 64, default configs. Run in a process without
    the interpreter (:func:`~moelora_lib.studies.compile_check.run_isolated`)."""
    from moelora_lib.studies import compile_check as cc

    d = Dims.of(get_shape("gpt-oss-20b"), 64, rank=32, adapters=8)
    run = cc._fused_meta_run(
        d, activation="swigluoai", has_bias=True, dtype="bfloat16", config=fused_default_config(d)
    )
    ptx = {"fused_gate_up": cc.ptx(cc._compile_launch(run.launch_args("fused_gate_up")))}
    kernel, args, cx, nw, ns, _ = cc.launch("act", 64, shape="gpt-oss-20b")
    ptx["act"] = cc.ptx(cc.compile_for_sm90(cc._jit(kernel, False), args, cx, nw, ns))
    pats = {
        "min_nan": r"\bmin\.NaN\.f32",
        "max_nan": r"\bmax\.NaN\.f32",
        "min": r"\bmin\.f32",
        "max": r"\bmax\.f32",
    }
    return {op: {k: len(re.findall(p, text)) for k, p in pats.items()} for op, text in ptx.items()}


def fused_ptx_facts(fixed_T: int = 64) -> dict:
    """PTX facts of stage ``fused`` at gpt-oss-20b (R = 32, L = 8, bf16), compiled for sm_90: ``vec`` (per
    launch of FUSED_LAUNCH_OPS at ``fixed_T``'s config, T = LENGTHS[0]: ``ptx_text.global_vector_ops``),
    ``shrink_sk1`` (the gate_up shrink at SPLIT_K = 1, fused against tuned), ``fused_no_lora`` (the fused
    GEMMs without their LoRA part), ``expand_tuned`` (tuned's down expand) and ``split_down`` (``{"sk1"|"sk8":
    {"REG", "LOCAL", "grid", "atom_add_f32", "out_dtype"}}``). Run in a process without the interpreter."""
    from dataclasses import replace

    from moelora_lib.studies import compile_check as cc
    from tests.ptx_text import global_vector_ops

    sh, kw = get_shape("gpt-oss-20b"), dict(rank=32, adapters=8)

    def run_at(T, cfg):
        d = Dims.of(sh, int(T), **kw)
        return cc._fused_meta_run(
            d, activation=sh.activation, has_bias=sh.has_bias, dtype="bfloat16", config=cfg
        )

    def vec(k):
        return global_vector_ops(cc.ptx(k))

    def tuned(name, **more):
        kernel, *args, _ = cc.launch(name, fixed_T, shape=sh.name, **kw, **more)
        return cc.compile_for_sm90(cc._jit(kernel, False), *args)

    fixed = fused_default_config(Dims.of(sh, fixed_T, **kw))
    out: dict = {
        "vec": {
            op: vec(cc._compile_launch(run_at(LENGTHS[0], fixed).launch_args(op))) for op in FUSED_LAUNCH_OPS
        }
    }
    run = run_at(fixed_T, fixed)
    sk1 = replace(fixed.gate_up_shrink, SPLIT_K=1)
    new, old = cc._compile_launch(run.launch_args("gate_up_shrink", sk1)), tuned("gate_up_shrink", cfg=sk1)
    out["shrink_sk1"] = dict(fused=vec(new), tuned=vec(old))
    out["shrink_sk1"] |= dict(
        fused_reg=cc.resource_usage(new)["REG"], tuned_reg=cc.resource_usage(old)["REG"]
    )
    run.lora_align = run.lora_align_down = None  # the fused GEMMs without their LoRA part
    out["fused_no_lora"] = {
        op: vec(cc._compile_launch(run.launch_args(op))) for op in ("fused_gate_up", "fused_down")
    }
    # tuned's down expand (reads the [1, P, R] intermediate through do_not_specialize'd stride_is)
    out["expand_tuned"] = vec(tuned("down_expand"))
    # the down GEMM split over K against the same tile unsplit
    out["split_down"] = {}
    for sk in (1, 8):
        c = fused_default_config(Dims.of(sh, 1, **kw))
        c = c.replace(
            base_down=OpConfig(16, 128, 64, 1, sk, 4, 4),
            base_gate_up=replace(c.base_gate_up, BLOCK_SIZE_M=16),
        )
        la = run_at(1, c).launch_args("fused_down")  # args: x, w, out (y, or the fp32 y when split), ...
        k = cc._compile_launch(la)
        ru = cc.resource_usage(k)
        out["split_down"][f"sk{sk}"] = {
            "REG": ru["REG"],
            "LOCAL": ru["LOCAL"],
            "grid": int(la.grid[0]),
            "atom_add_f32": len(re.findall(r"\b(?:atom|red)\.[\w.]*add[\w.]*f32\b", cc.ptx(k))),
            "out_dtype": str(la.args[2].dtype),
        }
    return out


@pytest.fixture(scope="module")
def report():
    from moelora_lib.studies.compile_check import run_isolated

    t0 = time.perf_counter()
    jobs = [
        dict(op="fused_report", lengths=LENGTHS, shape="gpt-oss-20b"),
        dict(op="tests.test_stage_fused:swigluoai_min_max_ops"),
        dict(op="tests.test_stage_fused:fused_ptx_facts"),
    ]
    r, min_max, facts = run_isolated(jobs, timeout=300)
    r["swigluoai_min_max"] = min_max
    for op, v in facts.pop("vec").items():
        r[op]["vec"] = v
    r |= facts
    regs = {
        op: {T: (v["REG"], v["LOCAL"], v["cfg"]) for T, v in r[op]["res"].items()} for op in FUSED_LAUNCH_OPS
    }
    print(f"\nfused_report: {time.perf_counter() - t0:.1f} s; (REG, LOCAL, cfg) per T: {regs}")
    return r


@pytest.mark.parametrize("op", FUSED_LAUNCH_OPS)
def test_one_binary_over_lengths(report, op):
    # one fixed config: one cache key and one binary over 19 prompt lengths (1 … 8192)
    r = report[op]
    assert (r["keys"], r["hashes"]) == (1, 1), r


@pytest.mark.parametrize("op", FUSED_LAUNCH_OPS)
def test_no_spills_default_configs(report, op):
    # default configs at gpt-oss-20b shapes, T = 1 / 64 / 1600: no local memory (spills), ≤ 255 registers
    for T, v in report[op]["res"].items():
        assert v["LOCAL"] == 0 and 0 < v["REG"] <= 255, (op, T, v)


def test_rank_intermediate_vector_stores(report):
    # the no_recompile regression and its fix (docs/perf_notes.md), same config at SPLIT_K = 1: tuned's
    # shrink stores the [S, P, R] intermediate with scalar st.global.b32 (its slice stride is
    # do_not_specialize), the fused shrink stores [P, S, R16] with 16-byte st.global.v4 only
    s = report["shrink_sk1"]
    assert s["fused"]["st_v4"] >= 1 and s["fused"]["st_scalar"] == 0 and s["fused"]["st_v2"] == 0, s
    assert s["tuned"]["st_v4"] == 0 and s["tuned"]["st_scalar"] > 0, s


@pytest.mark.parametrize("op", ["fused_gate_up", "fused_down"])
def test_rank_intermediate_vector_loads(report, op):
    # the fused GEMMs read the intermediate (and B) with 16-byte async copies only: the LoRA part adds
    # cp.async of 16 bytes and no 4-byte ones; tuned's expand reads its intermediate 4 bytes at a time
    with_lora, without = report[op]["vec"], report["fused_no_lora"][op]
    assert with_lora.get("cp_async_16", 0) > without.get("cp_async_16", 0), (with_lora, without)
    assert not any(with_lora.get(f"cp_async_{b}", 0) for b in (4, 8)), with_lora
    assert report["expand_tuned"].get("cp_async_4", 0) > 0, report["expand_tuned"]


def test_swigluoai_clamps_propagate_nan(report):
    # GPT-OSS's clamps as torch's clamp: a NaN pre-activation stays NaN. The GPU's plain min.f32 /
    # max.f32 return the operand that is not NaN (a NaN gate would become 7.0); the interpreter's numpy
    # propagates NaN either way, so the CPU tests cannot tell, the PTX can
    for op, n in report["swigluoai_min_max"].items():
        assert n["min_nan"] >= 2 and n["max_nan"] >= 1 and n["min"] == 0 and n["max"] == 0, (op, n)


# ---- the down GEMM split over K at decode ---------------------------------------------------------------
def test_split_down_compiles_to_atomics(report):
    # SPLIT_K 8 on the down GEMM: 8× the programs, fp32 relaxed atomic adds into an fp32 y, no spills;
    # unsplit: plain stores into y of the activations' dtype
    s = report["split_down"]
    assert s["sk8"]["grid"] == 8 * s["sk1"]["grid"], s
    assert s["sk8"]["atom_add_f32"] >= 1 and s["sk1"]["atom_add_f32"] == 0, s
    assert s["sk8"]["LOCAL"] == 0 and s["sk1"]["LOCAL"] == 0, s
    assert s["sk8"]["out_dtype"] == "torch.float32" and s["sk1"]["out_dtype"] == "torch.bfloat16", s


@pytest.mark.parametrize(
    "shape,dtype,sk",
    [(TINY, F16, 4), (TINY_OSS, F32, 2)],
    ids=["silu-fp16-sk4", "swigluoai_bias-fp32-sk2"],
)
def test_split_down_matches_reference_and_unsplit(shape, dtype, sk):
    # the down GEMM with K split over 2 or 4 programs (I = 32, BLOCK_SIZE_K 16: 1 K block each at 2,
    # and at 4 two programs get none and add exact zeros): the LoRA delta and the bias once, every share
    # times the routing weight, one rounding in the top-k sum. One split per case (each split on one
    # shape; the kernel's split path is the same code at both): the interpreted layer runs ~10 times per split
    inp = _inputs(shape, dtype, num_tokens=13)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    cfg = _cfg(bk=16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    c = cfg.replace(base_down=OpConfig(16, 32, 16, 4, sk, 4, 2))
    assert not c.is_deterministic and c.deterministic().base_down.SPLIT_K == 1
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=c)
    one = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="fused", config=c, deterministic=True)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close_rel(out, ref, tol=tol, what=f"split-K {sk} down vs reference")
    assert_close_rel(out, one, tol=tol, what=f"split-K {sk} down vs SPLIT_K 1")
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=c)
    run()
    assert run._y32 is not None and run._y32.dtype == torch.float32
    # the base part alone (no LoRA) splits too; the stages without fused GEMMs never split the down GEMM
    base = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=c.deterministic())
    assert torch.equal(run.base_part(), run.base_part())  # 2 programs with work: fp32 atomics order-free
    assert_close_rel(run.base_part(), base.base_part(), tol=tol, what="split base part")
    assert make_layer_run(*inp.args(), **inp.kwargs(), stage="tuned", config=c).cfg.base_down.SPLIT_K == 1
    # one launch alone with a config that differs from the layer's (the tuner's path): both ways
    base.op_fn("fused_down", c.base_down)()
    run.op_fn("fused_down", cfg.base_down)()
    # a split gate_up (stage gemv's) is never launched by the tensor-core stages
    c = cfg.replace(base_gate_up=OpConfig(16, 16, 32, 4, 2, 4, 2))
    assert make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=c).cfg.base_gate_up.SPLIT_K == 1


def test_layer_split_down_buffer_and_cap(monkeypatch):
    # the serving layer with a config that splits the down GEMM: an fp32 y from its scratch (built once,
    # sized for SPLIT_DOWN_MAX_TOKENS), equal to the public call with the same config; above the cap the
    # layer runs the down GEMM unsplit (no larger buffer), also equal to the public call unsplit
    import moelora_lib.layer as layer_mod

    monkeypatch.setattr(layer_mod, "SPLIT_DOWN_MAX_TOKENS", 16)
    E, H, I, K, L, R = 4, 64, 32, 2, 3, 16
    g = torch.Generator().manual_seed(1)

    def rnd(*s):
        return torch.randn(*s, generator=g) * 0.1

    cfg = _cfg(bk=16).replace(base_down=OpConfig(16, 32, 16, 4, 2, 4, 2))
    layer = MoELoRALayer(
        rnd(E, 2 * I, H), rnd(E, H, I), top_k=K, num_adapters=L, max_rank=R, max_tokens=40, stage="fused",
        config=cfg,
    )  # fmt: skip
    layer.load_adapter(1, gate_up=(rnd(E, 2, R, H), rnd(E, 2, I, R)), down=(rnd(E, R, I), rnd(E, H, R)))
    for T, split in ((9, True), (30, False)):
        x, logits = rnd(T, H), torch.randn(T, E, generator=g)
        ids = (torch.arange(T) % (L + 1) - 1).to(torch.int32)
        tw, ti = route_triton(logits, K)
        args = (
            x,
            layer.w13,
            layer.w2,
            tw,
            ti,
            ids,
            layer.lora_a13,
            layer.lora_b13,
            layer.lora_a2,
            layer.lora_b2,
        )
        assert (layer.config_for(T).base_down.SPLIT_K > 1) == split
        want = fused_moe_lora(*args, stage="fused", config=layer.config_for(T))
        out = layer(x, logits, lora_ids=ids)
        assert_close_rel(out, want, torch.float32, what=f"T={T}")  # rows may share tiles differently
        assert_close_rel(out, moe_lora_reference(*args), torch.float32)
    y32 = layer._scratch.workspaces[("y32",)]
    assert y32.dtype == torch.float32 and y32.numel() == 16 * K * H
    assert layer.memory_report()["scratch"] >= y32.numel() * 4
    layer.deterministic = True
    assert layer.config_for(9).base_down.SPLIT_K == 1


def test_shipped_decode_config_splits_the_down_gemm_and_deterministic_clears_it():
    from moelora_lib.configs import load_fused_config

    for T, sk in ((1, 8), (8, 4), (64, 1)):
        c = load_fused_config(Dims.of("gpt-oss-20b", T, rank=32, adapters=8), gpu_name="NVIDIA_H200")
        assert c.base_down.SPLIT_K == sk, (T, c.base_down)
        det = c.deterministic()
        assert det.is_deterministic and det.base_down.SPLIT_K == 1
        assert det.base_gate_up == c.base_gate_up
