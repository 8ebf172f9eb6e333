"""The written conclusions of notebooks 01-04 render from the committed GPU CSVs (and from small CPU frames).

CPU only, no kernels run: each ``conclusion(...)`` is fed the CSVs in ``data/`` that the H200 run wrote, with
``profile="gpu"``, so its asserts are checked against the committed run. The numbers the Markdown must carry
are recomputed here from the same CSVs with plain pandas (not with the conclusion modules' helpers) and
formatted as the conclusions format them, so a re-measured ``data/`` needs no edit here while a conclusion
that renders a wrong number (wrong row, wrong column, wrong ratio) still fails. vLLM's figures come both from
``moe_bench.anchor_table()`` and from the committed side-by-side measurement in ``data/anchors/``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from moelora_lib.hardware import H200_BF16_TFLOPS, H200_COPY_TB_PER_S
from moelora_lib.studies.conclusions import nb01, nb02, nb03, nb04

DATA = Path(__file__).resolve().parents[1] / "data"
BASE_OPS = ["base_gate_up", "base_down"]
LORA_OPS = ["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"]
SHRINK_OPS = ["gate_up_shrink", "down_shrink"]


def _csv(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name)


def _missing(md: str, expected) -> list[str]:
    return [s for s in expected if s not in md]


def _prose(items) -> str:
    """A list as the conclusions write it in prose: ``16``, ``16 and 80``, ``1, 16 and 80``."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


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


# ---- 01 -------------------------------------------------------------------------------------------------


def expected_nb01(costs: pd.DataFrame, checks: pd.DataFrame) -> list[str]:
    ridge = H200_BF16_TFLOPS / H200_COPY_TB_PER_S
    g = costs[(costs.model == "gpt-oss-20b") & (costs["T"] == 1)]
    base, lora = g[g.op.isin(BASE_OPS)], g[g.op.isin(LORA_OPS)]
    all_lora = costs[costs.op.isin(LORA_OPS)]
    top = all_lora.loc[all_lora.intensity.idxmax()]
    ref = checks[checks.check == "reference_vs_loop"]
    route = checks[checks.check == "route_vs_reference"]
    return [
        f"{ridge:.0f} FLOP/byte",
        f"streams {base.bytes.sum() / 1e6:.0f} MB of expert weights (floor {base.floor_us.sum():.0f} µs",
        f"the four LoRA ops {lora.bytes.sum() / 1e6:.1f} MB (floor {lora.floor_us.sum():.1f} µs)",
        f"{top.intensity:.1f} FLOP/byte ({top.model} {top.op}, T = {top['T']})",
        f"within {ref.value.max():.1e} (max rel_err) over {len(ref)} cases",
        f"max |Δw| {route.value.max():.1e}",
        "compute-bound",
    ]


def test_nb01_gpu():
    costs, checks = _csv("01_op_costs.csv"), _csv("01_checks.csv")
    md = nb01.conclusion(costs, checks, profile="gpu")
    assert md.startswith("## Conclusion\n")
    assert not _missing(md, expected_nb01(costs, checks)), _missing(md, expected_nb01(costs, checks))


def test_nb01_cpu_frame():
    checks = _csv("01_checks.csv").assign(device="cpu")
    md = nb01.conclusion(_csv("01_op_costs.csv"), checks, profile="cpu")
    assert md.startswith("## Conclusion\n") and "device cpu" in md


def test_nb01_asserts_its_claims():
    checks = _csv("01_checks.csv")
    checks.loc[checks.check == "reference_vs_loop", "value"] = 1e-3
    with pytest.raises(AssertionError):
        nb01.conclusion(_csv("01_op_costs.csv"), checks, profile="gpu")


# ---- 02 -------------------------------------------------------------------------------------------------


def _as_anchor_graph(df: pd.DataFrame) -> pd.DataFrame:
    """(model, T) x part of the `as_anchor` graph-mode rows: us_p50 and floor_us, one value per cell."""
    d = df[(df.variant == "as_anchor") & (df["mode"] == "graph")]
    assert not d.duplicated(["model", "T", "part"]).any(), "several graph rows per (model, T, part)"
    return d.set_index(["model", "T", "part"])[["us_p50", "floor_us"]]


def expected_nb02(df: pd.DataFrame, checks: pd.DataFrame, anchors: pd.DataFrame) -> list[str]:
    g = _as_anchor_graph(df)
    us, floor = g.us_p50, g.floor_us
    out = [f"max rel_err {checks.rel_err.max():.1e} (tolerance {checks.tol.max():.1e}"]
    for m in dict.fromkeys(g.index.get_level_values("model")):
        t0 = int(g.loc[m].index.get_level_values("T").min())
        base, lora = us[(m, t0, "base")], us[(m, t0, "lora")]
        base_fl, lora_fl = floor[(m, t0, "base")], floor[(m, t0, "lora")]
        out += [
            f"- {m}: base {base:.1f} µs at T = {t0} ",
            f"{base / base_fl:.2f}× the {base_fl:.0f} µs weight-streaming floor",
            f"LoRA part {lora:.1f} µs against a byte floor of {lora_fl:.1f} µs",
        ]
    # the side-by-side table: one row per (model, T) that vLLM's figures cover, ratios vLLM ÷ ours
    side = []
    for a in anchors.itertuples():
        if (a.model, a.T, "total") not in us.index:
            continue
        b, lo, t = (us[(a.model, a.T, p)] for p in ("base", "lora", "total"))
        out.append(
            f"| {a.model} | {a.T} | {b:.1f} vs {a.base_us:.1f} ({a.base_us / b:.2f}×) | "
            f"{lo:.1f} vs {a.lora_best_us:.1f} ({a.lora_best_us / lo:.2f}×) | "
            f"{t:.1f} vs {a.total_best_us:.1f} ({a.total_best_us / t:.2f}×) |"
        )
        side.append((a.model, a.T, a.lora_best_us / lo))
    assert side, "no anchored (model, T): the side-by-side is not exercised"
    t_min = {m: min(T for mm, T, _ in side if mm == m) for m, _, _ in side}
    first = [x for m, T, x in side if T == t_min[m]]
    out.append(f"slower than vLLM's best ({min(first):.2f}–{max(first):.2f}×)")
    return out


@pytest.mark.parametrize("which", ["side_by_side", "moe_bench"])
def test_nb02_gpu(which):
    anchors = dict(_anchor_tables())[which]
    df, checks = _csv("02_naive_kernel.csv"), _csv("02_naive_checks.csv")
    md = nb02.conclusion(df, checks, profile="gpu", anchors=anchors)
    assert md.startswith("## Conclusion\n")
    assert "| model | T | base | LoRA part | whole layer |" in md and "| gpt-oss-20b | 1 |" in md
    missing = _missing(md, expected_nb02(df, checks, anchors))
    assert not missing, missing


def test_nb02_renders_the_measured_numbers():
    """A number changed in the CSV changes the Markdown (the test is not satisfied by stale text)."""
    df, checks = _csv("02_naive_kernel.csv"), _csv("02_naive_checks.csv")
    anchors = anchors_from_side_by_side()
    before = nb02.conclusion(df, checks, profile="gpu", anchors=anchors)
    sel = (df.model == "gpt-oss-20b") & (df["T"] == 1) & (df.part == "base") & (df["mode"] == "graph")
    df.loc[sel & (df.variant == "as_anchor"), "us_p50"] *= 1.5
    after = nb02.conclusion(df, checks, profile="gpu", anchors=anchors)
    assert after != before
    assert not _missing(after, expected_nb02(df, checks, anchors))
    assert _missing(before, expected_nb02(df, checks, anchors))


def test_nb02_cpu_frame():
    df = _csv("02_naive_kernel.csv").assign(mode="cpu-interpreter")
    checks = _csv("02_naive_checks.csv").assign(rel_err=1e-6, tol=1e-4, dtype="float32")
    md = nb02.conclusion(df, checks, profile="cpu", anchors=anchors_from_side_by_side())
    assert md.startswith("## Conclusion\n") and "GPU profile" in md and "Side by side" not in md


# ---- 03 -------------------------------------------------------------------------------------------------


def expected_nb03(rec: pd.DataFrame) -> list[str]:
    nv = rec[rec.stage == "naive"].sort_values("call_index")
    nr = rec[rec.stage == "no_recompile"].sort_values("call_index")
    grew = nv[nv.compiled_total.diff() > 0]["T"].tolist()
    out = [
        f"goes from {int(nv.compiled_total.iloc[0])} to {int(nv.compiled_total.iloc[-1])}, growing at "
        f"T = {_prose(int(t) for t in grew)}",
        f"holds {int(nr.compiled_total.iloc[-1])} binaries",
    ]
    for col in [c for c in rec.columns if c.startswith("compiled_") and c != "compiled_total"]:
        if (rec[col] == 0).all():  # a kernel neither stage launches (the fused stage's)
            continue
        k, sites, naive = col.removeprefix("compiled_"), int(nr[col].iloc[-1]), int(nv[col].iloc[-1])
        assert naive % sites == 0, (k, naive, sites)
        out.append(f"| `{k}` | {naive // sites} | {sites} | {naive} = {naive // sites} × {sites} |")
    return out


def test_nb03_gpu():
    rec = _csv("03_no_recompile.csv")
    md = nb03.conclusion(_csv("03_spec_keys.csv"), rec, profile="gpu")
    assert "launch sites" in md and "docs/perf_notes.md" in md
    missing = _missing(md, expected_nb03(rec))
    assert not missing, missing


def _new_key_lengths(keys: pd.DataFrame) -> list[int]:
    """The lengths at which `naive` meets a (kernel, key) it has not seen at a smaller length."""
    naive, seen, new = keys[keys.stage == "naive"], set(), []
    for T, d in naive.groupby("T"):
        here = set(zip(d.kernel, d.key))
        if here - seen:
            new.append(int(T))
        seen |= here
    return new


def test_nb03_cpu_frame():
    keys = _csv("03_spec_keys.csv")
    md = nb03.conclusion(keys, None, profile="cpu")
    assert md.startswith("## Conclusion\n") and "compiles nothing" in md
    assert f"new keys first appear at T = {_prose(_new_key_lengths(keys))} " in md


def test_nb03_idle_kernel_column():
    """A kernel column neither stage launches reads zero and is left out; one that compiled fails."""
    rec = _csv("03_no_recompile.csv")
    rec["compiled_not_launched"] = 0
    md = nb03.conclusion(_csv("03_spec_keys.csv"), rec, profile="gpu")
    assert "`not_launched`" not in md
    rec.loc[rec.index[-1], "compiled_not_launched"] = 1
    with pytest.raises(AssertionError, match="not_launched compiled"):
        nb03.conclusion(_csv("03_spec_keys.csv"), rec, profile="gpu")


def test_nb03_mismatch_fails():
    rec = _csv("03_no_recompile.csv")
    rec.loc[rec.stage == "naive", "compiled_lora_shrink"] += 1
    with pytest.raises(AssertionError):
        nb03.conclusion(_csv("03_spec_keys.csv"), rec, profile="gpu")


# ---- 04 -------------------------------------------------------------------------------------------------


def expected_nb04(df: pd.DataFrame) -> list[str]:
    ops = df[df.part.isin(SHRINK_OPS)]
    us = df.groupby(["model", "T", "part", "split_k"]).us_p50.mean()
    default = ops.groupby(["model", "T", "part"]).default_value.first()
    t_lo, t_hi = int(df["T"].min()), int(df["T"].max())
    out = [f"max err_vs_1 = {ops.err_vs_1.max():.1e} over {len(ops)} op runs"]
    lo_sp = {}
    for (m, T, part), s in us.groupby(level=["model", "T", "part"]):
        s = s.droplevel(["model", "T", "part"]).sort_index()
        k, sp = int(s.idxmin()), s.loc[1] / s.min()
        if part in SHRINK_OPS:
            d = int(default[(m, T, part)])  # the stage default as an int ("16", not "16.0")
            out.append(
                f"| {m} | {T} | {part} | {s.loc[1]:.1f} | {s.min():.1f} at {k} | {sp:.2f}× | "
                f"{d} ({s.loc[d]:.1f} µs) |"
            )
            if T == t_lo:
                lo_sp[(m, part)] = (sp, k)
        elif part == "lora" and T == t_lo:
            out.append(f"{m} {s.loc[1]:.1f} → {s.min():.1f} µs at T = {t_lo} ({sp:.2f}×)")
    best, best_k = max(lo_sp.values())
    lo = [v for v, _ in lo_sp.values()]
    out += [
        f"at T = {t_lo} every shrink is faster with SPLIT_K > 1 ({min(lo):.2f}–{max(lo):.2f}×)",
        f"the best is {best:.2f}× at SPLIT_K = {best_k}",
        f"At T = {t_hi} (the GPU already full)",
    ]
    return out


def test_nb04_gpu():
    df = _csv("04_split_k.csv")
    md = nb04.conclusion(df, profile="gpu")
    assert "| model | T | op | SPLIT_K = 1 | best | speed-up | stage default |" in md
    missing = _missing(md, expected_nb04(df))
    assert not missing, missing


def test_nb04_cpu_frame():
    df = _csv("04_split_k.csv")
    df = df[df.split_k.isin([1, 2, 4]) & df["T"].isin([1, 8])].assign(mode="cpu-interpreter")
    md = nb04.conclusion(df, profile="cpu")
    assert md.startswith("## Conclusion\n") and "GPU profile" in md and "| gpt-oss-20b" not in md
