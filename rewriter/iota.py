"""Index arithmetic built from Range: integer tensors whose value is an affine function of their position.

transformers 5 builds its attention masks from index functions traced over iotas: the padding mask is
`Gather(Flatten(mask), b * S + j)` with `b` = Range(0, B) and `j` = Range(0, S) unsqueezed to [B, 1, 1, 1]
and [1, 1, 1, S]. That gathers the whole mask at its own row-major index: a Reshape of it to [B, 1, 1, S].
Through torch.export the same mask is `GatherND(mask, stack(b, j))` over the iotas expanded to [B, 1, 1, S].
`fold_iota_gathers` rewrites both into that Reshape, so the index tensor (shape arithmetic ORT runs on
the CPU), its copy to the device and the Gather kernel all go, and the mask's element-wise ops can fuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import _infer, _proto
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.canonical import BROADCASTING, _static_target, remove_dead, shape_dims, vector_slice
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo, per_graph
from ortfuse.rewriter.shapes import assemble, merged_sizes

# An integer coefficient: value * the product of the named symbolic dims (names sorted).
Coef = tuple[int, tuple[str, ...]]
MAX_DEPTH = 24  # producers followed from one tensor; index arithmetic is a handful of nodes
_INT_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def coef_of(d: Dim) -> Coef:
    return (d, ()) if isinstance(d, int) else (1, (d,))


def coef_mul(a: Coef, b: Coef) -> Coef:
    return a[0] * b[0], tuple(sorted(a[1] + b[1]))


def stride(shape: tuple[Dim, ...], axis: int) -> Coef:
    """Row-major stride of `axis`: the product of the dims after it."""
    out: Coef = (1, ())
    for d in shape[axis + 1:]:
        out = coef_mul(out, coef_of(d))
    return out


@dataclass(frozen=True)
class Affine:
    """An integer tensor of `shape` whose element at position p is const + sum(coef * p[axis])."""
    shape: tuple[Dim, ...]
    terms: tuple[tuple[int, Coef], ...]  # (axis, coefficient), one per axis at most
    const: int


def const_int(g: Graph, t: str) -> Optional[int]:
    v = g.constants.get(t)
    if v is None or np.asarray(v).size != 1 or not np.issubdtype(np.asarray(v).dtype, np.integer):
        return None
    return int(np.asarray(v).reshape(()))


def _producer(g: Graph, t: str) -> Optional[onnx.NodeProto]:
    i = g.producer.get(t)
    node = None if i is None else g.nodes[i]
    return node if node is not None and node.domain in ("", "ai.onnx") else None


def scalar(g: Graph, t: str, depth: int = 0) -> Optional[Coef]:
    """A one-element integer tensor's value as a Coef: a constant, a dim read through Shape + Gather, Shape with
    start and end, or a one-entry Slice of Shape, and products of those (through Cast, Reshape, Squeeze,
    Unsqueeze), else None."""
    c = const_int(g, t)
    if c is not None:
        return c, ()
    node = _producer(g, t)
    if node is None or depth > MAX_DEPTH:
        return None
    op = node.op_type
    if op in ("Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze"):
        if op == "Cast" and attr(node, "to", None) not in _INT_TYPES:
            return None
        return scalar(g, node.input[0], depth + 1)
    if op == "Mul":
        a, b = (scalar(g, x, depth + 1) for x in node.input)
        return None if a is None or b is None else coef_mul(a, b)
    if op == "Gather":
        shape_node = _producer(g, node.input[0])
        k = const_int(g, node.input[1])
        if shape_node is None or shape_node.op_type != "Shape" or k is None:
            return None
        read = shape_dims(g, shape_node)
        return None if read is None or not -len(read) <= k < len(read) else coef_of(read[k])
    if op == "Shape":  # Shape(x, start=k, end=k+1): torch.export's sym_size
        read = shape_dims(g, node)
        return None if read is None or len(read) != 1 else coef_of(read[0])
    if op == "Slice":  # Slice(Shape(x), [k], [k + 1]): TorchScript's x.size(k)
        src, k = _producer(g, node.input[0]), _one_dim_slice(g, node)
        read = shape_dims(g, src) if src is not None and src.op_type == "Shape" and k is not None else None
        return None if read is None else coef_of(read[k])
    return None


def affine(g: Graph, t: str, depth: int = 0) -> Optional[Affine]:
    """Tensor t as an Affine when it is built from Range(c, n, d) with constant c and d by Unsqueeze, integer
    Casts, Add and Mul by a scalar (`scalar`), else None."""
    info = g.tensors.get(t)
    if info is None or info.shape is None or info.dtype not in _INT_TYPES or depth > MAX_DEPTH:
        return None
    c = const_int(g, t)
    if c is not None:
        return Affine(info.shape, (), c)
    node = _producer(g, t)
    if node is None:
        return None
    op = node.op_type
    if op == "Range":
        start, delta = const_int(g, node.input[0]), const_int(g, node.input[2])
        if start is None or delta is None or len(info.shape) != 1:
            return None
        return Affine(info.shape, ((0, (delta, ())),), start)
    if op in ("Cast", "Identity", "Expand"):  # Expand broadcasts: the value at each position is unchanged
        src = affine(g, node.input[0], depth + 1)
        if src is None:
            return None
        shift = len(info.shape) - len(src.shape)
        return Affine(info.shape, tuple((a + shift, cf) for a, cf in src.terms), src.const)
    if op == "Unsqueeze":
        src, axes = affine(g, node.input[0], depth + 1), g.axes(node)
        if src is None or not isinstance(axes, list):
            return None
        rank = len(info.shape)
        inserted = sorted(a % rank for a in axes)
        kept = [k for k in range(rank) if k not in inserted]  # where the input's axes land
        return Affine(info.shape, tuple((kept[a], cf) for a, cf in src.terms), src.const)
    if op == "Mul":
        for x, y in (node.input, reversed(node.input)):
            src, s = affine(g, x, depth + 1), scalar(g, y, depth + 1)
            if src is not None and s is not None and (src.const == 0 or not s[1]):
                shift = len(info.shape) - len(src.shape)
                return Affine(info.shape, tuple((a + shift, coef_mul(cf, s)) for a, cf in src.terms),
                              src.const * s[0])
        return None
    if op == "Add":
        a, b = (affine(g, x, depth + 1) for x in node.input)
        if a is None or b is None:
            return None
        terms: dict[int, Coef] = {}
        for src in (a, b):
            shift = len(info.shape) - len(src.shape)
            for ax, cf in src.terms:
                if ax + shift in terms:
                    return None  # two terms on one axis: not needed by any exporter we know
                terms[ax + shift] = cf
        return Affine(info.shape, tuple(sorted(terms.items())), a.const + b.const)
    return None


def _iota_gather(g: Graph, node: onnx.NodeProto) -> Optional[tuple[str, tuple[Dim, ...], list[int]]]:
    """(X, output shape, constant Reshape target) when `node` gathers every element of a row-major
    flattened X at its own index (see the module docstring), else None."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or attr(node, "axis", 0) != 0:
        return None
    flat = _producer(g, node.input[0])
    if flat is None or flat.op_type not in ("Flatten", "Reshape"):
        return None
    x = flat.input[0]
    xs = g.tensors[x].shape if x in g.tensors else None
    if not xs:
        return None
    if flat.op_type == "Flatten" and attr(flat, "axis", 1) == len(xs):
        tail: tuple[Dim, ...] = (1,)  # [N, 1]
    elif flat.op_type == "Reshape" and g.constants.get(flat.input[1]) is not None \
            and np.asarray(g.constants[flat.input[1]]).tolist() == [-1]:
        tail = ()  # [N]
    else:
        return None
    idx = affine(g, node.input[1])
    if idx is None or not _identity_index([idx], xs, [stride(xs, k) for k in range(len(xs))]):
        return None
    out_shape = tuple(idx.shape) + tail
    target = _static_target(xs, out_shape)
    return None if target is None else (x, out_shape, target)


def _identity_index(idx: list[Affine], xs: tuple[Dim, ...], strides: list[Coef]) -> bool:
    """Whether the index terms address X = xs row-major at each position's own coordinates: term k runs along
    its own axis of the index (in X's axis order) over X's dim k with coefficient strides[k], other index
    axes have size 1, nothing is added."""
    terms = [t for a in idx for t in a.terms]
    if any(a.const != 0 for a in idx) or len(terms) != len(xs) or not idx:
        return False
    axes = [a for a, _ in terms]
    if axes != sorted(axes) or len(set(axes)) != len(axes):
        return False  # the iotas in another order than X's axes: a transpose, not a Reshape
    shape = idx[0].shape
    if any(cf != strides[k] or shape[a] != xs[k] for k, (a, cf) in enumerate(terms)):
        return False
    return all(d == 1 for a, d in enumerate(shape) if a not in axes)


def _index_columns(g: Graph, t: str, r: int) -> Optional[list[Affine]]:
    """GatherND's indices [..., r] built as Concat(Unsqueeze(A_0, -1), ..., axis=-1): the A_k, else None."""
    node = _producer(g, t)
    info = g.tensors.get(t)
    if node is None or node.op_type != "Concat" or info is None or not info.shape or info.shape[-1] != r \
            or attr(node, "axis", 0) not in (-1, len(info.shape) - 1) or len(node.input) != r:
        return None
    cols = []
    for x in node.input:
        u = _producer(g, x)
        axes = None if u is None or u.op_type != "Unsqueeze" else g.axes(u)
        if not isinstance(axes, list) or [a % len(info.shape) for a in axes] != [len(info.shape) - 1]:
            return None
        a = affine(g, u.input[0])
        if a is None or tuple(a.shape) != tuple(info.shape[:-1]):
            return None
        cols.append(a)
    return cols


def _iota_gather_nd(g: Graph, node: onnx.NodeProto) -> Optional[tuple[str, tuple[Dim, ...], list[int]]]:
    """GatherND(X, indices) whose index tuple at each position is the position's own coordinates in X
    (torch.export's form of the padding mask: stacked iotas), as `_iota_gather`'s result, else None."""
    if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx") or attr(node, "batch_dims", 0) != 0:
        return None
    x = node.input[0]
    xs = g.tensors[x].shape if x in g.tensors else None
    if not xs:
        return None
    cols = _index_columns(g, node.input[1], len(xs))
    if cols is None:
        return None
    # column k is X's coordinate k: one term of coefficient 1 each
    if any(len(c.terms) != 1 for c in cols) or not _identity_index(cols, xs, [(1, ())] * len(xs)):
        return None
    out_shape = tuple(cols[0].shape)
    target = _static_target(xs, out_shape)
    return None if target is None else (x, out_shape, target)


def fold_iota_gathers(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Gathers and GatherNDs that became Reshapes). `g` is left untouched."""
    plans = {i: p for i, n in enumerate(g.nodes) if (p := _iota_gather(g, n) or _iota_gather_nd(g, n)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    for i, (x, out_shape, target) in plans.items():
        node = m.graph.node[i]
        out = node.output[0]
        name = f"{out}__ortfuse_shape"
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(target, np.int64), name))
        tensors[name] = TensorInfo(name, onnx.TensorProto.INT64, (len(target),))
        tensors[out] = TensorInfo(out, g.tensors[out].dtype, out_shape)
        reshape = onnx.helper.make_node("Reshape", [x, name], [out], name=f"{node.name or out}/iota_gather")
        node.CopyFrom(reshape)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(plans)


_TRILU_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                          onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})


def trilus_as_iotas(g: Graph) -> tuple[Graph, int]:
    """(new graph, Trilus rewritten). A causal mask as torch exports scaled_dot_product_attention(is_causal=True)
    over a dynamic sequence (TorchScript, and torch.export before opset 23): Trilu of a constant c expanded to
    [Sq, T], its target read through Shape (Expand(c, Concat(Sq, T)) or ConstantOfShape), becomes
    Where(j <= i + k, c, 0) over two iotas (j >= i + k for upper=1), which a kernel computes from its
    coordinates: the attention kernel reading the mask takes it in (`search.attention._computed_input`), where ORT
    ran shape ops on the host, an Expand and a Trilu kernel and a [Sq, T] tensor for every layer. A bool Trilu
    of true is the comparison itself. A constant target is left alone (static lengths: folded to a constant
    where small, `canonical.fold_constant_subgraphs`). `g` is left untouched."""
    plans = {i: p for i, n in enumerate(g.nodes) if (p := _trilu_plan(g, n)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    by_index: dict[int, list[onnx.NodeProto]] = {}
    for i, (value, rows, cols, k) in plans.items():
        node = g.nodes[i]
        out, dt = node.output[0], g.tensors[node.output[0]].dtype
        sq, t = g.tensors[out].shape
        base = node.name or out
        made: list[onnx.NodeProto] = []

        def add(op: str, ins: list[str], what: str, shape: tuple, dtype: int = onnx.TensorProto.INT64,
                **attrs) -> str:
            name = f"{base}/ortfuse_{what}"
            made.append(onnx.helper.make_node(op, ins, [name], name=name, **attrs))
            tensors[name] = TensorInfo(name, dtype, shape)
            return name

        def const(what: str, v: np.ndarray) -> str:
            name = f"{base}/ortfuse_{what}"
            m.graph.initializer.append(numpy_helper.from_array(v, name))
            tensors[name] = TensorInfo(name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            return name
        zero, one = const("zero", np.array(0, np.int64)), const("one", np.array(1, np.int64))
        i_ = add("Range", [zero, add("Squeeze", [rows], "rows", ()), one], "i", (sq,))
        i_ = add("Unsqueeze", [i_, const("axis", np.array([1], np.int64))], "i_col", (sq, 1))
        if k:
            i_ = add("Add", [i_, const("k", np.array(k, np.int64))], "i_k", (sq, 1))
        j = add("Range", [zero, add("Squeeze", [cols], "cols", ()), one], "j", (t,))
        compare = "GreaterOrEqual" if attr(node, "upper", 1) else "LessOrEqual"
        if dt == onnx.TensorProto.BOOL:  # (true where kept: the comparison itself; ORT has no bool Where)
            made.append(onnx.helper.make_node(compare, [j, i_], [out], name=base))
            by_index[i] = made
            continue
        seen = add(compare, [j, i_], "seen", (sq, t), onnx.TensorProto.BOOL)
        values = []
        for what, v in (("value", value), ("zero_value", np.zeros((), np.int64))):
            name = f"{base}/ortfuse_{what}"
            m.graph.initializer.append(
                onnx.helper.make_tensor(name, dt, [], [float(v)]) if dt == onnx.TensorProto.BFLOAT16 else
                numpy_helper.from_array(np.asarray(v).astype(onnx.helper.tensor_dtype_to_np_dtype(dt)), name))
            tensors[name] = TensorInfo(name, dt, ())
            values.append(name)
        made.append(onnx.helper.make_node("Where", [seen, *values], [out], name=base))
        by_index[i] = made
    _proto.splice(m.graph, by_index)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(plans)


def _trilu_plan(g: Graph, node: onnx.NodeProto) -> Optional[tuple[np.ndarray, str, str, int]]:
    """(the constant c, the [1] tensors holding Sq and T, k) of a Trilu `trilus_as_iotas` rewrites, else None."""
    if node.op_type != "Trilu" or node.domain not in ("", "ai.onnx"):
        return None
    k = const_int(g, node.input[1]) if len(node.input) > 1 and node.input[1] else 0
    src = _producer(g, node.input[0])
    out = g.tensors.get(node.output[0])
    if k is None or src is None or out is None or out.shape is None or len(out.shape) != 2 \
            or out.dtype not in _TRILU_TYPES:
        return None
    if k and g.fed(node.input[1]):
        return None  # (an initializer the user may feed: its value is not known here)
    if src.op_type == "Expand" and g.constant_size(src.input[0]) == 1 and not g.fed(src.input[0]):
        value, target = np.asarray(g.constants[src.input[0]]).reshape(-1)[0], src.input[1]
    elif src.op_type == "ConstantOfShape":
        t = attr(src, "value", None)
        value, target = (numpy_helper.to_array(t).reshape(-1)[0] if t is not None else 0.0), src.input[0]
    else:
        return None
    if out.dtype == onnx.TensorProto.BOOL and not bool(value):
        return None  # (all false: nothing to compare)
    cat = _producer(g, target)
    if target in g.constants or cat is None or cat.op_type != "Concat" or len(cat.input) != 2:
        return None
    if any(x not in g.tensors or g.tensors[x].dtype != onnx.TensorProto.INT64 or scalar(g, x) != coef_of(d)
           for x, d in zip(cat.input, out.shape)):
        return None  # (each a one-element tensor holding the output's dim, read through Shape)
    return value, cat.input[0], cat.input[1], k


_CLONABLE = frozenset({"Range", "Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity", "Add", "Sub", "Mul", "Neg",
                       "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Where"})


def iota_cone(g: Graph, t: str, memo: dict[str, Optional[frozenset[int]]]) -> Optional[frozenset[int]]:
    """The nodes computing t from constants and Range iotas alone (at least one Range), else None: copied for
    each reader (`isolate_iotas`), computed in the kernel that reads t (an attention's causal rule:
    `search.attention`). Inputs that only carry shapes (a Range's limit, an Unsqueeze's axes) are not followed:
    they stay shared."""
    if t in memo:
        return memo[t]
    memo[t] = None
    i = g.producer.get(t)
    node = g.nodes[i] if i is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _CLONABLE:
        return None
    data = [node.input[0]] if node.op_type in ("Unsqueeze", "Squeeze", "Reshape") else \
        [] if node.op_type == "Range" else [x for x in node.input if x]
    cone = {i}
    ranged = node.op_type == "Range"
    for x in data:
        if x in g.constants:
            continue
        sub = iota_cone(g, x, memo)
        if sub is None:
            return None
        cone |= sub
        ranged = ranged or any(g.nodes[k].op_type == "Range" for k in sub)
    memo[t] = frozenset(cone) if ranged else None
    return memo[t]


_BROADCASTING = BROADCASTING | {"PRelu"}  # where two dims meet


@per_graph
def broadcast_merged_dims(g: Graph) -> frozenset[str]:
    """Symbolic dims shape inference may have merged with another one. ORT's symbolic shape inference
    (auto_merge) gives two symbolic dims that meet in a broadcast one name, though at run time either may be
    1: their equality is an assumption, not a fact, and nothing may be rewritten on it. Found in the tool's
    own record (`_infer.recorded_merges`), where a graph input's inferred dim is not the name it was
    declared with, and where two names still meet. A computed dim merged into a declared one (BERT's
    Min(512, sequence) into sequence: equal unless the model fails anyway) leaves the declared one trusted."""
    merged: set[str] = set()
    declared = {d for d in declared_dims(g).values() if isinstance(d, str)}
    for k, v in _infer.recorded_merges(g.model).items():  # what the tool says it merged: k into v
        # a tensor labelled v may really have k; v itself stays what the inputs declaring it have, unless two
        # declared dims were merged (then neither is known)
        merged |= {k} | ({v} if isinstance(v, str) and k in declared else set())
    for (t, axis), d in declared_dims(g).items():
        e = g.tensors[t].shape[axis]
        if isinstance(e, str) and d != e:
            merged |= {e} | ({d} if isinstance(d, str) else set())
    for n in g.nodes:
        if n.op_type not in _BROADCASTING or n.domain not in ("", "ai.onnx"):
            continue
        shapes = [g.tensors[x].shape for x in n.input if x in g.tensors and g.tensors[x].shape is not None]
        rank = max((len(s) for s in shapes), default=0)
        for k in range(1, rank + 1):
            names = {s[-k] for s in shapes if len(s) >= k and isinstance(s[-k], str)}
            if len(names) > 1:
                merged |= names
    return frozenset(merged)


@per_graph
def declared_dims(g: Graph) -> dict[tuple[str, int], Optional[Dim]]:
    """(graph input, axis) -> the dim the model declares there (a size, a name, or None when unnamed), for
    the axes shape inference also knows."""
    out: dict[tuple[str, int], Optional[Dim]] = {}
    for v in g.model.graph.input:
        inferred = g.tensors[v.name].shape if v.name in g.tensors and v.name in g.graph_inputs else None
        dims = v.type.tensor_type.shape.dim if v.type.tensor_type.HasField("shape") else ()
        for axis, (d, _) in enumerate(zip(dims, inferred or ())):
            out[(v.name, axis)] = d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
    return out


@per_graph
def shared_declarers(g: Graph) -> dict[str, frozenset[str]]:
    """Dim names that two or more graph inputs declare -> those inputs. ONNX reads a shared name as equal
    sizes, but nothing checks what a user feeds: a kernel that binds the name at one input's axis and reads
    another's must check it (`lower.dim_checks`)."""
    by_name: dict[str, set[str]] = {}
    for (t, _), d in declared_dims(g).items():
        if isinstance(d, str):
            by_name.setdefault(d, set()).add(t)
    return {d: frozenset(ts) for d, ts in by_name.items() if len(ts) > 1}


@per_graph
def input_ancestry(g: Graph) -> dict[str, frozenset[str]]:
    """Tensor -> the graph inputs it is computed from (nodes are in topological order)."""
    anc: dict[str, frozenset[str]] = {t: frozenset((t,)) for t in g.graph_inputs}
    none: frozenset[str] = frozenset()
    for n in g.nodes:
        reads = none.union(*(anc.get(x, none) for x in n.input if x))
        for o in n.output:
            if o:
                anc[o] = reads
    return anc


def _one_dim_slice(g: Graph, node: onnx.NodeProto) -> Optional[int]:
    """k where a Slice of a shape tensor selects its one entry k (constant starts and ends over axis 0, unit
    step, e.g. torch's x.size(-2) as Slice(Shape(x), [-2], [-1])), else None."""
    at = vector_slice(g, node)
    shape = g.tensors[node.input[0]].shape if node.input[0] in g.tensors else None
    if at is None or not shape or not isinstance(shape[0], int):
        return None
    picked = range(shape[0])[at]
    return picked[0] if len(picked) == 1 else None


def trusted_dims(g: Graph) -> frozenset[str]:
    """Symbolic dims that are a graph input's declared dim and that shape inference merged with no other:
    every tensor inferred with such a dim has that input's size at run time."""
    return frozenset(d for t in g.graph_inputs for d in (g.tensors[t].shape or ()) if t in g.tensors
                     and isinstance(d, str)) - broadcast_merged_dims(g)


def isolate_iotas(g: Graph) -> tuple[Graph, int]:
    """Rewrites that let a kernel compute an iota instead of reading it (docs/design.md, "Index ops"):
    * a Range limit that is a static dim read through Shape becomes a constant (not a size shape inference
      merged a symbolic dim into);
    * a dim read as Gather(Shape(x), k) or Shape(x, start=k, end=k + 1) from an intermediate tensor x is
      read from a graph input with the same symbolic dim instead, so x need not be written just for its
      shape (not for dims shape inference merged in a broadcast: `broadcast_merged_dims`);
    * an iota (a Range and the ops on it) read by several nodes is copied for each reader, so each kernel
      can absorb its own copy. Copies that stay unfused are merged again by ORT's common-subexpression
      elimination.
    Returns (new graph, rewrites); `g` is left untouched."""
    trusted = trusted_dims(g)
    where = {d: (t, a) for t in g.graph_inputs for a, d in enumerate(g.tensors[t].shape or ())
             if t in g.tensors and d in trusted}
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    count = 0
    shape_of: dict[str, str] = {}
    head: list[onnx.NodeProto] = []
    def const_at(name: str, value: int, rank: int, like: Optional[str] = None) -> str:
        """An index constant, of the integer type of `like` (a Slice's starts, ends, axes and steps share one)."""
        dtype = g.tensors[like].dtype if like in g.tensors else onnx.TensorProto.INT64
        name += "_i32" if dtype == onnx.TensorProto.INT32 else ""
        if name not in tensors:
            arr = np.asarray(value, onnx.helper.tensor_dtype_to_np_dtype(dtype)).reshape((1,) * rank)
            m.graph.initializer.append(numpy_helper.from_array(arr, name))
            tensors[name] = TensorInfo(name, dtype, (1,) * rank)
        return name

    for i, node in enumerate(g.nodes):
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.attribute \
                and node.input[0] not in g.graph_inputs:  # Shape(x, start=k, end=k + 1): torch.export's
            read = shape_dims(g, node)
            if read is not None and len(read) == 1 and read[0] in where:
                x, axis = where[read[0]]
                m.graph.node[i].input[0] = x
                del m.graph.node[i].attribute[:]
                m.graph.node[i].attribute.extend([onnx.helper.make_attribute("start", axis),
                                                  onnx.helper.make_attribute("end", axis + 1)])
                count += 1
            continue
        src = _producer(g, node.input[0]) if node.op_type in ("Gather", "Slice") and node.input else None
        k = (const_int(g, node.input[1]) if node.op_type == "Gather" else _one_dim_slice(g, node)) \
            if src is not None else None
        if src is None or src.op_type != "Shape" or k is None or src.input[0] in g.graph_inputs:
            continue
        dims = shape_dims(g, src)  # (torch.export writes Shape(x, start=0) for the whole shape)
        if not dims or not -len(dims) <= k < len(dims) or dims[k] not in where:
            continue
        x, axis = where[dims[k]]
        if x not in shape_of:
            shape_of[x] = f"{x}__ortfuse_shape_of"
            tensors[shape_of[x]] = TensorInfo(shape_of[x], onnx.TensorProto.INT64, (len(g.tensors[x].shape),))
            head.append(onnx.helper.make_node("Shape", [x], [shape_of[x]], name=f"{x}/ortfuse_shape"))
        if node.op_type == "Slice":  # Slice(shape, [axis], [axis + 1], [0]): the dim as a 1-element tensor
            m.graph.node[i].input[0] = shape_of[x]
            starts = node.input[1]
            m.graph.node[i].input[1] = const_at(f"{shape_of[x]}_{axis}_1d", axis, 1, starts)
            m.graph.node[i].input[2] = const_at(f"{shape_of[x]}_{axis + 1}_1d", axis + 1, 1, starts)
            count += 1
            continue
        rank = np.asarray(g.constants[node.input[1]]).ndim  # the index is a scalar or [k]: keep the output's rank
        pos = const_at(f"{shape_of[x]}_{axis}" + ("_1d" if rank else ""), axis, rank)
        m.graph.node[i].input[0], m.graph.node[i].input[1] = shape_of[x], pos
        count += 1
    static: dict[int, str] = {}  # Range node -> its constant limit
    merged = merged_sizes(g)  # a static size a symbolic dim was merged into may be another at run time
    for i, node in enumerate(g.nodes):
        limit = node.input[1] if node.op_type == "Range" and node.domain in ("", "ai.onnx") else None
        value = scalar(g, limit) if limit and limit not in g.constants and limit in g.tensors else None
        if value is not None and not value[1] and value[0] not in merged:
            name = f"{limit}__ortfuse_static"
            if name not in tensors:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(g.tensors[limit].dtype)
                m.graph.initializer.append(numpy_helper.from_array(np.asarray(value[0], dtype), name))
                tensors[name] = TensorInfo(name, g.tensors[limit].dtype, ())
            m.graph.node[i].input[1] = static[i] = name
            count += 1
    memo: dict[str, Optional[frozenset[int]]] = {}
    shared: dict[int, dict[str, frozenset[int]]] = {}  # reader -> the shared iotas it gets copies of (cones)
    for t, readers in g.consumers.items():
        cone = iota_cone(g, t, memo) if len(readers) > 1 else None
        for r in readers[1:] if cone is not None else ():
            shared.setdefault(r, {})[t] = cone
    copies: dict[int, list[onnx.NodeProto]] = {}  # node index -> copies to insert before it
    for r, cones in shared.items():  # one copy of the union of a reader's cones: overlapping cones share it
        rename: dict[str, str] = {}
        for j in sorted(frozenset().union(*cones.values())):
            c = onnx.NodeProto()
            c.CopyFrom(g.nodes[j])  # as it was: a cone node that is itself a later reader reads the original
            if j in static:
                c.input[1] = static[j]
            c.name = f"{c.name or c.output[0]}/ortfuse_copy{r}"
            for s, x in enumerate(c.input):
                c.input[s] = rename.get(x, x)
            for s, o in enumerate(c.output):
                rename[o] = c.output[s] = f"{o}__ortfuse_copy{r}"
                tensors[rename[o]] = TensorInfo(rename[o], g.tensors[o].dtype, g.tensors[o].shape)
            copies.setdefault(r, []).append(c)
        reader = m.graph.node[r]
        for s, x in enumerate(reader.input):
            if x in cones:
                reader.input[s] = rename[x]
        count += len(cones)
    if not count:
        return g, 0
    nodes = head + [c for i, n in enumerate(m.graph.node) for c in (*copies.get(i, ()), n)]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), count
