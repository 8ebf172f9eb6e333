"""Development probe (not suite evidence): stage ``fused``'s LoRA epilogue, per-adapter loop vs stacked.

    python3 scripts/dev_lora_stack.py --out OUT_DIR [--models gpt-oss-20b,qwen3-30b-a3b]
        [--tokens 1,8,64,256,1600,8192]

For each (model, T): the whole layer of stage ``fused`` with the shipped config and its LoRA epilogue forced
to the per-adapter loop (``lora_stack=False``) and to the stacked form (``lora_stack=True``), the stage's
default (``auto``: at acf5988, where this ran, a heuristic by expected adapters per tile; now the shipped
file's ``lora_stack``, else the loop), and ``tuned``'s whole layer as the yardstick, timed as notebook 12
times them (:func:`moelora_lib.studies.moe_bench.bench_layer`: graph replay, L2 flushed, median); each
output checked against the fp32 reference. Writes ``dev_lora_stack.csv`` under OUT_DIR. A development
measurement that sets the heuristic; notebook 12 is the evidence.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,256,1600,8192")
    a = ap.parse_args(argv)
    from moelora_lib.moe_lora import make_layer_run
    from moelora_lib.reference import moe_lora_reference
    from moelora_lib.shapes import get_shape
    from moelora_lib.studies import moe_bench as mb
    from moelora_lib.studies.bench import write_rows
    from moelora_lib.testing import assert_close_rel

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for model in a.models.split(","):
        sh = get_shape(model)
        weights = mb.layer_inputs(sh, 1, rank=32, num_adapters=8, bias=True)  # as notebook 12
        for T in (int(t) for t in a.tokens.split(",")):
            lkw = dict(rank=32, num_adapters=8, weights=weights, seed=0, activation="silu", bias=False)
            inp = mb.layer_inputs(sh, T, **lkw)
            ref = moe_lora_reference(*inp.args(), **inp.kwargs())
            got = {}
            for label, stage, stack in (
                ("loop", "fused", False), ("stacked", "fused", True), ("auto", "fused", None),
                ("tuned", "tuned", None),
            ):  # fmt: skip
                kw = dict(lora_stack=stack) if stage == "fused" else {}
                try:
                    run = make_layer_run(*inp.args(), **inp.kwargs(), stage=stage, check_values=False, **kw)
                    assert_close_rel(run(), ref, tol=2e-2, what=f"{model} T={T} {label}")
                    chunk = run._lora_chunk(run.cfg.base_gate_up, True) if stage == "fused" else -1
                    (r,) = mb.bench_layer(
                        stage, sh, T, parts=("total",), warmup_ms=10, rep_ms=40, **lkw, **kw,
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a dev sweep: report and go on
                    print(f"  {model} T={T} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                r.update(variant=label, lora_chunk=chunk)
                rows.append(r)
                got[label] = r["us_p50"]
            print(f"{model:15s} T={T:5d} " + "  ".join(f"{k} {v:8.1f}" for k, v in got.items()), flush=True)
            del inp, ref
            torch.cuda.empty_cache()
        del weights
    write_rows(out / "dev_lora_stack.csv", rows)
    print(f"dev_lora_stack: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
