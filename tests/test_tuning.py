"""The tuners (moelora_lib.studies.tuning, dense_tuning, fused_tuning on the engine studies.tuner) as
functional tests through the Triton interpreter: tiny shapes, 1-2 candidates. A tune writes files the
loaders read; candidate lists are small and valid; bad arguments are named before anything is written."""

import csv
import json
import os
import warnings

import pytest
import torch

from moelora_lib import configs
from moelora_lib.kernels import default_config
from moelora_lib.kernels.config import LORA_OPS, OpConfig
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.studies import dense_tuning as dt
from moelora_lib.studies import fused_tuning as ft
from moelora_lib.studies import tuning
from moelora_lib.testing import TOLERANCES

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter test (a GPU host compiles the kernels instead)"
)


def rows_of(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- the MoE tuner -------------------------------------------------------------------------------
@needs_interpreter
def test_tiny_tune_writes_a_file_the_loader_reads(tmp_path):
    out, csv_path = tmp_path / "cfg", tmp_path / "trials.csv"
    kw = dict(device="cpu", max_bms=1, max_cands=2, progress=False)
    s = tuning.tune(["tiny"], [16], 2, [3], out, csv_path, copy_ranks=[32], **kw)
    assert s["tuned"] == [("tiny", 16, 3)] and s["copied"] == [("tiny", 32, 3)]
    sh = get_shape("tiny")
    cfg = configs.load_layer_config(Dims.of(sh, 3, rank=16, adapters=2), folder=out, gpu_name="cpu")
    assert cfg.source == f"folder:{out}"
    rows = rows_of(csv_path)
    assert list(rows[0]) == tuning.CSV_COLUMNS
    assert {r["kind"] for r in rows} >= {"trial", "choice", "bm_sum", "copied", "session"}
    assert all(float(r["ms_p50"]) > 0 for r in rows if r["kind"] == "trial")
    # the loader returns exactly the chosen configs; the copied rank has its rank-sized tile adjusted
    chosen = {r["op"]: OpConfig(**json.loads(r["config_json"])) for r in rows if r["kind"] == "choice"}
    assert {op: getattr(cfg, op) for op in LORA_OPS} == {op: chosen[op] for op in LORA_OPS}
    assert (cfg.base_gate_up, cfg.base_down) == (chosen["base_gate_up"], chosen["base_down"])
    c32 = configs.load_layer_config(Dims.of(sh, 3, rank=32, adapters=2), folder=out, gpu_name="cpu")
    assert c32.gate_up_shrink.BLOCK_SIZE_N == 32 and c32.down_expand.BLOCK_SIZE_K == 32
    # resumable: a second run tunes nothing
    s2 = tuning.tune(["tiny"], [16], 2, [3], out, csv_path, **kw)
    assert s2["tuned"] == [] and s2["skipped"] == [("tiny", 16, 3)]


def test_candidate_lists_are_small_and_valid():
    for T in (1, 64, 1600, 8192):
        for m in ("gpt-oss-20b", "qwen3-30b-a3b"):
            s = get_shape(m)
            d = default_config(Dims.of(s, T, rank=32, adapters=8))
            bms = tuning.lora_bm_candidates(T, s.top_k, s.experts, 8)
            assert 1 <= len(bms) <= 3 and d.lora_block_size_m in bms
            assert d.base_block_size_m in tuning.base_bm_candidates(T, s.top_k, s.experts)
            for op in LORA_OPS:
                cands = tuning.lora_op_candidates(op, bms[-1], getattr(d, op), 32, s.hidden)
                assert 2 <= len(cands) <= 8 and all(c.BLOCK_SIZE_M == bms[-1] for c in cands)
                assert cands[0] == getattr(d, op).__class__(
                    **{**getattr(d, op).to_dict(), "BLOCK_SIZE_M": bms[-1]}
                )
                assert len(set(cands)) == len(cands)
                if op.endswith("expand"):
                    assert all(c.SPLIT_K == 1 for c in cands)
            for bm in (16, 64):
                base = tuning.base_op_candidates(bm, d.base_down)
                assert 2 <= len(base) <= 5 and all(c.BLOCK_SIZE_M == bm for c in base)


@pytest.mark.parametrize(
    "extra,flag,text",
    [
        (["--ranks", "a"], "--ranks", "'a'"),
        (["--ranks", ""], "--ranks", "comma-separated"),
        (["--copy-ranks", "x"], "--copy-ranks", "'x'"),
        (["--max-candidates", "0"], "--max-candidates", ">= 1"),
        (["--tokens", "1,x"], "--tokens", "'x'"),
        (["--model", "nope"], "--model", "unknown model preset 'nope'"),
        (["--adapters", "2.5"], "--adapters", "'2.5'"),
        (["--device", "tpu"], "--device", "'tpu'"),
        (["--budget-s", "nan"], "--budget-s", ">= 0"),
        (["--seed", "x"], "--seed", "'x'"),
    ],
)
def test_tuning_cli_rejects_bad_arguments(tmp_path, capsys, extra, flag, text):
    argv = ["--model", "tiny", "--out", str(tmp_path / "cfg"), "--csv", str(tmp_path / "t.csv"), *extra]
    with pytest.raises(SystemExit) as e:
        tuning.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and text in err and "Traceback" not in err
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "t.csv").exists()  # no work done


def test_tuning_cli_rejects_bad_paths_and_devices(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    not_trials = tmp_path / "other.csv"
    not_trials.write_text("a,b\n1,2\n")
    t = str(tmp_path / "t.csv")
    cases = [
        (["--out", str(f), "--csv", t], "argument --out: ", "is not a folder"),
        (["--out", str(f / "sub"), "--csv", t], "argument --out: ", "is a file"),
        (["--out", str(tmp_path / "o"), "--csv", str(tmp_path)], "argument --csv: ", "is a folder"),
        (["--out", str(tmp_path / "o"), "--csv", str(not_trials)], "argument --csv: ", "not a trials CSV"),
    ]
    if not torch.cuda.is_available():
        cases.append(
            (["--out", str(tmp_path / "o"), "--csv", t, "--device", "cuda"], "--device", "needs a CUDA GPU")
        )
    for argv, flag, text in cases:
        with pytest.raises(SystemExit) as e:
            tuning.main(["--model", "tiny", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and text in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(models=["nope"]), "models"),
        (dict(ranks=[]), "ranks"),
        (dict(tokens=[2.5]), "tokens"),
        (dict(adapters=0), "adapters"),
        (dict(copy_ranks=["x"]), "copy_ranks"),
        (dict(max_bms=0), "max_bms"),
        (dict(budget_s=-1.0), "budget_s"),
        (dict(device="tpu"), "device"),
        (dict(seed="a"), "seed"),
    ],
)
def test_tune_api_rejects_bad_arguments(tmp_path, kw, name):
    args = dict(
        models=["tiny"], ranks=[16], adapters=2, tokens=[3], out=tmp_path / "o", csv_path=tmp_path / "t.csv"
    )
    args.update(kw)
    pos = [args.pop(k) for k in ("models", "ranks", "adapters", "tokens", "out", "csv_path")]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        tuning.tune(*pos, progress=False, **{"device": "cpu", **args})
    assert not (tmp_path / "t.csv").exists() and not (tmp_path / "o").exists()


# ---- the fused tuner -----------------------------------------------------------------------------
@needs_interpreter
def test_fused_tuner_writes_a_file_the_loader_reads(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", configs.TunedConfigWarning)
        got = ft.tune_fused(
            ["tiny-oss"],
            [1, 40],
            rank=16,
            adapters=4,
            out=tmp_path,
            csv_path=tmp_path / "t.csv",
            dtype=torch.float32,
            gpu="NVIDIA_H200",
            device="cpu",
            max_bms=1,
            max_cands=1,
        )
    assert set(got) == {("tiny-oss", 1), ("tiny-oss", 40)}
    sh = get_shape("tiny-oss")
    for T in (1, 40):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", configs.TunedConfigWarning)
            c = configs.load_fused_config(
                Dims.of(sh, T, rank=16, adapters=4), folder=tmp_path, gpu_name="NVIDIA_H200"
            )
        assert (c.base_gate_up, c.base_down) == (
            got["tiny-oss", T]["fused_gate_up"],
            got["tiny-oss", T]["fused_down"],
        )
    rows = rows_of(tmp_path / "t.csv")
    assert list(rows[0]) == ft.CSV_COLUMNS
    assert sum(r["kind"] == "choice" for r in rows) == 4  # two ops x two workloads
    assert all(float(r["ms_p50"]) > 0 for r in rows if r["kind"] == "trial")
    assert rows[-1]["kind"] == "session"


def test_fused_candidates():
    cur = OpConfig(16, 64, 64, 1, 4, 4, 4)
    down = ft.fused_op_candidates("fused_down", 16, cur)
    assert down[0] == cur and any(c.SPLIT_K > 1 for c in down[1:]) and all(c.BLOCK_SIZE_M == 16 for c in down)
    up = ft.fused_op_candidates("fused_gate_up", 64, cur)
    assert up[0].SPLIT_K == 1 and all(c.SPLIT_K == 1 and c.BLOCK_SIZE_M == 64 for c in up) and len(up) <= 7
    with pytest.raises(ValueError, match="op must be one of"):
        ft.fused_op_candidates("base_down", 16, cur)


def test_fused_tuner_bad_arguments_named_before_writing(tmp_path):
    (tmp_path / "afile").write_text("x")
    kw = dict(out=tmp_path / "o", csv_path=tmp_path / "t.csv", device="cpu")
    cases = [
        (dict(models="tiny"), "models: expected a non-empty list"),
        (dict(models=["nope"]), "models: unknown"),
        (dict(tokens=[True]), "tokens"),
        (dict(tokens=[0]), "tokens"),
        (dict(rank=True), "rank"),
        (dict(adapters=0), "adapters"),
        (dict(gpu="a/b"), "no path separators"),
        (dict(out=tmp_path / "afile" / "sub"), "out: cannot make"),
        (dict(out=tmp_path / "afile"), "out: .* not a folder"),
        (dict(out=5), "out: expected a folder path"),
        (dict(csv_path=tmp_path), "csv_path: .* is a folder"),
        (dict(csv_path=tmp_path / "afile" / "x.csv"), "csv_path: cannot make"),
    ]
    for over, match in cases:
        args = dict(models=["tiny"], tokens=[1], **kw)
        args.update(over)
        with pytest.raises(ValueError, match=match):
            ft.tune_fused(args.pop("models"), args.pop("tokens"), **args)
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.csv").exists()
