"""The core install is enough for a serving stack: torch, triton, numpy, safetensors.

``import moelora_lib`` and a :class:`moelora_lib.MoELoRALayer` forward (CPU, Triton interpreter) run in a
fresh interpreter where the extras (pandas, matplotlib, tqdm, helion, transformers, peft, IPython,
papermill, nbformat) cannot be imported (the model runner, the dense LoRA op, the Helion backend's
fallback and the config loaders import too), and the declared core dependencies are exactly those four.
"""

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = (
    "pandas",
    "matplotlib",
    "tqdm",
    "helion",
    "transformers",
    "peft",
    "IPython",
    "papermill",
    "nbformat",
)

_SCRIPT = r"""
import sys

BLOCKED = set(sys.argv[1].split(","))
for name in BLOCKED:
    sys.modules[name] = None  # `import name` raises ImportError; importlib.util.find_spec gives None

import torch
import moelora_lib
from moelora_lib import MoELoRALayer
from moelora_lib.reference import moe_lora_reference
import moelora_lib.model, moelora_lib.linear  # noqa: F401,E401
import moelora_lib.helion_linear, moelora_lib.configs  # noqa: F401,E401

torch.manual_seed(0)
T, H, I, E, K, L, R = 5, 32, 16, 4, 2, 2, 4
w13 = torch.randn(E, 2 * I, H) / H**0.5
w2 = torch.randn(E, H, I) / I**0.5
layer = MoELoRALayer(w13, w2, top_k=K, num_adapters=L, max_rank=R, max_tokens=8)
a13, b13 = torch.randn(E, 2, R, H) / H**0.5, torch.randn(E, 2, I, R) / R**0.5
a2, b2 = torch.randn(E, R, I) / I**0.5, torch.randn(E, H, R) / R**0.5
layer.load_adapter(1, gate_up=(a13, b13), down=(a2, b2))
x = torch.randn(T, H)
topk_ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
topk_weights = torch.softmax(torch.randn(T, K), dim=-1)
lora_ids = torch.tensor([1, -1, 1, 0, 1], dtype=torch.int32)
out = layer(x, topk_weights=topk_weights, topk_ids=topk_ids, lora_ids=lora_ids)

# slot 0 holds nothing: zeros in every slot but 1
la13 = torch.zeros(L, E, 2, R, H); lb13 = torch.zeros(L, E, 2, I, R)
la2 = torch.zeros(L, E, R, I); lb2 = torch.zeros(L, E, H, R)
la13[1], lb13[1], la2[1], lb2[1] = a13, b13, a2, b2
ref = moe_lora_reference(x, w13, w2, topk_weights, topk_ids, lora_ids, la13, lb13, la2, lb2)
err = (out.float() - ref).abs().max().item()
assert err < 1e-4, err
loaded = sorted(m for m in BLOCKED if sys.modules.get(m) is not None)
assert not loaded, loaded
print("ok", err)
"""


def test_declared_core_dependencies_are_the_four():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split("=")[0].split(">")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert names == {"torch", "triton", "numpy", "safetensors"}
    extras = project["optional-dependencies"]
    assert {"notebooks", "helion", "models", "dev"} <= set(extras)
    assert any(d.startswith("helion") for d in extras["helion"])
    notebooks = {d.split(">")[0].split("=")[0] for d in extras["notebooks"]}
    assert {"pandas", "matplotlib", "tqdm", "papermill"} <= notebooks


def test_import_and_a_layer_forward_with_the_extras_hidden():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, ",".join(EXTRAS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")
