"""adapter_config.json fields against moelora_lib.model.peft_adapters (CPU, fp32, tiny Qwen3).

Adapters are made by PEFT 0.21 itself. PiSSA and OLoRA adapters, "trained" by perturbing their factors,
are saved twice: plainly (adapter_config.json keeps ``init_lora_weights: "pissa"``; PEFT reloads it by
rewriting the base weights) and with PEFT's conversion to a plain LoRA
(``path_initial_model_for_weight_conversion``). The plain file must be refused naming
``init_lora_weights``; the converted one must load and give the trained PEFT model's logits. Every
``LoraConfig`` field is classified by the loader (a new PEFT field fails
``test_every_loraconfig_field_is_classified``); each refused field is set in a copy of a real file and
must raise a ValueError naming it before any slot changes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib.model import load_hf_checkpoint, load_peft_adapter, peft_adapters
from moelora_lib.model.config import ModelConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, H, NL = 64, 32, 2
SIZES = dict(num_adapters=2, max_rank=8, max_batch=2, max_seq=8, max_tokens=16)
ATOL = 1e-4  # fp32 logits of O(1): kernels (interpreter) vs transformers' eager fp32
INITS = ("pissa", "olora")


def _hf_config():
    return transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=NL,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=40,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=NL,
        rms_norm_eps=1e-6,
        attention_bias=False,
    )


IDS = torch.tensor([[3, 17, 42, 5, 9, 60]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"ckpt": folder, "base_logits": [S, V], init: {"plain", "converted": folder, "logits": [S, V]}}."""
    root = tmp_path_factory.mktemp("peft_fields")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(_hf_config()).save_pretrained(root / "ckpt")
    out = {"ckpt": root / "ckpt"}
    with torch.no_grad():
        out["base_logits"] = transformers.Qwen3ForCausalLM.from_pretrained(root / "ckpt")(IDS).logits[0]
    for init in INITS:
        base = transformers.Qwen3ForCausalLM.from_pretrained(root / "ckpt")
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=init, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = peft.get_peft_model(base, lora)  # rewrites the base weights (W − s·B0·A0)
            pm.save_pretrained(root / f"{init}_init")
            torch.manual_seed(1)
            with torch.no_grad():  # stands in for training
                for name, p in pm.named_parameters():
                    if "lora_" in name:
                        p.add_(0.3 * torch.randn_like(p))
            pm.save_pretrained(root / f"{init}_plain")
            pm.save_pretrained(
                root / f"{init}_converted",
                path_initial_model_for_weight_conversion=str(root / f"{init}_init"),
            )
        with torch.no_grad():
            logits = pm.eval()(input_ids=IDS).logits[0]
        out[init] = {
            "plain": root / f"{init}_plain",
            "converted": root / f"{init}_converted",
            "logits": logits,
        }
    return out


@pytest.fixture
def model(files):
    """The checkpoint with slot 0 holding the converted PiSSA adapter and slot 1 empty."""
    m = load_hf_checkpoint(files["ckpt"], dtype=torch.float32, device="cpu", **SIZES)
    load_peft_adapter(m, 0, files["pissa"]["converted"])
    return m


def _slots(m) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items() if "lora" in k}


def _assert_unchanged(m, before: dict[str, torch.Tensor]) -> None:
    after = _slots(m)
    assert set(after) == set(before)
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} changed by a refused load"


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    edit(cfg)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


# --- PiSSA / OLoRA ---------------------------------------------------------------------------------
@pytest.mark.parametrize("init", INITS)
def test_base_rewriting_init_refused(files, model, init):
    cfg = json.loads((files[init]["plain"] / "adapter_config.json").read_text())
    assert cfg["init_lora_weights"] == init  # PEFT keeps it when saving without conversion
    before = _slots(model)
    for slot in (0, 1):
        with pytest.raises(
            ValueError,
            match=rf"init_lora_weights = '{init}'.*base weights.*path_initial_model_for_weight_conversion",
        ):
            load_peft_adapter(model, slot, files[init]["plain"])
    _assert_unchanged(model, before)


@pytest.mark.parametrize("init", INITS)
def test_converted_matches_peft(files, init):
    cfg = json.loads((files[init]["converted"] / "adapter_config.json").read_text())
    assert cfg["init_lora_weights"] is True and cfg["r"] == 8  # PEFT's conversion: plain LoRA, rank 2r
    m = load_hf_checkpoint(files["ckpt"], dtype=torch.float32, device="cpu", **SIZES)
    load_peft_adapter(m, 1, files[init]["converted"])
    ours = m(torch.cat([IDS, IDS]), [0, 0], [1, -1])
    ref = files[init]["logits"]
    assert (ref - files["base_logits"]).abs().max() > 0.1  # the adapter moves the logits
    err = (ours[0] - ref).abs().max().item()
    assert err < ATOL, f"{init}: max |logits − trained PEFT model| = {err:.3g}"
    err_base = (ours[1] - files["base_logits"]).abs().max().item()
    assert err_base < ATOL, f"slot −1: max |logits − base| = {err_base:.3g}"


# --- init_lora_weights values ----------------------------------------------------------------------
def _assert_same_adapter(src: Path, folder: Path) -> None:
    """Both folders read to identical slot tensors and scalings."""
    mc = ModelConfig.from_hf(_hf_config().to_dict())
    want, got = (peft_adapters.read_peft_adapter(f, mc, expert_slices=1) for f in (src, folder))
    for layer_w, layer_g in zip(want.layers, got.layers):
        assert set(layer_w) == set(layer_g)
        for name, (a, b, s) in layer_w.items():
            ga, gb, gs = layer_g[name]
            assert torch.equal(a, ga) and torch.equal(b, gb) and s == gs


@pytest.mark.parametrize("value", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_plain_inits_load(files, tmp_path, value):
    src = files["pissa"]["converted"]
    _assert_same_adapter(src, _edited(src, tmp_path / "a", lambda c: c.update(init_lora_weights=value)))


@pytest.mark.parametrize(
    "value, match",
    [
        ("pissa_niter_4", "base weights.*path_initial_model_for_weight_conversion"),
        ("corda", "base weights.*path_initial_model_for_weight_conversion"),
        ("lora_ga", "base weights.*path_initial_model_for_weight_conversion"),
        ("OLoRA", "base weights"),
        ("loftq", "LoftQ-quantized base"),
        ("kaiming", "is not supported"),
        (1, "is not supported"),
        (None, "is not supported"),
    ],
)
def test_other_inits_refused(files, model, tmp_path, value, match):
    folder = _edited(files["pissa"]["converted"], tmp_path / "a", lambda c: c.update(init_lora_weights=value))
    before = _slots(model)
    with pytest.raises(ValueError, match=rf"init_lora_weights = {value!r}.*{match}"):
        load_peft_adapter(model, 1, folder)
    _assert_unchanged(model, before)


# --- every other field -----------------------------------------------------------------------------
def test_every_loraconfig_field_is_classified():
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    known = (
        set(peft_adapters._READ_FIELDS)  # noqa: SLF001
        | set(peft_adapters._NO_EFFECT_FIELDS)  # noqa: SLF001
        | set(peft_adapters._REFUSED_TRUTHY)  # noqa: SLF001
    )
    assert fields - known == set(), "LoraConfig fields the loader does not classify"
    assert known - fields == set(), "classified fields LoraConfig does not have"


REFUSED = {
    "use_dora": True,
    "lora_bias": True,
    "bias": "lora_only",
    "fan_in_fan_out": True,
    "modules_to_save": ["lm_head"],
    "trainable_token_indices": [1, 2],
    "alora_invocation_tokens": [5, 6],
    "use_qalora": True,
    "layer_replication": [[0, 2], [1, 2]],
    "megatron_config": {"tensor_model_parallel_size": 2},
    "use_bdlora": {"target_modules_bd_a": ["q_proj"]},
    "arrow_config": {"top_k": 2},
    "kasa_config": {"beta": 1e-4},
    "velora_config": {"num_groups": 2},
    "monteclora_config": {"n_samples": 4},
    "use_foo_variant": True,  # a field this loader does not know
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_field(files, model, tmp_path, field):
    folder = _edited(files["pissa"]["converted"], tmp_path / "a", lambda c: c.update({field: REFUSED[field]}))
    before = _slots(model)
    for slot in (0, 1):
        with pytest.raises(ValueError, match=rf"adapter_config.json: (unknown field )?{field} = "):
            load_peft_adapter(model, slot, folder)
    _assert_unchanged(model, before)


NO_EFFECT = {
    "task_type": "CAUSAL_LM",
    "revision": "main",
    "base_model_name_or_path": "elsewhere",
    "inference_mode": False,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    "exclude_modules": ["o_proj"],
    "layers_to_transform": [0, 1],
    "layers_pattern": "layers",
    "lora_dropout": 0.1,
    "qalora_group_size": 32,
    "ensure_weight_tying": True,
    "loftq_config": {"loftq_bits": 4},
    "eva_config": {"rho": 2.0},
    "corda_config": {"corda_method": "kpm"},
    "lora_ga_config": {"direction": "ArB2r"},
    "use_future_flag": False,  # an unknown field left unset
    "future_config": None,
}


def test_no_effect_fields_load_the_same(files, tmp_path):
    src = files["pissa"]["converted"]
    _assert_same_adapter(src, _edited(src, tmp_path / "a", lambda c: c.update(NO_EFFECT)))
