"""The written conclusion of notebook 10 (dense multi-LoRA), rendered on the CPU.

There is no GPU run of notebook 10 yet, so the GPU profile is rendered from synthetic rows with the
columns and the (projection, T) grid the notebook writes, beside vLLM's real anchor table; the numbers
the Markdown must carry are recomputed here with plain pandas from the same rows. The asserts of the
conclusion are exercised by breaking one thing at a time. The CPU profile is rendered from a real
(tiny, interpreter) run. Once the GPU CSVs are committed, the last test renders them too.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from moelora_lib.studies import dense_bench as db
from moelora_lib.studies.conclusions import nb10

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [1, 8, 64, 256, 1600, 8192]
STAGES = ["naive", "split_k", "even_k_fused_add", "tuned"]
SLOWER = {"naive": 2.0, "split_k": 1.3, "even_k_fused_add": 1.05, "tuned": 1.0}


@pytest.fixture(scope="module")
def anchors() -> pd.DataFrame:
    return db.anchor_table()


def _synthetic(anchors) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(timing rows, check rows) shaped as the notebook writes them on the GPU profile."""
    a = anchors.set_index(["model", "proj", "T"])
    rows, checks = [], []
    for m in db.MODELS:
        for p in db.projections(m):
            for T in TOKENS:
                c = db.part_costs(p, T)
                key = dict(model=p.model, proj=p.proj, H=p.hidden, slices=p.slices_str, T=T, mode="graph")
                base = float(a.loc[(p.model, p.proj, T)].base_us)
                lora = max(9.0, 1.6 * c["lora"]["floor_us"])
                src = "folder:moelora_lib/configs/NVIDIA_H200" if p.proj == "qkv" else "default"
                rows.append(dict(key, part="base", impl="cublas", stage=None, us_p50=base, floor_us=1.0))
                for st in STAGES:
                    slow = SLOWER[st] if not (p.proj == "o" and T == 8 and st == "even_k_fused_add") else 0.9
                    rows.append(
                        dict(
                            key,
                            part="lora",
                            impl=st,
                            stage=st,
                            us_p50=lora * slow,
                            floor_us=c["lora"]["floor_us"],
                            config_source=src if st == "tuned" else "default",
                            block_size_m=16 if T <= 128 else 64,
                        )
                    )
                rows.append(
                    dict(
                        key, part="total", impl="tuned", stage="tuned", us_p50=base + lora + 4.0, floor_us=1.0
                    )
                )
                if T >= 64:
                    loop = lora * (3.5 if T <= 256 else 2.0)
                    rows.append(
                        dict(key, part="lora", impl="torch_loop", stage=None, us_p50=loop, floor_us=1.0)
                    )
                    rows.append(
                        dict(key, part="lora", impl="torch_gbmm", stage=None, us_p50=lora * 6, floor_us=1.0)
                    )
                if T in (1, 8192):
                    for part, f in (("shrink", 0.4), ("expand", 0.6)):
                        rows.append(
                            dict(
                                key,
                                part=part,
                                impl="tuned",
                                stage="tuned",
                                us_p50=lora * f,
                                floor_us=c[part]["floor_us"],
                            )
                        )
                for impl, part in (
                    [(st, "lora") for st in STAGES]
                    + [("tuned", "total")]
                    + [(b, "lora") for b in db.BASELINES]
                ):
                    checks.append(
                        dict(
                            model=p.model,
                            proj=p.proj,
                            T=T,
                            dtype="bfloat16",
                            impl=impl,
                            part=part,
                            rel_err=4e-3,
                            tol=2.5e-2,
                            delta_rel=0.8,
                            no_adapter_rows=T // 3,
                            no_adapter_bitwise=True,
                        )
                    )
    for T in TOKENS:
        rows.append(dict(part="align", impl="align", T=T, us_p50=3.0 if T <= 1024 else 14.0, mode="graph"))
    return pd.DataFrame(rows), pd.DataFrame(checks)


@pytest.fixture(scope="module")
def synthetic(anchors, tmp_path_factory):
    df, checks = _synthetic(anchors)
    d = tmp_path_factory.mktemp("nb10")
    df.to_csv(d / "10_dense_lora.csv", index=False)
    checks.to_csv(d / "10_checks.csv", index=False)
    tg = db.targets_table(db.summary_table(df, anchors))
    tg.to_csv(d / "10_targets.csv", index=False)
    # read back, as the notebook's last cell does
    return (
        pd.read_csv(d / "10_dense_lora.csv"),
        pd.read_csv(d / "10_checks.csv"),
        pd.read_csv(d / "10_targets.csv"),
    )


def _render(df, checks, targets, anchors):
    return nb10.conclusion(df, checks, targets, profile="gpu", anchors=anchors, stages=STAGES, final="tuned")


def test_gpu_conclusion_renders_the_numbers(synthetic, anchors):
    df, checks, targets = synthetic
    md = _render(df, checks, targets, anchors)
    assert md.startswith("## Conclusion")
    assert f"{len(checks)} checks" in md and "(held)" in md
    # per target: missed count, point count, predictions held — recomputed with plain pandas
    for name, g in targets.groupby("target"):
        n_missed, n = int((~g.met).sum()), len(g)
        assert f"at {n_missed} of {n} points ({n - n_missed} met)" in md, name
        pred = [nb10.predicted_met(name, m, p, t) for m, p, t in zip(g.model, g.proj, g["T"])]
        held = int((g.met == pd.Series(pred, index=g.index)).sum())
        assert f"Prediction held at {held} of {n};" in md, name
    # vLLM ÷ ours, over every point
    lora = df[(df.part == "lora") & (df.stage == "tuned")].set_index(["model", "proj", "T"]).us_p50
    x = anchors.set_index(["model", "proj", "T"]).lora_us.reindex(lora.index) / lora
    assert f"{x.min():.2f}–{x.max():.2f}× over {len(lora)} anchored points" in md
    # the stage where an earlier stage was faster is named, and the tuned config source
    assert "gpt-oss-20b/o T = 8 (`even_k_fused_add`" in md
    assert "configs from folder:moelora_lib/configs/NVIDIA_H200 at 24 of 72 points" in md
    # per kernel lines at T = 1 and 8192 with vLLM's numbers
    k = df[(df.part == "shrink") & (df.model == "llama-3.3-70b") & (df.proj == "down") & (df["T"] == 8192)]
    v = anchors[(anchors.model == "llama-3.3-70b") & (anchors.proj == "down") & (anchors["T"] == 8192)].iloc[
        0
    ]
    assert f"llama-3.3-70b/down T = 8192: shrink {k.us_p50.iloc[0]:.1f} + expand" in md
    assert f"vLLM {v.shrink_us:.1f} + {v.expand_us:.1f}" in md
    assert "captured and replayed as one graph at all 72 points" in md
    assert "4.0–4.0 µs over base" in md and "3.0–14.0 µs" in md
    assert "{" not in md.replace("{gpu}", "")  # no unformatted placeholder


def test_gpu_conclusion_asserts(synthetic, anchors):
    df, checks, targets = synthetic
    bad = checks.copy()
    bad.loc[3, "rel_err"] = 0.1
    with pytest.raises(AssertionError):
        _render(df, bad, targets, anchors)
    bad = checks.copy()
    bad.loc[5, "no_adapter_bitwise"] = False
    with pytest.raises(AssertionError):
        _render(df, bad, targets, anchors)
    flipped = targets.copy()
    flipped.loc[0, "met"] = not flipped.loc[0, "met"]
    with pytest.raises(AssertionError, match="targets CSV"):
        _render(df, checks, flipped, anchors)
    with pytest.raises(AssertionError, match="empty"):
        _render(df, checks, targets.iloc[0:0], anchors)
    gone = df.drop(df[(df.stage == "split_k") & (df["T"] == 64) & (df.proj == "o")].index)
    with pytest.raises(AssertionError, match="split_k"):
        _render(gone, checks, targets, anchors)
    fast = df.copy()
    sel = (fast.part == "lora") & (fast.stage == "naive") & (fast["T"] == 8192)
    fast.loc[sel, "us_p50"] = fast.loc[sel, "floor_us"] * 0.3
    with pytest.raises(AssertionError, match="floor"):
        _render(fast, checks, targets, anchors)
    eager = df.copy()
    eager.loc[eager.part == "total", "mode"] = "eager"
    with pytest.raises(AssertionError, match="graph"):
        _render(eager, checks, targets, anchors)


def test_predictions_cover_every_target():
    for name in db.TARGETS:
        nb10.predicted_met(name, "qwen3-32b", "gate_up", 64)
    assert nb10.predicted_met("share_of_base_large_T", "qwen3-32b", "down", 8192)
    assert not nb10.predicted_met("vs_vllm_small_T", "gpt-oss-20b", "o", 8)
    with pytest.raises(ValueError):
        nb10.predicted_met("faster", "qwen3-32b", "down", 1)


def test_cpu_conclusion_from_an_interpreter_run():
    kw = dict(rank=8, adapters=3, dtype=torch.float32, device="cpu")
    inp = db.make_inputs("tiny/qkv", 13, **kw)
    checks = pd.DataFrame(db.check_projection("tiny/qkv", 13, inputs=inp, stages=STAGES))
    rows = db.bench_projection("tuned", "tiny/qkv", 5, inputs=inp)
    df = pd.DataFrame(rows)
    targets = db.targets_table(db.summary_table(df).iloc[0:0])
    md = nb10.conclusion(df, checks, targets, profile="cpu", stages=STAGES)
    assert f"{len(checks)} checks" in md and "float32" in md
    assert "not concluded on this profile" in md
    assert "vLLM" not in md.split("not concluded")[0]  # no timing claim before it
    bad = checks.copy()
    bad.loc[0, "delta_rel"] = 0.0
    with pytest.raises(AssertionError):
        nb10.conclusion(df, bad, targets, profile="cpu")


def test_committed_gpu_csvs_render(anchors):
    paths = [ROOT / "data" / f for f in ("10_dense_lora.csv", "10_checks.csv", "10_targets.csv")]
    if not all(p.is_file() for p in paths):
        pytest.skip("notebook 10 has not been run on the GPU in this checkout")
    df, checks, targets = (pd.read_csv(p) for p in paths)
    stages = list(dict.fromkeys(df[(df.part == "lora") & df.stage.notna()].stage))
    md = nb10.conclusion(df, checks, targets, profile="gpu", anchors=anchors, stages=stages)
    assert "## Conclusion" in md
