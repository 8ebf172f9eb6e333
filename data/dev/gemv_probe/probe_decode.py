"""Decode-path MoE base on whatever GPU this is: the library's base part (stages tuned, fused) against the
split-K GEMV path (bf16 and MXFP4 weights), GPT-OSS-20B and Qwen3-30B-A3B, T = 1 and 8. Copy bandwidth too."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from moelora_lib.quant import MXFP4Weight  # noqa: E402
from moelora_lib.layer import MoELoRALayer  # noqa: E402


from moelora_lib.kernels.gemv import _gemv_gate_up_kernel  # noqa: E402
from probe_decode_lib import _cfg, decode_moe  # noqa: E402

from moelora_lib.configs import map_gpu_name  # noqa: E402
from moelora_lib.studies import bench, moe_bench  # noqa: E402
from moelora_lib.workloads import Workload  # noqa: E402

out_dir = os.environ.get("OUT", ".")
gpu = torch.cuda.get_device_name(0)
print("gpu", gpu, torch.__version__, flush=True)
if "H200" not in gpu:
    map_gpu_name(gpu, "NVIDIA_H200")
rows = []
T0 = time.time()
BUDGET = float(os.environ.get("PROBE_BUDGET_S", "420"))


def left():
    return BUDGET - (time.time() - T0)


def emit(**r):
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(out_dir, "probe_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


# copy bandwidth (read + write), 2 GiB
a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
b = torch.empty_like(a)
tm = bench.time_cuda(lambda: b.copy_(a), flush_l2=False)
emit(what="copy", us=tm.ms_p50 * 1e3, tb_s=2 * a.numel() * 2 / (tm.ms_p50 * 1e-3) / 1e12)
del a, b

MODELS = {
    "gpt-oss-20b": dict(E=32, H=2880, I=2880, K=4, act="swigluoai", bias=True),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, K=8, act="silu", bias=False),
}
GU_CFGS = [(16, 256, 1, 4), (32, 256, 1, 4), (32, 128, 1, 4), (64, 128, 1, 4), (16, 512, 1, 4), (32, 256, 2, 4),
           (16, 256, 2, 4), (32, 256, 1, 8)]
DN_CFGS = GU_CFGS
MX_CFGS = [(32, 256, 1, 4), (32, 512, 1, 8), (64, 256, 1, 8), (16, 512, 1, 4)]

for T_OUTER, (model, d) in [(t, md) for t in (1, 8) for md in MODELS.items()]:
    E, H, I, K = d["E"], d["H"], d["I"], d["K"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.02).bfloat16() if d["bias"] else None
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16() if d["bias"] else None
    mx13 = MXFP4Weight(torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, device="cuda", generator=g),
                       torch.randint(118, 124, (E, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=g))
    mx2 = MXFP4Weight(torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, device="cuda", generator=g),
                      torch.randint(118, 124, (E, H, I // 32), dtype=torch.uint8, device="cuda", generator=g))
    for T in (T_OUTER,):
        if left() < 60:
            break
        wl = Workload(model=model, T=T, pattern="uniform")
        inp = moe_bench._inputs(wl, None)
        for stage in ("tuned", "fused"):
            for r in moe_bench.bench_layer(stage, wl, weights=inp, parts=("base", "total")):
                emit(what="lib", model=model, T=T, stage=stage, part=r["part"], us=r["us_p50"], config=r["config"],
                     floor_us=r["floor_us"])
        x = (torch.randn(T, H, device="cuda", generator=g)).bfloat16()
        logits = torch.randn(T, E, device="cuda", generator=g)
        tw, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        tw = (tw / tw.sum(-1, keepdim=True)).float()
        ids = ids.to(torch.int32)
        nexp = ids.unique().numel()
        bytes_bf16 = nexp * (2 * I * H + H * I) * 2
        bytes_mx = nexp * (2 * I * H + H * I) * (0.5 + 1 / 32)
        P = T * K
        scratch = torch.empty(P * 2 * I + P * H, dtype=torch.float32, device="cuda")
        yout = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")

        def sweep(fmt, gu_list, dn_list, dn_fixed, gu_fixed):
            best = {}
            kw = dict(mx13=mx13, mx2=mx2) if fmt == "mxfp4" else {}
            nb = bytes_mx if fmt == "mxfp4" else bytes_bf16
            for which, lst in (("gate_up", gu_list), ("down", dn_list)):
                res = []
                for c in lst:
                    if left() < 40:
                        break
                    cg = c if which == "gate_up" else best.get("gate_up", gu_fixed)
                    cd = c if which == "down" else dn_fixed
                    fn = lambda: decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], cg, cd, scratch=scratch,  # noqa
                                            out=yout, **kw)
                    try:
                        tm = bench.time_cuda(fn, flush_l2=True)
                    except Exception as e:  # noqa
                        emit(what="err", model=model, T=T, fmt=fmt, sweep=which, cfg=c, err=str(e)[:200])
                        continue
                    us = tm.ms_p50 * 1e3
                    res.append((us, c))
                    emit(what="gemv_path", model=model, T=T, fmt=fmt, sweep=which, gu=cg, dn=cd, us=us,
                         floor_us=nb / 4.27e6, experts=nexp)
                if res:
                    best[which] = min(res)[1]
            return best

        ref = decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], (32, 256, 1, 4), (32, 256, 1, 4))
        bestb = sweep("bf16", GU_CFGS, DN_CFGS, (32, 256, 2, 4), (32, 256, 1, 4))
        # the winner checked against a plain torch computation
        yb = decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], bestb.get("gate_up"), bestb.get("down"))
        emit(what="check", model=model, T=T, maxdiff=(yb.float() - ref.float()).abs().max().item(),
             refmax=ref.float().abs().max().item())
        # gate_up alone at the best config (its share of the path)
        if "gate_up" in bestb:
            bn, bk, sk, nw = bestb["gate_up"]
            ordr = torch.argsort(ids.reshape(-1), stable=True)
            h = scratch[: P * 2 * I].view(P, 2 * I)

            def gu_only():
                fi = ids.reshape(-1)
                _gemv_gate_up_kernel[(P * sk, (2 * I + bn - 1) // bn)](
                    x, w13, w13, h, ordr, fi, fi, h, h, 2 * I, H, E, K, 0, 1, 0, x.stride(0), w13.stride(0),
                    w13.stride(1), 0, 0, h.stride(0), 0, 0, 0, 0, 0, 0,
                    BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, SPLIT_K=sk, MXFP4=False, HAS_LORA=False, BLOCK_SIZE_R=16, num_warps=nw)
            tm = bench.time_cuda(gu_only, flush_l2=True)
            emit(what="gate_up_alone", model=model, T=T, cfg=bestb["gate_up"], us=tm.ms_p50 * 1e3,
                 tb_s=nexp * 2 * I * H * 2 / (tm.ms_p50 * 1e-3) / 1e12)
        # with 8 adapters, rank 32, one random adapter per token
        S = 1 if d["act"] == "swigluoai" else 2
        L, R = 8, 32
        a13 = (torch.randn(L, E, S, R, H, device="cuda", generator=g) * 0.02).bfloat16()
        bl13 = (torch.randn(L, E, S, 2 * I // S, R, device="cuda", generator=g) * 0.02).bfloat16()
        a2 = (torch.randn(L, E, R, I, device="cuda", generator=g) * 0.02).bfloat16()
        bl2 = (torch.randn(L, E, H, R, device="cuda", generator=g) * 0.02).bfloat16()
        lids = torch.randint(0, L, (T,), device="cuda", generator=g).to(torch.int32)
        lscratch = torch.empty(P * 2 * I + P * H + P * S * R + P * R, dtype=torch.float32, device="cuda")
        for scfg in [(128, 4, 4), (256, 2, 4), (128, 8, 4)]:
            if left() < 40 or "gate_up" not in bestb:
                break
            fn = lambda: decode_moe(x, w13, w2, b13, b2, tw, ids, d["act"], bestb["gate_up"], bestb["down"],  # noqa
                                    scratch=lscratch, out=yout, lora=(lids, a13, bl13, a2, bl2), shrink_cfg=scfg)
            tm = bench.time_cuda(fn, flush_l2=True)
            emit(what="gemv_path_lora", model=model, T=T, gu=bestb["gate_up"], dn=bestb["down"], shrink=scfg,
                 us=tm.ms_p50 * 1e3)
        # the serving layer as the model calls it (graph, 8 rank-32 adapters loaded, one per token)
        if left() > 60 and "gate_up" in bestb:
            best_cfg = _cfg(bestb["gate_up"], bestb["down"], (128, 4, 4))
            for st in ("gemv", "tuned", "fused"):
                lay = MoELoRALayer(w13, w2, top_k=K, num_adapters=L, max_rank=R, max_tokens=64, slices=S, b13=b13,
                                   b2=b2, activation=d["act"], stage=st, config=best_cfg if st == "gemv" else None)
                for slot in range(L):
                    lay.load_adapter(slot, gate_up=(a13[slot], bl13[slot]), down=(a2[slot], bl2[slot]))
                yl = lay(x, topk_weights=tw, topk_ids=ids, lora_ids=lids)
                tm = bench.time_cuda(lambda: lay(x, topk_weights=tw, topk_ids=ids, lora_ids=lids), flush_l2=True)
                lay.active_slots = frozenset()
                none = torch.full_like(lids, -1)
                tb = bench.time_cuda(lambda: lay(x, topk_weights=tw, topk_ids=ids, lora_ids=none), flush_l2=True)
                lay.active_slots = None
                emit(what="layer", model=model, T=T, stage=st, us_lora=tm.ms_p50 * 1e3, us_base=tb.ms_p50 * 1e3,
                     maxabs=yl.float().abs().max().item(), cfg=lay.config_for(T).short())
                if st == "gemv":
                    ygemv = yl
                else:
                    emit(what="layer_check", model=model, T=T, stage=st,
                         rel=((ygemv.float() - yl.float()).abs().max() / yl.float().abs().max()).item())
                del lay
        del a13, bl13, a2, bl2
        sweep("mxfp4", MX_CFGS, MX_CFGS, (32, 256, 2, 4), (32, 256, 1, 4))
    del w13, w2, mx13, mx2
    torch.cuda.empty_cache()
# the tensor-core stages with MXFP4 weights (MoELoRALayer, packed) against the same layer dense, GPT-OSS-20B
from moelora_lib.layer import MoELoRALayer  # noqa: E402

if left() > 60:
    E, H, I, K = 32, 2880, 2880, 4
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    # quantize expert by expert (memory), then stack
    from moelora_lib.quant import quantize_mxfp4, dequantize_mxfp4  # noqa: E402
    bl, sc = zip(*[quantize_mxfp4(w13[e]) for e in range(E)])
    m13 = MXFP4Weight(torch.stack(bl), torch.stack(sc))
    bl, sc = zip(*[quantize_mxfp4(w2[e]) for e in range(E)])
    m2 = MXFP4Weight(torch.stack(bl), torch.stack(sc))
    del w13, w2
    d13 = torch.stack([dequantize_mxfp4(m13.blocks[e], m13.scales[e], torch.bfloat16) for e in range(E)])
    d2 = torch.stack([dequantize_mxfp4(m2.blocks[e], m2.scales[e], torch.bfloat16) for e in range(E)])
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.02).bfloat16()
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    for stage in ("tuned", "fused"):
        kw = dict(top_k=K, num_adapters=8, max_rank=32, max_tokens=2048, slices=1, b13=b13, b2=b2,
                  activation="swigluoai", stage=stage)
        lay_mx = MoELoRALayer(m13, m2, dtype=torch.bfloat16, **kw)
        lay_d = MoELoRALayer(d13, d2, **kw)
        for T in (1, 8, 64, 1600):
            if left() < 30:
                break
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            logits = torch.randn(T, E, device="cuda", generator=g)
            lids = torch.full((T,), -1, dtype=torch.int32, device="cuda")
            ymx = lay_mx(x, logits, lora_ids=lids)
            yd = lay_d(x, logits, lora_ids=lids)
            diff = ((ymx.float() - yd.float()).abs().max() / yd.float().abs().max()).item()
            tmx = bench.time_cuda(lambda: lay_mx(x, logits, lora_ids=lids), flush_l2=True)
            td = bench.time_cuda(lambda: lay_d(x, logits, lora_ids=lids), flush_l2=True)
            emit(what="tc_mxfp4_layer", stage=stage, T=T, us_mxfp4=tmx.ms_p50 * 1e3, us_dense=td.ms_p50 * 1e3,
                 rel_diff=diff)
print("probe done", time.time() - T0, flush=True)
