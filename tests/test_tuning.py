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


@needs_interpreter
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_w8a8"])
def test_packed_tune_writes_its_forms_base_file_only(tmp_path, fmt):
    # packed experts: the base GEMMs tuned on them into the form's own base file; the LoRA ops (one file for
    # every form) untouched; CSV group base_<form>; a dense lookup never reads the packed file
    from moelora_lib.studies import tuner

    out, csv_path = tmp_path / "cfg", tmp_path / "trials.csv"
    kw = dict(device="cpu", max_bms=1, max_cands=2, progress=False, weight_format=fmt)
    timers, real = [], tuner.graph_timer  # each candidate is timed as the layer would launch it
    tuner.graph_timer = lambda run, device, adapt: timers.append((run, adapt)) or real(run, device, adapt)
    try:
        s = tuning.tune(["tiny"], [16], 2, [3], out, csv_path, **kw)
    finally:
        tuner.graph_timer = real
    run, adapt = timers[0]
    assert type(run.w13).__name__ == ("MXFP4Weight" if fmt == "mxfp4" else "FP8BlockWeight")
    want_k = {"mxfp4": 32, "fp8_w8a8": 64}[fmt]  # W8A8 doubles a 16-bit tile's K step (w8a8_config)
    assert adapt("base_gate_up", OpConfig(BLOCK_SIZE_K=32)).BLOCK_SIZE_K == want_k
    assert s["tuned"] == [("tiny", 16, 3)]
    assert sorted(p.name for p in out.iterdir()) == [configs.config_file_name("cpu", "base", fmt)]
    rows = rows_of(csv_path)
    assert {r["group"] for r in rows if r["kind"] == "choice"} == {f"base_{fmt}"}
    chosen = {r["op"]: OpConfig(**json.loads(r["config_json"])) for r in rows if r["kind"] == "choice"}
    d = Dims.of(get_shape("tiny"), 3, rank=16, adapters=2, weight_format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no LoRA files in this folder: those fall back to the defaults
        cfg = configs.load_layer_config(d, folder=out, gpu_name="cpu")
        assert (cfg.base_gate_up, cfg.base_down) == (chosen["base_gate_up"], chosen["base_down"])
        assert cfg.source.endswith(f"; lora=default; base=file({fmt})")
        dense = configs.load_layer_config(
            Dims.of(get_shape("tiny"), 3, rank=16, adapters=2), folder=out, gpu_name="cpu"
        )
        assert dense.source == "default"  # the packed file never configures dense experts
    assert tuning.tune(["tiny"], [16], 2, [3], out, csv_path, **kw)["tuned"] == []  # resumable


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
        (["--device", "cpu", "--dtype", "bfloat16"], "--dtype", "bfloat16 does not run on the CPU"),
        (["--weight-format", "int4"], "--weight-format", "invalid choice"),
        (["--weight-format", "mxfp4", "--copy-ranks", "64"], "--copy-ranks", "weight_format dense only"),
    ],
)
def test_tuning_cli_rejects_bad_arguments(tmp_path, capsys, extra, flag, text):
    argv = ["--model", "tiny", "--out", str(tmp_path / "cfg"), "--csv", str(tmp_path / "t.csv"), *extra]
    with pytest.raises(SystemExit) as e:
        tuning.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and text in err and "Traceback" not in err
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "t.csv").exists()  # no work done


@pytest.mark.parametrize("module", [tuning, dt, ft], ids=["tuning", "dense_tuning", "fused_tuning"])
def test_tuner_help_describes_the_tool_in_whole_sentences(module, capsys):
    """--help shows the module docstring's first paragraph, joined, not its first line cut mid-sentence."""
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    first = " ".join(module.__doc__.split("\n\n")[0].split()).rstrip(":")
    assert first in help_text
    assert first.endswith((".", ")")), first


def test_tuning_cli_rejects_bad_paths_and_devices(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    not_trials = tmp_path / "other.csv"
    not_trials.write_text("a,b\n1,2\n")
    t = str(tmp_path / "t.csv")
    cases = [
        (["--out", str(f), "--csv", t], "--out: ", "is not a folder"),
        (["--out", str(f / "sub"), "--csv", t], "--out: ", "is a file"),
        (["--out", str(tmp_path / "o"), "--csv", str(tmp_path)], "--csv: ", "is a folder"),
        (["--out", str(tmp_path / "o"), "--csv", str(not_trials)], "--csv: ", "not a trials CSV"),
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
        (dict(weight_format="int4"), "weight_format"),
        (dict(weight_format="mxfp4", copy_ranks=[32]), "copy_ranks"),
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


# ---- the dense tuner -----------------------------------------------------------------------------
QKV = dict(hidden=48, slices=(64, 16, 16), rank=16, adapters=2)  # tiny/qkv


def dense_leaf(bm, bn, **kw):
    return {
        "block_m": bm,
        "block_n": bn,
        "block_k": 32,
        "group_size_m": 1,
        "num_warps": 4,
        "num_stages": 2,
        **kw,
    }


def test_dense_projections_plan_and_candidates():
    ps = {p.name: p for p in dt.projections("all")}
    assert (
        len(ps) == 12
        and ps["gpt-oss-20b/qkv"].slices == (4096, 512, 512)
        and ps["qwen3-32b/down"].hidden == 25600
    )
    assert [p.name for p in dt.projections("tiny:qkv,qwen3-32b:down")] == ["tiny/qkv", "qwen3-32b/down"]
    with pytest.raises(ValueError, match="unknown projection 'mlp'"):
        dt.projections("gpt-oss-20b:mlp")
    # identical entries under vLLM's keys: the later workload takes the existing one
    wl = {w.proj.name: w for w in dt.plan(dt.projections("all"), [32], 8, [64])}
    assert wl["qwen3-30b-a3b/qkv"].expand_shared and not wl["qwen3-30b-a3b/qkv"].shrink_shared
    assert wl["qwen3-30b-a3b/o"].shrink_shared and wl["qwen3-32b/down"].expand_shared
    assert not any(w.shrink_shared and w.expand_shared for w in wl.values())
    for p in (ps["gpt-oss-20b/qkv"], ps["llama-3.3-70b/down"]):
        for T in (1, 256, 8192):
            w = dt.Workload(p, 32, 8, T)
            bms = dt.bm_candidates(T, 8)
            assert 1 <= len(bms) <= 3 and w.default().block_size_m in bms
            for bm in bms:
                s, e = w.candidates("shrink", bm, 8, 2), w.candidates("expand", bm, 8, 2)
                assert 4 <= len(s) <= 8 and 4 <= len(e) <= 8 and all(c.BLOCK_SIZE_M == bm for c in s + e)
                assert all(c.SPLIT_K == 1 for c in e) and len(set(s)) == len(s)
                assert all(c.BLOCK_SIZE_K * c.SPLIT_K <= max(p.hidden, c.BLOCK_SIZE_K) for c in s)
                assert all(dt._smem_shrink(c, 2) <= dt.SMEM_LIMIT_BYTES for c in s[1:])


@needs_interpreter
def test_dense_tune_writes_files_the_loader_reads(tmp_path):
    out, trials = tmp_path / "cfg", tmp_path / "trials.csv"
    msgs = []
    s = dt.tune("tiny/qkv", [16], 2, [3, 24], out, trials, device="cpu", progress=False, echo=msgs.append)
    assert "CPU SMOKE RUN" in msgs[0] and "2 workloads" in msgs[1]
    assert s["tuned"] == [("tiny/qkv", 16, 3), ("tiny/qkv", 16, 24)] and s["gpu"] == "cpu"
    assert sorted(os.listdir(out)) == ["cpu_EXPAND_TRUE.json", "cpu_SHRINK.json"]
    rows = rows_of(trials)
    assert list(rows[0]) == dt.CSV_COLUMNS
    assert {r["kind"] for r in rows} >= {"trial", "bm_sum", "check", "choice", "session"}
    assert all(float(r["rel_err"]) <= TOLERANCES[torch.float32] for r in rows if r["kind"] == "check")
    assert {r["mode"] for r in rows if r["kind"] == "trial"} == {"cpu-interpreter"}
    chosen = {
        (r["T"], r["op"]): OpConfig(**json.loads(r["config_json"])) for r in rows if r["kind"] == "choice"
    }
    c = configs.load_dense_config(24, **QKV, folder=out, gpu_name="cpu")
    assert c.source == f"folder:{out}" and (c.shrink, c.expand) == (
        chosen["24", "shrink"],
        chosen["24", "expand"],
    )
    before = {p: (out / p).read_text() for p in os.listdir(out)}
    s2 = dt.tune("tiny/qkv", [16], 2, [3, 24], out, trials, device="cpu", progress=False, echo=msgs.append)
    assert s2["tuned"] == [] and len(s2["skipped"]) == 2  # resumable
    assert {p: (out / p).read_text() for p in os.listdir(out)} == before


@needs_interpreter
def test_dense_tuner_takes_existing_entries_and_skips_conflicts(tmp_path):
    out, trials = tmp_path / "cfg", tmp_path / "trials.csv"
    ex = configs.set_entry({}, configs.dense_keys("expand", 3, **QKV), dense_leaf(32, 64))
    configs.save_config_file(out / "cpu_EXPAND_TRUE.json", ex)
    s = dt.tune("tiny/qkv", [16], 2, [3], out, trials, device="cpu", progress=False, echo=lambda m: None)
    assert s["tuned"] == [("tiny/qkv", 16, 3)]
    c = configs.load_dense_config(3, **QKV, folder=out, gpu_name="cpu")
    assert c.block_size_m == 32 and c.expand.BLOCK_SIZE_N == 64 and c.expand.NUM_STAGES == 2
    rows = [r for r in rows_of(trials) if r["kind"] == "trial"]
    assert {r["BLOCK_SIZE_M"] for r in rows} == {"32"}
    assert [r["note"] for r in rows if r["op"] == "expand"] == ["shared entry (not tuned here)"]
    sh = json.loads((out / "cpu_SHRINK.json").read_text())
    configs.set_entry(sh, configs.dense_keys("shrink", 5, **QKV), dense_leaf(16, 32, split_k=1))
    configs.set_entry(ex, configs.dense_keys("expand", 5, **QKV), dense_leaf(32, 64))
    configs.save_config_file(out / "cpu_SHRINK.json", sh)
    configs.save_config_file(out / "cpu_EXPAND_TRUE.json", ex)
    s = dt.tune("tiny/qkv", [16], 2, [5], out, trials, device="cpu", progress=False, echo=lambda m: None)
    assert s["conflicts"] == [("tiny/qkv", 16, 5)] and s["tuned"] == []
    assert any(r["kind"] == "conflict" for r in rows_of(trials))


@needs_interpreter
@pytest.mark.parametrize(
    "flag,value,match",
    [
        ("--projections", "gpt-oss-20b", "only the smoke presets"),
        ("--tokens", "100", "at most 64 tokens"),
        ("--dtype", "bfloat16", "bfloat16 does not run on the CPU"),
        ("--max-candidates", "5", "at most 2 candidates"),
        ("--jobs", "-1", "int >= 0"),
        ("--warmup-ms", "nan", "finite"),
        ("--csv", "OTHER_CSV", "not a trials CSV of the dense tuner"),
        ("--out", "FILE", "not a folder"),
    ],
)
def test_dense_cli_names_bad_flags_before_work(tmp_path, capsys, flag, value, match):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    value = {"FILE": str(tmp_path / "file.txt"), "OTHER_CSV": str(tmp_path / "other.csv")}.get(value, value)
    base = {"--projections": "tiny", "--tokens": "1", "--ranks": "16", "--adapters": "2", "--device": "cpu"}
    base.update({"--out": str(tmp_path / "cfg"), "--csv": str(tmp_path / "t.csv"), flag: value})
    with pytest.raises(SystemExit) as e:
        dt.main([x for k, v in base.items() for x in (k, v)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and match in err, err
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "t.csv").exists()


def test_dense_precompile_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_cache"))
    c = dt.Workload(dt.projections("tiny/o")[0], 16, 2, 8).candidates("expand", 16, 1, 2)[0]
    job = dict(op="expand", H=64, slices=[48], R=16, L=2, cfg=c.to_dict(), dtype="bfloat16")
    bad = dict(job, cfg=dict(c.to_dict(), BLOCK_SIZE_N=48))
    st = dt.precompile([job, bad], 1, 240, 90)
    assert (st["ok"], st["failed"], st["unfinished"]) == (1, 1, 0), st
    assert "BLOCK_SIZE_N must be a power of two" in st["errors"][0]
    assert any((tmp_path / "triton_cache").rglob("*.cubin"))


def test_fused_tuning_cli_usage_errors_and_run_errors(tmp_path, capsys, monkeypatch):
    """A bad flag exits with code 2 naming it before any work; an error raised during the run is not
    turned into a usage error."""
    out, t = str(tmp_path / "o"), str(tmp_path / "t.csv")
    for argv, flag in [(["--model", "nope"], "--model"), (["--model", "tiny", "--rank", "0"], "--rank")]:
        with pytest.raises(SystemExit) as e:
            ft.main([*argv, "--out", out, "--csv", t])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.csv").exists()

    def boom(*a, **k):
        raise ValueError("mid-run failure")

    monkeypatch.setattr(ft, "tune_fused_workload", boom)
    with pytest.raises(ValueError, match="mid-run failure"):
        ft.main(["--model", "tiny", "--tokens", "1", "--out", out, "--csv", t, "--no-progress"])
