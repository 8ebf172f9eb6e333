"""On a GPU (skipped without CUDA), bfloat16: the block-FP8 dense GEMM in both forms and LoRALinear with an
FP8 weight, compiled for the device.

The CPU tests (tests/test_dense_fp8.py) check the math under the interpreter in float32/float16 (bf16 is
wrong there); here: the bf16 weight-only form against ``F.linear`` on the weight dequantized to bf16, the
W8A8 form (FP8 wgmma for M tiles of 64+ rows, mma.sync below) against the float32 GEMM of the
reference-quantized activations, the layer against the layer on dequantized weights, and a CUDA graph
capture of the layer in both forms (the activation quantization included: no host sync).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelora_lib.kernels.dense_fp8 import dense_fp8_w8a8, dense_fp8_weight_only, quantize_act
from moelora_lib.linear import LoRALinear
from moelora_lib.quant import FP8BlockWeight, quantize_fp8_act_reference
from moelora_lib.testing import assert_close_rel

pytestmark = pytest.mark.gpu

DT = torch.bfloat16
N, K, L, R = 1536, 2048, 3, 16
SLICES = (1024, 256, 256)


def _weight(seed=0) -> FP8BlockWeight:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, K, generator=g) * 0.02 for n in SLICES]
    return FP8BlockWeight.cat([FP8BlockWeight.quantize(p.cuda()) for p in parts])


def _x(T, seed=1):
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).to("cuda", DT)


def _qdq(x, g=128):
    q, s = quantize_fp8_act_reference(x, g)
    return q.float() * s.repeat_interleave(g, dim=1)[:, : x.shape[1]]


@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_weight_only_bf16(T):
    w = _weight()
    b = (torch.randn(N) * 0.1).to("cuda", DT)
    x = _x(T)
    y = dense_fp8_weight_only(x, w, b)
    ref = F.linear(x.float(), w.dequantize(DT).float(), b.float())
    assert_close_rel(y, ref, dtype=DT, what=f"FP8 weight-only bf16 T={T}")


@pytest.mark.parametrize("T", [16, 64, 300, 2048])
def test_w8a8_bf16(T):
    w = _weight(2)
    x = _x(T, 3)
    x_q, x_s = quantize_act(x, 128)
    y = dense_fp8_w8a8(x_q, x_s, w, out_dtype=DT)
    ref = F.linear(_qdq(x), w.dequantize(torch.float32))
    assert_close_rel(y, ref, dtype=DT, what=f"FP8 W8A8 bf16 T={T}")


def _layers(scheme):
    w = _weight(4)
    g = torch.Generator().manual_seed(5)
    f8 = LoRALinear(w, slices=SLICES, num_adapters=L, max_rank=R, max_tokens=512, dtype=DT,
                    activation_scheme=scheme)  # fmt: skip
    dense = LoRALinear(w.dequantize(DT), slices=SLICES, num_adapters=L, max_rank=R, max_tokens=512)
    for slot in range(L - 1):
        a = [torch.randn(R, K, generator=g).to("cuda", DT) * 0.02 for _ in SLICES]
        b = [torch.randn(n, R, generator=g).to("cuda", DT) * 0.02 for n in SLICES]
        f8.load_adapter(slot, a, b, 2.0)
        dense.load_adapter(slot, a, b, 2.0)
    return w, f8, dense


def _ids(T):
    return (torch.arange(T, device="cuda") % (L + 1) - 1).to(torch.int32)


@pytest.mark.parametrize("T", [1, 8, 256])
def test_layer_weight_only_bf16(T):
    w, f8, dense = _layers("weight_only")
    x, ids = _x(T, 6), _ids(T)
    with torch.no_grad():
        assert_close_rel(f8(x, ids), dense(x, ids).float(), dtype=DT, what=f"FP8 layer T={T}")


def test_layer_dynamic_bf16():
    """W8A8 layer: the base on the quantized activations, the LoRA part on the bf16 ones."""
    w, f8, dense = _layers("auto")
    T = 256
    assert f8.activation_scheme_for(T) == "dynamic"
    x, ids = _x(T, 7), _ids(T)
    with torch.no_grad():
        y = f8(x, ids)
        wd = w.dequantize(torch.float32)
        ref = dense(x, ids).float() - F.linear(x.float(), wd) + F.linear(_qdq(x), wd)
    assert_close_rel(y, ref, dtype=DT, what="FP8 W8A8 layer")


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_layer_graph_capture(scheme):
    w, f8, dense = _layers(scheme)
    T = 8
    x, ids = _x(T, 8).clone(), _ids(T)
    with torch.no_grad():
        eager = f8(x, ids)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f8(x, ids)  # warm-up outside the capture (configs, buffers)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f8(x, ids)
        graph.replay()
        assert torch.equal(out, eager)
        x.copy_(_x(T, 9))
        graph.replay()
        assert torch.equal(out, f8(x, ids))
