"""Stage ``auto``: per T, the stage the fused config file's ``"stage"`` key names for that T's bucket.

CPU (Triton interpreter, fp32/fp16, tiny dims): :func:`moelora_lib.configs.load_stage_choice` over a
temporary config folder (``$MOELORA_TUNED_CONFIG_FOLDER``; GPU name ``cpu``) — the nearest-key T
buckets, the fallback to ``tuned`` (no file, no key, no folder), the bad-value error naming the key
path; ``MoELoRALayer(stage="auto")`` and ``fused_moe_lora(stage="auto")`` equal bit for bit to the
explicitly named stage at each T; the shipped H200 file's choices equal
:func:`~moelora_lib.studies.fused_tuning.stage_choices_from_csv` of ``data/12_fused.csv``.
"""

from __future__ import annotations

import inspect
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib import configs, fused_moe_lora
from moelora_lib.kernels import AUTO_STAGE, STAGES, OpConfig, stage_named
from moelora_lib.layer import MoELoRALayer
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.studies.fused_tuning import stage_choices_from_csv, write_stage_choices
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


def _write_folder(folder: Path, choices: dict[int, str | None]) -> Path:
    data: dict = {}
    for m, stage in choices.items():
        configs.set_entry(data, configs.base_keys(_dims(m)), _leaf(stage))
    return configs.save_config_file(folder / configs.config_file_name("cpu", "fused"), data)


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
    # the defaults stay stage tuned
    for fn in (MoELoRALayer.__init__, fused_moe_lora):
        assert inspect.signature(fn).parameters["stage"].default == "tuned"
    with pytest.raises(ValueError, match=r"stage must be one of \[.*'fused', 'auto'\], got 'fastest'"):
        MoELoRALayer(w["w13"], w["w2"], top_k=K, num_adapters=L, max_rank=R, max_tokens=4, stage="fastest")
    configs.clear_cache()


@pytest.mark.filterwarnings("ignore::moelora_lib.configs.TunedConfigWarning")
@pytest.mark.parametrize("bad", ["FUSED", "auto", "", 1, True, None])
def test_bad_stage_value_names_the_key_path(tmp_path, bad):
    data = configs.set_entry({}, configs.base_keys(_dims(1)), {**_leaf(None), "stage": bad})
    p = tmp_path / configs.config_file_name("cpu", "fused")
    p.write_text(json.dumps(data))
    match = r'at \["4"\]\["64"\]\["64"\]\["1"\]\["stage"\]: \'stage\' must be one of \[\'tuned\', \'fused\'\]'
    with pytest.raises(ValueError, match=match):
        configs.load_config_file(p, "fused")
    configs.clear_cache()
    with pytest.raises(ValueError, match=match):
        configs.load_stage_choice(_dims(1), folder=tmp_path)
    with pytest.raises(ValueError, match=match):
        configs.load_fused_config(_dims(1), folder=tmp_path)
    configs.clear_cache()


def test_shipped_h200_choices_are_the_csv_measurement():
    choices = stage_choices_from_csv(ROOT / "data/12_fused.csv")
    oss, qwen = (32, 5760, 2880), (128, 1536, 2048)  # (E, 2I, H) of GPT-OSS-20B and Qwen3-30B-A3B
    # notebook 12, H200, layer totals (µs, p50): GPT-OSS-20B T=1 89.7 vs 93.8, T=8 283.8 vs 299.4,
    # T=8192 3934.8 vs 4067.8; Qwen3-30B-A3B T=1 55.7 vs 57.9 — fused faster; tuned faster elsewhere
    fused = {(*oss, 1), (*oss, 8), (*oss, 8192), (*qwen, 1)}
    tokens = (1, 8, 64, 256, 1600, 8192)
    assert choices == {(*d, T): "fused" if (*d, T) in fused else "tuned" for d in (oss, qwen) for T in tokens}
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
    write_stage_choices(p, stage_choices_from_csv(ROOT / "data/12_fused.csv"))
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
    with pytest.raises(ValueError, match=r"stage must be one of \['tuned', 'fused'\], got 'auto'"):
        write_stage_choices(p, {key: "auto"})
    assert p.read_bytes() == before
