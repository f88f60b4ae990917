"""Which Link applies each recorded function (``Node.link``):
:class:`LinkPaths`, a ``chainer.LinkHook`` the
:class:`~chainer_recompute.runtime.capture.recorder.Recorder` registers
with itself."""
from __future__ import annotations

from typing import Any, List, Optional

from .. import _chainer  # noqa: F401  (NumPy 2 compatibility before chainer)
import chainer


class LinkPaths(chainer.LinkHook):
    """The path of the innermost Link whose forward is running: a Link of
    ``root`` by its ``namedlinks()`` path (``/predictor/res2/a/conv1``;
    ``'/'`` for ``root`` itself), any other by its caller's path and its
    ``name`` (or class name); ``''`` outside every Link.

    >>> import chainer.links as L, numpy as np
    >>> seen = []
    >>> class Probe(chainer.FunctionHook):
    ...     name = 'probe'
    ...     def forward_preprocess(self, function, in_data):
    ...         seen.append(paths.current)
    >>> model = chainer.Sequential(L.Linear(3, 2))
    >>> with LinkPaths(model) as paths, Probe():
    ...     _ = model(np.ones((1, 3), np.float32))
    >>> seen
    ['/0']
    """

    def __init__(self, root: Optional[chainer.Link] = None) -> None:
        self.name = f"chainer_recompute-links-{id(self):x}"
        self._paths = {id(l): path for path, l in root.namedlinks()} if root is not None else {}
        self._stack: List[str] = []

    @property
    def current(self) -> str:
        return self._stack[-1] if self._stack else ""

    def forward_preprocess(self, args: Any) -> None:
        path = self._paths.get(id(args.link))
        if path is None:
            name = getattr(args.link, "name", None) or type(args.link).__name__
            path = f"{self.current.rstrip('/')}/{name}"
        self._stack.append(path)

    def forward_postprocess(self, args: Any) -> None:
        if self._stack:
            self._stack.pop()
