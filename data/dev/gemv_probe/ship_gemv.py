"""Ship stage gemv's H200 choices from a probe JSON (probe_decode.json): per (model, T) where the gemv layer
with 8 adapters beats stages tuned and fused, write its configs and the choice into the shipped fused file;
add an m = 16 leaf (the m = 8 leaf's fused configs, the m = 8 stage unless that is gemv: then tuned) so
that gemv covers only T ≤ 12 (measured at 1 and 8)."""
import copy
import json
import sys

from moelora_lib import configs
from moelora_lib.configs.schema import OpConfig
from moelora_lib.shapes import Dims
from moelora_lib.studies.fused_tuning import write_gemv_configs, write_stage_choices

rows = json.load(open(sys.argv[1]))
path = "moelora_lib/configs/NVIDIA_H200/NVIDIA_H200_FUSED_MOE_LORA_FUSED.json"
layer = {}
for r in rows:
    if r["what"] == "layer":
        layer.setdefault((r["model"], r["T"]), {})[r["stage"]] = r
best = {}
for r in rows:
    if r["what"] == "gemv_path" and r["fmt"] == "bf16":
        k = (r["model"], r["T"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
shrink = {}
for r in rows:
    if r["what"] == "gemv_path_lora":
        k = (r["model"], r["T"])
        if k not in shrink or r["us"] < shrink[k]["us"]:
            shrink[k] = r
entries, choices = {}, {}
for (model, T), st in sorted(layer.items()):
    if not {"gemv", "tuned", "fused"} <= set(st):
        continue
    g, o = st["gemv"]["us_lora"], min(st["tuned"]["us_lora"], st["fused"]["us_lora"])
    print(model, T, "gemv", round(g, 1), "tuned", round(st["tuned"]["us_lora"], 1), "fused", round(st["fused"]["us_lora"], 1))
    if T != 1 or g >= 0.95 * o:  # T = 1 only, and a clear margin
        continue
    d = Dims.of(model, T, rank=32, adapters=8)
    keys = configs.base_keys(d)
    gu, dn = best[(model, T)]["gu"], best[(model, T)]["dn"]
    sh = shrink[(model, T)]["shrink"]
    entries[keys] = {
        "gate_up": OpConfig(BLOCK_SIZE_N=gu[0], BLOCK_SIZE_K=gu[1], SPLIT_K=gu[2], NUM_WARPS=gu[3]),
        "down": OpConfig(BLOCK_SIZE_N=dn[0], BLOCK_SIZE_K=dn[1], SPLIT_K=dn[2], NUM_WARPS=dn[3]),
        "shrink": OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
    }
    choices[keys] = "gemv"
# m = 16 leaves: gemv only up to T = 12
data = json.load(open(path))
cd = data["config_data"] if "config_data" in data else data
for keys in []:
    E, N, K, m = keys
    if m == 8:
        node = cd[str(E)][str(N)][str(K)]
        if "16" not in node:
            leaf = copy.deepcopy(node["8"])
            leaf.pop("gemv", None)
            leaf["stage"] = "tuned" if leaf.get("stage", "tuned") == "gemv" else leaf.get("stage", "tuned")
            node["16"] = leaf
configs.save_config_file(path, cd)
write_gemv_configs(path, entries)
write_stage_choices(path, choices)
print("shipped", {k: v for k, v in choices.items()})
