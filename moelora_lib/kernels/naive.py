"""Stage ``naive`` (notebook 02): the baseline fused_moe_lora kernels.

Shrink and expand over the (adapter, expert)-sorted pairs for gate_up and for down, fully masked
loads, no split-K, row-major program order, the expand writing a zeroed delta buffer that a
separate torch add puts into the base output. Triton's default integer specialization is kept, so
every new prompt-length class compiles new binaries (fixed in stage ``no_recompile``).
"""

from .stages import Stage

STAGE = Stage(name="naive", title="naive fused kernels", specialize_lengths=True)
