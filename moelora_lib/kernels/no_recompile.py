"""Stage ``no_recompile`` (notebook 03): ``do_not_specialize`` on length-dependent arguments.

Triton specializes integer arguments on ``== 1`` and ``% 16 == 0``; num_pairs (T·K), the number of
alignment blocks and the rank-buffer slice stride follow the prompt length, so the naive stage
compiles a new binary for each new class of lengths (vLLM issue/PR #27445: TTFT about 10× the base
model's). Marking them ``do_not_specialize`` leaves one binary per config.
"""

from .stages import Stage

STAGE = Stage(name="no_recompile", title="+ do_not_specialize", specialize_lengths=False)
