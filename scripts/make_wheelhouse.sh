#!/usr/bin/env bash
# Make a folder of wheels for the GPU set-up on a machine with no package
# index (docs/gpu.md): Chainer 7.8.1 built here as a
# pure-Python wheel, and every other package the project needs that a CUDA
# machine with NumPy 2 and CuPy may lack. Run it where PyPI is reachable:
#
#   bash scripts/make_wheelhouse.sh wheels            # for Python 3.12, x86_64
#   PYTHON_VERSION=3.11 bash scripts/make_wheelhouse.sh wheels
#
# then copy the folder over and run the GPU set-up of docs/gpu.md with WHEELS=wheels
# (experiments/gpu.md carries it to the lent GPU machine). pytest comes too,
# for `pytest -m gpu` there. NumPy is left out (the GPU machine has NumPy 2).
set -euo pipefail
out=${1:?usage: make_wheelhouse.sh DIR}
py=${PYTHON_VERSION:-3.12}
platform=${PLATFORM:-manylinux2014_x86_64}
root="$(cd "$(dirname "$0")/.." && pwd)"
pip=${PIP:-python3 -m pip}
mkdir -p "$out"
# Chainer's source archive needs setuptools<81 to build (pkg_resources).
PIP_CONSTRAINT="$root/constraints-gpu.txt" $pip wheel -q --no-deps -w "$out" "chainer==7.8.1"
# Chainer's and the project's requirements, the build backend for `pip install -e .`,
# and pytest (with its requirements on Python 3.11+).
$pip download -q --no-deps --only-binary=:all: --python-version "$py" --platform "$platform" \
    -d "$out" "setuptools<81" wheel "networkx>=2.6" filelock "protobuf>=3" typing_extensions six packaging \
    pytest pluggy iniconfig pygments
ls "$out"
