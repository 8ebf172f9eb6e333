"""Bad input to moelora_lib.model: every case must raise a ValueError that names the argument (or the
file / key) and what was expected — never a crash inside a kernel, torch or safetensors, never silent
garbage. CPU, fp32, one tiny Qwen3 checkpoint written by transformers and two PEFT adapters (r = 4 and
r = 16) written by PEFT; most cases fail in validation before any kernel runs.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from moelora_lib.model import (
    Generator,
    ModelConfig,
    load_hf_checkpoint,
    load_peft_adapter,
    random_model,
    read_peft_adapter,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402

V, H, NL = 64, 32, 2
SIZES = dict(num_adapters=2, max_rank=8, max_batch=4, max_seq=16, max_tokens=16)
QKEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"ckpt", "r4", "r16"}: a tiny Qwen3 checkpoint and two PEFT adapters of it."""
    root = tmp_path_factory.mktemp("bad_input")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(_hf_config()).save_pretrained(root / "ckpt")
    out = {"ckpt": root / "ckpt"}
    for r in (4, 16):
        base = transformers.Qwen3ForCausalLM.from_pretrained(root / "ckpt")
        torch.manual_seed(r)
        lora = peft.LoraConfig(
            r=r, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(base, lora).save_pretrained(root / f"r{r}")
        out[f"r{r}"] = root / f"r{r}"
    return out


def _load(path, **kw):
    args = dict(dtype=torch.float32, device="cpu", **SIZES)
    args.update(kw)
    return load_hf_checkpoint(path, **args)


@pytest.fixture(scope="module")
def model(files):
    """The checkpoint with adapter r4 in slot 0 and slot 1 empty (tests must leave it so)."""
    m = _load(files["ckpt"])
    load_peft_adapter(m, 0, files["r4"])
    return m


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------------
# checkpoints and config.json
# --------------------------------------------------------------------------------------------------
def test_checkpoint_path_errors(files, tmp_path):
    with pytest.raises(ValueError, match="path must be a checkpoint folder.*NoneType"):
        _load(None)
    with pytest.raises(ValueError, match="checkpoint folder .*nowhere does not exist"):
        _load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="checkpoint folder .*config.json is a file"):
        _load(files["ckpt"] / "config.json")  # a file, not the folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no config.json"):
        _load(tmp_path / "empty")


def _edit_config(files, tmp_path, text: str) -> Path:
    d = _copy_folder(files["ckpt"], tmp_path / "ck")
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: "{not json", r"config.json: not valid JSON"),
        (lambda c: "[1, 2]", r"config.json: expected a JSON object, got list"),
        (lambda c: json.dumps(dict(c, model_type="llama")), r"model_type: must be one of .*'llama'"),
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "model_type"}), "model_type"),
        (lambda c: json.dumps(dict(c, hidden_size=48)), r"embed_tokens.weight'.*expected shape \[64, 48\]"),
        (
            lambda c: json.dumps(dict(c, num_hidden_layers=1, layer_types=["full_attention"])),
            r"unexpected .*model.layers.1",
        ),
        (lambda c: json.dumps(dict(c, num_hidden_layers=1)), "layer_types: must list num_hidden_layers = 1"),
        (lambda c: json.dumps(dict(c, vocab_size=64.0)), "vocab_size: must be a positive int"),
        (
            lambda c: json.dumps(dict(c, rope_parameters=None, rope_scaling=[1])),
            "rope_scaling: must be a dict",
        ),
        (
            lambda c: json.dumps(
                dict(c, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0, beta_fast="a"))
            ),
            "rope_scaling.beta_fast",
        ),
        (
            lambda c: json.dumps(
                dict(c, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0, mscale="x"))
            ),
            "rope_scaling.mscale",
        ),
        (lambda c: json.dumps(dict(c, quantization_config={"quant_method": "fp8"})), "quantization_config"),
    ],
    ids=[
        "bad_json",
        "json_list",
        "llama",
        "no_model_type",
        "hidden_size_vs_weights",
        "fewer_layers",
        "layer_types_length",
        "vocab_float",
        "rope_scaling_list",
        "yarn_beta_str",
        "yarn_mscale_str",
        "quantized",
    ],
)
def test_config_json_errors(files, tmp_path, edit, match):
    cfg = json.loads((files["ckpt"] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        _load(_edit_config(files, tmp_path, edit(cfg)))


def test_gpt_oss_swiglu_limit_not_a_number():
    from moelora_lib.model import REAL_CONFIGS

    with pytest.raises(ValueError, match="swiglu_limit"):
        ModelConfig.from_hf(dict(REAL_CONFIGS["gpt-oss-20b"], swiglu_limit="7"))


def _edit_weights(files, tmp_path, edit) -> Path:
    d = _copy_folder(files["ckpt"], tmp_path / "ck")
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors")
    return d


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: sd.pop("model.norm.weight"), r"missing 1 key.*model.norm.weight"),
        (lambda sd: sd.update(extra=torch.zeros(1)), r"unexpected 1 key.*'extra'"),
        (
            lambda sd: sd.update({"model.norm.weight": torch.ones(H, dtype=torch.int64)}),
            "must be a float tensor",
        ),
        (
            lambda sd: sd.update({"model.norm.weight": torch.full((H,), float("nan"))}),
            r"norm.weight'\]: not finite",
        ),
        (
            lambda sd: sd.update({"model.norm.weight": torch.zeros(H + 1)}),
            r"norm.weight'.*expected shape \[32\]",
        ),
    ],
    ids=["missing_key", "extra_key", "int_weight", "nan_weight", "wrong_shape"],
)
def test_checkpoint_weight_errors(files, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        _load(_edit_weights(files, tmp_path, edit))


def test_fp64_checkpoint_is_cast(files, tmp_path):
    d = _edit_weights(files, tmp_path, lambda sd: sd.update({k: v.double() for k, v in sd.items()}))
    assert _load(d).layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


def test_fp16_overflow_in_checkpoint(files, tmp_path):
    d = _edit_weights(files, tmp_path, lambda sd: sd["lm_head.weight"].mul_(1e6))
    with pytest.raises(ValueError, match=r"lm_head.weight'\]: not finite in torch.float16"):
        _load(d, dtype=torch.float16)


def test_corrupt_safetensors(files, tmp_path):
    d = _copy_folder(files["ckpt"], tmp_path / "ck")
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        _load(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        _load(d)
    (d / "model.safetensors.index.json").write_text("nope")
    with pytest.raises(ValueError, match=r"index.json: not valid JSON"):
        _load(d)


# --------------------------------------------------------------------------------------------------
# dtype, device, sizes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dtype=torch.float64), "dtype must be float16, bfloat16 or float32, got torch.float64"),
        (dict(dtype=torch.int32), "dtype must be float16, bfloat16 or float32"),
        (dict(dtype="float32"), "dtype must be float16, bfloat16 or float32, got 'float32'"),
        (dict(dtype=torch.bfloat16), r"dtype: bfloat16 is not supported on the CPU"),
        (dict(device="gpu"), "device must be a torch device.*'gpu'"),
        (dict(device=None), "device must be a torch device.*None"),
        (dict(device="meta"), "device must be a CUDA device or the CPU.*'meta'"),
        (dict(num_adapters=0), "num_adapters must be an int >= 1"),
        (dict(max_rank=-1), "max_rank must be an int >= 1"),
        (dict(max_batch=2.0), "max_batch must be an int >= 1"),
        (dict(max_tokens=True), "max_tokens must be an int >= 1"),
        (dict(stage="bogus"), r"stage must be one of \[.*'fused', 'gemv', 'auto'\], got 'bogus'"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_model_argument_errors(files, kw, match):
    with pytest.raises(ValueError, match=match):
        _load(files["ckpt"], **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_cuda(files):
    with pytest.raises(ValueError, match="device 'cuda:0': CUDA is not available"):
        _load(files["ckpt"], device="cuda:0")


def test_cpu_without_interpreter(files, monkeypatch):
    import moelora_lib.linear as ll

    def off(dtype, name="x"):
        raise ValueError("not the interpreter")

    monkeypatch.setattr(ll, "_check_cpu_backend", off)
    with pytest.raises(ValueError, match="device='cpu'.*TRITON_INTERPRET=1"):
        random_model("qwen3-32b", dtype=torch.float32, device="cpu", **SIZES)  # refused before any weight


def test_to_unsupported_dtype_on_cpu(files):
    m = _load(files["ckpt"])
    ids = torch.tensor([[1, 2]])
    m.to(torch.bfloat16)
    assert m.dtype == torch.bfloat16  # the properties follow .to()
    with pytest.raises(ValueError, match="bfloat16 is not supported on the CPU"):
        m(ids, [0], [-1])
    m.to(torch.float64)
    with pytest.raises(ValueError, match="must be float16, bfloat16 or float32, got torch.float64"):
        m(ids, [0], [-1])


# --------------------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------------------
def _edit_adapter(files, tmp_path, *, config=None, tensors=None, raw=None) -> Path:
    d = _copy_folder(files["r4"], tmp_path / "ad")
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps(config(cfg)))
    if tensors is not None:
        sd = {k: v.clone() for k, v in load_file(d / "adapter_model.safetensors").items()}
        tensors(sd)
        save_file(sd, d / "adapter_model.safetensors")
    if raw is not None:
        (d / "adapter_model.safetensors").write_bytes(raw)
    return d


def test_adapter_path_errors(model, files, tmp_path):
    with pytest.raises(ValueError, match="path must be a PEFT adapter folder.*NoneType"):
        load_peft_adapter(model, 1, None)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(model, 1, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(model, 1, files["ckpt"])  # the model's folder, not an adapter
    with pytest.raises(ValueError, match="model must be a MultiLoRAModel"):
        load_peft_adapter(object(), 0, files["r4"])
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: not a readable safetensors file"):
        load_peft_adapter(model, 1, _edit_adapter(files, tmp_path, raw=b"junk"))
    assert 1 not in model.layers[0].self_attn.qkv_proj.loaded_slots  # nothing written


def test_read_adapter_config_forms(model, files):
    """read_peft_adapter takes the model's ModelConfig or its config.json dict (the same tensors); another
    object, or a file for the folder, is named in the message (not 'model_type ... got None' / 'no
    adapter_config.json' for a file that is there)."""
    raw = json.loads((files["ckpt"] / "config.json").read_text())
    want = read_peft_adapter(files["r4"], model.config, expert_slices=1)
    got = read_peft_adapter(files["r4"], raw, expert_slices=1)
    assert [sorted(d) for d in got.layers] == [sorted(d) for d in want.layers] and got.rank == want.rank == 4
    for d_got, d_want in zip(got.layers, want.layers):
        for name, (a, b, s) in d_want.items():
            assert torch.equal(d_got[name][0], a) and torch.equal(d_got[name][1], b) and d_got[name][2] == s
    with pytest.raises(ValueError, match="config must be a ModelConfig .*got str"):
        read_peft_adapter(files["r4"], "qwen3", expert_slices=1)
    with pytest.raises(ValueError, match="model_type"):  # a dict is read by ModelConfig.from_hf
        read_peft_adapter(files["r4"], dict(raw, model_type="llama"), expert_slices=1)
    with pytest.raises(ValueError, match=r"adapter_config.json' is a file; expected a PEFT adapter folder"):
        load_peft_adapter(model, 1, files["r4"] / "adapter_config.json")


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(config=lambda c: dict(c, auto_mapping={"base_model_class": "GptOssForCausalLM"})),
            "made for another model",
        ),
        (
            dict(config=lambda c: dict(c, r=8)),
            r"lora_A.weight has shape \(4, \d+\), expected \(8, \d+\)",
        ),
        (dict(config=lambda c: dict(c, lora_alpha=float("nan"))), "lora_alpha must be a positive number"),
        (dict(config=lambda c: dict(c, use_dora=True)), "use_dora"),
        (
            dict(tensors=lambda sd: sd.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, H)})),
            "unknown key 'base_model.model.lm_head",
        ),
        (
            dict(
                tensors=lambda sd: sd.update(
                    {"base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight": torch.zeros(4, H)}
                )
            ),  # fmt: skip
            "unknown key .*experts.0.up_proj",
        ),
        (dict(tensors=lambda sd: sd.pop(QKEY.replace("lora_A", "lora_B"))), "lora_B.weight is missing"),
        (
            dict(tensors=lambda sd: sd.update({QKEY: torch.zeros(4, H + 1)})),
            r"shape \(4, 33\), expected \(4, 32\)",
        ),
        (dict(tensors=lambda sd: sd.update({QKEY: sd[QKEY].long()})), "expected a 2-D float tensor"),
        (dict(tensors=lambda sd: sd.update({QKEY: sd[QKEY][None]})), "expected a 2-D float tensor"),
        (dict(tensors=lambda sd: sd.update({QKEY: sd[QKEY] * float("nan")})), "q_proj.lora_A: not finite"),
        (
            dict(
                tensors=lambda sd: sd.update(
                    {k.replace("layers.0", "layers.5"): v.clone() for k, v in list(sd.items())}
                )
            ),  # fmt: skip
            "layer 5 >= the model's num_hidden_layers 2",
        ),
        (dict(tensors=lambda sd: sd.clear()), "no tensors"),
    ],
    ids=[
        "other_family",
        "r_mismatch",
        "alpha_nan",
        "dora",
        "lm_head_key",
        "expert_key_on_dense",
        "lone_lora_A",
        "wrong_in_dim",
        "int_factor",
        "3d_factor",
        "nan_factor",
        "layer_out_of_range",
        "empty_file",
    ],
)
def test_adapter_file_errors(model, files, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(model, 1, _edit_adapter(files, tmp_path, **kw))
    assert 1 not in model.layers[0].self_attn.qkv_proj.loaded_slots  # nothing written


@pytest.mark.parametrize("slot", [-1, 2, 1.0, None, True, "0"])
def test_adapter_slot_errors(model, files, slot):
    with pytest.raises(ValueError, match="slot must be"):
        load_peft_adapter(model, slot, files["r4"])
    with pytest.raises(ValueError, match="slot must be an int in"):
        model.unload_adapter(slot)


def test_rank_above_max_rank(model, files):
    with pytest.raises(ValueError, match=r"rank 16 exceeds the model's max_rank R = 8"):
        load_peft_adapter(model, 1, files["r16"])


def test_fp16_overflow_in_adapter(files, tmp_path):
    m = _load(files["ckpt"], dtype=torch.float16)

    def big_b(sd):
        sd.update({k: v * 1e6 for k, v in sd.items() if "lora_B" in k})

    d = _edit_adapter(files, tmp_path, tensors=big_b)
    with pytest.raises(ValueError, match=r"lora_B·scaling: not finite in the model's dtype torch.float16"):
        load_peft_adapter(m, 0, d)


def test_loading_twice_and_replacing(files):
    m = _load(files["ckpt"], max_rank=16)
    qkv = m.layers[0].self_attn.qkv_proj
    load_peft_adapter(m, 0, files["r4"])
    once = qkv.lora_a[0].clone(), qkv.lora_b[0].clone()
    load_peft_adapter(m, 0, files["r4"])  # same adapter again: same slot contents
    torch.testing.assert_close((qkv.lora_a[0], qkv.lora_b[0]), once, rtol=0, atol=0)
    load_peft_adapter(m, 0, files["r16"])  # a larger rank, then back: nothing of r16 may remain
    load_peft_adapter(m, 0, files["r4"])
    torch.testing.assert_close((qkv.lora_a[0], qkv.lora_b[0]), once, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------
def _gen_kwargs(**kw):
    args = dict(prompts=[[1, 2, 3]], adapters=[0], max_new_tokens=2)
    args.update(kw)
    return args


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(prompts=[], adapters=[]), "prompts: expected a non-empty list"),
        (dict(prompts=[[]]), r"prompts\[0\]: empty prompt"),
        (dict(prompts=[1, 2, 3], adapters=[0, 0, 0]), "prompts: .*a flat list of 3 ints; wrap it"),
        (dict(prompts="hello"), "prompts: expected a non-empty list"),
        (dict(prompts=np.array([[1, 2]])), "prompts: expected a non-empty list.*ndarray"),
        (dict(prompts=[[1, V]]), r"prompts\[0\]\[1\] = 64 is out of range \[0, vocab_size=64\)"),
        (dict(prompts=[[-1]]), r"prompts\[0\]\[0\] = -1 is out of range"),
        (dict(prompts=[[1.0, 2.0]]), r"prompts\[0\]: expected a list of int token ids.*got float 1.0"),
        (dict(prompts=[[True]]), r"prompts\[0\]: expected a list of int token ids.*got bool"),
        (dict(prompts=[np.array([1.0])]), r"prompts\[0\]: expected a 1-D integer tensor/array, got float64"),
        (dict(prompts=[torch.tensor([1.0])]), r"prompts\[0\]: expected a 1-D integer tensor/array"),
        (dict(prompts=[torch.tensor(3)]), r"prompts\[0\]: expected a 1-D integer tensor/array.*\(\)"),
        (dict(prompts=[torch.tensor([1], device="meta")]), r"prompts\[0\]: a meta tensor"),
        (dict(prompts=[[1]] * 5, adapters=[None] * 5), "5 requests exceed the model's max_batch=4"),
        (
            dict(prompts=[list(range(15))]),
            r"prompt length 15 \+ max_new_tokens 2 exceeds the model's max_seq=16",
        ),
        (dict(prompts=[[1], [2]], adapters=[0]), "adapters: expected one slot .* 2 in all, got 1"),
        (dict(adapters=None), "adapters: expected one slot"),
        (dict(adapters=[1]), r"adapters\[0\] = 1: slot 1 holds no adapter"),
        (dict(adapters=[2]), r"adapters\[0\] = 2: expected None, -1 or a slot in \[0, 2\)"),
        (dict(adapters=[-2]), r"adapters\[0\] = -2"),
        (dict(adapters=["0"]), r"adapters\[0\] = '0'"),
        (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
        (dict(max_new_tokens=-1), "max_new_tokens: expected an int >= 1"),
        (dict(max_new_tokens=2.0), "max_new_tokens: expected an int >= 1"),
        (dict(max_new_tokens=10**9), "exceeds the model's max_seq"),
        (dict(temperature=-1.0), "temperature: expected a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature: expected a finite number >= 0"),
        (dict(temperature=True), "temperature: expected a finite number >= 0, got True"),
        (dict(temperature=1.0, top_p=0), r"top_p: expected None or a number in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
        (dict(temperature=1.0, top_p=True), "top_p"),
        (dict(temperature=1.0, top_k=0), "top_k: expected None or an int >= 1"),
        (dict(temperature=1.0, seed="x"), r"seed: expected None or an int in \[-2\^63, 2\^64\) .*got 'x'"),
        (dict(temperature=1.0, seed=1.5), "seed: expected None or an int"),
        (dict(eos_token_id=-1), r"eos_token_id: expected None or a token id in \[0, 64\)"),
        (dict(eos_check_interval=0), "eos_check_interval: expected an int >= 1"),
        (dict(stream=5), "stream: expected None or a callable"),
    ],
)
def test_generate_argument_errors(model, kw, match):
    with pytest.raises(ValueError, match=match):
        Generator(model).generate(**_gen_kwargs(**kw))


def test_generator_construction_errors(model):
    with pytest.raises(ValueError, match="model: expected an attribute 'config.vocab_size'"):
        Generator(object())
    with pytest.raises(ValueError, match="graph_batch_sizes: expected positive ints"):
        Generator(model, graph_batch_sizes=[0])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cuda_graphs: the model is on cpu"):
            Generator(model, use_cuda_graphs=True)
    with pytest.raises(ValueError, match=r"batch_sizes: expected ints in \[1, max_batch=4\]"):
        Generator(model).warmup([0])


def test_prompt_as_numpy_array_or_tensor(model):
    gen = Generator(model)
    want = gen.generate([[1, 2, 3]], adapters=[0], max_new_tokens=1).tokens
    assert gen.generate([np.array([1, 2, 3])], adapters=[0], max_new_tokens=1).tokens == want
    assert (
        gen.generate([torch.tensor([1, 2, 3], dtype=torch.int32)], adapters=[0], max_new_tokens=1).tokens
        == want
    )


def test_unload_then_generate(files):
    m = _load(files["ckpt"])
    load_peft_adapter(m, 1, files["r4"])
    m.unload_adapter(1)
    with pytest.raises(ValueError, match=r"adapters\[0\] = 1: slot 1 holds no adapter \(loaded: \[\]\)"):
        Generator(m).generate([[1]], adapters=[1], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"lora_ids: slot\(s\) \[1\] hold no adapter"):
        m(torch.tensor([[1]]), [0], [1])


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------
IDS = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((torch.tensor([1, 2]), [0], [0]), {}, r"input_ids must be an int tensor \[B, S\], got shape \(2,\)"),
        ((IDS.float(), [0], [0]), {}, "input_ids must be int64 .or int32., got torch.float32"),
        ((IDS.to(torch.uint8), [0], [0]), {}, "input_ids must be int64"),
        ((IDS.numpy(), [0], [0]), {}, r"input_ids must be an int tensor \[B, S\], got ndarray"),
        ((torch.tensor([[V]]), [0], [-1]), {}, r"input_ids: token ids must be in \[0, vocab_size = 64\)"),
        ((torch.tensor([[-1]]), [0], [-1]), {}, r"input_ids: token ids must be in \[0, vocab_size = 64\)"),
        ((IDS.to("meta"), [0], [0]), {}, "input_ids must be on the CPU or on the model's device"),
        ((torch.zeros(0, 3, dtype=torch.long), [], []), {}, r"B = 0 must be in \[1, max_batch = 4\]"),
        ((IDS, torch.tensor([0.0]), [0]), {}, r"start_pos must be an int32/int64 tensor \[B=1\]"),
        ((IDS, torch.tensor([[0]]), [0]), {}, r"start_pos must be an int32/int64 tensor \[B=1\]"),
        ((IDS, 0, [0]), {}, r"start_pos must be an int tensor \[B=1\] or a list of B ints, got 0"),
        ((IDS, [-1], [0]), {}, "start_pos: every start_pos"),
        ((IDS, [14], [0]), {}, "start_pos: every start_pos"),
        ((IDS, torch.tensor([0], device="meta"), [0]), {}, "start_pos must be on the CPU"),
        ((IDS, [0], [1]), {}, r"lora_ids: slot\(s\) \[1\] hold no adapter \(loaded: \[0\]\)"),
        ((IDS, [0], [5]), {}, r"lora_ids: values must be in \[-1, num_adapters = 2\)"),
        ((IDS, [0], [True]), {}, "lora_ids must be an int tensor"),
        ((IDS, [0], [0, 0]), {}, "lora_ids must be an int tensor"),
        ((torch.tensor([[1], [2]]), [0, 0], [-1, -1]), dict(cache_rows=[1, 1]), "each request needs its own"),
        ((IDS, [0], [0]), dict(cache_rows=torch.tensor([0.0])), "cache_rows must be an int32/int64 tensor"),
        ((IDS, [0], [0]), dict(cache_rows=[4]), r"cache_rows: values must be in \[0, max_batch = 4\)"),
        ((IDS, [0], [0]), dict(kv_len=3.0), r"kv_len must be an int in \[S = 3, max_seq = 16\]"),
        ((IDS, [0], [0]), dict(kv_len=2), "kv_len must be an int in"),
    ],
)
def test_forward_argument_errors(model, args, kw, match):
    with pytest.raises(ValueError, match=match):
        model(*args, **kw)


# --------------------------------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------------------------------
def test_deepcopy_and_pickle(model):
    ref = model(IDS, [0], [0])
    dup = copy.deepcopy(model)
    torch.testing.assert_close(dup(IDS, [0], [0]), ref, rtol=0, atol=0)
    dup.unload_adapter(0)  # the copy's slots are its own
    assert 0 in model.layers[0].self_attn.qkv_proj.loaded_slots
    assert (dup(IDS, [0], [-1]) - ref).abs().max() > 0  # the copy now runs the base model
    back = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(back(IDS, [0], [0]), ref, rtol=0, atol=0)
