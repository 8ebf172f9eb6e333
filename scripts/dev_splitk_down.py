"""Development probe (not suite evidence): stage ``fused``'s down GEMM split over K at decode.

    python3 scripts/dev_splitk_down.py --out OUT_DIR [--models gpt-oss-20b,qwen3-30b-a3b]
        [--tokens 1,8,64,256]

For each (model, T): the whole layer of stage ``fused`` with the shipped config, then with ``base_down``
replaced by every variant of a small grid (SPLIT_K 1/2/4/8 × BLOCK_SIZE_N 32/64/128 × BLOCK_SIZE_K
64/128, BLOCK_SIZE_M and the rest as shipped), timed as notebook 12 times it
(:func:`moelora_lib.studies.moe_bench.bench_layer`: graph replay, L2 flushed, median); each variant's
output checked against the fp32 reference. Prints the best variants; writes ``dev_splitk_down.csv``
under OUT_DIR. A development measurement that picks the configs to ship; notebook 12 is the evidence.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,256")
    a = ap.parse_args(argv)
    from moelora_lib.kernels import STAGES
    from moelora_lib.moe_lora import make_layer_run
    from moelora_lib.reference import moe_lora_reference
    from moelora_lib.shapes import Dims, get_shape
    from moelora_lib.studies import moe_bench as mb
    from moelora_lib.studies.bench import write_rows
    from moelora_lib.testing import assert_close_rel
    from moelora_lib.workloads import make_inputs

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for model in a.models.split(","):
        sh = get_shape(model)
        for T in (int(t) for t in a.tokens.split(",")):
            inp = make_inputs(sh, T, rank=32, num_adapters=8, dtype=torch.bfloat16, device="cuda")
            ref = moe_lora_reference(*inp.args(), **inp.kwargs())
            dims = Dims.of(model, T, rank=32, adapters=8)
            shipped = STAGES["fused"].config_for(dims)
            variants = [("shipped", shipped)]
            for sk, bn, bk in itertools.product((1, 2, 4, 8), (32, 64, 128), (64, 128)):
                bd = replace(shipped.base_down, SPLIT_K=sk, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, NUM_STAGES=4)
                variants.append((f"s{sk}n{bn}k{bk}", shipped.replace(base_down=bd, source="dev")))
            got = []
            for label, cfg in variants:
                try:
                    run = make_layer_run(
                        *inp.args(), **inp.kwargs(), stage="fused", config=cfg, check_values=False
                    )
                    assert_close_rel(run(), ref, tol=2e-2, what=f"{model} T={T} {label}")
                    (r,) = mb.bench_layer(
                        "fused", sh, T, rank=32, num_adapters=8, weights=inp, activation="silu", bias=False,
                        parts=("total",), warmup_ms=10, rep_ms=40, config=cfg,
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a dev sweep: report and go on
                    print(f"  {model} T={T} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                r.update(variant=label, base_down=str(cfg.base_down))
                rows.append(r)
                got.append((r["us_p50"], label))
            got.sort()
            base = next(u for u, lab in got if lab == "shipped")
            best1 = min(u for u, lab in got if lab.startswith("s1"))
            print(f"{model:15s} T={T:5d} shipped {base:7.1f}  best SPLIT_K=1 {best1:7.1f}  best "
                  + "  ".join(f"{lab} {u:.1f}" for u, lab in got[:4]), flush=True)  # fmt: skip
            del inp, ref
            torch.cuda.empty_cache()
    write_rows(out / "dev_splitk_down.csv", rows)
    print(f"dev_splitk_down: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
