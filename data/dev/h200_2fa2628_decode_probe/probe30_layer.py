"""Same-call A/B on whatever GPU this is: stage fused with and without fuse_shrink (the H200's shipped fused
configs, mapped), stage tuned beside, the layer total at T = 1 and 8, GPT-OSS-20B and Qwen3-30B-A3B."""
import json
import os

import torch

from moelora_lib.configs import map_gpu_name
from moelora_lib.studies import moe_bench
from moelora_lib.workloads import Workload

out = os.environ.get("OUT", ".")
gpu = torch.cuda.get_device_name(0)
print("gpu", gpu, flush=True)
if "H200" not in gpu:
    map_gpu_name(gpu, "NVIDIA_H200")
rows = []
for model in ("gpt-oss-20b", "qwen3-30b-a3b"):
    weights = None
    for T in (1, 8):
        wl = Workload(model=model, T=T, pattern="uniform")
        inp = moe_bench._inputs(wl, weights)
        weights = inp
        cfg = moe_bench.make_run("fused", inp).cfg
        variants = [("tuned", None, "tuned"), ("fused", cfg, "fused"),
                    ("fused", cfg.replace(fuse_shrink=True), "fused+shrink")]
        for rep in range(2):
            for stage, c, label in variants:
                for r in moe_bench.bench_layer(stage, wl, config=c, weights=inp, parts=("total",)):
                    r["label"], r["rep"] = label, rep
                    rows.append(r)
                    print(f"{model:14s} T={T:2d} {label:13s} rep{rep}: {r['us_p50']:.1f} us  {r['config']}", flush=True)
with open(os.path.join(out, "probe30_layer.json"), "w") as f:
    json.dump(rows, f, default=str, indent=1)
