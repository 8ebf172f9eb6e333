"""Stage ``split_k`` (notebook 04): split the K loop of the thin shrink GEMMs.

The shrink is [pairs, H]·[H, R] with R = 16–64: few output tiles and long K loops, so at decode
sizes a handful of programs stream the whole K. SPLIT_K programs each take every SPLIT_K-th
BLOCK_SIZE_K chunk and add their partial tile into a zeroed fp32 buffer with
``tl.atomic_add(sem="relaxed")`` (vLLM PRs #27291/#27818). SPLIT_K = 1 stays a plain store, bitwise
deterministic; SPLIT_K > 1 reorders fp32 additions (bounded error, see tests).
"""

from .stages import Stage

STAGE = Stage(name="split_k", title="+ split-K shrink", specialize_lengths=False, split_k=True)
