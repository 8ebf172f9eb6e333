#!/usr/bin/env bash
# Run the test suite: bash scripts/run_tests.sh [pytest args...]
# Sets up .venv if needed (scripts/setup_env.sh), keeps caches under .cache/, and runs pytest
# (testpaths = tests). Without a CUDA GPU, tests/conftest.py switches on the Triton interpreter and
# skips the tests marked `gpu`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
bash "$ROOT/scripts/setup_env.sh"
exec "$VENV_PY" -m pytest -o cache_dir="$CACHE/pytest" "$@"
