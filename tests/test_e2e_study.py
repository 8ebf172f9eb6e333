"""Notebook 11's study module (moelora_lib.studies.e2e) on the CPU.

* The targets and summary tables from synthetic rows with the columns and grid the notebook writes on the
  GPU (built with the module's own row helpers), checked against values recomputed here.
* The CPU profile's code path on a tiny config through the Triton interpreter: adapters written as PEFT
  files and loaded, generation rows, the recompilation check, the per-step breakdown, the CSV tables.
* The adapter files this module writes are what PEFT reads: a tiny model of each kind gives the same logits
  through ``load_peft_adapter`` as transformers + ``PeftModel.from_pretrained`` on the same files.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from moelora_lib.model.generate import Generator
from moelora_lib.studies import e2e

PLEN = 1600
NEW = {"gpt-oss-20b": 600, "qwen3-30b-a3b": 128, "qwen3-32b": 128}
CONC = {"gpt-oss-20b": [1, 8, 32], "qwen3-30b-a3b": [1, 8], "qwen3-32b": [1, 8]}
# synthetic base step (ms) per (model, concurrency), above each bytes floor; adapters cost +20 %
STEP = {("gpt-oss-20b", 1): 4.5, ("gpt-oss-20b", 8): 9.0, ("gpt-oss-20b", 32): 12.0}
STEP |= {("qwen3-30b-a3b", 1): 6.0, ("qwen3-30b-a3b", 8): 9.0, ("qwen3-32b", 1): 22.0, ("qwen3-32b", 8): 24.0}


def _res(conc: int, new: int, ttft_ms: float, step_ms: float, rows: int | None = None):
    """A GenerationResult-shaped namespace: every request ``new`` tokens, one step every ``step_ms``."""
    dec = (new - 1) * step_ms / 1e3
    total = ttft_ms / 1e3 + dec
    return SimpleNamespace(
        tokens=[[0] * new for _ in range(conc)],
        ttft_s=[ttft_ms / 1e3 * (1 + 0.1 * i) for i in range(conc)],
        request_otps=[(new - 1) / dec] * conc,
        aggregate_otps=conc * new / total,
        decode_otps=conc * (new - 1) / dec,
        step_s=[step_ms / 1e3] * (new - 1),
        prefill_s=ttft_ms / 1e3,
        decode_s=dec,
        total_s=total,
        output_tokens=conc * new,
    )


def _ours(model, scenario, conc, step_ms, ttft_ms, stage="tuned"):
    adapters = e2e.adapter_slots(scenario, conc, 8)
    return e2e.generation_row(
        _res(conc, NEW[model], ttft_ms, step_ms),
        model=model,
        scenario=scenario,
        stage=stage,
        impl="moelora",
        adapters=adapters,
        prompt_len=PLEN,
        new_tokens=NEW[model],
        rank=32,
        adapters_loaded=0 if scenario == "base" else 8,
        cuda_graphs=True,
        mode="graph",
        dtype="bfloat16",
    )


def _synthetic():
    gen, bd, loads = [], [], []
    for m, cs in CONC.items():
        for sc in e2e.SCENARIOS:
            for c in cs:
                step = STEP[(m, c)] * (1.2 if sc == "adapters_mixed" else 1.0)
                row = _ours(m, sc, c, step, ttft_ms=65.0 * c)
                gen.append(row)
                k = step * 1e3 * 0.8  # kernels cover 80 % of the step
                b = dict(attention=0.2 * k, attn_proj_base=0.1 * k, mlp_base=0.5 * k, other=0.1 * k)
                b |= dict(lora=0.1 * k if sc == "adapters_mixed" else 0.0, unattributed=0.0)
                b["mlp_base"] += 0.1 * k if sc == "base" else 0.0
                b["kernel_sum"] = sum(b.values())
                bd += e2e.breakdown_rows(b, row, position=PLEN)
        for slot in range(8):
            src = "peft_file" if slot == 0 else "direct"
            loads.append(
                dict(
                    model=m, stage="tuned", slot=slot, source=src, load_s=3.0 if slot == 0 else 0.05, rank=32
                )
                | dict(file_mb=742.0 if slot == 0 else math.nan, write_s=1.0 if slot == 0 else math.nan)
            )
    gen.append(_ours("gpt-oss-20b", "adapters_mixed", 1, 7.0, ttft_ms=80.0, stage="naive"))
    for sc, otps, ttft in (("transformers", 23.5, 135.0), ("transformers_peft", 8.35, 251.0)):
        r = e2e.generation_row(
            _res(1, 64, ttft, 1e3 / otps),
            model="gpt-oss-20b",
            scenario=sc,
            stage=None,
            impl=sc,
            adapters=[0] if sc == "transformers_peft" else [None],
            prompt_len=PLEN,
            new_tokens=64,
            rank=32,
            adapters_loaded=int(sc == "transformers_peft"),
            cuda_graphs=False,
            mode="eager",
            dtype="bfloat16",
            attn_implementation="eager",
            experts_implementation="grouped_mm",
        )
        gen.append(r)
    rc = []
    for stage, first in (("tuned", 66.0), ("naive", 2400.0)):
        for i, n in enumerate((1234, 1777)):
            f = first if i == 0 else 67.0
            rc.append(
                dict(model="gpt-oss-20b", stage=stage, prompt_len=n, ttft_first_ms=f, ttft_warm_ms=64.0)
                | dict(ratio=f / 64.0, new_binaries=6 if (stage == "naive" and i == 0) else 0)
            )
    return pd.DataFrame(gen), pd.DataFrame(bd), pd.DataFrame(rc), pd.DataFrame(loads)


def test_targets_table_thresholds():
    gen, _, rc, _ = _synthetic()
    t = e2e.targets_table(gen, rc)
    assert set(t.target) == set(e2e.TARGETS)
    row = t[t.target == "ttft_c1"].iloc[0]
    assert row.value == pytest.approx(65.0) and not row.met  # TTFT 65 ms > 60 ms
    assert t[t.target == "vs_transformers"].met.all()
    assert e2e.targets_table(gen.iloc[0:0], None).empty
    # mixed ÷ base = 1 / 1.2 at all 7 (model, concurrency) points: missed everywhere
    lvb = t[t.target == "lora_vs_base"]
    assert len(lvb) == 7 and not lvb.met.any() and (lvb.value.round(4) == round(1 / 1.2, 4)).all()
    peft = gen[gen.impl == "transformers_peft"].iloc[0]
    head = gen[(gen.impl == "moelora") & (gen.stage == "tuned") & (gen.model == "gpt-oss-20b")]
    h1 = head[(head.scenario == "adapters_mixed") & (head.concurrency == 1)].iloc[0]
    vs = t[t.target == "vs_transformers"].value.iloc[0]
    assert vs == pytest.approx(h1.otps_per_request / peft.otps_per_request)
    rc_t = t[t.target == "recompile"]  # only the final stage's rows: 66/64 and 67/64, both met
    assert len(rc_t) == 2 and rc_t.met.all()
    summ = e2e.summary_table(gen).set_index(["model", "concurrency"])
    assert summ.loc[("qwen3-32b", 8), "ratio"] == pytest.approx(1 / 1.2)


def test_floors():
    f = e2e.decode_floor("gpt-oss-20b", batch=1, context=1900)
    # attention 0.637 B + 4 routed experts x 24 layers 2.389 B + lm_head 0.579 B params + routers, bf16
    assert f["weight_gb"] == pytest.approx(7.21, abs=0.01)
    assert 550 < f["otps_ceiling"] < 650
    one = e2e.decode_floor("gpt-oss-20b", batch=1, context=1900, adapters=1)
    assert 0.10 < one["lora_gb"] < 0.14 and one["floor_ms"] > f["floor_ms"]
    many = e2e.decode_floor("gpt-oss-20b", batch=32, context=1900)
    assert many["weight_gb"] > 5 * f["weight_gb"] / 1.05  # nearly every expert of every layer
    dense = e2e.decode_floor("qwen3-32b", batch=8, context=1664)
    assert dense["weight_gb"] == pytest.approx(
        e2e.decode_floor("qwen3-32b", batch=1, context=1)["weight_gb"], 1e-3
    )
    p = e2e.prefill_floor("gpt-oss-20b", prompt_len=1600)
    assert 9 < p["tflop"] < 11
    assert e2e.prefill_floor("qwen3-32b", prompt_len=1600)["tflop"] > 100


# --------------------------------------------------------------------------------------------------
# the CPU profile's code path (tiny configs, Triton interpreter)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run():
    """The notebook's CPU flow on tiny-gpt-oss: base, adapters (slot 0 from a file), mixed, the mixed
    batch's breakdown, recompilation check."""
    name = "tiny-gpt-oss"
    # one decoder layer: the flow's code path (every layer runs the same code)
    model = e2e.build_model(
        name, dtype=torch.float32, device="cpu", max_batch=2, max_seq=16, max_tokens=32, max_rank=4,
        num_layers=1,
    )  # fmt: skip
    gen = Generator(model)
    rows, bd = [], []
    for scenario in e2e.SCENARIOS:
        if scenario == "adapters_mixed":
            loads = e2e.load_adapters(model, name, rank=4, alpha=8, seed=0, file_slots=[0])
        row = e2e.run_generation(
            gen, name, scenario, concurrency=2, prompt_len=6, new_tokens=2, warm_tokens=0
        )
        rows.append(row)
    # the per-step breakdown of the mixed batch (the scenario with every category present)
    b = e2e.step_breakdown(model, batch=2, adapters=e2e.adapter_slots(scenario, 2, 8), position=6, steps=1)
    bd += e2e.breakdown_rows(b, row, position=6)
    rc = e2e.recompile_rows(gen, name, lengths=[5], warm_reps=1)
    return model, rows, bd, rc, loads


def test_cpu_rows(cpu_run):
    model, rows, bd, rc, loads = cpu_run
    base, mixed = rows
    assert base["adapters_loaded"] == 0 and mixed["adapters_loaded"] == 8
    assert mixed["distinct_adapters"] == 2 and base["distinct_adapters"] == 0
    assert base["mode"] == "cpu-interpreter" and not base["cuda_graphs"] and base["stage"] == "auto"
    assert model.stage == "auto"  # build_model's default: the rows record the model's stage name
    for r in rows:
        assert r["output_tokens"] == 4 and r["ttft_ms_mean"] > 0 and r["otps_aggregate"] > 0
        assert r["gpu"] == "cpu" and "git_commit" in r  # bench.result_row's environment columns
    assert [r["source"] for r in loads] == ["peft_file"] + ["direct"] * 7
    assert loads[0]["file_mb"] > 0 and all(r["load_s"] >= 0 for r in loads)
    assert set(model.layers[0].mlp.experts.loaded_slots) == set(range(8))
    cats = {r["category"] for r in bd}
    assert cats == {*e2e.CATEGORIES, "kernel_sum", "step", "gaps"}
    assert all(math.isfinite(r["us_per_step"]) for r in bd)
    assert rc[0]["prompt_len"] == 5 and rc[0]["new_binaries"] == 0 and rc[0]["ratio"] > 0


def test_cpu_tables(cpu_run, tmp_path):
    _, rows, bd, rc, loads = cpu_run
    paths = e2e.write_tables(tmp_path, generation=rows, breakdown=bd, recompile=rc, adapter_load=loads)
    assert sorted(p.name for p in paths.values()) == sorted(f"11_{t}.csv" for t in e2e.TABLES)
    gen, bdf, rcf, ld = (pd.read_csv(paths[t]) for t in e2e.TABLES)  # read back, as the notebook does
    with pytest.raises(ValueError, match="unknown table"):
        e2e.write_tables(tmp_path, checks=[])
    assert len(gen) == 2 and set(gen.scenario) == set(e2e.SCENARIOS) and (ld.source == "peft_file").any()
    assert list(e2e.targets_table(gen.iloc[0:0], None).columns) == [
        "target", "model", "concurrency", "prompt_len", "value", "threshold", "met"
    ]  # fmt: skip


def test_no_adapter_while_loaded(cpu_run):
    """Notebook 13's third scenario: no request on an adapter while 8 are loaded; its restricted breakdown
    runs no LoRA launch (the base-only variant), the mixed batch's restriction keeps them. Launches are
    checked, not CPU times (those vary with the machine's load)."""
    model, *_ = cpu_run
    gen = Generator(model)
    row = e2e.run_generation(gen, "tiny-gpt-oss", e2e.NO_ADAPTER_LOADED, concurrency=1, prompt_len=6,
                             new_tokens=2, warm_tokens=0)  # fmt: skip
    assert row["scenario"] == e2e.NO_ADAPTER_LOADED and row["adapters_loaded"] == 8
    assert row["distinct_adapters"] == 0 and row["output_tokens"] == 2
    kw = dict(batch=1, position=6, steps=1, restrict=True)
    off = e2e.step_breakdown(model, adapters=e2e.adapter_slots(e2e.NO_ADAPTER_LOADED, 1, 8), **kw)
    on = e2e.step_breakdown(model, adapters=e2e.adapter_slots("adapters_mixed", 1, 8), **kw)
    assert off["lora"] == 0 and off["kernel_sum"] > 0 and on["kernel_sum"] > 0, (off, on)
    assert not any(any(m) for m in model.lora_launches([])), "a batch without adapters launches no LoRA"
    assert any(any(m) for m in model.lora_launches(range(8))), "the mixed batch launches LoRA"
    assert model.lora_launches(None) == model.lora_launches(range(8))  # the restriction was undone


def test_adapter_slots_and_prompts():
    assert e2e.adapter_slots("base", 3, 8) == [None] * 3
    assert e2e.adapter_slots(e2e.NO_ADAPTER_LOADED, 2, 8) == [None] * 2
    assert e2e.adapter_slots("adapters_mixed", 10, 8) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    with pytest.raises(ValueError):
        e2e.adapter_slots("mixed", 2, 8)
    p = e2e.make_prompts(2, 5, 50, seed=1)
    assert len(p) == 2 and all(len(x) == 5 and all(0 <= t < 50 for t in x) for x in p)
    assert p == e2e.make_prompts(2, 5, 50, seed=1)
    with pytest.raises(ValueError):
        e2e.config_dict("llama-3")


def test_fits_device():
    """The notebooks' memory gate (13, 14, 15): the estimate plus the margin against the device; the H100
    run's cases (data/dev/h100_20261207): Qwen3-30B-A3B bf16 at notebook 13's sizes does not fit 85 GB,
    GPT-OSS-20B does; no device (the CPU profile) always fits."""
    assert e2e.fits_device(77.0, margin_gb=8, device_gb=85.0) == (True, "")  # the bound itself fits
    fits, why = e2e.fits_device({"total_gb": 94.4, "kv_gb": 5.0}, margin_gb=8, device_gb=85.02)
    assert not fits and why == "needs ≈ 94 GB (+ 8 GB margin), the device has 85 GB"
    assert e2e.fits_device(1e6, margin_gb=8, device_gb=float("nan")) == (True, "")
    assert e2e.fits_device(1e6, margin_gb=8, device_gb=None) == (True, "")
    sizes = dict(num_adapters=8, max_rank=32, max_batch=32, max_seq=1600 + 128, max_tokens=8192)
    assert not e2e.fits_device(e2e.memory_estimate_gb("qwen3-30b-a3b", **sizes), margin_gb=8, device_gb=85)[0]
    sizes["max_seq"] = 1600 + 600
    assert e2e.fits_device(e2e.memory_estimate_gb("gpt-oss-20b", **sizes), margin_gb=8, device_gb=85)[0]


def test_real_configs_and_adapter_keys():
    c = e2e.model_config("gpt-oss-20b")
    ts = e2e.adapter_tensors(
        e2e.model_config("tiny-gpt-oss"), rank=4, seed=0, dtype=torch.float32, device="cpu"
    )  # key layout is the same at every size; shapes follow the config
    tiny = e2e.model_config("tiny-gpt-oss")
    E, H, I = tiny.num_experts, tiny.hidden_size, tiny.moe_intermediate_size
    p = "base_model.model.model.layers.1."
    assert ts[p + "mlp.experts.base_layer.lora_A.weight"].shape == (E * 4, H)
    assert ts[p + "mlp.experts.base_layer.lora_B.weight"].shape == (2 * I, E * 4)
    assert ts[p + "mlp.experts.lora_B.weight"].shape == (H, E * 4)
    assert ts[p + "self_attn.k_proj.lora_B.weight"].shape == (tiny.kv_width, 4)
    assert e2e.peft_targets(c)[1] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert e2e.peft_targets(e2e.model_config("qwen3-32b"))[1] is None
    assert c.hidden_size == 2880 and e2e.model_config("tiny-qwen3").intermediate_size == 96


# --------------------------------------------------------------------------------------------------
# the files we write are what PEFT reads
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(e2e.TINY_MODELS.values()))
def test_written_adapter_matches_peft(name, tmp_path):
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from moelora_lib.model import load_hf_checkpoint
    from moelora_lib.model.peft_adapters import load_peft_adapter

    hf = e2e.hf_model(name, dtype=torch.float32, device="cpu", seed=1)
    hf.save_pretrained(str(tmp_path / "base"))
    e2e.write_peft_adapter(
        tmp_path / "ad", e2e.model_config(name), rank=4, alpha=8, seed=3, dtype=torch.float32, std=0.1
    )
    sizes = dict(num_adapters=2, max_rank=4, max_batch=2, max_seq=8, max_tokens=16)
    ours = load_hf_checkpoint(tmp_path / "base", dtype=torch.float32, device="cpu", **sizes)
    load_peft_adapter(ours, 1, tmp_path / "ad")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    out = ours(ids, [0, 0], [1, -1])
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        with_adapter = pm(input_ids=ids[0:1]).logits[0].float()
        with pm.disable_adapter():
            without = pm(input_ids=ids[1:2]).logits[0].float()
            base_row0 = pm(input_ids=ids[0:1]).logits[0].float()
    assert (with_adapter - base_row0).abs().max() > 1e-2, "the adapter changed nothing: a vacuous check"
    assert (out[0] - with_adapter).abs().max() < 1e-4
    assert (out[1] - without).abs().max() < 1e-4


def test_breakdown_attribution_of_gpu_events():
    """The GPU branch of step_breakdown's attribution on fake profiler events: kernels linked to an op go by
    the op's scopes (LoRA kernels by name wherever they are), kernels no op was linked to go by name (ours)
    or to "unattributed", and the scopes' own GPU spans are never counted."""
    from torch.autograd import DeviceType

    def cpu(name, parent=None, kernels=()):
        ks = [SimpleNamespace(name=n, duration=d) for n, d in kernels]
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, kernels=ks)

    def dev(name, us, annotation=False):
        span = SimpleNamespace(elapsed_us=lambda: us)
        return SimpleNamespace(
            name=name, device_type=DeviceType.CUDA, time_range=span, is_user_annotation=annotation
        )

    attn = cpu("e2e::attention")
    proj = cpu("e2e::proj", attn)
    mlp = cpu("e2e::mlp")
    events = [
        attn,
        proj,
        mlp,
        cpu("aten::mm", proj, [("nvjet_gemm", 10.0)]),  # qkv base GEMM
        cpu("cuLaunchKernelEx", proj, [("_dense_shrink_kernel", 3.0), ("_align_pair_kernel", 1.0)]),
        cpu("aten::softmax", attn, [("softmax_kernel", 4.0)]),
        cpu("moelora::moe_lora_layer", mlp, [("_fused_moe_kernel", 20.0), ("_lora_expand_kernel", 5.0)]),
        cpu("aten::mm", None, [("nvjet_gemm", 30.0)]),  # lm_head, outside every scope
        cpu("e2e::mlp", None, [("e2e::mlp", 99.0)]),  # an annotation span appended as a "kernel"
    ]
    events += [
        dev(n, d)
        for n, d in [("nvjet_gemm", 10.0), ("_dense_shrink_kernel", 3.0), ("_align_pair_kernel", 1.0)]
    ]
    events += [
        dev(n, d)
        for n, d in [("softmax_kernel", 4.0), ("_fused_moe_kernel", 20.0), ("_lora_expand_kernel", 5.0)]
    ]
    events += [dev("nvjet_gemm", 30.0), dev("e2e::mlp", 99.0, annotation=True)]
    events += [
        dev("_lora_shrink_kernel", 2.0),
        dev("_topk_reduce_kernel", 1.5),
        dev("elementwise", 0.5),
    ]  # unlinked
    t = e2e._attribute(events, cuda=True, moe=True)
    assert t == pytest.approx(
        dict(attention=4.0, attn_proj_base=10.0, mlp_base=21.5, lora=11.0, other=30.0, unattributed=0.5)
    )
    assert e2e._category_by_name("_align_scatter_kernel", moe=False) == "lora"
    # the model runner's own Triton kernels (launched outside any torch op) by name
    for k in ("_decode_split_kernel", "_decode_combine_kernel", "_qk_norm_rope_cache_kernel"):
        assert e2e._category_by_name(k, moe=True) == "attention"
    assert e2e._category_by_name("_rms_norm_kernel", moe=False) == "other"
