#!/usr/bin/env bash
# The one command for the offline GPU host (docs/gpu_host.md). Run from the repo root, with .whl/
# (scripts/build_wheelhouse.sh) next to the working tree:
#
#   NOTEBOOKS=01,02 GPU_TESTS=1 OUT=/some/dir bash scripts/gpu_job.sh
#
# Env: NOTEBOOKS   stage selection for the runner (default: all notebooks); groups separated by "+" run
#                  one after another in that order (NOTEBOOKS=09,10,11,12+00: the explorer last)
#      GPU_TESTS=1 also run `pytest -m gpu` after the notebooks
#      GPU_TESTS_PATHS  the test files or node ids for it (default: tests)
#      OUT         where results.tar.gz, gpu_job.log (and pytest_gpu.xml) go (default: ./_gpu_out)
#      JOB_BUDGET_S wall-clock budget for the whole job (default 560 s: the device allows 600 s per
#                  command); the notebooks and tests are stopped in time to always pack the results
#      MOELORA_GIT_COMMIT  recorded as git_commit when the copy has no .git
#      PRE_CMDS    shell commands run (bash -c, same environment) before the notebooks, e.g. a probe
#                  or the Helion tuner; their own time counts against JOB_BUDGET_S
#      NOTEBOOKS=none runs no notebook (only PRE_CMDS and GPU_TESTS)
#      SITE        where the wheels are installed (default /tmp/site)
# Uses the host's python3 with its own torch/triton/numpy; installs only the wheelhouse (--no-deps).
# Always leaves $OUT/results.tar.gz (data/: CSVs, figures, executed notebooks and the runner's
# data/executed/run_log.csv, env JSON) and
# $OUT/gpu_job.log, also on failure or timeout. Exit status: the runner's (or pytest's) status.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/_gpu_out}"
SITE="${SITE:-/tmp/site}"
BUDGET="${JOB_BUDGET_S:-560}"
PACK_RESERVE=25
mkdir -p "$OUT"
LOG="$OUT/gpu_job.log"
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
RC=0

pack() {
    local rc=$?
    [[ $RC == 0 ]] && RC=$rc
    trap - EXIT INT TERM
    echo "gpu_job: packing data/ into $OUT/results.tar.gz (status $RC, $(($(date +%s) - T0)) s elapsed)"
    mkdir -p data
    tar -czf "$OUT/results.tar.gz" --exclude='__pycache__' data || echo "gpu_job: tar failed"
    ls -la "$OUT"
    sleep 1  # let tee flush the log
    exit "$RC"
}
trap pack EXIT
trap 'RC=130; exit 130' INT TERM

left() { echo $((BUDGET - PACK_RESERVE - ($(date +%s) - T0))); }

echo "gpu_job: $(date -u +%FT%TZ) on $(hostname), budget ${BUDGET}s"
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_job: no .whl/*.whl here: run scripts/build_wheelhouse.sh on a networked machine and carry .whl"
    RC=3; exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu_job: wheel install failed"; RC=3; exit 3; }
# Exported, so the notebook kernels (started by the runner with this same python3) see the wheels too.
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# Keep the caches inside the repo copy, as on the CPU machines.
source "$ROOT/scripts/_common.sh"
unset TRITON_INTERPRET HELION_INTERPRET
# No kernelspec is registered: the runner writes its own (argv[0] = this python3) and checks it.

python3 - <<'PYEOF'
import importlib.metadata as md, sys
import torch
print("python", sys.version.split()[0])
for n in ("torch", "triton", "numpy", "helion", "papermill", "nbclient", "ipykernel", "pandas", "matplotlib",
          "transformers", "peft", "safetensors", "huggingface_hub"):
    try:
        print(f"{n:11s} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"{n:11s} absent")
print("cuda available:", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import ipykernel, papermill  # the runner and its kernels need both, from $SITE
PYEOF
nvidia-smi || echo "gpu_job: nvidia-smi failed"
python3 -c 'from moelora_lib.studies.bench import save_env; save_env("data/env/gpu_host.json")' \
    || echo "gpu_job: could not save data/env/gpu_host.json"

if [[ -n "${PRE_CMDS:-}" ]]; then
    t=$(left)
    echo "gpu_job: PRE_CMDS (timeout ${t}s): $PRE_CMDS"
    timeout --signal=INT --kill-after=10 "$t" bash -c "$PRE_CMDS"
    prc=$?
    echo "gpu_job: PRE_CMDS exit status $prc"
    [[ $RC == 0 ]] && RC=$prc
fi

if [[ "${NOTEBOOKS:-}" == none ]]; then
    echo "gpu_job: NOTEBOOKS=none: no notebook run"
else
    # NOTEBOOKS=09,10+00: groups separated by "+" run one after another in the order given (the runner
    # sorts the notebooks of one group by number), e.g. the explorer 00 after the notebooks whose CSVs it reads
    IFS='+' read -r -a GROUPS_ <<< "${NOTEBOOKS:-}"
    ((${#GROUPS_[@]} == 0)) && GROUPS_=("")
    for group in "${GROUPS_[@]}"; do
        ONLY_ARGS=()
        [[ -n "$group" ]] && ONLY_ARGS=(--only "$group")
        t=$(left)
        if ((t <= 0)); then
            echo "gpu_job: no time left for the notebooks ${group:-all} (JOB_BUDGET_S=$BUDGET)"
            [[ $RC == 0 ]] && RC=124
            break
        fi
        echo "gpu_job: running notebooks ${group:-all} (timeout ${t}s)"
        timeout --signal=INT --kill-after=10 "$t" \
            python3 -m moelora_lib.studies.runner --profile gpu --out data/executed --keep-going --no-progress \
            --log-output "${ONLY_ARGS[@]}"
        nrc=$?
        [[ $RC == 0 ]] && RC=$nrc
        if ((nrc == 124)); then
            echo "gpu_job: the notebooks ran out of time (JOB_BUDGET_S=$BUDGET)"
            break
        fi
    done
fi

if [[ "${GPU_TESTS:-0}" == 1 ]]; then
    t=$(left)
    if ((t > 10)); then
        echo "gpu_job: pytest -m gpu (timeout ${t}s)"
        timeout --signal=INT --kill-after=10 "$t" \
            python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" ${GPU_TESTS_PATHS:-tests}
        trc=$?
        [[ $RC == 0 ]] && RC=$trc
    else
        echo "gpu_job: no time left for pytest -m gpu"
    fi
fi
exit "$RC"
