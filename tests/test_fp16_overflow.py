"""fp16: a rank intermediate beyond fp16's range must not overflow the layer.

The shrink keeps the rank intermediate x·Aᵀ in fp32; rounding it to fp16 weights' dtype before the
expand's dot would turn a value above 65 504 into inf, and every stage would return inf/NaN where the
fp32 reference is finite. Here one rank row of A is large (x·A ≈ 76 800 on the
gate_up projection, g·A2 ≈ 82 000 on the down projection) and the matching column of B small, so
the delta and the output stay moderate. Every stage must be finite and within the fp16 tolerance.
"""

import pytest
import torch

from moelora_lib import STAGES, fused_moe_lora
from moelora_lib.reference import activation_reference, moe_lora_reference
from moelora_lib.shapes import get_shape
from moelora_lib.testing import TOLERANCES, assert_close_rel, rel_err
from moelora_lib.workloads import make_inputs

TINY = get_shape("tiny")  # H 64, I 32, E 4, top-2, silu
FP16_MAX = torch.finfo(torch.float16).max  # 65 504
BIG_RANK = 5  # the rank row of A (and column of B) that carries the large intermediate
# (id, projection whose intermediate overflows fp16, S)
CASES = [
    ("gate_up_S2", "gate_up", 2),
    ("gate_up_S1", "gate_up", 1),
    ("down_S2", "down", 2),
    ("down_S1", "down", 1),
]


def _overflow_inputs(proj: str, slices: int) -> tuple[list, dict]:
    """fp32 CPU arguments of fused_moe_lora: T = 4 tokens, one adapter of rank 16 used by every token.

    x = 2 everywhere; base and LoRA weights 0.02·randn, except rank row BIG_RANK of A and column
    BIG_RANK of B of the chosen projection (every expert, every slice):
    gate_up: A13 row = 600 (x·A = 64·2·600 = 76 800), B13 column = 2e-5 (delta ≈ 1.5 on every h column);
    down: A13 row = 1, B13 column = 0.01 (h ≈ 1.3, g ≈ 1.3 on every column, x·A = 128), then
    A2 row = 2000 (g·A2 ≈ 32·1.3·2000 ≈ 82 000) and B2 column = 2e-5.
    """
    inp = make_inputs(TINY, 4, rank=16, num_adapters=1, pattern="uniform", slices=slices)
    g = torch.Generator().manual_seed(10)
    small = {
        n: 0.02 * torch.randn(getattr(inp, n).shape, generator=g)
        for n in ("w13", "w2", "lora_a13", "lora_b13", "lora_a2", "lora_b2")
    }
    if proj == "gate_up":
        small["lora_a13"][0, :, :, BIG_RANK, :] = 600.0
        small["lora_b13"][0, :, :, :, BIG_RANK] = 2e-5
    else:
        small["lora_a13"][0, :, :, BIG_RANK, :] = 1.0
        small["lora_b13"][0, :, :, :, BIG_RANK] = 0.01
        small["lora_a2"][0, :, BIG_RANK, :] = 2000.0
        small["lora_b2"][0, :, :, BIG_RANK] = 2e-5
    x = torch.full_like(inp.hidden_states, 2.0)
    lora_ids = torch.zeros(4, dtype=torch.int32)  # every token on adapter 0
    args = [x, small["w13"], small["w2"], inp.topk_weights, inp.topk_ids, lora_ids]
    args += [small[n] for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2")]
    return args, inp.kwargs()


def _rank_intermediates(args, kw) -> tuple[float, float]:
    """max |x·A13ᵀ| and max |g·A2ᵀ| over the routed pairs, in fp32 (g from the fp32 reference math)."""
    x, w13, _, _, topk_ids, _, a13, b13, a2, _ = args
    inter13, inter2 = 0.0, 0.0
    for t in range(x.shape[0]):
        for e in topk_ids[t].tolist():
            i13 = torch.einsum("h,srh->sr", x[t], a13[0, e])  # [S, R]
            h = x[t] @ w13[e].T + torch.einsum("sr,snr->sn", i13, b13[0, e]).reshape(-1)
            i2 = activation_reference(h, kw["activation"]) @ a2[0, e].T
            inter13 = max(inter13, float(i13.abs().max()))
            inter2 = max(inter2, float(i2.abs().max()))
    return inter13, inter2


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_case_overflows_fp16_only_in_the_rank_intermediate(case):
    # guards the test below: the chosen projection's intermediate is beyond fp16's range, the other
    # one is not, the fp32 result is finite and moderate, and an expand that saturated the
    # intermediate at 65 504 (instead of keeping it) would fail the fp16 tolerance by far
    _, proj, slices = case
    args, kw = _overflow_inputs(proj, slices)
    inter13, inter2 = _rank_intermediates(args, kw)
    big, other = (inter13, inter2) if proj == "gate_up" else (inter2, inter13)
    assert big > 1.1 * FP16_MAX and other < FP16_MAX, (inter13, inter2)
    ref = moe_lora_reference(*args, **kw)
    assert torch.isfinite(ref).all() and ref.abs().max() < 100
    sat = [a.clone() for a in args]
    a_big = sat[6][0, :, :, BIG_RANK] if proj == "gate_up" else sat[8][0, :, BIG_RANK]
    a_big *= FP16_MAX / big
    assert rel_err(moe_lora_reference(*sat, **kw), ref) > 10 * TOLERANCES[torch.float16]


# the stages whose expand differs: naive (delta stored, then added), even_k_fused_add (the expand adds
# into the tile; every later unfused stage runs its kernels), fused (the expand inside the base GEMM)
EXPAND_FORMS = ["naive", "even_k_fused_add", "fused"]


@pytest.mark.parametrize("stage", EXPAND_FORMS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp16_rank_intermediate_beyond_fp16_range(case, stage, device):
    _, proj, slices = case
    args, kw = _overflow_inputs(proj, slices)
    ref = moe_lora_reference(*args, **kw)
    half = [
        a.to(device=device, dtype=torch.float16) if i not in (3, 4, 5) else a.to(device)
        for i, a in enumerate(args)
    ]
    out = fused_moe_lora(*half, **kw, stage=stage)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out).all(1)).sum())} of 4 rows not finite"
    assert_close_rel(out, ref, torch.float16)


def _big_delta_inputs() -> tuple[list, dict]:
    """A gate_up LoRA delta beyond fp16's range on a base that brings h back into range.

    x = 1; every gate row of w13 = -10 000 / H (base gate = -10 000), up rows small; adapter 0 of rank
    16 with rank row BIG_RANK of A13 = 1 (x·A = H = 64) and, on the gate slice, column BIG_RANK of B13 =
    70 000 / 64, so the gate delta is 70 000 (> 65 504) and the gate 60 000 (finite; g = silu(gate)·up
    stays in range because up is small). Stages that store the delta before adding it must not round
    it to fp16 alone."""
    inp = make_inputs(TINY, 4, rank=16, num_adapters=1, pattern="uniform", slices=2)
    g = torch.Generator().manual_seed(11)
    H = TINY.hidden
    w13 = 0.02 * torch.randn(inp.w13.shape, generator=g)
    w13[:, : TINY.intermediate, :] = -10_000.0 / H  # gate rows ([gate | up] for silu)
    w2 = 1e-6 * torch.randn(inp.w2.shape, generator=g)
    a13 = torch.zeros(inp.lora_a13.shape)
    b13 = torch.zeros(inp.lora_b13.shape)
    a13[0, :, :, BIG_RANK, :] = 1.0
    b13[0, :, 0, :, BIG_RANK] = 70_000.0 / H  # gate slice only
    a2 = 0.02 * torch.randn(inp.lora_a2.shape, generator=g)
    b2 = 0.02 * torch.randn(inp.lora_b2.shape, generator=g)
    x = torch.ones_like(inp.hidden_states)
    lora_ids = torch.zeros(4, dtype=torch.int32)
    args = [x, w13, w2, inp.topk_weights, inp.topk_ids, lora_ids, a13, b13, a2, b2]
    return args, inp.kwargs()


@pytest.mark.parametrize("stage", list(STAGES))
def test_fp16_stored_delta_beyond_fp16_range(stage, device):
    args, kw = _big_delta_inputs()
    ref = moe_lora_reference(*args, **kw)
    assert torch.isfinite(ref).all()
    half = [
        a.to(device=device, dtype=torch.float16) if i not in (3, 4, 5) else a.to(device)
        for i, a in enumerate(args)
    ]
    out = fused_moe_lora(*half, **kw, stage=stage)
    assert torch.isfinite(out).all(), (
        f"stage {stage}: {int((~torch.isfinite(out).all(1)).sum())} rows not finite"
    )
    assert_close_rel(out, ref, torch.float16)
