"""moelora_lib.model.generate on the CPU: greedy and sampled generation against a naive full-recompute
loop, on a stub model with the MultiLoRAModel forward contract and a real KV cache.

The stub (:class:`StubLM`) is one attention layer with a per-adapter LoRA-like delta on q/k/v/o and
learned position embeddings, computed in float64 (so batching changes no argmax) and returned as
float32 logits. It also checks the contract a caller must keep (dtypes, B <= max_batch, B*S <=
max_tokens, positions < kv_len <= max_seq, distinct cache rows, slots in [-1, L)) and logs each call's shape,
which is how the tests see prefill batching, chunking and decode-bucket padding.

The CUDA-graph capture/replay is not testable here; the padding to buckets with dummy rows on spare
cache rows runs here eagerly (``pad_to_buckets=True``), which is the same code minus capture.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moelora_lib.model.generate import GenerationResult, Generator, sample_tokens


class StubLM(nn.Module):
    def __init__(self, *, V=37, H=16, L=3, max_batch=4, max_seq=40, max_tokens=64, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=1.0):
            return nn.Parameter(
                torch.randn(*shape, generator=g, dtype=torch.float64) * scale, requires_grad=False
            )

        self.config = SimpleNamespace(vocab_size=V)
        self.max_batch, self.max_seq, self.max_tokens, self.num_adapters = max_batch, max_seq, max_tokens, L
        self.embed, self.pos = rnd(V, H), rnd(max_seq, H, scale=0.5)
        self.w = rnd(4, H, H, scale=H**-0.5)  # q, k, v, o
        self.lora_a, self.lora_b = rnd(L, 4, 2, H, scale=0.5), rnd(L, 4, H, 2, scale=0.5)
        self.lm_head = rnd(V, H)
        self.register_buffer("k_cache", torch.zeros(max_batch, max_seq, H, dtype=torch.float64))
        self.register_buffer("v_cache", torch.zeros(max_batch, max_seq, H, dtype=torch.float64))
        self.calls: list[tuple[int, int]] = []  # (B, S) per forward
        self.kv_lens: list[int | None] = []  # kv_len per forward

    def _proj(self, x, j, a):
        """x [B, S, H] through projection j plus adapter a[b]'s delta (none for a = -1)."""
        y = x @ self.w[j].T
        ac = a.clamp(min=0).long()
        delta = torch.einsum("bsh,brh,bor->bso", x, self.lora_a[ac, j], self.lora_b[ac, j])
        return y + delta * (a >= 0).to(x.dtype)[:, None, None]

    def forward(self, input_ids, start_pos, lora_ids, *, cache_rows=None, last_only=False, kv_len=None):
        B, S = input_ids.shape
        if cache_rows is None:
            cache_rows = torch.arange(B)
        assert input_ids.dtype == torch.int64 and cache_rows.dtype == torch.int64
        assert lora_ids.dtype == torch.int32 and start_pos.shape == (B,) == lora_ids.shape == cache_rows.shape
        assert B <= self.max_batch and B * S <= self.max_tokens, (B, S)
        assert (
            len(set(cache_rows.tolist())) == B and 0 <= cache_rows.min() and cache_rows.max() < self.max_batch
        )
        assert lora_ids.min() >= -1 and lora_ids.max() < self.num_adapters
        self.kv_lens.append(kv_len)
        kv_len = self.max_seq if kv_len is None else kv_len
        assert start_pos.min() >= 0 and start_pos.max() + S <= kv_len <= self.max_seq
        self.calls.append((B, S))
        pos = start_pos[:, None] + torch.arange(S)  # [B, S]
        x = self.embed[input_ids] + self.pos[pos]
        q, k, v = (self._proj(x, j, lora_ids) for j in range(3))
        self.k_cache[cache_rows[:, None], pos] = k
        self.v_cache[cache_rows[:, None], pos] = v
        keys, vals = self.k_cache[cache_rows, :kv_len], self.v_cache[cache_rows, :kv_len]  # [B, kv_len, H]
        scores = q @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])
        visible = torch.arange(kv_len)[None, None, :] <= pos[:, :, None]
        att = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1) @ vals
        h = torch.tanh(x + self._proj(att, 3, lora_ids))
        logits = (h @ self.lm_head.T).float()
        return logits[:, -1] if last_only else logits


def naive_greedy(model, prompt, adapter, n, eos=None):
    """Re-run the whole sequence from position 0 every step (cache row 0); argmax of the last logits."""
    seq, out = list(prompt), []
    a = -1 if adapter is None else adapter
    for _ in range(n):
        logits = model(torch.tensor([seq]), torch.tensor([0]), torch.tensor([a], dtype=torch.int32))
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def prompts_of(lengths, seed=1, V=37):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def stub():
    return StubLM()


# Mixed lengths (two equal, so one batched prefill group) and mixed adapters including the base.
LENGTHS = [5, 9, 5, 3]
ADAPTERS = [0, None, 2, 1]
NEW = 12


@pytest.mark.parametrize("n_req", [4, 3])
@pytest.mark.parametrize("pad", [False, True], ids=["exact_batch", "padded_buckets"])
def test_greedy_matches_naive_loop(stub, pad, n_req):
    prompts, adapters = prompts_of(LENGTHS)[:n_req], ADAPTERS[:n_req]
    gen = Generator(stub, pad_to_buckets=pad, graph_batch_sizes=(1, 2))
    res = gen.generate(prompts, adapters, NEW)
    assert isinstance(res, GenerationResult)
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        assert res.tokens[i] == naive_greedy(stub, p, a, NEW), f"request {i}"
    # decode ran every request at once; padded to bucket 4 (max_batch, always a bucket): with 3
    # requests one dummy row on the spare cache row 3
    assert set(res.decode_batch_sizes) == {(n_req, 4 if pad else n_req)}
    assert len(res.step_s) == NEW - 1


def test_mixed_adapters_equal_each_request_alone(stub):
    prompts = prompts_of([6] * 4, seed=3)
    res = Generator(stub).generate(prompts, ADAPTERS, NEW)
    for i, (p, a) in enumerate(zip(prompts, ADAPTERS)):
        alone = Generator(stub).generate([p], [a], NEW)
        assert res.tokens[i] == alone.tokens[0], f"request {i}"
    # the adapters matter: the same prompt under different slots gives different outputs
    same = Generator(stub).generate([prompts[0]] * 4, [None, 0, 1, 2], NEW).tokens
    assert len({tuple(t) for t in same}) > 1


def test_batched_and_one_by_one_prefill_agree(stub):
    prompts = prompts_of([7, 7, 7, 4], seed=5)
    stub.calls.clear()
    batched = Generator(stub, batch_prefill=True).generate(prompts, ADAPTERS, NEW)
    assert stub.calls[:2] == [(3, 7), (1, 4)]  # the three 7-token prompts in one prefill call
    stub.calls.clear()
    single = Generator(stub, batch_prefill=False).generate(prompts, ADAPTERS, NEW)
    assert stub.calls[:4] == [(1, 7), (1, 7), (1, 7), (1, 4)]
    assert batched.tokens == single.tokens
    # one-by-one prefill: request i's first token comes after request i-1's
    assert single.ttft_s == sorted(single.ttft_s) and batched.ttft_s[0] == batched.ttft_s[1]


def test_prefill_respects_max_tokens_by_chunking():
    """max_tokens = 8: three equal 6-token prompts go one per call, a 20-token prompt in 8-column
    chunks (start_pos 0, 8, 16); the result equals the naive loop of a model without the limit."""
    small, big = StubLM(max_tokens=8), StubLM(max_tokens=64)
    prompts = prompts_of([6, 6, 6, 20], seed=7)
    res = Generator(small).generate(prompts, ADAPTERS, 8)
    assert small.calls[:6] == [(1, 6), (1, 6), (1, 6), (1, 8), (1, 8), (1, 4)]
    # prefill bounds attention by kv_len = chunk end; decode reads the whole cache (graph-static)
    assert small.kv_lens[:6] == [6, 6, 6, 8, 16, 20] and set(small.kv_lens[6:]) == {None}
    for i, (p, a) in enumerate(zip(prompts, ADAPTERS)):
        assert res.tokens[i] == naive_greedy(big, p, a, 8)


def test_sampling_seeded_reproducible(stub):
    prompts = prompts_of(LENGTHS, seed=11)
    gen = Generator(stub)
    kw = dict(temperature=1.3, seed=1234)
    a = gen.generate(prompts, ADAPTERS, NEW, **kw).tokens
    b = gen.generate(prompts, ADAPTERS, NEW, **kw).tokens
    c = gen.generate(prompts, ADAPTERS, NEW, temperature=1.3, seed=99).tokens
    assert a == b and a != c
    assert all(0 <= t < 37 for row in a for t in row)
    greedy = gen.generate(prompts, ADAPTERS, NEW).tokens
    # filters that leave only the top token reduce sampling to greedy
    assert gen.generate(prompts, ADAPTERS, NEW, temperature=2.0, top_k=1, seed=0).tokens == greedy
    assert gen.generate(prompts, ADAPTERS, NEW, temperature=2.0, top_p=1e-6, seed=0).tokens == greedy


def test_sample_tokens_filters():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]] * 2000)
    g = torch.Generator().manual_seed(0)
    top2 = sample_tokens(logits, 1.0, top_k=2, generator=g)
    assert set(top2.tolist()) == {2, 3}
    # top_p = 0.8: softmax = [.032, .087, .644, .237]; the smallest prefix reaching 0.8 is {2, 3}
    nucleus = sample_tokens(logits, 1.0, top_p=0.8, generator=g)
    assert set(nucleus.tolist()) == {2, 3}
    freq = torch.bincount(sample_tokens(logits, 1.0, generator=g), minlength=4) / 2000
    assert torch.allclose(freq, torch.softmax(logits[0], 0), atol=0.04)


@pytest.mark.parametrize("interval, pad", [(1, False), (3, True)])
def test_eos_stops_a_request(stub, interval, pad):
    prompts = prompts_of(LENGTHS, seed=13)
    gen = Generator(stub, pad_to_buckets=pad, graph_batch_sizes=(1, 2))
    ref = gen.generate(prompts, ADAPTERS, NEW).tokens
    # eos := a token request 0 produces for the first time at a step k >= 1
    k = next(k for k in range(1, NEW) if ref[0][k] not in ref[0][:k])
    eos = ref[0][k]
    res = gen.generate(prompts, ADAPTERS, NEW, eos_token_id=eos, eos_check_interval=interval)
    for i in range(len(prompts)):
        want = ref[i][: ref[i].index(eos) + 1] if eos in ref[i] else ref[i]
        assert res.tokens[i] == want, f"request {i}"
        assert res.finished_eos[i] == (eos in ref[i])
    assert res.tokens[0][-1] == eos and len(res.tokens[0]) == k + 1
    # the batch shrank after the eos was seen
    assert res.decode_batch_sizes[0][0] == 4 and res.decode_batch_sizes[-1][0] < 4
    if pad:
        assert all(b in (1, 2, 4) and b >= n for n, b in res.decode_batch_sizes)


def test_eos_as_first_token(stub):
    prompts = prompts_of([4, 6], seed=17)
    ref = Generator(stub).generate(prompts, [None, 1], 6).tokens
    res = Generator(stub).generate(prompts, [None, 1], 6, eos_token_id=ref[0][0])
    assert res.tokens[0] == [ref[0][0]] and res.finished_eos[0]
    assert math.isnan(res.request_otps[0])


def test_stream_timing_and_progress(stub, capsys):
    prompts = prompts_of(LENGTHS, seed=19)
    seen: dict[int, list[int]] = {}
    res = Generator(stub).generate(
        prompts, ADAPTERS, NEW, progress=True, stream=lambda i, t: seen.setdefault(i, []).append(t)
    )
    assert [seen[i] for i in range(len(prompts))] == res.tokens
    assert "decode" in capsys.readouterr().out
    assert all(0 < t <= res.prefill_s for t in res.ttft_s)
    assert all(d > 0 and o > 0 for d, o in zip(res.request_decode_s, res.request_otps))
    assert res.output_tokens == len(prompts) * NEW
    assert res.prefill_s + res.decode_s <= res.total_s
    assert math.isclose(res.aggregate_otps, res.output_tokens / res.total_s)
    assert math.isclose(sum(res.step_s), res.decode_s, rel_tol=1e-9)
    row = res.summary()
    assert row["requests"] == 4 and row["output_tokens"] == 4 * NEW
    one = Generator(stub).generate(prompts[:1], [None], 1)
    assert len(one.tokens[0]) == 1 and one.step_s == [] and math.isnan(one.decode_otps)


def test_constructor_errors(stub):
    with pytest.raises(ValueError, match="use_cuda_graphs"):
        Generator(stub, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        Generator(stub, graph_batch_sizes=(0, 2))
    with pytest.raises(ValueError, match="model: expected an attribute"):
        Generator(nn.Linear(2, 2))
    assert Generator(stub, graph_batch_sizes=(1, 2, 16)).graph_batch_sizes == (1, 2, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[1], []], adapters=[None, None]), r"prompts\[1\]: empty"),
        (dict(prompts=[[1, 37]], adapters=[None]), r"prompts\[0\]\[1\] = 37 is out of range"),
        (dict(prompts=[[1, -1]], adapters=[None]), r"prompts\[0\]\[1\] = -1"),
        (dict(prompts=[[1.5]], adapters=[None]), r"prompts\[0\]"),
        (dict(prompts=[[1]] * 5, adapters=[None] * 5), "max_batch=4"),
        (dict(adapters=[None]), "adapters: expected one slot"),
        (dict(adapters=[3, None]), r"adapters\[0\] = 3"),
        (dict(adapters=[-2, None]), r"adapters\[0\] = -2"),
        (dict(adapters=[True, None]), r"adapters\[0\]"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=36), r"prompts\[1\]: prompt length 5 \+ max_new_tokens 36 exceeds .*max_seq=40"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(eos_token_id=37), "eos_token_id"),
        (dict(eos_check_interval=0), "eos_check_interval"),
    ],
)
def test_validation_errors(stub, kwargs, match):
    args = dict(prompts=[[1, 2, 3], [4, 5, 6, 7, 8]], adapters=[0, -1], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        Generator(stub).generate(
            args.pop("prompts"), args.pop("adapters"), args.pop("max_new_tokens"), **args
        )
    assert stub.calls == []  # nothing ran


def test_tensor_prompts_and_minus_one_adapter(stub):
    prompts = prompts_of([5, 8], seed=23)
    a = Generator(stub).generate([torch.tensor(p) for p in prompts], [-1, 2], 5).tokens
    b = Generator(stub).generate(prompts, [None, 2], 5).tokens
    assert a == b


class FakeGraphGenerator(Generator):
    """CUDA-graph semantics emulated on the CPU: "capture" freezes the tensor objects the step reads
    and writes, and "replay" reruns the step on exactly those tensors. Code that rebinds a bucket's
    buffers instead of writing them in place, or reads stale graph outputs, fails here as it would on
    a GPU. (Real capture/replay, the side-stream warm-up and the memory pool are GPU-only.)"""

    def __init__(self, model, **kw):
        super().__init__(model, pad_to_buckets=True, **kw)
        self.use_cuda_graphs = True  # the constructor refuses it on the CPU
        self.captured: list[int] = []

    def _capture(self, bucket):
        ids, pos, lora, rows = bucket.input_ids, bucket.start_pos, bucket.lora_ids, bucket.cache_rows
        warm, _ = self._forward_decode(bucket)  # the warm-up step (rewrites this step's K/V identically)
        logits, greedy = torch.full_like(warm, math.nan), torch.full((bucket.size,), -1, dtype=torch.int64)

        def replay():
            out = self.model(ids, pos, lora, cache_rows=rows, last_only=True)
            logits.copy_(out)
            greedy.copy_(out.argmax(-1))

        bucket.graphs[bucket.variant] = (SimpleNamespace(replay=replay), logits, greedy)
        self.captured.append(bucket.size)


def test_graph_path_emulated(stub):
    prompts = prompts_of(LENGTHS[:3], seed=29)
    gen = FakeGraphGenerator(stub, graph_batch_sizes=(1, 2))
    ref = [naive_greedy(stub, p, a, NEW) for p, a in zip(prompts, ADAPTERS)]
    res = gen.generate(prompts, ADAPTERS[:3], NEW)
    assert res.tokens == ref and gen.captured == [4]  # 3 requests -> bucket 4 (one dummy row), lazily
    sampled = gen.generate(prompts, ADAPTERS[:3], NEW, temperature=0.7, seed=5).tokens
    assert sampled == Generator(stub).generate(prompts, ADAPTERS[:3], NEW, temperature=0.7, seed=5).tokens
    # eos shrinks the batch to smaller buckets, each captured once and then reused
    k = next(k for k in range(1, NEW) if ref[0][k] not in ref[0][:k])
    eos = ref[0][k]
    for _ in range(2):
        res = gen.generate(prompts, ADAPTERS[:3], NEW, eos_token_id=eos)
        assert res.tokens == [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert len(gen.captured) == len(set(gen.captured)) and gen.captured[0] == 4
    assert sorted(gen.captured) == sorted({b for _, b in res.decode_batch_sizes})


def test_warmup_captures_every_bucket_up_front(stub):
    gen = FakeGraphGenerator(stub, graph_batch_sizes=(1, 2))
    with pytest.raises(ValueError, match="batch_sizes"):
        gen.warmup([5])
    gen.warmup()
    assert gen.captured == [4, 2, 1]  # largest first; max_batch = 4 is always a bucket
    # warm-up wrote dummy K/V at position 0 of rows 0..3; prefill overwrites what decode reads
    prompts = prompts_of([4, 6], seed=41)
    res = gen.generate(prompts, [2, None], NEW)
    assert res.tokens == [naive_greedy(stub, p, a, NEW) for p, a in zip(prompts, [2, None])]
    assert gen.captured == [4, 2, 1]
    Generator(stub).warmup()  # no CUDA graphs: a no-op


class StubWithSlots(StubLM):
    """The stub plus MultiLoRAModel's ``lora_modules()``: modules whose host-side ``loaded_slots``
    (LoRALinear: a list; MoELoRALayer: {slot: (gate_up, down)}) the generator checks requests against
    and keys its graphs on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.modules_ = {
            "qkv": SimpleNamespace(loaded_slots=[0]),
            "experts": SimpleNamespace(loaded_slots={1: (True, False)}),
        }

    def lora_modules(self):
        return self.modules_


def test_unloaded_slot_refused_and_graphs_follow_loads():
    model = StubWithSlots()
    prompts = prompts_of([5, 5], seed=31)
    with pytest.raises(ValueError, match=r"adapters\[1\] = 2: slot 2 holds no adapter \(loaded: \[0, 1\]\)"):
        Generator(model).generate(prompts, [0, 2], 3)
    gen = FakeGraphGenerator(model, graph_batch_sizes=(2,))
    gen.generate(prompts, [0, 1], 3)
    gen.generate(prompts, [1, None], 3)
    assert gen.captured == [2]  # same loaded slots: the graph is reused
    model.modules_["qkv"].loaded_slots = [0, 2]  # "loading" slot 2 changes what a graph must launch
    res = gen.generate(prompts, [2, 0], 3)
    assert gen.captured == [2, 2] and res.tokens == Generator(model).generate(prompts, [2, 0], 3).tokens


# --- the real model: a tiny GPT-OSS MultiLoRAModel (MoE + LoRA, sinks, sliding window), fp32, Triton
# interpreter; ~1 s per forward on a 2-core CPU, so one layer and few tokens


def _tiny_gpt_oss(max_batch=2, max_seq=12, max_tokens=16):
    from moelora_lib.model.checkpoint import random_model
    from moelora_lib.model.config import REAL_CONFIGS

    cfg = dict(REAL_CONFIGS["gpt-oss-20b"])
    cfg.update(
        hidden_size=32,
        num_hidden_layers=1,  # one layer keeps the interpreter at a few seconds
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_per_token=2,
        vocab_size=64,
        sliding_window=4,  # shorter than the sequences, so the window's mask matters
        layer_types=["sliding_attention"],
        max_position_embeddings=64,
    )
    model = random_model(
        cfg,
        seed=0,
        dtype=torch.float32,
        device="cpu",
        num_adapters=2,
        max_rank=4,
        max_batch=max_batch,
        max_seq=max_seq,
        max_tokens=max_tokens,
        std=0.3,  # logit gaps well above fp32 noise, so argmax is stable
    )
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    for m in model.lora_modules().values():  # slot 1 only: attention + experts, rank 3
        if hasattr(m, "slices"):  # LoRALinear
            m.load_adapter(1, [rnd(3, m.in_features) for _ in m.slices], [rnd(n, 3) for n in m.slices], 1.0)
        else:  # MoELoRALayer
            E, H, I, S = m.E, m.H, m.I, m.S
            m.load_adapter(
                1, gate_up=(rnd(E, S, 3, H), rnd(E, S, 2 * I // S, 3)), down=(rnd(E, 3, I), rnd(E, H, 3))
            )
    return model


def test_real_model_greedy_matches_naive_loop():
    """Mixed batch (slot 1 and the base) on a tiny random MultiLoRAModel: generation with the KV cache
    (batched prefill, one decode step for both rows) equals re-running each full sequence alone."""
    model = _tiny_gpt_oss()
    # three tokens: the prefill's and two decode steps (the second reads K/V a decode step wrote); the
    # sequences (up to 7 tokens) stay longer than the sliding window of 4
    prompts, adapters, new = prompts_of([5, 5], seed=37, V=64), [1, None], 3
    res = Generator(model).generate(prompts, adapters, new)
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        assert res.tokens[i] == naive_greedy(model, p, a, new), f"request {i}"
    with pytest.raises(ValueError, match="slot 0 holds no adapter"):
        Generator(model).generate(prompts, [0, None], new)
