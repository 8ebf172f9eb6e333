"""Adapter slots and graphs around a running ``Generator.generate`` call, the ``max_tokens >= max_batch``
rule, and what ``Generator.warmup`` captures.

* A call holds the slots its requests use (``MultiLoRAModel.hold_slots``): loading or unloading one of
  them from the ``stream`` callback (``load_peft_adapter``, ``unload_adapter``, a LoRA module's own
  ``load_adapter`` / ``unload_adapter``) raises RuntimeError there, changes nothing, and the request's
  tokens are those of a run without the attempt; a free slot can change. The holds end with the call,
  also when it raises.
* A call is not re-entrant: ``generate`` / ``warmup`` on the same model and the generator's
  ``reset_graphs`` raise RuntimeError from inside it.
* ``max_tokens < max_batch`` is refused when the model or the Generator is built.
* ``warmup(prefill_lengths=...)`` captures every prefill row count a call of up to ``max_batch`` prompts
  can need (a call then captures nothing), and reports what it leaves to the eager path.

CPU: a one-layer Qwen3 written by transformers, adapters written by PEFT (fp32, Triton interpreter, ~0.5 s
per forward), and the float64 stub of test_model_generate where no kernel is needed. GPU (marked ``gpu``):
real CUDA graphs in bf16 after the slots change between calls, and the reserved memory over 30
load / generate / unload cycles.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_model_generate import StubLM, prompts_of
from test_prefill_graphs import PadStub

from moelora_lib.model import Generator, load_hf_checkpoint, load_peft_adapter
from moelora_lib.studies import e2e

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# --- checkpoints: a base written by transformers, adapters written by PEFT ---------------------------

_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=32,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=1,
    rms_norm_eps=1e-6,
    attention_bias=False,
)
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _write(root: Path, cfg, adapters: dict[str, tuple[int, list[str]]]) -> dict[str, Path]:
    """Base (weights N(0, 0.3²), so tokens are far from ties) and PEFT adapters {name: (rank, targets)}
    with LoRA factors N(0, 0.5²), so each adapter changes the greedy tokens."""
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    out = {"base": root / "base"}
    base.save_pretrained(out["base"])
    for i, (name, (rank, targets)) in enumerate(adapters.items()):
        torch.manual_seed(100 + i)
        pm = peft.get_peft_model(
            transformers.Qwen3ForCausalLM(cfg),
            peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, target_modules=targets),
        )
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.normal_(0.0, 0.5)
        out[name] = root / name
        pm.save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cfg = transformers.Qwen3Config(**_TINY)
    targets = ["q_proj", "v_proj", "down_proj"]
    return _write(tmp_path_factory.mktemp("slots"), cfg, {"a0": (2, targets), "a1": (2, targets)})


def _model(files, **kw):
    sizes = dict(dtype=torch.float32, device="cpu", num_adapters=3, max_rank=2, max_batch=2, max_seq=12)
    sizes.update(max_tokens=16, **kw)
    model = load_hf_checkpoint(files["base"], **sizes)
    load_peft_adapter(model, 0, files["a0"])
    return model


def _slot_tensors(model, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for m in model.lora_modules().values() for t in (m.lora_a, m.lora_b)]


PROMPT = [3, 1, 4, 1, 5]
NEW = 3  # the prefill's token and two decode steps after the stream callback's first token


# --- (a), (b): slots held by a running call ----------------------------------------------------------


def test_in_use_slot_cannot_change_during_the_call(files):
    """From the stream callback, every way to load or unload the running request's slot raises
    RuntimeError naming it and changes nothing; the tokens equal the run without the attempt; a free
    slot loads there; afterwards both slots serve their adapters."""
    model = _model(files)
    gen = Generator(model)
    ref = gen.generate([PROMPT], [0], NEW).tokens[0]
    load_peft_adapter(model, 1, files["a1"])
    other = gen.generate([PROMPT], [1], NEW).tokens[0]
    assert other != ref  # the swap this test refuses would change the tokens
    model.unload_adapter(1)
    before = _slot_tensors(model, 0)
    qkv = model.layers[0].self_attn.qkv_proj
    a, b = torch.ones(2, qkv.in_features), torch.ones(qkv.slices[0], 2)
    attempts = {
        "load_peft_adapter": lambda: load_peft_adapter(model, 0, files["a1"]),
        "unload_adapter": lambda: model.unload_adapter(0),
        "module load_adapter": lambda: qkv.load_adapter(0, [a, None, None], [b, None, None]),
        "module unload_adapter": lambda: qkv.unload_adapter(0),
    }
    errors, seen = {}, []

    def stream(i, tok):
        seen.append(tok)
        if len(seen) == 1:
            assert model.slots_in_use == frozenset({0})
            for what, attempt in attempts.items():
                with pytest.raises(RuntimeError) as e:
                    attempt()
                errors[what] = str(e.value)
            load_peft_adapter(model, 1, files["a1"])  # a free slot: allowed mid-call

    res = gen.generate([PROMPT], [0], NEW, stream=stream)
    assert res.tokens[0] == ref == seen
    assert set(errors) == set(attempts)
    for what, msg in errors.items():
        assert "slot 0" in msg and "running generate call" in msg, (what, msg)
    assert all(torch.equal(a, b) for a, b in zip(before, _slot_tensors(model, 0)))
    # released: both slots serve their adapters (slot 1 loaded mid-call), then change freely
    assert model.slots_in_use == frozenset()
    assert gen.generate([PROMPT, PROMPT], [0, 1], NEW).tokens == [ref, other]
    model.unload_adapter(0)
    load_peft_adapter(model, 0, files["a1"])


def test_slots_released_when_the_call_raises(files):
    model = _model(files)
    gen = Generator(model)

    def stream(i, tok):
        raise KeyError("consumer gone")

    with pytest.raises(KeyError, match="consumer gone"):
        gen.generate([PROMPT], [0], 2, stream=stream)
    assert model.slots_in_use == frozenset() and not gen._running
    model.unload_adapter(0)  # free again
    load_peft_adapter(model, 0, files["a0"])
    assert len(gen.generate([PROMPT], [0], 1).tokens[0]) == 1  # the generator is not left busy


def test_hold_slots_counts_nested_holders(files):
    model = _model(files)
    with model.hold_slots([0, 0]) as held:
        assert held == frozenset({0})
        with model.hold_slots({0, 2}):
            assert model.slots_in_use == frozenset({0, 2})
            with pytest.raises(RuntimeError, match="unload_adapter: slot 2 is in use"):
                model.unload_adapter(2)
        assert model.slots_in_use == frozenset({0})  # the outer holder still holds slot 0
        with pytest.raises(RuntimeError, match="load_peft_adapter: slot 0 is in use"):
            load_peft_adapter(model, 0, files["a1"])
        model.unload_adapter(2)  # released by the inner holder
        dup = copy.deepcopy(model)  # a copy holds nothing and guards its own modules
        assert dup.slots_in_use == frozenset()
        dup.layers[0].self_attn.qkv_proj.unload_adapter(0)
        with dup.hold_slots([1]), pytest.raises(RuntimeError, match="slot 1"):
            dup.layers[0].mlp.down_proj.unload_adapter(1)
        assert model.slots_in_use == frozenset({0})
    assert model.slots_in_use == frozenset()
    for bad in ([3], [-1], ["0"], 0):
        with pytest.raises(ValueError, match="slot"):
            with model.hold_slots(bad):
                pass
    assert model.slots_in_use == frozenset()


# --- (c): a running call is not re-entrant ----------------------------------------------------------


def test_nested_generate_warmup_reset_refused():
    stub = PadStub(max_seq=40, max_tokens=80)
    prompts = prompts_of([5, 7], seed=3)
    gen = Generator(stub, pad_prefill=True)
    ref = gen.generate(prompts, [0, None], 5).tokens
    other = Generator(stub, pad_prefill=True)
    calls = {
        "generate": lambda: gen.generate(prompts, [0, None], 2),
        "generate (other generator, same model)": lambda: other.generate(prompts, [1, None], 2),
        "warmup": lambda: gen.warmup(prefill_lengths=[5]),
        "warmup (other generator, same model)": lambda: other.warmup(),
        "reset_graphs": gen.reset_graphs,
    }
    errors = {}

    def stream(i, tok):
        if not errors:
            for what, call in calls.items():
                with pytest.raises(RuntimeError) as e:
                    call()
                errors[what] = str(e.value)
            other.reset_graphs()  # another generator's own graphs: not in use

    assert gen.generate(prompts, [0, None], 5, stream=stream).tokens == ref
    assert set(errors) == set(calls)
    assert "generate: a generate call on this model is running" in errors["generate"]
    assert "warmup: a generate call on this model is running" in errors["warmup"]
    assert "reset_graphs: this generator's generate call is running" in errors["reset_graphs"]
    gen.reset_graphs()  # after the call: allowed
    assert gen.warmup()["captured"] == 0  # no CUDA graphs on the CPU


# --- (d): max_tokens < max_batch --------------------------------------------------------------------


def test_max_tokens_below_max_batch_refused_at_construction(files):
    with pytest.raises(ValueError, match=r"max_tokens = 2 < max_batch = 4; max_tokens must be >= max_batch"):
        Generator(StubLM(max_batch=4, max_tokens=2))
    with pytest.raises(ValueError, match=r"max_tokens = 2 must be >= max_batch = 4"):
        load_hf_checkpoint(files["base"], dtype=torch.float32, device="cpu", num_adapters=1, max_rank=2,
                           max_batch=4, max_seq=12, max_tokens=2)  # fmt: skip
    Generator(StubLM(max_batch=4, max_tokens=4))  # equal: one decode step of 4 rows fits


# --- (e): warmup covers the multi-request prefill ---------------------------------------------------


class CountingGraphGenerator(Generator):
    """CUDA-graph semantics emulated on the CPU at the one capture point, ``_capture_graph``: "capture"
    runs the step once and freezes its output tensors, "replay" reruns the step into them; each capture
    counts in ``captures`` as a real one does."""

    def __init__(self, model, **kw):
        super().__init__(model, pad_to_buckets=True, pad_prefill=True, **kw)
        self.use_cuda_graphs = True  # the constructor refuses it on the CPU
        self.what: list[str] = []

    def _capture_graph(self, fn, what):
        first = fn()
        outs = tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone()

        def replay():
            new = fn()
            for o, n in zip(outs, new) if isinstance(outs, tuple) else [(outs, new)]:
                o.copy_(n)

        self.captures += 1
        self.what.append(what)
        return SimpleNamespace(replay=replay), outs


def test_warmup_captures_every_prefill_row_count():
    """max_tokens 256: prompts of 10 tokens pad to 64 (4 rows per call), of 100 to 128 (2 rows); 300
    pads to 320 > max_tokens (eager, reported). Calls of up to max_batch = 8 such prompts then capture
    nothing."""
    stub = PadStub(max_batch=8, max_seq=320, max_tokens=256)
    gen = CountingGraphGenerator(stub, graph_batch_sizes=(1, 2, 4))
    plan = gen.warmup(prefill_lengths=[10, 100, 300])
    assert plan == {
        "decode": [8, 4, 2, 1],
        "prefill": {64: [1, 2, 3, 4], 128: [1, 2]},
        "eager": [300],
        "variants": [None],  # the stub has one LoRA variant
        "captured": 10,
    }
    assert gen.captures == 10 and sorted(gen._prefill_buckets) == [
        (1, 64), (1, 128), (2, 64), (2, 128), (3, 64), (4, 64),
    ]  # fmt: skip
    ref = Generator(stub, pad_prefill=True)
    for lengths in ([10] * 8, [10] * 7, [10] * 5 + [100] * 3, [100] * 3 + [10] * 2):
        prompts = prompts_of(lengths, seed=len(lengths))
        adapters = [i % 3 - 1 for i in range(len(lengths))]
        assert gen.generate(prompts, adapters, 3).tokens == ref.generate(prompts, adapters, 3).tokens
    assert gen.captures == 10  # nothing captured inside the calls
    assert gen.warmup(prefill_lengths=[10, 100])["captured"] == 0  # all there already


def test_warmup_plan_without_graphs():
    """Without CUDA graphs warmup captures nothing but returns the same plan; one prompt per call
    without batch_prefill; every length eager without pad_prefill."""
    stub = PadStub(max_batch=8, max_seq=320, max_tokens=256)
    plan = Generator(stub, pad_prefill=True, pad_to_buckets=True).warmup(prefill_lengths=[10, 300])
    assert plan == {
        "decode": [8, 4, 2, 1], "prefill": {64: [1, 2, 3, 4]}, "eager": [300], "variants": [None],
        "captured": 0,
    }  # fmt: skip
    one = Generator(stub, pad_prefill=True, batch_prefill=False).warmup([3], prefill_lengths=[10, 100])
    assert one == {
        "decode": [3], "prefill": {64: [1], 128: [1]}, "eager": [], "variants": [None], "captured": 0,
    }  # fmt: skip
    assert Generator(stub).warmup(prefill_lengths=[10])["eager"] == [10]
    # max_prompts caps the row counts: one graph per padded length for a single-request start-up
    gen = Generator(stub, pad_prefill=True, pad_to_buckets=True)
    assert gen.warmup([1], prefill_lengths=[10, 100], max_prompts=1)["prefill"] == {64: [1], 128: [1]}
    assert gen.warmup([1], prefill_lengths=[10], max_prompts=3)["prefill"] == {64: [1, 2, 3]}
    for bad in (0, 9, 2.0, "all"):
        with pytest.raises(ValueError, match="max_prompts"):
            gen.warmup(prefill_lengths=[10], max_prompts=bad)


# --- GPU: real CUDA graphs in bf16 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_files(tmp_path_factory):
    """The study's tiny Qwen3 (2 layers, H 64) written by transformers; PEFT adapters: two covering every
    projection (same slots state) and one covering q/v only (another state)."""
    cfg = e2e.hf_model("tiny-qwen3", dtype=torch.float32, device="cpu").config
    adapters = {"b0": (4, _ALL), "b1": (4, _ALL), "qv": (4, ["q_proj", "v_proj"])}
    return _write(tmp_path_factory.mktemp("slots_gpu"), cfg, adapters)


def _gpu_model(gpu_files):
    sizes = dict(num_adapters=2, max_rank=4, max_batch=4, max_seq=32, max_tokens=96)
    return load_hf_checkpoint(
        gpu_files["base"], dtype=torch.bfloat16, device="cuda", deterministic=True, **sizes
    )


GPU_PROMPTS = [[5, 9, 2, 7, 1], [4, 4, 8, 1, 3], [6, 2, 2, 9, 5], [1, 7, 3, 3, 8]]


@pytest.mark.gpu
def test_gpu_graphs_follow_slot_changes(gpu_files):
    """Captured decode and prefill graphs after the slots change between calls: another adapter in a
    slot (same slots state: the graphs are replayed, reading the slot in place) gives a fresh
    Generator's tokens; an adapter of other coverage recaptures; an emptied slot is a clear error."""
    model = _gpu_model(gpu_files)
    load_peft_adapter(model, 0, gpu_files["b0"])
    load_peft_adapter(model, 1, gpu_files["qv"])
    gen = Generator(model)
    assert gen.use_cuda_graphs and gen.pad_prefill
    adapters = [0, 1, None, 0]
    first = gen.generate(GPU_PROMPTS, adapters, 6).tokens
    assert gen.captures > 0 and gen._prefill_buckets and gen._buckets
    n = gen.captures
    load_peft_adapter(model, 0, gpu_files["b1"])  # same coverage: the graphs stay
    second = gen.generate(GPU_PROMPTS, adapters, 6).tokens
    assert gen.captures == n  # replayed, not recaptured
    assert second == Generator(model).generate(GPU_PROMPTS, adapters, 6).tokens
    assert second[0] != first[0] or second[3] != first[3]  # slot 0's new adapter is what ran
    load_peft_adapter(model, 1, gpu_files["b0"])  # other coverage in slot 1: recaptured
    third = gen.generate(GPU_PROMPTS, adapters, 6).tokens
    assert gen.captures > n
    assert third == Generator(model).generate(GPU_PROMPTS, adapters, 6).tokens
    model.unload_adapter(1)
    with pytest.raises(ValueError, match=r"adapters\[1\] = 1: slot 1 holds no adapter"):
        gen.generate(GPU_PROMPTS, adapters, 6)
    fourth = gen.generate(GPU_PROMPTS, [0, None, None, 0], 6).tokens
    assert fourth == Generator(model).generate(GPU_PROMPTS, [0, None, None, 0], 6).tokens


@pytest.mark.gpu
def test_gpu_warmup_covers_max_batch_prefill(gpu_files):
    """max_seq 32, max_tokens 96: 5-token prompts pad to 32, 3 per call, so 4 prompts run calls of 3 and
    1 rows; warmup captures both, in two LoRA variants (slot 0's and none), and the call, whose prefill
    groups and decode steps have one or the other, captures nothing."""
    model = _gpu_model(gpu_files)
    load_peft_adapter(model, 0, gpu_files["b0"])
    gen = Generator(model)
    plan = gen.warmup(prefill_lengths=[5])
    assert plan["prefill"] == {32: [1, 2, 3]} and plan["eager"] == [] and plan["decode"] == [4, 2, 1]
    assert plan["variants"] == [(), (0,)]
    assert plan["captured"] == gen.captures == 12
    n = gen.captures
    res = gen.generate(GPU_PROMPTS, [0, None, 0, None], 4)
    assert gen.captures == n
    assert res.tokens == Generator(model).generate(GPU_PROMPTS, [0, None, 0, None], 4).tokens


@pytest.mark.gpu
def test_gpu_reserved_memory_flat_over_load_generate_unload_cycles(gpu_files):
    """30 cycles of load (alternating slots: the loaded-slots state changes every cycle, so the graphs
    are dropped and captured again each time), generate, unload: the reserved memory stays at the level
    of the first cycle of each slot."""
    model = _gpu_model(gpu_files)
    gen = Generator(model)
    reserved = []
    for i in range(30):
        slot = i % 2
        load_peft_adapter(model, slot, gpu_files["b0" if slot == 0 else "b1"])
        gen.generate(GPU_PROMPTS[:2], [slot, None], 4)
        model.unload_adapter(slot)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert gen.captures >= 30  # recaptured every cycle
    assert max(reserved[2:]) <= max(reserved[:2]) + 2 * 2**20, [r / 2**20 for r in reserved]
