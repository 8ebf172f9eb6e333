#!/usr/bin/env bash
# Open the notebook suite in JupyterLab: bash scripts/lab.sh [jupyter lab arguments, e.g. --no-browser --port 8890]
# Sets up .venv if needed (scripts/setup_env.sh) and starts the venv's JupyterLab on notebooks/. The notebooks'
# parameter PROFILE = "auto" picks the GPU profile where CUDA is present, else the CPU one (small shapes through
# the Triton interpreter), so Run All works on either machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
bash "$ROOT/scripts/setup_env.sh"
exec "$VENV/bin/jupyter" lab --notebook-dir="$ROOT/notebooks" "$@"
