"""One-launch base + LoRA alignment (moelora_lib.kernels.align_small) against the torch oracle
routing.align_tokens (check_values=False): bit for bit, both alignments.

CPU: the Triton interpreter (tests/conftest.py). The kernel's sort is built from plain sums, so even
T·K = SMALL_MAX_PAIRS takes well under a second there. The sm_90 compile check runs in a subprocess
without TRITON_INTERPRET (the kernels cannot compile in a process that decorated them under it).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moelora_lib.kernels import align_small as AS
from moelora_lib.kernels.align_small import (
    MAX_GROUPS,
    SMALL_MAX_PAIRS,
    PairWorkspace,
    align_tokens_pair,
    pair_workspace,
)
from moelora_lib.routing import align_tokens

FIELDS = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")
GPT_OSS = (32, 4, 8)  # E, K, L
QWEN3 = (128, 8, 8)


def _ids(T, K, E, L, device, seed=0, dtype=torch.int32, lora_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(0, E, (T, K), generator=g).to(dtype)
    lora = torch.randint(-1, L, (T,), generator=g).to(lora_dtype)
    return topk.to(device), lora.to(device)


def _check_one(got, ref):
    for f in FIELDS:
        r, g = getattr(ref, f), getattr(got, f)
        assert g.dtype == torch.int32 and g.shape == r.shape, (f, g.dtype, g.shape, r.shape)
        assert torch.equal(g.cpu(), r.cpu()), f"{f} differs:\n got {g}\n ref {r}"
    assert (got.block_size_m, got.num_pairs, got.num_blocks) == (
        ref.block_size_m,
        ref.num_pairs,
        ref.num_blocks,
    )


def _same(ids, E, bb, lora, L, bl, incl=False, **kw):
    """Both alignments == the oracle's, bit for bit; returns them."""
    base, lo = align_tokens_pair(ids, E, bb, lora, L, bl, include_no_adapter=incl, **kw)
    _check_one(base, align_tokens(ids, E, bb, check_values=False))
    _check_one(lo, align_tokens(ids, E, bl, lora, L, incl, check_values=False))
    return base, lo


@pytest.mark.parametrize(
    "model,T,bb,bl",
    [(GPT_OSS, 1, 16, 16), (QWEN3, 64, 64, 16), (GPT_OSS, 256, 32, 64)],
    ids=["gpt-oss-T1", "qwen3-T64", "gpt-oss-T256"],
)
def test_model_shapes(device, model, T, bb, bl):
    E, K, L = model
    ids, lora = _ids(T, K, E, L, device, seed=T + bb + bl)
    _same(ids, E, bb, lora, L, bl)


@pytest.mark.parametrize(
    "T,K,E,L,bb,bl,incl",
    [
        (0, 4, 8, 2, 16, 16, False),  # T = 0
        (5, 0, 8, 2, 16, 16, False),  # K = 0
        (1, 1, 4, 1, 32, 16, False),  # T = 1, K = 1, L = 1
        (7, 2, 1, 3, 16, 16, True),  # E = 1
        (9, 4, 6, 3, 16, 32, True),  # include_no_adapter: slot L laid out last
        (20, 8, 16, 5, 128, 16, True),
        (33, 2, 128, 2, 16, 64, False),
    ],
)
def test_small_cases(device, T, K, E, L, bb, bl, incl):
    ids, lora = _ids(T, K, E, L, device, seed=T * 7 + K)
    _same(ids, E, bb, lora, L, bl, incl)


def test_max_pairs(device):
    """T·K = SMALL_MAX_PAIRS (Qwen3 T = 256)."""
    E, K, L = QWEN3
    T = SMALL_MAX_PAIRS // K
    ids, lora = _ids(T, K, E, L, device, seed=3)
    _same(ids, E, 16, lora, L, 16)
    _same(ids, E, 64, lora, L, 32, incl=True)


def test_random_sweep(device):
    g = torch.Generator().manual_seed(11)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    for i in range(4):
        K, E, L = pick([1, 2, 4, 8]), pick([1, 3, 16, 32, 128]), pick([1, 2, 5, 8])
        T = int(torch.randint(0, min(300, SMALL_MAX_PAIRS // K) + 1, (1,), generator=g))
        ids, lora = _ids(T, K, E, L, device, seed=i)
        _same(ids, E, pick([16, 32, 64]), lora, L, pick([16, 32, 64]), incl=bool(i % 3 == 0))


def test_int64_and_strided_ids(device):
    E, K, L = GPT_OSS
    ids, lora = _ids(40, K, E, L, device, seed=4, dtype=torch.int64, lora_dtype=torch.int64)
    _same(ids, E, 16, lora, L, 32)
    # non-contiguous topk_ids (a transposed buffer), lora_ids with stride 2, int32 and int64 mixed
    t = ids.t().contiguous().t().int()
    lb = torch.stack([lora, lora]).t().reshape(-1)[::2]
    assert not t.is_contiguous() and lb.stride(0) == 2
    _same(t, E, 16, lb, L, 16)
    # offset views (data pointers not 16-byte aligned)
    _same(torch.cat([ids.new_zeros(1, K), ids])[1:], E, 32, torch.cat([lora.new_zeros(1), lora])[1:], L, 16)


def test_all_tokens_one_group(device):
    T, E, L = 50, 8, 3
    ids = torch.tensor([3, 0, 5, 7], dtype=torch.int32).repeat(T, 1).to(device)
    one = torch.full((T,), 1, dtype=torch.int32, device=device)
    base, lo = _same(ids, E, 16, one, L, 16)
    assert int(base.num_tokens_post_padded) == 4 * 64 and int(lo.num_tokens_post_padded) == 4 * 64
    ids1 = torch.full((T, 1), 2, dtype=torch.int32, device=device)  # literally one group
    base, lo = _same(ids1, E, 16, one, L, 64)
    assert lo.block_expert_ids.tolist()[0] == 2 and lo.block_lora_ids.tolist()[0] == 1
    none = torch.full((T,), -1, dtype=torch.int32, device=device)  # no adapter at all
    base, lo = _same(ids, E, 16, none, L, 16)
    assert int(lo.num_tokens_post_padded) == 0 and (lo.sorted_token_ids == T * 4).all()
    _, lo = _same(ids, E, 16, none, L, 16, incl=True)  # all in slot L: lora -1 on every block
    assert (lo.block_lora_ids == -1).all()


def test_empty_groups(device):
    """Only experts 0 and E-1, adapters 0 and L-1: most groups empty."""
    T, K, E, L = 30, 2, 64, 4
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 2, (T, K), generator=g) * (E - 1)).int().to(device)
    lora = (torch.randint(0, 2, (T,), generator=g) * (L - 1)).int().to(device)
    lora[0] = -1
    for incl in (False, True):
        _same(ids, E, 32, lora, L, 16, incl)


def test_several_rows(device, monkeypatch):
    """ROW_PAIRS below the pair vector: NR rows, per-row counts summed across rows; NR·next_pow2(G)
    above the register tile takes the group-chunk loop (Qwen3 at 2048 pairs, 32 rows of 64)."""
    monkeypatch.setattr(AS, "ROW_PAIRS", 64)
    for model, T in ((GPT_OSS, 300), (QWEN3, 256)):
        E, K, L = model
        ids, lora = _ids(T, K, E, L, device, seed=T)
        ws = pair_workspace(T * K, E, 16, L, 32, device=device)
        assert ws.table_rows == AS.pairs_block(T * K) // 64
        _same(ids, E, 16, lora, L, 32, out=ws)
        _same(ids, E, 16, lora, L, 32, incl=True)
    # a workspace built for one row cannot serve a call that needs several
    monkeypatch.setattr(AS, "ROW_PAIRS", SMALL_MAX_PAIRS)
    ws1 = pair_workspace(320, 8, 16, 2, 16, device=device)
    monkeypatch.setattr(AS, "ROW_PAIRS", 64)
    ids, lora = _ids(40, 8, 8, 2, device)
    with pytest.raises(ValueError, match="rows"):
        align_tokens_pair(ids, 8, 16, lora, 2, 16, out=ws1)


def test_workspace_reuse(device):
    """A smaller T after a larger one: the returned prefixes hold no stale entries; views of the
    workspace at fixed offsets."""
    E, K, L = QWEN3
    ws = pair_workspace(SMALL_MAX_PAIRS, E, 16, L, 32, device=device)
    assert isinstance(ws, PairWorkspace)
    elem = ws.buffer.element_size()
    for part in (ws.base, ws.lora, ws.tables):
        for v in part.values():
            off = (v.data_ptr() - ws.buffer.data_ptr()) // elem
            assert off % 32 == 0 and v.data_ptr() % 16 == 0
    for T in (256, 3, 64, 1, 0, 200):
        ids, lora = _ids(T, K, E, L, device, seed=T)
        base, lo = _same(ids, E, 16, lora, L, 32, out=ws)
        assert base.sorted_token_ids.data_ptr() == ws.base["sorted"].data_ptr()
        assert lo.block_lora_ids.data_ptr() == ws.lora["block_l"].data_ptr()
        assert lo.num_tokens_post_padded.data_ptr() == ws.lora["npost"].data_ptr()


def _invariants(al, ids, E, lora, L, keep):
    """Each pair with keep[p] exactly once among the valid entries, in a block of its group, pair ids
    ascending inside a block, sentinel elsewhere, -1 block ids past the end."""
    ids, N = ids.cpu(), ids.numel()
    K = ids.shape[1]
    n, BM = int(al.num_tokens_post_padded), al.block_size_m
    s = al.sorted_token_ids.cpu()
    assert n % BM == 0 and n <= s.numel() and (s[n:] == N).all()
    valid = s[:n][s[:n] < N].long()
    assert torch.equal(valid.sort().values, torch.arange(N)[keep])
    rows = s[:n] < N
    be = al.block_expert_ids.cpu().repeat_interleave(BM)[:n]
    assert torch.equal(be[rows].long(), ids.reshape(-1)[s[:n][rows].long()].long())
    bl = al.block_lora_ids.cpu().repeat_interleave(BM)[:n]
    want = (
        lora.cpu().long()[s[:n][rows].long() // K]
        if lora is not None
        else torch.full_like(bl[rows], -1).long()
    )
    assert torch.equal(bl[rows].long(), want)
    nb = n // BM
    assert (al.block_expert_ids.cpu()[nb:] == -1).all() and (al.block_lora_ids.cpu()[nb:] == -1).all()
    for b in s[:n].view(-1, BM):
        v = b[b < N]
        assert len(v) > 0 and (v[1:] > v[:-1]).all()


def test_out_of_range_ids_are_dropped(device):
    """No value check (no host sync): out-of-range pairs are dropped, never written out of bounds
    (every workspace entry outside the returned prefixes keeps its guard value)."""
    E, L, K, T = 8, 3, 4, 24
    ids, lora = _ids(T, K, E, L, device, seed=9)
    ids[1, 2], ids[5, 0], ids[7, 3] = E, -1, 1 << 20
    lora[2], lora[9] = L, -2
    ws = pair_workspace(T * K, E, 16, L, 16, device=device)
    guard = -777
    ws.buffer.fill_(guard)
    base, lo = align_tokens_pair(ids, E, 16, lora, L, 16, out=ws)
    flat = ids.cpu().reshape(-1)
    ok_e = (flat >= 0) & (flat < E)
    lo_pair = lora.cpu().long().repeat_interleave(K)
    ok_l = ok_e & (lo_pair >= 0) & (lo_pair < L)
    _invariants(base, ids, E, None, L, ok_e)
    _invariants(lo, ids, E, lora, L, ok_l)
    # outside the returned prefixes (and the tables) nothing was written
    used = torch.zeros(ws.buffer.numel(), dtype=torch.bool)
    elem = ws.buffer.element_size()
    for t in [*_fields(base), *_fields(lo), *ws.tables.values()]:
        o = (t.data_ptr() - ws.buffer.data_ptr()) // elem
        used[o : o + t.numel()] = True
    assert (ws.buffer.cpu()[~used] == guard).all()
    _same(ids, E, 16, lora, L, 16)  # and the torch oracle drops the same pairs, bit for bit
    _same(ids, E, 16, lora, L, 32, incl=True)
    # only lora ids out of range: the base alignment is still the oracle's, bit for bit
    ids2, lora2 = _ids(T, K, E, L, device, seed=10)
    lora2[3], lora2[4] = 99, -5
    base2, lo2 = align_tokens_pair(ids2, E, 16, lora2, L, 32)
    _check_one(base2, align_tokens(ids2, E, 16, check_values=False))
    keep = (lora2.cpu().long().repeat_interleave(K) >= 0) & (lora2.cpu().long().repeat_interleave(K) < L)
    _invariants(lo2, ids2, E, lora2, L, keep)


def _fields(al):
    return [getattr(al, f) for f in FIELDS]


def test_bad_inputs(device):
    ids, lora = _ids(4, 2, 8, 2, device)
    base = dict(
        topk_ids=ids,
        num_experts=8,
        base_block_size_m=16,
        lora_ids=lora,
        num_adapters=2,
        lora_block_size_m=16,
    )
    big = torch.zeros(SMALL_MAX_PAIRS // 2 + 1, 2, dtype=torch.int32, device=device)
    cases = [
        (dict(base_block_size_m=24), "base_block_size_m"),
        (dict(base_block_size_m=8), "base_block_size_m"),
        (dict(lora_block_size_m=True), "lora_block_size_m"),
        (dict(lora_block_size_m=2**17), "lora_block_size_m"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2.0), "num_experts"),
        (dict(num_adapters=0), "num_adapters"),
        (dict(num_experts=512, num_adapters=8), "MAX_GROUPS"),
        (dict(topk_ids=ids[0]), "topk_ids"),
        (dict(topk_ids=ids.float()), "topk_ids"),
        (dict(topk_ids=[[0, 1]]), "topk_ids"),
        (dict(lora_ids=None), "lora_ids"),
        (dict(lora_ids=lora.float()), "lora_ids"),
        (dict(lora_ids=lora[:3]), "lora_ids"),
        (dict(topk_ids=big, lora_ids=big[:, 0]), "SMALL_MAX_PAIRS"),
        (dict(num_warps=3), "num_warps"),
        (dict(out=torch.empty(4)), "PairWorkspace"),
        (dict(out=pair_workspace(8, 8, 16, 2, 32, device=device)), "built for"),
        (dict(out=pair_workspace(8, 4, 16, 2, 16, device=device)), "built for"),
        (dict(out=pair_workspace(7, 8, 16, 2, 16, device=device)), "holds 7 pairs"),
    ]
    assert 512 * 9 > MAX_GROUPS
    for kw, name in cases:
        args = dict(base)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            align_tokens_pair(**args)
    with pytest.raises(ValueError, match="max_num_pairs"):
        pair_workspace(-1, 8, 16, 2, 16)
    with pytest.raises(ValueError, match="max_num_pairs"):
        pair_workspace(SMALL_MAX_PAIRS + 1, 8, 16, 2, 16)
    with pytest.raises(ValueError, match="num_adapters"):
        pair_workspace(8, 8, 16, 0, 16)
    with pytest.raises(ValueError, match="lora_block_size_m"):
        pair_workspace(8, 8, 16, 2, 48)


# ---- compile-only check for sm_90 (subprocess without TRITON_INTERPRET) -------------------------
_SM90_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from moelora_lib.kernels import align_small as A
    from moelora_lib.studies.compile_check import compile_for_sm90, resource_usage, specialization_key

    def launch(T, K, E, L, bb, bl, offset=False):
        topk = torch.empty(T + int(offset), K, dtype=torch.int32, device="meta")[int(offset) :]
        lora = torch.empty(T, dtype=torch.int32, device="meta")
        ws = A.pair_workspace(A.SMALL_MAX_PAIRS, E, bb, L, bl, device="meta")
        _, _, ln = A.pair_launch_args(topk, E, bb, lora, L, bl, out=ws)
        cx = dict(ln.constexprs)
        nw = cx.pop("num_warps")
        return ln.kernel, ln.args, cx, nw

    out = {"res": {}, "keys": {}}
    for name, (E, K, L) in {"gpt-oss": (32, 4, 8), "qwen3": (128, 8, 8)}.items():
        for T in (1, 256):
            kern, args, cx, nw = launch(T, K, E, L, 16, 16)
            out["res"][f"{name}/T={T}"] = resource_usage(compile_for_sm90(kern, args, cx, nw, None))
        # cache keys at both sides of every pair-vector size edge, at T with T·K % 16 == 0 and != 0 (the
        # specializations an int or pointer argument could add), and offset views of topk_ids
        keys = set()
        for T in [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 200, 255, 256]:
            kern, args, cx, nw = launch(T, K, E, L, 16, 16, offset=T in (5, 100))
            keys.add(specialization_key(kern, args, cx, nw))
        out["keys"][name] = len(keys)
    print(json.dumps(out))
    """
)


def test_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\nsm_90 resource usage:", json.dumps(out["res"]), "\ncache keys over T in 1..256:", out["keys"])
    for what, r in out["res"].items():
        assert r["LOCAL"] == 0 and r["STACK"] == 0, (what, r)  # no spills
        assert 0 < r["REG"] <= 128, (what, r)
    # BLOCK = max(64, next_pow2(T·K)): 64..1024 for GPT-OSS (K = 4), 64..2048 for Qwen3 (K = 8)
    assert out["keys"] == {"gpt-oss": 5, "qwen3": 6}, out["keys"]
