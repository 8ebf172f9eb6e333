"""Qwen3 / Qwen3-MoE block-FP8 checkpoints as published through load_hf_checkpoint, CPU (Triton
interpreter), float32.

The test writes tiny Qwen3-MoE and dense Qwen3 folders in the published layout (Qwen/Qwen3-30B-A3B-FP8,
Qwen/Qwen3-32B-FP8): a random transformers model saved by ``save_pretrained`` (so the keys are the ones
transformers writes: per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` for the MoE), every
attention / MLP / expert projection quantized with the project's quantizer into ``X_proj.weight``
float8_e4m3fn + ``X_proj.weight_scale_inv`` float32, the embeddings, norms, router and lm_head in bf16,
config.json with ``quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [32, 16]}`` — a non-square block that divides every dimension of these
models (transformers' loader infers the block from the grid and refuses ragged grids); the MoE once as
one model.safetensors and once sharded (a weight and its scales in different shards). A third folder
keeps the published [128, 128] (weight_block_size left out: the default), so every block is ragged.

Oracles: transformers' Qwen3MoeForCausalLM / Qwen3ForCausalLM loaded from the same folder with
``FineGrainedFP8Config(dequantize=True)`` (which runs on the CPU): its dequantized parameters equal ours
bit for bit, its fp32 logits equal ours within tests/test_model_base.py's tolerance (1e-4·max|ref| +
1e-5); for the ragged folder, transformers' ``_dequantize_fp8_weight`` per key. PEFT adapters (attention
+ experts for the MoE, attention + MLP for the dense model) made on that dequantized model, as FP8
models' adapters are trained: a mixed batch (adapter, none, other adapter) row by row against
transformers + PEFT within tests/test_model_adapters.py's E2E tolerance, for the model dequantized at
load and for the default load (dense projections and experts kept FP8) with the weight-only FP8 GEMM;
with the W8A8 GEMM (``activation_scheme="dynamic"``, on folders of [32, 32] blocks: an FP8 tensor-core K
step is 32 columns) within the activation quantization's error
(:data:`W8A8_LOGIT_REL`). The loader's FP8 seam: ``dequantize=None`` and ``False`` keep every FP8
projection FP8 (both layers list "fp8"); with a layer's PACKED_FORMATS emptied (monkeypatched),
``dequantize=False`` raises NotImplementedError naming ``dequantize=True``; the handoffs receive
FP8BlockWeights equal to the file's. Bad files are refused with a ValueError naming the key or field.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from quant_helpers import (
    add_key,
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
from safetensors.torch import load_file
from test_model_adapters import E2E_ATOL
from test_model_base import _close, _ref_logits

import moelora_lib
from moelora_lib.model import MultiLoRAModel, load_peft_adapter, modeling
from moelora_lib.model.modeling import packed_expert_weight, packed_linear_weight
from moelora_lib.quant import FP8BlockWeight, MXFP4Weight, dequantize_fp8_block, quantize_fp8_block

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
fp8_integration = pytest.importorskip("transformers.integrations.finegrained_fp8")

V, H, HEADS, KV, HD, NL, E, TOPK, MOE_I, DENSE_I = 96, 64, 4, 2, 16, 2, 4, 2, 32, 96
BLOCK = [32, 16]
BLOCK_W8A8 = [32, 32]  # the PEFT / W8A8 folders: a W8A8 K step (FP8 tl.dot) needs 32 columns per scale
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _hf_config(kind: str):
    common = dict(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=NL,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        hidden_act="silu",
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    )
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=MOE_I,
            num_experts=E,
            num_experts_per_tok=TOPK,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return transformers.Qwen3Config(**common, intermediate_size=DENSE_I, max_window_layers=NL)


def _is_quantized(key: str) -> bool:
    """The projections the published files quantize: attention q/k/v/o, MLP and expert gate/up/down
    (not the router ``mlp.gate``, embeddings, norms, lm_head)."""
    return key.endswith("_proj.weight")


def _published_tensors(kind: str, folder: Path, block=BLOCK, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a published FP8 file: a random transformers model (weights N(0, 0.15²), norms
    1 ± 0.1) saved by transformers (its key names), projections block-FP8, the rest bf16."""
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[kind])(_hf_config(kind))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.15 * torch.randn(p.shape, generator=g)
            )
    model.save_pretrained(str(folder))
    out = {}
    for key, t in load_file(str(folder / "model.safetensors")).items():
        if _is_quantized(key):
            out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(t, block)
        else:
            out[key] = t.to(torch.bfloat16).contiguous()
    return out


def _write_published(folder: Path, kind: str, tensors, sharded: bool = False, **cfg) -> Path:
    """A published folder of ``kind`` (sharded: a weight and its scales in different shards); cfg edits
    config.json."""
    pair = (".weight", ".weight_scale_inv")
    return write_published(folder, tensors, _hf_config(kind), QUANT, pair, sharded, **cfg)


def _hf_dequantized(kind: str, folder: Path):
    """transformers' model from the published folder, FP8 dequantized by transformers, fp32."""
    cls = getattr(transformers, _CLASSES[kind])
    return hf_from_pretrained(cls, folder, transformers.FineGrainedFP8Config(dequantize=True))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """kind -> {"tensors", "single", "sharded" (MoE only), "ragged" (dense only), "ref", "b32" (a folder of
    BLOCK_W8A8 blocks; sharded for the MoE), "b32_ref"}."""
    out = {}
    for kind in _CLASSES:
        root = tmp_path_factory.mktemp(f"{kind}_fp8")
        tensors = _published_tensors(kind, root / "single")
        entry = {"tensors": tensors, "single": _write_published(root / "single", kind, tensors)}
        if kind == "qwen3_moe":
            entry["sharded"] = _write_published(root / "sharded", kind, tensors, sharded=True)
        else:  # the published [128, 128] block, left to the default: every block ragged here
            ragged = _published_tensors(kind, root / "ragged", block=[128, 128])
            cfg = {k: v for k, v in QUANT.items() if k != "weight_block_size"}
            entry["ragged_tensors"] = ragged
            entry["ragged"] = _write_published(root / "ragged", kind, ragged, quantization_config=cfg)
        entry["ref"] = _hf_dequantized(kind, entry["single"])
        b32 = _published_tensors(kind, root / "b32", block=BLOCK_W8A8)
        entry["b32"] = _write_published(
            root / "b32",
            kind,
            b32,
            sharded=kind == "qwen3_moe",
            quantization_config={**QUANT, "weight_block_size": BLOCK_W8A8},
        )
        entry["b32_ref"] = _hf_dequantized(kind, entry["b32"])
        out[kind] = entry
    return out


_IDS = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))


def _ours_vs_hf(model: MultiLoRAModel, ref, kind: str):
    """(name, ours, transformers') for every weight the FP8 path builds, in transformers' terms."""
    for li in range(NL):
        ours, theirs = model.layers[li], ref.model.layers[li]
        a = theirs.self_attn
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        yield f"{li}.qkv", ours.self_attn.qkv_proj.weight, qkv
        yield f"{li}.o", ours.self_attn.o_proj.weight, a.o_proj.weight
        if kind == "qwen3_moe":
            yield f"{li}.w13", ours.mlp.experts.w13, theirs.mlp.experts.gate_up_proj  # [E, 2I, H] gate | up
            yield f"{li}.w2", ours.mlp.experts.w2, theirs.mlp.experts.down_proj
            yield f"{li}.router", ours.mlp.router.weight, theirs.mlp.gate.weight
        else:
            m = theirs.mlp
            yield (
                f"{li}.gate_up",
                ours.mlp.gate_up_proj.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            )
            yield f"{li}.down", ours.mlp.down_proj.weight, m.down_proj.weight
    yield "embed", model.embed_tokens.weight, ref.model.embed_tokens.weight
    yield "lm_head", model.lm_head.weight, ref.lm_head.weight


# --------------------------------------------------------------------------------------------------
# dequantized loading
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["qwen3_moe/single", "qwen3_moe/sharded", "qwen3/single"])
def test_dequantized_weights_equal_transformers_bit_for_bit(published, case):
    """dequantize=True: every projection equals transformers' FineGrainedFP8Config(dequantize=True)
    parameter bit for bit (and our dequantize_fp8_block of the file's tensors); the dense rest is the
    file's bf16; dequantize=None (the default) builds the same model with FP8 experts and FP8 attention /
    dense MLP projections (the layers' FP8 kernels) whose dequantization is the same."""
    kind, layout = case.split("/")
    entry = published[kind]
    model = load_model(entry[layout], dequantize=True)
    for name, ours, theirs in _ours_vs_hf(model, entry["ref"], kind):
        assert ours.dtype == torch.float32 and torch.equal(
            ours.view(torch.int32), theirs.view(torch.int32)
        ), name
    t = entry["tensors"]
    k = "model.layers.1.self_attn.o_proj."
    direct = dequantize_fp8_block(t[k + "weight"], t[k + "weight_scale_inv"], torch.float32, BLOCK)
    assert torch.equal(model.layers[1].self_attn.o_proj.weight, direct)
    default = load_model(entry[layout])  # dequantize=None: experts and dense projections stay FP8
    sd = default.state_dict()
    for n, v in model.state_dict().items():
        if ".mlp.experts.w" in n:
            li, w = int(n.split(".")[1]), n.rsplit(".", 1)[1]
            packed = dict(zip(("w13", "w2"), default.layers[li].mlp.experts.expert_weights()))[w]
        elif n.endswith("_proj.weight"):
            packed = default.get_submodule(n.removesuffix(".weight")).base_weight()
            assert n + "_fp8" in sd and n + "_scale_inv" in sd and n not in sd, n
        else:
            assert torch.equal(v, sd[n]), n
            continue
        assert isinstance(packed, FP8BlockWeight) and torch.equal(packed.dequantize(torch.float32), v), n


def test_ragged_default_block(published):
    """weight_block_size left out: [128, 128], larger than every dimension here (ceil grids of 1 x 1):
    the loaded weights are transformers' _dequantize_fp8_weight of each key (bit for bit, fp32)."""
    entry = published["qwen3"]
    t = entry["ragged_tensors"]
    assert t["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    model = load_model(entry["ragged"], dequantize=True)

    def hf(key):
        w, s = t[key + ".weight"], t[key + ".weight_scale_inv"]
        return fp8_integration._dequantize_fp8_weight(w, s, [128, 128], torch.float32)

    for li in range(NL):
        p = f"model.layers.{li}."
        qkv = torch.cat([hf(f"{p}self_attn.{n}_proj") for n in "qkv"])
        assert torch.equal(model.layers[li].self_attn.qkv_proj.weight, qkv)
        gate_up = torch.cat([hf(f"{p}mlp.gate_proj"), hf(f"{p}mlp.up_proj")])
        assert torch.equal(model.layers[li].mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(model.layers[li].mlp.down_proj.weight, hf(f"{p}mlp.down_proj"))


def test_bf16_and_fp16_scales_accepted(published, tmp_path):
    """Some files publish weight_scale_inv in bf16 / fp16: read as they are (a mix here)."""
    t = dict(published["qwen3"]["tensors"])
    scales = sorted(k for k in t if k.endswith("weight_scale_inv"))
    for i, k in enumerate(scales):
        t[k] = t[k].to((torch.bfloat16, torch.float16)[i % 2])
    model = load_model(_write_published(tmp_path / "half", "qwen3", t), dequantize=True)
    k = "model.layers.1.mlp.down_proj."
    assert t[k + "weight_scale_inv"].dtype != torch.float32
    expect = fp8_integration.Fp8Dequantize(None)._dequantize_one(
        t[k + "weight"], t[k + "weight_scale_inv"], output_dtype=torch.float32
    )
    assert torch.equal(model.layers[1].mlp.down_proj.weight, expect)


@pytest.mark.parametrize("case", ["qwen3_moe/single", "qwen3_moe/sharded", "qwen3/single"])
def test_logits_match_transformers_dequantized(published, case):
    kind, layout = case.split("/")
    ref = published[kind]["ref"]
    model = load_model(published[kind][layout], dequantize=True)
    r = _ref_logits(ref, _IDS)
    out = model(_IDS, [0, 0], [-1, -1])
    _close(out, r, f"fp8 {case} full prompt")
    if layout == "single":  # one decode step after a prefill of 9 tokens reads the cache the prefill wrote
        model(_IDS[:, :9], [0, 0], [-1, -1])
        step = model(_IDS[:, 9:], [9, 9], [-1, -1])
        _close(step[:, 0], r[:, 9], f"fp8 {case} decode step")


def test_fp8_model_logits_match_dequantized_model(published):
    """dequantize=None keeps every projection FP8 — the experts (MoELoRALayer's W_FP8 GEMMs) and the
    attention / dense MLP projections (LoRALinear's block-FP8 GEMM, weight-only at these sizes under
    activation_scheme "auto"): its logits equal the dequantize=True model's up to fp32 summation order
    (the FP8 GEMMs step 16 along K, one scale column of the [32, 16] blocks per step), prefill and one
    decode step. (The dense Qwen3's FP8 gate_up / down projections:
    test_peft_adapters_mixed_batch_match_transformers_peft.)"""
    entry = published["qwen3_moe"]
    f8, dense = load_model(entry["single"]), load_model(entry["single"], dequantize=True)
    lins = [m for m in f8.modules() if isinstance(m, moelora_lib.LoRALinear)]
    assert len(lins) == 2 * NL  # qkv, o
    assert all(m.weight_format == "fp8" and m.weight is None for m in lins)
    assert all(m.activation_scheme_for(20) == "weight_only" for m in lins)
    assert all(layer.mlp.experts.weight_format == "fp8" for layer in f8.layers)
    out, want = f8(_IDS, [0, 0], [-1, -1]), dense(_IDS, [0, 0], [-1, -1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for m in (f8, dense):
        m(_IDS[:, :9], [0, 0], [-1, -1])
    step = f8(_IDS[:, 9:], [9, 9], [-1, -1])
    torch.testing.assert_close(step, dense(_IDS[:, 9:], [9, 9], [-1, -1]), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# PEFT adapters made on the dequantized model: ours dequantized, FP8 weight-only, FP8 W8A8
# --------------------------------------------------------------------------------------------------
ADAPTERS = {
    "qwen3_moe": {
        "attn_experts": dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
        "v_down_rslora": dict(
            r=2, lora_alpha=3, use_rslora=True, target_modules=["v_proj"], target_parameters=["down_proj"]
        ),
    },
    "qwen3": {
        "attn_mlp": dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "q_up_rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["q_proj", "up_proj"]),
    },
}


#: W8A8 (activation_scheme "dynamic") against transformers + PEFT on the dequantized weights: every
#: activation entering an FP8 projection is replaced by its e4m3 code times its (token, 32-column group)
#: scale, within 2^-4 relative per element (3 mantissa bits; 2^-10·scale absolute below e4m3's normal
#: range), and these tiny random models (weights N(0, 0.15²), H = 64, two layers of four projections)
#: carry that to the logits. The kernel itself matches torch's F.linear on the quantize-dequantized
#: activations to fp32 rounding (tests/test_dense_fp8.py); the model-level error is the quantization's.
#: Bound per row: relative L2 error ‖ours − ref‖ / ‖ref‖ ≤ W8A8_LOGIT_REL. Measured over the three rows:
#: 0.072–0.088 qwen3, 0.038–0.044 qwen3_moe (max |Δlogit| 0.44 on logits of max |·| ≈ 4); the bound
#: keeps 1.7x margin over the largest.
W8A8_LOGIT_REL = 0.15


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_peft_adapters_mixed_batch_match_transformers_peft(published, kind, tmp_path):
    """Adapters made by PEFT on transformers' dequantized model of the [32, 32]-block folder (sharded for
    the MoE), as FP8 models' adapters are trained; ours loaded from the FP8 folder as it loads by default
    (every projection kept FP8; activation_scheme "auto", weight-only at these 18 tokens), both adapters
    in slots; a mixed batch (adapter, none, other adapter) against transformers + PEFT row by row within
    tests/test_model_adapters.py's E2E tolerance; then the same model with its dense projections switched
    to W8A8 ("dynamic"): within :data:`W8A8_LOGIT_REL` (activation quantization error) and measurably
    off the weight-only result. (The dequantize=True model: test_logits_match_transformers_dequantized.)"""
    entry = published[kind]
    base = functools.partial(_hf_dequantized, kind, entry["b32"])
    folders = save_peft_adapters(base, ADAPTERS[kind], tmp_path)
    names = list(folders)
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(3))
    lora_ids = [0, -1, 1]  # adapter, none, other adapter
    refs = peft_reference_rows(base, entry["b32_ref"], [folders[n] for n in names], ids, lora_ids)
    model = load_model(entry["b32"])
    lins = [m for m in model.modules() if isinstance(m, moelora_lib.LoRALinear)]
    assert lins and all(
        m.weight_format == "fp8" and m.activation_scheme_for(ids.numel()) == "weight_only" for m in lins
    )
    for slot, name in enumerate(names):
        load_peft_adapter(model, slot, folders[name])
    outs = {"weight_only": model(ids, [0] * 3, lora_ids)}
    for m in lins:
        m.activation_scheme = "dynamic"
    outs["dynamic"] = model(ids, [0] * 3, lora_ids)
    for how, ours in outs.items():
        for row, slot in enumerate(lora_ids):
            err = (ours[row] - refs[row]).abs().max().item()
            rel = ((ours[row] - refs[row]).norm() / refs[row].norm()).item()
            if how == "dynamic":
                assert rel <= W8A8_LOGIT_REL, (
                    f"{kind} W8A8 row {row} (slot {slot}): ‖logits − transformers+PEFT‖ / ‖ref‖ = {rel:.3g} "
                    f"> {W8A8_LOGIT_REL:.3g}"
                )
            else:
                assert err <= E2E_ATOL, (
                    f"{kind} {how} row {row} (slot {slot}): max |logits − transformers+PEFT| = {err:.3g}"
                )
    # W8A8 quantized something: its logits are not the weight-only ones
    assert (outs["dynamic"] - outs["weight_only"]).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------------
# the FP8 seam: which layers keep FP8, the handoffs
# --------------------------------------------------------------------------------------------------
def test_dequantize_false_keeps_fp8(published, monkeypatch):
    """Both layers run FP8, so dequantize=False keeps every projection FP8 (no forward here); with
    LoRALinear's PACKED_FORMATS emptied (a layer class without FP8 kernels) it raises
    NotImplementedError naming that layer and dequantize=True, while dequantize=None then dequantizes
    the dense projections and keeps the experts FP8."""
    assert {"fp8"} <= modeling.packed_expert_formats() and modeling.packed_linear_formats() == {"fp8"}
    for kind in ADAPTERS:
        model = load_model(published[kind]["single"], dequantize=False)
        lins = [m for m in model.modules() if isinstance(m, moelora_lib.LoRALinear)]
        assert lins and all(m.weight_format == "fp8" for m in lins), kind
    monkeypatch.setattr(moelora_lib.LoRALinear, "PACKED_FORMATS", ())
    with pytest.raises(
        NotImplementedError,
        match=r"dequantize=False: .*FP8 kernels in LoRALinear \(attention.*dequantize=True",
    ) as e:
        load_model(published["qwen3_moe"]["single"], dequantize=False)
    assert "MoELoRALayer" not in str(e.value)  # the experts run FP8
    model = load_model(published["qwen3_moe"]["single"])
    assert model.layers[0].self_attn.qkv_proj.weight_format == "dense"
    assert model.layers[0].mlp.experts.weight_format == "fp8"


def test_activation_scheme_reaches_every_fp8_layer(published):
    """load_hf_checkpoint(activation_scheme=...) sets the scheme of every FP8 layer, the experts'
    included (no forward here); "dynamic" over scale blocks of 16 columns (no 32-column FP8 K step) is
    refused naming activation_scheme."""
    model = load_model(published["qwen3_moe"]["b32"], activation_scheme="dynamic")
    lins = [m for m in model.modules() if isinstance(m, moelora_lib.LoRALinear)]
    assert lins and all(m.activation_scheme == "dynamic" for m in lins)
    assert all(layer.mlp.experts.activation_scheme == "dynamic" for layer in model.layers)
    with pytest.raises(
        ValueError, match=r"activation_scheme 'dynamic' \(W8A8\): the scale block's 16 columns"
    ):
        load_model(published["qwen3"]["single"], activation_scheme="dynamic")
    with pytest.raises(ValueError, match=r"activation_scheme must be one of"):
        load_model(published["qwen3"]["single"], activation_scheme="static")


def test_packed_weight_handoffs(monkeypatch):
    """The handoff functions the model calls for packed weights: FP8 experts and FP8 projections are kept
    (both layers list "fp8"); with LoRALinear's PACKED_FORMATS emptied, FP8 projections raise
    NotImplementedError naming dequantize=True; wrong shapes and types are ValueErrors naming the
    weight."""
    w = FP8BlockWeight.quantize(torch.randn(E, 2 * MOE_I, H), BLOCK)
    kept = packed_expert_weight(w, name="layers.0.mlp.experts.w13", shape=(E, 2 * MOE_I, H), device="cpu")
    assert isinstance(kept, FP8BlockWeight) and torch.equal(
        kept.scale_inv, w.scale_inv
    )  # the MoE layer runs FP8
    with pytest.raises(ValueError, match=r"experts\.w2.*expected shape \[4, 64, 32\], got FP8 of shape"):
        packed_expert_weight(w, name="layers.0.mlp.experts.w2", shape=(E, H, MOE_I), device="cpu")
    d = FP8BlockWeight.quantize(torch.randn(128, H), BLOCK)
    kept = packed_linear_weight(d, name="layers.0.self_attn.qkv_proj.weight", shape=(128, H), device="cpu")
    assert isinstance(kept, FP8BlockWeight) and torch.equal(
        kept.weight.view(torch.uint8), d.weight.view(torch.uint8)
    )
    with monkeypatch.context() as mp:
        mp.setattr(moelora_lib.LoRALinear, "PACKED_FORMATS", ())
        with pytest.raises(NotImplementedError, match=r"qkv_proj\.weight.*LoRALinear.*dequantize=True"):
            packed_linear_weight(d, name="layers.0.self_attn.qkv_proj.weight", shape=(128, H), device="cpu")
    with pytest.raises(
        ValueError, match=r"o_proj\.weight.*expected shape \[64, 64\], got FP8 of shape \[128, 64\]"
    ):
        packed_linear_weight(d, name="layers.0.self_attn.o_proj.weight", shape=(H, H), device="cpu")
    m = MXFP4Weight(torch.zeros(H, 2, 16, dtype=torch.uint8), torch.zeros(H, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must be an FP8BlockWeight, got MXFP4Weight"):
        packed_linear_weight(m, name="layers.0.self_attn.o_proj.weight", shape=(H, H), device="cpu")


@pytest.mark.parametrize("dequantize", [None, False])
def test_flipped_formats_hand_fp8_to_the_layers(published, monkeypatch, dequantize):
    """With "fp8" in both layers' PACKED_FORMATS, the loader keeps FP8: the handoffs receive
    FP8BlockWeights of the layers' dense shapes, equal to the file's weights and scales (q | k | v and
    gate | up fused, experts stacked). Here the recording handoffs return them dequantized, so the model
    builds and equals the dequantize=True one."""
    seen = {}

    def record(w, *, name, shape, device):
        assert isinstance(w, FP8BlockWeight) and tuple(w.shape) == tuple(shape), name
        seen[name] = w
        return w.to(device).dequantize(torch.float32)

    monkeypatch.setattr(modeling, "packed_linear_weight", record)
    monkeypatch.setattr(modeling, "packed_expert_weight", record)
    entry = published["qwen3_moe"]
    model = load_model(entry["sharded"], dequantize=dequantize)
    expect = {f"layers.{li}.self_attn.{n}.weight" for li in range(NL) for n in ("qkv_proj", "o_proj")}
    expect |= {f"layers.{li}.mlp.experts.{w}" for li in range(NL) for w in ("w13", "w2")}
    assert set(seen) == expect
    t, p = entry["tensors"], "model.layers.1."
    qkv = seen["layers.1.self_attn.qkv_proj.weight"]
    assert qkv.block == tuple(BLOCK)
    codes = torch.cat([t[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
    scales = torch.cat([t[f"{p}self_attn.{n}_proj.weight_scale_inv"] for n in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(qkv.scale_inv, scales)
    w13 = seen["layers.1.mlp.experts.w13"]
    e = 2
    gate_up = torch.cat([t[f"{p}mlp.experts.{e}.{n}_proj.weight_scale_inv"] for n in ("gate", "up")])
    assert w13.weight.shape == (E, 2 * MOE_I, H) and torch.equal(w13.scale_inv[e], gate_up)
    assert torch.equal(
        w13.weight[e, MOE_I:].view(torch.uint8), t[f"{p}mlp.experts.{e}.up_proj.weight"].view(torch.uint8)
    )
    dense = load_model(entry["sharded"], dequantize=True).state_dict()
    assert all(torch.equal(v, dense[n]) for n, v in model.state_dict().items())


def test_flipped_formats_dequantize_what_cannot_fuse(published, monkeypatch):
    """Block [128, 128] on q (64 rows) | k | v: a fused part ends in a ragged block row, so q | k | v and
    gate | up are dequantized at load while o_proj and down_proj (one part each) stay FP8."""
    seen = []

    def record(w, *, name, shape, device):
        seen.append(name)
        return w.dequantize(torch.float32)

    monkeypatch.setattr(modeling, "packed_linear_weight", record)
    load_model(published["qwen3"]["ragged"])
    assert sorted(seen) == sorted(
        f"layers.{li}.{n}.weight" for li in range(NL) for n in ("self_attn.o_proj", "mlp.down_proj")
    )


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
_A0 = "model.layers.0.self_attn."
_X1 = "model.layers.1.mlp.experts."


BAD_FILES = {
    "missing_scale": (
        None,
        drop_keys(f"{_A0}k_proj.weight_scale_inv"),
        rf"'{_A0}k_proj\.weight': a float8 \(F8_E4M3\) weight needs its block scales "
        rf"'{_A0}k_proj\.weight_scale_inv'",
    ),
    "missing_expert_scale": (
        None,
        drop_keys(f"{_X1}3.down_proj.weight_scale_inv"),
        rf"'{_X1}3\.down_proj\.weight': a float8 .* needs its block scales",
    ),
    "scale_grid": (
        None,
        replace_key(f"{_A0}q_proj.weight_scale_inv", lambda s: s[:1].contiguous()),
        rf"'{_A0}q_proj\.weight_scale_inv': shape \[1, 4\] does not match its weight '{_A0}q_proj\.weight': "
        r"expected \[2, 4\] \(ceil\(N/32\) x ceil\(K/16\)",
    ),
    "block_size_mismatch": (  # grids written for [32, 16], config says [48, 48]: ceil(64/48) = 2
        dict(weight_block_size=[48, 48]),
        None,
        rf"'{_A0}q_proj\.weight_scale_inv': shape \[2, 4\] .*expected \[2, 2\]",
    ),
    "scale_dtype": (
        None,
        replace_key(f"{_X1}0.up_proj.weight_scale_inv", lambda s: s.double()),
        rf"'{_X1}0\.up_proj\.weight_scale_inv': FP8 block scales must be float32, bfloat16 or float16 "
        r".* got F64",
    ),
    "weight_e5m2": (
        None,
        replace_key(f"{_A0}v_proj.weight", lambda w: w.float().to(torch.float8_e5m2)),
        rf"'{_A0}v_proj\.weight': FP8 weights must be float8_e4m3fn \(F8_E4M3, fmt 'e4m3'\), got F8_E5M2",
    ),
    "weight_not_fp8": (
        None,
        replace_key(f"{_A0}o_proj.weight", lambda w: w.to(torch.bfloat16)),
        rf"'{_A0}o_proj\.weight': has block scales .* but is BF16, not float8_e4m3fn",
    ),
    "router_scale": (
        None,
        add_key("model.layers.0.mlp.gate.weight_scale_inv", torch.ones(1, 4)),
        r"unexpected 1 key\(s\), e\.g\. \['model\.layers\.0\.mlp\.gate\.weight_scale_inv'\]",
    ),
    "fmt_e5m2": (dict(fmt="e5m2"), None, r"quantization_config\.fmt: 'e5m2' is not supported; only 'e4m3'"),
    "static_activations": (
        dict(activation_scheme="static"),
        None,
        r"quantization_config\.activation_scheme: 'static' is not supported; only 'dynamic'",
    ),
    "ue8m0_scales": (
        dict(scale_fmt="ue8m0"),
        None,
        r"quantization_config\.scale_fmt: 'ue8m0' is not supported",
    ),
    "block_size_bad": (
        dict(weight_block_size=[128]),
        None,
        r"quantization_config\.weight_block_size: expected two positive ints",
    ),
    "bad_not_convert": (
        dict(modules_to_not_convert="lm_head"),
        None,
        r"quantization_config\.modules_to_not_convert: expected a list of strings",
    ),
    "unknown_method": (
        dict(quant_method="awq"),
        None,
        r"quantization_config\.quant_method: 'awq' is not supported; supported: \['mxfp4', 'fp8'\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_refused_naming_the_key(published, case, tmp_path):
    quant_edits, tensor_edit, match = BAD_FILES[case]
    tensors = dict(published["qwen3_moe"]["tensors"])
    if tensor_edit is not None:
        tensor_edit(tensors)
    folder = _write_published(
        tmp_path / case, "qwen3_moe", tensors, quantization_config={**QUANT, **(quant_edits or {})}
    )
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_fp8_weights_without_quantization_config_refused(published, tmp_path):
    """A folder whose config.json lost its quantization_config: its scales are unexpected keys, and with
    the scales gone too, a float8 weight is refused by name rather than read as unscaled numbers."""
    tensors = dict(published["qwen3"]["tensors"])
    folder = _write_published(tmp_path / "no_cfg", "qwen3", tensors, quantization_config=None)
    with pytest.raises(
        ValueError,
        match=r"unexpected \d+ key\(s\), e\.g\. \['model\.layers\.0\.mlp\.down_proj\.weight_scale_inv'",
    ):
        load_model(folder)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}
    folder = _write_published(tmp_path / "no_scales", "qwen3", tensors, quantization_config=None)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight': a float8 \(F8_E4M3\) weight needs"
    ):
        load_model(folder)


def test_fp8_config_over_dense_checkpoint_refused(published, tmp_path):
    """A folder of transformers' dequantized model (save_pretrained drops quantization_config) given the
    fp8 config back: no key holds scales, so it is refused rather than read as an FP8 file."""
    folder = save_dequantized_declaring(published["qwen3"]["ref"], tmp_path / "dense", QUANT)
    with pytest.raises(ValueError, match=r"declares quantization_config.quant_method 'fp8' but no key"):
        load_model(folder)


def test_fp8_on_gpt_oss_refused(tmp_path):
    cfg = transformers.GptOssConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV
    )
    write_config(tmp_path, cfg, QUANT)
    with pytest.raises(
        ValueError, match=r"'fp8': block-FP8 weights are read for model_type 'qwen3' / 'qwen3_moe' only"
    ):
        load_model(tmp_path)
