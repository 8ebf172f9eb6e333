"""Routing and the (adapter, expert) alignment: invariants every kernel relies on."""

import pytest
import torch

from moelora_lib import route
from moelora_lib.reference import route_reference
from moelora_lib.routing import align_tokens, max_padded_pairs
from moelora_lib.workloads import adapter_ids


def _case(T, E, K, L, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    _, ids = route(logits, K)
    return ids, adapter_ids(T, max(L, 1), pattern, g)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(renormalize):
    logits = torch.randn(33, 9, generator=torch.Generator().manual_seed(1))
    w, ids = route(logits, 3, renormalize)
    w_ref, ids_ref = route_reference(logits, 3, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(33))


def test_route_bad_input():
    with pytest.raises(ValueError, match="router_logits"):
        route(torch.randn(4), 2)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(4, 3), 4)
    with pytest.raises(ValueError, match="router_logits"):
        route(torch.ones(4, 3, dtype=torch.int32), 1)


CASES = [  # (T, E, K, L, pattern, BLOCK_SIZE_M)
    (1, 4, 2, 3, "uniform", 16),  # one decode token
    (37, 7, 3, 4, "mixed", 16),  # odd E, ragged groups, -1 tokens
    (200, 8, 2, 8, "zipf", 32),  # skewed adapters
    (64, 4, 1, 2, "none", 16),  # no token has an adapter
    (50, 5, 2, 1, "one", 64),  # every token on slot 0, BM larger than groups
]


@pytest.mark.parametrize("T,E,K,L,pattern,BM", CASES)
@pytest.mark.parametrize("include_no_adapter", [False, True])
def test_lora_alignment_invariants(T, E, K, L, pattern, BM, include_no_adapter):
    ids, lora = _case(T, E, K, L, pattern)
    al = align_tokens(ids, E, BM, lora_ids=lora, num_adapters=L, include_no_adapter=include_no_adapter)
    P = T * K
    st = al.sorted_token_ids
    used = int(al.num_tokens_post_padded)
    assert used % BM == 0 and st.numel() == max_padded_pairs(P, (L + 1) * E, BM) >= used
    assert (st[used:] == P).all()  # beyond the used part: only the sentinel
    real = st[st < P].long()
    pair_lora = lora.long().repeat_interleave(K)
    expected = torch.arange(P) if include_no_adapter else torch.nonzero(pair_lora >= 0).squeeze(1)
    # each (token, k) pair appears exactly once (those with an adapter, or all)
    assert torch.equal(real.sort().values, expected)
    flat_e = ids.reshape(-1).long()
    for b in range(al.num_blocks):
        rows = st[b * BM : (b + 1) * BM].long()
        e, lid = int(al.block_expert_ids[b]), int(al.block_lora_ids[b])
        if b * BM >= used:
            assert e == -1 and lid == -1 and (rows == P).all()
            continue
        r = rows[rows < P]
        assert len(r) > 0  # no block is made of padding alone
        assert (flat_e[r] == e).all()  # one expert per block
        slot = pair_lora[r]
        assert (slot == slot[0]).all()  # one adapter slot per block
        assert lid == (int(slot[0]) if slot[0] >= 0 else -1)
        # padding rows only at the end of a group: real rows come first
        n = len(r)
        assert (rows[:n] < P).all() and (rows[n:] == P).all()


def test_no_adapter_slot_is_laid_out_last():
    ids, lora = _case(40, 4, 2, 3, "mixed")
    al = align_tokens(ids, 4, 16, lora_ids=lora, num_adapters=3, include_no_adapter=True)
    used = int(al.num_tokens_post_padded) // 16
    lids = al.block_lora_ids[:used].tolist()
    first_none = lids.index(-1)
    assert all(x == -1 for x in lids[first_none:]) and all(x >= 0 for x in lids[:first_none])


def test_expert_only_alignment():
    ids, _ = _case(30, 6, 2, 1, "none")
    al = align_tokens(ids, 6, 16)
    st = al.sorted_token_ids
    assert torch.equal(st[st < 60].sort().values.long(), torch.arange(60))
    assert (al.block_lora_ids == -1).all()


@pytest.mark.parametrize("bm", [0, 8, 24, 48])
def test_alignment_rejects_bad_block_size(bm):
    ids, _ = _case(4, 4, 2, 1, "none")
    with pytest.raises(ValueError, match="block_size_m"):
        align_tokens(ids, 4, bm)


BAD_ALIGN = [  # (id, kwargs override, argument named in the error)
    ("expert_id_equal_E", dict(topk_ids=torch.tensor([[0, 4]], dtype=torch.int32)), "topk_ids"),
    ("expert_id_negative", dict(topk_ids=torch.tensor([[0, -1]], dtype=torch.int32)), "topk_ids"),
    ("topk_ids_float", dict(topk_ids=torch.zeros(1, 2)), "topk_ids"),
    ("num_experts_zero", dict(num_experts=0), "num_experts"),
    (
        "lora_ids_without_num_adapters",
        dict(lora_ids=torch.zeros(1, dtype=torch.int32), num_adapters=0),
        "num_adapters",
    ),
    ("lora_id_out_of_range", dict(lora_ids=torch.tensor([3], dtype=torch.int32), num_adapters=3), "lora_ids"),
    (
        "lora_id_below_minus1",
        dict(lora_ids=torch.tensor([-2], dtype=torch.int32), num_adapters=3),
        "lora_ids",
    ),
    ("block_size_float", dict(block_size_m=16.0), "block_size_m"),
]


@pytest.mark.parametrize("override,name", [(b[1], b[2]) for b in BAD_ALIGN], ids=[b[0] for b in BAD_ALIGN])
def test_alignment_rejects_bad_input(override, name):
    kw = dict(topk_ids=torch.tensor([[0, 1]], dtype=torch.int32), num_experts=4, block_size_m=16)
    kw.update(override)
    with pytest.raises(ValueError, match=name):
        align_tokens(**kw)


def test_route_rejects_bool_top_k():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(4, 3), True)


def test_id_value_bounds_and_check():
    from moelora_lib.routing import check_id_bounds, id_value_bounds

    ti = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    li = torch.tensor([-1, 2], dtype=torch.int32)
    assert id_value_bounds(ti, li).tolist() == [0, 3, -1, 2]
    assert id_value_bounds(ti).tolist() == [0, 3, -1, -1]
    empty = torch.empty((0, 2), dtype=torch.int64)
    assert id_value_bounds(empty, torch.empty(0, dtype=torch.int32)).tolist() == [0, 0, -1, -1]
    check_id_bounds([0, 3, -1, 2], 4, 3)
    with pytest.raises(ValueError, match=r"topk_ids values must be in \[0, E=3\), got min 0, max 3"):
        check_id_bounds([0, 3, -1, 2], 3, 3)
    with pytest.raises(ValueError, match=r"lora_ids values must be in \[-1, L=2\)"):
        check_id_bounds([0, 3, -1, 2], 4, 2)
