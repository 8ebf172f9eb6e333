"""Deterministic mode: ``deterministic=True`` runs every split-K shrink with SPLIT_K = 1.

The shrinks' split-K partial sums meet in relaxed fp32 atomic adds whose order the GPU picks, so a split-K
result can change in the last bits from call to call; with SPLIT_K = 1 each output element comes from one
program in a fixed order. On the CPU (Triton interpreter) the checks are: the configs the mode launches
(functional calls, make_layer_run, MoELoRALayer, lora_linear, LoRALinear; the shipped H200 tuned configs,
which do split K), the output equal bit for bit to an explicit SPLIT_K = 1 config and to itself on a repeat,
close to the fp32 reference, and the flag's bad input. Whether the GPU's split-K output differs between
calls, and what the mode costs there, is for the GPU (not measured yet).
"""

from __future__ import annotations

import pytest
import torch

from moelora_lib import fused_moe_lora
from moelora_lib.configs import load_layer_config
from moelora_lib.kernels import STAGES, LayerConfig, OpConfig, default_config
from moelora_lib.kernels.dense_lora import DenseLoRAConfig
from moelora_lib.layer import MoELoRALayer
from moelora_lib.linear import LoRALinear, lora_linear, lora_linear_reference
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_reference
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs

SPLIT = 4  # tiny: H = 64, I = 32 -> BLOCK_SIZE_K 16 gives 4 (gate_up) and 2 (down) K blocks per split


def _dims(inp) -> Dims:
    return Dims.from_tensors(inp.hidden_states, inp.w2, inp.topk_ids, inp.lora_a13)


def _split_config(dims: Dims) -> LayerConfig:
    """The default config with the shrinks split over K (tiny's defaults do not split)."""
    cfg = default_config(dims)
    sh = dict(BLOCK_SIZE_K=16)
    return cfg.replace(
        gate_up_shrink=OpConfig(**{**cfg.gate_up_shrink.to_dict(), **sh, "SPLIT_K": SPLIT}),
        down_shrink=OpConfig(**{**cfg.down_shrink.to_dict(), **sh, "SPLIT_K": 2}),
        source="test:split",
    )


def test_layer_config_deterministic_sets_split_k_1_and_keeps_the_rest():
    for name in ("gpt-oss-20b", "qwen3-30b-a3b"):
        for T in (1, 64, 1600):
            dims = Dims.of(name, T, rank=32, adapters=8)
            for cfg in (default_config(dims), load_layer_config(dims, gpu_name="NVIDIA_H200")):
                det = cfg.deterministic()
                assert det.is_deterministic
                assert det.gate_up_shrink.SPLIT_K == det.down_shrink.SPLIT_K == 1
                for op in ("base_gate_up", "base_down", "gate_up_expand", "down_expand"):
                    assert getattr(det, op) == getattr(cfg, op)
                for op in ("gate_up_shrink", "down_shrink"):
                    a, b = getattr(det, op).to_dict(), getattr(cfg, op).to_dict()
                    a.pop("SPLIT_K"), b.pop("SPLIT_K")
                    assert a == b
                assert det.deterministic() is det
                if cfg.is_deterministic:
                    assert det is cfg
                else:
                    assert det.source == cfg.source + "+deterministic"
    # the shipped tuned configs do split K somewhere, so the mode changes what runs
    tuned = [
        load_layer_config(Dims.of(n, T, rank=32, adapters=8), gpu_name="NVIDIA_H200")
        for n in ("gpt-oss-20b", "qwen3-30b-a3b")
        for T in (1, 8, 64)
    ]
    assert any(not c.is_deterministic for c in tuned)


def test_dense_config_deterministic():
    cfg = DenseLoRAConfig(OpConfig(SPLIT_K=4), OpConfig(), source="x")
    det = cfg.deterministic()
    assert det.is_deterministic and det.shrink.SPLIT_K == 1 and det.expand == cfg.expand
    assert det.source == "x+deterministic" and det.deterministic() is det
    assert not cfg.is_deterministic


@pytest.mark.parametrize("stage,preset", [("split_k", "tiny"), ("tuned", "tiny-oss"), ("fused", "tiny")])
def test_functional_deterministic_equals_split_k_1_bitwise(stage, preset):
    T = 24
    inp = make_inputs(get_shape(preset), T, rank=16, num_adapters=4, dtype=torch.float32, device="cpu")
    dims = _dims(inp)
    cfg = _split_config(dims)
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, config=cfg, deterministic=True)
    assert run.cfg.gate_up_shrink.SPLIT_K == run.cfg.down_shrink.SPLIT_K == 1
    assert (
        make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, config=cfg).cfg.gate_up_shrink.SPLIT_K
        == SPLIT
    )
    det = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage, config=cfg, deterministic=True)
    again = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage, config=cfg, deterministic=True)
    one = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage, config=cfg.deterministic())
    assert torch.equal(det, again) and torch.equal(det, one)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    assert_close_rel(det, ref, tol=1e-4, what="deterministic vs fp32 reference")
    split = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage, config=cfg)
    assert_close_rel(split, det, tol=1e-5, what="split-K vs SPLIT_K = 1")


def test_layer_module_deterministic():
    sh = get_shape("tiny")
    T, L, R = 16, 3, 16
    inp = make_inputs(sh, T, rank=R, num_adapters=L, dtype=torch.float32, device="cpu")
    dims = _dims(inp)
    cfg = _split_config(dims)
    kw = dict(top_k=dims.top_k, num_adapters=L, max_rank=R, max_tokens=32, slices=dims.slices, config=cfg)
    det = MoELoRALayer(inp.w13, inp.w2, deterministic=True, **kw)
    plain = MoELoRALayer(inp.w13, inp.w2, **kw)
    assert det.config_for(T).is_deterministic and not plain.config_for(T).is_deterministic
    assert "deterministic=True" in repr(det) and "deterministic" not in repr(plain)
    for slot in range(L):
        gate_up = (inp.lora_a13[slot], inp.lora_b13[slot])
        down = (inp.lora_a2[slot], inp.lora_b2[slot])
        for layer in (det, plain):
            layer.load_adapter(slot, gate_up=gate_up, down=down)
    args = (inp.hidden_states,)
    route = dict(topk_weights=inp.topk_weights, topk_ids=inp.topk_ids, lora_ids=inp.lora_ids)
    a, b = det(*args, **route), det(*args, **route)
    want = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="tuned", config=cfg, deterministic=True)
    assert torch.equal(a, b) and torch.equal(a, want)
    assert_close_rel(plain(*args, **route), a, tol=1e-5, what="split-K module vs deterministic module")


def test_dense_deterministic():
    g = torch.Generator().manual_seed(0)
    T, H, N, L, R = 20, 64, 48, 3, 16
    x = torch.randn(T, H, generator=g)
    w = torch.randn(N, H, generator=g) * 0.1
    a = torch.randn(L, 1, R, H, generator=g) * 0.1
    b = torch.randn(L, N, R, generator=g) * 0.1
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    cfg = DenseLoRAConfig(OpConfig(BLOCK_SIZE_K=16, SPLIT_K=4), OpConfig())
    kw = dict(slices=(N,), stage="tuned", config=cfg)
    det = lora_linear(x, w, a, b, ids, deterministic=True, **kw)
    assert torch.equal(det, lora_linear(x, w, a, b, ids, deterministic=True, **kw))
    assert torch.equal(det, lora_linear(x, w, a, b, ids, **{**kw, "config": cfg.deterministic()}))
    assert_close_rel(
        det, lora_linear_reference(x, w, a, b, ids, slices=(N,)), tol=1e-4, what="dense vs reference"
    )
    mod = LoRALinear(w, num_adapters=L, max_rank=R, max_tokens=32, config=cfg, deterministic=True)
    assert mod.config_for(T).is_deterministic and "deterministic=True" in repr(mod)
    for slot in range(L):
        mod.load_adapter(slot, a[slot, 0], b[slot])
    assert torch.equal(mod(x, ids), det)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_deterministic_must_be_a_bool(bad):
    inp = make_inputs(get_shape("tiny"), 4, rank=16, num_adapters=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        fused_moe_lora(*inp.args(), **inp.kwargs(), stage="tuned", deterministic=bad)
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        MoELoRALayer(
            inp.w13,
            inp.w2,
            top_k=inp.topk_ids.shape[1],
            num_adapters=2,
            max_rank=16,
            max_tokens=8,
            deterministic=bad,
        )
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        LoRALinear(w, num_adapters=1, max_rank=4, max_tokens=4, deterministic=bad)
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        lora_linear(
            torch.zeros(2, 16),
            w,
            torch.zeros(1, 1, 4, 16),
            torch.zeros(1, 8, 4),
            torch.zeros(2, dtype=torch.int32),
            slices=(8,),
            deterministic=bad,
        )


def test_setting_the_attribute_later_applies_at_every_t():
    # a config resolved before the change must not survive it (found by a new-user trial)
    inp = make_inputs(get_shape("tiny"), 16, rank=16, num_adapters=2, dtype=torch.float32, device="cpu")
    cfg = _split_config(_dims(inp))
    layer = MoELoRALayer(inp.w13, inp.w2, top_k=2, num_adapters=2, max_rank=16, max_tokens=32, config=cfg)
    assert not layer.config_for(7).is_deterministic
    layer.deterministic = True
    assert layer.config_for(7).is_deterministic and layer.config_for(8).is_deterministic
    layer.deterministic = False
    assert not layer.config_for(7).is_deterministic
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        layer.deterministic = "no"
    assert layer.deterministic is False
    w = torch.randn(48, 64) * 0.1
    dcfg = DenseLoRAConfig(OpConfig(BLOCK_SIZE_K=16, SPLIT_K=4), OpConfig())
    lin = LoRALinear(w, num_adapters=1, max_rank=8, max_tokens=16, config=dcfg)
    assert not lin.config_for(7).is_deterministic
    lin.deterministic = True
    assert lin.config_for(7).is_deterministic and "deterministic=True" in repr(lin)
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        lin.deterministic = 1


def test_flags_are_bools_not_truthy_values():
    np = pytest.importorskip("numpy")
    inp = make_inputs(get_shape("tiny"), 4, rank=16, num_adapters=2, dtype=torch.float32, device="cpu")
    kw = dict(top_k=2, num_adapters=2, max_rank=16, max_tokens=8)
    with pytest.raises(
        ValueError, match=r"deterministic must be a Python bool \(True or False\), got numpy\."
    ):
        MoELoRALayer(inp.w13, inp.w2, deterministic=np.bool_(True), **kw)
    for flag in ("renormalize", "debug", "share_scratch"):
        with pytest.raises(ValueError, match=f"{flag} must be a Python bool"):
            MoELoRALayer(inp.w13, inp.w2, **{flag: "false"}, **kw)
    w = torch.zeros(8, 16)
    for flag in ("debug", "share_scratch"):
        with pytest.raises(ValueError, match=f"{flag} must be a Python bool"):
            LoRALinear(w, num_adapters=1, max_rank=4, max_tokens=4, **{flag: "no"})
    with pytest.raises(ValueError, match="check_values must be a Python bool"):
        lora_linear(
            torch.zeros(2, 16),
            w,
            torch.zeros(1, 1, 4, 16),
            torch.zeros(1, 8, 4),
            torch.zeros(2, dtype=torch.int32),
            slices=(8,),
            check_values="no",
        )
    with pytest.raises(ValueError, match="check_values must be a Python bool"):
        make_layer_run(*inp.args(), **inp.kwargs(), check_values="no")
    # with a bad stage and a bad flag, the stage is named first at T = 0 and T > 0 alike
    empty = make_inputs(get_shape("tiny"), 0, rank=16, num_adapters=2, dtype=torch.float32, device="cpu")
    for i in (empty, inp):
        with pytest.raises(ValueError, match="stage"):
            fused_moe_lora(*i.args(), **i.kwargs(), stage="nope", deterministic="x")


def test_model_builds_every_lora_module_deterministic():
    from moelora_lib.model import REAL_CONFIGS, ModelConfig, random_model

    cfg = ModelConfig.from_hf(
        dict(REAL_CONFIGS["qwen3-30b-a3b"], hidden_size=32, head_dim=16, num_attention_heads=4,
             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             num_hidden_layers=2, vocab_size=64)
    )  # fmt: skip
    sizes = dict(num_adapters=2, max_rank=4, max_batch=2, max_seq=16, max_tokens=24)
    det = random_model(cfg, seed=1, dtype=torch.float32, device="cpu", deterministic=True, **sizes)
    plain = random_model(cfg, seed=1, dtype=torch.float32, device="cpu", **sizes)
    mods = det.lora_modules()
    assert len(mods) >= 6 and all(m.deterministic for m in mods.values())
    assert det.deterministic and not plain.deterministic
    assert not any(m.deterministic for m in plain.lora_modules().values())
    with pytest.raises(AttributeError):
        det.deterministic = False  # fixed at construction (graphs bake the configs in)
    for model in (det, plain):  # slot 1: the same random rank-3 adapter in every LoRA module
        g = torch.Generator().manual_seed(2)

        def rnd(*shape, g=g):
            return torch.randn(*shape, generator=g) * 0.3

        for m in model.lora_modules().values():
            if hasattr(m, "slices"):  # LoRALinear
                m.load_adapter(1, [rnd(3, m.in_features) for _ in m.slices], [rnd(n, 3) for n in m.slices])
            else:  # MoELoRALayer
                E, H, I, S = m.E, m.H, m.I, m.S
                m.load_adapter(
                    1, gate_up=(rnd(E, S, 3, H), rnd(E, S, 2 * I // S, 3)), down=(rnd(E, 3, I), rnd(E, H, 3))
                )
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    a = det(ids, [0, 0], [-1, 1], kv_len=8)
    b = det(ids, [0, 0], [-1, 1], kv_len=8)
    assert torch.equal(a, b)
    assert_close_rel(a, plain(ids, [0, 0], [-1, 1], kv_len=8), tol=1e-5, what="deterministic model vs plain")
    with pytest.raises(ValueError, match="deterministic must be a Python bool"):
        random_model(cfg, dtype=torch.float32, device="cpu", deterministic="yes", **sizes)
    next(iter(mods.values())).deterministic = False  # one module switched by hand: the model says so
    assert not det.deterministic


def test_every_stage_still_accepts_the_flag():
    inp = make_inputs(get_shape("tiny"), 8, rank=16, num_adapters=2, dtype=torch.float32, device="cpu")
    outs = {s: fused_moe_lora(*inp.args(), **inp.kwargs(), stage=s, deterministic=True) for s in STAGES}
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    for s, o in outs.items():
        assert_close_rel(o, ref, tol=1e-4, what=f"stage {s} deterministic vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_gpu_deterministic_mode_repeats_bit_for_bit(model):
    """On the GPU at a real shape with the shipped tuned config and a split-K shrink: 20 deterministic
    calls give one result bit for bit (the split-K calls are only compared against it within the bf16
    tolerance; whether they vary between calls is the hardware's to decide, not asserted)."""
    T = 64
    inp = make_inputs(get_shape(model), T, rank=32, num_adapters=8, dtype=torch.bfloat16, device="cuda")
    cfg = load_layer_config(_dims(inp), gpu_name="NVIDIA_H200")
    if cfg.is_deterministic:  # make sure the plain path splits K, so the mode changes what runs
        cfg = _split_config(_dims(inp)).replace(source=cfg.source)
    kw = dict(stage="tuned", config=cfg)
    first = fused_moe_lora(*inp.args(), **inp.kwargs(), deterministic=True, **kw)
    for _ in range(19):
        assert torch.equal(fused_moe_lora(*inp.args(), **inp.kwargs(), deterministic=True, **kw), first)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    assert_close_rel(first, ref, dtype=torch.bfloat16, what="deterministic vs fp32 reference")
    assert_close_rel(
        fused_moe_lora(*inp.args(), **inp.kwargs(), **kw), ref, dtype=torch.bfloat16, what="split-K"
    )
