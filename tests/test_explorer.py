"""The explorer of notebook 00 without a browser (moelora_lib/studies/explorer.py).

Data: the committed GPU CSVs in data/ (read-only); the numbers the tables must show are recomputed here from
those files with plain pandas. Missing files are simulated in a temp folder. The notebook itself runs end to
end under papermill on the CPU profile, as the runner runs it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from moelora_lib.kernels import STAGES
from moelora_lib.studies import explorer as ex

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


def _tuned_total_1600() -> str:
    """tuned's whole layer at GPT-OSS-20B T = 1600 as the explorer's table prints it (committed CSV)."""
    c = pd.read_csv(DATA / "07_cumulative.csv").set_index(["model", "T", "part"])
    return f"{c.at[('gpt-oss-20b', 1600, 'total'), 'tuned']:,.1f}"


NEEDED = ["06_even_k_fused_add.csv", "07_tuning.csv", "02_naive_kernel.csv"]


@pytest.fixture(scope="module")
def ev() -> ex.Evidence:
    missing = [n for n in NEEDED if not (DATA / n).is_file()]
    if missing:
        pytest.skip(f"committed evidence not in this checkout: {missing}")
    return ex.load_evidence()


def _csv(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name)


# ---- loading -----------------------------------------------------------------------------------------


def test_options_are_the_values_the_csvs_hold(ev):
    opts = ex.options(ev)
    d6, d7 = _csv("06_even_k_fused_add.csv"), _csv("07_tuning.csv")
    # every registered stage has committed layer times, in order (fused: notebook 12's)
    assert opts["stages"] == list(STAGES)
    assert set(opts["model"]) == set(d6.model) | set(d7.model)
    assert opts["T"] == sorted(set(d6["T"]) | set(d7["T"]))
    assert opts["rank"] == sorted(set(d6.R) | set(d7.R)) and opts["adapters"] == sorted(set(d6.L) | set(d7.L))
    assert set(opts["pattern"]) == set(d6.pattern) | set(d7.pattern)
    assert "as_anchor" in opts["setting"]
    text = ex.describe(ev)
    assert "06_even_k_fused_add.csv" in text and "rank [32]" in text


def test_fused_rows_come_from_notebook_12_and_tuned_stays_notebook_07s(ev):
    d12, d7 = _csv("12_fused.csv"), _csv("07_tuning.csv")
    sel = ex.Selection("qwen3-30b-a3b", 1600, stages=("tuned", "fused")).validated(ev)
    t = ex.layer_table(ev, sel).set_index("row")

    def us(df, stage, part):
        q = df[(df.stage == stage) & (df.part == part) & (df.model == "qwen3-30b-a3b") & (df["T"] == 1600)]
        q = q[
            (q.pattern == "uniform")
            & (q.activation == "silu")
            & ~q.bias.astype(bool)
            & (q.R == 32)
            & (q.L == 8)
        ]
        assert len(q) == 1, q
        return float(q.us_p50.iloc[0])

    assert t.at["fused", "total_us"] == pytest.approx(us(d12, "fused", "total"))
    # notebook 12 times fused whole and its base part; its LoRA part is whole − base (as notebook 12 says)
    assert t.at["fused", "base_us"] == pytest.approx(us(d12, "fused", "base"))
    assert t.at["fused", "lora_us"] == pytest.approx(us(d12, "fused", "total") - us(d12, "fused", "base"))
    assert t.at["tuned", "total_us"] == pytest.approx(us(d7, "tuned", "total"))
    # fused was measured in vLLM's setting with R = 32, L = 8, uniform ids only
    other = ex.Selection("gpt-oss-20b", 64, pattern="zipf", stages=("tuned", "fused")).validated(ev)
    assert ex.layer_table(ev, other).set_index("row").loc["fused", ["lora_us", "total_us"]].isna().all()


def test_layer_table_matches_the_csvs(ev):
    sel = ex.Selection("gpt-oss-20b", 64).validated(ev)
    t = ex.layer_table(ev, sel).set_index("row")
    d6, d7, d2 = _csv("06_even_k_fused_add.csv"), _csv("07_tuning.csv"), _csv("02_naive_kernel.csv")

    def us(df, stage, part, **kw):
        q = df[(df.stage == stage) & (df.part == part) & (df.model == "gpt-oss-20b") & (df["T"] == 64)]
        q = q[(q.pattern == "uniform") & (q.activation == "silu") & ~q.bias.astype(bool)]
        if "mode" in q:
            q = q[q["mode"] == "graph"]
        assert len(q) == 1, (stage, part, len(q))
        return float(q.us_p50.iloc[0])

    assert t.at["naive", "lora_us"] == pytest.approx(us(d6, "naive", "lora"))  # 06 wins over 02
    assert t.at["naive", "base_us"] == pytest.approx(us(d2, "naive", "base"))  # only 02 has it
    assert t.at["swizzle", "total_us"] == pytest.approx(us(d6, "swizzle", "total"))
    assert math.isnan(t.at["swizzle", "base_us"])  # not measured alone: shown as missing, not invented
    assert t.at["tuned", "lora_us"] == pytest.approx(us(d7, "tuned", "lora"))
    assert t.at["tuned", "lora_vs_naive"] == pytest.approx(us(d6, "naive", "lora") / us(d7, "tuned", "lora"))
    a = ev.anchors.set_index(["model", "T"]).loc[("gpt-oss-20b", 64)]
    assert t.at["tuned", "vllm_total_x"] == pytest.approx(a.total_best_us / us(d7, "tuned", "total"))
    assert t.at["vLLM best path", "lora_us"] == pytest.approx(a.lora_best_us)
    assert t.at["H200 floor", "lora_us"] == pytest.approx(
        us(d6, "naive", "lora") / t.at["naive", "lora_over_floor"]
    )
    html = ex.table_html(ex.layer_table(ev, sel))
    assert "—" in html and "LoRA part µs" in html


def test_selection_without_vllm_figures_or_rows_says_so(ev):
    sel = ex.Selection("gpt-oss-20b", 64, pattern="zipf").validated(ev)
    t = ex.layer_table(ev, sel)
    assert not (t.kind == "vllm").any()  # vLLM's figures are for uniform adapter ids only
    assert t.set_index("row").loc["tuned", ["lora_us", "base_us", "total_us"]].isna().all()
    notes = " ".join(ex.selection_notes(ev, sel))
    assert "No committed rows for tuned" in notes and "vLLM's figures apply to" in notes
    real = ex.Selection("qwen3-30b-a3b", 8, setting="real").validated(ev)
    assert "its 'real' rows are the as_anchor rows" in " ".join(ex.selection_notes(ev, real))
    assert ex.layer_table(ev, real).set_index("row").at["tuned", "lora_us"] > 0
    with pytest.raises(ValueError, match="rank = 16 is not in the committed CSVs"):
        ex.Selection(rank=16).validated(ev)


def test_missing_files_are_notes_not_errors(tmp_path):
    only = tmp_path / "data"
    only.mkdir()
    shutil.copy(DATA / "06_even_k_fused_add.csv", only)
    ev = ex.load_evidence(only)
    assert ev.anchors is None and ev.serving is None
    notes = " ".join(ev.notes)
    for name in ("07_tuning.csv", "02_naive_kernel.csv", "09_graph.csv", "vllm_vs_moelora"):
        assert name in notes, name
    assert "notebook 09 has not been run on the GPU yet" in notes
    assert "tuned" not in ex.options(ev)["stages"]
    e = ex.Explorer(ev, ex.Selection(stages=("naive", "even_k_fused_add")))
    assert "07_tuning.csv" in e._notes.value and e._plot.outputs

    empty = ex.load_evidence(tmp_path / "nothing")
    assert len(empty.layer) == 0 and ex.options(empty)["model"] == []
    e = ex.Explorer(empty)
    assert "No layer times found" in e._notes.value and not e._plot.outputs
    assert "text/html" not in e._repr_mimebundle_()


def test_serving_rows_when_notebook_09_has_run(ev, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(DATA, folder, ignore=shutil.ignore_patterns("executed", "cpu", "figures", "env", "dev"))
    pd.DataFrame(
        [
            dict(model="gpt-oss-20b", T=64, mode="graph", us_p50=u, what=w)
            for w, u in (("layer_kernels", 470.0), ("module_topk", 481.5))
        ]
    ).to_csv(folder / "09_graph.csv", index=False)
    ev9 = ex.load_evidence(folder)
    t = ex.layer_table(ev9, ex.Selection("gpt-oss-20b", 64)).set_index("row")
    assert t.at["serving layer: module_topk", "total_us"] == 481.5
    assert "serving layer: layer_kernels" not in t.index
    assert not any("09_graph" in n for n in ev9.notes)


# ---- figure, widgets, redraw time --------------------------------------------------------------------


def test_figure_png(ev):
    png = ex.figure_png(ex.figure(ev, ex.Selection("qwen3-30b-a3b", 1600)))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def set_controls(e: ex.Explorer, **values) -> float:
    """Set the controls of ``e`` by name (model, T, rank, adapters, pattern, setting, stages) as a user would;
    returns the seconds of the last redraw. ValueError for an unknown control, value or stage; a refused call
    changes nothing."""
    for k, v in values.items():  # every value checked before anything changes
        if k == "stages":
            names = [v] if isinstance(v, str) else v
            if not isinstance(names, (list, tuple, set, frozenset)) or set(names) - set(e.stage_boxes):
                raise ValueError(
                    f"stages: expected a stage name or a list of {list(e.stage_boxes)}, got {v!r}"
                )
        elif k not in e.controls:
            raise ValueError(f"unknown control {k!r}; controls are {['stages', *e.controls]}")
        elif v not in (allowed := [o[1] if isinstance(o, tuple) else o for o in e.controls[k].options]):
            raise ValueError(f"{k}: {v!r} is not one of the values the evidence holds: {allowed}")
    for k, v in values.items():
        if k == "stages":
            for s, b in e.stage_boxes.items():
                b.value = s in names
        else:
            e.controls[k].value = v
    return e.last_redraw_s


def test_set_stages_by_name_and_bad_names(ev):
    e = ex.Explorer(ev, ex.Selection("gpt-oss-20b", 64))
    set_controls(e, stages="tuned")  # one name, not a substring match ("tuned" must not also tick others)
    assert e.selection().stages == ("tuned",)
    set_controls(e, stages=["naive", "tuned"])
    assert e.selection().stages == ("naive", "tuned")
    with pytest.raises(ValueError, match="stages: expected a stage name or a list of"):
        set_controls(e, stages=["tune"])
    with pytest.raises(ValueError, match="unknown control 'tokens'"):
        set_controls(e, tokens=64)
    assert e.selection().stages == ("naive", "tuned")  # a refused call changes nothing
    before = e.selection()
    with pytest.raises(ValueError, match="stages: expected a stage name or a list of"):
        set_controls(e, model="qwen3-30b-a3b", stages="bogus")  # checked before the model changes
    with pytest.raises(ValueError, match="T: 12345 is not one of the values"):
        set_controls(e, T=12345)
    for bad in ({"fused": True}, b"fused", None, 5):
        with pytest.raises(ValueError, match="stages: expected a stage name or a list of"):
            set_controls(e, stages=bad)
    assert e.selection() == before


def test_a_control_change_redraws_plot_and_table(ev):
    e = ex.Explorer(ev, ex.Selection("gpt-oss-20b", 64))
    png, table = e._plot.outputs[0]["data"]["image/png"], e._table.value
    set_controls(e, T=1600)
    assert e._plot.outputs[0]["data"]["image/png"] != png and e._table.value != table
    assert "T = 1600" in e._status.value and _tuned_total_1600() in e._table.value
    times = e.time_redraws()
    assert set(times.control) >= {"model", "T", "rank", "adapters", "pattern", "setting"}
    assert (times.seconds > 0).all(), times  # timed, not asserted against a limit (a benchmark, not a test)
    assert e.selection() == ex.Selection("gpt-oss-20b", 1600)  # time_redraws ends where it started
    bundle = e._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # JupyterLab: the widgets
    assert "data:image/png;base64," in bundle["text/html"]  # elsewhere: a static copy


# ---- the kernel lines a stage changes -----------------------------------------------------------------


def test_kernel_change_html_follows_show_kernel_change():
    from moelora_lib.studies.notebook import show_kernel_change

    html = ex.kernel_change_html("even_k_fused_add")
    assert "against <code>swizzle</code>" in html
    added = [
        ln for ln in show_kernel_change("swizzle", "even_k_fused_add").splitlines() if ln.startswith("+")
    ]
    assert "+    if EVEN_K:" in added and "background:#e6ffed'>+    if EVEN_K:</span>" in html
    assert "unchanged" in ex.kernel_change_html("tuned")
    assert "starting point" in ex.kernel_change_html(next(iter(STAGES)))


def test_the_explorer_shows_the_kernel_lines_of_the_chosen_stage(ev):
    e = ex.Explorer(ev, ex.Selection("gpt-oss-20b", 64), source_stage="split_k")
    assert "tl.atomic_add" in e._source.value
    e.source_stage.value = "no_recompile"
    assert "do_not_specialize" in e._source.value


# ---- the notebook ---------------------------------------------------------------------------------------


def test_notebook_runs_under_papermill_on_the_cpu_profile(tmp_path):
    from moelora_lib.studies.runner import run_notebooks

    results = run_notebooks(ROOT / "notebooks", tmp_path, "cpu", only=["00"], progress_bar=False)
    assert [r.status for r in results] == ["ok"], results
    nb = json.loads((tmp_path / "00_explorer.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    text = json.dumps(outputs)
    assert "What the committed evidence says" in text and "faster than `naive`" in text
    assert str(ROOT) not in text, "the executed explorer shows this machine's path"
