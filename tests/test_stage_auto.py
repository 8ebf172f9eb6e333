"""Stage ``auto``: per T, the stage the fused config file's ``"stage"`` key names for that T's bucket.

CPU (Triton interpreter, fp32/fp16, tiny dims): :func:`moelora_lib.configs.load_stage_choice` over a
temporary config folder (``$MOELORA_TUNED_CONFIG_FOLDER``; GPU name ``cpu``) — the nearest-key T
buckets, the fallback to ``tuned`` (no file, no key, no folder), the bad-value error naming the key
path; ``MoELoRALayer(stage="auto")`` and ``fused_moe_lora(stage="auto")`` equal bit for bit to the
explicitly named stage at each T; the shipped H200 file's choices equal
:func:`~moelora_lib.studies.fused_tuning.stage_choices_from_csv` of ``data/12_fused.csv``.

"auto" is the default of the MoE path (``MoELoRALayer``, ``fused_moe_lora``, ``make_layer_run``,
``MultiLoRAModel`` and its builders); a tiny GPT-OSS ``MultiLoRAModel`` built with the default gives the
tokens of stage ``tuned`` when the file chooses ``tuned`` and the logits of stage ``fused`` (tolerance
table) when it chooses ``fused``; under generation with padded buckets each MoE layer resolves its stage
once per T, as the file says for that T. The notebook-09 helpers (:mod:`moelora_lib.studies.serving`)
accept "auto"; a bad stage name is a ValueError naming the argument and the allowed names everywhere.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib import LoRALinear, configs, fused_moe_lora
from moelora_lib.kernels import AUTO_STAGE, MOE_STAGE_NAMES, STAGES, OpConfig, stage_named
from moelora_lib.layer import MoELoRALayer
from moelora_lib.linear import lora_linear
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.studies import serving
from moelora_lib.studies.fused_tuning import stage_choices_from_csv, write_stage_choices
from moelora_lib.testing import assert_close_rel
from moelora_lib.workloads import make_inputs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FUSED = ROOT / "moelora_lib/configs/NVIDIA_H200/NVIDIA_H200_FUSED_MOE_LORA_FUSED.json"
E, H, I, K, L, R, S = 4, 64, 32, 2, 3, 16, 2  # the "tiny" preset's sizes
#: T -> the bucket's stage in the temp file (m = 1 fused, m = 4 tuned, m = 16 without a choice: tuned;
#: nearest m; T = 10 is as far from 4 as from 16: the smaller key, 4)
EXPECTED = {1: "fused", 2: "fused", 3: "tuned", 4: "tuned", 10: "tuned", 13: "tuned", 16: "tuned"}


def _dims(T: int) -> Dims:
    return Dims(T=T, H=H, I=I, E=E, top_k=K, adapters=L, rank=R, slices=S)


def _leaf(stage: str | None) -> dict:
    leaf = {
        "fused_gate_up": OpConfig(16, 16, 32, 1, 1, 4, 2).to_dict(),
        "fused_down": OpConfig(16, 32, 32, 1, 1, 4, 2).to_dict(),
    }
    return leaf if stage is None else {**leaf, "stage": stage}


def _write_folder(folder: Path, choices: dict[int, str | None], dims=None) -> Path:
    """The fused file of this machine's GPU name (``cpu`` without CUDA) in ``folder``: one leaf per
    T bucket m of ``choices`` (its ``"stage"`` key, none for None) at ``dims(m)`` (default: the tiny
    preset's)."""
    dims = dims or _dims
    data: dict = {}
    for m, stage in choices.items():
        configs.set_entry(data, configs.base_keys(dims(m)), _leaf(stage))
    return configs.save_config_file(folder / configs.config_file_name(configs.gpu_name(), "fused"), data)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A config folder holding only ``cpu_FUSED_MOE_LORA_FUSED.json``, named by the environment variable
    (the layer reads it); the stage and config memos cleared around the test."""
    _write_folder(tmp_path, {1: "fused", 4: "tuned", 16: None})
    monkeypatch.setenv(configs.ENV_VAR, str(tmp_path))
    configs.clear_cache()
    with warnings.catch_warnings():  # no tuned LoRA / base files: their defaults, one warning each
        warnings.simplefilter("ignore", configs.TunedConfigWarning)
        yield tmp_path
    configs.clear_cache()


def test_load_stage_choice_per_bucket(folder):
    for T, want in EXPECTED.items():
        assert configs.load_stage_choice(_dims(T)) == want, T
        assert configs.load_stage_choice(_dims(T), folder=folder) == want, T
        assert stage_named("auto", _dims(T)) is STAGES[want]
    assert stage_named("fused", _dims(4)) is STAGES["fused"]  # a concrete name is itself at every T
    # the choice does not leak into the fused config (LayerConfig has no stage field)
    assert configs.load_fused_config(_dims(1)).source.endswith("fused=file")


def _layer_inputs(dtype):
    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.1).to(dtype)

    w = dict(w13=rnd(E, 2 * I, H), w2=rnd(E, H, I))
    adapters = {
        0: dict(gate_up=(rnd(E, S, 8, H), rnd(E, S, 2 * I // S, 8)), down=(rnd(E, 8, I), rnd(E, H, 8))),
        2: dict(gate_up=(rnd(E, S, R, H), rnd(E, S, 2 * I // S, R)), down=(rnd(E, R, I), rnd(E, H, R))),
    }
    return w, adapters, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_auto_equals_the_named_stage_bit_for_bit(folder, dtype):
    w, adapters, g = _layer_inputs(dtype)
    layers = {}
    for stage in ("auto", "tuned", "fused"):
        layer = MoELoRALayer(
            w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=16, slices=S, stage=stage
        )
        for slot, ad in adapters.items():
            layer.load_adapter(slot, **ad)
        layers[stage] = layer
    auto = layers["auto"]
    assert auto.stage is AUTO_STAGE and "stage='auto'" in repr(auto)
    for T in (1, 3, 16):
        want = EXPECTED[T]
        assert auto.stage_for(T) is STAGES[want]
        assert auto.config_for(T) == layers[want].config_for(T)
        x = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
        logits = torch.randn(T, E, generator=g)
        ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)  # -1, loaded slots, slot 1 (empty)
        got = auto(x, logits, lora_ids=ids)
        ref = layers[want](x, logits, lora_ids=ids)
        other = layers["tuned" if want == "fused" else "fused"](x, logits, lora_ids=ids)
        assert torch.equal(got, ref), (T, want)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, other, rtol=2e-2, atol=2e-3)  # the other stage: same math
    assert set(auto._stages) == {1, 3, 16}  # resolved once per T, on the host


def test_fused_moe_lora_auto_equals_the_named_stage(folder):
    for T in (1, 3):
        inp = make_inputs(get_shape("tiny"), num_tokens=T, rank=R, num_adapters=L, dtype=torch.float32)
        got = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="auto")
        ref = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=EXPECTED[T])
        assert torch.equal(got, ref), T


def test_fallback_to_tuned_without_a_choice(tmp_path, monkeypatch):
    monkeypatch.delenv(configs.ENV_VAR, raising=False)
    configs.clear_cache()
    # no folder at all on the CPU (nothing is shipped for "cpu"): tuned at every T, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {configs.load_stage_choice(_dims(T)) for T in (1, 8, 64)} == {"tuned"}
    w, _, _ = _layer_inputs(torch.float32)
    layer = MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=4, stage="auto")
    assert layer.stage_for(1) is STAGES["tuned"] and layer.stage_for(4) is STAGES["tuned"]
    # a folder without the fused file, and a fused file whose leaves have no "stage" key
    (tmp_path / "none").mkdir()
    assert configs.load_stage_choice(_dims(1), folder=tmp_path / "none") == "tuned"
    _write_folder(tmp_path, {1: None, 16: None})
    assert configs.load_stage_choice(_dims(1), folder=tmp_path) == "tuned"
    # the default layer is stage auto: tuned here too
    dflt = MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=4)
    assert dflt.stage is AUTO_STAGE and dflt.stage_for(3) is STAGES["tuned"]
    configs.clear_cache()


@pytest.mark.filterwarnings("ignore::moelora_lib.configs.TunedConfigWarning")
@pytest.mark.parametrize("bad", ["FUSED", "auto", "", 1, True, None])
def test_bad_stage_value_names_the_key_path(tmp_path, bad):
    data = configs.set_entry({}, configs.base_keys(_dims(1)), {**_leaf(None), "stage": bad})
    p = tmp_path / configs.config_file_name("cpu", "fused")
    p.write_text(json.dumps(data))
    match = r'at \["4"\]\["64"\]\["64"\]\["1"\]\["stage"\]: \'stage\' must be one of '
    match += r"\['tuned', 'fused', 'gemv'\]"
    with pytest.raises(ValueError, match=match):
        configs.load_config_file(p, "fused")
    configs.clear_cache()
    with pytest.raises(ValueError, match=match):
        configs.load_stage_choice(_dims(1), folder=tmp_path)
    with pytest.raises(ValueError, match=match):
        configs.load_fused_config(_dims(1), folder=tmp_path)
    configs.clear_cache()


#: Stage gemv's leaves: T = 1 of both models, where the gemv layer with 8 adapters beat stages tuned and
#: fused by more than 5 % (data/dev/h100_decode_probe/probe_decode.json, measured on an H100: GPT-OSS-20B
#: 105.0 µs vs 113.6 fused, Qwen3-30B-A3B 57.8 vs 67.7); the configs are that probe's fastest with the
#: gate_up GEMV unsplit (within 2 % of its split one there), which runs the down shrink in its epilogue.
GEMV_LEAVES = {(32, 5760, 2880, 1): "gemv", (128, 1536, 2048, 1): "gemv"}


def test_shipped_h200_choices_are_the_csv_measurement():
    choices = stage_choices_from_csv(ROOT / "data/12_fused.csv")
    oss, qwen = (32, 5760, 2880), (128, 1536, 2048)  # (E, 2I, H) of GPT-OSS-20B and Qwen3-30B-A3B
    # notebook 12, H200, layer totals (µs, p50): GPT-OSS-20B T=1 89.7 vs 93.8, T=8 283.8 vs 299.4,
    # T=8192 3934.8 vs 4067.8; Qwen3-30B-A3B T=1 55.7 vs 57.9 — fused faster; tuned faster elsewhere
    fused = {(*oss, 1), (*oss, 8), (*oss, 8192), (*qwen, 1)}
    tokens = (1, 8, 64, 256, 1600, 8192)
    assert choices == {(*d, T): "fused" if (*d, T) in fused else "tuned" for d in (oss, qwen) for T in tokens}
    choices |= GEMV_LEAVES
    data = configs.load_config_file(SHIPPED_FUSED, "fused")
    in_file = {
        (int(e), int(n), int(k), int(m)): leaf.get("stage")
        for e, a in data.items()
        for n, b in a.items()
        for k, c in b.items()
        for m, leaf in c.items()
    }
    assert in_file == choices
    configs.clear_cache()
    for model, T in (("gpt-oss-20b", 1), ("gpt-oss-20b", 64), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8)):
        got = configs.load_stage_choice(Dims.of(model, T, rank=32, adapters=8), gpu_name="NVIDIA_H200")
        assert got == choices[(*configs.base_keys(Dims.of(model, T)),)], (model, T)


def test_write_stage_choices_keeps_the_rest(tmp_path):
    p = tmp_path / SHIPPED_FUSED.name
    shutil.copy(SHIPPED_FUSED, p)
    write_stage_choices(p, stage_choices_from_csv(ROOT / "data/12_fused.csv") | GEMV_LEAVES)
    assert p.read_bytes() == SHIPPED_FUSED.read_bytes()  # the shipped file is this function's output
    key = (32, 5760, 2880, 64)
    write_stage_choices(p, {key: "fused"})
    new, old = json.loads(p.read_text()), json.loads(SHIPPED_FUSED.read_text())
    assert new["32"]["5760"]["2880"]["64"].pop("stage") == "fused"
    assert old["32"]["5760"]["2880"]["64"].pop("stage") == "tuned"
    assert new == old
    before = p.read_bytes()
    with pytest.raises(ValueError, match=r'no entry at \["32"\]\["5760"\]\["2880"\]\["2"\]'):
        write_stage_choices(p, {(32, 5760, 2880, 2): "fused"})
    with pytest.raises(ValueError, match=r"stage must be one of \['tuned', 'fused', 'gemv'\], got 'auto'"):
        write_stage_choices(p, {key: "auto"})
    assert p.read_bytes() == before


# --- "auto" is the MoE path's default; bad names ---------------------------------------------------
def test_auto_is_the_default_of_the_moe_path():
    from moelora_lib.model import checkpoint
    from moelora_lib.model.modeling import MultiLoRAModel
    from moelora_lib.moe_lora import make_layer_run
    from moelora_lib.studies import e2e

    fns = (MoELoRALayer.__init__, fused_moe_lora, make_layer_run, MultiLoRAModel.__init__)
    fns += (checkpoint.random_model, checkpoint.load_hf_checkpoint, e2e.build_model)
    for fn in fns:
        assert inspect.signature(fn).parameters["stage"].default == "auto", fn.__qualname__
    # the dense op has no per-T choice: its module keeps stage tuned and refuses "auto"
    assert inspect.signature(LoRALinear.__init__).parameters["stage"].default == "tuned"


ALLOWED = (
    r"\['naive', 'no_recompile', 'split_k', 'swizzle', 'even_k_fused_add', 'tuned', 'fused', 'gemv', 'auto'\]"
)
DENSE_ALLOWED = r"\['naive', 'no_recompile', 'split_k', 'swizzle', 'even_k_fused_add', 'tuned', 'fused'\]"


@pytest.mark.parametrize("bad", ["fastest", "Auto", "", None, 1, ["tuned"]])
def test_bad_stage_names(bad):
    from moelora_lib.moe_lora import make_layer_run

    assert list(MOE_STAGE_NAMES) == [*STAGES, "gemv", "auto"]
    w, _, _ = _layer_inputs(torch.float32)
    inp = make_inputs(get_shape("tiny"), num_tokens=2, rank=R, num_adapters=L, dtype=torch.float32)
    msg = rf"stage must be one of {ALLOWED}, got {re.escape(repr(bad))}$"
    calls = [
        lambda: MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=4, stage=bad),
        lambda: fused_moe_lora(*inp.args(), **inp.kwargs(), stage=bad),
        lambda: make_layer_run(*inp.args(), **inp.kwargs(), stage=bad),
        lambda: stage_named(bad, _dims(1)),
        lambda: _tiny_oss_model(stage=bad),
        lambda: serving.build_layer(inp, "tiny", max_tokens=4, stage=bad),
        lambda: serving.eager_rows("tiny", 2, inp, None, device="cpu", stage=bad),
        lambda: serving.host_breakdown_rows("tiny", 2, inp, device="cpu", stage=bad),
        lambda: serving.graph_rows("tiny", 2, inp, None, device="cpu", stage=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=msg):
            call()
    x = torch.zeros(2, 8)
    weight, a, b = torch.zeros(6, 8), torch.zeros(L, 1, 4, 8), torch.zeros(L, 6, 4)
    ids = torch.zeros(2, dtype=torch.int32)
    dense_msg = rf"stage must be one of {DENSE_ALLOWED}, got {re.escape(repr(bad))}$"
    for call in (
        lambda: LoRALinear(weight, num_adapters=L, max_rank=4, max_tokens=4, stage=bad),
        lambda: lora_linear(x, weight, a, b, ids, slices=(6,), stage=bad),
    ):
        with pytest.raises(ValueError, match=dense_msg):
            call()


def test_dense_op_refuses_auto_saying_why():
    weight = torch.zeros(6, 8)
    why = r"stage must be one of \[.*'fused'\], got 'auto': the dense LoRA op has no per-T stage choice"
    with pytest.raises(ValueError, match=why):
        LoRALinear(weight, num_adapters=L, max_rank=4, max_tokens=4, stage="auto")
    with pytest.raises(ValueError, match=why):
        lora_linear(
            torch.zeros(2, 8), weight, torch.zeros(L, 1, 4, 8), torch.zeros(L, 6, 4),
            torch.zeros(2, dtype=torch.int32), slices=(6,), stage="auto",
        )  # fmt: skip


# --- the model: a tiny GPT-OSS (one layer, E = 4, 2I = 32, H = 32), default stage -------------------
OSS_E, OSS_I, OSS_H = 4, 16, 32


def _oss_dims(T: int) -> Dims:
    return Dims(T=T, H=OSS_H, I=OSS_I, E=OSS_E, top_k=2, adapters=2, rank=4, slices=1)


def _tiny_oss_model(device="cpu", **kw):
    """A one-layer GPT-OSS MultiLoRAModel (random weights, seed 0, fp32) with an adapter in slot 1 on
    every projection; ``kw``: the model's ``stage`` (default: the model's own)."""
    from moelora_lib.model.checkpoint import random_model
    from moelora_lib.model.config import REAL_CONFIGS

    cfg = dict(REAL_CONFIGS["gpt-oss-20b"])
    cfg.update(
        hidden_size=OSS_H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=OSS_I, num_local_experts=OSS_E, num_experts_per_tok=2, experts_per_token=2,
        vocab_size=64, sliding_window=4, layer_types=["sliding_attention"], max_position_embeddings=64,
    )  # fmt: skip
    model = random_model(
        cfg, seed=0, dtype=torch.float32, device=device, num_adapters=2, max_rank=4, max_batch=2, max_seq=16,
        max_tokens=16, std=0.3, **kw,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(device)

    for m in model.lora_modules().values():
        if isinstance(m, LoRALinear):
            m.load_adapter(1, [rnd(3, m.in_features) for _ in m.slices], [rnd(n, 3) for n in m.slices], 1.0)
        else:
            E, H, I, S = m.E, m.H, m.I, m.S
            m.load_adapter(
                1, gate_up=(rnd(E, S, 3, H), rnd(E, S, 2 * I // S, 3)), down=(rnd(E, 3, I), rnd(E, H, 3))
            )
    return model


@pytest.fixture
def model_folder(tmp_path, monkeypatch):
    """``write(choices)``: a fused file for the tiny GPT-OSS dims in a fresh folder, named by the
    environment variable; the memos cleared around the test, the missing-file warnings off."""
    n = iter(range(100))

    def write(choices):
        folder = tmp_path / f"f{next(n)}"
        folder.mkdir()
        _write_folder(folder, choices, _oss_dims)
        monkeypatch.setenv(configs.ENV_VAR, str(folder))
        configs.clear_cache()
        return folder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", configs.TunedConfigWarning)
        yield write
    configs.clear_cache()


def _experts(model) -> list[MoELoRALayer]:
    return [m for m in model.lora_modules().values() if isinstance(m, MoELoRALayer)]


def test_model_default_runs_auto_and_equals_tuned_when_the_file_says_tuned(model_folder, device):
    from moelora_lib.model.generate import Generator

    model_folder({1: "tuned", 16: "tuned"})
    auto, tuned = _tiny_oss_model(device), _tiny_oss_model(device, stage="tuned")
    assert auto.stage == "auto" and tuned.stage == "tuned"
    for m in auto.lora_modules().values():  # MoE: auto; dense projections: tuned
        assert m.stage is (AUTO_STAGE if isinstance(m, MoELoRALayer) else STAGES["tuned"])
    prompts, adapters = [[3, 7, 1, 9, 4], [5, 2, 8, 6, 11]], [1, None]
    # two tokens: the prefill (T = 10) and one decode step (T = 2), the two forwards the file maps
    got = Generator(auto).generate(prompts, adapters, 2).tokens
    assert got == Generator(tuned).generate(prompts, adapters, 2).tokens
    for layer in _experts(auto):
        assert layer._stages and all(st is STAGES["tuned"] for st in layer._stages.values())


def test_model_default_equals_fused_when_the_file_says_fused(model_folder, device):
    model_folder({1: "fused", 16: "fused"})
    auto, fused = _tiny_oss_model(device), _tiny_oss_model(device, stage="fused")
    ids = torch.tensor([[3, 7, 1, 9, 4], [5, 2, 8, 6, 11]], device=device)
    lora = torch.tensor([1, -1], device=device)
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    for T, (x, pos) in {10: (ids, zero), 2: (ids[:, :1] + 1, zero + 5)}.items():  # prefill, then decode
        a, f = auto(x, pos, lora), fused(x, pos, lora)
        assert_close_rel(a, f, what=f"logits at T = {T}")
        for layer in _experts(auto):
            assert layer.stage_for(T) is STAGES["fused"]
            assert layer.config_for(T) == _experts(fused)[0].config_for(T)


def test_generation_resolves_the_stage_once_per_bucket(model_folder, device, monkeypatch):
    """Padded decode buckets and padded prefill (the CUDA-graph path's shapes, run eagerly on the CPU):
    each T a forward runs at is resolved once, on the host, to the file's stage for its bucket — decode
    T = 2 lands on m = 1 (fused), the padded prefill T = 16 on m = 16 (tuned)."""
    from moelora_lib.model.generate import Generator

    model_folder({1: "fused", 16: "tuned"})
    model = _tiny_oss_model(device)
    picks = []
    real = configs.load_stage_choice

    def counting(dims, **kw):
        picks.append(dims.T)
        return real(dims, **kw)

    monkeypatch.setattr(configs, "load_stage_choice", counting)
    gen = Generator(model, graph_batch_sizes=(1, 2), pad_to_buckets=True, pad_prefill=True)
    res = gen.generate([[3, 7, 1, 9, 4], [5, 2, 8, 6, 11]], [1, None], 2)  # prefill + one decode step
    assert {b for _, b in res.decode_batch_sizes} == {2}
    (layer,) = _experts(model)
    assert {T: st.name for T, st in layer._stages.items()} == {16: "tuned", 2: "fused"}
    assert sorted(picks) == [2, 16]  # once per T, not per call
    res2 = gen.generate([[3, 7, 1, 9, 4], [5, 2, 8, 6, 11]], [1, None], 2)
    assert res2.tokens == res.tokens and sorted(picks) == [2, 16]


# --- the serving study (notebook 09's helpers) ----------------------------------------------------
#: host_breakdown_rows' one-by-one launches per stage: the LayerRun methods, or stage fused's launch ops
LAUNCHES = {
    "tuned": {"base_gate_up", "lora_gate_up", "act", "base_down", "lora_down", "reduce"},
    "fused": {"gate_up_shrink", "fused_gate_up", "down_shrink", "fused_down", "reduce"},
}


def test_serving_helpers_accept_auto(folder):
    """On the temporary folder of the tiny preset (T = 1 fused, T = 3 tuned), each helper runs the stage the
    file chooses for its T; variant_rows pins an auto layer to its T = 64 stage and restores it."""
    kw = dict(rank=R, num_adapters=L, dtype=torch.float32, device="cpu")
    w = serving.layer_inputs("tiny", 1, **kw)
    layer = serving.build_layer(w, "tiny", max_tokens=8, stage="auto")
    assert layer.stage is AUTO_STAGE
    for T in (1, 3):
        inp = serving.layer_inputs("tiny", T, weights=w, **kw)
        rows = serving.host_breakdown_rows("tiny", T, inp, device="cpu", stage="auto")
        launches = {r["step"].removeprefix("launch.") for r in rows if r["step"].startswith("launch.")}
        assert launches == LAUNCHES[EXPECTED[T]], (T, launches)
        rows = serving.graph_rows("tiny", T, inp, layer, device="cpu", stage="auto")
        assert [r["what"] for r in rows] == ["layer_kernels", "module_topk", "module_logits"]
        assert all(r["max_abs_diff"] == 0.0 for r in rows), rows  # the layer and the public call: same stage
        assert layer.stage_for(T) is STAGES[EXPECTED[T]]
    rows = serving.variant_rows("tiny", layer, w, n_lengths=2, device="cpu")
    assert rows and layer.stage is AUTO_STAGE and layer.fixed_config is None
    assert layer.stage_for(1) is STAGES["fused"]  # per T again after the study
