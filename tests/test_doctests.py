"""Every docstring example of the package runs (house style: one runnable
``>>>`` example on public functions)."""
import doctest
import importlib
import pkgutil

import pytest

import chainer_recompute

#: Modules whose examples need what a default install lacks.
OPTIONAL = {"chainer_recompute.core.kernels.dp",  # numba ('fast' extra)
            "chainer_recompute.plotting"}  # matplotlib ('plot' extra)

MODULES = sorted(m.name for m in pkgutil.walk_packages(chainer_recompute.__path__,
                                                       "chainer_recompute.")
                 if m.name not in OPTIONAL)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
