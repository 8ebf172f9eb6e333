"""kernels.id_bounds (the device half of the public call's deferred id check) vs routing.id_value_bounds."""

import pytest
import torch

from moelora_lib.kernels.id_bounds import id_bounds_triton
from moelora_lib.routing import id_value_bounds


@pytest.mark.parametrize("T,K", [(0, 2), (1, 4), (300, 8), (3000, 4)])
@pytest.mark.parametrize("dt", [torch.int32, torch.int64])
def test_bounds_equal_torch(T, K, dt):
    g = torch.Generator().manual_seed(T)
    ti = torch.randint(0, 32, (T, K), generator=g).to(dt)
    li = torch.randint(-1, 8, (T,), generator=g, dtype=torch.int32)
    for lora in (li, None):
        assert id_bounds_triton(ti, lora).tolist() == id_value_bounds(ti, lora).tolist()


def test_out_of_range_non_contiguous_and_offset_views():
    ti = torch.randint(0, 32, (7, 3), dtype=torch.int64).t()  # non-contiguous
    ti[1, 2], ti[0, 0] = -7, 99
    flat = torch.zeros(3, dtype=torch.int32)
    li = flat[1:]  # offset view (4 bytes past the allocation)
    li.copy_(torch.tensor([5, -3], dtype=torch.int32))
    assert id_bounds_triton(ti, li).tolist() == [-7, 99, -3, 5]


def test_bounds_reject_non_integer_ids():
    with pytest.raises(ValueError, match="topk_ids must be an int32/int64"):
        id_bounds_triton(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="lora_ids must be an int32/int64"):
        id_bounds_triton(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.bool))
