"""Dense-model linear shapes for the Helion linear backend (weights in nn.Linear layout [N, K]).

Values from each model's published ``config.json``: Llama-3.1-8B (hidden 4096, intermediate 14336,
32 q / 8 kv heads of 128), Qwen3-32B (hidden 5120, intermediate 25600, 64 q / 8 kv heads of 128;
its attention width 64·128 = 8192 differs from hidden), Llama-3.3-70B (hidden 8192, intermediate
28672, 64 q / 8 kv heads of 128).

Projections per model, as (K, N) with the weight [N, K]:
  qkv      K = hidden,         N = (q_heads + 2·kv_heads)·head_dim
  o        K = q_heads·head_dim, N = hidden
  gate_up  K = hidden,         N = 2·intermediate  (merged [gate | up]; SwiGLU output is [M, I])
  down     K = intermediate,   N = hidden
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DenseModel", "LINEAR_MODELS", "linear_shapes"]


@dataclass(frozen=True)
class DenseModel:
    """One dense transformer's linear-layer dimensions."""

    name: str
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int = 128

    def projections(self) -> dict[str, tuple[int, int]]:
        """``{"qkv" | "o" | "gate_up" | "down": (K, N)}`` (weight [N, K])."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return {
            "qkv": (self.hidden, q + 2 * kv),
            "o": (q, self.hidden),
            "gate_up": (self.hidden, 2 * self.intermediate),
            "down": (self.intermediate, self.hidden),
        }


LINEAR_MODELS: dict[str, DenseModel] = {
    "llama3-8b": DenseModel("llama3-8b", hidden=4096, intermediate=14336, q_heads=32, kv_heads=8),
    "qwen3-32b": DenseModel("qwen3-32b", hidden=5120, intermediate=25600, q_heads=64, kv_heads=8),
    "llama3-70b": DenseModel("llama3-70b", hidden=8192, intermediate=28672, q_heads=64, kv_heads=8),
}


def linear_shapes(models: list[str] | tuple[str, ...]) -> list[tuple[str, str, int, int]]:
    """``[(model, projection, K, N), ...]`` for the named models; ValueError for an unknown name."""
    out = []
    for name in models:
        if name not in LINEAR_MODELS:
            raise ValueError(f"unknown model {name!r}; known: {sorted(LINEAR_MODELS)}")
        for proj, (k, n) in LINEAR_MODELS[name].projections().items():
            out.append((name, proj, k, n))
    return out
