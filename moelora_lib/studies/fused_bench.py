"""Notebook 12's measurements of stage ``fused`` beside stage ``tuned`` and vLLM's figures. ``fused`` runs
the LoRA expands inside the base GEMMs, so both stages are timed as whole layer and base part
(:func:`.moe_bench.bench_layer`) and LoRA = whole − base (:func:`layer_table`).
Units: µs; FLOPs 2 per multiply-add; bytes read + written; P = T·K pairs."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..common import dtype_name
from ..reference import moe_lora_reference
from ..testing import TOLERANCES, rel_err
from . import bench
from . import moe_bench as mb

#: The stage measured and the stage it is measured against.
STAGE, BASELINE = "fused", "tuned"

#: LoRA part (whole − base) ≥ this × faster than vLLM's best LoRA path: (largest T, target) in order.
LORA_TARGETS: tuple[tuple[float, float], ...] = ((64, 2.5), (math.inf, 2.0))
#: Whole layer ≥ this × faster than vLLM's (T = 1 and T ≥ 1600: 1.5×; 8–256: 1.15×); never slower (1.0×).
TOTAL_TARGETS = {"ends": 1.5, "mid": 1.15, "never_slower": 1.0}
#: Informational: the LoRA part's share of our base; the base against its floor.
LORA_SHARE_MAX, BASE_FLOOR_DECODE, BASE_FLOOR_PREFILL = 0.10, 1.25, 1.5


def check_point(stage: str, inp, *, model: str, pattern: str, variant: str) -> list[dict[str, Any]]:
    """Checks of one layer call of ``stage`` on ``inp``, one row per ``check`` with rel_err and tol:
    ``layer_vs_reference`` (plus no_adapter_rows, no_adapter_bitwise, delta_rel), ``base_vs_reference``,
    ``call_twice``."""
    run = mb.make_run(stage, inp)
    out, base, again = run().clone(), run.base_part().clone(), run().clone()
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    a = inp.args()  # every adapter id -1: the base part
    ref_base = moe_lora_reference(*a[:5], torch.full_like(inp.lora_ids, -1), *a[6:], **inp.kwargs())
    none = inp.lora_ids == -1
    bitwise = bool(torch.equal(out[none], base[none])) if bool(none.any()) else True
    delta_rel = float((ref - ref_base).abs().max() / ref.abs().max().clamp_min(1e-30))
    x = inp.hidden_states
    common = dict(
        stage=stage, model=model, T=int(x.shape[0]), dtype=dtype_name(x.dtype), activation=inp.activation,
        bias=inp.b13 is not None, pattern=pattern, variant=variant, config=run.cfg.short(),
        config_source=run.cfg.source, tol=TOLERANCES[x.dtype],
    )  # fmt: skip
    return [
        bench.result_row(check="layer_vs_reference", **common, rel_err=rel_err(out, ref),
                         no_adapter_rows=int(none.sum()), no_adapter_bitwise=bitwise, delta_rel=delta_rel),
        bench.result_row(check="base_vs_reference", **common, rel_err=rel_err(base, ref_base)),
        bench.result_row(check="call_twice", **common, rel_err=rel_err(again, out)),
    ]  # fmt: skip


#: torch calls that launch a fill kernel (a memset in a CUDA graph) when the tensor is not empty.
_FILLS = ((torch, "zeros"), (torch, "zeros_like"), (torch.Tensor, "zero_"), (torch.Tensor, "fill_"))


def count_launches(fn: Callable[[], Any]) -> dict[str, int]:
    """Call ``fn()`` once: {Triton kernel name: launches, "torch_fill": fills of non-empty tensors}."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counts: Counter = Counter()

    def wrap_run(real):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                name = getattr(getattr(self, "fn", None), "__name__", None)
                counts[name or getattr(self, "__name__", type(self).__name__)] += 1
            return real(self, *args, **kwargs)

        return run

    def wrap_fill(real, method: bool):
        def fill(*args, **kwargs):
            out = real(*args, **kwargs)
            t = args[0] if method else out
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                counts["torch_fill"] += 1
            return out

        return fill

    saved = [(c, "run", c.__dict__["run"]) for c in (JITFunction, InterpretedFunction)]
    saved += [(o, a, getattr(o, a)) for o, a in _FILLS]
    try:
        for owner, attr, real in saved:
            setattr(owner, attr, wrap_run(real) if attr == "run" else wrap_fill(real, owner is torch.Tensor))
        fn()
    finally:
        for owner, attr, real in reversed(saved):
            setattr(owner, attr, real)
    return dict(counts)


def profiled_launches(fn: Callable[[], Any]) -> dict[str, Any]:
    """GPU only: dict(kernels, memsets, names) of one profiled eager ``fn()`` after a warm call, or error."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop lines would fill the notebook
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = prof.events()
    dev = [e for e in ev if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    if not dev:
        return dict(error="the profiler recorded no device activity")
    dev.sort(key=lambda e: e.time_range.start)
    memsets = [e for e in dev if e.name.lower().startswith("memset")]
    kernels = [e for e in dev if not e.name.lower().startswith(("memset", "memcpy"))]
    names = ";".join(e.name[:48] for e in kernels + memsets)
    return dict(kernels=len(kernels), memsets=len(memsets), names=names)


def launch_rows(run, *, model: str, profile_gpu: bool) -> list[dict[str, Any]]:
    """Launches of a built LayerRun, rows ``part`` = total, base: triton, fills, counted, kernels, planned;
    with ``profile_gpu`` profiled_kernels/_memsets/_names/_error."""
    rows = []
    for part, fn in (("total", run), ("base", run.base_part)):
        c = count_launches(fn)
        fills = int(c.pop("torch_fill", 0))
        row = dict(
            stage=run.stage.name, model=model, T=int(run.dims.T), part=part, triton=int(sum(c.values())),
            fills=fills, counted=int(sum(c.values())) + fills,
            kernels=";".join(f"{k}={v}" for k, v in sorted(c.items())),
            planned=len(run.stage.launch_ops) + 1 if part == "total" else float("nan"),
            config=run.cfg.short(),
        )  # fmt: skip
        if profile_gpu and part == "total":
            try:
                p = profiled_launches(fn)
            except Exception as e:  # noqa: BLE001 - a profiler failure must not stop the measurements
                p = dict(error=f"{type(e).__name__}: {e}"[:200])
            missing = dict(kernels=float("nan"), memsets=float("nan"), names="", error="")
            row.update({f"profiled_{k}": p.get(k, v) for k, v in missing.items()})
        rows.append(bench.result_row(**row))
    return rows


def fused_op_costs(run, model: str, topk_ids=None, lora_ids=None) -> dict[str, dict[str, float]]:
    """FLOPs, minimal bytes and floor (µs) of stage ``fused``'s four launches (from
    ``moe_bench.op_costs``)."""
    from ..kernels.launchers import rank_stride

    d, b = run.dims, run.x.element_size()
    c = {r["op"]: r for r in mb.op_costs(model, d, dtype_bytes=b, topk_ids=topk_ids, lora_ids=lora_ids)}
    P, I, S, R = d.pairs, d.I, d.slices, d.rank
    inter13, inter2 = S * P * rank_stride(R) * 4, P * rank_stride(R) * 4
    gu, dn, gs, ds = c["gate_up_expand"], c["down_expand"], c["gate_up_shrink"], c["down_shrink"]
    bg, bd = c["base_gate_up"], c["base_down"]
    ops = {
        "gate_up_shrink": (gs["flops"], gs["bytes"] - S * P * R * 4 + inter13),
        "fused_gate_up": (bg["flops"] + gu["flops"], bg["bytes"] - P * I * b + gu["weight_bytes"] + inter13),
        "down_shrink": (ds["flops"], ds["bytes"] - P * R * 4 + inter2),
        "fused_down": (bd["flops"] + dn["flops"], bd["bytes"] + dn["weight_bytes"] + inter2),
    }  # fmt: skip
    return {k: dict(flops=float(f), bytes=float(n), floor_us=mb.floor_us(f, n)) for k, (f, n) in ops.items()}


def bench_fused_ops(
    run, *, model: str, topk_ids=None, lora_ids=None, warmup_ms: float = 10, rep_ms: float = 40
) -> list[dict[str, Any]]:
    """Each launch of a ``fused`` layer alone: one row per op in :func:`.moe_bench.bench_layer`'s form with
    :func:`fused_op_costs`."""
    from ..kernels.stages import FUSED_CONFIG_FIELD, FUSED_LAUNCH_OPS

    device, d, rows = run.x.device, run.dims, []
    mode = "cpu-interpreter" if device.type == "cpu" else "graph"
    costs = fused_op_costs(run, model, topk_ids, lora_ids)
    for op in FUSED_LAUNCH_OPS:
        tm, c = bench.time_fn(run.op_fn(op), mode, device, warmup_ms, rep_ms), costs[op]
        rows.append(bench.result_row(
            stage=run.stage.name, model=model, T=d.T, H=d.H, I=d.I, E=d.E, K=d.top_k, L=d.adapters, R=d.rank,
            S=d.slices, dtype=dtype_name(run.x.dtype), activation=run.activation, bias=run.b13 is not None,
            part=op, config=getattr(run.cfg, FUSED_CONFIG_FIELD[op]).short(), config_source=run.cfg.source,
            mode=mode, ms_p50=tm.ms_p50, ms_p20=tm.ms_p20, ms_p80=tm.ms_p80, us_p50=tm.ms_p50 * 1e3,
            flops=c["flops"], bytes=c["bytes"], floor_us=c["floor_us"], warmup_ms=warmup_ms, rep_ms=rep_ms,
        ))  # fmt: skip
    return rows


#: lever -> (stage, parts timed, config, adapter_order).
LEVERS: dict[str, tuple[str, tuple[str, ...], str, bool | None]] = {
    "fused_v1": (STAGE, ("base", "total"), "default", False),
    "fused_pair_order": (STAGE, ("base", "total"), "stage_cfg", False),
    "tuned_deterministic": (BASELINE, ("lora", "total"), "deterministic", None),
    "fused_deterministic": (STAGE, ("base", "total"), "deterministic", None),
}


def bench_levers(
    shape, T: int, *, levers: Sequence[str] | None = None, rank: int = 32, num_adapters: int = 8,
    weights=None, dtype=torch.bfloat16, device="cuda", warmup_ms: float = 10, rep_ms: float = 40, seed=0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Time each lever of :data:`LEVERS` (None: all) at one (model, T); rows as
    :func:`.moe_bench.bench_layer`'s plus ``lever``. ValueError for an unknown, repeated or empty lever list,
    or T not an int ≥ 1."""
    from ..kernels import STAGES
    from ..kernels.fused import fused_default_config
    from ..shapes import Dims, get_shape

    levers = list(LEVERS) if levers is None else [levers] if isinstance(levers, str) else levers
    if not isinstance(levers, (list, tuple)) or not levers or len(set(levers)) != len(levers):
        msg = f"a lever name or a non-empty list of distinct names of {list(LEVERS)}, got {levers!r}"
        raise ValueError(f"levers must be {msg}")
    if bad := [lv for lv in levers if lv not in LEVERS]:
        raise ValueError(f"levers must be names of {list(LEVERS)}, got {bad}")
    if not isinstance(T, int) or isinstance(T, bool) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    sh = get_shape(shape) if isinstance(shape, str) else shape
    S = weights.lora_a13.shape[2] if weights is not None else None
    dims = Dims.of(sh, T, rank=rank, adapters=num_adapters, **({"slices": S} if S else {}))
    rows = []
    for lv in levers:
        stage, parts, how, order = LEVERS[lv]
        cfg = STAGES[stage].config_for(dims)
        if how != "stage_cfg":
            cfg = fused_default_config(dims) if how == "default" else cfg.deterministic()
        rows += [dict(r, lever=lv, variant="as_anchor") for r in mb.bench_layer(
            stage, sh, T, rank=rank, num_adapters=num_adapters, weights=weights, seed=seed, activation="silu",
            bias=False, dtype=dtype, device=device, parts=parts, warmup_ms=warmup_ms, rep_ms=rep_ms,
            config=cfg, adapter_order=order,
        )]  # fmt: skip
    return rows


def levers_table(levers_df, df):
    """Per (model, T): µs p50 of each lever beside the stage rows of ``df``: ``v1_*``, ``pair_*``,
    ``fused_*``, ``tuned_*``, ``det_*``, ``fdet_*``, their ``*_lora``, ``tuned_split_k``/``fused_split_k``."""
    import re

    import pandas as pd

    def piv(d):
        return d.pivot_table(index=["model", "T"], columns="part", values="us_p50")

    def split_k(stage, pattern):  # the largest SPLIT_K in each total row's config string
        cfg = df[(df.stage == stage) & (df.part == "total")].set_index(["model", "T"]).config
        return cfg.map(lambda c: max(int(x) for x in re.findall(pattern, c)))

    lv = levers_df
    out = pd.DataFrame(index=piv(df[df.stage == STAGE]).index)
    v1, pair = (lv[lv.lever == k] for k in ("fused_v1", "fused_pair_order"))
    fused = df[(df.stage == STAGE) & df.part.isin(["base", "total"])]
    for name, d in (("v1", v1), ("pair", pair), ("fused", fused)):
        p = piv(d)
        out[f"{name}_base"], out[f"{name}_total"] = p["base"], p["total"]
        out[f"{name}_lora"] = p["total"] - p["base"]
    p = piv(df[(df.stage == BASELINE) & df.part.isin(["base", "lora", "total"])])
    out["tuned_base"], out["tuned_lora"], out["tuned_total"] = p["base"], p["lora"], p["total"]
    p = piv(lv[lv.lever == "tuned_deterministic"])
    out["det_lora"], out["det_total"] = p["lora"], p["total"]
    if (lv.lever == "fused_deterministic").any():
        p = piv(lv[lv.lever == "fused_deterministic"])
        out["fdet_base"], out["fdet_total"] = p["base"], p["total"]
        out["fused_split_k"] = split_k(STAGE, r"s(\d+)w\d+st")
    out["tuned_split_k"] = split_k(BASELINE, r"shrink=m\d+n\d+k\d+g\d+s(\d+)")
    return out.reset_index()


def layer_table(df):
    """Per (stage, model, T) of :func:`.moe_bench.bench_layer` rows: base, total, lora_measured (µs p50),
    ``lora`` = total − base with ``lora_lo``/``lora_hi``, ``base_floor_us``."""
    import pandas as pd

    d = df[df.part.isin(["base", "lora", "total"])]
    d = d.assign(us_p20=d.ms_p20 * 1e3, us_p80=d.ms_p80 * 1e3)
    key = ["stage", "model", "T"]
    piv = {q: d.pivot_table(index=key, columns="part", values=f"us_{q}") for q in ("p50", "p20", "p80")}
    t = pd.DataFrame(index=piv["p50"].index)
    t["base"], t["total"] = piv["p50"]["base"], piv["p50"]["total"]
    t["lora"] = t.total - t.base
    t["lora_lo"] = piv["p20"]["total"] - piv["p80"]["base"]
    t["lora_hi"] = piv["p80"]["total"] - piv["p20"]["base"]
    t["lora_measured"] = piv["p50"]["lora"] if "lora" in piv["p50"] else float("nan")
    fl = d[d.part == "base"].pivot_table(index=key, values="floor_us")
    t["base_floor_us"] = fl.floor_us if len(fl) else float("nan")
    return t.reset_index()


def _ratio(num, den):
    """num ÷ den, +inf where den ≤ 0 (a LoRA part at or below zero within the noise)."""
    import numpy as np

    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)


def targets_table(df, anchors, *, stage: str = STAGE, baseline: str = BASELINE):
    """The targets of ``stage`` per (model, T) of both ``df`` and ``anchors``
    (:func:`.moe_bench.anchor_table`), ``baseline`` beside it: our and vLLM's times, the ratios and each
    target's ``met_*`` column."""
    import pandas as pd

    lt = layer_table(df)
    ours = lt[lt.stage == stage].drop(columns="stage")
    ref = lt[lt.stage == baseline][["model", "T", "base", "total", "lora", "lora_measured"]]
    ref.columns = ["model", "T", "tuned_base_us", "tuned_total_us", "tuned_lora_derived_us", "tuned_lora_us"]
    a = anchors[["model", "T", "base_us", "lora_best_us", "total_best_us"]]
    a = a.rename(columns={c: f"vllm_{c}" for c in ("base_us", "lora_best_us", "total_best_us")})
    t = ours.drop(columns="lora_measured")
    t = t.rename(columns={c: f"{c}_us" for c in ("base", "total", "lora", "lora_lo", "lora_hi")})
    t = t.merge(a, on=["model", "T"], how="inner").merge(ref, on=["model", "T"], how="left")
    t = t.sort_values(["model", "T"], ignore_index=True)
    T = t["T"].astype(int)
    t["lora_x"] = _ratio(t.vllm_lora_best_us, t.lora_us)
    t["lora_x_low"] = _ratio(t.vllm_lora_best_us, t.lora_hi_us)
    t["lora_target"] = [next(x for hi, x in LORA_TARGETS if T_ <= hi) for T_ in T]
    t["met_lora"] = t.lora_x >= t.lora_target
    t["total_x"] = t.vllm_total_best_us / t.total_us
    t["total_target"] = [TOTAL_TARGETS["ends"] if T_ == 1 or T_ >= 1600 else TOTAL_TARGETS["mid"] for T_ in T]
    t["met_total"] = t.total_x >= t.total_target
    t["met_never_slower"] = t.total_x >= TOTAL_TARGETS["never_slower"]
    t["lora_share"] = t.lora_us / t.base_us
    share = [(x <= LORA_SHARE_MAX) if T_ <= 64 else None for T_, x in zip(T, t.lora_share)]
    t["met_lora_share"] = pd.Series(share, index=t.index, dtype=object)
    t["base_over_floor"] = t.base_us / t.base_floor_us
    lim = [BASE_FLOOR_DECODE if T_ <= 64 else BASE_FLOOR_PREFILL if T_ >= 1600 else None for T_ in T]
    floor = [None if m is None else x <= m for m, x in zip(lim, t.base_over_floor)]
    t["met_base_floor"] = pd.Series(floor, index=t.index, dtype=object)
    t["tuned_lora_x"] = _ratio(t.vllm_lora_best_us, t.tuned_lora_us)
    t["tuned_total_x"] = t.vllm_total_best_us / t.tuned_total_us
    t["speedup_total"] = t.tuned_total_us / t.total_us
    t["speedup_base"] = t.tuned_base_us / t.base_us
    t["speedup_lora"] = _ratio(t.tuned_lora_derived_us, t.lora_us)
    return t


def cumulative_with(cumulative, df, *, stage: str = STAGE, baseline: str = BASELINE):
    """``cumulative`` (``07_cumulative.csv``) with ``tuned (this run)`` and ``fused (this run)`` columns, on
    the rows this run measured."""
    lt = layer_table(df)
    out = cumulative.drop(columns=[c for c in ("run",) if c in cumulative]).copy()
    keys = [(p, (m, int(T))) for m, T, p in zip(out.model, out["T"], out.part)]
    for st, label in ((baseline, f"{baseline} (this run)"), (stage, f"{stage} (this run)")):
        s = lt[lt.stage == st].set_index(["model", "T"])
        lora = s.lora_measured if st == baseline else s.lora
        vals = {("lora", k): v for k, v in lora.items()} | {("total", k): v for k, v in s.total.items()}
        out[label] = [vals.get(k, float("nan")) for k in keys]
    return out[out[f"{stage} (this run)"].notna()].reset_index(drop=True)


def timeline_rows(events: Sequence[tuple[str, int, int]], replays: int) -> list[dict[str, Any]]:
    """Split ``events`` ((name, start_ns, duration_ns)) of ``replays`` graph replays into rows: replay, seq,
    name, start_us, dur_us, gap_us, span_us. ValueError when ``replays`` is not an int ≥ 1 or the events do
    not split evenly."""
    if not isinstance(replays, int) or isinstance(replays, bool) or replays < 1:
        raise ValueError(f"replays must be an int >= 1, got {replays!r}")
    ev = sorted(events, key=lambda e: e[1])
    if not ev or len(ev) % replays:
        raise ValueError(f"{len(ev)} device activities do not split into {replays} replays of the same graph")
    n = len(ev) // replays
    rows = []
    for r in range(replays):
        chunk = ev[r * n : (r + 1) * n]
        t0 = chunk[0][1]
        span = max(s + d for _, s, d in chunk) - t0
        prev_end = None
        for i, (name, s, d) in enumerate(chunk):
            gap = 0.0 if prev_end is None else (s - prev_end) / 1e3
            rows.append(dict(replay=r, seq=i, name=name[:60], start_us=(s - t0) / 1e3, dur_us=d / 1e3,
                             gap_us=gap, span_us=span / 1e3))  # fmt: skip
            prev_end = s + d if prev_end is None else max(prev_end, s + d)
    return rows


def graph_timeline(run, *, model: str, replays: int = 5) -> list[dict[str, Any]]:
    """GPU only: the kernels of ``replays`` CUDA-graph replays of ``run()``: :func:`timeline_rows` plus stage,
    model, T, config. RuntimeError without CUDA or when the profiler records nothing."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("graph_timeline needs a CUDA GPU (torch.cuda.is_available() is False)")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    graph = bench.capture_graph(run)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    dev = [e for e in prof.profiler.kineto_results.events() if str(e.device_type()).endswith("CUDA")]
    events = [(e.name(), int(e.start_ns()), int(e.duration_ns())) for e in dev
              if not e.is_user_annotation() and not e.name().lower().startswith("memcpy")]  # fmt: skip
    del graph
    if not events:
        raise RuntimeError("graph_timeline: the profiler recorded no device activity in the replays")
    base = dict(stage=run.stage.name, model=model, T=int(run.dims.T), config=run.cfg.short())
    return [bench.result_row(**base, **r) for r in timeline_rows(events, replays)]


def timeline_table(tl_df):
    """Per (model, T, stage), medians over replays of kernels, span_us, busy_us, gaps_us and gap_share."""
    g, keys = tl_df.assign(pos_gap=tl_df.gap_us.clip(lower=0)), ["model", "T", "stage"]
    per = g.groupby([*keys, "replay"]).agg(kernels=("seq", "size"), span_us=("span_us", "first"),
                                           busy_us=("dur_us", "sum"), gaps_us=("pos_gap", "sum"))  # fmt: skip
    out = per.reset_index().groupby(keys)[["kernels", "span_us", "busy_us", "gaps_us"]].median()
    out["gap_share"] = out.gaps_us / out.span_us
    return out.reset_index()


class RegisterReport:
    """:func:`.compile_check.fused_report` per model in a subprocess started now on a background thread."""

    def __init__(self, models: Sequence[str], lengths: Sequence[int], res_T: Sequence[int] = (1, 64, 1600)):
        from concurrent.futures import ThreadPoolExecutor

        from .compile_check import run_isolated

        self.models = list(models)
        lens, res = [int(x) for x in lengths], [int(x) for x in res_T]
        jobs = [dict(op="fused_report", lengths=lens, shape=m, res_T=res) for m in self.models]
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future = self._pool.submit(run_isolated, jobs, 900.0)
        self._pool.shutdown(wait=False)

    def rows(self, timeout: float = 300.0) -> list[dict[str, Any]]:
        """One row per (model, op, T): REG, LOCAL, cfg, binaries. Waits at most ``timeout`` s; RuntimeError if
        the job failed."""
        try:
            result = self._future.result(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a timeout or the child's failure, reported the same way
            raise RuntimeError(f"register report failed: {type(e).__name__}: {e}") from e
        return [
            dict(model=m, op=op, T=int(T), REG=int(v["REG"]), LOCAL=int(v["LOCAL"]), cfg=v["cfg"],
                 binaries=int(r["hashes"]))
            for m, rep in zip(self.models, result)
            for op, r in rep.items() if isinstance(r, dict) and "res" in r
            for T, v in r["res"].items()
        ]  # fmt: skip
