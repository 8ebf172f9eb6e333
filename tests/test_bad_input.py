"""Bad input from a new user: a clear error naming the argument, never silent garbage or a crash deep
inside torch or a kernel (found by a new-user trial; each test covers the whole kind of mistake)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelora_lib import fused_moe_lora
from moelora_lib.kernels.config import LayerConfig, OpConfig
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.studies.notebook import setup
from moelora_lib.workloads import Workload, adapter_ids, make_inputs

TINY = get_shape("tiny")


# --- 1. Dims.of: no int() truncation, slices=0 is not "the preset's" ---------------------------------
@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(T=2.7), "T"),
        (dict(T="4"), "T"),
        (dict(T=True), "T"),
        (dict(T=-1), "T"),
        (dict(rank=16.9), "rank"),
        (dict(rank=False), "rank"),
        (dict(rank=0), "rank"),
        (dict(adapters=2.0), "adapters"),
        (dict(adapters="8"), "adapters"),
        (dict(slices=0), "slices"),
        (dict(slices=3), "slices"),
        (dict(slices=1.0), "slices"),
    ],
)
def test_dims_of_rejects_non_int_and_bad_sizes(kw, name):
    kw = {"T": 4, **kw}
    T = kw.pop("T")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        Dims.of("tiny", T, **kw)


def test_dims_of_accepts_ints_and_none_slices():
    import numpy as np

    assert Dims.of("tiny", 4).slices == TINY.lora_slices
    assert Dims.of("tiny", np.int64(4), rank=np.int32(16)) == Dims.of("tiny", 4, rank=16)
    assert Dims.of("tiny", 4, slices=1).slices == 1
    with pytest.raises(TypeError, match="shape"):
        Dims.of(None, 4)
    with pytest.raises(ValueError, match="unknown model preset"):
        Dims.of("nope", 4)


# --- 2. Workload: every field checked in __post_init__ ------------------------------------------------
@pytest.mark.parametrize(
    "kw,name,exc",
    [
        (dict(T=2.5), "Workload.T", ValueError),
        (dict(T="4"), "Workload.T", ValueError),
        (dict(T=-1), "Workload.T", ValueError),
        (dict(rank=0), "Workload.rank", ValueError),
        (dict(rank=16.0), "Workload.rank", ValueError),
        (dict(adapters=True), "Workload.adapters", ValueError),
        (dict(seed="x"), "Workload.seed", ValueError),
        (dict(seed=1.5), "Workload.seed", ValueError),
        (dict(device="tpu"), "Workload.device", ValueError),
        (dict(device="cuda:x"), "Workload.device", ValueError),
        (dict(device=0), "Workload.device", TypeError),
        (dict(activation="gelu"), "Workload.activation", ValueError),
        (dict(bias="yes"), "Workload.bias", ValueError),
        (dict(bias=1), "Workload.bias", ValueError),
        (dict(model="nope"), "unknown model preset", ValueError),
        (dict(model=None), "Workload.model", TypeError),
        (dict(pattern="roundrobin"), "Workload.pattern", ValueError),
        (dict(pattern=["uniform"]), "Workload.pattern", ValueError),
        (dict(dtype="int8"), "Workload.dtype", ValueError),
        (dict(dtype=torch.int32), "Workload.dtype", ValueError),
    ],
)
def test_workload_rejects_bad_fields(kw, name, exc):
    kw = {"model": "tiny", "T": 4, "device": "cpu", **kw}
    with pytest.raises(exc, match=name):
        Workload(**kw)


def test_workload_accepts_good_fields():
    wl = Workload("tiny", 0, device=torch.device("cpu"), activation="swigluoai", bias=False, dtype="fp16")
    assert wl.dtype is torch.float16 and wl.T == 0
    assert Workload("tiny", 4).device == "cuda"  # a valid device string; availability is not checked here


# --- 3. make_inputs / adapter_ids ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,kw,name",
    [
        ((TINY, -3), {}, "num_tokens"),
        ((TINY, 2.5), {}, "num_tokens"),
        ((TINY, "4"), {}, "num_tokens"),
        ((TINY, 4), dict(rank=0), "rank"),
        ((TINY, 4), dict(rank=8.0), "rank"),
        ((TINY, 4), dict(num_adapters=0), "num_adapters"),
        ((TINY, 4), dict(num_adapters=True), "num_adapters"),
        ((TINY, 4), dict(true_rank=0), "true_rank"),
        ((TINY, 4), dict(rank=16, true_rank=17), "true_rank"),
        ((TINY, 4), dict(slices=0), "slices"),
        ((TINY, 4), dict(slices=3), "slices"),
        ((TINY, 4), dict(pattern="nope"), "pattern"),
        ((TINY, 4), dict(num_adapters=2, used_slots=3), "used_slots"),
        ((TINY, 4), dict(used_slots=0), "used_slots"),
        ((TINY, 4), dict(seed="a"), "seed"),
        ((TINY, 4), dict(dtype="int8"), "dtype"),
        ((TINY, 4), dict(dtype=torch.int32), "dtype"),
        ((TINY, 4), dict(device="tpu"), "device"),
        ((TINY, 4), dict(bias="yes"), "bias"),
        ((TINY, 4), dict(act_scale=float("nan")), "act_scale"),
        ((TINY, 4), dict(experts_override=torch.zeros(3, 2, dtype=torch.int32)), "experts_override"),
        ((TINY, 4), dict(experts_override=torch.full((4, 2), 9)), "experts_override"),
        ((TINY, 4), dict(experts_override=torch.zeros(4, 2)), "experts_override"),
        (("nope", 4), {}, "unknown model preset"),
    ],
)
def test_make_inputs_rejects_bad_arguments(args, kw, name):
    with pytest.raises(ValueError, match=name):
        make_inputs(*args, **kw)


def test_make_inputs_rejects_a_non_shape():
    with pytest.raises(TypeError, match="shape"):
        make_inputs({"hidden": 64}, 4)


def test_make_inputs_accepts_a_preset_name_and_empty_batch():
    a, b = make_inputs("tiny", 3), make_inputs(TINY, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.args(), b.args()))
    assert make_inputs(TINY, 0).hidden_states.shape == (0, TINY.hidden)


@pytest.mark.parametrize(
    "args,name",
    [
        ((-1, 4, "uniform"), "num_tokens"),
        ((4, 0, "uniform"), "num_adapters"),
        ((4, 4, "bogus"), "pattern"),
    ],
)
def test_adapter_ids_rejects_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        adapter_ids(*args, torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        adapter_ids(4, 4, "uniform", 0)


# --- 4. notebook.setup seed --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", ["a", 1.5, True, None])
def test_notebook_setup_rejects_non_int_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        setup("99", "cpu", seed=seed, save_env=False)


# --- 5. LayerConfig fields must be OpConfigs ---------------------------------------------------------
def _layer_config(**changes) -> LayerConfig:
    ops = dict(
        base_gate_up=OpConfig(16),
        base_down=OpConfig(16),
        gate_up_shrink=OpConfig(16),
        gate_up_expand=OpConfig(16),
        down_shrink=OpConfig(16),
        down_expand=OpConfig(16),
    )
    return LayerConfig(**{**ops, **changes})


@pytest.mark.parametrize("op", ["base_gate_up", "base_down", "gate_up_shrink", "down_expand"])
@pytest.mark.parametrize("bad", ["m16n64k64", {"BLOCK_SIZE_M": 16}, None])
def test_layer_config_fields_must_be_op_configs(op, bad):
    with pytest.raises(ValueError, match=f"LayerConfig.{op} must be an OpConfig"):
        _layer_config(**{op: bad})
    good = _layer_config()
    with pytest.raises(ValueError, match=f"LayerConfig.{op}"):
        dataclasses.replace(good, **{op: bad})


def test_op_config_takes_numpy_ints_and_refuses_bools():
    """A config built from numpy integers (a tuner CSV read with pandas) is the same OpConfig as from Python
    ints (it was refused as 'BLOCK_SIZE_M must be a power of two >= 16, got np.int64(32)'); a bool is not a
    size (SPLIT_K=True was taken as 1)."""
    np = pytest.importorskip("numpy")
    cfg = OpConfig(
        BLOCK_SIZE_M=np.int64(32), BLOCK_SIZE_K=np.int32(128), SPLIT_K=np.int64(4), NUM_STAGES=np.int8(3)
    )
    assert cfg == OpConfig(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, SPLIT_K=4, NUM_STAGES=3)
    assert all(type(v) is int for v in cfg.to_dict().values())
    for field in ("BLOCK_SIZE_M", "SPLIT_K", "GROUP_SIZE_M", "NUM_WARPS", "NUM_STAGES"):
        with pytest.raises(ValueError, match=f"{field} must be a"):
            OpConfig(**{field: True})
    with pytest.raises(ValueError, match="BLOCK_SIZE_N must be a power of two >= 16"):
        OpConfig(BLOCK_SIZE_N=np.float64(32))


# --- 6. fused_moe_lora names the tensor that disagrees ------------------------------------------------
def _kw(T=6):
    inp = make_inputs(TINY, T, rank=16, num_adapters=3, pattern="mixed")
    names = ["hidden_states", "w13", "w2", "topk_weights", "topk_ids", "lora_ids"]
    names += ["lora_a13", "lora_b13", "lora_a2", "lora_b2"]
    return {**dict(zip(names, inp.args())), **inp.kwargs()}


@pytest.mark.parametrize(
    "name,mutate",
    [
        ("hidden_states", lambda t: t[:, :48]),  # wrong H: hidden_states, not w13
        ("hidden_states", lambda t: t[:5]),  # wrong T: hidden_states, not topk_ids
        ("w13", lambda t: t[:, :, :48]),
        ("w13", lambda t: t[:3]),  # wrong E
        ("w2", lambda t: t[:3]),
        ("w2", lambda t: t[:, :48]),
        ("w2", lambda t: t[..., :16]),  # wrong I
        ("topk_ids", lambda t: t[:5]),
        ("topk_weights", lambda t: t[:, :1]),
        ("lora_a13", lambda t: t[..., :48]),
        ("lora_b13", lambda t: t[:2]),  # wrong L
        ("lora_a2", lambda t: t[:, :, :8]),  # wrong R
        ("lora_b2", lambda t: t[:, :2]),
        ("b13", lambda t: t[:, :16]),
        ("b2", lambda t: t[:, :48]),
    ],
)
def test_fused_moe_lora_names_the_disagreeing_tensor(name, mutate):
    kw = _kw()
    if kw.get(name) is None:  # tiny has no biases: make them
        kw["b13"] = torch.zeros(TINY.experts, 2 * TINY.intermediate)
        kw["b2"] = torch.zeros(TINY.experts, TINY.hidden)
    kw[name] = mutate(kw[name])
    with pytest.raises(ValueError, match=rf"^{name} must have shape"):
        fused_moe_lora(**kw)


def test_fused_moe_lora_wrong_H_message_gives_the_agreed_H():
    kw = _kw()
    kw["hidden_states"] = kw["hidden_states"][:, :48]
    with pytest.raises(
        ValueError, match=rf"hidden_states must have shape \[T=6, H={TINY.hidden}\], got \(6, 48\)"
    ):
        fused_moe_lora(**kw)


@pytest.mark.parametrize("dim", ["H", "I", "E"])
def test_fused_moe_lora_refuses_empty_weights(dim):
    kw = _kw()
    sl = {
        "H": {
            "hidden_states": (slice(None), slice(0, 0)),
            "w13": (..., slice(0, 0)),
            "w2": (slice(None), slice(0, 0)),
        },
        "I": {"w13": (slice(None), slice(0, 0)), "w2": (..., slice(0, 0))},
        "E": {"w13": (slice(0, 0),), "w2": (slice(0, 0),)},
    }[dim]
    for name, idx in sl.items():
        kw[name] = kw[name][idx]
    for name, t in list(kw.items()):  # the adapters follow the weights' sizes
        if name.startswith("lora_") and name != "lora_ids":
            d = {
                "lora_a13": (1, None, 4),
                "lora_b13": (1, 3, None),
                "lora_a2": (1, 3, None),
                "lora_b2": (1, 2, None),
            }[name]
            e_dim, i_dim, h_dim = d
            idx = [slice(None)] * t.dim()
            if dim == "E":
                idx[e_dim] = slice(0, 0)
            elif dim == "I" and i_dim is not None:
                idx[i_dim] = slice(0, 0)
            elif dim == "H" and h_dim is not None:
                idx[h_dim] = slice(0, 0)
            kw[name] = t[tuple(idx)]
    with pytest.raises(ValueError, match=rf"must have E, I and H >= 1, got .*{dim}=0"):
        fused_moe_lora(**kw)


def test_fused_moe_lora_dtype_mismatch_names_the_tensor():
    kw = _kw()
    kw["w2"] = kw["w2"].half()
    with pytest.raises(ValueError, match=r"w2 must have dtype torch.float32 \(like hidden_states\)"):
        fused_moe_lora(**kw)


@pytest.mark.parametrize(
    "name", ["hidden_states", "w13", "w2", "topk_weights", "lora_a13", "lora_b13", "lora_a2", "lora_b2", "b2"]
)
def test_fused_moe_lora_refuses_an_input_that_requires_grad(name):
    """Inference only: the result would silently carry no gradient. Refused by name under grad mode;
    the same call runs under torch.no_grad()."""
    kw = _kw()
    kw["b2"] = torch.zeros(TINY.experts, TINY.hidden)
    kw[name] = kw[name].clone().requires_grad_()
    with pytest.raises(
        ValueError, match=rf"^{name} requires grad: moelora_lib is inference only; call under"
    ):
        fused_moe_lora(**kw)
    with torch.no_grad():
        assert fused_moe_lora(**kw).shape == kw["hidden_states"].shape


@pytest.mark.parametrize("name", ["w2", "b13", "b2"])
def test_layer_dtype_mismatch_names_w13_as_the_reference(name):
    """The constructor takes no hidden_states: its dtype reference is w13."""
    from moelora_lib import MoELoRALayer

    kw = _kw()
    E, two_i = kw["w13"].shape[:2]
    args = dict(w13=kw["w13"].half(), w2=kw["w2"].half(), b13=torch.zeros(E, two_i).half())
    args["b2"] = torch.zeros(E, kw["w13"].shape[2]).half()
    args[name] = args[name].float()
    with pytest.raises(
        ValueError, match=rf"^{name} must have dtype torch.float16 \(like w13\), got torch.float32$"
    ):
        MoELoRALayer(**args, top_k=2, num_adapters=3, max_rank=16, max_tokens=8)


@pytest.mark.parametrize("name", ["w13", "w2", "lora_a13", "topk_ids", "lora_ids"])
def test_fused_moe_lora_wrong_rank_or_type_names_the_argument(name):
    kw = _kw()
    kw[name] = kw[name].flatten()[:4] if name != "lora_ids" else kw[name].tolist()
    with pytest.raises(ValueError, match=rf"^{name} must be a \d-D tensor"):
        fused_moe_lora(**kw)


# --- 7. one way to pass a shape: a Dims ---------------------------------------------------------------
def test_configs_take_a_dims_only():
    from moelora_lib.kernels import STAGES, default_config
    from moelora_lib.kernels.fused import fused_default_config

    d = Dims(T=8, H=64, I=32, E=4, top_k=2, adapters=2, rank=16)
    assert default_config(d).source == "default"
    for fn in (default_config, fused_default_config, STAGES["naive"].config_for):
        with pytest.raises(TypeError):
            fn(8, 64, 32, 4, 2, 16, 2)
    with pytest.raises(TypeError, match="Dims"):
        default_config((8, 64, 32, 4, 2, 16, 2))


# --- 8. routing inputs, id dtypes, flags, config sources, value checks, buffer sizes ------------------
def _layer(device, **kw):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(4, 64, 64, generator=g) * 0.1).to(device)
    w2 = (torch.randn(4, 64, 32, generator=g) * 0.1).to(device)
    from moelora_lib import MoELoRALayer

    kw = {**dict(top_k=2, num_adapters=3, max_rank=16, max_tokens=8), **kw}
    return MoELoRALayer(w13, w2, **kw)


def _routing(device, T=5):
    tw = torch.full((T, 2), 0.5, device=device)
    ti = torch.stack([torch.arange(T) % 4, (torch.arange(T) + 1) % 4], 1).to(device, torch.int32)
    lid = torch.tensor([0, 1, -1, 2, 0][:T], dtype=torch.int32, device=device)
    return tw, ti, lid


@pytest.mark.parametrize("name", ["topk_weights", "topk_ids", "lora_ids", "router_logits"])
def test_layer_non_tensor_routing_inputs_name_the_argument(device, name):
    layer = _layer(device)
    x = torch.randn(5, 64, device=device)
    tw, ti, lid = _routing(device)
    kw = dict(topk_weights=tw, topk_ids=ti, lora_ids=lid)
    if name == "router_logits":
        del kw["topk_weights"], kw["topk_ids"]
        kw["router_logits"] = [[0.0] * 4] * 5
    else:
        kw[name] = kw[name].tolist()
    with pytest.raises(ValueError, match=rf"^{name} must be an? .*tensor .*got list"):
        layer(x, **kw)


def _kw_on(device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _kw().items()}


def test_fused_moe_lora_lora_ids_int64_accepted_other_int_named(device):
    kw = _kw_on(device)
    ref = fused_moe_lora(**kw)
    assert torch.equal(fused_moe_lora(**{**kw, "lora_ids": kw["lora_ids"].long()}), ref)
    with pytest.raises(ValueError, match=r"^lora_ids must have dtype in \['torch.int32', 'torch.int64'\]"):
        fused_moe_lora(**{**kw, "lora_ids": kw["lora_ids"].short()})


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_route_renormalize_must_be_bool(bad):
    import moelora_lib

    with pytest.raises(ValueError, match="^renormalize must be a Python bool"):
        moelora_lib.route(torch.randn(5, 4), 2, renormalize=bad)


@pytest.mark.parametrize("loader", ["layer", "fused", "dense"])
@pytest.mark.parametrize("arg", ["gpu_name", "folder"])
def test_config_loaders_check_gpu_name_and_folder_types(loader, arg):
    from moelora_lib import configs

    d = Dims(T=5, H=64, I=32, E=4, top_k=2, adapters=4, rank=16)
    call = {
        "layer": lambda **kw: configs.load_layer_config(d, **kw),
        "fused": lambda **kw: configs.load_fused_config(d, **kw),
        "dense": lambda **kw: configs.load_dense_config(5, 64, (64, 16, 16), 16, 4, **kw),
    }[loader]
    with pytest.raises(ValueError, match=rf"^{arg} must be a str"):
        call(**{arg: 5})


def test_layer_debug_rejects_non_finite_topk_weights(device):
    x = torch.randn(5, 64, device=device)
    tw, ti, lid = _routing(device)
    tw[1, 0] = float("nan")
    tw[3, 1] = float("inf")
    with pytest.raises(ValueError, match="^topk_weights must be finite, got 2 NaN or inf"):
        _layer(device, debug=True)(x, topk_weights=tw, topk_ids=ti, lora_ids=lid)


def test_fused_moe_lora_rejects_non_finite_topk_weights(device):
    kw = _kw_on(device)
    kw["topk_weights"] = kw["topk_weights"].clone()
    kw["topk_weights"][2, 0] = float("nan")
    with pytest.raises(ValueError, match="^topk_weights must be finite, got 1 NaN or inf"):
        fused_moe_lora(**kw)


def test_layer_max_tokens_beyond_device_memory_names_max_tokens(device):
    with pytest.raises(ValueError, match=r"^max_tokens = 1000000000000 needs .* GiB of scratch buffers"):
        _layer(device, max_tokens=10**12)
    assert _layer(device, max_tokens=64).max_tokens == 64


def test_dims_accepts_empty_batch_only_for_T():
    assert Dims(T=0, H=64, I=32, E=4, top_k=2, adapters=1, rank=1).pairs == 0
    with pytest.raises(ValueError, match=r"^Dims.T must be an int >= 0"):
        Dims(T=-1, H=64, I=32, E=4, top_k=2, adapters=1, rank=1)
    with pytest.raises(ValueError, match=r"^Dims.H must be an int >= 1"):
        Dims(T=0, H=0, I=32, E=4, top_k=2, adapters=1, rank=1)


def _packed_weights(form: str, device: str):
    """(w13 [4, 64, 64], w2 [4, 64, 32]) on ``device``: dense (fp32), MXFP4 or block-FP8 (block 32)."""
    from moelora_lib.quant import FP8BlockWeight, MXFP4Weight

    w13, w2 = torch.randn(4, 64, 64) * 0.1, torch.randn(4, 64, 32) * 0.1
    if form == "mxfp4":
        w13, w2 = MXFP4Weight.quantize(w13), MXFP4Weight.quantize(w2)
    elif form == "fp8":
        w13, w2 = FP8BlockWeight.quantize(w13, (32, 32)), FP8BlockWeight.quantize(w2, (32, 32))
    return w13.to(device), w2.to(device)


@pytest.mark.parametrize("form", ["dense", "mxfp4", "fp8"])
def test_layer_constructor_on_meta_names_the_weight(form):
    """The constructors take no activations: a weight on the meta device is named as the weight."""
    from moelora_lib import LoRALinear, MoELoRALayer
    from moelora_lib.quant import FP8BlockWeight

    w13, w2 = _packed_weights(form, "meta")
    dt = dict(dtype=torch.float32) if form != "dense" else {}
    with pytest.raises(ValueError, match=r"^w13 is on meta: meta tensors hold no data and are not supported"):
        MoELoRALayer(w13, w2, top_k=2, num_adapters=2, max_rank=4, max_tokens=8, **dt)
    if form == "mxfp4":  # LoRALinear takes a dense or a block-FP8 weight [N, H]
        return
    weight = FP8BlockWeight(w13.weight[0], w13.scale_inv[0], w13.block) if form == "fp8" else w13[0]
    with pytest.raises(ValueError, match=r"^weight is on meta: meta tensors hold no data"):
        LoRALinear(weight, num_adapters=2, max_rank=4, max_tokens=8, **dt)


@pytest.mark.parametrize("form", ["mxfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e4m3fn])
def test_layer_packed_weights_non_kernel_dtype_names_dtype(form, dtype):
    """With packed weights the layer's dtype is the dtype argument: a non-kernel one is named as such."""
    from moelora_lib import MoELoRALayer

    w13, w2 = _packed_weights(form, "cpu")
    with pytest.raises(
        ValueError,
        match=rf"^dtype \(the layer's, with {form.upper()} weights\) must be float16, bfloat16 or float32",
    ):
        MoELoRALayer(w13, w2, top_k=2, num_adapters=2, max_rank=4, max_tokens=8, dtype=dtype)
