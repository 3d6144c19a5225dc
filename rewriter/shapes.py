"""From a model to a `Graph`: user input shapes applied, every tensor's dtype and shape inferred,
constants collected, producer/consumer links built.

Symbolic dims are strings: exporter names ("batch_size"), expressions made by symbolic inference
("2*sequence_length", "unk__3"), and "unk_<n>" for dims nobody named. `sym_hints` gives each a typical
value for the cost model: 1 for batch-like dims (name contains "batch", or axis 0 of a graph input of
rank >= 2), 128 for the rest; expressions are evaluated from the hints of their symbols.
"""
from __future__ import annotations

import itertools
import re
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from ortfuse.errors import InputError
from ortfuse.rewriter import _infer, _proto, weights
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo, per_graph

BATCH_HINT = 1
THROUGHPUT_BATCH = 32  # the second batch size a fusion must pay at when the batch is symbolic (search.cost)
DEFAULT_HINT = 128
_SYMPY_FUNCS = ("Min", "Max", "floor", "ceiling", "Mod", "Abs")  # what symbolic_shape_infer writes
_SAFE_EXPR = re.compile(r"[A-Za-z0-9_+\-*/(), ]+")
_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_input_shapes(specs: Iterable[str]) -> dict[str, tuple[Dim, ...]]:
    """["input_ids:1x128", "mask:Bx128", "x:1,3,224,224", "scalar:"] -> {name: dims}. Dims are
    separated by "x" (or "," when the spec has one, so names containing "x" still work); a dim is a
    non-negative int or a name. The name ends at the last ":" (TF-style names like "x:0" work)."""
    shapes: dict[str, tuple[Dim, ...]] = {}
    for spec in specs:
        name, sep, dims_text = spec.rpartition(":")
        if not sep or not name:
            raise InputError(f"input shape '{spec}': expected NAME:DIMS, e.g. input_ids:1x128")
        if name in shapes:
            raise InputError(f"input shape '{spec}': input '{name}' given twice")
        parts = dims_text.split("," if "," in dims_text else "x") if dims_text.strip() else []
        shapes[name] = tuple(_parse_dim(p.strip(), spec) for p in parts)
    return shapes


def _parse_dim(text: str, spec: str) -> Dim:
    if text.isdigit():
        return int(text)
    if _DIM_NAME.fullmatch(text):
        return text
    raise InputError(f"input shape '{spec}': bad dim '{text}' (want a non-negative int or a name)")


def build_graph(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[Dim, ...]] | None = None,
                hint_overrides: Mapping[str, int] | None = None) -> Graph:
    """A shape-inferred Graph over a private copy of `model` (which is left untouched); `hint_overrides`: the
    user's typical values of symbolic dims for the cost model (the shapes stay symbolic)."""
    m = _proto.copy_model(model)
    opset = _proto.opset_of(m)
    if opset is None:
        raise InputError("model: no opset import for the default ONNX domain")
    try:
        _proto.sort_nodes(m.graph)
    except ValueError as e:
        raise InputError(f"model: {e}") from None
    _apply_input_shapes(m.graph, dict(input_shapes or {}))
    _name_input_dims(m.graph)
    try:
        inferred = _infer.infer_value_infos(m)
    except _infer.ShapeInferenceError as e:
        raise InputError(f"model: shape inference failed: {e}") from None
    return assemble(m, _record_value_infos(m, inferred), opset, hint_overrides)


@per_graph
def merged_sizes(g: Graph) -> frozenset[int]:
    """Sizes other than 1 that symbolic inference merged a symbolic dim into (`_infer.recorded_merges`): a
    tensor inferred with such a size may have 1 there at run time."""
    return frozenset(v for v in _infer.recorded_merges(g.model).values() if isinstance(v, int) and v != 1)


@per_graph
def minted_dims(g: Graph) -> frozenset[str]:
    """Dims shape inference minted because it could not compute them (`_infer.MINTED` names, or expressions of
    them)."""
    return frozenset(d for t in g.tensors.values() for d in t.shape or ()
                     if isinstance(d, str) and _infer.MINTED.search(d))


@per_graph
def merges_into_sizes(g: Graph) -> dict[str, int]:
    """{symbol: the size other than 1 symbolic inference merged it into}, through names merged into names
    (`_infer.recorded_merges`)."""
    merges, out = _infer.recorded_merges(g.model), {}
    for sym, into in merges.items():
        seen = {sym}
        while isinstance(into, str) and into in merges and into not in seen:  # merged into a name merged on
            seen.add(into)
            into = merges[into]
        if isinstance(into, int) and into != 1:
            out[sym] = into
    return out


def _origins(sym: str, merges: Mapping[str, object], minted: Mapping[str, str],
             declared: Mapping[str, list[str]]) -> set[str] | None:
    """The minted or declared symbols a tensor carrying `sym` may have got it from: sym itself, the names in it
    (an expression: Min(8, t)), and every symbol inference merged into one of those by name (X -> t: a tensor
    minted X, now t, meets Min(8, t) through a Slice). None where one is neither (of no known origin)."""
    merged_into: dict[str, list[str]] = {}
    for s, into in merges.items():
        if isinstance(into, str):
            merged_into.setdefault(into, []).append(s)
    base: set[str] = set()
    todo, seen = [sym], set()
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        todo.extend(merged_into.get(s, ()))
        if s in minted or s in declared:
            base.add(s)
            continue
        parts = dim_names(s, declared)
        if not parts or parts == {s}:
            return None
        todo.extend(parts)
    return base


@per_graph
def merge_tainted(g: Graph) -> frozenset[str] | None:
    """Tensors whose shape may carry a size a symbolic dim was merged into (`merged_sizes`): the outputs of the
    nodes that minted such a symbol (or a symbol in such an expression: SAM's window un-partition slices a padded
    tensor to Min(8, minted); or one merged into those by name: `_origins`), graph inputs declaring one, and
    everything computed from them. A tensor
    outside this set has its static dims from inference without that merge (MobileViT's conv outputs, static
    from the image size, though other tensors' merged symbols took the same sizes). None where a merged
    symbol is neither (then every tensor is suspect)."""
    minted = _infer.minted_by(g.model)
    seeds: set[str] = set()
    declared: dict[str, list[str]] = {}  # symbol -> every graph input declaring it
    for vi in g.model.graph.input:
        for d in {x.dim_param for x in _dims_of(vi) or [] if x.dim_param}:
            declared.setdefault(d, []).append(vi.name)
    for sym in merges_into_sizes(g):
        names = _origins(sym, _infer.recorded_merges(g.model), minted, declared)
        if names is None:
            return None
        for name in names:
            if minted.get(name) and minted[name] in g.tensors:
                seeds.add(minted[name])
            elif name in declared:
                seeds.update(declared[name])
            else:
                return None  # minted for a tensor the folds removed
    return frozenset(g.downstream(seeds))


def assemble(m: onnx.ModelProto, tensors: Mapping[str, TensorInfo], opset: int,
             hint_overrides: Mapping[str, int] | None = None) -> Graph:
    """The Graph's links and constants over an already shape-inferred model `m` (taken, not copied)."""
    weights.set_aside(m)  # a rewrite's new weights join the store of the model's others (if it has one)
    nodes = tuple(m.graph.node)
    init_names = {t.name for t in m.graph.initializer}
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in dict.fromkeys(_proto.node_reads(n)):
            consumers.setdefault(x, []).append(i)
    inputs = tuple(v.name for v in m.graph.input if v.name not in init_names)
    return Graph(
        model=m, tensors=tensors, constants=Constants(m.graph), nodes=nodes, producer=producer,
        consumers={k: tuple(v) for k, v in consumers.items()}, graph_inputs=inputs,
        graph_outputs=tuple(v.name for v in m.graph.output), opset=opset,
        sym_hints=sym_hints(tensors, inputs, overrides=hint_overrides), hint_overrides=dict(hint_overrides or {}),
        store=weights.store_of(m),
    )


# ---- user input shapes -------------------------------------------------------------------------------

def _dims_of(vi: onnx.ValueInfoProto) -> list[onnx.TensorShapeProto.Dimension] | None:
    tt = vi.type.tensor_type
    return list(tt.shape.dim) if tt.HasField("shape") else None


def _apply_input_shapes(graph: onnx.GraphProto, shapes: dict[str, tuple[Dim, ...]]) -> None:
    """Set user shapes on graph inputs. A symbolic dim given a value is bound everywhere it appears on
    a graph input, so "input_ids:1x128" also fixes attention_mask's [batch, seq]."""
    inits = {t.name for t in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in inits}
    bound: dict[str, tuple[int, str]] = {}  # symbol -> (value, the input that fixed it)
    for name, dims in shapes.items():
        vi = inputs.get(name)
        if vi is None:
            known = ", ".join(inputs) or "none"
            raise InputError(f"input shape for '{name}': the model has no such input (inputs: {known})")
        if vi.type.WhichOneof("value") != "tensor_type":
            raise InputError(f"input shape for '{name}': the input is not a tensor")
        _check_against_declared(name, dims, _dims_of(vi), bound)
    for vi in inputs.values():
        declared = _dims_of(vi)
        if vi.name in shapes:
            _set_dims(vi, shapes[vi.name])
        elif declared is not None:
            for d in declared:
                if d.dim_param in bound:
                    d.dim_value = bound[d.dim_param][0]  # setting the value clears dim_param (oneof)


def _check_against_declared(name: str, dims: tuple[Dim, ...], declared, bound: dict) -> None:
    if declared is None:
        return
    if len(dims) != len(declared):
        raise InputError(f"input shape for '{name}': rank {len(dims)} given, the model declares rank "
                         f"{len(declared)}")
    for axis, (want, d) in enumerate(zip(dims, declared)):
        if d.HasField("dim_value") and want != d.dim_value:
            raise InputError(f"input shape for '{name}': dim {axis} is {d.dim_value} in the model, "
                             f"{want} given")
        if d.dim_param and isinstance(want, int):
            seen = bound.setdefault(d.dim_param, (want, name))
            if seen[0] != want:
                raise InputError(f"input shape for '{name}': dim {axis} ('{d.dim_param}') is {want}, but "
                                 f"'{seen[1]}' sets '{d.dim_param}' to {seen[0]}")


def _set_dims(vi: onnx.ValueInfoProto, dims: tuple[Dim, ...]) -> None:
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        if isinstance(d, int):
            shape.dim.add(dim_value=d)
        else:
            shape.dim.add(dim_param=d)


def _name_input_dims(graph: onnx.GraphProto) -> None:
    """Name anonymous graph-input dims before inference so each propagates as its own symbol."""
    for vi in graph.input:
        for axis, d in enumerate(_dims_of(vi) or []):
            if not d.HasField("dim_value") and not d.dim_param:
                d.dim_param = f"{re.sub(r'[^A-Za-z0-9_]', '_', vi.name)}_dim{axis}"


# ---- inferred types into the model and TensorInfos ---------------------------------------------------

def _record_value_infos(m: onnx.ModelProto, inferred: dict[str, onnx.ValueInfoProto]) -> dict[str, TensorInfo]:
    """TensorInfo for every graph input, initializer and node output; the model's value_info is
    rewritten to match (anonymous dims named), and graph outputs lacking a type or shape are filled."""
    g = m.graph
    taken = {d for vi in inferred.values() for d in _sym_names(vi)}
    fresh = (f"unk_{k}" for k in itertools.count() if f"unk_{k}" not in taken)
    declared = {vi.name: vi for vi in [*g.value_info, *g.output, *g.input]}
    tensors: dict[str, TensorInfo] = {}
    for t in g.initializer:
        tensors[t.name] = TensorInfo(t.name, t.data_type, tuple(int(d) for d in t.dims))
    node_outputs = [o for n in g.node for o in n.output if o]
    records: dict[str, onnx.ValueInfoProto] = {}
    for name in [vi.name for vi in g.input if vi.name not in tensors] + node_outputs:
        vi = onnx.ValueInfoProto(name=name)
        source = inferred.get(name, declared.get(name))
        if source is not None:
            vi.CopyFrom(source)
        tensors[name] = _tensor_info(vi, fresh)
        records[name] = vi
    outputs = {v.name for v in g.output}
    del g.value_info[:]
    g.value_info.extend(records[o] for o in node_outputs if o not in outputs)
    suspect = any(isinstance(v, int) and v != 1 for v in _infer.recorded_merges(m).values())
    for out in g.output:
        if out.name in records:
            _fill_gaps(out, records[out.name], suspect)
    return tensors


def _fill_gaps(declared: onnx.ValueInfoProto, inferred: onnx.ValueInfoProto, suspect: bool) -> None:
    """Keep a graph output's declared type; fill only what the exporter left out (shape, anonymous dims), but
    with no static size other than 1 where inference merged a symbolic dim into a size (`suspect`): such a
    size, or one built from it, may be 1 or another value at run time, and ORT takes a declared output shape
    as a fact (its Expand elimination dropped an Expand that broadcast such a dim)."""
    if declared.type.WhichOneof("value") != "tensor_type" or inferred.type.WhichOneof("value") != "tensor_type":
        return
    have, got = _dims_of(declared), _dims_of(inferred)
    if have is None:
        declared.type.CopyFrom(inferred.type)
        for d in _dims_of(declared) or []:
            if suspect and d.HasField("dim_value") and d.dim_value != 1:
                d.Clear()
    elif got is not None and len(have) == len(got):
        for d, e in zip(have, got):
            if not d.HasField("dim_value") and not d.dim_param and \
                    not (suspect and e.HasField("dim_value") and e.dim_value != 1):
                d.CopyFrom(e)


def _sym_names(vi: onnx.ValueInfoProto) -> Iterator[str]:
    for d in _dims_of(vi) or []:
        if d.dim_param:
            yield d.dim_param


def _tensor_info(vi: onnx.ValueInfoProto, fresh: Iterator[str]) -> TensorInfo:
    """dtype 0 and shape None for non-tensor values (sequences, maps) and tensors of unknown rank."""
    if vi.type.WhichOneof("value") != "tensor_type":
        return TensorInfo(vi.name, onnx.TensorProto.UNDEFINED, None)
    dims = _dims_of(vi)
    if dims is not None:
        for d in dims:
            if not d.HasField("dim_value") and not d.dim_param:
                d.dim_param = next(fresh)
        shape: tuple[Dim, ...] | None = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims)
    else:
        shape = None
    return TensorInfo(vi.name, vi.type.tensor_type.elem_type, shape)


# ---- constants ---------------------------------------------------------------------------------------

class Constants(Mapping[str, np.ndarray]):
    """Initializers and Constant-node outputs, converted to numpy on first access (a >2 GB model's
    weights are not duplicated unless someone reads them; a weight store's are read-only views of it)."""

    def __init__(self, graph: onnx.GraphProto):
        self._sources: dict[str, onnx.TensorProto | onnx.NodeProto] = {t.name: t for t in graph.initializer}
        for n in graph.node:
            if n.op_type == "Constant" and n.domain in _proto.DEFAULT_DOMAINS and n.output:
                self._sources[n.output[0]] = n
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            src = self._sources[name]
            self._cache[name] = (weights.array_of(src) if isinstance(src, onnx.TensorProto)
                                 else constant_value(src))
        return self._cache[name]

    def size_of(self, name: str) -> int:
        """Constant `name`'s element count, from its dims where it is an initializer (not converted)."""
        src = self._sources[name]
        if name not in self._cache and isinstance(src, onnx.TensorProto):
            return int(np.prod(src.dims, dtype=np.int64))
        return int(self[name].size)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value of a Constant node, whichever attribute holds it."""
    attr = node.attribute[0]
    kind = attr.name
    if kind == "value":
        return numpy_helper.to_array(attr.t)
    if kind == "sparse_value":
        return _dense(attr.sparse_tensor)
    scalars = {"value_float": (attr.f, np.float32), "value_int": (attr.i, np.int64),
               "value_string": (attr.s, object)}
    if kind in scalars:
        v, dt = scalars[kind]
        return np.array(v, dtype=dt)
    lists = {"value_floats": (attr.floats, np.float32), "value_ints": (attr.ints, np.int64),
             "value_strings": (attr.strings, object)}
    if kind in lists:
        v, dt = lists[kind]
        return np.array(list(v), dtype=dt)
    raise InputError(f"Constant node '{node.name or node.output[0]}': unknown attribute '{kind}'")


def _dense(sp: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(sp.values)
    indices = numpy_helper.to_array(sp.indices)
    out = np.zeros(tuple(sp.dims), dtype=values.dtype)
    if indices.ndim == 1:  # linearized indices
        out.reshape(-1)[indices] = values
    else:
        out[tuple(indices.T)] = values
    return out


# ---- symbolic dim hints ------------------------------------------------------------------------------

def sym_hints(tensors: Mapping[str, TensorInfo], graph_inputs: Iterable[str], batch: int = BATCH_HINT,
              overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """Typical values of the symbolic dims: `batch` for batch-like ones (named so, or leading a graph
    input), DEFAULT_HINT for others, `overrides` (the user's) where given, expressions evaluated from those.
    Base names are identifiers or any name a graph input declares (exporters write names like
    "p2o.DynamicDimension.0")."""
    batch_like = _batch_like(tensors, graph_inputs)
    names = {d for t in tensors.values() for d in t.shape or () if isinstance(d, str)}
    declared = {d for name in graph_inputs for d in tensors[name].shape or () if isinstance(d, str)}
    base = {n: _base_hint(n, batch_like, batch) for n in names
            if _DIM_NAME.fullmatch(n) or (n in declared and not is_dim_expression(n))}
    base.update({n: v for n, v in (overrides or {}).items() if n in base})  # (checked once: check_dim_hints)
    return {n: base[n] if n in base else _expr_hint(n, base, batch_like, batch) for n in sorted(names)}


MAX_DIM_HINT = 1 << 20  # a typical value's bound: the cost model's int64 products of dims stay exact


def _batch_like(tensors: Mapping[str, TensorInfo], graph_inputs: Iterable[str]) -> set[str]:
    """The symbolic dims leading a graph input of rank 2 or more."""
    return {t.shape[0] for name in graph_inputs if (t := tensors[name]).shape and len(t.shape) >= 2
            and isinstance(t.shape[0], str)}


def hints_at_batch(g: Graph, batch: int) -> dict[str, int]:
    """g's hints with its batch-like dims at `batch` (the user's hints for other dims kept, for the batch given
    way): the throughput binding of `cost.bindings` and of `--profile-batch`."""
    like = _batch_like(g.tensors, g.graph_inputs)
    keep = {n: v for n, v in g.hint_overrides.items() if not _is_batch(n, like)}
    return sym_hints(g.tensors, g.graph_inputs, batch, keep)


def check_dim_hints(g: Graph) -> None:
    """The user's hints (`build_graph`'s hint_overrides) name symbolic dims of g's inputs, each an int in
    [1, MAX_DIM_HINT]."""
    names = {d for t in g.graph_inputs for d in g.tensors[t].shape or () if isinstance(d, str)
             and not is_dim_expression(d)}
    for n, v in g.hint_overrides.items():
        if n not in names:
            known = ", ".join(sorted(names)) or "none"
            raise InputError(f"--dim-hint {n}={v}: '{n}' is not a symbolic dim of the model's inputs (they have: "
                             f"{known})")
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_DIM_HINT:
            raise InputError(f"--dim-hint {n}={v}: a typical value is an integer from 1 to {MAX_DIM_HINT}")


def is_dim_expression(text: str) -> bool:
    """A dim name that is arithmetic on other names ("past + seq", "2*sequence_length"), not a name of its own
    ("p2o.DynamicDimension.0", "seq-len")."""
    return bool(re.search(r"[+*/()]|\s-\s", text))


def _is_batch(name: str, batch_like: set[str]) -> bool:
    return "batch" in name.lower() or name in batch_like


def _base_hint(name: str, batch_like: set[str], batch: int = BATCH_HINT) -> int:
    return batch if _is_batch(name, batch_like) else DEFAULT_HINT


def dim_names(text: str, known: Iterable[str] = ()) -> frozenset[str]:
    """The dim names an inferred dim expression reads ("past + seq": past and seq): the names of `known` it
    mentions, identifiers or not ("p2o.DynamicDimension.1"), and its other identifiers but the functions
    symbolic inference writes."""
    odd = sorted((n for n in known if not _DIM_NAME.fullmatch(n)), key=len, reverse=True)
    found: set[str] = set()
    if odd:
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, odd)) + r")(?![\w.])")
        found |= set(pattern.findall(text))
        text = pattern.sub(" ", text)
    return frozenset(found | (set(_DIM_NAME.findall(text)) - set(_SYMPY_FUNCS)))


def _expr_hint(text: str, base: Mapping[str, int], batch_like: set[str], batch: int = BATCH_HINT) -> int:
    """Evaluate an expression like "2*sequence_length" with its symbols at their hints, at most MAX_DIM_HINT (a
    product of six minted dims over 1024, SAM's windows before session 46, came to 2^34)."""
    value = eval_dim(text, base, lambda name: _base_hint(name, batch_like, batch))
    return min(value, MAX_DIM_HINT) if value is not None and value > 0 else DEFAULT_HINT


def eval_dim(text: str, known: Mapping[str, int], default: Callable[[str], int]) -> int | None:
    """The value of a dim expression ("past_sequence_length + 1", "2*floor(seq/2)") with the names of `known`
    at their values and any other identifier at default(name); None where `text` is not plain arithmetic."""
    # known names that are not identifiers ("p2o.DynamicDimension.1") become placeholders first
    odd = sorted((n for n in known if not _DIM_NAME.fullmatch(n)), key=len, reverse=True)
    values: dict[str, int] = {}
    if odd:
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, odd)) + r")(?![\w.])")

        def placeholder(m: re.Match) -> str:
            key = f"_ofz_dim{odd.index(m.group(1))}"
            values[key] = known[m.group(1)]
            return key
        text = pattern.sub(placeholder, text)
    # dim names come from the model file and sympify evaluates Python: accept arithmetic only, with
    # every identifier bound to a Symbol (or a whitelisted function), and no "**" (huge powers hang)
    if not _SAFE_EXPR.fullmatch(text) or "**" in text:
        return None
    try:
        # every identifier is a Symbol: names like "sequence" or "N" must not resolve to sympy objects
        names = {n: sympy.Symbol(n) for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)}
        names.update({f: getattr(sympy, f) for f in _SYMPY_FUNCS if f in names})
        expr = sympy.sympify(text, locals=names)
        return int(expr.subs({s: values[s.name] if s.name in values else known[s.name] if s.name in known
                              else default(s.name) for s in expr.free_symbols}))
    except (sympy.SympifyError, TypeError, ValueError, AttributeError, SyntaxError):
        return None
