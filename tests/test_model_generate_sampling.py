"""moelora_lib.model.generate sampling on the CPU: the temperature limit (tiny and huge temperatures),
the counter-based per-request noise (a request's samples depend only on its seed, its output position
and its own logits, not on batch re-packing, eos checks or prefill grouping), its statistics, and
several eos ids. The model is the float64 stub of test_model_generate (one attention layer with
per-adapter deltas and a real KV cache)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_model_generate import ADAPTERS, LENGTHS, NEW, FakeGraphGenerator, StubLM, naive_greedy, prompts_of

from moelora_lib.model.generate import Generator, _counter_gumbel, _mix32, request_keys, sample_tokens


@pytest.fixture
def stub():
    return StubLM()


def _trim(row, eos):
    """``row`` up to and including its first token in ``eos`` (all of it without one)."""
    return next((row[: j + 1] for j, t in enumerate(row) if t in eos), row)


# --- temperature: finite positive temperatures never overflow; a tiny one is greedy -----------------


@pytest.mark.parametrize("temperature", [1e-30, 1e-37, 1e-44, 1e-300, 5e-324])
def test_tiny_temperature_generates_the_greedy_tokens(stub, temperature):
    """T below max|logit| / 3.4e38 overflowed logits / T to inf (softmax NaN, token 0 for every row);
    the limit of a tiny temperature is the greedy token, also where T rounds to 0 in float32."""
    prompts = prompts_of(LENGTHS, seed=43)
    greedy = Generator(stub).generate(prompts, ADAPTERS, NEW).tokens
    assert greedy == [naive_greedy(stub, p, a, NEW) for p, a in zip(prompts, ADAPTERS)]
    assert any(t != 0 for row in greedy for t in row)
    res = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=temperature, seed=0)
    assert res.tokens == greedy


def test_sample_tokens_extreme_logits_and_temperatures():
    keys = torch.arange(4000, dtype=torch.int64)
    # logits near float32's limits: l - max overflows to -inf (never drawn), never NaN
    big = torch.tensor([[3e38, -3e38, 1.0, 2e38]] * 4000)
    for t in (1e-44, 1e-38, 1e-3, 1.0, 1e6, 1e30, 1e300):
        tok = sample_tokens(big, t, keys=keys)
        assert 1 not in tok.tolist(), t  # 3e38 - (-3e38) overflows: -inf, never drawn
        assert (tok == 0).all() if t < 1e38 else set(tok.tolist()) == {0, 2, 3}, t
    # tiny temperature: the max (ties at the max drawn uniformly, the limit of softmax(l / T))
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 4000)
    for t in (1e-44, 1e-300):
        tok = sample_tokens(ties, t, keys=keys)
        assert set(tok.tolist()) == {1, 2}
        assert abs((tok == 1).float().mean().item() - 0.5) < 0.03
        assert set(sample_tokens(ties, t, top_k=1, keys=keys).tolist()) == {1, 2}  # ties at the k-th kept
        assert set(sample_tokens(ties, t, top_p=0.4, keys=keys).tolist()) == {1}  # first of the tie
        assert set(sample_tokens(ties, t, top_p=0.9, keys=keys).tolist()) == {1, 2}
    # huge temperature: uniform over the finite logits, -inf stays excluded
    masked = torch.tensor([[0.0, 1.0, -math.inf, 2.0]] * 4000)
    for t in (1e30, 1e300):
        freq = torch.bincount(sample_tokens(masked, t, keys=keys), minlength=4).double() / 4000
        assert freq[2] == 0 and torch.allclose(freq[[0, 1, 3]], torch.full((3,), 1 / 3).double(), atol=0.03)
    # the global-RNG path (no keys) is finite too
    g = torch.Generator().manual_seed(0)
    assert (sample_tokens(big, 1e-44, generator=g) == 0).all()
    assert set(sample_tokens(masked, 1e300, generator=g).tolist()) == {0, 1, 3}


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=float("nan")), "temperature: expected a finite real number >= 0, got nan"),
        (dict(temperature=float("inf")), "temperature: expected a finite real number >= 0, got inf"),
        (dict(temperature=-1e-3), "temperature: .* got -0.001"),
        (dict(temperature=True), "temperature: .* got True"),
        (dict(temperature="1.0"), "temperature: .* got '1.0'"),
        (dict(temperature=torch.tensor(1.0)), "temperature: .* got tensor"),
        (dict(temperature=1.0, top_k=0), "top_k: expected None or an int >= 1, got 0"),
        (dict(temperature=1.0, top_p=1.5), r"top_p: expected None or a number in \(0, 1\], got 1.5"),
        (dict(temperature=1.0, keys=torch.arange(3)), r"keys: expected None or int64 \[2\] on cpu, got"),
        (dict(temperature=1.0, keys=torch.arange(2.0)), r"keys: .*got 'torch.float32 \(2,\) on cpu'"),
        (dict(temperature=1.0, keys=[1, 2]), r"keys: .*got \[1, 2\]"),
    ],
)
def test_sample_tokens_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        sample_tokens(torch.zeros(2, 5), **kw)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-300, "0.5", None])
def test_generate_refuses_bad_temperature(stub, temperature):
    with pytest.raises(ValueError, match="temperature: expected a finite number >= 0"):
        Generator(stub).generate([[1, 2]], [None], 3, temperature=temperature)
    assert stub.calls == []


# --- the counter-based noise ------------------------------------------------------------------------


def test_counter_noise_is_a_pinned_pure_function():
    """The hash is integer arithmetic in int64 (bit-identical on every device); these values pin it, so a
    seed keeps giving the same tokens across versions and devices."""
    assert _mix32(torch.tensor([0, 1, 2**32 - 1])).tolist() == [0, 152788568, 3413970443]
    assert request_keys(0, 3).tolist() == [981959466, 1347895782, 189323250]
    # a list seeds each request alone; negative seeds are two's complement 64-bit
    assert request_keys([0, 2**64 - 1, -1], 3).tolist() == [981959466, 634547882, 634547882]
    assert request_keys(7, 1).tolist() == request_keys([7], 1).tolist()
    g = _counter_gumbel(request_keys(0, 2), 5, 4)
    want = torch.tensor([[-0.6654, -0.2629, -1.3209, 1.9682], [2.4266, -1.2444, 1.1701, 0.5403]])
    assert torch.allclose(g, want, atol=1e-4)
    assert torch.equal(g, _counter_gumbel(request_keys(0, 2), 5, 4))
    # a row's noise depends only on its own key and position
    keys = request_keys(11, 6)
    full = _counter_gumbel(keys, torch.arange(6) * 3, 50)
    for b in range(6):
        assert torch.equal(full[b], _counter_gumbel(keys[b : b + 1], 3 * b, 50)[0])
    assert torch.isfinite(full).all() and full.min() > -2.9 and full.max() < 16.7


def test_counter_sampler_statistics():
    """Frequencies of a known distribution over many keys at one position, over many positions of
    one key, and pairs of consecutive positions (independence), within ~4 standard deviations."""
    n = 6000
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    for t in (1.0, 0.5, 2.0):
        want = torch.softmax(logits[0] / t, 0).double()
        by_key = sample_tokens(logits.expand(n, 4), t, keys=torch.arange(n, dtype=torch.int64), position=9)
        pos = torch.arange(n, dtype=torch.int64)
        by_pos = sample_tokens(logits.expand(n, 4), t, keys=torch.full((n,), 12345), position=pos)
        for tok in (by_key, by_pos):
            freq = torch.bincount(tok, minlength=4).double() / n
            assert torch.allclose(freq, want, atol=0.025), (t, freq, want)
    # uniform over 64 tokens: chi-square with 63 degrees of freedom (mean 63, sd 11)
    tok = sample_tokens(torch.zeros(64 * 200, 64), 1.0, keys=torch.arange(64 * 200, dtype=torch.int64))
    counts = torch.bincount(tok, minlength=64).double()
    assert ((counts - 200) ** 2 / 200).sum() < 130
    # consecutive positions of one key are independent: the four pairs of a fair coin ~ 1/4 each
    keys = torch.arange(n, dtype=torch.int64)
    a = sample_tokens(torch.zeros(n, 2), 1.0, keys=keys, position=4)
    b = sample_tokens(torch.zeros(n, 2), 1.0, keys=keys, position=5)
    pairs = torch.bincount(2 * a + b, minlength=4).double() / n
    assert torch.allclose(pairs, torch.full((4,), 0.25).double(), atol=0.025)
    # top-k / top-p with keys: only the kept tokens, in the renormalised proportions
    k2 = sample_tokens(logits.expand(n, 4), 1.0, top_k=2, keys=keys)
    assert set(k2.tolist()) == {2, 3}
    assert abs((k2 == 2).double().mean().item() - 1 / (1 + math.exp(-1))) < 0.025
    assert set(sample_tokens(logits.expand(n, 4), 1.0, top_p=0.8, keys=keys).tolist()) == {2, 3}


def _eos_case(stub, **kw):
    """The issue's case: seed 0, temperature 1.0, an eos that one request samples early (at output
    position k >= 1, first occurrence) and that at least one other request never samples."""
    prompts = prompts_of(LENGTHS, seed=47)
    ref = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=1.0, seed=0, **kw).tokens
    for r in range(len(prompts)):
        for k in range(1, NEW // 2):
            eos = ref[r][k]
            never = [i for i in range(len(prompts)) if eos not in ref[i]]
            if eos not in ref[r][:k] and never:
                return prompts, ref, eos, r, k, never
    raise AssertionError("no eos candidate in the reference run")


def test_seeded_sampling_does_not_depend_on_repacking(stub):
    prompts, ref, eos, r, k, never = _eos_case(stub)
    want = [_trim(row, {eos}) for row in ref]
    assert len(want[r]) == k + 1 and never
    for interval in (1, 2, 4):
        for batch_prefill in (True, False):
            for pad in (False, True):
                gen = Generator(
                    stub, batch_prefill=batch_prefill, pad_to_buckets=pad, graph_batch_sizes=(1, 2)
                )
                res = gen.generate(
                    prompts,
                    ADAPTERS,
                    NEW,
                    temperature=1.0,
                    seed=0,
                    eos_token_id=eos,
                    eos_check_interval=interval,
                )
                assert res.tokens == want, (interval, batch_prefill, pad)
                assert res.finished_eos == [eos in row for row in ref]
                assert res.decode_batch_sizes[-1][0] < len(prompts)  # the batch was re-packed
    # the emulated CUDA-graph path (captured step, sampling after the replay) gives the same tokens
    res = FakeGraphGenerator(stub, graph_batch_sizes=(1, 2)).generate(
        prompts, ADAPTERS, NEW, temperature=1.0, seed=0, eos_token_id=eos, eos_check_interval=3
    )
    assert res.tokens == want


def test_request_samples_the_same_alone_or_batched(stub):
    prompts = prompts_of(LENGTHS, seed=53)
    seeds = [5, 2**63 + 9, -4, 5]
    kw = dict(temperature=0.8, top_k=20, top_p=0.95)
    batch = Generator(stub).generate(prompts, ADAPTERS, NEW, seed=seeds, **kw).tokens
    for i, (p, a, s) in enumerate(zip(prompts, ADAPTERS, seeds)):
        assert Generator(stub).generate([p], [a], NEW, seed=[s], **kw).tokens[0] == batch[i], i
    # another order of the same requests: each keeps its tokens
    order = [2, 0, 3, 1]
    shuffled = (
        Generator(stub)
        .generate(
            [prompts[i] for i in order],
            [ADAPTERS[i] for i in order],
            NEW,
            seed=[seeds[i] for i in order],
            **kw,
        )
        .tokens
    )
    assert shuffled == [batch[i] for i in order]
    # an int seed s keys request i by (s, i): request 0 equals seed [s] alone, the others differ
    by_int = Generator(stub).generate(prompts, ADAPTERS, NEW, seed=5, **kw).tokens
    assert by_int[0] == batch[0] and by_int[3] != batch[3]
    # the same prompt, adapter and seed in two rows: the same tokens; another seed: others
    twin = Generator(stub).generate([prompts[0]] * 3, [ADAPTERS[0]] * 3, NEW, seed=[1, 1, 2], **kw).tokens
    assert twin[0] == twin[1] != twin[2]


def test_unseeded_sampling_follows_torch_manual_seed(stub):
    prompts = prompts_of(LENGTHS, seed=59)
    torch.manual_seed(123)
    a = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=1.0).tokens
    torch.manual_seed(123)
    b = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=1.0).tokens
    c = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=1.0).tokens
    assert a == b != c


@pytest.mark.parametrize(
    "seed, match",
    [
        (
            [1, 2, 3],
            r"seed: expected None or an int in \[-2\^63, 2\^64\) \(or a list of 2 such ints.*got \[1, 2, 3\]",
        ),
        ([1, True], r"seed: .*got \[1, True\]"),
        ([1, 2.0], r"seed: .*got \[1, 2.0\]"),
        (2**64, r"seed: .*got 18446744073709551616"),
        (-(2**63) - 1, "seed: "),
        ((), "seed: "),
        (np.float64(1), "seed: "),
    ],
)
def test_seed_errors(stub, seed, match):
    with pytest.raises(ValueError, match=match):
        Generator(stub).generate([[1, 2], [3]], [None, 0], 3, temperature=1.0, seed=seed)
    assert stub.calls == []


# --- several eos ids ---------------------------------------------------------------------------------


def test_two_eos_ids(stub):
    """A request stops at the first token that is any of the eos ids; finished_eos and the trimming
    follow; tokens match the run without eos, trimmed."""
    prompts = prompts_of(LENGTHS, seed=61)
    ref = Generator(stub).generate(prompts, ADAPTERS, NEW).tokens
    first_new = [next(k for k in range(1, NEW) if row[k] not in row[:k]) for row in ref[:2]]
    eos = (ref[0][first_new[0]], ref[1][first_new[1]])
    assert eos[0] != eos[1]
    for interval, pad in ((1, False), (3, True)):
        for ids in (list(eos), tuple(reversed(eos)), [np.int64(eos[0]), eos[1], eos[1]]):
            gen = Generator(stub, pad_to_buckets=pad, graph_batch_sizes=(1, 2))
            res = gen.generate(prompts, ADAPTERS, NEW, eos_token_id=ids, eos_check_interval=interval)
            want = [_trim(row, set(eos)) for row in ref]
            assert res.tokens == want
            assert res.finished_eos == [row[-1] in eos for row in want]
            assert len(res.tokens[0]) <= first_new[0] + 1 and len(res.tokens[1]) <= first_new[1] + 1
            assert res.output_tokens == sum(map(len, want))
    # one id in a list equals the int; an eos as the very first token stops at the prefill
    assert (
        Generator(stub).generate(prompts, ADAPTERS, NEW, eos_token_id=[eos[0]]).tokens
        == Generator(stub).generate(prompts, ADAPTERS, NEW, eos_token_id=eos[0]).tokens
    )
    res = Generator(stub).generate(prompts, ADAPTERS, NEW, eos_token_id=[36, ref[2][0]])
    assert res.tokens[2] == [ref[2][0]] and res.finished_eos[2]
    # sampled, with the request-keyed noise: the same trimming rule
    samp = Generator(stub).generate(prompts, ADAPTERS, NEW, temperature=1.0, seed=3).tokens
    res = Generator(stub).generate(
        prompts, ADAPTERS, NEW, temperature=1.0, seed=3, eos_token_id=[samp[0][2], samp[1][3]]
    )
    assert res.tokens == [_trim(row, {samp[0][2], samp[1][3]}) for row in samp]


@pytest.mark.parametrize(
    "eos, got",
    [([], r"\[\]"), ((), r"\(\)"), ([1, 37], r"\[1, 37\]"), ([1, -1], r"\[1, -1\]"), ([1.0], r"\[1.0\]"),
     ([True], r"\[True\]"), ("3", "'3'"), ({3}, r"\{3\}"), (37, "37")],
)  # fmt: skip
def test_eos_errors(stub, eos, got):
    match = (
        r"eos_token_id: expected None or a token id in \[0, 37\) \(an int or a non-empty list of them\), got "
    )
    with pytest.raises(ValueError, match=match + got):
        Generator(stub).generate([[1, 2]], [None], 3, eos_token_id=eos)
    assert stub.calls == []


# --- GPU: the same noise and tokens as the CPU ---------------------------------------------------------


@pytest.mark.gpu
def test_counter_noise_same_on_cuda():
    keys = request_keys([3, 4, 2**40], 3)
    x = torch.arange(1000, dtype=torch.int64) * 7919
    assert torch.equal(_mix32(x).cpu(), _mix32(x.cuda()).cpu())
    assert torch.equal(request_keys([3, 4, 2**40], 3, "cuda").cpu(), keys)
    pos = torch.tensor([0, 5, 77])
    cpu = _counter_gumbel(keys, pos, 201088)
    gpu = _counter_gumbel(keys.cuda(), pos.cuda(), 201088).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-5, atol=1e-6)
    logits = torch.randn(3, 201088, generator=torch.Generator().manual_seed(0)) * 4
    for t, k, p in ((1.0, None, None), (0.7, 50, 0.9), (1e-40, None, None)):
        a = sample_tokens(logits, t, k, p, keys=keys, position=pos)
        b = sample_tokens(logits.cuda(), t, k, p, keys=keys.cuda(), position=pos.cuda()).cpu()
        assert torch.equal(a, b), (t, k, p)
