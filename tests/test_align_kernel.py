"""Triton alignment kernels (moelora_lib.kernels.align) against the torch oracle routing.align_tokens.

CPU: the Triton interpreter (tests/conftest.py), small shapes; its tl.sort costs ~2 ms per pair, so
multi-tile cases pass a small ``tile`` instead of many pairs.
"""

import pytest
import torch

from moelora_lib.kernels.align import (
    FILL_ROWS,
    INT32_MAX,
    AlignWorkspace,
    align_sizes,
    align_tokens_triton,
    align_workspace,
)
from moelora_lib.routing import align_tokens, max_padded_pairs

FIELDS = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")


def _ids(T, K, E, L, device, seed=0, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(0, E, (T, K), generator=g).to(dtype)
    lora = torch.randint(-1, L, (T,), generator=g).to(torch.int32) if L else None
    return topk.to(device), (lora.to(device) if lora is not None else None)


def _same(ids, E, BM, lora=None, L=0, incl=False, **kw):
    """Triton == oracle, bit for bit (shapes, dtypes, values, metadata); returns the Triton result."""
    ref = align_tokens(ids, E, BM, lora, L, incl, check_values=False)
    got = align_tokens_triton(ids, E, BM, lora, L, incl, **kw)
    for f in FIELDS:
        r, g = getattr(ref, f), getattr(got, f)
        assert g.dtype == torch.int32 and g.shape == r.shape, (f, g.shape, r.shape)
        assert torch.equal(g.cpu(), r.cpu()), f"{f} differs:\n got {g}\n ref {r}"
    assert (got.block_size_m, got.num_pairs, got.num_blocks) == (
        ref.block_size_m,
        ref.num_pairs,
        ref.num_blocks,
    )
    return got


def _invariants(al, ids, E, lora=None, L=0, incl=False):
    """Each kept pair exactly once among the valid entries, in its block's group, ascending in a group."""
    ids = ids.cpu()
    T, K = ids.shape
    N = T * K
    n = int(al.num_tokens_post_padded)
    assert n % al.block_size_m == 0 and n <= al.sorted_token_ids.numel()
    s = al.sorted_token_ids.cpu()
    assert (s[n:] == N).all()
    valid = s[:n][s[:n] < N].long()
    kept = torch.arange(N)
    if lora is not None and not incl:
        kept = kept[lora.cpu().repeat_interleave(K) >= 0]
    assert torch.equal(valid.sort().values, kept)
    be = al.block_expert_ids.cpu().repeat_interleave(al.block_size_m)[:n]
    bl = al.block_lora_ids.cpu().repeat_interleave(al.block_size_m)[:n]
    rows = s[:n] < N
    assert (be[:n] >= 0).all()
    assert torch.equal(be[rows].long(), ids.reshape(-1)[s[:n][rows].long()].long())
    if lora is not None:
        want = lora.cpu().long()[s[:n][rows].long() // K]
        assert torch.equal(bl[rows].long(), want)
    else:
        assert (al.block_lora_ids == -1).all()
    nb = n // al.block_size_m
    assert (al.block_expert_ids.cpu()[nb:] == -1).all() and (al.block_lora_ids.cpu()[nb:] == -1).all()
    # stable: pair ids ascend inside each block (blocks never straddle groups)
    blocks = s[:n].view(-1, al.block_size_m)
    for b in blocks:
        v = b[b < N]
        assert (v[1:] > v[:-1]).all()


@pytest.mark.parametrize(
    "T,K,E,BM,L,incl",
    [
        (7, 2, 4, 16, 0, False),  # expert-only
        (7, 2, 4, 16, 2, True),  # include_no_adapter
        (1, 8, 128, 16, 3, False),  # T = 1, E = 128 with few tokens
        (0, 4, 8, 16, 2, True),  # T = 0
        (6, 1, 8, 32, 1, True),  # K = 1, L = 1
        (5, 8, 16, 64, 8, True),  # K = 8, L = 8, BM = 64
    ],
)
def test_matches_oracle(device, T, K, E, BM, L, incl):
    ids, lora = _ids(T, K, E, L, device, seed=T * 100 + K)
    al = _same(ids, E, BM, lora, L, incl)
    _invariants(al, ids, E, lora, L, incl)


@pytest.mark.parametrize("L,incl", [(0, False), (3, True)])
def test_many_tiles(device, L, incl):
    """Several tile programs (tile = 16): the tile offsets inside a group are scanned across tiles."""
    ids, lora = _ids(23, 4, 6, L, device, seed=5)
    al = _same(ids, 6, 16, lora, L, incl, tile=16)
    _invariants(al, ids, 6, lora, L, incl)


def test_random_sweep(device):
    """Random small shapes: T in [0, 20], K in {1, 2, 4, 8}, E in {1, 3, 16, 128}, L in 0..8, BM, tile."""
    g = torch.Generator().manual_seed(10)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    for i in range(5):
        T, K = int(torch.randint(0, 21, (1,), generator=g)), pick([1, 2, 4, 8])
        E, L, BM = pick([1, 3, 16, 128]), pick([0, 1, 2, 5, 8]), pick([16, 32, 64])
        ids, lora = _ids(T, K, E, L, device, seed=i)
        al = _same(ids, E, BM, lora, L, bool(i % 2), tile=pick([16, 32, 64, None]))
        _invariants(al, ids, E, lora, L, bool(i % 2))


def test_large_tile(device):
    """T·K = 320 pairs in one tile of 512 (the default tile follows T·K: next_pow2(N / 8) in [64, 512])."""
    assert [align_sizes(n, 9 * 128, 16).tile for n in (0, 8, 1024, 2048, 4096, 65536)] == [
        64,
        64,
        128,
        256,
        512,
        512,
    ]
    ids, lora = _ids(40, 8, 128, 8, device, seed=7)
    al = _same(ids, 128, 16, lora, 8, True, tile=512)
    _invariants(al, ids, 128, lora, 8, True)


def test_int64_ids_and_strided_views(device):
    ids, lora = _ids(6, 4, 8, 3, device, seed=3, dtype=torch.int64)
    _same(ids, 8, 16, lora.long(), 3, True)
    # non-contiguous topk_ids (a transposed buffer) and lora_ids (every other element)
    t = ids.t().contiguous().t()
    lbuf = torch.stack([lora, lora]).t().reshape(-1)[::2]
    assert not t.is_contiguous() and lbuf.stride(0) == 2
    _same(t.int(), 8, 16, lbuf, 3, True)
    # offset views (data pointers not 16-byte aligned)
    buf = torch.cat([ids.new_zeros(1, 4), ids])[1:]
    _same(buf, 8, 16, torch.cat([lora.new_zeros(1), lora])[1:], 3, False)


def test_all_tokens_one_group(device):
    T, K, E = 9, 4, 8
    ids = torch.full((T, K), 3, dtype=torch.int32, device=device)
    ids[:, 1:] = torch.tensor([0, 5, 7], dtype=torch.int32)  # K distinct experts per token; column 0 all 3
    lora = torch.full((T,), 1, dtype=torch.int32, device=device)
    for L, incl in [(0, False), (2, False), (2, True)]:
        al = _same(ids, E, 16, lora if L else None, L, incl)
        _invariants(al, ids, E, lora if L else None, L, incl)
    ids1 = torch.full((T, 1), 2, dtype=torch.int32, device=device)  # literally one group
    al = _same(ids1, E, 16, lora, 2, False)
    assert int(al.num_tokens_post_padded) == 16 and al.block_expert_ids.tolist()[0] == 2
    # every token without adapter and include_no_adapter=False: nothing kept
    none = torch.full((T,), -1, dtype=torch.int32, device=device)
    al = _same(ids, E, 16, none, 2, False)
    assert int(al.num_tokens_post_padded) == 0 and (al.sorted_token_ids == T * 4).all()
    al = _same(ids, E, 16, none, 2, True)  # all in slot L
    assert (al.block_lora_ids == -1).all()


def test_empty_groups(device):
    """Only experts 0 and E-1 are used, adapters 0 and L-1: most groups are empty."""
    T, K, E, L = 10, 2, 64, 4
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 2, (T, K), generator=g) * (E - 1)).int().to(device)
    lora = (torch.randint(0, 2, (T,), generator=g) * (L - 1)).int().to(device)
    lora[0] = -1
    for incl in (False, True):
        al = _same(ids, E, 32, lora, L, incl)
        _invariants(al, ids, E, lora, L, incl)


def test_workspace_out(device):
    E, BM, L = 8, 16, 3
    ws = align_workspace(64, E, BM, L, device=device)
    assert isinstance(ws, AlignWorkspace)
    for T in (5, 16, 0):
        ids, lora = _ids(T, 4, E, L, device, seed=T)
        al = _same(ids, E, BM, lora, L, True, out=ws)
        assert al.sorted_token_ids.data_ptr() == ws.sorted_token_ids.data_ptr()
        assert al.num_tokens_post_padded.data_ptr() == ws.num_tokens_post_padded.data_ptr()
    base = align_workspace(64, E, BM, device=device)
    ids, _ = _ids(7, 4, E, 0, device)
    _same(ids, E, BM, out=base)
    with pytest.raises(ValueError, match="built for"):
        align_tokens_triton(ids, E, BM, out=ws)  # LoRA workspace for an expert-only call
    with pytest.raises(ValueError, match="built for"):
        align_tokens_triton(ids, E, 32, out=base)
    big, _ = _ids(17, 4, E, 0, device)
    with pytest.raises(ValueError, match="workspace holds"):
        align_tokens_triton(big, E, BM, out=base)
    with pytest.raises(ValueError, match="AlignWorkspace"):
        align_tokens_triton(ids, E, BM, out=torch.empty(4))


def test_out_of_range_ids_are_dropped(device):
    """No value check (no host sync); out-of-range pairs never land in the buffer, and the torch oracle
    (check_values=False) drops the same pairs, bit for bit (it used to index past its counts, or file an
    expert id of E + 1 under another adapter's group)."""
    ids = torch.tensor([[0, 9], [-1, 1], [2, 3]], dtype=torch.int32, device=device)
    lora = torch.tensor([0, 1, 7], dtype=torch.int32, device=device)
    al = align_tokens_triton(ids, 4, 16, lora, 2, True)
    s = al.sorted_token_ids.cpu()
    assert sorted(s[s < 6].tolist()) == [0, 3]
    _same(ids, 4, 16, lora, 2, True)
    _same(ids, 4, 16)  # expert-only
    ids = torch.tensor([[0, 5], [1, 2], [3, -2]], dtype=torch.int32, device=device)  # 5 = slot 1's key 1
    lora = torch.tensor([0, -3, -1], dtype=torch.int32, device=device)
    for incl in (False, True):
        al = _same(ids, 4, 16, lora, 2, incl)
        s = al.sorted_token_ids.cpu()
        assert sorted(s[s < 6].tolist()) == ([0, 4] if incl else [0])


def test_int32_edge_by_arithmetic():
    # just below the edge: fine
    n = INT32_MAX - 2**20
    sz = align_sizes(n, 8, 16)
    assert sz.padded == max_padded_pairs(n, 8, 16) and sz.tile == 512 and sz.padded + FILL_ROWS <= INT32_MAX
    assert sz.scratch == sz.num_tiles * 8 + 16
    # T·top_k near 2^31 (e.g. T = 2^28 tokens, K = 8): the padded size passes int32
    with pytest.raises(ValueError, match="num_pairs .*int32"):
        align_sizes(2**28 * 8, 8, 16)
    # padding pushes it over: N fits, N + G·(BM - 1) does not
    with pytest.raises(ValueError, match="padded size"):
        align_sizes(INT32_MAX - 2**16, 2**16, 64)
    # many groups times many tiles: the tile-count scratch
    with pytest.raises(ValueError, match="scratch"):
        align_sizes(2**20, 2**21, 16)
    # the launcher checks before touching tensors: a [T, K] view of a tiny tensor with T·K > 2^31
    huge = torch.zeros(1, dtype=torch.int32).expand(2**28, 8)
    with pytest.raises(ValueError, match="int32"):
        align_tokens_triton(huge, 8, 16)
    with pytest.raises(ValueError, match="int32"):
        align_workspace(2**31, 8, 16)


def test_bad_inputs(device):
    ids, lora = _ids(4, 2, 8, 2, device)
    cases = [
        (dict(block_size_m=24), "block_size_m"),
        (dict(block_size_m=8), "block_size_m"),
        (dict(block_size_m=True), "block_size_m"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2.0), "num_experts"),
        (dict(topk_ids=ids[0]), "topk_ids"),
        (dict(topk_ids=ids.float()), "topk_ids"),
        (dict(topk_ids=[[0, 1]]), "topk_ids"),
        (dict(lora_ids=lora.float(), num_adapters=2), "lora_ids"),
        (dict(lora_ids=lora[:3], num_adapters=2), "lora_ids"),
        (dict(lora_ids=lora, num_adapters=0), "num_adapters"),
        (dict(tile=48), "tile"),
        (dict(tile=2048), "tile"),
    ]
    for kw, name in cases:
        args = dict(topk_ids=ids, num_experts=8, block_size_m=16)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            align_tokens_triton(**args)
        # the oracle raises the same errors (its checks are mirrored) where it has the argument
        if name != "tile":
            with pytest.raises(ValueError, match=name):
                align_tokens(**args, check_values=False)
    with pytest.raises(ValueError, match="max_num_pairs"):
        align_workspace(-1, 8, 16)
    with pytest.raises(ValueError, match="num_adapters"):
        align_workspace(8, 8, 16, -1)


def test_default_workspace_serves_every_smaller_pair_count():
    """The default tile shrinks with T·K, so a smaller call may need more tiles than the largest one:
    the workspace must hold the scratch of every N ≤ max_num_pairs (arithmetic only, no kernel)."""
    from moelora_lib.kernels.align import align_sizes, align_workspace

    for n_max in (0, 1, 63, 322, 520, 1000, 4100, 9000):
        ws = align_workspace(n_max, 4, 16, 2)
        groups = 4 * 3
        need = max(align_sizes(n, groups, 16).scratch for n in range(n_max + 1))
        assert ws.scratch.numel() >= need, (n_max, ws.scratch.numel(), need)
