"""Shared dense-projection alignments within a model step (:class:`moelora_lib.linear.StepAlignments`).

A :class:`~moelora_lib.model.MultiLoRAModel` forward runs its layers inside ``step_alignments.scope()``:
every LoRALinear of one key (lora_ids tensor, T, BLOCK_SIZE_M, L, the module's loaded slots) reads the
alignment its first module made. Checks, on a tiny 2-layer dense Qwen3 (fp32, Triton interpreter) with
slot 0 on every projection, slot 1 on the attention projections and one down_proj only (so two keys
interleave through the step and share the modules' scratch sizes), slot 2 empty, and a batch of rows on
slots 0, 1 and -1:

* the logits (prefill and decode) equal bit for bit those of ``share_alignments = False`` (each
  projection aligned on its own), on the one-launch path and on the three-launch path;
* the alignment launches once per step and key (2 here, against 4 per layer without sharing), the
  empty-slot mapping likewise; with every slot loaded everywhere, once per step;
* a LoRALinear outside a scope aligns per call; two LoRALinear modules with different slots in one scope
  each get their own alignment, equal to their unshared forwards; the scope nests (joins) and closes on
  an exception.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moelora_lib.linear as linear_mod
from moelora_lib.linear import LoRALinear, StepAlignments
from moelora_lib.model.checkpoint import random_model
from moelora_lib.model.config import REAL_CONFIGS

NL = 2  # the two keys still interleave (layers.1.mlp.down_proj has the attention's slots)


def _tiny_dense():
    cfg = dict(REAL_CONFIGS["qwen3-32b"])
    cfg.update(
        hidden_size=32,
        num_hidden_layers=NL,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=64,
    )
    model = random_model(
        cfg,
        seed=0,
        dtype=torch.float32,
        device="cpu",
        num_adapters=3,
        max_rank=4,
        max_batch=3,
        max_seq=8,
        max_tokens=8,
        std=0.3,
    )
    g = torch.Generator().manual_seed(1)

    def load(m: LoRALinear, slot: int, rank: int) -> None:
        a = [torch.randn(rank, m.in_features, generator=g) * 0.3 for _ in m.slices]
        b = [torch.randn(n, rank, generator=g) * 0.3 for n in m.slices]
        m.load_adapter(slot, a, b, 1.0)

    for name, m in model.lora_modules().items():
        load(m, 0, 4)  # slot 0: every projection
        if "self_attn" in name or name == "layers.1.mlp.down_proj":
            load(m, 1, 2)  # slot 1: attention, and one MLP projection
    return model


def _step_logits(model, share: bool) -> list[torch.Tensor]:
    """Prefill of 2 tokens, then one decode step, rows on slots 0, 1 and none."""
    model.share_alignments = share
    ids = torch.tensor([0, 1, -1])
    tokens = torch.tensor([[5, 9], [3, 7], [11, 2]])
    pre = model(tokens, [0, 0, 0], ids)
    dec = model(torch.tensor([[1], [4], [6]]), [2, 2, 2], ids)
    return [pre, dec]


def _count(monkeypatch, name: str) -> list[int]:
    calls = [0]
    fn = getattr(linear_mod, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(linear_mod, name, counted)
    return calls


def _count_mapping(monkeypatch) -> list[int]:
    calls = [0]
    fn = LoRALinear._map_empty_slots

    def counted(self, lora_ids):
        calls[0] += 1
        return fn(self, lora_ids)

    monkeypatch.setattr(LoRALinear, "_map_empty_slots", counted)
    return calls


@pytest.fixture(scope="module")
def model():
    return _tiny_dense()


@pytest.mark.parametrize("path", ["pair", "multi"])
def test_model_step_shares_alignments_bitwise(model, monkeypatch, path):
    if path == "multi":  # the three-launch alignment (T > PAIR_PATH_MAX_PAIRS on a GPU)
        monkeypatch.setattr(linear_mod, "use_pair_path", lambda *a: False)
    align = _count(monkeypatch, "align_tokens_pair" if path == "pair" else "align_tokens_triton")
    mapped = _count_mapping(monkeypatch)
    lin = [m for m in model.lora_modules().values() if isinstance(m, LoRALinear)]
    assert len(lin) == 4 * NL
    # every projection picks one BLOCK_SIZE_M at these T, so the keys differ only by the loaded slots
    for T in (6, 3):
        assert len({m.config_for(T).block_size_m for m in lin}) == 1
    assert len({tuple(m._loaded) for m in lin}) == 2

    unshared = _step_logits(model, share=False)
    assert align[0] == mapped[0] == 2 * 4 * NL  # every projection of both steps aligns and maps
    align[0] = mapped[0] = 0
    shared = _step_logits(model, share=True)
    assert align[0] == mapped[0] == 2 * 2  # per step: one per key (attention's slots, the MLP's)
    for a, b in zip(shared, unshared):
        assert torch.equal(a, b)
    model.share_alignments = True


def test_model_without_empty_slots_aligns_once_per_step(monkeypatch):
    """Every projection holds the same slots (none empty): one key, one alignment, no mapping."""
    m = _tiny_dense()
    for mod in m.lora_modules().values():
        for slot in set(range(3)) - set(mod.loaded_slots):
            a = [torch.full((1, mod.in_features), 0.1) for _ in mod.slices]
            mod.load_adapter(slot, a, [torch.full((n, 1), 0.1) for n in mod.slices])
    align = _count(monkeypatch, "align_tokens_pair")
    _step_logits(m, share=True)
    assert align[0] == 2  # one per step


def _linears(slices=(16, 8), L=3, H=32):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(sum(slices), H, generator=g) * 0.2
    kw = dict(slices=slices, num_adapters=L, max_rank=4, max_tokens=16)
    a, b = LoRALinear(w, **kw), LoRALinear(w.clone(), **kw)  # same sizes: one shared scratch
    assert a._scratch is b._scratch
    for slot, mods in ((0, (a, b)), (1, (a,))):
        for m in mods:
            m.load_adapter(
                slot,
                [torch.randn(4, H, generator=g) * 0.3 for _ in slices],
                [torch.randn(n, 4, generator=g) * 0.3 for n in slices],
            )
    x = torch.randn(5, H, generator=g)
    return a, b, x, torch.tensor([0, 1, -1, 1, 0])


def test_linear_modules_in_a_scope(monkeypatch):
    """Two modules with different loaded slots sharing one scratch, interleaved in one scope: each key
    aligns once, in the scope's workspaces, and every output equals the module's unshared forward."""
    a, b, x, ids = _linears()
    with torch.no_grad():
        ref_a, ref_b = a(x, ids), b(x, ids)
        align = _count(monkeypatch, "align_tokens_pair")
        scope = StepAlignments()
        with scope.scope():
            got = [a(x, ids), b(x, ids), a(x, ids), b(x, ids)]
            assert align[0] == 2
            a(x, ids.clone())  # another lora_ids tensor: another key
            assert align[0] == 3
        assert len(scope._pool) == 1 and len(next(iter(scope._pool.values()))) == 3
        for out, ref in zip(got, (ref_a, ref_b, ref_a, ref_b)):
            assert torch.equal(out, ref)
        # outside the scope: per call again
        align[0] = 0
        assert torch.equal(a(x, ids), ref_a) and align[0] == 1
        # a second step reuses the scope's workspaces
        with scope.scope():
            assert torch.equal(b(x, ids), ref_b) and torch.equal(a(x, ids), ref_a)
        assert len(next(iter(scope._pool.values()))) == 3


def test_scope_nests_and_closes_on_error(monkeypatch):
    a, _, x, ids = _linears()
    align = _count(monkeypatch, "align_tokens_pair")
    scope = StepAlignments()
    with torch.no_grad(), scope.scope():
        a(x, ids)
        with scope.scope():  # joins the open step
            a(x, ids)
        a(x, ids)
        other = StepAlignments()
        with other.scope():  # another object's step: its own alignments
            a(x, ids)
        a(x, ids)
    assert align[0] == 2
    with pytest.raises(RuntimeError, match="boom"), scope.scope():
        raise RuntimeError("boom")
    assert linear_mod._OPEN_STEP.get() is None
    # a copy of the scope object holds no workspaces of the original
    assert copy.deepcopy(scope)._pool == {}
