"""Pointer alignment and length of an argument never give a kernel a new Triton binary.

Triton specializes pointer arguments on 16-byte alignment and ints on == 1 / % 16. The reported case:
``topk_weights`` passed as ``buf[1:17]`` of a [17, 6] float32 buffer compiled the base down GEMM and
the down expand again (1–1.4 s each on the H200). The fix: :func:`moelora_lib.common.aligned16` on
every input :class:`~moelora_lib.kernels.LayerRun` hands to a kernel, and in the Triton alignment
(:mod:`moelora_lib.kernels.align`) ``do_not_specialize`` on the lengths and the id tensors' pointers
and strides, and a scratch whose sub-buffers start at length-independent 16-byte aligned offsets.

The keys are computed for sm_90 in ONE subprocess without TRITON_INTERPRET
(:func:`moelora_lib.studies.compile_check.run_isolated`; conftest sets the interpreter here); the
results check (iii) runs the layer under the interpreter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from offset_view_helpers import ALIGN_KEYS, OFFSET_KEYS, reduce_keys

from moelora_lib import fused_moe_lora
from moelora_lib.common import MISALIGNED_COPY_WARN_BYTES, MisalignedCopyWarning, aligned16
from moelora_lib.kernels.stages import LAUNCH_OPS
from moelora_lib.shapes import MoEShape
from moelora_lib.studies.compile_check import meta_layer_run, run_isolated
from moelora_lib.workloads import make_inputs

# (E, K, L) of the alignment checks: GPT-OSS-20B, and G = E and 3·E not multiples of 4 (the old
# scratch layout put group_end at NT·G entries, so its alignment followed T)
ALIGN_SHAPES = [(32, 4, 8), (6, 2, 2)]
LAYOUTS = ("contiguous", "offset", "transposed")


def _jobs() -> dict:
    jobs = {
        # the reported case (K = 6: buf[1:17] of [17, 6] float32 starts 24 bytes in), fp16, biases
        ("offset", 6): dict(op=OFFSET_KEYS, K=6),
        # K = 2 (8 bytes in), GPT-OSS activation, one fused gate_up slice, no biases
        ("offset", 2): dict(op=OFFSET_KEYS, K=2, S=1, activation="swigluoai", has_bias=False),
        # the same inputs without aligned16: what the check detects
        ("before", 6): dict(op=OFFSET_KEYS, K=6, realign=False),
    }
    for E, K, L in ALIGN_SHAPES:
        for layout in LAYOUTS:
            common = dict(op=ALIGN_KEYS, lengths=None, E=E, K=K, L=L, layout=layout)
            jobs[("align", E, layout, "ws")] = dict(common, workspace=True)
            jobs[("align", E, layout, "fresh")] = dict(common, workspace=False)
        jobs[("align", E, "contiguous", "tile64")] = dict(
            op=ALIGN_KEYS, lengths=None, E=E, K=K, L=L, tile=64, workspace=True
        )
    return jobs


@pytest.fixture(scope="module")
def keys() -> dict:
    from moelora_lib.studies.moe_bench import log_spaced_lengths

    jobs = _jobs()
    lengths = log_spaced_lengths(32)
    for j in jobs.values():
        if j["op"] == ALIGN_KEYS:
            j["lengths"] = lengths
    results = run_isolated(list(jobs.values()), timeout=900)
    return dict(zip(jobs, results))


# --- (i) every layer launch: offset views keep the key ------------------------------------------
@pytest.mark.parametrize("K", [6, 2])
def test_offset_views_keep_every_launch_key(keys, K):
    r = keys[("offset", K)]
    # every input really was misaligned (else the check would prove nothing)
    want = {"hidden_states", "topk_weights", "w13", "w2", "b13", "lora_a13", "lora_b2"} - (
        set() if K == 6 else {"b13"}
    )
    assert want <= set(r["misaligned_inputs"])
    assert set(r["same"]) == set(LAUNCH_OPS)
    assert all(r["same"].values()), {op: k for op, k in r["keys"].items() if k[0] != k[1]}


def test_check_detects_misaligned_pointers(keys):
    """Without aligned16 the offset views change the key of every launch that reads an input."""
    same = keys[("before", 6)]["same"]
    assert not same["base_down"] and not same["down_expand"]  # the reported pair (topk_weights)
    assert not any(same[op] for op in LAUNCH_OPS if op != "act")
    assert same["act"]  # reads only the layer's own buffers


# --- (ii) the Triton alignment: one key per constexpr class over >= 32 lengths -------------------
@pytest.mark.parametrize("E", [s[0] for s in ALIGN_SHAPES])
def test_align_one_key_per_class_over_lengths(keys, E):
    base = keys[("align", E, "contiguous", "ws")]
    assert len(base["base_count"]["per_length"]) >= 32
    for layout in LAYOUTS:
        for mode in ("ws", "fresh"):
            r = keys[("align", E, layout, mode)]
            for launch, v in r.items():
                # TILE (from T·K) and the scan's TC (from NT) are constexpr on purpose; nothing else
                # (lengths, pointers, strides) may add a key
                assert v["max_keys_per_class"] == 1, (layout, mode, launch, v["keys"], v["classes"])
                assert v["keys"] == v["classes"]
                # the same binaries as contiguous ids in a workspace, at every length
                assert v["key_list"] == base[launch]["key_list"], (layout, mode, launch)
                assert v["per_length"] == base[launch]["per_length"], (layout, mode, launch)
    # the classes are few: TILE in {64, ..., 512}, TC in {1, ..., 32}
    assert base["base_count"]["keys"] == base["lora_count"]["keys"] == 4
    assert base["base_scan"]["keys"] <= 6 and base["lora_scatter"]["keys"] == 4


@pytest.mark.parametrize("E", [s[0] for s in ALIGN_SHAPES])
def test_align_fixed_tile_one_key(keys, E):
    """With a fixed tile the count and scatter launches have one key over every length."""
    r = keys[("align", E, "contiguous", "tile64")]
    for launch in ("base_count", "base_scatter", "lora_count", "lora_scatter"):
        assert r[launch]["keys"] == 1, launch
    assert r["base_scan"]["max_keys_per_class"] == r["lora_scan"]["max_keys_per_class"] == 1


# --- (iii) results: offset views compute exactly what fresh tensors do ---------------------------
def _offset(t: torch.Tensor, elems: int = 1) -> torch.Tensor:
    """A view of a copy of ``t`` that starts ``elems`` elements into its buffer."""
    buf = torch.zeros(t.numel() + elems, dtype=t.dtype, device=t.device)
    v = buf[elems:].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("stage", ["naive", "even_k_fused_add"])
def test_offset_view_inputs_same_result(device, stage):
    shape = MoEShape("e8k6", 64, 32, 8, 6, 1)  # H 64, I 32, E 8, top-6: buf[1:17] starts 24 bytes in
    T, K = 16, 6
    inp = make_inputs(shape, T, rank=16, num_adapters=2, pattern="mixed", dtype=torch.float16, device=device)
    fresh = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)

    buf = torch.zeros(T + 1, K, dtype=torch.float32, device=device)
    buf[1:] = inp.topk_weights
    views = dict(
        hidden_states=_offset(inp.hidden_states, 3),  # odd element offset (6 bytes)
        w13=_offset(inp.w13),
        w2=_offset(inp.w2, 5),
        topk_weights=buf[1:17],  # the reported case
        topk_ids=_offset(inp.topk_ids),
        lora_ids=_offset(inp.lora_ids),
        lora_a13=_offset(inp.lora_a13),
        lora_b13=_offset(inp.lora_b13, 7),
        lora_a2=_offset(inp.lora_a2),
        lora_b2=_offset(inp.lora_b2),
    )
    assert all(v.data_ptr() % 16 for v in views.values())
    args = [views[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids", "lora_ids")]
    args += [views[n] for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", MisalignedCopyWarning)  # small tensors: no warning
        got = fused_moe_lora(*args, **inp.kwargs(), stage=stage)
    assert torch.equal(got, fresh)


# --- (iv) aligned16 ---------------------------------------------------------------------------
def test_aligned16_keeps_aligned_meta_and_empty_tensors():
    a = torch.randn(17, 6)
    assert a.data_ptr() % 16 == 0 and aligned16(a) is a
    v = a[4:]  # 96 bytes in: aligned
    assert aligned16(v) is v
    # meta tensors (compile-only checks) have data_ptr 0: kept; a meta view's data_ptr is its byte
    # offset, and its "copy" is a new meta tensor at 0, as a device copy would be aligned
    m = torch.empty(17, 6, device="meta")
    assert m.data_ptr() == 0 and aligned16(m) is m
    mv = aligned16(m[1:])
    assert mv.device.type == "meta" and mv.shape == (16, 6) and mv.data_ptr() % 16 == 0
    e = a[1:1]
    assert aligned16(e) is e
    nc = a.t()  # non-contiguous but aligned: kept as is
    assert aligned16(nc) is nc


def test_aligned16_copies_misaligned_views():
    buf = torch.arange(17 * 6, dtype=torch.float32).view(17, 6)
    v = buf[1:17]
    assert v.data_ptr() % 16 == 8
    c = aligned16(v)
    assert c is not v and c.data_ptr() % 16 == 0 and c.is_contiguous()
    assert torch.equal(c, v) and c.dtype == v.dtype and c.shape == v.shape
    h = torch.randn(5, 9, dtype=torch.float16)[:, 1:]  # non-contiguous and misaligned
    hc = aligned16(h)
    assert hc.data_ptr() % 16 == 0 and hc.is_contiguous() and torch.equal(hc, h)


def test_aligned16_warns_on_large_copies():
    n = MISALIGNED_COPY_WARN_BYTES // 4 + 16
    big = torch.zeros(n + 1)[1:]
    with pytest.warns(MisalignedCopyWarning, match="w13"):
        out = aligned16(big, "w13")
    assert out.data_ptr() % 16 == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", MisalignedCopyWarning)
        aligned16(torch.zeros(1025)[1:], "small")


def test_layer_run_keeps_aligned_inputs_and_meta_tensors(device):
    """Aligned inputs are used as they are (no copy); meta tensors (compile checks) pass through."""
    from moelora_lib.shapes import Dims

    run = meta_layer_run(Dims(T=16, H=64, I=32, E=8, top_k=6, adapters=2, rank=16), dtype="float16")
    assert run.x.device.type == "meta" and all(t.device.type == "meta" for t in run.lora)
    inp = make_inputs(MoEShape("e8k6", 64, 32, 8, 6, 1), 16, num_adapters=2, device=device)
    from moelora_lib.moe_lora import make_layer_run

    r = make_layer_run(*inp.args(), **inp.kwargs(), check_values=False)
    assert r.x is inp.hidden_states and r.w13 is inp.w13 and r.w2 is inp.w2
    assert all(a is b for a, b in zip(r.lora, (inp.lora_a13, inp.lora_b13, inp.lora_a2, inp.lora_b2)))
    buf = torch.zeros(17, 6, device=device)
    buf[1:] = inp.topk_weights
    args = list(inp.args())
    args[3] = buf[1:17]
    r2 = make_layer_run(*args, **inp.kwargs(), check_values=False)
    assert r2.topk_w.data_ptr() % 16 == 0 and torch.equal(r2.topk_w, inp.topk_weights.reshape(-1))


def test_topk_reduce_one_key_for_offset_and_strided_ids():
    """Offset or transposed topk_ids / lora_ids views give topk_reduce no new binary (their pointers and
    strides are do_not_specialize)."""

    keys = reduce_keys()
    assert set(keys) == {"contiguous", "offset", "transposed"}
    assert len(set(keys.values())) == 1, keys
