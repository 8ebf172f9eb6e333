"""Notebook 15's tables: block-FP8 Qwen3 with bf16 adapters, against our bf16 layers and models and
against the FP8 floors.

Each timed row carries a ``variant`` column (:data:`VARIANTS`): "fp8_weight_only", "fp8_dynamic" (W8A8) or
"dense". Ratios: ``dense_x_fp8_*`` = dense time ÷ FP8 time (> 1: FP8 faster); ``fp8_*_x_bytes_floor`` =
FP8 time ÷ its bytes floor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: The variants a timed row is one of: FP8 weights with activations in the layer's dtype, FP8 weights with
#: W8A8 activations ("dynamic"), dense weights (bf16 on the GPU).
VARIANTS = ("fp8_weight_only", "fp8_dynamic", "dense")
#: The FP8 activation schemes, in the order of :data:`VARIANTS`.
SCHEMES = ("weight_only", "dynamic")
#: Generation scenarios: no adapter loaded, and 8 adapters with request i on slot i mod 8 (:mod:`.e2e`).
BASE, MIXED = "base", "adapters_mixed"

#: The targets: key -> (what, value ≥ threshold (True) or ≤ (False), threshold).
TARGETS: dict[str, tuple[str, bool, float]] = {
    "moe_dense_x_fp8_base": (
        "MoE layer, base (routing included): our bf16 ÷ FP8 (the scheme auto picks), T ≥ 1600",
        True,
        1.6,
    ),
    "moe_fp8_base_x_bytes_floor": (
        "MoE layer, FP8 base (routing included) ÷ its FP8 bytes floor, T ≤ 8",
        False,
        1.5,
    ),
    "otps_moe_fp8_x_dense": (
        "Qwen3-30B-A3B OTPS per request with 8 adapters, FP8 ÷ our bf16, at 1 and 32 requests",
        True,
        1.4,
    ),
    "otps_moe_fp8_adapters_x_base": (
        "Qwen3-30B-A3B-FP8 OTPS per request, 8 adapters ÷ no adapter, at 1 and 32 requests",
        True,
        0.9,
    ),
    "otps_dense_fp8_x_dense": (
        "Qwen3-32B OTPS per request with 8 adapters, FP8 ÷ our bf16, 1 request",
        True,
        1.6,
    ),
}


def variant(weight_format: str, scheme: str | None = None) -> str:
    """The :data:`VARIANTS` name of a row: "dense" for dense weights, else ``fp8_<scheme>``."""
    return "dense" if weight_format == "dense" else f"fp8_{scheme}"


def _pick_auto(t, auto: Mapping[int, str], parts: Sequence[str]):
    """Add ``fp8_auto`` (the scheme ``auto[T]`` picks) and ``fp8_auto_<part>`` (that scheme's
    ``fp8_<scheme>_<part>`` column) to ``t``, indexed by T."""
    t["fp8_auto"] = [auto.get(int(T), "weight_only") for T in t.index]
    for part in parts:
        cols = [f"fp8_{sc}_{part}" for sc in t["fp8_auto"]]
        t[f"fp8_auto_{part}"] = [t[c].iloc[i] if c in t.columns else math.nan for i, c in enumerate(cols)]
    return t


def layer_table(layer, auto: Mapping[int, str]):
    """One row per T of the MoE layer rows ``layer`` (:func:`~.moe_bench.bench_module` rows with a
    ``variant`` column): µs of ``<variant>_<part>`` (parts base, total), the FP8 base's bytes and FLOP floors
    (``fp8_bytes_floor_us``, ``fp8_flops_floor_us``, ``fp8_floor_us``), the dense base's ``dense_floor_us``,
    ``fp8_auto`` (``auto[T]``: the scheme the layer's "auto" runs) with its ``fp8_auto_base`` /
    ``fp8_auto_total``, and the ratios ``dense_x_fp8_base`` / ``dense_x_fp8_total`` (dense ÷ FP8 auto),
    ``dense_x_fp8_<scheme>_base``, ``fp8_base_x_bytes_floor`` (FP8 auto base ÷ its bytes floor),
    ``fp8_lora_x_base`` (FP8 auto with adapters ÷ without)."""
    t = layer.pivot_table(index="T", columns=["variant", "part"], values="us_p50")
    t.columns = [f"{v}_{p}" for v, p in t.columns]
    fp8 = layer[(layer.weight_format == "fp8") & (layer.part == "base")].groupby("T")
    t["fp8_bytes_floor_us"] = fp8.bytes_floor_us.min()
    t["fp8_flops_floor_us"] = fp8.flops_floor_us.min()
    t["fp8_floor_us"] = t[["fp8_bytes_floor_us", "fp8_flops_floor_us"]].max(axis=1)
    dense = layer[(layer.variant == "dense") & (layer.part == "base")].groupby("T")
    t["dense_floor_us"] = dense.floor_us.min()
    t = _pick_auto(t, auto, ("base", "total"))
    t["dense_x_fp8_base"] = t.dense_base / t.fp8_auto_base
    t["dense_x_fp8_total"] = t.dense_total / t.fp8_auto_total
    for sc in SCHEMES:
        if f"fp8_{sc}_base" in t:
            t[f"dense_x_fp8_{sc}_base"] = t.dense_base / t[f"fp8_{sc}_base"]
    t["fp8_base_x_bytes_floor"] = t.fp8_auto_base / t.fp8_bytes_floor_us
    t["fp8_lora_x_base"] = t.fp8_auto_total / t.fp8_auto_base
    return t.reset_index()


def dense_table(rows, auto: Mapping[int, str]):
    """One row per (model, proj, T) of the projection rows ``rows`` (:func:`~.dense_bench.bench_module` rows
    with a ``variant`` column), the columns of :func:`layer_table` (``auto``: T -> the scheme LoRALinear's
    ``activation_scheme="auto"`` runs)."""
    import pandas as pd

    out = []
    for (model, proj), g in rows.groupby(["model", "proj"], sort=False):
        out.append(layer_table(g, auto).assign(model=model, proj=proj))
    cols = ["model", "proj", "T"]
    t = pd.concat(out, ignore_index=True)
    return t[cols + [c for c in t.columns if c not in cols]]


def generation_table(gen):
    """One row per (model, concurrency) of generation rows (:func:`~.e2e.run_generation` rows with a
    ``format`` column, "fp8" or "dense"): OTPS per request and TTFT of the FP8 model without adapters
    (``fp8_base_*``) and with 8 (``fp8_mixed_*``) and of the dense model with 8 (``dense_mixed_*``), and
    ``otps_fp8_x_dense`` (FP8 ÷ dense, with adapters), ``otps_adapters_x_base`` (FP8 with ÷ without)."""
    g = gen.assign(key=gen["format"] + "_" + gen.scenario.map({BASE: "base", MIXED: "mixed"}))
    vals = ["otps_per_request", "otps_aggregate", "ttft_ms_mean"]
    t = g.pivot_table(index=["model", "concurrency"], columns="key", values=vals)
    t.columns = [f"{k}_{v}" for v, k in t.columns]
    for c in ("fp8_mixed_otps_per_request", "dense_mixed_otps_per_request", "fp8_base_otps_per_request"):
        if c not in t:
            t[c] = math.nan
    t["otps_fp8_x_dense"] = t.fp8_mixed_otps_per_request / t.dense_mixed_otps_per_request
    t["otps_adapters_x_base"] = t.fp8_mixed_otps_per_request / t.fp8_base_otps_per_request
    return t.reset_index()


def targets_table(lt, gt, *, moe_model: str, dense_model: str, small_tokens: Sequence[int],
                  large_tokens: Sequence[int], concurrency: Sequence[int], dense_concurrency: Sequence[int],
                  key: Mapping[str, str] | None = None):  # fmt: skip
    """The :data:`TARGETS` point by point, columns target, model, point, value, threshold, met: the layer
    targets from ``lt`` (:func:`layer_table`) at ``large_tokens`` / ``small_tokens``; the generation targets
    from ``gt`` (:func:`generation_table`) at ``concurrency`` (``moe_model``) and ``dense_concurrency``
    (``dense_model``). ``key`` maps a run's model name to the one reported (the CPU profile's tiny
    stand-ins to the real names). Points without numbers are left out."""
    import pandas as pd

    key = dict(key or {})
    rows: list[dict[str, Any]] = []

    def add(target, model, point, value):
        what, ge, threshold = TARGETS[target]
        if value is None or not math.isfinite(value):
            return
        met = value >= threshold if ge else value <= threshold
        rows.append(dict(target=target, model=key.get(model, model), point=point, value=float(value),
                         threshold=threshold, met=bool(met)))  # fmt: skip

    for r in lt.itertuples():
        if r.T in large_tokens:
            add("moe_dense_x_fp8_base", moe_model, f"T = {r.T} ({r.fp8_auto})", r.dense_x_fp8_base)
        if r.T in small_tokens:
            add(
                "moe_fp8_base_x_bytes_floor", moe_model, f"T = {r.T} ({r.fp8_auto})", r.fp8_base_x_bytes_floor
            )
    for r in gt.itertuples():
        c = int(r.concurrency)
        point = f"{c} request{'s' * (c > 1)}"
        if r.model == moe_model and c in concurrency:
            add("otps_moe_fp8_x_dense", r.model, point, r.otps_fp8_x_dense)
            add("otps_moe_fp8_adapters_x_base", r.model, point, r.otps_adapters_x_base)
        if r.model == dense_model and c in dense_concurrency:
            add("otps_dense_fp8_x_dense", r.model, point, r.otps_fp8_x_dense)
    return pd.DataFrame(rows, columns=["target", "model", "point", "value", "threshold", "met"])


def target_lines(targets) -> list[str]:
    """One Markdown bullet per target of ``targets`` (:func:`targets_table`): what, the threshold, met or
    **missed** at how many points, and every point's value."""
    lines = []
    for name, g in targets.groupby("target", sort=False):
        what, ge, threshold = TARGETS[name]
        miss = g[~g.met.astype(bool)]
        vals = ", ".join(f"{r.model} {r.point}: {r.value:.3g}" for r in g.itertuples())
        verdict = "met" if miss.empty else f"**missed** at {len(miss)} of {len(g)}"
        lines.append(f"- {what} {'≥' if ge else '≤'} {threshold:g}: {verdict} ({vals}).")
    return lines
