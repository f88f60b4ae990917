"""chainer-recompute: memory-efficient backpropagation for Chainer.

Every version requirement of the project lives here. Chainer 7.8.1 ships
only as a source archive whose setup.py imports ``pkg_resources``: build it
with ``PIP_CONSTRAINT`` naming a file with ``setuptools<81``, as the README's
set-up commands do (``constraints.txt`` for the CPU set-up, which also keeps
NumPy 1 there; ``constraints-gpu.txt``, which leaves NumPy alone, for a CUDA
machine whose CuPy needs NumPy 2). Chainer also imports ``pkg_resources`` at
run time, hence the run-time requirement on setuptools.
"""
from setuptools import find_packages, setup

setup(
    name="chainer-recompute",
    version="0.1.0",
    description="Graph-theoretic recomputation for memory-efficient backpropagation in Chainer",
    packages=find_packages(include=["chainer_recompute", "chainer_recompute.*"]),
    python_requires=">=3.9",
    install_requires=[
        "chainer==7.8.1",
        # NumPy 1 or 2: chainer_recompute._compat makes Chainer 7.8.1 run on
        # NumPy 2 (np.sctypes), which CuPy 14 needs.
        "numpy>=1.21",
        "networkx>=2.6",
        "setuptools<81",
    ],
    extras_require={
        # matplotlib: tests/test_plotting.py draws the figures of --out.
        "test": ["pytest>=7", "pytest-timeout>=2", "matplotlib>=3.5"],
        # memory.png and schedule.png of `chainer-recompute --out DIR` and
        # `chainer-recompute plot` (chainer_recompute/plotting.py).
        "plot": ["matplotlib>=3.5"],
        # Compiled DP kernels (chainer_recompute/core/kernels/dp.py) and
        # orjson for reading the authors' graph files; without them the solvers
        # run on NumPy alone and the files are read by json, with the same answers.
        "fast": ["numba>=0.59", "orjson>=3.9"],
        # ChainerMN (shipped with Chainer) over MPI (runtime/distributed.py): needs
        # a system MPI to build mpi4py (Debian: openmpi-bin, libopenmpi-dev).
        "mn": ["mpi4py>=3"],
        # Third-party Chainer libraries trained by their own training code in
        # tests/test_third_party.py (slow tests, skipped without them):
        # chainer-chemistry imports pandas (<2.3 works with NumPy 1.26);
        # chainerrl 0.8.0 imports gym.wrappers.Monitor, gone after gym 0.22;
        # chainercv2 (imgclsmob's model zoo) for experiments/chainercv2_sweep.py too.
        "thirdparty": ["chainer-chemistry==0.7.1", "pandas>=1.5,<2.3",
                       "chainerrl==0.8.0", "gym==0.22.0", "chainercv2==0.0.62"],
    },
    entry_points={"console_scripts": [
        "chainer-recompute=chainer_recompute.cli:main",
    ]},
)
