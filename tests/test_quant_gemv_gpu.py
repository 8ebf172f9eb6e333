"""On a GPU (skipped without CUDA), bf16: stage gemv and MXFP4 experts against the dense bf16 layer.

The CPU tests cover the math under the interpreter in fp32/fp16 (bf16 is wrong there); here: the bf16
kernels compiled for the GPU, stage gemv within bf16's tolerance of stage tuned, and every stage on packed
MXFP4 experts within bf16's tolerance of the same stage on the dequantized bf16 weights.
"""

from __future__ import annotations

import pytest
import torch

from moelora_lib.layer import MoELoRALayer
from moelora_lib.quant import MXFP4Weight
from moelora_lib.testing import assert_close_rel

pytestmark = pytest.mark.gpu

E, H, I, K, L, R = 8, 256, 128, 2, 4, 16
DT = torch.bfloat16


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.05).to("cuda", DT)
    b2 = (torch.randn(E, H, generator=g) * 0.05).to("cuda", DT)
    ad = []
    for _ in range(L - 1):
        ad.append(dict(
            gate_up=((torch.randn(E, 1, R, H, generator=g) * 0.05).to("cuda", DT),
                     (torch.randn(E, 1, 2 * I, R, generator=g) * 0.05).to("cuda", DT)),
            down=((torch.randn(E, R, I, generator=g) * 0.05).to("cuda", DT),
                  (torch.randn(E, H, R, generator=g) * 0.05).to("cuda", DT)),
        ))  # fmt: skip
    return w13, w2, b13, b2, ad


def _layer(w13, w2, b13, b2, ad, stage, **kw):
    layer = MoELoRALayer(w13, w2, top_k=K, num_adapters=L, max_rank=R, max_tokens=64, slices=1,
                         b13=b13, b2=b2, activation="swigluoai", stage=stage, **kw)  # fmt: skip
    for slot, a in enumerate(ad):
        layer.load_adapter(slot, **a)
    return layer


def _inputs(T, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", DT)
    logits = torch.randn(T, E, generator=g).to("cuda")
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32).to("cuda")
    return x, logits, ids


@pytest.mark.parametrize("T", [1, 8, 64])
def test_gemv_bf16_matches_tuned(T):
    w13, w2, b13, b2, ad = _weights()
    dense = dict(w13=w13.to("cuda", DT), w2=w2.to("cuda", DT), b13=b13, b2=b2, ad=ad)
    x, logits, ids = _inputs(T)
    got = _layer(**dense, stage="gemv")(x, logits, lora_ids=ids)
    ref = _layer(**dense, stage="tuned")(x, logits, lora_ids=ids)
    assert_close_rel(got, ref, dtype=DT, what=f"gemv vs tuned at T={T}")


@pytest.mark.parametrize("stage", ["tuned", "fused", "gemv"])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_mxfp4_layer_bf16_matches_dequantized(stage, T):
    w13, w2, b13, b2, ad = _weights()
    m13, m2 = MXFP4Weight.quantize(w13.cuda()), MXFP4Weight.quantize(w2.cuda())
    x, logits, ids = _inputs(T)
    packed = _layer(m13, m2, b13, b2, ad, stage, dtype=DT)(x, logits, lora_ids=ids)
    dense = _layer(m13.dequantize(DT), m2.dequantize(DT), b13, b2, ad, stage)(x, logits, lora_ids=ids)
    assert torch.isfinite(packed).all()
    assert_close_rel(packed, dense, dtype=DT, what=f"mxfp4 {stage} vs dequantized at T={T}")
