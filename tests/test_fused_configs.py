"""Stage ``fused``: the adapter-ordered base alignment, the fused GEMMs' own config file and its loader
(CPU: torch ops and the Triton interpreter, fp32/fp16).

The alignment is checked against a plain-Python reference written here (not the function under test):
per expert, the pairs in (adapter slot, pair) order, padding to BLOCK_SIZE_M per expert only.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from moelora_lib import STAGES, configs
from moelora_lib.configs import fused_default_config, fused_gemm_configs
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_reference
from moelora_lib.routing import align_tokens
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs


def _python_sorted_alignment(topk_ids, lora_ids, E, L, BM):
    """(sorted ids list, block experts list, num_post) by plain loops."""
    T, K = topk_ids.shape
    P = T * K
    out, experts = [], []
    for e in range(E):
        pairs = [p for p in range(P) if int(topk_ids.reshape(-1)[p]) == e]
        if not pairs:
            continue

        def slot(p):
            lid = int(lora_ids[p // K])
            return lid if 0 <= lid < L else L

        pairs.sort(key=lambda p: (slot(p), p))
        pad = -len(pairs) % BM
        out += pairs + [P] * pad
        experts += [e] * ((len(pairs) + pad) // BM)
    return out, experts, len(out)


@pytest.mark.parametrize("seed, BM", [(0, 16), (1, 32)])
def test_sorted_alignment_matches_python_reference(seed, BM):
    g = torch.Generator().manual_seed(seed)
    T, K, E, L = 37, 3, 5, 4
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    lora_ids = torch.randint(-1, L + 2, (T,), generator=g, dtype=torch.int32)  # -1 and ids >= L go last
    al = align_tokens(topk_ids, E, BM, check_values=False, sort_lora_ids=lora_ids, num_adapters=L)
    ids, experts, n = _python_sorted_alignment(topk_ids, lora_ids, E, L, BM)
    assert int(al.num_tokens_post_padded) == n
    assert al.sorted_token_ids[:n].tolist() == ids
    assert al.block_expert_ids[: n // BM].tolist() == experts
    assert (al.block_expert_ids[n // BM :] == -1).all() and (al.block_lora_ids == -1).all()
    plain = align_tokens(topk_ids, E, BM, check_values=False)  # same sizes and blocks, other order
    assert al.sorted_token_ids.shape == plain.sorted_token_ids.shape
    assert torch.equal(al.block_expert_ids, plain.block_expert_ids)


def test_sorted_alignment_bad_arguments_are_named():
    topk = torch.zeros(4, 2, dtype=torch.int32)
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="sort_lora_ids applies to the expert-only alignment"):
        align_tokens(topk, 2, 16, lora_ids=ids, num_adapters=2, sort_lora_ids=ids)
    with pytest.raises(ValueError, match=r"sort_lora_ids must be \[T=4\]"):
        align_tokens(topk, 2, 16, sort_lora_ids=ids[:3], num_adapters=2)
    with pytest.raises(ValueError, match="sort_lora_ids must be an int32/int64 tensor"):
        align_tokens(topk, 2, 16, sort_lora_ids=ids.float(), num_adapters=2)
    with pytest.raises(ValueError, match=r"num_adapters must be an int in \[1, 2\*\*31\) with sort_lora_ids"):
        align_tokens(topk, 2, 16, sort_lora_ids=ids)


@pytest.mark.parametrize(
    "model, dtype", [("tiny", torch.float32), ("tiny-oss", torch.float16)], ids=["tiny-fp32", "tiny-oss-fp16"]
)
def test_fused_stage_adapter_order_same_result(model, dtype):
    """The adapter order changes which rows share a tile, not a row's sums: equal to the pair order
    within the dtype's tolerance (not bit for bit: the interpreter's dot may round a row differently
    at another position in its tile, seen on an AMD EPYC's OpenBLAS) and close to the reference."""
    inp = make_inputs(get_shape(model), 29, rank=16, num_adapters=3, pattern="mixed", dtype=dtype, seed=4)
    cfg = fused_default_config(
        Dims.of(get_shape(model), 29, rank=16, adapters=3, slices=inp.lora_a13.shape[2])
    )
    runs = {
        o: make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", config=cfg, adapter_order=o)
        for o in (True, False)
    }
    ids = runs[True].base_align.sorted_token_ids
    K = inp.topk_ids.shape[1]
    assert not torch.equal(ids, runs[False].base_align.sorted_token_ids)  # the order did change
    outs = {o: r() for o, r in runs.items()}
    assert_close_rel(outs[True], outs[False], dtype)
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    assert_close_rel(outs[True], ref, dtype)
    # inside every block of the sorted alignment the adapter ids are non-decreasing
    lids = inp.lora_ids.long()
    slot = torch.where(lids < 0, torch.full_like(lids, 3), lids)
    for b in range(int(runs[True].base_align.num_tokens_post_padded) // 16):
        rows = [int(p) for p in ids[b * 16 : (b + 1) * 16] if int(p) < ids.numel() and int(p) < 29 * K]
        s = [int(slot[p // K]) for p in rows]
        assert s == sorted(s)


def test_adapter_order_flag_validated_and_defaulted():
    inp = make_inputs(get_shape("tiny"), 5, rank=16, num_adapters=2, pattern="uniform", dtype=torch.float32)
    with pytest.raises(ValueError, match="adapter_order must be a Python bool"):
        make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", adapter_order=1)
    assert make_layer_run(*inp.args(), **inp.kwargs(), stage="fused").adapter_order is True
    assert make_layer_run(*inp.args(), **inp.kwargs(), stage="tuned").adapter_order is False


# ---- the fused config file and its loader ---------------------------------------------------------


def _folder_with_shipped(tmp_path):
    """A copy of the shipped H200 LoRA and base files (no fused file)."""
    src = configs.shipped_folder("NVIDIA_H200")
    for op in ("base", "gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"):
        name = configs.config_file_name("NVIDIA_H200", op)
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


DIMS = Dims.of("gpt-oss-20b", 64, rank=32, adapters=8)


def test_load_fused_config_derived_then_file(tmp_path):
    configs.clear_cache()
    folder = _folder_with_shipped(tmp_path)
    tuned = configs.load_layer_config(DIMS, folder=folder, gpu_name="NVIDIA_H200")
    with pytest.warns(configs.TunedConfigWarning, match="derives its GEMM configs from the tuned base ones"):
        derived = configs.load_fused_config(DIMS, folder=folder, gpu_name="NVIDIA_H200")
    assert derived.source.endswith("; fused=derived")
    assert derived.base_gate_up == fused_gemm_configs(tuned).base_gate_up
    assert derived.base_gate_up.BLOCK_SIZE_N == max(32, tuned.base_gate_up.BLOCK_SIZE_N // 2)
    assert derived.gate_up_shrink == tuned.gate_up_shrink and derived.base_down == tuned.base_down
    leaf = {
        "fused_gate_up": {
            "BLOCK_SIZE_M": 32,
            "BLOCK_SIZE_N": 64,
            "BLOCK_SIZE_K": 64,
            "NUM_WARPS": 4,
            "NUM_STAGES": 4,
        },
        "fused_down": {
            "BLOCK_SIZE_M": 32,
            "BLOCK_SIZE_N": 128,
            "BLOCK_SIZE_K": 64,
            "NUM_WARPS": 8,
            "NUM_STAGES": 3,
        },
    }
    data = configs.set_entry({}, configs.base_keys(DIMS), leaf)
    configs.save_config_file(folder / configs.config_file_name("NVIDIA_H200", "fused"), data)
    got = configs.load_fused_config(DIMS, folder=folder, gpu_name="NVIDIA_H200")
    assert got.source.endswith("; fused=file")
    assert (got.base_gate_up.BLOCK_SIZE_M, got.base_gate_up.BLOCK_SIZE_N) == (32, 64)
    assert (got.base_down.BLOCK_SIZE_N, got.base_down.NUM_WARPS) == (128, 8)
    assert got.gate_up_shrink == tuned.gate_up_shrink  # shrinks: stage tuned's
    # the stage reads the same
    assert STAGES["fused"].config_for(DIMS, folder=folder, gpu_name="NVIDIA_H200") == got


def test_fused_config_cpu_default():
    if torch.cuda.is_available():
        pytest.skip("CPU-only: no tuned file for the interpreter")
    assert STAGES["fused"].config_for(DIMS) == fused_default_config(DIMS)


@pytest.mark.parametrize(
    "leaf, match",
    [
        ({"fused_gate_up": {"BLOCK_SIZE_M": 16}}, "must have exactly the keys"),
        (
            {"fused_gate_up": {"BLOCK_SIZE_M": 16}, "fused_down": {"BLOCK_SIZE_M": 32}},
            "must share BLOCK_SIZE_M",
        ),
        (
            {"fused_gate_up": {"BLOCK_SIZE_M": 16, "SPLIT_K": 2}, "fused_down": {"BLOCK_SIZE_M": 16}},
            "SPLIT_K.*must be 1",
        ),
        ({"fused_gate_up": {"BLOCK_SIZE_M": 16, "BLOK": 1}, "fused_down": {"BLOCK_SIZE_M": 16}}, "BLOK"),
        (
            {"fused_gate_up": {"BLOCK_SIZE_M": 16}, "fused_down": {"BLOCK_SIZE_M": 16}, "stack": True},
            r"must have exactly the keys .*, got \['fused_down', 'fused_gate_up', 'stack'\]",
        ),
    ],
)
def test_fused_file_errors_name_the_key(tmp_path, leaf, match):
    p = tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_FUSED.json"
    p.write_text(json.dumps(configs.set_entry({}, (32, 5760, 2880, 64), leaf)))
    with pytest.raises(ValueError, match=match):
        configs.load_config_file(p, "fused")


def test_fused_file_alone_in_a_folder_is_used(tmp_path):
    """A folder holding only the fused file (e.g. the tuner's --out): its GEMM configs are used, the
    shrinks fall back to the defaults, and the source says both."""
    configs.clear_cache()
    leaf = {
        "fused_gate_up": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64},
        "fused_down": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64},
    }
    configs.save_config_file(
        tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_FUSED.json",
        configs.set_entry({}, configs.base_keys(DIMS), leaf),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", configs.TunedConfigWarning)
        got = configs.load_fused_config(DIMS, folder=tmp_path, gpu_name="NVIDIA_H200")
    assert got.source.endswith("; lora=default; base=default; fused=file")
    assert (got.base_gate_up.BLOCK_SIZE_M, got.base_down.BLOCK_SIZE_N) == (32, 128)
    assert got.gate_up_shrink == fused_default_config(DIMS).gate_up_shrink
    with pytest.raises(ValueError, match="gpu_name must be a str"):
        configs.load_fused_config(DIMS, folder=tmp_path, gpu_name=5)


def test_fused_file_bm_mismatch_names_the_file_keys(tmp_path):
    p = tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_FUSED.json"
    leaf = {"fused_gate_up": {"BLOCK_SIZE_M": 16}, "fused_down": {"BLOCK_SIZE_M": 64}}
    p.write_text(json.dumps(configs.set_entry({}, (32, 5760, 2880, 64), leaf)))
    with pytest.raises(ValueError, match=r"\{'fused_gate_up': 16, 'fused_down': 64\}"):
        configs.load_config_file(p, "fused")


def test_sorted_alignment_refuses_huge_num_adapters_and_other_device():
    topk = torch.zeros(4, 2, dtype=torch.int32)
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"num_adapters must be an int in \[1, 2\*\*31\)"):
        align_tokens(topk, 3, 16, sort_lora_ids=ids, num_adapters=2**62)  # the sort key would overflow
    with pytest.raises(ValueError, match="sort_lora_ids must be on topk_ids' device"):
        align_tokens(topk, 3, 16, sort_lora_ids=ids.to("meta"), num_adapters=2)


def test_bench_levers_bad_arguments():
    from moelora_lib.studies import fused_bench as fb

    for kw, match in [
        (dict(levers=[]), "non-empty list of distinct"),
        (dict(levers=["fused_v1", "fused_v1"]), "non-empty list of distinct"),
        (dict(levers=5), "non-empty list of distinct"),  # None is the default: every lever the device runs
        (dict(levers=["nope"]), "levers must be names of"),
        (dict(T=0), "T must be an int >= 1"),
    ]:
        args = dict(T=1, levers=["fused_v1"], device="cpu", dtype=torch.float32)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            fb.bench_levers("tiny", args.pop("T"), **args)


def test_align_tokens_flags_must_be_bools():
    topk = torch.zeros(4, 2, dtype=torch.int32)
    for name in ("include_no_adapter", "check_values"):
        with pytest.raises(ValueError, match=f"{name} must be a Python bool"):
            align_tokens(topk, 3, 16, **{name: "no"})


def test_bench_layer_refuses_zero_tokens():
    from moelora_lib.studies import moe_bench as mb

    with pytest.raises(ValueError, match="bench_layer: T must be >= 1"):
        mb.bench_layer("tuned", "tiny", 0, dtype=torch.float32, device="cpu")
