"""PEFT adapter files read into the slot layout (moelora_lib.model.peft_adapters), CPU, fp32.

Every adapter here is written by PEFT 0.21 itself (``get_peft_model(..., init_lora_weights=False)`` +
``save_pretrained``) on tiny random transformers models, except the Qwen3-MoE per-expert file, which
only transformers 4 can write: it is written by hand in that format and PEFT reads it back
(``PeftModel.from_pretrained`` converts it to fused experts under transformers 5).

The oracle is PEFT's own merge: for every weight, ``merge_and_unload()`` minus the base weight,
transposed to the nn.Linear layout where the base parameter is stored ``x @ W`` (GPT-OSS experts).
Our ΔW = s·B·A per module (per expert and slice for the experts) must equal it, and every weight PEFT
changes must be covered. The same deltas are then read back out of real LoRALinear / MoELoRALayer
slots after :func:`load_peft_adapter` on a skeleton with the MultiLoRAModel module tree (no forward),
so the loader's scaling folds and slot writes are checked too. The end-to-end test (a mixed batch
through MultiLoRAModel against transformers + PEFT per row) runs when moelora_lib.model.modeling and
checkpoint exist.

Cases: GPT-OSS with both expert parameters and rank/alpha patterns (incl. a regex on one layer's
down_proj), GPT-OSS one-parameter files (down only with rsLoRA; gate_up only), Qwen3-MoE per-expert
names converted by PEFT to fused, native fused with rsLoRA, the transformers-4 per-expert file,
Qwen3 dense attention + MLP with rsLoRA and patterns; the swapped 3-D orientation (synthesised from
the normal file); refusals.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib.model.config import ModelConfig
from moelora_lib.model.peft_adapters import load_peft_adapter, read_peft_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402

ATOL = 2e-5  # fp32; deltas are O(1)

# --- tiny models (every field explicit: the config classes do not default to the real models) ------
H, NL, E, TOPK, HEADS, KV = 32, 2, 4, 2, 4, 2
GPT_I, QMOE_I, DENSE_I = 24, 12, 40  # GPT-OSS: 2I = 48 != H and I != H, so both orientations are visible


def _hf_config(kind: str):
    common = dict(
        vocab_size=96,
        hidden_size=H,
        num_hidden_layers=NL,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            **common,
            head_dim=8,
            intermediate_size=GPT_I,
            num_local_experts=E,
            num_experts_per_tok=TOPK,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rms_norm_eps=1e-5,
            attention_bias=True,
            router_aux_loss_coef=0.9,
            output_router_logits=False,
        )
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=QMOE_I,
            num_experts=E,
            num_experts_per_tok=TOPK,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
            rms_norm_eps=1e-6,
            attention_bias=False,
            output_router_logits=False,
        )
    return transformers.Qwen3Config(
        **common,
        head_dim=12,
        intermediate_size=DENSE_I,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=NL,
        rms_norm_eps=1e-6,
        attention_bias=False,
    )


_CLASSES = {"gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[kind])(_hf_config(kind)).eval()
    with torch.no_grad():  # nonzero biases / norms so that nothing is trivially symmetric
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "sinks" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _model_config(kind: str) -> ModelConfig:
    return ModelConfig.from_hf(_hf_config(kind).to_dict())


# adapter cases: name -> (model kind, LoraConfig kwargs); "per_expert" is written by hand (see above)
CASES = {
    "gpt_oss_both_patterns": (
        "gpt_oss",
        dict(
            r=3,
            lora_alpha=6,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.experts\.down_proj": 2},
            alpha_pattern={"o_proj": 3, "gate_up_proj": 10},
        ),
    ),
    "gpt_oss_down_rslora": (
        "gpt_oss",
        dict(r=2, lora_alpha=8, use_rslora=True, target_modules=["v_proj"], target_parameters=["down_proj"]),
    ),
    "gpt_oss_gate_up_only": (
        "gpt_oss",
        dict(r=2, lora_alpha=3, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
    ),
    "qwen3_moe_converted": (
        "qwen3_moe",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
    "qwen3_moe_fused_rslora": (
        "qwen3_moe",
        dict(
            r=3,
            lora_alpha=5,
            use_rslora=True,
            target_modules=["o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    ),
    "qwen3_moe_per_expert": ("qwen3_moe", dict(r=2, lora_alpha=3)),
    "qwen3_dense_attn_up": ("qwen3", dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj", "up_proj"])),
    "qwen3_dense_rslora_patterns": (
        "qwen3",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            rank_pattern={r"layers\.0\.mlp\.down_proj": 2},
            alpha_pattern={"v_proj": 2},
        ),
    ),
}


def _write_per_expert(model, folder: Path, r: int, alpha: float, seed: int) -> None:
    """A transformers-4 style Qwen3-MoE adapter: q/v attention + per-expert gate/up/down modules."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    I = QMOE_I
    shapes = {"self_attn.q_proj": (H, HEADS * 16), "self_attn.v_proj": (H, KV * 16)}
    for e in range(E):
        shapes |= {
            f"mlp.experts.{e}.gate_proj": (H, I),
            f"mlp.experts.{e}.up_proj": (H, I),
            f"mlp.experts.{e}.down_proj": (I, H),
        }
    for layer in range(NL):
        for mod, (d_in, d_out) in shapes.items():
            pre = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, d_in, generator=g) * 0.3
            tensors[f"{pre}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.3
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    )
    d = cfg.to_dict()
    d["target_modules"] = sorted(d["target_modules"])
    d["peft_type"] = "LORA"
    d["auto_mapping"] = {"base_model_class": "Qwen3MoeForCausalLM"}
    (folder / "adapter_config.json").write_text(json.dumps(d, default=str))


def _merged_deltas(kind: str, base_sd: dict, merged_sd: dict) -> dict:
    """{(layer, name): ΔW in the nn.Linear layout} from PEFT's merge (names as PeftAdapter uses)."""
    out = {}
    for key, w in merged_sd.items():
        d = w.float() - base_sd[key].float()
        if not d.abs().max() > 0:
            continue
        parts = key.split(".")
        assert parts[:2] == ["model", "layers"], f"PEFT changed {key}, which no adapter entry covers"
        layer, rest = int(parts[2]), ".".join(parts[3:])
        names = {
            "self_attn.q_proj.weight": "q",
            "self_attn.k_proj.weight": "k",
            "self_attn.v_proj.weight": "v",
            "self_attn.o_proj.weight": "o",
            "mlp.gate_proj.weight": "gate",
            "mlp.up_proj.weight": "up",
            "mlp.down_proj.weight": "down",
            "mlp.experts.gate_up_proj": "experts_gate_up",
            "mlp.experts.down_proj": "experts_down",
        }
        assert rest in names, f"PEFT changed {key}, which no adapter entry covers"
        name = names[rest]
        if kind == "gpt_oss" and name.startswith("experts"):  # stored x @ W: [E, in, out]
            d = d.transpose(1, 2)
        out[(layer, name)] = d
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (kind, folder, PEFT's merged deltas, base model state dict); built once per module."""
    root = tmp_path_factory.mktemp("peft_adapters")
    built = {}
    warnings.filterwarnings("ignore", category=UserWarning)
    for i, (name, (kind, kw)) in enumerate(CASES.items()):
        base = _hf_model(kind)
        base_sd = {k: v.clone() for k, v in base.state_dict().items()}
        folder = root / name
        if name == "qwen3_moe_per_expert":
            _write_per_expert(base, folder, kw["r"], kw["lora_alpha"], seed=100 + i)
            pm = peft.PeftModel.from_pretrained(base, str(folder))
        else:
            torch.manual_seed(100 + i)
            pm = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kw))
            pm.save_pretrained(str(folder))
        merged = pm.merge_and_unload()
        built[name] = (kind, folder, _merged_deltas(kind, base_sd, merged.state_dict()), base_sd)
    return built


def _delta_of_entry(name: str, entry) -> torch.Tensor:
    a, b, s = entry
    if name == "experts_gate_up":  # concat over slices of s·B[e, s]·A[e, s]
        return torch.cat([s * b[:, k] @ a[:, k] for k in range(a.shape[1])], dim=1)
    return s * b @ a


def _check_deltas(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs), f"covered: ours {sorted(ours)} vs PEFT {sorted(theirs)}"
    for key, d in theirs.items():
        assert ours[key].shape == d.shape, (key, ours[key].shape, d.shape)
        err = (ours[key] - d).abs().max().item()
        if err > ATOL * max(1.0, d.abs().max().item()):
            pytest.fail(f"{key}: max |ΔW ours − PEFT merge| = {err:.3g}")


def _slices_for(kind: str) -> list[int]:
    return [1, 2] if kind != "qwen3" else [2]


# --- (1) model-independent: our (A, B, scaling) reproduce PEFT's merge -----------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_read_matches_peft_merge(adapters, name):
    kind, folder, theirs, _ = adapters[name]
    for S in _slices_for(kind):
        ad = read_peft_adapter(folder, _model_config(kind), expert_slices=S)
        ours = {
            (layer, n): _delta_of_entry(n, ent)
            for layer, ents in enumerate(ad.layers)
            for n, ent in ents.items()
        }
        _check_deltas(ours, theirs)
        for (_, n), ent in ((k, ad.layers[k[0]][k[1]]) for k in ours):
            if n == "experts_gate_up":
                assert ent[0].shape[:2] == (E, S) and ent[1].shape[:2] == (E, S)
        if any(n.startswith("experts") for _, n in ours) and name != "qwen3_moe_per_expert":
            assert ad.expert_orientation == "normal"


def test_scalings_and_ranks(adapters):
    """Per-module r and scaling from r / rank_pattern / alpha_pattern / rsLoRA, as PEFT matches them."""
    ad = read_peft_adapter(adapters["gpt_oss_both_patterns"][1], _model_config("gpt_oss"), expert_slices=1)
    l0, l1 = ad.layers
    assert l0["q"][0].shape[0] == 4 and l0["q"][2] == pytest.approx(6 / 4)  # rank_pattern, alpha r
    assert l0["o"][2] == pytest.approx(3 / 3)  # alpha_pattern
    assert l0["experts_gate_up"][2] == pytest.approx(10 / 3) and l0["experts_gate_up"][0].shape[2] == 3
    assert l0["experts_down"][0].shape[1] == 3 and l1["experts_down"][0].shape[1] == 2  # layer-1 regex
    assert l1["experts_down"][2] == pytest.approx(6 / 2)
    assert ad.rank == 4
    ad = read_peft_adapter(adapters["gpt_oss_down_rslora"][1], _model_config("gpt_oss"), expert_slices=1)
    assert ad.layers[0]["experts_down"][2] == pytest.approx(8 / 2**0.5)
    assert set(ad.layers[0]) == {"v", "experts_down"}
    ad = read_peft_adapter(adapters["qwen3_moe_converted"][1], _model_config("qwen3_moe"), expert_slices=2)
    assert ad.layers[0]["experts_gate_up"][0].shape == (E, 2, 4, H)  # PEFT's conversion: rank 2r
    ad = read_peft_adapter(adapters["qwen3_moe_per_expert"][1], _model_config("qwen3_moe"), expert_slices=1)
    assert ad.layers[0]["experts_gate_up"][0].shape == (E, 1, 4, H)  # S = 1: [A_gate; A_up]
    assert ad.rank == 4


@pytest.mark.parametrize("S", [1, 2])
def test_per_expert_scalings_folded(adapters, S, tmp_path):
    """Gate and up of one expert with different alphas (alpha_pattern): each folded into its own B."""
    folder = _variant(
        adapters["qwen3_moe_per_expert"][1],
        tmp_path / "ap",
        cfg=lambda d: d.update(alpha_pattern={"up_proj": 7}),
    )
    t = load_file(str(folder / "adapter_model.safetensors"))
    ad = read_peft_adapter(folder, _model_config("qwen3_moe"), expert_slices=S)
    for layer in range(NL):
        a, b, s = ad.layers[layer]["experts_gate_up"]
        assert s == 1.0
        got = _delta_of_entry("experts_gate_up", (a, b, s))
        for e in range(E):
            pre = f"base_model.model.model.layers.{layer}.mlp.experts.{e}."
            want = torch.cat(
                [
                    (3 / 2) * t[pre + "gate_proj.lora_B.weight"] @ t[pre + "gate_proj.lora_A.weight"],
                    (7 / 2) * t[pre + "up_proj.lora_B.weight"] @ t[pre + "up_proj.lora_A.weight"],
                ]
            )
            torch.testing.assert_close(got[e], want, atol=ATOL, rtol=0)
        a, b, s = ad.layers[layer]["experts_down"]
        assert s == pytest.approx(3 / 2)  # down keeps its own scaling


def _swap_file(src: Path, dst: Path) -> None:
    """Rewrite every 3-D expert factor pair in PEFT's swapped orientation (notes §4.6): A' [E·r, out] with
    A'_e = B_eᵀ, B' [in, E·r] with B'[:, e::E] = A_eᵀ — the same ΔW_e."""
    shutil.copytree(src, dst)
    t = load_file(str(src / "adapter_model.safetensors"))
    keys = [
        k for k in t if k.endswith((".mlp.experts.lora_A.weight", ".mlp.experts.base_layer.lora_A.weight"))
    ]
    for key in keys:
        kb = key.replace("lora_A", "lora_B")
        a, b = t[key], t[kb]
        r = a.shape[0] // E
        a_e = a.reshape(E, r, -1)
        b_e = b.reshape(b.shape[0], r, E).permute(2, 0, 1)  # [E, out, r]
        t[key] = b_e.transpose(1, 2).reshape(E * r, -1).contiguous()  # B_eᵀ stacked expert-major
        t[kb] = a_e.permute(2, 1, 0).reshape(a.shape[1], r * E).contiguous()  # column k·E + e = A_e[k]ᵀ
    save_file(t, str(dst / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", ["gpt_oss_both_patterns", "qwen3_moe_fused_rslora"])
def test_swapped_orientation_is_loaded(adapters, name, tmp_path):
    kind, folder, theirs, _ = adapters[name]
    _swap_file(folder, tmp_path / "swapped")
    ad = read_peft_adapter(tmp_path / "swapped", _model_config(kind), expert_slices=1)
    assert ad.expert_orientation == "swapped"
    ours = {
        (layer, n): _delta_of_entry(n, ent) for layer, ents in enumerate(ad.layers) for n, ent in ents.items()
    }
    _check_deltas(ours, theirs)


def test_mixed_orientation_refused(adapters, tmp_path):
    folder = adapters["gpt_oss_both_patterns"][1]
    _swap_file(folder, tmp_path / "swapped")
    t = load_file(str(tmp_path / "swapped" / "adapter_model.safetensors"))
    t0 = load_file(str(folder / "adapter_model.safetensors"))
    k = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_"
    t[k + "A.weight"], t[k + "B.weight"] = t0[k + "A.weight"], t0[k + "B.weight"]  # layer 1 gate_up normal
    save_file(t, str(tmp_path / "swapped" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="orientation"):
        read_peft_adapter(tmp_path / "swapped", _model_config("gpt_oss"), expert_slices=1)


# --- (2) refusals ---------------------------------------------------------------------------------
def _variant(src: Path, dst: Path, *, cfg=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if cfg is not None:
        d = json.loads((dst / "adapter_config.json").read_text())
        cfg(d)
        (dst / "adapter_config.json").write_text(json.dumps(d))
    if tensors is not None:
        t = load_file(str(dst / "adapter_model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


_ATTN_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
_GU_KEY = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_"
REFUSALS = {
    "dora": (dict(cfg=lambda d: d.update(use_dora=True)), "use_dora"),
    "bias_all": (dict(cfg=lambda d: d.update(bias="all")), "bias"),
    "lora_bias": (dict(cfg=lambda d: d.update(lora_bias=True)), "lora_bias"),
    "fan_in_fan_out": (dict(cfg=lambda d: d.update(fan_in_fan_out=True)), "fan_in_fan_out"),
    "modules_to_save": (dict(cfg=lambda d: d.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "not_lora": (dict(cfg=lambda d: d.update(peft_type="IA3")), "peft_type"),
    "other_model_class": (
        dict(cfg=lambda d: d.update(auto_mapping={"base_model_class": "LlamaForCausalLM"})),
        "base_model_class.*LlamaForCausalLM",
    ),
    "unknown_key_lm_head": (
        dict(tensors=lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(3, H)})),
        "unknown key 'base_model.model.lm_head.lora_A.weight'",
    ),
    "unknown_key_router": (
        dict(
            tensors=lambda t: t.update(
                {"base_model.model.model.layers.0.mlp.router.lora_A.weight": torch.zeros(3, H)}
            )
        ),
        r"unknown key .*mlp\.router",
    ),
    "layer_out_of_range": (
        dict(
            tensors=lambda t: t.update(
                {
                    "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, H),
                    "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
                }
            )
        ),
        "layer 7 >= the model's num_hidden_layers 2",
    ),
    "lone_lora_A": (dict(tensors=lambda t: t.pop(_ATTN_KEY + "B.weight")), "lora_B.weight is missing"),
    "attn_shape": (
        dict(tensors=lambda t: t.update({_ATTN_KEY + "B.weight": torch.zeros(40, 4)})),
        r"q_proj.lora_B.weight has shape \(40, 4\), expected \(32, 4\)",
    ),
    "rank_vs_config": (
        dict(cfg=lambda d: d.update(rank_pattern={})),  # q_proj is rank 4 in the file, config now says 3
        r"q_proj.lora_A.weight has shape \(4, 32\), expected \(3, 32\)",
    ),
    "expert_shape": (
        dict(tensors=lambda t: t.update({_GU_KEY + "B.weight": torch.zeros(50, 12)})),
        r"gate_up_proj.*expected \[E·r, 32\] / \[48, E·r\] with E = 4",
    ),
    "expert_rows_vs_rank": (
        dict(cfg=lambda d: d["rank_pattern"].update({"gate_up_proj": 2})),
        r"gate_up_proj: lora_A has 12 rows, expected E·r = 4·2 = 8",
    ),
    "target_parameters_other": (
        dict(cfg=lambda d: d.update(target_parameters=["mlp.experts.gate_up_proj_bias"])),
        "target_parameters entry 'mlp.experts.gate_up_proj_bias'",
    ),
    "one_param_wrong_target": (  # a gate_up-only file whose config claims down_proj
        dict(cfg=lambda d: d.update(target_parameters=["mlp.experts.down_proj"])),
        "these are the shapes of gate_up_proj",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(adapters, case, tmp_path):
    kw, msg = REFUSALS[case]
    src = "gpt_oss_gate_up_only" if case == "one_param_wrong_target" else "gpt_oss_both_patterns"
    folder = _variant(adapters[src][1], tmp_path / case, **kw)
    with pytest.raises(ValueError, match=msg):
        read_peft_adapter(folder, _model_config("gpt_oss"), expert_slices=1)


def test_refuses_other_model(adapters):
    # a GPT-OSS adapter on a Qwen3-MoE model: the class check; without auto_mapping, the shapes
    gpt = adapters["gpt_oss_both_patterns"][1]
    with pytest.raises(ValueError, match="base_model_class = 'GptOssForCausalLM'.*'qwen3_moe'"):
        read_peft_adapter(gpt, _model_config("qwen3_moe"), expert_slices=2)
    # Qwen3-MoE per-expert keys on a dense Qwen3 / on GPT-OSS: unknown keys
    pe = adapters["qwen3_moe_per_expert"][1]
    cfg = _model_config("qwen3")
    with pytest.raises(ValueError, match="base_model_class"):
        read_peft_adapter(pe, cfg, expert_slices=2)


def test_refuses_other_dims_without_class(adapters, tmp_path):
    def drop(d):
        d.pop("auto_mapping", None)

    gpt = _variant(adapters["gpt_oss_both_patterns"][1], tmp_path / "gpt", cfg=drop)
    with pytest.raises(ValueError, match="expected"):
        read_peft_adapter(gpt, _model_config("qwen3_moe"), expert_slices=2)
    pe = _variant(adapters["qwen3_moe_per_expert"][1], tmp_path / "pe", cfg=drop)
    with pytest.raises(ValueError, match=r"unknown key .*mlp\.experts\.0\.down_proj"):
        read_peft_adapter(pe, _model_config("gpt_oss"), expert_slices=1)
    dense = _variant(adapters["qwen3_dense_rslora_patterns"][1], tmp_path / "dense", cfg=drop)
    with pytest.raises(ValueError, match=r"unknown key .*mlp\.down_proj"):
        read_peft_adapter(dense, _model_config("qwen3_moe"), expert_slices=2)


# --- (3) loading into real slot modules (the MultiLoRAModel module tree, no forward) --------------
class _Skeleton(torch.nn.Module):
    """MultiLoRAModel's adapter-facing tree: .config and .layers[l].{self_attn.qkv_proj, self_attn.o_proj,
    mlp.experts | mlp.gate_up_proj, mlp.down_proj}: moelora_lib.LoRALinear / MoELoRALayer, zero weights."""

    def __init__(self, cfg: ModelConfig, *, L: int, R: int, S: int):
        from moelora_lib import LoRALinear, MoELoRALayer

        super().__init__()
        self.config = cfg
        lin = dict(num_adapters=L, max_rank=R, max_tokens=8)
        q, kv = cfg.q_width, cfg.kv_width
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.qkv_proj = LoRALinear(torch.zeros(q + 2 * kv, H), slices=(q, kv, kv), **lin)
            layer.self_attn.o_proj = LoRALinear(torch.zeros(H, q), **lin)
            layer.mlp = torch.nn.Module()
            if cfg.is_moe:
                Inter = cfg.moe_intermediate_size
                layer.mlp.experts = MoELoRALayer(
                    torch.zeros(E, 2 * Inter, H), torch.zeros(E, H, Inter), top_k=TOPK, slices=S, **lin
                )
            else:
                Inter = cfg.intermediate_size
                layer.mlp.gate_up_proj = LoRALinear(torch.zeros(2 * Inter, H), slices=(Inter, Inter), **lin)
                layer.mlp.down_proj = LoRALinear(torch.zeros(H, Inter), **lin)
            self.layers.append(layer)


def _slot_deltas(model: _Skeleton, slot: int) -> dict:
    out = {}
    for li, layer in enumerate(model.layers):
        mods = [(layer.self_attn.qkv_proj, ("q", "k", "v")), (layer.self_attn.o_proj, ("o",))]
        if not model.config.is_moe:
            mods += [(layer.mlp.gate_up_proj, ("gate", "up")), (layer.mlp.down_proj, ("down",))]
        for mod, names in mods:
            for s, n in enumerate(names):
                o, w = mod.offsets[s], mod.slices[s]
                d = mod.lora_b[slot, o : o + w] @ mod.lora_a[slot, s]
                if d.abs().max() > 0:
                    out[(li, n)] = d
        if model.config.is_moe:
            ex = layer.mlp.experts
            gu = torch.cat([ex.lora_b13[slot, :, s] @ ex.lora_a13[slot, :, s] for s in range(ex.S)], dim=1)
            dn = ex.lora_b2[slot] @ ex.lora_a2[slot]
            for n, d in (("experts_gate_up", gu), ("experts_down", dn)):
                if d.abs().max() > 0:
                    out[(li, n)] = d
    return out


LOAD_PAIRS = {  # model kind -> (adapter for slot 0, adapter for slot 2)
    "gpt_oss": ("gpt_oss_both_patterns", "gpt_oss_down_rslora"),
    "qwen3_moe": ("qwen3_moe_per_expert", "qwen3_moe_fused_rslora"),
    "qwen3": ("qwen3_dense_rslora_patterns", "qwen3_dense_rslora_patterns"),
}


@pytest.mark.parametrize("kind", list(LOAD_PAIRS))
def test_load_into_slots(adapters, kind):
    S = 1 if kind == "gpt_oss" else 2
    model = _Skeleton(_model_config(kind), L=3, R=6, S=S)
    first, second = LOAD_PAIRS[kind]
    load_peft_adapter(model, 0, adapters[first][1])
    load_peft_adapter(model, 2, adapters[first][1])
    load_peft_adapter(model, 2, adapters[second][1])  # replaces: nothing of `first` may remain
    _check_deltas(_slot_deltas(model, 0), adapters[first][2])
    _check_deltas(_slot_deltas(model, 2), adapters[second][2])
    assert _slot_deltas(model, 1) == {}


def test_loaded_adapter_repr_is_one_short_line(adapters):
    """load_peft_adapter's result prints its slot, rank, alpha, scaling, tensor count, projections, layers
    and path on one line, not its tensors."""
    kind, folder = adapters["qwen3_dense_attn_up"][:2]
    model = _Skeleton(_model_config(kind), L=3, R=6, S=2)
    adapter = load_peft_adapter(model, 1, folder)
    n_layers = len(adapter.layers)
    text = repr(adapter)
    assert text == (
        f"PeftAdapter(slot=1, rank=2, lora_alpha=5, scaling=2.5, tensors={2 * 3 * n_layers}, "
        f"projections=[q, v, up], layers=0-{n_layers - 1} of {n_layers}, path={str(folder)!r})"
    )
    assert "tensor(" not in text and "\n" not in text
    read = read_peft_adapter(folder, model.config, expert_slices=2)
    assert repr(read).startswith("PeftAdapter(slot=None, rank=2,")  # read only: no slot
    several = adapters["qwen3_dense_rslora_patterns"][1]  # rank_pattern / alpha_pattern: several scalings
    assert "scaling=[" in repr(read_peft_adapter(several, model.config, expert_slices=2))


def test_load_refusals_write_nothing(adapters, tmp_path):
    model = _Skeleton(_model_config("gpt_oss"), L=2, R=3, S=1)
    load_peft_adapter(model, 0, adapters["gpt_oss_down_rslora"][1])  # rank 2 <= R
    before = {k: v.clone() for k, v in _slot_deltas(model, 0).items()}
    # rank 4 (q_proj via rank_pattern) > R = 3: named key and R in the message, slot 0 untouched
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: rank 4 exceeds the model's max_rank R = 3"
    ):
        load_peft_adapter(model, 0, adapters["gpt_oss_both_patterns"][1])
    with pytest.raises(ValueError, match="slot must be in"):
        load_peft_adapter(model, 2, adapters["gpt_oss_down_rslora"][1])
    bad = _variant(
        adapters["gpt_oss_gate_up_only"][1], tmp_path / "dora", cfg=lambda d: d.update(use_dora=True)
    )
    with pytest.raises(ValueError, match="use_dora"):
        load_peft_adapter(model, 0, bad)
    after = _slot_deltas(model, 0)
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


# --- (4) end to end: a mixed batch through MultiLoRAModel vs transformers + PEFT per row -----------
E2E = {  # model kind -> (adapter in slot 0, adapter in slot 1); rows use slot 0, slot 1 and -1
    "gpt_oss": ("gpt_oss_both_patterns", "gpt_oss_down_rslora"),
    "qwen3_moe": ("qwen3_moe_per_expert", "qwen3_moe_fused_rslora"),
    "qwen3": ("qwen3_dense_rslora_patterns", "qwen3_dense_attn_up"),
}
E2E_ATOL = 1e-4  # fp32 logits of O(1): kernels (interpreter) vs transformers' eager fp32


@pytest.mark.parametrize("kind", list(E2E))
def test_end_to_end_mixed_batch(adapters, kind, tmp_path):
    checkpoint = pytest.importorskip("moelora_lib.model.checkpoint")
    base = _hf_model(kind)  # same seed as the adapters' base: same weights
    base.save_pretrained(str(tmp_path / "base"))
    B, S = 3, 5
    model = checkpoint.load_hf_checkpoint(
        tmp_path / "base",
        dtype=torch.float32,
        device="cpu",
        num_adapters=2,
        max_rank=6,
        max_batch=B,
        max_seq=8,
        max_tokens=B * S,
    )
    first, second = E2E[kind]
    load_peft_adapter(model, 0, adapters[first][1])
    load_peft_adapter(model, 1, adapters[second][1])
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(3))
    ours = model(ids, [0, 0, 0], [0, 1, -1])
    refs = []
    with torch.no_grad():
        for row, name in enumerate((first, second, None)):
            ref = _hf_model(kind)
            if name is not None:
                ref = peft.PeftModel.from_pretrained(ref, str(adapters[name][1])).eval()
            refs.append(ref(input_ids=ids[row : row + 1]).logits[0].float())
    assert not torch.allclose(refs[0], refs[2], atol=1e-2) and not torch.allclose(refs[1], refs[2], atol=1e-2)
    for row in range(B):
        err = (ours[row] - refs[row]).abs().max().item()
        if err > E2E_ATOL:
            pytest.fail(
                f"{kind}: row {row} (slot {[0, 1, -1][row]}): max |logits − transformers+PEFT| = {err:.3g}"
            )
