"""Conclusion of notebook 10 (dense multi-LoRA for attention and dense-MLP projections)."""

from __future__ import annotations

import math

import pandas as pd

from .. import dense_bench as db

__all__ = ["conclusion", "predicted_met", "FINAL", "FLOOR_SANITY"]

FINAL = "tuned"
#: A LoRA part measured below this fraction of its bytes/FLOPs floor would mean skipped work (the L2 is
#: flushed before every repetition); asserted never to happen.
FLOOR_SANITY = 0.5
#: An earlier stage counts as faster than the final one below this fraction of its time (run-to-run noise).
NOISE = 0.95
_ORDER = {"qkv": 0, "o": 1, "gate_up": 2, "down": 3}


def predicted_met(target: str, model: str, proj: str, T: int) -> bool:
    """The verdict cell 1 of the notebook predicted for ``target`` (a :data:`~moelora_lib.studies.
    dense_bench.TARGETS` name) at one point, written before any GPU run from vLLM's figures
    (data/anchors/vllm_dense_lora_h200.csv) and the bytes floors (:func:`~moelora_lib.studies.
    dense_bench.part_costs`)."""
    attention = proj in ("qkv", "o")
    if target == "vs_vllm_small_T":  # vLLM's qkv (T ≥ 8) and gate_up LoRA cost 34–130 µs; o/down 14–28
        return proj == "gate_up" or (proj == "qkv" and T >= 8)
    if target == "vs_vllm_large_T":
        return True
    if target == "share_of_base_small_T":  # two launches cost ≥ ~8 µs: only the big bases leave room
        return proj == "gate_up" or (model == "llama-3.3-70b" and proj == "down")
    if target == "share_of_base_large_T":  # the floor alone: qkv 6–22 %, o 6–17 %, gate_up 4–7 %, down 3–5 %
        return proj == "down" or (proj == "gate_up" and model == "llama-3.3-70b")
    if target == "vs_torch":  # the loop is launch-bound up to T = 256 (1600 for attention widths)
        return T <= 256 or (T == 1600 and attention)
    raise ValueError(f"unknown target {target!r}")


def _gmean(values) -> float:
    v = [float(x) for x in values if math.isfinite(float(x)) and float(x) > 0]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")


def _pt(model: str, proj: str, T) -> str:
    return f"{model}/{proj} T = {int(T)}"


def _list(items: list[str], limit: int = 24) -> str:
    if not items:
        return "none"
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _range(s, fmt: str = ".2f", unit: str = "×") -> str:
    return f"{s.min():{fmt}}–{s.max():{fmt}}{unit}" if len(s) else "n/a"


def _sorted(d, cols=("model", "proj", "T")):
    d = d.assign(_o=d.proj.map(_ORDER).fillna(9))
    return d.sort_values(["model", "_o", "T"]).drop(columns="_o")


def _by_proj(g, fmt=None, unit: str = "") -> list[str]:
    """``model/proj T = a/b/c (v1/v2/v3 unit)`` per projection of the rows ``g`` (model, proj, T, value)."""
    items = []
    for (m, p), h in _sorted(g).groupby(["model", "proj"], sort=False):
        ts = "/".join(str(int(t)) for t in h["T"])
        vals = f" ({'/'.join(fmt(v) for v in h.value)}{unit})" if fmt else ""
        items.append(f"{m}/{p} T = {ts}{vals}")
    return items


def _check_paragraph(checks) -> str:
    assert len(checks), "no correctness rows"
    bad = checks[checks.rel_err > checks.tol]
    assert bad.empty, bad
    assert checks.no_adapter_bitwise.astype(bool).all(), checks[~checks.no_adapter_bitwise.astype(bool)]
    assert (checks.delta_rel > 0.01).all(), "a LoRA delta vanished (delta_rel <= 0.01)"
    impls = list(dict.fromkeys(checks.impl))
    n_pts = checks.groupby(["model", "proj", "T"]).ngroups
    worst = checks.loc[checks.rel_err.idxmax()]
    return (
        f"**Correctness (held).** {len(checks)} checks — the LoRA part of every stage timed, the "
        f"`LoRALinear` forward (alignment included) and both torch baselines ({', '.join(impls)}) at "
        f"{n_pts} (projection, T) points of {checks.model.nunique()} model(s), "
        f"{', '.join(sorted(set(checks.dtype)))} — are within the tolerance against the "
        f"`lora_linear_reference` (worst rel_err {worst.rel_err:.1e} for {worst.impl} at "
        f"{_pt(worst.model, worst.proj, worst['T'])}, tolerance {checks.tol.max():g}); the LoRA "
        f"contribution is {_range(checks.delta_rel, '.2f', '')} of the output (so a passing check is not a "
        f"LoRA that was never added); rows of tokens without an adapter "
        f"({int(checks.no_adapter_rows.max())} of the largest batch) equal `F.linear`'s bit for bit "
        "in every implementation."
    )


def conclusion(df, checks, targets, *, profile: str, anchors=None, stages=None, final: str = FINAL) -> str:
    """The written conclusion of notebook 10.

    Args:
        df: ``10_dense_lora.csv`` — the rows of :func:`~moelora_lib.studies.dense_bench.bench_projection`
            (parts base, lora, total), :func:`~moelora_lib.studies.dense_bench.bench_baselines` (impl
            torch_loop / torch_gbmm, part lora), :func:`~moelora_lib.studies.dense_bench.bench_kernels`
            (parts shrink, expand) and :func:`~moelora_lib.studies.dense_bench.bench_alignment` (part
            align).
        checks: ``10_checks.csv`` — :func:`~moelora_lib.studies.dense_bench.check_projection` rows.
        targets: ``10_targets.csv`` — :func:`~moelora_lib.studies.dense_bench.targets_table` as the
            notebook wrote it (empty on the CPU profile).
        profile: "gpu" or "cpu" (cpu: correctness only, no timing claim).
        anchors: :func:`~moelora_lib.studies.dense_bench.anchor_table` (GPU).
        stages: the stages timed, in order (default: the stages of the lora rows, in file order);
            ``final`` the one the targets are checked on.

    Asserts: every check within its tolerance, rows without an adapter bitwise the base, a LoRA delta
    present. GPU: every (projection, T) has the base, the LoRA part of every stage and the final
    stage's total (captured in one CUDA graph with the alignment); no LoRA part below
    ``FLOOR_SANITY`` × its floor; every projection anchored; the targets CSV is what the rows give
    (recomputed here). Whether each target is met is computed, never assumed.

    Returns:
        Markdown: which predictions of cell 1 held, which did not, with the per-kernel numbers.
    """
    out = ["## Conclusion", _check_paragraph(checks)]
    if profile != "gpu":
        out.append(
            "**Timing: not concluded on this profile.** The tables and figures time the Triton interpreter "
            "on the tiny shapes (µs of interpreter wall clock, not kernel performance). The stage table, "
            "the comparison with vLLM's figures and the targets need the GPU profile."
        )
        return "\n\n".join(out)

    # --- completeness -------------------------------------------------------------------------------
    lora = df[(df.part == "lora") & df.stage.notna()]
    if stages is None:
        stages = list(dict.fromkeys(lora.stage))
    assert final in stages, f"final stage {final!r} not among the timed stages {stages}"
    key = ["model", "proj", "T"]
    points = df[df.part == "base"][key].drop_duplicates()
    assert len(points), "no base rows"
    for st in stages:
        have = lora[lora.stage == st][key].drop_duplicates()
        assert len(have) == len(points), f"stage {st}: LoRA part at {len(have)} of {len(points)} points"
    tot = df[(df.part == "total") & (df.stage == final)]
    assert len(tot[key].drop_duplicates()) == len(points), "final total missing at some points"
    assert (tot["mode"] == "graph").all(), "a total was not replayed as a CUDA graph"
    low = lora[lora.us_p50 < FLOOR_SANITY * lora.floor_us]
    assert low.empty, (
        f"LoRA parts below {FLOOR_SANITY} x their floor (skipped work?):\n{low[key + ['us_p50']]}"
    )

    summ = db.summary_table(df, anchors, final=final)
    anchored_t = summ["T"].isin(set(anchors["T"]))
    assert summ.vllm_lora[anchored_t].notna().all(), "a projection has no vLLM anchor at an anchored T"
    assert anchored_t.any(), "no (projection, T) of the run is in vLLM's anchor table"
    rec = db.targets_table(summ)
    if targets is None or len(targets) == 0:
        raise AssertionError("the targets table is empty on the GPU profile")
    mine = rec.set_index(["target", *key]).met.astype(bool).sort_index()
    theirs = targets.set_index(["target", *key]).met.astype(bool).sort_index()
    assert mine.index.equals(theirs.index) and (mine == theirs).all(), "targets CSV differs from the rows"

    # --- stages ---------------------------------------------------------------------------------------
    first = stages[0]
    lines = []
    for st in stages[1:]:
        x = summ[f"lora_{first}"] / summ[f"lora_{st}"]
        small, large = x[summ["T"] <= 64], x[summ["T"] >= 1600]
        lines.append(
            f"`{st}` {_gmean(x):.2f}× (T ≤ 64: {_gmean(small):.2f}×, T ≥ 1600: {_gmean(large):.2f}×; "
            f"range {_range(x)})"
        )
    step = None
    if len(stages) > 1:
        g2 = summ[f"lora_{first}"] / summ[f"lora_{stages[1]}"]
        b = summ.loc[g2.idxmax()]
        step = (
            f" The largest `{first}` → `{stages[1]}` step: {_pt(b.model, b.proj, b['T'])} "
            f"({b[f'lora_{first}']:.1f} → {b[f'lora_{stages[1]}']:.1f} µs, {g2.max():.1f}×)."
        )
    fastest = summ[[f"lora_{st}" for st in stages]].idxmin(axis=1).str.removeprefix("lora_")
    beaten = (fastest != final) & (summ[[f"lora_{st}" for st in stages]].min(axis=1) < NOISE * summ["lora"])
    not_final, fastest = summ[beaten], fastest[beaten]
    slow_txt = _list(
        [
            f"{_pt(r.model, r.proj, r['T'])} (`{f}` {r[f'lora_{f}']:.1f} vs {r['lora']:.1f} µs)"
            for (_, r), f in zip(not_final.iterrows(), fastest)
        ]
    )
    fin_rows = lora[lora.stage == final]
    sources = sorted(set(fin_rows.config_source.dropna().astype(str)))
    tuned_found = [s for s in sources if s != "default"]
    src_txt = (
        f"configs from {', '.join(tuned_found)} at "
        f"{int((fin_rows.config_source.astype(str) != 'default').sum())} of {len(fin_rows)} points"
        if tuned_found
        else "the default configs everywhere (no tuned dense configs were found)"
    )
    out.append(
        f"**Stages (LoRA part, geometric mean of `{first}` ÷ stage over {len(summ)} points).** "
        + "; ".join(lines)
        + "."
        + (step or "")
        + f" `{final}` launched {src_txt}. Points where an earlier stage was faster than `{final}` by more "
        f"than {(1 - NOISE) * 100:.0f} %: " + f"{slow_txt}."
    )

    # --- targets --------------------------------------------------------------------------------------
    tg = rec.copy()
    tg["predicted"] = [predicted_met(t, m, p, T) for t, m, p, T in zip(tg.target, tg.model, tg.proj, tg["T"])]
    desc = {
        "vs_vllm_small_T": "LoRA part ≥ 3× faster than vLLM's at T ≤ 64",
        "vs_vllm_large_T": "≥ 1.5× faster than vLLM's at T ≥ 1600",
        "share_of_base_small_T": "≤ 15 % of the base at T ≤ 64",
        "share_of_base_large_T": "≤ 8 % of the base at T ≥ 1600",
        "vs_torch": "≥ 3× faster than the faster torch baseline at T ≥ 64",
    }
    tl = []
    for name, g in tg.groupby("target", sort=False):
        g = _sorted(g)
        unit = "" if db.TARGETS[name]["kind"] == "speedup" else " of the base"
        vals = g.value * (100 if db.TARGETS[name]["kind"] == "share" else 1)
        vr = _range(vals, ".1f", " %") if db.TARGETS[name]["kind"] == "share" else _range(vals, ".2f", "×")
        share_kind = db.TARGETS[name]["kind"] == "share"
        missed = _by_proj(
            g[~g.met],
            (lambda v: f"{v * 100:.1f}") if share_kind else (lambda v: f"{v:.2f}"),
            " %" if share_kind else "×",
        )
        surprise_met = _by_proj(g[g.met & ~g.predicted])
        surprise_missed = _by_proj(g[~g.met & g.predicted])
        n_miss = int((~g.met).sum())
        tl.append(
            f"- **{desc[name]}:** {'all met' if n_miss == 0 else '**not met**'} — missed at {n_miss} of "
            f"{len(g)} points ({len(g) - n_miss} met); value {vr}{unit}. Missed: {_list(missed)}. "
            f"Prediction held at {int((g.met == g.predicted).sum())} of {len(g)}; met though predicted "
            f"missed: {_list(surprise_met)}; missed though predicted met: {_list(surprise_missed)}."
        )
    x_v = summ.x_vllm.where(anchored_t)
    x_t = summ.x_torch.dropna()
    share = summ.share * 100
    vshare = summ.vllm_share * 100
    out.append(
        f"**Against vLLM's figures (same method; vLLM ÷ ours, `{final}`):** {_range(x_v)} over "
        f"{int(x_v.notna().sum())} anchored points ({_range(x_v[summ['T'] <= 64])} at T ≤ 64, "
        f"{_range(x_v[summ['T'] >= 1600])} at T ≥ 1600). LoRA part as a share of our base: "
        f"{_range(share, '.1f', ' %')} (vLLM's of its base: {_range(vshare, '.1f', ' %')}). Against the "
        f"faster torch baseline (torch ÷ ours, where timed): {_range(x_t)}. The targets, point by point "
        "(`10_targets.csv`):\n" + "\n".join(tl)
    )

    # --- per kernel ----------------------------------------------------------------------------------
    k = df[df.part.isin(["shrink", "expand"]) & (df.stage == final)]
    if len(k):
        kp = k.pivot_table(index=key, columns="part", values=["us_p50", "floor_us"])
        kp.columns = [f"{part}_{v}" for v, part in kp.columns]
        kp = _sorted(kp.reset_index())
        a = anchors.set_index(key)[["shrink_us", "expand_us"]]
        kl = []
        for _, r in kp.iterrows():
            pt = (r.model, r.proj, r["T"])
            vtxt = f"; vLLM {a.loc[pt].shrink_us:.1f} + {a.loc[pt].expand_us:.1f}" if pt in a.index else ""
            kl.append(
                f"{_pt(*pt)}: shrink {r.shrink_us_p50:.1f} + expand {r.expand_us_p50:.1f} µs (floors "
                f"{r.shrink_floor_us:.1f} + {r.expand_floor_us:.1f}{vtxt})"
            )
        t_lo, t_hi = kp["T"].min(), kp["T"].max()
        lo, hi = kp[kp["T"] == t_lo], kp[kp["T"] == t_hi]
        one = pd.concat([lo.shrink_us_p50, lo.expand_us_p50])
        one_floor = pd.concat([lo.shrink_floor_us, lo.expand_floor_us])
        exp_big = hi[hi.expand_us_p50 >= hi.shrink_us_p50]
        shr_big = hi[hi.expand_us_p50 < hi.shrink_us_p50]
        ramp = (
            ": the launch ramp, not the bytes, sets the time there" if one.min() > 3 * one_floor.max() else ""
        )
        exp_txt = _list([f"{m}/{p}" for m, p in zip(exp_big.model, exp_big.proj)])
        shr_txt = _list([f"{m}/{p}" for m, p in zip(shr_big.model, shr_big.proj)])
        out.append(
            f"**Per kernel (`{final}`, each launch replayed alone, L2 flushed).** At T = {int(t_lo)} one "
            f"launch costs {_range(one, '.1f', ' µs')} against floors of at most {one_floor.max():.1f} µs"
            f"{ramp}. At T = {int(t_hi)} the expand (its read-modify-write of the T × N output) is the "
            f"larger launch for {exp_txt}, the shrink (x read once per column tile of S·R) for {shr_txt}; "
            "launch ÷ "
            f"floor there: shrink {_range(hi.shrink_us_p50 / hi.shrink_floor_us)}, expand "
            f"{_range(hi.expand_us_p50 / hi.expand_floor_us)}.\n" + "\n".join(f"- {x}" for x in kl)
        )

    # --- alignment / total ----------------------------------------------------------------------------
    over = (summ.total - summ.base - summ.lora).dropna()
    al = df[df.part == "align"]
    al_txt = (
        f" The alignment alone: {_range(al.us_p50, '.1f', ' µs')} (T = {int(al['T'].min())}–"
        f"{int(al['T'].max())})."
        if len(al)
        else ""
    )
    out.append(
        f"**Token→adapter grouping inside the CUDA graph (held).** The `{final}` total — `F.linear`, the "
        "Triton alignment and both LoRA launches through `LoRALinear` — was captured and replayed as one "
        f"graph at all {len(tot)} points, no host sync; it costs {_range(over, '.1f', ' µs')} over base + "
        f"LoRA part (alignment and launch gaps).{al_txt} vLLM's figures exclude its metadata step "
        f"({_range(anchors.meta_us.dropna(), '.0f', ' µs')} per batch, eager, outside any graph)."
    )
    return "\n\n".join(out)
