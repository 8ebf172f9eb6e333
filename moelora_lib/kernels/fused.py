"""Stage ``fused`` (issue 13): the LoRA expand inside the base GEMMs, the activation in the gate_up epilogue.

What changes against ``tuned`` (same split-K shrink, grouped order, EVEN_K, no length specialization):

* **Expand fused into the base GEMM of each projection.** The gate_up program computes its tile of
  x·W13[e]ᵀ over the base (expert-only) alignment and then, in the same program and the same fp32
  accumulator, adds the rank intermediate times B13 of each row's adapter; the down program does the
  same with B2. ``h``/``y`` is written once: no expand launch, no read-modify-write of the output tile.
* **Activation in the gate_up epilogue.** Each program holds two accumulators, the gate columns and the
  up columns of the same BLOCK_SIZE_N columns j of g (silu: W13 rows j and I + j; swigluoai: rows 2j and
  2j + 1, GPT-OSS clamps, alpha 1.702, biases before the activation) and writes g [T·K, I] directly:
  no ``h`` buffer, no activation launch.
* **Rank intermediate with no length-dependent stride.** The shrink writes [T·K, S, R16] (R rounded up to
  16, :func:`~.launchers.rank_stride`) instead of [S, T·K, R]: every stride is a multiple of 16 and none
  follows the length, so only the counts (num_pairs, num_blocks) are ``do_not_specialize`` and the
  shrink's stores and the fused GEMMs' loads of the intermediate keep 16-byte vectors (the
  ``no_recompile`` regression of docs/perf_notes.md; tests/test_stage_fused.py checks the PTX).
* The shrink stays its own split-K launch (it needs all of K before any expand can start).

Launches per layer (routing and alignment aside): ``tuned`` 8 kernels — base_gate_up, gate_up_shrink,
gate_up_expand, act, base_down, down_shrink, down_expand, top-k sum — plus one memset per split-K shrink;
``fused`` 5 — gate_up_shrink, fused_gate_up, down_shrink, fused_down, top-k sum — plus the same memsets
(with PDL, third round: both before the five launches).
The base part (``base_part``) is 3 launches instead of 4 (the activation is in the GEMM).

**How rows of different adapters share one base tile (the design choice).** Base pairs are grouped by
expert (one weight stream per expert); LoRA pairs by (adapter, expert). Two ways to put both in one
program:

1. run the fused GEMM over the (adapter, expert)-sorted alignment (every tile has one adapter, one dot
   for the LoRA part). Rejected: the base weights W[e] are then streamed once per (adapter, expert)
   group instead of once per expert. At decode the base GEMM is weight-bound (GPT-OSS-20B T = 64: 256
   pairs over 32 experts from 8 adapters, up to ~6 groups per expert, so up to ~6× the 1.6 GB of weights),
   and at prefill every group is padded to BLOCK_SIZE_M separately (~8× the padding).
2. run over the base alignment and, after the K loop, gather each row's adapter id
   (``lora_ids[p // top_k]``) and loop over the adapters present in the tile (a scalar ``while`` loop:
   next id = min of the ids above the current one): for each, one dot of the rows of that adapter
   (others masked to zero in the operand, so they add exact zeros) with B[l, e]'s [R, BLOCK_SIZE_N] tile.
   **Chosen.** The weight stream and padding of the base GEMM are unchanged; the LoRA part costs one
   [BLOCK_SIZE_M, R]·[R, BLOCK_SIZE_N] dot per adapter present in the tile. Its waste: each such dot spans
   all BLOCK_SIZE_M rows, so a tile holding n adapters does n·R/K extra MMA work against the base's K
   (ideal: R/K). Decode tiles hold few rows (n ≤ rows), so the waste is nothing there; at prefill with 8
   adapters in every tile it is 8·32/2880 = 8.9 % of the GEMM's MMA work for GPT-OSS-20B (H = I = 2880),
   8·32/2048 = 12.5 % (gate_up) and 8·32/768 = 33 % (down) for Qwen3-30B-A3B. Sorting each expert's
   pairs by adapter in the base alignment (done in the second round, below) cuts n to ~1–2 per tile
   where an (adapter, expert) group fills a tile.
   Gathering B per row (a [BM, BN, R] broadcast product, no tensor cores) was the third option:
   rejected for its registers and its repeated B loads.

Rows whose adapter id is -1, or outside [0, L) (ids unchecked: the top-k sum gives them NaN rows), or
whose slot does not cover the projection (``LayerRun(proj_lora_ids=...)``, which MoELoRALayer passes)
get no LoRA term: bit-identical to the base part of this stage. Precision: the whole output row is one
fp32 accumulation (base, delta, bias; then the activation or the routing weight) rounded once, where
``tuned`` rounds h after the base GEMM, again after the expand's add, and feeds the rounded h to the
activation; the results differ from ``tuned`` by those roundings (both within the reference tolerance).

Configs: the :class:`~.config.LayerConfig` record of every stage, read through
:data:`~.stages.FUSED_CONFIG_FIELD`: ``base_gate_up`` configures the fused gate_up+activation GEMM,
``base_down`` the fused down GEMM, the two shrink fields the shrinks; the expand fields are unused. The
stage's configs (:meth:`FusedStage.config_for` -> :func:`moelora_lib.configs.load_fused_config`): the tuned
shrinks of stage ``tuned`` and the two GEMMs from ``{gpu}_FUSED_MOE_LORA_FUSED.json``, written by the fused
tuner (:mod:`moelora_lib.studies.fused_tuning`; shipped for the H200, tuned there on 2026-12-02); without
that file they are derived from the tuned base GEMMs (:func:`fused_gemm_configs`), and with no tuned file at
all (the CPU) :func:`fused_default_config` (a heuristic).

**Second round (issue 13, notebook 12 at e40cd00; the first round's numbers below are cd22587's).** Two levers
after the first GPU run: the fused GEMMs tuned, and the adapter order (:class:`~.stages.LayerRun`'s
``adapter_order``, on by default for this stage: inside each expert the base alignment orders pairs by
adapter, :func:`moelora_lib.routing.align_tokens`'s ``sort_lora_ids``, so a prefill tile holds fewer
adapters and the per-adapter loop runs fewer passes). The torch alignment builds that order; the Triton
alignments (:mod:`.align`, :mod:`.align_small`) do not have it yet, so :class:`moelora_lib.MoELoRALayer`
runs this stage over the pair order. Outcomes (notebook 12's lever paragraph; predictions in
``conclusions/nb12.LEVER_PREDICTIONS``, written before the run): the tuned GEMMs bring the base part to
0.93–1.05× ``tuned``'s; the adapter order cuts the LoRA part (whole − base) at GPT-OSS-20B T = 1600 / 8192
from 517 / 1852 µs to 328 / 666 µs, and does nothing at Qwen3-30B-A3B T = 1600, where one BLOCK_SIZE_M = 128
tile holds an expert's ~100 pairs and so all 8 adapters whatever their order. The layer is then 0.79–1.05×
``tuned`` (faster at T = 1 and 8 for GPT-OSS-20B, T = 1 for Qwen3 and GPT-OSS-20B T = 8192; slower most at
prefill, where the per-adapter loop is serial: a ``while`` loop of dependent loads and dots). ``tuned``
stays the stage to use.

**Third round (issue 13, 2026-12-03): programmatic dependent launch.** With ``pdl=True`` (Hopper,
:func:`~.launchers.pdl_supported`; off by default: only a development run of an earlier form has been
measured, docs/perf_notes.md) the layer's chain — gate_up_shrink, fused_gate_up, down_shrink, fused_down, the
top-k sum — is launched with PDL (:class:`~.stages.LayerRun`'s ``pdl``, Triton's ``launch_pdl``; the
``USE_PDL`` constexpr of the kernels):
a launch may start while the previous one drains; each program waits (``griddepcontrol.wait``) before it
reads anything the previous launch wrote or writes anything. The shrinks and the top-k sum then let the next
launch start at once (``griddepcontrol.launch_dependents``); the fused GEMMs only after their K loop: in a
development run (data/dev/12_round3_pdl, commit 96cbb12) the trigger at the start made GPT-OSS-20B's gate_up
GEMM 12 µs slower at T = 1 (42.8 → 54.8 µs of work), with the down shrink's ~3800 programs resident and
waiting through all of it. Nothing is read before the wait, the alignment entries included: the first
launch of the chain may directly follow the kernels that build the alignment (no split-K memset between
them in the deterministic mode, at T ≥ 64 with the shipped configs, in the base part or in a batch without
adapters; a version that read them before the wait ran in the development run only). Every program
waits, including those that exit early, so a launch never completes before its predecessor and the order is
transitive.
Both split-K intermediates are zeroed before the chain (no memset between two of its launches). Prediction
(written before the GPU run, ``conclusions/nb12.LEVER_PREDICTIONS``): 3–8 µs off the whole layer at T ≤ 8
(the 0.3–0.6 µs idle gaps of notebook 12's timeline and each launch's first dependent loads, over five
boundaries), ≤ 2 % from T = 64 on. The output is bit-identical with and without it.

**Fourth round (issue 13, 2026-12-03): the down GEMM split over K at decode.** ``base_down.SPLIT_K`` > 1
(this stage only; :meth:`~.stages.Stage.adapt` sets it to 1 in the others): program (tile, s) covers the
s-th share of the K blocks and adds its share times the routing weight into a zeroed fp32 ``y`` with a
relaxed atomic add (16-byte ``atom.add.v4.f32``); split 0 adds the LoRA delta and the bias; the top-k sum
(:func:`~.topk_reduce.topk_reduce`, ``out_dtype``) rounds once to the activations' dtype. The gate_up GEMM
cannot split (its activation needs all of K). Shipped for GPT-OSS-20B at T = 1 (SPLIT_K 8) and T = 8
(SPLIT_K 4), the only points where a development sweep (data/dev/12_round4_splitk) found a split variant
faster, by 2.0 and 5.7 µs of the whole layer (the loader's nearest-T lookup applies them to T = 2–4 and
5–36 too, which were not measured) (predicted ~9 µs at T = 1: docs/perf_notes.md says why it
missed). :meth:`~.config.LayerConfig.deterministic` clears it with the shrinks' split.

**Fifth round (issue 13, 2026-12-03): the LoRA epilogue with every adapter stacked; built, opt-in.** With
``LORA_CHUNK`` > 0 (:func:`~.launchers.fused_moe_lora`'s ``lora_chunk``; :class:`~.stages.LayerRun`'s or
:func:`~moelora_lib.moe_lora.make_layer_run`'s ``lora_stack=True``; :class:`~.config.LayerConfig`'s
``lora_stack``, which ``fused_moe_lora(config=...)`` takes) the epilogue does not loop over the adapters
present in the tile: the rank axis is extended to L·BLOCK_SIZE_R columns (BLOCK_SIZE_R = R rounded up to a
power of two ≥ 16; column c = rank c % BLOCK_SIZE_R of adapter c // BLOCK_SIZE_R); row p's operand holds its
intermediate in its own adapter's columns and zeros elsewhere, the B operand holds B[a, e] for the adapters
present in the tile (the others masked off: never read, so a NaN left in an unused slot cannot reach a row
through 0·NaN), and one counted loop of LORA_CHUNK-column dots replaces the ``while`` loop of dependent
load-and-dot passes. Development run (data/dev/12_lora_stack, at acf5988, of a form without the
present-adapter mask, which read every adapter's B): loop → stacked, whole layer µs, GPT-OSS-20B T = 64 491
→ 472, T = 1600 1149 → 1068, Qwen3-30B-A3B T = 256 550 → 536, T = 1600 844 → 651; slower at T ≤ 8, T = 8192,
GPT-OSS-20B T = 256 and Qwen3-30B-A3B T = 64 (predictions in docs/perf_notes.md). The shipped config chose
the stacked form at those four points for the suite run (8402a0c), where notebook 12's lever ``fused_loop``
measured the masked form 1.17–1.41× slower than the loop at all four (GPT-OSS-20B T = 64 576.5 against 491.3
µs, T = 1600 1561.3 against 1137.9; Qwen3-30B-A3B T = 256 779.2 against 553.5, T = 1600 1060.7 against
847.7). Likely cause, not measured: the mask needs a cross-row reduction (which adapters are present) inside
the chunk loop, which stops the loop's loads from being pipelined; computing that set once before the loop
(a bit mask of the present adapter ids) is the follow-up. So the loop is the default again (every H200 entry
``lora_stack`` false) and the stacked form is opt-in. Both forms assume finite adapter weights (as
:meth:`moelora_lib.MoELoRALayer.load_adapter` enforces): a NaN or Inf in the B of an adapter present in a
tile reaches that tile's other rows as 0·NaN, where stage ``tuned``'s expand, which runs over (adapter,
expert) groups, keeps it in that adapter's rows.

**Predictions (written before any GPU run; to be measured in notebook 12, H200, bf16, R = 32, 8 adapters,
tokens spread evenly, graph replay, L2 flushed).** Per-op times are ``tuned``'s from data/07_per_op.csv.

* Launches per layer 8 → 5 (memsets of split-K shrinks aside).
* Bytes of h/g/y traffic removed per layer (P = T·K pairs, bf16): the base gate_up's write of h (P·2I),
  the expand's read and write of h (2·P·2I; every pair has an adapter in this workload), the activation's
  read of h (P·2I), and the down expand's read and write of y (2·P·H): 16·P·I + 4·P·H bytes.
  GPT-OSS-20B (H = I = 2880, K = 4): T = 1 0.23 MB, T = 64 14.7 MB, T = 1600 369 MB (≈ 86 µs at 4.3 TB/s).
  Qwen3-30B-A3B (H = 2048, I = 768, K = 8): T = 1 0.16 MB, T = 64 10.5 MB, T = 1600 262 MB (≈ 61 µs).
* T = 1: launch-bound. The two expands (GPT-OSS 8.1 + 7.7 µs alone, Qwen3 7.6 + 7.3 µs) and the
  activation leave; in one graph back-to-back launches overlap partly, so the layer should drop by
  ~10–15 µs (GPT-OSS 94.4 → ~80–85 µs, Qwen3 58.2 → ~45–50 µs); the fused GEMMs' own time unchanged
  within a few µs (one extra B tile per adapter present; ≤ 4 or 8 rows per call).
* T = 64: the expands (GPT-OSS 38.3 + 23.5 µs, Qwen3 27.3 + 35.1 µs) and the activation go; the fused
  GEMMs stay weight-bound (+ the B reads the expands did): layer GPT-OSS 478 → ~420 µs, Qwen3 408 →
  ~350 µs.
* T = 1600: the expands (GPT-OSS 101.8 + 57.6 µs, Qwen3 72.6 + 91.6 µs) and the activation (~26 / ~14 µs
  of h reads and g writes) go, but the masked LoRA dots add MMA work (above): GPT-OSS +~47 µs (gate_up)
  +~27 µs (down) where compute-bound, Qwen3 +~32 µs and +~52 µs. Net: GPT-OSS 1056 → ~950 µs, Qwen3
  684 → ~600 µs. The per-adapter masked dot is the likeliest miss at prefill; sorting pairs by adapter
  within each expert is the follow-up lever.
* The shrink: vector stores restored (v4) at every T; against ``tuned``'s shrinks (whose configs already
  recovered most of the regression) a few % at T ≥ 1600, nothing at decode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..shapes import Dims
from .config import LayerConfig
from .stages import Stage, as_dims, default_config


def fused_gemm_configs(cfg: LayerConfig) -> LayerConfig:
    """Stage ``fused``'s two GEMM configs derived from a base-GEMM record (``base_gate_up``,
    ``base_down`` of ``cfg``; the other fields kept).

    * ``base_gate_up`` (the fused gate_up+activation GEMM): the base tile with BLOCK_SIZE_N halved
      (≥ 32): each program holds two accumulators (gate and up) and loads two weight tiles per K
      step, so halving N keeps registers and shared memory per program at the base GEMM's and covers
      the same 2·BLOCK_SIZE_N columns of h. At most 3 pipeline stages for the widest tiles (shared
      memory per stage is BM·BK + 2·BK·BN elements).
    * ``base_down`` (the fused down GEMM): the base tile (one accumulator, as the base GEMM).
    """
    gu = cfg.base_gate_up
    gu = replace(gu, BLOCK_SIZE_N=max(32, gu.BLOCK_SIZE_N // 2))
    if gu.BLOCK_SIZE_M >= 128:
        gu = replace(gu, NUM_STAGES=min(gu.NUM_STAGES, 3))
    return replace(cfg, base_gate_up=gu)


def fused_default_config(dims: Dims | int, *legacy: int) -> LayerConfig:
    """Default configs of stage ``fused`` (a heuristic over :func:`~.stages.default_config`, not tuned):
    the defaults' shrinks and :func:`fused_gemm_configs` of the default base tiles."""
    d = as_dims(dims, *legacy)
    return replace(fused_gemm_configs(default_config(d)), source="default:fused")


@dataclass(frozen=True)
class FusedStage(Stage):
    """A :class:`Stage` with ``fused_gemm``: four launches per layer and its own default configs."""

    def config_for(
        self, dims: Dims | int, *legacy: int, folder=None, gpu_name: str | None = None
    ) -> LayerConfig:
        """:func:`moelora_lib.configs.load_fused_config` for a call of ``dims`` (a Dims or the ints
        T, H, I, E, K, R, L, S): the tuned shrinks and the fused GEMMs' own tuned file where shipped
        (else derived from the tuned base GEMMs); :func:`fused_default_config` with no tuned file
        (the CPU). ``folder`` / ``gpu_name``: as in :meth:`TunedStage.config_for
        <moelora_lib.kernels.tuned.TunedStage.config_for>`."""
        from ..configs import load_fused_config  # lazy: configs imports kernels.config

        return load_fused_config(as_dims(dims, *legacy), folder=folder, gpu_name=gpu_name)


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
