"""Development probe (not suite evidence): where a prefill and a decode step of the model runner spend time.

    python3 scripts/dev_profile.py --models gpt-oss-20b,qwen3-30b-a3b --out OUT_DIR

For each model (random weights at the real dimensions, bf16, 8 random rank-32 adapters loaded): one
prefill of ``--prompt-len`` tokens at batch 1, with no adapter and with adapter 0, timed on the host
(device synchronized) after two warm calls, and profiled once with ``torch.profiler``: the kernel time
summed on the device, the wall time, and the top kernels by device time; then a short generation
(CUDA-graph decode) at batch 1 and 8 for the decode step time. Prints a table; writes
``dev_profile.txt`` (and a CSV of the top kernels) under OUT_DIR. The numbers are a development
measurement: they steer the next change and are quoted only as such.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def _wall(fn, reps: int = 3) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def _profile(fn, top: int, log, label: str, rows: list) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    dev = [k for k in ka if getattr(k, "device_time_total", 0) > 0 and k.device_type.name == "CUDA"]
    total = sum(k.device_time_total for k in dev)
    dev.sort(key=lambda k: -k.device_time_total)
    log(f"  [{label}] device kernel time {total / 1e3:.2f} ms over {sum(k.count for k in dev)} launches")
    for k in dev[:top]:
        log(f"    {k.device_time_total / 1e3:8.3f} ms  x{k.count:5d}  {k.key[:110]}")
        rows.append(dict(label=label, kernel=k.key, ms=k.device_time_total / 1e3, count=k.count))
    return total / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--prompt-len", type=int, default=1600)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--stage", default="tuned")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    from moelora_lib.model.generate import Generator
    from moelora_lib.studies import e2e

    rows: list[dict] = []
    dev = torch.device("cuda")
    for name in a.models.split(","):
        t0 = time.perf_counter()
        model = e2e.build_model(
            name,
            stage=a.stage,
            dtype=torch.bfloat16,
            device=dev,
            max_batch=8,
            max_seq=a.prompt_len + a.new_tokens + 8,
            max_tokens=8192,
            num_adapters=8,
            max_rank=32,
        )
        for slot in range(8):
            e2e.load_random_adapter(model, slot, rank=32, alpha=64.0, seed=slot)
        log(f"{name}: built + 8 adapters in {time.perf_counter() - t0:.0f} s")
        V = model.config.vocab_size
        ids = torch.randint(0, V, (1, a.prompt_len), device=dev)
        start = torch.zeros(1, dtype=torch.int64, device=dev)
        for lid in (-1, 0):
            lora = torch.full((1,), lid, dtype=torch.int32, device=dev)

            def prefill(lora=lora, model=model, ids=ids, start=start):
                return model(ids, start, lora, last_only=True, kv_len=a.prompt_len)

            prefill()
            prefill()
            wall = _wall(prefill)
            kern = _profile(prefill, a.top, log, f"{name} prefill lora={lid}", rows)
            log(f"  {name} prefill {a.prompt_len} tok lora={lid}: wall {wall:.1f} ms, kernels {kern:.1f} ms")
        gen = Generator(model)
        for conc, scen in ((1, "base"), (1, "adapters_mixed"), (8, "adapters_mixed")):
            row = e2e.run_generation(
                gen, name, scen, concurrency=conc, prompt_len=a.prompt_len, new_tokens=a.new_tokens
            )
            log(
                f"  {name} {scen} c={conc}: TTFT {row['ttft_ms_mean']:.1f} ms, "
                f"step {row['step_ms_p50']:.3f} ms, {row['otps_per_request']:.1f} OTPS"
            )
        bd = e2e.step_breakdown(model, batch=1, adapters=[0], position=a.prompt_len)
        log(f"  {name} eager step breakdown (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in bd.items()))
        del gen, model
        e2e.free_memory(dev)
    (out / "dev_profile.txt").write_text("\n".join(lines) + "\n")
    try:
        import pandas as pd

        pd.DataFrame(rows).to_csv(out / "dev_profile_kernels.csv", index=False)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
