"""Compile facts of the MXFP4 tensor-core base GEMMs for sm_90, no GPU needed.

For the four launches (stage tuned's base_gate_up / base_down, stage fused's fused_gate_up / fused_down) on
packed GPT-OSS-20B weights with the default configs, per T: registers, spills (LOCAL), shared memory, and the
SASS of the main K loop (the innermost loop with an MMA and the most FMULs): its instruction count and its
memory instructions. Run from the repository root without the interpreter:

    env -u TRITON_INTERPRET python data/dev/gemv_probe/mx_compile_facts.py [T ...] [--dtype bfloat16]

Compare two commits by running it in a checkout of each.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from moelora_lib.kernels import STAGES  # noqa: E402
from moelora_lib.kernels.fused import fused_default_config  # noqa: E402
from moelora_lib.kernels.stages import LayerRun, default_config, mxfp4_config  # noqa: E402
from moelora_lib.quant.mxfp4 import MXFP4Weight  # noqa: E402
from moelora_lib.shapes import Dims, get_shape  # noqa: E402
from moelora_lib.studies import compile_check as cc  # noqa: E402

MEM = re.compile(r"(LDG|STS|LDS|LDSM|LDGSTS)\b")


def _sass(kernel) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.check_output([cc._nvidia_bin("cuobjdump"), "-sass", f.name], text=True)
    found = re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)
    return [(int(m.group(1), 16), m.group(2).strip()) for m in found]


def _opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split(" ")[0]


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The body of the innermost backward-branch region holding an MMA with the most FMULs."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, s) in enumerate(ins):
        m = re.search(r"BRA(?:\.U)?\s+(?:\S+\s+)?0x([0-9a-f]+)", s)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = [x for _, x in ins[index[int(m.group(1), 16)] : i + 1]]
            if any(re.search(r"\b(HMMA|HGMMA)", x) for x in body):
                loops.append(body)
    return max(loops, key=lambda b: (sum(_opcode(x).startswith("FMUL") for x in b), -len(b)))


def facts(T: int, dtype: torch.dtype) -> dict:
    d = Dims.of(get_shape("gpt-oss-20b"), T, rank=32, adapters=8)

    def meta(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device="meta")

    def packed(N, K):
        return MXFP4Weight(meta(d.E, N, K // 32, 16, dt=torch.uint8), meta(d.E, N, K // 32, dt=torch.uint8))

    topk_ids, lora_ids = cc._routing(T, d.E, d.top_k, d.adapters)
    t = cc._layer_tensors(d, meta, has_bias=True) | dict(w13=packed(2 * d.I, d.H), w2=packed(d.H, d.I))
    out = {}
    for stage, ops, cfg in (
        ("tuned", ("base_gate_up", "base_down"), default_config(d)),
        ("fused", ("fused_gate_up", "fused_down"), fused_default_config(d)),
    ):
        cfg = mxfp4_config(cfg)
        run = LayerRun(
            STAGES[stage], **t, topk_weights=meta(T, d.top_k, dt=torch.float32), topk_ids=topk_ids,
            lora_ids=lora_ids, activation="swigluoai", config=cfg,
        )  # fmt: skip
        for op in ops:
            k = cc._compile_launch(run.launch_args(op))
            ru = cc.resource_usage(k)
            body = main_loop(_sass(k))
            mem = collections.Counter(_opcode(x) for x in body if MEM.match(_opcode(x)))
            out[op] = dict(
                cfg=getattr(cfg, op.replace("fused_", "base_")).short(),
                REG=ru["REG"],
                LOCAL=ru["LOCAL"],
                SHARED=k.metadata.shared,
                loop_sass=len(body),
                loop_mem=dict(sorted(mem.items())),
            )
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("T", type=int, nargs="*", default=[1, 512, 4096])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args()
    for T in a.T:
        for op, v in facts(T, getattr(torch, a.dtype)).items():
            print(T, op, json.dumps(v), flush=True)
