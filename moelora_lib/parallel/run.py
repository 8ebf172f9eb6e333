"""Generate with a :class:`~moelora_lib.model.MultiLoRAModel` split over the processes that ``torchrun``
starts: tensor-parallel attention (and dense MLP) and expert-parallel MoE over the whole world.

Usage (docs/parallel.md)::

    torchrun --nproc-per-node 2 -m moelora_lib.parallel.run --checkpoint /models/qwen3-30b-a3b \\
        --adapters /adapters/a /adapters/b --requests 0,1,-1 --prompt-len 128 --max-new-tokens 64

Every rank builds its shard of the model (a checkpoint, or random weights of a named or given config),
loads every adapter folder into slots 0, 1, ... (each rank keeping its shard), and runs the same
:class:`~moelora_lib.model.Generator` call on the same requests; the collectives inside the forward pair
up because every rank makes the same calls. Rank 0 prints one JSON line: the tokens of each request, the
timings of :class:`~moelora_lib.model.GenerationResult`, and whether every rank generated the same tokens.

Backend and device: NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on the CPU through the
Triton interpreter (TRITON_INTERPRET=1 is set for this process before the first kernel is built when no
CUDA device exists; use a tiny config there). Prompts are random token ids (``--seed``): the point is the
serving path, not the text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m moelora_lib.parallel.run", description=__doc__.split("\n\n")[0]
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a Hugging Face folder (config.json + safetensors)")
    src.add_argument("--config", help="random weights: a REAL_CONFIGS name or a config.json path")
    p.add_argument(
        "--adapters", nargs="*", default=[], help="PEFT adapter folders, loaded into slots 0, 1, ..."
    )
    p.add_argument("--requests", default="-1", help="comma-separated slot per request (-1 = base model)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--max-seq", type=int, default=None, help="default: prompt-len + max-new-tokens")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) / float16 / float32 (CPU default)")
    p.add_argument(
        "--no-tp", action="store_true", help="replicate attention and dense MLP (no tensor parallelism)"
    )
    p.add_argument("--no-ep", action="store_true", help="replicate the experts (no expert parallelism)")
    p.add_argument("--seed", type=int, default=0, help="prompts, random weights and sampling")
    p.add_argument("--temperature", type=float, default=0.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel module is imported
    import torch.distributed as dist

    from ..model import Generator, ModelConfig, load_hf_checkpoint, load_peft_adapter, random_model
    from ..model.config import REAL_CONFIGS

    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    slots = [int(s) for s in args.requests.split(",")]
    B = len(slots)
    max_seq = args.max_seq or args.prompt_len + args.max_new_tokens
    sizes = dict(
        dtype=dtype, device=device, num_adapters=max(1, len(args.adapters)), max_rank=args.max_rank,
        max_batch=B, max_seq=max_seq, max_tokens=max(B * args.prompt_len, B),
    )  # fmt: skip
    group = dist.group.WORLD
    if args.checkpoint or args.config not in REAL_CONFIGS:
        with open(os.path.join(args.checkpoint, "config.json") if args.checkpoint else args.config) as f:
            raw = json.load(f)
    else:
        raw = REAL_CONFIGS[args.config]
    is_moe = ModelConfig.from_hf(raw).is_moe
    parallel = dict(
        tp_group=None if args.no_tp else group, ep_group=None if (args.no_ep or not is_moe) else group
    )
    if args.checkpoint:
        model = load_hf_checkpoint(args.checkpoint, **sizes, **parallel)
    else:
        model = random_model(raw, seed=args.seed, **sizes, **parallel)
    for slot, folder in enumerate(args.adapters):
        load_peft_adapter(model, slot, folder)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (B, args.prompt_len), generator=g).tolist()
    gen = Generator(model)
    res = gen.generate(
        prompts, [None if s < 0 else s for s in slots], args.max_new_tokens, temperature=args.temperature,
        seed=args.seed,
    )  # fmt: skip
    rows = [t + [-1] * (args.max_new_tokens - len(t)) for t in res.tokens]
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    same = all(torch.equal(every[0], t) for t in every)
    if rank == 0:
        out = dict(world=world, tp=not args.no_tp, ep=parallel["ep_group"] is not None, tokens=res.tokens)
        out.update(same_tokens_on_every_rank=same, summary=res.summary())
        print(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
