"""``import chainer`` before ``import chainer_recompute`` on NumPy 2.

Chainer 7.8.1 reads ``numpy.sctypes`` at import, which NumPy 2 removed;
``chainer_recompute`` patches it before it imports Chainer
(:mod:`chainer_recompute._compat`), but most training scripts import
``chainer`` first. ``python -m chainer_recompute._numpy2_hook install``
writes a ``.pth`` file into the environment's site-packages. At every
interpreter start it puts a finder first on ``sys.meta_path`` (nothing is
imported then: the start stays as fast). The first ``import chainer`` makes
the finder load ``_compat.py`` on its own (not the package, which imports
Chainer) and apply it, then the finder removes itself and the import goes
on as usual. ``uninstall`` removes the file; ``status`` says whether it is
there.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import List, Optional

PTH_NAME = "chainer_recompute_numpy2.pth"
_HERE = os.path.dirname(os.path.abspath(__file__))
_COMPAT = os.path.join(_HERE, "_compat.py")


class _BeforeChainer:
    """Applies the NumPy 2 compatibility layer right before Chainer is imported."""

    def __init__(self, compat_path: str) -> None:
        self.compat_path = compat_path

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name != "chainer":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if os.path.exists(self.compat_path):
            import importlib.util
            spec = importlib.util.spec_from_file_location("_chainer_recompute_compat",
                                                          self.compat_path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            module.ensure_numpy_compat()
        return None  # the usual finders import chainer


def register(compat_path: str = _COMPAT) -> None:
    """Put the finder on ``sys.meta_path`` (what the ``.pth`` file runs)."""
    # by name: the .pth file defines the class anew in a namespace of its own
    if "chainer" in sys.modules or any(type(f).__name__ == "_BeforeChainer"
                                       for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeChainer(compat_path))


def _pth_line() -> str:
    # Runs this file (not the package) at start-up, only if it still exists.
    here = os.path.abspath(__file__)
    return (f"import os, sys; p = {here!r}; "
            "os.path.exists(p) and exec(compile(open(p).read(), p, 'exec'), "
            "{'__name__': '_chainer_recompute_numpy2_hook', '__file__': p}) "
            "and None\n")


def pth_path(site_dir: Optional[str] = None) -> str:
    return os.path.join(site_dir or sysconfig.get_path("purelib"), PTH_NAME)


def install(site_dir: Optional[str] = None) -> str:
    """Write the ``.pth`` file; returns its path."""
    path = pth_path(site_dir)
    with open(path, "w") as f:
        f.write(_pth_line())
    return path


def uninstall(site_dir: Optional[str] = None) -> bool:
    path = pth_path(site_dir)
    if os.path.exists(path):
        os.remove(path)
        return True
    return False


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else "status"
    if cmd == "install":
        print(f"installed {install()}: 'import chainer' now works first on NumPy 2")
    elif cmd == "uninstall":
        print("removed" if uninstall() else "nothing to remove", pth_path())
    elif cmd == "status":
        print(("installed: " if os.path.exists(pth_path()) else "not installed: ") + pth_path())
    else:
        print("usage: python -m chainer_recompute._numpy2_hook [install|uninstall|status]",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
elif __name__ == "_chainer_recompute_numpy2_hook":  # run by the .pth file at start-up
    register()
