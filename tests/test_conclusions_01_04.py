"""The written conclusions of notebooks 01-04 render from the committed GPU CSVs (and from small CPU frames).

CPU only, no kernels run: each ``conclusion(...)`` is fed the CSVs in ``data/`` that the H200 run wrote, with
``profile="gpu"``, so its asserts are checked against the numbers the next GPU run is expected to reproduce.
vLLM's figures come both from ``moe_bench.anchor_table()`` and from the committed side-by-side measurement in
``data/anchors/``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from moelora_lib.studies.conclusions import nb01, nb02, nb03, nb04

DATA = Path(__file__).resolve().parents[1] / "data"


def _csv(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name)


def anchors_from_side_by_side() -> pd.DataFrame:
    """vLLM's base / best LoRA / best whole layer per (model, T) from ``vllm_vs_moelora_moe_h200.csv`` (vLLM's
    current default configs, not the ``@cfg2025`` history rows)."""
    a = _csv("anchors/vllm_vs_moelora_moe_h200.csv")
    a = a[a.impl.isin(["vllm", "vllm_main", "2k_tma_pdl", "2k_notma"])]
    cols = {"base": "base_us", "lora": "lora_best_us", "total": "total_best_us"}
    parts = [a[a.part == p].groupby(["shape", "T"]).median_us.min().rename(c) for p, c in cols.items()]
    return pd.concat(parts, axis=1).reset_index().rename(columns={"shape": "model"})


def _anchor_tables():
    tables = [("side_by_side", anchors_from_side_by_side())]
    from moelora_lib.studies import moe_bench

    tables.append(("moe_bench", moe_bench.anchor_table()))
    return tables


def test_side_by_side_anchor_matches_docs():
    a = anchors_from_side_by_side().set_index(["model", "T"])
    # docs/anchors-h200.md: GPT-OSS-20B T = 1: LoRA best 30.3, whole layer 100.0; Qwen3 T = 1600: LoRA 641.1
    assert a.loc[("gpt-oss-20b", 1), "lora_best_us"] == pytest.approx(30.3, abs=0.1)
    assert a.loc[("gpt-oss-20b", 1), "total_best_us"] == pytest.approx(100.0, abs=0.1)
    assert a.loc[("qwen3-30b-a3b", 1600), "lora_best_us"] == pytest.approx(641.1, abs=0.1)


def test_nb01_gpu():
    md = nb01.conclusion(_csv("01_op_costs.csv"), _csv("01_checks.csv"), profile="gpu")
    assert md.startswith("### Conclusion (gpu profile)")
    for s in ["199 MB", "46 µs", "157 FLOP/byte", "2.6e-07", "mixtral-8x7b gate_up_shrink", "compute-bound"]:
        assert s in md, s


def test_nb01_cpu_frame():
    checks = _csv("01_checks.csv").assign(device="cpu")
    md = nb01.conclusion(_csv("01_op_costs.csv"), checks, profile="cpu")
    assert "(cpu profile)" in md and "device cpu" in md


def test_nb01_asserts_its_claims():
    checks = _csv("01_checks.csv")
    checks.loc[checks.check == "reference_vs_loop", "value"] = 1e-3
    with pytest.raises(AssertionError):
        nb01.conclusion(_csv("01_op_costs.csv"), checks, profile="gpu")


@pytest.mark.parametrize("which", ["side_by_side", "moe_bench"])
def test_nb02_gpu(which):
    anchors = dict(_anchor_tables())[which]
    md = nb02.conclusion(
        _csv("02_naive_kernel.csv"), _csv("02_naive_checks.csv"), profile="gpu", anchors=anchors
    )
    assert md.startswith("### Conclusion (gpu profile)")
    for s in [
        "7.0e-03",
        "83.9 µs at T = 1",
        "1.81×",
        "53.8",
        "| gpt-oss-20b | 1 |",
        "slower than vLLM's best",
    ]:
        assert s in md, s
    if which == "side_by_side":
        assert "53.8 vs 30.3 (0.56×)" in md and "134.1 vs 100.0 (0.75×)" in md


def test_nb02_cpu_frame():
    df = _csv("02_naive_kernel.csv").assign(mode="cpu-interpreter")
    checks = _csv("02_naive_checks.csv").assign(rel_err=1e-6, tol=1e-4, dtype="float32")
    md = nb02.conclusion(df, checks, profile="cpu", anchors=anchors_from_side_by_side())
    assert "(cpu profile)" in md and "GPU profile" in md and "Side by side" not in md


def test_nb03_gpu():
    md = nb03.conclusion(_csv("03_spec_keys.csv"), _csv("03_no_recompile.csv"), profile="gpu")
    for s in [
        "from 7 to 18",
        "T = 16, 80",
        "| `lora_shrink` | 3 | 2 | 6 = 3 × 2 |",
        "| `fused_moe` | 2 | 2 | 4 = 2 × 2 |",
        "launch sites",
        "docs/perf_notes.md",
    ]:
        assert s in md, s


def test_nb03_cpu_frame():
    md = nb03.conclusion(_csv("03_spec_keys.csv"), None, profile="cpu")
    assert "(cpu profile)" in md and "compiles nothing" in md and "T = 1, 16, 80" in md


def test_nb03_mismatch_fails():
    rec = _csv("03_no_recompile.csv")
    rec.loc[rec.stage == "naive", "compiled_lora_shrink"] += 1
    with pytest.raises(AssertionError):
        nb03.conclusion(_csv("03_spec_keys.csv"), rec, profile="gpu")


def test_nb04_gpu():
    md = nb04.conclusion(_csv("04_split_k.csv"), profile="gpu")
    for s in [
        "4.0e-06",
        "2.41×",
        "SPLIT_K = 16",
        "53.8 → 26.6 µs at T = 1 (2.02×)",
        "| gpt-oss-20b | 1600 |",
    ]:
        assert s in md, s


def test_nb04_cpu_frame():
    df = _csv("04_split_k.csv")
    df = df[df.split_k.isin([1, 2, 4]) & df["T"].isin([1, 8])].assign(mode="cpu-interpreter")
    md = nb04.conclusion(df, profile="cpu")
    assert "(cpu profile)" in md and "GPU profile" in md and "| gpt-oss-20b" not in md
