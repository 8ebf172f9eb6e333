"""moelora_lib.model without adapters: config reading, checkpoint loading, parity with transformers, KV cache.

Tiny random models are built with transformers' own classes (GptOssForCausalLM, Qwen3MoeForCausalLM,
Qwen3ForCausalLM; every config field passed explicitly, weights re-drawn at std 0.15 so routing and
attention are far from uniform, GPT-OSS biases and sinks nonzero), written with ``save_pretrained`` and
loaded with :func:`load_hf_checkpoint`. CPU, float32, kernels through the Triton interpreter
(conftest.py sets TRITON_INTERPRET).

Tolerance (fp32 against transformers' fp32 forward): |ours - ref| <= 1e-4·max|ref| + 1e-5 on the logits
(observed ~1e-7 relative).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora_lib.model import REAL_CONFIGS, ModelConfig, MultiLoRAModel, load_hf_checkpoint, random_model
from moelora_lib.model.modeling import rope_inv_freq

V, H, HEADS, KV, HD, E, TOPK, WINDOW = 96, 32, 4, 2, 16, 4, 2, 4
SIZES = dict(num_adapters=2, max_rank=4, max_batch=3, max_seq=16, max_tokens=24)


def _hf_model(kind: str):
    """A tiny transformers model of ``kind`` with random weights (std 0.15, norms 1 ± 0.1)."""
    import transformers as tf

    common = dict(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        hidden_act="silu",
        tie_word_embeddings=kind == "qwen3_tied",
    )
    if kind == "gpt_oss":
        cfg = tf.GptOssConfig(
            **common,
            intermediate_size=24,
            num_local_experts=E,
            num_experts_per_tok=TOPK,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            attention_bias=True,
            swiglu_limit=7.0,
            swiglu_alpha=1.702,
            rope_parameters=dict(  # the real gpt-oss YaRN parameters
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=4096,
                truncate=False,
            ),
        )
        model = tf.GptOssForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=TOPK,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = tf.Qwen3Config(
            **common,
            intermediate_size=48,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            attention_bias=False,
            use_sliding_window=False,
            max_window_layers=2,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        )
        model = tf.Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # weights, router/expert/attention biases, sinks
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """kind -> (transformers model, checkpoint folder); built once per module."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            ref = _hf_model(kind)
            path = tmp_path_factory.mktemp(kind)
            ref.save_pretrained(path)
            cache[kind] = (ref, path)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def loaded(ckpt):
    cache = {}

    def get(kind: str) -> MultiLoRAModel:
        if kind not in cache:
            cache[kind] = load_hf_checkpoint(ckpt(kind)[1], dtype=torch.float32, device="cpu", **SIZES)
        return cache[kind]

    return get


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (out - ref).abs().max().item()
    bound = 1e-4 * ref.abs().max().item() + 1e-5
    assert err <= bound, f"{what}: max |ours - transformers| = {err:.3g} > {bound:.3g}"


def _ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits.float()


KINDS = ["gpt_oss", "qwen3_moe", "qwen3", "qwen3_tied"]


# --------------------------------------------------------------------------------------------------
# (a) full-prompt parity
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_full_prompt_logits_match_transformers(kind, ckpt, loaded):
    ref, _ = ckpt(kind)
    model = loaded(kind)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))  # 10 > WINDOW
    out = model(ids, torch.tensor([0, 0]), torch.tensor([-1, -1], dtype=torch.int32))
    assert out.dtype == torch.float32 and out.shape == (2, 10, V)
    _close(out, _ref_logits(ref, ids), kind)
    last = model(ids, [0, 0], [-1, -1], last_only=True)
    assert last.shape == (2, V)
    torch.testing.assert_close(last, out[:, -1], rtol=1e-5, atol=1e-6)  # another GEMM shape


def test_float16_model_within_table_tolerance(ckpt):
    """The same checkpoint in float16 (GPT-OSS: norms kept in fp32 like transformers) against the fp32
    transformers forward, within the float16 entry of moelora_lib.testing.TOLERANCES (observed ~1.2e-3)."""
    from moelora_lib.testing import assert_close_rel

    ref, path = ckpt("gpt_oss")
    model = load_hf_checkpoint(path, dtype=torch.float16, device="cpu", **SIZES)
    assert model.norm.weight.dtype == torch.float32 and model.layers[0].mlp.experts.w13.dtype == torch.float16
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    out = model(ids, [0, 0], [-1, -1])
    assert out.dtype == torch.float32
    assert_close_rel(out, _ref_logits(ref, ids), torch.float16, what="gpt_oss float16 logits")


def test_module_tree(loaded):
    from moelora_lib import LoRALinear, MoELoRALayer

    m = loaded("gpt_oss")
    attn = m.layers[0].self_attn
    assert isinstance(attn.qkv_proj, LoRALinear) and attn.qkv_proj.slices == (HEADS * HD, KV * HD, KV * HD)
    assert attn.qkv_proj.bias is not None and attn.sinks.shape == (HEADS,)
    assert attn.k_cache.shape == (SIZES["max_batch"], KV, SIZES["max_seq"], HD)
    exp = m.layers[0].mlp.experts
    assert isinstance(exp, MoELoRALayer) and exp.S == 1 and exp.activation == "swigluoai"
    assert m.layers[0].mlp.router.bias.shape == (E,)
    assert loaded("qwen3_moe").layers[1].mlp.experts.S == 2
    dense = loaded("qwen3").layers[0].mlp
    assert dense.gate_up_proj.slices == (48, 48)
    mods = m.lora_modules()
    assert len(mods) == 2 * 3 and all(isinstance(v, (LoRALinear, MoELoRALayer)) for v in mods.values())
    m.unload_adapter(1)  # nothing loaded: a no-op that must not fail
    with pytest.raises(ValueError, match="slot"):
        m.unload_adapter(SIZES["num_adapters"])


# --------------------------------------------------------------------------------------------------
# (b) KV cache: prefill + token-by-token decode == full forward, rows at different start_pos
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt_oss", "qwen3_moe", "qwen3"])
def test_prefill_then_decode_matches_full_forward(kind, ckpt, loaded):
    ref, _ = ckpt(kind)
    model = loaded(kind)
    g = torch.Generator().manual_seed(2)
    seq0, seq1 = torch.randint(0, V, (10,), generator=g), torch.randint(0, V, (7,), generator=g)
    ref0, ref1 = _ref_logits(ref, seq0[None])[0], _ref_logits(ref, seq1[None])[0]
    none = [-1]
    # prefill each request into its own cache row (row 2 for seq0, row 0 for seq1)
    _close(model(seq0[None, :6], [0], none, cache_rows=[2])[0], ref0[:6], f"{kind} prefill row 2")
    _close(model(seq1[None, :3], [0], none, cache_rows=[0]), ref1[None, :3], f"{kind} prefill row 0")
    for i in range(4):  # decode both rows together; seq0 passes the sliding window
        if i == 2:  # batch order swapped, rows as a tensor
            ids, start, rows, order = (
                [[seq1[3 + i]], [seq0[6 + i]]],
                [3 + i, 6 + i],
                torch.tensor([0, 2]),
                (1, 0),
            )
        else:
            ids, start, rows, order = [[seq0[6 + i]], [seq1[3 + i]]], [6 + i, 3 + i], [2, 0], (0, 1)
        out = model(torch.tensor(ids), start, [-1, -1], cache_rows=rows)
        assert out.shape == (2, 1, V)
        _close(out[order[0], 0], ref0[6 + i], f"{kind} decode step {i} (seq0)")
        _close(out[order[1], 0], ref1[3 + i], f"{kind} decode step {i} (seq1)")
    # chunked prefill: seq0 in two chunks into row 0 (cache_rows None: rows 0..B-1, read as a view)
    _close(model(seq0[None, :6], [0], none)[0], ref0[:6], f"{kind} chunk 1 into row 0")
    _close(model(seq0[None, 6:10], [6], none)[0], ref0[6:10], f"{kind} chunk 2 at position 6")


# --------------------------------------------------------------------------------------------------
# (c) the sliding window matters
# --------------------------------------------------------------------------------------------------
def test_sliding_window_is_applied(ckpt, loaded):
    ref, _ = ckpt("gpt_oss")
    model = loaded("gpt_oss")
    weights = dict(model.state_dict())
    full_cfg = dataclasses.replace(model.config, layer_types=("full_attention",) * 2, sliding_window=None)
    no_window = MultiLoRAModel(full_cfg, dtype=torch.float32, device="cpu", weights=weights, **SIZES)
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    r = _ref_logits(ref, ids)
    out, bad = model(ids, [0], [-1]), no_window(ids, [0], [-1])
    _close(out, r, "with window")
    # identical while the sequence fits in the window, different once it is longer
    _close(bad[:, :WINDOW], r[:, :WINDOW], "no window, first WINDOW positions")
    assert (bad[:, WINDOW:] - r[:, WINDOW:]).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------
# checkpoint formats
# --------------------------------------------------------------------------------------------------
def test_qwen3_moe_fused_expert_keys_and_sharded_files(ckpt, loaded, tmp_path):
    ref, path = ckpt("qwen3_moe")
    sd = load_file(path / "model.safetensors")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in sd  # what transformers 5.24 writes
    fused = {}
    for k, t in sd.items():
        if ".experts." not in k:
            fused[k] = t
    for li in range(2):
        x = f"model.layers.{li}.mlp.experts."
        fused[f"{x}gate_up_proj"] = torch.stack(
            [torch.cat((sd[f"{x}{e}.gate_proj.weight"], sd[f"{x}{e}.up_proj.weight"])) for e in range(E)]
        )
        fused[f"{x}down_proj"] = torch.stack([sd[f"{x}{e}.down_proj.weight"] for e in range(E)])
    # split over two shards with an index file
    keys = sorted(fused)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: fused[k].contiguous() for k in ks}, tmp_path / name)
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    shutil.copy(path / "config.json", tmp_path / "config.json")
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32, device="cpu", **SIZES)
    base = loaded("qwen3_moe")
    for name, t in base.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0, msg=name)


def test_gpt_oss_expert_layout(ckpt, loaded):
    """w13 = gate_up_proj transposed with the gate/up interleaving kept, w2 = down_proj transposed."""
    ref, _ = ckpt("gpt_oss")
    ex, m = ref.model.layers[1].mlp.experts, loaded("gpt_oss").layers[1].mlp.experts
    torch.testing.assert_close(m.w13, ex.gate_up_proj.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(m.w2, ex.down_proj.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(m.b13, ex.gate_up_proj_bias, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------
def test_real_configs():
    gpt = ModelConfig.from_hf(REAL_CONFIGS["gpt-oss-20b"])
    assert (gpt.hidden_size, gpt.head_dim, gpt.q_width, gpt.num_experts, gpt.num_experts_per_tok) == (
        2880,
        64,
        4096,
        32,
        4,
    )
    assert gpt.moe_intermediate_size == 2880 and gpt.sliding_window == 128 and gpt.sinks and gpt.router_bias
    assert gpt.layer_types[:2] == ("sliding_attention", "full_attention") and len(gpt.layer_types) == 24
    assert (
        gpt.rope_theta == 150000 and gpt.rope_scaling["factor"] == 32.0 and not gpt.rope_scaling["truncate"]
    )
    q = ModelConfig.from_hf(REAL_CONFIGS["qwen3-30b-a3b"])
    assert (q.head_dim, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 128, 8, 768)
    assert q.qk_norm and q.norm_topk_prob and q.sliding_window is None and q.rope_scaling is None
    assert set(q.layer_types) == {"full_attention"} and len(q.layer_types) == 48
    d = ModelConfig.from_hf(REAL_CONFIGS["qwen3-32b"])
    assert (d.hidden_size, d.intermediate_size, d.num_key_value_heads, d.num_hidden_layers) == (
        5120,
        25600,
        8,
        64,
    )
    assert not d.is_moe and d.num_experts is None
    # transformers 5 form (rope_parameters, num_local_experts) reads the same
    t5 = dict(REAL_CONFIGS["gpt-oss-20b"])
    t5["rope_parameters"] = dict(t5.pop("rope_scaling"), rope_theta=t5.pop("rope_theta"))
    del t5["experts_per_token"]
    assert ModelConfig.from_hf(t5) == gpt


_QWEN_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)  # Qwen's docs


@pytest.mark.parametrize(
    "name, scaling",
    [("gpt-oss-20b", None), ("qwen3-32b", _QWEN_YARN), ("qwen3-30b-a3b", None)],
)
def test_rope_matches_transformers(name, scaling):
    """inv_freq and the attention factor, bit for bit: gpt-oss-20b's YaRN (truncate false), the YaRN
    extension the Qwen docs give (truncate default true), and plain RoPE."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = REAL_CONFIGS[name]
    d.pop("quantization_config", None)
    if scaling is not None:
        d["rope_scaling"] = dict(scaling)
    cls = {"gpt_oss": tf.GptOssConfig, "qwen3_moe": tf.Qwen3MoeConfig, "qwen3": tf.Qwen3Config}[
        d["model_type"]
    ]
    hf = cls(**json.loads(json.dumps(d)))
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":  # the model class's own
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        want, want_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf)
    got, scale = rope_inv_freq(ModelConfig.from_hf(d))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert scale == want_scale


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b", "qwen3-32b"])
def test_missing_head_fields_read_as_transformers(name):
    """A config.json without num_key_value_heads and head_dim: the widths transformers' own attention
    module builds from it (its config class's defaults: gpt_oss 8 / 64, qwen3 32 / 128, qwen3_moe 4 /
    hidden // heads), not num_attention_heads and hidden // heads for every model_type."""
    import importlib

    import transformers as tf

    d = json.loads(json.dumps(REAL_CONFIGS[name]))
    d.pop("quantization_config", None)
    d.update(hidden_size=64, num_attention_heads=32, num_hidden_layers=1)  # hidden // heads = 2
    if "layer_types" in d:
        d["layer_types"] = d["layer_types"][:1]
    del d["num_key_value_heads"]
    d.pop("head_dim", None)
    mt = d["model_type"]
    cls = {"gpt_oss": "GptOss", "qwen3_moe": "Qwen3Moe", "qwen3": "Qwen3"}[mt]
    hf = getattr(tf, cls + "Config")(**json.loads(json.dumps(d)))
    modeling = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    att = getattr(modeling, cls + "Attention")(hf, 0)
    ours = ModelConfig.from_hf(d)
    assert (ours.q_width, ours.kv_width) == (att.q_proj.out_features, att.k_proj.out_features)
    assert (ours.num_key_value_heads, ours.head_dim) == {
        "gpt_oss": (8, 64),
        "qwen3_moe": (4, 2),
        "qwen3": (32, 128),
    }[mt]
    # null reads as "none given": num_attention_heads and hidden // heads
    d.update(num_key_value_heads=None, head_dim=None)
    assert (ModelConfig.from_hf(d).num_key_value_heads, ModelConfig.from_hf(d).head_dim) == (32, 2)
    # a default that does not fit the file's heads is named as the default
    d["num_attention_heads"] = 6  # divisible by none of 4, 8, 32
    del d["num_key_value_heads"]
    with pytest.raises(ValueError, match=r"num_key_value_heads: \d+ \(the \w+ default: the file has none\)"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(model_type="llama"), "model_type"),
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda d: d.update(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_type"),
        (lambda d: d.pop("rope_theta"), "rope_theta"),
        (lambda d: d.update(swiglu_limit=8.0), "swiglu_limit"),
        (lambda d: d.update(layer_types=["full_attention"]), "layer_types"),
        (lambda d: d.pop("num_local_experts"), "num_local_experts"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_config_fields(edit, match):
    d = json.loads(json.dumps(REAL_CONFIGS["gpt-oss-20b"]))
    edit(d)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


def test_bad_qwen3_moe_fields():
    d = dict(REAL_CONFIGS["qwen3-30b-a3b"], mlp_only_layers=[3])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf(
            {k: v for k, v in REAL_CONFIGS["qwen3-30b-a3b"].items() if k != "moe_intermediate_size"}
        )


# --------------------------------------------------------------------------------------------------
# (d) errors: checkpoints, call sizes
# --------------------------------------------------------------------------------------------------
def _edited_copy(src, dst, edit):
    shutil.copy(src / "config.json", dst / "config.json")
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors")
    return dst


def test_checkpoint_errors(ckpt, tmp_path):
    _, path = ckpt("qwen3")
    key = "model.layers.1.self_attn.k_proj.weight"

    def load(p):
        return load_hf_checkpoint(p, dtype=torch.float32, device="cpu", **SIZES)

    def wrong_shape(sd):
        sd[key] = torch.zeros(KV * HD + 1, H)

    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match=r"k_proj.weight'.*expected shape \[32, 32\], got \[33, 32\]"):
        load(_edited_copy(path, tmp_path / "a", wrong_shape))
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="missing 1 key.*k_proj"):
        load(_edited_copy(path, tmp_path / "b", lambda sd: sd.pop(key)))
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="unexpected 1 key.*extra_thing"):
        load(_edited_copy(path, tmp_path / "c", lambda sd: sd.update({"model.extra_thing": torch.zeros(2)})))
    (tmp_path / "d").mkdir()
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(cfg, model_type="mixtral")))
    with pytest.raises(ValueError, match="model_type"):
        load(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(
        json.dumps(dict(cfg, quantization_config={"quant_method": "mxfp4"}))
    )
    with pytest.raises(ValueError, match="quantization_config"):
        load(tmp_path / "d")
    with pytest.raises(ValueError, match="config.json"):
        load(tmp_path / "nowhere")


def test_call_size_errors(loaded):
    m = loaded("qwen3")
    ids = torch.zeros((2, 13), dtype=torch.int64)  # 26 tokens > max_tokens 24
    with pytest.raises(ValueError, match="max_tokens"):
        m(ids, [0, 0], [-1, -1])
    with pytest.raises(ValueError, match="max_batch"):
        m(torch.zeros((4, 1), dtype=torch.int64), [0] * 4, [-1] * 4)
    with pytest.raises(ValueError, match="max_seq"):
        m(torch.zeros((1, 17), dtype=torch.int64), [0], [-1])
    with pytest.raises(ValueError, match="start_pos"):
        m(torch.zeros((1, 4), dtype=torch.int64), [13], [-1])
    with pytest.raises(ValueError, match="cache_rows"):
        m(torch.zeros((1, 1), dtype=torch.int64), [0], [-1], cache_rows=[3])
    with pytest.raises(ValueError, match="lora_ids"):
        m(torch.zeros((2, 1), dtype=torch.int64), [0, 0], [-1])
    with pytest.raises(ValueError, match="kv_len"):
        m(torch.zeros((1, 4), dtype=torch.int64), [0], [-1], kv_len=3)


def test_random_model_and_weight_errors():
    cfg = ModelConfig.from_hf(
        dict(REAL_CONFIGS["qwen3-30b-a3b"], hidden_size=32, head_dim=16, num_attention_heads=4,
             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             num_hidden_layers=2, vocab_size=64)
    )  # fmt: skip
    m = random_model(cfg, seed=1, dtype=torch.float32, device="cpu", **SIZES)
    out = m(torch.randint(0, 64, (2, 5)), [0, 0], [-1, -1], kv_len=8)
    assert out.shape == (2, 5, 64) and torch.isfinite(out).all()
    same = random_model(cfg, seed=1, dtype=torch.float32, device="cpu", **SIZES)
    torch.testing.assert_close(same.layers[1].mlp.experts.w13, m.layers[1].mlp.experts.w13, rtol=0, atol=0)
    sd = dict(m.state_dict())
    sd["layers.0.mlp.router.weight"] = torch.zeros(5, 32)
    with pytest.raises(ValueError, match=r"router.weight'\]: expected shape \[4, 32\]"):
        MultiLoRAModel(cfg, dtype=torch.float32, device="cpu", weights=sd, **SIZES)
    sd = dict(m.state_dict(), extra=torch.zeros(1))
    with pytest.raises(ValueError, match="unexpected"):
        MultiLoRAModel(cfg, dtype=torch.float32, device="cpu", weights=sd, **SIZES)
