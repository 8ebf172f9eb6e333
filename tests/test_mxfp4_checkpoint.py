"""GPT-OSS checkpoints as published (MXFP4 experts) through load_hf_checkpoint, CPU (Triton interpreter).

The test writes a tiny GPT-OSS folder in the published layout: a random transformers GptOssForCausalLM,
its experts quantized with the project's quantizer into ``*_blocks`` / ``*_scales`` (rows = output
features), every other tensor in bf16 (what ``modules_to_not_convert`` lists), config.json with
``quantization_config {"quant_method": "mxfp4", ...}``; once as one model.safetensors and once sharded
with model.safetensors.index.json (a layer's blocks and scales in different shards).

Oracles: transformers' ``convert_moe_packed_tensors`` for the dequantized experts (bit for bit), and
transformers' GptOssForCausalLM loaded from the same folder with ``Mxfp4Config(dequantize=True)`` (which
runs on the CPU) for the logits, within tests/test_model_base.py's tolerance; with PEFT adapters
(attention + experts, trained on that dequantized model as real GPT-OSS adapters are) against
transformers + PEFT, a mixed batch row by row within tests/test_model_adapters.py's E2E tolerance. The
default load keeps the experts packed (the MoE kernels decode them in registers): its logits and adapter
rows equal the ``dequantize=True`` model's within 1e-5 (the same operand values; the packed GEMMs sum the
even and the odd K in two dots, so the rounding differs), its greedy tokens are the same, and its expert
weights take 4.25 bits each. Bad files are refused with a ValueError naming the key or field.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from quant_helpers import (
    SIZES,
    drop_keys,
    hf_from_pretrained,
    load_model,
    peft_reference_rows,
    replace_key,
    save_dequantized_declaring,
    save_peft_adapters,
    write_config,
    write_published,
)
from safetensors.torch import save_file
from test_model_adapters import E2E_ATOL
from test_model_base import _close, _ref_logits

from moelora_lib.model import Generator, MultiLoRAModel, load_peft_adapter
from moelora_lib.model.modeling import packed_expert_formats, packed_expert_weight
from moelora_lib.quant import MXFP4Weight, quantize_mxfp4
from moelora_lib.testing import assert_close_rel

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
convert_moe_packed_tensors = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

V, H, I, E, TOPK, HEADS, KV, HD, WINDOW, NL = 96, 64, 32, 4, 2, 4, 2, 16, 4, 2
QUANT = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _hf_config():
    return transformers.GptOssConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=NL,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        hidden_act="silu",
        tie_word_embeddings=False,
        intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=TOPK,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        attention_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),
    )


def _published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a published GPT-OSS file: a random transformers model (weights N(0, 0.15²), norms
    1 ± 0.1), experts packed MXFP4 [E, N, K/32, 16] + [E, N, K/32], the rest bf16."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(_hf_config())
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        p = (
            1 + 0.1 * torch.randn(p.shape, generator=g)
            if "norm" in name
            else 0.15 * torch.randn(p.shape, generator=g)
        )
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers' x @ W: [E, K, N]
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantize_mxfp4(p.transpose(1, 2))
        else:
            out[name] = p.to(torch.bfloat16).contiguous()
    return out


def _write_published(folder: Path, tensors: dict[str, torch.Tensor], sharded: bool = False) -> Path:
    """A published folder (sharded: a projection's blocks and scales in different shards)."""
    return write_published(folder, tensors, _hf_config(), QUANT, ("_blocks", "_scales"), sharded)


def _hf_dequantized(folder: Path):
    """transformers' model from the published folder, experts dequantized by transformers, fp32."""
    return hf_from_pretrained(
        transformers.GptOssForCausalLM, folder, transformers.Mxfp4Config(dequantize=True)
    )


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = _published_tensors()
    single = _write_published(root / "single", tensors)
    sharded = _write_published(root / "sharded", tensors, sharded=True)
    return {"tensors": tensors, "single": single, "sharded": sharded, "ref": _hf_dequantized(single)}


_IDS = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))  # 10 > WINDOW


# --------------------------------------------------------------------------------------------------
# dequantized loading
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_dequantized_experts_bit_for_bit(published, layout):
    """w13 / w2 are convert_moe_packed_tensors' output transposed to rows = output features, bit for bit,
    and equal to the parameters transformers' Mxfp4Config(dequantize=True) builds; biases are the file's."""
    model = load_model(published[layout], dequantize=True)
    ref = published["ref"]
    t = published["tensors"]
    for li in range(NL):
        exp, x = model.layers[li].mlp.experts, f"model.layers.{li}.mlp.experts."
        for ours, hf in ((exp.w13, "gate_up_proj"), (exp.w2, "down_proj")):
            oracle = convert_moe_packed_tensors(
                t[f"{x}{hf}_blocks"], t[f"{x}{hf}_scales"], dtype=torch.float32
            )
            assert ours.dtype == torch.float32
            assert torch.equal(ours.view(torch.int32), oracle.transpose(1, 2).contiguous().view(torch.int32))
            assert torch.equal(ours, getattr(ref.model.layers[li].mlp.experts, hf).transpose(1, 2))
        assert torch.equal(exp.b13, t[f"{x}gate_up_proj_bias"].float())
        assert torch.equal(exp.b2, t[f"{x}down_proj_bias"].float())


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_logits_match_transformers_dequantized(published, layout):
    ref = published["ref"]
    model = load_model(published[layout], dequantize=True)
    r = _ref_logits(ref, _IDS)
    out = model(_IDS, [0, 0], [-1, -1])
    _close(out, r, f"mxfp4 {layout} full prompt")
    # one decode step after a prefill of 9 tokens reads the cache the prefill wrote
    model(_IDS[:, :9], [0, 0], [-1, -1])
    step = model(_IDS[:, 9:], [9, 9], [-1, -1])
    _close(step[:, 0], r[:, 9], f"mxfp4 {layout} decode step")


def test_float16_model_dequantizes_to_its_dtype(published):
    """dtype float16: the experts are dequantized straight to float16 (values of this file are exact
    there), equal to convert_moe_packed_tensors(dtype=float16); logits within the float16 table entry."""
    model = load_model(published["single"], dtype=torch.float16, dequantize=True)
    t = published["tensors"]
    x = "model.layers.1.mlp.experts."
    oracle = convert_moe_packed_tensors(
        t[f"{x}down_proj_blocks"], t[f"{x}down_proj_scales"], dtype=torch.float16
    )
    w2 = model.layers[1].mlp.experts.w2
    assert w2.dtype == torch.float16 and torch.equal(
        w2.view(torch.int16), oracle.transpose(1, 2).contiguous().view(torch.int16)
    )
    out = model(_IDS, [0, 0], [-1, -1])
    assert_close_rel(out, _ref_logits(published["ref"], _IDS), torch.float16, what="mxfp4 float16 logits")


def test_packed_expert_weight_checks_the_shape():
    w = MXFP4Weight(*quantize_mxfp4(torch.randn(E, H, I)))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w13.*expected shape \[4, 64, 64\]"):
        packed_expert_weight(w, name="layers.1.mlp.experts.w13", shape=(E, 2 * I, H), device="cpu")


# --------------------------------------------------------------------------------------------------
# PEFT adapters on the dequantized model
# --------------------------------------------------------------------------------------------------
ADAPTERS = {
    "attn_experts": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ),
    "v_down_rslora": dict(
        r=2,
        lora_alpha=3,
        use_rslora=True,
        target_modules=["v_proj", "o_proj"],
        target_parameters=["down_proj"],
    ),
}


@pytest.fixture(scope="module")
def adapters(published, tmp_path_factory):
    """PEFT adapters made on transformers' dequantized model (as GPT-OSS adapters are trained)."""
    base = functools.partial(_hf_dequantized, published["single"])
    return save_peft_adapters(base, ADAPTERS, tmp_path_factory.mktemp("mxfp4_peft"))


def test_peft_adapters_mixed_batch_match_transformers_peft(published, adapters):
    B = 3
    model = load_model(published["sharded"], dequantize=True)
    names = list(ADAPTERS)
    for slot, name in enumerate(names):
        load_peft_adapter(model, slot, adapters[name])
    ids = torch.randint(0, V, (B, 6), generator=torch.Generator().manual_seed(3))
    lora_ids = [0, -1, 1]  # adapter, none, other adapter
    ours = model(ids, [0] * B, lora_ids)
    base = functools.partial(_hf_dequantized, published["single"])
    refs = peft_reference_rows(base, published["ref"], [adapters[n] for n in names], ids, lora_ids)
    for row, slot in enumerate(lora_ids):
        err = (ours[row] - refs[row]).abs().max().item()
        assert err <= E2E_ATOL, f"row {row} (slot {slot}): max |logits − transformers+PEFT| = {err:.3g}"


# --------------------------------------------------------------------------------------------------
# packed loading (the default): the MoE kernels decode the experts in registers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dequantize", [None, False])
def test_default_keeps_experts_packed(published, dequantize):
    """dequantize=None (MoELoRALayer lists "mxfp4" in PACKED_FORMATS) and False: the experts are the
    file's blocks and scales as they are, w13 / w2 None; the biases are the file's."""
    assert "mxfp4" in packed_expert_formats()
    model = load_model(published["single"], dequantize=dequantize)
    t = published["tensors"]
    for li in range(NL):
        exp, x = model.layers[li].mlp.experts, f"model.layers.{li}.mlp.experts."
        assert exp.weight_format == "mxfp4" and exp.w13 is None and exp.w2 is None
        assert exp._ref.dtype == torch.float32 and "weights=mxfp4" in repr(exp)
        for ours, hf in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            for part in ("blocks", "scales"):
                assert torch.equal(getattr(exp, f"{ours}_{part}"), t[f"{x}{hf}_{part}"])
        assert torch.equal(exp.b13, t[f"{x}gate_up_proj_bias"].float())


def test_packed_model_logits_close_to_dequantized(published):
    """The packed model's logits are the dequantize=True model's within 1e-5 (the kernels dot the same
    operand values, the packed ones summing the even and the odd K apart), full prompt and a decode step
    after a prefill; and transformers' within the table."""
    packed, dense = load_model(published["single"]), load_model(published["single"], dequantize=True)
    out = packed(_IDS, [0, 0], [-1, -1])
    assert_close_rel(out, dense(_IDS, [0, 0], [-1, -1]), tol=1e-5, what="packed vs dequantized full prompt")
    _close(out, _ref_logits(published["ref"], _IDS), "mxfp4 packed full prompt")
    steps = []
    for m in (packed, dense):
        m(_IDS[:, :9], [0, 0], [-1, -1])
        steps.append(m(_IDS[:, 9:], [9, 9], [-1, -1]))
    assert_close_rel(*steps, tol=1e-5, what="packed vs dequantized decode step")


def test_packed_model_with_peft_adapters_close_to_dequantized(published, adapters):
    """PEFT adapters loaded into the packed model (the layer's dtype, not its weights', sets theirs): a
    mixed batch (adapter, none, other adapter) within 1e-5 of the dequantized model's, and the same greedy
    generation."""
    models = [load_model(published["sharded"]), load_model(published["sharded"], dequantize=True)]
    for m in models:
        for slot, name in enumerate(ADAPTERS):
            load_peft_adapter(m, slot, adapters[name])
    packed, dense = models
    exp = packed.layers[0].mlp.experts
    assert exp.lora_a2.dtype == torch.float32 and exp.loaded_slots == {0: (True, True), 1: (False, True)}
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(3))
    lora_ids = [0, -1, 1]
    assert_close_rel(packed(ids, [0] * 3, lora_ids), dense(ids, [0] * 3, lora_ids), tol=1e-5)
    prompts = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4)).tolist()
    # two tokens: the prefill's and a decode step's (each interpreted step costs seconds per model)
    got = Generator(packed).generate(prompts, [0, None], 2).tokens
    assert got == Generator(dense).generate(prompts, [0, None], 2).tokens and all(len(t) == 2 for t in got)


def test_packed_memory_report_counts_packed_bytes(published):
    """Each MoE layer's memory_report counts the packed experts (blocks + scales: 4.25 bits per expert
    weight) and the fp32 biases, against 32 bits per weight dequantized."""
    packed, dense = load_model(published["single"]), load_model(published["single"], dequantize=True)
    n_w, bias = E * 3 * I * H, E * (2 * I + H) * 4
    for li in range(NL):
        rep = packed.layers[li].mlp.experts.memory_report()
        assert rep["weights"] == n_w * 17 // 32 + bias  # K/2 bytes of codes + K/32 scale bytes per row
        assert (rep["weights"] - bias) * 8 / n_w == 4.25
        assert dense.layers[li].mlp.experts.memory_report()["weights"] == n_w * 4 + bias
        assert rep["adapter_slots"] == dense.layers[li].mlp.experts.memory_report()["adapter_slots"]
    params = {n: p for n, p in packed.named_parameters() if ".experts." in n}
    assert sum(p.numel() for n, p in params.items() if p.dtype == torch.uint8) == NL * n_w * 17 // 32


def test_packed_state_dict_round_trips(published):
    """A packed model's state_dict (``*.w13_blocks`` / ``*_scales`` in place of ``w13``) builds the same
    packed model; blocks without their scales are refused naming both keys."""
    model = load_model(published["single"])
    sd = model.state_dict()
    same = MultiLoRAModel(model.config, dtype=torch.float32, device="cpu", weights=sd, **SIZES)
    assert same.layers[1].mlp.experts.weight_format == "mxfp4"
    for k, v in same.state_dict().items():
        assert torch.equal(v, sd[k]), k
    bad = {k: v for k, v in sd.items() if k != "layers.1.mlp.experts.w2_scales"}
    with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.experts\.w2_blocks' without .*w2_scales"):
        MultiLoRAModel(model.config, dtype=torch.float32, device="cpu", weights=bad, **SIZES)


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
_X0 = "model.layers.0.mlp.experts."
_X1 = "model.layers.1.mlp.experts."


BAD_FILES = {
    "missing_scales": (None, drop_keys(f"{_X1}down_proj_scales"), rf"'{_X1}down_proj_scales' is missing"),
    "scales_shape": (
        None,
        replace_key(f"{_X0}gate_up_proj_scales", lambda s: s[:, :, :1].contiguous()),
        rf"'{_X0}gate_up_proj_scales': shape \[4, 64, 1\] does not match its blocks .*expected \[4, 64, 2\]",
    ),
    "blocks_shape": (
        None,
        replace_key(f"{_X1}gate_up_proj_blocks", lambda b: b.reshape(E, 2 * I, 4, 8).contiguous()),
        rf"'{_X1}gate_up_proj_blocks': expected shape \[4, 64, 2, 16\], got \[4, 64, 4, 8\]",
    ),
    "blocks_dtype": (
        None,
        replace_key(f"{_X0}down_proj_blocks", lambda b: b.to(torch.int16)),
        rf"'{_X0}down_proj_blocks': MXFP4 blocks must be uint8, got I16",
    ),
    "k_not_multiple_of_32": (
        dict(intermediate_size=48),
        None,
        rf"{_X0}down_proj_blocks: .*K = intermediate_size = 48.*not a multiple of 32",
    ),
    "unknown_method": (
        dict(quantization_config={"quant_method": "awq"}),
        None,
        r"quantization_config.quant_method: 'awq' is not supported; supported: \['mxfp4', 'fp8'\]",
    ),
    "fp8": (  # block FP8 is read for the Qwen3 models (tests/test_fp8_checkpoint.py), not GPT-OSS
        dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        None,
        r"quant_method 'fp8': block-FP8 weights are read for model_type 'qwen3' / 'qwen3_moe' only",
    ),
    "not_a_dict": (dict(quantization_config="mxfp4"), None, r"quantization_config: expected a JSON object"),
    "no_quantization_config": (
        dict(quantization_config=None),
        None,
        r"look like MXFP4 expert blocks, but config.json declares no quantization_config",
    ),
    "bad_not_convert": (
        dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}),
        None,
        r"quantization_config.modules_to_not_convert: expected a list of strings",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_refused_naming_the_key(published, case, tmp_path):
    cfg_edits, tensor_edit, match = BAD_FILES[case]
    folder = tmp_path / case
    folder.mkdir()
    tensors = dict(published["tensors"])
    if tensor_edit is not None:
        tensor_edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    write_config(folder, _hf_config(), QUANT, **(cfg_edits or {}))
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_dense_experts_under_mxfp4_config_refused(published, tmp_path):
    """A folder saved after transformers' dequantization (dense experts) that still declares mxfp4."""
    folder = save_dequantized_declaring(published["ref"], tmp_path / "dense", QUANT)
    with pytest.raises(
        ValueError, match=r"declares quantization_config.quant_method 'mxfp4' but .*experts\.down_proj"
    ):
        load_model(folder)


def test_mxfp4_on_other_model_types_and_bad_flag_refused(published, tmp_path):
    cfg = transformers.Qwen3Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV
    )
    write_config(tmp_path, cfg, QUANT)
    with pytest.raises(ValueError, match=r"model_type 'gpt_oss' only, got model_type 'qwen3'"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=r"dequantize must be a Python bool"):
        load_model(published["single"], dequantize="yes")


def test_sharded_index_naming_a_missing_shard(published, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(published["sharded"], folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"names shard model-00002-of-00002.safetensors"):
        load_model(folder)
