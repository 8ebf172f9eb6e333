"""kernels/norm_rope.py against the torch modules they replace (moelora_lib.model.modeling.RMSNorm,
apply_rope and the cache's index-put writes), which tests/test_model_base.py checks against transformers.

CPU: the Triton interpreter, fp32 and fp16 (bf16 is wrong under the interpreter: environment.md). The
kernels repeat the torch ops' dtype roundings, so the results equal the torch path up to the fp32
summation order of the mean of squares: fp32 to 1e-6, fp16 to one rounding step.
"""

import pytest
import torch

from moelora_lib.kernels.norm_rope import qk_norm_rope_cache, rms_norm
from moelora_lib.model.modeling import RMSNorm, apply_rope

TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# bf16 only where the kernels compile for a GPU (the interpreter's bf16 is wrong: environment.md)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _dev(device):
    return torch.device(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [True, False])
@pytest.mark.parametrize("N", [64, 96])  # 96: not a power of 2 (masked tail)
def test_rms_norm_matches_module(device, dtype, weight_fp32, N):
    g = torch.Generator().manual_seed(N + weight_fp32)
    dev = _dev(device)
    T = 5
    x = (torch.randn(T, N, generator=g) * 3).to(dtype).to(dev)
    res = torch.randn(T, N, generator=g).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(torch.float32 if weight_fp32 else dtype).to(dev)
    mod = RMSNorm(w, 1e-5, weight_fp32)
    out = rms_norm(x, w, 1e-5, weight_fp32=weight_fp32)
    torch.testing.assert_close(out, mod(x), **TOL[dtype])
    s_ref = x + res
    out2, s = rms_norm(x, w, 1e-5, weight_fp32=weight_fp32, residual=res)
    assert torch.equal(s, s_ref)  # the add is torch's, bit for bit
    torch.testing.assert_close(out2, mod(s_ref), **TOL[dtype])
    # in place: the residual stream updated in x itself
    xc = x.clone()
    out3, s3 = rms_norm(xc, w, 1e-5, weight_fp32=weight_fp32, residual=res, residual_out=xc)
    assert s3.data_ptr() == xc.data_ptr() and torch.equal(xc, s_ref)
    torch.testing.assert_close(out3, out2, atol=0, rtol=0)


def test_rms_norm_bad_input(device):
    dev = _dev(device)
    x = torch.randn(3, 8, device=dev)
    w = torch.ones(8, device=dev)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=dev), 1e-6, weight_fp32=True)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x.half(), w, 1e-6, weight_fp32=False)  # fp32 weight for a non-fp32 norm
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, weight_fp32=True, residual=torch.randn(3, 9, device=dev))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, 0.0, weight_fp32=True)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x.t(), w, 1e-6, weight_fp32=True)
    # found by a new-user trial: crashes or silent results before
    for bad_w in ([1.0] * 8, None):
        with pytest.raises(ValueError, match="weight"):
            rms_norm(x, bad_w, 1e-6, weight_fp32=True)
    for bad_eps in ("1e-5", None, float("nan"), True):
        with pytest.raises(ValueError, match="eps"):
            rms_norm(x, w, bad_eps, weight_fp32=True)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, weight_fp32=True, residual=[0.0] * 8)
    with pytest.raises(ValueError, match="N >= 1"):
        rms_norm(x[:, :0], w[:0], 1e-6, weight_fp32=True)
    if dev.type == "cpu":
        with pytest.raises(ValueError, match="bfloat16 is not supported on the CPU"):
            rms_norm(x.bfloat16(), w.bfloat16(), 1e-6, weight_fp32=False)


def _torch_path(qkv, B, S, NH, NKV, D, cos_t, sin_t, pos, rows, kc, vc, qw, kw, eps):
    """What modeling.Attention.forward did before: split, view, q/k-norm, rope, index-put."""
    q, k, v = qkv.split((NH * D, NKV * D, NKV * D), dim=-1)
    q, k, v = q.reshape(B, S, NH, D), k.reshape(B, S, NKV, D), v.reshape(B, S, NKV, D)
    if qw is not None:
        q, k = RMSNorm(qw, eps, False)(q), RMSNorm(kw, eps, False)(k)
    p = pos.view(B, S)
    cos, sin = cos_t[p].view(B, S, 1, D // 2), sin_t[p].view(B, S, 1, D // 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    r = rows.view(B, S)
    kc[r, :, p] = k
    vc[r, :, p] = v
    return q.transpose(1, 2).contiguous()  # [B, NH, S, D]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("B,S,NH,NKV,D", [(1, 1, 4, 2, 16), (3, 1, 8, 1, 32), (2, 5, 4, 4, 12)])
def test_qk_norm_rope_cache_matches_torch(device, dtype, qk_norm, B, S, NH, NKV, D):
    g = torch.Generator().manual_seed(B * 100 + S * 10 + D)
    dev = _dev(device)
    T, MB, MS = B * S, 4, 16
    qkv = torch.randn(T, (NH + 2 * NKV) * D, generator=g).to(dtype).to(dev)
    ang = torch.arange(MS)[:, None] * (0.3 / (1 + torch.arange(D // 2)))[None]
    cos_t, sin_t = ang.cos().to(dtype).to(dev), ang.sin().to(dtype).to(dev)
    start = torch.randint(0, MS - S + 1, (B,), generator=g)
    pos = (start[:, None] + torch.arange(S)[None]).reshape(T).to(dev)
    rows = torch.randperm(MB, generator=g)[:B][:, None].expand(B, S).reshape(T).to(dev)
    qw = kw = None
    if qk_norm:
        qw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(dev)
        kw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(dev)
    kc0 = torch.randn(MB, NKV, MS, D, generator=g).to(dtype).to(dev)
    vc0 = torch.randn(MB, NKV, MS, D, generator=g).to(dtype).to(dev)
    kr, vr = kc0.clone(), vc0.clone()
    q_ref = _torch_path(qkv, B, S, NH, NKV, D, cos_t, sin_t, pos, rows, kr, vr, qw, kw, 1e-6)
    kc, vc = kc0.clone(), vc0.clone()
    q_out = torch.full((B, NH, S, D), float("nan"), dtype=dtype, device=dev)  # poisoned: all written
    q = qk_norm_rope_cache(
        qkv, num_heads=NH, num_kv_heads=NKV, head_dim=D, batch=B, cos=cos_t, sin=sin_t, positions=pos,
        cache_rows=rows, k_cache=kc, v_cache=vc, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6, q_out=q_out,
    )  # fmt: skip
    assert q.data_ptr() == q_out.data_ptr()
    tol = TOL[dtype] if qk_norm else dict(atol=0, rtol=0)  # without the norm: bit for bit
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kc, kr, **tol)
    assert torch.equal(vc, vr)  # v copied; every other cache entry untouched


def test_qk_norm_rope_cache_bad_input(device):
    dev = _dev(device)
    NH, NKV, D = 4, 2, 8
    qkv = torch.randn(2, (NH + 2 * NKV) * D, device=dev)
    tab = torch.randn(8, D // 2, device=dev)
    ix = torch.zeros(2, dtype=torch.int64, device=dev)
    kc = torch.zeros(2, NKV, 8, D, device=dev)
    kw = dict(
        num_heads=NH, num_kv_heads=NKV, head_dim=D, batch=1, cos=tab, sin=tab, positions=ix, cache_rows=ix,
        k_cache=kc, v_cache=kc.clone(),
    )  # fmt: skip
    qk_norm_rope_cache(qkv, **kw)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_cache(qkv[:, :-1], **kw)
    with pytest.raises(ValueError, match="num_kv_heads"):
        qk_norm_rope_cache(qkv, **{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_cache(qkv, **{**kw, "positions": ix[:1]})
    with pytest.raises(ValueError, match="k_cache"):
        qk_norm_rope_cache(qkv, **{**kw, "k_cache": torch.zeros(2, NKV, 8, D + 2, device=dev)})
    with pytest.raises(ValueError, match="both or neither"):
        qk_norm_rope_cache(qkv, **kw, q_norm_weight=torch.ones(D, device=dev))
    with pytest.raises(ValueError, match="batch"):
        qk_norm_rope_cache(qkv, **{**kw, "batch": 3})
    # found by a new-user trial: silent truncation, NaN, crashes or a misleading message before
    for key, val, match in [
        ("num_heads", 4.7, "num_heads must be an int"),
        ("head_dim", 3.5, "head_dim must be an int"),
        ("head_dim", 7, "head_dim must be even"),
        ("batch", 2.0, "batch must be an int"),
        ("eps", 0.0, "eps must be a number > 0"),
        ("eps", "x", "eps must be a number > 0"),
        ("cos", [0.0], "cos must be"),
        ("v_cache", torch.zeros(1, NKV, 8, D, device=dev), "v_cache must have k_cache's shape"),
        ("positions", torch.tensor([0, 100], device=dev), "positions must be in"),
        ("cache_rows", torch.tensor([0, 7], device=dev), "cache_rows must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            qk_norm_rope_cache(qkv, **{**kw, key: val})
    with pytest.raises(ValueError, match="qkv must be float16/bfloat16/float32"):
        qk_norm_rope_cache(qkv.double(), **kw)
    with pytest.raises(ValueError, match="positions must be in"):  # a rope table shorter than the positions
        qk_norm_rope_cache(qkv, **{**kw, "cos": tab[:1], "sin": tab[:1], "positions": ix + 3})


def test_qk_norm_rope_cache_expanded_index_views(device):
    """cache_rows as an expanded view (stride 0, as rows[:, None].expand(B, S).reshape(B·S) gives at B = 1):
    every token is written to the right row."""
    dev = _dev(device)
    NH, NKV, D, S = 2, 1, 8, 5
    qkv = torch.randn(S, (NH + 2 * NKV) * D, device=dev)
    tab = torch.randn(8, D // 2, device=dev)
    rows = torch.tensor([2], device=dev)[:, None].expand(1, S).reshape(S)
    assert rows.stride() == (0,)
    kc, vc = torch.zeros(3, NKV, 8, D, device=dev), torch.zeros(3, NKV, 8, D, device=dev)
    pos = torch.arange(S, device=dev)
    qk_norm_rope_cache(
        qkv, num_heads=NH, num_kv_heads=NKV, head_dim=D, batch=1, cos=tab, sin=tab, positions=pos,
        cache_rows=rows, k_cache=kc, v_cache=vc,
    )  # fmt: skip
    assert torch.equal(vc[2, 0, :S], qkv[:, (NH + NKV) * D :]) and not vc[:2].any() and not vc[2, :, S:].any()
