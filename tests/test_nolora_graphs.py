"""LoRA variants: a forward serves only the adapter slots of its batch, so the LoRA launches that none of
them needs are skipped (none at all without adapters), and the Generator keeps a CUDA graph per bucket
and variant.

* Modules (``LoRALinear``, ``MoELoRALayer`` in stages ``tuned`` and ``fused``): with ``active_slots``
  empty, a batch without adapters makes no LoRA launch (alignment, shrink, expand) and its output is the
  base output bit for bit, equal to the base rows of the unrestricted forward on a mixed batch; a
  restriction to the batch's slots (or to slots of the same launches) equals the unrestricted forward bit
  for bit and drops the launches of a projection no served slot covers; the launch tuples
  (``lora_launches``) and the argument checks.
* Model: ``MultiLoRAModel.restrict_slots`` nests and restores; ``lora_launches`` is shared by adapters of
  equal coverage; a CPU forward refuses ids that need a skipped launch.
* Generator on a float64 stub with variants (cheap): each prefill call and decode step runs restricted to
  its requests' slots, its graph is the one of its variant (re-packing after an eos switches to the
  base-only graph), ``warmup`` captures the base-only and the all-loaded variants per bucket and reports
  them, and a later call of either kind captures nothing.
* Generator on a one-layer MoE model (fp32, CPU interpreter): a batch without adapters while two are
  loaded makes no LoRA launch and gives the tokens of the model with nothing loaded; a mixed batch whose
  adapter request ends at eos gives the tokens of the unrestricted run, steps with the adapter and then
  without it.
* GPU (marked ``gpu``, bf16): after ``warmup``, batches without and with adapters replay without a new
  capture, and the tokens without adapters equal those of the model with its adapters unloaded.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_layer import _adapter as moe_adapter
from test_layer import _inputs as moe_inputs
from test_layer import _layer
from test_lora_linear import _adapter as dense_adapter
from test_lora_linear import _module as dense_module
from test_model_generate import naive_greedy, prompts_of
from test_prefill_graphs import PadStub

import moelora_lib.kernels.stages as plan
import moelora_lib.layer as layer_mod
import moelora_lib.linear as linear_mod
from moelora_lib.model import Generator, random_model
from moelora_lib.studies import e2e


# --------------------------------------------------------------------------------------------------
# launch counters
# --------------------------------------------------------------------------------------------------
def _wrap(monkeypatch, module, name, log, label):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        tag = label(args, kwargs)
        if tag is not None:
            log.append(tag)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.fixture
def launches(monkeypatch):
    """Every LoRA launch of LoRALinear and MoELoRALayer, as it is made: ``dense_align`` /
    ``dense_lora`` (shrink + expand); ``moe_align`` (a LoRA alignment, alone or paired with the base
    one), ``shrink5`` / ``expand5`` (gate_up: 5-D A and B), ``shrink4`` / ``expand4`` (down), and in stage
    ``fused`` ``fused5`` / ``fused4`` (a base GEMM carrying the expand)."""
    log: list[str] = []
    _wrap(monkeypatch, linear_mod, "dense_lora_add", log, lambda a, k: "dense_lora")
    _wrap(monkeypatch, linear_mod, "align_tokens_pair", log, lambda a, k: "dense_align")
    _wrap(monkeypatch, linear_mod, "align_tokens_triton", log, lambda a, k: "dense_align")
    _wrap(monkeypatch, layer_mod, "align_tokens_pair", log, lambda a, k: "moe_align")
    _wrap(monkeypatch, layer_mod, "align_tokens_triton", log,
          lambda a, k: "moe_align" if k.get("lora_ids") is not None else None)  # fmt: skip
    for name in ("lora_shrink", "lora_shrink_rows"):
        _wrap(monkeypatch, plan, name, log, lambda a, k: f"shrink{a[1].dim()}")
    _wrap(monkeypatch, plan, "lora_expand", log, lambda a, k: f"expand{a[1].dim()}")
    _wrap(monkeypatch, plan, "fused_moe_lora", log,
          lambda a, k: None if k.get("inter") is None else f"fused{k['lora_b'].dim()}")  # fmt: skip
    return log


# --------------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------------
def _forward(module, active, *args, **kwargs):
    """One forward of ``module`` with ``active_slots = active`` (restored afterwards)."""
    prev = module.active_slots
    module.active_slots = active
    try:
        return module(*args, **kwargs)
    finally:
        module.active_slots = prev


def test_lora_linear_restricted(launches):
    m = dense_module("tuned", dt=torch.float16)
    for slot, seed in ((0, 1), (1, 2)):
        a, b = dense_adapter(8, seed)
        m.load_adapter(slot, a, b, scaling=2.0)
    g = torch.Generator().manual_seed(5)
    T = 9
    x = (torch.randn(T, m.in_features, generator=g) * 0.5).half()
    none = torch.full((T,), -1, dtype=torch.int32)
    mixed = torch.tensor([0, -1, 1, -1, 0, 0, -1, 1, -1], dtype=torch.int32)
    only0 = torch.where(mixed == 1, -1, mixed)
    base = F.linear(x, m.weight, m.bias)
    assert m.lora_launches() == (True,)
    assert m.lora_launches([]) == m.lora_launches([2]) == (False,)  # slot 2 is empty

    launches.clear()
    full = m(x, mixed)
    assert launches == ["dense_align", "dense_lora"]  # unrestricted: the LoRA launches run
    assert not torch.equal(full[mixed == 0], base[mixed == 0])  # the adapters matter
    launches.clear()
    out = _forward(m, (), x, none)
    assert launches == []  # no LoRA launch at all
    assert torch.equal(out, base) and torch.equal(out[mixed < 0], full[mixed < 0])
    assert torch.equal(_forward(m, {0}, x, only0), m(x, only0))
    assert torch.equal(_forward(m, {0, 2}, x, only0), m(x, only0))  # slot 2 is empty
    # a slot of the same launches serves slot 0's rows too (what a shared graph relies on)
    assert torch.equal(_forward(m, [1], x, mixed), full)
    assert m.active_slots is None
    for bad in ([3], [-1], [0.0], "0", 1, [True], [[0]]):
        with pytest.raises(ValueError, match="active_slots"):
            m.active_slots = bad
        with pytest.raises(ValueError, match="slots"):
            m.lora_launches(bad)
    assert m.active_slots is None


@pytest.mark.parametrize("stage", ["tuned", "fused"])
def test_moe_layer_restricted(stage, launches):
    dt, T = torch.float32, 8
    layer, plain = _layer(dt, stage), _layer(dt, stage)  # the same weights; nothing loaded in plain
    gu0, dn0 = moe_adapter(dt, 8, seed=1)
    gu1, _ = moe_adapter(dt, 4, seed=2)
    layer.load_adapter(0, gate_up=gu0, down=dn0)
    layer.load_adapter(1, gate_up=gu1)  # gate_up only
    assert layer.lora_launches() == layer.lora_launches([0]) == layer.lora_launches({0, 1}) == (True, True)
    assert layer.lora_launches([1]) == (True, False) and layer.lora_launches([]) == layer.lora_launches([2])
    assert layer.lora_launches([2]) == (False, False)
    x, logits, _ = moe_inputs(dt, T)
    mixed = torch.tensor([0, -1, 1, -1, 0, 1, -1, 0], dtype=torch.int32)
    none = torch.full_like(mixed, -1)
    ids0, ids1 = torch.where(mixed == 1, -1, mixed), torch.where(mixed == 0, -1, mixed)
    base = plain(x, logits, lora_ids=none)

    launches.clear()
    full = layer(x, logits, lora_ids=mixed)
    gate_up, down = ("fused5", "fused4") if stage == "fused" else ("expand5", "expand4")
    assert {"moe_align", "shrink5", gate_up, "shrink4", down} <= set(launches)
    assert not torch.equal(full[mixed >= 0], base[mixed >= 0])  # the adapters matter
    launches.clear()
    out = _forward(layer, (), x, logits, lora_ids=none)
    assert launches == []  # the base path alone
    assert torch.equal(out, base) and torch.equal(full[mixed < 0], base[mixed < 0])
    # slot 1 covers gate_up only: no down LoRA launch; the rows equal the unrestricted forward's
    ref1 = layer(x, logits, lora_ids=ids1)
    launches.clear()
    out1 = _forward(layer, [1], x, logits, lora_ids=ids1)
    assert launches and not {"shrink4", "expand4", "fused4"} & set(launches), launches
    assert torch.equal(out1, ref1) and torch.equal(out1[ids1 < 0], base[ids1 < 0])
    assert torch.equal(_forward(layer, [0], x, logits, lora_ids=ids0), layer(x, logits, lora_ids=ids0))
    # slot 0's launches serve slot 1's rows too (gate_up only: covered by slot 0's)
    assert torch.equal(_forward(layer, [0], x, logits, lora_ids=mixed), full)
    assert layer.active_slots is None
    with pytest.raises(ValueError, match="active_slots"):
        layer.active_slots = [3]


# --------------------------------------------------------------------------------------------------
# the model: restrict_slots, lora_launches
# --------------------------------------------------------------------------------------------------
def _moe_model(**kw):
    """tiny-qwen3-moe with one layer (qkv and o LoRALinear, one MoELoRALayer), fp32 on the CPU."""
    cfg = e2e.config_dict("tiny-qwen3-moe")
    cfg.update(num_hidden_layers=1, max_window_layers=1)
    sizes = dict(dtype=torch.float32, device="cpu", num_adapters=3, max_rank=4, max_batch=4, max_seq=10)
    sizes.update(max_tokens=30, **kw)  # prompts of <= 4 tokens pad to 10: one prefill call of 3 rows
    return random_model(cfg, seed=0, **sizes)


def _load_two(model, rank=4):
    """Slots 0 and 1: random adapters on every projection, large enough to change the tokens."""
    for slot in (0, 1):
        e2e.load_random_adapter(model, slot, rank=rank, alpha=2 * rank, seed=slot, std=0.3)


def test_restrict_slots_and_launch_tuples():
    model = _moe_model()
    _load_two(model)
    moe = model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    a = torch.randn(moe.E, moe.S, 4, moe.H, generator=g) * 0.1
    b = torch.randn(moe.E, moe.S, 2 * moe.I // moe.S, 4, generator=g) * 0.1
    moe.load_adapter(2, gate_up=(a, b))  # slot 2: the MoE gate_up only
    mods = list(model.lora_modules().values())
    full = model.lora_launches()
    assert len(full) == len(mods) == 3 and all(all(t) for t in full)
    # adapters of equal coverage share one tuple (one graph); none: all False; slot 2 its own
    assert model.lora_launches([0]) == model.lora_launches([1]) == model.lora_launches({0, 1, 2}) == full
    assert not any(any(t) for t in model.lora_launches([]))
    assert model.lora_launches([2]) == ((False,), (False,), (True, False))
    with model.restrict_slots([0, 0]) as outer:
        assert outer == frozenset({0}) and all(m.active_slots == outer for m in mods)
        with model.restrict_slots(()):
            assert all(m.active_slots == frozenset() for m in mods)
        assert all(m.active_slots == outer for m in mods)
        with pytest.raises(RuntimeError, match="boom"), model.restrict_slots([1]):
            raise RuntimeError("boom")
        assert all(m.active_slots == outer for m in mods)
    assert all(m.active_slots is None for m in mods)
    for bad in ([3], [-1], "0", 2):
        with pytest.raises(ValueError, match="slot"), model.restrict_slots(bad):
            pass
        with pytest.raises(ValueError, match="slot"):
            model.lora_launches(bad)
    assert all(m.active_slots is None for m in mods)
    # a CPU forward refuses ids that need a launch its restriction skips (checked before any work)
    ids, start = torch.tensor([[3], [4]]), torch.zeros(2, dtype=torch.int64)
    with model.restrict_slots([2]):
        with pytest.raises(ValueError, match=r"lora_ids: slot\(s\) \[0\] need LoRA launches"):
            model(ids, start, torch.tensor([0, 2], dtype=torch.int32), last_only=True)


# --------------------------------------------------------------------------------------------------
# the generator's variants on a stub (float64, no kernels)
# --------------------------------------------------------------------------------------------------
class VariantStub(PadStub):
    """PadStub with LoRA variants: slots 0 and 1 cover both of two "projections", slot 2 the first only.
    ``restrict_slots`` sets the restriction each forward checks its ids against (the stub's math ignores
    it); ``log`` has ((B, S), restriction or None) per forward."""

    COVERS = {0: (True, True), 1: (True, True), 2: (True, False)}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.restriction: frozenset[int] | None = None
        self.log: list[tuple[tuple[int, int], tuple[int, ...]]] = []

    def lora_modules(self):
        return {"stub": SimpleNamespace(loaded_slots=dict(self.COVERS))}

    @contextlib.contextmanager
    def restrict_slots(self, slots):
        prev, self.restriction = self.restriction, frozenset(slots)
        try:
            yield self.restriction
        finally:
            self.restriction = prev

    def lora_launches(self, slots=None):
        covers = [self.COVERS[s] for s in (self.COVERS if slots is None else slots)]
        return any(c[0] for c in covers), any(c[1] for c in covers)

    def forward(self, input_ids, start_pos, lora_ids, *, cache_rows=None, last_only=False, kv_len=None,
                last_index=None):  # fmt: skip
        kw = dict(cache_rows=cache_rows, last_only=last_only, kv_len=kv_len, last_index=last_index)
        r = self.restriction  # None: unrestricted (the naive reference loop)
        assert r is None or set(lora_ids.tolist()) - {-1} <= r, (lora_ids, r)
        self.log.append((tuple(input_ids.shape), None if r is None else tuple(sorted(r))))
        return super().forward(input_ids, start_pos, lora_ids, **kw)


class EmulatedGraphs(Generator):
    """CUDA-graph semantics emulated on the CPU at ``_capture_graph`` (test_generate_slots'
    CountingGraphGenerator): capture runs the forward once and freezes its outputs, replay reruns it into
    them; ``events`` logs (kind, what, variant) with the variant of the restriction the capture ran under."""

    def __init__(self, model, **kw):
        super().__init__(model, pad_to_buckets=True, pad_prefill=True, **kw)
        self.use_cuda_graphs = True  # the constructor refuses it on the CPU
        self.events: list[tuple[str, str, object]] = []

    def _capture_graph(self, fn, what):
        first = fn()
        variant = self.model.lora_launches(self.model.log[-1][1])
        outs = tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone()

        def replay():
            self.events.append(("replay", what.split()[1], variant))
            new = fn()
            for o, n in zip(outs, new) if isinstance(outs, tuple) else [(outs, new)]:
                o.copy_(n)

        self.captures += 1
        self.events.append(("capture", what.split()[1], variant))
        return SimpleNamespace(replay=replay), outs


NONE, BOTH, FIRST = (False, False), (True, True), (True, False)


def _eos_ending_first(ref: list[list[int]]) -> tuple[int, int]:
    """(k, eos): request 0's token at output position k >= 1, seen nowhere before it in request 0 and
    nowhere in the others, and at least two positions before the end: request 0 ends there, the rest go on."""
    for k in range(1, len(ref[0]) - 2):
        tok = ref[0][k]
        if tok not in ref[0][:k] and all(tok not in r for r in ref[1:]):
            return k, tok
    raise AssertionError(f"no eos candidate in {ref}")


def test_stub_step_variants_follow_the_requests():
    """Request 0 (slot 0) ends at eos; the others (no adapter) go on in a smaller bucket: its steps replay
    the base-only graph. Every forward ran restricted to its requests' slots."""
    stub = VariantStub(max_batch=4, max_seq=40, max_tokens=120)  # one prefill call of 3 x 40 tokens
    prompts, adapters, new = prompts_of([5, 5, 5], seed=3), [0, None, None], 10
    ref = [naive_greedy(stub, p, a, new) for p, a in zip(prompts, adapters)]
    k, eos = _eos_ending_first(ref)
    gen = EmulatedGraphs(stub, graph_batch_sizes=(1, 2, 4))
    stub.log.clear()
    res = gen.generate(prompts, adapters, new, eos_token_id=eos)
    assert res.tokens == [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert res.decode_slots == [(0,)] * k + [()] * (new - 1 - k)
    assert res.decode_batch_sizes == [(3, 4)] * k + [(2, 2)] * (new - 1 - k)
    # prefill and decode (bucket 4) with slot 0: capture + replay each, then k - 1 replays; bucket 2 without
    assert [r for _, r in stub.log] == [(0,)] * (3 + k) + [()] * (new - k)
    decode = [(kind, v) for kind, what, v in gen.events if what == "decode"]
    assert decode == [("capture", BOTH)] + [("replay", BOTH)] * k + [("capture", NONE)] + [
        ("replay", NONE)
    ] * (new - 1 - k)
    assert {s: set(b.graphs) for s, b in gen._buckets.items()} == {4: {BOTH}, 2: {NONE}}
    assert gen._buckets[2].variant == stub.lora_launches(()) == NONE


def test_stub_warmup_captures_both_variants():
    """max_seq 40, max_tokens 80: 5-token prompts pad to 40, two per call. warmup captures the base-only
    and the all-loaded variants of each bucket; calls without adapters or with adapters of full coverage
    capture nothing; slot 2 alone (other coverage) captures its own variant on first use."""
    stub = VariantStub(max_batch=4, max_seq=40, max_tokens=80)
    gen = EmulatedGraphs(stub, graph_batch_sizes=(1, 2, 4))
    plan = gen.warmup(prefill_lengths=[5])
    assert plan == {
        "decode": [4, 2, 1], "prefill": {40: [1, 2]}, "eager": [], "variants": [(), (0, 1, 2)],
        "captured": 10,
    }  # fmt: skip
    captured = [(what, v) for kind, what, v in gen.events if kind == "capture"]
    # per bucket (prefill rows 2, 1; decode 4, 2, 1) the LoRA variant first
    assert captured == [("prefill", BOTH), ("prefill", NONE)] * 2 + [("decode", BOTH), ("decode", NONE)] * 3
    n = gen.captures
    prompts = prompts_of([5, 5, 5, 5], seed=4)
    for adapters in ([None] * 4, [0, 1, 0, None], [1, 1, 0, 0]):
        res = gen.generate(prompts, adapters, 3)
        assert res.tokens == [naive_greedy(stub, p, a, 3) for p, a in zip(prompts, adapters)]
    assert gen.captures == n
    assert gen.generate(prompts[:1], [2], 3).tokens == [naive_greedy(stub, prompts[0], 2, 3)]
    assert gen.captures == n + 2  # prefill (1 row) and decode (bucket 1), variant FIRST
    assert {v for _, _, v in gen.events[-3:]} == {FIRST}
    assert gen.warmup(prefill_lengths=[5])["captured"] == 0


# --------------------------------------------------------------------------------------------------
# the generator on a real model (one MoE layer, fp32, CPU interpreter)
# --------------------------------------------------------------------------------------------------
GEN = dict(pad_to_buckets=True, pad_prefill=True, graph_batch_sizes=(1, 2, 4))


def test_no_adapter_batch_runs_the_base_model(launches):
    """Two adapters loaded, a batch without adapters: no LoRA launch in any forward (prefill, decode),
    the base-only variant in every step, and the tokens of the same model with nothing loaded."""
    model = _moe_model()
    _load_two(model)
    prompts, new = e2e.make_prompts(3, 4, model.config.vocab_size, 0), 2  # the prefill and a decode step
    gen = Generator(model, **GEN)
    launches.clear()
    res = gen.generate(prompts, [None] * 3, new)
    assert launches == []
    assert res.decode_slots == [()] * (new - 1)
    assert gen._buckets[4].variant == model.lora_launches([]) == ((False,), (False,), (False, False))
    for slot in (0, 1):
        model.unload_adapter(slot)
    assert Generator(model, **GEN).generate(prompts, [None] * 3, new).tokens == res.tokens


def test_mixed_batch_switches_to_base_after_eos(launches):
    """Request 0 (slot 0) ends at eos, the two without adapter go on: the tokens equal the unrestricted run's
    (a generator without variants: every forward makes every loaded slot's launches); the LoRA launches
    run in the forwards with slot 0 only."""
    model = _moe_model()
    _load_two(model)
    # four tokens: one decode step with slot 0 (k = 1), then two without
    prompts, adapters, new = e2e.make_prompts(3, 4, model.config.vocab_size, 1), [0, None, None], 4
    ref_gen = Generator(model, **GEN)
    ref_gen._has_variants = False  # the forward unrestricted, as before variants
    ref = ref_gen.generate(prompts, adapters, new).tokens
    k, eos = _eos_ending_first(ref)
    launches.clear()
    res = Generator(model, **GEN).generate(prompts, adapters, new, eos_token_id=eos)
    assert res.tokens == [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert res.decode_slots == [(0,)] * k + [()] * (new - 1 - k)
    assert launches.count("dense_lora") == 2 * (1 + k)  # qkv and o, in the prefill and k steps with slot 0


# --------------------------------------------------------------------------------------------------
# GPU: real CUDA graphs
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_variants_replay_without_new_captures():
    """bf16 tiny-qwen3-moe, adapters in both slots: warmup captures the base-only and the all-loaded
    variant of every bucket; batches without adapters, with both and with slot 0 alone (the all-loaded
    variant: same coverage) replay them without a new capture; the tokens without adapters equal those of
    the model with its adapters unloaded, and so do the base rows of the mixed batch."""
    model = e2e.build_model(
        "tiny-qwen3-moe", dtype=torch.bfloat16, device="cuda", max_batch=4, max_seq=32, max_tokens=96,
        num_adapters=2, max_rank=8,
    )  # fmt: skip
    for slot in (0, 1):
        e2e.load_random_adapter(model, slot, rank=8, alpha=16, seed=slot, std=0.1)
    gen = Generator(model)
    assert gen.use_cuda_graphs and gen.pad_prefill
    plan = gen.warmup(prefill_lengths=[5])
    # 5-token prompts pad to 32, max_tokens // 32 = 3 per call: prefill rows 1..3; decode buckets 4, 2, 1
    assert plan["variants"] == [(), (0, 1)]
    assert plan["prefill"] == {32: [1, 2, 3]} and plan["decode"] == [4, 2, 1]
    assert plan["captured"] == gen.captures == 2 * (3 + 3)
    n = gen.captures
    prompts = e2e.make_prompts(4, 5, model.config.vocab_size, 0)
    none = gen.generate(prompts, [None] * 4, 8)
    both = gen.generate(prompts, [0, 1, 1, 0], 8)
    mixed = gen.generate(prompts, [0, None, None, None], 8)
    assert gen.captures == n  # replayed, not captured
    assert none.decode_slots == [()] * 7 and both.decode_slots == [(0, 1)] * 7
    assert mixed.decode_slots == [(0,)] * 7
    for slot in (0, 1):
        model.unload_adapter(slot)
    base = Generator(model).generate(prompts, [None] * 4, 8).tokens
    assert none.tokens == base
    assert mixed.tokens[1:] == base[1:]  # base rows bit-identical beside an adapter's
