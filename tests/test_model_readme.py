"""README's "Generate with adapters" block, run as written on a tiny checkpoint (CPU, fp32).

The checkpoint is written by transformers (``save_pretrained`` of a tiny random GPT-OSS) and the two
adapters by PEFT (``get_peft_model(..., init_lora_weights=False)`` + ``save_pretrained``); the block's
bf16/CUDA/600-token settings are swapped for fp32/CPU/4 tokens (the swaps are asserted, so a README edit
that drops them fails here). Each request's tokens must equal the same request generated alone.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

README = Path(__file__).resolve().parents[1] / "README.md"
SWAPS = {
    'dtype, device = torch.bfloat16, "cuda"': 'dtype, device = torch.float32, "cpu"',
    "max_new_tokens=600": "max_new_tokens=4",
    "max_batch=32, max_seq=4096, max_tokens=8192": "max_batch=4, max_seq=64, max_tokens=64",
}


def _block() -> str:
    text = README.read_text()
    section = text[text.index("### Generate with adapters") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for old, new in SWAPS.items():
        assert old in code, f"README block changed: {old!r} not found"
        code = code.replace(old, new)
    return code


def _tiny_gpt_oss(folder: Path, adapter_dirs: list[Path]) -> None:
    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
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


def test_readme_generation_block_runs(tmp_path):
    checkpoint_dir, adapter_dirs = tmp_path / "ckpt", [tmp_path / "a0", tmp_path / "a1"]
    _tiny_gpt_oss(checkpoint_dir, adapter_dirs)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8, 1, 4], [6, 2, 2, 9, 11]]
    ns = dict(checkpoint_dir=checkpoint_dir, adapter_dirs=adapter_dirs, prompts=prompts)
    exec(compile(_block(), "README.md", "exec"), ns)
    out, model = ns["out"], ns["model"]
    assert [len(t) for t in out.tokens] == [4, 4, 4]
    summary = out.summary()
    assert summary and all(isinstance(k, str) for k in summary)
    gen = ns["Generator"](model)
    for i, slot in enumerate([0, 1, None]):  # each request alone gives the same tokens (greedy)
        alone = gen.generate([prompts[i]], adapters=[slot], max_new_tokens=4)
        assert alone.tokens[0] == out.tokens[i], (i, slot)
    # the adapters change the output of at least one of the two adapted requests (else the check above
    # would prove little)
    base = [gen.generate([prompts[i]], adapters=[None], max_new_tokens=4).tokens[0] for i in (0, 1)]
    assert base != [out.tokens[0], out.tokens[1]]
