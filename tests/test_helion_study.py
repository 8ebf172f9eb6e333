"""Notebook 08's study layer on the CPU: the bounds and targets tables against the committed GPU run, the
geometric mean, the CPU-profile sweep through the Triton interpreter, and the precompile process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from moelora_lib.studies import helion_study as study
from moelora_lib.studies import helion_tune

DATA = Path(__file__).resolve().parents[1] / "data"


def test_gmean():
    assert study.gmean([1.0, 4.0]) == pytest.approx(2.0)
    assert study.gmean([2.0, float("nan"), -1.0, 0.0, None]) == pytest.approx(2.0)  # finite positives only
    assert math.isnan(study.gmean([]))


def test_bounds_and_targets_reproduce_the_committed_tables():
    """From the committed sweep and ceilings, the same 08_bounds.csv and 08_targets.csv as the GPU run."""
    s = study.summary(pd.read_csv(DATA / "08_helion_linear.csv"))
    bb, tt = study.bounds_and_targets(s, json.loads((DATA / "08_ceilings.json").read_text()))
    want_b, want_t = pd.read_csv(DATA / "08_bounds.csv"), pd.read_csv(DATA / "08_targets.csv")
    assert list(bb.columns) == list(want_b.columns) and list(tt.columns) == list(want_t.columns)
    pd.testing.assert_frame_equal(bb, want_b, check_dtype=False, rtol=1e-9)
    pd.testing.assert_frame_equal(tt, want_t, check_dtype=False, rtol=1e-9)


def test_bounds_and_targets_by_hand():
    """Two decode rows in graph_clean: the bound at the read ceiling, the geomean targets, a beaten bound."""
    row = dict(model="m", proj="p", epilogue="none", dtype="bfloat16", mode="graph_clean", K=4096, N=4096)
    rates = dict(helion_tb_per_s=1.0, torch_tb_per_s=1.0, helion_tflops=1.0, torch_tflops=1.0)
    s = pd.DataFrame(
        [
            dict(row, M=1, torch_us=20.0, helion_us=16.0, speedup=1.25, **rates),
            dict(row, M=2, torch_us=20.0, helion_us=20.0, speedup=1.0, **rates),
        ]
    )
    bb, tt = study.bounds_and_targets(s, dict(read_tb_per_s=4.0, tiny_kernel_us=2.0))
    floor1 = (4096 * 4096 + 4096 + 4096) * 2 / 4e12 * 1e6  # weight + x + y bytes at 4 TB/s (µs)
    assert bb.floor_us[0] == pytest.approx(floor1) and bb.launch_us.eq(2.0).all()
    assert bb.est_speedup[0] == pytest.approx(20.0 / (floor1 + 2.0))
    t = tt.set_index("target")
    assert (
        t.loc["decode >= 1.15x"].measured == pytest.approx(math.sqrt(1.25))
        and not t.loc["decode >= 1.15x"].met
    )
    assert "prefill >= 0.95x" not in t.index  # no M >= 256 rows
    with pytest.raises(AssertionError):
        study.bounds_and_targets(s.assign(speedup=100.0), dict(read_tb_per_s=4.0, tiny_kernel_us=2.0))


def test_cpu_sweep_rows():
    pytest.importorskip("helion")
    df = pd.DataFrame(study.sweep(profile="cpu", ms=[1, 17], progress=False))
    assert len(df) == 2 * (2 + 3) * 2  # dtypes x (none: helion, torch; swiglu: + two GEMMs) x M
    assert (df["mode"] == "cpu").all() and set(df.impl) == {"helion", "torch", "torch_two_gemm"}
    assert (df.rel_err <= df.dtype.map(study.REL_TOL)).all()
    assert df[df.impl == "helion"].path.str.startswith("helion:").all()  # no silent fallback
    assert (df.flops == 2.0 * df.M * df.K * df.N).all()
    s = study.summary(df)
    assert len(s) == 2 * 2 * 2 and s[s.epilogue == "swiglu"].speedup_vs_two_gemm.notna().all()
    with pytest.raises(ValueError, match="profile"):
        study.sweep(profile="tpu")


def test_precompile_runs_in_a_fresh_process(capsys):
    """The precompile process starts from a notebook kernel too and reports a config that cannot compile
    (no GPU here) without failing."""
    tasks: dict = {}
    cfg = dict(block_sizes=[16, 32, 32], num_warps=4, num_stages=2)
    helion_tune.add_task(tasks, "none", "bfloat16", 64, 96, cfg, [1, 16])
    helion_tune.add_task(tasks, "none", "bfloat16", 64, 96, cfg, [16, 15])
    assert list(tasks.values())[0]["ms"] == [1, 16, 15]  # one task per config, Ms merged
    assert helion_tune.precompile_in_subprocess(tasks, 1, timeout_s=300)
    assert "1 done (1 failed)" in capsys.readouterr().out
