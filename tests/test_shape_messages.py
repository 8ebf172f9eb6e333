"""A wrong weight or adapter shape is reported on the tensor that is wrong, with the expected and the
received shape: MoELoRALayer (constructor and load_adapter), LoRALinear.load_adapter and
fused_moe_lora's checks. CPU, fp32, no kernel launch (the checks run before any)."""

from __future__ import annotations

import re

import pytest
import torch

from moelora_lib import LoRALinear, MoELoRALayer
from moelora_lib.moe_lora import validate_moe_lora_inputs

E, H, I, K, L, R, r = 4, 32, 24, 2, 2, 8, 4  # 2I != H, I != H: every transposed weight is visible
LAYER = dict(top_k=K, num_adapters=L, max_rank=R, max_tokens=4)


def _shapes_in(msg: str, *shapes) -> None:
    for s in shapes:
        assert str(tuple(s)) in msg, f"{tuple(s)} not in: {msg}"


def _w(*shape):
    return torch.randn(*shape)


# --- MoELoRALayer(w13, w2, b13, b2) -----------------------------------------------------------------
CTOR = {  # name -> (w13, w2, b13, b2, the tensor to name, expected shape)
    "w13_transposed": ((E, H, 2 * I), (E, H, I), None, None, "w13", (E, 2 * I, H)),
    "w2_transposed": ((E, 2 * I, H), (E, I, H), None, None, "w2", (E, H, I)),
    "w2_wrong_I": ((E, 2 * I, H), (E, H, 8), None, None, "w2", (E, H, I)),
    "w2_wrong_E": ((E, 2 * I, H), (E + 1, H, I), None, None, "w2", (E, H, I)),
    "w13_wrong_H_biases_agree_with_w2": ((E, 2 * I, 48), (E, H, I), (E, 2 * I), (E, H), "w13", (E, 2 * I, H)),
    "b13_wrong": ((E, 2 * I, H), (E, H, I), (E, H), (E, H), "b13", None),
    "b2_wrong": ((E, 2 * I, H), (E, H, I), (E, 2 * I), (E, 2 * I), "b2", None),
}


@pytest.mark.parametrize("case", list(CTOR))
def test_layer_weight_shapes(case):
    w13, w2, b13, b2, name, want = CTOR[case]
    args = [None if s is None else _w(*s) for s in (w13, w2, b13, b2)]
    with pytest.raises(ValueError) as exc:
        MoELoRALayer(args[0], args[1], b13=args[2], b2=args[3], **LAYER)
    msg = str(exc.value)
    assert re.match(rf"{name} must have shape", msg), msg
    got = {"w13": w13, "w2": w2, "b13": b13, "b2": b2}[name]
    if want is not None:
        _shapes_in(msg, want, got)
    else:  # fused_moe_lora's format for the biases: letters with sizes, and the received shape
        assert str(tuple(got)) in msg, msg


def test_issue_case_transposed_w13_names_w13():
    """[E, H, 2I] with 2I != H: the message is about w13 (not w2), and says it looks transposed."""
    with pytest.raises(
        ValueError, match=r"^w13 must have shape \[E, 2I, H\] = \(4, 48, 32\).*got \(4, 32, 48\)"
    ):
        MoELoRALayer(_w(E, H, 2 * I), _w(E, H, I), **LAYER)
    with pytest.raises(ValueError, match="dims 1 and 2 swapped"):
        MoELoRALayer(_w(E, H, 2 * I), _w(E, H, I), **LAYER)


# --- MoELoRALayer.load_adapter ---------------------------------------------------------------------
def _factors(S=2):
    return {
        "a13": _w(E, S, r, H),
        "b13": _w(E, S, 2 * I // S, r),
        "a2": _w(E, r, I),
        "b2": _w(E, H, r),
    }


LOAD = {  # factor transposed -> (argument, A or B, expected shape with r for the rank)
    "a13": ("gate_up", "A", (E, 2, "r", H)),
    "b13": ("gate_up", "B", (E, 2, I, "r")),
    "a2": ("down", "A", (E, "r", I)),
    "b2": ("down", "B", (E, H, "r")),
}


@pytest.mark.parametrize("factor", list(LOAD))
def test_layer_adapter_shapes(factor):
    layer = MoELoRALayer(_w(E, 2 * I, H), _w(E, H, I), **LAYER)
    f = _factors()
    f[factor] = f[factor].transpose(-1, -2)  # the last two dims swapped: rank and a model dim
    proj, which, want = LOAD[factor]
    pair = (f["a13"], f["b13"]) if proj == "gate_up" else (f["a2"], f["b2"])
    with pytest.raises(ValueError) as exc:
        layer.load_adapter(0, **{proj: pair})
    msg = str(exc.value)
    assert msg.startswith(f"{proj} {which} must have shape"), msg
    _shapes_in(msg, want, f[factor].shape)
    assert layer.loaded_slots == {}


# --- LoRALinear.load_adapter -----------------------------------------------------------------------
@pytest.mark.parametrize("which", ["lora_a", "lora_b"])
def test_linear_adapter_shapes(which):
    N = (24, 8)
    lin = LoRALinear(_w(sum(N), H), slices=N, num_adapters=L, max_rank=R, max_tokens=4)
    A = [_w(r, H), _w(r, H)]
    B = [_w(N[0], r), _w(N[1], r)]
    (A if which == "lora_a" else B)[1] = (A if which == "lora_a" else B)[1].T.contiguous()
    want = (r, H) if which == "lora_a" else (N[1], r)
    got = A[1].shape if which == "lora_a" else B[1].shape
    with pytest.raises(ValueError) as exc:
        lin.load_adapter(0, A, B)
    msg = str(exc.value)
    assert msg.startswith(f"{which}[1] must have shape"), msg  # a layout error, not "rank r = 32"
    _shapes_in(msg, got)
    assert (str(want) if which == "lora_b" else f"(r, {H})") in msg, msg
    assert lin.loaded_slots == []


# --- fused_moe_lora's checks (the functional API) --------------------------------------------------
FE, FH, FI = 4, 32, 24  # 2I = 48 != H, I != H, 2I/S = 24 != R: every transpose changes the shape
FUNC = {  # argument -> (its shape, the expected shape as fused_moe_lora writes it)
    "w13": ((FE, 2 * FI, FH), "[E=4, 2I=48, H=32]"),
    "w2": ((FE, FH, FI), "[E=4, H=32, I=24]"),
    "lora_a13": ((L, FE, 2, R, FH), "[L=2, E=4, S=2, R=8, H=32]"),
    "lora_b13": ((L, FE, 2, FI, R), "[L=2, E=4, S=2, 2I/S=24, R=8]"),
    "lora_a2": ((L, FE, R, FI), "[L=2, E=4, R=8, I=24]"),
    "lora_b2": ((L, FE, FH, R), "[L=2, E=4, H=32, R=8]"),
}


@pytest.mark.parametrize("name", list(FUNC))
def test_functional_shapes(name):
    args = {n: _w(*shape) for n, (shape, _) in FUNC.items()}
    args[name] = args[name].transpose(-1, -2)
    T = 3
    with pytest.raises(ValueError) as exc:
        validate_moe_lora_inputs(
            _w(T, FH),
            args["w13"],
            args["w2"],
            torch.full((T, K), 0.5),
            torch.zeros((T, K), dtype=torch.int32),
            torch.zeros((T,), dtype=torch.int32),
            args["lora_a13"],
            args["lora_b13"],
            args["lora_a2"],
            args["lora_b2"],
        )
    msg = str(exc.value)
    assert msg.startswith(f"{name} must have shape {FUNC[name][1]}"), msg
    _shapes_in(msg, args[name].shape)


def test_topk_k_mismatch_names_both_arguments():
    """topk_ids and topk_weights with different K: a tie of two votes, so the message names both."""
    import moelora_lib

    g = torch.Generator().manual_seed(0)
    T, H, I, E, L, R = 3, 16, 8, 4, 2, 4
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    tw, ti = torch.full((T, 2), 0.5), torch.zeros(T, 2, dtype=torch.int32)
    ids = torch.zeros(T, dtype=torch.int32)
    a13, b13 = torch.zeros(L, E, 2, R, H), torch.zeros(L, E, 2, I, R)
    a2, b2 = torch.zeros(L, E, R, I), torch.zeros(L, E, H, R)
    with pytest.raises(ValueError, match=r"topk_ids has K=1, topk_weights has K=2"):
        moelora_lib.fused_moe_lora(x, w13, w2, tw, ti[:, :1], ids, a13, b13, a2, b2)


# --- non-finite base weights: refused at construction, named -----------------------------------------
@pytest.mark.parametrize("name,bad", [("w13", float("nan")), ("w2", float("inf")), ("b2", float("-inf"))])
def test_layer_refuses_non_finite_base_weights(name, bad):
    ws = {"w13": _w(E, 2 * I, H), "w2": _w(E, H, I), "b13": _w(E, 2 * I), "b2": _w(E, H)}
    ws[name].view(-1)[3] = bad
    with pytest.raises(ValueError, match=rf"^{name} holds non-finite values"):
        MoELoRALayer(ws["w13"], ws["w2"], b13=ws["b13"], b2=ws["b2"], **LAYER)


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_lora_linear_refuses_non_finite_weight(name):
    w, b = _w(3 * H, H), _w(3 * H)
    (w if name == "weight" else b).view(-1)[5] = float("nan")
    with pytest.raises(ValueError, match=rf"^{name} holds non-finite values"):
        LoRALinear(w, bias=b, num_adapters=L, max_rank=R, max_tokens=4)
