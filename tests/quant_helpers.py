"""Helpers shared by the FP8 / MXFP4 tests.

* The MoE layer tests (tests/test_fp8_moe.py, tests/test_mxfp4_moe.py, tests/test_fp8_w8a8_moe.py): the
  layer sizes, seeded weights, the base GEMM launcher's inputs and fp64 oracle, the layers with their
  adapters, the layer inputs and the fp32 reference; and their sm_90 compile reports, which run in a
  process without TRITON_INTERPRET through
  :func:`~moelora_lib.studies.compile_check.run_isolated` with the ops :data:`FP8_SM90`,
  :data:`MXFP4_SM90` and :data:`W8A8_SM90` (:func:`sm90_report` does it). That process imports this
  module as ``tests.quant_helpers``, so it imports only moelora_lib, torch, safetensors and
  ``tests.ptx_text``.
* The published-checkpoint tests (tests/test_fp8_checkpoint.py, tests/test_mxfp4_checkpoint.py): the
  model sizes and the loader call, config.json and safetensors writers (one file or two shards), the
  refused-file edits, transformers' dequantized model, and the PEFT adapters and transformers + PEFT
  reference rows (the callers pass transformers' classes in; peft is imported inside the PEFT helpers:
  the callers' tests skip without either).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from moelora_lib.kernels.config import LayerConfig, OpConfig
from moelora_lib.kernels.launchers import fused_moe_gemm
from moelora_lib.layer import MoELoRALayer
from moelora_lib.model import MultiLoRAModel, load_hf_checkpoint
from moelora_lib.quant import FP8BlockWeight, MXFP4Weight
from moelora_lib.reference import moe_lora_reference, route_reference
from moelora_lib.routing import align_tokens
from moelora_lib.testing import assert_close_rel

F32, F16 = torch.float32, torch.float16
DT_IDS = {F32: "fp32", F16: "fp16"}

# --------------------------------------------------------------------------------------------------
# MoE layers on packed weights
# --------------------------------------------------------------------------------------------------
#: the layer tests: E experts, top-k K_TOP, L adapter slots of max rank R
E, K_TOP, L, R = 4, 2, 3, 16

#: stage fused's down GEMM split over K in two programs (OpConfig(16, 32, 32) everywhere else)
SPLIT_DOWN = LayerConfig(OpConfig(16, 32, 32), OpConfig(16, 32, 32, 1, 2), *[OpConfig(16, 32, 32)] * 4)


def fp8_weight(shape, seed, block, scale=0.1, scale_dtype=torch.float32) -> FP8BlockWeight:
    """N(0, scale²) weights of ``shape`` from ``seed``, block-FP8 quantized (scales in ``scale_dtype``)."""
    g = torch.Generator().manual_seed(seed)
    w = FP8BlockWeight.quantize(torch.randn(*shape, generator=g) * scale, block)
    return FP8BlockWeight(w.weight, w.scale_inv.to(scale_dtype), w.block)


def fp8_experts(H: int, I: int, block) -> tuple[FP8BlockWeight, FP8BlockWeight]:
    """(w13 [E, 2I, H], w2 [E, H, I]) of the layer tests, block-FP8 (seeds H + I and H·I)."""
    return fp8_weight((E, 2 * I, H), seed=H + I, block=block), fp8_weight((E, H, I), seed=H * I, block=block)


def gemm_inputs(w, dt, down: bool, T: int = 9, top_k: int = 2):
    """(topk, align, x, kw, out) of a base GEMM launch on the expert weight ``w`` [E, N, K] (seed 1):
    random top-k experts for T tokens, aligned in blocks of 16; x [T, K] (gate_up: rows_div = top_k) or
    [T·top_k, K] (down: rows_div 1, a bias and routing weights in kw), in dtype dt; out [T·top_k, N]
    filled with 1234.5."""
    E, N, K = w.shape
    g = torch.Generator().manual_seed(1)
    topk = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    align = align_tokens(topk, E, 16)
    rows = T * top_k if down else T
    x = torch.randn(rows, K, generator=g).to(dt)
    kw = dict(rows_div=1 if down else top_k)
    if down:
        kw |= dict(
            bias=(torch.randn(E, N, generator=g) * 0.1).to(dt),
            topk_weights=torch.rand(T * top_k, generator=g),
        )
    out = torch.full((T * top_k, N), 1234.5, dtype=dt)
    return topk, align, x, kw, out


def gemm_reference(x64: torch.Tensor, w64: torch.Tensor, topk: torch.Tensor, kw: dict) -> torch.Tensor:
    """The base GEMM of :func:`gemm_inputs`'s launch in float64 on the operand values x64 [rows, K] and
    w64 [E, N, K]: each (token, expert) pair's row of x64 times its expert's weights, plus the bias
    and times the routing weight where kw has them (down)."""
    e = topk.reshape(-1).long()
    ref = torch.einsum("pk,pnk->pn", x64[torch.arange(e.numel()) // kw["rows_div"]], w64[e])
    if "bias" in kw:
        ref = (ref + kw["bias"].double()[e]) * kw["topk_weights"].double()[:, None]
    return ref


def assert_dense_twin(out: torch.Tensor, want: torch.Tensor, tol: float | None, what: str) -> None:
    """``out`` (packed weights) against ``want`` (the dequantized dense twin): bit for bit when ``tol``
    is None, else within the relative error ``tol``."""
    if tol is None:
        assert torch.equal(out, want), f"{what}: max diff {(out.float() - want.float()).abs().max()}"
    else:
        assert_close_rel(out, want, tol=tol, what=what)


def assert_gemm_equals_dense(
    w, dense_w: torch.Tensor, dt, cfg: OpConfig, down: bool, tol: float | None = None
) -> None:
    """The base GEMM launch of :func:`gemm_inputs` on the packed ``w`` equals the same launch on its
    dequantized ``dense_w`` bit for bit (or within the relative error ``tol``, where the packed kernels
    sum in another order), and the fp64 reference on ``w.dequantize(float32)`` within the tolerance
    table of dt."""
    topk, align, x, kw, out = gemm_inputs(w, dt, down)
    dense_out = out.clone()
    fused_moe_gemm(x, w, out, align, cfg, **kw)
    fused_moe_gemm(x, dense_w, dense_out, align, cfg, **kw)
    assert_dense_twin(out, dense_out, tol, "packed vs dequantized dense")
    assert_close_rel(out, gemm_reference(x.double(), w.dequantize(torch.float32).double(), topk, kw), dt)


def adapted_layers(w13, w2, dt, stage, act, S, bias, config=None, dense=None, **kw) -> tuple:
    """(MoELoRALayer on the packed weights w13 [E, 2I, H], w2 [E, H, I] with dtype dt,) and, given
    ``dense``, the same layer on ``dense(w13, dt)``, ``dense(w2, dt)``; both with the same biases (if
    ``bias``) and the same adapters in slots 0 (rank R) and 1 (rank 8), drawn from seed 7; slot 2 stays
    empty: its tokens get the base only. kw: more arguments of the packed layer (activation_scheme)."""
    _, H, I = w2.shape
    g = torch.Generator().manual_seed(7)
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(dt) if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).to(dt) if bias else None
    common = dict(top_k=K_TOP, num_adapters=L, max_rank=R, max_tokens=40, slices=S, b13=b13, b2=b2)
    common |= dict(activation=act, stage=stage, config=config)
    layers = [MoELoRALayer(w13, w2, dtype=dt, **common, **kw)]
    if dense is not None:
        layers.append(MoELoRALayer(dense(w13, dt), dense(w2, dt), **common))
    for slot, r in ((0, R), (1, 8)):
        gu = (
            (torch.randn(E, S, r, H, generator=g) * 0.1).to(dt),
            (torch.randn(E, S, 2 * I // S, r, generator=g) * 0.1).to(dt),
        )
        dn = (
            (torch.randn(E, r, I, generator=g) * 0.1).to(dt),
            (torch.randn(E, H, r, generator=g) * 0.1).to(dt),
        )
        for layer in layers:
            layer.load_adapter(slot, gate_up=gu, down=dn, scaling=0.5 + slot)
    return tuple(layers)


def layer_inputs(T: int, H: int, dt, seed: int):
    """(x [T, H] in dt, topk_weights float32, topk_ids int32, lora_ids): reference routing of random
    logits; lora_ids -1, 0, 1, 2 (the empty slot), -1, ..."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dt)
    tw, ti = route_reference(torch.randn(T, E, generator=g), K_TOP)
    ids = (torch.arange(T, dtype=torch.int32) % (L + 1)) - 1
    return x, tw.float(), ti.to(torch.int32), ids


def layer_reference(layer: MoELoRALayer, x, w13, w2, tw, ti, ids, act: str) -> torch.Tensor:
    """``moe_lora_reference`` of ``layer`` (its adapter slots and biases) on the weights w13, w2
    dequantized in float32."""
    return moe_lora_reference(
        x, w13.dequantize(F32), w2.dequantize(F32), tw, ti, ids, layer.lora_a13, layer.lora_b13,
        layer.lora_a2, layer.lora_b2, activation=act, b13=layer.b13, b2=layer.b2,
    )  # fmt: skip


def assert_layer_equals_dense(
    layer, dense, w13, w2, act: str, T: int, H: int, dt, tol: float | None = None
) -> None:
    """``layer`` (packed weights w13, w2) and ``dense`` (the same layer on the dequantized weights) on
    :func:`layer_inputs` (seed T): the same output bit for bit (the same kernels on the same operand
    values; or within the relative error ``tol``, where the packed kernels sum in another order), of
    dtype dt and shape [T, H], and the fp32 reference within the tolerance table of dt."""
    x, tw, ti, ids = layer_inputs(T, H, dt, seed=T)
    out = layer(x, topk_weights=tw, topk_ids=ti, lora_ids=ids)
    want = dense(x, topk_weights=tw, topk_ids=ti, lora_ids=ids)
    assert out.dtype == dt and out.shape == (T, H)
    assert_dense_twin(out, want, tol, f"T={T}: packed vs dequantized dense layer")
    assert_close_rel(out, layer_reference(layer, x, w13, w2, tw, ti, ids, act), dt)


def functional_args(layer, act: str, stage: str, T: int, H: int, dt):
    """(x, topk_weights, topk_ids, lora_ids, adapter slots, keyword arguments) of a ``fused_moe_lora``
    call like ``layer``'s forward: T tokens (seed 11) in dt, reference routing, lora_ids 0, -1, 1, 2, 0,
    1, ...; the layer's adapter slots and biases, activation ``act``, ``stage``."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(dt)
    tw, ti = route_reference(torch.randn(T, E, generator=g), K_TOP)
    ids = torch.tensor([0, -1, 1, 2, 0, 1], dtype=torch.int32)[:T]
    slots = (layer.lora_a13, layer.lora_b13, layer.lora_a2, layer.lora_b2)
    kw = dict(activation=act, b13=layer.b13, b2=layer.b2, stage=stage)
    return x, tw.float(), ti.to(torch.int32), ids, slots, kw


def split_down_outputs(layer, dense, dt):
    """(x, logits, ids, layer's output, dense's output) on 5 tokens of H = 64 (seed 5), lora_ids
    0, -1, 1, 2, 0; both layers in stage fused with :data:`SPLIT_DOWN`: the down GEMM in two K programs."""
    assert layer.config_for(5).base_down.SPLIT_K == 2
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(5, 64, generator=g).to(dt), torch.randn(5, E, generator=g)
    ids = torch.tensor([0, -1, 1, 2, 0], dtype=torch.int32)
    return x, logits, ids, layer(x, logits, lora_ids=ids), dense(x, logits, lora_ids=ids)


# --------------------------------------------------------------------------------------------------
# sm_90 compile reports of the base GEMM launches (meta tensors, no GPU)
# --------------------------------------------------------------------------------------------------
FP8_SM90 = "tests.quant_helpers:fp8_sm90_report"
MXFP4_SM90 = "tests.quant_helpers:mxfp4_sm90_report"
W8A8_SM90 = "tests.quant_helpers:w8a8_sm90_report"


def sm90_report(op: str) -> dict:
    """The report ``op`` (:data:`FP8_SM90`, ...), run in a fresh process without the interpreter."""
    from moelora_lib.studies.compile_check import run_isolated

    (r,) = run_isolated([dict(op=op)], timeout=300)
    return r


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _fp8_meta(E: int, N: int, K: int) -> FP8BlockWeight:
    """Block-FP8 expert weights [E, N, K] of block (128, 128), fp32 scales (meta)."""
    grid = (E, -(-N // 128), -(-K // 128))
    return FP8BlockWeight(_meta(E, N, K, dtype=torch.float8_e4m3fn), _meta(*grid, dtype=F32))


def _mxfp4_meta(E: int, N: int, K: int) -> MXFP4Weight:
    """MXFP4 expert weights [E, N, K] (meta)."""
    return MXFP4Weight(_meta(E, N, K // 32, 16, dtype=torch.uint8), _meta(E, N, K // 32, dtype=torch.uint8))


def _layer_run(d, T: int, packed, has_bias: bool, stage: str, config, activation: str, **kw):
    """The LayerRun of ``stage`` at T tokens of the dims ``d`` on the packed weights ``packed(E, N, K)``
    (meta tensors, no bias unless ``has_bias``)."""
    from moelora_lib.kernels import STAGES
    from moelora_lib.kernels.stages import LayerRun
    from moelora_lib.studies import compile_check as cc

    topk_ids, lora_ids = cc._routing(T, d.E, d.top_k, d.adapters)
    t = cc._layer_tensors(d, _meta, has_bias=has_bias)
    t |= dict(w13=packed(d.E, 2 * d.I, d.H), w2=packed(d.E, d.H, d.I))
    return LayerRun(
        STAGES[stage], **t, topk_weights=_meta(T, d.top_k, dtype=F32), topk_ids=topk_ids,
        lora_ids=lora_ids, activation=activation, config=config, **kw,
    )  # fmt: skip


def _base_gemm_launches(shape: str, T: int, packed, has_bias: bool, activation: str, lower):
    """(op, launch args, sm_90 kernel) of the four base GEMM launches (stage tuned's base_gate_up /
    base_down, stage fused's fused_gate_up / fused_down) at T tokens of the model ``shape`` (rank 32,
    8 adapters) on packed weights, each stage's default config through ``lower``."""
    from moelora_lib.kernels.fused import fused_default_config
    from moelora_lib.kernels.stages import default_config
    from moelora_lib.shapes import Dims, get_shape
    from moelora_lib.studies import compile_check as cc

    d = Dims.of(get_shape(shape), T, rank=32, adapters=8)
    for stage, ops, cfg in (
        ("tuned", ("base_gate_up", "base_down"), default_config(d)),
        ("fused", ("fused_gate_up", "fused_down"), fused_default_config(d)),
    ):
        run = _layer_run(d, T, packed, has_bias, stage, lower(cfg), activation)
        for op in ops:
            la = run.launch_args(op)
            yield op, la, cc._compile_launch(la)


def fp8_sm90_report(T: int = 64) -> dict:
    """{launch: {"W_FP8", "mma", "REG", "LOCAL"}} of the four base GEMM launches (stage tuned's
    base_gate_up / base_down, stage fused's fused_gate_up / fused_down) on block-FP8 weights (block
    (128, 128), fp32 scales) at qwen3-30b-a3b sizes (silu, bf16 activations, default configs lowered by
    fp8_config), compiled for sm_90. Meta tensors; run in a process without the interpreter
    (:data:`FP8_SM90`)."""
    from moelora_lib.kernels.stages import fp8_config
    from moelora_lib.studies import compile_check as cc
    from tests.ptx_text import tensor_core_ops

    out = {}
    for op, la, k in _base_gemm_launches(
        "qwen3-30b-a3b", T, _fp8_meta, False, "silu", lambda cfg: fp8_config(cfg, 128)
    ):
        ru = cc.resource_usage(k)
        tc = tensor_core_ops(cc.ptx(k))
        mma = tc["mma_sync"] + tc["wgmma"]
        out[op] = dict(W_FP8=la.constexprs["W_FP8"], mma=mma, REG=ru["REG"], LOCAL=ru["LOCAL"])
    return out


def mxfp4_sm90_report(T: int = 64) -> dict:
    """{launch: {"W_MXFP4", "mma", "ftz", "REG", "LOCAL"}} of the four base GEMM launches (stage tuned's
    base_gate_up / base_down, stage fused's fused_gate_up / fused_down) on MXFP4 weights at gpt-oss-20b
    (swigluoai, biases, bf16 activations, default configs), compiled for sm_90. Meta tensors; run in a
    process without the interpreter (:data:`MXFP4_SM90`)."""
    import re

    from moelora_lib.kernels.stages import mxfp4_config
    from moelora_lib.studies import compile_check as cc
    from tests.ptx_text import tensor_core_ops

    out = {}
    for op, la, k in _base_gemm_launches("gpt-oss-20b", T, _mxfp4_meta, True, "swigluoai", mxfp4_config):
        ptx = cc.ptx(k)
        ru = cc.resource_usage(k)
        tc = tensor_core_ops(ptx)
        out[op] = dict(
            W_MXFP4=la.constexprs["W_MXFP4"],
            mma=tc["mma_sync"] + tc["wgmma"],
            ftz=len(re.findall(r"\b(?:mul|fma|cvt)[\w.]*\.ftz\b", ptx)),
            REG=ru["REG"],
            LOCAL=ru["LOCAL"],
        )
    return out


def w8a8_sm90_report() -> dict:
    """{variant: {"A_FP8", "fp8_mma", "REG", "LOCAL", "BLOCK_SIZE_K"}} of the W8A8 base GEMM launches at
    qwen3-30b-a3b sizes (block (128, 128) FP8 weights, bf16 activations, silu, default configs through
    w8a8_config): stage tuned's base_gate_up / base_down and stage fused's fused_gate_up / fused_down at
    T = 2048, stage fused's split-K down GEMM at T = 8; and the quantization kernel ("quant", K = 2048).
    ``fp8_mma``: PTX tensor-core instructions on e4m3 operands; ``mma``: all tensor-core instructions.
    Meta tensors; run without the interpreter (:data:`W8A8_SM90`)."""
    import re

    from moelora_lib.kernels.fp8_act import _quantize_fp8_act_kernel
    from moelora_lib.kernels.fused import fused_default_config
    from moelora_lib.kernels.stages import default_config, w8a8_config
    from moelora_lib.shapes import Dims, get_shape
    from moelora_lib.studies import compile_check as cc

    def fp8_mma(ptx: str) -> int:
        return len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\S*e4m3\.e4m3", ptx))

    def mma(ptx: str) -> int:
        return len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", ptx))

    out = {}
    prefill = (
        ("tuned", "base_gate_up"),
        ("tuned", "base_down"),
        ("fused", "fused_gate_up"),
        ("fused", "fused_down"),
    )
    for T, variants in ((2048, prefill), (8, (("fused", "fused_down"),))):
        d = Dims.of(get_shape("qwen3-30b-a3b"), T, rank=32, adapters=8)
        for stage, op in variants:
            cfg = default_config(d) if stage == "tuned" else fused_default_config(d)
            if T == 8:  # the decode split of stage fused's down GEMM
                cfg = cfg.replace(base_down=OpConfig(16, 64, 128, 1, 4, 4, 3))
            run = _layer_run(
                d, T, _fp8_meta, False, stage, w8a8_config(cfg, 128), "silu", activation_scheme="dynamic"
            )
            la = run.launch_args(op)
            k = cc._compile_launch(la)
            ru = cc.resource_usage(k)
            name = op if T != 8 else f"{op}_split{la.constexprs['SPLIT_K']}"
            out[name] = dict(
                A_FP8=la.constexprs["A_FP8"], fp8_mma=fp8_mma(cc.ptx(k)), mma=mma(cc.ptx(k)), REG=ru["REG"],
                LOCAL=ru["LOCAL"], BLOCK_SIZE_K=la.constexprs["BLOCK_SIZE_K"],
                BLOCK_SIZE_M=la.constexprs["BLOCK_SIZE_M"],
            )  # fmt: skip
    T, Kd = 64, 2048
    args = (
        _meta(T, Kd),
        _meta(T, Kd, dtype=torch.uint8),
        _meta(T, Kd // 128, dtype=F32),
        T,
        Kd,
        Kd,
        1,
        Kd,
        1,
        16,
        1,
    )
    k = cc.compile_for_sm90(_quantize_fp8_act_kernel, args, dict(GROUP=128, BLOCK_G=128, BLOCK_M=32), 4, None)
    ptx = cc.ptx(k)
    ru = cc.resource_usage(k)
    out["quant"] = dict(
        div_rn=len(re.findall(r"\bdiv\.rn\.f32\b", ptx)),
        ftz=len(re.findall(r"\.ftz\b", ptx)),
        LOCAL=ru["LOCAL"],
    )
    return out


# --------------------------------------------------------------------------------------------------
# published checkpoint folders
# --------------------------------------------------------------------------------------------------
#: the MultiLoRAModel sizes the checkpoint tests load with
SIZES = dict(num_adapters=2, max_rank=4, max_batch=3, max_seq=16, max_tokens=30)


def load_model(folder, **kw) -> MultiLoRAModel:
    """load_hf_checkpoint(folder) in float32 on the CPU with :data:`SIZES` (kw overrides)."""
    kw = {"dtype": torch.float32, "device": "cpu", **SIZES, **kw}
    return load_hf_checkpoint(folder, **kw)


def write_config(folder: Path, hf_config, quant: dict, **edits) -> None:
    """folder/config.json: ``hf_config``'s dict with quantization_config ``quant``, then ``edits``."""
    d = hf_config.to_dict()
    d["quantization_config"] = dict(quant)
    d.update(edits)
    (folder / "config.json").write_text(json.dumps(d))


def write_published(
    folder: Path, tensors: dict, hf_config, quant: dict, pair: tuple[str, str], sharded=False, **edits
) -> Path:
    """A published folder: config.json (:func:`write_config`) and ``tensors`` in model.safetensors, or
    ``sharded`` over two shards with model.safetensors.index.json, the keys alternating between them so
    that some key ending in ``pair[0]`` and its partner ending in ``pair[1]`` (a weight and its scales)
    land in different shards. Model files already in ``folder`` are removed first."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    write_config(folder, hf_config, quant, **edits)
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    keys = sorted(tensors)
    weight_map = {k: names[i % 2] for i, k in enumerate(keys)}
    a, b = pair
    partner = {k: k.removesuffix(a) + b for k in keys if k.endswith(a) and k.removesuffix(a) + b in tensors}
    assert any(weight_map[k] != weight_map[p] for k, p in partner.items())
    for n in names:
        save_file(
            {k: tensors[k] for k in keys if weight_map[k] == n}, str(folder / n), metadata={"format": "pt"}
        )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def hf_from_pretrained(cls, folder: Path, quantization_config):
    """transformers' model class ``cls`` from ``folder`` in fp32 with ``quantization_config`` (its
    dequantizing config), in eval mode; transformers' warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(
            str(folder), quantization_config=quantization_config, dtype=torch.float32
        ).eval()


def save_dequantized_declaring(model, folder: Path, quant: dict) -> Path:
    """transformers' dequantized ``model`` saved to ``folder`` (save_pretrained drops its
    quantization_config), then given ``quant`` back in config.json: dense weights that declare a
    quantization."""
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg  # transformers drops it when it saves dequantized weights
    cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# refused-file edits of a published folder's tensors (a dict key -> tensor, edited in place)
def drop_keys(*keys) -> Callable[[dict], None]:
    def edit(t):
        for k in keys:
            del t[k]

    return edit


def replace_key(key, fn) -> Callable[[dict], None]:
    def edit(t):
        t[key] = fn(t[key])

    return edit


def add_key(key, value) -> Callable[[dict], None]:
    def edit(t):
        t[key] = value

    return edit


def save_peft_adapters(base: Callable, adapters: dict, root: Path) -> dict[str, Path]:
    """name -> folder of a PEFT adapter per ``adapters`` entry (name -> LoraConfig kwargs, random
    weights from seed 200 + its index) made on the transformers model ``base()``, saved under root."""
    import peft

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, kw) in enumerate(adapters.items()):
            torch.manual_seed(200 + i)
            pm = peft.get_peft_model(base(), peft.LoraConfig(init_lora_weights=False, **kw))
            pm.save_pretrained(str(root / name))
            out[name] = root / name
    return out


def peft_reference_rows(base: Callable, base_model, folders: Sequence[Path], ids, lora_ids) -> list:
    """transformers + PEFT logits ([S, V] fp32) of each row of ``ids`` alone: a fresh ``base()`` with the
    PEFT adapter ``folders[slot]`` for its slot, none for -1. Checks that the adapters change the rows
    that have one (against ``base_model`` on those rows)."""
    import peft

    refs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row, slot in enumerate(lora_ids):
            ref = base()
            if slot >= 0:
                ref = peft.PeftModel.from_pretrained(ref, str(folders[slot])).eval()
            refs.append(ref(input_ids=ids[row : row + 1]).logits[0].float())
        rows = [row for row, slot in enumerate(lora_ids) if slot >= 0]
        plain = base_model(input_ids=ids[rows]).logits.float()
    assert not any(torch.allclose(refs[row], p, atol=1e-2) for row, p in zip(rows, plain))
    return refs
