"""moelora_lib.parallel on the CPU: two gloo processes against the one-process modules.

One launch of two ranks (``tests/parallel_cases.py``, the Triton interpreter, fp32, tiny shapes) runs every
case; this process computes the one-process references meanwhile and compares:

* expert parallelism (:class:`ExpertParallelMoELoRALayer`, experts 0-1 on rank 0, 2-3 on rank 1), stage
  ``tuned`` and ``fused``, mixed adapters (both projections, gate_up only, down only, none): bitwise equal
  to the one-process layer (top_k = 2 in fp32: the all-reduce adds the two ranks' shares in the order the
  one-process top-k sum adds the two pairs) — a token whose routes are all on the other rank, a batch in
  which rank 1 holds no expert any token routes to (its local ids all -1: no GEMM work), a global id out of
  range (a NaN row, the layer's contract, on every rank), routing from logits inside the layer, and the
  sharded-tokens form (all-gather + reduce-scatter);
* tensor parallelism: a column-parallel fused qkv (q/v-only and full adapters) bitwise equal to this rank's
  columns of the one-process output; a row-parallel o with bias (S-LoRA: intermediate all-reduced) within
  the fp32 tolerance of moelora_lib/testing.py (its sum is added in another order), with and without LoRA;
* models: Qwen3-MoE with tensor-parallel attention and expert-parallel MoE, dense Qwen3 (tensor-parallel
  MLP too) and GPT-OSS (sinks, attention biases) with adapters read from PEFT folders on every rank:
  prefill logits within the tolerance, the same on both ranks; the Generator's greedy tokens (Qwen3-MoE)
  equal to the one-process model's.

The single-process tests check the argument errors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moelora_lib.testing import assert_close_rel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIMEOUT_S = 900  # both ranks together; CI's two cores run other tests beside them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_columns(full: torch.Tensor, slices, rank: int, world: int) -> torch.Tensor:
    parts, o = [], 0
    for n in slices:
        k = n // world
        parts.append(full[:, o + rank * k : o + (rank + 1) * k])
        o += n
    return torch.cat(parts, 1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other has NaN."""
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan], b[~nan])


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo not available"
)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU test (Triton interpreter); a GPU host runs NCCL"
)
def test_two_gloo_ranks_match_one_process(tmp_path):
    sys.path.insert(0, str(HERE))
    import parallel_cases as pc

    adapters = tmp_path / "adapters"
    pc.write_adapters(adapters)
    port, world = _free_port(), 2
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "parallel_cases.py"),
                str(r),
                str(world),
                str(port),
                str(tmp_path),
                str(adapters),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        t0 = time.process_time()
        ref = pc.reference(str(adapters))  # while the ranks run
        ref_cpu = time.process_time() - t0
        deadline = time.monotonic() + TIMEOUT_S
        logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in ranks]
    except subprocess.TimeoutExpired:
        for p in ranks:
            p.kill()
        pytest.fail(f"the two gloo ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(ranks, logs)):
        if p.returncode != 0:
            tail = log.decode(errors="replace")[-4000:]
            pytest.fail(f"rank {r} exited with {p.returncode}:\n{tail}")
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    failures = []

    def check(ok: bool, what: str):
        if not ok:
            failures.append(what)

    for r, res in enumerate(out):
        for name in ("tuned/topk", "tuned/logits", "fused/topk"):  # expert parallelism, bitwise
            got, want = res[f"ep/{name}"], ref[f"ep/{name}"]
            check(
                _same(got, want),
                f"rank {r} ep/{name}: not bitwise equal ({(got - want).abs().nan_to_num().max():.3g})",
            )
        n = res["ep/sharded/topk"].shape[0]
        want = ref["ep/tuned/topk"][r * n : (r + 1) * n]
        check(_same(res["ep/sharded/topk"], want), f"rank {r} ep/sharded/topk: not bitwise equal")
        check(bool(torch.isnan(ref["ep/tuned/topk"][9]).all()), "reference: the bad id's row is not NaN")
        # the logits batch routes every token to rank 0's experts: rank 1's pairs are all remote (-1)
        local = res["ep/local_ids/logits"]
        check(
            bool((local == -1).all()) == (r == 1), f"rank {r}: local ids of the logits batch {local.tolist()}"
        )
        # base rows bitwise; adapter rows within tolerance (the shard's expand may pick a narrower
        # BLOCK_SIZE_N, and a dot of another shape may add in another order)
        want = _local_columns(ref["tp/qkv"], pc.QKV, r, world)
        base_rows = pc.LINEAR_IDS == -1
        check(
            torch.equal(res["tp/qkv"][base_rows], want[base_rows]),
            f"rank {r} tp/qkv: base rows not bitwise equal to its columns",
        )
        try:
            assert_close_rel(res["tp/qkv"], want, what=f"rank {r} tp/qkv")
        except AssertionError as e:
            failures.append(str(e))
        for name in (
            "tp/o",
            "tp/o_base_only",
            *[k for k in ref if k.startswith("model/") and "prefill" in k],
        ):
            try:
                assert_close_rel(res[name], ref[name], what=f"rank {r} {name}")
            except AssertionError as e:
                failures.append(str(e))
        check(
            torch.equal(res["model/qwen3_moe/tokens"], ref["model/qwen3_moe/tokens"]),
            f"rank {r}: generated tokens differ",
        )
    for name in [k for k in ref if k.startswith("model/")]:  # every rank computes the same logits / tokens
        check(torch.equal(out[0][name], out[1][name]), f"{name}: ranks 0 and 1 differ")
    cpu = ref_cpu + sum(res["cpu_s"] + res["import_cpu_s"] for res in out)
    assert not failures, "\n".join(failures) + f"\n(CPU time: {cpu:.0f} s)"


# --- single process: argument errors -----------------------------------------------------------------
def _expert_weights(E=4, H=32, I=16):
    return torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)


KW = dict(top_k=2, num_adapters=1, max_rank=2, max_tokens=4)


def test_gemv_expert_shards_sum_to_the_whole_layer():
    # stage gemv under an expert_map: each shard's pairs of experts held elsewhere do no work and add zero,
    # so the two shards' outputs sum to the one-layer output (fp32; only the order of the sums differs),
    # with an adapter on both projections; a token routed only to the other shard gets exact zeros
    from moelora_lib import MoELoRALayer
    from moelora_lib.parallel import contiguous_expert_map
    from moelora_lib.testing import assert_close_rel

    g = torch.Generator().manual_seed(7)
    E, H, I, R = 4, 32, 16, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    gu = (torch.randn(E, 2, R, H, generator=g) * 0.2, torch.randn(E, 2, I, R, generator=g) * 0.2)
    dn = (torch.randn(E, R, I, generator=g) * 0.2, torch.randn(E, H, R, generator=g) * 0.2)
    kw = dict(top_k=2, num_adapters=1, max_rank=R, max_tokens=4, stage="gemv")
    whole = MoELoRALayer(w13, w2, **kw)
    whole.load_adapter(0, gate_up=gu, down=dn)
    shards = []
    for rank in range(2):
        m = contiguous_expert_map(E, rank, 2)
        lay = MoELoRALayer(w13[2 * rank : 2 * rank + 2], w2[2 * rank : 2 * rank + 2], expert_map=m, **kw)
        lay.load_adapter(0, gate_up=gu, down=dn)
        assert lay.stage_for(3).name == "gemv"
        shards.append(lay)
    x = torch.randn(3, H, generator=g)
    tw = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]])
    ti = torch.tensor([[0, 3], [2, 1], [1, 0]], dtype=torch.int32)  # token 2: experts of rank 0 only
    ids = torch.tensor([0, -1, 0], dtype=torch.int32)
    want = whole(x, topk_weights=tw, topk_ids=ti, lora_ids=ids)
    parts = [lay(x, topk_weights=tw, topk_ids=ti, lora_ids=ids) for lay in shards]
    assert torch.isfinite(parts[1]).all() and torch.equal(parts[1][2], torch.zeros(H))
    assert_close_rel(parts[0] + parts[1], want.double(), torch.float32)


def test_expert_map_errors():
    from moelora_lib import MoELoRALayer
    from moelora_lib.parallel import ExpertParallelMoELoRALayer, contiguous_expert_map

    w13, w2 = _expert_weights(E=2)
    with pytest.raises(ValueError, match="world_size = 3 must divide num_experts = 4"):
        contiguous_expert_map(4, 0, 3)
    with pytest.raises(ValueError, match="rank must be an int in"):
        contiguous_expert_map(4, 2, 2)
    for bad, msg in (
        (torch.tensor([0.0, 1.0]), "expert_map must be a 1-D int32/int64"),
        (torch.tensor([0]), "fewer than the layer's E = 2"),
        (torch.tensor([0, 2, -1, -1]), r"expert_map values must be in \[-1, E=2\)"),
        (torch.tensor([0, 0, -1, -1]), r"local id\(s\) \[1\] missing and \[0\] repeated"),
    ):
        with pytest.raises(ValueError, match=msg):
            MoELoRALayer(w13, w2, expert_map=bad, **KW)
    m = contiguous_expert_map(4, 1, 2)
    with pytest.raises(ValueError, match=r"top_k = 5 must be <= E_global = 4"):
        MoELoRALayer(w13, w2, expert_map=m, **dict(KW, top_k=5))
    lay = MoELoRALayer(w13, w2, expert_map=m, **dict(KW, top_k=3))  # top_k may exceed the local E
    assert lay.num_global_experts == 4 and lay.local_to_global == [2, 3] and lay.stage_for(1).name != "gemv"
    with pytest.raises(ValueError, match=r"down A must have shape \[E, r, I\] = \(4, 'r', 16\)"):
        lay.load_adapter(0, down=(torch.zeros(2, 2, 16), torch.zeros(2, 32, 2)))  # local-shaped: refused
    with pytest.raises(ValueError, match=r"router_logits must be a float tensor \[T=1, E=4\]"):
        lay(torch.zeros(1, 32), torch.zeros(1, 2), lora_ids=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens must be one of"):
        ExpertParallelMoELoRALayer(w13, w2, tokens="all2all", **KW)
    with pytest.raises(ValueError, match="group must be a torch.distributed ProcessGroup"):
        ExpertParallelMoELoRALayer(w13, w2, group=[0, 1], **KW)


def test_expert_slots_keep_local_rows():
    from moelora_lib.parallel import ExpertParallelMoELoRALayer, contiguous_expert_map

    w13, w2 = _expert_weights(E=4)
    # one process (torch.distributed not initialized) holding experts 2-3 of 4 through an explicit map
    lay = ExpertParallelMoELoRALayer.from_full(w13, w2, expert_map=contiguous_expert_map(4, 1, 2), **KW)
    a = torch.arange(4.0).view(4, 1, 1).expand(4, 2, 16).contiguous()
    b = torch.ones(4, 32, 2)
    lay.load_adapter(0, down=(a, b))
    assert lay.E == 4 // 2 and lay.lora_a2[0, :, 0, 0].tolist() == [2.0, 3.0]
    assert lay.w13.shape[0] == 2 and lay.world_size == 1


def test_tensor_parallel_errors():
    from moelora_lib.parallel import ColumnParallelLoRALinear, RowParallelLoRALinear

    kw = dict(num_adapters=1, max_rank=2, max_tokens=4)
    with pytest.raises(ValueError, match="must be divisible by the tensor-parallel world size 2"):
        ColumnParallelLoRALinear.shard_weight(torch.zeros(5, 4), (3, 2), 0, 2)
    with pytest.raises(ValueError, match="t: H .* must be divisible"):
        RowParallelLoRALinear.shard_weight(torch.zeros(4, 5), 0, 2)
    with pytest.raises(ValueError, match="weight has 6 rows"):
        ColumnParallelLoRALinear(torch.zeros(6, 8), slices=(4, 4), **kw)
    with pytest.raises(ValueError, match="slices: a RowParallelLoRALinear has one output slice"):
        RowParallelLoRALinear(torch.zeros(8, 8), slices=(4, 4), **kw)
    col = ColumnParallelLoRALinear(torch.zeros(8, 8), slices=(4, 4), **kw)
    assert col.global_slices == (4, 4) and col.slices == (4, 4)  # one process: the whole layer
    with pytest.raises(ValueError, match=r"lora_b\[1\] must have shape \[N_s, r\] = \(4, r\)"):
        col.load_adapter(0, [torch.zeros(2, 8)] * 2, [torch.zeros(4, 2), torch.zeros(3, 2)])
    row = RowParallelLoRALinear(torch.zeros(8, 8), **kw)
    assert row.global_slices == (8,) and tuple(row.lora_b.shape) == (1, 8, 2)
    with pytest.raises(ValueError, match=r"lora_a\[0\] must have shape \[r, H\] = \(r, 8\)"):
        row.load_adapter(0, torch.zeros(2, 6), torch.zeros(8, 2))
    with pytest.raises(ValueError, match=r"lora_b\[0\] must have shape \[N, r\] = \(8, r\)"):
        row.load_adapter(0, torch.zeros(2, 8), torch.zeros(4, 2))


def test_model_group_errors():
    from moelora_lib.model import MultiLoRAModel

    sys.path.insert(0, str(HERE))
    import parallel_cases as pc

    sizes = dict(pc.MODEL_SIZES, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="tp_group must be a torch.distributed ProcessGroup"):
        MultiLoRAModel(pc.model_config("qwen3"), tp_group=2, **sizes)
    with pytest.raises(ValueError, match="ep_group: a qwen3 model has no experts"):
        MultiLoRAModel(pc.model_config("qwen3"), ep_group=object(), **sizes)
