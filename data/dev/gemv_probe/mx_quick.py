"""MXFP4 gemv after the fp16-pattern decode: GPT-OSS-20B / Qwen3-30B-A3B at T = 1 and 8, a few configs,
against the bf16 gemv on the same (dequantized) weights; correctness vs the dequantized run."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_decode_lib import decode_moe  # noqa: E402
from moelora_lib.quant import MXFP4Weight  # noqa: E402
from moelora_lib.studies import bench  # noqa: E402

out = open(os.path.join(os.environ.get("OUT", "."), "mx_quick.jsonl"), "w")


def emit(**r):
    print(json.dumps(r), flush=True)
    out.write(json.dumps(r) + "\n")
    out.flush()


MODELS = {
    "gpt-oss-20b": dict(E=32, H=2880, I=2880, K=4, act="swigluoai", bias=True, gu=(16, 256, 2, 4), dn=(32, 256, 1, 8)),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, K=8, act="silu", bias=False, gu=(32, 256, 2, 4), dn=(32, 256, 1, 4)),
}
MX = [(16, 256, 1, 4), (32, 256, 1, 4), (32, 128, 1, 4), (16, 512, 1, 4), (32, 256, 2, 4), (64, 256, 1, 8)]
for model, d in MODELS.items():
    E, H, I, K = d["E"], d["H"], d["I"], d["K"]
    g = torch.Generator(device="cuda").manual_seed(0)
    mx13 = MXFP4Weight(torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, device="cuda", generator=g),
                       torch.randint(118, 124, (E, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=g))
    mx2 = MXFP4Weight(torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, device="cuda", generator=g),
                      torch.randint(118, 124, (E, H, I // 32), dtype=torch.uint8, device="cuda", generator=g))
    w13, w2 = mx13.dequantize(torch.bfloat16), mx2.dequantize(torch.bfloat16)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.02).bfloat16() if d["bias"] else None
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16() if d["bias"] else None
    for T in (1, 8):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T, E, device="cuda", generator=g)
        tw, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
        ref = decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], d["gu"], d["dn"])
        t = bench.time_cuda(lambda: decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], d["gu"], d["dn"]), flush_l2=True)
        emit(model=model, T=T, fmt="bf16", gu=d["gu"], dn=d["dn"], us=t.ms_p50 * 1e3)
        for c in MX:
            for which in ("gu", "dn"):
                cg, cd = (c, (32, 256, 1, 4)) if which == "gu" else ((16, 512, 1, 4), c)
                fn = lambda: decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], cg, cd, mx13=mx13, mx2=mx2)  # noqa
                got = fn()
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = bench.time_cuda(fn, flush_l2=True)
                emit(model=model, T=T, fmt="mxfp4", gu=cg, dn=cd, us=t.ms_p50 * 1e3, rel_err=err)
print("mx_quick done", flush=True)
