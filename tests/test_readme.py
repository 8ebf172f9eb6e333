"""README.md: its size, no run history, and its three usage blocks run as written.

The functional and ``MoELoRALayer`` blocks run unchanged (on a CPU they pick float32 and the Triton
interpreter that conftest switches on) and are checked against the fp32 reference with routing and
adapter slots rebuilt here from the block's own tensors. The generation block runs on a tiny GPT-OSS
checkpoint and two adapters written by transformers and PEFT themselves; only its sizes and token count
are swapped for the CPU (the swaps are asserted, so an edit that drops them fails here).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib.reference import moe_lora_reference, route_reference
from moelora_lib.testing import assert_close_rel

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _block(marker: str) -> str:
    found = [b for b in _blocks() if marker in b]
    assert len(found) == 1, f"README: expected one python block with {marker!r}, found {len(found)}"
    return found[0]


def _run(code: str, **ns) -> dict:
    exec(compile(code, "README.md", "exec"), ns)
    return ns


def test_readme_is_short_and_has_no_run_history():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "<!-- results:begin -->" in text and "<!-- results:end -->" in text
    # no commit hashes (7+ hex digits with at least one letter and one digit) and no dated run reports
    hashes = [
        w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search("[a-f]", w)
    ]
    assert not hashes, hashes
    assert not re.search(r"\b(round|session|last run)\b", text, re.I)
    assert len(_blocks()) == 3


def test_readme_links_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
    assert links
    missing = [link for link in links if "://" not in link and not (README.parent / link).exists()]
    assert not missing, missing


def test_readme_functional_block():
    ns = _run(_block("fused_moe_lora("))
    out, d = ns["out"], ns["d"]
    assert out.shape == (d.T, d.H) and out.dtype == ns["dtype"]
    args = [
        ns[k] for k in ("x", "w13", "w2", "topk_weights", "topk_ids", "lora_ids", "a13", "b13", "a2", "b2")
    ]
    ref = moe_lora_reference(*args)
    assert_close_rel(out.float(), ref, ns["dtype"])
    # the routing the block used is softmax top-k of its logits (renormalized)
    assert ns["topk_ids"].shape == (d.T, d.top_k) and torch.allclose(
        ns["topk_weights"].sum(-1), torch.ones(d.T)
    )
    # the token without an adapter gets the base MoE alone
    base = moe_lora_reference(*args[:5], torch.full_like(ns["lora_ids"], -1), *args[6:])
    assert_close_rel(out[2:3].float(), base[2:3], ns["dtype"])


def test_readme_layer_block():
    ns = _run(_block("MoELoRALayer("))
    layer, x, logits, lora_ids, y = ns["layer"], ns["x"], ns["logits"], ns["lora_ids"], ns["y"]
    E, H, I, r, dtype = ns["E"], ns["H"], ns["I"], ns["r"], ns["dtype"]
    a_gu, b_gu, a_dn, b_dn = ns["A13"], ns["B13"], ns["A2"], ns["B2"]
    L, R = 8, 16
    # the slots as load_adapter must have filled them: rank r zero-padded to R, scaling folded into B
    a13 = torch.zeros(L, E, 1, R, H)
    b13 = torch.zeros(L, E, 1, 2 * I, R)
    a2, b2 = torch.zeros(L, E, R, I), torch.zeros(L, E, H, R)
    a13[0, :, :, :r], b13[0, ..., :r], a2[0, :, :r], b2[0, ..., :r] = a_gu, 2.0 * b_gu, a_dn, 2.0 * b_dn
    a13[1, :, :, :r], b13[1, ..., :r] = a_gu, b_gu
    tw, ti = route_reference(logits, 2)
    w = (layer.w13.float(), layer.w2.float())
    ref = moe_lora_reference(x.float(), *w, tw, ti, lora_ids, a13, b13, a2, b2, activation="swigluoai")
    assert y.shape == (5, H)
    assert_close_rel(y.float(), ref, dtype)
    # after unload_adapter(1), tokens on slot 1 get the base MoE
    ids1 = torch.ones_like(lora_ids)
    base = moe_lora_reference(
        x.float(), *w, tw, ti, torch.full_like(lora_ids, -1), a13, b13, a2, b2, activation="swigluoai"
    )
    assert_close_rel(layer(x, logits, lora_ids=ids1).float(), base, dtype)


# The generation block on a tiny checkpoint: what changes from the README's sizes.
GEN_SWAPS = {
    "max_new_tokens=600": "max_new_tokens=3",  # the prefill's token and two decode steps
    "max_batch=32, max_seq=4096, max_tokens=8192": "max_batch=4, max_seq=64, max_tokens=64",
}


def _tiny_gpt_oss(folder: Path, adapter_dirs: list[Path]) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,  # one decoder layer (sliding, so the window matters): the block's code path
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention"],
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        attention_bias=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.9,
        output_router_logits=False,
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).save_pretrained(folder)
    for i, d in enumerate(adapter_dirs):
        base = transformers.GptOssForCausalLM.from_pretrained(folder)
        torch.manual_seed(10 + i)
        lora = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(base, lora).save_pretrained(d)


def test_readme_generation_block(tmp_path):
    code = _block("load_hf_checkpoint(")
    # the placeholder paths and prompts give way to a tiny checkpoint and two adapters written here
    names = ("checkpoint_dir = ", "adapter_dirs = ", "prompts = ")
    assert all(any(line.startswith(n) for line in code.splitlines()) for n in names), "README inputs changed"
    code = "\n".join(line for line in code.splitlines() if not line.startswith(names))
    for old, new in GEN_SWAPS.items():
        assert old in code, f"README generation block changed: {old!r} not found"
        code = code.replace(old, new)
    checkpoint_dir, adapter_dirs = tmp_path / "ckpt", [tmp_path / "a0", tmp_path / "a1"]
    _tiny_gpt_oss(checkpoint_dir, adapter_dirs)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8, 1, 4], [6, 2, 2, 9, 11]]
    ns = _run(code, checkpoint_dir=checkpoint_dir, adapter_dirs=adapter_dirs, prompts=prompts)
    out, model = ns["out"], ns["model"]
    assert [len(t) for t in out.tokens] == [3, 3, 3]
    summary = out.summary()
    assert summary and all(isinstance(k, str) for k in summary)
    gen = ns["Generator"](model)
    # a request gives the same tokens in another batch (greedy): slot 0 and no adapter, without request 1
    # (the first two: the prefill's and a decode step's; each interpreted step costs seconds)
    other = gen.generate([prompts[0], prompts[2]], adapters=[0, None], max_new_tokens=2).tokens
    assert other == [out.tokens[0][:2], out.tokens[2][:2]]
    # and the adapters change the output of at least one adapted request (else the check above proves little)
    base = gen.generate(prompts[:2], adapters=[None, None], max_new_tokens=2).tokens
    assert base != [out.tokens[0][:2], out.tokens[1][:2]]
