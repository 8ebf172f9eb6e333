"""GPU probe for the Helion linear study (notebook 08): memory ceilings and how the L2 state before a
timed call changes decode-GEMM times (moelora_lib.studies.helion_study.ceilings / l2_probe).

Usage (GPU host, from the repo root): python3 scripts/helion_probe.py [--configs PATH]
Writes data/08_ceilings.json and data/08_l2_probe.csv; prints a short table.
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=None, help="Helion config JSON (default: the shipped file)")
    args = p.parse_args()
    import pandas as pd
    import torch

    from moelora_lib.studies import bench
    from moelora_lib.studies import helion_study as study

    if not torch.cuda.is_available():
        raise SystemExit("helion_probe needs a CUDA GPU")
    ceil = study.ceilings()
    ceil.update(bench.env_record())
    bench.data_path("08_ceilings.json").write_text(json.dumps(ceil, indent=1, default=str))
    print({k: ceil[k] for k in ("copy_tb_per_s", "read_tb_per_s", "tiny_kernel_us")})
    rows = study.l2_probe(configs=args.configs)
    bench.write_rows(bench.data_path("08_l2_probe.csv"), rows)
    df = pd.DataFrame(rows)
    df["us"] = df.ms_p50 * 1e3
    print(df.pivot_table(index=["K", "N", "impl"], columns="l2", values="us").round(2).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
