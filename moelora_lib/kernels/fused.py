"""Stage ``fused``: the LoRA expand inside each base GEMM, the activation in the gate_up epilogue.

Same shrinks as ``tuned`` (split-K, grouped order, EVEN_K, no length specialization). Launches per
layer, routing and alignment aside: gate_up_shrink, fused_gate_up, down_shrink, fused_down, top-k sum
(``tuned``: 8), plus one memset per split-K launch.

* **Expand in the base GEMM.** A program computes its tile of x·W[e]ᵀ over the base (expert-only)
  alignment; after the K loop it reads each row's adapter id (``lora_ids[p // top_k]``) and, for each
  adapter present in the tile (a ``while`` loop over the ids in ascending order), runs one
  [BLOCK_SIZE_M, R]·[R, BLOCK_SIZE_N] dot of that adapter's intermediate rows (others masked to zero)
  with B[l, e] into the same fp32 accumulator and keeps its result for that adapter's rows only (a
  select: the other rows keep their accumulator). ``g``/``y`` is written once: no expand launch, no
  read-modify-write.
  Why the base alignment and not the (adapter, expert) one: the base GEMM streams each expert's
  weights once, where an (adapter, expert) order would stream them once per group and pad every group
  to BLOCK_SIZE_M. The cost is one LoRA dot per adapter present in a tile, so the base alignment orders
  each expert's pairs by adapter (:class:`~.stages.LayerRun`'s ``adapter_order``, on by default here).
* **Activation in the gate_up epilogue.** Two accumulators, the gate and the up columns of the same
  BLOCK_SIZE_N columns j of g (silu: W13 rows j and I + j; swigluoai: rows 2j and 2j + 1, GPT-OSS
  clamp 7.0 and alpha 1.702, biases before the activation); writes g [T·K, I]: no ``h`` buffer, no
  activation launch.
* **Rank intermediate [T·K, S, R16]** (R rounded up to 16, :func:`~.launchers.rank_stride`): no stride
  follows the length, so only the counts are ``do_not_specialize`` and the shrink's stores and the
  GEMMs' loads keep 16-byte vectors (tests/test_stage_fused.py checks the PTX).
* **Down GEMM split over K** (``base_down.SPLIT_K`` > 1, this stage only; :meth:`~.stages.Stage.adapt`
  clears it elsewhere): program (tile, s) adds its share of the K blocks times the routing weight into a
  zeroed fp32 ``y`` with relaxed atomics; split 0 adds the LoRA delta and the bias; the top-k sum rounds
  once. The gate_up GEMM cannot split (its activation needs all of K).
  :meth:`~.config.LayerConfig.deterministic` clears the split with the shrinks'.

Rows whose adapter id is -1, outside [0, L), or whose slot does not cover the projection
(``LayerRun(proj_lora_ids=...)``) get no LoRA term: bit-identical to this stage's base part. A row
reads no value of another adapter's weights: an inf or NaN in one slot's A or B gives non-finite rows
of that slot only (as in every stage and in the reference), never rows of other slots or rows without
an adapter that share its tiles, because each adapter's dot result is selected into its own rows
rather than added to all rows with the others' operand zeroed (0·NaN = NaN). Precision: the whole output row
is one fp32 accumulation (base, delta, bias, then the activation or the routing weight) rounded once;
``tuned`` rounds h after the base GEMM and after the expand's add, so the two stages differ by those
roundings (both within the reference tolerance).

Configs (:data:`~.stages.FUSED_CONFIG_FIELD`): ``base_gate_up`` configures the fused gate_up GEMM,
``base_down`` the fused down GEMM, the shrink fields the shrinks; the expand fields are unused.
:meth:`FusedStage.config_for` -> :func:`moelora_lib.configs.load_fused_config`: the tuned shrinks of
stage ``tuned`` and the GEMMs of ``{gpu}_FUSED_MOE_LORA_FUSED.json`` (written by
:mod:`moelora_lib.studies.fused_tuning`), else derived from the tuned base GEMMs
(:func:`fused_gemm_configs`), else :func:`fused_default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..configs.defaults import fused_default_config, fused_gemm_configs
from ..shapes import Dims
from .config import LayerConfig
from .stages import Stage


@dataclass(frozen=True)
class FusedStage(Stage):
    """A :class:`Stage` with ``fused_gemm``: four launches per layer and its own default configs."""

    def config_for(self, dims: Dims, folder=None, gpu_name: str | None = None) -> LayerConfig:
        """:func:`moelora_lib.configs.load_fused_config` for a call of ``dims``: the tuned shrinks and
        the fused GEMMs' own tuned file where shipped (else derived from the tuned base GEMMs);
        :func:`fused_default_config` with no tuned file (the CPU). ``folder`` / ``gpu_name``: as in
        :meth:`TunedStage.config_for <moelora_lib.kernels.tuned.TunedStage.config_for>`."""
        from ..configs import load_fused_config  # lazy: loaded on the first config lookup

        return load_fused_config(dims, folder=folder, gpu_name=gpu_name)


STAGE = FusedStage(
    name="fused",
    title="+ expand and activation fused into the base GEMMs",
    specialize_lengths=False,
    split_k=True,
    swizzle=True,
    even_k=True,
    fused_add=True,
    fused_gemm=True,
)

__all__ = ["STAGE", "FusedStage", "fused_default_config", "fused_gemm_configs"]
