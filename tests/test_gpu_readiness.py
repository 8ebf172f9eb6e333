"""What would break or mislead when notebooks 11 and 12 first run on the GPU, checked on the CPU.

* Capture safety: one padded prefill (``pad_prefill``, equal in tokens to the unpadded one) and one decode
  step of every tiny model (the forwards a CUDA graph captures in ``Generator._capture``; stages
  ``tuned``, ``naive`` and ``fused``), with adapters of mixed coverage loaded, make no host sync in their
  layers, final norm, lm_head and greedy argmax (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``,
  ``torch.nonzero``, ``torch.tensor(...)``, ``torch.cuda.synchronize``, printing a tensor, ...) and make
  no tensor without ``device=`` (a host tensor, which on the GPU means a host->device copy that a capture
  refuses): each raises while the forward runs, except inside Triton's interpreter, whose host work
  stands for device work. The model's own argument checks (which read CPU-resident index tensors only,
  never device ones) stay outside the trap.
* State a captured graph holds by address stays in place: the KV cache, weights, adapter slots, scratch
  buffers and alignment workspaces of every LoRA module and the generator's bucket buffers keep their
  data pointers across generate calls, adapter loads (direct and from a PEFT file) and unloads; the
  generator's record of the loaded slots (what drops its graphs) changes with every load and unload.
* GQA attention without ``enable_gqa``: SDPA sees NKV heads of K/V as the cache holds them (with a mask,
  ``enable_gqa`` leaves CUDA only its math backend, which repeats and upcasts K/V over every cached
  position per call), and a transposed output layout (what CUDA's fused SDPA kernels return) is handled.
* transformers + PEFT baseline built and run in bfloat16 (torch's default dtype set to bf16 while the model
  is built), as notebook 11 does on the GPU.
* Stage ``fused``'s kernels at notebook 12's largest tiles fit the H200's shared memory and do not spill
  (compile-only for sm_90, in a subprocess without the interpreter).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from sm90_helpers import run_sm90_script

from moelora_lib.model.generate import Generator, prefill_length
from moelora_lib.studies import e2e

TINY = ("tiny-gpt-oss", "tiny-qwen3-moe", "tiny-qwen3")
ROOT = Path(__file__).resolve().parents[1]


def _model(
    name, *, max_batch=4, max_seq=24, max_tokens=32, adapters=4, rank=8, stage="tuned", num_layers=None
):
    return e2e.build_model(
        name,
        stage=stage,
        num_layers=num_layers,
        dtype=torch.float32,
        device="cpu",
        max_batch=max_batch,
        max_seq=max_seq,
        max_tokens=max_tokens,
        num_adapters=adapters,
        max_rank=rank,
    )


def _load_mixed(model, rank=8):
    """Slots 0 and 1 everywhere; on MoE layers slot 2 covers gate_up only (mixed coverage: the layer then
    computes per-projection ids on the device)."""
    for slot in (0, 1):
        e2e.load_random_adapter(model, slot, rank=rank, alpha=16, seed=slot)
    for layer in model.layers:
        x = getattr(layer.mlp, "experts", None)
        if x is not None:
            g = torch.Generator().manual_seed(7)
            a = torch.randn(x.E, x.S, rank, x.H, generator=g) * 0.02
            b = torch.randn(x.E, x.S, 2 * x.I // x.S, rank, generator=g) * 0.02
            x.load_adapter(2, gate_up=(a, b), scaling=2.0)


# --------------------------------------------------------------------------------------------------
# host syncs in the decode step
# --------------------------------------------------------------------------------------------------
class _SyncTrap:
    """Patches sync-inducing torch entry points to raise while ``armed`` (and not inside a Triton launch)."""

    METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__repr__")
    METHODS += ("__str__", "nonzero", "masked_select", "unique", "pin_memory")
    FUNCTIONS = ("nonzero", "tensor", "as_tensor", "from_numpy", "unique", "masked_select", "argwhere")
    FACTORIES = ("empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "linspace", "eye")

    def __init__(self, monkeypatch):
        self.armed = False
        self.hits: list[str] = []
        self.depth = 0  # Triton launches in progress (the interpreter's host work is device work)
        trap = self

        def guard(name, real):
            def wrapped(*args, **kwargs):
                if trap.armed and trap.depth == 0:
                    trap.hits.append(name)
                    trap.disarm()  # the error message may print tensors
                    raise AssertionError(f"host sync in the decode step: {name}")
                return real(*args, **kwargs)

            return wrapped

        for m in self.METHODS:
            monkeypatch.setattr(torch.Tensor, m, guard(f"Tensor.{m}", getattr(torch.Tensor, m)))
        for f in self.FUNCTIONS:
            monkeypatch.setattr(torch, f, guard(f"torch.{f}", getattr(torch, f)))

        def hostless(name, real):  # a factory without device=: a host tensor, copied to the GPU later
            def wrapped(*args, **kwargs):
                if trap.armed and trap.depth == 0 and kwargs.get("device") is None and "out" not in kwargs:
                    trap.hits.append(name)
                    trap.disarm()
                    raise AssertionError(f"host tensor made in the decode step: {name} without device=")
                return real(*args, **kwargs)

            return wrapped

        for f in self.FACTORIES:
            monkeypatch.setattr(torch, f, hostless(f"torch.{f}", getattr(torch, f)))
        sync = guard("torch.cuda.synchronize", torch.cuda.synchronize)
        monkeypatch.setattr(torch.cuda, "synchronize", sync)
        from triton.runtime.interpreter import InterpretedFunction

        real_run = InterpretedFunction.run

        def run(self_, *args, **kwargs):
            trap.depth += 1
            try:
                return real_run(self_, *args, **kwargs)
            finally:
                trap.depth -= 1

        monkeypatch.setattr(InterpretedFunction, "run", run)

    def arm(self, *_):
        self.armed = True

    def disarm(self):
        self.armed = False

    @contextlib.contextmanager
    def on(self):
        self.arm()
        try:
            yield
        finally:
            self.disarm()


@pytest.mark.parametrize(
    "name, stage",
    # one stage per model, so every model and each of the three stages is covered once
    [("tiny-gpt-oss", "tuned"), ("tiny-qwen3", "naive"), ("tiny-qwen3-moe", "fused")],
)
def test_padded_prefill_and_decode_step_make_no_host_sync(name, stage, monkeypatch):
    """Stages: ``tuned`` (notebook 11's), ``naive`` (its initial-vs-optimized run), ``fused`` (12's).

    One model per case serves both forwards a CUDA graph captures (built once for both checks): the
    padded prefill (``pad_prefill``, tests/test_prefill_graphs.py's subject) gives the tokens
    of the unpadded prefill, and neither it nor the decode step at a padded bucket makes a host sync."""
    # max_seq 12: the 5-token prompts pad to 12 (the bucket of 64 capped at max_seq), which keeps the
    # interpreted padded forward small (its cost grows with the padded tokens); the padding itself is the
    # same code path at any length. max_tokens 48 holds the 3 x 12 padded prefill in one call. One decoder
    # layer: the layers run one code (GPT-OSS's full and sliding ones differ in the mask they pick from the
    # model's forward, which builds both).
    model = _model(name, stage=stage, max_seq=12, max_tokens=48, num_layers=1)
    _load_mixed(model)
    adapters = [0, -1, 2] if model.config.is_moe else [0, -1, 1]
    prompts = e2e.make_prompts(3, 5, model.config.vocab_size, 0)
    # two new tokens: the prefill's and one decode step reading the prefill's K/V; eager and unpadded, as
    # the CPU profile runs it
    ref = Generator(model, pad_prefill=False).generate(prompts, adapters, 2).tokens
    gen = Generator(model, pad_prefill=True, pad_to_buckets=True, graph_batch_sizes=(2, 4))
    assert gen.pad_prefill and not gen.use_cuda_graphs
    trap = _SyncTrap(monkeypatch)
    # the padded prefill forward inside the generate call: the trap armed from the first decoder layer
    # (the model's argument checks before it read CPU index tensors only; on the GPU they are skipped) to
    # the end of the forward
    real, seen = gen._forward_prefill, []

    def trapped(pb):
        seen.append((pb.rows, pb.length))
        hook = model.layers[0].register_forward_pre_hook(trap.arm)
        try:
            logits = real(pb)
        finally:
            trap.disarm()
            hook.remove()
        seen.append(logits.argmax(-1).tolist())
        return logits

    monkeypatch.setattr(gen, "_forward_prefill", trapped)
    assert gen.generate(prompts, adapters, 2).tokens == ref  # the decode step read the padded K/V
    assert not trap.hits, trap.hits
    assert prefill_length(5, model.max_seq) == 12
    assert seen == [(3, 12), [t[0] for t in ref]]
    # one decode step at bucket 4 (one dummy row), the trap armed from the first decoder layer to the end
    # of the step: layers, norm, lm_head, argmax
    first = torch.tensor([[t[0]] for t in ref])
    bucket, _ = gen._load_bucket([0, 1, 2], 0, first, [5] * 3, adapters)
    hook = model.layers[0].register_forward_pre_hook(trap.arm)
    try:
        with torch.no_grad():
            logits, greedy = gen._forward_decode(bucket)
    finally:
        trap.disarm()
        hook.remove()
    assert not trap.hits, trap.hits
    assert bucket.size == 4
    assert logits.shape == (bucket.size, model.config.vocab_size) and logits.dtype == torch.float32
    assert greedy.tolist()[:3] == [t[1] for t in ref]  # the step is the generator's second token


def test_sync_trap_sees_a_sync_in_a_layer(monkeypatch):
    from moelora_lib.model.modeling import Attention

    model = _model("tiny-qwen3")
    gen = Generator(model, pad_to_buckets=True, graph_batch_sizes=(2, 4))
    bucket = gen._bucket_for(2)
    real = Attention.forward

    def forward(self, x, ctx):
        if (x.abs().sum() > 0).item():  # a data-dependent branch: a host sync on the GPU
            pass
        return real(self, x, ctx)

    monkeypatch.setattr(Attention, "forward", forward)
    trap = _SyncTrap(monkeypatch)
    hook = model.layers[0].register_forward_pre_hook(trap.arm)
    try:
        with pytest.raises(AssertionError, match="Tensor.item"), torch.no_grad():
            gen._forward_decode(bucket)
    finally:
        trap.disarm()
        hook.remove()


def test_sync_trap_catches_a_sync(monkeypatch):
    trap = _SyncTrap(monkeypatch)
    t = torch.ones(3)
    with pytest.raises(AssertionError, match="Tensor.item"):
        with trap.on():
            t.sum().item()
    with pytest.raises(AssertionError, match="Tensor.__bool__"):
        with trap.on():
            if (t > 0).all():
                pass
    with pytest.raises(AssertionError, match="torch.tensor"):
        with trap.on():
            torch.tensor([1, 2])
    with pytest.raises(AssertionError, match="torch.arange without device"):
        with trap.on():
            t + torch.arange(3)
    with trap.on():
        torch.arange(3, device=t.device)
    with trap.on():
        (t * 2).argmax(dim=-1)  # device work only: no hit


# --------------------------------------------------------------------------------------------------
# what a graph holds by address stays in place
# --------------------------------------------------------------------------------------------------
def _addresses(model, gen) -> dict[str, int]:
    out = {f"param {n}": p.data_ptr() for n, p in model.named_parameters()}
    out |= {f"buffer {n}": b.data_ptr() for n, b in model.named_buffers()}
    for n, m in model.lora_modules().items():
        sc = m._scratch
        out |= {f"{n} scratch {k}": t.data_ptr() for k, t in sc.bufs.items()}
        for key, ws in sc.workspaces.items():
            for i, t in enumerate(sc.workspace_tensors(ws)):
                out[f"{n} workspace {key} {i}"] = t.data_ptr()
    for size, b in gen._buckets.items():
        for f in ("input_ids", "start_pos", "lora_ids", "cache_rows"):
            out[f"bucket {size} {f}"] = getattr(b, f).data_ptr()
    return out


def test_graph_state_stays_in_place(tmp_path):
    # one MoE model, tiny-gpt-oss: tiny-qwen3-moe's LoRA modules, scratch, workspaces, KV cache and buckets
    # are the same classes (GPT-OSS adds biases, sinks and a sliding window); the dense model is covered by
    # the capture test above. One decoder layer: every layer holds the same kinds of state (a sliding
    # layer's KV cache is a full one's).
    name = "tiny-gpt-oss"
    model = _model(name, num_layers=1)
    gen = Generator(model, pad_to_buckets=True, graph_batch_sizes=(1, 4))
    vocab = model.config.vocab_size
    for c in (1, 3):
        gen.generate(e2e.make_prompts(c, 5, vocab, c), [None] * c, 2)
    before, state0 = _addresses(model, gen), gen._adapter_state()
    rows = e2e.load_adapters(model, name, rank=8, alpha=16, seed=0, file_slots=[0], workdir=tmp_path)
    assert {r["source"] for r in rows} == {"peft_file", "direct"}
    state1 = gen._adapter_state()
    model.unload_adapter(3)
    state2 = gen._adapter_state()
    assert len({state0, state1, state2}) == 3  # every load/unload changes what drops the graphs
    for c in (1, 3):
        gen.generate(e2e.make_prompts(c, 5, vocab, 10 + c), [i % 3 for i in range(c)], 2)
    after = _addresses(model, gen)
    moved = sorted(k for k in before if after.get(k) != before[k])
    assert not moved, f"reallocated (a captured graph would read stale memory): {moved[:10]}"


# --------------------------------------------------------------------------------------------------
# GQA attention
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_gqa_attention_reads_the_cache_as_it_is(name, monkeypatch):
    model = _model(name)
    c = model.config
    ids = torch.tensor(e2e.make_prompts(2, 6, c.vocab_size, 3))
    kw = dict(cache_rows=torch.tensor([1, 0]), last_only=False)
    with torch.no_grad():
        ref = model(ids, [0, 0], [-1, -1], **kw)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), kwargs.get("enable_gqa", False)))
        out = real(q, k, v, *args, **kwargs)
        # the layout CUDA's flash / memory-efficient kernels return: [B, M, H, D] storage, transposed back
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        got = model(ids, [0, 0], [-1, -1], **kw)
    assert len(calls) == c.num_hidden_layers
    g = c.num_attention_heads // c.num_key_value_heads
    assert g > 1  # the tiny configs are GQA
    for q_shape, k_shape, gqa in calls:
        assert not gqa
        assert q_shape[1] == k_shape[1] == c.num_key_value_heads and q_shape[2] == g * 6, (q_shape, k_shape)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# transformers + PEFT baseline in bfloat16
# --------------------------------------------------------------------------------------------------
def test_hf_baseline_in_bfloat16():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    prev = torch.get_default_dtype()
    rows = e2e.hf_baseline_rows(
        "tiny-gpt-oss", dtype=torch.bfloat16, device="cpu", prompt_len=8, new_tokens=3, rank=8, alpha=16
    )
    assert torch.get_default_dtype() == prev
    assert [r["impl"] for r in rows] == list(e2e.HF_SCENARIOS)
    assert all(r["output_tokens"] == 3 and r["dtype"] == "bfloat16" for r in rows)
    m = e2e.hf_model("tiny-gpt-oss", dtype=torch.bfloat16, device="cpu")
    dtypes = {p.dtype for p in m.parameters()}
    assert dtypes == {torch.bfloat16}, dtypes  # built in bf16 directly (no fp32 copy at 42 GB)
    assert all(b.dtype == torch.float32 for n, b in m.named_buffers() if "inv_freq" in n)


# --------------------------------------------------------------------------------------------------
# stage fused at notebook 12's largest tiles: shared memory and spills (compile-only, sm_90)
# --------------------------------------------------------------------------------------------------
_SMEM_SCRIPT = r"""
import json
from moelora_lib.studies import compile_check as cc
from moelora_lib.kernels.fused import fused_default_config
from moelora_lib.shapes import Dims
out = []
CASES = (("gpt-oss-20b", [("silu", False), ("swigluoai", True)]), ("qwen3-30b-a3b", [("silu", False)]))
for shape, variants in CASES:
    sh = cc._shape(shape)
    for T in (1600, 8192):
        for act, bias in variants:
            d = Dims.of(sh, T, rank=32, adapters=8)
            run = cc._fused_meta_run(d, activation=act, has_bias=bias, dtype="bfloat16",
                                     config=fused_default_config(d))
            for op in ("fused_gate_up", "fused_down"):
                la = run.launch_args(op)
                k = cc.compile_for_sm90(cc._jit(la.kernel, False), la.args, la.constexprs, la.num_warps,
                                        la.num_stages)
                ru = cc.resource_usage(k)
                out.append(dict(shape=shape, T=T, act=act, op=op, cfg=la.cfg.short(),
                                smem=int(k.metadata.shared), REG=ru["REG"], LOCAL=ru["LOCAL"]))
print(json.dumps(out))
"""


def test_fused_largest_tiles_fit_sm90():
    rows = run_sm90_script(_SMEM_SCRIPT)
    assert len(rows) == 12
    H200_SMEM_PER_BLOCK = 232448  # 227 KiB of dynamic shared memory per block on sm_90
    for r in rows:
        assert r["smem"] <= H200_SMEM_PER_BLOCK and r["LOCAL"] == 0 and r["REG"] <= 255, r


# --------------------------------------------------------------------------------------------------
# GPT-OSS sink attention at prefill: one SDPA call with a virtual sink key
# --------------------------------------------------------------------------------------------------
def _sink_case(B, nkv, g, S, L, hd, window, dtype=torch.float32, seed=0):
    """Random folded queries qg [B, NKV, g·S, D], cache views [B, NKV, L, D], a causal (optionally sliding)
    mask [B, 1, S, L] for rows at different start positions, and sinks [NKV·g] of both signs."""
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(B, nkv, g * S, hd, generator=gen).to(dtype)
    kc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    vc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    sinks = (torch.randn(nkv * g, generator=gen) * 2).to(dtype)
    start = torch.randint(0, L - S + 1, (B,), generator=gen)
    pos = start[:, None] + torch.arange(S)
    kpos = torch.arange(L)
    mask = kpos[None, None, :] <= pos[:, :, None]
    if window is not None:
        mask = mask & (kpos[None, None, :] > pos[:, :, None] - window)
    return qg, kc, vc, mask[:, None], sinks


def _sink_reference(qg, kc, vc, mask, sinks, scale):
    """softmax over [scores, sink_h] per query head, sink column dropped: per head, in float64."""
    B, nkv, L, hd = kc.shape
    S = mask.shape[-2]
    g = qg.shape[2] // S
    out = torch.empty(B, nkv, g * S, hd, dtype=torch.float64)
    for b in range(B):
        for kv in range(nkv):
            for j in range(g):
                q = qg[b, kv, j * S : (j + 1) * S].double()
                s = (q @ kc[b, kv].double().T) * scale
                s = s.masked_fill(~mask[b, 0], float("-inf"))
                sink = sinks[kv * g + j].double().expand(S, 1)
                p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[:, :L]
                out[b, kv, j * S : (j + 1) * S] = p @ vc[b, kv].double()
    return out


@pytest.mark.parametrize(
    "B, nkv, g, S, L, hd, window",
    [
        (2, 2, 4, 7, 13, 64, None),  # GQA, prefill, head dim 64 -> 72
        (3, 2, 2, 5, 11, 64, 3),  # sliding window, rows at different start positions
        (2, 1, 3, 1, 9, 16, None),  # S = 1
        (2, 2, 2, 1, 10, 16, 4),  # S = 1, sliding
        (1, 3, 1, 6, 6, 40, 2),  # no GQA, head dim 40 (scale not a power of two), kv_len = S
    ],
)
def test_sink_sdpa_equals_the_explicit_formula(B, nkv, g, S, L, hd, window):
    from moelora_lib.model.modeling import Attention

    qg, kc, vc, mask, sinks = _sink_case(B, nkv, g, S, L, hd, window)
    scale = hd**-0.5
    ref = _sink_reference(qg, kc, vc, mask, sinks, scale)
    explicit = Attention.sinks_explicit(qg, kc, vc, mask, sinks, scale)
    fused = Attention.sinks_sdpa(qg, kc, vc, mask, sinks, scale)
    assert fused.shape == explicit.shape == (B, nkv, g * S, hd) and fused.dtype == torch.float32
    torch.testing.assert_close(explicit.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, explicit, rtol=1e-6, atol=1e-6)


def test_sink_sdpa_in_bfloat16_keeps_the_sink_exact_enough():
    """bf16 inputs: the sink logit rides as hi + lo bf16 parts (sink/scale is not a bf16 number when the
    scale is not a power of two); the result stays as close to the float64 formula as the explicit path."""
    from moelora_lib.model.modeling import Attention

    qg, kc, vc, mask, sinks = _sink_case(2, 2, 4, 6, 12, 40, 5, dtype=torch.bfloat16, seed=3)
    scale = 40**-0.5
    ref = _sink_reference(qg, kc, vc, mask, sinks, scale)
    err_fused = (Attention.sinks_sdpa(qg, kc, vc, mask, sinks, scale).double() - ref).abs().max()
    err_explicit = (Attention.sinks_explicit(qg, kc, vc, mask, sinks, scale).double() - ref).abs().max()
    assert err_fused <= max(2 * err_explicit, 2e-2), (err_fused, err_explicit)


def test_sink_sdpa_arguments_suit_the_fused_cuda_kernels(monkeypatch):
    """One SDPA call: NKV heads (K/V not repeated), head dim a multiple of 8 on q, k and v, scale passed,
    an additive mask in the model dtype with one extra column and 16-aligned strides (else the
    memory-efficient kernel pads a copy); no host sync or host tensor."""
    from moelora_lib.model.modeling import Attention

    B, nkv, g, S, L, hd = 2, 2, 4, 5, 11, 64
    qg, kc, vc, mask, sinks = _sink_case(B, nkv, g, S, L, hd, 3)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kwargs):
        m = kwargs["attn_mask"]
        calls.append((q.shape, k.shape, v.shape, m.shape, m.dtype, m.stride(), kwargs.get("scale")))
        out = real(q, k, v, *args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # CUDA fused kernels' output layout

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    trap = _SyncTrap(monkeypatch)
    with trap.on():
        out = Attention.sinks_sdpa(qg, kc, vc, mask, sinks, hd**-0.5)
    assert not trap.hits, trap.hits
    ((qs, ks, vs, ms, mdt, mst, sc),) = calls
    assert qs == (B, nkv, g * S, 72) and ks == vs == (B, nkv, L + 1, 72) and sc == hd**-0.5
    assert ms == (B, 1, g * S, L + 1) and mdt == torch.float32
    assert all(st % 16 == 0 for st in mst[:-1]) and mst[-1] == 1, mst
    torch.testing.assert_close(out, Attention.sinks_explicit(qg, kc, vc, mask, sinks, hd**-0.5))


def test_gpt_oss_prefill_uses_sdpa_and_decode_the_split_kv_kernel(monkeypatch):
    model = _model("tiny-gpt-oss")
    c = model.config
    ids = torch.tensor(e2e.make_prompts(2, 6, c.vocab_size, 3))
    kw = dict(cache_rows=torch.tensor([1, 0]), last_only=False)
    with torch.no_grad():
        ref = model(ids, [0, 0], [-1, -1], **kw)
        ref_step = model(ids[:, :1], [6, 6], [-1, -1], **kw)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k, v, *args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        got = model(ids, [0, 0], [-1, -1], **kw)
        assert len(calls) == c.num_hidden_layers  # prefill: one SDPA call per layer
        got_step = model(ids[:, :1], [6, 6], [-1, -1], **kw)
        assert len(calls) == c.num_hidden_layers  # decode (S = 1): no SDPA (the decode_attention kernel)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_step, ref_step, rtol=1e-5, atol=1e-5)
