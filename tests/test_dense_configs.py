"""Tuned dense multi-LoRA configs (moelora_lib.configs.load_dense_config, vLLM's dense file format) on
the CPU: file names and keys, nearest lookup, precedence, warnings, GPU mapping, the resolved-config
memo, malformed files, and a hand-written folder read by stage "tuned" of lora_linear / LoRALinear."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from moelora_lib import configs
from moelora_lib.configs import DenseLoRAConfig, OpConfig, default_dense_config, files, loader
from moelora_lib.kernels import STAGES
from moelora_lib.kernels.dense_lora import dense_config_for
from moelora_lib.linear import LoRALinear, lora_linear, lora_linear_reference
from moelora_lib.testing import TOLERANCES, rel_err

GPU = "TEST_GPU"
#: the layer runs on CPU tensors only through the Triton interpreter (tests/conftest.py)
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter test (a GPU host compiles the kernels instead)"
)
# a workload: hidden, slices, rank, adapters
W = dict(hidden=64, slices=(64, 16, 16), rank=16, adapters=2)


def leaf(bm=16, bn=32, **kw):
    d = {"block_m": bm, "block_n": bn, "block_k": 32, "group_size_m": 1, "num_warps": 4, "num_stages": 2}
    d.update(kw)
    return d


def write_folder(folder, tokens=(1, 64), bms=None, gpu=GPU, w=W, tag=None, expand_bms=None):
    """Both dense files for workload ``w`` at the given T; block_n encodes T (16 below 32, else 64)
    unless ``tag`` is given (then num_stages = tag, to tell folders apart). ``bms``: BLOCK_SIZE_M per
    T (default 16); ``expand_bms``: the expand's, when it should differ."""
    folder.mkdir(parents=True, exist_ok=True)
    bms = bms or {T: 16 for T in tokens}
    expand_bms = expand_bms or bms
    sh, ex = {}, {}
    for T in tokens:
        extra = {"num_stages": tag} if tag else {}
        bn = 16 if T < 32 else 64
        configs.set_entry(sh, configs.dense_keys("shrink", T, **w), leaf(bms[T], bn, split_k=1, **extra))
        configs.set_entry(ex, configs.dense_keys("expand", T, **w), leaf(expand_bms[T], bn, **extra))
    configs.save_config_file(folder / configs.dense_config_file_name(gpu, "shrink"), sh)
    configs.save_config_file(folder / configs.dense_config_file_name(gpu, "expand"), ex)
    return folder


def load(T=8, folder=None, gpu=GPU, **over):
    w = {**W, **over}
    return configs.load_dense_config(
        T, w["hidden"], w["slices"], w["rank"], w["adapters"], folder=folder, gpu_name=gpu
    )


def dflt(T=8, **over):
    w = {**W, **over}
    return default_dense_config(T, **w)


def tuned_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, configs.TunedConfigWarning)]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(configs.ENV_VAR, raising=False)
    monkeypatch.setattr(loader, "_GPU_MAP", {})
    configs.clear_cache()
    yield
    configs.clear_cache()


def _on_gpu(monkeypatch, name):
    monkeypatch.setattr(loader, "_current_gpu_name", lambda: name.replace(" ", "_").replace("-", "_"))


# ---- format -------------------------------------------------------------------------------------
def test_file_names_and_keys_follow_vllm():
    assert configs.dense_config_file_name("NVIDIA_H200", "shrink") == "NVIDIA_H200_SHRINK.json"
    assert configs.dense_config_file_name("NVIDIA_H200", "expand") == "NVIDIA_H200_EXPAND_TRUE.json"
    assert (
        configs.dense_config_file_name("NVIDIA_H200", "dense_expand", False)
        == "NVIDIA_H200_EXPAND_FALSE.json"
    )
    qkv = dict(hidden=2880, slices=(4096, 512, 512), rank=32, adapters=8)
    # [max_loras][num_slices][m][k][n]: shrink k = hidden, n = rank; expand k = rank, n = widest slice
    assert configs.dense_keys("shrink", 7, **qkv) == (8, 3, 7, 2880, 32)
    assert configs.dense_keys("expand", 7, **qkv) == (8, 3, 7, 32, 4096)
    c = OpConfig(16, 128, 64, 8, 4, 4, 3)
    assert configs.dense_leaf(c, "shrink") == {
        "block_m": 16,
        "block_n": 128,
        "block_k": 64,
        "group_size_m": 8,
        "split_k": 4,
        "num_warps": 4,
        "num_stages": 3,
    }
    assert "split_k" not in configs.dense_leaf(OpConfig(16, 64, 32, 8, 1, 4, 2), "expand")


def test_leaf_accepts_vllm_and_opconfig_names(tmp_path):
    folder = write_folder(tmp_path / "f", tokens=(8,))
    p = folder / configs.dense_config_file_name(GPU, "shrink")
    data = json.loads(p.read_text())
    data["2"]["3"]["8"]["64"]["16"] = {
        "BLOCK_SIZE_M": 16,
        "block_n": 32,
        "Block_K": 64,
        "split_k": 2,
        "num_ctas": 1,
        "max_nreg": None,  # vLLM's keys without meaning here: ignored
    }
    configs.save_config_file(p, data)
    c = load(folder=folder).shrink
    assert (c.BLOCK_SIZE_M, c.BLOCK_SIZE_N, c.BLOCK_SIZE_K, c.SPLIT_K) == (16, 32, 64, 2)
    assert c.NUM_WARPS == OpConfig().NUM_WARPS  # missing keys: OpConfig's defaults


# ---- lookup -------------------------------------------------------------------------------------
def test_nearest_key_lookup(tmp_path):
    folder = write_folder(tmp_path / "f", tokens=(1, 64))
    assert load(1, folder).shrink.BLOCK_SIZE_N == 16
    assert load(20, folder).shrink.BLOCK_SIZE_N == 16  # |20-1| < |20-64|
    assert load(50, folder).expand.BLOCK_SIZE_N == 64
    assert load(9000, folder).expand.BLOCK_SIZE_N == 64
    # the other levels are nearest too (hidden, rank, L, widest slice)
    c = load(64, folder, hidden=100, rank=64, adapters=7, slices=(96, 8, 8))
    assert c.shrink.BLOCK_SIZE_N == 64 and c.expand.BLOCK_SIZE_N == 64 and c.source == f"folder:{folder}"
    # ties go to the smaller key (as the MoE lookup)
    assert load(32, folder).shrink.BLOCK_SIZE_N == 16 and load(33, folder).shrink.BLOCK_SIZE_N == 64


def test_num_slices_must_match_exactly(tmp_path):
    folder = write_folder(tmp_path / "f")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = load(folder=folder, slices=(96,))  # the files have num_slices 3 only
        load(folder=folder, slices=(96,), hidden=72)
    assert c == dflt(slices=(96,)) and c.source == "default"
    msgs = tuned_warnings(rec)
    assert len(msgs) == 1 and "num_slices=1" in msgs[0] and "SHRINK" in msgs[0]


def test_expand_lookup_follows_the_shrinks_block_size_m(tmp_path):
    # T=1: BM 16 in both files; T=64: BM 32 in both. At T=40 the nearest shrink entry is T=64
    # (BM 32); the expand is looked up among its BM-32 entries, whatever is nearest otherwise.
    folder = write_folder(tmp_path / "f", bms={1: 16, 64: 32}, expand_bms={1: 32, 64: 16})
    c = load(1, folder)  # shrink T=1 (BM 16): the expand entry with BM 16 is T=64's
    assert c.shrink.BLOCK_SIZE_M == c.expand.BLOCK_SIZE_M == 16 and c.expand.BLOCK_SIZE_N == 64
    c = load(40, folder)
    assert c.block_size_m == 32 and c.expand.BLOCK_SIZE_N == 16  # the expand entry of T=1
    # no expand entry with the shrink's BM at all: an error naming both files
    folder2 = write_folder(tmp_path / "g", bms={1: 16, 64: 16}, expand_bms={1: 32, 64: 32})
    with pytest.raises(ValueError, match="must be equal") as e:
        load(1, folder2)
    assert "TEST_GPU_SHRINK.json" in str(e.value) and "TEST_GPU_EXPAND_TRUE.json" in str(e.value)
    assert '["2"]["3"]["1"]["64"]["16"]' in str(e.value)


# ---- precedence, warnings, GPU names --------------------------------------------------------------
def test_precedence(tmp_path, monkeypatch):
    explicit = write_folder(tmp_path / "explicit", tag=5)
    env = write_folder(tmp_path / "env", tag=6)
    shipped_root = tmp_path / "pkg"
    write_folder(shipped_root / GPU, tag=7)
    monkeypatch.setattr(loader, "SHIPPED_DIR", shipped_root)
    monkeypatch.setenv(configs.ENV_VAR, str(env))
    c = load(folder=explicit)
    assert c.shrink.NUM_STAGES == 5 and c.source == f"folder:{explicit}"
    c = load()
    assert c.shrink.NUM_STAGES == 6 and c.source == f"env:{env}"
    monkeypatch.delenv(configs.ENV_VAR)
    c = load()
    assert c.expand.NUM_STAGES == 7 and c.source == f"shipped:{GPU}"
    with pytest.warns(configs.TunedConfigWarning, match="'OTHER_GPU'"):
        c = load(gpu="OTHER_GPU")  # nothing shipped for this GPU: defaults, said once
    assert c == dflt() and c.source == "default"


def test_folder_that_is_not_a_directory_raises(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="folder argument.*not a directory"):
        load(folder=tmp_path / "missing")
    monkeypatch.setenv(configs.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="MOELORA_TUNED_CONFIG_FOLDER"):
        load()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="T must be an int >= 1"):
        configs.load_dense_config(0, 64, (64,), 16, 2)
    with pytest.raises(ValueError, match="slices"):
        configs.load_dense_config(1, 64, (64, 0), 16, 2)
    with pytest.raises(ValueError, match="adapters"):
        configs.load_dense_config(1, 64, (64,), 16, 1.5)


@pytest.mark.parametrize("torch_name", ["NVIDIA H200 NVL", "Some Unknown GPU"])
def test_unknown_gpu_warns_once_naming_gpu_folders_and_tuner(monkeypatch, torch_name):
    _on_gpu(monkeypatch, torch_name)
    gpu = torch_name.replace(" ", "_").replace("-", "_")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c1 = dense_config_for(STAGES["tuned"], 8, **W)  # what stage "tuned" of lora_linear calls
        c2 = configs.load_dense_config(64, **{**W, "hidden": 64})
        configs.load_dense_config(1, **W)
    msgs = tuned_warnings(rec)
    assert len(msgs) == 1, msgs
    m = msgs[0]
    assert repr(gpu) in m and configs.ENV_VAR in m and str(configs.shipped_folder(gpu)) in m
    assert "map_gpu_name" in m and "dense_tuning" in m and f"{gpu}_SHRINK.json" in m
    assert c1 == dflt() and c1.source == "default" and c2.source == "default"


def test_cpu_without_folder_and_shipped_moe_only_folder_stay_silent(tmp_path, monkeypatch):
    from moelora_lib.configs import LORA_OPS

    # a shipped folder with MoE configs and no dense files (the H200's until the dense tuner has run)
    root = tmp_path / "pkg"
    (root / "NVIDIA_H200").mkdir(parents=True)
    for op in (*LORA_OPS, "base"):
        (root / "NVIDIA_H200" / configs.config_file_name("NVIDIA_H200", op)).write_text("{}")
    monkeypatch.setattr(loader, "SHIPPED_DIR", root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _on_gpu(monkeypatch, "cpu")
        assert load(gpu=None).source == "default"
        _on_gpu(monkeypatch, "NVIDIA H200")
        configs.clear_cache()  # (the memo is per device: its GPU name does not change in a process)
        for T in (1, 8, 64):  # quiet defaults
            c = load(T, gpu=None)
            assert c == dflt(T) and c.source == "default"
        assert dense_config_for(STAGES["tuned"], 8, **W) == dflt()


def test_moe_only_folder_warns_once_per_folder(tmp_path, monkeypatch):
    from moelora_lib.configs import LORA_OPS

    folder = tmp_path / "moe"
    folder.mkdir()
    for op in LORA_OPS:  # an (empty-valued) MoE file is enough to make it "a folder of this GPU's configs"
        (folder / configs.config_file_name(GPU, op)).write_text("{}")
    monkeypatch.setenv(configs.ENV_VAR, str(folder))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for T in (1, 8, 64):
            assert load(T).source == "default"
    msgs = tuned_warnings(rec)
    assert len(msgs) == 1 and "no dense LoRA config files" in msgs[0] and str(folder) in msgs[0]


def test_missing_expand_file_warns_once(tmp_path):
    folder = write_folder(tmp_path / "f")
    os.unlink(folder / configs.dense_config_file_name(GPU, "expand"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c1, c2 = load(1, folder), load(64, folder)
    msgs = tuned_warnings(rec)
    assert len(msgs) == 1 and "TEST_GPU_EXPAND_TRUE.json" in msgs[0]
    assert c1 == dflt(1) and c2 == dflt(64)


def test_map_gpu_name_uses_a_shipped_dense_folder(tmp_path, monkeypatch):
    root = tmp_path / "pkg"
    write_folder(root / "NVIDIA_H200", gpu="NVIDIA_H200", tag=4)  # dense files only
    monkeypatch.setattr(loader, "SHIPPED_DIR", root)
    assert configs.shipped_gpus() == ["NVIDIA_H200"]
    _on_gpu(monkeypatch, "NVIDIA H200 NVL")
    assert load(gpu="NVIDIA_H200").source == "shipped:NVIDIA_H200"  # per call
    configs.map_gpu_name("NVIDIA H200 NVL", "NVIDIA_H200")  # process-wide
    with warnings.catch_warnings():
        warnings.simplefilter("error", configs.TunedConfigWarning)
        c = dense_config_for(STAGES["tuned"], 8, **W)
    assert c.source == "shipped:NVIDIA_H200 (mapped from NVIDIA_H200_NVL)" and c.shrink.NUM_STAGES == 4
    configs.map_gpu_name("NVIDIA H200 NVL", None)
    with pytest.warns(configs.TunedConfigWarning, match="NVIDIA_H200_NVL"):
        assert load(gpu=None).source == "default"


def test_other_stages_ignore_tuned_files(tmp_path, monkeypatch):
    monkeypatch.setenv(configs.ENV_VAR, str(write_folder(tmp_path / "f", tag=5)))
    for name, st in STAGES.items():
        c = dense_config_for(st, 8, **W, gpu_name=GPU)
        assert (c.source == f"env:{tmp_path / 'f'}") == (name == "tuned"), name


# ---- memo and errors ------------------------------------------------------------------------------
def test_memo_cleared_by_save_and_clear_cache(tmp_path):
    folder = write_folder(tmp_path / "f", tag=3)
    c = load(folder=folder)
    assert c.shrink.NUM_STAGES == 3 and load(folder=folder) is c  # resolved once
    assert any(k[0] == "dense" for k in files._RESOLVED)
    write_folder(folder, tag=4)  # save_config_file forgets the resolved configs
    assert load(folder=folder).shrink.NUM_STAGES == 4
    c = load(folder=folder)
    configs.clear_cache()
    assert not files._RESOLVED and load(folder=folder) is not c


def _expect_error(folder, op, match):
    configs.clear_cache()
    with pytest.raises(ValueError, match=match) as e:
        load(folder=folder)
    assert configs.dense_config_file_name(GPU, op) in str(e.value)
    return str(e.value)


def test_malformed_files_name_the_file_and_key_path(tmp_path):
    folder = write_folder(tmp_path / "f", tokens=(8,))
    ps = folder / configs.dense_config_file_name(GPU, "shrink")
    pe = folder / configs.dense_config_file_name(GPU, "expand")
    good_s, good_e = ps.read_text(), pe.read_text()
    ps.write_text('{"2": {"3": ')
    _expect_error(folder, "shrink", "malformed JSON")
    ps.write_text(good_s)
    # unknown key
    data = json.loads(good_e)
    data["2"]["3"]["8"]["16"]["64"]["block_size"] = 16
    pe.write_text(json.dumps(data))
    msg = _expect_error(folder, "expand", "unknown key 'block_size'")
    assert '["2"]["3"]["8"]["16"]["64"]' in msg
    # non-power-of-two block, split_k in an expand, a non-integer value
    for key, val, match in (
        ("block_k", 48, "BLOCK_SIZE_K must be a power of two"),
        ("split_k", 2, "must be 1 for the dense expand"),
        ("num_warps", "4", "must be an integer"),
    ):
        data = json.loads(good_e)
        data["2"]["3"]["8"]["16"]["64"][key] = val
        pe.write_text(json.dumps(data))
        assert '["2"]["3"]["8"]["16"]["64"]' in _expect_error(folder, "expand", match)
    pe.write_text(good_e)
    # the same key under two names
    data = json.loads(good_s)
    data["2"]["3"]["8"]["64"]["16"]["BLOCK_SIZE_N"] = 32
    ps.write_text(json.dumps(data))
    _expect_error(folder, "shrink", "given twice")
    # nesting: a non-integer key, a non-object level
    ps.write_text(json.dumps({"2": {"three": {}}}))
    _expect_error(folder, "shrink", "not an integer")
    ps.write_text(json.dumps({"2": [1]}))
    _expect_error(folder, "shrink", "expected a non-empty JSON object")


# ---- the module: workspaces for the tuned block sizes -----------------------------------------------
@needs_interpreter
def test_tuned_block_sizes_and_module_workspaces(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "f", tokens=(1, 8, 64), bms={1: 16, 8: 32, 64: 64})
    kw = dict(hidden=64, slices=(64, 16, 16), rank=16, adapters=2, folder=folder, gpu_name="cpu")
    write_folder(folder, tokens=(1, 8, 64), bms={1: 16, 8: 32, 64: 64}, gpu="cpu")
    assert configs.tuned_dense_block_sizes_m(4, **kw) == (16,)  # T = 1..4: all nearest to m = 1
    assert configs.tuned_dense_block_sizes_m(5, **kw) == (16, 32)  # T = 5 is nearest to m = 8
    assert configs.tuned_dense_block_sizes_m(100, **kw) == (16, 32, 64)
    monkeypatch.setenv(configs.ENV_VAR, str(folder))
    w = torch.randn(96, 64)
    m = LoRALinear(w, slices=(64, 16, 16), num_adapters=2, max_rank=16, max_tokens=48, stage="tuned")
    assert {bm for _, bm in m._scratch.workspaces} >= {16, 32, 64}
    assert m.config_for(8).source == f"env:{folder}" and m.config_for(8).block_size_m == 32


# ---- stage "tuned" reads a folder ----------------------------------------------------------------
@needs_interpreter
def test_stage_tuned_uses_the_folder_and_is_correct(tmp_path, monkeypatch):
    kw = dict(hidden=48, slices=(64, 16, 16), rank=16, adapters=2)  # the tiny preset's qkv
    out = write_folder(tmp_path / "cfg", tokens=(3, 24), bms={3: 16, 24: 32}, gpu="cpu", w=kw)
    c = configs.load_dense_config(24, **kw, folder=out, gpu_name="cpu")
    assert c.source == f"folder:{out}" and c.block_size_m == 32 and c.shrink.BLOCK_SIZE_N == 16
    # stage "tuned" uses it (through the env var, on the CPU's GPU name "cpu") and is correct
    monkeypatch.setenv(configs.ENV_VAR, str(out))
    g = torch.Generator().manual_seed(0)
    x, wt = torch.randn(24, 48, generator=g), torch.randn(96, 48, generator=g) * 0.1
    a, b = torch.randn(2, 3, 16, 48, generator=g) * 0.1, torch.randn(2, 96, 16, generator=g) * 0.1
    ids = torch.tensor([0, 1, -1] * 8, dtype=torch.int32)
    assert dense_config_for(STAGES["tuned"], 24, **kw) == DenseLoRAConfig(c.shrink, c.expand, f"env:{out}")
    y = lora_linear(x, wt, a, b, ids, slices=(64, 16, 16), stage="tuned")
    assert (
        rel_err(y, lora_linear_reference(x, wt, a, b, ids, slices=(64, 16, 16))) <= TOLERANCES[torch.float32]
    )


def test_dense_gpus_in_ignores_moe_lora_files(tmp_path):
    (tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_W13_SHRINK.json").write_text("{}")
    (tmp_path / "NVIDIA_H200_FUSED_MOE_LORA_W13_EXPAND_TRUE.json").write_text("{}")
    (tmp_path / "MY_GPU_SHRINK.json").write_text("{}")
    assert loader._dense_gpus_in(tmp_path) == ["MY_GPU"]
