"""Stage ``even_k_fused_add`` (notebook 06): unmasked K loops and the LoRA add fused into expand.

* EVEN_K: when K % (BLOCK_SIZE_K·SPLIT_K) == 0 the K loop loads without masks (padding rows and
  rank columns past R are clamped into range instead and never stored); else the masked path.
* Fused add: expand loads the output tile it writes (the base gate_up output, or the weighted base
  down output), adds the delta in fp32 and stores once: no delta buffer, no zero-fill, no add
  kernel (vLLM PR #32774).
"""

from .stages import Stage

STAGE = Stage(
    name="even_k_fused_add",
    title="+ EVEN_K, fused add",
    specialize_lengths=False,
    split_k=True,
    swizzle=True,
    even_k=True,
    fused_add=True,
)
