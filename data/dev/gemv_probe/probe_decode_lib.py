import torch
from moelora_lib.configs.schema import LayerConfig, OpConfig
from moelora_lib.kernels.gemv import gemv_moe_lora


def _cfg(gu, dn, sh):
    return LayerConfig(
        base_gate_up=OpConfig(BLOCK_SIZE_N=gu[0], BLOCK_SIZE_K=gu[1], SPLIT_K=gu[2], NUM_WARPS=gu[3]),
        base_down=OpConfig(BLOCK_SIZE_N=dn[0], BLOCK_SIZE_K=dn[1], SPLIT_K=dn[2], NUM_WARPS=dn[3]),
        gate_up_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
        down_shrink=OpConfig(BLOCK_SIZE_K=sh[0], SPLIT_K=sh[1], NUM_WARPS=sh[2]),
        gate_up_expand=OpConfig(), down_expand=OpConfig())


def decode_moe(x, w13, w2, b13, b2, tw, ids, act, cg, cd, *, scratch=None, out=None, mx13=None, mx2=None,
               lora=None, shrink_cfg=(128, 4, 4)):
    lk = {}
    if lora is not None:
        lids, a13, bl13, a2, bl2 = lora
        lk = dict(lora_ids=lids, lora=(lids, lids, a13, bl13, a2, bl2))
    return gemv_moe_lora(x, mx13 if mx13 is not None else w13, mx2 if mx2 is not None else w2, tw, ids,
                         activation=act, config=_cfg(cg, cd, shrink_cfg), b13=b13, b2=b2, scratch=scratch,
                         out=out, **lk)

