"""Conclusion of notebook 12 (stage ``fused``: the LoRA expand and the activation inside the base GEMMs).

Asserts data sanity only (rows present and finite, the checks within their tolerance, the targets CSV equal
to what the timing rows and vLLM's figures give); whether a target or a prediction is met is computed and
reported, never asserted.
"""

from __future__ import annotations

import math

import pandas as pd

from .. import fused_bench as fb

__all__ = [
    "conclusion",
    "FINAL",
    "BASELINE",
    "PREDICTED_TOTAL_US",
    "TUNED_BEFORE_US",
    "PREDICTED_LAUNCHES",
    "PREDICTED_PREFILL_EXTRA_US",
    "DELTA_MIN",
    "LEVER_PREDICTIONS",
]

FINAL, BASELINE = fb.STAGE, fb.BASELINE
#: Parts each stage is timed in (``fused`` has no separable LoRA part).
PARTS = {FINAL: ("base", "total"), BASELINE: ("base", "lora", "total")}
#: A LoRA contribution smaller than this (relative to the output) would make the check vacuous.
DELTA_MIN = 0.01

#: kernels/fused.py's predictions of the whole layer (µs, written before any GPU run): the T = 1 ranges as
#: given, the "~" values of T = 64 and T = 1600 with ±5 %.
PREDICTED_TOTAL_US: dict[tuple[str, int], tuple[float, float]] = {
    ("gpt-oss-20b", 1): (80.0, 85.0),
    ("qwen3-30b-a3b", 1): (45.0, 50.0),
    ("gpt-oss-20b", 64): (399.0, 441.0),
    ("qwen3-30b-a3b", 64): (332.5, 367.5),
    ("gpt-oss-20b", 1600): (902.5, 997.5),
    ("qwen3-30b-a3b", 1600): (570.0, 630.0),
}
#: The ``tuned`` layer the predictions started from (µs; notebook 07's run, quoted in kernels/fused.py).
TUNED_BEFORE_US: dict[tuple[str, int], float] = {
    ("gpt-oss-20b", 1): 94.4,
    ("qwen3-30b-a3b", 1): 58.2,
    ("gpt-oss-20b", 64): 478.0,
    ("qwen3-30b-a3b", 64): 408.0,
    ("gpt-oss-20b", 1600): 1056.0,
    ("qwen3-30b-a3b", 1600): 684.0,
}
#: Launches per layer predicted (routing, alignment and split-K memsets aside; the top-k sum included).
PREDICTED_LAUNCHES = {BASELINE: 8, FINAL: 5}
#: The extra MMA work of the per-adapter masked dots at T = 1600 (µs, gate_up and down), where compute-bound.
PREDICTED_PREFILL_EXTRA_US = {"gpt-oss-20b": (47.0, 27.0), "qwen3-30b-a3b": (32.0, 52.0)}

#: The second round's predictions (written 2026-12-02 before its GPU run; fused.py's module docstring says
#: why). Ratios of this run's rows (:func:`moelora_lib.studies.fused_bench.levers_table`):
#: * configs: the fused GEMMs tuned (pair order) against ``tuned``'s base part, every point:
#:   pair_base ÷ tuned_base in [0.90, 1.05] (the activation launch gone, the GEMMs tuned over a list
#:   like the base GEMMs');
#: * order_prefill: the adapter order cuts the LoRA part (whole − base) at T ≥ 1600 to ≤ 0.5× the pair
#:   order's (1–2 adapters per tile instead of ~8: fewer serial passes of the per-adapter loop);
#: * order_decode: no effect at T ≤ 64 (one or a few rows per expert tile either way): the whole
#:   layers within ±3 %;
#: * deterministic: ``tuned``'s LoRA part with SPLIT_K = 1 is 1.2–1.8× the split-K one where a shipped
#:   shrink has SPLIT_K > 1 (notebook 04: split-K gave 2.0× on the shrinks at T = 1), 0.97–1.03× where
#:   both are 1 already;
#: * whole: ``fused`` ≤ ``tuned`` at T ≤ 256, ≤ 1.1× ``tuned`` at T ≥ 1600.
#: * pdl (third round, written 2026-12-03 before its GPU run): programmatic dependent launch between the
#:   layer's launches (shrink, fused gate_up, shrink, fused down, top-k sum; both memsets hoisted before the
#:   chain) saves fused − fused_pdl = 3–8 µs of the whole layer at T ≤ 8: notebook 12's timeline showed
#:   0.3–0.6 µs idle before each launch, and each launch's ramp (its first dependent alignment loads,
#:   ~0.5–1 µs from DRAM) now overlaps the previous launch's drain, over 5 boundaries plus one memset fewer
#:   inside the chain; from T = 64 on the same few µs are ≤ 2 % of the layer: fused_pdl ÷ fused within
#:   0.98–1.00.
#: * fused deterministic (fourth round, written 2026-12-03 after the development run of the split-K down
#:   GEMM, data/dev/12_round4_splitk, and before this notebook's run): ``fused`` with SPLIT_K = 1 on every
#:   launch ÷ ``fused`` within 1.00–1.10 where the stage's shipped config splits K somewhere (the shrinks'
#:   split-K and, at GPT-OSS-20B T ≤ 8, the down GEMM's: 2–6 µs in the development run), 0.98–1.02 where
#:   nothing splits.
#: * stacked LoRA epilogue (fifth round, written 2026-12-03 after the development run
#:   data/dev/12_lora_stack at acf5988, before this notebook's run): the stage with the per-adapter loop
#:   everywhere (lever ``fused_loop``) ÷ the stage within 1.02–1.35 where the shipped config stacks the
#:   adapters (GPT-OSS-20B T = 64, 1600; Qwen3-30B-A3B T = 256, 1600: 1.03–1.30 in the development run),
#:   0.97–1.03 elsewhere (the same kernels).
LEVER_PREDICTIONS = {
    "configs": (0.90, 1.05),
    "order_prefill_max": 0.5,
    "order_decode_tol": 0.03,
    "det_split": (1.2, 1.8),
    "det_nosplit": (0.97, 1.03),
    "whole_prefill_max": 1.1,
    "pdl_decode_us": (3.0, 8.0),
    "pdl_rest": (0.98, 1.00),
    "fdet_split": (1.00, 1.10),
    "fdet_nosplit": (0.98, 1.02),
    "stack_gain": (1.02, 1.35),
    "stack_same": (0.97, 1.03),
}

_NUM_TARGET_COLS = (
    "base_us",
    "lora_us",
    "lora_lo_us",
    "lora_hi_us",
    "total_us",
    "vllm_lora_best_us",
    "vllm_total_best_us",
    "lora_x",
    "total_x",
    "lora_target",
    "total_target",
)
_BOOL_TARGET_COLS = ("met_lora", "met_total", "met_never_slower")


# ---- helpers ---------------------------------------------------------------------------------------------


def _finite(s) -> bool:
    return bool(pd.Series(s, dtype=float).map(math.isfinite).all())


def _bool(s) -> pd.Series:
    """A CSV boolean column (True/False or "True"/"False") as bools."""
    return pd.Series(s).map(lambda v: v if isinstance(v, bool) else str(v).strip().lower() == "true")


def _x(v: float) -> str:
    return "∞" if math.isinf(v) else f"{v:.2f}×"


def _range(s) -> str:
    s = pd.Series(s, dtype=float)
    lo, hi = _x(s.min()), _x(s.max())
    return lo if lo == hi else f"{lo}–{hi}"


def _us_range(s) -> str:
    s = pd.Series(s, dtype=float)
    lo, hi = f"{s.min():.1f}", f"{s.max():.1f}"
    return lo if lo == hi else f"{lo}–{hi}"


def _pt(model: str, T: int) -> str:
    return f"{model} T = {int(T)}"


# ---- sanity ----------------------------------------------------------------------------------------------


def _check_sanity(df, checks, launches) -> list[tuple[str, int]]:
    """Assert the data are complete and finite; return the measured (model, T) points."""
    layer = df[df.part.isin(["base", "lora", "total"])]
    assert len(layer), "no timing rows"
    for st in (FINAL, BASELINE):
        assert (layer.stage == st).any(), f"no timing rows of stage {st!r}"
    dup = layer.duplicated(["stage", "model", "T", "part"])
    assert not dup.any(), (
        f"duplicate timing rows: {layer[dup][['stage', 'model', 'T', 'part']].to_dict('records')}"
    )
    assert _finite(df.us_p50) and (df.us_p50 > 0).all(), "non-finite or non-positive us_p50"
    for col in ("ms_p20", "ms_p80"):
        if col in df:
            assert _finite(layer[col]) and (layer[col] > 0).all(), f"non-finite or non-positive {col}"
    points = sorted({(m, int(T)) for m, T in zip(layer.model, layer["T"])})
    for st, parts in PARTS.items():
        s = layer[layer.stage == st]
        have = {(m, int(T), p) for m, T, p in zip(s.model, s["T"], s.part)}
        missing = [(m, T, p) for m, T in points for p in parts if (m, T, p) not in have]
        assert not missing, f"stage {st!r}: timing rows missing for {missing}"

    assert len(checks), "no check rows"
    assert _finite(checks.rel_err), "non-finite rel_err in the checks"
    bad = checks[~(checks.rel_err <= checks.tol)]
    assert bad.empty, (
        f"checks beyond their tolerance:\n{bad[['check', 'stage', 'model', 'T', 'rel_err', 'tol']]}"
    )
    ref = checks[checks.check == "layer_vs_reference"]
    models = sorted({m for m, _ in points})
    for st in (FINAL, BASELINE):
        for kind in ("layer_vs_reference", "base_vs_reference", "call_twice"):
            got = set(checks[(checks.check == kind) & (checks.stage == st)].model)
            assert set(models) <= got, f"{kind} rows of stage {st!r} missing for {sorted(set(models) - got)}"
    assert _bool(ref.no_adapter_bitwise).all(), "a row without an adapter differs from the base part"
    assert (ref.delta_rel > DELTA_MIN).all(), "a LoRA delta vanished (the reference check would be vacuous)"

    assert len(launches), "no launch-count rows"
    for col in ("triton", "counted"):
        assert _finite(launches[col]) and (launches[col] >= 1).all(), f"bad launch counts ({col})"
    lk = {
        (s, m, int(T), p) for s, m, T, p in zip(launches.stage, launches.model, launches["T"], launches.part)
    }
    missing = [
        (st, m, T, p)
        for st in (FINAL, BASELINE)
        for m, T in points
        for p in ("total", "base")
        if (st, m, T, p) not in lk
    ]
    assert not missing, f"launch counts missing for {missing}"
    return points


def _check_targets(targets, df, anchors) -> pd.DataFrame:
    """The targets CSV must be what :func:`fused_bench.targets_table` gives for the rows and anchors."""
    assert len(targets), "no target rows although vLLM's figures cover the measured models"
    for col in ("total_x", "lora_us", "total_us", "base_us"):
        assert _finite(targets[col]), f"non-finite {col} in the targets"
    if anchors is None:
        return targets
    want = fb.targets_table(df, anchors)
    key = ["model", "T"]
    a = targets.sort_values(key, ignore_index=True)
    b = want.sort_values(key, ignore_index=True)
    assert list(zip(a.model, a["T"].astype(int))) == list(zip(b.model, b["T"].astype(int))), (
        "the targets CSV covers other (model, T) points than the timing rows give"
    )
    for col in _NUM_TARGET_COLS:
        x, y = a[col].astype(float), b[col].astype(float)
        same = (x == y) | ((x - y).abs() <= 1e-9 * y.abs().clip(lower=1.0))
        assert same.all(), f"targets CSV column {col} differs from the timing rows: {x[~same].tolist()}"
    for col in _BOOL_TARGET_COLS:
        assert (_bool(a[col]).to_numpy() == _bool(b[col]).to_numpy()).all(), (
            f"targets CSV column {col} differs"
        )
    return a


# ---- paragraphs ------------------------------------------------------------------------------------------


def _irange(s) -> str:
    s = pd.Series(s).astype(int)
    return f"{s.min()}" if s.min() == s.max() else f"{s.min()}–{s.max()}"


def _launch_text(launches, gpu: bool) -> str:
    tot = launches[launches.part == "total"]
    parts = []
    for st in (BASELINE, FINAL):
        g = tot[tot.stage == st]
        fills = g.fills.astype(int)
        parts.append(
            f"`{st}` {_irange(g.triton)} Triton launches"
            + (
                f" plus {_irange(fills)} torch fills (the split-K zeroing: shrinks, `fused`'s down GEMM)"
                if fills.max()
                else ""
            )
        )
    fused_tri = tot[tot.stage == FINAL].triton.astype(int)
    tuned_tri = tot[tot.stage == BASELINE].triton.astype(int)
    held = (fused_tri == PREDICTED_LAUNCHES[FINAL]).all() and (
        tuned_tri == PREDICTED_LAUNCHES[BASELINE]
    ).all()
    base = launches[(launches.part == "base") & (launches.stage == FINAL)].triton
    base_t = launches[(launches.part == "base") & (launches.stage == BASELINE)].triton
    text = (
        f"**Launches per layer: predicted {PREDICTED_LAUNCHES[BASELINE]} → {PREDICTED_LAUNCHES[FINAL]} "
        f"({'held' if held else 'did not hold'}).** Counted in one eager call at every (model, T): "
        + "; ".join(parts)
        + f". The base part: `{BASELINE}` {_irange(base_t)}, `{FINAL}` {_irange(base)} Triton launches "
        "(the activation is in the gate_up GEMM)."
    )
    if gpu and "profiled_kernels" in launches:
        pk = launches.profiled_kernels.astype(float)
        pm = launches.profiled_memsets.astype(float) if "profiled_memsets" in launches else 0 * pk
        ok = pk.notna()
        if ok.any():
            agree = (pk[ok] + pm[ok] == launches.counted[ok].astype(float)).all()
            ft = pk[ok & (launches.part == "total") & (launches.stage == FINAL)]
            text += (
                f" torch.profiler saw {_irange(ft)} device kernels per `{FINAL}` layer (memsets aside); "
                "profiler and count "
                + (
                    "agree at every row."
                    if agree
                    else "differ at some rows (kernels the wrappers do not see; names in the launches CSV)."
                )
            )
        else:
            errs = launches["profiled_error"].fillna("") if "profiled_error" in launches else pd.Series([""])
            err = str(errs.iloc[0])
            text += f" The profiler cross-check gave nothing ({err or 'no rows'})."
    return text


def _prediction_text(t: pd.DataFrame) -> str | None:
    lines = []
    for (m, T), (lo, hi) in PREDICTED_TOTAL_US.items():
        r = t[(t.model == m) & (t["T"] == T)]
        if not len(r):
            continue
        r = r.iloc[0]
        meas, before, now = r.total_us, TUNED_BEFORE_US[(m, T)], r.tuned_total_us
        verdict = (
            "held" if lo <= meas <= hi else "faster than predicted" if meas < lo else "slower than predicted"
        )
        drop = now - meas
        lines.append(
            f"| {m} | {T} | {before:.1f} → {lo:.0f}–{hi:.0f} | {now:.1f} → {meas:.1f} | "
            f"{before - hi:.0f}–{before - lo:.0f} | {drop:.1f} | {verdict} |"
        )
    if not lines:
        return None
    head = (
        "**The whole layer against kernels/fused.py's predictions** (µs; the prediction started from "
        "notebook "
        f"07's `{BASELINE}` run; the measured drop is `{BASELINE}` − `{FINAL}` of this run, which removes "
        "the "
        "run-to-run spread of the starting point):\n\n"
        f"| model | T | predicted | measured (`{BASELINE}` → `{FINAL}`) | predicted drop | measured drop | "
        "verdict |\n"
        "|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(lines)


def _miss_reasons(r) -> list[str]:
    out = []
    T = int(r["T"])
    if not r.met_total:
        bound = r.vllm_total_best_us / r.base_us
        need_total = r.vllm_total_best_us / r.total_target
        if bound < r.total_target:
            why = (
                f"base-bound: with a LoRA part of 0 µs the layer would be {bound:.2f}× vLLM's (our base "
                f"{r.base_us:.1f} µs is {r.vllm_base_us / r.base_us:.2f}× vLLM's base {r.vllm_base_us:.1f} "
                "µs)"
            )
        else:
            why = (
                f"the LoRA part ({r.lora_us:.1f} µs, {100 * r.lora_us / r.total_us:.0f} % of the layer) "
                "would have "
                f"to be ≤ {need_total - r.base_us:.1f} µs"
            )
        pred = PREDICTED_TOTAL_US.get((r.model, T))
        if pred is not None:
            lo, hi = pred
            px_lo, px_hi = r.vllm_total_best_us / hi, r.vllm_total_best_us / lo
            why += f"; the prediction ({lo:.0f}–{hi:.0f} µs) meant {px_lo:.2f}–{px_hi:.2f}× here, " + (
                "already below the target"
                if px_hi < r.total_target
                else f"reaching the target: the measured {r.total_us:.1f} µs is "
                + ("slower than predicted" if r.total_us > hi else "within the prediction")
            )
        out.append(
            f"{_pt(r.model, T)}, whole layer {r.total_x:.2f}× (target {r.total_target:.2f}×, "
            f"needs ≤ {need_total:.1f} µs, measured {r.total_us:.1f} µs): {why}."
        )
    if not r.met_lora:
        need = r.vllm_lora_best_us / r.lora_target
        noise = (
            " — within the p20–p80 band of the subtraction"
            if r.lora_lo_us > 0 and r.vllm_lora_best_us / r.lora_lo_us >= r.lora_target
            else ""
        )
        why = (
            f"LoRA part {r.lora_us:.1f} µs (whole − base; p20–p80 band "
            f"{r.lora_lo_us:.1f}–{r.lora_hi_us:.1f} µs) "
            f"against ≤ {need:.1f} µs needed{noise}; `{BASELINE}`'s whole − base was "
            f"{r.tuned_lora_derived_us:.1f} µs"
        )
        if T >= 1600 and r.model in PREDICTED_PREFILL_EXTRA_US:
            gu, dn = PREDICTED_PREFILL_EXTRA_US[r.model]
            why += (
                f"; the per-adapter masked dots were predicted to add ~{gu:.0f} + {dn:.0f} µs of MMA work at "
                "T = 1600 where compute-bound (the docstring's likeliest miss at prefill; sorting each "
                "expert's "
                "pairs by adapter is the follow-up lever)"
            )
        out.append(f"{_pt(r.model, T)}, LoRA part {_x(r.lora_x)} (target {r.lora_target:.1f}×): {why}.")
    return out


def _targets_md(t: pd.DataFrame) -> str:
    head = (
        "| model | T | LoRA ours (µs) | vLLM best | vLLM ÷ ours | target | met | whole ours (µs) | vLLM | "
        "vLLM ÷ ours | target | met |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for _, r in t.iterrows():
        lines.append(
            f"| {r.model} | {int(r['T'])} | {r.lora_us:.1f} | {r.vllm_lora_best_us:.1f} | {_x(r.lora_x)} | "
            f"{r.lora_target:.2f}× | {'met' if r.met_lora else 'missed'} | {r.total_us:.1f} | "
            f"{r.vllm_total_best_us:.1f} | {_x(r.total_x)} | {r.total_target:.2f}× | "
            f"{'met' if r.met_total else 'missed'} |"
        )
    return "\n".join(lines)


def _timeline_text(tt: pd.DataFrame) -> str:
    """One paragraph on :func:`~moelora_lib.studies.fused_bench.timeline_table`: per model, the idle gaps
    inside one graph replay of each stage at the smallest and largest T measured."""
    parts = []
    for m in sorted(tt.model.unique()):
        q = tt[tt.model == m]
        cells = []
        for T in sorted({int(q["T"].min()), int(q["T"].max())}):
            for st in (BASELINE, FINAL):
                r = q[(q["T"] == T) & (q.stage == st)]
                if len(r):
                    r = r.iloc[0]
                    cells.append(
                        f"T = {T} `{st}` {r.span_us:.1f} µs span, {int(r.kernels)} activities, "
                        f"gaps {r.gaps_us:.1f} µs ({100 * r.gap_share:.0f} %)"
                    )
        parts.append(f"{m}: " + "; ".join(cells))
    return (
        "**One graph replay (profiler timeline, median of 5 replays, L2 not flushed).** "
        + ". ".join(parts)
        + ". The gaps are the device's kernel-to-kernel latency inside the graph: what programmatic "
        "dependent launch or fewer launches could still take (an upper bound: a kernel's ramp-up is in its "
        "own device time, not in the gap)."
    )


def _levers_text(lt: pd.DataFrame) -> str:
    """The second round, lever by lever, against :data:`LEVER_PREDICTIONS` (reported, not asserted)."""
    P = LEVER_PREDICTIONS
    num = [
        c for c in lt.columns if c not in ("model", "T", "tuned_split_k", "fused_split_k", "fused_stacked")
    ]
    assert _finite(lt[num].to_numpy().ravel()), "non-finite values in the levers table"
    lt = lt.assign(
        cfg_x=lt.pair_base / lt.tuned_base,
        order_x=lt.fused_lora / lt.pair_lora,
        order_total=lt.fused_total / lt.pair_total,
        det_x=lt.det_lora / lt.tuned_lora,
        whole_x=lt.fused_total / lt.tuned_total,
        v1_x=lt.v1_total / lt.fused_total,
    )
    pre, dec = lt[lt["T"] >= 1600], lt[lt["T"] <= 64]
    split, nosplit = lt[lt.tuned_split_k > 1], lt[lt.tuned_split_k == 1]

    def held(n, of):
        return f"held at {n} of {of}" if n < of else f"held at all {of}"

    lo, hi = P["configs"]
    n_cfg = int(lt.cfg_x.between(lo, hi).sum())
    n_pre = int((pre.order_x <= P["order_prefill_max"]).sum())
    n_dec = int(((dec.order_total - 1).abs() <= P["order_decode_tol"]).sum())
    dlo, dhi = P["det_split"]
    n_ds = int(split.det_x.between(dlo, dhi).sum())
    nlo, nhi = P["det_nosplit"]
    n_dn = int(nosplit.det_x.between(nlo, nhi).sum())
    small = lt[lt["T"] <= 256]
    n_ws = int((small.whole_x <= 1).sum())
    n_wp = int((pre.whole_x <= P["whole_prefill_max"]).sum())
    det_s = _range(split.det_x) if len(split) else "—"
    det_n = _range(nosplit.det_x) if len(nosplit) else "—"
    order_max, order_tol, whole_max = P["order_prefill_max"], P["order_decode_tol"], P["whole_prefill_max"]
    lines = [
        "**Second round, lever by lever** (this run; µs p50; `v1` = the first round's default configs "
        "and pair order, `pair` = tuned fused-GEMM configs with the pair order, `fused` = the stage "
        "now: tuned configs, adapter order; LoRA part = whole − base for the fused "
        "variants; `det` = "
        "`tuned` with SPLIT_K = 1 on both shrinks):",
        f"- tuned fused-GEMM configs: base part `pair` ÷ `tuned` {_range(lt.cfg_x)} (predicted "
        f"{lo:.2f}–{hi:.2f}: {held(n_cfg, len(lt))}); the whole layer `v1` ÷ `fused` {_range(lt.v1_x)}.",
        f"- adapter order at T ≥ 1600: LoRA part `fused` ÷ `pair` {_range(pre.order_x)} (predicted ≤ "
        f"{order_max}: {held(n_pre, len(pre))}); at T ≤ 64 whole layer "
        f"{_range(dec.order_total)} (predicted within ±{order_tol:.0%}: {held(n_dec, len(dec))}).",
        f"- deterministic mode (`tuned`): LoRA part `det` ÷ split-K {det_s} where a shipped shrink "
        f"splits K ({len(split)} points; predicted {dlo}–{dhi}: {held(n_ds, len(split))}), {det_n} "
        f"where none does ({len(nosplit)} points; predicted {nlo}–{nhi}: {held(n_dn, len(nosplit))}); "
        f"whole layer {_range(lt.det_total / lt.tuned_total)}.",
        f"- whole layer `fused` ÷ `tuned`: {_range(small.whole_x)} at T ≤ 256 (predicted ≤ 1: "
        f"{held(n_ws, len(small))}), {_range(pre.whole_x)} at T ≥ 1600 (predicted ≤ {whole_max}: "
        f"{held(n_wp, len(pre))}).",
    ]
    has_pdl = "pdl_total" in lt.columns
    if has_pdl:
        plo, phi = P["pdl_decode_us"]
        rlo, rhi = P["pdl_rest"]
        lt = lt.assign(pdl_saved=lt.fused_total - lt.pdl_total, pdl_x=lt.pdl_total / lt.fused_total)
        d8, rest = lt[lt["T"] <= 8], lt[lt["T"] > 8]
        n_pd = int(d8.pdl_saved.between(plo, phi).sum())
        n_pr = int(rest.pdl_x.between(rlo, rhi).sum())
        lines.append(
            f"- programmatic dependent launch (third round; `fused` with PDL ÷ `fused`): at T ≤ 8 the "
            f"layer is {_us_range(d8.pdl_saved)} µs faster with PDL (predicted {plo:g}–{phi:g} µs: "
            f"{held(n_pd, len(d8))}); from T = 64 on {_range(rest.pdl_x)} (predicted {rlo:.2f}–{rhi:.2f}: "
            f"{held(n_pr, len(rest))})."
        )
    if "fdet_total" in lt.columns:
        flo, fhi = P["fdet_split"]
        glo, ghi = P["fdet_nosplit"]
        lt = lt.assign(fdet_x=lt.fdet_total / lt.fused_total)
        fs, fn = lt[lt.fused_split_k > 1], lt[lt.fused_split_k == 1]
        n_fs = int(fs.fdet_x.between(flo, fhi).sum())
        n_fn = int(fn.fdet_x.between(glo, ghi).sum())
        fs_r = _range(fs.fdet_x) if len(fs) else "—"
        fn_r = _range(fn.fdet_x) if len(fn) else "—"
        lines.append(
            f"- deterministic mode (`fused`, fourth round: SPLIT_K = 1 on the shrinks and the down GEMM ÷ "
            f"the stage): whole layer {fs_r} where the stage splits K ({len(fs)} points; predicted "
            f"{flo:.2f}–{fhi:.2f}: {held(n_fs, len(fs))}), {fn_r} where nothing splits ({len(fn)} points; "
            f"predicted {glo:.2f}–{ghi:.2f}: {held(n_fn, len(fn))})."
        )
    if "loop_total" in lt.columns:
        slo, shi = P["stack_gain"]
        elo, ehi = P["stack_same"]
        lt = lt.assign(loop_x=lt.loop_total / lt.fused_total)
        st, ot = lt[lt.fused_stacked == 1], lt[lt.fused_stacked == 0]
        n_st = int(st.loop_x.between(slo, shi).sum())
        n_ot = int(ot.loop_x.between(elo, ehi).sum())
        where = ", ".join(f"{r.model} T = {int(r['T'])}" for _, r in st.iterrows()) or "none"
        lines.append(
            f"- stacked LoRA epilogue (fifth round; the stage with the per-adapter loop everywhere ÷ the "
            f"stage): whole layer {_range(st.loop_x) if len(st) else '—'} where the shipped config stacks "
            f"the adapters ({where}; predicted {slo:.2f}–{shi:.2f}: {held(n_st, len(st))}), "
            f"{_range(ot.loop_x) if len(ot) else '—'} elsewhere ({len(ot)} points, the same kernels; "
            f"predicted {elo:.2f}–{ehi:.2f}: {held(n_ot, len(ot))})."
        )
    lines += [
        "",
        "| model | T | v1 total | pair total | fused total | tuned total | pair LoRA | fused LoRA "
        "| tuned LoRA | det LoRA | SPLIT_K |" + (" PDL total |" if has_pdl else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_pdl else ""),
    ]
    for _, r in lt.iterrows():
        lines.append(
            f"| {r.model} | {int(r['T'])} | {r.v1_total:.1f} | {r.pair_total:.1f} | {r.fused_total:.1f} | "
            f"{r.tuned_total:.1f} | {r.pair_lora:.1f} | {r.fused_lora:.1f} | {r.tuned_lora:.1f} | "
            f"{r.det_lora:.1f} | {int(r.tuned_split_k)} |" + (f" {r.pdl_total:.1f} |" if has_pdl else "")
        )
    return "\n".join(lines)


def _registers_text(reg: pd.DataFrame) -> str:
    assert len(reg) and _finite(reg.REG) and (reg.REG > 0).all(), "bad register rows"
    per_op = reg.groupby("op").agg(
        lo=("REG", "min"), hi=("REG", "max"), local=("LOCAL", "max"), bins=("binaries", "max")
    )
    ops = "; ".join(
        f"`{op}` {int(r.lo)}–{int(r.hi)} registers"
        + (f", {int(r.local)} B local (spills)" if r.local else "")
        for op, r in per_op.iterrows()
    )
    spills = reg[reg.LOCAL > 0]
    one = (reg.binaries == 1).all()
    return (
        f"**Registers (compile-only, sm_90, default configs at T = "
        f"{', '.join(str(int(x)) for x in sorted(reg['T'].unique()))}):** {ops}. "
        + ("No spills. " if spills.empty else f"Spills at {len(spills)} (op, T) rows. ")
        + (
            "One binary per launch over the measured lengths with one config (no recompile)."
            if one
            else "More than one binary over the lengths for some launch (see the notebook)."
        )
    )


# ---- the conclusion --------------------------------------------------------------------------------------


def conclusion(
    df, checks, targets, launches, *, profile: str, anchors=None, registers=None, levers=None, timeline=None
) -> str:
    """The written conclusion of notebook 12.

    Args:
        df: ``12_fused.csv`` — :func:`~moelora_lib.studies.moe_bench.bench_layer` rows of stage ``fused``
            (parts base, total) and ``tuned`` (base, lora, total) per model and T, plus the four launches of
            ``fused`` timed alone (:func:`~moelora_lib.studies.fused_bench.bench_fused_ops`).
        checks: ``12_checks.csv`` — :func:`~moelora_lib.studies.fused_bench.check_point` rows.
        targets: ``12_targets.csv`` — :func:`~moelora_lib.studies.fused_bench.targets_table` as the notebook
            wrote it (empty on the CPU profile).
        launches: ``12_launches.csv`` — :func:`~moelora_lib.studies.fused_bench.launch_rows`.
        profile: "gpu" or "cpu" (cpu: correctness and launch counts only, no timing claims).
        anchors: :func:`~moelora_lib.studies.moe_bench.anchor_table` (GPU): the targets CSV is checked
            against it.
        registers: optional rows of :class:`~moelora_lib.studies.fused_bench.RegisterReport`.
        levers: optional :func:`~moelora_lib.studies.fused_bench.levers_table` (GPU): the second round's
            levers one at a time against :data:`LEVER_PREDICTIONS` (reported, not asserted).
        timeline: optional :func:`~moelora_lib.studies.fused_bench.timeline_table` (GPU): one graph replay
            per (model, T, stage), its span, busy time and the idle gaps between kernels (reported).

    Asserts data sanity only: timing rows of both stages at every (model, T) with every part, finite and
    positive; every check within its tolerance (rows without an adapter bitwise the base part; the LoRA
    delta not vanishing); launch counts present and ≥ 1; on the GPU the targets CSV equals what the rows
    and vLLM's figures give. A missed target or a missed prediction is reported, never raised.
    """
    points = _check_sanity(df, checks, launches)
    ref = checks[checks.check == "layer_vs_reference"]
    base_ck = checks[checks.check == "base_vs_reference"]
    twice = checks[checks.check == "call_twice"]
    out = ["## Conclusion"]
    worst = {st: ref[ref.stage == st].rel_err.max() for st in (FINAL, BASELINE)}
    out.append(
        f"**Correctness (held).** Against the fp32 reference: `{FINAL}` worst {worst[FINAL]:.1e}, "
        f"`{BASELINE}` "
        f"worst {worst[BASELINE]:.1e} (tolerance {ref.tol.max():g}; {len(ref)} layer calls over "
        f"{ref.model.nunique()} models); the base part alone worst {base_ck.rel_err.max():.1e}; a second "
        "call "
        f"differs from the first by at most {twice.rel_err.max():.1e}; rows without an adapter are bitwise "
        "the "
        "base part in both stages."
    )
    out.append(_launch_text(launches, profile == "gpu"))
    if registers is not None and len(registers):
        out.append(_registers_text(pd.DataFrame(registers)))
    if profile != "gpu":
        out.append(
            "**Timing: not concluded on this profile.** The tiny presets ran through the Triton "
            "interpreter in "
            "fp32: the times are interpreter cost. Whether the fused layer is faster than `tuned`, the "
            "predictions of kernels/fused.py and the targets against vLLM need the GPU profile."
        )
        return "\n\n".join(out)

    lt = fb.layer_table(df)
    f_ = lt[lt.stage == FINAL].set_index(["model", "T"])
    b_ = lt[lt.stage == BASELINE].set_index(["model", "T"])
    sp_total = b_.total / f_.total
    sp_base = b_.base / f_.base
    sp_lora = pd.Series(fb._ratio(b_.lora, f_.lora.reindex(b_.index)), index=b_.index)
    per_model = "; ".join(
        f"{m}: whole layer {_range(sp_total.xs(m))}, base part {_range(sp_base.xs(m))}, LoRA part "
        f"(whole − base) {_range(sp_lora.xs(m))}"
        for m in sorted({m for m, _ in points})
    )
    faster = int((sp_total > 1).sum())
    out.append(
        f"**`{FINAL}` against `{BASELINE}` (this run, `{BASELINE}` ÷ `{FINAL}`):** {per_model}; the layer "
        "is faster "
        f"at {faster} of {len(sp_total)} points"
        + (
            ", slower at "
            f"{', '.join(_pt(m, T) + f' ({x:.2f}×)' for (m, T), x in sp_total[sp_total < 1].items())}."
            if (sp_total < 1).any()
            else "."
        )
    )
    if levers is not None and len(levers):
        out.append(_levers_text(pd.DataFrame(levers)))
    if timeline is not None and len(timeline):
        out.append(_timeline_text(pd.DataFrame(timeline)))
    dl = b_.lora_measured / b_.lora.where(b_.lora > 0)
    if dl.notna().any():
        out.append(
            f"**Whole − base as the LoRA part.** On `{BASELINE}`, where both exist, its LoRA launches timed "
            "alone "
            f"take {_range(dl.dropna())} its whole − base: the subtraction "
            + (
                "credits the LoRA part with less than its launches alone cost (they overlap the base's "
                "launches "
                "in one graph)"
                if dl.dropna().median() > 1
                else "charges the LoRA part more than its launches alone cost"
            )
            + f"; `{FINAL}`'s LoRA part is read the same way."
        )

    if anchors is None and (targets is None or not len(targets)):
        out.append("**Targets: vLLM's figures were not given; no comparison.**")
        return "\n\n".join(out)
    if anchors is not None and not set(points) & {(m, int(T)) for m, T in zip(anchors.model, anchors["T"])}:
        out.append("**Targets: vLLM's figures cover none of the measured (model, T); no comparison.**")
        return "\n\n".join(out)
    assert targets is not None, "no targets table"
    t = _check_targets(targets, df, anchors)
    pred = _prediction_text(t)
    if pred:
        out.append(pred)
    n = len(t)
    met_l, met_t = int(_bool(t.met_lora).sum()), int(_bool(t.met_total).sum())
    never = int(_bool(t.met_never_slower).sum())
    t = t.assign(met_lora=_bool(t.met_lora).to_numpy(), met_total=_bool(t.met_total).to_numpy())
    out.append(
        "**Targets against vLLM's figures** (LoRA part ≥ 2.5× vLLM's best at T ≤ 64 and ≥ 2× at T ≥ 256; "
        "whole "
        f"layer ≥ 1.5× at T = 1 and T ≥ 1600, ≥ 1.15× at T = 8–256, never slower): LoRA part met at {met_l} "
        "of "
        f"{n} points ({_range(t.lora_x)}), whole layer at {met_t} of {n} ({_range(t.total_x)}), never "
        "slower at "
        f"{never} of {n}. `{BASELINE}` in the same run: LoRA part {_range(t.tuned_lora_x)}, whole layer "
        f"{_range(t.tuned_total_x)}.\n\n" + _targets_md(t)
    )
    misses = [line for _, r in t.iterrows() for line in _miss_reasons(r)]
    if misses:
        base_bound = int(
            sum(
                1
                for _, r in t.iterrows()
                if not r.met_total and r.vllm_total_best_us / r.base_us < r.total_target
            )
        )
        out.append(
            f"**Why the misses** ({len(misses)}; {base_bound} of the whole-layer misses are base-bound: the "
            "launches this stage removes cannot reach the target while the base GEMMs run at vLLM's "
            "speed):\n\n" + "\n".join(f"- {x}" for x in misses)
        )
    else:
        out.append("**Every target met.**")
    slower = t[~_bool(t.met_never_slower).to_numpy()]
    if len(slower):
        out.append(
            "**Slower than vLLM at:** "
            + ", ".join(
                f"{_pt(m, T)} ({x:.2f}×)" for m, T, x in zip(slower.model, slower["T"], slower.total_x)
            )
            + "."
        )
    return "\n\n".join(out)
