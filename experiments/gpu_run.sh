#!/usr/bin/env bash
# The lent GPU machine's whole run (experiments/gpu.md): set up from the
# carried wheel folder with no package index (scripts/setup_gpu.sh, then
# pytest from the same folder), then experiments/gpu_run.py.
#
#   bash experiments/gpu_run.sh OUT [gpu_run.py options]      # e.g. OUT=$OUT/gpu
#
# PYTHON: the interpreter that has NumPy 2 and CuPy (python3); WHEELS: the
# folder made by scripts/make_wheelhouse.sh (wheels). Where numba is
# installed, the planner's kernels are compiled once here, before the timed
# sections (NUMBA_CACHE_DIR, a planning of the committed ResNet152 graph that
# is refused: about 12 s on this project's CPU), not in the first section's
# time box.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_run.sh OUT [gpu_run.py options]}
shift
py=${PYTHON:-python3}
wheels=${WHEELS:-wheels}
mkdir -p "$out"
start=$(date +%s)
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # A system Python may refuse pip without this (PEP 668); no index is used.
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    PYTHON="$py" WHEELS="$wheels" bash scripts/setup_gpu.sh
    "$py" -m pip install -q --no-index --find-links "$wheels" pytest \
        || echo "pytest not installed: the pytest section will fail"
} > "$out/setup.log" 2>&1
rc=$?
tail -n 3 "$out/setup.log"
echo "set-up: exit $rc, $(( $(date +%s) - start )) s (log: $out/setup.log)"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/chainer-recompute-numba}
if "$py" -c "import numba" 2>/dev/null; then
    t0=$(date +%s)
    timeout 90 "$py" -m chainer_recompute.cli --graph experiments/graphs/resnet152.json \
        --budget 1.2GB >> "$out/setup.log" 2>&1
    echo "numba kernels compiled: $(( $(date +%s) - t0 )) s"
fi
"$py" experiments/gpu_run.py "$out" "$@"
