"""The package's architecture: a pure core that imports no Chainer, a
Chainer runtime beside it, and no import cycles anywhere."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "chainer_recompute"

# As if Chainer and CuPy were not installed: importing them raises
# ImportError and importlib.util.find_spec() returns None.
BLOCK_CHAINER = """
import sys
for name in ('chainer', 'chainerx', 'cupy'):
    sys.modules[name] = None
"""


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, type_checking: bool = False):
    """Modules of the package that ``path`` imports (``type_checking``:
    those under ``if TYPE_CHECKING:`` too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and \
                not type_checking:
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("chainer_recompute"):
                continue
            for alias in node.names:
                yield f"{mod}.{alias.name}"  # a submodule, or a name in mod
            yield mod
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("chainer_recompute"):
                    yield alias.name


def _cycles(type_checking: bool):
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _imports(path, type_checking):
            if target in modules and target != name and not name.startswith(target + "."):
                g.add_edge(name, target)
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycles():
    assert _cycles(False) == [], f"import cycles: {_cycles(False)}"


def test_no_import_cycles_counting_type_checking_imports():
    assert _cycles(True) == [], f"import cycles counting TYPE_CHECKING: {_cycles(True)}"


def test_no_mixin_class():
    """The runner is composed of objects with one job each (issue #33): no
    class of the package is a mixin or built from one, and the runners
    inherit nothing; the executor's hook holds a recorder instead of being
    one (a Chainer ``FunctionHook``, nothing of ours)."""
    runners = {"Recompute", "ChainRecompute", "Planner", "StepMeter"}
    hooks = {"IterationHook": ["chainer.FunctionHook"]}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert "mixin" not in node.name.lower(), (path, node.name)
                assert not any("mixin" in b.lower() for b in bases), (path, node.name, bases)
                if node.name in runners:
                    assert not bases, (path, node.name, bases)
                if node.name in hooks:
                    assert bases == hooks[node.name], (path, node.name, bases)


def test_core_never_imports_chainer_or_runtime():
    for path in (PACKAGE / "core").rglob("*.py"):
        for target in _imports(path):
            assert ".runtime" not in target and ".models" not in target, (path, target)
        text = path.read_text()
        assert "import chainer\n" not in text and "from chainer " not in text, path


def test_core_imports_and_solves_without_chainer():
    code = BLOCK_CHAINER + """
import chainer_recompute as cr
from chainer_recompute.core.graph import Graph
g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (2, 3)])
plan = cr.solve(g, 24, solver='exact')
print(plan.feasible, sys.modules.get('chainer') is not None)
try:
    cr.apply
except ImportError as e:
    print('apply needs chainer:', e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "True False"
    assert lines[1].startswith("apply needs chainer")


def test_every_module_says_its_job():
    """Every module opens with a docstring saying its job. (No cap on lines:
    one job per file is the rule, and a cap split the runner into mixins by
    size, issue #33.)"""
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        assert ast.get_docstring(ast.parse(path.read_text())), f"{rel} opens with no docstring"


def test_package_cites_only_documents_the_repository_has():
    """Every ``*.md`` the package's code and comments name is a file of the
    repository (a path from its root, or a name under docs/)."""
    root = PACKAGE.parent
    missing = set()
    for path in PACKAGE.rglob("*.py"):
        for ref in re.findall(r"[A-Za-z0-9_./-]+\.md\b", path.read_text()):
            if not ((root / ref).is_file() or (root / "docs" / ref).is_file()):
                missing.add((path.relative_to(PACKAGE).as_posix(), ref))
    assert missing == set(), f"documents cited but not in the repository: {sorted(missing)}"


def test_the_public_api_is_listed_and_importable():
    """``help(chainer_recompute)`` lists the API: every name of ``__all__``
    resolves (the lazy ones included), ``cr.extensions`` is the module
    ``chainer_recompute.extensions``, and pydoc's text shows ``apply``."""
    import pydoc
    import chainer_recompute as cr
    import chainer_recompute.extensions as extensions
    assert [n for n in cr.__all__ if not hasattr(cr, n)] == []
    assert cr.extensions is extensions
    assert set(cr.__all__) <= set(dir(cr))
    text = pydoc.render_doc(cr, renderer=pydoc.plaintext)
    assert "apply(model" in text and "least_total_budget(" in text


def test_apply_names_the_options_a_user_sets_and_takes_the_knobs_in_tuning():
    """``apply()``'s signature names the user's options; the tuning knobs
    go in ``cr.Tuning``; passed directly they still work, with a
    DeprecationWarning that names the ``Tuning`` to write; given twice,
    refused before anything changes."""
    import inspect
    import warnings
    import chainer.links as L
    import pytest
    import chainer_recompute as cr
    from chainer_recompute.core.errors import RecomputeError
    named = set(inspect.signature(cr.apply).parameters)
    assert {"budget", "solver", "strategy", "budget_scope", "capture_batch", "on_infeasible",
            "workspace", "keep", "verbose", "tuning"} <= named
    assert not named & {"cost", "max_plans", "max_structures", "check_iterations", "verify",
                        "workspace_exact", "plan_at", "engine", "method"}
    model = L.Classifier(L.Linear(4, 3))
    cr.apply(model, budget="least", verbose=False,
             tuning=cr.Tuning(cost="flops", check_iterations=0,
                              solver_options={"engine": "numpy"}))
    runner = cr.runner_of(model)
    assert (runner.spec.cost, runner.spec.check_iterations, runner.spec.solver_options) == \
        ("flops", 0, {"engine": "numpy"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cr.apply(model, budget="least", verbose=False, cost="paper", engine="numpy")
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert said and "Tuning(cost='paper', solver_options={'engine': 'numpy'})" in said[0]
    assert cr.runner_of(model).spec.cost == "paper"
    before = cr.runner_of(model)
    with pytest.raises(RecomputeError, match="give each once"):
        cr.apply(model, budget="least", tuning=cr.Tuning(cost="flops"), cost="paper")
    assert cr.runner_of(model) is before
    with pytest.raises(RecomputeError, match="Tuning"):
        cr.apply(model, budget="least", tuning={"cost": "flops"})
