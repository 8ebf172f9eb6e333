#!/usr/bin/env bash
# Build .whl/ (git-ignored): the CPython 3.12 manylinux x86_64 wheels that the offline GPU host lacks,
# so the notebook suite can run there against the host's own torch/triton (see docs/gpu_host.md).
#
#   bash scripts/build_wheelhouse.sh        # needs a PyPI-reachable pip; about 35 MB, < 40 MB
#
# 1. Resolve the closure of ROOTS for cp312/manylinux x86_64 (pip --dry-run --report).
# 2. Drop what the GPU host already has (HOST_HAS), what only newer versions of it need (NOT_NEEDED),
#    and never ship torch/triton/numpy/nvidia-*.
# 3. pip download --no-deps each remaining NAME==VERSION (exactly one version per package).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
# The device tool carries at most 64 MiB per call: the working tree (~13 MB) plus this folder.
MAX_MB="${MAX_MB:-40}"
PYVER="${WHEEL_PY_VERSION:-3.12}"   # the GPU host's python; another value only for rehearsals
ABI="cp${PYVER/./}"

# What the notebooks need on the host beyond its own stack. helion must be 1.4.0 there (torch 2.11).
# transformers + peft: notebook 11's baseline (and the versions the CPU tests use; the host's own
# transformers is 5.17); huggingface-hub < 2 keeps the resolution on the hub major the host has (1.33),
# whose own copy is used (transformers 5.24 needs >= 1.31).
ROOTS=(papermill==2.7.0 nbclient nbformat ipykernel ipywidgets helion==1.4.0 filecheck
       transformers==5.24.0 peft==0.21.2 "huggingface-hub>=1.31,<2")

# Packages present on the GPU host (its pip list; docs/gpu_host.md). Anything not
# listed is treated as missing and shipped.
HOST_HAS=(
    accelerate aiohttp anyio attrs certifi charset-normalizer click cloudpickle filelock fsspec idna
    jinja2 markupsafe matplotlib numpy packaging pandas psutil pygments python-dateutil pyyaml requests
    rich scikit-learn scipy six tqdm typing-extensions urllib3 markdown-it-py mdurl pytest safetensors
    huggingface-hub tokenizers hf-xet httpx httpcore h11 typer shellingham annotated-doc
    # requirements of packages above, so present with them (torch 2.11, scikit-learn, python-dateutil)
    torch triton sympy mpmath networkx setuptools joblib threadpoolctl narwhals tzdata
)
# Requirements of newer versions of packages the host has, whose own versions are used instead:
# typer >= 0.2x needs pydantic (transformers imports typer only for its command line).
NOT_NEEDED=(pydantic pydantic-core annotated-types typing-inspection)
NEVER='^(torch|triton|numpy|nvidia-.*|cuda-.*)$'

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform manylinux_2_5_x86_64)
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" "${PLATFORMS[@]}")

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
noise() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }

echo "build_wheelhouse: resolving ${ROOTS[*]} for $ABI manylinux x86_64"
"$PY" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed "${TARGET[@]}" \
    --target "$WORK/target" --report "$WORK/report.json" "${ROOTS[@]}" 2> >(noise)

"$PY" - "$WORK/report.json" "$NEVER" "${HOST_HAS[@]}" "${NOT_NEEDED[@]}" >"$WORK/wanted.txt" <<'PYEOF'
import json, re, sys
report, never, host = sys.argv[1], re.compile(sys.argv[2]), sys.argv[3:]
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
host = {canon(h) for h in host}
items = json.load(open(report))["install"]
pins = {}
for it in items:
    name, ver = canon(it["metadata"]["name"]), it["metadata"]["version"]
    if name in host or never.match(name):
        print(f"  skip {name}=={ver} (on the host / not needed / never shipped)", file=sys.stderr)
        continue
    if name in pins and pins[name] != ver:
        sys.exit(f"two versions of {name}: {pins[name]} and {ver}")
    pins[name] = ver
for name in sorted(pins):
    print(f"{name}=={pins[name]}")
PYEOF

echo "build_wheelhouse: downloading $(wc -l <"$WORK/wanted.txt") wheels into .whl/"
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$DEST" \
    -r "$WORK/wanted.txt" 2> >(noise)

# Checks: one wheel per wanted package, nothing forbidden, size limit.
"$PY" - "$DEST" "$WORK/wanted.txt" "$NEVER" "$MAX_MB" <<'PYEOF'
import pathlib, re, sys
dest, wanted, never, max_mb = pathlib.Path(sys.argv[1]), sys.argv[2], re.compile(sys.argv[3]), float(sys.argv[4])
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
want = {canon(l.split("==")[0]): l.split("==")[1] for l in open(wanted).read().split()}
wheels = sorted(dest.glob("*.whl"))
got = {}
for w in wheels:
    name, ver = canon(w.name.split("-")[0]), w.name.split("-")[1]
    if name in got:
        sys.exit(f"two wheels for {name}: {got[name]} and {w.name}")
    if never.match(name):
        sys.exit(f"forbidden wheel {w.name}")
    got[name] = w.name
missing = sorted(set(want) - set(got))
if missing:
    sys.exit(f"missing wheels: {missing}")
total = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"  {w.stat().st_size / 1e6:6.2f} MB  {w.name}")
print(f"build_wheelhouse: {len(wheels)} wheels, {total:,} bytes ({total / 2**20:.1f} MiB) in {dest}")
if total > max_mb * 2**20:
    sys.exit(f"wheelhouse is over {max_mb} MiB")
PYEOF
