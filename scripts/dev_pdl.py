"""Development probe (not suite evidence): stage ``fused`` with and without programmatic dependent launch.

    python3 scripts/dev_pdl.py --out OUT_DIR [--models gpt-oss-20b,qwen3-30b-a3b] [--tokens 1,8,64,...]

For each (model, T): the whole layer and the base part of stage ``fused`` with PDL (notebook 12's lever
``fused_pdl``) and without (the stage's default now; PDL was the default at 96cbb12, where run 1 ran), and
``tuned``'s whole layer beside them, all timed as the notebook times them
(:func:`moelora_lib.studies.moe_bench.bench_layer`: graph replay, L2 flushed, median); the two outputs
compared bit for bit; at T = 1 one graph replay kernel by kernel for both settings
(:func:`moelora_lib.studies.fused_bench.graph_timeline`). Prints a table; writes ``dev_pdl.csv`` and
``dev_pdl_timeline.csv`` under OUT_DIR. A development measurement: it steers the change and is quoted
only as such; notebook 12 is the evidence.
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
    from moelora_lib.shapes import get_shape
    from moelora_lib.studies import fused_bench as fb
    from moelora_lib.studies import moe_bench as mb
    from moelora_lib.studies.bench import write_rows
    from moelora_lib.workloads import make_inputs

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, tl = [], []
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    print(f"{'model':15s} {'T':>5s} {'pdl':>8s} {'no_pdl':>8s} {'saved':>6s} {'base':>8s} {'base_np':>8s} "
          f"{'tuned':>8s} equal", flush=True)  # fmt: skip
    for model in a.models.split(","):
        sh = get_shape(model)
        for T in (int(t) for t in a.tokens.split(",")):
            inp = make_inputs(sh, T, rank=32, num_adapters=8, dtype=torch.bfloat16, device="cuda")
            got = {}
            for label, stage, pdl in (
                ("pdl", "fused", True),
                ("no_pdl", "fused", False),
                ("tuned", "tuned", None),
            ):
                parts = ("total",) if stage == "tuned" else ("base", "total")
                for r in mb.bench_layer(
                    stage, sh, T, rank=32, num_adapters=8, weights=inp, activation="silu", bias=False,
                    parts=parts, warmup_ms=10, rep_ms=40, pdl=pdl,
                ):  # fmt: skip
                    r.update(lever=label)
                    rows.append(r)
                    got[(label, r["part"])] = r["us_p50"]
            on = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", check_values=False, pdl=True)
            off = make_layer_run(*inp.args(), **inp.kwargs(), stage="fused", check_values=False)
            eq = bool(torch.equal(on(), off())) and on.pdl and not off.pdl
            if T == 1:
                for label, run in (("pdl", on), ("no_pdl", off)):
                    for r in fb.graph_timeline(run, model=model):
                        r.update(lever=label)
                        tl.append(r)
            print(f"{model:15s} {T:5d} {got['pdl', 'total']:8.1f} {got['no_pdl', 'total']:8.1f} "
                  f"{got['no_pdl', 'total'] - got['pdl', 'total']:6.1f} {got['pdl', 'base']:8.1f} "
                  f"{got['no_pdl', 'base']:8.1f} {got['tuned', 'total']:8.1f} {eq}", flush=True)  # fmt: skip
            del inp, on, off
            torch.cuda.empty_cache()
    write_rows(out / "dev_pdl.csv", rows)
    if tl:
        write_rows(out / "dev_pdl_timeline.csv", tl)
        import pandas as pd

        d = pd.DataFrame(tl)
        g = d.groupby(["model", "lever", "replay"]).agg(span=("span_us", "first"), gaps=("gap_us", "sum"))
        print(g.groupby(["model", "lever"]).median().to_string(), flush=True)
        k = d.groupby(["model", "lever", "seq", "name"]).dur_us.median().reset_index()
        print(k.to_string(index=False), flush=True)
    print(f"dev_pdl: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
