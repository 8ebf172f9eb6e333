"""Op-level edge cases of every stage's switches: the LoRA shrink and expand launchers called directly
on hand-made alignments, against torch references written here in float64.

Runs under the Triton interpreter on the CPU (fp32 and fp16; conftest sets TRITON_INTERPRET). Pairs
are kept tiny (a handful of tokens, K = 2, L = 2, E = 3) and blocks big, because the interpreter's
cost is programs × loop iterations.

Each stage is applied to an op config the way the layer does it (``Stage.adapt`` of a LayerConfig,
``use_even_k = stage.even_k``, ``specialize_lengths = stage.specialize_lengths``), so a case runs the
switches of that stage: naive/no_recompile force SPLIT_K = 1 and GROUP_SIZE_M = 1, split_k keeps
SPLIT_K, swizzle keeps GROUP_SIZE_M, even_k_fused_add adds the unmasked K loop and the fused add.

Error bound of the shrink (documented once, used by every shrink case). One output element is
y = Σ_k x_k a_k over K terms. Split s of SPLIT_K (= SK) accumulates n_s ≤ ceil(K / (BK·SK))·BK of
them in fp32 (a block dot per iteration added into the fp32 accumulator; whatever order the dot sums
in, a sum of n terms has error ≤ (n − 1)·u·Σ|terms|, u = eps(fp32)/2 = 2⁻²⁴). fp16 products are
exact in fp32; fp32 products add one rounding each (u per term; on a GPU the fp32 dot runs in tf32,
whose input rounding adds 2·2⁻¹¹ per term). The SK partials are then combined by atomic adds into a
zeroed fp32 buffer in an arbitrary order: SK − 1 more additions, each ≤ u·Σ|x_k a_k|. So

    |y − Σ x_k a_k| ≤ (n_s + SK + 1)·u·Σ_k |x_k a_k|   (+ 2·2⁻¹¹·Σ|x_k a_k| for tf32),

i.e. the split combination adds at most SK·u·Σ|x_k a_k| = (1/2)·SK·eps(fp32)·Σ|x_k a_k| on top of
the per-split dot (first order in u; γ_n = n·u/(1 − n·u) is used below). It is a worst-case bound,
deterministic in the data, so a result that passes once passes always: never rerun.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from moelora_lib.kernels import STAGES
from moelora_lib.kernels.config import LayerConfig, OpConfig
from moelora_lib.kernels.launchers import even_k, lora_expand, lora_shrink, lora_shrink_args
from moelora_lib.kernels.stages import LayerRun
from moelora_lib.kernels.triton_kernels import KERNELS
from moelora_lib.routing import align_tokens

DTYPES = [torch.float32, torch.float16]
DT_IDS = ["fp32", "fp16"]
F32, F16 = DTYPES
STAGE_NAMES = list(STAGES)
U32 = 2.0**-24  # unit roundoff of fp32 (eps/2)
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
POISON = 1234.5  # exactly representable in fp16 and fp32; a kernel never produces it here


# --------------------------------------------------------------------------------------------------
# routing, configs and references
# --------------------------------------------------------------------------------------------------
def make_routing(T: int, K: int, E: int, L: int, pattern: str, seed: int = 0):
    """topk_ids [T, K] (distinct experts per token) and lora_ids [T] for a lora pattern:
    ``all`` every token on an adapter (round robin), ``mixed`` every slot plus -1 tokens,
    ``none`` all -1, ``groups`` every (adapter, expert) group non-empty (T = L·E, K = 1 or 2;
    with K = 1 each group holds one pair, so every block of the static buffer is in use), ``pack``
    every token on adapter 0 and experts 0..K-1 (K blocks: the cheapest for long K loops)."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "pack":  # every token on adapter 0 with experts {0, 1}: 2 groups, 2 blocks (cheap)
        topk = torch.tensor([[k for k in range(K)]] * T, dtype=torch.int32)
        return topk, torch.zeros(T, dtype=torch.int32)
    if pattern == "groups":
        assert T == L * E and K in (1, 2)
        topk = [[(t % E), (t + 1) % E][:K] for t in range(T)]
        lora = [t // E for t in range(T)]
        return torch.tensor(topk, dtype=torch.int32), torch.tensor(lora, dtype=torch.int32)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    if pattern == "all":
        lora = torch.arange(T) % L
    elif pattern == "mixed":
        lora = torch.arange(T) % (L + 1) - 1  # -1, 0, 1, ..., L-1, -1, ...
    elif pattern == "none":
        lora = torch.full((T,), -1)
    else:
        raise ValueError(pattern)
    return topk, lora.to(torch.int32)


def stage_op(stage_name: str, shrink: OpConfig, expand: OpConfig):
    """(shrink cfg, expand cfg, op kwargs) as the stage launches them (through Stage.adapt)."""
    st = STAGES[stage_name]
    base = OpConfig(shrink.BLOCK_SIZE_M)
    lc = st.adapt(LayerConfig(base, base, shrink, expand, shrink, expand))
    return (
        lc.gate_up_shrink,
        lc.gate_up_expand,
        dict(use_even_k=st.even_k, specialize_lengths=st.specialize_lengths),
    )


def shrink_groups(cfg0: OpConfig, K: int):
    """Stages grouped by what their shrink launch computes: (adapted cfg, effective EVEN_K).

    Stages in one group launch the same arithmetic (naive and no_recompile differ only in integer
    specialization, which changes no value and is checked by tests/test_compile_sm90.py), so one
    run per group covers every stage's switches; the group's first stage is the one run."""
    groups: dict = {}
    for name in STAGE_NAMES:
        cfg, _, kw = stage_op(name, cfg0, replace(cfg0, SPLIT_K=1))
        key = (cfg, kw["use_even_k"] and even_k(K, cfg.BLOCK_SIZE_K, cfg.SPLIT_K))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def expand_groups(cfg0: OpConfig, R: int):
    """Stages grouped by what their expand computes: (adapted cfg, effective EVEN_K, fused add)."""
    groups: dict = {}
    for name in STAGE_NAMES:
        _, cfg, kw = stage_op(name, OpConfig(cfg0.BLOCK_SIZE_M), cfg0)
        key = (cfg, kw["use_even_k"] and even_k(R, cfg.BLOCK_SIZE_K), STAGES[name].fused_add)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def pair_groups(shrink_cfg: OpConfig, expand_cfg: OpConfig, K: int, R: int):
    groups: dict = {}
    for name in STAGE_NAMES:
        sc, ec, kw = stage_op(name, shrink_cfg, expand_cfg)
        key = (
            sc,
            ec,
            kw["use_even_k"] and even_k(K, sc.BLOCK_SIZE_K, sc.SPLIT_K),
            kw["use_even_k"] and even_k(R, ec.BLOCK_SIZE_K),
            STAGES[name].fused_add,
        )
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def ref_shrink(x, a5, topk_ids, lora_ids, rows_div):
    """float64 inter [S, P, R] (NaN rows for pairs without adapter) and Σ_k |x_k a_k| per element."""
    T, K = topk_ids.shape
    P = T * K
    p = torch.arange(P)
    lora = lora_ids.long().repeat_interleave(K)
    exp = topk_ids.reshape(-1).long()
    xr = x.double()[p // rows_div]  # [P, H]
    a = a5.double()[lora.clamp(min=0), exp]  # [P, S, R, H]
    y = torch.einsum("ph,psrh->spr", xr, a)
    s_abs = torch.einsum("ph,psrh->spr", xr.abs(), a.abs())
    y[:, lora < 0] = float("nan")
    return y, s_abs


def ref_expand(inter, b5, topk_ids, lora_ids, topk_w=None):
    """float64 delta [P, S·N] (NaN rows for pairs without adapter) and Σ_r |i_r b_r| (·|w|).

    The kernel rounds the fp32 rank intermediate to bf16 before its dot with bf16 weights (so does this);
    with fp16 or fp32 weights it keeps the intermediate in fp32 (tf32 on a GPU: fp16's range is too small
    for it, tests/test_fp16_overflow.py)."""
    T, K = topk_ids.shape
    lora = lora_ids.long().repeat_interleave(K)
    exp = topk_ids.reshape(-1).long()
    i = (inter.to(b5.dtype) if b5.dtype == torch.bfloat16 else inter).double()  # [S, P, R]
    b = b5.double()[lora.clamp(min=0), exp]  # [P, S, N, R]
    d = torch.einsum("spr,psnr->psn", i, b)
    d_abs = torch.einsum("spr,psnr->psn", i.abs(), b.abs())
    if topk_w is not None:
        d = d * topk_w.double()[:, None, None]
        d_abs = d_abs * topk_w.double().abs()[:, None, None]
    P = d.shape[0]
    d, d_abs = d.reshape(P, -1), d_abs.reshape(P, -1)
    d[lora < 0] = float("nan")
    return d, d_abs


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def shrink_bound(K: int, cfg: OpConfig, dtype, device) -> float:
    """Coefficient c with |err| ≤ c·Σ|x_k a_k| (module docstring)."""
    sk = cfg.SPLIT_K
    n_s = math.ceil(K / (cfg.BLOCK_SIZE_K * sk)) * cfg.BLOCK_SIZE_K
    c = gamma(n_s + sk + 1)
    if dtype == torch.float32 and device == "cuda":
        c += 2 * 2.0**-11
    return c


def assert_shrink_close(inter, ref, s_abs, c, what="inter"):
    has = ~torch.isnan(ref)
    err = (inter.double() - ref).abs()[has]
    lim = c * s_abs[has] + 1e-30
    worst = float((err / lim).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: |err| reaches {worst:.3g}× the bound {c:.3g}·Σ|x a|"


def assert_expand_close(out, base, delta, d_abs, dtype, R: int, has_rows, what="out", stored_delta=False):
    """|out − (base + delta)| ≤ u_out·|ref| + γ_{R+3}·(Σ|i b|·|w| + |base|) (+ u_out·Σ|i b|·|w|) on
    rows with an adapter.

    R products summed in fp32, the routing weight, the add of the base, then one rounding to the
    output dtype; ``stored_delta`` (stages without fused add: the delta is stored in the output dtype,
    then added by torch) adds that rounding of the delta. The rounding of inter to the weight dtype
    is in the reference."""
    ref = base.double()[has_rows] + delta[has_rows]
    err = (out.double()[has_rows] - ref).abs()
    da, ba = d_abs[has_rows], base.double()[has_rows].abs()
    lim = UNIT[dtype] * ref.abs() + gamma(R + 3) * (da + ba) + 1e-30
    if stored_delta:
        lim = lim + UNIT[dtype] * da * (1 + gamma(R + 3))
    if dtype != torch.bfloat16 and torch.cuda.is_available():
        lim = lim + 2.0**-11 * da  # the GPU's tf32 dot rounds the fp32 intermediate to a 10-bit mantissa
    worst = float((err / lim).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: |err| reaches {worst:.3g}× the bound"


def rand(*shape, dtype, device, scale=1.0, g=None):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def shrink_inputs(T, K, E, L, S, R, H, dtype, device, pattern="all", seed=0, down=False):
    g = torch.Generator().manual_seed(seed + 1)
    topk_ids, lora_ids = make_routing(T, K, E, L, pattern, seed)
    if down:  # down projection: x is [P, I], one slice, 4-D adapter, rows_div = 1
        x = rand(T * K, H, dtype=dtype, device=device, g=g)
        a = rand(L, E, R, H, dtype=dtype, device=device, scale=H**-0.5, g=g)
        return x, a, a.unsqueeze(2), topk_ids.to(device), lora_ids.to(device), 1
    x = rand(T, H, dtype=dtype, device=device, g=g)
    a5 = rand(L, E, S, R, H, dtype=dtype, device=device, scale=H**-0.5, g=g)
    return x, a5, a5, topk_ids.to(device), lora_ids.to(device), K


def run_shrink_poisoned(x, a, align, cfg, rows_div, use_even_k, specialize_lengths):
    """The shrink launch with a POISON-filled output buffer (the launcher's own arguments, via
    lora_shrink_args), so rows the kernel must not write can be checked bit for bit."""
    a5 = a if a.dim() == 5 else a.unsqueeze(2)
    L, E, S, R, K = a5.shape
    inter = torch.full((S, align.num_pairs, R), POISON, dtype=torch.float32, device=x.device)
    grid, args, cx = lora_shrink_args(x, a, inter, align, cfg, rows_div=rows_div, use_even_k=use_even_k)
    KERNELS["lora_shrink"][specialize_lengths][grid](
        *args, **cx, num_warps=cfg.NUM_WARPS, num_stages=cfg.NUM_STAGES
    )
    return inter


# --------------------------------------------------------------------------------------------------
# shrink
# --------------------------------------------------------------------------------------------------
# (id, H = the shrink's K, R, cfg) — one comment per edge. Tokens: 2 on adapter 0 ("pack", 2 blocks).
SHRINK_CASES = [
    # K = 2880 (GPT-OSS) with BK 64, SPLIT_K 4: 2880 % 256 = 64, the masked (not even) path; in the
    # last iteration only split 0 has live columns
    ("k2880_bk64_sk4_uneven", 2880, 16, OpConfig(16, 16, 64, 1, 4, 4, 2)),
    # K = 2048 with BK 64, SPLIT_K 4: 2048 % 256 = 0, the EVEN_K (unmasked) path where the stage has it
    ("k2048_bk64_sk4_even", 2048, 16, OpConfig(16, 16, 64, 1, 4, 4, 2)),
    # rank 8 < 16: the N tile is clamped to 16 and columns 8..15 masked (loads clamped in EVEN_K)
    ("rank8_tile16", 1024, 8, OpConfig(16, 16, 128, 1, 2, 4, 2)),
    # rank 16 = the tile: no N mask needed
    ("rank16_tile16", 1024, 16, OpConfig(16, 16, 128, 1, 2, 4, 2)),
    # empty splits: K = 1024, BK 256, SPLIT_K 8 -> one iteration covers 2048, splits 4..7 load nothing
    ("empty_splits_k1024_bk256_sk8", 1024, 16, OpConfig(16, 16, 256, 1, 8, 4, 2)),
    # N tail within a split: R = 48 over two 32-wide tiles (the second half masked), SPLIT_K 2
    ("rank48_tile32_tail", 512, 48, OpConfig(16, 32, 128, 1, 2, 4, 2)),
]
# each edge in one dtype (alternating; the shrink's arithmetic is the same fp32 dot in both)
SHRINK_PARAMS = [
    pytest.param(case, names[0], DTYPES[i % 2], id=f"{case[0]}-{'+'.join(names)}-{DT_IDS[i % 2]}")
    for i, case in enumerate(SHRINK_CASES)
    for names in shrink_groups(case[3], case[1])
]


@pytest.mark.parametrize("case,stage,dtype", SHRINK_PARAMS)
def test_shrink_edges(case, stage, dtype, device):
    # each K/rank/split edge through each stage's switches, vs the float64 reference within the bound
    _, H, R, cfg0 = case
    cfg, _, kw = stage_op(stage, cfg0, replace(cfg0, SPLIT_K=1))
    x, a, a5, topk_ids, lora_ids, rows_div = shrink_inputs(2, 2, 3, 2, 1, R, H, dtype, device, pattern="pack")
    align = align_tokens(topk_ids, 3, cfg.BLOCK_SIZE_M, lora_ids=lora_ids, num_adapters=2)
    inter = lora_shrink(x, a, align, cfg, rows_div=rows_div, **kw)
    ref, s_abs = ref_shrink(x.cpu(), a5.cpu(), topk_ids.cpu(), lora_ids.cpu(), rows_div)
    assert inter.shape == ref.shape and inter.dtype == torch.float32
    assert_shrink_close(inter.cpu(), ref, s_abs, shrink_bound(H, cfg, dtype, device))


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
def test_shrink_two_slices_down_and_gate_up(dtype, device):
    # gate_up with S = 2 slices (slice stride of inter = P·R) and the down projection (4-D adapter,
    # S = 1, x rows are pairs: rows_div = 1), every slot plus -1 tokens, K = 2880, BK 128, SPLIT_K 4
    cfg = OpConfig(16, 16, 128, 1, 4, 4, 2)
    for down in (False, True):
        x, a, a5, topk_ids, lora_ids, rows_div = shrink_inputs(
            3, 2, 3, 2, 2, 16, 2880, dtype, device, pattern="mixed", down=down
        )
        align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
        inter = lora_shrink(x, a, align, cfg, rows_div=rows_div, use_even_k=True)
        ref, s_abs = ref_shrink(x.cpu(), a5.cpu(), topk_ids.cpu(), lora_ids.cpu(), rows_div)
        assert inter.shape == ref.shape
        assert_shrink_close(
            inter.cpu(),
            ref,
            s_abs,
            shrink_bound(2880, cfg, dtype, device),
            what="down" if down else "gate_up",
        )
        assert (inter.cpu()[torch.isnan(ref)] == 0).all()  # SPLIT_K > 1: no-adapter rows stay zero


def test_shrink_bound_can_fail():
    # the bound is tight enough to catch a lost K block: dropping the last 64 of 2880 terms exceeds it
    x, a, a5, topk_ids, lora_ids, rows_div = shrink_inputs(3, 2, 3, 2, 2, 16, 2880, torch.float32, "cpu")
    ref, s_abs = ref_shrink(x, a5, topk_ids, lora_ids, rows_div)
    lost, _ = ref_shrink(x[:, :-64], a5[..., :-64], topk_ids, lora_ids, rows_div)
    with pytest.raises(AssertionError):
        assert_shrink_close(
            lost.float(), ref, s_abs, shrink_bound(2880, OpConfig(16, 16, 64, 1, 4), torch.float32, "cpu")
        )


BITWISE_CFG = OpConfig(16, 16, 128, 4, 1, 4, 2)  # SPLIT_K 1; GROUP_SIZE_M 4 where the stage swizzles
BITWISE_PARAMS = [pytest.param(names[0], id="+".join(names)) for names in shrink_groups(BITWISE_CFG, 2048)]


@pytest.mark.parametrize("dtype", [F32], ids=["fp32"])
@pytest.mark.parametrize("stage", BITWISE_PARAMS)
def test_shrink_splitk1_bitwise(stage, dtype, device):
    # SPLIT_K = 1 is deterministic: two runs equal bit for bit, and equal to the naive stage's output
    # (EVEN_K, swizzle and specialization change no arithmetic); K = 2880 masked and 2048 even
    for H in (2880, 2048):
        x, a, _, topk_ids, lora_ids, rows_div = shrink_inputs(
            3, 2, 3, 2, 1, 16, H, dtype, device, pattern="mixed"
        )
        align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
        names = (stage, stage, "naive") if stage != "naive" else (stage, stage)
        outs = []
        for name in names:
            cfg, _, kw = stage_op(name, BITWISE_CFG, BITWISE_CFG)
            outs.append(run_shrink_poisoned(x, a, align, cfg, rows_div, **kw))
        assert torch.equal(outs[0], outs[1]), f"H={H}: two SPLIT_K=1 runs differ"
        assert torch.equal(outs[0], outs[-1]), f"H={H}: stage {stage} differs from naive at SPLIT_K=1"


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
@pytest.mark.parametrize("split_k", [1, 4], ids=["sk1", "sk4"])
def test_shrink_partial_swizzle_group(split_k, dtype, device):
    # GROUP_SIZE_M = 4 over 6 blocks, all in use (one pair per (adapter, expert) group), so the last
    # group {4, 5} is partial and does work; × 2 N tiles (R 64, BN 32): every tile written once,
    # equal to row-major order (bitwise at SPLIT_K 1), within the bound; SPLIT_K 4 with K = 256,
    # BK 128 also has two empty splits per tile
    L, E = 2, 3
    x, a, a5, topk_ids, lora_ids, rows_div = shrink_inputs(
        L * E, 1, E, L, 1, 64, 256, dtype, device, pattern="groups"
    )
    align = align_tokens(topk_ids, E, 16, lora_ids=lora_ids, num_adapters=L)
    assert align.num_blocks == 6 and int(align.num_tokens_post_padded) == 6 * 16
    swz = OpConfig(16, 32, 128, 4, split_k, 4, 2)
    ref, s_abs = ref_shrink(x.cpu(), a5.cpu(), topk_ids.cpu(), lora_ids.cpu(), rows_div)
    if split_k == 1:
        grouped = run_shrink_poisoned(x, a, align, swz, rows_div, True, False)
        rowmaj = run_shrink_poisoned(x, a, align, replace(swz, GROUP_SIZE_M=1), rows_div, True, False)
        assert not (grouped == POISON).any(), "a tile of the partial group was never written"
        assert torch.equal(grouped, rowmaj)
    else:
        grouped = lora_shrink(x, a, align, swz, rows_div=rows_div, use_even_k=True)
    assert_shrink_close(grouped.cpu(), ref, s_abs, shrink_bound(256, swz, dtype, device))


@pytest.mark.parametrize("dtype", [F32], ids=["fp32"])
@pytest.mark.parametrize("pattern", ["none", "mixed"], ids=["all_minus1", "every_slot_plus_minus1"])
@pytest.mark.parametrize("split_k", [1, 4], ids=["sk1", "sk4"])
def test_shrink_no_adapter_rows_untouched(split_k, pattern, dtype, device):
    # all -1 tokens: the shrink writes nothing; every slot + -1: only the -1 pairs' rows stay untouched
    # (poisoned buffer for SPLIT_K 1 — bit-identical after; the launcher's zeroed buffer for SPLIT_K 4)
    cfg = OpConfig(16, 16, 256, 4, split_k, 4, 2)
    x, a, a5, topk_ids, lora_ids, rows_div = shrink_inputs(
        5, 2, 3, 2, 1, 16, 1024, dtype, device, pattern=pattern
    )
    align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
    if split_k == 1:
        inter, fill = run_shrink_poisoned(x, a, align, cfg, rows_div, True, False), POISON
    else:
        inter, fill = lora_shrink(x, a, align, cfg, rows_div=rows_div, use_even_k=True), 0.0
    ref, s_abs = ref_shrink(x.cpu(), a5.cpu(), topk_ids.cpu(), lora_ids.cpu(), rows_div)
    untouched = torch.isnan(ref)
    assert untouched.any()
    assert torch.equal(inter.cpu()[untouched], torch.full_like(inter.cpu()[untouched], fill))
    if pattern == "none":
        assert untouched.all()
    else:
        assert_shrink_close(inter.cpu(), ref, s_abs, shrink_bound(1024, cfg, dtype, device))


# --------------------------------------------------------------------------------------------------
# expand
# --------------------------------------------------------------------------------------------------
def expand_inputs(T, K, E, L, S, N, R, dtype, device, pattern="all", seed=0, weighted=False):
    g = torch.Generator().manual_seed(seed + 7)
    topk_ids, lora_ids = make_routing(T, K, E, L, pattern, seed)
    P = T * K
    inter = torch.randn(S, P, R, generator=g).to(device)  # fp32, like the shrink's
    b = rand(L, E, S, N, R, dtype=dtype, device=device, scale=R**-0.5, g=g)
    base = rand(P, S * N, dtype=dtype, device=device, g=g)  # the base output tile
    tw = torch.rand(P, generator=g).to(device) if weighted else None
    return inter, b, base, topk_ids.to(device), lora_ids.to(device), tw


def stage_expand(stage_name, inter, b, out, align, cfg, tw, use_even_k, specialize_lengths):
    """The expand half of LayerRun._lora_pair for this stage: fused add, or a zeroed delta + add."""
    if STAGES[stage_name].fused_add:
        return lora_expand(
            inter,
            b,
            out,
            align,
            cfg,
            topk_weights=tw,
            add_inputs=True,
            use_even_k=use_even_k,
            specialize_lengths=specialize_lengths,
        )
    delta = torch.zeros_like(out)
    lora_expand(
        inter,
        b,
        delta,
        align,
        cfg,
        topk_weights=tw,
        add_inputs=False,
        use_even_k=use_even_k,
        specialize_lengths=specialize_lengths,
    )
    return out.add_(delta)


# (id, S, N, R, cfg, weighted) — one comment per edge.
EXPAND_CASES = [
    # N tail: N = 192 with BN 128 (second tile half masked), two slices (gate and up) at offsets s·N
    ("n192_bn128_S2", 2, 192, 16, OpConfig(16, 128, 16, 1, 1, 4, 2), False),
    # N tail: N = 2880 with BN 256 (2880 % 256 = 64), routed weights (the down projection)
    ("n2880_bn256_weighted", 1, 2880, 16, OpConfig(16, 256, 16, 1, 1, 4, 2), True),
    # rank 8 < 16: the K tile is clamped to 16 and masked (EVEN_K false even when the stage allows it)
    ("rank8_tile16", 1, 64, 8, OpConfig(16, 64, 16, 1, 1, 4, 2), False),
    # rank 16 = the K tile: EVEN_K where the stage has it
    ("rank16_tile16", 2, 64, 16, OpConfig(16, 64, 16, 1, 1, 4, 2), True),
    # rank 32 over two K iterations of 16
    ("rank32_two_k_iters", 1, 96, 32, OpConfig(16, 64, 16, 1, 1, 4, 2), False),
]


# each edge in one dtype, alternating, so both dot forms (bf16/fp32 operands, fp16 widened to fp32) run
EXPAND_PARAMS = [
    pytest.param(case, names[0], DTYPES[i % 2], id=f"{case[0]}-{'+'.join(names)}-{DT_IDS[i % 2]}")
    for i, case in enumerate(EXPAND_CASES)
    for names in expand_groups(case[4], case[3])
]


@pytest.mark.parametrize("case,stage,dtype", EXPAND_PARAMS)
def test_expand_edges(case, stage, dtype, device):
    # each N/rank edge through each stage's switches: out = base + delta on adapter rows (within the
    # bound), base rows of no-adapter pairs bit-identical (every slot plus -1 tokens)
    _, S, N, R, cfg0, weighted = case
    _, cfg, kw = stage_op(stage, OpConfig(16), cfg0)
    inter, b, base, topk_ids, lora_ids, tw = expand_inputs(
        3, 2, 3, 2, S, N, R, dtype, device, pattern="mixed", weighted=weighted
    )
    align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
    out = stage_expand(stage, inter, b, base.clone(), align, cfg, tw, **kw)
    delta, d_abs = ref_expand(
        inter.cpu(), b.cpu(), topk_ids.cpu(), lora_ids.cpu(), tw.cpu() if tw is not None else None
    )
    has = ~torch.isnan(delta[:, 0])
    assert has.any() and (~has).any()
    assert torch.equal(out.cpu()[~has], base.cpu()[~has])
    assert_expand_close(
        out.cpu(), base.cpu(), delta, d_abs, dtype, R, has, stored_delta=not STAGES[stage].fused_add
    )


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "store"])
def test_expand_all_minus1_writes_nothing(add_inputs, dtype, device):
    # all -1 tokens: the expand writes nothing, poisoned output stays bit-identical
    cfg = OpConfig(16, 128, 16, 4, 1, 4, 2)
    inter, b, _, topk_ids, lora_ids, tw = expand_inputs(3, 2, 3, 2, 2, 192, 16, dtype, device, pattern="none")
    align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
    out = torch.full((6, 2 * 192), POISON, dtype=dtype, device=device)
    lora_expand(inter, b, out, align, cfg, add_inputs=add_inputs, use_even_k=True)
    assert (out == POISON).all()


@pytest.mark.parametrize("dtype", [F32], ids=["fp32"])
def test_expand_store_leaves_no_adapter_rows(dtype, device):
    # add_inputs=False stores the delta on adapter rows and leaves rows of no-adapter pairs untouched
    cfg = OpConfig(16, 128, 16, 1, 1, 4, 2)
    inter, b, _, topk_ids, lora_ids, tw = expand_inputs(
        5, 2, 3, 2, 2, 192, 16, dtype, device, pattern="mixed", weighted=True
    )
    align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
    out = torch.full((10, 2 * 192), POISON, dtype=dtype, device=device)
    lora_expand(inter, b, out, align, cfg, topk_weights=tw, add_inputs=False, use_even_k=True)
    delta, d_abs = ref_expand(inter.cpu(), b.cpu(), topk_ids.cpu(), lora_ids.cpu(), tw.cpu())
    has = ~torch.isnan(delta[:, 0])
    assert (out.cpu()[~has] == POISON).all()
    assert_expand_close(out.cpu(), torch.zeros_like(out.cpu()), delta, d_abs, dtype, 16, has)


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
def test_expand_fused_add_twice(dtype, device):
    # add_inputs=True twice on the same output adds the delta twice (no stale state): in fp32 exactly
    # out1 = base + d and out2 = out1 + d with d the stored delta; in fp16 within the bound
    cfg = OpConfig(16, 128, 16, 1, 1, 4, 2)
    inter, b, base, topk_ids, lora_ids, tw = expand_inputs(
        3, 2, 3, 2, 2, 192, 16, dtype, device, pattern="mixed", weighted=True
    )
    align = align_tokens(topk_ids, 3, 16, lora_ids=lora_ids, num_adapters=2)
    out = base.clone()
    lora_expand(inter, b, out, align, cfg, topk_weights=tw, add_inputs=True, use_even_k=True)
    out1 = out.clone()
    lora_expand(inter, b, out, align, cfg, topk_weights=tw, add_inputs=True, use_even_k=True)
    delta, d_abs = ref_expand(inter.cpu(), b.cpu(), topk_ids.cpu(), lora_ids.cpu(), tw.cpu())
    has = ~torch.isnan(delta[:, 0])
    assert torch.equal(out.cpu()[~has], base.cpu()[~has])
    if dtype == torch.float32:
        d = torch.zeros_like(base)
        lora_expand(inter, b, d, align, cfg, topk_weights=tw, add_inputs=False, use_even_k=True)
        assert torch.equal(out1[has.to(out.device)], (base + d)[has.to(out.device)])
        assert torch.equal(out[has.to(out.device)], (out1 + d)[has.to(out.device)])
    assert_expand_close(out1.cpu(), base.cpu(), delta, d_abs, dtype, 16, has, what="first add")
    assert_expand_close(out.cpu(), out1.cpu(), delta, d_abs, dtype, 16, has, what="second add")


@pytest.mark.parametrize("dtype", [F32], ids=["fp32"])
def test_expand_partial_swizzle_group(dtype, device):
    # GROUP_SIZE_M = 4 over 6 blocks all in use (the last group {4, 5} partial) × 3 N tiles (N 192,
    # BN 64): bitwise equal to row-major order and every adapter row written
    L, E = 2, 3
    cfg = OpConfig(16, 64, 16, 4, 1, 4, 2)
    inter, b, _, topk_ids, lora_ids, _ = expand_inputs(
        L * E, 1, E, L, 1, 192, 16, dtype, device, pattern="groups"
    )
    align = align_tokens(topk_ids, E, 16, lora_ids=lora_ids, num_adapters=L)
    assert align.num_blocks == 6 and int(align.num_tokens_post_padded) == 6 * 16
    outs = []
    for c in (cfg, replace(cfg, GROUP_SIZE_M=1)):
        out = torch.full((6, 192), POISON, dtype=dtype, device=device)
        outs.append(lora_expand(inter, b, out, align, c, add_inputs=False, use_even_k=True))
    assert not (outs[0] == POISON).any()
    assert torch.equal(outs[0], outs[1])
    delta, d_abs = ref_expand(inter.cpu(), b.cpu(), topk_ids.cpu(), lora_ids.cpu())
    has = torch.ones(6, dtype=torch.bool)
    assert_expand_close(outs[0].cpu(), torch.zeros(6, 192), delta, d_abs, dtype, 16, has)


# --------------------------------------------------------------------------------------------------
# the shrink + expand pair exactly as the layer runs it
# --------------------------------------------------------------------------------------------------
PAIR_SHRINK = OpConfig(16, 16, 128, 4, 4, 4, 2)
PAIR_EXPAND = OpConfig(16, 128, 16, 4, 1, 4, 2)
PAIR_PARAMS = [
    pytest.param(names[0], id="+".join(names)) for names in pair_groups(PAIR_SHRINK, PAIR_EXPAND, 2880, 16)
]


@pytest.mark.parametrize("dtype", [F16], ids=["fp16"])
@pytest.mark.parametrize("stage", PAIR_PARAMS)
def test_lora_pair_through_stage(stage, dtype, device):
    # LayerRun.lora_down of each stage (down projection: 4-D adapters, rows_div 1, routed weights,
    # K = 2880 with BK 128 and SPLIT_K 4, N = 192 with BN 128, every slot plus -1) = base + w·(x·Aᵀ)·Bᵀ
    T, K, E, L, R, I, N = 3, 2, 3, 2, 16, 2880, 192
    lc = STAGES[stage].adapt(
        LayerConfig(OpConfig(16), OpConfig(16), PAIR_SHRINK, PAIR_EXPAND, PAIR_SHRINK, PAIR_EXPAND)
    )
    g = torch.Generator().manual_seed(3)
    topk_ids, lora_ids = make_routing(T, K, E, L, "mixed")
    x = rand(T * K, I, dtype=dtype, device=device, g=g)
    a2 = rand(L, E, R, I, dtype=dtype, device=device, scale=I**-0.5, g=g)
    b2 = rand(L, E, N, R, dtype=dtype, device=device, scale=R**-0.5, g=g)
    base = rand(T * K, N, dtype=dtype, device=device, g=g)
    tw = torch.rand(T * K, generator=g).to(device)
    # a real LayerRun (its down pair reads g and adds into y): x plays g, base plays y
    H, S = N, 1
    run = LayerRun(
        STAGES[stage],
        rand(T, H, dtype=dtype, device=device, g=g),
        rand(E, 2 * I, H, dtype=dtype, device=device, g=g),
        rand(E, H, I, dtype=dtype, device=device, g=g),
        tw.view(T, K),
        topk_ids.to(device),
        lora_ids.to(device),
        rand(L, E, S, R, H, dtype=dtype, device=device, g=g),
        rand(L, E, S, 2 * I, R, dtype=dtype, device=device, g=g),
        a2,
        b2,
        activation="silu",
        config=LayerConfig(OpConfig(16), OpConfig(16), PAIR_SHRINK, PAIR_EXPAND, PAIR_SHRINK, PAIR_EXPAND),
    )
    assert run.cfg == lc and run.lora_align.block_size_m == 16
    run.g, run.y = x, base.clone()
    run.lora_down()
    out = run.y
    inter64, s_abs = ref_shrink(x.cpu(), a2.unsqueeze(2).cpu(), topk_ids, lora_ids, 1)
    inter_ref = torch.nan_to_num(inter64).float()
    delta, d_abs = ref_expand(inter_ref, b2.unsqueeze(2).cpu(), topk_ids, lora_ids, tw)
    has = ~torch.isnan(delta[:, 0])
    assert torch.equal(out.cpu()[~has], base.cpu()[~has])
    # the kernel's fp32 inter differs from inter_ref by ≤ c·Σ|x a| (shrink bound) + u32·|inter|, and
    # rounding two such values to the weight dtype may differ by one more unit: propagate
    # |Δi| ≤ c·Σ|x a| + (u32 + 2·u_w)·|i| through |B| and |w| into the expand bound
    c = shrink_bound(I, lc.down_shrink, dtype, device)
    u_w = UNIT[dtype] if dtype != torch.float32 else 0.0
    di = c * torch.nan_to_num(s_abs) + (U32 + 2 * u_w) * inter_ref.double().abs()
    pair_l, pair_e = lora_ids.long().repeat_interleave(K).clamp(min=0), topk_ids.reshape(-1).long()
    b_sel = b2.double().cpu().abs()[pair_l, pair_e]
    prop = torch.einsum("spr,psnr->pn", di, b_sel.unsqueeze(1))
    prop = prop * tw.double().cpu()[:, None]
    ref = base.double().cpu()[has] + delta[has]
    err = (out.double().cpu()[has] - ref).abs()
    lim = (
        UNIT[dtype] * ref.abs()
        + gamma(R + 3) * (d_abs[has] + base.double().cpu()[has].abs())
        + prop[has] * (1 + gamma(R + 3))
    )
    if not STAGES[stage].fused_add:  # the delta is stored in the output dtype, then added
        lim = lim + UNIT[dtype] * (d_abs[has] + prop[has]) * (1 + gamma(R + 3))
    worst = float((err / lim).max())
    assert worst <= 1.0, f"|err| reaches {worst:.3g}× the bound"
