"""The serving layer on a GPU (skipped without CUDA): CUDA-graph capture and replay of the whole layer
call (routing, Triton alignment, launches), torch.compile, the public call's deferred id check.

The CPU tests (tests/test_layer.py) cover the module's math under the interpreter; here the point is
what only a GPU shows: that one graph captures a forward whole and replays it on new inputs with the
eager result, bit for bit, and that a bad id raises without corrupting the CUDA context.
"""

from __future__ import annotations

import pytest
import torch

from moelora_lib import fused_moe_lora
from moelora_lib.kernels.route import route_triton as route  # the module's routing
from moelora_lib.layer import MoELoRALayer

pytestmark = pytest.mark.gpu

E, H, I, K, L, R = 8, 256, 128, 2, 4, 16
DT = torch.bfloat16


def _layer(max_tokens=64, **kw):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to("cuda", DT)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to("cuda", DT)
    layer = MoELoRALayer(w13, w2, top_k=K, num_adapters=L, max_rank=R, max_tokens=max_tokens, slices=2, **kw)
    for slot in range(L - 1):  # the last slot stays empty: its tokens get the base layer
        r = 8 if slot % 2 else R
        a13 = (torch.randn(E, 2, r, H, generator=g) * 0.05).to("cuda", DT)
        b13 = (torch.randn(E, 2, I, r, generator=g) * 0.05).to("cuda", DT)
        a2 = (torch.randn(E, r, I, generator=g) * 0.05).to("cuda", DT)
        b2 = (torch.randn(E, H, r, generator=g) * 0.05).to("cuda", DT)
        layer.load_adapter(slot, gate_up=(a13, b13), down=(a2, b2), scaling=2.0)
    return layer


def _inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", DT)
    logits = torch.randn(T, E, generator=g).to("cuda")
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32).to("cuda")
    return x, logits, ids


@pytest.mark.parametrize("stage", ["tuned", "auto", "gemv"])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_graph_capture_replays_new_inputs(T, stage):
    # "auto" (the default): the stage the shipped configs choose for T, resolved on the host at the warm-up
    # call, so the captured graph runs it; deterministic (no split-K atomics) for a bitwise comparison
    det = stage in ("auto", "gemv")
    layer = _layer(stage=stage, deterministic=det)
    x, logits, ids = _inputs(T, 1)
    static = [t.clone() for t in (x, logits, ids)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(*static[:2], lora_ids=static[2])  # warm-up: compiles, allocates the workspaces
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(*static[:2], lora_ids=static[2])
    for seed in (2, 3):
        nx, nl, ni = _inputs(T, seed)
        for s, n in zip(static, (nx, nl, ni)):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = layer(nx, nl, lora_ids=ni)
        assert torch.equal(out, want), (out.float() - want.float()).abs().max()
        # and the same as the public call (same kernels, configs and alignment)
        tw, ti = route(nl, K)
        pub = fused_moe_lora(
            nx, layer.w13, layer.w2, tw, ti, ni, layer.lora_a13, layer.lora_b13, layer.lora_a2,
            layer.lora_b2, stage=layer.stage_for(T).name, deterministic=det,
        )  # fmt: skip
        assert torch.equal(out, pub)
    assert set(layer._stages) == {T}  # resolved once, at the warm-up


def test_torch_compile_fullgraph_on_gpu():
    layer = _layer()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = layer
            self.norm = torch.nn.LayerNorm(H, device="cuda", dtype=DT)

        def forward(self, x, logits, ids):
            return x + self.moe(self.norm(x), logits, lora_ids=ids)

    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    # the layer's op has no backward (serving only): under autograd, torch.compile would trace one
    with torch.no_grad():
        for T in (3, 17):
            x, logits, ids = _inputs(T, T)
            want = block(x, logits, ids)
            got = compiled(x, logits, ids)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_public_call_bad_ids_raise_after_launch_and_context_survives():
    layer = _layer()
    x, logits, ids = _inputs(8, 4)
    tw, ti = route(logits, K)
    args = (layer.w13, layer.w2)
    lora = (layer.lora_a13, layer.lora_b13, layer.lora_a2, layer.lora_b2)
    bad_ti = ti.clone()
    bad_ti[3, 1] = E + 5
    with pytest.raises(ValueError, match="topk_ids values must be in"):
        fused_moe_lora(x, *args, tw, bad_ti, ids, *lora, stage="tuned")
    bad_ids = ids.clone()
    bad_ids[0] = L
    with pytest.raises(ValueError, match="lora_ids values must be in"):
        fused_moe_lora(x, *args, tw, ti, bad_ids, *lora, stage="tuned")
    out = fused_moe_lora(x, *args, tw, ti, ids, *lora, stage="tuned")
    torch.cuda.synchronize()  # no device-side fault left behind
    assert torch.isfinite(out.float()).all()


def test_shared_scratch_two_layers_in_one_graph():
    a, b = _layer(), _layer()
    assert a._scratch is b._scratch and a.memory_report()["scratch_shared_by"] >= 2
    x, logits, ids = _inputs(16, 5)
    want = b(a(x, logits, lora_ids=ids), logits, lora_ids=ids)
    static = [t.clone() for t in (x, logits, ids)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b(a(*static[:2], lora_ids=static[2]), static[1], lora_ids=static[2])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b(a(*static[:2], lora_ids=static[2]), static[1], lora_ids=static[2])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_kernels_are_compiled_not_interpreted():
    # a test module that set TRITON_INTERPRET at import once made every kernel module imported after it
    # run under the interpreter in the GPU test process
    from moelora_lib.kernels import align, id_bounds, route
    from moelora_lib.kernels.triton_kernels import KERNELS

    for k in (route._route, id_bounds._id_bounds, align._align_count_kernel, KERNELS["fused_moe"][False]):
        assert type(k).__name__ == "JITFunction", type(k).__name__
