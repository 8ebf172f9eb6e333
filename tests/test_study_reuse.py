"""The levers that keep the GPU suite inside two device commands (docs/gpu_host.md §4), on the CPU:

* :class:`moe_bench.LayerWeights` hands out exactly what ``layer_inputs(shape, 1, ...)`` returns, once per
  (model, biases) in a process, and bit-identical from its folder in the next one;
* notebook 03's two fresh processes run side by side but never time at the same moment (one lock);
* notebook 05's four ncu points come from one ncu process, split back per point;
* notebook 08 starts the tuner only when a case is left to tune, and precompiles exactly the configs its
  sweep meets;
* vLLM's figures as the notebooks read them, and the conclusion cells of notebooks 01-06 holding on the
  committed H200 run.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from moelora_lib.studies import moe_bench as mb

CPU = dict(dtype=torch.float32, device="cpu")


def _same_inputs(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, (f.name, x, y)


def _generations(monkeypatch) -> list:
    """The weight sets LayerWeights generates from now on: one entry per ``moe_bench.layer_inputs`` call."""
    calls, real = [], mb.layer_inputs
    monkeypatch.setattr(mb, "layer_inputs", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("bias", [True, False, None])
def test_layer_weights_equal_layer_inputs_and_reload_bit_identical(tmp_path, monkeypatch, bias):
    want = mb.layer_inputs("tiny-oss", 1, rank=16, num_adapters=4, seed=3, bias=bias, **CPU)
    made = _generations(monkeypatch)
    store = mb.LayerWeights(rank=16, num_adapters=4, seed=3, folder=tmp_path, **CPU)
    got = store.get("tiny-oss", bias=bias)
    _same_inputs(got, want)
    assert store.get("tiny-oss", bias=bias) is got  # one set per process
    again = mb.LayerWeights(rank=16, num_adapters=4, seed=3, folder=tmp_path, **CPU)
    _same_inputs(again.get("tiny-oss", bias=bias), want)
    assert len(made) == 1  # generated once, then kept (memo) and loaded from its file


def test_layer_weights_keys_name_every_input(tmp_path):
    store = mb.LayerWeights(rank=16, num_adapters=4, folder=tmp_path, **CPU)
    store.get("tiny-oss", bias=True)
    store.get("tiny-oss", bias=False)
    mb.LayerWeights(rank=8, num_adapters=4, folder=tmp_path, **CPU).get("tiny-oss", bias=True)
    mb.LayerWeights(rank=16, num_adapters=4, seed=1, folder=tmp_path, **CPU).get("tiny-oss", bias=True)
    mb.LayerWeights(rank=16, num_adapters=4, folder=tmp_path, dtype=torch.float16, device="cpu").get(
        "tiny-oss"
    )
    assert len(list(tmp_path.glob("*.pt"))) == 5
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_layer_weights_bad_file_is_regenerated(tmp_path, monkeypatch):
    store = mb.LayerWeights(rank=16, num_adapters=4, folder=tmp_path, **CPU)
    want = store.get("tiny")
    (path,) = tmp_path.glob("*.pt")
    path.write_bytes(b"not a torch file")
    made = _generations(monkeypatch)
    again = mb.LayerWeights(rank=16, num_adapters=4, folder=tmp_path, **CPU)
    _same_inputs(again.get("tiny"), want)
    assert len(made) == 1


def test_layer_weights_drop_and_no_folder(tmp_path):
    store = mb.LayerWeights(rank=16, num_adapters=4, **CPU)
    a = store.get("tiny")
    store.drop("tiny")
    b = store.get("tiny")
    assert a is not b
    _same_inputs(a, b)
    store.drop()
    assert store._sets == {}


def test_reused_weights_give_the_same_tokens_as_before():
    """The timing cells draw each T's tokens over the reused set exactly as before (seeded by (seed, T))."""
    store = mb.LayerWeights(rank=16, num_adapters=4, **CPU)
    w = store.get("tiny", bias=False)
    direct = mb.layer_inputs("tiny", 1, rank=16, num_adapters=4, bias=False, **CPU)
    kw = dict(rank=16, num_adapters=4, activation="silu", bias=False, **CPU)
    _same_inputs(
        mb.layer_inputs("tiny", 7, weights=w, **kw), mb.layer_inputs("tiny", 7, weights=direct, **kw)
    )


_FAKE_CHILD = r"""
import json, sys, time
from moelora_lib.studies.moe_bench import _TimedSection
out, lock, stage = sys.argv[1], sys.argv[2], sys.argv[3]
spans = []
for i in range(4):
    time.sleep(0.02)  # untimed work: overlaps the other process
    with _TimedSection(None if lock == "-" else lock):
        t0 = time.time(); time.sleep(0.05); spans.append((t0, time.time()))
json.dump([dict(stage=stage, T=i, span=s) for i, s in enumerate(spans)], open(out, "w"))
"""


def test_recompile_processes_run_side_by_side_but_never_time_together(monkeypatch):
    def fake_cmd(stage, model, lengths, out, *, lock_path=None, **kw):
        return [sys.executable, "-c", _FAKE_CHILD, out, lock_path or "-", stage]

    monkeypatch.setattr(mb, "_recompile_cmd", fake_cmd)
    t0 = time.time()
    rows = mb.recompile_in_subprocesses(["naive", "no_recompile"], "tiny", [1, 2, 3, 4], timeout_s=120)
    assert list(rows) == ["naive", "no_recompile"] and all(len(r) == 4 for r in rows.values())
    spans = sorted(tuple(r["span"]) for rs in rows.values() for r in rs)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:])), "timed sections overlapped"
    assert spans[0][0] >= t0


def test_recompile_processes_report_a_failed_child(monkeypatch):
    monkeypatch.setattr(
        mb, "_recompile_cmd", lambda *a, **k: [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    )
    with pytest.raises(RuntimeError, match="rc 3"):
        mb.recompile_in_subprocesses(["naive", "no_recompile"], "tiny", [1], timeout_s=60)


def _fake_ncu(values):
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    lines += [
        f'"{i}","_lora_shrink_kernel","lts__t_sector_hit_rate.pct","%","{v}"' for i, v in enumerate(values)
    ]
    return SimpleNamespace(stdout="\n".join(lines), stderr="", returncode=0)


def test_ncu_points_from_one_process(monkeypatch):
    import shutil

    calls = []
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/ncu")

    def run(cmd, **kw):
        calls.append(cmd)
        return _fake_ncu([10.0] * 5 + [20.0] * 5 + [30.0, 30.0, 30.0, 30.0, 35.0])

    monkeypatch.setattr(subprocess, "run", run)
    rows = mb.ncu_l2_hit_rates("gpt-oss-20b", [(64, 1), (64, 8), (1600, 1)], weights_folder="/w")
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[cmd.index("--points") + 1] == "64:1,64:8,1600:1"
    assert cmd[cmd.index("--weights-folder") + 1] == "/w"
    assert [(r["T"], r["group_size_m"], r["ok"], r["launches"]) for r in rows] == [
        (64, 1, True, 5),
        (64, 8, True, 5),
        (1600, 1, True, 5),
    ]
    assert [r["l2_hit_pct"] for r in rows] == pytest.approx([10.0, 20.0, 31.0])
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: _fake_ncu([1.0] * 7))
    bad = mb.ncu_l2_hit_rates("gpt-oss-20b", [(64, 1), (64, 8)])
    assert not any(r["ok"] for r in bad) and "expected 5 per point" in bad[0]["message"]


def test_helion_tuner_starts_only_with_cases_left():
    from moelora_lib.helion_linear import LINEAR_MODELS, load_configs
    from moelora_lib.studies import helion_tune

    models, epis, ms = list(LINEAR_MODELS), ["none", "swiglu"], [1, 2, 4, 8, 16, 32, 256, 1024, 4096]
    shipped = load_configs("moelora_lib/configs/helion/NVIDIA_H200.json")
    assert helion_tune.cases_to_tune(models, epis, ms, shipped) == []
    every = helion_tune.build_cases(models, epis, ms)
    assert helion_tune.cases_to_tune(models, epis, ms, {}) == every
    assert helion_tune.cases_to_tune(models, epis, ms, shipped, force=True) == every


def test_helion_sweep_precompiles_the_configs_it_meets():
    from moelora_lib.helion_linear import HelionLinearMethod, bucket_for, lookup, warm_m_values
    from moelora_lib.studies import helion_study as study

    path = "moelora_lib/configs/helion/NVIDIA_H200.json"
    methods = {e: HelionLinearMethod(path, e) for e in ("none", "swiglu")}
    ms = [1, 2, 4, 8, 16, 32, 256, 1024, 4096]
    jobs = study._sweep_jobs(["llama3-8b", "qwen3-32b", "llama3-70b"], ("none", "swiglu"), "bfloat16")
    assert len(jobs) == 15
    tasks = study.sweep_compile_tasks(methods, jobs, ms)
    met = set()
    for _, _, k, n, epi, dt in jobs:
        for m in ms:
            cfg = lookup(methods[epi].table(), epi, dt, k, n, bucket_for(m))
            key = json.dumps([epi, dt, k, n, cfg], sort_keys=True)
            assert key in tasks, (epi, k, n, m)
            assert set(warm_m_values(bucket_for(m))) | {m} <= set(tasks[key]["ms"])
            met.add(key)
    assert met == set(tasks)  # nothing the sweep does not meet


def test_dense_checks_side_by_side_equal_one_process():
    """Notebook 10's checks split over processes: the same rows, in the same order, as in this process."""
    from moelora_lib.studies import dense_bench as db

    projs = [p.name for m in db.TINY_MODELS for p in db.projections(m)]
    kw = dict(stages=["naive", "tuned"], module_stages=["tuned"], rank=8, adapters=3, seed=0)
    here = db.check_projections(projs, [1, 5], dtype=torch.float32, device="cpu", **kw)
    there = db.check_in_subprocesses(
        projs, [1, 5], jobs=2, dtype="float32", device="cpu", timeout_s=600, **kw
    )
    assert len(here) == len(there) == len(projs) * 2 * (2 + 1 + len(db.BASELINES))
    drop = {"timestamp_utc", "git_commit"}  # a commit landing while the test runs changes the latter
    for a, b in zip(here, there):
        assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def test_compile_pass_points_run_in_helpers(tmp_path):
    """The compile pass launches what the timing loops launch (layer, parts, ops with changed configs)
    in helper processes that load the weight sets from the folder; a bad point is reported, not raised."""
    store = mb.LayerWeights(rank=16, num_adapters=4, folder=tmp_path, **CPU)
    split = [("gate_up_shrink", {"SPLIT_K": 2}), ("down_shrink", {"SPLIT_K": 2})]
    points = [
        mb.layer_point(
            "split_k", "tiny", 5, weights_bias=False, activation="silu", bias=False, op_changes=split
        ),
        mb.layer_point("naive", "tiny-oss", 3, weights_bias=True),
        mb.layer_point(
            "swizzle", "tiny", 2, weights_bias=False, op_changes=[("gate_up_expand", {"GROUP_SIZE_M": 4})]
        ),
    ]
    assert mb.compile_points(points, store) == []
    bad = mb.compile_points(
        [mb.layer_point("naive", "tiny", 3, op_changes=[("gate_up_shrink", {"NOPE": 1})])], store
    )
    assert len(bad) == 1 and "naive tiny T=3" in bad[0]
    res = mb.precompile_in_subprocesses(points, store, jobs=4, timeout_s=600)
    assert res["processes"] == 3 and res["points"] == 3 and res["failed"] == []  # 2 per model, 1 point left
    assert len(list(tmp_path.glob("*.pt"))) == 2  # one file per (model, biases), written by this process
    nothing = mb.precompile_in_subprocesses(points, mb.LayerWeights(rank=16, num_adapters=4, **CPU))
    assert nothing["processes"] == 0


def test_anchor_table_matches_the_side_by_side_file_and_docs():
    """``anchor_table`` against the same figures taken from the file with plain pandas, and the numbers
    docs/anchors-h200.md quotes (GPT-OSS-20B T = 1: LoRA best 30.3 µs, layer 100.0; Qwen3 T = 1600: 641.1)."""
    import pandas as pd

    a = pd.read_csv(mb.ANCHOR_FILE)
    a = a[a.impl.isin(["vllm", "vllm_main", "2k_tma_pdl", "2k_notma"])]
    want = {c: a[a.part == p].groupby(["shape", "T"]).median_us.min() for p, c in
            (("base", "base_us"), ("lora", "lora_best_us"), ("total", "total_best_us"))}  # fmt: skip
    got = mb.anchor_table().set_index(["model", "T"])
    assert len(got) == 12
    for col, w in want.items():
        assert got[col].to_dict() == pytest.approx(w.rename_axis(["model", "T"]).to_dict()), col
    assert got.loc[("gpt-oss-20b", 1), "lora_best_us"] == pytest.approx(30.3, abs=0.1)
    assert got.loc[("gpt-oss-20b", 1), "total_best_us"] == pytest.approx(100.0, abs=0.1)
    assert got.loc[("qwen3-30b-a3b", 1600), "lora_best_us"] == pytest.approx(641.1, abs=0.1)


_STAGES = ["naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add"]
_LORA_OPS = ["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]
#: per stage notebook: the variables its conclusion cell reads from earlier cells (CSV paths under data/)
_CONCLUSION_INPUTS = {
    "01_moe_lora_math": dict(lora_ops=_LORA_OPS, ridge=675 / 4.3),
    "02_naive_kernel": dict(CSV="02_naive_kernel.csv", CSV_CHECK="02_naive_checks.csv"),
    "03_no_recompile": dict(CSV="03_no_recompile.csv"),
    "04_split_k": dict(CSV="04_split_k.csv", OPS=["gate_up_shrink", "down_shrink"]),
    "05_swizzle": dict(CSV="05_swizzle.csv", NCU_CSV="05_ncu_l2.csv", OPS=_LORA_OPS),
    "06_even_k_fused_add": dict(CSV="06_even_k_fused_add.csv", CHECKS_CSV="06_checks.csv", stages=_STAGES),
}


@pytest.mark.parametrize("name", list(_CONCLUSION_INPUTS))
def test_stage_notebook_conclusion_holds_on_the_committed_gpu_run(name):
    """The last cell of notebooks 01-06 asserts its claims on the CSVs in data/ that the H200 run wrote
    (GPU profile) and renders Markdown that names the conclusion; no kernel runs."""
    from pathlib import Path

    import nbformat
    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    data = root / "data"
    nb = nbformat.read(root / "notebooks" / f"{name}.ipynb", 4)
    shown = []
    session = SimpleNamespace(csv=lambda n: data / n, gpu=True, profile="gpu", data=data)
    g = dict(nb=session, pd=pd, mb=mb, Markdown=lambda s: s, display=shown.append)
    g.update({k: data / v if isinstance(v, str) else v for k, v in _CONCLUSION_INPUTS[name].items()})
    for c in nb.cells:  # the cells the conclusion reads: notebook 05's ratio table, 06's targets
        if c.cell_type == "code" and ("ratios = us.div" in c.source):
            exec(c.source, g)
    if name == "06_even_k_fused_add":
        g["tgt"] = pd.read_csv(data / "06_targets.csv")
    exec(nb.cells[-1].source, g)
    assert len(shown) == 1 and shown[0].startswith("## Conclusion\n"), shown
    assert "Timing not concluded" not in shown[0] and "GPU only" not in shown[0]
