#!/usr/bin/env bash
# The main job: bash scripts/run_notebooks.sh [runner args, e.g. --only 01,02 --keep-going]
# Sets up .venv if needed, then executes every notebooks/NN_*.ipynb in order with papermill:
# profile gpu (full shapes) when the venv's torch sees a CUDA GPU, else profile cpu (small shapes
# through the Triton/Helion interpreters). See python -m moelora_lib.studies.runner --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
bash "$ROOT/scripts/setup_env.sh"

if venv_has_cuda; then PROFILE=gpu; else PROFILE=cpu; fi
echo "run_notebooks: profile=$PROFILE"
exec "$VENV_PY" -m moelora_lib.studies.runner --profile "$PROFILE" "$@"
