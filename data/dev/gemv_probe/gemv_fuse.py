"""GPU probe: stage gemv at decode, gate_up unsplit (down shrink in its epilogue) vs split (own launch)."""
import json
import os
from dataclasses import replace

import torch

from moelora_lib import configs, shapes
from moelora_lib.shapes import Dims
from moelora_lib.studies import moe_bench as mb

out = os.path.join(os.environ.get("OUT", "."), "gemv_fuse.jsonl")
f = open(out, "w")
for model in ("gpt-oss-20b", "qwen3-30b-a3b"):
    s = shapes.get_shape(model)
    for T in (1, 2, 4, 8):
        w = mb.layer_inputs(s, T, rank=32, num_adapters=8, dtype=torch.bfloat16, device="cuda", seed=0, activation=s.activation, bias=s.has_bias)
        base_cfg = configs.load_gemv_config(Dims.of(model, T, rank=32, adapters=8))
        for name, gu_split in (("unsplit", 1), ("split2", 2)):
            cfg = base_cfg.replace(base_gate_up=replace(base_cfg.base_gate_up, SPLIT_K=gu_split))
            rows = mb.bench_layer("gemv", s, T, parts=("base", "total"), config=cfg, weights=w, rank=32,
                                  num_adapters=8, seed=0, activation=s.activation, bias=s.has_bias, dtype=torch.bfloat16,
                                  device="cuda", warmup_ms=10, rep_ms=60)
            for r in rows:
                rec = dict(model=model, T=T, variant=name, part=r["part"], us=r["us_p50"], floor_us=r["floor_us"],
                           config=r["config"])
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
        del w
        torch.cuda.empty_cache()
f.close()
