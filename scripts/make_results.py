"""Write docs/results.md and the README's results block from the measurements in data/.

Usage::

    python scripts/make_results.py           # rewrite docs/results.md and README.md's results block
    python scripts/make_results.py --check   # exit 1 (naming the files) when either differs from what
                                             # this script would write; nothing is written

Inputs (CSV schemas as the notebooks write them; a missing file drops its table with a note):
  data/09_graph.csv, 09_alignment.csv, 09_eager.csv, 09_memory.csv  serving layer (notebook 09)
  data/07_cumulative.csv, 12_fused.csv                               stages (notebooks 06, 07, 12)
  data/10_targets.csv                                                dense multi-LoRA vs vLLM (notebook 10)
  data/08_helion_linear.csv                                          Helion linear vs cuBLAS (notebook 08)
  data/11_generation.csv                                             end-to-end generation (notebook 11)
  data/NN_targets.csv                                                targets met per notebook
  data/env/NN_gpu.json                                               commit, GPU and date of notebook NN's run
  data/anchors/vllm033_vs_moelora_moe_h200.csv                       vLLM's MoE-LoRA layer, same H200, same
                                                                     method (data/anchors/README.md)
  data/anchors/vllm_blog_e2e.csv                                     vLLM's published end-to-end figures
  data/anchors/sources.json                                          where each anchor file comes from

Method of the headline ratio (data/anchors/README.md): vLLM's time is the faster of its two LoRA paths at
each T plus its base GEMMs plus its own CUDA alignment ops; ours is ``MoELoRALayer``'s whole forward
(routing from logits + Triton alignment + stage ``tuned``) in one CUDA graph. Ratio = vLLM ÷ ours
(> 1: ours faster). Needs pandas (the ``notebooks`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MOE_ANCHOR = "anchors/vllm033_vs_moelora_moe_h200.csv"
BLOG_ANCHOR = "anchors/vllm_blog_e2e.csv"
MODELS = {
    "gpt-oss-20b": "GPT-OSS-20B",
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
    "qwen3-32b": "Qwen3-32B",
    "llama-3.3-70b": "Llama-3.3-70B",
}
LAYER_TS = (1, 8, 64, 256, 1600, 8192)


# ------------------------------------------------------------------------------------------------
# formatting
# ------------------------------------------------------------------------------------------------
def fmt(v, digits: int = 1) -> str:
    """A cell: floats with ``digits`` decimals, ratios as given, NaN/None as '–', bools as yes/no."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(rows: list[list], header: list[str], digits: int | list[int] = 1) -> str:
    """A Markdown table; ``digits`` per column (or one for all)."""
    ds = digits if isinstance(digits, list) else [digits] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(v, d) for v, d in zip(r, ds)) + " |")
    return "\n".join(lines)


def model_name(m: str) -> str:
    return MODELS.get(m, m)


# ------------------------------------------------------------------------------------------------
# inputs and provenance
# ------------------------------------------------------------------------------------------------
class Data:
    """Reads data/ once; names each source with its commit, GPU and date."""

    def __init__(self, root: Path):
        self.dir = root / "data"

    def csv(self, name: str) -> pd.DataFrame | None:
        p = self.dir / name
        # version strings stay strings ("0.15", not 0.15 read as a float)
        return pd.read_csv(p, dtype={"vllm": str}) if p.exists() else None

    def env(self, nn: str) -> dict:
        p = self.dir / "env" / f"{nn}_gpu.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def source(self, name: str, df: pd.DataFrame | None = None) -> str:
        """'`data/NAME`: commit …, GPU …, date …' from the rows (git_commit, gpu) and env/NN_gpu.json."""
        if name.startswith("anchors/"):  # copied files carry no env record: data/anchors/sources.json
            meta = json.loads((self.dir / "anchors" / "sources.json").read_text())
            return f"`data/{name}`: {meta[name.split('/', 1)[1]]}"
        env = self.env(name[:2])
        commits = (
            sorted(set(df["git_commit"].dropna().astype(str)))
            if df is not None and "git_commit" in df
            else []
        )
        gpus = sorted(set(df["gpu"].dropna().astype(str))) if df is not None and "gpu" in df else []
        commits = commits or [env.get("git_commit", "?")]
        gpus = gpus or [env.get("gpu", "?")]
        date = str(env.get("timestamp_utc", "?"))[:10]
        env_file = f"`data/env/{name[:2]}_gpu.json`"
        return f"`data/{name}`: commit {', '.join(commits)}, {', '.join(gpus)}, {date} ({env_file})"

    def readme_source(self, *names: str) -> str:
        """The README's provenance line: files, GPU and dates, no commits."""
        gpus, dates = set(), set()
        for n in names:
            env = self.env(n[:2])
            if env:
                gpus.add(env.get("gpu", "?"))
                dates.add(str(env.get("timestamp_utc", "?"))[:10])
        files = ", ".join(f"`data/{n}`" for n in names)
        return f"{', '.join(sorted(gpus))}, {', '.join(sorted(dates))}; from {files}"


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def vllm_layer(a: pd.DataFrame) -> pd.DataFrame:
    """Per (model, T): vLLM's best whole layer (faster LoRA path) + its CUDA alignment, its base, its best
    LoRA part, and our side-by-side module time from the same run."""
    a = a[a["shape"].isin(MODELS)]
    key = ["shape", "T"]
    tot = (
        a[a["impl"].isin(["vllm033", "vllm033_2k"]) & (a["part"] == "total")].groupby(key)["median_us"].min()
    )
    lora = (
        a[a["impl"].isin(["vllm033", "vllm033_2k"]) & (a["part"] == "lora")].groupby(key)["median_us"].min()
    )
    base = a[(a["impl"] == "vllm033") & (a["part"] == "base")].set_index(key)["median_us"]
    align = a[(a["impl"] == "vllm033_cudaops") & (a["part"] == "align_cuda")].set_index(key)["median_us"]
    ours = a[(a["impl"] == "layer_module") & (a["part"] == "layer_module")].set_index(key)["median_us"]
    out = pd.DataFrame({"vllm_best": tot, "vllm_lora": lora, "vllm_base": base, "vllm_align": align})
    out["vllm_whole"] = out["vllm_best"] + out["vllm_align"]
    out["anchor_ours"] = ours
    return out.rename_axis(["model", "T"]).reset_index()


def layer_vs_vllm(d: Data) -> pd.DataFrame | None:
    g, a = d.csv("09_graph.csv"), d.csv(MOE_ANCHOR)
    if g is None or a is None:
        return None
    ours = g[g["what"] == "module_logits"].set_index(["model", "T"])["us_p50"].rename("ours")
    kern = g[g["what"] == "layer_kernels"].set_index(["model", "T"])["us_p50"].rename("ours_kernels")
    v = vllm_layer(a).set_index(["model", "T"])
    out = v.join(ours, how="inner").join(kern).reset_index()
    out["x"] = out["vllm_whole"] / out["ours"]
    out["x_kernels"] = out["vllm_best"] / out["ours_kernels"]
    out["x_anchor"] = out["vllm_whole"] / out["anchor_ours"]
    return out.sort_values(["model", "T"])


def e2e_rows(d: Data) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    return d.csv("11_generation.csv"), d.csv(BLOG_ANCHOR)


def readme_block(d: Data) -> str:
    parts = []
    lv = layer_vs_vllm(d)
    if lv is not None:
        rows = []
        for m, grp in lv.groupby("model", sort=False):
            grp = grp.set_index("T")
            rows.append(
                [f"{model_name(m)}: vLLM ÷ ours"]
                + [
                    f"**{grp.x[t]:.2f}×** ({grp.vllm_whole[t]:.0f} / {grp.ours[t]:.0f})"
                    if t in grp.index
                    else "–"
                    for t in LAYER_TS
                ]
            )
        parts.append(
            "One MoE + LoRA layer call on an H200 (bf16, rank 32, 8 adapter slots, tokens spread "
            "evenly over them), "
            "whole: routing, alignment and the layer in one CUDA graph, median µs with L2 flushed. vLLM = "
            "the faster of its two LoRA paths plus its base GEMMs and its CUDA alignment ops, same GPU and "
            "method. Cells: vLLM ÷ ours (vLLM µs / ours µs); > 1: ours faster.\n\n"
            + table(rows, ["model"] + [f"T = {t}" for t in LAYER_TS])
        )
    g, blog = e2e_rows(d)
    if g is not None:
        c1 = g[(g["model"] == "gpt-oss-20b") & (g["concurrency"] == 1)]
        ours = c1[(c1["impl"] == "moelora") & (c1["scenario"] == "adapters_mixed") & (c1["stage"] == "tuned")]
        if len(ours):
            o = ours.iloc[0]
            rows = []
            for label, r in (
                ("moelora_lib, base model", c1[(c1["impl"] == "moelora") & (c1["scenario"] == "base")]),
                ("moelora_lib, with an adapter", ours),
                ("transformers + PEFT (eager)", c1[c1["impl"] == "transformers_peft"]),
            ):
                if len(r):
                    r = r.iloc[0]
                    if r.new_tokens != o.new_tokens:
                        label += f", {int(r.new_tokens)} out"
                    rows.append(
                        [
                            label,
                            r.ttft_ms_mean,
                            r.otps_per_request,
                            f"{o.otps_per_request / r.otps_per_request:.2f}×",
                        ]
                    )
            if blog is not None:
                for r in blog[blog["model"] == "gpt-oss-20b"].itertuples():
                    rows.append(
                        [
                            f"vLLM {r.vllm} ({r.configs} configs), published*",
                            float(r.ttft_ms),
                            float(r.otps),
                            f"{o.otps_per_request / r.otps:.2f}×",
                        ]
                    )
            parts.append(
                f"GPT-OSS-20B end to end, one request, {int(o.prompt_len)} tokens in, "
                f"{int(o.new_tokens)} out, "
                "rank 32, greedy, random weights at the real dimensions:\n\n"
                + table(rows, ["run", "TTFT ms", "output tokens/s", "ours with an adapter ÷ this"])
                + "\n\n\\* not measured side by side (`data/anchors/vllm_blog_e2e.csv`): vLLM's blog "
                "states neither its GPU nor its concurrency, and runs GPT-OSS's MXFP4 experts (ours: bf16)."
            )
    srcs = [n for n in ("09_graph.csv", "11_generation.csv") if (d.dir / n).exists()]
    parts.append(
        f"Measured on {d.readme_source(*srcs)}; vLLM's layer rows: `data/{MOE_ANCHOR}`. "
        "Every table, with its commit: "
        "[docs/results.md](docs/results.md)."
    )
    return "\n\n".join(parts)


def results_md(d: Data) -> str:
    out = [
        "# Results (H200)",
        "",
        "Generated by `python scripts/make_results.py` from `data/`; do not edit by hand (a test checks "
        "that this file matches the generator's output). Each table names its source CSV with the commit, "
        "GPU and date of the run that wrote it. Times are medians in µs of CUDA-graph replays with L2 "
        "flushed (`do_bench`), bf16, rank R = 32, 8 adapter slots, tokens spread evenly over the adapters "
        "unless a table says otherwise. What each number decided: [perf_notes.md](perf_notes.md).",
        "",
        "The vLLM anchor of the first two tables: vLLM 0.33.0's Triton kernels (base `fused_moe_kernel`; "
        "`fused_moe_lora_op.py`'s small-batch / one-shot kernels and the two-kernel shrink → expand path "
        "that 0.34.0 dispatches at T ≤ 64) run standalone in one process beside moelora_lib, on one set of "
        "inputs: GPT-OSS-20B as the real model runs (swigluoai with its clamp and expert biases), "
        "Qwen3-30B-A3B with silu; routing softmax top-k of random logits; each part captured once in a "
        "CUDA graph, `triton.testing.do_bench(graph.replay, warmup=25, rep=100)` median with its 256 MB "
        "L2 flush before every repetition; every output within 1.2e-2 of one fp32 reference. Provenance: "
        "`data/anchors/README.md`; the earlier anchor (vLLM b44679230, silu without biases) and its "
        "readings: [anchors-h200.md](anchors-h200.md).",
    ]

    def section(title: str, body: str | None, *sources: str) -> None:
        out.extend(["", f"## {title}", ""])
        if body is None:
            out.append("(source file missing)")
            return
        out.append(body)
        out.append("")
        out.extend(f"Source: {s}" + ("  " if i < len(sources) - 1 else "") for i, s in enumerate(sources))

    # 1. whole layer against vLLM
    lv = layer_vs_vllm(d)
    body = None
    if lv is not None:
        rows = [
            [
                model_name(r.model),
                int(r.T),
                r.vllm_whole,
                r.ours,
                f"{r.x:.2f}",
                r.vllm_best,
                r.ours_kernels,
                f"{r.x_kernels:.2f}",
                f"{r.x_anchor:.2f}",
            ]
            for r in lv.itertuples()
        ]
        body = (
            "`vLLM whole` = its faster LoRA path + base + its CUDA alignment; `ours whole` = `MoELoRALayer` "
            "forward from router logits (routing + Triton alignment + stage `tuned`), one graph. `kernels` = "
            "the layer's launches alone with a precomputed alignment, against vLLM's best without its "
            "alignment. The last column is the same ratio measured side by side in the anchor run.\n\n"
            + table(
                rows,
                [
                    "model",
                    "T",
                    "vLLM whole",
                    "ours whole",
                    "vLLM ÷ ours",
                    "vLLM kernels",
                    "ours kernels",
                    "vLLM ÷ ours (kernels)",
                    "vLLM ÷ ours (anchor run)",
                ],
            )
        )
    section(
        "Whole MoE + LoRA layer against vLLM",
        body,
        d.source("09_graph.csv", d.csv("09_graph.csv")),
        d.source(MOE_ANCHOR),
    )

    # 2. parts in the anchor run
    a = d.csv(MOE_ANCHOR)
    body = None
    if a is not None:
        v = vllm_layer(a).set_index(["model", "T"])
        mine = a[a["impl"].isin(["tuned", "fused"]) & a["part"].isin(["base", "lora"])]
        mine = mine.pivot_table(index=["shape", "T"], columns=["impl", "part"], values="median_us")
        rows = []
        for (m, t), r in v.iterrows():
            k = (m, t)
            tb = mine.loc[k, ("tuned", "base")] if k in mine.index else float("nan")
            tl = mine.loc[k, ("tuned", "lora")] if k in mine.index else float("nan")
            fl = mine.loc[k, ("fused", "lora")] if k in mine.index else float("nan")
            rows.append(
                [model_name(m), int(t), r.vllm_base, tb, r.vllm_lora, tl, fl, f"{r.vllm_lora / tl:.2f}"]
            )
        body = (
            "Base MoE GEMMs and the LoRA part alone (alignment excluded on both sides), measured side by "
            "side "
            "in one process. `fused` LoRA = its whole layer − its base.\n\n"
            + table(
                rows,
                [
                    "model",
                    "T",
                    "vLLM base",
                    "ours base (`tuned`)",
                    "vLLM LoRA (best path)",
                    "ours LoRA `tuned`",
                    "ours LoRA `fused`",
                    "vLLM ÷ ours (LoRA)",
                ],
            )
        )
    section("Parts against vLLM (anchor run)", body, d.source(MOE_ANCHOR))

    # 3. stages
    c, f = d.csv("07_cumulative.csv"), d.csv("12_fused.csv")
    body = None
    if c is not None:
        stages = [
            s for s in ("naive", "no_recompile", "split_k", "swizzle", "even_k_fused_add", "tuned") if s in c
        ]
        fz = None
        if f is not None:
            if "variant" in f:  # the rows measured as the stage notebooks run (silu, no biases)
                f = f[f["variant"] == "as_anchor"]
            fz = f[f["stage"] == "fused"].pivot_table(index=["model", "T"], columns="part", values="us_p50")
            fz["lora"] = fz["total"] - fz["base"]  # the LoRA work runs inside the base GEMMs
            fz = fz.stack()
        rows = []
        for r in c.itertuples():
            fv = fz.get((r.model, r.T, r.part), float("nan")) if fz is not None else float("nan")
            rows.append([model_name(r.model), int(r.T), r.part] + [getattr(r, s) for s in stages] + [fv])
        body = (
            "The LoRA part and the whole layer per stage (GPT-OSS-20B here with silu and no biases, as the "
            "stage notebooks and vLLM's earlier anchor run it; the alignment is not in these times).\n\n"
            + table(rows, ["model", "T", "part"] + [f"`{s}`" for s in stages] + ["`fused`"])
        )
    srcs = [d.source("07_cumulative.csv", c)] + ([d.source("12_fused.csv", f)] if f is not None else [])
    section("Stages", body, *srcs)

    # 4. serving layer
    al = d.csv("09_alignment.csv")
    body = None
    if al is not None:
        p = al.pivot_table(index=["model", "impl"], columns="T", values="us_p50")
        rows = [
            [model_name(m), i] + [p.loc[(m, i)].get(t, float("nan")) for t in LAYER_TS] for m, i in p.index
        ]
        body = "Alignment of one layer call (base + LoRA), µs.\n\n" + table(
            rows, ["model", "impl"] + [f"T = {t}" for t in LAYER_TS]
        )
    section("Serving layer: token alignment", body, d.source("09_alignment.csv", al))

    gr = d.csv("09_graph.csv")
    body = None
    if gr is not None:
        p = gr.pivot_table(index=["model", "what"], columns="T", values="us_p50")
        rows = [
            [model_name(m), w] + [p.loc[(m, w)].get(t, float("nan")) for t in LAYER_TS] for m, w in p.index
        ]
        body = (
            "One CUDA graph per call, µs: `layer_kernels` = the layer's launches with a precomputed "
            "alignment; `module_topk` = `MoELoRALayer` from top-k ids (alignment + layer); "
            "`module_logits` = from router "
            "logits (routing + alignment + layer).\n\n"
            + table(rows, ["model", "what"] + [f"T = {t}" for t in LAYER_TS])
        )
    section("Serving layer: one CUDA graph", body, d.source("09_graph.csv", gr))

    ea = d.csv("09_eager.csv")
    body = None
    if ea is not None:
        rows = [
            [model_name(r.model), int(r.T), r.what, r.mode, r.wall_us, r.host_us, r.gpu_us]
            for r in ea.itertuples()
        ]
        body = "Eager calls: wall and host time, µs, beside their kernels' GPU time (graph).\n\n" + table(
            rows, ["model", "T", "what", "mode", "wall µs", "host µs", "GPU µs"]
        )
    section("Serving layer: eager host overhead", body, d.source("09_eager.csv", ea))

    me = d.csv("09_memory.csv")
    body = None
    if me is not None:
        rows = [
            [
                model_name(r.model),
                int(r.max_tokens),
                r.kind,
                r.value / 2**20 if r.kind != "scratch_shared_by" else int(r.value),
            ]
            for r in me.itertuples()
        ]
        body = "Bytes per layer (MiB; `scratch_shared_by`: layers), by kind.\n\n" + table(
            rows, ["model", "max_tokens", "kind", "MiB"]
        )
    section("Serving layer: memory", body, d.source("09_memory.csv", me))

    # 5. dense
    dt = d.csv("10_targets.csv")
    body = None
    if dt is not None:
        v = dt[dt["target"].isin(["vs_vllm_small_T", "vs_vllm_large_T"])]
        p = v.pivot_table(index=["model", "proj"], columns="T", values="value")
        ts = list(p.columns)
        rows = [[model_name(m), pr] + [p.loc[(m, pr)].get(t, float("nan")) for t in ts] for m, pr in p.index]
        body = (
            "Dense multi-LoRA, the LoRA part of stage `tuned` against vLLM's `lora_shrink` + `lora_expand` "
            "(`data/anchors/vllm_dense_lora_h200.csv`, same method): vLLM ÷ ours.\n\n"
            + table(rows, ["model", "proj"] + [f"T = {t}" for t in ts], 2)
        )
    section("Dense multi-LoRA against vLLM", body, d.source("10_targets.csv", dt))

    # 6. helion
    hl = d.csv("08_helion_linear.csv")
    body = None
    if hl is not None:
        key = ["mode", "model", "proj", "epilogue", "M", "copies"]
        h = hl[hl["impl"] == "helion"].set_index(key)["ms_p50"]
        t = hl[hl["impl"] == "torch"].set_index(key)["ms_p50"]
        j = pd.concat({"helion": h, "torch": t}, axis=1).dropna().reset_index()
        j["phase"] = j["M"].map(lambda m: "decode (M ≤ 32)" if m <= 32 else "prefill (M ≥ 256)")
        j["x"] = j["torch"] / j["helion"]
        grp = j.groupby(["mode", "epilogue", "phase"])["x"]
        rows = [
            [mode, ep, ph, float(math.exp(x.map(math.log).mean())), float(x.min()), float(x.max()), len(x)]
            for (mode, ep, ph), x in grp
        ]
        body = (
            "Helion linear against torch (cuBLAS; `swiglu`: torch's merged gate/up GEMM + activation), "
            "cuBLAS ÷ Helion (> 1: Helion faster), dense projections of Llama-3-8B, Qwen3-32B, "
            "Llama-3-70B.\n\n"
            + table(rows, ["mode", "epilogue", "phase", "geomean", "min", "max", "points"], 3)
        )
    section("Helion linear backend", body, d.source("08_helion_linear.csv", hl))

    # 7. end to end
    g, blog = e2e_rows(d)
    body = None
    if g is not None:
        rows = [
            [
                model_name(r.model),
                r.impl,
                r.scenario,
                fmt(r.stage) if isinstance(r.stage, str) else "–",
                int(r.concurrency),
                int(r.prompt_len),
                int(r.new_tokens),
                r.ttft_ms_mean,
                r.otps_per_request,
                r.otps_aggregate,
                r.step_ms_p50,
            ]
            for r in g.itertuples()
        ]
        body = (
            "Random weights at the real dimensions, rank 32, 8 adapter slots on attention and MLP; "
            "`adapters_mixed`: request i on slot i mod 8; greedy.\n\n"
            + table(
                rows,
                [
                    "model",
                    "impl",
                    "scenario",
                    "stage",
                    "concurrency",
                    "in",
                    "out",
                    "TTFT ms",
                    "tokens/s per request",
                    "tokens/s aggregate",
                    "step ms",
                ],
            )
        )
        if blog is not None:
            brow = [
                [
                    model_name(r.model),
                    r.vllm,
                    r.configs,
                    int(r.prompt_len),
                    int(r.new_tokens),
                    float(r.ttft_ms),
                    float(r.otps),
                ]
                for r in blog.itertuples()
            ]
            body += (
                "\n\nvLLM's published figures (not side by side: GPU and concurrency not stated):\n\n"
                + table(brow, ["model", "vLLM", "configs", "in", "out", "TTFT ms", "tokens/s"])
            )
    srcs = [d.source("11_generation.csv", g)] + ([d.source(BLOG_ANCHOR)] if blog is not None else [])
    section("End-to-end generation", body, *srcs)

    # 8. targets
    rows, srcs = [], []
    for p in sorted(d.dir.glob("[0-9][0-9]_targets.csv")):
        tg = pd.read_csv(p)
        srcs.append(d.source(p.name, tg))
        if "met" in tg and "target" in tg:
            for name, grp in tg.groupby("target", sort=False):
                rows.append([p.name[:2], name, int(grp["met"].astype(bool).sum()), len(grp)])
        for col in [c for c in tg.columns if c.startswith("met_") or c.endswith("_met")]:
            rows.append([p.name[:2], col, int(tg[col].astype(bool).sum()), len(tg)])
    section(
        "Targets met",
        table(rows, ["notebook", "target", "met", "points"]) if rows else None,
        *srcs,
    )
    return "\n".join(out).rstrip() + "\n"


def with_block(readme: str, block: str) -> str:
    """README text with everything between the markers replaced by ``block``."""
    i, j = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:i] + "\n" + block + "\n" + readme[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed files differ")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this script's)")
    args = ap.parse_args(argv)
    d = Data(args.root)
    readme_p, results_p = args.root / "README.md", args.root / "docs" / "results.md"
    want = {
        results_p: results_md(d),
        readme_p: with_block(readme_p.read_text(), readme_block(d)),
    }
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(
                f"make_results: {p.relative_to(args.root)} differs from what scripts/make_results.py writes"
            )
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"make_results: wrote {p.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
