"""Reading and writing graphs: this project's JSON and the authors' format.

Pure core: no chainer import.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

from .errors import GraphError, GraphFormatError, SchemaVersionError
from .graph import ArrayInfo, Graph, HeldArray, Node, StepFacts, _topological_order

try:  # optional (the ``fast`` extra): reads the authors' attribute lines faster
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson_loads = None

#: Version 2 adds views (``view_of``), lifetimes (``dies_at``), measured
#: transient bytes, ``has_backward``, the recorded backward order and the
#: state bytes; version 1 files are still read (those fields absent). Later
#: optional fields (``made_at``, ``inner_params``, ``unrecorded_peak_bytes``)
#: read as absent from files that do not have them. Version 3 keeps the
#: step's facts (:class:`~chainer_recompute.core.graph.StepFacts`) in
#: ``step``, where earlier versions kept them among ``meta``'s notes (read
#: from there).
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PathLike = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------- JSON
def graph_to_dict(graph: Graph) -> Dict[str, Any]:
    def arr(a: ArrayInfo) -> Dict[str, Any]:
        return {"id": a.id, "shape": None if a.shape is None else list(a.shape),
                "dtype": a.dtype, "nbytes": a.nbytes, "kind": a.kind,
                "producer": a.producer, "name": a.name, "view_of": a.view_of,
                "dies_at": a.dies_at, "buffer_bytes": a.buffer_bytes, "made_at": a.made_at}

    def held(h: HeldArray) -> Dict[str, Any]:
        return {"name": h.name, "shape": None if h.shape is None else list(h.shape),
                "dtype": h.dtype, "nbytes": h.nbytes, "role": h.role}

    def node(n: Node) -> Dict[str, Any]:
        return {"id": n.id, "op": n.op, "inputs": list(n.inputs), "outputs": list(n.outputs),
                "retained_inputs": list(n.retained_inputs),
                "retained_outputs": list(n.retained_outputs),
                "held": [held(h) for h in n.held],
                "forward_time_s": n.forward_time_s, "backward_time_s": n.backward_time_s,
                "recomputable": n.recomputable, "label": n.label, "attrs": dict(n.attrs),
                "forward_transient_bytes": n.forward_transient_bytes,
                "backward_transient_bytes": n.backward_transient_bytes,
                "backward_alloc_bytes": n.backward_alloc_bytes,
                "has_backward": n.has_backward, "inner_params": list(n.inner_params),
                "unrecorded_peak_bytes": n.unrecorded_peak_bytes, "link": n.link,
                **({"must_keep": True} if n.must_keep else {})}

    return {"schema_version": SCHEMA_VERSION, "batch_size": graph.batch_size,
            "cost_model": graph.cost_model, "meta": graph.meta, "step": graph.step.as_dict(),
            "backward_order": (None if graph.backward_order is None
                               else list(graph.backward_order)),
            "arrays": [arr(a) for a in graph.arrays], "nodes": [node(n) for n in graph.nodes]}


def graph_from_dict(d: Dict[str, Any], source: str = "<dict>") -> Graph:
    version = d.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise SchemaVersionError(
            f"{source}: graph schema version {version!r}, but this chainer_recompute reads "
            f"versions {list(READABLE_VERSIONS)}; capture the graph again with this version")

    def shape(s: Optional[List[int]]) -> Optional[Tuple[int, ...]]:
        return None if s is None else tuple(int(x) for x in s)

    try:
        arrays = [ArrayInfo(id=a["id"], shape=shape(a["shape"]), dtype=a["dtype"],
                            nbytes=int(a["nbytes"]), kind=a["kind"], producer=a["producer"],
                            name=a.get("name", ""), view_of=a.get("view_of"),
                            dies_at=a.get("dies_at"), buffer_bytes=a.get("buffer_bytes"),
                            made_at=a.get("made_at"))
                  for a in d["arrays"]]
        nodes = [Node(id=n["id"], op=n["op"], inputs=tuple(n["inputs"]),
                      outputs=tuple(n["outputs"]),
                      retained_inputs=tuple(n.get("retained_inputs", ())),
                      retained_outputs=tuple(n.get("retained_outputs", ())),
                      held=tuple(HeldArray(h["name"], shape(h["shape"]), h["dtype"],
                                           int(h["nbytes"]), h.get("role", "state"))
                                 for h in n.get("held", ())),
                      forward_time_s=n.get("forward_time_s"),
                      backward_time_s=n.get("backward_time_s"),
                      recomputable=n.get("recomputable", True), label=n.get("label", ""),
                      attrs=n.get("attrs", {}),
                      forward_transient_bytes=n.get("forward_transient_bytes"),
                      backward_transient_bytes=n.get("backward_transient_bytes"),
                      backward_alloc_bytes=n.get("backward_alloc_bytes"),
                      has_backward=n.get("has_backward", True),
                      inner_params=tuple(n.get("inner_params", ())),
                      unrecorded_peak_bytes=int(n.get("unrecorded_peak_bytes", 0)),
                      link=str(n.get("link", "")),
                      must_keep=bool(n.get("must_keep", False)))
                 for n in d["nodes"]]
        step = StepFacts(**d["step"]) if "step" in d else None
    except (KeyError, TypeError) as e:
        raise GraphFormatError(source, None, f"missing or malformed field {e}") from None
    return Graph(arrays, nodes, batch_size=d.get("batch_size"),
                 cost_model=d.get("cost_model", "paper"), meta=d.get("meta", {}),
                 step=step,
                 backward_order=d.get("backward_order"))


def save_graph(graph: Graph, path: PathLike) -> None:
    """Write ``graph`` as JSON (schema version :data:`SCHEMA_VERSION`)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(graph_to_dict(graph), f)
    os.replace(tmp, path)


def load_graph(path: PathLike) -> Graph:
    """Read a graph written by :func:`save_graph`.

    Raises:
        GraphFormatError: the file is not valid JSON (names the line).
        SchemaVersionError: the file has another schema version.
    """
    source = os.fspath(path)
    with open(path) as f:
        text = f.read()
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphFormatError(source, e.lineno, f"not valid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise GraphFormatError(source, 1, "expected a JSON object with 'schema_version'")
    return graph_from_dict(d, source)


# ------------------------------------------------------- authors' format
class _Lines:
    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.i = 0

    def next(self, what: str) -> Tuple[int, str]:
        while self.i < len(self.lines) and not self.lines[self.i].strip():
            self.i += 1
        if self.i >= len(self.lines):
            raise GraphFormatError(self.path, len(self.lines) + 1,
                                   f"file ends early: expected {what} (truncated file?)")
        self.i += 1
        return self.i, self.lines[self.i - 1].strip()

    def ints(self, what: str, count: int) -> Tuple[int, List[str]]:
        lineno, line = self.next(what)
        parts = line.split()
        if len(parts) < count:
            raise GraphFormatError(self.path, lineno, f"expected {what}, found {line!r}")
        try:
            [int(p) for p in parts[:count]]
        except ValueError:
            raise GraphFormatError(self.path, lineno, f"expected {what}, found {line!r}") from None
        return lineno, parts

    def error(self, lineno: int, msg: str) -> GraphFormatError:
        return GraphFormatError(self.path, lineno, msg)


def load_authors_graph(path: PathLike) -> Graph:
    """Read a computational graph in the authors' text format
    (the ``cg_*.txt`` files of pfnet-research/recompute).

    Variables named ``_`` are intermediates, integers are model inputs and
    ``/...`` paths are parameters. Each ``forward`` record becomes a node;
    ``backward`` records are checked for shape but not otherwise used. The
    nodes are put in topological order (the file's records are not). The
    graph gets the ``paper`` cost model, as the authors used.

    Raises:
        GraphFormatError: a malformed or truncated file; the message names
            the line.

    >>> g = load_authors_graph('../shared/graphs/cg_vgg19.txt')  # doctest: +SKIP
    >>> g.n  # doctest: +SKIP
    46
    """
    source = os.fspath(path)
    with open(path) as f:
        text = f.read()
    try:
        # The common case, in few Python operations; anything unexpected
        # (a malformed file) is read again below for the error message.
        return _authors_graph(source, *_parse_authors_fast(text), _retry)
    except Exception:
        pass
    lines = _Lines(source, text)
    var_bytes, var_name, var_line, records = _parse_authors(lines)
    return _authors_graph(source, var_bytes, var_name, var_line, records, lines.error)


class _Retry(Exception):
    pass


def _retry(lineno: int, msg: str) -> Exception:
    return _Retry()


def _parse_authors_fast(text: str):
    """:func:`_parse_authors` for files laid out as the authors' tools write
    them (ASCII, tokens one space apart): raises on anything else, which
    the careful parser then reads or reports."""
    if not text.isascii() or any(c in text for c in _ODD_SPACE):
        raise _Retry()  # where str.split() or splitlines() would differ
    lines = text.split("\n")
    n_vars, n_recs = map(int, lines[0].split(" "))
    var_lines = lines[1:n_vars + 1]
    if n_vars < 0 or len(var_lines) != n_vars or any(x.count(" ") != 2 for x in var_lines):
        raise _Retry()
    tokens = " ".join(var_lines).split(" ")
    ids = list(map(int, tokens[0::3]))
    var_bytes: Dict[int, int] = dict(zip(ids, map(int, tokens[1::3])))
    var_name: Dict[int, str] = dict(zip(ids, tokens[2::3]))
    if len(var_bytes) != n_vars or not all(tokens[2::3]):
        raise _Retry()  # a variable defined twice, or a name missing
    texts: Dict[str, None] = {}  # every attribute line, once
    records = []
    refs: List[int] = []
    i = n_vars + 1
    for _ in range(n_recs):
        n_in, n_out = lines[i + 1].split(" ")
        a = i + 2
        b = a + int(n_in)
        j = b + int(n_out)
        if not a <= b <= j:
            raise _Retry()
        ins = [int(x.partition(" ")[0]) for x in lines[a:b]]
        outs = list(map(int, lines[b:j]))
        refs += ins
        refs += outs
        if not lines[j].strip() == lines[j] != "":
            raise _Retry()  # a blank or padded class name
        texts[lines[j + 1]] = None
        if lines[i] == "forward":
            records.append([i + 1, ins, outs, lines[j], lines[j + 1]])
        elif lines[i] != "backward":
            raise _Retry()
        i = j + 2
    if not var_bytes.keys() >= set(refs):
        raise _Retry()
    decoded = dict(zip(texts, _json_lines(list(texts))))
    if not all(type(d) is dict for d in decoded.values()):
        raise _Retry()
    for r in records:
        r[4] = decoded[r[4]]
    return var_bytes, var_name, None, records


#: Whitespace that the careful reader's ``str.split()`` and
#: ``splitlines()`` treat as a separator and the fast reader does not.
#: Blank or padded lines make the fast reader's int() or JSON or its
#: class-name check fail, or read to the same value.
_ODD_SPACE = "\r\t\x0b\x0c\x1c\x1d\x1e\x1f"


#: Digits to '0', to find integers that orjson would read as floats (it
#: keeps 64 bits) faster than a regular expression does.
_ZERO_DIGITS = str.maketrans("123456789", "000000000")


def _json_lines(texts: List[str]) -> List[Any]:
    """``json.loads`` of each line (raises on an invalid one); by orjson
    where it is installed (the ``fast`` extra) and gives the same values."""
    if _orjson_loads is not None and "0" * 19 not in "".join(texts).translate(_ZERO_DIGITS):
        return [_orjson_loads(t) for t in texts]
    return [json.loads(t) for t in texts]


def _parse_authors(lines: _Lines):
    """The variables (bytes, name, line) and the forward records (line,
    inputs, outputs, op, attributes) of an authors' file, checked line by
    line."""
    _, head = lines.ints("'N_VARIABLES N_FUNCTION_RECORDS'", 2)
    n_vars, n_recs = int(head[0]), int(head[1])
    var_bytes: Dict[int, int] = {}
    var_name: Dict[int, str] = {}
    var_line: Dict[int, int] = {}
    for _ in range(n_vars):
        lineno, parts = lines.ints("a variable line 'id bytes name'", 2)
        if len(parts) != 3:
            raise lines.error(lineno, f"expected a variable line 'id bytes name', found "
                                      f"{' '.join(parts)!r}")
        vid = int(parts[0])
        if vid in var_bytes:
            raise lines.error(lineno, f"variable {vid} is defined twice")
        var_bytes[vid], var_name[vid], var_line[vid] = int(parts[1]), parts[2], lineno
    records = []  # (lineno, inputs, outputs, op, attrs)
    for _ in range(n_recs):
        lineno, direction = lines.next("'forward' or 'backward'")
        if direction not in ("forward", "backward"):
            raise lines.error(lineno, f"expected 'forward' or 'backward', found {direction!r}")
        ln, parts = lines.ints("'n_in n_out'", 2)
        n_in, n_out = int(parts[0]), int(parts[1])
        ins, outs = [], []
        for _ in range(n_in):
            ln, parts = lines.ints("an input line 'var_id kind'", 1)
            ins.append((ln, int(parts[0])))
        for _ in range(n_out):
            ln, parts = lines.ints("an output line 'var_id'", 1)
            outs.append((ln, int(parts[0])))
        _, op = lines.next("a function class name")
        ln, attr_text = lines.next("a JSON attribute line")
        try:
            attrs = json.loads(attr_text)
        except json.JSONDecodeError as e:
            raise lines.error(ln, f"attributes are not valid JSON: {e.msg}") from None
        if not isinstance(attrs, dict):
            raise lines.error(ln, f"attributes must be a JSON object, found {attr_text!r}")
        for ln2, vid in ins + outs:
            if vid not in var_bytes:
                raise lines.error(ln2, f"refers to variable {vid}, which is not defined")
        if direction == "forward":
            records.append((lineno, [v for _, v in ins], [v for _, v in outs], op, attrs))
    return var_bytes, var_name, var_line, records


def _authors_graph(source: str, var_bytes: Dict[int, int], var_name: Dict[int, str],
                   var_line: Optional[Dict[int, int]], records: list, error) -> Graph:
    """The Graph of parsed authors' records (``error(lineno, msg)`` makes
    the exception for an inconsistent file)."""
    # Arrays: variables in id order.
    order_ids = sorted(var_bytes)
    array_of = dict(zip(order_ids, range(len(order_ids))))
    producer_rec = {v: r for r, rec in enumerate(records) for v in rec[2]}
    if len(producer_rec) != sum(len(rec[2]) for rec in records):
        seen: set = set()
        for lineno, _, outs, _, _ in records:
            for v in outs:
                if v in seen:
                    raise error(lineno, f"variable {v} is the output of two forward records")
                seen.add(v)
    rec_edges = {(producer_rec[v], r) for r, rec in enumerate(records) for v in rec[1]
                 if v in producer_rec}
    try:
        order = _topological_order(len(records), rec_edges)
    except GraphError as e:
        raise GraphFormatError(source, None, str(e)) from None
    node_of = dict(zip(order, range(len(order))))
    read = {v for rec in records for v in rec[1]}

    arrays = []
    new = object.__new__
    for i, vid in enumerate(order_ids):
        name = var_name[vid]
        r = producer_rec.get(vid)
        if name[0] == "/":
            kind = "param"
        elif name == "_":
            if r is None:
                raise error(None if var_line is None else var_line[vid],
                            f"intermediate variable {vid} is made by no forward record")
            kind = "intermediate" if vid in read else "output"
            name = ""
        else:
            kind = "input"
        a = new(ArrayInfo)
        a.__dict__.update(_ARRAY_DEFAULTS, id=i, nbytes=var_bytes[vid], kind=kind,
                          producer=None if r is None else node_of[r], name=name)
        arrays.append(a)
    nodes = []
    for v, r in enumerate(order):
        lineno, ins, outs, op, attrs = records[r]
        ins = tuple([array_of[x] for x in ins])
        outs = tuple([array_of[x] for x in outs])
        keep_in = _indexes(attrs, "_input_indexes_to_retain", lineno, error)
        keep_out = _indexes(attrs, "_output_indexes_to_retain", lineno, error)
        node = new(Node)
        node.__dict__.update(
            _NODE_DEFAULTS, id=v, op=op, inputs=ins, outputs=outs,
            retained_inputs=tuple([ins[i] for i in keep_in if i < len(ins)]),
            retained_outputs=tuple([outs[i] for i in keep_out if i < len(outs)]),
            label=f"record {r} (line {lineno})", attrs=attrs)
        nodes.append(node)
    return Graph(arrays, nodes, cost_model="paper",
                 meta={"model": os.path.basename(source), "source": source})


def _defaults(cls, **given: Any) -> Dict[str, Any]:
    """The plain defaults of the frozen dataclass ``cls``'s fields, and
    ``given``. The reader above fills each object's ``__dict__`` from these
    and its values (the class's ``__init__`` sets each field through
    ``object.__setattr__``: 3x slower, for thousands of objects in a large
    file); :class:`Graph` checks the values."""
    out = {f.name: f.default for f in dataclasses.fields(cls)
           if f.default is not dataclasses.MISSING}
    out.update(given)
    return out


#: An authors' file gives no shapes or dtypes.
_ARRAY_DEFAULTS = _defaults(ArrayInfo, shape=None, dtype="")
_NODE_DEFAULTS = _defaults(Node)


def _indexes(attrs: Dict[str, Any], key: str, lineno: int, error) -> Any:
    """A record's list of retained input or output indexes (``null``: none)."""
    got = attrs.get(key)
    if not got:
        return ()
    if type(got) is not list or not all(type(i) is int and i >= 0 for i in got):
        raise error(lineno, f"the record's {key} must be a list of indexes or null, found "
                            f"{got!r}")
    return got
