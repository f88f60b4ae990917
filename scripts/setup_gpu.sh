#!/usr/bin/env bash
# The GPU set-up (docs/gpu.md): run it with the Python of an
# environment that already has NumPy 2 and CuPy. It installs the project and
# what it needs without touching NumPy or CuPy, and lets `import chainer`
# come before `import chainer_recompute` on NumPy 2.
#
#   bash scripts/setup_gpu.sh                          # python3 on PATH, from PyPI
#   PYTHON=/opt/env/bin/python WHEELS=wheels bash scripts/setup_gpu.sh   # offline
#
# WHEELS: a folder made by scripts/make_wheelhouse.sh (no package index used).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
    # as variables, not options: a pip that installs `-e .` through `setup.py
    # develop` runs another pip for the build, which sees only these
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$(cd "$WHEELS" && pwd)"
fi
PIP_CONSTRAINT="$PWD/constraints-gpu.txt" "$py" -m pip install -q -e .
"$py" -m chainer_recompute._numpy2_hook install
"$py" -c "
import chainer, numpy, chainer_recompute
print(f'chainer-recompute ready: NumPy {numpy.__version__}, Chainer {chainer.__version__}, '
      f'CuPy usable by Chainer: {chainer.backends.cuda.available}')"
