"""Notebook 00, the explorer: every stage side by side from the committed H200 evidence, interactively.

The notebook is thin; everything it shows is built here, so the tests can call it without a browser:

* :func:`load_evidence` reads the committed GPU CSVs in ``data/`` (never ``data/cpu/``, whose
  interpreter timings are no performance numbers) into tidy tables (:class:`Evidence`). A missing file
  is no error: what it would feed is left out and :attr:`Evidence.notes` says so.
* :func:`options` lists the values the CSVs hold (the controls offer only those); a :class:`Selection`
  names one view (model, T, rank, adapters, adapter pattern, setting, stages).
* :func:`layer_table` (LoRA part, base and whole layer per stage, floors, vLLM's figures, the serving
  layer of notebook 09), :func:`per_op_table` (the six launches), :func:`figure` / :func:`figure_png`
  (three panels) and :func:`selection_notes` build the view of one selection.
* :func:`kernel_view` finds, in the kernel source (``moelora_lib/kernels/triton_kernels.py``), the lines
  a stage switches on: the :class:`~moelora_lib.kernels.Stage` fields that differ from the previous
  stage, mapped to their constexpr (:data:`FEATURES`), located with :mod:`ast` (no line numbers kept).
* :func:`measure` re-times the selection with :func:`moelora_lib.studies.moe_bench.bench_layer` (needs a
  CUDA GPU); :func:`tiny_check` runs every chosen stage at the tiny presets against the fp32 reference
  (on a CPU through the Triton interpreter, which :func:`moelora_lib.studies.notebook.setup` switches on).
* :class:`Explorer` wires these into ipywidgets controls; a control change redraws the plot and tables.

Nothing here imports a kernel module at import time (``TRITON_INTERPRET`` must be set first, by
``setup``); the kernel registry and ``moe_bench`` are imported inside the functions that need them.
"""

from __future__ import annotations

import ast
import base64
import html
import inspect
import io
import os
import re
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .bench import REPO_ROOT, data_path

__all__ = [
    "FEATURES",
    "FEATURE_KERNELS",
    "LAYER_FILES",
    "PER_OP_FILES",
    "PARTS",
    "Evidence",
    "Selection",
    "KernelView",
    "NeedsGPU",
    "load_evidence",
    "describe",
    "options",
    "stage_order",
    "layer_table",
    "per_op_table",
    "selection_notes",
    "figure",
    "figure_png",
    "table_html",
    "kernel_view",
    "kernel_view_html",
    "measure",
    "tiny_check",
    "Explorer",
]

PARTS = ("lora", "base", "total")
PART_LABEL = {"lora": "LoRA part", "base": "base MoE", "total": "whole layer"}
#: Files of whole-layer times, in priority order: where two files hold the same (stage, model, T, R, L,
#: pattern, setting, part), the first wins. 06 has every stage up to even_k_fused_add measured side by side
#: in one run; 07 adds ``tuned``; 02 adds the naive stage's base part and the real GPT-OSS setting; 12 adds
#: ``fused`` (R = 32, L = 8, uniform ids, vLLM's setting only; its launches differ, so no per-launch rows).
LAYER_FILES = (
    ("06_even_k_fused_add.csv", "notebook 06: stages naive to even_k_fused_add, side by side"),
    ("07_tuning.csv", "notebook 07: stage tuned (and even_k_fused_add with default configs)"),
    ("02_naive_kernel.csv", "notebook 02: stage naive (its base part, the real GPT-OSS setting)"),
    ("12_fused.csv", "notebook 12: stage fused (its tuned rows lose to notebook 07's)"),
)
#: Files of per-launch times (stage, how its rows are picked).
PER_OP_FILES = (
    ("07_per_op.csv", "notebook 07: stage tuned, all six launches"),
    (
        "06_missed_per_op.csv",
        "notebook 06: stage even_k_fused_add, the four LoRA ops where a target was missed",
    ),
    ("05_swizzle.csv", "notebook 05: the GROUP_SIZE_M sweep's row at the default value"),
    ("04_split_k.csv", "notebook 04: the SPLIT_K sweep's row at the default value"),
)
OP_COSTS_FILE = ("01_op_costs.csv", "notebook 01: FLOPs, bytes and floors per launch (T = 1, 64, 1600)")
SERVING_FILE = (
    "09_graph.csv",
    "notebook 09: the serving layer (routing + alignment + launches) in one CUDA graph",
)
#: Launch order of one layer (moelora_lib.kernels.stages.LAUNCH_OPS without the activation, not timed alone).
OPS = ("base_gate_up", "gate_up_shrink", "gate_up_expand", "base_down", "down_shrink", "down_expand")
LORA_OPS = ("gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand")
#: The settings of the layer rows: vLLM's anchor setting (silu, no expert biases) or the preset's own.
SETTINGS = {
    "as_anchor": "silu, no expert biases (vLLM's anchor setting)",
    "real": "the preset's own activation and biases (GPT-OSS: swigluoai + biases)",
}
#: What vLLM's figures (moe_bench.anchor_table) were measured with.
ANCHOR_SETTING = dict(rank=32, adapters=8, pattern="uniform", setting="as_anchor")
#: Stage field -> the names that field switches in the kernel source (triton_kernels.py).
FEATURES: dict[str, tuple[str, ...]] = {
    "specialize_lengths": ("do_not_specialize", "LENGTH_ARGS"),
    "split_k": ("SPLIT_K",),
    "swizzle": ("GROUP_SIZE_M",),
    "even_k": ("EVEN_K",),
    "fused_add": ("ADD_INPUTS",),
    "fused_gemm": ("HAS_LORA",),
}
#: Stage field -> the kernels (triton_kernels.KERNELS names) the switch reaches. The base GEMM
#: (fused_moe) always runs its own config's GROUP_SIZE_M and the unmasked K loop where K divides, in every
#: stage: only the LoRA ops follow the stage's swizzle and even_k (Stage.adapt, LayerRun._shrink/_expand).
FEATURE_KERNELS: dict[str, tuple[str, ...]] = {
    "specialize_lengths": ("fused_moe", "lora_shrink", "lora_expand", "gated_act"),
    "split_k": ("lora_shrink",),
    "swizzle": ("lora_shrink", "lora_expand"),
    "even_k": ("lora_shrink", "lora_expand"),
    "fused_add": ("lora_expand",),
    "fused_gemm": ("fused_moe_lora", "fused_moe_lora_act"),
}
KERNEL_SOURCE = REPO_ROOT / "moelora_lib" / "kernels" / "triton_kernels.py"
NEEDS_GPU = (
    "Measuring needs a CUDA GPU, and torch sees none on this machine (torch.cuda.is_available() is False). "
    "The numbers shown are the committed H200 evidence in data/; run this notebook on a GPU machine to "
    "measure the selection now."
)


class NeedsGPU(RuntimeError):
    """:func:`measure` was called where torch sees no CUDA device."""


# ------------------------------------------------------------------------------------------------
# Loading the evidence
# ------------------------------------------------------------------------------------------------


@dataclass
class Evidence:
    """The committed evidence, tidy.

    Attributes:
        layer: one row per (source, stage, model, T, R, L, pattern, setting, part) with us_p50, us_p20,
            us_p80, floor_us (µs, CUDA-graph replay on the H200), config_source.
        per_op: one row per (source, stage, model, T, R, L, pattern, setting, op) with us_p50, floor_us,
            config.
        op_costs: ``01_op_costs.csv`` (per-launch FLOPs, bytes, floor_us) or None.
        anchors: :func:`moelora_lib.studies.moe_bench.anchor_table` (vLLM on the same H200) or None.
        serving: ``09_graph.csv`` rows (model, T, what, us_p50) or None.
        notes: one sentence per file that was missing or unreadable, and what is therefore not shown.
        files: file name -> number of rows read.
        data_dir: the folder read.
    """

    layer: Any
    per_op: Any
    op_costs: Any = None
    anchors: Any = None
    serving: Any = None
    notes: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    data_dir: Path = field(default_factory=data_path)


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name


def _read(folder: Path, name: str, what: str, ev_notes: list[str], files: dict[str, int]):
    import pandas as pd

    path = folder / name
    if not path.is_file():
        ev_notes.append(f"`{_rel(path)}` not found: {what} are not shown.")
        return None
    try:
        df = pd.read_csv(path)
    except Exception as exc:  # noqa: BLE001 - a broken file is reported, not fatal
        ev_notes.append(
            f"`{_rel(path)}` could not be read ({type(exc).__name__}: {exc}): {what} are not shown."
        )
        return None
    files[name] = len(df)
    return df


def _setting(df):
    """``variant`` where the file has it, else derived: silu without biases is vLLM's anchor setting."""
    derived = (df["activation"].astype(str) == "silu") & ~df["bias"].astype(bool)
    derived = derived.map({True: "as_anchor", False: "real"})
    if "variant" in df:
        return df["variant"].where(df["variant"].notna(), derived).astype(str)
    return derived.astype(str)


_KEY = ["stage", "model", "T", "R", "L", "pattern", "setting"]


def _tidy_layer(df, source: str):
    df = df[df["part"].isin(PARTS)]
    if "mode" in df:
        df = df[df["mode"] == "graph"]
    out = df.assign(
        source=source,
        setting=_setting(df),
        T=df["T"].astype(int),
        R=df["R"].astype(int),
        L=df["L"].astype(int),
    )
    cols = [*_KEY, "part", "us_p50", "us_p20", "us_p80", "floor_us", "config_source", "source"]
    return out[[c for c in cols if c in out]]


def _tidy_per_op(df, name: str):
    if name == "07_per_op.csv":  # notebook 07 times the launches in vLLM's anchor setting, uniform ids
        df = df.assign(pattern="uniform", setting="as_anchor")
    else:
        df = df[df["part"].isin(LORA_OPS)].rename(columns={"part": "op"})
        df = df.assign(setting=_setting(df))
        sweep = {"04_split_k.csv": "SPLIT_K", "05_swizzle.csv": "GROUP_SIZE_M"}.get(name)
        if sweep:  # a sweep: the row at the stage's default value is the stage's own launch
            df = df[df[sweep] == df["default_value"]]
    if "mode" in df:
        df = df[df["mode"] == "graph"]
    df = df.assign(source=name, T=df["T"].astype(int), R=df["R"].astype(int), L=df["L"].astype(int))
    return df[[*_KEY, "op", "us_p50", "floor_us", "config", "source"]]


def _with_lora_part(df):
    """Notebook 12 times stage ``fused`` whole and its base part (3 launches), not its LoRA part alone
    (the expand runs inside the base GEMMs): its LoRA part is whole − base of the same run, as notebook 12
    reports it; the floor is that of the LoRA part of the same point (the workload is the same)."""
    import pandas as pd

    key = ["model", "T", "R", "L", "pattern", "activation", "bias"]
    if "variant" in df:
        key.append("variant")
    f = df[df["stage"] == "fused"]
    have = set(map(tuple, f.loc[f["part"] == "lora", key].itertuples(index=False, name=None)))
    whole = f[f["part"] == "total"].set_index(key)
    base = f[f["part"] == "base"].set_index(key)["us_p50"]
    floors = df[df["part"] == "lora"].drop_duplicates(key).set_index(key)["floor_us"]
    idx = [k for k in whole.index.intersection(base.index) if k not in have]
    if not idx:
        return df
    lora = whole.loc[idx].copy()
    lora["part"] = "lora"
    lora["us_p50"] = whole.loc[idx, "us_p50"] - base.loc[idx]
    lora["floor_us"] = floors.reindex(idx).to_numpy()
    for c in ("us_p20", "us_p80", "ms_p20", "ms_p80", "ms_p50"):
        if c in lora:
            lora[c] = float("nan")
    return pd.concat([df, lora.reset_index()[df.columns]], ignore_index=True)


def load_evidence(data_dir: str | os.PathLike | None = None, *, anchors: bool = True) -> Evidence:
    """Read the committed evidence from ``data_dir`` (default ``<repo>/data``); see :class:`Evidence`.

    Missing or unreadable files are skipped with a note; with none of :data:`LAYER_FILES` present the
    layer table is empty (the explorer then shows the notes only). ``anchors=False`` skips vLLM's figures.
    """
    import pandas as pd

    folder = Path(data_dir) if data_dir is not None else data_path()
    notes: list[str] = []
    files: dict[str, int] = {}
    layer = [
        _tidy_layer(_with_lora_part(df) if name == "12_fused.csv" else df, name)
        for name, what in LAYER_FILES
        if (df := _read(folder, name, f"the layer times of {what}", notes, files)) is not None
    ]
    cols = [*_KEY, "part", "us_p50", "us_p20", "us_p80", "floor_us", "config_source", "source"]
    layer = pd.concat(layer, ignore_index=True) if layer else pd.DataFrame(columns=cols)
    layer = layer.drop_duplicates([*_KEY, "part"], keep="first").reset_index(drop=True)
    per_op = [
        _tidy_per_op(df, name)
        for name, what in PER_OP_FILES
        if (df := _read(folder, name, f"the per-launch times of {what}", notes, files)) is not None
    ]
    op_cols = [*_KEY, "op", "us_p50", "floor_us", "config", "source"]
    per_op = pd.concat(per_op, ignore_index=True) if per_op else pd.DataFrame(columns=op_cols)
    per_op = per_op.drop_duplicates([*_KEY, "op"], keep="first").reset_index(drop=True)
    op_costs = _read(folder, *OP_COSTS_FILE, notes, files)
    serving = None
    name, what = SERVING_FILE
    if (folder / name).is_file():
        serving = _read(folder, name, what, notes, files)
        if serving is not None and "mode" in serving:
            serving = serving[serving["mode"] != "cpu"]
    else:
        notes.append(
            f"`{_rel(folder / name)}` not found: notebook 09 has not been run on the GPU yet; the serving "
            "layer's rows (the whole layer with routing and alignment in one CUDA graph) appear once it has."
        )
    anchor_df = None
    if anchors:
        from . import moe_bench

        path = Path(moe_bench.ANCHOR_FILE)
        if data_dir is not None:
            path = folder / path.relative_to(REPO_ROOT / "data")
        if path.is_file():
            anchor_df = moe_bench.anchor_table(path)
            files[_rel(path)] = len(anchor_df)
        else:
            notes.append(f"`{_rel(path)}` not found: vLLM's figures are not shown.")
    return Evidence(layer, per_op, op_costs, anchor_df, serving, notes, files, folder)


def describe(ev: Evidence) -> str:
    """A few lines: which files were read (rows), the values the controls offer, the missing files."""
    lines = [f"evidence read from {_rel(ev.data_dir)}/ (GPU run, read-only):"]
    lines += [f"  {name}: {n} rows" for name, n in ev.files.items()]
    opts = options(ev)
    lines.append(
        "controls offer what the CSVs hold: "
        + "; ".join(f"{k} {v}" for k, v in opts.items() if k != "stages")
        + f"; stages {opts['stages']}"
    )
    lines += [f"note: {n}" for n in ev.notes]
    return "\n".join(lines)


def stage_order() -> list[str]:
    """The registered stages in order (``moelora_lib.kernels.STAGES``)."""
    from moelora_lib.kernels import STAGES

    return list(STAGES)


def options(ev: Evidence) -> dict[str, list]:
    """The values of each control that the layer rows hold (sorted; stages in registry order)."""
    df = ev.layer
    order = stage_order()
    out: dict[str, list] = {}
    for key, col in (
        ("model", "model"),
        ("T", "T"),
        ("rank", "R"),
        ("adapters", "L"),
        ("pattern", "pattern"),
        ("setting", "setting"),
    ):
        vals = df[col].dropna().unique().tolist() if len(df) else []
        out[key] = sorted(int(v) for v in vals) if col in ("T", "R", "L") else sorted(map(str, vals))
    present = set(df["stage"]) if len(df) else set()
    out["stages"] = [s for s in order if s in present]
    return out


# ------------------------------------------------------------------------------------------------
# One selection
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """One view of the evidence: model preset, tokens T, rank R, adapter slots L, adapter pattern,
    setting ("as_anchor" or "real", see :data:`SETTINGS`) and the stages to compare (registry order)."""

    model: str = "gpt-oss-20b"
    T: int = 64
    rank: int = 32
    adapters: int = 8
    pattern: str = "uniform"
    setting: str = "as_anchor"
    stages: tuple[str, ...] = ("naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add", "tuned")

    def label(self) -> str:
        return (
            f"{self.model} · T = {self.T} · R = {self.rank} · L = {self.adapters} · {self.pattern} · "
            f"{self.setting} · {len(self.stages)} stage{'s' if len(self.stages) != 1 else ''}"
        )

    def validated(self, ev: Evidence) -> Selection:
        """Raise ValueError naming the field when a value is not in the CSVs (:func:`options`)."""
        opts = options(ev)
        for key in ("model", "T", "rank", "adapters", "pattern", "setting"):
            if getattr(self, key) not in opts[key]:
                raise ValueError(
                    f"{key} = {getattr(self, key)!r} is not in the committed CSVs; they hold {opts[key]}"
                )
        bad = [s for s in self.stages if s not in opts["stages"]]
        if bad:
            raise ValueError(f"stages {bad} are not in the committed CSVs; they hold {opts['stages']}")
        return replace(self, stages=tuple(s for s in opts["stages"] if s in self.stages))


def _effective_setting(sel: Selection) -> str:
    """A preset whose own setting is silu without biases (Qwen3) has its real rows labelled as_anchor."""
    from moelora_lib.shapes import get_shape

    try:
        shape = get_shape(sel.model)
    except ValueError:
        return sel.setting
    if sel.setting == "real" and shape.activation == "silu" and not shape.has_bias:
        return "as_anchor"
    return sel.setting


def _pick(df, sel: Selection):
    if not len(df):
        return df
    return df[
        (df["model"] == sel.model)
        & (df["T"] == sel.T)
        & (df["R"] == sel.rank)
        & (df["L"] == sel.adapters)
        & (df["pattern"] == sel.pattern)
        & (df["setting"] == _effective_setting(sel))
    ]


def _anchors_apply(sel: Selection) -> bool:
    return (
        sel.rank == ANCHOR_SETTING["rank"]
        and sel.adapters == ANCHOR_SETTING["adapters"]
        and sel.pattern == ANCHOR_SETTING["pattern"]
        and _effective_setting(sel) == ANCHOR_SETTING["setting"]
    )


def _anchor_row(ev: Evidence, sel: Selection, T: int | None = None):
    if ev.anchors is None or not _anchors_apply(sel):
        return None
    a = ev.anchors[(ev.anchors["model"] == sel.model) & (ev.anchors["T"] == (sel.T if T is None else T))]
    return a.iloc[0] if len(a) else None


def layer_table(ev: Evidence, sel: Selection):
    """Per chosen stage: LoRA part, base MoE and whole layer (µs, median, CUDA-graph replay), the speed-up
    over naive (naive ÷ stage), vLLM's best path ÷ ours, the LoRA part over its floor, and the files.
    Then reference rows: vLLM's best and current paths (where its figures apply: R = 32, L = 8, uniform,
    as_anchor), the H200 floor (bytes at 4.3 TB/s or FLOPs at 675 TFLOP/s, the larger), and the serving
    layer of notebook 09 when its CSV is there. Missing values are NaN.
    """
    import pandas as pd

    rows = _pick(ev.layer, sel)
    piv = (
        rows.pivot_table(index="stage", columns="part", values="us_p50", aggfunc="first")
        if len(rows)
        else None
    )
    naive = {
        p: piv.at["naive", p] if piv is not None and "naive" in piv.index and p in piv else float("nan")
        for p in PARTS
    }
    anchor = _anchor_row(ev, sel)
    out = []
    for st in sel.stages:
        r = {"row": st, "kind": "stage"}
        for p in PARTS:
            r[f"{p}_us"] = (
                float(piv.at[st, p]) if piv is not None and st in piv.index and p in piv else float("nan")
            )
        r["lora_vs_naive"] = naive["lora"] / r["lora_us"]
        r["total_vs_naive"] = naive["total"] / r["total_us"]
        r["vllm_lora_x"] = anchor["lora_best_us"] / r["lora_us"] if anchor is not None else float("nan")
        r["vllm_total_x"] = anchor["total_best_us"] / r["total_us"] if anchor is not None else float("nan")
        src = rows[rows["stage"] == st]
        r["source"] = "; ".join(
            f"{s[:2]} ({', '.join(p for p in PARTS if p in set(g['part']))})"
            for s, g in src.groupby("source", sort=False)
        )
        out.append(r)
    if anchor is not None:
        for label, lora, total in (
            ("vLLM best path", "lora_best_us", "total_best_us"),
            ("vLLM current path", "lora_current_us", "total_current_us"),
        ):
            out.append(
                {
                    "row": label,
                    "kind": "vllm",
                    "lora_us": float(anchor[lora]),
                    "base_us": float(anchor["base_us"]),
                    "total_us": float(anchor[total]),
                    "source": "anchors",
                }
            )
    if len(rows):
        fl = rows.groupby("part")["floor_us"].median()
        out.append(
            {
                "row": "H200 floor",
                "kind": "floor",
                **{f"{p}_us": float(fl.get(p, float("nan"))) for p in PARTS},
                "source": "roofline",
            }
        )
    if ev.serving is not None and _anchors_apply(sel):
        s = ev.serving[(ev.serving["model"] == sel.model) & (ev.serving["T"] == sel.T)]
        for what, us in zip(s["what"], s["us_p50"]):
            if what != "layer_kernels":
                out.append(
                    {
                        "row": f"serving layer: {what}",
                        "kind": "serving",
                        "total_us": float(us),
                        "source": "09",
                    }
                )
    t = pd.DataFrame(
        out,
        columns=[
            "row",
            "kind",
            "lora_us",
            "base_us",
            "total_us",
            "lora_vs_naive",
            "total_vs_naive",
            "vllm_lora_x",
            "vllm_total_x",
            "source",
        ],
    )
    floor = t.loc[t["kind"] == "floor", "lora_us"]
    t.insert(5, "lora_over_floor", t["lora_us"] / float(floor.iloc[0]) if len(floor) else float("nan"))
    t.loc[t["kind"] == "floor", "lora_over_floor"] = float("nan")
    return t


def per_op_table(ev: Evidence, sel: Selection):
    """The six launches (rows, launch order) × the chosen stages that have per-launch rows (µs), with the
    floor of each launch and the files the times come from.

    The floor is the first file's in :data:`PER_OP_FILES` order: 07 counts the (adapter, expert) groups
    its routing touched, as the layer floors of :func:`layer_table` do; 01 and 04–06 assume every (token,
    expert) pair has a group of its own (min(L·E, T·K) adapter weights read), a higher floor.
    ``01_op_costs.csv`` fills launches no per-launch file has."""
    import pandas as pd

    rows = _pick(ev.per_op, sel)
    rows = rows[rows["stage"].isin(sel.stages)]
    t = pd.DataFrame(index=pd.Index(OPS, name="op"))
    for st in sel.stages:
        q = rows[rows["stage"] == st].set_index("op")
        if len(q):
            t[st] = q["us_p50"].reindex(OPS)
    prio = {name: i for i, (name, _) in enumerate(PER_OP_FILES)}
    ranked = rows.assign(_prio=rows["source"].map(prio)).sort_values("_prio", kind="stable")
    floor = ranked.groupby("op")["floor_us"].first().reindex(OPS).astype(float)
    if ev.op_costs is not None and sel.pattern == "uniform":
        oc = ev.op_costs
        oc = oc[
            (oc["model"] == sel.model)
            & (oc["T"] == sel.T)
            & (oc["R"] == sel.rank)
            & (oc["L"] == sel.adapters)
        ]
        floor = floor.fillna(oc.set_index("op")["floor_us"].reindex(OPS)) if len(oc) else floor
    t["floor_us"] = floor.values
    t["source"] = [", ".join(sorted(set(rows.loc[rows["op"] == op, "source"].str[:2]))) for op in OPS]
    return t


def _floor_spread(ev: Evidence, sel: Selection) -> float:
    """The largest ratio (− 1) between two files' floors of one launch at the selection."""
    rows = _pick(ev.per_op, sel)
    if not len(rows):
        return 0.0
    g = rows.groupby("op")["floor_us"]
    return float((g.max() / g.min()).max() - 1)


def selection_notes(ev: Evidence, sel: Selection) -> list[str]:
    """Plain sentences about what the selection lacks and why (and the missing files)."""
    notes = []
    t = layer_table(ev, sel)
    st = t[t["kind"] == "stage"]
    if not len(sel.stages):
        notes.append("No stage chosen: tick at least one stage.")
    none = st[st[["lora_us", "base_us", "total_us"]].isna().all(axis=1)]["row"].tolist()
    if none:
        notes.append(
            f"No committed rows for {', '.join(none)} at this selection "
            "(the CSVs measure each stage at the settings its notebook needed)."
        )
    no_base = st[st["base_us"].isna() & st["lora_us"].notna()]["row"].tolist()
    if no_base:
        notes.append(
            f"Base part not measured on its own for {', '.join(no_base)}: from naive to even_k_fused_add the "
            "stages switch LoRA-op features only and run the same base launches with the same configs; "
            "tuned changes them."
        )
    if "fused" in sel.stages:
        notes.append(
            "fused (notebook 12): its LoRA expand runs inside the base GEMMs, so its LoRA part is "
            "whole − base of the same run (as notebook 12 reports it); its base part is its own 3 launches "
            "(the activation inside gate_up); its launches differ from the six here, so it has no "
            "per-launch bars (data/12_fused.csv has them)."
        )
    if _effective_setting(sel) != sel.setting:
        notes.append(
            f"{sel.model}'s own setting is silu without biases: its 'real' rows are the as_anchor rows."
        )
    if not _anchors_apply(sel):
        notes.append(
            "vLLM's figures apply to R = 32, L = 8, uniform adapter ids, silu without biases: not shown here."
        )
    elif ev.anchors is not None and _anchor_row(ev, sel) is None:
        notes.append(f"vLLM has no figure for {sel.model} at T = {sel.T}.")
    ops = per_op_table(ev, sel)
    if len(ops.columns) <= 2:
        notes.append(
            "No per-launch rows at this selection (07 times the tuned launches at uniform ids; 04-06 "
            "some LoRA ops)."
        )
    spread = _floor_spread(ev, sel)
    if spread > 0.05:
        notes.append(
            f"Per-launch floors: 04–06 record up to {spread:.0%} more than 07 for the same launch (they "
            "assume every (token, expert) pair has an (adapter, expert) group of its own; 07 counts the "
            "groups its routing touched, as the layer floors do). The table and the plot show 07's."
        )
    notes += ev.notes
    return notes


# ------------------------------------------------------------------------------------------------
# Figure and tables
# ------------------------------------------------------------------------------------------------

PART_COLOR = {"lora": "#1f77b4", "base": "#ff7f0e", "total": "#2ca02c"}


def _stage_colors(stages: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    order = stage_order()
    cmap = colormaps["viridis"]
    n = max(1, len(order) - 1)
    return {s: cmap(0.9 * order.index(s) / n) if s in order else "grey" for s in stages}


def _plain_log_ticks(axis, null_locator) -> None:
    """Decades only, labelled 1, 10, 100, ... (no minor ticks, no mathtext): half the redraw time."""
    from matplotlib.ticker import FuncFormatter

    axis.set_minor_locator(null_locator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:  # no "no artists with labels" warning on an empty panel
        ax.legend(**kw)


def figure(ev: Evidence, sel: Selection):
    """Three panels: (1) the chosen stages at T — LoRA part, base and whole layer with vLLM's figures
    (dashed) and the floors (dotted); (2) the LoRA part over T per stage with vLLM's best and the floor;
    (3) the per-launch times at T. A :class:`matplotlib.figure.Figure` (no pyplot state)."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(15, 4.1), dpi=80)  # fixed margins: a layout engine doubles the redraw time
    ax1, ax2, ax3 = fig.subplots(1, 3, width_ratios=[1.25, 1.0, 1.0])
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.16, top=0.93, wspace=0.3)
    t = layer_table(ev, sel)
    st = t[t["kind"] == "stage"].reset_index(drop=True)
    x = np.arange(len(st))
    for i, p in enumerate(PARTS):
        ax1.bar(x + (i - 1) * 0.27, st[f"{p}_us"].fillna(0), 0.27, color=PART_COLOR[p], label=PART_LABEL[p])
    anchor = _anchor_row(ev, sel)
    if anchor is not None:
        for p, col in (("lora", "lora_best_us"), ("base", "base_us"), ("total", "total_best_us")):
            ax1.axhline(anchor[col], color=PART_COLOR[p], ls="--", lw=1.2, label=f"vLLM {PART_LABEL[p]}")
    fl = t[t["kind"] == "floor"]
    if len(fl):
        for p in ("lora", "total"):
            ax1.axhline(
                float(fl[f"{p}_us"].iloc[0]),
                color=PART_COLOR[p],
                ls=":",
                lw=1.2,
                label=f"floor {PART_LABEL[p]}",
            )
    ax1.set_xticks(x, [s.replace("_", "_\n", 1) if len(s) > 10 else s for s in st["row"]], fontsize=8)
    for i, missing in enumerate(st[[f"{p}_us" for p in PARTS]].isna().all(axis=1)):
        if missing:
            ax1.text(x[i], 0, "no rows", ha="center", va="bottom", rotation=90, fontsize=8, color="grey")
    top = np.nanmax([*st[[f"{p}_us" for p in PARTS]].to_numpy().ravel(), *ax1.get_ylim(), 1.0])
    ax1.set_ylim(0, top * 1.4)  # room for the legend above the bars
    ax1.set_ylabel("µs (median, CUDA-graph replay)")
    ax1.set_title(f"{sel.model}, T = {sel.T}", fontsize=10)
    _legend(ax1, fontsize=6.5, ncol=3, loc="upper center")

    colors = _stage_colors(list(sel.stages))
    sweep = (
        ev.layer[
            (ev.layer["model"] == sel.model)
            & (ev.layer["R"] == sel.rank)
            & (ev.layer["L"] == sel.adapters)
            & (ev.layer["pattern"] == sel.pattern)
            & (ev.layer["setting"] == _effective_setting(sel))
            & (ev.layer["part"] == "lora")
        ]
        if len(ev.layer)
        else ev.layer
    )
    for s in sel.stages:
        q = sweep[sweep["stage"] == s].sort_values("T")
        if len(q):
            ax2.plot(q["T"], q["us_p50"], "o-", ms=3, lw=1.3, color=colors[s], label=s)
    if len(sweep):
        f = sweep.groupby("T")["floor_us"].median()
        ax2.plot(f.index, f.values, "k--", lw=1, label="floor")
    if ev.anchors is not None and _anchors_apply(sel):
        a = ev.anchors[ev.anchors["model"] == sel.model].sort_values("T")
        ax2.plot(a["T"], a["lora_best_us"], "k^:", ms=4, label="vLLM best")
    ax2.axvline(sel.T, color="red", lw=0.8, alpha=0.6)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    _plain_log_ticks(ax2.xaxis, NullLocator)
    _plain_log_ticks(ax2.yaxis, NullLocator)
    ax2.set_xlabel("tokens T")
    ax2.set_ylabel("µs")
    ax2.set_title("LoRA part over T", fontsize=10)
    _legend(ax2, fontsize=6.5)

    ops = per_op_table(ev, sel)
    have = [c for c in ops.columns if c not in ("floor_us", "source")]
    y = np.arange(len(OPS))
    if have:
        h = 0.8 / len(have)
        for j, s in enumerate(have):
            ax3.barh(
                y + (j - (len(have) - 1) / 2) * h, ops[s].fillna(0), h, color=colors.get(s, "grey"), label=s
            )
        ax3.plot(ops["floor_us"], y, "k|", ms=12, mew=2, label="floor")
        ax3.set_xscale("log")  # the base GEMMs are 10-50x the LoRA ops
        _plain_log_ticks(ax3.xaxis, NullLocator)
        _legend(ax3, fontsize=6.5)
    else:
        ax3.text(
            0.5,
            0.5,
            "no per-launch rows\nat this selection",
            ha="center",
            va="center",
            transform=ax3.transAxes,
        )
        ax3.set_xticks([])
    ax3.set_yticks(y, OPS, fontsize=8)
    ax3.invert_yaxis()
    ax3.set_xlabel("µs")
    ax3.set_title(f"per launch at T = {sel.T}", fontsize=10)
    return fig


def figure_png(fig, dpi: int = 80) -> bytes:
    """``fig`` rendered to PNG bytes (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


_TABLE_CSS = (
    "<style>.moelora-tab table{border-collapse:collapse;font-size:12px}"
    ".moelora-tab td,.moelora-tab th{padding:2px 8px;text-align:right;border-bottom:1px solid #ddd;"
    "white-space:nowrap}"
    ".moelora-tab th{background:#f3f3f3}.moelora-tab td:first-child{text-align:left}</style>"
)
_COLUMN_LABELS = {
    "row": "",
    "lora_us": "LoRA part µs",
    "base_us": "base µs",
    "total_us": "whole layer µs",
    "lora_vs_naive": "LoRA ×naive",
    "total_vs_naive": "layer ×naive",
    "lora_over_floor": "LoRA ÷ floor",
    "vllm_lora_x": "vLLM LoRA ÷ ours",
    "vllm_total_x": "vLLM layer ÷ ours",
    "source": "from data/NN_*",
    "floor_us": "floor µs",
}


def table_html(df, *, index: bool = False) -> str:
    """``df`` as a compact HTML table (µs with one decimal, ratios with two, NaN as an em dash)."""
    d = df.drop(columns=[c for c in ("kind",) if c in df])

    def fmt(col):
        if str(col).endswith("_x") or "_vs_" in str(col) or "_over_" in str(col):
            return lambda v: f"{v:.2f}×"
        return lambda v: f"{v:,.1f}"

    formatters = {c: fmt(c) for c in d.columns if d[c].dtype.kind == "f"}
    d = d.rename(columns=_COLUMN_LABELS)
    formatters = {_COLUMN_LABELS.get(c, c): f for c, f in formatters.items()}
    body = d.to_html(index=index, na_rep="—", formatters=formatters, border=0, escape=True)
    return f"{_TABLE_CSS}<div class='moelora-tab'>{body}</div>"


# ------------------------------------------------------------------------------------------------
# The kernel lines a stage switches on
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hunk:
    """Consecutive source lines: where (function or "module level"), and (line number, text, hit)."""

    where: str
    lines: tuple[tuple[int, str, bool], ...]

    @property
    def start(self) -> int:
        return self.lines[0][0]

    @property
    def end(self) -> int:
        return self.lines[-1][0]


@dataclass(frozen=True)
class KernelView:
    """What :func:`kernel_view` found for one stage.

    Attributes:
        stage, title: the stage. previous: the stage before it (None for the first).
        switches: Stage field -> (value in the previous stage, value here), for the fields that differ.
        names: the kernel-source names those fields switch (:data:`FEATURES`).
        summary: one paragraph. description: the kernel module's docstring bullets about those names.
        hunks: the source lines (file ``path``), hits marked.
    """

    stage: str
    title: str
    previous: str | None
    switches: dict[str, tuple[Any, Any]]
    names: tuple[str, ...]
    summary: str
    description: str
    hunks: tuple[Hunk, ...]
    path: str


def _docstring_ranges(tree: ast.Module) -> list[tuple[int, int]]:
    out = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.append((first.lineno, first.end_lineno))
    return out


def _docstring_bullets(doc: str, names: tuple[str, ...]) -> str:
    """The ``* ...`` bullets of ``doc`` that mention one of ``names`` (joined, whitespace tidied)."""
    bullets, cur = [], None
    for line in doc.splitlines():
        s = line.strip()
        if s.startswith("* "):
            cur = [s[2:]]
            bullets.append(cur)
        elif cur is not None and s and line.startswith("  "):
            cur.append(s)
        else:
            cur = None
    pat = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    texts = [" ".join(b) for b in bullets]
    # a bullet about the name (in its head, before the first colon) beats one that only mentions it
    about = [t for t in texts if pat.search(t.split(":", 1)[0])]
    return "\n".join(about or [t for t in texts if pat.search(t)])


def _enclosing(tree: ast.Module, line: int) -> str:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start <= line <= node.end_lineno:
                return node.name
    return "module level"


def _out_of_reach(tree: ast.Module, kernels: tuple[str, ...]):
    """A predicate on line numbers: inside a kernel function (``_<name>_kernel``) not in ``kernels``."""
    ranges = [
        (node.lineno, node.end_lineno)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.endswith("_kernel")
        and node.name.removeprefix("_").removesuffix("_kernel") not in kernels
    ]
    return lambda i: any(a <= i <= b for a, b in ranges)


def _regions(
    tree: ast.Module, lines: list[str], names: tuple[str, ...], skip
) -> tuple[list[tuple[int, int]], set[int]]:
    """Line ranges to show and the hit lines for ``names``: every code line naming one of them; an ``if``
    whose test names one is shown whole (both branches); a ``@triton.jit`` helper taking one as a
    parameter is shown whole. ``skip(line)``: lines never shown (docstrings, kernels out of reach)."""
    pat = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    hits = {i for i, text in enumerate(lines, 1) if pat.search(text) and not skip(i)}
    regions = [(i, i) for i in hits]
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno in hits:
            regions.append((node.lineno, node.end_lineno))
        if isinstance(node, ast.FunctionDef) and node.decorator_list and not skip(node.lineno):
            params = {a.arg for a in node.args.args}
            if params & set(names):
                regions.append((node.lineno - len(node.decorator_list), node.end_lineno))
    return regions, hits


MERGE_GAP = 8


def _hunks(tree, lines, regions, hits, skip) -> tuple[Hunk, ...]:
    merged: list[list[int]] = []
    for a, b in sorted(regions):
        # places up to MERGE_GAP lines apart in one function read as one piece of code, gap included
        if (
            merged
            and a <= merged[-1][1] + MERGE_GAP
            and _enclosing(tree, a) == _enclosing(tree, merged[-1][0])
        ):
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple(
        Hunk(
            _enclosing(tree, a),
            tuple((i, lines[i - 1], i in hits) for i in range(a, b + 1) if not skip(i)),
        )
        for a, b in merged
    )


def kernel_view(stage: str, source: str | os.PathLike | None = None) -> KernelView:
    """The kernel-source lines ``stage`` switches on, found from the source (no fixed line numbers).

    The switches are the :class:`~moelora_lib.kernels.Stage` fields that differ from the previous stage
    in :data:`moelora_lib.kernels.STAGES`; each maps to names in the kernel source (:data:`FEATURES`),
    whose lines are located with :mod:`ast` (docstrings left out). The first stage switches nothing on:
    its view is the masked K loops (the ``else`` branches of ``if EVEN_K:``) that it runs. A stage that
    switches no field but is its own Stage subclass (``tuned``) shows the methods it overrides.
    """
    from moelora_lib.kernels import STAGES

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; known: {list(STAGES)}")
    path = Path(source) if source is not None else KERNEL_SOURCE
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    docs = _docstring_ranges(tree)

    def skip(i: int) -> bool:
        return any(a <= i <= b for a, b in docs)

    order = list(STAGES)
    st = STAGES[stage]
    prev = STAGES[order[order.index(stage) - 1]] if order.index(stage) else None
    switches = {}
    if prev is not None:
        for f in fields(st):
            if f.name in FEATURES and getattr(st, f.name) != getattr(prev, f.name):
                switches[f.name] = (getattr(prev, f.name), getattr(st, f.name))
    names = tuple(n for f in switches for n in FEATURES[f])
    module_doc = ast.get_docstring(tree) or ""
    shown = _rel(path)
    if names:
        reach = tuple(dict.fromkeys(k for f in switches for k in FEATURE_KERNELS[f]))
        out = _out_of_reach(tree, reach)
        regions, hits = _regions(tree, lines, names, lambda i: skip(i) or out(i))
        hunks = _hunks(tree, lines, regions, hits, skip)
        what = ", ".join(f"`{f}` {a} → {b}" for f, (a, b) in switches.items())
        pat = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        others = [  # kernels that use these names but that the switch does not reach
            node.name.removeprefix("_").removesuffix("_kernel")
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and node.name.endswith("_kernel")
            and out(node.lineno)
            and pat.search(ast.get_source_segment(text, node) or "")
        ]
        summary = (
            f"Stage `{stage}` ({st.title}) differs from `{prev.name}` by {what}: in `{shown}` that is "
            f"{', '.join(f'`{n}`' for n in names)} in the kernel{'s' if len(reach) > 1 else ''} "
            f"{', '.join(f'`{k}`' for k in reach)} — "
            f"{sum(len(h.lines) for h in hunks)} lines in {len(hunks)} places, {len(hits)} naming it."
            + (
                f" Not shown: {', '.join(f'`{k}`' for k in others)}, which the stage's switch does not reach "
                "(the base GEMM does the same in every stage)."
                if others
                else ""
            )
        )
        description = _docstring_bullets(module_doc, names)
    elif prev is None:
        regions, hits = [], set()
        out = _out_of_reach(tree, FEATURE_KERNELS["even_k"])
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.If)
                and "EVEN_K" in ast.unparse(node.test)
                and node.orelse
                and not out(node.lineno)
            ):
                a, b = node.orelse[0].lineno, node.orelse[-1].end_lineno
                regions.append((a - 1, b))
                hits |= set(range(a, b + 1))
        hunks = _hunks(tree, lines, regions, hits, skip)
        summary = (
            f"Stage `{stage}` ({st.title}) is the starting point: every switch is off "
            f"({', '.join(f'`{f}` = {getattr(st, f)}' for f in FEATURES)}). Its LoRA kernels run the masked "
            "K loops below (the `else` branches of `if EVEN_K:`), SPLIT_K = 1 and GROUP_SIZE_M = 1, and a "
            "separate add puts the LoRA delta into the base output."
        )
        description = _docstring_bullets(module_doc, ("EVEN_K",))
    else:
        own = [
            (name, fn)
            for name, fn in vars(type(st)).items()
            if callable(fn) and not name.startswith("__") and type(st) is not type(prev)
        ]
        hunks_l = []
        path = Path(inspect.getsourcefile(type(st)))
        shown = _rel(path)
        for name, fn in own:
            src, start = inspect.getsourcelines(fn)
            hunks_l.append(
                Hunk(
                    f"{type(st).__name__}.{name}",
                    tuple((start + i, s.rstrip("\n"), True) for i, s in enumerate(src)),
                )
            )
        hunks = tuple(hunks_l)
        summary = (
            f"Stage `{stage}` ({st.title}) switches no kernel line: it runs the kernels of `{prev.name}` "
            f"unchanged. What changes is where its launch configs come from: "
            f"{', '.join(f'`{h.where}`' for h in hunks) or 'nothing'} in `{shown}`."
        )
        description = (inspect.getdoc(type(st)) or "").split("\n\n")[0]
    return KernelView(
        stage, st.title, prev.name if prev else None, switches, names, summary, description, hunks, shown
    )


def _md_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text.replace("``", "`")))


def kernel_view_html(view: KernelView, max_height_px: int = 460) -> str:
    """``view`` as HTML: the summary, the docstring description, then each hunk with line numbers (hits
    highlighted) in a scrolling box."""
    parts = [f"<p>{_md_code(view.summary)}</p>"]
    if view.description:
        parts.append(f"<p style='color:#555'><i>{_md_code(view.description)}</i></p>")
    box = []
    for h in view.hunks:
        box.append(
            f"<div style='color:#888'># {html.escape(view.path)} · {html.escape(h.where)} · "
            f"lines {h.start}–{h.end}</div>"
        )
        for n, text, hit in h.lines:
            line = f"{n:4d}  {html.escape(text)}"
            box.append(f"<span style='background:#fff1a8'>{line}</span>" if hit else line)
        box.append("")
    parts.append(
        f"<pre class='moelora-src' style='max-height:{max_height_px}px;overflow:auto;font-size:11.5px;"
        f"line-height:1.35;background:#fafafa;border:1px solid #e3e3e3;padding:6px'>"
        + "\n".join(box)
        + "</pre>"
    )
    return "".join(parts)


# ------------------------------------------------------------------------------------------------
# Measuring now (GPU) and the tiny correctness check
# ------------------------------------------------------------------------------------------------


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(sel: Selection, *, seed: int = 0, warmup_ms: float = 10, rep_ms: float = 40, before=None):
    """Time the selection now: :func:`moelora_lib.studies.moe_bench.bench_layer` for every chosen stage
    (bf16, CUDA-graph replay, L2 flushed; the weights made once), one row per (stage, part).
    ``before``: a callable run once after the CUDA check, right before measuring (a progress message).

    Raises:
        NeedsGPU: torch sees no CUDA device (the message says so plainly).
    """
    import pandas as pd
    import torch

    if not _has_cuda():
        raise NeedsGPU(NEEDS_GPU)
    if before is not None:  # e.g. say "measuring ..." once it is clear that something will be measured
        before()
    from . import moe_bench as mb

    anchor = _effective_setting(sel) == "as_anchor"
    kw = dict(
        rank=sel.rank,
        num_adapters=sel.adapters,
        pattern=sel.pattern,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed,
        activation="silu" if anchor else None,
        bias=False if anchor else None,
    )
    w = mb.layer_inputs(sel.model, sel.T, **kw)
    rows = []
    for st in sel.stages:
        rows += mb.bench_layer(st, sel.model, sel.T, **kw, weights=w, warmup_ms=warmup_ms, rep_ms=rep_ms)
    del w
    return pd.DataFrame(rows)


def tiny_check(
    stages, *, device: str = "cpu", dtype=None, T: int = 8, seed: int = 0, models=("tiny", "tiny-oss")
):
    """Every stage in ``stages`` at the tiny presets against the fp32 reference
    (:func:`moelora_lib.studies.moe_bench.check_layer`, adapter pattern "mixed": some tokens without an
    adapter). On the CPU the Triton interpreter must be on (``setup`` does it for the CPU profile).

    Returns a DataFrame: stage, model, T, dtype, rel_err, tolerance, delta_rel, no_adapter_rows,
    no_adapter_bitwise, seconds, ok (rel_err within tolerance, tokens without an adapter bit-identical to
    the base layer, and a LoRA contribution that is really there: delta_rel > 0.01).
    """
    import pandas as pd
    import torch

    from moelora_lib.testing import TOLERANCES

    dtype = dtype or torch.float32
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(
            "the check on the CPU runs the kernels through the Triton interpreter: set TRITON_INTERPRET=1 "
            "before any kernel import (moelora_lib.studies.notebook.setup does it for the CPU profile)"
        )
    from . import moe_bench as mb

    rows = []
    for st in stages:
        for m in models:
            t0 = time.perf_counter()
            r = mb.check_layer(st, m, T, rank=16, num_adapters=4, dtype=dtype, device=device, seed=seed)
            r["seconds"] = time.perf_counter() - t0
            r["tolerance"] = TOLERANCES[dtype]
            rows.append(r)
    df = pd.DataFrame(rows)
    df["ok"] = (df.rel_err <= df.tolerance) & df.no_adapter_bitwise & (df.delta_rel > 0.01)
    cols = [
        "stage",
        "model",
        "T",
        "dtype",
        "rel_err",
        "tolerance",
        "delta_rel",
        "no_adapter_rows",
        "no_adapter_bitwise",
        "seconds",
        "ok",
    ]
    return df[cols]


# ------------------------------------------------------------------------------------------------
# The widgets
# ------------------------------------------------------------------------------------------------


def _png_output(png: bytes) -> dict:
    return {
        "output_type": "display_data",
        "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": "<explorer figure>"},
        "metadata": {},
    }


class Explorer:
    """The interactive view (ipywidgets): controls, plot, tables, notes, kernel lines, measure and check.

    ``Explorer(ev, selection, source_stage=..., device=..., dtype=...)``; displaying it (the last line of
    a cell) shows the widgets in JupyterLab, and a static copy (figure and table) where widgets do not
    render (an executed notebook on GitHub). A control change calls :meth:`redraw`; ``last_redraw_s``
    holds how long the last one took. The CSS classes ``moelora-*`` name the parts for browser tests.
    """

    def __init__(
        self,
        ev: Evidence,
        selection: Selection | None = None,
        *,
        source_stage: str = "even_k_fused_add",
        device: str = "cpu",
        dtype=None,
        seed: int = 0,
    ):
        import ipywidgets as w

        self.ev, self.device, self.dtype, self.seed = ev, device, dtype, seed
        self.opts = options(ev)
        self.last_redraw_s = float("nan")
        self.redraws = 0
        self.measured = None
        self.checks = None
        sel = (selection or Selection()).validated(ev) if len(ev.layer) else (selection or Selection())
        dd = dict(style={"description_width": "initial"}, layout=w.Layout(width="auto"))
        labels = {
            "model": "model preset",
            "T": "tokens T",
            "rank": "rank R",
            "adapters": "adapters L",
            "pattern": "adapter pattern",
            "setting": "setting",
        }
        self.controls = {}
        for key, label in labels.items():
            opts = self.opts[key]
            if key == "setting":
                opts = [(f"{k}: {SETTINGS.get(k, k)}", k) for k in opts]
            value = getattr(sel, key) if self.opts[key] else None  # no evidence: empty controls
            self.controls[key] = w.Dropdown(options=opts, value=value, description=label, **dd)
        self.stage_boxes = {
            s: w.Checkbox(value=s in sel.stages, description=s, indent=False, layout=w.Layout(width="auto"))
            for s in self.opts["stages"]
        }
        self._status = w.HTML().add_class("moelora-status")
        self._plot = w.Output().add_class("moelora-plot")
        self._table = w.HTML().add_class("moelora-table")
        self._ops = w.HTML().add_class("moelora-ops")
        self._notes = w.HTML().add_class("moelora-notes")
        self.source_stage = w.Dropdown(
            options=stage_order(), value=source_stage, description="kernel lines of stage", **dd
        )
        self._source = w.HTML().add_class("moelora-source")
        wide = w.Layout(width="auto")
        self.measure_button = w.Button(
            description="measure now (GPU)", icon="play", button_style="warning", layout=wide
        )
        self.check_button = w.Button(
            description="check on tiny shapes", icon="check", button_style="info", layout=wide
        )
        self._measure_out = w.Output().add_class("moelora-measure")
        self._check_out = w.Output().add_class("moelora-check")
        for c in [*self.controls.values(), *self.stage_boxes.values()]:
            c.observe(self.redraw, names="value")
        self.source_stage.observe(self.show_source, names="value")
        self.measure_button.on_click(lambda _b: self.measure_now())
        self.check_button.on_click(lambda _b: self.run_check())
        H = lambda text: w.HTML(f"<h4 style='margin:10px 0 2px'>{text}</h4>")  # noqa: E731
        c = self.controls
        main = w.VBox(
            [
                w.HTML(
                    "<b>The stages side by side</b>, from the committed H200 evidence (data/*.csv; medians, "
                    "CUDA-graph replay, L2 flushed). The controls offer only the values those files hold."
                ),
                w.HBox([c["model"], c["T"], c["rank"], c["adapters"], c["pattern"]]),
                w.HBox([c["setting"]]),
                w.HBox([w.Label("stages:"), *self.stage_boxes.values()]),
                self._status,
                self._plot,
                self._table,
            ]
        ).add_class("moelora-main")
        self.widget = w.VBox(
            [
                main,
                H("Per launch, and the floors"),
                self._ops,
                self._notes,
                H("The kernel lines a stage switches on"),
                self.source_stage,
                self._source,
                H("Measure now, check now"),
                w.HBox([self.measure_button, self.check_button]),
                self._measure_out,
                self._check_out,
            ]
        ).add_class("moelora-explorer")
        if len(ev.layer):
            self.redraw()
        else:
            self._notes.value = "<br>".join(
                map(_md_code, ["No layer times found: nothing to plot.", *ev.notes])
            )
            self._status.value = "<b>no evidence</b>"
        self.show_source()

    # -- state ---------------------------------------------------------------------------------
    def selection(self) -> Selection:
        c = self.controls
        return Selection(
            model=c["model"].value,
            T=int(c["T"].value),
            rank=int(c["rank"].value),
            adapters=int(c["adapters"].value),
            pattern=c["pattern"].value,
            setting=c["setting"].value,
            stages=tuple(s for s, b in self.stage_boxes.items() if b.value),
        )

    def set(self, **values) -> float:
        """Set controls by name (model, T, rank, adapters, pattern, setting; stages= a list of stage
        names, or one name) as a user would; each change redraws. Returns the seconds of the last redraw.

        Raises ValueError for an unknown control name, a value the control does not offer or an unknown
        stage name (naming the known ones); every argument is checked first, so a refused call changes
        nothing."""
        unknown = [k for k in values if k != "stages" and k not in self.controls]
        if unknown:
            raise ValueError(f"unknown control {unknown[0]!r}; controls are {['stages', *self.controls]}")
        for k, v in values.items():  # every value checked before anything changes
            if k == "stages":
                continue
            opts = getattr(self.controls[k], "options", None)
            if opts is not None:
                allowed = [o[1] if isinstance(o, tuple) else o for o in opts]
                if v not in allowed or isinstance(v, bool) != any(isinstance(a, bool) for a in allowed):
                    raise ValueError(f"{k}: {v!r} is not one of the values the evidence holds: {allowed}")
        names = None
        if "stages" in values:
            v = values["stages"]
            if isinstance(v, str):
                names = [v]
            elif isinstance(v, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in v):
                names = list(v)
            else:
                raise ValueError(f"stages must be a stage name or a list of stage names, got {v!r}")
            bad = [n for n in names if n not in self.stage_boxes]
            if bad:
                raise ValueError(
                    f"stages: unknown stage {bad[0]!r}; the stages shown are {list(self.stage_boxes)}"
                )
        for k, v in values.items():
            if k == "stages":
                for s, b in self.stage_boxes.items():
                    b.value = s in names
            else:
                self.controls[k].value = v
        return self.last_redraw_s

    # -- drawing -------------------------------------------------------------------------------
    def redraw(self, *_change) -> None:
        """Rebuild the plot, the tables and the notes for the current selection; the status line is set
        last (a browser test waits on it)."""
        t0 = time.perf_counter()
        sel = self.selection()
        try:
            png = figure_png(figure(self.ev, sel))
            self._plot.outputs = (_png_output(png),)
            self._table.value = table_html(layer_table(self.ev, sel))
            self._ops.value = table_html(per_op_table(self.ev, sel), index=True)
            notes = selection_notes(self.ev, sel)
            self._notes.value = "".join(f"<div style='font-size:12px'>• {_md_code(n)}</div>" for n in notes)
        except Exception as exc:
            self._status.value = f"<b style='color:#b00'>redraw failed:</b> {html.escape(repr(exc))}"
            raise
        self.last_redraw_s = time.perf_counter() - t0
        self.redraws += 1
        self._status.value = f"<span style='font-size:12px'><b>showing</b> {html.escape(sel.label())}</span>"
        self._png = png

    def show_source(self, *_change) -> None:
        self._source.value = kernel_view_html(kernel_view(self.source_stage.value))

    def time_redraws(self):
        """Change every control once to another value the CSVs hold and back (as a user would), timing
        each redraw; returns a DataFrame control, value, seconds. The selection ends as it started."""
        import pandas as pd

        start = self.selection()
        rows = []
        for key, ctl in self.controls.items():
            vals = [o[1] if isinstance(o, tuple) else o for o in ctl.options]
            other = next((v for v in vals if v != ctl.value), None)
            for v in ([other] if other is not None else []) + [ctl.value]:
                if v == ctl.value:
                    ctl.value = v  # no change, no redraw: force one so every control is timed
                    self.redraw()
                else:
                    ctl.value = v
                rows.append(dict(control=key, value=v, seconds=self.last_redraw_s))
        if self.stage_boxes:
            s, box = next(iter(self.stage_boxes.items()))
            for v in (not box.value, box.value):
                box.value = v
                rows.append(dict(control=f"stage {s}", value=v, seconds=self.last_redraw_s))
        assert self.selection() == start
        return pd.DataFrame(rows)

    # -- buttons -------------------------------------------------------------------------------
    def _shown(self, out, show: bool):
        import contextlib

        if not show:
            return contextlib.nullcontext()
        out.clear_output()
        return out

    def measure_now(self, *, show: bool = True):
        """Measure the selection on this machine's GPU (:func:`measure`) beside the committed numbers; on a
        machine without CUDA, say plainly that it needs one (and return None).

        Returns a DataFrame: per chosen stage the LoRA part, base and whole layer measured now and the
        committed ones (µs); the raw rows are kept in ``self.measured``. ``show``: into the widget's
        output area (the button) or, False, into the calling cell's output."""
        from IPython.display import HTML, display

        sel = self.selection()
        with self._shown(self._measure_out, show):
            try:
                df = measure(
                    sel, seed=self.seed, before=lambda: print(f"measuring {sel.label()} on the GPU ...")
                )
            except NeedsGPU as exc:
                display(HTML(f"<b>{html.escape(str(exc))}</b>"))
                return None
            now = df.pivot_table(index="stage", columns="part", values="us_p50").reindex(list(sel.stages))
            t = layer_table(self.ev, sel).set_index("row")
            both = now.reindex(columns=list(PARTS)).rename(columns=lambda p: f"{p}_us_now")
            both = both.join(t[[f"{p}_us" for p in PARTS]].rename(columns=lambda c: f"{c}_committed"))
            both = both.rename_axis("stage").reset_index()
            print(f"measured on: {df['gpu'].iloc[0]}; committed on: NVIDIA H200")
            if show:
                display(HTML(table_html(both)))
        self.measured = df
        return both

    def run_check(self, *, show: bool = True):
        """Run :func:`tiny_check` for the chosen stages (all when none is ticked); returns the DataFrame.
        ``show``: into the widget's output area (the button) or, False, leave the showing to the caller."""
        import torch
        from IPython.display import HTML, display

        stages = self.selection().stages or tuple(self.opts["stages"])
        with self._shown(self._check_out, show):
            where = (
                "the Triton interpreter on the CPU" if self.device == "cpu" else f"the GPU ({self.device})"
            )
            print(f"checking {len(stages)} stages at the tiny presets through {where} ...")
            df = tiny_check(stages, device=self.device, dtype=self.dtype or torch.float32, seed=self.seed)
            if show:
                shown = df.assign(
                    rel_err=df.rel_err.map("{:.1e}".format), tolerance=df.tolerance.map("{:.0e}".format)
                )
                display(HTML(table_html(shown)))
        self.checks = df
        return df

    # -- display -------------------------------------------------------------------------------
    def static_html(self) -> str:
        """The figure and the layer table of the current selection as plain HTML (no widgets)."""
        sel = self.selection()
        png = getattr(self, "_png", None) or figure_png(figure(self.ev, sel))
        img = base64.b64encode(png).decode("ascii")
        return (
            f"<p><b>showing</b> {html.escape(sel.label())} (static copy; open the notebook in JupyterLab for "
            f"the controls)</p><img src='data:image/png;base64,{img}'/>"
            + table_html(layer_table(self.ev, sel))
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = self.widget._repr_mimebundle_(include=include, exclude=exclude)
        if isinstance(data, tuple):
            data = data[0]
        data = dict(data)
        if len(self.ev.layer):
            data["text/html"] = self.static_html()
        return data
