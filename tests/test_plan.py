"""One launch plan, one record per fact: LayerRun's op_fn / launch_args, Workload as one value for the
inputs, the one timing dispatch, the vLLM anchors read from data/anchors, one tolerance table."""

from __future__ import annotations

import math

import pytest
import torch

from moelora_lib.kernels import LAUNCH_OPS
from moelora_lib.kernels.launchers import lora_shrink
from moelora_lib.shapes import Dims
from moelora_lib.studies import bench, helion_study
from moelora_lib.studies import moe_bench as mb
from moelora_lib.testing import TOLERANCES
from moelora_lib.workloads import Workload

CPU = dict(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def run():
    inp = mb.layer_inputs("tiny", 5, rank=16, num_adapters=2, pattern="mixed", seed=1, **CPU)
    r = mb.make_run("even_k_fused_add", inp)
    r()
    return r


# --- the launch plan ---------------------------------------------------------------------------------
def test_op_fn_is_what_lora_op_fn_hands_out(run):
    # the shrink alone = a shrink wired by hand the way the layer wires it (gate_up: x, A13, rows_div K)
    got = run.op_fn("gate_up_shrink")()
    want = lora_shrink(
        run.x, run.lora[0], run.lora_align, run.cfg.gate_up_shrink, rows_div=run.K, use_even_k=True
    )
    # rows of pairs with an adapter (the others are never written by the shrink)
    ids = run.lora_align.sorted_token_ids
    rows = torch.unique(ids[ids < run.lora_align.num_pairs]).long()
    assert torch.equal(got[:, rows], want[:, rows])
    assert torch.equal(mb.lora_op_fn(run, "gate_up_shrink")()[:, rows], got[:, rows])
    with pytest.raises(ValueError, match="op must be one of"):
        mb.lora_op_fn(run, "base_down")
    with pytest.raises(ValueError, match="op must be one of"):
        run.launch_args("nope")


def test_expand_op_fn_writes_a_private_copy(run):
    y = run.y.clone()
    run.op_fn("down_expand")()
    assert torch.equal(run.y, y)  # the layer's buffer is untouched


def test_launch_args_cover_every_launch(run):
    for op in LAUNCH_OPS:
        la = run.launch_args(op)
        assert la.kernel in ("fused_moe", "lora_shrink", "lora_expand", "gated_act")
        assert (la.cfg is None) == (op == "act")
        if la.cfg is not None:
            assert la.cfg == getattr(run.cfg, op)
            assert la.constexprs["BLOCK_SIZE_M"] == la.cfg.BLOCK_SIZE_M
    assert run.launch_args("gate_up_expand").constexprs["ADD_INPUTS"] is True  # fused-add stage


# --- Workload: the inputs as one value -----------------------------------------------------------------
def test_workload_equals_the_keyword_form():
    wl = Workload("tiny", 4, rank=16, adapters=2, pattern="zipf", dtype="fp32", seed=3, device="cpu")
    assert wl.dtype is torch.float32 and wl.dims == Dims.of("tiny", 4, rank=16, adapters=2)
    a = mb.layer_inputs(wl)
    b = mb.layer_inputs("tiny", 4, rank=16, num_adapters=2, pattern="zipf", seed=3, **CPU)
    for x, y in zip(a.args(), b.args()):
        assert torch.equal(x, y)
    with pytest.raises(TypeError, match="either as a Workload"):
        mb.layer_inputs(wl, rank=8)
    with pytest.raises(TypeError, match="either as a Workload"):
        mb.layer_inputs(wl, 4)
    with pytest.raises(ValueError):
        Workload("tiny", 4, pattern="nope")
    r = mb.check_layer("even_k_fused_add", Workload("tiny", 3, rank=16, adapters=2, pattern="mixed", **CPU))
    assert r["rel_err"] <= TOLERANCES[torch.float32] and r["T"] == 3 and r["pattern"] == "mixed"


# --- one timing dispatch, one row schema -----------------------------------------------------------------
def test_time_fn_on_the_cpu():
    calls = []
    t = bench.time_fn(lambda: calls.append(1), "graph", "cpu")
    assert t.mode == "cpu" and len(calls) == 1 and t.ms_p50 >= 0
    assert bench.time_fn(lambda: None, "cpu-interpreter", "cuda").mode == "cpu"
    row = bench.result_row(timing=t)
    assert row["mode"] == "cpu" and "timing_mode" not in row


def test_bench_layer_rows_from_a_workload():
    wl = Workload("tiny", 3, rank=16, adapters=2, **CPU)
    rows = mb.bench_layer("even_k_fused_add", wl, parts=("lora",))
    assert [r["mode"] for r in rows] == ["cpu-interpreter"] and rows[0]["T"] == 3 and rows[0]["L"] == 2


# --- the vLLM anchors and the tolerance table ------------------------------------------------------------
def test_anchor_table_matches_docs_anchors_h200():
    t = mb.anchor_table().set_index(["model", "T"])
    assert list(t.columns) == [
        "base_us", "lora_current_us", "total_current_us", "lora_two_kernel_us", "total_two_kernel_us",
        "lora_best_us", "total_best_us",
    ]  # fmt: skip
    # docs/anchors-h200.md: (vLLM base, LoRA best, whole layer) in µs
    docs = {
        ("gpt-oss-20b", 1): (73.1, 30.3, 100.0),
        ("qwen3-30b-a3b", 1600): (428.8, 641.1, 1057.7),
        ("gpt-oss-20b", 1600): (946.7, 339.0, 1223.5),
    }
    for key, want in docs.items():
        got = t.loc[key, ["base_us", "lora_best_us", "total_best_us"]].tolist()
        assert all(math.isclose(g, w, abs_tol=0.051) for g, w in zip(got, want)), (key, got, want)
    assert mb.ANCHOR_FILE == mb.bench.REPO_ROOT / "data/anchors/vllm_vs_moelora_moe_h200.csv"


def test_helion_rel_tol_is_the_one_table():
    assert helion_study.REL_TOL == {str(dt).removeprefix("torch."): v for dt, v in TOLERANCES.items()}
