#!/usr/bin/env bash
# Open the notebook suite in JupyterLab: bash scripts/lab.sh [jupyter lab arguments, e.g. --no-browser --port 8890]
# Sets up .venv if needed (scripts/setup_env.sh) and starts the venv's JupyterLab on notebooks/. The notebooks'
# parameter PROFILE = "auto" picks the GPU profile where CUDA is present, else the CPU one (small shapes through
# the Triton interpreter), so Run All works on either machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
bash "$ROOT/scripts/setup_env.sh"
ROOT_ARGS=()
# JupyterLab refuses to start as root ("Running as root is not recommended. Use --allow-root"): containers
# and fresh cloud machines often run as root.
if [[ $EUID -eq 0 ]]; then ROOT_ARGS=(--allow-root); fi
exec "$VENV/bin/jupyter" lab --notebook-dir="$ROOT/notebooks" ${ROOT_ARGS[@]+"${ROOT_ARGS[@]}"} "$@"
