"""The dense multi-LoRA tuner: shrink and expand configs of :func:`moelora_lib.lora_linear.lora_linear`
(stage ``tuned``) per projection shape and T, written in vLLM's dense LoRA file format.

Run (H200: 72 workloads, 1188 timed trials, 445 kernels compiled in 14 processes; about 2.5 minutes
by :func:`estimate`, which it prints before starting — ``--dry-run`` prints only that)::

    python -m moelora_lib.studies.dense_tuning --projections all --tokens 1,8,64,256,1600,8192 \\
        --ranks 32 --adapters 8 --out moelora_lib/configs/NVIDIA_H200 \\
        --csv data/10_dense_tuning_trials.csv --budget-s 330

CPU smoke run (Triton interpreter; tiny shapes, 1–2 candidates, interpreter wall clock — NOT kernel
performance; files for the GPU name ``cpu``)::

    TRITON_INTERPRET=1 python -m moelora_lib.studies.dense_tuning --projections tiny --tokens 1,8 \\
        --ranks 16 --adapters 2 --out /tmp/dense_cfg --csv /tmp/dense_trials.csv

Projections (:data:`DENSE_MODELS`, :func:`projections`): ``--projections all`` = the attention of
GPT-OSS-20B and Qwen3-30B-A3B (qkv, o) and every projection of Qwen3-32B and Llama-3.3-70B (qkv, o,
gate_up, down); or a comma-separated list of ``model`` / ``model/proj``. ``tiny`` (H = 48) is the CPU
preset.

What it does per workload (projection, R, L, T), on random bf16 inputs with every token holding an
adapter, the T tokens spread evenly over the L slots in a shuffled order:

1. **BLOCK_SIZE_M, shared.** The shrink and the expand share one alignment, so one BLOCK_SIZE_M.
   Candidates by tokens per adapter g = T/L (:func:`bm_candidates`: 16 up to 16, 16/32 up to 48,
   32/64 up to 128, else 64/128; the largest ``--max-bms`` plus the default's). For each, the
   shrink and the expand are tuned independently over ≤ ``--max-candidates`` configs
   (:func:`shrink_candidates`: BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, warps, stages;
   :func:`expand_candidates`: BLOCK_SIZE_N, GROUP_SIZE_M, warps, stages; the default first), each
   op timed alone; the BM with the smallest sum of the two best medians wins.
2. **Shared file entries.** vLLM's keys do not tell every projection apart: the shrink entry
   (L, S, T, H, R) does not depend on the slice widths (GPT-OSS-20B and Qwen3-30B-A3B o: both
   4096 → R), the expand entry (L, S, T, R, widest slice) not on H (Qwen3-32B o and down: both
   R → 5120). Such ops are the same kernel on the same shapes. When an entry already exists (tuned
   earlier in this run, or in the ``--out`` files), the workload takes its config and BLOCK_SIZE_M
   and tunes only the other op at that BM, so the two files stay consistent (every shrink entry has
   an expand entry of the same BLOCK_SIZE_M at the same (L, S, T)). Both present with different
   BLOCK_SIZE_M: nothing is written for that workload (``conflict`` in the CSV).
3. **Correctness.** The winning pair is run through :func:`moelora_lib.kernels.dense_lora.dense_lora_add`
   (stage ``tuned``) and compared with :func:`moelora_lib.lora_linear.lora_linear_reference` (fp64,
   zero base weight: the LoRA delta alone) within :data:`moelora_lib.testing.TOLERANCES`; a pair
   that fails is logged and the next best pair is checked (then the default config); only a checked
   pair is written.

Compiles: before timing, every candidate kernel is compiled in ``--jobs`` parallel processes (no
GPU needed: :func:`moelora_lib.studies.compile_check.compile_for_sm90` for this GPU's arch), which
fills Triton's on-disk cache, so the timing process only loads binaries (about 1–1.4 s per compile
otherwise). Best effort: a failed or unfinished compile is simply compiled on demand later.

Timing: :func:`moelora_lib.studies.bench.time_fn` — CUDA-graph replay, L2 evicted before every
repetition (``--l2``: ``clean`` = a 256 MB read, ``dirty`` = do_bench's zeroing), warm-up 5 ms,
rep 20 ms; on the CPU one interpreted call (mode ``cpu``).

Bookkeeping: every trial is appended to the CSV row by row (``kind`` = trial / bm_sum / check /
choice / note / conflict / precompile / session); a workload whose two ``choice`` rows are in the
CSV is skipped (resumable) and its choices re-written into the JSON files, which are written
atomically after every workload. ``--budget-s``: no workload (and no further BLOCK_SIZE_M of one in
progress) starts past the budget; the rest is listed as not tuned. Every flag is checked before any
work (exit code 2 and a message naming the flag).

Files: ``{gpu}_SHRINK.json`` and ``{gpu}_EXPAND_TRUE.json`` in ``--out`` (format:
:mod:`moelora_lib.configs`, ``load_dense_config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
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
from ..kernels.config import OpConfig, next_pow2
from ..shapes import DENSE_CPU_MODELS, DENSE_GPU_MODELS, DENSE_PRESETS, DenseProjection
from .tuner_common import (
    BUDGET_BM_NOTE,
    BUDGET_WORKLOAD_NOTE,
    RUN_COLUMNS,
    TRIAL_COLUMNS,
    ConfigFiles,
    TrialLog,
    append_config_row,
    arg_type,
    budget_type,
    check_budget,
    check_csv,
    check_device,
    check_out,
    dedupe,
    int_list_type,
    over_budget,
    parse_int,
    time_candidate,
)

__all__ = [
    "DENSE_MODELS",
    "Projection",
    "projections",
    "CSV_COLUMNS",
    "bm_candidates",
    "shrink_candidates",
    "expand_candidates",
    "plan",
    "estimate",
    "tune",
    "main",
]

#: The stage whose switches the tuned configs are for (split-K, grouped order, EVEN_K, fused add).
TUNE_STAGE = "tuned"
#: Rough costs behind :func:`estimate` (H200 host): seconds per Triton compile, per timed trial
#: beyond warm-up + rep, per worker-process start, per workload (inputs, alignment, fp64 check).
COMPILE_S, TRIAL_OVERHEAD_S, WORKER_START_S, WORKLOAD_S, STARTUP_S = 1.3, 0.015, 8.0, 0.25, 15.0
CACHE_LOAD_S = 0.05  # loading a precompiled binary from Triton's cache in the timing process
#: Largest shared memory a candidate may ask for (the H200 allows 227 KiB per block).
SMEM_LIMIT_BYTES = 200 * 1024
#: CPU smoke run limits (the Triton interpreter runs a kernel program by program).
CPU_MAX_TOKENS, CPU_MAX_CANDIDATES = 64, 2


# ------------------------------------------------------------------------------------------------
# Projection presets
# ------------------------------------------------------------------------------------------------
#: hidden, q/kv heads, head_dim, MLP intermediate (None: attention only — the MoE models, whose
#: MLP is the expert layer), per model: a view of :data:`moelora_lib.shapes.DENSE_PRESETS` (values
#: from the models' config.json on the Hugging Face hub; ``tiny``: the CPU smoke preset, the tiny
#: shapes of dense_bench).
DENSE_MODELS: dict[str, dict[str, Any]] = {
    name: {f: getattr(m, f) for f in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate")}
    for name, m in DENSE_PRESETS.items()
}
GPU_MODELS = DENSE_GPU_MODELS
CPU_MODELS = DENSE_CPU_MODELS


class Projection(DenseProjection):
    """One dense projection (:class:`moelora_lib.shapes.DenseProjection`: x [T, hidden] -> [T, Σ slices],
    the slices fused in one weight) as the tuner names it: ``name`` is the projection's short name
    (qkv, o, gate_up, down, the CSV's ``proj``), ``label`` is ``"<model>/<proj>"``."""

    @property
    def name(self) -> str:
        return self.proj

    @property
    def label(self) -> str:
        """``"<model>/<proj>"`` (as notebook 10's tables name projections)."""
        return f"{self.model}/{self.proj}"


def _model_projections(model: str) -> list[Projection]:
    return [Projection(p.model, p.proj, p.hidden, p.slices) for p in DENSE_PRESETS[model].projections()]


def projections(spec: str | Sequence[str]) -> list[Projection]:
    """The projections named by ``spec``: ``"all"`` (the four GPU models), ``"model"`` (all its
    projections) or ``"model/proj"`` (or ``"model:proj"``; proj in qkv, o, gate_up, down),
    comma-separated or a list. Raises ValueError naming the unknown item and the known names."""
    items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
    if not items:
        raise ValueError(f"expected 'all' or comma-separated model[/proj] names, got {spec!r}")
    out: list[Projection] = []
    for it in items:
        if it == "all":
            got = [p for m in GPU_MODELS for p in _model_projections(m)]
        else:
            model, _, proj = it.replace(":", "/").partition("/")
            if model not in DENSE_MODELS:
                raise ValueError(f"unknown model {model!r} in {it!r}; known: {['all', *DENSE_MODELS]}")
            got = _model_projections(model)
            if proj:
                names = [p.proj for p in got]
                got = [p for p in got if p.proj == proj]
                if not got:
                    raise ValueError(f"unknown projection {proj!r} of {model}; it has {names}")
        out += [p for p in got if p not in out]
    return out


# ------------------------------------------------------------------------------------------------
# Candidates
# ------------------------------------------------------------------------------------------------
def bm_candidates(T: int, L: int, max_bms: int = 2) -> list[int]:
    """BLOCK_SIZE_M candidates by tokens per adapter g = T/L (uniform): 16 (g ≤ 16), 16/32 (g ≤ 48),
    32/64 (g ≤ 128), else 64/128 — the largest ``max_bms`` of them plus the default's BM."""
    from ..kernels.dense_lora import _block_m

    g = max(1, T) / max(1, L)
    bms = [16] if g <= 16 else [16, 32] if g <= 48 else [32, 64] if g <= 128 else [64, 128]
    dflt = _block_m(T, L)
    return sorted(set(bms[-max_bms:]) | {dflt}) if max_bms > 1 else [dflt]


def _smem_shrink(c: OpConfig, elem: int) -> int:
    return c.NUM_STAGES * (c.BLOCK_SIZE_M * c.BLOCK_SIZE_K + c.BLOCK_SIZE_K * c.BLOCK_SIZE_N) * elem


def _smem_expand(c: OpConfig, elem: int) -> int:  # the rank intermediate is fp32
    return c.NUM_STAGES * (c.BLOCK_SIZE_M * c.BLOCK_SIZE_K * 4 + c.BLOCK_SIZE_K * c.BLOCK_SIZE_N * elem)


def _p2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_pow2(max(1, int(v)))))


def shrink_candidates(
    bm: int, dflt: OpConfig, *, hidden: int, n: int, limit: int = 8, elem: int = 2
) -> list[OpConfig]:
    """≤ ``limit`` shrink configs at BLOCK_SIZE_M = bm (K = hidden, N = S·R); the default first.

    BLOCK_SIZE_N: the whole S·R up to 128 (one column tile), or 32 (more programs at decode);
    BLOCK_SIZE_K 64/128/256 with SPLIT_K around the default's (×½, ×1, ×2, ×4; each split gets ≥ one
    K chunk); 8 warps for 128 × 128 tiles; 3–4 stages; GROUP_SIZE_M 8. Dropped: shared memory over
    :data:`SMEM_LIMIT_BYTES`."""
    full = _p2(n, 16, 128)
    w = 8 if bm * full >= 128 * 128 else 4
    sk = dflt.SPLIT_K
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm, NUM_WARPS=max(dflt.NUM_WARPS, w))
    raw = [d]
    for bn, bk, s, st in [
        (full, 64, sk, 3),
        (full, 64, 2 * sk, 3),
        (full, 128, sk, 3),
        (full, 64, sk // 2, 3),
        (full, 128, sk // 2, 4),
        (full, 256, sk // 4, 3),
        (min(full, 32), 64, sk, 3),
        (full, 64, 4 * sk, 3),
        (full, 64, sk, 4),
        (full, 128, 2 * sk, 3),
        (min(full, 32), 128, 2 * sk, 3),
    ]:
        s = _p2(s, 1, 32)
        if bk > next_pow2(hidden):
            continue
        while s > 1 and bk * s > hidden:  # every split gets at least one K chunk
            s //= 2
        ww = 8 if bm * bn >= 128 * 128 else 4
        raw.append(OpConfig(bm, bn, bk, 8, s, ww, st))
    raw = [c for c in raw if c is d or _smem_shrink(c, elem) <= SMEM_LIMIT_BYTES]
    return dedupe(raw, limit)


def expand_candidates(
    bm: int, dflt: OpConfig, *, rank: int, widest: int, limit: int = 8, elem: int = 2
) -> list[OpConfig]:
    """≤ ``limit`` expand configs at BLOCK_SIZE_M = bm (K = R, N = the slices); the default first.

    BLOCK_SIZE_K = max(16, next_pow2(R)) (the whole rank in one step); BLOCK_SIZE_N 32–256 (clamped
    to the widest slice; 256 not with BM 128); GROUP_SIZE_M 8 or 1; 4 or 8 warps; 2–3 stages.
    Dropped: shared memory over :data:`SMEM_LIMIT_BYTES`."""
    bk = _p2(rank, 16, 1 << 30)
    cap = _p2(widest, 16, 256)
    d = dataclasses.replace(dflt, BLOCK_SIZE_M=bm)
    raw = [d]
    for bn, g, w, st in [
        (128, 8, 4, 2),
        (64, 8, 4, 2),
        (256, 8, 8, 2),
        (128, 8, 8, 3),
        (32, 8, 4, 2),
        (128, 1, 4, 3),
        (64, 1, 4, 3),
        (256, 8, 4, 3),
        (64, 8, 8, 3),
        (128, 8, 4, 4),
    ]:
        bn = min(bn, cap)
        if bm >= 128 and bn >= 256:
            continue
        w = 8 if bm * bn >= 128 * 128 else w
        raw.append(OpConfig(bm, bn, bk, g, 1, w, st))
    raw = [c for c in raw if c is d or _smem_expand(c, elem) <= SMEM_LIMIT_BYTES]
    return dedupe(raw, limit)


# ------------------------------------------------------------------------------------------------
# The plan: workloads, which ops they tune, the candidates, the compiles
# ------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    proj: Projection
    R: int
    L: int
    T: int
    shrink_shared: bool = False  # the shrink entry exists already (this run or the --out file)
    expand_shared: bool = False
    done: bool = False  # choices in the CSV

    @property
    def ids(self) -> dict[str, Any]:
        p = self.proj
        return dict(
            model=p.model,
            proj=p.proj,
            H=p.hidden,
            slices=p.slices_str,
            S=len(p.slices),
            N=sum(p.slices),
            R=self.R,
            L=self.L,
            T=self.T,
        )

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
            return shrink_candidates(
                bm, d.shrink, hidden=p.hidden, n=len(p.slices) * self.R, limit=limit, elem=elem
            )
        return expand_candidates(bm, d.expand, rank=self.R, widest=max(p.slices), limit=limit, elem=elem)


def _leaf_at(data: dict, keys: tuple[int, ...]):
    node = data
    for k in keys:
        if not isinstance(node, dict) or str(k) not in node:
            return None
        node = node[str(k)]
    return node


def plan(
    projs: Sequence[Projection],
    ranks: Sequence[int],
    adapters: int,
    tokens: Sequence[int],
    *,
    files: _DenseFiles | None = None,
    log: _TrialLog | None = None,
    max_bms: int = 2,
) -> list[Workload]:
    """The workloads in run order (R, then T, then projection: a budget cut leaves gaps across
    T, not whole models), each marked done (in the CSV) and with which of its ops take an existing
    entry (point 2 of the module docstring: decided by the keys alone, before any timing)."""
    seen = {"dense_shrink": set(), "dense_expand": set()}
    out = []
    for R in ranks:
        for T in tokens:
            for p in projs:
                w = Workload(p, R, adapters, T)
                w.done = bool(log and log.choices(w))
                for op, attr in (("dense_shrink", "shrink_shared"), ("dense_expand", "expand_shared")):
                    k = w.keys(op)
                    in_file = files is not None and _leaf_at(files.data[op], k) is not None
                    setattr(w, attr, not w.done and (k in seen[op] or in_file))
                    seen[op].add(k)
                out.append(w)
    return out


def _meta_launch(job: dict):
    """The :class:`~moelora_lib.kernels.dense_lora.DenseLaunch` of one compile job on meta tensors
    (as stage ``tuned`` launches it; T = 16: the key does not depend on T)."""
    from ..kernels import STAGES
    from ..kernels.dense_lora import DenseLoRAConfig, default_dense_config, dense_launches
    from ..routing import align_tokens

    H, slices, R, L = job["H"], tuple(job["slices"]), job["R"], job["L"]
    cfg = OpConfig(**job["cfg"])
    d = default_dense_config(16, hidden=H, slices=slices, rank=R, adapters=L)
    other = dataclasses.replace(
        d.expand if job["op"] == "shrink" else d.shrink, BLOCK_SIZE_M=cfg.BLOCK_SIZE_M
    )
    pair = DenseLoRAConfig(cfg, other) if job["op"] == "shrink" else DenseLoRAConfig(other, cfg)
    dt = parse_dtype(job["dtype"])
    meta = dict(device="meta", dtype=dt)
    T = 16
    ids = (torch.arange(T) % L).to(torch.int32)
    al = align_tokens(
        torch.zeros(T, 1, dtype=torch.int32),
        1,
        cfg.BLOCK_SIZE_M,
        lora_ids=ids,
        num_adapters=L,
        check_values=False,
    )
    fields = ("sorted_token_ids", "block_expert_ids", "block_lora_ids", "num_tokens_post_padded")
    al = dataclasses.replace(al, **{f: getattr(al, f).to("meta") for f in fields})
    x, out = torch.empty(T, H, **meta), torch.empty(T, sum(slices), **meta)
    a, b = torch.empty(L, len(slices), R, H, **meta), torch.empty(L, sum(slices), R, **meta)
    shrink, expand = dense_launches(STAGES[TUNE_STAGE], x, a, b, out, al, pair, slices=slices)
    return shrink if job["op"] == "shrink" else expand


def _compile_key(job: dict) -> str:
    """Triton's cache key of the job's launch when the kernels are compiled ones (on a GPU host),
    else a key made of the shapes and the config (same launch = same key either way)."""
    from ..kernels import STAGES
    from ..kernels.dense_lora import DENSE_KERNELS

    ln = _meta_launch(job)
    jf = DENSE_KERNELS[ln.kernel][STAGES[TUNE_STAGE].specialize_lengths]
    try:
        from .compile_check import specialization_key

        return ln.kernel + specialization_key(jf, ln.args, ln.constexprs, ln.num_warps, ln.num_stages)
    except Exception:  # interpreted kernels (CPU): no Triton key
        shape = (
            (job["H"], len(job["slices"]) * job["R"]) if job["op"] == "shrink" else (job["slices"], job["R"])
        )
        return json.dumps([ln.kernel, shape, sorted(ln.constexprs.items()), ln.num_warps, ln.num_stages])


def compile_jobs(workloads: Sequence[Workload], *, max_bms: int, max_cands: int, dtype: str) -> list[dict]:
    """One job per distinct kernel binary the not-done workloads may time (every BM candidate of
    the ops they tune), deduplicated by Triton's cache key."""
    elem = parse_dtype(dtype).itemsize
    jobs: dict[str, dict] = {}
    seen: set[str] = set()
    for w in workloads:
        if w.done:
            continue
        for op, shared in (("shrink", w.shrink_shared), ("expand", w.expand_shared)):
            if shared:
                continue
            for bm in bm_candidates(w.T, w.L, max_bms):
                for c in w.candidates(op, bm, max_cands, elem):
                    job = dict(
                        op=op,
                        H=w.proj.hidden,
                        slices=list(w.proj.slices),
                        R=w.R,
                        L=w.L,
                        cfg=c.to_dict(),
                        dtype=dtype,
                    )
                    raw = json.dumps(job, sort_keys=True)
                    if raw not in seen:  # the same candidate at another T: no new binary
                        seen.add(raw)
                        jobs.setdefault(_compile_key(job), job)
    return list(jobs.values())


def estimate(
    workloads: Sequence[Workload],
    *,
    max_bms: int,
    max_cands: int,
    n_compiles: int,
    jobs: int,
    warmup_ms: float,
    rep_ms: float,
    device: str,
) -> dict[str, float]:
    """Rough seconds of a run: {"compile", "timing", "workloads", "startup", "total", "trials"}.

    GPU: compiles × :data:`COMPILE_S` / jobs (+ :data:`WORKER_START_S`, + :data:`CACHE_LOAD_S` per
    binary), trials × (warm-up + rep + :data:`TRIAL_OVERHEAD_S`), plus per workload
    :data:`WORKLOAD_S` and the fp64 check of the big shapes (2·T·H·N flops at 40 TFLOP/s). CPU: about
    0.05 s per interpreted trial (tiny shapes)."""
    trials = 0
    check_flops = 0.0
    todo = [w for w in workloads if not w.done]
    for w in todo:
        bms = bm_candidates(w.T, w.L, max_bms)
        if w.shrink_shared or w.expand_shared:
            bms = bms[-1:]  # one BM: the existing entry's
        for op, shared in (("shrink", w.shrink_shared), ("expand", w.expand_shared)):
            trials += sum(1 if shared else len(w.candidates(op, bm, max_cands, 2)) for bm in bms)
        check_flops += 2.0 * w.T * w.proj.hidden * sum(w.proj.slices)
    if device == "cpu":
        timing = trials * 0.05
        compile_s = 0.0
        work = len(todo) * 0.1
        startup = 3.0
    else:
        timing = trials * ((warmup_ms + rep_ms) / 1e3 + TRIAL_OVERHEAD_S)
        compile_s = n_compiles * COMPILE_S / max(1, jobs)
        if jobs > 0 and n_compiles:  # worker start, then each binary loaded from the cache
            compile_s += WORKER_START_S + n_compiles * CACHE_LOAD_S
        work = len(todo) * WORKLOAD_S + check_flops / 40e12
        startup = STARTUP_S
    total = timing + compile_s + work + startup
    return dict(compile=compile_s, timing=timing, workloads=work, startup=startup, total=total, trials=trials)


# ------------------------------------------------------------------------------------------------
# Parallel compile (best effort; fills Triton's on-disk cache)
# ------------------------------------------------------------------------------------------------
def _precompile_main() -> int:
    """Worker: compile the jobs of the JSON file argv[1] for sm_<arch>, one JSON line per job to
    argv[2]. Runs without TRITON_INTERPRET (see :func:`precompile`)."""
    jobs_path, out_path, arch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from ..kernels import STAGES
    from ..kernels.dense_lora import DENSE_KERNELS
    from .compile_check import compile_for_sm90

    with open(jobs_path) as f:
        jobs = json.load(f)
    with open(out_path, "a") as out:
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            try:
                ln = _meta_launch(job)
                jf = DENSE_KERNELS[ln.kernel][STAGES[TUNE_STAGE].specialize_lengths]
                compile_for_sm90(jf, ln.args, ln.constexprs, ln.num_warps, ln.num_stages, arch=arch)
                res = dict(i=i, ok=True)
            except Exception as e:
                res = dict(i=i, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            res["s"] = round(time.perf_counter() - t0, 3)
            out.write(json.dumps(res) + "\n")
            out.flush()
    return 0


def precompile(jobs: list[dict], n_proc: int, timeout_s: float, arch: int) -> dict[str, Any]:
    """Compile ``jobs`` in ``n_proc`` fresh processes (no GPU used, TRITON_INTERPRET removed), at most
    ``timeout_s`` seconds; processes still running then are killed (the rest compiles on demand).
    Returns {"jobs", "ok", "failed", "unfinished", "wall_s", "compile_s", "errors"}."""
    t0 = time.perf_counter()
    stats: dict[str, Any] = dict(jobs=len(jobs), ok=0, failed=0, unfinished=0, compile_s=0.0, errors=[])
    if not jobs or n_proc <= 0:
        stats["unfinished"] = len(jobs)
        stats["wall_s"] = 0.0
        return stats
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from moelora_lib.studies.dense_tuning import _precompile_main as m; sys.exit(m())"
    n_proc = min(n_proc, len(jobs))
    shards = [jobs[i::n_proc] for i in range(n_proc)]
    with tempfile.TemporaryDirectory(prefix="dense_precompile_") as tmp:
        procs, killed = [], set()
        for k, shard in enumerate(shards):
            jp, op, ep = (Path(tmp) / f"{k}.{s}" for s in ("jobs.json", "out.jsonl", "err.txt"))
            jp.write_text(json.dumps(shard))
            err = open(ep, "w")
            p = subprocess.Popen(
                [sys.executable, "-c", code, str(jp), str(op), str(arch)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=root,
            )
            procs.append((p, err, op, ep, len(shard)))
        deadline = time.perf_counter() + timeout_s
        while any(p.poll() is None for p, *_ in procs) and time.perf_counter() < deadline:
            time.sleep(0.2)
        for p, err, op, ep, n in procs:
            if p.poll() is None:
                p.kill()  # only the processes started here
                p.wait()
                killed.add(p.pid)
            err.close()
            lines = op.read_text().splitlines() if op.exists() else []
            results = [json.loads(x) for x in lines if x.strip()]
            stats["ok"] += sum(r["ok"] for r in results)
            stats["failed"] += sum(not r["ok"] for r in results)
            stats["unfinished"] += n - len(results)
            stats["compile_s"] += sum(r["s"] for r in results)
            stats["errors"] += [r["error"] for r in results if not r["ok"]][:3]
            if p.pid in killed:
                stats["errors"].append(
                    f"worker stopped at the {timeout_s:.0f} s limit ({n - len(results)} left)"
                )
            elif p.returncode != 0:
                stats["errors"].append(f"worker rc {p.returncode}: {ep.read_text()[-500:]}")
    stats["wall_s"] = time.perf_counter() - t0
    return stats


# ------------------------------------------------------------------------------------------------
# CSV (appended row by row) and the JSON files
# ------------------------------------------------------------------------------------------------
CSV_COLUMNS = [
    "kind",
    "model",
    "proj",
    "H",
    "slices",
    "S",
    "N",
    "R",
    "L",
    "T",
    *TRIAL_COLUMNS,
    "rel_err",
    *RUN_COLUMNS,
]
_KEY_COLUMNS = ("kind", "model", "proj", "H", "slices", "R", "L", "T", "op", "config_json")


class _TrialLog(TrialLog):
    def __init__(self, path: Path):
        super().__init__(path, CSV_COLUMNS)

    def choices(self, w: Workload) -> dict[str, OpConfig]:
        """{"shrink", "expand"} chosen for workload ``w`` (empty unless both are in the CSV)."""
        want = {k: str(v) for k, v in w.ids.items() if k in ("model", "proj", "H", "slices", "R", "L", "T")}
        out = {}
        for r in self.rows:
            if r.get("kind") == "choice" and all(r.get(k) == v for k, v in want.items()):
                out[r["op"]] = OpConfig.from_dict(json.loads(r["config_json"]), where=str(self.path))
        return out if set(out) == {"shrink", "expand"} else {}


class _DenseFiles(ConfigFiles):
    """The two JSON files of one folder (shrink, expand with add_inputs), read once, saved atomically."""

    def __init__(self, folder: Path, gpu: str):
        super().__init__(folder, gpu, configs.DENSE_FILE_OPS)

    def path(self, op: str) -> Path:
        return self.folder / configs.dense_config_file_name(self.gpu, op, True)

    def get(self, op: str, keys) -> OpConfig | None:
        leaf = _leaf_at(self.data[op], keys)
        return None if leaf is None else configs._parse_dense_leaf(leaf, f"{self.path(op)}")

    def put(self, w: Workload, shrink: OpConfig, expand: OpConfig) -> None:
        configs.set_entry(
            self.data["dense_shrink"], w.keys("dense_shrink"), configs.dense_leaf(shrink, "shrink")
        )
        configs.set_entry(
            self.data["dense_expand"], w.keys("dense_expand"), configs.dense_leaf(expand, "expand")
        )


# ------------------------------------------------------------------------------------------------
# One workload
# ------------------------------------------------------------------------------------------------
class _Inputs:
    """The tensors of one projection (up to the largest T), made once per (projection, R)."""

    def __init__(self, proj: Projection, R: int, L: int, max_T: int, dtype, device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: 10^8 values at T = 8192
        H, S, N = proj.hidden, len(proj.slices), sum(proj.slices)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        self.x = rnd(max_T, H)
        self.a = rnd(L, S, R, H, scale=H**-0.5)
        self.b = rnd(L, N, R, scale=R**-0.5)
        self.out = torch.zeros(max_T, N, dtype=dtype, device=device)
        self.inter = torch.zeros(max_T, S * R, dtype=torch.float32, device=device)
        self.proj, self.R, self.L, self.seed, self.device = proj, R, L, seed, torch.device(device)

    def ids(self, T: int) -> torch.Tensor:
        """Every token with an adapter, spread evenly over the L slots, in a shuffled order."""
        g = torch.Generator(device="cpu").manual_seed(self.seed + T)
        ids = (torch.arange(T) % self.L)[torch.randperm(T, generator=g)]
        return ids.to(torch.int32).to(self.device)


def _align(inp: _Inputs, ids: torch.Tensor, bm: int):
    from ..lora_linear import _align_oneshot

    return _align_oneshot(ids, inp.L, bm)


def _op_fn(op: str, inp: _Inputs, T: int, align, cfg: OpConfig) -> Callable[[], Any]:
    from ..kernels import STAGES
    from ..kernels.dense_lora import dense_expand, dense_shrink

    st = STAGES[TUNE_STAGE]
    x, inter, out = inp.x[:T], inp.inter[:T], inp.out[:T]
    if op == "shrink":
        return lambda: dense_shrink(
            x, inp.a, align, cfg, use_even_k=st.even_k, specialize_lengths=st.specialize_lengths, inter=inter
        )
    return lambda: dense_expand(
        inter,
        inp.b,
        out,
        align,
        cfg,
        slices=inp.proj.slices,
        add_inputs=st.fused_add,
        use_even_k=st.even_k,
        specialize_lengths=st.specialize_lengths,
    )


def _check(inp: _Inputs, T: int, ids, align, shrink: OpConfig, expand: OpConfig, ref) -> float:
    """rel_err of the pair (stage tuned's dense_lora_add into a zero base) against ``ref``."""
    from ..kernels import STAGES
    from ..kernels.dense_lora import DenseLoRAConfig, dense_lora_add

    out = torch.zeros(T, sum(inp.proj.slices), dtype=inp.x.dtype, device=inp.device)
    cfg = DenseLoRAConfig(shrink, expand, source="tuner")
    dense_lora_add(STAGES[TUNE_STAGE], out, inp.x[:T], inp.a, inp.b, align, cfg, slices=inp.proj.slices)
    return _rel_err(out, ref)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`moelora_lib.testing.rel_err` (max|out − ref| / max|ref|, inf for a non-finite output)
    computed on the device: at T = 8192 the fp64 tensors are several GB."""
    if out.shape != ref.shape:
        return math.inf
    o = out.to(torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def _reference(inp: _Inputs, T: int, ids: torch.Tensor) -> torch.Tensor:
    """The LoRA delta alone in fp64 (lora_linear_reference with a zero base weight)."""
    from ..lora_linear import lora_linear_reference

    N = sum(inp.proj.slices)
    w0 = torch.zeros(N, inp.proj.hidden, dtype=inp.x.dtype, device=inp.device)
    ref = lora_linear_reference(inp.x[:T], w0, inp.a, inp.b, ids, slices=inp.proj.slices)
    del w0
    return ref


def _tune_workload(
    w: Workload,
    inp: _Inputs,
    files: _DenseFiles,
    log: _TrialLog,
    *,
    deadline: float,
    max_bms: int,
    max_cands: int,
    t0: float,
    warmup_ms: float,
    rep_ms: float,
    l2: str,
) -> tuple[OpConfig, OpConfig] | None:
    """Tune one workload (module docstring, points 1–3); returns the checked (shrink, expand), or None
    for a conflict (nothing written)."""
    from ..testing import TOLERANCES
    from . import bench

    dev, T, elem = inp.device, w.T, inp.x.element_size()
    ids_row = w.ids
    fixed = {
        "shrink": files.get("dense_shrink", w.keys("dense_shrink")),
        "expand": files.get("dense_expand", w.keys("dense_expand")),
    }
    fixed = {op: c for op, c in fixed.items() if c is not None}
    bms_fixed = {c.BLOCK_SIZE_M for c in fixed.values()}
    if len(bms_fixed) > 1:
        log.append(
            kind="conflict",
            **ids_row,
            note="existing shrink and expand entries have different BLOCK_SIZE_M: "
            + "; ".join(f"{op}={c.short()}" for op, c in fixed.items()),
        )
        return None
    bms = sorted(bms_fixed) if bms_fixed else bm_candidates(T, w.L, max_bms)
    dflt = w.default()
    ids = inp.ids(T)
    inp.out.zero_()  # the expand timings add into it

    def timed(op, align, cfg):
        fn = _op_fn(op, inp, T, align, cfg)
        return bench.time_fn(fn, "graph", dev, warmup_ms, rep_ms, flush_l2=l2 if l2 == "clean" else True)

    ranked: dict[int, dict[str, list[tuple[float, OpConfig]]]] = {}
    aligns = {}
    for n_bm, bm in enumerate(bms):
        if n_bm > 0 and over_budget(deadline, log, BUDGET_BM_NOTE, **ids_row, BLOCK_SIZE_M=bm):
            continue
        align = aligns[bm] = _align(inp, ids, bm)
        # a valid rank intermediate for the expand timings (the first shrink candidate at this BM)
        pre = fixed.get("shrink") or w.candidates("shrink", bm, max_cands, elem)[0]
        _op_fn("shrink", inp, T, align, pre)()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ranked[bm] = {}
        for op in ("shrink", "expand"):
            if op in fixed:
                cands, note0 = [fixed[op]], "shared entry (not tuned here)"
            else:
                cands, note0 = w.candidates(op, bm, max_cands, elem), "default"
            res = []
            default_ms = None
            for i, c in enumerate(cands):
                timer = functools.partial(timed, op, align, c)
                # on the CPU: interpreter wall clock, not performance
                ms, extra, note = time_candidate(timer, dev, note0 if i == 0 else "", 160, "cpu-interpreter")
                if i == 0 and op not in fixed:
                    default_ms = ms
                extra.update(ms_p50=ms, default_ms=default_ms, note=note)
                append_config_row(log, "trial", ids_row, op, bm, c, t0=t0, **extra)
                res.append((ms, c))
            ranked[bm][op] = sorted(res, key=lambda r: r[0])
        best = {op: ranked[bm][op][0] for op in ("shrink", "expand")}
        log.append(
            kind="bm_sum",
            **ids_row,
            BLOCK_SIZE_M=bm,
            sum_ms=best["shrink"][0] + best["expand"][0],
            config=f"shrink={best['shrink'][1].short()};expand={best['expand'][1].short()}",
        )
    # pairs in order of summed time (each BM's top 3 × top 3), then the default config
    pairs = []
    for bm, r in ranked.items():
        for ms_s, cs in r["shrink"][:3]:
            for ms_e, ce in r["expand"][:3]:
                if math.isfinite(ms_s + ms_e):
                    pairs.append((ms_s + ms_e, bm, cs, ce))
    pairs.sort(key=lambda p: p[0])
    pairs = pairs[:5]
    if not fixed or dflt.block_size_m in bms_fixed:
        dbm = dflt.block_size_m
        pairs.append((math.nan, dbm, fixed.get("shrink", dflt.shrink), fixed.get("expand", dflt.expand)))
    tol = TOLERANCES[inp.x.dtype]
    ref = _reference(inp, T, ids)
    for total, bm, cs, ce in pairs:
        align = aligns.get(bm) or _align(inp, ids, bm)
        try:
            err = _check(inp, T, ids, align, cs, ce, ref)
        except Exception as e:
            err, why = math.inf, f"{type(e).__name__}: {str(e)[:160]}"
        else:
            why = ""
        ok = err <= tol
        log.append(
            kind="check",
            **ids_row,
            op="pair",
            BLOCK_SIZE_M=bm,
            config=f"shrink={cs.short()};expand={ce.short()}",
            sum_ms=total,
            rel_err=err,
            note=("ok" if ok else f"WRONG (tolerance {tol:.1e}) {why}").strip(),
        )
        if ok:
            for op, c in (("shrink", cs), ("expand", ce)):
                ms = next((m for m, cc in ranked.get(bm, {}).get(op, []) if cc == c), math.nan)
                note = "shared entry" if op in fixed else ("default" if math.isnan(total) else "")
                append_config_row(
                    log, "choice", ids_row, op, bm, c, t0=t0, ms_p50=ms, sum_ms=total, rel_err=err, note=note
                )
            del ref
            return cs, ce
    raise RuntimeError(
        f"{w.proj.label} R={w.R} L={w.L} T={T}: no config passed the correctness check (see the "
        f"'check' rows of {log.path}); the kernels or the reference are broken"
    )


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def _check_csv(csv_path, name: str | None = "csv_path") -> Path:
    """A trials CSV of this tuner (resumed), an empty file, or a new file in a writable folder."""
    return check_csv(csv_path, name, _KEY_COLUMNS, "the dense tuner")


def _defaults(device, max_bms, max_cands, jobs) -> tuple:
    """max_bms, max_cands, jobs with the device's defaults where None (CPU: 1, 2, 0; GPU: 2, 8,
    min(14, cpu count − 2))."""
    try:
        on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    except (RuntimeError, TypeError):
        on_cpu = False  # an invalid device: _check_args names it
    max_bms = (1 if on_cpu else 2) if max_bms is None else max_bms
    max_cands = (CPU_MAX_CANDIDATES if on_cpu else 8) if max_cands is None else max_cands
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use (a container's share)
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 2
    jobs = (0 if on_cpu else max(0, min(14, cpus - 2))) if jobs is None else jobs
    return max_bms, max_cands, jobs


def _check_args(
    projs,
    ranks,
    adapters,
    tokens,
    out,
    csv_path,
    budget_s,
    device,
    dtype,
    max_bms,
    max_cands,
    jobs,
    seed,
    warmup_ms,
    rep_ms,
    l2,
    *,
    names: dict[str, str] | None = None,
    need_device: bool = True,
) -> tuple[list[Projection], torch.device, torch.dtype]:
    """Validate every argument of :func:`tune` before any work; ValueError naming the argument (by its
    CLI flag when ``names`` maps argument -> flag)."""
    from ..shapes import check_int

    n = {arg: arg for arg in _FLAGS}  # the arguments by their own names, unless ``names`` maps them
    n.update(names or {})
    try:
        ps = projections(projs) if isinstance(projs, (str, list, tuple)) else None
    except ValueError as e:
        raise ValueError(f"{n['projections']}: {e}") from None
    if not ps:
        raise ValueError(f"{n['projections']}: expected 'all' or model[/proj] names, got {projs!r}")
    for name, vals in (("ranks", ranks), ("tokens", tokens)):
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence) or not vals:
            raise ValueError(f"{n[name]}: expected a non-empty list of ints >= 1, got {vals!r}")
        for v in vals:
            check_int(n[name], v, 1)
    check_int(n["adapters"], adapters, 1)
    check_int(n["max_bms"], max_bms, 1)
    check_int(n["max_cands"], max_cands, 1, 16)
    check_int(n["jobs"], jobs, 0, 64)
    check_int(n["seed"], seed)
    check_budget(budget_s, n["budget_s"])
    for name, v, lo in (("warmup_ms", warmup_ms, 0.0), ("rep_ms", rep_ms, 0.001)):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo
        if not ok:
            raise ValueError(f"{n[name]}: expected a finite number of ms >= {lo:g}, got {v!r}")
    if l2 not in ("clean", "dirty"):
        raise ValueError(f"{n['l2']}: expected 'clean' or 'dirty', got {l2!r}")
    if need_device:
        dev = check_device(device, n["device"])
    else:  # a plan only (--dry-run): the device need not be here
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{n['device']}: the tuner runs on 'cpu' or 'cuda', got {device!r}")
    try:
        dt = (
            parse_dtype(dtype)
            if dtype is not None
            else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        )
    except ValueError as e:
        raise ValueError(f"{n['dtype']}: {e}") from None
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{n['dtype']}: expected float16, bfloat16 or float32, got {dtype!r}")
    if dev.type == "cpu":
        big = [p.label for p in ps if p.model not in CPU_MODELS]
        if big:
            raise ValueError(
                f"{n['projections']}: the CPU (Triton interpreter) runs only the smoke presets "
                f"{list(CPU_MODELS)} (e.g. 'tiny' or 'tiny/qkv'), got {big}; the model presets are for "
                "the GPU"
            )
        if max(tokens) > CPU_MAX_TOKENS:
            raise ValueError(
                f"{n['tokens']}: at most {CPU_MAX_TOKENS} tokens on the CPU (interpreter), got {max(tokens)}"
            )
        if max_cands > CPU_MAX_CANDIDATES:
            raise ValueError(
                f"{n['max_cands']}: at most {CPU_MAX_CANDIDATES} candidates on the CPU (interpreter), "
                f"got {max_cands}"
            )
        if dt == torch.bfloat16:
            raise ValueError(
                f"{n['dtype']}: bfloat16 does not run on the CPU interpreter; use float32 or float16"
            )
    check_out(out, n["out"])
    _check_csv(csv_path, n["csv_path"])
    return ps, dev, dt


# ------------------------------------------------------------------------------------------------
# The whole run
# ------------------------------------------------------------------------------------------------
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
    warmup_ms: float = 5.0,
    rep_ms: float = 20.0,
    l2: str = "clean",
    progress: bool = True,
    dry_run: bool = False,
    names: dict[str, str] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Tune every (projection, R, T) workload and write ``{gpu}_SHRINK.json`` /
    ``{gpu}_EXPAND_TRUE.json`` into ``out`` (module docstring); returns a summary dict (tuned,
    skipped, not_tuned, conflicts, estimate, precompile, elapsed_s, out, gpu).

    Defaults by device: max_bms 2 (CPU 1), max_cands 8 (CPU 2), jobs = min(14, cpu count − 2) (CPU 0:
    the interpreter compiles nothing). ``dry_run``: validate, plan, print the estimate, tune nothing.
    Raises ValueError naming the argument before any work (see :func:`_check_args`).
    """
    max_bms, max_cands, jobs = _defaults(device, max_bms, max_cands, jobs)
    ps, dev, dt = _check_args(
        projs,
        ranks,
        adapters,
        tokens,
        out,
        csv_path,
        budget_s,
        device,
        dtype,
        max_bms,
        max_cands,
        jobs,
        seed,
        warmup_ms,
        rep_ms,
        l2,
        names=names,
        need_device=not dry_run,
    )
    if dev.type == "cpu":
        jobs = 0
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    if dev.type == "cuda":
        gpu = configs.gpu_name() if torch.cuda.is_available() else "NVIDIA_H200"  # (dry run without a GPU)
    else:
        gpu = "cpu"
    # a dry run only reads: the CSV and the files if they exist
    log = _TrialLog(Path(csv_path)) if not dry_run or Path(csv_path).is_file() else None
    files = _DenseFiles(Path(out), gpu) if not dry_run or Path(out).is_dir() else None
    if log is not None and files is not None:
        for w in plan(ps, ranks, adapters, tokens, max_bms=max_bms):  # finished work first (resume)
            done = log.choices(w)
            if done:
                files.put(w, done["shrink"], done["expand"])
    wls = plan(ps, ranks, adapters, tokens, files=files, log=log, max_bms=max_bms)
    dname = str(dt).removeprefix("torch.")
    cjobs = compile_jobs(wls, max_bms=max_bms, max_cands=max_cands, dtype=dname) if dev.type == "cuda" else []
    est = estimate(
        wls,
        max_bms=max_bms,
        max_cands=max_cands,
        n_compiles=len(cjobs),
        jobs=jobs,
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        device=dev.type,
    )
    todo = [w for w in wls if not w.done]
    summary: dict[str, Any] = dict(
        tuned=[], skipped=[], not_tuned=[], conflicts=[], estimate=est, out=str(out), gpu=gpu, precompile=None
    )
    if dev.type == "cpu":
        echo(
            "dense_tuning: CPU SMOKE RUN under the Triton interpreter: tiny shapes, "
            f"{max_cands} candidate(s) per op; times are interpreter wall clock, NOT kernel performance; "
            f"files for GPU name 'cpu'"
        )
    echo(
        f"dense_tuning: {len(ps)} projections x {len(ranks)} rank(s) x {len(tokens)} T = "
        f"{len(wls)} workloads ({len(wls) - len(todo)} already in the CSV); {est['trials']} trials, "
        f"{len(cjobs)} distinct kernels to compile in {jobs} process(es); estimate ~{est['total']:.0f} s "
        f"(compile ~{est['compile']:.0f} s, timing ~{est['timing']:.0f} s, inputs/checks "
        f"~{est['workloads']:.0f} s, start ~{est['startup']:.0f} s)"
        + (f"; budget {budget_s:.0f} s" if math.isfinite(budget_s) else "")
    )
    if dry_run:
        summary["elapsed_s"] = time.perf_counter() - t0
        summary["workloads"] = wls
        summary["compile_jobs"] = cjobs
        return summary
    assert log is not None and files is not None
    if cjobs and jobs > 0:
        arch = 10 * torch.cuda.get_device_capability(dev)[0] + torch.cuda.get_device_capability(dev)[1]
        timeout = min(300.0, 0.6 * budget_s) if math.isfinite(budget_s) else 300.0
        st = precompile(cjobs, jobs, timeout, arch)
        summary["precompile"] = st
        log.append(
            kind="precompile",
            elapsed_s=round(time.perf_counter() - t0, 2),
            note=f"{st['ok']} ok, {st['failed']} failed, {st['unfinished']} unfinished of {st['jobs']} in "
            f"{st['wall_s']:.1f} s wall ({st['compile_s']:.0f} s of compiles) on {jobs} processes"
            + (f"; errors: {st['errors'][:3]}" if st["errors"] else ""),
        )
        echo(f"dense_tuning: precompile {log.rows[-1]['note']}")
    from .notebook import progress as bar_of

    inputs: dict[tuple, _Inputs] = {}
    max_T = max(tokens)
    bar = bar_of(wls, desc="dense tuning", disable=not progress)
    files.save()
    for w in bar:
        bar.set_postfix_str(f"{w.proj.label} R={w.R} T={w.T} {time.perf_counter() - t0:.0f}s")
        if log.choices(w):  # already in the files (put above)
            summary["skipped"].append((w.proj.label, w.R, w.T))
            continue
        if over_budget(deadline, log, BUDGET_WORKLOAD_NOTE, **w.ids):
            summary["not_tuned"].append((w.proj.label, w.R, w.T))
            continue
        key = (w.proj, w.R)
        if key not in inputs:
            if any(k[1] != w.R for k in inputs):  # the projections of one rank stay on the device
                inputs.clear()  # (all 12 at T = 8192: < 5 GB)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            inputs[key] = _Inputs(w.proj, w.R, w.L, max_T, dt, dev, seed)
        got = _tune_workload(
            w,
            inputs[key],
            files,
            log,
            deadline=deadline,
            max_bms=max_bms,
            max_cands=max_cands,
            t0=t0,
            warmup_ms=warmup_ms,
            rep_ms=rep_ms,
            l2=l2,
        )
        if got is None:
            summary["conflicts"].append((w.proj.label, w.R, w.T))
            continue
        files.put(w, *got)
        summary["tuned"].append((w.proj.label, w.R, w.T))
        files.save()
    inputs.clear()
    elapsed = time.perf_counter() - t0
    log.append(
        kind="session",
        elapsed_s=round(elapsed, 2),
        note=f"tuned {len(summary['tuned'])}, skipped {len(summary['skipped'])}, not tuned (budget) "
        f"{len(summary['not_tuned'])}, conflicts {len(summary['conflicts'])}; "
        f"estimate was {est['total']:.0f} s"
        + ("; CPU smoke run (interpreter wall clock, not performance)" if dev.type == "cpu" else ""),
    )
    summary["elapsed_s"] = elapsed
    return summary


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
_FLAGS = dict(
    projections="--projections",
    ranks="--ranks",
    adapters="--adapters",
    tokens="--tokens",
    out="--out",
    csv_path="--csv",
    budget_s="--budget-s",
    device="--device",
    dtype="--dtype",
    max_bms="--max-bms",
    max_cands="--max-candidates",
    jobs="--jobs",
    seed="--seed",
    warmup_ms="--warmup-ms",
    rep_ms="--rep-ms",
    l2="--l2",
)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring). Every flag is checked before any work: a bad one
    exits with code 2 and one error line naming the flag."""
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.studies.dense_tuning", description=__doc__.split("\n\n")[0]
    )

    def projs_type(text: str) -> str:
        projections(text)  # ValueError naming the unknown item
        return text

    def float_type(lo: float, what: str):
        def parse(text: str) -> float:
            try:
                v = float(text)
            except ValueError:
                raise ValueError(f"expected {what} >= {lo:g}, got {text!r}") from None
            if not (v >= lo and math.isfinite(v)):
                raise ValueError(f"expected a finite {what} >= {lo:g}, got {text!r}")
            return v

        return arg_type(parse, what)

    pos_int = arg_type(lambda t: parse_int(t, 1), "int >= 1")
    p.add_argument(
        "--projections",
        required=True,
        type=arg_type(projs_type, "projections"),
        help="'all', or comma-separated model[/proj] (models: " + ", ".join(DENSE_MODELS) + ")",
    )
    p.add_argument("--tokens", default="1,8,64,256,1600,8192", type=int_list_type(1), help="T values")
    p.add_argument("--ranks", default="32", type=int_list_type(1), help="R values (max LoRA rank)")
    p.add_argument("--adapters", type=pos_int, default=8, help="L, adapter slots")
    p.add_argument("--out", required=True, help="config folder to write the two JSON files into")
    p.add_argument("--csv", required=True, help="trials CSV (appended; resumable)")
    p.add_argument(
        "--budget-s",
        type=arg_type(budget_type, "seconds"),
        default=math.inf,
        help="no new workload starts past this many seconds",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default), float16, float32 (CPU default)")
    p.add_argument("--max-bms", type=pos_int, default=None, help="BLOCK_SIZE_M candidates (+ the default's)")
    p.add_argument(
        "--max-candidates", type=pos_int, default=None, help="configs per op and BLOCK_SIZE_M (GPU 8, CPU 2)"
    )
    p.add_argument(
        "--jobs",
        type=arg_type(lambda t: parse_int(t, 0), "int >= 0"),
        default=None,
        help="parallel compile processes (default min(14, cpus - 2); 0 = compile on demand)",
    )
    p.add_argument("--seed", type=arg_type(lambda t: parse_int(t, None), "int"), default=0)
    p.add_argument("--warmup-ms", type=float_type(0, "ms"), default=5.0)
    p.add_argument("--rep-ms", type=float_type(0.001, "ms"), default=20.0)
    p.add_argument(
        "--l2", choices=["clean", "dirty"], default="clean", help="L2 flush before every repetition"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--dry-run", action="store_true", help="check the flags, print the plan and estimate, exit"
    )
    a = p.parse_args(argv)
    # tune's arguments by name (_FLAGS: argument -> its flag), the first six positional
    kw = {arg: getattr(a, flag[2:].replace("-", "_")) for arg, flag in _FLAGS.items()}
    pos = [kw.pop(arg) for arg in ("projections", "ranks", "adapters", "tokens", "out", "csv_path")]
    resolved = _defaults(a.device, a.max_bms, a.max_candidates, a.jobs)
    try:  # every flag checked before any work
        checked = {**kw, **dict(zip(("max_bms", "max_cands", "jobs"), resolved))}
        _check_args(*pos, **checked, names=_FLAGS, need_device=not a.dry_run)
    except ValueError as e:
        p.error(str(e))
    s = tune(*pos, dry_run=a.dry_run, progress=not a.no_progress, names=_FLAGS, **kw)
    if a.dry_run:
        return 0
    print(
        f"dense_tuning: {len(s['tuned'])} workloads tuned, {len(s['skipped'])} already done, "
        f"{len(s['not_tuned'])} not tuned (budget): {s['not_tuned']}, {len(s['conflicts'])} conflicts: "
        f"{s['conflicts']}; wrote {s['out']} ({s['gpu']}); elapsed {s['elapsed_s']:.1f} s "
        f"(estimate {s['estimate']['total']:.0f} s)"
        + ("; CPU smoke run: interpreter wall clock, NOT performance" if s["gpu"] == "cpu" else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
