"""fp32 PyTorch reference of the MoE + multi-LoRA layer: the oracle every kernel is checked against.

Written for clarity, not speed: every term of the math contract below is computed in float32 with
plain indexing and matmuls, and a token with ``lora_ids[t] == -1`` never indexes the adapter tensors.

For token t with adapter a = lora_ids[t] and each routed expert e = topk_ids[t, k] with weight
w = topk_weights[t, k]:

    h   = x·W13[e]ᵀ (+ b13[e]) + [a ≥ 0]·concat_s((x·A13[a,e,s]ᵀ)·B13[a,e,s]ᵀ)   # delta before act
    g   = act(h)                         # silu(gate)·up, or GPT-OSS swigluoai
    y   = g·W2[e]ᵀ (+ b2[e]) + [a ≥ 0]·(g·A2[a,e]ᵀ)·B2[a,e]ᵀ
    out = Σ_k w·y                        # routing weight applied exactly once

Slice s of the gate_up LoRA covers output columns [s·2I/S, (s+1)·2I/S) of h, in w13's row order
(S = 2: gate then up; S = 1: all 2I rows, interleaved for GPT-OSS). LoRA scaling alpha/r is folded
into B when an adapter is loaded, so there is no scale argument. Follows vLLM's FusedMoEWithLoRA
semantics (vllm/lora/layers/fused_moe.py): the gate_up delta is added before the activation, the
down delta before the routing-weight sum.
"""

from __future__ import annotations

import torch

__all__ = ["route_reference", "activation_reference", "moe_lora_reference", "moe_lora_loop_reference"]

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """Softmax top-k routing in fp32.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: K.
        renormalize: divide the K kept probabilities by their sum.
    Returns:
        (topk_weights [T, K] float32, topk_ids [T, K] int32)
    """
    logits = router_logits.float()
    top_logits, ids = torch.topk(logits, top_k, dim=-1)
    if renormalize:
        # softmax over all E then renormalizing the kept K equals a softmax over the K kept logits
        weights = torch.softmax(top_logits, dim=-1)
    else:
        weights = torch.exp(top_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    return weights, ids.to(torch.int32)


def activation_reference(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated activation of the gate_up output, in fp32.

    Args:
        h: [..., 2I] pre-activation.
        activation: ``"silu"``: gate = h[..., :I], up = h[..., I:], out = silu(gate)·up.
            ``"swigluoai"`` (GPT-OSS): gate = h[..., 0::2], up = h[..., 1::2] (interleaved rows),
            gate clamped to ≤ 7, up to [-7, 7], out = (up + 1)·gate·sigmoid(1.702·gate).
    Returns:
        [..., I] float32 (float64 if h is float64).
    """
    h = h if h.dtype == torch.float64 else h.float()
    if activation == "silu":
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if activation == "swigluoai":
        gate, up = h[..., 0::2], h[..., 1::2]
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return (up + 1.0) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)
    raise ValueError(f"activation must be 'silu' or 'swigluoai', got {activation!r}")


def _lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """(x·Aᵀ)·Bᵀ in fp32: x [P, in], lora_a [R, in], lora_b [out, R] -> [P, out]."""
    return (x @ lora_a.T) @ lora_b.T


def moe_lora_reference(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora_ids,
    lora_a13,
    lora_b13,
    lora_a2,
    lora_b2,
    *,
    activation="silu",
    b13=None,
    b2=None,
) -> torch.Tensor:
    """The MoE + multi-LoRA layer in fp32, one expert and one (adapter, expert) group at a time.

    Shapes as in :func:`moelora_lib.fused_moe_lora`: hidden_states [T, H]; w13 [E, 2I, H];
    w2 [E, H, I]; topk_weights [T, K]; topk_ids [T, K]; lora_ids [T] (-1 = no adapter);
    lora_a13 [L, E, S, R, H]; lora_b13 [L, E, S, 2I/S, R]; lora_a2 [L, E, R, I]; lora_b2 [L, E, H, R];
    b13 [E, 2I] or None; b2 [E, H] or None. Any of them may be passed as None for the LoRA tensors
    when L = 0 is intended (then only the base MoE is computed).

    Returns:
        [T, H] float32.
    """
    T, H = hidden_states.shape
    K = topk_ids.shape[1]
    E = w13.shape[0]
    x = hidden_states.float()
    pair_token = torch.arange(T, device=x.device).repeat_interleave(K)  # [T*K]
    pair_expert = topk_ids.long().reshape(-1)
    pair_adapter = lora_ids.long()[pair_token]
    xp = x[pair_token]  # [P, H]
    P = xp.shape[0]
    h = torch.empty(P, w13.shape[1], dtype=torch.float32, device=x.device)
    # one expert (and one (adapter, expert) pair) at a time: memory stays O(P·(H + I))
    for e in range(E):
        rows = (pair_expert == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        h[rows] = xp[rows] @ w13[e].float().T
        if b13 is not None:
            h[rows] += b13[e].float()
        for a in pair_adapter[rows].unique().tolist() if lora_a13 is not None else []:
            if a < 0:
                continue  # no adapter: never index the adapter tensors with -1
            r = rows[pair_adapter[rows] == a]
            S = lora_a13.shape[2]
            h[r] += torch.cat(
                [_lora_delta(xp[r], lora_a13[a, e, s].float(), lora_b13[a, e, s].float()) for s in range(S)],
                dim=-1,
            )
    g = activation_reference(h, activation)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        rows = (pair_expert == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        y[rows] = g[rows] @ w2[e].float().T
        if b2 is not None:
            y[rows] += b2[e].float()
        for a in pair_adapter[rows].unique().tolist() if lora_a2 is not None else []:
            if a < 0:
                continue
            r = rows[pair_adapter[rows] == a]
            y[r] += _lora_delta(g[r], lora_a2[a, e].float(), lora_b2[a, e].float())
    y = y * topk_weights.float().reshape(-1, 1)
    return y.view(T, K, H).sum(dim=1)


def moe_lora_loop_reference(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora_ids,
    lora_a13,
    lora_b13,
    lora_a2,
    lora_b2,
    *,
    activation="silu",
    b13=None,
    b2=None,
) -> torch.Tensor:
    """Independent per-token, per-expert loop in float64: the check of :func:`moe_lora_reference`.

    Same arguments; slow; only for small shapes. Returns [T, H] float32.
    """
    T, H = hidden_states.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    d = torch.float64
    for t in range(T):
        x = hidden_states[t].to(d).cpu()
        a = int(lora_ids[t])
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            w = float(topk_weights[t, k])
            h = w13[e].to(d).cpu() @ x
            if b13 is not None:
                h = h + b13[e].to(d).cpu()
            if a >= 0:
                S = lora_a13.shape[2]
                n = h.shape[0] // S
                for s in range(S):
                    r = lora_a13[a, e, s].to(d).cpu() @ x
                    h[s * n : (s + 1) * n] += lora_b13[a, e, s].to(d).cpu() @ r
            g = activation_reference(h.unsqueeze(0), activation).squeeze(0).to(d)
            y = w2[e].to(d).cpu() @ g
            if b2 is not None:
                y = y + b2[e].to(d).cpu()
            if a >= 0:
                y = y + lora_b2[a, e].to(d).cpu() @ (lora_a2[a, e].to(d).cpu() @ g)
            out[t] += w * y
    return out.float()
