"""Stage ``swizzle`` (notebook 05): grouped program order (GROUP_SIZE_M) for the LoRA ops.

Programs are visited GROUP_SIZE_M M-blocks at a time down one N column (Triton matmul tutorial,
"L2 cache optimizations"; vLLM #27694 for the dense shrink), so programs running together read the
same weight tile and the same activation rows from L2. The last group may be partial.
"""

from .stages import Stage

STAGE = Stage(
    name="swizzle", title="+ grouped (swizzled) order", specialize_lengths=False, split_k=True, swizzle=True
)
