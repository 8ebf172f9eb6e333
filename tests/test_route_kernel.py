"""kernels.route.route_triton (one-launch softmax top-k) against routing.route (torch)."""

import pytest
import torch

from moelora_lib.kernels.route import route_triton
from moelora_lib.routing import route


@pytest.mark.parametrize("T,E,K", [(1, 32, 4), (37, 128, 8), (5, 4, 2), (16, 60, 6), (0, 8, 2)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_equals_torch(T, E, K, renorm):
    g = torch.Generator().manual_seed(T * 31 + E)
    logits = torch.randn(T, E, generator=g) * 3
    w, ids = route_triton(logits, K, renorm)
    rw, rids = route(logits, K, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (T, K)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


def test_route_fp16_strided_and_out_buffers():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9, 40, generator=g).half()
    logits = big[:, 3:35]  # strided rows, offset view
    wb = torch.full((100,), -1.0)
    ib = torch.full((100,), -1, dtype=torch.int32)
    w, ids = route_triton(logits, 3, out=(wb, ib))
    rw, rids = route(logits, 3)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert w.data_ptr() == wb.data_ptr() and (wb[27:] == -1).all()


def test_route_errors():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        route_triton(x, 9)
    with pytest.raises(ValueError, match="router_logits must be a float"):
        route_triton(x.int(), 2)
    with pytest.raises(ValueError, match="out\\[1\\]"):
        route_triton(x, 2, out=(torch.empty(6), torch.empty(6)))


def test_route_out_must_be_a_pair():
    with pytest.raises(ValueError, match="out must be a pair"):
        route_triton(torch.randn(3, 8), 2, out=torch.empty(6))
