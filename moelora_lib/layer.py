"""The serving layer: :class:`MoELoRALayer`, an ``nn.Module`` with expert weights and adapter slots.

Where :func:`moelora_lib.fused_moe_lora` validates everything and builds a
:class:`~moelora_lib.kernels.LayerRun` on each call, the module does the per-model work once:

* it owns the base weights, L adapter slots of max rank R (zeros until loaded), and buffers sized for
  ``max_tokens`` (``h``, ``g``, ``y``, the fp32 rank intermediates, the flat routing weights; the
  alignment workspaces of :func:`~moelora_lib.kernels.align.align_tokens_triton`, one per role and
  BLOCK_SIZE_M, allocated by the first call that needs them);
* its forward runs routing (if given logits), the Triton alignment and the launches of the stage with
  no host sync and no data-dependent Python branch — only shape checks and the launch config, picked
  on the host from T alone and cached per T (one :class:`~moelora_lib.kernels.LayerConfig` per distinct
  T, resolved once by ``stage.config_for`` as :func:`fused_moe_lora` picks it; with ``stage="auto"``,
  the default, the stage too is picked per T on the host, from the config files,
  :meth:`MoELoRALayer.stage_for`);
* the forward goes through the custom op ``torch.ops.moelora.moe_lora_layer`` (:mod:`moelora_lib.ops`),
  so ``torch.compile(..., fullgraph=True)`` of a model containing the layer works.

The launches are :class:`~moelora_lib.kernels.LayerRun`'s, the package's one launch plan, given the
layer's Triton alignments and preallocated buffers (its ``alignments=`` and ``buffers=``), so nothing is
aligned with torch ops or allocated there; the result equals ``fused_moe_lora`` on the same inputs bit
for bit on the CPU interpreter (tests/test_layer.py).

Adapter slots: :meth:`MoELoRALayer.load_adapter` / :meth:`~MoELoRALayer.unload_adapter`. A slot that
covers only one projection (gate_up only, down only) skips the LoRA work of the other projection for
its tokens: the layer keeps the coverage as a device tensor ``slot_covers`` [L, 2] bool and host-side
flags; when loaded slots differ in coverage, the per-projection adapter ids are computed on the device
(``where(covers[id] & id in [0, L), id, -1)``) and each projection gets its own alignment; a projection
that no loaded slot covers has no LoRA launch at all. A slot never loaded (or unloaded) is "no adapter".
``active_slots`` (host-side, set per step by ``MultiLoRAModel.restrict_slots``) narrows the slots a batch
may use: a projection that none of them covers has no LoRA launch either, and with none the forward is
the base path alone (:meth:`MoELoRALayer.lora_launches` says which launches a set of slots gets).

Per call on a GPU: routing in one launch (:mod:`moelora_lib.kernels.route`), both alignments in one
launch up to :data:`~moelora_lib.kernels.align_small.PAIR_PATH_MAX_PAIRS` pairs
(:mod:`moelora_lib.kernels.align_small`; above, three launches per alignment,
:mod:`moelora_lib.kernels.align`), then the stage's launches (seven, four for stage ``fused``) and the
top-k reduction. A CUDA graph
captures a forward whole (tests/test_layer_gpu.py); notebook 09 measures it. The only device
temporaries left are the reduced output (and, with mixed coverage, the per-projection ids); inside a
CUDA graph they come from the graph's memory pool.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref

import torch

from . import ops
from .common import (
    check_bool,
    check_finite,
    check_kernel_device,
    check_kernel_dtype,
    check_no_grad,
    check_real_scalar,
    is_finite,
    is_int,
)
from .kernels import AUTO_STAGE, GEMV_STAGE, STAGES, LayerConfig, LayerRun, Stage, check_stage_name
from .kernels.align import AlignWorkspace, align_tokens_triton, align_workspace
from .kernels.align_small import (
    PAIR_PATH_MAX_PAIRS,
    PairWorkspace,
    align_tokens_pair,
    pair_workspace,
    use_pair_path,
)
from .kernels.gemv import GEMV_MAX_PAIRS, gemv_moe_lora, gemv_scratch_numel
from .kernels.launchers import rank_stride
from .kernels.route import route_triton
from .kernels.stages import (
    W8A8_MIN_TOKENS,
    check_activation_scheme,
    config_weight_format,
    packed_config,
    resolve_activation_scheme,
)
from .moe_lora import _check_cpu_backend, _dense_views, _desc, validate_moe_lora_inputs
from .quant import check_dequantized_finite
from .quant.fp8 import FP8BlockWeight
from .quant.mxfp4 import MXFP4Weight
from .routing import check_finite_weights, check_id_values, route
from .scratch import Scratch, attach_scratch, memory_report, nbytes
from .shapes import Dims

__all__ = ["MoELoRALayer"]


class _Scratch(Scratch):
    """The per-call buffers of layers of one set of sizes: flat tensors for max_tokens·top_k pairs and
    the alignment workspaces (one per role and BLOCK_SIZE_M, allocated by the first call needing it)."""

    def __init__(self, dt, dev, max_tokens, E, H, I, K, L, R, S, fused_add, fp8_groups=None):
        super().__init__()
        P = max_tokens * K
        sizes = _scratch_sizes(dt, max_tokens, H, I, K, R, S, fused_add, fp8_groups)
        self.bufs = {name: torch.zeros(n, dtype=bdt, device=dev) for name, (n, bdt) in sizes.items()}
        self.max_num_pairs, self.E, self.device = P, E, dev

    def workspace(self, role: str, block_size_m: int, num_adapters: int) -> AlignWorkspace:
        n, E, dev = self.max_num_pairs, self.E, self.device
        return self.cached(
            (role, block_size_m), align_workspace, n, E, block_size_m, num_adapters, device=dev
        )

    def pair_workspace(self, max_num_pairs: int, E: int, bmb: int, L: int, bml: int) -> PairWorkspace:
        return self.cached(
            ("pair", bmb, bml), pair_workspace, max_num_pairs, E, bmb, L, bml, device=self.device
        )

    def workspace_tensors(self, ws) -> list[torch.Tensor]:
        if isinstance(ws, torch.Tensor):  # the split-K down GEMM's fp32 y; stage gemv's buffers
            return [ws]
        if isinstance(ws, PairWorkspace):
            return [ws.buffer]
        tables = [ws.sorted_token_ids, ws.block_expert_ids, ws.block_lora_ids, ws.num_tokens_post_padded]
        return tables + [ws.scratch]


#: Stage ``fused``'s down GEMM splits K (fp32 y, :class:`~moelora_lib.kernels.LayerConfig`'s
#: ``base_down.SPLIT_K``) only up to this many tokens in the serving layer: its fp32 y buffer
#: ([tokens·top_k, H], built on first use) is sized for them; above, the layer runs the down GEMM unsplit.
#: The shipped split configs are decode ones (T = 1 and 8).
SPLIT_DOWN_MAX_TOKENS = 64


def _scratch_sizes(
    dt, max_tokens, H, I, K, R, S, fused_add, fp8_groups=None
) -> dict[str, tuple[int, torch.dtype]]:
    """name -> (elements, dtype) of the flat scratch buffers of :class:`_Scratch` (P = max_tokens·K pairs).
    ``fp8_groups = (g13, g2)``: a layer that may run W8A8 also holds the quantized activations (``xq``,
    ``xs`` of hidden_states in groups of g13 columns; ``gq``, ``gs`` of the activation output in groups
    of g2)."""
    P = max_tokens * K
    f32 = torch.float32
    sizes = dict(
        h=(P * 2 * I, dt),
        g=(P * I, dt),
        y=(P * H, dt),
        tw=(P, f32),
        route_w=(P, f32),
        route_ids=(P, torch.int32),
        # R rounded up to 16 (= R for the usual ranks): stage fused's [P, S, R16] layout fits too
        inter13=(S * P * rank_stride(R), f32),
        inter2=(P * rank_stride(R), f32),
    )
    if not fused_add:  # stages that store the delta (fp32 for fp16: no overflow), then add it
        ddt = f32 if dt == torch.float16 else dt
        sizes.update(delta13=(P * 2 * I, ddt), delta2=(P * H, ddt))
    if fp8_groups is not None:
        g13, g2 = fp8_groups
        fp8 = torch.float8_e4m3fn
        sizes.update(
            xq=(max_tokens * H, fp8),
            xs=(max_tokens * -(-H // g13), f32),
            gq=(P * I, fp8),
            gs=(P * -(-I // g2), f32),
        )
    return sizes


def _device_total_memory(dev: torch.device) -> int | None:
    """Total bytes of ``dev``'s memory (CUDA: the GPU's; CPU: physical RAM), None when unknown."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    return None


#: Live scratches by sizes (weak: freed with the last layer using it).
_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _check_layer_dtype(dt: torch.dtype, dev: torch.device, name: str) -> None:
    """ValueError naming ``name`` unless the MoE kernels can run this dtype on this device."""
    check_kernel_dtype(dt, dev, name, _check_cpu_backend)


def _check_expert_weights(w13, w2, b13, b2) -> None:
    """w13 [E, 2I, H] and w2 [E, H, I] must agree; the message names the tensor that is wrong.

    Each weight gives its own (E, H, I). When they differ, the one whose shape is the other's
    expectation with dims 1 and 2 swapped (a transposed weight) is named; else w13 is named when the
    given biases agree with w2 and not with it; else w2 is named, its expected shape taken from w13.
    The message has the expected and the received shape and the shape the expectation comes from.
    """
    for name, t, layout in (("w13", w13, "[E, 2I, H]"), ("w2", w2, "[E, H, I]")):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be a 3-D float tensor {layout} (nn.Linear layout), got {_desc(t)}")
    e2, h2, i2 = w2.shape
    want13 = (e2, 2 * i2, h2)  # w13's shape as w2 implies it
    if tuple(w13.shape) == want13:
        return

    def msg(name, layout, want, got, other, other_shape):
        swapped = tuple(got) == (want[0], want[2], want[1])
        hint = " (dims 1 and 2 swapped: the layer takes the nn.Linear layout)" if swapped else ""
        return (
            f"{name} must have shape {layout} = {want} (E, H, I from {other} {tuple(other_shape)}), "
            f"got {tuple(got)}{hint}"
        )

    if tuple(w13.shape) == (e2, h2, 2 * i2):  # w13 transposed (w2 can't be transposed at once)
        raise ValueError(msg("w13", "[E, 2I, H]", want13, w13.shape, "w2", w2.shape))
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must have shape [E, 2I, H] with an even 2I (dim 1), got {tuple(w13.shape)}")
    e1, i1, h1 = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    want2 = (e1, h1, i1)  # w2's shape as w13 implies it
    if tuple(w2.shape) == (e1, i1, h1):  # w2 transposed
        raise ValueError(msg("w2", "[E, H, I]", want2, w2.shape, "w13", w13.shape))
    votes13 = votes2 = 0
    for b, dims in ((b13, lambda e, h, i: (e, 2 * i)), (b2, lambda e, h, i: (e, h))):
        if isinstance(b, torch.Tensor) and b.dim() == 2:
            votes13 += tuple(b.shape) == dims(e1, h1, i1)
            votes2 += tuple(b.shape) == dims(e2, h2, i2)
    if votes2 > votes13:
        raise ValueError(msg("w13", "[E, 2I, H]", want13, w13.shape, "w2 and the biases", w2.shape))
    # otherwise w13 is the reference (the first argument; the slots' shapes derive from it)
    raise ValueError(msg("w2", "[E, H, I]", want2, w2.shape, "w13", w13.shape))


def _check_expert_map(expert_map, E: int, dev: torch.device) -> tuple[torch.Tensor | None, list[int] | None]:
    """``(map, local_to_global)``: the expert_map as an int32 tensor on ``dev`` and the global id of each of
    the E local experts, or (None, None) for None. One host read of the map (at construction).

    Raises ValueError naming expert_map: not a 1-D int32/int64 tensor of at least E entries, a value
    outside [-1, E), a local id in [0, E) missing or given to two global experts."""
    if expert_map is None:
        return None, None
    if (
        not isinstance(expert_map, torch.Tensor)
        or expert_map.dim() != 1
        or expert_map.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"expert_map must be a 1-D int32/int64 tensor [E_global] (global expert id -> local id, -1 = "
            f"held elsewhere), got {_desc(expert_map)}"
        )
    m = expert_map.detach().to("cpu", torch.int64)
    if m.numel() < E:
        raise ValueError(
            f"expert_map: E_global = {m.numel()} entries, fewer than the layer's E = {E} experts"
        )
    lo, hi = int(m.min()), int(m.max())
    if lo < -1 or hi >= E:
        raise ValueError(
            f"expert_map values must be in [-1, E={E}) (local ids of w13's {E} experts, -1 = held "
            f"elsewhere), got min {lo}, max {hi}"
        )
    local = m[m >= 0]
    counts = torch.bincount(local, minlength=E)
    if not bool((counts == 1).all()):
        missing = (counts == 0).nonzero().flatten().tolist()
        repeated = (counts > 1).nonzero().flatten().tolist()
        raise ValueError(
            f"expert_map must give each local expert 0..{E - 1} exactly one global id, got local id(s) "
            f"{missing} missing and {repeated} repeated"
        )
    to_global = [0] * E
    for g, l in enumerate(m.tolist()):
        if l >= 0:
            to_global[l] = g
    return m.to(device=dev, dtype=torch.int32), to_global


def _packed_parts(w) -> dict[str, torch.Tensor]:
    """The tensors of a packed expert weight by Parameter suffix: MXFP4 ``blocks`` / ``scales``, FP8
    ``fp8`` (the float8_e4m3fn weight) / ``scale_inv``."""
    if isinstance(w, FP8BlockWeight):
        return {"fp8": w.weight, "scale_inv": w.scale_inv}
    return {"blocks": w.blocks, "scales": w.scales}


def _stage_named(name: str) -> Stage:
    """The Stage of a checked stage name ("auto" and "gemv" included; auto's fused_add is that of both
    stages it picks among)."""
    return {AUTO_STAGE.name: AUTO_STAGE, GEMV_STAGE.name: GEMV_STAGE}.get(name) or STAGES[name]


class MoELoRALayer(ops.OpLayer):
    """MoE layer (gate_up, activation, down, weighted sum over top-k) with L LoRA adapter slots.

    Computes the math contract of :mod:`moelora_lib.reference` (and :func:`moelora_lib.fused_moe_lora`)
    for the adapters loaded in its slots.

    Args:
        w13: [E, 2I, H] gate_up weights (rows [gate | up] for "silu", interleaved for "swigluoai"),
            float16/bfloat16/float32 — the layer's dtype and device (CUDA, or CPU under the Triton
            interpreter, not bfloat16 there).
        w2: [E, H, I] down weights, same dtype/device.
            Or both :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` s of those dense shapes (GPT-OSS's
            published layout: blocks uint8 [E, 2I, H/32, 16] / [E, H, I/32, 16], scales uint8
            [E, 2I, H/32] / [E, H, I/32]; H and I multiples of 32), kept packed: every stage's base
            GEMMs decode them in registers (:mod:`moelora_lib.kernels.triton_kernels`, ``W_MXFP4``) and
            compute as the dense layer with the dequantized weights in the layer's dtype does; the
            base GEMMs' BLOCK_SIZE_K is raised to 32 where a config has 16. Or both
            :class:`~moelora_lib.quant.FP8BlockWeight` s (float8_e4m3fn [E, N, K] and block scales
            ``scale_inv``, as Qwen3 FP8 checkpoints publish them; the scale block's columns a multiple
            of 16), kept in FP8: the base GEMMs scale each e4m3 tile in registers (``W_FP8``) and compute
            as the dense layer with :func:`~moelora_lib.quant.dequantize_fp8_block`'d weights in the
            layer's dtype; their BLOCK_SIZE_K is lowered to divide the scale block's columns where it
            does not. The adapters, biases and activations are of the layer's dtype (``dtype``).
            w13 and w2 (dense or the packed weights' tensors; b13 and b2 too) are kept, not copied: the
            layer aliases the caller's tensors, so the expert weights are never held twice; modifying
            them afterwards changes the layer, and its finiteness check ran at construction only
            (``load_state_dict`` writes into them as well).
        top_k: K, experts per token (1 ≤ K ≤ E).
        num_adapters: L ≥ 1 adapter slots.
        max_rank: R ≥ 1, the largest rank a slot holds.
        max_tokens: largest T a forward accepts (≥ 1); the buffers are sized for it, and must fit the
            device's total memory (ValueError naming max_tokens otherwise).
        slices: S, 2 (gate and up adapters) or 1 (one fused gate_up adapter, GPT-OSS style).
        b13: [E, 2I] or None; b2: [E, H] or None (expert biases).
        dtype: the layer's dtype with MXFP4 or FP8 weights (default bfloat16); with dense weights None or
            w13's dtype.
        activation: "silu" or "swigluoai".
        renormalize: routing from logits divides the K kept probabilities by their sum.
        stage: "auto" (default): per T, stage "gemv", "fused" or "tuned" as the config files choose for
            that T's bucket (:func:`moelora_lib.configs.load_stage_choice`: the ``"stage"`` key of the
            fused config file's leaf, the shipped H200 ones from measurements; "tuned" where no file or
            leaf records a choice, e.g. on the CPU or a GPU without shipped files); "gemv" for every T
            (:mod:`moelora_lib.kernels.gemv`; ValueError at a call above its pair limit); or a name of
            :data:`moelora_lib.kernels.STAGES` for every T. :meth:`stage_for` says which stage a T runs;
            resolved on the host once per T, so a CUDA graph captured at one T stays valid.
        config: a fixed :class:`~moelora_lib.kernels.LayerConfig` for every T (None = per T, as
            fused_moe_lora picks it).
        debug: check values in forward (topk_ids ∈ [0, E), lora_ids ∈ [-1, L), router_logits or the
            given topk_weights finite); a host sync.
        deterministic: bitwise-repeatable output (SPLIT_K = 1 on both shrinks and on stage ``fused``'s down
            GEMM, as
            :func:`moelora_lib.fused_moe_lora`'s ``deterministic``); the routing and the alignment
            kernels are deterministic already. Default False.
        activation_scheme: with FP8 weights, how the base GEMMs treat the activations: "dynamic" (W8A8,
            the published checkpoints' ``activation_scheme: "dynamic"``: hidden_states and the activation
            output quantized per token and per group of the scale block's columns at run time, one
            :func:`~moelora_lib.kernels.fp8_act.quantize_fp8_act` launch each, and FP8 × FP8 base GEMMs,
            ``A_FP8`` in :mod:`moelora_lib.kernels.triton_kernels`; the LoRA ops keep reading the
            unquantized activations; where stage "auto" would pick "gemv", "tuned" runs),
            "weight_only" (the e4m3 weight tiles scaled to the layer's dtype in registers, the activations
            unquantized) or "auto" (default: per T, "dynamic" from :attr:`W8A8_MIN_TOKENS` tokens on,
            "weight_only" below; :meth:`activation_scheme_for`). W8A8 differs from weight-only by the
            activations' rounding, at most 2^-4 relative per activation element. Dense and MXFP4
            weights run unquantized under "auto" and "weight_only"; "dynamic" with them, with stage
            "gemv", or with scale blocks whose columns are not a multiple of 32 raises ValueError naming
            activation_scheme.
        share_scratch: share the scratch buffers (``h`` [P, 2I], ``g`` [P, I], ``y`` [P, H] in the
            layer's dtype, the fp32 rank intermediates and routing weights, the alignment workspaces;
            P = max_tokens·top_k) with every other layer of the same sizes, dtype and device (default):
            a model's layers run one after another, so one copy serves them all. ``memory_report()``
            gives the bytes.
        expert_map: None (the layer holds every expert), or for expert parallelism a [E_global] int
            tensor (int32/int64, any device; kept as an int32 buffer on the layer's device) mapping each
            global expert id to its local id in [0, E) — E = w13.shape[0], the experts this layer holds —
            or to -1 for an expert held elsewhere; every local id appears exactly once
            (:func:`moelora_lib.parallel.contiguous_expert_map` builds the usual contiguous one). Routing
            then uses global ids (``router_logits`` [T, E_global], ``topk_ids`` in [0, E_global)), and a
            pair routed to an expert held elsewhere costs no work (the alignment drops it) and adds
            exactly zero to its token's row (:mod:`moelora_lib.kernels.topk_reduce`, ``skip_remote``): the
            output is this layer's share of the MoE sum, and the shares of the layers holding the other
            experts add up to the whole (:class:`moelora_lib.parallel.ExpertParallelMoELoRALayer` sums
            them over a process group). Global ids outside [0, E_global) still give NaN rows. Adapters
            are loaded with the global expert count (``load_adapter``: A/B of [E_global, ...]), the slots
            keep the local experts' rows. top_k may exceed E (not E_global). Every stage runs it (stage
            ``gemv``: such pairs do no work, its top-k sum leaves them out). Reference designs: vLLM's
            expert-parallel fused MoE (``expert_map`` global → local, -1 = not here) and its MoE LoRA with
            per-token adapter ids carried through the dispatch (vllm-project/vllm#40867).
    Raises:
        ValueError naming the argument: shapes, dtypes, devices, sizes, stage, activation, dense
        weights or biases holding NaN/inf, FP8 weights holding a NaN code or a NaN/inf scale, packed
        weights whose dequantized values are not finite in ``dtype`` (beyond float16's range, say; one
        host sync each; MXFP4: a scale byte 255). When w13 and w2 disagree, the message
        names the one that is wrong (a transposed weight is recognised; else w13 is the reference)
        with its expected shape, the received one and the other's shape.

    Parameters (frozen, in the state dict): ``w13``, ``w2``, ``b13``, ``b2``; with MXFP4 weights
    ``w13_blocks``, ``w13_scales``, ``w2_blocks``, ``w2_scales`` (uint8), with FP8 weights ``w13_fp8``,
    ``w2_fp8`` (float8_e4m3fn) and ``w13_scale_inv``, ``w2_scale_inv`` (their scale grids; the blocks
    in ``fp8_block``) instead of ``w13``/``w2`` (which are None; :meth:`expert_weights` gives the pair
    to launch with). Buffers (not in the
    state dict; runtime state): ``lora_a13`` [L, E, S, R, H], ``lora_b13`` [L, E, S, 2I/S, R],
    ``lora_a2`` [L, E, R, I], ``lora_b2`` [L, E, H, R] (zeros; scaling folded into B, ranks above the
    loaded one zero), ``slot_covers`` [L, 2] bool (gate_up, down). Build the layer on its final
    device; after ``.to()`` the private buffers are reallocated on the next call.
    """

    _op_prefix = "moe_lora_layer"

    #: Packed expert-weight formats the layer takes as ``w13`` / ``w2`` as they are ("mxfp4":
    #: :class:`~moelora_lib.quant.mxfp4.MXFP4Weight`, "fp8": :class:`~moelora_lib.quant.FP8BlockWeight`);
    #: read by
    #: :func:`moelora_lib.model.modeling.packed_expert_formats`.
    PACKED_FORMATS = ("mxfp4", "fp8")

    #: ``activation_scheme="auto"`` runs W8A8 from this many tokens on (FP8 weights; see
    #: :data:`moelora_lib.kernels.stages.W8A8_MIN_TOKENS`, the same value, for why), weight-only below.
    #: A class constant until the tuned config files record a per-shape threshold; set it on a
    #: subclass or an instance before the first forward (the choice is cached per T).
    W8A8_MIN_TOKENS: int = W8A8_MIN_TOKENS

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        top_k: int,
        num_adapters: int,
        max_rank: int,
        max_tokens: int,
        slices: int = 2,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        activation: str = "silu",
        renormalize: bool = True,
        stage: str = "auto",
        config: LayerConfig | None = None,
        debug: bool = False,
        deterministic: bool = False,
        share_scratch: bool = True,
        activation_scheme: str = "auto",
        expert_map: torch.Tensor | None = None,
    ):
        super().__init__()
        for name, v, lo in (
            ("top_k", top_k, 1),
            ("num_adapters", num_adapters, 1),
            ("max_rank", max_rank, 1),
            ("max_tokens", max_tokens, 1),
        ):
            if not is_int(v) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if slices not in (1, 2) or not is_int(slices):
            raise ValueError(f"slices must be 1 (fused gate_up) or 2 (gate, up), got {slices!r}")
        check_stage_name(stage)
        if config is not None and not isinstance(config, LayerConfig):
            raise ValueError(f"config must be a LayerConfig or None, got {type(config).__name__}")
        check_bool("deterministic", deterministic)
        packed = (w13, w2)
        w13, w2, fmt = _dense_views(w13, w2, dtype)  # packed: dense-shaped stand-ins for the checks
        check_activation_scheme(activation_scheme, packed[0], stage)
        # FP8 weights that may run W8A8: the scratch holds the quantized activations too
        fp8_groups = None
        if fmt == "fp8" and activation_scheme != "weight_only":
            fp8_groups = (packed[0].block[1], packed[1].block[1])
        _check_expert_weights(w13, w2, b13, b2)
        # finiteness, one host sync each: dense weights and the biases whatever the weights' form (packed
        # weights below, dequantized to the layer's dtype; MXFP4's NaN scale byte is refused by _dense_views)
        finite = (("w13", w13), ("w2", w2)) if fmt == "dense" else ()
        for name, t in finite + (("b13", b13), ("b2", b2)):
            if isinstance(t, torch.Tensor):
                check_finite(name, t)
        if w13.shape[1] % (2 * slices):
            raise ValueError(f"w13: 2I (dim 1) = {w13.shape[1]} must be divisible by 2·slices = {2 * slices}")
        E, two_i, H = w13.shape
        L, R, S, K = num_adapters, max_rank, slices, top_k
        dt, dev = w13.dtype, w13.device
        check_kernel_device("w13", dev)  # w2 and the rest must be on w13's device (checked below)
        what = "w13" if fmt == "dense" else f"dtype (the layer's, with {fmt.upper()} weights)"
        _check_layer_dtype(dt, dev, what)
        if fmt != "dense":  # packed: finite codes and scales, dequantized values within the layer's dtype
            for name, w in zip(("w13", "w2"), packed):
                check_dequantized_finite(name, w, dt)
        emap, local_to_global = _check_expert_map(expert_map, E, dev)
        E_global = E if emap is None else emap.shape[0]
        if K > E_global:
            what_e = (
                f"E = {E} (w13 dim 0)" if emap is None else f"E_global = {E_global} (expert_map's length)"
            )
            raise ValueError(f"top_k = {K} must be <= {what_e}")
        self._stage = _stage_named(stage)
        sizes = _scratch_sizes(dt, max_tokens, H, two_i // 2, K, R, S, self._stage.fused_add, fp8_groups)
        need = sum(n * torch.empty((), dtype=bdt).element_size() for n, bdt in sizes.values())
        total = _device_total_memory(dev)
        if total is not None and need > total:
            raise ValueError(
                f"max_tokens = {max_tokens} needs {need / 2**30:.1f} GiB of scratch buffers "
                f"(max_tokens·top_k pairs), more than the {total / 2**30:.1f} GiB of {dev}; lower max_tokens"
            )
        z = dict(dtype=dt, device=dev)
        lora_a13 = torch.zeros((L, E, S, R, H), **z)
        lora_b13 = torch.zeros((L, E, S, two_i // S, R), **z)
        lora_a2 = torch.zeros((L, E, R, two_i // 2), **z)
        lora_b2 = torch.zeros((L, E, H, R), **z)
        # all shape/dtype/device checks of the functional API, on an empty batch; without its grad check:
        # the layer freezes the weights it keeps (requires_grad=False), so a caller's tensor may require grad
        with torch.no_grad():
            validate_moe_lora_inputs(
                torch.empty((0, H), **z),
                w13,
                w2,
                torch.empty((0, min(K, E)), dtype=torch.float32, device=dev),  # K > E: expert parallelism
                torch.empty((0, min(K, E)), dtype=torch.int32, device=dev),
                torch.empty((0,), dtype=torch.int32, device=dev),
                lora_a13,
                lora_b13,
                lora_a2,
                lora_b2,
                activation,
                b13,
                b2,
                check_values=False,
                like="w13",  # the hidden_states above is a stand-in of w13's dtype and device
            )
        self.fp8_block = None  # FP8: the (bn, bk) of the scale blocks of w13 and w2
        if fmt != "dense":  # packed: w13/w2 are None, the packed tensors are the parameters
            self.register_parameter("w13", None)
            self.register_parameter("w2", None)
            for name, w in zip(("w13", "w2"), packed):
                for part, t in _packed_parts(w).items():
                    setattr(self, f"{name}_{part}", torch.nn.Parameter(t, requires_grad=False))
            if fmt == "fp8":
                self.fp8_block = (packed[0].block, packed[1].block)
        else:
            self.w13 = torch.nn.Parameter(w13, requires_grad=False)
            self.w2 = torch.nn.Parameter(w2, requires_grad=False)
        self.weight_format = fmt
        self._activation_scheme = activation_scheme  # checked above; the property checks later changes
        self._fp8_groups = fp8_groups
        self._schemes: dict[int, str] = {}
        self.b13 = None if b13 is None else torch.nn.Parameter(b13, requires_grad=False)
        self.b2 = None if b2 is None else torch.nn.Parameter(b2, requires_grad=False)
        self.register_buffer("lora_a13", lora_a13, persistent=False)
        self.register_buffer("lora_b13", lora_b13, persistent=False)
        self.register_buffer("lora_a2", lora_a2, persistent=False)
        self.register_buffer("lora_b2", lora_b2, persistent=False)
        self.register_buffer(
            "slot_covers", torch.zeros((L, 2), dtype=torch.bool, device=dev), persistent=False
        )
        self.E, self.H, self.I, self.K, self.L, self.R, self.S = E, H, two_i // 2, K, L, R, S
        #: E_global: the experts routing chooses among (E without an expert_map)
        self.num_global_experts = E_global
        self.register_buffer("expert_map", emap, persistent=False)
        #: with an expert_map: the global id of each local expert (host-side, [E] ints), else None
        self.local_to_global = local_to_global
        self.max_tokens = max_tokens
        self.activation = activation
        self.renormalize = check_bool("renormalize", renormalize)
        self.fixed_config = config
        self.debug = check_bool("debug", debug)
        self._configs: dict[int, LayerConfig] = {}
        self._stages: dict[int, Stage] = {}
        self.deterministic = deterministic  # property: validates, clears the per-T configs
        self.share_scratch = check_bool("share_scratch", share_scratch)
        self._covers: list[tuple[bool, bool]] = [(False, False)] * L  # host copy of slot_covers
        self._buffers_key = None
        self._bufs: dict[str, torch.Tensor] = {}
        self._scratch = None
        self._alloc_buffers()
        self._register_op_name()

    def extra_repr(self) -> str:
        return (
            f"E={self.E}, H={self.H}, I={self.I}, top_k={self.K}, adapters={self.L}, max_rank={self.R}, "
            f"slices={self.S}, max_tokens={self.max_tokens}, activation={self.activation!r}, "
            f"stage={self.stage.name!r}, dtype={self._ref.dtype}"
            + (f", weights={self.weight_format}" if self.weight_format != "dense" else "")
            + (f", activation_scheme={self.activation_scheme!r}" if self.weight_format == "fp8" else "")
            + (", deterministic=True" if self.deterministic else "")
            + (f", experts_global={self.num_global_experts}" if self.expert_map is not None else "")
        )

    # --- weights ----------------------------------------------------------------------------------
    @property
    def _ref(self) -> torch.Tensor:
        """The tensor whose dtype and device are the layer's: w13, or with MXFP4 weights the adapter
        slot lora_a13 (of the layer's dtype; ``.to()`` moves and casts it with the biases)."""
        return self.w13 if self.w13 is not None else self.lora_a13

    def _cast_exempt(self) -> tuple[str, ...]:
        """FP8 expert codes and scales keep their dtypes through a dtype cast (``OpLayer._apply``)."""
        return ("w13_fp8", "w2_fp8", "w13_scale_inv", "w2_scale_inv") if self.weight_format == "fp8" else ()

    def expert_weights(self) -> tuple:
        """``(w13, w2)`` as the kernels take them: the dense Parameters, or
        :class:`~moelora_lib.quant.mxfp4.MXFP4Weight` s or :class:`~moelora_lib.quant.FP8BlockWeight` s
        over the packed Parameters."""
        if self.weight_format == "fp8":
            return (
                FP8BlockWeight(self.w13_fp8, self.w13_scale_inv, self.fp8_block[0]),
                FP8BlockWeight(self.w2_fp8, self.w2_scale_inv, self.fp8_block[1]),
            )
        if self.weight_format != "mxfp4":
            return self.w13, self.w2
        return (
            MXFP4Weight(self.w13_blocks, self.w13_scales),
            MXFP4Weight(self.w2_blocks, self.w2_scales),
        )

    # --- buffers ----------------------------------------------------------------------------------
    def _scratch_key(self) -> tuple:
        return (
            self._ref.dtype,
            self._ref.device,
            self.max_tokens,
            self.E,
            self.H,
            self.I,
            self.K,
            self.L,
            self.R,
            self.S,
            self.stage.fused_add,
            self._fp8_groups,
        )

    def _alloc_buffers(self) -> None:
        """Attach the scratch (flat buffers for max_tokens·top_k pairs and the alignment workspaces).

        Layers of the same sizes, dtype and device share one :class:`_Scratch` (layers of a model run
        one after another, and nothing in the scratch outlives a forward: the output is a new tensor),
        unless built with ``share_scratch=False``. A call uses contiguous prefixes (offset 0)."""
        scratch = attach_scratch(self, _SCRATCH, self._scratch_key(), _Scratch)
        self._bufs = scratch.bufs
        self._buffers_key = (self._ref.dtype, self._ref.device)

    def _view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._bufs[name][: math.prod(shape)].view(shape)

    def _workspace(self, role: str, block_size_m: int, num_adapters: int) -> AlignWorkspace:
        return self._scratch.workspace(role, block_size_m, num_adapters)

    def memory_report(self) -> dict[str, int]:
        """Bytes the layer holds on its device, by kind.

        Returns {"weights": w13 + w2 (with MXFP4 weights: their blocks + scales; FP8: their e4m3
        weights + scale_inv) + biases,
        "adapter_slots": the four LoRA slot tensors + slot_covers, "scratch": the flat buffers +
        alignment workspaces allocated so far (shared with every layer of the same sizes, see
        ``share_scratch``), "scratch_shared_by": layers using that scratch, "per_layer": weights +
        adapter_slots (+ scratch when not shared)}. Temporaries of a forward (routing, the reduced
        output) are not held and not counted.
        """
        parts = ("blocks", "scales", "fp8", "scale_inv")
        packed = [getattr(self, f"{n}_{p}", None) for n in ("w13", "w2") for p in parts]
        weights = nbytes((self.w13, self.w2, self.b13, self.b2, *packed))
        slots = nbytes((self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2, self.slot_covers))
        return memory_report(self, weights, slots)

    def _dims(self, T: int) -> Dims:
        # (expert parallelism: top_k may exceed the local E; the config lookup takes at most E)
        # the weights' form at T picks the tuned files (MXFP4, FP8 weight-only or W8A8, dense)
        fmt = config_weight_format(self.expert_weights()[0], self.activation_scheme_for(T))
        return Dims(
            T=T, H=self.H, I=self.I, E=self.E, top_k=min(self.K, self.E), adapters=self.L, rank=self.R,
            slices=self.S, weight_format=fmt,
        )  # fmt: skip

    @property
    def activation_scheme(self) -> str:
        """How the base GEMMs treat the activations with FP8 weights ("auto", "weight_only", "dynamic"; see
        the constructor). Setting it validates the value (ValueError naming ``activation_scheme``, as at
        construction) and drops the per-T schemes, stages and configs resolved so far, so the next forward at
        every T follows it; the scratch is re-sized on the next forward when W8A8 becomes possible (a CUDA
        graph captured before keeps the form it captured)."""
        return self._activation_scheme

    @activation_scheme.setter
    def activation_scheme(self, value: str) -> None:
        w13, w2 = self.expert_weights()
        check_activation_scheme(value, w13, self.stage.name)
        self._activation_scheme = value
        w8a8 = self.weight_format == "fp8" and value != "weight_only"  # may run W8A8
        groups = (w13.block[1], w2.block[1]) if w8a8 else None
        if groups != self._fp8_groups:
            self._fp8_groups, self._buffers_key = groups, None  # the scratch holds the quantized activations
        for memo in (self._schemes, self._stages, self._configs):
            memo.clear()

    @property
    def stage(self) -> Stage:
        """The layer's stage (a :class:`~moelora_lib.kernels.stages.Stage`; ``stage.name`` is "auto",
        "gemv" or one of :data:`~moelora_lib.kernels.STAGES`). Set it by name, as at construction (or to a
        Stage object):
        ValueError naming ``stage`` for an unknown name or one the activation scheme cannot run ("gemv"
        with "dynamic"); the per-T stages and configs resolved so far are dropped, and the scratch is
        re-sized on the next forward when the new stage needs other buffers (a CUDA graph captured
        before keeps the stage it captured). A ``config`` given at construction still applies."""
        return self._stage

    @stage.setter
    def stage(self, value: str | Stage) -> None:
        if not isinstance(value, Stage):
            check_stage_name(value)
        check_activation_scheme(
            self.activation_scheme, self.expert_weights()[0], getattr(value, "name", value)
        )
        new = value if isinstance(value, Stage) else _stage_named(value)
        if new.fused_add != self._stage.fused_add:
            self._buffers_key = None  # the scratch's delta buffer depends on it
        self._stage = new
        for memo in (self._stages, self._configs):
            memo.clear()

    def activation_scheme_for(self, T: int) -> str:
        """The concrete activation scheme of a forward of T tokens, "dynamic" (W8A8) or "weight_only":
        the layer's ``activation_scheme``, with "auto" resolved by :attr:`W8A8_MIN_TOKENS`; "weight_only"
        for dense and MXFP4 weights. Host-side, once per T."""
        sc = self._schemes.get(T)
        if sc is None:
            w13 = self.expert_weights()[0]
            sc = resolve_activation_scheme(self.activation_scheme, w13, T, self.W8A8_MIN_TOKENS)
            self._schemes[T] = sc
        return sc

    def stage_for(self, T: int) -> Stage:
        """The stage the forward runs at T tokens: the layer's stage, or with ``stage="auto"`` the one
        the config files choose for T (:meth:`AutoStage.pick <moelora_lib.kernels.auto.AutoStage.pick>`;
        "tuned" where that is "gemv" and T runs W8A8, :meth:`activation_scheme_for`: the GEMVs are
        weight-only); resolved on the host once per T (a pure function of T and the layer's sizes)."""
        st = self._stages.get(T)
        if st is None:
            st = self.stage.pick(self._dims(T)) if self.stage is AUTO_STAGE else self.stage
            if st is GEMV_STAGE and self.activation_scheme_for(T) == "dynamic":  # the GEMVs are weight-only
                st = STAGES["tuned"]
            self._stages[T] = st
        return st

    def config_for(self, T: int) -> LayerConfig:
        """The config (after the adapt of :meth:`stage_for`'s stage) the forward launches at T tokens;
        resolved once per T."""
        cfg = self._configs.get(T)
        if cfg is None:
            st = self.stage_for(T)
            cfg = self.fixed_config
            if cfg is None:
                cfg = st.config_for(self._dims(T))
            cfg = st.adapt(cfg)
            # MXFP4 / FP8: K steps of whole scale blocks (W8A8: of at least 32 columns)
            cfg = packed_config(cfg, self.expert_weights()[0], self.activation_scheme_for(T))
            if self.deterministic:
                cfg = cfg.deterministic()
            if (
                st is not GEMV_STAGE and cfg.base_down.SPLIT_K > 1 and T > SPLIT_DOWN_MAX_TOKENS
            ):  # no fp32 y that large
                cfg = cfg.replace(base_down=dataclasses.replace(cfg.base_down, SPLIT_K=1))
            self._configs[T] = cfg
        return cfg

    # --- adapter slots ----------------------------------------------------------------------------
    def _check_slot(self, slot) -> int:
        if not is_int(slot) or not 0 <= slot < self.L:
            raise ValueError(f"slot must be an int in [0, num_adapters={self.L}), got {slot!r}")
        return slot

    def _check_pair(
        self, proj: str, pair, a_shape: list, b_shape: list
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Check (A, B) of one projection; ``None`` in a shape marks the rank dim. Returns (A, B, r)."""
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{proj} must be a pair (A, B) of tensors, got {type(pair).__name__}")
        a, b = pair
        letters = {"gate_up": ("[E, S, r, H]", "[E, S, 2I/S, r]"), "down": ("[E, r, I]", "[E, H, r]")}[proj]
        for what, t, want, desc in (("A", a, a_shape, letters[0]), ("B", b, b_shape, letters[1])):
            if not isinstance(t, torch.Tensor) or t.dim() != len(want):
                raise ValueError(f"{proj} {what} must be a {len(want)}-D tensor {desc}, got {_desc(t)}")
            if not t.is_floating_point():
                raise ValueError(f"{proj} {what} must be a float tensor, got dtype {t.dtype}")
            if t.device != self._ref.device:
                raise ValueError(
                    f"{proj} {what} must be on {self._ref.device} (the layer's device), got {t.device}"
                )
        for what, t, want, desc in (("A", a, a_shape, letters[0]), ("B", b, b_shape, letters[1])):
            # the dims other than the rank first: a transposed or swapped tensor is a layout error
            fixed = [(i, v) for i, v in enumerate(want) if v is not None]
            if any(t.shape[i] != v for i, v in fixed):
                want_txt = tuple("r" if v is None else v for v in want)
                raise ValueError(
                    f"{proj} {what} must have shape {desc} = {want_txt} (r = its rank), got {tuple(t.shape)}"
                )
        r = a.shape[a_shape.index(None)]
        if not 1 <= r <= self.R:
            raise ValueError(
                f"{proj} A: rank r = {r} must be in [1, max_rank R = {self.R}] "
                "(the layer's slots hold rank ≤ R)"
            )
        for what, t, want, desc in (("A", a, a_shape, letters[0]), ("B", b, b_shape, letters[1])):
            full = tuple(r if v is None else v for v in want)
            if tuple(t.shape) != full:
                raise ValueError(f"{proj} {what} must have shape {desc} = {full}, got {tuple(t.shape)}")
        return a, b, r

    def load_adapter(self, slot: int, *, gate_up=None, down=None, scaling: float = 1.0) -> None:
        """Copy an adapter into slot ``slot`` (replacing what it held), scaling folded into B.

        Args:
            slot: int in [0, L).
            gate_up: (A [E, S, r, H], B [E, S, 2I/S, r]) or None (the adapter has no gate_up LoRA).
            down: (A [E, r, I], B [E, H, r]) or None (no down LoRA). At least one of the two.
                With an ``expert_map``, E is E_global (the whole adapter, as every rank reads it from its
                folder): the slot keeps the rows of the layer's own experts.
                Any rank 1 ≤ r ≤ R per projection; the slot's ranks r..R-1 are zeroed, so the result
                is exactly that of the rank-r adapter whatever the slot held before. Float tensors on
                the layer's device; cast to the layer's dtype after the scaling is applied in fp32.
            scaling: a finite real number multiplied into B (e.g. PEFT's lora_alpha / r): a Python or
                numpy int or float, a numbers.Real or a 0-d real tensor
                (:func:`~moelora_lib.common.check_real_scalar`).
        Raises:
            ValueError naming the argument: slot out of range, neither projection given, not a pair,
            wrong rank (> R or < 1), shape, non-float dtype, other device, non-finite scaling, A or
            scaling·B not finite in the layer's dtype (e.g. beyond float16's range); what
            ``slot_guard`` raises (a MultiLoRAModel's: RuntimeError while a running generate call uses
            the slot).
        A projection the adapter lacks is skipped for this slot's tokens (no launch work), not
        multiplied by zeros. Nothing is written unless every check passes. Not for use while a
        forward captured in a CUDA graph is replaying on another stream (plain copies on the current
        stream).
        """
        slot = self._check_slot(slot)
        self._guard_slot(slot, "load_adapter")
        if gate_up is None and down is None:
            raise ValueError(
                "load_adapter: pass gate_up=(A, B) and/or down=(A, B); to clear a slot use unload_adapter"
            )
        scaling = check_real_scalar("scaling", scaling)
        E, H, I, S = self.num_global_experts, self.H, self.I, self.S
        gu = dn = None
        if gate_up is not None:
            gu = self._check_pair("gate_up", gate_up, [E, S, None, H], [E, S, 2 * I // S, None])
        if down is not None:
            dn = self._check_pair("down", down, [E, None, I], [E, H, None])
        dt = self._ref.dtype
        with torch.no_grad():
            cast = {}
            for proj, pair in (("gate_up", gu), ("down", dn)):
                if pair is None:
                    continue
                a, b, r = pair
                if self.local_to_global is not None:  # expert parallelism: keep the local experts' rows
                    idx = torch.tensor(self.local_to_global, dtype=torch.long, device=a.device)
                    a, b = a.index_select(0, idx), b.index_select(0, idx)
                a_c, b_c = a.to(dt), (b.float() * scaling).to(dt)
                for what, t in (("A", a_c), (f"B·scaling (scaling {scaling:g})", b_c)):
                    if not is_finite(t):  # one host sync per load, not per call
                        raise ValueError(
                            f"{proj} {what} is not finite in the layer's dtype {dt} (inf/NaN, or beyond its "
                            "range): the slot would make every token on it NaN"
                        )
                cast[proj] = (a_c, b_c, r)
            self._clear_slot(slot)
            if "gate_up" in cast:
                a, b, r = cast["gate_up"]
                self.lora_a13[slot, :, :, :r].copy_(a)
                self.lora_b13[slot, :, :, :, :r].copy_(b)
            if "down" in cast:
                a, b, r = cast["down"]
                self.lora_a2[slot, :, :r].copy_(a)
                self.lora_b2[slot, :, :, :r].copy_(b)
            self._set_covers(slot, gu is not None, dn is not None)

    def unload_adapter(self, slot: int) -> None:
        """Empty slot ``slot``: zero its tensors; tokens with this id then get the base MoE only.

        Raises: ValueError if slot is not an int in [0, L); what ``slot_guard`` raises (a
        MultiLoRAModel's: RuntimeError while a running generate call uses the slot)."""
        slot = self._check_slot(slot)
        self._guard_slot(slot, "unload_adapter")
        with torch.no_grad():
            self._clear_slot(slot)
            self._set_covers(slot, False, False)

    def _clear_slot(self, slot: int) -> None:
        for t in (self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2):
            t[slot].zero_()

    def _set_covers(self, slot: int, gate_up: bool, down: bool) -> None:
        self._covers[slot] = (gate_up, down)
        self.slot_covers[slot, 0] = gate_up
        self.slot_covers[slot, 1] = down

    @property
    def loaded_slots(self) -> dict[int, tuple[bool, bool]]:
        """{slot: (covers gate_up, covers down)} of the slots holding an adapter (host-side)."""
        return {i: c for i, c in enumerate(self._covers) if c[0] or c[1]}

    def lora_launches(self, slots=None) -> tuple[bool, bool]:
        """(gate_up, down): whether a forward whose :attr:`active_slots` are ``slots`` makes that
        projection's LoRA launches, i.e. an adapter loaded in one of ``slots`` (None: any slot) covers it.
        Host-side. Raises ValueError naming ``slots`` unless None or an iterable of ints in [0, L)."""
        return self._launches(None if slots is None else self._check_slot_set("slots", slots))

    def _launches(self, slots: frozenset[int] | None) -> tuple[bool, bool]:
        covers = self._covers if slots is None else [self._covers[s] for s in slots]
        return any(c[0] for c in covers), any(c[1] for c in covers)

    # --- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        lora_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The layer on T tokens, through ``torch.ops.moelora.moe_lora_layer``.

        Args:
            hidden_states: [T, H] of the layer's dtype and device, T ≤ max_tokens.
            router_logits: [T, E] float (softmax top-k routing, ``renormalize``; one Triton launch,
                :func:`moelora_lib.kernels.route.route_triton`, for K ≤ 16 and E ≤ 1024), or None when
                ``topk_weights`` [T, K] float32 and ``topk_ids`` [T, K] int32/int64 are given.
            lora_ids: [T] int32/int64, slot of each token in [-1, L); -1, or a slot with nothing loaded
                for a projection, = no adapter on it. With :attr:`active_slots` set, only the LoRA
                launches of projections one of those slots covers run (see there).
            With an ``expert_map`` the expert ids are global: router_logits [T, E_global], topk_ids in
            [0, E_global); pairs of experts held elsewhere add zero (the layer's ``expert_map``).
        Returns:
            [T, H] of the layer's dtype; [0, H] (empty) when T = 0.
        Raises:
            ValueError naming the argument for a wrong shape, dtype or device, T > max_tokens, both or
            neither routing form (a routing argument or lora_ids that is not a tensor included); with
            ``debug=True`` also for id values out of range and for NaN or inf in router_logits or
            topk_weights; hidden_states, router_logits or topk_weights requiring grad while grad mode
            is on (inference only: run under torch.no_grad() / torch.inference_mode()).
        Id values are not checked otherwise (no host sync): a token with a top-k id outside [0, E) or an
        adapter id outside [-1, L) — or NaN router logits, which route nowhere — gets a NaN output row
        (its pairs are dropped by the alignment; :mod:`moelora_lib.kernels.topk_reduce`), never values
        from another call. Inference only: the custom op has no autograd formula.
        """
        # the argument checks before the op too: a meta or otherwise foreign tensor would otherwise make
        # the dispatcher pick the op's fake (shape-only) implementation
        self._check_runs_here(self._ref.device)
        self._check_call(hidden_states, router_logits, topk_weights, topk_ids, lora_ids)
        # inference only (the custom op has no autograd formula); host-side attribute reads
        check_no_grad(
            ("hidden_states", hidden_states), ("router_logits", router_logits), ("topk_weights", topk_weights)
        )
        return ops.moe_lora_layer(
            hidden_states, router_logits, topk_weights, topk_ids, lora_ids, self.layer_name
        )

    def _gemv_forward(self, x, topk_weights, topk_ids, lora_ids, cfg, ids13, ids2) -> torch.Tensor:
        """Stage gemv's forward (:func:`~moelora_lib.kernels.gemv.gemv_moe_lora`) on the layer's fp32
        scratch (one buffer for every call of at most :data:`GEMV_MAX_PAIRS` pairs)."""
        T, K = topk_ids.shape
        if T * K > GEMV_MAX_PAIRS:
            raise ValueError(
                f"stage 'gemv' takes at most {GEMV_MAX_PAIRS} (token, k) pairs per call, got T·top_k = "
                f"{T}·{K}; use stage 'auto' (gemv at decode sizes, the tensor-core stages above)"
            )
        t_max = min(self.max_tokens, GEMV_MAX_PAIRS // K)
        n = gemv_scratch_numel(t_max, K, self.H, self.I, self.S, self.R)
        scratch = self._scratch.cached(("gemv",), torch.empty, n, dtype=torch.float32, device=x.device)
        w13, w2 = self.expert_weights()
        # the slots go along even when no projection has a launch: lora_ids are checked against L
        lora = (ids13, ids2, self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2)
        return gemv_moe_lora(
            x, w13, w2, topk_weights.contiguous(), topk_ids.contiguous(), activation=self.activation,
            config=cfg, b13=self.b13, b2=self.b2, lora_ids=lora_ids, lora=lora, scratch=scratch,
            skip_remote=self.expert_map is not None,  # expert parallelism: id -1 = held elsewhere, adds zero
        )  # fmt: skip

    def _check_call(self, x, router_logits, topk_weights, topk_ids, lora_ids) -> None:
        dt, dev = self._ref.dtype, self._ref.device
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.H:
            raise ValueError(f"hidden_states must be a tensor [T, H={self.H}], got {_desc(x)}")
        if x.dtype != dt or x.device != dev:
            raise ValueError(
                f"hidden_states must be {dt} on {dev} (the layer's), got {x.dtype} on {x.device}"
            )
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"hidden_states: T = {T} exceeds the layer's max_tokens = {self.max_tokens}")
        if (
            not isinstance(lora_ids, torch.Tensor)
            or tuple(lora_ids.shape) != (T,)
            or lora_ids.dtype not in (torch.int32, torch.int64)
            or lora_ids.device != dev
        ):
            raise ValueError(
                f"lora_ids must be an int32/int64 tensor [T={T}] on {dev}, got {_desc(lora_ids)}"
            )
        if router_logits is not None:
            if topk_weights is not None or topk_ids is not None:
                raise ValueError("pass either router_logits or topk_weights and topk_ids, not both")
            if (
                not isinstance(router_logits, torch.Tensor)
                or tuple(router_logits.shape) != (T, self.num_global_experts)
                or router_logits.device != dev
                or not router_logits.is_floating_point()
            ):
                raise ValueError(
                    f"router_logits must be a float tensor [T={T}, E={self.num_global_experts}] on {dev}, "
                    f"got {_desc(router_logits)}"
                )
            return
        if topk_weights is None or topk_ids is None:
            raise ValueError("pass router_logits, or both topk_weights and topk_ids")
        if (
            not isinstance(topk_weights, torch.Tensor)
            or tuple(topk_weights.shape) != (T, self.K)
            or topk_weights.dtype != torch.float32
            or topk_weights.device != dev
        ):
            raise ValueError(
                f"topk_weights must be a float32 tensor [T={T}, K={self.K}] on {dev}, "
                f"got {_desc(topk_weights)}"
            )
        if (
            not isinstance(topk_ids, torch.Tensor)
            or tuple(topk_ids.shape) != (T, self.K)
            or topk_ids.dtype not in (torch.int32, torch.int64)
            or topk_ids.device != dev
        ):
            raise ValueError(
                f"topk_ids must be an int32/int64 tensor [T={T}, K={self.K}] on {dev}, got {_desc(topk_ids)}"
            )

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global top-k ids [T, K] -> local int32 ids by ``expert_map``: -1 for an expert held elsewhere,
        E (out of range: the token's row is NaN) for a global id outside [0, E_global). Device ops only."""
        Eg = self.num_global_experts
        ok = (topk_ids >= 0) & (topk_ids < Eg)
        local = self.expert_map[topk_ids.clamp(0, Eg - 1).long()]
        return torch.where(ok, local, torch.full_like(local, self.E))

    def _lora_ids_for(self, lora_ids: torch.Tensor, proj: int) -> torch.Tensor:
        """lora_ids with -1 where the slot does not cover projection ``proj`` (0 gate_up, 1 down)."""
        valid = (lora_ids >= 0) & (lora_ids < self.L)
        covered = self.slot_covers[lora_ids.clamp(0, self.L - 1).long(), proj]
        return torch.where(valid & covered, lora_ids, torch.full_like(lora_ids, -1))

    def _forward_impl(self, hidden_states, router_logits, topk_weights, topk_ids, lora_ids) -> torch.Tensor:
        """The eager body of the custom op (see :meth:`forward`)."""
        self._check_call(hidden_states, router_logits, topk_weights, topk_ids, lora_ids)
        T, H, K, E, L, I, S, R = (
            hidden_states.shape[0],
            self.H,
            self.K,
            self.E,
            self.L,
            self.I,
            self.S,
            self.R,
        )
        if T == 0:
            return hidden_states.new_empty((0, H))
        if self._buffers_key != (self._ref.dtype, self._ref.device):  # built, moved (.to()) or unpickled
            _check_layer_dtype(self._ref.dtype, self._ref.device, "the layer's weights (w13, after .to())")
            self._alloc_buffers()
        Eg = self.num_global_experts
        routed = router_logits is not None and K <= 16 and Eg <= 1024
        if routed:  # one launch, into the scratch (kernels/route.py)
            topk_weights, topk_ids = route_triton(
                router_logits, K, self.renormalize, out=(self._bufs["route_w"], self._bufs["route_ids"])
            )
        elif router_logits is not None:
            topk_weights, topk_ids = route(router_logits, K, self.renormalize)
        if self.debug:
            if router_logits is not None and not bool(torch.isfinite(router_logits).all()):
                raise ValueError("router_logits contain NaN or inf (debug check): such tokens route nowhere")
            if router_logits is None:
                check_finite_weights(topk_weights)
            check_id_values(topk_ids, Eg, lora_ids, L)
        remote = self.expert_map is not None
        if remote:  # global -> local ids: -1 = held elsewhere (no work, adds zero), E = a bad id (NaN row)
            topk_ids = self._local_ids(topk_ids)
        cfg = self.config_for(T)
        st = self.stage_for(T)
        P = T * K
        # host-side coverage flags decide which LoRA launches exist (no device data is read): a projection
        # has them when an active slot covers it; how ids reach them follows the loaded slots alone, so
        # one launch sequence serves every active set with the same (do13, do2)
        do13, do2 = self._launches(self._active_slots)
        covers = self._covers
        all_both = all(c == (True, True) for c in covers)
        shared = all(c[0] == c[1] for c in covers)  # one alignment serves both projections
        bmb, bm = cfg.base_block_size_m, cfg.lora_block_size_m
        ids13 = ids2 = None
        if do13 or do2:
            if all_both:
                ids13 = ids2 = lora_ids
            elif shared:
                ids13 = ids2 = self._lora_ids_for(lora_ids, 0)
            else:
                ids13 = self._lora_ids_for(lora_ids, 0) if do13 else None
                ids2 = self._lora_ids_for(lora_ids, 1) if do2 else None
        if st is GEMV_STAGE:  # no alignment: one program per pair (kernels/gemv.py)
            return self._gemv_forward(
                hidden_states, topk_weights, topk_ids, lora_ids, cfg, ids13 if do13 else None,
                ids2 if do2 else None,
            )  # fmt: skip
        first = ids13 if do13 else ids2  # the LoRA alignment computed with the base one
        if first is not None and use_pair_path(P, E, L):
            # small T: base + first LoRA alignment in one launch (kernels/align_small.py)
            ws = self._scratch.pair_workspace(min(self.max_tokens * K, PAIR_PATH_MAX_PAIRS), E, bmb, L, bm)
            base_align, first_al = align_tokens_pair(topk_ids, E, bmb, first, L, bm, out=ws)
        else:
            base_align = align_tokens_triton(topk_ids, E, bmb, out=self._workspace("base", bmb, 0))
            first_al = None
            if first is not None:
                role = "lora13" if do13 else "lora2"
                first_al = align_tokens_triton(
                    topk_ids, E, bm, lora_ids=first, num_adapters=L, out=self._workspace(role, bm, L)
                )
        al13 = first_al if do13 else None
        al2 = None
        if do2:
            if not do13 or shared:
                al2 = first_al
            else:
                al2 = align_tokens_triton(
                    topk_ids, E, bm, lora_ids=ids2, num_adapters=L, out=self._workspace("lora2", bm, L)
                )
        bufs = {
            "h": self._view("h", (P, 2 * I)),
            "g": self._view("g", (P, I)),
            "y": self._view("y", (P, H)),
            "inter_gate_up": self._view("inter13", (S, P, R)),
            "inter_down": self._view("inter2", (1, P, R)),
        }
        if st.fused_gemm:  # stage fused: [P, S, R16] intermediates (no length-dependent stride), no h
            R16 = rank_stride(R)
            bufs["inter_gate_up"] = self._view("inter13", (P, S, R16))
            bufs["inter_down"] = self._view("inter2", (P, 1, R16))
            del bufs["h"]
            if cfg.base_down.SPLIT_K > 1:  # the split-K down GEMM's fp32 y (config_for: T ≤ the cap)
                n = min(self.max_tokens, SPLIT_DOWN_MAX_TOKENS) * K * H
                dev = self._ref.device
                y32 = self._scratch.cached(("y32",), torch.zeros, n, dtype=torch.float32, device=dev)
                bufs["y32"] = y32[: P * H].view(P, H)
        if not routed:  # the layer's own aligned fp32 copy of caller-given routing weights
            bufs["tw"] = self._view("tw", (P,))
        if not st.fused_add:
            bufs["delta_gate_up"] = self._view("delta13", (P, 2 * I))
            bufs["delta_down"] = self._view("delta2", (P, H))
        scheme = self.activation_scheme_for(T)
        if scheme == "dynamic":  # W8A8: the quantized activations (kernels/fp8_act.py)
            g13, g2 = self._fp8_groups
            bufs["xq"] = self._view("xq", (T, H))
            bufs["xs"] = self._view("xs", (T, -(-H // g13)))
            bufs["gq"] = self._view("gq", (P, I))
            bufs["gs"] = self._view("gs", (P, -(-I // g2)))
        run = LayerRun(
            st,
            hidden_states,
            *self.expert_weights(),
            topk_weights,
            topk_ids,
            lora_ids,
            self.lora_a13,
            self.lora_b13,
            self.lora_a2,
            self.lora_b2,
            activation=self.activation,
            b13=self.b13,
            b2=self.b2,
            config=cfg,
            alignments=(base_align, al13, al2),
            buffers=bufs,
            nan_on_bad_ids=True,  # ids unchecked: NaN rows, never another call's pair rows
            skip_remote=remote,  # expert parallelism: id -1 = held elsewhere, adds zero
            proj_lora_ids=(ids13, ids2),  # the ids each LoRA alignment was built from (stage fused)
            activation_scheme=scheme,
        )
        return run()
