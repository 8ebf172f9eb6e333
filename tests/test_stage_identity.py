"""Stages survive copies (the layer compares them by identity), and stage gemv with no slot loaded.

Both cases came from a new-user trial: a deep-copied or unpickled layer of stage "auto" raised inside
its forward, and stage gemv gave NaN rows for valid adapter ids while no slot was loaded.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from moelora_lib import MoELoRALayer
from moelora_lib.kernels import AUTO_STAGE, GEMV_STAGE, STAGES

E, H, I = 4, 64, 32


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


@pytest.mark.parametrize("stage", [AUTO_STAGE, GEMV_STAGE, STAGES["fused"]], ids=lambda s: s.name)
def test_registered_stage_copies_as_itself(stage):
    assert copy.copy(stage) is stage and copy.deepcopy(stage) is stage
    assert pickle.loads(pickle.dumps(stage)) is stage


@pytest.mark.parametrize("stage", ["auto", "gemv"])
def test_copied_and_reloaded_layer_gives_the_same_output(stage):
    w13, w2 = _weights()
    layer = MoELoRALayer(w13, w2, top_k=2, num_adapters=2, max_rank=8, max_tokens=8, stage=stage)
    g = torch.Generator().manual_seed(1)
    a13, b13 = torch.randn(E, 2, 8, H, generator=g) * 0.1, torch.randn(E, 2, I, 8, generator=g) * 0.1
    layer.load_adapter(0, gate_up=(a13, b13))
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    ids = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    want = layer(x, logits, lora_ids=ids)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        assert other.stage is layer.stage
        assert torch.equal(other(x, logits, lora_ids=ids), want)


def test_gemv_without_loaded_slots_is_the_base():
    """No slot loaded: a valid id means no adapter (the base rows of stage tuned); an id outside
    [-1, L) still gives a NaN row, as in every stage."""
    w13, w2 = _weights()
    kw = dict(top_k=2, num_adapters=4, max_rank=16, max_tokens=16, slices=1, activation="swigluoai")
    tuned, gemv = MoELoRALayer(w13, w2, stage="tuned", **kw), MoELoRALayer(w13, w2, stage="gemv", **kw)
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(3, H, generator=g), torch.randn(3, E, generator=g)
    ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    y = gemv(x, logits, lora_ids=ids)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, tuned(x, logits, lora_ids=ids), rtol=1e-5, atol=1e-5)
    bad = torch.tensor([4, -1, 0], dtype=torch.int32)
    assert torch.isnan(gemv(x, logits, lora_ids=bad)).all(1).tolist() == [True, False, False]
