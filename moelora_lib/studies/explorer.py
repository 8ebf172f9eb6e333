"""Notebook 00, the explorer: every stage side by side from the committed H200 evidence, interactively.

:func:`load_evidence` reads the committed GPU CSVs of ``data/`` (never ``data/cpu/``); a missing file is a
note, not an error. No kernel module is imported at import time (``setup`` sets ``TRITON_INTERPRET`` first).
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .bench import REPO_ROOT, data_path
from .notebook import rel

PARTS = ("lora", "base", "total")
PART_LABEL = {"lora": "LoRA part", "base": "base MoE", "total": "whole layer"}
#: Files of whole-layer times, in priority order: for the same row the first wins.
LAYER_FILES = (
    ("06_even_k_fused_add.csv", "notebook 06: stages naive to even_k_fused_add, side by side"),
    ("07_tuning.csv", "notebook 07: stage tuned"),
    ("02_naive_kernel.csv", "notebook 02: stage naive (its base part, the real GPT-OSS setting)"),
    ("12_fused.csv", "notebook 12: stage fused"),
)
SERVING_FILE = ("09_graph.csv", "notebook 09: the serving layer (routing + alignment + launches), one graph")
#: The settings of the layer rows: vLLM's anchor setting (silu, no expert biases) or the preset's own.
SETTINGS = {
    "as_anchor": "silu, no expert biases (vLLM's anchor setting)",
    "real": "the preset's own activation and biases (GPT-OSS: swigluoai + biases)",
}
#: What vLLM's figures (moe_bench.anchor_table) were measured with.
ANCHOR_SETTING = dict(rank=32, adapters=8, pattern="uniform", setting="as_anchor")
_KEY = ["stage", "model", "T", "R", "L", "pattern", "setting"]
_LAYER_COLS = [*_KEY, "part", "us_p50", "us_p20", "us_p80", "floor_us", "config_source", "source"]


@dataclass
class Evidence:
    """The committed evidence, tidy: ``layer`` (one row per stage, model, T, R, L, pattern, setting, part;
    µs), ``anchors`` (or None), ``serving`` (or None), ``notes`` (one per missing or unreadable file),
    ``files`` (name -> rows)."""

    layer: Any
    anchors: Any = None
    serving: Any = None
    notes: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    data_dir: Path = field(default_factory=data_path)


def _read(folder: Path, name: str, what: str, ev: Evidence):
    import pandas as pd

    path = folder / name
    if not path.is_file():
        ev.notes.append(f"`{rel(path)}` not found: {what} are not shown.")
        return None
    try:
        df = pd.read_csv(path)
    except Exception as exc:  # noqa: BLE001 - a broken file is reported, not fatal
        ev.notes.append(
            f"`{rel(path)}` could not be read ({type(exc).__name__}: {exc}): {what} are not shown."
        )
        return None
    ev.files[name] = len(df)
    return df[df["mode"] == "graph"] if "mode" in df else df


def _setting(df):
    """``variant`` where the file has it, else derived: silu without biases is vLLM's anchor setting."""
    plain = (df["activation"].astype(str) == "silu") & ~df["bias"].astype(bool)
    derived = plain.map({True: "as_anchor", False: "real"})
    if "variant" in df:
        return df["variant"].where(df["variant"].notna(), derived).astype(str)
    return derived.astype(str)


def _tidy(df, source: str, cols: list[str]):
    out = df.assign(source=source, T=df["T"].astype(int), R=df["R"].astype(int), L=df["L"].astype(int))
    return out[[c for c in cols if c in out]]


def _with_lora_part(df):
    """Stage ``fused``'s LoRA part as whole − base of the same run, with the LoRA part's floor."""
    import pandas as pd

    key = ["model", "T", "R", "L", "pattern", "activation", "bias"] + (["variant"] if "variant" in df else [])
    f = df[df["stage"] == "fused"]
    have = set(map(tuple, f.loc[f["part"] == "lora", key].itertuples(index=False, name=None)))
    whole = f[f["part"] == "total"].set_index(key)
    base = f[f["part"] == "base"].set_index(key)["us_p50"]
    idx = [k for k in whole.index.intersection(base.index) if k not in have]
    if not idx:
        return df
    lora = whole.loc[idx].copy()
    lora["part"] = "lora"
    lora["us_p50"] = whole.loc[idx, "us_p50"] - base.loc[idx]
    floors = df[df["part"] == "lora"].drop_duplicates(key).set_index(key)["floor_us"]
    lora["floor_us"] = floors.reindex(idx).to_numpy()
    for c in ("us_p20", "us_p80"):
        if c in lora:
            lora[c] = float("nan")
    return pd.concat([df, lora.reset_index()[df.columns]], ignore_index=True)


def load_evidence(data_dir: str | os.PathLike | None = None, *, anchors: bool = True) -> Evidence:
    """Read the evidence from ``data_dir`` (default ``<repo>/data``); missing or unreadable files are skipped
    with a note; ``anchors=False`` skips vLLM's figures."""
    import pandas as pd

    folder = Path(data_dir) if data_dir is not None else data_path()
    ev = Evidence(None, data_dir=folder)
    layer = []
    for name, what in LAYER_FILES:
        if (df := _read(folder, name, f"the layer times of {what}", ev)) is not None:
            df = _with_lora_part(df) if name == "12_fused.csv" else df
            df = df[df["part"].isin(PARTS)]
            layer.append(_tidy(df.assign(setting=_setting(df)), name, _LAYER_COLS))
    layer = pd.concat(layer, ignore_index=True) if layer else pd.DataFrame(columns=_LAYER_COLS)
    ev.layer = layer.drop_duplicates([*_KEY, "part"], keep="first").reset_index(drop=True)
    name, what = SERVING_FILE
    if (folder / name).is_file():
        ev.serving = _read(folder, name, what, ev)
    else:
        ev.notes.append(f"`{rel(folder / name)}` not found: notebook 09 has not been run on the GPU yet.")
    if anchors:
        from . import moe_bench

        path = Path(moe_bench.ANCHOR_FILE)
        if data_dir is not None:
            path = folder / path.relative_to(REPO_ROOT / "data")
        if path.is_file():
            ev.anchors = moe_bench.anchor_table(path)
            ev.files[rel(path)] = len(ev.anchors)
        else:
            ev.notes.append(f"`{rel(path)}` not found: vLLM's figures are not shown.")
    return ev


def stage_order() -> list[str]:
    """The registered stages in order (``moelora_lib.kernels.STAGES``)."""
    from moelora_lib.kernels import STAGES

    return list(STAGES)


def options(ev: Evidence) -> dict[str, list]:
    """The values of each control that the layer rows hold (sorted; stages in registry order)."""
    df = ev.layer
    cols = dict(model="model", T="T", rank="R", adapters="L", pattern="pattern", setting="setting")
    out: dict[str, list] = {}
    for key, col in cols.items():
        vals = df[col].dropna().unique().tolist() if len(df) else []
        out[key] = sorted(int(v) for v in vals) if col in ("T", "R", "L") else sorted(map(str, vals))
    present = set(df["stage"]) if len(df) else set()
    out["stages"] = [s for s in stage_order() if s in present]
    return out


def describe(ev: Evidence) -> str:
    """A few lines: which files were read (rows), the values the controls offer, the missing files."""
    opts = options(ev)
    lines = [f"evidence read from {rel(ev.data_dir)}/ (GPU run, read-only):"]
    lines += [f"  {name}: {n} rows" for name, n in ev.files.items()]
    lines.append("controls offer what the CSVs hold: " + "; ".join(f"{k} {v}" for k, v in opts.items()))
    return "\n".join(lines + [f"note: {n}" for n in ev.notes])


@dataclass(frozen=True)
class Selection:
    """One view of the evidence: model, T, R, L, pattern, setting (:data:`SETTINGS`) and the stages to
    compare."""

    model: str = "gpt-oss-20b"
    T: int = 64
    rank: int = 32
    adapters: int = 8
    pattern: str = "uniform"
    setting: str = "as_anchor"
    stages: tuple[str, ...] = ("naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add", "tuned")

    def label(self) -> str:
        n, head = len(self.stages), f"{self.model} · T = {self.T} · R = {self.rank} · L = {self.adapters}"
        return f"{head} · {self.pattern} · {self.setting} · {n} stage{'s' if n != 1 else ''}"

    def validated(self, ev: Evidence) -> Selection:
        """Raise ValueError naming the field when a value is not in the CSVs (:func:`options`)."""
        opts = options(ev)
        for key, have in opts.items():
            value = getattr(self, key)
            if (key == "stages" and set(value) - set(have)) or (key != "stages" and value not in have):
                raise ValueError(f"{key} = {value!r} is not in the committed CSVs; they hold {have}")
        return replace(self, stages=tuple(s for s in opts["stages"] if s in self.stages))


def _effective_setting(sel: Selection) -> str:
    """A preset whose own setting is silu without biases (Qwen3) has its real rows labelled as_anchor."""
    from moelora_lib.shapes import get_shape

    try:
        shape = get_shape(sel.model)
    except ValueError:
        return sel.setting
    plain = shape.activation == "silu" and not shape.has_bias
    return "as_anchor" if sel.setting == "real" and plain else sel.setting


def _pick(df, sel: Selection, *, every_T: bool = False):
    if not len(df):
        return df
    m = (df["model"] == sel.model) & (df["R"] == sel.rank) & (df["L"] == sel.adapters)
    m &= (df["pattern"] == sel.pattern) & (df["setting"] == _effective_setting(sel))
    return df[m if every_T else m & (df["T"] == sel.T)]


def _applies(sel: Selection) -> bool:
    """Whether vLLM's figures apply to ``sel`` (:data:`ANCHOR_SETTING`)."""
    here = dict(rank=sel.rank, adapters=sel.adapters, pattern=sel.pattern, setting=_effective_setting(sel))
    return here == ANCHOR_SETTING


def _anchor_row(ev: Evidence, sel: Selection):
    if ev.anchors is None or not _applies(sel):
        return None
    q = ev.anchors[(ev.anchors["model"] == sel.model) & (ev.anchors["T"] == sel.T)]
    return q.iloc[0] if len(q) else None


def layer_table(ev: Evidence, sel: Selection):
    """Per chosen stage: LoRA part, base MoE and whole layer (µs), the speed-up over naive, vLLM's best ÷
    ours, the LoRA part over its floor and the files; then reference rows (vLLM's paths where they apply, the
    H200 floor, notebook 09's serving layer). Missing values are NaN."""
    import pandas as pd

    nan = float("nan")
    rows = _pick(ev.layer, sel)
    piv = rows.pivot_table(index="stage", columns="part", values="us_p50", aggfunc="first")

    def us(stage, part):
        return float(piv.at[stage, part]) if stage in piv.index and part in piv else nan

    anchor = _anchor_row(ev, sel)
    out = []
    for st in sel.stages:
        r = {"row": st, "kind": "stage", **{f"{p}_us": us(st, p) for p in PARTS}}
        r["lora_vs_naive"] = us("naive", "lora") / r["lora_us"]
        r["total_vs_naive"] = us("naive", "total") / r["total_us"]
        r["vllm_lora_x"] = anchor["lora_best_us"] / r["lora_us"] if anchor is not None else nan
        r["vllm_total_x"] = anchor["total_best_us"] / r["total_us"] if anchor is not None else nan
        src = rows[rows["stage"] == st].groupby("source", sort=False)["part"]
        r["source"] = "; ".join(f"{s[:2]} ({', '.join(p for p in PARTS if p in set(g))})" for s, g in src)
        out.append(r)
    if anchor is not None:
        for label, kind in (("vLLM best path", "best"), ("vLLM current path", "current")):
            us_ = {f"{p}_us": float(anchor[f"{p}_{kind}_us" if p != "base" else "base_us"]) for p in PARTS}
            out.append(dict(row=label, kind="vllm", **us_, source="anchors"))
    if len(rows):
        fl = rows.groupby("part")["floor_us"].median()
        floors = {f"{p}_us": float(fl.get(p, nan)) for p in PARTS}
        out.append(dict(row="H200 floor", kind="floor", **floors, source="roofline"))
    if ev.serving is not None and _applies(sel):
        s = ev.serving[(ev.serving["model"] == sel.model) & (ev.serving["T"] == sel.T)]
        for what, v in zip(s["what"], s["us_p50"]):
            if what != "layer_kernels":
                out.append(dict(row=f"serving layer: {what}", kind="serving", total_us=float(v), source="09"))
    cols = ["row", "kind", "lora_us", "base_us", "total_us", "lora_vs_naive", "total_vs_naive"]
    t = pd.DataFrame(out, columns=[*cols, "vllm_lora_x", "vllm_total_x", "source"])
    floor = t.loc[t["kind"] == "floor", "lora_us"]
    t.insert(5, "lora_over_floor", t["lora_us"] / float(floor.iloc[0]) if len(floor) else nan)
    t.loc[t["kind"] == "floor", "lora_over_floor"] = nan
    return t


def selection_notes(ev: Evidence, sel: Selection) -> list[str]:
    """Plain sentences about what the selection lacks and why (and the missing files)."""
    notes = [] if sel.stages else ["No stage chosen: tick at least one stage."]
    st = layer_table(ev, sel)
    st = st[st["kind"] == "stage"]
    none = st[st[["lora_us", "base_us", "total_us"]].isna().all(axis=1)]["row"].tolist()
    if none:
        notes.append(f"No committed rows for {', '.join(none)} at this selection (the CSVs measure each "
                     "stage at the settings its notebook needed).")  # fmt: skip
    no_base = st[st["base_us"].isna() & st["lora_us"].notna()]["row"].tolist()
    if no_base:
        notes.append(f"Base part not measured on its own for {', '.join(no_base)}: from naive to "
                     "even_k_fused_add the stages switch LoRA-op features only.")  # fmt: skip
    if "fused" in sel.stages:
        notes.append("fused: its LoRA expand runs inside the base GEMMs, so its LoRA part is whole − base of "
                     "the same run (data/12_fused.csv has its launches).")  # fmt: skip
    if _effective_setting(sel) != sel.setting:
        notes.append(
            f"{sel.model}'s own setting is silu without biases: its 'real' rows are the as_anchor rows."
        )
    if not _applies(sel):
        notes.append("vLLM's figures apply to R = 32, L = 8, uniform adapter ids, silu without biases only.")
    elif ev.anchors is not None and _anchor_row(ev, sel) is None:
        notes.append(f"vLLM has no figure for {sel.model} at T = {sel.T}.")
    return notes + ev.notes


# --- Figure and tables --------------------------------------------------------------------------------------

PART_COLOR = {"lora": "#1f77b4", "base": "#ff7f0e", "total": "#2ca02c"}


def figure(ev: Evidence, sel: Selection):
    """Two panels: the chosen stages at T, and the LoRA part over T per stage; a matplotlib Figure."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig = Figure(figsize=(13, 4.1), dpi=80)  # fixed margins: a layout engine doubles the redraw time
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1.3, 1.0])
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.16, top=0.93, wspace=0.2)
    t = layer_table(ev, sel)
    st = t[t["kind"] == "stage"].reset_index(drop=True)
    x = np.arange(len(st))
    for i, p in enumerate(PARTS):
        ax1.bar(x + (i - 1) * 0.27, st[f"{p}_us"].fillna(0), 0.27, color=PART_COLOR[p], label=PART_LABEL[p])
    anchor = _anchor_row(ev, sel)
    for p, col in (("lora", "lora_best_us"), ("base", "base_us"), ("total", "total_best_us")):
        if anchor is not None:
            ax1.axhline(anchor[col], color=PART_COLOR[p], ls="--", lw=1.2, label=f"vLLM {PART_LABEL[p]}")
    for _, r in t[t["kind"] == "floor"].iterrows():
        for p in ("lora", "total"):
            ax1.axhline(r[f"{p}_us"], color=PART_COLOR[p], ls=":", lw=1.2, label=f"floor {PART_LABEL[p]}")
    ax1.set_xticks(x, [s.replace("_", "_\n", 1) if len(s) > 10 else s for s in st["row"]], fontsize=8)
    top = np.nanmax([*st[[f"{p}_us" for p in PARTS]].to_numpy().ravel(), *ax1.get_ylim(), 1.0])
    ax1.set_ylim(0, top * 1.4)  # room for the legend above the bars
    ax1.set_ylabel("µs (median, CUDA-graph replay)")
    ax1.set_title(f"{sel.model}, T = {sel.T}", fontsize=10)
    order = stage_order()
    sweep = _pick(ev.layer, sel, every_T=True)
    sweep = sweep[sweep["part"] == "lora"] if len(sweep) else sweep
    for s in sel.stages:
        q = sweep[sweep["stage"] == s].sort_values("T")
        c = colormaps["viridis"](0.9 * order.index(s) / max(1, len(order) - 1)) if s in order else "grey"
        if len(q):
            ax2.plot(q["T"], q["us_p50"], "o-", ms=3, lw=1.3, color=c, label=s)
    if len(sweep):
        f = sweep.groupby("T")["floor_us"].median()
        ax2.plot(f.index, f.values, "k--", lw=1, label="floor")
    if ev.anchors is not None and _applies(sel):
        a = ev.anchors[ev.anchors["model"] == sel.model].sort_values("T")
        ax2.plot(a["T"], a["lora_best_us"], "k^:", ms=4, label="vLLM best")
    ax2.axvline(sel.T, color="red", lw=0.8, alpha=0.6)
    ax2.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs")
    for axis in (ax2.xaxis, ax2.yaxis):  # decades labelled 1, 10, 100 (no mathtext: half the redraw time)
        axis.set_minor_locator(NullLocator())
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax2.set_title("LoRA part over T", fontsize=10)
    for ax, kw in ((ax1, dict(ncol=3, loc="upper center")), (ax2, {})):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5, **kw)
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
    "white-space:nowrap}.moelora-tab th{background:#f3f3f3}"
    ".moelora-tab td:first-child{text-align:left}</style>"
)
_COLUMN_LABELS = dict(row="", lora_us="LoRA part µs", base_us="base µs", total_us="whole layer µs")
_COLUMN_LABELS |= dict(lora_vs_naive="LoRA ×naive", total_vs_naive="layer ×naive")
_COLUMN_LABELS |= dict(lora_over_floor="LoRA ÷ floor", vllm_lora_x="vLLM LoRA ÷ ours")
_COLUMN_LABELS |= dict(vllm_total_x="vLLM layer ÷ ours", floor_us="floor µs", source="from data/NN_*")


def table_html(df, *, index: bool = False) -> str:
    """``df`` as a compact HTML table (µs with one decimal, ratios with two, NaN as an em dash)."""
    d = df.drop(columns=[c for c in ("kind",) if c in df])

    def fmt(col):
        ratio = col.endswith("_x") or "_vs_" in col or "_over_" in col
        return (lambda v: f"{v:.2f}×") if ratio else (lambda v: f"{v:,.1f}")

    formatters = {_COLUMN_LABELS.get(c, c): fmt(str(c)) for c in d.columns if d[c].dtype.kind == "f"}
    body = d.rename(columns=_COLUMN_LABELS).to_html(index=index, na_rep="—", formatters=formatters, border=0)
    return f"{_TABLE_CSS}<div class='moelora-tab'>{body}</div>"


def kernel_change_html(stage: str) -> str:
    """The kernel lines ``stage`` changes against the stage before it, as HTML."""
    from .notebook import show_kernel_change, stage_kernel_source

    order = stage_order()
    i = order.index(stage)
    prev = order[i - 1] if i else None
    text = show_kernel_change(prev, stage, show=False) if prev else stage_kernel_source(stage)
    head = f"What <code>{stage}</code> changes in the kernels against <code>{prev}</code>:"
    if not prev:
        head = f"Stage <code>{stage}</code> is the starting point: its kernels."
    elif not text:
        head = f"<code>{stage}</code> launches the kernels of <code>{prev}</code> unchanged."
    color = {"+": "#e6ffed", "-": "#ffeef0", "@": "#f1f8ff"}
    esc = [(ln[:1], html.escape(ln)) for ln in text.splitlines()]
    lines = [f"<span style='background:{color[c]}'>{e}</span>" if c in color else e for c, e in esc]
    style = "max-height:460px;overflow:auto;font-size:11.5px;background:#fafafa;border:1px solid #e3e3e3"
    return f"<p>{head}</p><pre class='moelora-src' style='{style};padding:6px'>" + "\n".join(lines) + "</pre>"


# --- The widgets --------------------------------------------------------------------------------------------


def _md_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


class Explorer:
    """The interactive view (ipywidgets): controls, plot, layer table, notes and the kernel lines a stage
    changes; a static copy where widgets do not render. A control change calls :meth:`redraw`
    (``last_redraw_s``). CSS classes ``moelora-*`` name the parts."""

    LABELS = dict(model="model preset", T="tokens T", rank="rank R", adapters="adapters L")
    LABELS.update(pattern="adapter pattern", setting="setting")

    def __init__(
        self, ev: Evidence, selection: Selection | None = None, *, source_stage: str = "even_k_fused_add"
    ):
        import ipywidgets as w

        self.ev, self.opts, self.last_redraw_s, self._png = ev, options(ev), float("nan"), None
        sel = selection or Selection()
        sel = sel.validated(ev) if len(ev.layer) else sel
        dd = dict(style={"description_width": "initial"}, layout=w.Layout(width="auto"))
        self.controls = {}
        for key, label in self.LABELS.items():
            opts = self.opts[key]
            shown = [(f"{k}: {SETTINGS.get(k, k)}", k) for k in opts] if key == "setting" else opts
            value = getattr(sel, key) if opts else None  # no evidence: empty controls
            self.controls[key] = w.Dropdown(options=shown, value=value, description=label, **dd)
        self.stage_boxes = {
            s: w.Checkbox(value=s in sel.stages, description=s, indent=False, layout=w.Layout(width="auto"))
            for s in self.opts["stages"]
        }
        self._status, self._table = w.HTML().add_class("moelora-status"), w.HTML().add_class("moelora-table")
        self._plot, self._notes = w.Output().add_class("moelora-plot"), w.HTML().add_class("moelora-notes")
        self.source_stage = w.Dropdown(
            options=stage_order(), value=source_stage, description="kernel lines of stage", **dd
        )
        self._source = w.HTML().add_class("moelora-source")
        for c in [*self.controls.values(), *self.stage_boxes.values()]:
            c.observe(self.redraw, names="value")
        self.source_stage.observe(self.show_source, names="value")
        c = self.controls
        intro = (
            "<b>The stages side by side</b>, from the committed H200 evidence (data/*.csv; medians, "
            "CUDA-graph replay, L2 flushed). The controls offer only the values those files hold."
        )
        rows = [[c["model"], c["T"], c["rank"], c["adapters"], c["pattern"]], [c["setting"]]]
        rows.append([w.Label("stages:"), *self.stage_boxes.values()])
        main = [w.HTML(intro), *map(w.HBox, rows), self._status, self._plot, self._table]
        head = w.HTML("<h4 style='margin:10px 0 2px'>The kernel lines a stage changes</h4>")
        parts = [w.VBox(main).add_class("moelora-main"), self._notes, head, self.source_stage, self._source]
        self.widget = w.VBox(parts).add_class("moelora-explorer")
        if len(ev.layer):
            self.redraw()
        else:
            self._notes.value = "<br>".join(
                map(_md_code, ["No layer times found: nothing to plot.", *ev.notes])
            )
            self._status.value = "<b>no evidence</b>"
        self.show_source()

    def selection(self) -> Selection:
        c = {k: ctl.value for k, ctl in self.controls.items()}
        stages = tuple(s for s, b in self.stage_boxes.items() if b.value)
        return Selection(
            c["model"], int(c["T"]), int(c["rank"]), int(c["adapters"]), c["pattern"], c["setting"], stages
        )

    def redraw(self, *_change) -> None:
        """Rebuild the plot, the tables and the notes; the status line is set last."""
        t0 = time.perf_counter()
        sel = self.selection()
        try:
            png = figure_png(figure(self.ev, sel))
            image = {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": "<explorer figure>"}
            self._plot.outputs = ({"output_type": "display_data", "data": image, "metadata": {}},)
            self._table.value = table_html(layer_table(self.ev, sel))
            notes = selection_notes(self.ev, sel)
            self._notes.value = "".join(f"<div style='font-size:12px'>• {_md_code(n)}</div>" for n in notes)
        except Exception as exc:
            self._status.value = f"<b style='color:#b00'>redraw failed:</b> {html.escape(repr(exc))}"
            raise
        self.last_redraw_s = time.perf_counter() - t0
        self._status.value = f"<span style='font-size:12px'><b>showing</b> {html.escape(sel.label())}</span>"
        self._png = png

    def show_source(self, *_change) -> None:
        self._source.value = kernel_change_html(self.source_stage.value)

    def time_redraws(self):
        """Change every control once to another value and back, timing each redraw; returns a DataFrame
        control, value, seconds."""
        import pandas as pd

        rows = []
        for key, ctl in self.controls.items():
            start = ctl.value
            other = next(
                (v for o in ctl.options if (v := o[1] if isinstance(o, tuple) else o) != start), None
            )
            for v in [other, start] if other is not None else [start]:
                if v == ctl.value:
                    self.redraw()  # no change, no redraw: force one so every control is timed
                ctl.value = v
                rows.append(dict(control=key, value=v, seconds=self.last_redraw_s))
        return pd.DataFrame(rows)

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = self.widget._repr_mimebundle_(include=include, exclude=exclude)
        data = dict(data[0] if isinstance(data, tuple) else data)
        if len(self.ev.layer):  # a static copy where widgets do not render
            sel = self.selection()
            img = base64.b64encode(self._png or figure_png(figure(self.ev, sel))).decode("ascii")
            data["text/html"] = (
                f"<p><b>showing</b> {html.escape(sel.label())} (static copy; open the notebook in JupyterLab "
                f"for the controls)</p><img src='data:image/png;base64,{img}'/>"
                + table_html(layer_table(self.ev, sel))
            )
        return data
