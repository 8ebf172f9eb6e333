"""W8A8 vs weight-only FP8 vs bf16: the MoE base path (no LoRA launches) of stage tuned at qwen3-30b-a3b
and gpt-oss-20b sizes over T, and a BLOCK_SIZE_K check of w8a8_config. Writes w8a8_bench.csv under $OUT.

Run from the repository root on a GPU: python3 data/dev/w8a8_probe/bench_w8a8.py
"""

import csv
import os
import sys
from dataclasses import replace

import torch
import triton

from moelora_lib.moe_lora import make_layer_run
from moelora_lib.quant import FP8BlockWeight
from moelora_lib.shapes import get_shape
from moelora_lib.workloads import make_inputs

OUT = os.environ.get("OUT", ".")
rows = []


def bench(fn):
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    return ms


def write():
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("model", "T", "variant", "what"), k))
    with open(os.path.join(OUT, "w8a8_bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(models=("qwen3-30b-a3b", "gpt-oss-20b"), Ts=(64, 256, 1024, 1600, 4096, 8192)):
    dev = "cuda"
    for model in models:
        shape = get_shape(model)
        for T in Ts:
            inp = make_inputs(shape, T, rank=16, num_adapters=4, dtype=torch.bfloat16, device=dev, seed=0)
            w13 = FP8BlockWeight.quantize(inp.w13.float())
            w2 = FP8BlockWeight.quantize(inp.w2.float())
            d13, d2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
            ids = torch.full_like(inp.lora_ids, -1)
            common = (
                inp.topk_weights,
                inp.topk_ids,
                ids,
                inp.lora_a13,
                inp.lora_b13,
                inp.lora_a2,
                inp.lora_b2,
            )
            kw = dict(activation=shape.activation, b13=inp.b13, b2=inp.b2, stage="tuned", check_values=False)
            res = {}
            for name, a, b, scheme in (
                ("bf16", d13, d2, "weight_only"),
                ("fp8_weight_only", w13, w2, "weight_only"),
                ("fp8_w8a8", w13, w2, "dynamic"),
            ):
                run = make_layer_run(inp.hidden_states, a, b, *common, **kw, activation_scheme=scheme)
                out = run.base_part()
                ms = bench(run.base_part)
                res[name] = (ms, out)
                cfg = run.cfg
                row = dict(
                    model=model,
                    T=T,
                    variant=name,
                    what="base_part",
                    ms_p50=ms[0],
                    ms_p20=ms[1],
                    ms_p80=ms[2],
                    cfg_gate_up=cfg.base_gate_up.short(),
                    cfg_down=cfg.base_down.short(),
                )
                for op in ("base_gate_up", "base_down"):
                    row[f"{op}_ms"] = bench(run.op_fn(op))[0]
                rows.append(row)
                print(row, flush=True)
                if name == "fp8_w8a8" and T >= 1024:  # BLOCK_SIZE_K of the 16-bit config vs doubled
                    for op in ("base_gate_up", "base_down"):
                        c = getattr(cfg, op)
                        for bk, st in (
                            (64, c.NUM_STAGES),
                            (128, c.NUM_STAGES),
                            (128, max(2, c.NUM_STAGES - 1)),
                        ):
                            alt = replace(c, BLOCK_SIZE_K=bk, NUM_STAGES=st)
                            try:
                                t = bench(run.op_fn(op, alt))[0]
                            except Exception as e:  # out of shared memory
                                t = float("nan")
                                print("skip", alt.short(), type(e).__name__, file=sys.stderr)
                            rows.append(
                                dict(model=model, T=T, variant=name, what=f"{op}:{alt.short()}", ms_p50=t)
                            )
            ref = res["bf16"][1].float()
            for name in ("fp8_weight_only", "fp8_w8a8"):
                err = ((res[name][1].float() - ref).abs().max() / ref.abs().max()).item()
                speed = res["bf16"][0][0] / res[name][0][0]
                ms = res[name][0][0]
                print(f"{model} T={T} {name}: {ms:.4f} ms, {speed:.2f}x bf16, rel_err vs bf16 {err:.3e}")
                rows.append(
                    dict(model=model, T=T, variant=name, what="speedup_vs_bf16", ms_p50=speed, rel_err=err)
                )
            write()
            del inp, w13, w2, d13, d2, res
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
