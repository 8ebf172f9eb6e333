"""Compile-only checks of the kernels for sm_90 (H200) on a machine without a GPU.

Every compile runs in ONE subprocess (``moelora_lib.studies.compile_check.run_isolated``) started without
TRITON_INTERPRET: the kernels must be decorated without the interpreter, while conftest sets it for
this test process (environment.md §2–§3). The jobs are submitted once by a module fixture; each
test reads its results. Launch arguments are built by the launchers' own ``*_args`` functions at
gpt-oss-20b shapes (H = I = 2880, E = 32, top-4, R = 32, L = 8, bf16), so length-dependent
arguments follow T exactly as in the layer.
"""

from __future__ import annotations

import time

import pytest
from ptx_text import has_atomic_add, k_loop_bodies, masked_global_loads, tensor_core_ops

from moelora_lib.studies.compile_check import KERNEL_NAMES, run_isolated

# ≥ 16 prompt lengths: == 1 (T = 1 still gives T·K = 4 pairs), multiples of 16 and not, up to 8192
LENGTHS = [1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 1000, 1024, 4096, 8192]
SHAPE = "gpt-oss-20b"
# spill check: T buckets where default_config changes (decode, small batch, prefill, long prefill)
SPILL_T = [1, 256, 1600, 8192]
LAUNCHES = [
    "base_gate_up",
    "base_down",
    "gate_up_shrink",
    "gate_up_expand",
    "down_shrink",
    "down_expand",
    "act",
]
LORA_KERNELS = ["fused_moe", "lora_shrink", "lora_expand"]


def _jobs():
    from moelora_lib.kernels.stages import default_config
    from moelora_lib.shapes import Dims

    jobs = {}
    # (a) variant counts: one fixed config over all lengths (keys and compiled hashes), and the
    # per-length default configs as the layer launches them (keys only)
    for kernel in KERNEL_NAMES:
        for spec in (False, True):
            common = dict(op="count", kernel=kernel, specialize_lengths=spec, lengths=LENGTHS, shape=SHAPE)
            jobs[("count", kernel, spec, "fixed")] = common
            if kernel != "gated_act":
                jobs[("count", kernel, spec, "auto")] = dict(common, cfg="auto", compile=False)
    second = {"base_down": "fused_moe", "down_shrink": "lora_shrink", "down_expand": "lora_expand"}
    for launch, kernel in second.items():  # the second launch of each kernel
        jobs[("count", launch, False, "fixed")] = dict(
            op="count",
            kernel=kernel,
            launch_name=launch,
            specialize_lengths=False,
            lengths=LENGTHS,
            shape=SHAPE,
        )
    # (b) EVEN_K: bf16 shrink, K = H = 2048, BK 64, SPLIT_K 1, num_stages 1 (predicated loads)
    for ek in (True, False):
        jobs[("even_k", ek)] = dict(
            op="inspect",
            launch="gate_up_shrink",
            T=64,
            use_even_k=ek,
            shape={"base": SHAPE, "hidden": 2048},
            want=["ptx"],
            cfg=dict(BLOCK_SIZE_K=64, SPLIT_K=1, NUM_STAGES=1),
        )
    # (c) split-K: SPLIT_K 4 vs 1 (K = 2880)
    for sk in (1, 4):
        jobs[("split_k", sk)] = dict(
            op="inspect",
            launch="gate_up_shrink",
            T=64,
            shape=SHAPE,
            want=["ptx", "sass"],
            cfg=dict(SPLIT_K=sk),
        )
    # (d) + (e): default configs at gpt-oss-20b shapes, bf16: tensor cores and spills (one compile per
    # distinct (launch, config))
    seen = set()
    for T in SPILL_T:
        cfg = default_config(Dims.of(SHAPE, T, rank=32, adapters=8))
        for launch in LAUNCHES:
            c = getattr(cfg, launch).short() if launch != "act" else "-"
            if (launch, c) in seen:
                continue
            seen.add((launch, c))
            jobs[("default", launch, T)] = dict(
                op="inspect", launch=launch, T=T, shape=SHAPE, want=["res", "ptx"]
            )
    return jobs


@pytest.fixture(scope="module")
def results():
    jobs = _jobs()
    t0 = time.perf_counter()
    out = run_isolated(list(jobs.values()), timeout=170)
    print(f"\ncompile_check subprocess: {len(jobs)} jobs in {time.perf_counter() - t0:.1f} s")
    return dict(zip(jobs.keys(), out))


# ---- (a) variant counts ------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_no_recompile_one_variant_per_config(results, kernel):
    # stage no_recompile: one cache key and one binary over all 19 lengths for a fixed config
    r = results[("count", kernel, False, "fixed")]
    assert (r["keys"], r["hashes"]) == (1, 1), r["key_list"]


@pytest.mark.parametrize("launch", ["base_down", "down_shrink", "down_expand"])
def test_no_recompile_second_launch(results, launch):
    # the down-projection launches (other strides and rows_div) also compile once over all lengths
    r = results[("count", launch, False, "fixed")]
    assert (r["keys"], r["hashes"]) == (1, 1), r["key_list"]


@pytest.mark.parametrize("kernel", LORA_KERNELS)
def test_no_recompile_auto_configs(results, kernel):
    # with default_config(T) per length (as the layer launches): exactly one key per distinct config
    r = results[("count", kernel, False, "auto")]
    assert r["configs"] >= 2 and r["keys"] == r["configs"], r


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_naive_recompiles(results, kernel):
    # stage naive (Triton's default int specialization): several binaries for one config, so the
    # no_recompile assertion above can fail
    r = results[("count", kernel, True, "fixed")]
    assert r["keys"] > 1 and r["hashes"] == r["keys"], r["per_length"]
    assert results[("count", kernel, True, "fixed")]["per_length"]["16"] != r["per_length"]["17"]


@pytest.mark.parametrize("kernel", LORA_KERNELS)
def test_naive_auto_more_keys_than_configs(results, kernel):
    # naive with per-length configs: more keys than configs (the recompiles come on top)
    r = results[("count", kernel, True, "auto")]
    assert r["keys"] > r["configs"], r


# ---- (b) EVEN_K --------------------------------------------------------------------------------
def _k_loop(ptx: str) -> str:
    """The loop whose body holds the tensor-core dot (the K loop)."""
    loops = [b for b in k_loop_bodies(ptx) if tensor_core_ops(b)["mma_sync"] + tensor_core_ops(b)["wgmma"]]
    assert loops, "no loop with mma/wgmma found in the PTX"
    return min(loops, key=len)  # innermost


def test_even_k_loop_has_no_masked_loads(results):
    # EVEN_K = True: the K loop's global loads (x gather with clamped rows, A with clamped columns)
    # are plain ld.global — none predicated, no cp.async zero-fill
    r = results[("even_k", True)]
    assert r["constexprs"]["EVEN_K"] is True
    loop = masked_global_loads(_k_loop(r["ptx"]))
    assert loop["all_ld_global"] >= 2, loop
    assert loop["predicated"] == 0 and loop["zero_fill"] == 0 and loop["predicated_cp_async"] == 0, loop


def test_even_k_false_loop_has_masked_loads(results):
    # EVEN_K = False (same K, masked path forced): the K loop's loads are predicated (@%p ld.global)
    r = results[("even_k", False)]
    assert r["constexprs"]["EVEN_K"] is False
    loop = masked_global_loads(_k_loop(r["ptx"]))
    assert loop["predicated"] + loop["zero_fill"] + loop["predicated_cp_async"] > 0, loop


# ---- (c) split-K -------------------------------------------------------------------------------
def test_split_k_uses_relaxed_red(results):
    # SPLIT_K 4: relaxed global atomic add in PTX, REDG in SASS
    r = results[("split_k", 4)]
    a = has_atomic_add(r["ptx"], r["sass"])
    assert a["ptx_atomic_add"] > 0 and a["ptx_relaxed"] == a["ptx_atomic_add"], a
    assert a["sass_red"] > 0, a


def test_split_k1_has_no_atomics(results):
    # SPLIT_K 1: plain stores, no atomic of any kind
    r = results[("split_k", 1)]
    a = has_atomic_add(r["ptx"], r["sass"])
    assert a == {"ptx_atomic_add": 0, "ptx_relaxed": 0, "sass_red": 0, "sass_atom": 0}, a


# ---- (d) tensor cores and (e) spills -----------------------------------------------------------
def _default_jobs(results, launches):
    return {k: v for k, v in results.items() if k[0] == "default" and k[1] in launches}


def test_tensor_cores_bf16(results):
    # every GEMM launch of the default configs uses mma.sync or wgmma on bf16
    jobs = _default_jobs(results, [x for x in LAUNCHES if x != "act"])
    assert len(jobs) >= 6
    for key, r in jobs.items():
        tc = tensor_core_ops(r["ptx"])
        assert tc["mma_sync"] + tc["wgmma"] > 0, (key, r["cfg"], tc)
        assert "bf16" in r["ptx"], key


def test_no_spills_default_configs(results):
    # LOCAL == 0 (no register spills) for every default config at gpt-oss-20b shapes, T ∈ SPILL_T
    jobs = _default_jobs(results, LAUNCHES)
    assert len(jobs) >= 7
    bad = {f"{k[1]}@T={k[2]}": (r["res"], r["cfg"]) for k, r in jobs.items() if r["res"]["LOCAL"] != 0}
    assert not bad, bad
    for r in jobs.values():
        assert 0 < r["res"]["REG"] <= 255
