#!/usr/bin/env bash
# Run the test suite: bash scripts/run_tests.sh [pytest args...]
# Sets up .venv if needed (scripts/setup_env.sh), keeps caches under .cache/, and runs pytest
# (testpaths = tests). Without a CUDA GPU, tests/conftest.py switches on the Triton interpreter and
# skips the tests marked `gpu`. The tests run in PYTEST_WORKERS processes (pytest-xdist; default 2,
# PYTEST_WORKERS=0 runs them in this process), each with one torch thread per worker so that the workers
# do not compete for the cores.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
bash "$ROOT/scripts/setup_env.sh"
WORKERS="${PYTEST_WORKERS:-2}"
if [[ "$WORKERS" != 0 ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    exec "$VENV_PY" -m pytest -o cache_dir="$CACHE/pytest" -n "$WORKERS" "$@"
fi
exec "$VENV_PY" -m pytest -o cache_dir="$CACHE/pytest" "$@"
