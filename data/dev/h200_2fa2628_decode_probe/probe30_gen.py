"""Same-call A/B on whatever GPU this is: decode OTPS of a request with no adapter while 8 are loaded, with
the per-step LoRA variants (base-only graph) against one graph with every loaded slot's launches."""
import json
import os
import sys

import torch

from moelora_lib.model.generate import Generator
from moelora_lib.studies import e2e

out = os.environ.get("OUT", ".")
names = sys.argv[1:] or ["gpt-oss-20b"]
rows = []
print("gpu", torch.cuda.get_device_name(0), flush=True)


def run(gen, name, scen, c, new, label):
    r = e2e.run_generation(gen, name, scen, concurrency=c, prompt_len=1600, new_tokens=new, seed=0, warm_tokens=4)
    r["label"] = label
    rows.append(r)
    print(f"{label:34s} {name} c={c}: OTPS/req {r['otps_per_request']:.1f}  TTFT {r['ttft_ms_mean']:.1f} ms", flush=True)


for name in names:
    new = 128
    model = e2e.build_model(name, stage="tuned", dtype=torch.bfloat16, device="cuda", max_batch=8, max_seq=1800,
                            max_tokens=8192, num_adapters=8, max_rank=32)
    gen = Generator(model, graph_batch_sizes=[1, 8])
    for rep in range(2):
        for c in (1, 8):
            run(gen, name, "base", c, new, f"base_nothing_loaded#{rep}")
    e2e.load_adapters(model, name, rank=32, alpha=64, seed=0, file_slots=[])
    for rep in range(2):
        gen.reset_graphs()
        gen._has_variants = True
        for c in (1, 8):
            run(gen, name, "base", c, new, f"no_adapter_8_loaded_variants#{rep}")
        gen.reset_graphs()
        gen._has_variants = False
        for c in (1, 8):
            run(gen, name, "base", c, new, f"no_adapter_8_loaded_one_graph#{rep}")
    gen.reset_graphs()
    gen._has_variants = True
    for c in (1, 8):
        run(gen, name, "adapters_mixed", c, new, "adapters_mixed")
    del gen, model
    e2e.free_memory("cuda")
with open(os.path.join(out, "probe30_gen.json"), "w") as f:
    json.dump(rows, f, default=str, indent=1)
