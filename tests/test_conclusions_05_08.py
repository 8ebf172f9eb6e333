"""The written conclusions of notebooks 05–08, rendered from the committed GPU CSVs in data/ (CPU only).

Each ``conclusion(...)`` asserts the claims it states; rendering it from the H200 evidence with
``profile="gpu"`` checks that those asserts hold on the committed run. The numbers the Markdown must carry
are recomputed here from the same CSVs with plain pandas (not with the conclusion modules' helpers) and
formatted as the conclusions format them: a re-measured ``data/`` needs no edit here, a conclusion that
renders a wrong number still fails.
"""

import math
from pathlib import Path

import pandas as pd
import pytest

from moelora_lib.studies.conclusions import nb05, nb06, nb07, nb08

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


def _csv(name: str) -> pd.DataFrame:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"data/{name} not in this checkout")
    return pd.read_csv(path)


def _missing(md: str, expected) -> list[str]:
    return [s for s in expected if s not in md]


def _range(s) -> str:
    return f"{min(s):.2f}–{max(s):.2f}×"


def _gmean(values) -> float:
    v = [float(x) for x in values if math.isfinite(float(x)) and float(x) > 0]
    return math.exp(sum(map(math.log, v)) / len(v))


def _vs_vllm(ours: pd.DataFrame, anchors: pd.DataFrame) -> pd.DataFrame:
    """``ours`` (model, T) x part (µs) joined with vLLM's figures; ``<part>_x`` = vLLM ÷ ours."""
    t = ours.reset_index().merge(anchors, on=["model", "T"])
    t["lora_x"] = t.lora_best_us / t.lora
    t["total_x"] = t.total_best_us / t.total
    assert len(t), "no anchored (model, T): the comparison with vLLM is not exercised"
    return t


@pytest.fixture(scope="module")
def anchors() -> pd.DataFrame:
    """vLLM's current H200 figures (docs/anchors-h200.md), as the notebooks get them."""
    from moelora_lib.studies import moe_bench as mb

    return mb.anchor_table()


def test_anchor_fixture_matches_docs(anchors):
    # docs/anchors-h200.md, GPT-OSS-20B T = 1: vLLM LoRA best 30.3 µs, whole layer 100.0 µs
    row = anchors[(anchors.model == "gpt-oss-20b") & (anchors["T"] == 1)].iloc[0]
    assert row.lora_best_us == pytest.approx(30.3, abs=0.1)
    assert row.total_best_us == pytest.approx(100.0, abs=0.1)
    assert len(anchors) == 12


# ---- 05 -------------------------------------------------------------------------------------------------


def test_nb05_conclusion_gpu():
    df, ncu = _csv("05_swizzle.csv"), _csv("05_ncu_l2.csv")
    md = nb05.conclusion(df, ncu, profile="gpu")
    assert md.startswith("## Conclusion")
    ops = df[df.part.isin(["gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand"])]
    expected = [
        "Decode sizes (held)",
        f"**T = {int(df['T'].max())} (",
        f"output is {ops.err_vs_1.max():.1e}",
        "L2 hit rate",
        "unchanged",
    ]
    ok = ncu[ncu.ok.astype(bool)]
    for (m, T), d in ok.groupby(["model", "T"]):
        rates = d.sort_values("group_size_m").l2_hit_pct
        expected.append(f"{m} T = {T}: " + " vs ".join(f"{x:.1f} %" for x in rates))
    missing = _missing(md, expected)
    assert not missing, missing


def test_nb05_conclusion_cpu_states_no_timing():
    md = nb05.conclusion(_csv("05_swizzle.csv"), None, profile="cpu")
    assert "needs the GPU profile" in md and "Decode sizes" not in md


# ---- 06 -------------------------------------------------------------------------------------------------


def expected_nb06(df: pd.DataFrame, checks: pd.DataFrame, anchors: pd.DataFrame) -> list[str]:
    final, prev = nb06.FINAL, nb06.PREVIOUS
    ref = checks[checks.check == "layer_vs_reference"]
    twice = checks[checks.check == "fused_add_twice"]
    out = [
        f"(worst {ref.rel_err.max():.1e}, tolerance {ref.tol.max():g})",
        f"adds the same delta again (worst {twice.rel_err.max():.1e})",
    ]
    d = df[df.variant == "as_anchor"]
    lora = d[d.part == "lora"].groupby(["model", "pattern", "T", "stage"]).us_p50.mean()
    gain = lora.xs(prev, level="stage") / lora.xs(final, level="stage")
    big = int(gain.index.get_level_values("T").max())
    g_big = gain[gain.index.get_level_values("T") == big]
    out.append(f"At T = {big} the LoRA part is {g_big.min():.2f}–{g_big.max():.2f}× faster")
    s = lora.loc[("gpt-oss-20b", "uniform", big)]
    out.append(f"{s[prev]:.0f} → {s[final]:.0f} µs, −{(s[prev] - s[final]) / 1e3:.2f} ms")
    slower = gain[gain < 1 / nb06.PARITY[1]]
    if len(slower):
        out.append("'Every T' (did not hold)")
        out += [f"{m} {p} T = {T} ({1 / x:.2f}× slower)" for (m, p, T), x in slower.items()]
    else:
        out.append("'Every T' (held)")
    naive_x = lora.xs("naive", level="stage") / lora.xs(final, level="stage")
    out.append(f"(LoRA part):** {naive_x.min():.2f}–{naive_x.max():.2f}× over all models")
    ours = d[(d.stage == final) & (d.pattern == "uniform")].groupby(["model", "T", "part"]).us_p50.mean()
    t = _vs_vllm(ours.unstack("part"), anchors)
    out += [
        f"**LoRA part vs vLLM's best LoRA path (stage `{final}`",
        f"{_range(t.lora_x)} (vLLM ÷ ours)",
        "**Whole layer vs vLLM's whole layer",
        f"uniform ids):** {_range(t.total_x)}; faster",
        f"{'met' if (t.lora_x > 1).all() else 'not met'} for the LoRA part and "
        f"{'met' if (t.total_x > 1).all() else 'not met'} for the whole layer",
    ]
    return out


def test_nb06_conclusion_gpu(anchors):
    df, checks = _csv("06_even_k_fused_add.csv"), _csv("06_checks.csv")
    md = nb06.conclusion(df, checks, profile="gpu", anchors=anchors)
    assert "Correctness (held)" in md and "Fused add at large T (held)" in md
    missing = _missing(md, expected_nb06(df, checks, anchors))
    assert not missing, missing


def test_nb06_renders_the_measured_numbers(anchors):
    """A changed time in the CSV changes the Markdown, and the expectation follows it."""
    df, checks = _csv("06_even_k_fused_add.csv"), _csv("06_checks.csv")
    before = nb06.conclusion(df, checks, profile="gpu", anchors=anchors)
    sel = (df.stage == nb06.PREVIOUS) & (df.part == "lora") & (df["T"] == df["T"].max())
    df.loc[sel & (df.model == "gpt-oss-20b") & (df.pattern == "uniform"), "us_p50"] *= 1.1
    after = nb06.conclusion(df, checks, profile="gpu", anchors=anchors)
    assert not _missing(after, expected_nb06(df, checks, anchors))
    assert _missing(before, expected_nb06(df, checks, anchors))


# ---- 07 -------------------------------------------------------------------------------------------------


def expected_nb07(df: pd.DataFrame, cumulative: pd.DataFrame, anchors: pd.DataFrame) -> list[str]:
    us = df.groupby(["stage", "model", "T", "part"]).us_p50.mean()
    tuned, default = us.loc["tuned"].unstack("part"), us.loc["even_k_fused_add"].unstack("part")
    sp = default / tuned
    v = _vs_vllm(tuned, anchors)
    c = cumulative
    x = c["naive"] / c["tuned"]
    out = [
        f"at all {len(sp)} (model, T) points",
        f"**LoRA part: predicted 1.0–1.3×, measured {_range(sp.lora)}**",
        f"Whole layer {_range(sp.total)}: it follows the base",
        f"LoRA part {_range(x[c.part == 'lora'])}, whole layer {_range(x[c.part == 'total'])} faster than "
        "the naive kernels",
        f"the LoRA part is {_range(v.lora_x)} vLLM's speed, the whole layer {_range(v.total_x)} "
        f"(median {v.total_x.median():.2f}×)",
        "data/07_cumulative.csv",
    ]
    if not (v.total_x > 1.05).all():
        out.append("near parity, not faster at every T")
    return out


def test_nb07_conclusion_gpu(anchors):
    df, cumulative = _csv("07_tuning.csv"), _csv("07_cumulative.csv")
    md = nb07.conclusion(df, _csv("07_tuning_trials.csv"), cumulative, profile="gpu", anchors=anchors)
    assert "Never slower than the defaults (held)" in md
    missing = _missing(md, expected_nb07(df, cumulative, anchors))
    assert not missing, missing


def test_nb07_conclusion_cpu_without_anchors():
    md = nb07.conclusion(
        _csv("07_tuning.csv"), _csv("07_tuning_trials.csv"), None, profile="cpu", anchors=None
    )
    assert "need the GPU profile" in md


# ---- 08 -------------------------------------------------------------------------------------------------


def expected_nb08(df: pd.DataFrame, bounds: pd.DataFrame, targets: pd.DataFrame) -> list[str]:
    df = df.rename(columns={"timing_mode": "mode"})
    key = ["model", "proj", "epilogue", "dtype", "M", "mode"]
    ms = df.groupby([*key, "impl"]).ms_p50.first().unstack("impl")
    ms = ms.reset_index()
    ms["speedup"] = ms.torch / ms.helion
    geo = {}
    for mode in ("graph", "graph_clean", "graph_rotate"):
        m = ms[ms["mode"] == mode]
        plain = m[m.epilogue == "none"]
        geo[mode] = dict(
            decode=plain[plain.M <= 32].speedup,
            prefill=plain[plain.M >= 256].speedup,
            swiglu=m[m.epilogue == "swiglu"].speedup,
        )
    geo = {mode: g for mode, g in geo.items() if len(g["decode"])}
    assert geo, "no graph-mode decode rows"

    def per_mode(part: str) -> str:
        return " / ".join(f"{_gmean(g[part]):.3f}× ({mode})" for mode, g in geo.items() if len(g[part]))

    out = [
        f"measured geomean {per_mode('decode')}**",
        f"measured {per_mode('prefill')}** — missed",
        f"measured {per_mode('swiglu')}**",
        f"All {len(df)} outputs",
    ]
    b = bounds.rename(columns={"timing_mode": "mode"})
    clean = b[(b["mode"] == "graph_clean") & (b.epilogue == "none") & (b.M <= 32)]
    out.append(f"{_gmean(clean.est_speedup):.2f}× with one graph launch")
    met = targets.met.astype(str).str.lower().eq("true")
    out.append(f"**Targets (08_targets.csv): {int(met.sum())} of {len(targets)} met**")
    return out


def test_nb08_conclusion_gpu():
    df, bounds, targets = _csv("08_helion_linear.csv"), _csv("08_bounds.csv"), _csv("08_targets.csv")
    md = nb08.conclusion(df, bounds, targets, profile="gpu")
    missing = _missing(md, expected_nb08(df, bounds, targets))
    assert not missing, missing


def test_nb08_accepts_either_timing_column_name():
    df = _csv("08_helion_linear.csv")
    renamed = df.rename(columns={"timing_mode": "mode"}) if "timing_mode" in df else df
    old = renamed.rename(columns={"mode": "timing_mode"})
    assert nb08.conclusion(renamed, profile="gpu") == nb08.conclusion(old, profile="gpu")


def test_nb08_bounds_and_targets_reproduce_the_committed_tables():
    from moelora_lib.studies import helion_study as study

    ceil = pd.read_json(DATA / "08_ceilings.json", typ="series").to_dict()
    df = _csv("08_helion_linear.csv")
    try:  # the timing column is `mode`; a CSV written before the rename calls it `timing_mode`
        s = study.summary(nb08.normalize(df))
    except KeyError:
        s = study.summary(df)
    bb, tt = nb08.bounds_and_targets(s, ceil)
    committed = nb08.normalize(_csv("08_targets.csv"))
    merged = tt.merge(committed, on=["mode", "target"], suffixes=("", "_committed"))
    assert len(merged) == len(committed)
    assert (merged.measured - merged.measured_committed).abs().max() < 1e-9


def test_nb08_eager_prediction_reported_not_asserted():
    # the eager ratio times the host's Python dispatch: 6c00f8f's run measured Helion slower (held),
    # f26749d's run (data/dev/08_failed_f26749d) 1.02x, which the old assertion turned into a failed notebook
    failed = DATA / "dev" / "08_failed_f26749d"
    if not failed.is_dir():
        pytest.skip("data/dev/08_failed_f26749d not in this checkout")
    df = pd.read_csv(failed / "08_helion_linear.csv")
    md = nb08.conclusion(
        df, pd.read_csv(failed / "08_bounds.csv"), pd.read_csv(failed / "08_targets.csv"), profile="gpu"
    )
    assert "measured 1.02× at decode** — not held in this run" in md
    held = nb08.conclusion(
        _csv("08_helion_linear.csv"), _csv("08_bounds.csv"), _csv("08_targets.csv"), profile="gpu"
    )
    assert "at decode** — held: serve Helion only under CUDA-graph replay" in held
