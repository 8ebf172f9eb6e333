"""kernels.topk_reduce: the top-k sum of the serving layer, NaN rows for out-of-range ids."""

import pytest
import torch

from moelora_lib.kernels.topk_reduce import topk_reduce


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,K,H", [(1, 4, 64), (5, 2, 100), (3, 8, 2048)])
def test_equals_torch_sum_for_valid_ids(dt, T, K, H):
    g = torch.Generator().manual_seed(T * K)
    y = torch.randn(T * K, H, generator=g).to(dt)
    ids = torch.randint(0, 6, (T, K), generator=g, dtype=torch.int32)
    lora = torch.randint(-1, 3, (T,), generator=g, dtype=torch.int32)
    want = y.view(T, K, H).float().sum(dim=1).to(dt)
    assert torch.equal(topk_reduce(y, ids, 6, lora, 3), want)
    assert torch.equal(topk_reduce(y, ids.long(), 6), want)


def test_out_of_range_ids_give_nan_rows():
    y = torch.ones(4 * 2, 16)
    ids = torch.tensor([[0, 1], [0, 6], [-1, 2], [3, 4]], dtype=torch.int32)
    lora = torch.tensor([0, -1, 1, 3], dtype=torch.int32)
    out = topk_reduce(y, ids, 6, lora, 3)
    assert (out[0] == 2).all()
    assert torch.isnan(out[1:]).all()  # expert 6 ≥ E, expert -1, adapter 3 ≥ L
    out = topk_reduce(y, ids, 6)  # adapter ids not checked
    assert (out[3] == 2).all() and torch.isnan(out[1:3]).all()
    assert topk_reduce(y[:0], ids[:0], 6).shape == (0, 16)


def test_errors():
    with pytest.raises(ValueError, match="topk_ids must be an int32/int64"):
        topk_reduce(torch.ones(4, 8), torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="y must be"):
        topk_reduce(torch.ones(3, 8), torch.zeros(2, 2, dtype=torch.int32), 4)


def test_check_ids_off_is_the_plain_sum():
    y = torch.ones(2 * 2, 8)
    ids = torch.tensor([[0, 9], [1, 2]], dtype=torch.int32)
    assert (topk_reduce(y, ids, 4, check_ids=False) == 2).all()


@pytest.mark.parametrize("check_ids", [True, False])
def test_skip_remote_leaves_minus_one_pairs_out(check_ids):
    # expert parallelism: id -1 = expert on another rank (its y row is stale scratch: never read)
    y = torch.randn(5 * 3, 16, generator=torch.Generator().manual_seed(1))
    y[1] = float("nan")  # the remote pair's stale row
    ids = torch.tensor([[0, -1, 2], [-1, -1, -1], [1, 2, 3], [-2, 0, 1], [0, 4, 1]], dtype=torch.int32)
    lora = torch.tensor([0, -1, 1, 0, 0], dtype=torch.int32)
    out = topk_reduce(y, ids, 4, lora, 2, check_ids=check_ids, skip_remote=True)
    yv = y.view(5, 3, 16)
    assert torch.equal(out[0], yv[0, 0] + yv[0, 2])  # the local pairs only, in k order
    assert torch.equal(out[1], torch.zeros(16))  # every pair remote: zero row
    assert torch.equal(out[2], yv[2].sum(0))  # all local: the plain sum
    if check_ids:  # -2 and 4 (= E) are still bad ids
        assert torch.isnan(out[3]).all() and torch.isnan(out[4]).all()
    # without skip_remote, -1 is an out-of-range id as before
    out = topk_reduce(y, ids, 4, lora, 2)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1]).all() and not torch.isnan(out[2]).any()
    with pytest.raises(ValueError, match="skip_remote"):
        topk_reduce(y, ids, 4, skip_remote=1)
