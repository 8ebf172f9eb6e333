"""Notebook 12's study module (moelora_lib.studies.fused_bench): launch counts, checks and op costs of stage
``fused`` on the tiny preset (Triton interpreter on the CPU), and its tables on synthetic rows against
values recomputed here with plain arithmetic."""

import math

import pandas as pd
import pytest
import torch

from moelora_lib.studies import fused_bench as fb
from moelora_lib.studies import moe_bench as mb


@pytest.fixture(scope="module")
def weights():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    return mb.layer_inputs("tiny-oss", 1, rank=16, num_adapters=4, dtype=dt, device=dev, seed=0, bias=True)


def test_launch_rows_count_the_plan(weights):
    inp = mb.layer_inputs("tiny-oss", 5, rank=16, num_adapters=4, weights=weights, seed=0)
    got = {}
    for stage in ("tuned", "fused"):
        run = mb.make_run(stage, inp)
        run()
        rows = {r["part"]: r for r in fb.launch_rows(run, model="tiny-oss", profile_gpu=False)}
        got[stage] = (rows["total"]["triton"], rows["base"]["triton"], rows["total"]["planned"])
        assert rows["total"]["counted"] == rows["total"]["triton"] + rows["total"]["fills"]
    assert got == {"tuned": (8, 4, 8), "fused": (5, 3, 5)}
    from triton.runtime.jit import JITFunction  # the wrappers are gone afterwards

    assert JITFunction.run.__name__ == "run" and torch.zeros.__name__ == "zeros"
    assert fb.count_launches(lambda: None) == {}


def test_check_point_rows(weights):
    inp = mb.layer_inputs("tiny-oss", 9, rank=16, num_adapters=4, weights=weights, seed=0, pattern="mixed")
    rows = fb.check_point("fused", inp, model="tiny-oss", pattern="mixed", variant="real")
    assert [r["check"] for r in rows] == ["layer_vs_reference", "base_vs_reference", "call_twice"]
    assert all(r["rel_err"] <= r["tol"] for r in rows)
    assert rows[0]["no_adapter_rows"] > 0 and rows[0]["no_adapter_bitwise"] and rows[0]["delta_rel"] > 1e-3


def test_fused_op_costs_account_for_the_fusion(weights):
    inp = mb.layer_inputs("tiny-oss", 7, rank=16, num_adapters=4, weights=weights, seed=0)
    run = mb.make_run("fused", inp)
    c = fb.fused_op_costs(run, "tiny-oss", inp.topk_ids, inp.lora_ids)
    b = inp.hidden_states.element_size()
    base = {r["op"]: r for r in mb.op_costs("tiny-oss", run.dims, dtype_bytes=b, topk_ids=inp.topk_ids,
                                            lora_ids=inp.lora_ids)}  # fmt: skip
    d = run.dims
    P, I, H, R, S = d.pairs, d.I, d.H, d.rank, d.slices
    lid = inp.lora_ids.long().cpu().repeat_interleave(d.top_k)
    eid = inp.topk_ids.long().cpu().reshape(-1)
    n_pair = len({(int(a), int(e)) for a, e in zip(lid, eid) if a >= 0})
    R16 = (R + 15) // 16 * 16
    # gate_up: g [P, I] written instead of h [P, 2I]; B13 of the touched pairs and the intermediate read
    gu = base["base_gate_up"]["bytes"] - P * I * b + n_pair * 2 * I * R * b + S * P * R16 * 4
    assert c["fused_gate_up"]["bytes"] == gu
    assert c["fused_down"]["bytes"] == base["base_down"]["bytes"] + n_pair * H * R * b + P * R16 * 4
    assert c["fused_gate_up"]["flops"] == base["base_gate_up"]["flops"] + 2 * P * R * 2 * I
    assert c["fused_down"]["flops"] == base["base_down"]["flops"] + 2 * P * R * H
    assert c["gate_up_shrink"]["flops"] == base["gate_up_shrink"]["flops"]
    assert all(v["floor_us"] > 0 for v in c.values())


def _rows():
    """Synthetic 12_fused.csv rows: two stages at T = 1 and 1600, with config strings, and lever rows."""
    rows, lv = [], []
    for T, k in ((1, 32), (1600, 1)):
        us = dict(base=100.0 * T**0.3, lora=20.0, total=100.0 * T**0.3 + 30.0)
        cfg_t = f"gate_up_shrink=m16n32k64g8s{k}w4st3;down_shrink=m16n32k64g8s1w4st3"
        cfg_f = f"gate_up_shrink=m16n32k64g8s{k}w4st3;fused_down=m16n64k64g1s{2 if T == 1 else 1}w4st4"
        for part in ("base", "lora", "total"):
            v = us[part]
            rows.append(dict(stage="tuned", model="m", T=T, part=part, us_p50=v, ms_p20=0.9 * v / 1e3,
                             ms_p80=1.1 * v / 1e3, floor_us=50.0, config=cfg_t))  # fmt: skip
            if part != "lora":
                f = v * (0.9 if part == "total" else 1.0)
                rows.append(dict(stage="fused", model="m", T=T, part=part, us_p50=f, ms_p20=0.9 * f / 1e3,
                                 ms_p80=1.1 * f / 1e3, floor_us=50.0, config=cfg_f))  # fmt: skip
        levers = [("fused_v1", "base", 2.0), ("fused_v1", "total", 3.0), ("fused_pair_order", "base", 1.0)]
        levers += [("fused_pair_order", "total", 1.5), ("tuned_deterministic", "lora", 1.2)]
        levers += [("tuned_deterministic", "total", 1.1), ("fused_deterministic", "base", 1.0)]
        levers += [("fused_deterministic", "total", 1.05)]
        for lever, part, v in levers:
            lv.append(dict(lever=lever, model="m", T=T, part=part, us_p50=v * us[part]))
    df = pd.DataFrame(rows)
    df["ms_p50"] = df.us_p50 / 1e3
    return df, pd.DataFrame(lv)


def test_layer_and_targets_tables():
    df, _ = _rows()
    lt = fb.layer_table(df).set_index(["stage", "model", "T"])
    f = lt.loc[("fused", "m", 1600)]
    base, total = 100.0 * 1600**0.3, 0.9 * (100.0 * 1600**0.3 + 30.0)
    assert f.lora == pytest.approx(total - base)
    assert f.lora_lo == pytest.approx(0.9 * total - 1.1 * base) and f.lora_hi == pytest.approx(
        1.1 * total - 0.9 * base
    )
    assert lt.loc[("tuned", "m", 1), "lora_measured"] == pytest.approx(20.0)
    anchors = pd.DataFrame(dict(model="m", T=[1, 1600], base_us=[90.0, 500.0], lora_best_us=[40.0, 80.0],
                                total_best_us=[150.0, 800.0]))  # fmt: skip
    t = fb.targets_table(df, anchors).set_index("T")
    assert t.loc[1, "lora_target"] == 2.5 and t.loc[1600, "lora_target"] == 2.0
    assert t.loc[1, "total_target"] == 1.5 and t.loc[1600, "total_target"] == 1.5
    tot1 = 0.9 * 130.0
    assert t.loc[1, "total_x"] == pytest.approx(150.0 / tot1) and t.loc[1, "met_total"] == (
        150.0 / tot1 >= 1.5
    )
    assert t.loc[1, "lora_x"] == pytest.approx(40.0 / (tot1 - 100.0))
    assert t.loc[1600, "speedup_total"] == pytest.approx(1 / 0.9)
    assert t.loc[1, "met_base_floor"] == (100.0 / 50.0 <= 1.25) and t.loc[1600, "met_lora_share"] is None


def test_levers_table_matches_plain_arithmetic():
    df, lv = _rows()
    t = fb.levers_table(lv, df).set_index(["model", "T"])
    for T, k in ((1, 32), (1600, 1)):
        r = t.loc[("m", T)]
        b, tot = 100.0 * T**0.3, 100.0 * T**0.3 + 30.0
        assert r.v1_total == pytest.approx(3.0 * tot) and r.v1_lora == pytest.approx(3.0 * tot - 2.0 * b)
        assert r.pair_lora == pytest.approx(1.5 * tot - b) and r.fused_lora == pytest.approx(0.9 * tot - b)
        assert r.det_lora == pytest.approx(1.2 * 20.0) and r.fdet_total == pytest.approx(1.05 * tot)
        assert r.tuned_split_k == k and r.fused_split_k == max(k, 2 if T == 1 else 1)
    assert not {"pdl_total", "loop_total", "fused_stacked"} & set(t.columns)


def test_levers_are_the_kept_capabilities():
    assert list(fb.LEVERS) == ["fused_v1", "fused_pair_order", "tuned_deterministic", "fused_deterministic"]
    with pytest.raises(ValueError, match="levers must be names of"):
        fb.bench_levers("tiny", 1, levers=["fused_pdl"], device="cpu")


def test_timeline_rows_split_replays_and_gaps():
    """Two replays of a 3-kernel graph given out of order: split by start, gaps from the previous end."""
    ev = [("a", 1000, 2000), ("b", 4000, 1000), ("c", 4500, 1500),  # replay 0: b and c overlap
          ("c", 106000, 1000), ("a", 100000, 3000), ("b", 103500, 500)]  # fmt: skip
    rows = fb.timeline_rows(ev, 2)
    assert [(r["replay"], r["seq"], r["name"]) for r in rows] == [
        (0, 0, "a"), (0, 1, "b"), (0, 2, "c"), (1, 0, "a"), (1, 1, "b"), (1, 2, "c")
    ]  # fmt: skip
    assert [r["start_us"] for r in rows] == [0.0, 3.0, 3.5, 0.0, 3.5, 6.0]
    assert [r["gap_us"] for r in rows] == [0.0, 1.0, -0.5, 0.0, 0.5, 2.0]
    assert [r["span_us"] for r in rows] == [5.0] * 3 + [7.0] * 3
    t = fb.timeline_table(pd.DataFrame([dict(r, model="m", T=1, stage="s") for r in rows]))
    assert t.kernels.tolist() == [3] and t.span_us.tolist() == [6.0]
    assert t.busy_us.tolist() == [4.5] and t.gaps_us.tolist() == [1.75]  # medians of (1.0, 2.5)
    assert math.isclose(t.gap_share.iloc[0], 1.75 / 6.0)
    with pytest.raises(ValueError, match="split into 4 replays"):
        fb.timeline_rows(ev, 4)
    with pytest.raises(ValueError, match="replays must be an int"):
        fb.timeline_rows(ev, 0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            fb.graph_timeline(object(), model="m")
