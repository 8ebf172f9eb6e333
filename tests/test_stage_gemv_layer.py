"""Stage gemv through the serving layer, the public call and stage auto (CPU interpreter, fp32/fp16).

The layer with stage "gemv" equals stage "tuned" within the tolerance table on curated cases: mixed
ranks, a slot covering one projection, -1 rows, ids of empty slots, MXFP4 experts; auto picks gemv where
the config file says so (and tuned above the pair limit); the public call runs it; bad ids give NaN rows.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moelora_lib import configs, fused_moe_lora
from moelora_lib.kernels import GEMV_STAGE, STAGES, OpConfig, stage_named
from moelora_lib.kernels.gemv import GEMV_MAX_PAIRS, GemvRun
from moelora_lib.layer import MoELoRALayer
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.quant import MXFP4Weight
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs

E, H, I, K, L, R = 4, 64, 32, 2, 3, 16


def _weights(dtype, S, activation, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=0.1):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    w = dict(w13=rnd(E, 2 * I, H), w2=rnd(E, H, I))
    if activation == "swigluoai":
        w.update(b13=rnd(E, 2 * I), b2=rnd(E, H))
    adapters = {  # slot 0 rank 8 both projections, slot 2 rank R gate_up only; slot 1 stays empty
        0: dict(gate_up=(rnd(E, S, 8, H), rnd(E, S, 2 * I // S, 8)), down=(rnd(E, 8, I), rnd(E, H, 8))),
        2: dict(gate_up=(rnd(E, S, R, H), rnd(E, S, 2 * I // S, R))),
    }
    return w, adapters, g


def _layers(w, adapters, S, activation, stages, **kw):
    out = {}
    for st in stages:
        layer = MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=64, slices=S,
                             b13=w.get("b13"), b2=w.get("b2"), activation=activation, stage=st,
                             **kw)  # fmt: skip
        for slot, ad in adapters.items():
            layer.load_adapter(slot, **ad)
        out[st] = layer
    return out


# each dtype and each (slices, activation) once, paired (the cross product repeated the same layer code)
@pytest.mark.parametrize(
    "dtype,S,activation",
    [(torch.float16, 2, "silu"), (torch.float32, 1, "swigluoai")],
    ids=["fp16-2-silu", "fp32-1-swigluoai"],
)
def test_layer_gemv_equals_tuned(dtype, S, activation):
    w, adapters, g = _weights(dtype, S, activation)
    layers = _layers(w, adapters, S, activation, ("gemv", "tuned"))
    gemv = layers["gemv"]
    assert gemv.stage is GEMV_STAGE and gemv.stage_for(5) is GEMV_STAGE
    # one token (its pairs read in place) and several (pairs in expert order; ids -1, 0, 1, 2 and repeats)
    for T in (1, 6):
        x = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
        logits = torch.randn(T, E, generator=g)
        ids = torch.tensor([t % (L + 1) - 1 for t in range(T)], dtype=torch.int32)  # -1, 0, 1 (empty), 2
        got = gemv(x, logits, lora_ids=ids)
        ref = layers["tuned"](x, logits, lora_ids=ids)
        assert got.dtype == dtype and got.shape == (T, H)
        assert_close_rel(got, ref, dtype=dtype, what=f"gemv vs tuned at T={T}")
        # restricted to no slot (the base-only graph variant): every row is the base MoE
        gemv.active_slots = frozenset()
        base = gemv(x, logits, lora_ids=torch.full_like(ids, -1))
        gemv.active_slots = None
        assert_close_rel(base, layers["tuned"](x, logits, lora_ids=torch.full_like(ids, -1)), dtype=dtype)


def test_layer_gemv_mxfp4_equals_dense():
    w, adapters, g = _weights(torch.float32, 1, "swigluoai")
    m13, m2 = MXFP4Weight.quantize(w["w13"]), MXFP4Weight.quantize(w["w2"])
    wd = dict(w, w13=m13.dequantize(torch.float32), w2=m2.dequantize(torch.float32))
    dense = _layers(wd, adapters, 1, "swigluoai", ("gemv",))["gemv"]
    packed = _layers(dict(w, w13=m13, w2=m2), adapters, 1, "swigluoai", ("gemv",), dtype=torch.float32)[
        "gemv"
    ]
    x = torch.randn(6, H, generator=g)
    logits = torch.randn(6, E, generator=g)
    ids = torch.tensor([0, -1, 2, 1, 0, 2], dtype=torch.int32)
    # the packed kernels decode exactly the dequantized values; they sum even and odd K apart, so the
    # fp32 rounding order differs from the dense GEMV's
    assert_close_rel(packed(x, logits, lora_ids=ids), dense(x, logits, lora_ids=ids), tol=1e-5)


def test_layer_gemv_bad_ids_nan_rows_and_pair_limit():
    w, adapters, g = _weights(torch.float32, 2, "silu")
    layer = _layers(w, adapters, 2, "silu", ("gemv",))["gemv"]
    x = torch.randn(4, H, generator=g)
    tw = torch.full((4, K), 0.5)
    ids = torch.tensor([[0, 1], [2, E], [1, 3], [0, 2]], dtype=torch.int32)
    lora = torch.tensor([0, 2, L + 1, -1], dtype=torch.int32)
    out = layer(x, topk_weights=tw, topk_ids=ids, lora_ids=lora)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[[0, 3]]).all()
    big = GEMV_MAX_PAIRS // K + 1
    layer_big = MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=big, slices=2,
                             stage="gemv")  # fmt: skip
    with pytest.raises(ValueError, match="stage 'gemv' takes at most"):
        layer_big(
            torch.zeros(big, H), torch.zeros(big, E), lora_ids=torch.full((big,), -1, dtype=torch.int32)
        )


def _dims(T: int) -> Dims:
    return Dims(T=T, H=H, I=I, E=E, top_k=K, adapters=L, rank=R, slices=2)


@pytest.fixture
def gemv_folder(tmp_path, monkeypatch):
    """A fused file choosing gemv at T bucket 1 (with its gemv configs), tuned at 16."""
    gemv_cfgs = {
        "gate_up": OpConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, SPLIT_K=2, NUM_WARPS=4).to_dict(),
        "down": OpConfig(BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, SPLIT_K=1, NUM_WARPS=2).to_dict(),
        "shrink": OpConfig(BLOCK_SIZE_K=32, SPLIT_K=2, NUM_WARPS=4).to_dict(),
    }
    leaf = {
        "fused_gate_up": OpConfig(16, 16, 32, 1, 1, 4, 2).to_dict(),
        "fused_down": OpConfig(16, 32, 32, 1, 1, 4, 2).to_dict(),
    }
    data: dict = {}
    configs.set_entry(data, configs.base_keys(_dims(1)), {**leaf, "stage": "gemv", "gemv": gemv_cfgs})
    configs.set_entry(data, configs.base_keys(_dims(16)), {**leaf, "stage": "tuned"})
    configs.save_config_file(tmp_path / configs.config_file_name(configs.gpu_name(), "fused"), data)
    monkeypatch.setenv(configs.ENV_VAR, str(tmp_path))
    configs.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", configs.TunedConfigWarning)
        yield tmp_path
    configs.clear_cache()


def test_auto_picks_gemv_from_the_file(gemv_folder):
    assert configs.load_stage_choice(_dims(1)) == "gemv"
    assert configs.load_stage_choice(_dims(3)) == "gemv"  # nearest bucket 1
    assert configs.load_stage_choice(_dims(16)) == "tuned"
    assert stage_named("auto", _dims(1)) is GEMV_STAGE
    # a T nearest to the gemv bucket but above the pair limit runs tuned
    big = Dims(T=GEMV_MAX_PAIRS, H=H, I=I, E=E, top_k=K, adapters=L, rank=R, slices=2)
    assert configs.load_stage_choice(big) == "tuned"
    cfg = configs.load_gemv_config(_dims(1))
    assert (
        cfg.base_gate_up.SPLIT_K == 2
        and cfg.base_down.BLOCK_SIZE_N == 16
        and cfg.source.endswith("gemv=file")
    )
    assert configs.load_fused_config(_dims(1)).source.endswith("fused=file")  # the gemv key is no field
    w, adapters, g = _weights(torch.float32, 2, "silu")
    layers = _layers(w, adapters, 2, "silu", ("auto", "gemv"))
    assert layers["auto"].stage_for(2) is GEMV_STAGE and layers["auto"].stage_for(16) is STAGES["tuned"]
    x = torch.randn(2, H, generator=g)
    logits = torch.randn(2, E, generator=g)
    ids = torch.tensor([0, 2], dtype=torch.int32)
    a = layers["auto"](x, logits, lora_ids=ids)
    assert_close_rel(a, layers["gemv"](x, logits, lora_ids=ids), tol=1e-5)
    # deterministic mode unsplits every launch of the gemv config
    det = _layers(w, adapters, 2, "silu", ("auto",), deterministic=True)["auto"]
    assert det.config_for(2).is_deterministic and det.config_for(2).base_gate_up.SPLIT_K == 1


def test_bad_gemv_leaf_names_the_key(tmp_path):
    leaf = {"fused_gate_up": OpConfig(16, 16, 32).to_dict(), "fused_down": OpConfig(16, 32, 32).to_dict()}
    for bad, match in (({**leaf, "stage": "gemv"}, "needs the leaf's 'gemv'"),
                       ({**leaf, "gemv": {"gate_up": {}}}, "must have exactly the keys")):  # fmt: skip
        data: dict = {}
        configs.set_entry(data, configs.base_keys(_dims(1)), bad)
        p = configs.save_config_file(tmp_path / configs.config_file_name("bad", "fused"), data)
        with pytest.raises(ValueError, match=match):
            configs.load_config_file(p, "fused")


def test_public_call_gemv():
    inp = make_inputs(get_shape("tiny"), num_tokens=5, rank=R, num_adapters=L, dtype=torch.float32)
    got = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="gemv")
    ref = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="tuned")
    assert_close_rel(got, ref, dtype=torch.float32)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="gemv")
    assert isinstance(run, GemvRun) and run.stage is GEMV_STAGE
    base = make_layer_run(*inp.args(), **inp.kwargs(), stage="tuned")
    assert_close_rel(run.base_part(), base.base_part(), dtype=torch.float32)


def test_write_gemv_configs_and_choices_from_csv(tmp_path):
    from moelora_lib.studies.fused_tuning import (
        stage_choices_from_csv,
        write_gemv_configs,
        write_stage_choices,
    )

    leaf = {"fused_gate_up": OpConfig(16, 16, 32).to_dict(), "fused_down": OpConfig(16, 32, 32).to_dict()}
    data: dict = {}
    for m in (1, 16):
        configs.set_entry(data, configs.base_keys(_dims(m)), dict(leaf))
    path = configs.save_config_file(tmp_path / configs.config_file_name("gpu", "fused"), data)
    csv = tmp_path / "rows.csv"
    lines = ["stage,T,H,I,E,part,variant,us_p50"]
    for T, times in ((1, dict(tuned=90, fused=85, gemv=60)), (16, dict(tuned=100, fused=101, gemv=100))):
        lines += [f"{st},{T},{H},{I},{E},total,as_anchor,{us}" for st, us in times.items()]
    csv.write_text("\n".join(lines) + "\n")
    choices = stage_choices_from_csv(csv)
    k1, k16 = configs.base_keys(_dims(1)), configs.base_keys(_dims(16))
    assert choices == {k1: "gemv", k16: "tuned"}  # a tie goes to the earlier stage
    with pytest.raises(ValueError, match="needs the leaf's 'gemv'"):  # a gemv choice needs its configs
        write_stage_choices(path, choices)
    g = {"gate_up": OpConfig(BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, SPLIT_K=2), "down": OpConfig(BLOCK_SIZE_N=16),
         "shrink": OpConfig(BLOCK_SIZE_K=32, SPLIT_K=4)}  # fmt: skip
    with pytest.raises(ValueError, match="gemv configs must be"):
        write_gemv_configs(path, {k1: {"gate_up": g["gate_up"]}})
    write_gemv_configs(path, {k1: g})
    write_stage_choices(path, choices)
    cfg = configs.load_gemv_config(_dims(1), folder=tmp_path, gpu_name="gpu")
    assert cfg.base_gate_up.SPLIT_K == 2 and cfg.gate_up_shrink.SPLIT_K == 4
    assert configs.load_stage_choice(_dims(1), folder=tmp_path, gpu_name="gpu") == "gemv"
    configs.clear_cache()
