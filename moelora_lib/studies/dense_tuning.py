"""The dense multi-LoRA tuner: shrink and expand configs of :func:`moelora_lib.linear.lora_linear`
(stage ``tuned``) per projection shape and T, in vLLM's dense LoRA file format (``{gpu}_SHRINK.json``,
``{gpu}_EXPAND_TRUE.json``; ``load_dense_config``). The run command: moelora_lib/configs/README.md.

Per workload (projection, R, L, T), through :mod:`.tuner`:

1. Shrink and expand share one BLOCK_SIZE_M (:func:`bm_candidates`); the BM with the smallest sum of the
   two best medians wins.
2. An op whose entry exists (this run or ``--out``) keeps it and its BM, and only the other op is tuned;
   both present with different BMs: nothing written (``conflict`` row).
3. Only a pair checked against ``lora_linear_reference`` (fp64) within ``TOLERANCES`` is written.

CSV kinds: trial / bm_sum / check / choice / note / conflict / precompile / session.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import configs
from ..common import parse_dtype
from ..kernels import STAGES
from ..kernels.config import OpConfig, next_pow2
from ..shapes import DENSE_CPU_MODELS, DENSE_GPU_MODELS, DENSE_PRESETS, DenseProjection
from . import bench, tuner
from .tuner import RUN_COLUMNS, TRIAL_COLUMNS

#: The stage whose switches the tuned configs are for (split-K, grouped order, EVEN_K, fused add).
TUNE_STAGE = "tuned"
#: Largest shared memory a candidate may ask for (the H200 allows 227 KiB per block).
SMEM_LIMIT_BYTES = 200 * 1024
#: CPU smoke run limits (the Triton interpreter runs a kernel program by program).
CPU_MAX_TOKENS, CPU_MAX_CANDIDATES = 64, 2
CSV_COLUMNS = [*("kind", "model", "proj", "H", "slices", "S", "N", "R", "L", "T"), *TRIAL_COLUMNS, "rel_err"]
CSV_COLUMNS += RUN_COLUMNS
_KEY_COLUMNS = ("kind", "model", "proj", "H", "slices", "R", "L", "T", "op", "config_json")
_FILE_OPS = {"shrink": "dense_shrink", "expand": "dense_expand"}


def projections(spec: str | Sequence[str]) -> list[DenseProjection]:
    """The projections named by ``spec``: ``"all"``, ``"model"`` or ``"model/proj"`` (or ``model:proj``),
    comma-separated or a list. ValueError naming an unknown item."""
    items = [str(x).strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
    if not items:
        raise ValueError(f"expected 'all' or comma-separated model[/proj] names, got {spec!r}")
    out: list[DenseProjection] = []
    for it in items:
        model, _, proj = it.replace(":", "/").partition("/")
        if it != "all" and model not in DENSE_PRESETS:
            raise ValueError(f"unknown model {model!r} in {it!r}; known: {['all', *DENSE_PRESETS]}")
        models = DENSE_GPU_MODELS if it == "all" else [model]
        got = [p for m in models for p in DENSE_PRESETS[m].projections()]
        if proj and not (got := [p for p in got if p.proj == proj]):
            have = [p.proj for p in DENSE_PRESETS[model].projections()]
            raise ValueError(f"unknown projection {proj!r} of {model}; it has {have}")
        out += [p for p in got if p not in out]
    return out


# --- Candidates ---------------------------------------------------------------------------------------------
def bm_candidates(T: int, L: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates by tokens per adapter T/L: the largest ``max_bms`` plus the default's BM."""
    from ..configs.defaults import _block_m

    g = max(1, T) / max(1, L)
    bms = [16] if g <= 16 else [16, 32] if g <= 48 else [32, 64] if g <= 128 else [64, 128]
    return sorted(set(bms[-max_bms:]) | {_block_m(T, L)}) if max_bms > 1 else [_block_m(T, L)]


def _smem_shrink(c: OpConfig, elem: int) -> int:
    return c.NUM_STAGES * (c.BLOCK_SIZE_M * c.BLOCK_SIZE_K + c.BLOCK_SIZE_K * c.BLOCK_SIZE_N) * elem


def _smem_expand(c: OpConfig, elem: int) -> int:  # the rank intermediate is fp32
    return c.NUM_STAGES * (c.BLOCK_SIZE_M * c.BLOCK_SIZE_K * 4 + c.BLOCK_SIZE_K * c.BLOCK_SIZE_N * elem)


def _p2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(max(1, int(v)))))


def _warps(bm: int, bn: int, w: int = 4) -> int:
    return 8 if bm * bn >= 128 * 128 else w


def shrink_candidates(
    bm: int, dflt: OpConfig, *, hidden: int, n: int, limit: int = 8, elem: int = 2
) -> list[OpConfig]:
    """≤ ``limit`` shrink configs at BLOCK_SIZE_M = bm, the default first; none over
    :data:`SMEM_LIMIT_BYTES`."""
    full, sk = _p2(n, 16, 128), dflt.SPLIT_K
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm, NUM_WARPS=max(dflt.NUM_WARPS, _warps(bm, full)))
    raw = [d]
    grid = [(full, 64, sk, 3), (full, 64, 2 * sk, 3), (full, 128, sk, 3), (full, 64, sk // 2, 3)]
    grid += [
        (full, 128, sk // 2, 4),
        (full, 256, sk // 4, 3),
        (min(full, 32), 64, sk, 3),
        (full, 64, 4 * sk, 3),
    ]
    grid += [(full, 64, sk, 4), (full, 128, 2 * sk, 3), (min(full, 32), 128, 2 * sk, 3)]
    for bn, bk, s, st in grid:
        s = _p2(s, 1, 32)
        if bk > next_pow2(hidden):
            continue
        while s > 1 and bk * s > hidden:  # every split gets at least one K chunk
            s //= 2
        raw.append(OpConfig(bm, bn, bk, 8, s, _warps(bm, bn), st))
    return tuner.dedupe([c for c in raw if c is d or _smem_shrink(c, elem) <= SMEM_LIMIT_BYTES], limit)


def expand_candidates(
    bm: int, dflt: OpConfig, *, rank: int, widest: int, limit: int = 8, elem: int = 2
) -> list[OpConfig]:
    """≤ ``limit`` expand configs at BLOCK_SIZE_M = bm, the default first; none over
    :data:`SMEM_LIMIT_BYTES`."""
    bk, cap = _p2(rank, 16, 1 << 30), _p2(widest, 16, 256)
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    grid = [(128, 8, 4, 2), (64, 8, 4, 2), (256, 8, 8, 2), (128, 8, 8, 3), (32, 8, 4, 2), (128, 1, 4, 3)]
    grid += [(64, 1, 4, 3), (256, 8, 4, 3), (64, 8, 8, 3), (128, 8, 4, 4)]
    raw = [d]
    for bn, g, w, st in grid:
        bn = min(bn, cap)
        if not (bm >= 128 and bn >= 256):
            raw.append(OpConfig(bm, bn, bk, g, 1, _warps(bm, bn, w), st))
    return tuner.dedupe([c for c in raw if c is d or _smem_expand(c, elem) <= SMEM_LIMIT_BYTES], limit)


# --- The plan: workloads, which ops they tune, the compiles -------------------------------------------------
@dataclass
class Workload:
    proj: DenseProjection
    R: int
    L: int
    T: int
    shrink_shared: bool = False  # the shrink entry exists already (this run or the --out file)
    expand_shared: bool = False
    done: bool = False  # choices in the CSV

    @property
    def ids(self) -> dict[str, Any]:
        p = self.proj
        ids = dict(model=p.model, proj=p.proj, H=p.hidden, slices=p.slices_str, S=len(p.slices))
        return ids | dict(N=sum(p.slices), R=self.R, L=self.L, T=self.T)

    def keys(self, op: str) -> tuple[int, ...]:
        p = self.proj
        return configs.dense_keys(op, self.T, hidden=p.hidden, slices=p.slices, rank=self.R, adapters=self.L)

    def default(self):
        from ..kernels.dense_lora import default_dense_config

        p = self.proj
        return default_dense_config(self.T, hidden=p.hidden, slices=p.slices, rank=self.R, adapters=self.L)

    def candidates(self, op: str, bm: int, limit: int, elem: int) -> list[OpConfig]:
        p, d = self.proj, self.default()
        if op == "shrink":
            n = len(p.slices) * self.R
            return shrink_candidates(bm, d.shrink, hidden=p.hidden, n=n, limit=limit, elem=elem)
        return expand_candidates(bm, d.expand, rank=self.R, widest=max(p.slices), limit=limit, elem=elem)


def _leaf_at(data: dict, keys: tuple[int, ...]):
    found = configs.lookup(data, keys, exact_levels=tuple(range(len(keys))))
    return found and found[1]


def _choices(log: tuner.TrialLog, w: Workload) -> dict[str, OpConfig]:
    match = {k: v for k, v in w.ids.items() if k in ("model", "proj", "H", "slices", "R", "L", "T")}
    return log.choices(_FILE_OPS, **match)


def plan(
    projs: Sequence[DenseProjection], ranks, adapters: int, tokens, *, files=None, log=None
) -> list[Workload]:
    """The workloads in run order (R, T, projection), each marked done and with which of its ops take an
    existing entry."""
    seen: dict[str, set] = {"dense_shrink": set(), "dense_expand": set()}
    out = []
    for R, T, p in ((R, T, p) for R in ranks for T in tokens for p in projs):
        w = Workload(p, R, adapters, T)
        w.done = bool(log and _choices(log, w))
        for op, fop in _FILE_OPS.items():
            k = w.keys(fop)
            in_file = files is not None and _leaf_at(files.data[fop], k) is not None
            setattr(w, f"{op}_shared", not w.done and (k in seen[fop] or in_file))
            seen[fop].add(k)
        out.append(w)
    return out


def _meta_launch(job: dict):
    """The DenseLaunch of one compile job on meta tensors."""
    from ..kernels.dense_lora import DenseLoRAConfig, default_dense_config, dense_launches
    from ..routing import align_tokens

    H, slices, R, L, T = job["H"], tuple(job["slices"]), job["R"], job["L"], 16
    cfg = OpConfig(**job["cfg"])
    d = default_dense_config(T, hidden=H, slices=slices, rank=R, adapters=L)
    other = d.expand if job["op"] == "shrink" else d.shrink
    other = dataclasses.replace(other, BLOCK_SIZE_M=cfg.BLOCK_SIZE_M)
    pair = DenseLoRAConfig(cfg, other) if job["op"] == "shrink" else DenseLoRAConfig(other, cfg)
    meta = dict(device="meta", dtype=parse_dtype(job["dtype"]))
    ids = (torch.arange(T) % L).to(torch.int32)
    topk = torch.zeros(T, 1, dtype=torch.int32)
    al = align_tokens(topk, 1, cfg.BLOCK_SIZE_M, lora_ids=ids, num_adapters=L, check_values=False)
    fields = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")
    al = dataclasses.replace(al, **{f: getattr(al, f).to("meta") for f in fields})
    x, out = torch.empty(T, H, **meta), torch.empty(T, sum(slices), **meta)
    a, b = torch.empty(L, len(slices), R, H, **meta), torch.empty(L, sum(slices), R, **meta)
    shrink, expand = dense_launches(STAGES[TUNE_STAGE], x, a, b, out, al, pair, slices=slices)
    return shrink if job["op"] == "shrink" else expand


def compile_jobs(workloads: Sequence[Workload], *, max_bms: int, max_cands: int, dtype: str) -> list[dict]:
    """One job per distinct kernel binary the not-done workloads may time."""
    elem, jobs = parse_dtype(dtype).itemsize, {}
    for w in (w for w in workloads if not w.done):
        for op in (op for op in _FILE_OPS if not getattr(w, f"{op}_shared")):
            for c in (
                c for bm in bm_candidates(w.T, w.L, max_bms) for c in w.candidates(op, bm, max_cands, elem)
            ):
                p = w.proj
                job = dict(op=op, H=p.hidden, slices=list(p.slices), R=w.R, L=w.L, cfg=c.to_dict())
                job["dtype"] = dtype
                jobs.setdefault(json.dumps(job, sort_keys=True), job)  # the same candidate at another T
    return list(jobs.values())


def _precompile_main() -> int:
    """Worker: compile the jobs of JSON file argv[1] for sm_<argv[3]>, one JSON line per job to argv[2]."""
    from ..kernels.dense_lora import DENSE_KERNELS
    from .compile_check import compile_for_sm90

    jobs_path, out_path, arch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(out_path, "a") as out:
        for i, job in enumerate(json.loads(Path(jobs_path).read_text())):
            t0 = time.perf_counter()
            try:
                ln = _meta_launch(job)
                jf = DENSE_KERNELS[ln.kernel][STAGES[TUNE_STAGE].specialize_lengths]
                compile_for_sm90(jf, ln.args, ln.constexprs, ln.num_warps, ln.num_stages, arch=arch)
                res = dict(i=i, ok=True)
            except Exception as e:
                res = dict(i=i, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            out.write(json.dumps(dict(res, s=round(time.perf_counter() - t0, 3))) + "\n")
            out.flush()
    return 0


def precompile(jobs: list[dict], n_proc: int, timeout_s: float, arch: int) -> dict[str, Any]:
    """Compile ``jobs`` in ``n_proc`` fresh processes side by side into Triton's on-disk cache, at most
    ``timeout_s`` seconds. Returns {"jobs", "ok", "failed", "unfinished", "wall_s", "compile_s", "errors"}."""
    t0 = time.perf_counter()
    stats: dict[str, Any] = dict(jobs=len(jobs), ok=0, failed=0, unfinished=len(jobs), compile_s=0.0)
    stats["errors"] = []
    if not jobs or n_proc <= 0:
        return dict(stats, wall_s=0.0)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(bench.REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from moelora_lib.studies.dense_tuning import _precompile_main as m; sys.exit(m())"
    n_proc = min(n_proc, len(jobs))
    with tempfile.TemporaryDirectory(prefix="dense_precompile_") as tmp:
        outs = [Path(tmp) / f"{k}.out.jsonl" for k in range(n_proc)]
        cmds = {}
        for k in range(n_proc):
            (Path(tmp) / f"{k}.json").write_text(json.dumps(jobs[k::n_proc]))
            cmds[str(k)] = [sys.executable, "-c", code, str(Path(tmp) / f"{k}.json"), str(outs[k]), str(arch)]
        try:
            bench.run_side_by_side(cmds, envs={k: env for k in cmds}, timeout_s=timeout_s)
        except RuntimeError as e:  # a worker failed or the limit passed: the others were stopped
            stats["errors"].append(str(e)[-500:])
        results = [json.loads(x) for o in outs if o.exists() for x in o.read_text().splitlines() if x.strip()]
    stats.update(ok=sum(r["ok"] for r in results), failed=sum(not r["ok"] for r in results))
    stats.update(unfinished=len(jobs) - len(results), compile_s=sum(r["s"] for r in results))
    stats["errors"] = [r["error"] for r in results if not r["ok"]][:3] + stats["errors"]
    return dict(stats, wall_s=time.perf_counter() - t0)


# --- One workload -------------------------------------------------------------------------------------------
class _Inputs:
    """The tensors of one projection (up to the largest T), made once per (projection, R)."""

    def __init__(self, proj: DenseProjection, R: int, L: int, max_T: int, dtype, device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: 10^8 values at T = 8192
        H, S, N = proj.hidden, len(proj.slices), sum(proj.slices)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        self.x, self.a, self.b = rnd(max_T, H), rnd(L, S, R, H, scale=H**-0.5), rnd(L, N, R, scale=R**-0.5)
        self.out = torch.zeros(max_T, N, dtype=dtype, device=device)
        self.inter = torch.zeros(max_T, S * R, dtype=torch.float32, device=device)
        self.proj, self.R, self.L, self.seed, self.device = proj, R, L, seed, torch.device(device)

    def ids(self, T: int) -> torch.Tensor:
        """Every token with an adapter, spread evenly over the L slots, in a shuffled order."""
        g = torch.Generator(device="cpu").manual_seed(self.seed + T)
        return (torch.arange(T) % self.L)[torch.randperm(T, generator=g)].to(torch.int32).to(self.device)

    def op_fn(self, op: str, T: int, align, cfg: OpConfig) -> Callable[[], Any]:
        from ..kernels.dense_lora import dense_expand, dense_shrink

        st = STAGES[TUNE_STAGE]
        kw = dict(use_even_k=st.even_k, specialize_lengths=st.specialize_lengths)
        if op == "shrink":
            return lambda: dense_shrink(self.x[:T], self.a, align, cfg, inter=self.inter[:T], **kw)
        kw |= dict(slices=self.proj.slices, add_inputs=st.fused_add)
        return lambda: dense_expand(self.inter[:T], self.b, self.out[:T], align, cfg, **kw)

    def rel_err(self, T: int, align, shrink: OpConfig, expand: OpConfig, ref: torch.Tensor) -> float:
        """max|out − ref| / max|ref| of the pair, on the device; inf for a non-finite output."""
        from ..kernels.dense_lora import DenseLoRAConfig, dense_lora_add
        from .dense_bench import _rel_err

        out = torch.zeros(T, sum(self.proj.slices), dtype=self.x.dtype, device=self.device)
        cfg = DenseLoRAConfig(shrink, expand, source="tuner")
        args = (STAGES[TUNE_STAGE], out, self.x[:T], self.a, self.b, align, cfg)
        dense_lora_add(*args, slices=self.proj.slices)
        return _rel_err(out, ref)


def _tune_workload(
    w: Workload, inp: _Inputs, files, log, *, deadline, max_bms, max_cands, t0, warmup_ms, rep_ms, l2
) -> tuple[OpConfig, OpConfig] | None:
    """Tune one workload; the checked (shrink, expand), or None for a conflict."""
    from ..linear import _align_oneshot, lora_linear_reference
    from ..testing import TOLERANCES

    dev, T, elem = inp.device, w.T, inp.x.element_size()
    fixed = {op: files.data[fop] and _leaf_at(files.data[fop], w.keys(fop)) for op, fop in _FILE_OPS.items()}
    parse = configs.files._parse_dense_leaf
    fixed = {op: parse(v, str(files.path(_FILE_OPS[op]))) for op, v in fixed.items() if v}
    bms_fixed = {c.BLOCK_SIZE_M for c in fixed.values()}
    if len(bms_fixed) > 1:
        note = "existing shrink and expand entries have different BLOCK_SIZE_M: "
        note += "; ".join(f"{op}={c.short()}" for op, c in fixed.items())
        log.append(kind="conflict", **w.ids, note=note)
        return None
    ids, aligns = inp.ids(T), {}
    inp.out.zero_()  # the expand timings add into it

    def prepare(bm: int):
        align = aligns[bm] = _align_oneshot(ids, inp.L, bm)
        # a valid rank intermediate for the expand timings (the first shrink candidate at this BM)
        inp.op_fn("shrink", T, align, fixed.get("shrink") or w.candidates("shrink", bm, 1, elem)[0])()
        flush = l2 if l2 == "clean" else True
        timing = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, flush_l2=flush)
        return lambda op, c: bench.time_fn(inp.op_fn(op, T, align, c), "graph", dev, **timing)

    bms = sorted(bms_fixed) if bms_fixed else bm_candidates(T, w.L, max_bms)
    ranked = tuner.sweep(
        bms, prepare, ("shrink", "expand"), lambda op, bm: w.candidates(op, bm, max_cands, elem), dev, log,
        w.ids, deadline=deadline, t0=t0, fixed=fixed, cpu_mode="cpu-interpreter",
    )  # fmt: skip
    # pairs in order of summed time (each BM's top 3 × top 3, at most 5), then the default config
    pairs = [(ms_s + ms_e, bm, cs, ce) for bm, r in ranked.items() for ms_s, cs in r["shrink"][:3]
             for ms_e, ce in r["expand"][:3] if math.isfinite(ms_s + ms_e)]  # fmt: skip
    pairs = sorted(pairs, key=lambda p: p[0])[:5]
    dflt = w.default()
    if not fixed or dflt.block_size_m in bms_fixed:
        d = (fixed.get("shrink", dflt.shrink), fixed.get("expand", dflt.expand))
        pairs.append((math.nan, dflt.block_size_m, *d))
    tol = TOLERANCES[inp.x.dtype]
    w0 = torch.zeros(sum(inp.proj.slices), inp.proj.hidden, dtype=inp.x.dtype, device=dev)
    ref = lora_linear_reference(inp.x[:T], w0, inp.a, inp.b, ids, slices=inp.proj.slices)  # the LoRA delta
    for total, bm, cs, ce in pairs:
        align = aligns.get(bm) or _align_oneshot(ids, inp.L, bm)
        try:
            err, why = inp.rel_err(T, align, cs, ce, ref), ""
        except Exception as e:
            err, why = math.inf, f"{type(e).__name__}: {str(e)[:160]}"
        ok = err <= tol
        pair = f"shrink={cs.short()};expand={ce.short()}"
        note = "ok" if ok else f"WRONG (tolerance {tol:.1e}) {why}".strip()
        log.append(kind="check", **w.ids, op="pair", BLOCK_SIZE_M=bm, config=pair, sum_ms=total, rel_err=err,
                   note=note)  # fmt: skip
        if ok:
            for op, c in (("shrink", cs), ("expand", ce)):
                ms = next((m for m, cc in ranked.get(bm, {}).get(op, []) if cc == c), math.nan)
                note = "shared entry" if op in fixed else ("default" if math.isnan(total) else "")
                log.config_row("choice", w.ids, op, c, t0=t0, ms_p50=ms, sum_ms=total, rel_err=err, note=note)
            return cs, ce
    raise RuntimeError(
        f"{w.proj.name} R={w.R} L={w.L} T={T}: no config passed the correctness check (see the 'check' rows "
        f"of {log.path}); the kernels or the reference are broken"
    )


# --- Arguments, the whole run, the command line -------------------------------------------------------------
def _defaults(device, max_bms, max_cands, jobs) -> tuple[int, int, int]:
    """max_bms, max_cands, jobs with the device's defaults where None."""
    try:
        on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    except (RuntimeError, TypeError):
        on_cpu = False  # an invalid device: _check_args names it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return (
        (1 if on_cpu else 2) if max_bms is None else max_bms,
        (CPU_MAX_CANDIDATES if on_cpu else 8) if max_cands is None else max_cands,
        (0 if on_cpu else max(0, min(14, cpus - 2))) if jobs is None else jobs,
    )


def _check_args(projs, ranks, adapters, tokens, out, csv_path, budget_s, device, dtype, max_bms, max_cands,
                jobs, seed, warmup_ms, rep_ms, l2, *, names=None):  # fmt: skip
    """Check every argument of :func:`tune`; returns (projections, device, dtype, max_bms, max_cands,
    jobs)."""
    n = {a: a for a in tuner.FLAGS} | (names or {})
    max_bms, max_cands, jobs = _defaults(device, max_bms, max_cands, jobs)
    try:
        ps = projections(projs) if isinstance(projs, (str, list, tuple)) else None
    except ValueError as e:
        raise ValueError(f"{n['projections']}: {e}") from None
    if not ps:
        raise ValueError(f"{n['projections']}: expected 'all' or model[/proj] names, got {projs!r}")
    ints = dict(adapters=(adapters, 1, None), max_bms=(max_bms, 1, None), max_cands=(max_cands, 1, 16))
    dev, dt = tuner.check_run(
        names, tokens=tokens, budget_s=budget_s, device=device, dtype=dtype, out=out, csv_path=csv_path,
        key_columns=_KEY_COLUMNS, what="the dense tuner", lists=dict(ranks=(ranks, False)),
        ints=dict(ints, jobs=(jobs, 0, 64), seed=(seed, None, None)),
    )  # fmt: skip
    for name, v, lo in (("warmup_ms", warmup_ms, 0.0), ("rep_ms", rep_ms, 0.001)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo):
            raise ValueError(f"{n[name]}: expected a finite number of ms >= {lo:g}, got {v!r}")
    if l2 not in ("clean", "dirty"):
        raise ValueError(f"{n['l2']}: expected 'clean' or 'dirty', got {l2!r}")
    if dev.type == "cpu":  # the interpreter runs a kernel program by program
        big = [p.name for p in ps if p.model not in DENSE_CPU_MODELS]
        if big:
            raise ValueError(f"{n['projections']}: the CPU (Triton interpreter) runs only the smoke presets "
                             f"{list(DENSE_CPU_MODELS)} (e.g. 'tiny/qkv'), got {big}")  # fmt: skip
        if max(tokens) > CPU_MAX_TOKENS:
            raise ValueError(f"{n['tokens']}: at most {CPU_MAX_TOKENS} tokens on the CPU (interpreter)")
        if max_cands > CPU_MAX_CANDIDATES:
            raise ValueError(
                f"{n['max_cands']}: at most {CPU_MAX_CANDIDATES} candidates on the CPU (interpreter)"
            )
        if dt == torch.bfloat16:
            raise ValueError(
                f"{n['dtype']}: bfloat16 does not run on the CPU interpreter; use float32 or float16"
            )
    return ps, dev, dt, max_bms, max_cands, jobs


def tune(
    projs: str | Sequence[str],
    ranks: Sequence[int],
    adapters: int,
    tokens: Sequence[int],
    out: str | os.PathLike,
    csv_path: str | os.PathLike,
    *,
    budget_s: float = math.inf,
    device: str | None = None,
    dtype=None,
    max_bms: int | None = None,
    max_cands: int | None = None,
    jobs: int | None = None,
    seed: int = 0,
    warmup_ms: float = tuner.WARMUP_MS,
    rep_ms: float = tuner.REP_MS,
    l2: str = "clean",
    progress: bool = True,
    names: dict[str, str] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Tune every (projection, R, T) workload and write ``{gpu}_SHRINK.json`` / ``{gpu}_EXPAND_TRUE.json``
    into ``out``; returns a summary dict (tuned, skipped, not_tuned, conflicts: lists of (label, R, T);
    precompile, elapsed_s, out, gpu). Defaults by device: max_bms 2 (CPU 1), max_cands 8 (CPU 2), jobs min(14,
    cpus − 2) (CPU 0). ValueError naming the argument before any work."""
    args = (projs, ranks, adapters, tokens, out, csv_path, budget_s, device, dtype, max_bms, max_cands, jobs)
    ps, dev, dt, max_bms, max_cands, jobs = _check_args(*args, seed, warmup_ms, rep_ms, l2, names=names)
    jobs = 0 if dev.type == "cpu" else jobs
    t0 = time.perf_counter()
    gpu = "cpu" if dev.type == "cpu" else configs.gpu_name() if torch.cuda.is_available() else "NVIDIA_H200"
    log = tuner.TrialLog(Path(csv_path), CSV_COLUMNS)
    files = tuner.ConfigFiles(Path(out), gpu, _FILE_OPS.values(), configs.dense_config_file_name)
    for w in plan(ps, ranks, adapters, tokens):  # finished work into the files first (resume)
        if done := _choices(log, w):
            _put(files, w, done["shrink"], done["expand"])
    wls = plan(ps, ranks, adapters, tokens, files=files, log=log)
    dname = str(dt).removeprefix("torch.")
    cjobs = compile_jobs(wls, max_bms=max_bms, max_cands=max_cands, dtype=dname) if dev.type == "cuda" else []
    opts = dict(max_bms=max_bms, max_cands=max_cands, warmup_ms=warmup_ms, rep_ms=rep_ms)
    summary: dict[str, Any] = dict(out=str(out), gpu=gpu, precompile=None)
    if dev.type == "cpu":
        echo(
            f"dense_tuning: CPU SMOKE RUN under the Triton interpreter: tiny shapes, {max_cands} "
            "candidate(s) per op; times are interpreter wall clock, NOT kernel performance; files for GPU "
            "name 'cpu'"
        )
    n_done = sum(w.done for w in wls)
    echo(
        f"dense_tuning: {len(ps)} projections x {len(ranks)} rank(s) x {len(tokens)} T = {len(wls)} "
        f"workloads ({n_done} already in the CSV); {len(cjobs)} distinct kernels to compile in {jobs} "
        "process(es)" + (f"; budget {budget_s:.0f} s" if math.isfinite(budget_s) else "")
    )
    if cjobs and jobs > 0:
        cap = torch.cuda.get_device_capability(dev)
        st = summary["precompile"] = precompile(cjobs, jobs, min(300.0, 0.6 * budget_s), 10 * cap[0] + cap[1])
        note = f"{st['ok']} ok, {st['failed']} failed, {st['unfinished']} unfinished of {st['jobs']} in "
        note += f"{st['wall_s']:.1f} s wall ({st['compile_s']:.0f} s of compiles) on {jobs} processes"
        note += f"; errors: {st['errors'][:3]}" if st["errors"] else ""
        log.append(kind="precompile", elapsed_s=round(time.perf_counter() - t0, 2), note=note)
        echo(f"dense_tuning: precompile {log.rows[-1]['note']}")
    inputs: dict[tuple, _Inputs] = {}

    def tune_one(w: Workload) -> bool:
        if (w.proj, w.R) not in inputs:
            if any(k[1] != w.R for k in inputs):  # the projections of one rank stay on the device
                inputs.clear()  # (all 12 at T = 8192: < 5 GB)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            inputs[w.proj, w.R] = _Inputs(w.proj, w.R, w.L, max(tokens), dt, dev, seed)
        got = _tune_workload(w, inputs[w.proj, w.R], files, log, deadline=t0 + budget_s, t0=t0, l2=l2, **opts)
        if got is not None:
            _put(files, w, *got)
        return got is not None

    tuner.run_workloads(
        wls, log, files, summary, label=lambda w: (w.proj.name, w.R, w.T), ids=lambda w: w.ids,
        todo=lambda w: not _choices(log, w), tune=tune_one, deadline=t0 + budget_s, t0=t0, progress=progress,
        desc="dense tuning",
    )  # fmt: skip
    inputs.clear()
    return tuner.finish(log, summary, t0, "; CPU smoke run (interpreter wall clock)" if gpu == "cpu" else "")


def _put(files: tuner.ConfigFiles, w: Workload, shrink: OpConfig, expand: OpConfig) -> None:
    files.put("dense_shrink", w.keys("dense_shrink"), configs.dense_leaf(shrink, "shrink"))
    files.put("dense_expand", w.keys("dense_expand"), configs.dense_leaf(expand, "expand"))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a bad flag exits with code 2 and one error line naming it."""
    p = tuner.parser("python -m moelora_lib.studies.dense_tuning", __doc__, "1,8,64,256,1600,8192")
    add = p.add_argument
    add(
        "--projections",
        required=True,
        help="'all', or comma-separated model[/proj] of " + ", ".join(DENSE_PRESETS),
    )
    add("--ranks", default="32", type=tuner.int_list_type(1), help="R values (max LoRA rank)")
    add("--jobs", type=tuner.int_type(0), default=None, help="compile processes (default min(14, cpus - 2))")
    add("--warmup-ms", type=float, default=tuner.WARMUP_MS)
    add("--rep-ms", type=float, default=tuner.REP_MS)
    add("--l2", choices=["clean", "dirty"], default="clean", help="L2 flush before every repetition")
    a = p.parse_args(argv)
    pos = (a.projections, a.ranks, a.adapters, a.tokens, a.out, a.csv)
    kw = dict(budget_s=a.budget_s, device=a.device, dtype=a.dtype, max_bms=a.max_bms, max_cands=a.max_cands)
    kw.update(jobs=a.jobs, seed=a.seed, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, l2=a.l2)
    try:  # every flag checked before any work
        _check_args(*pos, **kw, names=tuner.FLAGS)
    except ValueError as e:
        p.error(str(e))
    s = tune(*pos, progress=not a.no_progress, names=tuner.FLAGS, **kw)
    cpu = "; CPU smoke run: interpreter wall clock, NOT performance" if s["gpu"] == "cpu" else ""
    print(tuner.summary_line("dense_tuning", s, f", {len(s['conflicts'])} conflicts: {s['conflicts']}") + cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
