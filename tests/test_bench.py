"""CPU-testable parts of the benchmark harness: environment record, result rows, CSV round trip, floors,
and the CPU timer. time_cuda itself needs a GPU (tests marked gpu)."""

from __future__ import annotations

import json
import math

import pytest

from moelora_lib.studies import bench

ENV_KEYS = {
    "gpu", "gpu_count", "driver", "cuda", "torch", "triton", "helion", "numpy", "python",
    "git_commit", "hostname", "timestamp_utc", "TRITON_INTERPRET", "MOELORA_TUNED_CONFIG_FOLDER",
}  # fmt: skip


def test_env_record_keys_and_values(monkeypatch, tmp_path):
    monkeypatch.setenv("MOELORA_TUNED_CONFIG_FOLDER", str(tmp_path))
    rec = bench.env_record()
    assert ENV_KEYS <= set(rec)
    assert rec["MOELORA_TUNED_CONFIG_FOLDER"] == str(tmp_path)
    assert rec["torch"] != "absent" and rec["triton"] != "absent"
    assert isinstance(rec["git_commit"], str) and rec["git_commit"]
    json.dumps(rec)  # serializable as is


def test_result_row_adds_env_columns_and_expands_timing():
    t = bench.Timing(ms_p50=1.5, ms_p20=1.0, ms_p80=2.0, mode="eager")
    row = bench.result_row(stage="naive", op="fused_moe_lora", T=16, timing=t)
    assert set(bench.ENV_COLUMNS) <= set(row)
    assert row["stage"] == "naive" and row["T"] == 16
    assert (row["ms_p50"], row["ms_p20"], row["ms_p80"], row["mode"]) == (1.5, 1.0, 2.0, "eager")
    assert "timing_mode" not in row  # one timing column in every result row: mode
    assert bench.result_row(gpu="override")["gpu"] == "override"  # explicit fields win


def test_write_rows_round_trip(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "nested" / "stage.csv"
    rows = [bench.result_row(stage="naive", T=t, ms_p50=0.1 * t) for t in (1, 16)]
    bench.write_rows(path, rows)
    df = pd.read_csv(path)
    assert list(df["T"]) == [1, 16] and "git_commit" in df.columns
    bench.write_rows(path, [bench.result_row(stage="split_k", T=64, ms_p50=0.2, extra=1)], append=True)
    df = pd.read_csv(path)
    assert list(df["stage"]) == ["naive", "naive", "split_k"] and "extra" in df.columns
    bench.write_rows(path, rows)  # append=False overwrites
    assert len(pd.read_csv(path)) == 2


def test_save_env(tmp_path):
    rec = bench.save_env(tmp_path / "env" / "cpu.json")
    assert json.loads((tmp_path / "env" / "cpu.json").read_text())["python"] == rec["python"]


def test_floors():
    # 4.3 TB/s: 4.3e6 bytes take 1 µs; 675 TFLOP/s: 675e6 flops take 1 µs.
    assert math.isclose(bench.copy_bandwidth_floor_us(4.3e6), 1.0)
    assert math.isclose(bench.copy_bandwidth_floor_us(1e12, tb_per_s=1.0), 1e6)
    assert math.isclose(bench.compute_floor_us(675e6), 1.0)
    assert math.isclose(bench.compute_floor_us(2 * 8192**3, tflops=675.0), 2 * 8192**3 / 675e12 * 1e6)
    with pytest.raises(ValueError):
        bench.copy_bandwidth_floor_us(1.0, tb_per_s=0)


def test_time_cpu_quantiles():
    calls = []
    t = bench.time_cpu(lambda: calls.append(1), reps=5)
    assert len(calls) == 6  # 1 warm-up + 5 timed
    assert t.mode == "cpu" and 0 <= t.ms_p20 <= t.ms_p50 <= t.ms_p80
    assert bench._quantiles([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((3.0, 1.8, 4.2))


@pytest.mark.parametrize("flush", ["warm", 1, 0, None])
def test_time_cuda_bad_flush_raises(flush):
    with pytest.raises(ValueError, match="flush_l2"):
        bench.time_cuda(lambda: None, flush_l2=flush)


def test_time_cuda_bad_mode_raises_before_cuda_check():
    with pytest.raises(ValueError, match="mode"):
        bench.time_cuda(lambda: None, mode="bogus")


@pytest.mark.parametrize("min_reps", [0, -1, 2.5, True, "10"])
def test_time_cuda_bad_min_reps_raises_before_cuda_check(min_reps):
    with pytest.raises(ValueError, match="min_reps"):
        bench.time_cuda(lambda: None, min_reps=min_reps)


@pytest.mark.gpu
def test_time_cuda_min_reps_raises_the_budget():
    """A ~1 ms call (a 2 GiB copy) with rep_ms = 1 gets more repetitions with min_reps than without.

    Not exactly min_reps: do_bench's own estimate counts its L2 flush per call, this one does not (on the
    H200 at cd22587: 15 calls in all with min_reps = 8, i.e. ~5 timed ones, against 1 without)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randint(0, 255, (2 * 2**30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    counts = {}
    for min_reps in (None, 8):
        calls = []
        fn = lambda calls=calls: calls.append(y.copy_(x))  # noqa: E731
        t = bench.time_cuda(fn, mode="eager", warmup_ms=1, rep_ms=1, min_reps=min_reps)
        assert t.mode == "eager" and 0 < t.ms_p50
        counts[min_reps] = len(calls)
    # 3 warm-up (+ 3 estimate with min_reps) + do_bench's 1 + 5 estimate + >= 1 warm-up, then the timed ones
    assert counts[8] >= counts[None] + 3 + 3, counts


def test_time_cuda_without_gpu_raises():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.time_cuda(lambda: None)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("flush_l2", [True, False, "clean"])
def test_time_cuda_copy(mode, flush_l2):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = bench.time_cuda(lambda: y.copy_(x), mode=mode, flush_l2=flush_l2, rep_ms=20)
    assert t.mode == mode and 0 < t.ms_p20 <= t.ms_p50 <= t.ms_p80
    # A 64 MiB copy moves 128 MiB; it cannot beat the copy floor by more than measurement noise.
    assert t.ms_p50 * 1e3 > 0.5 * bench.copy_bandwidth_floor_us(2 * x.numel())
