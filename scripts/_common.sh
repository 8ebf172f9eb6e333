# Sourced by the scripts in this folder (not run directly).
# Sets ROOT, VENV_PY and keeps every cache inside the repo under .cache/,
# so nothing is written to $HOME and CI runs start from the same state.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VENV_PY="$VENV/bin/python"
CACHE="$ROOT/.cache"

export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$CACHE/triton}"
export HELION_CACHE_DIR="${HELION_CACHE_DIR:-$CACHE/helion}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/torchinductor}"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$CACHE/xdg}"
export JUPYTER_DATA_DIR="${JUPYTER_DATA_DIR:-$CACHE/jupyter/data}"
export JUPYTER_RUNTIME_DIR="${JUPYTER_RUNTIME_DIR:-$CACHE/jupyter/runtime}"
export JUPYTER_CONFIG_DIR="${JUPYTER_CONFIG_DIR:-$CACHE/jupyter/config}"
export IPYTHONDIR="${IPYTHONDIR:-$CACHE/ipython}"
export MPLCONFIGDIR="${MPLCONFIGDIR:-$CACHE/matplotlib}"
# The Triton interpreter runs tl.dot as numpy's matmul (OpenBLAS). OpenBLAS's FMA kernels (Haswell and newer,
# picked at run time on CPUs without AVX-512) round a row of a product differently depending on where the row
# falls in the matrix, so tests asserting that a kernel's rows do not depend on which rows share a tile (true
# of the GPU's MMA) would fail on such CPUs only. The non-FMA kernels make every row independent of the others.
export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-Sandybridge}"
# Jupyter warns about the platformdirs migration on every start otherwise.
export JUPYTER_PLATFORM_DIRS="${JUPYTER_PLATFORM_DIRS:-1}"
export PYTHONDONTWRITEBYTECODE="${PYTHONDONTWRITEBYTECODE:-1}"
mkdir -p "$TRITON_CACHE_DIR" "$HELION_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$XDG_CACHE_HOME" \
    "$JUPYTER_DATA_DIR" "$JUPYTER_RUNTIME_DIR" "$JUPYTER_CONFIG_DIR" "$IPYTHONDIR" "$MPLCONFIGDIR"

# True when the venv's torch sees a CUDA device.
venv_has_cuda() {
    "$VENV_PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
