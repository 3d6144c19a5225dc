"""Writing a model: fused regions become `ortfuse` nodes backed by model-local functions holding the
original sub-graph (docs/design.md, "The fused node"), and an atomic save."""
from __future__ import annotations

import heapq
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from ortfuse.errors import InputError
from ortfuse.rewriter import _infer, _proto, weights
from ortfuse.rewriter.attrs import inverse_perm
from ortfuse.rewriter.layernorm_fold import LayerNormFold, fold_constants
from ortfuse.rewriter.graph import Graph

DOMAIN = "ortfuse"
DOMAIN_VERSION = 1


@dataclass(frozen=True)
class FusedNode:
    name: str  # node name, e.g. "ortfuse_region_3"
    op_type: str  # "Fused_<10 hex>"; also the FunctionProto name
    node_indices: tuple[int, ...]  # indices into graph.nodes that this node replaces
    inputs: tuple[str, ...]  # kernel arguments in order: tensors defined outside the region
    outputs: tuple[str, ...]  # tensors produced in the region and used outside it, or graph outputs
    attributes: tuple[onnx.AttributeProto, ...] = ()
    # constant inputs the kernel reads transposed: (tensor, perm). The node is given a new initializer
    # holding the transposed data; its function transposes it back before the original sub-graph.
    input_perms: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (tensor, parts): a shape tensor the region reads (a Range's length, an Expand's target) made of dims
    # of the inputs: part (k, axis) = inputs[k].shape[axis], (-1, v) = v; a rank-0 tensor has one part. The
    # kernel knows them as dims; the function body rebuilds them from the inputs' shapes (Shape + Gather,
    # Concat), so the shape arithmetic outside the region that computed them can go
    shape_reads: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    # a LayerNorm folded into the region's GEMM: the weight, gamma, beta and GEMM-bias slots carry folded
    # constants (new initializers) on which the function body computes the same (rewriter/layernorm_fold.py)
    ln_fold: Optional[LayerNormFold] = None


def replace(graph: Graph, fused: Sequence[FusedNode], stubs: bool = False) -> onnx.ModelProto:
    """A new model with each region's nodes replaced by its fused node. A graph over a weight store's stubs
    (rewriter.weights) gives a model with its weights filled, or with `stubs` one that keeps them (the caller
    holds the store: `compile_model`). Raises ValueError when the FusedNode set is inconsistent with the graph
    (an internal error of the caller)."""
    fused = tuple(fused)
    owner = _validate(graph, fused)
    model = _proto.copy_model(graph.model)
    merged = _infer.recorded_merges(model)
    _infer.record_merges(model, {})  # the rewriter's note, not the user's metadata
    g = model.graph
    if merged:  # inferred shapes then rest on assumed equalities: ORT's optimizers must not take them as facts
        del g.value_info[:]  # (its Expand elimination would drop an Expand that broadcasts a merged dim)
    taken = set(graph.tensors) | {t.name for t in g.initializer}  # names a new initializer must avoid
    permuted = _permuted_constants(graph, fused, g, taken)
    folded = _folded_constants(graph, fused, g, taken)
    new_nodes = [_fused_node(fused[k], permuted, folded.get(k, {})) if kind == "fused" else graph.nodes[k]
                 for kind, k in _contracted_order(graph, fused, owner)]
    del g.node[:]
    g.node.extend(new_nodes)
    _add_functions(model, graph, fused)
    _drop_dead(g, {x for f in fused for i in f.node_indices for x in _proto.node_reads(graph.nodes[i])})
    _prune_value_info(g)
    weights.set_aside(model)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=DOMAIN, version=DOMAIN_VERSION)
    model.ir_version = _proto.target_ir_version(model)
    try:
        _proto.check_model(model, weights=False)  # the weights were checked at load, or come from numpy
    except onnx.checker.ValidationError as e:
        raise ValueError(f"replace produced an invalid model: {str(e).strip().splitlines()[0]}") from None
    return model if stubs or not weights.has_stubs(model) else weights.materialized(model)


# ---- validation --------------------------------------------------------------------------------------

def _validate(graph: Graph, fused: tuple[FusedNode, ...]) -> dict[int, int]:
    """Regions are disjoint, non-empty, free of control flow, and their inputs/outputs match what the
    region's nodes read and produce. Returns node index -> region index."""
    owner: dict[int, int] = {}
    names = {n.name for n in graph.nodes if n.name}
    for k, f in enumerate(fused):
        if not f.node_indices:
            raise ValueError(f"{f.name}: empty region")
        if not f.op_type or f.name in names:
            raise ValueError(f"{f.name}: missing op_type or node name already in use")
        names.add(f.name)
        for i in f.node_indices:
            if not 0 <= i < len(graph.nodes):
                raise ValueError(f"{f.name}: node index {i} out of range")
            if i in owner:
                raise ValueError(f"{f.name} and {fused[owner[i]].name} both contain {graph.node_label(i)}")
            if _proto.has_subgraph(graph.nodes[i]):
                raise ValueError(f"{f.name}: control-flow node {graph.node_label(i)} cannot be fused")
            owner[i] = k
        _check_interface(graph, f)
    return owner


def _check_interface(graph: Graph, f: FusedNode) -> None:
    region = set(f.node_indices)
    produced = {o for i in region for o in graph.nodes[i].output if o}
    read = {x for i in region for x in _proto.node_reads(graph.nodes[i])}
    for what, names in (("inputs", f.inputs), ("outputs", f.outputs)):
        if len(set(names)) != len(names):
            raise ValueError(f"{f.name}: duplicate {what}")
    for x in f.inputs:
        if x in produced or x not in read:
            raise ValueError(f"{f.name}: input '{x}' is not read from outside the region")
    for x, parts in f.shape_reads:
        for k, axis in parts:
            shape = graph.tensors[f.inputs[k]].shape if 0 <= k < len(f.inputs) and f.inputs[k] in graph.tensors else None
            if x not in read or x in produced or not parts or (k >= 0 and (shape is None or not 0 <= axis < len(shape))) \
                    or k < -1 or (not graph.tensors[x].shape and len(parts) != 1):
                raise ValueError(f"{f.name}: shape read '{x}' <- {parts} does not fit the region")
    for x in read - produced - set(f.inputs) - {x for x, _ in f.shape_reads}:
        if x not in graph.constants:
            raise ValueError(f"{f.name}: '{x}' is read by the region but is neither an input nor a constant")
    for x in f.outputs:
        if x not in produced:
            raise ValueError(f"{f.name}: output '{x}' is not produced by the region")
    graph_outputs = set(graph.graph_outputs)
    for x in produced - set(f.outputs):
        if x in graph_outputs or any(c not in region for c in graph.consumers.get(x, ())):
            raise ValueError(f"{f.name}: '{x}' is used outside the region but is not an output")


def _contracted_order(graph: Graph, fused: tuple[FusedNode, ...], owner: dict[int, int]) -> list[tuple[str, int]]:
    """Topological order of the graph with each region contracted to one node, keeping the original
    order where possible (a region sits at its first node's place). ValueError on a cycle."""
    def unit(i: int) -> tuple[str, int]:
        return ("fused", owner[i]) if i in owner else ("node", i)

    units = {unit(i): i for i in reversed(range(len(graph.nodes)))}  # unit -> its smallest node index
    deps: dict[tuple[str, int], set[tuple[str, int]]] = {u: set() for u in units}
    for i, node in enumerate(graph.nodes):
        for x in _proto.node_reads(node):
            if x in graph.producer and unit(graph.producer[x]) != unit(i):
                deps[unit(i)].add(unit(graph.producer[x]))
    users: dict[tuple[str, int], list[tuple[str, int]]] = {u: [] for u in units}
    for u, ds in deps.items():
        for d in ds:
            users[d].append(u)
    missing = {u: len(ds) for u, ds in deps.items()}
    ready = [(units[u], u) for u, m in missing.items() if m == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in users[u]:
            missing[v] -= 1
            if missing[v] == 0:
                heapq.heappush(ready, (units[v], v))
    if len(order) < len(units):
        stuck = [fused[k].name for kind, k in units if kind == "fused" and missing[(kind, k)] > 0]
        raise ValueError(f"contracting the regions creates a cycle (through {', '.join(stuck) or 'nodes'})")
    return order


# ---- building ----------------------------------------------------------------------------------------

def _fused_node(f: FusedNode, permuted: dict[tuple[str, tuple[int, ...]], str],
                folded: dict[str, str]) -> onnx.NodeProto:
    perm_of = dict(f.input_perms)
    inputs = [folded[x] if x in folded else permuted[(x, perm_of[x])] if x in perm_of else x for x in f.inputs]
    node = onnx.helper.make_node(f.op_type, inputs, list(f.outputs), name=f.name, domain=DOMAIN)
    node.attribute.extend(f.attributes)
    return node


def _new_initializer(g: onnx.GraphProto, taken: set[str], name: str, data: np.ndarray, dtype: int,
                     what: str) -> str:
    """Appends `data` to `g` as an initializer named `name` (suffixed until unused) of element type `dtype`
    (ValueError naming `what` if numpy would store another); returns its name."""
    while name in taken:
        name += "_"
    tensor = numpy_helper.from_array(np.ascontiguousarray(data), name)
    if tensor.data_type != dtype:
        raise ValueError(f"{what} would change dtype")
    g.initializer.append(tensor)
    taken.add(name)
    return name


def _permuted_constants(graph: Graph, fused: tuple[FusedNode, ...], g: onnx.GraphProto,
                        taken: set[str]) -> dict[tuple[str, tuple[int, ...]], str]:
    """Each (constant, perm) some fused node reads as a new initializer in `g`: {(name, perm): new name}."""
    out: dict[tuple[str, tuple[int, ...]], str] = {}
    for f in fused:
        for name, perm in f.input_perms:
            if (name, perm) in out or (f.ln_fold is not None and name == f.ln_fold.weight):
                continue  # (a folded weight is transposed with the fold's constants)
            if name not in f.inputs or name not in graph.constants:
                raise ValueError(f"{f.name}: '{name}' is not a constant input of the region")
            data = np.asarray(graph.constants[name])
            if sorted(perm) != list(range(data.ndim)):
                raise ValueError(f"{f.name}: {perm} is not a permutation of '{name}' (rank {data.ndim})")
            out[(name, perm)] = _new_initializer(g, taken, f"{name}__ortfuse_t{''.join(map(str, perm))}",
                                                 np.transpose(data, perm), graph.tensors[name].dtype,
                                                 f"{f.name}: '{name}' transposed")
    return out


def _folded_constants(graph: Graph, fused: tuple[FusedNode, ...], g: onnx.GraphProto,
                      taken: set[str]) -> dict[int, dict[str, str]]:
    """The new initializers of each LayerNorm fold, by fused node: {slot tensor: new initializer}."""
    out: dict[int, dict[str, str]] = {}
    folds = [(i, f) for i, f in enumerate(fused) if f.ln_fold is not None]
    if not folds:
        return out
    for _, f in folds:
        fold = f.ln_fold
        slots = [t for t in (fold.weight, fold.scale, fold.bias, fold.gemm_bias) if t]
        if any(t not in f.inputs or t not in graph.constants for t in slots) or len(set(slots)) != len(slots) or \
                any(x in dict(f.input_perms) for x in slots if x != fold.weight):
            raise ValueError(f"{f.name}: the LayerNorm fold does not fit the region's inputs")
    with ThreadPoolExecutor(max_workers=max(1, min(len(folds), os.cpu_count() or 1))) as pool:  # numpy, GIL free
        made = list(pool.map(lambda f: fold_constants(f[1].ln_fold, graph.constants), folds))
    for (i, f), data_of in zip(folds, made):
        weight = f.ln_fold.weight
        perm = dict(f.input_perms).get(weight)
        if perm is not None:  # the kernel reads W'' in another layout (the TMA mainloop's [N][K])
            data_of[weight] = np.transpose(data_of[weight], perm)
        out[i] = {slot: _new_initializer(g, taken, f"{slot}__ortfuse_ln" + ("" if slot == weight else f"_{weight}"),
                                         data, graph.tensors[slot].dtype, f"{f.name}: the folded '{slot}'")
                  for slot, data in data_of.items()}
    return out


def _add_functions(model: onnx.ModelProto, graph: Graph, fused: tuple[FusedNode, ...]) -> None:
    """One function per op_type. Regions sharing an op_type (same kernel) must have the same body,
    which canonical tensor names make comparable."""
    existing = {(fn.domain, fn.name): fn for fn in model.functions}
    opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    for f in fused:
        fn = _function(graph, f, opsets)
        prior = existing.get((DOMAIN, f.op_type))
        if prior is None:
            model.functions.append(fn)
            existing[(DOMAIN, f.op_type)] = fn
        elif prior != fn:
            raise ValueError(f"{f.name}: op_type {f.op_type} is already used for a different sub-graph")


def _function(graph: Graph, f: FusedNode, opsets) -> onnx.FunctionProto:
    """Body = the region's nodes (graph order is topological) with tensors renamed in0.., out0..,
    t0..; constants read but not passed become Constant nodes at the top of the body."""
    rename = {x: f"in{k}" for k, x in enumerate(f.inputs)} | {x: f"out{k}" for k, x in enumerate(f.outputs)}
    region = sorted(f.node_indices)
    produced = {o for i in region for o in graph.nodes[i].output if o}
    body: list[onnx.NodeProto] = []
    for x, perm in f.input_perms:  # the node is given the transposed constant: transpose it back
        k = f.inputs.index(x)
        body.append(onnx.helper.make_node("Transpose", [f"in{k}"], [f"p{k}"], perm=list(inverse_perm(perm))))
        rename[x] = f"p{k}"
    for x, parts in f.shape_reads:  # dims of inputs, as the shape tensor x the region reads
        rename[x] = _shape_read(body, graph.tensors[x], parts)
    for i in region:
        for x in graph.nodes[i].input:
            if x and x not in rename and x not in produced:
                rename[x] = f"c{len(body)}"
                body.append(_constant_node(graph, x, rename[x]))
    for i in region:
        node = onnx.NodeProto()
        node.CopyFrom(graph.nodes[i])
        node.name = ""  # names would make identical regions' bodies differ
        for seq in (node.input, node.output):
            for j, x in enumerate(seq):
                if x:
                    seq[j] = rename.setdefault(x, f"t{len(rename)}")
        body.append(node)
    return onnx.helper.make_function(DOMAIN, f.op_type, [f"in{k}" for k in range(len(f.inputs))],
                                     [f"out{k}" for k in range(len(f.outputs))], body, opsets)


def _shape_read(body: list[onnx.NodeProto], info, parts: tuple[tuple[int, int], ...]) -> str:
    """Appends to `body` the nodes computing a shape tensor of `info`'s rank and type from the function's
    inputs' shapes: one dim of an input (Shape + Gather), a constant, or a vector of those (Concat)."""
    stem = f"s{len(body)}"
    vector = bool(info.shape)
    pieces = []
    for j, (k, axis) in enumerate(parts):
        name = f"{stem}_{j}"
        index = np.asarray(axis, np.int64).reshape((1,) if vector else ())
        if k < 0:
            body.append(onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(index)))
        else:
            body.append(onnx.helper.make_node("Shape", [f"in{k}"], [f"{name}_shape"]))
            body.append(onnx.helper.make_node("Constant", [], [f"{name}_axis"], value=numpy_helper.from_array(index)))
            body.append(onnx.helper.make_node("Gather", [f"{name}_shape", f"{name}_axis"], [name]))
        pieces.append(name)
    out = pieces[0]
    if vector and len(pieces) > 1:
        out = f"{stem}_vec"
        body.append(onnx.helper.make_node("Concat", pieces, [out], axis=0))
    if info.dtype != onnx.TensorProto.INT64:
        body.append(onnx.helper.make_node("Cast", [out], [f"{stem}_cast"], to=info.dtype))
        out = f"{stem}_cast"
    return out


def _constant_node(graph: Graph, name: str, new_name: str) -> onnx.NodeProto:
    """A Constant node carrying the exact proto of an initializer or Constant node (dtype preserved)."""
    if name in graph.producer:
        node = onnx.NodeProto()
        node.CopyFrom(graph.nodes[graph.producer[name]])
        del node.output[:]
        node.output.append(new_name)
        node.name = ""
        return node
    tensor = next(t for t in graph.model.graph.initializer if t.name == name)
    value = onnx.TensorProto()
    value.CopyFrom(weights.filled(tensor))
    value.name = new_name
    return onnx.helper.make_node("Constant", [], [new_name], value=value)


def _drop_dead(g: onnx.GraphProto, candidates: set[str]) -> None:
    """Initializers and nodes the regions read that nothing reads any more: Constants, and the shape
    arithmetic of a Range the kernel now computes itself (followed back through the nodes removed).
    Initializers that are also graph inputs (IR < 4 style) stay: removing them would change the model's
    interface."""
    inputs = {v.name for v in g.input}
    while True:
        used = {x for n in g.node for x in _proto.node_reads(n)} | {v.name for v in g.output}
        dead = candidates - used - inputs
        gone = [n.domain in _proto.DEFAULT_DOMAINS and not _proto.has_subgraph(n) and any(o in dead for o in n.output)
                and not any(o and o in used for o in n.output) for n in g.node]
        if not any(gone):
            break
        candidates = candidates | {x for n, x_gone in zip(g.node, gone) if x_gone for x in _proto.node_reads(n)}
        keep = [n for n, x_gone in zip(g.node, gone) if not x_gone]
        del g.node[:]
        g.node.extend(keep)
    keep_init = [t for t in g.initializer if t.name not in dead]
    if len(keep_init) < len(g.initializer):
        del g.initializer[:]  # rebuilt: repeated-field deletion by index is quadratic on big models
        g.initializer.extend(keep_init)


def _prune_value_info(g: onnx.GraphProto) -> None:
    """Drop value_info of tensors that vanished inside regions (the fused outputs' entries stay)."""
    alive = {o for n in g.node for o in n.output}
    keep = [vi for vi in g.value_info if vi.name in alive]
    del g.value_info[:]
    g.value_info.extend(keep)


# ---- saving ------------------------------------------------------------------------------------------

def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write atomically (temporary file in the target folder, then os.replace) with the IR version
    ORT reads; over 2 GB the tensors go to "<name>.data" beside the model. `model` is not modified."""
    path = Path(os.fspath(path))
    if not path.parent.is_dir():
        raise InputError(f"{path}: folder does not exist")
    try:
        if _proto.is_large(model):
            _save_large(model, path)
        else:
            _save_small(model, path)
    except OSError as e:
        raise InputError(f"{path}: cannot write ({e.strerror or e})") from None


def _save_small(model: onnx.ModelProto, path: Path) -> None:
    """Serialized straight into the file, a weight store's stubs filled one at a time (weights.write_materialized)."""
    original = model.ir_version
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            model.ir_version = _proto.target_ir_version(model)
            try:
                if weights.has_stubs(model):
                    weights.write_materialized(model, f)
                else:
                    f.write(model.SerializeToString())
            finally:
                model.ir_version = original
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


EXTERNAL_BYTES = 1024  # tensors above this go to the data file of a model over 2 GB
ALIGN_FROM, ALIGNMENT = 1 << 20, 1 << 16  # tensors of 1 MiB or more start at 64 KiB offsets (ORT maps them)


def _save_large(model: onnx.ModelProto, path: Path) -> None:
    """The model beside "<name>.data", which receives every tensor over EXTERNAL_BYTES: graph initializers are
    streamed from `model` (a weight store's stubs from the store) without copying the model's weights."""
    data_name = f"{path.name}.data"
    tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        out = _proto.without_initializers(model)
        out.ir_version = _proto.target_ir_version(out)
        with open(os.path.join(tmp, data_name), "wb") as f:
            for t in model.graph.initializer:
                if not (_proto.raw_only(t) or weights.is_stub(t)) or _proto.tensor_bytes(t) <= EXTERNAL_BYTES:
                    out.graph.initializer.append(weights.filled(t))
                    continue
                stored = weights.bare(t)
                data = weights.buffer_of(t) if weights.is_stub(t) else t.raw_data
                _write_external(f, stored, memoryview(data), data_name)
                out.graph.initializer.append(stored)
            for t in external_data_helper._get_all_tensors(out):  # Constant values, subgraphs' initializers
                if _proto.raw_only(t) and _proto.tensor_bytes(t) > EXTERNAL_BYTES:
                    data = t.raw_data
                    t.ClearField("raw_data")
                    _write_external(f, t, memoryview(data), data_name)
            f.flush()
            os.fsync(f.fileno())
            wrote = f.tell() > 0
        _save_small(out, Path(tmp) / path.name)
        if wrote:  # absent when every tensor is under EXTERNAL_BYTES
            os.replace(os.path.join(tmp, data_name), path.parent / data_name)  # data first: the model names it
        os.replace(os.path.join(tmp, path.name), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_external(f, t: onnx.TensorProto, data: memoryview, location: str) -> None:
    """Appends `data` to the data file `f` and points `t` (without data of its own) at it."""
    offset = f.tell()
    if data.nbytes >= ALIGN_FROM and offset % ALIGNMENT:
        f.write(b"\0" * (ALIGNMENT - offset % ALIGNMENT))
        offset = f.tell()
    f.write(data)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", data.nbytes)):
        t.external_data.add(key=key, value=str(value))
