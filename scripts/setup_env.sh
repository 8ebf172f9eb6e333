#!/usr/bin/env bash
# Create/refresh the project venv in <repo>/.venv. Idempotent: a second run with the same
# pyproject.toml (and this script) only checks a stamp file and returns in well under a second.
#
#   GPU machine (nvidia-smi works, or the system python3's torch sees CUDA):
#       venv with --system-site-packages, so the host's CUDA torch/triton/numpy are used as they are
#       (pinned to the installed versions via a constraints file); only the rest is installed.
#   CPU machine:
#       torch==2.13.0 (CPU build) triton==3.6.0 "numpy<2.4" (triton 3.6's interpreter breaks with
#       numpy>=2.4) + -e .[notebooks,helion,models,dev], in one pip command. A dry run first checks that no CUDA
#       torch / nvidia-* package would be installed and aborts if one would.
#
# Env: PYTHON (interpreter for the venv, default python3), MOELORA_SETUP_FORCE=1 (ignore the stamp).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

PY="${PYTHON:-python3}"
STAMP="$VENV/.moelora_setup_stamp"
t_start=$(date +%s)

host_has_cuda() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        return 0
    fi
    "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1
}

if host_has_cuda; then MODE=gpu; else MODE=cpu; fi

stamp_value() {
    {
        echo "mode=$MODE"
        cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh"
    } | sha256sum | cut -d' ' -f1
}
WANT="$(stamp_value)"

if [[ "${MOELORA_SETUP_FORCE:-0}" != 1 && -x "$VENV_PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "setup_env: .venv is up to date (mode=$MODE)"
    exit 0
fi

if [[ ! -x "$VENV_PY" ]]; then
    echo "setup_env: creating .venv (mode=$MODE) with $("$PY" --version 2>&1)"
    if [[ $MODE == gpu ]]; then
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
elif [[ $MODE == gpu ]] && ! grep -qi 'include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
    echo "setup_env: WARNING: .venv exists without --system-site-packages on a CUDA machine;" \
        "delete .venv to use the host's CUDA torch" >&2
fi

PIP=("$VENV_PY" -m pip --disable-pip-version-check)
# Drop pip's warnings about unreachable local find-links/index folders (machine config, not errors).
pip_() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true); }
QUIET=(-q)
[[ "${VERBOSE:-0}" == 1 ]] && QUIET=()
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [[ $MODE == gpu ]]; then
    # Keep whatever torch/triton/numpy the host has: pin them to their installed versions.
    "$VENV_PY" - >"$WORK/constraints.txt" <<'PYEOF'
import importlib.metadata as md
for name in ("torch", "triton", "numpy"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PYEOF
    echo "setup_env: keeping the host's $(tr '\n' ' ' <"$WORK/constraints.txt")"
    pip_ install "${QUIET[@]}" -c "$WORK/constraints.txt" -e ".[notebooks,helion,models,dev]"
else
    REQS=("torch==2.13.0" "triton==3.6.0" "numpy<2.4" -e ".[notebooks,helion,models,dev]")
    echo "setup_env: resolving (dry run) ${REQS[*]}"
    pip_ install -q --dry-run --ignore-installed --report "$WORK/report.json" "${REQS[@]}"
    "$VENV_PY" - "$WORK/report.json" <<'PYEOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
cuda = sorted(n for n in names if n.startswith(("nvidia-", "cuda-")))
torch_v = names.get("torch", "(already installed)")
print(f"setup_env: dry run selects {len(names)} packages; torch {torch_v}")
if cuda or "+cu" in torch_v:
    sys.exit(
        "setup_env: ABORT: the resolver would install a CUDA torch build "
        f"(torch {torch_v}; {', '.join(cuda[:8])}{' ...' if len(cuda) > 8 else ''}).\n"
        "Point pip at an index that serves the CPU build of torch==2.13.0 "
        "(e.g. PIP_EXTRA_INDEX_URL=<CPU-only torch index>) and run again."
    )
PYEOF
    echo "setup_env: installing"
    pip_ install "${QUIET[@]}" "${REQS[@]}"
fi

# The installed set must be consistent, and the core imports must work.
"${PIP[@]}" check
"$VENV_PY" -c 'import torch, triton, numpy, papermill, moelora_lib, sys
print(f"setup_env: torch {torch.__version__} (cuda={torch.cuda.is_available()}), triton {triton.__version__}, "
      f"numpy {numpy.__version__}, python {sys.version.split()[0]}")'
echo "$WANT" >"$STAMP"
echo "setup_env: done in $(($(date +%s) - t_start)) s"
