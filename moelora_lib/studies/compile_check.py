"""Compile-only inspection of the kernels for sm_90 (H200) on a machine without a GPU.

Meta tensors stand in for device buffers; ``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` builds
the cubin with the ptxas bundled in the triton wheel (docs/environment.md §3). Kernels must be decorated
without ``TRITON_INTERPRET``: from an interpreted process use :func:`run_isolated`. CLI::

    python -m moelora_lib.studies.compile_check count --kernel lora_shrink --naive --lengths 1 7 16 4096
    python -m moelora_lib.studies.compile_check inspect --launch gate_up_shrink --T 64 --cfg '{"SPLIT_K": 4}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from functools import cache
from pathlib import Path

KERNEL_NAMES = ("fused_moe", "lora_shrink", "lora_expand", "gated_act")


# --- compiling -------------------------------------------------------------------------------------------
def _target(arch: int = 90):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


SM90 = 90


@cache
def _backend(arch: int = SM90):
    from triton.compiler import make_backend

    return make_backend(_target(arch))


@cache
def _binder(jitfn, arch: int = SM90):
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(jitfn.signature, jitfn.params, _backend(arch))


def _check_jit(jitfn) -> None:
    from triton.runtime.jit import JITFunction

    if not isinstance(jitfn, JITFunction):
        raise RuntimeError(f"{jitfn!r} is not a JITFunction (decorated under TRITON_INTERPRET=1?); compile "
                           "in a process without it, e.g. compile_check.run_isolated(jobs)")  # fmt: skip


def _kwargs(jitfn, constexprs: dict, num_warps, num_stages) -> dict:
    """Keyword arguments exactly as JITFunction.run sees them (it adds debug/instrumentation_mode)."""
    from triton import knobs

    kw = dict(constexprs)
    if num_warps is not None:
        kw["num_warps"] = num_warps
    if num_stages is not None:
        kw["num_stages"] = num_stages
    kw["debug"] = kw.get("debug", jitfn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kw


def _bind(jitfn, args, constexprs, num_warps, num_stages, arch):
    _check_jit(jitfn)
    kw = _kwargs(jitfn, constexprs, num_warps, num_stages)
    bound_args, specialization, options = _binder(jitfn, arch)(*args, **kw)
    return kw, bound_args, specialization, options


def specialization_key(jitfn, args, constexprs: dict, num_warps: int | None = None,
                       num_stages: int | None = None, arch: int = SM90) -> str:  # fmt: skip
    """The key ``JITFunction.run`` looks its kernel cache up with for these launch arguments: the same key
    reuses one binary, a new key compiles a new one."""
    from triton.runtime.jit import compute_cache_key

    _, _, specialization, options = _bind(jitfn, args, constexprs, num_warps, num_stages, arch)
    return compute_cache_key({}, specialization, options)


def compile_for_sm90(jitfn, args, constexprs: dict, num_warps: int | None = None,
                     num_stages: int | None = None, arch: int = SM90):  # fmt: skip
    """A ``CompiledKernel`` of ``jitfn`` for sm_``arch`` (no GPU) for these launch arguments (CPU or meta
    tensors, ints) and keyword constexprs; num_warps/num_stages None: Triton's."""
    import triton
    from triton.compiler import ASTSource

    backend = _backend(arch)
    kw, bound_args, specialization, options = _bind(jitfn, args, constexprs, num_warps, num_stages, arch)
    options, signature, cexprs, attrs = jitfn._pack_args(backend, kw, bound_args, specialization, options)
    return triton.compile(
        ASTSource(jitfn, signature, cexprs, attrs), target=_target(arch), options=options.__dict__
    )


# --- inspecting a CompiledKernel -------------------------------------------------------------------------
def _nvidia_bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool} is not bundled with this triton wheel ({path})")
    return path


def ptx(compiled) -> str:
    """The PTX of a compiled kernel."""
    return compiled.asm["ptx"]


def sass(compiled) -> str:
    """The SASS of a compiled kernel (``cuobjdump -sass`` of its cubin, via triton.tools.disasm)."""
    from triton.tools.disasm import get_sass

    os.environ.setdefault("TRITON_CUOBJDUMP_PATH", _nvidia_bin("cuobjdump"))  # used by older wheels
    return get_sass(compiled.asm["cubin"])


def resource_usage(compiled) -> dict:
    """``cuobjdump -res-usage`` of the cubin as ints: REG, STACK, SHARED, LOCAL (> 0: spills), CONSTANT_0,
    TEXTURE, SURFACE, SAMPLER; plus DYN_SHARED and NUM_WARPS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        cmd = [_nvidia_bin("cuobjdump"), "-res-usage", path]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        os.remove(path)
    m = re.search(r"REG:\d+.*", out)
    if m is None:
        raise RuntimeError(f"cannot parse cuobjdump -res-usage output:\n{out}")
    res = {}
    for key, val in re.findall(r"([A-Z_]+(?:\[\d+\])?):(\d+)", m.group(0)):
        res[key.replace("[", "_").replace("]", "")] = int(val)
    res["DYN_SHARED"] = int(compiled.metadata.shared)
    res["NUM_WARPS"] = int(compiled.metadata.num_warps)
    return res


# --- the real launch arguments of one layer launch, on meta tensors --------------------------------------
#: launch name -> kernel name (the launches of one layer, :data:`moelora_lib.kernels.stages.LAUNCH_KERNELS`)
LAUNCHES = dict(base_gate_up="fused_moe", base_down="fused_moe", gate_up_shrink="lora_shrink")
LAUNCHES |= dict(down_shrink="lora_shrink", gate_up_expand="lora_expand", down_expand="lora_expand")
LAUNCHES["act"] = "gated_act"
#: kernel name -> its first launch
_DEFAULT_LAUNCH = {k: next(n for n, v in LAUNCHES.items() if v == k) for k in KERNEL_NAMES}


def _shape(shape):
    """A preset name, or a dict of MoEShape fields over ``base`` (default gpt-oss-20b)."""
    from ..shapes import get_shape

    if isinstance(shape, str):
        return get_shape(shape)
    d = dict(shape)
    return replace(get_shape(d.pop("base", "gpt-oss-20b")), **d)


def _routing(T: int, E: int, K: int, L: int):
    """Deterministic top-k ids (distinct experts per token) and adapter ids (round robin)."""
    import torch

    t = torch.arange(T)
    topk_ids = (t[:, None] * 7 + torch.arange(K)[None, :] * (E // K if E >= 2 * K else 1)) % E
    return topk_ids.to(torch.int32), (t % L).to(torch.int32)


def _stage(specialize_lengths: bool = False, even_k: bool = True):
    """A stage with split-K, swizzle and fused add, and the given EVEN_K / specialization switches."""
    from ..kernels.stages import Stage

    kw = dict(specialize_lengths=specialize_lengths, split_k=True, swizzle=True, even_k=even_k)
    kw["fused_add"] = True
    return Stage(name="compile_check", title="compile-only launch", **kw)


def _layer_tensors(d, make, has_bias: bool) -> dict:
    """The float tensors of one layer call of Dims ``d``, each made by ``make(*shape)``."""
    T, H, I, E, L, R, S = d.T, d.H, d.I, d.E, d.adapters, d.rank, d.slices
    t = dict(hidden_states=make(T, H), w13=make(E, 2 * I, H), w2=make(E, H, I), lora_a13=make(L, E, S, R, H))
    t |= dict(lora_b13=make(L, E, S, 2 * I // S, R), lora_a2=make(L, E, R, I), lora_b2=make(L, E, H, R))
    return t | (dict(b13=make(E, 2 * I), b2=make(E, H)) if has_bias else {})


def meta_layer_run(dims, *, activation: str = "silu", has_bias: bool = False, dtype="bfloat16", config=None,
                   use_even_k: bool = True, specialize_lengths: bool = False):  # fmt: skip
    """A :class:`~moelora_lib.kernels.LayerRun` of ``dims`` on meta tensors (``config`` None:
    ``default_config(dims)``), a stage with fused add and the given switches. Nothing is launched."""
    import torch

    from ..common import parse_dtype
    from ..kernels.stages import LayerRun, default_config

    dt = parse_dtype(dtype)
    topk_ids, lora_ids = _routing(dims.T, dims.E, dims.top_k, dims.adapters)
    t = _layer_tensors(dims, lambda *shape: torch.empty(*shape, device="meta", dtype=dt), has_bias)
    w = torch.empty(dims.T, dims.top_k, device="meta", dtype=torch.float32)
    cfg = config if config is not None else default_config(dims)
    ids = dict(topk_weights=w, topk_ids=topk_ids, lora_ids=lora_ids)
    run = LayerRun(_stage(specialize_lengths, use_even_k), **t, **ids, activation=activation, config=cfg)
    fields = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")
    for name in ("base_align", "lora_align"):
        al = getattr(run, name)
        setattr(run, name, replace(al, **{f: getattr(al, f).to("meta") for f in fields}))
    return run


def launch(launch_name: str, T: int, *, shape="gpt-oss-20b", rank: int = 32, adapters: int = 8,
           dtype: str = "bfloat16", cfg=None, use_even_k: bool = True):  # fmt: skip
    """``(kernel_name, args, constexprs, num_warps, num_stages, cfg)`` of one layer launch at T. launch_name:
    of :data:`LAUNCHES` or a kernel name; cfg: an OpConfig, a dict of fields over the default, or None;
    use_even_k: the LoRA ops' switch."""
    from ..kernels.config import BASE_OPS, LORA_OPS, OpConfig
    from ..kernels.stages import default_config
    from ..shapes import Dims

    launch_name = _DEFAULT_LAUNCH.get(launch_name, launch_name)
    sh = _shape(shape)
    dims = Dims.of(sh, int(T), rank=rank, adapters=adapters)
    layer_cfg = default_config(dims)
    if LAUNCHES[launch_name] != "gated_act":
        base = getattr(layer_cfg, launch_name)
        if cfg is None:
            cfg = base
        elif isinstance(cfg, dict):
            cfg = replace(base, **{k.upper(): v for k, v in cfg.items()})
        assert isinstance(cfg, OpConfig)
        group = BASE_OPS if launch_name in BASE_OPS else LORA_OPS
        bm = cfg.BLOCK_SIZE_M
        layer_cfg = layer_cfg.replace(
            **{op: replace(getattr(layer_cfg, op), BLOCK_SIZE_M=bm) for op in group}
        )
    kw = dict(activation=sh.activation, has_bias=sh.has_bias, dtype=dtype, config=layer_cfg)
    kw["use_even_k"] = use_even_k
    la = meta_layer_run(dims, **kw).launch_args(launch_name, cfg)
    return la.kernel, la.args, la.constexprs, la.num_warps, la.num_stages, la.cfg


def _jit(kernel: str, specialize_lengths: bool):
    from ..kernels.triton_kernels import KERNELS

    return KERNELS[kernel][bool(specialize_lengths)]


_HASHES: dict = {}


def variants(kernel_name: str, specialize_lengths: bool, lengths, *, launch_name: str | None = None, cfg=None,
             compile: bool = True, **launch_kw) -> dict:  # fmt: skip
    """Distinct cache keys (and binaries) of one layer launch over ``lengths``. ``cfg``: None (the default at
    T = 64), an OpConfig or dict, or ``"auto"`` (``default_config(T)`` per length). Returns ``{"keys",
    "hashes", "configs", "per_length": {T: key index}, "key_list"}``. ValueError when the launch does not run
    ``kernel_name``."""
    from ..kernels.config import OpConfig

    name = launch_name or _DEFAULT_LAUNCH[kernel_name]
    if LAUNCHES[name] != kernel_name:
        raise ValueError(f"launch {name!r} runs {LAUNCHES[name]}, not {kernel_name}")
    fixed = cfg
    if cfg is None and kernel_name != "gated_act":
        fixed = launch(name, 64, **launch_kw)[5]
    keys, per_length, configs, hashes = [], {}, set(), set()
    jf = _jit(kernel_name, specialize_lengths)
    for T in lengths:
        _, args, cx, nw, ns, used = launch(name, int(T), cfg=None if fixed == "auto" else fixed, **launch_kw)
        configs.add(used if isinstance(used, OpConfig) else None)
        key = specialization_key(jf, args, cx, nw, ns)
        if key not in keys:
            keys.append(key)
            if compile:
                if key not in _HASHES:
                    _HASHES[key] = compile_for_sm90(jf, args, cx, nw, ns).hash
                hashes.add(_HASHES[key])
        per_length[int(T)] = keys.index(key)
    n_hashes = len(hashes) if compile else None
    return dict(keys=len(keys), hashes=n_hashes, configs=len(configs), per_length=per_length, key_list=keys)


def inspect_job(
    launch_name: str, T: int, *, specialize_lengths: bool = False, want=("res", "ptx", "sass"), **launch_kw
) -> dict:
    """Compile one layer launch for sm_90: kernel, hash, key, constexprs, cfg, and the ``want``-ed "res",
    "ptx", "sass"."""
    kernel, args, cx, nw, ns, cfg = launch(launch_name, T, **launch_kw)
    jf = _jit(kernel, specialize_lengths)
    k = compile_for_sm90(jf, args, cx, nw, ns)
    out = dict(kernel=kernel, hash=k.hash, key=specialization_key(jf, args, cx, nw, ns))
    out["constexprs"] = {n: (v if isinstance(v, (int, bool, str)) else str(v)) for n, v in cx.items()}
    out["cfg"] = cfg.to_dict() if cfg is not None else None
    for name, fn in (("res", resource_usage), ("ptx", ptx), ("sass", sass)):
        if name in want:
            out[name] = fn(k)
    return out


# --- stage fused: variants over lengths, registers ---------------------------------------------------------
def _fused_meta_run(dims, *, activation: str, has_bias: bool, dtype: str, config):
    """:func:`meta_layer_run` with stage ``fused``'s switches and ``config`` as that stage adapts it."""
    from ..kernels import STAGES

    run = meta_layer_run(dims, activation=activation, has_bias=has_bias, dtype=dtype, config=config)
    run.stage = replace(STAGES["fused"])
    run.adapter_order = run.stage.uses_adapter_order()  # as a real run of the stage
    run.cfg = run.stage.adapt(config)  # (the meta stage's adapt never lets the down GEMM split K)
    run._g_buf = run._act_out()
    return run


def _compile_launch(la):
    return compile_for_sm90(_jit(la.kernel, False), la.args, la.constexprs, la.num_warps, la.num_stages)


def fused_report(
    lengths,
    *,
    shape="gpt-oss-20b",
    rank: int = 32,
    adapters: int = 8,
    dtype: str = "bfloat16",
    fixed_T: int = 64,
    res_T=(1, 64, 1600),
) -> dict:
    """Compile-only facts of stage ``fused`` at ``shape``: per launch of
    :data:`~moelora_lib.kernels.stages.FUSED_LAUNCH_OPS` ``keys``/``hashes`` over ``lengths`` at ``fixed_T``'s
    config and ``res`` (``{T: {"REG", "LOCAL", "cfg"}}`` at each T of ``res_T``)."""
    from ..kernels.fused import fused_default_config
    from ..kernels.stages import FUSED_CONFIG_FIELD, FUSED_LAUNCH_OPS
    from ..shapes import Dims

    sh = _shape(shape)

    def run_at(T, cfg=None):
        d = Dims.of(sh, int(T), rank=rank, adapters=adapters)
        c = cfg if cfg is not None else fused_default_config(d)
        return _fused_meta_run(d, activation=sh.activation, has_bias=sh.has_bias, dtype=dtype, config=c)

    fixed = fused_default_config(Dims.of(sh, int(fixed_T), rank=rank, adapters=adapters))
    out: dict = {}
    for op in FUSED_LAUNCH_OPS:
        keys, hashes = [], set()
        for T in lengths:
            la = run_at(T, fixed).launch_args(op)
            key = specialization_key(
                _jit(la.kernel, False), la.args, la.constexprs, la.num_warps, la.num_stages
            )
            if key not in keys:
                keys.append(key)
                hashes.add(_compile_launch(la).hash)
        res = {}
        for T in res_T:
            la = run_at(T).launch_args(op)
            ru = resource_usage(_compile_launch(la))
            res[int(T)] = {"REG": ru["REG"], "LOCAL": ru["LOCAL"], "cfg": la.cfg.short()}
        kernel = FUSED_CONFIG_FIELD[op] and run_at(fixed_T, fixed).launch_args(op).kernel
        out[op] = dict(kernel=kernel, keys=len(keys), hashes=len(hashes), res=res)
    return out


# --- subprocess runner and CLI ---------------------------------------------------------------------------
def _run_job(job: dict) -> dict:
    job = dict(job)
    op = job.pop("op")
    if op == "count":
        return variants(job.pop("kernel"), job.pop("specialize_lengths"), job.pop("lengths"), **job)
    if op == "inspect":
        return inspect_job(job.pop("launch"), job.pop("T"), **job)
    if ":" in op:  # "module:function", e.g. a test's helper
        mod, fn = op.split(":")
        return getattr(importlib.import_module(mod), fn)(**job)
    if op == "fused_report":
        return fused_report(job.pop("lengths"), **job)
    raise ValueError(f"unknown op {op!r}")


def run_isolated(jobs: list[dict], timeout: float = 600.0) -> list[dict]:
    """Run compile jobs (``{"op": "count" | "inspect" | "fused_report" | "module:function", **arguments}``) in
    one fresh subprocess without TRITON_INTERPRET; returns their results. RuntimeError with the subprocess's
    stderr when a job fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "moelora_lib.studies.compile_check", "batch"],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=root,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compile_check subprocess failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.studies.compile_check", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("batch", help="read a JSON list of jobs on stdin, print a JSON list of results")
    c = sub.add_parser("count", help="count compiled variants over prompt lengths")
    c.add_argument("--kernel", required=True, choices=KERNEL_NAMES)
    c.add_argument("--launch", default=None, choices=sorted(LAUNCHES))
    c.add_argument("--naive", action="store_true", help="Triton's default specialization (stage naive)")
    c.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 7, 16, 33, 64, 1000, 4096, 8192])
    c.add_argument("--auto-config", action="store_true", help="default_config(T) per length")
    i = sub.add_parser("inspect", help="compile one launch; print resources (and PTX/SASS with --asm)")
    i.add_argument("--launch", required=True, choices=sorted(LAUNCHES) + list(KERNEL_NAMES))
    i.add_argument("--T", type=int, default=64)
    i.add_argument("--cfg", default=None, help="JSON dict of OpConfig fields")
    i.add_argument("--dtype", default="bfloat16")
    i.add_argument("--asm", choices=["ptx", "sass"], default=None)
    for s in (c, i):
        s.add_argument("--shape", default="gpt-oss-20b")
    a = p.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET to compile for sm_90", file=sys.stderr)
        return 2
    if a.cmd == "batch":
        json.dump([_run_job(j) for j in json.load(sys.stdin)], sys.stdout)
    elif a.cmd == "count":
        cfg = "auto" if a.auto_config else None
        v = variants(a.kernel, a.naive, a.lengths, launch_name=a.launch, cfg=cfg, shape=a.shape)
        print(json.dumps({k: v[k] for k in ("keys", "hashes", "configs", "per_length")}))
    else:
        cfg = json.loads(a.cfg) if a.cfg else None
        want = ("res",) + ((a.asm,) if a.asm else ())
        r = inspect_job(a.launch, a.T, cfg=cfg, shape=a.shape, dtype=a.dtype, want=want)
        if a.asm:
            print(r[a.asm])
        print(json.dumps({k: r[k] for k in ("kernel", "hash", "constexprs", "cfg", "res")}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
