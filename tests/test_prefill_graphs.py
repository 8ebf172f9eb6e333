"""Padded (graph-capturable) prefill of moelora_lib.model.generate (``pad_prefill``) on the CPU.

With CUDA graphs the generator pads each prefill group to :func:`prefill_length` and replays a graph per
(rows, padded length). Capture itself needs a GPU (tests/test_layer_gpu.py style, marked ``gpu``); here the
same padded forward runs eagerly (``pad_prefill=True`` on the CPU) and must give the tokens of the unpadded
prefill, on a stub with the model contract here; on the tiny real models with mixed adapters (and that the
padded forward makes no host sync) in tests/test_gpu_readiness.py's
``test_padded_prefill_and_decode_step_make_no_host_sync``, which shares each model with the decode step's
check.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_readiness import _model
from test_model_generate import ADAPTERS, StubLM, naive_greedy, prompts_of

from moelora_lib.model.generate import Generator, prefill_length
from moelora_lib.studies import e2e


class PadStub(StubLM):
    """StubLM with the ``last_index`` argument of MultiLoRAModel.forward."""

    def forward(self, input_ids, start_pos, lora_ids, *, cache_rows=None, last_only=False, kv_len=None,
                last_index=None):  # fmt: skip
        logits = super().forward(input_ids, start_pos, lora_ids, cache_rows=cache_rows, kv_len=kv_len)
        if not last_only:
            return logits
        if last_index is None:
            return logits[:, -1]
        return logits[torch.arange(logits.shape[0]), last_index]


def test_prefill_length_buckets():
    assert [prefill_length(n, 10_000) for n in (1, 64, 65, 512, 513, 1600, 2048, 2049)] == [
        64, 64, 128, 512, 576, 1664, 2048, 2304,
    ]  # fmt: skip
    assert prefill_length(1600, 1620) == 1620  # capped at max_seq
    assert len({prefill_length(n, 4096) for n in range(1, 4097)}) == 32  # 8 per octave above 64
    for n in range(1, 5000, 7):  # at most 63 padded tokens, and 12.5 % above 512
        p = prefill_length(n, 10**6)
        assert n <= p < n + 64 if n <= 512 else n <= p <= 1.125 * n


@pytest.mark.parametrize("batch_prefill", [True, False])
def test_padded_prefill_matches_naive_loop(batch_prefill):
    stub = PadStub(max_seq=40, max_tokens=80)
    prompts = prompts_of([5, 9, 5, 3])
    gen = Generator(stub, pad_prefill=True, batch_prefill=batch_prefill)
    assert gen.pad_prefill and not gen.use_cuda_graphs
    res = gen.generate(prompts, ADAPTERS, 8)
    calls, kv_lens = list(stub.calls), list(stub.kv_lens)
    for i, (p, a) in enumerate(zip(prompts, ADAPTERS)):
        assert res.tokens[i] == naive_greedy(stub, p, a, 8), f"request {i}"
    # every prompt padded to 40 (64 capped at max_seq); max_tokens 80 -> two rows per call at most
    prefill_calls = [c for c in calls if c[1] > 1]
    assert prefill_calls and all(s == 40 and b <= 2 for b, s in prefill_calls)
    assert set(kv_lens[: len(prefill_calls)]) == {40}


def test_padded_prefill_falls_back_for_long_prompts():
    """A padded length above max_tokens is prefilled eagerly in chunks, as without padding."""
    stub, big = PadStub(max_seq=40, max_tokens=8), PadStub(max_seq=40, max_tokens=64)
    prompts = prompts_of([20], seed=7)
    res = Generator(stub, pad_prefill=True).generate(prompts, [1], 5)
    assert stub.calls[:3] == [(1, 8), (1, 8), (1, 4)]
    assert res.tokens[0] == naive_greedy(big, prompts[0], 1, 5)


def test_pad_prefill_needs_last_index():
    with pytest.raises(ValueError, match="pad_prefill"):
        Generator(StubLM(), pad_prefill=True)
    assert not Generator(StubLM()).pad_prefill  # off by default on the CPU


def test_last_index_argument():
    model = _model("tiny-qwen3")
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    start, lora = torch.zeros(2, dtype=torch.int64), torch.full((2,), -1, dtype=torch.int32)
    full = model(ids, start, lora)
    idx = torch.tensor([2, 5])
    got = model(ids, start, lora, last_only=True, last_index=idx)
    torch.testing.assert_close(got, full[torch.arange(2), idx], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="last_index"):
        model(ids, start, lora, last_index=idx)  # needs last_only
    with pytest.raises(ValueError, match="last_index"):
        model(ids, start, lora, last_only=True, last_index=torch.tensor([1]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_prefill_graph_replay_on_gpu(name):
    """A captured padded prefill (CUDA graph) gives the eager unpadded prefill's last logits, and a second
    group at another length in the same bucket replays the same graph."""
    model = e2e.build_model(
        name, dtype=torch.float32, device="cuda", max_batch=4, max_seq=80, max_tokens=200, num_adapters=4,
        max_rank=8,
    )  # fmt: skip
    e2e.load_random_adapter(model, 0, rank=8, alpha=16, seed=0)
    gen = Generator(model)
    assert gen.use_cuda_graphs and gen.pad_prefill
    V = model.config.vocab_size
    for length in (11, 13):  # both pad to 64: one graph
        prompts = e2e.make_prompts(2, length, V, length)
        ids = torch.tensor(prompts, device="cuda")
        lora = torch.tensor([0, -1], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            ref = model(ids, torch.zeros(2, dtype=torch.int64, device="cuda"), lora, last_only=True)
            got = gen._prefill([0, 1], prompts, [0, -1]).clone()
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    # one LoRA variant: each group has rows of slot 0 (the variant of every loaded slot)
    assert list(gen._prefill_buckets) == [(2, 64)] and len(gen._prefill_buckets[2, 64].graphs) == 1


def test_bad_arguments_found_by_a_new_user_trial():
    """Each was a TypeError, a silent result or an error after the forward ran."""
    for n, ms in [(0, 10), (-100, 10), (3.5, 10), (True, 10), ("10", 10), (None, 10), (5, 0), (5, -5)]:
        with pytest.raises(ValueError, match="n:|max_seq:"):
            prefill_length(n, ms)
    stub = PadStub(max_seq=40, max_tokens=80)
    for bad in ("no", 2):
        with pytest.raises(ValueError, match="pad_prefill"):
            Generator(stub, pad_prefill=bad)
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        Generator(stub, graph_batch_sizes=3)
    gen = Generator(stub, pad_prefill=True)
    for bad in (3.5, 5, None, (n for n in (8,))):
        with pytest.raises(ValueError, match="prefill_lengths"):
            gen.warmup(prefill_lengths=bad)
    with pytest.raises(ValueError, match="batch_sizes"):
        gen.warmup(batch_sizes=4)
    model = _model("tiny-qwen3")
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    start, lora = torch.zeros(2, dtype=torch.int64), torch.full((2,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs last_only=True"):
        model(ids, start, lora, last_index=torch.tensor([1, 2]))
    for bad in (torch.tensor([1, 4]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError, match=r"last_index values must be in \[0, S = 4\)"):
            model(ids, start, lora, last_only=True, last_index=bad)
