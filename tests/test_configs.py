"""Tuned-config files: lookup, precedence, errors, atomic writes, Dims-only shapes, stage tuned; the
configs package imports no kernel module."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moelora_lib import configs, fused_moe_lora
from moelora_lib.configs import LORA_OPS, default_config, loader
from moelora_lib.reference import moe_lora_reference
from moelora_lib.shapes import Dims, get_shape
from moelora_lib.testing import TOLERANCES, rel_err
from moelora_lib.workloads import make_inputs

GPU = "TEST_GPU"
# a workload; dims(**over) changes it by shape letter (T, H, I, E, K, R, L, S)
W = Dims(T=8, H=64, I=32, E=4, top_k=2, adapters=2, rank=16, slices=2)
_FIELD = {"K": "top_k", "R": "rank", "L": "adapters", "S": "slices"}


def dims(w=W, **over):
    return dataclasses.replace(w, **{_FIELD.get(k, k): v for k, v in over.items()})


def leaf(bm=16, **kw):
    d = {
        "BLOCK_SIZE_M": bm,
        "BLOCK_SIZE_N": 32,
        "BLOCK_SIZE_K": 32,
        "GROUP_SIZE_M": 1,
        "NUM_WARPS": 4,
        "NUM_STAGES": 2,
        "SPLIT_K": 1,
    }
    d.update(kw)
    return d


def write_folder(folder, tokens=(1, 64), bm=None, base_bm=32, gpu=GPU, w=W, tag=None):
    """All five files for workload ``w`` at the given T buckets; leaf BLOCK_SIZE_N encodes T (for lookup
    checks) unless ``tag`` is given (then NUM_STAGES = tag, to tell folders apart)."""
    folder.mkdir(parents=True, exist_ok=True)
    for op in LORA_OPS:
        data = {}
        for T in tokens:
            lf = leaf(bm or 16, BLOCK_SIZE_N=16 if T < 32 else 64, **({"NUM_STAGES": tag} if tag else {}))
            configs.set_entry(data, configs.lora_keys(op, dims(w, T=T)), lf)
        configs.save_config_file(folder / configs.config_file_name(gpu, op), data)
    data = {}
    for T in tokens:
        configs.set_entry(
            data,
            configs.base_keys(dims(w, T=T)),
            {"base_gate_up": leaf(base_bm), "base_down": leaf(base_bm, BLOCK_SIZE_N=64)},
        )
    configs.save_config_file(folder / configs.config_file_name(gpu, "base"), data)
    return folder


def load(folder=None, gpu=GPU, **over):
    return configs.load_layer_config(dims(**over), folder=folder, gpu_name=gpu)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(configs.ENV_VAR, raising=False)
    configs.clear_cache()
    yield
    configs.clear_cache()


def test_file_names_and_keys_follow_vllm():
    assert (
        configs.config_file_name("NVIDIA_H200", "gate_up_shrink")
        == "NVIDIA_H200_FUSED_MOE_LORA_W13_SHRINK.json"
    )
    assert (
        configs.config_file_name("NVIDIA_H200", "down_expand") == "NVIDIA_H200_FUSED_MOE_LORA_W2_EXPAND.json"
    )
    assert configs.config_file_name("NVIDIA_H200", "base") == "NVIDIA_H200_FUSED_MOE_BASE.json"
    # [max_loras][num_slices][m][k = rank][n = hidden][i = moe_intermediate_size]
    qwen = Dims(T=7, H=2048, I=768, E=128, top_k=8, adapters=4, rank=16, slices=2)
    oss = Dims(T=7, H=2880, I=2880, E=32, top_k=4, adapters=8, rank=32, slices=1)
    assert configs.lora_keys("gate_up_shrink", qwen) == (4, 2, 7, 16, 2048, 768)
    assert configs.lora_keys("gate_up_expand", oss) == (8, 1, 7, 32, 2880, 5760)
    assert configs.lora_keys("down_shrink", qwen) == (4, 1, 7, 16, 2048, 768)
    assert configs.base_keys(oss) == (32, 5760, 2880, 7)


@pytest.mark.parametrize(
    "call",
    [
        lambda: configs.load_layer_config(8),
        lambda: configs.load_fused_config(8),
        lambda: configs.lora_keys("down_shrink", (8, 64, 32, 16, 2, 2)),
        lambda: configs.base_keys(8),
        lambda: configs.default_config({"T": 8}),
    ],
    ids=["load_layer_config", "load_fused_config", "lora_keys", "base_keys", "default_config"],
)
def test_shapes_are_dims_only(call):
    with pytest.raises(TypeError, match=r"dims must be a moelora_lib\.shapes\.Dims"):
        call()


def test_importing_configs_does_not_import_the_kernels():
    code = (
        "import sys, moelora_lib.configs, moelora_lib.configs.loader\n"
        "bad = sorted(m for m in sys.modules if m.startswith('moelora_lib.kernels'))\n"
        "assert not bad, bad\n"
        "from moelora_lib.kernels.config import OpConfig\n"
        "assert OpConfig is moelora_lib.configs.OpConfig\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 0, r.stderr


def test_nearest_bucket_lookup(tmp_path):
    folder = write_folder(tmp_path / "f", tokens=(1, 64))
    assert load(folder, T=1).gate_up_shrink.BLOCK_SIZE_N == 16
    assert load(folder, T=20).gate_up_shrink.BLOCK_SIZE_N == 16  # |20-1| < |20-64|
    assert load(folder, T=50).gate_up_shrink.BLOCK_SIZE_N == 64
    assert load(folder, T=9000).down_expand.BLOCK_SIZE_N == 64
    # other levels are nearest too (rank, hidden, L); the base file likewise
    cfg = load(folder, T=64, R=64, H=100, L=7, I=40, E=5)
    assert cfg.gate_up_expand.BLOCK_SIZE_N == 64 and cfg.base_gate_up.BLOCK_SIZE_M == 32
    assert cfg.base_down.BLOCK_SIZE_N == 64
    # ties go to the smaller key
    assert configs.lookup({"2": 1, "4": 2}, (3,))[1] == 1


def test_num_slices_must_match_exactly(tmp_path):
    folder = write_folder(tmp_path / "f")
    with pytest.warns(UserWarning, match="num_slices"):
        cfg = load(folder, S=1)  # W13 files only have num_slices 2
    assert cfg.gate_up_shrink == default_config(dims(S=1)).gate_up_shrink
    assert cfg.source.endswith("; lora=default") and cfg.base_gate_up.BLOCK_SIZE_M == 32


def test_precedence(tmp_path, monkeypatch):
    explicit = write_folder(tmp_path / "explicit", tag=5)
    env = write_folder(tmp_path / "env", tag=6)
    shipped_root = tmp_path / "pkg"
    write_folder(shipped_root / GPU, tag=7)
    monkeypatch.setattr(loader, "SHIPPED_DIR", shipped_root)
    monkeypatch.setenv(configs.ENV_VAR, str(env))
    c = load(explicit)
    assert c.gate_up_shrink.NUM_STAGES == 5 and c.source == f"folder:{explicit}"
    c = load()
    assert c.gate_up_shrink.NUM_STAGES == 6 and c.source == f"env:{env}"
    monkeypatch.delenv(configs.ENV_VAR)
    c = load()
    assert c.gate_up_shrink.NUM_STAGES == 7 and c.source == f"shipped:{GPU}"
    with pytest.warns(configs.TunedConfigWarning, match="'OTHER_GPU'"):
        c = load(gpu="OTHER_GPU")  # nothing shipped for this GPU: defaults, said once
    assert c == default_config(W)
    assert c.source == "default"


def test_env_var_is_read_at_call_time(tmp_path, monkeypatch):
    env = write_folder(tmp_path / "env", tag=6)
    with pytest.warns(configs.TunedConfigWarning, match="'TEST_GPU'"):
        assert load().source == "default"  # the CPU has no shipped TEST_GPU folder
    monkeypatch.setenv(configs.ENV_VAR, str(env))
    assert load().source == f"env:{env}"


def _expect_error(folder, op, match):
    configs.clear_cache()
    with pytest.raises(ValueError, match=match) as e:
        load(folder)
    assert configs.config_file_name(GPU, op) in str(e.value)
    return str(e.value)


def test_malformed_json_names_file(tmp_path):
    folder = write_folder(tmp_path / "f")
    (folder / configs.config_file_name(GPU, "down_shrink")).write_text('{"2": {"1": ')
    _expect_error(folder, "down_shrink", "malformed JSON")


def test_unknown_key_names_file_and_key_path(tmp_path):
    folder = write_folder(tmp_path / "f")
    p = folder / configs.config_file_name(GPU, "gate_up_expand")
    data = json.loads(p.read_text())
    data["2"]["2"]["64"]["16"]["64"]["32"]["BLOCK_M"] = 16
    p.write_text(json.dumps(data))
    msg = _expect_error(folder, "gate_up_expand", "unknown key 'BLOCK_M'")
    assert '["2"]["2"]["64"]["16"]["64"]["32"]' in msg


def test_non_power_of_two_names_file_and_key_path(tmp_path):
    folder = write_folder(tmp_path / "f")
    p = folder / configs.config_file_name(GPU, "base")
    data = json.loads(p.read_text())
    data["4"]["64"]["64"]["1"]["base_down"]["BLOCK_SIZE_K"] = 48
    p.write_text(json.dumps(data))
    msg = _expect_error(folder, "base", "BLOCK_SIZE_K must be a power of two")
    assert '["4"]["64"]["64"]["1"]["base_down"]' in msg


def test_mismatched_block_size_m_names_files_and_keys(tmp_path):
    folder = write_folder(tmp_path / "f")
    p = folder / configs.config_file_name(GPU, "down_expand")
    data = json.loads(p.read_text())
    data["2"]["1"]["1"]["16"]["64"]["32"]["BLOCK_SIZE_M"] = 32
    p.write_text(json.dumps(data))
    msg = _expect_error(folder, "down_expand", "must share BLOCK_SIZE_M")
    assert configs.config_file_name(GPU, "gate_up_shrink") in msg and "BLOCK_SIZE_M=32" in msg


def test_non_integer_key_and_bad_nesting(tmp_path):
    folder = write_folder(tmp_path / "f")
    p = folder / configs.config_file_name(GPU, "down_shrink")
    p.write_text(json.dumps({"2": {"one": {}}}))
    _expect_error(folder, "down_shrink", "not an integer")
    base = write_folder(tmp_path / "g") / configs.config_file_name(GPU, "base")
    data = json.loads(base.read_text())
    leaf = data["4"]["64"]["64"]["1"]
    base.write_text(json.dumps({"4": {"64": leaf}}))  # a leaf two levels early
    msg = _expect_error(base.parent, "base", r"key 'base_\w+' is not an integer \(2 more level\(s\)")
    assert "the file nests 4 levels" in msg
    p.write_text(json.dumps({"2": [1, 2]}))
    _expect_error(folder, "down_shrink", "expected a non-empty JSON object")


def test_missing_file_warns_once_and_falls_back(tmp_path):
    folder = write_folder(tmp_path / "f")
    os.unlink(folder / configs.config_file_name(GPU, "down_expand"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c1 = load(folder)
        c2 = load(folder, T=64)
    msgs = [str(w.message) for w in rec if "tuned configs" in str(w.message)]
    assert len(msgs) == 1 and "FUSED_MOE_LORA_W2_EXPAND" in msgs[0] and "all four LoRA ops" in msgs[0]
    dflt = default_config(W)
    assert all(getattr(c1, op) == getattr(dflt, op) for op in LORA_OPS)
    assert c1.base_gate_up.BLOCK_SIZE_M == 32 and c1.source == f"folder:{folder}; lora=default"
    assert c2.source == c1.source


def test_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    configs.save_config_file(p, {"10": {"a": 1}, "9": {"b": 2}})
    assert list(json.loads(p.read_text())) == ["9", "10"]  # numeric order
    assert sorted(os.listdir(tmp_path)) == ["x.json"]

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        configs.save_config_file(p, {"1": {}})
    assert sorted(os.listdir(tmp_path)) == ["x.json"]
    assert json.loads(p.read_text()) == {"9": {"b": 2}, "10": {"a": 1}}  # the old file intact


def test_cache_sees_a_rewritten_file(tmp_path):
    folder = write_folder(tmp_path / "f", tag=3)
    assert load(folder).gate_up_shrink.NUM_STAGES == 3
    write_folder(folder, tag=4)
    os.utime(folder / configs.config_file_name(GPU, "gate_up_shrink"), ns=(1, 10**18))
    assert load(folder).gate_up_shrink.NUM_STAGES == 4


@pytest.mark.parametrize("model", ["tiny", "tiny-oss"])
def test_stage_tuned_matches_reference(tmp_path, monkeypatch, model, device):
    s = get_shape(model)
    inp = make_inputs(s, 5, rank=16, num_adapters=2, pattern="mixed", device=device, seed=1)
    # a tuned folder whose configs differ from the defaults (BM 32, BN 32), found through the env var
    w = Dims.of(s, 5, rank=16, adapters=2)
    folder = write_folder(tmp_path / "f", tokens=(5,), bm=32, w=w, gpu=configs.gpu_name())
    monkeypatch.setenv(configs.ENV_VAR, str(folder))
    out = fused_moe_lora(*inp.args(), **inp.kwargs(), stage="tuned")
    ref = moe_lora_reference(*inp.args(), **inp.kwargs())
    assert rel_err(out, ref) <= TOLERANCES[torch.float32]
    from moelora_lib.moe_lora import make_layer_run

    run = make_layer_run(*inp.args(), **inp.kwargs(), stage="tuned")
    assert run.cfg.source == f"env:{folder}" and run.cfg.lora_block_size_m == 32


def test_config_folder_that_does_not_exist_raises(tmp_path, monkeypatch):
    # a typo in an explicitly named folder must not silently drop every tuned config
    missing = tmp_path / "no_such_folder"
    with pytest.raises(ValueError, match="folder argument.*not a directory"):
        configs.load_layer_config(dims(L=4), folder=missing, gpu_name="TEST_GPU")
    monkeypatch.setenv(configs.ENV_VAR, str(missing))
    with pytest.raises(ValueError, match="MOELORA_TUNED_CONFIG_FOLDER"):
        configs.load_layer_config(dims(L=4), gpu_name="TEST_GPU")


# ---------------------------------------------------------------------------------------------
# Other GPU names: no silent defaults, explicit mapping only
# ---------------------------------------------------------------------------------------------
QWEN = dict(T=64, R=32, L=8)


@pytest.fixture
def no_map(monkeypatch):
    monkeypatch.setattr(loader, "_GPU_MAP", {})


def _on_gpu(monkeypatch, name):
    """Pretend to run on a GPU whose torch name is ``name`` (CPU tests)."""
    monkeypatch.setattr(loader, "_current_gpu_name", lambda: name.replace(" ", "_").replace("-", "_"))


def _qwen_dims():
    return Dims.of("qwen3-30b-a3b", QWEN["T"], rank=QWEN["R"], adapters=QWEN["L"])


def _tuned_warnings(rec):
    return [w for w in rec if issubclass(w.category, configs.TunedConfigWarning)]


@pytest.mark.parametrize("torch_name", ["NVIDIA H200 NVL", "NVIDIA H20-3e", "Some Unknown GPU"])
def test_other_gpu_name_warns_once_naming_gpu_and_folders(monkeypatch, no_map, torch_name):
    from moelora_lib.kernels import STAGES

    _on_gpu(monkeypatch, torch_name)
    gpu = torch_name.replace(" ", "_").replace("-", "_")
    d = _qwen_dims()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c1 = STAGES["tuned"].config_for(d)  # what stage "tuned" of fused_moe_lora calls
        c2 = configs.load_layer_config(dataclasses.replace(d, T=1))
    tw = _tuned_warnings(rec)
    assert len(tw) == 1, [str(w.message) for w in rec]
    msg = str(tw[0].message)
    assert repr(gpu) in msg and configs.ENV_VAR in msg and str(configs.shipped_folder(gpu)) in msg
    assert "folder argument" in msg and "map_gpu_name" in msg and "NVIDIA_H200" in msg
    assert c1 == default_config(d) and c1.source == "default" and c2.source == "default"
    # never guessed: "NVIDIA H200 NVL" does not get the H200's files
    assert c1 != configs.load_layer_config(d, gpu_name="NVIDIA_H200")


def test_other_gpu_name_warns_again_for_another_folder_set(tmp_path, monkeypatch, no_map):
    _on_gpu(monkeypatch, "NVIDIA H200 NVL")
    d = _qwen_dims()
    env = write_folder(tmp_path / "env")  # files for TEST_GPU only
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        configs.load_layer_config(d)
        configs.load_layer_config(d)
        monkeypatch.setenv(configs.ENV_VAR, str(env))
        c = configs.load_layer_config(d)
        configs.load_layer_config(d)
        c_folder = configs.load_layer_config(d, folder=env)
    tw = [str(w.message) for w in _tuned_warnings(rec)]
    assert len(tw) == 3, tw  # no folder; env folder; explicit folder (+ env not read)
    assert f"{configs.ENV_VAR}={str(env)!r}" in tw[1] and "has files for ['TEST_GPU']" in tw[1]
    assert "not read: a folder was given" in tw[1]
    assert f"folder argument {str(env)!r}" in tw[2] and "not read: folder given" in tw[2]
    assert c.source == "default" and c_folder.source == "default"


def test_map_gpu_name_uses_the_shipped_folder_explicitly(monkeypatch, no_map):
    from moelora_lib.kernels import STAGES

    _on_gpu(monkeypatch, "NVIDIA H200 NVL")
    d = _qwen_dims()
    h200 = configs.load_layer_config(d, gpu_name="NVIDIA_H200")
    assert h200.source == "shipped:NVIDIA_H200"
    assert STAGES["tuned"].config_for(d, gpu_name="NVIDIA_H200") == h200  # per call, on the stage
    configs.map_gpu_name("NVIDIA H200 NVL", "NVIDIA_H200")  # torch's spelling is accepted
    assert configs.gpu_name_map() == {"NVIDIA_H200_NVL": "NVIDIA_H200"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", configs.TunedConfigWarning)
        mapped = STAGES["tuned"].config_for(d)
    assert mapped.source == "shipped:NVIDIA_H200 (mapped from NVIDIA_H200_NVL)"
    assert mapped.replace(source=h200.source) == h200
    configs.map_gpu_name("NVIDIA_H200_NVL", None)  # removed: back to the defaults, with the warning
    with pytest.warns(configs.TunedConfigWarning, match="NVIDIA_H200_NVL"):
        assert configs.load_layer_config(d).source == "default"
    with pytest.raises(ValueError, match="no shipped tuned configs for 'NVIDIA_H100'"):
        configs.map_gpu_name("NVIDIA H200 NVL", "NVIDIA_H100")
    for gpu, use in (("NVIDIA H200 NVL", "../NVIDIA_H200"), ("NVIDIA H200 NVL", ""), (None, "NVIDIA_H200")):
        with pytest.raises(ValueError, match="map_gpu_name"):
            configs.map_gpu_name(gpu, use)
    assert configs.gpu_name_map() == {}
    assert "NVIDIA_H200" in configs.shipped_gpus() and "helion" not in configs.shipped_gpus()


def test_h200_finds_its_shipped_folder_silently(monkeypatch, no_map):
    _on_gpu(monkeypatch, "NVIDIA H200")
    d = _qwen_dims()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = configs.load_layer_config(d)
    assert c.source == "shipped:NVIDIA_H200" and c == configs.load_layer_config(d, gpu_name="NVIDIA_H200")


def test_cpu_without_folder_stays_silent(monkeypatch, no_map):
    _on_gpu(monkeypatch, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert configs.load_layer_config(_qwen_dims()).source == "default"


def test_fused_moe_lora_tuned_on_unknown_gpu_warns(monkeypatch, no_map):
    from moelora_lib.moe_lora import make_layer_run

    _on_gpu(monkeypatch, "NVIDIA H20-3e")
    inp = make_inputs(get_shape("tiny"), 3, rank=16, num_adapters=2, pattern="mixed", device="cpu", seed=0)
    with pytest.warns(configs.TunedConfigWarning, match="NVIDIA_H20_3e"):
        run = make_layer_run(*inp.args(), **inp.kwargs(), stage="tuned")
    assert run.cfg.source == "default"


# ---- configs of packed expert weights (Dims.weight_format) ----------------------------------------------
def test_packed_forms_have_their_own_base_and_fused_file_names():
    assert configs.config_file_name("G", "base", "mxfp4") == "G_FUSED_MOE_BASE_MXFP4.json"
    assert configs.config_file_name("G", "fused", "fp8_w8a8") == "G_FUSED_MOE_LORA_FUSED_FP8_W8A8.json"
    assert configs.config_file_name("G", "base_down", "fp8") == "G_FUSED_MOE_BASE_FP8.json"
    # the LoRA ops run on the activations' dtype whatever the experts' form: one file each
    lora_file = configs.config_file_name("G", "gate_up_shrink")
    assert configs.config_file_name("G", "gate_up_shrink", "mxfp4") == lora_file
    with pytest.raises(ValueError, match="weight_format must be one of"):
        configs.config_file_name("G", "base", "int4")
    with pytest.raises(ValueError, match="Dims.weight_format must be one of"):
        dims(weight_format="bf16")
    assert Dims.of("gpt-oss-20b", 1, weight_format="mxfp4").weight_format == "mxfp4"
    assert W.weight_format == "dense"


def _write_base(folder, fmt, bn, stage=None):
    data = {}
    for T in (1, 64):
        entry = {"base_gate_up": leaf(32, BLOCK_SIZE_N=bn), "base_down": leaf(32, BLOCK_SIZE_N=bn)}
        configs.set_entry(data, configs.base_keys(dims(T=T)), entry)
    configs.save_config_file(folder / configs.config_file_name(GPU, "base", fmt), data)
    fused = {}
    for T in (1, 64):
        entry = {"fused_gate_up": leaf(32, BLOCK_SIZE_N=bn), "fused_down": leaf(32, BLOCK_SIZE_N=bn)}
        configs.set_entry(fused, configs.base_keys(dims(T=T)), entry | ({"stage": stage} if stage else {}))
    configs.save_config_file(folder / configs.config_file_name(GPU, "fused", fmt), fused)


def test_a_packed_form_reads_its_own_files_where_they_exist(tmp_path):
    folder = write_folder(tmp_path / "f")  # dense base: BLOCK_SIZE_N 32 / 64
    _write_base(folder, "dense", 128, stage="tuned")
    _write_base(folder, "mxfp4", 256, stage="fused")
    mx = load(folder, weight_format="mxfp4")
    assert mx.base_gate_up.BLOCK_SIZE_N == 256 and mx.source.endswith("; base=file(mxfp4)")
    assert mx.gate_up_shrink == load(folder).gate_up_shrink  # the LoRA ops: one file for every form
    dense = load(folder)
    assert dense.base_gate_up.BLOCK_SIZE_N == 128 and "base=" not in dense.source
    fp8 = load(folder, weight_format="fp8")  # no FP8 files: the dense ones, said by nothing new
    assert fp8.base_gate_up == dense.base_gate_up and fp8.source == dense.source
    fused = configs.load_fused_config(dims(weight_format="mxfp4"), folder=folder, gpu_name=GPU)
    assert fused.base_gate_up.BLOCK_SIZE_N == 256 and fused.source.endswith("; fused=file(mxfp4)")
    assert configs.load_fused_config(dims(), folder=folder, gpu_name=GPU).source.endswith("; fused=file")
    # a form's file configures only the GEMM shapes (N, K) it holds: another takes the dense entry; another
    # E (an expert-parallel shard) takes the nearest E holding this (N, K)
    shard = load(folder, weight_format="mxfp4", E=2)
    assert shard.base_gate_up.BLOCK_SIZE_N == 256 and shard.source.endswith("; base=file(mxfp4)")
    other = load(folder, weight_format="mxfp4", H=100)
    assert other.base_gate_up.BLOCK_SIZE_N == 128 and "base=file(" not in other.source
    # another model's entry at the shard's own E (other N, K) is not taken: the nearest E with this (N, K) is
    path = folder / configs.config_file_name(GPU, "base", "mxfp4")
    data = json.loads(path.read_text())
    entry = {"base_gate_up": leaf(32, BLOCK_SIZE_N=16), "base_down": leaf(32, BLOCK_SIZE_N=16)}
    configs.set_entry(data, configs.base_keys(dims(E=2, H=100, T=1)), entry)
    configs.save_config_file(path, data)
    configs.clear_cache()
    assert load(folder, weight_format="mxfp4", E=2).base_gate_up.BLOCK_SIZE_N == 256
    assert load(folder, weight_format="mxfp4", E=2, H=100).base_gate_up.BLOCK_SIZE_N == 16
    assert (
        configs.load_stage_choice(dims(weight_format="mxfp4", H=100), folder=folder, gpu_name=GPU) == "tuned"
    )
    # stage auto's choice follows the form's file
    assert configs.load_stage_choice(dims(weight_format="mxfp4"), folder=folder, gpu_name=GPU) == "fused"
    assert configs.load_stage_choice(dims(), folder=folder, gpu_name=GPU) == "tuned"
    assert configs.load_stage_choice(dims(weight_format="fp8_w8a8"), folder=folder, gpu_name=GPU) == "tuned"


def test_a_layer_looks_up_the_form_its_weights_run_at_each_T(tmp_path, monkeypatch):
    from moelora_lib import MoELoRALayer
    from moelora_lib.kernels.stages import W8A8_MIN_TOKENS
    from moelora_lib.quant import FP8BlockWeight, MXFP4Weight

    H, I, E = 64, 32, 4
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    kw = dict(top_k=2, num_adapters=2, max_rank=16, max_tokens=8, dtype=torch.float32)
    mx = MoELoRALayer(MXFP4Weight.quantize(w13), MXFP4Weight.quantize(w2), **kw)
    fp8 = MoELoRALayer(FP8BlockWeight.quantize(w13, (32, 32)), FP8BlockWeight.quantize(w2, (32, 32)), **kw)
    dense = MoELoRALayer(w13, w2, **kw)
    assert mx._dims(1).weight_format == "mxfp4" and dense._dims(1).weight_format == "dense"
    assert fp8._dims(1).weight_format == "fp8"  # activation_scheme "auto": weight-only below W8A8_MIN_TOKENS
    assert fp8._dims(W8A8_MIN_TOKENS).weight_format == "fp8_w8a8"
    # through the environment's folder (the CPU's GPU name is "cpu"): the MXFP4 layer takes its own base file
    folder = write_folder(tmp_path / "f", gpu="cpu", w=Dims(T=1, H=H, I=I, E=E, top_k=2, adapters=2, rank=16))
    data = {}
    for T in (1, 64):
        entry = {"base_gate_up": leaf(16, BLOCK_SIZE_N=128), "base_down": leaf(16, BLOCK_SIZE_N=128)}
        configs.set_entry(
            data, configs.base_keys(Dims(T=T, H=H, I=I, E=E, top_k=2, adapters=2, rank=16)), entry
        )
    configs.save_config_file(folder / configs.config_file_name("cpu", "base", "mxfp4"), data)
    monkeypatch.setenv(configs.ENV_VAR, str(folder))
    configs.clear_cache()
    # (layers built after the folder is set: a layer resolves its configs once per T)
    mx2 = MoELoRALayer(MXFP4Weight.quantize(w13), MXFP4Weight.quantize(w2), **kw)
    for layer, want in ((mx2, 128), (MoELoRALayer(w13, w2, **kw), 32)):
        cfg = layer.config_for(1)
        assert cfg.base_gate_up.BLOCK_SIZE_N == want, (layer.weight_format, cfg)
    # an FP8 layer (scheme "auto") reads the weight-only file below W8A8_MIN_TOKENS and the W8A8 one from it
    for fmt, bn in (("fp8", 64), ("fp8_w8a8", 256)):
        data = {}
        for T in (1, 64):
            entry = {"base_gate_up": leaf(16, BLOCK_SIZE_N=bn), "base_down": leaf(16, BLOCK_SIZE_N=bn)}
            configs.set_entry(
                data, configs.base_keys(Dims(T=T, H=H, I=I, E=E, top_k=2, adapters=2, rank=16)), entry
            )
        configs.save_config_file(folder / configs.config_file_name("cpu", "base", fmt), data)
    configs.clear_cache()
    fp8b = MoELoRALayer(FP8BlockWeight.quantize(w13, (32, 32)), FP8BlockWeight.quantize(w2, (32, 32)), **kw)
    kw64 = dict(kw, max_tokens=W8A8_MIN_TOKENS)
    fp8c = MoELoRALayer(FP8BlockWeight.quantize(w13, (32, 32)), FP8BlockWeight.quantize(w2, (32, 32)), **kw64)
    assert fp8b.config_for(1).base_gate_up.BLOCK_SIZE_N == 64
    assert fp8c.config_for(W8A8_MIN_TOKENS).base_gate_up.BLOCK_SIZE_N == 256
    assert fp8c.config_for(1).base_gate_up.BLOCK_SIZE_N == 64


def test_config_files_keep_readable_permissions_and_bad_ops_are_named(tmp_path):
    # the atomic write's temporary file is 0o600: the written file gets a plain new file's mode (umask),
    # and an existing file keeps its own
    folder = write_folder(tmp_path / "f")
    p = folder / configs.config_file_name(GPU, "base")
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask
    os.chmod(p, 0o640)
    configs.save_config_file(p, configs.load_config_file(p, "base"))
    assert p.stat().st_mode & 0o777 == 0o640
    with pytest.raises(ValueError, match="op must be 'base', 'fused'"):
        configs.config_file_name(GPU, "fused_gate_up")


def test_gpu_name_in_torch_spelling_finds_the_same_files(tmp_path):
    """gpu_name and the file-name helpers take a GPU name as torch.cuda.get_device_name() spells it
    ("NVIDIA H200") or as the files do ("NVIDIA_H200"), like map_gpu_name: the spaced spelling read no file
    (defaults, and load_stage_choice silently "tuned" where the shipped file chooses "gemv")."""
    assert configs.config_file_name("NVIDIA H200", "base") == "NVIDIA_H200_FUSED_MOE_BASE.json"
    assert configs.config_file_name("MY GPU-1", "down_shrink") == "MY_GPU_1_FUSED_MOE_LORA_W2_SHRINK.json"
    assert configs.dense_config_file_name("NVIDIA H200", "shrink") == "NVIDIA_H200_SHRINK.json"
    folder = write_folder(tmp_path / "cfg", gpu="MY_GPU_1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", configs.TunedConfigWarning)
        spaced = load(folder, gpu="MY GPU-1")
    assert spaced == load(folder, gpu="MY_GPU_1") and spaced.source == f"folder:{folder}"
    assert spaced.base_gate_up.BLOCK_SIZE_M == 32  # the file's entry, not the default
    d = dataclasses.replace(_qwen_dims(), T=1)
    assert configs.load_stage_choice(d, gpu_name="NVIDIA_H200") == "gemv"  # the shipped choice at T = 1
    assert configs.load_stage_choice(d, gpu_name="NVIDIA H200") == configs.load_stage_choice(
        d, gpu_name="NVIDIA_H200"
    )
    assert configs.load_layer_config(d, gpu_name="NVIDIA H200").source == "shipped:NVIDIA_H200"
    for bad in (None, "", "../NVIDIA_H200", 3):
        with pytest.raises(ValueError, match="gpu must be a GPU name"):
            configs.config_file_name(bad, "base")
    with pytest.raises(ValueError, match="op must be 'dense_shrink' or 'dense_expand', got 3"):
        configs.dense_config_file_name("NVIDIA_H200", 3)
    for bad in ("../NVIDIA_H200", " ", ".."):
        with pytest.raises(ValueError, match="gpu_name must be a GPU name"):
            configs.load_layer_config(d, gpu_name=bad)
