"""``keep=``: the functions whose outputs no plan drops.

Pure core: no chainer. The policy is parsed once, where the user gives it
(:func:`parse_keep`), into a :class:`KeepPolicy`; marking a recorded graph
with it (:meth:`KeepPolicy.mark`) sets :attr:`~.graph.Node.must_keep` on the
functions it names, and every solver honours those marks (see
:func:`~.lower_sets.boundary`).

A policy is link paths, as ``Link.namedlinks()`` names them
(``'/predictor/res5'``: every function applied by that link or a link
under it, by :attr:`~.graph.Node.link`), and predicates on the recorded
functions (a callable taking a :class:`~.graph.Node`, which has ``op``,
``link`` and ``label``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, List, Tuple

from .errors import GraphError, KeepError
from .graph import Graph, Node

__all__ = ["KeepPolicy", "parse_keep", "with_must_keep", "FORMS"]

#: What ``keep=`` accepts, as error messages say it.
FORMS = ("a link path as namedlinks() names it ('/predictor/res5'), a list of them, or a "
         "function taking a recorded function (its .op, .link, .label) and returning True "
         "for those to keep")


def with_must_keep(graph: Graph, nodes: Iterable[int]) -> Graph:
    """``graph`` with exactly ``nodes`` marked :attr:`~.graph.Node.must_keep`
    (``graph`` itself when they are already).

    Raises:
        GraphError: a node id that is not in the graph.

    >>> g = Graph.from_edges([4, 4, 4], [(0, 1), (1, 2)])
    >>> sorted(with_must_keep(g, {1}).must_keep), with_must_keep(g, ()) is g
    ([1], True)
    """
    import dataclasses
    want = frozenset(int(v) for v in nodes)
    if any(not 0 <= v < graph.n for v in want):
        raise GraphError(f"must_keep names nodes {sorted(want)[:5]}, but the graph has "
                         f"nodes 0..{graph.n - 1}")
    if want == graph.must_keep:
        return graph
    return graph.replace(nodes=[dataclasses.replace(n, must_keep=n.id in want)
                                for n in graph.nodes])


def _path(text: str) -> str:
    """A link path in namedlinks()' form: a leading ``/``, no trailing one."""
    p = "/" + text.strip().strip("/")
    return p


@dataclass(frozen=True)
class KeepPolicy:
    """Which recorded functions every plan keeps (see module doc).

    Attributes:
        paths: link paths (``'/'`` is the model itself: every function
            applied inside it).
        predicates: callables on :class:`~.graph.Node`.

    >>> from chainer_recompute.core.graph import Graph
    >>> g = Graph.from_edges([4, 4], [(0, 1)], ops=['Linear', 'ReLU'])
    >>> sorted(parse_keep(lambda node: node.op == 'ReLU').nodes(g))
    [1]
    """

    paths: Tuple[str, ...] = ()
    predicates: Tuple[Callable[[Node], Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.paths or self.predicates)

    def matches(self, node: Node) -> bool:
        """Whether ``node``'s outputs are kept by this policy.

        Raises:
            KeepError: a predicate raised (the message names the function).
        """
        link = node.link
        if link:
            for p in self.paths:
                if link == p or link.startswith(p + "/") or (p == "/" and link.startswith("/")):
                    return True
        for f in self.predicates:
            try:
                if f(node):
                    return True
            except Exception as e:  # noqa: BLE001 - the user's function: said with its input
                raise KeepError(f"the keep= function {getattr(f, '__name__', f)!r} raised "
                                f"{type(e).__name__}: {e} on function #{node.id} ({node.op}, "
                                f"link {node.link or 'unknown'!r}); it takes a recorded "
                                f"function, with .op, .link and .label") from e
        return False

    def nodes(self, graph: Graph) -> FrozenSet[int]:
        """The nodes of ``graph`` this policy keeps."""
        if not self:
            return frozenset()
        return frozenset(v for v, node in enumerate(graph.nodes) if self.matches(node))

    def mark(self, graph: Graph) -> Graph:
        """``graph`` with :attr:`~.graph.Node.must_keep` set on exactly
        :meth:`nodes` (itself when they are marked already; no policy:
        ``graph`` as it is)."""
        if not self:
            return graph
        return with_must_keep(graph, self.nodes(graph))

    def check_names(self, names: Iterable[str], where: str = "the model",
                    option: str = "keep=") -> None:
        """Refuse a path that names none of ``names`` (a model's
        ``namedlinks()`` paths), with the closest names.

        Raises:
            KeepError: a path names no link.

        >>> KeepPolicy(('/predictor/res6',)).check_names(['/', '/predictor', '/predictor/res5'])
        Traceback (most recent call last):
        ...
        chainer_recompute.core.errors.KeepError: keep= names '/predictor/res6', which is no link of the model; the closest: '/predictor/res5', '/predictor'
        """
        known = sorted(set(names))
        for p in self.paths:
            if p == "/" or p in known:
                continue
            close = difflib.get_close_matches(p, known, n=3, cutoff=0.5)
            if close:
                hint = "the closest: " + ", ".join(repr(c) for c in close)
            else:
                top = [k for k in known if k.count("/") == 1 and k != "/"][:8]
                hint = ("its links: " + ", ".join(repr(k) for k in top)) if top else \
                    "it has no links under it"
            raise KeepError(f"{option} names {p!r}, which is no link of {where}; {hint}")

    def check_graph(self, graph: Graph, option: str = "keep=") -> None:
        """Refuse a path that names no link of ``graph``'s recorded
        functions (for a model whose ``namedlinks()`` are not known: a
        plain callable), with the closest names.

        Raises:
            KeepError: a path names no recorded link, or the graph records
                none (functions applied outside any Link).
        """
        if not self.paths:
            return
        names = set()
        for node in graph.nodes:
            link = node.link
            while link and link not in names:  # the link and every link above it
                names.add(link)
                link = link.rsplit("/", 1)[0]
        if not names:
            raise KeepError(f"{option} names {', '.join(repr(p) for p in self.paths)}, but the "
                            f"recorded functions were applied outside any Link (or the graph "
                            f"does not record links); keep= takes a function on the recorded "
                            f"functions instead (.op, .label)")
        self.check_names(names, "the recorded model", option)

    def describe(self) -> str:
        """The policy in a few words (for a log line)."""
        parts = [repr(p) for p in self.paths] + [getattr(f, "__name__", "a function")
                                                 for f in self.predicates]
        return ", ".join(parts) if parts else "nothing"


def parse_keep(value: Any) -> KeepPolicy:
    """``keep=`` as given (``None``, a path, a callable, a list or tuple of
    paths and callables, or a :class:`KeepPolicy`) as a policy.

    Raises:
        KeepError: anything else (the message lists the forms).

    >>> parse_keep(['predictor/res5/', '/attn']).paths
    ('/predictor/res5', '/attn')
    >>> parse_keep(None)
    KeepPolicy(paths=(), predicates=())
    """
    if value is None:
        return KeepPolicy()
    if isinstance(value, KeepPolicy):
        return value
    items: List[Any] = [value] if isinstance(value, str) or callable(value) else None  # type: ignore
    if items is None:
        if isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        else:
            raise KeepError(f"keep= got {type(value).__name__} {value!r}; accepted: {FORMS}")
    paths: List[str] = []
    preds: List[Callable[[Node], Any]] = []
    for item in items:
        if isinstance(item, str):
            if not item.strip():
                raise KeepError(f"keep= got an empty path; accepted: {FORMS}")
            p = _path(item)
            if p not in paths:
                paths.append(p)
        elif callable(item):
            preds.append(item)
        else:
            raise KeepError(f"keep= got {type(item).__name__} {item!r} in its list; "
                            f"accepted: {FORMS}")
    return KeepPolicy(tuple(paths), tuple(preds))
