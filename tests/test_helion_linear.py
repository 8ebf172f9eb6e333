"""CPU tests of the Helion linear backend (moelora_lib.helion_linear).

* codegen: every kernel generates Triton source for a fixed config without a GPU and without any
  interpreter (a subprocess with TRITON_INTERPRET unset), bf16 and fp16;
* numerics: every kernel through the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py and
  here as a fallback) in fp32 and fp16 at small shapes against an fp64 PyTorch reference; bf16 is
  not run (the CPU interpreter multiplies raw bf16 bits, environment.md §2);
* buckets, config JSON round trip and malformed files, the fallback path (one warning per reason),
  and ValueError on bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (read when a kernel is decorated); never
# here on a GPU host: a kernel module imported later in the same pytest process would be interpreted
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moelora_lib.helion_linear import (
    BUCKETS,
    ConfigFileError,
    HelionFallbackWarning,
    HelionLinearMethod,
    Linear,
    TorchLinearMethod,
    bucket_for,
    load_configs,
    save_configs,
    set_entry,
    warm_m_values,
)

K_, N_ = 64, 96  # small K, N: the interpreter runs every program in Python
CFG = {"block_sizes": [16, 32, 32], "num_warps": 4, "num_stages": 2}
CFG_SPLIT = {**CFG, "split_k": 2}

# fp32: only accumulation-order error; fp16: output rounding (~5e-4 relative) + fp16 inputs.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _table(dtype: torch.dtype, epilogue: str, cfg: dict, n: int = N_, buckets=(1, 2, 4, 8, 16, 32)) -> dict:
    t: dict = {}
    for b in buckets:
        set_entry(t, epilogue, str(dtype).removeprefix("torch."), K_, n, b, cfg)
    return t


def _ref(x, w, b, epilogue):
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    if epilogue == "silu":
        y = y * torch.sigmoid(y)
    if epilogue == "swiglu":
        g, u = y.chunk(2, dim=-1)
        y = g * torch.sigmoid(g) * u
    return y


def _rel_err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------------------------
# Interpreter numerics (every kernel, fp32 and fp16, M covering 1, a ragged M, and two M tiles)
# ---------------------------------------------------------------------------------------------
CASES = [
    ("none", CFG),
    ("bias", CFG),
    ("silu", CFG),
    ("swiglu", CFG),
    ("none", CFG_SPLIT),  # split-K: 2 chunks of K reduced by fp32 atomic_add
    ("bias", CFG_SPLIT),  # split-K with the bias added by the k = 0 chunk only
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "epilogue,cfg", CASES, ids=[f"{e}{'-splitk' if 'split_k' in c else ''}" for e, c in CASES]
)
def test_interpreter_matches_reference(epilogue, cfg, dtype):
    torch.manual_seed(0)
    method = HelionLinearMethod(_table(dtype, epilogue, cfg), epilogue=epilogue, allow_interpreter=True)
    w = torch.randn(N_, K_, dtype=dtype) / 8
    b = torch.randn(N_, dtype=dtype) if epilogue == "bias" else None
    layer = Linear.from_weight(w, method, bias=b)
    # M = 1 (Triton's constexpr-1 variant) and 17 (two M tiles, the second ragged: masked rows)
    for m in (1, 17):
        x = torch.randn(m, K_, dtype=dtype)
        assert method.path_for(layer, m) == f"helion:{bucket_for(m)}"
        with warnings.catch_warnings():
            warnings.simplefilter("error", HelionFallbackWarning)
            y = layer(x)
        assert y.dtype == dtype
        assert y.shape == (m, N_ // 2 if epilogue == "swiglu" else N_)
        assert _rel_err(y, _ref(x, w, b, epilogue)) < TOL[dtype], (epilogue, m)


def test_warmup_compiles_every_configured_bucket():
    method = HelionLinearMethod(
        _table(torch.float32, "none", CFG, buckets=(1, 2, 16)), allow_interpreter=True
    )
    layer = Linear.from_weight(torch.randn(N_, K_), method)
    paths = method.warmup(layer, max_m=20)
    assert paths[1] == "helion:1" and paths[2] == "helion:2" and paths[16] == "helion:16"
    assert paths[4].startswith("torch: bucket 4 not tuned") and paths[32].startswith("torch: bucket 32")
    assert set(method.last_warmup) == {1, 2, 16}
    assert 64 not in paths  # bucket_for(20) = 32 is the top


def test_warmup_of_a_new_config_at_a_two_m_bucket():
    """A bucket >= 16 warms two M values (16 and 15); when its config is new there, the first call
    proves the runner and the second must call that runner again (the H200 suite run at e5ed62e failed
    with "'Tensor' object is not callable": the first call's output had replaced the runner)."""
    method = HelionLinearMethod(_table(torch.float32, "none", CFG, buckets=(16,)), allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_), method)
    paths = method.warmup(layer, max_m=16)
    assert paths[16] == "helion:16" and set(method.last_warmup) == {16}
    x = torch.randn(15, K_)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HelionFallbackWarning)
        assert _rel_err(layer(x), _ref(x, layer.weight, None, "none")) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# Codegen without any interpreter (subprocess: TRITON_INTERPRET unset), bf16 and fp16
# ---------------------------------------------------------------------------------------------
_CODEGEN_SCRIPT = textwrap.dedent(
    """
    import os, sys, json, torch, helion
    assert "TRITON_INTERPRET" not in os.environ
    from moelora_lib.helion_linear import kernels as K
    from moelora_lib.helion_linear.method import kernel_args
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        w = torch.empty(256, 128, dtype=dt)
        b = torch.empty(256, dtype=dt)
        x = torch.empty(2, 128, dtype=dt)
        for (epi, split), kern in K.KERNELS.items():
            cfg = dict(block_sizes=[16, 64, 64], num_warps=4, num_stages=3, pid_type="flat")
            if split:
                cfg["split_k"] = 2
            bound = kern.bind(kernel_args(epi, x, w, b if epi == "bias" else None))
            code = bound.to_triton_code(helion.Config(**cfg))
            out[f"{epi}-{split}-{dt}"] = code
    print(json.dumps(out))
    """
)


def test_codegen_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _CODEGEN_SCRIPT],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(codes) == 12
    for key, code in codes.items():
        assert "@triton.jit" in code and "tl.dot(" in code, key
        assert "tl.range(0, 128" in code or "split" in key.split("-")[1] or "True" in key, (
            key
        )  # K specialized
        assert "_launcher(" in code, key
        if "True" in key:  # split-K reduces with atomics
            assert "tl.atomic_add(" in code, key
        if key.startswith("swiglu"):
            assert code.count("tl.dot(") == 2 and "tl.sigmoid(" in code, key
        if key.startswith("silu"):
            assert "tl.sigmoid(" in code, key
        dt = "tl.bfloat16" if "bfloat16" in key else "tl.float16"
        assert dt in code, key


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "m,bucket",
    [
        (1, 1),
        (2, 2),
        (3, 4),
        (4, 4),
        (5, 8),
        (16, 16),
        (17, 32),
        (33, 64),
        (1024, 1024),
        (1025, 2048),
        (10**6, 2048),
    ],
)
def test_bucket_for(m, bucket):
    assert bucket_for(m) == bucket


def test_bucket_for_rejects_bad_m():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="m must be"):
            bucket_for(bad)
    assert BUCKETS[-1] == 2048


def test_warm_m_values_cover_triton_variants():
    assert warm_m_values(1) == [1]
    assert warm_m_values(8) == [8]
    assert warm_m_values(16) == [16, 15] and warm_m_values(2048) == [2048, 2047]


# ---------------------------------------------------------------------------------------------
# Config JSON: round trip and malformed files
# ---------------------------------------------------------------------------------------------
def test_config_round_trip(tmp_path):
    t = _table(
        torch.bfloat16, "none", {**CFG, "indexing": "tensor_descriptor", "pid_type": "persistent_blocked"}
    )
    set_entry(t, "none", "bfloat16", 4096, 4096, 2048, CFG_SPLIT)
    set_entry(t, "swiglu", "float16", 4096, 28672, 16, CFG)
    t["_meta"] = {"tuning_seconds": 12.5}
    p = save_configs(t, tmp_path / "sub" / "NVIDIA_H200.json")
    assert load_configs(p) == t
    assert not [f for f in os.listdir(p.parent) if f.endswith(".tmp")]  # atomic write left nothing
    method = HelionLinearMethod(p)
    assert method.config_source == str(p)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "invalid JSON"),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "bogus": 1}}}}}',
            "unknown helion.Config field",
        ),
        ('{"none": {"bfloat16": {"64,96": {"16": {"num_warps": 4}}}}}', "missing 'block_sizes'"),
        ('{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32]}}}}}', "3 powers of two"),
        ('{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [3, 32, 32]}}}}}', "3 powers of two"),
        ('{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [true, 32, 32]}}}}}', "3 powers of two"),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "indexing": "bogus"}}}}}',
            "indexing",
        ),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "pid_type": 7}}}}}',
            "pid_type",
        ),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "num_warps": 3}}}}}',
            "num_warps",
        ),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "split_k": true}}}}}',
            "split_k",
        ),
        ('{"none": {"bfloat16": {" 64, 96": {"16": {"block_sizes": [16, 32, 32]}}}}}', "shape key"),
        ('{"none": {"bfloat16": {"64,96": {"01": {"block_sizes": [16, 32, 32]}}}}}', "bucket"),
        ('{"none": {"bfloat16": {"64,96": {"\u00b2": {"block_sizes": [16, 32, 32]}}}}}', "bucket"),
        ('{"none": {"bfloat16": {"64,96": {"3": {"block_sizes": [16, 32, 32]}}}}}', "bucket must be one of"),
        ('{"none": {"bfloat16": {"64x96": {}}}}', "shape key"),
        ('{"gelu": {}}', "unknown epilogue"),
        ('{"none": {"int8": {}}}', "unknown dtype"),
        ('{"silu": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "split_k": 2}}}}}', "split_k"),
        (
            '{"none": {"bfloat16": {"64,96": {"16": {"block_sizes": [16, 32, 32], "split_k": 3}}}}}',
            "power of two",
        ),
        ("[]", "JSON object"),
    ],
)
def test_malformed_config_file_errors_name_file_and_key(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ConfigFileError, match=match) as ei:
        load_configs(p)
    assert str(p) in str(ei.value)
    if "bogus" in content or "num_warps" in content:
        assert "none/bfloat16/64,96/16" in str(ei.value)  # the key path


def test_config_file_not_utf8(tmp_path):
    p = tmp_path / "bad.json"
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigFileError, match="UTF-8"):
        load_configs(p)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_configs(tmp_path / "nope.json")


# ---------------------------------------------------------------------------------------------
# Fallback: untuned dtype / shape / bucket / device -> F.linear with exactly one warning per reason
# ---------------------------------------------------------------------------------------------
def test_fallback_warns_once_and_matches_torch():
    torch.manual_seed(0)
    method = HelionLinearMethod(_table(torch.float32, "none", CFG), allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_, dtype=torch.float16), method)  # fp16 is untuned
    x = torch.randn(3, K_, dtype=torch.float16)
    assert method.path_for(layer, 3).startswith("torch: no tuned config for epilogue=none dtype=float16")
    with pytest.warns(HelionFallbackWarning, match="dtype=float16") as rec:
        y1 = layer(x)
        y2 = layer(x)
    assert len(rec) == 1
    torch.testing.assert_close(y1, torch.nn.functional.linear(x, layer.weight))
    torch.testing.assert_close(y1, y2)


def test_fallback_untuned_bucket_and_device():
    method = HelionLinearMethod(_table(torch.float32, "none", CFG, buckets=(1,)), allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_), method)
    assert method.path_for(layer, 1) == "helion:1"
    assert method.path_for(layer, 2).startswith("torch: bucket 2 not tuned")
    no_interp = HelionLinearMethod(_table(torch.float32, "none", CFG))
    assert no_interp.path_for(layer, 1).startswith("torch: device cpu")
    capped = HelionLinearMethod(_table(torch.float32, "none", CFG), max_m=1, allow_interpreter=True)
    assert capped.path_for(layer, 2) == "torch: M=2 above max_m=1"


# A config that passes the table's checks but that Helion cannot run: three
# loop_orders entries for the 2-D tile loop -> helion.exc.InvalidConfig at compile_config.
CFG_BAD_LOOP_ORDER = {**CFG, "loop_orders": [[0, 1, 2]]}


def _count_builds(monkeypatch):
    from moelora_lib.helion_linear import method as M

    calls = []
    real = M.build_runner

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(M, "build_runner", counting)
    return calls


@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_config_that_validates_but_cannot_run_falls_back_once(monkeypatch, epilogue):
    torch.manual_seed(0)
    table = _table(torch.float32, epilogue, CFG_BAD_LOOP_ORDER, buckets=(1,))
    set_entry(table, epilogue, "float32", K_, N_, 2, CFG)  # a good bucket beside the bad one
    method = HelionLinearMethod(table, epilogue=epilogue, allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_) / 8, method)
    builds = _count_builds(monkeypatch)
    assert method.path_for(layer, 1) == "helion:1"  # not known to be bad before the first build
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ys = [(x, layer(x)) for x in (torch.randn(1, K_) for _ in range(3))]
    fb = [str(w.message) for w in rec if issubclass(w.category, HelionFallbackWarning)]
    assert len(fb) == 1, fb
    assert f"K={K_} N={N_} bucket 1" in fb[0] and "InvalidConfig" in fb[0] and "loop_orders" in fb[0]
    assert len(builds) == 1  # remembered: not rebuilt on later calls
    for x, y in ys:
        torch.testing.assert_close(y, TorchLinearMethod(epilogue).apply(layer, x))
    assert method.path_for(layer, 1).startswith(
        "torch: the tuned config for"
    ) and "bucket 1" in method.path_for(layer, 1)
    # the good bucket still runs Helion, without a warning
    assert method.path_for(layer, 2) == "helion:2"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HelionFallbackWarning)
        x = torch.randn(2, K_)
        assert _rel_err(layer(x), _ref(x, layer.weight, None, epilogue)) < TOL[torch.float32]


def test_warmup_with_a_config_that_cannot_run():
    table = _table(torch.float32, "none", CFG_BAD_LOOP_ORDER, buckets=(1,))
    set_entry(table, "none", "float32", K_, N_, 2, CFG)
    strict = HelionLinearMethod(table, allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_), strict)
    with pytest.raises(RuntimeError, match="bucket 1.*InvalidConfig"):
        strict.warmup(layer, max_m=2)
    assert strict.path_for(layer, 1).startswith("torch: the tuned config")  # remembered for apply
    lenient = HelionLinearMethod(table, allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_), lenient)
    with pytest.warns(HelionFallbackWarning, match="bucket 1.*InvalidConfig") as rec:
        paths = lenient.warmup(layer, max_m=2, strict=False)
        layer(torch.randn(1, K_))  # no second warning for the same reason
    assert len(rec) == 1
    assert paths[1].startswith("torch: the tuned config") and paths[2] == "helion:2"
    assert set(lenient.last_warmup) == {2}


def test_runner_that_fails_to_compile_on_first_call_falls_back(monkeypatch):
    """Triton compiles on a runner's first call (OutOfResources, CompilationError, ... on the GPU):
    caught there once, then F.linear for that bucket; a runner that worked once is called directly."""
    from triton.errors import TritonError

    from moelora_lib.helion_linear import method as M

    class FakeCompileError(TritonError):
        pass

    calls = []

    def fake_build(epilogue, cfg, weight, bias=None):
        def runner(*args):
            calls.append(cfg["num_warps"])
            if cfg["num_warps"] == 8:
                raise FakeCompileError("out of shared memory")
            return torch.nn.functional.linear(args[0], args[1])

        return runner

    monkeypatch.setattr(M, "build_runner", fake_build)
    table = _table(torch.float32, "none", {**CFG, "num_warps": 8}, buckets=(1,))
    set_entry(table, "none", "float32", K_, N_, 2, CFG)
    method = HelionLinearMethod(table, allow_interpreter=True)
    layer = Linear.from_weight(torch.randn(N_, K_), method)
    with pytest.warns(HelionFallbackWarning, match="bucket 1.*FakeCompileError: out of shared memory") as rec:
        for _ in range(3):
            x = torch.randn(1, K_)
            torch.testing.assert_close(layer(x), x @ layer.weight.T)
    assert len(rec) == 1 and calls == [8]  # tried once
    for _ in range(2):
        layer(torch.randn(2, K_))
    assert calls == [8, 4, 4] and method.path_for(layer, 2) == "helion:2"


def test_torch_method_swiglu_matches_reference():
    torch.manual_seed(0)
    w = torch.randn(N_, K_, dtype=torch.float64)
    layer = Linear.from_weight(w, TorchLinearMethod("swiglu"))
    x = torch.randn(4, K_, dtype=torch.float64)
    assert _rel_err(layer(x), _ref(x, w, None, "swiglu")) < 1e-12


# ---------------------------------------------------------------------------------------------
# Bad input -> ValueError naming the argument and what was expected
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method_cls", [TorchLinearMethod, HelionLinearMethod])
def test_bad_input_raises_value_error(method_cls):
    method = method_cls(epilogue="none") if method_cls is TorchLinearMethod else method_cls({}, "none")
    layer = Linear.from_weight(torch.randn(N_, K_), method)
    with pytest.raises(ValueError, match=r"x: expected a 2-D tensor \[M, 64\]"):
        method.apply(layer, torch.randn(2, 3, K_))
    with pytest.raises(ValueError, match=r"x: expected shape \[M, 64\]"):
        method.apply(layer, torch.randn(2, K_ + 1))
    with pytest.raises(ValueError, match="x: expected dtype torch.float32"):
        method.apply(layer, torch.randn(2, K_, dtype=torch.float16))
    with pytest.raises(ValueError, match="x: expected device"):
        method.apply(layer, torch.randn(2, K_, device="meta"))
    with pytest.raises(ValueError, match="bias: epilogue 'none' takes no bias"):
        method.apply(layer, torch.randn(2, K_), torch.randn(N_))


def test_bad_bias_and_sizes_raise_value_error():
    method = TorchLinearMethod("bias")
    layer = Linear.from_weight(torch.randn(N_, K_), method, bias=torch.randn(N_))
    with pytest.raises(ValueError, match=r"bias: expected shape \[96\]"):
        method.apply(layer, torch.randn(2, K_), torch.randn(N_ + 1))
    layer.bias = None
    with pytest.raises(ValueError, match="bias: epilogue 'bias' needs a bias"):
        method.apply(layer, torch.randn(2, K_))
    with pytest.raises(ValueError, match="even"):
        Linear(K_, 7, TorchLinearMethod("swiglu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        HelionLinearMethod({}, "gelu")


# ---------------------------------------------------------------------------------------------
# Tuner candidate lists and the bound helper (no GPU needed)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("epi", ["none", "bias", "silu", "swiglu"])
@pytest.mark.parametrize("kn", [(4096, 4096), (14336, 4096), (8192, 57344)])
@pytest.mark.parametrize("bucket", [1, 16, 32, 256, 1024, 2048])
def test_tuner_candidates_valid(epi, kn, bucket):
    from moelora_lib.studies import helion_tune as T

    k, n = kn
    cands = T.candidates(epi, k, n, bucket)
    assert 3 <= len(cands) <= 12
    keys = [json.dumps(c, sort_keys=True) for c in cands]
    assert len(set(keys)) == len(keys), "duplicate candidates"
    for c in cands:
        bm, bn, bk = c["block_sizes"]
        assert all(v >= 16 and v & (v - 1) == 0 for v in (bm, bn, bk)), c
        assert T.smem_bytes(c, epi) <= T.SMEM_LIMIT_BYTES, c
        if "split_k" in c:
            assert epi in ("none", "bias"), c
            assert 2 <= c["split_k"] <= 16 and k // c["split_k"] >= 1024, c
        if bucket <= 32:
            assert bm <= max(16, bucket), c


def test_split_factor_fills_the_sms():
    from moelora_lib.studies import helion_tune as T

    assert T._split_factor(4096, 4096, 64, 132) == 4  # 64 tiles -> 256 programs
    assert T._split_factor(4096, 57344, 64, 132) is None  # 896 tiles already fill the GPU
    assert T._split_factor(4096, 4096, 128, 132, m_tiles=4) == 4
    assert T._split_factor(2048, 4096, 64, 132) == 2  # chunks keep >= 1024 of K


def test_best_ratio_bounds():
    import pandas as pd

    from moelora_lib.studies import helion_study as study

    s = pd.DataFrame(
        dict(
            M=[1, 4096],
            K=[4096, 4096],
            N=[4096, 4096],
            epilogue=["none", "none"],
            dtype=["bfloat16", "bfloat16"],
            torch_us=[20.0, 200.0],
        )
    )
    b = study.best_ratio_bounds(s, read_tb_per_s=4.0, tflops=500.0, launch_us=2.0)
    # M = 1: bytes (4096*4096 + 4096 + 4096) * 2 / 4e12 s = 8.39 us + 2 us launch
    assert b.floor_us[0] == pytest.approx((4096 * 4096 + 2 * 4096) * 2 / 4e12 * 1e6 + 2.0)
    # M = 4096: flops 2 * 4096^3 / 500e12 = 274.9 us > bytes
    assert b.floor_us[1] == pytest.approx(2 * 4096**3 / 500e12 * 1e6 + 2.0)
    assert b.max_speedup[0] == pytest.approx(20.0 / b.floor_us[0])
    # fp32 rows count 4 bytes per element
    b32 = study.best_ratio_bounds(s.assign(dtype="float32"), read_tb_per_s=4.0, tflops=500.0)
    assert b32.floor_us[0] == pytest.approx((4096 * 4096 + 2 * 4096) * 4 / 4e12 * 1e6)
    with pytest.raises(ValueError, match="read_tb_per_s"):
        study.best_ratio_bounds(s, read_tb_per_s=0.0, tflops=500.0)
    with pytest.raises(ValueError, match="launch_us"):
        study.best_ratio_bounds(s, read_tb_per_s=4.0, tflops=500.0, launch_us=-1.0)
    with pytest.raises(ValueError, match="missing column"):
        study.best_ratio_bounds(s.drop(columns="dtype"), read_tb_per_s=4.0, tflops=500.0)


def test_rotation_copies():
    from moelora_lib.studies import helion_study as study

    assert study.rotation_copies(33_554_432) == 8  # 4096 x 4096 bf16: 8 x 32 MiB = 4 x 60 MiB + ...
    assert study.rotation_copies(940_000_000) == 2  # never fewer than two
    for bad in (0, -5, True, 2.5, float("nan"), None, "33"):
        with pytest.raises(ValueError, match="weight_bytes"):
            study.rotation_copies(bad)


def test_linear_construction_errors():
    m = TorchLinearMethod("none")
    with pytest.raises(ValueError, match="bias"):
        Linear(8, 8, m, bias=True)  # epilogue "none" would silently ignore it
    with pytest.raises(ValueError, match="dtype"):
        Linear(8, 8, m, dtype=torch.int32)
    with pytest.raises(ValueError, match="weight"):
        Linear.from_weight(torch.randn(8), m)
    with pytest.raises(ValueError, match="bias"):
        Linear.from_weight(torch.randn(8, 8), TorchLinearMethod("bias"), bias=torch.randn(7))
    with pytest.raises(TypeError, match="configs"):
        HelionLinearMethod([1, 2])
    with pytest.raises(ValueError, match="max_m"):
        HelionLinearMethod(None, max_m=0)
    h = HelionLinearMethod(None)
    layer = Linear.from_weight(torch.randn(8, 8), h)
    with pytest.raises(ValueError, match="max_m"):
        h.warmup(layer, "3")


def test_bucket_for_accepts_numpy_ints():
    import numpy as np

    from moelora_lib.helion_linear import bucket_for

    assert bucket_for(np.int64(5)) == 8
    with pytest.raises(ValueError, match="m must be"):
        bucket_for(2.0)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--shapes", "llama9"], "--shapes"),
        (["--epilogues", "gelu"], "--epilogues"),
        (["--m", "abc"], "--m"),
        (["--m", "0"], "--m"),
        (["--budget-s", "-1"], "--budget-s"),
    ],
)
def test_tuner_cli_rejects_bad_arguments(tmp_path, capsys, extra, match):
    from moelora_lib.studies import helion_tune

    with pytest.raises(SystemExit) as ei:
        helion_tune.main(["--out", str(tmp_path / "t.json"), "--csv", str(tmp_path / "t.csv"), *extra])
    assert ei.value.code == 2
    assert match in capsys.readouterr().err


def test_tuner_candidates_reject_bad_input():
    from moelora_lib.studies import helion_tune

    with pytest.raises(ValueError, match="epilogue"):
        helion_tune.candidates("gelu", 4096, 4096, 1)
    with pytest.raises(ValueError, match="bucket"):
        helion_tune.candidates("none", 4096, 4096, 3)
    with pytest.raises(ValueError, match="k"):
        helion_tune.candidates("none", 0, 4096, 1)
