"""Tolerances and comparison helpers shared by the tests and the notebooks.

One table, per dtype, of the largest accepted ``rel_err = max|out − ref| / max|ref|`` against the
fp32 reference (:mod:`moelora_lib.reference`). The values follow the usual expectations (fp32 far
under 1e-3; tf32 near 3e-4 — Triton's default for an fp32 tl.dot on the GPU; fp16/bf16 operands
1e-3 to 1e-2) with the layer's roundings (h, the activation output, and y are stored in the input
dtype between launches, as in vLLM) and vLLM's own anchor check (every case within 9.3e-3).
The Helion linear study (:data:`moelora_lib.studies.helion_study.REL_TOL`) checks against the same table,
keyed by dtype name.
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "rel_err", "assert_close_rel"]

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 2e-3,  # 1e-6 under the interpreter; tf32 dots on a GPU reach ~1e-3
    torch.float16: 1e-2,
    torch.bfloat16: 2.5e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out − ref| / max|ref| in float64 (NaN or a shape mismatch gives inf)."""
    if out.shape != ref.shape:
        return float("inf")
    o, r = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).abs().max() / r.abs().max().clamp_min(1e-30)) if r.numel() else 0.0


def assert_close_rel(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype | None = None,
    tol: float | None = None,
    what: str = "output",
) -> float:
    """Assert rel_err(out, ref) ≤ tol (default TOLERANCES[dtype or out.dtype]); return the error."""
    tol = TOLERANCES[dtype or out.dtype] if tol is None else tol
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: rel_err {err:.3e} > tolerance {tol:.1e}"
    return err
