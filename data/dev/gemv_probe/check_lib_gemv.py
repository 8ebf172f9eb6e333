import torch, itertools
from moelora_lib.kernels.gemv import gemv_moe_lora
from moelora_lib.configs.schema import LayerConfig, OpConfig
from moelora_lib.reference import moe_lora_reference
from moelora_lib.quant import MXFP4Weight
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
def cfg(gu, dn, sh):
    return LayerConfig(gate_up_expand=OpConfig(), down_expand=OpConfig(), base_gate_up=OpConfig(BLOCK_SIZE_N=gu[0], BLOCK_SIZE_K=gu[1], SPLIT_K=gu[2], NUM_WARPS=gu[3]),
        base_down=OpConfig(BLOCK_SIZE_N=dn[0], BLOCK_SIZE_K=dn[1], SPLIT_K=dn[2], NUM_WARPS=dn[3]),
        gate_up_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
        down_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]))
for (E, H, I, K, T, act, bias, S, L, mx) in [(4, 96, 64, 2, 5, "swigluoai", True, 1, 3, False), (4, 64, 96, 2, 4, "silu", False, 2, 2, False),
                                             (4, 96, 64, 2, 5, "swigluoai", True, 1, 3, True)]:
    R = 16
    x = torch.randn(T, H, device=dev).to(dt)
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5)
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5)
    if mx:
        m13, m2 = MXFP4Weight.quantize(w13), MXFP4Weight.quantize(w2)
        w13, w2 = m13.dequantize(torch.float32), m2.dequantize(torch.float32)
    w13, w2 = w13.to(dt), w2.to(dt)
    b13 = torch.randn(E, 2 * I, device=dev).to(dt) if bias else None
    b2 = torch.randn(E, H, device=dev).to(dt) if bias else None
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
    ids[1, 0] = E + 3  # a bad expert id: NaN row for token 1
    tw = torch.rand(T, K, device=dev)
    a13 = (torch.randn(L, E, S, R, H, device=dev) / H**0.5).to(dt)
    bl13 = (torch.randn(L, E, S, 2 * I // S, R, device=dev) * 0.3).to(dt)
    a2 = (torch.randn(L, E, R, I, device=dev) / I**0.5).to(dt)
    bl2 = (torch.randn(L, E, H, R, device=dev) * 0.3).to(dt)
    lids = torch.tensor([i % (L + 1) - 1 for i in range(T)], dtype=torch.int32, device=dev)
    ids_ok = ids.clone(); ids_ok[1, 0] = (ids[1, 1] + 1) % E
    r = moe_lora_reference(x, w13, w2, tw, ids_ok, lids, a13, bl13, a2, bl2, activation=act, b13=b13, b2=b2)
    for c in [cfg((32, 32, 1, 4), (32, 32, 1, 4), (32, 1, 4)), cfg((16, 64, 2, 4), (64, 32, 2, 2), (64, 2, 2))]:
        y = gemv_moe_lora(x, m13 if mx else w13, m2 if mx else w2, tw, ids, activation=act, config=c, b13=b13, b2=b2,
                          lora_ids=lids, lora=(lids, lids, a13, bl13, a2, bl2))
        assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2, 3]]).any()
        err = (y.float() - r)[[0, 2, 3]].abs().max().item()
        print(act, S, mx, "maxerr", err, r.abs().max().item())
        assert err < 2e-2 * max(1, r.abs().max().item())
print("lib ok")
