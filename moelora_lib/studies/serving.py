"""Notebook 09's measurements of the serving layer (rows for ``data/09_*.csv``): alignment, eager host
overhead, the whole layer in one CUDA graph, compiled variants, memory.

``stage`` is a name of :data:`~moelora_lib.kernels.STAGES` or ``"auto"`` (default ``tuned``); a bad name
is a ValueError. On the CPU rows say ``mode = "cpu-interpreter"``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..common import MisalignedCopyWarning
from ..kernels import STAGES, check_stage_name, stage_named
from ..kernels.align import align_tokens_triton, align_workspace
from ..kernels.align_small import MAX_GROUPS, SMALL_MAX_PAIRS, align_tokens_pair, pair_workspace
from ..kernels.id_bounds import id_bounds_triton
from ..kernels.route import route_triton
from ..layer import MoELoRALayer
from ..moe_lora import _device_alignments, fused_moe_lora, make_layer_run, validate_moe_lora_inputs
from ..routing import Alignment, align_tokens, id_value_bounds
from ..shapes import Dims, MoEShape, get_shape
from ..workloads import MoELoRAInputs
from . import bench
from .moe_bench import layer_inputs, log_spaced_lengths

#: The two MoE models of the serving-layer targets, and the token counts of the anchor table.
SHAPES = ("gpt-oss-20b", "qwen3-30b-a3b")
TOKENS = (1, 8, 64, 256, 1600, 8192)


def alignments_equal(a: Alignment, b: Alignment) -> bool:
    """True when two alignments are bit-identical (ids, block ids, padded length, sizes)."""
    fields = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")
    same = (a.block_size_m, a.num_pairs) == (b.block_size_m, b.num_pairs)
    return same and all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()) for f in fields)


def _shape(shape: MoEShape | str) -> MoEShape:
    return shape if isinstance(shape, MoEShape) else get_shape(shape)


#: do_bench's budgets (ms) unless a caller passes its own (notebook 09: its WARMUP_MS / REP_MS).
WARMUP_MS, REP_MS = 25, 100


def _row(shape: MoEShape, T: int, tm: bench.Timing, **fields) -> dict[str, Any]:
    us = dict(us_p50=tm.ms_p50 * 1e3, us_p20=tm.ms_p20 * 1e3, us_p80=tm.ms_p80 * 1e3)
    return bench.result_row(model=shape.name, T=T, mode=tm.mode, **us, **fields)


def align_rows(
    shape: MoEShape | str, T: int, *, device="cuda", adapters: int = 8, rank: int = 32, seed: int = 0,
    weights: MoELoRAInputs | None = None, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
) -> list[dict[str, Any]]:  # fmt: skip
    """Base + LoRA alignment of one layer call at T tokens, one row per impl (``torch``, ``triton``,
    ``triton_one_launch`` up to ``SMALL_MAX_PAIRS`` pairs) with us_p50 and identical (bit-equal to torch).
    ``weights``: ``layer_inputs``' result."""
    sh = _shape(shape)
    inp = layer_inputs(sh, T, rank=rank, num_adapters=adapters, device=device, seed=seed, weights=weights)
    ti, li, E, K, L = inp.topk_ids, inp.lora_ids, sh.experts, sh.top_k, adapters
    cfg = STAGES["tuned"].adapt(STAGES["tuned"].config_for(Dims.of(sh, T, rank=rank, adapters=adapters)))
    bmb, bml, N = cfg.base_block_size_m, cfg.lora_block_size_m, T * K
    ws_b, ws_l = align_workspace(N, E, bmb, 0, device=device), align_workspace(N, E, bml, L, device=device)
    impls = {
        "torch": lambda: (
            align_tokens(ti, E, bmb, check_values=False),
            align_tokens(ti, E, bml, lora_ids=li, num_adapters=L, check_values=False),
        ),
        "triton": lambda: (
            align_tokens_triton(ti, E, bmb, out=ws_b),
            align_tokens_triton(ti, E, bml, lora_ids=li, num_adapters=L, out=ws_l),
        ),
    }
    if N <= SMALL_MAX_PAIRS and (L + 1) * E <= MAX_GROUPS:
        ws_p = pair_workspace(N, E, bmb, L, bml, device=device)
        impls["triton_one_launch"] = lambda: align_tokens_pair(ti, E, bmb, li, L, bml, out=ws_p)
    ref, rows = impls["torch"](), []
    for name, fn in impls.items():
        same = all(alignments_equal(r, g) for r, g in zip(ref, fn()))
        tm = bench.time_fn(fn, "graph", device, warmup_ms, rep_ms)
        rows.append(_row(sh, T, tm, impl=name, E=E, K=K, L=L, bm_base=bmb, bm_lora=bml, identical=same))
    return rows


def build_layer(
    inp: MoELoRAInputs, shape: MoEShape | str, *, max_tokens: int, stage: str = "tuned", **kw
) -> MoELoRALayer:
    """A MoELoRALayer over ``inp``'s weights (no copy), its L adapters in slots 0..L-1 (scaling 1.0), in
    ``stage``."""
    L, S, R = inp.lora_a13.shape[0], inp.lora_a13.shape[2], inp.lora_a13.shape[3]
    layer = MoELoRALayer(
        inp.w13, inp.w2, top_k=inp.topk_ids.shape[1], num_adapters=L, max_rank=R, max_tokens=max_tokens,
        slices=S, b13=inp.b13, b2=inp.b2, activation=inp.activation, renormalize=_shape(shape).renormalize,
        stage=stage, **kw,
    )  # fmt: skip
    for slot in range(L):
        gate_up, down = (inp.lora_a13[slot], inp.lora_b13[slot]), (inp.lora_a2[slot], inp.lora_b2[slot])
        layer.load_adapter(slot, gate_up=gate_up, down=down)
    return layer


def wall_us(fn: Callable[[], Any], device, *, reps: int = 200, warmup: int = 10) -> tuple[float, float]:
    """(median wall µs of one call incl. the synchronize after it, median µs until it returns), each from an
    idle GPU."""
    for _ in range(warmup):
        fn()
    wall, host = [], []
    for _ in range(reps):
        bench.sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        bench.sync(device)
        wall.append((time.perf_counter() - t0) * 1e6)
        host.append((t1 - t0) * 1e6)
    return statistics.median(wall), statistics.median(host)


def eager_rows(
    shape: MoEShape | str, T: int, inp: MoELoRAInputs, layer: MoELoRALayer, *, device="cuda",
    stage: str = "tuned", reps: int = 200, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
) -> list[dict[str, Any]]:  # fmt: skip
    """Eager wall time at T tokens beside the kernels' GPU time: rows (``what``) ``public``, ``module_topk``,
    ``module_logits`` with wall_us and host_us; ``public_kernels``, ``module_kernels``, ``layer_kernels`` with
    gpu_us."""
    check_stage_name(stage)
    sh = _shape(shape)
    x, tw, ti, li, lg = inp.hidden_states, inp.topk_weights, inp.topk_ids, inp.lora_ids, inp.router_logits
    calls = {
        "public": lambda: fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage),
        "module_topk": lambda: layer(x, topk_weights=tw, topk_ids=ti, lora_ids=li),
        "module_logits": lambda: layer(x, lg, lora_ids=li),
    }
    on_gpu = torch.device(device).type == "cuda"
    mode, rows = "eager" if on_gpu else "cpu-interpreter", []
    for what, fn in calls.items():
        w, h = wall_us(fn, device, reps=reps) if on_gpu else wall_us(fn, device, reps=1, warmup=1)
        rows.append(bench.result_row(model=sh.name, T=T, what=what, mode=mode, wall_us=w, host_us=h))
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, check_values=False)
    bounds = id_bounds_triton if on_gpu else id_value_bounds

    def public_kernels():  # what the public call launches, without its host sync and value check
        bounds(ti, li)
        return make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, check_values=False)()

    kernels = dict(public_kernels=public_kernels, module_kernels=calls["module_logits"], layer_kernels=run)
    for what, fn in kernels.items():
        tm = bench.time_fn(fn, "graph", device, warmup_ms, rep_ms, flush_l2=False)
        rows.append(bench.result_row(model=sh.name, T=T, what=what, mode=tm.mode, gpu_us=tm.ms_p50 * 1e3))
    return rows


def host_breakdown_rows(
    shape: MoEShape | str, T: int, inp: MoELoRAInputs, *, device="cuda", stage: str = "tuned", reps: int = 100
) -> list[dict[str, Any]]:
    """Host µs (median, GPU idle before each) of each step of one public call, one by one per launch
    (``launch.*``), and the floors ``floor.triton_launch`` and ``floor.torch_op``."""
    from ..kernels import LayerRun

    check_stage_name(stage)
    sh = _shape(shape)
    L = inp.lora_a13.shape[0]
    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, check_values=False)
    dims = run.dims  # the call's sizes and its experts' form (the config files of packed experts)
    st, cuda = stage_named(stage, dims), torch.device(device).type == "cuda"
    cfg = st.adapt(raw_cfg := st.config_for(dims))
    bounds = id_bounds_triton if cuda else id_value_bounds
    pinned = torch.empty(4, dtype=torch.int64, pin_memory=cuda)
    al = (run.base_align, run.lora_align, run.lora_align_down)
    steps = {
        "validate": lambda: validate_moe_lora_inputs(*inp.args(), inp.activation, inp.b13, inp.b2, False),
        "config": lambda: stage_named(stage, dims).config_for(dims),
        "id_bounds": lambda: pinned.copy_(bounds(inp.topk_ids, inp.lora_ids), non_blocking=True),
        "alignments": lambda: _device_alignments(st, raw_cfg, inp.topk_ids, inp.lora_ids, sh.experts, L),
        "layer_run": lambda: LayerRun(st, *inp.args(), **inp.kwargs(), config=cfg, alignments=al),
        "launches": run,
    }
    if st.fused_gemm:  # stage fused: its four launches one by one (op_fn), then the top-k sum
        steps |= {f"launch.{op}": run.op_fn(op) for op in st.launch_ops}
        steps["launch.reduce"] = run.reduce
    else:
        ops = ("base_gate_up", "lora_gate_up", "act", "base_down", "lora_down", "reduce")
        steps |= {f"launch.{op}": getattr(run, op) for op in ops}
    steps["floor.triton_launch"] = lambda: id_bounds_triton(inp.topk_ids, None)
    steps["floor.torch_op"] = lambda: inp.topk_weights.sum()
    host = {what: wall_us(fn, device, reps=reps if cuda else 1, warmup=1)[1] for what, fn in steps.items()}
    return [bench.result_row(model=sh.name, T=T, step=what, host_us=us) for what, us in host.items()]


def _short_path(file: str) -> str:
    """``file`` without the machine's prefix."""
    if file.startswith(("~", "<")):
        return file
    for marker, keep in (("site-packages/", ""), ("dist-packages/", ""), ("moelora_lib/", "moelora_lib/")):
        if marker in file:
            return keep + file.rpartition(marker)[2]
    return "python/" + file.replace("\\", "/").rsplit("/", 1)[-1]


def host_profile_rows(
    shape: MoEShape | str, T: int, fn: Callable[[], Any], *, what: str, device="cuda", calls=50, top=20
) -> list[dict[str, Any]]:
    """``cProfile`` over ``calls`` calls of ``fn``: the ``top`` functions by own time (µs per call), cumtime,
    file, line."""
    import cProfile
    import pstats

    sh = _shape(shape)
    for _ in range(3):
        fn()
    bench.sync(device)
    with cProfile.Profile() as prof:
        for _ in range(calls):
            fn()
        bench.sync(device)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    items = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        bench.result_row(model=sh.name, T=T, what=what, function=name, file=_short_path(file), line=line,
                         calls_per_call=n / calls, tottime_us=tt / calls * 1e6, cumtime_us=ct / calls * 1e6)
        for (file, line, name), (_, n, tt, ct, _) in items
    ]  # fmt: skip


def graph_rows(
    shape: MoEShape | str, T: int, inp: MoELoRAInputs, layer: MoELoRALayer, *, device="cuda", stage="tuned",
    warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
) -> list[dict[str, Any]]:  # fmt: skip
    """The whole layer in one CUDA graph at T tokens, rows (``what``) ``layer_kernels``, ``module_topk``,
    ``module_logits`` with ``max_abs_diff`` against the public call."""
    check_stage_name(stage)
    sh = _shape(shape)
    x, tw, ti, li, lg = inp.hidden_states, inp.topk_weights, inp.topk_ids, inp.lora_ids, inp.router_logits
    ref = fused_moe_lora(*inp.args(), **inp.kwargs(), stage=stage)
    rw, ri = route_triton(lg, ti.shape[1], sh.renormalize)
    ref_logits = fused_moe_lora(x, inp.w13, inp.w2, rw, ri, *inp.args()[5:], **inp.kwargs(), stage=stage)
    fns = {
        "layer_kernels": make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, check_values=False),
        "module_topk": lambda: layer(x, topk_weights=tw, topk_ids=ti, lora_ids=li),
        "module_logits": lambda: layer(x, lg, lora_ids=li),
    }
    refs = {"layer_kernels": ref, "module_topk": ref, "module_logits": ref_logits}
    rows = []
    for what, fn in fns.items():
        diff = (fn().float() - refs[what].float()).abs().max().item() if T else 0.0
        tm = bench.time_fn(fn, "graph", device, warmup_ms, rep_ms)
        rows.append(_row(sh, T, tm, what=what, max_abs_diff=diff))
    return rows


def jit_cache_sizes(device: int | None = None) -> dict[str, int]:
    """Compiled binaries per jitted kernel a layer call may launch; all 0 without CUDA."""
    import importlib

    from ..kernels.triton_kernels import KERNELS

    jits = {name: flav[False] for name, flav in KERNELS.items()}
    for mod_name in ("align", "align_small", "route", "id_bounds", "topk_reduce"):
        mod = importlib.import_module(f"moelora_lib.kernels.{mod_name}")
        for name, obj in ((n, getattr(mod, n)) for n in dir(mod)):
            if hasattr(obj, "device_caches") or type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
                jits[f"{mod_name}.{name.strip('_')}"] = obj
    if not torch.cuda.is_available():
        return dict.fromkeys(jits, 0)
    dev = torch.cuda.current_device() if device is None else device
    caches = {name: getattr(k, "device_caches", None) or {} for name, k in jits.items()}
    return {name: len(c[dev][0]) if dev in c else 0 for name, c in caches.items()}


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` one element past a fresh allocation (not 16-byte aligned for 2- and 4-byte dtypes)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


#: Launch sites of each layer kernel in one forward (gate_up and down for the GEMMs and LoRA ops).
LAUNCH_SITES = {"fused_moe": 2, "lora_shrink": 2, "lora_expand": 2, "gated_act": 1}


def variant_rows(
    shape: MoEShape | str, layer: MoELoRALayer, weights: MoELoRAInputs, *, n_lengths: int = 32, device="cuda"
) -> list[dict[str, Any]]:
    """New compiled binaries per kernel over ``n_lengths`` log-spaced T with one fixed config (the layer's
    stage and config at T = 64), then again with misaligned inputs, beside ``settings`` (the distinct
    compile-time settings those lengths call for). The layer's stage, config and memos are restored
    afterwards."""
    from ..kernels.align import align_launch_args
    from ..kernels.align_small import pair_launch_args, use_pair_path

    sh = _shape(shape)
    lengths = list(log_spaced_lengths(n_lengths, 1, layer.max_tokens))
    st = layer.stage_for(64)  # a concrete stage ("auto": the config files' choice at T = 64)
    fixed = st.config_for(layer._dims(64))
    saved = layer.stage, layer.fixed_config
    layer.stage, layer.fixed_config, layer._configs, layer._stages = st, fixed, {}, {}
    seen: dict[str, set] = {}  # each alignment kernel's constexpr settings (launch args from CPU ids)

    def add(kernel, constexprs):
        seen.setdefault(kernel, set()).add(tuple(sorted(constexprs.items())))

    c = st.adapt(fixed)
    for T in lengths:
        ti, li = torch.zeros((T, layer.K), dtype=torch.int32), torch.zeros((T,), dtype=torch.int32)
        if use_pair_path(T * layer.K, layer.E, layer.L):  # what the layer launches at this T
            *_, pl = pair_launch_args(ti, layer.E, c.base_block_size_m, li, layer.L, c.lora_block_size_m)
            add("align_small.align_pair_kernel", pl.constexprs)
            continue
        for bm, lora in ((c.base_block_size_m, None), (c.lora_block_size_m, li)):
            for la in align_launch_args(ti, layer.E, bm, lora, layer.L if lora is not None else 0)[1]:
                add(f"align.align_{la.name}_kernel", la.constexprs)
    settings = {k: len(v) for k, v in seen.items()}
    try:
        before = jit_cache_sizes()
        for T in lengths:
            inp = layer_inputs(sh, T, weights=weights, device=device)
            layer(inp.hidden_states, inp.router_logits, lora_ids=inp.lora_ids)
        bench.sync(device)
        after_lengths = jit_cache_sizes()
        with warnings.catch_warnings():  # large misaligned inputs are copied, with a warning each
            warnings.simplefilter("ignore", MisalignedCopyWarning)
            for T in lengths:
                inp = layer_inputs(sh, T, weights=weights, device=device)
                m = {k: _misaligned(getattr(inp, k)) for k in ("topk_weights", "topk_ids", "lora_ids")}
                layer(_misaligned(inp.hidden_states), **m)
        bench.sync(device)
        after_offsets = jit_cache_sizes()
    finally:
        (layer.stage, layer.fixed_config), layer._configs, layer._stages = saved, {}, {}
    return [
        bench.result_row(model=sh.name, kernel=k, n_lengths=len(lengths),
                         new_binaries_lengths=after_lengths[k] - before[k],
                         new_binaries_offset_views=after_offsets[k] - after_lengths[k],
                         binaries_total=after_offsets[k], settings=settings.get(k, LAUNCH_SITES.get(k, 1)))
        for k in before
        # on a GPU, skip device helpers (inlined, never launched) and kernels this layer does not use
        if not (torch.cuda.is_available() and after_offsets[k] == 0)
    ]  # fmt: skip


def memory_rows(
    shape: MoEShape | str, layer: MoELoRALayer, inp: MoELoRAInputs, *, device="cuda"
) -> list[dict[str, Any]]:
    """The module's bytes by kind (``memory_report``) and ``forward_temporaries`` (the peak of one forward's
    temporaries; CPU: None)."""
    sh, T = _shape(shape), inp.hidden_states.shape[0]
    layer(inp.hidden_states, inp.router_logits, lora_ids=inp.lora_ids)  # workspaces allocated
    temp = None
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        out = layer(inp.hidden_states, inp.router_logits, lora_ids=inp.lora_ids)
        torch.cuda.synchronize()
        temp = torch.cuda.max_memory_allocated() - m0
        del out
    rep = {**layer.memory_report(), "forward_temporaries": temp}
    row = dict(model=sh.name, T=T, max_tokens=layer.max_tokens)
    return [bench.result_row(**row, kind=k, value=None if v is None else int(v)) for k, v in rep.items()]
