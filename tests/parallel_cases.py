"""The cases of tests/test_parallel.py, shared by its parent process (the one-process references) and the
ranks it spawns (``python tests/parallel_cases.py RANK WORLD PORT OUTDIR``, gloo on the CPU).

Every input is built from fixed seeds here, so both sides build the same weights, adapters and batches.
A rank runs :func:`run_rank`: every case once, its outputs saved to ``OUTDIR/rank{RANK}.pt`` (a dict
case name -> tensors); the parent compares them with the one-process modules (:func:`reference`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

# layer cases: E experts over 2 ranks (rank 0: experts 0-1, rank 1: 2-3), K = 2, fp32
E, H, I, K, L, R = 4, 32, 16, 2, 3, 4
DT = torch.float32


def _rnd(g, *shape, scale=0.2):
    return (torch.randn(*shape, generator=g) * scale).to(DT)


def layer_weights() -> dict:
    g = torch.Generator().manual_seed(33)
    return dict(w13=_rnd(g, E, 2 * I, H), w2=_rnd(g, E, H, I), b13=_rnd(g, E, 2 * I), b2=_rnd(g, E, H))


def layer_adapters() -> dict:
    """slot -> load_adapter kwargs (whole adapters, [E, ...]): slot 0 both projections, 1 gate_up only,
    2 down only."""
    g = torch.Generator().manual_seed(34)
    gu = lambda r: (_rnd(g, E, 2, r, H), _rnd(g, E, 2, I, r))  # noqa: E731
    dn = lambda r: (_rnd(g, E, r, I), _rnd(g, E, H, r))  # noqa: E731
    return {0: dict(gate_up=gu(4), down=dn(4), scaling=0.5), 1: dict(gate_up=gu(2)), 2: dict(down=dn(3))}


def layer_batches() -> dict:
    """name -> forward kwargs (hidden_states + routing + lora_ids), global expert ids."""
    g = torch.Generator().manual_seed(35)
    i32 = dict(dtype=torch.int32)
    out = {}
    # routes: rank 0 only, rank 1 only, mixed; every adapter pattern; a token whose routes are all remote
    # for rank 0 (row 1) and one all remote for rank 1 (row 0); row 9 has a global id out of range (E):
    # its row is NaN (the contract), the others are exact
    ids = [[0, 1], [2, 3], [0, 2], [3, 1], [1, 0], [3, 2], [2, 0], [1, 3], [0, 3], [E, 1]]
    out["topk"] = dict(
        hidden_states=_rnd(g, 10, H, scale=1.0),
        topk_weights=torch.rand(10, K, generator=g),
        topk_ids=torch.tensor(ids, **i32),
        lora_ids=torch.tensor([0, 1, 2, -1, 0, 1, 2, -1, 1, 0], **i32),
    )
    # routed by the layer from logits that favour experts 0 and 1: every token goes to rank 0's experts,
    # rank 1 holds no expert any token routes to (it computes nothing and adds zeros)
    logits = torch.randn(6, E, generator=g)
    logits[:, :2] += 6.0
    out["logits"] = dict(
        hidden_states=_rnd(g, 6, H, scale=1.0),
        router_logits=logits,
        lora_ids=torch.tensor([2, 0, -1, 1, 0, 2], **i32),
    )
    return out


LAYER_KW = dict(top_k=K, num_adapters=L, max_rank=R, max_tokens=16, deterministic=True)

# tensor-parallel projections: a fused qkv (column) and o (row, with bias)
QKV = (32, 16, 16)


def linear_weights() -> dict:
    g = torch.Generator().manual_seed(36)
    return dict(
        qkv_w=_rnd(g, sum(QKV), H),
        qkv_b=_rnd(g, sum(QKV)),
        o_w=_rnd(g, H, 32),
        o_b=_rnd(g, H),
        x=_rnd(g, 6, H, scale=1.0),
    )


def linear_adapters() -> dict:
    """module -> slot -> (lora_a list, lora_b list, scaling): qkv slot 0 q and v only, slot 1 all; o
    slot 0."""
    g = torch.Generator().manual_seed(37)

    def pair(r, n_in, n_out):
        return _rnd(g, r, n_in), _rnd(g, n_out, r)

    q, v = pair(4, H, 32), pair(4, H, 16)
    a = [pair(2, H, n) for n in QKV]
    o = pair(4, 32, H)
    return {
        "qkv": {
            0: ([q[0], None, v[0]], [q[1], None, v[1]], 0.5),
            1: ([p[0] for p in a], [p[1] for p in a], 1.0),
        },
        "o": {0: ([o[0]], [o[1]], 2.0)},
    }


LINEAR_IDS = torch.tensor([0, 1, -1, 0, 1, -1], dtype=torch.int32)
LINEAR_KW = dict(num_adapters=2, max_rank=4, max_tokens=8, deterministic=True)


# tiny models: a Qwen3-MoE (tensor-parallel attention + expert-parallel MoE), a dense Qwen3 (tensor-parallel
# attention and MLP), a GPT-OSS (sinks, attention biases, one fused gate_up slice, swigluoai)
MODEL_KINDS = ("qwen3_moe", "qwen3", "gpt_oss")
MODEL_SIZES = dict(num_adapters=2, max_rank=4, max_batch=3, max_seq=12, max_tokens=12, stage="tuned")
PROMPTS = ([5, 9, 2, 33], [11, 3, 60, 8], [1, 2, 3, 4])  # one prefill call, then decode steps
GEN_ADAPTERS = (0, None, 1)
NEW_TOKENS = 2


def model_config(kind: str):
    from moelora_lib.model import ModelConfig

    d = dict(
        model_type=kind, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=10000.0,
    )  # fmt: skip
    if kind == "qwen3_moe":
        d.update(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True)
        d.update(intermediate_size=64)
    elif kind == "gpt_oss":
        d.update(num_local_experts=E, num_experts_per_tok=K, intermediate_size=I, sliding_window=3)
        d.update(layer_types=["sliding_attention"])
    else:
        d.update(intermediate_size=32)
    return ModelConfig.from_hf(d)


def model_weights(kind: str):
    from moelora_lib.model import random_weights

    return random_weights(seed=len(kind), std=0.3)


def write_adapters(folder: Path) -> None:
    """PEFT adapter folders ``{kind}_{0,1}`` (adapter_config.json + adapter_model.safetensors): slot 0 q, v
    (and per-expert gate/up/down, or the dense gate/up/down); slot 1 k, o (and the experts' down)."""
    from safetensors.torch import save_file

    cls = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
    for kind in MODEL_KINDS:
        c = model_config(kind)
        q, kv = c.q_width, c.kv_width
        dims = {"q": (32, q), "k": (32, kv), "v": (32, kv), "o": (q, 32)}
        if kind == "qwen3":
            Id = c.intermediate_size
            dims.update(gate=(32, Id), up=(32, Id), down=(Id, 32))
        for slot, names in ((0, ("q", "v", "gate", "up", "down")), (1, ("k", "o", "down"))):
            g = torch.Generator().manual_seed(100 + slot + len(kind))
            t, r = {}, 4 - 2 * slot
            pre = "base_model.model.model.layers.0."
            for n in names:
                mods = []
                if n in "qkvo":
                    mods = [(f"self_attn.{n}_proj", dims[n])]
                elif kind == "qwen3":
                    mods = [(f"mlp.{n}_proj", dims[n])]
                elif kind == "qwen3_moe":
                    io = (I, 32) if n == "down" else (32, I)
                    mods = [(f"mlp.experts.{e}.{n}_proj", io) for e in range(E)]
                for m, (d_in, d_out) in mods:
                    t[f"{pre}{m}.lora_A.weight"] = torch.randn(r, d_in, generator=g) * 0.3
                    t[f"{pre}{m}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.3
            out = folder / f"{kind}_{slot}"
            out.mkdir(parents=True, exist_ok=True)
            save_file(t, str(out / "adapter_model.safetensors"))
            cfg = dict(peft_type="LORA", r=r, lora_alpha=2 * r, auto_mapping={"base_model_class": cls[kind]})
            (out / "adapter_config.json").write_text(json.dumps(cfg))


def _model_outputs(kind: str, folder: Path, **parallel) -> dict:
    """Prefill logits of a mixed batch (slots 0, 1, none) and greedy Generator tokens of one model."""
    from moelora_lib.model import Generator, MultiLoRAModel, load_peft_adapter

    m = MultiLoRAModel(
        model_config(kind), dtype=DT, device="cpu", weights=model_weights(kind), **MODEL_SIZES, **parallel
    )
    for slot in (0, 1):
        load_peft_adapter(m, slot, folder / f"{kind}_{slot}")
    ids = torch.tensor([p[:3] for p in PROMPTS])
    res = {f"model/{kind}/prefill": m(ids, [0, 0, 0], [0, 1, -1])}
    if kind == "qwen3_moe":  # the Generator (prefill + decode steps), every rank running the same calls
        gen = Generator(m)
        out = gen.generate(list(PROMPTS), list(GEN_ADAPTERS), NEW_TOKENS)
        res[f"model/{kind}/tokens"] = torch.tensor(out.tokens)
    return res


# ------------------------------------------------------------------------------------------------------
def _layer_outputs(make, rank: int, world: int) -> dict:
    """The outputs of the layer cases for a layer factory ``make(stage, tokens)`` (``tokens`` None: the
    one-process reference, whose sharded-form output is the "tuned/topk" one's rows)."""
    res = {}
    batches = layer_batches()
    for stage in ("tuned", "fused"):
        layer = make(stage, "replicated")
        for slot, kw in layer_adapters().items():
            layer.load_adapter(slot, **kw)
        for name, b in batches.items():
            if stage == "fused" and name != "topk":
                continue
            res[f"{stage}/{name}"] = layer(**b)
    if world == 1:
        return res
    # the sharded-tokens form: rank r passes rows [r·T/world, (r+1)·T/world) of the batch
    layer = make("tuned", "sharded")
    for slot, kw in layer_adapters().items():
        layer.load_adapter(slot, **kw)
    for name in ("topk",):
        b = batches[name]
        n = b["hidden_states"].shape[0] // world
        part = {k: v[rank * n : (rank + 1) * n] for k, v in b.items()}
        res[f"sharded/{name}"] = layer(**part)
    return res


def run_rank(rank: int, world: int, port: int, outdir: str, adapters: str) -> None:
    import torch.distributed as dist

    from moelora_lib.parallel import (
        ColumnParallelLoRALinear,
        ExpertParallelMoELoRALayer,
        RowParallelLoRALinear,
    )

    t_init = time.time()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    t0 = time.process_time()
    res_t = {"init_wall_s": time.time() - t_init, "import_cpu_s": t0}
    res: dict = {}
    w = layer_weights()

    def make(stage, tokens):
        return ExpertParallelMoELoRALayer.from_full(
            w["w13"], w["w2"], b13=w["b13"], b2=w["b2"], group=group, tokens=tokens, stage=stage, **LAYER_KW
        )

    res.update({f"ep/{k}": v for k, v in _layer_outputs(make, rank, world).items()})
    # the local ids of the logits batch (rank 1: every pair remote, -1: no GEMM work)
    from moelora_lib.routing import route

    lay = make("tuned", "replicated")
    res["ep/local_ids/logits"] = lay._local_ids(route(layer_batches()["logits"]["router_logits"], K)[1])
    # tensor parallelism
    lw, la = linear_weights(), linear_adapters()
    col = ColumnParallelLoRALinear(
        ColumnParallelLoRALinear.shard_weight(lw["qkv_w"], QKV, rank, world),
        ColumnParallelLoRALinear.shard_weight(lw["qkv_b"], QKV, rank, world),
        slices=QKV,
        group=group,
        **LINEAR_KW,
    )
    row = RowParallelLoRALinear(
        RowParallelLoRALinear.shard_weight(lw["o_w"], rank, world), lw["o_b"], group=group, **LINEAR_KW
    )
    for mod, name in ((col, "qkv"), (row, "o")):
        for slot, (a, b, s) in la[name].items():
            mod.load_adapter(slot, a, b, s)
    x = lw["x"]
    res["tp/qkv"] = col(x, LINEAR_IDS)
    xo = RowParallelLoRALinear.shard_weight(x, rank, world)  # this rank's input columns
    res["tp/o"] = row(xo, LINEAR_IDS)
    with row_restricted(row, {1}):  # slot 1 holds nothing in o: the base path, no LoRA launch
        res["tp/o_base_only"] = row(xo, LINEAR_IDS.clamp(max=-1))
    for kind in MODEL_KINDS:  # tensor parallelism of attention (and MLP), expert parallelism of the MoE
        ep = {"ep_group": group} if kind != "qwen3" else {}
        res.update(_model_outputs(kind, Path(adapters), tp_group=group, **ep))
    res["cpu_s"] = time.process_time() - t0
    res.update(res_t)
    torch.save(res, Path(outdir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


class row_restricted:
    """``module.active_slots = slots`` for the body of the ``with``."""

    def __init__(self, module, slots):
        self.m, self.slots = module, slots

    def __enter__(self):
        self.prev, self.m.active_slots = self.m.active_slots, self.slots

    def __exit__(self, *exc):
        self.m.active_slots = self.prev


# ------------------------------------------------------------------------------------------------------
def reference(adapters: str) -> dict:
    """The one-process outputs of every case (same keys as a rank's, before any slicing)."""
    from moelora_lib import LoRALinear, MoELoRALayer

    res: dict = {}
    w = layer_weights()

    def make(stage, tokens):
        return MoELoRALayer(w["w13"], w["w2"], b13=w["b13"], b2=w["b2"], stage=stage, **LAYER_KW)

    res.update({f"ep/{k}": v for k, v in _layer_outputs(make, 0, 1).items()})
    lw, la = linear_weights(), linear_adapters()
    col = LoRALinear(lw["qkv_w"], lw["qkv_b"], slices=QKV, **LINEAR_KW)
    row = LoRALinear(lw["o_w"], lw["o_b"], **LINEAR_KW)
    for mod, name in ((col, "qkv"), (row, "o")):
        for slot, (a, b, s) in la[name].items():
            mod.load_adapter(slot, a, b, s)
    res["tp/qkv"] = col(lw["x"], LINEAR_IDS)
    res["tp/o"] = row(lw["x"], LINEAR_IDS)
    res["tp/o_base_only"] = row(lw["x"], LINEAR_IDS.clamp(max=-1))
    for kind in MODEL_KINDS:
        res.update(_model_outputs(kind, Path(adapters)))
    return res


if __name__ == "__main__":
    import conftest  # noqa: F401  (the test session's interpreter set-up, in this rank's process too)

    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    print(json.dumps({"rank": int(sys.argv[1]), "ok": True}), file=sys.stderr)
    os._exit(0)
