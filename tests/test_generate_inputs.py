"""Inputs and outputs around ``Generator.generate`` and ``sample_tokens`` that a new user gets wrong or
cannot see, and two related library messages.

* Non-finite logits: a request whose logits hold NaN/inf (an fp16 adapter whose update overflows) is
  flagged in ``GenerationResult.non_finite`` (computed on the device, decode graphs included) with a
  RuntimeWarning naming it; the other requests' tokens are those of a clean run. ``sample_tokens`` gives
  such a row a deterministic token (its argmax), greedy or sampled.
* A model forward from the ``stream`` callback of a running call raises RuntimeError (it would overwrite
  the call's KV cache rows) and the call's tokens are unchanged.
* Flags that must be bools, a ``stream`` that cannot take (request_index, token), a flat list of ints as
  ``prompts``, and ``sample_tokens``' ``logits`` / ``position`` are refused up front, naming the argument.
* ``fused_moe_lora`` on meta tensors says meta tensors are not supported; ``load_hf_checkpoint`` warns
  when ``max_seq`` exceeds the checkpoint's ``max_position_embeddings``.

CPU: the float64 stub of test_model_generate (with ``last_index``, so the padded prefill runs), the CPU
emulation of graph capture of test_generate_slots, and a one-layer Qwen3 written by transformers with an
adapter written by PEFT (fp32, Triton interpreter). GPU (marked ``gpu``): real CUDA graphs in bf16 with
one slot's LoRA B filled with NaN.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from test_generate_slots import _TINY, CountingGraphGenerator, _write
from test_model_generate import prompts_of
from test_prefill_graphs import PadStub

from moelora_lib import fused_moe_lora
from moelora_lib.model import Generator, load_hf_checkpoint, load_peft_adapter
from moelora_lib.model.generate import sample_tokens
from moelora_lib.shapes import get_shape
from moelora_lib.workloads import make_inputs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NAN = float("nan")


class NaNStub(PadStub):
    """The stub whose logits are NaN for the rows of adapter slot ``nan_slot`` at positions >=
    ``from_pos`` (the K/V stay finite, so only the logits go bad), or, with ``dummy_nan``, for decode
    rows at position 0 (only a padded bucket's dummy rows are there)."""

    def __init__(self, nan_slot=None, from_pos=0, dummy_nan=False, **kw):
        super().__init__(**kw)
        self.nan_slot, self.from_pos, self.dummy_nan = nan_slot, from_pos, dummy_nan

    def forward(self, input_ids, start_pos, lora_ids, *, cache_rows=None, last_only=False, kv_len=None,
                last_index=None):  # fmt: skip
        kw = dict(cache_rows=cache_rows, last_only=last_only, kv_len=kv_len, last_index=last_index)
        logits = super().forward(input_ids, start_pos, lora_ids, **kw).clone()
        if logits.dim() != 2:
            return logits
        bad = torch.zeros(len(lora_ids), dtype=torch.bool)
        if self.nan_slot is not None:
            last = input_ids.shape[1] - 1 if last_index is None else last_index  # the real last token
            bad |= (lora_ids == self.nan_slot) & (start_pos + last >= self.from_pos)
        if self.dummy_nan and input_ids.shape[1] == 1:
            bad |= start_pos == 0
        logits[bad] = NAN
        return logits


GENERATORS = {
    "eager": lambda m: Generator(m),
    "padded": lambda m: Generator(m, pad_to_buckets=True, pad_prefill=True, graph_batch_sizes=(1, 2)),
    "graphs (CPU emulation)": lambda m: CountingGraphGenerator(m, graph_batch_sizes=(1, 2)),
}
PROMPTS = prompts_of([5, 7, 5])
ADAPTERS = [0, 1, None]  # request 1 uses the slot that goes NaN
NEW = 6


def _quiet(gen, *args, **kw):
    """generate, checking that it warned nothing about non-finite logits."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        res = gen.generate(*args, **kw)
    assert not [w for w in rec if "NaN or inf" in str(w.message)]
    return res


# --- 1. non-finite logits are flagged ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(GENERATORS))
@pytest.mark.parametrize("from_pos", [0, 8], ids=["prefill", "decode"])
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_non_finite_request_flagged_others_untouched(kind, from_pos, temperature):
    """NaN logits for request 1 from its prefill (from_pos 0) or from its second decode step (its
    prompt has 7 tokens, so the steps read positions 7, 8, ...): only it is flagged and named in the
    warning; requests 0 and 2 get a clean run's tokens; request 1's tokens before the NaN too, and a NaN
    row's token is 0 (the argmax of an all-NaN row), greedy or sampled. The next clean call on the same
    generator flags nothing (the flags are reset per call)."""
    kw = dict(temperature=temperature, seed=3)
    clean = _quiet(GENERATORS[kind](NaNStub()), PROMPTS, ADAPTERS, NEW, **kw)
    assert clean.non_finite == [False] * 3
    stub = NaNStub(nan_slot=1, from_pos=from_pos)
    gen = GENERATORS[kind](stub)
    with pytest.warns(RuntimeWarning, match=r"request\(s\) \[1\] held NaN or inf") as rec:
        res = gen.generate(PROMPTS, ADAPTERS, NEW, **kw)
    assert len(rec) == 1 and rec[0].filename == __file__  # points at the caller's line
    assert res.non_finite == [False, True, False]
    assert res.tokens[0] == clean.tokens[0] and res.tokens[2] == clean.tokens[2]
    good = 0 if from_pos == 0 else from_pos - len(PROMPTS[1]) + 1  # tokens from finite logits
    assert res.tokens[1][:good] == clean.tokens[1][:good]
    assert res.tokens[1][good:] == [0] * (NEW - good)
    stub.nan_slot = None
    again = _quiet(gen, PROMPTS, ADAPTERS, NEW, **kw)
    assert again.non_finite == [False] * 3 and again.tokens == clean.tokens


def test_dummy_rows_flag_no_request():
    """A padded bucket's dummy rows sit on spare cache rows, here the row of a request that finished at
    eos; their logits (NaN in this stub) flag nobody, and the others' tokens are a clean run's."""
    prompts, adapters = prompts_of([5, 6, 7, 4], seed=9), [0, 1, 2, None]
    clean = Generator(NaNStub()).generate(prompts, adapters, NEW)
    eos = clean.tokens[1][0]  # request 1 stops at its first token, so its cache row is spare
    gen = CountingGraphGenerator(NaNStub(dummy_nan=True), graph_batch_sizes=(1, 2))
    res = _quiet(gen, prompts, adapters, NEW, eos_token_id=eos)
    assert (3, 4) in res.decode_batch_sizes  # 3 requests padded to bucket 4: one dummy row
    assert res.non_finite == [False] * 4
    ref = Generator(NaNStub()).generate(prompts, adapters, NEW, eos_token_id=eos)
    assert res.tokens == ref.tokens


def test_sample_tokens_non_finite_rows_are_deterministic():
    """A row whose max is not finite (a NaN, a +inf, every logit -inf) gets its argmax — the first NaN,
    else the first +inf, else 0 — greedy or sampled, for any keys, position, temperature, top_k, top_p
    or generator; a -inf in a row with a finite max stays a masked token."""
    inf = math.inf
    logits = torch.tensor(
        [
            [0.5, 1.0, NAN, 2.0, NAN],
            [0.5, inf, 3.0, inf, 1.0],
            [-inf] * 5,
            [0.5, -inf, 3.0, 1.0, -inf],
        ]
    )
    want = [2, 1, 0, 2]
    assert sample_tokens(logits).tolist() == want
    g = torch.Generator().manual_seed(0)
    for t, k, p in ((1.0, None, None), (0.5, 2, 0.9), (1e-40, None, None), (1e30, 3, None)):
        for pos in range(5):
            keys = torch.arange(4, dtype=torch.int64) * 977 + pos
            tok = sample_tokens(logits, t, k, p, keys=keys, position=pos).tolist()
            assert tok[:3] == want[:3], (t, k, p, pos)
            assert tok[3] not in (1, 4)  # masked
        assert sample_tokens(logits, t, k, p, generator=g).tolist()[:3] == want[:3]


# --- 2. a forward from the stream callback of a running call --------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cfg = transformers.Qwen3Config(**_TINY)  # max_position_embeddings 64
    return _write(tmp_path_factory.mktemp("inputs"), cfg, {"a0": (2, ["q_proj", "v_proj", "down_proj"])})


def _model(files, max_seq=12):
    model = load_hf_checkpoint(
        files["base"], dtype=torch.float32, device="cpu", num_adapters=2, max_rank=2, max_batch=2,
        max_seq=max_seq, max_tokens=16,
    )  # fmt: skip
    load_peft_adapter(model, 0, files["a0"])
    return model


def test_forward_from_stream_callback_refused(files):
    """The trial's reproducer: a direct forward in the stream callback raises RuntimeError (it would
    overwrite the running request's cache row) and the call's tokens equal the reference; the model's
    own forward works again after the call, and the reservation is one at a time."""
    m = _model(files)
    gen = Generator(m)
    prompt = [3, 1, 4, 1, 5]
    ref = gen.generate([prompt], [0], 4).tokens[0]
    errors = []

    def stream(i, tok):
        with pytest.raises(RuntimeError) as e:
            m(torch.tensor([[5, 5, 5]]), torch.tensor([0]), torch.tensor([0], dtype=torch.int32),
              cache_rows=torch.tensor([0]), last_only=True)  # fmt: skip
        errors.append(str(e.value))

    assert gen.generate([prompt], [0], 4, stream=stream).tokens[0] == ref
    assert len(errors) == 4
    assert "a generate call is running on this model" in errors[0] and "after it returns" in errors[0]
    assert m(torch.tensor([[5, 5, 5]]), [0], [0], last_only=True).shape == (1, m.config.vocab_size)
    with m.exclusive_forwards() as run:
        with pytest.raises(RuntimeError, match="already reserved"):
            with m.exclusive_forwards():
                pass
        assert run(torch.tensor([[5]]), [0], [-1], last_only=True).shape == (1, m.config.vocab_size)
        with pytest.raises(RuntimeError, match="a generate call is running"):
            m(torch.tensor([[5]]), [0], [-1])
    m(torch.tensor([[5]]), [0], [-1])  # released


# --- 3.-6. arguments refused up front ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(pad_to_buckets="no"), "pad_to_buckets"),
        (dict(batch_prefill="no"), "batch_prefill"),
        (dict(batch_prefill=None), "batch_prefill"),
        (dict(use_cuda_graphs="no"), "use_cuda_graphs"),
        (dict(use_cuda_graphs=0), "use_cuda_graphs"),
        (dict(pad_prefill=1), "pad_prefill"),
    ],
)
def test_generator_flags_must_be_bools(kw, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected .*True or False, got {kw[name]!r}"):
        Generator(NaNStub(), **kw)


def test_generate_refuses_bad_progress_stream_and_flat_prompts():
    stub = NaNStub(max_batch=2)
    gen = Generator(stub)
    with pytest.raises(ValueError, match=r"^progress: expected True or False, got 'yes'"):
        gen.generate([[1, 2]], [None], 2, progress="yes")
    for bad in (lambda tok: None, lambda: None, lambda i, tok, extra: None, lambda i, tok, *, k: None):
        with pytest.raises(ValueError, match=r"^stream: expected a callable taking two positional"):
            gen.generate([[1, 2]], [None], 2, stream=bad)
    with pytest.raises(ValueError, match=r"^prompts: .* got a flat list of 5 ints; wrap it in a list"):
        gen.generate([3, 1, 4, 1, 5], [0] * 5, 2)
    with pytest.raises(ValueError, match=r"got Tensor \(one prompt as a 1-D tensor/array: wrap it"):
        gen.generate(torch.tensor([3, 1, 4]), [0], 2)
    assert stub.calls == []  # nothing ran

    class Sink:
        def __init__(self):
            self.got = []

        def __call__(self, i, tok):
            self.got.append((i, tok))

    seen, sink = [], Sink()
    fine = [
        lambda *a: seen.append(a),
        lambda i, tok, extra=None: None,
        functools.partial(lambda tag, i, tok: None, "tag"),
        sink,
        print,  # a builtin: accepted whether or not its signature is readable
    ]
    for stream in fine:
        assert len(gen.generate([[1, 2]], [None], 2, stream=stream).tokens[0]) == 2
    assert len(seen) == 2 and len(sink.got) == 2


@pytest.mark.parametrize(
    "logits, kw, match",
    [
        (torch.zeros(2, 5), dict(temperature=1.0, position=1.5), r"^position: expected an int .* got 1.5"),
        (torch.zeros(2, 5), dict(position=torch.tensor([0.0, 1.0])), r"^position: .* got torch.float32"),
        (torch.zeros(2, 5), dict(temperature=1.0, position=torch.arange(3)), r"^position: .* \(3,\)"),
        (torch.zeros(5), dict(), r"^logits: expected a floating-point tensor \[B, V\] .* \(5,\)"),
        (torch.zeros(2, 5, dtype=torch.int64), dict(temperature=1.0), r"^logits: .* torch.int64 \(2, 5\)"),
        (torch.zeros(2, 5, dtype=torch.int64), dict(), r"^logits: .* got torch.int64"),
        ([[0.0, 1.0]], dict(), r"^logits: .* got list"),
    ],
)  # fmt: skip
def test_sample_tokens_logits_and_position_errors(logits, kw, match):
    with pytest.raises(ValueError, match=match):
        sample_tokens(logits, **kw)


def test_sample_tokens_position_forms_agree():
    """An int, a 0-d tensor and an int32 [B] tensor of the same position draw the same tokens."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    keys = torch.tensor([1, 2, 3], dtype=torch.int64)
    a = sample_tokens(logits, 1.0, keys=keys, position=7)
    assert torch.equal(a, sample_tokens(logits, 1.0, keys=keys, position=torch.tensor(7)))
    pos32 = torch.full((3,), 7, dtype=torch.int32)
    assert torch.equal(a, sample_tokens(logits, 1.0, keys=keys, position=pos32))


# --- 7. library messages ------------------------------------------------------------------------------


def test_fused_moe_lora_meta_tensors_not_supported():
    inp = make_inputs(get_shape("tiny"), 4, rank=4, num_adapters=2, dtype=torch.float32, device="cpu")
    args = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in inp.args()]
    with pytest.raises(ValueError, match=r"^hidden_states is on meta: meta tensors hold no data and are not"):
        fused_moe_lora(*args, **inp.kwargs())


def test_load_hf_checkpoint_warns_past_max_position_embeddings(files):
    msg = r"max_seq = 100 exceeds the checkpoint's max_position_embeddings = 64"
    with pytest.warns(UserWarning, match=msg):
        m = _model(files, max_seq=100)
    assert m.max_seq == 100  # built: a warning, not an error
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _model(files, max_seq=64)
    assert not [w for w in rec if "max_position_embeddings" in str(w.message)]


# --- GPU: the flags inside real CUDA graphs ------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_non_finite_flags_under_cuda_graphs(tmp_path):
    """bf16 tiny Qwen3 with CUDA graphs (prefill and decode captured): slot 1's LoRA B filled with NaN
    makes request 1's logits NaN (the LoRA kernels keep a slot's NaN to its rows); the flags, set inside
    the captured steps, name it alone; the other requests' tokens equal the run with slot 1 clean (same
    slots, graphs and batch shape). A replay without capture flags it again, and a clean call after
    flags nothing."""
    from moelora_lib.studies import e2e

    cfg = e2e.hf_model("tiny-qwen3", dtype=torch.float32, device="cpu").config
    all_proj = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    f = _write(tmp_path, cfg, {"b0": (4, all_proj), "b1": (4, all_proj)})
    model = load_hf_checkpoint(
        f["base"], dtype=torch.bfloat16, device="cuda", deterministic=True, num_adapters=2, max_rank=4,
        max_batch=4, max_seq=32, max_tokens=96,
    )  # fmt: skip
    load_peft_adapter(model, 0, f["b0"])
    load_peft_adapter(model, 1, f["b1"])
    gen = Generator(model)
    assert gen.use_cuda_graphs and gen.pad_prefill
    prompts = [[5, 9, 2, 7, 1], [4, 4, 8, 1, 3], [6, 2, 2, 9, 5]]  # 3 requests: bucket 4, one dummy row
    adapters = [0, 1, None]
    clean = _quiet(gen, prompts, adapters, 6)
    clean_sampled = _quiet(gen, prompts, adapters, 6, temperature=0.8, seed=1)
    assert clean.non_finite == clean_sampled.non_finite == [False] * 3
    saved = [t.clone() for t in _slot_b(model, 1)]
    for t in _slot_b(model, 1):
        t.fill_(NAN)
    n, nan_tokens = gen.captures, []
    for kw in (dict(), dict(), dict(temperature=0.8, seed=1)):
        with pytest.warns(RuntimeWarning, match=r"request\(s\) \[1\]"):
            res = gen.generate(prompts, adapters, 6, **kw)
        assert gen.captures == n  # replays: the flags come from inside the graphs
        assert res.non_finite == [False, True, False]
        ref = clean_sampled if kw else clean
        assert res.tokens[0] == ref.tokens[0] and res.tokens[2] == ref.tokens[2]
        nan_tokens.append(res.tokens[1])
    assert nan_tokens[0] == nan_tokens[1] == nan_tokens[2]  # a NaN row's token: its argmax, sampled too
    for t, b in zip(_slot_b(model, 1), saved):
        t.copy_(b)
    again = _quiet(gen, prompts, adapters, 6)
    assert again.non_finite == [False] * 3 and again.tokens == clean.tokens


def _slot_b(model, slot):
    """The LoRA B factors of ``slot`` in every LoRA module (views: writing them changes the slot)."""
    names = ("lora_b", "lora_b13", "lora_b2")
    return [getattr(m, n)[slot] for m in model.lora_modules().values() for n in names if hasattr(m, n)]
