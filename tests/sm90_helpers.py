"""Run a script that compiles kernels for sm_90 (no GPU needed) in a fresh interpreter without
TRITON_INTERPRET, and read the JSON list it prints on its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sm90_script(script: str, timeout: int = 600) -> list[dict]:
    """The rows the script prints as JSON on its last stdout line; AssertionError with its stderr's tail
    when it fails. FP fusion is on, as on the GPU (Triton's default)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
