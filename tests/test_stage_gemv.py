"""Stage gemv's kernels (moelora_lib/kernels/gemv.py) against the fp32 reference, on the CPU interpreter.

fp32 and fp16 activations (bf16 is wrong under the interpreter), dense and MXFP4 weights, silu and
swigluoai (biases, interleaved gate/up), 1 and 2 slices, K tails (H, I not multiples of BLOCK_SIZE_K),
SPLIT_K 1 and > 1 (the down shrink inside an unsplit gate_up GEMV, or a launch of its own), mixed adapter
ids with -1 and absent slots, a projection without LoRA, bad ids.
"""

from __future__ import annotations

import pytest
import torch

from moelora_lib.configs.schema import LayerConfig, OpConfig
from moelora_lib.kernels.gemv import GEMV_MAX_PAIRS, GEMV_MAX_SHRINK_SPLIT, gemv_moe_lora, gemv_scratch_numel
from moelora_lib.quant import MXFP4Weight
from moelora_lib.reference import moe_lora_reference
from moelora_lib.testing import assert_close_rel


def _cfg(gu=(32, 32, 1, 4), dn=(32, 32, 1, 4), sh=(32, 1, 4)) -> LayerConfig:
    return LayerConfig(
        base_gate_up=OpConfig(BLOCK_SIZE_N=gu[0], BLOCK_SIZE_K=gu[1], SPLIT_K=gu[2], NUM_WARPS=gu[3]),
        base_down=OpConfig(BLOCK_SIZE_N=dn[0], BLOCK_SIZE_K=dn[1], SPLIT_K=dn[2], NUM_WARPS=dn[3]),
        gate_up_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
        down_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
        gate_up_expand=OpConfig(),
        down_expand=OpConfig(),
    )


def _case(E, H, I, K, T, act, bias, S, L, R, dtype, mxfp4, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    w13, w2 = rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)
    m13 = m2 = None
    if mxfp4:  # the dense weights are the exact dequantization of the packed ones
        m13, m2 = MXFP4Weight.quantize(w13), MXFP4Weight.quantize(w2)
        w13, w2 = m13.dequantize(torch.float32), m2.dequantize(torch.float32)
    c = dict(
        x=rnd(T, H).to(dtype),
        w13=w13.to(dtype),
        w2=w2.to(dtype),
        b13=rnd(E, 2 * I).to(dtype) if bias else None,
        b2=rnd(E, H).to(dtype) if bias else None,
        ids=torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32),
        tw=torch.rand(T, K, generator=g),
        a13=rnd(L, E, S, R, H, scale=H**-0.5).to(dtype),
        bl13=rnd(L, E, S, 2 * I // S, R, scale=0.3).to(dtype),
        a2=rnd(L, E, R, I, scale=I**-0.5).to(dtype),
        bl2=rnd(L, E, H, R, scale=0.3).to(dtype),
        m13=m13,
        m2=m2,
    )
    # -1 (no adapter), every slot, and ids of slots the caller holds nothing in are all covered by T ≥ L + 1
    c["lids"] = torch.tensor([t % (L + 1) - 1 for t in range(T)], dtype=torch.int32)
    return c


def _ref(c, act, lids13=None, lids2=None):
    """The fp32 reference; per-projection ids by zeroing the other projection's B for a second call."""
    return moe_lora_reference(
        c["x"], c["w13"], c["w2"], c["tw"], c["ids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"],
        activation=act, b13=c["b13"], b2=c["b2"],
    )  # fmt: skip


CASES = [  # E, H, I, K, T, activation, bias, S, L, R
    (4, 96, 64, 2, 5, "swigluoai", True, 1, 3, 16),
    (6, 64, 96, 3, 4, "silu", False, 2, 2, 16),
]
CONFIGS = [
    _cfg(),
    _cfg(gu=(16, 64, 2, 4), dn=(64, 32, 2, 2), sh=(64, 2, 2)),  # split K, tails of K in every op
]


# every case with both weight formats and both dtypes, each (format, dtype) pair once (the full cross
# product ran the same kernels twice over)
@pytest.mark.parametrize(
    "case,mxfp4,dtype",
    [
        (CASES[0], False, torch.float32),
        (CASES[0], True, torch.float16),
        (CASES[1], False, torch.float16),
        (CASES[1], True, torch.float32),
    ],
    ids=[
        "swigluoai-bias-S1-dense-fp32",
        "swigluoai-bias-S1-mxfp4-fp16",
        "silu-S2-dense-fp16",
        "silu-S2-mxfp4-fp32",
    ],
)
def test_gemv_matches_reference(case, mxfp4, dtype):
    E, H, I, K, T, act, bias, S, L, R = case
    c = _case(E, H, I, K, T, act, bias, S, L, R, dtype, mxfp4)
    ref = _ref(c, act)
    w13 = c["m13"] if mxfp4 else c["w13"]
    w2 = c["m2"] if mxfp4 else c["w2"]
    for cfg in CONFIGS:
        out = gemv_moe_lora(
            c["x"], w13, w2, c["tw"], c["ids"], activation=act, config=cfg, b13=c["b13"], b2=c["b2"],
            lora_ids=c["lids"], lora=(c["lids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"]),
        )  # fmt: skip
        assert out.dtype == dtype and out.shape == (T, H)
        assert_close_rel(out, ref, dtype=dtype, what=f"gemv {cfg.base_gate_up.short()} vs reference")


def test_gemv_base_only_and_one_projection():
    # no LoRA at all equals the reference with no adapter; LoRA on down only equals the reference with the
    # gate_up B zeroed (a slot that covers one projection)
    E, H, I, K, T, act, bias, S, L, R = CASES[0]
    c = _case(E, H, I, K, T, act, bias, S, L, R, torch.float32, False)
    none = torch.full_like(c["lids"], -1)
    base = gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=CONFIGS[1],
                         b13=c["b13"], b2=c["b2"])  # fmt: skip
    ref0 = _ref(dict(c, lids=none), act)
    assert_close_rel(base, ref0, what="base only")
    down_only = gemv_moe_lora(
        c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=CONFIGS[0], b13=c["b13"],
        b2=c["b2"], lora_ids=c["lids"], lora=(None, c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"]),
    )  # fmt: skip
    ref_d = _ref(dict(c, bl13=torch.zeros_like(c["bl13"])), act)
    assert_close_rel(down_only, ref_d, what="down LoRA only")
    gate_up_only = gemv_moe_lora(
        c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=CONFIGS[0], b13=c["b13"],
        b2=c["b2"], lora_ids=c["lids"], lora=(c["lids"], None, c["a13"], c["bl13"], c["a2"], c["bl2"]),
    )  # fmt: skip
    ref_g = _ref(dict(c, bl2=torch.zeros_like(c["bl2"])), act)
    assert_close_rel(gate_up_only, ref_g, what="gate_up LoRA only")


def test_gemv_split_k_is_close_to_unsplit_and_single_split_is_deterministic():
    E, H, I, K, T, act, bias, S, L, R = CASES[1]
    c = _case(E, H, I, K, T, act, bias, S, L, R, torch.float32, False, seed=3)
    args = (c["x"], c["w13"], c["w2"], c["tw"], c["ids"])
    kw = dict(activation=act, b13=c["b13"], b2=c["b2"], lora_ids=c["lids"],
              lora=(c["lids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"]))  # fmt: skip
    one = gemv_moe_lora(*args, config=_cfg(), **kw)
    assert torch.equal(one, gemv_moe_lora(*args, config=_cfg(), **kw))
    split = gemv_moe_lora(*args, config=_cfg(gu=(32, 32, 4, 4), dn=(32, 32, 4, 4), sh=(32, 4, 4)), **kw)
    assert_close_rel(split, one, tol=1e-5, what="SPLIT_K 4 vs 1")


def test_gemv_bad_ids_give_nan_rows_only_there():
    # an expert id outside [0, E) or an adapter id outside [-1, L): that token's row is NaN, the other rows
    # equal the call without the bad token's ids (no out-of-bounds read, nothing leaks across rows)
    E, H, I, K, T, act, bias, S, L, R = CASES[0]
    c = _case(E, H, I, K, T, act, bias, S, L, R, torch.float32, False)
    lora = (c["lids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"])
    kw = dict(activation=act, config=CONFIGS[1], b13=c["b13"], b2=c["b2"])
    good = gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], lora_ids=c["lids"], lora=lora, **kw)
    ids = c["ids"].clone()
    ids[1, 0] = E + 5
    ids[3, 1] = -2
    lids = c["lids"].clone()
    lids[2] = L + 7
    out = gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], ids, lora_ids=lids,
                        lora=(lids, lids) + lora[2:], **kw)  # fmt: skip
    bad = torch.tensor([1, 2, 3])
    assert torch.isnan(out[bad]).all()
    keep = torch.tensor([0, 4])
    assert torch.equal(out[keep], good[keep])


def test_gemv_one_token():
    # T = 1 reads its pairs in place (no expert order): the reference with an adapter and without one,
    # both configs; a bad expert id gives that single row NaN
    E, H, I, K, _, act, bias, S, L, R = CASES[0]
    c = _case(E, H, I, K, 1, act, bias, S, L, R, torch.float32, False)
    for lid in (1, -1):
        c["lids"] = torch.tensor([lid], dtype=torch.int32)
        ref = _ref(c, act)
        lora = (c["lids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"])
        for cfg in CONFIGS:
            out = gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=cfg,
                                b13=c["b13"], b2=c["b2"], lora_ids=c["lids"], lora=lora)  # fmt: skip
            assert_close_rel(out, ref, dtype=torch.float32, what=f"gemv T=1 adapter {lid}")
    ids = c["ids"].clone()
    ids[0, 1] = E
    out = gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], ids, activation=act, config=CONFIGS[0],
                        b13=c["b13"], b2=c["b2"])  # fmt: skip
    assert torch.isnan(out).all()


def test_gemv_refuses():
    E, H, I, K, T, act, bias, S, L, R = CASES[0]
    c = _case(E, H, I, K, T, act, bias, S, L, R, torch.float32, True)
    with pytest.raises(ValueError, match="BLOCK_SIZE_K must be a multiple of 32"):
        gemv_moe_lora(c["x"], c["m13"], c["m2"], c["tw"], c["ids"], activation=act,
                      config=_cfg(gu=(32, 16, 1, 4)), b13=c["b13"], b2=c["b2"])  # fmt: skip
    with pytest.raises(ValueError, match="scratch must hold at least"):
        gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=_cfg(),
                      b13=c["b13"], b2=c["b2"], scratch=torch.empty(7))  # fmt: skip
    big = GEMV_MAX_PAIRS // K + 1
    x = torch.zeros(big, H)
    ids = torch.zeros(big, K, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most"):
        gemv_moe_lora(x, c["w13"], c["w2"], torch.ones(big, K), ids, activation=act, config=_cfg())
    with pytest.raises(ValueError, match="gate_up_shrink.SPLIT_K must be at most"):
        too_split = _cfg(sh=(32, 2 * GEMV_MAX_SHRINK_SPLIT, 4))
        gemv_moe_lora(c["x"], c["w13"], c["w2"], c["tw"], c["ids"], activation=act, config=too_split,
                      b13=c["b13"], b2=c["b2"], lora_ids=c["lids"],
                      lora=(c["lids"], c["lids"], c["a13"], c["bl13"], c["a2"], c["bl2"]))  # fmt: skip
    assert gemv_scratch_numel(T, K, H, I, S, R, 1) == T * K * (2 * I + H + S * R + R)
    assert gemv_scratch_numel(T, K, H, I, S, R) == T * K * (2 * I + H + S * GEMV_MAX_SHRINK_SPLIT * R + R)
