"""Whole-layer correctness of every stage against the fp32 reference (curated cases).

On a CPU machine these run through the Triton interpreter in fp32/fp16 (bf16 arithmetic is wrong
under the interpreter, environment.md §2); tests marked ``gpu`` run bf16 at model shapes.
"""

import pytest
import torch

from moelora_lib import STAGES, fused_moe_lora
from moelora_lib.kernels import stage_named
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_loop_reference, moe_lora_reference
from moelora_lib.shapes import MoEShape, get_shape
from moelora_lib.testing import TOLERANCES, assert_close_rel
from moelora_lib.workloads import make_inputs

TINY = get_shape("tiny")  # H 64, I 32, E 4, K 2, silu
TINY_OSS = get_shape("tiny-oss")  # same with swigluoai, biases, S = 1
E7 = MoEShape("e7", 64, 48, 7, 3, 1)

# (id, shape, make_inputs kwargs) — one comment per edge; rank 16 and S = 2 (gate and up adapters) are
# the defaults of every case.
CASES = [
    ("T1", TINY, dict(num_tokens=1)),  # a single decode token
    ("T_lt_BM", TINY, dict(num_tokens=5)),  # 10 pairs < BLOCK_SIZE_M = 16
    ("T_not_multiple", TINY, dict(num_tokens=37)),  # 74 pairs, ragged last blocks
    ("E7_K3", E7, dict(num_tokens=19)),  # odd expert count, top-3
    ("R8", TINY, dict(num_tokens=9, rank=8)),  # rank < 16: tiles clamped, masked
    ("R64", TINY, dict(num_tokens=9, rank=64)),  # rank above the rank tile of the defaults
    ("true_rank24_in_R32", TINY, dict(num_tokens=9, rank=32, true_rank=24)),  # zero-padded rank
    ("S1_fused_gate_up", TINY, dict(num_tokens=11, slices=1)),  # GPT-OSS-style 3-D adapter
    ("swigluoai_beyond_clamp", TINY_OSS, dict(num_tokens=13, act_scale=12.0)),  # |pre-act| >> 7
    ("silu_with_biases", TINY, dict(num_tokens=13, bias=True)),
    ("every_slot_plus_minus1", TINY, dict(num_tokens=23, num_adapters=3, pattern="mixed")),
    ("L8_two_slots_used", TINY, dict(num_tokens=17, num_adapters=8, used_slots=2)),
    ("zipf_adapters", TINY, dict(num_tokens=29, num_adapters=4, pattern="zipf")),
]
_CASE = {c[0]: c for c in CASES}

# Every case on the stages whose kernels or launch plans differ (naive: masked loads, delta buffers,
# length specialization; even_k_fused_add: split-K, grouped order, EVEN_K, fused add); the stages between
# them only switch a subset of those features on, and ``tuned`` runs even_k_fused_add's kernels with its
# configs (the defaults on the CPU): a few edges each. Stage ``fused`` (the fused GEMMs): the few edges and
# the ones tests/test_stage_fused.py's curated cases leave out (its cases cover one decode token, ragged
# blocks, E7/top-3, rank 8, the zero-padded rank, S = 1, biases, swigluoai beyond the clamp, mixed and
# zipf slots).
FULL_STAGES = ("naive", "even_k_fused_add")
FEW_CASES = ("T_not_multiple", "R8", "S1_fused_gate_up")
FUSED_CASES = FEW_CASES + ("T_lt_BM", "R64", "L8_two_slots_used")
STAGE_CASES = [
    (stage, c)
    for stage in STAGES
    for c in CASES
    if stage in FULL_STAGES or c[0] in (FUSED_CASES if stage == "fused" else FEW_CASES)
]


def _inputs(shape, device, dtype, **kw):
    kw.setdefault("rank", 16)
    kw.setdefault("num_adapters", 3)
    kw.setdefault("pattern", "mixed")
    return make_inputs(shape, dtype=dtype, device=device, **kw)


@pytest.mark.parametrize("stage,case", STAGE_CASES, ids=[f"{c[0]}-{st}" for st, c in STAGE_CASES])
def test_stage_matches_reference_fp32(case, stage, device):
    _, shape, kw = case
    inp = _inputs(shape, device, torch.float32, **kw)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
@pytest.mark.parametrize(
    "case",
    [_CASE[n] for n in ("T_not_multiple", "swigluoai_beyond_clamp", "every_slot_plus_minus1")],
    ids=lambda c: c[0],
)
def test_stage_matches_reference_fp16(case, stage, device):
    _, shape, kw = case
    inp = _inputs(shape, device, torch.float16, **kw)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    assert out.dtype == torch.float16
    assert_close_rel(out, ref, torch.float16)


def test_lora_delta_is_not_negligible(device):
    # guards the tests above: dropping the LoRA terms must fail the tolerance by far
    inp = _inputs(TINY, device, torch.float32, num_tokens=13, pattern="uniform")
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    base = moe_lora_reference(*inp.args()[:6], None, None, None, None, **inp.kwargs())
    assert (ref - base).abs().max() > 50 * TOLERANCES[torch.float32] * ref.abs().max()


def test_swigluoai_case_reaches_the_clamp():
    inp = _inputs(TINY_OSS, "cpu", torch.float32, num_tokens=13, act_scale=12.0)
    h = torch.einsum("th,eih->tei", inp.hidden_states, inp.w13)
    assert h.abs().max() > 3 * 7.0  # pre-activations well beyond GPT-OSS's limit of 7


@pytest.mark.parametrize("stage", list(STAGES))
def test_all_tokens_without_adapter_equal_base_exactly(stage, device):
    # lora_ids all -1: no LoRA program does any work, so the output is the base MoE bit for bit
    inp = _inputs(TINY_OSS, device, torch.float32, num_tokens=21, pattern="none")
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage)
    with_lora = run().clone()
    base_only = run.base_part()
    assert torch.equal(with_lora, base_only)


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
def test_rows_without_adapter_equal_base_exactly(stage, device):
    # mixed batch: rows of -1 tokens must be bit-identical to the base-only output (vLLM #42008)
    inp = _inputs(TINY, device, torch.float32, num_tokens=23, pattern="mixed")
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage)
    with_lora = run().clone()
    base_only = run.base_part()
    none = inp.lora_ids == -1
    assert none.any() and (~none).any()
    assert torch.equal(with_lora[none], base_only[none])
    assert not torch.equal(with_lora[~none], base_only[~none])


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
def test_one_expert_takes_all_tokens(stage, device):
    # every token routes to expert 2 (plus one other): one expert group holds all T tokens
    T = 40
    other = torch.tensor([0, 1, 3]).repeat(T // 3 + 1)[:T]
    ids = torch.stack([torch.full((T,), 2), other], dim=1)
    inp = _inputs(TINY, device, torch.float32, num_tokens=T, pattern="uniform", experts_override=ids)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
def test_routing_weights_applied_once(stage, device):
    # out = Σ_k w·y is linear in w: doubling every weight doubles the output (weights applied once)
    inp = _inputs(TINY_OSS, device, torch.float32, num_tokens=9)
    out1 = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    args = list(inp.args())
    args[3] = inp.topk_weights * 2
    out2 = fused_moe_lora(*args, **inp.kwargs(), stage=stage)
    assert_close_rel(out2, 2 * out1, torch.float32, tol=1e-6)


def test_reference_matches_independent_loop():
    for shape, kw in [(TINY, {}), (TINY_OSS, dict(act_scale=12.0)), (E7, dict(slices=1))]:
        inp = _inputs(shape, "cpu", torch.float32, num_tokens=7, **kw)
        ref = moe_lora_reference(*inp.args(), **inp.kwargs())
        loop = moe_lora_loop_reference(*inp.args(), **inp.kwargs())
        assert_close_rel(ref, loop, tol=1e-5, what=shape.name)


def test_default_stage_is_auto(device):
    # "auto": the stage the config files choose for these dims (tests/test_stage_auto.py); stage tuned on
    # the CPU, which has no config files
    inp = _inputs(TINY, device, torch.float32, num_tokens=9)
    run = make_layer_run(*inp.args(), **inp.kwargs())
    assert run.stage is stage_named("auto", run.dims)
    if device == "cpu":
        assert run.stage is STAGES["tuned"]
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), deterministic=True)
    ref = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=run.stage.name, deterministic=True)
    assert torch.equal(out, ref)
    assert_close_rel(out, moe_lora_reference(*inp.args(), **inp.kwargs()), torch.float32)


def test_empty_batch_returns_empty(device):
    inp = _inputs(TINY, device, torch.float32, num_tokens=4)
    args = [a[:0] if i in (0, 3, 4, 5) else a for i, a in enumerate(inp.args())]
    out = fused_moe_lora(*args, **inp.kwargs())
    assert out.shape == (0, TINY.hidden)


# --- a non-finite value in one slot's weights stays in that slot's rows -------------------------
#: slot -> the LoRA tensor holding its non-finite value; slot 0 stays finite
POISONED = {1: "lora_a13", 2: "lora_b13", 3: "lora_a2", 4: "lora_b2"}
#: 10 tokens, all on experts 0 … K-1: each expert's tile holds rows of every slot and rows without one
POISON_IDS = [1, 0, -1, 2, 3, 4, 0, -1, 2, 4]


def _poisoned(shape, device, dtype, value, **kw):
    """Inputs with 5 slots where slot s of POISONED holds ``value`` in its tensor at [s, e, ..., 0, 0]
    for every expert e (and slice): every tile meets each poisoned slot's value in that slot's dot."""
    T = len(POISON_IDS)
    experts = torch.arange(shape.top_k, dtype=torch.int32).repeat(T, 1)
    inp = _inputs(shape, device, dtype, num_tokens=T, num_adapters=5, experts_override=experts, **kw)
    inp.lora_ids = torch.tensor(POISON_IDS, dtype=torch.int32, device=device)
    for slot, name in POISONED.items():
        t = getattr(inp, name).clone()
        t[slot, ..., 0, 0] = value
        setattr(inp, name, t)
    return inp


def _assert_poison_stays_in_its_slot(out, ref, lora_ids, dtype):
    """Each poisoned slot's rows non-finite exactly where the reference's are (and the finite entries
    close to it); rows of the clean slot and rows without adapter as the reference."""
    out, ref, ids = out.cpu(), ref.cpu(), lora_ids.cpu()
    clean = (ids == 0) | (ids == -1)
    assert torch.isfinite(ref[clean]).all()
    assert_close_rel(out[clean], ref[clean], dtype, what="rows of the clean slot and without adapter")
    for slot, name in POISONED.items():
        rows = ids == slot
        assert not torch.isfinite(ref[rows]).all(), name  # guards the case: the value reaches the rows
        assert torch.equal(torch.isfinite(out[rows]), torch.isfinite(ref[rows])), name
        fin = torch.isfinite(ref[rows])
        if fin.any():
            assert_close_rel(out[rows][fin], ref[rows][fin], dtype, what=f"finite entries, {name}")


# every stage in fp32 with NaN (silu); the fused stage also with inf and in fp16; swigluoai (its clamps
# must keep a NaN pre-activation NaN, as torch's clamp does) on the two activation paths: the gated_act
# kernel (tuned) and the fused gate_up epilogue
POISON_CASES = [(st, TINY, "nan", torch.float32) for st in STAGES]
POISON_CASES += [("fused", TINY, "inf", torch.float32), ("fused", TINY, "nan", torch.float16)]
POISON_CASES += [(st, TINY_OSS, "nan", torch.float32) for st in ("tuned", "fused")]


@pytest.mark.parametrize(
    "stage,shape,value,dtype",
    POISON_CASES,
    ids=[f"{c[0]}-{c[1].name}-{c[2]}-{str(c[3])[6:]}" for c in POISON_CASES],
)
def test_non_finite_adapter_weights_stay_in_their_slot(stage, shape, value, dtype, device):
    # a NaN/inf in one slot's lora_a13, lora_b13, lora_a2 or lora_b2 (one slot each): that slot's rows
    # are non-finite as in the reference; rows of the clean slot and rows without adapter, which share
    # every tile with them, are the reference's (a kernel that zeroes the other rows' operand of a
    # shared dot gives them 0·NaN = NaN)
    inp = _poisoned(shape, device, dtype, float(value))
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    _assert_poison_stays_in_its_slot(out, ref, inp.lora_ids, dtype)


# --- bad input: a clear ValueError naming the argument ------------------------------------------
BAD = [
    ("hidden_states_1d", lambda a: a.update(hidden_states=a["hidden_states"][0]), "hidden_states"),
    ("hidden_states_int", lambda a: a.update(hidden_states=a["hidden_states"].int()), "hidden_states"),
    ("w13_wrong_H", lambda a: a.update(w13=a["w13"][..., :-1]), "w13"),
    ("w2_wrong_I", lambda a: a.update(w2=a["w2"][..., :-1]), "w2"),
    ("w2_dtype", lambda a: a.update(w2=a["w2"].half()), "w2"),
    ("topk_weights_fp16", lambda a: a.update(topk_weights=a["topk_weights"].half()), "topk_weights"),
    ("topk_ids_float", lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids"),
    ("topk_ids_out_of_range", lambda a: a.update(topk_ids=a["topk_ids"] + 100), "topk_ids"),
    ("topk_ids_negative", lambda a: a.update(topk_ids=a["topk_ids"] - 100), "topk_ids"),
    ("lora_ids_too_large", lambda a: a.update(lora_ids=a["lora_ids"] + 10), "lora_ids"),
    ("lora_ids_below_minus1", lambda a: a.update(lora_ids=a["lora_ids"] - 10), "lora_ids"),
    ("lora_ids_int16", lambda a: a.update(lora_ids=a["lora_ids"].short()), "lora_ids"),
    ("lora_ids_wrong_T", lambda a: a.update(lora_ids=a["lora_ids"][:-1]), "lora_ids"),
    ("lora_a13_4d", lambda a: a.update(lora_a13=a["lora_a13"][:, :, 0]), "lora_a13"),
    ("lora_b13_wrong_R", lambda a: a.update(lora_b13=a["lora_b13"][..., :-1]), "lora_b13"),
    ("lora_a2_wrong_E", lambda a: a.update(lora_a2=a["lora_a2"][:, :-1]), "lora_a2"),
    ("lora_b2_wrong_H", lambda a: a.update(lora_b2=a["lora_b2"][:, :, :-1]), "lora_b2"),
    ("b13_wrong", lambda a: a.update(b13=a["w13"][:, :, 0][:, :-1]), "b13"),
    ("activation", lambda a: a.update(activation="gelu"), "activation"),
    ("stage", lambda a: a.update(stage="fastest"), "stage"),
    ("config_type", lambda a: a.update(config={"BLOCK_SIZE_M": 16}), "config"),
]


@pytest.mark.parametrize("mutate,name", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_argument(mutate, name):
    inp = _inputs(TINY, "cpu", torch.float32, num_tokens=6)
    kw = dict(
        zip(
            [
                "hidden_states",
                "w13",
                "w2",
                "topk_weights",
                "topk_ids",
                "lora_ids",
                "lora_a13",
                "lora_b13",
                "lora_a2",
                "lora_b2",
            ],
            inp.args(),
        )
    )
    kw.update(inp.kwargs())
    mutate(kw)
    with pytest.raises(ValueError, match=name):
        fused_moe_lora(**kw)


def test_wrong_device_raises():
    # a tensor on another device than hidden_states (meta stands in for a second GPU on a CPU box)
    inp = _inputs(TINY, "cpu", torch.float32, num_tokens=6)
    args = list(inp.args())
    args[6] = args[6].to("meta")
    with pytest.raises(ValueError, match="lora_a13"):
        fused_moe_lora(*args, **inp.kwargs())


# --- GPU: bf16 at model shapes ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize(
    "model,T", [("gpt-oss-20b", 1), ("gpt-oss-20b", 100), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 1600)]
)
def test_model_shapes_bf16_gpu(model, T, stage):
    inp = make_inputs(
        get_shape(model), T, rank=32, num_adapters=8, pattern="mixed", dtype=torch.bfloat16, device="cuda"
    )
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    assert_close_rel(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["tuned", "fused"])
@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_non_finite_adapter_weights_stay_in_their_slot_bf16_gpu(model, stage):
    # the CPU test's poisoned slots at model shapes in bf16: tensor-core dots, the shipped configs
    inp = _poisoned(get_shape(model), "cuda", torch.bfloat16, float("nan"), rank=32)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    _assert_poison_stays_in_its_slot(out, ref, inp.lora_ids, torch.bfloat16)


def test_bf16_on_cpu_is_rejected():
    # the interpreter multiplies raw bf16 bits: refuse instead of returning garbage
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    inp = _inputs(TINY, "cpu", torch.bfloat16, num_tokens=4)
    with pytest.raises(ValueError, match="bfloat16"):
        fused_moe_lora(*inp.args(), **inp.kwargs())


def test_empty_batch_still_checks_config():
    inp = _inputs(TINY, "cpu", torch.float32, num_tokens=4)
    args = [a[:0] if i in (0, 3, 4, 5) else a for i, a in enumerate(inp.args())]
    with pytest.raises(ValueError, match="config"):
        fused_moe_lora(*args, **inp.kwargs(), config="garbage")
