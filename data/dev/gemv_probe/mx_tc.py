"""GPU probe: tensor-core MXFP4 MoE layer (stages tuned, fused) vs its dequantized bf16 twin, base and total."""
import json
import os

import torch

from moelora_lib import shapes
from moelora_lib.studies import moe_bench as mb

f = open(os.path.join(os.environ.get("OUT", "."), "mx_tc.jsonl"), "w")
s = shapes.get_shape("gpt-oss-20b")
for T in (1, 64, 512, 4096):
    kw = dict(rank=32, num_adapters=8, dtype=torch.bfloat16, device="cuda", seed=0, activation=s.activation,
              bias=s.has_bias)
    dense = mb.layer_inputs(s, T, **kw)
    mx = mb.with_weight_format(dense, "mxfp4")
    for fmt, w in (("mxfp4", mx), ("dense", mb.with_weight_format(mx, "dense"))):
        for stage in ("tuned", "fused"):
            for r in mb.bench_layer(stage, s, T, parts=("base", "total"), weights=w, warmup_ms=10, rep_ms=40, **kw):
                rec = dict(T=T, fmt=fmt, stage=stage, part=r["part"], us=r["us_p50"], floor_us=r["floor_us"])
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
    del dense, mx
    torch.cuda.empty_cache()
f.close()
