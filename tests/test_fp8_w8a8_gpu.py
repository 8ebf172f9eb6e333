"""On a GPU (skipped without CUDA), bf16: the W8A8 block-FP8 MoE path compiled for the GPU.

The CPU tests (tests/test_fp8_w8a8_moe.py) check the math under the interpreter in fp32/fp16, whose FP8 dots
sum exact products in fp32. Here: the quantization kernel bit for bit on the GPU (bf16 inputs, the
hardware's division and integer paths), the FP8 × FP8 tensor-core GEMM against an fp64 oracle on the values
it multiplies (tolerance: one bf16 rounding of the output, 2^-8 relative, plus the FP8 tensor cores'
limited accumulation inside one K step — 2^-7 of the output's scale), the layer in W8A8 against the same
oracles as on the CPU in bf16, and a CUDA-graph capture of a W8A8 forward (no allocation, no host sync).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_w8a8_moe import _act64, _exact, _w8a8_layer_oracle

from moelora_lib.kernels.config import OpConfig
from moelora_lib.kernels.fp8_act import FP8Activations, quantize_fp8_act
from moelora_lib.kernels.launchers import fused_moe_gemm
from moelora_lib.layer import MoELoRALayer
from moelora_lib.quant import FP8BlockWeight, quantize_fp8_act_reference
from moelora_lib.reference import moe_lora_reference, route_reference
from moelora_lib.routing import align_tokens
from moelora_lib.testing import assert_close_rel

pytestmark = pytest.mark.gpu

DT = torch.bfloat16
E, K_TOP, L, R = 8, 2, 4, 16


@pytest.mark.parametrize("T,K", [(1, 2048), (300, 768), (37, 200)])
def test_quant_kernel_bit_exact_on_gpu(T, K):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-20, 10, (T, K), generator=g).float())
    x = x.to(DT)
    x[0, :128] = 0.0
    q, s = quantize_fp8_act(x.cuda(), 128)
    qr, sr = quantize_fp8_act_reference(x, 128)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)


@pytest.mark.parametrize("bk", [64, 128])
def test_w8a8_gemm_bf16_vs_oracle(bk):
    N, K, T = 768, 2048, 200
    g = torch.Generator().manual_seed(bk)
    w = FP8BlockWeight.quantize(torch.randn(E, N, K, generator=g) * 0.05).to("cuda")
    topk = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]).to(torch.int32)
    align = align_tokens(topk.cuda(), E, 64)
    x = torch.randn(T, K, generator=g).to("cuda", DT)
    xa = FP8Activations.quantize(x, 128)
    out = torch.empty(T * K_TOP, N, dtype=DT, device="cuda")
    fused_moe_gemm(xa, w, out, align, OpConfig(64, 128, bk, 8, 1, 4, 3), rows_div=K_TOP)
    ref = _act64(x.cpu(), 128)[torch.arange(T * K_TOP) // K_TOP]
    ref = torch.einsum("pk,pnk->pn", ref, _exact(w.to("cpu"))[topk.reshape(-1).long()])
    assert_close_rel(out, ref, tol=2.0**-7)


def _layer(stage, scheme, H=256, I=128, max_tokens=512, **kw):
    g = torch.Generator().manual_seed(0)
    w13 = FP8BlockWeight.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.05).to("cuda")
    w2 = FP8BlockWeight.quantize(torch.randn(E, H, I, generator=g) * 0.05).to("cuda")
    layer = MoELoRALayer(
        w13, w2, top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=max_tokens, dtype=DT, stage=stage,
        activation_scheme=scheme, **kw,
    )  # fmt: skip
    for slot in range(L - 1):  # the last slot stays empty
        a13 = (torch.randn(E, 2, R, H, generator=g) * 0.05).to("cuda", DT)
        b13 = (torch.randn(E, 2, I, R, generator=g) * 0.05).to("cuda", DT)
        a2 = (torch.randn(E, R, I, generator=g) * 0.05).to("cuda", DT)
        b2 = (torch.randn(E, H, R, generator=g) * 0.05).to("cuda", DT)
        layer.load_adapter(slot, gate_up=(a13, b13), down=(a2, b2), scaling=2.0)
    return layer, (w13, w2)


def _inputs(T, H=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", DT)
    tw, ti = route_reference(torch.randn(T, E, generator=g), K_TOP)
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    return x, tw.float().cuda(), ti.to(torch.int32).cuda(), ids.cuda()


@pytest.mark.parametrize("stage", ["tuned", "fused"])
@pytest.mark.parametrize("T", [8, 300])
def test_layer_w8a8_bf16_vs_oracles(stage, T):
    layer, (w13, w2) = _layer(stage, "dynamic")
    x, tw, ti, ids = _inputs(T)
    out = layer(x, topk_weights=tw, topk_ids=ti, lora_ids=ids)
    assert torch.isfinite(out).all()
    cpu = [t.cpu() for t in (x, tw, ti, ids)]
    lay_cpu = type("Slots", (), {})()  # the oracle reads the adapter slots and biases off a layer
    for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2"):
        setattr(lay_cpu, n, getattr(layer, n).cpu())
    lay_cpu.b13 = lay_cpu.b2 = None
    lay_cpu.L = L
    oracle = _w8a8_layer_oracle(*cpu[:1], w13.to("cpu"), w2.to("cpu"), *cpu[1:], lay_cpu, "silu", stage)
    assert_close_rel(out, oracle, DT)
    ref = moe_lora_reference(
        x, w13.dequantize(torch.float32), w2.dequantize(torch.float32), tw, ti, ids, layer.lora_a13,
        layer.lora_b13, layer.lora_a2, layer.lora_b2,
    )  # fmt: skip
    assert_close_rel(out, ref, tol=2.0**-3, what="W8A8 vs the unquantized reference")
    wo, _ = _layer(stage, "weight_only")
    assert_close_rel(out, wo(x, topk_weights=tw, topk_ids=ti, lora_ids=ids).double(), tol=2.0**-3)


def test_graph_capture_w8a8_forward():
    # the two quantization launches write the layer's scratch: one graph captures the forward whole
    layer, _ = _layer("tuned", "dynamic", deterministic=True)
    T = 64
    x, tw, ti, ids = _inputs(T, seed=1)
    static = [t.clone() for t in (x, tw, ti, ids)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(static[0], topk_weights=static[1], topk_ids=static[2], lora_ids=static[3])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static[0], topk_weights=static[1], topk_ids=static[2], lora_ids=static[3])
    for seed in (2, 3):
        new = _inputs(T, seed=seed)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = layer(new[0], topk_weights=new[1], topk_ids=new[2], lora_ids=new[3])
        assert torch.equal(out, want), (out.float() - want.float()).abs().max()
