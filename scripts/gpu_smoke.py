"""Quick GPU check of every stage: bf16 correctness at model shapes and a first timing table.

Usage (on a CUDA host): python scripts/gpu_smoke.py [out_dir]. Prints a table; writes smoke.csv.
"""

import sys
import time

import torch

from moelora_lib import STAGES
from moelora_lib.moe_lora import make_layer_run
from moelora_lib.reference import moe_lora_reference
from moelora_lib.shapes import get_shape
from moelora_lib.studies.bench import result_row, time_cuda, write_rows
from moelora_lib.testing import rel_err
from moelora_lib.workloads import make_inputs


def main(out_dir="."):
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for model, T in [("gpt-oss-20b", 64), ("qwen3-30b-a3b", 200)]:
        inp = make_inputs(
            get_shape(model), T, rank=32, num_adapters=8, pattern="mixed", dtype=torch.bfloat16, device="cuda"
        )
        ref = moe_lora_reference(*inp.args(), **inp.kwargs())
        for st in STAGES:
            run = make_layer_run(*inp.args(), **inp.kwargs(), stage=st)
            out = run()
            print(f"check {model} T={T} {st}: rel_err {rel_err(out, ref):.2e}", flush=True)
    for model in ["gpt-oss-20b", "qwen3-30b-a3b"]:
        for T in [1, 64, 1600, 8192]:
            inp = make_inputs(
                get_shape(model),
                T,
                rank=32,
                num_adapters=8,
                pattern="uniform",
                dtype=torch.bfloat16,
                device="cuda",
                bias=False,
            )
            kw = dict(activation="silu", b13=None, b2=None)
            for st in ["naive", "split_k", "even_k_fused_add"]:
                t0 = time.time()
                run = make_layer_run(*inp.args(), **kw, stage=st)
                run()
                torch.cuda.synchronize()
                res = {}
                for part, fn in [("base", run.base_part), ("lora", run.lora_part), ("total", run)]:
                    tm = time_cuda(fn, mode="graph", warmup_ms=10, rep_ms=40)
                    res[part] = tm.ms_p50 * 1000
                    rows.append(
                        result_row(
                            model=model,
                            T=T,
                            stage=st,
                            part=part,
                            us_p50=tm.ms_p50 * 1000,
                            config=run.cfg.short(),
                        )
                    )
                print(
                    f"{model:14s} T={T:5d} {st:18s} base {res['base']:8.1f} lora {res['lora']:8.1f} "
                    f"total {res['total']:8.1f} us  ({time.time() - t0:.1f}s)",
                    flush=True,
                )
    write_rows(f"{out_dir}/smoke.csv", rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
