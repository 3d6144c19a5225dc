"""Protobuf-level helpers shared by load, shapes and replace: copies, reads, topological order, IR
version, and checks that also work for models over the 2 GB protobuf limit."""
from __future__ import annotations

import contextlib
import functools
import heapq
import os
import tempfile
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import onnx
from google.protobuf.message import EncodeError

from ortfuse.rewriter import weights as _weights

# Protobuf refuses to serialize a message of 2 GiB or more. A module attribute (not a constant folded
# into callers) so tests can lower it and exercise the large-model paths with tiny models.
PROTOBUF_LIMIT = 2**31 - 1

# Functions need IR >= 8; ONNX Runtime 1.31 reads IR <= 13 while onnx 1.23 writes 14 by default.
MIN_IR_VERSION = 8
MAX_IR_VERSION = 13

DEFAULT_DOMAINS = ("", "ai.onnx")


_PACKED_4BIT = frozenset({onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1})


def is_large(model: onnx.ModelProto) -> bool:
    """Whether `model` serializes to the protobuf limit or more. ByteSize() serializes, copying every weight:
    it is asked only where a bound that counts the weights' raw bytes from their dims comes near the limit."""
    if _size_bound(model) < PROTOBUF_LIMIT - 2**24:
        return False
    # a stub's bytes come back as raw_data: its tag, length and the tensor's longer length cost under 16 bytes
    return _byte_size(model) + sum(tensor_bytes(t) + 16 for t in _weights.stubs(model)) >= PROTOBUF_LIMIT


def _byte_size(model: onnx.ModelProto) -> int:
    """model.ByteSize(), which raises (upb: "Failed to serialize proto") from 2 GiB on: then the limit itself."""
    try:
        return model.ByteSize()
    except EncodeError:
        return PROTOBUF_LIMIT


_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def fixed_size(data_type: int) -> bool:
    return data_type not in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED)


def raw_only(t: onnx.TensorProto) -> bool:
    """`t` holds its data as raw bytes alone, of a type with a fixed item size."""
    return t.HasField("raw_data") and fixed_size(t.data_type) and not any(len(getattr(t, f)) for f in _TYPED_FIELDS)


def _sized_by_dims(t: onnx.TensorProto) -> bool:
    """`t`'s data is raw bytes as its dims and type say: held in the proto, or a stub's in its store."""
    return raw_only(t) or _weights.is_stub(t)


def tensor_bytes(t: onnx.TensorProto) -> int:
    """The bytes of `t`'s data: raw bytes (in the proto or a weight store) counted from dims and item size (not
    copied out; a tensor whose raw bytes do not match its dims is the checker's to refuse); otherwise its
    serialized size."""
    if not _sized_by_dims(t):
        return t.ByteSize()
    n = dims_bytes(t.data_type, t.dims)
    return t.ByteSize() if n is None else n


def dims_bytes(data_type: int, dims: Iterable[int]) -> int | None:
    """Raw bytes of a tensor of this type and dims; None for a type without a fixed item size or one this onnx
    does not know (the checker names it)."""
    if not fixed_size(data_type):
        return None
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except KeyError:
        return None
    n = 1
    for d in dims:
        n *= d
    return (n + 1) // 2 if data_type in _PACKED_4BIT else n * item


def _size_bound(model: onnx.ModelProto) -> int:
    """At least model.ByteSize() for a well-formed model: each initializer held as raw bytes alone by its dims,
    item size and an upper bound on its other fields and framing; everything else by ByteSize() per message
    (no weights there)."""
    g = model.graph
    text = lambda x: len(x.encode())  # noqa: E731 (UTF-8 bytes, not characters)
    total = 4096 + sum(6 + x.ByteSize() for x in (*model.opset_import, *model.metadata_props, *model.functions,
                                                   *model.training_info, *model.configuration))
    total += sum(map(text, (model.doc_string, model.producer_name, model.producer_version, model.domain,
                            g.name, g.doc_string)))
    total += sum(6 + x.ByteSize() for x in (*g.node, *g.input, *g.output, *g.value_info, *g.sparse_initializer,
                                            *g.quantization_annotation, *g.metadata_props))
    for t in g.initializer:
        if not _sized_by_dims(t):
            total += 6 + t.ByteSize()
            continue
        total += 64 + tensor_bytes(t) + text(t.name) + text(t.doc_string) + 11 * len(t.dims) + \
            t.segment.ByteSize() + sum(6 + x.ByteSize() for x in (*t.external_data, *t.metadata_props))
    return total


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def opset_of(model: onnx.ModelProto, domain: str = "") -> int | None:
    domains = DEFAULT_DOMAINS if domain in DEFAULT_DOMAINS else (domain,)
    versions = [o.version for o in model.opset_import if o.domain in domains]
    return max(versions) if versions else None


def _subgraphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(True for _ in _subgraphs(node))


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads from enclosing scopes: read inside but defined nowhere inside."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    for n in graph.node:
        defined.update(n.output)
    return {x for n in graph.node for x in node_reads(n) if x and x not in defined}


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads: its inputs plus outer-scope names used by its subgraphs (If/Loop/Scan
    bodies), which are real dependencies for ordering and fusion even though they are not inputs."""
    reads = [x for x in node.input if x]
    extra = set().union(*(_outer_names(g) for g in _subgraphs(node))) - set(reads)
    return reads + sorted(extra)


def topo_order(nodes: Sequence[onnx.NodeProto]) -> list[int]:
    """Indices of `nodes` in a topological order that keeps the given order wherever it is already
    valid (Kahn's algorithm, smallest index first). Raises ValueError naming a node on a cycle."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    deps = [{producer[x] for x in node_reads(n) if x in producer} for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    missing = [len(d) for d in deps]
    ready = [i for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(nodes):
        stuck = next(i for i, m in enumerate(missing) if m > 0)
        n = nodes[stuck]
        raise ValueError(f"the graph has a cycle through node {n.op_type} '{n.name or n.output[0]}'")
    return order


def splice(graph: onnx.GraphProto, replaced: Mapping[int, Sequence[onnx.NodeProto]]) -> None:
    """Node i of `graph` replaced by the nodes `replaced[i]` (none: removed), in place, in order."""
    nodes = [x for i, n in enumerate(graph.node) for x in replaced.get(i, (n,))]
    del graph.node[:]
    graph.node.extend(nodes)


def sort_nodes(graph: onnx.GraphProto) -> bool:
    """Put graph.node in topological order in place; returns whether anything moved."""
    order = topo_order(graph.node)
    if order == list(range(len(order))):
        return False
    nodes = [graph.node[i] for i in order]
    copies = [onnx.NodeProto() for _ in nodes]
    for c, n in zip(copies, nodes):
        c.CopyFrom(n)
    del graph.node[:]
    graph.node.extend(copies)
    return True


def _min_ir_for(column: int, version: int) -> int:
    """Smallest IR version whose release supports `version` of the opset in VERSION_TABLE `column`."""
    rows = [r for r in onnx.helper.VERSION_TABLE if r[column] >= version]
    return min(r[1] for r in rows) if rows else max(r[1] for r in onnx.helper.VERSION_TABLE)


def target_ir_version(model: onnx.ModelProto) -> int:
    """The IR version every written model gets: at least what its opsets need and what functions need,
    never below the original (newer IR features may be in use), capped at what ORT 1.31 reads."""
    need = [model.ir_version, MIN_IR_VERSION]
    if (v := opset_of(model, "")) is not None:
        need.append(_min_ir_for(2, v))
    if (v := opset_of(model, "ai.onnx.ml")) is not None:
        need.append(_min_ir_for(3, v))
    return min(max(need), MAX_IR_VERSION)


def save_external(model: onnx.ModelProto, path: str, location: str) -> None:
    """Write `model` (left unchanged) with its tensors in one external data file beside it."""
    clone = copy_model(model)  # onnx.save_model moves tensor bytes out of the proto it is given
    onnx.save_model(clone, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=1024)


def check_model(model: onnx.ModelProto, weights: bool = True) -> None:
    """onnx.checker.check_model(full_check=False); over 2 GB the checker only accepts a path, so the
    model is written with external data to a temporary folder first. A model with weight stubs
    (`rewriter.weights`) is always checked as with `weights=False`. `weights=False`: the checker reads
    the model with its large raw initializers emptied (`_weightless`), for a model whose tensors were checked
    at load or made from numpy arrays (the rewriter's output): its structure is checked without serializing
    every weight, nor writing them out over 2 GB."""
    if not weights or _weights.has_stubs(model):
        model = _weightless(model)
    with _ort_ops_checkable(model):
        if not is_large(model):
            onnx.checker.check_model(model, full_check=False)
            return
        with tempfile.TemporaryDirectory(prefix="ortfuse-check-") as tmp:
            path = os.path.join(tmp, "model.onnx")
            save_external(model, path, "model.onnx.data")
            onnx.checker.check_model(path, full_check=False)


@functools.cache
def ort_schemas() -> frozenset[tuple[str, str]] | None:
    """(domain, op) of every op ONNX Runtime defines, its own included; None where the build does not say."""
    return None if _ort_schema_list() is None else frozenset((d, name) for d, name, _ in _ort_schema_list())


@functools.cache
def _ort_schema_list() -> tuple[tuple[str, str, int], ...] | None:
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C

        return tuple((s.domain, s.name, s.since_version) for s in C.get_all_operator_schema())
    except (ImportError, AttributeError):
        return None


@functools.cache
def _ort_own_default_ops() -> dict[str, tuple[int, ...]]:
    """Op -> since versions of ORT's schemas in the default domain that ONNX has no schema for."""
    def onnx_has(name: str, version: int) -> bool:
        try:
            return onnx.defs.get_schema(name, version, "").since_version == version
        except onnx.defs.SchemaError:
            return False

    own: dict[str, tuple[int, ...]] = {}
    for d, name, v in _ort_schema_list() or ():
        if d in DEFAULT_DOMAINS and not onnx_has(name, v):
            own[name] = (*own.get(name, ()), v)
    return own


def deep_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """`nodes` and, after each, the nodes of its subgraphs (If/Loop/Scan bodies), recursively."""
    for n in nodes:
        yield n
        for sub in _subgraphs(n):
            yield from deep_nodes(sub.node)


def ort_default_domain_op(model: onnx.ModelProto, node: onnx.NodeProto,
                          opsets: Sequence[onnx.OperatorSetIdProto] | None = None) -> bool:
    """A default-domain op ONNX lacks at the model's opset (or `opsets`': a function's) that ORT defines
    itself (SimplifiedLayerNormalization; LayerNormalization before opset 17: ORT's transformers optimizer
    writes both)."""
    own = _ort_own_default_ops()
    if node.domain not in DEFAULT_DOMAINS or node.op_type not in own:
        return False
    versions = [o.version for o in (model.opset_import if opsets is None else opsets) if o.domain in DEFAULT_DOMAINS]
    opset = max(versions) if versions else onnx.defs.onnx_opset_version()
    try:
        onnx.defs.get_schema(node.op_type, opset, "")
        return False
    except onnx.defs.SchemaError:
        return min(own[node.op_type]) <= opset


_ORT_CHECKED_AS = "com.microsoft"  # a domain the checker takes on trust, as it does any but ONNX's own


@contextlib.contextmanager
def _ort_ops_checkable(model: onnx.ModelProto) -> Iterator[None]:
    """ONNX's checker refuses ORT's own default-domain ops; while this lasts, they are in ORT's contrib domain
    (in place, in the main graph, the model-local functions and their subgraphs; undone on exit)."""
    moved = [(n, n.domain) for n in deep_nodes(model.graph.node) if ort_default_domain_op(model, n)]
    imports: list[Any] = [model.opset_import] if moved else []
    for f in model.functions:
        here = [(n, n.domain) for n in deep_nodes(f.node) if ort_default_domain_op(model, n, f.opset_import)]
        moved += here
        imports += [f.opset_import] if here else []
    for n, _ in moved:
        n.domain = _ORT_CHECKED_AS
    added = [ops for ops in imports if not any(o.domain == _ORT_CHECKED_AS for o in ops)]
    for ops in added:
        ops.add(domain=_ORT_CHECKED_AS, version=1)
    try:
        yield
    finally:
        for n, domain in moved:
            n.domain = domain
        for ops in added:
            del ops[len(ops) - 1]


WEIGHTLESS_BYTES = 1024  # raw initializers above this are emptied for a structural check
_M = TypeVar("_M", onnx.ModelProto, onnx.GraphProto)


def copied_where(msg: _M, keep: Callable[[int], bool]) -> _M:
    """A new message of msg's type with the fields set in msg whose field number `keep` accepts (copied)."""
    out = type(msg)()
    for fd, value in msg.ListFields():
        if not keep(fd.number):
            continue
        if fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED:  # protobuf < 5.28
            getattr(out, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(out, fd.name).CopyFrom(value)
        else:
            setattr(out, fd.name, value)
    return out


_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number


def without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` but its graph's initializers (for a copy whose weights are stubbed: no weight copied)."""
    out = copied_where(model, lambda k: k != _GRAPH)
    out.graph.CopyFrom(copied_where(model.graph, lambda k: k != _INITIALIZER))
    return out


def emptied_for_check(t: onnx.TensorProto) -> bool:
    """A weight store stub, or raw bytes over WEIGHTLESS_BYTES: `_weightless` empties it."""
    return _weights.is_stub(t) or (raw_only(t) and tensor_bytes(t) > WEIGHTLESS_BYTES)


def _weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each initializer that holds over WEIGHTLESS_BYTES as raw bytes alone, and each weight store
    stub, replaced by an empty tensor of its name and type (the checker does not match initializers against their
    uses)."""
    out = without_initializers(model)
    for t in model.graph.initializer:
        if emptied_for_check(t):
            out.graph.initializer.add(name=t.name, data_type=t.data_type, dims=[0])
        else:
            out.graph.initializer.append(t)
    return out


def read_instead(nodes: Iterable[onnx.NodeProto], alias: Mapping[str, str]) -> None:
    """Each node reads alias[x] wherever it read x (in place; subgraph bodies are not rewritten)."""
    for node in nodes:
        for k, x in enumerate(node.input):
            if x in alias:
                node.input[k] = alias[x]
